//! GGUF reader (versions 2 and 3): header, metadata key/values, tensor infos and the aligned
//! tensor data region, parsed from a memory map. The file is untrusted input: every length and
//! count is checked against what remains of the file before anything is allocated, arithmetic is
//! checked, and every failure names the file and byte offset. This module knows bytes and
//! metadata, not architectures: `model::load` turns what it finds into a `ModelConfig`.
//!
//! Why our own parser: the GGUF crates on crates.io each pull in a tensor library or read
//! through `std::io` into owned buffers, while gatestream needs tensor infos as offsets into its
//! own map (zero-copy, and the `.gst` writer reads them) and errors with file and offset. The
//! format is small (a header and three tables); this parser is fuzzed (`tools/fuzz.sh gguf`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::quant::{ggml_type_name, GgmlType};

const MAGIC: &[u8; 4] = b"GGUF";
const ALIGNMENT_DEFAULT: u64 = 32;
/// Limits that no real model reaches; they stop absurd counts before any allocation.
const KEY_BYTES_MAX: u64 = 1 << 16;
const TENSOR_DIMS_MAX: u32 = 4;
const ARRAY_NESTING_MAX: u32 = 2;

/// A metadata value as stored in the file.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// Any integer type that fits in u64 (negative values do not).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's index entry. `dims` are GGUF's `ne`: `dims[0]` is the fastest (input) dimension,
/// along which quantization blocks run.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    /// The raw ggml type id; `ty` is None when gatestream cannot compute on it.
    pub type_id: u32,
    pub ty: Option<GgmlType>,
    /// Absolute offset of the tensor's bytes in the file.
    pub offset_bytes: u64,
    pub len_bytes: u64,
}

/// A parsed GGUF file backed by a read-only memory map.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    pub map: Arc<memmap2::Mmap>,
}

/// Whether `path` is a file starting with GGUF's magic.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only and private to this process; the file is opened read-only.
        // If another process truncates the file while it is mapped, accesses could fault (SIGBUS);
        // that is the documented hazard of memory-mapped model files and the same one llama.cpp
        // accepts. Every range we hand out is checked against the map's length at parse time.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::parse(path, Arc::new(map))
    }

    /// Parse a mapped file (also an anonymous map holding bytes in memory: tests, fuzzing).
    pub fn parse(path: &Path, map: Arc<memmap2::Mmap>) -> Result<GgufFile> {
        let (version, metadata, tensors) = parse_bytes(path, &map)?;
        let mut tensor_index = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if tensor_index.insert(t.name.clone(), i).is_some() {
                return Err(malformed(
                    path,
                    t.offset_bytes,
                    format!("tensor `{}` appears twice", t.name),
                ));
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            tensor_index,
            map,
        })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor (bounds were checked at parse time).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.offset_bytes as usize..(t.offset_bytes + t.len_bytes) as usize]
    }
}

fn malformed(path: &Path, offset_bytes: u64, what: String) -> Error {
    Error::Malformed {
        path: path.to_path_buf(),
        format: "GGUF",
        offset_bytes,
        what,
    }
}

/// A bounds-checked little-endian cursor over untrusted bytes.
struct Cursor<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: impl Into<String>) -> Error {
        malformed(self.path, self.pos as u64, what.into())
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n > remaining {
            return Err(self.err(format!(
                "file truncated: {what} needs {n} bytes but only {remaining} remain (the download may be incomplete)"
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str, len_max: u64) -> Result<String> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > len_max {
            return Err(malformed(
                self.path,
                at as u64,
                format!("{what} claims {len} bytes (limit {len_max})"),
            ));
        }
        let b = self.take(len, what)?;
        // Token strings in some files are not valid UTF-8; keep going with replacement characters
        // rather than refusing the model.
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }
}

/// Smallest encoded size of one value of a metadata type, used to bound array counts.
fn value_bytes_min(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 => 8,     // string: at least its u64 length
        9 => 4 + 8, // nested array: type + count
        _ => return None,
    })
}

fn read_value(c: &mut Cursor, ty: u32, depth: u32) -> Result<MetaValue> {
    let whole = c.bytes.len() as u64;
    Ok(match ty {
        0 => MetaValue::U8(c.array::<1>("u8 value")?[0]),
        1 => MetaValue::I8(c.array::<1>("i8 value")?[0] as i8),
        2 => MetaValue::U16(u16::from_le_bytes(c.array("u16 value")?)),
        3 => MetaValue::I16(i16::from_le_bytes(c.array("i16 value")?)),
        4 => MetaValue::U32(c.u32("u32 value")?),
        5 => MetaValue::I32(i32::from_le_bytes(c.array("i32 value")?)),
        6 => MetaValue::F32(f32::from_le_bytes(c.array("f32 value")?)),
        7 => {
            let b = c.array::<1>("bool value")?[0];
            if b > 1 {
                return Err(c.err(format!("bool value is {b}, not 0 or 1")));
            }
            MetaValue::Bool(b == 1)
        }
        8 => MetaValue::Str(c.string("string value", whole)?),
        9 => {
            if depth >= ARRAY_NESTING_MAX {
                return Err(c.err("arrays nested too deeply"));
            }
            let at = c.pos;
            let elem_ty = c.u32("array element type")?;
            let count = c.u64("array length")?;
            let min = value_bytes_min(elem_ty)
                .ok_or_else(|| malformed(c.path, at as u64, format!("array of unknown value type {elem_ty}")))?;
            if count.checked_mul(min).is_none_or(|b| b > c.remaining()) {
                return Err(malformed(
                    c.path,
                    at as u64,
                    format!(
                        "array claims {count} elements, more than the {} bytes left can hold",
                        c.remaining()
                    ),
                ));
            }
            let mut v = Vec::with_capacity(count as usize);
            for _ in 0..count {
                v.push(read_value(c, elem_ty, depth + 1)?);
            }
            MetaValue::Array(v)
        }
        10 => MetaValue::U64(c.u64("u64 value")?),
        11 => MetaValue::I64(i64::from_le_bytes(c.array("i64 value")?)),
        12 => MetaValue::F64(f64::from_le_bytes(c.array("f64 value")?)),
        _ => return Err(c.err(format!("unknown metadata value type {ty}"))),
    })
}

type Parsed = (u32, HashMap<String, MetaValue>, Vec<TensorInfo>);

fn parse_bytes(path: &Path, bytes: &[u8]) -> Result<Parsed> {
    let mut c = Cursor { path, bytes, pos: 0 };
    let magic = c.array::<4>("magic")?;
    if &magic != MAGIC {
        return Err(malformed(
            path,
            0,
            format!("bad magic {magic:02x?}: not a GGUF file (expected \"GGUF\")"),
        ));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(malformed(
            path,
            4,
            format!(
                "GGUF version {version} is not supported (versions 2 and 3 are); convert it with a current llama.cpp"
            ),
        ));
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    // Each key/value takes at least 8 (key length) + 4 (type) + 1 bytes; each tensor info at least
    // 8 + 4 + 4 + 8 bytes. Counts beyond that cannot be honest.
    if n_kv.checked_mul(13).is_none_or(|b| b > c.remaining()) {
        return Err(malformed(
            path,
            16,
            format!("metadata count {n_kv} is larger than the file can hold"),
        ));
    }
    let mut metadata = HashMap::with_capacity(n_kv as usize);
    for _ in 0..n_kv {
        let key = c.string("metadata key", KEY_BYTES_MAX)?;
        let ty = c.u32("metadata value type")?;
        let value = read_value(&mut c, ty, 0)?;
        metadata.insert(key, value);
    }
    if n_tensors.checked_mul(24).is_none_or(|b| b > c.remaining()) {
        return Err(malformed(
            path,
            8,
            format!("tensor count {n_tensors} is larger than the file can hold"),
        ));
    }
    let alignment = match metadata.get("general.alignment") {
        None => ALIGNMENT_DEFAULT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(malformed(
                    path,
                    0,
                    format!("general.alignment {v:?} is not a power of two"),
                ))
            }
        },
    };
    struct Raw {
        name: String,
        dims: Vec<u64>,
        type_id: u32,
        rel_offset: u64,
        at: u64,
    }
    let mut raw = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let at = c.pos as u64;
        let name = c.string("tensor name", KEY_BYTES_MAX)?;
        let n_dims = c.u32("tensor dimension count")?;
        if n_dims == 0 || n_dims > TENSOR_DIMS_MAX {
            return Err(malformed(
                path,
                at,
                format!("tensor `{name}` has {n_dims} dimensions (1..={TENSOR_DIMS_MAX} allowed)"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64("tensor dimension")?);
        }
        let type_id = c.u32("tensor type")?;
        let rel_offset = c.u64("tensor offset")?;
        raw.push(Raw {
            name,
            dims,
            type_id,
            rel_offset,
            at,
        });
    }
    let data_start = (c.pos as u64).next_multiple_of(alignment);
    let file_len = bytes.len() as u64;
    let mut tensors = Vec::with_capacity(raw.len());
    for r in raw {
        let n_elems = r.dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let n_elems =
            n_elems.ok_or_else(|| malformed(path, r.at, format!("tensor `{}` dims {:?} overflow", r.name, r.dims)))?;
        let ty = GgmlType::from_ggml_id(r.type_id);
        // Unsupported types still get a size when we know their block layout, so the file parses
        // and the error can name the tensor when (and only when) the model needs it.
        let len_bytes = match ty {
            Some(t) => {
                let row = usize::try_from(r.dims[0]).ok().and_then(|d0| t.row_bytes(d0));
                let row = row.ok_or_else(|| {
                    malformed(
                        path,
                        r.at,
                        format!(
                            "tensor `{}`: row of {} elements is not a whole number of {} blocks",
                            r.name,
                            r.dims[0],
                            t.name()
                        ),
                    )
                })?;
                (row as u64).checked_mul(n_elems / r.dims[0].max(1))
            }
            None => Some(0),
        };
        let len_bytes =
            len_bytes.ok_or_else(|| malformed(path, r.at, format!("tensor `{}` size overflows", r.name)))?;
        if r.rel_offset % alignment != 0 {
            return Err(malformed(
                path,
                r.at,
                format!(
                    "tensor `{}` offset {} is not aligned to {alignment}",
                    r.name, r.rel_offset
                ),
            ));
        }
        let offset_bytes = data_start.checked_add(r.rel_offset);
        let end = offset_bytes.and_then(|o| o.checked_add(len_bytes));
        match (offset_bytes, end) {
            (Some(o), Some(e)) if e <= file_len => tensors.push(TensorInfo {
                name: r.name,
                dims: r.dims,
                type_id: r.type_id,
                ty,
                offset_bytes: o,
                len_bytes,
            }),
            _ => {
                return Err(malformed(
                    path,
                    r.at,
                    format!(
                        "tensor `{}` ({} bytes at data offset {}) runs past the end of the file ({file_len} bytes): the file is truncated",
                        r.name, len_bytes, r.rel_offset
                    ),
                ))
            }
        }
    }
    Ok((version, metadata, tensors))
}

/// The type name for an error message about a tensor we cannot compute on.
pub fn unsupported_type_error(path: &Path, t: &TensorInfo) -> Error {
    Error::UnsupportedTensorType {
        path: path.to_path_buf(),
        tensor: t.name.clone(),
        type_id: t.type_id,
        type_name: ggml_type_name(t.type_id).unwrap_or("unknown").to_string(),
    }
}

/// Writing GGUF files, for tests that need small (or deliberately broken) models.
pub mod write {
    use super::MetaValue;

    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn type_id(v: &MetaValue) -> u32 {
        match v {
            MetaValue::U8(_) => 0,
            MetaValue::I8(_) => 1,
            MetaValue::U16(_) => 2,
            MetaValue::I16(_) => 3,
            MetaValue::U32(_) => 4,
            MetaValue::I32(_) => 5,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::Str(_) => 8,
            MetaValue::Array(_) => 9,
            MetaValue::U64(_) => 10,
            MetaValue::I64(_) => 11,
            MetaValue::F64(_) => 12,
        }
    }

    fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
        match v {
            MetaValue::U8(x) => out.push(*x),
            MetaValue::I8(x) => out.push(*x as u8),
            MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            MetaValue::Bool(x) => out.push(*x as u8),
            MetaValue::Str(s) => put_str(out, s),
            MetaValue::Array(a) => {
                let elem = a.first().map(type_id).unwrap_or(4);
                out.extend_from_slice(&elem.to_le_bytes());
                out.extend_from_slice(&(a.len() as u64).to_le_bytes());
                for x in a {
                    put_value(out, x);
                }
            }
        }
    }

    /// A tensor to write: name, GGUF dims (`ne`, fastest first), ggml type id, raw bytes.
    pub struct TensorOut<'a> {
        pub name: &'a str,
        pub dims: Vec<u64>,
        pub type_id: u32,
        pub bytes: &'a [u8],
    }

    /// Tensor data starts, and each tensor's data is padded, to a multiple of this.
    pub const ALIGN_BYTES: u64 = 32;

    /// A tensor's entry in the header: name, GGUF dims (`ne`, fastest first), ggml type id and
    /// the length of its data.
    pub struct TensorInfoOut<'a> {
        pub name: &'a str,
        pub dims: &'a [u64],
        pub type_id: u32,
        pub len_bytes: u64,
    }

    /// A version-3 GGUF's header (metadata and tensor infos), padded to the alignment so the
    /// tensors' data can follow it, each at the returned offset from the header's end (data
    /// written in order, each padded to [`ALIGN_BYTES`]). Lets a writer stream the data.
    pub fn gguf_header(metadata: &[(&str, MetaValue)], tensors: &[TensorInfoOut]) -> (Vec<u8>, Vec<u64>) {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&type_id(v).to_le_bytes());
            put_value(&mut out, v);
        }
        let mut rel = 0u64;
        let mut offsets = Vec::new();
        for t in tensors {
            put_str(&mut out, t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&rel.to_le_bytes());
            offsets.push(rel);
            rel = (rel + t.len_bytes).next_multiple_of(ALIGN_BYTES);
        }
        out.resize((out.len() as u64).next_multiple_of(ALIGN_BYTES) as usize, 0);
        (out, offsets)
    }

    /// Serialize a version-3 GGUF with 32-byte alignment.
    pub fn gguf_bytes(metadata: &[(&str, MetaValue)], tensors: &[TensorOut]) -> Vec<u8> {
        let infos: Vec<TensorInfoOut> = tensors
            .iter()
            .map(|t| TensorInfoOut {
                name: t.name,
                dims: &t.dims,
                type_id: t.type_id,
                len_bytes: t.bytes.len() as u64,
            })
            .collect();
        let (mut out, offsets) = gguf_header(metadata, &infos);
        let start = out.len();
        for (t, off) in tensors.iter().zip(offsets) {
            out.resize(start + off as usize, 0);
            out.extend_from_slice(t.bytes);
        }
        out
    }
}
