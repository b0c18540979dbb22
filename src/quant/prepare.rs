//! The activation side of a dot product: a vector quantized once per matvec in the format the
//! weight type's kernels consume, as llama.cpp does (`vec_dot_type`). Stored as separate arrays
//! (values, scales, sums) rather than ggml's interleaved structs so the SIMD kernels load the
//! values with plain unaligned vector loads.

use super::layout::{QK_K, QK_LEGACY};
use super::GgmlType;

/// How the activations are stored; which one follows from the weight type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActivationFormat {
    /// Plain `f32` (F32/F16/BF16 weights).
    F32,
    /// Blocks of 32: `f32` scale, 32 `i8`, `i32` sum of the quants (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0,
    /// IQ4_NL, MXFP4).
    Q8Blocks32,
    /// Q8_K blocks of 256: `f32` scale, 256 `i8`, sums per 16 and per 32 quants (K-quants,
    /// IQ4_XS).
    Q8K,
}

impl ActivationFormat {
    /// The activations' blocks span the weights' blocks: float weights take plain f32, blocks
    /// of 32 take blocks of 32, super-blocks of 256 take Q8_K.
    pub(crate) fn for_weights(ty: GgmlType) -> ActivationFormat {
        match ty.block_elems() {
            1 => ActivationFormat::F32,
            super::layout::QK_LEGACY => ActivationFormat::Q8Blocks32,
            _ => ActivationFormat::Q8K,
        }
    }
}

/// An activation vector prepared for dot products against rows of one weight type (or any type
/// sharing its activation format). The buffers are reused across [`PreparedInput::prepare`] calls,
/// so a steady-state decode loop does not allocate.
#[derive(Clone, Debug)]
pub struct PreparedInput {
    weight_type: GgmlType,
    len: usize,
    /// Plain activations, for float weights only.
    pub(crate) values_f32: Vec<f32>,
    /// Quantized activations, `len` of them, for quantized weights.
    pub(crate) quants: Vec<i8>,
    /// One scale per block (of 32 or 256): activation = quant * scale.
    pub(crate) block_scales: Vec<f32>,
    /// Sum of the quants of each group of 32 (Q8Blocks32: one per block; Q8K: 8 per block).
    pub(crate) sums_32: Vec<i32>,
    /// Per 32-block pairs `[scale, scale * sum_32]` (Q8Blocks32 only) followed by two zeros of
    /// padding, so the Q4_1 kernel can multiply a block's `[d, m]` by one 128-bit load.
    pub(crate) scale_and_scaled_sum: Vec<f32>,
    /// Sum of the quants of each group of 16 (Q8K only: 16 per block; Q6_K's scale groups).
    /// `i16` as in ggml's `bsums` (at most 16 * 127), so the kernels can `vpmaddwd` them.
    pub(crate) sums_16: Vec<i16>,
}

impl PreparedInput {
    /// An empty input (length 0, prepared for F32 weights).
    pub fn new() -> Self {
        PreparedInput {
            weight_type: GgmlType::F32,
            len: 0,
            values_f32: Vec::new(),
            quants: Vec::new(),
            block_scales: Vec::new(),
            sums_32: Vec::new(),
            scale_and_scaled_sum: Vec::new(),
            sums_16: Vec::new(),
        }
    }

    /// Prepares `x` for dot products with rows of `weight_type`. Panics if `x.len()` is not a
    /// whole number of `weight_type` blocks.
    pub fn prepare(&mut self, x: &[f32], weight_type: GgmlType) {
        assert!(
            x.len().is_multiple_of(weight_type.block_elems()),
            "{} activations are not a whole number of {} blocks",
            x.len(),
            weight_type.name()
        );
        self.weight_type = weight_type;
        self.len = x.len();
        self.values_f32.clear();
        self.quants.clear();
        self.block_scales.clear();
        self.sums_32.clear();
        self.scale_and_scaled_sum.clear();
        self.sums_16.clear();
        match ActivationFormat::for_weights(weight_type) {
            ActivationFormat::F32 => self.values_f32.extend_from_slice(x),
            ActivationFormat::Q8Blocks32 => {
                for block in x.chunks_exact(QK_LEGACY) {
                    self.push_q8_32_block(block);
                }
                self.scale_and_scaled_sum.extend([0.0, 0.0]);
            }
            ActivationFormat::Q8K => {
                for block in x.chunks_exact(QK_K) {
                    self.push_q8_k_block(block);
                }
            }
        }
    }

    /// Number of elements of the prepared vector.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the prepared vector has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The weight type this input was prepared for.
    pub fn weight_type(&self) -> GgmlType {
        self.weight_type
    }

    /// Whether rows of `ty` can be dotted with this input (same activation format).
    pub(crate) fn is_prepared_for(&self, ty: GgmlType) -> bool {
        ActivationFormat::for_weights(ty) == ActivationFormat::for_weights(self.weight_type)
    }

    /// ggml's `quantize_row_q8_0`: scale = absmax / 127, quants rounded half away from zero.
    /// Written as whole-block array passes (no per-element `push`) so the loops vectorize.
    fn push_q8_32_block(&mut self, block: &[f32]) {
        let block: &[f32; QK_LEGACY] = block.try_into().expect("a whole block");
        let abs_max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = abs_max / 127.0;
        let inv_scale = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let mut quants = [0i8; QK_LEGACY];
        for (q, &v) in quants.iter_mut().zip(block) {
            *q = round_half_away(v * inv_scale) as i8;
        }
        let sum: i32 = quants.iter().map(|&q| i32::from(q)).sum();
        self.quants.extend_from_slice(&quants);
        self.block_scales.push(scale);
        self.sums_32.push(sum);
        self.scale_and_scaled_sum.extend([scale, scale * sum as f32]);
    }

    /// ggml's `quantize_row_q8_K`: the scale carries the sign of the element of largest
    /// magnitude (iscale = -127 / max), quants rounded half to even and capped at 127, so every
    /// quant lies in -127..=127 (which keeps `vpmaddubsw` from saturating).
    fn push_q8_k_block(&mut self, block: &[f32]) {
        let block: &[f32; QK_K] = block.try_into().expect("a whole block");
        // The first element of largest magnitude, found in two vectorizable passes (NaNs are
        // skipped by both `max` and the comparison, as by ggml's strict `>` scan).
        let abs_max = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let max = block.iter().copied().find(|v| v.abs() == abs_max).unwrap_or(0.0);
        let start = self.quants.len();
        if abs_max == 0.0 {
            self.quants.resize(start + QK_K, 0);
            self.block_scales.push(0.0);
        } else {
            let inv_scale = -127.0 / max;
            let mut quants = [0i8; QK_K];
            for (q, &v) in quants.iter_mut().zip(block) {
                *q = (round_ties_even(inv_scale * v) as i32).min(127) as i8;
            }
            self.quants.extend_from_slice(&quants);
            self.block_scales.push(1.0 / inv_scale);
        }
        let quants = &self.quants[start..];
        for group in quants.chunks_exact(16) {
            self.sums_16.push(group.iter().map(|&q| i16::from(q)).sum());
        }
        for group in quants.chunks_exact(32) {
            self.sums_32.push(group.iter().map(|&q| i32::from(q)).sum());
        }
    }
}

/// `x.round_ties_even()` without the libm call it compiles to on baseline x86-64 (no SSE4.1
/// `roundss`), which was a tenth of prefill time: below 2^22, adding and subtracting 1.5 * 2^23
/// leaves `x` rounded to an integer by the FPU's round-to-nearest-even, exactly (up to the sign
/// of a zero result, which the integer cast drops).
#[inline(always)]
fn round_ties_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    if x.abs() < 4_194_304.0 {
        (x + MAGIC) - MAGIC
    } else {
        x.round_ties_even() // already an integer, or inf/NaN
    }
}

/// `x.round()` (half away from zero) without the libm call: truncate with `cvttss2si`, then
/// step away from zero if the (exactly computed) fraction is at least one half. For |x| >= 2^31
/// and inf the truncation saturates to an integer-valued `t` whose cast to `i8` matches; NaN
/// gives 0 either way.
#[inline(always)]
fn round_half_away(x: f32) -> f32 {
    let t = x as i32 as f32;
    let frac = x - t;
    // Branch-free (adding or subtracting 0.0 leaves `t` as is) so the callers' loops vectorize.
    t + f32::from(u8::from(frac >= 0.5)) - f32::from(u8::from(frac <= -0.5))
}

impl PreparedInput {
    /// The activations the dot products see, as f32: each quant times its block's scale (the
    /// input itself for float weights). A device that multiplies f32 activations computes the
    /// CPU's products (to rounding) from these; the CUDA device makes them on the GPU
    /// (`act_q8_32` and `act_q8_k` in kernels/ops.cu) and tests compare with this.
    pub fn dequantized(&self) -> Vec<f32> {
        let block = match ActivationFormat::for_weights(self.weight_type) {
            ActivationFormat::F32 => return self.values_f32.clone(),
            ActivationFormat::Q8Blocks32 => QK_LEGACY,
            ActivationFormat::Q8K => QK_K,
        };
        self.quants
            .chunks_exact(block)
            .zip(&self.block_scales)
            .flat_map(|(q, &d)| q.iter().map(move |&v| v as f32 * d))
            .collect()
    }
}

impl Default for PreparedInput {
    fn default() -> Self {
        PreparedInput::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_blocks_reconstruct_within_half_a_step() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37) % 23) as f32 - 11.3).collect();
        let mut p = PreparedInput::new();
        p.prepare(&x, GgmlType::Q4_1);
        assert_eq!((p.len(), p.weight_type()), (64, GgmlType::Q4_1));
        for (b, block) in x.chunks_exact(32).enumerate() {
            let scale = p.block_scales[b];
            let quants = &p.quants[32 * b..32 * b + 32];
            assert_eq!(p.sums_32[b], quants.iter().map(|&q| q as i32).sum::<i32>());
            assert!(quants.iter().any(|&q| q.abs() == 127));
            for (v, &q) in block.iter().zip(quants) {
                assert!((v - q as f32 * scale).abs() <= 0.5 * scale + 1e-6);
            }
        }
    }

    /// Every weight type's dot product with a prepared input equals the plain f32 dot product of
    /// the dequantized row with [`PreparedInput::dequantized`] (to rounding): what a device that
    /// multiplies f32 activations must be given to compute the CPU's products.
    #[test]
    fn dequantized_activations_give_the_quantized_dot_products() {
        use crate::quant::test_util::{random_row, Rng};
        let mut rng = Rng::new(11);
        for ty in GgmlType::ALL {
            let n = 512;
            let row = random_row(&mut rng, ty, n);
            let mut w = vec![0f32; n];
            crate::quant::dequantize_row(ty, &row, &mut w);
            let x: Vec<f32> = (0..n).map(|_| rng.normal() * 3.0).collect();
            let mut p = PreparedInput::new();
            p.prepare(&x, ty);
            let seen = p.dequantized();
            assert_eq!(seen.len(), n);
            let want: f64 = w.iter().zip(&seen).map(|(&a, &b)| a as f64 * b as f64).sum();
            let scale: f64 = w.iter().zip(&seen).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let got = crate::quant::vec_dot(ty, &row, &p) as f64;
            assert!(
                (got - want).abs() <= 1e-5 * scale,
                "{ty:?}: {got} vs {want} (scale {scale})"
            );
            // Against the unquantized input it differs by the quantization (not for float types).
            let plain: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            if ty.block_elems() > 1 {
                assert!(
                    (plain - want).abs() > 1e-5 * scale,
                    "{ty:?}: quantization changed nothing"
                );
            }
        }
    }

    /// The libm-free roundings equal the standard library's wherever the quantizers use them
    /// (|x| up to a little over 127, ties included) and on the awkward values.
    #[test]
    fn fast_roundings_equal_std() {
        let mut values: Vec<f32> = (-140_000..=140_000).map(|i| i as f32 * 0.001).collect();
        values.extend((-300..=300).map(|i| i as f32 * 0.5));
        values.extend([
            0.49999997,
            -0.49999997,
            0.50000006,
            8388607.5,
            -8388607.5,
            4194303.5,
            4194304.5,
            1e9,
            -1e9,
            3e38,
            -3e38,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            -0.0,
        ]);
        for v in values {
            // The quantizer casts to an integer, so -0.0 and 0.0 (which the trick can swap) agree.
            assert_eq!(round_ties_even(v) as i32, v.round_ties_even() as i32, "{v}");
            assert_eq!(round_half_away(v) as i8, v.round() as i8, "{v}");
        }
        assert!(round_ties_even(f32::NAN).is_nan());
        assert_eq!(round_half_away(f32::NAN) as i8, f32::NAN.round() as i8);
    }

    #[test]
    fn q8_k_matches_ggml_sign_convention_and_sums() {
        let mut x: Vec<f32> = (0..256).map(|i| (i as f32 * 0.37).sin()).collect();
        x[5] = 3.0; // largest magnitude is positive: scale negative, quant of x[5] is -127
        let mut p = PreparedInput::new();
        p.prepare(&x, GgmlType::Q6_K);
        assert!(p.block_scales[0] < 0.0);
        assert_eq!(p.quants[5], -127);
        assert!(p.quants.iter().all(|&q| q >= -127));
        for g in 0..16 {
            let s: i32 = p.quants[16 * g..16 * g + 16].iter().map(|&q| q as i32).sum();
            assert_eq!(i32::from(p.sums_16[g]), s);
        }
        for g in 0..8 {
            let pair = i32::from(p.sums_16[2 * g]) + i32::from(p.sums_16[2 * g + 1]);
            assert_eq!(p.sums_32[g], pair);
        }
        // Equal magnitudes: the first one fixes the sign of the scale, as in ggml's scan.
        let mut tie = vec![0.25f32; 256];
        (tie[9], tie[40]) = (-2.0, 2.0);
        p.prepare(&tie, GgmlType::Q6_K);
        assert!(p.block_scales[0] > 0.0 && p.quants[9] == -127 && p.quants[40] == 127);
        p.prepare(&[0.0; 256], GgmlType::Q4_K);
        assert_eq!((p.block_scales.as_slice(), p.sums_16.len()), ([0.0f32].as_slice(), 16));
        assert!(p.is_prepared_for(GgmlType::Q5_K) && !p.is_prepared_for(GgmlType::Q8_0));
    }
}
