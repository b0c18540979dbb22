//! Perplexity over a text file, by the same method as llama.cpp's `llama-perplexity`, so the two
//! can be compared number for number: the whole file is tokenized once (with BOS when the model
//! adds one); it is cut into consecutive, non-overlapping windows of `ctx` tokens; when the model
//! adds BOS, each window's first token is replaced by BOS; each window is evaluated from an empty
//! KV cache and only the second half of it is scored (the prediction of token j+1 from position
//! j, for j from ctx/2 to ctx-2), so every scored token has at least ctx/2 tokens of context.

use std::time::Instant;

use crate::backend::ops::log_sum_exp;
use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::forward::Passes;
use crate::model::Model;

pub const METHOD: &str =
    "llama.cpp-compatible: text tokenized once; consecutive non-overlapping windows of ctx tokens; \
first token of each window replaced by BOS when the model adds BOS; only the second half of each window scored";

#[derive(Clone, Debug)]
pub struct PerplexityOptions {
    pub ctx: usize,
    /// Windows to evaluate (0 = all that fit).
    pub windows: usize,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct PerplexityReport {
    pub perplexity: f64,
    /// Perplexity after each window (running), as llama.cpp prints it.
    pub running: Vec<f64>,
    pub windows: usize,
    pub ctx: usize,
    pub scored_tokens: usize,
    pub text_tokens: usize,
    pub method: &'static str,
    pub seconds: f64,
    pub tokens_per_s: f64,
}

/// Window `w` of `ctx` tokens as llama-perplexity evaluates it: the first token replaced by BOS
/// when the model adds one. `eval` uses the same windows.
pub fn window_tokens(model: &Model, tokens: &[u32], w: usize, ctx: usize) -> Vec<u32> {
    let mut batch = tokens[w * ctx..(w + 1) * ctx].to_vec();
    if let Some(b) = model.tokenizer.bos_id().filter(|_| model.tokenizer.adds_bos()) {
        batch[0] = b;
    }
    batch
}

/// Evaluate; `progress(done, total)` is called after each window.
pub fn perplexity(
    model: &Model,
    text: &str,
    opts: &PerplexityOptions,
    progress: &mut dyn FnMut(usize, usize, f64),
) -> Result<PerplexityReport> {
    perplexity_with(model, Passes::default(), text, opts, progress)
}

/// As `perplexity`, with every window's passes run as `passes` says (through a stream under a
/// RAM budget, in batches it holds).
pub fn perplexity_with(
    model: &Model,
    passes: Passes,
    text: &str,
    opts: &PerplexityOptions,
    progress: &mut dyn FnMut(usize, usize, f64),
) -> Result<PerplexityReport> {
    if opts.ctx < 4 {
        return Err(Error::Input(format!("--ctx {} is too small (at least 4)", opts.ctx)));
    }
    let tokens = model.tokenizer.encode(text, true)?;
    let available = tokens.len() / opts.ctx;
    if available == 0 {
        return Err(Error::Input(format!(
            "the text has {} tokens, fewer than one window of --ctx {}",
            tokens.len(),
            opts.ctx
        )));
    }
    let windows = if opts.windows == 0 {
        available
    } else {
        opts.windows.min(available)
    };
    let first_scored = opts.ctx / 2;
    let (hooks, batch_max) = (passes.hooks(None, None), passes.batch_max());
    let mut cache = KvCache::new(&model.config, opts.ctx);
    let vocab = model.config.vocab;
    let (mut nll, mut count) = (0f64, 0usize);
    let mut running = Vec::with_capacity(windows);
    let t0 = Instant::now();
    for w in 0..windows {
        let batch = window_tokens(model, &tokens, w, opts.ctx);
        cache.clear();
        let logits = model.forward_in_batches(&batch, &mut cache, first_scored, &hooks, batch_max)?;
        for j in first_scored..opts.ctx - 1 {
            let row = &logits[(j - first_scored) * vocab..(j - first_scored + 1) * vocab];
            let target = tokens[w * opts.ctx + j + 1] as usize;
            nll += log_sum_exp(row) - row[target] as f64;
            count += 1;
        }
        running.push((nll / count as f64).exp());
        progress(w + 1, windows, (nll / count as f64).exp());
    }
    let seconds = t0.elapsed().as_secs_f64();
    Ok(PerplexityReport {
        perplexity: (nll / count as f64).exp(),
        running,
        windows,
        ctx: opts.ctx,
        scored_tokens: count,
        text_tokens: tokens.len(),
        method: METHOD,
        seconds,
        tokens_per_s: (windows * opts.ctx) as f64 / seconds.max(1e-9),
    })
}
