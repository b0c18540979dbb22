//! Would a hot-first, neuron-major layout inside each expert let a neuron mask read a contiguous
//! prefix of the expert? Measured on a MoE GGUF in RAM (docs/RESULTS.md section 8):
//! 1. calibration: the last `CAL` windows of the text; per layer, expert and neuron, the share of
//!    the tokens routed to the expert for which the neuron's |act(gate)·up| is at least that
//!    token's median in the expert (the `.gst` calibration's definition); neurons then ordered
//!    hottest first within each expert;
//! 2. on the first `EVAL` windows (disjoint), for each sparsity: the top-K exact mask inside each
//!    routed expert — how long a hot-first prefix must be to hold every neuron it keeps (what a
//!    prefix read would fetch) and how many of them the prefix of the kept count holds — and the
//!    perplexity of that mask, of a static mask keeping the hottest neurons (a prefix of the
//!    kept count: what a prefix read alone computes), and of no mask.
//!
//! `cargo run --release --example expert_prefix -- MODEL.gguf TEXT [CAL] [EVAL]`

use std::sync::Mutex;

use gatestream::backend::ops::log_sum_exp;
use gatestream::kv::KvCache;
use gatestream::model::forward::{FfnHooks, FfnMask};
use gatestream::model::{LoadOptions, Model};
use gatestream::perplexity::window_tokens;

const CTX: usize = 512;

/// Which expert each `apply` call of a layer computes: the routed experts, ascending (the order
/// the in-RAM forward pass runs them in).
#[derive(Default)]
struct Calls {
    experts: Vec<usize>,
    next: usize,
}

impl Calls {
    fn route(&mut self, routes: &[(usize, f32)]) {
        self.experts = routes.iter().map(|r| r.0).collect();
        self.experts.sort_unstable();
        self.experts.dedup();
        self.next = 0;
    }
    fn take(&mut self) -> usize {
        self.next += 1;
        self.experts[self.next - 1]
    }
}

enum Kind {
    /// Count active neurons per (layer, expert).
    Calibrate,
    /// Keep each token's top `keep` neurons by |hact|; record prefix statistics.
    TopK,
    /// Keep the `keep` hottest neurons of each expert.
    Static,
}

struct Probe {
    kind: Kind,
    keep: usize,
    calls: Mutex<Vec<Calls>>,
    /// [layer][expert][neuron] active counts, and tokens seen per [layer][expert].
    active: Mutex<Vec<Vec<Vec<u64>>>>,
    seen: Mutex<Vec<Vec<u64>>>,
    /// [layer][expert][neuron] rank in hot-first order.
    rank: Vec<Vec<Vec<usize>>>,
    /// Sum over (token, routed expert) of the prefix needed and of the kept neurons inside the
    /// prefix of `keep`; and the count.
    stats: Mutex<(f64, f64, u64)>,
}

impl FfnMask for Probe {
    fn apply(&self, layer: usize, _xn: &[f32], _gate: &[f32], _up: &[f32], hact: &mut [f32]) {
        let expert = self.calls.lock().unwrap()[layer].take();
        let ffn = self.active.lock().unwrap()[layer][expert].len();
        for row in hact.chunks_exact_mut(ffn) {
            match self.kind {
                Kind::Calibrate => {
                    let mut s: Vec<f32> = row.iter().map(|v| v.abs()).collect();
                    let median = *s.select_nth_unstable_by(ffn / 2, f32::total_cmp).1;
                    let mut active = self.active.lock().unwrap();
                    for (n, v) in row.iter().enumerate() {
                        if v.abs() >= median {
                            active[layer][expert][n] += 1;
                        }
                    }
                    self.seen.lock().unwrap()[layer][expert] += 1;
                }
                Kind::TopK => {
                    let mut order: Vec<usize> = (0..ffn).collect();
                    order.sort_by(|&a, &b| row[b].abs().total_cmp(&row[a].abs()).then(a.cmp(&b)));
                    let rank = &self.rank[layer][expert];
                    let kept = &order[..self.keep];
                    let prefix = kept.iter().map(|&n| rank[n] + 1).max().unwrap_or(0);
                    let inside = kept.iter().filter(|&&n| rank[n] < self.keep).count();
                    let mut st = self.stats.lock().unwrap();
                    st.0 += prefix as f64 / ffn as f64;
                    st.1 += inside as f64 / self.keep as f64;
                    st.2 += 1;
                    for &n in &order[self.keep..] {
                        row[n] = 0.0;
                    }
                }
                Kind::Static => {
                    let rank = &self.rank[layer][expert];
                    for (n, v) in row.iter_mut().enumerate() {
                        if rank[n] >= self.keep {
                            *v = 0.0;
                        }
                    }
                }
            }
        }
    }
    fn inside_experts(&self) -> bool {
        true
    }
    fn routed(&self, layer: usize, _n_used: usize, routes: &[(usize, f32)]) {
        self.calls.lock().unwrap()[layer].route(routes);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: expert_prefix MODEL.gguf TEXT [CAL windows, 4] [EVAL windows, 5]");
        std::process::exit(2);
    }
    let model = Model::load(std::path::Path::new(&args[1]), &LoadOptions::default()).unwrap();
    let text = std::fs::read_to_string(&args[2]).unwrap();
    let cal: usize = args.get(3).map_or(4, |a| a.parse().unwrap());
    let eval: usize = args.get(4).map_or(5, |a| a.parse().unwrap());
    let moe = model.config.moe.clone().expect("a mixture-of-experts model");
    let (layers, experts, ffn) = (model.config.n_layers, moe.n_experts, model.config.ffn);
    let tokens = model.tokenizer.encode(&text, true).unwrap();
    let windows = tokens.len() / CTX;
    assert!(windows >= cal + eval, "text too short");
    let probe = |kind: Kind, keep: usize, rank: Vec<Vec<Vec<usize>>>| Probe {
        kind,
        keep,
        calls: Mutex::new((0..layers).map(|_| Calls::default()).collect()),
        active: Mutex::new(vec![vec![vec![0; ffn]; experts]; layers]),
        seen: Mutex::new(vec![vec![0; experts]; layers]),
        rank,
        stats: Mutex::new((0.0, 0.0, 0)),
    };
    // Perplexity over windows `ws` with `mask` (llama-perplexity's scoring: the second half).
    let run = |mask: Option<&dyn FfnMask>, ws: std::ops::Range<usize>| -> f64 {
        let hooks = FfnHooks {
            observe: None,
            mask,
            stream: None,
            cancel: None,
        };
        let mut cache = KvCache::new(&model.config, CTX);
        let v = model.config.vocab;
        let (mut nll, mut count) = (0f64, 0usize);
        for w in ws {
            let batch = window_tokens(&model, &tokens, w, CTX);
            cache.clear();
            let logits = model
                .forward_in_batches(&batch, &mut cache, CTX / 2, &hooks, CTX)
                .unwrap();
            for j in CTX / 2..CTX - 1 {
                let row = &logits[(j - CTX / 2) * v..(j - CTX / 2 + 1) * v];
                nll += log_sum_exp(row) - row[tokens[w * CTX + j + 1] as usize] as f64;
                count += 1;
            }
        }
        (nll / count as f64).exp()
    };

    let c = probe(Kind::Calibrate, 0, Vec::new());
    run(Some(&c), windows - cal..windows);
    let active = c.active.into_inner().unwrap();
    let seen = c.seen.into_inner().unwrap();
    let rank: Vec<Vec<Vec<usize>>> = active
        .iter()
        .map(|per_expert| {
            per_expert
                .iter()
                .map(|counts| {
                    let mut order: Vec<usize> = (0..ffn).collect();
                    order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
                    let mut rank = vec![0; ffn];
                    order.iter().enumerate().for_each(|(r, &n)| rank[n] = r);
                    rank
                })
                .collect()
        })
        .collect();
    // How skewed the calibration frequencies are: the hottest and coldest tenth's mean share.
    let (mut hot, mut cold, mut groups) = (0f64, 0f64, 0usize);
    for (l, per_expert) in active.iter().enumerate() {
        for (e, counts) in per_expert.iter().enumerate() {
            if seen[l][e] == 0 {
                continue;
            }
            let mut f: Vec<f64> = counts.iter().map(|&c| c as f64 / seen[l][e] as f64).collect();
            f.sort_by(|a, b| b.total_cmp(a));
            let tenth = ffn / 10;
            hot += f[..tenth].iter().sum::<f64>() / tenth as f64;
            cold += f[ffn - tenth..].iter().sum::<f64>() / tenth as f64;
            groups += 1;
        }
    }
    println!(
        "calibration: {cal} windows of {CTX}; {groups} (layer, expert) pairs routed to; active share of the hottest tenth of neurons {:.3}, of the coldest tenth {:.3}",
        hot / groups as f64,
        cold / groups as f64
    );
    let dense = run(None, 0..eval);
    println!("evaluation: windows 0..{eval}; no mask: perplexity {dense:.4}");
    println!("| sparsity | top-K exact ppl | hot-first prefix holding all kept | kept inside the prefix of their count | static hottest-prefix ppl |");
    println!("|---|---|---|---|---|");
    for s in [0.1, 0.3, 0.5] {
        let keep = ((1.0 - s) * ffn as f64).round() as usize;
        let t = probe(Kind::TopK, keep, rank.clone());
        let topk = run(Some(&t), 0..eval);
        let (prefix, inside, n) = t.stats.into_inner().unwrap();
        let st = probe(Kind::Static, keep, rank.clone());
        let stat = run(Some(&st), 0..eval);
        println!(
            "| {s} | {topk:.4} ({:+.2}%) | {:.3} of the expert | {:.3} | {stat:.4} ({:+.2}%) |",
            (topk / dense - 1.0) * 100.0,
            prefix / n as f64,
            inside / n as f64,
            (stat / dense - 1.0) * 100.0
        );
    }
}
