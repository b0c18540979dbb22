//! Text generation: encode the prompt (optionally through the chat template), prefill it in
//! one batch, then decode one token at a time, handing text to a callback as soon as it is
//! complete UTF-8. Timing is measured here so every caller reports the same numbers.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::model::batch::Logits;
use crate::model::forward::{FfnHooks, FfnMask, FfnNeurons, LayerStream};
use crate::model::kv::KvCache;
use crate::model::sampler::{Sampler, SamplerConfig};
use crate::model::Model;

/// A mask that generation tells how many of the next batch's tokens are the prompt.
pub trait PromptAwareMask: Sync {
    fn prompt_tokens(&self, n: usize);
    fn as_mask(&self) -> &dyn FfnMask;
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Render the prompt with the model's chat template.
    pub chat: bool,
    /// KV cache positions to allocate (prompt + generated); 0 = prompt + max_tokens.
    pub ctx: usize,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Generation {
    pub text: String,
    /// Generated token ids (not the prompt).
    pub tokens: Vec<u32>,
    pub prompt_tokens: Vec<u32>,
    /// Why generation ended: "stop_token" or "max_tokens".
    pub finish: &'static str,
    pub prefill_s: f64,
    pub decode_s: f64,
    pub prefill_tok_per_s: f64,
    pub decode_tok_per_s: f64,
}

impl Model {
    pub fn generate(&self, prompt: &str, opts: &GenerateOptions, on_text: &mut dyn FnMut(&str)) -> Result<Generation> {
        self.generate_with(prompt, opts, None, None, on_text)
    }

    /// As `generate`, with an FFN mask applied to every layer of every step (the prompt's
    /// length is announced to it first, for masks that learn from the prompt).
    pub fn generate_with(
        &self,
        prompt: &str,
        opts: &GenerateOptions,
        mask: Option<&dyn PromptAwareMask>,
        stream: Option<&dyn LayerStream>,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        let text = if opts.chat {
            if !self.tokenizer.has_chat_template() {
                return Err(Error::Invalid(format!(
                    "{}: --chat given but the model has no chat template",
                    self.path.display()
                )));
            }
            self.tokenizer.apply_chat_template(prompt)?
        } else {
            prompt.to_string()
        };
        // A chat template writes its own BOS where the model wants one.
        let prompt_tokens = self.tokenizer.encode(&text, !opts.chat)?;
        if prompt_tokens.is_empty() {
            return Err(Error::Invalid(
                "the prompt encodes to no tokens and the model has no BOS to start from".into(),
            ));
        }
        let ctx = if opts.ctx == 0 {
            prompt_tokens.len() + opts.max_tokens
        } else {
            opts.ctx
        };
        if prompt_tokens.len() + opts.max_tokens > ctx {
            return Err(Error::Invalid(format!(
                "prompt ({} tokens) + --max-tokens {} exceed --ctx {ctx}",
                prompt_tokens.len(),
                opts.max_tokens
            )));
        }
        let mut cache = KvCache::new(&self.config, ctx);
        let mut sampler = Sampler::new(opts.sampler.clone());
        let mut decoder = self.tokenizer.stream_decoder();
        let mut out_text = String::new();
        let mut tokens = Vec::new();

        let t0 = Instant::now();
        let step = |tokens: &[u32], cache: &mut KvCache| -> Result<Vec<f32>> {
            let hooks = FfnHooks {
                select: &|_, _| FfnNeurons::All,
                observe: None,
                mask: mask.map(|m| m.as_mask()),
                stream,
            };
            self.forward_with(tokens, cache, Logits::Last, &hooks)
        };
        if let Some(m) = mask {
            m.prompt_tokens(prompt_tokens.len());
        }
        let mut logits = step(&prompt_tokens, &mut cache)?;
        if let Some(m) = mask {
            m.prompt_tokens(0);
        }
        if let Some(s) = stream {
            s.prefill_done();
        }
        let prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut finish = "max_tokens";
        let mut n_decode_forward = 0usize;
        for i in 0..opts.max_tokens {
            let next = sampler.sample(&logits);
            if self.tokenizer.is_stop(next) {
                finish = "stop_token";
                break;
            }
            tokens.push(next);
            if let Some(s) = decoder.push(next) {
                on_text(&s);
                out_text.push_str(&s);
            }
            if i + 1 < opts.max_tokens {
                logits = step(&[next], &mut cache)?;
                n_decode_forward += 1;
            }
        }
        // Decode speed: single-token forward passes (sampling included) per second; the first
        // generated token comes from the prefill.
        let decode_s = t1.elapsed().as_secs_f64();
        Ok(Generation {
            text: out_text,
            prefill_tok_per_s: prompt_tokens.len() as f64 / prefill_s.max(1e-9),
            decode_tok_per_s: if n_decode_forward > 0 {
                n_decode_forward as f64 / decode_s.max(1e-9)
            } else {
                0.0
            },
            tokens,
            prompt_tokens,
            finish,
            prefill_s,
            decode_s,
        })
    }
}
