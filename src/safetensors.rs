//! Hugging Face safetensors reader: one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, memory-mapped. The untrusted header is parsed and validated by
//! the `safetensors` crate (size limit, JSON, byte ranges, element counts); this module maps its
//! errors to ours (file and byte offset), keeps the dtypes gatestream computes on, and joins
//! shards. Knows bytes and dtypes, not architectures.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// The `safetensors` crate's header limit (a real model's header is a few hundred KiB at most).
const HEADER_BYTES_MAX: u64 = 100_000_000;

#[derive(Clone, Debug)]
pub struct StTensor {
    pub name: String,
    /// Shape as written (row-major, last dimension fastest).
    pub shape: Vec<usize>,
    pub ty: GgmlType,
    pub file: usize,
    pub offset_bytes: usize,
    pub len_bytes: usize,
}

/// All tensors of a model folder, across shards.
pub struct SafetensorsModel {
    pub paths: Vec<PathBuf>,
    pub maps: Vec<Arc<memmap2::Mmap>>,
    pub tensors: HashMap<String, StTensor>,
}

fn malformed(path: &Path, offset_bytes: u64, what: String) -> Error {
    Error::Malformed {
        path: path.to_path_buf(),
        format: "safetensors",
        offset_bytes,
        what,
    }
}

impl SafetensorsModel {
    /// Open `dir/model.safetensors`, or the shards named by `dir/model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<SafetensorsModel> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| malformed(&index, 0, format!("index is not JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| malformed(&index, 0, "no `weight_map` object".into()))?;
            let mut names: Vec<String> = map.values().filter_map(|f| f.as_str().map(String::from)).collect();
            names.sort();
            names.dedup();
            if names.iter().any(|n| n.contains('/') || n.contains("..")) {
                return Err(malformed(&index, 0, "shard names must be plain file names".into()));
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            return Err(Error::Config {
                path: dir.to_path_buf(),
                what: "no model.safetensors or model.safetensors.index.json in this folder".into(),
            });
        };
        let mut model = SafetensorsModel {
            paths: Vec::new(),
            maps: Vec::new(),
            tensors: HashMap::new(),
        };
        for (i, path) in files.iter().enumerate() {
            let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: read-only private map of a file opened read-only; ranges are checked below
            // against the map length. Truncation by another process while mapped is the usual
            // mmap hazard, accepted as for GGUF.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
            for t in parse_header(path, &map, i)? {
                if model.tensors.contains_key(&t.name) {
                    return Err(malformed(
                        path,
                        8,
                        format!("tensor `{}` appears in more than one shard", t.name),
                    ));
                }
                model.tensors.insert(t.name.clone(), t);
            }
            model.paths.push(path.clone());
            model.maps.push(Arc::new(map));
        }
        Ok(model)
    }

    /// The shards as one byte space ([`crate::io::place_parts`]): what a stream reads, and
    /// where each shard starts in it.
    pub fn parts(&self) -> Vec<crate::io::FilePart> {
        let files: Vec<(PathBuf, u64)> = self
            .paths
            .iter()
            .zip(&self.maps)
            .map(|(p, m)| (p.clone(), m.len() as u64))
            .collect();
        crate::io::place_parts(&files)
    }

    pub fn bytes(&self, t: &StTensor) -> &[u8] {
        &self.maps[t.file][t.offset_bytes..t.offset_bytes + t.len_bytes]
    }
}

/// Parse one file's header with the `safetensors` crate (u64 little-endian header length, a JSON
/// object of `name -> {dtype, shape, data_offsets}`, tensors covering the data exactly, shapes
/// matching byte counts), mapping its errors to ours with the file and the byte offset where the
/// problem lies, then keeping the dtypes gatestream computes on.
pub fn parse_header(path: &Path, bytes: &[u8], file: usize) -> Result<Vec<StTensor>> {
    use safetensors::tensor::{Dtype, SafeTensorError as E};
    let header_len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .unwrap_or(0);
    let data_start = 8u64.saturating_add(header_len);
    let (n, metadata) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| match e {
        E::HeaderTooSmall => malformed(
            path,
            0,
            format!("file is {} bytes, too short for a header", bytes.len()),
        ),
        E::HeaderTooLarge | E::InvalidHeaderLength => malformed(
            path,
            0,
            format!(
                "header length {header_len} exceeds the file ({} bytes) or the {HEADER_BYTES_MAX}-byte limit",
                bytes.len()
            ),
        ),
        E::InvalidHeader(e) => malformed(path, 8, format!("header is not UTF-8: {e}")),
        E::InvalidHeaderDeserialization(e) | E::JsonError(e) => {
            malformed(path, 8, format!("header is not a JSON object of tensors: {e}"))
        }
        E::InvalidOffset(name) => malformed(
            path,
            8,
            format!("tensor `{name}`: data_offsets do not start where the previous tensor ends"),
        ),
        E::MetadataIncompleteBuffer => malformed(
            path,
            data_start,
            format!(
                "the tensors' data does not end where the file does ({} data bytes; truncated or padded file?)",
                (bytes.len() as u64).saturating_sub(data_start)
            ),
        ),
        E::TensorInvalidInfo | E::ValidationOverflow => malformed(
            path,
            8,
            "a tensor's byte count does not match its shape and dtype (or overflows)".into(),
        ),
        other => malformed(path, 8, other.to_string()),
    })?;
    let data_start = 8 + n;
    let mut out = Vec::new();
    for (name, info) in metadata.tensors() {
        let ty = match info.dtype {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::BF16,
            other => {
                return Err(malformed(
                    path,
                    8,
                    format!("tensor `{name}`: dtype {other} is not supported (F32, F16, BF16 are)"),
                ))
            }
        };
        let (begin, end) = info.data_offsets;
        out.push(StTensor {
            name,
            shape: info.shape.clone(),
            ty,
            file,
            offset_bytes: data_start + begin,
            len_bytes: end - begin,
        });
    }
    // The crate's map has no order; tensors in offset order keep error messages repeatable.
    out.sort_by_key(|t| t.offset_bytes);
    Ok(out)
}
