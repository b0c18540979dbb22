//! Streaming from disk: runs a `.gst` model under a RAM budget, reading per token only what is
//! not resident, and for the FFN only the neurons the mask keeps.
//!
//! Per layer (see docs/DESIGN.md, "The pipeline"): the layer's streamed dense parts (attention and
//! gate matrices that did not fit the budget) were requested from the prefetch thread while the
//! layer before computed; the gate runs; the mask (or dense: every neuron) names the neurons
//! that need up; their up rows and down columns not in the neuron cache are planned into
//! merged, aligned reads ([`plan`]) and read in one batch; up·x, the mask's final choice and the
//! down accumulation follow. The exact criterion needs up before it can choose, so it reads up
//! for every needed neuron first and down for the kept ones second.
//!
//! The streamer is the forward pass's weight provider (`LayerStream`, implemented in [`rows`]):
//! it hands bytes over — views of prefetched matrices, rows staged in neuron order, or rows
//! where they are as their reads land — and `model::ffn` computes on them.
//!
//! Exactness: staged rows are laid out in neuron order and go through the same device
//! operations as the in-RAM path, so with every neuron active the logits are bit-identical to it.
//!
//! Owns: the residency plan, the readers, the neuron caches, staging buffers and counters. Does
//! not own the arithmetic (`model::ffn` on a `backend::Device`) or the choice of neurons (the mask).

pub mod cache;
pub mod experts;
pub mod hybrid;
mod open;
pub mod plan;
pub mod prefetch;
pub mod report;
pub mod residency;
mod rows;

pub use report::{
    peak_rss_bytes, release_free_memory, reset_peak_rss, rss_bytes, Counters, LookaheadReport, StreamReport,
};

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::io::{Range, ReadEngine, ReadStats, Reader, ReaderOptions};
use crate::model::forward::AttnWeights;
use crate::quant::GgmlType;
use crate::tensor::Weight;
use cache::{CachePolicy, LayerCache};
use plan::{CostModel, PlannedRead};
use prefetch::{Placement, Prefetcher};
use residency::{Priority, Residency};
use rows::{Ahead, DecodeStep};

/// How to stream.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    pub budget_bytes: u64,
    pub engine: ReadEngine,
    pub reader: ReaderOptions,
    pub cache: CachePolicy,
    /// Whether gates or the neuron cache come first in the budget after attention.
    pub priority: Priority,
    /// Dense streaming: every layer's FFN rows (those the cache lacks) are prefetched with its
    /// dense parts while the layer before computes, since all of them will be needed.
    pub prefetch_ffn: bool,
    /// Overrides the cost model's merge gap (reads through shorter gaps); `None` = the model's.
    pub merge_gap_bytes: Option<u64>,
    /// Where the read planner's cost model comes from.
    pub cost: CostSource,
    /// Sparse decoding: while layer l computes, predict layer l+1's neurons and read them on a
    /// third reader ([`Streamer`] docs, "Lookahead").
    pub lookahead: Lookahead,
    /// KV cache positions the budget holds (prompt and generated tokens of every sequence).
    pub kv_positions: usize,
    /// The most tokens one pass takes (a longer prompt is prefilled in batches of this many);
    /// their activations are counted in the budget.
    pub batch_tokens_max: usize,
    /// A device with memory of its own: what it keeps resident ([`residency::DeviceResidency`]);
    /// the weights it does not keep are copied to it at each use. `None`: it keeps every weight
    /// the host holds. Refused for the CPU device.
    pub vram_budget_bytes: Option<u64>,
    /// Prefetch buffers, each a layer's streamed matrices (at least 2: the layer in use and the
    /// next being read; each more reads one more layer ahead). [`PREFETCH_BUFFERS`] by default.
    pub prefetch_buffers: usize,
    /// Bytes of one read the prefetch thread issues (its reads land in place, so they are not
    /// bound by the reader's slot size): [`PREFETCH_READ_BYTES`] by default.
    pub prefetch_read_bytes: usize,
}

/// The default [`StreamOptions::prefetch_buffers`].
pub const PREFETCH_BUFFERS: usize = 2;

/// The default [`StreamOptions::prefetch_read_bytes`]: 1 MiB, where this machine's disk gives
/// sequential reads at its full rate (smaller requests cost it 10-30%).
pub const PREFETCH_READ_BYTES: usize = 1 << 20;

/// [`StreamOptions::budget_bytes`] for no RAM budget of its own: the plan keeps everything
/// resident in host memory (what `--vram-budget` without `--ram-budget` streams from).
pub const RAM_UNLIMITED: u64 = u64::MAX;

/// The default [`StreamOptions::batch_tokens_max`]: prefill batches of 32 tokens keep a long
/// prompt's activations at ~7 MB on Qwen2.5-1.5B (218 KB per token) while each streamed weight
/// still serves 32 tokens per read.
pub const STREAM_BATCH_TOKENS: usize = 32;

/// The default [`StreamOptions::batch_tokens_max`] for a stream with no RAM budget of its own
/// that serves a GPU under `--vram-budget`: the weights it does not keep cross the link once per
/// pass, so a prompt's passes are as wide as the in-memory model's
/// ([`crate::model::generate::PREFILL_BATCH_TOKENS`]); their activations live in the GPU's
/// budget, which the device's plan counts.
pub fn default_batch_tokens(budget_bytes: u64, vram_budget_bytes: Option<u64>) -> usize {
    match (budget_bytes, vram_budget_bytes) {
        (RAM_UNLIMITED, Some(_)) => crate::model::generate::PREFILL_BATCH_TOKENS,
        _ => STREAM_BATCH_TOKENS,
    }
}

/// Bytes of one token's activations in a pass: the hidden state and its norm, q/k/v, the
/// attention output, and the FFN's gate, up, hidden and staged activations (f32).
pub fn activation_bytes_per_token(cfg: &crate::config::ModelConfig) -> u64 {
    4 * (4 * cfg.hidden + 2 * cfg.q_dim() + 2 * cfg.kv_dim() + 5 * cfg.ffn) as u64
}

/// Whether and how the next layer's neurons are predicted and read ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookahead {
    Off,
    /// The mask's up set does not depend on the input (the exact criterion, a union set):
    /// predicted exactly, whatever stays resident.
    Exact,
    /// Predicted through the next layer's resident gate; where no gate is resident under the
    /// budget it is turned off (with a warning), so its buffers go to the cache instead.
    FromGates,
}

impl Lookahead {
    /// For a mask whose up set does (`true`) or does not depend on the layer's input.
    pub fn for_mask(reads_input: bool) -> Lookahead {
        if reads_input {
            Lookahead::FromGates
        } else {
            Lookahead::Exact
        }
    }
}

/// Where the read planner's cost model comes from.
#[derive(Clone, Debug)]
pub enum CostSource {
    /// Measured on the file at start-up ([`plan::probe`]).
    Probe,
    /// This machine's defaults ([`CostModel::default_for`]).
    Default,
    /// Measured earlier: per-request time (µs) and bandwidth (bytes/µs), e.g. from a `bench`
    /// report ([`CostModel::from_bench_json`]).
    Given { request_us: f64, bytes_per_us: f64 },
}

/// A matrix's place in the file (`bench` replays reads with it too).
#[derive(Clone, Debug)]
pub(crate) struct Part {
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    offset_bytes: u64,
    row_bytes: usize,
    stride_bytes: usize,
}

impl Part {
    pub(crate) fn of(w: &Weight) -> Result<Part> {
        let offset_bytes = w
            .file_offset()
            .ok_or_else(|| Error::Internal(format!("{}: streaming needs the weight's place in the file", w.name)))?;
        Ok(Part {
            name: w.name.clone(),
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            offset_bytes,
            row_bytes: w.row_bytes,
            stride_bytes: w.row_stride_bytes,
        })
    }

    /// Row `row`'s `(offset, len)` in the file.
    pub(crate) fn extent(&self, row: u32) -> (u64, usize) {
        (
            self.offset_bytes + row as u64 * self.stride_bytes as u64,
            self.row_bytes,
        )
    }

    /// Slots `first..first + count` of a neuron cache's buffer for this matrix (`buf`, one
    /// packed row of `hidden` columns a slot) as a weight over it.
    pub(crate) fn slots(&self, buf: &Arc<Vec<u8>>, first: usize, count: usize, hidden: usize) -> Result<Weight> {
        Weight::shared(&self.name, self.ty, count, hidden, buf.clone(), first * self.row_bytes)
    }

    /// Rows `0..rows` as one range: the whole matrix when contiguous, the span from its first
    /// to its last row's end when strided (bundled).
    pub(crate) fn range_of(&self, rows: usize) -> Range {
        let len = if rows == 0 {
            0
        } else {
            (rows - 1) * self.stride_bytes + self.row_bytes
        };
        Range::new(self.offset_bytes, len)
    }

    /// The whole matrix as one range (contiguous parts only).
    fn range(&self) -> Range {
        self.range_of(self.rows)
    }

    /// Bytes of the rows themselves.
    pub(crate) fn row_bytes(&self) -> usize {
        self.row_bytes
    }
}

struct LayerParts {
    /// wq, wk, wv, wo when streamed.
    attn: Option<[Part; 4]>,
    gate: Option<Part>,
    /// Neuron-major files: the up rows and down columns (row n = neuron n). The `rows` layout:
    /// the up matrix `[ffn, hidden]` and the down matrix `[hidden, ffn]` as stored.
    up: Part,
    down: Part,
    /// The `rows` layout: up and down when each streams whole (read with the attention and
    /// gate, after them), `None` when resident.
    rows_up: Option<Part>,
    rows_down: Option<Part>,
    /// FFN rows prefetched with the dense parts (dense streaming), as merged file ranges.
    ffn_ranges: Vec<Range>,
    /// Dense steps' FFN rows handed over as views of the prefetch buffer, when set.
    views: Option<FfnViews>,
}

/// How a dense step's FFN rows are handed over as views of the layer's prefetch buffer instead
/// of being gathered into the staging: the stream's neurons are `first..ffn` (after the
/// device's hot ones); a pinned cache holds `first..cached` (never written again, so the
/// prefetch thread may read it) and the prefetch reads `cached..ffn`. Room for the cached rows is
/// kept free before the prefetched ranges (`leads`), and the prefetch thread copies them there
/// (`fill`), so each matrix's rows `first..ffn` lie in the buffer at one stride, as in the file
/// (a bundled file's up rows and down columns interleaved: strided views, which only a device
/// computing in host memory takes; a device with memory of its own would copy the whole bundle
/// for each of the two views, so it is handed contiguous rows only).
#[derive(Clone)]
struct FfnViews {
    first: usize,
    cached: usize,
    /// The pinned cache's up rows and down columns (slot s = neuron `first + s`).
    cache_up: Arc<Vec<u8>>,
    cache_down: Arc<Vec<u8>>,
    /// Per matrix (up, down): the index among `dense_ranges()` of the range holding its row
    /// `cached`, and that row's byte offset in the range.
    at: [(usize, usize); 2],
}

impl FfnViews {
    /// Bytes kept free before each of `dense_ranges()` (`n` of them): room for the cached rows
    /// before the range each matrix's row `cached` starts.
    fn leads(&self, parts: &LayerParts, n: usize) -> Vec<usize> {
        let mut leads = vec![0; n];
        for ((i, off), p) in self.at.iter().zip([&parts.up, &parts.down]) {
            let room = (self.cached - self.first) * p.stride_bytes;
            leads[*i] = leads[*i].max(room.saturating_sub(*off));
        }
        leads
    }

    /// Where matrix `m`'s (0 up, 1 down) row `first` lies in a buffer whose ranges start at
    /// `starts`.
    fn row_first_at(&self, p: &Part, m: usize, starts: &[usize]) -> usize {
        let (i, off) = self.at[m];
        starts[i] + off - (self.cached - self.first) * p.stride_bytes
    }

    /// What the prefetch thread runs before its reads: the cached rows copied into the room kept
    /// for them.
    fn fill(&self, parts: &LayerParts) -> prefetch::Fill {
        let v = self.clone();
        let (up, down) = (parts.up.clone(), parts.down.clone());
        Box::new(move |buf: &mut [u8], starts: &[usize]| {
            for (m, (p, cache)) in [(&up, &v.cache_up), (&down, &v.cache_down)].into_iter().enumerate() {
                let at = v.row_first_at(p, m, starts);
                for s in 0..v.cached - v.first {
                    let dst = at + s * p.stride_bytes;
                    buf[dst..dst + p.row_bytes].copy_from_slice(&cache[s * p.row_bytes..(s + 1) * p.row_bytes]);
                }
            }
        })
    }
}

impl LayerParts {
    /// Streamed whole matrices, in the order they lie in the prefetch buffer: attention, gate,
    /// and in the `rows` layout up and down.
    fn matrices(&self) -> impl Iterator<Item = &Part> {
        self.attn
            .iter()
            .flatten()
            .chain(self.gate.iter())
            .chain(self.rows_up.iter())
            .chain(self.rows_down.iter())
    }

    fn matrix_ranges(&self) -> Vec<Range> {
        self.matrices().map(Part::range).collect()
    }

    /// The index among `dense_ranges()` of the streamed gate, up and down (those present).
    fn gate_index(&self) -> usize {
        self.attn.as_ref().map_or(0, |a| a.len())
    }
    fn rows_up_index(&self) -> usize {
        self.gate_index() + self.gate.is_some() as usize
    }
    fn rows_down_index(&self) -> usize {
        self.rows_up_index() + self.rows_up.is_some() as usize
    }
    /// Everything the prefetch thread reads for this layer.
    fn dense_ranges(&self) -> Vec<Range> {
        let mut r = self.matrix_ranges();
        r.extend(self.ffn_ranges.iter().copied());
        r
    }
    fn streams_dense(&self) -> bool {
        self.matrices().next().is_some() || !self.ffn_ranges.is_empty()
    }
    /// The up rows and down columns of neurons `first..` (those a pinned cache of `first`
    /// neurons lacks), sorted by offset.
    fn ffn_extents_from(&self, first: usize) -> Vec<(u64, usize)> {
        let mut spans = Vec::with_capacity(2 * self.up.rows.saturating_sub(first));
        for n in first as u32..self.up.rows as u32 {
            spans.push(self.up.extent(n));
            spans.push(self.down.extent(n));
        }
        spans.sort_unstable_by_key(|s| s.0);
        spans
    }

    /// The number of streamed whole matrices (the first of `dense_ranges()`).
    fn matrix_count(&self) -> usize {
        self.matrices().count()
    }

    /// The bytes of file extent `(o, len)` in the layer's dense buffer `buf` (its ranges at
    /// `starts`), if it was prefetched.
    fn prefetched<'b>(&self, buf: &'b [u8], starts: &[usize], o: u64, len: usize) -> Option<&'b [u8]> {
        let first = self.matrix_count();
        for (r, &at) in self.ffn_ranges.iter().zip(starts.get(first..)?) {
            if o >= r.offset_bytes && o + len as u64 <= r.offset_bytes + r.len_bytes as u64 {
                let start = at + (o - r.offset_bytes) as usize;
                return buf.get(start..start + len);
            }
        }
        None
    }
}

/// A layer's dense parts as the prefetch thread read them: `buf` holds its `dense_ranges()`,
/// range i at `starts[i]` (each at its file phase, [`prefetch::Placement::InPhase`]).
struct Current {
    layer: usize,
    buf: Arc<Vec<u8>>,
    starts: Vec<usize>,
}

struct State {
    caches: Vec<LayerCache>,
    staging_up: Arc<Vec<u8>>,
    staging_down: Arc<Vec<u8>>,
    /// Layers whose dense parts were submitted to the prefetcher, oldest first.
    pending: VecDeque<usize>,
    /// The layer whose dense parts are in use.
    current: Option<Current>,
    spare: Vec<Vec<u8>>,
    plan: Vec<PlannedRead>,
    counters: Counters,
    /// Lookahead reads submitted and not yet taken, oldest first (`buf` empty until done).
    ahead: VecDeque<Ahead>,
    ahead_spare: Vec<Vec<u8>>,
    /// The lookahead read taken for the decode step's layer, until its up phase uses it.
    ahead_taken: Option<Ahead>,
    /// The decode step between its up and down phases.
    decode: Option<DecodeStep>,
    /// Staging buffers the device page-locked (among the streamer's `_pinned`), by address, and
    /// any of them replaced while a weight still viewed it (see [`unique`]): kept until the
    /// streamer drops, after the device unlocked them, so none is freed while locked.
    pinned: Vec<usize>,
    retired: Vec<Arc<Vec<u8>>>,
    /// The prefetch thread's buffers the device page-locked or the reader registered, by
    /// address (made at their largest at open, so never reallocated): one still viewed when it
    /// leaves `current` is retired rather than freed while locked or registered.
    dense_pinned: Vec<usize>,
}

impl State {
    /// Nothing pending or taken yet; `caches` and staging as the residency plan sized them.
    fn new(caches: Vec<LayerCache>, staging_up: Vec<u8>, staging_down: Vec<u8>) -> State {
        State {
            caches,
            staging_up: Arc::new(staging_up),
            staging_down: Arc::new(staging_down),
            pending: VecDeque::new(),
            current: None,
            spare: Vec::new(),
            plan: Vec::new(),
            counters: Counters::default(),
            ahead: VecDeque::new(),
            ahead_spare: Vec::new(),
            ahead_taken: None,
            decode: None,
            pinned: Vec::new(),
            retired: Vec::new(),
            dense_pinned: Vec::new(),
        }
    }
}

/// A `.gst` model's streaming state. Create with [`Streamer::open`], pass as `FfnHooks::stream`.
///
/// Lookahead ([`StreamOptions::lookahead`], sparse decoding only): at the start of layer l's
/// FFN, the mask is asked which neurons layer l+1 will need, from layer l's FFN input carried
/// over to l+1's norm (`xn ÷ norm_l × norm_{l+1}`: the residual stream changes little from one
/// layer to the next) and l+1's resident gate. The rows of those the cache lacks are planned
/// and read on a third reader while layer l reads and computes; layer l+1 takes what it needs
/// from them and reads only what the prediction missed. Masks whose `up_needed` does not look
/// at the input (the exact criterion reads up for every neuron; a union set is fixed) are
/// predicted perfectly, also across the last layer into the next token's first. Layers whose
/// gate streams get no lookahead.
pub struct Streamer {
    /// The prefetch thread's buffers registered with its reader (io_uring fixed buffers), undone
    /// before any of that memory is freed (the first field, so dropped first).
    _registered: Vec<crate::io::Registration>,
    /// The device's locks on host memory it copies from at each use (a device with memory of its
    /// own; locked, at the link's pinned speed): the FFN staging buffers, the prefetch thread's
    /// buffers, and the resident weights its plan does not keep ([`pin_unkept`]). The first
    /// field, so they drop, unlocking, before any of that memory does (the prefetch thread's
    /// buffers go with `prefetcher`).
    _pinned: Vec<crate::backend::PinnedHost>,
    pub residency: Residency,
    pub cost: CostModel,
    pub engine: ReadEngine,
    pub direct_io: bool,
    /// Fallbacks the readers took, for the caller to print.
    pub warnings: Vec<String>,
    /// What dense streaming reads per token under this residency (planned, not measured).
    pub dense_bytes_per_token: u64,
    /// The most tokens a pass may take (their activations are in the budget).
    pub batch_tokens_max: usize,
    /// KV positions the budget holds.
    pub kv_positions: usize,
    /// Bytes of one large read (the prefetch thread's, an expert's miss).
    read_bytes: usize,
    fg: Arc<dyn Reader>,
    bg: Arc<dyn Reader>,
    prefetcher: Prefetcher,
    /// The lookahead thread and its reader.
    lookahead: Option<(Prefetcher, Arc<dyn Reader>)>,
    layers: Vec<LayerParts>,
    /// The embedding matrix when it streams (one row per token); `None` when tied to `output`.
    embedding: Option<Part>,
    /// The output matrix (always resident), and the layers' resident attention and gates.
    output: Weight,
    resident_attn: Vec<Option<AttnWeights>>,
    resident_gate: Vec<Option<Weight>>,
    /// The `rows` layout: each layer's resident up and down matrices (`None` where they stream);
    /// empty for a neuron-major file.
    resident_ffn: Vec<(Option<Weight>, Option<Weight>)>,
    hidden: usize,
    /// Held for a whole forward pass, taken before the pass enters the thread pool
    /// ([`LayerStream::pass_lock`]): passes over one stream run one at a time, and `state` is
    /// only ever locked by the one pass running, so no pool thread waits on it while its
    /// holder waits for pool work (which could deadlock).
    pass: Mutex<()>,
    state: Mutex<State>,
    /// Counters when the prompt's pass finished (see [`LayerStream::prefill_done`]), the
    /// device's link counters too.
    decode_start: Mutex<Option<DecodeStart>>,
    /// How the device the model computes on reaches host memory (its link counters, the
    /// weights it reads in place).
    link: Arc<dyn crate::backend::HostLink>,
    /// Under `--vram-budget`: what the device keeps.
    pub device_plan: Option<residency::DeviceResidency>,
    /// Per layer, the hot neurons the device keeps (the plan's `hot_neurons`): the up rows and
    /// down columns of the layer's first neurons, resident there. The layer's cache holds the
    /// neurons after them.
    hot: Vec<Option<(Weight, Weight)>>,
    /// A mixture-of-experts model's experts, cache and lookahead ([`experts`]); `None` for a
    /// dense model.
    pub experts: Option<experts::ExpertStream>,
    /// The hybrid executor's CPU, cold rows and plan ([`Streamer::enable_hybrid`]).
    hybrid: Option<hybrid::Hybrid>,
}

/// The readers a streamer reads with: `fg` serves the FFN reads and setup, `bg` the prefetch
/// thread, `ahead` the lookahead thread (when lookahead is on; `None` shares `bg`).
pub struct Readers {
    pub fg: Arc<dyn Reader>,
    pub bg: Arc<dyn Reader>,
    pub ahead: Option<Arc<dyn Reader>>,
}

/// The buffer for writing; a new one if a view of the old one is still alive (the weights built
/// on it are dropped after each layer, so this does not happen in steady state).
fn unique<'a>(buf: &'a mut Arc<Vec<u8>>, pinned: &[usize], retired: &mut Vec<Arc<Vec<u8>>>) -> &'a mut Vec<u8> {
    if Arc::get_mut(buf).is_none() {
        let old = std::mem::replace(buf, Arc::new(vec![0u8; buf.len()]));
        // A page-locked buffer must outlive its lock (the streamer's guards drop first).
        if pinned.contains(&(old.as_ptr() as usize)) {
            retired.push(old);
        }
    }
    Arc::get_mut(buf).expect("just made unique")
}

/// Where the decode steps' counters start (see [`Streamer::decode_counters`]).
type DecodeStart = (Counters, ReadStats, Option<crate::backend::LinkCounters>);

impl Streamer {
    /// Turns on the hybrid executor ([`hybrid`]) for `mode` with `threads` CPU threads (0: one
    /// per core) for `model` (the model this stream was opened for): measures its cost model
    /// and keeps each layer's cold rows. It needs a GPU budget (`vram_budget_bytes`), and a
    /// mixture-of-experts model (its routed experts, cached or read, are in host memory either
    /// way) or a dense neuron-major file (its cold rows in place where a neuron cache holds the
    /// whole layer, else staged at each step, read as a dense step reads them). `Off` and
    /// `GpuStream` turn it off. Returns why it stays off under `Auto` where it cannot run
    /// (`CpuCold` fails instead).
    pub fn enable_hybrid(
        &mut self,
        model: &crate::model::Model,
        mode: hybrid::HybridMode,
        threads: usize,
    ) -> Result<Option<String>> {
        use hybrid::{HybridMode, Probe};
        self.hybrid = None;
        if matches!(mode, HybridMode::Off | HybridMode::GpuStream) {
            return Ok(None);
        }
        if self.device_plan.is_none() && mode == HybridMode::Auto {
            return Ok(None);
        }
        let why_not = match () {
            _ if self.device_plan.is_none() => {
                Some("it splits a model between a GPU and the CPU: it needs --vram-budget (and --device cuda)")
            }
            // (The rows layout: its resident FFN matrices; experts have none.)
            _ if !self.resident_ffn.is_empty() => {
                Some("the rows layout keeps no FFN rows on the device: reformat with --ffn-layout split or bundled")
            }
            _ => None,
        };
        if let Some(why) = why_not {
            return match mode {
                HybridMode::CpuCold => Err(Error::Input(format!("--hybrid cpu-cold: {why}"))),
                _ => Ok(Some(format!("--hybrid auto: off, since {why}"))),
            };
        }
        let link = self.link.clone();
        let cap = self.batch_tokens_max;
        let hybrid = match &self.experts {
            Some(x) => {
                let moe = model
                    .config
                    .moe
                    .as_ref()
                    .ok_or_else(|| Error::Internal("an expert stream for a model without experts".into()))?;
                let probe = x.probe_expert(self.fg.as_ref())?;
                let per_layer = moe.n_used as f64 * x.expert_bytes as f64;
                hybrid::Hybrid::new(
                    mode,
                    threads,
                    Vec::new(),
                    &format!("routed experts ({} of {} a token)", moe.n_used, moe.n_experts),
                    per_layer,
                    Probe::Expert(&probe, model.config.activation),
                    link.as_ref(),
                    cap,
                )?
            }
            None => {
                // Per layer: its cold rows in place where the cache holds the whole layer (never
                // rewritten then); else staged at each step.
                let cold: Vec<(usize, Option<(Weight, Weight)>)> = {
                    let st = self.state.lock().expect("stream state");
                    let mut cold = Vec::with_capacity(self.layers.len());
                    for (l, p) in self.layers.iter().enumerate() {
                        let k = self.hot[l].as_ref().map_or(0, |(u, _)| u.rows);
                        let c = &st.caches[l];
                        if c.slots() != p.up.rows {
                            cold.push((k, None));
                            continue;
                        }
                        let (ub, db) = c.buffers();
                        let rows = p.up.rows - k;
                        cold.push((
                            k,
                            Some((
                                p.up.slots(ub, k, rows, self.hidden)?,
                                p.down.slots(db, k, rows, self.hidden)?,
                            )),
                        ));
                    }
                    cold
                };
                let per_layer = self
                    .layers
                    .iter()
                    .zip(&cold)
                    .map(|(p, (k, _))| ((p.up.rows - k) * (p.up.row_bytes + p.down.row_bytes)) as f64)
                    .sum::<f64>()
                    / cold.len().max(1) as f64;
                // The probe: the largest layer held in place, else the first rows of layer 0 read
                // from the file (at most 4096 neurons; the time is scaled to a layer's share).
                let (up, down) = match cold.iter().filter_map(|(_, r)| r.as_ref()).max_by_key(|(u, _)| u.rows) {
                    Some((u, d)) => (u.clone(), d.clone()),
                    None => {
                        let p = self
                            .layers
                            .first()
                            .ok_or_else(|| Error::Internal("a model without layers".into()))?;
                        let rows = p.up.rows.min(4096);
                        let read = |part: &Part| -> Result<Weight> {
                            let r = part.range_of(rows);
                            let bytes = self.fg.read_vec(r.offset_bytes, r.len_bytes)?;
                            Weight::shared_strided(
                                &part.name,
                                part.ty,
                                rows,
                                self.hidden,
                                Arc::new(bytes),
                                0,
                                part.stride_bytes,
                            )
                        };
                        (read(&p.up)?, read(&p.down)?)
                    }
                };
                hybrid::Hybrid::new(
                    mode,
                    threads,
                    cold,
                    "cold FFN rows",
                    per_layer,
                    Probe::Cold(&up, &down),
                    link.as_ref(),
                    cap,
                )?
            }
        };
        self.hybrid = Some(hybrid);
        Ok(None)
    }

    /// Sets the widest pass whose cold rows the CPU computes, in place of the width the cost
    /// model chose (tests and measurements of a given split); no effect when the hybrid is off.
    pub fn set_hybrid_max_width(&mut self, width: usize) {
        if let Some(h) = &mut self.hybrid {
            h.plan.max_width = width;
        }
    }

    /// The hybrid executor's plan, when it is on.
    pub fn hybrid_plan(&self) -> Option<&hybrid::HybridPlan> {
        self.hybrid.as_ref().map(|h| &h.plan)
    }

    /// Counters and device reads since the prompt's pass (decode steps only), or since opening
    /// when no prompt was marked.
    pub fn decode_counters(&self) -> (Counters, ReadStats) {
        let (c, r) = (self.counters(), self.read_stats());
        match *self.decode_start.lock().expect("decode start") {
            Some((c0, r0, _)) => (c.minus(&c0), r.combine(&r0, -1)),
            None => (c, r),
        }
    }

    /// What the device copied from the host since the prompt's pass (or since it opened): `None`
    /// for the CPU device.
    pub fn decode_link(&self) -> Option<crate::backend::LinkCounters> {
        let now = self.link.link()?;
        match *self.decode_start.lock().expect("decode start") {
            Some((_, _, Some(l0))) => Some(now.minus(&l0)),
            _ => Some(now),
        }
    }

    /// Marks where decoding starts (the counters' and the device's).
    fn mark_decode_start(&self) {
        *self.decode_start.lock().expect("decode start") = Some((self.counters(), self.read_stats(), self.link.link()));
    }

    pub fn counters(&self) -> Counters {
        self.state.lock().expect("stream state").counters
    }

    /// Every reader's counters added together (what the device actually did).
    pub fn read_stats(&self) -> ReadStats {
        let s = self.fg.stats().combine(&self.bg.stats(), 1);
        match &self.lookahead {
            // A shared reader is counted once.
            Some((_, r)) if !Arc::ptr_eq(r, &self.bg) => s.combine(&r.stats(), 1),
            _ => s,
        }
    }

    /// The next layer after `l` (cyclically: the next pass's first) whose dense parts stream.
    fn next_streamed(&self, l: usize) -> Option<usize> {
        let n = self.layers.len();
        (1..=n).map(|d| (l + d) % n).find(|&m| self.layers[m].streams_dense())
    }

    /// How layer `l`'s dense parts are laid out in the prefetch buffer: in phase with the file,
    /// with room for the cached FFN rows before the prefetched ones when dense steps take views.
    fn placement(&self, l: usize) -> Placement {
        let parts = &self.layers[l];
        match &parts.views {
            None => Placement::in_phase(),
            Some(v) => Placement::InPhase {
                leads: v.leads(parts, parts.matrix_count() + parts.ffn_ranges.len()),
                fill: Some(v.fill(parts)),
            },
        }
    }

    /// Makes layer `l`'s dense parts current (waiting for the prefetch if needed) and requests
    /// the next streamed layer's.
    fn advance(&self, st: &mut State, l: usize) -> Result<()> {
        if let Some(Current { buf, .. }) = st.current.take() {
            let at = buf.as_ptr() as usize;
            match Arc::try_unwrap(buf) {
                Ok(v) => st.spare.push(v),
                Err(buf) if st.dense_pinned.contains(&at) => st.retired.push(buf),
                Err(_) => {}
            }
        }
        if self.layers[l].streams_dense() {
            if st.pending.front() != Some(&l) {
                // Out of step (first pass, or a pass that ended in an error): start over.
                while st.pending.pop_front().is_some() {
                    let d = self.prefetcher.next()?;
                    st.spare.push(d.buf);
                }
                let buf = st.spare.pop().unwrap_or_default();
                self.prefetcher
                    .submit(l, self.layers[l].dense_ranges(), buf, self.placement(l))?;
                st.pending.push_back(l);
            }
            let t0 = Instant::now();
            let done = self.prefetcher.next()?;
            st.pending.pop_front();
            st.counters.io_wait_ns += t0.elapsed().as_nanos() as u64;
            debug_assert_eq!(done.key, l);
            st.counters.dense_needed_bytes += done.bytes as u64;
            // Kept even when the read failed (a locked buffer must not be freed here).
            st.current = Some(Current {
                layer: l,
                buf: Arc::new(done.buf),
                starts: done.starts,
            });
            done.result?;
        }
        if st.pending.is_empty() {
            if let Some(m) = self.next_streamed(l) {
                let buf = st.spare.pop().unwrap_or_default();
                self.prefetcher
                    .submit(m, self.layers[m].dense_ranges(), buf, self.placement(m))?;
                st.pending.push_back(m);
            }
        }
        Ok(())
    }
}

/// The device's locks on the resident weights it copies at each use — of the output matrix,
/// the resident attention and `more` (gates, or routers and shared experts), those its plan
/// does not keep (volatile) whose bytes are this process's own memory (a map of the file is not
/// locked) — so those copies, too, run from page-locked memory. Empty for a device computing in
/// host memory; a weight the device declines to lock is copied as before.
fn pin_unkept<'a>(
    link: &dyn crate::backend::HostLink,
    output: &'a Weight,
    attn: &'a [Option<AttnWeights>],
    more: impl Iterator<Item = &'a Weight>,
) -> Vec<crate::backend::PinnedHost> {
    if link.host_memory() {
        return Vec::new();
    }
    let attn = attn.iter().flatten().flat_map(|a| a.matrices());
    std::iter::once(output)
        .chain(attn)
        .chain(more)
        .filter(|w| w.is_volatile() && w.is_owned())
        .filter_map(|w| w.span())
        .filter(|(bytes, _)| !bytes.is_empty())
        .filter_map(|(bytes, _)| link.pin_host(bytes, false))
        .collect()
}
