//! Keys and values of one sequence: what attention reads back for every earlier position. A
//! forward pass gets one [`KvCache`] per sequence of its batch; positions are explicit (a
//! token's K/V go to its own position's slot), so sequences of different lengths decode in one
//! batch, and `truncate` rolls a sequence back (speculation, a retried request).
//! The bytes are allocated up front for `capacity` positions; [`KvCache::bytes_for`] is what a
//! budget must count for them.

use crate::config::ModelConfig;

/// Keys and values of every layer for positions `0..len`, f32, `[pos][kv_dim]` per layer. With
/// latent attention ([`ModelConfig::mla`]) a position's key is the latent and its rotated part,
/// and its value the latent, the key's first `kv_lora_rank` numbers: `v` is empty and attention
/// reads values from `k`.
pub struct KvCache {
    pub(crate) k: Vec<Vec<f32>>,
    pub(crate) v: Vec<Vec<f32>>,
    pub(crate) kv_dim: usize,
    pub capacity: usize,
    pub len: usize,
    /// The keys and values on a device with memory of its own (the CUDA device puts its buffers
    /// here on first use; the host vectors above then stay untouched, and the OS never backs them).
    #[cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]
    pub(crate) device: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl KvCache {
    pub fn new(cfg: &ModelConfig, capacity: usize) -> KvCache {
        let kv_dim = cfg.kv_dim();
        let per_layer = capacity * kv_dim;
        let v_len = if cfg.mla.is_some() { 0 } else { per_layer };
        KvCache {
            k: (0..cfg.n_layers).map(|_| vec![0.0; per_layer]).collect(),
            v: (0..cfg.n_layers).map(|_| vec![0.0; v_len]).collect(),
            kv_dim,
            capacity,
            len: 0,
            device: None,
        }
    }

    /// Bytes a cache of `capacity` positions holds for this model.
    pub fn bytes_for(cfg: &ModelConfig, capacity: usize) -> u64 {
        let tensors = if cfg.mla.is_some() { 1 } else { 2 };
        (tensors * cfg.n_layers as u64)
            .saturating_mul(capacity as u64)
            .saturating_mul(cfg.kv_dim() as u64 * 4)
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Forget every position from `len` on (the next batch is written there).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn bytes(&self) -> usize {
        let tensors = self.k.len() + self.v.iter().filter(|v| !v.is_empty()).count();
        4 * tensors * self.capacity * self.kv_dim
    }

    /// Layer `l`'s values: its own, or (latent attention) the keys, whose first numbers they are.
    pub(crate) fn values(&self, l: usize) -> &[f32] {
        if self.v[l].is_empty() {
            &self.k[l]
        } else {
            &self.v[l]
        }
    }
}

/// The machine's physical memory in bytes, where the platform says (a KV cache larger than this
/// cannot be allocated, and asking aborts the process instead of returning an error).
pub fn physical_memory_bytes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf has no preconditions; it returns -1 for an unknown name.
        let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        if pages > 0 && page > 0 {
            return Some(pages as u64 * page as u64);
        }
    }
    None
}
