//! The forward pass: embeddings, per-layer attention with a KV cache and the gated FFN, final
//! norm and logits. One code path serves batched prefill (many tokens at once, each weight read
//! once per batch) and decode (one token). A mask ([`FfnMask`]) picks the FFN neurons that
//! count, the seam the sparse streaming path builds on.

use std::borrow::Cow;

use crate::backend::{Act, AttnShape, RopeShape};
use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::batch::{Batch, Logits, PassOut, Want, TOP_K_MAX};
use crate::model::weights::LayerWeights;
use crate::model::{Model, Placement};
use crate::tensor::Weight;

/// `(layer, act(gate), act(gate)·up)` — see [`FfnHooks::observe`].
pub type FfnObserver<'a> = &'a (dyn Fn(usize, &[f32], &[f32]) + Sync);

/// Per-layer control over the FFN: the neurons that count, and an observer that sees the
/// activations (calibration collects statistics through it).
pub struct FfnHooks<'a> {
    /// `(layer, act(gate), act(gate)·up)`, both `[n_tokens, ffn]`, after a layer's FFN hidden
    /// activations are computed (neurons a mask dropped are zero).
    pub observe: Option<FfnObserver<'a>>,
    /// Chooses which of the computed neurons count, after gate and up are known.
    pub mask: Option<&'a dyn FfnMask>,
    /// Weights read from disk while the pass runs (the streaming path); `None` is the in-RAM model.
    pub stream: Option<&'a dyn LayerStream>,
    /// Checked before every layer: once set, the pass stops with [`Error::Cancelled`] (a long
    /// prompt batch ends within a layer's time, not a whole pass's). The KV cache keeps the
    /// positions of earlier passes only.
    pub cancel: Option<&'a std::sync::atomic::AtomicBool>,
}

/// The attention matrices of one layer (latent attention: see [`MlaWeights`] for what each is).
#[derive(Clone)]
pub struct AttnWeights {
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    pub mla: Option<Box<MlaWeights>>,
}

/// Latent attention's own weights ([`crate::config::Mla`]); in its [`AttnWeights`], `wq` is the
/// query (after `q_a` and its norm where there is a bottleneck), `wk` the latent and rotated
/// key part (`attn_kv_a_mqa`), `wv` the heads' value up-projections stacked
/// (`[heads · v_head, kv_lora_rank]`) and `wo` the output.
#[derive(Clone)]
pub struct MlaWeights {
    /// The query bottleneck (`attn_q_a`) and its norm.
    pub q_a: Option<Weight>,
    pub q_a_norm: Option<Vec<f32>>,
    /// The latent's norm (`attn_kv_a_norm`).
    pub kv_a_norm: Vec<f32>,
    /// The heads' key up-projections stacked, `[heads · kv_lora_rank, qk_nope]` (`attn_k_b`):
    /// head h's rows absorb its query's unrotated part into the latent space.
    pub k_b: Weight,
}

impl AttnWeights {
    /// Every matrix (latent attention's own too).
    pub fn matrices(&self) -> Vec<&Weight> {
        let mut out = vec![&self.wq, &self.wk, &self.wv, &self.wo];
        if let Some(m) = &self.mla {
            out.extend(m.q_a.iter().chain([&m.k_b]));
        }
        out
    }

    /// The same, to change.
    pub fn matrices_mut(&mut self) -> Vec<&mut Weight> {
        let mut out = vec![&mut self.wq, &mut self.wk, &mut self.wv, &mut self.wo];
        if let Some(m) = &mut self.mla {
            let MlaWeights { q_a, k_b, .. } = &mut **m;
            out.extend(q_a.iter_mut().chain([k_b]));
        }
        out
    }

    /// The same matrices each passed through `f` (a stream's loading).
    pub fn try_map(&self, f: &mut dyn FnMut(&Weight) -> Result<Weight>) -> Result<AttnWeights> {
        Ok(AttnWeights {
            wq: f(&self.wq)?,
            wk: f(&self.wk)?,
            wv: f(&self.wv)?,
            wo: f(&self.wo)?,
            mla: match &self.mla {
                None => None,
                Some(m) => Some(Box::new(MlaWeights {
                    q_a: m.q_a.as_ref().map(&mut *f).transpose()?,
                    q_a_norm: m.q_a_norm.clone(),
                    kv_a_norm: m.kv_a_norm.clone(),
                    k_b: f(&m.k_b)?,
                })),
            },
        })
    }
}

/// Rows handed over where they are in memory: `(neuron, bytes)` each.
pub type RowsInMemory<'a> = dyn FnMut(&[(u32, &[u8])]) + Send + 'a;
/// As [`RowsInMemory`], with `true` when reads are in flight meanwhile on another pool thread.
pub type DownRowsInMemory<'a> = dyn FnMut(&[(u32, &[u8])], bool) + Send + 'a;
/// One row as its read lands: `(neuron, bytes)`.
pub type RowLanded<'a> = dyn FnMut(u32, &[u8]) + Send + 'a;

/// The weight provider of the streaming path: what the forward pass asks for instead of reading
/// resident weights. It hands bytes over (views, staged rows, rows as their reads land) and
/// never computes: the arithmetic is `model::ffn`'s. Implemented by `stream::Streamer`; each
/// method may block on reads. What the FFN's paths ask of it is narrower, by what the stream
/// holds: a neuron-major file's rows ([`RowStream`], from [`Self::ffn_rows`]), a mixture of
/// experts' routed experts ([`ExpertStream`], from [`Self::expert_stream`]), or a `rows`
/// layout's whole matrices ([`Self::ffn_weights`]).
pub trait LayerStream: Sync {
    /// Writes token `tok`'s embedding row (dequantized, unscaled) into `out`, or returns
    /// `Ok(false)` to use the resident embedding matrix.
    fn embedding(&self, tok: u32, out: &mut [f32]) -> Result<bool>;
    /// Layer `l`'s attention matrices when they are streamed, or `None` when resident. Called in
    /// layer order; an implementation may start reading later layers' weights meanwhile.
    fn attention(&self, l: usize) -> Result<Option<Cow<'_, AttnWeights>>>;
    /// The FFN rows this stream hands over (a neuron-major file): the dense FFN's streamed
    /// paths ask it for their gate and rows. `None`: the FFN computes on the model's own
    /// matrices, or on [`Self::ffn_weights`]'.
    fn ffn_rows(&self) -> Option<&dyn RowStream> {
        None
    }
    /// The routed experts this stream reads (a mixture of experts). `None`: the model's own.
    fn expert_stream(&self) -> Option<&dyn ExpertStream> {
        None
    }
    /// Layer `l`'s whole FFN (gate, up, down rows) when the stream hands its matrices over
    /// (a `.gst` in the `rows` layout: views of its prefetch buffer, or resident copies): the FFN
    /// then computes on them as on the in-RAM model's. `None`: the stream hands over rows, or
    /// nothing.
    fn ffn_weights(&self, _l: usize) -> Result<Option<crate::model::weights::FfnWeights>> {
        Ok(None)
    }
    /// A whole matrix of the model read into memory (to build sketches of a streamed model).
    fn read_matrix(&self, w: &Weight) -> Result<Weight> {
        Err(Error::Internal(format!(
            "{}: this stream reads no whole matrices",
            w.name
        )))
    }
    /// KV positions the stream's budget holds for all sequences together.
    fn kv_positions(&self) -> Option<usize> {
        None
    }
    /// The most tokens one pass may take (the budget holds that many tokens' activations).
    fn batch_tokens_max(&self) -> Option<usize> {
        None
    }
    /// The output matrix when the stream holds it (a model opened for streaming keeps none).
    fn output(&self) -> Option<&Weight> {
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

/// The rows of a neuron-major FFN a stream hands over: what the dense FFN's streamed paths
/// ([`crate::model::ffn`]: hybrid, decode on the host, in place, staged) ask for, and nothing
/// else. Each method may block on reads.
pub trait RowStream: Sync {
    /// Layer `l`'s gate matrix when the stream holds it (a resident copy, or the view of the
    /// bytes prefetched with the layer); `None`: the model's own.
    fn gate(&self, l: usize) -> Result<Option<Cow<'_, Weight>>>;
    /// Layer `l`'s hot neurons the device keeps (`--vram-budget`'s plan): the up rows and the
    /// down columns of the layer's first `k` neurons, row n = neuron n, resident on the device.
    /// A step computes those neurons from them and asks the stream (`stage*`, `decode_*`,
    /// `rows_in_place`) only for neurons from `k` on. `None`: none (the stream hands over all).
    fn hot_rows(&self, l: usize) -> Option<(&Weight, &Weight)>;
    /// Counts what a step computed from layer `l`'s hot rows: `up` up rows, `down` down columns.
    fn count_hot_rows(&self, l: usize, up: usize, down: usize);
    /// The hybrid executor (`--hybrid`): for a pass of `n` tokens, layer `l`'s FFN rows past the
    /// device's hot ones (`hot_rows`), in host memory, for the host's CPU to compute — when the
    /// stream holds them there and its cost model gives a pass of this width to the CPU.
    /// `None`: the device computes every neuron (the rows are handed to it).
    fn cold_on_host(&self, l: usize, n: usize) -> Option<ColdRows<'_>>;
    /// Counts what the CPU computed of one layer for the hybrid executor: `bytes` of weights
    /// in `ns` nanoseconds.
    fn count_cold(&self, bytes: u64, ns: u64);
    /// Layer `l`'s whole up matrix (or, `down`, its neuron-major down columns) as a weight the
    /// device reads in place ([`crate::backend::HostLink::in_place`]), row n = neuron n (from the
    /// first neuron past the device's hot ones, `hot_rows`: row i = neuron k + i), when the
    /// stream holds the layer in memory the device mapped and every neuron of `set` (sorted)
    /// there: a decode step's products then read `set`'s rows by id, nothing staged or copied.
    /// Counts `set`'s rows as used. `None` (nothing done): use `decode_up` / `decode_down`.
    fn rows_in_place(&self, l: usize, set: &[u32], down: bool) -> Result<Option<Weight>>;
    /// Stages the up rows of `up_set` (sorted) and, when `with_down`, their down columns: row
    /// i of each returned matrix is the set's i-th neuron. The cache serves what it holds.
    fn stage(&self, l: usize, up_set: &[u32], with_down: bool) -> Result<(Weight, Option<Weight>)>;
    /// Stages the down columns of `down_set` (sorted); `staged_up`: the up set the last `stage`
    /// staged (neurons now read whole go to the cache).
    fn stage_down(&self, l: usize, down_set: &[u32], staged_up: &[u32]) -> Result<Weight>;
    /// A decode step (one token) starts layer `l`'s FFN: the lookahead read for it, if any, is
    /// waited for.
    fn begin_decode(&self, l: usize) -> Result<()>;
    /// Where a lookahead prediction made at layer `l` goes: the next layer (the next token's
    /// first after the last, when the mask's up set does not read the input) and, when
    /// `reads_input`, its resident gate to predict with; `None`: no lookahead there.
    fn lookahead_target(&self, l: usize, reads_input: bool) -> Option<(usize, Option<&Weight>)>;
    /// Reads the rows of the neurons `need` predicts for `layer` (with their down columns when
    /// `with_down`) ahead, on the lookahead reader.
    fn read_ahead(&self, layer: usize, need: &[bool], with_down: bool) -> Result<()>;
    /// A decode step's up rows where they are: `available` gets every row the cache holds
    /// (on one pool thread) while `landed` gets each missed row as its read completes (on the
    /// other), so reading overlaps computing; `with_down` reads the misses' down columns in
    /// the same batch (kept for `decode_down`).
    fn decode_up(
        &self,
        l: usize,
        up_set: &[u32],
        with_down: bool,
        available: &mut RowsInMemory<'_>,
        landed: &mut RowLanded<'_>,
    ) -> Result<()>;
    /// The decode step's down columns of the neurons `kept` keeps: `available` gets those in
    /// memory (cache hits first, then misses staged by `decode_up`) with `true` when reads are in
    /// flight meanwhile on the other pool thread, `landed` each one read now.
    fn decode_down(
        &self,
        l: usize,
        kept: &dyn Fn(u32) -> bool,
        available: &mut DownRowsInMemory<'_>,
        landed: &mut RowLanded<'_>,
    ) -> Result<()>;
}

/// The routed experts a stream reads: what the mixture-of-experts FFN asks for, and nothing
/// else. Each method may block on reads.
pub trait ExpertStream: Sync {
    /// Layer `l`'s router and shared expert as the stream holds them; `None`: layer `l` has no
    /// experts here (a leading dense layer).
    fn expert_layer(&self, l: usize) -> Option<ExpertLayer<'_>>;
    /// Runs `compute` on each of layer `l`'s experts `ids` (distinct, any order): those in
    /// memory first, the rest as their reads land.
    fn experts(&self, l: usize, ids: &[usize], compute: &mut ExpertCompute<'_>) -> Result<()>;
    /// Where a lookahead from layer `l`'s FFN input goes: the next layer, its router and its
    /// score bias; `None`: no lookahead (or the next layer has no experts).
    fn expert_lookahead(&self, l: usize) -> Option<(usize, &Weight, Option<&[f32]>)>;
    /// Reads the experts `ids` predicted for `layer` ahead.
    fn read_experts_ahead(&self, layer: usize, ids: &[usize]) -> Result<()>;
    /// The hybrid executor's CPU for a pass of `n` tokens, when its cost model gives the pass
    /// to the CPU: the routed experts the stream hands over (in host memory) are then computed
    /// there, not copied to the device. `None`: the device.
    fn host_cpu(&self, n: usize) -> Option<&crate::backend::cpu::CpuBackend>;
    /// Counts what the CPU computed of one layer for the hybrid executor: `bytes` of weights
    /// in `ns` nanoseconds.
    fn count_cold(&self, bytes: u64, ns: u64);
}

/// A layer's cold FFN rows in host memory and the CPU that computes them (see
/// [`RowStream::cold_on_host`]). `first` is the number of hot neurons the device keeps;
/// `rows`, when the stream holds every cold neuron in place: up rows and down columns,
/// neuron-major, row i = neuron `first + i`. `None`: the stream reads some of them (a RAM budget
/// of its own), and the step stages the cold neurons it needs ([`RowStream::stage`]).
pub struct ColdRows<'a> {
    pub first: usize,
    pub rows: Option<(&'a Weight, &'a Weight)>,
    pub cpu: &'a crate::backend::cpu::CpuBackend,
}

/// What a stream holds of a mixture-of-experts layer (see [`ExpertStream::expert_layer`]).
pub struct ExpertLayer<'a> {
    pub router: &'a Weight,
    pub score_bias: Option<&'a [f32]>,
    pub shared: Option<&'a (crate::model::weights::FfnWeights, Option<Vec<f32>>)>,
}

/// Computes one expert (its index, its weights).
pub type ExpertCompute<'a> = dyn FnMut(usize, &crate::model::weights::FfnWeights) -> Result<()> + 'a;

impl FfnHooks<'_> {
    /// The dense model: every neuron, no observer, no mask.
    pub fn dense() -> FfnHooks<'static> {
        FfnHooks {
            observe: None,
            mask: None,
            stream: None,
            cancel: None,
        }
    }
}

/// How a caller's passes run: through `stream` (if any), at most `batch_tokens_max` tokens each
/// (0: no limit of the caller's own; a stream's limit always applies). Evaluation, calibration
/// and perplexity take one, so they run the same way in RAM and streamed.
#[derive(Clone, Copy, Default)]
pub struct Passes<'a> {
    pub stream: Option<&'a dyn LayerStream>,
    pub batch_tokens_max: usize,
    /// Stops a pass between layers once set (see [`FfnHooks::cancel`]).
    pub cancel: Option<&'a std::sync::atomic::AtomicBool>,
}

impl<'a> Passes<'a> {
    /// The most tokens per pass.
    pub fn batch_max(&self) -> usize {
        let own = if self.batch_tokens_max == 0 {
            usize::MAX
        } else {
            self.batch_tokens_max
        };
        own.min(self.stream.and_then(|s| s.batch_tokens_max()).unwrap_or(usize::MAX))
    }

    /// Hooks for these passes: every neuron selected, `mask` and `observe` as given.
    pub fn hooks<'h>(&self, mask: Option<&'h dyn FfnMask>, observe: Option<FfnObserver<'h>>) -> FfnHooks<'h>
    where
        'a: 'h,
    {
        FfnHooks {
            observe,
            mask,
            stream: self.stream,
            cancel: self.cancel,
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

    /// True when `apply`'s choice, and what it counts, depends on `xn` and `gate` alone (never
    /// on `up` or the values of `hact`), and its edit only zeroes the neurons it drops, which
    /// are those `up_needed` did not name (so [`FfnMask::decides_before_up`] holds too). A
    /// masked decode step on a device with memory of its own then makes act(gate)·up itself
    /// from an up that is zero outside those neurons, and `apply` is only told of the step:
    /// up never comes to the host.
    fn decides_from_input(&self) -> bool {
        false
    }

    /// A masked decode step (one token) that a device with memory of its own ran for a mask
    /// that [`FfnMask::decides_from_input`]: the step kept exactly the `kept` neurons
    /// `up_needed` named, and the device made their activations, so `apply` is not called.
    /// Counts the step as `apply` would have, recomputing nothing and needing neither the input
    /// nor the gate on the host. A mask that decides from the input counts its steps here; the
    /// default counts nothing.
    fn count_decided(&self, _layer: usize, _kept: usize) {}

    /// Mixture-of-experts models: whether this mask can run inside each routed expert (per
    /// token, on the expert's own neurons; it sees one expert's `[tokens routed to it, ffn]` at a
    /// time). Masks that keep per-layer state over a layer's neurons (thresholds, union sets,
    /// calibration statistics) cannot, and are refused for such models.
    fn inside_experts(&self) -> bool {
        false
    }

    /// Mixture-of-experts models: route each token to this many experts instead of the model's
    /// own count, for the passes this mask runs (`eval` measures several counts in one run).
    fn experts_used(&self) -> Option<usize> {
        None
    }

    /// Mixture-of-experts models: whether `apply` changes the activations (false for a hook that
    /// only watches the routing: the experts then run with no mask at all).
    fn masks_neurons(&self) -> bool {
        true
    }

    /// Mixture-of-experts models: layer `layer` routed its batch of tokens; `routes` holds
    /// `n_used` `(expert, weight)` entries per token, in token order (see `model::ffn::route`).
    fn routed(&self, _layer: usize, _n_used: usize, _routes: &[(usize, f32)]) {}
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
        self.forward_want(tokens, cache, which, hooks, Want::Logits)
            .map(PassOut::into_logits)
    }

    /// As `forward_with`, returning what `want` asks for.
    pub fn forward_want(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        which: Logits,
        hooks: &FfnHooks,
        want: Want,
    ) -> Result<PassOut> {
        if tokens.is_empty() {
            return Ok(PassOut::empty(want));
        }
        let batch = Batch::one(tokens, cache.len, which)?;
        self.forward_batch_want(&batch, &mut [cache], hooks, want)
    }

    /// As `forward_with`, feeding `tokens` in passes of at most `batch_max` tokens (a stream's
    /// limit, or a prefill batch size): logits `[n - from, vocab]` for positions `from..` of
    /// `tokens`. With `batch_max >= tokens.len()` this is one `forward_with` pass.
    pub fn forward_in_batches(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        from: usize,
        hooks: &FfnHooks,
        batch_max: usize,
    ) -> Result<Vec<f32>> {
        if from >= tokens.len() {
            return Err(Error::Internal(format!(
                "logits asked from position {from} of {} tokens",
                tokens.len()
            )));
        }
        let mut logits = Vec::new();
        for (c, chunk) in tokens.chunks(batch_max.max(1)).enumerate() {
            let start = c * batch_max.max(1);
            let mut batch = Batch::one(chunk, cache.len, Logits::Last)?;
            batch.logit_rows = (from.saturating_sub(start)..chunk.len()).collect();
            logits.extend(self.forward_batch(&batch, &mut [cache], hooks)?);
        }
        Ok(logits)
    }

    /// Runs a batch of tokens of one or more sequences (`caches[s]` is sequence `s`'s), writes
    /// their keys and values at their positions, and returns logits `[batch.logit_rows.len(),
    /// vocab]`. Each token attends only to its own sequence.
    pub fn forward_batch(&self, batch: &Batch, caches: &mut [&mut KvCache], hooks: &FfnHooks) -> Result<Vec<f32>> {
        self.forward_batch_want(batch, caches, hooks, Want::Logits)
            .map(PassOut::into_logits)
    }

    /// As `forward_batch`, returning what `want` asks for.
    pub fn forward_batch_want(
        &self,
        batch: &Batch,
        caches: &mut [&mut KvCache],
        hooks: &FfnHooks,
        want: Want,
    ) -> Result<PassOut> {
        let lens: Vec<(usize, usize)> = caches.iter().map(|c| (c.len, c.capacity)).collect();
        let next = batch.check(self.config.vocab, &lens)?;
        if hooks.stream.is_none() && self.placement == Placement::OnDisk {
            return Err(Error::Internal(format!(
                "{}: this model was opened for streaming (its matrices stay on disk), and the pass was given no \
                 stream to read them; pass the model's stream (a pass without it would read past the RAM budget)",
                self.path.display()
            )));
        }
        if batch.is_empty() {
            return Ok(PassOut::empty(want));
        }
        // Run the whole pass on the backend's threads: the many parallel loops inside it then
        // start from a pool thread, which joins the work directly, instead of parking the
        // caller's thread on a lock for every matrix (that cost ~10% of decode time).
        if let Some(max) = hooks.stream.and_then(|s| s.batch_tokens_max()) {
            if batch.len() > max {
                return Err(Error::Internal(format!(
                    "a pass of {} tokens exceeds the {max} whose activations the RAM budget holds; \
                     feed the prompt in batches of at most {max} tokens (generation does)",
                    batch.len()
                )));
            }
        }
        let _pass = hooks.stream.and_then(|s| s.pass_lock());
        let mut result = None;
        self.device.run(Box::new(|| {
            result = Some(self.forward_on_device(batch, caches, hooks, want))
        }));
        let logits = result.expect("the device ran the pass");
        if let Some(e) = self.device.take_error() {
            return Err(e);
        }
        let logits = logits?;
        for (c, len) in caches.iter_mut().zip(next) {
            c.len = len;
        }
        Ok(logits)
    }

    /// The layer program, on `self.device`.
    fn forward_on_device(
        &self,
        batch: &Batch,
        caches: &mut [&mut KvCache],
        hooks: &FfnHooks,
        want: Want,
    ) -> Result<PassOut> {
        let cfg = &self.config;
        let dev = &*self.device;
        let (n, h) = (batch.len(), cfg.hidden);
        // Embeddings: rows the stream reads, or the resident matrix's.
        let mut x = match hooks.stream {
            Some(s) => {
                let mut host = vec![0f32; n * h];
                let mut all_streamed = true;
                for (row, &tok) in host.chunks_mut(h).zip(&batch.ids) {
                    all_streamed &= s.embedding(tok, row)?;
                }
                if all_streamed {
                    if cfg.embed_scale != 1.0 {
                        host.iter_mut().for_each(|v| *v *= cfg.embed_scale);
                    }
                    dev.upload(n, h, host)
                } else {
                    dev.embed(&self.weights.token_embd, &batch.ids, cfg.embed_scale)
                }
            }
            None => dev.embed(&self.weights.token_embd, &batch.ids, cfg.embed_scale),
        };
        let mut residual: Option<Act> = None;
        for (l, layer) in self.weights.layers.iter().enumerate() {
            if hooks
                .cancel
                .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
            {
                return Err(Error::Cancelled);
            }
            let streamed = match hooks.stream {
                Some(s) => s.attention(l)?,
                None => None,
            };
            let attn = streamed.as_deref().unwrap_or(&layer.attn);
            let o = self.attention_block(l, layer, attn, &mut x, residual.take(), batch, caches);
            residual = Some(self.ffn_block(l, layer, &mut x, o, hooks)?);
        }
        // Each block's output is added to the residual stream where the next block normalizes
        // it (one operation on a GPU); the last one here, with the final norm where every row's
        // logits are wanted (a decode step), else before the rows are picked.
        if batch.logit_rows.is_empty() {
            return Ok(PassOut::empty(want));
        }
        let every_row = batch.logit_rows.len() == x.rows && batch.logit_rows.iter().enumerate().all(|(i, &r)| r == i);
        let xo = match residual {
            Some(d) if every_row => dev.add_rms_norm(&mut x, &d, &self.weights.output_norm, cfg.rms_eps),
            residual => {
                if let Some(d) = residual {
                    dev.add(&mut x, &d);
                }
                let mut xo = dev.select_rows(&x, &batch.logit_rows);
                dev.rms_norm_in_place(&mut xo, &self.weights.output_norm, cfg.rms_eps);
                xo
            }
        };
        let out_w = hooks.stream.and_then(|s| s.output()).unwrap_or(&self.weights.output);
        let mut logits = dev.matmul(&[out_w], &xo).remove(0);
        if let Some(cap) = cfg.final_logit_softcap {
            dev.softcap(&mut logits, cap);
        }
        Ok(match want {
            Want::Logits => PassOut::Logits(dev.download(logits)),
            Want::Greedy { banned } => PassOut::Tokens(dev.argmax_rows(&logits, banned)),
            Want::Top { k, banned, greedy, lse } => {
                let k = k.clamp(1, TOP_K_MAX).min(logits.width);
                let top = dev.top_k_rows(&logits, k, banned, lse, greedy);
                PassOut::Top {
                    k,
                    pairs: top.pairs,
                    tokens: top.tokens,
                    lse: top.lse,
                }
            }
        })
    }

    /// The attention block's output for `x` (the residual stream, with the previous block's
    /// output `pending` added first), to be added to `x` by the caller.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        l: usize,
        w: &LayerWeights,
        a: &AttnWeights,
        x: &mut Act,
        pending: Option<Act>,
        batch: &Batch,
        caches: &mut [&mut KvCache],
    ) -> Act {
        let cfg = &self.config;
        let dev = &*self.device;
        let xn = match pending {
            Some(p) => dev.add_rms_norm(x, &p, &w.attn_norm, cfg.rms_eps),
            None => dev.rms_norm(x, &w.attn_norm, cfg.rms_eps),
        };
        if let (Some(m), Some(mw)) = (&cfg.mla, &a.mla) {
            return self.latent_attention(l, a, (m, mw), &xn, batch, caches);
        }
        // Q, K and V usually share a type: the input is prepared once for them (and on a GPU
        // they may be one launch, their biases added as each output is written).
        let biases = [&w.bq, &w.bk, &w.bv].map(|b| b.as_deref());
        let mut qkv = dev.matmul_bias(&[&a.wq, &a.wk, &a.wv], &biases, &xn);
        let (v, mut k, mut q) = (qkv.pop().expect("v"), qkv.pop().expect("k"), qkv.pop().expect("q"));
        let local = cfg.layer_is_local(l);
        let (base, pos_scale) = if local {
            (cfg.rope_theta_local, 1.0)
        } else {
            (cfg.rope_theta, cfg.rope_scale_global)
        };
        let rope = RopeShape {
            head_dim: cfg.head_dim,
            rope_dims: cfg.rope_dims(),
            base,
            pos_scale,
            style: cfg.rope_style,
            factors: cfg.rope_freq_factors.as_deref(),
        };
        let (q_norm, k_norm) = match (&w.q_norm, &w.k_norm) {
            // OLMoE: over the whole projection, before RoPE.
            (Some(qn), Some(kn)) if cfg.qk_norm_whole => {
                dev.rms_norm_in_place(&mut q, qn, cfg.rms_eps);
                dev.rms_norm_in_place(&mut k, kn, cfg.rms_eps);
                (None, None)
            }
            _ => (w.q_norm.as_deref(), w.k_norm.as_deref()),
        };
        dev.rope_qk_kv_write(
            l,
            &mut q,
            &mut k,
            &v,
            (&batch.positions, &batch.seq_of_token),
            caches,
            (rope, q_norm, k_norm, cfg.rms_eps),
        );
        let shape = AttnShape {
            layer: l,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            scale: cfg.attn_scale,
            window: if local { cfg.sliding_window } else { None },
            sinks: w.attn_sinks.as_deref(),
        };
        let attn = dev.attention(&q, &batch.positions, &batch.seq_of_token, caches, shape);
        let mut o = dev.matmul_bias(&[&a.wo], &[w.bo.as_deref()], &attn).remove(0);
        if let Some(pn) = &w.post_attn_norm {
            dev.rms_norm_in_place(&mut o, pn, cfg.rms_eps);
        }
        o
    }

    /// The FFN block's output for `x` after the attention block's output `o` is added to it, to
    /// be added to `x` by the caller.
    fn ffn_block(&self, l: usize, w: &LayerWeights, x: &mut Act, o: Act, hooks: &FfnHooks) -> Result<Act> {
        let cfg = &self.config;
        let dev = &*self.device;
        let xn = dev.add_rms_norm(x, &o, &w.ffn_norm, cfg.rms_eps);
        drop(o);
        let mut d = self.ffn(l, w, &xn, hooks)?;
        if let Some(pn) = &w.post_ffn_norm {
            dev.rms_norm_in_place(&mut d, pn, cfg.rms_eps);
        }
        Ok(d)
    }
}
