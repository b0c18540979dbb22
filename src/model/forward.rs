//! The forward pass: embeddings, per-layer attention with a KV cache and the gated FFN, final
//! norm and logits. One code path serves batched prefill (many tokens at once, each weight read
//! once per batch) and decode (one token). The FFN can be computed over a subset of neurons
//! (`FfnNeurons`), the seam the sparse streaming path builds on.

use rayon::prelude::*;

use crate::backend::ops::{attend, gelu_tanh, rms_norm, rope_apply, rope_table, silu};
use crate::error::{Error, Result};
use crate::model::config::{FfnActivation, ModelConfig};
use crate::model::weights::{FfnDown, LayerWeights, Weight};
use crate::model::Model;
use crate::quant::PreparedInput;

/// Which FFN neurons to compute. `All` is the dense model; `Subset` computes gate and up only
/// for the listed neurons and treats the others as exactly zero.
#[derive(Clone, Copy, Debug)]
pub enum FfnNeurons<'a> {
    All,
    Subset(&'a [u32]),
}

/// `(layer, act(gate), act(gate)·up)` — see [`FfnHooks::observe`].
pub type FfnObserver<'a> = &'a (dyn Fn(usize, &[f32], &[f32]) + Sync);

/// Per-layer control over the FFN: which neurons to compute, and an observer that sees the
/// activations (calibration collects statistics through it).
pub struct FfnHooks<'a> {
    /// `(layer, n_tokens)` → the neurons to compute for that layer.
    pub select: &'a (dyn Fn(usize, usize) -> FfnNeurons<'a> + Sync),
    /// `(layer, act(gate), act(gate)·up)`, both `[n_tokens, ffn]`, after a layer's FFN hidden
    /// activations are computed (neurons not computed are zero).
    pub observe: Option<FfnObserver<'a>>,
    /// Chooses which of the computed neurons count, after gate and up are known.
    pub mask: Option<&'a dyn FfnMask>,
}

impl FfnHooks<'_> {
    /// The dense model: every neuron, no observer, no mask.
    pub fn dense() -> FfnHooks<'static> {
        FfnHooks {
            select: &|_, _| FfnNeurons::All,
            observe: None,
            mask: None,
        }
    }
}

/// A neuron selection made after phase 1 (gate, and up where the criterion needs it): it zeroes
/// the hidden activations of the neurons it drops, which then contribute nothing to down.
pub trait FfnMask: Sync {
    /// `xn`: the normalized FFN input `[n, hidden]`; `gate`: act(gate·x) `[n, ffn]`; `up`: up·x
    /// `[n, ffn]`; `hact`: act(gate)·up `[n, ffn]`, to be edited in place.
    fn apply(&self, layer: usize, xn: &[f32], gate: &[f32], up: &[f32], hact: &mut [f32]);
}

/// Which positions of a batch need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every position from this index of the batch on (perplexity scores half a window).
    From(usize),
}

/// Keys and values of every layer for positions `0..len`, f32, `[pos][kv_dim]` per layer.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    kv_dim: usize,
    pub capacity: usize,
    pub len: usize,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig, capacity: usize) -> KvCache {
        let kv_dim = cfg.kv_dim();
        let per_layer = capacity * kv_dim;
        KvCache {
            k: (0..cfg.n_layers).map(|_| vec![0.0; per_layer]).collect(),
            v: (0..cfg.n_layers).map(|_| vec![0.0; per_layer]).collect(),
            kv_dim,
            capacity,
            len: 0,
        }
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    pub fn bytes(&self) -> usize {
        2 * self.k.len() * self.capacity * self.kv_dim * 4
    }
}

/// Prepare one activation vector per token for dot products with `w`.
fn prepare_all(xs: &[f32], width: usize, w: &Weight, out: &mut Vec<PreparedInput>) {
    let n = xs.len() / width;
    out.resize_with(n, PreparedInput::new);
    for (t, p) in out.iter_mut().enumerate() {
        p.prepare(&xs[t * width..(t + 1) * width], w.ty);
    }
}

fn add_bias(out: &mut [f32], bias: &Option<Vec<f32>>) {
    if let Some(b) = bias {
        for row in out.chunks_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
        }
    }
}

impl Model {
    /// Run `tokens` at positions `cache.len..`, append their keys/values to the cache, and return
    /// logits `[n, vocab]` for the positions `which` selects.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, which: Logits) -> Result<Vec<f32>> {
        self.forward_with(tokens, cache, which, &FfnHooks::dense())
    }

    /// As `forward`, with per-layer FFN hooks.
    pub fn forward_with(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        which: Logits,
        hooks: &FfnHooks,
    ) -> Result<Vec<f32>> {
        // Run the whole pass on the backend's threads: the many parallel loops inside it then
        // start from a pool thread, which joins the work directly, instead of parking the
        // caller's thread on a lock for every matrix (that cost ~10% of decode time).
        self.cpu.install(|| self.forward_in_pool(tokens, cache, which, hooks))
    }

    fn forward_in_pool(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        which: Logits,
        hooks: &FfnHooks,
    ) -> Result<Vec<f32>> {
        let cfg = &self.config;
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        if cache.len + n > cache.capacity {
            return Err(Error::Invalid(format!(
                "context full: {} cached + {n} new tokens exceed the {} positions allocated (raise --ctx)",
                cache.len, cache.capacity
            )));
        }
        let h = cfg.hidden;
        let mut x = vec![0f32; n * h];
        for (t, &tok) in tokens.iter().enumerate() {
            if tok as usize >= cfg.vocab {
                return Err(Error::Invalid(format!(
                    "token id {tok} is outside the vocabulary of {}",
                    cfg.vocab
                )));
            }
            let row = &mut x[t * h..(t + 1) * h];
            self.weights.token_embd.dequantize_row(tok as usize, row);
            if cfg.embed_scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= cfg.embed_scale);
            }
        }
        let mut prep = Vec::new();
        for (l, layer) in self.weights.layers.iter().enumerate() {
            self.attention_block(l, layer, &mut x, cache, &mut prep);
            self.ffn_block(l, layer, &mut x, &mut prep, hooks);
        }
        cache.len += n;
        let first = match which {
            Logits::Last => n - 1,
            Logits::From(i) => i.min(n - 1),
        };
        let mut xo = x[first * h..].to_vec();
        for row in xo.chunks_mut(h) {
            rms_norm(row, &self.weights.output_norm, cfg.rms_eps);
        }
        let out_w = &self.weights.output;
        prepare_all(&xo, h, out_w, &mut prep);
        let mut logits = vec![0f32; (n - first) * cfg.vocab];
        self.backend.matmul(out_w, &prep, &mut logits);
        if let Some(cap) = cfg.final_logit_softcap {
            logits.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
        Ok(logits)
    }

    fn attention_block(
        &self,
        l: usize,
        w: &LayerWeights,
        x: &mut [f32],
        cache: &mut KvCache,
        prep: &mut Vec<PreparedInput>,
    ) {
        let cfg = &self.config;
        let (h, qd, kvd, hd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let n = x.len() / h;
        let mut xn = x.to_vec();
        for row in xn.chunks_mut(h) {
            rms_norm(row, &w.attn_norm, cfg.rms_eps);
        }
        let mut q = vec![0f32; n * qd];
        let mut k = vec![0f32; n * kvd];
        let mut v = vec![0f32; n * kvd];
        // Q, K and V usually share a type; prepare once per distinct type.
        prepare_all(&xn, h, &w.wq, prep);
        self.backend.matmul(&w.wq, prep, &mut q);
        if w.wk.ty != w.wq.ty {
            prepare_all(&xn, h, &w.wk, prep);
        }
        self.backend.matmul(&w.wk, prep, &mut k);
        if w.wv.ty != w.wk.ty {
            prepare_all(&xn, h, &w.wv, prep);
        }
        self.backend.matmul(&w.wv, prep, &mut v);
        add_bias(&mut q, &w.bq);
        add_bias(&mut k, &w.bk);
        add_bias(&mut v, &w.bv);

        let local = cfg.layer_is_local(l);
        let (base, pos_scale) = if local {
            (cfg.rope_theta_local, 1.0)
        } else {
            (cfg.rope_theta, cfg.rope_scale_global)
        };
        let mut table = Vec::with_capacity(hd / 2);
        for t in 0..n {
            rope_table(cache.len + t, hd, base, pos_scale, &mut table);
            for head in q[t * qd..(t + 1) * qd].chunks_mut(hd) {
                if let Some(qn) = &w.q_norm {
                    rms_norm(head, qn, cfg.rms_eps);
                }
                rope_apply(head, &table, cfg.rope_style);
            }
            for head in k[t * kvd..(t + 1) * kvd].chunks_mut(hd) {
                if let Some(kn) = &w.k_norm {
                    rms_norm(head, kn, cfg.rms_eps);
                }
                rope_apply(head, &table, cfg.rope_style);
            }
        }
        let start = cache.len;
        cache.k[l][start * kvd..(start + n) * kvd].copy_from_slice(&k);
        cache.v[l][start * kvd..(start + n) * kvd].copy_from_slice(&v);

        // Attention per (token, head), causal, optionally within a sliding window.
        let window = if local { cfg.sliding_window } else { None };
        let group = cfg.n_heads / cfg.n_kv_heads;
        let (kc, vc) = (&cache.k[l], &cache.v[l]);
        let mut attn = vec![0f32; n * qd];
        let scale = cfg.attn_scale;
        self.cpu.install(|| {
            attn.par_chunks_mut(hd)
                .enumerate()
                .for_each_init(Vec::new, |scores, (i, out)| {
                    let (t, head) = (i / cfg.n_heads, i % cfg.n_heads);
                    let pos = start + t;
                    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    let qh = &q[t * qd + head * hd..t * qd + (head + 1) * hd];
                    attend(qh, kc, vc, kvd, (head / group) * hd, first..pos + 1, scale, scores, out);
                })
        });
        prepare_all(&attn, qd, &w.wo, prep);
        let mut o = vec![0f32; n * h];
        self.backend.matmul(&w.wo, prep, &mut o);
        if let Some(pn) = &w.post_attn_norm {
            for row in o.chunks_mut(h) {
                rms_norm(row, pn, cfg.rms_eps);
            }
        }
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
    }

    fn ffn_block(&self, l: usize, w: &LayerWeights, x: &mut [f32], prep: &mut Vec<PreparedInput>, hooks: &FfnHooks) {
        let cfg = &self.config;
        let (h, f) = (cfg.hidden, cfg.ffn);
        let n = x.len() / h;
        let neurons = (hooks.select)(l, n);
        let mut xn = x.to_vec();
        for row in xn.chunks_mut(h) {
            rms_norm(row, &w.ffn_norm, cfg.rms_eps);
        }
        let act = |g: f32| match cfg.activation {
            FfnActivation::Silu => silu(g),
            FfnActivation::GeluTanh => gelu_tanh(g),
        };
        // act(gate·x) and up·x, [n, ffn]; neurons not computed stay exactly zero.
        let mut gate = vec![0f32; n * f];
        let mut up = vec![0f32; n * f];
        prepare_all(&xn, h, &w.ffn_gate, prep);
        match neurons {
            FfnNeurons::All => {
                self.backend.matmul(&w.ffn_gate, prep, &mut gate);
                if w.ffn_up.ty != w.ffn_gate.ty {
                    prepare_all(&xn, h, &w.ffn_up, prep);
                }
                self.backend.matmul(&w.ffn_up, prep, &mut up);
                gate.iter_mut().for_each(|g| *g = act(*g));
            }
            FfnNeurons::Subset(rows) => {
                let m = rows.len();
                let mut g = vec![0f32; n * m];
                let mut u = vec![0f32; n * m];
                self.backend.matmul_rows(&w.ffn_gate, rows, prep, &mut g);
                if w.ffn_up.ty != w.ffn_gate.ty {
                    prepare_all(&xn, h, &w.ffn_up, prep);
                }
                self.backend.matmul_rows(&w.ffn_up, rows, prep, &mut u);
                for t in 0..n {
                    for (i, &r) in rows.iter().enumerate() {
                        gate[t * f + r as usize] = act(g[t * m + i]);
                        up[t * f + r as usize] = u[t * m + i];
                    }
                }
            }
        }
        // Hidden activations act(gate)·up (in place of up unless a mask needs up itself).
        let hact = match hooks.mask {
            None => {
                up.iter_mut().zip(&gate).for_each(|(u, g)| *u *= g);
                up
            }
            Some(mask) => {
                let mut hact: Vec<f32> = up.iter().zip(&gate).map(|(u, g)| u * g).collect();
                mask.apply(l, &xn, &gate, &up, &mut hact);
                hact
            }
        };
        if let Some(observe) = hooks.observe {
            observe(l, &gate, &hact);
        }
        let mut d = vec![0f32; n * h];
        match &w.ffn_down {
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
        }
        if let Some(pn) = &w.post_ffn_norm {
            for row in d.chunks_mut(h) {
                rms_norm(row, pn, cfg.rms_eps);
            }
        }
        x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
    }
}
