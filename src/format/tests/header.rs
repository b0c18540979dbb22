//! One test per rejection of the header and of the file as a whole (length, index checksum).

use super::*;

/// The sample image with its header replaced by `header` (checksum recomputed by `to_bytes`).
fn with_header(change: impl FnOnce(&mut Header)) -> Vec<u8> {
    let (_, planned, mut image) = sample();
    let mut header = planned.header;
    change(&mut header);
    image[..HEADER_BYTES as usize].copy_from_slice(&header.to_bytes());
    image
}

#[test]
fn rejects_file_shorter_than_magic() {
    let (_, _, image) = sample();
    assert_malformed(
        parse_file_bytes(path(), &image[..5]),
        Some(5),
        &["truncated", "5 bytes"],
    );
    assert_malformed(parse_file_bytes(path(), &[]), Some(0), &["truncated"]);
}

#[test]
fn rejects_file_shorter_than_header_fields() {
    let (_, _, image) = sample();
    assert_malformed(
        parse_file_bytes(path(), &image[..40]),
        Some(40),
        &["truncated", "40 bytes"],
    );
}

#[test]
fn rejects_file_shorter_than_header_page() {
    let (_, _, image) = sample();
    assert_malformed(
        parse_file_bytes(path(), &image[..4000]),
        Some(4000),
        &["truncated", "4096-byte header page"],
    );
}

#[test]
fn rejects_truncated_file() {
    let (_, _, image) = sample();
    let cut = image.len() - 1;
    assert_malformed(
        parse_file_bytes(path(), &image[..cut]),
        Some(cut as u64),
        &["truncated", "incomplete"],
    );
    // Cut inside the sections, well before the index.
    assert_malformed(parse_file_bytes(path(), &image[..10_000]), Some(10_000), &["truncated"]);
}

#[test]
fn rejects_trailing_bytes() {
    let (_, _, mut image) = sample();
    let len = image.len() as u64;
    image.extend_from_slice(&[0; 3]);
    assert_malformed(parse_file_bytes(path(), &image), Some(len), &["3 bytes follow"]);
}

#[test]
fn rejects_bad_magic() {
    let (_, _, mut image) = sample();
    image[..4].copy_from_slice(b"GGUF");
    assert_malformed(
        parse_file_bytes(path(), &image),
        Some(0),
        &["not a .gst file", "gatestream reformat"],
    );
}

#[test]
fn rejects_unknown_version() {
    let image = with_header(|h| h.format_version = 5);
    assert_malformed(
        parse_file_bytes(path(), &image),
        Some(8),
        &["gst format version 5, this build reads 1 to 4; re-run gatestream reformat"],
    );
}

#[test]
fn rejects_header_checksum_mismatch() {
    let (_, _, mut image) = sample();
    image[20] ^= 0x40; // inside index_offset_bytes, without resealing
    assert_malformed(
        parse_file_bytes(path(), &image),
        Some(48),
        &["header checksum mismatch"],
    );
}

#[test]
fn rejects_wrong_header_bytes() {
    let (_, _, mut image) = sample();
    image[12..16].copy_from_slice(&8192u32.to_le_bytes());
    reseal_checksums_for_testing(&mut image);
    assert_malformed(parse_file_bytes(path(), &image), Some(12), &["header_bytes is 8192"]);
}

#[test]
fn rejects_nonzero_reserved_bytes() {
    let (_, _, mut image) = sample();
    image[60] = 1;
    assert_malformed(parse_file_bytes(path(), &image), Some(60), &["reserved header byte"]);
}

#[test]
fn rejects_nonzero_header_padding() {
    let (_, _, mut image) = sample();
    image[1000] = 7;
    assert_malformed(parse_file_bytes(path(), &image), Some(1000), &["padding is not zero"]);
}

#[test]
fn rejects_index_range_beyond_file() {
    let image = with_header(|h| h.index_len_bytes += 1);
    assert_malformed(
        parse_file_bytes(path(), &image),
        Some(16),
        &["runs past the end of the file"],
    );
}

#[test]
fn rejects_bytes_after_index_per_header() {
    let image = with_header(|h| h.file_len_bytes += 10);
    assert_malformed(
        parse_file_bytes(path(), &image),
        Some(40),
        &["nothing may follow the index"],
    );
}

#[test]
fn rejects_index_inside_header_page() {
    let image = with_header(|h| {
        h.index_offset_bytes = 64;
        h.file_len_bytes = 64 + h.index_len_bytes;
    });
    assert_malformed(
        parse_file_bytes(path(), &image),
        Some(16),
        &["inside the 4096-byte header page"],
    );
}

#[test]
fn rejects_empty_index() {
    let image = with_header(|h| {
        h.index_offset_bytes += h.index_len_bytes;
        h.index_len_bytes = 0;
    });
    assert_malformed(parse_file_bytes(path(), &image), Some(24), &["index length 0 bytes"]);
}

#[test]
fn rejects_index_over_size_limit() {
    let image = with_header(|h| {
        h.index_len_bytes = INDEX_LEN_MAX_BYTES + 1;
        h.file_len_bytes = h.index_offset_bytes + h.index_len_bytes;
    });
    assert_malformed(parse_file_bytes(path(), &image), Some(24), &["outside 1..=268435456"]);
}

#[test]
fn rejects_index_range_overflowing_u64() {
    let image = with_header(|h| {
        h.index_offset_bytes = u64::MAX - 10;
        h.file_len_bytes = u64::MAX;
    });
    assert_malformed(parse_file_bytes(path(), &image), Some(16), &["overflows"]);
}

#[test]
fn rejects_index_checksum_mismatch() {
    let (_, planned, mut image) = sample();
    let last = image.len() - 1;
    image[last] = b' '; // the closing brace, without resealing
    assert_malformed(
        parse_file_bytes(path(), &image),
        Some(planned.header.index_offset_bytes),
        &["index checksum mismatch"],
    );
}

#[test]
fn header_to_bytes_is_one_page_and_parses_back() {
    let (_, planned, _) = sample();
    let page = planned.header.to_bytes();
    assert_eq!(page.len() as u64, HEADER_BYTES);
    assert_eq!(&page[..8], b"GSTREAM\0");
    assert_eq!(u32::from_le_bytes(page[12..16].try_into().unwrap()), 4096);
    assert!(page[56..].iter().all(|&b| b == 0));
    assert_eq!(Header::parse(path(), &page).expect("parses"), planned.header);
}
