//! The `.gst` path end to end on real weights: reformat, verify, run densely and compare with the
//! source model; neuron order and layout change no output; an interrupted reformat leaves no file
//! that passes validation.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use gatestream::format::{FfnLayout, NeuronOrder};
use gatestream::gstfile::GstFile;
use gatestream::kv::KvCache;
use gatestream::model::batch::Logits;
use gatestream::model::{LoadOptions, Model};
use gatestream::perplexity::{perplexity, PerplexityOptions};
use gatestream::reformat::{reformat, DownType, ReformatOptions};

fn convert(input: &Path, dir: &Path, name: &str, opts: &ReformatOptions) -> PathBuf {
    let out = dir.join(name);
    reformat(input, &out, opts, &mut |_, _, _| {}).unwrap();
    GstFile::open(&out).unwrap().verify(&mut |_, _| {}).unwrap();
    out
}

fn logits(model: &Model, text: &str) -> Vec<f32> {
    let ids = model.tokenizer.encode(text, true).unwrap();
    let mut cache = KvCache::new(&model.config, ids.len());
    model.forward(&ids, &mut cache, Logits::From(0)).unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

fn load(p: &Path) -> Model {
    Model::load(p, &LoadOptions::default()).unwrap()
}

fn wikitext() -> PathBuf {
    data_dir().join("wikitext-2/wiki.test.raw")
}

#[test]
fn stories260k_gst_keeps_the_golden_decode_in_both_layouts_and_orders() {
    let tmp = tempfile::tempdir().unwrap();
    let src = load(&stories_dir());
    let want = src.generate("Once upon a time", &greedy(60), &mut |_| {}).unwrap();
    let reference = logits(&src, "Once upon a time, there was a cat");
    let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    // Tolerances relative to the largest logit: f32 down columns (`same` for this f32 model)
    // keep it exact up to summation order; f16 and q8_0 columns add their rounding.
    let variants = [
        (
            "split-f16.gst",
            FfnLayout::Split,
            DownType::F16,
            NeuronOrder::Original,
            1e-3,
        ),
        (
            "bundled-q8.gst",
            FfnLayout::Bundled,
            DownType::Q8_0,
            NeuronOrder::Original,
            2e-2,
        ),
        (
            "hot-first.gst",
            FfnLayout::Split,
            DownType::Same,
            NeuronOrder::HotFirst,
            1e-5,
        ),
    ];
    for (name, ffn_layout, down_type, order, tol) in variants {
        let opts = ReformatOptions {
            ffn_layout,
            down_type,
            order,
            calibrate_text: (order == NeuronOrder::HotFirst).then(wikitext),
            calibrate_tokens: 1024,
            ..Default::default()
        };
        let gst = load(&convert(&stories_dir(), tmp.path(), name, &opts));
        let got = gst.generate("Once upon a time", &greedy(60), &mut |_| {}).unwrap();
        assert_eq!(got.tokens, want.tokens, "{name}: greedy tokens differ");
        let d = max_abs_diff(&logits(&gst, "Once upon a time, there was a cat"), &reference) / scale;
        assert!(
            d < tol,
            "{name}: logits differ from the source by {d} of the largest logit"
        );
        // Perplexity (wikitext-2 is far from TinyStories, but it exercises every position).
        let text = std::fs::read_to_string(wikitext()).unwrap();
        let opts = PerplexityOptions { ctx: 256, windows: 2 };
        let p_src = perplexity(&src, &text, &opts, &mut |_, _, _| {}).unwrap().perplexity;
        let p_gst = perplexity(&gst, &text, &opts, &mut |_, _, _| {}).unwrap().perplexity;
        let rel = (p_gst - p_src).abs() / p_src;
        assert!(rel < 0.005, "{name}: perplexity {p_gst} vs source {p_src}");
    }
}

#[test]
fn smollm2_gst_matches_the_gguf_and_hot_first_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let src = load(&gguf);
    let original = load(&convert(&gguf, tmp.path(), "original.gst", &ReformatOptions::default()));
    let hot = load(&convert(
        &gguf,
        tmp.path(),
        "hot.gst",
        &ReformatOptions {
            order: NeuronOrder::HotFirst,
            calibrate_text: Some(wikitext()),
            calibrate_tokens: 1024,
            ..Default::default()
        },
    ));
    // Same greedy continuation as the GGUF.
    let want = src
        .generate("The capital of France is", &greedy(12), &mut |_| {})
        .unwrap();
    for m in [&original, &hot] {
        let got = m
            .generate("The capital of France is", &greedy(12), &mut |_| {})
            .unwrap();
        assert_eq!(got.tokens, want.tokens, "{}", got.text);
        assert!(got.text.starts_with(" Paris"));
    }
    // Permuting neurons changes no output: down columns are summed in f64, so the order of the
    // neurons does not even change the rounding.
    let text = "The history of the Roman Empire begins";
    let d = max_abs_diff(&logits(&original, text), &logits(&hot, text));
    assert!(d < 1e-5, "hot-first logits differ from original order by {d}");
    // The hot prefix covers more than its share of activations.
    let g = GstFile::open(&tmp.path().join("hot.gst")).unwrap();
    let cal = g.index.calibration.as_ref().unwrap();
    assert_eq!(cal.layers.len(), 30);
    assert!(cal
        .layers
        .iter()
        .all(|l| l.hot_prefix_10 > 0.10 && l.hot_prefix_25 > 0.25 && l.hot_prefix_25 < 1.0));
    // Perplexity within 0.5% of the source (the only change is down re-quantized to Q8_0).
    let text = std::fs::read_to_string(wikitext()).unwrap();
    let opts = PerplexityOptions { ctx: 512, windows: 2 };
    let p_src = perplexity(&src, &text, &opts, &mut |_, _, _| {}).unwrap().perplexity;
    let p_gst = perplexity(&original, &text, &opts, &mut |_, _, _| {})
        .unwrap()
        .perplexity;
    let rel = (p_gst - p_src).abs() / p_src;
    assert!(
        rel < 0.005,
        "perplexity {p_gst} vs source {p_src} ({:.3}% apart)",
        rel * 100.0
    );
}

#[test]
fn reformat_refuses_to_overwrite_and_cleans_up_after_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = convert(&stories_dir(), tmp.path(), "s.gst", &ReformatOptions::default());
    let e = reformat(&stories_dir(), &out, &ReformatOptions::default(), &mut |_, _, _| {}).unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    reformat(
        &stories_dir(),
        &out,
        &ReformatOptions {
            force: true,
            ..Default::default()
        },
        &mut |_, _, _| {},
    )
    .unwrap();
    // Hot-first without calibration text is refused before anything is written.
    let bad = tmp.path().join("bad.gst");
    let e = reformat(
        &stories_dir(),
        &bad,
        &ReformatOptions {
            order: NeuronOrder::HotFirst,
            ..Default::default()
        },
        &mut |_, _, _| {},
    )
    .unwrap_err();
    assert!(e.to_string().contains("--calibrate"), "{e}");
    // A failure midway (the progress callback panics after two layers) leaves no file behind.
    let r = std::panic::catch_unwind(|| {
        reformat(
            &stories_dir(),
            &bad,
            &ReformatOptions::default(),
            &mut |stage, done, _| {
                if stage == "layers" && done == 2 {
                    panic!("interrupted");
                }
            },
        )
    });
    assert!(r.is_err());
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left,
        vec![std::ffi::OsString::from("s.gst")],
        "files left behind: {left:?}"
    );
}

#[test]
fn a_reformat_killed_midway_leaves_no_valid_looking_file() {
    // Kill the real binary while it writes the largest model here; whatever is on disk must not
    // pass validation, and the target name must not exist.
    let tmp = tempfile::tempdir().unwrap();
    let qwen = model_file("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen1.5b");
    let out = tmp.path().join("qwen.gst");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_gatestream"))
        .arg("reformat")
        .arg(&qwen)
        .arg(&out)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the partial file has some sections in it, then kill.
    let started = std::time::Instant::now();
    loop {
        let partial: u64 = std::fs::read_dir(tmp.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum();
        if partial > 100 << 20 || started.elapsed().as_secs() > 60 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!out.exists(), "the target exists after a kill");
    let mut seen = 0;
    for e in std::fs::read_dir(tmp.path()).unwrap() {
        let p = e.unwrap().path();
        seen += 1;
        assert!(
            GstFile::open(&p).is_err(),
            "{} passes validation after a kill",
            p.display()
        );
    }
    assert!(
        seen > 0,
        "the kill came after the rename; the test did not interrupt anything"
    );
}

#[test]
fn up_sketch_section_estimates_up_rows() {
    use gatestream::format::UpSketch;
    use gatestream::quant::sketch::{sketch_dot, sketch_row_bytes};
    let tmp = tempfile::tempdir().unwrap();
    let gguf = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let opts = ReformatOptions {
        up_sketch: UpSketch::TwoBit,
        ffn_layout: FfnLayout::Bundled,
        ..Default::default()
    };
    let path = convert(&gguf, tmp.path(), "sketch.gst", &opts);
    let g = GstFile::open(&path).unwrap();
    assert_eq!(g.index.layout.up_sketch, UpSketch::TwoBit);
    let (ffn, hidden) = (g.index.config.ffn, g.index.config.hidden);
    let row_bytes = sketch_row_bytes(hidden).unwrap();
    let s = g.index.section("blk.3.ffn_up_sketch").unwrap();
    assert_eq!(s.len_bytes as usize, ffn * row_bytes);
    let sketch = g.section_bytes(s);
    let model = load(&path);
    let up = &model.weights.layers[3].dense("test").unwrap().up;
    let x: Vec<f32> = (0..hidden).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
    let mut row = vec![0f32; hidden];
    let (mut exact, mut est) = (Vec::new(), Vec::new());
    for n in 0..ffn {
        up.dequantize_row(n, &mut row);
        exact.push(row.iter().zip(&x).map(|(a, b)| a * b).sum::<f32>());
        est.push(sketch_dot(&sketch[n * row_bytes..(n + 1) * row_bytes], &x));
    }
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    let (me, ms) = (mean(&exact), mean(&est));
    let cov: f32 = exact.iter().zip(&est).map(|(a, b)| (a - me) * (b - ms)).sum();
    let var = |v: &[f32], m: f32| v.iter().map(|a| (a - m).powi(2)).sum::<f32>();
    let corr = cov / (var(&exact, me) * var(&est, ms)).sqrt();
    assert!(corr > 0.8, "2-bit sketch estimates correlate with up·x only {corr}");
}

#[test]
fn safetensors_matrices_convert_with_type_and_gguf_refuses_it() {
    use gatestream::quant::GgmlType;
    let tmp = tempfile::tempdir().unwrap();
    let src = load(&stories_dir());
    let reference = logits(&src, "Once upon a time, there was a cat");
    let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (ty, tol) in [(GgmlType::F16, 2e-3), (GgmlType::BF16, 2e-2)] {
        let opts = ReformatOptions {
            matrix_type: Some(ty),
            down_type: DownType::Same,
            ..Default::default()
        };
        let path = convert(&stories_dir(), tmp.path(), &format!("{}.gst", ty.name()), &opts);
        let g = GstFile::open(&path).unwrap();
        let t = g.index.tensor("blk.0.ffn_down_t.weight").unwrap();
        assert_eq!(t.dtype, ty);
        assert_eq!(g.index.tensor("blk.2.attn_q.weight").unwrap().dtype, ty);
        let d = max_abs_diff(&logits(&load(&path), "Once upon a time, there was a cat"), &reference) / scale;
        assert!(d < tol, "{ty:?}: logits differ by {d} of the largest");
    }
    let gguf = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let opts = ReformatOptions {
        matrix_type: Some(GgmlType::F16),
        ..Default::default()
    };
    let e = reformat(&gguf, &tmp.path().join("x.gst"), &opts, &mut |_, _, _| {}).unwrap_err();
    assert!(e.to_string().contains("--type applies to safetensors"), "{e}");
}

#[test]
fn batched_prefill_equals_token_by_token_on_neuron_major_down() {
    // The batched path sums down columns in (tokens x columns) tiles, the single-token path by
    // rows split across threads; both accumulate in f64, so they agree to f32 rounding.
    let tmp = tempfile::tempdir().unwrap();
    let gguf = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let model = load(&convert(&gguf, tmp.path(), "s.gst", &ReformatOptions::default()));
    let ids = model
        .tokenizer
        .encode("The history of the Roman Empire begins with the founding of", true)
        .unwrap();
    assert!(ids.len() > 9, "need more than one 8-token tile");
    let mut c1 = KvCache::new(&model.config, ids.len());
    let batched = model.forward(&ids, &mut c1, Logits::From(0)).unwrap();
    let mut c2 = KvCache::new(&model.config, ids.len());
    let v = model.config.vocab;
    for (i, &t) in ids.iter().enumerate() {
        let one = model.forward(&[t], &mut c2, Logits::Last).unwrap();
        let d = max_abs_diff(&one, &batched[i * v..(i + 1) * v]);
        assert!(d < 1e-3, "position {i}: logits differ by {d}");
    }
}

#[test]
fn calibrate_rewrites_the_file_safely_and_changes_no_output() {
    use gatestream::reformat::recalibrate;
    let tmp = tempfile::tempdir().unwrap();
    let path = convert(&stories_dir(), tmp.path(), "s.gst", &ReformatOptions::default());
    let before = logits(&load(&path), "Once upon a time, there was a cat");
    assert!(GstFile::open(&path).unwrap().index.calibration.is_none());
    let cal = recalibrate(&path, &wikitext(), 1024, 0, &mut |_, _, _| {}).unwrap();
    assert!(cal.text.contains("last 1024 tokens"), "{}", cal.text);
    let g = GstFile::open(&path).unwrap();
    g.verify(&mut |_, _| {}).unwrap();
    assert_eq!(g.index.calibration.as_ref().unwrap().layers.len(), 5);
    assert_eq!(g.frequencies().unwrap().unwrap().len(), 5 * 172);
    assert_eq!(logits(&load(&path), "Once upon a time, there was a cat"), before);
    // Calibrating again replaces the calibration instead of adding a second one.
    recalibrate(&path, &wikitext(), 512, 0, &mut |_, _, _| {}).unwrap();
    let g = GstFile::open(&path).unwrap();
    assert_eq!(
        g.index
            .sections
            .iter()
            .filter(|s| s.name == "calibration.frequencies")
            .count(),
        1
    );
    assert_eq!(g.index.calibration.as_ref().unwrap().tokens, 512);
    // A damaged section is refused, and the file is left as it was.
    let mut bytes = std::fs::read(&path).unwrap();
    let s = g.index.section("blk.2.ffn_gate.weight").unwrap();
    bytes[s.offset_bytes as usize + 10] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let e = recalibrate(&path, &wikitext(), 512, 0, &mut |_, _, _| {}).unwrap_err();
    assert!(e.to_string().contains("blk.2.ffn_gate.weight"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    let names: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

#[test]
fn eval_store_puts_the_frontier_in_the_file_and_run_sparse_uses_it() {
    let tmp = tempfile::tempdir().unwrap();
    let path = convert(&stories_dir(), tmp.path(), "s.gst", &ReformatOptions::default());
    let bin = env!("CARGO_BIN_EXE_gatestream");
    // `eval` of the exact criterion on short windows with an unlimited quality budget.
    let eval_cmd = |model: &Path, windows: &str, sparsity: &str| {
        let mut c = std::process::Command::new(bin);
        c.args(["eval", "--model"]).arg(model).arg("--text").arg(wikitext());
        c.args(["--ctx", "128", "--windows", windows, "--sparsity", sparsity]);
        c.args(["--criterion", "exact", "--max-ppl-increase", "1000"]);
        c
    };
    let out = eval_cmd(&path, "2", "0,0.1,0.3")
        .args(["--store", "--json"])
        .arg(tmp.path().join("e.json"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        !tmp.path().join("e.json.checkpoint").exists(),
        "the checkpoint goes once the report is written"
    );
    let g = GstFile::open(&path).unwrap();
    g.verify(&mut |_, _| {}).unwrap();
    let r = g.index.recommended_sparse.clone().expect("a stored recommendation");
    // With an unlimited budget the frontier is the sparsest (cheapest) configuration.
    assert_eq!(
        (r.strategy.as_str(), r.criterion.as_str(), r.sparsity),
        ("topk", "exact", 0.3)
    );
    let v = run_sparse_json(&path);
    assert_eq!(v["sparsity"]["level"].as_f64().unwrap() as f32, 0.3);
    assert_eq!(v["sparsity"]["criterion"], "exact");

    // Measured on the source model, stored in the .gst made from it; refused for a .gst made
    // from another model, which keeps its bytes.
    let eval_source_into = |target: &Path| {
        eval_cmd(&stories_dir(), "1", "0,0.1")
            .arg("--store-in")
            .arg(target)
            .output()
            .unwrap()
    };
    let out = eval_source_into(&path);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r = GstFile::open(&path).unwrap().index.recommended_sparse.clone().unwrap();
    assert_eq!(r.sparsity, 0.1);
    // The first run's report, stored again later at a budget chosen then (no re-evaluation).
    let recommend = |budget: &str| {
        std::process::Command::new(bin)
            .args(["recommend", "--report"])
            .arg(tmp.path().join("e.json"))
            .arg("--model")
            .arg(&path)
            .arg(format!("--max-ppl-increase={budget}"))
            .output()
            .unwrap()
    };
    let out = recommend("1000");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r = GstFile::open(&path).unwrap().index.recommended_sparse.clone().unwrap();
    assert_eq!(
        (r.sparsity, r.measured_on.as_str()),
        (0.3, "wiki.test.raw: 2 windows of 128 tokens")
    );
    // Reports of one evaluation run in parts count as one (here the same report twice).
    let out = std::process::Command::new(bin)
        .args(["recommend", "--max-ppl-increase=1000", "--model"])
        .arg(&path)
        .arg("--report")
        .arg(tmp.path().join("e.json"))
        .arg("--report")
        .arg(tmp.path().join("e.json"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        GstFile::open(&path).unwrap().index.recommended_sparse.clone().unwrap(),
        r
    );
    let out = recommend("-100");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("nothing stored"), "{err}");
    let gguf = write_temp(tmp.path(), "other.gguf", &stories_gguf(Breakage::None));
    let other = convert(&gguf, tmp.path(), "other.gst", &ReformatOptions::default());
    let before = std::fs::read(&other).unwrap();
    let out = eval_source_into(&other);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("other.gst") && err.contains("converted from"),
        "{err}"
    );
    assert_eq!(std::fs::read(&other).unwrap(), before);
}

/// `gatestream run --model PATH --mode sparse --json` (the file's recommendation) on a short prompt.
fn run_sparse_json(path: &Path) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gatestream"))
        .args(["run", "--model"])
        .arg(path)
        .args([
            "--mode",
            "sparse",
            "--max-tokens",
            "4",
            "--json",
            "--prompt",
            "Once upon a time",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Counts under the names every completion API uses; the ids under their own name.
    let ids = v["prompt_token_ids"].as_array().expect("prompt_token_ids").len();
    assert!(ids > 1 && v["prompt_tokens"].as_u64() == Some(ids as u64), "{v}");
    assert_eq!(
        v["completion_tokens"].as_u64(),
        Some(v["tokens"].as_array().unwrap().len() as u64),
        "{v}"
    );
    v
}

#[test]
fn a_stored_per_layer_budget_is_what_run_sparse_applies() {
    let tmp = tempfile::tempdir().unwrap();
    let path = convert(&stories_dir(), tmp.path(), "s.gst", &ReformatOptions::default());
    let levels = vec![0.1f32, 0.2, 0.3, 0.5, 0.4];
    let r = gatestream::format::Recommendation {
        strategy: "topk".into(),
        criterion: "exact".into(),
        sparsity: 0.3,
        max_ppl_increase_pct: 2.0,
        measured_ppl_increase_pct: 1.0,
        top1_agreement: 0.9,
        ffn_bytes_rel_dense: 0.8,
        measured_on: "test".into(),
        per_layer_sparsity: Some(levels.clone()),
    };
    gatestream::reformat::store_recommendation(&path, r.clone(), &mut |_, _, _| {}).unwrap();
    let g = GstFile::open(&path).unwrap();
    g.verify(&mut |_, _| {}).unwrap();
    assert_eq!(g.index.recommended_sparse, Some(r));
    assert_eq!(g.index.format_version, gatestream::format::FORMAT_VERSION);
    drop(g);
    let v = run_sparse_json(&path);
    let got: Vec<f32> = serde_json::from_value(v["sparsity"]["level_per_layer"].clone()).unwrap();
    assert_eq!(got, levels);
    let achieved: Vec<f32> = serde_json::from_value(v["sparsity"]["achieved_per_layer"].clone()).unwrap();
    for (a, s) in achieved.iter().zip(&levels) {
        assert!((a - s).abs() < 0.01, "achieved {achieved:?} for levels {levels:?}");
    }
}

/// A small shape `make-model` writes: `arch` with `experts`, a synthetic vocabulary of 512.
fn small_shape(arch: gatestream::config::Arch, experts: Option<(usize, usize)>) -> gatestream::synth::Shape {
    let glm = arch == gatestream::config::Arch::Glm4Moe;
    let kv_heads = if arch == gatestream::config::Arch::Olmoe { 4 } else { 2 };
    let ffn = if experts.is_some() { 256 } else { 512 };
    gatestream::synth::Shape {
        vocab: 512,
        context_len: 256,
        rope_theta: 10000.0,
        rms_eps: 1e-6,
        experts,
        // glm4moe: half of each head rotated, the first layer dense, a shared expert.
        rope_dim: glm.then_some(32),
        routing: glm.then_some(gatestream::synth::RoutingShape::glm(512)),
        ..gatestream::synth::Shape::custom(arch, 256, ffn, 3, 4, kv_heads, 64)
    }
}

fn make_model(
    dir: &Path,
    name: &str,
    spec: &gatestream::synth::MakeSpec,
    format: gatestream::synth::OutputFormat,
) -> PathBuf {
    let out = dir.join(name);
    let r = gatestream::synth::write_model(spec, &out, &format, false, &mut |_, _| {}).unwrap();
    assert_eq!(r.file_bytes, std::fs::metadata(&out).unwrap().len(), "{name}");
    out
}

/// `make-model` (each architecture it writes, dense and with experts): the `.gst` it writes
/// directly holds, section for section, the bytes `reformat` writes from the GGUF it writes from
/// the same seed (for the split, bundled and rows layouts), and the same config and tokenizer; the
/// GGUF and the rows `.gst` compute the same logits, bit for bit, and the split `.gst` (down
/// columns re-quantized to Q8_0) within rounding. A second seed gives other weights.
#[test]
fn make_model_writes_the_gst_reformat_makes_of_the_gguf_it_writes() {
    use gatestream::config::Arch;
    use gatestream::synth::{MakeSpec, Mix, OutputFormat, TokenizerChoice};
    let tmp = tempfile::tempdir().unwrap();
    let text = "Once upon a time";
    for (arch, experts, mix, rope_factors) in [
        (Arch::Llama, None, Mix::Q4KM, None),
        (Arch::Llama, None, Mix::Q6K, Some([8.0, 1.0, 4.0, 64.0])),
        (Arch::Qwen2, None, Mix::Q6K, None),
        (Arch::Qwen3, None, Mix::Q8_0, None),
        (Arch::Llama, Some((8, 2)), Mix::Q4KM, None),
        (Arch::Qwen3Moe, Some((6, 2)), Mix::Q8_0, None),
        (Arch::Olmoe, Some((4, 2)), Mix::Q4KM, None),
        (Arch::Glm4Moe, Some((4, 2)), Mix::Q4KM, None),
    ] {
        let spec = MakeSpec {
            shape: gatestream::synth::Shape {
                rope_factors,
                ..small_shape(arch, experts)
            },
            mix,
            dequantize: false,
            tokenizer: TokenizerChoice::Synthetic,
            seed: 3,
            residual_gain: 0.1,
        };
        let what = format!("{arch:?} {experts:?} {mix:?} {rope_factors:?}");
        let base = format!("{}-{}-{}", arch.name(), experts.is_some(), rope_factors.is_some());
        let gguf = make_model(tmp.path(), &format!("{base}.gguf"), &spec, OutputFormat::Gguf);
        let in_ram = logits(&load(&gguf), text);
        assert!(in_ram.iter().all(|v| v.is_finite()), "{what}");
        let layouts: &[FfnLayout] = match experts {
            None => &[FfnLayout::Split, FfnLayout::Bundled, FfnLayout::Rows],
            Some(_) => &[FfnLayout::Split],
        };
        for &layout in layouts {
            let opts = ReformatOptions {
                ffn_layout: layout,
                ..ReformatOptions::default()
            };
            let direct = make_model(
                tmp.path(),
                &format!("{base}-{layout:?}.gst"),
                &spec,
                OutputFormat::Gst(opts.clone()),
            );
            let converted = convert(&gguf, tmp.path(), &format!("{base}-{layout:?}-converted.gst"), &opts);
            let (a, b) = (GstFile::open(&direct).unwrap(), GstFile::open(&converted).unwrap());
            a.verify(&mut |_, _| {}).unwrap();
            assert_eq!(a.index.config, b.index.config, "{what} {layout:?}");
            assert_eq!(a.index.layout, b.index.layout, "{what} {layout:?}");
            assert_eq!(a.index.tensors, b.index.tensors, "{what} {layout:?}");
            let names = |g: &GstFile| g.index.sections.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
            assert_eq!(names(&a), names(&b), "{what} {layout:?}");
            for (sa, sb) in a.index.sections.iter().zip(&b.index.sections) {
                assert!(
                    a.section_bytes(sa) == b.section_bytes(sb),
                    "{what} {layout:?}: section {} differs",
                    sa.name
                );
            }
            let got = logits(&load(&direct), text);
            if layout == FfnLayout::Rows || experts.is_some() {
                assert!(
                    got.iter().zip(&in_ram).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{what} {layout:?}"
                );
                if layout == FfnLayout::Rows {
                    // No larger than the GGUF but for each section's alignment to 4 KiB
                    // (nothing re-quantized; 292 sections pad Llama-3-8B's 4.9 GB by 1.2 MB).
                    let len = |p: &Path| std::fs::metadata(p).unwrap().len();
                    let pad = 4096 * a.index.sections.len() as u64;
                    assert!(
                        len(&direct) <= len(&gguf) + pad,
                        "{what}: {} vs {}",
                        len(&direct),
                        len(&gguf)
                    );
                }
            } else {
                let range = in_ram.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(max_abs_diff(&got, &in_ram) < 0.05 * range, "{what} {layout:?}");
            }
        }
        let other = make_model(
            tmp.path(),
            &format!("{base}-seed4.gguf"),
            &MakeSpec {
                seed: 4,
                ..spec.clone()
            },
            OutputFormat::Gguf,
        );
        assert_ne!(
            logits(&load(&other), text),
            in_ram,
            "{what}: another seed, the same weights"
        );
    }
}

/// `make-model` takes a real tokenizer (SmolLM2's) and pads its vocabulary to the shape's with
/// unused tokens: the model encodes text as SmolLM2 does and has the shape's vocabulary; a shape
/// with fewer tokens than the tokenizer takes the tokenizer's. Bad shapes, an existing output and
/// a full disk's worth are refused with the reason.
#[test]
fn make_model_pads_a_real_tokenizer_and_refuses_bad_shapes() {
    use gatestream::config::Arch;
    use gatestream::synth::{MakeSpec, Mix, OutputFormat, Shape, TokenizerChoice};
    let tmp = tempfile::tempdir().unwrap();
    let smollm2 = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let spec = |vocab: usize| MakeSpec {
        shape: Shape {
            vocab,
            ..small_shape(Arch::Llama, None)
        },
        mix: Mix::Q4KM,
        dequantize: false,
        tokenizer: TokenizerChoice::From(smollm2.clone()),
        seed: 1,
        residual_gain: 0.1,
    };
    let padded = make_model(tmp.path(), "padded.gguf", &spec(50_000), OutputFormat::Gguf);
    let (m, donor) = (load(&padded), load(&smollm2));
    assert_eq!(m.config.vocab, 50_000);
    let text = "The capital of France is Paris.";
    assert_eq!(
        m.tokenizer.encode(text, true).unwrap(),
        donor.tokenizer.encode(text, true).unwrap()
    );
    let gst = make_model(
        tmp.path(),
        "padded.gst",
        &spec(50_000),
        OutputFormat::Gst(ReformatOptions::default()),
    );
    assert_eq!(
        load(&gst).tokenizer.encode(text, true).unwrap(),
        donor.tokenizer.encode(text, true).unwrap()
    );
    let small = make_model(tmp.path(), "small.gguf", &spec(1000), OutputFormat::Gguf);
    assert_eq!(load(&small).config.vocab, 49_152, "the tokenizer's vocabulary");
    // An existing file is kept; bad shapes are named.
    let e = gatestream::synth::write_model(&spec(50_000), &padded, &OutputFormat::Gguf, false, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("already exists") && e.contains("--force"), "{e}");
    for (shape, needle) in [
        (
            Shape {
                heads: 3,
                ..small_shape(Arch::Llama, None)
            },
            "KV heads",
        ),
        (
            Shape {
                hidden: 100,
                ..small_shape(Arch::Llama, None)
            },
            "multiples of 32",
        ),
        (small_shape(Arch::Qwen3Moe, None), "needs --experts"),
        (
            Shape {
                experts: Some((4, 5)),
                ..small_shape(Arch::Llama, None)
            },
            "used",
        ),
        (
            Shape {
                kv_heads: 2,
                ..small_shape(Arch::Olmoe, Some((4, 2)))
            },
            "grouped-query",
        ),
    ] {
        let s = MakeSpec {
            shape,
            tokenizer: TokenizerChoice::Synthetic,
            ..spec(512)
        };
        let out = tmp.path().join("bad.gguf");
        let e = gatestream::synth::write_model(&s, &out, &OutputFormat::Gguf, false, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{needle}: {e}");
        assert!(!out.exists());
    }
    let e = gatestream::synth::Shape::named("llama3-9b").unwrap_err().to_string();
    assert!(e.contains("llama3-8b") && e.contains("custom"), "{e}");
}

/// `verify` reads the file (not through a map) in batches: a section longer than a batch (36 MB
/// here) is hashed across them, and one flipped byte anywhere in a section is found and named.
#[test]
fn verify_reads_large_sections_and_finds_a_flipped_byte() {
    use gatestream::config::Arch;
    use gatestream::synth::{MakeSpec, Mix, OutputFormat, Shape, TokenizerChoice};
    let tmp = tempfile::tempdir().unwrap();
    let spec = MakeSpec {
        shape: Shape {
            hidden: 2048,
            ffn: 16384,
            layers: 1,
            heads: 16,
            kv_heads: 4,
            head_dim: 128,
            ..small_shape(Arch::Llama, None)
        },
        mix: Mix::Q8_0,
        dequantize: false,
        tokenizer: TokenizerChoice::Synthetic,
        seed: 9,
        residual_gain: 0.1,
    };
    let opts = ReformatOptions {
        ffn_layout: FfnLayout::Rows,
        ..ReformatOptions::default()
    };
    let p = make_model(tmp.path(), "big.gst", &spec, OutputFormat::Gst(opts));
    let g = GstFile::open(&p).unwrap();
    let up = g
        .index
        .sections
        .iter()
        .find(|s| s.name == "blk.0.ffn_up.weight")
        .unwrap()
        .clone();
    assert!(up.len_bytes > 32 << 20, "{}", up.len_bytes);
    let mut seen = 0;
    g.verify(&mut |done, total| {
        assert!(done <= total);
        seen = done;
    })
    .unwrap();
    assert_eq!(seen, g.index.sections.iter().map(|s| s.len_bytes).sum::<u64>());
    drop(g);
    // One bit flipped past the first batch of the large section.
    let at = up.offset_bytes + (33 << 20) + 12345;
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[at as usize] ^= 0x10;
    std::fs::write(&p, &bytes).unwrap();
    let e = GstFile::open(&p)
        .unwrap()
        .verify(&mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("`blk.0.ffn_up.weight` checksum mismatch"), "{e}");
    assert!(e.contains(&up.offset_bytes.to_string()), "{e}");
}

/// A type gatestream reads but did not write into the source (stories260K with its layer-0 up
/// rows in Q5_1): every layout keeps those rows as stored, Q5_1, and computes the source's
/// logits: bit for bit in the rows layout, to summation order with down columns kept as the
/// source's (F32), to their rounding with Q8_0 down columns.
#[test]
fn q5_1_rows_are_kept_in_every_layout() {
    use gatestream::quant::GgmlType;
    let tmp = tempfile::tempdir().unwrap();
    let gguf = write_temp(tmp.path(), "q5_1-up.gguf", &stories_gguf(Breakage::Q5_1Up));
    let text = "Once upon a time, there was a cat";
    let reference = logits(&load(&gguf), text);
    let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    let variants = [
        (FfnLayout::Rows, DownType::Q8_0, 0.0),
        (FfnLayout::Split, DownType::Same, 1e-5),
        (FfnLayout::Bundled, DownType::Q8_0, 2e-2),
    ];
    for (ffn_layout, down_type, tol) in variants {
        let opts = ReformatOptions {
            ffn_layout,
            down_type,
            ..Default::default()
        };
        let path = convert(&gguf, tmp.path(), &format!("{ffn_layout:?}.gst"), &opts);
        let g = GstFile::open(&path).unwrap();
        let up = g.index.tensors.iter().find(|t| t.name == "blk.0.ffn_up.weight");
        let up = up.unwrap_or_else(|| panic!("{ffn_layout:?}: no view of blk.0.ffn_up.weight"));
        assert_eq!(up.dtype, GgmlType::Q5_1, "{ffn_layout:?}");
        let d = max_abs_diff(&logits(&load(&path), text), &reference) / scale;
        assert!(
            d <= tol,
            "{ffn_layout:?}: logits differ from the source by {d} of the largest"
        );
    }
}
