//! Text generation: encode the prompt (optionally through the chat template), prefill it in
//! batches of at most `batch_tokens_max` tokens, then decode one token per pass (or, with prompt
//! lookup, the pending token and its drafts, verified in one pass), handing each
//! token (id, the text it completes, its log-probability) to a callback as soon as it is
//! sampled. Generation can be cancelled between passes; a trailing incomplete UTF-8 sequence
//! is flushed at the end. Timing is measured here so every caller reports the same numbers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::batch::{Logits, PassOut, Row, Rows, Want};
use crate::model::draft::Drafter;
use crate::model::forward::{FfnMask, LayerStream, Passes};
use crate::model::sampler::{Sampler, SamplerConfig};
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
    /// Bring every pass's logits to the host and sample there ([`Want::Logits`]), as on a
    /// device that finds neither greedy tokens nor candidates: the reference what a device
    /// finds ([`Want::Greedy`], [`Want::Top`]) is checked against. Off (the default), only a
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

/// Token `t`, chosen from `row`: `None` when it is a stop token, else the text it completes
/// and (when asked) its log-probability ([`Row::logprob`]; a pass asked for logprobs hands over
/// logits or candidates with their log-sum-exp). Generation and the engine both emit tokens
/// through it.
pub(crate) fn take_token(
    tokenizer: &crate::model::tokenizer::Tokenizer,
    decoder: &mut crate::model::tokenizer::StreamDecoder,
    row: Row,
    t: u32,
    logprobs: bool,
) -> Option<(String, Option<f32>)> {
    if tokenizer.is_stop(t) {
        return None;
    }
    let logprob = logprobs.then(|| row.logprob(t)).flatten();
    debug_assert!(
        !logprobs || logprob.is_some(),
        "logprobs asked of a pass that cannot give them: {row:?}"
    );
    Some((decoder.push(t).unwrap_or_default(), logprob))
}

/// One sequence's rows of a pass (`rows`: row j follows `drafts[..j]`; row 0 is the fed token's):
/// each row's token is sampled, or verified against the row's draft, and handed to `emit`
/// (with its row), which says whether generation goes on. A kept draft moves on to the next row;
/// the first token that is not its row's draft ends the pass. Returns the drafts kept, and the
/// token to feed next (`None` when `emit` ended the sequence). The KV cache then holds the pass's
/// positions up to `pass start + 1 + kept`; the rest are rolled back. Generation and the engine
/// both walk their passes through it.
///
/// Rows of tokens (a greedy pass: [`Want::Greedy`]) are each row's token as greedy sampling
/// would pick it from the row's logits; rows of candidates ([`Want::Top`]) are drawn from as
/// the row's logits would be, or give their greedy tokens when they have them. `emit` gets the
/// row as the pass gave it ([`Row`]), for log-probabilities.
pub(crate) fn walk_rows(
    sampler: &mut Sampler,
    rows: Rows,
    vocab: usize,
    drafts: &[u32],
    emit: &mut dyn FnMut(u32, Row) -> bool,
) -> (usize, Option<u32>) {
    let n = match rows {
        Rows::Logits(l) => l.len() / vocab.max(1),
        Rows::Tokens(t) => t.len(),
        Rows::Top { k, pairs, .. } => pairs.len() / k.max(1),
    };
    for j in 0..n.min(drafts.len() + 1) {
        let draft = drafts.get(j).copied();
        let (t, row) = match rows {
            Rows::Logits(l) => {
                let row = &l[j * vocab..(j + 1) * vocab];
                let t = match draft {
                    Some(d) => sampler.verify(row, d),
                    None => sampler.sample(row),
                };
                (t, Row::Logits(row))
            }
            Rows::Tokens(ids) => {
                debug_assert!(sampler.is_greedy(), "tokens handed over for a sampler that draws");
                (ids[j], Row::Token)
            }
            Rows::Top { k, pairs, lse, tokens } => {
                let top = &pairs[j * k..(j + 1) * k];
                let t = match (tokens.get(j), draft) {
                    (Some(&t), _) => {
                        debug_assert!(sampler.is_greedy(), "tokens handed over for a sampler that draws");
                        t
                    }
                    (None, Some(d)) => sampler.verify_top(top, d),
                    (None, None) => sampler.sample_top(top),
                };
                (
                    t,
                    Row::Top {
                        pairs: top,
                        lse: lse.get(j).copied(),
                    },
                )
            }
        };
        let kept = draft == Some(t);
        if !emit(t, row) {
            return (j + kept as usize, None);
        }
        if !kept {
            return (j, Some(t));
        }
    }
    unreachable!("the row after the last draft has no draft, so it ends the walk")
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

/// Tells the mask the prompt is over when dropped, also when a pass fails midway (a mask left
/// in prompt mode would treat the next request's tokens as context).
struct PromptMode<'a>(Option<&'a dyn PromptAwareMask>);

impl Drop for PromptMode<'_> {
    fn drop(&mut self) {
        if let Some(m) = self.0 {
            m.prompt_tokens(0);
        }
    }
}

impl Model {
    /// The prompt's token ids as generation feeds them: through the chat template when `chat`
    /// (which writes its own BOS), else with BOS where the model adds one.
    pub fn prompt_ids(&self, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        if !chat {
            return self.encode_prompt(prompt, false);
        }
        if !self.tokenizer.has_chat_template() {
            return Err(Error::Invalid(format!(
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
            return Err(Error::Invalid(
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
            return Err(Error::Invalid(format!(
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
            return Err(Error::Invalid(format!(
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

    pub fn generate(&self, prompt: &str, opts: &GenerateOptions, on_text: &mut dyn FnMut(&str)) -> Result<Generation> {
        self.generate_with(prompt, opts, None, None, on_text)
    }

    /// As `generate`, with an FFN mask applied to every layer of every step (the prompt's
    /// length is announced to it first, for masks that learn from the prompt) and a stream.
    pub fn generate_with(
        &self,
        prompt: &str,
        opts: &GenerateOptions,
        mask: Option<&dyn PromptAwareMask>,
        stream: Option<&dyn LayerStream>,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        let ids = self.prompt_ids(prompt, opts.chat)?;
        self.generate_ids(&ids, opts, mask, stream, None, &mut |e| {
            if !e.text.is_empty() {
                on_text(e.text)
            }
        })
    }

    /// Generation from prompt ids, handing every token to `on_token` as it is sampled and
    /// stopping early (finish `Cancelled`, tokens so far kept) once `cancel` is set.
    pub fn generate_ids(
        &self,
        prompt_ids: &[u32],
        opts: &GenerateOptions,
        mask: Option<&dyn PromptAwareMask>,
        stream: Option<&dyn LayerStream>,
        cancel: Option<&AtomicBool>,
        on_token: &mut dyn FnMut(&TokenEvent),
    ) -> Result<Generation> {
        self.generate_ids_drafted(prompt_ids, opts, mask, stream, cancel, None, on_token)
    }

    /// As `generate_ids`, with drafts from `draft` (a draft model, see [`Drafter`]) verified
    /// in each decode pass; not with prompt lookup (`opts.lookup`) at the same time.
    #[allow(clippy::too_many_arguments)]
    pub fn generate_ids_drafted(
        &self,
        prompt_ids: &[u32],
        opts: &GenerateOptions,
        mask: Option<&dyn PromptAwareMask>,
        stream: Option<&dyn LayerStream>,
        cancel: Option<&AtomicBool>,
        draft: Option<&Drafter>,
        on_token: &mut dyn FnMut(&TokenEvent),
    ) -> Result<Generation> {
        if draft.is_some() && opts.lookup > 0 {
            return Err(Error::Invalid(
                "drafts come from prompt lookup (--lookup) or from a draft model (--draft), not both".into(),
            ));
        }
        let speculating = opts.lookup > 0 || draft.is_some();
        let prompt_tokens = prompt_ids.to_vec();
        if prompt_tokens.is_empty() {
            return Err(Error::Invalid("generation needs at least one prompt token".into()));
        }
        let plan = self.context_plan(prompt_tokens.len(), opts.max_tokens, opts.ctx)?;
        let passes = Passes {
            stream,
            batch_tokens_max: if opts.batch_tokens_max == 0 {
                PREFILL_BATCH_TOKENS
            } else {
                opts.batch_tokens_max
            },
            cancel,
        };
        let batch_max = passes.batch_max();
        let cancelled = || cancel.is_some_and(|c| c.load(Ordering::Relaxed));
        let mut cache = KvCache::new(&self.config, plan.kv_positions);
        if let Some(d) = draft {
            d.begin(plan.kv_positions);
        }
        let mut sampler = Sampler::new(opts.sampler.clone());
        let mut decoder = self.tokenizer.stream_decoder();
        let mut out_text = String::new();
        let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());

        let t0 = Instant::now();
        let hooks = passes.hooks(mask.map(|m| m.as_mask()), None);
        // Greedy without logprobs needs only each row's argmax: the device finds it (from a GPU,
        // 4 bytes a row come back instead of the logits); a draw with top-k, only each row's k
        // most likely tokens (8 bytes each). With logprobs, the row's log-sum-exp too (and for
        // greedy, the argmax and its candidate): a sampled token's log-probability is its value
        // less that. Only a draw from the whole vocabulary (`--top-k 0`) needs the logits.
        let stop_ids: &[u32] = if opts.ignore_eos {
            self.tokenizer.stop_ids()
        } else {
            &[]
        };
        let want = match (opts.logprobs, opts.sampler.is_greedy(), opts.sampler.device_top_k()) {
            _ if opts.logits_on_host => Want::Logits,
            (false, true, _) => Want::Greedy { banned: stop_ids },
            (true, true, _) => Want::Top {
                k: 1,
                banned: stop_ids,
                greedy: true,
                lse: true,
            },
            (lse, false, Some(k)) => Want::Top {
                k,
                banned: stop_ids,
                greedy: false,
                lse,
            },
            (_, false, None) => Want::Logits,
        };
        let mut logits = PassOut::empty(want);
        // With `ignore_eos`, each pass's rows never sample a stop token.
        let ban_stops = |logits: &mut PassOut| {
            if let PassOut::Logits(logits) = logits {
                for row in logits.chunks_exact_mut(self.config.vocab) {
                    crate::model::sampler::ban(row, stop_ids);
                }
            }
        };
        // Prompt tokens whose pass completed (all of them unless cancelled).
        let mut prefilled = 0usize;
        {
            let _prompt_mode = PromptMode(mask);
            for chunk in prompt_tokens.chunks(batch_max.max(1)) {
                if cancelled() {
                    break;
                }
                if let Some(m) = mask {
                    m.prompt_tokens(chunk.len());
                }
                match self.forward_want(chunk, &mut cache, Logits::Last, &hooks, want) {
                    Ok(l) => {
                        logits = l;
                        ban_stops(&mut logits);
                        prefilled += chunk.len();
                    }
                    // Cancelled inside a pass: nothing is sampled from a partial prompt.
                    Err(Error::Cancelled) => {
                        logits = PassOut::empty(want);
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        if let Some(s) = stream {
            s.prefill_done();
        }
        let prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut finish = plan.at_max_new;
        let mut n_decode_forward = 0usize;
        let vocab = self.config.vocab;
        // `logits` holds one row per token of the last pass from the pending token on: row j
        // follows `drafts[..j]` (see `walk_rows`).
        let mut drafts: Vec<u32> = Vec::new();
        let mut context: Vec<u32> = if speculating { prompt_tokens.clone() } else { Vec::new() };
        let (mut drafted, mut accepted, mut samples) = (0usize, 0usize, 0usize);
        let mut pass_start = cache.len;
        while tokens.len() < plan.max_new {
            if cancelled() || logits.is_empty() {
                finish = Finish::Cancelled;
                break;
            }
            let rows = logits.rows_for(0, drafts.len() + 1, vocab, opts.sampler.is_greedy());
            let (kept, pending) = walk_rows(&mut sampler, rows, vocab, &drafts, &mut |t, row| {
                samples += 1;
                let Some((text, logprob)) = take_token(&self.tokenizer, &mut decoder, row, t, opts.logprobs) else {
                    finish = Finish::StopToken;
                    return false;
                };
                tokens.push(t);
                logprobs.extend(logprob);
                on_token(&TokenEvent {
                    id: Some(t),
                    text: &text,
                    logprob,
                });
                out_text.push_str(&text);
                if speculating {
                    context.push(t);
                }
                tokens.len() < plan.max_new
            });
            accepted += kept;
            let Some(next) = pending else {
                break;
            };
            // The pending token and the drafts kept stay; a rejected draft's positions go.
            cache.truncate(pass_start + 1 + kept);
            if cancelled() {
                finish = Finish::Cancelled;
                break;
            }
            // Drafts for this pass: never past the last token the request may generate, nor
            // more than a pass takes (a stream's batch limit).
            let room = (plan.max_new - tokens.len() - 1).min(batch_max.saturating_sub(1));
            drafts = match draft {
                Some(d) => d.draft(&context, room)?,
                None => lookup_draft(&context, opts.lookup.min(room)),
            };
            drafted += drafts.len();
            pass_start = cache.len;
            let mut fed = Vec::with_capacity(1 + drafts.len());
            fed.push(next);
            fed.extend_from_slice(&drafts);
            let which = if drafts.is_empty() {
                Logits::Last
            } else {
                Logits::From(0)
            };
            match self.forward_want(&fed, &mut cache, which, &hooks, want) {
                Ok(l) => {
                    logits = l;
                    ban_stops(&mut logits);
                }
                Err(Error::Cancelled) => {
                    finish = Finish::Cancelled;
                    break;
                }
                Err(e) => return Err(e),
            }
            n_decode_forward += 1;
        }
        // An unfinished UTF-8 sequence at the end is not lost: it is written as U+FFFD.
        if let Some(rest) = decoder.flush() {
            on_token(&TokenEvent {
                id: None,
                text: &rest,
                logprob: None,
            });
            out_text.push_str(&rest);
        }
        // Decode speed: tokens sampled from decode passes (sampling included) per second; the
        // first generated token comes from the prefill.
        let decode_s = t1.elapsed().as_secs_f64();
        let decode_tokens = samples.saturating_sub(1);
        Ok(Generation {
            text: out_text,
            prefill_tok_per_s: prefilled as f64 / prefill_s.max(1e-9),
            decode_tok_per_s: if n_decode_forward > 0 {
                decode_tokens as f64 / decode_s.max(1e-9)
            } else {
                0.0
            },
            decode_tokens,
            speculative: speculating.then(|| Speculation {
                source: if draft.is_some() { "draft" } else { "lookup" },
                lookup_max: draft.map_or(opts.lookup, |d| d.max),
                draft_seconds: draft.map_or(0.0, |d| d.seconds()),
                drafted,
                accepted,
                acceptance_rate: accepted as f64 / drafted.max(1) as f64,
                passes: n_decode_forward,
                tokens_per_pass: decode_tokens as f64 / n_decode_forward.max(1) as f64,
            }),
            prompt_tokens: prompt_tokens.len(),
            completion_tokens: tokens.len(),
            tokens,
            logprobs,
            prompt_token_ids: prompt_tokens,
            finish,
            prefill_s,
            decode_s,
        })
    }
}
