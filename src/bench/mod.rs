//! `gatestream bench`: the I/O of streaming measured alone. Replays traces of which neurons each
//! token used against a `.gst` file — dense transfer (whole FFN sections, large sequential reads)
//! and sparse transfer (the read planner's reads for the trace) — with each reader engine and
//! queue depth, and measures the device's own limits on the same file in the same run (sequential
//! 1 MiB reads; random reads of several sizes), so every figure has a reference.
//!
//! Owns: replay, timing, the device baseline, the report (table, JSON, SVG). Reads through `io`,
//! plans with `stream::plan`, never computes a model.

pub mod experts;
pub mod trace;

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::gstfile::GstFile;
#[cfg(target_os = "linux")]
use crate::io::FixedBuffers;
use crate::io::{open_reader, ReadEngine, Reader, ReaderOptions};
use crate::io::{DirectIo, Range};
use crate::stream::cache::{CachePolicy, LayerCache};
use crate::stream::plan::{plan, CostModel};
use crate::stream::Part;
use trace::Trace;

/// One reader configuration to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct EngineConfig {
    pub engine: &'static str,
    pub queue_depth: usize,
    pub fixed_buffers: bool,
}

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub engines: Vec<EngineConfig>,
    /// Tokens of each trace replayed (the first ones).
    pub tokens: usize,
    /// Read the gate matrix in full every token in both transfers (as streaming does when the
    /// gate is not resident); false leaves the gate out of both.
    pub gate_streamed: bool,
    /// Neurons per layer an LRU neuron cache holds in sparse replay (0: no cache).
    pub cache_neurons: usize,
    /// Random-read baseline sizes, bytes.
    pub baseline_sizes: Vec<usize>,
    pub baseline_random_reads: usize,
    pub baseline_seq_bytes: u64,
    /// The planner's merge gap override (None: the probed cost model's).
    pub merge_gap_bytes: Option<u64>,
    /// Submit a whole token's reads as one batch instead of one batch per layer (streaming
    /// cannot: a layer's neurons are known only after the layer before; this shows what the
    /// per-layer round trips cost). Per-layer times are not measured then.
    pub token_batches: bool,
}

/// One pass: an engine configuration replaying one transfer over the trace's tokens.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Pass {
    pub engine: EngineConfig,
    /// "dense", or the sparse trace's mask.
    pub transfer: String,
    pub tokens: usize,
    pub needed_bytes_per_token: f64,
    pub device_bytes_per_token: f64,
    pub reads_per_token: f64,
    pub seconds_per_token: f64,
    pub device_gb_per_s: f64,
    pub iops: f64,
    /// Per read: time from its layer's batch submission to its completion (queueing included).
    pub completion_p50_us: f64,
    pub completion_p99_us: f64,
    pub read_amplification: f64,
    /// Share of needed neurons the simulated cache served.
    pub cache_hit_rate: f64,
    /// The device baseline's time for this pass's mix of reads (sequential bandwidth for reads
    /// of 1 MiB and more, random-read rate of the nearest measured size below that), divided by
    /// the measured time: 1.0 = as fast as the device itself.
    pub fraction_of_baseline: f64,
    /// Per layer, per token: device bytes and milliseconds.
    pub layer_bytes: Vec<f64>,
    pub layer_ms: Vec<f64>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct RandomBaseline {
    pub read_bytes: usize,
    pub queue_depth: usize,
    pub iops: f64,
    pub gb_per_s: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Baseline {
    pub engine: &'static str,
    /// Sequential 1 MiB reads at the deepest queue swept.
    pub sequential_1mib_gb_per_s: f64,
    pub sequential_queue_depth: usize,
    /// Sequential 1 MiB reads at every io_uring queue depth swept (`[queue_depth, GB/s]`), each
    /// over its own region of the file: on some devices deep queues of large reads are slower.
    pub sequential_by_queue_depth: Vec<(usize, f64)>,
    pub random: Vec<RandomBaseline>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Setup {
    pub kernel: String,
    pub file: PathBuf,
    pub file_bytes: u64,
    pub model: String,
    pub direct_io_align_bytes: usize,
    pub cost_model: CostModel,
    pub gate_streamed: bool,
    pub cache_neurons_per_layer: usize,
    pub traces: Vec<trace::TraceHeader>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    pub setup: Setup,
    pub baseline: Baseline,
    pub passes: Vec<Pass>,
    /// `bench --device cuda`: the host-to-device link, measured in the same run.
    pub link: Option<Vec<crate::backend::LinkBandwidth>>,
}

/// A layer's FFN in the file.
struct LayerGeometry {
    gate: Part,
    up: Part,
    down: Part,
}

fn geometry(g: &GstFile) -> Result<Vec<LayerGeometry>> {
    let c = &g.index.config;
    let get = |name: String| -> Result<Part> {
        let w = g
            .weight(&name, c.ffn, c.hidden)?
            .ok_or_else(|| Error::Input(format!("{}: no tensor {name}", g.path.display())))?;
        Part::of(&w)
    };
    (0..c.n_layers)
        .map(|l| {
            Ok(LayerGeometry {
                gate: get(format!("blk.{l}.ffn_gate.weight"))?,
                up: get(format!("blk.{l}.ffn_up.weight"))?,
                down: get(format!("blk.{l}.ffn_down_t.weight"))?,
            })
        })
        .collect()
}

fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| std::env::consts::OS.into(), |s| s.trim().into())
}

/// Cuts `r` into reads of at most `chunk` bytes.
fn chunks(r: Range, chunk: usize, out: &mut Vec<Range>) {
    let mut done = 0;
    while done < r.len_bytes {
        let len = chunk.min(r.len_bytes - done);
        out.push(Range::new(r.offset_bytes + done as u64, len));
        done += len;
    }
}

fn open(path: &Path, e: EngineConfig) -> Result<Box<dyn Reader>> {
    let engine = match e.engine {
        "uring" => ReadEngine::Uring,
        "pread" => ReadEngine::Pread,
        _ => ReadEngine::Mmap,
    };
    let opts = ReaderOptions {
        queue_depth: e.queue_depth,
        // Room for a 1 MiB read widened by one block at each end: no read needs a one-off
        // buffer (whose first-touch page faults would be timed as I/O).
        slot_bytes: (1 << 20) + 2 * crate::io::ALIGN_BYTES,
        direct_io: if engine == ReadEngine::Mmap {
            DirectIo::Off
        } else {
            DirectIo::Optional
        },
        #[cfg(target_os = "linux")]
        fixed_buffers: if e.fixed_buffers {
            FixedBuffers::On
        } else {
            FixedBuffers::Off
        },
        ..ReaderOptions::default()
    };
    Ok(open_reader(path, engine, &opts)?.reader)
}

/// Evicts the file's pages from the page cache (so mmap passes start cold); false if refused.
fn drop_file_cache(path: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        if let Ok(f) = std::fs::File::open(path) {
            // SAFETY: advice on a descriptor `f` keeps open; no memory is touched.
            return unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) } == 0;
        }
        false
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        false
    }
}

/// Reads `ranges` as one batch, recording each read's completion time (µs since submission).
/// Every page of the bytes is touched, so a zero-copy engine (mmap) really reads them.
fn timed_batch(reader: &dyn Reader, ranges: &[Range], completions: &mut Vec<f64>) -> Result<f64> {
    let t0 = Instant::now();
    reader.read_each(ranges, &mut |_, bytes| {
        let mut x = 0u8;
        for i in (0..bytes.len()).step_by(4096) {
            x ^= bytes[i];
        }
        std::hint::black_box(x);
        completions.push(t0.elapsed().as_secs_f64() * 1e6);
        Ok(())
    })?;
    Ok(t0.elapsed().as_secs_f64())
}

fn measure_baseline(path: &Path, file_bytes: u64, opts: &BenchOptions) -> Result<Baseline> {
    let qd = 64;
    let mut depths: Vec<usize> = opts
        .engines
        .iter()
        .filter(|e| e.engine == "uring")
        .map(|e| e.queue_depth)
        .collect();
    depths.push(qd);
    depths.sort_unstable();
    depths.dedup();
    let seq_bytes = opts.baseline_seq_bytes.min(file_bytes);
    let mut sink = Vec::new();
    let mut by_depth = Vec::new();
    for (i, &d) in depths.iter().enumerate() {
        let r = open(
            path,
            EngineConfig {
                engine: "uring",
                queue_depth: d,
                fixed_buffers: true,
            },
        )?;
        let start = (i as u64 * seq_bytes) % (file_bytes - seq_bytes + 1) / 4096 * 4096;
        let mut seq = Vec::new();
        chunks(Range::new(start, seq_bytes as usize), 1 << 20, &mut seq);
        let t = timed_batch(r.as_ref(), &seq, &mut sink)?;
        by_depth.push((d, seq_bytes as f64 / t / 1e9));
    }
    let sequential = by_depth.iter().find(|x| x.0 == qd).map_or(0.0, |x| x.1);
    let r = open(
        path,
        EngineConfig {
            engine: "uring",
            queue_depth: qd,
            fixed_buffers: true,
        },
    )?;
    let mut random = Vec::new();
    for &size in &opts.baseline_sizes {
        let size = size.min(file_bytes as usize);
        let slots = (file_bytes / size as u64).max(1);
        let n = opts.baseline_random_reads;
        let stride = (slots / n.max(1) as u64).max(1) | 1;
        let ranges: Vec<Range> = (0..n as u64)
            .map(|i| Range::new(((i * stride * 7919 + 13) % slots) * size as u64, size))
            .collect();
        let t = timed_batch(r.as_ref(), &ranges, &mut sink)?;
        random.push(RandomBaseline {
            read_bytes: size,
            queue_depth: qd,
            iops: n as f64 / t,
            gb_per_s: (n * size) as f64 / t / 1e9,
        });
    }
    Ok(Baseline {
        engine: "uring",
        sequential_1mib_gb_per_s: sequential,
        sequential_queue_depth: qd,
        sequential_by_queue_depth: by_depth,
        random,
    })
}

/// Sequential reads of one size at one queue depth (`bench --device-only`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct SequentialPoint {
    pub read_bytes: usize,
    pub queue_depth: usize,
    pub gb_per_s: f64,
}

/// The device's own curve on a file (any file: a `.gst`, a GGUF): sequential reads by request
/// size and queue depth, then random reads by size at the deepest queue — what streaming's
/// request size and queue depth are chosen against, and what its read rate is compared with.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceCurve {
    pub kernel: String,
    pub file: PathBuf,
    pub file_bytes: u64,
    pub direct_io_align_bytes: usize,
    pub sequential_bytes_per_point: u64,
    pub sequential: Vec<SequentialPoint>,
    pub random: Vec<RandomBaseline>,
    /// The fastest sequential point.
    pub best_sequential_gb_per_s: f64,
}

/// Measures [`DeviceCurve`] with io_uring and O_DIRECT: `seq_bytes` at each size × depth, each
/// point over its own region of the file (so no point reads what another just read), then
/// `random_reads` reads of each of `random_sizes`.
pub fn device_curve(
    path: &Path,
    sizes: &[usize],
    depths: &[usize],
    seq_bytes: u64,
    random_sizes: &[usize],
    random_reads: usize,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<DeviceCurve> {
    let file_bytes = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
    let seq_bytes = seq_bytes.min(file_bytes);
    let open_at = |read_bytes: usize, queue_depth: usize| -> Result<Box<dyn Reader>> {
        let opts = ReaderOptions {
            queue_depth,
            slot_bytes: read_bytes + 2 * crate::io::ALIGN_BYTES,
            direct_io: DirectIo::Optional,
            ..ReaderOptions::default()
        };
        Ok(open_reader(path, ReadEngine::Uring, &opts)?.reader)
    };
    let mut sink = Vec::new();
    let mut sequential = Vec::new();
    let total = sizes.len() * depths.len() + 1;
    let mut region = 0u64;
    let mut align = 1;
    for &size in sizes {
        for &qd in depths {
            progress("sequential", sequential.len(), total);
            let r = open_at(size, qd)?;
            align = r.align_bytes();
            let start = (region * seq_bytes) % (file_bytes - seq_bytes + 1) / 4096 * 4096;
            region += 1;
            let mut seq = Vec::new();
            chunks(Range::new(start, seq_bytes as usize), size, &mut seq);
            let t = timed_batch(r.as_ref(), &seq, &mut sink)?;
            sequential.push(SequentialPoint {
                read_bytes: size,
                queue_depth: qd,
                gb_per_s: seq_bytes as f64 / t / 1e9,
            });
        }
    }
    progress("random", total - 1, total);
    let qd = depths.iter().copied().max().unwrap_or(64);
    let r = open_at(random_sizes.iter().copied().max().unwrap_or(4096), qd)?;
    let mut random = Vec::new();
    for &size in random_sizes {
        let size = size.min(file_bytes as usize).max(1);
        let slots = (file_bytes / size as u64).max(1);
        let n = random_reads;
        let stride = (slots / n.max(1) as u64).max(1) | 1;
        let ranges: Vec<Range> = (0..n as u64)
            .map(|i| Range::new(((i * stride * 7919 + 13) % slots) * size as u64, size))
            .collect();
        let t = timed_batch(r.as_ref(), &ranges, &mut sink)?;
        random.push(RandomBaseline {
            read_bytes: size,
            queue_depth: qd,
            iops: n as f64 / t,
            gb_per_s: (n * size) as f64 / t / 1e9,
        });
    }
    progress("done", total, total);
    let best = sequential.iter().map(|p| p.gb_per_s).fold(0.0, f64::max);
    Ok(DeviceCurve {
        kernel: kernel(),
        file: path.to_path_buf(),
        file_bytes,
        direct_io_align_bytes: align,
        sequential_bytes_per_point: seq_bytes,
        sequential,
        random,
        best_sequential_gb_per_s: best,
    })
}

/// The device curve as a table.
pub fn curve_table(c: &DeviceCurve) -> String {
    use std::fmt::Write;
    let mut depths: Vec<usize> = c.sequential.iter().map(|p| p.queue_depth).collect();
    depths.dedup();
    depths.sort_unstable();
    depths.dedup();
    let mut s = format!(
        "device curve of {} ({:.2} GB, io_uring, O_DIRECT {}-byte alignment): sequential GB/s, {:.0} MB per point\n  read size",
        c.file.display(),
        c.file_bytes as f64 / 1e9,
        c.direct_io_align_bytes,
        c.sequential_bytes_per_point as f64 / 1e6
    );
    for d in &depths {
        let _ = write!(s, "   QD {d:<4}");
    }
    s.push('\n');
    let mut sizes: Vec<usize> = c.sequential.iter().map(|p| p.read_bytes).collect();
    sizes.dedup();
    for size in sizes {
        let _ = write!(s, "  {:>9}", human_bytes(size));
        for d in &depths {
            match c
                .sequential
                .iter()
                .find(|p| p.read_bytes == size && p.queue_depth == *d)
            {
                Some(p) => {
                    let _ = write!(s, "   {:>7.2}", p.gb_per_s);
                }
                None => s.push_str("         -"),
            }
        }
        s.push('\n');
    }
    for r in &c.random {
        let _ = writeln!(
            s,
            "  random {:>9} at QD {}: {:>8.0} IOPS, {:.2} GB/s",
            human_bytes(r.read_bytes),
            r.queue_depth,
            r.iops,
            r.gb_per_s
        );
    }
    let _ = writeln!(s, "  best sequential: {:.2} GB/s", c.best_sequential_gb_per_s);
    s
}

fn human_bytes(b: usize) -> String {
    match b {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// The baseline's time for reads of these sizes at queue depth `qd`, seconds (sequential at the
/// nearest measured depth; random reads at the depth they were measured at).
fn baseline_time(b: &Baseline, sizes: &[usize], qd: usize) -> f64 {
    let seq = b
        .sequential_by_queue_depth
        .iter()
        .min_by_key(|x| x.0.abs_diff(qd))
        .map_or(b.sequential_1mib_gb_per_s, |x| x.1);
    sizes
        .iter()
        .map(|&s| {
            if s >= 1 << 20 || b.random.is_empty() {
                s as f64 / (seq * 1e9)
            } else {
                // The measured size at or below this read (the smallest if none is below).
                let r = b
                    .random
                    .iter()
                    .filter(|r| r.read_bytes <= s)
                    .max_by_key(|r| r.read_bytes)
                    .unwrap_or(&b.random[0]);
                // Per-request cost plus the extra bytes at that size's bandwidth.
                1.0 / r.iops + (s.saturating_sub(r.read_bytes)) as f64 / (r.gb_per_s * 1e9)
            }
        })
        .sum()
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Replays one transfer (`trace` None = dense) with one engine.
#[allow(clippy::too_many_arguments)]
fn replay(
    path: &Path,
    layers: &[LayerGeometry],
    ffn: usize,
    e: EngineConfig,
    trace: Option<&Trace>,
    tokens: usize,
    opts: &BenchOptions,
    cost: &CostModel,
    baseline: &Baseline,
) -> Result<Pass> {
    if e.engine == "mmap" {
        drop_file_cache(path);
    }
    let reader = open(path, e)?;
    // Plan at this engine's own granularity (whole pages for mmap, the direct-I/O block otherwise).
    let cost = &CostModel {
        align_bytes: reader.align_bytes().max(1) as u64,
        ..*cost
    };
    let n_layers = layers.len();
    let mut caches: Vec<LayerCache> = (0..n_layers)
        .map(|_| LayerCache::new(CachePolicy::Lru, ffn, opts.cache_neurons, 0, 0))
        .collect();
    let chunk = 1 << 20;
    let (mut needed, mut device, mut reads, mut lookups, mut hits) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut layer_bytes = vec![0f64; n_layers];
    let mut layer_s = vec![0f64; n_layers];
    let mut completions = Vec::new();
    let mut sizes = Vec::new();
    let mut total_s = 0.0;
    let all: Vec<u32> = (0..ffn as u32).collect();
    let mut planned = Vec::new();
    let mut token_ranges = Vec::new();
    for t in 0..tokens {
        for (l, g) in layers.iter().enumerate() {
            let mut ranges = Vec::new();
            let mut dev = 0u64;
            if opts.gate_streamed {
                let gate = g.gate.range_of(ffn);
                chunks(gate, chunk, &mut ranges);
                needed += gate.len_bytes as u64;
                dev += gate.len_bytes as u64;
            }
            let (up_set, down_set) = match trace {
                None => (&all, &all),
                Some(tr) => (&tr.records[t][l].up, &tr.records[t][l].down),
            };
            match trace {
                None => {
                    // Whole sections: up and down rows are contiguous runs of the file.
                    let mut spans = vec![g.up.range_of(ffn), g.down.range_of(ffn)];
                    spans.sort_unstable_by_key(|r| (r.offset_bytes, r.len_bytes));
                    spans.dedup();
                    for r in spans {
                        chunks(r, chunk, &mut ranges);
                        dev += r.len_bytes as u64;
                    }
                    needed += (ffn * (g.up.row_bytes() + g.down.row_bytes())) as u64;
                }
                Some(_) => {
                    let step = t as u64 + 1;
                    let mut spans = Vec::new();
                    let mut misses = Vec::new();
                    let mut union: Vec<u32> = up_set.iter().chain(down_set.iter()).copied().collect();
                    union.sort_unstable();
                    union.dedup();
                    for &n in &union {
                        lookups += 1;
                        if caches[l].get(n, step).is_some() {
                            hits += 1;
                            continue;
                        }
                        misses.push(n);
                        if up_set.binary_search(&n).is_ok() {
                            spans.push(g.up.extent(n));
                        }
                        if down_set.binary_search(&n).is_ok() {
                            spans.push(g.down.extent(n));
                        }
                    }
                    spans.sort_unstable();
                    let totals = plan(&spans, cost, &mut planned);
                    needed += totals.needed_bytes;
                    dev += totals.device_bytes;
                    ranges.extend(planned.iter().map(|p| p.range));
                    for n in misses {
                        if down_set.binary_search(&n).is_ok() {
                            caches[l].offer(n, &[], &[], step);
                        }
                    }
                }
            }
            sizes.extend(ranges.iter().map(|r| r.len_bytes));
            reads += ranges.len() as u64;
            if opts.token_batches {
                token_ranges.extend(ranges);
            } else {
                let s = timed_batch(reader.as_ref(), &ranges, &mut completions)?;
                total_s += s;
                layer_s[l] += s;
            }
            layer_bytes[l] += dev as f64;
            device += dev;
        }
        if opts.token_batches {
            total_s += timed_batch(reader.as_ref(), &token_ranges, &mut completions)?;
            token_ranges.clear();
        }
    }
    let tok = tokens.max(1) as f64;
    let stats = reader.stats();
    // The reader's own count includes alignment widening; the plan's is what was asked.
    let device_measured = stats.bytes_device.max(device);
    Ok(Pass {
        engine: e,
        transfer: trace.map_or("dense".into(), |t| t.header.mask.clone()),
        tokens,
        needed_bytes_per_token: needed as f64 / tok,
        device_bytes_per_token: device_measured as f64 / tok,
        reads_per_token: reads as f64 / tok,
        seconds_per_token: total_s / tok,
        device_gb_per_s: device_measured as f64 / total_s.max(1e-9) / 1e9,
        iops: reads as f64 / total_s.max(1e-9),
        completion_p50_us: percentile(&mut completions, 0.5),
        completion_p99_us: percentile(&mut completions, 0.99),
        read_amplification: device_measured as f64 / needed.max(1) as f64,
        cache_hit_rate: if lookups > 0 { hits as f64 / lookups as f64 } else { 0.0 },
        fraction_of_baseline: baseline_time(baseline, &sizes, e.queue_depth) / total_s.max(1e-9),
        layer_bytes: layer_bytes.iter().map(|b| b / tok).collect(),
        layer_ms: layer_s.iter().map(|s| s * 1e3 / tok).collect(),
    })
}

/// Runs the benchmark: the device baseline, then every engine × (dense + each trace).
pub fn bench(
    path: &Path,
    traces: &[Trace],
    opts: &BenchOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<BenchReport> {
    let g = GstFile::open(path)?;
    let c = g.index.config.clone();
    for t in traces {
        if t.header.ffn != c.ffn || t.header.n_layers != c.n_layers {
            return Err(Error::Input(format!(
                "trace of {} ({} layers x {} neurons) does not fit {} ({} x {})",
                t.header.model,
                t.header.n_layers,
                t.header.ffn,
                path.display(),
                c.n_layers,
                c.ffn
            )));
        }
        if t.header.tokens == 0 {
            return Err(Error::Input(format!("trace of {} holds no tokens", t.header.model)));
        }
    }
    let layers = geometry(&g)?;
    let file_bytes = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
    let probe_reader = open(
        path,
        EngineConfig {
            engine: "uring",
            queue_depth: 64,
            fixed_buffers: true,
        },
    )?;
    let align = probe_reader.align_bytes();
    let mut cost = crate::stream::plan::probe(probe_reader.as_ref(), 1024, 32 << 20, 256 << 10, 256 << 10)?;
    if let Some(gap) = opts.merge_gap_bytes {
        cost.request_us = gap as f64 / cost.bytes_per_us;
    }
    drop(probe_reader);
    let total = 1 + opts.engines.len() * (1 + traces.len());
    progress("baseline", 0, total);
    let baseline = measure_baseline(path, file_bytes, opts)?;
    let mut passes = Vec::new();
    let mut done = 1;
    for &e in &opts.engines {
        for t in std::iter::once(None).chain(traces.iter().map(Some)) {
            progress(e.engine, done, total);
            let tokens = opts.tokens.min(t.map_or(usize::MAX, |t| t.header.tokens)).max(1);
            passes.push(replay(path, &layers, c.ffn, e, t, tokens, opts, &cost, &baseline)?);
            done += 1;
        }
    }
    progress("done", total, total);
    Ok(BenchReport {
        setup: Setup {
            kernel: kernel(),
            file: path.to_path_buf(),
            file_bytes,
            model: g.index.source.file_name.clone(),
            direct_io_align_bytes: align,
            cost_model: cost,
            gate_streamed: opts.gate_streamed,
            cache_neurons_per_layer: opts.cache_neurons,
            traces: traces.iter().map(|t| t.header.clone()).collect(),
        },
        baseline,
        passes,
        link: None,
    })
}

/// The host-to-device link's bandwidth by copy size, pageable and pinned (`bench --device cuda`).
pub fn link_table(rows: &[crate::backend::LinkBandwidth]) -> String {
    use std::fmt::Write;
    let mut s = String::from("host-to-device copies    pageable GB/s   pinned GB/s   pinned/pageable\n");
    for r in rows {
        let size = if r.bytes >= 1 << 20 {
            format!("{} MiB", r.bytes >> 20)
        } else {
            format!("{} KiB", r.bytes >> 10)
        };
        let _ = writeln!(
            s,
            "  {size:>8} x {:<4}      {:>13.2}   {:>11.2}   {:>15.2}",
            r.copies,
            r.pageable_gb_per_s,
            r.pinned_gb_per_s,
            r.pinned_gb_per_s / r.pageable_gb_per_s.max(1e-12)
        );
    }
    s
}

/// The readable table.
pub fn table(r: &BenchReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let b = &r.baseline;
    let _ = writeln!(
        s,
        "{} ({:.1} MB), kernel {}, direct-I/O alignment {} B; gate {} in both transfers",
        r.setup.file.display(),
        r.setup.file_bytes as f64 / 1e6,
        r.setup.kernel,
        r.setup.direct_io_align_bytes,
        if r.setup.gate_streamed {
            "read in full"
        } else {
            "left out"
        }
    );
    let _ = write!(s, "device baseline (uring): sequential 1 MiB");
    for (qd, g) in &b.sequential_by_queue_depth {
        let _ = write!(s, " {g:.2} GB/s at QD {qd},");
    }
    let _ = write!(s, " random at QD {}:", b.random.first().map_or(0, |r| r.queue_depth));
    for x in &b.random {
        let _ = write!(
            s,
            " {} KiB {:.0} IOPS ({:.2} GB/s);",
            x.read_bytes / 1024,
            x.iops,
            x.gb_per_s
        );
    }
    let _ = writeln!(
        s,
        "\nplanner: {:.1} µs per request, {:.0} MB/s → gaps under {:.1} KB read through",
        r.setup.cost_model.request_us,
        r.setup.cost_model.bytes_per_us,
        r.setup.cost_model.merge_gap_bytes() as f64 / 1e3
    );
    let _ = writeln!(
        s,
        "{:<6} {:>3} {:>5} {:<24} {:>9} {:>9} {:>8} {:>8} {:>6} {:>7} {:>8} {:>8} {:>5} {:>6}",
        "engine",
        "QD",
        "fixed",
        "transfer",
        "need MB",
        "disk MB",
        "reads",
        "ms/tok",
        "GB/s",
        "IOPS",
        "p50 µs",
        "p99 µs",
        "amp",
        "vs dev"
    );
    for p in &r.passes {
        let _ = writeln!(
            s,
            "{:<6} {:>3} {:>5} {:<24} {:>9.1} {:>9.1} {:>8.0} {:>8.1} {:>6.2} {:>7.0} {:>8.0} {:>8.0} {:>5.2} {:>6.2}",
            p.engine.engine,
            p.engine.queue_depth,
            if p.engine.fixed_buffers { "on" } else { "off" },
            p.transfer,
            p.needed_bytes_per_token / 1e6,
            p.device_bytes_per_token / 1e6,
            p.reads_per_token,
            p.seconds_per_token * 1e3,
            p.device_gb_per_s,
            p.iops,
            p.completion_p50_us,
            p.completion_p99_us,
            p.read_amplification,
            p.fraction_of_baseline
        );
    }
    // Sparse vs dense per engine.
    for e in r.passes.iter().filter(|p| p.transfer == "dense") {
        for p in r
            .passes
            .iter()
            .filter(|p| p.engine == e.engine && p.transfer != "dense")
        {
            let _ = writeln!(
                s,
                "{} QD{}: {} / dense = {:.3}x disk bytes, {:.3}x time per token",
                p.engine.engine,
                p.engine.queue_depth,
                p.transfer,
                p.device_bytes_per_token / e.device_bytes_per_token.max(1.0),
                p.seconds_per_token / e.seconds_per_token.max(1e-12)
            );
        }
    }
    s
}

/// Three charts in one SVG: per-layer device bytes and time per token, dense vs each sparse
/// trace (the deepest-queue io_uring pass); and io_uring throughput against queue depth.
pub fn plot(r: &BenchReport) -> String {
    use crate::plot::{Chart, Series};
    let uring: Vec<&Pass> = r.passes.iter().filter(|p| p.engine.engine == "uring").collect();
    let best_qd = uring.iter().map(|p| p.engine.queue_depth).max().unwrap_or(0);
    let deepest: Vec<&&Pass> = uring
        .iter()
        .filter(|p| p.engine.queue_depth == best_qd && p.engine.fixed_buffers)
        .collect();
    let by_layer = |f: &dyn Fn(&Pass) -> &Vec<f64>, scale: f64| -> Vec<Series> {
        deepest
            .iter()
            .map(|p| Series {
                name: p.transfer.clone(),
                points: f(p).iter().enumerate().map(|(l, &v)| (l as f64, v * scale)).collect(),
            })
            .collect()
    };
    let bytes = Chart {
        title: "device MB per token by layer (io_uring, deepest queue)",
        x_label: "layer",
        y_label: "MB per token",
        series: by_layer(&|p| &p.layer_bytes, 1e-6),
    };
    let per_layer = Chart {
        title: "time per token by layer (io_uring, deepest queue)",
        x_label: "layer",
        y_label: "ms per token",
        series: by_layer(&|p| &p.layer_ms, 1.0),
    };
    // One line per transfer over the io_uring queue-depth sweep (pread, mmap and unregistered
    // buffers run at one depth each; their figures are in the table and JSON).
    let mut series: Vec<Series> = Vec::new();
    for p in r
        .passes
        .iter()
        .filter(|p| p.engine.engine == "uring" && p.engine.fixed_buffers)
    {
        let name = p.transfer.clone();
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push((p.engine.queue_depth as f64, p.device_gb_per_s)),
            None => series.push(Series {
                name,
                points: vec![(p.engine.queue_depth as f64, p.device_gb_per_s)],
            }),
        }
    }
    let qd = Chart {
        title: "io_uring device throughput vs queue depth",
        x_label: "queue depth",
        y_label: "GB/s",
        series,
    };
    let h = 560;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"900\" height=\"{}\">\n",
        3 * h
    );
    for (i, c) in [bytes, per_layer, qd].iter().enumerate() {
        out += &format!("<svg y=\"{}\">{}</svg>\n", i * h, strip_xml_decl(&c.svg()));
    }
    out + "</svg>\n"
}

fn strip_xml_decl(s: &str) -> &str {
    s.strip_prefix("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n")
        .unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_table_gives_each_size_both_kinds_and_their_ratio() {
        use crate::backend::LinkBandwidth;
        let rows = [
            LinkBandwidth {
                bytes: 64 << 10,
                pageable_gb_per_s: 2.0,
                pinned_gb_per_s: 5.0,
                copies: 1000,
            },
            LinkBandwidth {
                bytes: 16 << 20,
                pageable_gb_per_s: 10.0,
                pinned_gb_per_s: 25.0,
                copies: 16,
            },
        ];
        let t = link_table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(
            lines[1].contains("64 KiB") && lines[1].contains("2.00") && lines[1].contains("5.00"),
            "{t}"
        );
        assert!(
            lines[2].contains("16 MiB") && lines[2].trim_end().ends_with("2.50"),
            "{t}"
        );
    }

    #[test]
    fn baseline_time_uses_the_nearest_size_below() {
        let b = Baseline {
            engine: "uring",
            sequential_1mib_gb_per_s: 2.0,
            sequential_queue_depth: 64,
            sequential_by_queue_depth: vec![(1, 4.0), (64, 2.0)],
            random: vec![
                RandomBaseline {
                    read_bytes: 4096,
                    queue_depth: 64,
                    iops: 1000.0,
                    gb_per_s: 0.004,
                },
                RandomBaseline {
                    read_bytes: 65536,
                    queue_depth: 64,
                    iops: 100.0,
                    gb_per_s: 0.0065,
                },
            ],
        };
        assert!((baseline_time(&b, &[4096], 64) - 1e-3).abs() < 1e-12);
        assert!((baseline_time(&b, &[65536, 65536], 64) - 2e-2).abs() < 1e-12);
        assert!((baseline_time(&b, &[2 << 20], 64) - (2 << 20) as f64 / 2e9).abs() < 1e-12);
        // Sequential reads at the nearest measured queue depth.
        assert!((baseline_time(&b, &[2 << 20], 2) - (2 << 20) as f64 / 4e9).abs() < 1e-12);
        // Smaller than every measured size: the smallest one's rate.
        assert!((baseline_time(&b, &[512], 64) - 1e-3).abs() < 1e-12);
    }
}
