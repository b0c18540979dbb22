//! The `gatestream` command line: parses arguments, calls the library, prints. Nothing here
//! computes; everything it does is a library call tests can make too.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use gatestream::bench::trace::{Trace, TraceRecorder};
use gatestream::io::{ReadEngine, ReaderOptions};
use gatestream::model::generate::GenerateOptions;
use gatestream::model::sampler::SamplerConfig;
use gatestream::model::{LoadOptions, Model};
use gatestream::perplexity::{perplexity_with, PerplexityOptions};
use gatestream::runtime::{KvPositions, OpenOptions, Outcome, SparseAsk, StreamAsk};
use gatestream::sparsity::{Criterion, Masker, Strategy};
use gatestream::stream::cache::CachePolicy;
use gatestream::stream::residency::{parse_budget, Priority};
use gatestream::stream::CostSource;

#[derive(Parser)]
#[command(
    name = "gatestream",
    version,
    about = "Run language models larger than memory: stream a .gst model from disk under a RAM budget, reading only the FFN neurons each token uses"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct ModelArgs {
    /// Model: a .gguf file, or a Hugging Face folder (config.json, model.safetensors, tokenizer.json).
    /// Default: SmolLM2-135M-Instruct as fetched by ../shared/models/fetch.sh smollm2.
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Worker threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text: streams the continuation to stdout, stats to stderr.
    Run {
        #[command(flatten)]
        model: ModelArgs,
        /// The prompt text.
        #[arg(long, short, default_value = "The capital of France is")]
        prompt: String,
        /// Most tokens to generate (stops earlier at the model's end-of-sequence token).
        #[arg(long, default_value_t = 32)]
        max_tokens: usize,
        /// Sampling temperature; 0 = greedy (deterministic).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Sample among the k most likely tokens only (0 = no limit). Ignored when greedy.
        #[arg(long, default_value_t = 40)]
        top_k: usize,
        /// Sample from the smallest set of tokens whose probability reaches p. Ignored when greedy.
        #[arg(long, default_value_t = 0.95)]
        top_p: f32,
        /// Random seed for sampling.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Wrap the prompt in the model's chat template (instruct models).
        #[arg(long)]
        chat: bool,
        /// With --json: each generated token's log-probability under the model (`logprobs`; a
        /// softmax over the vocabulary per token, so off by default).
        #[arg(long)]
        logprobs: bool,
        /// dense: every FFN neuron; sparse: only the neurons the mask keeps (with --ram-budget,
        /// only those are read from disk); compare: both, one after the other, side by side, with
        /// agreement and (when streaming) the bytes each read.
        #[arg(long, value_enum, default_value_t = ModeArg::Dense)]
        mode: ModeArg,
        /// Share of FFN neurons dropped per layer in sparse mode. Without --sparsity, --strategy
        /// and --criterion, a .gst file's recommendation (stored by `eval --store` or
        /// `recommend`) is used, else topk / exact / 0.3.
        #[arg(long)]
        sparsity: Option<f32>,
        /// Mask strategy in sparse mode: topk (per token), threshold (per-layer thresholds stored
        /// by calibration in a .gst file), union (the prompt's choices reused while decoding).
        #[arg(long, value_enum)]
        strategy: Option<StrategyArg>,
        /// How neurons are scored in sparse mode: gate |act(g)|, exact |act(g)·up|, candidates,
        /// sketch (see `gatestream eval --help`).
        #[arg(long, value_enum)]
        criterion: Option<CriterionArg>,
        #[command(flatten)]
        stream: StreamArgs,
        /// Print one JSON object with the text, token ids and speeds at the end instead of stats.
        #[arg(long)]
        json: bool,
    },
    /// Perplexity of a text file, computed the way llama.cpp's llama-perplexity does: the file is
    /// tokenized once, cut into consecutive windows of --ctx tokens, each window starts with BOS
    /// (when the model adds BOS) in place of its first token, and only the second half of each
    /// window is scored.
    Perplexity {
        #[command(flatten)]
        model: ModelArgs,
        /// Text file to score (e.g. ../shared/data/wikitext-2/wiki.test.raw).
        #[arg(long)]
        text: PathBuf,
        /// Window length in tokens.
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Number of windows from the start of the text (0 = all).
        #[arg(long, default_value_t = 0)]
        windows: usize,
        /// Print the report as JSON on stdout.
        #[arg(long)]
        json: bool,
        /// Stream a .gst model from disk under this RAM budget (as `run --ram-budget`; the KV
        /// cache of one window and one batch's activations are counted in it; windows are fed in
        /// batches of 32 tokens, so the result differs from the in-RAM one by rounding).
        #[arg(long)]
        ram_budget: Option<String>,
        /// Reader when streaming: uring, pread or mmap (as `run --io`).
        #[arg(long, value_enum, default_value_t = IoArg::Uring)]
        io: IoArg,
    },
    /// Convert a GGUF file or Hugging Face folder into a tile-grouped .gst file laid out for
    /// sparse reads (neuron-major FFN sections, 4096-aligned, checksummed; see docs/FORMAT.md).
    Reformat {
        /// Source model: a .gguf file or a Hugging Face folder.
        input: PathBuf,
        /// The .gst file to write (written to a temporary file and renamed when complete).
        output: PathBuf,
        /// bundled: each neuron's up row and down column side by side (one read fetches both);
        /// split: up rows and down columns in separate neuron-major sections.
        #[arg(long, value_enum, default_value_t = LayoutArg::Split)]
        ffn_layout: LayoutArg,
        /// Element type of the transposed down columns (re-quantized along hidden); `same` keeps
        /// the source's down type.
        #[arg(long, value_enum, default_value_t = DownArg::Q8_0)]
        down_type: DownArg,
        /// Neuron order within each layer: original, or hot-first (needs --calibrate).
        #[arg(long, value_enum, default_value_t = OrderArg::Original)]
        order: OrderArg,
        /// Calibration text run through the dense model (its LAST --calibrate-tokens tokens, so it
        /// does not overlap perplexity windows taken from the start of the same file).
        #[arg(long)]
        calibrate: Option<PathBuf>,
        /// Tokens of calibration text.
        #[arg(long, default_value_t = 2048)]
        calibrate_tokens: usize,
        /// Convert every matrix of a safetensors source to this type (default: as stored).
        #[arg(long = "type", value_enum)]
        matrix_type: Option<TypeArg>,
        /// Also store a compact 2-bit copy of every up row (12 bytes per 32 values) for cheap
        /// estimates of up·x when choosing neurons.
        #[arg(long, value_enum, default_value_t = SketchArg::None)]
        up_sketch: SketchArg,
        /// Replace OUTPUT if it exists.
        #[arg(long)]
        force: bool,
        /// Worker threads for calibration (0 = one per core).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// Print the report as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// The quality cost of FFN sparsity: perplexity, its increase over dense, top-1 agreement
    /// and KL divergence from dense, achieved sparsity and implied FFN bytes per token, for every
    /// strategy x criterion x level, on the same windows as `perplexity`.
    Eval {
        #[command(flatten)]
        model: ModelArgs,
        /// Text file (e.g. ../shared/data/wikitext-2/wiki.test.raw); windows come from its start,
        /// threshold calibration from its end.
        #[arg(long)]
        text: PathBuf,
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Number of windows (0 = all).
        #[arg(long, default_value_t = 20)]
        windows: usize,
        /// Comma-separated sparsity levels (share of FFN neurons dropped); 0 is the dense row.
        #[arg(long, default_value = "0,0.3,0.5,0.7", value_delimiter = ',')]
        sparsity: Vec<f32>,
        /// Comma-separated strategies: topk (per token), threshold (per-layer calibrated),
        /// union (the context's choices reused).
        #[arg(long, value_enum, default_value = "topk", value_delimiter = ',')]
        strategy: Vec<StrategyArg>,
        /// Comma-separated criteria: gate |act(g)|, exact |act(g)·up|, candidates (gate top
        /// 1.4x, then exact), sketch |act(g)·û| with a 2-bit up sketch.
        #[arg(long, value_enum, default_value = "gate,exact", value_delimiter = ',')]
        criterion: Vec<CriterionArg>,
        /// Tokens from the END of the text used to calibrate thresholds.
        #[arg(long, default_value_t = 2048)]
        calibrate_tokens: usize,
        /// Also evaluate top-K with per-layer budgets (levels allocated by each layer's measured
        /// sensitivity on this many tokens from the end of the text, same mean and bytes as the
        /// uniform level); 0 = off.
        #[arg(long, default_value_t = 0)]
        per_layer_tokens: usize,
        /// Quality budget for the frontier line: the largest perplexity increase, in percent.
        #[arg(long, default_value_t = 2.0)]
        max_ppl_increase: f64,
        /// Also draw perplexity increase against FFN bytes per token, one line per strategy and
        /// criterion, as an SVG file.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Store the frontier configuration in the model's .gst file as the default for
        /// `run --mode sparse` (safe rewrite of the file).
        #[arg(long)]
        store: bool,
        /// Store the frontier configuration in this .gst file instead: the evaluated model must
        /// be the file it was converted from (checked by length and xxh3), e.g. evaluate the
        /// GGUF (its batched kernels are faster) and store in the .gst made from it.
        #[arg(long, value_name = "FILE.gst", conflicts_with = "store")]
        store_in: Option<PathBuf>,
        /// Also write the report as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Save progress here after every window; if the file exists and belongs to the same
        /// evaluation (model, text, levels, strategies, criteria, windows), continue from it.
        /// Removed once the report is written. Default with --json: FILE.checkpoint beside it.
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// Evaluate at most N windows in this run, then stop with progress saved in the
        /// checkpoint (run the same command again to continue): a long evaluation in parts.
        #[arg(long, value_name = "N")]
        windows_this_run: Option<usize>,
        /// Also run every configuration N more times with its neuron scores changed at rounding
        /// level (a relative 1e-6, fixed per seed, layer and neuron) and print the spread of the
        /// perplexity increase: differences between rows smaller than it are noise. Costs N
        /// times the sparse passes.
        #[arg(long, value_name = "N", default_value_t = 0)]
        jitter_seeds: usize,
    },
    /// Stores the frontier of earlier `eval --json` reports in a .gst file as the default for
    /// `run --mode sparse`, at a quality budget chosen now (no re-evaluation). The .gst must be
    /// the evaluated model or made from it (checked by the source length and xxh3 it records).
    Recommend {
        /// The report written by `gatestream eval --json`. Repeat it for an evaluation run in
        /// parts (same model, text, windows and context; e.g. one strategy per run): the
        /// frontier is taken over all of their rows.
        #[arg(long, required = true)]
        report: Vec<PathBuf>,
        /// The .gst file to store the recommendation in (safe rewrite).
        #[arg(long)]
        model: PathBuf,
        /// Quality budget: the largest perplexity increase over dense, in percent.
        #[arg(long, default_value_t = 2.0)]
        max_ppl_increase: f64,
    },
    /// The I/O benchmark: replays traces of which neurons each token used against a .gst file,
    /// without computing — dense transfer (whole FFN sections in 1 MiB reads) against sparse
    /// transfer (the read planner's reads) — per reader engine and queue depth, beside the
    /// device's own sequential and random-read rates measured on the same file in the same run.
    /// O_DIRECT for uring and pread; the page cache is dropped for the file before mmap passes.
    Bench {
        /// The .gst model file.
        #[arg(long)]
        model: PathBuf,
        /// Traces to replay (from `run --record-trace`). Without any, one trace per --sparsity is
        /// made by running the model over the start of --text.
        #[arg(long)]
        trace: Vec<PathBuf>,
        /// Text for the built-in traces (default: ../shared/data/wikitext-2/wiki.test.raw).
        #[arg(long)]
        text: Option<PathBuf>,
        /// Tokens of --text each built-in trace covers.
        #[arg(long, default_value_t = 64)]
        trace_tokens: usize,
        /// Comma-separated sparsity levels for built-in traces.
        #[arg(long, default_value = "0.3,0.5,0.7", value_delimiter = ',')]
        sparsity: Vec<f32>,
        /// Mask strategy for built-in traces.
        #[arg(long, value_enum, default_value_t = StrategyArg::Topk)]
        strategy: StrategyArg,
        /// Mask criterion for built-in traces (exact reads up for every neuron).
        #[arg(long, value_enum, default_value_t = CriterionArg::Gate)]
        criterion: CriterionArg,
        /// Tokens of each trace replayed per pass.
        #[arg(long, default_value_t = 16)]
        tokens: usize,
        /// Comma-separated engines: uring, pread, mmap.
        #[arg(long, default_value = "uring,pread,mmap", value_delimiter = ',')]
        engines: Vec<String>,
        /// io_uring queue depths to sweep (pread and mmap run at the deepest; io_uring also runs
        /// once there without registered buffers).
        #[arg(long, default_value = "1,8,32,64", value_delimiter = ',')]
        queue_depths: Vec<usize>,
        /// Leave the gate matrix out of both transfers (as when it is resident); by default it
        /// is read in full every token in both.
        #[arg(long)]
        gate_resident: bool,
        /// Neurons per layer held by a simulated LRU neuron cache in sparse replay (0 = none).
        #[arg(long, default_value_t = 0)]
        cache_neurons: usize,
        /// Override the probed planner's merge gap (see `run --help`).
        #[arg(long)]
        merge_gap_bytes: Option<u64>,
        /// Submit each token's reads as one batch instead of one per layer (streaming cannot; this
        /// shows what the per-layer round trips cost). Per-layer times are then not measured.
        #[arg(long)]
        token_batches: bool,
        /// Small and fast (a CI smoke test): 2 tokens, queue depths 8 and 64, a 16-token trace at
        /// 0.5, a short baseline.
        #[arg(long)]
        quick: bool,
        /// Write every figure and the setup as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Draw per-layer time (dense vs sparse) and throughput vs queue depth as an SVG file.
        #[arg(long)]
        plot: Option<PathBuf>,
    },
    /// Measure per-layer activation statistics of a .gst file's model on the LAST --tokens tokens
    /// of a text (evaluation uses the start of the same file, so they do not overlap) and store
    /// them in the file: neuron activation frequencies, thresholds for 1%..99% sparsity on the
    /// exact score |act(gate)·up|, hot-prefix coverage. The file is rewritten safely (temporary
    /// file, fsync, rename).
    Calibrate {
        /// The .gst file to calibrate (rewritten in place).
        #[arg(long, short)]
        model: PathBuf,
        /// Calibration text, e.g. ../shared/data/wikitext-2/wiki.test.raw.
        #[arg(long)]
        text: PathBuf,
        /// Tokens of text, taken from its end.
        #[arg(long, default_value_t = 2048)]
        tokens: usize,
        #[arg(long, default_value_t = 0)]
        threads: usize,
    },
    /// Show a .gst file: model config, layout, sections, neuron order and calibration summary.
    Inspect {
        file: PathBuf,
        /// Print the whole index as JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Check every checksum of a .gst file (header, index and all sections).
    Verify { file: PathBuf },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LayoutArg {
    Bundled,
    Split,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DownArg {
    #[value(name = "q8_0")]
    Q8_0,
    F16,
    Same,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum OrderArg {
    Original,
    HotFirst,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ModeArg {
    Dense,
    Sparse,
    Compare,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum IoArg {
    Uring,
    Pread,
    Mmap,
}

/// `--cost-model`: probe, default, or a bench report's baseline.
fn cost_source(arg: &str) -> anyhow::Result<CostSource> {
    Ok(match arg {
        "probe" => CostSource::Probe,
        "default" => CostSource::Default,
        file => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("--cost-model {file}: not probe, default or a readable bench report"))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).with_context(|| format!("--cost-model {file}: not JSON"))?;
            let c = gatestream::stream::plan::CostModel::from_bench_json(&v, 1, u64::MAX)
                .with_context(|| format!("--cost-model {file} (write one with gatestream bench --json FILE)"))?;
            CostSource::Given {
                request_us: c.request_us,
                bytes_per_us: c.bytes_per_us,
            }
        }
    })
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ResidencyArg {
    GateFirst,
    CacheFirst,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CacheArg {
    Lru,
    Pinned,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum StrategyArg {
    Topk,
    Threshold,
    Union,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum CriterionArg {
    Gate,
    Exact,
    Candidates,
    Sketch,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum SketchArg {
    None,
    #[value(name = "2bit")]
    TwoBit,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum TypeArg {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
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

/// Why sparse streaming can take longer than dense, in this run's own figures: on a device
/// where a request costs as much as reading many KB, scattered neuron reads save bytes but not
/// time; what saves time there is the neuron cache.
fn slower_sparse_hint(s: &gatestream::stream::StreamReport) -> String {
    let c = &s.cost_model;
    format!(
        "note: sparse streaming took longer than dense here. The read planner read through gaps under {:.1} KB \
         between needed neurons (its cost model: {:.1} µs per request at {:.0} MB/s; read amplification {:.2}) and \
         paid one request per remaining run: where a request costs as long as reading several KB, the bytes saved \
         do not save time. What does: neurons served from RAM (cache hits {:.0}% here) — a larger --ram-budget — \
         or dense streaming.",
        c.merge_gap_bytes() as f64 / 1e3,
        c.request_us,
        c.bytes_per_us,
        s.read_amplification,
        s.cache_hit_rate * 100.0
    )
}

/// A sparsity level as a user reads it: up to three decimals, no float noise (0.575, 0.6).
fn level(s: f32) -> String {
    let t = format!("{s:.3}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn strategy_of(s: StrategyArg) -> Strategy {
    match s {
        StrategyArg::Topk => Strategy::TopK,
        StrategyArg::Threshold => Strategy::Threshold,
        StrategyArg::Union => Strategy::Union,
    }
}

fn criterion_of(c: CriterionArg) -> Criterion {
    match c {
        CriterionArg::Gate => Criterion::Gate,
        CriterionArg::Exact => Criterion::Exact,
        CriterionArg::Candidates => Criterion::Candidates,
        CriterionArg::Sketch => Criterion::Sketch,
    }
}

/// Progress on stderr: a bar redrawn in place (at most 10 times a second) on a terminal, a line
/// every 10 seconds otherwise, and always the final state.
struct Progress {
    started: std::time::Instant,
    last_draw: Option<std::time::Instant>,
    tty: bool,
    /// The stage whose final state was printed (it is printed once).
    finished_stage: Option<String>,
}

impl Progress {
    fn new() -> Progress {
        use std::io::IsTerminal;
        Progress {
            started: std::time::Instant::now(),
            last_draw: None,
            tty: std::io::stderr().is_terminal(),
            finished_stage: None,
        }
    }

    fn update(&mut self, stage: &str, done: usize, total: usize) {
        let total = total.max(1);
        let finished = done >= total;
        let every = if self.tty { 0.1 } else { 10.0 };
        if !finished && self.last_draw.is_some_and(|t| t.elapsed().as_secs_f64() < every) {
            return;
        }
        if finished {
            if self.finished_stage.as_deref() == Some(stage) {
                return;
            }
            self.finished_stage = Some(stage.to_string());
        }
        self.last_draw = Some(std::time::Instant::now());
        let elapsed = self.started.elapsed().as_secs_f64();
        let eta = elapsed / done.max(1) as f64 * (total - done.min(total)) as f64;
        let bar = "#".repeat(30 * done.min(total) / total);
        let line = format!("{stage:>10} [{bar:<30}] {done}/{total}  {elapsed:.0} s elapsed, eta {eta:.0} s");
        if self.tty {
            eprint!("\r{line} ");
            if finished {
                eprintln!();
            }
        } else {
            eprintln!("{line}");
        }
    }
}

/// How `run` streams.
#[derive(clap::Args)]
struct StreamArgs {
    /// Stream a .gst model from disk under this RAM budget: bytes (700M, 1.5G, 512MiB) or a
    /// share of the file (40%). Resident, in this order while the budget lasts: the output
    /// matrix and norms (required), attention, gate matrices, a neuron cache; everything else
    /// is read per token. Refused, with the minimum, when too small. Without it the model is
    /// memory-mapped and computed in RAM.
    #[arg(long)]
    ram_budget: Option<String>,
    /// Reader when streaming: uring (io_uring, O_DIRECT, registered buffers; falls back to
    /// pread with a warning), pread (thread pool, O_DIRECT), mmap (page cache: the walk path).
    #[arg(long, value_enum, default_value_t = IoArg::Uring)]
    io: IoArg,
    /// Reads in flight at once when streaming.
    #[arg(long, default_value_t = 64)]
    queue_depth: usize,
    /// Neuron cache when streaming: lru (recently used neurons, replaced as others are read;
    /// default in sparse mode) or pinned (the file's first neurons — the hot prefix of a
    /// hot-first file — never replaced; default in dense mode).
    #[arg(long, value_enum)]
    cache: Option<CacheArg>,
    /// After attention, what the budget keeps first: gate-first (gate matrices, then the
    /// neuron cache) or cache-first (the neuron cache, then gates). Dense streaming saves the
    /// same bytes either way; sparse streaming usually gains from cache-first, since cached
    /// neurons spare scattered reads and a streamed gate is one sequential read.
    #[arg(long, value_enum, default_value_t = ResidencyArg::CacheFirst)]
    residency: ResidencyArg,
    /// The read planner reads through gaps between needed rows shorter than this, rather
    /// than issuing another request. Default: the cost model's per-request time x bandwidth
    /// (printed at start-up; ~10–55 KB on this machine's virtio disk); 0 reads only needed rows.
    #[arg(long)]
    merge_gap_bytes: Option<u64>,
    /// The read planner's cost model: probe (measure per-request cost and bandwidth on the
    /// model file at start-up: 1024 random 4 KiB reads in batches of 256, twice, and 32 MiB
    /// sequential; ~0.1 s), default (13 µs per request at 1.5 GB/s: this machine's virtio
    /// disk as DESIGN.md measured it), or a `gatestream bench --json` report (its device
    /// baseline: sequential 1 MiB bandwidth and the time per 4 KiB random read at QD 64).
    #[arg(long, default_value = "probe", value_name = "probe|default|BENCH.json")]
    cost_model: String,
    /// Save which FFN neurons every token used, per layer (prompt and generated tokens), for
    /// `gatestream bench --trace FILE`. In compare mode the sparse run's.
    #[arg(long)]
    record_trace: Option<PathBuf>,
    /// Sparse streaming: while a layer computes, predict the next layer's neurons (its
    /// resident gate applied to this layer's FFN input) and read them on a third reader, so
    /// the next layer reads only what the prediction missed. Costs two more layers of FFN
    /// rows in the budget and one more gate product per layer; reports hit rate and bytes
    /// read in vain. Exact-criterion masks are predicted perfectly (they read every up row).
    #[arg(long)]
    lookahead: bool,
}

/// One generation and what it measured, as `run` prints it.
trait Report {
    fn json(&self) -> anyhow::Result<serde_json::Value>;
    fn print_stats(&self, label: &str);
}

impl Report for Outcome {
    fn json(&self) -> anyhow::Result<serde_json::Value> {
        let mut v = serde_json::to_value(&self.generation)?;
        v["sparsity"] = self.sparsity.clone().unwrap_or(serde_json::Value::Null);
        v["stream"] = serde_json::to_value(&self.stream)?;
        Ok(v)
    }

    fn print_stats(&self, label: &str) {
        let g = &self.generation;
        eprintln!(
            "{label}prompt {} tokens: {:.1} tok/s prefill; generated {} tokens: {:.2} tok/s decode ({})",
            g.prompt_tokens.len(),
            g.prefill_tok_per_s,
            g.tokens.len(),
            g.decode_tok_per_s,
            g.finish.name()
        );
        if let Some(r) = &self.stream {
            let mb = |b: f64| b / 1e6;
            eprintln!(
                "{label}streamed ({}{}): {:.1} MB/token from disk (dense streaming: {:.1} MB planned), read amplification {:.2}, \
                 cache hits {:.1}%, waiting for reads {:.0}% of decode time, peak RSS {:.1} MB (budget {:.1} MB)",
                r.engine,
                if r.direct_io { ", O_DIRECT" } else { "" },
                mb(r.disk_bytes_per_token),
                mb(r.dense_disk_bytes_per_token),
                r.read_amplification,
                r.cache_hit_rate * 100.0,
                r.io_wait_fraction * 100.0,
                mb(r.peak_rss_bytes as f64),
                mb(r.ram_budget_bytes as f64)
            );
            if let Some(a) = &r.lookahead {
                eprintln!(
                    "{label}lookahead: {:.1}% of the neurons read ahead were used; it read {:.1}% of the FFN bytes \
                     the layers needed; {:.1} MB/token read in vain",
                    a.hit_rate * 100.0,
                    a.coverage * 100.0,
                    mb(a.wasted_bytes_per_token)
                );
            }
        }
    }
}

/// Opens the model through the runtime (streamed when a budget is given, masked when `sparse`
/// is given), says what was assembled, and generates.
fn generate_one(
    args: &ModelArgs,
    sparse: Option<&SparseAsk>,
    stream: &StreamArgs,
    record_trace: Option<&std::path::Path>,
    prompt: &str,
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> anyhow::Result<Outcome> {
    gatestream::stream::reset_peak_rss();
    let path = model_path(args)?;
    let stream_ask = match &stream.ram_budget {
        None => None,
        Some(b) => Some(StreamAsk {
            budget_bytes: parse_budget(b, std::fs::metadata(&path)?.len())?,
            engine: engine_of(stream.io),
            reader: ReaderOptions {
                queue_depth: stream.queue_depth,
                ..ReaderOptions::default()
            },
            cache: stream.cache.map(|c| match c {
                CacheArg::Lru => CachePolicy::Lru,
                CacheArg::Pinned => CachePolicy::Pinned,
            }),
            priority: match stream.residency {
                ResidencyArg::GateFirst => Priority::GateFirst,
                ResidencyArg::CacheFirst => Priority::CacheFirst,
            },
            merge_gap_bytes: stream.merge_gap_bytes,
            cost: cost_source(&stream.cost_model)?,
            lookahead: stream.lookahead,
            batch_tokens_max: 0,
        }),
    };
    let t = std::time::Instant::now();
    let rt = gatestream::runtime::open(
        &path,
        &OpenOptions {
            threads: args.threads,
            stream: stream_ask,
            sparse: sparse.cloned(),
            kv_positions: KvPositions::Prompt {
                prompt: prompt.to_string(),
                chat: opts.chat,
                extra: opts.max_tokens,
            },
        },
    )?;
    print_loaded(&rt.model, t.elapsed().as_secs_f64() - rt.stream_open_s);
    for w in &rt.warnings {
        eprintln!("warning: {w}");
    }
    if let Some(s) = &rt.stream {
        let r = &s.residency;
        let mb = |b: u64| b as f64 / 1e6;
        eprintln!(
            "streaming under {:.1} MB ({:.2} s to load what is resident): required {:.1} MB, buffers {:.1} MB, \
             KV cache + batch {:.1} MB, attention {}/{} layers ({:.1} MB), gate {}/{} layers ({:.1} MB), \
             neuron cache {:.1} MB ({} neurons/layer)",
            mb(r.budget_bytes),
            rt.stream_open_s,
            mb(r.required_bytes),
            mb(r.working_bytes),
            mb(r.context_bytes),
            r.attention_resident.iter().filter(|&&a| a).count(),
            r.attention_resident.len(),
            mb(r.attention_bytes),
            r.gate_resident.iter().filter(|&&a| a).count(),
            r.gate_resident.len(),
            mb(r.gate_bytes),
            mb(r.cache_bytes),
            r.cache_neurons.first().copied().unwrap_or(0)
        );
        eprintln!(
            "read planner: {:.1} µs per request, {:.0} MB/s, {}-byte alignment: gaps under {:.1} KB are read through",
            s.cost.request_us,
            s.cost.bytes_per_us,
            s.cost.align_bytes,
            s.cost.merge_gap_bytes() as f64 / 1e3
        );
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
    let ids = rt.model.prompt_ids(prompt, opts.chat)?;
    let outcome = rt.generate(&ids, opts, record_trace.is_some(), None, &mut |e| {
        if !e.text.is_empty() {
            on_text(e.text)
        }
    })?;
    if let (Some(t), Some(path)) = (&outcome.trace, record_trace) {
        t.write(path)?;
        eprintln!(
            "trace: {} tokens x {} layers ({:.1}% of neurons kept) written to {}",
            t.header.tokens,
            t.header.n_layers,
            t.header.kept_fraction * 100.0,
            path.display()
        );
    }
    Ok(outcome)
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

fn engine_of(io: IoArg) -> ReadEngine {
    match io {
        IoArg::Uring => ReadEngine::Uring,
        IoArg::Pread => ReadEngine::Pread,
        IoArg::Mmap => ReadEngine::Mmap,
    }
}

fn model_path(args: &ModelArgs) -> anyhow::Result<PathBuf> {
    match &args.model {
        Some(p) => Ok(p.clone()),
        None => default_model(),
    }
}

fn print_loaded(model: &Model, seconds: f64) {
    let c = &model.config;
    eprintln!(
        "loaded {} ({}, {} layers, hidden {}, ffn {}, vocab {}) in {seconds:.2} s on {}",
        model.path.display(),
        c.arch.name(),
        c.n_layers,
        c.hidden,
        c.ffn,
        c.vocab,
        model.device.name()
    );
}

fn load(args: &ModelArgs) -> anyhow::Result<Model> {
    let path = model_path(args)?;
    let t = std::time::Instant::now();
    let model = Model::load(
        &path,
        &LoadOptions {
            threads: args.threads,
            ..Default::default()
        },
    )?;
    print_loaded(&model, t.elapsed().as_secs_f64());
    Ok(model)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
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
            temperature,
            top_k,
            top_p,
            seed,
            chat,
            logprobs,
            mode,
            sparsity,
            strategy,
            criterion,
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
            let opts = GenerateOptions {
                max_tokens,
                sampler: SamplerConfig {
                    temperature,
                    top_k,
                    top_p,
                    seed,
                },
                chat,
                ctx: 0,
                batch_tokens_max: 0,
                logprobs,
            };
            let asked = SparseAsk {
                strategy: strategy.map(strategy_of),
                criterion: criterion.map(criterion_of),
                sparsity,
            };
            let mut stdout = std::io::stdout();
            let live = !json && mode != ModeArg::Compare;
            let mut print = |s: &str| {
                if live {
                    let _ = write!(stdout, "{s}");
                    let _ = stdout.flush();
                }
            };
            match mode {
                ModeArg::Dense | ModeArg::Sparse => {
                    let sparse = (mode == ModeArg::Sparse).then_some(&asked);
                    let out = generate_one(
                        &model,
                        sparse,
                        &stream,
                        stream.record_trace.as_deref(),
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
                    let dense = generate_one(&model, None, &stream, None, &prompt, &opts, &mut |_| {})?;
                    // Give the first run's memory back before the second measures its peak.
                    gatestream::stream::release_free_memory();
                    let sparse = generate_one(
                        &model,
                        Some(&asked),
                        &stream,
                        stream.record_trace.as_deref(),
                        &prompt,
                        &opts,
                        &mut |_| {},
                    )?;
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
                            })
                        );
                    } else {
                        println!("dense : {}", d.text);
                        println!("sparse: {}", s.text);
                        println!(
                            "agreement: {same}/{n} tokens ({:.1}%), first difference at {}",
                            agreement * 100.0,
                            first_difference.map_or("none".into(), |i| format!("token {i}"))
                        );
                        dense.print_stats("dense  ");
                        sparse.print_stats("sparse ");
                        if let Some(r) = ratios {
                            let time = r["time_per_token"].as_f64().unwrap_or(0.0);
                            eprintln!(
                                "sparse / dense: {:.3}x disk bytes per token, {time:.3}x time per token",
                                r["disk_bytes_per_token"].as_f64().unwrap_or(0.0),
                            );
                            match &sparse.stream {
                                Some(ss) if time > 1.0 => eprintln!("{}", slower_sparse_hint(ss)),
                                _ => {}
                            }
                        }
                    }
                }
            }
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
            let path = model_path(&model)?;
            let stream = match &ram_budget {
                None => None,
                Some(b) => Some(StreamAsk {
                    budget_bytes: parse_budget(b, std::fs::metadata(&path)?.len())?,
                    engine: engine_of(io),
                    reader: ReaderOptions::default(),
                    cache: None,
                    priority: Priority::CacheFirst,
                    merge_gap_bytes: None,
                    cost: CostSource::Probe,
                    lookahead: false,
                    batch_tokens_max: 0,
                }),
            };
            let t = std::time::Instant::now();
            let rt = gatestream::runtime::open(
                &path,
                &OpenOptions {
                    threads: model.threads,
                    stream,
                    sparse: None,
                    kv_positions: KvPositions::Exactly(ctx),
                },
            )?;
            print_loaded(&rt.model, t.elapsed().as_secs_f64());
            for w in &rt.warnings {
                eprintln!("warning: {w}");
            }
            let hooks = gatestream::model::forward::FfnHooks {
                select: &|_, _| gatestream::model::forward::FfnNeurons::All,
                observe: None,
                mask: None,
                stream: rt.layer_stream(),
            };
            let mut bar = Progress::new();
            let report = perplexity_with(
                &rt.model,
                &body,
                &PerplexityOptions {
                    ctx,
                    windows,
                    batch_tokens_max: 0,
                },
                &hooks,
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
            use gatestream::format::{FfnLayout, NeuronOrder, UpSketch};
            use gatestream::quant::GgmlType;
            use gatestream::reformat::{reformat, DownType, ReformatOptions};
            let opts = ReformatOptions {
                ffn_layout: match ffn_layout {
                    LayoutArg::Bundled => FfnLayout::Bundled,
                    LayoutArg::Split => FfnLayout::Split,
                },
                down_type: match down_type {
                    DownArg::Q8_0 => DownType::Q8_0,
                    DownArg::F16 => DownType::F16,
                    DownArg::Same => DownType::Same,
                },
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
                println!(
                    "wrote {} ({:.1} MB, {} sections) in {:.1} s (calibration {:.1} s); down re-quantization relative RMS error: mean {:.4}, max {:.4}",
                    report.output.display(),
                    report.file_len_bytes as f64 / 1e6,
                    report.sections,
                    report.seconds,
                    report.calibration_seconds,
                    mean,
                    max
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
            json,
            plot,
        } => {
            use gatestream::bench::{bench, plot as bench_plot, table, BenchOptions, EngineConfig};
            let (tokens, trace_tokens, sparsity, queue_depths) = if quick {
                (2, 16, vec![0.5], vec![8, 64])
            } else {
                (tokens, trace_tokens, sparsity, queue_depths)
            };
            let mut traces = Vec::new();
            for p in &trace {
                traces.push(Trace::read(p)?);
            }
            if traces.is_empty() {
                let text = match text {
                    Some(t) => t,
                    None => PathBuf::from("../shared/data/wikitext-2/wiki.test.raw"),
                };
                let body = std::fs::read_to_string(&text)
                    .with_context(|| format!("reading {} (give --text or --trace)", text.display()))?;
                let m = Model::load(&model, &LoadOptions::default())?;
                let mut ids = m.tokenizer.encode(&body, true)?;
                ids.truncate(trace_tokens.max(1));
                for &s in &sparsity {
                    let masker = Masker::for_model(&m, strategy_of(strategy), criterion_of(criterion), s, None)?;
                    let c = &m.config;
                    let rec = TraceRecorder::new(Some(&masker), c.n_layers, c.hidden, c.ffn);
                    let hooks = gatestream::model::forward::FfnHooks {
                        select: &|_, _| gatestream::model::forward::FfnNeurons::All,
                        observe: None,
                        mask: Some(&rec),
                        stream: None,
                    };
                    let mut cache = gatestream::kv::KvCache::new(c, ids.len());
                    m.forward_with(&ids, &mut cache, gatestream::model::batch::Logits::Last, &hooks)?;
                    let what = format!("{} {} {s}", masker.strategy.name(), masker.criterion.name());
                    let name = text
                        .file_name()
                        .map_or("text".into(), |n| n.to_string_lossy().into_owned());
                    traces.push(rec.trace(&name, &what));
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
            let mut bar = Progress::new();
            let report = bench(&model, &traces, &opts, &mut |stage, d, n| bar.update(stage, d, n))?;
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
            plot,
            store,
            store_in,
            json,
            checkpoint,
            windows_this_run,
            jitter_seeds,
        } => {
            use gatestream::eval::{eval, table, EvalOptions};
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
            let model = load(&model)?;
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
            };
            let name = text.file_name().and_then(|n| n.to_str()).unwrap_or("text").to_string();
            let mut bar = Progress::new();
            let Some(report) = eval(&model, &body, &name, &opts, &mut |stage, d, n| bar.update(stage, d, n))? else {
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
                drop(model);
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
