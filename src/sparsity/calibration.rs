//! Per-layer thresholds for the `Threshold` strategy, for every criterion: the tail of a text
//! runs through the dense model while a recording hook pools each layer's neuron scores; the
//! threshold for sparsity s is the s-quantile of the pooled scores (keeping neurons at or above
//! it drops a share s on average). The tail is used so calibration and evaluation windows (taken
//! from the start) do not overlap.

use std::sync::Mutex;

use super::{scores, Criterion, UpSketches, CANDIDATE_FACTOR};
use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::forward::{FfnMask, Passes};
use crate::model::Model;

/// Tokens per layer whose scores are pooled (here and by `calibrate`, which stores thresholds
/// for `run`: both must pool and take quantiles alike for `run` to use what `eval` evaluated).
pub const POOLED_TOKENS_MAX: usize = 128;

/// The `share`-quantile of ascending `sorted` scores: keeping scores at or above it drops about
/// `share` of them (0 for an empty pool).
pub fn quantile(sorted: &[f32], share: f32) -> f32 {
    let at = ((sorted.len() as f32 * share) as usize).min(sorted.len().saturating_sub(1));
    sorted.get(at).copied().unwrap_or(0.0)
}
const WINDOW: usize = 512;

/// The last `tokens` tokens of a text: calibration reads the end of a file because evaluation
/// reads its start.
pub struct TextTail {
    pub ids: Vec<u32>,
    /// Index of the first kept token in the whole text, and the text's length in tokens.
    pub start: usize,
    pub total: usize,
    /// "NAME: last N tokens (tokens a..b of total)".
    pub description: String,
}

pub fn text_tail(model: &Model, text: &str, text_name: &str, tokens: usize) -> Result<TextTail> {
    let mut all = model.tokenizer.encode(text, false)?;
    if tokens < 2 || all.len() < tokens {
        return Err(Error::Input(format!(
            "calibration text {text_name} has {} tokens; asked for the last {tokens} (at least 2)",
            all.len()
        )));
    }
    let (total, start) = (all.len(), all.len() - tokens);
    let ids = all.split_off(start);
    let description = format!("{text_name}: last {tokens} tokens (tokens {start}..{total} of {total})");
    Ok(TextTail {
        ids,
        start,
        total,
        description,
    })
}

/// Sorted pooled scores per criterion and layer.
pub struct ScorePools {
    /// (criterion, per-layer sorted scores)
    pools: Vec<(Criterion, Vec<Vec<f32>>)>,
    pub tokens: usize,
    pub text: String,
}

struct Recorder<'a> {
    criteria: Vec<Criterion>,
    sketches: Option<&'a UpSketches>,
    every: usize,
    hidden: usize,
    ffn: usize,
    state: Mutex<(usize, Vec<Vec<Vec<f32>>>)>, // (tokens seen in batch offset, [criterion][layer] pool)
}

impl FfnMask for Recorder<'_> {
    fn apply(&self, layer: usize, xn: &[f32], gate: &[f32], _up: &[f32], hact: &mut [f32]) {
        let (f, h) = (self.ffn, self.hidden);
        let mut st = self.state.lock().expect("recorder lock");
        let base = st.0;
        let mut scratch = Vec::new();
        for t in 0..hact.len() / f {
            if !(base + t).is_multiple_of(self.every) {
                continue;
            }
            for (c, crit) in self.criteria.iter().enumerate() {
                scores(
                    *crit,
                    self.sketches,
                    layer,
                    &xn[t * h..(t + 1) * h],
                    &gate[t * f..(t + 1) * f],
                    &hact[t * f..(t + 1) * f],
                    &mut scratch,
                );
                st.1[c][layer].extend_from_slice(&scratch);
            }
        }
    }
}

impl ScorePools {
    /// Run the last `tokens` tokens of `text` and pool scores for `criteria` (base criteria).
    pub fn collect(
        model: &Model,
        passes: Passes,
        text: &str,
        text_name: &str,
        tokens: usize,
        criteria: &[Criterion],
        sketches: Option<&UpSketches>,
    ) -> Result<ScorePools> {
        let tail = text_tail(model, text, text_name, tokens)?;
        let mut bases: Vec<Criterion> = criteria.iter().map(|c| c.base()).collect();
        if criteria.contains(&Criterion::Candidates) {
            bases.push(Criterion::Gate);
        }
        bases.sort_by_key(|c| *c as u8);
        bases.dedup();
        let n_layers = model.config.n_layers;
        let rec = Recorder {
            criteria: bases.clone(),
            sketches,
            every: tokens.div_ceil(POOLED_TOKENS_MAX).max(1),
            hidden: model.config.hidden,
            ffn: model.config.ffn,
            state: Mutex::new((0, vec![vec![Vec::new(); n_layers]; bases.len()])),
        };
        let bos = if model.tokenizer.adds_bos() {
            model.tokenizer.bos_id()
        } else {
            None
        };
        let mut cache = KvCache::new(&model.config, WINDOW + 1);
        for chunk in tail.ids.chunks(WINDOW) {
            let mut batch: Vec<u32> = bos.into_iter().collect();
            batch.extend_from_slice(chunk);
            cache.clear();
            let hooks = passes.hooks(Some(&rec), None);
            model.forward_in_batches(&batch, &mut cache, batch.len() - 1, &hooks, passes.batch_max())?;
            rec.state.lock().expect("recorder lock").0 += batch.len();
        }
        let (_, pools) = rec.state.into_inner().expect("recorder lock");
        let pools = bases
            .into_iter()
            .zip(pools)
            .map(|(c, layers)| {
                let sorted = layers
                    .into_iter()
                    .map(|mut p| {
                        p.sort_unstable_by(|a, b| a.total_cmp(b));
                        p
                    })
                    .collect();
                (c, sorted)
            })
            .collect();
        Ok(ScorePools {
            pools,
            tokens,
            text: tail.description,
        })
    }

    fn quantiles(&self, criterion: Criterion, share: f32) -> Vec<f32> {
        let (_, layers) = self
            .pools
            .iter()
            .find(|(c, _)| *c == criterion)
            .expect("criterion was pooled");
        layers.iter().map(|p| quantile(p, share)).collect()
    }

    /// Per-layer thresholds for `criterion` at `sparsity` (and, for candidates, the gate
    /// threshold that admits `CANDIDATE_FACTOR ×` the kept share).
    pub fn thresholds(&self, criterion: Criterion, sparsity: f32) -> (Vec<f32>, Option<Vec<f32>>) {
        let t = self.quantiles(criterion.base(), sparsity);
        let g = (criterion == Criterion::Candidates).then(|| {
            let candidate_share = ((1.0 - sparsity) * CANDIDATE_FACTOR).min(1.0);
            self.quantiles(Criterion::Gate, 1.0 - candidate_share)
        });
        (t, g)
    }
}
