//! One test per rejection of the index: JSON and schema, limits, sections, tensor views, and the
//! references between them.

use super::*;

fn index_offset() -> u64 {
    sample().1.header.index_offset_bytes
}

fn section_offset(name: &str) -> u64 {
    sample().0.section(name).expect("sample section").offset_bytes
}

fn tensor_mut<'a>(index: &'a mut Index, name: &str) -> &'a mut TensorView {
    index
        .tensors
        .iter_mut()
        .find(|t| t.name == name)
        .expect("sample tensor")
}

#[test]
fn rejects_index_not_json() {
    let (_, planned, image) = sample();
    let data = &image[..planned.header.index_offset_bytes as usize];
    let r = parse_with_index_bytes(data, b"{\"format_version\": 1,, }");
    // serde_json stops at the second comma, byte 21 of the index (column 22).
    assert_malformed(r, Some(index_offset() + 21), &["is not valid JSON"]);
    let r = parse_with_index_bytes(data, &[0xff, 0xfe, b'{']);
    assert_malformed(r, Some(index_offset()), &["is not valid JSON"]);
}

#[test]
fn rejects_index_wrong_schema() {
    let (index, planned, image) = sample();
    let data = &image[..planned.header.index_offset_bytes as usize];
    let r = parse_with_index_bytes(data, br#"{"format_version": 1}"#);
    assert_malformed(r, None, &["does not match the version 1 schema", "missing field"]);
    // A negative row count.
    let json = String::from_utf8(index.to_json_bytes()).unwrap();
    let bad = json.replacen("\"rows\":256", "\"rows\":-256", 1);
    assert_ne!(bad, json);
    assert_malformed(
        parse_with_index_bytes(data, bad.as_bytes()),
        None,
        &["schema", "invalid value"],
    );
    // An unknown element type.
    let bad = json.replacen("\"dtype\":\"F16\"", "\"dtype\":\"TQ1_0\"", 1);
    assert_ne!(bad, json);
    assert_malformed(
        parse_with_index_bytes(data, bad.as_bytes()),
        None,
        &["schema", "unknown variant"],
    );
}

#[test]
fn rejects_unknown_index_field() {
    let (index, planned, image) = sample();
    let data = &image[..planned.header.index_offset_bytes as usize];
    let json = String::from_utf8(index.to_json_bytes()).unwrap();
    let bad = json.replacen('{', r#"{"compression":"zstd","#, 1);
    assert_malformed(
        parse_with_index_bytes(data, bad.as_bytes()),
        None,
        &["unknown field `compression`"],
    );
}

#[test]
fn rejects_index_version_mismatch() {
    let r = parse_changed(|ix| ix.format_version = 5);
    assert_malformed(
        r,
        Some(index_offset()),
        &["index says gst format version 5, this build reads 1 to 4"],
    );
    let r = parse_changed(|ix| ix.format_version = 0);
    assert_malformed(r, Some(index_offset()), &["index says gst format version 0"]);
    // Index and header must agree (the sample's header says 2).
    let r = parse_changed(|ix| ix.format_version = 1);
    assert_malformed(
        r,
        Some(index_offset()),
        &["index says gst format version 1, the header says 4"],
    );
}

#[test]
fn rejects_invalid_model_config() {
    let r = parse_changed(|ix| ix.config.n_kv_heads = 3);
    assert!(
        matches!(&r, Err(Error::Config { what, .. }) if what.contains("KV heads")),
        "{r:?}"
    );
}

#[test]
fn rejects_config_numbers_out_of_f32_range() {
    // 1e39 is a valid JSON number beyond f32: refused where it stands (it must never become
    // infinity; the config check for non-finite numbers is the second line of defence).
    let (index, planned, image) = sample();
    let data = &image[..planned.header.index_offset_bytes as usize];
    let json = String::from_utf8(index.to_json_bytes()).unwrap();
    let bad = json.replacen("\"rope_theta\":10000.0", "\"rope_theta\":1e39", 1);
    assert_ne!(bad, json);
    let at =
        (index_offset() + bad.find("1e39").unwrap() as u64)..=(index_offset() + bad.find("1e39").unwrap() as u64 + 4);
    let r = parse_with_index_bytes(data, bad.as_bytes());
    match &r {
        Err(Error::Malformed { offset_bytes, .. }) => assert!(at.contains(offset_bytes), "{r:?} not in {at:?}"),
        other => panic!("expected Error::Malformed, got {other:?}"),
    }
    assert_malformed(r, None, &["out of range"]);
}

#[test]
fn rejects_too_many_sections() {
    let (mut index, _, _) = sample();
    let one = index.sections[0].clone();
    index.sections = vec![one; SECTIONS_MAX + 1];
    assert_malformed(
        index.validate(path(), index_offset()),
        Some(index_offset()),
        &["1000001 sections"],
    );
}

#[test]
fn rejects_too_many_tensors() {
    let (mut index, _, _) = sample();
    let one = index.tensors[0].clone();
    index.tensors = vec![one; TENSORS_MAX + 1];
    assert_malformed(
        index.validate(path(), index_offset()),
        Some(index_offset()),
        &["1000001 tensors"],
    );
}

#[test]
fn rejects_section_not_aligned() {
    let at = section_offset("globals") + 512;
    let r = parse_changed(|ix| ix.sections[1].offset_bytes = at);
    assert_malformed(r, Some(at), &["section `globals`", "not a multiple of 4096"]);
}

#[test]
fn rejects_section_overlapping_header() {
    let r = parse_changed(|ix| ix.sections[0].offset_bytes = 0);
    assert_malformed(r, Some(0), &["section `tokenizer`", "inside the 4096-byte header page"]);
}

#[test]
fn rejects_section_overlapping_index() {
    let at = section_offset("calibration.frequencies");
    let r = parse_changed(|ix| ix.sections.last_mut().unwrap().len_bytes += 1);
    assert_malformed(
        r,
        Some(at),
        &["calibration.frequencies", "runs past the start of the index"],
    );
}

#[test]
fn rejects_section_beyond_file() {
    let r = parse_changed(|ix| ix.sections[1].offset_bytes = 1 << 40);
    assert_malformed(r, Some(1 << 40), &["section `globals`", "runs past"]);
    // offset + len overflowing u64 is an error, not a panic.
    let at = u64::MAX - 4095;
    let r = parse_changed(|ix| {
        ix.sections[1].offset_bytes = at;
        ix.sections[1].len_bytes = 1 << 20;
    });
    assert_malformed(r, Some(at), &["runs past"]);
}

#[test]
fn rejects_overlapping_sections() {
    let at = section_offset("globals");
    // blk.0.dense is smaller than its distance to the index, so this only overlaps `globals`.
    let r = parse_changed(|ix| ix.sections[2].offset_bytes = at);
    assert_malformed(r, Some(at), &["overlaps section"]);
}

#[test]
fn rejects_duplicate_section_name() {
    let r = parse_changed(|ix| ix.sections[2].name = "globals".into());
    assert_malformed(r, None, &["section `globals`", "a second section has this name"]);
}

#[test]
fn rejects_duplicate_tensor_name() {
    let r = parse_changed(|ix| ix.tensors[3].name = ix.tensors[2].name.clone());
    assert_malformed(r, Some(index_offset()), &["a second tensor has this name"]);
}

#[test]
fn rejects_tensor_in_missing_section() {
    let r = parse_changed(|ix| ix.tensors[0].section = "embeddings".into());
    assert_malformed(
        r,
        Some(index_offset()),
        &["tensor `token_embd`", "section `embeddings`, which is not in the index"],
    );
}

#[test]
fn rejects_tensor_rows_past_section() {
    let at = section_offset("blk.0.ffn");
    let r = parse_changed(|ix| tensor_mut(ix, "blk.0.ffn_down").rows += 1);
    assert_malformed(
        r,
        Some(at),
        &["tensor `blk.0.ffn_down`", "run past the end of section `blk.0.ffn`"],
    );
}

#[test]
fn rejects_tensor_offset_past_section() {
    let r = parse_changed(|ix| tensor_mut(ix, "blk.0.ffn_down").offset_in_section_bytes += 1);
    assert_malformed(r, None, &["run past the end of section"]);
    // A view with no rows still has to start inside its section.
    let r = parse_changed(|ix| {
        let t = tensor_mut(ix, "output_norm");
        t.rows = 0;
        t.offset_in_section_bytes = 1 << 30;
    });
    assert_malformed(r, None, &["run past the end of section `globals`"]);
}

#[test]
fn rejects_tensor_stride_past_section() {
    let r = parse_changed(|ix| tensor_mut(ix, "blk.1.ffn_up").row_stride_bytes += 1);
    assert_malformed(r, None, &["tensor `blk.1.ffn_up`", "run past the end"]);
}

#[test]
fn rejects_tensor_extent_overflowing_u64() {
    let r = parse_changed(|ix| tensor_mut(ix, "blk.0.ffn_gate").row_stride_bytes = u64::MAX / 2);
    assert_malformed(r, None, &["tensor `blk.0.ffn_gate`", "run past the end"]);
    let r = parse_changed(|ix| tensor_mut(ix, "blk.0.ffn_gate").offset_in_section_bytes = u64::MAX);
    assert_malformed(r, None, &["run past the end"]);
}

#[test]
fn rejects_stride_smaller_than_row() {
    let r = parse_changed(|ix| tensor_mut(ix, "blk.0.ffn_gate").row_stride_bytes = 67);
    assert_malformed(r, None, &["row stride 67 bytes is smaller than a row (68 bytes"]);
}

#[test]
fn rejects_cols_not_whole_blocks() {
    let r = parse_changed(|ix| tensor_mut(ix, "blk.0.attn_q").cols = 48);
    assert_malformed(r, None, &["48 columns is not a whole number of Q8_0 blocks of 32"]);
}

#[test]
fn rejects_rows_over_limit() {
    let r = parse_changed(|ix| tensor_mut(ix, "output_norm").rows = DIM_MAX + 1);
    assert_malformed(r, None, &["exceeds the limit of 4294967296"]);
}

#[test]
fn rejects_cols_over_limit() {
    let r = parse_changed(|ix| tensor_mut(ix, "output_norm").cols = DIM_MAX + 32);
    assert_malformed(r, None, &["exceeds the limit of 4294967296"]);
}

#[test]
fn rejects_long_names() {
    let long = "x".repeat(NAME_LEN_MAX_BYTES + 1);
    let r = parse_changed(|ix| ix.sections[1].name = long.clone());
    assert_malformed(r, None, &["name is 1025 bytes long"]);
    let r = parse_changed(|ix| ix.tensors[1].name = long.clone());
    assert_malformed(r, None, &["name is 1025 bytes long"]);
    let r = parse_changed(|ix| ix.source.file_name = long.repeat(5));
    assert_malformed(r, None, &["source.file_name is 5125 bytes long"]);
}

#[test]
fn rejects_empty_names() {
    let r = parse_changed(|ix| ix.tensors[1].name = String::new());
    assert_malformed(r, None, &["name is 0 bytes long"]);
}

#[test]
fn rejects_bad_section_checksum_string() {
    let r = parse_changed(|ix| ix.sections[1].xxh3 = "xyz".into());
    assert_malformed(r, None, &["section `globals`", "not 16 lowercase hex digits"]);
    let r = parse_changed(|ix| ix.sections[1].xxh3 = ix.sections[1].xxh3.to_uppercase());
    assert_malformed(r, None, &["not 16 lowercase hex digits"]);
}

#[test]
fn rejects_bad_source_checksum_string() {
    let r = parse_changed(|ix| ix.source.xxh3.push('0'));
    assert_malformed(r, Some(index_offset()), &["source.xxh3", "not 16 lowercase hex digits"]);
}

#[test]
fn rejects_missing_tokenizer_section() {
    let r = parse_changed(|ix| ix.tokenizer_section = "vocab".into());
    assert_malformed(r, Some(index_offset()), &["tokenizer_section names section `vocab`"]);
}

#[test]
fn rejects_missing_frequencies_section() {
    let r = parse_changed(|ix| ix.calibration.as_mut().unwrap().frequencies_section = "freq".into());
    assert_malformed(r, None, &["calibration.frequencies_section names section `freq`"]);
}

#[test]
fn rejects_frequencies_section_of_wrong_length() {
    let at = section_offset("calibration.frequencies");
    let r = parse_changed(|ix| ix.sections.last_mut().unwrap().len_bytes -= 4);
    assert_malformed(r, Some(at), &["1020 bytes, expected 1024"]);
}

#[test]
fn rejects_calibration_layer_count() {
    let r = parse_changed(|ix| {
        ix.calibration.as_mut().unwrap().layers.pop();
    });
    assert_malformed(r, None, &["calibration has 1 layers, the model has 2"]);
}

#[test]
fn rejects_calibration_values_out_of_range() {
    let r = parse_changed(|ix| ix.calibration.as_mut().unwrap().layers[1].hot_prefix_25 = 1.5);
    assert_malformed(r, None, &["calibration of layer 1"]);
    // Infinity does not survive JSON; check the struct rule directly.
    let (mut index, _, _) = sample();
    index.calibration.as_mut().unwrap().layers[0].thresholds[3].1 = f32::INFINITY;
    assert_malformed(
        index.validate(path(), index_offset()),
        None,
        &["calibration of layer 0"],
    );
}

#[test]
fn rejects_requant_errors_of_wrong_length_or_value() {
    let r = parse_changed(|ix| ix.down_requant_rel_rms.push(0.1));
    assert_malformed(r, None, &["down_requant_rel_rms has 3 entries, expected 0 or 2"]);
    let r = parse_changed(|ix| ix.down_requant_rel_rms[0] = -0.5);
    assert_malformed(r, None, &["negative or non-finite"]);
    // Empty (down kept as stored) and no calibration at all are both fine.
    parse_changed(|ix| {
        ix.down_requant_rel_rms.clear();
        ix.calibration = None;
    })
    .expect("optional parts may be absent");
}

#[test]
fn recommended_sparse_round_trips_and_rejects_bad_values() {
    let good = Recommendation {
        strategy: "topk".into(),
        criterion: "exact".into(),
        sparsity: 0.3,
        max_ppl_increase_pct: 2.0,
        measured_ppl_increase_pct: 0.5,
        top1_agreement: 0.94,
        ffn_bytes_rel_dense: 0.86,
        measured_on: "wiki.test.raw, 20 windows of 512".into(),
        per_layer_sparsity: None,
    };
    let g = good.clone();
    let (_, ix) = parse_changed(move |ix| ix.recommended_sparse = Some(g)).unwrap();
    assert_eq!(ix.recommended_sparse, Some(good.clone()));
    // Per-layer levels: one per layer, averaging to `sparsity`.
    let (sample_ix, _, _) = sample();
    let n = sample_ix.config.n_layers;
    let mut levels = vec![0.3f32; n];
    levels[0] = 0.1;
    levels[n - 1] = 0.5;
    let layered = Recommendation {
        per_layer_sparsity: Some(levels.clone()),
        ..good.clone()
    };
    let g = layered.clone();
    let (_, ix) = parse_changed(move |ix| ix.recommended_sparse = Some(g)).unwrap();
    assert_eq!(ix.recommended_sparse, Some(layered.clone()));
    // A version 1 file reads, but cannot hold per-layer levels.
    let as_version_1 = |r: Option<Recommendation>| {
        let (mut index, planned, image) = sample();
        index.format_version = 1;
        index.recommended_sparse = r;
        let data_end = planned.header.index_offset_bytes as usize;
        parse_with_header_version(&image[..data_end], &index.to_json_bytes(), 1)
    };
    let (header, _) = as_version_1(Some(good.clone())).expect("a version 1 file reads");
    assert_eq!(header.format_version, 1);
    let r = as_version_1(Some(layered.clone()));
    assert_malformed(
        r,
        Some(index_offset()),
        &["recommended_sparse is not a valid configuration"],
    );
    // One level short; a mean (0.5) other than `sparsity` (0.3); a level of 1.
    let mut level_one = levels.clone();
    level_one[1] = 1.0;
    for p in [levels[..n - 1].to_vec(), vec![0.5; n], level_one] {
        let bad = Recommendation {
            per_layer_sparsity: Some(p),
            ..good.clone()
        };
        let r = parse_with_index_bytes_of(|ix| ix.recommended_sparse = Some(bad));
        assert!(r.is_err());
    }
    let r = parse_with_index_bytes_of(|ix| {
        ix.recommended_sparse = Some(Recommendation {
            strategy: "threshold".into(),
            ..layered
        })
    });
    assert!(r.is_err(), "per-layer levels are for top-K only");
    for bad in [
        Recommendation {
            strategy: "random".into(),
            ..good.clone()
        },
        Recommendation {
            criterion: "".into(),
            ..good.clone()
        },
        Recommendation {
            sparsity: 1.0,
            ..good.clone()
        },
        Recommendation {
            top1_agreement: f32::NAN,
            ..good.clone()
        },
    ] {
        let r = parse_with_index_bytes_of(|ix| ix.recommended_sparse = Some(bad));
        assert!(r.is_err());
    }
}

/// Serialize the changed sample index by hand (a NaN cannot go through `Index::to_json_bytes`
/// into a valid document, so this checks the parser rejects whatever reaches it).
fn parse_with_index_bytes_of(change: impl FnOnce(&mut Index)) -> Result<(Header, Index)> {
    let (mut index, planned, image) = sample();
    change(&mut index);
    let json = serde_json::to_vec(&index).unwrap_or_else(|_| b"{".to_vec());
    parse_with_index_bytes(&image[..planned.header.index_offset_bytes as usize], &json)
}

#[test]
fn rejects_experts_in_an_index_older_than_version_3() {
    let moe = crate::config::MoeConfig::softmax(4, 2, true);
    let (mut index, planned, image) = sample();
    index.format_version = 2;
    index.config.moe = Some(moe.clone());
    let data = &image[..planned.header.index_offset_bytes as usize];
    let r = parse_with_header_version(data, &index.to_json_bytes(), 2);
    assert_malformed(
        r,
        Some(index_offset()),
        &["mixture-of-experts config", "version 2 index", "version 3"],
    );
    // The same config at version 3 is accepted.
    parse_changed(|ix| ix.config.moe = Some(moe)).expect("version 3 reads experts");
}

#[test]
fn rejects_the_rows_layout_in_an_index_older_than_version_4() {
    let (mut index, planned, image) = sample();
    index.format_version = 3;
    index.layout.ffn_layout = crate::format::FfnLayout::Rows;
    let data = &image[..planned.header.index_offset_bytes as usize];
    let r = parse_with_header_version(data, &index.to_json_bytes(), 3);
    assert_malformed(
        r,
        Some(index_offset()),
        &["`rows` FFN layout", "version 3 index", "version 4"],
    );
    // The same layout at version 4 is accepted.
    parse_changed(|ix| ix.layout.ffn_layout = crate::format::FfnLayout::Rows).expect("version 4 reads rows");
}
