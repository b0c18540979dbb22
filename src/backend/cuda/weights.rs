//! Weights, vectors and index lists on the device: copied on first use and kept by the address
//! of their host bytes (streamed weights copied at each use, or read in place over mapped host
//! memory).

use super::*;
use crate::tensor::Home;

impl CudaDevice {
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
        let pinned = match w.is_volatile() && !bytes.is_empty() {
            true => upload::pinned_range(&self.pinned, bytes),
            false => None,
        };
        if let Some(refilled) = pinned {
            // Page-locked (a buffer the stream refills, or a resident weight the device does not
            // keep): copied on the copy stream, the host waiting for the copy only where the
            // stream may refill the buffer.
            return match upload::copy_pinned(&self.uploads, bytes, refilled) {
                Ok((ptr, holder)) => Some(OnDevice {
                    ptr,
                    _transient: None,
                    _staged: Some(holder),
                }),
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
