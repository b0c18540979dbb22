//! Writing a `.gst` file safely: sections stream into a temporary file in the target directory
//! (aligned as `format::plan_layout` lays them out, hashed as they go), then the index and finally
//! the header are written, the file is fsynced and renamed over the target. Until the rename the
//! target is untouched; until the header is written the temporary file has no magic, so a crash
//! at any point never leaves a file that passes validation. Dropping an unfinished writer removes
//! the temporary file.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::{self, Index, Section, TensorView, ALIGN_BYTES, HEADER_BYTES};
use crate::quant::GgmlType;

pub struct GstWriter {
    target: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
    pos_bytes: u64,
    offsets: Vec<u64>,
    lens: Vec<u64>,
    checksums: Vec<String>,
    pub sections: Vec<Section>,
    pub tensors: Vec<TensorView>,
}

impl GstWriter {
    /// Start writing `target`; refuses to replace an existing file unless `force`.
    pub fn create(target: &Path, force: bool) -> Result<GstWriter> {
        if target.exists() && !force {
            return Err(Error::Input(format!(
                "{} already exists; pass --force to replace it",
                target.display()
            )));
        }
        let dir = match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("model.gst");
        let tmp = dir.join(format!(".{name}.partial-{}", std::process::id()));
        let mut file = File::create(&tmp).map_err(|e| {
            Error::Input(format!(
                "cannot write {}: creating its temporary file in {} failed ({e}); is the folder there and writable?",
                target.display(),
                dir.display()
            ))
        })?;
        // The header page stays zero (no magic) until everything else is on disk.
        file.write_all(&vec![0u8; HEADER_BYTES as usize])
            .map_err(|e| Error::io(&tmp, e))?;
        Ok(GstWriter {
            target: target.to_path_buf(),
            tmp,
            file: Some(file),
            pos_bytes: HEADER_BYTES,
            offsets: Vec::new(),
            lens: Vec::new(),
            checksums: Vec::new(),
            sections: Vec::new(),
            tensors: Vec::new(),
        })
    }

    fn io(&self, e: std::io::Error) -> Error {
        Error::io(&self.tmp, e)
    }

    /// Append a section (at the next aligned offset) from its bytes.
    pub fn section(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let start = self.pos_bytes.next_multiple_of(ALIGN_BYTES);
        let pad = (start - self.pos_bytes) as usize;
        let file = self.file.as_mut().expect("writer is open");
        let r = file.write_all(&vec![0u8; pad]).and_then(|_| file.write_all(bytes));
        r.map_err(|e| self.io(e))?;
        self.pos_bytes = start + bytes.len() as u64;
        self.offsets.push(start);
        self.lens.push(bytes.len() as u64);
        self.checksums.push(format::checksum_hex(bytes));
        self.sections.push(Section {
            name: name.into(),
            offset_bytes: 0,
            len_bytes: 0,
            xxh3: String::new(),
        });
        Ok(())
    }

    /// Append a section holding one matrix (or vector, `rows == 1`) stored contiguously.
    pub fn matrix(&mut self, name: &str, dtype: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> Result<()> {
        let row_bytes = dtype
            .row_bytes(cols)
            .ok_or_else(|| Error::Internal(format!("{name}: bad row size")))?;
        if bytes.len() != rows * row_bytes {
            return Err(Error::Internal(format!(
                "{name}: {} bytes for {rows}x{cols} {}",
                bytes.len(),
                dtype.name()
            )));
        }
        self.section(name, bytes)?;
        self.view(name, name, 0, dtype, rows, cols, row_bytes);
        Ok(())
    }

    /// Record a tensor view into an already written section.
    #[allow(clippy::too_many_arguments)]
    pub fn view(
        &mut self,
        name: &str,
        section: &str,
        offset_in_section_bytes: usize,
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        row_stride_bytes: usize,
    ) {
        self.tensors.push(TensorView {
            name: name.into(),
            section: section.into(),
            offset_in_section_bytes: offset_in_section_bytes as u64,
            dtype,
            rows: rows as u64,
            cols: cols as u64,
            row_stride_bytes: row_stride_bytes as u64,
        });
    }

    /// Write the index and header, fsync, and rename over the target. Returns the file length.
    pub fn finish(mut self, mut index: Index) -> Result<u64> {
        index.sections = std::mem::take(&mut self.sections);
        index.tensors = std::mem::take(&mut self.tensors);
        let planned = format::plan_layout(&mut index, &self.lens, &self.checksums)?;
        if planned.section_offsets != self.offsets {
            return Err(Error::Internal(format!(
                "the layout plan placed sections at {:?}, the writer at {:?}",
                &planned.section_offsets[..planned.section_offsets.len().min(4)],
                &self.offsets[..self.offsets.len().min(4)]
            )));
        }
        let index_at = planned.header.index_offset_bytes;
        let pad = (index_at - self.pos_bytes) as usize;
        let file = self.file.as_mut().expect("writer is open");
        let r = (|| -> std::io::Result<()> {
            file.write_all(&vec![0u8; pad])?;
            file.write_all(&planned.index_bytes)?;
            file.sync_all()?;
            file.seek(SeekFrom::Start(0))?;
            file.write_all(&planned.header.to_bytes())?;
            file.sync_all()
        })();
        r.map_err(|e| Error::io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.target).map_err(|e| Error::io(&self.target, e))?;
        // Renamed: nothing left for Drop to clean up.
        self.file = None;
        if let Some(dir) = self.target.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Make the rename itself durable; failure to open a directory is not fatal.
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(planned.header.file_len_bytes)
    }
}

impl Drop for GstWriter {
    fn drop(&mut self) {
        // Still open means `finish` never ran: remove the partial file.
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}
