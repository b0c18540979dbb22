//! Readers: batched reads of byte ranges of one file, by io_uring, a pread thread pool, mmap, or a
//! simulated device for tests.
//!
//! Owns file descriptors, O_DIRECT, alignment, queue depth, short-read resumption and read
//! statistics. It knows files, offsets and bytes only: it must never name a neuron, layer, tensor or
//! model, and it does not plan reads (merging, choosing what to read) — `stream` does that.
//!
//! ## The one operation
//! [`Reader::read_each`] takes a batch of [`Range`]s and calls `on_done(index, bytes)` once per
//! range, in completion order, as each range's bytes land. The bytes live in the reader's own
//! buffers and are lent to the callback only for its duration: compute on them there (the sparse FFN
//! accumulates a neuron as its bundle lands), or copy them out. While the callback runs, the rest of
//! the batch stays in flight, so compute overlaps I/O without the caller owning any buffer that the
//! kernel writes into. [`Reader::read_into`] is the form that fills caller slices: a copy out of
//! the reader's buffers, except that the io_uring engine reads straight into a caller's buffer laid
//! out in phase with the file ([`in_phase_starts`]) — how reads land directly in memory a GPU has
//! page-locked, with no copy on the host.
//!
//! Every engine returns the same bytes. Alignment is the reader's job: callers give any offset and
//! length; O_DIRECT engines widen each read to [`ALIGN_BYTES`] and hand back only the wanted bytes,
//! counting the widening in [`ReadStats::bytes_device`]. Short reads are resumed; a range that
//! runs past the end of the file, and any device error, is an [`Error::Read`] naming the file and the
//! range — never a panic and never wrong bytes.
//!
//! ## Engines
//! - [`UringReader`] (Linux): O_DIRECT, optional registered buffers, configurable queue depth.
//! - [`PreadReader`]: a pool of threads doing `pread`; the portable reference.
//! - [`MmapReader`]: page cache, zero-copy ([`MmapReader::slice`]), `MADV_RANDOM`. Serves ranges in
//!   order on the caller's thread (a page fault blocks), so it overlaps nothing.
//! - [`SimReader`]: a device with injected latency, short reads and EIO.
//! - [`PartsReader`]: several files (a model's shards) as one byte space, each range read by the
//!   reader of the file holding it.
//!
//! [`open_reader`] picks an engine by policy and falls back (with warnings returned to the caller)
//! when io_uring or O_DIRECT is unavailable.

mod buf;
mod file;
mod mmap;
mod parts;
mod pread;
mod sim;
mod stats;
#[cfg(test)]
mod tests;
#[cfg(target_os = "linux")]
mod uring;

pub use buf::{advise_huge_pages, AlignedBuf, BufferPool, ALIGN_BYTES};
pub use file::DirectIo;
pub use mmap::MmapReader;
pub use parts::{measure_read_rate, open_parts_reader, place_parts, FilePart, PartsReader, PART_ALIGN_BYTES};
pub use pread::{PreadOptions, PreadReader};
pub use sim::{ShortReads, SimFaults, SimReader};
pub use stats::ReadStats;
#[cfg(target_os = "linux")]
pub use uring::{FixedBuffers, UringOptions, UringProbe, UringReader};

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// A byte range of the reader's file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub offset_bytes: u64,
    pub len_bytes: usize,
}

impl Range {
    pub fn new(offset_bytes: u64, len_bytes: usize) -> Self {
        Range {
            offset_bytes,
            len_bytes,
        }
    }
}

/// A read into a caller-owned slice, for [`Reader::read_into`]: `buf.len()` bytes at `offset_bytes`.
#[derive(Debug)]
pub struct ReadReq<'a> {
    pub offset_bytes: u64,
    pub buf: &'a mut [u8],
}

/// A read [`Reader::read_stream`] makes: `len_bytes` bytes at `offset_bytes` into caller memory at
/// `dest`; `tag` names it to the completion callback.
#[derive(Clone, Copy, Debug)]
pub struct StreamReq {
    pub offset_bytes: u64,
    pub len_bytes: usize,
    pub dest: *mut u8,
    pub tag: u64,
}

/// `next(idle)`: the next request of a [`Reader::read_stream`], or `None` when there is none now.
/// `idle` is true when nothing is in flight: the callback may then block for a request, and
/// `None` ends the stream; with `idle` false it must not block (reads are waiting to be reaped).
pub type NextReq<'a> = dyn FnMut(bool) -> Option<StreamReq> + 'a;
/// `done(tag, result)`: a [`Reader::read_stream`] request finished (its bytes are all in place),
/// or failed (the error names the file and range; its memory's contents are unspecified).
pub type ReqDone<'a> = dyn FnMut(u64, Result<()>) + 'a;

/// Called once per completed range with the range's index in the batch and its bytes.
/// Returning an error stops the batch (reads in flight are drained) and `read_each` returns it.
pub type OnDone<'a> = dyn FnMut(usize, &[u8]) -> Result<()> + 'a;

/// Batched reads of byte ranges of one file. See the module doc for the contract.
pub trait Reader: Send + Sync {
    /// Reads every range and calls `on_done(index, bytes)` once per range as it completes (in
    /// completion order, not batch order; zero-length ranges complete first, with an empty slice).
    /// On the first error, no new reads are started, reads in flight are waited for, and the error
    /// is returned; ranges not yet reported then never are. Calls from several threads are allowed;
    /// an engine may serialize them.
    fn read_each(&self, ranges: &[Range], on_done: &mut OnDone<'_>) -> Result<()>;

    /// The file this reader reads.
    fn path(&self) -> &Path;

    /// The file's length when the reader was opened; ranges must end at or before it.
    fn len_bytes(&self) -> u64;

    /// Counters since the reader was opened (or since `reset_stats`).
    fn stats(&self) -> ReadStats;

    fn reset_stats(&self);

    /// Every device read is widened to multiples of this many bytes (1: no widening).
    fn align_bytes(&self) -> usize {
        1
    }

    /// Reads each request's `buf.len()` bytes at its offset into its buffer. Same error contract as
    /// `read_each` (on an error, a buffer's contents are unspecified). By default one copy out of
    /// the reader's buffers; the io_uring engine reads the whole blocks of a buffer laid out in
    /// phase with the file ([`in_phase_starts`]) straight into it, counted in
    /// [`ReadStats::bytes_in_place`].
    fn read_into(&self, reqs: &mut [ReadReq<'_>]) -> Result<()> {
        let ranges: Vec<Range> = reqs.iter().map(|r| Range::new(r.offset_bytes, r.buf.len())).collect();
        self.read_each(&ranges, &mut |i, bytes| {
            reqs[i].buf.copy_from_slice(bytes);
            Ok(())
        })
    }

    /// Registers `bytes` — memory that `read_into` will read into again and again, such as a
    /// long-lived prefetch buffer — with the engine, so those reads skip per-read setup (io_uring:
    /// a fixed buffer, its pages pinned once instead of at every read). The guard undoes it when
    /// dropped. `None`: nothing to register (the default) or the engine has no room or is refused.
    ///
    /// # Safety
    /// `bytes` must stay allocated, in place (never freed, moved or reallocated) until the
    /// returned guard is dropped: a fixed-buffer read writes to the pages registered, whatever
    /// the address names by then.
    unsafe fn register(&self, _bytes: &mut [u8]) -> Option<Registration> {
        None
    }

    /// A pipeline of reads into caller memory: takes requests from `next` and reports each to
    /// `done` as it completes, in any order, until `next(true)` returns `None`. The io_uring
    /// engine keeps its queue full across requests (the next ones are started while the last
    /// ones of a batch are still in flight, so a stream of jobs never drains the device between
    /// them) and reads whole blocks in place as `read_into` does; by default each request is
    /// read on its own, in order. Per-request errors go to `done`; an error return means the
    /// reader itself failed (its ring could not be waited on).
    ///
    /// # Safety
    /// Each request's `dest` must be valid for writes of `len_bytes` bytes, and neither read nor
    /// written by anyone else, from when `next` hands it over until `done` is called with its tag.
    unsafe fn read_stream(&self, next: &mut NextReq<'_>, done: &mut ReqDone<'_>) -> Result<()> {
        while let Some(r) = next(true) {
            // SAFETY: the caller guarantees `dest` is valid and unaliased for `len_bytes` until
            // `done`, which is called right after the read.
            let buf = unsafe { std::slice::from_raw_parts_mut(r.dest, r.len_bytes) };
            let result = self.read_into(&mut [ReadReq {
                offset_bytes: r.offset_bytes,
                buf,
            }]);
            done(r.tag, result);
        }
        Ok(())
    }

    /// Reads one range into a new `Vec`, in requests of at most [`READ_VEC_PIECE_BYTES`] (a
    /// `Vec` is rarely in phase with the file, so each request goes through a reader buffer of
    /// its size: one for the whole range would double a large matrix's memory while it loads).
    fn read_vec(&self, offset_bytes: u64, len_bytes: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len_bytes];
        // (An empty range is one request, so its offset is checked like any other.)
        let (mut ranges, mut starts) = (
            vec![Range::new(offset_bytes, len_bytes.min(READ_VEC_PIECE_BYTES))],
            vec![0],
        );
        let mut at = ranges[0].len_bytes;
        while at < len_bytes {
            let n = READ_VEC_PIECE_BYTES.min(len_bytes - at);
            ranges.push(Range::new(offset_bytes + at as u64, n));
            starts.push(at);
            at += n;
        }
        self.read_into(&mut requests_at(&mut out, &ranges, &starts))?;
        Ok(out)
    }
}

/// The largest request [`Reader::read_vec`] makes.
pub const READ_VEC_PIECE_BYTES: usize = 4 << 20;

/// Sizes `v` to hold `len` bytes read from file offset `offset` straight into it (O_DIRECT in
/// place, [`in_phase_starts`]): returns where they start, at the offset's phase modulo
/// [`ALIGN_BYTES`]. A buffer too small is replaced by one whose memory is advised into huge
/// pages before it is first touched ([`advise_huge_pages`]).
pub fn lay_in_phase(v: &mut Vec<u8>, offset: u64, len: usize) -> usize {
    lay_pieces_in_phase(v, &[Range::new(offset, len)])[0]
}

/// Lays `v` out for `pieces` read in place, each at its file offset's phase (as
/// [`in_phase_starts`] places them), and returns where each starts. A buffer too small for the
/// largest layout is replaced by one whose memory is advised into huge pages before it is first
/// touched ([`advise_huge_pages`]), so a reused buffer is not reallocated.
pub fn lay_pieces_in_phase(v: &mut Vec<u8>, pieces: &[Range]) -> Vec<usize> {
    let need = in_phase_len_max(pieces, &[]);
    if v.capacity() < need {
        *v = Vec::with_capacity(need);
        // SAFETY: the spare capacity is memory the vector owns; it is only advised, not read.
        let spare = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr(), need) };
        advise_huge_pages(spare);
    }
    let (starts, end) = in_phase_starts(v.as_ptr() as usize, pieces, &[]);
    // A reused buffer keeps its old bytes (the reads overwrite every piece; the gaps between
    // pieces are never read): zeroing it again would cost a pass over memory each expert.
    if v.len() < end {
        v.resize(end, 0);
    } else {
        v.truncate(end);
    }
    starts
}

/// Reads `len` bytes at `offset` into a new buffer laid out in phase ([`lay_in_phase`]), in
/// requests of at most [`READ_VEC_PIECE_BYTES`]: io_uring reads their whole blocks in place (no
/// reader buffer, no copy). Returns the buffer and where the bytes start in it.
pub fn read_in_phase(r: &dyn Reader, offset: u64, len: usize) -> Result<(Vec<u8>, usize)> {
    let mut v = Vec::new();
    let at = lay_in_phase(&mut v, offset, len);
    let (mut ranges, mut starts) = (vec![Range::new(offset, len.min(READ_VEC_PIECE_BYTES))], vec![at]);
    let mut done = ranges[0].len_bytes;
    while done < len {
        let n = READ_VEC_PIECE_BYTES.min(len - done);
        ranges.push(Range::new(offset + done as u64, n));
        starts.push(at + done);
        done += n;
    }
    r.read_into(&mut requests_at(&mut v, &ranges, &starts))?;
    Ok((v, at))
}

/// Where to place each of `ranges`, back to back in order, in a buffer whose first byte is at
/// address `base`, so that [`Reader::read_into`] can read their whole blocks straight into it (the
/// io_uring engine does; see its module doc): each range at the first position at or after the
/// previous one's end plus `leads[i]` bytes kept free before it (none where `leads` is shorter)
/// whose address has the range's file offset's phase modulo [`ALIGN_BYTES`]. Returns each range's
/// start and the end of the last; at most [`in_phase_len_max`]. The layout depends on `base`:
/// compute it for the buffer that is read into.
pub fn in_phase_starts(base: usize, ranges: &[Range], leads: &[usize]) -> (Vec<usize>, usize) {
    let a = ALIGN_BYTES as u64;
    let mut starts = Vec::with_capacity(ranges.len());
    let mut at = 0usize;
    for (i, r) in ranges.iter().enumerate() {
        at += leads.get(i).copied().unwrap_or(0);
        let addr = (base as u64).wrapping_add(at as u64);
        let pad = (r.offset_bytes % a).wrapping_sub(addr % a).wrapping_add(a) % a;
        at += pad as usize;
        starts.push(at);
        at += r.len_bytes;
    }
    (starts, at)
}

/// The most bytes [`in_phase_starts`] lays `ranges` (and `leads`) out in, whatever the base address.
pub fn in_phase_len_max(ranges: &[Range], leads: &[usize]) -> usize {
    ranges.iter().map(|r| r.len_bytes + ALIGN_BYTES - 1).sum::<usize>() + leads.iter().sum::<usize>()
}

/// Requests for [`Reader::read_into`] reading `ranges` into `buf`, range i's bytes at
/// `starts[i]` (increasing, each range clear of the next), e.g. as [`in_phase_starts`] placed
/// them. Panics if a range does not fit where it is placed (a caller's layout bug).
pub fn requests_at<'a>(buf: &'a mut [u8], ranges: &[Range], starts: &[usize]) -> Vec<ReadReq<'a>> {
    let mut reqs = Vec::with_capacity(ranges.len());
    let mut rest: &mut [u8] = buf;
    let mut at = 0;
    for (r, &start) in ranges.iter().zip(starts) {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
        let (mine, tail) = tail.split_at_mut(r.len_bytes);
        reqs.push(ReadReq {
            offset_bytes: r.offset_bytes,
            buf: mine,
        });
        rest = tail;
        at = start + r.len_bytes;
    }
    reqs
}

/// Memory registered with a reader ([`Reader::register`]); dropping it undoes the registration.
pub struct Registration {
    release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl Registration {
    pub(crate) fn new(release: impl FnOnce() + Send + Sync + 'static) -> Registration {
        Registration {
            release: Some(Box::new(release)),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Registration")
    }
}

/// Which engine to read with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadEngine {
    /// io_uring on Linux; falls back to `Pread` (with a warning) where unavailable.
    Uring,
    Pread,
    Mmap,
}

/// Options for [`open_reader`]; engine-specific fields are ignored by the other engines.
#[derive(Clone, Debug)]
pub struct ReaderOptions {
    pub direct_io: DirectIo,
    /// Reads in flight at once (uring ring size; pread jobs in flight).
    pub queue_depth: usize,
    /// Size of each reusable read buffer; larger ranges get a one-off buffer.
    pub slot_bytes: usize,
    pub pread_threads: usize,
    #[cfg(target_os = "linux")]
    pub fixed_buffers: FixedBuffers,
    #[cfg(target_os = "linux")]
    pub uring_probe: UringProbe,
}

impl ReaderOptions {
    /// The reusable buffers a reader opened with these options holds (queue depth × slot).
    pub fn buffer_bytes(&self) -> u64 {
        (self.queue_depth * self.slot_bytes) as u64
    }
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            direct_io: DirectIo::Optional,
            queue_depth: 64,
            slot_bytes: 256 * 1024,
            pread_threads: 8,
            #[cfg(target_os = "linux")]
            fixed_buffers: FixedBuffers::On,
            #[cfg(target_os = "linux")]
            uring_probe: UringProbe::Detect,
        }
    }
}

/// What [`open_reader`] opened, and why it differs from what was asked, if it does.
pub struct OpenedReader {
    pub reader: Box<dyn Reader>,
    /// The engine actually in use (differs from the request after a fallback).
    pub engine: ReadEngine,
    /// Whether reads bypass the page cache (O_DIRECT).
    pub direct_io_active: bool,
    /// Fallbacks taken (io_uring unavailable, O_DIRECT refused, ...), for the caller to print.
    pub warnings: Vec<String>,
}

/// Opens `path` with `engine`, falling back where the platform cannot do what was asked:
/// io_uring unavailable → pread thread pool; O_DIRECT refused by the filesystem → buffered reads,
/// unless `opts.direct_io` is `Required`, which makes it an error. Each fallback adds a warning.
/// Writes `bytes` to `path` whole or not at all: into `path` + ".tmp" beside it, fsynced, then
/// renamed over `path` (a reader sees the old file or the complete new one).
pub fn write_replacing(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    write().map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

pub fn open_reader(path: impl AsRef<Path>, engine: ReadEngine, opts: &ReaderOptions) -> Result<OpenedReader> {
    let path = path.as_ref();
    let mut warnings = Vec::new();
    if engine == ReadEngine::Uring {
        #[cfg(target_os = "linux")]
        {
            match UringReader::probe_with(opts.uring_probe) {
                Ok(()) => {
                    let uopts = UringOptions {
                        queue_depth: opts.queue_depth,
                        fixed_buffers: opts.fixed_buffers,
                        slot_bytes: opts.slot_bytes,
                        direct_io: opts.direct_io,
                        probe: opts.uring_probe,
                    };
                    let r = UringReader::open(path, &uopts)?;
                    warnings.extend(r.warnings().iter().cloned());
                    let direct_io_active = r.direct_io_active();
                    return Ok(OpenedReader {
                        reader: Box::new(r),
                        engine: ReadEngine::Uring,
                        direct_io_active,
                        warnings,
                    });
                }
                Err(why) => warnings.push(format!(
                    "{}: io_uring unavailable ({why}); reading with the pread thread pool instead",
                    path.display()
                )),
            }
        }
        #[cfg(not(target_os = "linux"))]
        warnings.push(format!(
            "{}: io_uring exists only on Linux; reading with the pread thread pool instead",
            path.display()
        ));
    }
    if engine == ReadEngine::Mmap {
        let r = MmapReader::open(path)?;
        match opts.direct_io {
            DirectIo::Required => {
                return Err(Error::Input(format!(
                    "{}: the mmap reader reads through the page cache and cannot honour \
                     direct I/O `required`; use the uring or pread engine, or direct I/O `optional`",
                    path.display()
                )))
            }
            DirectIo::Optional => warnings.push(format!(
                "{}: the mmap reader reads through the page cache; direct I/O not used",
                path.display()
            )),
            DirectIo::Off => {}
        }
        return Ok(OpenedReader {
            reader: Box::new(r),
            engine: ReadEngine::Mmap,
            direct_io_active: false,
            warnings,
        });
    }
    let popts = PreadOptions {
        threads: opts.pread_threads,
        queue_depth: opts.queue_depth,
        direct_io: opts.direct_io,
    };
    let r = PreadReader::open(path, &popts)?;
    warnings.extend(r.warnings().iter().cloned());
    let direct_io_active = r.direct_io_active();
    Ok(OpenedReader {
        reader: Box::new(r),
        engine: ReadEngine::Pread,
        direct_io_active,
        warnings,
    })
}

/// The error for a range that ends past the end of the file (checked before any I/O).
pub(crate) fn past_eof(path: &Path, range: Range, file_len_bytes: u64) -> Error {
    Error::Read {
        path: path.to_path_buf(),
        offset_bytes: range.offset_bytes,
        len_bytes: range.len_bytes as u64,
        cause: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "the range ends past the end of the file ({file_len_bytes} bytes); \
                 is the file truncated or the offset wrong?"
            ),
        ),
    }
}

/// Checks that `range` lies inside a file of `file_len_bytes`.
pub(crate) fn check_range(path: &Path, range: Range, file_len_bytes: u64) -> Result<()> {
    match range.offset_bytes.checked_add(range.len_bytes as u64) {
        Some(end) if end <= file_len_bytes => Ok(()),
        _ => Err(past_eof(path, range, file_len_bytes)),
    }
}

pub(crate) fn read_error(path: &Path, range: Range, source: std::io::Error) -> Error {
    Error::Read {
        path: PathBuf::from(path),
        offset_bytes: range.offset_bytes,
        len_bytes: range.len_bytes as u64,
        cause: source,
    }
}
