//! The tokens of one forward pass. A [`Batch`] holds tokens of one or more sequences, each with
//! its id, its position in its sequence and its sequence (an index into the KV caches passed
//! with the batch), and names the tokens whose logits the pass returns. Products run over all
//! of a batch's tokens at once; only the K/V writes and attention look at sequences. A batch
//! is checked before any work: ids inside the vocabulary, sequences that exist, each
//! sequence's positions continuing its cache without a gap, logit rows inside the batch.

use crate::error::{Error, Result};
use crate::model::sampler::{log_prob, log_softmax_at, top_log_softmax};

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
    /// with sampling ones ([`PassOut::rows_for`]). With `lse`, each row's log-sum-exp too (8
    /// bytes a row), from which the candidates' log-probabilities follow ([`Row::logprob`]).
    Top {
        k: usize,
        banned: &'a [u32],
        greedy: bool,
        lse: bool,
    },
}

pub use crate::backend::TOP_K_MAX;

/// A pass's result, as its [`Want`] asked.
#[derive(Clone, Debug, PartialEq)]
pub enum PassOut {
    /// `[rows, vocab]`.
    Logits(Vec<f32>),
    /// One token a row.
    Tokens(Vec<u32>),
    /// `k` candidates a row, `[rows, k]`, and each row's greedy token and log-sum-exp when
    /// asked (else empty; see [`Want::Top`]).
    Top {
        k: usize,
        pairs: Vec<(u32, f32)>,
        tokens: Vec<u32>,
        lse: Vec<f64>,
    },
}

/// `n` rows of a pass's result from row `first` on (see [`PassOut::rows`]).
#[derive(Clone, Copy, Debug)]
pub enum Rows<'a> {
    Logits(&'a [f32]),
    Tokens(&'a [u32]),
    /// `k` candidates a row ([`Want::Top`]), each row's log-sum-exp (empty when not asked), and
    /// each row's greedy token for a greedy sequence (see [`PassOut::rows_for`]; else empty).
    Top {
        k: usize,
        pairs: &'a [(u32, f32)],
        lse: &'a [f64],
        tokens: &'a [u32],
    },
}

/// One row of a pass's result as a sampled token's emitter sees it (see
/// [`crate::model::generate::walk_rows`]).
#[derive(Clone, Copy, Debug)]
pub enum Row<'a> {
    /// The row's logits.
    Logits(&'a [f32]),
    /// A greedy token alone: nothing to say of log-probabilities.
    Token,
    /// The row's candidates, most likely first, and its log-sum-exp when the pass was asked.
    Top { pairs: &'a [(u32, f32)], lse: Option<f64> },
}

impl Row<'_> {
    /// ln p of token `t`, a token sampled from this row: from the logits
    /// ([`log_softmax_at`]), or `t`'s candidate value less the row's log-sum-exp. `None` when the
    /// row cannot say (a token alone, candidates without a log-sum-exp).
    ///
    /// A greedy token need not be among the candidates: [`crate::model::sampler::argmax`] and the
    /// candidates' order differ only where the row's largest values tie as -0 and +0 (equal
    /// values) or a NaN is in it (then the log-sum-exp is NaN): the first candidate's value then
    /// gives what the logits would.
    pub fn logprob(&self, t: u32) -> Option<f32> {
        match *self {
            Row::Logits(l) => Some(log_softmax_at(l, t)),
            Row::Token => None,
            Row::Top { pairs, lse } => {
                let z = lse?;
                let v = pairs.iter().find(|p| p.0 == t).or(pairs.first())?.1;
                Some(log_prob(v, z))
            }
        }
    }

    /// The `n` most likely tokens with their ln p, most likely first (as [`top_log_softmax`]):
    /// from the logits, or the first `n` candidates (a pass asked for at least `n`, with the
    /// log-sum-exp). Empty when `n` is 0 or the row cannot say.
    pub fn top_logprobs(&self, n: usize) -> Vec<(u32, f32)> {
        match *self {
            Row::Logits(l) => top_log_softmax(l, n),
            Row::Token | Row::Top { lse: None, .. } => Vec::new(),
            Row::Top { pairs, lse: Some(z) } => pairs.iter().take(n).map(|&(t, v)| (t, log_prob(v, z))).collect(),
        }
    }
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
                lse: Vec::new(),
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

    /// Rows `first..first + n` (rows of `vocab` logits, tokens, or candidates; a pass of
    /// candidates' greedy tokens are left out: see [`PassOut::rows_for`]).
    pub fn rows(&self, first: usize, n: usize, vocab: usize) -> Rows<'_> {
        self.rows_for(first, n, vocab, false)
    }

    /// [`PassOut::rows`] for a sequence that samples greedily (`greedy`) or not: its tokens
    /// where a pass of candidates found them too ([`Want::Top`] with `greedy`).
    pub fn rows_for(&self, first: usize, n: usize, vocab: usize, greedy: bool) -> Rows<'_> {
        match self {
            PassOut::Logits(l) => Rows::Logits(&l[first * vocab..(first + n) * vocab]),
            PassOut::Tokens(t) => Rows::Tokens(&t[first..first + n]),
            PassOut::Top { k, pairs, tokens, lse } => Rows::Top {
                k: *k,
                pairs: &pairs[first * k..(first + n) * k],
                lse: if lse.is_empty() { &[] } else { &lse[first..first + n] },
                tokens: if greedy && !tokens.is_empty() {
                    &tokens[first..first + n]
                } else {
                    &[]
                },
            },
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
                return Err(Error::Internal(format!(
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
            return Err(Error::Internal(format!(
                "a batch of {n} ids has {} positions and {} sequence indices",
                self.positions.len(),
                self.seq_of_token.len()
            )));
        }
        let mut next: Vec<usize> = cache_lens.iter().map(|&(len, _)| len).collect();
        for t in 0..n {
            let (id, pos, s) = (self.ids[t], self.positions[t], self.seq_of_token[t]);
            if id as usize >= vocab {
                return Err(Error::Input(format!(
                    "token id {id} is outside the vocabulary of {vocab}"
                )));
            }
            let Some(&(_, capacity)) = cache_lens.get(s) else {
                return Err(Error::Internal(format!(
                    "token {t} of the batch belongs to sequence {s}, but the pass was given {} caches",
                    cache_lens.len()
                )));
            };
            if pos != next[s] {
                return Err(Error::Internal(format!(
                    "token {t} of the batch is at position {pos} of sequence {s}, whose next position is {}",
                    next[s]
                )));
            }
            if pos >= capacity {
                return Err(Error::Input(format!(
                    "context full: sequence {s} needs position {pos} but its cache holds {capacity} positions (raise --ctx)"
                )));
            }
            next[s] = pos + 1;
        }
        if let Some(&r) = self.logit_rows.iter().find(|&&r| r >= n) {
            return Err(Error::Internal(format!(
                "logits asked for token {r} of a batch of {n} tokens"
            )));
        }
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row's candidates with its log-sum-exp give the log-probabilities its logits give, bit
    /// for bit: of every candidate, of the greedy token where it is not the first candidate
    /// (-0 and +0 tied largest; a NaN in the row), and the top ones in order; with stop ids
    /// banned on both sides.
    #[test]
    fn candidates_with_log_sum_exp_give_the_logits_log_probabilities() {
        use crate::backend::cpu::CpuBackend;
        use crate::backend::Device;
        use crate::model::sampler::{argmax_banned, ban, test_rng};
        let mut next = test_rng();
        let mut rows: Vec<Vec<f32>> = (0..6)
            .map(|_| (0..300).map(|_| (next() % 20_000) as f32 / 1000.0 - 10.0).collect())
            .collect();
        // Ties: -0 before +0 as the largest; a NaN; a row where one value dominates.
        rows[1].iter_mut().for_each(|v| *v = -v.abs() - 1.0);
        rows[1][3] = -0.0;
        rows[1][7] = 0.0;
        rows[2][5] = f32::NAN;
        rows[3][9] = 80.0;
        let dev = CpuBackend::new(1);
        for banned in [vec![], vec![9, 0, 1000]] {
            let values: Vec<f32> = rows.concat();
            let x = dev.upload(rows.len(), 300, values);
            let k = 8;
            let top = dev.top_k_rows(&x, k, &banned, true, true);
            let greedy = &top.tokens;
            assert_eq!(greedy, &dev.argmax_rows(&x, &banned));
            assert_eq!((top.pairs.len(), top.lse.len()), (rows.len() * k, rows.len()));
            for (r, row) in rows.iter().enumerate() {
                let mut logits = row.clone();
                ban(&mut logits, &banned);
                let from_logits = Row::Logits(&logits);
                let from_top = Row::Top {
                    pairs: &top.pairs[r * k..(r + 1) * k],
                    lse: Some(top.lse[r]),
                };
                let g = greedy[r];
                assert_eq!(g, argmax_banned(row, &banned));
                let tokens = top.pairs[r * k..(r + 1) * k].iter().map(|p| p.0).chain([g]);
                for t in tokens {
                    let (a, b) = (from_top.logprob(t).unwrap(), from_logits.logprob(t).unwrap());
                    assert_eq!(a.to_bits(), b.to_bits(), "row {r}, token {t}: {a} against {b}");
                }
                for n in [0, 1, 5, k] {
                    let (a, b) = (from_top.top_logprobs(n), from_logits.top_logprobs(n));
                    let bits = |v: &[(u32, f32)]| v.iter().map(|&(t, l)| (t, l.to_bits())).collect::<Vec<_>>();
                    assert_eq!(bits(&a), bits(&b), "row {r}, top {n}");
                }
            }
            assert_eq!(greedy[1], 3, "-0 at 3 is the first largest");
            assert_ne!(top.pairs[k].0, 3, "total order puts +0 first");
        }
        // Without the log-sum-exp, or a token alone, there is nothing to say.
        let pairs = [(1u32, 0.5f32)];
        assert_eq!(
            Row::Top {
                pairs: &pairs,
                lse: None
            }
            .logprob(1),
            None
        );
        assert!(Row::Top {
            pairs: &pairs,
            lse: None
        }
        .top_logprobs(1)
        .is_empty());
        assert_eq!(Row::Token.logprob(1), None);
    }

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
