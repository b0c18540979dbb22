//! The scalar reference dot products. Each quantized type computes, per block, one exact integer
//! (or two, for types with a min term) from the weight quants and the activation quants, and
//! scales it in `f32`; the SIMD kernels in [`super::x86`] compute the same integers and must agree
//! with these up to the order of the float summation.

use super::iq;
use super::layout::{
    e8m0_half, iq4_xs_scale, q2_k_quant, q3_k_quant, q3_k_scale, read_f16, unpack_k_scales, FP4_VALUES, IQ4_VALUES,
    IQ4_XS_QS_OFFSET, Q2_K_D_OFFSET, Q2_K_QS_OFFSET, Q3_K_D_OFFSET, Q3_K_QS_OFFSET, Q3_K_SCALES_OFFSET, Q5_K_QS_OFFSET,
    Q6_K_D_OFFSET, Q6_K_QH_OFFSET, Q6_K_SCALES_OFFSET, QK_K, QK_LEGACY,
};
use super::prepare::ActivationFormat;
use super::{bf16_to_f32, f16_to_f32, GgmlType, PreparedInput};

/// `dot(row, x)` computed one element at a time. Panics if `row` is not one row of `ty` with
/// `x.len()` elements or `x` was prepared for an incompatible weight type.
pub fn vec_dot_scalar(ty: GgmlType, row: &[u8], x: &PreparedInput) -> f32 {
    super::check_rows(ty, row, x, 1);
    debug_assert_eq!(
        ActivationFormat::for_weights(ty),
        ActivationFormat::for_weights(x.weight_type())
    );
    let blocks = row.chunks_exact(ty.block_bytes());
    match ty {
        GgmlType::F32 => blocks
            .zip(&x.values_f32)
            .map(|(w, &v)| f32::from_le_bytes(w.try_into().unwrap()) * v)
            .sum(),
        GgmlType::F16 => blocks
            .zip(&x.values_f32)
            .map(|(w, &v)| f16_to_f32(u16::from_le_bytes([w[0], w[1]])) * v)
            .sum(),
        GgmlType::BF16 => blocks
            .zip(&x.values_f32)
            .map(|(w, &v)| bf16_to_f32(u16::from_le_bytes([w[0], w[1]])) * v)
            .sum(),
        GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::Q8_0
        | GgmlType::IQ4_NL
        | GgmlType::MXFP4 => {
            let mut sum = 0.0f32;
            for (b, block) in blocks.enumerate() {
                let quants = &x.quants[QK_LEGACY * b..QK_LEGACY * (b + 1)];
                let scaled_sum = x.scale_and_scaled_sum[2 * b + 1];
                sum += legacy_block_dot(ty, block, quants, x.block_scales[b], x.sums_32[b], scaled_sum);
            }
            sum
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let mut sum = 0.0f32;
            for (b, block) in blocks.enumerate() {
                let quants = &x.quants[QK_K * b..QK_K * (b + 1)];
                let sums_32 = &x.sums_32[8 * b..8 * (b + 1)];
                sum += k4_k5_block_dot(ty, block, quants, x.block_scales[b], sums_32);
            }
            sum
        }
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q6_K => {
            let block_dot = match ty {
                GgmlType::Q2_K => q2_k_block_dot,
                GgmlType::Q3_K => q3_k_block_dot,
                _ => q6_k_block_dot,
            };
            let mut sum = 0.0f32;
            for (b, block) in blocks.enumerate() {
                let quants = &x.quants[QK_K * b..QK_K * (b + 1)];
                let sums_16 = &x.sums_16[16 * b..16 * (b + 1)];
                sum += block_dot(block, quants, x.block_scales[b], sums_16);
            }
            sum
        }
        GgmlType::IQ4_XS => {
            let mut sum = 0.0f32;
            for (b, block) in blocks.enumerate() {
                let quants = &x.quants[QK_K * b..QK_K * (b + 1)];
                sum += iq4_xs_block_dot(block, quants, x.block_scales[b]);
            }
            sum
        }
        GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ3_XXS
        | GgmlType::IQ3_S
        | GgmlType::IQ1_S
        | GgmlType::IQ1_M => {
            // The grid types: one exact integer per block (`iq`), scaled in f32 block by block.
            let mult = iq::mult(ty);
            let mut sum = 0.0f32;
            for (b, block) in blocks.enumerate() {
                let quants = &x.quants[QK_K * b..QK_K * (b + 1)];
                let integer = iq::block_integer(ty, block, quants);
                sum += iq::block_value(iq::block_d(ty, block), x.block_scales[b], integer, mult);
            }
            sum
        }
    }
}

/// One 32-element block. The weight quant `q` is taken unsigned (as stored) and its offset
/// (8 for Q4_0, 16 for Q5_0) is subtracted through the activation sum, which is how the SIMD
/// kernels do it too: `sum((q - k) * y) = sum(q * y) - k * sum(y)`. Q4_1's min term uses the
/// prepared `y_scale * y_sum` (ggml's `s` of `block_q8_1`).
fn legacy_block_dot(ty: GgmlType, block: &[u8], y: &[i8], y_scale: f32, y_sum: i32, y_scaled_sum: f32) -> f32 {
    if ty == GgmlType::MXFP4 {
        // No f16 scale: a power of two times the doubled FP4 values (ggml's order of products).
        let qy = table_dot(&FP4_VALUES, &block[1..17], y);
        return y_scale * e8m0_half(block[0]) * qy as f32;
    }
    let d = read_f16(block, 0) * y_scale;
    match ty {
        GgmlType::Q4_0 => {
            let qy = nibble_dot(&block[2..18], y);
            d * (qy - 8 * y_sum) as f32
        }
        GgmlType::Q4_1 => {
            let qy = nibble_dot(&block[4..20], y);
            d * qy as f32 + read_f16(block, 2) * y_scaled_sum
        }
        GgmlType::Q5_0 => {
            let qh = u32::from_le_bytes(block[2..6].try_into().unwrap());
            d * (five_bit_dot(qh, &block[6..22], y) - 16 * y_sum) as f32
        }
        GgmlType::Q5_1 => {
            let qh = u32::from_le_bytes(block[4..8].try_into().unwrap());
            d * five_bit_dot(qh, &block[8..24], y) as f32 + read_f16(block, 2) * y_scaled_sum
        }
        GgmlType::IQ4_NL => d * table_dot(&IQ4_VALUES, &block[2..18], y) as f32,
        GgmlType::Q8_0 => {
            let qy: i32 = block[2..34]
                .iter()
                .zip(y)
                .map(|(&q, &v)| i32::from(q as i8) * i32::from(v))
                .sum();
            d * qy as f32
        }
        _ => unreachable!("{ty:?} is not a 32-element type"),
    }
}

/// `sum(q * y)` over 32 elements whose unsigned 4-bit quants are packed low-then-high.
fn nibble_dot(qs: &[u8], y: &[i8]) -> i32 {
    qs.iter()
        .enumerate()
        .map(|(j, &byte)| i32::from(byte & 0x0f) * i32::from(y[j]) + i32::from(byte >> 4) * i32::from(y[j + 16]))
        .sum()
}

/// `sum(q * y)` over 32 elements of unsigned 5-bit quants: Q5_0/Q5_1 nibbles, fifth bit `e`
/// of `qh`.
fn five_bit_dot(qh: u32, qs: &[u8], y: &[i8]) -> i32 {
    let mut qy = 0i32;
    for (j, &byte) in qs.iter().enumerate() {
        let lo = (byte & 0x0f) as u32 | (((qh >> j) & 1) << 4);
        let hi = (byte >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
        qy += lo as i32 * i32::from(y[j]) + hi as i32 * i32::from(y[j + 16]);
    }
    qy
}

/// `sum(table[q] * y)` over 32 elements whose 4-bit indices are packed low-then-high.
fn table_dot(table: &[i8; 16], qs: &[u8], y: &[i8]) -> i32 {
    qs.iter()
        .enumerate()
        .map(|(j, &byte)| {
            let lo = i32::from(table[usize::from(byte & 0x0f)]);
            let hi = i32::from(table[usize::from(byte >> 4)]);
            lo * i32::from(y[j]) + hi * i32::from(y[j + 16])
        })
        .sum()
}

/// One Q2_K super-block: `d * sum_g(sc[g] * sum(q * y)) - dmin * sum_g(m[g] * sum(y))` over the
/// 16 groups of 16, with `sc[g]`, `m[g]` the nibbles of `scales[g]`.
fn q2_k_block_dot(block: &[u8], y: &[i8], y_scale: f32, sums_16: &[i16]) -> f32 {
    let d = read_f16(block, Q2_K_D_OFFSET) * y_scale;
    let dmin = read_f16(block, Q2_K_D_OFFSET + 2) * y_scale;
    let qs = &block[Q2_K_QS_OFFSET..Q2_K_D_OFFSET];
    let mut group_qy = [0i32; 16];
    for (e, &v) in y.iter().enumerate() {
        group_qy[e / 16] += i32::from(q2_k_quant(e, qs)) * i32::from(v);
    }
    let mut scaled_qy = 0i32;
    let mut scaled_mins = 0i32;
    for g in 0..16 {
        scaled_qy += i32::from(block[g] & 0x0f) * group_qy[g];
        scaled_mins += i32::from(block[g] >> 4) * i32::from(sums_16[g]);
    }
    d * scaled_qy as f32 - dmin * scaled_mins as f32
}

/// One Q3_K super-block: `d * sum_g(sc[g] * (sum(q * y) - 4 * sum(y)))` over the 16 groups of
/// 16, `q` the unsigned 3-bit quant and `sc[g]` the signed scale.
fn q3_k_block_dot(block: &[u8], y: &[i8], y_scale: f32, sums_16: &[i16]) -> f32 {
    let d = read_f16(block, Q3_K_D_OFFSET) * y_scale;
    let hmask = &block[..Q3_K_QS_OFFSET];
    let qs = &block[Q3_K_QS_OFFSET..Q3_K_SCALES_OFFSET];
    let packed = &block[Q3_K_SCALES_OFFSET..Q3_K_D_OFFSET];
    let mut group_qy = [0i32; 16];
    for (e, &v) in y.iter().enumerate() {
        group_qy[e / 16] += i32::from(q3_k_quant(e, hmask, qs)) * i32::from(v);
    }
    let total: i32 = (0..16)
        .map(|g| i32::from(q3_k_scale(g, packed)) * (group_qy[g] - 4 * i32::from(sums_16[g])))
        .sum();
    d * total as f32
}

/// One IQ4_XS super-block: `d * sum_s((sc[s] - 32) * sum(IQ4_VALUES[q] * y))` over the eight
/// sub-blocks of 32.
fn iq4_xs_block_dot(block: &[u8], y: &[i8], y_scale: f32) -> f32 {
    let d = read_f16(block, 0) * y_scale;
    let scales_h = u16::from_le_bytes([block[2], block[3]]);
    let total: i32 = block[IQ4_XS_QS_OFFSET..]
        .chunks_exact(16)
        .zip(y.chunks_exact(32))
        .enumerate()
        .map(|(s, (qs, y))| {
            let scale = i32::from(iq4_xs_scale(s, scales_h, &block[4..8])) - 32;
            scale * table_dot(&IQ4_VALUES, qs, y)
        })
        .sum();
    d * total as f32
}

/// One Q4_K/Q5_K super-block: `d * sum_s(sc[s] * sum(q * y)) - dmin * sum_s(m[s] * sum(y))`.
fn k4_k5_block_dot(ty: GgmlType, block: &[u8], y: &[i8], y_scale: f32, sums_32: &[i32]) -> f32 {
    let d = read_f16(block, 0) * y_scale;
    let dmin = read_f16(block, 2) * y_scale;
    let (scales, mins) = unpack_k_scales(&block[4..16]);
    let (qh, qs) = if ty == GgmlType::Q5_K {
        (Some(&block[16..48]), &block[Q5_K_QS_OFFSET..])
    } else {
        (None, &block[16..])
    };
    let mut scaled_qy = 0i32;
    let mut scaled_mins = 0i32;
    for s in 0..8 {
        let mut qy = 0i32;
        for l in 0..32 {
            let byte = qs[32 * (s / 2) + l];
            let mut q = if s % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            if let Some(qh) = qh {
                q |= ((qh[l] >> s) & 1) << 4;
            }
            qy += i32::from(q) * i32::from(y[32 * s + l]);
        }
        scaled_qy += i32::from(scales[s]) * qy;
        scaled_mins += i32::from(mins[s]) * sums_32[s];
    }
    d * scaled_qy as f32 - dmin * scaled_mins as f32
}

/// One Q6_K super-block: `d * sum_g(sc[g] * (sum(q * y) - 32 * sum(y)))` over groups of 16.
fn q6_k_block_dot(block: &[u8], y: &[i8], y_scale: f32, sums_16: &[i16]) -> f32 {
    let d = read_f16(block, Q6_K_D_OFFSET) * y_scale;
    let ql = &block[..Q6_K_QH_OFFSET];
    let qh = &block[Q6_K_QH_OFFSET..Q6_K_SCALES_OFFSET];
    let scales = &block[Q6_K_SCALES_OFFSET..Q6_K_D_OFFSET];
    let mut group_qy = [0i32; 16];
    for (e, &v) in y.iter().enumerate() {
        let (half, quarter, l) = (e / 128, (e % 128) / 32, e % 32);
        let low_byte = ql[64 * half + l + 32 * (quarter % 2)];
        let low = if quarter < 2 { low_byte & 0x0f } else { low_byte >> 4 };
        let high = (qh[32 * half + l] >> (2 * quarter)) & 3;
        group_qy[e / 16] += i32::from(low | (high << 4)) * i32::from(v);
    }
    let total: i32 = (0..16)
        .map(|g| i32::from(scales[g] as i8) * (group_qy[g] - 32 * i32::from(sums_16[g])))
        .sum();
    d * total as f32
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{dequantized_activations, random_row, Rng};
    use super::super::{dequantize_row, quantize_row};
    use super::*;

    /// The quantized dot product must equal the dot of the dequantized row with the dequantized
    /// activations; against the raw `f32` activations it differs only by activation rounding.
    #[test]
    fn scalar_dot_matches_dequantized_dot() {
        let mut rng = Rng::new(11);
        for ty in GgmlType::ALL {
            for n_elems in [256, 1536] {
                let x: Vec<f32> = (0..n_elems).map(|_| rng.normal()).collect();
                let row = random_row(&mut rng, ty, n_elems);
                let mut w = vec![0.0f32; n_elems];
                dequantize_row(ty, &row, &mut w);
                let mut p = PreparedInput::new();
                p.prepare(&x, ty);
                let got = vec_dot_scalar(ty, &row, &p) as f64;

                let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                let abs_sum: f64 = w.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                // Activation rounding is at most half a step of 1/127 of each block's max.
                let tol = if ty.block_elems() == 1 { 1e-5 } else { 1.5e-2 } * abs_sum + 1e-6;
                assert!((got - exact).abs() <= tol, "{ty:?} n={n_elems}: {got} vs {exact}");

                if ty.block_elems() > 1 {
                    // With the activations dequantized too, only float rounding remains.
                    let y = dequantized_activations(&p);
                    let exact_q: f64 = w.iter().zip(&y).map(|(&a, &b)| a as f64 * b as f64).sum();
                    assert!(
                        (got - exact_q).abs() <= 1e-5 * abs_sum + 1e-6,
                        "{ty:?} n={n_elems}: {got} vs {exact_q}"
                    );
                }
            }
        }
    }

    #[test]
    fn q8_0_row_dotted_with_itself_is_close_to_the_squared_norm() {
        let mut rng = Rng::new(5);
        let x: Vec<f32> = (0..1024).map(|_| rng.normal()).collect();
        let mut row = vec![0u8; GgmlType::Q8_0.row_bytes(1024).unwrap()];
        assert!(quantize_row(GgmlType::Q8_0, &x, &mut row));
        let mut p = PreparedInput::new();
        p.prepare(&x, GgmlType::Q8_0);
        let norm2: f32 = x.iter().map(|v| v * v).sum();
        let got = vec_dot_scalar(GgmlType::Q8_0, &row, &p);
        assert!((got - norm2).abs() < 1e-3 * norm2, "{got} vs {norm2}");
    }
}
