//! Speculative decoding with a draft model: a small model sharing the target's vocabulary,
//! resident in RAM, continues the context greedily for a few tokens; the target verifies them
//! all in one batched pass (the engine's step), so every weight a streamed target reads serves
//! several positions. Each request keeps its own draft state ([`DraftState`]: a KV cache of the
//! draft model) across passes: each call feeds only what the context gained since the last one,
//! after rolling back the drafts the target rejected.
//!
//! Exactness: the drafts are a deterministic function of the context (greedy), so the target's
//! accept/reject rule for fixed proposals (`Sampler::verify`, the rule prompt lookup uses) keeps
//! sampling exact, and greedy output is the target's own, token for token.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::batch::{Logits, PassOut, Want};
use crate::model::forward::FfnHooks;
use crate::model::Model;

/// A draft model; the state between passes is each request's own ([`Drafter::begin`]).
pub struct Drafter {
    pub model: Model,
    /// The most drafts per pass.
    pub max: usize,
}

/// One request's draft state: what the draft model has seen of its context.
pub struct DraftState {
    cache: KvCache,
    /// The tokens whose keys and values `cache` holds, in order.
    fed: Vec<u32>,
    /// Seconds spent in the draft model since the last `begin`.
    seconds: f64,
}

impl Drafter {
    /// `model` drafting up to `max` tokens per pass for `target`: refused, naming the first
    /// difference, unless both have the same vocabulary (every token's bytes, BOS and stop
    /// tokens).
    pub fn new(model: Model, target: &Model, max: usize) -> Result<Drafter> {
        if max == 0 {
            return Err(Error::Input("--draft-max must be at least 1".into()));
        }
        let (a, b) = (&target.tokenizer, &model.tokenizer);
        let differs = if a.vocab_size() != b.vocab_size() {
            Some(format!(
                "{} tokens against the target's {}",
                b.vocab_size(),
                a.vocab_size()
            ))
        } else if a.bos_id() != b.bos_id() || a.adds_bos() != b.adds_bos() {
            Some("another BOS token".to_string())
        } else {
            (0..a.vocab_size() as u32)
                .find(|&id| a.piece(id).ok() != b.piece(id).ok() || a.is_stop(id) != b.is_stop(id))
                .map(|id| format!("token {id} differs"))
        };
        if let Some(d) = differs {
            return Err(Error::Input(format!(
                "{}: a draft model must share the target's vocabulary ({}): {d}",
                model.path.display(),
                target.path.display()
            )));
        }
        Ok(Drafter { model, max })
    }

    /// The draft state of a request whose context holds at most `positions` tokens (prompt and
    /// generated): an empty cache with room for them and the drafts.
    pub fn begin(&self, positions: usize) -> DraftState {
        let room = (positions + self.max + 1).min(self.model.config.context_len.max(1));
        DraftState {
            cache: KvCache::new(&self.model.config, room),
            fed: Vec::new(),
            seconds: 0.0,
        }
    }

    /// Up to `k` tokens continuing `context` greedily (fewer when the draft's context is full),
    /// from and into the request's state `st`.
    pub fn draft(&self, st: &mut DraftState, context: &[u32], k: usize) -> Result<Vec<u32>> {
        let k = k.min(self.max);
        if k == 0 || context.is_empty() {
            return Ok(Vec::new());
        }
        let t0 = Instant::now();
        // Keep what the context still agrees with, but feed at least its last token again (the
        // logits of the position after it are not kept between calls).
        let same = st.fed.iter().zip(context).take_while(|(a, b)| a == b).count();
        let keep = same.min(context.len() - 1);
        st.cache.truncate(keep);
        st.fed.truncate(keep);
        // The context, then all but the last draft, must fit the draft's cache.
        if context.len() > st.cache.capacity {
            return Ok(Vec::new());
        }
        let k = k.min(st.cache.capacity + 1 - context.len());
        // Each draft is the argmax, found by the draft's device (see `Want::Greedy`).
        let greedy = |tokens: &[u32], cache: &mut KvCache| -> Result<u32> {
            let hooks = FfnHooks::dense();
            match self
                .model
                .forward_want(tokens, cache, Logits::Last, &hooks, Want::Greedy { banned: &[] })?
            {
                PassOut::Tokens(t) => Ok(t[0]),
                PassOut::Logits(_) | PassOut::Top { .. } => unreachable!("a greedy pass returns tokens"),
            }
        };
        let mut t = greedy(&context[keep..], &mut st.cache)?;
        st.fed.extend_from_slice(&context[keep..]);
        let mut drafts = Vec::with_capacity(k);
        loop {
            if t as usize >= self.model.tokenizer.vocab_size() {
                break;
            }
            drafts.push(t);
            if drafts.len() == k {
                break;
            }
            let fed = t;
            t = greedy(&[fed], &mut st.cache)?;
            st.fed.push(fed);
        }
        st.seconds += t0.elapsed().as_secs_f64();
        Ok(drafts)
    }
}

impl DraftState {
    /// Seconds this request spent in the draft model.
    pub fn seconds(&self) -> f64 {
        self.seconds
    }
}
