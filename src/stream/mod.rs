//! Streaming from disk: runs a `.gst` model under a RAM budget, reading per token only what is
//! not resident, and for the FFN only the neurons the mask keeps.
//!
//! Per layer (see DESIGN.md, "The pipeline"): the layer's streamed dense parts (attention and
//! gate matrices that did not fit the budget) were requested from the prefetch thread while the
//! layer before computed; the gate runs; the mask (or dense: every neuron) names the neurons
//! that need up; their up rows and down columns not in the neuron cache are planned into
//! merged, aligned reads ([`plan`]) and read in one batch; up·x, the mask's final choice and the
//! down accumulation follow. The exact criterion needs up before it can choose, so it reads up
//! for every needed neuron first and down for the kept ones second.
//!
//! Exactness: staged rows are laid out in neuron order and go through the same backend calls as
//! the in-RAM path, so with every neuron active the logits are bit-identical to it.
//!
//! Owns: the residency plan, the readers, the neuron caches, staging buffers and counters. Does
//! not own the arithmetic (the backend) or the choice of neurons (the mask).

pub mod cache;
pub mod plan;
pub mod prefetch;
pub mod residency;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::io::{open_reader, Range, ReadEngine, ReadStats, Reader, ReaderOptions};
use crate::model::forward::{AttnWeights, LayerStream};
use crate::model::weights::FfnDown;
use crate::model::Model;
use crate::quant::GgmlType;
use crate::tensor::Weight;
use cache::{CachePolicy, LayerCache};
use plan::{plan, CostModel, PlanTotals, PlannedRead};
use prefetch::Prefetcher;
use residency::{ModelSizes, Priority, Residency};

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
}

/// The default [`StreamOptions::batch_tokens_max`]: prefill batches of 32 tokens keep a long
/// prompt's activations at ~7 MB on Qwen2.5-1.5B (218 KB per token) while each streamed weight
/// still serves 32 tokens per read.
pub const STREAM_BATCH_TOKENS: usize = 32;

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
            .ok_or_else(|| Error::Invalid(format!("{}: streaming needs the weight's place in the file", w.name)))?;
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
    up: Part,
    down: Part,
    /// FFN rows prefetched with the dense parts (dense streaming), as merged file ranges.
    ffn_ranges: Vec<Range>,
}

impl LayerParts {
    /// Streamed attention and gate matrices.
    fn matrix_ranges(&self) -> Vec<Range> {
        self.attn
            .iter()
            .flatten()
            .chain(self.gate.iter())
            .map(Part::range)
            .collect()
    }
    /// Everything the prefetch thread reads for this layer.
    fn dense_ranges(&self) -> Vec<Range> {
        let mut r = self.matrix_ranges();
        r.extend(self.ffn_ranges.iter().copied());
        r
    }
    fn streams_dense(&self) -> bool {
        self.attn.is_some() || self.gate.is_some() || !self.ffn_ranges.is_empty()
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

    /// Where the prefetched FFN rows start in the layer's dense buffer.
    fn ffn_ranges_at(&self) -> usize {
        self.attn
            .iter()
            .flatten()
            .chain(self.gate.iter())
            .map(|p| p.rows * p.row_bytes)
            .sum()
    }
    /// The bytes of file extent `(o, len)` in the layer's dense buffer, if it was prefetched.
    fn prefetched<'b>(&self, buf: &'b [u8], o: u64, len: usize) -> Option<&'b [u8]> {
        let mut at = self.ffn_ranges_at();
        for r in &self.ffn_ranges {
            if o >= r.offset_bytes && o + len as u64 <= r.offset_bytes + r.len_bytes as u64 {
                let start = at + (o - r.offset_bytes) as usize;
                return buf.get(start..start + len);
            }
            at += r.len_bytes;
        }
        None
    }
}

/// Counters since the streamer was opened (see [`Streamer::counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Counters {
    /// Forward passes (prefill batches and decode steps).
    pub passes: u64,
    /// FFN neurons the passes needed (up or down part), and how many the cache served.
    pub cache_lookups: u64,
    pub cache_hits: u64,
    /// Bytes of FFN rows read from disk, and what the plan transferred (merged gaps and
    /// alignment included), in how many reads.
    pub ffn_needed_bytes: u64,
    pub ffn_device_bytes: u64,
    pub ffn_reads: u64,
    /// Bytes of streamed dense parts (attention, gate, embedding rows) asked for.
    pub dense_needed_bytes: u64,
    /// Time the compute thread waited for reads, nanoseconds.
    pub io_wait_ns: u64,
    /// Lookahead: neurons predicted and read ahead, and how many of them the layer then used
    /// (their rows' bytes too). The rest were read in vain.
    pub ahead_neurons: u64,
    pub ahead_used_neurons: u64,
    pub ahead_bytes: u64,
    pub ahead_used_bytes: u64,
    /// FFN bytes the layers took from lookahead reads: predicted rows and rows the reads
    /// covered by reading through gaps (part of `ffn_needed_bytes`).
    pub ahead_served_bytes: u64,
}

impl Counters {
    pub fn minus(&self, o: &Counters) -> Counters {
        Counters {
            passes: self.passes - o.passes,
            cache_lookups: self.cache_lookups - o.cache_lookups,
            cache_hits: self.cache_hits - o.cache_hits,
            ffn_needed_bytes: self.ffn_needed_bytes - o.ffn_needed_bytes,
            ffn_device_bytes: self.ffn_device_bytes - o.ffn_device_bytes,
            ffn_reads: self.ffn_reads - o.ffn_reads,
            dense_needed_bytes: self.dense_needed_bytes - o.dense_needed_bytes,
            io_wait_ns: self.io_wait_ns - o.io_wait_ns,
            ahead_neurons: self.ahead_neurons - o.ahead_neurons,
            ahead_used_neurons: self.ahead_used_neurons - o.ahead_used_neurons,
            ahead_bytes: self.ahead_bytes - o.ahead_bytes,
            ahead_used_bytes: self.ahead_used_bytes - o.ahead_used_bytes,
            ahead_served_bytes: self.ahead_served_bytes - o.ahead_served_bytes,
        }
    }
}

/// A lookahead read: the rows predicted for `layer`, planned into `ranges` (sorted by offset),
/// which the lookahead thread reads back to back into `buf`.
struct Ahead {
    layer: usize,
    ranges: Vec<Range>,
    /// Where each range starts in `buf`.
    starts: Vec<usize>,
    buf: Vec<u8>,
    /// The neurons predicted (sorted), and the bytes read for each (up row, and down column
    /// when the mask decides before up).
    predicted: Vec<u32>,
    neuron_bytes: u64,
}

impl Ahead {
    /// The bytes of file extent `(o, len)`, if a read of this lookahead covers it.
    fn get(&self, o: u64, len: usize) -> Option<&[u8]> {
        let i = self.ranges.partition_point(|r| r.offset_bytes <= o).checked_sub(1)?;
        let r = self.ranges[i];
        if o + len as u64 > r.offset_bytes + r.len_bytes as u64 {
            return None;
        }
        let at = self.starts[i] + (o - r.offset_bytes) as usize;
        self.buf.get(at..at + len)
    }
}

struct State {
    caches: Vec<LayerCache>,
    staging_up: Arc<Vec<u8>>,
    staging_down: Arc<Vec<u8>>,
    /// Layers whose dense parts were submitted to the prefetcher, oldest first.
    pending: VecDeque<usize>,
    /// The layer whose dense parts are in use, and their bytes.
    current: Option<(usize, Arc<Vec<u8>>)>,
    spare: Vec<Vec<u8>>,
    plan: Vec<PlannedRead>,
    counters: Counters,
    /// Lookahead reads submitted and not yet taken, oldest first (`buf` empty until done).
    ahead: VecDeque<Ahead>,
    ahead_spare: Vec<Vec<u8>>,
    /// The decode step between its up and down phases.
    decode: Option<DecodeStep>,
}

/// One decode step's FFN rows between `decode_up` and `decode_down`: which of the up set the
/// cache held (neuron, slot) and which were read (their rows staged in that order), and the
/// lookahead read taken for this layer (until the up phase uses it).
struct DecodeStep {
    layer: usize,
    hits: Vec<(u32, usize)>,
    misses: Vec<u32>,
    with_down: bool,
    ahead: Option<Ahead>,
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
    hidden: usize,
    /// Held for a whole forward pass, taken before the pass enters the thread pool
    /// ([`LayerStream::pass_lock`]): passes over one stream run one at a time, and `state` is
    /// only ever locked by the one pass running, so no pool thread waits on it while its
    /// holder waits for pool work (which could deadlock).
    pass: Mutex<()>,
    state: Mutex<State>,
    /// Counters when the prompt's pass finished (see [`LayerStream::prefill_done`]).
    decode_start: Mutex<Option<(Counters, ReadStats)>>,
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
fn unique(buf: &mut Arc<Vec<u8>>) -> &mut Vec<u8> {
    if Arc::get_mut(buf).is_none() {
        *buf = Arc::new(vec![0u8; buf.len()]);
    }
    Arc::get_mut(buf).expect("just made unique")
}

/// Writes each page once, so first-touch faults happen at setup, not while timing tokens.
fn prefault(buf: &mut [u8]) {
    for i in (0..buf.len()).step_by(4096) {
        buf[i] = 0;
    }
}

impl Streamer {
    /// Plans residency for `model` (loaded from a `.gst` file) under the budget, loads what is
    /// resident into memory (reading it past the page cache where the engine allows), and makes
    /// the model's remaining weights streamed.
    ///
    /// The model is only read: a streamer keeps its own resident copies (or, for the mmap
    /// engine, views of its own map), so one model can back several streamers and is best
    /// loaded with `Placement::OnDisk`, which keeps no view of the file a pass without the
    /// stream could read.
    pub fn open(model: &Model, opts: &StreamOptions) -> Result<Streamer> {
        // Two readers: one for the compute thread's FFN reads, one for the prefetch thread.
        let open = || -> Result<(Arc<dyn Reader>, bool, Vec<String>)> {
            let o = open_reader(&model.path, opts.engine, &opts.reader)?;
            Ok((Arc::from(o.reader), o.direct_io_active, o.warnings))
        };
        let (fg, direct_io, mut warnings) = open()?;
        let (bg, _, w2) = open()?;
        warnings.extend(w2.into_iter().filter(|w| !warnings.contains(w)).collect::<Vec<_>>());
        let ahead = if opts.lookahead != Lookahead::Off {
            Some(open()?.0)
        } else {
            None
        };
        Streamer::with_readers(model, opts, Readers { fg, bg, ahead }, direct_io, warnings)
    }

    /// As `open`, with readers supplied (tests use simulated devices).
    pub fn with_readers(
        model: &Model,
        opts: &StreamOptions,
        readers: Readers,
        direct_io: bool,
        warnings: Vec<String>,
    ) -> Result<Streamer> {
        let Readers { fg, bg, ahead } = readers;
        let cfg = model.config.clone();
        let not_gst = || {
            Error::Invalid(format!(
                "{}: streaming reads a .gst file (neuron-major FFN); convert with `gatestream reformat`",
                model.path.display()
            ))
        };
        if !crate::gstfile::is_gst(&model.path) {
            return Err(not_gst());
        }
        let w = &model.weights;
        let tied = w.output.file_offset() == w.token_embd.file_offset();
        let norm_bytes = |l: &crate::model::weights::LayerWeights| {
            let opt = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| v.len());
            (l.attn_norm.len()
                + l.ffn_norm.len()
                + opt(&l.bq)
                + opt(&l.bk)
                + opt(&l.bv)
                + opt(&l.q_norm)
                + opt(&l.k_norm)
                + opt(&l.post_attn_norm)
                + opt(&l.post_ffn_norm)) as u64
                * 4
        };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        let mut sizes = ModelSizes {
            n_layers: cfg.n_layers,
            ffn: cfg.ffn,
            required_bytes: w.output.len_bytes() as u64
                + w.output_norm.len() as u64 * 4
                + w.layers.iter().map(norm_bytes).sum::<u64>(),
            attention_bytes: Vec::new(),
            gate_bytes: Vec::new(),
            neuron_bytes: Vec::new(),
            prefetch_ffn: opts.prefetch_ffn,
            // Every reader's reusable buffers (set with the plan below).
            reader_bytes: 0,
            lookahead: false,
            context_bytes: crate::kv::KvCache::bytes_for(&cfg, opts.kv_positions)
                + opts.batch_tokens_max.max(1) as u64 * activation_bytes_per_token(&cfg),
        };
        for l in &w.layers {
            let FfnDown::Columns(down) = &l.ffn_down else {
                return Err(not_gst());
            };
            let a = &l.attn;
            sizes
                .attention_bytes
                .push([&a.wq, &a.wk, &a.wv, &a.wo].iter().map(|w| w.len_bytes() as u64).sum());
            sizes.gate_bytes.push(l.ffn_gate.len_bytes() as u64);
            sizes.neuron_bytes.push((l.ffn_up.row_bytes + down.row_bytes) as u64);
            layers.push(LayerParts {
                attn: None,
                gate: None,
                up: Part::of(&l.ffn_up)?,
                down: Part::of(down)?,
                ffn_ranges: Vec::new(),
            });
        }
        let plan_with = |sizes: &mut ModelSizes, lookahead: bool| {
            let readers = if lookahead { 3 } else { 2 };
            sizes.reader_bytes = readers * (opts.reader.queue_depth * opts.reader.slot_bytes) as u64;
            sizes.lookahead = lookahead;
            sizes.plan(opts.budget_bytes, opts.priority)
        };
        let mut residency = plan_with(&mut sizes, opts.lookahead != Lookahead::Off)?;
        let mut warnings = warnings;
        let mut lookahead_on = opts.lookahead != Lookahead::Off;
        let streamed_gates = residency.gate_resident.iter().filter(|&&g| !g).count();
        if opts.lookahead == Lookahead::FromGates && streamed_gates == cfg.n_layers {
            // Nothing to predict with: the lookahead's buffers are worth more as cache.
            residency = plan_with(&mut sizes, false)?;
            lookahead_on = false;
            warnings.push(
                "lookahead is off: this mask's lookahead predicts from resident gates, and no layer's gate is resident \
                 under this budget (--residency gate-first or a larger --ram-budget keeps them; the exact criterion \
                 needs none)"
                    .into(),
            );
        } else if opts.lookahead == Lookahead::FromGates && streamed_gates > 0 {
            warnings.push(format!(
                "lookahead predicts from resident gates, and {streamed_gates} of {} layers' gates stream under this \
                 budget: those layers get no lookahead (--residency gate-first or a larger --ram-budget keeps them; \
                 the exact criterion needs none)",
                cfg.n_layers
            ));
        }
        // Reads stay within the reader's reusable buffers, even widened by a block at each end
        // (a larger read would get a one-off buffer and pay first-touch page faults).
        let max_read_bytes = opts
            .reader
            .slot_bytes
            .saturating_sub(2 * crate::io::ALIGN_BYTES)
            .max(crate::io::ALIGN_BYTES) as u64;
        let mut cost = match opts.cost {
            CostSource::Probe => plan::probe(fg.as_ref(), 1024, 32 << 20, opts.reader.slot_bytes, max_read_bytes)?,
            CostSource::Default => CostModel {
                max_read_bytes,
                ..CostModel::default_for(fg.align_bytes() as u64)
            },
            CostSource::Given {
                request_us,
                bytes_per_us,
            } => CostModel {
                request_us,
                bytes_per_us,
                align_bytes: fg.align_bytes().max(1) as u64,
                max_read_bytes,
            },
        };
        if let Some(gap) = opts.merge_gap_bytes {
            cost.request_us = gap as f64 / cost.bytes_per_us;
        }
        // Page-cache engines keep resident weights as views of a map of the file (the walk
        // path); the others copy them into memory once, bypassing the page cache where O_DIRECT
        // is on. Either way the streamer owns them: the model is not changed.
        let map = match opts.engine {
            ReadEngine::Mmap => {
                let f = std::fs::File::open(&model.path).map_err(|e| Error::io(&model.path, e))?;
                // SAFETY: the file is opened read-only and the map is only read; like every map of
                // a model file here, it assumes the file is not truncated while the process runs
                // (the same assumption `gguf`, `safetensors` and `gstfile` make for theirs).
                Some(Arc::new(
                    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(&model.path, e))?,
                ))
            }
            _ => None,
        };
        let load = |w: &Weight| -> Result<Weight> {
            let offset = w
                .file_offset()
                .ok_or_else(|| Error::Invalid(format!("{}: streaming needs the weight's place in the file", w.name)))?;
            match &map {
                Some(m) => {
                    let end = offset as usize + w.len_bytes();
                    if end > m.len() {
                        return Err(Error::Invalid(format!(
                            "{}: {} ends at byte {end}, past the end of the file ({} bytes)",
                            model.path.display(),
                            w.name,
                            m.len()
                        )));
                    }
                    Ok(Weight::mapped(
                        &w.name,
                        w.ty,
                        w.rows,
                        w.cols,
                        m.clone(),
                        offset as usize,
                        w.row_stride_bytes,
                    ))
                }
                None => Weight::owned(&w.name, w.ty, w.rows, w.cols, fg.read_vec(offset, w.len_bytes())?),
            }
        };
        let w = &model.weights;
        let output = load(&w.output)?;
        let embedding = if tied { None } else { Some(Part::of(&w.token_embd)?) };
        let mut resident_attn = Vec::with_capacity(cfg.n_layers);
        let mut resident_gate = Vec::with_capacity(cfg.n_layers);
        for (l, lw) in w.layers.iter().enumerate() {
            let a = &lw.attn;
            if residency.attention_resident[l] {
                resident_attn.push(Some(AttnWeights {
                    wq: load(&a.wq)?,
                    wk: load(&a.wk)?,
                    wv: load(&a.wv)?,
                    wo: load(&a.wo)?,
                }));
            } else {
                resident_attn.push(None);
                layers[l].attn = Some([Part::of(&a.wq)?, Part::of(&a.wk)?, Part::of(&a.wv)?, Part::of(&a.wo)?]);
            }
            if residency.gate_resident[l] {
                resident_gate.push(Some(load(&lw.ffn_gate)?));
            } else {
                resident_gate.push(None);
                layers[l].gate = Some(Part::of(&lw.ffn_gate)?);
            }
        }
        // Neuron caches start with each layer's first neurons (the hot prefix of a hot-first file).
        let mut caches = Vec::with_capacity(cfg.n_layers);
        for (l, parts) in layers.iter().enumerate() {
            let slots = residency.cache_neurons[l];
            let mut c = LayerCache::new(opts.cache, cfg.ffn, slots, parts.up.row_bytes, parts.down.row_bytes);
            if slots > 0 {
                let read_rows = |p: &Part| -> Result<Vec<u8>> {
                    let r = p.range_of(slots);
                    fg.read_vec(r.offset_bytes, r.len_bytes)
                };
                let (up, down) = (read_rows(&parts.up)?, read_rows(&parts.down)?);
                for n in 0..slots {
                    let (u, d) = (n * parts.up.stride_bytes, n * parts.down.stride_bytes);
                    c.fill(
                        n,
                        n as u32,
                        &up[u..u + parts.up.row_bytes],
                        &down[d..d + parts.down.row_bytes],
                    );
                }
            }
            caches.push(c);
        }
        if opts.prefetch_ffn {
            for (l, p) in layers.iter_mut().enumerate() {
                let spans = p.ffn_extents_from(residency.cache_neurons[l]);
                // Only touching rows merge: the ranges hold exactly the rows.
                let exact = CostModel {
                    request_us: 0.0,
                    bytes_per_us: 1.0,
                    align_bytes: 1,
                    max_read_bytes: u64::MAX,
                };
                let mut reads = Vec::new();
                plan(&spans, &exact, &mut reads);
                p.ffn_ranges = reads.iter().map(|r| r.range).collect();
            }
        }
        let max_row = |f: fn(&LayerParts) -> usize| layers.iter().map(f).max().unwrap_or(0);
        let mut staging_up = vec![0u8; cfg.ffn * max_row(|p| p.up.row_bytes)];
        let mut staging_down = vec![0u8; cfg.ffn * max_row(|p| p.down.row_bytes)];
        prefault(&mut staging_up);
        prefault(&mut staging_down);
        let dense_bytes_per_token = dense_plan_bytes(&layers, &residency, &cost, embedding.as_ref());
        fg.reset_stats();
        let prefetcher = Prefetcher::start(bg.clone(), max_read_bytes as usize)?;
        let lookahead = match (lookahead_on, ahead) {
            (false, _) => None,
            (true, r) => {
                // Without a reader of its own it shares the prefetch thread's (tests).
                let r = r.unwrap_or_else(|| bg.clone());
                r.reset_stats();
                Some((Prefetcher::start(r.clone(), max_read_bytes as usize)?, r))
            }
        };
        Ok(Streamer {
            batch_tokens_max: opts.batch_tokens_max.max(1),
            kv_positions: opts.kv_positions,
            residency,
            cost,
            engine: opts.engine,
            direct_io,
            warnings,
            dense_bytes_per_token,
            fg,
            bg,
            prefetcher,
            lookahead,
            layers,
            embedding,
            output,
            resident_attn,
            resident_gate,
            hidden: cfg.hidden,
            pass: Mutex::new(()),
            state: Mutex::new(State {
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
                decode: None,
            }),
            decode_start: Mutex::new(None),
        })
    }

    /// Reads a whole matrix of the model (e.g. every up row, to build sketches) through the
    /// compute thread's reader into memory; strided rows (a bundled layout) come out contiguous.
    /// The read is counted like any other (`read_stats`).
    pub fn read_matrix(&self, w: &Weight) -> Result<Weight> {
        let p = Part::of(w)?;
        let span = p.range_of(p.rows);
        let bytes = self.fg.read_vec(span.offset_bytes, span.len_bytes)?;
        let mut rows = Vec::with_capacity(p.rows * p.row_bytes);
        for r in 0..p.rows {
            let at = r * p.stride_bytes;
            rows.extend_from_slice(&bytes[at..at + p.row_bytes]);
        }
        Weight::owned(&w.name, w.ty, w.rows, w.cols, rows)
    }

    /// Counters and device reads since the prompt's pass (decode steps only), or since opening
    /// when no prompt was marked.
    pub fn decode_counters(&self) -> (Counters, ReadStats) {
        let (c, r) = (self.counters(), self.read_stats());
        match *self.decode_start.lock().expect("decode start") {
            Some((c0, r0)) => (c.minus(&c0), r.combine(&r0, -1)),
            None => (c, r),
        }
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

    /// Makes layer `l`'s dense parts current (waiting for the prefetch if needed) and requests
    /// the next streamed layer's.
    fn advance(&self, st: &mut State, l: usize) -> Result<()> {
        if let Some((_, buf)) = st.current.take() {
            if let Ok(v) = Arc::try_unwrap(buf) {
                st.spare.push(v);
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
                self.prefetcher.submit(l, self.layers[l].dense_ranges(), buf)?;
                st.pending.push_back(l);
            }
            let t0 = Instant::now();
            let done = self.prefetcher.next()?;
            st.pending.pop_front();
            st.counters.io_wait_ns += t0.elapsed().as_nanos() as u64;
            debug_assert_eq!(done.key, l);
            st.counters.dense_needed_bytes += done.buf.len() as u64;
            done.result?;
            st.current = Some((l, Arc::new(done.buf)));
        }
        if st.pending.is_empty() {
            if let Some(m) = self.next_streamed(l) {
                let buf = st.spare.pop().unwrap_or_default();
                self.prefetcher.submit(m, self.layers[m].dense_ranges(), buf)?;
                st.pending.push_back(m);
            }
        }
        Ok(())
    }

    /// Sorts `extents` (`(offset, len, tag)`) by offset and plans their reads into `planned`.
    fn plan_extents<T: Copy>(&self, extents: &mut [(u64, usize, T)], planned: &mut Vec<PlannedRead>) -> PlanTotals {
        extents.sort_unstable_by_key(|e| e.0);
        let spans: Vec<(u64, usize)> = extents.iter().map(|e| (e.0, e.1)).collect();
        plan(&spans, &self.cost, planned)
    }

    /// Reads `planned` (planned from `extents`) on the compute thread's reader, calling
    /// `on_extent(tag, bytes)` for every extent as its read lands.
    fn read_extents<T: Copy>(
        &self,
        extents: &[(u64, usize, T)],
        planned: &[PlannedRead],
        on_extent: &mut dyn FnMut(T, &[u8]),
    ) -> Result<()> {
        if planned.is_empty() {
            return Ok(());
        }
        let ranges: Vec<Range> = planned.iter().map(|p| p.range).collect();
        self.fg.read_each(&ranges, &mut |ri, bytes| {
            let p = planned[ri];
            for &(o, len, tag) in &extents[p.first..p.first + p.count] {
                let at = (o - p.range.offset_bytes) as usize;
                on_extent(tag, &bytes[at..at + len]);
            }
            Ok(())
        })
    }

    /// Layer `l`'s lookahead read, waited for, if one was submitted; stale ones (for other
    /// layers, left by a pass that ended early or a prompt's pass) are waited for and dropped.
    fn take_ahead(&self, st: &mut State, l: usize) -> Result<Option<Ahead>> {
        let Some((pf, _)) = &self.lookahead else {
            return Ok(None);
        };
        while let Some(mut a) = st.ahead.pop_front() {
            let t0 = Instant::now();
            let done = pf.next()?;
            st.counters.io_wait_ns += t0.elapsed().as_nanos() as u64;
            done.result?;
            if a.layer == l {
                a.buf = done.buf;
                return Ok(Some(a));
            }
            st.ahead_spare.push(done.buf);
        }
        Ok(None)
    }

    /// The layer whose lookahead prediction layer `l`'s FFN should make, and that layer's
    /// resident gate when the prediction needs one (see [`LayerStream::lookahead_target`]).
    fn lookahead_target_of(&self, l: usize, reads_input: bool) -> Option<(usize, Option<Weight>)> {
        self.lookahead.as_ref()?;
        let n_layers = self.layers.len();
        let next = match (l + 1 < n_layers, reads_input) {
            (true, _) => l + 1,
            // Into the next token's first layer only when the input does not matter.
            (false, false) => 0,
            (false, true) => return None,
        };
        if !reads_input {
            return Some((next, None));
        }
        // A layer whose gate streams gets no lookahead.
        let gate = self.resident_gate[next].clone()?;
        Some((next, Some(gate)))
    }

    /// Submits the read of the predicted neurons of layer `next` (`need`) that the cache lacks to
    /// the lookahead thread.
    fn submit_ahead(&self, st: &mut State, next: usize, need: &[bool], with_down: bool) -> Result<()> {
        let Some((pf, _)) = &self.lookahead else {
            return Ok(());
        };
        let parts = &self.layers[next];
        let cache = &st.caches[next];
        let mut spans = Vec::new();
        let predicted: Vec<u32> = (0..need.len() as u32)
            .filter(|&n| need[n as usize] && cache.slot(n).is_none())
            .collect();
        for &n in &predicted {
            spans.push(parts.up.extent(n));
            if with_down {
                spans.push(parts.down.extent(n));
            }
        }
        if spans.is_empty() {
            return Ok(());
        }
        spans.sort_unstable_by_key(|s| s.0);
        let mut planned = Vec::new();
        let totals = plan(&spans, &self.cost, &mut planned);
        let ranges: Vec<Range> = planned.iter().map(|p| p.range).collect();
        let mut starts = Vec::with_capacity(ranges.len());
        let mut at = 0;
        for r in &ranges {
            starts.push(at);
            at += r.len_bytes;
        }
        let buf = st.ahead_spare.pop().unwrap_or_default();
        pf.submit(next, ranges.clone(), buf)?;
        st.counters.ahead_neurons += predicted.len() as u64;
        st.counters.ahead_bytes += totals.needed_bytes;
        st.ahead.push_back(Ahead {
            layer: next,
            ranges,
            starts,
            buf: Vec::new(),
            neuron_bytes: totals.needed_bytes / predicted.len() as u64,
            predicted,
        });
        Ok(())
    }

    /// A view of part `p` of the current layer's dense buffer; `at` is its byte offset there.
    fn view(st: &State, p: &Part, at: usize) -> Result<Weight> {
        let (_, buf) = st.current.as_ref().expect("current layer");
        Weight::shared(&p.name, p.ty, p.rows, p.cols, buf.clone(), at)
    }

    /// The decode step's up phase (see [`LayerStream::decode_up`]): hits from their slots,
    /// misses read (with their down columns too when `with_down`), misses the lookahead read
    /// taken from its buffer as if their reads had landed. The two pool threads split the
    /// work: one submits the misses' reads and hands each up row over as it completes, the
    /// other hands over the hits meanwhile. Only missed rows are copied (into staging, for the
    /// cache and the down phase).
    fn decode_up_rows(
        &self,
        l: usize,
        up_set: &[u32],
        with_down: bool,
        available: &mut (dyn FnMut(&[(u32, &[u8])]) + Send),
        landed: &mut (dyn FnMut(u32, &[u8]) + Send),
    ) -> Result<()> {
        let mut guard = self.state.lock().expect("stream state");
        let st = &mut *guard;
        let parts = &self.layers[l];
        let (ur, dr) = (parts.up.row_bytes, parts.down.row_bytes);
        let step = st.counters.passes;
        let ahead = st.decode.take().and_then(|d| d.ahead.filter(|a| a.layer == l));
        let State {
            caches,
            staging_up,
            staging_down,
            plan: planned,
            counters,
            ..
        } = st;
        let cache = &mut caches[l];
        let (su, sd) = (unique(staging_up), unique(staging_down));
        let (mut hits, mut misses) = (Vec::new(), Vec::new());
        for &n in up_set {
            match cache.slot(n) {
                Some(slot) => {
                    cache.touch(slot, step);
                    hits.push((n, slot));
                }
                None => misses.push(n),
            }
        }
        counters.cache_lookups += up_set.len() as u64;
        counters.cache_hits += hits.len() as u64;
        // (offset, len, (is_down, row in `misses`))
        let mut extents: Vec<(u64, usize, (bool, u32))> = Vec::with_capacity(2 * misses.len());
        let mut from_ahead: Vec<(&[u8], (bool, u32))> = Vec::new();
        for (i, &n) in misses.iter().enumerate() {
            let mut want = |(o, len): (u64, usize), tag: (bool, u32)| match ahead.as_ref().and_then(|a| a.get(o, len)) {
                Some(b) => from_ahead.push((b, tag)),
                None => extents.push((o, len, tag)),
            };
            want(parts.up.extent(n), (false, i as u32));
            if with_down {
                want(parts.down.extent(n), (true, i as u32));
            }
        }
        if let Some(a) = &ahead {
            let used = misses.iter().filter(|n| a.predicted.binary_search(n).is_ok()).count() as u64;
            counters.ahead_used_neurons += used;
            counters.ahead_used_bytes += used * a.neuron_bytes;
            let served: u64 = from_ahead.iter().map(|(b, _)| b.len() as u64).sum();
            counters.ahead_served_bytes += served;
            counters.ffn_needed_bytes += served;
        }
        let totals = self.plan_extents(&mut extents, planned);
        let cache_ro: &LayerCache = cache;
        let planned_ro: &[PlannedRead] = planned;
        let hit_rows: Vec<(u32, &[u8])> = hits.iter().map(|&(n, s)| (n, cache_ro.rows(s).0)).collect();
        let misses_ro = &misses;
        let t0 = Instant::now();
        let (read, hits_s) = rayon::join(
            || {
                let mut land = |(is_down, row): (bool, u32), src: &[u8]| {
                    let row = row as usize;
                    if is_down {
                        sd[row * dr..(row + 1) * dr].copy_from_slice(src);
                    } else {
                        landed(misses_ro[row], src);
                        su[row * ur..(row + 1) * ur].copy_from_slice(src);
                    }
                };
                for &(src, tag) in &from_ahead {
                    land(tag, src);
                }
                self.read_extents(&extents, planned_ro, &mut land)
            },
            || {
                let t = Instant::now();
                available(&hit_rows);
                t.elapsed()
            },
        );
        counters.io_wait_ns += t0.elapsed().saturating_sub(hits_s).as_nanos() as u64;
        read?;
        if !extents.is_empty() {
            counters.ffn_needed_bytes += totals.needed_bytes;
            counters.ffn_device_bytes += totals.device_bytes;
            counters.ffn_reads += totals.reads;
        }
        if let Some(a) = ahead {
            st.ahead_spare.push(a.buf);
        }
        st.decode = Some(DecodeStep {
            layer: l,
            hits,
            misses,
            with_down,
            ahead: None,
        });
        Ok(())
    }

    /// The decode step's down phase (see [`LayerStream::decode_down`]).
    fn decode_down_rows(
        &self,
        l: usize,
        kept: &dyn Fn(u32) -> bool,
        available: &mut (dyn FnMut(&[(u32, &[u8])], bool) + Send),
        landed: &mut (dyn FnMut(u32, &[u8]) + Send),
    ) -> Result<()> {
        let mut guard = self.state.lock().expect("stream state");
        let st = &mut *guard;
        let Some(d) = st.decode.take().filter(|d| d.layer == l) else {
            return Err(Error::Invalid(format!(
                "layer {l}: the decode step's down phase came without its up phase"
            )));
        };
        let parts = &self.layers[l];
        let (ur, dr) = (parts.up.row_bytes, parts.down.row_bytes);
        let step = st.counters.passes;
        let State {
            caches,
            staging_up,
            staging_down,
            counters,
            ..
        } = st;
        let cache = &mut caches[l];
        let (su, sd) = (unique(staging_up), unique(staging_down));
        // Rows in memory: the kept hits' down columns, then (one pass) the kept misses' staged ones.
        let mut rows: Vec<(u32, &[u8])> = Vec::new();
        let cache_ro: &LayerCache = cache;
        for &(n, slot) in &d.hits {
            if kept(n) {
                rows.push((n, cache_ro.rows(slot).1));
            }
        }
        let mut down_misses: Vec<u32> = Vec::new();
        if d.with_down {
            for (i, &n) in d.misses.iter().enumerate() {
                if kept(n) {
                    rows.push((n, &sd[i * dr..(i + 1) * dr]));
                }
            }
        } else {
            down_misses = d.misses.iter().copied().filter(|&n| kept(n)).collect();
        }
        // The second pass's down columns, kept for the cache.
        let mut dcopy: Vec<u8> = Vec::new();
        if down_misses.is_empty() {
            available(&rows, false);
        } else {
            // Second pass (the exact criterion): read the kept misses' down columns and hand each
            // over as it lands, while the other thread takes the hits.
            let mut dext: Vec<(u64, usize, u32)> = down_misses
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let (o, len) = parts.down.extent(n);
                    (o, len, i as u32)
                })
                .collect();
            let mut dplan = Vec::new();
            let totals = self.plan_extents(&mut dext, &mut dplan);
            dcopy.resize(down_misses.len() * dr, 0);
            let t0 = Instant::now();
            let (read, hits_s) = rayon::join(
                || {
                    self.read_extents(&dext, &dplan, &mut |i, src| {
                        let i = i as usize;
                        landed(down_misses[i], src);
                        dcopy[i * dr..(i + 1) * dr].copy_from_slice(src);
                    })
                },
                || {
                    let t = Instant::now();
                    available(&rows, true);
                    t.elapsed()
                },
            );
            counters.io_wait_ns += t0.elapsed().saturating_sub(hits_s).as_nanos() as u64;
            read?;
            counters.ffn_needed_bytes += totals.needed_bytes;
            counters.ffn_device_bytes += totals.device_bytes;
            counters.ffn_reads += totals.reads;
        }
        drop(rows);
        // File the neurons read whole in the cache (their up row and down column are staged).
        if d.with_down {
            for (i, &n) in d.misses.iter().enumerate() {
                cache.offer(n, &su[i * ur..(i + 1) * ur], &sd[i * dr..(i + 1) * dr], step);
            }
        } else {
            for (i, &n) in down_misses.iter().enumerate() {
                let j = d.misses.binary_search(&n).expect("a kept miss had its up row read");
                cache.offer(n, &su[j * ur..(j + 1) * ur], &dcopy[i * dr..(i + 1) * dr], step);
            }
        }
        Ok(())
    }

    /// Reads the up rows of `up_set` and the down columns of `down_set` (each sorted) into the
    /// staging buffers, row i of each holding the set's i-th neuron; the cache serves what it
    /// holds. `staged_up` names the neurons whose up rows the staging buffer holds after this
    /// call (for filing newly read neurons in the cache).
    fn fetch(&self, st: &mut State, l: usize, up_set: &[u32], down_set: &[u32], staged_up: &[u32]) -> Result<()> {
        let parts = &self.layers[l];
        let (ur, dr) = (parts.up.row_bytes, parts.down.row_bytes);
        let step = st.counters.passes;
        let State {
            caches,
            staging_up,
            staging_down,
            plan: planned,
            counters,
            current,
            ..
        } = st;
        let prefetched: &[u8] = match current {
            Some((cl, buf)) if *cl == l => buf,
            _ => &[],
        };
        let cache = &mut caches[l];
        let (su, sd) = (unique(staging_up), unique(staging_down));
        // (offset, len, (is_down, staging row))
        let mut extents: Vec<(u64, usize, (bool, u32))> = Vec::new();
        let mut misses_down = Vec::new();
        for (i, &n) in up_set.iter().enumerate() {
            counters.cache_lookups += 1;
            match cache.get(n, step) {
                Some((u, _)) => {
                    su[i * ur..(i + 1) * ur].copy_from_slice(u);
                    counters.cache_hits += 1;
                }
                None => {
                    let (o, len) = parts.up.extent(n);
                    match parts.prefetched(prefetched, o, len) {
                        Some(b) => su[i * ur..(i + 1) * ur].copy_from_slice(b),
                        None => extents.push((o, len, (false, i as u32))),
                    }
                }
            }
        }
        for (i, &n) in down_set.iter().enumerate() {
            // A neuron counted with its up row is one lookup, not two.
            let counted = up_set.binary_search(&n).is_ok();
            match cache.get(n, step) {
                Some((_, d)) => {
                    sd[i * dr..(i + 1) * dr].copy_from_slice(d);
                    if !counted {
                        counters.cache_lookups += 1;
                        counters.cache_hits += 1;
                    }
                }
                None => {
                    if !counted {
                        counters.cache_lookups += 1;
                    }
                    let (o, len) = parts.down.extent(n);
                    match parts.prefetched(prefetched, o, len) {
                        Some(b) => sd[i * dr..(i + 1) * dr].copy_from_slice(b),
                        None => extents.push((o, len, (true, i as u32))),
                    }
                    misses_down.push(i);
                }
            }
        }
        if !extents.is_empty() {
            let totals = self.plan_extents(&mut extents, planned);
            let t0 = Instant::now();
            self.read_extents(&extents, planned, &mut |(is_down, row), src| {
                let row = row as usize;
                if is_down {
                    sd[row * dr..(row + 1) * dr].copy_from_slice(src);
                } else {
                    su[row * ur..(row + 1) * ur].copy_from_slice(src);
                }
            })?;
            counters.io_wait_ns += t0.elapsed().as_nanos() as u64;
            counters.ffn_needed_bytes += totals.needed_bytes;
            counters.ffn_device_bytes += totals.device_bytes;
            counters.ffn_reads += totals.reads;
        }
        // File the neurons just read whole (up and down) in the cache.
        for i in misses_down {
            let n = down_set[i];
            if let Ok(j) = staged_up.binary_search(&n) {
                cache.offer(n, &su[j * ur..(j + 1) * ur], &sd[i * dr..(i + 1) * dr], step);
            }
        }
        Ok(())
    }
}

/// What dense streaming reads per token under `residency`: streamed attention and gate, every
/// neuron the pinned cache does not hold, and one embedding row — planned like the real reads.
fn dense_plan_bytes(layers: &[LayerParts], residency: &Residency, cost: &CostModel, embd: Option<&Part>) -> u64 {
    let mut total = 0;
    let mut out = Vec::new();
    for (l, p) in layers.iter().enumerate() {
        let mut spans: Vec<(u64, usize)> = p
            .matrix_ranges()
            .iter()
            .map(|r| (r.offset_bytes, r.len_bytes))
            .collect();
        spans.extend(p.ffn_extents_from(residency.cache_neurons[l]));
        spans.sort_unstable_by_key(|s| s.0);
        total += plan(&spans, cost, &mut out).device_bytes;
    }
    if let Some(e) = embd {
        total += plan(&[(e.offset_bytes, e.row_bytes)], cost, &mut out).device_bytes;
    }
    total
}

impl LayerStream for Streamer {
    fn prefill_done(&self) {
        *self.decode_start.lock().expect("decode start") = Some((self.counters(), self.read_stats()));
    }

    fn pass_lock(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        // A pass that panicked leaves nothing half-done that a lock could protect (the state
        // recovers from an out-of-step prefetch), so a poisoned lock is taken as it is.
        Some(self.pass.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn output(&self) -> Option<Weight> {
        Some(self.output.clone())
    }

    fn batch_tokens_max(&self) -> Option<usize> {
        Some(self.batch_tokens_max)
    }

    fn kv_positions(&self) -> Option<usize> {
        Some(self.kv_positions)
    }

    fn embedding(&self, tok: u32, out: &mut [f32]) -> Result<bool> {
        let Some(e) = &self.embedding else {
            // Tied: the output matrix is the embedding, and it is resident.
            self.output.dequantize_row(tok as usize, out);
            return Ok(true);
        };
        let (o, len) = e.extent(tok);
        let t0 = Instant::now();
        let bytes = self.fg.read_vec(o, len)?;
        let mut st = self.state.lock().expect("stream state");
        st.counters.io_wait_ns += t0.elapsed().as_nanos() as u64;
        st.counters.dense_needed_bytes += len as u64;
        crate::quant::dequantize_row(e.ty, &bytes, out);
        Ok(true)
    }

    fn attention(&self, l: usize) -> Result<Option<AttnWeights>> {
        let mut st = self.state.lock().expect("stream state");
        if l == 0 {
            st.counters.passes += 1;
        }
        self.advance(&mut st, l)?;
        match &self.layers[l].attn {
            None => Ok(self.resident_attn[l].clone()),
            Some([q, k, v, o]) => {
                let mut at = 0;
                let mut next = |p: &Part| {
                    let w = Streamer::view(&st, p, at);
                    at += p.rows * p.row_bytes;
                    w
                };
                Ok(Some(AttnWeights {
                    wq: next(q)?,
                    wk: next(k)?,
                    wv: next(v)?,
                    wo: next(o)?,
                }))
            }
        }
    }

    fn streams_ffn(&self) -> bool {
        true
    }

    fn gate(&self, l: usize) -> Result<Option<Weight>> {
        let parts = &self.layers[l];
        match &parts.gate {
            Some(g) => {
                let st = self.state.lock().expect("stream state");
                let at = parts.attn.iter().flatten().map(|p| p.rows * p.row_bytes).sum();
                Streamer::view(&st, g, at).map(Some)
            }
            None => Ok(self.resident_gate[l].clone()),
        }
    }

    fn stage(&self, l: usize, up_set: &[u32], with_down: bool) -> Result<(Weight, Option<Weight>)> {
        let mut st = self.state.lock().expect("stream state");
        self.fetch(&mut st, l, up_set, if with_down { up_set } else { &[] }, up_set)?;
        let (parts, m) = (&self.layers[l], up_set.len());
        let up = Weight::shared(&parts.up.name, parts.up.ty, m, self.hidden, st.staging_up.clone(), 0)?;
        let down = match with_down {
            true => Some(Weight::shared(
                &parts.down.name,
                parts.down.ty,
                m,
                self.hidden,
                st.staging_down.clone(),
                0,
            )?),
            false => None,
        };
        Ok((up, down))
    }

    fn stage_down(&self, l: usize, down_set: &[u32], staged_up: &[u32]) -> Result<Weight> {
        let mut st = self.state.lock().expect("stream state");
        self.fetch(&mut st, l, &[], down_set, staged_up)?;
        let parts = &self.layers[l];
        Weight::shared(
            &parts.down.name,
            parts.down.ty,
            down_set.len(),
            self.hidden,
            st.staging_down.clone(),
            0,
        )
    }

    fn begin_decode(&self, l: usize) -> Result<()> {
        let mut st = self.state.lock().expect("stream state");
        let ahead = self.take_ahead(&mut st, l)?;
        st.decode = Some(DecodeStep {
            layer: l,
            hits: Vec::new(),
            misses: Vec::new(),
            with_down: false,
            ahead,
        });
        Ok(())
    }

    fn lookahead_target(&self, l: usize, reads_input: bool) -> Option<(usize, Option<Weight>)> {
        self.lookahead_target_of(l, reads_input)
    }

    fn read_ahead(&self, layer: usize, need: &[bool], with_down: bool) -> Result<()> {
        let mut st = self.state.lock().expect("stream state");
        self.submit_ahead(&mut st, layer, need, with_down)
    }

    fn decode_up(
        &self,
        l: usize,
        up_set: &[u32],
        with_down: bool,
        available: &mut (dyn FnMut(&[(u32, &[u8])]) + Send),
        landed: &mut (dyn FnMut(u32, &[u8]) + Send),
    ) -> Result<()> {
        self.decode_up_rows(l, up_set, with_down, available, landed)
    }

    fn decode_down(
        &self,
        l: usize,
        kept: &dyn Fn(u32) -> bool,
        available: &mut (dyn FnMut(&[(u32, &[u8])], bool) + Send),
        landed: &mut (dyn FnMut(u32, &[u8]) + Send),
    ) -> Result<()> {
        self.decode_down_rows(l, kept, available, landed)
    }
}

/// Peak resident set size of this process (VmHWM), bytes; 0 where /proc is unavailable.
pub fn peak_rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Returns freed heap memory to the system (glibc keeps freed blocks for reuse otherwise), so a
/// second run in the same process measures its own peak.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory held by the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Restarts the peak RSS count from the current RSS (Linux: `/proc/self/clear_refs` = 5);
/// returns false where that is not possible.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// End-of-run figures of a streamed generation, per decoded token (the prompt's pass left out).
#[derive(Clone, Debug, serde::Serialize)]
pub struct StreamReport {
    pub engine: &'static str,
    pub direct_io: bool,
    pub ram_budget_bytes: u64,
    pub residency: Residency,
    pub cost_model: CostModel,
    /// Decode steps measured (generated tokens after the first, which the prompt's pass yields).
    pub decode_tokens: u64,
    pub decode_tok_per_s: f64,
    /// Bytes the device transferred per decode step (both readers, alignment included).
    pub disk_bytes_per_token: f64,
    /// What dense streaming reads per token under the same budget (planned by the same read
    /// planner; `run --mode compare` also measures it).
    pub dense_disk_bytes_per_token: f64,
    /// Device bytes per byte needed (FFN rows, streamed matrices, embedding rows).
    pub read_amplification: f64,
    /// Share of needed FFN neurons the neuron cache served.
    pub cache_hit_rate: f64,
    /// Share of decode time the compute thread waited for reads.
    pub io_wait_fraction: f64,
    pub peak_rss_bytes: u64,
    /// With lookahead: how well it predicted.
    pub lookahead: Option<LookaheadReport>,
    pub counters: Counters,
}

/// Lookahead figures per decoded token (see [`Streamer`]).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct LookaheadReport {
    /// Share of the neurons read ahead that the layer then used.
    pub hit_rate: f64,
    /// Share of the FFN bytes the layers needed from disk that lookahead had read.
    pub coverage: f64,
    /// Rows read ahead and not used (bytes of the rows; device bytes include merged gaps).
    pub wasted_bytes_per_token: f64,
}

impl StreamReport {
    pub fn new(s: &Streamer, g: &crate::model::generate::Generation) -> StreamReport {
        let (c, r) = s.decode_counters();
        let steps = c.passes.max(1) as f64;
        let needed = (c.ffn_needed_bytes + c.dense_needed_bytes) as f64;
        StreamReport {
            engine: match s.engine {
                ReadEngine::Uring => "uring",
                ReadEngine::Pread => "pread",
                ReadEngine::Mmap => "mmap",
            },
            direct_io: s.direct_io,
            ram_budget_bytes: s.residency.budget_bytes,
            residency: s.residency.clone(),
            cost_model: s.cost,
            decode_tokens: c.passes,
            decode_tok_per_s: g.decode_tok_per_s,
            disk_bytes_per_token: r.bytes_device as f64 / steps,
            dense_disk_bytes_per_token: s.dense_bytes_per_token as f64,
            read_amplification: if needed > 0.0 {
                r.bytes_device as f64 / needed
            } else {
                1.0
            },
            cache_hit_rate: if c.cache_lookups > 0 {
                c.cache_hits as f64 / c.cache_lookups as f64
            } else {
                0.0
            },
            io_wait_fraction: if g.decode_s > 0.0 {
                (c.io_wait_ns as f64 / 1e9 / g.decode_s).min(1.0)
            } else {
                0.0
            },
            peak_rss_bytes: peak_rss_bytes(),
            lookahead: s.lookahead.as_ref().map(|_| LookaheadReport {
                hit_rate: c.ahead_used_neurons as f64 / c.ahead_neurons.max(1) as f64,
                coverage: c.ahead_served_bytes as f64 / c.ffn_needed_bytes.max(1) as f64,
                wasted_bytes_per_token: c.ahead_bytes.saturating_sub(c.ahead_used_bytes) as f64 / steps,
            }),
            counters: c,
        }
    }
}
