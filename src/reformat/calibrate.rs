//! Activation statistics from running calibration text through the dense model: per layer, how
//! often each FFN neuron is among the active half of a token's neurons, and the thresholds on
//! the neuron score that give 1%…99% sparsity. The score is |act(gate)·up| (the exact
//! contribution weight of the neuron); a neuron is "active" for a token when its score is at or
//! above that token's median score in the layer.
//!
//! Calibration text is taken from the END of the given file (the last N tokens), because
//! perplexity and evaluation use its beginning: the two never overlap for files longer than
//! their sum, and the report says which tokens were used.

use std::sync::Mutex;

use crate::error::Result;
use crate::kv::KvCache;
use crate::model::batch::Logits;
use crate::model::forward::FfnHooks;
use crate::model::Model;
use crate::sparsity::calibration::{quantile, text_tail, POOLED_TOKENS_MAX};

/// Window length for calibration forward passes.
const CALIBRATION_CTX: usize = 512;

pub struct CalibrationStats {
    pub tokens: usize,
    /// Human-readable description of the text used.
    pub text: String,
    /// `[layer][neuron]`: share of tokens for which the neuron was active, in the model's order.
    pub frequencies: Vec<Vec<f32>>,
    /// `[layer]`: (target sparsity, score threshold) for 0.01 ... 0.99, so any level `eval` reports
    /// (two decimals) runs with the thresholds it was evaluated with.
    pub thresholds: Vec<Vec<(f32, f32)>>,
}

struct Accum {
    active_counts: Vec<Vec<u32>>,
    pooled: Vec<Vec<f32>>,
    tokens_seen: usize,
    pool_every: usize,
    scratch: Vec<f32>,
}

/// Run the last `tokens` tokens of `text` through `model`; `progress(done, total)` per window.
pub fn calibrate(
    model: &Model,
    text: &str,
    text_name: &str,
    tokens: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CalibrationStats> {
    let tail = text_tail(model, text, text_name, tokens)?;
    let ids = &tail.ids;
    let (n_layers, ffn) = (model.config.n_layers, model.config.ffn);
    let acc = Mutex::new(Accum {
        active_counts: vec![vec![0; ffn]; n_layers],
        pooled: vec![Vec::new(); n_layers],
        tokens_seen: 0,
        pool_every: tokens.div_ceil(POOLED_TOKENS_MAX).max(1),
        scratch: Vec::with_capacity(ffn),
    });
    let bos = if model.tokenizer.adds_bos() {
        model.tokenizer.bos_id()
    } else {
        None
    };
    let windows: Vec<&[u32]> = ids.chunks(CALIBRATION_CTX).collect();
    let mut cache = KvCache::new(&model.config, CALIBRATION_CTX + 1);
    for (w, chunk) in windows.iter().enumerate() {
        let mut batch: Vec<u32> = Vec::with_capacity(chunk.len() + 1);
        batch.extend(bos);
        batch.extend_from_slice(chunk);
        let skip = batch.len() - chunk.len();
        let observe = |layer: usize, _gate: &[f32], hact: &[f32]| {
            let mut a = acc.lock().expect("calibration statistics lock");
            let a = &mut *a;
            for (t, row) in hact.chunks(ffn).enumerate().skip(skip) {
                a.scratch.clear();
                a.scratch.extend(row.iter().map(|v| v.abs()));
                let mid = ffn / 2;
                let median = *a.scratch.select_nth_unstable_by(mid, |x, y| x.total_cmp(y)).1;
                for (c, v) in a.active_counts[layer].iter_mut().zip(row) {
                    *c += (v.abs() >= median) as u32;
                }
                let token_index = a.tokens_seen + t - skip;
                if token_index.is_multiple_of(a.pool_every) {
                    let s = std::mem::take(&mut a.scratch);
                    a.pooled[layer].extend_from_slice(&s);
                    a.scratch = s;
                }
            }
        };
        let hooks = FfnHooks {
            observe: Some(&observe),
            mask: None,
            stream: None,
            cancel: None,
        };
        cache.clear();
        model.forward_with(&batch, &mut cache, Logits::Last, &hooks)?;
        acc.lock().expect("calibration statistics lock").tokens_seen += chunk.len();
        progress(w + 1, windows.len());
    }
    let acc = acc.into_inner().expect("calibration statistics lock");
    let frequencies = acc
        .active_counts
        .iter()
        .map(|counts| counts.iter().map(|&c| c as f32 / tokens as f32).collect())
        .collect();
    let thresholds = acc
        .pooled
        .into_iter()
        .map(|mut pool| {
            pool.sort_unstable_by(|a, b| a.total_cmp(b));
            (1..=99)
                .map(|i| {
                    let s = i as f32 / 100.0;
                    (s, quantile(&pool, s))
                })
                .collect()
        })
        .collect();
    Ok(CalibrationStats {
        tokens,
        text: tail.description,
        frequencies,
        thresholds,
    })
}

/// Neuron order, most frequently active first (ties keep the original order).
pub fn hot_first_order(frequencies: &[f32]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..frequencies.len() as u32).collect();
    order.sort_by(|&a, &b| {
        frequencies[b as usize]
            .total_cmp(&frequencies[a as usize])
            .then(a.cmp(&b))
    });
    order
}

/// Share of all activations covered by the first `fraction` of neurons in the given order.
pub fn prefix_coverage(frequencies_in_order: &[f32], fraction: f32) -> f32 {
    let total: f32 = frequencies_in_order.iter().sum();
    let n = ((frequencies_in_order.len() as f32) * fraction).round() as usize;
    if total == 0.0 {
        return 0.0;
    }
    frequencies_in_order[..n.min(frequencies_in_order.len())]
        .iter()
        .sum::<f32>()
        / total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_first_sorts_by_frequency_and_keeps_ties_stable() {
        let f = [0.1, 0.9, 0.5, 0.9, 0.0];
        assert_eq!(hot_first_order(&f), vec![1, 3, 2, 0, 4]);
        let ordered: Vec<f32> = hot_first_order(&f).iter().map(|&i| f[i as usize]).collect();
        assert!((prefix_coverage(&ordered, 0.4) - 1.8 / 2.4).abs() < 1e-6);
        assert_eq!(prefix_coverage(&[0.0, 0.0], 0.5), 0.0);
    }
}
