//! Opening files for reading (with or without O_DIRECT, by policy), widening ranges to the O_DIRECT
//! block size, and the resume-until-complete loop shared by the synchronous engines.
//!
//! Owns the O_DIRECT decision and its evidence (the fd's flags). It must not choose an engine or
//! hold buffers beyond one probe block.

use super::buf::{AlignedBuf, ALIGN_BYTES};
use super::stats::StatsCell;
use super::{read_error, Range};
use crate::error::{Error, Result};
use std::fs::File;
use std::io;
use std::path::Path;

/// Whether reads bypass the page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectIo {
    /// O_DIRECT or an error naming why it is unavailable.
    Required,
    /// O_DIRECT where the filesystem supports it, else buffered reads and a warning.
    Optional,
    /// Buffered reads through the page cache.
    Off,
}

pub(crate) struct OpenedFile {
    pub file: File,
    pub len_bytes: u64,
    pub direct_io_active: bool,
    /// Reads are widened to multiples of this (the filesystem's direct-I/O offset alignment;
    /// 1 for buffered reads).
    pub align_bytes: usize,
    pub warnings: Vec<String>,
}

/// Opens `path` read-only under `policy`. With O_DIRECT, one aligned block is read to prove the
/// filesystem accepts direct reads (tmpfs refuses the open; some filesystems refuse only the read).
pub(crate) fn open_file(path: &Path, policy: DirectIo) -> Result<OpenedFile> {
    let mut warnings = Vec::new();
    if policy != DirectIo::Off {
        match open_direct(path) {
            Ok(file) => {
                let len_bytes = file_len(path, &file)?;
                return Ok(OpenedFile {
                    align_bytes: dio_align_bytes(&file),
                    file,
                    len_bytes,
                    direct_io_active: true,
                    warnings,
                });
            }
            Err(why) if policy == DirectIo::Required => {
                return Err(Error::Input(format!(
                    "{}: direct I/O (O_DIRECT) is required but unavailable: {why}; put the file on \
                     a filesystem that supports it (not tmpfs) or allow buffered reads",
                    path.display()
                )))
            }
            Err(why) => warnings.push(format!(
                "{}: direct I/O (O_DIRECT) unavailable ({why}); reading through the page cache",
                path.display()
            )),
        }
    }
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let len_bytes = file_len(path, &file)?;
    Ok(OpenedFile {
        file,
        len_bytes,
        direct_io_active: false,
        align_bytes: 1,
        warnings,
    })
}

fn file_len(path: &Path, file: &File) -> Result<u64> {
    Ok(file.metadata().map_err(|e| Error::io(path, e))?.len())
}

/// Opens with O_DIRECT and proves a direct read works; the error says why not.
#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> std::result::Result<File, String> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| format!("open with O_DIRECT failed: {e}"))?;
    if !has_o_direct(&file) {
        return Err("the kernel dropped the O_DIRECT flag".into());
    }
    let mut probe = AlignedBuf::new(ALIGN_BYTES);
    match file.read_at(probe.as_mut_slice(), 0) {
        Ok(_) => Ok(file),
        Err(e) => Err(format!("a direct read of the first block failed: {e}")),
    }
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_path: &Path) -> std::result::Result<File, String> {
    Err("this build implements O_DIRECT only on Linux".into())
}

/// The offset and length alignment direct reads of `file` need: what `statx(STATX_DIOALIGN)`
/// reports (often the device's 512-byte logical block), else [`ALIGN_BYTES`]. Only values that
/// divide `ALIGN_BYTES` are used, since buffers are aligned to it.
#[cfg(target_os = "linux")]
fn dio_align_bytes(file: &File) -> usize {
    use std::os::fd::AsRawFd;
    const STATX_DIOALIGN: u32 = 0x2000;
    // SAFETY: statx writes at most one `struct statx` into `st`, which lives for the call; the
    // empty path with AT_EMPTY_PATH names the descriptor `file` keeps open.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: as above: `st` is writable for one `struct statx`, the descriptor is open.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            STATX_DIOALIGN,
            &mut st,
        )
    };
    let a = st.stx_dio_offset_align as usize;
    let m = st.stx_dio_mem_align as usize;
    if rc == 0
        && st.stx_mask & STATX_DIOALIGN != 0
        && a.is_power_of_two()
        && ALIGN_BYTES.is_multiple_of(a)
        && m <= ALIGN_BYTES
    {
        a
    } else {
        ALIGN_BYTES
    }
}

#[cfg(not(target_os = "linux"))]
fn dio_align_bytes(_file: &File) -> usize {
    ALIGN_BYTES
}

/// Whether the open file description has O_DIRECT set (asks the kernel, `fcntl(F_GETFL)`).
#[cfg(target_os = "linux")]
pub(crate) fn has_o_direct(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: F_GETFL takes no argument and only reads the flags of a descriptor that `file`
    // keeps open for the duration of the call.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    flags >= 0 && flags & libc::O_DIRECT != 0
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn has_o_direct(_file: &File) -> bool {
    false
}

/// A range widened to whole aligned blocks: read `dev_len_bytes` at `dev_offset_bytes`; the wanted
/// bytes start `head_bytes` into the read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    pub dev_offset_bytes: u64,
    pub dev_len_bytes: usize,
    pub head_bytes: usize,
}

impl Span {
    /// `align` is 1 (no widening) or [`ALIGN_BYTES`] for O_DIRECT.
    pub fn widen(range: Range, align: usize) -> Span {
        let a = align as u64;
        let dev_offset_bytes = range.offset_bytes / a * a;
        let head_bytes = (range.offset_bytes - dev_offset_bytes) as usize;
        let dev_len_bytes = (head_bytes + range.len_bytes).div_ceil(align) * align;
        Span {
            dev_offset_bytes,
            dev_len_bytes,
            head_bytes,
        }
    }

    /// Bytes from the start of the read that must arrive before the range is complete.
    pub fn needed_bytes(&self, range: Range) -> usize {
        self.head_bytes + range.len_bytes
    }
}

/// Where to restart after `done` bytes: O_DIRECT reads must start on a block boundary, so a short
/// read that ended mid-block is re-read from the block's start.
pub(crate) fn resume_at(done: usize, align: usize) -> usize {
    done / align * align
}

/// Reads `range` (widened to `span`) into `buf[..span.dev_len_bytes]` with `read_at`, resuming
/// short reads and retrying EINTR until the wanted bytes are in. EOF before them or a device error
/// is an [`Error::Read`] naming the range.
pub(crate) fn read_span(
    path: &Path,
    range: Range,
    span: Span,
    align: usize,
    buf: &mut [u8],
    stats: &StatsCell,
    read_at: &mut dyn FnMut(u64, &mut [u8]) -> io::Result<usize>,
) -> Result<()> {
    let needed = span.needed_bytes(range);
    let mut done = 0usize;
    while done < needed {
        let start = resume_at(done, align);
        let n = match read_at(
            span.dev_offset_bytes + start as u64,
            &mut buf[start..span.dev_len_bytes],
        ) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(read_error(path, range, e)),
        };
        if n > 0 {
            stats.add_device_read(n as u64);
        }
        // No progress means the file ends at `done`: either the read returned 0, or (O_DIRECT) a
        // block-aligned re-read stopped at the same unaligned end of file as the last one.
        if start + n <= done {
            return Err(read_error(path, range, eof_at(span.dev_offset_bytes + done as u64)));
        }
        done = start + n;
    }
    Ok(())
}

pub(crate) fn eof_at(end_bytes: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("the file ended at byte {end_bytes} before the range did; was it truncated?"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widen_aligns_both_ends_and_keeps_the_head() {
        let s = Span::widen(Range::new(5000, 100), 4096);
        assert_eq!(
            s,
            Span {
                dev_offset_bytes: 4096,
                dev_len_bytes: 4096,
                head_bytes: 904
            }
        );
        let s = Span::widen(Range::new(4000, 200), 4096);
        assert_eq!(
            s,
            Span {
                dev_offset_bytes: 0,
                dev_len_bytes: 8192,
                head_bytes: 4000
            }
        );
        let s = Span::widen(Range::new(8192, 0), 4096);
        assert_eq!(s.dev_len_bytes, 0);
        let s = Span::widen(Range::new(5000, 100), 1);
        assert_eq!(
            s,
            Span {
                dev_offset_bytes: 5000,
                dev_len_bytes: 100,
                head_bytes: 0
            }
        );
    }

    #[test]
    fn read_span_without_progress_is_eof_not_a_hang() {
        let stats = StatsCell::default();
        let mut buf = vec![0u8; 8192];
        let range = Range::new(10, 8000);
        let span = Span::widen(range, 4096);
        // Always returns 100 bytes: never crosses a block, so aligned resumption never advances.
        let err = read_span(Path::new("dev"), range, span, 4096, &mut buf, &stats, &mut |_, b| {
            Ok(b.len().min(100))
        })
        .unwrap_err();
        assert!(err.to_string().contains("ended at byte 100 "), "{err}");
    }
}
