//! Opening a `.gst` file for reading: memory-map it, check the header and index with `format`
//! (which owns every rule), and hand out byte ranges and weight views. Section checksums are
//! checked on demand (`verify`), since reading every byte defeats streaming.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{self, Header, Index, Section};
use crate::tensor::Weight;

pub struct GstFile {
    pub path: PathBuf,
    pub header: Header,
    pub index: Index,
    pub map: Arc<memmap2::Mmap>,
}

/// Whether the file starts with the `.gst` magic (so `run` can take either format by content).
pub fn is_gst(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == format::MAGIC
}

impl GstFile {
    pub fn open(path: &Path) -> Result<GstFile> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only private map of a file opened read-only. Every range handed out is
        // checked against the validated index, whose sections were checked against the file
        // length. Truncation by another process while mapped is the usual mmap hazard.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let (header, index) = format::parse_file_bytes(path, &map)?;
        Ok(GstFile {
            path: path.to_path_buf(),
            header,
            index,
            map: Arc::new(map),
        })
    }

    pub fn section_bytes(&self, s: &Section) -> &[u8] {
        &self.map[s.offset_bytes as usize..(s.offset_bytes + s.len_bytes) as usize]
    }

    fn section_named(&self, name: &str) -> Result<&Section> {
        self.index.section(name).ok_or_else(|| Error::Malformed {
            path: self.path.clone(),
            format: "gst",
            offset_bytes: self.header.index_offset_bytes,
            what: format!("the index names no section `{name}`"),
        })
    }

    /// Check every section's checksum; `progress(done_bytes, total_bytes)` after each.
    pub fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        use crate::io::{open_reader, requests_at, AlignedBuf, DirectIo, Range, ReadEngine, ReaderOptions};
        // Read, not mapped: a 40 GB file's pages would otherwise all count as this process's
        // memory and push everything else out of the page cache. Past the cache (O_DIRECT where
        // the filesystem allows), in batches of 4 reads of 8 MiB hashed in order, straight into
        // one page-aligned buffer (sections start on page boundaries, so io_uring reads their
        // whole blocks in place; its slots hold only a section's last partial block).
        const READ: usize = 8 << 20;
        const BATCH: usize = 4;
        let opts = ReaderOptions {
            direct_io: DirectIo::Optional,
            queue_depth: BATCH,
            pread_threads: BATCH,
            slot_bytes: 2 * crate::io::ALIGN_BYTES,
            ..ReaderOptions::default()
        };
        let reader = open_reader(&self.path, ReadEngine::Uring, &opts)?.reader;
        let total: u64 = self.index.sections.iter().map(|s| s.len_bytes).sum();
        let mut done = 0;
        let mut aligned = AlignedBuf::new(READ * BATCH);
        let buf = aligned.as_mut_slice();
        for s in &self.index.sections {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            let mut at = 0u64;
            while at < s.len_bytes {
                let n = (s.len_bytes - at).min((READ * BATCH) as u64) as usize;
                let (mut ranges, mut starts) = (Vec::new(), Vec::new());
                let mut k = 0;
                while k < n {
                    let len = READ.min(n - k);
                    ranges.push(Range::new(s.offset_bytes + at + k as u64, len));
                    starts.push(k);
                    k += len;
                }
                reader.read_into(&mut requests_at(&mut buf[..n], &ranges, &starts))?;
                h.update(&buf[..n]);
                at += n as u64;
                done += n as u64;
                progress(done, total);
            }
            format::verify_section_digest(&self.path, s, at, h.digest())?;
        }
        Ok(())
    }

    /// The tokenizer section's bytes, checksum-verified, and where the section starts (the
    /// model layer parses them: `gstfile` knows sections, not tokenizers).
    pub fn tokenizer_bytes(&self) -> Result<(&[u8], u64)> {
        let s = self.section_named(&self.index.tokenizer_section)?;
        let bytes = self.section_bytes(s);
        format::verify_section(&self.path, s, bytes)?;
        Ok((bytes, s.offset_bytes))
    }

    /// The tensor `name` as a `[rows, cols]` weight view, checking its shape.
    pub fn weight(&self, name: &str, rows: usize, cols: usize) -> Result<Option<Weight>> {
        let Some(t) = self.index.tensor(name) else {
            return Ok(None);
        };
        if t.rows != rows as u64 || t.cols != cols as u64 {
            return Err(Error::WrongShape {
                path: self.path.clone(),
                tensor: name.into(),
                expected: vec![rows, cols],
                found: vec![t.rows as usize, t.cols as usize],
            });
        }
        let s = self.section_named(&t.section)?;
        // The index validated that every row of the view lies inside its section.
        let offset = s.offset_bytes + t.offset_in_section_bytes;
        Ok(Some(Weight::mapped(
            name,
            t.dtype,
            rows,
            cols,
            self.map.clone(),
            offset as usize,
            t.row_stride_bytes as usize,
        )))
    }

    /// `(rows, cols)` of a tensor, if present.
    pub fn shape(&self, name: &str) -> Option<(usize, usize)> {
        self.index.tensor(name).map(|t| (t.rows as usize, t.cols as usize))
    }

    /// The calibration frequencies `[n_layers][ffn]`, when the file was calibrated.
    pub fn frequencies(&self) -> Result<Option<Vec<f32>>> {
        let Some(c) = &self.index.calibration else {
            return Ok(None);
        };
        let s = self.section_named(&c.frequencies_section)?;
        let bytes = self.section_bytes(s);
        Ok(Some(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ))
    }
}
