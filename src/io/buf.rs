//! Page-aligned heap buffers for O_DIRECT and io_uring, and a small pool to reuse them.
//!
//! Owns the only raw allocation in the I/O layer. It must not know what the bytes mean, and it never
//! hands out memory that is uninitialized: every buffer is zero-filled (and so pre-faulted) when it
//! is allocated, which keeps first-touch page faults out of read timings.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Mutex;

/// Alignment of every [`AlignedBuf`], and the granularity O_DIRECT reads are widened to. 4096 covers
/// both 512-byte and 4 KiB logical block sizes and equals the page size on x86-64 and most aarch64.
pub const ALIGN_BYTES: usize = 4096;

/// Asks the kernel to back `bytes` with transparent huge pages (2 MiB on x86-64) where it can:
/// call before the memory is first touched. A direct read into physically contiguous memory is
/// one device request for up to the device's largest (a virtio disk here takes 4 MiB requests
/// but splits one over 4 KiB pages into ~0.5 MiB pieces: 254 segments of a page each), which
/// is what a streaming pipeline's large reads need. Without the feature (or off Linux) nothing
/// changes: the memory is ordinary pages.
pub fn advise_huge_pages(bytes: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (bytes.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (bytes.as_ptr() as usize + bytes.len()) / HUGE * HUGE;
        if end > start {
            // SAFETY: [start, end) lies inside `bytes`, memory this process owns and maps; the
            // advice changes how its pages are backed, not their contents or mapping.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = bytes;
}

/// A heap buffer whose start address and capacity are multiples of [`ALIGN_BYTES`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len_bytes: usize,
}

// SAFETY: `AlignedBuf` uniquely owns its allocation (like `Vec<u8>`); nothing else holds the
// pointer except an in-flight kernel read, which the readers wait for before the buffer is touched
// or dropped. Moving it between threads or sharing `&AlignedBuf` is therefore as sound as for Vec.
unsafe impl Send for AlignedBuf {}
// SAFETY: see `Send`; `&AlignedBuf` only allows reads through `as_slice`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zero-filled buffer of at least `min_len_bytes`, rounded up to a multiple of [`ALIGN_BYTES`]
    /// (a zero request still gets one block, so the pointer is always a real allocation).
    pub fn new(min_len_bytes: usize) -> Self {
        let len_bytes = round_up(min_len_bytes.max(1), ALIGN_BYTES);
        let layout = Layout::from_size_align(len_bytes, ALIGN_BYTES)
            .expect("AlignedBuf: size overflows isize (request of more than isize::MAX bytes)");
        // SAFETY: `layout` has a non-zero size (len_bytes >= ALIGN_BYTES) and a power-of-two
        // alignment, as `alloc_zeroed` requires. A null return is handled below.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        // Touch every page now: `alloc_zeroed` of a large block maps untouched zero pages, and the
        // first write fault would otherwise land inside the first timed read (docs/DESIGN.md: first touch
        // runs at 0.3–0.4 GB/s).
        for page in (0..len_bytes).step_by(ALIGN_BYTES) {
            // SAFETY: `page < len_bytes`, so the write is inside the allocation we own exclusively.
            unsafe { ptr.as_ptr().add(page).write_volatile(0) };
        }
        AlignedBuf { ptr, len_bytes }
    }

    /// Capacity in bytes (a multiple of [`ALIGN_BYTES`]).
    pub fn len(&self) -> usize {
        self.len_bytes
    }

    /// Never true: a buffer always has at least one block. Present for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len_bytes == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len_bytes` initialized (zero-filled at allocation) bytes owned by
        // `self`; the shared borrow of `self` prevents concurrent mutation through safe code, and
        // the readers never create this slice while a kernel read into the buffer is in flight.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len_bytes) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, and `&mut self` makes this the only live reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len_bytes) }
    }

    /// Raw pointer for handing to the kernel. Taking it creates no Rust reference to the bytes, so
    /// the kernel may write through it while other buffers are borrowed; the caller must keep `self`
    /// alive and untouched until the write completes.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this size and alignment, and freed only here.
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len_bytes, ALIGN_BYTES),
            )
        };
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

/// Reuses [`AlignedBuf`]s so steady-state reads allocate (and page-fault) nothing. Keeps at most
/// `retained_max` buffers; extra ones returned by `put` are freed.
#[derive(Debug)]
pub struct BufferPool {
    free: Mutex<Vec<AlignedBuf>>,
    retained_max: usize,
}

impl BufferPool {
    pub fn new(retained_max: usize) -> Self {
        BufferPool {
            free: Mutex::new(Vec::new()),
            retained_max,
        }
    }

    /// A buffer of at least `min_len_bytes`: the smallest pooled one that fits, else a new one.
    pub fn get(&self, min_len_bytes: usize) -> AlignedBuf {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= min_len_bytes)
            .min_by_key(|(_, b)| b.len())
            .map(|(i, _)| i);
        match best {
            Some(i) => free.swap_remove(i),
            None => {
                drop(free);
                AlignedBuf::new(min_len_bytes)
            }
        }
    }

    pub fn put(&self, buf: AlignedBuf) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < self.retained_max {
            free.push(buf);
        }
    }

    /// Number of buffers currently held for reuse.
    pub fn retained(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

pub(crate) fn round_up(x: usize, align: usize) -> usize {
    x.div_ceil(align) * align
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buf_is_aligned_zeroed_and_rounded() {
        for want in [0usize, 1, 4095, 4096, 4097, 1 << 20] {
            let mut b = AlignedBuf::new(want);
            assert_eq!(b.as_slice().as_ptr() as usize % ALIGN_BYTES, 0);
            assert_eq!(b.len() % ALIGN_BYTES, 0);
            assert!(b.len() >= want.max(1));
            assert!(b.as_slice().iter().all(|&x| x == 0));
            let last = b.len() - 1;
            b.as_mut_slice()[last] = 7;
            assert_eq!(b.as_slice()[b.len() - 1], 7);
        }
    }

    #[test]
    fn pool_reuses_smallest_fitting_and_caps_retention() {
        let pool = BufferPool::new(2);
        pool.put(AlignedBuf::new(3 * 4096));
        pool.put(AlignedBuf::new(4096));
        pool.put(AlignedBuf::new(8 * 4096)); // over the cap: freed
        assert_eq!(pool.retained(), 2);
        let b = pool.get(100);
        assert_eq!(b.len(), 4096);
        let b2 = pool.get(2 * 4096);
        assert_eq!(b2.len(), 3 * 4096);
        assert_eq!(pool.retained(), 0);
        let b3 = pool.get(5 * 4096);
        assert_eq!(b3.len(), 5 * 4096);
    }
}
