//! Cross-engine tests: every engine returns the same bytes for the same ranges; errors are
//! `Error::Read` naming file, offset and length; fallbacks are reported, never silent.
//!
//! Test files live under the crate's `target/` directory (a real disk here), not `/tmp`, which may
//! be tmpfs and refuse O_DIRECT.

use super::*;
use crate::error::Error;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

/// Deterministic pseudo-random numbers (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn scratch_dir() -> tempfile::TempDir {
    let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/io-test-tmp");
    std::fs::create_dir_all(&base).expect("create target/io-test-tmp");
    tempfile::Builder::new()
        .prefix("io-")
        .tempdir_in(&base)
        .expect("tempdir under target/")
}

/// A file of `len` pseudo-random bytes; returns its path and contents.
fn test_file(dir: &tempfile::TempDir, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let mut rng = Rng(seed | 1);
    let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
    let path = dir.path().join(format!("data-{seed}.bin"));
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&bytes).unwrap();
    f.sync_all().unwrap();
    (path, bytes)
}

/// Random ranges plus the edge cases: zero-length (start, middle, at EOF), the last byte, the last
/// unaligned tail, the whole file, ranges straddling block boundaries, and ranges larger than a slot.
fn test_ranges(file_len: usize, count: usize, seed: u64) -> Vec<Range> {
    let mut rng = Rng(seed | 1);
    let n = file_len as u64;
    let mut v = vec![
        Range::new(0, 0),
        Range::new(n / 2, 0),
        Range::new(n, 0),
        Range::new(n - 1, 1),
        Range::new(n - 5000, 5000),
        Range::new(0, file_len),
        Range::new(4095, 2),
        Range::new(4096, 4096),
        Range::new(8191, 70_000.min(file_len - 8191)),
    ];
    while v.len() < count {
        let len = match rng.below(4) {
            0 => rng.below(64),
            1 => rng.below(4096 * 2),
            2 => rng.below(100_000),
            _ => 4096,
        }
        .min(n) as usize;
        let offset = rng.below(n - len as u64 + 1);
        v.push(Range::new(offset, len));
    }
    v
}

/// Runs `read_each` and checks: every range reported exactly once, with exactly its bytes.
fn check_reader(name: &str, r: &dyn Reader, ranges: &[Range], expected: &[u8]) {
    let mut seen: HashMap<usize, usize> = HashMap::new();
    r.read_each(ranges, &mut |i, bytes| {
        let rg = ranges[i];
        let start = rg.offset_bytes as usize;
        assert_eq!(bytes.len(), rg.len_bytes, "{name}: range {i} {rg:?} length");
        assert!(
            bytes == &expected[start..start + rg.len_bytes],
            "{name}: range {i} {rg:?} returned wrong bytes"
        );
        *seen.entry(i).or_default() += 1;
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(seen.len(), ranges.len(), "{name}: not every range reported");
    assert!(seen.values().all(|&c| c == 1), "{name}: a range reported twice");
    // The copying form agrees too.
    let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|r| vec![0xAA; r.len_bytes]).collect();
    let mut reqs: Vec<ReadReq> = ranges
        .iter()
        .zip(bufs.iter_mut())
        .map(|(r, b)| ReadReq {
            offset_bytes: r.offset_bytes,
            buf: b,
        })
        .collect();
    r.read_into(&mut reqs).unwrap_or_else(|e| panic!("{name}: {e}"));
    for (r, b) in ranges.iter().zip(&bufs) {
        let s = r.offset_bytes as usize;
        assert!(b[..] == expected[s..s + r.len_bytes], "{name}: read_into {r:?}");
    }
    let st = r.stats();
    assert_eq!(st.requests, 2 * ranges.len() as u64, "{name}: stats.requests");
    let want: u64 = ranges.iter().map(|r| r.len_bytes as u64).sum();
    assert_eq!(st.bytes_requested, 2 * want, "{name}: stats.bytes_requested");
    assert!(st.bytes_device >= st.bytes_requested, "{name}: {st:?}");
}

#[cfg(target_os = "linux")]
fn uring(path: &Path, fixed: FixedBuffers, direct: DirectIo) -> UringReader {
    let opts = UringOptions {
        queue_depth: 8,
        fixed_buffers: fixed,
        slot_bytes: 16 * 1024, // small, so some ranges take the one-off-buffer path
        direct_io: direct,
        probe: UringProbe::Detect,
    };
    UringReader::open(path, &opts).expect("io_uring works on the Linux test machines")
}

fn pread(path: &Path, direct: DirectIo) -> PreadReader {
    let opts = PreadOptions {
        threads: 3,
        queue_depth: 5,
        direct_io: direct,
    };
    PreadReader::open(path, &opts).unwrap()
}

#[test]
fn all_engines_return_identical_bytes() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, (1 << 20) + 123, 7); // unaligned end
    let ranges = test_ranges(bytes.len(), 400, 11); // far more than any queue depth
    let mut engines: Vec<(String, Box<dyn Reader>)> = Vec::new();
    #[cfg(target_os = "linux")]
    for fixed in [FixedBuffers::On, FixedBuffers::Off] {
        for direct in [DirectIo::Optional, DirectIo::Off] {
            let r = uring(&path, fixed, direct);
            assert_eq!(
                r.fixed_buffers_active(),
                fixed == FixedBuffers::On,
                "{:?}",
                r.warnings()
            );
            engines.push((format!("uring {fixed:?} direct {direct:?}"), Box::new(r)));
        }
    }
    for direct in [DirectIo::Optional, DirectIo::Off] {
        engines.push((format!("pread direct {direct:?}"), Box::new(pread(&path, direct))));
    }
    engines.push(("mmap".into(), Box::new(MmapReader::open(&path).unwrap())));
    let short = SimFaults {
        short_reads: ShortReads::AtMost(3000),
        ..SimFaults::default()
    };
    engines.push((
        "sim memory, short reads".into(),
        Box::new(SimReader::from_bytes("mem", bytes.clone(), short.clone())),
    ));
    engines.push((
        "sim over pread, short reads".into(),
        Box::new(SimReader::wrap(Box::new(pread(&path, DirectIo::Off)), short)),
    ));
    for (name, r) in &engines {
        check_reader(name, r.as_ref(), &ranges, &bytes);
    }
}

#[test]
fn empty_file_reads_zero_length_ranges_in_every_engine() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 0, 3);
    let ranges = [Range::new(0, 0), Range::new(0, 0)];
    #[cfg(target_os = "linux")]
    check_reader(
        "uring",
        &uring(&path, FixedBuffers::On, DirectIo::Optional),
        &ranges,
        &bytes,
    );
    check_reader("pread", &pread(&path, DirectIo::Optional), &ranges, &bytes);
    check_reader("mmap", &MmapReader::open(&path).unwrap(), &ranges, &bytes);
    let err = MmapReader::open(&path).unwrap().read_vec(0, 1).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Read {
                offset_bytes: 0,
                len_bytes: 1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn mmap_slice_is_zero_copy_view_of_the_file() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 10_000, 5);
    let r = MmapReader::open(&path).unwrap();
    assert!(r.warnings().is_empty(), "{:?}", r.warnings());
    assert_eq!(r.slice(123, 4567).unwrap(), &bytes[123..123 + 4567]);
    assert_eq!(r.slice(10_000, 0).unwrap(), &[] as &[u8]);
    assert!(r.slice(9_999, 2).is_err());
}

/// Asserts `err` is a `Read` error for exactly this range whose message says `what`.
fn assert_read_error(err: &Error, path: &Path, offset: u64, len: u64, what: &str) {
    match err {
        Error::Read {
            path: p,
            offset_bytes,
            len_bytes,
            ..
        } => {
            assert_eq!((p.as_path(), *offset_bytes, *len_bytes), (path, offset, len), "{err}")
        }
        other => panic!("expected Error::Read, got {other:?}"),
    }
    let msg = err.to_string();
    for part in [
        path.display().to_string(),
        offset.to_string(),
        len.to_string(),
        what.into(),
    ] {
        assert!(msg.contains(&part), "message `{msg}` lacks `{part}`");
    }
}

#[test]
fn ranges_past_eof_are_errors_naming_the_range_in_every_engine() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 20_000, 9);
    let n = bytes.len() as u64;
    let mut engines: Vec<Box<dyn Reader>> = vec![
        Box::new(pread(&path, DirectIo::Optional)),
        Box::new(MmapReader::open(&path).unwrap()),
        Box::new(SimReader::from_bytes(&path, bytes.clone(), SimFaults::default())),
    ];
    #[cfg(target_os = "linux")]
    engines.push(Box::new(uring(&path, FixedBuffers::On, DirectIo::Optional)));
    for r in &engines {
        for (offset, len) in [(n - 10, 20usize), (n + 1, 0), (n, 1), (u64::MAX, 1)] {
            let err = r.read_vec(offset, len).unwrap_err();
            assert_read_error(&err, &path, offset, len as u64, "past the end of the file");
        }
        // A bad range anywhere in a batch fails the batch before any read is issued.
        let before = r.stats();
        let batch = [Range::new(0, 10), Range::new(n, 1)];
        assert!(r.read_each(&batch, &mut |_, _| Ok(())).is_err());
        assert_eq!(r.stats().device_reads, before.device_reads);
    }
}

#[test]
fn file_truncated_after_open_is_an_eof_error_not_short_data() {
    let dir = scratch_dir();
    let (path, _) = test_file(&dir, 64 * 1024, 13);
    let mut engines: Vec<Box<dyn Reader>> = vec![Box::new(pread(&path, DirectIo::Optional))];
    #[cfg(target_os = "linux")]
    for fixed in [FixedBuffers::On, FixedBuffers::Off] {
        engines.push(Box::new(uring(&path, fixed, DirectIo::Optional)));
        engines.push(Box::new(uring(&path, fixed, DirectIo::Off)));
    }
    // mmap is excluded on purpose: touching a truncated mapping is SIGBUS (see mmap.rs).
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(10_000)
        .unwrap();
    for r in &engines {
        let err = r.read_vec(9_000, 20_000).unwrap_err();
        assert_read_error(&err, &path, 9_000, 20_000, "ended at byte");
        let err = r.read_vec(30_000, 100).unwrap_err();
        assert_read_error(&err, &path, 30_000, 100, "ended at byte");
        assert!(r.read_vec(100, 9_000).is_ok(), "reads inside the file still work");
    }
}

#[test]
fn sim_short_reads_are_resumed_and_counted() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 50_000, 17);
    let faults = SimFaults {
        short_reads: ShortReads::AtMost(1000),
        ..SimFaults::default()
    };
    let r = SimReader::from_bytes(&path, bytes.clone(), faults);
    let ranges = [Range::new(10, 4500), Range::new(49_000, 1000), Range::new(7, 0)];
    let mut got = vec![Vec::new(); ranges.len()];
    r.read_each(&ranges, &mut |i, b| {
        got[i] = b.to_vec();
        Ok(())
    })
    .unwrap();
    for (rg, g) in ranges.iter().zip(&got) {
        let s = rg.offset_bytes as usize;
        assert_eq!(g[..], bytes[s..s + rg.len_bytes]);
    }
    let st = r.stats();
    assert_eq!(st.requests, 3);
    assert_eq!(
        st.device_reads,
        5 + 1,
        "4500 bytes in 1000-byte pieces is 5 reads, plus 1"
    );
    assert_eq!(st.bytes_device, 5500);
}

#[test]
fn sim_eio_is_a_read_error_naming_the_range_and_spares_other_ranges() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 50_000, 19);
    let faults = SimFaults {
        eio_at_bytes: vec![30_000],
        ..SimFaults::default()
    };
    // Over a real engine too, and with short reads so the EIO lands mid-resumption.
    let over_pread = SimFaults {
        short_reads: ShortReads::AtMost(777),
        ..faults.clone()
    };
    let readers: Vec<Box<dyn Reader>> = vec![
        Box::new(SimReader::from_bytes(&path, bytes.clone(), faults)),
        Box::new(SimReader::wrap(Box::new(pread(&path, DirectIo::Optional)), over_pread)),
    ];
    for r in &readers {
        let err = r.read_vec(29_000, 2_000).unwrap_err();
        assert_read_error(&err, &path, 29_000, 2_000, "Input/output error");
        match &err {
            Error::Read { cause, .. } => assert_eq!(cause.raw_os_error(), Some(EIO_ERRNO)),
            _ => unreachable!(),
        }
        // The batch stops at the failing range and returns its error.
        let batch = [Range::new(0, 100), Range::new(29_999, 2), Range::new(40_000, 10)];
        let err = r.read_each(&batch, &mut |_, _| Ok(())).unwrap_err();
        assert_read_error(&err, &path, 29_999, 2, "Input/output error");
        assert_eq!(r.read_vec(30_001, 5_000).unwrap(), bytes[30_001..35_001]);
        assert_eq!(r.read_vec(0, 30_000).unwrap(), bytes[..30_000]);
    }
}

const EIO_ERRNO: i32 = 5;

#[test]
fn sim_latency_changes_timing_not_data() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 30_000, 23);
    let faults = SimFaults {
        latency_per_read: Duration::from_millis(2),
        short_reads: ShortReads::AtMost(4096),
        ..SimFaults::default()
    };
    let r = SimReader::wrap(Box::new(MmapReader::open(&path).unwrap()), faults);
    let ranges = test_ranges(bytes.len(), 20, 29);
    let device_reads_before = r.stats().device_reads;
    assert_eq!(device_reads_before, 0);
    check_reader("sim latency", &r, &ranges, &bytes);
    let st = r.stats();
    assert!(st.wall_ns >= st.device_reads * 2_000_000, "{st:?}");
}

#[test]
fn callback_error_stops_the_batch_and_the_reader_stays_usable() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 300_000, 31);
    let ranges = test_ranges(bytes.len(), 60, 37);
    let mut engines: Vec<(String, Box<dyn Reader>)> =
        vec![("pread".into(), Box::new(pread(&path, DirectIo::Optional)))];
    #[cfg(target_os = "linux")]
    engines.push((
        "uring".into(),
        Box::new(uring(&path, FixedBuffers::On, DirectIo::Optional)),
    ));
    for (name, r) in &engines {
        let mut calls = 0;
        let err = r
            .read_each(&ranges, &mut |_, _| {
                calls += 1;
                if calls == 12 {
                    return Err(Error::Input("stop here".into()));
                }
                Ok(())
            })
            .unwrap_err();
        assert!(matches!(&err, Error::Input(m) if m == "stop here"), "{name}: {err}");
        assert_eq!(calls, 12, "{name}: no callbacks after the error");
        r.reset_stats();
        check_reader(name, r.as_ref(), &ranges, &bytes);
    }
}

/// Real devices return short reads rarely; splitting every read into 8 KiB SQEs makes the ring
/// resume every range larger than that, in every mode.
#[cfg(target_os = "linux")]
#[test]
fn uring_resumes_partial_reads_in_the_ring() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 200_000 + 77, 61);
    let ranges = test_ranges(bytes.len(), 80, 67);
    for fixed in [FixedBuffers::On, FixedBuffers::Off] {
        for direct in [DirectIo::Optional, DirectIo::Off] {
            let r = uring(&path, fixed, direct).with_sqe_bytes_max(8192);
            let name = format!("uring split {fixed:?} {direct:?}");
            check_reader(&name, &r, &ranges, &bytes);
            let min_reads: u64 = ranges.iter().map(|r| r.len_bytes.div_ceil(8192) as u64).sum();
            assert!(r.stats().device_reads >= 2 * min_reads, "{name}: {:?}", r.stats());
        }
    }
}

#[cfg(target_os = "linux")]
#[test]
fn uring_survives_a_panicking_callback_with_reads_in_flight() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 300_000, 41);
    let ranges = test_ranges(bytes.len(), 50, 43);
    let r = uring(&path, FixedBuffers::On, DirectIo::Optional);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = r.read_each(&ranges, &mut |_, _| panic!("callback bug"));
    }));
    assert!(caught.is_err());
    r.reset_stats();
    check_reader("uring after panic", &r, &ranges, &bytes);
}

#[cfg(target_os = "linux")]
#[test]
fn uring_is_shared_across_threads() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 500_000, 47);
    let r = std::sync::Arc::new(uring(&path, FixedBuffers::On, DirectIo::Optional));
    let bytes = std::sync::Arc::new(bytes);
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let (r, bytes) = (r.clone(), bytes.clone());
            std::thread::spawn(move || {
                let ranges = test_ranges(bytes.len(), 100, 100 + t);
                for rg in &ranges {
                    let s = rg.offset_bytes as usize;
                    assert_eq!(
                        r.read_vec(rg.offset_bytes, rg.len_bytes).unwrap(),
                        bytes[s..s + rg.len_bytes]
                    );
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// O_DIRECT is used when the filesystem allows it — verified on the fd with fcntl — and when it
/// does not, the reader says so. Which branch ran is printed; neither is skipped silently.
#[cfg(target_os = "linux")]
#[test]
fn uring_and_pread_use_o_direct_when_the_filesystem_allows() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 100_000, 53);
    let u = uring(&path, FixedBuffers::On, DirectIo::Optional);
    let p = pread(&path, DirectIo::Optional);
    match UringReader::open(
        &path,
        &UringOptions {
            direct_io: DirectIo::Required,
            ..UringOptions::default()
        },
    ) {
        Ok(req) => {
            eprintln!("O_DIRECT branch: {} supports direct I/O", path.display());
            assert!(req.direct_io_active() && u.direct_io_active() && p.direct_io_active());
            assert!(u.warnings().is_empty() && p.warnings().is_empty());
            // Widening to the filesystem's direct-I/O alignment (512 bytes to 4 KiB) shows up as
            // device bytes beyond the requested ones.
            let a = u.align_bytes();
            assert!(
                a.is_power_of_two() && (512..=4096).contains(&a) && a == p.align_bytes(),
                "{a}"
            );
            u.read_vec(5000, 10).unwrap();
            assert_eq!(u.stats().bytes_device, a as u64);
        }
        Err(e) => {
            eprintln!("O_DIRECT fallback branch: {e}");
            assert!(e.to_string().contains("O_DIRECT"), "{e}");
            assert!(!u.direct_io_active() && !p.direct_io_active());
            assert!(
                u.warnings().iter().any(|w| w.contains("O_DIRECT")),
                "{:?}",
                u.warnings()
            );
            assert!(
                p.warnings().iter().any(|w| w.contains("O_DIRECT")),
                "{:?}",
                p.warnings()
            );
        }
    }
    assert_eq!(u.read_vec(1, 99_999).unwrap(), bytes[1..]);
    let off = uring(&path, FixedBuffers::Off, DirectIo::Off);
    assert!(!off.direct_io_active() && off.warnings().is_empty());
}

#[test]
fn open_reader_falls_back_with_a_warning_and_still_reads() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 40_000, 59);
    let mut opts = ReaderOptions {
        queue_depth: 4,
        ..ReaderOptions::default()
    };
    #[cfg(target_os = "linux")]
    {
        opts.uring_probe = UringProbe::PretendUnavailable;
        assert!(UringReader::probe().is_ok(), "this machine has io_uring");
    }
    let opened = open_reader(&path, ReadEngine::Uring, &opts).unwrap();
    assert_eq!(opened.engine, ReadEngine::Pread);
    assert!(
        opened.warnings.iter().any(|w| w.contains("io_uring")),
        "{:?}",
        opened.warnings
    );
    assert_eq!(opened.reader.read_vec(123, 30_000).unwrap(), bytes[123..30_123]);

    let mmap = open_reader(&path, ReadEngine::Mmap, &opts).unwrap();
    assert!(
        mmap.warnings.iter().any(|w| w.contains("page cache")),
        "{:?}",
        mmap.warnings
    );
    opts.direct_io = DirectIo::Required;
    assert!(open_reader(&path, ReadEngine::Mmap, &opts).is_err());
    opts.direct_io = DirectIo::Off;
    let plain = open_reader(&path, ReadEngine::Mmap, &opts).unwrap();
    assert!(plain.warnings.is_empty());

    #[cfg(target_os = "linux")]
    {
        let opts = ReaderOptions::default();
        let u = open_reader(&path, ReadEngine::Uring, &opts).unwrap();
        assert_eq!(u.engine, ReadEngine::Uring);
        assert_eq!(u.reader.read_vec(0, 40_000).unwrap(), bytes);
    }
}

#[test]
fn in_phase_layout_puts_each_range_at_its_file_phase_within_the_bound() {
    let ranges = [
        Range::new(4096, 10_000),
        Range::new(5, 3),
        Range::new(123_456, 0),
        Range::new(8191, 4097),
        Range::new(1 << 20, 4096),
    ];
    for (base, leads) in [0usize, 16, 4095, 4096, 0x7f00_0000_1010]
        .into_iter()
        .flat_map(|b| [(b, vec![]), (b, vec![0, 5000, 1, 4096])])
    {
        let (starts, end) = in_phase_starts(base, &ranges, &leads);
        assert!(end <= in_phase_len_max(&ranges, &leads), "base {base}: {end}");
        let mut prev_end = 0;
        for (i, (r, &s)) in ranges.iter().zip(&starts).enumerate() {
            let lead = leads.get(i).copied().unwrap_or(0);
            assert!(
                s >= prev_end + lead && s - prev_end - lead < ALIGN_BYTES,
                "base {base}: {r:?} at {s}"
            );
            assert_eq!(
                (base + s) % ALIGN_BYTES,
                r.offset_bytes as usize % ALIGN_BYTES,
                "base {base}: {r:?}"
            );
            prev_end = s + r.len_bytes;
        }
        assert_eq!(end, prev_end);
    }
}

/// `read_into` on io_uring: buffers laid out in phase with the file get their whole blocks read
/// in place (counted), the partial blocks at their ends and buffers out of phase through the
/// slots; every byte right, with and without fixed buffers, O_DIRECT and resumed short reads.
#[cfg(target_os = "linux")]
#[test]
fn uring_read_into_lands_whole_blocks_in_place() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 300_000 + 123, 71);
    let mut ranges = test_ranges(bytes.len(), 60, 73);
    ranges.retain(|r| r.len_bytes > 0);
    for fixed in [FixedBuffers::On, FixedBuffers::Off] {
        for direct in [DirectIo::Optional, DirectIo::Off] {
            for sqe in [None, Some(8192)] {
                let mut r = uring(&path, fixed, direct);
                if let Some(b) = sqe {
                    r = r.with_sqe_bytes_max(b);
                }
                let name = format!("uring {fixed:?} {direct:?} sqe {sqe:?}");
                let a = r.align_bytes();
                // In phase: one buffer, each range at its file phase; the expected in-place bytes
                // are each range's whole blocks.
                let mut buf = vec![0xAAu8; in_phase_len_max(&ranges, &[])];
                let (starts, _) = in_phase_starts(buf.as_ptr() as usize, &ranges, &[]);
                let mut want_in_place = 0u64;
                for rg in &ranges {
                    let (o, e) = (rg.offset_bytes as usize, rg.offset_bytes as usize + rg.len_bytes);
                    let (lo, hi) = (o.div_ceil(a) * a, e / a * a);
                    want_in_place += hi.saturating_sub(lo) as u64;
                }
                r.read_into(&mut requests_at(&mut buf, &ranges, &starts))
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                for (rg, &s) in ranges.iter().zip(&starts) {
                    let o = rg.offset_bytes as usize;
                    assert!(buf[s..s + rg.len_bytes] == bytes[o..o + rg.len_bytes], "{name}: {rg:?}");
                }
                let st = r.stats();
                assert_eq!(st.bytes_in_place, want_in_place, "{name}: {st:?}");
                assert!(want_in_place > 0, "{name}: the ranges exercise the in-place path");
                // Out of phase by one byte: nothing in place (when O_DIRECT needs alignment), the
                // same bytes.
                r.reset_stats();
                let mut bufs: Vec<Vec<u8>> = ranges.iter().map(|rg| vec![0x55; rg.len_bytes + 1]).collect();
                let mut reqs: Vec<ReadReq> = ranges
                    .iter()
                    .zip(bufs.iter_mut())
                    .map(|(rg, b)| {
                        let skip = !(b.as_ptr() as usize + 1)
                            .wrapping_sub(rg.offset_bytes as usize)
                            .is_multiple_of(a);
                        let b = if skip { &mut b[1..] } else { &mut b[..rg.len_bytes] };
                        ReadReq {
                            offset_bytes: rg.offset_bytes,
                            buf: &mut b[..rg.len_bytes],
                        }
                    })
                    .collect();
                r.read_into(&mut reqs).unwrap_or_else(|e| panic!("{name}: {e}"));
                for (rg, q) in ranges.iter().zip(&reqs) {
                    let o = rg.offset_bytes as usize;
                    assert!(q.buf[..] == bytes[o..o + rg.len_bytes], "{name}: out of phase {rg:?}");
                }
                if a > 1 {
                    assert_eq!(r.stats().bytes_in_place, 0, "{name}");
                }
            }
        }
    }
}

/// A read into a caller's buffer that fails (the file shrank after it was opened) returns the
/// error naming the range, with every read of the batch completed, and the reader still works.
#[cfg(target_os = "linux")]
#[test]
fn uring_read_into_in_place_reports_eof_and_stays_usable() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 256 * 1024, 79);
    for fixed in [FixedBuffers::On, FixedBuffers::Off] {
        let r = uring(&path, fixed, DirectIo::Optional);
        let ranges = [
            Range::new(0, 100_000),
            Range::new(131_072, 120_000),
            Range::new(8192, 4096),
        ];
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(200_000)
            .unwrap();
        let mut buf = vec![0u8; in_phase_len_max(&ranges, &[])];
        let (starts, _) = in_phase_starts(buf.as_ptr() as usize, &ranges, &[]);
        let mut reqs = requests_at(&mut buf, &ranges, &starts);
        let err = r.read_into(&mut reqs).unwrap_err();
        assert!(err.to_string().contains("ended at byte"), "{err}");
        // Restore the file for the next round and read again through the same reader.
        std::fs::write(&path, &bytes).unwrap();
        let mut out = vec![0u8; 100_000];
        r.read_into(&mut [ReadReq {
            offset_bytes: 0,
            buf: &mut out,
        }])
        .unwrap();
        assert!(out == bytes[..100_000]);
    }
}

/// Memory registered with the io_uring reader is read into with the fixed-buffer opcode (counted
/// apart); the same bytes land either way; the registration ends with its guard, the table has
/// room for a few entries, and without fixed buffers nothing registers.
#[cfg(target_os = "linux")]
#[test]
fn uring_reads_into_registered_memory_as_fixed_buffers() {
    let dir = scratch_dir();
    let (path, bytes) = test_file(&dir, 400_000 + 5, 83);
    let ranges = [
        Range::new(0, 150_000),
        Range::new(4096 * 40 + 100, 90_000),
        Range::new(300_000, 100_005),
    ];
    let read = |r: &UringReader, buf: &mut Vec<u8>| {
        let (starts, _) = in_phase_starts(buf.as_ptr() as usize, &ranges, &[]);
        let mut reqs = requests_at(buf, &ranges, &starts);
        r.reset_stats();
        r.read_into(&mut reqs).unwrap();
        for (rg, q) in ranges.iter().zip(&reqs) {
            let o = rg.offset_bytes as usize;
            assert!(q.buf[..] == bytes[o..o + rg.len_bytes], "{rg:?}");
        }
        r.stats()
    };
    for sqe in [None, Some(8192)] {
        let mut r = uring(&path, FixedBuffers::On, DirectIo::Optional);
        if let Some(b) = sqe {
            r = r.with_sqe_bytes_max(b);
        }
        let mut buf = vec![0u8; in_phase_len_max(&ranges, &[])];
        // SAFETY: `buf` is neither freed nor reallocated before `guard` drops (below).
        let guard = unsafe { r.register(&mut buf) }.expect("a kernel with sparse buffer tables (5.19+)");
        let st = read(&r, &mut buf);
        assert!(
            st.bytes_in_place > 0 && st.bytes_in_place_registered == st.bytes_in_place,
            "{st:?}"
        );
        drop(guard);
        let st = read(&r, &mut buf);
        assert!(
            st.bytes_in_place > 0 && st.bytes_in_place_registered == 0,
            "after the guard: {st:?}"
        );
        // Room for a few entries; a freed entry is taken again.
        let mut bufs: Vec<Vec<u8>> = (0..12).map(|_| vec![0u8; 8192]).collect();
        // SAFETY: `bufs` outlive `guards` (dropped first, below) and are never resized.
        let mut guards: Vec<Registration> = bufs.iter_mut().filter_map(|b| unsafe { r.register(b) }).collect();
        assert!(guards.len() >= 2 && guards.len() < 12, "{} entries", guards.len());
        guards.pop();
        // SAFETY: as above.
        guards.push(unsafe { r.register(&mut buf) }.expect("the entry just freed"));
        let st = read(&r, &mut buf);
        assert_eq!(st.bytes_in_place_registered, st.bytes_in_place, "{st:?}");
        drop(guards);
    }
    let off = uring(&path, FixedBuffers::Off, DirectIo::Optional);
    let mut buf = vec![0u8; 4096];
    // SAFETY: nothing is registered.
    assert!(unsafe { off.register(&mut buf) }.is_none());
}

/// `read_vec` reads a large range in pieces of at most `READ_VEC_PIECE_BYTES` (each piece is one
/// reader buffer, so loading a large matrix never holds a second copy of it whole), and every
/// engine returns the same bytes for it, and for `read_stream`'s pipeline of requests.
#[test]
fn read_vec_reads_in_pieces_and_read_stream_in_any_engine() {
    let dir = scratch_dir();
    let len = 2 * super::READ_VEC_PIECE_BYTES + 12345;
    let (path, expected) = test_file(&dir, len + 8192, 77);
    let sim = SimReader::from_bytes("sim", expected.clone(), SimFaults::default());
    let got = sim.read_vec(4096, len).unwrap();
    assert!(got == expected[4096..4096 + len]);
    assert_eq!(sim.stats().requests, 3, "{:?}", sim.stats());
    let readers: Vec<Box<dyn Reader>> = vec![
        Box::new(uring(&path, FixedBuffers::On, DirectIo::Optional)),
        Box::new(pread(&path, DirectIo::Optional)),
        Box::new(sim),
    ];
    for r in &readers {
        assert!(r.read_vec(100, len).unwrap() == expected[100..100 + len]);
        // A stream of requests into one buffer, some in phase with the file and some not.
        let mut buf = vec![0u8; len];
        let base = buf.as_mut_ptr();
        let cuts = [
            (0usize, 5000usize),
            (5000, 1 << 20),
            ((1 << 20) + 5000, len - (1 << 20) - 5000),
        ];
        let mut i = 0;
        let mut done = Vec::new();
        // SAFETY: each request points into `buf`, which outlives the call and is not touched
        // until it returns.
        unsafe {
            r.read_stream(
                &mut |_| {
                    let (at, n) = *cuts.get(i)?;
                    i += 1;
                    Some(super::StreamReq {
                        offset_bytes: 3 + at as u64,
                        len_bytes: n,
                        dest: base.add(at),
                        tag: at as u64,
                    })
                },
                &mut |tag, res| done.push((tag, res.is_ok())),
            )
        }
        .unwrap();
        done.sort();
        assert_eq!(done, cuts.iter().map(|c| (c.0 as u64, true)).collect::<Vec<_>>());
        assert!(buf == expected[3..3 + len]);
    }
}
