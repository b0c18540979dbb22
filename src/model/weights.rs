//! A model's weights and their loading from each source format: per-layer tensors, their names
//! in GGUF, safetensors and `.gst`, and their shapes. The matrices themselves are
//! [`crate::tensor::Weight`]s; small vectors (norms, biases) are decoded to f32 once.

use std::path::{Path, PathBuf};

use crate::config::{Arch, ModelConfig, ROPE_FREQS_TENSOR};
use crate::error::{Error, Result};
use crate::gguf::{self, GgufFile};
use crate::gstfile::GstFile;
use crate::model::forward::{AttnWeights, MlaWeights};
use crate::safetensors::SafetensorsModel;
use crate::tensor::Weight;

/// Where tensors come from; names are the source's own.
pub enum TensorSource {
    Gguf(GgufFile),
    Safetensors {
        dir: PathBuf,
        model: SafetensorsModel,
    },
    /// A `.gst` file: GGUF tensor names, FFN down stored as neuron-major columns (or, in the
    /// `rows` layout, as the checkpoint stores it).
    Gst(Box<GstFile>),
}

impl TensorSource {
    pub fn path(&self) -> &Path {
        match self {
            TensorSource::Gguf(g) => &g.path,
            TensorSource::Safetensors { dir, .. } => dir,
            TensorSource::Gst(g) => &g.path,
        }
    }

    /// Shape as `[rows, cols]` (cols fastest) for a 1-D or 2-D tensor, or None if absent.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self {
            TensorSource::Gguf(g) => g
                .tensor(name)
                .map(|t| t.dims.iter().rev().map(|&d| d as usize).collect()),
            TensorSource::Safetensors { model, .. } => model.tensors.get(name).map(|t| t.shape.clone()),
            TensorSource::Gst(g) => g.shape(name).map(|(r, c)| if r == 1 { vec![c] } else { vec![r, c] }),
        }
    }

    fn missing(&self, name: &str, arch: Arch) -> Error {
        Error::MissingTensor {
            path: self.path().to_path_buf(),
            tensor: name.into(),
            arch: arch.name().into(),
        }
    }

    /// A matrix with the expected `[rows, cols]`.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize, arch: Arch) -> Result<Weight> {
        let wrong = |found: Vec<usize>| Error::WrongShape {
            path: self.path().to_path_buf(),
            tensor: name.into(),
            expected: vec![rows, cols],
            found,
        };
        match self {
            TensorSource::Gguf(g) => {
                let t = g.tensor(name).ok_or_else(|| self.missing(name, arch))?;
                let found: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
                if t.dims.len() != 2 || t.dims[0] as usize != cols || t.dims[1] as usize != rows {
                    return Err(wrong(found));
                }
                let ty = t.ty.ok_or_else(|| gguf::unsupported_type_error(&g.path, t))?;
                let row_bytes = ty.row_bytes(cols).ok_or_else(|| wrong(found.clone()))?;
                Ok(Weight::mapped(
                    name,
                    ty,
                    rows,
                    cols,
                    g.map.clone(),
                    t.offset_bytes as usize,
                    row_bytes,
                ))
            }
            TensorSource::Safetensors { model, .. } => {
                let t = model.tensors.get(name).ok_or_else(|| self.missing(name, arch))?;
                if t.shape != [rows, cols] {
                    return Err(wrong(t.shape.clone()));
                }
                let row_bytes = t.ty.row_bytes(cols).ok_or_else(|| wrong(t.shape.clone()))?;
                Ok(Weight::mapped(
                    name,
                    t.ty,
                    rows,
                    cols,
                    model.maps[t.file].clone(),
                    t.offset_bytes,
                    row_bytes,
                ))
            }
            TensorSource::Gst(g) => g.weight(name, rows, cols)?.ok_or_else(|| self.missing(name, arch)),
        }
    }

    /// A vector of `len` values decoded to f32.
    pub fn vector(&self, name: &str, len: usize, arch: Arch) -> Result<Vec<f32>> {
        let shape = self.shape(name).ok_or_else(|| self.missing(name, arch))?;
        if shape.iter().product::<usize>() != len || shape.len() > 2 {
            return Err(Error::WrongShape {
                path: self.path().to_path_buf(),
                tensor: name.into(),
                expected: vec![len],
                found: shape,
            });
        }
        let w = self.matrix_any(name, arch, 1, len)?;
        let mut out = vec![0.0; len];
        w.dequantize_row(0, &mut out);
        Ok(out)
    }

    fn matrix_any(&self, name: &str, arch: Arch, rows: usize, cols: usize) -> Result<Weight> {
        // Reinterpret a vector as one row; the shape was checked by the caller.
        match self {
            TensorSource::Gguf(g) => {
                let t = g.tensor(name).ok_or_else(|| self.missing(name, arch))?;
                let ty = t.ty.ok_or_else(|| gguf::unsupported_type_error(&g.path, t))?;
                let row_bytes = ty
                    .row_bytes(cols)
                    .ok_or_else(|| Error::Input(format!("{name}: bad vector length")))?;
                Ok(Weight::mapped(
                    name,
                    ty,
                    rows,
                    cols,
                    g.map.clone(),
                    t.offset_bytes as usize,
                    row_bytes,
                ))
            }
            TensorSource::Safetensors { model, .. } => {
                let t = model.tensors.get(name).ok_or_else(|| self.missing(name, arch))?;
                Ok(Weight::mapped(
                    name,
                    t.ty,
                    rows,
                    cols,
                    model.maps[t.file].clone(),
                    t.offset_bytes,
                    t.ty.block_bytes() * cols,
                ))
            }
            TensorSource::Gst(g) => g.weight(name, rows, cols)?.ok_or_else(|| self.missing(name, arch)),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.shape(name).is_some()
    }

    /// The files a stream reads, each at its place in one byte space: the file itself, or a
    /// Hugging Face folder's shards one after another ([`crate::io::place_parts`]); a matrix
    /// left on disk ([`ModelWeights::leave_on_disk`]) has its offset in that space.
    pub fn parts(&self) -> Vec<crate::io::FilePart> {
        let one = |path: &Path, len: usize| {
            vec![crate::io::FilePart {
                path: path.to_path_buf(),
                base_bytes: 0,
                len_bytes: len as u64,
            }]
        };
        match self {
            TensorSource::Gguf(g) => one(&g.path, g.map.len()),
            TensorSource::Gst(g) => one(&g.path, g.map.len()),
            TensorSource::Safetensors { model, .. } => model.parts(),
        }
    }

    /// Where matrix `name`'s file starts in [`TensorSource::parts`]' byte space (0 but for a
    /// Hugging Face folder's later shards).
    fn base_of(&self, name: &str) -> u64 {
        match self {
            TensorSource::Safetensors { model, .. } => {
                model.tensors.get(name).map_or(0, |t| model.parts()[t.file].base_bytes)
            }
            _ => 0,
        }
    }

    /// A GGUF three-dimensional tensor of `n` matrices `[rows, cols]` (dims `[cols, rows, n]`)
    /// as one matrix `[n · rows, cols]`: matrix i is rows `i·rows..(i+1)·rows`
    /// ([`Weight::rows_view`]).
    pub fn stacked(&self, name: &str, n: usize, rows: usize, cols: usize, arch: Arch) -> Result<Weight> {
        let mut parts = self.experts(name, n, rows, cols, arch)?;
        Ok(parts.swap_remove(0).stacked_with(name, n))
    }

    /// The `n` matrices `[rows, cols]` of a GGUF three-dimensional expert tensor (dims
    /// `[cols, rows, n]`, the expert outermost): each expert's rows are contiguous, so each is a
    /// view at its own offset.
    pub fn experts(&self, name: &str, n: usize, rows: usize, cols: usize, arch: Arch) -> Result<Vec<Weight>> {
        let TensorSource::Gguf(g) = self else {
            return Err(Error::Input(format!(
                "{}: `{name}`: experts are read from GGUF files only",
                self.path().display()
            )));
        };
        let t = g.tensor(name).ok_or_else(|| self.missing(name, arch))?;
        let found: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        let wrong = || Error::WrongShape {
            path: self.path().to_path_buf(),
            tensor: name.into(),
            expected: vec![n, rows, cols],
            found: found.clone(),
        };
        if found != [n, rows, cols] {
            return Err(wrong());
        }
        let ty = t.ty.ok_or_else(|| gguf::unsupported_type_error(&g.path, t))?;
        let row_bytes = ty.row_bytes(cols).ok_or_else(wrong)?;
        Ok((0..n)
            .map(|e| {
                Weight::mapped(
                    &format!("{name}[{e}]"),
                    ty,
                    rows,
                    cols,
                    g.map.clone(),
                    t.offset_bytes as usize + e * rows * row_bytes,
                    row_bytes,
                )
            })
            .collect())
    }
}

/// Tensors a GGUF file may hold that leave the output unchanged, so loading ignores them: none by
/// name so far. (Every other tensor is read by the architecture's computation, or consumed into
/// its config — `rope_freqs.weight` — or is one of [`ignored_by_config`]'s, or the file is
/// refused.)
pub const IGNORED_TENSORS: &[&str] = &[];

/// Tensors a GGUF file holds that its configuration says are not run, so loading ignores them:
/// every tensor of the NextN / multi-token-prediction layers (`blk.L.*` for L from `n_layers`
/// on, `nextn_predict_layers` of them: GLM-4.5's `blk.46.*` — a whole layer's attention and
/// experts plus `nextn.eh_proj`, `nextn.enorm`, `nextn.hnorm`, `nextn.embed_tokens`,
/// `nextn.shared_head_head`, `nextn.shared_head_norm`), which llama.cpp loads only for its
/// speculative MTP decoding and never runs in the model's own pass.
pub fn ignored_by_config(cfg: &ModelConfig, name: &str) -> bool {
    cfg.nextn_layers > 0
        && name
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, _)| l.parse::<usize>().ok())
            .is_some_and(|l| l >= cfg.n_layers && l < cfg.n_layers + cfg.nextn_layers)
}

/// A [`TensorSource`] that records the names of the tensors read from it (a probe with `has`
/// reads nothing), so the loader can tell which of a file's tensors it left unread.
pub struct Taking<'a> {
    source: &'a TensorSource,
    taken: std::cell::RefCell<std::collections::HashSet<String>>,
}

impl<'a> Taking<'a> {
    fn new(source: &'a TensorSource) -> Self {
        Taking {
            source,
            taken: Default::default(),
        }
    }
    fn take(&self, name: &str) {
        self.taken.borrow_mut().insert(name.to_string());
    }
    fn has(&self, name: &str) -> bool {
        self.source.has(name)
    }
    fn missing(&self, name: &str, arch: Arch) -> Error {
        self.source.missing(name, arch)
    }
    fn matrix(&self, name: &str, rows: usize, cols: usize, arch: Arch) -> Result<Weight> {
        self.take(name);
        self.source.matrix(name, rows, cols, arch)
    }
    fn vector(&self, name: &str, len: usize, arch: Arch) -> Result<Vec<f32>> {
        self.take(name);
        self.source.vector(name, len, arch)
    }
    fn stacked(&self, name: &str, n: usize, rows: usize, cols: usize, arch: Arch) -> Result<Weight> {
        self.take(name);
        self.source.stacked(name, n, rows, cols, arch)
    }
    fn experts(&self, name: &str, n: usize, rows: usize, cols: usize, arch: Arch) -> Result<Vec<Weight>> {
        self.take(name);
        self.source.experts(name, n, rows, cols, arch)
    }
}

/// Latent attention's matrices ([`crate::config::Mla`]) in [`AttnWeights`]: `wq` the query
/// (`attn_q`, or `attn_q_b` after `attn_q_a` and its norm), `wk` the latent and rotated key part
/// (`attn_kv_a_mqa`), `wv` every head's value up-projection stacked (`attn_v_b`,
/// `[heads · v_head, kv_lora_rank]`), `wo` the output.
fn latent_attention(
    src: &Taking,
    cfg: &ModelConfig,
    m: &crate::config::Mla,
    n: &dyn Fn(&str) -> String,
) -> Result<AttnWeights> {
    let (arch, h, heads) = (cfg.arch, cfg.hidden, cfg.n_heads);
    let q = heads * m.q_head();
    if src.has(&n("attn_kv_b.weight")) {
        return Err(Error::Input(format!(
            "{}: `{}`: this file keeps the keys' and values' up-projection in one tensor, as converters \
             before llama.cpp's split of it wrote; convert the model again with a current convert_hf_to_gguf.py",
            src.source.path().display(),
            n("attn_kv_b.weight")
        )));
    }
    let (wq, q_a) = match m.q_lora_rank {
        0 => (src.matrix(&n("attn_q.weight"), q, h, arch)?, None),
        r => (
            src.matrix(&n("attn_q_b.weight"), q, r, arch)?,
            Some(src.matrix(&n("attn_q_a.weight"), r, h, arch)?),
        ),
    };
    let q_a_norm = match m.q_lora_rank {
        0 => None,
        r => Some(src.vector(&n("attn_q_a_norm.weight"), r, arch)?),
    };
    Ok(AttnWeights {
        wq,
        wk: src.matrix(&n("attn_kv_a_mqa.weight"), m.latent(), h, arch)?,
        wv: src.stacked(&n("attn_v_b.weight"), heads, m.v_head, m.kv_lora_rank, arch)?,
        wo: src.matrix(&n("attn_output.weight"), h, heads * m.v_head, arch)?,
        mla: Some(Box::new(MlaWeights {
            q_a,
            q_a_norm,
            kv_a_norm: src.vector(&n("attn_kv_a_norm.weight"), m.kv_lora_rank, arch)?,
            k_b: src.stacked(&n("attn_k_b.weight"), heads, m.kv_lora_rank, m.qk_nope, arch)?,
        })),
    })
}

/// The FFN down projection in one of its two storage orders.
pub enum FfnDown {
    /// `[hidden, ffn]`: rows run along the neurons, as GGUF and safetensors store `down_proj`.
    Rows(Weight),
    /// `[ffn, hidden]`: row n is neuron n's down column, contiguous along hidden (the `.gst`
    /// neuron-major layout, where one neuron is one read).
    Columns(Weight),
}

impl FfnDown {
    pub fn weight(&self) -> &Weight {
        match self {
            FfnDown::Rows(w) | FfnDown::Columns(w) => w,
        }
    }
}

/// A gated FFN: `down · (act(gate·x) ⊙ up·x)`.
pub struct FfnWeights {
    pub gate: Weight,  // [ffn, hidden]
    pub up: Weight,    // [ffn, hidden]
    pub down: FfnDown, // [hidden, ffn] rows or [ffn, hidden] columns
}

/// A mixture-of-experts FFN (see [`crate::config::MoeConfig`]).
pub struct ExpertWeights {
    /// `[n_experts, hidden]`: the router's logits are `router · x`.
    pub router: Weight,
    /// `[n_experts]`: added to the experts' scores to choose them (`exp_probs_b`; GLM-4.5,
    /// DeepSeek-V3), not to weigh them.
    pub score_bias: Option<Vec<f32>>,
    /// Each expert's FFN, `[expert_ffn, hidden]` gate and up, `[hidden, expert_ffn]` down.
    pub experts: Vec<FfnWeights>,
    /// The shared expert(s), with Qwen2-MoE's gate vector `[hidden]` where gated: every token
    /// adds `sigmoid(gate · x) · ffn(x)`, or `ffn(x)` without a gate (GLM-4.5).
    pub shared: Option<(FfnWeights, Option<Vec<f32>>)>,
    /// gpt-oss: the router's and the experts' biases ([`crate::config::MoeConfig::oai_experts`]),
    /// kept resident (in RAM and streamed alike: a few MB a layer).
    pub biases: Option<ExpertBiases>,
}

/// The biases of a gpt-oss expert layer, each expert's slice in expert order.
pub struct ExpertBiases {
    /// `[n_experts]`, added to the router's logits (`ffn_gate_inp.bias`).
    pub router: Vec<f32>,
    /// `[n_experts, expert_ffn]` (`ffn_gate_exps.bias`, `ffn_up_exps.bias`).
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    /// `[n_experts, hidden]` (`ffn_down_exps.bias`).
    pub down: Vec<f32>,
}

impl ExpertBiases {
    /// Expert `e`'s gate, up and down biases.
    pub fn of(&self, e: usize) -> [&[f32]; 3] {
        let (f, h) = (self.gate.len() / self.router.len(), self.down.len() / self.router.len());
        [
            &self.gate[e * f..(e + 1) * f],
            &self.up[e * f..(e + 1) * f],
            &self.down[e * h..(e + 1) * h],
        ]
    }

    fn len(&self) -> usize {
        self.router.len() + self.gate.len() + self.up.len() + self.down.len()
    }
}

impl ExpertWeights {
    /// Bytes of the f32 vectors (score bias, shared gate), which a stream keeps resident
    /// (gpt-oss's biases are counted in [`LayerWeights::vector_bytes`]).
    pub fn vector_bytes(&self) -> u64 {
        let bias = self.score_bias.as_ref().map_or(0, |b| b.len());
        let gate = self.shared.as_ref().and_then(|s| s.1.as_ref()).map_or(0, |g| g.len());
        4 * (bias + gate) as u64
    }
}

/// A layer's FFN: dense, or experts (boxed; the dense variant is the common one and is never moved
/// per token).
#[allow(clippy::large_enum_variant)]
pub enum LayerFfn {
    Dense(FfnWeights),
    Experts(Box<ExpertWeights>),
}

/// One transformer block's weights. Shapes are `[rows, cols]` = `[out, in]`.
pub struct LayerWeights {
    pub attn_norm: Vec<f32>, // [hidden]
    /// wq `[n_heads*head_dim, hidden]`, wk and wv `[n_kv_heads*head_dim, hidden]`,
    /// wo `[hidden, n_heads*head_dim]`.
    pub attn: AttnWeights,
    pub bq: Option<Vec<f32>>, // [n_heads*head_dim] (qwen2)
    pub bk: Option<Vec<f32>>, // [n_kv_heads*head_dim]
    pub bv: Option<Vec<f32>>, // [n_kv_heads*head_dim]
    /// The attention output's bias `[hidden]` (gpt-oss).
    pub bo: Option<Vec<f32>>,
    /// One attention-sink logit per query head `[n_heads]` (gpt-oss; see
    /// [`crate::backend::AttnShape::sinks`]).
    pub attn_sinks: Option<Vec<f32>>,
    /// `[head_dim]` per head (gemma3, qwen3moe), or `[n_heads*head_dim]` over the whole
    /// projection (olmoe, `qk_norm_whole`).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,         // [head_dim] or [n_kv_heads*head_dim]
    pub post_attn_norm: Option<Vec<f32>>, // [hidden] (gemma3)
    pub ffn_norm: Vec<f32>,               // [hidden]
    pub ffn: LayerFfn,
    pub post_ffn_norm: Option<Vec<f32>>, // [hidden] (gemma3)
}

impl LayerWeights {
    /// Bytes of the layer's f32 vectors (norms, biases), which a stream keeps resident.
    pub fn vector_bytes(&self) -> u64 {
        let opt = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| v.len());
        4 * (self.attn_norm.len()
            + self.ffn_norm.len()
            + opt(&self.bq)
            + opt(&self.bk)
            + opt(&self.bv)
            + opt(&self.q_norm)
            + opt(&self.k_norm)
            + opt(&self.post_attn_norm)
            + opt(&self.post_ffn_norm)
            + opt(&self.bo)
            + opt(&self.attn_sinks)
            + self
                .attn
                .mla
                .as_ref()
                .map_or(0, |m| m.kv_a_norm.len() + opt(&m.q_a_norm))
            + match &self.ffn {
                LayerFfn::Experts(e) => e.biases.as_ref().map_or(0, |b| b.len()),
                LayerFfn::Dense(_) => 0,
            }) as u64
    }

    /// The dense FFN, or an error naming `what` (a path that does not read experts yet).
    pub fn dense(&self, what: &str) -> Result<&FfnWeights> {
        match &self.ffn {
            LayerFfn::Dense(f) => Ok(f),
            LayerFfn::Experts(_) => Err(Error::Input(format!(
                "{what} does not read mixture-of-experts models yet (dense FFNs only); `run`, \
                 `perplexity` and `serve` run them in RAM with --mode dense"
            ))),
        }
    }
}

pub struct ModelWeights {
    pub token_embd: Weight, // [vocab, hidden]
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>, // [hidden]
    pub output: Weight,        // [vocab, hidden]; the embedding matrix when tied
}

/// The per-layer tensor names of each source format.
struct Names {
    gguf: bool,
}

impl Names {
    fn global(&self, what: &str) -> &'static str {
        match (self.gguf, what) {
            (true, "embd") => "token_embd.weight",
            (true, "norm") => "output_norm.weight",
            (true, "output") => "output.weight",
            (false, "embd") => "model.embed_tokens.weight",
            (false, "norm") => "model.norm.weight",
            (false, "output") => "lm_head.weight",
            _ => unreachable!("unknown global tensor {what}"),
        }
    }

    /// `what` is the GGUF short name; the Hugging Face name is derived from it.
    fn layer(&self, l: usize, what: &str, arch: Arch) -> String {
        if self.gguf {
            return format!("blk.{l}.{what}");
        }
        let hf = match (what, arch) {
            ("attn_norm.weight", _) => "input_layernorm.weight",
            ("attn_q.weight", _) => "self_attn.q_proj.weight",
            ("attn_k.weight", _) => "self_attn.k_proj.weight",
            ("attn_v.weight", _) => "self_attn.v_proj.weight",
            ("attn_output.weight", _) => "self_attn.o_proj.weight",
            ("attn_q.bias", _) => "self_attn.q_proj.bias",
            ("attn_k.bias", _) => "self_attn.k_proj.bias",
            ("attn_v.bias", _) => "self_attn.v_proj.bias",
            ("attn_q_norm.weight", _) => "self_attn.q_norm.weight",
            ("attn_k_norm.weight", _) => "self_attn.k_norm.weight",
            ("post_attention_norm.weight", _) => "post_attention_layernorm.weight",
            ("ffn_norm.weight", Arch::Gemma3) => "pre_feedforward_layernorm.weight",
            ("ffn_norm.weight", _) => "post_attention_layernorm.weight",
            ("post_ffw_norm.weight", _) => "post_feedforward_layernorm.weight",
            ("ffn_gate.weight", _) => "mlp.gate_proj.weight",
            ("ffn_up.weight", _) => "mlp.up_proj.weight",
            ("ffn_down.weight", _) => "mlp.down_proj.weight",
            // Mixtral's router, then every other mixture's (Qwen-MoE, OLMoE).
            ("ffn_gate_inp.weight", Arch::Llama) => "block_sparse_moe.gate.weight",
            ("ffn_gate_inp.weight", _) => "mlp.gate.weight",
            ("ffn_gate_inp_shexp.weight", _) => "mlp.shared_expert_gate.weight",
            ("ffn_gate_shexp.weight", _) => "mlp.shared_expert.gate_proj.weight",
            ("ffn_up_shexp.weight", _) => "mlp.shared_expert.up_proj.weight",
            ("ffn_down_shexp.weight", _) => "mlp.shared_expert.down_proj.weight",
            _ => unreachable!("unknown layer tensor {what}"),
        };
        format!("model.layers.{l}.{hf}")
    }

    /// Expert `e`'s gate, up and down matrices of layer `l` in a Hugging Face folder (each
    /// expert's own tensors: Mixtral's `w1`, `w3`, `w2`; the others' `gate_proj`, `up_proj`,
    /// `down_proj`).
    fn hf_expert(l: usize, e: usize, arch: Arch) -> [String; 3] {
        let [gate, up, down] = match arch {
            Arch::Llama => ["w1", "w3", "w2"],
            _ => ["gate_proj", "up_proj", "down_proj"],
        };
        let block = match arch {
            Arch::Llama => "block_sparse_moe",
            _ => "mlp",
        };
        [gate, up, down].map(|m| format!("model.layers.{l}.{block}.experts.{e}.{m}.weight"))
    }
}

/// The matrices of `ModelWeights` `$w`, borrowed shared or (`mut`) mutably: one listing for both.
macro_rules! every_matrix {
    ($w:expr $(, $m:ident)?) => {{
        let w = $w;
        let mut out = vec![& $($m)? w.token_embd, & $($m)? w.output];
        for l in & $($m)? w.layers {
            let AttnWeights { wq, wk, wv, wo, mla } = & $($m)? l.attn;
            out.extend([wq, wk, wv, wo]);
            if let Some(m) = mla {
                let MlaWeights { q_a, k_b, .. } = & $($m)? **m;
                out.extend(q_a.into_iter().chain([k_b]));
            }
            let ffns: Vec<& $($m)? FfnWeights> = match & $($m)? l.ffn {
                LayerFfn::Dense(f) => vec![f],
                LayerFfn::Experts(e) => {
                    let ExpertWeights { router, experts, shared, .. } = & $($m)? **e;
                    out.push(router);
                    experts.into_iter().chain(shared.into_iter().map(|(f, _)| f)).collect()
                }
            };
            for f in ffns {
                let FfnWeights { gate, up, down } = f;
                let (FfnDown::Rows(down) | FfnDown::Columns(down)) = down;
                out.extend([gate, up, down]);
            }
        }
        out
    }};
}

impl ModelWeights {
    /// Every matrix of the model: the embedding, the output, then each layer's attention and
    /// FFN (a mixture of experts: its router, experts and shared expert).
    pub fn matrices(&self) -> Vec<&Weight> {
        every_matrix!(self)
    }

    /// The same, to change.
    fn matrices_mut(&mut self) -> Vec<&mut Weight> {
        every_matrix!(self, mut)
    }

    /// Drops every matrix's view of the file, keeping only where it is in `src`'s byte space
    /// ([`TensorSource::parts`], [`Weight::on_disk`]).
    pub fn leave_on_disk(&mut self, src: &TensorSource) {
        for w in self.matrices_mut() {
            *w = w.on_disk(src.base_of(&w.name));
        }
    }

    /// The weights `cfg` needs from `source`. A GGUF file holding a tensor the computation does
    /// not read (and none of [`IGNORED_TENSORS`]) is refused ([`Error::UnusedTensor`]).
    pub fn load(source: &TensorSource, cfg: &ModelConfig) -> Result<ModelWeights> {
        let src = &Taking::new(source);
        let weights = Self::load_from(src, cfg)?;
        if let TensorSource::Gguf(g) = source {
            let taken = src.taken.borrow();
            let by_config = |name: &str| {
                (name == ROPE_FREQS_TENSOR && cfg.rope_freq_factors.is_some()) || ignored_by_config(cfg, name)
            };
            if let Some(t) = g.tensors.iter().find(|t| {
                !taken.contains(&t.name) && !by_config(&t.name) && !IGNORED_TENSORS.contains(&t.name.as_str())
            }) {
                return Err(Error::UnusedTensor {
                    path: g.path.clone(),
                    tensor: t.name.clone(),
                    arch: g
                        .get("general.architecture")
                        .and_then(|v| v.as_str())
                        .unwrap_or(cfg.arch.name())
                        .into(),
                    offset_bytes: t.offset_bytes,
                });
            }
        }
        Ok(weights)
    }

    fn load_from(src: &Taking, cfg: &ModelConfig) -> Result<ModelWeights> {
        let names = Names {
            gguf: !matches!(src.source, TensorSource::Safetensors { .. }),
        };
        let neuron_major = matches!(src.source, TensorSource::Gst(_));
        let arch = cfg.arch;
        // Hugging Face Gemma checkpoints store norm weights as w with the model using (1 + w);
        // GGUF files already hold 1 + w.
        let norm_offset = if arch == Arch::Gemma3 && !names.gguf { 1.0 } else { 0.0 };
        let norm = |name: &str, len: usize| -> Result<Vec<f32>> {
            let mut v = src.vector(name, len, arch)?;
            v.iter_mut().for_each(|x| *x += norm_offset);
            Ok(v)
        };
        let (h, q, kv) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim());
        // GLM's pre-FFN norm is `post_attention_norm` in its GGUF files (`.gst` files name every
        // architecture's `ffn_norm`).
        let ffn_norm_name = match (arch, src.source) {
            (Arch::Glm4Moe, TensorSource::Gguf(_)) => "post_attention_norm.weight",
            _ => "ffn_norm.weight",
        };
        let qk_norm = cfg.qk_norm || cfg.qk_norm_whole;
        let qk_norm_len = |per_head: usize, whole: usize| if cfg.qk_norm_whole { whole } else { per_head };
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |what: &str| names.layer(l, what, arch);
            let opt_vec = |what: &str, len: usize| -> Result<Option<Vec<f32>>> {
                let name = n(what);
                if src.has(&name) {
                    src.vector(&name, len, arch).map(Some)
                } else {
                    Ok(None)
                }
            };
            let need_norm = |what: &str, len: usize, needed: bool| -> Result<Option<Vec<f32>>> {
                if needed {
                    norm(&n(what), len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let attn = match cfg.mla {
                None => AttnWeights {
                    wq: src.matrix(&n("attn_q.weight"), q, h, arch)?,
                    wk: src.matrix(&n("attn_k.weight"), kv, h, arch)?,
                    wv: src.matrix(&n("attn_v.weight"), kv, h, arch)?,
                    wo: src.matrix(&n("attn_output.weight"), h, q, arch)?,
                    mla: None,
                },
                Some(m) => latent_attention(src, cfg, &m, &n)?,
            };
            layers.push(LayerWeights {
                attn_norm: norm(&n("attn_norm.weight"), h)?,
                attn,
                bq: opt_vec("attn_q.bias", q)?,
                bk: opt_vec("attn_k.bias", kv)?,
                bv: opt_vec("attn_v.bias", kv)?,
                bo: match cfg.attn_sinks {
                    true => Some(src.vector(&n("attn_output.bias"), h, arch)?),
                    false => None,
                },
                attn_sinks: match cfg.attn_sinks {
                    true => Some(src.vector(&n("attn_sinks.weight"), cfg.n_heads, arch)?),
                    false => None,
                },
                q_norm: need_norm("attn_q_norm.weight", qk_norm_len(cfg.head_dim, q), qk_norm)?,
                k_norm: need_norm("attn_k_norm.weight", qk_norm_len(cfg.head_dim, kv), qk_norm)?,
                post_attn_norm: need_norm("post_attention_norm.weight", h, cfg.post_norms)?,
                // gpt-oss's GGUF names the FFN's norm `post_attention_norm` (a `.gst` writes
                // every model's as `ffn_norm`).
                ffn_norm: match arch {
                    Arch::GptOss if !neuron_major => norm(&n("post_attention_norm.weight"), h)?,
                    _ => norm(&n(ffn_norm_name), h)?,
                },

                ffn: match cfg.moe.as_ref().filter(|m| m.layer_has_experts(l)) {
                    None => LayerFfn::Dense(FfnWeights {
                        gate: src.matrix(&n("ffn_gate.weight"), cfg.layer_ffn(l), h, arch)?,
                        up: src.matrix(&n("ffn_up.weight"), cfg.layer_ffn(l), h, arch)?,
                        // A `.gst` holds down columns unless its layout is `rows` (down as stored).
                        down: if neuron_major && !src.has(&n("ffn_down.weight")) {
                            FfnDown::Columns(src.matrix(&n("ffn_down_t.weight"), cfg.layer_ffn(l), h, arch)?)
                        } else {
                            FfnDown::Rows(src.matrix(&n("ffn_down.weight"), h, cfg.layer_ffn(l), arch)?)
                        },
                    }),
                    Some(m) => {
                        let (e, f) = (m.n_experts, cfg.ffn);
                        let experts = if neuron_major {
                            // `.gst`: each expert in its own section (gate, up, down rows).
                            (0..e)
                                .map(|i| {
                                    Ok(FfnWeights {
                                        gate: src.matrix(&n(&format!("ffn_gate_exps.{i}.weight")), f, h, arch)?,
                                        up: src.matrix(&n(&format!("ffn_up_exps.{i}.weight")), f, h, arch)?,
                                        down: FfnDown::Rows(src.matrix(
                                            &n(&format!("ffn_down_exps.{i}.weight")),
                                            h,
                                            f,
                                            arch,
                                        )?),
                                    })
                                })
                                .collect::<Result<Vec<_>>>()?
                        } else if !names.gguf {
                            (0..e)
                                .map(|i| {
                                    let [gate, up, down] = Names::hf_expert(l, i, arch);
                                    Ok(FfnWeights {
                                        gate: src.matrix(&gate, f, h, arch)?,
                                        up: src.matrix(&up, f, h, arch)?,
                                        down: FfnDown::Rows(src.matrix(&down, h, f, arch)?),
                                    })
                                })
                                .collect::<Result<Vec<_>>>()?
                        } else {
                            let gate = src.experts(&n("ffn_gate_exps.weight"), e, f, h, arch)?;
                            let up = src.experts(&n("ffn_up_exps.weight"), e, f, h, arch)?;
                            let down = src.experts(&n("ffn_down_exps.weight"), e, h, f, arch)?;
                            (gate.into_iter().zip(up).zip(down))
                                .map(|((gate, up), down)| FfnWeights {
                                    gate,
                                    up,
                                    down: FfnDown::Rows(down),
                                })
                                .collect()
                        };
                        let shared = match m.shared_ffn {
                            0 => None,
                            s => Some((
                                FfnWeights {
                                    gate: src.matrix(&n("ffn_gate_shexp.weight"), s, h, arch)?,
                                    up: src.matrix(&n("ffn_up_shexp.weight"), s, h, arch)?,
                                    down: FfnDown::Rows(src.matrix(&n("ffn_down_shexp.weight"), h, s, arch)?),
                                },
                                match m.shared_gated {
                                    true => Some(src.vector(&n("ffn_gate_inp_shexp.weight"), h, arch)?),
                                    false => None,
                                },
                            )),
                        };
                        let biases = match m.oai_experts {
                            true => Some(ExpertBiases {
                                router: src.vector(&n("ffn_gate_inp.bias"), e, arch)?,
                                gate: src.vector(&n("ffn_gate_exps.bias"), e * f, arch)?,
                                up: src.vector(&n("ffn_up_exps.bias"), e * f, arch)?,
                                down: src.vector(&n("ffn_down_exps.bias"), e * h, arch)?,
                            }),
                            false => None,
                        };
                        LayerFfn::Experts(Box::new(ExpertWeights {
                            router: src.matrix(&n("ffn_gate_inp.weight"), e, h, arch)?,
                            score_bias: match m.score_bias {
                                true => Some(src.vector(&n("exp_probs_b.bias"), e, arch)?),
                                false => None,
                            },
                            experts,
                            shared,
                            biases,
                        }))
                    }
                },
                post_ffn_norm: need_norm("post_ffw_norm.weight", h, cfg.post_norms)?,
            });
            if cfg.attn_bias {
                let lw = &layers[l];
                for (b, what) in [
                    (&lw.bq, "attn_q.bias"),
                    (&lw.bk, "attn_k.bias"),
                    (&lw.bv, "attn_v.bias"),
                ] {
                    // (Qwen2 files carry all three or none: the first missing is named.)
                    if b.is_none() && (arch == Arch::GptOss || what == "attn_q.bias") {
                        return Err(src.missing(&n(what), arch));
                    }
                }
            }
        }
        let token_embd = src.matrix(names.global("embd"), cfg.vocab, h, arch)?;
        let output = if src.has(names.global("output")) {
            src.matrix(names.global("output"), cfg.vocab, h, arch)?
        } else {
            token_embd.clone()
        };
        Ok(ModelWeights {
            token_embd,
            layers,
            output_norm: norm(names.global("norm"), h)?,
            output,
        })
    }
}
