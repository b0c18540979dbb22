//! The fixed header in the first page of a `.gst` file: where the index is, how long the file
//! is, and checksums of both. Parsing checks every field before anything else is read.

use std::path::Path;

use super::{malformed, HEADER_BYTES, HEADER_USED_BYTES, INDEX_LEN_MAX_BYTES, MAGIC, REBUILD};
use crate::error::Result;

// Byte offsets of the header fields (all little-endian); see docs/FORMAT.md.
const MAGIC_AT: usize = 0;
const VERSION_AT: usize = 8;
const HEADER_BYTES_AT: usize = 12;
const INDEX_OFFSET_AT: usize = 16;
const INDEX_LEN_AT: usize = 24;
const INDEX_XXH3_AT: usize = 32;
const FILE_LEN_AT: usize = 40;
const HEADER_XXH3_AT: usize = 48;
const RESERVED_AT: usize = 56;

/// The header fields that vary between files (`magic` and `header_bytes` are constants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub format_version: u32,
    pub index_offset_bytes: u64,
    pub index_len_bytes: u64,
    /// xxh3-64 of the index bytes.
    pub index_xxh3: u64,
    pub file_len_bytes: u64,
}

impl Header {
    /// The whole header page: exactly `HEADER_BYTES` long, zero after byte 64.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut page = vec![0u8; HEADER_BYTES as usize];
        let mut put = |at: usize, bytes: &[u8]| page[at..at + bytes.len()].copy_from_slice(bytes);
        put(MAGIC_AT, &MAGIC);
        put(VERSION_AT, &self.format_version.to_le_bytes());
        put(HEADER_BYTES_AT, &(HEADER_BYTES as u32).to_le_bytes());
        put(INDEX_OFFSET_AT, &self.index_offset_bytes.to_le_bytes());
        put(INDEX_LEN_AT, &self.index_len_bytes.to_le_bytes());
        put(INDEX_XXH3_AT, &self.index_xxh3.to_le_bytes());
        put(FILE_LEN_AT, &self.file_len_bytes.to_le_bytes());
        let header_xxh3 = xxhash_rust::xxh3::xxh3_64(&page[..HEADER_XXH3_AT]);
        page[HEADER_XXH3_AT..RESERVED_AT].copy_from_slice(&header_xxh3.to_le_bytes());
        page
    }

    /// Parse and check the header from the file's first page (`first_page` may be longer; only
    /// the first `HEADER_BYTES` are looked at). Checks, in order: magic, version, header checksum,
    /// `header_bytes`, reserved and padding bytes zero, and that the index lies after the header
    /// page, within the index size limit, and ends exactly at `file_len_bytes`. The caller checks
    /// `file_len_bytes` against the real file length.
    pub fn parse(path: &Path, first_page: &[u8]) -> Result<Header> {
        let truncated = || {
            malformed(
                path,
                first_page.len() as u64,
                format!(
                    "truncated: the file is {} bytes, a .gst header needs {HEADER_BYTES}; {REBUILD}",
                    first_page.len()
                ),
            )
        };
        // The magic is checked before the length of the used bytes so that a short file that is
        // not a .gst at all is called that, not "truncated".
        let magic = first_page.get(MAGIC_AT..MAGIC_AT + MAGIC.len()).ok_or_else(truncated)?;
        if magic != MAGIC {
            return Err(malformed(
                path,
                MAGIC_AT as u64,
                format!(
                    "not a .gst file: magic is {:?}, expected {:?}; convert a GGUF or safetensors model with `gatestream reformat`",
                    String::from_utf8_lossy(magic),
                    String::from_utf8_lossy(&MAGIC)
                ),
            ));
        }
        let used = first_page.get(..HEADER_USED_BYTES).ok_or_else(truncated)?;
        // `used` is exactly HEADER_USED_BYTES long, so these fixed-offset reads are in bounds.
        let u32_at = |at: usize| u32::from_le_bytes(used[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(used[at..at + 8].try_into().expect("8 bytes"));

        // Version before checksum: a future version may lay the header out differently, and
        // "re-run reformat" is the useful message then, not "checksum mismatch".
        let format_version = u32_at(VERSION_AT);
        if !(super::FORMAT_VERSION_MIN..=super::FORMAT_VERSION).contains(&format_version) {
            return Err(malformed(
                path,
                VERSION_AT as u64,
                format!(
                    "gst format version {format_version}, this build reads {} to {}; re-run gatestream reformat",
                    super::FORMAT_VERSION_MIN,
                    super::FORMAT_VERSION
                ),
            ));
        }
        let header_xxh3_expected = u64_at(HEADER_XXH3_AT);
        let header_xxh3_found = xxhash_rust::xxh3::xxh3_64(&used[..HEADER_XXH3_AT]);
        if header_xxh3_found != header_xxh3_expected {
            return Err(malformed(
                path,
                HEADER_XXH3_AT as u64,
                format!(
                    "header checksum mismatch: stored {header_xxh3_expected:016x}, bytes 0..48 hash to {header_xxh3_found:016x}; {REBUILD}"
                ),
            ));
        }
        let header_bytes = u32_at(HEADER_BYTES_AT);
        if u64::from(header_bytes) != HEADER_BYTES {
            return Err(malformed(
                path,
                HEADER_BYTES_AT as u64,
                format!("header_bytes is {header_bytes}, version 1 requires {HEADER_BYTES}; {REBUILD}"),
            ));
        }
        if let Some(pos) = used[RESERVED_AT..].iter().position(|&b| b != 0) {
            return Err(malformed(
                path,
                (RESERVED_AT + pos) as u64,
                format!("reserved header byte is not zero; {REBUILD}"),
            ));
        }
        let page = first_page.get(..HEADER_BYTES as usize).ok_or_else(|| {
            malformed(
                path,
                first_page.len() as u64,
                format!(
                    "truncated: the file is {} bytes, shorter than the {HEADER_BYTES}-byte header page; {REBUILD}",
                    first_page.len()
                ),
            )
        })?;
        if let Some(pos) = page[HEADER_USED_BYTES..].iter().position(|&b| b != 0) {
            return Err(malformed(
                path,
                (HEADER_USED_BYTES + pos) as u64,
                format!("header page padding is not zero; {REBUILD}"),
            ));
        }

        let header = Header {
            format_version,
            index_offset_bytes: u64_at(INDEX_OFFSET_AT),
            index_len_bytes: u64_at(INDEX_LEN_AT),
            index_xxh3: u64_at(INDEX_XXH3_AT),
            file_len_bytes: u64_at(FILE_LEN_AT),
        };
        header.check_index_range(path)?;
        Ok(header)
    }

    fn check_index_range(&self, path: &Path) -> Result<()> {
        let Header {
            index_offset_bytes: offset,
            index_len_bytes: len,
            file_len_bytes: file_len,
            ..
        } = *self;
        if offset < HEADER_BYTES {
            return Err(malformed(
                path,
                INDEX_OFFSET_AT as u64,
                format!("index offset {offset} lies inside the {HEADER_BYTES}-byte header page; {REBUILD}"),
            ));
        }
        if len == 0 || len > INDEX_LEN_MAX_BYTES {
            return Err(malformed(
                path,
                INDEX_LEN_AT as u64,
                format!("index length {len} bytes is outside 1..={INDEX_LEN_MAX_BYTES}; {REBUILD}"),
            ));
        }
        let end = offset.checked_add(len).ok_or_else(|| {
            malformed(
                path,
                INDEX_OFFSET_AT as u64,
                format!("index range {offset} + {len} overflows a 64-bit offset; {REBUILD}"),
            )
        })?;
        if end > file_len {
            return Err(malformed(
                path,
                INDEX_OFFSET_AT as u64,
                format!(
                    "index range [{offset}, {end}) runs past the end of the file ({file_len} bytes per the header); {REBUILD}"
                ),
            ));
        }
        if end < file_len {
            return Err(malformed(
                path,
                FILE_LEN_AT as u64,
                format!(
                    "the header says the file is {file_len} bytes but the index ends at {end}; nothing may follow the index; {REBUILD}"
                ),
            ));
        }
        Ok(())
    }
}
