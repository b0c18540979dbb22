//! Staged uploads on CUDA ([`HostLink::begin_upload`](crate::backend::HostLink::begin_upload)): a
//! decode step's streamed rows are written into page-locked host memory (not write-combined),
//! and each chunk, once complete, is copied to a device twin of that buffer on the device's
//! copy stream, asynchronously, with an event recorded after it. A product over the staged rows
//! makes the compute stream wait on the events of the chunks it reads — so the copies run while
//! later rows are still being read from disk, and the compute never waits on the host.
//!
//! Buffers (host and device twin: a slot) are pooled and reused from step to step. Reuse is
//! ordered by two events of the slot's last use: the host waits until that use's copies have
//! read the host memory (`copies_done`) before handing the slot out to be written, and the copy
//! stream waits until that use's kernels have read the device twin (`readers_done`) before
//! copying into it again.
//!
//! The stream's own FFN staging (where dense steps' and prompts' rows are gathered) is
//! page-locked in place (`pin_host`, `cuMemHostRegister`); a weight over it is copied into a
//! pooled device buffer on the copy stream (`copy_pinned`), the host waiting for that copy alone
//! (the stream refills the buffer next), the compute stream for its event.

use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};

use crate::backend::{LinkCounters, Upload};
use crate::tensor::StagedBytes;

use crate::backend::{UPLOAD_BUFFERS_KEPT, UPLOAD_BUFFER_GRAIN};

/// What the device and its uploads share.
pub(crate) struct Uploads {
    pub ctx: Arc<CudaContext>,
    /// The device's (compute) stream, and the stream staged chunks are copied on.
    pub compute: Arc<CudaStream>,
    pub copy: Arc<CudaStream>,
    pub link: Arc<Mutex<LinkCounters>>,
    pub error: Arc<Mutex<Option<String>>>,
    pub device_id: usize,
    free: Mutex<Vec<Slot>>,
    /// Timed events whose copies were reaped, recorded again rather than created anew (a
    /// decode step records a few hundred).
    events: Mutex<Vec<CudaEvent>>,
}

/// A page-locked host buffer and its device twin, with the events of its last use.
struct Slot {
    host: *mut u8,
    cap: usize,
    _dev: CudaSlice<u8>,
    dev_ptr: u64,
    copies_done: Option<CudaEvent>,
    readers_done: Option<CudaEvent>,
    /// Each chunk copy of this (or the last) use, in the order sent: events recorded on the copy
    /// stream before and after it (timed; the compute stream waits on the second).
    timings: Vec<(CudaEvent, CudaEvent)>,
}

// SAFETY: `host` is page-locked memory owned by the slot alone (freed in `Drop`); whoever holds
// the slot is the only one that writes it, and the copy engine reads it only between a copy's
// launch and `copies_done`, which the pool waits for before handing the slot out again.
unsafe impl Send for Slot {}
// SAFETY: as for `Send`: one holder writes the slot; the copy engine reads it only while the
// pool waits.
unsafe impl Sync for Slot {}

impl Drop for Slot {
    fn drop(&mut self) {
        // The copy engine may still read the host memory: wait before freeing it.
        if let Some(e) = &self.copies_done {
            let _ = e.synchronize();
        }
        // SAFETY: allocated by `cuMemHostAlloc` in `Uploads::slot`, freed once, here, after the
        // copies that read it.
        unsafe {
            let _ = result::free_host(self.host as _);
        }
    }
}

impl Uploads {
    pub fn new(
        ctx: Arc<CudaContext>,
        compute: Arc<CudaStream>,
        link: Arc<Mutex<LinkCounters>>,
        error: Arc<Mutex<Option<String>>>,
        device_id: usize,
    ) -> std::result::Result<Uploads, cudarc::driver::DriverError> {
        let copy = ctx.new_stream()?;
        Ok(Uploads {
            ctx,
            compute,
            copy,
            link,
            error,
            device_id,
            free: Mutex::new(Vec::new()),
            events: Mutex::new(Vec::new()),
        })
    }

    fn fail(&self, msg: String) {
        self.error.lock().expect("error").get_or_insert(msg);
    }

    /// Adds the timed copies of a slot whose copies are done to the link's copy time.
    fn reap(&self, slot: &mut Slot) {
        if slot.timings.is_empty() {
            return;
        }
        let mut ns = 0u64;
        let mut spare = Vec::with_capacity(2 * slot.timings.len());
        for (start, end) in slot.timings.drain(..) {
            match start.elapsed_ms(&end) {
                Ok(ms) => ns += (ms as f64 * 1e6) as u64,
                Err(e) => {
                    self.fail(format!("CUDA: timing a staged copy: {e}"));
                    return;
                }
            }
            spare.push(start);
            spare.push(end);
        }
        self.link.lock().expect("link counters").copy_ns += ns;
        let mut events = self.events.lock().expect("spare events");
        if events.len() < 4096 {
            events.extend(spare);
        }
    }

    /// A timed event recorded now on the copy stream: a spare one (its last recording's work
    /// done: reaped) or a new one.
    fn record_copy_event(&self) -> std::result::Result<CudaEvent, cudarc::driver::DriverError> {
        let spare = self.events.lock().expect("spare events").pop();
        match spare {
            Some(e) => e.record(&self.copy).map(|_| e),
            None => self.copy.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)),
        }
    }

    /// A slot of at least `bytes`, its last use's copies done and its device twin free for the
    /// copy stream to write: from the pool, or a new one.
    fn slot(&self, bytes: usize) -> std::result::Result<Slot, String> {
        let (reused, too_small) = {
            let mut free = self.free.lock().expect("upload slots");
            let best = (0..free.len())
                .filter(|&i| free[i].cap >= bytes)
                .min_by_key(|&i| free[i].cap);
            match best {
                Some(i) => (Some(free.swap_remove(i)), Vec::new()),
                // None fits: free them before making a larger one (see UPLOAD_BUFFERS_KEPT).
                None => (None, std::mem::take(&mut *free)),
            }
        };
        drop(too_small);
        if let Some(mut s) = reused {
            if let Some(e) = &s.copies_done {
                e.synchronize()
                    .map_err(|e| format!("CUDA: waiting for a staged copy: {e}"))?;
            }
            self.reap(&mut s);
            if let Some(e) = &s.readers_done {
                self.copy
                    .wait(e)
                    .map_err(|e| format!("CUDA: ordering a staged copy after its buffer's last readers: {e}"))?;
            }
            return Ok(s);
        }
        let cap = bytes.max(1).div_ceil(UPLOAD_BUFFER_GRAIN) * UPLOAD_BUFFER_GRAIN;
        let err = |what: &'static str| move |e: cudarc::driver::DriverError| format!("CUDA: {what} ({cap} bytes): {e}");
        self.ctx.bind_to_thread().map_err(err("binding the context"))?;
        // SAFETY: a fresh allocation, written by the staging before any copy reads it; flags 0:
        // page-locked, not write-combined (the host may read the staged rows too).
        let host =
            unsafe { result::malloc_host(cap, 0) }.map_err(err("allocating page-locked staging memory"))? as *mut u8;
        // SAFETY: the device twin is written only by staged copies before kernels read it.
        let dev = match unsafe { self.compute.alloc::<u8>(cap) } {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: allocated just above, not yet shared.
                unsafe {
                    let _ = result::free_host(host as _);
                }
                return Err(err("allocating a staging buffer on the GPU")(e));
            }
        };
        let dev_ptr = dev.device_ptr(&self.compute).0;
        // The allocation is ordered on the compute stream; the copy stream waits for it.
        let allocated = self.compute.record_event(None).map_err(err("recording an event"))?;
        self.copy.wait(&allocated).map_err(err("ordering the copy stream"))?;
        Ok(Slot {
            host,
            cap,
            _dev: dev,
            dev_ptr,
            copies_done: None,
            readers_done: None,
            timings: Vec::new(),
        })
    }

    /// A slot back to the pool after a use: its copies and (if any) readers recorded as events.
    fn give_back(&self, mut slot: Slot, read: bool) {
        let copies = self.copy.record_event(None);
        let readers = if read {
            self.compute.record_event(None).map(Some)
        } else {
            Ok(None)
        };
        match (copies, readers) {
            (Ok(c), Ok(r)) => {
                slot.copies_done = Some(c);
                if r.is_some() {
                    slot.readers_done = r;
                }
            }
            (Err(e), _) | (_, Err(e)) => {
                // Without the events the slot cannot be reused safely: wait and drop it.
                self.fail(format!("CUDA: recording a staged buffer's last use: {e}"));
                let _ = self.copy.synchronize();
                let _ = self.compute.synchronize();
                return;
            }
        }
        let mut free = self.free.lock().expect("upload slots");
        free.push(slot);
        if free.len() > UPLOAD_BUFFERS_KEPT {
            let smallest = (0..free.len()).min_by_key(|&i| free[i].cap).expect("not empty");
            free.swap_remove(smallest);
        }
    }

    /// Adds the copy time of the slots waiting in the pool (their copies done first).
    pub fn reap_free(&self) {
        let mut free = self.free.lock().expect("upload slots");
        for s in free.iter_mut() {
            if let Some(e) = &s.copies_done {
                if let Err(e) = e.synchronize() {
                    self.fail(format!("CUDA: waiting for a staged copy: {e}"));
                    return;
                }
            }
            self.reap(s);
        }
    }
}

/// A staging in progress (or, wrapped in [`CudaStaged`], finished). Dropped, it returns its
/// slot to the pool.
pub(crate) struct CudaUpload {
    uploads: Arc<Uploads>,
    slot: Option<Slot>,
    len: usize,
    /// Sent chunks' byte ranges; chunk i's events are the slot's `timings[i]`.
    chunks: Vec<(usize, usize)>,
    /// Whether kernels may have read the device twin (a finished staging's products).
    read: bool,
}

/// A finished staging, as a weight's storage; back to the pool when the last weight drops.
pub(crate) struct CudaStaged {
    upload: CudaUpload,
    /// Which chunks' events the compute stream already waits on.
    waited: Mutex<Vec<bool>>,
}

impl Uploads {
    /// Copies `src` to byte `offset` of `slot`'s device twin on the copy stream, between two
    /// timed events (the second recorded in the slot's timings: what the compute stream waits
    /// on). The caller keeps `src` untouched until the copy is done.
    fn copy_async(
        &self,
        slot: &mut Slot,
        offset: usize,
        src: &[u8],
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        let begun = self.record_copy_event()?;
        self.ctx.bind_to_thread()?;
        // SAFETY: the caller checked `offset + src.len()` against the slot's capacity; the copy
        // stream waited for the twin's last readers when the slot was handed out; `src` stays
        // untouched until the copy is done (the caller's promise).
        unsafe { result::memcpy_htod_async(slot.dev_ptr + offset as u64, src, self.copy.cu_stream())? };
        let done = self.record_copy_event()?;
        slot.timings.push((begun, done));
        Ok(())
    }

    /// Counts a copy of `bytes` from page-locked memory (`staged`: from a staging buffer).
    fn count(&self, bytes: usize, staged: bool) {
        let mut link = self.link.lock().expect("link counters");
        link.volatile_bytes += bytes as u64;
        link.pinned_bytes += bytes as u64;
        link.staged_bytes += if staged { bytes as u64 } else { 0 };
        link.volatile_copies += 1;
    }
}

/// A staging buffer of `bytes`, or `None` with the device's error set (the caller then stages
/// in ordinary memory, and the pass returns the error).
pub(crate) fn begin(uploads: &Arc<Uploads>, bytes: usize) -> Option<CudaUpload> {
    match uploads.slot(bytes) {
        Ok(slot) => Some(CudaUpload {
            uploads: uploads.clone(),
            slot: Some(slot),
            len: bytes,
            chunks: Vec::new(),
            read: false,
        }),
        Err(msg) => {
            uploads.fail(msg);
            None
        }
    }
}

impl CudaUpload {
    fn slot(&self) -> &Slot {
        self.slot.as_ref().expect("an upload holds its slot until dropped")
    }
}

impl Upload for CudaUpload {
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `host` holds `cap >= len` bytes, this upload holds the slot alone, and the
        // slot's last copies finished before it was handed out (`Uploads::slot`).
        unsafe { std::slice::from_raw_parts_mut(self.slot().host, self.len) }
    }

    fn send(&mut self, start: usize, end: usize) {
        let u = self.uploads.clone();
        let overlaps = self.chunks.iter().any(|&(s, e)| start < e && s < end);
        if start >= end || end > self.len || overlaps {
            u.fail(format!(
                "CUDA: staged chunk {start}..{end} sent {} (buffer of {} bytes)",
                if overlaps { "twice" } else { "out of bounds" },
                self.len
            ));
            return;
        }
        let s = self.slot.as_mut().expect("an upload holds its slot until dropped");
        // SAFETY: (of the slice) `start..end` lies inside the host buffer (checked above). The
        // staging writes each range once, before sending it, and the pool waits for the slot's
        // copies before handing it out again: the bytes stay untouched until the copy is done.
        let src = unsafe { std::slice::from_raw_parts(s.host.add(start), end - start) };
        match u.copy_async(s, start, src) {
            Ok(()) => {
                self.chunks.push((start, end));
                u.count(end - start, true);
            }
            Err(e) => u.fail(format!("CUDA: copying staged bytes {start}..{end} to the GPU: {e}")),
        }
    }

    fn finish(self: Box<Self>) -> Arc<dyn StagedBytes> {
        let n = self.chunks.len();
        Arc::new(CudaStaged {
            upload: *self,
            waited: Mutex::new(vec![false; n]),
        })
    }
}

impl Drop for CudaUpload {
    /// Back to the pool once the copies already sent are done (and, if read, the kernels that
    /// read the twin): a finished staging's last weight dropped, or one abandoned (a read
    /// failed).
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.uploads.give_back(slot, self.read);
        }
    }
}

impl StagedBytes for CudaStaged {
    fn bytes(&self) -> &[u8] {
        // SAFETY: as in `CudaUpload::bytes_mut`; nothing writes the host bytes after the
        // staging finished.
        unsafe { std::slice::from_raw_parts(self.upload.slot().host, self.upload.len) }
    }

    /// The device address of host bytes `bytes` (a view of this staging), after making the
    /// compute stream wait on the copies of the chunks they lie in; an error when part of them
    /// was never sent.
    fn device_address(&self, device: u64, bytes: &[u8]) -> Option<std::result::Result<u64, String>> {
        let u = &self.upload;
        if device as usize != u.uploads.device_id {
            return None;
        }
        let s = u.slot();
        let start = (bytes.as_ptr() as usize).wrapping_sub(s.host as usize);
        let end = start.saturating_add(bytes.len());
        if end > u.len {
            return Some(Err(format!(
                "staged bytes {start}..{end} lie outside the {}-byte staging",
                u.len
            )));
        }
        let mut covered = 0;
        let mut waited = self.waited.lock().expect("waited chunks");
        for (i, ((cs, ce), (_, event))) in u.chunks.iter().zip(&s.timings).enumerate() {
            let (lo, hi) = ((*cs).max(start), (*ce).min(end));
            if lo >= hi {
                continue;
            }
            covered += hi - lo;
            if !waited[i] {
                if let Err(e) = u.uploads.compute.wait(event) {
                    return Some(Err(format!("CUDA: waiting on a staged copy: {e}")));
                }
                waited[i] = true;
            }
        }
        if covered != bytes.len() {
            return Some(Err(format!(
                "a product read staged bytes {start}..{end}, of which only {covered} were sent to the GPU"
            )));
        }
        Some(Ok(s.dev_ptr + start as u64))
    }
}

impl Drop for CudaStaged {
    /// Products may have read the twin: the slot's reuse waits for them (the upload, dropped
    /// next, gives it back).
    fn drop(&mut self) {
        self.upload.read = true;
    }
}

/// Copies `bytes` — page-locked host memory (registered with
/// [`pin_host`](crate::backend::HostLink::pin_host)) — into a pooled device buffer on the copy
/// stream, at the link's pinned speed; the compute stream waits for the copy, and so does the
/// host when the memory is `refilled` (the stream refills its buffers once the weight's use
/// returns; resident weights stay as they are, so their copies overlap the host's work). The
/// device address and a holder that returns the buffer to the pool when dropped, after the
/// launch that reads it.
pub(crate) fn copy_pinned(
    uploads: &Arc<Uploads>,
    bytes: &[u8],
    refilled: bool,
) -> std::result::Result<(u64, Arc<dyn std::any::Any + Send + Sync>), String> {
    let mut up = CudaUpload {
        uploads: uploads.clone(),
        slot: Some(uploads.slot(bytes.len())?),
        len: bytes.len(),
        chunks: Vec::new(),
        read: false,
    };
    let s = up.slot.as_mut().expect("just taken");
    let copied = uploads.copy_async(s, 0, bytes).and_then(|()| {
        let (_, done) = s.timings.last().expect("just recorded");
        uploads.compute.wait(done)?;
        match refilled {
            true => done.synchronize(),
            false => Ok(()),
        }
    });
    // On an error `up` drops, giving the slot back after the copy stream's queued work.
    copied.map_err(|e| {
        format!(
            "CUDA: copying {} bytes from page-locked memory to the GPU: {e}",
            bytes.len()
        )
    })?;
    uploads.count(bytes.len(), false);
    up.chunks.push((0, bytes.len()));
    let ptr = up.slot().dev_ptr;
    let holder: Arc<dyn std::any::Any + Send + Sync> = Arc::new(CudaStaged {
        upload: up,
        waited: Mutex::new(vec![true]),
    });
    Ok((ptr, holder))
}

/// `GATESTREAM_CUDA_MAP_HOST`: `1` (or `on`, the default) maps the stream's neuron cache into
/// the GPU's address space (`HostLink::map_host`), so a masked decode step's products read the kept
/// rows in place across the link instead of having them gathered into staging and copied; `0`
/// (`off`) only page-locks it (the rows are then staged, as from disk). The binary's `--map-host`
/// flag sets it (and wins over the variable).
pub const MAP_HOST_ENV: &str = "GATESTREAM_CUDA_MAP_HOST";

/// Whether [`MAP_HOST_ENV`] asks for mapping (`value`: the variable's value).
pub fn map_host_asked(value: Option<&str>) -> crate::error::Result<bool> {
    super::switch_asked(
        MAP_HOST_ENV,
        value,
        "kept rows read in place from the mapped neuron cache",
        "kept rows staged and copied",
    )
}

/// A host range page-locked for copies: whether the stream refills it, and where the device
/// sees it when it is also mapped (`map_host`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Pinned {
    start: usize,
    len: usize,
    refilled: bool,
    mapped: Option<u64>,
}

/// The host ranges this device page-locked, by start address (ranges never overlap: the driver
/// refuses to register memory twice). A mixture of experts registers each expert buffer of its
/// cache, thousands of ranges, looked up at every copy.
pub(crate) type PinnedRanges = Arc<Mutex<std::collections::BTreeMap<usize, Pinned>>>;

/// Page-locks `bytes` for copies (see `HostLink::pin_host`), and maps them into the device's
/// address space when `map` (`HostLink::map_host`); `None` if the driver refuses.
pub(crate) fn pin_host(
    ctx: &Arc<CudaContext>,
    ranges: &PinnedRanges,
    bytes: &[u8],
    refilled: bool,
    map: bool,
) -> Option<crate::backend::PinnedHost> {
    if bytes.is_empty() {
        return None;
    }
    ctx.bind_to_thread().ok()?;
    let flags = match map {
        true => sys::CU_MEMHOSTREGISTER_DEVICEMAP,
        false => 0,
    };
    // SAFETY: `bytes` is live host memory; the caller keeps it allocated until the guard
    // returned here drops (which unregisters it). Flags 0: the device only copies from it;
    // DEVICEMAP: its kernels may also read it (never write: weights are only read).
    unsafe { sys::cuMemHostRegister_v2(bytes.as_ptr() as *mut _, bytes.len(), flags) }
        .result()
        .ok()?;
    let mapped = match map {
        false => None,
        true => {
            let mut address: sys::CUdeviceptr = 0;
            // SAFETY: the range was just registered with DEVICEMAP; the address is written once.
            let got = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut address, bytes.as_ptr() as *mut _, 0) };
            if got.result().is_err() {
                // SAFETY: registered just above, by this call, and not yet used.
                unsafe {
                    let _ = sys::cuMemHostUnregister(bytes.as_ptr() as *mut _);
                }
                return None;
            }
            Some(address)
        }
    };
    let range = Pinned {
        start: bytes.as_ptr() as usize,
        len: bytes.len(),
        refilled,
        mapped,
    };
    ranges.lock().expect("pinned ranges").insert(range.start, range);
    Some(crate::backend::PinnedHost(Box::new(Unpin {
        ctx: ctx.clone(),
        ranges: ranges.clone(),
        range,
    })))
}

/// Unregisters a range page-locked by [`pin_host`] when dropped.
struct Unpin {
    ctx: Arc<CudaContext>,
    ranges: PinnedRanges,
    range: Pinned,
}

// SAFETY: only the range's address is kept (as a number); unregistering is a driver call that
// any thread may make with the context bound.
unsafe impl Send for Unpin {}
// SAFETY: as for `Send`: nothing but the address (a number) is shared.
unsafe impl Sync for Unpin {}

impl Drop for Unpin {
    fn drop(&mut self) {
        {
            let mut ranges = self.ranges.lock().expect("pinned ranges");
            if ranges.get(&self.range.start) == Some(&self.range) {
                ranges.remove(&self.range.start);
            }
        }
        let _ = self.ctx.bind_to_thread();
        // Copies from a range that is not refilled may still be in flight (`copy_pinned` does
        // not wait for them), and kernels may read a mapped one: the device finishes its work
        // before the range is unlocked.
        if !self.range.refilled || self.range.mapped.is_some() {
            let _ = self.ctx.synchronize();
        }
        // SAFETY: registered by `pin_host`, unregistered once, here, after every copy from it
        // finished (refilled ranges: `copy_pinned` waited for each; the others: just above).
        unsafe {
            let _ = sys::cuMemHostUnregister(self.range.start as *mut _);
        }
    }
}

/// The range of `ranges` that `bytes` lie inside, if any.
fn range_of(ranges: &PinnedRanges, bytes: &[u8]) -> Option<Pinned> {
    let (lo, hi) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
    ranges
        .lock()
        .expect("pinned ranges")
        .range(..=lo)
        .next_back()
        .map(|(_, r)| *r)
        .filter(|r| r.start <= lo && hi <= r.start + r.len)
}

/// Whether `bytes` lie inside one of `ranges`: `Some(refilled)` if so.
pub(crate) fn pinned_range(ranges: &PinnedRanges, bytes: &[u8]) -> Option<bool> {
    range_of(ranges, bytes).map(|r| r.refilled)
}

/// Where the device sees `bytes` when they lie inside a mapped range.
pub(crate) fn mapped_address(ranges: &PinnedRanges, bytes: &[u8]) -> Option<u64> {
    let r = range_of(ranges, bytes)?;
    Some(r.mapped? + (bytes.as_ptr() as usize - r.start) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_map_host_variable_is_read_strictly() {
        assert!(map_host_asked(None).unwrap());
        for off in ["0", "off", " off "] {
            assert!(!map_host_asked(Some(off)).unwrap(), "{off:?}");
        }
        for on in ["", "1", "on"] {
            assert!(map_host_asked(Some(on)).unwrap(), "{on:?}");
        }
        let e = map_host_asked(Some("no")).unwrap_err().to_string();
        assert!(e.contains("GATESTREAM_CUDA_MAP_HOST=no") && e.contains("or 0"), "{e}");
    }

    #[test]
    fn a_mapped_range_gives_device_addresses_inside_it_only() {
        let bytes = [0u8; 64];
        let ranges: PinnedRanges = Arc::new(Mutex::new(
            [
                Pinned {
                    start: bytes.as_ptr() as usize,
                    len: 32,
                    refilled: false,
                    mapped: Some(0x7000),
                },
                Pinned {
                    start: bytes.as_ptr() as usize + 32,
                    len: 32,
                    refilled: true,
                    mapped: None,
                },
            ]
            .into_iter()
            .map(|r| (r.start, r))
            .collect(),
        ));
        assert_eq!(mapped_address(&ranges, &bytes[8..16]), Some(0x7008));
        assert_eq!(pinned_range(&ranges, &bytes[8..16]), Some(false));
        // Pinned but not mapped; and across the two ranges.
        assert_eq!(mapped_address(&ranges, &bytes[40..48]), None);
        assert_eq!(pinned_range(&ranges, &bytes[40..48]), Some(true));
        assert_eq!(mapped_address(&ranges, &bytes[24..40]), None);
        assert_eq!(pinned_range(&ranges, &bytes[24..40]), None);
    }
}
