//! The host link of the CUDA device ([`HostLink`]): page-locking and mapping the stream's host
//! memory, staged uploads, the link's counters and its measured bandwidth.

use super::*;
use crate::backend::{HostLink, HostUpload, LinkBandwidth, LinkCounters, MappedHost, PinnedHost, Upload};

impl CudaDevice {
    /// Host-to-device bandwidth per copy size (see [`HostLink::measure_link`]): about 256 MB
    /// copied per size and memory kind (3 to 1000 copies), one copy first untimed, timed on the
    /// host from the first copy's start to the stream's end.
    pub(super) fn link_bandwidth(&self, sizes: &[usize]) -> Result<Vec<LinkBandwidth>> {
        let max = sizes.iter().copied().max().unwrap_or(0).max(1);
        let mut dev = self
            .stream
            .alloc_zeros::<u8>(max)
            .map_err(driver_err("allocating the link test's device buffer"))?;
        let pageable = vec![1u8; max];
        // SAFETY: the memory is written (filled) below before any copy reads it.
        let mut pinned = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(max, 0) }
            .map_err(driver_err("allocating page-locked host memory"))?;
        pinned
            .as_mut_slice()
            .map_err(driver_err("page-locked host memory"))?
            .fill(1);
        let mut rows = Vec::with_capacity(sizes.len());
        for &size in sizes {
            let size = size.max(1);
            let copies = ((256usize << 20) / size).clamp(3, 1000);
            let mut time = |src: &[u8]| -> Result<f64> {
                let mut run = |n: usize| -> Result<f64> {
                    let t0 = std::time::Instant::now();
                    for _ in 0..n {
                        let mut dst = dev.slice_mut(..size);
                        self.stream
                            .memcpy_htod(&src[..size], &mut dst)
                            .map_err(driver_err("copying to the GPU"))?;
                    }
                    self.stream.synchronize().map_err(driver_err("waiting for copies"))?;
                    Ok(t0.elapsed().as_secs_f64())
                };
                run(1)?;
                let s = run(copies)?;
                Ok((copies * size) as f64 / s.max(1e-9) / 1e9)
            };
            let pageable_gb_per_s = time(&pageable)?;
            let pinned_src = pinned.as_slice().map_err(driver_err("page-locked host memory"))?;
            let pinned_gb_per_s = time(pinned_src)?;
            rows.push(LinkBandwidth {
                bytes: size,
                pageable_gb_per_s,
                pinned_gb_per_s,
                copies,
            });
        }
        Ok(rows)
    }
}

impl HostLink for CudaDevice {
    fn host_memory(&self) -> bool {
        false
    }
    fn memory_free(&self) -> Option<u64> {
        self.ctx.mem_get_info().ok().map(|(free, _)| free as u64)
    }

    fn keep_resident(&self, ws: &[&Weight]) {
        for w in ws.iter().filter(|w| !w.is_volatile() && w.span().is_some()) {
            let _ = self.weight(w);
        }
        // (the copies are done when this returns: their time is the load's)
        let r = self.stream.synchronize();
        self.check("copying weights to the GPU", r);
    }

    fn link(&self) -> Option<LinkCounters> {
        self.end_segment();
        self.uploads.reap_free();
        Some(*self.link.lock().expect("link counters"))
    }

    fn keep_keyed(&self, bytes: u64) {
        self.keep_keyed_bytes(bytes);
    }

    fn pin_host(&self, bytes: &[u8], refilled: bool) -> Option<PinnedHost> {
        self.leave_recording();
        upload::pin_host(&self.ctx, &self.pinned, bytes, refilled, false)
    }

    fn map_host(&self, bytes: &[u8], refilled: bool) -> Option<PinnedHost> {
        if !CudaDevice::map_host(self) {
            return None;
        }
        self.leave_recording();
        upload::pin_host(&self.ctx, &self.pinned, bytes, refilled, true)
    }

    fn in_place(&self, w: &Weight) -> Option<Weight> {
        let (bytes, _) = w.span()?;
        let device_address = upload::mapped_address(&self.pinned, bytes)?;
        MappedHost::weight_over(w, self.id as u64, device_address)
    }

    fn begin_upload(&self, bytes: usize) -> Box<dyn Upload> {
        // Its slot's reuse is ordered by events on the compute stream after earlier readers.
        self.leave_recording();
        match upload::begin(&self.uploads, bytes) {
            Some(u) => Box::new(u),
            // The error is set; stage in ordinary memory so the step can end and return it.
            None => Box::new(HostUpload::new(bytes)),
        }
    }

    fn measure_link(&self, sizes: &[usize]) -> Option<Result<Vec<LinkBandwidth>>> {
        self.end_segment();
        Some(self.link_bandwidth(sizes))
    }
}
