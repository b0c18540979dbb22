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
    "gpt-oss-20b",
    "gpt-oss-120b",
];

/// gpt-oss's attention window on its local layers, and its YaRN RoPE scaling (factor, original
/// context), as the released configs give them; `make-model` writes every gpt-oss shape with
/// them.
pub const GPT_OSS_SLIDING_WINDOW: usize = 128;
pub const GPT_OSS_YARN: (f32, usize) = (32.0, 4096);

impl Shape {
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
                return Err(Error::Invalid(format!(
                    "--shape {other}: not a shape this build knows; give one of {} or `custom` with its dimensions",
                    SHAPE_NAMES.join(", ")
                )))
            }
        };
        Ok(Shape {
            name: name.into(),
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
            rope_factors: None,
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
        let bad = |what: String| Err(Error::Invalid(format!("shape {}: {what}", self.name)));
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
        match (self.arch, self.experts) {
            (Arch::Llama, _) | (Arch::Qwen2 | Arch::Qwen3, None) => {}
            (Arch::Qwen2 | Arch::Qwen3, Some(_)) => {
                return bad(format!("{} has no experts (qwen3moe and olmoe do)", self.arch.name()))
            }
            (Arch::Qwen3Moe | Arch::Olmoe | Arch::GptOss, None) => {
                return bad(format!("{} needs --experts", self.arch.name()))
            }
            (Arch::Qwen3Moe | Arch::Olmoe | Arch::GptOss, Some(_)) => {}
            (a, _) => return bad(format!("{} is not an architecture make-model writes", a.name())),
        }
        if let Some((e, k)) = self.experts {
            if k == 0 || k > e || e > 256 {
                return bad(format!("{e} experts with {k} used: need 1 <= used <= experts <= 256"));
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
        }
    }

    /// llama.cpp's `general.file_type` for the mix (`LLAMA_FTYPE_MOSTLY_*`).
    pub fn file_type(self) -> u32 {
        match self {
            Mix::Q4KM => 15,
            Mix::Q6K => 18,
            Mix::Q8_0 => 7,
            Mix::Mxfp4Moe => 38,
        }
    }

    /// The type of a matrix of `role` in layer `layer` (ignored for the embedding and output)
    /// whose rows hold `cols` values, in a model of `shape`.
    pub fn matrix_type(self, shape: &Shape, role: Role, layer: usize, cols: usize) -> GgmlType {
        let n = shape.layers;
        let more_bits = layer < n / 8 || layer >= 7 * n / 8 || (layer as isize - (n / 8) as isize).rem_euclid(3) == 2;
        let eight_experts = shape.experts.is_some_and(|(e, _)| e == 8);
        let base = match self {
            Mix::Q4KM => GgmlType::Q4_K,
            Mix::Q6K => GgmlType::Q6_K,
            Mix::Q8_0 => GgmlType::Q8_0,
            // llama-quant.cpp: three-dimensional (expert) tensors MXFP4, the rest Q8_0.
            Mix::Mxfp4Moe => {
                let expert = shape.experts.is_some() && matches!(role, Role::FfnGate | Role::FfnUp | Role::FfnDown);
                return if expert { GgmlType::MXFP4 } else { GgmlType::Q8_0 };
            }
        };
        let output_like = role == Role::Output || (role == Role::TokenEmbd && shape.tied);
        let ty = match role {
            _ if output_like => match self {
                Mix::Q8_0 => GgmlType::Q8_0,
                _ if !cols.is_multiple_of(256) => GgmlType::Q8_0,
                _ => GgmlType::Q6_K,
            },
            Role::AttnV if eight_experts => GgmlType::Q8_0,
            Role::AttnK if eight_experts && self != Mix::Q8_0 => GgmlType::Q8_0,
            Role::AttnV if self == Mix::Q4KM => {
                let seventy_b = shape.arch == Arch::Llama && n == 80;
                match (more_bits, seventy_b) {
                    (true, _) => GgmlType::Q6_K,
                    (false, true) => GgmlType::Q5_K,
                    (false, false) => GgmlType::Q4_K,
                }
            }
            Role::AttnOutput if eight_experts && self == Mix::Q4KM => GgmlType::Q5_K,
            Role::FfnDown if self == Mix::Q4KM && more_bits => GgmlType::Q6_K,
            _ => base,
        };
        // llama.cpp's fallback for rows that are not whole 256-value blocks (Q5_K's would be
        // Q5_1, which gatestream does not compute: Q8_0 there).
        match ty {
            GgmlType::Q4_K if !cols.is_multiple_of(256) => GgmlType::Q5_0,
            GgmlType::Q5_K | GgmlType::Q6_K if !cols.is_multiple_of(256) => GgmlType::Q8_0,
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
}
