//! Per-layer budgets: layers differ in how much they tolerate sparsity, so the same total of
//! dropped neurons costs less when it is spread by sensitivity rather than uniformly. The
//! sensitivity of layer l at level s is the mean KL(dense ‖ sparse) over calibration positions
//! when only layer l is top-K sparse at s; a greedy allocation then raises, step by step, the
//! layer whose next step costs the least KL per neuron saved, until the mean reaches the target.
//! Every layer has the same FFN size, so equal mean sparsity means equal FFN bytes.
//!
//! Single-layer KL does not add up across layers (a layer's loss changes what the layers after
//! it see), so the greedy allocation can lose to uniform. [`Sensitivity::allocate_checked`]
//! therefore blends uniform and greedy levels (uniform + α·(greedy − uniform), α in
//! [`BLENDS`]) and keeps the blend with the least KL with *all* layers sparse on the same
//! calibration tokens: never worse than uniform there, and never measured on evaluation text.

use super::{Criterion, Masker, Strategy, UpSketches};
use crate::backend::ops::log_sum_exp;
use crate::error::Result;
use crate::kv::KvCache;
use crate::model::forward::Passes;
use crate::model::Model;

/// Levels at which sensitivity is measured; allocation interpolates between them.
pub const MEASURED_LEVELS: [f32; 4] = [0.3, 0.5, 0.7, 0.9];
/// Allocation step per layer.
pub const STEP: f32 = 0.1;
/// No layer goes beyond this.
pub const LEVEL_MAX: f32 = 0.9;

/// Blends of greedy into uniform tried by [`Sensitivity::allocate_checked`] (0 = uniform).
pub const BLENDS: [f32; 5] = [0.0, 0.25, 0.5, 0.75, 1.0];

/// `[layer][MEASURED_LEVELS]` mean KL when only that layer is sparse.
pub struct Sensitivity {
    pub kl: Vec<Vec<f64>>,
    pub tokens: usize,
    pub criterion: Criterion,
    /// The calibration batch and the dense model's logits on it, for checking allocations.
    batch: Vec<u32>,
    dense: Vec<f32>,
}

/// A per-layer allocation and how it was chosen.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Allocation {
    pub levels: Vec<f32>,
    /// The blend of greedy into uniform that was kept.
    pub blend: f32,
    /// Mean KL on the calibration tokens with every layer sparse: uniform, and the kept blend.
    pub calibration_kl_uniform: f64,
    pub calibration_kl: f64,
}

fn kl_rows(dense: &[f32], sparse: &[f32], vocab: usize) -> f64 {
    let mut total = 0.0;
    let rows = dense.len() / vocab;
    for (d, s) in dense.chunks(vocab).zip(sparse.chunks(vocab)) {
        let (ld, ls) = (log_sum_exp(d), log_sum_exp(s));
        total += d
            .iter()
            .zip(s)
            .map(|(&a, &b)| ((a as f64 - ld).exp()) * ((a as f64 - ld) - (b as f64 - ls)))
            .sum::<f64>();
    }
    total / rows.max(1) as f64
}

impl Sensitivity {
    /// Measure on the last `tokens` tokens of `text` (one window; at most the model's context).
    pub fn measure(
        model: &Model,
        passes: Passes,
        text: &str,
        tokens: usize,
        criterion: Criterion,
        sketches: Option<&UpSketches>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Sensitivity> {
        let tail = super::calibration::text_tail(model, text, "calibration text", tokens)?;
        let mut batch: Vec<u32> = model
            .tokenizer
            .bos_id()
            .filter(|_| model.tokenizer.adds_bos())
            .into_iter()
            .collect();
        batch.extend_from_slice(&tail.ids);
        let vocab = model.config.vocab;
        let mut cache = KvCache::new(&model.config, batch.len());
        let dense = model.forward_in_batches(&batch, &mut cache, 0, &passes.hooks(None, None), passes.batch_max())?;
        let n_layers = model.config.n_layers;
        let mut kl = vec![vec![0.0; MEASURED_LEVELS.len()]; n_layers];
        for (l, row) in kl.iter_mut().enumerate() {
            for (i, &s) in MEASURED_LEVELS.iter().enumerate() {
                let mut per_layer = vec![0.0; n_layers];
                per_layer[l] = s;
                let m = Masker::new(model, Strategy::TopK, criterion, s, sketches, None).with_per_layer(per_layer);
                cache.clear();
                let hooks = passes.hooks(Some(&m), None);
                let sparse = model.forward_in_batches(&batch, &mut cache, 0, &hooks, passes.batch_max())?;
                row[i] = kl_rows(&dense, &sparse, vocab);
            }
            progress(l + 1, n_layers);
        }
        Ok(Sensitivity {
            kl,
            tokens,
            criterion,
            batch,
            dense,
        })
    }

    /// Mean KL from dense on the calibration tokens with every layer top-K sparse at `levels`.
    fn kl_with(&self, model: &Model, passes: Passes, levels: &[f32], sketches: Option<&UpSketches>) -> Result<f64> {
        let mean = levels.iter().sum::<f32>() / levels.len().max(1) as f32;
        let m =
            Masker::new(model, Strategy::TopK, self.criterion, mean, sketches, None).with_per_layer(levels.to_vec());
        let mut cache = KvCache::new(&model.config, self.batch.len());
        let hooks = passes.hooks(Some(&m), None);
        let sparse = model.forward_in_batches(&self.batch, &mut cache, 0, &hooks, passes.batch_max())?;
        Ok(kl_rows(&self.dense, &sparse, model.config.vocab))
    }

    /// The greedy allocation at mean `target`, blended into uniform by whichever of [`BLENDS`]
    /// loses least on the calibration tokens with all layers sparse (see the module doc).
    pub fn allocate_checked(
        &self,
        model: &Model,
        passes: Passes,
        target: f32,
        sketches: Option<&UpSketches>,
    ) -> Result<Allocation> {
        let greedy = self.allocate(target);
        let n = greedy.len() as f32;
        let mean = greedy.iter().sum::<f32>() / n;
        let mut best: Option<Allocation> = None;
        let mut kl_uniform = 0.0;
        for &a in &BLENDS {
            // Blend around the greedy mean so every blend has the same mean (the same bytes).
            let levels: Vec<f32> = greedy.iter().map(|&g| mean + a * (g - mean)).collect();
            let kl = self.kl_with(model, passes, &levels, sketches)?;
            if a == 0.0 {
                kl_uniform = kl;
            }
            if best.as_ref().is_none_or(|b| kl < b.calibration_kl) {
                best = Some(Allocation {
                    levels,
                    blend: a,
                    calibration_kl_uniform: 0.0,
                    calibration_kl: kl,
                });
            }
        }
        let mut best = best.expect("BLENDS is not empty");
        best.calibration_kl_uniform = kl_uniform;
        Ok(best)
    }

    /// KL of layer `l` at level `s`, linear between measured levels and from 0 at s = 0.
    pub fn at(&self, l: usize, s: f32) -> f64 {
        let row = &self.kl[l];
        let mut prev = (0.0f32, 0.0f64);
        for (&level, &k) in MEASURED_LEVELS.iter().zip(row) {
            if s <= level + 1e-6 {
                let t = ((s - prev.0) / (level - prev.0)) as f64;
                return prev.1 + t * (k - prev.1);
            }
            prev = (level, k);
        }
        prev.1
    }

    /// Per-layer sparsities with mean `target`, chosen greedily by least KL per step.
    pub fn allocate(&self, target: f32) -> Vec<f32> {
        let n = self.kl.len();
        let mut levels = vec![0.0f32; n];
        let steps = ((target * n as f32) / STEP).round() as usize;
        for _ in 0..steps {
            let best = (0..n)
                .filter(|&l| levels[l] + STEP <= LEVEL_MAX + 1e-6)
                .min_by(|&a, &b| {
                    let cost = |l: usize| self.at(l, levels[l] + STEP) - self.at(l, levels[l]);
                    cost(a).total_cmp(&cost(b)).then(a.cmp(&b))
                });
            match best {
                Some(l) => levels[l] += STEP,
                None => break,
            }
        }
        levels
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_puts_sparsity_where_it_costs_least_and_keeps_the_mean() {
        // Layer 0 is ten times as sensitive as layer 1.
        let s = Sensitivity {
            kl: vec![vec![1.0, 2.0, 4.0, 8.0], vec![0.1, 0.2, 0.4, 0.8]],
            tokens: 0,
            criterion: Criterion::Exact,
            batch: Vec::new(),
            dense: Vec::new(),
        };
        let a = s.allocate(0.5);
        assert!((a.iter().sum::<f32>() / 2.0 - 0.5).abs() < 1e-5, "{a:?}");
        assert!(a[1] > a[0], "{a:?}");
        assert!(a.iter().all(|&x| x <= LEVEL_MAX + 1e-6));
        assert!((s.at(0, 0.4) - 1.5).abs() < 1e-9);
        assert!((s.at(1, 0.15) - 0.05).abs() < 1e-9);
    }
}
