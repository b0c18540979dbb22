//! Fuzz target for the `.gst` header and index parser (`gatestream::format`). Each input is tried
//! twice: as is (the checksums stop most mutations at the header), and with its header and index
//! checksums recomputed, so mutations reach the JSON schema and layout validation. Whatever is
//! accepted must be self-consistent: every tensor row lies before the index, and the index
//! survives a JSON round trip unchanged. See docs/FORMAT.md for how to run it.

#![no_main]

use std::path::Path;

use gatestream::format::{parse_file_bytes, reseal_checksums_for_testing, Index};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gst");
    let _ = parse_file_bytes(path, data);

    let mut sealed = data.to_vec();
    reseal_checksums_for_testing(&mut sealed);
    let Ok((header, index)) = parse_file_bytes(path, &sealed) else {
        return;
    };
    for t in &index.tensors {
        if let Some(last) = t.rows.checked_sub(1) {
            let (_, end) = index.row_range(t, last).expect("an accepted tensor's last row has a range");
            assert!(end <= header.index_offset_bytes, "tensor `{}` runs into the index", t.name);
        }
    }
    let again = Index::parse(path, &index.to_json_bytes(), header.index_offset_bytes)
        .expect("an accepted index, written back as JSON, parses");
    assert_eq!(again, index, "an accepted index changes through a JSON round trip");
});
