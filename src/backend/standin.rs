//! A host stand-in for a device with memory of its own, so the paths that feed such a device
//! (the streaming path above all) can be tested where there is no GPU. It computes with the CPU
//! device, but only on its own copies of the weights it is handed, kept the way the CUDA device
//! keeps them: a resident weight is copied at first sight and found again by its address; a
//! volatile one (a buffer the stream refills, [`Weight::is_volatile`]) is copied at each use. A
//! streamed buffer handed over without that mark is then computed from a stale copy, and a test
//! comparing with the in-RAM model fails. It reports `host_memory() == false`, as the CUDA
//! device does. Not a compute device to run models on.
//!
//! Staged uploads ([`super::HostLink::begin_upload`]) follow the CUDA device's protocol and are checked
//! against it: a chunk's bytes are "copied" (snapshotted) when it is sent, and a product computes
//! from those snapshots only; a product over bytes never sent, bytes written after their chunk
//! was sent, or a chunk sent twice or out of bounds is recorded as an error the pass returns
//! ([`Device::take_error`]). Staging buffers come from a pool, refilled with a poison pattern when
//! they return, so a weight reading a reused buffer without its chunks having been sent again
//! computes from poison (and the comparison with the in-RAM model fails).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::cpu::CpuBackend;
use super::{Act, AttnShape, Device, HostLink, LinkCounters, RopeShape, TopRows, Upload};
use crate::config::FfnActivation;
use crate::kv::KvCache;
use crate::tensor::{Home, StagedBytes, Weight};

/// Resident copies: by (address, length, row stride) of the original bytes, the copy and what
/// keeps the original alive.
type Copies = HashMap<(usize, usize, usize), (Weight, Arc<dyn std::any::Any + Send + Sync>)>;

/// What the stand-in's staged uploads did (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UploadCounters {
    /// Staging buffers handed out, and how many of them came from the pool (reused).
    pub uploads: u64,
    pub reused: u64,
    /// Chunks sent, and of those, chunks sent while part of their buffer was still unsent:
    /// copies that overlap the staging of the rest.
    pub chunks: u64,
    pub early_chunks: u64,
    /// Bytes sent (copied to the "device") in those chunks.
    pub sent_bytes: u64,
    /// Bytes of staging buffers alive (kept or in use) now, and at most.
    pub held_bytes: u64,
    pub peak_held_bytes: u64,
    /// Products that read a staged buffer: each waited on the chunks its rows lie in.
    pub staged_uses: u64,
    pub chunk_waits: u64,
}

/// The byte every staging buffer is filled with when it is handed out.
const POISON: u8 = 0xA5;

/// The pool of staging buffers, shared with the buffers handed out (they return on drop).
type UploadPool = Arc<Mutex<Vec<Vec<u8>>>>;

/// Stand-ins alive in this process get distinct ids, so a staged buffer is only ever taken as
/// already copied by the stand-in that staged it.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub struct HostStandIn {
    cpu: CpuBackend,
    id: u64,
    pool: UploadPool,
    uploads: Arc<Mutex<UploadCounters>>,
    /// The first protocol error since the last `take_error`.
    error: Arc<Mutex<Option<String>>>,
    chunk_bytes: usize,
    /// Whether attention computes sinks (as the CPU; `without_attention_sinks`: as a device that
    /// does not, which refuses such models at load).
    sinks: bool,
    /// Host ranges page-locked for copies (`pin_host`, `map_host`): (start address, length,
    /// whether mapped for reads in place).
    pinned: Arc<Mutex<Vec<(usize, usize, bool)>>>,
    /// Volatile bytes copied from those ranges.
    pinned_copied: AtomicU64,
    /// Resident copies by (address, length, row stride) of the bytes they were made of, each
    /// holding those bytes alive (as the CUDA device does) so no other buffer takes the address.
    resident: Mutex<Copies>,
    /// Bytes copied for resident weights (once each) and for volatile ones (at every use).
    resident_bytes: AtomicU64,
    volatile_bytes: AtomicU64,
    volatile_copies: AtomicU64,
    /// Bytes brought to the host (`to_host`, `download`, `argmax_rows`'s tokens, `top_k_rows`'s
    /// candidates).
    to_host_bytes: AtomicU64,
    /// Activation bytes sent to the "device" (`upload`).
    uploaded_bytes: AtomicU64,
    /// Volatile copies made, by weight name.
    volatile_uses: Mutex<HashMap<String, u64>>,
    /// Uses of weights read in place from mapped memory (`in_place`), by weight name.
    in_place_uses: Mutex<HashMap<String, u64>>,
    /// Whether it says it rotates part of a head ([`Device::rope_partial`]; `with_whole_head_rope`:
    /// as a device whose RoPE rotates whole heads only).
    rope_partial: bool,
}

impl HostStandIn {
    pub fn new(threads: usize) -> HostStandIn {
        HostStandIn {
            cpu: CpuBackend::new(threads),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            pool: Arc::new(Mutex::new(Vec::new())),
            uploads: Arc::new(Mutex::new(UploadCounters::default())),
            error: Arc::new(Mutex::new(None)),
            chunk_bytes: super::UPLOAD_CHUNK_BYTES,
            sinks: true,
            pinned: Arc::new(Mutex::new(Vec::new())),
            pinned_copied: AtomicU64::new(0),
            resident: Mutex::new(HashMap::new()),
            resident_bytes: AtomicU64::new(0),
            volatile_bytes: AtomicU64::new(0),
            volatile_copies: AtomicU64::new(0),
            to_host_bytes: AtomicU64::new(0),
            uploaded_bytes: AtomicU64::new(0),
            volatile_uses: Mutex::new(HashMap::new()),
            in_place_uses: Mutex::new(HashMap::new()),
            rope_partial: true,
        }
    }

    /// A stand-in whose RoPE rotates whole heads only: a model with partial RoPE is refused at
    /// load on it.
    pub fn with_whole_head_rope(mut self) -> HostStandIn {
        self.rope_partial = false;
        self
    }

    /// How many times weights whose name contains `part` were used as volatile ones — copied at
    /// the use, or staged and copied when sent (a streamed layer's `ffn_up` rows, say: one use
    /// per pass that computed them here).
    pub fn volatile_uses(&self, part: &str) -> u64 {
        uses_of(&self.volatile_uses, part)
    }

    /// How many products read weights whose name contains `part` in place, from mapped host
    /// memory ([`super::HostLink::in_place`]), without a copy.
    pub fn in_place_uses(&self, part: &str) -> u64 {
        uses_of(&self.in_place_uses, part)
    }

    /// Bytes copied "to the device" so far: (resident weights, volatile weights).
    pub fn copied_bytes(&self) -> (u64, u64) {
        (
            self.resident_bytes.load(Ordering::Relaxed),
            self.volatile_bytes.load(Ordering::Relaxed) + self.upload_counters().sent_bytes,
        )
    }

    /// Staged rows sent in chunks of `bytes` (so that a small model's layer spans several).
    pub fn with_upload_chunk_bytes(mut self, bytes: usize) -> HostStandIn {
        self.chunk_bytes = bytes.max(1);
        self
    }

    /// Says it does not compute attention sinks ([`Device::attention_sinks`]): a model with them
    /// is refused at load.
    pub fn without_attention_sinks(mut self) -> HostStandIn {
        self.sinks = false;
        self
    }

    /// Host ranges page-locked now (see [`super::HostLink::pin_host`]).
    pub fn pinned_ranges(&self) -> usize {
        self.pinned.lock().expect("pinned ranges").len()
    }

    /// What the staged uploads did so far.
    pub fn upload_counters(&self) -> UploadCounters {
        *self.uploads.lock().expect("upload counters")
    }

    fn fail(&self, msg: String) {
        self.error.lock().expect("error").get_or_insert(msg);
    }

    /// Locks `bytes` (`pin_host`), mapped too when `mapped` (`map_host`); as cuMemHostRegister,
    /// a range overlapping one already locked is refused.
    fn lock_range(&self, bytes: &[u8], mapped: bool) -> Option<super::PinnedHost> {
        let range = (bytes.as_ptr() as usize, bytes.len(), mapped);
        let mut pinned = self.pinned.lock().expect("pinned ranges");
        if bytes.is_empty() || pinned.iter().any(|&(p, n, _)| range.0 < p + n && p < range.0 + range.1) {
            return None;
        }
        pinned.push(range);
        Some(super::PinnedHost(Box::new(Unpin {
            ranges: self.pinned.clone(),
            range,
        })))
    }

    /// The copy a staged upload made of `w`'s bytes (`w` viewing `bytes` of `staged`): its rows
    /// from the snapshots taken when their chunks were sent.
    fn staged_copy(&self, w: &Weight, bytes: &[u8], staged: &StandInUpload) -> Weight {
        let start = bytes.as_ptr() as usize - staged.host.as_ptr() as usize;
        let end = start + bytes.len();
        let mut copy = vec![POISON; bytes.len()];
        let mut covered = 0usize;
        let mut waits = 0u64;
        for (s, e, snap) in &staged.chunks {
            let (lo, hi) = ((*s).max(start), (*e).min(end));
            if lo >= hi {
                continue;
            }
            waits += 1;
            covered += hi - lo;
            copy[lo - start..hi - start].copy_from_slice(&snap[lo - s..hi - s]);
            if staged.host[lo..hi] != snap[lo - s..hi - s] {
                self.fail(format!(
                    "{}: staged bytes {lo}..{hi} changed after their chunk was sent to the device",
                    w.name
                ));
            }
        }
        if covered != bytes.len() {
            self.fail(format!(
                "{}: a product read staged bytes {start}..{end}, of which only {covered} were sent to the device",
                w.name
            ));
        }
        let mut u = self.uploads.lock().expect("upload counters");
        u.staged_uses += 1;
        u.chunk_waits += waits;
        drop(u);
        count_use(&self.volatile_uses, &w.name);
        Weight::shared_strided(&w.name, w.ty, w.rows, w.cols, Arc::new(copy), 0, w.row_stride_bytes)
            .expect("the copy has the original's shape")
    }

    /// The stand-in's own copy of `w`'s bytes, as a weight over them.
    fn on_device(&self, w: &Weight) -> Weight {
        let Some((bytes, keep)) = w.span() else {
            panic!(
                "{}: a weight whose bytes are on disk reached the device (streamed weights arrive as the stream's buffers)",
                w.name
            );
        };
        match w.home() {
            // Its own staging (this test device's one look at a type behind the trait).
            Home::Staged(s) => {
                let own = (s as &dyn std::any::Any).downcast_ref::<StandInStaged>();
                if let Some(StandInStaged(staged)) = own.filter(|s| s.0.device == self.id) {
                    return self.staged_copy(w, bytes, staged);
                }
            }
            // Mapped host memory, read in place: the bytes as they are now, never copied.
            Home::Mapped { device, .. } if device == self.id => {
                count_use(&self.in_place_uses, &w.name);
                return w.clone();
            }
            Home::Mapped { .. } | Home::Host | Home::OnDisk => {}
        }
        let copy = || {
            Weight::shared_strided(
                &w.name,
                w.ty,
                w.rows,
                w.cols,
                Arc::new(bytes.to_vec()),
                0,
                w.row_stride_bytes,
            )
            .expect("the copy has the original's shape")
        };
        if w.is_volatile() {
            self.volatile_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            self.volatile_copies.fetch_add(1, Ordering::Relaxed);
            let (lo, hi) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
            let pinned = self.pinned.lock().expect("pinned ranges");
            if pinned.iter().any(|&(p, n, _)| p <= lo && hi <= p + n) {
                self.pinned_copied.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            }
            count_use(&self.volatile_uses, &w.name);
            return copy();
        }
        let key = (bytes.as_ptr() as usize, bytes.len(), w.row_stride_bytes);
        let mut resident = self.resident.lock().expect("resident copies");
        resident
            .entry(key)
            .or_insert_with(|| {
                self.resident_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                (copy(), keep)
            })
            .0
            .clone()
    }
}

/// Uses counted by weight name: one more of `name`.
fn count_use(uses: &Mutex<HashMap<String, u64>>, name: &str) {
    *uses.lock().expect("uses").entry(name.to_string()).or_default() += 1;
}

/// The uses counted of weights whose name contains `part`.
fn uses_of(uses: &Mutex<HashMap<String, u64>>, part: &str) -> u64 {
    let uses = uses.lock().expect("uses");
    uses.iter()
        .filter(|(name, _)| name.contains(part))
        .map(|(_, n)| n)
        .sum()
}

/// Unlocks a range locked by `pin_host` when dropped.
struct Unpin {
    ranges: Arc<Mutex<Vec<(usize, usize, bool)>>>,
    range: (usize, usize, bool),
}

impl Drop for Unpin {
    fn drop(&mut self) {
        self.ranges.lock().expect("pinned ranges").retain(|&r| r != self.range);
    }
}

/// A staging buffer being filled (see the module docs); dropped — abandoned (a read failed),
/// or, wrapped in [`StandInStaged`], with the last weight over it — its buffer goes back to
/// the pool.
struct StandInUpload {
    host: Vec<u8>,
    /// Sent chunks: byte range and the snapshot "copied" at the send.
    chunks: Vec<(usize, usize, Vec<u8>)>,
    sent_bytes: usize,
    device: u64,
    pool: UploadPool,
    uploads: Arc<Mutex<UploadCounters>>,
    error: Arc<Mutex<Option<String>>>,
}

impl Drop for StandInUpload {
    fn drop(&mut self) {
        give_back(&self.pool, &self.uploads, std::mem::take(&mut self.host));
    }
}

/// A finished staging, as a weight's storage.
struct StandInStaged(StandInUpload);

impl StagedBytes for StandInStaged {
    fn bytes(&self) -> &[u8] {
        &self.0.host
    }
}

/// A staging buffer back to the pool, poisoned; beyond `UPLOAD_BUFFERS_KEPT` the smallest goes.
fn give_back(pool: &UploadPool, uploads: &Mutex<UploadCounters>, mut host: Vec<u8>) {
    host.fill(POISON);
    let mut pool = pool.lock().expect("upload pool");
    pool.push(host);
    if pool.len() > super::UPLOAD_BUFFERS_KEPT {
        let smallest = (0..pool.len()).min_by_key(|&i| pool[i].capacity()).expect("not empty");
        let gone = pool.swap_remove(smallest);
        uploads.lock().expect("upload counters").held_bytes -= gone.capacity() as u64;
    }
}

impl Upload for StandInUpload {
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.host
    }
    fn send(&mut self, start: usize, end: usize) {
        let overlaps = self.chunks.iter().any(|&(s, e, _)| start < e && s < end);
        if start >= end || end > self.host.len() || overlaps {
            self.error.lock().expect("error").get_or_insert(format!(
                "staged chunk {start}..{end} sent {} (buffer of {} bytes)",
                if overlaps { "twice" } else { "out of bounds" },
                self.host.len()
            ));
            return;
        }
        self.sent_bytes += end - start;
        let mut u = self.uploads.lock().expect("upload counters");
        u.chunks += 1;
        u.sent_bytes += (end - start) as u64;
        u.early_chunks += u64::from(self.sent_bytes < self.host.len());
        self.chunks.push((start, end, self.host[start..end].to_vec()));
    }
    fn finish(self: Box<Self>) -> Arc<dyn StagedBytes> {
        Arc::new(StandInStaged(*self))
    }
}

impl HostLink for HostStandIn {
    fn pin_host(&self, bytes: &[u8], _refilled: bool) -> Option<super::PinnedHost> {
        self.lock_range(bytes, false)
    }

    fn map_host(&self, bytes: &[u8], _refilled: bool) -> Option<super::PinnedHost> {
        self.lock_range(bytes, true)
    }

    fn in_place(&self, w: &Weight) -> Option<Weight> {
        let (bytes, _) = w.span()?;
        let (lo, hi) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
        let pinned = self.pinned.lock().expect("pinned ranges");
        pinned
            .iter()
            .find(|&&(p, n, mapped)| mapped && p <= lo && hi <= p + n)?;
        super::MappedHost::weight_over(w, self.id, lo as u64)
    }

    fn upload_chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    fn begin_upload(&self, bytes: usize) -> Box<dyn Upload> {
        // The CUDA device's pool policy (see UPLOAD_BUFFERS_KEPT): the smallest kept buffer that
        // fits, else the kept ones are freed and a new one made, sized in whole grains.
        let (reused, freed) = {
            let mut pool = self.pool.lock().expect("upload pool");
            let best = (0..pool.len())
                .filter(|&i| pool[i].capacity() >= bytes)
                .min_by_key(|&i| pool[i].capacity());
            match best {
                Some(i) => (Some(pool.swap_remove(i)), 0),
                None => (None, pool.drain(..).map(|b| b.capacity() as u64).sum()),
            }
        };
        let mut u = self.uploads.lock().expect("upload counters");
        u.uploads += 1;
        u.reused += u64::from(reused.is_some());
        u.held_bytes -= freed;
        let mut host = match reused {
            Some(b) => b,
            None => {
                let cap = bytes.max(1).div_ceil(super::UPLOAD_BUFFER_GRAIN) * super::UPLOAD_BUFFER_GRAIN;
                u.held_bytes += cap as u64;
                Vec::with_capacity(cap)
            }
        };
        u.peak_held_bytes = u.peak_held_bytes.max(u.held_bytes);
        drop(u);
        host.clear();
        host.resize(bytes, POISON);
        Box::new(StandInUpload {
            host,
            chunks: Vec::new(),
            sent_bytes: 0,
            device: self.id,
            pool: self.pool.clone(),
            uploads: self.uploads.clone(),
            error: self.error.clone(),
        })
    }

    fn host_memory(&self) -> bool {
        false
    }

    fn link(&self) -> Option<LinkCounters> {
        let (resident_bytes, volatile_bytes) = self.copied_bytes();
        let u = self.upload_counters();
        Some(LinkCounters {
            resident_bytes,
            volatile_bytes,
            volatile_copies: self.volatile_copies.load(Ordering::Relaxed) + u.chunks,
            staged_bytes: u.sent_bytes,
            pinned_bytes: u.sent_bytes + self.pinned_copied.load(Ordering::Relaxed),
            copy_ns: 0,
            to_host_bytes: self.to_host_bytes.load(Ordering::Relaxed),
            // It computes at each call: nothing is left to wait for.
            host_waits: 0,
            activation_bytes: self.uploaded_bytes.load(Ordering::Relaxed),
            // It keeps no copies of keyed weights.
            kept_bytes: 0,
        })
    }
}

impl Device for HostStandIn {
    fn take_error(&self) -> Option<crate::error::Error> {
        self.error
            .lock()
            .expect("error")
            .take()
            .map(|m| crate::error::Error::Device(format!("host stand-in: {m}")))
    }
    fn attention_sinks(&self) -> bool {
        self.sinks && self.cpu.attention_sinks()
    }
    fn name(&self) -> String {
        format!("host stand-in for a device ({})", Device::name(&self.cpu))
    }
    fn rope_partial(&self) -> bool {
        self.rope_partial
    }
    fn run<'a>(&self, f: Box<dyn FnOnce() + Send + 'a>) {
        self.cpu.run(f)
    }
    fn upload(&self, rows: usize, width: usize, values: Vec<f32>) -> Act {
        self.uploaded_bytes
            .fetch_add(4 * values.len() as u64, Ordering::Relaxed);
        self.cpu.upload(rows, width, values)
    }
    fn zeros(&self, rows: usize, width: usize) -> Act {
        self.cpu.zeros(rows, width)
    }
    fn copy(&self, x: &Act) -> Act {
        self.cpu.copy(x)
    }
    fn to_host<'a>(&self, a: &'a Act) -> Cow<'a, [f32]> {
        self.to_host_bytes
            .fetch_add((a.rows * a.width * 4) as u64, Ordering::Relaxed);
        self.cpu.to_host(a)
    }
    fn download(&self, a: Act) -> Vec<f32> {
        self.to_host_bytes
            .fetch_add((a.rows * a.width * 4) as u64, Ordering::Relaxed);
        self.cpu.download(a)
    }
    fn argmax_rows(&self, x: &Act, banned: &[u32]) -> Vec<u32> {
        // As a GPU: the tokens, not the rows, come to the host.
        self.to_host_bytes.fetch_add((x.rows * 4) as u64, Ordering::Relaxed);
        self.cpu.argmax_rows(x, banned)
    }
    fn top_k_rows(&self, x: &Act, k: usize, banned: &[u32], lse: bool, greedy: bool) -> TopRows {
        // As a GPU: the candidates (an id and a value each), each row's log-sum-exp and greedy
        // token, not the rows.
        let row_bytes = k * 8 + if lse { 8 } else { 0 } + if greedy { 4 } else { 0 };
        self.to_host_bytes
            .fetch_add((x.rows * row_bytes) as u64, Ordering::Relaxed);
        self.cpu.top_k_rows(x, k, banned, lse, greedy)
    }
    fn embed(&self, w: &Weight, ids: &[u32], scale: f32) -> Act {
        self.cpu.embed(&self.on_device(w), ids, scale)
    }
    fn rms_norm(&self, x: &Act, w: &[f32], eps: f32) -> Act {
        self.cpu.rms_norm(x, w, eps)
    }
    fn rms_norm_in_place(&self, x: &mut Act, w: &[f32], eps: f32) {
        self.cpu.rms_norm_in_place(x, w, eps)
    }
    fn add(&self, x: &mut Act, y: &Act) {
        self.cpu.add(x, y)
    }
    fn add_bias(&self, x: &mut Act, b: &[f32]) {
        self.cpu.add_bias(x, b)
    }
    fn mul(&self, x: &mut Act, y: &Act) {
        self.cpu.mul(x, y)
    }
    fn activate(&self, x: &mut Act, f: FfnActivation) {
        self.cpu.activate(x, f)
    }
    fn softcap(&self, x: &mut Act, cap: f32) {
        self.cpu.softcap(x, cap)
    }
    fn select_rows(&self, x: &Act, rows: &[usize]) -> Act {
        self.cpu.select_rows(x, rows)
    }
    fn scatter_cols(&self, x: &Act, cols: &[u32], width: usize) -> Act {
        self.cpu.scatter_cols(x, cols, width)
    }
    fn gather_cols(&self, x: &Act, cols: &[u32]) -> Act {
        self.cpu.gather_cols(x, cols)
    }
    fn add_rows_scaled(&self, out: &mut Act, y: &Act, rows: &[usize], scales: &[f32]) {
        self.cpu.add_rows_scaled(out, y, rows, scales)
    }
    fn matmul(&self, ws: &[&Weight], x: &Act) -> Vec<Act> {
        let copies: Vec<Weight> = ws.iter().map(|w| self.on_device(w)).collect();
        self.cpu.matmul(&copies.iter().collect::<Vec<_>>(), x)
    }
    fn matmul_rows(&self, w: &Weight, rows: &[u32], x: &Act) -> Act {
        self.cpu.matmul_rows(&self.on_device(w), rows, x)
    }
    fn accumulate_rows(&self, w: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        self.cpu.accumulate_rows(&self.on_device(w), rows, acts, out)
    }
    fn accumulate_rows_onto(&self, w: &Weight, rows: Option<&[u32]>, acts: &Act, base: Vec<f64>, out: &mut Act) {
        // The base crosses the link as f64.
        self.uploaded_bytes.fetch_add(8 * base.len() as u64, Ordering::Relaxed);
        self.cpu.accumulate_rows_onto(&self.on_device(w), rows, acts, base, out)
    }
    fn accumulate_rows_joined(&self, head: &Weight, tail: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        // Each part where the device has it (kept, copied or read in place), joined there.
        let joined = super::join_rows(&self.on_device(head), &self.on_device(tail)).expect("rows that join");
        self.cpu.accumulate_rows(&joined, rows, acts, out)
    }
    fn rope_qk(
        &self,
        q: &mut Act,
        k: &mut Act,
        positions: &[usize],
        shape: RopeShape,
        q_norm: Option<&[f32]>,
        k_norm: Option<&[f32]>,
        eps: f32,
    ) {
        self.cpu.rope_qk(q, k, positions, shape, q_norm, k_norm, eps)
    }
    fn kv_write(
        &self,
        layer: usize,
        k: &Act,
        v: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &mut [&mut KvCache],
    ) {
        self.cpu.kv_write(layer, k, v, positions, seq_of_token, caches)
    }
    fn attention(
        &self,
        q: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &[&mut KvCache],
        shape: AttnShape<'_>,
    ) -> Act {
        self.cpu.attention(q, positions, seq_of_token, caches, shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;

    /// A 4×8 F32 matrix (32-byte rows) and its bytes.
    fn matrix() -> (Weight, Vec<u8>) {
        let values: Vec<f32> = (0..32).map(|i| i as f32 * 0.25 - 3.0).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        (Weight::owned("w", GgmlType::F32, 4, 8, bytes.clone()).unwrap(), bytes)
    }

    fn product(dev: &HostStandIn, w: &Weight) -> Vec<f32> {
        let x = dev.upload(1, 8, (0..8).map(|i| 1.0 - i as f32 * 0.1).collect());
        dev.download(dev.matmul(&[w], &x).remove(0))
    }

    fn staged(dev: &HostStandIn, bytes: &[u8], sends: &[(usize, usize)], write_after: bool) -> Weight {
        let mut up = dev.begin_upload(bytes.len());
        up.bytes_mut().copy_from_slice(bytes);
        for &(s, e) in sends {
            up.send(s, e);
        }
        if write_after {
            up.bytes_mut()[0] ^= 1;
        }
        Weight::staged("w", GgmlType::F32, 4, 8, up.finish()).unwrap()
    }

    #[test]
    fn a_product_over_staged_rows_computes_from_the_chunks_as_sent() {
        let (w, bytes) = matrix();
        let dev = HostStandIn::new(1);
        let want = product(&dev, &w);
        let s = staged(&dev, &bytes, &[(64, 128), (0, 64)], false);
        assert_eq!(product(&dev, &s), want);
        assert!(dev.take_error().is_none());
        let c = dev.upload_counters();
        assert_eq!(
            (c.uploads, c.reused, c.chunks, c.early_chunks, c.sent_bytes),
            (1, 0, 2, 1, 128)
        );
        assert_eq!((c.staged_uses, c.chunk_waits), (1, 2));
        // A staged buffer is copied once, when sent, not again at each use.
        let (_, volatile) = dev.copied_bytes();
        assert_eq!(volatile, 128);
        assert_eq!(dev.link().unwrap().staged_bytes, 128);
        // Released, the buffer returns to the pool, poisoned, and is handed out again.
        drop(s);
        let again = staged(&dev, &bytes, &[(0, 128)], false);
        assert_eq!(product(&dev, &again), want);
        assert_eq!(dev.upload_counters().reused, 1);
        drop(again);
        let mut up = dev.begin_upload(128);
        assert!(up.bytes_mut().iter().all(|&b| b == POISON));
    }

    #[test]
    fn staging_protocol_errors_are_returned_by_the_pass() {
        let (_, bytes) = matrix();
        let expect = |sends: &[(usize, usize)], write_after: bool, what: &str| {
            let dev = HostStandIn::new(1);
            let s = staged(&dev, &bytes, sends, write_after);
            product(&dev, &s);
            let e = dev.take_error().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(what), "{sends:?}: {e:?} lacks {what:?}");
        };
        expect(&[(0, 64)], false, "of which only 64 were sent");
        expect(&[(0, 64), (64, 128)], true, "changed after their chunk was sent");
        expect(&[(0, 64), (32, 128)], false, "sent twice");
        expect(&[(0, 129)], false, "out of bounds");
    }

    #[test]
    fn staging_buffers_are_reused_smallest_first_and_two_are_kept() {
        let dev = HostStandIn::new(1);
        let k = 1u64 << 10;
        let held = || dev.upload_counters().held_bytes;
        drop(dev.begin_upload(100_000)); // 2 grains
        assert_eq!(held(), 128 * k);
        // Nothing kept fits: the kept buffer is freed before a larger one is made.
        drop(dev.begin_upload(200_000)); // 4 grains
        assert_eq!(held(), 256 * k);
        let a = dev.begin_upload(50_000); // the kept 256 KiB
        let b = dev.begin_upload(50_000); // a new grain
        assert_eq!(held(), 320 * k);
        drop((a, b));
        let (c, d) = (dev.begin_upload(10), dev.begin_upload(10)); // smallest first: 64, then 256
        let e = dev.begin_upload(10); // a new grain
        assert_eq!(held(), 384 * k);
        drop((c, d, e));
        // Three back, two kept: the smallest goes.
        assert_eq!(held(), 320 * k);
        let u = dev.upload_counters();
        assert_eq!((u.uploads, u.reused, u.peak_held_bytes), (7, 3, 384 * k));
    }
}
