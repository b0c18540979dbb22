//! Tensors and their storage: a `Weight` is a 2-D matrix `[rows, cols]` whose rows run along
//! the input dimension (so quantization blocks stay whole) and whose bytes live wherever the
//! source put them: a memory map of the model file by default, so nothing assumes the whole model
//! is in RAM. This module is a leaf: it knows element types and bytes, never files, architectures
//! or arithmetic (the dequantization of one row is the only decoding it does, for embeddings and
//! tests). Every other layer — readers of model files, the forward pass, the backends, the
//! streamer — names weights through it, which is what keeps the module graph free of circles.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::quant::{dequantize_row, GgmlType};

#[derive(Clone)]
enum Storage {
    Mapped(Arc<memmap2::Mmap>),
    Owned(Arc<Vec<u8>>),
    /// Only the place in the file is known: the bytes are read through a stream (a model opened
    /// for streaming keeps no view of its matrices, so nothing can read them past the budget).
    OnDisk,
    /// Host memory a device staged rows in for its own copies (`backend::HostLink::begin_upload`).
    Staged(Arc<dyn StagedBytes>),
}

/// Host bytes a device staged and copied to its memory (page-locked on CUDA), or mapped to read
/// in place: readable on the host like any buffer; the device that staged or mapped them finds
/// its copy or its address through [`Weight::home`], instead of copying them again.
pub trait StagedBytes: std::any::Any + Send + Sync {
    fn bytes(&self) -> &[u8];

    /// Host memory a device mapped (`backend::HostLink::in_place`): that device and the device
    /// address of the first of [`StagedBytes::bytes`].
    fn mapped(&self) -> Option<(u64, u64)> {
        None
    }

    /// Where device `device` holds its copy of `bytes` (a view of these), when it staged them:
    /// its address, or why it cannot be used (part of them was never sent); `None` for another
    /// device's staging.
    fn device_address(&self, _device: u64, _bytes: &[u8]) -> Option<std::result::Result<u64, String>> {
        None
    }
}

/// Where a weight's bytes live ([`Weight::home`]): what a device with memory of its own matches
/// on to read them in place, find the copy it staged, or copy them.
pub enum Home<'a> {
    /// On disk: only a stream can read them.
    OnDisk,
    /// This process's memory (its own, or a map of the model file).
    Host,
    /// Host memory device `device` mapped: it reads the weight in place, row 0 at `address`.
    Mapped { device: u64, address: u64 },
    /// Host memory a device staged the bytes in for its own copy.
    Staged(&'a dyn StagedBytes),
}

/// A matrix `[rows, cols]` in `ty`; row `r` is `row_bytes` bytes at
/// `offset_bytes + r * row_stride_bytes` of its storage. Rows are usually contiguous
/// (`row_stride_bytes == row_bytes`); in a bundled `.gst` FFN section up rows and down columns
/// interleave, so each is a strided view of the same bytes.
#[derive(Clone)]
pub struct Weight {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub row_stride_bytes: usize,
    storage: Storage,
    offset_bytes: usize,
    /// The bytes sit in a buffer the streaming path refills (staging, cache slots, the current
    /// layer's read buffer): a device with memory of its own copies them at each use and never
    /// keeps a copy by address, which could outlive the bytes it was made of.
    volatile: bool,
    /// What a volatile weight's bytes are, where the stream can name them (a routed expert:
    /// its stream and its place in the file): the same key always holds the same bytes, so a
    /// device may keep a copy by it ([`Weight::keyed`]).
    content: Option<(u64, u64)>,
}

impl Weight {
    /// A weight held in memory (tests, converted tensors).
    pub fn owned(name: &str, ty: GgmlType, rows: usize, cols: usize, bytes: Vec<u8>) -> Result<Weight> {
        if ty.row_bytes(cols).and_then(|r| r.checked_mul(rows)) != Some(bytes.len()) {
            return Err(Error::Internal(format!(
                "{name}: {} bytes for {rows}x{cols} {ty:?}",
                bytes.len()
            )));
        }
        Weight::shared(name, ty, rows, cols, Arc::new(bytes), 0)
    }

    /// Rows staged for a device (see [`StagedBytes`]), packed from byte 0; volatile, as every
    /// staged buffer is reused.
    pub fn staged(name: &str, ty: GgmlType, rows: usize, cols: usize, bytes: Arc<dyn StagedBytes>) -> Result<Weight> {
        let len = bytes.bytes().len();
        let stride = ty.row_bytes(cols).unwrap_or(0);
        Weight::over(name, ty, rows, cols, Storage::Staged(bytes), len, 0, stride).map(Weight::volatile)
    }

    /// The first `rows` rows of a shared buffer (the streaming path's staging and prefetch
    /// buffers, reused across tokens); `offset_bytes` is where row 0 starts in it.
    pub fn shared(
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: Arc<Vec<u8>>,
        offset_bytes: usize,
    ) -> Result<Weight> {
        // Packed rows; columns that do not fit the type are refused by `shared_strided`.
        let stride = ty.row_bytes(cols).unwrap_or(0);
        Weight::shared_strided(name, ty, rows, cols, bytes, offset_bytes, stride)
    }

    /// As [`Weight::shared`], row r at `offset_bytes + r * row_stride_bytes` (a bundled FFN's
    /// up rows and down columns interleave).
    pub fn shared_strided(
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: Arc<Vec<u8>>,
        offset_bytes: usize,
        row_stride_bytes: usize,
    ) -> Result<Weight> {
        let len = bytes.len();
        Weight::over(
            name,
            ty,
            rows,
            cols,
            Storage::Owned(bytes),
            len,
            offset_bytes,
            row_stride_bytes,
        )
    }

    /// A view of `storage` (`len` bytes), its rows checked to lie inside.
    #[allow(clippy::too_many_arguments)]
    fn over(
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        storage: Storage,
        len: usize,
        offset_bytes: usize,
        row_stride_bytes: usize,
    ) -> Result<Weight> {
        let row_bytes = ty
            .row_bytes(cols)
            .ok_or_else(|| Error::Internal(format!("{name}: {cols} columns do not fit {ty:?} blocks")))?;
        let extent = match rows {
            0 => Some(0),
            _ => (rows - 1)
                .checked_mul(row_stride_bytes)
                .and_then(|b| b.checked_add(row_bytes)),
        };
        match extent.and_then(|b| b.checked_add(offset_bytes)) {
            Some(end) if end <= len && row_stride_bytes >= row_bytes => {}
            _ => {
                return Err(Error::Internal(format!(
                    "{name}: {rows}x{cols} {ty:?} at byte {offset_bytes} does not fit a {len}-byte buffer"
                )))
            }
        }
        Ok(Weight {
            name: name.into(),
            ty,
            rows,
            cols,
            row_bytes,
            row_stride_bytes,
            storage,
            offset_bytes,
            volatile: false,
            content: None,
        })
    }

    /// Where row 0 starts in the model file, for weights that view a memory map of it or stay
    /// on disk (`None` for weights held in memory).
    pub fn file_offset(&self) -> Option<u64> {
        match self.storage {
            Storage::Mapped(_) | Storage::OnDisk => Some(self.offset_bytes as u64),
            Storage::Owned(_) | Storage::Staged(_) => None,
        }
    }

    /// Whether the bytes can be read (held in memory or mapped); `false` for [`Weight::on_disk`].
    pub fn in_memory(&self) -> bool {
        !matches!(self.storage, Storage::OnDisk)
    }

    /// The same matrix with its bytes left on disk: only its place is kept, its offset in the
    /// file moved by `base_bytes` (where the file starts in the byte space a stream reads: 0 but
    /// for a model's later shards). The streaming path reads such weights through its readers;
    /// reading their rows directly is a bug, caught before a pass by [`Weight::in_memory`] checks.
    pub fn on_disk(&self, base_bytes: u64) -> Weight {
        match self.storage {
            Storage::Mapped(_) => Weight {
                storage: Storage::OnDisk,
                offset_bytes: self.offset_bytes + base_bytes as usize,
                ..self.clone()
            },
            Storage::OnDisk => self.clone(),
            Storage::Owned(_) | Storage::Staged(_) => self.clone(),
        }
    }

    /// A view of mapped bytes; the caller has checked that every row lies inside the map.
    pub fn mapped(
        name: &str,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        map: Arc<memmap2::Mmap>,
        offset_bytes: usize,
        row_stride_bytes: usize,
    ) -> Weight {
        let row_bytes = ty.row_bytes(cols).expect("caller checked the row size");
        debug_assert!(rows == 0 || offset_bytes + (rows - 1) * row_stride_bytes + row_bytes <= map.len());
        Weight {
            name: name.into(),
            ty,
            rows,
            cols,
            row_bytes,
            row_stride_bytes,
            storage: Storage::Mapped(map),
            offset_bytes,
            volatile: false,
            content: None,
        }
    }

    fn storage(&self) -> &[u8] {
        match &self.storage {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
            Storage::Staged(s) => s.bytes(),
            // Every entry point that computes checks `in_memory` first (the forward pass refuses
            // a model whose matrices are on disk unless a stream serves them), so this is a bug.
            Storage::OnDisk => panic!("{}: its bytes are on disk and only a stream can read them", self.name),
        }
    }

    /// The bytes from row 0 to the end of the last row (a strided view's gaps included) and a
    /// handle on their storage: what a device with memory of its own copies once and keeps,
    /// keyed by the address, which the handle keeps from being freed and reused. `None` for a
    /// weight on disk.
    pub fn span(&self) -> Option<(&[u8], Arc<dyn std::any::Any + Send + Sync>)> {
        let keep: Arc<dyn std::any::Any + Send + Sync> = match &self.storage {
            Storage::Mapped(m) => m.clone(),
            Storage::Owned(v) => v.clone(),
            Storage::Staged(s) => s.clone(),
            Storage::OnDisk => return None,
        };
        let len = match self.rows {
            0 => 0,
            r => (r - 1) * self.row_stride_bytes + self.row_bytes,
        };
        Some((&self.storage()[self.offset_bytes..self.offset_bytes + len], keep))
    }

    /// Where the bytes live (see [`Home`]).
    pub fn home(&self) -> Home<'_> {
        match &self.storage {
            Storage::OnDisk => Home::OnDisk,
            Storage::Mapped(_) | Storage::Owned(_) => Home::Host,
            Storage::Staged(s) => match s.mapped() {
                Some((device, base)) => Home::Mapped {
                    device,
                    address: base + self.offset_bytes as u64,
                },
                None => Home::Staged(&**s),
            },
        }
    }

    /// The same view marked as bytes of a buffer that will be refilled (see the field).
    pub fn volatile(mut self) -> Weight {
        self.volatile = true;
        self
    }

    pub fn is_volatile(&self) -> bool {
        self.volatile
    }

    /// A volatile weight whose bytes are always those of `(source, at)` — `source` a stream's
    /// own id, `at` the weight's place in its file — whatever buffer holds them now: a device
    /// may keep a copy by that key (a GPU's copies of routed experts).
    pub fn keyed(mut self, source: u64, at: u64) -> Weight {
        self.content = Some((source, at));
        self
    }

    /// The key of [`Weight::keyed`], if any.
    pub fn content_key(&self) -> Option<(u64, u64)> {
        self.content
    }

    /// Whether the bytes are this process's own memory (not a map of a file, not staged by a
    /// device, not on disk).
    pub fn is_owned(&self) -> bool {
        matches!(self.storage, Storage::Owned(_))
    }

    pub fn is_contiguous(&self) -> bool {
        self.row_stride_bytes == self.row_bytes
    }

    pub fn row(&self, r: usize) -> &[u8] {
        let start = self.offset_bytes + r * self.row_stride_bytes;
        &self.storage()[start..start + self.row_bytes]
    }

    /// Rows `start..start + rows` as a matrix of their own (the same bytes).
    pub fn rows_view(&self, start: usize, rows: usize) -> Weight {
        assert!(
            start + rows <= self.rows,
            "{}: rows {start}+{rows} of {}",
            self.name,
            self.rows
        );
        Weight {
            rows,
            offset_bytes: self.offset_bytes + start * self.row_stride_bytes,
            ..self.clone()
        }
    }

    /// This matrix and the `n - 1` that follow it in its storage as one (`n · rows` rows): the
    /// matrices of a three-dimensional tensor, packed, this one the first. The caller has checked
    /// that the tensor lies inside the storage (a GGUF file's tensors are, at open).
    pub fn stacked_with(self, name: &str, n: usize) -> Weight {
        debug_assert!(self.is_contiguous());
        Weight {
            name: name.into(),
            rows: n * self.rows,
            ..self
        }
    }

    /// Rows `[start, end)` as one contiguous byte slice; only for contiguous weights.
    pub fn rows_bytes(&self, start: usize, end: usize) -> &[u8] {
        assert!(self.is_contiguous(), "{}: strided rows are not one slice", self.name);
        &self.storage()[self.offset_bytes + start * self.row_bytes..self.offset_bytes + end * self.row_bytes]
    }

    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.ty, self.row(r), out);
    }

    /// Bytes of the rows themselves (not the gaps of a strided view).
    pub fn len_bytes(&self) -> usize {
        self.rows * self.row_bytes
    }

    /// Bytes from row 0's start to the last row's end (`len_bytes` when packed; more when
    /// strided rows interleave with another view's).
    pub fn extent_bytes(&self) -> usize {
        match self.rows {
            0 => 0,
            r => (r - 1) * self.row_stride_bytes + self.row_bytes,
        }
    }
}
