//! Masks and `eval` on real weights (stories260K, fast): keeping every neuron is the dense
//! model, dropping neurons changes the output by the amount the criterion predicts, thresholds
//! calibrated on one part of a text give about the asked sparsity, union keeps the context dense.

mod common;

use common::*;
use gatestream::eval::{eval, EvalOptions};
use gatestream::kv::KvCache;
use gatestream::model::batch::Logits;
use gatestream::model::forward::{FfnHooks, Passes};
use gatestream::model::{LoadOptions, Model};
use gatestream::sparsity::calibration::ScorePools;
use gatestream::sparsity::{Criterion, Masker, Strategy, UpSketches};

const DOG_STORY: &str = "Once upon a time, there was a little dog who liked to run in the park";

fn stories() -> Model {
    Model::load(&stories_dir(), &LoadOptions::default()).unwrap()
}

fn text() -> String {
    std::fs::read_to_string(data_dir().join("wikitext-2/wiki.test.raw")).unwrap()
}

/// `eval` options for stories260K: 2 windows of 128 tokens, the given grid, nothing else.
fn eval_opts(sparsities: &[f32], strategies: &[Strategy], criteria: &[Criterion]) -> EvalOptions {
    EvalOptions {
        ctx: 128,
        windows: 2,
        sparsities: sparsities.to_vec(),
        strategies: strategies.to_vec(),
        criteria: criteria.to_vec(),
        calibrate_tokens: 512,
        max_ppl_increase_pct: 2.0,
        per_layer_tokens: 0,
        checkpoint: None,
        windows_this_run: None,
        jitter_seeds: 0,
        experts: None,
    }
}

/// A whole evaluation (no checkpoint stop) on wiki.test.raw.
fn evaluate(model: &Model, text: &str, opts: &EvalOptions) -> gatestream::eval::EvalReport {
    eval(model, text, "wiki.test.raw", opts, &mut |_, _, _| {})
        .unwrap()
        .unwrap()
}

fn run(model: &Model, ids: &[u32], mask: Option<&Masker>) -> Vec<f32> {
    let mut cache = KvCache::new(&model.config, ids.len());
    let hooks = FfnHooks {
        observe: None,
        mask: mask.map(|m| m as _),
        stream: None,
        cancel: None,
    };
    model.forward_with(ids, &mut cache, Logits::From(0), &hooks).unwrap()
}

#[test]
fn keeping_every_neuron_is_the_dense_model_for_every_criterion() {
    let model = stories();
    let sketches = UpSketches::build(&model).unwrap();
    let ids = model
        .tokenizer
        .encode("Once upon a time, there was a little dog", true)
        .unwrap();
    let dense = run(&model, &ids, None);
    for c in [
        Criterion::Gate,
        Criterion::Exact,
        Criterion::Candidates,
        Criterion::Sketch,
    ] {
        let m = Masker::new(&model, Strategy::TopK, c, 0.0, Some(&sketches), None);
        assert_eq!(run(&model, &ids, Some(&m)), dense, "{c:?}");
        assert!(m.achieved_sparsity().iter().all(|&s| s == 0.0));
    }
}

#[test]
fn top_k_drops_exactly_the_asked_share_and_exact_beats_gate() {
    let model = stories();
    let ids = model.tokenizer.encode(DOG_STORY, true).unwrap();
    let dense = run(&model, &ids, None);
    let err = |c: Criterion| {
        let m = Masker::new(&model, Strategy::TopK, c, 0.5, None, None);
        let out = run(&model, &ids, Some(&m));
        let achieved = m.achieved_sparsity();
        let want = 1.0 - (0.5f32 * model.config.ffn as f32).round() / model.config.ffn as f32;
        assert!(achieved.iter().all(|&s| (s - want).abs() < 1e-6), "{c:?}: {achieved:?}");
        out.iter()
            .zip(&dense)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
    };
    let (gate, exact) = (err(Criterion::Gate), err(Criterion::Exact));
    assert!(gate > 0.0 && exact > 0.0);
    assert!(
        exact < gate,
        "the exact criterion should lose less than the gate alone: {exact} vs {gate}"
    );
}

#[test]
fn thresholds_from_calibration_give_about_the_target_sparsity() {
    let model = stories();
    let pools = ScorePools::collect(
        &model,
        Passes::default(),
        &text(),
        "wiki.test.raw",
        1024,
        &[Criterion::Exact, Criterion::Gate],
        None,
    )
    .unwrap();
    let ids = model.tokenizer.encode(&text()[..3000], true).unwrap();
    for s in [0.3, 0.5, 0.7] {
        let m = Masker::new(
            &model,
            Strategy::Threshold,
            Criterion::Exact,
            s,
            None,
            Some(pools.thresholds(Criterion::Exact, s)),
        );
        run(&model, &ids[..256], Some(&m));
        let a = m.achieved_sparsity();
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!((mean - s).abs() < 0.1, "target {s}, achieved {mean} ({a:?})");
    }
}

#[test]
fn union_keeps_the_context_dense_and_masks_the_rest() {
    let model = stories();
    let ids = model.tokenizer.encode(DOG_STORY, true).unwrap();
    let dense = run(&model, &ids, None);
    let m = Masker::new(&model, Strategy::Union, Criterion::Exact, 0.5, None, None);
    let half = ids.len() / 2;
    m.set_union_context(half);
    let out = run(&model, &ids, Some(&m));
    let v = model.config.vocab;
    assert_eq!(&out[..half * v], &dense[..half * v], "context positions must be dense");
    assert_ne!(&out[half * v..], &dense[half * v..]);
}

#[test]
fn eval_reports_dense_first_and_sparse_rows_with_bytes() {
    let model = stories();
    let opts = EvalOptions {
        max_ppl_increase_pct: 1e9,
        ..eval_opts(
            &[0.0, 0.5],
            &[Strategy::TopK, Strategy::Threshold],
            &[Criterion::Gate, Criterion::Exact],
        )
    };
    let r = evaluate(&model, &text(), &opts);
    assert_eq!(r.rows.len(), 1 + 4);
    assert_eq!(r.rows[0].ppl_increase_pct, 0.0);
    assert_eq!(r.scored_positions, 2 * 63);
    for row in &r.rows[1..] {
        assert!(row.top1_agreement <= 1.0 && row.mean_kl > 0.0, "{row:?}");
        assert!(
            row.ffn_bytes_rel_dense < 1.0 && row.ffn_bytes_rel_dense > 0.3,
            "{row:?}"
        );
    }
    // Exact needs all of up, so it reads more than gate at the same level.
    let bytes = |c: Criterion| {
        r.rows
            .iter()
            .find(|x| x.criterion == Some(c) && x.strategy == Some(Strategy::TopK))
            .unwrap()
            .ffn_bytes_per_token
    };
    assert!(bytes(Criterion::Exact) > bytes(Criterion::Gate));
    // With an unlimited budget the frontier is the cheapest row (the least perplexity among
    // rows as cheap within the tie share); with none, dense.
    let fewest = r.rows.iter().map(|x| x.ffn_bytes_per_token).fold(f64::MAX, f64::min);
    let f = &r.rows[r.frontier];
    assert!(f.ffn_bytes_per_token <= fewest * (1.0 + gatestream::eval::FRONTIER_BYTES_TIE));
    assert!(r
        .rows
        .iter()
        .filter(|x| x.ffn_bytes_per_token <= fewest * (1.0 + gatestream::eval::FRONTIER_BYTES_TIE))
        .all(|x| x.ppl_increase_pct >= f.ppl_increase_pct));
    assert_eq!(gatestream::eval::frontier(&r.rows, -1.0), 0);
    // A per-layer row a few bytes dearer than the uniform one but better wins.
    let mut rows = vec![r.rows[0].clone(), r.rows[1].clone(), r.rows[1].clone()];
    rows[2].ffn_bytes_per_token += 12.0;
    rows[2].ppl_increase_pct -= 0.2;
    assert_eq!(gatestream::eval::frontier(&rows, 1e9), 2);
    rows[2].ffn_bytes_per_token *= 1.01;
    assert_eq!(gatestream::eval::frontier(&rows, 1e9), 1, "1% dearer is not a tie");
    let chart = gatestream::eval::chart(&r);
    assert_eq!(chart.series.len(), 4, "one line per strategy x criterion");
    assert!(chart.svg().contains("topk exact"));
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains("\"top1_agreement\"") && json.contains("\"bytes_model\""));
}

#[test]
fn per_layer_budgets_keep_the_mean_and_the_bytes_of_uniform() {
    use gatestream::sparsity::budget::Sensitivity;
    let model = stories();
    let sens = Sensitivity::measure(
        &model,
        Passes::default(),
        &text(),
        256,
        Criterion::Exact,
        None,
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(sens.kl.len(), 5);
    assert!(
        sens.kl.iter().all(|row| row.windows(2).all(|w| w[1] >= w[0] * 0.5)),
        "{:?}",
        sens.kl
    );
    let alloc = sens.allocate(0.5);
    assert!((alloc.iter().sum::<f32>() / 5.0 - 0.5).abs() < 1e-5, "{alloc:?}");
    let opts = EvalOptions {
        per_layer_tokens: 256,
        ..eval_opts(&[0.5], &[Strategy::TopK], &[Criterion::Exact])
    };
    let r = evaluate(&model, &text(), &opts);
    assert_eq!(r.rows.len(), 3);
    let (uniform, layered) = (&r.rows[1], &r.rows[2]);
    assert!(uniform.per_layer.is_none() && layered.per_layer.is_some());
    // The kept blend is never worse than uniform on the calibration tokens.
    let a = layered
        .allocation
        .as_ref()
        .expect("a per-layer row says how it was chosen");
    assert!(a.calibration_kl <= a.calibration_kl_uniform, "{a:?}");
    assert_eq!(layered.per_layer.as_ref(), Some(&a.levels));
    assert!((layered.ffn_bytes_per_token - uniform.ffn_bytes_per_token).abs() / uniform.ffn_bytes_per_token < 0.02);
}

#[test]
fn smollm2_still_says_paris_with_the_frontier_configuration() {
    // The frontier measured by `gatestream eval` on SmolLM2 on 4 windows (≤ 2% perplexity):
    // per-token top-K on the exact score, 30% of neurons dropped.
    let path = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let model = Model::load(&path, &LoadOptions::default()).unwrap();
    let m = Masker::for_model(&model, Strategy::TopK, Criterion::Exact, 0.3, None).unwrap();
    let g = model
        .generate_with("The capital of France is", &greedy(4), Some(&m), None, &mut |_| {})
        .unwrap();
    assert!(g.text.starts_with(" Paris"), "{:?}", g.text);
    let a = m.achieved_sparsity();
    assert!(a.iter().all(|&s| (s - 0.3).abs() < 0.01), "{a:?}");

    // The frontier on 20 windows (≤ 2%): calibrated thresholds on the exact score at 50%
    // (+1.91%, 0.779 of dense FFN bytes), thresholds from the .gst's calibration (the text's
    // last 2048 tokens, as eval calibrates them).
    use gatestream::reformat::{reformat, ReformatOptions};
    let tmp = tempfile::tempdir().unwrap();
    let gst = tmp.path().join("smollm2.gst");
    let opts = ReformatOptions {
        calibrate_text: Some(data_dir().join("wikitext-2/wiki.test.raw")),
        ..ReformatOptions::default()
    };
    reformat(&path, &gst, &opts, &mut |_, _, _| {}).unwrap();
    let model = Model::load(&gst, &LoadOptions::default()).unwrap();
    let m = Masker::for_model(&model, Strategy::Threshold, Criterion::Exact, 0.5, None).unwrap();
    let g = model
        .generate_with("The capital of France is", &greedy(4), Some(&m), None, &mut |_| {})
        .unwrap();
    assert!(g.text.starts_with(" Paris"), "{:?}", g.text);

    // A level between the old 0.1 grid's (eval reports two decimals, e.g. Qwen's frontier at
    // 0.67) runs with its own thresholds, as eval evaluated it, not the nearest tenth's.
    let pools = ScorePools::collect(
        &model,
        Passes::default(),
        &text(),
        "wiki.test.raw",
        2048,
        &[Criterion::Exact],
        None,
    )
    .unwrap();
    let ids = model.tokenizer.encode(&text()[..3000], true).unwrap();
    let achieved = |m: &Masker| {
        run(&model, &ids[..256], Some(m));
        let a = m.achieved_sparsity();
        a.iter().sum::<f32>() / a.len() as f32
    };
    let stored = achieved(&Masker::for_model(&model, Strategy::Threshold, Criterion::Exact, 0.67, None).unwrap());
    let evaluated = achieved(&Masker::new(
        &model,
        Strategy::Threshold,
        Criterion::Exact,
        0.67,
        None,
        Some(pools.thresholds(Criterion::Exact, 0.67)),
    ));
    let tenth = achieved(&Masker::for_model(&model, Strategy::Threshold, Criterion::Exact, 0.7, None).unwrap());
    assert!(
        (stored - evaluated).abs() < 0.003 && (stored - tenth).abs() > 0.01,
        "0.67 from the file: {stored}, from eval's calibration: {evaluated}, 0.7 from the file: {tenth}"
    );
}

#[test]
fn union_learns_from_the_prompt_and_reuses_the_set_while_decoding() {
    let model = stories();
    let m = Masker::for_model(&model, Strategy::Union, Criterion::Exact, 0.5, None).unwrap();
    let g = model
        .generate_with(
            "Once upon a time, there was a little dog",
            &greedy(8),
            Some(&m),
            None,
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(g.tokens.len(), 8);
    // Decode steps (after the prompt) were masked at the asked level, with the prompt's set.
    let a = m.achieved_sparsity();
    assert!(a.iter().all(|&s| (s - 0.5).abs() < 0.01), "{a:?}");
    // Threshold needs stored calibration: a clear error on a model without it.
    let e = Masker::for_model(&model, Strategy::Threshold, Criterion::Exact, 0.5, None)
        .err()
        .unwrap();
    assert!(e.to_string().contains("calibrate"), "{e}");
}

/// `eval` runs a union mask's context once (in the dense pass) and only its second half per
/// mask; that must score exactly what a union mask running the whole window by itself scores,
/// also beside top-K rows that use the same cache, and for union candidates, which eval does not
/// run (it is union exact by construction).
#[test]
fn eval_union_rows_equal_a_union_mask_running_each_whole_window() {
    use gatestream::backend::ops::log_sum_exp;
    let model = stories();
    let (ctx, windows) = (128, 2);
    let opts = EvalOptions {
        ctx,
        windows,
        ..eval_opts(
            &[0.0, 0.5],
            &[Strategy::TopK, Strategy::Union],
            &[Criterion::Gate, Criterion::Exact, Criterion::Candidates],
        )
    };
    let text = text();
    let r = evaluate(&model, &text, &opts);
    let t = gatestream::eval::table(&r);
    assert!(t.contains("union candidates = union exact"), "{t}");
    let ids = model.tokenizer.encode(&text, true).unwrap();
    // eval takes union candidates from union exact; a union candidates mask run by itself
    // must score the same.
    for c in [Criterion::Gate, Criterion::Exact, Criterion::Candidates] {
        let (mut nll, mut n) = (0.0f64, 0usize);
        for w in 0..windows {
            let batch = gatestream::perplexity::window_tokens(&model, &ids, w, ctx);
            let m = Masker::new(&model, Strategy::Union, c, 0.5, None, None);
            m.set_union_context(ctx / 2);
            let out = run(&model, &batch, Some(&m));
            let v = model.config.vocab;
            for j in ctx / 2..ctx - 1 {
                let row = &out[j * v..(j + 1) * v];
                nll -= row[ids[w * ctx + j + 1] as usize] as f64 - log_sum_exp(row);
                n += 1;
            }
        }
        let want = (nll / n as f64).exp();
        let row = r
            .rows
            .iter()
            .find(|x| x.strategy == Some(Strategy::Union) && x.criterion == Some(c))
            .unwrap();
        assert!(
            (row.perplexity - want).abs() < 1e-9 * want,
            "{c:?}: eval {} vs whole windows {want}",
            row.perplexity
        );
    }
}

#[test]
fn an_eval_stopped_and_resumed_from_its_checkpoint_reports_what_one_run_reports() {
    let model = stories();
    let text = text();
    let tmp = tempfile::tempdir().unwrap();
    let checkpoint = tmp.path().join("eval.checkpoint");
    let opts = EvalOptions {
        windows: 4,
        per_layer_tokens: 256,
        jitter_seeds: 1,
        ..eval_opts(
            &[0.0, 0.5],
            &[Strategy::TopK, Strategy::Threshold, Strategy::Union],
            &[Criterion::Gate, Criterion::Exact],
        )
    };
    let whole = evaluate(&model, &text, &opts);
    // Every sparse row carries its jittered re-run; the spread covers it and the row.
    for row in &whole.rows[1..] {
        let j = row.jitter.as_ref().expect("a jittered re-run");
        assert_eq!(j.ppl_increase_pct.len(), 1);
        let want = (j.ppl_increase_pct[0] - row.ppl_increase_pct).abs();
        assert!(
            (j.ppl_increase_spread - want).abs() < 1e-9,
            "{j:?} vs {}",
            row.ppl_increase_pct
        );
    }
    assert!(whole.rows[0].jitter.is_none());
    // In three parts: 1 window, 2 more, the rest; every part saves its progress.
    let parts = EvalOptions {
        checkpoint: Some(checkpoint.clone()),
        ..opts.clone()
    };
    let mut windows_seen = Vec::new();
    for n in [Some(1), Some(2)] {
        let part = EvalOptions {
            windows_this_run: n,
            ..parts.clone()
        };
        let r = eval(&model, &text, "wiki.test.raw", &part, &mut |stage, d, _| {
            if stage == "windows" {
                windows_seen.push(d)
            }
        })
        .unwrap();
        assert!(r.is_none(), "a part stops before the last window");
        assert!(checkpoint.exists());
    }
    assert_eq!(windows_seen, [0, 1, 1, 2, 3], "each part starts where the last stopped");
    let resumed = evaluate(&model, &text, &parts);
    let json = |r: &gatestream::eval::EvalReport| serde_json::to_value(&r.rows).unwrap();
    assert_eq!(json(&resumed), json(&whole), "bit for bit the same rows");
    assert_eq!(resumed.scored_positions, whole.scored_positions);

    // A checkpoint of another evaluation, or a damaged one, is refused with the file named.
    let other = EvalOptions {
        sparsities: vec![0.0, 0.3],
        ..parts.clone()
    };
    let e = eval(&model, &text, "wiki.test.raw", &other, &mut |_, _, _| {})
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("eval.checkpoint") && e.contains("different evaluation") && e.contains("sparsities"),
        "{e}"
    );
    std::fs::write(&checkpoint, b"{\"format\": 1").unwrap();
    let e = eval(&model, &text, "wiki.test.raw", &parts, &mut |_, _, _| {})
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("eval.checkpoint") && e.contains("not a readable eval checkpoint"),
        "{e}"
    );
}
