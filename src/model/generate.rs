//! Text generation's parts: the prompt's ids (optionally through the chat template), what a
//! request may use of the context, the options and results of one generation, prompt lookup,
//! and the walk that samples (or verifies drafts from) a pass's rows. The loop that runs them is
//! the engine's ([`crate::engine::Engine::step`]; one request: `Model::generate_ids`).

use crate::error::{Error, Result};
use crate::model::forward::FfnMask;
use crate::model::sampler::SamplerConfig;
use crate::model::Model;

/// A mask that generation tells how many of the next batch's tokens are the prompt.
pub trait PromptAwareMask: Sync {
    fn prompt_tokens(&self, n: usize);
    fn as_mask(&self) -> &dyn FfnMask;
}

/// Prompt batches when neither the caller nor a stream sets a smaller size (llama.cpp's
/// default micro-batch).
pub const PREFILL_BATCH_TOKENS: usize = 512;

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Render the prompt with the model's chat template.
    pub chat: bool,
    /// The context in positions (prompt + generated): a longer prompt is refused before any work,
    /// generation stops when it is full (finish `ContextFull`); 0 = the model's trained context.
    /// The KV cache holds only what the request can use (prompt + `max_tokens`, at most this).
    pub ctx: usize,
    /// The most prompt tokens per pass; 0 = [`PREFILL_BATCH_TOKENS`] (a stream may lower it).
    pub batch_tokens_max: usize,
    /// Compute each token's log-probability (a softmax over the vocabulary per token: ~5% of
    /// SmolLM2's decode time, more with Gemma's 262k vocabulary, so only when asked).
    pub logprobs: bool,
    /// Speculative decoding by prompt lookup: up to this many draft tokens per pass (0 = off),
    /// see [`lookup_draft`]; each pass verifies them all at once.
    pub lookup: usize,
    /// Never end at the model's end-of-sequence tokens: their logits are set to -inf before
    /// sampling (as llama.cpp's `--ignore-eos` biases them), so generation goes on to
    /// `max_tokens` or a full context. For fixed-length continuations, to compare or to time.
    pub ignore_eos: bool,
    /// Bring every pass's logits to the host and sample there (`Want::Logits`), as on a
    /// device that finds neither greedy tokens nor candidates: the reference what a device
    /// finds (`Want::Greedy`, `Want::Top`) is checked against. Off (the default), only a
    /// draw from the whole vocabulary (top-k 0, or above [`crate::model::batch::TOP_K_MAX`])
    /// brings the logits.
    pub logits_on_host: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 64,
            sampler: SamplerConfig::default(),
            chat: false,
            ctx: 0,
            batch_tokens_max: 0,
            logprobs: false,
            lookup: 0,
            ignore_eos: false,
            logits_on_host: false,
        }
    }
}

/// The shortest and longest context tails [`lookup_draft`] matches.
pub const LOOKUP_NGRAM_MIN: usize = 2;
pub const LOOKUP_NGRAM_MAX: usize = 4;

/// Prompt lookup: the (at most `k`) tokens that followed the latest earlier occurrence of the
/// context's last n tokens, trying n from [`LOOKUP_NGRAM_MAX`] down to [`LOOKUP_NGRAM_MIN`];
/// empty when the tail occurs nowhere before. No model: text that repeats (code being edited,
/// quoted passages) drafts itself.
pub fn lookup_draft(context: &[u32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    for n in (LOOKUP_NGRAM_MIN..=LOOKUP_NGRAM_MAX).rev() {
        if context.len() <= n {
            continue;
        }
        let tail = &context[context.len() - n..];
        if let Some(i) = (0..context.len() - n).rev().find(|&i| &context[i..i + n] == tail) {
            let from = i + n;
            return context[from..(from + k).min(context.len())].to_vec();
        }
    }
    Vec::new()
}

/// What speculative decoding did in one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Speculation {
    /// Where the drafts came from: `lookup` (prompt lookup) or `draft` (a draft model).
    pub source: &'static str,
    /// The most draft tokens per pass (`GenerateOptions::lookup`, or the draft model's).
    pub lookup_max: usize,
    /// Seconds the draft model took (part of the decode time; 0 for prompt lookup).
    pub draft_seconds: f64,
    /// Draft tokens verified, and how many of them were kept.
    pub drafted: usize,
    pub accepted: usize,
    pub acceptance_rate: f64,
    /// Decode passes, and tokens generated per decode pass.
    pub passes: usize,
    pub tokens_per_pass: f64,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// The model produced a stop token.
    StopToken,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The context (the model's, or the one asked for) is full.
    ContextFull,
    /// The caller cancelled (the tokens so far are kept).
    Cancelled,
    /// The text reached one of the request's stop strings (kept up to it, without it).
    StopString,
}

impl Finish {
    /// The name `--json` and the stderr summary use ("stop_token", "max_tokens", "cancelled").
    pub fn name(self) -> &'static str {
        match self {
            Finish::StopToken => "stop_token",
            Finish::MaxTokens => "max_tokens",
            Finish::ContextFull => "context_full",
            Finish::Cancelled => "cancelled",
            Finish::StopString => "stop_string",
        }
    }
}

/// One generated token, handed over as soon as it is sampled.
#[derive(Clone, Debug)]
pub struct TokenEvent<'a> {
    /// The token; `None` for the last event of a generation that ended inside a UTF-8
    /// sequence, which carries the flushed bytes (as U+FFFD) and no token.
    pub id: Option<u32>,
    /// The text this token completes (empty while a UTF-8 sequence is unfinished).
    pub text: &'a str,
    /// ln p(token) under the model's distribution (softmax of the logits, before temperature),
    /// when [`GenerateOptions::logprobs`] asks for it.
    pub logprob: Option<f32>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Generation {
    pub text: String,
    /// Generated token ids (not the prompt).
    pub tokens: Vec<u32>,
    /// ln p of each generated token under the model (see [`TokenEvent::logprob`]); empty
    /// unless asked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<f32>,
    /// How many tokens the prompt encoded to (a count, as every completion API names it).
    pub prompt_tokens: usize,
    /// How many tokens were generated.
    pub completion_tokens: usize,
    /// The prompt's token ids.
    pub prompt_token_ids: Vec<u32>,
    pub finish: Finish,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub prefill_tok_per_s: f64,
    /// Tokens sampled from decode passes per second (with speculation, several per pass).
    pub decode_tok_per_s: f64,
    /// Tokens sampled from decode passes' logits (a final stop token included).
    pub decode_tokens: usize,
    /// With `GenerateOptions::lookup`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<Speculation>,
}

/// What a request may use of the context: KV positions to allocate and tokens to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextPlan {
    /// KV positions the request can fill (prompt + generated, at most `limit`).
    pub kv_positions: usize,
    /// Tokens it may generate: `max_tokens`, or fewer when the context fills first.
    pub max_new: usize,
    /// How the request ends once it has generated `max_new` tokens: `MaxTokens`, or
    /// `ContextFull` when the context cut `max_tokens` down.
    pub at_max_new: Finish,
}

impl Model {
    /// The prompt's token ids as generation feeds them: through the chat template when `chat`
    /// (which writes its own BOS), else with BOS where the model adds one.
    pub fn prompt_ids(&self, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        if !chat {
            return self.encode_prompt(prompt, false);
        }
        if !self.tokenizer.has_chat_template() {
            return Err(Error::Input(format!(
                "{}: --chat given but the model has no chat template",
                self.path.display()
            )));
        }
        self.encode_prompt(&self.tokenizer.apply_chat_template(prompt)?, true)
    }

    /// A conversation's token ids, rendered with the model's chat template (the assistant turn
    /// opened), encoded as [`Model::prompt_ids`] encodes a chat prompt.
    pub fn chat_ids(&self, messages: &[(crate::model::chat::Role, &str)]) -> Result<Vec<u32>> {
        self.encode_prompt(&self.tokenizer.apply_chat_template_to(messages)?, true)
    }

    /// `text` encoded for generation: BOS first when the model adds one, unless `chat` (a
    /// rendered chat template, whose text carries its own start).
    fn encode_prompt(&self, text: &str, chat: bool) -> Result<Vec<u32>> {
        let ids = self.tokenizer.encode(text, !chat)?;
        if ids.is_empty() {
            return Err(Error::Input(
                "the prompt encodes to no tokens and the model has no BOS to start from".into(),
            ));
        }
        Ok(ids)
    }

    /// What a prompt of `prompt_len` tokens may use of a context of `ctx` positions (0 = the
    /// model's trained context): refused, naming both counts and the way out, when the prompt
    /// leaves no room to generate.
    pub fn context_plan(&self, prompt_len: usize, max_tokens: usize, ctx: usize) -> Result<ContextPlan> {
        let limit = if ctx == 0 { self.config.context_len } else { ctx };
        if prompt_len >= limit {
            let whose = if ctx == 0 {
                format!("the model's context of {limit} tokens")
            } else {
                format!(
                    "the context of {limit} tokens asked for (the model's is {})",
                    self.config.context_len
                )
            };
            return Err(Error::Input(format!(
                "the prompt is {prompt_len} tokens, which leaves no room to generate in {whose}; shorten the prompt{}",
                if ctx != 0 && ctx < self.config.context_len {
                    " or give a longer --ctx-size"
                } else {
                    ""
                }
            )));
        }
        let max_new = max_tokens.min(limit - prompt_len);
        let kv_bytes = crate::kv::KvCache::bytes_for(&self.config, prompt_len + max_new);
        if let Some(ram) = crate::kv::physical_memory_bytes().filter(|&ram| kv_bytes > ram) {
            return Err(Error::Input(format!(
                "the KV cache for {} positions (prompt {prompt_len} + up to {max_new} generated) needs {:.1} GB, more than \
                 this machine's {:.1} GB of memory; give a smaller --max-tokens or --ctx-size",
                prompt_len + max_new,
                kv_bytes as f64 / 1e9,
                ram as f64 / 1e9
            )));
        }
        Ok(ContextPlan {
            kv_positions: prompt_len + max_new,
            max_new,
            at_max_new: if max_new < max_tokens {
                Finish::ContextFull
            } else {
                Finish::MaxTokens
            },
        })
    }
}
