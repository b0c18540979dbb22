//! Hugging Face safetensors reader: one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, memory-mapped. Parses the untrusted JSON header with a size
//! limit and checks every tensor's byte range, dtype and element count before use. Knows bytes
//! and dtypes, not architectures.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// The header of a real model is a few hundred KiB at most.
const HEADER_BYTES_MAX: u64 = 100 << 20;

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

    pub fn bytes(&self, t: &StTensor) -> &[u8] {
        &self.maps[t.file][t.offset_bytes..t.offset_bytes + t.len_bytes]
    }
}

/// Parse one file's header: u64 little-endian header length, a JSON object of
/// `name -> {dtype, shape, data_offsets: [begin, end]}` (offsets relative to the data after the header).
pub fn parse_header(path: &Path, bytes: &[u8], file: usize) -> Result<Vec<StTensor>> {
    let len_field: [u8; 8] = bytes.get(..8).and_then(|b| b.try_into().ok()).ok_or_else(|| {
        malformed(
            path,
            0,
            format!("file is {} bytes, too short for a header", bytes.len()),
        )
    })?;
    let header_len = u64::from_le_bytes(len_field);
    if header_len > HEADER_BYTES_MAX || header_len > bytes.len() as u64 - 8 {
        return Err(malformed(
            path,
            0,
            format!("header length {header_len} exceeds the file or the {HEADER_BYTES_MAX}-byte limit"),
        ));
    }
    let data_start = 8 + header_len as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..data_start])
        .map_err(|e| malformed(path, 8, format!("header is not a JSON object: {e}")))?;
    let data_len = bytes.len() - data_start;
    let mut out = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let bad = |what: String| malformed(path, 8, format!("tensor `{name}`: {what}"));
        let dtype = info
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("no dtype".into()))?;
        let ty = match dtype {
            "F32" => GgmlType::F32,
            "F16" => GgmlType::F16,
            "BF16" => GgmlType::BF16,
            other => return Err(bad(format!("dtype {other} is not supported (F32, F16, BF16 are)"))),
        };
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("no shape".into()))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("shape has a non-integer dimension".into()))?;
        let offsets = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .ok_or_else(|| bad("no data_offsets".into()))?;
        let (begin, end) = match offsets.as_slice() {
            [b, e] => (b.as_u64(), e.as_u64()),
            _ => (None, None),
        };
        let (begin, end) = match (begin, end) {
            (Some(b), Some(e)) if b <= e && e <= data_len as u64 => (b as usize, e as usize),
            _ => {
                return Err(bad(format!(
                    "data_offsets {offsets:?} fall outside the {data_len} data bytes (truncated file?)"
                )))
            }
        };
        let n_elems = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let want = n_elems.and_then(|n| n.checked_mul(ty.block_bytes()));
        if want != Some(end - begin) {
            return Err(bad(format!(
                "{} bytes stored, but shape {shape:?} of {dtype} needs {want:?}",
                end - begin
            )));
        }
        out.push(StTensor {
            name,
            shape,
            ty,
            file,
            offset_bytes: data_start + begin,
            len_bytes: end - begin,
        });
    }
    Ok(out)
}
