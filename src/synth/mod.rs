//! Synthetic models, because no real weights beyond 1.5B parameters (and no real mixture of
//! experts) are reachable here:
//! - [`moe`] (`gatestream make-moe`): a dense llama GGUF upcycled into experts, or random experts
//!   with its tokenizer;
//! - [`shapes`], [`tensors`] and [`write`] (`gatestream make-model`): random weights in the shapes
//!   of real architectures (Llama-3-8B … 70B, Qwen2.5, Mixtral, Qwen3-MoE, OLMoE) and in the type
//!   mixes llama.cpp's quantizer gives them, with a real tokenizer, written as a GGUF llama.cpp
//!   loads or as a `.gst` directly, a tensor at a time (memory stays at about one layer).
//!
//! Random weights mean nothing for quality (perplexity, agreement, draft acceptance); their
//! bytes, shapes and types are real, so speeds, bytes per token and memory are.
//!
//! Owns: the generators and the writers' order. Does not own the file formats (`gguf::write`,
//! `reformat`'s `.gst` builder) or any arithmetic beyond making bytes.

pub mod moe;
pub mod shapes;
pub mod tensors;
pub mod write;

pub use moe::{write_moe, MoeReport, MoeSpec, RandomShape, QK_LINEAR_EPS, QK_RESIDUAL_SCALE};
pub use shapes::{Mix, Role, RoutingShape, Shape, SHAPE_NAMES};
pub use write::{write_model, MakeReport, MakeSpec, OutputFormat, TokenizerChoice};

/// A deterministic generator (splitmix64; Box-Muller normals).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    pub(crate) fn normal(&mut self) -> f32 {
        let (a, b) = (self.unit(), self.unit());
        (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
    }
}
