//! Parsing and validation of the JSON index: schema, limits, section ranges, tensor views, and
//! the cross-references between them. After [`Index::parse`] succeeds, every tensor row the index
//! describes lies inside its section and every section inside the file, before the index.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::{
    malformed, Index, Section, TensorView, ALIGN_BYTES, DIM_MAX, FORMAT_VERSION, FORMAT_VERSION_MIN, HEADER_BYTES,
    INDEX_LEN_MAX_BYTES, NAME_LEN_MAX_BYTES, REBUILD, SECTIONS_MAX, TENSORS_MAX, TEXT_LEN_MAX_BYTES,
};
use crate::error::Result;

impl Index {
    /// Compact UTF-8 JSON, the bytes stored at the end of the file.
    pub fn to_json_bytes(&self) -> Vec<u8> {
        // Every map key here is a struct field name, so serialization cannot fail. Non-finite
        // floats become `null`, which `parse` rejects; `plan_layout` parses its own output so a
        // writer learns about that before writing a file.
        serde_json::to_vec(self).expect("Index has no map keys that are not strings")
    }

    /// Parse and validate the index: JSON within limits, format_version, config.validate(), and
    /// the layout rules of docs/FORMAT.md. `index_offset_bytes` (from the header) is where the
    /// index starts in the file: every section must end at or before it, and error offsets are
    /// file offsets.
    pub fn parse(path: &Path, index_bytes: &[u8], index_offset_bytes: u64) -> Result<Index> {
        if index_bytes.len() as u64 > INDEX_LEN_MAX_BYTES {
            return Err(malformed(
                path,
                index_offset_bytes,
                format!(
                    "index is {} bytes, more than the limit of {INDEX_LEN_MAX_BYTES}; {REBUILD}",
                    index_bytes.len()
                ),
            ));
        }
        let index: Index = serde_json::from_slice(index_bytes).map_err(|e| {
            let at = index_offset_bytes.saturating_add(json_error_position(index_bytes, &e));
            let kind = if e.is_data() {
                "does not match the version 1 schema"
            } else {
                "is not valid JSON"
            };
            malformed(path, at, format!("index {kind}: {e}; {REBUILD}"))
        })?;
        index.validate(path, index_offset_bytes)?;
        Ok(index)
    }

    pub fn section(&self, name: &str) -> Option<&Section> {
        self.sections.iter().find(|s| s.name == name)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorView> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The byte range [start, end) of a tensor's row r in the file (checked arithmetic; None if r
    /// out of range or the tensor's section is missing). Looks the section up by name; hot paths
    /// should resolve it once and call [`TensorView::row_range_in`].
    pub fn row_range(&self, t: &TensorView, r: u64) -> Option<(u64, u64)> {
        t.row_range_in(self.section(&t.section)?, r)
    }

    /// Every rule a reader relies on, checked on the parsed struct. Error offsets point at the
    /// offending section when there is one, else at the index.
    pub(super) fn validate(&self, path: &Path, index_offset_bytes: u64) -> Result<()> {
        let at_index = |what: String| malformed(path, index_offset_bytes, format!("{what}; {REBUILD}"));
        if !(FORMAT_VERSION_MIN..=FORMAT_VERSION).contains(&self.format_version) {
            return Err(at_index(format!(
                "index says gst format version {}, this build reads {FORMAT_VERSION_MIN} to {FORMAT_VERSION}",
                self.format_version
            )));
        }
        // JSON numbers beyond f32's range parse as infinity (serde casts from f64), and a file
        // whose index cannot be written back as JSON is not one a writer produced. Checked
        // before the config's own validation so the message names the index.
        let c = &self.config;
        let config_floats = [
            c.rms_eps,
            c.rope_theta,
            c.rope_theta_local,
            c.rope_scale_global,
            c.attn_scale,
            c.embed_scale,
            c.final_logit_softcap.unwrap_or(1.0),
        ];
        if !config_floats.iter().all(|v| v.is_finite()) {
            return Err(at_index(format!("config has a non-finite number: {config_floats:?}")));
        }
        let config = self.config.clone().validate(path)?;
        if (config.moe.is_some() || config.qk_norm_whole) && self.format_version < 3 {
            return Err(at_index(format!(
                "a mixture-of-experts config (`moe`, `qk_norm_whole`) in a version {} index; experts came with version 3",
                self.format_version
            )));
        }
        if self.layout.ffn_layout == super::FfnLayout::Rows && self.format_version < 4 {
            return Err(at_index(format!(
                "the `rows` FFN layout in a version {} index; it came with version 4",
                self.format_version
            )));
        }
        if self.sections.len() > SECTIONS_MAX {
            return Err(at_index(format!(
                "{} sections, more than the limit of {SECTIONS_MAX}",
                self.sections.len()
            )));
        }
        if self.tensors.len() > TENSORS_MAX {
            return Err(at_index(format!(
                "{} tensors, more than the limit of {TENSORS_MAX}",
                self.tensors.len()
            )));
        }
        check_text(&self.source.file_name, "source.file_name").map_err(at_index)?;
        check_checksum_hex(&self.source.xxh3, "source.xxh3").map_err(at_index)?;

        let sections = self.validate_sections(path, index_offset_bytes)?;
        self.validate_tensors(path, index_offset_bytes, &sections)?;

        let require_section = |name: &str, field: &str| -> Result<&Section> {
            sections
                .get(name)
                .copied()
                .ok_or_else(|| at_index(format!("{field} names section `{name}`, which is not in the index")))
        };
        require_section(&self.tokenizer_section, "tokenizer_section")?;

        let n_layers = config.n_layers;
        if let Some(cal) = &self.calibration {
            check_text(&cal.text, "calibration.text").map_err(at_index)?;
            let freq = require_section(&cal.frequencies_section, "calibration.frequencies_section")?;
            // f32 per neuron per layer; ModelConfig::validate bounds both factors, so no overflow.
            let freq_len_expected = (n_layers as u64) * (config.ffn as u64) * 4;
            if freq.len_bytes != freq_len_expected {
                return Err(malformed(
                    path,
                    freq.offset_bytes,
                    format!(
                        "calibration frequencies section `{}` is {} bytes, expected {freq_len_expected} \
                         ({n_layers} layers x {} neurons x 4-byte f32); {REBUILD}",
                        freq.name, freq.len_bytes, config.ffn
                    ),
                ));
            }
            if cal.layers.len() != n_layers {
                return Err(at_index(format!(
                    "calibration has {} layers, the model has {n_layers}",
                    cal.layers.len()
                )));
            }
            for (l, layer) in cal.layers.iter().enumerate() {
                let shares = [layer.hot_prefix_10, layer.hot_prefix_25];
                let thresholds_ok = layer
                    .thresholds
                    .iter()
                    .all(|&(s, t)| (0.0..=1.0).contains(&s) && t.is_finite());
                if !thresholds_ok || !shares.iter().all(|v| (0.0..=1.0).contains(v)) {
                    return Err(at_index(format!(
                        "calibration of layer {l} has a sparsity or share outside [0, 1] or a non-finite threshold"
                    )));
                }
            }
        }
        let rms = &self.down_requant_rel_rms;
        if !(rms.is_empty() || rms.len() == n_layers) {
            return Err(at_index(format!(
                "down_requant_rel_rms has {} entries, expected 0 or {n_layers} (one per layer)",
                rms.len()
            )));
        }
        if !rms.iter().all(|v| v.is_finite() && *v >= 0.0) {
            return Err(at_index(
                "down_requant_rel_rms has a negative or non-finite entry".into(),
            ));
        }
        if let Some(r) = &self.recommended_sparse {
            let names_ok = ["topk", "threshold", "union"].contains(&r.strategy.as_str())
                && ["gate", "exact", "candidates", "sketch"].contains(&r.criterion.as_str());
            let numbers_ok = (0.0..1.0).contains(&r.sparsity)
                && [
                    r.max_ppl_increase_pct,
                    r.measured_ppl_increase_pct,
                    r.top1_agreement,
                    r.ffn_bytes_rel_dense,
                ]
                .iter()
                .all(|v| v.is_finite())
                && r.measured_on.len() <= TEXT_LEN_MAX_BYTES;
            // Per-layer levels: one per layer, each a sparsity, averaging to `sparsity`, and
            // only for top-K (the only strategy that takes a level per layer), from version 2.
            let per_layer_ok = r.per_layer_sparsity.as_ref().is_none_or(|p| {
                self.format_version >= 2
                    && r.strategy == "topk"
                    && p.len() == self.config.n_layers
                    && p.iter().all(|s| (0.0..1.0).contains(s))
                    && (p.iter().map(|&s| s as f64).sum::<f64>() / p.len() as f64 - r.sparsity as f64).abs() < 1e-3
            });
            if !(names_ok && numbers_ok && per_layer_ok) {
                return Err(at_index(format!(
                    "recommended_sparse is not a valid configuration: {r:?}"
                )));
            }
        }
        Ok(())
    }

    /// Names, checksums, alignment, bounds and overlap of sections; returns them by name.
    fn validate_sections(&self, path: &Path, index_offset_bytes: u64) -> Result<HashMap<&str, &Section>> {
        let mut by_name: HashMap<&str, &Section> = HashMap::with_capacity(self.sections.len());
        for s in &self.sections {
            let bad =
                |what: String| malformed(path, s.offset_bytes, format!("section `{}`: {what}; {REBUILD}", s.name));
            check_name(&s.name).map_err(bad)?;
            check_checksum_hex(&s.xxh3, "xxh3").map_err(bad)?;
            if by_name.insert(&s.name, s).is_some() {
                return Err(bad("a second section has this name".into()));
            }
            if !s.offset_bytes.is_multiple_of(ALIGN_BYTES) {
                return Err(bad(format!(
                    "offset {} is not a multiple of {ALIGN_BYTES}",
                    s.offset_bytes
                )));
            }
            if s.offset_bytes < HEADER_BYTES {
                return Err(bad(format!(
                    "offset {} lies inside the {HEADER_BYTES}-byte header page",
                    s.offset_bytes
                )));
            }
            let end = s.offset_bytes.checked_add(s.len_bytes);
            if end.is_none_or(|end| end > index_offset_bytes) {
                return Err(bad(format!(
                    "range {} + {} bytes runs past the start of the index at {index_offset_bytes} \
                     (or the end of the file)",
                    s.offset_bytes, s.len_bytes
                )));
            }
        }
        // Sorted by start, each section must begin at or after the end of the one before.
        // (All ends fit in u64: they were checked against the index offset above.)
        let mut by_start: Vec<&Section> = self.sections.iter().collect();
        by_start.sort_by_key(|s| (s.offset_bytes, s.len_bytes));
        for pair in by_start.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if b.offset_bytes < a.offset_bytes + a.len_bytes {
                return Err(malformed(
                    path,
                    b.offset_bytes,
                    format!(
                        "section `{}` at [{}, {}) overlaps section `{}` at [{}, {}); {REBUILD}",
                        b.name,
                        b.offset_bytes,
                        b.offset_bytes + b.len_bytes,
                        a.name,
                        a.offset_bytes,
                        a.offset_bytes + a.len_bytes
                    ),
                ));
            }
        }
        Ok(by_name)
    }

    /// Names, sizes, block alignment, stride, and that every row of every view lies inside its
    /// section.
    fn validate_tensors(&self, path: &Path, index_offset_bytes: u64, sections: &HashMap<&str, &Section>) -> Result<()> {
        let mut names: HashSet<&str> = HashSet::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let at =
                |offset: u64, what: String| malformed(path, offset, format!("tensor `{}`: {what}; {REBUILD}", t.name));
            check_name(&t.name).map_err(|w| at(index_offset_bytes, w))?;
            if !names.insert(&t.name) {
                return Err(at(index_offset_bytes, "a second tensor has this name".into()));
            }
            let section = sections.get(t.section.as_str()).ok_or_else(|| {
                at(
                    index_offset_bytes,
                    format!("refers to section `{}`, which is not in the index", t.section),
                )
            })?;
            let at = |what: String| at(section.offset_bytes, what);
            if t.rows > DIM_MAX || t.cols > DIM_MAX {
                return Err(at(format!(
                    "shape [{}, {}] exceeds the limit of {DIM_MAX} per dimension",
                    t.rows, t.cols
                )));
            }
            let row_bytes = t.row_bytes().ok_or_else(|| {
                at(format!(
                    "{} columns is not a whole number of {} blocks of {} elements",
                    t.cols,
                    t.dtype.name(),
                    t.dtype.block_elems()
                ))
            })?;
            if t.row_stride_bytes < row_bytes {
                return Err(at(format!(
                    "row stride {} bytes is smaller than a row ({row_bytes} bytes of {} x {})",
                    t.row_stride_bytes,
                    t.cols,
                    t.dtype.name()
                )));
            }
            // The last row ends at offset + (rows - 1) * stride + row_bytes; with no rows the view
            // is just its offset.
            let end = match t.rows.checked_sub(1) {
                None => Some(t.offset_in_section_bytes),
                Some(last) => last
                    .checked_mul(t.row_stride_bytes)
                    .and_then(|v| v.checked_add(t.offset_in_section_bytes))
                    .and_then(|v| v.checked_add(row_bytes)),
            };
            if end.is_none_or(|end| end > section.len_bytes) {
                return Err(at(format!(
                    "{} rows of {row_bytes} bytes every {} bytes from offset {} run past the end of \
                     section `{}` ({} bytes)",
                    t.rows, t.row_stride_bytes, t.offset_in_section_bytes, section.name, section.len_bytes
                )));
            }
        }
        Ok(())
    }
}

fn check_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() || name.len() > NAME_LEN_MAX_BYTES {
        return Err(format!(
            "name is {} bytes long, allowed 1..={NAME_LEN_MAX_BYTES}",
            name.len()
        ));
    }
    Ok(())
}

fn check_text(text: &str, field: &str) -> std::result::Result<(), String> {
    if text.len() > TEXT_LEN_MAX_BYTES {
        return Err(format!(
            "{field} is {} bytes long, allowed at most {TEXT_LEN_MAX_BYTES}",
            text.len()
        ));
    }
    Ok(())
}

/// Checksums are written by [`super::checksum_hex`]: exactly 16 lowercase hex digits.
fn check_checksum_hex(s: &str, field: &str) -> std::result::Result<(), String> {
    if s.len() != 16 || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(format!(
            "{field} {:?} is not 16 lowercase hex digits",
            s.chars().take(40).collect::<String>()
        ));
    }
    Ok(())
}

/// Byte position within the index of a serde_json error (it reports 1-based line and column,
/// the column counting bytes).
fn json_error_position(bytes: &[u8], e: &serde_json::Error) -> u64 {
    let line_start: usize = bytes
        .split(|&b| b == b'\n')
        .take(e.line().saturating_sub(1))
        .map(|line| line.len() + 1)
        .sum();
    let pos = line_start.saturating_add(e.column().saturating_sub(1)).min(bytes.len());
    pos as u64
}
