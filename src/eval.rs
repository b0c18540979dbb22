//! `gatestream eval`: what each sparsity level costs in quality, on the same windows as
//! `perplexity`. For every window the dense model runs once; then every (strategy, criterion,
//! level) runs with its mask, and each scored position (the second half of the window, as in
//! perplexity) is compared with dense: perplexity, top-1 agreement of the next-token argmax,
//! and KL(dense ‖ sparse). Also reports the achieved sparsity per layer and the FFN bytes per
//! token the mask implies with a neuron-major layout (see `FfnBytes`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::backend::ops::log_sum_exp;
use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::forward::{FfnMask, Passes};
use crate::model::sampler::argmax;
use crate::model::{Model, Placement};
use crate::perplexity::window_tokens;
use crate::quant::GgmlType;
use crate::sparsity::budget::{Allocation, Sensitivity};
use crate::sparsity::calibration::ScorePools;
use crate::sparsity::{Criterion, MaskCounters, Masker, Strategy, UpSketches};
use rayon::prelude::*;

#[derive(Clone, Debug)]
pub struct EvalOptions {
    pub ctx: usize,
    pub windows: usize,
    pub sparsities: Vec<f32>,
    pub strategies: Vec<Strategy>,
    pub criteria: Vec<Criterion>,
    /// Calibration tokens for thresholds, from the end of the text.
    pub calibrate_tokens: usize,
    /// Quality budget for the frontier: the largest perplexity increase (percent) allowed.
    pub max_ppl_increase_pct: f64,
    /// Also evaluate top-K with per-layer budgets (sparsity allocated by measured sensitivity,
    /// same mean as each level, so the same FFN bytes as uniform top-K at that level), measured
    /// on this many tokens from the end of the text (0 = off).
    pub per_layer_tokens: usize,
    /// Progress is saved here after every window (written to a temporary file and renamed);
    /// if the file exists and belongs to the same evaluation (model, text, options), the run
    /// continues from it. The caller removes it once the report is written.
    pub checkpoint: Option<PathBuf>,
    /// Evaluate at most this many windows in this run, then stop with the checkpoint saved
    /// (`eval` returns `None`): a long evaluation split across runs.
    pub windows_this_run: Option<usize>,
    /// Also run every configuration this many more times with its scores jittered at rounding
    /// level (seeds 1..=N, [`Masker::jittered`]), and report the spread: how much of a
    /// difference between rows is noise.
    pub jitter_seeds: usize,
    /// Mixture-of-experts models: counts of experts per token to measure besides the model's
    /// own, each with no mask and with every mask configuration (`None`: the model's own count
    /// halved until 1; refused for dense models when given).
    pub experts: Option<Vec<usize>>,
}

/// The default experts-per-token counts `eval` measures for a model routing `own` experts per
/// token: `own` halved until 1 (8 → 4, 2, 1).
pub fn default_expert_counts(own: usize) -> Vec<usize> {
    std::iter::successors(Some(own / 2), |&k| (k > 1).then_some(k / 2))
        .filter(|&k| k >= 1)
        .collect()
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct EvalRow {
    pub strategy: Option<Strategy>,
    pub criterion: Option<Criterion>,
    pub sparsity: f32,
    /// A per-layer budget (top-K levels allocated by sensitivity, one per layer) rather than
    /// the uniform `sparsity`.
    pub per_layer: Option<Vec<f32>>,
    /// How the per-layer levels were chosen (blend of greedy into uniform, calibration KL).
    pub allocation: Option<Allocation>,
    /// With jitter seeds: the same configuration with its scores changed at rounding level.
    #[serde(default)]
    pub jitter: Option<Jitter>,
    pub perplexity: f64,
    pub ppl_increase_pct: f64,
    pub top1_agreement: f64,
    pub mean_kl: f64,
    pub achieved_sparsity_mean: f32,
    pub achieved_sparsity_per_layer: Vec<f32>,
    pub ffn_bytes_per_token: f64,
    pub ffn_bytes_rel_dense: f64,
    /// Mixture-of-experts models: experts per token when not the model's own count (the dense
    /// row and rows at the model's own count have none).
    #[serde(default)]
    pub experts_used: Option<usize>,
}

impl EvalRow {
    /// The reference row: every neuron, the model's own experts per token.
    pub fn is_dense(&self) -> bool {
        self.strategy.is_none() && self.experts_used.is_none()
    }

    /// The row's configuration for people: `topk gate 0.50`, `topk/layer exact 0.30`, `dense`,
    /// with ` · K experts` when the count of experts per token is not the model's own.
    pub fn label(&self) -> String {
        let mask = match (self.strategy, self.criterion) {
            (Some(s), Some(c)) => format!(
                "{}{} {} {:.2}",
                s.name(),
                if self.per_layer.is_some() { "/layer" } else { "" },
                c.name(),
                self.sparsity
            ),
            _ if self.experts_used.is_some() => "every neuron".into(),
            _ => "dense".into(),
        };
        match self.experts_used {
            Some(k) => format!("{mask} · {k} expert{} per token", if k == 1 { "" } else { "s" }),
            None => mask,
        }
    }
}

/// A row's configuration re-run with jittered scores, one entry per seed.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Jitter {
    pub ppl_increase_pct: Vec<f64>,
    pub top1_agreement: Vec<f64>,
    /// Largest minus smallest perplexity increase over the row itself and every seed.
    pub ppl_increase_spread: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct EvalReport {
    pub model: String,
    /// The text's name (its file name).
    pub text: String,
    pub windows: usize,
    pub ctx: usize,
    pub scored_positions: usize,
    pub method: &'static str,
    pub bytes_model: &'static str,
    pub calibration: Option<String>,
    pub dense_ffn_bytes_per_token: f64,
    /// Mixture-of-experts models: the model's own experts per token (that of the dense row).
    pub experts_per_token: Option<usize>,
    pub rows: Vec<EvalRow>,
    pub max_ppl_increase_pct: f64,
    /// Index into `rows` of the configuration with the fewest FFN bytes per token whose
    /// perplexity increase is within `max_ppl_increase_pct` (the dense row if none is).
    pub frontier: usize,
    pub seconds: f64,
}

/// Rows whose FFN bytes are within this share of the fewest count as equally cheap.
pub const FRONTIER_BYTES_TIE: f64 = 0.001;

/// The row with the fewest FFN bytes per token within the quality budget; among rows equally
/// cheap (within [`FRONTIER_BYTES_TIE`], e.g. a per-layer budget beside the uniform level it
/// matches, a few bytes apart from rounding), the one with the least perplexity increase.
pub fn frontier(rows: &[EvalRow], max_ppl_increase_pct: f64) -> usize {
    let within = || {
        rows.iter()
            .enumerate()
            .filter(|(_, r)| r.ppl_increase_pct <= max_ppl_increase_pct)
    };
    let Some(fewest) = within().map(|(_, r)| r.ffn_bytes_per_token).min_by(f64::total_cmp) else {
        return 0;
    };
    within()
        .filter(|(_, r)| r.ffn_bytes_per_token <= fewest * (1.0 + FRONTIER_BYTES_TIE))
        .min_by(|a, b| a.1.ppl_increase_pct.total_cmp(&b.1.ppl_increase_pct))
        .map_or(0, |(i, _)| i)
}

/// Whether `run` can use a row's configuration: threshold masks only on the exact score (the
/// thresholds `calibrate` stores); eval also measures threshold on the other criteria, with
/// thresholds it calibrates for itself, but such a row is never stored as a recommendation.
pub fn runnable(r: &EvalRow) -> bool {
    (r.strategy != Some(Strategy::Threshold) || r.criterion == Some(Criterion::Exact)) && r.experts_used.is_none()
}

/// What `gatestream recommend` reads back from an eval report's JSON.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct SavedReport {
    pub model: String,
    /// Absent in reports written before it was recorded.
    #[serde(default)]
    pub text: String,
    pub windows: usize,
    pub ctx: usize,
    pub rows: Vec<EvalRow>,
}

/// Dense perplexities of two reports closer than this (relative) count as the same
/// measurement: the same windows through another build of the same kernels.
const SAME_DENSE_REL: f64 = 1e-6;

/// Several reports of one evaluation (the same model, text, windows and context — a grid run
/// in parts, e.g. one strategy per run) as one: the dense row once, then every report's sparse
/// rows, so that the frontier is taken over all of them. Refused, naming the reports and what
/// differs, when they did not measure the same thing. `reports` are (name, report) pairs.
pub fn merge_reports(reports: Vec<(String, SavedReport)>) -> Result<SavedReport> {
    let mut reports = reports.into_iter();
    let Some((first, mut merged)) = reports.next() else {
        return Err(Error::Input("no report to merge".into()));
    };
    let same_file = |a: &str, b: &str| {
        a == b
            || match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
                (Ok(a), Ok(b)) => a == b,
                _ => false,
            }
    };
    let dense = |r: &SavedReport| r.rows.iter().find(|x| x.is_dense()).map(|x| x.perplexity);
    let first_dense = dense(&merged);
    for (name, r) in reports {
        let mut differs = Vec::new();
        if !same_file(&merged.model, &r.model) {
            differs.push(format!("model {} vs {}", merged.model, r.model));
        }
        // Reports written before the text was recorded say nothing about it.
        if merged.text.is_empty() {
            merged.text = r.text.clone();
        } else if !r.text.is_empty() && merged.text != r.text {
            differs.push(format!("text {} vs {}", merged.text, r.text));
        }
        if (merged.windows, merged.ctx) != (r.windows, r.ctx) {
            differs.push(format!(
                "{} vs {} windows of {} vs {} tokens",
                merged.windows, r.windows, merged.ctx, r.ctx
            ));
        }
        match (first_dense, dense(&r)) {
            (Some(a), Some(b)) if (a - b).abs() <= SAME_DENSE_REL * a => {}
            (a, b) => {
                let show = |p: Option<f64>| p.map_or("none".into(), |p| format!("{p:.4}"));
                differs.push(format!("dense perplexity {} vs {}", show(a), show(b)))
            }
        }
        if !differs.is_empty() {
            return Err(Error::Input(format!(
                "{first} and {name} are reports of different evaluations ({}); only reports of the same model, text, windows and context can be merged",
                differs.join("; ")
            )));
        }
        merged.rows.extend(r.rows.into_iter().filter(|x| !x.is_dense()));
    }
    Ok(merged)
}

/// The frontier configuration at a quality budget, as stored in a .gst file; `None` when no
/// sparse row is within the budget.
pub fn recommendation(
    rows: &[EvalRow],
    max_ppl_increase_pct: f64,
    text: &str,
    windows: usize,
    ctx: usize,
) -> Option<crate::format::Recommendation> {
    let runnable: Vec<EvalRow> = rows.iter().filter(|r| runnable(r)).cloned().collect();
    let f = &runnable[frontier(&runnable, max_ppl_increase_pct)];
    let (strategy, criterion) = (f.strategy?, f.criterion?);
    let text = if text.is_empty() { "(text not recorded)" } else { text };
    Some(crate::format::Recommendation {
        strategy: strategy.name().into(),
        criterion: criterion.name().into(),
        sparsity: f.sparsity,
        max_ppl_increase_pct: max_ppl_increase_pct as f32,
        measured_ppl_increase_pct: f.ppl_increase_pct as f32,
        top1_agreement: f.top1_agreement as f32,
        ffn_bytes_rel_dense: f.ffn_bytes_rel_dense as f32,
        measured_on: format!("{text}: {windows} windows of {ctx} tokens"),
        per_layer_sparsity: f.per_layer.clone(),
    })
}

pub const METHOD: &str = "windows as llama.cpp perplexity (ctx tokens, BOS first when the model adds it, second half scored); \
agreement and KL over the scored positions against the dense model on the same window; union: the unscored first half runs dense and \
votes, the scored half uses the winners";

pub const BYTES_MODEL: &str = "per layer and token: the whole gate matrix, plus up rows (all for exact, the candidates for candidates, \
the kept neurons otherwise; the sketch is resident and not counted) and down columns of the kept neurons, in a neuron-major layout \
with down as Q8_0 columns (or the .gst file's own types); exact bytes, before read alignment and merging; mixture-of-experts models: per layer \
and token the router and any shared expert whole, and for each routed expert what a dense layer's FFN of the expert's width costs";

/// Bytes per neuron row of each FFN part, for the bytes model.
struct FfnBytes {
    /// Per layer and token whatever the mask and routing: a mixture of experts' router and
    /// shared expert (none for dense models).
    fixed_layer: f64,
    /// One FFN's (an expert's) whole gate matrix.
    gate_layer: f64,
    up_row: f64,
    down_col: f64,
    ffn: usize,
    /// Layers of this FFN (a mixture of experts: its layers of experts).
    n_layers: usize,
    /// FFNs run per layer and token: 1, or the model's own experts per token.
    own_used: usize,
    /// A mixture of experts' leading dense layers (GLM-4.5): their count, and their FFNs' bytes
    /// per token (every neuron; masks run inside the routed experts only).
    lead: usize,
    lead_bytes: f64,
}

impl FfnBytes {
    fn of(model: &Model) -> crate::error::Result<FfnBytes> {
        use crate::model::weights::{FfnDown, LayerFfn};
        // (A mixture of experts: its first layer of experts, past any leading dense ones.)
        let layers = &model.weights.layers;
        let first = layers
            .iter()
            .find(|l| matches!(l.ffn, LayerFfn::Experts(_)))
            .unwrap_or(&layers[0]);
        let (ffn, fixed, own_used) = match &first.ffn {
            LayerFfn::Dense(f) => (f, 0, 1),
            LayerFfn::Experts(e) => {
                let shared = e.shared.as_ref().map_or(0, |(f, g)| {
                    f.gate.len_bytes()
                        + f.up.len_bytes()
                        + f.down.weight().len_bytes()
                        + g.as_ref().map_or(0, |g| g.len() * 4)
                });
                let used = model.config.moe.as_ref().map_or(1, |m| m.n_used);
                (&e.experts[0], e.router.len_bytes() + shared, used)
            }
        };
        let lead = model.config.moe.as_ref().map_or(0, |m| m.leading_dense);
        let lead_bytes: f64 = layers[..lead]
            .iter()
            .filter_map(|l| match &l.ffn {
                LayerFfn::Dense(f) => {
                    Some((f.gate.len_bytes() + f.up.len_bytes() + f.down.weight().len_bytes()) as f64)
                }
                LayerFfn::Experts(_) => None,
            })
            .sum();
        let down = ffn.down.weight();
        let down_col = match &ffn.down {
            FfnDown::Columns(w) => w.row_bytes,
            FfnDown::Rows(_) => GgmlType::Q8_0.row_bytes(down.rows).unwrap_or(down.rows * 4),
        };
        Ok(FfnBytes {
            fixed_layer: fixed as f64,
            gate_layer: ffn.gate.len_bytes() as f64,
            up_row: ffn.up.row_bytes as f64,
            down_col: down_col as f64,
            ffn: ffn.gate.rows,
            n_layers: model.config.n_layers - lead,
            own_used,
            lead,
            lead_bytes,
        })
    }

    fn dense(&self) -> f64 {
        self.every_neuron(None)
    }

    /// Every neuron of `used` FFNs per layer and token (`None`: the model's own count).
    fn every_neuron(&self, used: Option<usize>) -> f64 {
        let k = used.unwrap_or(self.own_used) as f64;
        self.lead_bytes
            + self.n_layers as f64
                * (self.fixed_layer + k * (self.gate_layer + self.ffn as f64 * (self.up_row + self.down_col)))
    }

    /// With per-layer mean up rows and sparsity per FFN run, `used` FFNs per layer and token
    /// (`None`: the model's own count).
    fn sparse(&self, up_rows: &[f32], achieved: &[f32], used: Option<usize>) -> f64 {
        let k = used.unwrap_or(self.own_used) as f64;
        self.lead_bytes
            + up_rows
                .iter()
                .zip(achieved)
                .skip(self.lead)
                .map(|(&u, &s)| {
                    self.fixed_layer
                        + k * (self.gate_layer
                            + u as f64 * self.up_row
                            + (1.0 - s as f64) * self.ffn as f64 * self.down_col)
                })
                .sum::<f64>()
    }
}

#[derive(Clone, Default)]
struct Accum {
    nll: f64,
    agree: u64,
    kl: f64,
    count: u64,
}

impl Accum {
    /// As bit patterns: exact and valid for any value (JSON has no infinity), so a resumed run
    /// adds up to the same result.
    fn save(&self) -> [u64; 4] {
        [self.nll.to_bits(), self.agree, self.kl.to_bits(), self.count]
    }

    fn load(v: [u64; 4]) -> Accum {
        Accum {
            nll: f64::from_bits(v[0]),
            agree: v[1],
            kl: f64::from_bits(v[2]),
            count: v[3],
        }
    }
}

const CHECKPOINT_FORMAT: &str = "gatestream eval checkpoint 1";

/// An evaluation's progress after some windows ([`EvalOptions::checkpoint`]).
#[derive(serde::Serialize, serde::Deserialize)]
struct Checkpoint {
    format: String,
    /// What the evaluation is (model, text, options): a checkpoint only continues its own.
    key: serde_json::Value,
    windows_done: usize,
    seconds: f64,
    dense: [u64; 4],
    configs: Vec<ConfigState>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ConfigState {
    accum: [u64; 4],
    counters: MaskCounters,
    /// Per-layer rows: the allocation (not measured again; its levels parse back exactly).
    allocation: Option<Allocation>,
}

/// The identity of an evaluation, for its checkpoint.
fn checkpoint_key(model: &Model, text: &str, text_name: &str, opts: &EvalOptions) -> Result<serde_json::Value> {
    let model_bytes = std::fs::metadata(&model.path)
        .map_err(|e| Error::io(&model.path, e))?
        .len();
    Ok(serde_json::json!({
        "model": model.path.display().to_string(),
        "model_bytes": model_bytes,
        "text": text_name,
        "text_bytes": text.len(),
        "text_xxh3": format!("{:016x}", xxhash_rust::xxh3::xxh3_64(text.as_bytes())),
        "ctx": opts.ctx,
        "windows": opts.windows,
        "sparsities": opts.sparsities,
        "strategies": opts.strategies.iter().map(|s| s.name()).collect::<Vec<_>>(),
        "criteria": opts.criteria.iter().map(|c| c.name()).collect::<Vec<_>>(),
        "calibrate_tokens": opts.calibrate_tokens,
        "per_layer_tokens": opts.per_layer_tokens,
        "jitter_seeds": opts.jitter_seeds,
        "experts": opts.experts,
    }))
}

/// The checkpoint at `path` if there is one, checked to belong to this evaluation.
fn read_checkpoint(path: &Path, key: &serde_json::Value) -> Result<Option<Checkpoint>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    let c: Checkpoint = serde_json::from_slice(&bytes).map_err(|e| {
        Error::Input(format!(
            "{}: not a readable eval checkpoint ({e}); remove it to start over",
            path.display()
        ))
    })?;
    if c.format != CHECKPOINT_FORMAT {
        return Err(Error::Input(format!(
            "{}: checkpoint format `{}`, this build writes `{CHECKPOINT_FORMAT}`; remove it to start over",
            path.display(),
            c.format
        )));
    }
    if &c.key != key {
        let differs: Vec<String> = match (key, &c.key) {
            (serde_json::Value::Object(want), serde_json::Value::Object(have)) => want
                .iter()
                .filter(|(k, v)| have.get(*k) != Some(*v))
                .map(|(k, v)| {
                    format!(
                        "{k}: {} here, {} in the checkpoint",
                        v,
                        have.get(k).unwrap_or(&serde_json::Value::Null)
                    )
                })
                .collect(),
            _ => vec!["its key".into()],
        };
        return Err(Error::Input(format!(
            "{}: a checkpoint of a different evaluation ({}); remove it, or pass another checkpoint file",
            path.display(),
            differs.join("; ")
        )));
    }
    Ok(Some(c))
}

/// Lets every union mask vote on a dense batch (its context) without changing it.
struct Voters<'a>(Vec<&'a Masker<'a>>);

impl FfnMask for Voters<'_> {
    fn apply(&self, layer: usize, xn: &[f32], gate: &[f32], _up: &[f32], hact: &mut [f32]) {
        let hact: &[f32] = hact;
        self.0.par_iter().for_each(|m| {
            m.union_vote_accumulating(layer, xn, gate, hact);
        });
    }
}

/// Log-softmax of a logits row, in f64.
fn log_probs(row: &[f32]) -> Vec<f64> {
    let lse = log_sum_exp(row);
    row.iter().map(|&v| v as f64 - lse).collect()
}

pub fn eval(
    model: &Model,
    text: &str,
    text_name: &str,
    opts: &EvalOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<Option<EvalReport>> {
    eval_with(model, Passes::default(), text, text_name, opts, progress)
}

/// As `eval`, with every pass (windows, threshold calibration, per-layer sensitivity) run as
/// `passes` says: through a stream under a RAM budget, in batches it holds. A window's union
/// context votes over all its batches, so results equal the in-RAM model's fed in the same
/// batches.
pub fn eval_with(
    model: &Model,
    passes: Passes,
    text: &str,
    text_name: &str,
    opts: &EvalOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<Option<EvalReport>> {
    let t0 = Instant::now();
    check_options(opts)?;
    let tokens = model.tokenizer.encode(text, true)?;
    let windows = window_count(&tokens, opts)?;
    let expert_counts = expert_counts(model, opts)?;
    let sketches = sketches_for(model, passes, opts)?;
    check_calibration_room(opts, windows, tokens.len())?;
    let pools = threshold_pools(model, passes, text, text_name, opts, sketches.as_ref())?;
    let mut configs = Configs::uniform(model, &expert_counts, opts, sketches.as_ref(), pools.as_ref());
    let (key, resumed) = checkpoint_of(model, text, text_name, opts)?;
    if opts.per_layer_tokens > 0 {
        if windows * opts.ctx + opts.per_layer_tokens > tokens.len() {
            return Err(Error::Input(
                "evaluation windows and the per-layer sensitivity tokens would overlap".into(),
            ));
        }
        configs.add_per_layer(model, passes, text, opts, sketches.as_ref(), resumed.as_ref(), progress)?;
    }
    configs.add_jittered(opts.jitter_seeds);
    let bytes = FfnBytes::of(model)?;
    let mut tally = Tally::resumed(resumed, &configs, opts, windows)?;
    let start = tally.windows_done;
    let stop = opts.windows_this_run.map_or(windows, |n| (start + n).min(windows));
    let mut cache = KvCache::new(&model.config, opts.ctx);
    // Union masks run the window's first half dense and vote on it: that half is the dense pass's
    // own first half, so it runs once, with every union mask voting, and each union mask then
    // runs only the second half from the dense keys and values.
    let voters = configs.voters();
    progress("windows", start, windows);
    for w in start..stop {
        let window = Window::new(model, &tokens, w, opts.ctx);
        eval_window(model, passes, &window, &voters, &configs, &mut cache, &mut tally)?;
        tally.windows_done = w + 1;
        if let Some(path) = &opts.checkpoint {
            let seconds = tally.seconds_before + t0.elapsed().as_secs_f64();
            save_checkpoint(path, &key, &configs, &tally, seconds)?;
        }
        progress("windows", w + 1, windows);
    }
    if stop < windows {
        return Ok(None);
    }
    let dense_bytes = bytes.dense();
    let rows = report_rows(model, &configs, &tally, &bytes, opts.jitter_seeds);
    let best = frontier(&rows, opts.max_ppl_increase_pct);
    Ok(Some(EvalReport {
        max_ppl_increase_pct: opts.max_ppl_increase_pct,
        frontier: best,
        model: model.path.display().to_string(),
        text: text_name.to_string(),
        windows,
        ctx: opts.ctx,
        scored_positions: tally.dense.count as usize,
        method: METHOD,
        bytes_model: BYTES_MODEL,
        calibration: pools.map(|p| p.text),
        dense_ffn_bytes_per_token: dense_bytes,
        experts_per_token: model.config.moe.as_ref().map(|m| m.n_used),
        rows,
        seconds: tally.seconds_before + t0.elapsed().as_secs_f64(),
    }))
}

/// The checkpoint's key for this evaluation and what the checkpoint holds (nothing without a
/// checkpoint file, or before it is first written).
fn checkpoint_of(
    model: &Model,
    text: &str,
    text_name: &str,
    opts: &EvalOptions,
) -> Result<(serde_json::Value, Option<Checkpoint>)> {
    let Some(path) = &opts.checkpoint else {
        return Ok((serde_json::Value::Null, None));
    };
    let key = checkpoint_key(model, text, text_name, opts)?;
    let resumed = read_checkpoint(path, &key)?;
    Ok((key, resumed))
}

/// Refuses a window too short to score and sparsity levels outside [0, 1).
fn check_options(opts: &EvalOptions) -> Result<()> {
    if opts.ctx < 8 {
        return Err(Error::Input(format!("--ctx {} is too small", opts.ctx)));
    }
    if let Some(s) = opts.sparsities.iter().find(|s| !(0.0..1.0).contains(*s)) {
        return Err(Error::Input(format!("sparsity {s} is outside [0, 1)")));
    }
    Ok(())
}

/// The windows to evaluate: `opts.windows` (0 = all) of those the text holds; refused when it
/// holds none.
fn window_count(tokens: &[u32], opts: &EvalOptions) -> Result<usize> {
    let available = tokens.len() / opts.ctx;
    let windows = if opts.windows == 0 {
        available
    } else {
        opts.windows.min(available)
    };
    if windows == 0 {
        return Err(Error::Input(format!(
            "the text has {} tokens, fewer than one window of {}",
            tokens.len(),
            opts.ctx
        )));
    }
    Ok(windows)
}

/// The counts of experts per token to measure: `[None]` (the model's own) for a dense model;
/// for a mixture of experts the model's own and then each other count asked for (or
/// [`default_expert_counts`]), refusing what a mixture of experts cannot be evaluated with.
fn expert_counts(model: &Model, opts: &EvalOptions) -> Result<Vec<Option<usize>>> {
    let moe = match (&model.config.moe, &opts.experts) {
        (None, Some(_)) => {
            return Err(Error::Input(format!(
                "{}: --experts measures mixture-of-experts models routed to fewer experts, and this model is dense",
                model.path.display()
            )))
        }
        (None, None) => return Ok(vec![None]),
        (Some(moe), _) => moe,
    };
    let asked = opts
        .experts
        .clone()
        .unwrap_or_else(|| default_expert_counts(moe.n_used));
    if let Some(k) = asked.iter().find(|&&k| k == 0 || k > moe.n_experts) {
        return Err(Error::Input(format!(
            "--experts {k}: this model has {} experts per layer; give counts from 1 to {}",
            moe.n_experts, moe.n_experts
        )));
    }
    if let Some(st) = opts.strategies.iter().find(|&&st| st != Strategy::TopK) {
        return Err(Error::Input(format!(
            "{}: a mixture-of-experts model takes top-K masks inside each routed expert; --strategy {} keeps \
             per-layer state over a dense layer's neurons: use --strategy topk",
            model.path.display(),
            st.name()
        )));
    }
    if opts.criteria.contains(&Criterion::Sketch) || opts.per_layer_tokens > 0 {
        return Err(Error::Input(format!(
            "{}: the sketch criterion and per-layer budgets are not available for mixture-of-experts models; \
             use --criterion gate, exact or candidates and no --per-layer-tokens",
            model.path.display()
        )));
    }
    let mut counts = vec![None];
    for k in asked {
        if k != moe.n_used && !counts.contains(&Some(k)) {
            counts.push(Some(k));
        }
    }
    Ok(counts)
}

/// The up-row sketches the sketch criterion scores with (None when no criterion asks for them);
/// a streamed model's up rows are read through its stream.
fn sketches_for(model: &Model, passes: Passes, opts: &EvalOptions) -> Result<Option<UpSketches>> {
    if !opts.criteria.contains(&Criterion::Sketch) {
        return Ok(None);
    }
    let built = match passes.stream {
        // A streamed model's up rows are read through its stream (counted in its reads).
        Some(s) if model.placement == Placement::OnDisk => UpSketches::build_with(model, &|w| s.read_matrix(w))?,
        _ => UpSketches::build(model),
    };
    Ok(Some(built.ok_or_else(|| {
        Error::Input("the sketch criterion needs hidden to be a multiple of 32".into())
    })?))
}

/// With the threshold strategy: refuses calibration tokens (from the end of a text of
/// `text_tokens`) that would overlap the evaluation windows.
fn check_calibration_room(opts: &EvalOptions, windows: usize, text_tokens: usize) -> Result<()> {
    if opts.strategies.contains(&Strategy::Threshold) && windows * opts.ctx + opts.calibrate_tokens > text_tokens {
        return Err(Error::Input(format!(
            "evaluation windows ({} tokens) and calibration ({} tokens from the end) would overlap in a text of {} tokens",
            windows * opts.ctx,
            opts.calibrate_tokens,
            text_tokens
        )));
    }
    Ok(())
}

/// The score pools threshold masks take their thresholds from, collected on
/// `opts.calibrate_tokens` tokens from the end of the text (None without the threshold
/// strategy).
fn threshold_pools(
    model: &Model,
    passes: Passes,
    text: &str,
    text_name: &str,
    opts: &EvalOptions,
    sketches: Option<&UpSketches>,
) -> Result<Option<ScorePools>> {
    if !opts.strategies.contains(&Strategy::Threshold) {
        return Ok(None);
    }
    Ok(Some(ScorePools::collect(
        model,
        passes,
        text,
        text_name,
        opts.calibrate_tokens,
        &opts.criteria,
        sketches,
    )?))
}

/// The configurations an evaluation runs, in the order of its rows after the dense one.
struct Configs<'a> {
    maskers: Vec<Masker<'a>>,
    /// Per configuration: the per-layer allocation its levels came from (per-layer rows only).
    allocations: Vec<Option<Allocation>>,
    /// Configurations other than jittered copies: the first `base` (the rows of the report).
    base: usize,
    /// Per configuration: an earlier one whose mask equals its own by construction (union
    /// candidates = union exact); it is not run and takes that one's results after every window.
    copy_of: Vec<Option<usize>>,
}

impl<'a> Configs<'a> {
    /// Per count of experts per token (dense models: one, `None`): every neuron (a row of its
    /// own unless the count is the model's), then every (level, strategy, criterion) mask.
    fn uniform(
        model: &Model,
        expert_counts: &[Option<usize>],
        opts: &EvalOptions,
        sketches: Option<&'a UpSketches>,
        pools: Option<&ScorePools>,
    ) -> Configs<'a> {
        let mut maskers: Vec<Masker> = Vec::new();
        for &k in expert_counts {
            if k.is_some() {
                maskers.push(Masker::new(model, Strategy::TopK, Criterion::Gate, 0.0, None, None).with_experts_used(k));
            }
            for &s in opts.sparsities.iter().filter(|&&s| s > 0.0) {
                for &st in &opts.strategies {
                    for &c in &opts.criteria {
                        let th = (st == Strategy::Threshold).then(|| pools.expect("pools").thresholds(c, s));
                        maskers.push(Masker::new(model, st, c, s, sketches, th).with_experts_used(k));
                    }
                }
            }
        }
        Configs {
            allocations: maskers.iter().map(|_| None).collect(),
            base: maskers.len(),
            copy_of: Vec::new(),
            maskers,
        }
    }

    /// Adds top-K with per-layer levels for every (criterion, level): sensitivity measured on
    /// `opts.per_layer_tokens` tokens, or the allocations a resumed run measured before, bit
    /// for bit.
    #[allow(clippy::too_many_arguments)] // the evaluation's inputs, as eval_with has them
    fn add_per_layer(
        &mut self,
        model: &Model,
        passes: Passes,
        text: &str,
        opts: &EvalOptions,
        sketches: Option<&'a UpSketches>,
        resumed: Option<&Checkpoint>,
        progress: &mut dyn FnMut(&str, usize, usize),
    ) -> Result<()> {
        let levels = opts.sparsities.iter().filter(|&&s| s > 0.0);
        let uniform = self.maskers.len();
        let mut saved = resumed.iter().flat_map(|c| c.configs.iter().skip(uniform));
        for &c in &opts.criteria {
            let mut sens = None;
            for &s in levels.clone() {
                let a = match saved.next() {
                    Some(ConfigState {
                        allocation: Some(a), ..
                    }) => a.clone(),
                    _ => {
                        if sens.is_none() {
                            let stage = format!("per-layer sensitivity ({})", c.name());
                            let m = Sensitivity::measure(
                                model,
                                passes,
                                text,
                                opts.per_layer_tokens,
                                c,
                                sketches,
                                &mut |d, n| progress(&stage, d, n),
                            )?;
                            sens = Some(m);
                        }
                        sens.as_ref()
                            .expect("measured")
                            .allocate_checked(model, passes, s, sketches)?
                    }
                };
                self.maskers
                    .push(Masker::new(model, Strategy::TopK, c, s, sketches, None).with_per_layer(a.levels.clone()));
                self.allocations.push(Some(a));
            }
        }
        Ok(())
    }

    /// Adds `seeds` jittered copies of every configuration, seed by seed, and marks which
    /// configurations copy an earlier one's mask.
    fn add_jittered(&mut self, seeds: usize) {
        self.base = self.maskers.len();
        for seed in 1..=seeds as u64 {
            for i in 0..self.base {
                let m = self.maskers[i].jittered(seed);
                self.maskers.push(m);
                self.allocations.push(self.allocations[i].clone());
            }
        }
        let maskers = &self.maskers;
        self.copy_of = (0..maskers.len())
            .map(|i| (0..i).find(|&j| maskers[j].same_mask_as(&maskers[i])))
            .collect();
    }

    /// The union masks that run, to vote on a window's dense first half.
    fn voters(&self) -> Voters<'_> {
        Voters(
            self.maskers
                .iter()
                .zip(&self.copy_of)
                .filter(|(m, copy)| m.strategy == Strategy::Union && copy.is_none())
                .map(|(m, _)| m)
                .collect(),
        )
    }
}

/// The sums so far: dense's and each configuration's, after `windows_done` windows that took
/// `seconds_before` seconds in earlier runs.
struct Tally {
    dense: Accum,
    configs: Vec<Accum>,
    windows_done: usize,
    seconds_before: f64,
}

impl Tally {
    /// Nothing summed yet, or what the checkpoint `resumed` holds (the configurations' mask
    /// counters restored too), checked to fit `configs` and `windows`.
    fn resumed(resumed: Option<Checkpoint>, configs: &Configs, opts: &EvalOptions, windows: usize) -> Result<Tally> {
        let mut t = Tally {
            dense: Accum::default(),
            configs: configs.maskers.iter().map(|_| Accum::default()).collect(),
            windows_done: 0,
            seconds_before: 0.0,
        };
        let Some(c) = resumed else {
            return Ok(t);
        };
        if c.configs.len() != configs.maskers.len() || c.windows_done > windows {
            return Err(Error::Input(format!(
                "{}: the checkpoint holds {} configurations after {} windows; this evaluation has {} and {} windows; remove it to start over",
                opts.checkpoint.as_ref().expect("resumed from a file").display(),
                c.configs.len(),
                c.windows_done,
                configs.maskers.len(),
                windows
            )));
        }
        t.dense = Accum::load(c.dense);
        for ((acc, m), state) in t.configs.iter_mut().zip(&configs.maskers).zip(&c.configs) {
            *acc = Accum::load(state.accum);
            m.restore_counters(&state.counters)?;
        }
        (t.windows_done, t.seconds_before) = (c.windows_done, c.seconds);
        Ok(t)
    }
}

/// One window of the text: its tokens as fed (BOS first), the text's tokens from its start (the
/// targets), its unscored first half, and how many positions are scored.
struct Window<'t> {
    batch: Vec<u32>,
    targets: &'t [u32],
    half: usize,
    scored: usize,
}

impl<'t> Window<'t> {
    /// Window `w` of `ctx` tokens of the text's `tokens`.
    fn new(model: &Model, tokens: &'t [u32], w: usize, ctx: usize) -> Window<'t> {
        Window {
            batch: window_tokens(model, tokens, w, ctx),
            targets: &tokens[w * ctx..],
            half: ctx / 2,
            scored: ctx - 1 - ctx / 2,
        }
    }

    /// The token position `j` of the window should predict.
    fn target(&self, j: usize) -> usize {
        self.targets[j + 1] as usize
    }
}

/// Runs one window dense (its first half once, with every union mask voting) and then every
/// configuration not copying another, and adds each one's scores against dense to `tally`.
fn eval_window(
    model: &Model,
    passes: Passes,
    window: &Window,
    voters: &Voters,
    configs: &Configs,
    cache: &mut KvCache,
    tally: &mut Tally,
) -> Result<()> {
    let (batch, half, vocab) = (&window.batch, window.half, model.config.vocab);
    let batch_max = passes.batch_max();
    // Without union masks the first half runs with no mask at all (a mixture-of-experts model
    // takes only masks that run inside its experts).
    let voting = passes.hooks((!voters.0.is_empty()).then_some(voters as &dyn FfnMask), None);
    cache.clear();
    for m in &voters.0 {
        m.start_union_context(half);
    }
    model.forward_in_batches(&batch[..half], cache, half - 1, &voting, batch_max)?;
    let dense = model.forward_in_batches(&batch[half..], cache, 0, &passes.hooks(None, None), batch_max)?;
    let dense_lp: Vec<Vec<f64>> = dense.par_chunks(vocab).map(log_probs).collect();
    let dense_top: Vec<u32> = dense.par_chunks(vocab).map(argmax).collect();
    for (i, lp) in dense_lp.iter().enumerate().take(window.scored) {
        tally.dense.nll -= lp[window.target(half + i)];
        tally.dense.count += 1;
    }
    let maskers = &configs.maskers;
    // Union masks first: they start from the dense first half still in the cache.
    let mut order: Vec<usize> = (0..maskers.len()).filter(|&i| configs.copy_of[i].is_none()).collect();
    order.sort_by_key(|&i| maskers[i].strategy != Strategy::Union);
    for i in order {
        let (m, acc) = (&maskers[i], &mut tally.configs[i]);
        let hooks = passes.hooks(Some(m), None);
        let sparse = if m.strategy == Strategy::Union {
            // The context (first half) has voted in the dense pass; its keys stay.
            m.set_union_context(0);
            cache.truncate(half);
            model.forward_in_batches(&batch[half..], cache, 0, &hooks, batch_max)?
        } else {
            cache.clear();
            model.forward_in_batches(batch, cache, half, &hooks, batch_max)?
        };
        // Each position is scored on its own (in parallel: with a large vocabulary this is a
        // good share of the work) and the scores are summed in position order, as before.
        let scores: Vec<(f64, bool, f64)> = sparse
            .par_chunks(vocab)
            .take(window.scored)
            .enumerate()
            .map(|(i, row)| {
                let lp = log_probs(row);
                let kl = dense_lp[i].iter().zip(&lp).map(|(d, s)| d.exp() * (d - s)).sum::<f64>();
                (lp[window.target(half + i)], argmax(row) == dense_top[i], kl)
            })
            .collect();
        for (lp_target, agree, kl) in scores {
            acc.nll -= lp_target;
            acc.agree += agree as u64;
            acc.kl += kl;
            acc.count += 1;
        }
    }
    for (i, j) in configs
        .copy_of
        .iter()
        .enumerate()
        .filter_map(|(i, j)| j.map(|j| (i, j)))
    {
        tally.configs[i] = tally.configs[j].clone();
        maskers[i].restore_counters(&maskers[j].counters())?;
    }
    Ok(())
}

/// Writes the evaluation's progress (`seconds` in all so far) to the checkpoint at `path`.
fn save_checkpoint(path: &Path, key: &serde_json::Value, configs: &Configs, tally: &Tally, seconds: f64) -> Result<()> {
    let states = configs
        .maskers
        .iter()
        .zip(&tally.configs)
        .zip(&configs.allocations)
        .map(|((m, acc), a)| ConfigState {
            accum: acc.save(),
            counters: m.counters(),
            allocation: a.clone(),
        })
        .collect();
    let c = Checkpoint {
        format: CHECKPOINT_FORMAT.into(),
        key: key.clone(),
        windows_done: tally.windows_done,
        seconds,
        dense: tally.dense.save(),
        configs: states,
    };
    let bytes = serde_json::to_vec(&c).map_err(|e| Error::Internal(format!("checkpoint: {e}")))?;
    crate::io::write_replacing(path, &bytes)
}

/// The report's rows: dense first, then each configuration but the jittered copies, with its
/// copies' spread (`jitter_seeds` of them).
fn report_rows(model: &Model, configs: &Configs, tally: &Tally, bytes: &FfnBytes, jitter_seeds: usize) -> Vec<EvalRow> {
    let dense_ppl = (tally.dense.nll / tally.dense.count as f64).exp();
    let dense_bytes = bytes.dense();
    let mut rows = vec![EvalRow {
        strategy: None,
        criterion: None,
        sparsity: 0.0,
        per_layer: None,
        allocation: None,
        jitter: None,
        perplexity: dense_ppl,
        ppl_increase_pct: 0.0,
        top1_agreement: 1.0,
        mean_kl: 0.0,
        achieved_sparsity_mean: 0.0,
        achieved_sparsity_per_layer: vec![0.0; model.config.n_layers],
        ffn_bytes_per_token: dense_bytes,
        ffn_bytes_rel_dense: 1.0,
        experts_used: None,
    }];
    let (base, accs) = (configs.base, &tally.configs);
    let ppl_of = |acc: &Accum| (acc.nll / acc.count as f64).exp();
    for (i, ((m, acc), allocation)) in configs
        .maskers
        .iter()
        .zip(accs)
        .zip(&configs.allocations)
        .take(base)
        .enumerate()
    {
        let ppl = ppl_of(acc);
        let jitter = (jitter_seeds > 0).then(|| {
            let runs: Vec<&Accum> = (1..=jitter_seeds).map(|s| &accs[s * base + i]).collect();
            let ppl_increase_pct: Vec<f64> = runs.iter().map(|a| (ppl_of(a) / dense_ppl - 1.0) * 100.0).collect();
            let own = (ppl / dense_ppl - 1.0) * 100.0;
            let (lo, hi) = ppl_increase_pct
                .iter()
                .fold((own, own), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            Jitter {
                top1_agreement: runs.iter().map(|a| a.agree as f64 / a.count as f64).collect(),
                ppl_increase_pct,
                ppl_increase_spread: hi - lo,
            }
        });
        let achieved = m.achieved_sparsity();
        // A row of fewer experts with every neuron is no mask (its experts ran with none).
        let masked = m.masks_neurons();
        let b = if masked {
            bytes.sparse(&m.up_rows_per_token(), &achieved, m.experts_used)
        } else {
            bytes.every_neuron(m.experts_used)
        };
        rows.push(EvalRow {
            strategy: masked.then_some(m.strategy),
            criterion: masked.then_some(m.criterion),
            sparsity: m.sparsity,
            per_layer: m.per_layer.clone(),
            allocation: allocation.clone(),
            jitter,
            perplexity: ppl,
            ppl_increase_pct: (ppl / dense_ppl - 1.0) * 100.0,
            top1_agreement: acc.agree as f64 / acc.count as f64,
            mean_kl: acc.kl / acc.count as f64,
            // (Over the layers masks run in: a mixture of experts' leading dense layers run whole.)
            achieved_sparsity_mean: achieved[bytes.lead..].iter().sum::<f32>()
                / achieved.len().saturating_sub(bytes.lead).max(1) as f32,
            achieved_sparsity_per_layer: achieved,
            ffn_bytes_per_token: b,
            ffn_bytes_rel_dense: b / dense_bytes,
            experts_used: m.experts_used,
        });
    }
    rows
}

/// The report as a table.
pub fn table(r: &EvalReport) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{}: {} windows of {} tokens, {} scored positions, {:.0} s",
        r.model, r.windows, r.ctx, r.scored_positions, r.seconds
    );
    if let Some(c) = &r.calibration {
        let _ = writeln!(o, "thresholds calibrated on {c}");
    }
    let union_with = |c| {
        r.rows
            .iter()
            .any(|row| row.strategy == Some(Strategy::Union) && row.criterion == Some(c))
    };
    if union_with(Criterion::Exact) && union_with(Criterion::Candidates) {
        let _ = writeln!(
            o,
            "union candidates = union exact by construction (the vote ranks the exact score): evaluated once"
        );
    }
    let jitter = r.rows.iter().any(|row| row.jitter.is_some());
    // Mixture-of-experts models: the experts per token of each row.
    let experts = |row: &EvalRow| match r.experts_per_token {
        Some(own) => format!("{:>7} ", row.experts_used.unwrap_or(own)),
        None => String::new(),
    };
    if let Some(own) = r.experts_per_token {
        let _ = writeln!(
            o,
            "mixture of experts, {own} per token: masks keep each routed expert's neurons (the shared expert runs whole)"
        );
    }
    let _ = writeln!(
        o,
        "{}{:<10} {:<11} {:>5} {:>10} {:>8} {:>7} {:>8} {:>9} {:>11} {:>8}{}",
        if r.experts_per_token.is_some() { "experts " } else { "" },
        "strategy",
        "criterion",
        "level",
        "ppl",
        "Δppl%",
        "top1",
        "KL",
        "achieved",
        "FFN MB/tok",
        "vs dense",
        if jitter { "  jitter Δppl% spread" } else { "" }
    );
    for row in &r.rows {
        // A row of fewer experts with no mask is not the dense row.
        let none = if row.is_dense() { "dense" } else { "none" };
        let name = |v: Option<String>| v.unwrap_or_else(|| none.into());
        let _ = writeln!(
            o,
            "{}{:<10} {:<11} {:>5.2} {:>10.4} {:>+8.2} {:>7.4} {:>8.4} {:>9.3} {:>11.2} {:>8.3}{}",
            experts(row),
            name(
                row.strategy
                    .map(|s| format!("{s:?}").to_lowercase() + if row.per_layer.is_some() { "/layer" } else { "" })
            ),
            name(row.criterion.map(|c| format!("{c:?}").to_lowercase())),
            row.sparsity,
            row.perplexity,
            row.ppl_increase_pct,
            row.top1_agreement,
            row.mean_kl,
            row.achieved_sparsity_mean,
            row.ffn_bytes_per_token / 1e6,
            row.ffn_bytes_rel_dense,
            match &row.jitter {
                Some(j) => format!(
                    "  {:.2} ({})",
                    j.ppl_increase_spread,
                    j.ppl_increase_pct
                        .iter()
                        .map(|v| format!("{v:+.2}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
                None => String::new(),
            }
        );
    }
    let f = &r.rows[r.frontier];
    let _ = writeln!(
        o,
        "frontier (≤ {:+.1}% perplexity): {} — {:.3} of dense FFN bytes per token ({:+.2}% perplexity, top-1 {:.4})",
        r.max_ppl_increase_pct,
        f.label(),
        f.ffn_bytes_rel_dense,
        f.ppl_increase_pct,
        f.top1_agreement
    );
    o
}

/// Quality against bytes: one line per strategy × criterion (× budget), each starting at dense.
pub fn chart(r: &EvalReport) -> crate::plot::Chart<'static> {
    use crate::plot::{Chart, Series};
    let mut series: Vec<Series> = Vec::new();
    for row in &r.rows[1..] {
        let name = format!(
            "{}{} {}{}",
            row.strategy.map_or("all neurons", |s| s.name()),
            if row.per_layer.is_some() { "/layer" } else { "" },
            row.criterion.map_or("", |c| c.name()),
            row.experts_used.map_or(String::new(), |k| format!(" · {k} experts"))
        );
        let point = (row.ffn_bytes_rel_dense, row.ppl_increase_pct);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push(point),
            None => series.push(Series {
                name,
                points: vec![(1.0, 0.0), point],
            }),
        }
    }
    Chart {
        title: "Perplexity increase vs FFN bytes per token",
        x_label: "FFN bytes per token relative to dense",
        y_label: "perplexity increase over dense (%)",
        series,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(
        strategy: Option<Strategy>,
        sparsity: f32,
        perplexity: f64,
        ppl_increase_pct: f64,
        bytes_rel: f64,
    ) -> EvalRow {
        EvalRow {
            strategy,
            criterion: strategy.map(|_| Criterion::Exact),
            sparsity,
            per_layer: None,
            allocation: None,
            jitter: None,
            perplexity,
            ppl_increase_pct,
            top1_agreement: 0.9,
            mean_kl: 0.01,
            achieved_sparsity_mean: sparsity,
            achieved_sparsity_per_layer: vec![sparsity],
            ffn_bytes_per_token: bytes_rel * 1e6,
            ffn_bytes_rel_dense: bytes_rel,
            experts_used: None,
        }
    }

    fn report(windows: usize, dense_ppl: f64, sparse: Vec<EvalRow>) -> SavedReport {
        let mut rows = vec![row(None, 0.0, dense_ppl, 0.0, 1.0)];
        rows.extend(sparse);
        SavedReport {
            model: "m.gguf".into(),
            text: "wiki.test.raw".into(),
            windows,
            ctx: 512,
            rows,
        }
    }

    #[test]
    fn merged_reports_keep_one_dense_row_and_take_the_frontier_over_all_rows() {
        let topk = report(20, 10.0, vec![row(Some(Strategy::TopK), 0.5, 10.1, 1.0, 0.75)]);
        let threshold = report(20, 10.0, vec![row(Some(Strategy::Threshold), 0.5, 10.15, 1.5, 0.72)]);
        let m = merge_reports(vec![("a.json".into(), topk), ("b.json".into(), threshold)]).unwrap();
        assert_eq!(m.rows.len(), 3);
        assert_eq!(m.rows.iter().filter(|r| r.strategy.is_none()).count(), 1);
        assert_eq!(m.rows[frontier(&m.rows, 2.0)].strategy, Some(Strategy::Threshold));
        assert_eq!(m.rows[frontier(&m.rows, 1.2)].strategy, Some(Strategy::TopK));
    }

    #[test]
    fn the_recommendation_is_the_cheapest_row_run_can_use() {
        let mut sketch = row(Some(Strategy::Threshold), 0.5, 10.1, 1.0, 0.64);
        sketch.criterion = Some(Criterion::Sketch);
        let exact = row(Some(Strategy::Threshold), 0.5, 10.15, 1.5, 0.76);
        let topk = row(Some(Strategy::TopK), 0.3, 10.12, 1.2, 0.78);
        let r = report(20, 10.0, vec![sketch, exact, topk]);
        assert_eq!(frontier(&r.rows, 2.0), 1, "eval reports the threshold sketch row");
        let rec = recommendation(&r.rows, 2.0, &r.text, r.windows, r.ctx).unwrap();
        assert_eq!((rec.strategy.as_str(), rec.criterion.as_str()), ("threshold", "exact"));
        assert_eq!(rec.ffn_bytes_rel_dense, 0.76);
    }

    /// A mixture of experts' row routed to fewer experts (with or without a mask) is neither the
    /// dense row when merging nor a recommendation `run --mode sparse` could use.
    #[test]
    fn rows_of_fewer_experts_are_not_dense_nor_recommended() {
        let mut one = row(None, 0.0, 10.05, 0.5, 0.55);
        one.experts_used = Some(1);
        let mut one_masked = row(Some(Strategy::TopK), 0.5, 10.1, 1.0, 0.4);
        one_masked.experts_used = Some(1);
        let topk = row(Some(Strategy::TopK), 0.3, 10.12, 1.2, 0.78);
        let r = report(20, 10.0, vec![one.clone(), one_masked, topk]);
        assert!(r.rows[0].is_dense() && !one.is_dense());
        assert_eq!(frontier(&r.rows, 2.0), 2, "eval reports the cheapest row");
        let rec = recommendation(&r.rows, 2.0, &r.text, r.windows, r.ctx).unwrap();
        assert_eq!((rec.sparsity, rec.ffn_bytes_rel_dense), (0.3, 0.78));
        let m = merge_reports(vec![("a.json".into(), r.clone()), ("b.json".into(), r)]).unwrap();
        assert_eq!(m.rows.len(), 7, "one dense row, and both reports' three others");
    }

    #[test]
    fn reports_of_different_evaluations_are_not_merged() {
        let a = || report(20, 10.0, vec![]);
        let e = merge_reports(vec![("a.json".into(), a()), ("b.json".into(), report(4, 10.0, vec![]))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("a.json and b.json") && e.contains("20 vs 4 windows"), "{e}");
        let e = merge_reports(vec![
            ("a.json".into(), a()),
            ("c.json".into(), report(20, 10.5, vec![])),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("dense perplexity 10.0000 vs 10.5000"), "{e}");
        let mut other = a();
        other.text = "wiki.train.raw".into();
        let e = merge_reports(vec![("a.json".into(), a()), ("d.json".into(), other)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("text wiki.test.raw vs wiki.train.raw"), "{e}");
        // A report written before the text was recorded merges with one that records it.
        let mut unrecorded = a();
        unrecorded.text = String::new();
        let m = merge_reports(vec![("old.json".into(), unrecorded), ("a.json".into(), a())]).unwrap();
        assert_eq!(m.text, "wiki.test.raw");
        assert!(merge_reports(vec![]).is_err());
    }
}
