//! Tests of the `.gst` format: a small but real-looking file (two llama layers, bundled FFN,
//! calibration) built through `plan_layout`, the round trip, one named test per rejection
//! (`header.rs`, `index.rs`), and random damage that must never panic (`damage.rs`).

mod damage;
mod header;
mod index;

use std::path::Path;

use super::*;
use crate::config::{Arch, FfnActivation, RopeStyle};
use crate::error::{Error, Result};

pub(super) const PATH: &str = "test.gst";

pub(super) fn path() -> &'static Path {
    Path::new(PATH)
}

/// A tiny Llama-style configuration ([hidden 64, ffn 128], 2 layers, GQA 4:2).
pub(super) fn config() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        hidden: 64,
        ffn: 128,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        vocab: 256,
        context_len: 512,
        rms_eps: 1e-5,
        rope_theta: 10000.0,
        rope_theta_local: 10000.0,
        rope_scale_global: 1.0,
        rope_freq_factors: None,
        rope_style: RopeStyle::AdjacentPairs,
        activation: FfnActivation::Silu,
        sliding_window: None,
        sliding_pattern: 6,
        attn_scale: 0.25,
        embed_scale: 1.0,
        qk_norm: false,
        post_norms: false,
        attn_bias: false,
        final_logit_softcap: None,
        qk_norm_whole: false,
        moe: None,
        mla: None,
        // (0: the whole head.)
        rope_dim: 0,
        nextn_layers: 0,
        attn_sinks: false,
    }
}

/// Deterministic bytes for payloads and the damage tests.
pub(super) struct XorShift(pub u64);

impl XorShift {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

struct Builder {
    sections: Vec<Section>,
    payloads: Vec<Vec<u8>>,
    tensors: Vec<TensorView>,
    rng: XorShift,
}

impl Builder {
    fn section(&mut self, name: &str, payload: Vec<u8>) {
        self.sections.push(Section {
            name: name.into(),
            offset_bytes: 0,
            len_bytes: 0,
            xxh3: String::new(),
        });
        self.payloads.push(payload);
    }

    /// A section of whole tensors one after another, each as `(name, dtype, rows, cols)`.
    fn dense(&mut self, section: &str, tensors: &[(&str, GgmlType, u64, u64)]) {
        let mut len = 0u64;
        for &(name, dtype, rows, cols) in tensors {
            let row_bytes = dtype.row_bytes(cols as usize).unwrap() as u64;
            self.tensors.push(TensorView {
                name: name.into(),
                section: section.into(),
                offset_in_section_bytes: len,
                dtype,
                rows,
                cols,
                row_stride_bytes: row_bytes,
            });
            len += rows * row_bytes;
        }
        let payload = self.rng.bytes(len as usize);
        self.section(section, payload);
    }

    /// A bundled FFN section: neuron n's up row then its down column, `ffn` times.
    fn bundle(&mut self, section: &str, up: &str, down: &str, ffn: u64, hidden: u64) {
        let row_bytes = GgmlType::Q8_0.row_bytes(hidden as usize).unwrap() as u64;
        for (name, offset) in [(up, 0), (down, row_bytes)] {
            self.tensors.push(TensorView {
                name: name.into(),
                section: section.into(),
                offset_in_section_bytes: offset,
                dtype: GgmlType::Q8_0,
                rows: ffn,
                cols: hidden,
                row_stride_bytes: 2 * row_bytes,
            });
        }
        let payload = self.rng.bytes((ffn * 2 * row_bytes) as usize);
        self.section(section, payload);
    }
}

/// The sample index (offsets and checksums not yet filled in) and its section payloads.
pub(super) fn sample_parts() -> (Index, Vec<Vec<u8>>) {
    let cfg = config();
    let (hidden, ffn) = (cfg.hidden as u64, cfg.ffn as u64);
    let (q_dim, kv_dim) = (cfg.q_dim() as u64, cfg.kv_dim() as u64);
    let mut b = Builder {
        sections: Vec::new(),
        payloads: Vec::new(),
        tensors: Vec::new(),
        rng: XorShift(0x9e37_79b9_7f4a_7c15),
    };
    b.section("tokenizer", br#"{"kind":"test","vocab":256}"#.to_vec());
    b.dense(
        "globals",
        &[
            ("token_embd", GgmlType::F16, cfg.vocab as u64, hidden), // [vocab, hidden]
            ("output_norm", GgmlType::F32, 1, hidden),               // [hidden]
        ],
    );
    for l in 0..cfg.n_layers {
        let n = |t: &str| format!("blk.{l}.{t}");
        b.dense(
            &n("dense"),
            &[
                (&n("attn_norm"), GgmlType::F32, 1, hidden),        // [hidden]
                (&n("attn_q"), GgmlType::Q8_0, q_dim, hidden),      // [q_dim, hidden]
                (&n("attn_k"), GgmlType::Q8_0, kv_dim, hidden),     // [kv_dim, hidden]
                (&n("attn_v"), GgmlType::Q8_0, kv_dim, hidden),     // [kv_dim, hidden]
                (&n("attn_output"), GgmlType::Q8_0, hidden, q_dim), // [hidden, q_dim]
                (&n("ffn_norm"), GgmlType::F32, 1, hidden),         // [hidden]
                (&n("ffn_gate"), GgmlType::Q8_0, ffn, hidden),      // [ffn, hidden]
            ],
        );
        // up rows [ffn, hidden] and down columns [ffn, hidden], interleaved.
        b.bundle(&n("ffn"), &n("ffn_up"), &n("ffn_down"), ffn, hidden);
    }
    let freqs: Vec<u8> = (0..cfg.n_layers * cfg.ffn)
        .flat_map(|i| (1.0 / (1 + i % cfg.ffn) as f32).to_le_bytes())
        .collect();
    b.section("calibration.frequencies", freqs);
    let layer = LayerCalibration {
        thresholds: (1..10).map(|k| (k as f32 / 10.0, 0.01 * k as f32)).collect(),
        hot_prefix_10: 0.21,
        hot_prefix_25: 0.37,
    };
    let index = Index {
        format_version: FORMAT_VERSION,
        config: cfg.clone(),
        layout: Layout {
            ffn_layout: FfnLayout::Bundled,
            neuron_order: NeuronOrder::HotFirst,
            down_type: GgmlType::Q8_0,
            up_sketch: UpSketch::None,
        },
        source: SourceInfo {
            file_name: "tiny-llama.gguf".into(),
            len_bytes: 123_456,
            xxh3: checksum_hex(b"tiny-llama.gguf"),
        },
        tokenizer_section: "tokenizer".into(),
        calibration: Some(Calibration {
            tokens: 4096,
            text: "wiki.train.raw, first 4096 tokens".into(),
            frequencies_section: "calibration.frequencies".into(),
            layers: vec![layer; cfg.n_layers],
        }),
        down_requant_rel_rms: vec![0.004, 0.005],
        recommended_sparse: None,
        sections: b.sections,
        tensors: b.tensors,
    };
    (index, b.payloads)
}

/// Lay out the header, padding, payloads and index exactly as the writer does.
pub(super) fn assemble(planned: &Planned, payloads: &[Vec<u8>]) -> Vec<u8> {
    let mut image = planned.header.to_bytes();
    for (&offset, payload) in planned.section_offsets.iter().zip(payloads) {
        image.resize(offset as usize, 0);
        image.extend_from_slice(payload);
    }
    assert_eq!(image.len() as u64, planned.header.index_offset_bytes);
    image.extend_from_slice(&planned.index_bytes);
    image
}

/// The planned sample index and its file image.
pub(super) fn sample() -> (Index, Planned, Vec<u8>) {
    let (mut index, payloads) = sample_parts();
    let lens: Vec<u64> = payloads.iter().map(|p| p.len() as u64).collect();
    let sums: Vec<String> = payloads.iter().map(|p| checksum_hex(p)).collect();
    let planned = plan_layout(&mut index, &lens, &sums).expect("the sample index is valid");
    let image = assemble(&planned, &payloads);
    (index, planned, image)
}

/// The sample's image with its index replaced by `index` (sections stay where they were; the
/// header is rewritten with correct checksums), then parsed. Bypasses `plan_layout`'s checks, so
/// a test can hand the reader an index no writer would produce.
pub(super) fn parse_with_index(index: &Index) -> Result<(Header, Index)> {
    let (_, planned, image) = sample();
    let data_end = planned.header.index_offset_bytes as usize;
    parse_with_index_bytes(&image[..data_end], &index.to_json_bytes())
}

pub(super) fn parse_with_index_bytes(data: &[u8], index_bytes: &[u8]) -> Result<(Header, Index)> {
    parse_with_header_version(data, index_bytes, FORMAT_VERSION)
}

/// As `parse_with_index_bytes`, with the header saying `format_version`.
pub(super) fn parse_with_header_version(
    data: &[u8],
    index_bytes: &[u8],
    format_version: u32,
) -> Result<(Header, Index)> {
    let header = Header {
        format_version,
        index_offset_bytes: data.len() as u64,
        index_len_bytes: index_bytes.len() as u64,
        index_xxh3: xxhash_rust::xxh3::xxh3_64(index_bytes),
        file_len_bytes: (data.len() + index_bytes.len()) as u64,
    };
    let mut image = data.to_vec();
    image[..HEADER_BYTES as usize].copy_from_slice(&header.to_bytes());
    image.extend_from_slice(index_bytes);
    parse_file_bytes(path(), &image)
}

/// The sample index, changed by `change`, through the reader.
pub(super) fn parse_changed(change: impl FnOnce(&mut Index)) -> Result<(Header, Index)> {
    let (mut index, _, _) = sample();
    change(&mut index);
    parse_with_index(&index)
}

/// Assert `r` is a `Malformed` gst error at `offset_bytes` (when given) whose message contains
/// every one of `needles`, and that the rendered message names the file.
#[track_caller]
pub(super) fn assert_malformed<T: std::fmt::Debug>(r: Result<T>, offset: Option<u64>, needles: &[&str]) {
    let e = r.expect_err("expected a rejection");
    let message = e.to_string();
    match &e {
        Error::Malformed {
            path: p,
            format,
            offset_bytes,
            what,
        } => {
            assert_eq!(p, path(), "{message}");
            assert_eq!(*format, "gst", "{message}");
            if let Some(offset) = offset {
                assert_eq!(*offset_bytes, offset, "{message}");
            }
            for needle in needles {
                assert!(what.contains(needle), "`{needle}` not in: {message}");
            }
            assert!(message.contains(PATH), "{message}");
        }
        other => panic!("expected Error::Malformed, got {other:?}"),
    }
}

#[test]
fn round_trip_through_plan_layout_and_parse() {
    let (index, planned, image) = sample();
    let (header, parsed) = parse_file_bytes(path(), &image).expect("valid image parses");
    assert_eq!(header, planned.header);
    assert_eq!(parsed, index);
    assert_eq!(header.file_len_bytes, image.len() as u64);
    // Every section's payload is where the index says and matches its checksum.
    for s in &parsed.sections {
        let bytes = &image[s.offset_bytes as usize..(s.offset_bytes + s.len_bytes) as usize];
        verify_section(path(), s, bytes).expect("payload matches its checksum");
    }
}

#[test]
fn plan_layout_aligns_sections_and_puts_the_index_last() {
    let (index, planned, image) = sample();
    assert_eq!(planned.section_offsets.first(), Some(&HEADER_BYTES));
    let mut end = HEADER_BYTES;
    for (s, &offset) in index.sections.iter().zip(&planned.section_offsets) {
        assert_eq!(s.offset_bytes, offset);
        assert_eq!(offset % ALIGN_BYTES, 0);
        assert_eq!(
            offset,
            end.next_multiple_of(ALIGN_BYTES),
            "section `{}` is not packed",
            s.name
        );
        // Padding between sections is zero.
        assert!(image[end as usize..offset as usize].iter().all(|&b| b == 0));
        end = offset + s.len_bytes;
    }
    assert_eq!(planned.header.index_offset_bytes, end);
    assert_eq!(planned.header.file_len_bytes, image.len() as u64);
    assert_eq!(&image[end as usize..], planned.index_bytes.as_slice());
}

#[test]
fn plan_layout_rejects_mismatched_section_counts() {
    let (mut index, payloads) = sample_parts();
    let lens: Vec<u64> = payloads.iter().map(|p| p.len() as u64).collect();
    let sums: Vec<String> = payloads.iter().map(|p| checksum_hex(p)).collect();
    let r = plan_layout(&mut index, &lens[1..], &sums);
    assert!(
        matches!(&r, Err(Error::Internal(m)) if m.contains("must match")),
        "{r:?}"
    );
}

#[test]
fn plan_layout_rejects_an_index_the_reader_would_reject() {
    // NaN cannot be written as JSON (serde_json writes null), so the file would not read back.
    let (mut index, payloads) = sample_parts();
    index.down_requant_rel_rms[1] = f32::NAN;
    let lens: Vec<u64> = payloads.iter().map(|p| p.len() as u64).collect();
    let sums: Vec<String> = payloads.iter().map(|p| checksum_hex(p)).collect();
    let e = plan_layout(&mut index, &lens, &sums).expect_err("NaN must be refused");
    assert!(e.to_string().contains("schema"), "{e}");
    // And a bad checksum string from the writer is caught before anything is written.
    let (mut index, _) = sample_parts();
    let mut bad_sums = sums.clone();
    bad_sums[0] = "not hex".into();
    let e = plan_layout(&mut index, &lens, &bad_sums).expect_err("bad checksum must be refused");
    assert!(e.to_string().contains("16 lowercase hex digits"), "{e}");
}

#[test]
fn row_range_matches_the_layout() {
    let (index, _, image) = sample();
    let down = index.tensor("blk.1.ffn_down").expect("tensor exists");
    let section = index.section("blk.1.ffn").expect("section exists");
    let row_bytes = 68; // Q8_0: 64 columns = 2 blocks of 34 bytes
    assert_eq!(down.row_bytes(), Some(row_bytes));
    for r in [0, 1, 127] {
        let start = section.offset_bytes + row_bytes + r * 2 * row_bytes;
        assert_eq!(index.row_range(down, r), Some((start, start + row_bytes)));
    }
    let (_, last_end) = index.row_range(down, 127).expect("last row");
    assert_eq!(last_end, section.offset_bytes + section.len_bytes);
    assert!(last_end <= image.len() as u64);
    assert_eq!(index.row_range(down, 128), None, "row past the end");
    assert_eq!(index.row_range(down, u64::MAX), None);
    let mut orphan = down.clone();
    orphan.section = "missing".into();
    assert_eq!(index.row_range(&orphan, 0), None, "tensor whose section is missing");
    let mut huge = down.clone();
    huge.row_stride_bytes = u64::MAX / 2;
    assert_eq!(index.row_range(&huge, 100), None, "overflow is None, not a panic");
}

#[test]
fn verify_section_accepts_good_bytes_and_rejects_damage() {
    let (index, _, image) = sample();
    let s = index.section("globals").expect("section exists");
    let range = s.offset_bytes as usize..(s.offset_bytes + s.len_bytes) as usize;
    verify_section(path(), s, &image[range.clone()]).expect("intact");
    let mut damaged = image[range.clone()].to_vec();
    damaged[100] ^= 1;
    assert_malformed(
        verify_section(path(), s, &damaged),
        Some(s.offset_bytes),
        &["`globals` checksum mismatch", "re-run `gatestream reformat`"],
    );
    assert_malformed(
        verify_section(path(), s, &image[range.start..range.end - 1]),
        Some(s.offset_bytes),
        &["got", "bytes to verify"],
    );
}

#[test]
fn checksum_hex_is_16_lowercase_hex_digits() {
    let h = checksum_hex(b"");
    assert_eq!(h, format!("{:016x}", xxhash_rust::xxh3::xxh3_64(b"")));
    assert_eq!(h.len(), 16);
    assert!(h.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
    assert_eq!(checksum_to_hex(1), "0000000000000001");
}

/// Writes the sample image as the fuzzer's seed. Not a test of the library, and it writes
/// outside a temporary directory, so it only runs when asked for.
#[test]
#[ignore = "writes fuzz/corpus/gst_index/sample.gst; run by hand to seed the fuzzer: \
            cargo test --release --lib format::tests::write_fuzz_seed -- --ignored"]
fn write_fuzz_seed() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/gst_index");
    std::fs::create_dir_all(&dir).expect("create corpus dir");
    let (_, _, image) = sample();
    // A second, small seed: the same index cut down to three sections, so that more of the
    // fuzzer's mutations land in the JSON than in section payloads.
    let (mut index, mut payloads) = sample_parts();
    let keep = ["tokenizer", "blk.0.dense", "calibration.frequencies"];
    let kept: Vec<usize> = (0..index.sections.len())
        .filter(|&i| keep.contains(&index.sections[i].name.as_str()))
        .collect();
    index.sections = kept.iter().map(|&i| index.sections[i].clone()).collect();
    payloads = kept.iter().map(|&i| std::mem::take(&mut payloads[i])).collect();
    index.tensors.retain(|t| keep.contains(&t.section.as_str()));
    let lens: Vec<u64> = payloads.iter().map(|p| p.len() as u64).collect();
    let sums: Vec<String> = payloads.iter().map(|p| checksum_hex(p)).collect();
    let small = assemble(
        &plan_layout(&mut index, &lens, &sums).expect("small index is valid"),
        &payloads,
    );
    for (name, image) in [("sample.gst", &image), ("small.gst", &small)] {
        assert!(parse_file_bytes(path(), image).is_ok(), "{name} parses");
        std::fs::write(dir.join(name), image).expect("write seed");
    }
}
