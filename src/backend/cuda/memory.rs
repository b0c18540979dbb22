//! Device memory: the activation buffer pool, the device's hash maps, and the handles that keep
//! a weight's or a buffer's device memory alive while work that reads it is queued.

use super::*;

/// Freed activation buffers by length, reused by the next allocation of that length (a decode
/// step allocates the same few dozen shapes every layer).
#[derive(Default)]
pub(super) struct Pool {
    pub(super) free: Mutex<FreeLists>,
    /// While graphs are on, buffers the free lists cannot take wait here for the recorded
    /// launches that may read them (see `graph`), instead of being freed at once.
    pub(super) held: Mutex<Option<Vec<CudaSlice<f32>>>>,
}

impl Pool {
    pub(super) fn hold(&self, on: bool) {
        let mut h = self.held.lock().expect("pool");
        match (on, h.is_some()) {
            (true, false) => *h = Some(Vec::new()),
            (false, true) => *h = None,
            _ => {}
        }
    }

    /// Frees the held buffers (in stream order, after the launches that read them).
    pub(super) fn release_held(&self) {
        if let Some(h) = self.held.lock().expect("pool").as_mut() {
            h.clear();
        }
    }
}

/// A fast hash for the device's own maps, whose keys come from this process (addresses,
/// lengths, index lists, the words of a graph's signature; nothing adversarial): a rotate, xor
/// and multiply per 8 bytes (as rustc's FxHash), against SipHash's rounds — a decode step looks
/// up weights, vectors and kernels hundreds of times and hashes its whole signature once.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

impl FastHasher {
    pub(super) fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl std::hash::Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }
    fn write_u8(&mut self, v: u8) {
        self.add(u64::from(v));
    }
    fn write_u32(&mut self, v: u32) {
        self.add(u64::from(v));
    }
    fn write_u64(&mut self, v: u64) {
        self.add(v);
    }
    fn write_usize(&mut self, v: usize) {
        self.add(v as u64);
    }
}

/// A map hashed with [`FastHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<FastHasher>>;

/// Free buffers by length, and their bytes in all.
pub(super) type FreeLists = (FastMap<usize, Vec<CudaSlice<f32>>>, usize);
/// Host vectors (norms, biases) on the device, by host address and length: the contents copied
/// (to notice a change), the device slice and its address.
pub(super) type VectorCache = FastMap<(usize, usize), (Vec<f32>, CudaSlice<f32>, u64)>;
/// Index lists uploaded once: the device slice and its address.
pub(super) type IndexCache = FastMap<Vec<u32>, (CudaSlice<u32>, u64)>;

/// An activation's device buffer; dropping it returns the memory to the pool. Work already
/// queued on the device's one stream that reads it runs before any later reuse.
pub(crate) struct DevBuf {
    pub(super) slice: Option<CudaSlice<f32>>,
    pub(super) ptr: u64,
    pub(super) pool: Arc<Pool>,
    /// The integer products' Q8_K blocks of this buffer's values, written by the kernel that
    /// wrote them (see [`FUSE_ENV`]), for the activation's shape `(rows, width)` then; dropped
    /// by anything that writes the buffer again ([`CudaDevice::buf_mut`]).
    pub(super) blocks: Option<((usize, usize), Box<DevBuf>)>,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            let mut free = self.pool.free.lock().expect("pool");
            let bytes = s.len() * 4;
            if free.1 + bytes <= POOL_BYTES_MAX {
                free.1 += bytes;
                free.0.entry(s.len()).or_default().push(s);
            } else if let Some(held) = self.pool.held.lock().expect("pool").as_mut() {
                held.push(s);
            }
        }
    }
}

/// A weight's bytes on the device; `_keep` holds the host bytes so their address (the key)
/// stays theirs while cached.
pub(super) struct DevWeight {
    pub(super) _buf: CudaSlice<u8>,
    pub(super) ptr: u64,
    pub(super) _keep: Arc<dyn Any + Send + Sync>,
}

/// A weight's device address for one launch; a streamed (volatile) weight's copy lives as long as
/// this does, so keep it until the kernel that reads it is launched.
pub(super) struct OnDevice {
    pub(super) ptr: u64,
    pub(super) _transient: Option<CudaSlice<u8>>,
    /// A staged buffer (its device twin is `ptr`'s), returned to the pool after the launch.
    pub(super) _staged: Option<Arc<dyn Any + Send + Sync>>,
}
