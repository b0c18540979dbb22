//! A readable description of a `.gst` file for `gatestream inspect`: model config, layout,
//! source, sections grouped by role (per-layer sections summed over layers), and the neuron order
//! and calibration summary. Pure formatting of what `gstfile` validated.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::gstfile::GstFile;

/// `blk.12.ffn_up.weight` → `blk.*.ffn_up.weight`.
fn role(name: &str) -> String {
    let mut parts: Vec<&str> = name.split('.').collect();
    if parts.len() > 2 && parts[0] == "blk" && parts[1].parse::<usize>().is_ok() {
        parts[1] = "*";
    }
    parts.join(".")
}

pub fn describe(g: &GstFile) -> String {
    let ix = &g.index;
    let c = &ix.config;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{}: gst format v{}, {:.1} MB",
        g.path.display(),
        ix.format_version,
        g.header.file_len_bytes as f64 / 1e6
    );
    let _ = writeln!(
        o,
        "model: {} — {} layers, hidden {}, ffn {}, heads {}/{} (head_dim {}), vocab {}, context {}",
        c.arch.name(),
        c.n_layers,
        c.hidden,
        c.ffn,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.vocab,
        c.context_len
    );
    let _ = writeln!(
        o,
        "source: {} ({} bytes, xxh3 {})",
        ix.source.file_name, ix.source.len_bytes, ix.source.xxh3
    );
    let l = &ix.layout;
    // Down is stored as neuron-major columns, or (the rows layout, experts) as the source's rows.
    let down = match (l.ffn_layout, ix.config.moe.is_some()) {
        (crate::format::FfnLayout::Rows, _) | (_, true) => {
            format!("down rows as stored (layer 0: {})", l.down_type.name())
        }
        _ => format!("down columns {}", l.down_type.name()),
    };
    let _ = writeln!(
        o,
        "layout: ffn {:?}, neuron order {:?}, {down}, up sketch {:?}",
        l.ffn_layout, l.neuron_order, l.up_sketch
    );
    if !ix.down_requant_rel_rms.is_empty() {
        let e = &ix.down_requant_rel_rms;
        let max = e.iter().copied().fold(0f32, f32::max);
        let mean = e.iter().sum::<f32>() / e.len() as f32;
        let _ = writeln!(
            o,
            "down re-quantization relative RMS error: mean {mean:.4}, max {max:.4}"
        );
    }

    // Sections and the tensor views in them, grouped by role.
    let mut dtype_of: BTreeMap<&str, String> = BTreeMap::new();
    for t in &ix.tensors {
        let e = dtype_of.entry(t.section.as_str()).or_default();
        if !e.is_empty() {
            e.push('+');
        }
        let _ = write!(e, "{}[{}x{}]", t.dtype.name(), t.rows, t.cols);
    }
    let mut groups: BTreeMap<String, (usize, u64, String)> = BTreeMap::new();
    for s in &ix.sections {
        let g = groups.entry(role(&s.name)).or_insert((0, 0, String::new()));
        g.0 += 1;
        g.1 += s.len_bytes;
        if g.2.is_empty() {
            g.2 = dtype_of.get(s.name.as_str()).cloned().unwrap_or_else(|| "bytes".into());
        }
    }
    let _ = writeln!(o, "\nsections ({} in all, each 4096-aligned):", ix.sections.len());
    let _ = writeln!(o, "  {:<34} {:>6} {:>12}  type[rows x cols]", "role", "count", "MB");
    for (name, (count, bytes, ty)) in &groups {
        let _ = writeln!(o, "  {name:<34} {count:>6} {:>12.2}  {ty}", *bytes as f64 / 1e6);
    }

    match &ix.calibration {
        None => {
            let _ = writeln!(
                o,
                "\ncalibration: none (reformat with --calibrate TEXT to measure neuron activity)"
            );
        }
        Some(cal) => {
            let _ = writeln!(o, "\ncalibration: {} tokens of {}", cal.tokens, cal.text);
            let _ = writeln!(
                o,
                "  share of activations covered by the first 10% / 25% of neurons (file order), and the score threshold for 50% sparsity:"
            );
            for (i, lc) in cal.layers.iter().enumerate() {
                let t50 = lc
                    .thresholds
                    .iter()
                    .find(|(s, _)| (*s - 0.5).abs() < 1e-6)
                    .map(|t| t.1)
                    .unwrap_or(f32::NAN);
                let _ = writeln!(
                    o,
                    "  layer {i:>3}: {:>5.1}% / {:>5.1}%   threshold@50% {t50:.4}",
                    lc.hot_prefix_10 * 100.0,
                    lc.hot_prefix_25 * 100.0
                );
            }
            let n = cal.layers.len().max(1) as f32;
            let m10 = cal.layers.iter().map(|l| l.hot_prefix_10).sum::<f32>() / n;
            let m25 = cal.layers.iter().map(|l| l.hot_prefix_25).sum::<f32>() / n;
            let _ = writeln!(
                o,
                "  mean: {:.1}% / {:.1}% (uniform activity would give 10% / 25%)",
                m10 * 100.0,
                m25 * 100.0
            );
        }
    }
    o
}

#[cfg(test)]
mod tests {
    #[test]
    fn roles_fold_layer_numbers() {
        assert_eq!(super::role("blk.12.ffn_up.weight"), "blk.*.ffn_up.weight");
        assert_eq!(super::role("token_embd.weight"), "token_embd.weight");
    }
}
