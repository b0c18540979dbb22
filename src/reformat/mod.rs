//! `gatestream reformat`: a GGUF file or Hugging Face folder → one `.gst` file laid out for
//! sparse reads (see docs/FORMAT.md). Per layer, FFN neurons become the unit of storage: gate and
//! up rows stay in their source quantization (their blocks run along hidden), down columns are
//! transposed out of the `[hidden, ffn]` matrix and re-quantized along hidden, and all three are
//! permuted together when neurons are ordered hot-first. Everything else is copied as stored.
//! Reads the source through `model` (memory-mapped) one layer at a time, so memory stays at
//! about one layer's down matrix in f32.

pub mod builder;
pub mod calibrate;
pub mod writer;

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::format::Recommendation;
use crate::format::{self, Calibration, FfnLayout, Index, LayerCalibration, NeuronOrder, SourceInfo, UpSketch};
use crate::gstfile::GstFile;
use crate::model::weights::{ExpertWeights, FfnDown, FfnWeights, ModelWeights, TensorSource};
use crate::model::{open_source, LoadOptions, Model};
use crate::quant::{dequantize_row, quantize_row, GgmlType};
use crate::tensor::Weight;
pub use builder::GstBuilder;
use calibrate::{calibrate, hot_first_order, prefix_coverage, CalibrationStats};
use writer::GstWriter;

/// How to store the transposed down columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownType {
    Q8_0,
    F16,
    /// The source's own down type (needs hidden to be a whole number of its blocks).
    Same,
}

#[derive(Clone, Debug)]
pub struct ReformatOptions {
    pub ffn_layout: FfnLayout,
    pub down_type: DownType,
    pub order: NeuronOrder,
    /// Text for calibration (required for hot-first order; optional otherwise).
    pub calibrate_text: Option<PathBuf>,
    pub calibrate_tokens: usize,
    /// Element type for every matrix of a safetensors source (None: as stored).
    pub matrix_type: Option<GgmlType>,
    /// Also store a 2-bit sketch of every up row (its own section per layer).
    pub up_sketch: UpSketch,
    pub force: bool,
    pub threads: usize,
}

impl Default for ReformatOptions {
    fn default() -> Self {
        ReformatOptions {
            ffn_layout: FfnLayout::Split,
            down_type: DownType::Q8_0,
            order: NeuronOrder::Original,
            calibrate_text: None,
            calibrate_tokens: 2048,
            matrix_type: None,
            up_sketch: UpSketch::None,
            force: false,
            threads: 0,
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ReformatReport {
    pub output: PathBuf,
    pub file_len_bytes: u64,
    pub sections: usize,
    pub seconds: f64,
    pub calibration_seconds: f64,
    /// Per layer: relative RMS error of the re-quantized down columns.
    pub down_requant_rel_rms: Vec<f32>,
}

/// What the long steps report: (stage, done, total).
pub type Progress<'a> = &'a mut dyn FnMut(&str, usize, usize);

fn xxh3_of_file(path: &Path) -> Result<(u64, String)> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        len += n as u64;
    }
    Ok((len, format::checksum_to_hex(h.digest())))
}

fn source_info(input: &Path) -> Result<SourceInfo> {
    let file = if input.is_dir() {
        let single = input.join("model.safetensors");
        if single.exists() {
            single
        } else {
            input.join("model.safetensors.index.json")
        }
    } else {
        input.to_path_buf()
    };
    let (len_bytes, xxh3) = xxh3_of_file(&file)?;
    let file_name = input
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("model")
        .to_string();
    Ok(SourceInfo {
        file_name,
        len_bytes,
        xxh3,
    })
}

/// Every row of `w` in its own order, converted to `to` when given.
fn rows_as_stored(w: &Weight, to: Option<GgmlType>) -> Result<(GgmlType, Vec<u8>)> {
    rows_in_order(w, &(0..w.rows as u32).collect::<Vec<_>>(), to)
}

/// Rows of `w` in `order`, converted to `to` when given.
fn rows_in_order(w: &Weight, order: &[u32], to: Option<GgmlType>) -> Result<(GgmlType, Vec<u8>)> {
    let ty = to.unwrap_or(w.ty);
    let row_bytes = ty.row_bytes(w.cols).ok_or_else(|| {
        Error::Input(format!(
            "{}: {} columns are not a whole number of {} blocks",
            w.name,
            w.cols,
            ty.name()
        ))
    })?;
    let mut out = Vec::with_capacity(order.len() * row_bytes);
    let mut f = vec![0f32; w.cols];
    let mut q = vec![0u8; row_bytes];
    for &r in order {
        if ty == w.ty {
            out.extend_from_slice(w.row(r as usize));
        } else {
            w.dequantize_row(r as usize, &mut f);
            convert(&w.name, &f, ty, &mut q)?;
            out.extend_from_slice(&q);
        }
    }
    Ok((ty, out))
}

fn convert(name: &str, x: &[f32], ty: GgmlType, out: &mut [u8]) -> Result<()> {
    if quantize_row(ty, x, out) {
        Ok(())
    } else {
        Err(Error::Input(format!(
            "{name}: cannot quantize to {}: gatestream reads that type but has no quantizer for it \
             (llama-quantize makes it); for down columns choose --down-type q8_0 or f16",
            ty.name()
        )))
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Down columns `[ffn, hidden]` from a `[hidden, ffn]` down matrix, in `order`, quantized to `ty`.
/// Returns the bytes and the relative RMS error of the quantization.
fn down_columns(down: &Weight, order: &[u32], ty: GgmlType) -> Result<(Vec<u8>, f32)> {
    let (hidden, ffn) = (down.rows, down.cols);
    let row_bytes = ty.row_bytes(hidden).ok_or_else(|| {
        Error::Input(format!(
            "{}: hidden size {hidden} is not a whole number of {} blocks; choose --down-type q8_0 or f16",
            down.name,
            ty.name()
        ))
    })?;
    let mut full = vec![0f32; hidden * ffn]; // [hidden, ffn]
    for (i, row) in full.chunks_mut(ffn).enumerate() {
        down.dequantize_row(i, row);
    }
    let mut out = Vec::with_capacity(order.len() * row_bytes);
    let (mut col, mut back) = (vec![0f32; hidden], vec![0f32; hidden]);
    let mut q = vec![0u8; row_bytes];
    let (mut err2, mut sum2) = (0f64, 0f64);
    for &n in order {
        for (i, c) in col.iter_mut().enumerate() {
            *c = full[i * ffn + n as usize];
        }
        convert(&down.name, &col, ty, &mut q)?;
        dequantize_row(ty, &q, &mut back);
        for (a, b) in col.iter().zip(&back) {
            err2 += ((a - b) as f64).powi(2);
            sum2 += (*a as f64).powi(2);
        }
        out.extend_from_slice(&q);
    }
    let rel = if sum2 > 0.0 { (err2 / sum2).sqrt() as f32 } else { 0.0 };
    Ok((out, rel))
}

/// One FFN as one section `section`: its gate rows `[ffn x hidden]`, up rows `[ffn x hidden]`
/// and down rows `[hidden x ffn]`, each as stored (or converted to `to`), so the whole FFN is one
/// contiguous read and its bytes are the checkpoint's. Views `names` = gate, up, down.
pub(super) fn write_ffn_section(
    w: &mut GstWriter,
    section: &str,
    names: [&str; 3],
    f: &FfnWeights,
    to: Option<GgmlType>,
) -> Result<()> {
    let FfnDown::Rows(down) = &f.down else {
        return Err(Error::Internal("a non-.gst source with neuron-major down".into()));
    };
    let mut bytes = Vec::new();
    let mut at = Vec::with_capacity(3);
    for m in [&f.gate, &f.up, down] {
        let (ty, b) = rows_as_stored(m, to)?;
        at.push((bytes.len(), ty, m.rows, m.cols, b.len() / m.rows.max(1)));
        bytes.extend_from_slice(&b);
    }
    w.section(section, &bytes)?;
    for (name, (offset, ty, rows, cols, row_bytes)) in names.into_iter().zip(at) {
        w.view(name, section, offset, ty, rows, cols, row_bytes);
    }
    Ok(())
}

/// A mixture-of-experts layer: the router as a matrix, each expert in its own section
/// `blk.L.ffn_exps.E` ([`write_ffn_section`]), the shared expert in `blk.L.ffn_shexp` with its
/// gate vector. Experts keep their down matrices as stored (nothing is re-quantized).
fn write_experts(w: &mut GstWriter, l: usize, e: &ExpertWeights, to: Option<GgmlType>) -> Result<()> {
    let n = |what: &str| format!("blk.{l}.{what}");
    let (ty, router) = rows_as_stored(&e.router, to)?;
    w.matrix(&n("ffn_gate_inp.weight"), ty, e.router.rows, e.router.cols, &router)?;
    for (i, f) in e.experts.iter().enumerate() {
        let names = [
            n(&format!("ffn_gate_exps.{i}.weight")),
            n(&format!("ffn_up_exps.{i}.weight")),
            n(&format!("ffn_down_exps.{i}.weight")),
        ];
        write_ffn_section(
            w,
            &n(&format!("ffn_exps.{i}")),
            names.each_ref().map(|s| s.as_str()),
            f,
            to,
        )?;
    }
    if let Some(b) = &e.biases {
        // gpt-oss: resident vectors (each expert's slice in expert order), one F32 row each.
        for (what, v) in [
            ("ffn_gate_inp.bias", &b.router),
            ("ffn_gate_exps.bias", &b.gate),
            ("ffn_up_exps.bias", &b.up),
            ("ffn_down_exps.bias", &b.down),
        ] {
            w.matrix(&n(what), GgmlType::F32, 1, v.len(), &f32_bytes(v))?;
        }
    }
    if let Some((f, gate)) = &e.shared {
        let names = [
            n("ffn_gate_shexp.weight"),
            n("ffn_up_shexp.weight"),
            n("ffn_down_shexp.weight"),
        ];
        write_ffn_section(w, &n("ffn_shexp"), names.each_ref().map(|s| s.as_str()), f, to)?;
        if let Some(gate) = gate {
            w.matrix(
                &n("ffn_gate_inp_shexp.weight"),
                GgmlType::F32,
                1,
                gate.len(),
                &f32_bytes(gate),
            )?;
        }
    }
    Ok(())
}

/// Write the frequencies section (in the file's neuron order) and build the index's calibration.
fn write_calibration(w: &mut GstWriter, s: &CalibrationStats, orders: &[Vec<u32>]) -> Result<Calibration> {
    let ffn = orders.first().map_or(0, |o| o.len());
    let mut freq_bytes = Vec::with_capacity(orders.len() * ffn * 4);
    let mut layers = Vec::with_capacity(orders.len());
    for ((order, freq), thresholds) in orders.iter().zip(&s.frequencies).zip(&s.thresholds) {
        let in_order: Vec<f32> = order.iter().map(|&i| freq[i as usize]).collect();
        freq_bytes.extend(f32_bytes(&in_order));
        layers.push(LayerCalibration {
            thresholds: thresholds.clone(),
            hot_prefix_10: prefix_coverage(&in_order, 0.10),
            hot_prefix_25: prefix_coverage(&in_order, 0.25),
        });
    }
    w.section(FREQUENCIES_SECTION, &freq_bytes)?;
    Ok(Calibration {
        tokens: s.tokens as u64,
        text: s.text.clone(),
        frequencies_section: FREQUENCIES_SECTION.into(),
        layers,
    })
}

const FREQUENCIES_SECTION: &str = "calibration.frequencies";

/// `gatestream calibrate`: measure activation statistics of a `.gst` file's model on the last
/// `tokens` tokens of `text` and store them in the file (frequencies, thresholds, hot-prefix
/// coverage), replacing any earlier calibration. Safe like reformat: the file is rewritten to a
/// temporary name (sections copied as they are, checksums recomputed) and renamed over itself.
pub fn recalibrate(
    path: &Path,
    text_path: &Path,
    tokens: usize,
    threads: usize,
    progress: Progress,
) -> Result<Calibration> {
    let old = GstFile::open(path)?;
    let text = std::fs::read_to_string(text_path).map_err(|e| Error::io(text_path, e))?;
    let model = Model::load(
        path,
        &LoadOptions {
            threads,
            ..Default::default()
        },
    )?;
    let name = text_path.file_name().and_then(|n| n.to_str()).unwrap_or("text");
    let stats = calibrate(&model, &text, name, tokens, &mut |d, n| progress("calibrate", d, n))?;
    drop(model);
    let ffn = old.index.config.ffn as u32;
    let identity: Vec<Vec<u32>> = (0..old.index.config.n_layers).map(|_| (0..ffn).collect()).collect();
    rewrite(
        &old,
        &[FREQUENCIES_SECTION],
        |w| write_calibration(w, &stats, &identity),
        |index, calibration| {
            index.calibration = Some(calibration.clone());
            calibration
        },
        progress,
    )
}

/// Store the configuration `eval` chose in a `.gst` file (safe rewrite, like calibrate).
pub fn store_recommendation(path: &Path, r: Recommendation, progress: Progress) -> Result<()> {
    let old = GstFile::open(path)?;
    rewrite(
        &old,
        &[],
        |_| Ok(()),
        |index, ()| index.recommended_sparse = Some(r),
        progress,
    )
}

/// As [`store_recommendation`], for a recommendation measured on `evaluated`: the .gst file
/// itself, or the model file it was converted from (checked by length and xxh3 against the
/// source the file records).
pub fn store_recommendation_from(path: &Path, evaluated: &Path, r: Recommendation, progress: Progress) -> Result<()> {
    if !same_file(path, evaluated)? {
        if crate::gstfile::is_gst(evaluated) {
            return Err(Error::Input(format!(
                "{}: the recommendation was measured on another .gst file ({}); evaluate this file, or the model it was converted from",
                path.display(),
                evaluated.display()
            )));
        }
        let recorded = GstFile::open(path)?.index.source.clone();
        let src = source_info(evaluated)?;
        if (src.len_bytes, &src.xxh3) != (recorded.len_bytes, &recorded.xxh3) {
            return Err(Error::Input(format!(
                "{}: converted from {} ({} bytes, xxh3 {}), not from the evaluated {} ({} bytes, xxh3 {}); evaluate the file it was converted from, or the .gst itself",
                path.display(),
                recorded.file_name,
                recorded.len_bytes,
                recorded.xxh3,
                evaluated.display(),
                src.len_bytes,
                src.xxh3
            )));
        }
    }
    store_recommendation(path, r, progress)
}

fn same_file(a: &Path, b: &Path) -> Result<bool> {
    let canon = |p: &Path| std::fs::canonicalize(p).map_err(|e| Error::io(p, e));
    Ok(canon(a)? == canon(b)?)
}

/// Rewrite `old` under its own name: its sections are copied (each verified first, so damage is
/// not re-blessed with fresh checksums) except `drop`, `add` writes new sections, `change` edits
/// the index; the result replaces the file by rename, or nothing changes.
fn rewrite<T, R>(
    old: &GstFile,
    drop: &[&str],
    add: impl FnOnce(&mut GstWriter) -> Result<T>,
    change: impl FnOnce(&mut Index, T) -> R,
    progress: Progress,
) -> Result<R> {
    let path = &old.path;
    let mut w = GstWriter::create(path, true)?;
    let kept: Vec<_> = old
        .index
        .sections
        .iter()
        .filter(|s| !drop.contains(&s.name.as_str()))
        .collect();
    for (i, s) in kept.iter().enumerate() {
        format::verify_section(path, s, old.section_bytes(s))?;
        w.section(&s.name, old.section_bytes(s))?;
        progress("copy", i + 1, kept.len());
    }
    w.tensors = old.index.tensors.clone();
    let added = add(&mut w)?;
    let mut index = old.index.clone();
    let result = change(&mut index, added);
    w.finish(index)?;
    Ok(result)
}

pub fn reformat(input: &Path, output: &Path, opts: &ReformatOptions, progress: Progress) -> Result<ReformatReport> {
    let t0 = Instant::now();
    let src = open_source(input)?;
    if let TensorSource::Gst(_) = src.tensors {
        return Err(Error::Input(format!("{} is already a .gst file", input.display())));
    }
    let is_gguf = matches!(src.tensors, TensorSource::Gguf(_));
    if is_gguf && opts.matrix_type.is_some() {
        return Err(Error::Input(
            "--type applies to safetensors inputs; GGUF tensors keep their quantization".into(),
        ));
    }
    if opts.order == NeuronOrder::HotFirst && opts.calibrate_text.is_none() {
        return Err(Error::Input(
            "--order hot-first needs --calibrate TEXT to measure activation frequencies".into(),
        ));
    }
    let cfg = src.config.clone();
    let (n_layers, ffn) = (cfg.n_layers, cfg.ffn);
    if cfg.moe.is_some() && (opts.calibrate_text.is_some() || opts.up_sketch != UpSketch::None) {
        return Err(Error::Input(format!(
            "{}: a mixture-of-experts model is reformatted without --calibrate, --order hot-first or --up-sketch \
             (neuron statistics inside experts are not built yet); its experts keep their neurons in checkpoint order",
            input.display()
        )));
    }

    let mut calibration_seconds = 0.0;
    let stats: Option<CalibrationStats> = match &opts.calibrate_text {
        None => None,
        Some(text_path) => {
            let t = Instant::now();
            let text = std::fs::read_to_string(text_path).map_err(|e| Error::io(text_path, e))?;
            let model = Model::load(
                input,
                &LoadOptions {
                    threads: opts.threads,
                    ..Default::default()
                },
            )?;
            let name = text_path.file_name().and_then(|n| n.to_str()).unwrap_or("text");
            let s = calibrate(&model, &text, name, opts.calibrate_tokens, &mut |d, n| {
                progress("calibrate", d, n)
            })?;
            calibration_seconds = t.elapsed().as_secs_f64();
            Some(s)
        }
    };
    let orders: Vec<Vec<u32>> = (0..n_layers)
        .map(|l| match (&stats, opts.order) {
            (Some(s), NeuronOrder::HotFirst) => hot_first_order(&s.frequencies[l]),
            _ => (0..ffn as u32).collect(),
        })
        .collect();

    let weights = ModelWeights::load(&src.tensors, &cfg)?;
    let mut b = GstBuilder::create(output, opts)?;
    if cfg.moe.is_some() {
        b.mixture_of_experts();
    }
    let tied = weights.output.name == weights.token_embd.name;
    b.globals(
        &src.tokenizer,
        &weights.token_embd,
        (!tied).then_some(&weights.output),
        &weights.output_norm,
    )?;
    for (l, lw) in weights.layers.iter().enumerate() {
        b.layer(l, lw, &orders[l])?;
        progress("layers", l + 1, n_layers);
    }
    let built = b.finish(cfg, source_info(input)?, stats.as_ref().map(|s| (s, &orders[..])))?;
    Ok(ReformatReport {
        output: output.to_path_buf(),
        file_len_bytes: built.file_len_bytes,
        sections: built.sections,
        seconds: t0.elapsed().as_secs_f64(),
        calibration_seconds,
        down_requant_rel_rms: built.down_requant_rel_rms,
    })
}
