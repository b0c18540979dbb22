//! The `.gst` on-disk format, version 1: the types that describe a file (header, JSON index,
//! sections, tensor views), parsing and validation of untrusted bytes, and the layout plan the
//! writer follows. The byte-level specification, with offsets and every rule a reader checks, is
//! `docs/FORMAT.md`; this module is its one implementation.
//!
//! What this module must not do: open, read or write files (every function takes bytes and a
//! `path` used only in error messages), know about readers, caches or the forward pass, or trust
//! anything it parses. A file is a header page, 4096-aligned sections, then the index:
//!
//! ```text
//! [0, 4096)            header (64 bytes used, rest zero)
//! [4096k, ..)          sections, each at a multiple of 4096, zero padding between
//! [index_offset, EOF)  the index: UTF-8 JSON of `Index`, nothing after it
//! ```
//!
//! Section payloads are checked lazily ([`verify_section`]) because they can be gigabytes; the
//! header and index are checked completely by [`parse_file_bytes`] / [`Header::parse`] +
//! [`Index::parse`].

mod file;
mod header;
mod index;

#[cfg(test)]
mod tests;

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::Error;
use crate::quant::GgmlType;

pub use file::{
    parse_file_bytes, plan_layout, reseal_checksums_for_testing, verify_section, verify_section_digest, Planned,
};
pub use header::Header;

pub const MAGIC: [u8; 8] = *b"GSTREAM\0";
/// The version this build writes. Version 2 added `recommended_sparse.per_layer_sparsity`;
/// version 3 mixture-of-experts models (`config.moe`, `config.qk_norm_whole`, expert sections);
/// version 4 the `rows` FFN layout (each FFN matrix as the checkpoint stores it).
pub const FORMAT_VERSION: u32 = 4;
/// The oldest version this build reads (version 1 files are version 2 files without per-layer
/// recommendations).
pub const FORMAT_VERSION_MIN: u32 = 1;
/// Every section starts at a multiple of this (O_DIRECT reads need block-aligned offsets).
pub const ALIGN_BYTES: u64 = 4096;
/// The header occupies the whole first page so the first section can start at `ALIGN_BYTES`.
pub const HEADER_BYTES: u64 = 4096;
/// Bytes of the header page that carry fields; the rest of the page must be zero.
pub const HEADER_USED_BYTES: usize = 64;

/// The index of a 1,000-layer model with every tensor named is a few MiB; this bounds what a
/// hostile header can make the reader allocate.
pub const INDEX_LEN_MAX_BYTES: u64 = 256 << 20;
pub const SECTIONS_MAX: usize = 1_000_000;
pub const TENSORS_MAX: usize = 1_000_000;
/// Rows and columns of one tensor view; the largest real matrices are ~2^18 on a side.
pub const DIM_MAX: u64 = 1 << 32;
/// Section and tensor names (and the names that refer to sections).
pub const NAME_LEN_MAX_BYTES: usize = 1024;
/// Free-text fields shown to people: `source.file_name`, `calibration.text`.
pub const TEXT_LEN_MAX_BYTES: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnLayout {
    /// Each FFN section holds, neuron after neuron, the neuron's up row then its down column.
    Bundled,
    /// Up rows and down columns live in two neuron-major sections.
    Split,
    /// Gate, up and down as the checkpoint stores them (down as `[hidden x ffn]` rows, nothing
    /// re-quantized): no larger than the source, read whole by dense streaming; no neuron-sparse
    /// reads (version 4).
    Rows,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NeuronOrder {
    /// Neurons in the checkpoint's order.
    Original,
    /// Neurons sorted by calibrated activation frequency, most frequent first.
    HotFirst,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpSketch {
    None,
    /// A resident 2-bit sketch of up, used to estimate |act(g)·u| before reading up.
    TwoBit,
}

/// The JSON document at the end of the file. Unknown fields are rejected: a writer that needs a
/// new field bumps [`FORMAT_VERSION`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Index {
    pub format_version: u32,
    pub config: ModelConfig,
    pub layout: Layout,
    pub source: SourceInfo,
    /// Name of the section holding the tokenizer description (JSON bytes; opaque to this module).
    pub tokenizer_section: String,
    pub calibration: Option<Calibration>,
    /// Per layer: relative RMS error of the down re-quantization (empty when down was not re-quantized).
    pub down_requant_rel_rms: Vec<f32>,
    /// The sparse configuration `gatestream eval --store` measured as best for a quality budget;
    /// `run --mode sparse` uses it when no mask options are given. Absent in files that were
    /// never evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recommended_sparse: Option<Recommendation>,
    pub sections: Vec<Section>,
    pub tensors: Vec<TensorView>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    pub ffn_layout: FfnLayout,
    pub neuron_order: NeuronOrder,
    pub down_type: GgmlType,
    pub up_sketch: UpSketch,
}

/// The checkpoint this file was made from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceInfo {
    pub file_name: String,
    pub len_bytes: u64,
    /// 16 lowercase hex digits of the source file's xxh3-64.
    pub xxh3: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    pub tokens: u64,
    /// Where the calibration text came from (file name and which part of it).
    pub text: String,
    /// Section with f32 little-endian activation frequencies, [n_layers][ffn] in the file's neuron order.
    pub frequencies_section: String,
    pub layers: Vec<LayerCalibration>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerCalibration {
    /// (target sparsity, threshold on the criterion) for 0.1, 0.2, ... 0.9.
    pub thresholds: Vec<(f32, f32)>,
    /// Share of all activations covered by the first 10% / 25% of neurons in file order.
    pub hot_prefix_10: f32,
    pub hot_prefix_25: f32,
}

/// A measured sparse configuration (names as `gatestream eval` prints them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recommendation {
    /// "topk", "threshold" or "union".
    pub strategy: String,
    /// "gate", "exact", "candidates" or "sketch".
    pub criterion: String,
    /// Share of FFN neurons dropped, in [0, 1).
    pub sparsity: f32,
    /// The quality budget it was chosen under, and what it measured (percent).
    pub max_ppl_increase_pct: f32,
    pub measured_ppl_increase_pct: f32,
    pub top1_agreement: f32,
    /// FFN bytes per token relative to dense streaming, per `eval`'s bytes model.
    pub ffn_bytes_rel_dense: f32,
    /// What it was measured on (text, windows).
    pub measured_on: String,
    /// Top-K with a level per layer (allocated by measured sensitivity; their mean is
    /// `sparsity`). Version 2 and later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_layer_sparsity: Option<Vec<f32>>,
}

/// A byte range of the file with its checksum.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Section {
    pub name: String,
    pub offset_bytes: u64,
    pub len_bytes: u64,
    /// 16 lowercase hex digits of the xxh3-64 of the section's bytes.
    pub xxh3: String,
}

/// A matrix inside a section: row r (0-based) is `row_bytes(dtype, cols)` bytes at
/// section.offset + offset_in_section_bytes + r * row_stride_bytes. Bundled FFN sections hold two
/// views (up rows and down columns) interleaved with the same stride.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorView {
    pub name: String,
    pub section: String,
    pub offset_in_section_bytes: u64,
    pub dtype: GgmlType,
    pub rows: u64,
    pub cols: u64,
    pub row_stride_bytes: u64,
}

impl TensorView {
    /// Bytes of one row; `None` if `cols` is not a whole number of `dtype` blocks.
    pub fn row_bytes(&self) -> Option<u64> {
        let cols = usize::try_from(self.cols).ok()?;
        u64::try_from(self.dtype.row_bytes(cols)?).ok()
    }

    /// The byte range [start, end) of row `r` in the file, given the section this view lives in
    /// (resolve the section once with [`Index::section`] on hot paths). `None` if `r` is out of
    /// range, the row would leave the section, or the arithmetic overflows.
    pub fn row_range_in(&self, section: &Section, r: u64) -> Option<(u64, u64)> {
        if r >= self.rows {
            return None;
        }
        let row_bytes = self.row_bytes()?;
        let in_section_start = r
            .checked_mul(self.row_stride_bytes)?
            .checked_add(self.offset_in_section_bytes)?;
        let in_section_end = in_section_start.checked_add(row_bytes)?;
        if in_section_end > section.len_bytes {
            return None;
        }
        let start = section.offset_bytes.checked_add(in_section_start)?;
        Some((start, start.checked_add(row_bytes)?))
    }
}

/// xxh3-64 of `bytes` as 16 lowercase hex digits, the form every checksum takes in the index.
pub fn checksum_hex(bytes: &[u8]) -> String {
    checksum_to_hex(xxhash_rust::xxh3::xxh3_64(bytes))
}

/// The index's form of a checksum computed elsewhere (e.g. by a streaming
/// `xxhash_rust::xxh3::Xxh3` over a section too large to hold in memory).
pub fn checksum_to_hex(xxh3: u64) -> String {
    format!("{xxh3:016x}")
}

fn malformed(path: &Path, offset_bytes: u64, what: impl Into<String>) -> Error {
    Error::Malformed {
        path: path.to_path_buf(),
        format: "gst",
        offset_bytes,
        what: what.into(),
    }
}

/// The advice that ends most messages: the file cannot be repaired, only rebuilt.
const REBUILD: &str = "the file is damaged or was not written by gatestream; re-run `gatestream reformat`";
