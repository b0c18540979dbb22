//! The FFN, once. Every path — in RAM or streamed, prefill or decode, dense or masked — runs
//! its arithmetic here; a stream only hands weights over ([`RowStream`] for a dense FFN's rows,
//! [`crate::model::forward::ExpertStream`] for routed experts): the gate (resident
//! or prefetched), staged up rows and down columns, or, for a streamed decode step, rows where
//! they are (cache slots, and reads as they land). Phases:
//! 1. the gate product and its activation;
//! 2. the neurons that need up: every one when the rows are in memory (computing them costs no
//!    reads), the mask's `up_needed` set when they stream; up·x for those;
//! 3. act(gate)·up, the mask's final choice (`apply`), the observer;
//! 4. down over the kept neurons: a product of the hidden activations with `[hidden, ffn]` rows,
//!    or an f64 accumulation of neuron-major `[ffn, hidden]` columns.
//!
//! A streamed decode step with a mask computes each up row and down column as it lands (hits
//! from the cache meanwhile, on the other pool thread); its down sums run in another order
//! than the staged path's, so it agrees with the in-RAM model to rounding, not bit for bit.
//! On a device with memory of its own (`HostLink::host_memory() == false`) the same step takes
//! the gate's scores to the host (the one small copy the mask needs), gathers the rows the
//! stream hands over (cache hits, lookahead reads, reads as they land) in neuron order into the
//! device's staging buffer (`HostLink::begin_upload`; page-locked on CUDA), handing each chunk to
//! the device as soon as its last row lands so its copy overlaps the reads still in flight, and
//! runs phases 2–4 with the device's products on those staged rows — unless the stream holds
//! the whole layer in host memory the device mapped (`RowStream::rows_in_place`: a neuron
//! cache of every neuron, as `--vram-budget` without `--ram-budget` plans), where the device's
//! products read the needed up rows and the kept down columns by id, in place, across the link:
//! nothing gathered, staged or copied.
//! Everything else streams through the staged path (a set the cache holds in consecutive slots,
//! such as a dense step's, handed over as a view of the cache rather than gathered),
//! bit-identical to the in-RAM model when every neuron is kept.
//!
//! Which of these a pass takes — in RAM, hybrid, decode on the host, in place, staged — is one
//! decision, [`ffn_path`], made from the stream, the mask and the device (its doc is the table);
//! each path is a function of its own, the in-RAM and streamed ones sharing phases 2 to 4.

use rayon::prelude::*;

use crate::backend::cpu::CpuBackend;
use crate::backend::{Act, Device, Upload};
use crate::config::{FfnActivation, Gating, MoeConfig};
use crate::error::Error;
use crate::error::Result;
use crate::model::forward::{ColdRows, FfnHooks, FfnMask, RowStream};
use crate::model::weights::{ExpertWeights, FfnDown, FfnWeights, LayerFfn, LayerWeights};
use crate::model::Model;
use crate::quant::{axpy_row_f64, vec_dot, PreparedInput};
use crate::tensor::Weight;

/// The ways a dense FFN's pass runs, [`ffn_path`]'s choice (see the module docs for each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FfnPath {
    /// Every matrix in memory: gate and up from one prepared input ([`Model::ffn_in_ram`]).
    InRam,
    /// The hybrid executor: the device computes the rows it keeps, the host's CPU the cold rows
    /// where the stream holds them ([`Model::ffn_hybrid`]).
    Hybrid,
    /// A masked, streamed decode step on the CPU device: each row computed where it lands
    /// ([`Model::ffn_decode_streamed`]).
    DecodeOnHost,
    /// A masked, streamed decode step on a device with memory of its own: its products read the
    /// step's rows in place where the stream holds the layer in memory the device mapped, else
    /// the rows are staged ([`RowStream::rows_in_place`]).
    InPlace,
    /// Any other streamed pass: the rows staged for the device's products (a dense step's as a
    /// view of the cache or the prefetch buffer where they lie in order).
    Staged,
}

/// A mask's properties the path depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MaskFacts {
    /// It decides from the input and the gate alone ([`FfnMask::decides_from_input`]).
    pub from_input: bool,
    /// It decides before up is computed ([`FfnMask::decides_before_up`]).
    pub before_up: bool,
}

/// What [`ffn_path`] decides from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FfnFacts {
    /// A stream hands this FFN's weights over.
    pub streamed: bool,
    /// The device computes in host memory (the CPU device).
    pub host_memory: bool,
    /// Tokens in the pass.
    pub tokens: usize,
    pub mask: Option<MaskFacts>,
    /// An observer watches the activations (calibration, traces).
    pub observed: bool,
    /// The stream gives this pass's cold rows to the host's CPU (the hybrid executor plans
    /// them for a pass of this width), `true` when it holds them in host memory (not only
    /// staged).
    pub cold: Option<bool>,
}

/// The path of a dense FFN's pass. In order, the first row that holds:
///
/// | streamed | device | mask | observer | cold rows on the host | path |
/// |---|---|---|---|---|---|
/// | no | any | any | any | any | `InRam` |
/// | yes | own memory | none, or one token deciding from the input before up | none | planned (held, where a mask runs) | `Hybrid` |
/// | yes | host memory | one token | any | any | `DecodeOnHost` |
/// | yes | own memory | one token | any | any | `InPlace` |
/// | yes | any | otherwise | any | any | `Staged` |
pub(crate) fn ffn_path(f: &FfnFacts) -> FfnPath {
    if !f.streamed {
        return FfnPath::InRam;
    }
    let hybrid_mask = f.mask.is_none_or(|m| f.tokens == 1 && m.from_input && m.before_up);
    let cold = f.cold.is_some_and(|held| held || f.mask.is_none());
    if !f.host_memory && !f.observed && hybrid_mask && cold {
        return FfnPath::Hybrid;
    }
    match (f.mask.is_some() && f.tokens == 1, f.host_memory) {
        (true, true) => FfnPath::DecodeOnHost,
        (true, false) => FfnPath::InPlace,
        (false, _) => FfnPath::Staged,
    }
}

impl Model {
    /// Layer `l`'s FFN on the normalized input `xn` `[n, hidden]`, before any post-FFN norm.
    pub fn ffn(&self, l: usize, w: &LayerWeights, xn: &Act, hooks: &FfnHooks) -> Result<Act> {
        match (&w.ffn, &self.config.moe) {
            // A stream that hands the whole FFN over (the `rows` layout): as in RAM, on its views.
            (LayerFfn::Dense(f), _) => {
                // A leading dense layer of a mixture of experts runs every neuron, as its shared
                // expert does: masks and traces are of the routed experts.
                let lead = FfnHooks {
                    observe: None,
                    mask: None,
                    stream: hooks.stream,
                    cancel: hooks.cancel,
                };
                let hooks = if self.config.moe.is_some() { &lead } else { hooks };
                match hooks.stream.map(|s| s.ffn_weights(l)).transpose()?.flatten() {
                    Some(streamed) => self.ffn_dense(l, &streamed, xn, hooks),
                    None => self.ffn_dense(l, f, xn, hooks),
                }
            }
            (LayerFfn::Experts(e), Some(moe)) => self.ffn_experts(l, e, moe, xn, hooks),
            (LayerFfn::Experts(_), None) => Err(Error::Internal(format!(
                "{}: layer {l} has experts but the configuration none",
                self.path.display()
            ))),
        }
    }

    /// A mixture of experts (see [`MoeConfig`]): the router's choices come to the host (the
    /// one sync point), tokens are grouped per expert so each chosen expert's rows are read
    /// once for all its tokens, each expert is [`Model::ffn_dense`], and its rows are added to
    /// their tokens' outputs times their weights; Qwen2-MoE's shared expert runs on every token
    /// scaled by its sigmoid gate. Arithmetic as llama.cpp's `build_moe_ffn`: softmax over the
    /// router's logits in f32, the `n_used` largest (ties to the lower index), renormalized
    /// (sum clamped to 2^-14) where the architecture says so.
    fn ffn_experts(&self, l: usize, e: &ExpertWeights, moe: &MoeConfig, xn: &Act, hooks: &FfnHooks) -> Result<Act> {
        let n = xn.rows;
        // A stream that reads this layer's experts holds its router and shared expert too.
        let stream = hooks
            .stream
            .and_then(|s| s.expert_stream())
            .and_then(|s| s.expert_layer(l).map(|x| (s, x)));
        let streams_elsewhere = stream.is_none() && hooks.stream.is_some_and(|s| s.ffn_rows().is_some());
        let mask = hooks.mask;
        if streams_elsewhere || hooks.observe.is_some() || mask.is_some_and(|m| !m.inside_experts()) {
            return Err(Error::Input(
                "mixture-of-experts models take top-K neuron masks inside each routed expert (--strategy topk with \
                 --criterion gate, exact or candidates); threshold and union masks, the sketch criterion and \
                 calibration keep per-layer state over a dense layer's neurons and are not available for them; \
                 to trade quality for speed, also route tokens to fewer experts: --experts-used K (run --mode compare \
                 --experts-used K sets it against the model's own count)"
                    .into(),
            ));
        }
        let used = mask.and_then(|m| m.experts_used()).unwrap_or(moe.n_used);
        if used == 0 || used > moe.n_experts {
            return Err(Error::Input(format!(
                "{} experts per token asked of a model with {} experts per layer",
                used, moe.n_experts
            )));
        }
        let moe = &MoeConfig {
            n_used: used,
            ..moe.clone()
        };
        let (router, shared, bias) = match &stream {
            Some((_, x)) => (x.router, x.shared, x.score_bias),
            None => (&e.router, e.shared.as_ref(), e.score_bias.as_deref()),
        };
        let dev = &*self.device;
        let h = self.config.hidden;
        let logits = dev.matmul(&[router], xn).remove(0);
        let routes = route(&with_router_bias(dev.to_host(&logits), e), moe, bias);
        if let Some(m) = mask {
            m.routed(l, moe.n_used, &routes);
        }
        let mut groups: Vec<(Vec<usize>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); moe.n_experts];
        for (t, chosen) in routes.chunks_exact(moe.n_used).enumerate() {
            for &(ex, weight) in chosen {
                groups[ex].0.push(t);
                groups[ex].1.push(weight);
            }
        }
        // Lookahead (decoding): the next layer's router on this layer's input carried over to
        // the next layer's norm picks the experts to read while this layer computes.
        if let (Some((s, _)), 1) = (&stream, n) {
            if let Some((next, router_next, bias_next)) = s.expert_lookahead(l) {
                let x = self.carried_to_next_norm(l, next, &dev.to_host(xn));
                let predicted = dev.matmul(&[router_next], &dev.upload(1, h, x)).remove(0);
                let predicted = match &self.weights.layers[next].ffn {
                    LayerFfn::Experts(e_next) => with_router_bias(dev.to_host(&predicted), e_next),
                    LayerFfn::Dense(_) => dev.to_host(&predicted),
                };
                let ids: Vec<usize> = route(&predicted, moe, bias_next).iter().map(|r| r.0).collect();
                s.read_experts_ahead(next, &ids)?;
            }
        }
        let ids: Vec<usize> = (0..moe.n_experts).filter(|&ex| !groups[ex].0.is_empty()).collect();
        let dense = FfnHooks::dense();
        // The hybrid executor: routed experts computed by the host's CPU where the stream has
        // them (host memory), unless a neuron mask runs inside them; the device computes the
        // shared expert meanwhile (launched first), and gets each expert's output rows.
        let on_cpu = match (&stream, mask.filter(|m| m.masks_neurons())) {
            (Some((s, _)), None) if !dev.host_memory() && !moe.oai_experts => s.host_cpu(n).map(|cpu| (*s, cpu)),
            _ => None,
        };
        let shared_y = match shared {
            Some((shared, _)) => Some(self.ffn_dense(l, shared, xn, &dense)?),
            None => None,
        };
        // The input on the host, once: the CPU's experts and the shared expert's gate read it.
        let mut xh = on_cpu.map(|_| dev.to_host(xn).into_owned());
        if on_cpu.is_some() {
            dev.launch_pending();
        }
        let (mut cpu_bytes, mut cpu_ns) = (0u64, 0u64);
        // A neuron mask runs inside each routed expert (not the shared one, which every token
        // runs): it sees the expert's own activations, of the model's expert width.
        let masked = FfnHooks {
            observe: None,
            mask: mask.filter(|m| m.masks_neurons()),
            stream: None,
            cancel: None,
        };
        let mut outputs: Vec<(usize, Act)> = Vec::with_capacity(ids.len());
        let mut one = |ex: usize, w: &FfnWeights| -> Result<()> {
            let tokens = &groups[ex].0;
            if masked.mask.is_some() && w.gate.rows != self.config.ffn {
                return Err(Error::Input(format!(
                    "{}: layer {l} expert {ex} has {} neurons, not the model's expert width {}; a neuron mask cannot run inside it",
                    self.path.display(),
                    w.gate.rows,
                    self.config.ffn
                )));
            }
            if let (Some((_, cpu)), Some(xh)) = (on_cpu, &xh) {
                let started = std::time::Instant::now();
                let x: Vec<f32> = tokens
                    .iter()
                    .flat_map(|&t| xh[t * h..(t + 1) * h].iter().copied())
                    .collect();
                let y = host_ffn(cpu, w, x, tokens.len(), self.config.activation);
                cpu_ns += started.elapsed().as_nanos() as u64;
                cpu_bytes += (w.gate.len_bytes() + w.up.len_bytes() + w.down.weight().len_bytes()) as u64;
                outputs.push((ex, dev.upload(tokens.len(), h, y)));
                return Ok(());
            }
            let picked = (tokens.len() < n).then(|| dev.select_rows(xn, tokens));
            let x = picked.as_ref().unwrap_or(xn);
            let y = match e.biases.as_ref().filter(|_| moe.oai_experts) {
                Some(b) if masked.mask.is_none() => self.ffn_oai_expert(w, b.of(ex), x),
                Some(_) => {
                    return Err(Error::Input(format!(
                        "{}: neuron masks do not run inside {} experts (biased, clamped SwiGLU) yet; run it \
                         with --mode dense",
                        self.path.display(),
                        self.config.arch.name()
                    )))
                }
                None if moe.oai_experts => {
                    return Err(Error::Input(format!(
                        "{}: layer {l} has no expert biases (`ffn_gate_exps.bias`…), which its configuration needs",
                        self.path.display()
                    )))
                }
                None => self.ffn_dense(l, w, x, &masked)?,
            };
            outputs.push((ex, y));
            Ok(())
        };
        match &stream {
            Some((s, _)) => s.experts(l, &ids, &mut one)?,
            None => {
                for &ex in &ids {
                    one(ex, &e.experts[ex])?;
                }
            }
        }
        if let Some((s, _)) = on_cpu.filter(|_| cpu_bytes > 0) {
            s.count_cold(cpu_bytes, cpu_ns);
        }
        // Added in expert order whatever order they came in (cache hits first when streaming),
        // so streamed and in-RAM sums round alike.
        outputs.sort_by_key(|o| o.0);
        let mut out = dev.zeros(n, h);
        for (ex, y) in &outputs {
            dev.add_rows_scaled(&mut out, y, &groups[*ex].0, &groups[*ex].1);
        }
        match (shared, shared_y) {
            (Some((_, Some(gate))), Some(y)) => {
                let x = xh.get_or_insert_with(|| dev.to_host(xn).into_owned());
                let scales: Vec<f32> = x
                    .chunks_exact(h)
                    .map(|row| {
                        let g: f32 = row.iter().zip(gate).map(|(a, b)| a * b).sum();
                        1.0 / (1.0 + (-g).exp())
                    })
                    .collect();
                dev.add_rows_scaled(&mut out, &y, &(0..n).collect::<Vec<_>>(), &scales);
            }
            // Not gated (GLM-4.5): the routed experts' sum plus the shared expert's output.
            (Some((_, None)), Some(y)) => dev.add(&mut out, &y),
            _ => {}
        }
        Ok(out)
    }

    /// A gpt-oss expert on `xn` `[n, hidden]`: `down · swiglu_oai(gate·x + b_g, up·x + b_u) + b_d`
    /// (llama.cpp's `build_moe_ffn` with `LLM_FFN_SWIGLU_OAI_MOE`): the activation on the host
    /// (a borrow on the CPU device).
    fn ffn_oai_expert(&self, w: &FfnWeights, b: [&[f32]; 3], xn: &Act) -> Act {
        let dev = &*self.device;
        let mut gu = dev.matmul_bias(&[&w.gate, &w.up], &[Some(b[0]), Some(b[1])], xn);
        let (up, gate) = (gu.pop().expect("up"), gu.pop().expect("gate"));
        let act: Vec<f32> = {
            let (g, u) = (dev.to_host(&gate), dev.to_host(&up));
            g.iter().zip(u.iter()).map(|(&g, &u)| swiglu_oai(g, u)).collect()
        };
        let act = dev.upload(xn.rows, w.gate.rows, act);
        match &w.down {
            FfnDown::Rows(down) => dev.matmul_bias(&[down], &[Some(b[2])], &act).remove(0),
            FfnDown::Columns(down_t) => {
                let mut d = dev.zeros(xn.rows, down_t.cols);
                dev.accumulate_rows(down_t, None, &act, &mut d);
                dev.add_bias(&mut d, b[2]);
                d
            }
        }
    }

    /// A dense FFN on the normalized input `xn` `[n, hidden]`: `down · (act(gate·x) · up·x)`
    /// `[n, hidden]`, by the path [`ffn_path`] chooses from the stream, the mask and the device.
    pub(crate) fn ffn_dense(&self, l: usize, w: &FfnWeights, xn: &Act, hooks: &FfnHooks) -> Result<Act> {
        let stream = hooks.stream.and_then(|s| s.ffn_rows());
        let cold = stream.and_then(|s| s.cold_on_host(l, xn.rows));
        let facts = FfnFacts {
            streamed: stream.is_some(),
            host_memory: self.device.host_memory(),
            tokens: xn.rows,
            mask: hooks.mask.map(|m| MaskFacts {
                from_input: m.decides_from_input(),
                before_up: m.decides_before_up(),
            }),
            observed: hooks.observe.is_some(),
            cold: cold.as_ref().map(|c| c.rows.is_some()),
        };
        match (ffn_path(&facts), stream) {
            (FfnPath::InRam, _) | (_, None) => self.ffn_in_ram(l, w, xn, hooks),
            (path, Some(s)) => self.ffn_streamed(l, w, xn, hooks, s, path, cold),
        }
    }

    /// [`FfnPath::InRam`]: gate and up from one prepared input, then phases 3 and 4 (act(gate)·up
    /// in one operation when no mask and no observer is there).
    fn ffn_in_ram(&self, l: usize, w: &FfnWeights, xn: &Act, hooks: &FfnHooks) -> Result<Act> {
        let dev = &*self.device;
        let mut gu = dev.matmul(&[&w.gate, &w.up], xn);
        let up = gu.pop().expect("up");
        let mut gate = gu.pop().expect("gate");
        let plain = hooks.mask.is_none() && hooks.observe.is_none();
        if !plain {
            dev.activate(&mut gate, self.config.activation);
        }
        self.ffn_phases(l, w, xn, gate, Some(up), None, FfnPath::InRam, hooks)
    }

    /// The streamed paths after phase 1 (the gate, resident or handed over, activated):
    /// [`FfnPath::Hybrid`], [`FfnPath::DecodeOnHost`], and phases 2 to 4 for
    /// [`FfnPath::InPlace`] and [`FfnPath::Staged`].
    #[allow(clippy::too_many_arguments)]
    fn ffn_streamed(
        &self,
        l: usize,
        w: &FfnWeights,
        xn: &Act,
        hooks: &FfnHooks,
        s: &dyn RowStream,
        path: FfnPath,
        cold: Option<ColdRows>,
    ) -> Result<Act> {
        let dev = &*self.device;
        let streamed_gate = s.gate(l)?;
        let mut gate = dev.matmul(&[streamed_gate.as_deref().unwrap_or(&w.gate)], xn).remove(0);
        dev.activate(&mut gate, self.config.activation);
        drop(streamed_gate);
        match (path, hooks.mask) {
            (FfnPath::Hybrid, mask) => {
                let cold =
                    cold.ok_or_else(|| Error::Internal(format!("layer {l}: the hybrid path without cold rows")))?;
                self.ffn_hybrid(l, xn, &gate, mask, s, cold)
            }
            (FfnPath::DecodeOnHost, Some(mask)) => {
                let d = self.ffn_decode_streamed(l, w, &dev.to_host(xn), &dev.to_host(&gate), mask, hooks, s)?;
                Ok(dev.upload(1, self.config.hidden, d))
            }
            _ => self.ffn_phases(l, w, xn, gate, None, Some(s), path, hooks),
        }
    }

    /// Phases 2 to 4 (see the module docs) after phase 1's activated gate (or, in RAM with no
    /// mask and no observer, the gate's product and `up_with_gate`, for phase 3's one
    /// operation): in RAM, or streamed by [`FfnPath::InPlace`] or [`FfnPath::Staged`].
    #[allow(clippy::too_many_arguments)]
    fn ffn_phases(
        &self,
        l: usize,
        w: &FfnWeights,
        xn: &Act,
        mut gate: Act,
        up_with_gate: Option<Act>,
        stream: Option<&dyn RowStream>,
        path: FfnPath,
        hooks: &FfnHooks,
    ) -> Result<Act> {
        let cfg = &self.config;
        let dev = &*self.device;
        let (h, f, n) = (cfg.hidden, w.gate.rows, xn.rows);
        let plain = matches!((stream, hooks.mask, hooks.observe), (None, None, None));
        // A masked decode step on a device with memory of its own (its rows read in place where
        // the stream holds them so).
        let decode = path == FfnPath::InPlace;

        // Phase 2: up·x `[n, ffn]` for the neurons that need it. Streamed: the up set, and the
        // down columns staged with it when the mask decides before up (one read batch); the
        // device's hot neurons (`RowStream::hot_rows`) from its own copy, the stream handing
        // over only the rest.
        let mut streamed: Option<Streamed> = None;
        // The mask's inputs on the host, once per layer (a sync where the device has its own
        // memory; a borrow on the CPU): phase 3 reads them, and phase 2 too when the mask picks
        // up's neurons from them. Otherwise they are fetched after up is computed, so a decode
        // layer waits on the device once (input, gate and up together), not twice.
        let fetch = || (dev.to_host(xn), dev.to_host(&gate));
        let mut scores = hooks.mask.filter(|m| m.up_needed_reads_input()).map(|_| fetch());
        let mut up = match (up_with_gate, stream) {
            (Some(up), _) => up,
            (None, None) => unreachable!("computed with the gate"),
            (None, Some(s)) => {
                let mut need = vec![true; f];
                if let Some(m) = hooks.mask {
                    // A mask whose up set does not read the input is handed none (it is
                    // fetched later; see `scores`).
                    let (xh, gh) = scores.as_ref().map_or((&[][..], &[][..]), |(x, g)| (&x[..], &g[..]));
                    if decode {
                        s.begin_decode(l)?;
                        self.predict_next(l, xh, m, s)?;
                    }
                    m.up_needed(l, xh, gh, &mut need);
                }
                let one_pass = hooks.mask.is_none_or(|m| m.decides_before_up());
                let (up, st) = self.up_streamed(l, w, xn, s, decode, &need, one_pass)?;
                streamed = Some(st);
                up
            }
        };

        // Phase 3: hidden activations act(gate)·up (in place of up unless a mask needs up).
        // A device with memory of its own: the mask's edit of them, made on the host, stays
        // there too (phase 4 reads the kept neurons from it instead of the device).
        let mut hact_host: Option<Vec<f32>> = None;
        // A decode step on a device with memory of its own, whose mask decides from the input
        // and gate alone and reads up only for the neurons it keeps (a hot or streamed set, up
        // zero elsewhere): the device makes act(gate)·up, and phase 4 takes exactly that set,
        // so up is never fetched (one sync a layer fewer). Nothing watches the activations.
        let on_device = decode
            && !dev.host_memory()
            && hooks.observe.is_none()
            && hooks.mask.is_some_and(|m| m.decides_from_input())
            && streamed.as_ref().is_some_and(|st| st.one_pass);
        let hact = match hooks.mask {
            Some(mask) if on_device => {
                // The mask counts the step from the set it chose (phase 4 takes exactly that
                // set): its choice is not made again, and the input and gate stay on the
                // device unless the choice read them.
                let st = streamed.as_ref().expect("on_device needs the stream's sets");
                mask.count_decided(l, st.hot_set.len() + st.up_set.len());
                dev.mul(&mut up, &gate);
                up
            }
            None if plain => {
                dev.activate_mul(&mut up, &mut gate, cfg.activation);
                up
            }
            None => {
                dev.mul(&mut up, &gate);
                up
            }
            Some(mask) => {
                // act(gate)·up made on the host from the gate and up it holds for the mask (the
                // f32 products the device's `mul` makes), edited by the mask, then handed to the
                // device (the CPU device takes the vector itself; a GPU gets one upload and no
                // launches). A device with memory of its own keeps the host copy for phase 4 and
                // the observer, so nothing is downloaded again.
                let (xh, gh) = scores.get_or_insert_with(fetch);
                let uh = dev.to_host(&up);
                let mut ha: Vec<f32> = uh.iter().zip(gh.iter()).map(|(u, g)| u * g).collect();
                mask.apply(l, xh, gh, &uh, &mut ha);
                if !dev.host_memory() {
                    hact_host = Some(ha.clone());
                }
                dev.upload(n, f, ha)
            }
        };
        if let Some(observe) = hooks.observe {
            let gh = dev.to_host(&gate);
            match &hact_host {
                Some(ha) => observe(l, &gh, ha),
                None => observe(l, &gh, &dev.to_host(&hact)),
            }
        }

        // Phase 4: down over the kept neurons.
        let d = match (streamed, stream) {
            (Some(st), Some(s)) => self.down_streamed(l, w, s, st, &hact, hact_host.as_deref(), on_device)?,
            _ => match &w.down {
                FfnDown::Rows(down) => dev.matmul(&[down], &hact).remove(0),
                FfnDown::Columns(down_t) => {
                    let mut d = dev.zeros(n, h);
                    dev.accumulate_rows(down_t, None, &hact, &mut d);
                    d
                }
            },
        };
        Ok(d)
    }

    /// Phase 2 of a streamed step: up·x `[n, ffn]` for the neurons `need` names, the device's hot
    /// ones from its own copy (`RowStream::hot_rows`) and the rest as the stream hands them
    /// over ([`UpRows`]), the down columns with them when `one_pass` allows (one read batch).
    #[allow(clippy::too_many_arguments)]
    fn up_streamed(
        &self,
        l: usize,
        w: &FfnWeights,
        xn: &Act,
        s: &dyn RowStream,
        decode: bool,
        need: &[bool],
        one_pass: bool,
    ) -> Result<(Act, Streamed)> {
        let dev = &*self.device;
        let (n, f) = (xn.rows, w.gate.rows);
        let hot = s.hot_rows(l);
        let k = hot.map_or(0, |(u, _)| u.rows);
        let mut up_set: Vec<u32> = (0..f as u32).filter(|&i| need[i as usize]).collect();
        let hot_set: Vec<u32> = up_set.drain(..up_set.partition_point(|&i| (i as usize) < k)).collect();
        // The stream is asked for rows unless the hot neurons are all the step needs. A decode
        // step's up rows are read by id, in place, where the device mapped the stream's copy of
        // the layer; else staged as they land (the down columns come in the down phase, for the
        // kept neurons only). Other passes' rows are staged.
        let asks = k == 0 || !up_set.is_empty();
        let (rows, u) = match (asks, decode) {
            (false, _) => (UpRows::HotOnly, None),
            (true, true) => match s.rows_in_place(l, &up_set, false)? {
                Some(all) => {
                    // The stream's rows start after the hot ones: row i = neuron k + i.
                    let ids: Vec<u32> = up_set.iter().map(|&i| i - k as u32).collect();
                    (UpRows::InPlace, Some(dev.matmul_rows(&all, &ids, xn)))
                }
                None => {
                    let up_w = staged_decode_up(dev, s, l, &up_set, one_pass, &w.up)?;
                    (UpRows::StagedDecode, Some(dev.matmul(&[&up_w], xn).remove(0)))
                }
            },
            (true, false) => {
                let (up_w, down) = s.stage(l, &up_set, one_pass)?;
                (UpRows::Staged { down }, Some(dev.matmul(&[&up_w], xn).remove(0)))
            }
        };
        let mut up = match u {
            Some(u) => dev.scatter_cols(&u, &up_set, f),
            None => dev.zeros(n, f),
        };
        if let Some((hot_up, _)) = hot.filter(|_| !hot_set.is_empty()) {
            let u = match hot_set.len() == k {
                true => dev.matmul(&[hot_up], xn).remove(0),
                false => dev.matmul_rows(hot_up, &hot_set, xn),
            };
            dev.add(&mut up, &dev.scatter_cols(&u, &hot_set, f));
        }
        Ok((
            up,
            Streamed {
                up_set,
                hot_set,
                one_pass,
                rows,
            },
        ))
    }

    /// Phase 4 of a streamed step: down over the kept neurons of the hidden activations `hact`
    /// (`hact_host`: the host's copy, where the mask made them there), the device's hot columns
    /// from its own copy and the rest where phase 2's rows say ([`UpRows`], [`DownTail`]).
    /// `on_device`: the device made the activations of exactly the up set.
    #[allow(clippy::too_many_arguments)]
    fn down_streamed(
        &self,
        l: usize,
        w: &FfnWeights,
        s: &dyn RowStream,
        st: Streamed,
        hact: &Act,
        hact_host: Option<&[f32]>,
        on_device: bool,
    ) -> Result<Act> {
        let dev = &*self.device;
        let (n, h, f) = (hact.rows, self.config.hidden, w.gate.rows);
        let hot = s.hot_rows(l);
        let k = hot.map_or(0, |(u, _)| u.rows);
        // The neurons kept: the up set when the mask chose before up and the down columns are
        // at hand with the up rows (staged with them, or in place), else those some token kept.
        // Hot ones first, then the stream's.
        let at_hand = match &st.rows {
            UpRows::HotOnly | UpRows::InPlace => true,
            UpRows::Staged { down } => down.is_some(),
            UpRows::StagedDecode => false,
        };
        let mut kept: Vec<u32> = match st.one_pass && (on_device || at_hand) {
            true => st.hot_set.iter().chain(&st.up_set).copied().collect(),
            false => match hact_host {
                Some(ha) => nonzero_neurons(ha, n, f),
                None => nonzero_neurons(&dev.to_host(hact), n, f),
            },
        };
        let rest = kept.split_off(kept.partition_point(|&i| (i as usize) < k));
        if k > 0 {
            s.count_hot_rows(l, st.hot_set.len(), kept.len());
        }
        let tail = match st.rows {
            UpRows::HotOnly => None,
            UpRows::InPlace if rest.is_empty() => None,
            UpRows::InPlace => Some(DownTail::InPlace(s.rows_in_place(l, &rest, true)?.ok_or_else(
                || {
                    Error::Internal(format!(
                        "layer {l}: the stream held the up rows in place but not the down columns"
                    ))
                },
            )?)),
            UpRows::Staged { down: Some(dw) } => Some(DownTail::Staged(dw)),
            UpRows::Staged { down: None } => Some(DownTail::Staged(s.stage_down(l, &rest, &st.up_set)?)),
            UpRows::StagedDecode => Some(DownTail::Staged(staged_decode_down(dev, s, l, &rest, w.down.weight())?)),
        };
        let mut d = dev.zeros(n, h);
        match (hot, tail) {
            (None, Some(DownTail::InPlace(all))) => dev.accumulate_rows(&all, Some(&rest), hact, &mut d),
            (None, Some(DownTail::Staged(dw))) if !rest.is_empty() => {
                let acts = dev.gather_cols(hact, &rest);
                dev.accumulate_rows(&dw, None, &acts, &mut d);
            }
            (None, _) => {}
            // The hot columns and the stream's summed as one matrix (the result does not depend
            // on where the split falls): rows 0..k the hot ones, then the stream's.
            (Some((_, hot_down)), Some(DownTail::InPlace(tail))) => {
                let ids: Vec<u32> = kept.iter().chain(&rest).copied().collect();
                let ids = (ids.len() < f).then_some(&ids[..]);
                dev.accumulate_rows_joined(hot_down, &tail, ids, hact, &mut d);
            }
            (Some((_, hot_down)), Some(DownTail::Staged(tail))) if !kept.is_empty() || !rest.is_empty() => {
                // The hot activations, then the stream's (all of them when every neuron is
                // handed over: no gather).
                let cols: Vec<u32> = (0..k as u32).chain(rest.iter().copied()).collect();
                let gathered = (cols.len() < f).then(|| dev.gather_cols(hact, &cols));
                let acts = gathered.as_ref().unwrap_or(hact);
                let ids: Vec<u32> = kept.iter().copied().chain(k as u32..(k + rest.len()) as u32).collect();
                let ids = (ids.len() < cols.len()).then_some(&ids[..]);
                dev.accumulate_rows_joined(hot_down, &tail, ids, acts, &mut d);
            }
            (Some((_, hot_down)), None) if !kept.is_empty() => {
                let acts = dev.gather_cols(hact, &(0..k as u32).collect::<Vec<_>>());
                let ids = (kept.len() < k).then_some(&kept[..]);
                dev.accumulate_rows(hot_down, ids, &acts, &mut d);
            }
            (Some(_), _) => {}
        }
        Ok(d)
    }

    /// A hybrid step after phase 1 (`gate` activated, on the device): the neurons the device
    /// keeps (its hot rows) computed there, the rest by the host's CPU from the rows the stream
    /// holds in host memory ([`ColdRows`]); the CPU's partial output crosses the link (`hidden`
    /// floats a token) and is added to the device's. The device's launches are made first, so
    /// a device that queues them computes its share while the CPU computes the other. A mask
    /// (decode) picks the neurons from the input and gate, both brought to the host once.
    fn ffn_hybrid(
        &self,
        l: usize,
        xn: &Act,
        gate: &Act,
        mask: Option<&dyn FfnMask>,
        s: &dyn RowStream,
        cold: ColdRows,
    ) -> Result<Act> {
        let dev = &*self.device;
        let (n, h, f, k) = (xn.rows, self.config.hidden, gate.width, cold.first);
        if let Some((up, down)) = cold.rows.filter(|(u, d)| u.rows != f - k || d.rows != f - k) {
            return Err(Error::Internal(format!(
                "layer {l}: the stream's cold rows ({} up, {} down) are not the {} neurons past the {k} hot ones",
                up.rows,
                down.rows,
                f - k
            )));
        }
        // The one wait on the device a layer: its input and activated gate to the host.
        let (xh, gh) = (dev.to_host(xn).into_owned(), dev.to_host(gate).into_owned());
        let mut need = vec![true; f];
        if let Some(m) = mask {
            m.up_needed(l, &xh, &gh, &mut need);
            m.count_decided(l, need.iter().filter(|&&b| b).count());
        }
        let hot_set: Vec<u32> = (0..k as u32).filter(|&i| need[i as usize]).collect();
        let cold_set: Vec<u32> = (k as u32..f as u32)
            .filter(|&i| need[i as usize])
            .map(|i| i - k as u32)
            .collect();
        // The device's share first (its up rows times the gate), started before the CPU's, so
        // a device that queues its work computes while the CPU does; its down product waits for
        // the CPU's sums and adds them before rounding (one rounding, as one device's product).
        let hot = match (s.hot_rows(l), hot_set.is_empty()) {
            (Some((hot_up, hot_down)), false) => {
                let all = hot_set.len() == k;
                let mut u = match all {
                    true => dev.matmul(&[hot_up], xn).remove(0),
                    false => dev.matmul_rows(hot_up, &hot_set, xn),
                };
                dev.mul(&mut u, &dev.gather_cols(gate, &hot_set));
                let acts = match all {
                    true => u,
                    false => dev.scatter_cols(&u, &hot_set, k),
                };
                s.count_hot_rows(l, hot_set.len(), hot_set.len());
                Some((hot_down, all, acts))
            }
            _ => None,
        };
        dev.launch_pending();
        let sums = match cold_set.is_empty() {
            true => vec![0f64; n * h],
            false => {
                let started = std::time::Instant::now();
                let all = cold_set.len() == f - k;
                let g: Vec<f32> = (0..n)
                    .flat_map(|t| cold_set.iter().map(move |&i| (t, i)))
                    .map(|(t, i)| gh[t * f + k + i as usize])
                    .collect();
                let row_bytes = |w: &Weight| (w.len_bytes() / w.rows.max(1)) as u64;
                let (sums, bytes) = match cold.rows {
                    Some((up, down)) => (
                        cold_ffn(cold.cpu, up, down, (!all).then_some(&cold_set[..]), xh, g, n),
                        row_bytes(up) + row_bytes(down),
                    ),
                    None => {
                        // Staged in set order (row i = the set's i-th neuron), as a dense step's.
                        let ids: Vec<u32> = cold_set.iter().map(|&i| i + k as u32).collect();
                        let (up, down) = s.stage(l, &ids, true)?;
                        let down = down.ok_or_else(|| {
                            Error::Internal(format!(
                                "layer {l}: the stream staged up rows without their down columns"
                            ))
                        })?;
                        (
                            cold_ffn(cold.cpu, &up, &down, None, xh, g, n),
                            row_bytes(&up) + row_bytes(&down),
                        )
                    }
                };
                let bytes = cold_set.len() as u64 * bytes;
                s.count_cold(bytes, started.elapsed().as_nanos() as u64);
                sums
            }
        };
        match hot {
            Some((hot_down, all, acts)) => {
                let mut d = dev.zeros(n, h);
                dev.accumulate_rows_onto(hot_down, (!all).then_some(&hot_set[..]), &acts, sums, &mut d);
                Ok(d)
            }
            None => Ok(dev.upload(n, h, sums.iter().map(|&v| v as f32).collect())),
        }
    }

    /// One token's masked, streamed FFN after phase 1, computed where the bytes are (see the
    /// module docs): the stream hands over up rows (cache hits on one pool thread, misses as
    /// they land on the other), then the kept neurons' down columns likewise. Also makes the
    /// lookahead prediction for the next layer, when the stream reads ahead.
    #[allow(clippy::too_many_arguments)]
    fn ffn_decode_streamed(
        &self,
        l: usize,
        w: &FfnWeights,
        xn: &[f32],
        gate: &[f32],
        mask: &dyn FfnMask,
        hooks: &FfnHooks,
        s: &dyn RowStream,
    ) -> Result<Vec<f32>> {
        let (h, f) = (self.config.hidden, self.config.ffn);
        s.begin_decode(l)?;
        self.predict_next(l, xn, mask, s)?;
        let mut need = vec![false; f];
        mask.up_needed(l, xn, gate, &mut need);
        let one_pass = mask.decides_before_up();
        let up_set: Vec<u32> = (0..f as u32).filter(|&i| need[i as usize]).collect();
        let (up_ty, down_ty) = (w.up.ty, w.down.weight().ty);
        let mut px = PreparedInput::new();
        px.prepare(xn, up_ty);

        // Up: hits and misses on two threads, each writing its own list.
        let mut hit_u: Vec<(u32, f32)> = Vec::new();
        let mut miss_u: Vec<(u32, f32)> = Vec::new();
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

    /// Layer `l`'s normalized FFN input `xn` (one token) as layer `next`'s norm would scale it:
    /// `xn ÷ norm_l × norm_next` (the residual stream changes little from one layer to the next).
    /// What lookahead predicts the next layer's neurons or experts from.
    fn carried_to_next_norm(&self, l: usize, next: usize, xn: &[f32]) -> Vec<f32> {
        let (w_now, w_next) = (&self.weights.layers[l].ffn_norm, &self.weights.layers[next].ffn_norm);
        xn.iter()
            .zip(w_now.iter().zip(w_next))
            .map(|(&v, (&a, &b))| if a != 0.0 { v / a * b } else { 0.0 })
            .collect()
    }

    /// Lookahead: which neurons the next layer will need, from this layer's FFN input carried
    /// over to the next layer's norm (`xn ÷ norm_l × norm_next`: the residual stream changes
    /// little from one layer to the next) and the next layer's resident gate — or, for masks
    /// whose up set does not read the input, exactly — handed to the stream to read ahead.
    fn predict_next(&self, l: usize, xn: &[f32], mask: &dyn FfnMask, s: &dyn RowStream) -> Result<()> {
        let reads_input = mask.up_needed_reads_input();
        let Some((next, gate_next)) = s.lookahead_target(l, reads_input) else {
            return Ok(());
        };
        let (h, f) = (self.config.hidden, self.config.ffn);
        let mut need = vec![false; f];
        match gate_next {
            Some(gate_w) => {
                let x = self.carried_to_next_norm(l, next, xn);
                let dev = &*self.device;
                let x = dev.upload(1, h, x);
                let mut g = dev.matmul(&[gate_w], &x).remove(0);
                dev.activate(&mut g, self.config.activation);
                mask.up_needed(next, &dev.to_host(&x), &dev.to_host(&g), &mut need);
            }
            None => mask.up_needed(next, &[], &[], &mut need),
        }
        s.read_ahead(next, &need, mask.decides_before_up())
    }
}

/// A streamed FFN's rows after phase 2, for phase 4.
struct Streamed {
    /// The up set the stream handed over (past the device's hot neurons), and the hot neurons
    /// of the up set (computed from the device's copy).
    up_set: Vec<u32>,
    hot_set: Vec<u32>,
    /// The mask chose before up (or there is none): the down set is the up set.
    one_pass: bool,
    /// Where the up rows came from, which says where the down columns come from.
    rows: UpRows,
}

/// Where a streamed step's up rows came from (decided once, in phase 2), and so where phase 4
/// finds its down columns.
enum UpRows {
    /// The device's hot neurons were all the step needed: the stream was not asked.
    HotOnly,
    /// A decode step's rows read by id where the device mapped the stream's copy of the layer
    /// (`RowStream::rows_in_place`): the kept neurons' down columns are read there too.
    InPlace,
    /// A decode step's rows staged as they landed: the kept neurons' down columns are staged
    /// the same way.
    StagedDecode,
    /// A pass's rows staged by the stream, with the down columns when one read batch sufficed
    /// (`down`), else the kept neurons' columns staged after.
    Staged { down: Option<Weight> },
}

/// The stream's down columns of the kept neurons past the hot ones, for phase 4.
enum DownTail {
    /// In place: row i is neuron k + i (k hot neurons).
    InPlace(Weight),
    /// Staged: row i is the i-th kept neuron past the hot ones.
    Staged(Weight),
}

/// The neurons (of `f`) some token of the hidden activations `ha` `[n, f]` keeps (non-zero).
fn nonzero_neurons(ha: &[f32], n: usize, f: usize) -> Vec<u32> {
    (0..f as u32)
        .filter(|&i| (0..n).any(|t| ha[t * f + i as usize] != 0.0))
        .collect()
}

/// A decode step's up rows of `set` (sorted) as the stream hands them over (cache hits, reads
/// as they land: [`RowStream::decode_up`]), staged for `dev` in `set`'s order: row i is the
/// set's i-th neuron. `like`: the layer's up matrix (its type and width).
fn staged_decode_up(
    dev: &dyn Device,
    s: &dyn RowStream,
    l: usize,
    set: &[u32],
    with_down: bool,
    like: &Weight,
) -> Result<Weight> {
    let staging = std::sync::Mutex::new(Staging::new(dev, like, set)?);
    s.decode_up(l, set, with_down, &mut |rows| put_each(&staging, rows), &mut |n, r| {
        staging.lock().expect("staging").put(n, r)
    })?;
    staging.into_inner().expect("staging").finish(like)
}

/// A decode step's down columns of the kept neurons `kept` (sorted, a subset of the up set),
/// staged for `dev` in `kept`'s order ([`RowStream::decode_down`]). `like`: the layer's down
/// matrix.
fn staged_decode_down(dev: &dyn Device, s: &dyn RowStream, l: usize, kept: &[u32], like: &Weight) -> Result<Weight> {
    let staging = std::sync::Mutex::new(Staging::new(dev, like, kept)?);
    s.decode_down(
        l,
        &|n| kept.binary_search(&n).is_ok(),
        &mut |rows, _| put_each(&staging, rows),
        &mut |n, r| staging.lock().expect("staging").put(n, r),
    )?;
    staging.into_inner().expect("staging").finish(like)
}

/// Stages `rows` (the rows the stream holds in memory, handed over at once) a batch of one
/// chunk's rows at a time under the lock, so the thread handing over rows as they land waits at
/// most one batch; each batch's copies are spread over the pool's threads (a step's rows from a
/// cache holding the layer are hundreds of megabytes: one thread's copy was most of the step).
fn put_each(staging: &std::sync::Mutex<Staging<'_>>, rows: &[(u32, &[u8])]) {
    let batch = staging.lock().expect("staging").chunk_rows;
    for b in rows.chunks(batch.max(1)) {
        staging.lock().expect("staging").put_many(b);
    }
}

/// Rows of a sorted neuron set copied into place in the device's staging buffer as the stream
/// hands them over (the cache's on one pool thread, reads as they land on the other: hence the
/// callers' lock), row i = the set's i-th neuron; every neuron must come exactly once, with a
/// row of the matrix's length. The set is cut into chunks of whole rows, about
/// [`HostLink::upload_chunk_bytes`] each; a chunk goes to the
/// device ([`Upload::send`]) the moment its last row lands, so its copy overlaps the reads
/// still in flight for the others.
struct Staging<'a> {
    set: &'a [u32],
    row_bytes: usize,
    upload: Box<dyn Upload>,
    filled: Vec<bool>,
    chunk_rows: usize,
    /// Rows each chunk still waits for.
    missing: Vec<usize>,
    /// The first row that did not fit (kept to report after the stream's call returns).
    wrong: Option<String>,
}

impl<'a> Staging<'a> {
    fn new(dev: &dyn Device, like: &Weight, set: &'a [u32]) -> Result<Staging<'a>> {
        let row_bytes = like.ty.row_bytes(like.cols).ok_or_else(|| {
            Error::Internal(format!(
                "{}: {} values do not fill whole {:?} blocks",
                like.name, like.cols, like.ty
            ))
        })?;
        let chunk_rows = (dev.upload_chunk_bytes() / row_bytes.max(1)).max(1);
        let missing = (0..set.len().div_ceil(chunk_rows))
            .map(|c| chunk_rows.min(set.len() - c * chunk_rows))
            .collect();
        Ok(Staging {
            set,
            row_bytes,
            upload: dev.begin_upload(set.len() * row_bytes),
            filled: vec![false; set.len()],
            chunk_rows,
            missing,
            wrong: None,
        })
    }

    fn put(&mut self, n: u32, row: &[u8]) {
        if let Some(i) = self.claim(n, row) {
            let rb = self.row_bytes;
            self.upload.bytes_mut()[i * rb..(i + 1) * rb].copy_from_slice(row);
            self.written(i);
        }
    }

    /// [`Staging::put`] for many rows: each place claimed, the copies run in parallel, then the
    /// chunks they complete are sent.
    fn put_many(&mut self, rows: &[(u32, &[u8])]) {
        let rb = self.row_bytes;
        let mut places: Vec<(usize, &[u8])> = rows.iter().filter_map(|&(n, r)| Some((self.claim(n, r)?, r))).collect();
        places.sort_unstable_by_key(|p| p.0);
        {
            // Disjoint destinations, taken in order from the buffer's rows.
            let mut rest = self.upload.bytes_mut().chunks_exact_mut(rb);
            let mut next = 0;
            let mut copies: Vec<(&mut [u8], &[u8])> = Vec::with_capacity(places.len());
            for &(i, r) in &places {
                let d = rest.nth(i - next).expect("a claimed row lies inside the staging");
                next = i + 1;
                copies.push((d, r));
            }
            copies
                .par_iter_mut()
                .with_min_len(64)
                .for_each(|(d, r)| d.copy_from_slice(r));
        }
        for &(i, _) in &places {
            self.written(i);
        }
    }

    /// The place of neuron `n`'s row, marked filled; `None` (the first such row kept to report)
    /// for a neuron not in the set or handed over twice, or a row of the wrong length.
    fn claim(&mut self, n: u32, row: &[u8]) -> Option<usize> {
        let rb = self.row_bytes;
        match self.set.binary_search(&n) {
            Ok(i) if !self.filled[i] && row.len() == rb => {
                self.filled[i] = true;
                Some(i)
            }
            _ => {
                self.wrong.get_or_insert_with(|| {
                    format!(
                        "the stream handed over a row of {} bytes for neuron {n} (rows are {rb} bytes; not asked for, or twice)",
                        row.len()
                    )
                });
                None
            }
        }
    }

    /// Row `i` is written: its chunk goes to the device if that was its last row.
    fn written(&mut self, i: usize) {
        let c = i / self.chunk_rows;
        self.missing[c] -= 1;
        if self.missing[c] == 0 {
            let end = ((c + 1) * self.chunk_rows).min(self.set.len());
            let rb = self.row_bytes;
            self.upload.send(c * self.chunk_rows * rb, end * rb);
        }
    }

    /// The staged rows as a volatile weight of `like`'s type and width.
    fn finish(self, like: &Weight) -> Result<Weight> {
        if let Some(w) = self.wrong {
            return Err(Error::Internal(format!("{}: {w}", like.name)));
        }
        if let Some(i) = self.filled.iter().position(|&f| !f) {
            return Err(Error::Internal(format!(
                "{}: the stream did not hand over neuron {}'s row",
                like.name, self.set[i]
            )));
        }
        Weight::staged(&like.name, like.ty, self.set.len(), like.cols, self.upload.finish())
    }
}

/// gpt-oss's clamped SwiGLU of one neuron (ggml's `swiglu_oai` with llama.cpp's alpha 1.702
/// and limit 7): the gate clamped above at 7, up to ±7, `g · sigmoid(1.702 g) · (u + 1)`, in
/// ggml's operation order.
#[inline]
pub fn swiglu_oai(gate: f32, up: f32) -> f32 {
    const ALPHA: f32 = 1.702;
    const LIMIT: f32 = 7.0;
    let x = gate.min(LIMIT);
    let y = up.clamp(-LIMIT, LIMIT);
    x / (1.0 + (ALPHA * -x).exp()) * (y + 1.0)
}

/// The router's logits `[n, n_experts]` with the layer's router bias added (gpt-oss's
/// `ffn_gate_inp.bias`); as they are without one.
fn with_router_bias<'a>(logits: std::borrow::Cow<'a, [f32]>, e: &ExpertWeights) -> std::borrow::Cow<'a, [f32]> {
    match &e.biases {
        None => logits,
        Some(b) => {
            let mut l = logits.into_owned();
            for row in l.chunks_exact_mut(b.router.len()) {
                row.iter_mut().zip(&b.router).for_each(|(v, b)| *v += b);
            }
            l.into()
        }
    }
}

/// Per token, the experts chosen from the router's logits `[n, n_experts]`: `n_used` entries
/// `(expert, weight)` each, best first, as llama.cpp's `build_moe_ffn` computes them in f32:
/// scores by the gating function (softmax over the row, or each logit's sigmoid); `bias` (the
/// score bias, `exp_probs_b`) added to the scores for choosing only; grouped routing keeps the
/// `groups_used` groups whose two best biased scores sum highest (others out of the choice); the
/// `n_used` highest (ties to the lower index) chosen; their unbiased scores are the weights,
/// renormalized (sum clamped to 2^-14) where the model says so, then times `routed_scale`. With
/// [`MoeConfig::softmax_after_topk`] (gpt-oss) the largest logits are chosen and weighted by the
/// softmax over them alone.
pub fn route(logits: &[f32], moe: &MoeConfig, bias: Option<&[f32]>) -> Vec<(usize, f32)> {
    let ne = moe.n_experts;
    let mut out = Vec::with_capacity(logits.len() / ne.max(1) * moe.n_used);
    let mut order: Vec<usize> = Vec::with_capacity(ne);
    let mut select = vec![0f32; ne];
    for row in logits.chunks_exact(ne) {
        if moe.softmax_after_topk {
            order.clear();
            order.extend(0..ne);
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let mut w: Vec<f32> = order[..moe.n_used].iter().map(|&e| row[e]).collect();
            crate::backend::ops::softmax(&mut w);
            out.extend(order[..moe.n_used].iter().copied().zip(w));
            continue;
        }
        let mut probs = row.to_vec();
        match moe.gating {
            Gating::Softmax => crate::backend::ops::softmax(&mut probs),
            Gating::Sigmoid => probs.iter_mut().for_each(|p| *p = 1.0 / (1.0 + (-*p).exp())),
        }
        select.copy_from_slice(&probs);
        if let Some(b) = bias {
            select.iter_mut().zip(b).for_each(|(s, b)| *s += b);
        }
        if moe.grouped() {
            let per = ne / moe.n_groups;
            let group_score = |g: usize| {
                let s = &select[g * per..(g + 1) * per];
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &v in s {
                    if v > a {
                        (a, b) = (v, a);
                    } else if v > b {
                        b = v;
                    }
                }
                if per < 2 {
                    a
                } else {
                    a + b
                }
            };
            let scores: Vec<f32> = (0..moe.n_groups).map(group_score).collect();
            let mut groups: Vec<usize> = (0..moe.n_groups).collect();
            groups.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
            for &g in &groups[moe.groups_used..] {
                select[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
            }
        }
        order.clear();
        order.extend(0..ne);
        order.sort_by(|&a, &b| select[b].total_cmp(&select[a]).then(a.cmp(&b)));
        let chosen = &order[..moe.n_used];
        let norm = if moe.normalize {
            1.0 / chosen.iter().map(|&e| probs[e]).sum::<f32>().max(6.103_515_6e-5)
        } else {
            1.0
        };
        out.extend(chosen.iter().map(|&e| {
            let w = if moe.normalize { probs[e] * norm } else { probs[e] };
            (
                e,
                if moe.routed_scale != 1.0 {
                    w * moe.routed_scale
                } else {
                    w
                },
            )
        }));
    }
    out
}

/// A whole FFN (an expert) on the CPU `cpu` for `x` `[n, hidden]`: `down · (act(gate·x) ·
/// up·x)`, as the in-RAM model computes it (gate and up from one prepared input, the gated
/// activation in one operation). Returns `[n, hidden]`.
pub fn host_ffn(cpu: &CpuBackend, w: &FfnWeights, x: Vec<f32>, n: usize, act: FfnActivation) -> Vec<f32> {
    let xa = cpu.upload(n, w.gate.cols, x);
    let mut gu = cpu.matmul(&[&w.gate, &w.up], &xa);
    let mut up = gu.pop().expect("up");
    let mut gate = gu.pop().expect("gate");
    cpu.activate_mul(&mut up, &mut gate, act);
    let d = match &w.down {
        FfnDown::Rows(down) => cpu.matmul(&[down], &up).remove(0),
        FfnDown::Columns(down_t) => {
            let mut d = cpu.zeros(n, down_t.cols);
            cpu.accumulate_rows(down_t, None, &up, &mut d);
            d
        }
    };
    cpu.download(d)
}

/// The cold share of a hybrid FFN on the CPU `cpu`: `down · (gate ⊙ up·x)` over the neurons
/// `set` of the neuron-major `up` and `down` (row ids; every row when `None`), for `x`
/// `[n, hidden]` and the activated `gate` `[n, set.len()]` (or `[n, up.rows]`). Returns the
/// `[n, hidden]` partial output as its f64 sums, for the device to round once with its own
/// share ([`Device::accumulate_rows_onto`]).
pub fn cold_ffn(
    cpu: &CpuBackend,
    up: &Weight,
    down: &Weight,
    set: Option<&[u32]>,
    x: Vec<f32>,
    gate: Vec<f32>,
    n: usize,
) -> Vec<f64> {
    let xa = cpu.upload(n, up.cols, x);
    let (mut u, m) = match set {
        None => (cpu.matmul(&[up], &xa).remove(0), up.rows),
        Some(s) => (cpu.matmul_rows(up, s, &xa), s.len()),
    };
    cpu.mul(&mut u, &cpu.upload(n, m, gate));
    let acts = match set {
        None => u,
        Some(s) => cpu.scatter_cols(&u, s, up.rows),
    };
    let mut sums = vec![0f64; n * down.cols];
    cpu.accumulate_rows_f64(down, set, &cpu.download(acts), &mut sums);
    sums
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::standin::HostStandIn;
    use crate::quant::GgmlType;

    /// One case per row of [`ffn_path`]'s table, and the cases beside each row that fall to
    /// the next.
    #[test]
    fn the_ffn_path_is_the_first_row_of_its_table_that_holds() {
        let gate_mask = MaskFacts {
            from_input: true,
            before_up: true,
        };
        let late_mask = MaskFacts {
            from_input: false,
            before_up: false,
        };
        let facts = |streamed, host_memory, tokens, mask, observed, cold| FfnFacts {
            streamed,
            host_memory,
            tokens,
            mask,
            observed,
            cold,
        };
        use FfnPath::*;
        let rows = [
            // Not streamed: in RAM, whatever else holds.
            (facts(false, true, 1, Some(gate_mask), true, Some(true)), InRam),
            (facts(false, false, 8, None, false, Some(true)), InRam),
            // Hybrid: a device of its own, cold rows planned; a mask only on one token deciding
            // from the input before up, with the rows held on the host.
            (facts(true, false, 8, None, false, Some(false)), Hybrid),
            (facts(true, false, 1, Some(gate_mask), false, Some(true)), Hybrid),
            (facts(true, false, 1, Some(gate_mask), false, Some(false)), InPlace),
            (facts(true, false, 1, Some(late_mask), false, Some(true)), InPlace),
            (facts(true, false, 8, Some(gate_mask), false, Some(true)), Staged),
            (facts(true, false, 8, None, true, Some(true)), Staged),
            (facts(true, false, 8, None, false, None), Staged),
            // On the CPU device: a masked decode step computes rows where they land.
            (facts(true, true, 1, Some(gate_mask), false, Some(true)), DecodeOnHost),
            (facts(true, true, 1, Some(late_mask), true, None), DecodeOnHost),
            (facts(true, true, 1, None, false, None), Staged),
            (facts(true, true, 4, Some(gate_mask), false, None), Staged),
            // A device of its own, a masked decode step without the hybrid: in place.
            (facts(true, false, 1, Some(late_mask), true, None), InPlace),
        ];
        for (f, want) in rows {
            assert_eq!(ffn_path(&f), want, "{f:?}");
        }
    }

    /// An F32 matrix of 10 rows of 4 values (16-byte rows); row r's values are r*4 .. r*4+3.
    fn matrix() -> Weight {
        let bytes: Vec<u8> = (0..40).flat_map(|i| (i as f32).to_le_bytes()).collect();
        Weight::owned("blk.0.ffn_up.weight", GgmlType::F32, 10, 4, bytes).unwrap()
    }

    #[test]
    fn staging_sends_each_chunk_once_when_its_last_row_lands() {
        let like = matrix();
        // Chunks of 3 rows (48 bytes) over a set of 7 neurons: 3 + 3 + 1 rows.
        let dev = HostStandIn::new(1).with_upload_chunk_bytes(48);
        let set = [0u32, 2, 3, 5, 6, 8, 9];
        let mut st = Staging::new(&dev, &like, &set).unwrap();
        // Rows land out of order (cache hits, then reads as they complete).
        let mut chunks_after = Vec::new();
        for n in [9u32, 5, 0, 8, 3, 2, 6] {
            st.put(n, like.row(n as usize));
            chunks_after.push(dev.upload_counters().chunks);
        }
        // 9 completes the 1-row chunk {9}; 2 completes {0, 2, 3}; 6 completes {5, 6, 8}.
        assert_eq!(chunks_after, [1, 1, 1, 1, 1, 2, 3]);
        let w = st.finish(&like).unwrap();
        assert!(w.is_volatile());
        for (i, &n) in set.iter().enumerate() {
            assert_eq!(w.row(i), like.row(n as usize), "row {i}");
        }
        let c = dev.upload_counters();
        assert_eq!((c.chunks, c.early_chunks, c.sent_bytes), (3, 2, 7 * 16));
        // The product computes from the chunks as sent, without a protocol error.
        let x = dev.upload(1, 4, vec![1.0, 0.5, 0.25, 0.125]);
        let got = dev.download(dev.matmul(&[&w], &x).remove(0));
        let want: Vec<f32> = set
            .iter()
            .map(|&n| {
                (0..4)
                    .map(|j| (n * 4 + j) as f32 * [1.0, 0.5, 0.25, 0.125][j as usize])
                    .sum()
            })
            .collect();
        assert_eq!(got, want);
        assert!(dev.take_error().is_none());
    }

    #[test]
    fn staging_many_rows_at_once_matches_one_at_a_time_and_refuses_the_same() {
        let like = matrix();
        let dev = HostStandIn::new(1).with_upload_chunk_bytes(48);
        let set = [0u32, 2, 3, 5, 6, 8, 9];
        let mut st = Staging::new(&dev, &like, &set).unwrap();
        // Hits in a batch (out of order, one twice, one not in the set), then a row as it lands.
        let rows: Vec<(u32, &[u8])> = [6u32, 0, 2, 3, 8, 9, 0, 7]
            .iter()
            .map(|&n| (n, like.row(n as usize)))
            .collect();
        st.put_many(&rows);
        // {0, 2, 3} and {9} are complete; {5, 6, 8} waits for 5.
        assert_eq!(dev.upload_counters().chunks, 2);
        st.put(5, like.row(5));
        assert_eq!(dev.upload_counters().chunks, 3);
        // The duplicate 0 is reported (the first wrong row); every place holds its neuron's row.
        let e = st.finish(&like).err().unwrap().to_string();
        assert!(e.contains("neuron 0") && e.contains("twice"), "{e}");
        let mut st = Staging::new(&dev, &like, &set).unwrap();
        let rows: Vec<(u32, &[u8])> = set.iter().rev().map(|&n| (n, like.row(n as usize))).collect();
        st.put_many(&rows[..4]);
        st.put_many(&rows[4..]);
        let w = st.finish(&like).unwrap();
        for (i, &n) in set.iter().enumerate() {
            assert_eq!(w.row(i), like.row(n as usize), "row {i}");
        }
        let mut st = Staging::new(&dev, &like, &set).unwrap();
        st.put_many(&[(2, &like.row(2)[..8])]);
        assert!(st
            .finish(&like)
            .err()
            .unwrap()
            .to_string()
            .contains("row of 8 bytes for neuron 2"));
    }

    #[test]
    fn staging_refuses_a_missing_row_and_a_row_of_the_wrong_length() {
        let like = matrix();
        let dev = HostStandIn::new(1).with_upload_chunk_bytes(48);
        let set = [1u32, 4];
        let mut st = Staging::new(&dev, &like, &set).unwrap();
        st.put(1, like.row(1));
        let e = st.finish(&like).err().unwrap().to_string();
        assert!(e.contains("did not hand over neuron 4"), "{e}");
        let mut st = Staging::new(&dev, &like, &set).unwrap();
        st.put(1, like.row(1));
        st.put(4, &like.row(4)[..8]);
        st.put(7, like.row(7));
        let e = st.finish(&like).err().unwrap().to_string();
        assert!(e.contains("row of 8 bytes for neuron 4"), "{e}");
        // Neither staging sent its incomplete chunk; each buffer went back to the pool and was
        // handed out again.
        assert_eq!(dev.upload_counters().chunks, 0);
        let _third = Staging::new(&dev, &like, &set).unwrap();
        assert_eq!(dev.upload_counters().reused, 2);
    }
}
