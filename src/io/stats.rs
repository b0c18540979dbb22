//! Per-reader read counters, for read-amplification and bandwidth reporting.
//!
//! Owns the counters only; it must not decide anything from them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Counters of one reader since it was opened or last reset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Ranges the caller asked for (zero-length ones included).
    pub requests: u64,
    /// Bytes the caller asked for.
    pub bytes_requested: u64,
    /// Device reads issued (syscalls or io_uring SQEs), counting each resumption of a short read.
    /// For mmap: ranges served (page faults are not visible to the reader).
    pub device_reads: u64,
    /// Bytes the device returned, including O_DIRECT alignment widening and bytes re-read when
    /// resuming. For mmap: bytes of the pages the ranges touch (read-ahead is invisible to it).
    pub bytes_device: u64,
    /// Wall time spent inside `read_each` (callbacks included), summed over calls.
    pub wall_ns: u64,
    /// Requested bytes the device read straight into the caller's memory (`read_into` on
    /// io_uring, where the buffer's layout allows it): never copied out of a reader's buffer.
    pub bytes_in_place: u64,
    /// Of those, the bytes read into memory registered with the engine ([`super::Reader::register`]):
    /// io_uring fixed buffers, whose pages the kernel pinned once instead of at every read.
    pub bytes_in_place_registered: u64,
}

impl ReadStats {
    /// Field by field: `self + o` (two readers' counters together) or `self - o` (since a
    /// snapshot `o`).
    pub fn combine(&self, o: &ReadStats, sign: i8) -> ReadStats {
        let f = |a: u64, b: u64| if sign < 0 { a - b } else { a + b };
        ReadStats {
            requests: f(self.requests, o.requests),
            bytes_requested: f(self.bytes_requested, o.bytes_requested),
            device_reads: f(self.device_reads, o.device_reads),
            bytes_device: f(self.bytes_device, o.bytes_device),
            wall_ns: f(self.wall_ns, o.wall_ns),
            bytes_in_place: f(self.bytes_in_place, o.bytes_in_place),
            bytes_in_place_registered: f(self.bytes_in_place_registered, o.bytes_in_place_registered),
        }
    }

    /// Device bytes per requested byte (1.0 when nothing was requested).
    pub fn read_amplification(&self) -> f64 {
        if self.bytes_requested == 0 {
            1.0
        } else {
            self.bytes_device as f64 / self.bytes_requested as f64
        }
    }

    /// Requested bytes per second of wall time inside `read_each`.
    pub fn requested_bytes_per_s(&self) -> f64 {
        if self.wall_ns == 0 {
            0.0
        } else {
            self.bytes_requested as f64 * 1e9 / self.wall_ns as f64
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct StatsCell {
    requests: AtomicU64,
    bytes_requested: AtomicU64,
    device_reads: AtomicU64,
    bytes_device: AtomicU64,
    wall_ns: AtomicU64,
    bytes_in_place: AtomicU64,
    bytes_in_place_registered: AtomicU64,
}

impl StatsCell {
    pub(crate) fn add_requests(&self, requests: u64, bytes: u64) {
        self.requests.fetch_add(requests, Relaxed);
        self.bytes_requested.fetch_add(bytes, Relaxed);
    }

    pub(crate) fn add_device_read(&self, bytes: u64) {
        self.device_reads.fetch_add(1, Relaxed);
        self.bytes_device.fetch_add(bytes, Relaxed);
    }

    pub(crate) fn add_in_place(&self, bytes: u64) {
        self.bytes_in_place.fetch_add(bytes, Relaxed);
    }

    pub(crate) fn add_in_place_registered(&self, bytes: u64) {
        self.bytes_in_place_registered.fetch_add(bytes, Relaxed);
    }

    pub(crate) fn add_wall_since(&self, start: Instant) {
        self.wall_ns.fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> ReadStats {
        ReadStats {
            requests: self.requests.load(Relaxed),
            bytes_requested: self.bytes_requested.load(Relaxed),
            device_reads: self.device_reads.load(Relaxed),
            bytes_device: self.bytes_device.load(Relaxed),
            wall_ns: self.wall_ns.load(Relaxed),
            bytes_in_place: self.bytes_in_place.load(Relaxed),
            bytes_in_place_registered: self.bytes_in_place_registered.load(Relaxed),
        }
    }

    pub(crate) fn reset(&self) {
        for c in [
            &self.requests,
            &self.bytes_requested,
            &self.device_reads,
            &self.bytes_device,
            &self.wall_ns,
            &self.bytes_in_place,
            &self.bytes_in_place_registered,
        ] {
            c.store(0, Relaxed);
        }
    }
}
