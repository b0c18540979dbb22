//! Random damage to a valid image — byte flips, truncations, edits inside the JSON with the
//! checksums resealed so they reach the validator — must give a typed error or a valid index,
//! never a panic. The fuzz target (`fuzz/fuzz_targets/gst_index.rs`) does the same without end.

use super::*;

/// Apply one random kind of damage to a copy of `image`.
fn damage(rng: &mut XorShift, image: &[u8], index_offset: usize) -> Vec<u8> {
    let mut out = image.to_vec();
    let index_len = image.len() - index_offset;
    match rng.below(6) {
        // Flip bits anywhere, checksums left alone.
        0 => {
            for _ in 0..=rng.below(4) {
                let at = rng.below(out.len() as u64) as usize;
                out[at] ^= 1 << rng.below(8);
            }
        }
        // Truncate.
        1 => out.truncate(rng.below(image.len() as u64) as usize),
        // Flip header bytes and reseal, so the field checks (not the checksum) see them.
        2 => {
            let at = rng.below(56) as usize;
            out[at] = rng.next() as u8;
            reseal_checksums_for_testing(&mut out);
        }
        // Change a byte of the JSON and reseal.
        3 => {
            let at = index_offset + rng.below(index_len as u64) as usize;
            out[at] = b"0123456789-.,:\"{}[]ex \xff"[rng.below(23) as usize];
            reseal_checksums_for_testing(&mut out);
        }
        // Replace a digit run in the JSON with a random (often huge) number and fix the header.
        4 => {
            let json = &image[index_offset..];
            let start = rng.below(json.len() as u64) as usize;
            let Some(first) = json[start..].iter().position(u8::is_ascii_digit).map(|p| start + p) else {
                return out;
            };
            let len = json[first..].iter().take_while(|b| b.is_ascii_digit()).count();
            let number = match rng.below(4) {
                0 => u64::MAX.to_string(),
                1 => (u64::MAX - rng.below(1 << 20)).to_string(),
                2 => (1u64 << rng.below(64)).to_string(),
                _ => rng.below(1 << 16).to_string(),
            };
            let mut new_json = json[..first].to_vec();
            new_json.extend_from_slice(number.as_bytes());
            new_json.extend_from_slice(&json[first + len..]);
            out.truncate(index_offset);
            out.extend_from_slice(&new_json);
            let (len, file_len) = (new_json.len() as u64, out.len() as u64);
            out[24..32].copy_from_slice(&len.to_le_bytes());
            out[40..48].copy_from_slice(&file_len.to_le_bytes());
            reseal_checksums_for_testing(&mut out);
        }
        // Cut the JSON short and fix the header to match.
        _ => {
            let keep = rng.below(index_len as u64);
            out.truncate(index_offset + keep as usize);
            let file_len = out.len() as u64;
            out[24..32].copy_from_slice(&keep.to_le_bytes());
            out[40..48].copy_from_slice(&file_len.to_le_bytes());
            reseal_checksums_for_testing(&mut out);
        }
    }
    out
}

#[test]
fn random_damage_never_panics() {
    let (_, planned, image) = sample();
    let index_offset = planned.header.index_offset_bytes as usize;
    let mut rng = XorShift(0x2545_f491_4f6c_dd1d);
    let (mut accepted, mut rejected) = (0, 0);
    for iteration in 0..4000 {
        let damaged = damage(&mut rng, &image, index_offset);
        match parse_file_bytes(path(), &damaged) {
            Ok((header, index)) => {
                // Whatever was accepted is self-consistent: it re-validates, and every row of
                // every tensor view lies inside the file.
                index
                    .validate(path(), header.index_offset_bytes)
                    .expect("accepted index re-validates");
                for t in &index.tensors {
                    if let Some(last) = t.rows.checked_sub(1) {
                        let (_, end) = index.row_range(t, last).expect("last row in range");
                        assert!(end <= header.index_offset_bytes, "iteration {iteration}: `{}`", t.name);
                    }
                }
                accepted += 1;
            }
            Err(Error::Malformed { format: "gst", .. } | Error::Config { .. }) => rejected += 1,
            Err(other) => panic!("iteration {iteration}: unexpected error kind {other:?}"),
        }
    }
    // Some damage is harmless (a digit in a float, a header byte set to the value it had), at
    // least three in four are caught; both paths ran.
    assert!(rejected >= 3000, "rejected {rejected} of 4000");
    assert!(
        accepted > 0,
        "no damaged image was accepted: the resealing paths are not reaching the index"
    );
}

#[test]
fn reseal_handles_images_of_any_length() {
    // Regression: the fuzzer's first crash was this helper writing `index_xxh3` (bytes 32..40)
    // into a 35-byte image whose header fields read as an empty index at offset 0.
    let mut crash = vec![0u8; 35];
    crash[0] = b'f';
    crash[32..35].copy_from_slice(b"]ol");
    reseal_checksums_for_testing(&mut crash);
    assert_malformed(parse_file_bytes(path(), &crash), Some(0), &["not a .gst file"]);
    let (_, _, image) = sample();
    for len in (0..=64).chain([4095, 4096, 5000]) {
        let mut bytes = image[..len].to_vec();
        reseal_checksums_for_testing(&mut bytes);
        assert_eq!(bytes.len(), len);
        assert!(
            parse_file_bytes(path(), &bytes).is_err(),
            "a {len}-byte prefix is not a file"
        );
    }
    let mut whole = image.clone();
    reseal_checksums_for_testing(&mut whole);
    assert_eq!(whole, image, "resealing a valid image changes nothing");
}
