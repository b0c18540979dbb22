//! The shapes of real models and the type mixes llama.cpp's quantizer gives them: what
//! `make-model` writes. A shape is dimensions only; [`Mix`] and [`Mix::matrix_type`] say which
//! GGML type each matrix gets, following `llama_tensor_get_type` in llama.cpp's `llama-quant.cpp`
//! (the rules for Q4_K_M, Q6_K and Q8_0 files, including its 8-expert and 70B special cases).

use crate::config::Arch;
use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// A model's dimensions.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Shape {
    /// The name `make-model --shape` takes (`custom` for one given by its dimensions).
    pub name: String,
    pub arch: Arch,
    pub hidden: usize,
    /// The dense FFN's width, or each expert's.
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub context_len: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    /// The output matrix is the token embedding (no `output.weight`).
    pub tied: bool,
    /// Mixture of experts: (experts per layer, experts each token uses).
    pub experts: Option<(usize, usize)>,
    /// Llama 3's RoPE frequency factors (written as `rope_freqs.weight`), by Llama 3.1's rule:
    /// `[factor, low_freq_factor, high_freq_factor, original context]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_factors: Option<[f32; 4]>,
    /// Partial RoPE: the leading dimensions of each head that rotate (`rope.dimension_count`);
    /// `None`: the whole head.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_dim: Option<usize>,
    /// Routing beyond a top-k softmax, shared experts and leading dense layers (glm4moe: needed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingShape>,
    /// Multi-head latent attention (`deepseek2`): `kv_heads` is then 1 and `head_dim` the
    /// latent's width plus the rotated key part ([`crate::config::Mla::latent`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mla: Option<crate::config::Mla>,
}

/// A mixture of experts' routing and layers beyond Mixtral's (GLM-4.5, DeepSeek-V3): what
/// `make-model` writes as the `expert_*` and `leading_dense_block_count` keys and tensors.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RoutingShape {
    /// The first layers have a dense FFN of `dense_ffn` neurons instead of experts.
    pub leading_dense: usize,
    pub dense_ffn: usize,
    /// Shared experts (not gated), each of the experts' width, run by every token.
    pub shared_experts: usize,
    /// Sigmoid gating (else softmax).
    pub sigmoid: bool,
    /// A per-expert score bias `exp_probs_b` that chooses (does not weigh) experts.
    pub score_bias: bool,
    /// The chosen experts' weights renormalized to sum to one.
    pub normalize: bool,
    /// The chosen experts' weights multiplied by this.
    pub routed_scale: f32,
    /// Grouped top-k (DeepSeek-V3): experts in this many groups, chosen from this many of
    /// them (`expert_group_count`, `expert_group_used_count`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub groups: Option<(usize, usize)>,
}

impl RoutingShape {
    /// GLM-4.5's routing: the first layer dense (of `dense_ffn` neurons), one shared expert,
    /// sigmoid scores with a score bias, renormalized, scale 1, not grouped.
    pub fn glm(dense_ffn: usize) -> RoutingShape {
        RoutingShape {
            leading_dense: 1,
            dense_ffn,
            shared_experts: 1,
            sigmoid: true,
            score_bias: true,
            normalize: true,
            routed_scale: 1.0,
            groups: None,
        }
    }

    /// DeepSeek-V3's routing at a small model's scale: the first layer dense (of `dense_ffn`
    /// neurons), one shared expert, sigmoid scores with a score bias, renormalized, scaled by
    /// 2.5, the experts in 4 groups of which 2 are used (V3's own: 8 and 4).
    pub fn deepseek_v3(dense_ffn: usize) -> RoutingShape {
        RoutingShape {
            routed_scale: 2.5,
            groups: Some((4, 2)),
            ..RoutingShape::glm(dense_ffn)
        }
    }
}

/// The named shapes, as `--shape` spells them.
pub const SHAPE_NAMES: &[&str] = &[
    "llama3-8b",
    "llama3.1-8b",
    "llama3-70b",
    "qwen2.5-1.5b",
    "qwen2.5-7b",
    "qwen2.5-32b",
    "qwen3-8b",
    "qwen3-32b",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "olmoe-1b-7b",
    "glm-4.5-air",
    "deepseek-v2-lite",
    "deepseek-v3",
    "kimi-k2",
    "gpt-oss-20b",
    "gpt-oss-120b",
];

/// The DeepSeek-V2/V3 shapes (`deepseek2`: latent attention, shared experts, leading dense
/// layers), from their config.json files. Their YaRN RoPE scaling (factor 40, or 32 for Kimi-K2)
/// is not written: it changes no size and no read.
fn deepseek_shape(name: &str) -> Option<Shape> {
    use crate::config::Mla;
    // (name, hidden, layers, heads, q_lora, experts, used, expert width, first dense, dense
    // width, shared, sigmoid+bias, normalize, scale, groups, vocab, rope base, context)
    #[allow(clippy::type_complexity)]
    let (
        hidden,
        layers,
        heads,
        q_lora_rank,
        experts,
        used,
        ffn,
        dense,
        dense_ffn,
        shared,
        v3,
        normalize,
        scale,
        groups,
        vocab,
        rope_theta,
        context_len,
    ): (
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        bool,
        bool,
        f32,
        Option<(usize, usize)>,
        usize,
        f32,
        usize,
    ) = match name {
        // deepseek-ai/DeepSeek-V2-Lite: softmax routing, no score bias, weights not renormalized.
        "deepseek-v2-lite" => (
            2048, 27, 16, 0, 64, 6, 1408, 1, 10944, 2, false, false, 1.0, None, 102_400, 10000.0, 163_840,
        ),
        // deepseek-ai/DeepSeek-V3 (and R1): sigmoid scores with a bias, 8 groups of which 4 are
        // used, scale 2.5.
        "deepseek-v3" => (
            7168,
            61,
            128,
            1536,
            256,
            8,
            2048,
            3,
            18432,
            1,
            true,
            true,
            2.5,
            Some((8, 4)),
            129_280,
            10000.0,
            163_840,
        ),
        // moonshotai/Kimi-K2-Instruct: V3's layout with 384 experts, 64 heads, one dense layer.
        "kimi-k2" => (
            7168, 61, 64, 1536, 384, 8, 2048, 1, 18432, 1, true, true, 2.827, None, 163_840, 50000.0, 131_072,
        ),
        _ => return None,
    };
    let mla = Mla {
        q_lora_rank,
        kv_lora_rank: 512,
        qk_nope: 128,
        qk_rope: 64,
        v_head: 128,
    };
    Some(Shape {
        name: name.into(),
        arch: Arch::Deepseek2,
        hidden,
        ffn,
        layers,
        heads,
        kv_heads: 1,
        head_dim: mla.latent(),
        vocab,
        context_len,
        rope_theta,
        rms_eps: 1e-6,
        tied: false,
        experts: Some((experts, used)),
        rope_factors: None,
        rope_dim: None,
        routing: Some(RoutingShape {
            leading_dense: dense,
            dense_ffn,
            shared_experts: shared,
            sigmoid: v3,
            score_bias: v3,
            normalize,
            routed_scale: scale,
            groups,
        }),
        mla: Some(mla),
    })
}

/// gpt-oss's attention window on its local layers, and its YaRN RoPE scaling (factor, original
/// context), as the released configs give them; `make-model` writes every gpt-oss shape with
/// them.
pub const GPT_OSS_SLIDING_WINDOW: usize = 128;
pub const GPT_OSS_YARN: (f32, usize) = (32.0, 4096);

impl Shape {
    /// A custom shape (`make-model --shape custom`): `arch` at these dimensions, the rest as that
    /// command sets it — the tokenizer's vocabulary (`vocab` 0), a 4096-token context, the
    /// architecture's RoPE base and norm epsilon, untied, dense, whole heads rotated, no RoPE
    /// frequency factors, latent attention or routing beyond a top-k softmax.
    pub fn custom(
        arch: Arch,
        hidden: usize,
        ffn: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Shape {
        Shape {
            name: "custom".into(),
            arch,
            hidden,
            ffn,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab: 0,
            context_len: 4096,
            rope_theta: match arch {
                Arch::Llama => 10000.0,
                Arch::GptOss => 150_000.0,
                _ => 1e6,
            },
            rms_eps: if arch == Arch::GptOss { 1e-5 } else { 1e-6 },
            tied: false,
            experts: None,
            rope_factors: None,
            mla: None,
            rope_dim: None,
            routing: None,
        }
    }

    /// A named shape (the dimensions of the released model's config).
    pub fn named(name: &str) -> Result<Shape> {
        if name == "llama3.1-8b" {
            // Llama 3's dimensions, a 128K context and the RoPE frequency factors of its config
            // (factor 8, low and high frequency factors 1 and 4, original context 8192).
            return Ok(Shape {
                name: name.into(),
                context_len: 131_072,
                rope_factors: Some([8.0, 1.0, 4.0, 8192.0]),
                ..Shape::named("llama3-8b")?
            });
        }
        if name == "glm-4.5-air" {
            // zai-org/GLM-4.5-Air's config.json: 46 layers (the first dense, of width 10944),
            // 128 experts of 1408 (8 per token, sigmoid scores with a bias, renormalized, scale
            // 1.0) and one shared expert, 96 heads of 128 over 8 KV heads with Q/K/V biases and
            // no QK-norm, half of each head rotated (partial_rotary_factor 0.5), rope base 1e6.
            // (Its NextN layer, which inference does not run, is not written.)
            return Ok(Shape {
                name: name.into(),
                arch: Arch::Glm4Moe,
                hidden: 4096,
                ffn: 1408,
                layers: 46,
                heads: 96,
                kv_heads: 8,
                head_dim: 128,
                vocab: 151_552,
                context_len: 131_072,
                rope_theta: 1e6,
                rms_eps: 1e-5,
                tied: false,
                experts: Some((128, 8)),
                rope_factors: None,
                rope_dim: Some(64),
                routing: Some(RoutingShape::glm(10944)),
                mla: None,
            });
        }
        if let Some(s) = deepseek_shape(name) {
            return Ok(s);
        }
        #[allow(clippy::type_complexity)]
        let (
            arch,
            hidden,
            ffn,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab,
            context_len,
            rope_theta,
            rms_eps,
            tied,
            experts,
        ): (
            Arch,
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            usize,
            f32,
            f32,
            bool,
            Option<(usize, usize)>,
        ) = match name {
            "llama3-8b" => (
                Arch::Llama,
                4096,
                14336,
                32,
                32,
                8,
                128,
                128_256,
                8192,
                500_000.0,
                1e-5,
                false,
                None,
            ),
            "llama3-70b" => (
                Arch::Llama,
                8192,
                28672,
                80,
                64,
                8,
                128,
                128_256,
                8192,
                500_000.0,
                1e-5,
                false,
                None,
            ),
            "qwen2.5-1.5b" => (
                Arch::Qwen2,
                1536,
                8960,
                28,
                12,
                2,
                128,
                151_936,
                32768,
                1e6,
                1e-6,
                true,
                None,
            ),
            "qwen2.5-7b" => (
                Arch::Qwen2,
                3584,
                18944,
                28,
                28,
                4,
                128,
                152_064,
                32768,
                1e6,
                1e-6,
                false,
                None,
            ),
            "qwen2.5-32b" => (
                Arch::Qwen2,
                5120,
                27648,
                64,
                40,
                8,
                128,
                152_064,
                32768,
                1e6,
                1e-6,
                false,
                None,
            ),
            "qwen3-8b" => (
                Arch::Qwen3,
                4096,
                12288,
                36,
                32,
                8,
                128,
                151_936,
                40960,
                1e6,
                1e-6,
                false,
                None,
            ),
            "qwen3-32b" => (
                Arch::Qwen3,
                5120,
                25600,
                64,
                64,
                8,
                128,
                151_936,
                40960,
                1e6,
                1e-6,
                false,
                None,
            ),
            "mixtral-8x7b" => (
                Arch::Llama,
                4096,
                14336,
                32,
                32,
                8,
                128,
                32000,
                32768,
                1e6,
                1e-5,
                false,
                Some((8, 2)),
            ),
            "qwen3-30b-a3b" => (
                Arch::Qwen3Moe,
                2048,
                768,
                48,
                32,
                4,
                128,
                151_936,
                40960,
                1e6,
                1e-6,
                false,
                Some((128, 8)),
            ),
            "olmoe-1b-7b" => (
                Arch::Olmoe,
                2048,
                1024,
                16,
                16,
                16,
                128,
                50304,
                4096,
                10000.0,
                1e-5,
                false,
                Some((64, 8)),
            ),
            // openai/gpt-oss-20b and -120b: 2880 wide, 64 query heads of 64 (q_dim 4096 ≠
            // hidden), 8 KV heads, experts 2880 wide, o200k_harmony's 201088 tokens.
            "gpt-oss-20b" | "gpt-oss-120b" => {
                let big = name == "gpt-oss-120b";
                (
                    Arch::GptOss,
                    2880,
                    2880,
                    if big { 36 } else { 24 },
                    64,
                    8,
                    64,
                    201_088,
                    131_072,
                    150_000.0,
                    1e-5,
                    false,
                    Some((if big { 128 } else { 32 }, 4)),
                )
            }
            other => {
                return Err(Error::Input(format!(
                    "--shape {other}: not a shape this build knows; give one of {} or `custom` with its dimensions",
                    SHAPE_NAMES.join(", ")
                )))
            }
        };
        Ok(Shape {
            name: name.into(),
            vocab,
            context_len,
            rope_theta,
            rms_eps,
            tied,
            experts,
            ..Shape::custom(arch, hidden, ffn, layers, heads, kv_heads, head_dim)
        })
    }

    /// The RoPE frequency factors written as `rope_freqs.weight`, if the shape has them.
    pub fn rope_freq_factors(&self) -> Option<Vec<f32>> {
        self.rope_factors
            .map(|[f, lo, hi, ctx]| crate::config::llama3_rope_factors(self.head_dim, self.rope_theta, f, lo, hi, ctx))
    }

    /// Checks what the writers and llama.cpp need: heads dividing evenly, experts only in the
    /// architectures that have them (and always in those), OLMoE without grouped-query
    /// attention, sizes within the format's limits.
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Input(format!("shape {}: {what}", self.name)));
        let dims = [
            self.hidden,
            self.ffn,
            self.layers,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.vocab,
        ];
        if dims.contains(&0) || self.context_len == 0 {
            return bad("every dimension must be at least 1".into());
        }
        if dims.iter().any(|&d| d > 1 << 20) || self.layers > 1024 {
            return bad("a dimension is beyond what a model of this kind has (at most 2^20; 1024 layers)".into());
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} heads do not share {} KV heads evenly",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head size {} must be even (RoPE rotates pairs)", self.head_dim));
        }
        if !self.hidden.is_multiple_of(32) || !self.ffn.is_multiple_of(32) {
            return bad(format!(
                "hidden ({}) and the FFN width ({}) must be multiples of 32 (whole quantization blocks)",
                self.hidden, self.ffn
            ));
        }
        match (self.arch, self.experts, &self.routing) {
            (Arch::Glm4Moe, Some(_), Some(_)) => {}
            (Arch::Glm4Moe, _, _) => {
                return bad("glm4moe needs --experts and its routing (leading dense layers, shared experts)".into())
            }
            (Arch::Deepseek2, Some(_), Some(_)) | (Arch::Deepseek2, None, None) => {}
            (Arch::Deepseek2, _, _) => {
                return bad("deepseek2's experts need their routing (leading dense layers, shared experts)".into())
            }
            (_, _, Some(_)) => {
                return bad(format!(
                    "{} routes by a top-k softmax (no score bias, leading dense layers or shared experts here)",
                    self.arch.name()
                ))
            }
            _ => {}
        }
        if let Some(r) = &self.routing {
            if r.leading_dense >= self.layers
                || (r.leading_dense > 0 && !r.dense_ffn.is_multiple_of(32))
                || r.dense_ffn > 1 << 20
                || r.shared_experts > 64
                || !(r.routed_scale.is_finite() && r.routed_scale > 0.0)
                || r.groups.is_some_and(|(n, used)| {
                    let e = self.experts.map_or(0, |x| x.0);
                    n == 0 || used == 0 || used > n || !e.is_multiple_of(n)
                })
            {
                return bad(format!(
                    "routing {r:?}: need fewer leading dense layers than layers (some have experts), a dense width \
                     that is a multiple of 32, at most 64 shared experts and a positive scale"
                ));
            }
        }
        if let Some(d) = self.rope_dim {
            if d == 0 || d > self.head_dim || !d.is_multiple_of(2) {
                return bad(format!(
                    "RoPE over {d} of {} dimensions: need an even count up to the head's",
                    self.head_dim
                ));
            }
        }
        match (self.arch, self.experts) {
            (Arch::Glm4Moe, _) => {}
            (Arch::Llama, _) | (Arch::Qwen2 | Arch::Qwen3, None) => {}
            (Arch::Qwen2 | Arch::Qwen3, Some(_)) => {
                return bad(format!("{} has no experts (qwen3moe and olmoe do)", self.arch.name()))
            }
            (Arch::Qwen3Moe | Arch::Olmoe | Arch::GptOss, None) => {
                return bad(format!("{} needs --experts", self.arch.name()))
            }
            (Arch::Qwen3Moe | Arch::Olmoe | Arch::GptOss, Some(_)) => {}
            (Arch::Deepseek2, _) => {}
            (a, _) => return bad(format!("{} is not an architecture make-model writes", a.name())),
        }
        if let Some((e, k)) = self.experts {
            if k == 0 || k > e || e > 1024 {
                return bad(format!("{e} experts with {k} used: need 1 <= used <= experts <= 1024"));
            }
        }
        if let Some([f, lo, hi, ctx]) = self.rope_factors {
            if !([f, lo, ctx].iter().all(|x| x.is_finite() && *x > 0.0) && hi.is_finite() && hi > lo) {
                return bad(format!(
                    "RoPE factors [{f}, {lo}, {hi}, {ctx}]: need a positive factor and original context and \
                     0 < low < high frequency factors"
                ));
            }
        }
        match (self.arch, self.mla) {
            (Arch::Deepseek2, Some(m)) => {
                if self.kv_heads != 1 || self.head_dim != m.latent() || !m.qk_rope.is_multiple_of(2) {
                    return bad(format!(
                        "latent attention {m:?} caches one head of kv_lora_rank + qk_rope = {} (kv_heads 1, \
                         head_dim {}); qk_rope even",
                        m.latent(),
                        m.latent()
                    ));
                }
                if [m.kv_lora_rank, m.qk_nope, m.v_head, m.q_lora_rank]
                    .iter()
                    .any(|d| !d.is_multiple_of(32))
                {
                    return bad(format!("latent attention {m:?}: its widths must be multiples of 32"));
                }
            }
            (Arch::Deepseek2, None) => return bad("deepseek2 needs latent attention dimensions".into()),
            (a, Some(_)) => return bad(format!("{} has no latent attention", a.name())),
            _ => {}
        }
        if self.arch == Arch::Olmoe && self.kv_heads != self.heads {
            return bad(format!(
                "olmoe has no grouped-query attention: give as many KV heads as heads ({})",
                self.heads
            ));
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// The type mix: which GGML type each matrix gets, as llama.cpp's quantizer assigns it for a
/// file type. Norms, biases and routers are F32 in every mix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mix {
    /// `Q4_K_M`: Q4_K, with Q6_K for the output matrix and for `attn_v` and `ffn_down` on the
    /// layers `use_more_bits` picks (Q5_K `attn_v` elsewhere in a 70B llama), and for 8-expert
    /// models Q8_0 `attn_k`/`attn_v` and Q5_K `attn_output`.
    Q4KM,
    /// `Q6_K` everywhere (Q8_0 `attn_k`/`attn_v` for 8-expert models).
    Q6K,
    /// `Q8_0` everywhere.
    Q8_0,
    /// `MXFP4_MOE` (how gpt-oss is published): MXFP4 experts, Q8_0 for every other matrix
    /// (the embedding and output included).
    Mxfp4Moe,
    /// `Q2_K`: Q2_K, with Q3_K `ffn_down` and `attn_output` (Q5_K for 8-expert models), Q4_K
    /// `attn_v` where 4 or more query heads share a key head (Q3_K otherwise), Q6_K output.
    Q2K,
    /// `Q3_K_M`: Q3_K, with Q4_K `ffn_down` (Q5_K on the first sixteenth of the layers) and
    /// `attn_output` (Q5_K for 8-expert models), Q5_K `attn_v` on the first two layers and Q4_K
    /// after, Q6_K output.
    Q3KM,
    /// `IQ4_XS` (quantized without an importance matrix): IQ4_XS, with Q5_K `attn_v` where 4
    /// or more query heads share a key head and Q5_K `ffn_down` on the first eighth of the
    /// layers (and `attn_output` for 8-expert models), Q6_K output.
    IQ4XS,
    /// `IQ2_XXS`: IQ2_XXS, with Q2_K embedding and `ffn_down` on the first eighth of the layers,
    /// Q4_K `attn_v` where 4 or more query heads share a key head or a layer has 4 or more
    /// experts (Q2_K otherwise), Q5_K output (and `attn_output` for 8-expert models).
    IQ2XXS,
}

/// What a matrix is, for the type rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    TokenEmbd,
    Output,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    FfnGate,
    FfnUp,
    FfnDown,
}

impl Mix {
    pub fn name(self) -> &'static str {
        match self {
            Mix::Q4KM => "Q4_K_M",
            Mix::Q6K => "Q6_K",
            Mix::Q8_0 => "Q8_0",
            Mix::Mxfp4Moe => "MXFP4_MOE",
            Mix::Q2K => "Q2_K",
            Mix::Q3KM => "Q3_K_M",
            Mix::IQ4XS => "IQ4_XS",
            Mix::IQ2XXS => "IQ2_XXS",
        }
    }

    /// llama.cpp's `general.file_type` for the mix (`LLAMA_FTYPE_MOSTLY_*`).
    pub fn file_type(self) -> u32 {
        match self {
            Mix::Q4KM => 15,
            Mix::Q6K => 18,
            Mix::Q8_0 => 7,
            Mix::Mxfp4Moe => 38,
            Mix::Q2K => 10,
            Mix::Q3KM => 12,
            Mix::IQ4XS => 30,
            Mix::IQ2XXS => 19,
        }
    }

    /// The type of a matrix of `role` in layer `layer` (ignored for the embedding and output)
    /// whose rows hold `cols` values, in a model of `shape`: llama.cpp's
    /// `llama_tensor_get_type` for the mix's file type (llama-quant.cpp), then its fallback for
    /// rows that are not whole blocks of the type.
    pub fn matrix_type(self, shape: &Shape, role: Role, layer: usize, cols: usize) -> GgmlType {
        use GgmlType as T;
        let n = shape.layers;
        let more_bits = layer < n / 8 || layer >= 7 * n / 8 || (layer as isize - (n / 8) as isize).rem_euclid(3) == 2;
        let experts = shape.experts.map_or(0, |(e, _)| e);
        let eight_experts = experts == 8;
        let gqa = shape.heads / shape.kv_heads.max(1);
        let seventy_b = shape.arch == Arch::Llama && n == 80;
        let base = match self {
            Mix::Q4KM => T::Q4_K,
            Mix::Q6K => T::Q6_K,
            Mix::Q8_0 => T::Q8_0,
            Mix::Q2K => T::Q2_K,
            Mix::Q3KM => T::Q3_K,
            Mix::IQ4XS => T::IQ4_XS,
            Mix::IQ2XXS => T::IQ2_XXS,
            // Three-dimensional (expert) tensors MXFP4, the rest Q8_0, the output included.
            Mix::Mxfp4Moe => {
                let expert = shape.experts.is_some() && matches!(role, Role::FfnGate | Role::FfnUp | Role::FfnDown);
                return if expert { T::MXFP4 } else { T::Q8_0 };
            }
        };
        let output_like = role == Role::Output || (role == Role::TokenEmbd && shape.tied);
        let ty = if output_like {
            match self {
                Mix::Q8_0 => T::Q8_0,
                _ if !cols.is_multiple_of(256) => T::Q8_0,
                Mix::IQ2XXS => T::Q5_K,
                _ => T::Q6_K,
            }
        } else if role == Role::TokenEmbd {
            if self == Mix::IQ2XXS {
                T::Q2_K
            } else {
                base
            }
        } else if self == Mix::IQ2XXS {
            match role {
                Role::AttnV if gqa >= 4 || experts >= 4 => T::Q4_K,
                Role::AttnV => T::Q2_K,
                Role::AttnK if eight_experts => T::Q4_K,
                Role::FfnDown if layer < n / 8 => T::Q2_K,
                Role::AttnOutput if eight_experts => T::Q5_K,
                _ => base,
            }
        } else {
            match role {
                Role::AttnV => {
                    let t = match self {
                        Mix::Q2K if gqa >= 4 => T::Q4_K,
                        Mix::Q2K => T::Q3_K,
                        Mix::Q3KM if layer < 2 => T::Q5_K,
                        Mix::Q3KM => T::Q4_K,
                        Mix::IQ4XS if gqa >= 4 => T::Q5_K,
                        Mix::Q4KM if more_bits => T::Q6_K,
                        _ => base,
                    };
                    match t {
                        _ if eight_experts => T::Q8_0,
                        T::Q3_K | T::Q4_K if seventy_b => T::Q5_K,
                        t => t,
                    }
                }
                Role::AttnK if eight_experts => T::Q8_0,
                Role::FfnDown => match self {
                    Mix::Q2K => T::Q3_K,
                    Mix::Q3KM if layer < n / 16 => T::Q5_K,
                    Mix::Q3KM => T::Q4_K,
                    Mix::Q4KM if more_bits => T::Q6_K,
                    Mix::IQ4XS if layer < n / 8 => T::Q5_K,
                    _ => base,
                },
                Role::AttnOutput if eight_experts => match self {
                    Mix::Q2K | Mix::Q3KM | Mix::Q4KM | Mix::IQ4XS => T::Q5_K,
                    _ => base,
                },
                Role::AttnOutput => match self {
                    Mix::Q2K => T::Q3_K,
                    Mix::Q3KM => T::Q4_K,
                    _ => base,
                },
                _ => base,
            }
        };
        // llama.cpp's fallback for rows that are not whole blocks of the type.
        if cols.is_multiple_of(ty.block_elems()) {
            return ty;
        }
        match ty {
            T::IQ4_XS | T::IQ2_XXS => T::IQ4_NL,
            T::Q2_K | T::Q3_K => T::Q4_0,
            T::Q4_K => T::Q5_0,
            T::Q5_K => T::Q5_1,
            T::Q6_K => T::Q8_0,
            t => t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The types llama.cpp gave the real Qwen2.5-Coder-1.5B Q4_K_M file fetched by tools/fetch-models.sh:
    /// Q6_K output, Q4_K embedding (untied there), Q6_K attn_v and ffn_down on 14 of 28 layers
    /// (use_more_bits), Q4_K elsewhere. llama.cpp counts layers in the order the file lists them,
    /// which for that file was lexicographic (blk.0, blk.1, blk.10, …), so it picked other layers
    /// than the numeric order make-model writes in; the count (and so the bytes) is the same.
    #[test]
    fn q4_k_m_follows_llama_cpp_on_a_real_file() {
        let s = Shape {
            tied: false,
            ..Shape::named("qwen2.5-1.5b").unwrap()
        };
        let m = Mix::Q4KM;
        assert_eq!(m.matrix_type(&s, Role::Output, 0, 1536), GgmlType::Q6_K);
        assert_eq!(m.matrix_type(&s, Role::TokenEmbd, 0, 1536), GgmlType::Q4_K);
        let q6: Vec<usize> = (0..28)
            .filter(|&l| m.matrix_type(&s, Role::FfnDown, l, 8960) == GgmlType::Q6_K)
            .collect();
        assert_eq!(q6, vec![0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]);
        for l in 0..28 {
            assert_eq!(
                m.matrix_type(&s, Role::AttnV, l, 1536),
                m.matrix_type(&s, Role::FfnDown, l, 8960)
            );
            assert_eq!(m.matrix_type(&s, Role::FfnGate, l, 1536), GgmlType::Q4_K);
            assert_eq!(m.matrix_type(&s, Role::AttnOutput, l, 1536), GgmlType::Q4_K);
        }
        // Tied: the embedding is the output matrix and gets its type.
        let tied = Shape::named("qwen2.5-1.5b").unwrap();
        assert_eq!(m.matrix_type(&tied, Role::TokenEmbd, 0, 1536), GgmlType::Q6_K);
    }

    /// The types llama-quantize (llama.cpp of llama-cpp-python 0.3.36, tools/llama-cpp.sh) gave the real
    /// Qwen2.5-Coder-1.5B (28 layers, 6 query heads a key head, untied) re-quantized to Q2_K,
    /// Q3_K_M, IQ4_XS and IQ2_XXS (with an importance matrix), and SmolLM2-135M (576 columns:
    /// the fallbacks; 3 query heads a key head) to Q2_K and IQ4_XS.
    #[test]
    fn the_small_mixes_follow_llama_cpp_on_real_files() {
        use GgmlType as T;
        let s = Shape {
            tied: false,
            ..Shape::named("qwen2.5-1.5b").unwrap()
        };
        let (h, f) = (1536, 8960);
        let expect = |mix: Mix, embd: T, out: T, attn: T, v: fn(usize) -> T, o: T, down: fn(usize) -> T, ffn: T| {
            assert_eq!(mix.matrix_type(&s, Role::TokenEmbd, 0, h), embd, "{mix:?}");
            assert_eq!(mix.matrix_type(&s, Role::Output, 0, h), out, "{mix:?}");
            for l in 0..28 {
                assert_eq!(mix.matrix_type(&s, Role::AttnQ, l, h), attn, "{mix:?} {l}");
                assert_eq!(mix.matrix_type(&s, Role::AttnK, l, h), attn, "{mix:?} {l}");
                assert_eq!(mix.matrix_type(&s, Role::AttnV, l, h), v(l), "{mix:?} {l}");
                assert_eq!(mix.matrix_type(&s, Role::AttnOutput, l, h), o, "{mix:?} {l}");
                assert_eq!(mix.matrix_type(&s, Role::FfnGate, l, h), ffn, "{mix:?} {l}");
                assert_eq!(mix.matrix_type(&s, Role::FfnUp, l, h), ffn, "{mix:?} {l}");
                assert_eq!(mix.matrix_type(&s, Role::FfnDown, l, f), down(l), "{mix:?} {l}");
            }
        };
        expect(
            Mix::Q2K,
            T::Q2_K,
            T::Q6_K,
            T::Q2_K,
            |_| T::Q4_K,
            T::Q3_K,
            |_| T::Q3_K,
            T::Q2_K,
        );
        expect(
            Mix::Q3KM,
            T::Q3_K,
            T::Q6_K,
            T::Q3_K,
            |l| if l < 2 { T::Q5_K } else { T::Q4_K },
            T::Q4_K,
            |l| if l < 1 { T::Q5_K } else { T::Q4_K },
            T::Q3_K,
        );
        expect(
            Mix::IQ4XS,
            T::IQ4_XS,
            T::Q6_K,
            T::IQ4_XS,
            |_| T::Q5_K,
            T::IQ4_XS,
            |l| if l < 3 { T::Q5_K } else { T::IQ4_XS },
            T::IQ4_XS,
        );
        expect(
            Mix::IQ2XXS,
            T::Q2_K,
            T::Q5_K,
            T::IQ2_XXS,
            |_| T::Q4_K,
            T::IQ2_XXS,
            |l| if l < 3 { T::Q2_K } else { T::IQ2_XXS },
            T::IQ2_XXS,
        );
        // SmolLM2's 576-column rows fall back to 32-value blocks; 3 query heads a key head.
        let small = Shape {
            name: "custom".into(),
            hidden: 576,
            ffn: 1536,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            ..s.clone()
        };
        for (mix, v, up) in [(Mix::Q2K, T::Q4_0, T::Q4_0), (Mix::IQ4XS, T::IQ4_NL, T::IQ4_NL)] {
            assert_eq!(mix.matrix_type(&small, Role::AttnV, 5, 576), v, "{mix:?}");
            assert_eq!(mix.matrix_type(&small, Role::AttnOutput, 5, 576), v, "{mix:?}");
            assert_eq!(mix.matrix_type(&small, Role::FfnUp, 5, 576), up, "{mix:?}");
        }
        assert_eq!(Mix::Q2K.matrix_type(&small, Role::FfnDown, 0, 1536), T::Q3_K);
        assert_eq!(Mix::IQ4XS.matrix_type(&small, Role::FfnDown, 0, 1536), T::Q5_K);
    }

    #[test]
    fn eight_experts_and_70b_special_cases() {
        let mixtral = Shape::named("mixtral-8x7b").unwrap();
        let m = Mix::Q4KM;
        assert_eq!(m.matrix_type(&mixtral, Role::AttnV, 10, 4096), GgmlType::Q8_0);
        assert_eq!(m.matrix_type(&mixtral, Role::AttnK, 10, 4096), GgmlType::Q8_0);
        assert_eq!(m.matrix_type(&mixtral, Role::AttnOutput, 10, 4096), GgmlType::Q5_K);
        assert_eq!(
            Mix::Q6K.matrix_type(&mixtral, Role::AttnOutput, 10, 4096),
            GgmlType::Q6_K
        );
        let l70 = Shape::named("llama3-70b").unwrap();
        assert_eq!(m.matrix_type(&l70, Role::AttnV, 0, 8192), GgmlType::Q6_K);
        assert_eq!(m.matrix_type(&l70, Role::AttnV, 11, 8192), GgmlType::Q5_K);
        let qwen3 = Shape::named("qwen3-30b-a3b").unwrap();
        assert_eq!(m.matrix_type(&qwen3, Role::AttnK, 10, 2048), GgmlType::Q4_K);
        // Rows that are not whole 256-value blocks fall back as llama.cpp's do.
        assert_eq!(m.matrix_type(&qwen3, Role::FfnDown, 10, 96), GgmlType::Q5_0);
        assert_eq!(m.matrix_type(&qwen3, Role::FfnDown, 0, 96), GgmlType::Q8_0);
        for name in SHAPE_NAMES {
            Shape::named(name).unwrap().check().unwrap();
        }
        let oss = Shape::named("gpt-oss-20b").unwrap();
        let x = Mix::Mxfp4Moe;
        for role in [Role::FfnGate, Role::FfnUp, Role::FfnDown] {
            assert_eq!(x.matrix_type(&oss, role, 3, 2880), GgmlType::MXFP4);
        }
        for role in [
            Role::TokenEmbd,
            Role::Output,
            Role::AttnQ,
            Role::AttnK,
            Role::AttnV,
            Role::AttnOutput,
        ] {
            assert_eq!(x.matrix_type(&oss, role, 3, 2880), GgmlType::Q8_0);
        }
        // A dense model has no expert tensors: everything Q8_0.
        let dense = Shape::named("llama3-8b").unwrap();
        assert_eq!(x.matrix_type(&dense, Role::FfnUp, 0, 4096), GgmlType::Q8_0);
        assert!(Shape::named("llama3-9b").is_err());
    }

    /// GLM-4.5-Air's Q4_K_M mix as llama.cpp's quantizer assigns it: experts of 1408 columns
    /// (not whole 256-value blocks) fall back (down: Q5_0 or, on the use_more_bits layers,
    /// Q8_0), the dense layer and the 4096-column matrices keep Q4_K / Q6_K.
    #[test]
    fn glm_4_5_air_types() {
        let s = Shape::named("glm-4.5-air").unwrap();
        let m = Mix::Q4KM;
        assert_eq!(m.matrix_type(&s, Role::FfnGate, 1, 4096), GgmlType::Q4_K);
        assert_eq!(m.matrix_type(&s, Role::FfnDown, 0, 10944), GgmlType::Q8_0);
        assert_eq!(m.matrix_type(&s, Role::FfnDown, 0, 1408), GgmlType::Q8_0);
        assert_eq!(m.matrix_type(&s, Role::FfnDown, 11, 1408), GgmlType::Q5_0);
        assert_eq!(m.matrix_type(&s, Role::FfnDown, 10, 1408), GgmlType::Q8_0);
        assert_eq!(m.matrix_type(&s, Role::AttnV, 0, 4096), GgmlType::Q6_K);
        assert_eq!(m.matrix_type(&s, Role::AttnK, 10, 4096), GgmlType::Q4_K);
        assert_eq!(m.matrix_type(&s, Role::Output, 0, 4096), GgmlType::Q6_K);
        let mut bad = s.clone();
        bad.routing = None;
        assert!(bad.check().is_err());
    }
}
