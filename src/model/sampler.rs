//! Choosing the next token from logits: greedy, or temperature with top-k and top-p, from a
//! seeded generator so a run can be repeated exactly. The distribution a draw is made from is
//! exposed ([`Sampler::distribution`]), as speculative acceptance and logprobs need.
//!
//! Why its own generator (xorshift64* seeded by splitmix64) rather than `rand`: a draw must be
//! the same on every platform and version for a seed (tests and users compare runs), which
//! `rand` does not promise across releases; the generator is six lines.

#[derive(Clone, Debug)]
pub struct SamplerConfig {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1.0 = all).
    pub top_p: f32,
    pub seed: u64,
}

impl SamplerConfig {
    /// Greedy: every token is the logits' argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// The top-k a sampler asks of a pass ([`crate::model::batch::Want::Top`]) in place of
    /// the logits: `Some(top_k)` when it draws with a top-k of at most
    /// [`crate::backend::TOP_K_MAX`] (the candidates are then all a draw looks at).
    pub fn device_top_k(&self) -> Option<usize> {
        let k = self.top_k;
        (!self.is_greedy() && (1..=crate::backend::TOP_K_MAX).contains(&k)).then_some(k)
    }
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 40,
            top_p: 0.95,
            seed: 0,
        }
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    state: u64,
}

#[cfg(test)]
use crate::backend::pick::argmax_scan;
pub use crate::backend::pick::{argmax, argmax_banned, ban, most_likely};

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        // splitmix64 of the seed, so seeds 0 and 1 start far apart.
        let mut s = cfg.seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        s = (s ^ (s >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        s = (s ^ (s >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Sampler {
            cfg,
            state: (s ^ (s >> 31)) | 1,
        }
    }

    /// Greedy: every token is the logits' argmax (and no draw is made).
    pub fn is_greedy(&self) -> bool {
        self.cfg.is_greedy()
    }

    /// xorshift64*: uniform in [0, 1).
    fn uniform(&mut self) -> f32 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        let r = self.state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (r >> 40) as f32 / (1u64 << 24) as f32
    }

    /// See [`SamplerConfig::device_top_k`].
    pub fn device_top_k(&self) -> Option<usize> {
        self.cfg.device_top_k()
    }

    /// The tokens a draw can pick and their unnormalized weights (most likely first), and the
    /// weights' sum; `None` for greedy.
    fn candidates(&self, logits: &[f32]) -> Option<(Vec<(u32, f32)>, f32)> {
        if self.cfg.is_greedy() || logits.is_empty() {
            return None;
        }
        let k = if self.cfg.top_k == 0 {
            logits.len()
        } else {
            self.cfg.top_k
        };
        Some(self.weigh(most_likely(logits, k)))
    }

    /// [`Sampler::candidates`] from a row's most likely tokens as [`most_likely`] lists them
    /// (at least `top_k` of them, or the whole vocabulary): the first `top_k` are the same.
    fn candidates_of(&self, top: &[(u32, f32)]) -> (Vec<(u32, f32)>, f32) {
        assert!(
            self.device_top_k().is_some() && !top.is_empty(),
            "candidates handed over for a sampler without top-k"
        );
        self.weigh(top[..self.cfg.top_k.min(top.len())].to_vec())
    }

    /// Temperature, then top-p, over candidates most likely first.
    fn weigh(&self, mut cand: Vec<(u32, f32)>) -> (Vec<(u32, f32)>, f32) {
        let max = cand[0].1;
        let mut sum = 0f32;
        for c in cand.iter_mut() {
            c.1 = ((c.1 - max) / self.cfg.temperature).exp();
            sum += c.1;
        }
        let mut kept = 0;
        let mut acc = 0f32;
        for c in &cand {
            acc += c.1 / sum;
            kept += 1;
            if acc >= self.cfg.top_p {
                break;
            }
        }
        cand.truncate(kept.max(1));
        let total: f32 = cand.iter().map(|c| c.1).sum();
        (cand, total)
    }

    /// The distribution `sample` draws from: `(token, probability)`, most likely first,
    /// probabilities summing to 1 (greedy: the argmax with probability 1).
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        match self.candidates(logits) {
            None => vec![(argmax(logits), 1.0)],
            Some((cand, total)) => cand.into_iter().map(|(t, w)| (t, w / total)).collect(),
        }
    }

    /// A token for `logits` when `draft` was proposed for this position (speculative decoding
    /// with a draft that has no distribution of its own): greedy, the argmax (the draft is kept
    /// exactly when it is the argmax); sampling, the draft with its probability under
    /// [`Sampler::distribution`], else a token drawn from that distribution without the draft.
    /// Either way the token is distributed exactly as [`Sampler::sample`]'s.
    pub fn verify(&mut self, logits: &[f32], draft: u32) -> u32 {
        match self.candidates(logits) {
            None => argmax(logits),
            Some((cand, total)) => self.keep_or_draw(&cand, total, draft),
        }
    }

    /// [`Sampler::verify`] from the row's most likely tokens (`top`, as [`most_likely`] lists
    /// them, at least [`Sampler::device_top_k`] of them or the whole vocabulary): the same token for
    /// the same generator state.
    pub fn verify_top(&mut self, top: &[(u32, f32)], draft: u32) -> u32 {
        let (cand, total) = self.candidates_of(top);
        self.keep_or_draw(&cand, total, draft)
    }

    fn keep_or_draw(&mut self, cand: &[(u32, f32)], total: f32, draft: u32) -> u32 {
        let w = cand.iter().find(|c| c.0 == draft).map_or(0.0, |c| c.1);
        if self.uniform() * total < w {
            return draft;
        }
        let rest = total - w;
        let mut r = self.uniform() * rest;
        let mut last = None;
        for c in cand.iter().filter(|c| c.0 != draft) {
            r -= c.1;
            last = Some(c.0);
            if r <= 0.0 {
                return c.0;
            }
        }
        // Rounding left a sliver: the last other candidate (or the draft, if it is the only one).
        last.unwrap_or(draft)
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        match self.candidates(logits) {
            None => argmax(logits),
            Some((cand, total)) => self.draw(&cand, total),
        }
    }

    /// [`Sampler::sample`] from the row's most likely tokens (see [`Sampler::verify_top`]).
    pub fn sample_top(&mut self, top: &[(u32, f32)]) -> u32 {
        let (cand, total) = self.candidates_of(top);
        self.draw(&cand, total)
    }

    fn draw(&mut self, cand: &[(u32, f32)], total: f32) -> u32 {
        let mut r = self.uniform() * total;
        for c in cand {
            r -= c.1;
            if r <= 0.0 {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
    }
}

/// `ln softmax(logits)[id]`, in f64 (the model's own log-probability of a token).
pub fn log_softmax_at(logits: &[f32], id: u32) -> f32 {
    log_prob(logits[id as usize], crate::backend::ops::log_sum_exp(logits))
}

/// ln p of a logit `value` in a row whose log-sum-exp is `lse`, in f64 (as the logits or a
/// device's candidates give them: `crate::model::batch::Row`).
pub fn log_prob(value: f32, lse: f64) -> f32 {
    (value as f64 - lse) as f32
}

/// The `n` most likely tokens under `softmax(logits)` with their ln p, most likely first (ties:
/// lower id first).
pub fn top_log_softmax(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let z = crate::backend::ops::log_sum_exp(logits);
    most_likely(logits, n)
        .into_iter()
        .map(|(t, l)| (t, log_prob(l, z)))
        .collect()
}

/// A xorshift generator for tests' rows (a fixed seed: the same rows every run).
#[cfg(test)]
pub(crate) fn test_rng() -> impl FnMut() -> u64 {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_is_the_first_largest_as_one_scan_finds_it() {
        let mut next = test_rng();
        let mut cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![1.0],
            vec![f32::NAN, 5.0, 7.0],
            vec![2.0, f32::NAN, 3.0],
            vec![f32::NEG_INFINITY; 40],
            vec![0.0; 33],
            vec![-0.0, 0.0, -0.0],
        ];
        // Ties across lanes, in the tail, NaNs and infinities anywhere; lengths around 16.
        for len in [1usize, 15, 16, 17, 31, 32, 33, 100, 1000, 151_936] {
            for kind in 0..6u64 {
                let v: Vec<f32> = (0..len)
                    .map(|_| {
                        let r = next();
                        match (kind, r % 97) {
                            (1, _) => (r % 5) as f32,
                            (2, 0) => f32::NAN,
                            (3, 0) => f32::INFINITY,
                            (4, _) => -((r % 3) as f32),
                            (5, 0) => f32::NEG_INFINITY,
                            _ => (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5,
                        }
                    })
                    .collect();
                cases.push(v);
            }
        }
        for (i, c) in cases.iter().enumerate() {
            assert_eq!(argmax(c), argmax_scan(c), "case {i} (length {})", c.len());
        }
    }

    /// A banned id never wins (unless every other is NaN or banned too: then 0, as the scan of
    /// the row with -inf written there); ids past the row are passed over.
    #[test]
    fn banned_ids_count_as_minus_infinity() {
        let row = [0.5f32, 3.0, -1.0, 3.0, 2.0];
        assert_eq!(argmax_banned(&row, &[]), 1);
        assert_eq!(argmax_banned(&row, &[1]), 3);
        assert_eq!(argmax_banned(&row, &[1, 3, 99]), 4);
        assert_eq!(argmax_banned(&row, &[99]), 1);
        assert_eq!(argmax_banned(&[f32::NAN, 1.0, 2.0], &[]), 0);
        assert_eq!(argmax_banned(&[f32::NAN, 1.0, 2.0], &[0]), 2);
        assert_eq!(argmax_banned(&[1.0, f32::NAN], &[0]), 0);
        for banned in [&[0u32, 1, 2, 3, 4][..], &[4, 3, 2, 1, 0]] {
            assert_eq!(argmax_banned(&row, banned), 0);
        }
        for ban in 0..row.len() as u32 {
            let mut r = row;
            r[ban as usize] = f32::NEG_INFINITY;
            assert_eq!(argmax_banned(&row, &[ban]), argmax_scan(&r), "ban {ban}");
        }
    }

    /// A draft kept with its probability, else a draw without it, is distributed as a plain
    /// draw: frequencies over 200,000 draws agree within 0.005 for every token and draft.
    #[test]
    fn verifying_a_draft_samples_the_same_distribution() {
        let logits = [1.0f32, 0.5, 0.0, -1.0, 2.0];
        let cfg = SamplerConfig {
            temperature: 0.8,
            top_k: 4,
            top_p: 0.97,
            seed: 3,
        };
        let n = 200_000;
        let mut plain = Sampler::new(cfg.clone());
        let mut want = [0f64; 5];
        for _ in 0..n {
            want[plain.sample(&logits) as usize] += 1.0 / n as f64;
        }
        for draft in [0u32, 3, 4] {
            let mut s = Sampler::new(SamplerConfig {
                seed: 11 + draft as u64,
                ..cfg.clone()
            });
            let mut got = [0f64; 5];
            for _ in 0..n {
                got[s.verify(&logits, draft) as usize] += 1.0 / n as f64;
            }
            for t in 0..5 {
                assert!((got[t] - want[t]).abs() < 0.005, "draft {draft}: {got:?} vs {want:?}");
            }
        }
        // Greedy keeps the draft exactly when it is the argmax.
        let mut g = Sampler::new(SamplerConfig {
            temperature: 0.0,
            ..cfg
        });
        assert_eq!(g.verify(&logits, 4), 4);
        assert_eq!(g.verify(&logits, 1), 4);
    }

    /// Drawing from a row's most likely tokens (as a device lists them, `Want::Top`) gives the
    /// tokens drawing from the row does, seed for seed, drafts verified too — with exactly the
    /// sampler's k, with more (the server asks for the largest k of a step), and with fewer
    /// when the vocabulary is smaller than k.
    #[test]
    fn drawing_from_the_top_k_is_drawing_from_the_logits() {
        let mut state = 0x1234_5678_9ABC_DEF1u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for (vocab, top_k, listed, top_p) in [
            (1000usize, 40usize, 40usize, 0.95f32),
            (1000, 40, 100, 0.9),
            (1000, 1, 7, 1.0),
            (30, 40, 30, 0.95),
            (5000, 1024, 1024, 1.0),
        ] {
            let cfg = SamplerConfig {
                temperature: 0.7,
                top_k,
                top_p,
                seed: vocab as u64 + top_k as u64,
            };
            let (mut a, mut b) = (Sampler::new(cfg.clone()), Sampler::new(cfg));
            assert_eq!(a.device_top_k(), Some(top_k));
            for step in 0..300 {
                // Few distinct values, so ties decide which tokens are listed.
                let logits: Vec<f32> = (0..vocab).map(|_| (next() % 50) as f32 * 0.1).collect();
                let top = most_likely(&logits, listed);
                let draft = (next() % vocab as u64) as u32;
                let (x, y) = if step % 2 == 0 {
                    (a.sample(&logits), b.sample_top(&top))
                } else {
                    (a.verify(&logits, draft), b.verify_top(&top, draft))
                };
                assert_eq!(x, y, "vocab {vocab}, top-k {top_k}, {listed} listed, step {step}");
            }
        }
        let no_k = |temperature, top_k| {
            Sampler::new(SamplerConfig {
                temperature,
                top_k,
                ..SamplerConfig::default()
            })
            .device_top_k()
        };
        assert_eq!(no_k(0.0, 40), None, "greedy");
        assert_eq!(no_k(0.8, 0), None, "every token a candidate");
        assert_eq!(
            no_k(0.8, crate::backend::TOP_K_MAX + 1),
            None,
            "more than a device sorts"
        );
    }

    #[test]
    fn top_log_softmax_is_the_most_likely_tokens_in_order() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.0];
        let top = top_log_softmax(&logits, 3);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 4]);
        for &(t, lp) in &top {
            assert!((lp - log_softmax_at(&logits, t)).abs() < 1e-6);
        }
        assert_eq!(top_log_softmax(&logits, 9).len(), 5);
        assert!(top_log_softmax(&logits, 0).is_empty());
    }

    #[test]
    fn greedy_takes_first_maximum() {
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_repeat() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 17) as f32 * 0.3).collect();
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 5,
        });
        assert_eq!(s.sample(&logits), argmax(&logits));
        // Logits -i at temperature 1: p0 = 0.63, p1 = 0.23, p2 = 0.09 (cumulative 0.95), so
        // top-p 0.9 keeps exactly tokens 0, 1 and 2.
        let logits: Vec<f32> = (0..100).map(|i| -(i as f32)).collect();
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            seed: 42,
        };
        let draw = |cfg: SamplerConfig| -> Vec<u32> {
            let mut s = Sampler::new(cfg);
            (0..300).map(|_| s.sample(&logits)).collect()
        };
        let a = draw(cfg.clone());
        assert_eq!(a, draw(cfg.clone()), "same seed, same draws");
        assert!(a.iter().all(|&t| t < 3), "{a:?}");
        assert!((0..3).all(|t| a.contains(&t)), "all three nucleus tokens appear");
        assert_ne!(
            a,
            draw(SamplerConfig {
                seed: 43,
                ..cfg.clone()
            }),
            "another seed, other draws"
        );
        // The exposed distribution is the nucleus, normalized, and the draws follow it.
        let d = Sampler::new(cfg).distribution(&logits);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 1, 2]);
        assert!((d.iter().map(|x| x.1).sum::<f32>() - 1.0).abs() < 1e-6);
        let share0 = a.iter().filter(|&&t| t == 0).count() as f32 / a.len() as f32;
        assert!(
            (share0 - d[0].1).abs() < 0.1,
            "token 0 drawn {share0}, probability {}",
            d[0].1
        );
    }

    #[test]
    fn log_softmax_matches_the_definition() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((log_softmax_at(&logits, 2) as f64 - (3.0 - z.ln())).abs() < 1e-6);
        let greedy = Sampler::new(SamplerConfig::default());
        assert_eq!(greedy.distribution(&logits), [(2, 1.0)]);
    }
}
