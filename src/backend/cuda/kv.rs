//! The KV cache on the device: each sequence's keys and values, allocated on first use, and
//! each token's cache words for a launch.

use super::*;

/// A sequence's keys and values on the device: `[layer][capacity][kv_dim]` each. A latent
/// attention cache (the host cache's values empty: [`KvCache`]) has keys alone, and its value
/// address is its key address: the kernels read its values from the keys and write none
/// (kernels/attention.cu).
pub(super) struct DevKv {
    /// The keys, and the values unless the cache is latent.
    pub(super) slices: Option<(CudaSlice<f32>, Option<CudaSlice<f32>>)>,
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) shape: (usize, usize, usize),
    pub(super) device: usize,
    pub(super) pool: Arc<Pool>,
}

impl Drop for DevKv {
    /// A cache dropped while launches are recorded (graphs on) may still be read by them: its
    /// memory waits with the pool's held buffers until they are launched (see `graph`).
    fn drop(&mut self) {
        if let Some((k, v)) = self.slices.take() {
            if let Some(held) = self.pool.held.lock().expect("pool").as_mut() {
                held.push(k);
                held.extend(v);
            }
        }
    }
}

impl CudaDevice {
    /// Each token's `TokenKv` (key base, value base, position, capacity) as u32 words.
    pub(super) fn token_kv(&self, positions: &[usize], seq_of_token: &[usize], caches: &[&mut KvCache]) -> u64 {
        let mut words = Vec::with_capacity(positions.len() * 8);
        for (&pos, &s) in positions.iter().zip(seq_of_token) {
            let (k, v, cap) = match caches[s].device.as_ref().and_then(|d| d.downcast_ref::<DevKv>()) {
                Some(d) => (d.k, d.v, d.shape.1 as u64),
                None => (0, 0, 0),
            };
            for x in [k, v, pos as u64, cap] {
                words.push(x as u32);
                words.push((x >> 32) as u32);
            }
        }
        self.indices(&words)
    }

    /// Gives `cache` device buffers for its shape if it has none of this device's.
    pub(super) fn ensure_kv(&self, cache: &mut KvCache) {
        let shape = (cache.k.len(), cache.capacity, cache.kv_dim);
        let ok = cache
            .device
            .as_ref()
            .and_then(|d| d.downcast_ref::<DevKv>())
            .is_some_and(|d| d.shape == shape && d.device == self.id);
        if ok {
            return;
        }
        let len = (shape.0 * shape.1 * shape.2).max(1);
        // (Latent attention's host cache has no values: nor has the device's.)
        let latent = cache.v.first().is_some_and(|v| v.is_empty());
        let k = self.check("allocating the KV cache", self.stream.alloc_zeros::<f32>(len));
        let v = if latent {
            Some(None)
        } else {
            self.check("allocating the KV cache", self.stream.alloc_zeros::<f32>(len))
                .map(Some)
        };
        if let (Some(k), Some(v)) = (k, v) {
            let kp = self.raw(&k);
            let vp = v.as_ref().map_or(kp, |v| self.raw(v));
            cache.device = Some(Box::new(DevKv {
                slices: Some((k, v)),
                k: kp,
                v: vp,
                shape,
                device: self.id,
                pool: self.pool.clone(),
            }));
        }
    }
}
