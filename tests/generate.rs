//! Generation as a request: chunked prefill (also under a stream, whose budget holds one
//! batch's activations), cancellation, tokens with log-probabilities, the mask's prompt mode
//! reset after a failed pass, and the runtime that assembles a streamed, masked model.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use gatestream::error::{Error, Result};
use gatestream::format::FfnLayout;
use gatestream::model::forward::{AttnWeights, FfnHooks, LayerStream};
use gatestream::model::generate::{Finish, GenerateOptions, PromptAwareMask};
use gatestream::model::{LoadOptions, Model};
use gatestream::reformat::{reformat, ReformatOptions};
use gatestream::runtime::{KvPositions, OpenOptions, SparseAsk};
use gatestream::sparsity::{Criterion, Masker, Strategy};

/// A runtime streaming through pread under `budget` bytes, passes of at most `batch` tokens,
/// a KV cache of `positions`, no mask.
fn streamed(budget: u64, batch: usize, positions: usize) -> OpenOptions {
    OpenOptions {
        threads: 0,
        stream: Some(pread_stream(budget, batch)),
        sparse: None,
        kv_positions: KvPositions::Exactly(positions),
        experts_used: None,
    }
}

/// SmolLM2 as a `.gst` (split layout) in `dir`.
fn smollm2_gst(dir: &std::path::Path) -> std::path::PathBuf {
    let gst = dir.join("smollm2.gst");
    let opts = ReformatOptions {
        ffn_layout: FfnLayout::Split,
        ..ReformatOptions::default()
    };
    reformat(
        &model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2"),
        &gst,
        &opts,
        &mut |_, _, _| {},
    )
    .unwrap();
    gst
}

/// `--vram-budget` on a device with memory of its own (the host stand-in, which keeps weights
/// as the CUDA device does): under a device budget of 40% of the file, from host RAM (no RAM
/// budget) and from disk (a RAM budget), the in-RAM model's tokens; the device keeps only what
/// its plan keeps, and a dense decode step copies exactly what the plan says it copies (every
/// weight not kept, the whole FFN); a masked one copies less (from host RAM it copies no FFN
/// row: the kept ones are read in place from the mapped neuron cache). A budget below the
/// minimum is refused naming it, and the CPU device refuses the flag.
#[test]
fn a_gpu_budget_keeps_part_of_the_model_on_the_device_and_copies_the_rest_at_each_use() {
    use gatestream::backend::standin::HostStandIn;
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let gst = smollm2_gst(tmp.path());
    let file_bytes = std::fs::metadata(&gst).unwrap().len();
    let in_ram = Model::load(&gst, &LoadOptions::default()).unwrap();
    let ids = in_ram.prompt_ids("The capital of France is", false).unwrap();
    let sparse = SparseAsk {
        strategy: Some(Strategy::TopK),
        criterion: Some(Criterion::Exact),
        sparsity: Some(0.5),
    };
    let want = |mask: Option<SparseAsk>| {
        let rt = gatestream::runtime::open(
            &gst,
            &OpenOptions {
                sparse: mask,
                stream: None,
                ..streamed(0, 8, 0)
            },
        )
        .unwrap();
        rt.generate(&ids, &greedy(6), false, None, &mut |_| {})
            .unwrap()
            .generation
            .tokens
    };
    let (want_dense, want_sparse) = (want(None), want(Some(sparse.clone())));
    let ffn_layer_bytes = in_ram
        .weights
        .layers
        .iter()
        .map(|l| match &l.ffn {
            gatestream::model::weights::LayerFfn::Dense(f) => (f.up.len_bytes() + f.down.weight().len_bytes()) as u64,
            gatestream::model::weights::LayerFfn::Experts(_) => unreachable!("a dense model"),
        })
        .max()
        .unwrap();
    let with_vram = |ram: u64, vram: u64, mask: Option<SparseAsk>| {
        let mut o = streamed(ram, 8, ids.len() + 6);
        o.stream.as_mut().unwrap().vram_budget_bytes = Some(vram);
        o.sparse = mask;
        o
    };
    let vram = file_bytes * 2 / 5;
    for ram in [gatestream::stream::RAM_UNLIMITED, file_bytes * 3 / 4] {
        let mut dense_copies = 0.0;
        for mask in [None, Some(sparse.clone())] {
            let dev = Arc::new(HostStandIn::new(0));
            let rt = gatestream::runtime::open_on(&gst, &with_vram(ram, vram, mask.clone()), dev.clone()).unwrap();
            let got = rt.generate(&ids, &greedy(6), false, None, &mut |_| {}).unwrap();
            let what = format!("ram {ram} sparse {}", mask.is_some());
            let want = if mask.is_some() { &want_sparse } else { &want_dense };
            assert_eq!(&got.generation.tokens, want, "{what}");
            let report = got.stream.expect("a stream report");
            let plan = report.device_plan.clone().expect("a device plan");
            let link = report.link.expect("link figures");
            assert!(plan.resident_bytes() <= vram, "{what}: {plan:?}");
            // Something kept and something not: the output matrix (tied embedding) comes first.
            assert!(plan.output_resident, "{what}: {plan:?}");
            assert!(
                plan.attention_resident.iter().chain(&plan.gate_resident).any(|&k| !k),
                "{what}: {plan:?}"
            );
            // The device kept at most the weights its plan keeps (norms travel as vectors).
            let (resident, _) = dev.copied_bytes();
            assert!(
                resident > 0 && resident <= plan.output_bytes + plan.attention_bytes + plan.gate_bytes + plan.hot_bytes,
                "{what}: {resident} resident bytes copied, plan {plan:?}"
            );
            // The stream's FFN staging is page-locked while the stream is open, and so are the
            // resident attention and gate matrices the plan does not keep (each its own
            // buffer), and each layer's neuron cache (up rows, down columns; mapped too).
            // Under the RAM budget some of those stream from disk instead, through the prefetch
            // thread's two buffers, which are locked too. So a dense step copies only from
            // page-locked memory either way.
            let unkept = 4 * plan.attention_resident.iter().filter(|&&k| !k).count()
                + plan.gate_resident.iter().filter(|&&k| !k).count();
            // A partial cache holds the neurons after the device's hot ones (a whole one, all).
            let ffn = in_ram.config.ffn;
            let host_held = |(&n, &hot): (&usize, &usize)| if n == ffn { n } else { n - hot };
            let held = report
                .residency
                .cache_neurons
                .iter()
                .zip(&plan.hot_neurons)
                .map(host_held);
            let caches = 2 * held.filter(|&n| n > 0).count();
            let all_resident = ram == gatestream::stream::RAM_UNLIMITED;
            if all_resident {
                assert_eq!(caches, 2 * plan.gate_resident.len(), "{what}: every layer cached");
                assert_eq!(dev.pinned_ranges(), 2 + unkept + caches, "{what}");
            } else {
                assert!(
                    (4 + caches..=4 + unkept + caches).contains(&dev.pinned_ranges()),
                    "{what}"
                );
            }
            if mask.is_none() {
                assert_eq!(link.bytes_per_token, plan.copied_bytes_per_token as f64, "{what}");
                let pinned = link.pinned_fraction * link.bytes_per_token;
                assert!(
                    (pinned - link.bytes_per_token).abs() < 1.0,
                    "{what}: {pinned} of {} bytes per token page-locked",
                    link.bytes_per_token
                );
                dense_copies = link.bytes_per_token;
            } else {
                assert!(
                    link.bytes_per_token < 0.85 * dense_copies,
                    "{what}: {link:?} vs dense {dense_copies}"
                );
                let u = dev.upload_counters();
                if all_resident {
                    // The cache holds every layer, mapped: decode steps read the kept rows by
                    // id where they are, nothing staged.
                    assert!(
                        link.mapped_bytes_per_token > 0.0 && u.uploads == 0,
                        "{what}: {link:?} {u:?}"
                    );
                } else {
                    // Decode steps staged their FFN rows; the staging buffers alive at once never
                    // held more than one layer's up and down matrices (the room the plan keeps
                    // for one layer's copies), give or take a grain each.
                    let grain = gatestream::backend::UPLOAD_BUFFER_GRAIN as u64;
                    assert_eq!(
                        link.mapped_bytes_per_token, 0.0,
                        "{what}: a partial cache is not read in place"
                    );
                    assert!(u.uploads > 0 && u.peak_held_bytes > 0, "{what}: {u:?}");
                    assert!(
                        u.peak_held_bytes <= ffn_layer_bytes + 2 * grain,
                        "{what}: {u:?} vs {ffn_layer_bytes}"
                    );
                }
            }
            // The locks go with the stream (before its buffers).
            drop(rt);
            assert_eq!(dev.pinned_ranges(), 0, "{what}");
        }
    }
    // Too small: refused with the minimum, which runs.
    let e = gatestream::runtime::open_on(&gst, &with_vram(file_bytes, 1000, None), Arc::new(HostStandIn::new(0)))
        .err()
        .expect("a tiny device budget is refused")
        .to_string();
    assert!(e.contains("--vram-budget 1000 is too small"), "{e}");
    let min = budget_in_refusal(&e);
    gatestream::runtime::open_on(&gst, &with_vram(file_bytes, min, None), Arc::new(HostStandIn::new(0))).unwrap();
    // The CPU device computes in host memory: the flag is refused there.
    let e = gatestream::runtime::open(&gst, &with_vram(file_bytes, vram, None))
        .err()
        .expect("the CPU device refuses --vram-budget")
        .to_string();
    assert!(e.contains("--vram-budget") && e.contains("--device cuda"), "{e}");
}

fn smollm2() -> Model {
    Model::load(
        &model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2"),
        &LoadOptions::default(),
    )
    .unwrap()
}

const LONG_PROMPT: &str = "The history of the city begins with a small settlement on the river. Over the centuries \
     merchants, farmers and craftsmen arrived, built bridges and markets, and the town grew into a centre of trade \
     for the whole region. Today it is known for";

/// A prompt fed in batches of 7 tokens continues exactly as one fed whole (greedy tokens).
#[test]
fn prefill_in_batches_gives_the_same_tokens() {
    let m = smollm2();
    let ids = m.prompt_ids(LONG_PROMPT, false).unwrap();
    assert!(ids.len() > 30, "{} tokens", ids.len());
    let whole = m
        .generate_ids(&ids, &greedy(10), None, None, None, &mut |_| {})
        .unwrap();
    let opts = GenerateOptions {
        batch_tokens_max: 7,
        ..greedy(10)
    };
    let batched = m.generate_ids(&ids, &opts, None, None, None, &mut |_| {}).unwrap();
    assert_eq!(batched.tokens, whole.tokens);
}

/// `ignore_eos` (`run --ignore-eos`): a continuation that ended at the end-of-sequence token goes
/// on to `max_tokens` without ever sampling a stop token, and is the plain one up to where that
/// one stopped.
#[test]
fn ignore_eos_goes_on_past_the_end_of_sequence_token() {
    let m = smollm2();
    // The chat template: the answer ends with the end-of-turn token.
    let ids = m.prompt_ids("What is the capital of France?", true).unwrap();
    let plain = m
        .generate_ids(&ids, &greedy(64), None, None, None, &mut |_| {})
        .unwrap();
    assert_eq!(plain.finish, Finish::StopToken, "{:?}", plain.tokens);
    let n = plain.tokens.len() + 8;
    let opts = GenerateOptions {
        ignore_eos: true,
        ..greedy(n)
    };
    let g = m.generate_ids(&ids, &opts, None, None, None, &mut |_| {}).unwrap();
    assert_eq!(g.finish, Finish::MaxTokens);
    assert_eq!(g.tokens.len(), n);
    assert_eq!(g.tokens[..plain.tokens.len()], plain.tokens[..]);
    assert!(g.tokens.iter().all(|&t| !m.tokenizer.is_stop(t)), "{:?}", g.tokens);
}

/// A generation on a model on the host stand-in `dev`: the result, the logit rows its passes
/// returned (1 + the decode passes, or the speculative passes and drafts), and the bytes that
/// came back to the host meanwhile.
/// A mask that decides from the layer's input and gate alone (union sets past the prompt, gate
/// scores) has its decode steps computed on a device with memory of its own from the set it
/// chose, and is told of each step from that set (`FfnMask::count_decided`) instead of being
/// handed the activations: a union set's decode steps bring nothing of the FFN back to the host
/// (its set reads no input), gate scores the layer's input and gate only. The tokens and the
/// mask's achieved sparsity are the in-RAM model's; the bytes back are exactly the greedy
/// tokens (4 a pass), the prompt pass's input, gate and up of every layer (the mask's edit is
/// made on the host) and, for gate scores, each decode step's input and gate.
#[test]
fn masks_deciding_from_the_input_run_device_decode_steps_without_their_activations() {
    use gatestream::backend::standin::HostStandIn;
    use gatestream::backend::HostLink;
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let gst = smollm2_gst(tmp.path());
    let file_bytes = std::fs::metadata(&gst).unwrap().len();
    let in_ram = Model::load(&gst, &LoadOptions::default()).unwrap();
    let ids = in_ram.prompt_ids("The capital of France is", false).unwrap();
    let (layers, h, f) = (
        in_ram.config.n_layers as u64,
        in_ram.config.hidden as u64,
        in_ram.config.ffn as u64,
    );
    for (strategy, criterion) in [(Strategy::Union, Criterion::Exact), (Strategy::TopK, Criterion::Gate)] {
        let what = format!("{strategy:?} {criterion:?}");
        let ask = SparseAsk {
            strategy: Some(strategy),
            criterion: Some(criterion),
            sparsity: Some(0.5),
        };
        let in_ram = gatestream::runtime::open(
            &gst,
            &OpenOptions {
                sparse: Some(ask.clone()),
                stream: None,
                ..streamed(0, 8, 0)
            },
        )
        .unwrap()
        .generate(&ids, &greedy(6), false, None, &mut |_| {})
        .unwrap();
        let dev = Arc::new(HostStandIn::new(0));
        let mut o = streamed(gatestream::stream::RAM_UNLIMITED, 8, ids.len() + 6);
        o.stream.as_mut().unwrap().vram_budget_bytes = Some(file_bytes * 2 / 5);
        o.sparse = Some(ask);
        let rt = gatestream::runtime::open_on(&gst, &o, dev.clone()).unwrap();
        let before = dev.link().unwrap().to_host_bytes;
        let got = rt.generate(&ids, &greedy(6), false, None, &mut |_| {}).unwrap();
        let back = dev.link().unwrap().to_host_bytes - before;
        assert_eq!(got.generation.tokens, in_ram.generation.tokens, "{what}");
        let achieved = |o: &gatestream::runtime::Outcome| o.sparsity.as_ref().unwrap()["achieved_per_layer"].clone();
        assert_eq!(achieved(&got), achieved(&in_ram), "{what}: the mask's counts");
        let steps = got.generation.decode_tokens as u64;
        assert!(steps >= 3, "{what}: {:?}", got.generation.tokens);
        let prompt = ids.len() as u64;
        let decode_fetch = match strategy {
            Strategy::Union => 0,
            _ => steps * (h + f),
        };
        assert_eq!(
            back,
            4 * (1 + steps) + 4 * layers * (prompt * (h + 2 * f) + decode_fetch),
            "{what}: bytes back to the host"
        );
    }
}

/// Floats' bits, to compare them exactly (NaNs included).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn generate_counting_bytes_back(
    dev: &gatestream::backend::standin::HostStandIn,
    m: &Model,
    ids: &[u32],
    opts: &GenerateOptions,
) -> (gatestream::model::generate::Generation, u64, u64) {
    use gatestream::backend::HostLink;
    let before = dev.link().unwrap().to_host_bytes;
    let g = m.generate_ids(ids, opts, None, None, None, &mut |_| {}).unwrap();
    let rows = 1 + g.speculative.as_ref().map_or(g.decode_tokens, |s| s.passes + s.drafted);
    (g, rows as u64, dev.link().unwrap().to_host_bytes - before)
}

/// Greedy decoding without log-probabilities asks the device for each row's token, not its
/// logits: on a device with memory of its own (the host stand-in, which counts what comes back)
/// 4 bytes a row come to the host instead of a vocabulary of floats, and the tokens are those
/// sampled from the logits (`logits_on_host`) — with the stop tokens banned (`ignore_eos`) and
/// with drafts to verify (prompt lookup: several rows a pass). With log-probabilities, the
/// token, its candidate and the row's log-sum-exp come back (20 bytes a row), and the
/// log-probabilities are those of the logits, bit for bit. The engine asks for tokens when
/// every sequence of a step is greedy without log-probabilities, and for the token, candidate
/// and log-sum-exp when one of them asks for log-probabilities.
#[test]
fn greedy_tokens_found_on_the_device_are_those_sampled_from_the_logits() {
    use gatestream::backend::standin::HostStandIn;
    use gatestream::backend::HostLink;
    use std::sync::Arc;
    let path = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let dev = Arc::new(HostStandIn::new(0));
    let m = Model::load_on(&path, &LoadOptions::default(), dev.clone()).unwrap();
    let vocab = m.config.vocab as u64;
    // The chat answer ends at the end-of-turn token, which `ignore_eos` then bans.
    let ids = m.prompt_ids("What is the capital of France?", true).unwrap();
    for (ignore_eos, lookup) in [(false, 0), (true, 0), (true, 3)] {
        let what = format!("ignore_eos {ignore_eos}, lookup {lookup}");
        let opts = GenerateOptions {
            ignore_eos,
            lookup,
            ..greedy(24)
        };
        let run = |logprobs: bool, logits_on_host: bool| {
            generate_counting_bytes_back(
                &dev,
                &m,
                &ids,
                &GenerateOptions {
                    logprobs,
                    logits_on_host,
                    ..opts.clone()
                },
            )
        };
        let (tokens, rows, back) = run(false, false);
        let (logits, logit_rows, logits_back) = run(true, true);
        let (lp, lp_rows, lp_back) = run(true, false);
        assert_eq!(tokens.tokens, logits.tokens, "{what}");
        assert_eq!(lp.tokens, logits.tokens, "{what}");
        assert_eq!(bits(&lp.logprobs), bits(&logits.logprobs), "{what}");
        assert_eq!(lp.logprobs.len(), lp.tokens.len(), "{what}");
        assert_eq!(back, 4 * rows, "{what}: {rows} rows");
        assert_eq!(logits_back, 4 * vocab * logit_rows, "{what}: {logit_rows} rows");
        assert_eq!(lp_back, 20 * lp_rows, "{what}: {lp_rows} rows");
        if ignore_eos {
            assert_eq!(tokens.tokens.len(), 24, "{what}");
            assert!(tokens.tokens.iter().all(|&t| !m.tokenizer.is_stop(t)), "{what}");
        } else {
            assert_eq!(tokens.finish, Finish::StopToken, "{what}: {:?}", tokens.tokens);
        }
        if lookup > 0 {
            let sp = tokens.speculative.as_ref().unwrap();
            assert!(sp.drafted > 0, "{what}: {sp:?}");
        }
    }
    // The engine: a step whose sequences are all greedy without log-probabilities brings back
    // 4 bytes a row, one with a sequence asking for them each row's token, top candidate and
    // log-sum-exp; the tokens each request gets alone either way.
    let prompts = ["The capital of France is", "Once upon a time"].map(|p| m.prompt_ids(p, false).unwrap());
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            m.generate_ids(p, &greedy(6), None, None, None, &mut |_| {})
                .unwrap()
                .tokens
        })
        .collect();
    for logprobs_of_one in [false, true] {
        let mut engine = gatestream::engine::Engine::new(&m, None, 16);
        let reqs = prompts.iter().enumerate().map(|(i, p)| gatestream::engine::Request {
            prompt_ids: p.clone(),
            max_tokens: 6,
            sampler: greedy(0).sampler,
            logprobs: logprobs_of_one && i == 1,
            ..Default::default()
        });
        let before = dev.link().unwrap().to_host_bytes;
        let (got, _) = run_engine(&mut engine, reqs, &mut |_, _| {});
        let back = dev.link().unwrap().to_host_bytes - before;
        assert_eq!(got, alone, "logprobs of one: {logprobs_of_one}");
        // No stop token came: one row a token.
        let rows = got.iter().map(|t| t.len() as u64).sum::<u64>();
        let per_row = if logprobs_of_one { 20 } else { 4 };
        assert_eq!(back, per_row * rows, "logprobs of one: {logprobs_of_one}");
    }
}

/// Sampling with a top-k asks the device for each row's k most likely tokens, not its logits:
/// on the host stand-in (which counts what comes back as a GPU would) 8 bytes a candidate come
/// to the host instead of a vocabulary of floats (8 bytes a row more for log-probabilities: the
/// row's log-sum-exp), and the tokens and log-probabilities are those of the logits
/// (`logits_on_host`) — with the stop tokens banned and with drafts to verify. The engine asks
/// for the largest k of a step when every sequence of it samples with a top-k (or asks for that
/// many top log-probabilities), each row's greedy token too when greedy sequences share the
/// step (4 bytes a row more), and the log-sum-exp when one asks for log-probabilities; one with
/// every token a candidate (top-k 0) brings the step's logits. Each request gets the tokens it
/// gets alone.
#[test]
fn sampled_tokens_drawn_from_device_candidates_are_those_drawn_from_the_logits() {
    use gatestream::backend::standin::HostStandIn;
    use gatestream::backend::HostLink;
    use gatestream::model::sampler::SamplerConfig;
    use std::sync::Arc;
    let path = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let dev = Arc::new(HostStandIn::new(0));
    let m = Model::load_on(&path, &LoadOptions::default(), dev.clone()).unwrap();
    let vocab = m.config.vocab as u64;
    let sampler = |top_k, seed| SamplerConfig {
        temperature: 0.9,
        top_k,
        top_p: 0.95,
        seed,
    };
    let ids = m
        .prompt_ids("Once upon a time, in a quiet village, there lived", false)
        .unwrap();
    for (ignore_eos, lookup) in [(false, 0), (true, 0), (true, 3)] {
        let what = format!("ignore_eos {ignore_eos}, lookup {lookup}");
        let run = |logprobs: bool, logits_on_host: bool| {
            let opts = GenerateOptions {
                ignore_eos,
                lookup,
                logprobs,
                logits_on_host,
                sampler: sampler(40, 11),
                ..greedy(24)
            };
            generate_counting_bytes_back(&dev, &m, &ids, &opts)
        };
        let (top, rows, back) = run(false, false);
        let (logits, logit_rows, logits_back) = run(true, true);
        let (lp, lp_rows, lp_back) = run(true, false);
        assert_eq!(top.tokens, logits.tokens, "{what}");
        assert_eq!(lp.tokens, logits.tokens, "{what}");
        assert_eq!(bits(&lp.logprobs), bits(&logits.logprobs), "{what}");
        assert_eq!(lp.logprobs.len(), lp.tokens.len(), "{what}");
        assert!(top.tokens.len() > 5, "{what}: {:?}", top.tokens);
        assert_eq!(back, 8 * 40 * rows, "{what}: {rows} rows");
        assert_eq!(logits_back, 4 * vocab * logit_rows, "{what}: {logit_rows} rows");
        assert_eq!(lp_back, (8 * 40 + 8) * lp_rows, "{what}: {lp_rows} rows");
        if lookup > 0 {
            assert!(top.speculative.as_ref().unwrap().passes > 0, "{what}");
        }
    }
    // Another seed, other tokens: the draws are the sampler's, not fixed by the candidates.
    let other = m
        .generate_ids(
            &ids,
            &GenerateOptions {
                sampler: sampler(40, 12),
                ignore_eos: true,
                ..greedy(24)
            },
            None,
            None,
            None,
            &mut |_| {},
        )
        .unwrap();
    let first = m
        .generate_ids(
            &ids,
            &GenerateOptions {
                sampler: sampler(40, 11),
                ignore_eos: true,
                ..greedy(24)
            },
            None,
            None,
            None,
            &mut |_| {},
        )
        .unwrap();
    assert_ne!(other.tokens, first.tokens);
    // The engine.
    let prompts = ["The capital of France is", "Once upon a time"].map(|p| m.prompt_ids(p, false).unwrap());
    // Each case: two requests' samplers and top log-probabilities (log-probabilities with
    // them), and the bytes a row back.
    for (samplers, tops, per_row) in [
        ([sampler(20, 1), sampler(40, 2)], [0, 0], 8 * 40),
        ([sampler(40, 1), greedy(0).sampler], [0, 0], 8 * 40 + 4),
        ([greedy(0).sampler, sampler(7, 3)], [0, 0], 8 * 7 + 4),
        ([sampler(0, 1), sampler(40, 2)], [0, 0], 4 * vocab),
        ([greedy(0).sampler, sampler(7, 3)], [5, 0], 8 * 7 + 4 + 8),
        ([sampler(20, 1), greedy(0).sampler], [0, 25], 8 * 25 + 4 + 8),
        ([sampler(20, 1), sampler(3, 2)], [2, 4], 8 * 20 + 8),
        ([sampler(0, 1), greedy(0).sampler], [0, 3], 4 * vocab),
        // More top log-probabilities than the device lists: the logits.
        ([sampler(20, 1), greedy(0).sampler], [0, 1100], 4 * vocab),
    ] {
        // Alone, from the logits: the tokens and (where asked) their log-probabilities.
        let alone: Vec<(Vec<u32>, Vec<f32>)> = prompts
            .iter()
            .zip(&samplers)
            .zip(tops)
            .map(|((p, s), top)| {
                let opts = GenerateOptions {
                    sampler: s.clone(),
                    logprobs: top > 0,
                    logits_on_host: true,
                    ..greedy(6)
                };
                let g = m.generate_ids(p, &opts, None, None, None, &mut |_| {}).unwrap();
                (g.tokens, g.logprobs)
            })
            .collect();
        let mut engine = gatestream::engine::Engine::new(&m, None, 16);
        let reqs = prompts
            .iter()
            .zip(&samplers)
            .zip(tops)
            .map(|((p, s), top)| gatestream::engine::Request {
                prompt_ids: p.clone(),
                max_tokens: 6,
                sampler: s.clone(),
                logprobs: top > 0,
                top_logprobs: top,
                ..Default::default()
            });
        let what = format!(
            "top-k {} and {}, top log-probabilities {tops:?}",
            samplers[0].top_k, samplers[1].top_k
        );
        let before = dev.link().unwrap().to_host_bytes;
        let mut logprobs = vec![Vec::new(); 2];
        let (got, _) = run_engine(&mut engine, reqs, &mut |_, e| {
            if let gatestream::engine::Event::Token {
                request,
                token,
                logprob,
                top,
                ..
            } = e
            {
                // A new engine's requests are 0 and 1.
                let i = *request as usize;
                assert_eq!(logprob.is_some(), tops[i] > 0, "{what}");
                assert_eq!(top.len(), tops[i], "{what}");
                assert!(top.windows(2).all(|w| w[0].1 >= w[1].1), "{what}: {top:?}");
                if let Some(&(_, l)) = top.iter().find(|c| c.0 == *token) {
                    assert_eq!(Some(l.to_bits()), logprob.map(f32::to_bits), "{what}");
                }
                logprobs[i].extend(*logprob);
            }
        });
        let back = dev.link().unwrap().to_host_bytes - before;
        for i in 0..2 {
            assert_eq!(got[i], alone[i].0, "{what}: request {i}");
            assert_eq!(bits(&logprobs[i]), bits(&alone[i].1), "{what}: request {i}");
        }
        let rows = got.iter().map(|t| t.len() as u64).sum::<u64>();
        assert_eq!(back, per_row * rows, "{what}");
    }
}

/// Every token comes with its log-probability; cancelling stops between passes, keeping what
/// was generated.
#[test]
fn tokens_carry_logprobs_and_generation_can_be_cancelled() {
    let m = smollm2();
    let ids = m.prompt_ids("The capital of France is", false).unwrap();
    let cancel = AtomicBool::new(false);
    let mut seen = Vec::new();
    let opts = GenerateOptions {
        logprobs: true,
        ..greedy(20)
    };
    let g = m
        .generate_ids(&ids, &opts, None, None, Some(&cancel), &mut |e| {
            if let Some(id) = e.id {
                seen.push((id, e.logprob.expect("asked for")));
            }
            if seen.len() == 3 {
                cancel.store(true, Ordering::Relaxed);
            }
        })
        .unwrap();
    assert_eq!(g.finish, Finish::Cancelled);
    assert_eq!(g.tokens.len(), 3);
    assert_eq!(seen.iter().map(|s| s.0).collect::<Vec<_>>(), g.tokens);
    assert!(g.logprobs.iter().all(|&l| l <= 0.0 && l > -20.0), "{:?}", g.logprobs);
    // Greedy " Paris" after this prompt is likely: its log-probability is well above chance.
    assert!(g.logprobs[0] > -2.0, "{:?}", g.logprobs);
}

/// A stream whose every pass fails.
struct Broken;

impl LayerStream for Broken {
    fn embedding(&self, _tok: u32, _out: &mut [f32]) -> Result<bool> {
        Ok(false)
    }
    fn attention(&self, l: usize) -> Result<Option<std::borrow::Cow<'_, AttnWeights>>> {
        Err(Error::Device(format!("layer {l}: simulated read failure")))
    }
}

/// A pass that fails during the prompt leaves the union mask out of prompt mode (it used to
/// stay there, so the next request's tokens would all have been taken as context).
#[test]
fn a_failed_prefill_leaves_the_mask_out_of_prompt_mode() {
    let m = smollm2();
    let masker = Masker::for_model(&m, Strategy::Union, Criterion::Exact, 0.5, None).unwrap();
    let ids = m.prompt_ids("The capital of France is", false).unwrap();
    let e = m
        .generate_ids(
            &ids,
            &greedy(4),
            Some(&masker as &dyn PromptAwareMask),
            Some(&Broken),
            None,
            &mut |_| {},
        )
        .unwrap_err();
    assert!(e.to_string().contains("simulated read failure"), "{e}");
    assert_eq!(masker.union_context(), 0, "the mask is still in prompt mode");
}

/// The runtime streams a .gst model under a budget: a prompt longer than one batch is prefilled
/// in batches (the budget holds one batch's activations and the KV cache) and gives the in-RAM
/// model's tokens (also streamed onto a device with memory of its own, the host stand-in, by the
/// runtime and by the engine `serve` steps); a pass larger than a batch is refused; a request
/// needing more KV positions than the budget was planned for is refused.
#[test]
fn the_runtime_streams_a_long_prompt_in_batches() {
    let tmp = tempfile::tempdir().unwrap();
    let gst = smollm2_gst(tmp.path());
    let in_ram = Model::load(&gst, &LoadOptions::default()).unwrap();
    let ids = in_ram.prompt_ids(LONG_PROMPT, false).unwrap();
    let want = in_ram
        .generate_ids(
            &ids,
            &GenerateOptions {
                batch_tokens_max: 8,
                ..greedy(6)
            },
            None,
            None,
            None,
            &mut |_| {},
        )
        .unwrap();
    let file_bytes = std::fs::metadata(&gst).unwrap().len();
    let open = |sparse: Option<SparseAsk>| {
        gatestream::runtime::open(
            &gst,
            &OpenOptions {
                sparse,
                ..streamed(file_bytes, 8, ids.len() + 6)
            },
        )
        .unwrap()
    };
    let rt = open(None);
    assert!(rt.stream.as_ref().unwrap().residency.context_bytes > 0);
    let got = rt.generate(&ids, &greedy(6), false, None, &mut |_| {}).unwrap();
    assert_eq!(got.generation.tokens, want.tokens);
    let report = got.stream.expect("a stream report");
    assert!(report.counters.passes > 0);

    // The same through the runtime onto a device with memory of its own (the host stand-in,
    // which copies the stream's buffers at each use as the CUDA device does): the same tokens.
    let standin = std::sync::Arc::new(gatestream::backend::standin::HostStandIn::new(0));
    let on_device =
        gatestream::runtime::open_on(&gst, &streamed(file_bytes * 3 / 4, 8, ids.len() + 6), standin.clone()).unwrap();
    let got = on_device.generate(&ids, &greedy(6), false, None, &mut |_| {}).unwrap();
    assert_eq!(got.generation.tokens, want.tokens);
    assert!(standin.copied_bytes().1 > 0, "nothing streamed to the device");

    // The engine over the same stream: the same tokens; a second request past the KV positions
    // the budget holds is refused.
    let mut engine = gatestream::engine::Engine::new(&rt.model, rt.layer_stream(), 0);
    let req = gatestream::engine::Request {
        prompt_ids: ids.clone(),
        max_tokens: 6,
        sampler: greedy(0).sampler,
        ..Default::default()
    };
    engine.submit(req.clone()).unwrap();
    let e = engine.submit(req).unwrap_err().to_string();
    assert!(e.contains("KV positions"), "{e}");
    let mut tokens = Vec::new();
    while engine.active() > 0 {
        for ev in engine.step().unwrap() {
            if let gatestream::engine::Event::Token { token, .. } = ev {
                tokens.push(token);
            }
        }
    }
    assert_eq!(tokens, want.tokens);
    // And the engine (what `serve` steps) over the stream onto the stand-in device.
    let mut engine = gatestream::engine::Engine::new(&on_device.model, on_device.layer_stream(), 0);
    engine
        .submit(gatestream::engine::Request {
            prompt_ids: ids.clone(),
            max_tokens: 6,
            sampler: greedy(0).sampler,
            ..Default::default()
        })
        .unwrap();
    let mut tokens = Vec::new();
    while engine.active() > 0 {
        for ev in engine.step().unwrap() {
            if let gatestream::engine::Event::Token { token, .. } = ev {
                tokens.push(token);
            }
        }
    }
    assert_eq!(tokens, want.tokens, "the engine on the stand-in device");

    // One pass over more tokens than a batch is refused, naming the limit.
    let mut cache = gatestream::kv::KvCache::new(&rt.model.config, ids.len());
    let hooks = FfnHooks {
        observe: None,
        mask: None,
        stream: rt.layer_stream(),
        cancel: None,
    };
    let e = rt
        .model
        .forward_with(&ids, &mut cache, gatestream::model::batch::Logits::Last, &hooks)
        .unwrap_err();
    assert!(e.to_string().contains("exceeds the 8"), "{e}");

    // More positions than planned: refused before any work.
    let e = rt
        .generate(&ids, &greedy(7), false, None, &mut |_| {})
        .err()
        .expect("refused");
    assert!(e.to_string().contains("KV positions"), "{e}");

    // A sparse runtime: the mask asked for is what runs.
    let sparse = open(Some(SparseAsk {
        strategy: Some(Strategy::TopK),
        criterion: Some(Criterion::Gate),
        sparsity: Some(0.5),
    }));
    let m = sparse.mask.clone().unwrap();
    assert_eq!(
        (m.strategy, m.criterion, m.sparsity, m.stored),
        (Strategy::TopK, Criterion::Gate, 0.5, false)
    );
    let out = sparse.generate(&ids, &greedy(3), false, None, &mut |_| {}).unwrap();
    assert_eq!(out.generation.tokens.len(), 3);
    assert!(out.sparsity.is_some());
}

/// The engine runs several requests in one pass per step (decode tokens and prompt pieces
/// together, prompts longer than a step fed in pieces, a request joining mid-way) and each gets
/// exactly the tokens it gets alone; a cancelled request ends at the next step with what it had.
#[test]
fn the_engine_batches_requests_and_each_gets_its_own_tokens() {
    use gatestream::engine::{Engine, Event, Request};
    let m = smollm2();
    let prompts = [
        m.prompt_ids("The capital of France is", false).unwrap(),
        m.prompt_ids(LONG_PROMPT, false).unwrap(),
        m.prompt_ids("Once upon a time", false).unwrap(),
    ];
    let max = [8, 5, 10];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .zip(max)
        .map(|(p, n)| {
            m.generate_ids(p, &greedy(n), None, None, None, &mut |_| {})
                .unwrap()
                .tokens
        })
        .collect();
    let req = |i: usize| Request {
        prompt_ids: prompts[i].clone(),
        max_tokens: max[i],
        sampler: greedy(0).sampler,
        logprobs: true,
        ..Default::default()
    };
    let mut engine = Engine::new(&m, None, 16);
    let mut ids = vec![engine.submit(req(0)).unwrap(), engine.submit(req(1)).unwrap()];
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 3];
    let mut finished = 0;
    let mut steps = 0;
    while engine.active() > 0 || ids.len() < 3 {
        if steps == 2 {
            ids.push(engine.submit(req(2)).unwrap());
        }
        for e in engine.step().unwrap() {
            match e {
                Event::Token {
                    request,
                    token,
                    logprob,
                    ..
                } => {
                    assert!(logprob.is_some_and(|l| l <= 0.0));
                    got[ids.iter().position(|&r| r == request).unwrap()].push(token);
                }
                Event::Finished { .. } => finished += 1,
            }
        }
        steps += 1;
        assert!(steps < 100, "the engine does not finish");
    }
    assert_eq!(finished, 3);
    assert_eq!(got, alone, "batched requests differ from each run alone");

    // Cancelling: the request ends at the next step with the tokens it had.
    let mut engine = Engine::new(&m, None, 0);
    let id = engine.submit(req(0)).unwrap();
    let mut tokens = 0;
    let mut ended = None;
    for _ in 0..10 {
        for e in engine.step().unwrap() {
            match e {
                Event::Token { .. } => tokens += 1,
                Event::Finished { finish, .. } => ended = Some(finish),
            }
        }
        if tokens == 2 {
            engine.cancel(id);
        }
        if ended.is_some() {
            break;
        }
    }
    assert_eq!((tokens, ended), (2, Some(Finish::Cancelled)));

    // With a per-token mask (top-K on the gate, 50%): each request's tokens as alone with it.
    let masker = Masker::for_model(&m, Strategy::TopK, Criterion::Gate, 0.5, None).unwrap();
    let masked_alone: Vec<Vec<u32>> = (0..2)
        .map(|i| {
            m.generate_ids(
                &prompts[i],
                &greedy(max[i]),
                Some(&masker as &dyn PromptAwareMask),
                None,
                None,
                &mut |_| {},
            )
            .unwrap()
            .tokens
        })
        .collect();
    assert_ne!(masked_alone[0], alone[0], "the mask changes the continuation");
    let mut engine = Engine::new(&m, None, 16).with_mask(&masker).unwrap();
    let ids = [engine.submit(req(0)).unwrap(), engine.submit(req(1)).unwrap()];
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); 2];
    while engine.active() > 0 {
        for e in engine.step().unwrap() {
            if let Event::Token { request, token, .. } = e {
                got[ids.iter().position(|&r| r == request).unwrap()].push(token);
            }
        }
    }
    assert_eq!(got, masked_alone);
    let union = Masker::for_model(&m, Strategy::Union, Criterion::Exact, 0.5, None).unwrap();
    assert!(Engine::new(&m, None, 0).with_mask(&union).is_err());
}

/// Eight requests decoded together (as `serve --parallel 8` runs them) each get exactly the
/// tokens they get alone; a stop string ends a request with the text up to it, released only
/// once it cannot be the start of the stop string; the top log-probabilities are the model's.
#[test]
fn eight_requests_in_one_batch_stop_strings_and_top_logprobs() {
    use gatestream::engine::{Engine, Event, Request};
    let m = smollm2();
    let texts = EIGHT_PROMPTS;
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| m.prompt_ids(t, false).unwrap()).collect();
    let max: Vec<usize> = (0..8).map(|i| 6 + 3 * i).collect();
    let alone: Vec<_> = prompts
        .iter()
        .zip(&max)
        .map(|(p, &n)| m.generate_ids(p, &greedy(n), None, None, None, &mut |_| {}).unwrap())
        .collect();
    let mut engine = Engine::new(&m, None, 64);
    let reqs = prompts.iter().zip(&max).map(|(p, &n)| Request {
        prompt_ids: p.clone(),
        max_tokens: n,
        sampler: greedy(0).sampler,
        top_logprobs: 3,
        ..Default::default()
    });
    let mut widest = 0;
    let (got, _) = run_engine(&mut engine, reqs, &mut |engine, e| {
        widest = widest.max(engine);
        if let Event::Token { token, top, .. } = e {
            assert_eq!(top.len(), 3);
            assert_eq!(top[0].0, *token, "greedy takes the most likely token");
            assert!(top[0].1 >= top[1].1 && top[1].1 >= top[2].1);
        }
    });
    assert_eq!(widest, 8);
    let want: Vec<Vec<u32>> = alone.iter().map(|g| g.tokens.clone()).collect();
    assert_eq!(got, want, "batched requests differ from each run alone");

    // The same eight and a prompt that repeats itself, with prompt lookup (4 drafts per request
    // and step, inside a 64-token step): the same greedy tokens, drafts kept and rolled back.
    let code = m.prompt_ids(CODE_PROMPT, false).unwrap();
    let code_alone = m
        .generate_ids(&code, &greedy(30), None, None, None, &mut |_| {})
        .unwrap();
    let mut engine = Engine::new(&m, None, 64);
    let reqs = prompts
        .iter()
        .chain([&code])
        .zip(max.iter().chain([&30]))
        .map(|(p, &n)| Request {
            prompt_ids: p.clone(),
            max_tokens: n,
            sampler: greedy(0).sampler,
            lookup: 4,
            ..Default::default()
        });
    let (got, steps) = run_engine(&mut engine, reqs, &mut |_, _| {});
    let mut want = want;
    want.push(code_alone.tokens);
    assert_eq!(got, want, "lookup in the engine changed greedy tokens");
    let (drafted, accepted) = engine.drafts();
    assert!(accepted > 0 && drafted > accepted, "{drafted} drafted, {accepted} kept");
    assert!(steps < 30, "{steps} steps for 30 tokens: no step kept a draft");

    // A stop string: the text up to it, without it; nothing after it is released.
    let full = &alone[2].text;
    let cut = full.char_indices().nth(10).map(|(i, _)| i).unwrap();
    let stop = full[cut..].chars().take(4).collect::<String>();
    let expect = &full[..full.find(&stop).unwrap()];
    let mut engine = Engine::new(&m, None, 0);
    let id = engine
        .submit(Request {
            prompt_ids: prompts[2].clone(),
            max_tokens: max[2],
            sampler: greedy(0).sampler,
            stop: vec!["no such text anywhere".into(), stop.clone()],
            ..Default::default()
        })
        .unwrap();
    let (mut text, mut finish) = (String::new(), None);
    while engine.active() > 0 {
        for e in engine.step().unwrap() {
            match e {
                Event::Token { request, text: t, .. } => {
                    assert_eq!(request, id);
                    text.push_str(&t);
                    assert!(expect.starts_with(&text), "released {text:?}, beyond {expect:?}");
                }
                Event::Finished { finish: f, text: t, .. } => {
                    text.push_str(&t);
                    finish = Some(f);
                }
            }
        }
    }
    assert_eq!(
        (text.as_str(), finish),
        (expect, Some(Finish::StopString)),
        "stop {stop:?} in {full:?}"
    );
    assert!(engine
        .submit(Request {
            prompt_ids: prompts[2].clone(),
            max_tokens: 4,
            stop: vec![String::new()],
            ..Default::default()
        })
        .is_err());
}

/// A generation that ends inside a UTF-8 sequence keeps those bytes (as U+FFFD), in the text and
/// as a last event with no token; they used to be dropped. SmolLM2 continues this prompt with a
/// character split over two tokens, so one token ends mid-character.
#[test]
fn a_generation_ending_mid_character_flushes_it() {
    let m = smollm2();
    let ids = m.prompt_ids("中文：你好，世界。我们", false).unwrap();
    let mut events = Vec::new();
    let g = m
        .generate_ids(&ids, &greedy(1), None, None, None, &mut |e| {
            events.push((e.id, e.text.to_string()))
        })
        .unwrap();
    assert_eq!(g.tokens.len(), 1);
    assert_eq!(g.text, "\u{FFFD}", "the partial character was dropped");
    assert_eq!(events.last(), Some(&(None, "\u{FFFD}".to_string())));
    // Two tokens on, the character is complete and nothing is flushed.
    let two = m.generate_ids(&ids, &greedy(3), None, None, None, &mut |_| {}).unwrap();
    assert!(!two.text.contains('\u{FFFD}'), "{:?}", two.text);
    assert_eq!(two.text, m.tokenizer.decode(&two.tokens).unwrap());
}

/// A prompt that does not fit the context is refused before any work, naming both counts; a
/// smaller context asked for is honoured and generation ends `ContextFull` where it fills,
/// with the tokens an unlimited run starts with.
#[test]
fn the_context_bounds_prompt_and_generation() {
    let m = smollm2();
    let limit = m.config.context_len;
    let too_long = vec![1u32; limit];
    let t = std::time::Instant::now();
    let e = m
        .generate_ids(&too_long, &greedy(4), None, None, None, &mut |_| {})
        .err()
        .unwrap();
    assert!(t.elapsed().as_secs_f64() < 1.0, "refused after {:?}", t.elapsed());
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("{limit} tokens")) && msg.contains("context of"),
        "{msg}"
    );

    let ids = m.prompt_ids("The capital of France is", false).unwrap();
    let free = m.generate_ids(&ids, &greedy(8), None, None, None, &mut |_| {}).unwrap();
    let opts = GenerateOptions {
        ctx: ids.len() + 3,
        ..greedy(8)
    };
    let capped = m.generate_ids(&ids, &opts, None, None, None, &mut |_| {}).unwrap();
    assert_eq!(capped.finish, Finish::ContextFull);
    assert_eq!(capped.tokens, free.tokens[..3]);
    assert_eq!((capped.prompt_tokens, capped.completion_tokens), (ids.len(), 3));
    let opts = GenerateOptions {
        ctx: ids.len(),
        ..greedy(8)
    };
    let e = m
        .generate_ids(&ids, &opts, None, None, None, &mut |_| {})
        .err()
        .unwrap();
    assert!(e.to_string().contains("--ctx-size"), "{e}");
    // A KV cache larger than the machine is refused, not an allocation abort.
    #[cfg(target_os = "linux")]
    {
        let opts = GenerateOptions {
            ctx: usize::MAX / 2,
            ..greedy(usize::MAX / 2)
        };
        let e = m
            .generate_ids(&ids, &opts, None, None, None, &mut |_| {})
            .err()
            .unwrap();
        assert!(e.to_string().contains("more than this machine's"), "{e}");
    }
}

/// Cancelling stops a pass before its next layer, not at its end: an observer that sets the
/// flag after layer 1's FFN sees no later layer, and the pass ends `Cancelled` without
/// advancing the KV cache.
#[test]
fn cancel_stops_a_pass_between_layers() {
    use gatestream::kv::KvCache;
    use gatestream::model::batch::Logits;
    let m = smollm2();
    let ids = m.prompt_ids(LONG_PROMPT, false).unwrap();
    let cancel = AtomicBool::new(false);
    let seen = std::sync::Mutex::new(Vec::new());
    let observe = |l: usize, _: &[f32], _: &[f32]| {
        seen.lock().unwrap().push(l);
        if l == 1 {
            cancel.store(true, Ordering::Relaxed);
        }
    };
    let hooks = FfnHooks {
        observe: Some(&observe),
        mask: None,
        stream: None,
        cancel: Some(&cancel),
    };
    let mut cache = KvCache::new(&m.config, ids.len());
    let e = m.forward_with(&ids, &mut cache, Logits::Last, &hooks).err().unwrap();
    assert!(matches!(e, Error::Cancelled), "{e:?}");
    assert_eq!(*seen.lock().unwrap(), vec![0, 1]);
    assert_eq!(cache.len, 0);
}

/// `gatestream run` stopped by Ctrl-C (SIGINT) in the middle of a long prompt's prefill exits
/// within a second, with status 130, saying it was cancelled; stopped while generating, it
/// has printed what it generated.
#[cfg(unix)]
#[test]
fn ctrl_c_stops_run_within_a_second() {
    use std::time::{Duration, Instant};
    let model = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(700);
    for (prompt, max_tokens) in [(prompt.as_str(), "4"), ("Once upon a time", "8000")] {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_gatestream"))
            .args(["run", "--model"])
            .arg(&model)
            .args(["--threads", "1", "--max-tokens", max_tokens, "--prompt", prompt])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        let t = Instant::now();
        let status = std::process::Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let out = child.wait_with_output().unwrap();
        let waited = t.elapsed();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            waited < Duration::from_secs(1),
            "exited {waited:?} after SIGINT: {stderr}"
        );
        assert_eq!(out.status.code(), Some(130), "{stderr}");
        assert!(stderr.contains("(cancelled)"), "{stderr}");
        if max_tokens == "8000" {
            assert!(stdout.trim().len() > 10, "nothing printed: {stdout:?}");
        }
    }
}

/// Submits `reqs` and steps until all end: each request's tokens (in submission order) and the
/// steps taken; `each` sees the active count before each step and every event.
fn run_engine(
    engine: &mut gatestream::engine::Engine,
    reqs: impl Iterator<Item = gatestream::engine::Request>,
    each: &mut dyn FnMut(usize, &gatestream::engine::Event),
) -> (Vec<Vec<u32>>, usize) {
    let ids: Vec<_> = reqs.map(|r| engine.submit(r).unwrap()).collect();
    let mut got = vec![Vec::new(); ids.len()];
    let mut steps = 0;
    while engine.active() > 0 {
        let active = engine.active();
        steps += 1;
        for e in engine.step().unwrap() {
            each(active, &e);
            if let gatestream::engine::Event::Token { request, token, .. } = e {
                got[ids.iter().position(|&r| r == request).unwrap()].push(token);
            }
        }
    }
    (got, steps)
}

/// A prompt whose continuation repeats it (prompt lookup drafts well from it).
const CODE_PROMPT: &str = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n\
                           # The same two functions again:\ndef add(a, b):\n";

/// Speculative decoding by prompt lookup keeps greedy decoding's tokens exactly, in RAM and
/// streamed from a .gst under a budget (drafts verified in one pass, rejected ones rolled back
/// out of the KV cache), with several tokens per pass on text that repeats; streamed, the disk
/// bytes per generated token fall with the tokens per pass.
#[test]
fn prompt_lookup_keeps_greedy_tokens_in_ram_and_streamed() {
    let m = smollm2();
    let ids = m.prompt_ids(CODE_PROMPT, false).unwrap();
    let n = 24;
    let plain = m.generate_ids(&ids, &greedy(n), None, None, None, &mut |_| {}).unwrap();
    for k in [1, 3, 6] {
        let spec = m
            .generate_ids(
                &ids,
                &GenerateOptions { lookup: k, ..greedy(n) },
                None,
                None,
                None,
                &mut |_| {},
            )
            .unwrap();
        assert_eq!(spec.tokens, plain.tokens, "lookup {k}");
        assert_eq!(spec.text, plain.text);
        let sp = spec.speculative.unwrap();
        assert!(sp.accepted > 0 && sp.drafted > sp.accepted, "lookup {k}: {sp:?}");
        assert!(sp.passes < n - 1, "lookup {k}: {sp:?}");
        assert_eq!(spec.decode_tokens, n - 1);
    }

    let tmp = tempfile::tempdir().unwrap();
    let gst = tmp.path().join("smollm2.gst");
    reformat(
        &model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2"),
        &gst,
        &ReformatOptions::default(),
        &mut |_, _, _| {},
    )
    .unwrap();
    let rt = gatestream::runtime::open(
        &gst,
        // Above the 73.6 MB minimum, below the 110 MB file: FFN rows stream. Passes of at most 4
        // tokens: 6 drafts asked, 3 taken per pass.
        &streamed(80_000_000, 4, ids.len() + n),
    )
    .unwrap();
    let streamed = rt.generate(&ids, &greedy(n), false, None, &mut |_| {}).unwrap();
    let spec = rt
        .generate(
            &ids,
            &GenerateOptions { lookup: 6, ..greedy(n) },
            false,
            None,
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(streamed.generation.tokens, plain.tokens);
    assert_eq!(spec.generation.tokens, plain.tokens);
    let sp = spec.generation.speculative.unwrap();
    let (a, b) = (streamed.stream.unwrap(), spec.stream.unwrap());
    assert!(a.disk_bytes_per_token > 0.0);
    assert!(
        b.disk_bytes_per_token < a.disk_bytes_per_token / 2.0,
        "{} vs {} bytes per token at {:.2} tokens per pass",
        b.disk_bytes_per_token,
        a.disk_bytes_per_token,
        sp.tokens_per_pass
    );
}

/// With prompt lookup, one request's drafts never take another's turn: in a step of 8 tokens,
/// every request already decoding gets a token in every step, a prompt arriving meanwhile is fed
/// at once (its first token within 3 steps), and the tokens are still each request's greedy
/// tokens alone.
#[test]
fn drafts_take_only_what_the_step_has_spare() {
    use gatestream::engine::{Engine, Event, Request};
    use std::collections::HashSet;
    let m = smollm2();
    let code = m.prompt_ids(CODE_PROMPT, false).unwrap();
    let late = m.prompt_ids("Once upon a time", false).unwrap();
    let want = [
        m.generate_ids(&code, &greedy(40), None, None, None, &mut |_| {})
            .unwrap()
            .tokens,
        m.generate_ids(&code, &greedy(40), None, None, None, &mut |_| {})
            .unwrap()
            .tokens,
        m.generate_ids(&late, &greedy(6), None, None, None, &mut |_| {})
            .unwrap()
            .tokens,
    ];
    let req = |p: &Vec<u32>, n: usize| Request {
        prompt_ids: p.clone(),
        max_tokens: n,
        sampler: greedy(0).sampler,
        lookup: 8,
        ..Default::default()
    };
    let mut engine = Engine::new(&m, None, 8);
    let mut ids = vec![
        engine.submit(req(&code, 40)).unwrap(),
        engine.submit(req(&code, 40)).unwrap(),
    ];
    let mut got = vec![Vec::new(); 3];
    let mut decoding = HashSet::new();
    let (mut step, mut late_at) = (0, None);
    while engine.active() > 0 {
        step += 1;
        // The late request arrives once both others decode.
        if decoding.len() == 2 && late_at.is_none() {
            ids.push(engine.submit(req(&late, 6)).unwrap());
            late_at = Some(step);
        }
        let (mut tokens_of, mut ended) = (HashSet::new(), HashSet::new());
        for e in engine.step().unwrap() {
            match e {
                Event::Token { request, token, .. } => {
                    tokens_of.insert(request);
                    got[ids.iter().position(|&r| r == request).unwrap()].push(token);
                }
                Event::Finished { request, .. } => {
                    ended.insert(request);
                }
            }
        }
        for r in &decoding {
            assert!(
                tokens_of.contains(r) || ended.contains(r),
                "request {r} got no token in step {step}"
            );
        }
        if let Some(at) = late_at {
            assert!(
                step - at < 2 || !got[2].is_empty(),
                "the late prompt waited {} steps",
                step - at + 1
            );
        }
        decoding.extend(tokens_of);
        decoding.retain(|r| !ended.contains(r));
    }
    assert!(late_at.is_some(), "the two code requests never decoded together");
    assert!(engine.drafts().1 > 0, "no draft was kept");
    assert_eq!(got, want);
}

/// Speculative decoding with a draft model sharing the target's vocabulary keeps the target's
/// greedy tokens exactly: a mixture of experts upcycled from stories260K drafted by stories260K
/// itself (in RAM; drafts rejected and rolled back in both models' caches), and SmolLM2 streamed
/// from a .gst under a budget drafted by the same .gst in RAM (every draft kept, so the disk bytes
/// per generated token fall with the tokens per pass; the .gst's down columns are re-quantized,
/// so its tokens are compared with its own streamed run, not the GGUF's). A draft of another
/// vocabulary, or one beside prompt lookup, is refused.
#[test]
fn a_draft_model_keeps_greedy_tokens_in_ram_and_streamed() {
    use gatestream::model::draft::Drafter;
    let tmp = tempfile::tempdir().unwrap();
    let stories = write_temp(tmp.path(), "stories.gguf", &stories_gguf(Breakage::None));
    let moe = tmp.path().join("moe.gguf");
    let spec = gatestream::synth::MoeSpec {
        arch: gatestream::config::Arch::Llama,
        experts: 4,
        used: 2,
        ty: gatestream::quant::GgmlType::F32,
        random: None,
        perturb: 0.3,
        seed: 5,
    };
    gatestream::synth::write_moe(&stories, &spec, &moe, &mut |_, _| {}).unwrap();
    let target = Model::load(&moe, &LoadOptions::default()).unwrap();
    let draft = Drafter::new(Model::load(&stories, &LoadOptions::default()).unwrap(), &target, 4).unwrap();
    let ids = target
        .prompt_ids("Once upon a time, there was a little", false)
        .unwrap();
    let n = 40;
    let plain = target
        .generate_ids(&ids, &greedy(n), None, None, None, &mut |_| {})
        .unwrap();
    let spec = target
        .generate_ids_drafted(&ids, &greedy(n), None, None, None, Some(&draft), &mut |_| {})
        .unwrap();
    assert_eq!(
        spec.tokens, plain.tokens,
        "the draft changed the target's greedy tokens"
    );
    let sp = spec.speculative.unwrap();
    assert_eq!((sp.source, sp.lookup_max), ("draft", 4));
    assert!(sp.accepted > 0 && sp.accepted < sp.drafted, "{sp:?}");
    assert!(sp.passes < spec.decode_tokens && sp.draft_seconds > 0.0, "{sp:?}");
    // Again with the same drafter: its cache starts over with each request.
    let again = target
        .generate_ids_drafted(&ids, &greedy(n), None, None, None, Some(&draft), &mut |_| {})
        .unwrap();
    assert_eq!(again.tokens, plain.tokens);
    assert_eq!(again.speculative.unwrap().accepted, sp.accepted);
    let e = target
        .generate_ids_drafted(
            &ids,
            &GenerateOptions { lookup: 2, ..greedy(n) },
            None,
            None,
            None,
            Some(&draft),
            &mut |_| {},
        )
        .expect_err("lookup and a draft model together")
        .to_string();
    assert!(e.contains("not both"), "{e}");
    let e = Drafter::new(Model::load(&stories, &LoadOptions::default()).unwrap(), &smollm2(), 4)
        .err()
        .expect("another vocabulary")
        .to_string();
    assert!(e.contains("share the target's vocabulary"), "{e}");

    let smol = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let gst = tmp.path().join("smollm2.gst");
    reformat(&smol, &gst, &ReformatOptions::default(), &mut |_, _, _| {}).unwrap();
    let m = smollm2();
    let ids = m.prompt_ids(LONG_PROMPT, false).unwrap();
    let n = 24;
    let open = || {
        gatestream::runtime::open(
            &gst,
            // FFN rows stream (see prompt lookup's test); passes of at most 4 tokens.
            &streamed(80_000_000, 4, ids.len() + n),
        )
        .unwrap()
    };
    let streamed = open().generate(&ids, &greedy(n), false, None, &mut |_| {}).unwrap();
    let mut rt = open();
    rt.attach_draft(&gst, 6).unwrap();
    assert!(
        rt.warnings.iter().any(|w| w.contains("beside --ram-budget")),
        "{:?}",
        rt.warnings
    );
    let spec = rt.generate(&ids, &greedy(n), false, None, &mut |_| {}).unwrap();
    assert_eq!(spec.generation.tokens, streamed.generation.tokens);
    let sp = spec.generation.speculative.unwrap();
    assert_eq!(sp.accepted, sp.drafted, "the model drafting for itself: {sp:?}");
    assert!(sp.tokens_per_pass > 3.5, "{sp:?}");
    let (a, b) = (streamed.stream.unwrap(), spec.stream.unwrap());
    assert!(
        b.disk_bytes_per_token < a.disk_bytes_per_token / 2.0,
        "{} vs {} bytes per token at {:.2} tokens per pass",
        b.disk_bytes_per_token,
        a.disk_bytes_per_token,
        sp.tokens_per_pass
    );
}
