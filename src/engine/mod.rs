//! Requests over one model: an [`Engine`] takes requests ([`Engine::submit`]) and advances all
//! of them together ([`Engine::step`]): each step is one forward pass over a [`Batch`] holding
//! the next token of every decoding sequence and, in what is left of the step's token budget,
//! the next piece of prompts still being prefilled (chunked prefill), so a long prompt never
//! stalls the others and a new request joins at the next step (continuous batching). Every
//! generated token comes out as an [`Event`] with its id, text and (when asked) log-probability;
//! a request ends with its finish reason (stop token, stop string, max tokens, context full,
//! cancelled). This is the one generation loop: `run` is one request ([`Model::generate_ids`],
//! in `single`), `serve` is HTTP over it.
//!
//! Owns: the sequences (KV cache, sampler, text decoder, position, drafts, timings) and the
//! step's scheduling. Does not own arithmetic (`model`), reading (`stream`) or sampling rules
//! (`sampler`). A mask applies to every token of every request ([`Engine::with_mask`]);
//! per-token masks (top-K, threshold) decide each token alone, so batching does not change
//! them. A mask that learns from a prompt (the union mask, the trace recorders:
//! [`Engine::with_prompt_mask`]) keeps one prompt's state, so such an engine runs one request
//! at a time.

mod single;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::batch::{Batch, PassOut, Row, Rows, Want};
use crate::model::draft::{DraftState, Drafter};
use crate::model::forward::{FfnMask, LayerStream, Passes};
use crate::model::generate::{lookup_draft, ContextPlan, Finish, PromptAwareMask, PREFILL_BATCH_TOKENS};
use crate::model::sampler::{Sampler, SamplerConfig};
use crate::model::tokenizer::{StreamDecoder, Tokenizer};
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
    /// Not with an engine's draft model ([`Engine::with_drafter`]), which drafts instead.
    pub lookup: usize,
    /// Never end at the model's stop tokens: their logits are set to -inf before sampling (as
    /// llama.cpp's `--ignore-eos` biases them), so the request goes on to `max_tokens` or a full
    /// context.
    pub ignore_eos: bool,
    /// Bring this request's logits to the host and sample there ([`Want::Logits`]): the
    /// reference what a device finds (greedy tokens, candidates) is checked against.
    pub logits_on_host: bool,
}

/// What one request cost, handed over when it ends ([`Event::Finished`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RequestStats {
    /// Prompt tokens whose pass completed (all of them unless cancelled).
    pub prefilled: usize,
    /// Seconds from the request's first pass to the end of the pass that fed its last prompt
    /// token (its first token's sampling not included).
    pub prefill_s: f64,
    /// Seconds from then to the end (the first token's sampling included).
    pub decode_s: f64,
    /// Decode passes (one per step the request decoded in; the first token comes from the
    /// prompt's pass), and tokens sampled from them (several a pass with drafts; a final stop
    /// token counted).
    pub decode_passes: usize,
    pub decode_tokens: usize,
    /// Draft tokens verified, and how many were kept.
    pub drafted: usize,
    pub accepted: usize,
    /// Seconds in the draft model (part of `decode_s`; 0 without one).
    pub draft_seconds: f64,
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
        stats: RequestStats,
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
    /// Prompt and generated tokens (kept only with `lookup` or a draft model), where drafts come
    /// from.
    context: Vec<u32>,
    /// The drafts fed after `next` in this step, and where the step's tokens start in the cache.
    drafts: Vec<u32>,
    pass_start: usize,
    /// The draft model's state for this request (an engine with a draft model).
    draft: Option<DraftState>,
    ignore_eos: bool,
    logits_on_host: bool,
    /// When its first pass started, and when the pass feeding its last prompt token ended.
    started: Option<Instant>,
    prefilled_at: Option<Instant>,
    stats: RequestStats,
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
    /// A mask told how many of a pass's tokens are prompt ([`Engine::with_prompt_mask`]).
    prompt_mask: Option<&'m dyn PromptAwareMask>,
    drafter: Option<&'m Drafter>,
    /// Set from outside: every request ends cancelled at the next step or inside the pass.
    cancel: Option<&'m AtomicBool>,
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
            prompt_mask: None,
            drafter: None,
            cancel: None,
            ctx: 0,
            drafted: 0,
            accepted: 0,
        }
    }

    /// Draft tokens verified and kept so far (requests with `lookup`, or a draft model).
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
            return Err(Error::Input(
                "the union mask learns one set from one prompt; the engine runs several requests at once, so it \
                 takes per-token masks (topk, threshold) only"
                    .into(),
            ));
        }
        self.mask = Some(mask);
        Ok(self)
    }

    /// Every token through `mask`, told before each pass how many of its tokens are a prompt's
    /// (masks that learn from the prompt: the union mask, the trace recorders). Its state is one
    /// prompt's, so the engine then runs one request at a time (a second is refused while one
    /// runs).
    pub fn with_prompt_mask(mut self, mask: &'m dyn PromptAwareMask) -> Engine<'m> {
        self.mask = Some(mask.as_mask());
        self.prompt_mask = Some(mask);
        self
    }

    /// Drafts from `drafter` (a small model sharing the vocabulary) for every request, verified
    /// in each decode pass (see [`crate::model::draft`]); a request that asks for prompt lookup
    /// too is refused.
    pub fn with_drafter(mut self, drafter: &'m Drafter) -> Engine<'m> {
        self.drafter = Some(drafter);
        self
    }

    /// Ends every request (finish `Cancelled`, tokens so far kept) once `cancel` is set: at the
    /// next step, or inside the running pass between layers.
    pub fn with_cancel(mut self, cancel: &'m AtomicBool) -> Engine<'m> {
        self.cancel = Some(cancel);
        self
    }

    /// Queues a request; it starts at the next step.
    pub fn submit(&mut self, req: Request) -> Result<RequestId> {
        let plan = check(self.model, &req, self.ctx)?;
        if self.drafter.is_some() && req.lookup > 0 {
            return Err(Error::Input(
                "drafts come from prompt lookup (--lookup) or from a draft model (--draft), not both".into(),
            ));
        }
        if self.prompt_mask.is_some() && !self.seqs.is_empty() {
            return Err(Error::Input(
                "this engine's mask learns from one prompt at a time (union, traces): one request runs at a time"
                    .into(),
            ));
        }
        let positions = plan.kv_positions;
        if let Some(limit) = self.stream.and_then(|s| s.kv_positions()) {
            let in_use: usize = self.seqs.iter().map(|s| s.cache.capacity).sum();
            if in_use + positions > limit {
                return Err(Error::Input(format!(
                    "the request needs {positions} KV positions and {in_use} are in use, but the RAM budget holds \
                     {limit} (the KV cache is counted in --ram-budget)"
                )));
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let context = if req.lookup > 0 || self.drafter.is_some() {
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
            draft: self.drafter.map(|d| d.begin(positions)),
            ignore_eos: req.ignore_eos,
            logits_on_host: req.logits_on_host,
            started: None,
            prefilled_at: None,
            stats: RequestStats::default(),
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
        self.end_before_work(&mut events);
        let mut plan = StepPlan::new(self.step_tokens_max);
        let now = Instant::now();
        self.add_decodes(&mut plan)?;
        self.add_prompt_pieces(&mut plan, now);
        if plan.batch.is_empty() {
            return Ok(events);
        }
        let want = self.want(&plan.rows);
        let prompt_fed = plan.batch.len() - plan.decode_fed;
        if let Some(m) = self.prompt_mask {
            m.prompt_tokens(prompt_fed);
        }
        let pass = self.forward(&plan, want);
        // A mask that learns from prompts is told when no prompt is left to feed (also when the
        // pass failed), so the next prompt votes from nothing.
        if let (Some(m), true) = (self.prompt_mask, pass.is_err()) {
            m.prompt_tokens(0);
        }
        let mut logits = match pass {
            Ok(l) => l,
            // Cancelled inside the pass: every request ends with the tokens it had; nothing is
            // sampled from the pass.
            Err(Error::Cancelled) => {
                for mut s in self.seqs.drain(..) {
                    events.push(finished(&mut s, Finish::Cancelled));
                }
                return Ok(events);
            }
            Err(e) => return Err(e),
        };
        self.count_prompts_fed(&plan, prompt_fed);
        self.ban_stop_tokens(&mut logits, &plan.rows);
        self.sample(&logits, &plan.rows, &mut events);
        Ok(events)
    }

    /// Ends, before any work, the requests cancelled (all of them when the engine is) and those
    /// that may generate nothing.
    fn end_before_work(&mut self, events: &mut Vec<Event>) {
        let cancelled = self.cancel.is_some_and(|c| c.load(Ordering::Relaxed));
        self.seqs.retain_mut(|s| {
            let done = cancelled || s.cancelled || s.max_tokens == 0;
            if done {
                let finish = if cancelled || s.cancelled {
                    Finish::Cancelled
                } else {
                    s.at_max
                };
                events.push(finished(s, finish));
            }
            !done
        });
    }

    /// Puts the next token of every decoding sequence in the step's batch, each with its drafts:
    /// drafts only take what the step has left once every decoding request has its token and
    /// prompts waiting to be fed have up to half the step, so no request waits for another's
    /// drafts.
    fn add_decodes(&mut self, plan: &mut StepPlan) -> Result<()> {
        let mut decoders_after = self.seqs.iter().filter(|s| s.next.is_some()).count();
        let prompt_left: usize = self
            .seqs
            .iter()
            .filter(|s| s.next.is_none())
            .map(|s| s.prompt.len() - s.fed)
            .sum();
        let for_prompts = prompt_left.min(plan.budget / 2);
        for (i, s) in self.seqs.iter_mut().enumerate() {
            s.drafts.clear();
            if let (Some(t), true) = (s.next, plan.budget > 0) {
                let slot = plan.members.len();
                plan.members.push(i);
                s.pass_start = s.cache.len;
                decoders_after -= 1;
                // Drafts: within what is spare of the step and the tokens the request may still
                // generate.
                let spare = plan.budget.saturating_sub(1 + decoders_after + for_prompts);
                let room = spare.min(s.max_tokens - s.generated - 1);
                s.drafts = match (self.drafter, s.draft.as_mut()) {
                    (Some(d), Some(st)) => d.draft(st, &s.context, room)?,
                    _ => lookup_draft(&s.context, s.lookup.min(room)),
                };
                plan.batch.push(slot, t, s.cache.len, true);
                for (j, &d) in s.drafts.iter().enumerate() {
                    plan.batch.push(slot, d, s.cache.len + 1 + j, true);
                }
                plan.rows.push((i, plan.n_rows, 1 + s.drafts.len()));
                plan.n_rows += 1 + s.drafts.len();
                plan.budget -= 1 + s.drafts.len();
                plan.decode_fed += 1 + s.drafts.len();
                self.drafted += s.drafts.len() as u64;
                s.stats.drafted += s.drafts.len();
            }
        }
        Ok(())
    }

    /// Puts the next piece of every prompt still being prefilled in the step's batch while its
    /// budget lasts (`now`: the step's start, a request's start if this is its first pass).
    fn add_prompt_pieces(&mut self, plan: &mut StepPlan, now: Instant) {
        for (i, s) in self.seqs.iter_mut().enumerate() {
            if s.next.is_some() || plan.budget == 0 {
                continue;
            }
            let take = (s.prompt.len() - s.fed).min(plan.budget);
            let slot = plan.members.len();
            plan.members.push(i);
            s.started.get_or_insert(now);
            for j in 0..take {
                let last = s.fed + j + 1 == s.prompt.len();
                plan.batch.push(slot, s.prompt[s.fed + j], s.cache.len + j, last);
                if last {
                    plan.rows.push((i, plan.n_rows, 1));
                    plan.n_rows += 1;
                }
            }
            plan.budget -= take;
        }
    }

    /// What the pass hands back for the sequences of `rows` to sample from.
    ///
    /// Each row's argmax (greedy) or k most likely tokens (a draw with a top-k) is all a
    /// sequence samples from: the device finds them (see `Want::Greedy`, `Want::Top`; the
    /// largest k asked, a row's first k of them being its own k; and the argmax too when
    /// greedy sequences are among them). Log-probabilities need each row's log-sum-exp
    /// beside them, and top log-probabilities at least as many candidates. Only a draw from
    /// the whole vocabulary (top-k 0, or more than the device lists), or more top
    /// log-probabilities than it lists, needs the logits; so do rows that disagree on
    /// banning the stop tokens (`ignore_eos`: banned on the host then), and a request that
    /// asks for them (`logits_on_host`).
    fn want(&self, rows: &[(usize, usize, usize)]) -> Want<'m> {
        let stop_ids = self.model.tokenizer.stop_ids();
        let (mut greedy, mut sampled, mut lse, mut top_k) = (0usize, 0usize, false, Some(1usize));
        let (mut bans, mut on_host) = (0usize, false);
        for &(i, _, _) in rows {
            let s = &self.seqs[i];
            lse |= s.logprobs || s.top_logprobs > 0;
            bans += s.ignore_eos as usize;
            on_host |= s.logits_on_host;
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
        let banned: &[u32] = if bans > 0 { stop_ids } else { &[] };
        match top_k {
            _ if on_host || (bans > 0 && bans < rows.len()) => Want::Logits,
            Some(_) if sampled == 0 && !lse => Want::Greedy { banned },
            Some(k) => Want::Top {
                k,
                banned,
                greedy: greedy > 0,
                lse,
            },
            None => Want::Logits,
        }
    }

    /// The step's forward pass over its batch, each member's KV cache in its slot.
    fn forward(&mut self, plan: &StepPlan, want: Want) -> Result<PassOut> {
        let hooks = Passes {
            stream: self.stream,
            batch_tokens_max: self.step_tokens_max,
            cancel: self.cancel,
        }
        .hooks(self.mask, None);
        let mut caches: Vec<&mut KvCache> = Vec::with_capacity(plan.members.len());
        let mut by_index: Vec<Option<&mut Sequence>> = self.seqs.iter_mut().map(Some).collect();
        for &i in &plan.members {
            caches.push(&mut by_index[i].take().expect("one slot per sequence").cache);
        }
        self.model.forward_batch_want(&plan.batch, &mut caches, &hooks, want)
    }

    /// Counts the prompt tokens the pass fed (`prompt_fed` in all); tells the stream when a
    /// prompt is done, and a mask that learns from prompts when none is left to feed.
    fn count_prompts_fed(&mut self, plan: &StepPlan, prompt_fed: usize) {
        let done = Instant::now();
        let mut prompt_done = false;
        for (slot, &i) in plan.members.iter().enumerate() {
            let s = &mut self.seqs[i];
            if s.next.is_none() {
                s.fed += plan.batch.seq_of_token.iter().filter(|&&x| x == slot).count();
                s.stats.prefilled = s.fed;
                if s.fed == s.prompt.len() {
                    s.prefilled_at = Some(done);
                    prompt_done = true;
                }
            }
        }
        if let (true, Some(stream)) = (prompt_done, self.stream) {
            stream.prefill_done();
        }
        if let (Some(m), true) = (
            self.prompt_mask,
            prompt_fed > 0 && self.seqs.iter().all(|s| s.next.is_some() || s.fed == s.prompt.len()),
        ) {
            m.prompt_tokens(0);
        }
    }

    /// Bans the stop tokens in the rows of a request that asks so, where the pass brought
    /// logits.
    fn ban_stop_tokens(&self, logits: &mut PassOut, rows: &[(usize, usize, usize)]) {
        let (vocab, stop_ids) = (self.model.config.vocab, self.model.tokenizer.stop_ids());
        if let PassOut::Logits(l) = logits {
            for &(i, r0, n) in rows {
                if self.seqs[i].ignore_eos {
                    for row in l[r0 * vocab..(r0 + n) * vocab].chunks_exact_mut(vocab) {
                        crate::model::sampler::ban(row, stop_ids);
                    }
                }
            }
        }
    }

    /// Samples every sequence that got logits, its drafts verified (see `walk_rows`; the cache
    /// is rolled back past a rejected draft), and ends those that finished.
    fn sample(&mut self, logits: &PassOut, rows: &[(usize, usize, usize)], events: &mut Vec<Event>) {
        let (tokenizer, vocab) = (&self.model.tokenizer, self.model.config.vocab);
        let mut ended = Vec::new();
        for &(i, r0, n) in rows {
            let s = &mut self.seqs[i];
            let decoding = s.next.is_some();
            s.stats.decode_passes += decoding as usize;
            let pass_rows = logits.rows_for(r0, n, vocab, s.sampler.is_greedy());
            let mut end = None;
            let (kept, next) = walk_rows(&mut s.sampler, pass_rows, vocab, &s.drafts, &mut |t, row| {
                s.stats.decode_tokens += decoding as usize;
                let Some((text, logprob)) = take_token(tokenizer, &mut s.decoder, row, t, s.logprobs) else {
                    end = Some(Finish::StopToken);
                    return false;
                };
                s.generated += 1;
                if s.lookup > 0 || s.draft.is_some() {
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
            s.stats.accepted += kept;
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
    }
}

/// One step's pass as it is assembled: decode tokens first, then prompt pieces while the
/// budget lasts.
struct StepPlan {
    batch: Batch,
    /// Tokens the step may still take.
    budget: usize,
    /// The sequences whose logits the pass returns, in row order: each with its first row and
    /// its number of rows (a decoding sequence has one row for its token and one after each of
    /// its drafts; a prompt's last piece, one).
    rows: Vec<(usize, usize, usize)>,
    n_rows: usize,
    /// The sequence index in `seqs` of each cache slot.
    members: Vec<usize>,
    /// Tokens of decoding sequences (fed tokens and drafts); the rest are prompt tokens.
    decode_fed: usize,
}

impl StepPlan {
    /// Nothing yet, `budget` tokens to take.
    fn new(budget: usize) -> StepPlan {
        StepPlan {
            batch: Batch::default(),
            budget,
            rows: Vec::new(),
            n_rows: 0,
            members: Vec::new(),
            decode_fed: 0,
        }
    }
}

/// Why `req` cannot run on `model` in a context of `ctx` positions (0 = the model's), or what
/// of the context it may use: what [`Engine::submit`] checks, for callers that refuse a request
/// before queueing it. A prompt that does not fit is refused before any work; generation stops
/// where the context is full.
pub fn check(model: &Model, req: &Request, ctx: usize) -> Result<ContextPlan> {
    if req.prompt_ids.is_empty() {
        return Err(Error::Input("a request needs at least one prompt token".into()));
    }
    if let Some(&t) = req.prompt_ids.iter().find(|&&t| t as usize >= model.config.vocab) {
        return Err(Error::Input(format!(
            "prompt token {t} is outside the vocabulary of {}",
            model.config.vocab
        )));
    }
    if req.stop.iter().any(|s| s.is_empty()) {
        return Err(Error::Input("a stop string may not be empty".into()));
    }
    model.context_plan(req.prompt_ids.len(), req.max_tokens, ctx)
}

/// Token `t`, chosen from `row`: `None` when it is a stop token, else the text it completes
/// and (when asked) its log-probability ([`Row::logprob`]; a pass asked for logprobs hands over
/// logits or candidates with their log-sum-exp).
fn take_token(
    tokenizer: &Tokenizer,
    decoder: &mut StreamDecoder,
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
/// positions up to `pass start + 1 + kept`; the rest are rolled back.
///
/// Rows of tokens (a greedy pass: `Want::Greedy`) are each row's token as greedy sampling
/// would pick it from the row's logits; rows of candidates (`Want::Top`) are drawn from as
/// the row's logits would be, or give their greedy tokens when they have them. `emit` gets the
/// row as the pass gave it ([`Row`]), for log-probabilities.
fn walk_rows(
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

/// The event that ends `s`, with what it cost.
fn finished(s: &mut Sequence, finish: Finish) -> Event {
    let mut text = std::mem::take(&mut s.held);
    if finish != Finish::StopString {
        text.push_str(&s.decoder.flush().unwrap_or_default());
    }
    let now = Instant::now();
    let since = |t: Option<Instant>| t.map_or(0.0, |t| now.duration_since(t).as_secs_f64());
    let mut stats = s.stats;
    stats.prefill_s = match (s.started, s.prefilled_at) {
        (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
        (a, _) => since(a),
    };
    stats.decode_s = since(s.prefilled_at);
    stats.draft_seconds = s.draft.as_ref().map_or(0.0, |d| d.seconds());
    Event::Finished {
        request: s.id,
        finish,
        text,
        stats,
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
