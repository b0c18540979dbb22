//! Mixture-of-experts models: synthetic GGUFs of each architecture (`gatestream::synth`, made from
//! stories260K's tokenizer and weights — no real MoE weights are reachable here) checked against
//! a naive reference that computes every expert, against the dense model they were upcycled
//! from, and batched against token by token; top-K masks inside the experts and `eval` over
//! them; and the refusals (threshold and union masks, unsupported MoE architectures, malformed
//! expert tensors).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::*;
use gatestream::config::Arch;
use gatestream::gguf::MetaValue;
use gatestream::io::{ReadEngine, ReaderOptions};
use gatestream::kv::KvCache;
use gatestream::model::batch::Logits;
use gatestream::model::forward::FfnHooks;
use gatestream::model::weights::{FfnDown, FfnWeights, LayerFfn};
use gatestream::model::Placement;
use gatestream::model::{LoadOptions, Model};
use gatestream::quant::GgmlType;
use gatestream::stream::cache::CachePolicy;
use gatestream::stream::residency::Priority;
use gatestream::stream::{CostSource, Lookahead, StreamOptions, Streamer};
use gatestream::synth::{write_moe, MoeSpec, RandomShape};

const ARCHS: [Arch; 4] = [Arch::Llama, Arch::Qwen2Moe, Arch::Qwen3Moe, Arch::Olmoe];

fn stories_file(dir: &Path) -> PathBuf {
    write_temp(dir, "stories.gguf", &stories_gguf(Breakage::None))
}

fn spec(arch: Arch, ty: GgmlType, random: bool) -> MoeSpec {
    MoeSpec {
        arch,
        experts: 6,
        used: 2,
        ty,
        random: random.then_some(RandomShape {
            hidden: 64,
            ffn: 64,
            layers: 2,
            heads: 4,
            kv_heads: if arch == Arch::Olmoe { 4 } else { 2 },
        }),
        perturb: 0.05,
        seed: 7,
    }
}

fn make(dir: &Path, spec: &MoeSpec, name: &str) -> PathBuf {
    let out = dir.join(name);
    write_moe(&stories_file(dir), spec, &out, &mut |_, _| {}).unwrap();
    out
}

/// A random F32 model of each architecture (6 experts, 2 used) written into `dir`; glm4moe's
/// by `make-model` ([`glm_file`]).
fn random_f32_models(dir: &Path) -> Vec<(Arch, PathBuf)> {
    let mut all: Vec<(Arch, PathBuf)> = ARCHS
        .iter()
        .map(|&arch| {
            let path = make(dir, &spec(arch, GgmlType::F32, true), &format!("{}.gguf", arch.name()));
            (arch, path)
        })
        .collect();
    all.push((Arch::Glm4Moe, glm_file(dir, "glm4moe.gguf", 2, true)));
    all
}

/// A small glm4moe shape (`make-model --arch glm4moe --shape custom`): hidden 64, 2 layers
/// (the first dense, of width 128), 6 experts of 64 with `used` per token, one shared expert,
/// sigmoid scores with a score bias, renormalized; heads of 16 of which 8 rotate; Q/K/V biases.
fn glm_shape(used: usize) -> gatestream::synth::Shape {
    gatestream::synth::Shape {
        vocab: 512,
        context_len: 256,
        rope_theta: 10000.0,
        rms_eps: 1e-5,
        experts: Some((6, used)),
        rope_dim: Some(8),
        routing: Some(gatestream::synth::RoutingShape::glm(128)),
        ..gatestream::synth::Shape::custom(Arch::Glm4Moe, 64, 64, 2, 4, 2, 16)
    }
}

/// [`glm_shape`] written by `make-model` as a GGUF (F32 where `f32`, else Q8_0) into `dir`.
fn glm_file(dir: &Path, name: &str, used: usize, f32: bool) -> PathBuf {
    use gatestream::synth::{write_model, MakeSpec, Mix, OutputFormat, TokenizerChoice};
    let spec = MakeSpec {
        shape: glm_shape(used),
        mix: Mix::Q8_0,
        dequantize: f32,
        tokenizer: TokenizerChoice::Synthetic,
        seed: 11,
        residual_gain: 1.0,
    };
    let out = dir.join(name);
    write_model(&spec, &out, &OutputFormat::Gguf, true, &mut |_, _| {}).unwrap();
    out
}

fn load(path: &Path) -> Model {
    Model::load(path, &LoadOptions::default()).unwrap()
}

fn rows_f64(w: &gatestream::tensor::Weight) -> Vec<Vec<f64>> {
    let mut row = vec![0f32; w.cols];
    (0..w.rows)
        .map(|r| {
            w.dequantize_row(r, &mut row);
            row.iter().map(|&v| v as f64).collect()
        })
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// One dense SwiGLU FFN in f64.
fn ffn_f64(f: &FfnWeights, x: &[f64]) -> Vec<f64> {
    ffn_f64_keeping(f, x, None)
}

/// As `ffn_f64`, keeping only the `keep` neurons of largest |act(gate)| (ties to the lower
/// index) when given: a top-K gate mask.
fn ffn_f64_keeping(f: &FfnWeights, x: &[f64], keep: Option<usize>) -> Vec<f64> {
    let FfnDown::Rows(down) = &f.down else {
        panic!("GGUF experts store down as rows")
    };
    let (gate, up, down) = (rows_f64(&f.gate), rows_f64(&f.up), rows_f64(down));
    let act: Vec<f64> = gate
        .iter()
        .map(|g| {
            let g = dot(g, x);
            g / (1.0 + (-g).exp())
        })
        .collect();
    let mut hact: Vec<f64> = act.iter().zip(&up).map(|(a, u)| a * dot(u, x)).collect();
    if let Some(k) = keep {
        let mut order: Vec<usize> = (0..act.len()).collect();
        order.sort_by(|&a, &b| act[b].abs().total_cmp(&act[a].abs()).then(a.cmp(&b)));
        for &i in &order[k..] {
            hact[i] = 0.0;
        }
    }
    down.iter().map(|r| dot(r, &hact)).collect()
}

/// Every expert run on every token, then each token's top-K (by the router's softmax, most likely
/// first) summed with its weights, renormalized where the architecture does so; plus the shared
/// expert behind its sigmoid gate. Also the experts chosen.
fn naive_moe(model: &Model, l: usize, x: &[f32], n: usize) -> (Vec<f64>, Vec<usize>) {
    naive_moe_keeping(model, l, x, n, None)
}

/// As `naive_moe`, each routed expert keeping only its `keep` neurons of largest |act(gate)|
/// when given (the shared expert runs whole).
fn naive_moe_keeping(model: &Model, l: usize, x: &[f32], n: usize, keep: Option<usize>) -> (Vec<f64>, Vec<usize>) {
    let moe = model.config.moe.as_ref().unwrap();
    let LayerFfn::Experts(e) = &model.weights.layers[l].ffn else {
        panic!("a MoE layer")
    };
    let h = model.config.hidden;
    let router = rows_f64(&e.router);
    let mut out = Vec::with_capacity(n * h);
    let mut used = Vec::new();
    for t in 0..n {
        let xt: Vec<f64> = x[t * h..(t + 1) * h].iter().map(|&v| v as f64).collect();
        let all: Vec<Vec<f64>> = e.experts.iter().map(|f| ffn_f64_keeping(f, &xt, keep)).collect();
        let logits: Vec<f64> = router.iter().map(|r| dot(r, &xt)).collect();
        // Scores: softmax, or each logit's sigmoid (GLM-4.5).
        let p: Vec<f64> = match moe.gating {
            gatestream::config::Gating::Softmax => {
                let max = logits.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = logits.iter().map(|v| (v - max).exp()).sum();
                logits.iter().map(|v| (v - max).exp() / z).collect()
            }
            gatestream::config::Gating::Sigmoid => logits.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
        };
        // The score bias chooses; the scores weigh.
        let bias = e.score_bias.clone().unwrap_or_else(|| vec![0.0; moe.n_experts]);
        let choose: Vec<f64> = p.iter().zip(&bias).map(|(a, b)| a + *b as f64).collect();
        let mut order: Vec<usize> = (0..moe.n_experts).collect();
        order.sort_by(|&a, &b| choose[b].partial_cmp(&choose[a]).unwrap());
        let chosen = &order[..moe.n_used];
        used.extend_from_slice(chosen);
        let sum: f64 = chosen.iter().map(|&i| p[i]).sum();
        let mut y = vec![0f64; h];
        for &i in chosen {
            let w = if moe.normalize { p[i] / sum } else { p[i] } * moe.routed_scale as f64;
            y.iter_mut().zip(&all[i]).for_each(|(a, b)| *a += w * b);
        }
        match &e.shared {
            Some((shared, Some(gate))) => {
                let g: f64 = gate.iter().zip(&xt).map(|(a, b)| *a as f64 * b).sum();
                let s = ffn_f64(shared, &xt);
                y.iter_mut().zip(&s).for_each(|(a, b)| *a += b / (1.0 + (-g).exp()));
            }
            // Not gated (GLM-4.5): added as it is.
            Some((shared, None)) => {
                let s = ffn_f64(shared, &xt);
                y.iter_mut().zip(&s).for_each(|(a, b)| *a += b);
            }
            None => {}
        }
        out.extend(y);
    }
    (out, used)
}

/// Asserts the largest |got - want| is at most 1e-4 of the reference's largest magnitude, which
/// it returns.
fn assert_near_reference(got: &[f32], want: &[f64], what: &str) -> f64 {
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0f64, f64::max);
    assert!(
        worst <= 1e-4 * scale,
        "{what}: |gatestream - reference| {worst:.3e} of {scale:.3e}"
    );
    scale
}

#[test]
fn every_architecture_matches_the_naive_all_experts_reference() {
    let tmp = tempfile::tempdir().unwrap();
    for (arch, path) in random_f32_models(tmp.path()) {
        let model = load(&path);
        let moe = model.config.moe.clone().unwrap();
        assert_eq!((moe.n_experts, moe.n_used), (6, 2), "{arch:?}");
        let glm = arch == Arch::Glm4Moe;
        assert_eq!(
            moe.normalize,
            matches!(arch, Arch::Llama | Arch::Qwen3Moe | Arch::Glm4Moe),
            "{arch:?}"
        );
        assert_eq!(
            moe.shared_ffn > 0,
            matches!(arch, Arch::Qwen2Moe | Arch::Glm4Moe),
            "{arch:?}"
        );
        assert_eq!(moe.shared_gated, arch == Arch::Qwen2Moe, "{arch:?}");
        assert_eq!((moe.score_bias, moe.leading_dense), (glm, glm as usize), "{arch:?}");
        if glm {
            assert_eq!(moe.gating, gatestream::config::Gating::Sigmoid);
            assert_eq!((moe.dense_ffn, model.config.rope_dims()), (128, 8));
            assert!(model.config.attn_bias && !model.config.qk_norm);
        }
        let (h, n) = (model.config.hidden, 9);
        // Inputs of unit RMS, different per token so tokens route differently.
        let x: Vec<f32> = (0..n * h)
            .map(|i| ((i * 7919 % 613) as f32 / 306.5 - 1.0) * 1.7)
            .collect();
        let mut experts_used = std::collections::BTreeSet::new();
        for l in 0..model.config.n_layers {
            let w = &model.weights.layers[l];
            let got = model.device.download(
                model
                    .ffn(l, w, &model.device.upload(n, h, x.clone()), &FfnHooks::dense())
                    .unwrap(),
            );
            let dense = &w.ffn;
            if let LayerFfn::Dense(f) = dense {
                // GLM's leading dense layer: a plain FFN of its own width.
                assert!(l < moe.leading_dense, "{arch:?}: layer {l} is dense");
                assert_eq!(f.gate.rows, moe.dense_ffn);
                let want: Vec<f64> = (0..n)
                    .flat_map(|t| ffn_f64(f, &x[t * h..(t + 1) * h].iter().map(|&v| v as f64).collect::<Vec<_>>()))
                    .collect();
                assert_near_reference(&got, &want, &format!("{arch:?} dense layer {l}"));
                continue;
            }
            let (want, used) = naive_moe(&model, l, &x, n);
            experts_used.extend(used);
            let scale = assert_near_reference(&got, &want, &format!("{arch:?} layer {l}"));
            // Batched (tokens grouped per expert) equals one token at a time.
            for t in 0..n {
                let one = model.device.download(
                    model
                        .ffn(
                            l,
                            w,
                            &model.device.upload(1, h, x[t * h..(t + 1) * h].to_vec()),
                            &FfnHooks::dense(),
                        )
                        .unwrap(),
                );
                let d = one
                    .iter()
                    .zip(&got[t * h..(t + 1) * h])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    d as f64 <= 1e-5 * scale,
                    "{arch:?} layer {l} token {t}: batched vs alone {d}"
                );
            }
        }
        assert!(
            experts_used.len() >= 4,
            "{arch:?}: the tokens used only experts {experts_used:?}"
        );
    }
}

/// `--experts-used K` (`LoadOptions::experts_used`): each architecture routes every token to K
/// experts (the naive reference with K, K experts per token), K equal to the model's own count
/// changes nothing, and a dense model or a K outside 1..=experts is refused with the range.
#[test]
fn experts_used_routes_each_token_to_that_many_experts() {
    let tmp = tempfile::tempdir().unwrap();
    for (arch, path) in random_f32_models(tmp.path()) {
        let with = |k: Option<usize>| {
            Model::load(
                &path,
                &LoadOptions {
                    experts_used: k,
                    ..LoadOptions::default()
                },
            )
        };
        let own = load(&path);
        let (h, n) = (own.config.hidden, 5);
        let x: Vec<f32> = (0..n * h)
            .map(|i| ((i * 7919 % 613) as f32 / 306.5 - 1.0) * 1.7)
            .collect();
        // The first layer of experts (GLM's first layer is dense).
        let l0 = own.config.moe.as_ref().unwrap().leading_dense;
        let ffn = |m: &Model| {
            let w = &m.weights.layers[l0];
            m.device.download(
                m.ffn(l0, w, &m.device.upload(n, h, x.clone()), &FfnHooks::dense())
                    .unwrap(),
            )
        };
        let same = with(Some(2)).unwrap();
        assert_eq!(ffn(&same), ffn(&own), "{arch:?}: K = the model's own count");
        for k in [1, 4] {
            let m = with(Some(k)).unwrap();
            assert_eq!(m.config.moe.as_ref().unwrap().n_used, k);
            let got = ffn(&m);
            let (want, used) = naive_moe(&m, l0, &x, n);
            assert_eq!(used.len(), n * k, "{arch:?} K={k}: experts per token");
            assert_near_reference(&got, &want, &format!("{arch:?} K={k}"));
            assert_ne!(
                got,
                ffn(&own),
                "{arch:?} K={k}: no different from the model's own count"
            );
        }
        for k in [0, 7] {
            let e = with(Some(k)).err().expect("out of range").to_string();
            assert!(e.contains("has 6 experts") && e.contains("give 1 to 6"), "{e}");
        }
    }
    let dense = stories_file(tmp.path());
    let e = Model::load(
        &dense,
        &LoadOptions {
            experts_used: Some(1),
            ..LoadOptions::default()
        },
    )
    .err()
    .expect("dense refused")
    .to_string();
    assert!(e.contains("--experts-used applies to mixture-of-experts models"), "{e}");
}

/// `eval` on a mixture of experts: the dense row is `perplexity`'s, a row of fewer experts with
/// every neuron is the model loaded with that count, masks run inside the experts (both
/// selections composed), the bytes model counts routed experts, and what cannot run inside
/// experts is refused with what can.
#[test]
fn eval_measures_masks_inside_experts_and_fewer_experts() {
    use gatestream::eval::{eval, EvalOptions};
    use gatestream::perplexity::{perplexity, PerplexityOptions};
    use gatestream::sparsity::{Criterion, Strategy};
    let tmp = tempfile::tempdir().unwrap();
    let path = make(tmp.path(), &spec(Arch::Qwen2Moe, GgmlType::Q8_0, true), "m.gguf");
    let model = load(&path);
    let text = std::fs::read_to_string(data_dir().join("wikitext-2/wiki.test.raw")).unwrap();
    let opts = EvalOptions {
        ctx: 64,
        windows: 2,
        sparsities: vec![0.0, 0.5],
        strategies: vec![Strategy::TopK],
        criteria: vec![Criterion::Gate, Criterion::Exact],
        calibrate_tokens: 0,
        max_ppl_increase_pct: 1e9,
        per_layer_tokens: 0,
        checkpoint: None,
        windows_this_run: None,
        jitter_seeds: 0,
        experts: None,
    };
    let r = eval(&model, &text, "wiki", &opts, &mut |_, _, _| {}).unwrap().unwrap();
    assert_eq!(r.experts_per_token, Some(2));
    // Dense; gate and exact at 0.5; then one expert: every neuron, gate, exact.
    let shape: Vec<(Option<usize>, Option<Strategy>, Option<Criterion>)> = r
        .rows
        .iter()
        .map(|x| (x.experts_used, x.strategy, x.criterion))
        .collect();
    let (t, g, e) = (Some(Strategy::TopK), Some(Criterion::Gate), Some(Criterion::Exact));
    assert_eq!(
        shape,
        vec![
            (None, None, None),
            (None, t, g),
            (None, t, e),
            (Some(1), None, None),
            (Some(1), t, g),
            (Some(1), t, e)
        ]
    );
    let ppl = |experts_used: Option<usize>| {
        let m = Model::load(
            &path,
            &LoadOptions {
                experts_used,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        let o = PerplexityOptions { ctx: 64, windows: 2 };
        perplexity(&m, &text, &o, &mut |_, _, _| {}).unwrap().perplexity
    };
    assert_eq!(r.rows[0].perplexity, ppl(None), "the dense row");
    assert_eq!(r.rows[3].perplexity, ppl(Some(1)), "one expert, every neuron");
    let rows = &r.rows;
    for row in &rows[1..] {
        assert!(row.mean_kl > 0.0 && row.perplexity != rows[0].perplexity, "{row:?}");
    }
    for i in [1, 2, 4, 5] {
        assert_eq!(rows[i].achieved_sparsity_mean, 0.5, "{:?}", rows[i]);
    }
    // Bytes: the router and shared expert every token, then per routed expert; one expert of
    // two reads a little over half, and a mask at 0.5 less again; gate reads fewer up rows
    // than exact.
    let rel: Vec<f64> = rows.iter().map(|x| x.ffn_bytes_rel_dense).collect();
    assert!(rel[3] > 0.5 && rel[3] < 0.75, "{rel:?}");
    assert!(
        rel[1] < rel[2] && rel[2] < 1.0 && rel[4] < rel[5] && rel[5] < rel[3],
        "{rel:?}"
    );
    let table = gatestream::eval::table(&r);
    assert!(
        table.contains("mixture of experts, 2 per token") && table.contains("experts strategy"),
        "{table}"
    );
    let labels: Vec<String> = rows.iter().map(|x| x.label()).collect();
    assert_eq!(labels[3], "every neuron · 1 expert per token");
    assert_eq!(labels[5], "topk exact 0.50 · 1 expert per token");

    for (change, want) in [
        (
            EvalOptions {
                strategies: vec![Strategy::Threshold],
                ..opts.clone()
            },
            "use --strategy topk",
        ),
        (
            EvalOptions {
                criteria: vec![Criterion::Sketch],
                ..opts.clone()
            },
            "sketch",
        ),
        (
            EvalOptions {
                experts: Some(vec![7]),
                ..opts.clone()
            },
            "from 1 to 6",
        ),
    ] {
        let e = eval(&model, &text, "wiki", &change, &mut |_, _, _| {})
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(want), "{e}");
    }
    let dense = Model::load(&stories_file(tmp.path()), &LoadOptions::default()).unwrap();
    let e = eval(
        &dense,
        &text,
        "wiki",
        &EvalOptions {
            experts: Some(vec![1]),
            ..opts.clone()
        },
        &mut |_, _, _| {},
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("this model is dense"), "{e}");
}

/// Hooks with `mask` and nothing else.
fn masked(mask: Option<&dyn gatestream::model::forward::FfnMask>) -> FfnHooks<'_> {
    FfnHooks {
        observe: None,
        mask,
        stream: None,
        cancel: None,
    }
}

/// A top-K gate mask runs inside each routed expert: every architecture matches the naive
/// reference whose experts keep their `keep` largest |act(gate)| neurons (the shared expert
/// whole), the mask at sparsity 0 changes nothing bit for bit, and a mask asking for fewer
/// experts per token equals the model loaded with that count, bit for bit.
#[test]
fn topk_masks_run_inside_each_routed_expert() {
    use gatestream::sparsity::{Criterion, Masker, Strategy};
    let tmp = tempfile::tempdir().unwrap();
    for (arch, path) in random_f32_models(tmp.path()) {
        let model = load(&path);
        let (h, n, f) = (model.config.hidden, 7, model.config.ffn);
        let x: Vec<f32> = (0..n * h)
            .map(|i| ((i * 7919 % 613) as f32 / 306.5 - 1.0) * 1.7)
            .collect();
        let ffn = |m: &Model, mask: Option<&dyn gatestream::model::forward::FfnMask>| {
            let w = &m.weights.layers[1];
            let hooks = masked(mask);
            m.device
                .download(m.ffn(1, w, &m.device.upload(n, h, x.clone()), &hooks).unwrap())
        };
        let unmasked = ffn(&model, None);
        let half = Masker::new(&model, Strategy::TopK, Criterion::Gate, 0.5, None, None);
        let got = ffn(&model, Some(&half));
        let (want, _) = naive_moe_keeping(&model, 1, &x, n, Some(f / 2));
        assert_near_reference(&got, &want, &format!("{arch:?} top-K gate 0.5 inside experts"));
        assert_ne!(got, unmasked, "{arch:?}: the mask changed nothing");
        // Half of each routed expert's neuron slots kept: 2 experts × 7 tokens × f.
        let achieved = half.achieved_sparsity();
        assert_eq!(achieved[1], 0.5, "{arch:?}");
        assert_eq!(half.counters().total[1], (2 * n * f) as u64, "{arch:?}");

        let none = Masker::new(&model, Strategy::TopK, Criterion::Exact, 0.0, None, None);
        assert_eq!(
            ffn(&model, Some(&none)),
            unmasked,
            "{arch:?}: sparsity 0 changed the output"
        );
        let one = Masker::new(&model, Strategy::TopK, Criterion::Gate, 0.0, None, None).with_experts_used(Some(1));
        let loaded_one = Model::load(
            &path,
            &LoadOptions {
                experts_used: Some(1),
                ..LoadOptions::default()
            },
        )
        .unwrap();
        assert_eq!(
            ffn(&model, Some(&one)),
            ffn(&loaded_one, None),
            "{arch:?}: one expert through the mask"
        );
        // Both selections composed: one expert per token, half its neurons.
        let both = Masker::new(&model, Strategy::TopK, Criterion::Gate, 0.5, None, None).with_experts_used(Some(1));
        let (want, used) = naive_moe_keeping(&loaded_one, 1, &x, n, Some(f / 2));
        assert_eq!(used.len(), n);
        assert_near_reference(
            &ffn(&model, Some(&both)),
            &want,
            &format!("{arch:?} one expert, half its neurons"),
        );
        // Masks keeping per-layer state over a dense layer's neurons are refused by name.
        let union = Masker::new(&model, Strategy::Union, Criterion::Gate, 0.5, None, None);
        let w = &model.weights.layers[1];
        let hooks = masked(Some(&union));
        let e = model
            .ffn(1, w, &model.device.upload(n, h, x.clone()), &hooks)
            .err()
            .expect("union refused")
            .to_string();
        assert!(e.contains("top-K") && e.contains("union"), "{e}");
        // `run --mode sparse` asks for its mask by name: refused before any pass.
        let e = Masker::for_model(&model, Strategy::Threshold, Criterion::Exact, 0.5, None)
            .err()
            .expect("threshold refused")
            .to_string();
        assert!(
            e.contains("top-K masks inside each routed expert") && e.contains("threshold"),
            "{e}"
        );
        assert!(Masker::for_model(&model, Strategy::TopK, Criterion::Candidates, 0.5, None).is_ok());
    }
}

#[test]
fn route_takes_the_most_likely_and_renormalizes_only_where_told() {
    use gatestream::model::ffn::route;
    let mut moe = gatestream::config::MoeConfig::softmax(4, 2, false);
    let logits = [0.0f32, 2.0, 1.0, 2.0];
    let z: f32 = logits.iter().map(|v| v.exp()).sum();
    let r = route(&logits, &moe, None);
    // Ties go to the lower index; weights are the softmax's.
    assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 3]);
    assert!((r[0].1 - 2f32.exp() / z).abs() < 1e-6 && (r[1].1 - 2f32.exp() / z).abs() < 1e-6);
    moe.normalize = true;
    let r = route(&logits, &moe, None);
    assert!((r[0].1 - 0.5).abs() < 1e-6 && (r[1].1 - 0.5).abs() < 1e-6, "{r:?}");
    // Sigmoid scores; a score bias chooses (expert 2 over 3) but does not weigh; the scale
    // multiplies the renormalized weights.
    moe.gating = gatestream::config::Gating::Sigmoid;
    moe.routed_scale = 2.5;
    let s = |v: f32| 1.0 / (1.0 + (-v).exp());
    let r = route(&logits, &moe, Some(&[0.0, 0.0, 0.5, 0.0]));
    assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), [2, 1], "{r:?}");
    let sum = s(1.0) + s(2.0);
    assert!((r[0].1 - 2.5 * s(1.0) / sum).abs() < 1e-6, "{r:?}");
    assert!((r[1].1 - 2.5 * s(2.0) / sum).abs() < 1e-6, "{r:?}");
    // Grouped: experts {0, 1} and {2, 3}, one group used: group {0, 1} scores 0 + 2 and
    // {2, 3} 1 + 2 by the logits' sigmoids, so the choice is made within {2, 3}.
    moe.n_groups = 2;
    moe.groups_used = 1;
    moe.routed_scale = 1.0;
    let r = route(&[0.0, 2.0, 1.0, 2.0], &moe, None);
    assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), [3, 2], "{r:?}");
    let r = route(&[0.5, 2.5, 0.0, 1.2], &moe, None);
    assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 0], "{r:?}");
}

/// Identical experts (no perturbation) whose weights sum to one are the dense FFN: the upcycled
/// models give the dense stories260K's logits — Mixtral-style exactly (to f32 rounding); Qwen3-MoE
/// and OLMoE through their near-identity QK-norm (`synth::QK_LINEAR_EPS`, the residual stream
/// scaled by `QK_RESIDUAL_SCALE`) to within 0.5% of the logits' range, with the same greedy token
/// at every position. (QK-norm weights that normalize Q and K to a fixed RMS instead, as an earlier
/// version wrote, differ by far more: the models were damaged beyond use.)
#[test]
fn identical_renormalized_experts_equal_the_dense_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dense = load(&stories_file(tmp.path()));
    let prompt = dense
        .tokenizer
        .encode(
            "Once upon a time, there was a dog who liked to play in the park with his friends",
            true,
        )
        .unwrap();
    let v = dense.config.vocab;
    let mut c1 = KvCache::new(&dense.config, 64);
    let a = dense.forward(&prompt, &mut c1, Logits::From(0)).unwrap();
    let range = a.iter().fold(f32::MIN, |m, &x| m.max(x)) - a.iter().fold(f32::MAX, |m, &x| m.min(x));
    let argmax = |row: &[f32]| (0..row.len()).max_by(|&i, &j| row[i].total_cmp(&row[j])).unwrap();
    for (arch, tolerance) in [
        (Arch::Llama, 1e-3),
        (Arch::Qwen3Moe, 0.005 * range),
        (Arch::Olmoe, 0.005 * range),
    ] {
        let mut s = spec(arch, GgmlType::F32, false);
        s.perturb = 0.0;
        if arch == Arch::Olmoe {
            // Not renormalized: the weights sum to one only when every expert is used.
            (s.experts, s.used) = (2, 2);
        }
        let moe = load(&make(tmp.path(), &s, &format!("upcycled-{}.gguf", arch.name())));
        let mut c2 = KvCache::new(&moe.config, 64);
        let b = moe.forward(&prompt, &mut c2, Logits::From(0)).unwrap();
        assert_eq!(a.len(), prompt.len() * v);
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        eprintln!("{}: max |logit difference| {d} (logits' range {range})", arch.name());
        assert!(d < tolerance, "{}: upcycled vs dense logits differ by {d}", arch.name());
        for (p, (ra, rb)) in a.chunks_exact(v).zip(b.chunks_exact(v)).enumerate() {
            assert_eq!(argmax(ra), argmax(rb), "{}: greedy token at position {p}", arch.name());
        }
    }
}

/// Each architecture, random Q8_0 weights (experts and attention): a batched prompt gives the
/// logits of feeding it token by token.
#[test]
fn batched_prefill_equals_token_by_token_for_each_architecture() {
    let tmp = tempfile::tempdir().unwrap();
    for arch in ARCHS {
        let model = load(&make(
            tmp.path(),
            &spec(arch, GgmlType::Q8_0, true),
            &format!("{}.gguf", arch.name()),
        ));
        let prompt = model
            .tokenizer
            .encode("Once upon a time, there was a dog", true)
            .unwrap();
        for (i, d) in batched_vs_one_by_one(&model, &prompt).into_iter().enumerate() {
            assert!(d < 1e-3, "{arch:?} position {i}: logits differ by {d}");
        }
    }
}

#[test]
fn masks_streaming_and_reformat_are_refused_for_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let path = make(tmp.path(), &spec(Arch::Qwen3Moe, GgmlType::Q8_0, true), "m.gguf");
    let model = load(&path);
    // A mask that keeps per-layer state (as a threshold or union mask does: not inside experts).
    struct LayerState;
    impl gatestream::model::forward::FfnMask for LayerState {
        fn apply(&self, _: usize, _: &[f32], _: &[f32], _: &[f32], _: &mut [f32]) {}
    }
    let hooks = FfnHooks {
        mask: Some(&LayerState),
        ..FfnHooks::dense()
    };
    let mut cache = KvCache::new(&model.config, 8);
    let e = model
        .forward_with(&[1, 2], &mut cache, Logits::Last, &hooks)
        .unwrap_err()
        .to_string();
    assert!(e.contains("mixture-of-experts") && e.contains("top-K"), "{e}");
    // Neuron statistics inside experts are not built: calibration is refused, nothing written.
    let opts = gatestream::reformat::ReformatOptions {
        calibrate_text: Some(tmp.path().join("text.txt")),
        ..Default::default()
    };
    let e = gatestream::reformat::reformat(&path, &tmp.path().join("m.gst"), &opts, &mut |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("mixture-of-experts") && e.contains("--calibrate"), "{e}");
    assert!(!tmp.path().join("m.gst").exists());
    // A dense model's neuron cache has no frequency policy.
    let dense = tmp.path().join("dense.gst");
    gatestream::reformat::reformat(
        &stories_file(tmp.path()),
        &dense,
        &Default::default(),
        &mut |_, _, _| {},
    )
    .unwrap();
    let m = Model::load(&dense, &on_disk()).unwrap();
    let e = Streamer::open(
        &m,
        &stream_options(1 << 30, ReadEngine::Pread, CachePolicy::Frequency, false),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("--cache frequency"), "{e}");
}

fn on_disk() -> LoadOptions {
    LoadOptions {
        placement: Placement::OnDisk,
        ..LoadOptions::default()
    }
}

fn stream_options(budget_bytes: u64, engine: ReadEngine, cache: CachePolicy, lookahead: bool) -> StreamOptions {
    StreamOptions {
        budget_bytes,
        engine,
        reader: ReaderOptions::default(),
        cache,
        priority: Priority::CacheFirst,
        prefetch_ffn: false,
        merge_gap_bytes: None,
        cost: CostSource::Default,
        lookahead: if lookahead {
            Lookahead::FromGates
        } else {
            Lookahead::Off
        },
        kv_positions: 64,
        batch_tokens_max: 32,
        vram_budget_bytes: None,
        prefetch_buffers: gatestream::stream::PREFETCH_BUFFERS,
        prefetch_read_bytes: gatestream::stream::PREFETCH_READ_BYTES,
    }
}

/// The smallest budget a `.gst` MoE model streams under (from the refusal of a zero budget).
/// A random Q8_0 model of `arch` (see [`spec`]) reformatted to a `.gst` in `dir`.
fn random_gst(dir: &Path, arch: Arch) -> PathBuf {
    let gguf = make(dir, &spec(arch, GgmlType::Q8_0, true), &format!("{}.gguf", arch.name()));
    let gst = dir.join(format!("{}.gst", arch.name()));
    gatestream::reformat::reformat(&gguf, &gst, &Default::default(), &mut |_, _, _| {}).unwrap();
    gst
}

fn min_budget(path: &Path, lookahead: bool) -> u64 {
    let m = Model::load(path, &on_disk()).unwrap();
    let e = Streamer::open(&m, &stream_options(0, ReadEngine::Pread, CachePolicy::Lru, lookahead))
        .err()
        .expect("a zero budget is refused")
        .to_string();
    assert!(e.contains("mixture-of-experts") && e.contains("one"), "{e}");
    budget_in_refusal(&e)
}

/// Each architecture reformatted to `.gst` equals its GGUF in RAM bit for bit; streamed from the `.gst` under budgets
/// from one expert's room to every expert, with each reader, LRU and frequency caches, with and
/// without lookahead, the logits of a prompt and four greedy steps are bit-identical to the
/// `.gst` model's in RAM. The counters show the cache and lookahead at work.
#[test]
fn streamed_experts_equal_the_in_ram_gst_model_for_every_reader() {
    let tmp = tempfile::tempdir().unwrap();
    let text = "Once upon a time, there was a little dog";
    for arch in ARCHS {
        // Three experts per token: the order their outputs are added in shows in the rounding.
        let three = MoeSpec {
            used: 3,
            ..spec(arch, GgmlType::F32, true)
        };
        let gguf = make(tmp.path(), &three, &format!("{}.gguf", arch.name()));
        let gst = tmp.path().join(format!("{}.gst", arch.name()));
        gatestream::reformat::reformat(&gguf, &gst, &Default::default(), &mut |_, _, _| {}).unwrap();
        // Experts keep the checkpoint's bytes and layout, so the `.gst` computes exactly as the GGUF.
        let from_gguf = prompt_then_greedy(&load(&gguf), None, None, text, 4);
        let reference = prompt_then_greedy(&load(&gst), None, None, text, 4);
        assert!(
            from_gguf
                .iter()
                .zip(&reference)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{arch:?}: the .gst in RAM differs from the GGUF"
        );

        let m = Model::load(&gst, &on_disk()).unwrap();
        // With a top-K mask inside the routed experts too (the experts are computed where their
        // bytes are, with the same arithmetic).
        let mask = gatestream::sparsity::Masker::new(
            &m,
            gatestream::sparsity::Strategy::TopK,
            gatestream::sparsity::Criterion::Exact,
            0.5,
            None,
            None,
        );
        let masked_reference = prompt_then_greedy(&load(&gst), None, Some(&mask), text, 4);
        let cfg = &m.config;
        let moe = cfg.moe.clone().unwrap();
        let all_experts = (cfg.n_layers * moe.n_experts) as u64;
        for lookahead in [false, true] {
            let min = min_budget(&gst, lookahead);
            let s = Streamer::open(&m, &stream_options(min, ReadEngine::Pread, CachePolicy::Lru, lookahead)).unwrap();
            let expert_bytes = s.experts.as_ref().unwrap().expert_bytes;
            assert_eq!(
                s.experts.as_ref().unwrap().cache_slots,
                1,
                "the minimum holds one expert"
            );
            let budgets = [min, min + 3 * expert_bytes, min + all_experts * expert_bytes];
            for (b, budget) in budgets.into_iter().enumerate() {
                for engine in [ReadEngine::Pread, ReadEngine::Uring, ReadEngine::Mmap] {
                    for policy in [CachePolicy::Lru, CachePolicy::Frequency] {
                        let what = format!("{arch:?} budget {b} {engine:?} {policy:?} lookahead {lookahead}");
                        let s = Streamer::open(&m, &stream_options(budget, engine, policy, lookahead)).unwrap();
                        let got = prompt_then_greedy(&m, Some(&s), None, text, 4);
                        assert!(
                            got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{what}: streamed logits differ from in RAM"
                        );
                        if policy == CachePolicy::Lru {
                            let s = Streamer::open(&m, &stream_options(budget, engine, policy, lookahead)).unwrap();
                            let got = prompt_then_greedy(&m, Some(&s), Some(&mask), text, 4);
                            assert!(
                                got.iter()
                                    .zip(&masked_reference)
                                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                                "{what}: streamed logits with a mask inside the experts differ from in RAM"
                            );
                            assert_ne!(got, reference, "{what}: the mask changed nothing");
                        }
                        let c = s.counters();
                        let x = s.experts.as_ref().unwrap();
                        assert!(x.cached() <= x.cache_slots, "{what}: {} cached", x.cached());
                        assert!(c.cache_lookups > 0 && c.ffn_reads > 0, "{what}: {c:?}");
                        if b == 2 {
                            // Every expert fits: each is read at most once, later uses are hits.
                            assert!(c.ffn_reads + c.ahead_neurons <= all_experts, "{what}: {c:?}");
                            assert!(c.cache_hits > 0, "{what}: {c:?}");
                        }
                        if lookahead && b < 2 {
                            // (With every expert cached after the prompt, there is nothing to read ahead.)
                            assert!(c.ahead_neurons > 0, "{what}: nothing read ahead");
                        } else if !lookahead {
                            assert_eq!(c.ahead_neurons, 0, "{what}");
                        }
                    }
                }
            }
        }
    }
}

/// Experts streamed to a device with memory of its own (the host stand-in, which copies the
/// stream's cache slots at each use and keeps resident weights by address, as the CUDA device
/// does): the same logits as the `.gst` in RAM on the CPU, bit for bit, for each architecture at
/// the minimum budget (one cache slot, refilled by every expert) and with room for three.
#[test]
fn streamed_experts_feed_a_device_with_memory_of_its_own() {
    use gatestream::backend::standin::HostStandIn;
    use gatestream::backend::HostLink;
    let tmp = tempfile::tempdir().unwrap();
    let text = "Once upon a time, there was a little dog";
    for arch in ARCHS {
        let gst = random_gst(tmp.path(), arch);
        let reference = prompt_then_greedy(&load(&gst), None, None, text, 4);
        let min = min_budget(&gst, false);
        for (b, extra) in [0u64, 3].into_iter().enumerate() {
            let dev = Arc::new(HostStandIn::new(0));
            let m = Model::load_on(&gst, &on_disk(), dev.clone()).unwrap();
            let probe = Streamer::open(&m, &stream_options(min, ReadEngine::Pread, CachePolicy::Lru, false)).unwrap();
            let budget = min + extra * probe.experts.as_ref().unwrap().expert_bytes;
            drop(probe);
            let s = Streamer::open(&m, &stream_options(budget, ReadEngine::Uring, CachePolicy::Lru, false)).unwrap();
            let got = prompt_then_greedy(&m, Some(&s), None, text, 4);
            assert!(
                got.len() == reference.len() && got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{arch:?} budget {b}: streamed to the stand-in differs from in RAM"
            );
            let (resident, volatile) = dev.copied_bytes();
            assert!(
                resident > 0 && volatile > 0,
                "{arch:?}: {resident} resident, {volatile} volatile bytes"
            );
            // A GPU budget: the plan keeps the output, then attention and routers (with any
            // shared expert) by layer while it lasts; the rest, and the routed experts, are
            // copied at each use. The same logits, bit for bit.
            let vram_opts = |v: u64| StreamOptions {
                vram_budget_bytes: Some(v),
                ..stream_options(budget, ReadEngine::Pread, CachePolicy::Lru, false)
            };
            let e = Streamer::open(&m, &vram_opts(0))
                .err()
                .expect("a zero GPU budget is refused")
                .to_string();
            let min_vram = budget_in_refusal(&e);
            let file_bytes = std::fs::metadata(&gst).unwrap().len();
            let vram = min_vram + file_bytes / 8;
            let dev = Arc::new(HostStandIn::new(0));
            let m = Model::load_on(&gst, &on_disk(), dev.clone()).unwrap();
            let s = Streamer::open(&m, &vram_opts(vram)).unwrap();
            let plan = s.device_plan.clone().expect("a device plan");
            let got = prompt_then_greedy(&m, Some(&s), None, text, 4);
            assert!(
                got.len() == reference.len() && got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{arch:?} budget {b}: streamed under a GPU budget differs from in RAM"
            );
            assert!(plan.resident_bytes() <= vram, "{arch:?}: {plan:?}");
            let kept = plan.attention_resident.iter().chain(&plan.gate_resident);
            assert!(
                kept.clone().any(|&k| k) && kept.clone().any(|&k| !k),
                "{arch:?}: {plan:?}"
            );
            let (resident, _) = dev.copied_bytes();
            assert!(
                resident > 0 && resident <= plan.output_bytes + plan.attention_bytes + plan.gate_bytes,
                "{arch:?}: {resident} resident bytes copied, plan {plan:?}"
            );
            // One decode step copies the plan's bytes per token: what it does not keep, and the
            // routed experts.
            let link0 = dev.link().unwrap();
            let ids = m.tokenizer.encode(text, true).unwrap();
            let mut cache = KvCache::new(&m.config, ids.len() + 2);
            let hooks = FfnHooks {
                observe: None,
                mask: None,
                stream: Some(&s),
                cancel: None,
            };
            m.forward_with(&ids, &mut cache, Logits::Last, &hooks).unwrap();
            let link1 = dev.link().unwrap();
            m.forward_with(&[ids[1]], &mut cache, Logits::Last, &hooks).unwrap();
            let step = dev.link().unwrap().minus(&link1);
            assert!(
                link1.volatile_bytes > link0.volatile_bytes,
                "{arch:?}: the prompt copied nothing"
            );
            assert_eq!(
                step.volatile_bytes, plan.copied_bytes_per_token,
                "{arch:?}: {step:?} vs {plan:?}"
            );
            // What the plan does not keep of the resident weights (attention; each layer's
            // router, with its shared expert's three matrices where there is one) is copied from
            // page-locked memory: one locked range each; and so are the routed experts, from the
            // expert cache's buffers, each locked once when made. Every copied byte is
            // page-locked.
            let shared = usize::from(matches!(arch, Arch::Qwen2Moe));
            let unkept = 4 * plan.attention_resident.iter().filter(|&&k| !k).count()
                + (1 + 3 * shared) * plan.gate_resident.iter().filter(|&&k| !k).count();
            // (A read ahead may still be making and locking a buffer: the two counts are taken
            // again until they are of one moment, for a second at most.)
            let counts = || (s.experts.as_ref().unwrap().locked_buffers(), dev.pinned_ranges());
            let mut seen = counts();
            for _ in 0..100 {
                if seen.1 == unkept + seen.0 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
                seen = counts();
            }
            let (buffers, pinned) = seen;
            assert!(buffers > 0, "{arch:?}: no expert buffer was locked");
            assert_eq!(pinned, unkept + buffers, "{arch:?}: {plan:?}");
            assert!(
                step.pinned_bytes > 0 && step.pinned_bytes == step.volatile_bytes,
                "{arch:?}: {step:?}"
            );
            drop(s);
            assert_eq!(dev.pinned_ranges(), 0, "{arch:?}: the locks go with the stream");
        }
    }
}

/// A GPU budget's stream with no RAM budget of its own holds the whole model in host RAM: every
/// expert is read into the cache at open (not on a prompt's first passes), and a prompt then
/// reads nothing from the file; the same logits as in RAM, bit for bit.
#[test]
fn a_gpu_budget_without_a_ram_budget_reads_every_expert_at_open() {
    use gatestream::backend::standin::HostStandIn;
    let tmp = tempfile::tempdir().unwrap();
    let text = "Once upon a time, there was a little dog";
    for arch in ARCHS {
        let gst = random_gst(tmp.path(), arch);
        let reference = prompt_then_greedy(&load(&gst), None, None, text, 4);
        let opts = |v: u64| StreamOptions {
            vram_budget_bytes: Some(v),
            ..stream_options(
                gatestream::stream::RAM_UNLIMITED,
                ReadEngine::Uring,
                CachePolicy::Lru,
                false,
            )
        };
        let m = Model::load_on(&gst, &on_disk(), Arc::new(HostStandIn::new(0))).unwrap();
        let e = Streamer::open(&m, &opts(0)).err().expect("refused").to_string();
        let vram = budget_in_refusal(&e) + std::fs::metadata(&gst).unwrap().len() / 8;
        let s = Streamer::open(&m, &opts(vram)).unwrap();
        let x = s.experts.as_ref().unwrap();
        assert_eq!(x.cached(), x.experts_total(), "{arch:?}: experts held at open");
        let before = s.counters();
        let got = prompt_then_greedy(&m, Some(&s), None, text, 4);
        assert!(
            got.len() == reference.len() && got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{arch:?}: differs from in RAM"
        );
        let c = s.counters();
        assert_eq!(
            c.ffn_reads, before.ffn_reads,
            "{arch:?}: experts read after open: {c:?}"
        );
        assert_eq!(
            c.cache_hits - before.cache_hits,
            c.cache_lookups - before.cache_lookups,
            "{arch:?}: {c:?}"
        );
    }
}

/// The hybrid executor on a mixture of experts (`--hybrid cpu-cold`, the stand-in as the GPU):
/// every routed expert computed by the CPU where the stream has it in host memory (cached, or
/// read on a miss), the routers, shared expert and attention by the device. The same logits as
/// the `.gst` in RAM, bit for bit, for each architecture; a decode step copies no expert across
/// the link (the step without the hybrid copies them), only their output rows.
#[test]
fn the_hybrid_executor_computes_routed_experts_on_the_cpu() {
    use gatestream::backend::standin::HostStandIn;
    use gatestream::backend::{HostLink, LinkCounters};
    use gatestream::stream::hybrid::HybridMode;
    let tmp = tempfile::tempdir().unwrap();
    let text = "Once upon a time, there was a little dog";
    for arch in ARCHS {
        let gst = random_gst(tmp.path(), arch);
        let reference = prompt_then_greedy(&load(&gst), None, None, text, 4);
        let min = min_budget(&gst, false);
        let expert_bytes = {
            let m = Model::load(&gst, &on_disk()).unwrap();
            let s = Streamer::open(&m, &stream_options(min, ReadEngine::Pread, CachePolicy::Lru, false)).unwrap();
            s.experts.as_ref().unwrap().expert_bytes
        };
        // Room for three experts: routed experts come from the cache or are read on a miss.
        let budget = min + 3 * expert_bytes;
        let vram_opts = |v: u64| StreamOptions {
            vram_budget_bytes: Some(v),
            ..stream_options(budget, ReadEngine::Uring, CachePolicy::Lru, false)
        };
        let file_bytes = std::fs::metadata(&gst).unwrap().len();
        let vram = {
            let m = Model::load_on(&gst, &on_disk(), Arc::new(HostStandIn::new(0))).unwrap();
            let e = Streamer::open(&m, &vram_opts(0)).err().expect("refused").to_string();
            budget_in_refusal(&e) + file_bytes / 8
        };
        // (logits, one decode step's link counters, the CPU's cold bytes, layers on the CPU)
        let run = |mode: HybridMode| -> (Vec<f32>, LinkCounters, u64, u64) {
            let dev = Arc::new(HostStandIn::new(0));
            let m = Model::load_on(&gst, &on_disk(), dev.clone()).unwrap();
            let mut s = Streamer::open(&m, &vram_opts(vram)).unwrap();
            assert_eq!(s.enable_hybrid(&m, mode, 1).unwrap(), None, "{arch:?}");
            assert_eq!(s.hybrid_plan().is_some(), mode == HybridMode::CpuCold, "{arch:?}");
            let got = prompt_then_greedy(&m, Some(&s), None, text, 4);
            let ids = m.tokenizer.encode(text, true).unwrap();
            let mut cache = KvCache::new(&m.config, ids.len() + 2);
            let hooks = FfnHooks {
                observe: None,
                mask: None,
                stream: Some(&s),
                cancel: None,
            };
            m.forward_with(&ids, &mut cache, Logits::Last, &hooks).unwrap();
            let (link1, c1) = (dev.link().unwrap(), s.counters());
            m.forward_with(&[ids[1]], &mut cache, Logits::Last, &hooks).unwrap();
            let c = s.counters().minus(&c1);
            (
                got,
                dev.link().unwrap().minus(&link1),
                c.cold_cpu_bytes,
                c.cold_cpu_layers,
            )
        };
        let (got, step, cpu_bytes, cpu_layers) = run(HybridMode::CpuCold);
        assert!(
            got.len() == reference.len() && got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{arch:?}: the hybrid differs from in RAM"
        );
        let (_, plain, plain_cpu, _) = run(HybridMode::GpuStream);
        let cfg = load(&gst).config;
        let (layers, used) = (cfg.n_layers as u64, cfg.moe.as_ref().unwrap().n_used as u64);
        assert_eq!((cpu_layers, plain_cpu), (layers, 0), "{arch:?}");
        // The step's routed experts: computed on the CPU, where the plain step copied them.
        assert!(
            cpu_bytes > 0 && cpu_bytes <= layers * used * expert_bytes,
            "{arch:?}: {cpu_bytes} vs {used} of {expert_bytes}-byte experts"
        );
        assert_eq!(
            step.volatile_bytes + cpu_bytes,
            plain.volatile_bytes,
            "{arch:?}: {step:?} vs {plain:?}"
        );
        // Each routed expert's output rows (one token: `hidden` floats each) crossed instead.
        assert!(
            step.activation_bytes >= plain.activation_bytes + layers * used * cfg.hidden as u64 * 4,
            "{arch:?}: {step:?} vs {plain:?}"
        );
    }
}

/// A GGUF with `general.architecture` and extra keys replaced, tensors as stories260K's.
/// The runtime (what `run --ram-budget` opens) on a MoE `.gst`: with no cache asked it uses an
/// LRU expert cache without the warning `--cache pinned` gets; `experts_used` reaches the
/// streamed model (K = 1 routes and reads fewer experts per token than the model's own 3).
#[test]
fn the_runtime_streams_experts_with_the_default_cache_and_experts_used() {
    use gatestream::runtime::{KvPositions, OpenOptions, StreamAsk};
    let tmp = tempfile::tempdir().unwrap();
    let gguf = make(
        tmp.path(),
        &MoeSpec {
            used: 3,
            ..spec(Arch::Qwen3Moe, GgmlType::F32, true)
        },
        "m.gguf",
    );
    let gst = tmp.path().join("m.gst");
    gatestream::reformat::reformat(&gguf, &gst, &Default::default(), &mut |_, _, _| {}).unwrap();
    let bytes = std::fs::metadata(&gst).unwrap().len();
    let open = |cache: Option<CachePolicy>, experts_used: Option<usize>| {
        gatestream::runtime::open(
            &gst,
            &OpenOptions {
                threads: 1,
                stream: Some(StreamAsk {
                    cache,
                    ..pread_stream(bytes + (64 << 20), 0)
                }),
                sparse: None,
                kv_positions: KvPositions::Exactly(16),
                experts_used,
            },
        )
        .unwrap()
    };
    let pinned = |rt: &gatestream::runtime::Runtime| rt.warnings.iter().any(|w| w.contains("--cache pinned"));
    assert!(!pinned(&open(None, None)), "the default cache warns");
    assert!(
        pinned(&open(Some(CachePolicy::Pinned), None)),
        "--cache pinned does not warn"
    );
    let routed = |k: Option<usize>| {
        let rt = open(None, k);
        let out = rt.generate(&[1, 5, 9], &greedy(4), false, None, &mut |_| {}).unwrap();
        out.stream.unwrap().experts.unwrap().routed_per_token
    };
    let (own, one) = (routed(None), routed(Some(1)));
    assert!(
        one > 0.0 && one * 3.0 <= own + 1e-9,
        "K = 1 routed {one} per token, the model's 3: {own}"
    );
}

/// `run --record-trace` on a mixture of experts writes a routing trace (one record per token
/// and layer, the experts each token was routed to), and `bench` replaying it through the
/// streamer's expert cache of the same size and policy finds the same hits as the live run: the
/// replay measures what streaming reads. Routing traces and traces of neurons are told apart.
#[test]
fn routing_traces_replay_the_live_expert_cache() {
    use gatestream::bench::experts::{bench_experts, ExpertBenchOptions};
    use gatestream::bench::trace::AnyTrace;
    use gatestream::bench::{BenchOptions, EngineConfig};
    use gatestream::runtime::{KvPositions, OpenOptions, StreamAsk};
    let tmp = tempfile::tempdir().unwrap();
    let gguf = make(tmp.path(), &spec(Arch::Llama, GgmlType::Q8_0, true), "m.gguf");
    let gst = tmp.path().join("m.gst");
    gatestream::reformat::reformat(&gguf, &gst, &Default::default(), &mut |_, _, _| {}).unwrap();
    let min = min_budget(&gst, false);
    let expert_bytes = {
        let m = Model::load(&gst, &on_disk()).unwrap();
        let s = Streamer::open(&m, &stream_options(min, ReadEngine::Pread, CachePolicy::Lru, false)).unwrap();
        s.experts.as_ref().unwrap().expert_bytes
    };
    let open = |policy: CachePolicy, budget: u64| {
        gatestream::runtime::open(
            &gst,
            &OpenOptions {
                threads: 1,
                stream: Some(StreamAsk {
                    cache: Some(policy),
                    ..pread_stream(budget, 1)
                }),
                sparse: None,
                kv_positions: KvPositions::Exactly(32),
                experts_used: None,
            },
        )
    };
    // The runtime's own smallest budget (its KV cache and batch differ from `min_budget`'s).
    let min = budget_in_refusal(&open(CachePolicy::Lru, 0).err().expect("refused").to_string());
    for policy in [CachePolicy::Lru, CachePolicy::Frequency] {
        let rt = open(policy, min + 2 * expert_bytes).unwrap();
        // One token per pass (a one-token prompt, then decoding), as the replay reads them.
        let opts = gatestream::model::generate::GenerateOptions {
            sampler: gatestream::model::sampler::SamplerConfig {
                temperature: 1.0,
                seed: 3,
                ..Default::default()
            },
            ..greedy(12)
        };
        let out = rt.generate(&[1], &opts, true, None, &mut |_| {}).unwrap();
        let live = out.stream.unwrap().experts.unwrap();
        assert_eq!(live.cache_slots, 3, "{policy:?}");
        let Some(AnyTrace::Routes(trace)) = out.trace else {
            panic!("{policy:?}: no routing trace")
        };
        let h = &trace.header;
        assert_eq!((h.n_layers, h.n_experts, h.n_used), (2, 6, 2), "{policy:?}");
        assert_eq!(h.tokens, out.generation.tokens.len(), "{policy:?}: a record per pass");
        assert!(trace
            .records
            .iter()
            .flatten()
            .all(|ids| ids.len() == 2 && ids[0] != ids[1]));
        assert!(
            trace.distinct_experts() > 3,
            "{policy:?}: routing too narrow to test a cache"
        );
        let path = tmp.path().join("routes.trace");
        AnyTrace::Routes(trace.clone()).write(&path).unwrap();
        let AnyTrace::Routes(back) = AnyTrace::read(&path).unwrap() else {
            panic!("read back as another kind")
        };
        assert_eq!(back, trace);
        let e = gatestream::bench::trace::Trace::read(&path).unwrap_err().to_string();
        assert!(e.contains("routing trace"), "{e}");

        let bench = BenchOptions {
            engines: vec![EngineConfig {
                engine: "pread",
                queue_depth: 8,
                fixed_buffers: false,
            }],
            tokens: usize::MAX,
            gate_streamed: false,
            cache_neurons: 0,
            baseline_sizes: vec![4096],
            baseline_random_reads: 16,
            baseline_seq_bytes: 1 << 20,
            merge_gap_bytes: None,
            token_batches: false,
        };
        let x = ExpertBenchOptions {
            cache_experts: vec![0, 3],
            policies: vec![CachePolicy::Lru, CachePolicy::Frequency],
        };
        let r = bench_experts(&gst, &[back], &bench, &x, &mut |_, _, _| {}).unwrap();
        let names: Vec<(&str, usize)> = r.passes.iter().map(|p| (p.policy, p.cache_experts)).collect();
        assert_eq!(names, vec![("none", 0), ("lru", 3), ("frequency", 3)]);
        let name = if policy == CachePolicy::Lru { "lru" } else { "frequency" };
        let replay = r.passes.iter().find(|p| p.policy == name).unwrap();
        assert_eq!(replay.tokens, h.tokens);
        // The live report counts decoding: every record but the first (the prompt's pass, which
        // finds the cache empty and reads its 4 experts).
        let t = h.tokens as f64;
        let count = |per_token: f64, tokens: f64| (per_token * tokens).round() as u64;
        let live_hits = count(live.cache_hit_rate * live.routed_per_token, t - 1.0);
        assert_eq!(
            count(replay.cache_hit_rate * replay.experts_routed_per_token, t),
            live_hits,
            "{policy:?}: replayed hits"
        );
        assert_eq!(
            count(replay.experts_read_per_token, t),
            count(live.read_per_token, t - 1.0) + 4,
            "{policy:?}: replayed reads"
        );
        assert!(live_hits > 0, "{policy:?}: no hits to compare");
        assert_eq!(replay.experts_routed_per_token, 4.0);
        let none = &r.passes[0];
        assert_eq!((none.cache_hit_rate, none.experts_read_per_token), (0.0, 4.0));
        assert_eq!(none.needed_bytes_per_token, 4.0 * expert_bytes as f64);
        assert!(replay.needed_bytes_per_token < none.needed_bytes_per_token);
    }
}

fn stories_with(dir: &Path, name: &str, arch: &str, extra: &[(&str, MetaValue)]) -> PathBuf {
    let src = gatestream::gguf::GgufFile::open(&stories_file(dir)).unwrap();
    let mut meta: Vec<(String, MetaValue)> = src
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer.") || k.starts_with("general."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    meta.retain(|(k, _)| k != "general.architecture");
    meta.push(("general.architecture".into(), MetaValue::Str(arch.into())));
    for (k, v) in &src.metadata {
        if let Some(rest) = k.strip_prefix("llama.") {
            meta.push((format!("{arch}.{rest}"), v.clone()));
        }
    }
    meta.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    let tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = src
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), t.type_id, src.tensor_bytes(t).to_vec()))
        .collect();
    let refs: Vec<(&str, MetaValue)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    write_temp(dir, name, &gguf_of(&refs, &tensors))
}

fn load_err(path: &Path) -> String {
    match Model::load(path, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_and_malformed_moe_files_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let e = load_err(&stories_with(tmp.path(), "ds.gguf", "deepseek32", &[]));
    assert!(
        e.contains("deepseek32") && e.contains("sparse attention") && e.contains("qwen3moe"),
        "{e}"
    );
    // A MoE architecture without its expert keys.
    let e = load_err(&stories_with(tmp.path(), "q.gguf", "qwen3moe", &[]));
    assert!(e.contains("qwen3moe.expert_count"), "{e}");
    // Expert keys, but the dense tensors only.
    let e = load_err(&stories_with(
        tmp.path(),
        "mx.gguf",
        "llama",
        &[
            ("llama.expert_count", MetaValue::U32(4)),
            ("llama.expert_used_count", MetaValue::U32(2)),
        ],
    ));
    assert!(e.contains("blk.0.ffn_gate_exps.weight"), "{e}");
    let e = load_err(&stories_with(
        tmp.path(),
        "bad.gguf",
        "llama",
        &[
            ("llama.expert_count", MetaValue::U32(2)),
            ("llama.expert_used_count", MetaValue::U32(3)),
        ],
    ));
    assert!(e.contains("2 experts with 3 used"), "{e}");
    // An expert tensor of the wrong shape.
    let good = make(tmp.path(), &spec(Arch::Llama, GgmlType::F32, true), "good.gguf");
    let g = gatestream::gguf::GgufFile::open(&good).unwrap();
    let refs: Vec<(&str, MetaValue)> = g.metadata.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = g
        .tensors
        .iter()
        .map(|t| {
            let mut dims = t.dims.clone();
            if t.name == "blk.1.ffn_up_exps.weight" {
                dims.swap(1, 2);
            }
            (t.name.clone(), dims, t.type_id, g.tensor_bytes(t).to_vec())
        })
        .collect();
    let e = load_err(&write_temp(tmp.path(), "shape.gguf", &gguf_of(&refs, &tensors)));
    assert!(
        e.contains("blk.1.ffn_up_exps.weight") && e.contains("[6, 64, 64]"),
        "{e}"
    );
}

/// glm4moe (its first layer dense, a shared expert not gated, sigmoid routing with a score bias):
/// streamed from its GGUF and from the `.gst` `reformat` makes of it (experts in their own
/// sections, the dense layer's FFN as stored), under budgets from one expert's room to every
/// expert, with each reader and with and without lookahead, the logits of a prompt and four
/// greedy steps are bit-identical to the GGUF's in RAM (and the `.gst` in RAM to the GGUF).
#[test]
fn glm4moe_streams_from_its_gguf_and_gst_as_in_ram() {
    let tmp = tempfile::tempdir().unwrap();
    // (Few tokens: the synthetic tokenizer gives one per byte, and a pass holds at most 32.)
    let text = "Once upon a time";
    // Three experts per token: the order their outputs are added in shows in the rounding.
    let gguf = glm_file(tmp.path(), "glm.gguf", 3, true);
    let gst = tmp.path().join("glm.gst");
    gatestream::reformat::reformat(&gguf, &gst, &Default::default(), &mut |_, _, _| {}).unwrap();
    let reference = prompt_then_greedy(&load(&gguf), None, None, text, 4);
    let from_gst = prompt_then_greedy(&load(&gst), None, None, text, 4);
    assert!(
        from_gst.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
        "the .gst in RAM differs from the GGUF"
    );
    for path in [&gguf, &gst] {
        let m = Model::load(path, &on_disk()).unwrap();
        assert!(matches!(m.weights.layers[0].ffn, LayerFfn::Dense(_)));
        let experts = (m.config.expert_layers() * m.config.moe.as_ref().unwrap().n_experts) as u64;
        assert_eq!(experts, 6);
        for lookahead in [false, true] {
            let min = min_budget(path, lookahead);
            let s = Streamer::open(&m, &stream_options(min, ReadEngine::Pread, CachePolicy::Lru, lookahead)).unwrap();
            let x = s.experts.as_ref().unwrap();
            assert_eq!(x.cache_slots, 1, "the minimum holds one expert");
            let expert_bytes = x.expert_bytes;
            for (b, budget) in [min, min + 2 * expert_bytes, min + experts * expert_bytes]
                .into_iter()
                .enumerate()
            {
                for engine in [ReadEngine::Pread, ReadEngine::Uring, ReadEngine::Mmap] {
                    let what = format!("{} budget {b} {engine:?} lookahead {lookahead}", path.display());
                    let s = Streamer::open(&m, &stream_options(budget, engine, CachePolicy::Lru, lookahead)).unwrap();
                    let got = prompt_then_greedy(&m, Some(&s), None, text, 4);
                    assert!(
                        got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: streamed logits differ from in RAM"
                    );
                    let c = s.counters();
                    assert!(c.cache_lookups > 0 && c.ffn_reads > 0, "{what}: {c:?}");
                    if b == 2 {
                        assert!(c.ffn_reads + c.ahead_neurons <= experts, "{what}: {c:?}");
                    }
                }
            }
        }
    }
}

/// A small DeepSeek-V3-style model (`make-model --arch deepseek2`: latent attention with a query
/// bottleneck; the first layer dense; 8 experts in 4 groups of which 2 are used, sigmoid scores
/// with a bias, renormalized, scaled by 2.5; a shared expert), F32 where `f32`, else Q8_0.
fn deepseek2_file(dir: &Path, name: &str, f32: bool) -> PathBuf {
    use gatestream::synth::{write_model, MakeSpec, Mix, OutputFormat, RoutingShape, Shape, TokenizerChoice};
    let mla = gatestream::config::Mla {
        q_lora_rank: 32,
        kv_lora_rank: 64,
        qk_nope: 32,
        qk_rope: 16,
        v_head: 32,
    };
    let spec = MakeSpec {
        shape: Shape {
            name: "custom".into(),
            arch: Arch::Deepseek2,
            hidden: 64,
            ffn: 64,
            layers: 3,
            heads: 4,
            kv_heads: 1,
            head_dim: mla.latent(),
            vocab: 512,
            context_len: 256,
            rope_theta: 10000.0,
            rms_eps: 1e-6,
            tied: false,
            experts: Some((8, 3)),
            rope_factors: None,
            rope_dim: None,
            routing: Some(RoutingShape::deepseek_v3(128)),
            mla: Some(mla),
        },
        mix: Mix::Q8_0,
        dequantize: f32,
        tokenizer: TokenizerChoice::Synthetic,
        seed: 13,
        residual_gain: 1.0,
    };
    let out = dir.join(name);
    write_model(&spec, &out, &OutputFormat::Gguf, true, &mut |_, _| {}).unwrap();
    out
}

/// deepseek2 (latent attention resident, routed experts read by route) streamed from its GGUF
/// under budgets from one expert's room to every expert, with each reader, with and without
/// lookahead, F32 and Q8_0: the logits of a prompt and four greedy steps are bit-identical to
/// the GGUF's in RAM. A `.gst` is refused (it does not hold latent attention), naming what to do.
#[test]
fn deepseek2_streams_from_its_gguf_as_in_ram() {
    let tmp = tempfile::tempdir().unwrap();
    let text = "Once upon a time";
    for f32 in [true, false] {
        let gguf = deepseek2_file(tmp.path(), &format!("ds-{f32}.gguf"), f32);
        let reference = prompt_then_greedy(&load(&gguf), None, None, text, 4);
        let m = Model::load(&gguf, &on_disk()).unwrap();
        assert!(m.config.mla.is_some() && matches!(m.weights.layers[0].ffn, LayerFfn::Dense(_)));
        let experts = (m.config.expert_layers() * m.config.moe.as_ref().unwrap().n_experts) as u64;
        assert_eq!(experts, 16);
        for lookahead in [false, true] {
            let min = min_budget(&gguf, lookahead);
            let s = Streamer::open(&m, &stream_options(min, ReadEngine::Pread, CachePolicy::Lru, lookahead)).unwrap();
            let expert_bytes = s.experts.as_ref().unwrap().expert_bytes;
            for budget in [min, min + 3 * expert_bytes, min + experts * expert_bytes] {
                for engine in [ReadEngine::Pread, ReadEngine::Uring, ReadEngine::Mmap] {
                    let what = format!("f32 {f32} budget {budget} {engine:?} lookahead {lookahead}");
                    let s = Streamer::open(&m, &stream_options(budget, engine, CachePolicy::Lru, lookahead)).unwrap();
                    let got = prompt_then_greedy(&m, Some(&s), None, text, 4);
                    assert!(
                        got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: streamed logits differ from in RAM"
                    );
                    let c = s.counters();
                    assert!(c.cache_lookups > 0 && c.ffn_reads > 0, "{what}: {c:?}");
                }
            }
        }
    }
    let gguf = tmp.path().join("ds-true.gguf");
    let e = gatestream::reformat::reformat(
        &gguf,
        &tmp.path().join("ds.gst"),
        &Default::default(),
        &mut |_, _, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("latent attention") && e.contains("--ram-budget"), "{e}");
}

/// What makes glm4moe GLM changes its output: the score bias (zeroed, other experts are
/// chosen), partial RoPE (rotating the whole head) and the shared expert (gated instead) each
/// change the logits.
#[test]
fn glm4moe_features_change_the_output() {
    let tmp = tempfile::tempdir().unwrap();
    // (Few tokens: the synthetic tokenizer gives one per byte, and a pass holds at most 32.)
    let text = "Once upon a time";
    let path = glm_file(tmp.path(), "glm.gguf", 2, true);
    let reference = prompt_then_greedy(&load(&path), None, None, text, 2);
    let mut no_bias = load(&path);
    for l in &mut no_bias.weights.layers {
        if let LayerFfn::Experts(e) = &mut l.ffn {
            e.score_bias.as_mut().unwrap().fill(0.0);
        }
    }
    assert_ne!(prompt_then_greedy(&no_bias, None, None, text, 2), reference, "bias");
    let mut whole = load(&path);
    whole.config.rope_dim = whole.config.head_dim;
    assert_ne!(
        prompt_then_greedy(&whole, None, None, text, 2),
        reference,
        "partial RoPE"
    );
    let mut scaled = load(&path);
    scaled.config.moe.as_mut().unwrap().routed_scale = 2.0;
    assert_ne!(
        prompt_then_greedy(&scaled, None, None, text, 2),
        reference,
        "routed scale"
    );
}

/// GLM-4.5's NextN (multi-token prediction) layer — a whole layer's tensors plus `nextn.*` after
/// the model's own, counted in `block_count` and named by `nextn_predict_layers` — is not run
/// (llama.cpp's model pass skips it) and does not trip the refusal of unread tensors: the logits
/// are the file's without it. Without `nextn_predict_layers` the `nextn.*` tensors are refused.
#[test]
fn glm4moe_nextn_layers_are_not_run() {
    let tmp = tempfile::tempdir().unwrap();
    // (Few tokens: the synthetic tokenizer gives one per byte, and a pass holds at most 32.)
    let text = "Once upon a time";
    let path = glm_file(tmp.path(), "glm.gguf", 2, true);
    let reference = prompt_then_greedy(&load(&path), None, None, text, 2);
    let g = gatestream::gguf::GgufFile::open(&path).unwrap();
    let h = 64u64;
    // Layer 1's tensors as layer 2's, and the NextN ones.
    let mut extra: Vec<(String, Vec<u64>, u32, Vec<u8>)> = g
        .tensors
        .iter()
        .filter_map(|t| {
            let rest = t.name.strip_prefix("blk.1.")?;
            Some((
                format!("blk.2.{rest}"),
                t.dims.clone(),
                t.type_id,
                g.tensor_bytes(t).to_vec(),
            ))
        })
        .collect();
    let f32_t = |name: &str, dims: Vec<u64>| {
        let n: u64 = dims.iter().product();
        (name.to_string(), dims, 0u32, f32_bytes(&vec![0.01; n as usize]))
    };
    extra.push(f32_t("blk.2.nextn.eh_proj.weight", vec![2 * h, h]));
    extra.push(f32_t("blk.2.nextn.enorm.weight", vec![h]));
    extra.push(f32_t("blk.2.nextn.hnorm.weight", vec![h]));
    extra.push(f32_t("blk.2.nextn.shared_head_norm.weight", vec![h]));
    let meta = vec![
        ("glm4moe.block_count".to_string(), MetaValue::U32(3)),
        ("glm4moe.nextn_predict_layers".to_string(), MetaValue::U32(1)),
    ];
    let with = write_temp(tmp.path(), "nextn.gguf", &gguf_edited(&path, meta, extra.clone()));
    let m = load(&with);
    assert_eq!((m.config.n_layers, m.config.nextn_layers), (2, 1));
    let got = prompt_then_greedy(&m, None, None, text, 2);
    assert!(got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()));
    // Streamed, too (the NextN experts are not the stream's).
    let od = Model::load(&with, &on_disk()).unwrap();
    let s = Streamer::open(
        &od,
        &stream_options(1 << 30, ReadEngine::Pread, CachePolicy::Lru, false),
    )
    .unwrap();
    assert_eq!(s.experts.as_ref().unwrap().experts_total(), 6);
    let got = prompt_then_greedy(&od, Some(&s), None, text, 2);
    assert!(got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()));
    let meta = vec![("glm4moe.block_count".to_string(), MetaValue::U32(3))];
    let e = load_err(&write_temp(tmp.path(), "no-key.gguf", &gguf_edited(&path, meta, extra)));
    assert!(e.contains("nextn"), "{e}");
}

/// A device whose RoPE rotates whole heads (here the host stand-in told so)
/// refuses glm4moe at load, naming the architecture and what it lacks, rather than computing
/// another model; the stand-in that rotates part of a head runs it as the CPU does.
#[test]
fn glm4moe_is_refused_by_a_device_without_partial_rope() {
    use gatestream::backend::standin::HostStandIn;
    let tmp = tempfile::tempdir().unwrap();
    let path = glm_file(tmp.path(), "glm.gguf", 2, true);
    let e = Model::load_on(
        &path,
        &LoadOptions::default(),
        Arc::new(HostStandIn::new(1).with_whole_head_rope()),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        e.contains("glm4moe") && e.contains("partial RoPE") && e.contains("--device cpu"),
        "{e}"
    );
    let text = "Once upon a time";
    let on = Model::load_on(&path, &LoadOptions::default(), Arc::new(HostStandIn::new(1))).unwrap();
    assert_eq!(
        prompt_then_greedy(&on, None, None, text, 2),
        prompt_then_greedy(&load(&path), None, None, text, 2)
    );
}

/// A routing trace of glm4moe (recorded by the streamed runtime) leaves its leading dense layer's
/// records empty (and writes no bytes for them), reads back equal, and `bench` replays it: the
/// one layer of experts routes 2 a token, and a cache of every expert reads each at most once.
#[test]
fn glm4moe_routing_traces_skip_the_dense_layer() {
    use gatestream::bench::experts::{bench_experts, ExpertBenchOptions};
    use gatestream::bench::trace::AnyTrace;
    use gatestream::bench::{BenchOptions, EngineConfig};
    use gatestream::runtime::{KvPositions, OpenOptions};
    let tmp = tempfile::tempdir().unwrap();
    let gguf = glm_file(tmp.path(), "glm.gguf", 2, false);
    let gst = tmp.path().join("glm.gst");
    gatestream::reformat::reformat(&gguf, &gst, &Default::default(), &mut |_, _, _| {}).unwrap();
    let rt = gatestream::runtime::open(
        &gst,
        &OpenOptions {
            threads: 1,
            stream: Some(pread_stream(1 << 30, 1)),
            sparse: None,
            kv_positions: KvPositions::Exactly(32),
            experts_used: None,
        },
    )
    .unwrap();
    let out = rt.generate(&[1], &greedy(8), true, None, &mut |_| {}).unwrap();
    let Some(AnyTrace::Routes(trace)) = out.trace else {
        panic!("no routing trace")
    };
    let h = &trace.header;
    assert_eq!((h.n_layers, h.leading_dense, h.n_experts, h.n_used), (2, 1, 6, 2));
    assert_eq!(h.tokens, out.generation.tokens.len());
    assert!(trace.records.iter().all(|t| t[0].is_empty() && t[1].len() == 2));
    let path = tmp.path().join("routes.trace");
    AnyTrace::Routes(trace.clone()).write(&path).unwrap();
    let AnyTrace::Routes(back) = AnyTrace::read(&path).unwrap() else {
        panic!("read back as another kind")
    };
    assert_eq!(back, trace);
    let bench = BenchOptions {
        engines: vec![EngineConfig {
            engine: "pread",
            queue_depth: 8,
            fixed_buffers: false,
        }],
        tokens: usize::MAX,
        gate_streamed: false,
        cache_neurons: 0,
        baseline_sizes: vec![4096],
        baseline_random_reads: 16,
        baseline_seq_bytes: 1 << 20,
        merge_gap_bytes: None,
        token_batches: false,
    };
    let x = ExpertBenchOptions {
        cache_experts: vec![0, 6],
        policies: vec![CachePolicy::Lru],
    };
    let r = bench_experts(&gst, &[back], &bench, &x, &mut |_, _, _| {}).unwrap();
    assert_eq!(r.passes.len(), 2);
    for p in &r.passes {
        assert_eq!(p.experts_routed_per_token, 2.0, "{p:?}");
    }
    let all = &r.passes[1];
    assert!(all.experts_read_per_token * h.tokens as f64 <= 6.0, "{all:?}");
    let e = bench_experts(
        &gst,
        &[trace],
        &bench,
        &ExpertBenchOptions {
            cache_experts: vec![7],
            policies: vec![CachePolicy::Lru],
        },
        &mut |_, _, _| {},
    )
    .expect_err("more than every expert")
    .to_string();
    assert!(e.contains("6 experts"), "{e}");
}

/// A small random gpt-oss from `make-model` (2 layers, 4 heads of 32 over a width of 64, 2 KV
/// heads, 6 experts of 64, 3 used; biases, sinks, YaRN) in `mix` (F32 when `dequantize`), with a
/// synthetic byte-level vocabulary; a `.gst` (written directly) when `name` ends so, else a GGUF.
fn gpt_oss_model(dir: &Path, name: &str, mix: gatestream::synth::Mix, dequantize: bool) -> PathBuf {
    use gatestream::synth::{write_model, MakeSpec, OutputFormat, Shape, TokenizerChoice};
    let spec = MakeSpec {
        shape: Shape {
            vocab: 320,
            context_len: 512,
            experts: Some((6, 3)),
            ..Shape::custom(Arch::GptOss, 64, 64, 2, 4, 2, 32)
        },
        mix,
        dequantize,
        tokenizer: TokenizerChoice::Synthetic,
        seed: 3,
        residual_gain: 1.0,
    };
    let out = dir.join(name);
    let format = match name.ends_with(".gst") {
        true => OutputFormat::Gst(Default::default()),
        false => OutputFormat::Gguf,
    };
    write_model(&spec, &out, &format, true, &mut |_, _| {}).unwrap();
    out
}

/// gpt-oss's experts in f64, every expert on every token: the router's logits plus its bias,
/// the `n_used` largest chosen and weighted by the softmax over them alone; each expert
/// `down · swiglu_oai(gate·x + b_g, up·x + b_u) + b_d` with the gate clamped above at 7 and up
/// to ±7. Also the experts chosen.
fn naive_gpt_oss_moe(model: &Model, l: usize, x: &[f32], n: usize) -> (Vec<f64>, Vec<usize>) {
    let moe = model.config.moe.as_ref().unwrap();
    let LayerFfn::Experts(e) = &model.weights.layers[l].ffn else {
        panic!("a MoE layer")
    };
    let b = e.biases.as_ref().expect("gpt-oss expert biases");
    let h = model.config.hidden;
    let router = rows_f64(&e.router);
    let expert = |i: usize, xt: &[f64]| -> Vec<f64> {
        let f = &e.experts[i];
        let FfnDown::Rows(down) = &f.down else { panic!("rows") };
        let [bg, bu, bd] = b.of(i);
        let (gate, up, down) = (rows_f64(&f.gate), rows_f64(&f.up), rows_f64(down));
        let act: Vec<f64> = (0..gate.len())
            .map(|j| {
                let g = (dot(&gate[j], xt) + bg[j] as f64).min(7.0);
                let u = (dot(&up[j], xt) + bu[j] as f64).clamp(-7.0, 7.0);
                g / (1.0 + (-1.702 * g).exp()) * (u + 1.0)
            })
            .collect();
        down.iter()
            .zip(bd)
            .map(|(r, &bias)| dot(r, &act) + bias as f64)
            .collect()
    };
    let (mut out, mut used) = (Vec::with_capacity(n * h), Vec::new());
    for t in 0..n {
        let xt: Vec<f64> = x[t * h..(t + 1) * h].iter().map(|&v| v as f64).collect();
        let logits: Vec<f64> = router
            .iter()
            .zip(&b.router)
            .map(|(r, &bias)| dot(r, &xt) + bias as f64)
            .collect();
        let mut order: Vec<usize> = (0..moe.n_experts).collect();
        order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap());
        let chosen = &order[..moe.n_used];
        used.extend_from_slice(chosen);
        let max = logits[chosen[0]];
        let z: f64 = chosen.iter().map(|&i| (logits[i] - max).exp()).sum();
        let mut y = vec![0f64; h];
        for &i in chosen {
            let w = (logits[i] - max).exp() / z;
            y.iter_mut().zip(expert(i, &xt)).for_each(|(a, b)| *a += w * b);
        }
        out.extend(y);
    }
    (out, used)
}

/// gpt-oss's experts (F32, and MXFP4 with Q8_0 elsewhere as published) match the naive f64
/// reference: router bias, top-k then softmax over the chosen, expert biases, the clamped
/// SwiGLU; batched equals one token at a time. The routing rule on its own: the largest
/// logits, weighted by the softmax over them alone.
#[test]
fn gpt_oss_matches_the_naive_all_experts_reference() {
    use gatestream::synth::Mix;
    let mut moe = gatestream::config::MoeConfig {
        softmax_after_topk: true,
        oai_experts: true,
        ..gatestream::config::MoeConfig::softmax(4, 2, false)
    };
    let r = gatestream::model::ffn::route(&[0.0, 2.0, 1.0, 2.0], &moe, None);
    assert_eq!(r, vec![(1, 0.5), (3, 0.5)]);
    moe.n_used = 3;
    let r = gatestream::model::ffn::route(&[0.0, 2.0, 1.0, 2.0], &moe, None);
    let z = 2.0 * 2f32.exp() + 1f32.exp();
    assert_eq!(r.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 3, 2]);
    assert!(
        (r[2].1 - 1f32.exp() / z).abs() < 1e-6 && (r[0].1 - 2f32.exp() / z).abs() < 1e-6,
        "{r:?}"
    );
    // The clamped SwiGLU at and past its limits.
    let oai = gatestream::model::ffn::swiglu_oai;
    assert_eq!(oai(9.0, 0.0), oai(7.0, 0.0));
    assert_eq!(oai(1.0, 20.0), oai(1.0, 7.0));
    assert_eq!(oai(1.0, -20.0), oai(1.0, -7.0));
    assert_eq!(oai(1.0, -1.0), 0.0);
    assert!((oai(1.0, 0.0) - 1.0 / (1.0 + (-1.702f32).exp())).abs() < 1e-7);

    let tmp = tempfile::tempdir().unwrap();
    for (mix, dequantize) in [(Mix::Mxfp4Moe, true), (Mix::Mxfp4Moe, false)] {
        let model = load(&gpt_oss_model(tmp.path(), "oss.gguf", mix, dequantize));
        let moe = model.config.moe.clone().unwrap();
        assert!(moe.softmax_after_topk && moe.oai_experts && !moe.normalize);
        let (h, n) = (model.config.hidden, 9);
        let x: Vec<f32> = (0..n * h)
            .map(|i| ((i * 7919 % 613) as f32 / 306.5 - 1.0) * 1.7)
            .collect();
        let mut experts_used = std::collections::BTreeSet::new();
        for l in 0..model.config.n_layers {
            let w = &model.weights.layers[l];
            let LayerFfn::Experts(e) = &w.ffn else {
                panic!("layer {l} is dense")
            };
            let ty = e.experts[0].gate.ty;
            assert_eq!(ty, if dequantize { GgmlType::F32 } else { GgmlType::MXFP4 });
            let got = model.device.download(
                model
                    .ffn(l, w, &model.device.upload(n, h, x.clone()), &FfnHooks::dense())
                    .unwrap(),
            );
            let (want, used) = naive_gpt_oss_moe(&model, l, &x, n);
            experts_used.extend(used);
            let what = format!("{ty:?} layer {l}");
            if dequantize {
                assert_near_reference(&got, &want, &what);
            } else {
                // MXFP4 products take 8-bit activations (as ggml's): within 2% of the reference.
                let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (*a as f64 - b).abs())
                    .fold(0f64, f64::max);
                assert!(worst <= 0.02 * scale, "{what}: {worst:.3e} of {scale:.3e}");
            }
            for t in 0..n {
                let one = model.device.download(
                    model
                        .ffn(
                            l,
                            w,
                            &model.device.upload(1, h, x[t * h..(t + 1) * h].to_vec()),
                            &FfnHooks::dense(),
                        )
                        .unwrap(),
                );
                assert!(
                    one.iter().zip(&got[t * h..(t + 1) * h]).all(|(a, b)| a == b),
                    "{what} token {t}: batched differs from alone"
                );
            }
        }
        assert!(experts_used.len() >= 5, "the tokens used only experts {experts_used:?}");
    }
}

/// gpt-oss streamed under a RAM budget, from its GGUF (each expert three slices of the 3-D
/// tensors, read by route; its biases resident), from the `.gst` `reformat` makes of it and
/// from the one `make-model` writes directly,
/// with MXFP4 experts: the logits of a prompt and four greedy steps are bit-identical to the
/// in-RAM model's, from the least budget that opens to every expert cached, with and without
/// lookahead (which routes the next layer with its router bias).
#[test]
fn gpt_oss_streams_from_gguf_and_gst_like_in_ram() {
    use gatestream::backend::standin::HostStandIn;
    use gatestream::synth::Mix;
    let tmp = tempfile::tempdir().unwrap();
    let text = "Once upon a time";
    let gguf = gpt_oss_model(tmp.path(), "oss.gguf", Mix::Mxfp4Moe, false);
    let gst = tmp.path().join("oss.gst");
    gatestream::reformat::reformat(&gguf, &gst, &Default::default(), &mut |_, _, _| {}).unwrap();
    let reference = prompt_then_greedy(&load(&gguf), None, None, text, 4);
    let same =
        |a: &[f32]| a.len() == reference.len() && a.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same(&prompt_then_greedy(&load(&gst), None, None, text, 4)),
        "the .gst in RAM differs from the GGUF"
    );
    // make-model's `.gst` written directly is the file `reformat` makes of its GGUF.
    let direct = gpt_oss_model(tmp.path(), "direct.gst", Mix::Mxfp4Moe, false);
    assert!(
        same(&prompt_then_greedy(&load(&direct), None, None, text, 4)),
        "make-model's .gst differs"
    );
    // A device with memory of its own (the host stand-in, whose attention is the CPU's)
    // computes it alike; one that does not compute sinks refuses it at load, naming the
    // architecture and what it lacks.
    let standin = Model::load_on(&gguf, &LoadOptions::default(), Arc::new(HostStandIn::new(0))).unwrap();
    assert!(
        same(&prompt_then_greedy(&standin, None, None, text, 4)),
        "on the host stand-in"
    );
    let e = Model::load_on(
        &gguf,
        &LoadOptions::default(),
        Arc::new(HostStandIn::new(0).without_attention_sinks()),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        e.contains("gpt-oss") && e.contains("attention sinks") && e.contains("--device cpu"),
        "{e}"
    );
    for path in [&gguf, &gst, &direct] {
        let m = Model::load(path, &on_disk()).unwrap();
        let all_experts = std::fs::metadata(path).unwrap().len();
        for lookahead in [false, true] {
            let mut min = 0;
            for _ in 0..4 {
                match Streamer::open(&m, &stream_options(min, ReadEngine::Pread, CachePolicy::Lru, lookahead)) {
                    Ok(_) => break,
                    Err(e) => min = budget_in_refusal(&e.to_string()),
                }
            }
            for budget in [min + (256 << 10), min + all_experts] {
                for engine in [ReadEngine::Pread, ReadEngine::Uring] {
                    let what = format!("{} budget {budget} {engine:?} lookahead {lookahead}", path.display());
                    let s = Streamer::open(&m, &stream_options(budget, engine, CachePolicy::Lru, lookahead)).unwrap();
                    let got = prompt_then_greedy(&m, Some(&s), None, text, 4);
                    assert!(same(&got), "{what}: streamed logits differ from in RAM");
                    let c = s.counters();
                    assert!(c.ffn_reads > 0 && c.cache_lookups > 0, "{what}: {c:?}");
                }
            }
        }
    }
}

/// `eval` on glm4moe: the dense row is `perplexity`'s; masks run inside the routed experts (the
/// leading dense layer whole), so the achieved sparsity is the experts' and the FFN bytes count
/// the dense layer in full.
#[test]
fn eval_on_glm4moe_masks_the_routed_experts_only() {
    use gatestream::eval::{eval, EvalOptions};
    use gatestream::perplexity::{perplexity, PerplexityOptions};
    use gatestream::sparsity::{Criterion, Strategy};
    let tmp = tempfile::tempdir().unwrap();
    let path = glm_file(tmp.path(), "glm.gguf", 2, false);
    let model = load(&path);
    let text = std::fs::read_to_string(data_dir().join("wikitext-2/wiki.test.raw")).unwrap();
    let opts = EvalOptions {
        ctx: 64,
        windows: 2,
        sparsities: vec![0.0, 0.5],
        strategies: vec![Strategy::TopK],
        criteria: vec![Criterion::Exact],
        calibrate_tokens: 0,
        max_ppl_increase_pct: 1e9,
        per_layer_tokens: 0,
        checkpoint: None,
        windows_this_run: None,
        jitter_seeds: 0,
        experts: Some(vec![]),
    };
    let r = eval(&model, &text, "wiki", &opts, &mut |_, _, _| {}).unwrap().unwrap();
    let rows = &r.rows;
    let o = PerplexityOptions { ctx: 64, windows: 2 };
    assert_eq!(
        rows[0].perplexity,
        perplexity(&model, &text, &o, &mut |_, _, _| {}).unwrap().perplexity
    );
    let masked = rows.iter().find(|x| x.strategy.is_some()).unwrap();
    assert_eq!(masked.achieved_sparsity_mean, 0.5, "{masked:?}");
    assert!(masked.perplexity != rows[0].perplexity, "{masked:?}");
    let rel = masked.ffn_bytes_rel_dense;
    assert!(rel > 0.5 && rel < 1.0, "{masked:?}");
}

/// `gguf` (an F32 mixture of experts of `arch` written by `write_moe` from stories260K) as the
/// Hugging Face folder its checkpoint would be: config.json of its `model_type`, every tensor
/// under its Hugging Face name (each expert's own three, Q/K rows un-permuted for Mixtral's
/// half-split RoPE) in `shards` safetensors files with their index, and stories260K's llama2.c
/// tokenizer.
fn moe_as_hf_folder(gguf: &Path, arch: Arch, dest: &Path, shards: usize) {
    let g = gatestream::gguf::GgufFile::open(gguf).unwrap();
    let cfg = load(gguf).config;
    let moe = cfg.moe.clone().unwrap();
    std::fs::create_dir_all(dest).unwrap();
    std::fs::copy(stories_dir().join("tok512.bin"), dest.join("tok512.bin")).unwrap();
    let mixtral = arch == Arch::Llama;
    let (block, [eg, eu, ed]) = match mixtral {
        true => ("block_sparse_moe", ["w1", "w3", "w2"]),
        false => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    };
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for t in &g.tensors {
        let bytes = g.map[t.offset_bytes as usize..(t.offset_bytes + t.len_bytes) as usize].to_vec();
        let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        assert_eq!(t.type_id, 0, "{}: F32 only", t.name);
        let global = match t.name.as_str() {
            "token_embd.weight" => Some("model.embed_tokens.weight"),
            "output.weight" => Some("lm_head.weight"),
            "output_norm.weight" => Some("model.norm.weight"),
            _ => None,
        };
        if let Some(h) = global {
            out.push((h.into(), shape, bytes));
            continue;
        }
        let rest = t.name.strip_prefix("blk.").unwrap();
        let (l, what) = rest.split_once('.').unwrap();
        let layer = |h: &str| format!("model.layers.{l}.{h}");
        // Rows of each head back in half-split order (the GGUF's are pair-interleaved).
        let unpermute = |bytes: Vec<u8>, heads: usize| -> Vec<u8> {
            let row = shape[1] * 4;
            let hd = shape[0] / heads;
            let mut to = bytes.clone();
            for head in 0..heads {
                for i in 0..hd / 2 {
                    for j in 0..2 {
                        let (permuted, original) = (head * hd + 2 * i + j, head * hd + j * hd / 2 + i);
                        to[original * row..(original + 1) * row]
                            .copy_from_slice(&bytes[permuted * row..(permuted + 1) * row]);
                    }
                }
            }
            to
        };
        match what {
            "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight" => {
                let m = match what {
                    "ffn_gate_exps.weight" => eg,
                    "ffn_up_exps.weight" => eu,
                    _ => ed,
                };
                let each = bytes.len() / moe.n_experts;
                for e in 0..moe.n_experts {
                    out.push((
                        layer(&format!("{block}.experts.{e}.{m}.weight")),
                        shape[1..].to_vec(),
                        bytes[e * each..(e + 1) * each].to_vec(),
                    ));
                }
            }
            _ => {
                let (h, bytes, shape) = match what {
                    "attn_norm.weight" => ("input_layernorm.weight", bytes, shape),
                    "attn_q.weight" if mixtral => ("self_attn.q_proj.weight", unpermute(bytes, cfg.n_heads), shape),
                    "attn_k.weight" if mixtral => ("self_attn.k_proj.weight", unpermute(bytes, cfg.n_kv_heads), shape),
                    "attn_q.weight" => ("self_attn.q_proj.weight", bytes, shape),
                    "attn_k.weight" => ("self_attn.k_proj.weight", bytes, shape),
                    "attn_v.weight" => ("self_attn.v_proj.weight", bytes, shape),
                    "attn_output.weight" => ("self_attn.o_proj.weight", bytes, shape),
                    "attn_q.bias" => ("self_attn.q_proj.bias", bytes, shape),
                    "attn_k.bias" => ("self_attn.k_proj.bias", bytes, shape),
                    "attn_v.bias" => ("self_attn.v_proj.bias", bytes, shape),
                    "attn_q_norm.weight" => ("self_attn.q_norm.weight", bytes, shape),
                    "attn_k_norm.weight" => ("self_attn.k_norm.weight", bytes, shape),
                    "ffn_norm.weight" => ("post_attention_layernorm.weight", bytes, shape),
                    "ffn_gate_inp.weight" if mixtral => ("block_sparse_moe.gate.weight", bytes, shape),
                    "ffn_gate_inp.weight" => ("mlp.gate.weight", bytes, shape),
                    "ffn_gate_shexp.weight" => ("mlp.shared_expert.gate_proj.weight", bytes, shape),
                    "ffn_up_shexp.weight" => ("mlp.shared_expert.up_proj.weight", bytes, shape),
                    "ffn_down_shexp.weight" => ("mlp.shared_expert.down_proj.weight", bytes, shape),
                    "ffn_gate_inp_shexp.weight" => ("mlp.shared_expert_gate.weight", bytes, vec![1, shape[0]]),
                    other => panic!("{}: no Hugging Face name for {other}", gguf.display()),
                };
                out.push((layer(h), shape, bytes));
            }
        }
    }
    let out: Vec<(String, &str, Vec<usize>, Vec<u8>)> = out.into_iter().map(|(n, s, b)| (n, "F32", s, b)).collect();
    write_safetensors_shards(dest, &out, shards, 8);
    let mut config = serde_json::json!({
        "model_type": match arch {
            Arch::Llama => "mixtral",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::Qwen3Moe => "qwen3_moe",
            _ => "olmoe",
        },
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab,
        "max_position_embeddings": cfg.context_len,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "num_experts_per_tok": moe.n_used,
        "bos_token_id": 1,
        "eos_token_id": 2,
    });
    let c = config.as_object_mut().unwrap();
    match arch {
        Arch::Llama => {
            c.insert("num_local_experts".into(), moe.n_experts.into());
            c.insert("intermediate_size".into(), cfg.ffn.into());
        }
        Arch::Olmoe => {
            c.insert("num_experts".into(), moe.n_experts.into());
            c.insert("intermediate_size".into(), cfg.ffn.into());
        }
        _ => {
            c.insert("num_experts".into(), moe.n_experts.into());
            c.insert("moe_intermediate_size".into(), cfg.ffn.into());
            // (The dense width these checkpoints also name, unused by their experts.)
            c.insert("intermediate_size".into(), (4 * cfg.ffn).into());
            if arch == Arch::Qwen2Moe {
                c.insert("shared_expert_intermediate_size".into(), moe.shared_ffn.into());
            }
        }
    }
    std::fs::write(dest.join("config.json"), config.to_string()).unwrap();
}

/// A mixture of experts from its Hugging Face folder (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; each
/// expert's own tensors, in three shards): in RAM it computes what its GGUF does, and streamed
/// (experts read by route into the cache, from whichever shard holds each matrix) its logits are
/// bit-identical to the folder's in RAM, with every reader, from one expert's room to every
/// expert cached.
#[test]
fn a_mixture_of_experts_streams_from_its_hugging_face_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let text = "Once upon a time, there was a little dog";
    for arch in ARCHS {
        let gguf = make(
            tmp.path(),
            &spec(arch, GgmlType::F32, true),
            &format!("{}.gguf", arch.name()),
        );
        let dir = tmp.path().join(format!("{}-hf", arch.name()));
        moe_as_hf_folder(&gguf, arch, &dir, 3);
        let (from_gguf, hf) = (load(&gguf), load(&dir));
        assert_eq!(hf.config.moe, from_gguf.config.moe, "{arch:?}");
        assert_eq!(
            hf.tokenizer.encode(text, true).unwrap(),
            from_gguf.tokenizer.encode(text, true).unwrap()
        );
        let want = prompt_then_greedy(&from_gguf, None, None, text, 4);
        let in_ram = prompt_then_greedy(&hf, None, None, text, 4);
        let worst = want
            .iter()
            .zip(&in_ram)
            .map(|(a, b)| (a - b).abs() / a.abs().max(1.0))
            .fold(0f32, f32::max);
        assert!(
            in_ram.len() == want.len() && worst < 1e-4,
            "{arch:?}: folder vs GGUF {worst}"
        );
        let m = Model::load(&dir, &on_disk()).unwrap();
        assert_eq!(m.parts.len(), 3);
        let min = budget_in_refusal(
            &Streamer::open(&m, &stream_options(0, ReadEngine::Pread, CachePolicy::Lru, false))
                .err()
                .unwrap()
                .to_string(),
        );
        let model_bytes = gatestream::model::model_bytes(&dir).unwrap();
        for budget in [min, min + model_bytes / 3, min + 2 * model_bytes] {
            for engine in [ReadEngine::Uring, ReadEngine::Pread, ReadEngine::Mmap] {
                let s = Streamer::open(&m, &stream_options(budget, engine, CachePolicy::Lru, false)).unwrap();
                let got = prompt_then_greedy(&m, Some(&s), None, text, 4);
                assert!(
                    got.len() == in_ram.len() && got.iter().zip(&in_ram).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{arch:?} at budget {budget} with {engine:?}: streamed differs from the folder in RAM"
                );
                let c = s.counters();
                assert!(c.cache_lookups > 0, "{arch:?}: {c:?}");
                if budget == min {
                    assert!(c.ffn_needed_bytes > 0, "{arch:?}: {c:?}");
                }
            }
        }
    }
    // A mixture whose GGUF runs and whose folder is not read says so, and what to do.
    let dir = tmp.path().join("qwen3moe-hf");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["model_type"] = "deepseek_v3".into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = Model::load(&dir, &LoadOptions::default()).err().unwrap().to_string();
    assert!(e.contains("deepseek_v3") && e.contains("convert_hf_to_gguf"), "{e}");
}

/// On the CPU device the expert cache's buffers are made ahead, on a thread at idle priority,
/// as many as the plan counts (the cache's slots; with lookahead, its reads in flight and as
/// many spares) and no more: a pass then takes them instead of making its own. (A cache with
/// fewer slots than a layer's experts in one pass needs one buffer more than its slots: the
/// cache here holds more than a layer's six and fewer than the model's twelve.)
#[test]
fn expert_buffers_are_made_ahead_and_no_more_than_planned() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = make(tmp.path(), &spec(Arch::Qwen3Moe, GgmlType::F32, true), "q.gguf");
    let m = Model::load(&gguf, &on_disk()).unwrap();
    let min = budget_in_refusal(
        &Streamer::open(&m, &stream_options(0, ReadEngine::Pread, CachePolicy::Lru, false))
            .err()
            .unwrap()
            .to_string(),
    );
    for lookahead in [false, true] {
        let expert_bytes = Streamer::open(&m, &stream_options(min, ReadEngine::Pread, CachePolicy::Lru, false))
            .unwrap()
            .experts
            .as_ref()
            .unwrap()
            .expert_bytes;
        let budget = min_budget(&gguf, lookahead).max(min) + 7 * expert_bytes;
        let s = Streamer::open(
            &m,
            &stream_options(budget, ReadEngine::Pread, CachePolicy::Lru, lookahead),
        )
        .unwrap();
        let x = s.experts.as_ref().unwrap();
        let target = x.cache_slots + if lookahead { 2 * x.ahead_max } else { 0 };
        assert!((7..12).contains(&x.cache_slots), "{}", x.cache_slots);
        let t = std::time::Instant::now();
        while x.buffers_made() != (target, target) && t.elapsed().as_secs() < 20 {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(
            x.buffers_made(),
            (target, target),
            "lookahead {lookahead}: made ahead, none used yet"
        );
        prompt_then_greedy(&m, Some(&s), None, "Once upon a time, there was a little dog", 4);
        let (made, waiting) = x.buffers_made();
        assert_eq!(made, target, "lookahead {lookahead}: the passes made none of their own");
        assert!(
            waiting < target,
            "lookahead {lookahead}: the misses took the buffers made ahead"
        );
    }
}
