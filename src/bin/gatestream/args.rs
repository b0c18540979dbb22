//! The command line's arguments: what each flag means (`--help` prints these docs) and how
//! the raw values map to the library's typed options.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

use gatestream::io::ReadEngine;
use gatestream::sparsity::{Criterion, Strategy};
use gatestream::stream::residency::BudgetSize;
use gatestream::stream::CostSource;

#[derive(Parser)]
#[command(
    name = "gatestream",
    version,
    about = "Run language models larger than memory: stream a .gst model from disk under a RAM budget, reading only the FFN neurons each token uses"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(clap::Args, Clone)]
pub(crate) struct ModelArgs {
    /// Model file (.gguf, .gst) or Hugging Face folder.
    ///
    /// Model: a .gguf file, or a Hugging Face folder (config.json, model.safetensors, tokenizer.json).
    /// Default: SmolLM2-135M-Instruct as fetched by tools/fetch-models.sh smollm2.
    #[arg(help_heading = "Model and device", long, short)]
    pub(crate) model: Option<PathBuf>,
    /// Worker threads (0 = one per core).
    ///
    /// Worker threads (0 = one per core; at most 1024).
    #[arg(help_heading = "Model and device", long, default_value_t = 0, value_parser = threads_arg)]
    pub(crate) threads: usize,
    /// Where to compute: cpu, cuda or auto.
    ///
    /// Where to compute: cpu; cuda (an NVIDIA GPU, the model in its memory, or streamed to it
    /// with --ram-budget / --vram-budget; needs a build
    /// with `--features cuda`, the NVIDIA driver, and NVRTC, found on the library path or through
    /// GATESTREAM_NVRTC=/path/to/libnvrtc.so); auto (cuda when a GPU is found, else the CPU with a
    /// one-line notice).
    #[arg(help_heading = "Model and device", long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub(crate) device: DeviceArg,
    /// Experts a token is routed to (mixture of experts).
    ///
    /// Mixture-of-experts models: route each token to this many experts instead of the model's
    /// own count (fewer: less compute and, streamed, fewer bytes read per token, at a quality
    /// cost `perplexity` measures; `run --mode compare` sets it against the model's own count;
    /// for `eval` it becomes the model's own count, and `eval --experts` measures others).
    /// Refused for dense models.
    #[arg(help_heading = "Model and device", long)]
    pub(crate) experts_used: Option<usize>,
    /// A CUDA device mode, KEY=VALUE (repeatable); `--cuda-opt help` lists them.
    ///
    /// Over GATESTREAM_CUDA_OPTS (KEY=VALUE,KEY=VALUE) and each mode's own variable
    /// (GATESTREAM_CUDA_<KEY>); `--cuda-opt help` prints every mode with its values and default.
    #[arg(help_heading = "Model and device", long = "cuda-opt", value_name = "KEY=VALUE")]
    pub(crate) cuda_opt: Vec<String>,
    /// With --device cuda or wgpu: what the GPU's quantized products multiply [default: auto]
    ///
    /// With --device cuda: what the GPU's quantized products multiply the weights with. auto (the
    /// default): Q4_K and Q6_K weights with the CPU's 8-bit activation blocks, as integers; the
    /// other types with the f32 activations. f32: the f32 activations, weights decoded to f32. q8:
    /// the CPU's 8-bit activation blocks decoded to f32, so the GPU computes what the CPU path
    /// (and llama.cpp) computes, to rounding. int8: those blocks multiplied as integers where a
    /// kernel does (Q4_K, Q6_K), as q8 elsewhere. With --device wgpu: int8 (packed 8-bit dot
    /// products, every quantized type) or q8; auto is int8 where the adapter's WGSL has
    /// dot4I8Packed, and f32 is refused. Over GATESTREAM_CUDA_ACTIVATIONS. [default: auto]
    #[arg(
        help_heading = "Model and device",
        long,
        value_enum,
        value_name = "auto|f32|q8|int8",
        hide_possible_values = true
    )]
    pub(crate) activations: Option<ActivationsArg>,
    /// With --device cuda and --vram-budget: map the neuron cache for the GPU [default: on]
    ///
    /// With --device cuda and --vram-budget: on (the default) maps the neuron cache the host
    /// keeps for the GPU, so masked decode steps read its kept rows in place, across the link;
    /// off: only page-locked, the kept rows staged and copied. Over GATESTREAM_CUDA_MAP_HOST.
    /// [default: on]
    #[arg(
        help_heading = "Model and device",
        long,
        value_enum,
        value_name = "on|off",
        hide_possible_values = true
    )]
    pub(crate) map_host: Option<MapHostArg>,
}

impl ModelArgs {
    /// The CUDA settings given as flags of their own (`--activations`, `--map-host`), as
    /// `gatestream::backend::modes::CUDA_FLAGS` keys and values.
    pub(crate) fn cuda_flags(&self) -> Vec<(&'static str, String)> {
        fn name(v: &impl clap::ValueEnum) -> String {
            v.to_possible_value()
                .map(|p| p.get_name().to_string())
                .unwrap_or_default()
        }
        let mut flags = Vec::new();
        if let Some(a) = &self.activations {
            flags.push(("activations", name(a)));
        }
        if let Some(m) = &self.map_host {
            flags.push(("map-host", name(m)));
        }
        flags
    }
}

/// `--activations`: what the GPU's quantized products multiply.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ActivationsArg {
    Auto,
    F32,
    Q8,
    Int8,
}

/// `--map-host`: whether `--vram-budget`'s neuron cache is mapped for the GPU.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum MapHostArg {
    On,
    Off,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum DeviceArg {
    Cpu,
    Cuda,
    Auto,
    /// The portable GPU device (Vulkan, Metal, DX12 through wgpu; build with --features wgpu).
    Wgpu,
    /// For tests: the host stand-in for a device with memory of its own (computes on the CPU
    /// from its own copies of what it is handed, as a GPU would), so the paths that feed a GPU
    /// run end to end where there is none. Not a device to run models on; not listed.
    #[value(hide = true)]
    HostStandin,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Generate text: streams the continuation to stdout, stats to stderr.
    Run(RunArgs),
    /// An OpenAI-compatible HTTP server with continuous batching: up to --parallel requests
    /// decode together, one forward pass per step, so a streamed layer's bytes serve every
    /// sequence in the step. Endpoints: GET /v1/models, POST /v1/completions and
    /// /v1/chat/completions (JSON, or server-sent events with "stream": true), POST /v1/infer
    /// (next-token predictions and a greedy continuation: dense, sparse or compare), POST
    /// /tokenize and /detokenize, GET /health (503 while loading), GET /metrics (Prometheus),
    /// GET /stats (the live figures as JSON), and GET / a chat page (unless --no-webui).
    /// SIGINT / SIGTERM stop accepting connections and let requests in flight finish.
    Serve(ServeArgs),
    /// Perplexity of a text file, computed the way llama.cpp's llama-perplexity does: the file is
    /// tokenized once, cut into consecutive windows of --ctx tokens, each window starts with BOS
    /// (when the model adds BOS) in place of its first token, and only the second half of each
    /// window is scored.
    Perplexity(PerplexityArgs),
    /// Convert a GGUF file or Hugging Face folder into a tile-grouped .gst file laid out for
    /// sparse reads (neuron-major FFN sections, 4096-aligned, checksummed; see docs/FORMAT.md).
    Reformat(ReformatArgs),
    /// Write a model of a real architecture's shape with random weights — Llama-3-8B/70B,
    /// Qwen2.5-1.5B/7B/32B, Mixtral-8x7B, Qwen3-30B-A3B, OLMoE-1B-7B, GLM-4.5-Air,
    /// DeepSeek-V2-Lite/V3, Kimi-K2, gpt-oss-20b/120b, or custom dimensions — in the type mix
    /// llama.cpp's quantizer gives it (Q4_K_M, Q6_K, Q8_0, Q3_K_M, Q2_K, IQ4_XS, IQ2_XXS or
    /// MXFP4_MOE), with a real
    /// tokenizer, as a GGUF llama.cpp loads or as a .gst directly (a tensor at a time: memory
    /// stays at about one layer). Random weights make quality figures (perplexity, agreement,
    /// draft acceptance) meaningless; their bytes, shapes and types are real, so speeds, bytes
    /// per token and memory are what the real model's would be.
    MakeModel(MakeModelArgs),
    /// Write a synthetic mixture-of-experts GGUF from a dense llama-architecture GGUF (no real MoE
    /// weights are reachable here): its FFN upcycled into experts (each a perturbed copy, a random
    /// router; it speaks like the dense model), or random weights with its tokenizer. llama.cpp
    /// reads the result too, so it can serve as the reference.
    MakeMoe(MakeMoeArgs),
    /// The quality cost of FFN sparsity: perplexity, its increase over dense, top-1 agreement
    /// and KL divergence from dense, achieved sparsity and implied FFN bytes per token, for every
    /// strategy x criterion x level, on the same windows as `perplexity`. Mixture-of-experts
    /// models: top-K masks inside each routed expert, and fewer experts per token (`--experts`).
    Eval(EvalArgs),
    /// Stores the frontier of earlier `eval --json` reports in a .gst file as the default for
    /// `run --mode sparse`, at a quality budget chosen now (no re-evaluation). The .gst must be
    /// the evaluated model or made from it (checked by the source length and xxh3 it records).
    Recommend(RecommendArgs),
    /// The I/O benchmark: replays traces of which neurons each token used against a .gst file,
    /// without computing — dense transfer (whole FFN sections in 1 MiB reads) against sparse
    /// transfer (the read planner's reads) — per reader engine and queue depth, beside the
    /// device's own sequential and random-read rates measured on the same file in the same run.
    /// O_DIRECT for uring and pread; the page cache is dropped for the file before mmap passes.
    Bench(BenchArgs),
    /// Measure per-layer activation statistics of a .gst file's model on the LAST --tokens tokens
    /// of a text (evaluation uses the start of the same file, so they do not overlap) and store
    /// them in the file: neuron activation frequencies, thresholds for 1%..99% sparsity on the
    /// exact score |act(gate)·up|, hot-prefix coverage. The file is rewritten safely (temporary
    /// file, fsync, rename).
    Calibrate(CalibrateArgs),
    /// Show a .gst file: model config, layout, sections, neuron order and calibration summary.
    Inspect(InspectArgs),
    /// Check every checksum of a .gst file (header, index and all sections).
    Verify(VerifyArgs),
}

/// `Run`'s arguments (the subcommand's documentation is on [`Command::Run`]).
#[derive(clap::Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// The prompt text.
    #[arg(help_heading = "Generation", long, short, default_value = "The capital of France is")]
    pub(crate) prompt: String,
    /// Most tokens to generate.
    ///
    /// Most tokens to generate (stops earlier at the model's end-of-sequence token).
    #[arg(help_heading = "Generation", long, default_value_t = 32)]
    pub(crate) max_tokens: usize,
    /// Context in tokens, prompt + generated (0 = the model's).
    ///
    /// The context in tokens (prompt + generated), as llama.cpp's -c; 0 = the model's trained
    /// context. A prompt that does not fit is refused before any work, naming both counts;
    /// generation stops when the context is full (finish `context_full`). The KV cache (and,
    /// with --ram-budget, its share of the budget) holds only what the run can use: prompt +
    /// --max-tokens, at most this.
    #[arg(help_heading = "Generation", long, short = 'c', default_value_t = 0)]
    pub(crate) ctx_size: usize,
    /// Sampling temperature; 0 = greedy (deterministic).
    #[arg(help_heading = "Generation", long, default_value_t = 0.0)]
    pub(crate) temperature: f32,
    /// Sample among the k likeliest tokens (0 = all).
    ///
    /// Sample among the k most likely tokens only (0 = no limit). Ignored when greedy.
    #[arg(help_heading = "Generation", long, default_value_t = 40)]
    pub(crate) top_k: usize,
    /// Sample from the likeliest tokens whose probability reaches p.
    ///
    /// Sample from the smallest set of tokens whose probability reaches p. Ignored when greedy.
    #[arg(help_heading = "Generation", long, default_value_t = 0.95)]
    pub(crate) top_p: f32,
    /// Random seed for sampling.
    #[arg(help_heading = "Generation", long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Wrap the prompt in the model's chat template (instruct models).
    #[arg(help_heading = "Generation", long)]
    pub(crate) chat: bool,
    /// With --json: each generated token's log-probability.
    ///
    /// With --json: each generated token's log-probability under the model (`logprobs`; a
    /// softmax over the vocabulary per token, so off by default).
    #[arg(help_heading = "Generation", long)]
    pub(crate) logprobs: bool,
    /// Draft this many tokens a pass by prompt lookup (0 = off).
    ///
    /// Speculative decoding by prompt lookup: draft up to this many tokens per pass from the
    /// context itself (what followed the latest earlier occurrence of its last 4, 3 or 2
    /// tokens) and verify them all in one pass (at most a pass's tokens: 32 when streaming);
    /// rejected drafts are rolled back. Greedy output is the same as without it (a streamed
    /// sparse mask: to rounding, as one-token passes read rows another way); sampling draws
    /// from the same distribution, though not the same tokens for a seed. Pays where
    /// passes are expensive and text repeats (editing code under --ram-budget: every byte
    /// read serves the whole draft). 0 = off. Figures in `speculative` with --json.
    #[arg(help_heading = "Generation", long, default_value_t = 0)]
    pub(crate) lookup: usize,
    /// Never stop at the end-of-sequence token.
    ///
    /// Never stop at the model's end-of-sequence tokens: they are never sampled (their logits
    /// set to -inf, as llama.cpp's --ignore-eos does), so generation goes on to --max-tokens
    /// or a full context. For continuations of a fixed length, to compare or to time.
    #[arg(help_heading = "Generation", long)]
    pub(crate) ignore_eos: bool,
    /// A draft model for speculative decoding.
    ///
    /// Speculative decoding with a draft model: a small model sharing this model's
    /// vocabulary (refused otherwise), memory-mapped in RAM (outside --ram-budget), continues
    /// the text greedily for up to --draft-max tokens per pass and this model verifies them
    /// in one pass, as --lookup's drafts are (greedy output unchanged, sampling exact).
    /// Pays where this model's passes are expensive (streamed) and the draft often agrees.
    #[arg(help_heading = "Generation", long, conflicts_with = "lookup")]
    pub(crate) draft: Option<PathBuf>,
    /// The most tokens the draft model proposes per pass.
    #[arg(help_heading = "Generation", long, default_value_t = 4, requires = "draft")]
    pub(crate) draft_max: usize,
    /// dense, sparse (masked FFN) or compare (both).
    ///
    /// dense: every FFN neuron; sparse: only the neurons the mask keeps (with --ram-budget,
    /// only those are read from disk); compare: both, one after the other, side by side, with
    /// agreement and (when streaming) the bytes each read.
    #[arg(help_heading = "Sparsity", long, value_enum, default_value_t = ModeArg::Dense)]
    pub(crate) mode: ModeArg,
    #[command(flatten)]
    pub(crate) sparse: SparseArgs,
    #[command(flatten)]
    pub(crate) stream: StreamArgs,
    /// Print one JSON object at the end instead of stats.
    ///
    /// Print one JSON object with the text, token ids and speeds at the end instead of stats.
    #[arg(help_heading = "Generation", long)]
    pub(crate) json: bool,
}

/// `Serve`'s arguments (the subcommand's documentation is on [`Command::Serve`]).
#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Address to listen on (0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) host: String,
    /// Port to listen on (0 = any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    pub(crate) port: u16,
    /// Requests decoding at once (the batch width). Each holds a KV cache of --ctx-size
    /// positions; with --ram-budget all of them are counted in the budget.
    #[arg(long, default_value_t = 4)]
    pub(crate) parallel: usize,
    /// Requests that may wait for a slot beyond --parallel; more are answered 503 with
    /// Retry-After.
    #[arg(long, default_value_t = 64)]
    pub(crate) queue: usize,
    /// Each request's context in tokens (prompt + generated); 0 = the model's trained
    /// context, at most 4096 (give a number to go beyond). A longer prompt is answered 400
    /// before any work; generation stops when the context is full.
    #[arg(long, short = 'c', default_value_t = 0)]
    pub(crate) ctx_size: usize,
    /// Tokens per engine step: every decoding request's next token, then pieces of new
    /// prompts (chunked prefill, so a long prompt does not stall the others). Streaming
    /// caps it at 32.
    #[arg(long, default_value_t = 128)]
    pub(crate) step_tokens: usize,
    /// Request bodies larger than this many bytes are answered 413.
    #[arg(long, default_value_t = 1 << 20)]
    pub(crate) max_body_bytes: usize,
    /// The name /v1/models lists and responses carry (default: the model file's name).
    #[arg(long)]
    pub(crate) alias: Option<String>,
    /// Requests without a "mode" run dense (every FFN neuron) or sparse (the mask below;
    /// streamed, only its neurons are read). A request may ask for the other mode when the
    /// server has a mask: in RAM it always has one; streaming, only with --mode sparse.
    /// (compare is per request: POST /v1/infer with "mode": "compare".)
    #[arg(long, value_enum, default_value_t = ModeArg::Dense)]
    pub(crate) mode: ModeArg,
    #[command(flatten)]
    pub(crate) sparse: SparseArgs,
    /// Speculative decoding by prompt lookup for every request (as `run --lookup`): up to this
    /// many draft tokens per request and step, taken from its own context and verified in the
    /// step's pass (they count in --step-tokens). 0 = off.
    #[arg(long, default_value_t = 0)]
    pub(crate) lookup: usize,
    /// Speculative decoding with a draft model for every request (as `run --draft`): a small
    /// model sharing this model's vocabulary proposes up to --draft-max tokens per request and
    /// step (each request keeps its own draft state), verified in the step's pass (they count
    /// in --step-tokens). Greedy output unchanged, sampling exact.
    #[arg(long, conflicts_with = "lookup")]
    pub(crate) draft: Option<PathBuf>,
    /// The most tokens the draft model proposes per request and step.
    #[arg(long, default_value_t = 4, requires = "draft")]
    pub(crate) draft_max: usize,
    /// Seconds requests in flight may go on after SIGINT / SIGTERM before they are
    /// cancelled (they end with what they generated).
    #[arg(long, default_value_t = 10.0)]
    pub(crate) shutdown_grace: f64,
    /// Do not serve the chat page at GET / (answered 404 then); the API, /metrics and
    /// /stats are unchanged. The page (embedded in the binary, it fetches nothing from
    /// elsewhere) chats through /v1/chat/completions, streamed, and shows beside the chat
    /// what the last reply cost: tok/s, disk bytes per token, read rate beside the disk's,
    /// cache hit rate, batch width, queue depth, resident memory against the budget.
    #[arg(long)]
    pub(crate) no_webui: bool,
    #[command(flatten)]
    pub(crate) stream: StreamArgs,
}

/// `Perplexity`'s arguments (the subcommand's documentation is on [`Command::Perplexity`]).
#[derive(clap::Args)]
pub(crate) struct PerplexityArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Text file to score (e.g. data/wikitext-2/wiki.test.raw).
    #[arg(long)]
    pub(crate) text: PathBuf,
    /// Window length in tokens.
    #[arg(long, default_value_t = 512)]
    pub(crate) ctx: usize,
    /// Number of windows from the start of the text (0 = all).
    #[arg(long, default_value_t = 0)]
    pub(crate) windows: usize,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub(crate) json: bool,
    /// Stream a .gst model from disk under this RAM budget (as `run --ram-budget`; the KV
    /// cache of one window and one batch's activations are counted in it; windows are fed in
    /// batches of 32 tokens, so the result differs from the in-RAM one by rounding).
    #[arg(long, value_parser = size_arg)]
    pub(crate) ram_budget: Option<BudgetSize>,
    /// Reader when streaming: uring, pread or mmap (as `run --io`).
    #[arg(long, value_enum, default_value_t = IoArg::Uring)]
    pub(crate) io: IoArg,
}

/// `Reformat`'s arguments (the subcommand's documentation is on [`Command::Reformat`]).
#[derive(clap::Args)]
pub(crate) struct ReformatArgs {
    /// Source model: a .gguf file or a Hugging Face folder.
    pub(crate) input: PathBuf,
    /// The .gst file to write (written to a temporary file and renamed when complete).
    pub(crate) output: PathBuf,
    /// bundled: each neuron's up row and down column side by side (one read fetches both);
    /// split: up rows and down columns in separate neuron-major sections; rows: gate, up and
    /// down as the source stores them (no transpose, nothing re-quantized, no larger than the
    /// source): for dense streaming, no neuron-sparse reads.
    #[arg(long, value_enum, default_value_t = LayoutArg::Split)]
    pub(crate) ffn_layout: LayoutArg,
    /// Element type of the transposed down columns (re-quantized along hidden); `same` keeps
    /// the source's down type.
    #[arg(long, value_enum, default_value_t = DownArg::Q8_0)]
    pub(crate) down_type: DownArg,
    /// Neuron order within each layer: original, or hot-first (needs --calibrate).
    #[arg(long, value_enum, default_value_t = OrderArg::Original)]
    pub(crate) order: OrderArg,
    /// Calibration text run through the dense model (its LAST --calibrate-tokens tokens, so it
    /// does not overlap perplexity windows taken from the start of the same file).
    #[arg(long)]
    pub(crate) calibrate: Option<PathBuf>,
    /// Tokens of calibration text.
    #[arg(long, default_value_t = 2048)]
    pub(crate) calibrate_tokens: usize,
    /// Convert every matrix of a safetensors source to this type (default: as stored).
    #[arg(long = "type", value_enum)]
    pub(crate) matrix_type: Option<TypeArg>,
    /// Also store a compact 2-bit copy of every up row (12 bytes per 32 values) for cheap
    /// estimates of up·x when choosing neurons.
    #[arg(long, value_enum, default_value_t = SketchArg::None)]
    pub(crate) up_sketch: SketchArg,
    /// Replace OUTPUT if it exists.
    #[arg(long)]
    pub(crate) force: bool,
    /// Worker threads for calibration (0 = one per core; at most 1024).
    #[arg(long, default_value_t = 0, value_parser = threads_arg)]
    pub(crate) threads: usize,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `MakeModel`'s arguments (the subcommand's documentation is on [`Command::MakeModel`]).
#[derive(clap::Args)]
pub(crate) struct MakeModelArgs {
    /// The file to write: .gguf or .gst (written to a temporary file and renamed when
    /// complete; --format overrides the extension).
    pub(crate) output: PathBuf,
    /// A named shape, or `custom` with --hidden, --ffn, --layers, --heads, --kv-heads (and
    /// optionally --head-dim, --vocab, --arch, --experts/--experts-used).
    #[arg(long)]
    pub(crate) shape: String,
    /// The type mix, by llama.cpp's per-tensor rules for its file type: q4_k_m (Q6_K output
    /// and some attn_v/ffn_down), q6_k, q8_0, q3_k_m, q2_k, iq4_xs, iq2_xxs, or mxfp4_moe
    /// (MXFP4 experts, Q8_0 elsewhere: how gpt-oss is published; the default for the gpt-oss
    /// shapes).
    #[arg(long, value_enum)]
    pub(crate) mix: Option<MixArg>,
    /// gguf or gst (default: from OUTPUT's extension).
    #[arg(long, value_enum)]
    pub(crate) format: Option<ModelFormatArg>,
    /// With a .gst: the FFN layout (as `reformat --ffn-layout`).
    #[arg(long, value_enum, default_value_t = LayoutArg::Split)]
    pub(crate) ffn_layout: LayoutArg,
    /// With a .gst in the split or bundled layout: the down columns' type (as `reformat`).
    #[arg(long, value_enum, default_value_t = DownArg::Q8_0)]
    pub(crate) down_type: DownArg,
    /// A GGUF whose tokenizer to take (its vocabulary padded with unused tokens up to the
    /// shape's), or `synthetic` (made-up pieces and bytes, for exact small vocabularies).
    /// Default: Qwen2.5-Coder-1.5B's for the Qwen shapes, SmolLM2's for the others (as
    /// tools/fetch-models.sh fetches them).
    #[arg(long)]
    pub(crate) tokenizer: Option<String>,
    /// Custom shapes: llama, qwen2, qwen3, qwen3moe, olmoe, glm4moe (GLM-4.5: sigmoid
    /// routing with a score bias, renormalized; a shared expert; leading dense layers;
    /// half of each head rotated; Q/K/V biases), deepseek2 (latent attention: --mla; with
    /// --experts, routed as glm4moe, without its biases and partial RoPE) or gpt-oss (sliding
    /// window 128 on even layers, YaRN factor 32 from 4096, as the released models).
    #[arg(long, value_enum, default_value_t = MakeArchArg::Llama)]
    pub(crate) arch: MakeArchArg,
    #[arg(long)]
    pub(crate) hidden: Option<usize>,
    /// The FFN width (each expert's in a mixture of experts).
    #[arg(long)]
    pub(crate) ffn: Option<usize>,
    #[arg(long)]
    pub(crate) layers: Option<usize>,
    #[arg(long)]
    pub(crate) heads: Option<usize>,
    #[arg(long)]
    pub(crate) kv_heads: Option<usize>,
    /// Default: hidden / heads.
    #[arg(long)]
    pub(crate) head_dim: Option<usize>,
    /// Default: the tokenizer's.
    #[arg(long)]
    pub(crate) vocab: Option<usize>,
    /// Experts per layer (custom mixture-of-experts shapes).
    #[arg(long)]
    pub(crate) experts: Option<usize>,
    #[arg(long)]
    pub(crate) experts_used: Option<usize>,
    /// Custom glm4moe shapes: the first layers with a dense FFN (default 1).
    #[arg(long)]
    pub(crate) leading_dense: Option<usize>,
    /// Custom glm4moe shapes: the leading dense layers' FFN width (default 4 x --ffn).
    #[arg(long)]
    pub(crate) dense_ffn: Option<usize>,
    /// Custom glm4moe shapes: shared experts, of the experts' width (default 1).
    #[arg(long)]
    pub(crate) shared_experts: Option<usize>,
    /// Custom shapes: the leading dimensions of each head RoPE rotates (glm4moe default:
    /// half the head).
    #[arg(long)]
    pub(crate) rope_dim: Option<usize>,
    /// Custom shapes: Llama 3's RoPE frequency factors (`rope_freqs.weight`) by Llama 3.1's
    /// rule, as FACTOR,LOW,HIGH,CONTEXT (Llama 3.1's own: 8,1,4,8192).
    #[arg(long, value_name = "FACTOR,LOW,HIGH,CONTEXT")]
    pub(crate) rope_factors: Option<String>,
    /// Custom deepseek2 shapes: multi-head latent attention's widths, as
    /// Q_LORA,KV_LORA,QK_NOPE,QK_ROPE,V_HEAD (DeepSeek-V3's: 1536,512,128,64,128; Q_LORA 0:
    /// no query bottleneck, as V2-Lite). --kv-heads and --head-dim follow from them.
    #[arg(long, value_name = "Q_LORA,KV_LORA,QK_NOPE,QK_ROPE,V_HEAD")]
    pub(crate) mla: Option<String>,
    /// Write the GGUF's header and leave its tensor data a hole (a sparse file reading as
    /// zeros, taking no disk room): for a model too large for this disk (DeepSeek-V3,
    /// Kimi-K2), what `run --ram-budget` plans and reads for it. Its output and speed mean
    /// nothing.
    #[arg(long)]
    pub(crate) header_only: bool,
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Replace OUTPUT if it exists.
    #[arg(long)]
    pub(crate) force: bool,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `MakeMoe`'s arguments (the subcommand's documentation is on [`Command::MakeMoe`]).
#[derive(clap::Args)]
pub(crate) struct MakeMoeArgs {
    /// Dense source: a llama-architecture .gguf (default: SmolLM2-135M-Instruct, as fetched by
    /// tools/fetch-models.sh smollm2).
    #[arg(long, short)]
    pub(crate) model: Option<PathBuf>,
    /// The .gguf to write (through a temporary file renamed when complete).
    pub(crate) output: PathBuf,
    /// Architecture written: llama (Mixtral-style: renormalized top-K), qwen2moe (shared
    /// expert, not renormalized), qwen3moe (per-head QK-norm, renormalized), olmoe (QK-norm over
    /// the whole projection, not renormalized).
    #[arg(long, value_enum, default_value_t = MoeArchArg::Qwen3moe)]
    pub(crate) arch: MoeArchArg,
    /// Experts per layer.
    #[arg(long, default_value_t = 4)]
    pub(crate) experts: usize,
    /// Experts each token uses.
    #[arg(long, default_value_t = 2)]
    pub(crate) used: usize,
    /// Type of the expert matrices (random models: of every matrix but the router).
    #[arg(long = "type", value_enum, default_value_t = MoeTypeArg::Q8_0)]
    pub(crate) ty: MoeTypeArg,
    /// Random weights instead of the source's: HIDDEN,FFN,LAYERS,HEADS,KV_HEADS (FFN: each
    /// expert's neurons), e.g. 2048,1024,16,16,16 for an OLMoE-1B-7B shape.
    #[arg(long, value_parser = random_shape_arg)]
    pub(crate) random: Option<gatestream::synth::RandomShape>,
    /// Each expert's values are the dense ones times 1 + PERTURB·N(0,1).
    #[arg(long, default_value_t = 0.05)]
    pub(crate) perturb: f32,
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Replace OUTPUT if it exists.
    #[arg(long)]
    pub(crate) force: bool,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `Eval`'s arguments (the subcommand's documentation is on [`Command::Eval`]).
#[derive(clap::Args)]
pub(crate) struct EvalArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Text file (e.g. data/wikitext-2/wiki.test.raw); windows come from its start,
    /// threshold calibration from its end.
    #[arg(long)]
    pub(crate) text: PathBuf,
    #[arg(long, default_value_t = 512)]
    pub(crate) ctx: usize,
    /// Number of windows (0 = all).
    #[arg(long, default_value_t = 20)]
    pub(crate) windows: usize,
    /// Comma-separated sparsity levels (share of FFN neurons dropped); 0 is the dense row.
    #[arg(long, default_value = "0,0.3,0.5,0.7", value_delimiter = ',')]
    pub(crate) sparsity: Vec<f32>,
    /// Comma-separated strategies: topk (per token), threshold (per-layer calibrated),
    /// union (the context's choices reused).
    #[arg(long, value_enum, default_value = "topk", value_delimiter = ',')]
    pub(crate) strategy: Vec<StrategyArg>,
    /// Comma-separated criteria: gate |act(g)|, exact |act(g)·up|, candidates (gate top
    /// 1.4x, then exact), sketch |act(g)·û| with a 2-bit up sketch.
    #[arg(long, value_enum, default_value = "gate,exact", value_delimiter = ',')]
    pub(crate) criterion: Vec<CriterionArg>,
    /// Tokens from the END of the text used to calibrate thresholds.
    #[arg(long, default_value_t = 2048)]
    pub(crate) calibrate_tokens: usize,
    /// Mixture-of-experts models: comma-separated counts of experts per token to measure
    /// besides the model's own (each with every neuron, and with every mask inside the
    /// routed experts); default: the model's own count halved down to 1 (8 → 4,2,1).
    /// Refused for dense models.
    #[arg(long, value_delimiter = ',')]
    pub(crate) experts: Option<Vec<usize>>,
    /// Also evaluate top-K with per-layer budgets (levels allocated by each layer's measured
    /// sensitivity on this many tokens from the end of the text, same mean and bytes as the
    /// uniform level); 0 = off.
    #[arg(long, default_value_t = 0)]
    pub(crate) per_layer_tokens: usize,
    /// Quality budget for the frontier line: the largest perplexity increase, in percent.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) max_ppl_increase: f64,
    /// Also draw perplexity increase against FFN bytes per token, one line per strategy and
    /// criterion, as an SVG file.
    #[arg(long)]
    pub(crate) plot: Option<PathBuf>,
    /// Store the frontier configuration in the model's .gst file as the default for
    /// `run --mode sparse` (safe rewrite of the file).
    #[arg(long)]
    pub(crate) store: bool,
    /// Store the frontier configuration in this .gst file instead: the evaluated model must
    /// be the file it was converted from (checked by length and xxh3), e.g. evaluate the
    /// GGUF (its batched kernels are faster) and store in the .gst made from it.
    #[arg(long, value_name = "FILE.gst", conflicts_with = "store")]
    pub(crate) store_in: Option<PathBuf>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Save progress here after every window; if the file exists and belongs to the same
    /// evaluation (model, text, levels, strategies, criteria, windows), continue from it.
    /// Removed once the report is written. Default with --json: FILE.checkpoint beside it.
    #[arg(long)]
    pub(crate) checkpoint: Option<PathBuf>,
    /// Evaluate at most N windows in this run, then stop with progress saved in the
    /// checkpoint (run the same command again to continue): a long evaluation in parts.
    #[arg(long, value_name = "N")]
    pub(crate) windows_this_run: Option<usize>,
    /// Also run every configuration N more times with its neuron scores changed at rounding
    /// level (a relative 1e-6, fixed per seed, layer and neuron) and print the spread of the
    /// perplexity increase: differences between rows smaller than it are noise. Costs N
    /// times the sparse passes.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) jitter_seeds: usize,
    /// Stream a .gst model from disk under this RAM budget (as `run --ram-budget`): every
    /// pass — windows, threshold calibration, per-layer sensitivity — reads what is not
    /// resident, in batches of 32 tokens (results differ from in RAM by rounding).
    #[arg(long, value_parser = size_arg)]
    pub(crate) ram_budget: Option<BudgetSize>,
    /// Reader when streaming: uring, pread or mmap (as `run --io`).
    #[arg(long, value_enum, default_value_t = IoArg::Uring)]
    pub(crate) io: IoArg,
}

/// `Recommend`'s arguments (the subcommand's documentation is on [`Command::Recommend`]).
#[derive(clap::Args)]
pub(crate) struct RecommendArgs {
    /// The report written by `gatestream eval --json`. Repeat it for an evaluation run in
    /// parts (same model, text, windows and context; e.g. one strategy per run): the
    /// frontier is taken over all of their rows.
    #[arg(long, required = true)]
    pub(crate) report: Vec<PathBuf>,
    /// The .gst file to store the recommendation in (safe rewrite).
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Quality budget: the largest perplexity increase over dense, in percent.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) max_ppl_increase: f64,
}

/// `Bench`'s arguments (the subcommand's documentation is on [`Command::Bench`]).
#[derive(clap::Args)]
pub(crate) struct BenchArgs {
    /// The .gst model file.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Traces to replay (from `run --record-trace`). Without any, one trace per --sparsity is
    /// made by running the model over the start of --text (a mixture-of-experts model: one
    /// routing trace).
    #[arg(long)]
    pub(crate) trace: Vec<PathBuf>,
    /// Text for the built-in traces (default: data/wikitext-2/wiki.test.raw).
    #[arg(long)]
    pub(crate) text: Option<PathBuf>,
    /// Tokens of --text each built-in trace covers.
    #[arg(long, default_value_t = 64)]
    pub(crate) trace_tokens: usize,
    /// Comma-separated sparsity levels for built-in traces.
    #[arg(long, default_value = "0.3,0.5,0.7", value_delimiter = ',')]
    pub(crate) sparsity: Vec<f32>,
    /// Mask strategy for built-in traces.
    #[arg(long, value_enum, default_value_t = StrategyArg::Topk)]
    pub(crate) strategy: StrategyArg,
    /// Mask criterion for built-in traces (exact reads up for every neuron).
    #[arg(long, value_enum, default_value_t = CriterionArg::Gate)]
    pub(crate) criterion: CriterionArg,
    /// Tokens of each trace replayed per pass.
    #[arg(long, default_value_t = 16)]
    pub(crate) tokens: usize,
    /// Comma-separated engines: uring, pread, mmap.
    #[arg(
        long,
        value_enum,
        default_value = "uring,pread,mmap",
        value_delimiter = ',',
        hide_possible_values = true
    )]
    pub(crate) engines: Vec<IoArg>,
    /// io_uring queue depths to sweep (pread and mmap run at the deepest; io_uring also runs
    /// once there without registered buffers).
    #[arg(long, default_value = "1,8,32,64", value_delimiter = ',')]
    pub(crate) queue_depths: Vec<usize>,
    /// Leave the gate matrix out of both transfers (as when it is resident); by default it
    /// is read in full every token in both.
    #[arg(long)]
    pub(crate) gate_resident: bool,
    /// Neurons per layer held by a simulated LRU neuron cache in sparse replay (0 = none).
    #[arg(long, default_value_t = 0)]
    pub(crate) cache_neurons: usize,
    /// Override the probed planner's merge gap (see `run --help`).
    #[arg(long)]
    pub(crate) merge_gap_bytes: Option<u64>,
    /// Submit each token's reads as one batch instead of one per layer (streaming cannot; this
    /// shows what the per-layer round trips cost). Per-layer times are then not measured.
    #[arg(long)]
    pub(crate) token_batches: bool,
    /// Only the device's own curve, on any file (a .gst or a GGUF): sequential reads of
    /// 256 KiB, 1 MiB and 4 MiB at queue depths 4, 16 and 64 (256 MB each; --quick: 64 MB),
    /// then random reads of 4 KiB to 1 MiB — what streaming's read rate is compared with.
    #[arg(long)]
    pub(crate) device_only: bool,
    /// Small and fast (a CI smoke test): 2 tokens, queue depths 8 and 64, a 16-token trace at
    /// 0.5, a short baseline.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Mixture-of-experts models: expert cache sizes replayed, each with the lru and the
    /// frequency policy (0: no cache), as counts of experts or shares of all of them (40%).
    /// The traces are routing traces (`run --record-trace` on such a model; built in: the
    /// model's own routing over --text).
    #[arg(long, default_value = "0,10%,30%", value_delimiter = ',')]
    pub(crate) cache_experts: Vec<String>,
    /// Write every figure and the setup as JSON to this file.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Draw per-layer time (dense vs sparse) and throughput vs queue depth as an SVG file
    /// (mixture-of-experts models: disk bytes per token against the expert cache's size).
    #[arg(long)]
    pub(crate) plot: Option<PathBuf>,
    /// cuda or wgpu: also measure the host-to-device link in the same run — copy bandwidth from
    /// pageable and from pinned host memory (wgpu: through its queue, which stages the host's
    /// bytes itself, so both columns are the same copies), 4 KiB to 64 MiB per copy (--quick:
    /// 64 KiB, 1 MiB, 16 MiB) — printed and written to --json (`link`). cpu (default): disk
    /// only.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub(crate) device: DeviceArg,
}

/// `Calibrate`'s arguments (the subcommand's documentation is on [`Command::Calibrate`]).
#[derive(clap::Args)]
pub(crate) struct CalibrateArgs {
    /// The .gst file to calibrate (rewritten in place).
    #[arg(long, short)]
    pub(crate) model: PathBuf,
    /// Calibration text, e.g. data/wikitext-2/wiki.test.raw.
    #[arg(long)]
    pub(crate) text: PathBuf,
    /// Tokens of text, taken from its end.
    #[arg(long, default_value_t = 2048)]
    pub(crate) tokens: usize,
    /// Worker threads (0 = one per core; at most 1024).
    #[arg(long, default_value_t = 0, value_parser = threads_arg)]
    pub(crate) threads: usize,
}

/// `Inspect`'s arguments (the subcommand's documentation is on [`Command::Inspect`]).
#[derive(clap::Args)]
pub(crate) struct InspectArgs {
    pub(crate) file: PathBuf,
    /// Print the whole index as JSON on stdout.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `Verify`'s arguments (the subcommand's documentation is on [`Command::Verify`]).
#[derive(clap::Args)]
pub(crate) struct VerifyArgs {
    pub(crate) file: PathBuf,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum LayoutArg {
    Bundled,
    Split,
    Rows,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum MixArg {
    #[value(name = "q4_k_m")]
    Q4KM,
    #[value(name = "q6_k")]
    Q6K,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "mxfp4_moe")]
    Mxfp4Moe,
    #[value(name = "q2_k")]
    Q2K,
    #[value(name = "q3_k_m")]
    Q3KM,
    #[value(name = "iq4_xs")]
    IQ4XS,
    #[value(name = "iq2_xxs")]
    IQ2XXS,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum ModelFormatArg {
    Gguf,
    Gst,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum MakeArchArg {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3moe,
    Olmoe,
    Deepseek2,
    Glm4moe,
    #[value(name = "gpt-oss")]
    GptOss,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum DownArg {
    #[value(name = "q8_0")]
    Q8_0,
    F16,
    Same,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum OrderArg {
    Original,
    HotFirst,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ModeArg {
    Dense,
    Sparse,
    Compare,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum IoArg {
    Uring,
    Pread,
    Mmap,
}

/// `--cost-model`: probe, default, or a bench report's baseline.
pub(crate) fn cost_source(arg: &str) -> anyhow::Result<CostSource> {
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
pub(crate) enum ResidencyArg {
    GateFirst,
    CacheFirst,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum HybridArg {
    Auto,
    Off,
    CpuCold,
    GpuStream,
}

impl HybridArg {
    pub(crate) fn mode(self) -> gatestream::stream::hybrid::HybridMode {
        use gatestream::stream::hybrid::HybridMode;
        match self {
            HybridArg::Auto => HybridMode::Auto,
            HybridArg::Off => HybridMode::Off,
            HybridArg::CpuCold => HybridMode::CpuCold,
            HybridArg::GpuStream => HybridMode::GpuStream,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum CacheArg {
    Lru,
    Pinned,
    Frequency,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum StrategyArg {
    Topk,
    Threshold,
    Union,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum CriterionArg {
    Gate,
    Exact,
    Candidates,
    Sketch,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum SketchArg {
    None,
    #[value(name = "2bit")]
    TwoBit,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum TypeArg {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum MoeArchArg {
    Llama,
    Qwen2moe,
    Qwen3moe,
    Olmoe,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum MoeTypeArg {
    F32,
    F16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_k")]
    Q4K,
    #[value(name = "q6_k")]
    Q6K,
}

fn random_shape_arg(s: &str) -> Result<gatestream::synth::RandomShape, String> {
    let v: Vec<usize> = s
        .split(',')
        .map(|x| x.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("`{s}`: {e}; expected HIDDEN,FFN,LAYERS,HEADS,KV_HEADS"))?;
    match v[..] {
        [hidden, ffn, layers, heads, kv_heads] if v.iter().all(|&x| x > 0) => Ok(gatestream::synth::RandomShape {
            hidden,
            ffn,
            layers,
            heads,
            kv_heads,
        }),
        _ => Err(format!(
            "`{s}`: expected five positive numbers HIDDEN,FFN,LAYERS,HEADS,KV_HEADS"
        )),
    }
}

pub(crate) fn strategy_of(s: StrategyArg) -> Strategy {
    match s {
        StrategyArg::Topk => Strategy::TopK,
        StrategyArg::Threshold => Strategy::Threshold,
        StrategyArg::Union => Strategy::Union,
    }
}

pub(crate) fn criterion_of(c: CriterionArg) -> Criterion {
    match c {
        CriterionArg::Gate => Criterion::Gate,
        CriterionArg::Exact => Criterion::Exact,
        CriterionArg::Candidates => Criterion::Candidates,
        CriterionArg::Sketch => Criterion::Sketch,
    }
}

/// The mask of sparse mode (`run`, `serve`).
#[derive(clap::Args)]
pub(crate) struct SparseArgs {
    /// Share of FFN neurons dropped per layer.
    ///
    /// Share of FFN neurons dropped per layer in sparse mode. Without --sparsity, --strategy
    /// and --criterion, a .gst file's recommendation (stored by `eval --store` or
    /// `recommend`) is used, else topk / exact / 0.3.
    #[arg(help_heading = "Sparsity", long)]
    pub(crate) sparsity: Option<f32>,
    /// Mask strategy: topk, threshold or union.
    ///
    /// Mask strategy in sparse mode: topk (per token), threshold (per-layer thresholds stored
    /// by calibration in a .gst file), union (the prompt's choices reused while decoding; `run`
    /// only: a server decodes several requests at once).
    #[arg(help_heading = "Sparsity", long, value_enum)]
    pub(crate) strategy: Option<StrategyArg>,
    /// How neurons are scored: gate, exact, candidates, sketch.
    ///
    /// How neurons are scored in sparse mode: gate |act(g)|, exact |act(g)·up|, candidates,
    /// sketch (see `gatestream eval --help`).
    #[arg(help_heading = "Sparsity", long, value_enum)]
    pub(crate) criterion: Option<CriterionArg>,
}

impl SparseArgs {
    pub(crate) fn ask(&self) -> gatestream::runtime::SparseAsk {
        gatestream::runtime::SparseAsk {
            strategy: self.strategy.map(strategy_of),
            criterion: self.criterion.map(criterion_of),
            sparsity: self.sparsity,
        }
    }
}

impl Command {
    /// The `--cuda-opt` items of a command that opens a device.
    pub(crate) fn cuda_opts(&self) -> &[String] {
        match self {
            Command::Run(RunArgs { model, .. })
            | Command::Serve(ServeArgs { model, .. })
            | Command::Perplexity(PerplexityArgs { model, .. })
            | Command::Eval(EvalArgs { model, .. }) => &model.cuda_opt,
            _ => &[],
        }
    }

    /// Whether the command streams a model under a RAM budget (`--ram-budget`).
    pub(crate) fn streams(&self) -> bool {
        match self {
            Command::Run(RunArgs { stream, .. }) | Command::Serve(ServeArgs { stream, .. }) => stream.streams(),
            Command::Perplexity(PerplexityArgs { ram_budget, .. }) | Command::Eval(EvalArgs { ram_budget, .. }) => {
                ram_budget.is_some()
            }
            _ => false,
        }
    }
}

/// How `run` streams.
#[derive(clap::Args)]
pub(crate) struct StreamArgs {
    /// Stream from disk under this RAM budget (700M, 40%, auto, off).
    ///
    /// Stream the model (a GGUF or a Hugging Face folder as downloaded, or a .gst) from disk
    /// under this RAM budget: bytes (700M, 1.5G, 512MiB) or a share of the model (40%); `auto`
    /// (the default) or `off`.
    /// Resident, in this order while the budget lasts: the output matrix and norms (required),
    /// attention, gate matrices, a neuron cache (a GGUF's FFN matrices whole); everything else
    /// is read per token. A mixture-of-experts model keeps everything but its routed experts
    /// resident and gives the rest of the budget to a cache of whole experts; each layer reads
    /// only the experts its tokens were routed to that the cache lacks. Refused, with the
    /// minimum, when too small. auto: the model runs in RAM (memory-mapped) when it, its
    /// context and 256 MiB fit in what this process may use (the tighter of its cgroup's
    /// memory limit and MemAvailable; GATESTREAM_MEMORY_LIMIT=bytes overrides), else streams
    /// under that less a tenth (at least 128 MiB); the choice is printed and in --json
    /// (`placement`), and a streamed run's expected speed (the disk's rate, measured at open,
    /// over a token's reads: `expected: …`, `placement.expected`). off: in RAM.
    #[arg(help_heading = "Streaming and GPU", long, value_parser = ram_budget_arg)]
    pub(crate) ram_budget: Option<RamBudget>,
    /// With --device cuda or wgpu: the GPU memory the model may use (auto, on CUDA: what fits
    /// its free memory).
    ///
    /// With --device cuda or wgpu: the GPU memory the model may use, as --ram-budget's sizes (40% is a
    /// share of the file). Required on the GPU: norms, the KV cache and one batch's
    /// activations, room for one layer's weights copied for one use; then, while the budget
    /// lasts, the output matrix, attention and gate matrices (only those the host keeps
    /// resident; for a mixture-of-experts model each layer's router and shared expert take the
    /// gate's place), then hot neurons: each layer's first neurons (the hot prefix of a file
    /// reformatted hot-first), as many as the rest allows, split evenly over layers, up to what
    /// the host caches; a step computes them on the GPU and streams only the other neurons'
    /// rows. Every other weight (FFN rows, routed experts) is copied from host memory
    /// at each use; a sparse decode step's FFN rows through page-locked staging, in chunks
    /// copied while the rest is still being read. Without --ram-budget the whole model is held
    /// in host RAM (the FFN rows page-locked and mapped for the GPU) and streams from there:
    /// dense steps copy each layer's rows, sparse decode steps' products read only the kept rows,
    /// in place, across the link (--map-host off: staged and copied instead); with
    /// it, from disk as --ram-budget plans. Refused, with the minimum, when too small, and for
    /// the CPU device. auto (or absent, with automatic host placement): the GPU holds every
    /// weight the host holds when they, the context and a reserve (a twentieth of its free
    /// memory, 256 MiB to 2 GiB) fit in its free memory, else a budget of its free memory less
    /// the reserve; the choice is printed and in --json (`placement.gpu`). wgpu tells no free
    /// memory: there auto holds the whole model on the device.
    #[arg(help_heading = "Streaming and GPU", long, value_parser = vram_budget_arg)]
    pub(crate) vram_budget: Option<VramBudget>,
    /// Where what the GPU does not keep computes.
    ///
    /// With --vram-budget: where the weights the GPU does not keep are computed. cpu-cold: by
    /// the CPU, where they lie in host memory (with --ram-budget, as they are read), while the
    /// GPU computes attention and what it keeps; only activations cross the link. A dense model:
    /// the FFN rows past the GPU's hot neurons (the layer's input and gate to the host, the
    /// CPU's partial output of `hidden` values a token back); dense steps, and sparse decode
    /// steps whose mask picks from the gate (top-K) when the host holds the whole model (no
    /// --ram-budget); not the rows layout. A mixture of experts: every routed expert, cached or
    /// read (its output rows back), unless a neuron mask runs inside the experts. gpu-stream (or
    /// off): copied to the GPU at each use. auto (default): a cost model measured at start (the
    /// CPU's time for a layer's share at 1 and 8 tokens, the link's pinned copy rate) gives each
    /// pass width to the faster side and is printed: decode and narrow batches on the CPU when
    /// it beats the link, wide prompt batches on the GPU (auto says why where it cannot run).
    #[arg(help_heading = "Streaming and GPU", long, value_enum, default_value_t = HybridArg::Auto)]
    pub(crate) hybrid: HybridArg,
    /// Reader when streaming: uring, pread or mmap.
    ///
    /// Reader when streaming: uring (io_uring, O_DIRECT, registered buffers; falls back to
    /// pread with a warning), pread (thread pool, O_DIRECT), mmap (page cache: the walk path).
    #[arg(help_heading = "Streaming and GPU", long, value_enum, default_value_t = IoArg::Uring)]
    pub(crate) io: IoArg,
    /// Reads in flight at once when streaming.
    #[arg(
        help_heading = "Streaming and GPU",
        hide_short_help = true,
        long,
        default_value_t = 64
    )]
    pub(crate) queue_depth: usize,
    /// Neuron or expert cache policy when streaming.
    ///
    /// Neuron cache when streaming: lru (recently used neurons, replaced as others are read;
    /// default in sparse mode) or pinned (the file's first neurons — the hot prefix of a
    /// hot-first file — never replaced; default in dense mode). For a mixture-of-experts model
    /// the cache holds whole experts: lru (default) or frequency (the expert routed to least
    /// often since start goes first, the least recently used among equals).
    #[arg(help_heading = "Streaming and GPU", long, value_enum)]
    pub(crate) cache: Option<CacheArg>,
    /// What the budget keeps first after attention.
    ///
    /// After attention, what the budget keeps first: gate-first (gate matrices, then the
    /// neuron cache) or cache-first (the neuron cache, then gates). Dense streaming saves the
    /// same bytes either way; sparse streaming usually gains from cache-first, since cached
    /// neurons spare scattered reads and a streamed gate is one sequential read.
    #[arg(help_heading = "Streaming and GPU", hide_short_help = true, long, value_enum, default_value_t = ResidencyArg::CacheFirst)]
    pub(crate) residency: ResidencyArg,
    /// Read through gaps between needed rows shorter than this.
    ///
    /// The read planner reads through gaps between needed rows shorter than this, rather
    /// than issuing another request. Default: the cost model's per-request time x bandwidth
    /// (printed at start-up; ~10–55 KB on this machine's virtio disk); 0 reads only needed rows.
    #[arg(help_heading = "Streaming and GPU", hide_short_help = true, long)]
    pub(crate) merge_gap_bytes: Option<u64>,
    /// The read planner's cost model.
    ///
    /// The read planner's cost model: probe (measure per-request cost and bandwidth on the
    /// model file at start-up: 1024 random 4 KiB reads in batches of 256, twice, and 32 MiB
    /// sequential; ~0.1 s), default (13 µs per request at 1.5 GB/s: the development machine's
    /// virtio disk, conservatively; docs/DESIGN.md), or a `gatestream bench --json` report (its device
    /// baseline: sequential 1 MiB bandwidth and the time per 4 KiB random read at QD 64).
    #[arg(
        help_heading = "Streaming and GPU",
        hide_short_help = true,
        long,
        default_value = "probe",
        value_name = "probe|default|BENCH.json"
    )]
    pub(crate) cost_model: String,
    /// Save the neurons or experts each token used, for bench.
    ///
    /// Save which FFN neurons every token used, per layer (prompt and generated tokens), for
    /// `gatestream bench --trace FILE`; a mixture-of-experts model saves which experts each
    /// token was routed to (a routing trace). In compare mode the second run's.
    #[arg(help_heading = "Streaming and GPU", hide_short_help = true, long)]
    pub(crate) record_trace: Option<PathBuf>,
    /// Read the next layer's predicted neurons or experts ahead.
    ///
    /// Sparse streaming: while a layer computes, predict the next layer's neurons (its
    /// resident gate applied to this layer's FFN input) and read them on a third reader, so
    /// the next layer reads only what the prediction missed. Costs two more layers of FFN
    /// rows in the budget and one more gate product per layer; reports hit rate and bytes
    /// read in vain. Exact-criterion masks are predicted perfectly (they read every up row).
    /// Mixture of experts (decoding): the next layer's router applied to this layer's FFN
    /// input picks the experts to read ahead on the prefetch thread; costs two tokens' worth
    /// of experts in the budget and one router product per layer.
    #[arg(help_heading = "Streaming and GPU", long)]
    pub(crate) lookahead: bool,
    /// Layers read ahead while one computes.
    ///
    /// Layers whose streamed weights are read ahead while one computes (each one more
    /// prefetch buffer of the largest layer's streamed bytes in the budget). With 2 or more
    /// the reads of one layer start while the last reads of the one before are still in
    /// flight, so the disk never waits between layers.
    #[arg(help_heading = "Streaming and GPU", long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub(crate) read_ahead: u16,
    /// Bytes of each prefetch read (default 1 MiB).
    ///
    /// Bytes of each read the prefetch thread issues (whole blocks land straight in its
    /// buffers, so reads are not bounded by the reader's slots); default 1 MiB.
    #[arg(help_heading = "Streaming and GPU", hide_short_help = true, long, value_parser = read_bytes_arg)]
    pub(crate) read_bytes: Option<usize>,
}

/// `--ram-budget` of `run` and `serve`: automatic placement (`auto`, as when absent), in RAM
/// (`off`), or a budget to stream under.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum RamBudget {
    Auto,
    Off,
    Size(BudgetSize),
}

/// `--vram-budget`: what fits the GPU's free memory (`auto`, as when absent), or a budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum VramBudget {
    Auto,
    Size(BudgetSize),
}

/// `--ram-budget` of `run` and `serve`: auto, off, or a size ([`BudgetSize::parse`]).
fn ram_budget_arg(s: &str) -> Result<RamBudget, String> {
    match s {
        "auto" => Ok(RamBudget::Auto),
        "off" => Ok(RamBudget::Off),
        _ => size_arg(s)
            .map(RamBudget::Size)
            .map_err(|e| format!("{e}, auto or off")),
    }
}

/// `--vram-budget`: auto, or a size ([`BudgetSize::parse`]).
fn vram_budget_arg(s: &str) -> Result<VramBudget, String> {
    match s {
        "auto" => Ok(VramBudget::Auto),
        _ => size_arg(s).map(VramBudget::Size).map_err(|e| format!("{e}, or auto")),
    }
}

/// A budget's size: bytes (700M, 1.5G, 512MiB) or a share of the model file (40%).
fn size_arg(s: &str) -> Result<BudgetSize, String> {
    BudgetSize::parse(s).ok_or_else(|| BudgetSize::EXPECTED.to_string())
}

/// `--read-bytes`: a size (256K, 1M, 4MiB) of at least 4 KiB and at most 64 MiB.
fn read_bytes_arg(s: &str) -> Result<usize, String> {
    let b = gatestream::stream::residency::parse_budget_for("--read-bytes", s, 0).map_err(|e| e.to_string())?;
    if !(4096..=64 << 20).contains(&b) {
        return Err(format!("{s}: give 4K to 64M"));
    }
    Ok(b as usize)
}

impl StreamArgs {
    /// Whether a flag asks the model to stream (through host RAM from disk, or from host RAM
    /// to a GPU); automatic placement may choose to stream too (`auto_placement`).
    pub(crate) fn streams(&self) -> bool {
        matches!(self.ram_budget, Some(RamBudget::Size(_))) || matches!(self.vram_budget, Some(VramBudget::Size(_)))
    }
}

pub(crate) fn engine_of(io: IoArg) -> ReadEngine {
    match io {
        IoArg::Uring => ReadEngine::Uring,
        IoArg::Pread => ReadEngine::Pread,
        IoArg::Mmap => ReadEngine::Mmap,
    }
}

/// The most worker threads a pool is asked for: beyond this, starting them fails (or thrashes).
const THREADS_MAX: usize = 1024;

/// `--threads`: 0 (one per core) to [`THREADS_MAX`].
fn threads_arg(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|_| format!("`{s}` is not a thread count"))?;
    if n > THREADS_MAX {
        return Err(format!(
            "{n} threads is more than the {THREADS_MAX} a pool may start (0 = one per core)"
        ));
    }
    Ok(n)
}
