//! The io_uring engine (Linux): many reads in flight on one ring, O_DIRECT with reads widened to
//! whole blocks, optional registered (fixed) buffers, short reads resumed in the ring.
//!
//! Owns the ring, its read slots and the in-flight bookkeeping; the unsafe code that lends buffers
//! to the kernel lives here and nowhere else. It must not outlive a read: no buffer is touched,
//! reused or freed while the kernel may still write into it (see `Ring::drain` and `Drop`).
//!
//! Design: a fixed set of `queue_depth` slot buffers. `read_each` holds the ring for the whole
//! batch: it fills every free slot with a read, waits for at least one completion, reports finished
//! ranges to the callback straight from the slot (zero copy), resubmits short reads, and refills.
//! Calls from several threads serialize on the ring's mutex.

use super::buf::AlignedBuf;
use super::file::{eof_at, has_o_direct, open_file, resume_at, DirectIo, Span};
use super::stats::{ReadStats, StatsCell};
use super::{check_range, read_error, OnDone, Range, Reader};
use crate::error::{Error, Result};
use io_uring::{opcode, types, IoUring, Probe};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

/// Whether the slot buffers are registered with the kernel (`IORING_REGISTER_BUFFERS`), which
/// saves pinning and unpinning pages on every read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FixedBuffers {
    On,
    Off,
}

/// How to decide whether io_uring is usable. `PretendUnavailable` exists so the fallback path can
/// be tested on a machine that has io_uring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UringProbe {
    Detect,
    PretendUnavailable,
}

#[derive(Clone, Debug)]
pub struct UringOptions {
    /// Reads in flight at once; also the number of slot buffers. 1..=4096.
    pub queue_depth: usize,
    pub fixed_buffers: FixedBuffers,
    /// Size of each slot buffer; a range whose widened read is larger gets a one-off buffer.
    pub slot_bytes: usize,
    pub direct_io: DirectIo,
    pub probe: UringProbe,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions {
            queue_depth: 64,
            fixed_buffers: FixedBuffers::On,
            slot_bytes: 256 * 1024,
            direct_io: DirectIo::Optional,
            probe: UringProbe::Detect,
        }
    }
}

const QUEUE_DEPTH_MAX: usize = 4096;
/// One SQE reads at most this much (its length field is 32-bit); longer reads continue like short
/// reads.
const SQE_BYTES_MAX: usize = 1 << 30;
/// Negative CQE results that mean "try again", not failure.
const RETRY_ERRNOS: [i32; 2] = [libc::EINTR, libc::EAGAIN];

pub struct UringReader {
    ring: Mutex<Ring>,
    file: File,
    path: PathBuf,
    len_bytes: u64,
    direct_io_active: bool,
    align: usize,
    /// Longest single SQE; `SQE_BYTES_MAX` except in tests, which shrink it to force resumption.
    sqe_bytes_max: usize,
    warnings: Vec<String>,
    stats: StatsCell,
}

/// One read in flight (or between resubmissions) in a slot.
struct Inflight {
    index: usize,
    range: Range,
    span: Span,
    /// Bytes of the span known to be in the buffer.
    done: usize,
    /// Where the current SQE started reading, relative to the span.
    pos: usize,
    /// A one-off buffer for a read larger than a slot (read without the fixed-buffer opcode).
    big: Option<AlignedBuf>,
}

struct Ring {
    ring: IoUring,
    slots: Vec<AlignedBuf>,
    fixed: bool,
    inflight: Vec<Option<Inflight>>,
    free: Vec<usize>,
    /// SQEs pushed whose CQE has not been reaped. While > 0 the kernel may write into slot memory.
    pending: usize,
    cqes: Vec<(u64, i32)>,
}

impl UringReader {
    /// Whether io_uring works here and supports the read opcodes this engine uses.
    pub fn probe() -> std::result::Result<(), String> {
        Self::probe_with(UringProbe::Detect)
    }

    pub fn probe_with(how: UringProbe) -> std::result::Result<(), String> {
        if how == UringProbe::PretendUnavailable {
            return Err("pretending io_uring is unavailable (UringProbe::PretendUnavailable)".into());
        }
        let ring = IoUring::new(4).map_err(|e| format!("io_uring_setup failed: {e}"))?;
        let mut probe = Probe::new();
        ring.submitter()
            .register_probe(&mut probe)
            .map_err(|e| format!("IORING_REGISTER_PROBE failed: {e}"))?;
        for (code, name) in [
            (opcode::Read::CODE, "IORING_OP_READ"),
            (opcode::ReadFixed::CODE, "IORING_OP_READ_FIXED"),
        ] {
            if !probe.is_supported(code) {
                return Err(format!("the kernel lacks {name}"));
            }
        }
        Ok(())
    }

    pub fn open(path: impl AsRef<Path>, opts: &UringOptions) -> Result<Self> {
        let path = path.as_ref();
        if opts.queue_depth == 0 || opts.queue_depth > QUEUE_DEPTH_MAX {
            return Err(Error::Invalid(format!(
                "io_uring queue depth {} is out of range 1..={QUEUE_DEPTH_MAX}",
                opts.queue_depth
            )));
        }
        Self::probe_with(opts.probe).map_err(|why| Error::io(path, io::Error::other(why)))?;
        let opened = open_file(path, opts.direct_io)?;
        let mut warnings = opened.warnings;
        let ring = IoUring::new(opts.queue_depth as u32).map_err(|e| Error::io(path, e))?;
        let mut slots: Vec<AlignedBuf> = (0..opts.queue_depth)
            .map(|_| AlignedBuf::new(opts.slot_bytes))
            .collect();
        let mut fixed = false;
        if opts.fixed_buffers == FixedBuffers::On {
            let iovecs: Vec<libc::iovec> = slots
                .iter_mut()
                .map(|b| libc::iovec {
                    iov_base: b.as_mut_ptr().cast(),
                    iov_len: b.len(),
                })
                .collect();
            // SAFETY: each iovec describes a live slot allocation owned by the `Ring` built below,
            // which also owns the `IoUring`; the slots are never freed or reallocated while the
            // ring exists (`Ring` drops its ring first — field order — after draining every read),
            // so the registration never outlives the memory it names.
            match unsafe { ring.submitter().register_buffers(&iovecs) } {
                Ok(()) => fixed = true,
                Err(e) => warnings.push(format!(
                    "{}: registering {} io_uring buffers failed ({e}); reading without fixed \
                     buffers (raise RLIMIT_MEMLOCK to enable them)",
                    path.display(),
                    slots.len()
                )),
            }
        }
        let queue_depth = opts.queue_depth;
        Ok(UringReader {
            ring: Mutex::new(Ring {
                ring,
                slots,
                fixed,
                inflight: (0..queue_depth).map(|_| None).collect(),
                free: (0..queue_depth).rev().collect(),
                pending: 0,
                cqes: Vec::with_capacity(queue_depth),
            }),
            align: opened.align_bytes,
            sqe_bytes_max: SQE_BYTES_MAX,
            direct_io_active: opened.direct_io_active,
            file: opened.file,
            path: path.to_path_buf(),
            len_bytes: opened.len_bytes,
            warnings,
            stats: StatsCell::default(),
        })
    }

    /// Whether the file descriptor really has O_DIRECT set (asked of the kernel, not remembered).
    pub fn direct_io_active(&self) -> bool {
        self.direct_io_active && has_o_direct(&self.file)
    }

    /// Whether the slot buffers are registered with the kernel.
    pub fn fixed_buffers_active(&self) -> bool {
        self.ring.lock().unwrap_or_else(|e| e.into_inner()).fixed
    }

    /// Fallbacks taken when opening (O_DIRECT refused, buffer registration failed).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Splits reads into SQEs of at most `bytes` (a multiple of the alignment), so tests can
    /// exercise the resumption path that real devices take only on short reads.
    #[cfg(test)]
    pub(crate) fn with_sqe_bytes_max(mut self, bytes: usize) -> Self {
        assert!(bytes > 0 && bytes.is_multiple_of(self.align));
        self.sqe_bytes_max = bytes;
        self
    }
}

impl Ring {
    /// Pushes the SQE for the unread rest of slot `slot`'s span.
    fn push(&mut self, slot: usize, fd: i32, align: usize, sqe_bytes_max: usize) -> io::Result<()> {
        let fixed = self.fixed;
        let slot_ptr = self.slots[slot].as_mut_ptr();
        let e = self.inflight[slot].as_mut().expect("push on an empty slot");
        e.pos = resume_at(e.done, align);
        let len = (e.span.dev_len_bytes - e.pos).min(sqe_bytes_max);
        let offset = e.span.dev_offset_bytes + e.pos as u64;
        let sqe = match e.big.as_mut() {
            Some(big) => {
                // SAFETY (pointer arithmetic): pos + len <= dev_len_bytes <= the buffer's length,
                // so the pointer stays inside the allocation.
                let ptr = unsafe { big.as_mut_ptr().add(e.pos) };
                opcode::Read::new(types::Fd(fd), ptr, len as u32).offset(offset).build()
            }
            None if fixed => opcode::ReadFixed::new(
                types::Fd(fd),
                // SAFETY: as above; the slot's length is >= dev_len_bytes (checked when assigned).
                unsafe { slot_ptr.add(e.pos) },
                len as u32,
                slot as u16,
            )
            .offset(offset)
            .build(),
            // SAFETY: as above.
            None => opcode::Read::new(types::Fd(fd), unsafe { slot_ptr.add(e.pos) }, len as u32)
                .offset(offset)
                .build(),
        }
        .user_data(slot as u64);
        loop {
            // SAFETY: the SQE points into slot `slot` (or its `big` buffer, owned by the same
            // `inflight` entry). Both stay allocated and untouched by Rust until this SQE's CQE is
            // reaped: `read_each` takes the entry out only when it handles this SQE's CQE,
            // `pending` counts the SQE, and every path that could free or reuse the memory (`drain`
            // at the start of the next call, `Drop`) first waits until `pending` is zero. `fd` belongs to the reader's `File`, alive as long as the ring.
            // For ReadFixed the range lies inside registered buffer `slot`.
            let pushed = unsafe { self.ring.submission().push(&sqe) };
            if pushed.is_ok() {
                break;
            }
            // Queue full (cannot happen while entries >= queue depth, but never spin on it).
            self.ring.submit()?;
        }
        self.pending += 1;
        Ok(())
    }

    /// Submits and waits for at least one completion, then moves all available CQEs to `cqes`.
    fn wait(&mut self) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => break, // CQ full: reap first
                Err(e) => return Err(e),
            }
        }
        self.cqes.clear();
        for cqe in self.ring.completion() {
            self.cqes.push((cqe.user_data(), cqe.result()));
        }
        self.pending -= self.cqes.len();
        Ok(())
    }

    /// Waits out reads left in flight by a call that unwound (a panicking callback), discarding
    /// their results, so their slots can be reused. After an error from here the ring is unusable.
    fn drain(&mut self) -> io::Result<()> {
        while self.pending > 0 {
            self.wait()?;
        }
        // Nothing is in flight now: every slot is free, including one whose entry an unwinding
        // call had already taken out.
        self.inflight.iter_mut().for_each(|e| *e = None);
        self.free = (0..self.slots.len()).rev().collect();
        Ok(())
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        if self.drain().is_err() {
            // The kernel may still write into the slots: leaking them is the only sound option.
            std::mem::forget(std::mem::take(&mut self.slots));
            std::mem::forget(std::mem::take(&mut self.inflight));
        }
    }
}

impl Reader for UringReader {
    fn read_each(&self, ranges: &[Range], on_done: &mut OnDone<'_>) -> Result<()> {
        let t0 = Instant::now();
        let result = self.read_each_inner(ranges, on_done);
        self.stats.add_wall_since(t0);
        result
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    fn stats(&self) -> ReadStats {
        self.stats.snapshot()
    }

    fn align_bytes(&self) -> usize {
        self.align
    }

    fn reset_stats(&self) {
        self.stats.reset()
    }
}

impl UringReader {
    fn read_each_inner(&self, ranges: &[Range], on_done: &mut OnDone<'_>) -> Result<()> {
        for &r in ranges {
            check_range(&self.path, r, self.len_bytes)?;
        }
        self.stats
            .add_requests(ranges.len() as u64, ranges.iter().map(|r| r.len_bytes as u64).sum());
        for (i, r) in ranges.iter().enumerate() {
            if r.len_bytes == 0 {
                on_done(i, &[])?;
            }
        }
        let ring_err = |e: io::Error| Error::io(&self.path, e);
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.drain().map_err(ring_err)?;
        let fd = self.file.as_raw_fd();
        let mut next = 0usize;
        let mut first_err: Option<Error> = None;
        loop {
            while first_err.is_none() && next < ranges.len() && !ring.free.is_empty() {
                let (index, range) = (next, ranges[next]);
                next += 1;
                if range.len_bytes == 0 {
                    continue;
                }
                let slot = ring.free.pop().expect("checked non-empty");
                let span = Span::widen(range, self.align);
                let big = (span.dev_len_bytes > ring.slots[slot].len()).then(|| AlignedBuf::new(span.dev_len_bytes));
                ring.inflight[slot] = Some(Inflight {
                    index,
                    range,
                    span,
                    done: 0,
                    pos: 0,
                    big,
                });
                if let Err(e) = ring.push(slot, fd, self.align, self.sqe_bytes_max) {
                    ring.inflight[slot] = None;
                    ring.free.push(slot);
                    first_err = Some(ring_err(e));
                }
            }
            if ring.pending == 0 {
                break;
            }
            if let Err(e) = ring.wait() {
                // Reads may still be in flight; the next call (or Drop) drains them first.
                return Err(first_err.unwrap_or(ring_err(e)));
            }
            let cqes = std::mem::take(&mut ring.cqes);
            for &(user_data, res) in &cqes {
                let slot = user_data as usize;
                let mut e = ring.inflight[slot].take().expect("CQE for an empty slot");
                let needed = e.span.needed_bytes(e.range);
                let outcome: Option<io::Error> = if res < 0 {
                    let errno = -res;
                    (!RETRY_ERRNOS.contains(&errno)).then(|| io::Error::from_raw_os_error(errno))
                } else {
                    if res > 0 {
                        self.stats.add_device_read(res as u64);
                    }
                    // No progress: the file ends at `done` (see `file::read_span`).
                    let end = e.pos + res as usize;
                    if end <= e.done {
                        Some(eof_at(e.span.dev_offset_bytes + e.done as u64))
                    } else {
                        e.done = end;
                        None
                    }
                };
                if let Some(err) = outcome {
                    first_err.get_or_insert(read_error(&self.path, e.range, err));
                    ring.free.push(slot);
                } else if e.done < needed {
                    // Short read (or EINTR/EAGAIN): resume the rest in the same slot.
                    ring.inflight[slot] = Some(e);
                    if let Err(err) = ring.push(slot, fd, self.align, self.sqe_bytes_max) {
                        let e = ring.inflight[slot].take().expect("just stored");
                        first_err.get_or_insert(read_error(&self.path, e.range, err));
                        ring.free.push(slot);
                    }
                } else {
                    let (lo, hi) = (e.span.head_bytes, needed);
                    if first_err.is_none() {
                        let bytes = match &e.big {
                            Some(big) => &big.as_slice()[lo..hi],
                            None => &ring.slots[slot].as_slice()[lo..hi],
                        };
                        if let Err(err) = on_done(e.index, bytes) {
                            first_err = Some(err);
                        }
                    }
                    ring.free.push(slot);
                }
            }
            ring.cqes = cqes;
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
