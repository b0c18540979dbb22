//! Streaming from disk on real weights: with every neuron active the streamed model's logits are
//! bit-identical to the in-RAM model's, for every reader and every budget; device faults are
//! resumed (short reads) or surface as errors naming file, offset and length (EIO); sparse
//! streaming reads fewer bytes than dense and keeps the in-RAM sparse model's tokens.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use gatestream::backend::{Device, HostLink};
use gatestream::format::FfnLayout;
use gatestream::gstfile::GstFile;
use gatestream::io::{open_reader, ReadEngine, Reader, ReaderOptions, ShortReads, SimFaults, SimReader};
use gatestream::kv::KvCache;
use gatestream::model::batch::Logits;
use gatestream::model::forward::{FfnHooks, LayerStream};
use gatestream::model::{LoadOptions, Model, Placement};
use gatestream::reformat::{reformat, ReformatOptions};
use gatestream::sparsity::{up_set_reads_input, Criterion, Masker, Strategy};
use gatestream::stream::cache::CachePolicy;
use gatestream::stream::residency::Priority;
use gatestream::stream::{CostSource, Lookahead, Readers, StreamOptions, Streamer};

fn convert(input: &Path, dir: &Path, name: &str, layout: FfnLayout) -> PathBuf {
    let out = dir.join(name);
    let opts = ReformatOptions {
        ffn_layout: layout,
        ..ReformatOptions::default()
    };
    reformat(input, &out, &opts, &mut |_, _, _| {}).unwrap();
    out
}

fn load(p: &Path) -> Model {
    Model::load(p, &LoadOptions::default()).unwrap()
}

/// A model as streaming opens it: its matrices stay on disk.
fn load_on_disk(p: &Path) -> Model {
    let opts = LoadOptions {
        placement: Placement::OnDisk,
        ..LoadOptions::default()
    };
    Model::load(p, &opts).unwrap()
}

/// SmolLM2 as a split `.gst` in `dir`.
fn smollm2_gst(dir: &Path) -> PathBuf {
    let src = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    convert(&src, dir, "smollm2.gst", FfnLayout::Split)
}

/// The model at `p` opened for streaming on a fresh host stand-in device, whose staged rows go
/// over in 16 KiB chunks (a layer's staged up rows, 360 bytes each, in dozens).
fn on_standin(p: &Path) -> (Arc<gatestream::backend::standin::HostStandIn>, Model) {
    let dev = Arc::new(gatestream::backend::standin::HostStandIn::new(0).with_upload_chunk_bytes(16 << 10));
    let opts = LoadOptions {
        placement: Placement::OnDisk,
        ..LoadOptions::default()
    };
    let m = Model::load_on(p, &opts, dev.clone()).unwrap();
    (dev, m)
}

fn options(budget_bytes: u64, engine: ReadEngine, cache: CachePolicy) -> StreamOptions {
    StreamOptions {
        budget_bytes,
        engine,
        reader: ReaderOptions::default(),
        cache,
        priority: Priority::GateFirst,
        prefetch_ffn: false,
        merge_gap_bytes: None,
        cost: CostSource::Default,
        lookahead: Lookahead::Off,
        kv_positions: 64,
        batch_tokens_max: 64,
        vram_budget_bytes: None,
        prefetch_buffers: gatestream::stream::PREFETCH_BUFFERS,
        prefetch_read_bytes: gatestream::stream::PREFETCH_READ_BYTES,
    }
}

/// Dense streaming's options: FFN rows prefetched with each layer, the cache before gates.
fn dense_options(budget_bytes: u64, engine: ReadEngine) -> StreamOptions {
    StreamOptions {
        priority: Priority::CacheFirst,
        prefetch_ffn: true,
        ..options(budget_bytes, engine, CachePolicy::Pinned)
    }
}

fn run(model: &Model, stream: Option<&Streamer>, mask: Option<&Masker>, text: &str, steps: usize) -> Vec<f32> {
    prompt_then_greedy(model, stream.map(|s| s as _), mask.map(|m| m as _), text, steps)
}

fn min_budget(path: &Path) -> u64 {
    min_budget_with(path, options(0, ReadEngine::Pread, CachePolicy::Pinned))
}

fn min_budget_with(path: &Path, opts: StreamOptions) -> u64 {
    let m = load(path);
    let e = Streamer::open(&m, &opts)
        .err()
        .expect("a zero budget is refused")
        .to_string();
    budget_in_refusal(&e)
}

fn assert_bit_identical(path: &Path, text: &str) {
    let reference = run(&load(path), None, None, text, 4);
    let file_bytes = std::fs::metadata(path).unwrap().len();
    let min = min_budget(path);
    let min_dense = min_budget_with(path, dense_options(0, ReadEngine::Pread));
    // One model, its matrices on disk, serves every streamer below: opening one changes nothing
    // in it, and no pass can read a matrix except through the stream.
    let m = load_on_disk(path);
    for engine in [ReadEngine::Uring, ReadEngine::Pread, ReadEngine::Mmap] {
        // Everything streamed; some resident; everything resident with a full neuron cache.
        // The minimum (everything streamed), half the file more, and everything resident.
        // (The two minima differ: only sparse reads need the compute thread's reader to hold
        // whole reads.)
        let (mid, mid_dense, all) = (
            min + file_bytes / 2,
            min_dense + file_bytes / 2,
            min.max(min_dense) + 2 * file_bytes,
        );
        for (budget, opts) in [
            (min, options(min, engine, CachePolicy::Pinned)),
            (mid, options(mid, engine, CachePolicy::Lru)),
            (all, options(all, engine, CachePolicy::Pinned)),
            (min_dense, dense_options(min_dense, engine)),
            (mid_dense, dense_options(mid_dense, engine)),
        ] {
            let policy = (opts.cache, opts.priority, opts.prefetch_ffn);
            let s = Streamer::open(&m, &opts).unwrap();
            let got = run(&m, Some(&s), None, text, 4);
            let same = got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same && got.len() == reference.len(),
                "{}: {engine:?} at budget {budget} ({policy:?}) differs from the in-RAM model",
                path.display()
            );
            let c = s.counters();
            if budget == min && !opts.prefetch_ffn {
                assert!(c.ffn_needed_bytes > 0 && c.cache_hits == 0, "{c:?}");
            }
            if opts.prefetch_ffn {
                // Every FFN row came with the prefetch: nothing read on the compute thread; and
                // dense steps took them as views of the prefetch buffer, the pinned cache's rows
                // copied in front (the pinned cache holds some at the larger budget).
                assert_eq!(c.ffn_needed_bytes, 0, "{c:?}");
                assert!(c.ffn_in_place_bytes > 0, "{engine:?} at budget {budget}: {c:?}");
                assert_eq!(
                    c.cache_hits > 0,
                    budget == mid_dense,
                    "{engine:?} at budget {budget}: {c:?}"
                );
            }
            // The prefetch thread's reads land in its buffers (laid out in phase with the file):
            // io_uring reads their whole blocks in place (most of the bytes; the count includes
            // the next pass's first layer, read ahead), the other engines copy.
            // The prefetch buffers are registered with its reader (fixed buffers), so those
            // reads take the fixed-buffer opcode. (A few kilobytes of dense reads, as a budget
            // that leaves a small matrix or two out gives, may all be shorter than a block.)
            let st = s.read_stats();
            let in_place = st.bytes_in_place;
            match engine {
                ReadEngine::Uring if c.dense_needed_bytes >= 1 << 20 => assert!(
                    2 * in_place > c.dense_needed_bytes && 2 * st.bytes_in_place_registered > c.dense_needed_bytes,
                    "{engine:?} at budget {budget} ({policy:?}): {st:?}: {c:?}"
                ),
                ReadEngine::Uring => {}
                _ => assert_eq!(in_place, 0, "{engine:?} at budget {budget} ({policy:?})"),
            }
            if budget == all {
                assert_eq!((c.ffn_needed_bytes, c.cache_hits), (0, c.cache_lookups), "{c:?}");
                // The cache holds every layer in neuron order: its rows were used in place.
                assert!(c.ffn_in_place_bytes > 0, "{c:?}");
            } else if budget == min {
                assert_eq!(c.ffn_in_place_bytes, 0, "{c:?}");
            }
        }
    }
}

#[test]
fn dense_streaming_is_bit_identical_to_in_ram_for_every_reader_stories260k() {
    let tmp = tempfile::tempdir().unwrap();
    for layout in [FfnLayout::Split, FfnLayout::Bundled] {
        let p = convert(&stories_dir(), tmp.path(), &format!("{layout:?}.gst"), layout);
        assert_bit_identical(&p, "Once upon a time, there was a cat");
    }
}

/// A model opened for streaming keeps no view of its matrices: a pass without the stream is an
/// error (it used to read them through the model's memory map, past the budget), and one model
/// serves two streamers (opening the second used to panic on `expect("mapped")`).
#[test]
fn a_streamed_model_is_read_only_through_a_stream_and_serves_several() {
    let tmp = tempfile::tempdir().unwrap();
    let p = convert(&stories_dir(), tmp.path(), "split.gst", FfnLayout::Split);
    let m = load_on_disk(&p);
    let ids = m.tokenizer.encode("Once upon a time", true).unwrap();
    let mut cache = KvCache::new(&m.config, ids.len());
    let e = m.forward(&ids, &mut cache, Logits::Last).unwrap_err().to_string();
    assert!(e.contains("opened for streaming") && e.contains("no stream"), "{e}");
    let budget = min_budget(&p) + 4096;
    let a = Streamer::open(&m, &options(budget, ReadEngine::Pread, CachePolicy::Lru)).unwrap();
    let b = Streamer::open(&m, &options(budget, ReadEngine::Mmap, CachePolicy::Pinned)).unwrap();
    let reference = run(&load(&p), None, None, "Once upon a time", 2);
    assert_eq!(run(&m, Some(&a), None, "Once upon a time", 2), reference);
    assert_eq!(run(&m, Some(&b), None, "Once upon a time", 2), reference);
}

/// Passes over one stream from several threads at once finish with the in-RAM logits (they run
/// one at a time). The stream's state lock used to be taken per layer inside the thread pool and
/// held across the pool's work: passes interleaved layer by layer (each disturbing the other's
/// prefetch order; measured: wrong logits), and a pool thread waiting for its share of a
/// product could pick up another pass and block on the lock its own stack held (a deadlock).
#[test]
fn concurrent_passes_over_one_stream_finish() {
    let tmp = tempfile::tempdir().unwrap();
    let p = smollm2_gst(tmp.path());
    let opts = LoadOptions {
        threads: 4,
        placement: Placement::OnDisk,
        ..LoadOptions::default()
    };
    let m = Arc::new(Model::load(&p, &opts).unwrap());
    let s = Arc::new(Streamer::open(&m, &options(min_budget(&p), ReadEngine::Pread, CachePolicy::Lru)).unwrap());
    let reference = run(&load(&p), None, None, "The capital of France is", 1);
    let (tx, rx) = std::sync::mpsc::channel();
    for _ in 0..4 {
        let (m, s, tx) = (m.clone(), s.clone(), tx.clone());
        std::thread::spawn(move || {
            for _ in 0..3 {
                tx.send(run(&m, Some(&s), None, "The capital of France is", 1)).unwrap();
            }
        });
    }
    for i in 0..12 {
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(got) => assert!(
                got == reference,
                "pass {i} of the concurrent passes gave other logits than in RAM"
            ),
            Err(e) => panic!("{i} of 12 concurrent passes finished in 120 s ({e}): the passes deadlocked"),
        }
    }
}

#[test]
fn dense_streaming_is_bit_identical_to_in_ram_for_every_reader_smollm2() {
    let tmp = tempfile::tempdir().unwrap();
    let p = smollm2_gst(tmp.path());
    assert_bit_identical(&p, "The capital of France is");
}

/// The first byte of layer 1's up section.
fn up_offset(path: &Path) -> u64 {
    let g = GstFile::open(path).unwrap();
    let t = g.index.tensor("blk.1.ffn_up.weight").unwrap();
    g.index.row_range(t, 0).unwrap().0
}

fn sim(path: &Path, faults: SimFaults) -> Arc<dyn Reader> {
    let inner = open_reader(path, ReadEngine::Pread, &ReaderOptions::default())
        .unwrap()
        .reader;
    Arc::new(SimReader::wrap(inner, faults))
}

fn readers(path: &Path, faults: SimFaults) -> Readers {
    Readers {
        fg: sim(path, faults.clone()),
        bg: sim(path, faults),
        ahead: None,
    }
}

#[test]
fn short_reads_are_resumed_and_eio_names_file_offset_and_length() {
    let tmp = tempfile::tempdir().unwrap();
    let p = convert(&stories_dir(), tmp.path(), "s.gst", FfnLayout::Split);
    let reference = run(&load(&p), None, None, "Once upon a time", 3);
    let min = min_budget(&p);
    let short = SimFaults {
        latency_per_read: Duration::from_micros(50),
        short_reads: ShortReads::AtMost(700),
        eio_at_bytes: Vec::new(),
    };
    let m = load(&p);
    let opts = options(min, ReadEngine::Pread, CachePolicy::Pinned);
    let s = Streamer::with_readers(&m, &opts, readers(&p, short), false, Vec::new()).unwrap();
    let got = run(&m, Some(&s), None, "Once upon a time", 3);
    assert!(got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(
        s.read_stats().device_reads > s.read_stats().requests,
        "short reads were resumed"
    );

    // EIO inside layer 1's up rows: the pass fails with an error naming the file and the range.
    let bad = up_offset(&p) + 100;
    let eio = SimFaults {
        eio_at_bytes: vec![bad],
        ..SimFaults::default()
    };
    let m = load(&p);
    let s = Streamer::with_readers(&m, &opts, readers(&p, eio), false, Vec::new()).unwrap();
    let ids = m.tokenizer.encode("Once upon a time", true).unwrap();
    let mut cache = KvCache::new(&m.config, ids.len());
    let hooks = FfnHooks {
        observe: None,
        mask: None,
        stream: Some(&s),
        cancel: None,
    };
    let e = m
        .forward_with(&ids, &mut cache, Logits::Last, &hooks)
        .unwrap_err()
        .to_string();
    assert!(e.contains(&p.display().to_string()), "{e}");
    assert!(e.contains("at offset") && e.contains("bytes"), "{e}");
    let number_after = |what: &str| -> u64 {
        e.split(what)
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (offset, len) = (number_after("at offset "), number_after("read of "));
    assert!(offset <= bad && bad < offset + len, "{e}");
}

/// A masked decode step on a device with memory of its own stages its rows through the
/// device's upload buffers: through short reads it keeps the in-RAM sparse model's logits, and
/// EIO in the middle of a staging fails the pass with the file and range, no staging protocol
/// error, and the device usable afterwards.
#[test]
fn staged_uploads_survive_short_reads_and_report_eio() {
    use gatestream::backend::standin::HostStandIn;
    let tmp = tempfile::tempdir().unwrap();
    let p = convert(&stories_dir(), tmp.path(), "s.gst", FfnLayout::Split);
    let text = "Once upon a time";
    let ram = load(&p);
    let masker = |m: &Model| Masker::for_model(m, Strategy::TopK, Criterion::Exact, 0.5, None).unwrap();
    let want = run(&ram, None, Some(&masker(&ram)), text, 3);
    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
    let opts = options(min_budget(&p), ReadEngine::Pread, CachePolicy::Pinned);
    // 1 KiB chunks: several per layer even on this small model.
    let dev = Arc::new(HostStandIn::new(0).with_upload_chunk_bytes(1024));
    let lopts = LoadOptions {
        placement: Placement::OnDisk,
        ..LoadOptions::default()
    };
    let m = Model::load_on(&p, &lopts, dev.clone()).unwrap();
    let mask = masker(&m);
    let short = SimFaults {
        short_reads: ShortReads::AtMost(100),
        ..SimFaults::default()
    };
    let s = Streamer::with_readers(&m, &opts, readers(&p, short), false, Vec::new()).unwrap();
    let check = |got: &[f32], what: &str| {
        let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff <= 1e-4 * scale, "{what}: {diff} (scale {scale})");
    };
    check(&run(&m, Some(&s), Some(&mask), text, 3), "short reads");
    assert!(
        s.read_stats().device_reads > s.read_stats().requests,
        "short reads were resumed"
    );
    let u = dev.upload_counters();
    assert!(u.chunks > u.uploads && u.early_chunks > 0 && u.reused > 0, "{u:?}");

    // EIO in layer 1's up rows during a one-token pass (a decode step: the staged path).
    let bad = up_offset(&p) + 100;
    let eio = SimFaults {
        eio_at_bytes: vec![bad],
        ..SimFaults::default()
    };
    let s = Streamer::with_readers(&m, &opts, readers(&p, eio), false, Vec::new()).unwrap();
    let mut cache = KvCache::new(&m.config, 4);
    let hooks = FfnHooks {
        observe: None,
        mask: Some(&mask),
        stream: Some(&s),
        cancel: None,
    };
    let before = dev.upload_counters().uploads;
    let e = m
        .forward_with(&[1], &mut cache, Logits::Last, &hooks)
        .expect_err("EIO fails the pass")
        .to_string();
    assert!(e.contains(&p.display().to_string()) && e.contains("at offset"), "{e}");
    assert!(dev.upload_counters().uploads > before, "the failed step was staging");
    assert!(dev.take_error().is_none(), "no staging protocol error");
    // The device goes on: a clean stream over the same device keeps the in-RAM logits.
    let s = Streamer::open(&m, &opts).unwrap();
    check(&run(&m, Some(&s), Some(&mask), text, 3), "after EIO");
}

/// The command line end to end on a device with memory of its own (the hidden `--device
/// host-standin`): `run --mode compare --vram-budget --json --record-trace` runs both passes,
/// reports the device plan and link figures (the dense pass's FFN rows copied from views of the
/// neuron cache, the sparse pass's kept rows read by id from it in place), and records the
/// sparse pass's trace.
#[test]
fn run_compare_with_a_gpu_budget_reports_the_link_and_records_a_trace() {
    let tmp = tempfile::tempdir().unwrap();
    let p = convert(&stories_dir(), tmp.path(), "s.gst", FfnLayout::Split);
    let trace = tmp.path().join("t.trace");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gatestream"))
        .args(["run", "--model"])
        .arg(&p)
        // Room for everything but part of the FFN: the hot neurons stay on the device, the
        // rest streams (with 1G every neuron would be hot and nothing would cross the link).
        .args(["--device", "host-standin", "--vram-budget", "1.1M", "--mode", "compare"])
        .args([
            "--sparsity",
            "0.5",
            "--criterion",
            "exact",
            "--max-tokens",
            "6",
            "--json",
        ])
        .arg("--record-trace")
        .arg(&trace)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for pass in ["dense", "sparse"] {
        let s = &r[pass]["stream"];
        assert_eq!(
            s["device_plan"]["budget_bytes"].as_u64(),
            Some(1_100_000),
            "{pass}: {s}"
        );
        let hot = s["device_plan"]["hot_neurons"].as_array().unwrap();
        assert!(
            hot.iter().all(|k| k.as_u64().is_some_and(|k| k > 0 && k < 172)),
            "{pass}: {s}"
        );
        let link = &s["link"];
        let f = |k: &str| link[k].as_f64().unwrap_or_else(|| panic!("{pass}: no {k} in {link}"));
        // No RAM budget: the neuron cache holds every layer, mapped by the device. A dense
        // pass's rows are views of it, copied at each use; a sparse pass's decode steps read
        // the kept rows by id where they are (only the prompt's pass copies).
        let in_place = s["counters"]["ffn_in_place_bytes"].as_u64().unwrap();
        assert!(in_place > 0, "{pass}: {s}");
        assert!(f("hot_bytes_per_token") > 0.0, "{link}");
        match pass {
            "dense" => assert!(
                f("bytes_per_token") > 0.0
                    && f("staged_fraction") == 0.0
                    && f("pinned_fraction") > 0.5
                    && f("mapped_bytes_per_token") == 0.0,
                "{link}"
            ),
            _ => assert!(
                f("mapped_bytes_per_token") > 0.0 && f("staged_fraction") == 0.0,
                "{link}"
            ),
        }
    }
    let t = gatestream::bench::trace::Trace::read(&trace).unwrap();
    assert!(t.header.tokens >= 6, "{:?}", t.header);
    assert!((t.header.kept_fraction - 0.5).abs() < 0.05, "{:?}", t.header);
    // The stand-in is a test device: not offered in --help.
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_gatestream"))
        .args(["run", "--help"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&help.stdout).contains("standin"));
}

#[test]
fn a_budget_too_small_is_refused_with_the_minimum() {
    let tmp = tempfile::tempdir().unwrap();
    let p = convert(&stories_dir(), tmp.path(), "s.gst", FfnLayout::Split);
    let min = min_budget(&p);
    let m = load(&p);
    let e = Streamer::open(&m, &options(min - 1, ReadEngine::Pread, CachePolicy::Pinned))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("too small") && e.contains(&min.to_string()), "{e}");
}

/// A device with memory of its own fed by the stream — the host stand-in
/// (`gatestream::backend::standin`), which keeps resident weights by address as the CUDA device
/// does and copies the stream's buffers (volatile weights) at each use: the streamed logits equal
/// the in-RAM model's on the CPU, bit for bit with every neuron, and to the f64 down sums' order
/// with a top-K mask (exact and gate criteria, with and without lookahead), for every reader,
/// with everything streamed (no cache) and with an LRU cache (hits and misses); the streamed
/// bytes reached the device as per-use copies, a masked decode step's FFN rows were staged
/// onto the device (not computed on the host where they landed), and the mask counted what it
/// kept as in RAM.
#[test]
fn a_device_with_memory_of_its_own_is_fed_by_the_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let p = smollm2_gst(tmp.path());
    let text = "The capital of France is";
    let (min, file_bytes) = (min_budget(&p), std::fs::metadata(&p).unwrap().len());
    let ram = load(&p);
    let n_layers = ram.config.n_layers as u64;
    let want_dense = run(&ram, None, None, text, 4);
    let criteria = [Criterion::Exact, Criterion::Gate];
    // The in-RAM model's logits and the mask's counts (`apply` at every step).
    let (want_sparse, want_counts): (Vec<Vec<f32>>, Vec<_>) = criteria
        .iter()
        .map(|&c| {
            let mask = Masker::for_model(&ram, Strategy::TopK, c, 0.5, None).unwrap();
            (run(&ram, None, Some(&mask), text, 4), mask.counters())
        })
        .unzip();
    for engine in [ReadEngine::Uring, ReadEngine::Pread, ReadEngine::Mmap] {
        for (budget, policy) in [(min, CachePolicy::Pinned), (min + file_bytes / 2, CachePolicy::Lru)] {
            for sparse in [None, Some(0), Some(1)] {
                // Lookahead where the budget leaves room for resident gates to predict with.
                let ahead = sparse.is_some() && policy == CachePolicy::Lru;
                let (dev, m) = on_standin(&p);
                let mut sopts = options(budget, engine, policy);
                if let (true, Some(c)) = (ahead, sparse) {
                    sopts.lookahead = Lookahead::for_mask(up_set_reads_input(Strategy::TopK, criteria[c]));
                }
                let s = Streamer::open(&m, &sopts).unwrap();
                let mask = sparse.map(|c| Masker::for_model(&m, Strategy::TopK, criteria[c], 0.5, None).unwrap());
                let got = run(&m, Some(&s), mask.as_ref(), text, 4);
                let what = format!(
                    "{engine:?} {policy:?} sparse {:?} lookahead {ahead}",
                    sparse.map(|c| criteria[c])
                );
                // Back to the host: the logits, and for a mask each layer's input, gate and up
                // of every token (its edit of act(gate)·up is made on the host and sent, never
                // fetched) — except up in the decode steps of the gate criterion, which decides
                // from the input and gate alone (the device makes act(gate)·up); the lookahead's
                // prediction may fetch its own inputs besides.
                let tokens = (got.len() / m.config.vocab) as u64;
                let (h, f) = (m.config.hidden as u64, m.config.ffn as u64);
                let per_token = match sparse.map(|c| criteria[c]) {
                    None => 0,
                    Some(Criterion::Gate) => (tokens - 4) * (h + 2 * f) + 4 * (h + f),
                    Some(_) => tokens * (h + 2 * f),
                };
                let want_back = 4 * got.len() as u64 + 4 * n_layers * per_token;
                let back = dev.link().unwrap().to_host_bytes;
                match ahead {
                    false => assert_eq!(back, want_back, "{what}: bytes back to the host"),
                    true => assert!(
                        back >= want_back,
                        "{what}: {back} bytes back to the host, {want_back} without lookahead"
                    ),
                }
                let want = sparse.map_or(&want_dense, |c| &want_sparse[c]);
                assert_eq!(got.len(), want.len(), "{what}");
                // The mask counted what it kept as in RAM, also where the device made the
                // activations and the mask was only told of the step (`count_decided`).
                if let (Some(c), Some(mask)) = (sparse, &mask) {
                    assert_eq!(mask.counters(), want_counts[c], "{what}: the mask's counts");
                }
                if sparse.is_some() {
                    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(diff <= 1e-4 * scale, "{what}: {diff} (scale {scale})");
                    // The prompt's pass stages each layer's up rows once; each decode step once more.
                    let up_copies = dev.volatile_uses("ffn_up");
                    assert!(
                        up_copies >= 2 * n_layers,
                        "{what}: {up_copies} copies of up rows for {n_layers} layers: decode steps computed elsewhere"
                    );
                    if ahead {
                        let c = s.counters();
                        assert!(c.ahead_neurons > 0 && c.ahead_used_neurons > 0, "{what}: {c:?}");
                    }
                    // Decode steps staged their rows in the device's buffers, reused from step
                    // to step, sent in chunks as they filled (most before the last row landed),
                    // and each product waited on the chunks it read.
                    let u = dev.upload_counters();
                    assert!(u.uploads >= 2 * n_layers && u.reused > 0, "{what}: {u:?}");
                    assert!(u.chunks > u.uploads && u.early_chunks > 0, "{what}: {u:?}");
                    assert!(u.staged_uses > 0 && u.chunk_waits >= u.chunks, "{what}: {u:?}");
                    assert_eq!(dev.link().unwrap().staged_bytes, u.sent_bytes, "{what}");
                } else {
                    assert!(
                        got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: differs from the in-RAM model"
                    );
                }
                let (resident, volatile) = dev.copied_bytes();
                assert!(
                    resident > 0 && volatile > 0,
                    "{what}: copied {resident} resident, {volatile} volatile"
                );
            }
        }
    }
}

/// Dense streaming onto a device with memory of its own (the host stand-in): the layer's reads
/// land in the prefetch buffers (in place, registered, page-locked by the device), and a split
/// file's dense steps hand over their FFN rows as views of that buffer — the pinned cache's rows
/// copied in front by the prefetch thread — while a bundled file's are gathered into the
/// staging as before (two strided views would copy each bundle twice). Either way: logits bit
/// for bit the in-RAM model's, the same bytes copied to the device, every one from page-locked
/// memory.
#[test]
fn dense_streaming_hands_a_device_the_prefetch_buffers_rows_in_place() {
    let tmp = tempfile::tempdir().unwrap();
    let src = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let text = "The capital of France is";
    let mut copied = Vec::new();
    for layout in [FfnLayout::Split, FfnLayout::Bundled] {
        let p = convert(&src, tmp.path(), &format!("{layout:?}.gst"), layout);
        let want = run(&load(&p), None, None, text, 4);
        let min = min_budget_with(&p, dense_options(0, ReadEngine::Uring));
        let file_bytes = std::fs::metadata(&p).unwrap().len();
        for budget in [min, min + file_bytes / 4] {
            let (dev, m) = on_standin(&p);
            let s = Streamer::open(&m, &dense_options(budget, ReadEngine::Uring)).unwrap();
            let got = run(&m, Some(&s), None, text, 4);
            let what = format!("{layout:?} at budget {budget}");
            assert!(
                got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: differs from the in-RAM model"
            );
            let (c, r) = (s.counters(), s.read_stats());
            assert_eq!(c.cache_hits > 0, budget > min, "{what}: {c:?}");
            match layout {
                FfnLayout::Split => assert!(c.ffn_in_place_bytes > 0, "{what}: {c:?}"),
                FfnLayout::Bundled | FfnLayout::Rows => assert_eq!(c.ffn_in_place_bytes, 0, "{what}: {c:?}"),
            }
            // (The next pass's first layer may still be in flight: its bytes count as they land.)
            assert!(
                2 * r.bytes_in_place_registered > c.dense_needed_bytes,
                "{what}: {r:?}: {c:?}"
            );
            let link = dev.link().unwrap();
            assert!(
                link.volatile_bytes > 0 && link.pinned_bytes == link.volatile_bytes,
                "{what}: {link:?}"
            );
            copied.push((budget > min, link.volatile_bytes, link.volatile_copies));
        }
    }
    // The two layouts' runs copied the same bytes in as many copies, budget for budget.
    assert_eq!(copied[0..2], copied[2..4], "{copied:?}");
    // Under a GPU budget that keeps each layer's first neurons on the device (hot), the views
    // start after them: the cache's rows past the hot ones copied in front, the rest read.
    let p = convert(&src, tmp.path(), "hot.gst", FfnLayout::Split);
    let want = run(&load(&p), None, None, text, 4);
    let file_bytes = std::fs::metadata(&p).unwrap().len();
    let min = min_budget_with(&p, dense_options(0, ReadEngine::Uring));
    for vram in [file_bytes * 45 / 100, file_bytes * 55 / 100] {
        let (_dev, m) = on_standin(&p);
        let opts = StreamOptions {
            vram_budget_bytes: Some(vram),
            ..dense_options(min + file_bytes / 4, ReadEngine::Uring)
        };
        let s = Streamer::open(&m, &opts).unwrap();
        let got = run(&m, Some(&s), None, text, 4);
        let plan = s.device_plan.clone().unwrap();
        let what = format!(
            "GPU budget {vram}: hot {:?}, cached {:?}",
            plan.hot_neurons, s.residency.cache_neurons
        );
        assert!(
            plan.hot_neurons
                .iter()
                .zip(&s.residency.cache_neurons)
                .all(|(&k, &c)| 0 < k && k < c),
            "{what}"
        );
        assert!(
            got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: differs from the in-RAM model"
        );
        let c = s.counters();
        assert!(c.ffn_in_place_bytes > 0 && c.ffn_hot_bytes > 0, "{what}: {c:?}");
    }
}

/// With a neuron cache that holds every layer (no RAM budget of its own, as `--vram-budget`
/// alone plans), a device with memory of its own gets a dense step's FFN rows as views of the
/// cache, copied at each use (nothing gathered into staging), and a masked decode step's
/// products read the kept rows by id in place from the cache the device mapped (nothing staged
/// or copied): dense logits bit-identical to the in-RAM model, sparse ones within rounding.
/// Streamed logits against the in-RAM model's: bit-identical for a dense run; for a masked one
/// (the same neurons kept, the down sums in another order) within 1e-4 of the largest logit.
fn assert_like_in_ram(got: &[f32], want: &[f32], masked: bool, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    if !masked {
        assert!(
            got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: differs from the in-RAM model"
        );
    } else {
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff <= 1e-4 * scale, "{what}: {diff} (scale {scale})");
    }
}

#[test]
fn a_cache_holding_every_layer_hands_a_device_its_rows_in_place() {
    let tmp = tempfile::tempdir().unwrap();
    let p = smollm2_gst(tmp.path());
    let text = "The capital of France is";
    let (min, file_bytes) = (min_budget(&p), std::fs::metadata(&p).unwrap().len());
    let ram = load(&p);
    let layers = ram.config.n_layers as u64;
    let up_bytes = ram.weights.layers[0].dense("test").unwrap().up.len_bytes() as u64;
    // The prompt's pass and four decode steps.
    let (steps, passes) = (4, 5);
    for (policy, sparse) in [
        (CachePolicy::Pinned, None),
        (CachePolicy::Lru, None),
        (CachePolicy::Pinned, Some(Criterion::Exact)),
        (CachePolicy::Lru, Some(Criterion::Gate)),
    ] {
        let want = {
            let mask = sparse.map(|c| Masker::for_model(&ram, Strategy::TopK, c, 0.5, None).unwrap());
            run(&ram, None, mask.as_ref(), text, steps)
        };
        let (dev, m) = on_standin(&p);
        let s = Streamer::open(&m, &options(min + 2 * file_bytes, ReadEngine::Uring, policy)).unwrap();
        let mask = sparse.map(|c| Masker::for_model(&m, Strategy::TopK, c, 0.5, None).unwrap());
        let got = run(&m, Some(&s), mask.as_ref(), text, steps);
        let what = format!("{policy:?} {sparse:?}");
        assert_like_in_ram(&got, &want, sparse.is_some(), &what);
        let (c, u) = (s.counters(), dev.upload_counters());
        assert_eq!(
            (c.ffn_needed_bytes, c.cache_hits),
            (0, c.cache_lookups),
            "{what}: {c:?}"
        );
        // Nothing went through the device's staging buffers.
        assert_eq!(u.uploads, 0, "{what}: {u:?}");
        let (copied_up, by_id) = (dev.volatile_uses("ffn_up"), dev.in_place_uses("ffn_"));
        match sparse {
            // Up and down of every layer in every pass, copied from the views.
            None => {
                assert!(c.ffn_in_place_bytes >= 2 * passes * layers * up_bytes, "{what}: {c:?}");
                assert_eq!(
                    (copied_up, by_id, c.ffn_mapped_bytes),
                    (passes * layers, 0, 0),
                    "{what}"
                );
            }
            // The prompt's pass copies its up rows; each decode step reads up rows and down
            // columns of every layer by id.
            Some(_) => {
                assert_eq!(copied_up, layers, "{what}");
                assert_eq!(dev.in_place_uses("ffn_up"), (passes - 1) * layers, "{what}");
                assert_eq!(dev.in_place_uses("ffn_down"), (passes - 1) * layers, "{what}");
                assert!(
                    c.ffn_mapped_bytes > 0 && c.ffn_in_place_bytes >= c.ffn_mapped_bytes,
                    "{what}: {c:?}"
                );
                if sparse == Some(Criterion::Exact) {
                    // The prompt's pass needs every up row: one run of slots, a view copied.
                    assert!(c.ffn_in_place_bytes > c.ffn_mapped_bytes, "{what}: {c:?}");
                }
            }
        }
    }
}

#[test]
fn sparse_streaming_reads_less_and_matches_the_in_ram_sparse_model() {
    let tmp = tempfile::tempdir().unwrap();
    let p = smollm2_gst(tmp.path());
    let min = min_budget(&p);
    let text = "The capital of France is";
    let ram = load(&p);
    let file_bytes = std::fs::metadata(&p).unwrap().len();
    for criterion in [Criterion::Gate, Criterion::Exact] {
        let mask = Masker::for_model(&ram, Strategy::TopK, criterion, 0.5, None).unwrap();
        let want = run(&ram, None, Some(&mask), text, 6);
        // Decode steps compute from cache slots and read buffers directly: check them with no
        // cache (all misses) and with an LRU cache holding part of the model (hits and misses).
        // Same kept neurons; only the order of the f64 down sums can differ.
        let streamed = |opts: &StreamOptions, what: &str| {
            let m = load(&p);
            let s = Streamer::open(&m, opts).unwrap();
            let mask = Masker::for_model(&m, Strategy::TopK, criterion, 0.5, None).unwrap();
            let got = run(&m, Some(&s), Some(&mask), text, 6);
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff <= 1e-4 * scale, "{criterion:?} {what}: {diff} (scale {scale})");
            s.counters()
        };
        for (budget, policy) in [(min, CachePolicy::Pinned), (min + file_bytes / 2, CachePolicy::Lru)] {
            let c = streamed(&options(budget, ReadEngine::Pread, policy), &format!("{policy:?}"));
            if policy == CachePolicy::Lru {
                assert!(c.cache_hits > 0 && c.cache_hits < c.cache_lookups, "{c:?}");
            }
        }
        let m = load(&p);
        let s = Streamer::open(&m, &options(min, ReadEngine::Pread, CachePolicy::Pinned)).unwrap();
        let mask = Masker::for_model(&m, Strategy::TopK, criterion, 0.5, None).unwrap();
        run(&m, Some(&s), Some(&mask), text, 6);
        let sparse = s.counters();
        let m = load(&p);
        let d = Streamer::open(&m, &options(min, ReadEngine::Pread, CachePolicy::Pinned)).unwrap();
        run(&m, Some(&d), None, text, 6);
        let dense = d.counters();
        assert!(
            sparse.ffn_needed_bytes < dense.ffn_needed_bytes * 3 / 4,
            "{criterion:?}: sparse {sparse:?} vs dense {dense:?}"
        );

        // Lookahead: the same results; the next layer's rows come from the lookahead's reads.
        // The exact criterion reads every up row, so its prediction is perfect (only the read
        // for the token after the last is never used); the gate's is a prediction.
        let opts = StreamOptions {
            lookahead: Lookahead::for_mask(up_set_reads_input(Strategy::TopK, criterion)),
            ..options(min + file_bytes / 2, ReadEngine::Pread, CachePolicy::Pinned)
        };
        let c = streamed(&opts, "lookahead");
        let hit_rate = c.ahead_used_neurons as f64 / c.ahead_neurons as f64;
        eprintln!(
            "lookahead {criterion:?}: {hit_rate:.3} of {} neurons used; {c:?}",
            c.ahead_neurons
        );
        assert!(
            c.ahead_used_bytes > 0 && c.ahead_used_bytes <= c.ahead_served_bytes,
            "{c:?}"
        );
        assert!(c.ahead_served_bytes <= c.ffn_needed_bytes, "{c:?}");
        match criterion {
            Criterion::Exact => assert!(hit_rate > 0.95, "{c:?}"),
            _ => assert!(hit_rate > 0.5, "{c:?}"),
        }

        // With the cache first and no gate resident, a gate-predicted lookahead has nothing to
        // predict with: it is turned off and its buffers go to the cache (the plan equals the
        // one without lookahead); the exact criterion's keeps its buffers and works.
        let cache_first = |lookahead| StreamOptions {
            priority: Priority::CacheFirst,
            lookahead,
            ..options(min + file_bytes / 4, ReadEngine::Pread, CachePolicy::Lru)
        };
        let m = load(&p);
        let off = Streamer::open(&m, &cache_first(Lookahead::Off)).unwrap();
        assert!(off.residency.gate_resident.iter().all(|&g| !g), "{:?}", off.residency);
        let asked = Lookahead::for_mask(up_set_reads_input(Strategy::TopK, criterion));
        let m = load(&p);
        let s = Streamer::open(&m, &cache_first(asked)).unwrap();
        let turned_off = s.warnings.iter().any(|w| w.contains("lookahead is off"));
        match criterion {
            Criterion::Exact => {
                assert!(!turned_off, "{:?}", s.warnings);
                assert!(s.residency.cache_neurons[0] < off.residency.cache_neurons[0]);
            }
            _ => {
                assert!(turned_off, "{:?}", s.warnings);
                assert_eq!(s.residency.cache_neurons, off.residency.cache_neurons);
            }
        }
        let mask = Masker::for_model(&m, Strategy::TopK, criterion, 0.5, None).unwrap();
        run(&m, Some(&s), Some(&mask), text, 6);
        assert_eq!(s.counters().ahead_neurons > 0, criterion == Criterion::Exact);
    }
}

#[test]
fn run_records_a_trace_and_bench_quick_replays_it_with_sparse_reading_less() {
    let tmp = tempfile::tempdir().unwrap();
    let p = convert(&stories_dir(), tmp.path(), "s.gst", FfnLayout::Split);
    let bin = env!("CARGO_BIN_EXE_gatestream");
    let trace = tmp.path().join("t.trace");
    // `gatestream run --model s.gst ARGS…`
    let run_cli = |args: &[&std::ffi::OsStr]| {
        std::process::Command::new(bin)
            .args(["run", "--model"])
            .arg(&p)
            .args(args)
            .output()
            .unwrap()
    };
    let os = |a: &'static str| std::ffi::OsStr::new(a);
    let out = run_cli(&[
        os("--max-tokens"),
        os("8"),
        os("--mode"),
        os("sparse"),
        os("--sparsity"),
        os("0.7"),
        os("--criterion"),
        os("gate"),
        os("--ram-budget"),
        os("100M"),
        os("--record-trace"),
        trace.as_os_str(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let t = gatestream::bench::trace::Trace::read(&trace).unwrap();
    assert_eq!(t.header.n_layers, 5);
    assert!(t.header.tokens >= 8, "{:?}", t.header);
    assert!((t.header.kept_fraction - 0.3).abs() < 0.02, "{:?}", t.header);

    // Replay with and without read-through merging; --quick must stay quick.
    for gap in ["0", "100000"] {
        let json = tmp.path().join(format!("b{gap}.json"));
        let t0 = std::time::Instant::now();
        let out = std::process::Command::new(bin)
            .args(["bench", "--quick", "--model"])
            .arg(&p)
            .arg("--trace")
            .arg(&trace)
            .args(["--merge-gap-bytes", gap, "--json"])
            .arg(&json)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(t0.elapsed().as_secs() < 60, "bench --quick took {:?}", t0.elapsed());
        let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        assert!(r["baseline"]["sequential_1mib_gb_per_s"].as_f64().unwrap() > 0.0);
        let passes = r["passes"].as_array().unwrap();
        let engines: std::collections::BTreeSet<&str> =
            passes.iter().map(|p| p["engine"]["engine"].as_str().unwrap()).collect();
        assert_eq!(engines.into_iter().collect::<Vec<_>>(), ["mmap", "pread", "uring"]);
        for dense in passes.iter().filter(|p| p["transfer"] == "dense") {
            let sparse = passes
                .iter()
                .find(|s| s["engine"] == dense["engine"] && s["transfer"] != "dense")
                .unwrap();
            let f = |p: &serde_json::Value, k: &str| p[k].as_f64().unwrap();
            assert!(f(sparse, "needed_bytes_per_token") < 0.8 * f(dense, "needed_bytes_per_token"));
            // Reading through every gap costs at most the blocks' widening beyond dense.
            assert!(
                f(sparse, "device_bytes_per_token") <= f(dense, "device_bytes_per_token") * 1.05,
                "{sparse} vs {dense}"
            );
            // Reading only needed rows: fewer bytes with direct I/O's 512-byte blocks (mmap reads
            // whole 4 KiB pages, and stories260K's rows are so small that every page holds a
            // kept one).
            if gap == "0" && dense["engine"]["engine"] != "mmap" {
                assert!(
                    f(sparse, "device_bytes_per_token") < f(dense, "device_bytes_per_token"),
                    "{sparse} vs {dense}"
                );
            }
            assert_eq!(dense["layer_ms"].as_array().unwrap().len(), 5);
        }
    }

    // `--mode compare` under a budget prints both runs' ratio and, when sparse took longer, why.
    let out = run_cli(
        &[
            "--max-tokens",
            "8",
            "--mode",
            "compare",
            "--sparsity",
            "0.5",
            "--criterion",
            "gate",
            "--ram-budget",
            "100M",
        ]
        .map(os),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let time: f64 = err
        .split("x disk bytes per token, ")
        .nth(1)
        .and_then(|t| t.split('x').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no sparse / dense time ratio in: {err}"));
    assert_eq!(
        err.contains("note: sparse streaming took longer than dense"),
        time > 1.0,
        "{err}"
    );

    // The bench report's device baseline as the read planner's cost model.
    let bench_json = tmp.path().join("b0.json");
    let out = run_cli(&[
        os("--max-tokens"),
        os("2"),
        os("--mode"),
        os("sparse"),
        os("--ram-budget"),
        os("100M"),
        os("--cost-model"),
        bench_json.as_os_str(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&bench_json).unwrap()).unwrap();
    let seq_mb_per_s = r["baseline"]["sequential_1mib_gb_per_s"].as_f64().unwrap() * 1e3;
    assert!(err.contains(&format!("{seq_mb_per_s:.0} MB/s")), "{err}");
    let out = run_cli(&[os("--ram-budget"), os("100M"), os("--cost-model"), trace.as_os_str()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--cost-model") && err.contains("bench"),
        "{err}"
    );
}

/// `perplexity` streams too: under the minimum budget its windows go in batches the budget
/// holds, and the result is exactly the in-RAM model's fed in batches of the same size.
#[test]
fn perplexity_streams_and_equals_the_in_ram_model_in_the_same_batches() {
    use gatestream::model::forward::Passes;
    use gatestream::perplexity::{perplexity_with, PerplexityOptions};
    let tmp = tempfile::tempdir().unwrap();
    let p = convert(&stories_dir(), tmp.path(), "split.gst", FfnLayout::Split);
    let text = std::fs::read_to_string(data_dir().join("wikitext-2/wiki.test.raw")).unwrap();
    let text = &text[..20_000];
    let opts = PerplexityOptions { ctx: 64, windows: 2 };
    fn batches(stream: Option<&Streamer>, batch_tokens_max: usize) -> Passes<'_> {
        Passes {
            stream: stream.map(|s| s as _),
            batch_tokens_max,
            cancel: None,
        }
    }
    let m = load_on_disk(&p);
    let stream_opts = StreamOptions {
        kv_positions: 64,
        batch_tokens_max: 16,
        ..options(min_budget(&p), ReadEngine::Pread, CachePolicy::Pinned)
    };
    let s = Streamer::open(&m, &stream_opts).unwrap();
    let streamed = perplexity_with(&m, batches(Some(&s), 0), text, &opts, &mut |_, _, _| {}).unwrap();
    let in_ram = load(&p);
    let batched = perplexity_with(&in_ram, batches(None, 16), text, &opts, &mut |_, _, _| {}).unwrap();
    assert_eq!(streamed.perplexity.to_bits(), batched.perplexity.to_bits());
    assert!(s.counters().passes >= 2 * 4, "{:?}", s.counters());
    let whole = perplexity_with(&in_ram, batches(None, 0), text, &opts, &mut |_, _, _| {}).unwrap();
    assert!((whole.perplexity - streamed.perplexity).abs() / whole.perplexity < 1e-4);
}

/// `eval` streams too: every pass (windows, threshold calibration, per-layer sensitivity, the
/// union context's votes over its batches, sketches read through the stream) in the batches
/// the budget holds, with exactly the rows of the in-RAM model fed in batches of the same size.
#[test]
fn eval_streams_and_equals_the_in_ram_model_in_the_same_batches() {
    use gatestream::eval::{eval_with, EvalOptions};
    use gatestream::model::forward::Passes;
    let tmp = tempfile::tempdir().unwrap();
    let p = convert(&stories_dir(), tmp.path(), "split.gst", FfnLayout::Split);
    let text = std::fs::read_to_string(data_dir().join("wikitext-2/wiki.test.raw")).unwrap();
    let text = &text[..60_000];
    let opts = EvalOptions {
        ctx: 64,
        windows: 2,
        sparsities: vec![0.0, 0.5],
        strategies: vec![Strategy::TopK, Strategy::Threshold, Strategy::Union],
        criteria: vec![Criterion::Gate, Criterion::Exact, Criterion::Sketch],
        calibrate_tokens: 256,
        max_ppl_increase_pct: 2.0,
        per_layer_tokens: 64,
        checkpoint: None,
        windows_this_run: None,
        jitter_seeds: 0,
        experts: None,
    };
    let m = load_on_disk(&p);
    let stream_opts = StreamOptions {
        kv_positions: 513,
        batch_tokens_max: 16,
        ..options(min_budget(&p) + 600_000, ReadEngine::Pread, CachePolicy::Lru)
    };
    let s = Streamer::open(&m, &stream_opts).unwrap();
    let streamed = Passes {
        stream: Some(&s),
        batch_tokens_max: 0,
        cancel: None,
    };
    let got = eval_with(&m, streamed, text, "wiki", &opts, &mut |_, _, _| {})
        .unwrap()
        .unwrap();
    let in_ram = load(&p);
    let batched = Passes {
        stream: None,
        batch_tokens_max: 16,
        cancel: None,
    };
    let want = eval_with(&in_ram, batched, text, "wiki", &opts, &mut |_, _, _| {})
        .unwrap()
        .unwrap();
    assert_eq!(got.rows.len(), want.rows.len());
    assert!(got.rows.len() >= 10, "{} rows", got.rows.len());
    for (g, w) in got.rows.iter().zip(&want.rows) {
        assert_eq!(
            (g.perplexity.to_bits(), g.strategy, g.criterion),
            (w.perplexity.to_bits(), w.strategy, w.criterion),
            "{:?} {:?} {}: streamed {} vs in RAM {}",
            g.strategy,
            g.criterion,
            g.sparsity,
            g.perplexity,
            w.perplexity
        );
    }
    assert!(s.counters().passes > 0 && s.read_stats().bytes_device > 0);
}

/// Under a GPU budget with room after the output matrix, attention and gates, the device keeps
/// each layer's first neurons (the plan's hot neurons) and computes them from its own copy: the
/// stream hands over only the rest (a cache of the whole layer lends the hot rows; a partial one
/// holds the neurons after them), nothing is read or looked up for a hot neuron, and the down
/// columns of both are summed as one matrix — dense logits stay bit-identical to the in-RAM
/// model's (this model turns a last-bit difference in one FFN output into logits 0.5 apart),
/// sparse ones within rounding.
#[test]
fn a_gpu_budget_keeps_hot_neurons_on_the_device_and_streams_only_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let p = smollm2_gst(tmp.path());
    let text = "The capital of France is";
    let (min, file_bytes) = (min_budget(&p), std::fs::metadata(&p).unwrap().len());
    let ram = load(&p);
    let ffn = ram.config.ffn as u64;
    let ffn0 = ram.weights.layers[0].dense("test").unwrap();
    let neuron_bytes = (ffn0.up.row_bytes + ffn0.down.weight().row_bytes) as u64;
    // The prompt's pass and four decode steps.
    let (steps, passes) = (4, 5);
    for (budget, policy, sparse) in [
        (min + 2 * file_bytes, CachePolicy::Pinned, None),
        (min + 2 * file_bytes, CachePolicy::Lru, Some(Criterion::Exact)),
        (min + 2 * file_bytes, CachePolicy::Lru, Some(Criterion::Gate)),
        (min + file_bytes / 2, CachePolicy::Lru, None),
        (min + file_bytes / 2, CachePolicy::Lru, Some(Criterion::Gate)),
    ] {
        let want = {
            let mask = sparse.map(|c| Masker::for_model(&ram, Strategy::TopK, c, 0.5, None).unwrap());
            run(&ram, None, mask.as_ref(), text, steps)
        };
        let (dev, m) = on_standin(&p);
        let opts = StreamOptions {
            vram_budget_bytes: Some(file_bytes * 7 / 10),
            ..options(budget, ReadEngine::Uring, policy)
        };
        let s = Streamer::open(&m, &opts).unwrap();
        let mask = sparse.map(|c| Masker::for_model(&m, Strategy::TopK, c, 0.5, None).unwrap());
        let got = run(&m, Some(&s), mask.as_ref(), text, steps);
        let what = format!("budget {budget} {policy:?} {sparse:?}");
        assert_like_in_ram(&got, &want, sparse.is_some(), &what);
        let plan = s.device_plan.clone().unwrap();
        let whole = s.residency.cache_neurons.iter().all(|&c| c as u64 == ffn);
        assert!(
            plan.hot_neurons.iter().all(|&k| k > 0 && (k as u64) < ffn),
            "{what}: {plan:?}"
        );
        let streamed: u64 = plan.hot_neurons.iter().map(|&k| ffn - k as u64).sum();
        let c = s.counters();
        // Every hot neuron of every layer in every pass when dense; some when sparse.
        match sparse {
            None => assert_eq!(c.ffn_hot_bytes, passes * plan.hot_bytes, "{what}: {c:?}"),
            Some(_) => assert!(
                c.ffn_hot_bytes > 0 && c.ffn_hot_bytes < passes * plan.hot_bytes,
                "{what}: {c:?}"
            ),
        }
        // The stream never read or handed over a hot neuron: each other neuron's rows at most
        // once a pass.
        let handed = c.ffn_needed_bytes + c.ffn_in_place_bytes;
        assert!(handed <= passes * streamed * neuron_bytes, "{what}: {c:?}");
        // The device copied the hot rows once, with the other weights it keeps.
        let (resident, _) = dev.copied_bytes();
        assert!(resident >= plan.hot_bytes, "{what}: {resident} vs {plan:?}");
        match (whole, sparse) {
            // Whole cache: nothing read; a decode step's kept rows past the hot ones read by id.
            (true, Some(_)) => {
                assert_eq!(c.ffn_needed_bytes, 0, "{what}: {c:?}");
                assert_eq!(
                    dev.in_place_uses("ffn_down"),
                    (passes - 1) * plan.hot_neurons.len() as u64,
                    "{what}"
                );
            }
            // Whole cache, dense: views of every other neuron's rows, every pass.
            (true, None) => assert_eq!(
                (c.ffn_needed_bytes, c.ffn_in_place_bytes),
                (0, passes * streamed * neuron_bytes),
                "{what}: {c:?}"
            ),
            // Partial cache: what it lacks is read, never in place.
            (false, _) => {
                assert!(c.ffn_needed_bytes > 0, "{what}: {c:?}");
                assert_eq!(dev.in_place_uses("ffn_"), 0, "{what}");
            }
        }
    }
}

/// A small custom shape for `make-model` (hidden 512, 8 heads sharing 2 KV heads of 64, a
/// 1024-token synthetic vocabulary): `ffn` wide (each expert's, with `experts`), `layers` deep.
fn small_shape(
    arch: gatestream::config::Arch,
    ffn: usize,
    layers: usize,
    experts: Option<(usize, usize)>,
) -> gatestream::synth::Shape {
    gatestream::synth::Shape {
        vocab: 1024,
        context_len: 512,
        rope_theta: 10000.0,
        experts,
        ..gatestream::synth::Shape::custom(arch, 512, ffn, layers, 8, 2, 64)
    }
}

/// Models written by `make-model` stream at half their size: a dense model in the `rows` layout
/// (its FFN matrices kept or read whole), the same in the split layout, a Qwen3 (QK-norm) in the
/// rows layout, a Llama with Llama 3.1's RoPE frequency factors in the split layout, and a mixture of experts
/// (its read buffers once took more than the budget). Streamed logits equal the in-RAM model's
/// bit for bit with every reader, from the minimum budget to everything resident; in the rows
/// layout the prefetch buffers are sized by what the plan streams, and a second read-ahead
/// buffer, bigger reads and smaller ones change no logit.
#[test]
fn make_model_models_stream_at_half_their_size() {
    use gatestream::config::Arch;
    use gatestream::synth::{MakeSpec, Mix, OutputFormat, Shape, TokenizerChoice};
    let tmp = tempfile::tempdir().unwrap();
    let text = "Once upon a time, there was a cat";
    let shape = small_shape;
    let make = |name: &str, shape: Shape, layout: FfnLayout| {
        let spec = MakeSpec {
            shape,
            mix: Mix::Q4KM,
            dequantize: false,
            tokenizer: TokenizerChoice::Synthetic,
            seed: 5,
            residual_gain: 0.1,
        };
        let out = tmp.path().join(name);
        let opts = ReformatOptions {
            ffn_layout: layout,
            ..ReformatOptions::default()
        };
        gatestream::synth::write_model(&spec, &out, &OutputFormat::Gst(opts), false, &mut |_, _| {}).unwrap();
        out
    };
    let models = [
        (
            make("rows.gst", shape(Arch::Llama, 2048, 12, None), FfnLayout::Rows),
            FfnLayout::Rows,
        ),
        (
            make("split.gst", shape(Arch::Llama, 2048, 12, None), FfnLayout::Split),
            FfnLayout::Split,
        ),
        (
            make("qwen3-rows.gst", shape(Arch::Qwen3, 2048, 12, None), FfnLayout::Rows),
            FfnLayout::Rows,
        ),
        (
            make(
                "llama31-split.gst",
                Shape {
                    rope_factors: Some([8.0, 1.0, 4.0, 128.0]),
                    ..shape(Arch::Llama, 2048, 12, None)
                },
                FfnLayout::Split,
            ),
            FfnLayout::Split,
        ),
        (
            make(
                "moe.gst",
                shape(Arch::Qwen3Moe, 1024, 6, Some((8, 2))),
                FfnLayout::Split,
            ),
            FfnLayout::Split,
        ),
    ];
    for (p, layout) in &models {
        let file_bytes = std::fs::metadata(p).unwrap().len();
        let moe = p.ends_with("moe.gst");
        let reference = run(&load(p), None, None, text, 4);
        let m = load_on_disk(p);
        let opts = |budget: u64, engine| StreamOptions {
            cost: CostSource::Default,
            ..match moe {
                true => options(budget, engine, CachePolicy::Lru),
                false => dense_options(budget, engine),
            }
        };
        let min = budget_in_refusal(
            &Streamer::open(&m, &opts(0, ReadEngine::Pread))
                .err()
                .unwrap()
                .to_string(),
        );
        assert!(
            min <= file_bytes / 2,
            "{}: the minimum {min} is more than half of {file_bytes}",
            p.display()
        );
        for budget in [min, file_bytes / 2, 2 * file_bytes] {
            for engine in [ReadEngine::Uring, ReadEngine::Pread, ReadEngine::Mmap] {
                let s = Streamer::open(&m, &opts(budget, engine)).unwrap();
                // What the FFN asks of the stream is what it holds: a split file's rows, an
                // expert file's experts, a rows layout's whole matrices (neither).
                let narrowed = (s.ffn_rows().is_some(), s.expert_stream().is_some());
                let holds = (!moe && *layout == FfnLayout::Split, moe);
                assert_eq!(narrowed, holds, "{} ({layout:?})", p.display());
                let got = run(&m, Some(&s), None, text, 4);
                assert!(
                    got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} ({layout:?}) at budget {budget} with {engine:?} differs from in RAM",
                    p.display()
                );
                let r = &s.residency;
                assert!(r.resident_bytes() <= budget, "{r:?}");
                if *layout == FfnLayout::Rows && budget < file_bytes {
                    // Some FFN matrices stream; the buffers hold what the plan streams, no more.
                    assert!(r.up_resident.iter().chain(&r.down_resident).any(|&k| !k), "{r:?}");
                    let c = s.counters();
                    assert!(c.dense_needed_bytes > 0 && c.ffn_needed_bytes == 0, "{c:?}");
                    let layer_max = (0..m.config.n_layers)
                        .map(|l| {
                            let w = m.weights.layers[l].dense("test").unwrap();
                            let kept = [
                                r.attention_resident[l],
                                r.gate_resident[l],
                                r.up_resident[l],
                                r.down_resident[l],
                            ];
                            let a = &m.weights.layers[l].attn;
                            let sizes = [
                                [&a.wq, &a.wk, &a.wv, &a.wo]
                                    .iter()
                                    .map(|w| w.len_bytes() as u64)
                                    .sum::<u64>(),
                                w.gate.len_bytes() as u64,
                                w.up.len_bytes() as u64,
                                w.down.weight().len_bytes() as u64,
                            ];
                            (0..4).filter(|&i| !kept[i]).map(|i| sizes[i]).sum::<u64>()
                        })
                        .max()
                        .unwrap();
                    assert_eq!(r.prefetch_buffer_bytes, layer_max, "{r:?}");
                }
            }
        }
        if *layout == FfnLayout::Rows {
            for (buffers, read_bytes) in [(3, 1 << 20), (2, 8192), (4, 64 << 20)] {
                let o = StreamOptions {
                    prefetch_buffers: buffers,
                    prefetch_read_bytes: read_bytes,
                    ..opts(file_bytes * 3 / 4, ReadEngine::Uring)
                };
                let s = Streamer::open(&m, &o).unwrap();
                assert_eq!(s.residency.prefetch_buffers, buffers);
                let got = run(&m, Some(&s), None, text, 4);
                assert!(
                    got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{buffers} buffers"
                );
            }
        }
    }
}

/// The hybrid executor (`--hybrid`) on the host stand-in as the GPU and the CPU device as the
/// CPU: the rows past the device's hot neurons computed by the CPU from the stream's caches,
/// the CPU's f64 down sums finished by the device's and rounded once. Logits bit-identical to
/// the in-RAM model's when dense (under two GPU budgets), within the f64 down-sum tolerance
/// when masked (top-K on the gate); the link carries activations only (no FFN row copied,
/// staged or read in place across it).
#[test]
fn the_hybrid_executor_computes_cold_rows_on_the_cpu_like_the_in_ram_model() {
    use gatestream::stream::hybrid::HybridMode;
    let tmp = tempfile::tempdir().unwrap();
    let p = smollm2_gst(tmp.path());
    let text = "The capital of France is";
    let (min, file_bytes) = (min_budget(&p), std::fs::metadata(&p).unwrap().len());
    let ram = load(&p);
    let (layers, hidden) = (ram.config.n_layers as u64, ram.config.hidden as u64);
    let prompt = ram.tokenizer.encode(text, true).unwrap().len() as u64;
    let (steps, passes) = (4u64, 5u64);
    // (GPU budget, mask, RAM budget: None holds every layer in host memory, Some streams part
    // of each layer's rows from disk, which the step stages for the CPU as a dense step would)
    for (vram, sparse, ram_budget) in [
        (file_bytes * 7 / 10, None, None),
        (file_bytes * 45 / 100, None, None),
        (file_bytes * 7 / 10, Some(Criterion::Gate), None),
        (file_bytes * 7 / 10, None, Some(min + file_bytes / 4)),
    ] {
        let want = {
            let mask = sparse.map(|c| Masker::for_model(&ram, Strategy::TopK, c, 0.5, None).unwrap());
            run(&ram, None, mask.as_ref(), text, steps as usize)
        };
        let (dev, m) = on_standin(&p);
        let policy = if sparse.is_some() {
            CachePolicy::Lru
        } else {
            CachePolicy::Pinned
        };
        let opts = StreamOptions {
            vram_budget_bytes: Some(vram),
            ..match ram_budget {
                None => options(min + 2 * file_bytes, ReadEngine::Uring, policy),
                Some(b) => dense_options(b, ReadEngine::Uring),
            }
        };
        let mut s = Streamer::open(&m, &opts).unwrap();
        assert_eq!(s.enable_hybrid(&m, HybridMode::CpuCold, 1).unwrap(), None);
        let plan = s.hybrid_plan().unwrap().clone();
        assert_eq!(plan.max_width, usize::MAX);
        assert!(
            plan.cpu_s_one_token > 0.0 && plan.cold_bytes_per_layer > 0.0,
            "{plan:?}"
        );
        // The stand-in measures no link.
        assert!(!plan.link_measured, "{plan:?}");
        let mask = sparse.map(|c| Masker::for_model(&m, Strategy::TopK, c, 0.5, None).unwrap());
        let read_before = s.read_stats().bytes_device;
        let got = run(&m, Some(&s), mask.as_ref(), text, steps as usize);
        let what = format!("GPU budget {vram} {sparse:?} RAM budget {ram_budget:?}");
        assert_like_in_ram(&got, &want, sparse.is_some(), &what);
        let (c, link, u) = (s.counters(), dev.link().unwrap(), dev.upload_counters());
        let hot = s.device_plan.as_ref().unwrap().hot_neurons.clone();
        assert!(
            hot.iter().all(|&k| k > 0 && (k as u64) < ram.config.ffn as u64),
            "{what}: {hot:?}"
        );
        // A mask takes the hybrid in decode steps only (the prompt's pass goes through the
        // device as before); dense passes take it always.
        let hybrid_passes = if sparse.is_some() { passes - 1 } else { passes };
        assert_eq!(c.cold_cpu_layers, hybrid_passes * layers, "{what}: {c:?}");
        assert!(c.cold_cpu_bytes > 0 && c.ffn_hot_bytes > 0, "{what}: {c:?}");
        // No FFN row crossed the link in a hybrid pass: nothing staged, nothing read in place,
        // and only the masked prompt's pass copied up rows.
        assert_eq!(u.uploads, 0, "{what}: {u:?}");
        assert_eq!(dev.in_place_uses("ffn_"), 0, "{what}");
        assert_eq!(dev.volatile_uses("ffn_up"), (passes - hybrid_passes) * layers, "{what}");
        assert_eq!(
            dev.volatile_uses("ffn_down"),
            (passes - hybrid_passes) * layers,
            "{what}"
        );
        // What crossed it instead: each hybrid layer's partial output, `hidden` floats a token.
        let tokens = if sparse.is_some() { steps } else { prompt + steps };
        assert!(
            link.activation_bytes >= tokens * layers * hidden * 4,
            "{what}: {link:?}"
        );
        match ram_budget {
            // Every cold row in place in the caches: nothing handed over, nothing read.
            None if sparse.is_none() => {
                assert_eq!(c.ffn_in_place_bytes + c.ffn_needed_bytes, 0, "{what}: {c:?}")
            }
            None => {}
            // Part of each layer read from disk every pass, staged for the CPU.
            Some(_) => assert!(
                s.read_stats().bytes_device > read_before && c.cache_hits > 0,
                "{what}: {c:?}"
            ),
        }
    }
}

/// Under `--hybrid auto` a prompt's pass wider than the crossover copies the cold rows to the
/// device and the decode steps compute them on the CPU: the switch mid-generation keeps the
/// in-RAM model's greedy tokens, and the counters split that way.
#[test]
fn the_hybrid_crossover_switches_between_prefill_and_decode_and_keeps_greedy_tokens() {
    use gatestream::stream::hybrid::HybridMode;
    let tmp = tempfile::tempdir().unwrap();
    let p = smollm2_gst(tmp.path());
    let text = "The capital of France is";
    let (min, file_bytes) = (min_budget(&p), std::fs::metadata(&p).unwrap().len());
    let ram = load(&p);
    let layers = ram.config.n_layers as u64;
    let steps = 6;
    let greedy = |logits: &[f32]| -> Vec<usize> {
        let v = ram.config.vocab;
        let rows = logits.len() / v;
        (rows - steps - 1..rows)
            .map(|r| {
                let row = &logits[r * v..(r + 1) * v];
                (0..v).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap()
            })
            .collect()
    };
    let want = run(&ram, None, None, text, steps);
    let (dev, m) = on_standin(&p);
    let opts = StreamOptions {
        vram_budget_bytes: Some(file_bytes * 7 / 10),
        ..options(min + 2 * file_bytes, ReadEngine::Uring, CachePolicy::Pinned)
    };
    let mut s = Streamer::open(&m, &opts).unwrap();
    assert_eq!(s.enable_hybrid(&m, HybridMode::Auto, 1).unwrap(), None);
    let plan = s.hybrid_plan().unwrap();
    assert!(plan.max_width <= opts.batch_tokens_max, "{plan:?}");
    assert!(plan.describe().contains("hybrid (auto)"), "{}", plan.describe());
    // The prompt (more than 2 tokens) on the device, decode steps on the CPU.
    s.set_hybrid_max_width(2);
    let got = run(&m, Some(&s), None, text, steps);
    assert_like_in_ram(&got, &want, false, "auto, crossover 2");
    assert_eq!(greedy(&got), greedy(&want));
    let c = s.counters();
    assert_eq!(c.cold_cpu_layers, steps as u64 * layers, "{c:?}");
    assert_eq!(dev.volatile_uses("ffn_up"), layers);
    // gpu-stream (and off) open no hybrid: every pass copies its rows, as before.
    for mode in [HybridMode::GpuStream, HybridMode::Off] {
        s.enable_hybrid(&m, mode, 1).unwrap();
        assert!(s.hybrid_plan().is_none(), "{mode:?}");
    }
}

/// Where the hybrid cannot run (no GPU budget; the rows layout), `cpu-cold` is refused with the
/// reason and the fix, and `auto` stays off with that reason as a warning (or silently without
/// a GPU budget).
#[test]
fn the_hybrid_executor_says_why_it_cannot_run() {
    use gatestream::stream::hybrid::HybridMode;
    let tmp = tempfile::tempdir().unwrap();
    let p = smollm2_gst(tmp.path());
    let (min, file_bytes) = (min_budget(&p), std::fs::metadata(&p).unwrap().len());
    // No GPU budget (the CPU device).
    let m = load(&p);
    let mut s = Streamer::open(
        &m,
        &options(min + 2 * file_bytes, ReadEngine::Pread, CachePolicy::Pinned),
    )
    .unwrap();
    let e = s.enable_hybrid(&m, HybridMode::CpuCold, 1).unwrap_err().to_string();
    assert!(e.contains("--vram-budget"), "{e}");
    assert_eq!(s.enable_hybrid(&m, HybridMode::Auto, 1).unwrap(), None);
    assert!(s.hybrid_plan().is_none());
    // The rows layout: the device keeps no FFN rows, and the CPU's share is not split by neuron.
    let src = model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2");
    let rows = convert(&src, tmp.path(), "rows.gst", FfnLayout::Rows);
    let rows_bytes = std::fs::metadata(&rows).unwrap().len();
    let (_dev, m) = on_standin(&rows);
    let opts = StreamOptions {
        vram_budget_bytes: Some(rows_bytes * 7 / 10),
        ..dense_options(2 * rows_bytes, ReadEngine::Pread)
    };
    let mut s = Streamer::open(&m, &opts).unwrap();
    let e = s.enable_hybrid(&m, HybridMode::CpuCold, 1).unwrap_err().to_string();
    assert!(e.contains("--ffn-layout split"), "{e}");
    let w = s.enable_hybrid(&m, HybridMode::Auto, 1).unwrap().expect("a warning");
    assert!(w.contains("--hybrid auto: off") && w.contains("--ffn-layout"), "{w}");
    assert!(s.hybrid_plan().is_none());
}

/// A GGUF streams as downloaded, with no `.gst` made first: dense (FFN matrices kept or read
/// whole, as the `rows` layout does) from the real SmolLM2 (Q4_1, tied embeddings, GGUF tensors
/// aligned to 32 bytes, not the disk's blocks) and from make-model's Llama (Q4_K_M mix) and
/// Qwen3. Logits equal the in-RAM model's bit for bit with every reader from the minimum budget
/// to everything resident, and each budget reads what the `rows` `.gst` made from the same GGUF
/// reads (the same plan); nothing is written. The same for make-model's Llama in the small type
/// mixes (Q2_K, Q3_K_M, IQ4_XS, IQ2_XXS: the K, IQ4 and grid types beside Q4_K/Q5_K/Q6_K rows),
/// whose split `.gst` (up rows as stored, down columns re-quantized) also streams bit-identical to
/// its own in-RAM model with every reader and cache.
#[test]
fn a_gguf_streams_directly_like_the_in_ram_model_and_the_rows_gst() {
    use gatestream::config::Arch;
    use gatestream::synth::{MakeSpec, Mix, OutputFormat, TokenizerChoice};
    let tmp = tempfile::tempdir().unwrap();
    let text = "The capital of France is";
    let make_mix = |name: &str, arch: Arch, mix: Mix, layers: usize| {
        let spec = MakeSpec {
            shape: small_shape(arch, 2048, layers, None),
            mix,
            dequantize: false,
            tokenizer: TokenizerChoice::Synthetic,
            seed: 7,
            residual_gain: 0.1,
        };
        let out = tmp.path().join(name);
        gatestream::synth::write_model(&spec, &out, &OutputFormat::Gguf, false, &mut |_, _| {}).unwrap();
        out
    };
    let make = |name: &str, arch: Arch| make_mix(name, arch, Mix::Q4KM, 12);
    let small_mixes = [Mix::Q2K, Mix::Q3KM, Mix::IQ4XS, Mix::IQ2XXS]
        .map(|mix| make_mix(&format!("llama-{}.gguf", mix.name()), Arch::Llama, mix, 4));
    for gguf in &small_mixes {
        let split = convert(gguf, tmp.path(), "split.gst", FfnLayout::Split);
        assert_bit_identical(&split, text);
        std::fs::remove_file(&split).unwrap();
    }
    let mut ggufs = vec![
        model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2"),
        make("llama.gguf", Arch::Llama),
        make("qwen3.gguf", Arch::Qwen3),
    ];
    ggufs.extend(small_mixes);
    for gguf in &ggufs {
        let rows = convert(gguf, tmp.path(), "rows.gst", FfnLayout::Rows);
        let reference = run(&load(gguf), None, None, text, 4);
        let file_bytes = std::fs::metadata(gguf).unwrap().len();
        let (m, g) = (load_on_disk(gguf), load_on_disk(&rows));
        let min = budget_in_refusal(
            &Streamer::open(&m, &dense_options(0, ReadEngine::Pread))
                .err()
                .unwrap()
                .to_string(),
        );
        for budget in [min, min + (file_bytes - min.min(file_bytes)) / 2, 2 * file_bytes] {
            for engine in [ReadEngine::Uring, ReadEngine::Pread, ReadEngine::Mmap] {
                let s = Streamer::open(&m, &dense_options(budget, engine)).unwrap();
                let got = run(&m, Some(&s), None, text, 4);
                assert!(
                    got.len() == reference.len() && got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} at budget {budget} with {engine:?} differs from in RAM",
                    gguf.display()
                );
                assert!(s.residency.resident_bytes() <= budget, "{:?}", s.residency);
                let from_gst = Streamer::open(&g, &dense_options(budget, engine)).unwrap();
                let got_gst = run(&g, Some(&from_gst), None, text, 4);
                assert!(got_gst.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()));
                let (c, d) = (s.counters(), from_gst.counters());
                assert_eq!(
                    (c.dense_needed_bytes, c.ffn_needed_bytes),
                    (d.dense_needed_bytes, d.ffn_needed_bytes),
                    "{} at budget {budget} with {engine:?}: the GGUF and the rows .gst read differently",
                    gguf.display()
                );
                if budget == min {
                    assert!(c.dense_needed_bytes > 0, "{c:?}");
                }
            }
        }
        std::fs::remove_file(&rows).unwrap();
    }
}

/// `src`'s tensors written again as a Hugging Face folder of `shards` safetensors files with
/// their index (each header padded by `pad` spaces, so the data starts at another phase of the
/// disk's block in each file), beside its config and tokenizer.
fn shard_safetensors(src: &Path, dest: &Path, shards: usize, pad: usize) {
    use gatestream::safetensors::SafetensorsModel;
    std::fs::create_dir_all(dest).unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_none_or(|e| e != "safetensors") {
            std::fs::copy(&f, dest.join(f.file_name().unwrap())).unwrap();
        }
    }
    let m = SafetensorsModel::open_dir(src).unwrap();
    let mut tensors: Vec<_> = m.tensors.values().collect();
    tensors.sort_by_key(|t| (t.file, t.offset_bytes));
    let tensors: Vec<(String, &str, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|t| {
            let dtype = match t.ty {
                gatestream::quant::GgmlType::F32 => "F32",
                gatestream::quant::GgmlType::F16 => "F16",
                _ => "BF16",
            };
            (t.name.clone(), dtype, t.shape.clone(), m.bytes(t).to_vec())
        })
        .collect();
    write_safetensors_shards(dest, &tensors, shards, pad);
}

/// A Hugging Face folder streams directly, one file or several: its shards are one byte space
/// (each at its place, a MiB multiple, so offsets keep their phase), each range read from the
/// shard holding it. Logits bit-identical to the in-RAM model's with every reader, from the
/// minimum budget to everything resident; the sharded copy (headers of other lengths, so each
/// shard's data starts at another phase) reads what the single file does.
#[test]
fn a_safetensors_folder_streams_directly_like_the_in_ram_model_one_file_or_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let sharded = tmp.path().join("sharded");
    shard_safetensors(&stories_dir(), &sharded, 3, 1001);
    assert_eq!(
        gatestream::model::model_bytes(&sharded).unwrap(),
        std::fs::read_dir(&sharded)
            .unwrap()
            .map(|f| f.unwrap().path())
            .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
            .map(|f| std::fs::metadata(f).unwrap().len())
            .sum::<u64>()
    );
    let text = "Once upon a time, there was a cat";
    let reference = run(&load(&stories_dir()), None, None, text, 4);
    let mut read = Vec::new();
    for dir in [stories_dir(), sharded.clone()] {
        let m = load_on_disk(&dir);
        assert_eq!(m.parts.len(), if dir == sharded { 3 } else { 1 }, "{:?}", m.parts);
        let model_bytes = gatestream::model::model_bytes(&dir).unwrap();
        let min = budget_in_refusal(
            &Streamer::open(&m, &dense_options(0, ReadEngine::Pread))
                .err()
                .unwrap()
                .to_string(),
        );
        for budget in [min, min + model_bytes / 2, min + 2 * model_bytes] {
            for engine in [ReadEngine::Uring, ReadEngine::Pread, ReadEngine::Mmap] {
                let s = Streamer::open(&m, &dense_options(budget, engine)).unwrap();
                let got = run(&m, Some(&s), None, text, 4);
                assert!(
                    got.len() == reference.len() && got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} at budget {budget} with {engine:?} differs from in RAM",
                    dir.display()
                );
                assert!(s.residency.resident_bytes() <= budget, "{:?}", s.residency);
                let c = s.counters();
                match budget == min {
                    true => assert!(c.dense_needed_bytes > 0, "{c:?}"),
                    false if budget > min + model_bytes => assert_eq!(c.dense_needed_bytes, 0, "{c:?}"),
                    false => {}
                }
                read.push((engine, c.dense_needed_bytes, c.ffn_needed_bytes));
            }
        }
    }
    let (one, shards) = read.split_at(read.len() / 2);
    assert_eq!(one, shards, "the sharded folder reads what the single file does");
}

/// A mixture-of-experts GGUF streams directly: expert e of a layer is slice e of each of its
/// three expert tensors (three ranges, whole tensors apart), read by route into the expert
/// cache. Qwen3-MoE, Mixtral-style llama and OLMoE from make-model: logits bit-identical to the
/// in-RAM model with every reader, cache policy and lookahead, from the minimum budget to every
/// expert cached; each budget reads as many expert bytes as the `.gst` made from the same GGUF
/// (whose experts are one section each).
#[test]
fn a_mixture_of_experts_gguf_streams_directly_like_the_in_ram_model() {
    use gatestream::config::Arch;
    use gatestream::synth::{MakeSpec, Mix, OutputFormat, Shape, TokenizerChoice};
    let tmp = tempfile::tempdir().unwrap();
    let text = "Once upon a time, there was a cat";
    let make = |name: &str, arch: Arch, experts: (usize, usize)| {
        let spec = MakeSpec {
            shape: Shape {
                vocab: 512,
                context_len: 512,
                rope_theta: 10000.0,
                experts: Some(experts),
                ..Shape::custom(arch, 256, 256, 4, 4, if arch == Arch::Olmoe { 4 } else { 2 }, 64)
            },
            mix: Mix::Q4KM,
            dequantize: false,
            tokenizer: TokenizerChoice::Synthetic,
            seed: 9,
            residual_gain: 0.1,
        };
        let out = tmp.path().join(name);
        gatestream::synth::write_model(&spec, &out, &OutputFormat::Gguf, false, &mut |_, _| {}).unwrap();
        out
    };
    for gguf in [
        make("qwen3moe.gguf", Arch::Qwen3Moe, (8, 2)),
        make("mixtral.gguf", Arch::Llama, (8, 2)),
        make("olmoe.gguf", Arch::Olmoe, (6, 3)),
    ] {
        let gst = convert(&gguf, tmp.path(), "experts.gst", FfnLayout::Split);
        let reference = run(&load(&gguf), None, None, text, 4);
        let (m, g) = (load_on_disk(&gguf), load_on_disk(&gst));
        let opts = |budget: u64, engine, cache, lookahead| StreamOptions {
            lookahead,
            ..options(budget, engine, cache)
        };
        let file_bytes = std::fs::metadata(&gguf).unwrap().len();
        let mut compared = 0;
        for (cache, lookahead) in [
            (CachePolicy::Lru, Lookahead::Off),
            (CachePolicy::Frequency, Lookahead::FromGates),
        ] {
            for engine in [ReadEngine::Uring, ReadEngine::Pread, ReadEngine::Mmap] {
                // The least budget that opens (a refusal names the least its own check needs;
                // one with that budget may meet the next check).
                let min_of = |m: &Model| {
                    let mut b = 0;
                    for _ in 0..4 {
                        match Streamer::open(m, &opts(b, engine, cache, lookahead)) {
                            Ok(_) => return b,
                            Err(e) => b = budget_in_refusal(&e.to_string()),
                        }
                    }
                    panic!("no budget opens {}", m.path.display())
                };
                // (The .gst's minimum may be larger: its readers' buffers are sized by its
                // sections. A few experts' room over it: the minimum itself moves by a few
                // pages from one open to the next, with what the readers could register.)
                let min = min_of(&m).max(min_of(&g)) + (256 << 10);
                for budget in [min, min + file_bytes / 4, min + 2 * file_bytes] {
                    let what = format!(
                        "{} at budget {budget} with {engine:?} {cache:?} {lookahead:?}",
                        gguf.display()
                    );
                    let s = Streamer::open(&m, &opts(budget, engine, cache, lookahead)).unwrap();
                    let got = run(&m, Some(&s), None, text, 4);
                    assert!(
                        got.len() == reference.len()
                            && got.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: differs from in RAM"
                    );
                    let from_gst = Streamer::open(&g, &opts(budget, engine, cache, lookahead)).unwrap();
                    run(&g, Some(&from_gst), None, text, 4);
                    let (c, d) = (s.counters(), from_gst.counters());
                    let slots = |s: &Streamer| s.experts.as_ref().map(|e| e.cache_slots);
                    assert!(c.ffn_needed_bytes > 0, "{what}: {c:?}");
                    if slots(&s) != slots(&from_gst) {
                        continue;
                    }
                    assert_eq!(
                        (c.ffn_needed_bytes, c.cache_hits, c.cache_lookups),
                        (d.ffn_needed_bytes, d.cache_hits, d.cache_lookups),
                        "{what}: the GGUF and the .gst read experts differently"
                    );
                    compared += 1;
                }
            }
        }
        // (All but the smallest budgets give both the same cache.)
        assert!(compared >= 12, "{}: {compared} of 18 compared", gguf.display());
        std::fs::remove_file(&gst).unwrap();
    }
}

/// A memory cgroup of its own (v1's memory controller or v2's), removed when dropped; for the
/// tests that run the binary under a memory cap. Fails, never skips, where none can be made
/// (this machine and CI are root on a kernel with one).
struct MemoryCgroup {
    dir: PathBuf,
    procs: PathBuf,
}

impl MemoryCgroup {
    fn new(limit_bytes: u64) -> MemoryCgroup {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let name = format!("gatestream-test-{}", std::process::id());
        for line in own.lines() {
            let mut f = line.splitn(3, ':');
            let (_, controllers, rel) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap());
            let (base, limit_file) = if controllers.split(',').any(|c| c == "memory") {
                (
                    Path::new("/sys/fs/cgroup/memory").to_path_buf(),
                    "memory.limit_in_bytes",
                )
            } else if controllers.is_empty() && Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
                (Path::new("/sys/fs/cgroup").to_path_buf(), "memory.max")
            } else {
                continue;
            };
            let dir = base.join(rel.trim_start_matches('/')).join(&name);
            if std::fs::create_dir_all(&dir).is_ok()
                && std::fs::write(dir.join(limit_file), limit_bytes.to_string()).is_ok()
            {
                return MemoryCgroup {
                    procs: dir.join("cgroup.procs"),
                    dir,
                };
            }
            let _ = std::fs::remove_dir(&dir);
        }
        panic!("no memory cgroup could be made here (root and a cgroup memory controller are needed): {own}");
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// `run` with no budget flag under a memory cap smaller than the model: automatic placement
/// reads the cgroup's limit, streams the GGUF instead of mapping it whole, stays within the cap
/// (no OOM kill) and says what it chose, in its output and its JSON; the same model with room
/// runs in RAM. (Qwen2.5-Coder-1.5B, 1.12 GB, under a 700 MiB cap.)
#[test]
fn run_with_no_budget_streams_under_a_cgroup_cap_instead_of_being_killed() {
    let qwen = model_file("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen1.5b");
    let bin = env!("CARGO_BIN_EXE_gatestream");
    let cap: u64 = 700 << 20;
    let cg = MemoryCgroup::new(cap);
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("echo $$ > '{}' && exec \"$@\"", cg.procs.display()))
        .arg("sh")
        .arg(bin)
        .args([
            "run",
            "--max-tokens",
            "4",
            "--json",
            "--prompt",
            "def fib(n):",
            "--model",
        ])
        .arg(&qwen)
        .env_remove("GATESTREAM_MEMORY_LIMIT")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?} under a {cap}-byte cap: {err}",
        out.status
    );
    assert!(
        err.contains("placement: streamed from disk") && err.contains("cgroup"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["placement"]["placed"]["kind"], "streamed", "{v}");
    assert_eq!(v["placement"]["memory"]["limit_bytes"].as_u64(), Some(cap), "{v}");
    let rss = v["stream"]["peak_rss_bytes"].as_u64().unwrap();
    assert!(rss < cap, "peak RSS {rss} over the {cap}-byte cap");
    assert!(v["stream"]["disk_bytes_per_token"].as_f64().unwrap() > 1e8, "{v}");
    drop(cg);
    // With room (an override well above the model): in RAM, no stream.
    let out = std::process::Command::new(bin)
        .args(["run", "--max-tokens", "2", "--json", "--model"])
        .arg(&qwen)
        .env("GATESTREAM_MEMORY_LIMIT", (8u64 << 30).to_string())
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["placement"]["placed"]["kind"], "in_ram", "{v}");
    assert!(v["stream"].is_null(), "{v}");
}

/// A Hugging Face folder is placed like a file: with no budget flag and less memory than the
/// folder's files and the run's overhead, `run` streams it (the sharded copy too), with the
/// in-RAM run's text, and says what it should give (the disk's rate over a token's reads); with
/// room, it runs in RAM.
#[test]
fn run_with_no_budget_places_a_safetensors_folder_like_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let sharded = tmp.path().join("sharded");
    shard_safetensors(&stories_dir(), &sharded, 2, 7);
    let bin = env!("CARGO_BIN_EXE_gatestream");
    let run = |dir: &Path, limit: u64| -> serde_json::Value {
        let out = std::process::Command::new(bin)
            .args([
                "run",
                "--max-tokens",
                "12",
                "--json",
                "--prompt",
                "Once upon a time",
                "--model",
            ])
            .arg(dir)
            .env("GATESTREAM_MEMORY_LIMIT", limit.to_string())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let in_ram = run(&stories_dir(), 8 << 30);
    assert_eq!(in_ram["placement"]["placed"]["kind"], "in_ram", "{in_ram}");
    assert!(in_ram["text"].as_str().is_some_and(|t| t.len() > 10), "{in_ram}");
    for dir in [stories_dir(), sharded] {
        // (Automatic placement keeps a 128 MiB reserve: 2 MB left, near the minimum.)
        let v = run(&dir, (128 << 20) + 2_000_000);
        assert_eq!(v["placement"]["placed"]["kind"], "streamed", "{v}");
        assert_eq!(
            v["placement"]["model_bytes"].as_u64(),
            Some(gatestream::model::model_bytes(&dir).unwrap()),
            "{v}"
        );
        assert!(v["stream"]["disk_bytes_per_token"].as_f64().is_some(), "{v}");
        assert_eq!(v["text"], in_ram["text"], "{}", dir.display());
        // What it should give: the planned bytes a token at the disk's rate measured at open.
        let e = &v["placement"]["expected"];
        let (bytes, rate) = (
            e["bytes_per_token"].as_u64().unwrap(),
            e["disk_bytes_per_s"].as_f64().unwrap(),
        );
        assert_eq!(
            Some(bytes as f64),
            v["stream"]["dense_disk_bytes_per_token"].as_f64(),
            "{v}"
        );
        assert!(
            rate > 0.0 && (e["tok_per_s_max"].as_f64().unwrap() - rate / bytes as f64).abs() < 1e-6,
            "{e}"
        );
        assert_eq!(e["experts_all_read"], false, "{e}");
    }
}
