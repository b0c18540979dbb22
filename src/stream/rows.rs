//! The weight provider (`LayerStream`, `RowStream` and `ExpertStream` for `Streamer`) and the FFN rows a layer needs,
//! handed over as bytes: staged in neuron order for a pass over many tokens (`fetch`), or, for
//! a decode step, where they are — cache slots, and reads as they land (`decode_up`,
//! `decode_down`) — and the lookahead's reads of a predicted set. Plans reads with
//! [`super::plan`], counts everything in [`super::Counters`], files neurons read whole in the
//! cache. No arithmetic: the callers' callbacks compute.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use super::cache::LayerCache;
use super::plan::{plan, PlanTotals, PlannedRead};
use super::prefetch::Placement;
use super::{unique, Part, State, Streamer};
use crate::error::{Error, Result};
use crate::io::Range;
use crate::model::forward::{
    AttnWeights, DownRowsInMemory, ExpertCompute, ExpertLayer, ExpertStream, LayerStream, RowLanded, RowStream,
    RowsInMemory,
};
use crate::model::weights::{FfnDown, FfnWeights};
use crate::tensor::Weight;

/// A lookahead read: the rows predicted for `layer`, planned into `ranges` (sorted by offset),
/// which the lookahead thread reads back to back into `buf`.
pub(super) struct Ahead {
    pub(super) layer: usize,
    pub(super) ranges: Vec<Range>,
    /// Where each range starts in `buf` (empty until the read is done).
    pub(super) starts: Vec<usize>,
    pub(super) buf: Vec<u8>,
    /// The neurons predicted (sorted), and the bytes read for each (up row, and down column
    /// when the mask decides before up).
    pub(super) predicted: Vec<u32>,
    pub(super) neuron_bytes: u64,
}

impl Ahead {
    /// The bytes of file extent `(o, len)`, if a read of this lookahead covers it.
    pub(super) fn get(&self, o: u64, len: usize) -> Option<&[u8]> {
        let i = self.ranges.partition_point(|r| r.offset_bytes <= o).checked_sub(1)?;
        let r = self.ranges[i];
        if o + len as u64 > r.offset_bytes + r.len_bytes as u64 {
            return None;
        }
        let at = self.starts[i] + (o - r.offset_bytes) as usize;
        self.buf.get(at..at + len)
    }
}

/// One decode step's FFN rows between `decode_up` and `decode_down`: which of the up set the
/// cache held (neuron, slot) and which were read (their rows staged in that order).
pub(super) struct DecodeStep {
    pub(super) layer: usize,
    pub(super) hits: Vec<(u32, usize)>,
    pub(super) misses: Vec<u32>,
    pub(super) with_down: bool,
}

impl Streamer {
    /// Sorts `extents` (`(offset, len, tag)`) by offset and plans their reads into `planned`.
    pub(super) fn plan_extents<T: Copy>(
        &self,
        extents: &mut [(u64, usize, T)],
        planned: &mut Vec<PlannedRead>,
    ) -> PlanTotals {
        extents.sort_unstable_by_key(|e| e.0);
        let spans: Vec<(u64, usize)> = extents.iter().map(|e| (e.0, e.1)).collect();
        plan(&spans, &self.cost, planned)
    }

    /// Reads `planned` (planned from `extents`) on the compute thread's reader, calling
    /// `on_extent(tag, bytes)` for every extent as its read lands.
    pub(super) fn read_extents<T: Copy>(
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
    pub(super) fn take_ahead(&self, st: &mut State, l: usize) -> Result<Option<Ahead>> {
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
                a.starts = done.starts;
                return Ok(Some(a));
            }
            st.ahead_spare.push(done.buf);
        }
        Ok(None)
    }

    /// Submits the read of the predicted neurons of layer `next` (`need`) that the cache lacks to
    /// the lookahead thread.
    pub(super) fn submit_ahead(&self, st: &mut State, next: usize, need: &[bool], with_down: bool) -> Result<()> {
        let Some((pf, _)) = &self.lookahead else {
            return Ok(());
        };
        let parts = &self.layers[next];
        let cache = &st.caches[next];
        let mut spans = Vec::new();
        // Neither the device's hot neurons nor what the cache holds is read.
        let hot = self.hot_rows(next).map_or(0, |(u, _)| u.rows) as u32;
        let predicted: Vec<u32> = (hot..need.len() as u32)
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
        let buf = st.ahead_spare.pop().unwrap_or_default();
        pf.submit(next, ranges.clone(), buf, Placement::in_phase())?;
        st.counters.ahead_neurons += predicted.len() as u64;
        st.counters.ahead_bytes += totals.needed_bytes;
        st.ahead.push_back(Ahead {
            layer: next,
            ranges,
            starts: Vec::new(),
            buf: Vec::new(),
            neuron_bytes: totals.needed_bytes / predicted.len() as u64,
            predicted,
        });
        Ok(())
    }

    /// A view of part `p` of the current layer's dense buffer, the `i`-th of its `dense_ranges()`.
    pub(super) fn view(st: &State, p: &Part, i: usize) -> Result<Weight> {
        let c = st.current.as_ref().expect("current layer");
        Weight::shared(&p.name, p.ty, p.rows, p.cols, c.buf.clone(), c.starts[i]).map(Weight::volatile)
    }

    /// Views of layer `l`'s cache over the up rows (`up`) and down columns (`down`) of `set`
    /// (sorted) when the cache holds the set in consecutive slots in its order
    /// ([`LayerCache::run_of`]): a dense step over a cache that holds the whole layer (the plan
    /// without a RAM budget), or its hot prefix. Volatile, as staged rows are (a device copies
    /// them at each use; slots may change in a later step). Counted as cache hits; `None` (and
    /// nothing counted) when the set is not such a run or is empty.
    pub(super) fn run_views(
        &self,
        st: &mut State,
        l: usize,
        set: &[u32],
        up: bool,
        down: bool,
    ) -> Result<Option<(Option<Weight>, Option<Weight>)>> {
        let cache = &mut st.caches[l];
        let Some(first) = cache.run_of(set) else {
            return Ok(None);
        };
        let step = st.counters.passes;
        for s in first..first + set.len() {
            cache.touch(s, step);
        }
        let (ub, db) = cache.buffers();
        let view = |p: &Part, buf: &Arc<Vec<u8>>| p.slots(buf, first, set.len(), self.hidden).map(Weight::volatile);
        let parts = &self.layers[l];
        let up_w = up.then(|| view(&parts.up, ub)).transpose()?;
        let down_w = down.then(|| view(&parts.down, db)).transpose()?;
        let c = &mut st.counters;
        c.cache_lookups += set.len() as u64;
        c.cache_hits += set.len() as u64;
        let bytes = up_w.iter().chain(&down_w).map(|w| w.len_bytes() as u64).sum::<u64>();
        c.ffn_in_place_bytes += bytes;
        Ok(Some((up_w, down_w)))
    }

    /// Views of the current layer's prefetch buffer over the up rows and down columns of `set`
    /// (sorted) when it is every neuron the stream hands over (`first..ffn`: a dense step) and
    /// the layer's rows were laid out for it ([`super::FfnViews`]: the pinned cache's rows copied
    /// in front of the prefetched ones). Counted as the staging would be, and as bytes in place;
    /// `None` (nothing counted) otherwise.
    pub(super) fn prefetch_views(
        &self,
        st: &mut State,
        l: usize,
        set: &[u32],
        with_down: bool,
    ) -> Result<Option<(Weight, Weight)>> {
        let parts = &self.layers[l];
        let (Some(v), Some(c)) = (&parts.views, st.current.as_ref().filter(|c| c.layer == l)) else {
            return Ok(None);
        };
        let rows = parts.up.rows - v.first;
        // A sorted set of distinct neurons this long from `first` to the last is all of them.
        let every = set.len() == rows
            && set.first() == Some(&(v.first as u32))
            && set.last() == Some(&(parts.up.rows as u32 - 1));
        if !every || !with_down {
            return Ok(None);
        }
        let view = |p: &Part, m: usize| {
            let at = v.row_first_at(p, m, &c.starts);
            Weight::shared_strided(&p.name, p.ty, rows, self.hidden, c.buf.clone(), at, p.stride_bytes)
                .map(Weight::volatile)
        };
        let (up, down) = (view(&parts.up, 0)?, view(&parts.down, 1)?);
        let counters = &mut st.counters;
        counters.cache_lookups += rows as u64;
        counters.cache_hits += (v.cached - v.first) as u64;
        counters.ffn_in_place_bytes += (up.len_bytes() + down.len_bytes()) as u64;
        Ok(Some((up, down)))
    }

    /// Reads the up rows of `up_set` and the down columns of `down_set` (each sorted) into the
    /// staging buffers, row i of each holding the set's i-th neuron; the cache serves what it
    /// holds. `staged_up` names the neurons whose up rows the staging buffer holds after this
    /// call (for filing newly read neurons in the cache).
    pub(super) fn fetch(
        &self,
        st: &mut State,
        l: usize,
        up_set: &[u32],
        down_set: &[u32],
        staged_up: &[u32],
    ) -> Result<()> {
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
            pinned,
            retired,
            ..
        } = st;
        let (prefetched, starts): (&[u8], &[usize]) = match current {
            Some(c) if c.layer == l => (&c.buf, &c.starts),
            _ => (&[], &[]),
        };
        let cache = &mut caches[l];
        let (su, sd) = (
            unique(staging_up, pinned, retired),
            unique(staging_down, pinned, retired),
        );
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
                    match parts.prefetched(prefetched, starts, o, len) {
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
                    match parts.prefetched(prefetched, starts, o, len) {
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

impl LayerStream for Streamer {
    fn prefill_done(&self) {
        self.mark_decode_start();
    }

    fn pass_lock(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        // A pass that panicked leaves nothing half-done that a lock could protect (the state
        // recovers from an out-of-step prefetch), so a poisoned lock is taken as it is.
        Some(self.pass.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn output(&self) -> Option<&Weight> {
        Some(&self.output)
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

    fn attention(&self, l: usize) -> Result<Option<Cow<'_, AttnWeights>>> {
        let mut st = self.state.lock().expect("stream state");
        if l == 0 {
            st.counters.passes += 1;
        }
        if self.experts.is_some() {
            // Mixture of experts: attention is resident.
            return Ok(self.resident_attn[l].as_ref().map(Cow::Borrowed));
        }
        self.advance(&mut st, l)?;
        match &self.layers[l].attn {
            None => Ok(self.resident_attn[l].as_ref().map(Cow::Borrowed)),
            Some([q, k, v, o]) => Ok(Some(Cow::Owned(AttnWeights {
                wq: Streamer::view(&st, q, 0)?,
                wk: Streamer::view(&st, k, 1)?,
                wv: Streamer::view(&st, v, 2)?,
                wo: Streamer::view(&st, o, 3)?,
                mla: None,
            }))),
        }
    }

    /// Reads a whole matrix of the model (e.g. every up row, to build sketches) through the
    /// compute thread's reader into memory; strided rows (a bundled layout) come out contiguous.
    /// The read is counted like any other (`read_stats`).
    fn read_matrix(&self, w: &Weight) -> Result<Weight> {
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

    /// The `rows` layout: the layer's gate, up and down matrices, each resident or a view of
    /// the layer's prefetch buffer.
    fn ffn_weights(&self, l: usize) -> Result<Option<FfnWeights>> {
        // A leading dense layer of a mixture of experts: its resident FFN.
        if let Some(f) = self.experts.as_ref().and_then(|x| x.dense.get(l)?.as_ref()) {
            return Ok(Some(FfnWeights {
                gate: f.gate.clone(),
                up: f.up.clone(),
                down: match &f.down {
                    FfnDown::Rows(d) => FfnDown::Rows(d.clone()),
                    FfnDown::Columns(d) => FfnDown::Columns(d.clone()),
                },
            }));
        }
        let Some((up_kept, down_kept)) = self.resident_ffn.get(l) else {
            return Ok(None);
        };
        let parts = &self.layers[l];
        let st = self.state.lock().expect("stream state");
        let gate = match (&parts.gate, &self.resident_gate[l]) {
            (Some(g), _) => Streamer::view(&st, g, parts.gate_index())?,
            (None, Some(g)) => g.clone(),
            (None, None) => {
                return Err(Error::Internal(format!(
                    "layer {l}: its gate is neither resident nor streamed"
                )))
            }
        };
        let matrix = |part: &Option<super::Part>, index: usize, kept: &Option<Weight>| -> Result<Weight> {
            match (part, kept) {
                (Some(p), _) => Streamer::view(&st, p, index),
                (None, Some(w)) => Ok(w.clone()),
                (None, None) => Err(Error::Internal(format!(
                    "layer {l}: an FFN matrix is neither resident nor streamed"
                ))),
            }
        };
        Ok(Some(FfnWeights {
            gate,
            up: matrix(&parts.rows_up, parts.rows_up_index(), up_kept)?,
            down: FfnDown::Rows(matrix(&parts.rows_down, parts.rows_down_index(), down_kept)?),
        }))
    }

    fn ffn_rows(&self) -> Option<&dyn RowStream> {
        // Neuron-major files hand rows over; the `rows` layout hands whole matrices over
        // (`ffn_weights`) and experts go through `expert_stream`.
        (self.experts.is_none() && self.resident_ffn.is_empty()).then_some(self as &dyn RowStream)
    }

    fn expert_stream(&self) -> Option<&dyn ExpertStream> {
        self.experts.as_ref().map(|_| self as &dyn ExpertStream)
    }
}

impl RowStream for Streamer {
    fn gate(&self, l: usize) -> Result<Option<Cow<'_, Weight>>> {
        let parts = &self.layers[l];
        match &parts.gate {
            Some(g) => {
                let st = self.state.lock().expect("stream state");
                // After the streamed attention matrices, if any.
                Streamer::view(&st, g, parts.gate_index()).map(|w| Some(Cow::Owned(w)))
            }
            None => Ok(self.resident_gate[l].as_ref().map(Cow::Borrowed)),
        }
    }

    fn hot_rows(&self, l: usize) -> Option<(&Weight, &Weight)> {
        self.hot.get(l)?.as_ref().map(|(u, d)| (u, d))
    }

    fn count_hot_rows(&self, l: usize, up: usize, down: usize) {
        let parts = &self.layers[l];
        let mut st = self.state.lock().expect("stream state");
        st.counters.ffn_hot_bytes += (up * parts.up.row_bytes + down * parts.down.row_bytes) as u64;
    }

    fn cold_on_host(&self, l: usize, n: usize) -> Option<crate::model::forward::ColdRows<'_>> {
        self.hybrid.as_ref()?.rows(l, n)
    }

    fn count_cold(&self, bytes: u64, ns: u64) {
        self.count_cold_cpu(bytes, ns);
    }

    fn rows_in_place(&self, l: usize, set: &[u32], down: bool) -> Result<Option<Weight>> {
        let mut guard = self.state.lock().expect("stream state");
        let st = &mut *guard;
        let cache = &mut st.caches[l];
        if !cache.holds_in_place(set) {
            return Ok(None);
        }
        let parts = &self.layers[l];
        let (ub, db) = cache.buffers();
        // From the first neuron the device does not keep (row i = neuron hot + i).
        let hot = self.hot_rows(l).map_or(0, |(u, _)| u.rows);
        if set.first().is_some_and(|&n| (n as usize) < hot) {
            return Ok(None);
        }
        let all = |p: &Part, buf: &Arc<Vec<u8>>| -> Result<Option<Weight>> {
            let w = p.slots(buf, hot, cache.slots() - hot, self.hidden)?.volatile();
            Ok(self.link.in_place(&w))
        };
        // Both matrices or neither: a step whose up rows were read in place reads its down
        // columns so too.
        let (Some(up), Some(dn)) = (all(&parts.up, ub)?, all(&parts.down, db)?) else {
            return Ok(None);
        };
        let (p, mapped) = match down {
            false => (&parts.up, up),
            true => (&parts.down, dn),
        };
        let step = st.counters.passes;
        for &n in set {
            cache.touch(n as usize, step);
        }
        let c = &mut st.counters;
        if !down {
            // A decode step's lookups are its up set's (the down set is a part of it).
            c.cache_lookups += set.len() as u64;
            c.cache_hits += set.len() as u64;
            // The step takes no lookahead read here (everything is in memory).
            if let Some(a) = st.ahead_taken.take() {
                st.ahead_spare.push(a.buf);
            }
        }
        let bytes = (set.len() * p.row_bytes) as u64;
        st.counters.ffn_in_place_bytes += bytes;
        st.counters.ffn_mapped_bytes += bytes;
        Ok(Some(mapped))
    }

    fn stage(&self, l: usize, up_set: &[u32], with_down: bool) -> Result<(Weight, Option<Weight>)> {
        let mut st = self.state.lock().expect("stream state");
        if let Some((Some(up), down)) = self.run_views(&mut st, l, up_set, true, with_down)? {
            return Ok((up, down));
        }
        if let Some((up, down)) = self.prefetch_views(&mut st, l, up_set, with_down)? {
            return Ok((up, Some(down)));
        }
        self.fetch(&mut st, l, up_set, if with_down { up_set } else { &[] }, up_set)?;
        let (parts, m) = (&self.layers[l], up_set.len());
        let up = Weight::shared(&parts.up.name, parts.up.ty, m, self.hidden, st.staging_up.clone(), 0)?.volatile();
        let down = match with_down {
            true => Some(
                Weight::shared(
                    &parts.down.name,
                    parts.down.ty,
                    m,
                    self.hidden,
                    st.staging_down.clone(),
                    0,
                )?
                .volatile(),
            ),
            false => None,
        };
        Ok((up, down))
    }

    fn stage_down(&self, l: usize, down_set: &[u32], staged_up: &[u32]) -> Result<Weight> {
        let mut st = self.state.lock().expect("stream state");
        if let Some((_, Some(down))) = self.run_views(&mut st, l, down_set, false, true)? {
            return Ok(down);
        }
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
        .map(Weight::volatile)
    }

    fn begin_decode(&self, l: usize) -> Result<()> {
        let mut st = self.state.lock().expect("stream state");
        st.ahead_taken = self.take_ahead(&mut st, l)?;
        Ok(())
    }

    fn lookahead_target(&self, l: usize, reads_input: bool) -> Option<(usize, Option<&Weight>)> {
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
        let gate = self.resident_gate[next].as_ref()?;
        Some((next, Some(gate)))
    }

    fn read_ahead(&self, layer: usize, need: &[bool], with_down: bool) -> Result<()> {
        let mut st = self.state.lock().expect("stream state");
        self.submit_ahead(&mut st, layer, need, with_down)
    }

    /// The decode step's up phase (see [`RowStream::decode_up`]): hits from their slots,
    /// misses read (with their down columns too when `with_down`), misses the lookahead read
    /// taken from its buffer as if their reads had landed. The two pool threads split the
    /// work: one submits the misses' reads and hands each up row over as it completes, the
    /// other hands over the hits meanwhile. Only missed rows are copied (into staging, for the
    /// cache and the down phase).
    fn decode_up(
        &self,
        l: usize,
        up_set: &[u32],
        with_down: bool,
        available: &mut RowsInMemory<'_>,
        landed: &mut RowLanded<'_>,
    ) -> Result<()> {
        let mut guard = self.state.lock().expect("stream state");
        let st = &mut *guard;
        let parts = &self.layers[l];
        let (ur, dr) = (parts.up.row_bytes, parts.down.row_bytes);
        let step = st.counters.passes;
        let ahead = st.ahead_taken.take().filter(|a| a.layer == l);
        let State {
            caches,
            staging_up,
            staging_down,
            plan: planned,
            counters,
            pinned,
            retired,
            ..
        } = st;
        let cache = &mut caches[l];
        let (su, sd) = (
            unique(staging_up, pinned, retired),
            unique(staging_down, pinned, retired),
        );
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
        });
        Ok(())
    }

    /// The decode step's down phase (see [`RowStream::decode_down`]).
    fn decode_down(
        &self,
        l: usize,
        kept: &dyn Fn(u32) -> bool,
        available: &mut DownRowsInMemory<'_>,
        landed: &mut RowLanded<'_>,
    ) -> Result<()> {
        let mut guard = self.state.lock().expect("stream state");
        let st = &mut *guard;
        let Some(d) = st.decode.take().filter(|d| d.layer == l) else {
            return Err(Error::Internal(format!(
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
            pinned,
            retired,
            ..
        } = st;
        let cache = &mut caches[l];
        let (su, sd) = (
            unique(staging_up, pinned, retired),
            unique(staging_down, pinned, retired),
        );
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
}

impl ExpertStream for Streamer {
    fn expert_layer(&self, l: usize) -> Option<ExpertLayer<'_>> {
        let x = self.experts.as_ref()?;
        Some(ExpertLayer {
            router: x.routers.get(l)?.as_ref()?,
            score_bias: x.score_bias.get(l)?.as_deref(),
            shared: x.shared.get(l)?.as_ref(),
        })
    }

    fn experts(&self, l: usize, ids: &[usize], compute: &mut ExpertCompute<'_>) -> Result<()> {
        let x = self
            .experts
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("layer {l}: this stream reads no experts")))?;
        let mut st = self.state.lock().expect("stream state");
        x.run(
            l,
            ids,
            self.fg.as_ref(),
            &self.prefetcher,
            // Misses are read in place: as large reads as the prefetch thread's.
            self.read_bytes,
            &mut st.counters,
            compute,
        )
    }

    fn expert_lookahead(&self, l: usize) -> Option<(usize, &Weight, Option<&[f32]>)> {
        let x = self.experts.as_ref().filter(|x| x.lookahead)?;
        let next = l + 1;
        let router = x.routers.get(next)?.as_ref()?;
        Some((next, router, x.score_bias[next].as_deref()))
    }

    fn read_experts_ahead(&self, layer: usize, ids: &[usize]) -> Result<()> {
        let Some(x) = &self.experts else { return Ok(()) };
        let mut st = self.state.lock().expect("stream state");
        x.read_ahead(layer, ids, &self.prefetcher, &mut st.counters)
    }

    fn host_cpu(&self, n: usize) -> Option<&crate::backend::cpu::CpuBackend> {
        self.hybrid.as_ref().filter(|_| self.experts.is_some())?.cpu_for(n)
    }

    fn count_cold(&self, bytes: u64, ns: u64) {
        self.count_cold_cpu(bytes, ns);
    }
}

impl Streamer {
    /// Counts what the hybrid executor's CPU computed of one layer: `bytes` of weights in `ns`
    /// nanoseconds.
    fn count_cold_cpu(&self, bytes: u64, ns: u64) {
        let mut st = self.state.lock().expect("stream state");
        let c = &mut st.counters;
        c.cold_cpu_bytes += bytes;
        c.cold_cpu_ns += ns;
        c.cold_cpu_layers += 1;
    }
}
