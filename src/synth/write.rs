//! `make-model`: a model of a real shape with random weights, written a tensor at a time as a
//! GGUF llama.cpp loads, or a layer at a time as a `.gst` (through `reformat`'s builder, so it
//! is the file `reformat` would make from that GGUF). Memory stays at about one layer (plus the
//! tokenizer); nothing is left under the output's name unless the file is complete.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::shapes::{Mix, Role, Shape};
use super::tensors::{
    dequantized_bytes, f32_bytes, name_seed, random_bias, random_matrix, random_norm, random_router, random_sinks,
};
use crate::config::{Arch, ModelConfig};
use crate::error::{Error, Result};
use crate::format::SourceInfo;
use crate::gguf::write::{gguf_header, TensorInfoOut};
use crate::gguf::{GgufFile, MetaValue};
use crate::model::forward::AttnWeights;
use crate::model::tokenizer::{GgufVocab, TokenizerSpec};
use crate::model::weights::{ExpertBiases, ExpertWeights, FfnDown, FfnWeights, LayerFfn, LayerWeights};
use crate::quant::GgmlType;
use crate::reformat::{GstBuilder, ReformatOptions};
use crate::tensor::Weight;

/// Where the tokenizer comes from.
#[derive(Clone, Debug)]
pub enum TokenizerChoice {
    /// A GGUF file's tokenizer (a real one: `tools/fetch-models.sh`); its vocabulary is padded with
    /// unused `[PAD<id>]` tokens up to the shape's vocabulary, or, when it has more tokens than
    /// the shape, sets the vocabulary.
    From(PathBuf),
    /// A SentencePiece-style vocabulary of the shape's size made up here (control tokens, the
    /// 256 byte tokens, then `▁w<id>` pieces): for models that need an exact small vocabulary
    /// (tests); text tokenizes into bytes.
    Synthetic,
}

/// What file to write.
#[derive(Clone, Debug)]
pub enum OutputFormat {
    Gguf,
    /// A GGUF whose header is written and whose tensor data is a hole of its length (a sparse
    /// file reading as zeros, taking no disk room): what the planner, the expert cache and the
    /// loader make of a model too large for this disk (DeepSeek-V3), not a model to run for its
    /// output or its speed.
    GgufHeaderOnly,
    /// A `.gst` with these options (the FFN layout, down's type…; no calibration).
    Gst(ReformatOptions),
}

/// What to make.
#[derive(Clone, Debug)]
pub struct MakeSpec {
    pub shape: Shape,
    pub mix: Mix,
    /// Store the mix's weights decoded to F32 (the same values, exactly): a reference for the
    /// f32 paths.
    pub dequantize: bool,
    pub tokenizer: TokenizerChoice,
    pub seed: u64,
    /// The residual branches' last products (`attn_output`, `ffn_down`) at this share of the
    /// other matrices' scale, so a deep random network's residual stream stays finite and its
    /// logits distinct.
    pub residual_gain: f32,
}

/// What was written.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MakeReport {
    pub output: PathBuf,
    pub format: &'static str,
    pub shape: Shape,
    pub mix: &'static str,
    pub dequantized: bool,
    pub tokenizer: String,
    /// The model's vocabulary (the shape's, or the tokenizer's when it has more tokens).
    pub vocab: usize,
    pub tensors: usize,
    pub parameters: u64,
    /// The tensors' bytes, and the file's.
    pub tensor_bytes: u64,
    pub file_bytes: u64,
    pub seconds: f64,
    /// The process's peak resident memory when the file was complete.
    pub peak_rss_bytes: u64,
}

/// How a tensor's values are made.
#[derive(Clone, Copy, Debug)]
enum Fill {
    Norm,
    /// Biases (a vector, or `[experts, width]` for experts' biases).
    Bias,
    /// An expert score bias: 0.3 N(0,1), about the spread of the experts' sigmoid scores, so
    /// it changes which experts are chosen.
    ScoreBias,
    /// gpt-oss's attention sinks, one logit per head.
    Sinks,
    Router,
    /// A matrix of `gen` type (the mix's; stored as F32 when dequantized) at `gain`.
    Matrix {
        gen: GgmlType,
        gain: f32,
    },
    /// `n` experts' matrices, the expert outermost.
    Experts {
        gen: GgmlType,
        gain: f32,
        n: usize,
    },
    /// Llama 3's RoPE frequency factors for heads of twice the length at `base`:
    /// `[factor, low_freq_factor, high_freq_factor, original context]`.
    RopeFactors {
        base: f32,
        rule: [f32; 4],
    },
}

/// One tensor of the file.
#[derive(Clone, Debug)]
struct Planned {
    name: String,
    /// `[rows, cols]` (`[n, rows, cols]` for experts; `[len]` for vectors), cols fastest.
    shape: Vec<usize>,
    ty: GgmlType,
    fill: Fill,
}

impl Planned {
    fn cols(&self) -> usize {
        *self.shape.last().expect("a tensor has a dimension")
    }
    fn rows(&self) -> usize {
        self.shape.iter().rev().skip(1).product()
    }
    fn len_bytes(&self) -> u64 {
        self.rows() as u64 * self.ty.row_bytes(self.cols()).expect("planned rows of whole blocks") as u64
    }
    /// GGUF dims (`ne`): fastest first.
    fn dims(&self) -> Vec<u64> {
        self.shape.iter().rev().map(|&d| d as u64).collect()
    }

    /// The tensor's bytes (the same for a seed whatever else is made).
    fn bytes(&self, seed: u64, dequantize: bool) -> Result<Vec<u8>> {
        let s = name_seed(seed, &self.name);
        let cols = self.cols();
        match self.fill {
            Fill::Norm => Ok(f32_bytes(&random_norm(cols, s))),
            Fill::Bias => Ok(f32_bytes(&random_bias(self.rows() * cols, s))),
            Fill::ScoreBias => Ok(f32_bytes(
                &random_bias(cols, s).iter().map(|b| 3.0 * b).collect::<Vec<_>>(),
            )),
            Fill::Sinks => Ok(f32_bytes(&random_sinks(cols, s))),
            Fill::Router => Ok(f32_bytes(&random_router(self.rows(), cols, s))),
            Fill::RopeFactors {
                base,
                rule: [f, lo, hi, ctx],
            } => Ok(f32_bytes(&crate::config::llama3_rope_factors(
                2 * cols,
                base,
                f,
                lo,
                hi,
                ctx,
            ))),
            Fill::Matrix { gen, gain } => {
                let b = random_matrix(gen, self.rows(), cols, gain, s)?;
                Ok(if dequantize {
                    dequantized_bytes(gen, &b, cols)
                } else {
                    b
                })
            }
            Fill::Experts { gen, gain, n } => {
                let rows = self.rows() / n;
                let mut out = Vec::with_capacity(self.len_bytes() as usize);
                for e in 0..n {
                    let b = random_matrix(gen, rows, cols, gain, name_seed(s, &e.to_string()))?;
                    out.extend(if dequantize {
                        dequantized_bytes(gen, &b, cols)
                    } else {
                        b
                    });
                }
                Ok(out)
            }
        }
    }
}

/// The model's tensors, in file order: the embedding, output norm and output, then each layer's.
fn plan(spec: &MakeSpec, vocab: usize) -> Vec<Vec<Planned>> {
    let s = &spec.shape;
    let (h, f, q, kv) = (s.hidden, s.ffn, s.q_dim(), s.kv_dim());
    let stored = |gen: GgmlType| if spec.dequantize { GgmlType::F32 } else { gen };
    let matrix = |name: String, role: Role, layer: usize, rows: usize, cols: usize, gain: f32| {
        let gen = spec.mix.matrix_type(s, role, layer, cols);
        Planned {
            name,
            shape: vec![rows, cols],
            ty: stored(gen),
            fill: Fill::Matrix { gen, gain },
        }
    };
    let vector = |name: String, len: usize, fill: Fill| Planned {
        name,
        shape: vec![len],
        ty: GgmlType::F32,
        fill,
    };
    let mut globals = vec![
        matrix("token_embd.weight".into(), Role::TokenEmbd, 0, vocab, h, 1.0),
        vector("output_norm.weight".into(), h, Fill::Norm),
    ];
    if !s.tied {
        globals.push(matrix("output.weight".into(), Role::Output, 0, vocab, h, 1.0));
    }
    if let Some(rule) = s.rope_factors {
        globals.push(vector(
            crate::config::ROPE_FREQS_TENSOR.into(),
            s.mla.map_or(s.head_dim, |m| m.qk_rope) / 2,
            Fill::RopeFactors {
                base: s.rope_theta,
                rule,
            },
        ));
    }
    let mut all = vec![globals];
    let g = spec.residual_gain;
    for l in 0..s.layers {
        let n = |what: &str| format!("blk.{l}.{what}");
        let mut t = vec![vector(n("attn_norm.weight"), h, Fill::Norm)];
        match s.mla {
            None => t.extend([
                matrix(n("attn_q.weight"), Role::AttnQ, l, q, h, 1.0),
                matrix(n("attn_k.weight"), Role::AttnK, l, kv, h, 1.0),
                matrix(n("attn_v.weight"), Role::AttnV, l, kv, h, 1.0),
                matrix(n("attn_output.weight"), Role::AttnOutput, l, h, q, g),
            ]),
            Some(m) => {
                // Latent attention as llama.cpp's converter writes it (`attn_kv_b` split into the
                // heads' key and value up-projections).
                let q = s.heads * m.q_head();
                match m.q_lora_rank {
                    0 => t.push(matrix(n("attn_q.weight"), Role::AttnQ, l, q, h, 1.0)),
                    r => t.extend([
                        matrix(n("attn_q_a.weight"), Role::AttnQ, l, r, h, 1.0),
                        vector(n("attn_q_a_norm.weight"), r, Fill::Norm),
                        matrix(n("attn_q_b.weight"), Role::AttnQ, l, q, r, 1.0),
                    ]),
                }
                t.push(matrix(n("attn_kv_a_mqa.weight"), Role::AttnK, l, m.latent(), h, 1.0));
                t.push(vector(n("attn_kv_a_norm.weight"), m.kv_lora_rank, Fill::Norm));
                for (what, role, rows, cols) in [
                    ("attn_k_b.weight", Role::AttnK, m.kv_lora_rank, m.qk_nope),
                    ("attn_v_b.weight", Role::AttnV, m.v_head, m.kv_lora_rank),
                ] {
                    let gen = spec.mix.matrix_type(s, role, l, cols);
                    t.push(Planned {
                        name: n(what),
                        shape: vec![s.heads, rows, cols],
                        ty: stored(gen),
                        fill: Fill::Experts {
                            gen,
                            gain: 1.0,
                            n: s.heads,
                        },
                    });
                }
                t.push(matrix(
                    n("attn_output.weight"),
                    Role::AttnOutput,
                    l,
                    h,
                    s.heads * m.v_head,
                    g,
                ));
            }
        }
        match s.arch {
            Arch::Qwen2 | Arch::Glm4Moe => {
                t.push(vector(n("attn_q.bias"), q, Fill::Bias));
                t.push(vector(n("attn_k.bias"), kv, Fill::Bias));
                t.push(vector(n("attn_v.bias"), kv, Fill::Bias));
            }
            Arch::Qwen3 | Arch::Qwen3Moe => {
                t.push(vector(n("attn_q_norm.weight"), s.head_dim, Fill::Norm));
                t.push(vector(n("attn_k_norm.weight"), s.head_dim, Fill::Norm));
            }
            Arch::Olmoe => {
                t.push(vector(n("attn_q_norm.weight"), q, Fill::Norm));
                t.push(vector(n("attn_k_norm.weight"), kv, Fill::Norm));
            }
            Arch::GptOss => {
                t.push(vector(n("attn_q.bias"), q, Fill::Bias));
                t.push(vector(n("attn_k.bias"), kv, Fill::Bias));
                t.push(vector(n("attn_v.bias"), kv, Fill::Bias));
                t.push(vector(n("attn_output.bias"), h, Fill::Bias));
                t.push(vector(n("attn_sinks.weight"), s.heads, Fill::Sinks));
            }
            _ => {}
        }
        // GLM's and gpt-oss's GGUFs name the pre-FFN norm `post_attention_norm`.
        let ffn_norm = if matches!(s.arch, Arch::Glm4Moe | Arch::GptOss) {
            "post_attention_norm.weight"
        } else {
            "ffn_norm.weight"
        };
        t.push(vector(n(ffn_norm), h, Fill::Norm));
        let routing = s.routing.as_ref();
        let experts = s.experts.filter(|_| routing.is_none_or(|r| l >= r.leading_dense));
        match experts {
            None => {
                let f = match routing {
                    Some(r) => r.dense_ffn,
                    None => f,
                };
                t.push(matrix(n("ffn_gate.weight"), Role::FfnGate, l, f, h, 1.0));
                t.push(matrix(n("ffn_up.weight"), Role::FfnUp, l, f, h, 1.0));
                t.push(matrix(n("ffn_down.weight"), Role::FfnDown, l, h, f, g));
            }
            Some((e, _)) => {
                t.push(Planned {
                    name: n("ffn_gate_inp.weight"),
                    shape: vec![e, h],
                    ty: GgmlType::F32,
                    fill: Fill::Router,
                });
                if routing.is_some_and(|r| r.score_bias) {
                    t.push(vector(n("exp_probs_b.bias"), e, Fill::ScoreBias));
                }
                for (what, role, rows, cols, gain) in [
                    ("ffn_gate_exps.weight", Role::FfnGate, f, h, 1.0),
                    ("ffn_up_exps.weight", Role::FfnUp, f, h, 1.0),
                    ("ffn_down_exps.weight", Role::FfnDown, h, f, g),
                ] {
                    let gen = spec.mix.matrix_type(s, role, l, cols);
                    t.push(Planned {
                        name: n(what),
                        shape: vec![e, rows, cols],
                        ty: stored(gen),
                        fill: Fill::Experts { gen, gain, n: e },
                    });
                }
                if let Some(r) = routing.filter(|r| r.shared_experts > 0) {
                    let sf = r.shared_experts * f;
                    t.push(matrix(n("ffn_gate_shexp.weight"), Role::FfnGate, l, sf, h, 1.0));
                    t.push(matrix(n("ffn_up_shexp.weight"), Role::FfnUp, l, sf, h, 1.0));
                    t.push(matrix(n("ffn_down_shexp.weight"), Role::FfnDown, l, h, sf, g));
                }
                if s.arch == Arch::GptOss {
                    // The router's and each expert's biases, `[experts, width]` (GGUF dims
                    // `{width, experts}`, as llama.cpp's loader asks).
                    t.push(vector(n("ffn_gate_inp.bias"), e, Fill::Bias));
                    for (what, width) in [
                        ("ffn_gate_exps.bias", f),
                        ("ffn_up_exps.bias", f),
                        ("ffn_down_exps.bias", h),
                    ] {
                        t.push(Planned {
                            name: n(what),
                            shape: vec![e, width],
                            ty: GgmlType::F32,
                            fill: Fill::Bias,
                        });
                    }
                }
            }
        }
        all.push(t);
    }
    all
}

/// The synthetic SentencePiece-style vocabulary of `n` tokens (see [`TokenizerChoice::Synthetic`]).
fn synthetic_vocab(n: usize) -> GgufVocab {
    let tokens = (0..n)
        .map(|i| match i {
            0 => "<unk>".to_string(),
            1 => "<s>".to_string(),
            2 => "</s>".to_string(),
            3..=258 => format!("<0x{:02X}>", i - 3),
            _ => format!("\u{2581}w{i}"),
        })
        .collect();
    GgufVocab {
        model: "llama".into(),
        tokens,
        scores: Some((0..n).map(|i| -(i as f32)).collect()),
        token_types: Some(
            (0..n)
                .map(|i| {
                    if i < 3 {
                        3
                    } else if i < 259 {
                        6
                    } else {
                        1
                    }
                })
                .collect(),
        ),
        bos_id: Some(1),
        eos_id: Some(2),
        unknown_id: Some(0),
        add_bos: Some(true),
        ..GgufVocab::default()
    }
}

/// The tokenizer's vocabulary, padded to `vocab` tokens (`[PAD<id>]`, unused) when it has
/// fewer; and the name to report.
fn vocabulary(choice: &TokenizerChoice, vocab: usize) -> Result<(GgufVocab, String)> {
    match choice {
        TokenizerChoice::Synthetic => {
            if vocab < 259 {
                return Err(Error::Input(format!(
                    "a synthetic tokenizer needs at least 259 tokens (3 control, 256 bytes); the shape has {vocab}"
                )));
            }
            Ok((synthetic_vocab(vocab), "synthetic".into()))
        }
        TokenizerChoice::From(path) => {
            let g = GgufFile::open(path)?;
            let mut v = crate::model::gguf_vocab(&g)?;
            let n = v.tokens.len();
            for i in n..vocab {
                v.tokens.push(format!("[PAD{i}]"));
            }
            if let Some(t) = v.token_types.as_mut() {
                t.resize(v.tokens.len(), 5);
            }
            if let Some(s) = v.scores.as_mut() {
                s.resize(v.tokens.len(), -1e9);
            }
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("model").to_string();
            Ok((v, name))
        }
    }
}

/// The GGUF metadata of the model: architecture, dimensions, file type, tokenizer.
fn metadata(spec: &MakeSpec, vocab: &GgufVocab) -> Vec<(String, MetaValue)> {
    let s = &spec.shape;
    let a = s.arch.name();
    let u = |v: usize| MetaValue::U32(v as u32);
    let mut m: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        (
            "general.name".into(),
            MetaValue::Str(format!(
                "{}-shaped random {} (gatestream make-model, seed {})",
                s.name,
                spec.mix.name(),
                spec.seed
            )),
        ),
        (
            "general.file_type".into(),
            MetaValue::U32(if spec.dequantize { 0 } else { spec.mix.file_type() }),
        ),
        ("general.quantization_version".into(), MetaValue::U32(2)),
    ];
    let ffn_key = match (s.arch, s.experts, &s.routing) {
        // Qwen's MoE files give the dense width beside the experts' own; GLM's, its leading
        // dense layers' width.
        (_, _, Some(r)) if r.leading_dense > 0 => r.dense_ffn,
        (Arch::Qwen3Moe | Arch::Glm4Moe, Some((_, k)), _) => s.ffn * k,
        _ => s.ffn,
    };
    for (key, v) in [
        ("context_length", u(s.context_len)),
        ("embedding_length", u(s.hidden)),
        ("feed_forward_length", u(ffn_key)),
        ("block_count", u(s.layers)),
        ("attention.head_count", u(s.heads)),
        ("attention.head_count_kv", u(s.kv_heads)),
        ("attention.key_length", u(s.head_dim)),
        (
            "attention.value_length",
            u(s.mla.map_or(s.head_dim, |m| m.kv_lora_rank)),
        ),
        ("attention.layer_norm_rms_epsilon", MetaValue::F32(s.rms_eps)),
        ("rope.freq_base", MetaValue::F32(s.rope_theta)),
        ("vocab_size", u(vocab.tokens.len())),
    ] {
        m.push((format!("{a}.{key}"), v));
    }
    if let Some(mla) = s.mla {
        // (llama.cpp reads the expert keys of a deepseek2 file whether or not it has experts.)
        for (key, v) in [
            ("attention.kv_lora_rank", mla.kv_lora_rank),
            // (0: no query bottleneck. llama.cpp needs the key unless the layer count is one of
            // V2-Lite's.)
            ("attention.q_lora_rank", mla.q_lora_rank),
            ("attention.key_length_mla", mla.q_head()),
            ("attention.value_length_mla", mla.v_head),
            ("rope.dimension_count", mla.qk_rope),
        ] {
            m.push((format!("{a}.{key}"), u(v)));
        }
        if s.routing.is_none() {
            // Dense in every layer.
            for (key, v) in [
                ("leading_dense_block_count", s.layers),
                ("expert_feed_forward_length", s.ffn),
                ("expert_shared_count", 1),
            ] {
                m.push((format!("{a}.{key}"), u(v)));
            }
        }
    }
    if let Some((e, k)) = s.experts {
        m.push((format!("{a}.expert_count"), u(e)));
        m.push((format!("{a}.expert_used_count"), u(k)));
        if matches!(s.arch, Arch::Qwen3Moe | Arch::Glm4Moe | Arch::Deepseek2 | Arch::GptOss) {
            m.push((format!("{a}.expert_feed_forward_length"), u(s.ffn)));
        }
    }
    if let Some(d) = s.rope_dim {
        m.push((format!("{a}.rope.dimension_count"), u(d)));
    }
    if let Some(r) = &s.routing {
        // As llama.cpp's converter writes GLM-4.5's (gating function 2: sigmoid).
        m.push((format!("{a}.expert_shared_count"), u(r.shared_experts)));
        m.push((format!("{a}.leading_dense_block_count"), u(r.leading_dense)));
        m.push((
            format!("{a}.expert_gating_func"),
            MetaValue::U32(if r.sigmoid { 2 } else { 1 }),
        ));
        m.push((format!("{a}.expert_weights_scale"), MetaValue::F32(r.routed_scale)));
        m.push((format!("{a}.expert_weights_norm"), MetaValue::Bool(r.normalize)));
        if let Some((n, used)) = r.groups {
            m.push((format!("{a}.expert_group_count"), u(n)));
            m.push((format!("{a}.expert_group_used_count"), u(used)));
        }
    }
    if s.arch == Arch::GptOss {
        // As convert_hf_to_gguf.py writes the released configs'.
        let (factor, original) = super::shapes::GPT_OSS_YARN;
        m.push((
            format!("{a}.attention.sliding_window"),
            u(super::shapes::GPT_OSS_SLIDING_WINDOW),
        ));
        m.push((format!("{a}.rope.scaling.type"), MetaValue::Str("yarn".into())));
        m.push((format!("{a}.rope.scaling.factor"), MetaValue::F32(factor)));
        m.push((format!("{a}.rope.scaling.original_context_length"), u(original)));
    }
    m.extend(crate::model::gguf_vocab_metadata(vocab));
    m
}

/// The configuration a reader makes of `meta` (a GGUF of no tensors parsed in memory), so a
/// `.gst` written directly says what its GGUF would; what a reader learns from the tensors
/// themselves (DeepSeek's score bias) from `shape`.
fn config_of(meta: &[(&str, MetaValue)], vocab: usize, out: &Path, shape: &Shape) -> Result<ModelConfig> {
    let (bytes, _) = gguf_header(meta, &[]);
    let mut map = memmap2::MmapMut::map_anon(bytes.len()).map_err(|e| Error::io(out, e))?;
    map.copy_from_slice(&bytes);
    let map = map.make_read_only().map_err(|e| Error::io(out, e))?;
    let g = GgufFile::parse(out, Arc::new(map))?;
    let mut c = ModelConfig::from_gguf(&g, vocab)?;
    if let (Some(m), Some(r)) = (c.moe.as_mut(), &shape.routing) {
        m.score_bias = r.score_bias;
    }
    Ok(c)
}

/// A file being written under a temporary name in the target's folder, renamed when complete,
/// removed if dropped before.
struct Partial {
    tmp: PathBuf,
    target: PathBuf,
    file: Option<std::io::BufWriter<std::fs::File>>,
}

impl Partial {
    fn create(target: &Path) -> Result<Partial> {
        let dir = match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("model");
        let tmp = dir.join(format!(".{name}.partial-{}", std::process::id()));
        let f = std::fs::File::create(&tmp).map_err(|e| {
            Error::Input(format!(
                "cannot write {}: creating its temporary file in {} failed ({e}); is the folder there and writable?",
                target.display(),
                dir.display()
            ))
        })?;
        Ok(Partial {
            tmp,
            target: target.to_path_buf(),
            file: Some(std::io::BufWriter::with_capacity(8 << 20, f)),
        })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let f = self.file.as_mut().expect("open until finished");
        f.write_all(bytes).map_err(|e| Error::io(&self.tmp, e))
    }

    /// Ends the file at `len` bytes without writing what lies past what was written (a hole).
    fn finish_sparse(mut self, len: u64) -> Result<()> {
        let f = self.file.take().expect("open until finished");
        let f = f.into_inner().map_err(|e| Error::io(&self.tmp, e.into_error()))?;
        f.set_len(len).map_err(|e| Error::io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.target).map_err(|e| Error::io(&self.target, e))
    }

    fn finish(mut self) -> Result<()> {
        let f = self.file.take().expect("open until finished");
        let f = f.into_inner().map_err(|e| Error::io(&self.tmp, e.into_error()))?;
        f.sync_all().map_err(|e| Error::io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.target).map_err(|e| Error::io(&self.target, e))
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Refuses to start a file of `bytes` where the disk has less room (with a margin of 1%).
fn check_room(out: &Path, bytes: u64) -> Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let dir = match out.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| Error::Input(format!("{}: a path with a NUL byte", dir.display())))?;
        // SAFETY: `c` is a NUL-terminated path and `st` a zeroed statvfs the call fills.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above: a NUL-terminated path, and `st` writable for one statvfs.
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0 {
            let free = st.f_bavail as u64 * st.f_frsize as u64;
            if free < bytes + bytes / 100 {
                return Err(Error::Input(format!(
                    "{}: the model needs {:.2} GB and {} has {:.2} GB free; free some room or write elsewhere",
                    out.display(),
                    bytes as f64 / 1e9,
                    dir.display(),
                    free as f64 / 1e9
                )));
            }
        }
    }
    Ok(())
}

/// Writes the model `spec` describes to `out` as `format`; `progress(done, total)` in bytes of
/// tensors made. Refuses an existing `out` unless `force`.
pub fn write_model(
    spec: &MakeSpec,
    out: &Path,
    format: &OutputFormat,
    force: bool,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<MakeReport> {
    let t0 = Instant::now();
    if out.exists() && !force {
        return Err(Error::Input(format!(
            "{} already exists; pass --force to replace it",
            out.display()
        )));
    }
    if !(spec.residual_gain.is_finite() && spec.residual_gain > 0.0) {
        return Err(Error::Input(format!(
            "residual gain {}: give a positive number",
            spec.residual_gain
        )));
    }
    let (vocab_tokens, tokenizer_name) = vocabulary(&spec.tokenizer, spec.shape.vocab)?;
    let vocab = vocab_tokens.tokens.len();
    // The shape as written: its vocabulary is the tokenizer's when that has more tokens (or the
    // shape gives none).
    let spec = &MakeSpec {
        shape: Shape {
            vocab,
            ..spec.shape.clone()
        },
        ..spec.clone()
    };
    spec.shape.check()?;
    let meta = metadata(spec, &vocab_tokens);
    let meta_refs: Vec<(&str, MetaValue)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let mut config = config_of(&meta_refs, vocab, out, &spec.shape)?;
    // (A tensor, not metadata, in the GGUF; YaRN's factors, gpt-oss's, come from the metadata.)
    if let Some(f) = spec.shape.rope_freq_factors() {
        config.rope_freq_factors = Some(f);
    }
    let planned = plan(spec, vocab);
    let all: Vec<&Planned> = planned.iter().flatten().collect();
    if config.arch == Arch::Glm4Moe {
        // (A GGUF's reader sees these optional tensors; the header alone does not.)
        let has = |n: &str| all.iter().any(|p| p.name == n);
        config.attn_bias = has("blk.0.attn_q.bias");
        config.qk_norm = has("blk.0.attn_q_norm.weight");
    }
    let config = config.validate(out)?;
    let total: u64 = all.iter().map(|p| p.len_bytes()).sum();
    let parameters: u64 = all.iter().map(|p| p.shape.iter().product::<usize>() as u64).sum();
    if !matches!(format, OutputFormat::GgufHeaderOnly) {
        check_room(out, total)?;
    }
    let mut done = 0u64;
    let (format_name, file_bytes) = match format {
        OutputFormat::Gguf | OutputFormat::GgufHeaderOnly => {
            let dims: Vec<Vec<u64>> = all.iter().map(|p| p.dims()).collect();
            let infos: Vec<TensorInfoOut> = all
                .iter()
                .zip(&dims)
                .map(|(p, d)| TensorInfoOut {
                    name: &p.name,
                    dims: d,
                    type_id: p.ty.ggml_id(),
                    len_bytes: p.len_bytes(),
                })
                .collect();
            let (header, offsets) = gguf_header(&meta_refs, &infos);
            let mut file = Partial::create(out)?;
            file.write(&header)?;
            if matches!(format, OutputFormat::GgufHeaderOnly) {
                let end = header.len() as u64
                    + offsets
                        .last()
                        .map_or(0, |o| o + all.last().map_or(0, |p| p.len_bytes()));
                file.finish_sparse(end)?;
                ("gguf header only (its data a hole)", end)
            } else {
                let mut at = 0u64;
                for (p, &off) in all.iter().zip(&offsets) {
                    file.write(&vec![0u8; (off - at) as usize])?;
                    let b = p.bytes(spec.seed, spec.dequantize)?;
                    debug_assert_eq!(b.len() as u64, p.len_bytes());
                    file.write(&b)?;
                    at = off + b.len() as u64;
                    done += b.len() as u64;
                    progress(done, total);
                }
                file.finish()?;
                ("gguf", header.len() as u64 + at)
            }
        }
        OutputFormat::Gst(opts) => {
            let mut b = GstBuilder::create(out, &ReformatOptions { force, ..opts.clone() })?;
            let mut made = |p: &Planned| -> Result<Vec<u8>> {
                let bytes = p.bytes(spec.seed, spec.dequantize)?;
                done += bytes.len() as u64;
                progress(done, total);
                Ok(bytes)
            };
            let globals = &planned[0];
            let find = |name: &str| globals.iter().find(|p| p.name == name);
            let weight = |p: &Planned, bytes: Vec<u8>| {
                let (rows, cols) = (p.rows(), p.cols());
                Weight::owned(&p.name, p.ty, rows, cols, bytes)
            };
            let embd_p = find("token_embd.weight").expect("planned");
            let token_embd = weight(embd_p, made(embd_p)?)?;
            let norm_p = find("output_norm.weight").expect("planned");
            let output_norm = floats(&made(norm_p)?);
            let output = match find("output.weight") {
                Some(p) => Some(weight(p, made(p)?)?),
                None => None,
            };
            b.globals(
                &TokenizerSpec::Gguf {
                    vocab: vocab_tokens.clone(),
                },
                &token_embd,
                output.as_ref(),
                &output_norm,
            )?;
            drop((token_embd, output));
            if config.moe.is_some() {
                b.mixture_of_experts();
            }
            let identity: Vec<u32> = (0..spec.shape.ffn as u32).collect();
            for (l, tensors) in planned[1..].iter().enumerate() {
                let lw = layer_weights(tensors, &mut made)?;
                b.layer(l, &lw, &identity)?;
            }
            let description = format!(
                "make-model {} {}{} seed {} (random weights)",
                spec.shape.name,
                spec.mix.name(),
                if spec.dequantize { " dequantized to F32" } else { "" },
                spec.seed
            );
            let source = SourceInfo {
                file_name: description.clone(),
                len_bytes: 0,
                xxh3: crate::format::checksum_hex(description.as_bytes()),
            };
            let built = b.finish(config, source, None)?;
            ("gst", built.file_len_bytes)
        }
    };
    Ok(MakeReport {
        output: out.to_path_buf(),
        format: format_name,
        shape: spec.shape.clone(),
        mix: spec.mix.name(),
        dequantized: spec.dequantize,
        tokenizer: tokenizer_name,
        vocab,
        tensors: all.len(),
        parameters,
        tensor_bytes: total,
        file_bytes,
        seconds: t0.elapsed().as_secs_f64(),
        peak_rss_bytes: crate::stream::peak_rss_bytes(),
    })
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect()
}

/// A three-dimensional expert tensor made: name, bytes, experts, each one's rows, type.
type ExpertTensor = (String, Arc<Vec<u8>>, usize, usize, GgmlType);

/// A layer's weights from its planned tensors (made in order by `made`).
fn layer_weights(tensors: &[Planned], made: &mut dyn FnMut(&Planned) -> Result<Vec<u8>>) -> Result<LayerWeights> {
    let mut vectors: Vec<(String, Vec<f32>)> = Vec::new();
    let mut matrices: Vec<(String, Weight)> = Vec::new();
    // (name, the tensor's bytes, experts, each one's rows, type)
    let mut experts: Vec<ExpertTensor> = Vec::new();
    for p in tensors {
        let short = p
            .name
            .split_once('.')
            .map_or("", |x| x.1)
            .split_once('.')
            .map_or("", |x| x.1)
            .to_string();
        let bytes = made(p)?;
        match p.fill {
            Fill::Norm | Fill::Bias | Fill::ScoreBias | Fill::Sinks | Fill::RopeFactors { .. } => {
                vectors.push((short, floats(&bytes)))
            }
            Fill::Router | Fill::Matrix { .. } => {
                matrices.push((short, Weight::owned(&p.name, p.ty, p.rows(), p.cols(), bytes)?))
            }
            Fill::Experts { n, .. } => experts.push((short, Arc::new(bytes), n, p.shape[1], p.ty)),
        }
    }
    let mut vector = |k: &str| vectors.iter().position(|v| v.0 == k).map(|i| vectors.swap_remove(i).1);
    let attn_norm = vector("attn_norm.weight").expect("planned");
    let ffn_norm = vector("ffn_norm.weight")
        .or_else(|| vector("post_attention_norm.weight"))
        .expect("planned");
    let score_bias = vector("exp_probs_b.bias");
    let (bq, bk, bv) = (vector("attn_q.bias"), vector("attn_k.bias"), vector("attn_v.bias"));
    let (bo, attn_sinks) = (vector("attn_output.bias"), vector("attn_sinks.weight"));
    let expert_biases = vector("ffn_gate_inp.bias").map(|router| ExpertBiases {
        router,
        gate: vector("ffn_gate_exps.bias").expect("planned"),
        up: vector("ffn_up_exps.bias").expect("planned"),
        down: vector("ffn_down_exps.bias").expect("planned"),
    });
    let (q_norm, k_norm) = (vector("attn_q_norm.weight"), vector("attn_k_norm.weight"));
    let mut matrix = |k: &str| {
        matrices
            .iter()
            .position(|m| m.0 == k)
            .map(|i| matrices.swap_remove(i).1)
            .ok_or_else(|| Error::Internal(format!("make-model planned no {k}")))
    };
    let attn = AttnWeights {
        wq: matrix("attn_q.weight")?,
        wk: matrix("attn_k.weight")?,
        wv: matrix("attn_v.weight")?,
        wo: matrix("attn_output.weight")?,
        mla: None,
    };
    let ffn = if experts.is_empty() {
        LayerFfn::Dense(FfnWeights {
            gate: matrix("ffn_gate.weight")?,
            up: matrix("ffn_up.weight")?,
            down: FfnDown::Rows(matrix("ffn_down.weight")?),
        })
    } else {
        let router = matrix("ffn_gate_inp.weight")?;
        // Each expert a view of its slice of the three-dimensional tensors.
        let views = |k: &str| -> Result<Vec<Weight>> {
            let (name, bytes, n, rows, ty) = experts
                .iter()
                .find(|x| x.0 == k)
                .ok_or_else(|| Error::Internal(format!("make-model planned no {k}")))?;
            let per = bytes.len() / n;
            let cols = per / rows / ty.block_bytes() * ty.block_elems();
            (0..*n)
                .map(|e| Weight::shared(&format!("{name}[{e}]"), *ty, *rows, cols, bytes.clone(), e * per))
                .collect()
        };
        let (gate, up, down) = (
            views("ffn_gate_exps.weight")?,
            views("ffn_up_exps.weight")?,
            views("ffn_down_exps.weight")?,
        );
        let shared = match matrix("ffn_gate_shexp.weight") {
            Ok(gate) => Some((
                FfnWeights {
                    gate,
                    up: matrix("ffn_up_shexp.weight")?,
                    down: FfnDown::Rows(matrix("ffn_down_shexp.weight")?),
                },
                None,
            )),
            Err(_) => None,
        };
        LayerFfn::Experts(Box::new(ExpertWeights {
            router,
            score_bias,
            experts: gate
                .into_iter()
                .zip(up)
                .zip(down)
                .map(|((gate, up), down)| FfnWeights {
                    gate,
                    up,
                    down: FfnDown::Rows(down),
                })
                .collect(),
            shared,
            biases: expert_biases,
        }))
    };
    Ok(LayerWeights {
        attn_norm,
        attn,
        bq,
        bk,
        bv,
        bo,
        attn_sinks,
        q_norm,
        k_norm,
        post_attn_norm: None,
        ffn_norm,
        ffn,
        post_ffn_norm: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The DeepSeek shapes' headers read back as their models (latent attention's widths, the
    /// routing), with their released parameter counts: DeepSeek-V2-Lite 15.7B, DeepSeek-V3 671B,
    /// Kimi-K2 1.03T (no NextN layers written).
    #[test]
    fn deepseek_shapes_header_and_sizes() {
        for (name, params_b, layers, q_lora, experts, groups) in [
            ("deepseek-v2-lite", 15.7, 27, 0, 64, 0),
            ("deepseek-v3", 671.0, 61, 1536, 256, 8),
            ("kimi-k2", 1026.0, 61, 1536, 384, 0),
        ] {
            let spec = MakeSpec {
                shape: Shape::named(name).unwrap(),
                mix: Mix::Q4KM,
                dequantize: false,
                tokenizer: TokenizerChoice::Synthetic,
                seed: 1,
                residual_gain: 1.0,
            };
            let vocab = synthetic_vocab(spec.shape.vocab);
            let meta = metadata(&spec, &vocab);
            let refs: Vec<(&str, MetaValue)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            let c = config_of(&refs, spec.shape.vocab, Path::new("ds.gguf"), &spec.shape).unwrap();
            let (mla, m) = (c.mla.unwrap(), c.moe.clone().unwrap());
            assert_eq!(
                (c.arch, c.n_layers, c.n_kv_heads, c.head_dim),
                (Arch::Deepseek2, layers, 1, 576)
            );
            assert_eq!(
                (mla.q_lora_rank, mla.kv_lora_rank, mla.q_head(), mla.v_head),
                (q_lora, 512, 192, 128)
            );
            assert_eq!((m.n_experts, m.n_groups, m.shared_gated), (experts, groups, false));
            assert_eq!(m.score_bias, name != "deepseek-v2-lite", "{name}");
            let planned = plan(&spec, spec.shape.vocab);
            let params: u64 = planned
                .iter()
                .flatten()
                .map(|p| p.shape.iter().product::<usize>() as u64)
                .sum();
            let rel = (params as f64 / 1e9 - params_b).abs() / params_b;
            assert!(rel < 0.01, "{name}: {params} parameters");
        }
    }

    /// GLM-4.5-Air's shape as `make-model` would write it (not written: 70 GB): the header's
    /// keys read back as the configuration llama.cpp reads (46 layers, the first dense of 10944,
    /// 128 experts of 1408 with 8 used, one shared expert, sigmoid routing with a score bias,
    /// renormalized, half of each head rotated), and the tensors' count and sizes: 106.9 billion
    /// parameters (the released model's 106B without its NextN layer), 70.4 GB in Q4_K_M.
    #[test]
    fn glm_4_5_air_header_and_sizes() {
        let spec = MakeSpec {
            shape: Shape::named("glm-4.5-air").unwrap(),
            mix: Mix::Q4KM,
            dequantize: false,
            tokenizer: TokenizerChoice::Synthetic,
            seed: 1,
            residual_gain: 1.0,
        };
        let vocab = synthetic_vocab(spec.shape.vocab);
        let meta = metadata(&spec, &vocab);
        let refs: Vec<(&str, MetaValue)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let c = config_of(&refs, 151_552, Path::new("glm-4.5-air.gguf"), &spec.shape).unwrap();
        let m = c.moe.clone().unwrap();
        assert_eq!((c.arch, c.n_layers, c.hidden, c.ffn), (Arch::Glm4Moe, 46, 4096, 1408));
        assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim, c.rope_dims()), (96, 8, 128, 64));
        assert_eq!(
            (m.n_experts, m.n_used, m.shared_ffn, m.shared_gated),
            (128, 8, 1408, false)
        );
        assert_eq!((m.leading_dense, m.dense_ffn), (1, 10944));
        assert_eq!(m.gating, crate::config::Gating::Sigmoid);
        assert!(m.score_bias && m.normalize && m.routed_scale == 1.0 && !c.qk_norm);
        let planned = plan(&spec, 151_552);
        let all: Vec<&Planned> = planned.iter().flatten().collect();
        let params: u64 = all.iter().map(|p| p.shape.iter().product::<usize>() as u64).sum();
        let bytes: u64 = all.iter().map(|p| p.len_bytes()).sum();
        assert!((106.5e9..107.5e9).contains(&(params as f64)), "{params} parameters");
        assert!((69e9..72e9).contains(&(bytes as f64)), "{bytes} bytes");
        let names: Vec<&str> = planned[1].iter().map(|p| p.name.as_str()).collect();
        assert!(names.contains(&"blk.0.ffn_down.weight") && !names.iter().any(|n| n.contains("exps")));
        let layer1: Vec<&str> = planned[2].iter().map(|p| p.name.as_str()).collect();
        for n in [
            "exp_probs_b.bias",
            "ffn_gate_shexp.weight",
            "post_attention_norm.weight",
            "attn_q.bias",
        ] {
            assert!(layer1.contains(&format!("blk.1.{n}").as_str()), "{n}: {layer1:?}");
        }
        // The experts' down (1408 columns: not whole 256-value blocks) falls back to Q5_0.
        let down = planned[12]
            .iter()
            .find(|p| p.name.ends_with("ffn_down_exps.weight"))
            .unwrap();
        assert_eq!((down.shape.clone(), down.ty), (vec![128, 4096, 1408], GgmlType::Q5_0));
    }

    /// The gpt-oss shapes as planned (nothing written): the released models' parameter counts
    /// (20.91B and 116.83B, as llama.cpp reports them), MXFP4 experts and Q8_0 elsewhere with
    /// F32 vectors and router (about 12.1 and 63.4 GB of tensors), llama.cpp's tensor names and
    /// dims (biases `{width, experts}`, sinks per head, the FFN norm as `post_attention_norm`),
    /// and a header read back as the configuration gatestream runs (window 128 on even layers,
    /// YaRN, top-4 of 32 or 128 experts with gpt-oss routing).
    #[test]
    fn gpt_oss_shapes_plan_the_released_sizes_and_header() {
        for (name, layers, experts, bytes, params) in [
            ("gpt-oss-20b", 24, 32, 12_096_558_336u64, 20_914_757_184u64),
            ("gpt-oss-120b", 36, 128, 63_374_323_968, 116_829_156_672),
        ] {
            let shape = Shape::named(name).unwrap();
            shape.check().unwrap();
            assert_eq!((shape.layers, shape.experts), (layers, Some((experts, 4))));
            let spec = MakeSpec {
                shape,
                mix: Mix::Mxfp4Moe,
                dequantize: false,
                tokenizer: TokenizerChoice::Synthetic,
                seed: 1,
                residual_gain: 0.1,
            };
            let planned = plan(&spec, 201_088);
            let all: Vec<&Planned> = planned.iter().flatten().collect();
            assert_eq!(all.iter().map(|p| p.len_bytes()).sum::<u64>(), bytes, "{name}");
            let count: u64 = all.iter().map(|p| p.shape.iter().product::<usize>() as u64).sum();
            assert_eq!(count, params, "{name}");
            let find = |n: &str| {
                *all.iter()
                    .find(|p| p.name == n)
                    .unwrap_or_else(|| panic!("{name}: no {n}"))
            };
            for t in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
                let p = find(&format!("blk.3.{t}.weight"));
                assert_eq!(
                    (p.ty, p.dims()),
                    (GgmlType::MXFP4, vec![2880, 2880, experts as u64]),
                    "{t}"
                );
                let b = find(&format!("blk.3.{t}.bias"));
                assert_eq!((b.ty, b.dims()), (GgmlType::F32, vec![2880, experts as u64]), "{t}");
            }
            for (t, dims) in [
                ("token_embd.weight", vec![2880, 201_088]),
                ("output.weight", vec![2880, 201_088]),
                ("blk.0.attn_q.weight", vec![2880, 4096]),
                ("blk.0.attn_k.weight", vec![2880, 512]),
                ("blk.0.attn_output.weight", vec![4096, 2880]),
            ] {
                assert_eq!((find(t).ty, find(t).dims()), (GgmlType::Q8_0, dims), "{t}");
            }
            for (t, dims) in [
                ("blk.0.attn_sinks.weight", vec![64]),
                ("blk.0.attn_output.bias", vec![2880]),
                ("blk.0.attn_q.bias", vec![4096]),
                ("blk.0.post_attention_norm.weight", vec![2880]),
                ("blk.0.ffn_gate_inp.weight", vec![2880, experts as u64]),
                ("blk.0.ffn_gate_inp.bias", vec![experts as u64]),
            ] {
                assert_eq!((find(t).ty, find(t).dims()), (GgmlType::F32, dims), "{t}");
            }
            let vocab = synthetic_vocab(201_088);
            let meta = metadata(&spec, &vocab);
            let refs: Vec<(&str, MetaValue)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            let c = config_of(&refs, 201_088, Path::new("gpt-oss.gguf"), &spec.shape).unwrap();
            assert_eq!(
                (c.arch, c.n_layers, c.hidden, c.ffn),
                (Arch::GptOss, layers, 2880, 2880)
            );
            assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim, c.q_dim()), (64, 8, 64, 4096));
            assert_eq!((c.sliding_window, c.sliding_pattern), (Some(128), 2));
            assert!(c.layer_is_local(0) && !c.layer_is_local(1));
            assert!(c.attn_sinks && c.attn_bias && c.rope_freq_factors.is_some());
            assert_eq!((c.rope_theta, c.context_len), (150_000.0, 131_072));
            // YaRN factor 32: q·k scaled by (1 + 0.1 ln 32)^2 / sqrt(64).
            assert!((c.attn_scale - (1.0 + 0.1 * 32f32.ln()).powi(2) / 8.0).abs() < 1e-6);
            let m = c.moe.unwrap();
            assert_eq!((m.n_experts, m.n_used, m.normalize), (experts, 4, false));
            assert!(m.softmax_after_topk && m.oai_experts);
            assert!(meta
                .iter()
                .any(|(k, v)| k == "general.file_type" && *v == MetaValue::U32(38)));
        }
    }
}
