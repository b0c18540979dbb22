//! Masks: which FFN neurons a token uses. A mask is a strategy (per-token top-K, a per-layer
//! calibrated threshold, or the sequence-level union of the context's choices) applied to a
//! criterion (how a neuron is scored: |act(gate)| alone; the exact |act(gate)·up|; gate-chosen
//! candidates then exact among them; or |act(gate)·û| with û from a 2-bit sketch of up). It
//! runs as an [`FfnMask`] hook after phase 1 and zeroes the dropped neurons' activations, so the
//! same code measures quality in RAM now and selects the neurons to read when streaming.
//! Knows scores and neurons, never files or bytes on disk.

pub mod budget;
pub mod calibration;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::model::forward::FfnMask;
use crate::model::Model;
use crate::quant::sketch::{sketch_dots, sketch_row, sketch_row_bytes};
use crate::tensor::Weight;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Each token keeps its own top (1 − s) share of neurons.
    TopK,
    /// Each token keeps the neurons whose score reaches the layer's calibrated threshold.
    Threshold,
    /// The context's tokens run dense; the neurons most often in their top-K are kept, for every
    /// later token (CoreInfer-style sequence-level sparsity).
    Union,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Criterion {
    /// |act(gate·x)|: needs only the gate (the seed design).
    Gate,
    /// |act(gate·x) · up·x|: needs up for every neuron.
    Exact,
    /// The gate picks `CANDIDATE_FACTOR ×` as many neurons as will be kept, then exact among them:
    /// up is needed for the candidates only.
    Candidates,
    /// |act(gate·x) · û·x| with û a resident 2-bit sketch of up.
    Sketch,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::TopK => "topk",
            Strategy::Threshold => "threshold",
            Strategy::Union => "union",
        }
    }
    pub fn from_name(s: &str) -> Option<Strategy> {
        [Strategy::TopK, Strategy::Threshold, Strategy::Union]
            .into_iter()
            .find(|x| x.name() == s)
    }
}

impl Criterion {
    pub fn name(self) -> &'static str {
        match self {
            Criterion::Gate => "gate",
            Criterion::Exact => "exact",
            Criterion::Candidates => "candidates",
            Criterion::Sketch => "sketch",
        }
    }
    pub fn from_name(s: &str) -> Option<Criterion> {
        [
            Criterion::Gate,
            Criterion::Exact,
            Criterion::Candidates,
            Criterion::Sketch,
        ]
        .into_iter()
        .find(|x| x.name() == s)
    }
}

/// Candidates per kept neuron for `Criterion::Candidates` (50% kept → gate's top 70%).
pub const CANDIDATE_FACTOR: f32 = 1.4;

impl Criterion {
    /// The base score used by thresholds (candidates are chosen by gate, ranked by exact).
    pub fn base(self) -> Criterion {
        match self {
            Criterion::Candidates => Criterion::Exact,
            c => c,
        }
    }
}

/// 2-bit sketches of every layer's up rows, built from the model's weights.
pub struct UpSketches {
    row_bytes: usize,
    layers: Vec<Vec<u8>>,
}

impl UpSketches {
    /// From the model's own up matrices (a model whose matrices are in memory or mapped).
    pub fn build(model: &Model) -> Option<UpSketches> {
        UpSketches::build_with(model, &|w| Ok(w.clone())).ok().flatten()
    }

    /// From up matrices handed over by `read` (a stream reads them from disk for a model
    /// opened with its matrices there), one layer at a time per thread; `None` when the
    /// hidden size has no sketch layout.
    pub fn build_with(
        model: &Model,
        read: &(dyn Fn(&Weight) -> crate::error::Result<Weight> + Sync),
    ) -> crate::error::Result<Option<UpSketches>> {
        let (ffn, hidden) = (model.config.ffn, model.config.hidden);
        let Some(row_bytes) = sketch_row_bytes(hidden) else {
            return Ok(None);
        };
        let layers = model
            .weights
            .layers
            .par_iter()
            .map(|l| {
                let up = read(&l.dense("up sketches")?.up)?;
                let mut out = vec![0u8; ffn * row_bytes];
                let mut f = vec![0f32; hidden];
                for (n, o) in out.chunks_exact_mut(row_bytes).enumerate() {
                    up.dequantize_row(n, &mut f);
                    sketch_row(&f, o);
                }
                Ok(out)
            })
            .collect::<crate::error::Result<Vec<_>>>()?;
        Ok(Some(UpSketches { row_bytes, layers }))
    }

    /// û·x for every neuron of `layer`.
    fn estimates(&self, layer: usize, x: &[f32], out: &mut [f32]) {
        sketch_dots(&self.layers[layer][..out.len() * self.row_bytes], x, out);
    }
}

/// Scores of one token's neurons under a base criterion.
pub fn scores(
    criterion: Criterion,
    sketches: Option<&UpSketches>,
    layer: usize,
    xn: &[f32],
    gate: &[f32],
    hact: &[f32],
    out: &mut Vec<f32>,
) {
    out.clear();
    match criterion.base() {
        Criterion::Gate => out.extend(gate.iter().map(|g| g.abs())),
        Criterion::Exact | Criterion::Candidates => out.extend(hact.iter().map(|h| h.abs())),
        Criterion::Sketch => {
            out.resize(gate.len(), 0.0);
            sketches
                .expect("sketch criterion without sketches")
                .estimates(layer, xn, out);
            out.iter_mut().zip(gate).for_each(|(u, g)| *u = (*u * g).abs());
        }
    }
}

/// Indices of the `k` largest values (ties broken by lower index), as a keep mask.
fn top_k_mask(values: &[f32], k: usize, keep: &mut [bool]) {
    keep.fill(false);
    if k >= values.len() {
        keep.fill(true);
        return;
    }
    if k == 0 {
        return;
    }
    let mut idx: Vec<u32> = (0..values.len() as u32).collect();
    idx.select_nth_unstable_by(k - 1, |&a, &b| {
        values[b as usize].total_cmp(&values[a as usize]).then(a.cmp(&b))
    });
    for &i in &idx[..k] {
        keep[i as usize] = true;
    }
}

/// A mask configuration with what it needs: per-layer thresholds, sketches, union state, and
/// counters of what was kept.
/// Whether the neurons whose up rows a mask needs depend on the layer's input: not for the
/// exact criterion (up is read for every neuron) nor for a union set (fixed once the context has
/// voted).
pub fn up_set_reads_input(strategy: Strategy, criterion: Criterion) -> bool {
    strategy != Strategy::Union && criterion != Criterion::Exact
}

/// A mask's per-layer counters: kept and total neuron slots, up rows needed.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MaskCounters {
    pub kept: Vec<u64>,
    pub total: Vec<u64>,
    pub up_rows: Vec<u64>,
}

pub struct Masker<'a> {
    pub strategy: Strategy,
    pub criterion: Criterion,
    pub sparsity: f32,
    /// Per-layer sparsity for `TopK` (a budget allocated across layers); `sparsity` is then
    /// their mean.
    pub per_layer: Option<Vec<f32>>,
    ffn: usize,
    hidden: usize,
    sketches: Option<&'a UpSketches>,
    /// Per layer, for `Threshold`: minimum base score to keep.
    thresholds: Option<Vec<f32>>,
    /// Per layer, for `Candidates` with `Threshold`: minimum gate score to be a candidate.
    gate_thresholds: Option<Vec<f32>>,
    /// For `Union`: tokens of each batch that run dense and build the set.
    union_context: Mutex<usize>,
    /// For `Union`: each layer's kept set from the last context, reused by batches without one
    /// (decode steps after the prompt).
    union_sets: Mutex<Vec<Option<Vec<bool>>>>,
    /// For `Union` in generation: each layer's votes over the context so far, so a prompt
    /// prefilled in several batches votes as one (cleared when a new context starts).
    union_votes: Mutex<Vec<Vec<u32>>>,
    kept: Vec<AtomicU64>,
    total: Vec<AtomicU64>,
    up_rows: Vec<AtomicU64>,
    /// A seed for tiny per-neuron changes of every score ([`Masker::jittered`]).
    pub jitter: Option<u64>,
    /// Mixture-of-experts models: experts per token for the passes this mask runs (`None`: the
    /// model's own count); see [`FfnMask::experts_used`].
    pub experts_used: Option<usize>,
}

/// Relative size of a jittered score's change: about float rounding, far below any real
/// difference between neurons.
pub const JITTER_REL: f32 = 1e-6;

impl<'a> Masker<'a> {
    /// The same mask with every score multiplied by `1 + JITTER_REL·u`, `u` in [-1, 1) fixed
    /// per (seed, layer, neuron): what a rounding-level change of the scores (another kernel,
    /// another summation order) does to the results. Evaluating a few seeds shows how much of
    /// a difference between configurations is noise.
    pub fn jittered(&self, seed: u64) -> Masker<'a> {
        let n = self.kept.len();
        Masker {
            strategy: self.strategy,
            criterion: self.criterion,
            sparsity: self.sparsity,
            per_layer: self.per_layer.clone(),
            ffn: self.ffn,
            hidden: self.hidden,
            sketches: self.sketches,
            thresholds: self.thresholds.clone(),
            gate_thresholds: self.gate_thresholds.clone(),
            union_context: Mutex::new(0),
            union_sets: Mutex::new(vec![None; n]),
            union_votes: Mutex::new(vec![Vec::new(); n]),
            kept: (0..n).map(|_| AtomicU64::new(0)).collect(),
            total: (0..n).map(|_| AtomicU64::new(0)).collect(),
            up_rows: (0..n).map(|_| AtomicU64::new(0)).collect(),
            jitter: Some(seed),
            experts_used: self.experts_used,
        }
    }

    fn jitter_scores(&self, layer: usize, scores: &mut [f32]) {
        let Some(seed) = self.jitter else {
            return;
        };
        for (i, s) in scores.iter_mut().enumerate() {
            // splitmix64 of (seed, layer, neuron): a fixed pseudo-random u in [-1, 1).
            let mut z = seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(((layer as u64) << 32) | i as u64);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            *s *= 1.0 + JITTER_REL * u;
        }
    }

    pub fn new(
        model: &Model,
        strategy: Strategy,
        criterion: Criterion,
        sparsity: f32,
        sketches: Option<&'a UpSketches>,
        thresholds: Option<(Vec<f32>, Option<Vec<f32>>)>,
    ) -> Masker<'a> {
        let n = model.config.n_layers;
        let (thresholds, gate_thresholds) = match thresholds {
            Some((t, g)) => (Some(t), g),
            None => (None, None),
        };
        Masker {
            strategy,
            criterion,
            sparsity,
            per_layer: None,
            ffn: model.config.ffn,
            hidden: model.config.hidden,
            sketches,
            thresholds,
            gate_thresholds,
            union_context: Mutex::new(0),
            union_sets: Mutex::new(vec![None; n]),
            union_votes: Mutex::new(vec![Vec::new(); n]),
            kept: (0..n).map(|_| AtomicU64::new(0)).collect(),
            total: (0..n).map(|_| AtomicU64::new(0)).collect(),
            up_rows: (0..n).map(|_| AtomicU64::new(0)).collect(),
            jitter: None,
            experts_used: None,
        }
    }

    /// A masker for generation: `Threshold` takes its per-layer thresholds from the `.gst` file's
    /// stored calibration (exact criterion, levels 0.01…0.99), the others need nothing stored.
    pub fn for_model(
        model: &Model,
        strategy: Strategy,
        criterion: Criterion,
        sparsity: f32,
        sketches: Option<&'a UpSketches>,
    ) -> crate::error::Result<Masker<'a>> {
        use crate::error::Error;
        if !(0.0..1.0).contains(&sparsity) {
            return Err(Error::Input(format!("--sparsity {sparsity} must be in [0, 1)")));
        }
        if model.config.moe.is_some() && !Masker::runs_inside_experts(strategy, criterion) {
            return Err(Error::Input(format!(
                "{}: a mixture-of-experts model takes top-K masks inside each routed expert (--strategy topk with \
                 --criterion gate, exact or candidates), not --strategy {} --criterion {}",
                model.path.display(),
                strategy.name(),
                criterion.name()
            )));
        }
        if criterion == Criterion::Sketch && sketches.is_none() {
            return Err(Error::Input("the sketch criterion needs sketches of up".into()));
        }
        let thresholds = if strategy == Strategy::Threshold {
            if criterion != Criterion::Exact {
                return Err(Error::Input(
                    "--strategy threshold uses the thresholds stored by `gatestream calibrate`, which are for --criterion exact"
                        .into(),
                ));
            }
            let not_calibrated = || {
                Error::Input(format!(
                    "{}: --strategy threshold needs a calibrated .gst file (gatestream reformat ... --calibrate TEXT, or gatestream calibrate)",
                    model.path.display()
                ))
            };
            let Some(index) = &model.gst_index else {
                return Err(not_calibrated());
            };
            let cal = index.calibration.as_ref().ok_or_else(not_calibrated)?;
            // Each layer's threshold at the stored level nearest to `sparsity`; a level more than
            // half a point away would run a different configuration than asked, so it is refused.
            let mut t = Vec::with_capacity(cal.layers.len());
            for (l, layer) in cal.layers.iter().enumerate() {
                let nearest = layer
                    .thresholds
                    .iter()
                    .min_by(|a, b| (a.0 - sparsity).abs().total_cmp(&(b.0 - sparsity).abs()))
                    .ok_or_else(not_calibrated)?;
                if (nearest.0 - sparsity).abs() > 0.005 {
                    return Err(Error::Input(format!(
                        "{}: layer {l} has calibrated thresholds for levels {}, none within 0.005 of --sparsity {sparsity}; \
                         recalibrate (`gatestream calibrate --model FILE --text TEXT` stores 0.01 … 0.99) or pass --sparsity {}",
                        model.path.display(),
                        layer.thresholds.iter().map(|x| format!("{}", x.0)).collect::<Vec<_>>().join(", "),
                        nearest.0
                    )));
                }
                t.push(nearest.1);
            }
            Some((t, None))
        } else {
            None
        };
        Ok(Masker::new(model, strategy, criterion, sparsity, sketches, thresholds))
    }

    /// For `Union`: the first `tokens` of each following batch are the context. A context that
    /// follows decode steps (the context was 0) is a new one, as with
    /// [`Masker::start_union_context`]; otherwise later batches of the same context vote on.
    pub fn set_union_context(&self, tokens: usize) {
        let was = std::mem::replace(&mut *self.union_context.lock().expect("union context lock"), tokens);
        if was == 0 && tokens > 0 {
            self.clear_union_votes();
        }
    }

    /// For `Union`: a new context of `tokens` tokens per batch, voting from nothing (a context
    /// fed in several batches votes as one across them).
    pub fn start_union_context(&self, tokens: usize) {
        *self.union_context.lock().expect("union context lock") = tokens;
        self.clear_union_votes();
    }

    fn clear_union_votes(&self) {
        self.union_votes
            .lock()
            .expect("union votes lock")
            .iter_mut()
            .for_each(Vec::clear);
    }

    /// For `Union`: how many of each following batch's first tokens are the context (0 after
    /// a prompt, so decode steps use the learned set).
    pub fn union_context(&self) -> usize {
        *self.union_context.lock().expect("union context lock")
    }

    /// Top-K with a different sparsity per layer (mean = the first element of the returned
    /// masker's `sparsity`).
    pub fn with_per_layer(mut self, per_layer: Vec<f32>) -> Self {
        self.sparsity = per_layer.iter().sum::<f32>() / per_layer.len().max(1) as f32;
        self.per_layer = Some(per_layer);
        self
    }

    /// The same mask routing each token to `k` experts (a mixture-of-experts model); with
    /// sparsity 0 it keeps every neuron and only the count of experts changes.
    pub fn with_experts_used(mut self, k: Option<usize>) -> Self {
        self.experts_used = k;
        self
    }

    /// Whether this mask can run inside each routed expert of a mixture-of-experts model: top-K
    /// on a per-token score (the others keep per-layer state over a dense layer's neurons).
    pub fn runs_inside_experts(strategy: Strategy, criterion: Criterion) -> bool {
        strategy == Strategy::TopK && criterion != Criterion::Sketch
    }

    /// Whether this mask keeps, by construction, exactly the neurons `other` keeps on every
    /// input, so that evaluating one gives the other's results. Under `Union` the candidates
    /// criterion votes with the exact score (its gate step is per token, and a union mask has
    /// no per-token step), so union candidates is union exact at the same level and seed.
    pub fn same_mask_as(&self, other: &Masker) -> bool {
        self.strategy == Strategy::Union
            && other.strategy == Strategy::Union
            && self.criterion.base() == other.criterion.base()
            && self.sparsity == other.sparsity
            && self.per_layer == other.per_layer
            && self.jitter == other.jitter
            && self.experts_used == other.experts_used
    }

    fn keep_count(&self, layer: usize) -> usize {
        let s = self.per_layer.as_ref().map_or(self.sparsity, |p| p[layer]);
        ((1.0 - s) * self.ffn as f32).round() as usize
    }

    /// Per layer: share of masked neuron slots dropped.
    pub fn achieved_sparsity(&self) -> Vec<f32> {
        self.kept
            .iter()
            .zip(&self.total)
            .map(|(k, t)| {
                let t = t.load(Ordering::Relaxed);
                if t == 0 {
                    0.0
                } else {
                    1.0 - k.load(Ordering::Relaxed) as f32 / t as f32
                }
            })
            .collect()
    }

    /// Per layer: mean up rows that must be read per masked token (all for `Exact`, the
    /// candidates for `Candidates`, the kept ones otherwise).
    pub fn up_rows_per_token(&self) -> Vec<f32> {
        let per_token = self
            .total
            .iter()
            .map(|t| t.load(Ordering::Relaxed) as f32 / self.ffn as f32);
        self.up_rows
            .iter()
            .zip(per_token)
            .map(|(u, n)| {
                if n == 0.0 {
                    0.0
                } else {
                    u.load(Ordering::Relaxed) as f32 / n
                }
            })
            .collect()
    }

    /// The counters behind `achieved_sparsity` and `up_rows_per_token`, to save.
    pub fn counters(&self) -> MaskCounters {
        let load = |v: &[AtomicU64]| v.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        MaskCounters {
            kept: load(&self.kept),
            total: load(&self.total),
            up_rows: load(&self.up_rows),
        }
    }

    /// Sets the counters to saved values (one entry per layer each).
    pub fn restore_counters(&self, c: &MaskCounters) -> crate::error::Result<()> {
        let n = self.kept.len();
        if c.kept.len() != n || c.total.len() != n || c.up_rows.len() != n {
            return Err(crate::error::Error::Input(format!(
                "saved mask counters are for {} layers, the model has {n}",
                c.kept.len()
            )));
        }
        for (dst, src) in [
            (&self.kept, &c.kept),
            (&self.total, &c.total),
            (&self.up_rows, &c.up_rows),
        ] {
            dst.iter().zip(src).for_each(|(d, &v)| d.store(v, Ordering::Relaxed));
        }
        Ok(())
    }

    pub fn reset_counters(&self) {
        for c in self.kept.iter().chain(&self.total).chain(&self.up_rows) {
            c.store(0, Ordering::Relaxed);
        }
    }

    /// For top-K `Candidates`: marks the `CANDIDATE_FACTOR ×` keep-count neurons with the largest
    /// |gate| in `cand`; returns how many.
    fn gate_candidates(&self, layer: usize, gate: &[f32], cand: &mut [bool]) -> usize {
        let c = ((self.keep_count(layer) as f32 * CANDIDATE_FACTOR).round() as usize).min(self.ffn);
        let g: Vec<f32> = gate.iter().map(|g| g.abs()).collect();
        top_k_mask(&g, c, cand);
        c
    }

    /// For `Union`: the context's tokens (`xn`, `gate`, `hact` of those tokens only) vote with
    /// their own top-K; the most voted neurons become the layer's set, kept for later batches
    /// and returned.
    pub fn union_vote(&self, layer: usize, xn: &[f32], gate: &[f32], hact: &[f32]) -> Vec<bool> {
        let mut votes = vec![0u32; self.ffn];
        self.union_vote_into(layer, xn, gate, hact, &mut votes)
    }

    /// As `union_vote`, adding to the votes of the current context's earlier batches (a new
    /// context starts when `set_union_context` goes from 0 to a token count).
    pub fn union_vote_accumulating(&self, layer: usize, xn: &[f32], gate: &[f32], hact: &[f32]) -> Vec<bool> {
        let mut all = self.union_votes.lock().expect("union votes lock");
        let votes = &mut all[layer];
        votes.resize(self.ffn, 0);
        self.union_vote_into(layer, xn, gate, hact, votes)
    }

    /// As `union_vote`, adding to `votes` (the context's earlier batches' votes).
    fn union_vote_into(&self, layer: usize, xn: &[f32], gate: &[f32], hact: &[f32], votes: &mut [u32]) -> Vec<bool> {
        let (f, h) = (self.ffn, self.hidden);
        let k = self.keep_count(layer);
        let mut scratch = Vec::new();
        let mut keep = vec![false; f];
        for t in 0..hact.len() / f {
            let (g, a) = (&gate[t * f..(t + 1) * f], &hact[t * f..(t + 1) * f]);
            scores(
                self.criterion,
                self.sketches,
                layer,
                &xn[t * h..(t + 1) * h],
                g,
                a,
                &mut scratch,
            );
            self.jitter_scores(layer, &mut scratch);
            top_k_mask(&scratch, k, &mut keep);
            votes.iter_mut().zip(&keep).for_each(|(v, &kp)| *v += kp as u32);
        }
        let votes_f: Vec<f32> = votes.iter().map(|&v| v as f32).collect();
        top_k_mask(&votes_f, k, &mut keep);
        self.union_sets.lock().expect("union sets lock")[layer] = Some(keep.clone());
        keep
    }

    /// Which neurons one token keeps (not `Union`).
    fn token_mask(
        &self,
        layer: usize,
        xn: &[f32],
        gate: &[f32],
        hact: &[f32],
        scratch: &mut Vec<f32>,
        keep: &mut [bool],
    ) -> usize {
        let k = self.keep_count(layer);
        scores(self.criterion, self.sketches, layer, xn, gate, hact, scratch);
        self.jitter_scores(layer, scratch);
        let mut up_rows = self.ffn;
        match (self.strategy, self.criterion) {
            (Strategy::Threshold, Criterion::Candidates) => {
                let (t, tg) = (
                    self.thresholds.as_ref().expect("thresholds")[layer],
                    self.gate_thresholds.as_ref().expect("gate thresholds")[layer],
                );
                up_rows = 0;
                for (i, kp) in keep.iter_mut().enumerate() {
                    let candidate = gate[i].abs() >= tg;
                    up_rows += candidate as usize;
                    *kp = candidate && scratch[i] >= t;
                }
            }
            (Strategy::Threshold, _) => {
                let t = self.thresholds.as_ref().expect("thresholds")[layer];
                keep.iter_mut().zip(scratch.iter()).for_each(|(kp, s)| *kp = *s >= t);
            }
            (_, Criterion::Candidates) => {
                let mut cand = vec![false; self.ffn];
                let c = self.gate_candidates(layer, gate, &mut cand);
                // Among candidates only: non-candidates score below everything.
                scratch.iter_mut().zip(&cand).for_each(|(s, c)| {
                    if !c {
                        *s = f32::NEG_INFINITY
                    }
                });
                top_k_mask(scratch, k, keep);
                up_rows = c;
            }
            _ => top_k_mask(scratch, k, keep),
        }
        if matches!(self.criterion, Criterion::Gate | Criterion::Sketch) {
            up_rows = keep.iter().filter(|&&k| k).count();
        }
        up_rows
    }
}

impl crate::model::generate::PromptAwareMask for Masker<'_> {
    fn prompt_tokens(&self, n: usize) {
        self.set_union_context(n);
    }
    fn as_mask(&self) -> &dyn FfnMask {
        self
    }
}

impl FfnMask for Masker<'_> {
    fn up_needed(&self, layer: usize, xn: &[f32], gate: &[f32], need: &mut [bool]) {
        let (f, h) = (self.ffn, self.hidden);
        let n = gate.len() / f;
        if self.strategy == Strategy::Union {
            let context = *self.union_context.lock().expect("union context lock");
            match &self.union_sets.lock().expect("union sets lock")[layer] {
                Some(set) if context == 0 => need.copy_from_slice(set),
                // The context's tokens run dense, and without a context the mask runs dense.
                _ => need.fill(true),
            }
            return;
        }
        if self.criterion == Criterion::Exact {
            need.fill(true);
            return;
        }
        need.fill(false);
        let (mut scratch, mut keep) = (Vec::new(), vec![false; f]);
        for t in 0..n {
            let g = &gate[t * f..(t + 1) * f];
            match (self.strategy, self.criterion) {
                (Strategy::Threshold, Criterion::Candidates) => {
                    let tg = self.gate_thresholds.as_ref().expect("gate thresholds")[layer];
                    keep.iter_mut().zip(g).for_each(|(k, g)| *k = g.abs() >= tg);
                }
                (_, Criterion::Candidates) => {
                    self.gate_candidates(layer, g, &mut keep);
                }
                // Gate and sketch scores do not read up: the kept set is decided here.
                _ => {
                    self.token_mask(layer, &xn[t * h..(t + 1) * h], g, g, &mut scratch, &mut keep);
                }
            }
            need.iter_mut().zip(&keep).for_each(|(n, k)| *n |= k);
        }
    }

    fn up_needed_reads_input(&self) -> bool {
        up_set_reads_input(self.strategy, self.criterion)
    }

    fn inside_experts(&self) -> bool {
        Masker::runs_inside_experts(self.strategy, self.criterion)
    }

    fn experts_used(&self) -> Option<usize> {
        self.experts_used
    }

    /// At sparsity 0 (a mask that only asks for another count of experts) every neuron is
    /// kept: the experts run with no mask at all, and nothing is counted.
    fn masks_neurons(&self) -> bool {
        self.sparsity > 0.0 || self.per_layer.is_some()
    }

    fn decides_before_up(&self) -> bool {
        match self.strategy {
            Strategy::Union => *self.union_context.lock().expect("union context lock") == 0,
            _ => matches!(self.criterion, Criterion::Gate | Criterion::Sketch),
        }
    }

    /// Gate and sketch scores read `xn` and `gate` only; a union set, nothing of the step.
    fn decides_from_input(&self) -> bool {
        self.decides_before_up()
    }

    /// What `apply` counts for one token whose kept set is the one `up_needed` named (gate and
    /// sketch scores: the token's own set, its up rows those; a union set past the context: the
    /// set).
    fn count_decided(&self, layer: usize, kept: usize) {
        self.kept[layer].fetch_add(kept as u64, Ordering::Relaxed);
        self.total[layer].fetch_add(self.ffn as u64, Ordering::Relaxed);
        self.up_rows[layer].fetch_add(kept as u64, Ordering::Relaxed);
    }

    fn apply(&self, layer: usize, xn: &[f32], gate: &[f32], _up: &[f32], hact: &mut [f32]) {
        let (f, h) = (self.ffn, self.hidden);
        let n = hact.len() / f;
        let first = match self.strategy {
            Strategy::Union => (*self.union_context.lock().expect("union context lock")).min(n),
            _ => 0,
        };
        if self.strategy == Strategy::Union {
            let keep = if first > 0 {
                self.union_vote_accumulating(layer, &xn[..first * h], &gate[..first * f], &hact[..first * f])
            } else {
                match &self.union_sets.lock().expect("union sets lock")[layer] {
                    Some(set) => set.clone(),
                    // No context has been seen: nothing to learn from, so run dense.
                    None => vec![true; f],
                }
            };
            let kept_per_token = keep.iter().filter(|&&k| k).count() as u64;
            for row in hact[first * f..].chunks_mut(f) {
                row.iter_mut().zip(&keep).for_each(|(a, &kp)| {
                    if !kp {
                        *a = 0.0
                    }
                });
            }
            let masked = (n - first) as u64;
            self.kept[layer].fetch_add(kept_per_token * masked, Ordering::Relaxed);
            self.total[layer].fetch_add(f as u64 * masked, Ordering::Relaxed);
            self.up_rows[layer].fetch_add(kept_per_token * masked, Ordering::Relaxed);
            return;
        }
        let counts: Vec<(u64, u64)> = hact
            .par_chunks_mut(f)
            .enumerate()
            .map_init(
                || (Vec::new(), vec![false; f]),
                |(scratch, keep), (t, row)| {
                    let up_rows = self.token_mask(
                        layer,
                        &xn[t * h..(t + 1) * h],
                        &gate[t * f..(t + 1) * f],
                        row,
                        scratch,
                        keep,
                    );
                    let mut kept = 0u64;
                    for (a, &kp) in row.iter_mut().zip(keep.iter()) {
                        if kp {
                            kept += 1;
                        } else {
                            *a = 0.0;
                        }
                    }
                    (kept, up_rows as u64)
                },
            )
            .collect();
        let kept: u64 = counts.iter().map(|c| c.0).sum();
        let up: u64 = counts.iter().map(|c| c.1).sum();
        self.kept[layer].fetch_add(kept, Ordering::Relaxed);
        self.total[layer].fetch_add((f * n) as u64, Ordering::Relaxed);
        self.up_rows[layer].fetch_add(up, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_the_largest_with_stable_ties() {
        let mut keep = vec![false; 6];
        top_k_mask(&[0.1, 0.9, 0.5, 0.9, 0.0, 0.3], 3, &mut keep);
        assert_eq!(keep, vec![false, true, true, true, false, false]);
        top_k_mask(&[1.0, 1.0, 1.0], 2, &mut keep[..3]);
        assert_eq!(&keep[..3], &[true, true, false]);
        top_k_mask(&[1.0, 2.0], 0, &mut keep[..2]);
        assert_eq!(&keep[..2], &[false, false]);
    }
}
