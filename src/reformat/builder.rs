//! The `.gst` writer's order, a part at a time: the tokenizer and the global tensors, each layer
//! (attention as stored; the FFN in the chosen layout), then the calibration and the index.
//! `reformat` feeds it from a checkpoint; `make-model` feeds it random weights made a layer at a
//! time, so memory stays at about one layer whatever the model's size.

use std::path::Path;

use super::{down_columns, f32_bytes, rows_as_stored, rows_in_order, write_calibration, write_experts, DownType};
use super::{writer::GstWriter, ReformatOptions};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::{FfnLayout, Index, Layout, NeuronOrder, SourceInfo, UpSketch, FORMAT_VERSION};
use crate::model::tokenizer::TokenizerSpec;
use crate::model::weights::{FfnDown, LayerFfn, LayerWeights};
use crate::quant::sketch::{sketch_row, sketch_row_bytes};
use crate::quant::GgmlType;
use crate::tensor::Weight;

use super::calibrate::CalibrationStats;

pub struct GstBuilder {
    w: GstWriter,
    ffn_layout: FfnLayout,
    down_type: DownType,
    order: NeuronOrder,
    up_sketch: UpSketch,
    /// Element type for every matrix (safetensors sources), `None`: as stored.
    to: Option<GgmlType>,
    down_err: Vec<f32>,
    /// The down type the layout records (layer 0's).
    layout_down_type: Option<GgmlType>,
    /// A mixture of experts: its leading dense layers' FFNs are written as the experts are,
    /// one section each with down as stored ([`GstBuilder::mixture_of_experts`]).
    experts: bool,
}

/// What was written.
pub struct Built {
    pub file_len_bytes: u64,
    pub sections: usize,
    pub down_requant_rel_rms: Vec<f32>,
}

impl GstBuilder {
    /// Starts writing `output` (a temporary file until [`GstBuilder::finish`]); refuses layout
    /// choices that cannot go together.
    pub fn create(output: &Path, opts: &ReformatOptions) -> Result<GstBuilder> {
        if opts.ffn_layout == FfnLayout::Rows && opts.order == NeuronOrder::HotFirst {
            return Err(Error::Input(
                "--ffn-layout rows keeps each FFN matrix as the checkpoint stores it (down as [hidden x ffn] rows, \
                 for dense streaming), so its neurons cannot be reordered; use --ffn-layout split or bundled for \
                 --order hot-first"
                    .into(),
            ));
        }
        Ok(GstBuilder {
            w: GstWriter::create(output, opts.force)?,
            ffn_layout: opts.ffn_layout,
            down_type: opts.down_type,
            order: opts.order,
            up_sketch: opts.up_sketch,
            to: opts.matrix_type,
            down_err: Vec::new(),
            layout_down_type: None,
            experts: false,
        })
    }

    /// The model is a mixture of experts: a dense layer's FFN (GLM-4.5's leading dense layers)
    /// goes in one section `blk.L.ffn` (gate, up, down rows as stored), as its experts do, so the
    /// expert stream reads it as the model stores it.
    pub fn mixture_of_experts(&mut self) {
        self.experts = true;
    }

    fn matrix(&mut self, name: &str, m: &Weight) -> Result<()> {
        let (ty, bytes) = rows_as_stored(m, self.to)?;
        self.w.matrix(name, ty, m.rows, m.cols, &bytes)
    }

    fn vector(&mut self, name: &str, v: &[f32]) -> Result<()> {
        self.w.matrix(name, GgmlType::F32, 1, v.len(), &f32_bytes(v))
    }

    /// The tokenizer, the token embedding, the output matrix (`None` when tied to the
    /// embedding) and the final norm.
    pub fn globals(
        &mut self,
        tokenizer: &TokenizerSpec,
        token_embd: &Weight,
        output: Option<&Weight>,
        output_norm: &[f32],
    ) -> Result<()> {
        let json = serde_json::to_vec(tokenizer).map_err(|e| Error::Internal(e.to_string()))?;
        self.w.section("tokenizer.json", &json)?;
        self.matrix("token_embd.weight", token_embd)?;
        if let Some(o) = output {
            self.matrix("output.weight", o)?;
        }
        self.vector("output_norm.weight", output_norm)
    }

    /// Layer `l`, its FFN neurons in `order` (the identity unless hot-first).
    pub fn layer(&mut self, l: usize, lw: &LayerWeights, order: &[u32]) -> Result<()> {
        let n = |what: &str| format!("blk.{l}.{what}");
        if lw.attn.mla.is_some() {
            return Err(Error::Input(
                "a .gst does not hold latent attention (DeepSeek-V2/V3) yet: stream the GGUF itself \
                 (`run --model FILE.gguf --ram-budget SIZE`), which reads it without a second copy"
                    .into(),
            ));
        }
        self.vector(&n("attn_norm.weight"), &lw.attn_norm)?;
        self.matrix(&n("attn_q.weight"), &lw.attn.wq)?;
        self.matrix(&n("attn_k.weight"), &lw.attn.wk)?;
        self.matrix(&n("attn_v.weight"), &lw.attn.wv)?;
        self.matrix(&n("attn_output.weight"), &lw.attn.wo)?;
        if let LayerFfn::Experts(e) = &lw.ffn {
            if let Some(b) = &e.score_bias {
                self.vector(&n("exp_probs_b.bias"), b)?;
            }
        }
        for (what, v) in [
            ("attn_q.bias", &lw.bq),
            ("attn_k.bias", &lw.bk),
            ("attn_v.bias", &lw.bv),
            ("attn_output.bias", &lw.bo),
            ("attn_sinks.weight", &lw.attn_sinks),
            ("attn_q_norm.weight", &lw.q_norm),
            ("attn_k_norm.weight", &lw.k_norm),
            ("post_attention_norm.weight", &lw.post_attn_norm),
            ("post_ffw_norm.weight", &lw.post_ffn_norm),
        ] {
            if let Some(v) = v {
                self.vector(&n(what), v)?;
            }
        }
        self.vector(&n("ffn_norm.weight"), &lw.ffn_norm)?;
        let ffn_w = match &lw.ffn {
            LayerFfn::Dense(f) if self.experts => {
                let names = [n("ffn_gate.weight"), n("ffn_up.weight"), n("ffn_down.weight")];
                self.layout_down_type.get_or_insert(f.down.weight().ty);
                return super::write_ffn_section(
                    &mut self.w,
                    &n("ffn"),
                    names.each_ref().map(|s| s.as_str()),
                    f,
                    self.to,
                );
            }
            LayerFfn::Dense(f) => f,
            LayerFfn::Experts(e) => {
                // Experts keep their down matrices as stored.
                self.layout_down_type.get_or_insert(e.experts[0].down.weight().ty);
                return write_experts(&mut self.w, l, e, self.to);
            }
        };
        let (ffn, hidden) = (ffn_w.gate.rows, ffn_w.gate.cols);
        let to = self.to;
        let FfnDown::Rows(down) = &ffn_w.down else {
            return Err(Error::Internal("a non-.gst source with neuron-major down".into()));
        };
        if self.ffn_layout == FfnLayout::Rows {
            // As stored: gate and up rows, down as [hidden x ffn] rows (nothing re-quantized).
            self.matrix(&n("ffn_gate.weight"), &ffn_w.gate)?;
            self.matrix(&n("ffn_up.weight"), &ffn_w.up)?;
            self.matrix(&n("ffn_down.weight"), down)?;
            self.layout_down_type.get_or_insert(to.unwrap_or(down.ty));
        } else {
            let (gate_ty, gate) = rows_in_order(&ffn_w.gate, order, to)?;
            self.w.matrix(&n("ffn_gate.weight"), gate_ty, ffn, hidden, &gate)?;
            let (up_ty, up) = rows_in_order(&ffn_w.up, order, to)?;
            let down_ty = match self.down_type {
                DownType::Q8_0 => GgmlType::Q8_0,
                DownType::F16 => GgmlType::F16,
                DownType::Same => to.unwrap_or(down.ty),
            };
            self.layout_down_type.get_or_insert(down_ty);
            let (down_t, err) = down_columns(down, order, down_ty)?;
            self.down_err.push(err);
            let (up_row, down_row) = (up.len() / ffn, down_t.len() / ffn);
            match self.ffn_layout {
                FfnLayout::Split | FfnLayout::Rows => {
                    // (Rows was written above; here it is split.)
                    self.w.matrix(&n("ffn_up.weight"), up_ty, ffn, hidden, &up)?;
                    self.w.matrix(&n("ffn_down_t.weight"), down_ty, ffn, hidden, &down_t)?;
                }
                FfnLayout::Bundled => {
                    let mut bundle = Vec::with_capacity(up.len() + down_t.len());
                    for i in 0..ffn {
                        bundle.extend_from_slice(&up[i * up_row..(i + 1) * up_row]);
                        bundle.extend_from_slice(&down_t[i * down_row..(i + 1) * down_row]);
                    }
                    let section = n("ffn_updown");
                    self.w.section(&section, &bundle)?;
                    let stride = up_row + down_row;
                    self.w
                        .view(&n("ffn_up.weight"), &section, 0, up_ty, ffn, hidden, stride);
                    self.w
                        .view(&n("ffn_down_t.weight"), &section, up_row, down_ty, ffn, hidden, stride);
                }
            }
        }
        if self.up_sketch == UpSketch::TwoBit {
            let row_bytes = sketch_row_bytes(hidden).ok_or_else(|| {
                Error::Input(format!(
                    "--up-sketch 2bit needs hidden ({hidden}) to be a multiple of 32"
                ))
            })?;
            let mut sketch = vec![0u8; ffn * row_bytes];
            let mut f = vec![0f32; hidden];
            for (&r, out) in order.iter().zip(sketch.chunks_exact_mut(row_bytes)) {
                ffn_w.up.dequantize_row(r as usize, &mut f);
                sketch_row(&f, out);
            }
            self.w.section(&n("ffn_up_sketch"), &sketch)?;
        }
        Ok(())
    }

    /// The calibration (statistics with each layer's neuron order), the index and header; the
    /// file is then renamed into place.
    pub fn finish(
        mut self,
        config: ModelConfig,
        source: SourceInfo,
        calibration: Option<(&CalibrationStats, &[Vec<u32>])>,
    ) -> Result<Built> {
        let calibration = match calibration {
            None => None,
            Some((s, orders)) => Some(write_calibration(&mut self.w, s, orders)?),
        };
        let index = Index {
            format_version: FORMAT_VERSION,
            config,
            layout: Layout {
                ffn_layout: self.ffn_layout,
                neuron_order: self.order,
                down_type: self.layout_down_type.unwrap_or(GgmlType::Q8_0),
                up_sketch: self.up_sketch,
            },
            source,
            tokenizer_section: "tokenizer.json".into(),
            calibration,
            down_requant_rel_rms: self.down_err.clone(),
            recommended_sparse: None,
            sections: Vec::new(),
            tensors: Vec::new(),
        };
        let sections = self.w.sections.len();
        let file_len_bytes = self.w.finish(index)?;
        Ok(Built {
            file_len_bytes,
            sections,
            down_requant_rel_rms: self.down_err,
        })
    }
}
