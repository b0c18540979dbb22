//! The tokens of one forward pass. A [`Batch`] holds tokens of one or more sequences, each with
//! its id, its position in its sequence and its sequence (an index into the KV caches passed
//! with the batch), and names the tokens whose logits the pass returns. Products run over all
//! of a batch's tokens at once; only the K/V writes and attention look at sequences. A batch
//! is checked before any work: ids inside the vocabulary, sequences that exist, each
//! sequence's positions continuing its cache without a gap, logit rows inside the batch.

use crate::error::{Error, Result};

/// Which positions of a one-sequence batch need logits ([`Batch::one`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every position from this index of the batch on (perplexity scores half a window); an
    /// index past the batch's last token is an error.
    From(usize),
}

/// What a pass hands back for its logit rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want<'a> {
    /// The logits, `[rows, vocab]`.
    Logits,
    /// Each row's greedy token ([`crate::model::sampler::argmax`], the `banned` ids counted as
    /// -inf), found where the logits are: from a GPU, 4 bytes a row come to the host instead of
    /// a vocabulary of logits.
    Greedy { banned: &'a [u32] },
    /// Each row's `k` largest logits with their ids, largest first (ties: lower id first, in
    /// `f32::total_cmp`'s order), the `banned` ids counted as -inf: all a sampler with top-k
    /// draws from ([`crate::model::sampler::Sampler::sample_top`]). From a GPU, 8 bytes a
    /// candidate come to the host instead of a vocabulary of logits. `k` is at most
    /// [`TOP_K_MAX`] and the vocabulary. With `greedy`, each row's greedy token too (as
    /// [`Want::Greedy`]; 4 bytes a row more), for a step whose greedy sequences share the pass
    /// with sampling ones ([`PassOut::rows_for`]).
    Top { k: usize, banned: &'a [u32], greedy: bool },
}

/// The most candidates a row of [`Want::Top`] may ask for (a GPU block sorts them).
pub const TOP_K_MAX: usize = 1024;

/// A pass's result, as its [`Want`] asked.
#[derive(Clone, Debug, PartialEq)]
pub enum PassOut {
    /// `[rows, vocab]`.
    Logits(Vec<f32>),
    /// One token a row.
    Tokens(Vec<u32>),
    /// `k` candidates a row, `[rows, k]`, and each row's greedy token when asked (else empty;
    /// see [`Want::Top`]).
    Top {
        k: usize,
        pairs: Vec<(u32, f32)>,
        tokens: Vec<u32>,
    },
}

/// `n` rows of a pass's result from row `first` on (see [`PassOut::rows`]).
#[derive(Clone, Copy, Debug)]
pub enum Rows<'a> {
    Logits(&'a [f32]),
    Tokens(&'a [u32]),
    /// `k` candidates a row ([`Want::Top`]).
    Top {
        k: usize,
        pairs: &'a [(u32, f32)],
    },
}

impl PassOut {
    /// The empty result `want` asks for (a pass with no logit rows).
    pub fn empty(want: Want) -> PassOut {
        match want {
            Want::Logits => PassOut::Logits(Vec::new()),
            Want::Greedy { .. } => PassOut::Tokens(Vec::new()),
            Want::Top { k, .. } => PassOut::Top {
                k,
                pairs: Vec::new(),
                tokens: Vec::new(),
            },
        }
    }

    pub fn is_empty(&self) -> bool {
        match self {
            PassOut::Logits(l) => l.is_empty(),
            PassOut::Tokens(t) => t.is_empty(),
            PassOut::Top { pairs, .. } => pairs.is_empty(),
        }
    }

    /// The logits; a pass that was asked for logits returns them.
    pub fn into_logits(self) -> Vec<f32> {
        match self {
            PassOut::Logits(l) => l,
            PassOut::Tokens(_) | PassOut::Top { .. } => unreachable!("a pass asked for logits returns logits"),
        }
    }

    /// Rows `first..first + n` (rows of `vocab` logits, or tokens).
    pub fn rows(&self, first: usize, n: usize, vocab: usize) -> Rows<'_> {
        match self {
            PassOut::Logits(l) => Rows::Logits(&l[first * vocab..(first + n) * vocab]),
            PassOut::Tokens(t) => Rows::Tokens(&t[first..first + n]),
            PassOut::Top { k, pairs, .. } => Rows::Top {
                k: *k,
                pairs: &pairs[first * k..(first + n) * k],
            },
        }
    }

    /// [`PassOut::rows`] for a sequence that samples greedily (`greedy`) or not: its tokens
    /// where a pass of candidates found them too ([`Want::Top`] with `greedy`).
    pub fn rows_for(&self, first: usize, n: usize, vocab: usize, greedy: bool) -> Rows<'_> {
        match self {
            PassOut::Top { tokens, .. } if greedy && !tokens.is_empty() => Rows::Tokens(&tokens[first..first + n]),
            _ => self.rows(first, n, vocab),
        }
    }
}

/// Tokens of a forward pass (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub ids: Vec<u32>,
    /// Each token's position in its sequence.
    pub positions: Vec<usize>,
    /// Each token's sequence: an index into the caches the pass is given.
    pub seq_of_token: Vec<usize>,
    /// The tokens (indices into `ids`) whose logits the pass returns, one row each, in this order.
    pub logit_rows: Vec<usize>,
}

impl Batch {
    /// `ids` of sequence 0 at positions `start..`, logits as `which` says.
    pub fn one(ids: &[u32], start: usize, which: Logits) -> Result<Batch> {
        let n = ids.len();
        let first = match which {
            Logits::Last => n.saturating_sub(1),
            Logits::From(i) if i < n => i,
            Logits::From(i) => {
                return Err(Error::Invalid(format!(
                    "logits asked from position {i} of a batch of {n} tokens (the last is {})",
                    n.saturating_sub(1)
                )))
            }
        };
        Ok(Batch {
            ids: ids.to_vec(),
            positions: (start..start + n).collect(),
            seq_of_token: vec![0; n],
            logit_rows: if n == 0 { Vec::new() } else { (first..n).collect() },
        })
    }

    /// Appends token `id` of sequence `seq` at `position`; `logits`: return its logits.
    pub fn push(&mut self, seq: usize, id: u32, position: usize, logits: bool) {
        if logits {
            self.logit_rows.push(self.ids.len());
        }
        self.ids.push(id);
        self.positions.push(position);
        self.seq_of_token.push(seq);
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Checks the batch against the model's vocabulary and the caches' lengths and
    /// capacities; returns each cache's length after the pass.
    pub(crate) fn check(&self, vocab: usize, cache_lens: &[(usize, usize)]) -> Result<Vec<usize>> {
        let n = self.ids.len();
        if self.positions.len() != n || self.seq_of_token.len() != n {
            return Err(Error::Invalid(format!(
                "a batch of {n} ids has {} positions and {} sequence indices",
                self.positions.len(),
                self.seq_of_token.len()
            )));
        }
        let mut next: Vec<usize> = cache_lens.iter().map(|&(len, _)| len).collect();
        for t in 0..n {
            let (id, pos, s) = (self.ids[t], self.positions[t], self.seq_of_token[t]);
            if id as usize >= vocab {
                return Err(Error::Invalid(format!(
                    "token id {id} is outside the vocabulary of {vocab}"
                )));
            }
            let Some(&(_, capacity)) = cache_lens.get(s) else {
                return Err(Error::Invalid(format!(
                    "token {t} of the batch belongs to sequence {s}, but the pass was given {} caches",
                    cache_lens.len()
                )));
            };
            if pos != next[s] {
                return Err(Error::Invalid(format!(
                    "token {t} of the batch is at position {pos} of sequence {s}, whose next position is {}",
                    next[s]
                )));
            }
            if pos >= capacity {
                return Err(Error::Invalid(format!(
                    "context full: sequence {s} needs position {pos} but its cache holds {capacity} positions (raise --ctx)"
                )));
            }
            next[s] = pos + 1;
        }
        if let Some(&r) = self.logit_rows.iter().find(|&&r| r >= n) {
            return Err(Error::Invalid(format!(
                "logits asked for token {r} of a batch of {n} tokens"
            )));
        }
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_from_past_the_batch_is_an_error() {
        assert_eq!(Batch::one(&[1, 2, 3], 0, Logits::From(2)).unwrap().logit_rows, [2]);
        let e = Batch::one(&[1, 2, 3], 0, Logits::From(3)).unwrap_err().to_string();
        assert!(e.contains("position 3 of a batch of 3"), "{e}");
    }

    #[test]
    fn positions_must_continue_each_cache() {
        let mut b = Batch::default();
        b.push(0, 5, 4, false);
        b.push(1, 6, 0, true);
        b.push(0, 7, 5, true);
        assert_eq!(b.check(10, &[(4, 8), (0, 8)]).unwrap(), [6, 1]);
        assert!(b
            .check(10, &[(3, 8), (0, 8)])
            .unwrap_err()
            .to_string()
            .contains("next position is 3"));
        assert!(b
            .check(10, &[(4, 8)])
            .unwrap_err()
            .to_string()
            .contains("given 1 caches"));
        assert!(b
            .check(10, &[(4, 5), (0, 8)])
            .unwrap_err()
            .to_string()
            .contains("context full"));
        assert!(b
            .check(6, &[(4, 8), (0, 8)])
            .unwrap_err()
            .to_string()
            .contains("vocabulary"));
    }
}
