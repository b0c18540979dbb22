//! One request through the engine: what `run`, `eval`'s generations and the tests call
//! ([`Model::generate_ids`] and its siblings). The engine's step does the work (prefill in
//! pieces, decode, drafts, masks, cancelling); this turns its events into the callback's
//! tokens and its statistics into a [`Generation`].

use std::sync::atomic::AtomicBool;

use crate::engine::{Engine, Event, Request};
use crate::error::{Error, Result};
use crate::model::draft::Drafter;
use crate::model::forward::LayerStream;
use crate::model::generate::{GenerateOptions, Generation, PromptAwareMask, Speculation, TokenEvent};
use crate::model::Model;

impl Model {
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
        if prompt_ids.is_empty() {
            return Err(Error::Input("generation needs at least one prompt token".into()));
        }
        let mut engine = Engine::new(self, stream, opts.batch_tokens_max).with_context(opts.ctx);
        if let Some(m) = mask {
            engine = engine.with_prompt_mask(m);
        }
        if let Some(d) = draft {
            engine = engine.with_drafter(d);
        }
        if let Some(c) = cancel {
            engine = engine.with_cancel(c);
        }
        engine.submit(Request {
            prompt_ids: prompt_ids.to_vec(),
            max_tokens: opts.max_tokens,
            sampler: opts.sampler.clone(),
            logprobs: opts.logprobs,
            top_logprobs: 0,
            stop: Vec::new(),
            lookup: opts.lookup,
            ignore_eos: opts.ignore_eos,
            logits_on_host: opts.logits_on_host,
        })?;
        let (mut text, mut tokens, mut logprobs) = (String::new(), Vec::new(), Vec::new());
        loop {
            for event in engine.step()? {
                match event {
                    Event::Token {
                        token,
                        text: piece,
                        logprob,
                        ..
                    } => {
                        tokens.push(token);
                        logprobs.extend(logprob);
                        on_token(&TokenEvent {
                            id: Some(token),
                            text: &piece,
                            logprob,
                        });
                        text.push_str(&piece);
                    }
                    // An unfinished UTF-8 sequence at the end is not lost: it is written as U+FFFD.
                    Event::Finished {
                        finish,
                        text: rest,
                        stats,
                        ..
                    } => {
                        if !rest.is_empty() {
                            on_token(&TokenEvent {
                                id: None,
                                text: &rest,
                                logprob: None,
                            });
                            text.push_str(&rest);
                        }
                        let speculating = opts.lookup > 0 || draft.is_some();
                        // Decode speed: tokens sampled from decode passes (sampling included)
                        // per second; the first generated token comes from the prompt's pass.
                        return Ok(Generation {
                            text,
                            prefill_tok_per_s: stats.prefilled as f64 / stats.prefill_s.max(1e-9),
                            decode_tok_per_s: if stats.decode_passes > 0 {
                                stats.decode_tokens as f64 / stats.decode_s.max(1e-9)
                            } else {
                                0.0
                            },
                            decode_tokens: stats.decode_tokens,
                            speculative: speculating.then(|| Speculation {
                                source: if draft.is_some() { "draft" } else { "lookup" },
                                lookup_max: draft.map_or(opts.lookup, |d| d.max),
                                draft_seconds: stats.draft_seconds,
                                drafted: stats.drafted,
                                accepted: stats.accepted,
                                acceptance_rate: stats.accepted as f64 / stats.drafted.max(1) as f64,
                                passes: stats.decode_passes,
                                tokens_per_pass: stats.decode_tokens as f64 / stats.decode_passes.max(1) as f64,
                            }),
                            prompt_tokens: prompt_ids.len(),
                            completion_tokens: tokens.len(),
                            tokens,
                            logprobs,
                            prompt_token_ids: prompt_ids.to_vec(),
                            finish,
                            prefill_s: stats.prefill_s,
                            decode_s: stats.decode_s,
                        });
                    }
                }
            }
        }
    }
}
