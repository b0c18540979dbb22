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
//!
//! `read_into` reads straight into the caller's memory where O_DIRECT allows it: the whole
//! aligned blocks of a request whose buffer address has the file offset's phase modulo the
//! alignment (a caller that lays its buffer out so gets its bytes without a copy; `stream`'s
//! prefetch buffers are laid out so). Only the partial blocks at either end, and requests whose
//! phase does not match, go through the slots and are copied. The kernel then writes into memory
//! the ring does not own, so every path out of such a batch — an error, a panicking callback —
//! first waits until no read is in flight.

use super::buf::AlignedBuf;
use super::file::{eof_at, has_o_direct, open_file, resume_at, DirectIo, Span};
use super::stats::{ReadStats, StatsCell};
use super::{check_range, read_error, NextReq, OnDone, Range, ReadReq, Reader, Registration, ReqDone, StreamReq};
use crate::error::{Error, Result};
use io_uring::{opcode, types, IoUring, Probe};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
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
/// Entries of the registered-buffer table after the slots, for caller memory
/// ([`Reader::register`]); the table is sparse (Linux 5.19+) so they can be filled later.
const LENT_MAX: usize = 8;
/// One SQE reads at most this much (its length field is 32-bit); longer reads continue like short
/// reads.
const SQE_BYTES_MAX: usize = 1 << 30;
/// Negative CQE results that mean "try again", not failure.
const RETRY_ERRNOS: [i32; 2] = [libc::EINTR, libc::EAGAIN];

pub struct UringReader {
    /// Shared with the [`Registration`]s of caller memory, which clear their entry when dropped.
    ring: Arc<Mutex<Ring>>,
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

/// What [`UringReader::reap`] hands each read that finished: its index, and its bytes (`Some`,
/// lent from the ring's buffers), `None` (read into caller memory) or the error.
type Settled<'a> = dyn FnMut(usize, Result<Option<&[u8]>>) + 'a;

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
    /// The caller's memory the read lands in (a [`Job::Into`]); the slot's buffer is unused.
    dest: Option<DestPtr>,
    /// Whether that memory is registered (read with the fixed-buffer opcode).
    registered: bool,
}

/// The start of caller memory a [`Job::Into`] read lands in.
#[derive(Clone, Copy, Debug)]
struct DestPtr(*mut u8);

// SAFETY: a `DestPtr` is only created by `read_into` from a `&mut [u8]` it holds for the whole
// batch, and is dereferenced (by the kernel, or to compute an SQE's address) only while that
// batch runs on the thread holding the ring's mutex; moving it with the ring between threads
// gives no other thread access to the memory.
unsafe impl Send for DestPtr {}

/// One read of a batch.
#[derive(Clone, Copy, Debug)]
enum Job {
    /// Into the ring's buffers; the range's bytes are lent to the callback.
    Lend(Range),
    /// Whole aligned blocks (offset and length multiples of the reader's alignment) straight into
    /// caller memory at `dest`, `range.len_bytes` long and aligned likewise; no callback.
    Into { range: Range, dest: DestPtr },
}

impl Job {
    fn range(&self) -> Range {
        match *self {
            Job::Lend(r) | Job::Into { range: r, .. } => r,
        }
    }
}

/// The bytes `[lo, hi)` of a request (`len` bytes at file offset `offset` into memory at `addr`)
/// that can be read straight into its memory under alignment `align`: the whole blocks, when the
/// address has the offset's phase modulo `align`; `(0, 0)` when none can.
fn in_place_part(offset: u64, addr: usize, len: usize, align: usize) -> (usize, usize) {
    if align <= 1 {
        return (0, len);
    }
    let a = align as u64;
    if !(addr as u64).wrapping_sub(offset).is_multiple_of(a) {
        return (0, 0);
    }
    let lo = ((a - offset % a) % a).min(len as u64) as usize;
    let hi = lo + (len - lo) / align * align;
    match hi > lo {
        true => (lo, hi),
        false => (0, 0),
    }
}

struct Ring {
    ring: IoUring,
    slots: Vec<AlignedBuf>,
    fixed: bool,
    /// Caller memory registered at table entry `slots.len() + i` (start address, length); empty
    /// when the table is not sparse (no room to add entries).
    lent: Vec<Option<(usize, usize)>>,
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
            return Err(Error::Input(format!(
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
        let mut lent = Vec::new();
        if opts.fixed_buffers == FixedBuffers::On {
            let iovecs: Vec<libc::iovec> = slots
                .iter_mut()
                .map(|b| libc::iovec {
                    iov_base: b.as_mut_ptr().cast(),
                    iov_len: b.len(),
                })
                .collect();
            // A sparse table with room for caller memory after the slots, where the kernel has
            // them; else the slots alone.
            let table = (iovecs.len() + LENT_MAX) as u32;
            // SAFETY: each iovec describes a live slot allocation owned by the `Ring` built below,
            // which also owns the `IoUring`; the slots are never freed or reallocated while the
            // ring exists (`Ring` drops its ring first — field order — after draining every read),
            // so the registration never outlives the memory it names.
            let sparse = ring.submitter().register_buffers_sparse(table).is_ok()
                && unsafe { ring.submitter().register_buffers_update(0, &iovecs, None) }.is_ok();
            if sparse {
                lent = vec![None; LENT_MAX];
            } else {
                // Nothing or an empty table registered: start again with the slots alone.
                let _ = ring.submitter().unregister_buffers();
            }
            let registered = match sparse {
                true => Ok(()),
                // SAFETY: as above.
                false => unsafe { ring.submitter().register_buffers(&iovecs) },
            };
            match registered {
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
            ring: Arc::new(Mutex::new(Ring {
                ring,
                slots,
                fixed,
                lent,
                inflight: (0..queue_depth).map(|_| None).collect(),
                free: (0..queue_depth).rev().collect(),
                pending: 0,
                cqes: Vec::with_capacity(queue_depth),
            })),
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
        let sqe = match (e.dest, e.big.as_mut()) {
            (Some(dest), _) => {
                // SAFETY: (pointer arithmetic) pos + len <= dev_len_bytes = the destination's
                // length (an `Into` range is whole blocks, so it is not widened).
                let ptr = unsafe { dest.0.add(e.pos) };
                // Caller memory inside a registered entry is read as a fixed buffer.
                let (at, end) = (ptr as usize, ptr as usize + len);
                let entry = self
                    .lent
                    .iter()
                    .position(|l| l.is_some_and(|(start, n)| start <= at && end <= start + n));
                match entry {
                    Some(i) => {
                        e.registered = true;
                        let index = (self.slots.len() + i) as u16;
                        opcode::ReadFixed::new(types::Fd(fd), ptr, len as u32, index)
                            .offset(offset)
                            .build()
                    }
                    None => opcode::Read::new(types::Fd(fd), ptr, len as u32).offset(offset).build(),
                }
            }
            (None, Some(big)) => {
                // SAFETY: (pointer arithmetic) pos + len <= dev_len_bytes <= the buffer's length,
                // so the pointer stays inside the allocation.
                let ptr = unsafe { big.as_mut_ptr().add(e.pos) };
                opcode::Read::new(types::Fd(fd), ptr, len as u32).offset(offset).build()
            }
            (None, None) if fixed => opcode::ReadFixed::new(
                types::Fd(fd),
                // SAFETY: as above; the slot's length is >= dev_len_bytes (checked when assigned).
                unsafe { slot_ptr.add(e.pos) },
                len as u32,
                slot as u16,
            )
            .offset(offset)
            .build(),
            // SAFETY: as above.
            (None, None) => opcode::Read::new(types::Fd(fd), unsafe { slot_ptr.add(e.pos) }, len as u32)
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
            // For ReadFixed the range lies inside registered buffer `slot`. Or it points into
            // caller memory (`dest`), which `read_into` borrows mutably for the whole batch and
            // does not touch where reads land; `run` returns (or unwinds) only after `pending`
            // is zero when a batch has such reads (see `run`).
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

    /// Enters `bytes` in the ring's registered-buffer table (one of [`LENT_MAX`] entries after
    /// the slots), so reads into it take the fixed-buffer opcode: its pages are pinned once, not
    /// at every read. `None` without fixed buffers, without a sparse table (kernels before 5.19),
    /// when every entry is taken, or when the kernel refuses (RLIMIT_MEMLOCK).
    unsafe fn register(&self, bytes: &mut [u8]) -> Option<Registration> {
        if bytes.is_empty() {
            return None;
        }
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let i = ring.lent.iter().position(Option::is_none)?;
        let index = (ring.slots.len() + i) as u32;
        let iov = libc::iovec {
            iov_base: bytes.as_mut_ptr().cast(),
            iov_len: bytes.len(),
        };
        // SAFETY: the entry names `bytes`, which the caller keeps allocated and in place until the
        // returned guard drops (this method's contract); the guard clears the entry then. Reads
        // into it happen only inside `read_into`, which the caller's borrow of the memory allows.
        unsafe { ring.ring.submitter().register_buffers_update(index, &[iov], None) }.ok()?;
        ring.lent[i] = Some((bytes.as_ptr() as usize, bytes.len()));
        let shared = Arc::clone(&self.ring);
        Some(Registration::new(move || {
            let mut ring = shared.lock().unwrap_or_else(|e| e.into_inner());
            ring.lent[i] = None;
            let empty = libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            };
            // SAFETY: an empty entry names no memory. No read uses the entry now: reads into
            // caller memory complete inside `read_into`, under the lock held here.
            let _ = unsafe { ring.ring.submitter().register_buffers_update(index, &[empty], None) };
        }))
    }

    fn read_into(&self, reqs: &mut [ReadReq<'_>]) -> Result<()> {
        let t0 = Instant::now();
        let result = self.read_into_inner(reqs);
        self.stats.add_wall_since(t0);
        result
    }

    /// Keeps the ring full across requests (see [`Reader::read_stream`]): while reads are in
    /// flight, free slots take the next requests `next(false)` offers, each split as `read_into`
    /// splits one; when nothing is in flight the ring is let go while `next(true)` waits.
    unsafe fn read_stream(&self, next: &mut NextReq<'_>, done: &mut ReqDone<'_>) -> Result<()> {
        while let Some(first) = next(true) {
            let t0 = Instant::now();
            let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
            ring.drain().map_err(|e| Error::io(&self.path, e))?;
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.stream_on(&mut ring, first, next, done)
            }));
            // Reads into caller memory: nothing may be in flight when this returns or unwinds.
            if let Err(e) = ring.drain() {
                eprintln!(
                    "{}: io_uring reads into caller memory may still be in flight and the ring cannot \
                     be waited on ({e}); aborting rather than returning memory the kernel may write",
                    self.path.display()
                );
                std::process::abort();
            }
            drop(ring);
            self.stats.add_wall_since(t0);
            match outcome {
                Ok(r) => r?,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        Ok(())
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
        let jobs: Vec<Job> = ranges.iter().map(|&r| Job::Lend(r)).collect();
        self.run(&jobs, on_done)
    }

    /// `read_into` (see the module doc): each request's whole aligned blocks read straight into
    /// its buffer when the buffer's address has the file offset's phase, the rest through slots
    /// and copied.
    fn read_into_inner(&self, reqs: &mut [ReadReq<'_>]) -> Result<()> {
        for r in reqs.iter() {
            check_range(&self.path, Range::new(r.offset_bytes, r.buf.len()), self.len_bytes)?;
        }
        self.stats
            .add_requests(reqs.len() as u64, reqs.iter().map(|r| r.buf.len() as u64).sum());
        // Every byte is written through these pointers (derived once from the `&mut` borrows,
        // which `reqs` holds for the whole call), so no reference to a buffer is made while the
        // kernel writes into another part of it.
        let bases: Vec<*mut u8> = reqs.iter_mut().map(|r| r.buf.as_mut_ptr()).collect();
        let lens: Vec<usize> = reqs.iter().map(|r| r.buf.len()).collect();
        let mut jobs = Vec::with_capacity(reqs.len());
        // Per job: its request and where its bytes start in the request's buffer.
        let mut places: Vec<(usize, usize)> = Vec::with_capacity(reqs.len());
        let mut in_place_bytes = 0u64;
        for (i, r) in reqs.iter().enumerate() {
            let (o, len) = (r.offset_bytes, lens[i]);
            let (lo, hi) = in_place_part(o, bases[i] as usize, len, self.align);
            // (start, end, straight into the buffer): head and tail through slots.
            let pieces = match hi > lo {
                true => [(0, lo, false), (lo, hi, true), (hi, len, false)],
                false => [(0, len, false), (0, 0, false), (0, 0, false)],
            };
            for (at, end, into) in pieces.into_iter().filter(|p| p.1 > p.0) {
                let range = Range::new(o + at as u64, end - at);
                jobs.push(match into {
                    true => {
                        in_place_bytes += range.len_bytes as u64;
                        Job::Into {
                            range,
                            // SAFETY: (pointer arithmetic) at < end <= len, inside request i's
                            // buffer.
                            dest: DestPtr(unsafe { bases[i].add(at) }),
                        }
                    }
                    false => Job::Lend(range),
                });
                places.push((i, at));
            }
        }
        self.stats.add_in_place(in_place_bytes);
        self.run(&jobs, &mut |j, bytes| {
            let (i, at) = places[j];
            debug_assert!(at + bytes.len() <= lens[i]);
            // SAFETY: a `Lend` job's bytes go to `[at, at + len)` of request i's buffer, inside it
            // (the jobs split the request), and no other job of the batch writes there.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), bases[i].add(at), bytes.len()) };
            Ok(())
        })
    }

    /// Runs `jobs`: fills every free slot with a read, reaps completions, resumes short reads,
    /// hands each `Lend` job's bytes to `on_done(job index, bytes)`. With `Into` jobs, it returns
    /// or unwinds only after every read of the batch has completed (the kernel writes into the
    /// caller's memory); if the ring cannot be waited on then, the process aborts, the only sound
    /// way out.
    fn run(&self, jobs: &[Job], on_done: &mut OnDone<'_>) -> Result<()> {
        let ring_err = |e: io::Error| Error::io(&self.path, e);
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.drain().map_err(ring_err)?;
        if !jobs.iter().any(|j| matches!(j, Job::Into { .. })) {
            return self.run_on(&mut ring, jobs, on_done);
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_on(&mut ring, jobs, on_done)));
        if let Err(e) = ring.drain() {
            eprintln!(
                "{}: io_uring reads into caller memory may still be in flight and the ring cannot \
                 be waited on ({e}); aborting rather than returning memory the kernel may write",
                self.path.display()
            );
            std::process::abort();
        }
        match outcome {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    fn run_on(&self, ring: &mut Ring, jobs: &[Job], on_done: &mut OnDone<'_>) -> Result<()> {
        let ring_err = |e: io::Error| Error::io(&self.path, e);
        let mut next = 0usize;
        let mut first_err: Option<Error> = None;
        loop {
            while first_err.is_none() && next < jobs.len() && !ring.free.is_empty() {
                let (index, job) = (next, jobs[next]);
                next += 1;
                if job.range().len_bytes == 0 {
                    continue;
                }
                if let Err(e) = self.start(ring, index, job) {
                    first_err = Some(ring_err(e));
                }
            }
            if ring.pending == 0 {
                break;
            }
            let reaped = self.reap(ring, &mut |index, outcome| match outcome {
                Err(e) => {
                    first_err.get_or_insert(e);
                }
                Ok(Some(bytes)) if first_err.is_none() => {
                    if let Err(e) = on_done(index, bytes) {
                        first_err = Some(e);
                    }
                }
                Ok(_) => {}
            });
            if let Err(e) = reaped {
                // Reads may still be in flight; the next call (or Drop) drains them first, or,
                // with reads into caller memory, `run` before it returns.
                return Err(first_err.unwrap_or(e));
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Starts `job` (the `index`-th of its batch) in a free slot (the caller checked there is
    /// one); on an error nothing is in flight for it and the slot is free again.
    fn start(&self, ring: &mut Ring, index: usize, job: Job) -> io::Result<()> {
        let fd = self.file.as_raw_fd();
        let range = job.range();
        let slot = ring.free.pop().expect("a free slot");
        let span = Span::widen(range, self.align);
        let dest = match job {
            Job::Into { dest, .. } => Some(dest),
            Job::Lend(_) => None,
        };
        let big = (dest.is_none() && span.dev_len_bytes > ring.slots[slot].len())
            .then(|| AlignedBuf::new(span.dev_len_bytes));
        ring.inflight[slot] = Some(Inflight {
            index,
            range,
            span,
            done: 0,
            pos: 0,
            big,
            dest,
            registered: false,
        });
        ring.push(slot, fd, self.align, self.sqe_bytes_max).inspect_err(|_| {
            ring.inflight[slot] = None;
            ring.free.push(slot);
        })
    }

    /// Waits for at least one completion and settles every completion there is: a short read
    /// (or EINTR/EAGAIN) is resumed in its slot; a read that finished or failed frees its slot
    /// and goes to `settled(index, outcome)` — `Ok(Some(bytes))` for a read into the ring's
    /// buffers (lent for the call), `Ok(None)` for one into caller memory, `Err` naming the
    /// range when it failed. An error return means the ring could not be waited on.
    fn reap(&self, ring: &mut Ring, settled: &mut Settled<'_>) -> Result<()> {
        let fd = self.file.as_raw_fd();
        ring.wait().map_err(|e| Error::io(&self.path, e))?;
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
                settled(e.index, Err(read_error(&self.path, e.range, err)));
                ring.free.push(slot);
            } else if e.done < needed {
                // Short read (or EINTR/EAGAIN): resume the rest in the same slot.
                let index = e.index;
                let range = e.range;
                ring.inflight[slot] = Some(e);
                if let Err(err) = ring.push(slot, fd, self.align, self.sqe_bytes_max) {
                    ring.inflight[slot] = None;
                    ring.free.push(slot);
                    settled(index, Err(read_error(&self.path, range, err)));
                }
            } else {
                let (lo, hi) = (e.span.head_bytes, needed);
                if e.registered {
                    self.stats.add_in_place_registered(e.range.len_bytes as u64);
                }
                match (e.dest, &e.big) {
                    (Some(_), _) => settled(e.index, Ok(None)),
                    (None, Some(big)) => settled(e.index, Ok(Some(&big.as_slice()[lo..hi]))),
                    (None, None) => settled(e.index, Ok(Some(&ring.slots[slot].as_slice()[lo..hi]))),
                }
                ring.free.push(slot);
            }
        }
        ring.cqes = cqes;
        Ok(())
    }

    /// `read_into`'s split of a request (`len` bytes at `offset` into memory at `base`): its
    /// whole aligned blocks straight into the memory when the address has the offset's phase,
    /// the partial blocks at either end (or everything, when the phase differs) through the
    /// slots; each piece with where its bytes start in the memory.
    fn pieces(&self, offset: u64, base: *mut u8, len: usize) -> Vec<(Job, usize)> {
        let (lo, hi) = in_place_part(offset, base as usize, len, self.align);
        let parts = match hi > lo {
            true => [(0, lo, false), (lo, hi, true), (hi, len, false)],
            false => [(0, len, false), (0, 0, false), (0, 0, false)],
        };
        parts
            .into_iter()
            .filter(|p| p.1 > p.0)
            .map(|(at, end, into)| {
                let range = Range::new(offset + at as u64, end - at);
                let job = match into {
                    true => Job::Into {
                        range,
                        // SAFETY: (pointer arithmetic) at < end <= len, inside the request's
                        // memory.
                        dest: DestPtr(unsafe { base.add(at) }),
                    },
                    false => Job::Lend(range),
                };
                (job, at)
            })
            .collect()
    }

    /// `read_stream` once nothing is in flight and `first` is at hand: keeps the ring full from
    /// `next(false)` until it has nothing more and every read has settled.
    fn stream_on(
        &self,
        ring: &mut Ring,
        first: StreamReq,
        next: &mut NextReq<'_>,
        done: &mut ReqDone<'_>,
    ) -> Result<()> {
        struct Open {
            req: StreamReq,
            /// Pieces not yet settled, and where each piece's bytes start in the request's memory.
            left: usize,
            at: [usize; 3],
            err: Option<Error>,
        }
        let mut open: Vec<Option<Open>> = Vec::new();
        let mut free_ids: Vec<usize> = Vec::new();
        // Pieces waiting for a slot: (job, request id, piece number).
        let mut queued: std::collections::VecDeque<(Job, usize, usize)> = std::collections::VecDeque::new();
        let mut pending_req = Some(first);
        loop {
            // Fill free slots: queued pieces first, then new requests.
            while !ring.free.is_empty() {
                if let Some((job, id, k)) = queued.pop_front() {
                    if let Err(e) = self.start(ring, id * 3 + k, job) {
                        let o = open[id].as_mut().expect("an open request");
                        o.err.get_or_insert(Error::io(&self.path, e));
                        o.left -= 1;
                        if o.left == 0 {
                            let o = open[id].take().expect("open");
                            free_ids.push(id);
                            done(o.req.tag, Err(o.err.expect("just set")));
                        }
                    }
                    continue;
                }
                let Some(req) = pending_req.take().or_else(|| next(false)) else {
                    break;
                };
                let range = Range::new(req.offset_bytes, req.len_bytes);
                if let Err(e) = check_range(&self.path, range, self.len_bytes) {
                    done(req.tag, Err(e));
                    continue;
                }
                self.stats.add_requests(1, req.len_bytes as u64);
                let pieces = self.pieces(req.offset_bytes, req.dest, req.len_bytes);
                if pieces.is_empty() {
                    done(req.tag, Ok(()));
                    continue;
                }
                let mut at = [0; 3];
                for (k, (job, a)) in pieces.iter().enumerate() {
                    at[k] = *a;
                    if let Job::Into { range, .. } = job {
                        self.stats.add_in_place(range.len_bytes as u64);
                    }
                }
                let id = free_ids.pop().unwrap_or_else(|| {
                    open.push(None);
                    open.len() - 1
                });
                open[id] = Some(Open {
                    req,
                    left: pieces.len(),
                    at,
                    err: None,
                });
                for (k, (job, _)) in pieces.into_iter().enumerate() {
                    queued.push_back((job, id, k));
                }
            }
            if ring.pending == 0 && queued.is_empty() {
                // Nothing in flight, waiting or offered: the caller waits idle (without the ring).
                return Ok(());
            }
            self.reap(ring, &mut |index, outcome| {
                let (id, k) = (index / 3, index % 3);
                let o = open[id].as_mut().expect("a settled piece's request is open");
                match outcome {
                    Err(e) => {
                        o.err.get_or_insert(e);
                    }
                    Ok(Some(bytes)) => {
                        // SAFETY: the piece's bytes belong at `[at, at + len)` of the request's
                        // memory (the pieces split it), which the caller keeps valid and
                        // untouched until `done` (this method's contract); no other piece
                        // writes there.
                        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), o.req.dest.add(o.at[k]), bytes.len()) };
                    }
                    Ok(None) => {}
                }
                o.left -= 1;
                if o.left == 0 {
                    let o = open[id].take().expect("open");
                    free_ids.push(id);
                    done(o.req.tag, o.err.map_or(Ok(()), Err));
                }
            })?;
        }
    }
}
