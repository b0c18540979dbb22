//! `ModelConfig`: the one validated description of an architecture's hyperparameters, built once
//! from GGUF metadata or a Hugging Face config.json. Everything downstream reads this, never the
//! raw metadata.

use std::path::Path;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Arch {
    Llama,
    Qwen2,
    Gemma3,
}

impl Arch {
    pub fn parse(path: &Path, name: &str) -> Result<Arch> {
        match name {
            "llama" | "mistral" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "gemma3" | "gemma3_text" => Ok(Arch::Gemma3),
            other => Err(Error::UnsupportedArchitecture {
                path: path.to_path_buf(),
                arch: other.to_string(),
            }),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
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
}

impl ModelConfig {
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
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
        let rope_scale_global = match g.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            Some("linear") => opt_f("rope.scaling.factor").unwrap_or(1.0),
            _ => 1.0,
        };
        let rope_theta = opt_f("rope.freq_base").unwrap_or(10000.0);
        let cfg = ModelConfig {
            arch,
            hidden,
            ffn: int("feed_forward_length")?,
            n_layers: int("block_count")?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab,
            context_len: opt_int("context_length").unwrap_or(2048),
            rms_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta,
            rope_theta_local: if gemma { 10000.0 } else { rope_theta },
            rope_scale_global,
            rope_style: if arch == Arch::Llama {
                RopeStyle::AdjacentPairs
            } else {
                RopeStyle::HalfSplit
            },
            activation: if gemma {
                FfnActivation::GeluTanh
            } else {
                FfnActivation::Silu
            },
            sliding_window: if gemma {
                opt_int("attention.sliding_window")
            } else {
                None
            },
            sliding_pattern: 6,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            embed_scale: if gemma { (hidden as f32).sqrt() } else { 1.0 },
            qk_norm: gemma,
            post_norms: gemma,
            attn_bias: arch == Arch::Qwen2,
            final_logit_softcap: opt_f("final_logit_softcapping").filter(|&c| c > 0.0),
        };
        cfg.validate(path)
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
        let arch = Arch::parse(path, model_type)?;
        let gemma = arch == Arch::Gemma3;
        let hidden = int("hidden_size")?;
        let n_heads = int("num_attention_heads")?;
        let head_dim = opt_int("head_dim").unwrap_or(hidden.checked_div(n_heads).unwrap_or(0));
        let rope_theta = opt_f("rope_theta").unwrap_or(10000.0);
        let rope_scale_global = v
            .get("rope_scaling")
            .filter(|s| s.get("rope_type").and_then(|t| t.as_str()) == Some("linear"))
            .and_then(|s| s.get("factor"))
            .and_then(|f| f.as_f64())
            .unwrap_or(1.0) as f32;
        let cfg = ModelConfig {
            arch,
            hidden,
            ffn: int("intermediate_size")?,
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
            rope_style: RopeStyle::HalfSplit,
            activation: if gemma {
                FfnActivation::GeluTanh
            } else {
                FfnActivation::Silu
            },
            sliding_window: if gemma { opt_int("sliding_window") } else { None },
            sliding_pattern: opt_int("sliding_window_pattern").unwrap_or(6),
            attn_scale: 1.0 / opt_f("query_pre_attn_scalar").unwrap_or(head_dim as f32).sqrt(),
            embed_scale: if gemma { (hidden as f32).sqrt() } else { 1.0 },
            qk_norm: gemma,
            post_norms: gemma,
            attn_bias: arch == Arch::Qwen2,
            final_logit_softcap: opt_f("final_logit_softcapping").filter(|&c| c > 0.0),
        };
        cfg.validate(path)
    }
}
