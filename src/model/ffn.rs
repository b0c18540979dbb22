//! The FFN, once. Every path — in RAM or streamed, prefill or decode, dense or masked — runs
//! its arithmetic here; a stream ([`LayerStream`]) only hands weights over: the gate (resident
//! or prefetched), staged up rows and down columns, or, for a streamed decode step, rows where
//! they are (cache slots, and reads as they land). Phases:
//! 1. the gate product and its activation (for the selected neurons);
//! 2. the neurons that need up: every selected one when the rows are in memory (computing them
//!    costs no reads), the mask's `up_needed` set when they stream; up·x for those;
//! 3. act(gate)·up, the mask's final choice (`apply`), the observer;
//! 4. down over the kept neurons: a product of the hidden activations with `[hidden, ffn]` rows,
//!    or an f64 accumulation of neuron-major `[ffn, hidden]` columns.
//!
//! A streamed decode step with a mask computes each up row and down column as it lands (hits
//! from the cache meanwhile, on the other pool thread); its down sums run in another order
//! than the staged path's, so it agrees with the in-RAM model to rounding, not bit for bit.
//! Everything else streams through the staged path, bit-identical to the in-RAM model when
//! every neuron is kept.

use rayon::prelude::*;

use crate::backend::ops::{gelu_tanh, silu};
use crate::config::FfnActivation;
use crate::error::Result;
use crate::model::forward::{prepare_all, FfnHooks, FfnMask, FfnNeurons, LayerStream};
use crate::model::weights::{FfnDown, LayerWeights};
use crate::model::Model;
use crate::quant::{axpy_row_f64, vec_dot, PreparedInput};

impl Model {
    /// The FFN's activation function.
    pub fn ffn_act(&self, g: f32) -> f32 {
        match self.config.activation {
            FfnActivation::Silu => silu(g),
            FfnActivation::GeluTanh => gelu_tanh(g),
        }
    }

    /// Layer `l`'s FFN on the normalized input `xn` `[n, hidden]`: `down · (act(gate·x) · up·x)`
    /// `[n, hidden]`, before any post-FFN norm.
    pub(crate) fn ffn(
        &self,
        l: usize,
        w: &LayerWeights,
        xn: &[f32],
        prep: &mut Vec<PreparedInput>,
        hooks: &FfnHooks,
    ) -> Result<Vec<f32>> {
        let cfg = &self.config;
        let (h, f) = (cfg.hidden, cfg.ffn);
        let n = xn.len() / h;
        let stream = hooks.stream.filter(|s| s.streams_ffn());
        let neurons = (hooks.select)(l, n);
        let act = |g: f32| self.ffn_act(g);

        // Phase 1: act(gate·x) `[n, ffn]`; neurons not selected stay exactly zero.
        let streamed_gate = match stream {
            Some(s) => s.gate(l)?,
            None => None,
        };
        let gate_w = streamed_gate.as_ref().unwrap_or(&w.ffn_gate);
        let gate_ty = gate_w.ty;
        let mut gate = vec![0f32; n * f];
        prepare_all(xn, h, gate_w, prep);
        match neurons {
            FfnNeurons::All => {
                self.backend.matmul(gate_w, prep, &mut gate);
                gate.iter_mut().for_each(|g| *g = act(*g));
            }
            FfnNeurons::Subset(rows) => {
                let m = rows.len();
                let mut g = vec![0f32; n * m];
                self.backend.matmul_rows(gate_w, rows, prep, &mut g);
                for t in 0..n {
                    for (i, &r) in rows.iter().enumerate() {
                        gate[t * f + r as usize] = act(g[t * m + i]);
                    }
                }
            }
        }
        drop(streamed_gate);
        if let (Some(s), Some(mask), 1, FfnNeurons::All) = (stream, hooks.mask, n, neurons) {
            return self.ffn_decode_streamed(l, w, xn, &gate, mask, hooks, s);
        }

        // Phase 2: up·x `[n, ffn]` for the neurons that need it.
        let mut up = vec![0f32; n * f];
        let scatter = |up: &mut [f32], set: &[u32], u: &[f32]| {
            let m = set.len();
            for t in 0..n {
                for (i, &r) in set.iter().enumerate() {
                    up[t * f + r as usize] = u[t * m + i];
                }
            }
        };
        // Streamed: the up set, and the down columns staged with it when the mask decides
        // before up (one read batch instead of two).
        let mut staged: Option<(Vec<u32>, bool, Option<crate::tensor::Weight>)> = None;
        match stream {
            None => {
                if w.ffn_up.ty != gate_ty {
                    prepare_all(xn, h, &w.ffn_up, prep);
                }
                match neurons {
                    FfnNeurons::All => self.backend.matmul(&w.ffn_up, prep, &mut up),
                    FfnNeurons::Subset(rows) => {
                        let mut u = vec![0f32; n * rows.len()];
                        self.backend.matmul_rows(&w.ffn_up, rows, prep, &mut u);
                        scatter(&mut up, rows, &u);
                    }
                }
            }
            Some(s) => {
                let mut need = vec![true; f];
                if let Some(m) = hooks.mask {
                    m.up_needed(l, xn, &gate, &mut need);
                }
                if let FfnNeurons::Subset(rows) = neurons {
                    let mut selected = vec![false; f];
                    rows.iter().for_each(|&r| selected[r as usize] = true);
                    need.iter_mut().zip(&selected).for_each(|(n, s)| *n &= s);
                }
                let one_pass = hooks.mask.is_none_or(|m| m.decides_before_up());
                let up_set: Vec<u32> = (0..f as u32).filter(|&i| need[i as usize]).collect();
                let (up_w, down_w) = s.stage(l, &up_set, one_pass)?;
                if up_w.ty != gate_ty {
                    prepare_all(xn, h, &up_w, prep);
                }
                let mut u = vec![0f32; n * up_set.len()];
                if !up_set.is_empty() {
                    self.backend.matmul(&up_w, prep, &mut u);
                }
                drop(up_w);
                scatter(&mut up, &up_set, &u);
                staged = Some((up_set, one_pass, down_w));
            }
        }

        // Phase 3: hidden activations act(gate)·up (in place of up unless a mask needs up).
        let hact = match hooks.mask {
            None => {
                up.iter_mut().zip(&gate).for_each(|(u, g)| *u *= g);
                up
            }
            Some(mask) => {
                let mut hact: Vec<f32> = up.iter().zip(&gate).map(|(u, g)| u * g).collect();
                mask.apply(l, xn, &gate, &up, &mut hact);
                hact
            }
        };
        if let Some(observe) = hooks.observe {
            observe(l, &gate, &hact);
        }

        // Phase 4: down over the kept neurons.
        let mut d = vec![0f32; n * h];
        match (staged, stream) {
            (Some((up_set, one_pass, down_w)), Some(s)) => {
                // Staged columns, row i = the down set's i-th neuron (already staged when one
                // read batch sufficed).
                let (down_set, down_w) = match (one_pass, down_w) {
                    (true, Some(dw)) => (up_set, dw),
                    _ => {
                        let keep: Vec<u32> = (0..f as u32)
                            .filter(|&i| (0..n).any(|t| hact[t * f + i as usize] != 0.0))
                            .collect();
                        let dw = s.stage_down(l, &keep, &up_set)?;
                        (keep, dw)
                    }
                };
                let k = down_set.len();
                let mut acts = vec![0f32; n * k];
                for t in 0..n {
                    for (i, &r) in down_set.iter().enumerate() {
                        acts[t * k + i] = hact[t * f + r as usize];
                    }
                }
                if k > 0 {
                    self.backend.accumulate_rows(&down_w, None, &acts, &mut d);
                }
            }
            _ => match &w.ffn_down {
                FfnDown::Rows(down) => {
                    prepare_all(&hact, f, down, prep);
                    self.backend.matmul(down, prep, &mut d);
                }
                FfnDown::Columns(down_t) => {
                    let rows = match neurons {
                        FfnNeurons::All => None,
                        FfnNeurons::Subset(rows) => Some(rows),
                    };
                    self.backend.accumulate_rows(down_t, rows, &hact, &mut d);
                }
            },
        }
        Ok(d)
    }

    /// One token's masked, streamed FFN after phase 1, computed where the bytes are (see the
    /// module docs): the stream hands over up rows (cache hits on one pool thread, misses as
    /// they land on the other), then the kept neurons' down columns likewise. Also makes the
    /// lookahead prediction for the next layer, when the stream reads ahead.
    #[allow(clippy::too_many_arguments)]
    fn ffn_decode_streamed(
        &self,
        l: usize,
        w: &LayerWeights,
        xn: &[f32],
        gate: &[f32],
        mask: &dyn FfnMask,
        hooks: &FfnHooks,
        s: &dyn LayerStream,
    ) -> Result<Vec<f32>> {
        let (h, f) = (self.config.hidden, self.config.ffn);
        s.begin_decode(l)?;
        self.predict_next(l, xn, mask, s)?;
        let mut need = vec![false; f];
        mask.up_needed(l, xn, gate, &mut need);
        let one_pass = mask.decides_before_up();
        let up_set: Vec<u32> = (0..f as u32).filter(|&i| need[i as usize]).collect();
        let (up_ty, down_ty) = (w.ffn_up.ty, w.ffn_down.weight().ty);
        let mut px = PreparedInput::new();
        px.prepare(xn, up_ty);

        // Up: hits and misses on two threads, each writing its own list.
        let (mut hit_u, mut miss_u): (Vec<(u32, f32)>, Vec<(u32, f32)>) = (Vec::new(), Vec::new());
        s.decode_up(
            l,
            &up_set,
            one_pass,
            &mut |rows| hit_u = rows.iter().map(|&(n, r)| (n, vec_dot(up_ty, r, &px))).collect(),
            &mut |n, r| miss_u.push((n, vec_dot(up_ty, r, &px))),
        )?;
        let mut up = vec![0f32; f];
        for &(n, u) in hit_u.iter().chain(&miss_u) {
            up[n as usize] = u;
        }
        let mut hact: Vec<f32> = up.iter().zip(gate).map(|(u, g)| u * g).collect();
        mask.apply(l, xn, gate, &up, &mut hact);
        if let Some(observe) = hooks.observe {
            observe(l, gate, &hact);
        }

        // Down for the kept neurons: rows in memory summed (split over the two threads when
        // no read is in flight), rows read now added as they land.
        let hact_ro = &hact;
        let sum = |rows: &[(u32, &[u8])], acc: &mut [f64]| {
            for &(n, row) in rows {
                axpy_row_f64(down_ty, row, hact_ro[n as usize], acc);
            }
        };
        let mut acc = vec![0f64; h];
        let mut acc_read = vec![0f64; h];
        let mut read_any = false;
        s.decode_down(
            l,
            &|n| hact_ro[n as usize] != 0.0,
            &mut |rows, concurrent| {
                if concurrent {
                    sum(rows, &mut acc);
                    return;
                }
                let per = rows.len().div_ceil(2).max(1);
                let partials: Vec<Vec<f64>> = rows
                    .par_chunks(per)
                    .map(|c| {
                        let mut a = vec![0f64; h];
                        sum(c, &mut a);
                        a
                    })
                    .collect();
                for p in partials {
                    acc.iter_mut().zip(&p).for_each(|(a, b)| *a += b);
                }
            },
            &mut |n, row| {
                read_any = true;
                axpy_row_f64(down_ty, row, hact_ro[n as usize], &mut acc_read);
            },
        )?;
        if read_any {
            acc.iter_mut().zip(&acc_read).for_each(|(a, b)| *a += b);
        }
        Ok(acc.iter().map(|&v| v as f32).collect())
    }

    /// Lookahead: which neurons the next layer will need, from this layer's FFN input carried
    /// over to the next layer's norm (`xn ÷ norm_l × norm_next`: the residual stream changes
    /// little from one layer to the next) and the next layer's resident gate — or, for masks
    /// whose up set does not read the input, exactly — handed to the stream to read ahead.
    fn predict_next(&self, l: usize, xn: &[f32], mask: &dyn FfnMask, s: &dyn LayerStream) -> Result<()> {
        let reads_input = mask.up_needed_reads_input();
        let Some((next, gate_next)) = s.lookahead_target(l, reads_input) else {
            return Ok(());
        };
        let (h, f) = (self.config.hidden, self.config.ffn);
        let mut need = vec![false; f];
        match gate_next {
            Some(gate_w) => {
                let (w_now, w_next) = (&self.weights.layers[l].ffn_norm, &self.weights.layers[next].ffn_norm);
                let x: Vec<f32> = xn
                    .iter()
                    .zip(w_now.iter().zip(w_next))
                    .map(|(&v, (&a, &b))| if a != 0.0 { v / a * b } else { 0.0 })
                    .collect();
                let mut prep = Vec::new();
                prepare_all(&x, h, &gate_w, &mut prep);
                let mut g = vec![0f32; f];
                self.backend.matmul(&gate_w, &prep, &mut g);
                g.iter_mut().for_each(|v| *v = self.ffn_act(*v));
                mask.up_needed(next, &x, &g, &mut need);
            }
            None => mask.up_needed(next, &[], &[], &mut need),
        }
        s.read_ahead(next, &need, mask.decides_before_up())
    }
}
