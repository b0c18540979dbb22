//! The forward pass: embeddings, per-layer attention with a KV cache and the gated FFN, final
//! norm and logits. One code path serves batched prefill (many tokens at once, each weight read
//! once per batch) and decode (one token). The FFN can be computed over a subset of neurons
//! (`FfnNeurons`), the seam the sparse streaming path builds on.

use rayon::prelude::*;

use crate::backend::ops::{attend, rms_norm, rope_apply, rope_table};
use crate::error::{Error, Result};
use crate::model::batch::{Batch, Logits};
use crate::model::kv::KvCache;
use crate::model::weights::LayerWeights;
use crate::model::Model;
use crate::quant::PreparedInput;
use crate::tensor::Weight;

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
    /// Weights read from disk while the pass runs (the streaming path); `None` is the in-RAM model.
    pub stream: Option<&'a dyn LayerStream>,
}

/// The attention matrices of one layer.
#[derive(Clone)]
pub struct AttnWeights {
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
}

/// The weight provider of the streaming path: what the forward pass asks for instead of reading
/// resident weights. It hands bytes over (views, staged rows, rows as their reads land) and
/// never computes: the arithmetic is `model::ffn`'s. Implemented by `stream::Streamer`; each
/// method may block on reads.
pub trait LayerStream: Sync {
    /// Writes token `tok`'s embedding row (dequantized, unscaled) into `out`, or returns
    /// `Ok(false)` to use the resident embedding matrix.
    fn embedding(&self, tok: u32, out: &mut [f32]) -> Result<bool>;
    /// Layer `l`'s attention matrices when they are streamed, or `None` when resident. Called in
    /// layer order; an implementation may start reading later layers' weights meanwhile.
    fn attention(&self, l: usize) -> Result<Option<AttnWeights>>;
    /// Whether the FFN's rows come from this stream (its `gate`, `stage*`, `decode_*`); `false`:
    /// from the model's own matrices.
    fn streams_ffn(&self) -> bool {
        false
    }
    /// Layer `l`'s gate matrix when the stream holds it (a resident copy, or the view of the
    /// bytes prefetched with the layer); `None`: the model's own.
    fn gate(&self, _l: usize) -> Result<Option<Weight>> {
        Ok(None)
    }
    /// Stages the up rows of `up_set` (sorted) and, when `with_down`, their down columns: row
    /// i of each returned matrix is the set's i-th neuron. The cache serves what it holds.
    fn stage(&self, l: usize, _up_set: &[u32], _with_down: bool) -> Result<(Weight, Option<Weight>)> {
        Err(no_rows(l))
    }
    /// Stages the down columns of `down_set` (sorted); `staged_up`: the up set the last `stage`
    /// staged (neurons now read whole go to the cache).
    fn stage_down(&self, l: usize, _down_set: &[u32], _staged_up: &[u32]) -> Result<Weight> {
        Err(no_rows(l))
    }
    /// A decode step (one token) starts layer `l`'s FFN: the lookahead read for it, if any, is
    /// waited for.
    fn begin_decode(&self, _l: usize) -> Result<()> {
        Ok(())
    }
    /// Where a lookahead prediction made at layer `l` goes: the next layer (the next token's
    /// first after the last, when the mask's up set does not read the input) and, when
    /// `reads_input`, its resident gate to predict with; `None`: no lookahead there.
    fn lookahead_target(&self, _l: usize, _reads_input: bool) -> Option<(usize, Option<Weight>)> {
        None
    }
    /// Reads the rows of the neurons `need` predicts for `layer` (with their down columns when
    /// `with_down`) ahead, on the lookahead reader.
    fn read_ahead(&self, _layer: usize, _need: &[bool], _with_down: bool) -> Result<()> {
        Ok(())
    }
    /// A decode step's up rows where they are: `available` gets every row the cache holds
    /// (on one pool thread) while `landed` gets each missed row as its read completes (on the
    /// other), so reading overlaps computing; `with_down` reads the misses' down columns in
    /// the same batch (kept for `decode_down`).
    fn decode_up(
        &self,
        l: usize,
        _up_set: &[u32],
        _with_down: bool,
        _available: &mut (dyn FnMut(&[(u32, &[u8])]) + Send),
        _landed: &mut (dyn FnMut(u32, &[u8]) + Send),
    ) -> Result<()> {
        Err(no_rows(l))
    }
    /// The decode step's down columns of the neurons `kept` keeps: `available` gets those in
    /// memory (cache hits first, then misses staged by `decode_up`) with `true` when reads are in
    /// flight meanwhile on the other pool thread, `landed` each one read now.
    fn decode_down(
        &self,
        l: usize,
        _kept: &dyn Fn(u32) -> bool,
        _available: &mut (dyn FnMut(&[(u32, &[u8])], bool) + Send),
        _landed: &mut (dyn FnMut(u32, &[u8]) + Send),
    ) -> Result<()> {
        Err(no_rows(l))
    }
    /// The most tokens one pass may take (the budget holds that many tokens' activations).
    fn batch_tokens_max(&self) -> Option<usize> {
        None
    }
    /// The output matrix when the stream holds it (a model opened for streaming keeps none).
    fn output(&self) -> Option<Weight> {
        None
    }
    /// Taken by the forward pass before it enters the thread pool and held until it ends, for
    /// streams whose state allows one pass at a time (blocking there, outside the pool, cannot
    /// deadlock the pool).
    fn pass_lock(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        None
    }
    /// Generation calls this after the prompt's pass, before the first decode step (so
    /// per-token figures can leave the prompt out).
    fn prefill_done(&self) {}
}

fn no_rows(l: usize) -> Error {
    Error::Invalid(format!("layer {l}: this stream serves no FFN rows"))
}

impl FfnHooks<'_> {
    /// The dense model: every neuron, no observer, no mask.
    pub fn dense() -> FfnHooks<'static> {
        FfnHooks {
            select: &|_, _| FfnNeurons::All,
            observe: None,
            mask: None,
            stream: None,
        }
    }
}

/// A neuron selection made after phase 1 (gate, and up where the criterion needs it): it zeroes
/// the hidden activations of the neurons it drops, which then contribute nothing to down.
pub trait FfnMask: Sync {
    /// `xn`: the normalized FFN input `[n, hidden]`; `gate`: act(gate·x) `[n, ffn]`; `up`: up·x
    /// `[n, ffn]`; `hact`: act(gate)·up `[n, ffn]`, to be edited in place.
    fn apply(&self, layer: usize, xn: &[f32], gate: &[f32], up: &[f32], hact: &mut [f32]);

    /// Which neurons need up·x before `apply` can decide, for a whole batch (the streaming path
    /// reads up only for these; the others' up is taken as zero). Default: every neuron.
    fn up_needed(&self, _layer: usize, _xn: &[f32], _gate: &[f32], need: &mut [bool]) {
        need.fill(true);
    }

    /// Whether `up_needed` looks at `xn` and `gate` (false: it names the same neurons whatever
    /// the input, so a prediction of them is exact).
    fn up_needed_reads_input(&self) -> bool {
        false
    }

    /// True when `apply` keeps exactly the neurons `up_needed` named (minus those whose
    /// activation is zero), so their down columns can be read in the same batch as up.
    fn decides_before_up(&self) -> bool {
        false
    }
}

/// Prepare one activation vector per token for dot products with `w`.
pub(crate) fn prepare_all(xs: &[f32], width: usize, w: &Weight, out: &mut Vec<PreparedInput>) {
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
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let batch = Batch::one(tokens, cache.len, which)?;
        self.forward_batch(&batch, &mut [cache], hooks)
    }

    /// Runs a batch of tokens of one or more sequences (`caches[s]` is sequence `s`'s), writes
    /// their keys and values at their positions, and returns logits `[batch.logit_rows.len(),
    /// vocab]`. Each token attends only to its own sequence.
    pub fn forward_batch(&self, batch: &Batch, caches: &mut [&mut KvCache], hooks: &FfnHooks) -> Result<Vec<f32>> {
        let lens: Vec<(usize, usize)> = caches.iter().map(|c| (c.len, c.capacity)).collect();
        let next = batch.check(self.config.vocab, &lens)?;
        if hooks.stream.is_none() && !self.weights.in_memory() {
            return Err(Error::Invalid(format!(
                "{}: this model was opened for streaming (its matrices stay on disk), and the pass was given no \
                 stream to read them; pass the model's stream (a pass without it would read past the RAM budget)",
                self.path.display()
            )));
        }
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        // Run the whole pass on the backend's threads: the many parallel loops inside it then
        // start from a pool thread, which joins the work directly, instead of parking the
        // caller's thread on a lock for every matrix (that cost ~10% of decode time).
        if let Some(max) = hooks.stream.and_then(|s| s.batch_tokens_max()) {
            if batch.len() > max {
                return Err(Error::Invalid(format!(
                    "a pass of {} tokens exceeds the {max} whose activations the RAM budget holds; \
                     feed the prompt in batches of at most {max} tokens (generation does)",
                    batch.len()
                )));
            }
        }
        let _pass = hooks.stream.and_then(|s| s.pass_lock());
        let logits = self.cpu.install(|| self.forward_in_pool(batch, caches, hooks))?;
        for (c, len) in caches.iter_mut().zip(next) {
            c.len = len;
        }
        Ok(logits)
    }

    fn forward_in_pool(&self, batch: &Batch, caches: &mut [&mut KvCache], hooks: &FfnHooks) -> Result<Vec<f32>> {
        let cfg = &self.config;
        let n = batch.len();
        let h = cfg.hidden;
        let mut x = vec![0f32; n * h];
        for (t, &tok) in batch.ids.iter().enumerate() {
            let row = &mut x[t * h..(t + 1) * h];
            let streamed = match hooks.stream {
                Some(s) => s.embedding(tok, row)?,
                None => false,
            };
            if !streamed {
                self.weights.token_embd.dequantize_row(tok as usize, row);
            }
            if cfg.embed_scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= cfg.embed_scale);
            }
        }
        let mut prep = Vec::new();
        for (l, layer) in self.weights.layers.iter().enumerate() {
            let streamed = match hooks.stream {
                Some(s) => s.attention(l)?,
                None => None,
            };
            let attn = streamed.as_ref().unwrap_or(&layer.attn);
            self.attention_block(l, layer, attn, &mut x, batch, caches, &mut prep);
            self.ffn_block(l, layer, &mut x, &mut prep, hooks)?;
        }
        let rows = &batch.logit_rows;
        let mut xo = vec![0f32; rows.len() * h];
        for (o, &r) in xo.chunks_mut(h).zip(rows) {
            o.copy_from_slice(&x[r * h..(r + 1) * h]);
            rms_norm(o, &self.weights.output_norm, cfg.rms_eps);
        }
        let streamed_out = hooks.stream.and_then(|s| s.output());
        let out_w = streamed_out.as_ref().unwrap_or(&self.weights.output);
        prepare_all(&xo, h, out_w, &mut prep);
        let mut logits = vec![0f32; rows.len() * cfg.vocab];
        if !rows.is_empty() {
            self.backend.matmul(out_w, &prep, &mut logits);
        }
        if let Some(cap) = cfg.final_logit_softcap {
            logits.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
        Ok(logits)
    }

    fn attention_block(
        &self,
        l: usize,
        w: &LayerWeights,
        a: &AttnWeights,
        x: &mut [f32],
        batch: &Batch,
        caches: &mut [&mut KvCache],
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
        prepare_all(&xn, h, &a.wq, prep);
        self.backend.matmul(&a.wq, prep, &mut q);
        if a.wk.ty != a.wq.ty {
            prepare_all(&xn, h, &a.wk, prep);
        }
        self.backend.matmul(&a.wk, prep, &mut k);
        if a.wv.ty != a.wk.ty {
            prepare_all(&xn, h, &a.wv, prep);
        }
        self.backend.matmul(&a.wv, prep, &mut v);
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
            rope_table(batch.positions[t], hd, base, pos_scale, &mut table);
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
        for t in 0..n {
            let (pos, c) = (batch.positions[t], &mut caches[batch.seq_of_token[t]]);
            c.k[l][pos * kvd..(pos + 1) * kvd].copy_from_slice(&k[t * kvd..(t + 1) * kvd]);
            c.v[l][pos * kvd..(pos + 1) * kvd].copy_from_slice(&v[t * kvd..(t + 1) * kvd]);
        }

        // Attention per (token, head) over the token's own sequence, causal, optionally within
        // a sliding window.
        let window = if local { cfg.sliding_window } else { None };
        let group = cfg.n_heads / cfg.n_kv_heads;
        let caches: &[&mut KvCache] = caches;
        let mut attn = vec![0f32; n * qd];
        let scale = cfg.attn_scale;
        self.cpu.install(|| {
            attn.par_chunks_mut(hd)
                .enumerate()
                .for_each_init(Vec::new, |scores, (i, out)| {
                    let (t, head) = (i / cfg.n_heads, i % cfg.n_heads);
                    let pos = batch.positions[t];
                    let c = &caches[batch.seq_of_token[t]];
                    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    let qh = &q[t * qd + head * hd..t * qd + (head + 1) * hd];
                    attend(
                        qh,
                        &c.k[l],
                        &c.v[l],
                        kvd,
                        (head / group) * hd,
                        first..pos + 1,
                        scale,
                        scores,
                        out,
                    );
                })
        });
        prepare_all(&attn, qd, &a.wo, prep);
        let mut o = vec![0f32; n * h];
        self.backend.matmul(&a.wo, prep, &mut o);
        if let Some(pn) = &w.post_attn_norm {
            for row in o.chunks_mut(h) {
                rms_norm(row, pn, cfg.rms_eps);
            }
        }
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
    }

    fn ffn_block(
        &self,
        l: usize,
        w: &LayerWeights,
        x: &mut [f32],
        prep: &mut Vec<PreparedInput>,
        hooks: &FfnHooks,
    ) -> Result<()> {
        let cfg = &self.config;
        let h = cfg.hidden;
        let mut xn = x.to_vec();
        for row in xn.chunks_mut(h) {
            rms_norm(row, &w.ffn_norm, cfg.rms_eps);
        }
        let mut d = self.ffn(l, w, &xn, prep, hooks)?;
        if let Some(pn) = &w.post_ffn_norm {
            for row in d.chunks_mut(h) {
                rms_norm(row, pn, cfg.rms_eps);
            }
        }
        x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        Ok(())
    }
}
