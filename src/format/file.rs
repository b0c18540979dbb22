//! Whole-file operations that still do no I/O: parsing a file image, checking a section's
//! payload against its checksum, and planning the layout the writer streams out.

use std::path::Path;

use super::{malformed, Header, Index, Section, ALIGN_BYTES, FORMAT_VERSION, HEADER_BYTES, REBUILD};
use crate::error::{Error, Result};

/// Parse a whole file image (header + index), as the fuzz target and tests do; returns the
/// header and validated index. Does NOT verify section checksums.
pub fn parse_file_bytes(path: &Path, bytes: &[u8]) -> Result<(Header, Index)> {
    let header = Header::parse(path, bytes)?;
    let file_len = bytes.len() as u64;
    if file_len != header.file_len_bytes {
        let what = if file_len < header.file_len_bytes {
            format!(
                "truncated: the header says the file is {} bytes, it is {file_len}; the copy is incomplete or {REBUILD}",
                header.file_len_bytes
            )
        } else {
            format!(
                "{} bytes follow the end of the file the header describes ({} bytes); {REBUILD}",
                file_len - header.file_len_bytes,
                header.file_len_bytes
            )
        };
        return Err(malformed(path, file_len.min(header.file_len_bytes), what));
    }
    // Header::parse checked offset + len == file_len_bytes, which now equals bytes.len().
    let index_bytes = usize::try_from(header.index_offset_bytes)
        .ok()
        .and_then(|start| bytes.get(start..))
        .ok_or_else(|| {
            malformed(
                path,
                header.index_offset_bytes,
                format!("index lies outside the file; {REBUILD}"),
            )
        })?;
    let index_xxh3 = xxhash_rust::xxh3::xxh3_64(index_bytes);
    if index_xxh3 != header.index_xxh3 {
        return Err(malformed(
            path,
            header.index_offset_bytes,
            format!(
                "index checksum mismatch: the header says {:016x}, the {} index bytes hash to {index_xxh3:016x}; {REBUILD}",
                header.index_xxh3,
                index_bytes.len()
            ),
        ));
    }
    let index = Index::parse(path, index_bytes, header.index_offset_bytes)?;
    if index.format_version != header.format_version {
        return Err(malformed(
            path,
            header.index_offset_bytes,
            format!(
                "index says gst format version {}, the header says {}; {REBUILD}",
                index.format_version, header.format_version
            ),
        ));
    }
    Ok((header, index))
}

/// Checks a section's xxh3, computed over its bytes as they were read (`digest`, of
/// `len_bytes` bytes), against the index's: what [`verify_section`] does for bytes in memory.
pub fn verify_section_digest(path: &Path, s: &Section, len_bytes: u64, digest: u64) -> Result<()> {
    if len_bytes != s.len_bytes {
        return Err(malformed(
            path,
            s.offset_bytes,
            format!(
                "section `{}`: got {len_bytes} bytes to verify, the index says {}; read the whole section",
                s.name, s.len_bytes
            ),
        ));
    }
    let found = super::checksum_to_hex(digest);
    if found != s.xxh3 {
        return Err(malformed(
            path,
            s.offset_bytes,
            format!(
                "section `{}` checksum mismatch: the index says {}, its {} bytes hash to {found}; {REBUILD}",
                s.name, s.xxh3, s.len_bytes
            ),
        ));
    }
    Ok(())
}

/// Verify one section's checksum against its bytes (the whole section, `s.len_bytes` long).
pub fn verify_section(path: &Path, s: &Section, bytes: &[u8]) -> Result<()> {
    verify_section_digest(path, s, bytes.len() as u64, xxhash_rust::xxh3::xxh3_64(bytes))
}

/// Where everything goes in a file being written. The writer writes `header.to_bytes()`, then
/// for each section zero padding up to `section_offsets[i]` and the payload, then `index_bytes`
/// (which starts right after the last section: `header.index_offset_bytes`), and nothing else.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub header: Header,
    pub section_offsets: Vec<u64>,
    pub index_bytes: Vec<u8>,
}

/// Serialize: given the section payloads' lengths and checksums in order, lay them out (aligned),
/// fill in offsets, lengths and checksums in `index.sections` (whose names must match the
/// payloads, in order), and return the plan. Offsets are the next multiple of `ALIGN_BYTES` after
/// the previous section, starting at `HEADER_BYTES`; the index follows the last section
/// unaligned. The planned image is validated exactly as a reader would (the index is parsed back
/// from its JSON), so a writer never produces a file its reader rejects.
pub fn plan_layout(index: &mut Index, section_lens: &[u64], section_checksums: &[String]) -> Result<Planned> {
    if section_lens.len() != index.sections.len() || section_checksums.len() != index.sections.len() {
        return Err(Error::Internal(format!(
            "plan_layout: {} sections in the index, {} lengths, {} checksums; they must match one to one",
            index.sections.len(),
            section_lens.len(),
            section_checksums.len()
        )));
    }
    let overflow = || Error::Internal("plan_layout: section lengths overflow a 64-bit file offset".into());
    let mut cursor = HEADER_BYTES;
    let mut section_offsets = Vec::with_capacity(section_lens.len());
    for ((s, &len), xxh3) in index.sections.iter_mut().zip(section_lens).zip(section_checksums) {
        let offset = cursor.checked_next_multiple_of(ALIGN_BYTES).ok_or_else(overflow)?;
        s.offset_bytes = offset;
        s.len_bytes = len;
        s.xxh3.clone_from(xxh3);
        section_offsets.push(offset);
        cursor = offset.checked_add(len).ok_or_else(overflow)?;
    }
    // Whatever version the index came from (a rewrite copies an older one), it is written as this
    // build's.
    index.format_version = FORMAT_VERSION;
    let index_bytes = index.to_json_bytes();
    let index_len = index_bytes.len() as u64;
    let header = Header {
        format_version: FORMAT_VERSION,
        index_offset_bytes: cursor,
        index_len_bytes: index_len,
        index_xxh3: xxhash_rust::xxh3::xxh3_64(&index_bytes),
        file_len_bytes: cursor.checked_add(index_len).ok_or_else(overflow)?,
    };
    let planned_path = Path::new("(.gst being planned)");
    Header::parse(planned_path, &header.to_bytes())?;
    let reparsed = Index::parse(planned_path, &index_bytes, header.index_offset_bytes)?;
    if reparsed != *index {
        // serde_json writes floats in the shortest form that reads back exactly, so no known
        // index gets here; if one ever does, refuse rather than write a file that reads back
        // different from what the writer meant.
        return Err(Error::Internal(
            "plan_layout: the index does not read back equal to itself through JSON".into(),
        ));
    }
    Ok(Planned {
        header,
        section_offsets,
        index_bytes,
    })
}

/// For fuzzing and tests only: recompute the header and index checksums of a (mutated) image in
/// place, so that mutations reach the index validator instead of stopping at a checksum. Does
/// nothing to images too short to hold the checksum fields; leaves `index_xxh3` alone when the
/// index range does not fit in the image.
#[doc(hidden)]
pub fn reseal_checksums_for_testing(bytes: &mut [u8]) {
    // The header's checksum fields end at byte 56; shorter images have nothing to reseal. (The
    // fuzzer found the version that wrote `index_xxh3` into a 35-byte image.)
    if bytes.len() < 56 {
        return;
    }
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let (offset, len) = (u64_at(bytes, 16), u64_at(bytes, 24));
    let range = usize::try_from(offset).ok().zip(usize::try_from(len).ok());
    if let Some(index) = range.and_then(|(o, l)| bytes.get(o..o.checked_add(l)?)) {
        let xxh3 = xxhash_rust::xxh3::xxh3_64(index);
        bytes[32..40].copy_from_slice(&xxh3.to_le_bytes());
    }
    let xxh3 = xxhash_rust::xxh3::xxh3_64(&bytes[..48]);
    bytes[48..56].copy_from_slice(&xxh3.to_le_bytes());
}
