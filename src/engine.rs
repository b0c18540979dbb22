//! Requests over one model: an [`Engine`] takes requests ([`Engine::submit`]) and advances all
//! of them together ([`Engine::step`]): each step is one forward pass over a [`Batch`] holding
//! the next token of every decoding sequence and, in what is left of the step's token budget,
//! the next piece of prompts still being prefilled (chunked prefill), so a long prompt never
//! stalls the others and a new request joins at the next step (continuous batching). Every
//! generated token comes out as an [`Event`] with its id, text and (when asked) log-probability;
//! a request ends with its finish reason (stop token, stop string, max tokens, context full,
//! cancelled). `run` is one request; `serve` is HTTP over this loop.
//!
//! Owns: the sequences (KV cache, sampler, text decoder, position) and the step's scheduling.
//! Does not own arithmetic (`model`), reading (`stream`) or sampling rules (`sampler`). A mask
//! applies to every token of every request ([`Engine::with_mask`]); per-token masks (top-K,
//! threshold) decide each token alone, so batching does not change them; the union mask keeps
//! per-prompt state, not per-sequence state, and is refused.

use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::batch::{Batch, Want};
use crate::model::forward::{FfnMask, LayerStream, Passes};
use crate::model::generate::{lookup_draft, take_token, walk_rows, ContextPlan, Finish, PREFILL_BATCH_TOKENS};
use crate::model::sampler::{Sampler, SamplerConfig};
use crate::model::tokenizer::StreamDecoder;
use crate::model::Model;
use crate::sparsity::{Masker, Strategy};

pub type RequestId = u64;

/// One request: a prompt's token ids and how to continue it.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Report each token's log-probability (a softmax over the vocabulary per token).
    pub logprobs: bool,
    /// Also report the this many most likely tokens at each step, with their log-probabilities.
    pub top_logprobs: usize,
    /// Generation ends as soon as the text contains one of these; the text is kept up to it,
    /// without it (finish `StopString`). Text that could be the start of a stop string is held
    /// back until the next tokens show it is not.
    pub stop: Vec<String>,
    /// Speculative decoding by prompt lookup: up to this many draft tokens verified per step
    /// (see [`crate::model::generate::lookup_draft`]; 0 = off). Greedy tokens are unchanged.
    pub lookup: usize,
}

/// What a step produced for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token {
        request: RequestId,
        token: u32,
        /// The text this token releases: what it completes (empty inside a UTF-8 sequence),
        /// after text held back because it could begin a stop string.
        text: String,
        logprob: Option<f32>,
        /// The `top_logprobs` most likely tokens with their log-probabilities, most likely first.
        top: Vec<(u32, f32)>,
    },
    /// The request ended; `text` holds what was still held back (an incomplete UTF-8 sequence,
    /// the start of a stop string that never completed), if anything.
    Finished {
        request: RequestId,
        finish: Finish,
        text: String,
    },
}

struct Sequence<'m> {
    id: RequestId,
    cache: KvCache,
    sampler: Sampler,
    decoder: StreamDecoder<'m>,
    /// Prompt tokens not yet fed.
    prompt: Vec<u32>,
    fed: usize,
    /// The sampled token to feed next (decoding).
    next: Option<u32>,
    generated: usize,
    max_tokens: usize,
    /// How a sequence that reaches `max_tokens` ends: `MaxTokens`, or `ContextFull` when the
    /// context cut `max_tokens` down.
    at_max: Finish,
    logprobs: bool,
    top_logprobs: usize,
    stop: Vec<String>,
    /// Generated text not yet released: it could be the start of a stop string.
    held: String,
    cancelled: bool,
    lookup: usize,
    /// Prompt and generated tokens (kept only with `lookup`), where drafts are looked up.
    context: Vec<u32>,
    /// The drafts fed after `next` in this step, and where the step's tokens start in the cache.
    drafts: Vec<u32>,
    pass_start: usize,
}

/// Requests over one model and, optionally, its stream (see the module docs).
pub struct Engine<'m> {
    model: &'m Model,
    stream: Option<&'m dyn LayerStream>,
    /// The most tokens one step's pass takes (decode tokens first, then prompt pieces).
    step_tokens_max: usize,
    seqs: Vec<Sequence<'m>>,
    next_id: RequestId,
    mask: Option<&'m dyn FfnMask>,
    /// Each request's context (prompt + generated); 0 = the model's.
    ctx: usize,
    /// Draft tokens verified and kept, over every request so far.
    drafted: u64,
    accepted: u64,
}

impl<'m> Engine<'m> {
    /// `step_tokens_max`: tokens per pass (0 = 512; a stream's own limit caps it).
    pub fn new(model: &'m Model, stream: Option<&'m dyn LayerStream>, step_tokens_max: usize) -> Engine<'m> {
        let passes = Passes {
            stream,
            batch_tokens_max: if step_tokens_max == 0 {
                PREFILL_BATCH_TOKENS
            } else {
                step_tokens_max
            },
            cancel: None,
        };
        Engine {
            model,
            stream,
            step_tokens_max: passes.batch_max(),
            seqs: Vec::new(),
            next_id: 0,
            mask: None,
            ctx: 0,
            drafted: 0,
            accepted: 0,
        }
    }

    /// Draft tokens verified and kept so far (requests with `lookup`).
    pub fn drafts(&self) -> (u64, u64) {
        (self.drafted, self.accepted)
    }

    /// Every request's context, prompt and generated tokens together (0 = the model's): a longer
    /// prompt is refused, and generation stops when it is full (finish `ContextFull`).
    pub fn with_context(mut self, ctx: usize) -> Engine<'m> {
        self.ctx = ctx;
        self
    }

    /// The most tokens one step takes: at most this many requests decode in a step.
    pub fn step_tokens(&self) -> usize {
        self.step_tokens_max
    }

    /// Every token of every request through `mask` (see the module docs; union is refused).
    pub fn with_mask(mut self, mask: &'m Masker<'m>) -> Result<Engine<'m>> {
        if mask.strategy == Strategy::Union {
            return Err(Error::Invalid(
                "the union mask learns one set from one prompt; the engine runs several requests at once, so it \
                 takes per-token masks (topk, threshold) only"
                    .into(),
            ));
        }
        self.mask = Some(mask);
        Ok(self)
    }

    /// Queues a request; it starts at the next step.
    pub fn submit(&mut self, req: Request) -> Result<RequestId> {
        let plan = check(self.model, &req, self.ctx)?;
        let positions = plan.kv_positions;
        if let Some(limit) = self.stream.and_then(|s| s.kv_positions()) {
            let in_use: usize = self.seqs.iter().map(|s| s.cache.capacity).sum();
            if in_use + positions > limit {
                return Err(Error::Invalid(format!(
                    "the request needs {positions} KV positions and {in_use} are in use, but the RAM budget holds \
                     {limit} (the KV cache is counted in --ram-budget)"
                )));
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let context = if req.lookup > 0 {
            req.prompt_ids.clone()
        } else {
            Vec::new()
        };
        self.seqs.push(Sequence {
            id,
            cache: KvCache::new(&self.model.config, positions),
            sampler: Sampler::new(req.sampler),
            decoder: self.model.tokenizer.stream_decoder(),
            prompt: req.prompt_ids,
            fed: 0,
            next: None,
            generated: 0,
            max_tokens: plan.max_new,
            at_max: plan.at_max_new,
            logprobs: req.logprobs,
            top_logprobs: req.top_logprobs,
            stop: req.stop,
            held: String::new(),
            cancelled: false,
            lookup: req.lookup,
            context,
            drafts: Vec::new(),
            pass_start: 0,
        });
        Ok(id)
    }

    /// Ends a request at the next step (its tokens so far were already handed over).
    pub fn cancel(&mut self, id: RequestId) {
        if let Some(s) = self.seqs.iter_mut().find(|s| s.id == id) {
            s.cancelled = true;
        }
    }

    /// Requests not yet finished.
    pub fn active(&self) -> usize {
        self.seqs.len()
    }

    /// One pass over every active request (see the module docs); returns its events.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        // Cancelled requests, and those that may generate nothing, end before any work.
        self.seqs.retain_mut(|s| {
            let done = s.cancelled || s.max_tokens == 0;
            if done {
                let finish = if s.cancelled { Finish::Cancelled } else { s.at_max };
                events.push(finished(s, finish));
            }
            !done
        });
        // The batch: decode tokens first, then prompt pieces while the budget lasts.
        let mut batch = Batch::default();
        let mut budget = self.step_tokens_max;
        // The sequences whose logits the pass returns, in row order, each with its first row (a
        // decoding sequence has one row for its token and one after each of its drafts).
        let mut rows: Vec<(usize, usize)> = Vec::new();
        let mut n_rows = 0;
        let mut members: Vec<usize> = Vec::new(); // sequence index in `seqs` of each cache slot
                                                  // Drafts only take what the step has left once every decoding request has its token and
                                                  // prompts waiting to be fed have up to half the step: no request waits for another's drafts.
        let mut decoders_after = self.seqs.iter().filter(|s| s.next.is_some()).count();
        let prompt_left: usize = self
            .seqs
            .iter()
            .filter(|s| s.next.is_none())
            .map(|s| s.prompt.len() - s.fed)
            .sum();
        let for_prompts = prompt_left.min(budget / 2);
        for (i, s) in self.seqs.iter_mut().enumerate() {
            s.drafts.clear();
            if let (Some(t), true) = (s.next, budget > 0) {
                let slot = members.len();
                members.push(i);
                s.pass_start = s.cache.len;
                decoders_after -= 1;
                // Drafts: within what is spare of the step and the tokens the request may still
                // generate.
                let spare = budget.saturating_sub(1 + decoders_after + for_prompts);
                let room = spare.min(s.max_tokens - s.generated - 1);
                s.drafts = lookup_draft(&s.context, s.lookup.min(room));
                batch.push(slot, t, s.cache.len, true);
                for (j, &d) in s.drafts.iter().enumerate() {
                    batch.push(slot, d, s.cache.len + 1 + j, true);
                }
                rows.push((i, n_rows));
                n_rows += 1 + s.drafts.len();
                budget -= 1 + s.drafts.len();
                self.drafted += s.drafts.len() as u64;
            }
        }
        for (i, s) in self.seqs.iter().enumerate() {
            if s.next.is_some() || budget == 0 {
                continue;
            }
            let take = (s.prompt.len() - s.fed).min(budget);
            let slot = members.len();
            members.push(i);
            for j in 0..take {
                let last = s.fed + j + 1 == s.prompt.len();
                batch.push(slot, s.prompt[s.fed + j], s.cache.len + j, last);
                if last {
                    rows.push((i, n_rows));
                    n_rows += 1;
                }
            }
            budget -= take;
        }
        if batch.is_empty() {
            return Ok(events);
        }
        let hooks = Passes {
            stream: self.stream,
            batch_tokens_max: self.step_tokens_max,
            cancel: None,
        }
        .hooks(self.mask, None);
        // Each row's argmax (greedy) or k most likely tokens (a draw with a top-k) is all a
        // sequence samples from: the device finds them (see `Want::Greedy`, `Want::Top`; the
        // largest k asked, a row's first k of them being its own k; and the argmax too when
        // greedy sequences are among them). Log-probabilities need each row's log-sum-exp
        // beside them, and top log-probabilities at least as many candidates. Only a draw from
        // the whole vocabulary (top-k 0, or more than the device lists), or more top
        // log-probabilities than it lists, needs the logits.
        let (mut greedy, mut sampled, mut lse, mut top_k) = (0usize, 0usize, false, Some(1usize));
        for &(i, _) in &rows {
            let s = &self.seqs[i];
            lse |= s.logprobs || s.top_logprobs > 0;
            let own = if s.sampler.is_greedy() {
                greedy += 1;
                Some(1)
            } else {
                sampled += 1;
                s.sampler.device_top_k()
            };
            top_k = top_k
                .zip(own)
                .map(|(a, b)| a.max(b).max(s.top_logprobs))
                .filter(|&k| k <= crate::model::batch::TOP_K_MAX);
        }
        let want = match top_k {
            Some(_) if sampled == 0 && !lse => Want::Greedy { banned: &[] },
            Some(k) => Want::Top {
                k,
                banned: &[],
                greedy: greedy > 0,
                lse,
            },
            None => Want::Logits,
        };
        let logits = {
            let mut caches: Vec<&mut KvCache> = Vec::with_capacity(members.len());
            let mut by_index: Vec<Option<&mut Sequence>> = self.seqs.iter_mut().map(Some).collect();
            for &i in &members {
                caches.push(&mut by_index[i].take().expect("one slot per sequence").cache);
            }
            self.model.forward_batch_want(&batch, &mut caches, &hooks, want)?
        };
        // Prompt tokens fed.
        for (slot, &i) in members.iter().enumerate() {
            let s = &mut self.seqs[i];
            if s.next.is_none() {
                s.fed += batch.seq_of_token.iter().filter(|&&x| x == slot).count();
            }
        }
        // Sample every sequence that got logits, its drafts verified (see `walk_rows`); the cache
        // is rolled back past a rejected draft.
        let vocab = self.model.config.vocab;
        let tokenizer = &self.model.tokenizer;
        let mut ended = Vec::new();
        for &(i, r0) in &rows {
            let s = &mut self.seqs[i];
            let pass_rows = logits.rows_for(r0, 1 + s.drafts.len(), vocab, s.sampler.is_greedy());
            let mut end = None;
            let (kept, next) = walk_rows(&mut s.sampler, pass_rows, vocab, &s.drafts, &mut |t, row| {
                let Some((text, logprob)) = take_token(tokenizer, &mut s.decoder, row, t, s.logprobs) else {
                    end = Some(Finish::StopToken);
                    return false;
                };
                s.generated += 1;
                if s.lookup > 0 {
                    s.context.push(t);
                }
                let top = row.top_logprobs(s.top_logprobs);
                let (text, stopped) = release(&mut s.held, &s.stop, text);
                events.push(Event::Token {
                    request: s.id,
                    token: t,
                    text,
                    logprob,
                    top,
                });
                end = if stopped {
                    Some(Finish::StopString)
                } else if s.generated >= s.max_tokens {
                    Some(s.at_max)
                } else {
                    None
                };
                end.is_none()
            });
            self.accepted += kept as u64;
            match (next, end) {
                (Some(t), _) => {
                    if kept < s.drafts.len() {
                        s.cache.truncate(s.pass_start + 1 + kept);
                    }
                    s.next = Some(t);
                }
                (None, Some(finish)) => ended.push((i, finish)),
                (None, None) => unreachable!("a walk ends only where emit ends it"),
            }
        }
        ended.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        for (i, finish) in ended {
            let mut s = self.seqs.remove(i);
            events.push(finished(&mut s, finish));
        }
        Ok(events)
    }
}

/// Why `req` cannot run on `model` in a context of `ctx` positions (0 = the model's), or what
/// of the context it may use: what [`Engine::submit`] checks, for callers that refuse a request
/// before queueing it. A prompt that does not fit is refused before any work; generation stops
/// where the context is full.
pub fn check(model: &Model, req: &Request, ctx: usize) -> Result<ContextPlan> {
    if req.prompt_ids.is_empty() {
        return Err(Error::Invalid("a request needs at least one prompt token".into()));
    }
    if let Some(&t) = req.prompt_ids.iter().find(|&&t| t as usize >= model.config.vocab) {
        return Err(Error::Invalid(format!(
            "prompt token {t} is outside the vocabulary of {}",
            model.config.vocab
        )));
    }
    if req.stop.iter().any(|s| s.is_empty()) {
        return Err(Error::Invalid("a stop string may not be empty".into()));
    }
    model.context_plan(req.prompt_ids.len(), req.max_tokens, ctx)
}

fn finished(s: &mut Sequence, finish: Finish) -> Event {
    let mut text = std::mem::take(&mut s.held);
    if finish != Finish::StopString {
        text.push_str(&s.decoder.flush().unwrap_or_default());
    }
    Event::Finished {
        request: s.id,
        finish,
        text,
    }
}

/// Adds a token's text to what is `held` back and returns what can be released, and whether a
/// stop string was reached (then the text before it is released and the rest dropped).
fn release(held: &mut String, stop: &[String], text: String) -> (String, bool) {
    if stop.is_empty() {
        return (text, false);
    }
    held.push_str(&text);
    let (out, stopped) = split_at_stop(held, stop);
    let out = out.to_owned();
    held.drain(..out.len());
    if stopped {
        held.clear();
    }
    (out, stopped)
}

/// What of `held` can be released given `stops`: everything before the first stop string (and
/// `true`), or everything before the earliest suffix that could still grow into one.
fn split_at_stop<'a>(held: &'a str, stops: &[String]) -> (&'a str, bool) {
    if let Some(at) = stops.iter().filter_map(|s| held.find(s.as_str())).min() {
        return (&held[..at], true);
    }
    let keep_from = held
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| stops.iter().any(|s| s.starts_with(&held[i..])))
        .unwrap_or(held.len());
    (&held[..keep_from], false)
}

#[cfg(test)]
mod tests {
    use super::split_at_stop;

    #[test]
    fn stop_strings_hold_back_only_what_could_begin_one() {
        let stops = vec!["\n\nUser:".to_string(), "END".to_string()];
        assert_eq!(split_at_stop("Hello", &stops), ("Hello", false));
        assert_eq!(split_at_stop("Hello\n", &stops), ("Hello", false));
        assert_eq!(split_at_stop("Hello\n\nUs", &stops), ("Hello", false));
        assert_eq!(split_at_stop("Hello\n\nUser: hi", &stops), ("Hello", true));
        assert_eq!(split_at_stop("a ENDb END", &stops), ("a ", true));
        assert_eq!(split_at_stop("xEN", &stops), ("x", false));
        assert_eq!(split_at_stop("xENx", &stops), ("xENx", false));
        // The earliest stop wins, whichever string it is.
        assert_eq!(split_at_stop("aEND\n\nUser:", &stops), ("a", true));
        // Multi-byte characters: only whole characters are released or held.
        assert_eq!(split_at_stop("é€", &["€x".to_string()]), ("é", false));
    }
}
