//! The mmap engine (the "walk" path): the whole file mapped read-only, pages fetched by the kernel
//! on first touch, `MADV_RANDOM` so a fault reads one page rather than megabytes of read-ahead.
//!
//! Owns the mapping. It must not be used on files that another process may truncate or rewrite
//! while mapped, and it cannot report device errors as `Error::Read`: a failing page fault is a
//! SIGBUS, which is why the uring and pread engines are the default where errors must be reported.

use super::stats::{ReadStats, StatsCell};
use super::{check_range, OnDone, Range, Reader};
use crate::error::Result;
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Page size used to count touched bytes in [`ReadStats::bytes_device`].
const PAGE_BYTES: u64 = 4096;

pub struct MmapReader {
    /// `None` for an empty file (there is nothing to map).
    map: Option<Mmap>,
    path: PathBuf,
    len_bytes: u64,
    stats: StatsCell,
    warnings: Vec<String>,
}

impl MmapReader {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io_err = |e| crate::Error::io(path, e);
        let file = File::open(path).map_err(io_err)?;
        let len_bytes = file.metadata().map_err(io_err)?.len();
        let mut warnings = Vec::new();
        let map = if len_bytes == 0 {
            None
        } else {
            // SAFETY: the map is read-only and lives as long as `self`; slices handed out borrow
            // `self`. It is sound as long as no one truncates or rewrites the file while mapped —
            // gatestream writes model files to a temporary name and renames them, never in place,
            // and this module's doc makes the requirement explicit for other callers. (Truncation
            // by another process would be SIGBUS on access, not a wrong byte.)
            let map = unsafe { Mmap::map(&file) }.map_err(io_err)?;
            #[cfg(unix)]
            if let Err(e) = map.advise(memmap2::Advice::Random) {
                warnings.push(format!(
                    "{}: madvise(MADV_RANDOM) failed ({e}); random reads will trigger read-ahead",
                    path.display()
                ));
            }
            Some(map)
        };
        Ok(MmapReader {
            map,
            path: path.to_path_buf(),
            len_bytes,
            stats: StatsCell::default(),
            warnings,
        })
    }

    /// The bytes of `len_bytes` at `offset_bytes`, borrowed from the map (zero copy). Touching them
    /// may fault pages in from disk. Not counted in [`ReadStats`].
    pub fn slice(&self, offset_bytes: u64, len_bytes: usize) -> Result<&[u8]> {
        let range = Range::new(offset_bytes, len_bytes);
        check_range(&self.path, range, self.len_bytes)?;
        let start = offset_bytes as usize;
        Ok(match &self.map {
            Some(map) => &map[start..start + len_bytes],
            None => &[],
        })
    }

    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
}

impl Reader for MmapReader {
    fn read_each(&self, ranges: &[Range], on_done: &mut OnDone<'_>) -> Result<()> {
        let t0 = Instant::now();
        let result = (|| {
            for &r in ranges {
                check_range(&self.path, r, self.len_bytes)?;
            }
            self.stats
                .add_requests(ranges.len() as u64, ranges.iter().map(|r| r.len_bytes as u64).sum());
            for (i, &r) in ranges.iter().enumerate() {
                if r.len_bytes > 0 {
                    let lo = r.offset_bytes / PAGE_BYTES * PAGE_BYTES;
                    let hi = (r.offset_bytes + r.len_bytes as u64).div_ceil(PAGE_BYTES) * PAGE_BYTES;
                    self.stats.add_device_read(hi - lo);
                }
                on_done(i, self.slice(r.offset_bytes, r.len_bytes)?)?;
            }
            Ok(())
        })();
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

    fn reset_stats(&self) {
        self.stats.reset()
    }

    /// The device reads whole pages for a map (its read-ahead aside).
    fn align_bytes(&self) -> usize {
        super::ALIGN_BYTES
    }
}
