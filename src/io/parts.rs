//! A model stored in several files (a Hugging Face folder's shards) read as one: each file has a
//! place in one byte space ([`FilePart::base_bytes`], a multiple of [`PART_ALIGN_BYTES`], so an
//! offset keeps its phase modulo the disk's block), and [`PartsReader`] sends each range to the
//! reader of the file holding it. A range never spans two files (a tensor lies in one).

use std::path::{Path, PathBuf};

use super::{open_reader, OnDone, OpenedReader, Range, ReadEngine, ReadReq, ReadStats, Reader, ReaderOptions};
use super::{NextReq, Registration, ReqDone, StreamReq};
use crate::error::{Error, Result};

/// Where each file's place in the byte space starts: a multiple of this (1 MiB), after the
/// previous file's end.
pub const PART_ALIGN_BYTES: u64 = 1 << 20;

/// One file of a model, at its place in the model's byte space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FilePart {
    pub path: PathBuf,
    /// Where byte 0 of the file is in the model's byte space.
    pub base_bytes: u64,
    pub len_bytes: u64,
}

/// Places `files` (path, length) one after another, each at a multiple of
/// [`PART_ALIGN_BYTES`].
pub fn place_parts(files: &[(PathBuf, u64)]) -> Vec<FilePart> {
    let mut at = 0u64;
    files
        .iter()
        .map(|(path, len)| {
            let p = FilePart {
                path: path.clone(),
                base_bytes: at,
                len_bytes: *len,
            };
            at = (at + len).div_ceil(PART_ALIGN_BYTES) * PART_ALIGN_BYTES;
            p
        })
        .collect()
}

/// Opens a reader over `parts` with `engine`: the file's own reader when there is one part at
/// place 0, else a [`PartsReader`] over one reader per file (`name`: what its messages call
/// the whole, e.g. the model's folder).
pub fn open_parts_reader(
    name: &Path,
    parts: &[FilePart],
    engine: ReadEngine,
    opts: &ReaderOptions,
) -> Result<OpenedReader> {
    match parts {
        [one] if one.base_bytes == 0 => open_reader(&one.path, engine, opts),
        [] => Err(Error::Internal(format!("{}: no files to read", name.display()))),
        _ => {
            let mut readers = Vec::with_capacity(parts.len());
            let (mut engine_used, mut direct_io_active, mut warnings) = (engine, true, Vec::new());
            for p in parts {
                let o = open_reader(&p.path, engine, opts)?;
                engine_used = o.engine;
                direct_io_active &= o.direct_io_active;
                warnings.extend(o.warnings);
                readers.push(o.reader);
            }
            Ok(OpenedReader {
                reader: Box::new(PartsReader::new(name, parts, readers)?),
                engine: engine_used,
                direct_io_active,
                warnings,
            })
        }
    }
}

/// Reads up to `bytes` from the middle of the largest of `parts` (large requests in flight
/// together, in phase, O_DIRECT where the file system allows) and returns the rate in bytes a
/// second and whether the reads bypassed the page cache.
pub fn measure_read_rate(name: &Path, parts: &[FilePart], bytes: usize) -> Result<(f64, bool)> {
    use super::{lay_pieces_in_phase, requests_at};
    const PIECE: usize = 4 << 20;
    let Some(p) = parts.iter().max_by_key(|p| p.len_bytes) else {
        return Ok((0.0, false));
    };
    let len = (bytes as u64).min(p.len_bytes) as usize;
    let start = p.base_bytes + (p.len_bytes - len as u64) / 2 / 4096 * 4096;
    let ranges: Vec<Range> = (0..len.div_ceil(PIECE))
        .map(|i| Range::new(start + (i * PIECE) as u64, PIECE.min(len - i * PIECE)))
        .collect();
    let opts = ReaderOptions {
        queue_depth: ranges.len().clamp(1, 64),
        ..ReaderOptions::default()
    };
    let o = open_parts_reader(name, parts, ReadEngine::Uring, &opts)?;
    let mut buf = Vec::new();
    let starts = lay_pieces_in_phase(&mut buf, &ranges);
    let t = std::time::Instant::now();
    o.reader.read_into(&mut requests_at(&mut buf, &ranges, &starts))?;
    let s = t.elapsed().as_secs_f64().max(1e-9);
    Ok((len as f64 / s, o.direct_io_active))
}

/// A part's ranges of a batch: the part, the ranges' indices in the batch, the ranges in its file.
type PartRanges = (usize, Vec<usize>, Vec<Range>);

/// Reads a byte space made of several files ([`FilePart`]s), each through a reader of its own.
pub struct PartsReader {
    name: PathBuf,
    parts: Vec<FilePart>,
    readers: Vec<Box<dyn Reader>>,
    len_bytes: u64,
}

impl PartsReader {
    /// `readers[i]` reads `parts[i]`'s file; the parts are in increasing, non-overlapping places.
    pub fn new(name: &Path, parts: &[FilePart], readers: Vec<Box<dyn Reader>>) -> Result<PartsReader> {
        let ordered = parts
            .windows(2)
            .all(|w| w[0].base_bytes + w[0].len_bytes <= w[1].base_bytes);
        if !ordered || readers.len() != parts.len() {
            return Err(Error::Internal(format!(
                "{}: file parts out of order or without readers",
                name.display()
            )));
        }
        Ok(PartsReader {
            name: name.to_path_buf(),
            len_bytes: parts.last().map_or(0, |p| p.base_bytes + p.len_bytes),
            parts: parts.to_vec(),
            readers,
        })
    }

    /// The part holding `r` whole, and `r` as an offset in its file.
    fn locate(&self, r: Range) -> Result<(usize, Range)> {
        let i = self.parts.partition_point(|p| p.base_bytes <= r.offset_bytes);
        let found = i.checked_sub(1).and_then(|i| {
            let p = &self.parts[i];
            let local = r.offset_bytes - p.base_bytes;
            (local.checked_add(r.len_bytes as u64)? <= p.len_bytes).then_some((i, Range::new(local, r.len_bytes)))
        });
        found.ok_or_else(|| Error::Read {
            path: self.name.clone(),
            offset_bytes: r.offset_bytes,
            len_bytes: r.len_bytes as u64,
            cause: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "the range does not lie within one of the model's {} files (their places: {})",
                    self.parts.len(),
                    self.parts
                        .iter()
                        .map(|p| format!(
                            "{} at {}..{}",
                            p.path.file_name().unwrap_or_default().to_string_lossy(),
                            p.base_bytes,
                            p.base_bytes + p.len_bytes
                        ))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ),
        })
    }

    /// Each range's part and place in its file, grouped by part (the parts in order, each with
    /// the ranges' batch indices).
    fn group(&self, ranges: &[Range]) -> Result<Vec<PartRanges>> {
        let mut groups: Vec<PartRanges> = Vec::new();
        for (i, &r) in ranges.iter().enumerate() {
            let (part, local) = self.locate(r)?;
            match groups.iter_mut().find(|g| g.0 == part) {
                Some(g) => {
                    g.1.push(i);
                    g.2.push(local);
                }
                None => groups.push((part, vec![i], vec![local])),
            }
        }
        groups.sort_by_key(|g| g.0);
        Ok(groups)
    }
}

impl Reader for PartsReader {
    fn read_each(&self, ranges: &[Range], on_done: &mut OnDone<'_>) -> Result<()> {
        for (part, indices, local) in self.group(ranges)? {
            self.readers[part].read_each(&local, &mut |j, bytes| on_done(indices[j], bytes))?;
        }
        Ok(())
    }

    fn read_into(&self, reqs: &mut [ReadReq<'_>]) -> Result<()> {
        let ranges: Vec<Range> = reqs.iter().map(|r| Range::new(r.offset_bytes, r.buf.len())).collect();
        for (part, indices, local) in self.group(&ranges)? {
            // Each request's buffer lent to the part's reader, then given back.
            let mut sub: Vec<ReadReq<'_>> = indices
                .iter()
                .zip(&local)
                .map(|(&i, l)| ReadReq {
                    offset_bytes: l.offset_bytes,
                    buf: std::mem::take(&mut reqs[i].buf),
                })
                .collect();
            let result = self.readers[part].read_into(&mut sub);
            for (&i, s) in indices.iter().zip(sub) {
                reqs[i].buf = s.buf;
            }
            result?;
        }
        Ok(())
    }

    /// One stream per run of requests in the same file: the first request for another file
    /// waits until the reads in flight are reaped, then starts that file's stream.
    unsafe fn read_stream(&self, next: &mut NextReq<'_>, done: &mut ReqDone<'_>) -> Result<()> {
        let Some(mut pending) = next(true) else {
            return Ok(());
        };
        loop {
            let first = pending;
            let (part, local) = match self.locate(Range::new(first.offset_bytes, first.len_bytes)) {
                Ok(found) => found,
                Err(e) => {
                    done(first.tag, Err(e));
                    match next(true) {
                        Some(r) => {
                            pending = r;
                            continue;
                        }
                        None => return Ok(()),
                    }
                }
            };
            let mut after: Option<StreamReq> = None;
            let mut first = Some(StreamReq {
                offset_bytes: local.offset_bytes,
                ..first
            });
            let base = self.parts[part].base_bytes;
            let mut next_here = |idle: bool| -> Option<StreamReq> {
                if let Some(r) = first.take() {
                    return Some(r);
                }
                if after.is_some() {
                    return None;
                }
                let r = next(idle)?;
                match self.locate(Range::new(r.offset_bytes, r.len_bytes)) {
                    Ok((p, _)) if p == part => Some(StreamReq {
                        offset_bytes: r.offset_bytes - base,
                        ..r
                    }),
                    // Another file's (or none's): after this stream ends.
                    _ => {
                        after = Some(r);
                        None
                    }
                }
            };
            // SAFETY: the requests are the caller's, each with its destination as given (only
            // the offset is made the file's own), so the caller's guarantee carries over.
            unsafe { self.readers[part].read_stream(&mut next_here, done)? };
            // The stream ended on a request for another file, or on the caller's end.
            match after {
                Some(r) => pending = r,
                None => return Ok(()),
            }
        }
    }

    fn path(&self) -> &Path {
        &self.name
    }

    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    fn stats(&self) -> ReadStats {
        self.readers
            .iter()
            .fold(ReadStats::default(), |a, r| a.combine(&r.stats(), 1))
    }

    fn reset_stats(&self) {
        self.readers.iter().for_each(|r| r.reset_stats());
    }

    fn align_bytes(&self) -> usize {
        self.readers.iter().map(|r| r.align_bytes()).max().unwrap_or(1)
    }

    unsafe fn register(&self, bytes: &mut [u8]) -> Option<Registration> {
        // SAFETY: the caller keeps `bytes` in place until the returned guard is dropped, and the
        // guard holds every part reader's registration.
        let guards: Vec<Registration> = self
            .readers
            .iter()
            .filter_map(|r| unsafe { r.register(bytes) })
            .collect();
        (!guards.is_empty()).then(|| Registration::new(move || drop(guards)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{requests_at, ReaderOptions};

    /// Three files of a known pattern, their parts and a reader over them with `engine`.
    fn three(dir: &Path, engine: ReadEngine) -> (Vec<FilePart>, Vec<Vec<u8>>, Box<dyn Reader>) {
        let mut files = Vec::new();
        let mut contents = Vec::new();
        for (i, len) in [10_000usize, 5_000, 70_000].into_iter().enumerate() {
            let bytes: Vec<u8> = (0..len).map(|j| (j * 7 + i * 31) as u8).collect();
            let p = dir.join(format!("part{i}"));
            std::fs::write(&p, &bytes).unwrap();
            files.push((p, len as u64));
            contents.push(bytes);
        }
        let parts = place_parts(&files);
        let r = open_parts_reader(dir, &parts, engine, &ReaderOptions::default())
            .unwrap()
            .reader;
        (parts, contents, r)
    }

    #[test]
    fn parts_are_placed_in_phase_and_ranges_read_from_their_file() {
        let tmp = tempfile::tempdir().unwrap();
        for engine in [ReadEngine::Uring, ReadEngine::Pread, ReadEngine::Mmap] {
            let (parts, contents, r) = three(tmp.path(), engine);
            assert_eq!(
                parts.iter().map(|p| p.base_bytes).collect::<Vec<_>>(),
                [0, PART_ALIGN_BYTES, 2 * PART_ALIGN_BYTES]
            );
            assert_eq!(r.len_bytes(), 2 * PART_ALIGN_BYTES + 70_000);
            let want = |part: usize, at: usize, n: usize| contents[part][at..at + n].to_vec();
            let ranges = [
                Range::new(2 * PART_ALIGN_BYTES + 4_097, 60_000),
                Range::new(3, 9_000),
                Range::new(PART_ALIGN_BYTES + 100, 4_900),
                Range::new(PART_ALIGN_BYTES, 0),
            ];
            let expect = [
                want(2, 4_097, 60_000),
                want(0, 3, 9_000),
                want(1, 100, 4_900),
                Vec::new(),
            ];
            let mut seen = vec![None; ranges.len()];
            r.read_each(&ranges, &mut |i, b| {
                seen[i] = Some(b.to_vec());
                Ok(())
            })
            .unwrap();
            for (i, s) in seen.into_iter().enumerate() {
                assert_eq!(s.as_deref(), Some(&expect[i][..]), "{engine:?} range {i}");
            }
            // Into caller memory, in phase (io_uring reads the whole blocks in place).
            let mut buf = Vec::new();
            let starts = crate::io::lay_pieces_in_phase(&mut buf, &ranges);
            r.read_into(&mut requests_at(&mut buf, &ranges, &starts)).unwrap();
            for (i, &s) in starts.iter().enumerate() {
                assert_eq!(
                    &buf[s..s + ranges[i].len_bytes],
                    &expect[i][..],
                    "{engine:?} into, range {i}"
                );
            }
            // As a stream switching files.
            let mut out: Vec<Vec<u8>> = ranges.iter().map(|r| vec![0u8; r.len_bytes]).collect();
            let reqs: Vec<StreamReq> = ranges
                .iter()
                .zip(out.iter_mut())
                .enumerate()
                .map(|(i, (r, o))| StreamReq {
                    offset_bytes: r.offset_bytes,
                    len_bytes: r.len_bytes,
                    dest: o.as_mut_ptr(),
                    tag: i as u64,
                })
                .collect();
            let mut queue = reqs.into_iter();
            let mut finished = Vec::new();
            // SAFETY: each destination is its own vector, untouched until the stream returns.
            unsafe {
                r.read_stream(&mut |_| queue.next(), &mut |tag, res| {
                    res.unwrap();
                    finished.push(tag)
                })
            }
            .unwrap();
            finished.sort();
            assert_eq!(finished, [0, 1, 2, 3]);
            assert_eq!(out, expect, "{engine:?} stream");
            assert_eq!(r.stats().bytes_requested, 3 * (60_000 + 9_000 + 4_900));
        }
    }

    #[test]
    fn a_range_between_or_across_files_is_an_error_naming_them() {
        let tmp = tempfile::tempdir().unwrap();
        let (_, _, r) = three(tmp.path(), ReadEngine::Pread);
        for bad in [
            Range::new(9_000, 2_000),
            Range::new(20_000, 10),
            Range::new(3 * PART_ALIGN_BYTES, 1),
        ] {
            let e = r.read_vec(bad.offset_bytes, bad.len_bytes).unwrap_err().to_string();
            assert!(
                e.contains("part0 at 0..10000") && e.contains(&bad.offset_bytes.to_string()),
                "{e}"
            );
        }
    }
}
