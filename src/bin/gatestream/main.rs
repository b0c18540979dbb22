//! The `gatestream` command line: parses arguments, calls the library, prints. Nothing here
//! computes; everything it does is a library call tests can make too.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;

use gatestream::backend::cpu::CpuBackend;
use gatestream::backend::Device;
use gatestream::bench::trace::AnyTrace;
use gatestream::io::ReaderOptions;
use gatestream::model::generate::GenerateOptions;
use gatestream::model::sampler::SamplerConfig;
use gatestream::perplexity::{perplexity_with, PerplexityOptions};
use gatestream::runtime::{KvPositions, OpenOptions, Outcome, SparseAsk, StreamAsk};
use gatestream::sparsity::Masker;
use gatestream::stream::cache::CachePolicy;
use gatestream::stream::residency::{BudgetSize, Priority};
use gatestream::stream::CostSource;

mod args;
mod bench_cmd;
mod files_cmd;
mod generate_cmd;
mod make;
mod output;
mod quality_cmd;
mod serve_cmd;

use args::*;
use output::*;

/// Set by the first Ctrl-C during `run`: generation stops before the next layer (well within a
/// second) and the run prints what it generated and its figures; a second Ctrl-C quits at once.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Exit status of a run stopped by Ctrl-C (128 + SIGINT, as shells report it).
const EXIT_INTERRUPTED: u8 = 130;

fn stop_on_ctrl_c() {
    let installed = ctrlc::set_handler(|| {
        if INTERRUPTED.swap(true, Ordering::SeqCst) {
            std::process::exit(EXIT_INTERRUPTED.into());
        }
        eprintln!("\ninterrupted: stopping after the current layer (Ctrl-C again to quit at once)");
    });
    if let Err(e) = installed {
        eprintln!("warning: Ctrl-C will end the process without printing what was generated ({e})");
    }
}

/// Stores the frontier of eval `rows` at the quality budget in the .gst `target` (which must
/// be the evaluated model, or made from it).
fn store_frontier(
    rows: &[gatestream::eval::EvalRow],
    max_ppl_increase: f64,
    text: &str,
    windows: usize,
    ctx: usize,
    evaluated: &std::path::Path,
    target: &std::path::Path,
) -> anyhow::Result<()> {
    if !gatestream::gstfile::is_gst(target) {
        anyhow::bail!(
            "{}: not a .gst file; the recommendation is stored in a .gst (gatestream reformat)",
            target.display()
        );
    }
    let Some(r) = gatestream::eval::recommendation(rows, max_ppl_increase, text, windows, ctx) else {
        anyhow::bail!("no sparse configuration is within +{max_ppl_increase}% perplexity; nothing stored");
    };
    let best = &rows[gatestream::eval::frontier(rows, max_ppl_increase)];
    if !gatestream::eval::runnable(best) {
        eprintln!(
            "note: the frontier, {} {} at {} ({:.3} of dense FFN bytes), is not stored: `run --strategy threshold` uses the exact-score thresholds `calibrate` stores",
            best.strategy.map_or("dense", |s| s.name()),
            best.criterion.map_or("dense", |c| c.name()),
            level(best.sparsity),
            best.ffn_bytes_rel_dense
        );
    }
    let what = format!(
        "{} {} at {}{} ({:+.2}% perplexity, {:.3} of dense FFN bytes)",
        r.strategy,
        r.criterion,
        level(r.sparsity),
        if r.per_layer_sparsity.is_some() {
            " with per-layer levels"
        } else {
            ""
        },
        r.measured_ppl_increase_pct,
        r.ffn_bytes_rel_dense
    );
    let mut bar = Progress::new();
    gatestream::reformat::store_recommendation_from(target, evaluated, r, &mut |stage, d, n| bar.update(stage, d, n))?;
    eprintln!("stored in {}: {what}", target.display());
    Ok(())
}

/// Opens the model through the runtime (streamed when a budget is given, masked when `sparse`
/// is given), says what was assembled, and generates.
// The run's parts come from different argument groups; bundling them for one caller would only
// rename them.
#[allow(clippy::too_many_arguments)]
fn generate_one(
    device: &Arc<dyn Device>,
    args: &ModelArgs,
    sparse: Option<&SparseAsk>,
    stream: &StreamArgs,
    record_trace: Option<&std::path::Path>,
    draft: Option<(&std::path::Path, usize)>,
    prompt: &str,
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> anyhow::Result<Outcome> {
    gatestream::stream::reset_peak_rss();
    let path = model_path(args)?;
    let (stream_ask, placement) = stream_ask(stream, &path, prompt.len() + opts.max_tokens + 1, &**device)?;
    if let Some(d) = &placement {
        eprintln!("{}", d.describe());
    }
    let t = std::time::Instant::now();
    let rt = gatestream::runtime::open_on(
        &path,
        &OpenOptions {
            threads: args.threads,
            stream: stream_ask,
            sparse: sparse.cloned(),
            kv_positions: KvPositions::Prompt {
                prompt: prompt.to_string(),
                chat: opts.chat,
                extra: opts.max_tokens,
                ctx: opts.ctx,
            },
            experts_used: args.experts_used,
        },
        device.clone(),
    )
    .map_err(|e| match &placement {
        Some(d) if d.placed != gatestream::placement::Placed::InRam => anyhow::Error::new(e).context(format!(
            "automatic placement streamed the model under what this process may use ({} {} bytes, less a \
             reserve): that is below what it needs; give it more memory, or --ram-budget with the minimum below \
             if the limit allows",
            d.memory.source, d.memory.limit_bytes
        )),
        _ => e.into(),
    })?;
    let mut rt = rt;
    if let Some((p, max)) = draft {
        rt.attach_draft(p, max)?;
    }
    let expected = describe(&rt, t.elapsed().as_secs_f64());
    let ids = rt.model.prompt_ids(prompt, opts.chat)?;
    // A gpt-oss chat reply: its reasoning (the analysis channel) goes to stderr as it is
    // written, its answer (the final channel) to `on_text`, the Harmony markers to neither.
    let mut harmony =
        (opts.chat && rt.model.tokenizer.chat_is_harmony()).then(gatestream::model::chat::HarmonySplit::new);
    let emit = |p: gatestream::model::chat::HarmonyPiece, on_text: &mut dyn FnMut(&str)| {
        if !p.reasoning.is_empty() {
            eprint!("{}", p.reasoning);
        }
        if !p.answer.is_empty() {
            on_text(&p.answer)
        }
    };
    let mut outcome = rt.generate(
        &ids,
        opts,
        record_trace.is_some(),
        Some(&INTERRUPTED),
        &mut |e| match harmony.as_mut() {
            _ if e.text.is_empty() => {}
            Some(split) => emit(split.push(e.text), on_text),
            None => on_text(e.text),
        },
    )?;
    if let Some(split) = harmony.as_mut() {
        emit(split.finish(), on_text);
    }
    outcome.placement = placement.map(|d| gatestream::placement::Decision { expected, ..d });
    if let (Some(t), Some(path)) = (&outcome.trace, record_trace) {
        t.write(path)?;
        eprintln!("\ntrace: {} written to {}", t.summary(), path.display());
    }
    Ok(outcome)
}

/// Automatic placement (`--ram-budget` absent or `auto`): in RAM or streamed, from the memory
/// this process may use and the model's size with a context of `context_positions` (its KV
/// cache and a batch's activations); on a GPU (`device` with memory of its own, `--vram-budget`
/// absent or `auto`), whether it holds the whole model or a budget of it, from its free memory.
/// None: an explicit budget (or `off`), or no memory figure to be had.
fn auto_placement(
    stream: &StreamArgs,
    path: &std::path::Path,
    context_positions: usize,
    device: Option<&dyn Device>,
) -> anyhow::Result<Option<gatestream::placement::Decision>> {
    if !matches!(stream.ram_budget, None | Some(RamBudget::Auto)) {
        return Ok(None);
    }
    let given = match std::env::var("GATESTREAM_MEMORY_LIMIT") {
        Ok(v) => Some(
            v.trim()
                .parse::<u64>()
                .map_err(|_| anyhow::anyhow!("GATESTREAM_MEMORY_LIMIT={v:?}: give a number of bytes"))?,
        ),
        Err(_) => None,
    };
    let Some(memory) = gatestream::placement::host_memory(given) else {
        return Ok(None);
    };
    let model_bytes = gatestream::model::model_bytes(path)?;
    let cfg = gatestream::model::open_config(path)?;
    let positions = context_positions.min(cfg.context_len.max(1));
    let context_bytes = gatestream::kv::KvCache::bytes_for(&cfg, positions)
        + 512 * gatestream::stream::activation_bytes_per_token(&cfg);
    let mut d = gatestream::placement::decide(model_bytes, context_bytes, &memory);
    let gpu = device.filter(|d| !d.host_memory());
    if let (Some(gpu), None | Some(VramBudget::Auto)) = (gpu, stream.vram_budget) {
        if let Some(free) = gpu.memory_free() {
            let weights = match d.placed {
                gatestream::placement::Placed::InRam => model_bytes,
                gatestream::placement::Placed::Streamed { budget_bytes } => budget_bytes.min(model_bytes),
            };
            d.gpu = Some(gatestream::placement::decide_gpu(weights, context_bytes, free));
        }
    }
    Ok(Some(d))
}

/// What `--ram-budget`, `--vram-budget` and the other streaming flags ask for (None: in RAM),
/// and what automatic placement chose when no budget was given (`context_positions`: the KV
/// cache's positions, for its share).
fn stream_ask(
    stream: &StreamArgs,
    path: &std::path::Path,
    context_positions: usize,
    device: &dyn Device,
) -> anyhow::Result<(Option<StreamAsk>, Option<gatestream::placement::Decision>)> {
    use gatestream::placement::{GpuPlaced, Placed};
    let decision = auto_placement(stream, path, context_positions, Some(device))?;
    let auto_vram = match decision.as_ref().and_then(|d| d.gpu.as_ref()) {
        Some(gatestream::placement::GpuDecision {
            placed: GpuPlaced::Budget { budget_bytes },
            ..
        }) => Some(*budget_bytes),
        _ => None,
    };
    let budget = match (stream.ram_budget, &decision) {
        (Some(RamBudget::Off), _) => None,
        (Some(RamBudget::Size(b)), _) => Some(b.bytes(gatestream::model::model_bytes(path)?)),
        (
            _,
            Some(gatestream::placement::Decision {
                placed: Placed::Streamed { budget_bytes },
                ..
            }),
        ) => Some(*budget_bytes),
        _ => None,
    };
    let explicit_vram = match stream.vram_budget {
        Some(VramBudget::Size(v)) => Some(v),
        _ => None,
    };
    if budget.is_none() && explicit_vram.is_none() && auto_vram.is_none() {
        return Ok((None, decision));
    }
    let file_bytes = gatestream::model::model_bytes(path)?;
    Ok((
        Some(StreamAsk {
            // Only a GPU budget: the whole model in host RAM, streamed from there.
            budget_bytes: budget.unwrap_or(gatestream::stream::RAM_UNLIMITED),
            vram_budget_bytes: match explicit_vram {
                Some(v) => Some(v.bytes(file_bytes)),
                None => auto_vram,
            },
            prefetch_buffers: stream.read_ahead as usize + 1,
            prefetch_read_bytes: stream.read_bytes.unwrap_or(0),
            engine: engine_of(stream.io),
            reader: ReaderOptions {
                queue_depth: stream.queue_depth,
                ..ReaderOptions::default()
            },
            cache: stream.cache.map(|c| match c {
                CacheArg::Lru => CachePolicy::Lru,
                CacheArg::Pinned => CachePolicy::Pinned,
                CacheArg::Frequency => CachePolicy::Frequency,
            }),
            priority: match stream.residency {
                ResidencyArg::GateFirst => Priority::GateFirst,
                ResidencyArg::CacheFirst => Priority::CacheFirst,
            },
            merge_gap_bytes: stream.merge_gap_bytes,
            cost: cost_source(&stream.cost_model)?,
            lookahead: stream.lookahead,
            batch_tokens_max: 0,
            hybrid: stream.hybrid.mode(),
        }),
        decision,
    ))
}

/// Says what was loaded (`load_s`: seconds since opening began), what the stream keeps and
/// reads, what it should give (measured now: [`expected`]), and the mask.
fn describe(rt: &gatestream::runtime::Runtime, load_s: f64) -> Option<gatestream::placement::Expected> {
    print_loaded(&rt.model, load_s - rt.stream_open_s);
    for w in &rt.warnings {
        eprintln!("warning: {w}");
    }
    if let Some(d) = &rt.draft {
        let c = &d.model.config;
        eprintln!(
            "draft model {} ({}, {} layers, hidden {}): up to {} drafts per pass",
            d.model.path.display(),
            c.arch.name(),
            c.n_layers,
            c.hidden,
            d.max
        );
    }
    if let Some(s) = &rt.stream {
        let r = &s.residency;
        let mb = |b: u64| b as f64 / 1e6;
        if let Some(x) = &s.experts {
            eprintln!(
                "streaming under {:.1} MB ({:.2} s to load what is resident): attention {:.1} MB, routers, shared \
                 experts, dense FFNs, norms and output {:.1} MB, buffers {:.1} MB, KV cache + batch {:.1} MB, {} expert cache of \
                 {} of {} experts ({:.1} MB){}",
                mb(r.budget_bytes),
                rt.stream_open_s,
                mb(r.attention_bytes),
                mb(r.required_bytes),
                mb(r.working_bytes),
                mb(r.context_bytes),
                x.policy.name(),
                x.cache_slots,
                x.experts_total(),
                mb(r.cache_bytes),
                if x.lookahead { ", router lookahead" } else { "" }
            );
        } else {
            print_residency(s, rt.stream_open_s, rt.mask.as_ref().map(|m| m.sparsity));
            if let Some(d) = &s.device_plan {
                eprintln!(
                    "device memory under {:.1} MB (minimum {:.1} MB): norms, KV cache, batch and one layer's copies {:.1} MB, \
                     output {}, attention {}/{} layers, gate {}/{} layers, hot neurons {}/layer ({:.1} MB; {:.1} MB resident \
                     in all); {:.1} MB/token copied from host memory when dense",
                    mb(d.budget_bytes),
                    mb(d.minimum_bytes),
                    mb(d.required_bytes),
                    if d.output_resident { "resident" } else { "copied per token" },
                    d.attention_resident.iter().filter(|&&a| a).count(),
                    d.attention_resident.len(),
                    d.gate_resident.iter().filter(|&&g| g).count(),
                    d.gate_resident.len(),
                    d.hot_neurons.first().copied().unwrap_or(0),
                    mb(d.hot_bytes),
                    mb(d.resident_bytes()),
                    mb(d.copied_bytes_per_token)
                );
            }
            eprintln!(
            "read planner: {:.1} µs per request, {:.0} MB/s, {}-byte alignment: gaps under {:.1} KB are read through",
            s.cost.request_us,
            s.cost.bytes_per_us,
            s.cost.align_bytes,
            s.cost.merge_gap_bytes() as f64 / 1e3
        );
        }
    }
    if let Some(h) = rt.stream.as_ref().and_then(|s| s.hybrid_plan()) {
        eprintln!("{}", h.describe());
    }
    if let Some(m) = &rt.mask {
        eprintln!(
            "sparse FFN ({}): {} {} at {}{}",
            if rt.stream.is_some() { "streamed" } else { "in RAM" },
            m.strategy.name(),
            m.criterion.name(),
            level(m.sparsity),
            match &m.per_layer {
                Some(p) => format!(
                    " (per-layer levels {}, stored in the file)",
                    p.iter().map(|&s| level(s)).collect::<Vec<_>>().join(",")
                ),
                None => String::new(),
            }
        );
    }
    expected(rt)
}

/// What streaming `rt` should give from the disk's side ([`gatestream::placement::Expected`]):
/// the disk's rate measured now (32 MiB of large reads), beside what a token reads; printed.
/// None in RAM, or where the disk cannot be read for it (a warning says why).
fn expected(rt: &gatestream::runtime::Runtime) -> Option<gatestream::placement::Expected> {
    let s = rt.stream.as_ref()?;
    match gatestream::io::measure_read_rate(&rt.model.path, &rt.model.parts, 32 << 20) {
        Ok((rate, direct_io)) => {
            let mut e =
                gatestream::placement::Expected::new(s.dense_bytes_per_token, s.experts.is_some(), rate, direct_io);
            // Under a GPU budget, the link too: its pinned rate for 16 MiB copies.
            if let Some(d) = &s.device_plan {
                match rt.model.device.measure_link(&[16 << 20]) {
                    Some(Ok(v)) if !v.is_empty() => {
                        let rate = v[0].pinned_gb_per_s * 1e9;
                        e = e.with_link(gatestream::placement::LinkBound::new(d.copied_bytes_per_token, rate));
                    }
                    Some(Err(err)) => eprintln!("warning: the link's rate could not be measured: {err}"),
                    _ => {}
                }
            }
            eprintln!("{}", e.describe());
            Some(e)
        }
        Err(e) => {
            eprintln!("warning: the disk's rate could not be measured for the expected speed: {e}");
            None
        }
    }
}

fn default_model() -> anyhow::Result<PathBuf> {
    let dir = std::env::var_os("GATESTREAM_MODELS")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/gatestream/models")))
        .context("no --model given and neither GATESTREAM_MODELS nor HOME is set")?;
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        anyhow::bail!(
            "no --model given and the default model {} is not there; fetch it with tools/fetch-models.sh smollm2 (in the repository)",
            path.display()
        );
    }
    Ok(path)
}

/// The device `--device` names (a notice on stderr when `auto` falls back to the CPU).
fn device_of(args: &ModelArgs) -> anyhow::Result<Arc<dyn Device>> {
    open_named_device(args.device, args.threads, &args.cuda_opt, &args.cuda_flags())
}

/// Opens the device `arg` names with `threads` CPU threads, the CUDA modes `cuda_opt`
/// (`--cuda-opt`) and the CUDA settings given as flags (`cuda_flags`: `--activations`,
/// `--map-host`), printing `auto`'s fallback notice.
fn open_named_device(
    arg: DeviceArg,
    threads: usize,
    cuda_opt: &[String],
    cuda_flags: &[(&str, String)],
) -> anyhow::Result<Arc<dyn Device>> {
    let kind = match arg {
        DeviceArg::Cpu => gatestream::backend::DeviceKind::Cpu,
        DeviceArg::Cuda => gatestream::backend::DeviceKind::Cuda,
        DeviceArg::Auto => gatestream::backend::DeviceKind::Auto,
        DeviceArg::Wgpu => gatestream::backend::DeviceKind::Wgpu,
        DeviceArg::HostStandin => gatestream::backend::DeviceKind::HostStandIn,
    };
    // The CUDA device's settings: where its libraries are, from the environment; its modes from
    // --activations and --map-host, --cuda-opt, GATESTREAM_CUDA_OPTS and their own variables.
    let env = |name: &str| std::env::var(name).ok();
    let var = gatestream::backend::modes::with_opts(cuda_opt, cuda_flags, &env)?;
    let (device, notice) = gatestream::backend::open_device(kind, threads, &var)?;
    if let Some(n) = notice {
        eprintln!("{n}");
    }
    Ok(device)
}

/// [`open_plain`] with what `--model`, `--device`, `--threads` and `--experts-used` say.
fn open_for_passes(
    args: &ModelArgs,
    ram_budget: Option<BudgetSize>,
    io: IoArg,
    kv_positions: usize,
) -> anyhow::Result<gatestream::runtime::Runtime> {
    let path = model_path(args)?;
    open_plain(
        &path,
        device_of(args)?,
        args.threads,
        ram_budget,
        io,
        kv_positions,
        args.experts_used,
    )
}

/// Opens a model for a command that runs whole passes (perplexity, eval): in RAM, or streamed
/// under `ram_budget` with the KV cache of `kv_positions` positions counted in it, a
/// mixture-of-experts model with `experts_used` experts per token if given; says what was
/// loaded and any warning.
#[allow(clippy::too_many_arguments)] // each is one command-line choice
fn open_plain(
    path: &std::path::Path,
    device: Arc<dyn Device>,
    threads: usize,
    ram_budget: Option<BudgetSize>,
    io: IoArg,
    kv_positions: usize,
    experts_used: Option<usize>,
) -> anyhow::Result<gatestream::runtime::Runtime> {
    let stream = match ram_budget {
        None => None,
        Some(b) => Some(StreamAsk {
            budget_bytes: b.bytes(gatestream::model::model_bytes(path)?),
            engine: engine_of(io),
            reader: ReaderOptions::default(),
            cache: None,
            priority: Priority::CacheFirst,
            merge_gap_bytes: None,
            cost: CostSource::Probe,
            lookahead: false,
            batch_tokens_max: 0,
            vram_budget_bytes: None,
            prefetch_buffers: 0,
            prefetch_read_bytes: 0,
            hybrid: gatestream::stream::hybrid::HybridMode::Auto,
        }),
    };
    let t = std::time::Instant::now();
    let rt = gatestream::runtime::open_on(
        path,
        &OpenOptions {
            threads,
            stream,
            sparse: None,
            kv_positions: KvPositions::Exactly(kv_positions),
            experts_used,
        },
        device,
    )?;
    print_loaded(&rt.model, t.elapsed().as_secs_f64());
    for w in &rt.warnings {
        eprintln!("warning: {w}");
    }
    Ok(rt)
}

fn model_path(args: &ModelArgs) -> anyhow::Result<PathBuf> {
    match &args.model {
        Some(p) => Ok(p.clone()),
        None => default_model(),
    }
}

/// For a model in RAM: glibc's allocator returns every block above its mmap threshold (at most
/// 32 MB) to the kernel when freed, so each prefill layer's activations (tens of MB per product
/// for 512 tokens) came back as fresh pages, faulted in and zeroed again: Qwen's 512-token
/// prefill ran 3-15% faster with blocks up to 128 MB kept in the heap and up to 256 MB of free
/// heap top kept before trimming (measured in alternation on this machine; Gemma's unchanged).
/// Not when streaming under a RAM budget: there the retained blocks raised a Qwen run's peak
/// RSS by 47 MB, which a memory cap would feel.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called at the start of main, before any
    // other thread exists. A refusal (return 0) leaves glibc's defaults, which are correct too.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// Whether automatic placement will stream `cmd`'s model (decided again, with the run's own
/// context, when it opens).
fn placement_streams(cmd: &Command) -> bool {
    let (Command::Run(RunArgs { model, stream, .. }) | Command::Serve(ServeArgs { model, stream, .. })) = cmd else {
        return false;
    };
    let Ok(path) = model_path(model) else { return false };
    matches!(
        auto_placement(stream, &path, 0, None),
        Ok(Some(gatestream::placement::Decision {
            placed: gatestream::placement::Placed::Streamed { .. },
            ..
        }))
    )
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.command.cuda_opts().iter().any(|o| o == "help") {
        print!("{}", gatestream::backend::modes::help());
        return ExitCode::SUCCESS;
    }
    // A bad --cuda-opt is refused before any model is read.
    if let Err(e) = gatestream::backend::modes::parse(cli.command.cuda_opts(), "--cuda-opt") {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    if !cli.command.streams() && !placement_streams(&cli.command) {
        tune_allocator();
    }
    match run(cli) {
        Ok(()) if INTERRUPTED.load(Ordering::SeqCst) => ExitCode::from(EXIT_INTERRUPTED),
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if INTERRUPTED.load(Ordering::SeqCst) => {
            eprintln!("error (after Ctrl-C): {e:#}");
            ExitCode::from(EXIT_INTERRUPTED)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(c) => generate_cmd::run(c)?,
        Command::Serve(c) => serve_cmd::serve(c)?,
        Command::Perplexity(c) => quality_cmd::perplexity(c)?,
        Command::Reformat(c) => files_cmd::reformat(c)?,
        Command::MakeModel(c) => make::make_model(c)?,
        Command::MakeMoe(c) => files_cmd::make_moe(c)?,
        Command::Bench(c) => bench_cmd::bench(c)?,
        Command::Eval(c) => quality_cmd::eval(c)?,
        Command::Recommend(c) => quality_cmd::recommend(c)?,
        Command::Calibrate(c) => quality_cmd::calibrate(c)?,
        Command::Inspect(c) => files_cmd::inspect(c)?,
        Command::Verify(c) => files_cmd::verify(c)?,
    }
    Ok(())
}
