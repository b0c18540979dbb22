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
use gatestream::stream::residency::{parse_budget, parse_budget_for, Priority};
use gatestream::stream::CostSource;

mod args;
mod make;
mod output;

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
    let stream_ask = stream_ask(stream, &path)?;
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
    )?;
    let mut rt = rt;
    if let Some((p, max)) = draft {
        rt.attach_draft(p, max)?;
    }
    describe(&rt, t.elapsed().as_secs_f64());
    let ids = rt.model.prompt_ids(prompt, opts.chat)?;
    let outcome = rt.generate(&ids, opts, record_trace.is_some(), Some(&INTERRUPTED), &mut |e| {
        if !e.text.is_empty() {
            on_text(e.text)
        }
    })?;
    if let (Some(t), Some(path)) = (&outcome.trace, record_trace) {
        t.write(path)?;
        eprintln!("\ntrace: {} written to {}", t.summary(), path.display());
    }
    Ok(outcome)
}

/// What `--ram-budget`, `--vram-budget` and the other streaming flags ask for (None: in RAM).
fn stream_ask(stream: &StreamArgs, path: &std::path::Path) -> anyhow::Result<Option<StreamAsk>> {
    if !stream.streams() {
        return Ok(None);
    }
    let file_bytes = std::fs::metadata(path)?.len();
    Ok(Some(StreamAsk {
        budget_bytes: match &stream.ram_budget {
            Some(b) => parse_budget(b, file_bytes)?,
            // Only a GPU budget: the whole model in host RAM, streamed from there.
            None => gatestream::stream::RAM_UNLIMITED,
        },
        vram_budget_bytes: match &stream.vram_budget {
            Some(v) => Some(parse_budget_for("--vram-budget", v, file_bytes)?),
            None => None,
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
    }))
}

/// Says what was loaded (`load_s`: seconds since opening began), what the stream keeps and
/// reads, and the mask.
fn describe(rt: &gatestream::runtime::Runtime, load_s: f64) {
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
                 experts, norms and output {:.1} MB, buffers {:.1} MB, KV cache + batch {:.1} MB, {} expert cache of \
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
}

fn default_model() -> anyhow::Result<PathBuf> {
    let dir = std::env::var_os("GATESTREAM_MODELS")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/gatestream/models")))
        .context("no --model given and neither GATESTREAM_MODELS nor HOME is set")?;
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        anyhow::bail!(
            "no --model given and the default model {} is not there; fetch it with ../shared/models/fetch.sh smollm2",
            path.display()
        );
    }
    Ok(path)
}

/// The device `--device` names (a notice on stderr when `auto` falls back to the CPU).
fn device_of(args: &ModelArgs) -> anyhow::Result<Arc<dyn Device>> {
    open_named_device(args.device, args.threads)
}

/// Opens the device `arg` names with `threads` CPU threads, printing `auto`'s fallback notice.
fn open_named_device(arg: DeviceArg, threads: usize) -> anyhow::Result<Arc<dyn Device>> {
    let kind = match arg {
        DeviceArg::Cpu => gatestream::backend::DeviceKind::Cpu,
        DeviceArg::Cuda => gatestream::backend::DeviceKind::Cuda,
        DeviceArg::Auto => gatestream::backend::DeviceKind::Auto,
        DeviceArg::HostStandin => gatestream::backend::DeviceKind::HostStandIn,
    };
    let (device, notice) = gatestream::backend::open_device(kind, threads)?;
    if let Some(n) = notice {
        eprintln!("{n}");
    }
    Ok(device)
}

/// [`open_plain`] with what `--model`, `--device`, `--threads` and `--experts-used` say.
fn open_for_passes(
    args: &ModelArgs,
    ram_budget: Option<&str>,
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
    ram_budget: Option<&str>,
    io: IoArg,
    kv_positions: usize,
    experts_used: Option<usize>,
) -> anyhow::Result<gatestream::runtime::Runtime> {
    let stream = match ram_budget {
        None => None,
        Some(b) => Some(StreamAsk {
            budget_bytes: parse_budget(b, std::fs::metadata(path)?.len())?,
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !cli.command.streams() {
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
        Command::Run {
            model,
            prompt,
            max_tokens,
            ctx_size,
            temperature,
            top_k,
            top_p,
            seed,
            chat,
            logprobs,
            lookup,
            ignore_eos,
            draft,
            draft_max,
            mode,
            sparse,
            stream,
            json,
        } => {
            if !(0.0..=1.0).contains(&top_p) || top_p == 0.0 {
                anyhow::bail!("--top-p {top_p} must be in (0, 1]");
            }
            if temperature < 0.0 || !temperature.is_finite() {
                anyhow::bail!("--temperature {temperature} must be 0 (greedy) or positive");
            }
            if stream.queue_depth == 0 {
                anyhow::bail!("--queue-depth must be at least 1");
            }
            if (lookup > 0 || draft.is_some()) && stream.record_trace.is_some() {
                anyhow::bail!(
                    "--record-trace records one token per position; with --lookup or --draft a pass also runs drafts \
                     that are then rejected: record traces without them"
                );
            }
            let draft = draft.as_deref().map(|p| (p, draft_max));
            let opts = GenerateOptions {
                max_tokens,
                sampler: SamplerConfig {
                    temperature,
                    top_k,
                    top_p,
                    seed,
                },
                chat,
                ctx: ctx_size,
                batch_tokens_max: 0,
                logprobs,
                lookup,
                ignore_eos,
                logits_on_host: false,
            };
            stop_on_ctrl_c();
            let asked = sparse.ask();
            let mut stdout = std::io::stdout();
            let live = !json && mode != ModeArg::Compare;
            let mut print = |s: &str| {
                if live {
                    let _ = write!(stdout, "{s}");
                    let _ = stdout.flush();
                }
            };
            let device = device_of(&model)?;
            match mode {
                ModeArg::Dense | ModeArg::Sparse => {
                    let sparse = (mode == ModeArg::Sparse).then_some(&asked);
                    let out = generate_one(
                        &device,
                        &model,
                        sparse,
                        &stream,
                        stream.record_trace.as_deref(),
                        draft,
                        &prompt,
                        &opts,
                        &mut print,
                    )?;
                    if json {
                        println!("{}", out.json()?);
                    } else {
                        println!();
                        out.print_stats("");
                    }
                }
                ModeArg::Compare => {
                    // With --experts-used (a mixture-of-experts model): the model with its own
                    // count of experts per token against that many, no neuron mask; else the
                    // dense model against the mask.
                    let experts = model.experts_used;
                    let own = ModelArgs {
                        experts_used: None,
                        ..model.clone()
                    };
                    let mask = experts.is_none().then_some(&asked);
                    // One device (one thread pool) serves both runs.
                    let dense = generate_one(&device, &own, None, &stream, None, draft, &prompt, &opts, &mut |_| {})?;
                    // Give the first run's memory back before the second measures its peak.
                    gatestream::stream::release_free_memory();
                    let sparse = generate_one(
                        &device,
                        &model,
                        mask,
                        &stream,
                        stream.record_trace.as_deref(),
                        draft,
                        &prompt,
                        &opts,
                        &mut |_| {},
                    )?;
                    let labels = match experts {
                        Some(k) => ("own experts".to_string(), format!("{k} experts")),
                        None => ("dense".to_string(), "sparse".to_string()),
                    };
                    let (d, s) = (&dense.generation, &sparse.generation);
                    let n = d.tokens.len().min(s.tokens.len());
                    let same = d.tokens.iter().zip(&s.tokens).filter(|(a, b)| a == b).count();
                    let first_difference = d.tokens.iter().zip(&s.tokens).position(|(a, b)| a != b);
                    let agreement = if n == 0 { 1.0 } else { same as f64 / n as f64 };
                    let ratios = match (&dense.stream, &sparse.stream) {
                        (Some(ds), Some(ss)) => Some(serde_json::json!({
                            "disk_bytes_per_token": ss.disk_bytes_per_token / ds.disk_bytes_per_token.max(1.0),
                            "time_per_token": ds.decode_tok_per_s / ss.decode_tok_per_s.max(1e-9),
                        })),
                        _ => None,
                    };
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({
                                "dense": dense.json()?, "sparse": sparse.json()?, "agreement": agreement,
                                "first_difference": first_difference, "sparse_vs_dense": ratios,
                                "experts_used": experts,
                            })
                        );
                    } else {
                        let width = labels.0.len().max(labels.1.len());
                        println!("{:width$}: {}", labels.0, d.text);
                        println!("{:width$}: {}", labels.1, s.text);
                        println!(
                            "agreement: {same}/{n} tokens ({:.1}%), first difference at {}",
                            agreement * 100.0,
                            first_difference.map_or("none".into(), |i| format!("token {i}"))
                        );
                        dense.print_stats(&format!("{:width$} ", labels.0));
                        sparse.print_stats(&format!("{:width$} ", labels.1));
                        if let Some(r) = ratios {
                            let time = r["time_per_token"].as_f64().unwrap_or(0.0);
                            eprintln!(
                                "{} / {}: {:.3}x disk bytes per token, {time:.3}x time per token",
                                labels.1,
                                labels.0,
                                r["disk_bytes_per_token"].as_f64().unwrap_or(0.0),
                            );
                            match &sparse.stream {
                                Some(ss) if time > 1.0 && experts.is_none() => eprintln!("{}", slower_sparse_hint(ss)),
                                _ => {}
                            }
                        }
                    }
                }
            }
        }
        Command::Serve {
            model,
            host,
            port,
            parallel,
            queue,
            ctx_size,
            step_tokens,
            max_body_bytes,
            alias,
            mode,
            sparse,
            lookup,
            shutdown_grace,
            stream,
        } => {
            if stream.record_trace.is_some() {
                anyhow::bail!("--record-trace records one run's neurons; it is not for serve (use `run`)");
            }
            if sparse.strategy == Some(StrategyArg::Union) {
                anyhow::bail!(
                    "--strategy union learns one set of neurons from one prompt; a server decodes several requests \
                     at once: use topk or threshold"
                );
            }
            if mode == ModeArg::Compare {
                anyhow::bail!(
                    "--mode compare runs two generations side by side; a server compares per request: start it \
                     with --mode dense or sparse and POST /v1/infer with \"mode\": \"compare\""
                );
            }
            if !(shutdown_grace.is_finite() && shutdown_grace >= 0.0) {
                anyhow::bail!("--shutdown-grace {shutdown_grace} must be a number of seconds, 0 or more");
            }
            let path = model_path(&model)?;
            let device = device_of(&model)?;
            let streaming = stream.streams();
            let sparse = (mode == ModeArg::Sparse || !streaming).then(|| sparse.ask());
            let opts = OpenOptions {
                threads: model.threads,
                stream: stream_ask(&stream, &path)?,
                sparse,
                // Streaming, the budget counts every slot's KV cache.
                kv_positions: KvPositions::Sequences {
                    ctx: ctx_size,
                    sequences: parallel,
                },
                experts_used: model.experts_used,
            };
            let model_id = alias.unwrap_or_else(|| {
                path.file_name()
                    .map_or("model".into(), |n| n.to_string_lossy().into_owned())
            });
            let serve_opts = gatestream::serve::ServeOptions {
                host,
                port,
                parallel,
                queue,
                ctx: ctx_size,
                step_tokens,
                max_body_bytes,
                default_mode: if mode == ModeArg::Sparse {
                    gatestream::serve::Mode::Sparse
                } else {
                    gatestream::serve::Mode::Dense
                },
                model_id,
                shutdown_grace: std::time::Duration::from_secs_f64(shutdown_grace),
                lookup,
            };
            let load = Box::new(move || {
                gatestream::stream::reset_peak_rss();
                let t = std::time::Instant::now();
                let rt = gatestream::runtime::open_on(&path, &opts, device)?;
                describe(&rt, t.elapsed().as_secs_f64());
                let ctx = gatestream::runtime::slot_context(&rt.model, ctx_size);
                eprintln!(
                    "ready: {parallel} sequences at once, {ctx} tokens of context each, {}",
                    if rt.mask.is_some() {
                        "dense and sparse requests"
                    } else {
                        "dense requests"
                    }
                );
                Ok(rt)
            });
            gatestream::serve::serve(serve_opts, load, &mut |addr| {
                eprintln!("listening on http://{addr} (the model loads meanwhile: /health answers 503 until ready)");
            })?;
        }
        Command::Perplexity {
            model,
            text,
            ctx,
            windows,
            json,
            ram_budget,
            io,
        } => {
            let body = std::fs::read_to_string(&text).with_context(|| format!("reading {}", text.display()))?;
            let rt = open_for_passes(&model, ram_budget.as_deref(), io, ctx)?;
            let passes = gatestream::model::forward::Passes {
                stream: rt.layer_stream(),
                batch_tokens_max: 0,
                cancel: None,
            };
            let mut bar = Progress::new();
            let report = perplexity_with(
                &rt.model,
                passes,
                &body,
                &PerplexityOptions { ctx, windows },
                &mut |done, total, ppl| bar.update(&format!("ppl {ppl:.3}"), done, total),
            )?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!(
                    "perplexity {:.4} over {} windows of {} tokens ({} scored) in {:.1} s ({:.1} tok/s)",
                    report.perplexity,
                    report.windows,
                    report.ctx,
                    report.scored_tokens,
                    report.seconds,
                    report.tokens_per_s
                );
            }
        }
        Command::Reformat {
            input,
            output,
            ffn_layout,
            down_type,
            order,
            calibrate,
            calibrate_tokens,
            matrix_type,
            up_sketch,
            force,
            threads,
            json,
        } => {
            use gatestream::format::{NeuronOrder, UpSketch};
            use gatestream::quant::GgmlType;
            use gatestream::reformat::{reformat, ReformatOptions};
            let opts = ReformatOptions {
                ffn_layout: ffn_layout.into(),
                down_type: down_type.into(),
                order: match order {
                    OrderArg::Original => NeuronOrder::Original,
                    OrderArg::HotFirst => NeuronOrder::HotFirst,
                },
                calibrate_text: calibrate,
                calibrate_tokens,
                matrix_type: matrix_type.map(|t| match t {
                    TypeArg::F32 => GgmlType::F32,
                    TypeArg::F16 => GgmlType::F16,
                    TypeArg::Bf16 => GgmlType::BF16,
                    TypeArg::Q8_0 => GgmlType::Q8_0,
                }),
                up_sketch: match up_sketch {
                    SketchArg::None => UpSketch::None,
                    SketchArg::TwoBit => UpSketch::TwoBit,
                },
                force,
                threads,
            };
            let mut bar = Progress::new();
            let report = reformat(&input, &output, &opts, &mut |stage, done, total| {
                bar.update(stage, done, total)
            })?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                let errs = &report.down_requant_rel_rms;
                let max = errs.iter().copied().fold(0f32, f32::max);
                let mean = errs.iter().sum::<f32>() / errs.len().max(1) as f32;
                let down = if errs.is_empty() {
                    "down kept as stored (the rows layout and experts are not re-quantized)".to_string()
                } else {
                    format!("down re-quantization relative RMS error: mean {mean:.4}, max {max:.4}")
                };
                println!(
                    "wrote {} ({:.1} MB, {} sections) in {:.1} s (calibration {:.1} s); {down}",
                    report.output.display(),
                    report.file_len_bytes as f64 / 1e6,
                    report.sections,
                    report.seconds,
                    report.calibration_seconds,
                );
            }
        }
        c @ Command::MakeModel { .. } => make::make_model(c)?,
        Command::MakeMoe {
            model,
            output,
            arch,
            experts,
            used,
            ty,
            random,
            perturb,
            seed,
            force,
            json,
        } => {
            use gatestream::config::Arch;
            use gatestream::quant::GgmlType;
            let dense = match model {
                Some(m) => m,
                None => default_model()?,
            };
            if output.exists() && !force {
                anyhow::bail!("{} exists; pass --force to replace it", output.display());
            }
            let spec = gatestream::synth::MoeSpec {
                arch: match arch {
                    MoeArchArg::Llama => Arch::Llama,
                    MoeArchArg::Qwen2moe => Arch::Qwen2Moe,
                    MoeArchArg::Qwen3moe => Arch::Qwen3Moe,
                    MoeArchArg::Olmoe => Arch::Olmoe,
                },
                experts,
                used,
                ty: match ty {
                    MoeTypeArg::F32 => GgmlType::F32,
                    MoeTypeArg::F16 => GgmlType::F16,
                    MoeTypeArg::Q8_0 => GgmlType::Q8_0,
                    MoeTypeArg::Q4_0 => GgmlType::Q4_0,
                    MoeTypeArg::Q4K => GgmlType::Q4_K,
                    MoeTypeArg::Q6K => GgmlType::Q6_K,
                },
                random,
                perturb,
                seed,
            };
            let mut bar = Progress::new();
            let report = gatestream::synth::write_moe(&dense, &spec, &output, &mut |done, total| {
                bar.update("layers", done, total)
            })?;
            drop(bar);
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!(
                    "wrote {} ({:.1} MB): {} {} experts, {} used, {} layers, hidden {}, expert FFN {}",
                    output.display(),
                    report.bytes as f64 / 1e6,
                    report.arch,
                    report.experts,
                    report.used,
                    report.layers,
                    report.hidden,
                    report.expert_ffn
                );
            }
        }
        Command::Bench {
            model,
            trace,
            text,
            trace_tokens,
            sparsity,
            strategy,
            criterion,
            tokens,
            engines,
            queue_depths,
            gate_resident,
            cache_neurons,
            merge_gap_bytes,
            token_batches,
            quick,
            device_only,
            cache_experts,
            json,
            plot,
            device,
        } => {
            use gatestream::bench::{bench, link_table, plot as bench_plot, table, BenchOptions, EngineConfig};
            if device_only {
                let mut bar = Progress::new();
                let curve = gatestream::bench::device_curve(
                    &model,
                    &[256 << 10, 1 << 20, 4 << 20],
                    &[4, 16, 64],
                    if quick { 64 << 20 } else { 256 << 20 },
                    &[4096, 16384, 65536, 262144, 1 << 20],
                    if quick { 1024 } else { 4096 },
                    &mut |stage, done, total| bar.update(stage, done, total),
                )?;
                drop(bar);
                print!("{}", gatestream::bench::curve_table(&curve));
                if let Some(p) = json {
                    std::fs::write(&p, serde_json::to_vec_pretty(&curve)?)?;
                }
                return Ok(());
            }
            // The link first: a missing GPU is refused before the disk work starts.
            let link = match device {
                DeviceArg::Cpu => None,
                kind => {
                    let dev = open_named_device(kind, 0)?;
                    let sizes: Vec<usize> = if quick {
                        vec![64 << 10, 1 << 20, 16 << 20]
                    } else {
                        gatestream::backend::LINK_SIZES.to_vec()
                    };
                    match dev.measure_link(&sizes) {
                        Some(rows) => {
                            let rows = rows?;
                            print!("{}", link_table(&rows));
                            Some(rows)
                        }
                        None => None,
                    }
                }
            };
            let (tokens, trace_tokens, sparsity, queue_depths) = if quick {
                (2, 16, vec![0.5], vec![8, 64])
            } else {
                (tokens, trace_tokens, sparsity, queue_depths)
            };
            let moe = gatestream::gstfile::GstFile::open(&model)
                .ok()
                .and_then(|g| g.index.config.moe.clone().map(|m| (m, g.index.config.n_layers)));
            let mut traces = Vec::new();
            let mut routes = Vec::new();
            for p in &trace {
                match (AnyTrace::read(p)?, &moe) {
                    (AnyTrace::Neurons(t), None) => traces.push(t),
                    (AnyTrace::Routes(t), Some(_)) => routes.push(t),
                    (AnyTrace::Neurons(_), Some(_)) => anyhow::bail!(
                        "{}: a trace of neurons; {} is a mixture-of-experts model, whose bench replays routing traces \
                         (`run --record-trace FILE` on it)",
                        p.display(),
                        model.display()
                    ),
                    (AnyTrace::Routes(_), None) => anyhow::bail!(
                        "{}: a routing trace of a mixture-of-experts model; {} is dense",
                        p.display(),
                        model.display()
                    ),
                }
            }
            // Built-in traces over the start of --text: routing traces of a mixture of experts,
            // else one trace of neurons per --sparsity.
            if (moe.is_some() && routes.is_empty()) || (moe.is_none() && traces.is_empty()) {
                let text = text.unwrap_or_else(|| PathBuf::from("../shared/data/wikitext-2/wiki.test.raw"));
                let body = std::fs::read_to_string(&text)
                    .with_context(|| format!("reading {} (give --text or --trace)", text.display()))?;
                let rt = open_plain(&model, Arc::new(CpuBackend::new(0)), 0, None, IoArg::Pread, 0, None)?;
                let m = &rt.model;
                let mut ids = m.tokenizer.encode(&body, true)?;
                ids.truncate(trace_tokens.max(1));
                let name = text
                    .file_name()
                    .map_or("text".into(), |n| n.to_string_lossy().into_owned());
                let passes = gatestream::model::forward::Passes::default;
                if moe.is_some() {
                    routes.push(gatestream::bench::trace::record_routes(m, passes(), &ids, &name)?);
                }
                for &s in sparsity.iter().filter(|_| moe.is_none()) {
                    let masker = Masker::for_model(m, strategy_of(strategy), criterion_of(criterion), s, None)?;
                    traces.push(gatestream::bench::trace::record(m, passes(), &ids, &masker, &name)?);
                }
            }
            let mut configs = Vec::new();
            let deepest = queue_depths.iter().copied().max().unwrap_or(64);
            for e in &engines {
                match e.as_str() {
                    "uring" => {
                        for &qd in &queue_depths {
                            configs.push(EngineConfig {
                                engine: "uring",
                                queue_depth: qd,
                                fixed_buffers: true,
                            });
                        }
                        configs.push(EngineConfig {
                            engine: "uring",
                            queue_depth: deepest,
                            fixed_buffers: false,
                        });
                    }
                    "pread" => configs.push(EngineConfig {
                        engine: "pread",
                        queue_depth: deepest,
                        fixed_buffers: false,
                    }),
                    "mmap" => configs.push(EngineConfig {
                        engine: "mmap",
                        queue_depth: 1,
                        fixed_buffers: false,
                    }),
                    other => anyhow::bail!("--engines: unknown engine {other:?} (uring, pread, mmap)"),
                }
            }
            let opts = BenchOptions {
                engines: configs,
                tokens,
                gate_streamed: !gate_resident,
                cache_neurons,
                baseline_sizes: vec![4096, 16384, 65536, 262144],
                baseline_random_reads: if quick { 256 } else { 4096 },
                baseline_seq_bytes: if quick { 16 << 20 } else { 256 << 20 },
                merge_gap_bytes,
                token_batches,
            };
            if let Some((m, n_layers)) = &moe {
                use gatestream::bench::experts::{bench_experts, table as experts_table, ExpertBenchOptions};
                let all = n_layers * m.n_experts;
                let mut sizes = Vec::new();
                for c in &cache_experts {
                    let n = match c.strip_suffix('%') {
                        Some(p) => {
                            let share: f64 = p
                                .parse()
                                .ok()
                                .filter(|s: &f64| (0.0..=100.0).contains(s))
                                .with_context(|| format!("--cache-experts {c}: a share from 0% to 100%"))?;
                            (all as f64 * share / 100.0).round() as usize
                        }
                        None => c
                            .parse()
                            .with_context(|| format!("--cache-experts {c}: a count of experts or a share (30%)"))?,
                    };
                    if !sizes.contains(&n) {
                        sizes.push(n);
                    }
                }
                let x = ExpertBenchOptions {
                    cache_experts: sizes,
                    policies: vec![CachePolicy::Lru, CachePolicy::Frequency],
                };
                let mut bar = Progress::new();
                let mut report = bench_experts(&model, &routes, &opts, &x, &mut |stage, d, n| bar.update(stage, d, n))?;
                report.link = link;
                print!("{}", experts_table(&report));
                if let Some(path) = json {
                    std::fs::write(&path, serde_json::to_string_pretty(&report)?)
                        .with_context(|| format!("writing {}", path.display()))?;
                }
                if let Some(path) = plot {
                    std::fs::write(&path, gatestream::bench::experts::plot(&report))
                        .with_context(|| format!("writing {}", path.display()))?;
                }
                return Ok(());
            }
            let mut bar = Progress::new();
            let mut report = bench(&model, &traces, &opts, &mut |stage, d, n| bar.update(stage, d, n))?;
            report.link = link;
            print!("{}", table(&report));
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_string_pretty(&report)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(path) = plot {
                std::fs::write(&path, bench_plot(&report)).with_context(|| format!("writing {}", path.display()))?;
            }
        }
        Command::Eval {
            model,
            text,
            ctx,
            windows,
            sparsity,
            strategy,
            criterion,
            calibrate_tokens,
            max_ppl_increase,
            per_layer_tokens,
            experts,
            plot,
            store,
            store_in,
            json,
            checkpoint,
            windows_this_run,
            jitter_seeds,
            ram_budget,
            io,
        } => {
            use gatestream::eval::{eval_with, table, EvalOptions};
            let checkpoint = checkpoint.or_else(|| {
                json.as_ref().map(|j| {
                    let mut name = j.as_os_str().to_owned();
                    name.push(".checkpoint");
                    PathBuf::from(name)
                })
            });
            if windows_this_run.is_some() && checkpoint.is_none() {
                anyhow::bail!(
                    "--windows-this-run needs a checkpoint to continue from: pass --checkpoint FILE or --json FILE"
                );
            }
            // KV positions: a window, a calibration window (512 + BOS), the sensitivity tokens.
            let kv = ctx.max(513).max(per_layer_tokens + 1);
            let rt = open_for_passes(&model, ram_budget.as_deref(), io, kv)?;
            let passes = gatestream::model::forward::Passes {
                stream: rt.layer_stream(),
                batch_tokens_max: 0,
                cancel: None,
            };
            let model = &rt.model;
            let body = std::fs::read_to_string(&text).with_context(|| format!("reading {}", text.display()))?;
            let opts = EvalOptions {
                ctx,
                windows,
                sparsities: sparsity,
                strategies: strategy.iter().map(|&s| strategy_of(s)).collect(),
                criteria: criterion.iter().map(|&c| criterion_of(c)).collect(),
                calibrate_tokens,
                max_ppl_increase_pct: max_ppl_increase,
                per_layer_tokens,
                checkpoint: checkpoint.clone(),
                windows_this_run,
                jitter_seeds,
                experts,
            };
            let name = text.file_name().and_then(|n| n.to_str()).unwrap_or("text").to_string();
            let mut bar = Progress::new();
            let Some(report) = eval_with(model, passes, &body, &name, &opts, &mut |stage, d, n| {
                bar.update(stage, d, n)
            })?
            else {
                eprintln!(
                    "stopped after --windows-this-run {} windows; progress is saved in {}: run the same command again to continue",
                    windows_this_run.unwrap_or(0),
                    checkpoint.as_ref().expect("checked above").display()
                );
                return Ok(());
            };
            print!("{}", table(&report));
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_string_pretty(&report)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(path) = plot {
                std::fs::write(&path, gatestream::eval::chart(&report).svg())
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(path) = &checkpoint {
                // The report is written: the progress it was made from is no longer needed.
                if path.exists() {
                    std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
                }
            }
            if store || store_in.is_some() {
                let target = store_in.clone().unwrap_or_else(|| model.path.clone());
                let evaluated = model.path.clone();
                drop(rt);
                let r = &report;
                store_frontier(
                    &r.rows,
                    r.max_ppl_increase_pct,
                    &r.text,
                    r.windows,
                    r.ctx,
                    &evaluated,
                    &target,
                )?;
            }
        }
        Command::Recommend {
            report,
            model,
            max_ppl_increase,
        } => {
            let mut reports = Vec::with_capacity(report.len());
            for path in &report {
                let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
                let r: gatestream::eval::SavedReport = serde_json::from_slice(&bytes)
                    .with_context(|| format!("{}: not an eval report (gatestream eval --json)", path.display()))?;
                reports.push((path.display().to_string(), r));
            }
            let r = gatestream::eval::merge_reports(reports)?;
            store_frontier(
                &r.rows,
                max_ppl_increase,
                &r.text,
                r.windows,
                r.ctx,
                std::path::Path::new(&r.model),
                &model,
            )?;
        }
        Command::Calibrate {
            model,
            text,
            tokens,
            threads,
        } => {
            let mut bar = Progress::new();
            let cal = gatestream::reformat::recalibrate(&model, &text, tokens, threads, &mut |stage, d, n| {
                bar.update(stage, d, n)
            })?;
            let n = cal.layers.len().max(1) as f32;
            println!(
                "{}: calibrated on {}; first 10% / 25% of neurons cover {:.1}% / {:.1}% of activations on average",
                model.display(),
                cal.text,
                cal.layers.iter().map(|l| l.hot_prefix_10).sum::<f32>() / n * 100.0,
                cal.layers.iter().map(|l| l.hot_prefix_25).sum::<f32>() / n * 100.0
            );
        }
        Command::Inspect { file, json } => {
            let g = gatestream::gstfile::GstFile::open(&file)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&g.index)?);
            } else {
                print!("{}", gatestream::inspect::describe(&g));
            }
        }
        Command::Verify { file } => {
            let g = gatestream::gstfile::GstFile::open(&file)?;
            let mut bar = Progress::new();
            let mb = |done: u64, total: u64| if done == total { total.div_ceil(1 << 20) } else { done >> 20 } as usize;
            g.verify(&mut |done, total| bar.update("verify MB", mb(done, total), mb(total, total)))?;
            println!(
                "{}: header, index and {} sections verified ({:.1} MB)",
                file.display(),
                g.index.sections.len(),
                g.header.file_len_bytes as f64 / 1e6
            );
        }
    }
    Ok(())
}
