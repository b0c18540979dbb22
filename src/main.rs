//! The `gatestream` command line: parses arguments, calls the library, prints. Nothing here
//! computes; everything it does is a library call tests can make too.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use gatestream::model::generate::GenerateOptions;
use gatestream::model::sampler::SamplerConfig;
use gatestream::model::{LoadOptions, Model};
use gatestream::perplexity::{perplexity, PerplexityOptions};

#[derive(Parser)]
#[command(
    name = "gatestream",
    version,
    about = "Run language models from GGUF or safetensors on the CPU (streaming and sparsity are on the way)"
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
    },
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

fn load(args: &ModelArgs) -> anyhow::Result<Model> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => default_model()?,
    };
    let t = std::time::Instant::now();
    let model = Model::load(&path, &LoadOptions { threads: args.threads })?;
    let c = &model.config;
    eprintln!(
        "loaded {} ({}, {} layers, hidden {}, ffn {}, vocab {}) in {:.2} s on {}",
        path.display(),
        c.arch.name(),
        c.n_layers,
        c.hidden,
        c.ffn,
        c.vocab,
        t.elapsed().as_secs_f64(),
        model.backend.name()
    );
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
            json,
        } => {
            if !(0.0..=1.0).contains(&top_p) || top_p == 0.0 {
                anyhow::bail!("--top-p {top_p} must be in (0, 1]");
            }
            if temperature < 0.0 || !temperature.is_finite() {
                anyhow::bail!("--temperature {temperature} must be 0 (greedy) or positive");
            }
            let model = load(&model)?;
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
            };
            let mut stdout = std::io::stdout();
            let g = model.generate(&prompt, &opts, &mut |s| {
                if !json {
                    let _ = write!(stdout, "{s}");
                    let _ = stdout.flush();
                }
            })?;
            if json {
                println!("{}", serde_json::to_string(&g)?);
            } else {
                println!();
                eprintln!(
                    "prompt {} tokens: {:.1} tok/s prefill; generated {} tokens: {:.1} tok/s decode ({})",
                    g.prompt_tokens.len(),
                    g.prefill_tok_per_s,
                    g.tokens.len(),
                    g.decode_tok_per_s,
                    g.finish
                );
            }
        }
        Command::Perplexity {
            model,
            text,
            ctx,
            windows,
            json,
        } => {
            let model = load(&model)?;
            let body = std::fs::read_to_string(&text).with_context(|| format!("reading {}", text.display()))?;
            let started = std::time::Instant::now();
            let report = perplexity(
                &model,
                &body,
                &PerplexityOptions { ctx, windows },
                &mut |done, total, ppl| {
                    let per_window_s = started.elapsed().as_secs_f64() / done as f64;
                    let eta_s = per_window_s * (total - done) as f64;
                    let bar = "#".repeat(30 * done / total);
                    eprint!("\r[{bar:<30}] window {done}/{total}  perplexity {ppl:.4}  {per_window_s:.1} s/window  eta {eta_s:.0} s ");
                },
            )?;
            eprintln!();
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
    }
    Ok(())
}
