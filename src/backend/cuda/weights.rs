//! Weights, vectors and index lists on the device: copied on first use and kept by the address
//! of their host bytes (streamed weights copied at each use, or read in place over mapped host
//! memory).

use super::*;
use crate::tensor::Home;

/// A kept copy's key: the weight's content key ([`Weight::keyed`]) and its length.
type KeptKey = (u64, u64, usize);

/// The device's copies of keyed volatile weights (routed experts), within `cap` bytes, the
/// least recently used replaced (see [`crate::backend::HostLink::keep_keyed`]).
#[derive(Default)]
pub(super) struct Kept {
    cap: u64,
    used: u64,
    tick: u64,
    /// Each copy, its device address and its last use.
    copies: std::collections::HashMap<KeptKey, (CudaSlice<u8>, u64, u64)>,
    /// Last use -> key, oldest first.
    order: std::collections::BTreeMap<u64, KeptKey>,
}

impl CudaDevice {
    /// Lets the device keep copies of keyed volatile weights in up to `bytes` of its memory
    /// (fewer: the oldest copies go now).
    pub(super) fn keep_keyed_bytes(&self, bytes: u64) {
        let mut k = self.kept.lock().expect("kept copies");
        k.cap = bytes;
        self.evict_kept(&mut k, 0);
    }

    /// Frees the oldest copies until `need` more bytes fit (in stream order: launches queued
    /// before, which may read them, run first; recorded ones are issued first).
    fn evict_kept(&self, k: &mut Kept, need: u64) {
        while k.used + need > k.cap {
            let Some((_, key)) = k.order.pop_first() else { break };
            if let Some((buf, _, _)) = k.copies.remove(&key) {
                k.used -= key.2 as u64;
                self.keep_until_launched(Box::new(buf));
            }
        }
    }

    /// The device address of a kept copy of `key`, marked as just used.
    fn kept_copy(&self, key: KeptKey) -> Option<u64> {
        let mut guard = self.kept.lock().expect("kept copies");
        let k = &mut *guard;
        k.tick += 1;
        let tick = k.tick;
        let (_, ptr, last) = k.copies.get_mut(&key)?;
        let ptr = *ptr;
        k.order.remove(last);
        *last = tick;
        k.order.insert(tick, key);
        Some(ptr)
    }

    /// Keeps a copy of the `key.2` bytes at device address `from` (a use's copy, about to be
    /// read), copied on the compute stream, where room is made for it.
    fn keep_copy(&self, key: KeptKey, from: u64) {
        let mut guard = self.kept.lock().expect("kept copies");
        let k = &mut *guard;
        let len = key.2 as u64;
        if len == 0 || len > k.cap || k.copies.contains_key(&key) {
            return;
        }
        self.evict_kept(k, len);
        let Some(buf) = self.check(
            "keeping a copy of a routed expert",
            self.stream.alloc_zeros::<u8>(key.2),
        ) else {
            return;
        };
        let to = self.raw(&buf);
        // SAFETY: both ranges are device memory of `key.2` bytes: `buf` just allocated, `from`
        // the use's copy, which its holder keeps until after the launches queued on this stream
        // (this copy among them) have read it.
        let copied = unsafe { cudarc::driver::result::memcpy_dtod_async(to, from, key.2, self.stream.cu_stream()) };
        if self.check("keeping a copy of a routed expert", copied).is_none() {
            return;
        }
        k.tick += 1;
        k.order.insert(k.tick, key);
        k.copies.insert(key, (buf, to, k.tick));
        k.used += len;
    }

    /// A device copy of a weight's bytes (copied on first use), by the address of row 0.
    pub(super) fn weight(&self, w: &Weight) -> Option<OnDevice> {
        if !computes_type(w.ty) {
            // Refused at load (`Device::computes_type`); this guards the direct callers.
            self.fail(cpu_only_message(&w.name, w.ty));
            return None;
        }
        let Some((bytes, keep)) = w.span() else {
            self.fail(format!(
                "{}: its bytes are on disk, not read into memory by the stream (a bug: streamed weights reach the \
                 device as the stream's buffers)",
                w.name
            ));
            return None;
        };
        let copy = |what: &str| {
            let t0 = std::time::Instant::now();
            let buf = self.check(
                &format!("copying {what} {} ({} bytes) to the GPU", w.name, bytes.len()),
                self.stream
                    .clone_htod(if bytes.is_empty() { &[0u8][..] } else { bytes }),
            );
            let mut link = self.link.lock().expect("link counters");
            link.copy_ns += t0.elapsed().as_nanos() as u64;
            if w.is_volatile() {
                link.volatile_bytes += bytes.len() as u64;
                link.volatile_copies += 1;
            } else {
                link.resident_bytes += bytes.len() as u64;
            }
            buf
        };
        if w.is_volatile() {
            // Its copy, staging or page-locked range lives only for this use: what is recorded
            // is launched, and the rest of the segment too as it comes.
            self.leave_recording();
        }
        let in_place = match w.home() {
            // Mapped host memory (`in_place`): the kernels read it where it is, across the link.
            Home::Mapped { device, address } if device == self.id as u64 => Some(Ok(address)),
            // Staged by this device: its copy (another GPU's staging is copied below like any
            // streamed buffer).
            Home::Staged(staged) => staged.device_address(self.id as u64, bytes),
            Home::Mapped { .. } | Home::Host | Home::OnDisk => None,
        };
        match in_place {
            Some(Ok(ptr)) => {
                return Some(OnDevice {
                    ptr,
                    _transient: None,
                    _staged: Some(keep),
                })
            }
            Some(Err(msg)) => {
                self.fail(format!("{}: {msg}", w.name));
                return None;
            }
            None => {}
        }
        // A keyed volatile weight (a routed expert) the device kept a copy of: nothing to copy.
        let key = match (w.is_volatile(), w.content_key()) {
            (true, Some((source, at))) => Some((source, at, bytes.len())),
            _ => None,
        };
        if let Some(ptr) = key.and_then(|k| self.kept_copy(k)) {
            self.link.lock().expect("link counters").kept_bytes += bytes.len() as u64;
            return Some(OnDevice {
                ptr,
                _transient: None,
                _staged: None,
            });
        }
        let pinned = match w.is_volatile() && !bytes.is_empty() {
            true => upload::pinned_range(&self.pinned, bytes),
            false => None,
        };
        if let Some(refilled) = pinned {
            // Page-locked (a buffer the stream refills, or a resident weight the device does not
            // keep): copied on the copy stream, the host waiting for the copy only where the
            // stream may refill the buffer.
            return match upload::copy_pinned(&self.uploads, bytes, refilled) {
                Ok((ptr, holder)) => {
                    if let Some(k) = key {
                        self.keep_copy(k, ptr);
                    }
                    Some(OnDevice {
                        ptr,
                        _transient: None,
                        _staged: Some(holder),
                    })
                }
                Err(msg) => {
                    self.fail(format!("{}: {msg}", w.name));
                    None
                }
            };
        }
        if w.is_volatile() {
            // A buffer the stream refills: copied for this use only. The copy from pageable
            // memory has left the host buffer when `clone_htod` returns; dropping the slice after
            // the launch frees it in stream order (or after a synchronize).
            let buf = copy("streamed")?;
            let ptr = self.raw(&buf);
            return Some(OnDevice {
                ptr,
                _transient: Some(buf),
                _staged: None,
            });
        }
        let key = (bytes.as_ptr() as usize, bytes.len(), w.row_stride_bytes);
        let mut cache = self.weights.lock().expect("weights");
        if let Some(d) = cache.get(&key) {
            return Some(OnDevice {
                ptr: d.ptr,
                _transient: None,
                _staged: None,
            });
        }
        let buf = copy("resident")?;
        let ptr = self.raw(&buf);
        cache.insert(
            key,
            DevWeight {
                _buf: buf,
                ptr,
                _keep: keep,
            },
        );
        Some(OnDevice {
            ptr,
            _transient: None,
            _staged: None,
        })
    }

    /// A host vector (norm, bias) on the device, copied again if its contents changed.
    pub(super) fn vector(&self, v: &[f32]) -> u64 {
        let key = (v.as_ptr() as usize, v.len());
        let mut cache = self.vectors.lock().expect("vectors");
        if let Some((host, _, ptr)) = cache.get(&key) {
            // Compared as bytes (one memcmp): a decode step asks for every norm and bias again.
            if f32_bytes(host) == f32_bytes(v) {
                return *ptr;
            }
        }
        let data = if v.is_empty() { &[0f32][..] } else { v };
        match self.check("copying a vector to the GPU", self.stream.clone_htod(data)) {
            Some(s) => {
                let ptr = self.raw(&s);
                if let Some(old) = cache.insert(key, (v.to_vec(), s, ptr)) {
                    // A recorded launch may still read the old copy.
                    self.keep_until_launched(Box::new(old.1));
                }
                ptr
            }
            None => 0,
        }
    }

    /// Holds device memory until the recorded launches (which may read it) are issued; freed
    /// now (in stream order) when nothing is recorded.
    pub(super) fn keep_until_launched(&self, x: Box<dyn Any + Send + Sync>) {
        let mut g = self.graphs.lock().expect("graphs");
        if g.enabled {
            g.keep(x);
        }
    }

    /// An index list on the device; the last few hundred distinct lists stay (a pass's
    /// positions and row lists repeat every layer).
    pub(super) fn indices(&self, v: &[u32]) -> u64 {
        if let Some(p) = self.arena_indices(v) {
            return p;
        }
        let mut guard = self.indices.lock().expect("indices");
        let (cache, retired) = &mut *guard;
        if let Some((_, ptr)) = cache.get(v) {
            return *ptr;
        }
        if let Some(e) = retired.remove(v) {
            let ptr = e.1;
            cache.insert(v.to_vec(), e);
            return ptr;
        }
        if cache.len() >= 256 {
            // The lists the flush before this one retired go, freed in stream order: launches
            // already queued that read them run first (and recorded ones are issued before
            // they go). This flush's stay a round more: a list handed out just before it, to
            // a launch that asks for two (RoPE with the KV write: the tokens' KV words, then
            // the positions), must outlive the queueing of that launch.
            let old = std::mem::replace(retired, std::mem::take(cache));
            self.keep_until_launched(Box::new(old));
        }
        let data = if v.is_empty() { &[0u32][..] } else { v };
        match self.check("copying indices to the GPU", self.stream.clone_htod(data)) {
            Some(s) => {
                let ptr = self.raw(&s);
                cache.insert(v.to_vec(), (s, ptr));
                ptr
            }
            None => 0,
        }
    }
}
