//! `ModelConfig`: the one validated description of an architecture's hyperparameters, built once
//! from GGUF metadata or a Hugging Face config.json. Everything downstream reads this, never the
//! raw metadata.

use std::path::Path;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Arch {
    /// Llama family; with `llama.expert_count`, Mixtral-style experts.
    Llama,
    Qwen2,
    /// Qwen3 (dense): per-head QK-norm before RoPE, no Q/K/V biases.
    Qwen3,
    Gemma3,
    /// Qwen1.5-MoE / Qwen2-MoE: routed experts plus a shared expert behind a sigmoid gate.
    Qwen2Moe,
    /// Qwen3-MoE: per-head QK-norm, routed experts only.
    Qwen3Moe,
    /// OLMoE: QK-norm over the whole projection, routed experts only.
    Olmoe,
    /// DeepSeek-V2/V3, Kimi-K2: multi-head latent attention ([`Mla`]), shared experts, leading
    /// dense layers.
    Deepseek2,
    /// GLM-4.5 / 4.5-Air / 4.6: sigmoid routing with an expert score bias, a shared expert not
    /// gated, leading dense layers, partial RoPE, Q/K/V biases, optional QK-norm, and NextN
    /// (multi-token prediction) layers at the end that normal inference does not run.
    Glm4Moe,
    /// gpt-oss (llama.cpp's `LLM_ARCH_OPENAI_MOE`): attention sinks, Q/K/V/O biases, alternating
    /// sliding-window and full attention, routed experts with biases and a clamped SwiGLU.
    GptOss,
}

/// Mixture-of-experts architectures llama.cpp knows that gatestream does not run, with why.
const MOE_REFUSED: &[(&str, &str)] = &[
    ("deepseek", "DeepSeek MoE (grouped expert gating)"),
    ("deepseek32", "DeepSeek-V3.2 (MLA with sparse attention)"),
    ("dbrx", "DBRX (clamped QKV, LayerNorm)"),
    ("grok", "Grok (soft-capped attention, GELU experts)"),
    ("phimoe", "Phi-3.5-MoE (LayerNorm, sparsemixer routing)"),
    ("arctic", "Snowflake Arctic (dense residual FFN beside the experts)"),
    ("granitemoe", "Granite MoE (scaled residuals and logits)"),
    (
        "llama4",
        "Llama 4 (weights applied before the experts, chunked attention)",
    ),
    ("bailingmoe", "Ling / Bailing MoE"),
    ("ernie4_5-moe", "ERNIE 4.5 MoE"),
    ("hunyuan-moe", "Hunyuan MoE"),
    ("qwen3next", "Qwen3-Next (linear attention)"),
];

impl Arch {
    pub fn parse(path: &Path, name: &str) -> Result<Arch> {
        match name {
            "llama" | "mistral" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "gemma3" | "gemma3_text" => Ok(Arch::Gemma3),
            "qwen2moe" => Ok(Arch::Qwen2Moe),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "olmoe" => Ok(Arch::Olmoe),
            "deepseek2" => Ok(Arch::Deepseek2),
            "glm4moe" => Ok(Arch::Glm4Moe),
            "gpt-oss" => Ok(Arch::GptOss),
            other => Err(Error::UnsupportedArchitecture {
                path: path.to_path_buf(),
                arch: other.to_string(),
                what: MOE_REFUSED
                    .iter()
                    .find(|(n, _)| *n == other)
                    .map(|(_, what)| format!(" (a mixture-of-experts model: {what})"))
                    .unwrap_or_default(),
            }),
        }
    }
    /// The architectures whose FFNs are always experts (llama has them only with `expert_count`).
    pub fn is_moe(self) -> bool {
        matches!(
            self,
            Arch::Qwen2Moe | Arch::Qwen3Moe | Arch::Olmoe | Arch::Glm4Moe | Arch::GptOss
        )
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Olmoe => "olmoe",
            Arch::Deepseek2 => "deepseek2",
            Arch::Glm4Moe => "glm4moe",
            Arch::GptOss => "gpt-oss",
        }
    }
}

/// How rotary embeddings pair up the dimensions of a head. GGUF `llama` files permute the Q/K
/// rows so that llama.cpp can rotate adjacent pairs; Hugging Face checkpoints (and GGUF qwen2 and
/// gemma3) rotate dimension i with i + head_dim/2. Both give the same attention scores when
/// matched with their weights, so we rotate the way the weights were stored rather than copying
/// the Q/K matrices to un-permute them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RopeStyle {
    AdjacentPairs,
    HalfSplit,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FfnActivation {
    /// SwiGLU: silu(gate) * up.
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanh,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden: usize,
    /// FFN intermediate size (number of neurons per layer).
    pub ffn: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context_len: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Rope base for sliding-window layers (Gemma 3 uses 10k locally, 1M globally).
    pub rope_theta_local: f32,
    /// Linear RoPE scaling factor of global layers (positions are divided by it).
    pub rope_scale_global: f32,
    /// Per-frequency divisors of the rotation angles (`head_dim / 2` of them): Llama 3.1+'s
    /// `rope_freqs` (Hugging Face `rope_scaling.rope_type = "llama3"`); pair i turns by
    /// `pos * base^(-2i/d) / factors[i]`. None: all 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_freq_factors: Option<Vec<f32>>,
    pub rope_style: RopeStyle,
    pub activation: FfnActivation,
    /// Sliding-window attention span for local layers; `None` means every layer is global.
    pub sliding_window: Option<usize>,
    /// With a sliding window: layer `l` is global iff `(l + 1) % sliding_pattern == 0`.
    pub sliding_pattern: usize,
    /// Multiplier of q·k before softmax.
    pub attn_scale: f32,
    /// Embeddings are multiplied by this (Gemma: sqrt(hidden)).
    pub embed_scale: f32,
    pub qk_norm: bool,
    /// Gemma's extra norms on the attention and FFN outputs before the residual add.
    pub post_norms: bool,
    pub attn_bias: bool,
    pub final_logit_softcap: Option<f32>,
    /// OLMoE: Q and K are RMS-normalized over the whole projection (not per head) before RoPE.
    #[serde(default)]
    pub qk_norm_whole: bool,
    /// Routed experts in place of the dense FFN (every layer past `leading_dense`); `ffn` is
    /// then an expert's width.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    /// Dimensions of a head RoPE rotates (the first ones; the rest pass through): `head_dim`
    /// unless the file's `rope.dimension_count` is less (GLM-4.5 rotates half). Half-split pairs
    /// pair dimension i with i + rope_dim/2, and the angles use rope_dim as the head's size.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rope_dim: usize,
    /// NextN / multi-token-prediction layers the file holds after the `n_layers` layers
    /// (`nextn_predict_layers`): llama.cpp does not run them in normal inference, and neither
    /// does gatestream; their tensors are ignored.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub nextn_layers: usize,
    /// Multi-head latent attention (DeepSeek-V2/V3): the cache holds one compressed latent and
    /// one rotated key part per position, shared by every head. The attention is computed in
    /// the latent space: `n_kv_heads` is 1 and `head_dim` is `kv_lora_rank + qk_rope` (what a
    /// query and a cached key are after absorbing the key up-projection into the query).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<Mla>,
    /// gpt-oss: each head's softmax has one more logit (`blk.N.attn_sinks`, one per head) that
    /// takes probability mass and adds no value; the attention output has a bias too.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attn_sinks: bool,
}

/// The dimensions of multi-head latent attention. Per token, `q` is `heads × (qk_nope + qk_rope)`
/// (projected directly, or through a `q_lora_rank` bottleneck with its own norm); the latent is
/// `kv_lora_rank` wide (normalized) plus a `qk_rope`-wide key part rotated once for all heads.
/// A head's key is `k_b[h] · latent` and its value `v_b[h] · latent` (`v_head` wide); both
/// products are folded into the query and the output instead of being expanded per position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Mla {
    /// 0: the query is projected from the input directly (DeepSeek-V2-Lite).
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head: usize,
}

impl Mla {
    /// A head's query width before absorption (`attn_q` rows per head).
    pub fn q_head(&self) -> usize {
        self.qk_nope + self.qk_rope
    }
    /// What the cache holds per position and layer: the latent and the rotated key part.
    pub fn latent(&self) -> usize {
        self.kv_lora_rank + self.qk_rope
    }
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// How the router's logits become expert scores (llama.cpp's `expert_gating_func`: 1 softmax,
/// 2 sigmoid).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Gating {
    /// Softmax over all experts (Mixtral, Qwen-MoE, OLMoE).
    #[default]
    Softmax,
    /// Each expert's logit through a sigmoid on its own (GLM-4.5, DeepSeek-V3).
    Sigmoid,
}

/// A mixture-of-experts FFN: per token the router's logits give each expert a score
/// ([`Gating`]); the `n_used` best — by score plus the per-expert bias `exp_probs_b` where the
/// file has one (`score_bias`; the bias only chooses, it does not weigh), and only among the
/// `groups_used` best of `n_groups` groups where grouped — are run, their outputs summed weighted
/// by their scores, renormalized to sum to one (`normalize`, llama.cpp's `norm_w`) and then
/// multiplied by `routed_scale`. Shared experts (`shared_ffn` neurons in all) run on every token,
/// behind a sigmoid gate (Qwen2-MoE) or added as they are (GLM-4.5, DeepSeek). The first
/// `leading_dense` layers have a dense FFN of `dense_ffn` neurons instead of experts.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoeConfig {
    pub n_experts: usize,
    pub n_used: usize,
    /// Whether the chosen experts' weights are divided by their sum.
    pub normalize: bool,
    /// Neurons of the shared expert(s) every token also runs (all shared experts as one FFN);
    /// 0: none.
    pub shared_ffn: usize,
    /// Whether the shared expert's output is scaled by sigmoid of a learned projection of the
    /// input (`ffn_gate_inp_shexp`, Qwen2-MoE); otherwise it is added unscaled.
    #[serde(default = "yes")]
    pub shared_gated: bool,
    #[serde(default)]
    pub gating: Gating,
    /// A per-expert bias (`blk.L.exp_probs_b.bias`) added to the scores to choose experts.
    #[serde(default)]
    pub score_bias: bool,
    /// Grouped top-k: experts in `n_groups` equal groups, each group scored by the sum of its
    /// two best (biased) scores, experts chosen only from the `groups_used` best groups.
    /// `n_groups <= 1`: not grouped.
    #[serde(default)]
    pub n_groups: usize,
    #[serde(default)]
    pub groups_used: usize,
    /// The chosen experts' weights are multiplied by this (after normalizing).
    #[serde(default = "one")]
    pub routed_scale: f32,
    /// The first layers with a dense FFN instead of experts, and its width.
    #[serde(default)]
    pub leading_dense: usize,
    #[serde(default)]
    pub dense_ffn: usize,
    /// gpt-oss routing (llama.cpp's `SOFTMAX_WEIGHT` gating): the router's logits (plus its
    /// bias, `ffn_gate_inp.bias`) pick the `n_used` largest, and the weights are the softmax over
    /// those chosen logits only. False: softmax over all experts, then the largest.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub softmax_after_topk: bool,
    /// gpt-oss experts: biases on gate, up and down (`ffn_{gate,up,down}_exps.bias`) and the
    /// clamped SwiGLU ([`crate::model::ffn::swiglu_oai`], llama.cpp's `SWIGLU_OAI_MOE`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub oai_experts: bool,
}

fn yes() -> bool {
    true
}

fn one() -> f32 {
    1.0
}

impl MoeConfig {
    /// A plain top-k softmax router (Mixtral, Qwen-MoE, OLMoE): no bias, no groups, scale 1,
    /// every layer of experts, no shared expert.
    pub fn softmax(n_experts: usize, n_used: usize, normalize: bool) -> MoeConfig {
        MoeConfig {
            n_experts,
            n_used,
            normalize,
            shared_ffn: 0,
            shared_gated: false,
            gating: Gating::Softmax,
            score_bias: false,
            n_groups: 0,
            groups_used: 0,
            routed_scale: 1.0,
            leading_dense: 0,
            dense_ffn: 0,
            softmax_after_topk: false,
            oai_experts: false,
        }
    }

    /// Whether layer `l` has experts (else a dense FFN of `dense_ffn` neurons).
    pub fn layer_has_experts(&self, l: usize) -> bool {
        l >= self.leading_dense
    }

    /// Whether routing is grouped.
    pub fn grouped(&self) -> bool {
        self.n_groups > 1
    }
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// The dimensions RoPE rotates (`rope_dim`, or the whole head where unset: older `.gst`
    /// files).
    pub fn rope_dims(&self) -> usize {
        if self.rope_dim == 0 {
            self.head_dim
        } else {
            self.rope_dim
        }
    }
    /// Whether layer `l` has experts.
    pub fn layer_has_experts(&self, l: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.layer_has_experts(l))
    }
    /// The FFN width of layer `l`: a dense layer's (the leading dense layers of a mixture of
    /// experts have their own), or an expert's.
    pub fn layer_ffn(&self, l: usize) -> usize {
        match &self.moe {
            Some(m) if !m.layer_has_experts(l) => m.dense_ffn,
            _ => self.ffn,
        }
    }
    /// The layers with experts.
    pub fn expert_layers(&self) -> usize {
        match &self.moe {
            Some(m) => self.n_layers.saturating_sub(m.leading_dense),
            None => 0,
        }
    }
    pub fn layer_is_local(&self, layer: usize) -> bool {
        self.sliding_window.is_some() && !(layer + 1).is_multiple_of(self.sliding_pattern)
    }

    /// Check sizes and relations; every constructor (and the .gst reader) calls this.
    pub fn validate(self, path: &Path) -> Result<Self> {
        let bad = |what: String| {
            Err(Error::Config {
                path: path.to_path_buf(),
                what,
            })
        };
        if self.hidden == 0 || self.ffn == 0 || self.n_layers == 0 || self.vocab == 0 || self.head_dim == 0 {
            return bad(format!("zero-sized dimension in {self:?}"));
        }
        if self.n_heads == 0 || self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} attention heads cannot share {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} is odd; RoPE needs pairs", self.head_dim));
        }
        if let Some(m) = &self.moe {
            if m.n_used == 0 || m.n_used > m.n_experts || m.n_experts > 1024 || m.shared_ffn > 1 << 20 {
                return bad(format!(
                    "{} experts with {} used per token: need 1 <= used <= experts <= 1024",
                    m.n_experts, m.n_used
                ));
            }
            if m.grouped()
                && (!m.n_experts.is_multiple_of(m.n_groups)
                    || m.groups_used == 0
                    || m.groups_used > m.n_groups
                    || m.n_used > m.groups_used * (m.n_experts / m.n_groups))
            {
                return bad(format!(
                    "{} experts in {} groups, {} groups used, {} experts used: the groups must divide the experts \
                     and the used groups hold at least the used experts",
                    m.n_experts, m.n_groups, m.groups_used, m.n_used
                ));
            }
            if m.leading_dense > self.n_layers || (m.leading_dense > 0 && !(1..=1 << 20).contains(&m.dense_ffn)) {
                return bad(format!(
                    "{} leading dense layers of width {} in a model of {} layers",
                    m.leading_dense, m.dense_ffn, self.n_layers
                ));
            }
            if !(m.routed_scale.is_finite() && m.routed_scale > 0.0) {
                return bad(format!("routed experts' scale {} (must be positive)", m.routed_scale));
            }
        }
        if self.rope_dims() > self.head_dim || !self.rope_dims().is_multiple_of(2) || self.nextn_layers > 1024 {
            return bad(format!(
                "RoPE over {} dimensions of heads of {} (need an even count up to the head's)",
                self.rope_dims(),
                self.head_dim
            ));
        }
        if let Some(m) = &self.mla {
            let sane = |x: usize| x > 0 && x <= 1 << 14;
            if !(sane(m.kv_lora_rank) && sane(m.qk_nope) && sane(m.qk_rope) && sane(m.v_head))
                || m.q_lora_rank > 1 << 16
                || !m.qk_rope.is_multiple_of(2)
                || self.head_dim != m.latent()
                || self.n_kv_heads != 1
            {
                return bad(format!("inconsistent latent attention dimensions {m:?} in {self:?}"));
            }
        }
        if self.sliding_pattern == 0 {
            return bad("sliding window pattern 0".into());
        }
        // Limits far above any model here; they keep a hostile config from asking for terabytes.
        if self.hidden > 1 << 16 || self.ffn > 1 << 20 || self.n_layers > 1024 || self.vocab > 1 << 24 {
            return bad(format!("implausible sizes in {self:?}"));
        }
        if !(self.rms_eps > 0.0 && self.rope_theta > 0.0) {
            return bad("rms epsilon and rope base must be positive".into());
        }
        let floats = [
            self.rms_eps,
            self.rope_theta,
            self.rope_theta_local,
            self.rope_scale_global,
            self.attn_scale,
            self.embed_scale,
            self.final_logit_softcap.unwrap_or(1.0),
        ];
        if floats.iter().any(|f| !f.is_finite() || *f <= 0.0) {
            return bad(format!("non-finite or non-positive value among {floats:?}"));
        }
        if let Some(f) = &self.rope_freq_factors {
            if f.len() != self.rope_dims() / 2 {
                return bad(match self.rope_dims() == self.head_dim {
                    true => format!(
                        "{} RoPE frequency factors for heads of {} (need head_dim / 2 = {})",
                        f.len(),
                        self.head_dim,
                        self.head_dim / 2
                    ),
                    false => format!(
                        "{} RoPE frequency factors for {} rotated dimensions (need half as many: {})",
                        f.len(),
                        self.rope_dims(),
                        self.rope_dims() / 2
                    ),
                });
            }
            if let Some(x) = f.iter().find(|x| !x.is_finite() || **x <= 0.0) {
                return bad(format!(
                    "a RoPE frequency factor is {x} (each must be finite and positive)"
                ));
            }
        }
        Ok(self)
    }

    /// From GGUF metadata (`{arch}.embedding_length` and friends). `vocab` comes from the
    /// embedding tensor, which is authoritative.
    pub fn from_gguf(g: &GgufFile, vocab: usize) -> Result<ModelConfig> {
        let path = &g.path;
        let arch_name = g
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .ok_or_else(|| Error::Config {
                path: path.clone(),
                what: "no general.architecture key".into(),
            })?;
        let arch = Arch::parse(path, arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let int = |k: &str| -> Result<usize> {
            g.get(&key(k))
                .and_then(|v| v.as_u64())
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| Error::Config {
                    path: path.clone(),
                    what: format!("missing or non-integer metadata key {}", key(k)),
                })
        };
        let opt_int = |k: &str| g.get(&key(k)).and_then(|v| v.as_u64()).map(|v| v as usize);
        let opt_f = |k: &str| g.get(&key(k)).and_then(|v| v.as_f64()).map(|v| v as f32);
        let hidden = int("embedding_length")?;
        let n_heads = int("attention.head_count")?;
        // head_count_kv may be an array (per-layer) in some files; we need a single value.
        let n_kv_heads = opt_int("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = opt_int("attention.key_length").unwrap_or(hidden.checked_div(n_heads).unwrap_or(0));
        let gemma = arch == Arch::Gemma3;
        let mla = match arch {
            Arch::Deepseek2 => Some(mla_from_gguf(g, arch_name, head_dim, &opt_int, &int)?),
            _ => None,
        };
        let n_kv_heads = if mla.is_some() { 1 } else { n_kv_heads };
        let gpt_oss = arch == Arch::GptOss;
        refuse_unread_math_keys(g, arch_name)?;
        let (rope_scale_global, yarn) = rope_scaling_from_gguf(g, arch_name, opt_int("context_length"))?;
        let yarn_log_mul = opt_f("rope.scaling.yarn_log_multiplier").filter(|&m| m != 0.0);
        if let (Some(m), Some(y)) = (&mla, &yarn) {
            if y.attn_factor != 1.0 {
                return Err(Error::Config {
                    path: path.clone(),
                    what: format!(
                        "{arch_name}.rope.scaling.attn_factor = {}: with latent attention (RoPE over {} of a \
                         head's {} query dimensions) only 1 is computed",
                        y.attn_factor,
                        m.qk_rope,
                        m.q_head()
                    ),
                });
            }
        }
        let rope_theta = opt_f("rope.freq_base").unwrap_or(10000.0);
        let rope_freq_factors = match (rope_freqs_from_gguf(g)?, &yarn) {
            (Some(_), Some(_)) => {
                return Err(Error::Config {
                    path: g.path.clone(),
                    what: format!(
                        "{ROPE_FREQS_TENSOR} and YaRN RoPE scaling ({arch_name}.rope.scaling.type = yarn) together: \
                         gatestream computes one or the other"
                    ),
                })
            }
            (Some(f), None) => Some(f),
            (None, Some(y)) => Some(y.factors(opt_int("rope.dimension_count").unwrap_or(head_dim), rope_theta)),
            (None, None) => None,
        };
        // gpt-oss's sliding-window layers may have a RoPE base of their own (llama.cpp reads
        // `rope.freq_base_swa`); the frequency factors (YaRN's) are computed for one base.
        let rope_theta_swa = opt_f("rope.freq_base_swa").unwrap_or(rope_theta);
        if gpt_oss && rope_theta_swa != rope_theta && rope_freq_factors.is_some() {
            return Err(Error::Config {
                path: path.clone(),
                what: format!(
                    "metadata {arch_name}.rope.freq_base_swa = {rope_theta_swa} beside rope.freq_base = {rope_theta} \
                     with YaRN: gatestream computes the RoPE factors for one base"
                ),
            });
        }
        let moe = Self::moe_from_gguf(g, arch, &opt_int, &int)?;
        // An expert's width: the MoE files name it apart from the dense width they also carry
        // (which GLM's leading dense layers have); without it, llama.cpp's n_ff / n_used.
        let ffn = match (&moe, arch) {
            (Some(m), Arch::Qwen2Moe | Arch::Qwen3Moe | Arch::Glm4Moe | Arch::Deepseek2 | Arch::GptOss) => {
                match opt_int("expert_feed_forward_length") {
                    Some(w) => w,
                    None => int("feed_forward_length")? / m.n_used.max(1),
                }
            }
            _ => int("feed_forward_length")?,
        };
        let moe = moe.map(|m| match arch {
            // GLM's and DeepSeek's shared experts are `expert_shared_count` experts' width together.
            Arch::Glm4Moe | Arch::Deepseek2 => MoeConfig {
                shared_ffn: m.shared_ffn * ffn,
                ..m
            },
            _ => m,
        });
        // NextN layers follow the model's own in `block_count`; llama.cpp runs only the others.
        let nextn_layers = opt_int("nextn_predict_layers").unwrap_or(0);
        let n_layers = int("block_count")?
            .checked_sub(nextn_layers)
            .ok_or_else(|| Error::Config {
                path: path.clone(),
                what: format!(
                    "{} = {nextn_layers} exceeds the block count",
                    key("nextn_predict_layers")
                ),
            })?;
        let rope_dim = opt_int("rope.dimension_count").unwrap_or(head_dim);
        if arch == Arch::Llama && rope_dim != head_dim {
            // (llama.cpp refuses it too: "invalid n_rot".)
            return Err(Error::Config {
                path: path.clone(),
                what: format!(
                    "metadata {} = {rope_dim}: RoPE over {rope_dim} of a head's {head_dim} dimensions, and a llama \
                     model rotates whole heads",
                    key("rope.dimension_count")
                ),
            });
        }
        let glm = arch == Arch::Glm4Moe;
        // GLM-4.5's QK-norm and Q/K/V biases are optional in llama.cpp: present or not per file.
        let has = |t: &str| g.tensor(&format!("blk.0.{t}")).is_some();
        let cfg = ModelConfig {
            arch,
            hidden,
            ffn,
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            context_len: opt_int("context_length").unwrap_or(2048),
            rms_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta,
            rope_theta_local: match () {
                _ if gemma => 10000.0,
                _ if gpt_oss => rope_theta_swa,
                _ => rope_theta,
            },
            rope_scale_global,
            rope_freq_factors,
            rope_style: if matches!(arch, Arch::Llama | Arch::Deepseek2) {
                RopeStyle::AdjacentPairs
            } else {
                RopeStyle::HalfSplit
            },
            activation: if gemma {
                FfnActivation::GeluTanh
            } else {
                FfnActivation::Silu
            },
            sliding_window: if gpt_oss {
                Some(int("attention.sliding_window")?)
            } else if gemma {
                opt_int("attention.sliding_window")
            } else {
                None
            },
            // gpt-oss: llama.cpp's `load_swa_pattern(ml, 2)`, even layers local, odd ones full.
            sliding_pattern: if gpt_oss {
                sliding_pattern_from_gguf(g, arch_name, 2)?
            } else {
                6
            },
            // (YaRN scales q and k by its magnitude factor: q·k by its square)
            // (DeepSeek's YaRN: a magnitude of its own, `1 + 0.1 · mscale_all_dim · ln factor`,
            // the file holding 0.1 · mscale_all_dim as `yarn_log_multiplier`, as llama.cpp reads
            // it; the scores are over a head's query width before absorption.)
            attn_scale: yarn.as_ref().map_or(1.0, |y| match (yarn_log_mul, mla) {
                (Some(m), Some(_)) => (1.0 + m * y.factor.ln()).powi(2),
                _ => y.mscale().powi(2),
            }) / (mla.map_or(head_dim, |m| m.q_head()) as f32).sqrt(),
            embed_scale: if gemma { (hidden as f32).sqrt() } else { 1.0 },
            qk_norm: gemma || matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe) || (glm && has("attn_q_norm.weight")),
            post_norms: gemma,
            attn_bias: matches!(arch, Arch::Qwen2 | Arch::GptOss) || (glm && has("attn_q.bias")),
            final_logit_softcap: opt_f("final_logit_softcapping").filter(|&c| c > 0.0),
            qk_norm_whole: arch == Arch::Olmoe,
            moe,
            mla,
            rope_dim,
            nextn_layers,
            attn_sinks: gpt_oss,
        };
        cfg.validate(path)
    }

    /// The experts' configuration as llama.cpp reads it: `{arch}.expert_count` and
    /// `expert_used_count` (both required by the MoE architectures, optional for llama),
    /// renormalization per architecture (Mixtral and Qwen3-MoE renormalize, Qwen2-MoE and OLMoE
    /// do not, GLM-4.5 as `expert_weights_norm` says), grouped routing where
    /// `expert_group_count` exceeds one (any architecture, as llama.cpp's `build_moe_ffn`), and
    /// per architecture: Qwen2-MoE's gated shared expert (`expert_shared_feed_forward_length`,
    /// else the dense width); GLM-4.5's sigmoid gating (`expert_gating_func`, absent: sigmoid),
    /// score bias, `expert_weights_scale`, ungated shared experts (`expert_shared_count` of them:
    /// the caller multiplies by the expert width) and `leading_dense_block_count` dense layers of
    /// `feed_forward_length`.
    fn moe_from_gguf(
        g: &GgufFile,
        arch: Arch,
        opt_int: &dyn Fn(&str) -> Option<usize>,
        int: &dyn Fn(&str) -> Result<usize>,
    ) -> Result<Option<MoeConfig>> {
        if !arch.is_moe() && (arch != Arch::Llama || opt_int("expert_count").unwrap_or(0) == 0) {
            // (DeepSeek's files have experts after their leading dense layers, if any layer has.)
            let dense_only = opt_int("expert_count").unwrap_or(0) == 0
                || opt_int("leading_dense_block_count").unwrap_or(0) >= int("block_count")?;
            if arch != Arch::Deepseek2 || dense_only {
                return Ok(None);
            }
        }
        let arch_name = arch.name();
        let n_experts = int("expert_count")?;
        let n_used = int("expert_used_count")?;
        let mut m = MoeConfig::softmax(n_experts, n_used, matches!(arch, Arch::Llama | Arch::Qwen3Moe));
        m.n_groups = opt_int("expert_group_count").unwrap_or(0);
        m.groups_used = opt_int("expert_group_used_count").unwrap_or(0);
        // gpt-oss: the softmax over the chosen logits; biased experts with the clamped SwiGLU.
        m.softmax_after_topk = arch == Arch::GptOss;
        m.oai_experts = arch == Arch::GptOss;
        match arch {
            Arch::Qwen2Moe => {
                m.shared_ffn = match opt_int("expert_shared_feed_forward_length") {
                    Some(w) => w,
                    None => int("feed_forward_length")?,
                };
                m.shared_gated = true;
            }
            Arch::Glm4Moe | Arch::Deepseek2 => {
                let key = |k: &str| format!("{arch_name}.{k}");
                // (Unset: GLM's sigmoid; DeepSeek-V2's softmax, as llama.cpp reads files from
                // before the key.)
                m.gating = match opt_int("expert_gating_func").unwrap_or(0) {
                    0 if arch == Arch::Deepseek2 => Gating::Softmax,
                    0 | 2 => Gating::Sigmoid,
                    1 => Gating::Softmax,
                    other => {
                        return Err(Error::Config {
                            path: g.path.clone(),
                            what: format!(
                                "metadata {} = {other}: gatestream computes gating functions 1 (softmax) and 2 \
                                 (sigmoid)",
                                key("expert_gating_func")
                            ),
                        })
                    }
                };
                m.normalize = g
                    .get(&key("expert_weights_norm"))
                    .and_then(|v| v.as_bool())
                    .unwrap_or(false);
                let scale = g
                    .get(&key("expert_weights_scale"))
                    .and_then(|v| v.as_f64())
                    .unwrap_or(0.0) as f32;
                // llama.cpp scales only by a value other than 0 (absent) and 1.
                m.routed_scale = if scale == 0.0 { 1.0 } else { scale };
                // GLM's files always have the score bias; DeepSeek's from V3 on.
                m.score_bias = arch == Arch::Glm4Moe || {
                    let first = opt_int("leading_dense_block_count").unwrap_or(0);
                    g.tensor(&format!("blk.{first}.exp_probs_b.bias")).is_some()
                };
                // Counted in experts here; the caller makes it neurons (times the expert width).
                m.shared_ffn = int("expert_shared_count")?;
                m.shared_gated = false;
                m.leading_dense = opt_int("leading_dense_block_count").unwrap_or(0);
                if m.leading_dense > 0 {
                    m.dense_ffn = int("feed_forward_length")?;
                }
            }
            _ => {}
        }
        Ok(Some(m))
    }

    /// From a Hugging Face `config.json`.
    pub fn from_hf_config(path: &Path, v: &serde_json::Value) -> Result<ModelConfig> {
        let bad = |what: String| Error::Config {
            path: path.to_path_buf(),
            what,
        };
        let int = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(|x| x.as_u64())
                .map(|x| x as usize)
                .ok_or_else(|| bad(format!("missing integer `{k}`")))
        };
        let opt_int = |k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
        let opt_f = |k: &str| v.get(k).and_then(|x| x.as_f64()).map(|x| x as f32);
        let model_type = v
            .get("model_type")
            .and_then(|x| x.as_str())
            .ok_or_else(|| bad("missing `model_type`".into()))?;
        // The mixtures of experts read from a folder, by the names their GGUFs give them.
        let hf_moe = matches!(model_type, "qwen3_moe" | "qwen2_moe" | "olmoe" | "mixtral");
        // The mixtures whose GGUFs run and whose folders are not read.
        let gguf_only = matches!(
            model_type,
            "glm4_moe" | "deepseek_v2" | "deepseek_v3" | "kimi_k2" | "gpt_oss"
        );
        if gguf_only {
            return Err(bad(format!(
                "`{model_type}` is a mixture-of-experts model whose Hugging Face folder gatestream does not read \
                 (it reads qwen3_moe, qwen2_moe, olmoe and mixtral folders); its GGUF runs: convert it with \
                 llama.cpp's convert_hf_to_gguf.py"
            )));
        }
        let arch = Arch::parse(
            path,
            match model_type {
                "qwen3_moe" => "qwen3moe",
                "qwen2_moe" => "qwen2moe",
                "mixtral" => "llama",
                t => t,
            },
        )?;
        if !hf_moe && (arch.is_moe() || v.get("num_local_experts").is_some()) {
            return Err(bad(format!(
                "`{model_type}` is a mixture-of-experts model whose Hugging Face folder gatestream does not read \
                 (it reads qwen3_moe, qwen2_moe, olmoe and mixtral folders, and every architecture's GGUF: \
                 convert it with llama.cpp's convert_hf_to_gguf.py)"
            )));
        }
        let moe = match hf_moe {
            false => None,
            true => {
                let n_experts = opt_int("num_experts")
                    .or_else(|| opt_int("num_local_experts"))
                    .ok_or_else(|| bad("missing integer `num_experts` (or `num_local_experts`)".into()))?;
                // As llama.cpp per architecture: Mixtral and Qwen3-MoE renormalize the chosen
                // experts' weights, Qwen2-MoE and OLMoE do not (`norm_topk_prob` where given).
                let normalize = v
                    .get("norm_topk_prob")
                    .and_then(|x| x.as_bool())
                    .unwrap_or(matches!(model_type, "qwen3_moe" | "mixtral"));
                let mut m = MoeConfig::softmax(n_experts, int("num_experts_per_tok")?, normalize);
                if model_type == "qwen2_moe" {
                    m.shared_ffn = int("shared_expert_intermediate_size")?;
                    m.shared_gated = true;
                }
                let dense_layers = v
                    .get("mlp_only_layers")
                    .and_then(|x| x.as_array())
                    .is_some_and(|a| !a.is_empty());
                if opt_int("decoder_sparse_step").unwrap_or(1) != 1 || dense_layers {
                    return Err(bad(
                        "`decoder_sparse_step` other than 1 or `mlp_only_layers`: gatestream runs experts in every \
                         layer of this architecture"
                            .into(),
                    ));
                }
                Some(m)
            }
        };
        let ffn_key = match model_type {
            "qwen3_moe" | "qwen2_moe" => "moe_intermediate_size",
            _ => "intermediate_size",
        };
        let gemma = arch == Arch::Gemma3;
        let hidden = int("hidden_size")?;
        let n_heads = int("num_attention_heads")?;
        let head_dim = opt_int("head_dim").unwrap_or(hidden.checked_div(n_heads).unwrap_or(0));
        let rope_theta = opt_f("rope_theta").unwrap_or(10000.0);
        let (rope_scale_global, rope_freq_factors, qk_scale) = rope_scaling_from_hf(path, v, head_dim, rope_theta)?;
        let cfg = ModelConfig {
            arch,
            hidden,
            ffn: int(ffn_key)?,
            n_layers: int("num_hidden_layers")?,
            n_heads,
            n_kv_heads: opt_int("num_key_value_heads").unwrap_or(n_heads),
            head_dim,
            vocab: int("vocab_size")?,
            context_len: opt_int("max_position_embeddings").unwrap_or(2048),
            rms_eps: opt_f("rms_norm_eps").unwrap_or(1e-6),
            rope_theta,
            rope_theta_local: if gemma {
                opt_f("rope_local_base_freq").unwrap_or(10000.0)
            } else {
                rope_theta
            },
            rope_scale_global,
            rope_freq_factors,
            rope_style: RopeStyle::HalfSplit,
            activation: if gemma {
                FfnActivation::GeluTanh
            } else {
                FfnActivation::Silu
            },
            sliding_window: if gemma { opt_int("sliding_window") } else { None },
            sliding_pattern: opt_int("sliding_window_pattern").unwrap_or(6),
            attn_scale: qk_scale / opt_f("query_pre_attn_scalar").unwrap_or(head_dim as f32).sqrt(),
            embed_scale: if gemma { (hidden as f32).sqrt() } else { 1.0 },
            qk_norm: gemma || matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe),
            post_norms: gemma,
            attn_bias: arch == Arch::Qwen2,
            final_logit_softcap: opt_f("final_logit_softcapping").filter(|&c| c > 0.0),
            qk_norm_whole: arch == Arch::Olmoe,
            moe,
            mla: None,
            rope_dim: head_dim,
            nextn_layers: 0,
            attn_sinks: false,
        };
        cfg.validate(path)
    }
}

/// `{arch}.attention.sliding_window_pattern` as llama.cpp's `load_swa_pattern` reads it (with
/// `default` when absent): an integer n makes layer l local unless `(l + 1) % n == 0`. The
/// per-layer array form is refused: gatestream's pattern is periodic.
fn sliding_pattern_from_gguf(g: &GgufFile, arch_name: &str, default: usize) -> Result<usize> {
    let key = format!("{arch_name}.attention.sliding_window_pattern");
    match g.get(&key) {
        None => Ok(default),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(n as usize),
            _ => Err(Error::Config {
                path: g.path.clone(),
                what: format!(
                    "metadata {key} = {v:?}: gatestream reads a positive integer period here (every n-th layer \
                     full), not a per-layer list"
                ),
            }),
        },
    }
}

/// The tensor Llama 3.1+ GGUF files carry their RoPE frequency factors in.
pub const ROPE_FREQS_TENSOR: &str = "rope_freqs.weight";

/// YaRN RoPE scaling (`rope.scaling.type = yarn`; Hugging Face `rope_type = "yarn"`), as
/// llama.cpp computes it: pair i turns by `pos · base^(-2i/d) · (s·(1 - r_i) + r_i)` with
/// `s = 1 / factor` and `r_i` a ramp from 1 (pairs that turn more than `beta_fast` times in the
/// original context: kept) to 0 (fewer than `beta_slow` times: interpolated by `s`); q and k are
/// scaled by `attn_factor · (1 + 0.1 ln factor)` (so q·k by its square).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub original_context: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub attn_factor: f32,
}

impl Yarn {
    /// The rotation's per-pair divisors (as [`ModelConfig::rope_freq_factors`]) for heads of
    /// `head_dim` at `base`, in f32 as ggml's `rope_yarn` computes them.
    pub fn factors(&self, head_dim: usize, base: f32) -> Vec<f32> {
        let n = head_dim as f32;
        // The pair index whose wavelength fits `turns` times in the original context.
        let dim =
            |turns: f32| n * (self.original_context / (turns * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln());
        let low = dim(self.beta_fast).floor().max(0.0);
        let high = dim(self.beta_slow).ceil().min(n - 1.0);
        let s = 1.0 / self.factor;
        (0..head_dim / 2)
            .map(|i| {
                let y = (i as f32 - low) / (high - low).max(0.001);
                let ramp = 1.0 - y.clamp(0.0, 1.0);
                1.0 / (s * (1.0 - ramp) + ramp)
            })
            .collect()
    }

    /// The magnitude q and k are scaled by.
    pub fn mscale(&self) -> f32 {
        self.attn_factor * (1.0 + 0.1 * self.factor.ln())
    }
}

/// `{arch}.rope.scaling.type`: absent or `none` (1), `linear` (positions divided by
/// `rope.scaling.factor`), `yarn` (`rope.scaling.factor`, `rope.scaling.original_context_length`
/// (else `context`), `rope.scaling.attn_factor` (else 1); llama.cpp's ramp bounds 32 and 1);
/// any other kind changes the rotation in a way not computed here, so the file is refused
/// rather than run as if it were absent.
fn rope_scaling_from_gguf(g: &GgufFile, arch_name: &str, context: Option<usize>) -> Result<(f32, Option<Yarn>)> {
    let key = format!("{arch_name}.rope.scaling.type");
    let num = |k: &str| {
        g.get(&format!("{arch_name}.rope.scaling.{k}"))
            .and_then(|v| v.as_f64())
            .map(|f| f as f32)
    };
    let factor = num("factor");
    match g.get(&key).map(|v| v.as_str()) {
        None | Some(Some("none")) => Ok((1.0, None)),
        Some(Some("linear")) => Ok((factor.unwrap_or(1.0), None)),
        Some(Some("yarn")) => {
            let original_context = num("original_context_length").or(context.map(|c| c as f32));
            match (factor, original_context) {
                (Some(factor), Some(original_context)) if factor >= 1.0 && original_context > 0.0 => Ok((
                    1.0,
                    Some(Yarn {
                        factor,
                        original_context,
                        beta_fast: 32.0,
                        beta_slow: 1.0,
                        attn_factor: num("attn_factor").unwrap_or(1.0),
                    }),
                )),
                _ => Err(Error::Config {
                    path: g.path.clone(),
                    what: format!(
                        "metadata {key} = \"yarn\" needs {arch_name}.rope.scaling.factor (at least 1) and an original \
                         context ({arch_name}.rope.scaling.original_context_length or context_length); found {factor:?} \
                         and {original_context:?}"
                    ),
                }),
            }
        }
        Some(Some(other)) => Err(Error::Config {
            path: g.path.clone(),
            what: format!(
                "metadata {key} = \"{other}\": RoPE scaling of this kind is not computed by gatestream \
                 (it reads none, linear, yarn and Llama 3's frequency factors); running without it would compute \
                 another model"
            ),
        }),
        Some(None) => Err(Error::Config {
            path: g.path.clone(),
            what: format!("metadata {key} is not a string"),
        }),
    }
}

/// Llama 3.1+'s per-frequency RoPE divisors, from the `rope_freqs.weight` tensor (F32).
fn rope_freqs_from_gguf(g: &GgufFile) -> Result<Option<Vec<f32>>> {
    let Some(t) = g.tensor(ROPE_FREQS_TENSOR) else {
        return Ok(None);
    };
    if t.ty != Some(crate::quant::GgmlType::F32) || t.dims.len() != 1 {
        return Err(Error::Config {
            path: g.path.clone(),
            what: format!(
                "{ROPE_FREQS_TENSOR} at offset {} is ggml type {} with dims {:?}; expected one F32 row",
                t.offset_bytes, t.type_id, t.dims
            ),
        });
    }
    let bytes = g.tensor_bytes(t);
    Ok(Some(
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ))
}

/// Llama 3's frequency factors as its Hugging Face configuration defines them (and llama.cpp's
/// converter writes them into `rope_freqs`): frequencies whose wavelength exceeds the original
/// context over `low_freq_factor` are divided by `factor`, those shorter than the original
/// context over `high_freq_factor` are kept, and those between are interpolated smoothly.
pub fn llama3_rope_factors(
    head_dim: usize,
    base: f32,
    factor: f32,
    low_freq_factor: f32,
    high_freq_factor: f32,
    original_context: f32,
) -> Vec<f32> {
    let low_wavelen = original_context / low_freq_factor;
    let high_wavelen = original_context / high_freq_factor;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / (base as f64).powf(2.0 * i as f64 / head_dim as f64);
            let wavelen = (2.0 * std::f64::consts::PI / freq) as f32;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// `rope_scaling` of a Hugging Face config: absent, `default` or null (1, no factors), `linear`
/// (positions divided by `factor`), `llama3` (frequency factors), `yarn` ([`Yarn`]: `factor`,
/// `original_max_position_embeddings`, optional `beta_fast`, `beta_slow` and
/// `attention_factor`); anything else is refused. Returns the linear scale, the factors and what
/// q·k is multiplied by (YaRN's magnitude squared; else 1).
fn rope_scaling_from_hf(
    path: &Path,
    v: &serde_json::Value,
    head_dim: usize,
    base: f32,
) -> Result<(f32, Option<Vec<f32>>, f32)> {
    let Some(s) = v.get("rope_scaling").filter(|s| !s.is_null()) else {
        return Ok((1.0, None, 1.0));
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let num = |k: &str| s.get(k).and_then(|f| f.as_f64()).map(|f| f as f32);
    let need = |k: &str| {
        num(k).ok_or_else(|| Error::Config {
            path: path.to_path_buf(),
            what: format!("rope_scaling of type {kind} lacks a number `{k}`"),
        })
    };
    match kind {
        "default" => Ok((1.0, None, 1.0)),
        "linear" => Ok((num("factor").unwrap_or(1.0), None, 1.0)),
        "yarn" => {
            // DeepSeek's magnitude terms and unrounded ramp bounds change what is computed.
            for k in ["mscale", "mscale_all_dim"] {
                if s.get(k).is_some_and(|m| !m.is_null()) {
                    return Err(Error::Config {
                        path: path.to_path_buf(),
                        what: format!("rope_scaling of type yarn with `{k}`: not computed by gatestream"),
                    });
                }
            }
            if s.get("truncate").and_then(|t| t.as_bool()) == Some(false) {
                return Err(Error::Config {
                    path: path.to_path_buf(),
                    what: "rope_scaling of type yarn with `truncate: false`: not computed by gatestream".into(),
                });
            }
            let factor = need("factor")?;
            let y = Yarn {
                factor,
                original_context: need("original_max_position_embeddings")?,
                beta_fast: num("beta_fast").unwrap_or(32.0),
                beta_slow: num("beta_slow").unwrap_or(1.0),
                attn_factor: 1.0,
            };
            // `attention_factor`, where given, is the whole magnitude (Hugging Face's rule).
            let m = num("attention_factor").unwrap_or(y.mscale());
            Ok((1.0, Some(y.factors(head_dim, base)), m * m))
        }
        "llama3" => Ok((
            1.0,
            Some(llama3_rope_factors(
                head_dim,
                base,
                need("factor")?,
                need("low_freq_factor")?,
                need("high_freq_factor")?,
                need("original_max_position_embeddings")?,
            )),
            1.0,
        )),
        other => Err(Error::Config {
            path: path.to_path_buf(),
            what: format!(
                "rope_scaling.rope_type \"{other}\" is not computed by gatestream (it reads default, linear, \
                 llama3 and yarn); running without it would compute another model"
            ),
        }),
    }
}

/// Metadata keys that change what llama.cpp computes and that gatestream does not read, each with
/// the value that leaves the computation as gatestream's (None: any value changes it). A file
/// setting one otherwise is refused, naming the key, rather than computed as another model.
const UNREAD_MATH_KEYS: &[(&str, Option<f64>)] = &[
    ("expert_weights_scale", Some(1.0)),
    ("expert_weights_norm", None),
    ("expert_gating_func", Some(1.0)),
    ("leading_dense_block_count", Some(0.0)),
    ("attention.q_lora_rank", None),
    ("attention.kv_lora_rank", None),
    ("attention.scale", None),
    ("embedding_scale", Some(1.0)),
    ("residual_scale", Some(1.0)),
    ("logit_scale", Some(1.0)),
    ("attention.clamp_kqv", None),
    ("rope.scaling.yarn_log_multiplier", None),
    ("rope.scaling.yarn_beta_fast", Some(32.0)),
    ("rope.scaling.yarn_beta_slow", Some(1.0)),
];

/// The keys of [`UNREAD_MATH_KEYS`] an architecture does read (so any value is computed).
fn read_math_keys(arch: Arch) -> &'static [&'static str] {
    match arch {
        Arch::Glm4Moe => &[
            "expert_weights_scale",
            "expert_weights_norm",
            "expert_gating_func",
            "leading_dense_block_count",
        ],
        Arch::Deepseek2 => &[
            "expert_weights_scale",
            "expert_weights_norm",
            "expert_gating_func",
            "expert_group_count",
            "leading_dense_block_count",
            "attention.q_lora_rank",
            "attention.kv_lora_rank",
            "rope.scaling.yarn_log_multiplier",
        ],
        _ => &[],
    }
}

/// Latent attention's dimensions from a `deepseek2` file: `attention.kv_lora_rank`,
/// `attention.q_lora_rank` (absent or 0: no query bottleneck), `rope.dimension_count` (the
/// rotated part), `attention.key_length_mla` and `value_length_mla` (a head's query and value
/// widths). `attention.key_length` is the cached width, latent plus rotated part. Files from
/// converters before llama.cpp split `attn_kv_b` (no `key_length_mla`) are refused.
fn mla_from_gguf(
    g: &GgufFile,
    arch_name: &str,
    key_length: usize,
    opt_int: &dyn Fn(&str) -> Option<usize>,
    int: &dyn Fn(&str) -> Result<usize>,
) -> Result<Mla> {
    let bad = |what: String| Error::Config {
        path: g.path.clone(),
        what,
    };
    let (Some(k_mla), Some(v_mla)) = (
        opt_int("attention.key_length_mla"),
        opt_int("attention.value_length_mla"),
    ) else {
        return Err(bad(format!(
            "{arch_name}.attention.key_length_mla is missing: this file keeps the keys' and values' up-projection \
             in one tensor (attn_kv_b), as converters before llama.cpp's split of it wrote; convert the model again \
             with a current convert_hf_to_gguf.py"
        )));
    };
    let kv_lora_rank = int("attention.kv_lora_rank")?;
    let qk_rope = int("rope.dimension_count")?;
    let m = Mla {
        q_lora_rank: opt_int("attention.q_lora_rank").unwrap_or(0),
        kv_lora_rank,
        qk_nope: k_mla.checked_sub(qk_rope).filter(|&n| n > 0).ok_or_else(|| {
            bad(format!(
                "key_length_mla {k_mla} is not above the rotated part {qk_rope}"
            ))
        })?,
        qk_rope,
        v_head: v_mla,
    };
    if key_length != m.latent() {
        return Err(bad(format!(
            "{arch_name}.attention.key_length = {key_length}: latent attention caches kv_lora_rank + \
             rope.dimension_count = {} per position",
            m.latent()
        )));
    }
    Ok(m)
}

/// Refuses a file whose metadata asks for computation gatestream does not do: a key of
/// [`UNREAD_MATH_KEYS`] the architecture does not read at another value, or multi-section RoPE
/// (`rope.dimension_sections`, which llama.cpp's GLM-4 reads for its vision models).
fn refuse_unread_math_keys(g: &GgufFile, arch_name: &str) -> Result<()> {
    let refuse = |key: String, what: String| {
        Err(Error::Config {
            path: g.path.clone(),
            what: format!(
                "metadata {key} = {what}: gatestream does not compute what it asks for (running without it would \
                 compute another model than llama.cpp does)"
            ),
        })
    };
    let read = Arch::parse(&g.path, arch_name).map(read_math_keys).unwrap_or(&[]);
    for (k, neutral) in UNREAD_MATH_KEYS {
        if read.contains(k) {
            continue;
        }
        let key = format!("{arch_name}.{k}");
        if let Some(v) = g.get(&key) {
            let same = match (neutral, v.as_f64().or_else(|| v.as_bool().map(|b| b as u8 as f64))) {
                (Some(n), Some(x)) => (x - n).abs() < 1e-9,
                _ => false,
            };
            if !same {
                return refuse(key, format!("{v:?}"));
            }
        }
    }
    let key = format!("{arch_name}.rope.dimension_sections");
    if let Some(v) = g.get(&key) {
        let sections: Vec<u64> = v
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
            .unwrap_or_default();
        if sections.len() < 2 || sections[0] > 0 && sections[1] > 0 {
            return refuse(key, format!("{v:?} (multi-section RoPE)"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Hugging Face `rope_scaling` of type yarn gives the factors and q·k scale a GGUF's YaRN
    /// keys give (the magnitude 1 + 0.1 ln factor, squared), its ramp keeps the fast pairs and
    /// divides the slow ones by the factor; DeepSeek's magnitude terms are refused.
    #[test]
    fn hugging_face_yarn_is_read_as_gguf_yarn() {
        let v: serde_json::Value = serde_json::json!({"rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}});
        let (linear, factors, qk) = rope_scaling_from_hf(Path::new("c.json"), &v, 64, 100000.0).unwrap();
        let y = Yarn {
            factor: 4.0,
            original_context: 512.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0,
        };
        let f = factors.unwrap();
        assert_eq!(linear, 1.0);
        assert_eq!(f, y.factors(64, 100000.0));
        assert_eq!(f[0], 1.0, "{f:?}");
        assert_eq!(*f.last().unwrap(), 4.0, "{f:?}");
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "{f:?}");
        assert!((qk - (1.0 + 0.1 * 4f32.ln()).powi(2)).abs() < 1e-6, "{qk}");
        let v = serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 512, "mscale": 0.707, "mscale_all_dim": 0.707}});
        let e = rope_scaling_from_hf(Path::new("c.json"), &v, 64, 100000.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mscale"), "{e}");
    }
}
