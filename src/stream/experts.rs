//! Streaming a mixture-of-experts `.gst` model: everything but the routed experts stays
//! resident (attention, routers, shared experts, leading dense layers' FFNs, norms, the output
//! matrix), and each layer reads only the experts its tokens were routed to, each one contiguous
//! section (`blk.L.ffn_exps.E`, docs/FORMAT.md). An expert cache holds whole experts within the budget,
//! replaced by least recent use (`lru`) or by how often each expert was routed to
//! (`frequency`: the least-routed goes first, the least recent among equals). Lookahead (decode
//! only): at layer l the next layer's router is applied to layer l's FFN input carried over to
//! the next layer's norm, and the experts it picks that the cache lacks are read on the
//! prefetch thread while layer l computes; layer l+1 takes them into the cache and reads only
//! what the prediction missed.
//!
//! Exactness: an expert's bytes are the file's whichever way they arrive (cache, lookahead,
//! read now) and the forward pass adds the experts' outputs in expert order, so streamed logits
//! equal the in-RAM `.gst` model's bit for bit.
//!
//! Owns the expert cache, the lookahead reads and their counters; no arithmetic (the forward
//! pass computes on the experts it is handed) and no routing (the forward pass routes).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use std::time::Instant;

use super::cache::CachePolicy;
use super::prefetch::Prefetcher;
use super::report::Counters;
use crate::error::{Error, Result};
use crate::io::{Range, Reader};
use crate::model::weights::{FfnDown, FfnWeights, LayerFfn};
use crate::quant::GgmlType;
use crate::tensor::Weight;

/// One matrix's place inside an expert's pieces: `offset` bytes into piece `piece`; `at` its
/// place in the file.
#[derive(Clone, Debug)]
struct MatrixAt {
    at: u64,
    name: String,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    piece: usize,
    offset: usize,
    stride: usize,
}

/// Where an expert lies in the file — one range (a `.gst` expert's section: gate, up and down
/// rows together) or one per matrix (a GGUF's expert `e` is slice `e` of each of three 3-D
/// tensors, far apart) — and its three matrices inside those ranges.
#[derive(Clone, Debug)]
pub(crate) struct ExpertPart {
    pieces: Vec<Range>,
    len_bytes: usize,
    gate: MatrixAt,
    up: MatrixAt,
    /// Down as rows `[hidden, ffn]` (`.gst` and GGUF experts keep the checkpoint's layout).
    down: MatrixAt,
}

/// Matrices closer than this in the file are read as one range (the bytes between read
/// through): a `.gst` expert's three are adjacent, a GGUF's are whole tensors apart.
const PIECE_GAP_MAX: u64 = 64 << 10;

impl ExpertPart {
    /// From an expert's views: a `.gst` expert's section (docs/FORMAT.md), or a GGUF expert's
    /// slices of the three expert tensors.
    pub(crate) fn of(f: &FfnWeights) -> Result<ExpertPart> {
        let FfnDown::Rows(down) = &f.down else {
            return Err(Error::Input(format!(
                "{}: an expert's down matrix is stored as rows; this file's is not",
                f.gate.name
            )));
        };
        let place = |w: &Weight| -> Result<(u64, u64)> {
            let o = w.file_offset().ok_or_else(|| {
                Error::Internal(format!("{}: streaming needs the weight's place in the file", w.name))
            })?;
            Ok((o, o + w.extent_bytes() as u64))
        };
        let spans = [place(&f.gate)?, place(&f.up)?, place(down)?];
        // Ranges: the spans in file order, those within PIECE_GAP_MAX of the one before joined.
        let mut order = [0usize, 1, 2];
        order.sort_by_key(|&i| spans[i].0);
        let mut pieces: Vec<(u64, u64)> = Vec::with_capacity(3);
        let mut piece_of = [0usize; 3];
        for &i in &order {
            let (start, end) = spans[i];
            match pieces.last_mut() {
                Some(last) if start <= last.1.saturating_add(PIECE_GAP_MAX) => last.1 = last.1.max(end),
                _ => pieces.push((start, end)),
            }
            piece_of[i] = pieces.len() - 1;
        }
        let at = |w: &Weight, i: usize| MatrixAt {
            at: spans[i].0,
            name: w.name.clone(),
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            piece: piece_of[i],
            offset: (spans[i].0 - pieces[piece_of[i]].0) as usize,
            stride: w.row_stride_bytes,
        };
        let (gate, up, down) = (at(&f.gate, 0), at(&f.up, 1), at(down, 2));
        let pieces: Vec<Range> = pieces
            .iter()
            .map(|&(start, end)| Range::new(start, (end - start) as usize))
            .collect();
        Ok(ExpertPart {
            len_bytes: pieces.iter().map(|r| r.len_bytes).sum(),
            pieces,
            gate,
            up,
            down,
        })
    }

    /// Bytes the expert's ranges hold.
    pub(crate) fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// The file ranges the expert is read from, in file order.
    pub(crate) fn pieces(&self) -> &[Range] {
        &self.pieces
    }

    /// Where each piece starts in a buffer that holds them back to back from its start.
    fn packed_starts(&self) -> Vec<usize> {
        let mut at = 0;
        self.pieces
            .iter()
            .map(|r| {
                let s = at;
                at += r.len_bytes;
                s
            })
            .collect()
    }

    /// The expert as weights over its bytes: piece i starts at `starts[i]` in `bytes`; keyed
    /// by `source` (the stream's id) and their places in the file, so a device may keep copies.
    fn weights(&self, bytes: &Arc<Vec<u8>>, starts: &[usize], source: u64) -> Result<FfnWeights> {
        // A cache slot, refilled with another expert when evicted.
        let w = |m: &MatrixAt| {
            Weight::shared_strided(
                &m.name,
                m.ty,
                m.rows,
                m.cols,
                bytes.clone(),
                starts[m.piece] + m.offset,
                m.stride,
            )
            .map(|w| w.volatile().keyed(source, m.at))
        };
        Ok(FfnWeights {
            gate: w(&self.gate)?,
            up: w(&self.up)?,
            down: FfnDown::Rows(w(&self.down)?),
        })
    }
}

/// A shared expert and its gate vector, where gated.
pub(crate) type SharedExpert = (FfnWeights, Option<Vec<f32>>);

/// An expert's bytes and where each of its pieces starts in them.
type Slot = (Arc<Vec<u8>>, Vec<usize>);

struct Entry {
    bytes: Arc<Vec<u8>>,
    /// Where each of the expert's pieces starts in `bytes` (read in place: each at its file
    /// offset's phase; read ahead: back to back).
    starts: Vec<usize>,
    last_used: u64,
}

/// Whole experts in RAM, keyed by (layer, expert).
struct ExpertCache {
    policy: CachePolicy,
    slots: usize,
    entries: HashMap<(usize, usize), Entry>,
    /// Evicted buffers something else still held (a weight over them): kept, not freed, until
    /// they can be reused (a buffer the device page-locked is never freed while locked).
    retired: Vec<Arc<Vec<u8>>>,
    /// Routing counts of every expert ever routed to (kept after eviction: the frequency
    /// policy ranks by how often an expert is wanted, not by how long it stayed).
    uses: HashMap<(usize, usize), u64>,
}

impl ExpertCache {
    /// The entry to evict, never one of `keep`.
    fn victim(&self, keep: &[(usize, usize)]) -> Option<(usize, usize)> {
        let candidates = self.entries.iter().filter(|(k, _)| !keep.contains(k));
        match self.policy {
            CachePolicy::Frequency => candidates
                .min_by_key(|(k, e)| (self.uses.get(k).copied().unwrap_or(0), e.last_used, **k))
                .map(|(k, _)| *k),
            _ => candidates.min_by_key(|(k, e)| (e.last_used, **k)).map(|(k, _)| *k),
        }
    }

    /// Makes room for one entry besides `in_flight` buffers taken for entries not yet inserted
    /// (evicting as the policy says, never `keep`). Every evicted buffer nothing else holds goes
    /// to `freed`, for reuse (a buffer is never dropped here: on a device that page-locks them it
    /// must be released, its lock first).
    fn make_room(&mut self, keep: &[(usize, usize)], in_flight: usize, freed: &mut Vec<Vec<u8>>) {
        while self.entries.len() + in_flight >= self.slots {
            let Some(k) = self.victim(keep) else { break };
            let e = self.entries.remove(&k).expect("victim present");
            self.free(e.bytes, freed);
        }
    }

    /// A buffer out of the cache: to `freed` if nothing else holds it, else retired until then.
    fn free(&mut self, bytes: Arc<Vec<u8>>, freed: &mut Vec<Vec<u8>>) {
        match Arc::try_unwrap(bytes) {
            Ok(v) => freed.push(v),
            Err(held) => self.retired.push(held),
        }
    }

    /// Caches `key`'s bytes, making room for them; when every entry is to be kept they are not
    /// cached and their buffer is freed as an evicted one is.
    fn insert(
        &mut self,
        key: (usize, usize),
        (bytes, starts): Slot,
        step: u64,
        keep: &[(usize, usize)],
        freed: &mut Vec<Vec<u8>>,
    ) {
        self.make_room(keep, 0, freed);
        if self.entries.len() < self.slots {
            self.entries.insert(
                key,
                Entry {
                    bytes,
                    starts,
                    last_used: step,
                },
            );
        } else {
            self.free(bytes, freed);
        }
    }
}

/// A pending lookahead read: `experts[i]` of `layer`, in submission order.
struct AheadJob {
    layer: usize,
    expert: usize,
}

struct ExpertState {
    cache: ExpertCache,
    step: u64,
    ahead: VecDeque<AheadJob>,
    spare: Vec<Vec<u8>>,
}

/// The size of the expert buffers, and their page-locks on a device with memory of its own: it
/// copies each routed expert from its buffer at every use, and from page-locked memory at the
/// link's pinned speed (several times the pageable rate). Every buffer is made at `buf_bytes`
/// (the largest expert laid out in phase), so it is never reallocated, locked once when made
/// (on such a device), and unlocked just before it is freed ([`ExpertStream::release`]).
struct Pins {
    link: Option<Arc<dyn crate::backend::HostLink>>,
    buf_bytes: usize,
    locks: HashMap<usize, crate::backend::PinnedHost>,
}

/// Expert buffers made ahead of need on a thread of their own, at idle priority where the
/// system has one (Linux `SCHED_IDLE`: it runs only on a core that would otherwise wait), on a
/// device computing in host memory. A filling cache's new buffers cost the kernel's zeroing of
/// their fresh pages, which can take longer than reading the expert (most of gpt-oss-120b's
/// time under a 16 GiB cap here, `clear_page_erms`); made ahead, that work overlaps the reads
/// instead of delaying each miss. Every buffer the stream makes is counted in `made`, the
/// thread's and `take_buf`'s alike, and the thread stops at `target` (the cache's slots and the
/// lookahead's buffers: what the stream would make anyway), so memory stays as planned.
struct Warm {
    ready: Mutex<Vec<Vec<u8>>>,
    made: AtomicUsize,
    target: usize,
    stop: AtomicBool,
}

impl Warm {
    /// Counts one buffer made, unless `target` are: then `false`.
    fn claim(&self) -> bool {
        self.made
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.target).then_some(n + 1)
            })
            .is_ok()
    }

    /// The thread's work: buffers of `bytes`, touched (so their pages are the kernel's to zero
    /// now), until `target` are made or the stream stops.
    fn run(&self, bytes: usize) {
        #[cfg(target_os = "linux")]
        {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: sets this thread's own policy (tid 0: the caller) from a valid parameter;
            // failing leaves it at normal priority, which is only less polite.
            let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
        }
        while !self.stop.load(Ordering::Acquire) && self.claim() {
            let mut v = Vec::with_capacity(bytes);
            // SAFETY: the spare capacity is memory the vector owns; it is only advised, not read.
            crate::io::advise_huge_pages(unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr(), bytes) });
            v.resize(bytes, 0);
            self.ready.lock().expect("warm buffers").push(v);
        }
    }
}

/// The expert half of a [`super::Streamer`] opened on a mixture-of-experts model. Per layer:
/// the experts' places (none in a leading dense layer), and what stays resident — the router and
/// score bias, the shared expert, or a leading dense layer's whole FFN.
pub struct ExpertStream {
    pub(crate) parts: Vec<Vec<ExpertPart>>,
    pub(crate) routers: Vec<Option<Weight>>,
    pub(crate) score_bias: Vec<Option<Vec<f32>>>,
    pub(crate) shared: Vec<Option<SharedExpert>>,
    /// The leading dense layers' FFNs (GLM-4.5's first layer), resident like a shared expert.
    pub(crate) dense: Vec<Option<FfnWeights>>,
    pub policy: CachePolicy,
    pub cache_slots: usize,
    pub expert_bytes: u64,
    pub lookahead: bool,
    /// The most experts read ahead per layer (the experts a token uses).
    pub ahead_max: usize,
    /// This stream's own id, in its experts' content keys ([`Weight::keyed`]): another stream
    /// on the same device (a draft model's) never shares a key.
    id: u64,
    /// Declared before `state`, so dropped first: every lock is released before the buffers
    /// it covers are freed.
    pins: Mutex<Pins>,
    state: Mutex<ExpertState>,
    warm: Arc<Warm>,
    warm_thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for ExpertStream {
    fn drop(&mut self) {
        self.warm.stop.store(true, Ordering::Release);
        if let Some(t) = self.warm_thread.take() {
            let _ = t.join();
        }
    }
}

/// What an expert stream holds resident and how its cache is sized.
pub struct ExpertPlan {
    pub policy: CachePolicy,
    pub cache_slots: usize,
    pub lookahead: bool,
    pub n_used: usize,
    /// A device with memory of its own, which page-locks the expert buffers it copies from
    /// (`None`: a device computing in host memory).
    pub link: Option<Arc<dyn crate::backend::HostLink>>,
}

impl ExpertStream {
    /// Resident routers, score biases, shared experts and leading dense FFNs loaded with
    /// `load`, from each layer's FFN; the experts' places `parts` (per layer, from
    /// [`ExpertPart::of`]; none for a dense layer). The cache starts empty.
    pub(crate) fn new(
        layers: &[&LayerFfn],
        parts: Vec<Vec<ExpertPart>>,
        load: &dyn Fn(&Weight) -> Result<Weight>,
        plan: ExpertPlan,
    ) -> Result<ExpertStream> {
        let ffn = |f: &FfnWeights| -> Result<FfnWeights> {
            let down = match &f.down {
                FfnDown::Columns(d) => FfnDown::Columns(load(d)?),
                FfnDown::Rows(d) => FfnDown::Rows(load(d)?),
            };
            Ok(FfnWeights {
                gate: load(&f.gate)?,
                up: load(&f.up)?,
                down,
            })
        };
        let n = layers.len();
        let (mut routers, mut score_bias) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut shared, mut dense) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for lf in layers {
            match lf {
                LayerFfn::Experts(e) => {
                    routers.push(Some(load(&e.router)?));
                    score_bias.push(e.score_bias.clone());
                    shared.push(match &e.shared {
                        None => None,
                        Some((f, g)) => Some((ffn(f)?, g.clone())),
                    });
                    dense.push(None);
                }
                LayerFfn::Dense(f) => {
                    routers.push(None);
                    score_bias.push(None);
                    shared.push(None);
                    dense.push(Some(ffn(f)?));
                }
            }
        }
        let expert_bytes = parts.iter().flatten().map(|p| p.len_bytes as u64).max().unwrap_or(0);
        let buf_bytes = parts
            .iter()
            .flatten()
            .map(|p| crate::io::in_phase_len_max(p.pieces(), &[]))
            .max()
            .unwrap_or(0);
        // Made ahead on a device computing in host memory (one that page-locks its buffers
        // makes them as it needs them).
        let warm = Arc::new(Warm {
            ready: Mutex::new(Vec::new()),
            made: AtomicUsize::new(0),
            // (The plan's: the cache's slots, and with lookahead its reads in flight and as many
            // spares.)
            target: match (&plan.link, plan.lookahead) {
                (None, true) => plan.cache_slots + 2 * plan.n_used,
                (None, false) => plan.cache_slots,
                (Some(_), _) => 0,
            },
            stop: AtomicBool::new(false),
        });
        let warm_thread = match (warm.target, buf_bytes) {
            (0, _) | (_, 0) => None,
            _ => {
                let w = warm.clone();
                std::thread::Builder::new()
                    .name("gatestream-expert-buffers".into())
                    .spawn(move || w.run(buf_bytes))
                    .ok()
            }
        };
        Ok(ExpertStream {
            warm,
            warm_thread,
            parts,
            routers,
            score_bias,
            shared,
            dense,
            policy: plan.policy,
            cache_slots: plan.cache_slots,
            expert_bytes,
            lookahead: plan.lookahead,
            ahead_max: plan.n_used,
            id: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
            pins: Mutex::new(Pins {
                link: plan.link,
                buf_bytes,
                locks: HashMap::new(),
            }),
            state: Mutex::new(ExpertState {
                cache: ExpertCache {
                    policy: plan.policy,
                    slots: plan.cache_slots,
                    entries: HashMap::new(),
                    retired: Vec::new(),
                    uses: HashMap::new(),
                },
                step: 0,
                ahead: VecDeque::new(),
                spare: Vec::new(),
            }),
        })
    }

    /// A buffer for an expert's bytes: a spare one, an evicted one (`evict`: the entries to
    /// keep, and the buffers already taken for entries not yet inserted, so that the cache and
    /// those stay within its slots), one made ahead, or a new one (on a device that copies from
    /// host memory: made at its largest and page-locked).
    fn take_buf(&self, st: &mut ExpertState, evict: Option<(&[(usize, usize)], usize)>) -> Vec<u8> {
        if let Some(v) = st.spare.pop() {
            return v;
        }
        if let Some((keep, in_flight)) = evict {
            st.cache.make_room(keep, in_flight, &mut st.spare);
            if let Some(v) = st.spare.pop() {
                return v;
            }
        }
        if let Some(v) = self.warm.ready.lock().expect("warm buffers").pop() {
            return v;
        }
        // (Counted with the warm thread's, which then makes fewer.)
        self.warm.made.fetch_add(1, Ordering::AcqRel);
        let mut pins = self.pins.lock().expect("expert pins");
        // Made at the largest expert's size, so any expert fits it and it is never reallocated:
        // experts of other sizes (other layers' types) would otherwise free and allocate
        // buffers of several sizes, and the allocator's holes between them grow the process
        // past its budget (1.5 GB on GLM-4.5-Air's shape under a 7 GB budget).
        let mut v = Vec::with_capacity(pins.buf_bytes);
        // SAFETY: the spare capacity is memory the vector owns; it is only advised, not read.
        crate::io::advise_huge_pages(unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr(), pins.buf_bytes) });
        let Some(link) = pins.link.clone() else {
            return v;
        };
        v.resize(pins.buf_bytes, 0);
        if let Some(lock) = link.pin_host(&v, true) {
            pins.locks.insert(v.as_ptr() as usize, lock);
        }
        v
    }

    /// Frees a buffer: its page-lock is released here, the buffer when the call returns.
    fn release(&self, v: Vec<u8>) {
        self.pins
            .lock()
            .expect("expert pins")
            .locks
            .remove(&(v.as_ptr() as usize));
    }

    /// Gives buffers back to the spares (after a failed read: nothing is freed while locked).
    fn give_back(st: &mut ExpertState, bufs: impl IntoIterator<Item = Vec<u8>>) {
        st.spare.extend(bufs.into_iter().filter(|v| v.capacity() > 0));
    }

    /// Runs `compute` on each of layer `l`'s experts `ids` (distinct): first those in the cache
    /// (or just read ahead), then those it lacks, each as its read lands. Counts into `counters`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        l: usize,
        ids: &[usize],
        reader: &dyn Reader,
        prefetcher: &Prefetcher,
        max_read_bytes: usize,
        counters: &mut Counters,
        compute: &mut dyn FnMut(usize, &FfnWeights) -> Result<()>,
    ) -> Result<()> {
        let mut st = self.state.lock().expect("expert state");
        let st = &mut *st;
        // Evicted buffers nothing holds any longer become spares.
        for held in std::mem::take(&mut st.cache.retired) {
            match Arc::try_unwrap(held) {
                Ok(v) => st.spare.push(v),
                Err(held) => st.cache.retired.push(held),
            }
        }
        st.step += 1;
        let step = st.step;
        let keys: Vec<(usize, usize)> = ids.iter().map(|&e| (l, e)).collect();
        for k in &keys {
            *st.cache.uses.entry(*k).or_insert(0) += 1;
        }
        // Lookahead reads for this layer: into the cache (stale ones, from a pass that
        // stopped early, give their buffers back).
        let t0 = Instant::now();
        let mut landed = Vec::new();
        // Pending: this layer's reads, then the next layer's (submitted by this layer's
        // router lookahead just before); anything else is left from a pass that stopped
        // midway and only gives its buffer back. (Bytes are the file's whichever way they
        // came, so a stale read is never wrong, only wasted.)
        while st.ahead.front().is_some_and(|j| j.layer != l + 1) {
            let job = st.ahead.pop_front().expect("checked");
            let done = prefetcher.next()?;
            if job.layer != l {
                st.spare.push(done.buf);
                continue;
            }
            if let Err(e) = done.result {
                st.spare.push(done.buf);
                return Err(e);
            }
            let key = (job.layer, job.expert);
            // (Read ahead packed: the expert's pieces back to back from the buffer's first byte.)
            st.cache
                .insert(key, (Arc::new(done.buf), done.starts), step, &keys, &mut st.spare);
            landed.push(key);
        }
        let waited = t0.elapsed().as_nanos() as u64;
        {
            let c = &mut *counters;
            c.io_wait_ns += waited;
            let used = landed.iter().filter(|k| keys.contains(k)).count() as u64;
            c.ahead_used_neurons += used;
            c.ahead_used_bytes += used * self.expert_bytes;
            c.ahead_served_bytes += used * self.expert_bytes;
            // Bytes the layer needed from disk: what lookahead brought and what it reads now.
            c.ffn_needed_bytes += used * self.expert_bytes;
            c.cache_lookups += keys.len() as u64;
        }
        // Hits (including what lookahead just brought).
        let mut misses = Vec::new();
        let mut hits = 0u64;
        for (&e, k) in ids.iter().zip(&keys) {
            match st.cache.entries.get_mut(k) {
                Some(entry) => {
                    entry.last_used = step;
                    let w = self.parts[l][e].weights(&entry.bytes, &entry.starts, self.id)?;
                    if !landed.contains(k) {
                        hits += 1;
                    }
                    compute(e, &w)?;
                }
                None => misses.push(e),
            }
        }
        counters.cache_hits += hits;
        // Misses, at most a cache's worth at a time (one when the cache holds none), each
        // computed as its last chunk lands. Each is read straight into its buffer (laid out at
        // its file offset's phase, in huge pages where the kernel gives them) as one pipeline
        // of reads.
        let per_round = st.cache.slots.max(1);
        for round in misses.chunks(per_round) {
            let mut bufs: Vec<(Vec<u8>, Vec<usize>)> = Vec::with_capacity(round.len());
            // Every expert's pieces, and whose piece each is (expert i of the round, piece k).
            let (mut ranges, mut owner) = (Vec::new(), Vec::new());
            for (i, &e) in round.iter().enumerate() {
                let mut v = self.take_buf(st, Some((&keys, i)));
                let p = &self.parts[l][e];
                let starts = crate::io::lay_pieces_in_phase(&mut v, p.pieces());
                bufs.push((v, starts));
                for (k, r) in p.pieces().iter().enumerate() {
                    ranges.push(*r);
                    owner.push((i, k));
                }
            }
            let (chunks, place) = super::prefetch::cut(&ranges, max_read_bytes);
            let mut left = vec![0usize; round.len()];
            place.iter().for_each(|&(j, _)| left[owner[j].0] += 1);
            // Where each chunk lands (derived once: the buffers are not touched again until
            // their last chunk is in).
            let dests: Vec<*mut u8> = place
                .iter()
                .map(|&(j, o)| {
                    let (i, k) = owner[j];
                    // SAFETY: (pointer arithmetic) the chunk lies inside piece k of its expert,
                    // which lies inside the buffer from `starts[k]` (sized by
                    // `lay_pieces_in_phase`).
                    unsafe { bufs[i].0.as_mut_ptr().add(bufs[i].1[k] + o) }
                })
                .collect();
            let t0 = Instant::now();
            let mut compute_ns = 0u64;
            let mut ready: Vec<Option<Slot>> = vec![None; round.len()];
            let mut first_err: Option<Error> = None;
            let mut issued = 0usize;
            let mut next = |_idle: bool| -> Option<crate::io::StreamReq> {
                let c = issued;
                let r = chunks.get(c)?;
                issued += 1;
                Some(crate::io::StreamReq {
                    offset_bytes: r.offset_bytes,
                    len_bytes: r.len_bytes,
                    dest: dests[c],
                    tag: c as u64,
                })
            };
            let mut done = |tag: u64, result: Result<()>| {
                let i = owner[place[tag as usize].0].0;
                if let Err(e) = result {
                    first_err.get_or_insert(e);
                    return;
                }
                left[i] -= 1;
                if left[i] > 0 || first_err.is_some() {
                    return;
                }
                let t = Instant::now();
                let (b, starts) = std::mem::take(&mut bufs[i]);
                let b = Arc::new(b);
                let e = round[i];
                if let Err(err) = self.parts[l][e]
                    .weights(&b, &starts, self.id)
                    .and_then(|w| compute(e, &w))
                {
                    first_err = Some(err);
                }
                ready[i] = Some((b, starts));
                compute_ns += t.elapsed().as_nanos() as u64;
            };
            // SAFETY: each chunk's destination lies in its expert's buffer, which stays where it
            // is (not touched, moved out of `bufs` only once its last chunk has landed, freed
            // only after this call) until every chunk has reported to `done`.
            let read = unsafe { reader.read_stream(&mut next, &mut done) };
            if let Some(e) = read.err().or(first_err) {
                // Every buffer back to the spares, those computed on too (when nothing holds them).
                let landed = ready.into_iter().flatten().filter_map(|(b, _)| Arc::try_unwrap(b).ok());
                Self::give_back(st, bufs.into_iter().map(|(v, _)| v).chain(landed));
                return Err(e);
            }
            let wait = (t0.elapsed().as_nanos() as u64).saturating_sub(compute_ns);
            let bytes: u64 = round.iter().map(|&e| self.parts[l][e].len_bytes as u64).sum();
            {
                let c = &mut *counters;
                c.io_wait_ns += wait;
                c.ffn_needed_bytes += bytes;
                c.ffn_reads += round.len() as u64;
            }
            for (b, &e) in ready.into_iter().zip(round) {
                let b = b.expect("every read landed");
                st.cache.insert((l, e), b, step, &keys, &mut st.spare);
            }
        }
        // Spare buffers for the lookahead's next reads; the rest back to the warm buffers, whose
        // pages are already the process's (on a device that page-locks them: to the allocator).
        let keep = if self.lookahead { self.ahead_max } else { 0 };
        if st.spare.len() > keep {
            let rest = st.spare.split_off(keep);
            match self.warm_thread.is_some() {
                true => self.warm.ready.lock().expect("warm buffers").extend(rest),
                false => rest.into_iter().for_each(|v| self.release(v)),
            }
        }
        Ok(())
    }

    /// Reads layer `layer`'s experts `ids` (the lookahead's prediction) that the cache lacks
    /// on the prefetch thread; the layer takes them when it runs.
    pub(crate) fn read_ahead(
        &self,
        layer: usize,
        ids: &[usize],
        prefetcher: &Prefetcher,
        counters: &mut Counters,
    ) -> Result<()> {
        let mut st = self.state.lock().expect("expert state");
        for &e in ids.iter().take(self.ahead_max) {
            let pending = st.ahead.iter().any(|j| (j.layer, j.expert) == (layer, e));
            if pending || st.cache.entries.contains_key(&(layer, e)) {
                continue;
            }
            let p = &self.parts[layer][e];
            let buf = self.take_buf(&mut st, None);
            // Packed: the expert's pieces back to back from the buffer's first byte.
            prefetcher.submit(e, p.pieces().to_vec(), buf, super::prefetch::Placement::Packed)?;
            st.ahead.push_back(AheadJob { layer, expert: e });
            counters.ahead_neurons += 1;
            counters.ahead_bytes += p.len_bytes as u64;
        }
        Ok(())
    }

    /// Expert buffers made so far (by the warm thread and on demand), and how many of them wait
    /// unused for a miss.
    pub fn buffers_made(&self) -> (usize, usize) {
        (
            self.warm.made.load(Ordering::Acquire),
            self.warm.ready.lock().expect("warm buffers").len(),
        )
    }

    /// Experts in the model.
    pub fn experts_total(&self) -> usize {
        self.parts.iter().map(Vec::len).sum()
    }

    /// The first expert layer's expert 0 read into memory (the hybrid executor's cost model times the CPU on
    /// it); not cached, but counted with the reader's reads.
    pub(crate) fn probe_expert(&self, reader: &dyn Reader) -> Result<FfnWeights> {
        let part = self
            .parts
            .iter()
            .find_map(|p| p.first())
            .ok_or_else(|| Error::Internal("a mixture-of-experts stream without experts".into()))?;
        let mut bytes = Vec::with_capacity(part.len_bytes);
        for r in part.pieces() {
            bytes.extend(reader.read_vec(r.offset_bytes, r.len_bytes)?);
        }
        part.weights(&Arc::new(bytes), &part.packed_starts(), self.id)
    }

    /// Expert buffers the device page-locked (tests).
    pub fn locked_buffers(&self) -> usize {
        self.pins.lock().expect("expert pins").locks.len()
    }

    /// Experts held now (tests, reports).
    pub fn cached(&self) -> usize {
        self.state.lock().expect("expert state").cache.entries.len()
    }
}

impl super::Streamer {
    /// [`super::Streamer::with_readers`] for a mixture-of-experts model: everything but the
    /// routed experts resident, the rest of the budget an expert cache (see the module docs).
    pub(crate) fn open_experts(
        model: &crate::model::Model,
        opts: &super::StreamOptions,
        readers: super::Readers,
        direct_io: bool,
        mut warnings: Vec<String>,
    ) -> Result<super::Streamer> {
        use super::residency::Residency;
        use crate::model::weights::LayerFfn;
        let super::Readers { fg, bg, ahead: _ } = readers;
        let cfg = model.config.clone();
        let moe = cfg
            .moe
            .clone()
            .ok_or_else(|| Error::Internal("not a mixture-of-experts model".into()))?;
        let w = &model.weights;
        let tied = w.output.file_offset() == w.token_embd.file_offset();
        let span = |w: &Weight| w.extent_bytes() as u64;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        let mut attention_bytes = 0u64;
        // Per layer, attention, and router + shared expert (a GPU budget's plan keeps them in the
        // place of a dense model's gates), and the norms and biases of all.
        let (mut attention_by_layer, mut router_by_layer) = (Vec::new(), Vec::new());
        let mut vector_bytes = w.output_norm.len() as u64 * 4;
        for lw in &w.layers {
            let a = &lw.attn;
            let attn = a.matrices().iter().map(|m| span(m)).sum::<u64>();
            attention_bytes += attn;
            attention_by_layer.push(attn);
            let ffn_span = |f: &FfnWeights| span(&f.gate) + span(&f.up) + span(f.down.weight());
            // A leading dense layer's FFN stays resident in the place of the router and shared
            // expert (GLM-4.5-Air's one is under 2% of the model).
            let router = match &lw.ffn {
                LayerFfn::Experts(e) => {
                    vector_bytes += e.vector_bytes();
                    span(&e.router) + e.shared.as_ref().map_or(0, |(f, _)| ffn_span(f))
                }
                LayerFfn::Dense(f) => ffn_span(f),
            };
            router_by_layer.push(router);
            vector_bytes += lw.vector_bytes();
            layers.push(&lw.ffn);
        }
        let required_bytes = span(&w.output) + vector_bytes + router_by_layer.iter().sum::<u64>();
        let parts = layers
            .iter()
            .map(|lf| match lf {
                LayerFfn::Experts(e) => e.experts.iter().map(ExpertPart::of).collect::<Result<Vec<_>>>(),
                LayerFfn::Dense(_) => Ok(Vec::new()),
            })
            .collect::<Result<Vec<_>>>()?;
        let expert_bytes = parts.iter().flatten().map(|p| p.len_bytes as u64).max().unwrap_or(0);
        let context_bytes = crate::kv::KvCache::bytes_for(&cfg, opts.kv_positions)
            + opts.batch_tokens_max.max(1) as u64 * super::activation_bytes_per_token(&cfg);
        let lookahead = opts.lookahead != super::Lookahead::Off;
        // Two readers' buffers; with lookahead, its reads in flight and as many spare buffers.
        let roles = super::open::reader_roles(opts, true, super::open::section_max_bytes(model));
        let working_bytes = roles.fg.buffer_bytes()
            + roles.bg.buffer_bytes()
            + if lookahead {
                2 * moe.n_used as u64 * expert_bytes
            } else {
                0
            };
        let fixed = required_bytes + attention_bytes + context_bytes + working_bytes;
        let total_experts = cfg.expert_layers() * moe.n_experts;
        let slots = (opts.budget_bytes.saturating_sub(fixed) / expert_bytes.max(1)).min(total_experts as u64) as usize;
        if slots == 0 {
            let mb = |b: u64| b as f64 / 1e6;
            return Err(Error::Input(format!(
                "{}: --ram-budget {} is too small for this mixture-of-experts model: at least {} ({:.1} MB) is \
                 needed for resident attention {:.1} MB, routers, shared experts, dense FFNs, norms and output {:.1} MB, KV cache \
                 and batch {:.1} MB, read buffers {:.1} MB, and room for one {:.1} MB expert",
                model.path.display(),
                opts.budget_bytes,
                fixed + expert_bytes,
                mb(fixed + expert_bytes),
                mb(attention_bytes),
                mb(required_bytes),
                mb(context_bytes),
                mb(working_bytes),
                mb(expert_bytes)
            )));
        }
        if opts.cache == CachePolicy::Pinned {
            warnings.push(
                "--cache pinned keeps a dense model's hot neurons; an expert cache replaces experts (lru is used; \
                 --cache frequency ranks them by how often they are routed to)"
                    .into(),
            );
        }
        let policy = match opts.cache {
            CachePolicy::Pinned => CachePolicy::Lru,
            p => p,
        };
        let load = |m: &Weight| -> Result<Weight> {
            let offset = m.file_offset().ok_or_else(|| {
                Error::Internal(format!("{}: streaming needs the weight's place in the file", m.name))
            })?;
            let (bytes, at) = crate::io::read_in_phase(fg.as_ref(), offset, span(m) as usize)?;
            Weight::shared_strided(&m.name, m.ty, m.rows, m.cols, Arc::new(bytes), at, m.row_stride_bytes)
        };
        let mut experts = ExpertStream::new(
            &layers,
            parts,
            &load,
            ExpertPlan {
                policy,
                cache_slots: slots,
                lookahead,
                n_used: moe.n_used,
                link: match model.device.host_memory() {
                    true => None,
                    false => Some(model.device.clone()),
                },
            },
        )?;
        let mut resident_attn = Vec::with_capacity(cfg.n_layers);
        for lw in &w.layers {
            let a = &lw.attn;
            resident_attn.push(Some(a.try_map(&mut |w| load(w))?));
        }
        let mut output = load(&w.output)?;
        let embedding = if tied {
            None
        } else {
            Some(super::Part::of(&w.token_embd)?)
        };
        let max_read_bytes = opts
            .reader
            .slot_bytes
            .saturating_sub(2 * crate::io::ALIGN_BYTES)
            .max(crate::io::ALIGN_BYTES) as u64;
        let cost = super::plan::CostModel {
            max_read_bytes,
            ..super::plan::CostModel::default_for(fg.align_bytes() as u64)
        };
        let n = cfg.n_layers;
        let residency = Residency {
            budget_bytes: opts.budget_bytes,
            attention_resident: vec![true; n],
            gate_resident: vec![false; n],
            cache_neurons: vec![0; n],
            required_bytes,
            working_bytes,
            context_bytes,
            attention_bytes,
            gate_bytes: 0,
            cache_bytes: slots as u64 * expert_bytes,
            up_resident: Vec::new(),
            down_resident: Vec::new(),
            ffn_matrix_bytes: 0,
            prefetch_buffers: 0,
            prefetch_buffer_bytes: 0,
        };
        // A GPU budget: the plan of a dense model's (see `ModelSizes::plan_device`), with each
        // layer's router and shared expert in the place of its gate (always resident on the
        // host here) and the routed experts' bytes per token in the place of its FFN rows.
        let mut device_plan = match opts.vram_budget_bytes {
            Some(v) => {
                let sizes = super::residency::ModelSizes {
                    n_layers: n,
                    ffn: moe.n_used,
                    required_bytes: span(&w.output) + vector_bytes,
                    attention_bytes: attention_by_layer,
                    gate_bytes: router_by_layer,
                    neuron_bytes: vec![expert_bytes; n],
                    prefetch_ffn: false,
                    reader_bytes: 0,
                    lookahead: false,
                    context_bytes,
                    ffn_rows: None,
                    prefetch_buffers: 2,
                };
                let host = Residency {
                    gate_resident: vec![true; n],
                    ..residency.clone()
                };
                Some(sizes.plan_device(v, span(&w.output), &host)?)
            }
            None => None,
        };
        if let Some(plan) = device_plan.as_mut() {
            // The room the plan leaves keeps copies of the routed experts the device is sent.
            plan.kept_bytes = plan.budget_bytes.saturating_sub(plan.resident_bytes());
            model.device.keep_keyed(plan.kept_bytes);
            // What the plan does not keep on the device is copied at each use.
            if !plan.output_resident {
                output = output.volatile();
            }
            for (l, attn) in resident_attn.iter_mut().enumerate() {
                if let (false, Some(a)) = (plan.attention_resident[l], attn.as_mut()) {
                    for m in a.matrices_mut() {
                        *m = m.clone().volatile();
                    }
                }
            }
            for l in (0..n).filter(|&l| !plan.gate_resident[l]) {
                if let Some(r) = experts.routers[l].as_mut() {
                    *r = r.clone().volatile();
                }
                let dense = experts.dense[l].as_mut();
                for f in experts.shared[l].as_mut().map(|(f, _)| f).into_iter().chain(dense) {
                    f.gate = f.gate.clone().volatile();
                    f.up = f.up.clone().volatile();
                    f.down = match &f.down {
                        FfnDown::Rows(d) => FfnDown::Rows(d.clone().volatile()),
                        FfnDown::Columns(d) => FfnDown::Columns(d.clone().volatile()),
                    };
                }
            }
        }
        // The resident weights the device's plan does not keep are copied at each use: from
        // page-locked memory.
        let pinned = super::pin_unkept(
            model.device.as_ref(),
            &output,
            &resident_attn,
            experts.routers.iter().flatten().chain(
                experts
                    .shared
                    .iter()
                    .flatten()
                    .map(|(f, _)| f)
                    .chain(experts.dense.iter().flatten())
                    .flat_map(|f| [&f.gate, &f.up, f.down.weight()]),
            ),
        );
        let prefetcher = Prefetcher::start(bg.clone(), max_read_bytes as usize)?;
        // Without a RAM budget of its own (a GPU budget's stream, the model held in host RAM)
        // every expert fits the cache: all are read now, a layer's in one pipeline of reads, as
        // a dense model's rows are held at open, rather than on a prompt's first passes.
        if opts.budget_bytes == super::RAM_UNLIMITED && slots >= total_experts {
            let mut c = super::report::Counters::default();
            let ids: Vec<usize> = (0..moe.n_experts).collect();
            for l in (0..n).filter(|&l| cfg.layer_has_experts(l)) {
                experts.run(
                    l,
                    &ids,
                    fg.as_ref(),
                    &prefetcher,
                    max_read_bytes as usize,
                    &mut c,
                    &mut |_, _| Ok(()),
                )?;
            }
        }
        fg.reset_stats();
        bg.reset_stats();
        Ok(super::Streamer {
            batch_tokens_max: opts.batch_tokens_max.max(1),
            kv_positions: opts.kv_positions,
            read_bytes: opts.prefetch_read_bytes.max(crate::io::ALIGN_BYTES),
            residency,
            cost,
            engine: opts.engine,
            direct_io,
            warnings,
            // Without a cache, every routed expert of every layer is read per token.
            dense_bytes_per_token: cfg.expert_layers() as u64 * moe.n_used as u64 * expert_bytes,
            fg,
            bg,
            prefetcher,
            lookahead: None,
            layers: Vec::new(),
            embedding,
            output,
            resident_attn,
            resident_gate: vec![None; n],
            resident_ffn: Vec::new(),
            hidden: cfg.hidden,
            pass: Mutex::new(()),
            _registered: Vec::new(),
            _pinned: pinned,
            state: Mutex::new(super::State::new(Vec::new(), Vec::new(), Vec::new())),
            decode_start: Mutex::new(None),
            link: model.device.clone(),
            device_plan,
            hot: Vec::new(),
            experts: Some(experts),
            hybrid: None,
        })
    }
}
