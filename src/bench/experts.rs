//! `gatestream bench` on a mixture-of-experts `.gst`: routing traces replayed against the file
//! through the streamer's own expert cache (`stream::experts`, the code `run --ram-budget` runs,
//! with nothing computed), for each reader engine, cache policy and cache size — so LRU and the
//! frequency-aware policy are compared on the same routing, and the time per token is the I/O
//! alone. Tokens are replayed one at a time, as decoding reads them; no lookahead.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::trace::{RouteHeader, RouteTrace};
use super::{drop_file_cache, measure_baseline, open, BenchOptions, EngineConfig};
use crate::error::{Error, Result};
use crate::model::weights::LayerFfn;
use crate::model::{LoadOptions, Model, Placement};
use crate::stream::cache::CachePolicy;
use crate::stream::experts::{ExpertPart, ExpertPlan, ExpertStream};
use crate::stream::prefetch::Prefetcher;
use crate::stream::report::Counters;

/// One replay: an engine, a routing trace, a cache policy and size.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ExpertPass {
    pub engine: EngineConfig,
    /// The trace's description (its mask, its text).
    pub trace: String,
    /// `lru` or `frequency`; `none` with no cache.
    pub policy: &'static str,
    pub cache_experts: usize,
    pub tokens: usize,
    /// (layer, expert) pairs routed to per token, and how many of them were read from disk.
    pub experts_routed_per_token: f64,
    pub experts_read_per_token: f64,
    pub cache_hit_rate: f64,
    /// Bytes the replay asked for, and what the device transferred (alignment included).
    pub needed_bytes_per_token: f64,
    pub device_bytes_per_token: f64,
    pub seconds_per_token: f64,
    pub device_gb_per_s: f64,
    /// The sequential baseline's time for the bytes read, over the measured time (1.0: as fast
    /// as the device reads large sequential runs).
    pub fraction_of_baseline: f64,
}

/// Cache sizes, policies and what is replayed.
#[derive(Clone, Debug)]
pub struct ExpertBenchOptions {
    /// Experts the cache holds, each size replayed with every policy (0: no cache, once).
    pub cache_experts: Vec<usize>,
    pub policies: Vec<CachePolicy>,
}

fn policy_name(p: CachePolicy, slots: usize) -> &'static str {
    match (slots, p) {
        (0, _) => "none",
        (_, CachePolicy::Frequency) => "frequency",
        _ => "lru",
    }
}

/// The experts' places in a `.gst` file, per layer; the model (views of the file) they come from.
fn expert_parts(path: &Path) -> Result<(Model, Vec<Vec<ExpertPart>>)> {
    crate::gstfile::GstFile::open(path).map_err(|e| {
        Error::Input(format!(
            "{}: bench replays routing traces against a .gst file (gatestream reformat MODEL.gguf MODEL.gst): {e}",
            path.display()
        ))
    })?;
    let model = Model::load(
        path,
        &LoadOptions {
            threads: 1,
            placement: Placement::OnDisk,
            experts_used: None,
        },
    )?;
    let mut parts = Vec::with_capacity(model.config.n_layers);
    if model.config.moe.is_none() {
        return Err(Error::Input(format!(
            "{}: a dense model; routing traces replay mixture-of-experts files",
            path.display()
        )));
    }
    for lw in &model.weights.layers {
        parts.push(match &lw.ffn {
            LayerFfn::Experts(e) => e.experts.iter().map(ExpertPart::of).collect::<Result<Vec<_>>>()?,
            // A leading dense layer: no experts (its trace routes none).
            LayerFfn::Dense(_) => Vec::new(),
        });
    }
    Ok((model, parts))
}

/// Replays `trace`'s first `tokens` tokens with one engine, policy and cache size.
#[allow(clippy::too_many_arguments)]
fn replay(
    path: &Path,
    model: &Model,
    parts: &[Vec<ExpertPart>],
    e: EngineConfig,
    trace: &RouteTrace,
    tokens: usize,
    policy: CachePolicy,
    slots: usize,
    baseline: &super::Baseline,
) -> Result<ExpertPass> {
    let layers: Vec<&LayerFfn> = model.weights.layers.iter().map(|lw| &lw.ffn).collect();
    // Routers and shared experts stay views of the file: the replay never computes.
    let xs = ExpertStream::new(
        &layers,
        parts.to_vec(),
        &|w| Ok(w.clone()),
        ExpertPlan {
            policy,
            cache_slots: slots,
            lookahead: false,
            n_used: trace.header.n_used,
            link: None,
        },
    )?;
    if e.engine == "mmap" {
        drop_file_cache(path);
    }
    let reader = open(path, e)?;
    // Unused without lookahead; the cache's code takes one.
    let prefetcher = Prefetcher::start(Arc::from(open(path, e)?), 1 << 20)?;
    let max_read_bytes = 1 << 20;
    let mut counters = Counters::default();
    let mut seconds = 0.0;
    let mut ids = Vec::new();
    for t in &trace.records[..tokens] {
        for (l, chosen) in t.iter().enumerate() {
            // As the forward pass asks: each routed expert once, in expert order.
            ids.clear();
            ids.extend(chosen.iter().map(|&x| x as usize));
            ids.sort_unstable();
            ids.dedup();
            let t0 = Instant::now();
            xs.run(
                l,
                &ids,
                reader.as_ref(),
                &prefetcher,
                max_read_bytes,
                &mut counters,
                &mut |_, _| Ok(()),
            )?;
            seconds += t0.elapsed().as_secs_f64();
        }
    }
    let tok = tokens.max(1) as f64;
    let device = reader.stats().bytes_device.max(counters.ffn_needed_bytes);
    let seq = baseline.sequential_1mib_gb_per_s.max(1e-9);
    Ok(ExpertPass {
        engine: e,
        trace: trace.header.mask.clone(),
        policy: policy_name(policy, slots),
        cache_experts: slots,
        tokens,
        experts_routed_per_token: counters.cache_lookups as f64 / tok,
        experts_read_per_token: counters.ffn_reads as f64 / tok,
        cache_hit_rate: if counters.cache_lookups > 0 {
            counters.cache_hits as f64 / counters.cache_lookups as f64
        } else {
            0.0
        },
        needed_bytes_per_token: counters.ffn_needed_bytes as f64 / tok,
        device_bytes_per_token: device as f64 / tok,
        seconds_per_token: seconds / tok,
        device_gb_per_s: device as f64 / seconds.max(1e-9) / 1e9,
        fraction_of_baseline: device as f64 / (seq * 1e9) / seconds.max(1e-9),
    })
}

/// What a mixture-of-experts bench measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ExpertBenchReport {
    /// `bench --device cuda`: the host-to-device link, measured in the same run.
    pub link: Option<Vec<crate::backend::LinkBandwidth>>,
    pub kernel: String,
    pub file: std::path::PathBuf,
    pub file_bytes: u64,
    pub n_layers: usize,
    pub n_experts: usize,
    /// Bytes of one expert's section (the largest).
    pub expert_bytes: u64,
    pub traces: Vec<RouteHeader>,
    pub baseline: super::Baseline,
    pub passes: Vec<ExpertPass>,
}

/// Runs the benchmark: the device baseline, then every engine × trace × cache size × policy.
pub fn bench_experts(
    path: &Path,
    traces: &[RouteTrace],
    opts: &BenchOptions,
    x: &ExpertBenchOptions,
    progress: &mut dyn FnMut(&str, usize, usize),
) -> Result<ExpertBenchReport> {
    let (model, parts) = expert_parts(path)?;
    let moe = model.config.moe.clone().expect("a mixture-of-experts model");
    for t in traces {
        let h = &t.header;
        if h.n_layers != model.config.n_layers || h.n_experts != moe.n_experts {
            return Err(Error::Input(format!(
                "routing trace of {} ({} layers x {} experts) does not fit {} ({} x {})",
                h.model,
                h.n_layers,
                h.n_experts,
                path.display(),
                model.config.n_layers,
                moe.n_experts
            )));
        }
        if h.tokens == 0 {
            return Err(Error::Input(format!("routing trace of {} holds no tokens", h.model)));
        }
    }
    let total_experts = model.config.expert_layers() * moe.n_experts;
    if let Some(&n) = x.cache_experts.iter().find(|&&n| n > total_experts) {
        return Err(Error::Input(format!(
            "--cache-experts {n}: the model has {total_experts} experts ({} layers of experts x {})",
            model.config.expert_layers(),
            moe.n_experts
        )));
    }
    let mut runs: Vec<(CachePolicy, usize)> = Vec::new();
    for &n in &x.cache_experts {
        for &p in &x.policies {
            let p = if n == 0 { CachePolicy::Lru } else { p };
            if !runs.contains(&(p, n)) {
                runs.push((p, n));
            }
        }
    }
    let file_bytes = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
    let total = 1 + opts.engines.len() * traces.len() * runs.len();
    progress("baseline", 0, total);
    let baseline = measure_baseline(path, file_bytes, opts)?;
    let mut passes = Vec::new();
    let mut done = 1;
    for &e in &opts.engines {
        for t in traces {
            for &(policy, slots) in &runs {
                progress(e.engine, done, total);
                // Every replay starts as a fresh process does: the freed cache of the one before
                // goes back to the system, so each pays for first touching its own (else the
                // second policy at a size reuses the first's pages and looks faster).
                crate::stream::release_free_memory();
                let tokens = opts.tokens.min(t.header.tokens).max(1);
                passes.push(replay(path, &model, &parts, e, t, tokens, policy, slots, &baseline)?);
                done += 1;
            }
        }
    }
    progress("done", total, total);
    Ok(ExpertBenchReport {
        kernel: super::kernel(),
        file: path.to_path_buf(),
        file_bytes,
        n_layers: model.config.n_layers,
        n_experts: moe.n_experts,
        expert_bytes: parts.iter().flatten().map(|p| p.len_bytes() as u64).max().unwrap_or(0),
        traces: traces.iter().map(|t| t.header.clone()).collect(),
        baseline,
        passes,
        link: None,
    })
}

/// The readable table.
pub fn table(r: &ExpertBenchReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} ({:.1} MB), kernel {}: {} layers x {} experts of {:.2} MB; routing traces replayed token by token, no compute",
        r.file.display(),
        r.file_bytes as f64 / 1e6,
        r.kernel,
        r.n_layers,
        r.n_experts,
        r.expert_bytes as f64 / 1e6
    );
    for t in &r.traces {
        let _ = writeln!(
            s,
            "trace: {} tokens, {} experts per token and layer ({})",
            t.tokens, t.n_used, t.mask
        );
    }
    let _ = writeln!(
        s,
        "device baseline (uring): sequential 1 MiB {:.2} GB/s at QD {}",
        r.baseline.sequential_1mib_gb_per_s, r.baseline.sequential_queue_depth
    );
    let _ = writeln!(
        s,
        "{:<6} {:>3} {:>5} {:<10} {:>7} {:>7} {:>7} {:>6} {:>8} {:>8} {:>6} {:>6} {:>7}",
        "engine",
        "QD",
        "fixed",
        "cache",
        "experts",
        "routed",
        "read",
        "hits",
        "disk MB",
        "ms/tok",
        "GB/s",
        "vs dev",
        "tokens"
    );
    for p in &r.passes {
        let _ = writeln!(
            s,
            "{:<6} {:>3} {:>5} {:<10} {:>7} {:>7.1} {:>7.1} {:>5.1}% {:>8.1} {:>8.2} {:>6.2} {:>6.2} {:>7}",
            p.engine.engine,
            p.engine.queue_depth,
            if p.engine.fixed_buffers { "on" } else { "off" },
            p.policy,
            p.cache_experts,
            p.experts_routed_per_token,
            p.experts_read_per_token,
            p.cache_hit_rate * 100.0,
            p.device_bytes_per_token / 1e6,
            p.seconds_per_token * 1e3,
            p.device_gb_per_s,
            p.fraction_of_baseline,
            p.tokens
        );
    }
    s
}

/// Disk bytes per token against the expert cache's size, one line per policy and trace (the
/// deepest-queue io_uring passes with registered buffers, else the first engine's), as an SVG.
pub fn plot(r: &ExpertBenchReport) -> String {
    use crate::plot::{Chart, Series};
    let uring = |p: &&ExpertPass| p.engine.engine == "uring" && p.engine.fixed_buffers;
    let deepest = r.passes.iter().filter(uring).map(|p| p.engine.queue_depth).max();
    let engine = match deepest {
        Some(qd) => r
            .passes
            .iter()
            .find(|p| uring(p) && p.engine.queue_depth == qd)
            .map(|p| p.engine),
        None => r.passes.first().map(|p| p.engine),
    };
    let mut series: Vec<Series> = Vec::new();
    for p in r.passes.iter().filter(|p| Some(p.engine) == engine) {
        // The no-cache pass starts every policy's line.
        let policies: Vec<&str> = if p.policy == "none" {
            vec!["lru", "frequency"]
        } else {
            vec![p.policy]
        };
        for policy in policies {
            let name = format!("{policy} ({})", p.trace);
            let point = (p.cache_experts as f64, p.device_bytes_per_token / 1e6);
            match series.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push(point),
                None => series.push(Series {
                    name,
                    points: vec![point],
                }),
            }
        }
    }
    for s in &mut series {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Chart {
        title: "disk MB per token vs expert cache size (routing traces replayed)",
        x_label: "experts cached",
        y_label: "disk MB per token",
        series,
    }
    .svg()
}
