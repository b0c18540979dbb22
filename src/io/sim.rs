//! A simulated device for tests: bytes from memory or from another reader, served with injected
//! latency, short reads and EIO, through the same resume loop the real synchronous engines use.
//!
//! Owns only fault injection. It must not be used for real reads (it is serial and sleeps), and it
//! must never return bytes that differ from its source: faults change timing and errors, not data.

use super::file::{read_span, Span};
use super::stats::{ReadStats, StatsCell};
use super::{check_range, OnDone, Range, Reader};
use crate::error::Result;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// EIO's errno on Linux and macOS.
const EIO: i32 = 5;

/// Whether device reads return less than asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShortReads {
    Off,
    /// Every device read returns at most this many bytes (at least 1).
    AtMost(usize),
}

/// The faults a [`SimReader`] injects.
#[derive(Clone, Debug)]
pub struct SimFaults {
    /// Slept before every device read (each resumption of a short read included).
    pub latency_per_read: Duration,
    pub short_reads: ShortReads,
    /// A device read covering any of these byte offsets fails with EIO.
    pub eio_at_bytes: Vec<u64>,
}

impl Default for SimFaults {
    fn default() -> Self {
        SimFaults {
            latency_per_read: Duration::ZERO,
            short_reads: ShortReads::Off,
            eio_at_bytes: Vec::new(),
        }
    }
}

enum Source {
    Memory(Vec<u8>),
    Reader(Box<dyn Reader>),
}

pub struct SimReader {
    source: Source,
    path: PathBuf,
    len_bytes: u64,
    faults: SimFaults,
    stats: StatsCell,
}

impl SimReader {
    /// A device holding `bytes`; `name` is the path reported in errors.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>, faults: SimFaults) -> Self {
        SimReader {
            len_bytes: bytes.len() as u64,
            source: Source::Memory(bytes),
            path: name.into(),
            faults,
            stats: StatsCell::default(),
        }
    }

    /// A device whose bytes come from `inner` (any engine), with faults added on top.
    pub fn wrap(inner: Box<dyn Reader>, faults: SimFaults) -> Self {
        SimReader {
            len_bytes: inner.len_bytes(),
            path: inner.path().to_path_buf(),
            source: Source::Reader(inner),
            faults,
            stats: StatsCell::default(),
        }
    }

    /// One device read: up to `buf.len()` bytes at `offset_bytes`, after the faults.
    fn device_read(&self, offset_bytes: u64, buf: &mut [u8]) -> io::Result<usize> {
        if !self.faults.latency_per_read.is_zero() {
            std::thread::sleep(self.faults.latency_per_read);
        }
        let left = self.len_bytes.saturating_sub(offset_bytes);
        let mut n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        if let ShortReads::AtMost(max) = self.faults.short_reads {
            n = n.min(max.max(1));
        }
        if n == 0 {
            return Ok(0);
        }
        let end = offset_bytes + n as u64;
        if self
            .faults
            .eio_at_bytes
            .iter()
            .any(|&b| (offset_bytes..end).contains(&b))
        {
            return Err(io::Error::from_raw_os_error(EIO));
        }
        match &self.source {
            Source::Memory(bytes) => {
                let start = offset_bytes as usize;
                buf[..n].copy_from_slice(&bytes[start..start + n]);
            }
            Source::Reader(inner) => {
                let mut req = [super::ReadReq {
                    offset_bytes,
                    buf: &mut buf[..n],
                }];
                inner.read_into(&mut req).map_err(|e| io::Error::other(e.to_string()))?;
            }
        }
        Ok(n)
    }
}

impl Reader for SimReader {
    fn read_each(&self, ranges: &[Range], on_done: &mut OnDone<'_>) -> Result<()> {
        let t0 = Instant::now();
        let result = (|| {
            for &r in ranges {
                check_range(&self.path, r, self.len_bytes)?;
            }
            self.stats
                .add_requests(ranges.len() as u64, ranges.iter().map(|r| r.len_bytes as u64).sum());
            let mut buf = Vec::new();
            for (i, &range) in ranges.iter().enumerate() {
                buf.clear();
                buf.resize(range.len_bytes, 0);
                if range.len_bytes > 0 {
                    let span = Span::widen(range, 1);
                    read_span(&self.path, range, span, 1, &mut buf, &self.stats, &mut |o, b| {
                        self.device_read(o, b)
                    })?;
                }
                on_done(i, &buf)?;
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
}
