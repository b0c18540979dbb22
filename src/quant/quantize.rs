//! Quantization of weight rows into the block layouts of [`super::layout`]. The 32-element types
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) follow ggml's `quantize_row_*_ref` exactly; the K-quants use a simpler (min/max per sub-block,
//! no error search) but layout-exact scheme, good enough for tests and for converting small
//! models, not a replacement for llama.cpp's `llama-quantize`.

use super::layout::{e8m0_half, pack_k_scales, FP4_VALUES, Q5_K_QS_OFFSET, QK_K, QK_LEGACY};
use super::GgmlType;

/// Quantizes `x` into `out` as one row of `ty`; returns `false` (leaving `out` unspecified) if
/// quantizing to `ty` is not implemented. Panics unless `out.len() == ty.row_bytes(x.len())`.
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut [u8]) -> bool {
    assert_eq!(
        Some(out.len()),
        ty.row_bytes(x.len()),
        "a {} row of {} elements",
        ty.name(),
        x.len()
    );
    let blocks = out.chunks_exact_mut(ty.block_bytes());
    match ty {
        GgmlType::F32 => {
            for (dst, v) in blocks.zip(x) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (dst, &v) in blocks.zip(x) {
                dst.copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (dst, &v) in blocks.zip(x) {
                dst.copy_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        GgmlType::Q4_0 => blocks.zip(x.chunks_exact(QK_LEGACY)).for_each(|(d, v)| q4_0(v, d)),
        GgmlType::Q4_1 => blocks.zip(x.chunks_exact(QK_LEGACY)).for_each(|(d, v)| q4_1(v, d)),
        GgmlType::Q5_0 => blocks.zip(x.chunks_exact(QK_LEGACY)).for_each(|(d, v)| q5_0(v, d)),
        GgmlType::Q8_0 => blocks.zip(x.chunks_exact(QK_LEGACY)).for_each(|(d, v)| q8_0(v, d)),
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let levels_max = if ty == GgmlType::Q4_K { 15 } else { 31 };
            for (dst, v) in blocks.zip(x.chunks_exact(QK_K)) {
                k4_k5(v, levels_max, dst);
            }
        }
        GgmlType::Q6_K => blocks.zip(x.chunks_exact(QK_K)).for_each(|(d, v)| q6_k(v, d)),
        GgmlType::Q5_1 => blocks.zip(x.chunks_exact(QK_LEGACY)).for_each(|(d, v)| q5_1(v, d)),
        GgmlType::MXFP4 => blocks.zip(x.chunks_exact(QK_LEGACY)).for_each(|(d, v)| mxfp4(v, d)),
        // Read and computed with, not written: llama-quantize makes these (the grid types with
        // an importance matrix, see `super::iq`).
        GgmlType::Q2_K
        | GgmlType::Q3_K
        | GgmlType::IQ4_NL
        | GgmlType::IQ4_XS
        | GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ3_XXS
        | GgmlType::IQ3_S
        | GgmlType::IQ1_S
        | GgmlType::IQ1_M => return false,
    }
    true
}

fn f16_bytes(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// The element of largest magnitude, with its sign (ggml's `max` in the `_ref` quantizers).
fn signed_abs_max(x: &[f32]) -> f32 {
    let mut abs_max = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if v.abs() > abs_max {
            abs_max = v.abs();
            max = v;
        }
    }
    max
}

fn inverse_or_zero(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// MXFP4 as ggml's `quantize_row_mxfp4_ref`: the shared E8M0 exponent `e = floor(log2(amax)) -
/// 2 + 127` (so 4 · 2^(e-127) ≤ amax: the largest FP4 magnitude, 6, covers up to 1.5 · 2^floor;
/// larger values clamp to it), each value the nearest of the sixteen FP4 codes times half the
/// scale ([`e8m0_half`], the codes being doubled), the first of equally near ones; all-zero
/// blocks get e = 0. Layout: `e`, then element j in the low nibble of byte j and element j + 16
/// in its high nibble.
fn mxfp4(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    // (ggml casts the float to u8; clamped here where that cast would wrap.)
    let e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8
    } else {
        0
    };
    let d = e8m0_half(e);
    let best = |v: f32| {
        let mut best = (0usize, (f32::from(FP4_VALUES[0]) * d - v).abs());
        for (i, &q) in FP4_VALUES.iter().enumerate().skip(1) {
            let err = (f32::from(q) * d - v).abs();
            if err < best.1 {
                best = (i, err);
            }
        }
        best.0 as u8
    };
    out[0] = e;
    for j in 0..16 {
        out[1 + j] = best(x[j]) | (best(x[j + 16]) << 4);
    }
}

fn q4_0(x: &[f32], out: &mut [u8]) {
    let d = signed_abs_max(x) / -8.0;
    let id = inverse_or_zero(d);
    out[..2].copy_from_slice(&f16_bytes(d));
    for j in 0..16 {
        // ggml truncates toward zero after adding 8.5, then caps at 15.
        let lo = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let hi = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
        out[2 + j] = lo | (hi << 4);
    }
}

fn q4_1(x: &[f32], out: &mut [u8]) {
    let min = x.iter().copied().fold(f32::MAX, f32::min);
    let max = x.iter().copied().fold(-f32::MAX, f32::max);
    let d = (max - min) / 15.0;
    let id = inverse_or_zero(d);
    out[..2].copy_from_slice(&f16_bytes(d));
    out[2..4].copy_from_slice(&f16_bytes(min));
    for j in 0..16 {
        let lo = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
        let hi = (((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
        out[4 + j] = lo | (hi << 4);
    }
}

fn q5_0(x: &[f32], out: &mut [u8]) {
    let d = signed_abs_max(x) / -16.0;
    let id = inverse_or_zero(d);
    out[..2].copy_from_slice(&f16_bytes(d));
    let mut qh = 0u32;
    for j in 0..16 {
        let lo = ((x[j] * id + 16.5) as i8).min(31) as u8;
        let hi = ((x[j + 16] * id + 16.5) as i8).min(31) as u8;
        out[6 + j] = (lo & 0x0f) | ((hi & 0x0f) << 4);
        qh |= u32::from(lo >> 4) << j;
        qh |= u32::from(hi >> 4) << (j + 16);
    }
    out[2..6].copy_from_slice(&qh.to_le_bytes());
}

fn q5_1(x: &[f32], out: &mut [u8]) {
    let min = x.iter().copied().fold(f32::MAX, f32::min);
    let max = x.iter().copied().fold(-f32::MAX, f32::max);
    let d = (max - min) / 31.0;
    let id = inverse_or_zero(d);
    out[..2].copy_from_slice(&f16_bytes(d));
    out[2..4].copy_from_slice(&f16_bytes(min));
    let mut qh = 0u32;
    for j in 0..16 {
        // ggml truncates after adding 0.5 (the values are non-negative).
        let lo = (((x[j] - min) * id + 0.5) as u8).min(31);
        let hi = (((x[j + 16] - min) * id + 0.5) as u8).min(31);
        out[8 + j] = (lo & 0x0f) | ((hi & 0x0f) << 4);
        qh |= u32::from(lo >> 4) << j;
        qh |= u32::from(hi >> 4) << (j + 16);
    }
    out[4..8].copy_from_slice(&qh.to_le_bytes());
}

fn q8_0(x: &[f32], out: &mut [u8]) {
    let abs_max = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = abs_max / 127.0;
    let id = inverse_or_zero(d);
    out[..2].copy_from_slice(&f16_bytes(d));
    for (dst, &v) in out[2..].iter_mut().zip(x) {
        *dst = (v * id).round() as i8 as u8;
    }
}

/// Q4_K (`levels_max` 15) or Q5_K (31): per sub-block of 32, the range [min(0, lo), hi] is split
/// into `levels_max` steps; the steps and the (non-negative) mins are then quantized to 6 bits
/// against the block's largest, and the elements re-quantized against the rounded values.
fn k4_k5(x: &[f32], levels_max: u8, out: &mut [u8]) {
    let mut steps = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    for (s, sub) in x.chunks_exact(32).enumerate() {
        let lo = sub.iter().copied().fold(0.0f32, f32::min);
        let hi = sub.iter().copied().fold(f32::MIN, f32::max);
        steps[s] = (hi - lo).max(0.0) / f32::from(levels_max);
        mins[s] = -lo;
    }
    let d = steps.iter().copied().fold(0.0f32, f32::max) / 63.0;
    let dmin = mins.iter().copied().fold(0.0f32, f32::max) / 63.0;
    // Store d and dmin as f16 first so the 6-bit codes are chosen against the stored values.
    let d_f16 = half::f16::from_f32(d);
    let dmin_f16 = half::f16::from_f32(dmin);
    let (d, dmin) = (d_f16.to_f32(), dmin_f16.to_f32());
    let scale_codes: [u8; 8] = std::array::from_fn(|s| (steps[s] * inverse_or_zero(d)).round().min(63.0) as u8);
    let min_codes: [u8; 8] = std::array::from_fn(|s| (mins[s] * inverse_or_zero(dmin)).round().min(63.0) as u8);
    out[..2].copy_from_slice(&d_f16.to_bits().to_le_bytes());
    out[2..4].copy_from_slice(&dmin_f16.to_bits().to_le_bytes());
    out[4..16].copy_from_slice(&pack_k_scales(&scale_codes, &min_codes));
    // Q5_K puts its 32 bytes of fifth bits before `qs`.
    let qs_offset = if levels_max == 31 { Q5_K_QS_OFFSET } else { 16 };
    out[16..].fill(0);
    for (e, &v) in x.iter().enumerate() {
        let s = e / 32;
        let step = d * f32::from(scale_codes[s]);
        let offset = dmin * f32::from(min_codes[s]);
        let q = ((v + offset) * inverse_or_zero(step))
            .round()
            .clamp(0.0, f32::from(levels_max)) as u8;
        out[qs_offset + 32 * (e / 64) + e % 32] |= (q & 0x0f) << (4 * (s % 2));
        if levels_max == 31 {
            out[16 + e % 32] |= (q >> 4) << s;
        }
    }
}

/// Q6_K: each group of 16 gets a signed step so its largest-magnitude element maps to -32 (as
/// ggml's `make_qx_quants` starts from); steps are quantized to i8 against the block's largest.
fn q6_k(x: &[f32], out: &mut [u8]) {
    let steps: [f32; 16] = std::array::from_fn(|g| signed_abs_max(&x[16 * g..16 * g + 16]) / -32.0);
    let step_max = signed_abs_max(&steps);
    let d_f16 = half::f16::from_f32(step_max / -128.0);
    let d = d_f16.to_f32();
    let id = inverse_or_zero(d);
    let codes: [i8; 16] = std::array::from_fn(|g| (steps[g] * id).round().clamp(-128.0, 127.0) as i8);
    let (ql, rest) = out.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    let (scales, d_bytes) = rest.split_at_mut(16);
    ql.fill(0);
    qh.fill(0);
    for (dst, &c) in scales.iter_mut().zip(&codes) {
        *dst = c as u8;
    }
    d_bytes.copy_from_slice(&d_f16.to_bits().to_le_bytes());
    for (e, &v) in x.iter().enumerate() {
        let step = d * f32::from(codes[e / 16]);
        let q = ((v * inverse_or_zero(step)).round().clamp(-32.0, 31.0) as i32 + 32) as u8;
        let (half, quarter, l) = (e / 128, (e % 128) / 32, e % 32);
        ql[64 * half + l + 32 * (quarter % 2)] |= (q & 0x0f) << (4 * (quarter / 2));
        qh[32 * half + l] |= (q >> 4) << (2 * quarter);
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Rng;
    use super::super::{dequantize_row, GgmlType};
    use super::*;

    /// The types [`quantize_row`] writes.
    const WRITABLE: [GgmlType; 12] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::MXFP4,
    ];

    /// MXFP4 blocks made by hand, as ggml's `quantize_row_mxfp4_ref` makes them: the largest
    /// magnitude 5 gives e = floor(log2 5) - 2 + 127 = 127 (values on the FP4 grid 0, ±0.5 … ±6
    /// times 2^0), each value the nearest code, ties to the first (5 → 4, 0.25 → 0), 7 and more
    /// clamped to 6; element j in the low nibble of byte j, j + 16 in the high one.
    #[test]
    fn mxfp4_blocks_made_by_hand() {
        let mut x = [0f32; 32];
        x[0] = 5.0; // between 4 (code 6) and 6 (code 7): the first, 4
        x[1] = -1.4; // -1.5: code 8 + 3
        x[2] = 0.25; // between 0 and 0.5: 0
        x[3] = 2.6; // 3: code 5
        x[16] = -0.5; // code 9
        x[17] = 0.75; // between 0.5 and 1: 0.5, code 1
        let mut b = [0u8; 17];
        assert!(quantize_row(GgmlType::MXFP4, &x, &mut b));
        assert_eq!(b[0], 127);
        assert_eq!(b[1], 6 | (9 << 4));
        assert_eq!(b[2], 11 | (1 << 4));
        assert_eq!(b[3], 0);
        assert_eq!(b[4], 5);
        assert!(b[5..].iter().all(|&q| q == 0));
        let mut y = [0f32; 32];
        dequantize_row(GgmlType::MXFP4, &b, &mut y);
        assert_eq!(&y[..4], &[4.0, -1.5, 0.0, 3.0]);
        assert_eq!(&y[16..18], &[-0.5, 0.5]);
        // A block whose largest value is 7.9: e = 127 still (floor(log2 7.9) = 2), 7.9 clamps to 6.
        let mut x = [0.1f32; 32];
        x[5] = 7.9;
        assert!(quantize_row(GgmlType::MXFP4, &x, &mut b));
        dequantize_row(GgmlType::MXFP4, &b, &mut y);
        assert_eq!((b[0], y[5], y[0]), (127, 6.0, 0.0));
        // A smaller scale: amax 0.02 gives e = floor(-5.64) - 2 + 127 = 119, steps of 2^-9.
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.00125).collect();
        assert!(quantize_row(GgmlType::MXFP4, &x, &mut b));
        assert_eq!(b[0], 119);
    }

    /// MXFP4 round trip on normal values: each value becomes the nearest of its block's sixteen
    /// (the dequantized codes under its scale), so no code is nearer; the error stays within half
    /// the block's largest magnitude (values past 1.5·2^floor(log2 amax) clamp) and is small on
    /// the whole (relative RMS under 15%: 4-bit floats under a power-of-two scale).
    #[test]
    fn mxfp4_round_trip_is_nearest_and_small() {
        let mut rng = Rng::new(4);
        let x: Vec<f32> = (0..4096).map(|_| rng.normal() * 0.02).collect();
        let mut row = vec![0u8; GgmlType::MXFP4.row_bytes(x.len()).unwrap()];
        assert!(quantize_row(GgmlType::MXFP4, &x, &mut row));
        let mut y = vec![0f32; x.len()];
        dequantize_row(GgmlType::MXFP4, &row, &mut y);
        let (mut se, mut sx) = (0f64, 0f64);
        for (b, block) in row.chunks_exact(17).enumerate() {
            let d = e8m0_half(block[0]);
            let xs = &x[32 * b..32 * (b + 1)];
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (i, &v) in xs.iter().enumerate() {
                let got = y[32 * b + i];
                let err = (got - v).abs();
                let nearest = FP4_VALUES
                    .iter()
                    .map(|&q| (f32::from(q) * d - v).abs())
                    .fold(f32::MAX, f32::min);
                assert_eq!(err, nearest, "block {b} [{i}]: {v} -> {got}");
                assert!(err <= 0.5 * amax, "block {b} [{i}]: {v} -> {got}");
                se += (err as f64).powi(2);
                sx += (v as f64).powi(2);
            }
        }
        let rel = (se / sx).sqrt();
        assert!(rel < 0.15 && rel > 0.01, "relative RMS error {rel}");
    }

    /// Quantize then dequantize: the error of each element is bounded by the type's step size,
    /// measured here relative to the row's largest magnitude.
    #[test]
    fn round_trip_error_is_within_the_step_size() {
        let mut rng = Rng::new(9);
        let bounds = [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 1e-3),
            (GgmlType::BF16, 8e-3),
            (GgmlType::Q8_0, 1.0 / 127.0),
            (GgmlType::Q4_0, 1.0 / 8.0),
            (GgmlType::Q4_1, 1.0 / 15.0),
            (GgmlType::Q5_0, 1.0 / 16.0),
            (GgmlType::Q5_1, 1.0 / 31.0),
            (GgmlType::Q4_K, 2.0 / 15.0),
            (GgmlType::Q5_K, 2.0 / 31.0),
            (GgmlType::Q6_K, 2.0 / 32.0),
        ];
        for (ty, rel_step) in bounds {
            let x: Vec<f32> = (0..512).map(|_| rng.normal()).collect();
            let mut row = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            assert!(quantize_row(ty, &x, &mut row));
            let mut y = vec![0.0f32; x.len()];
            dequantize_row(ty, &row, &mut y);
            for block in 0..x.len() / ty.block_elems().max(32) {
                let range = ty.block_elems().max(32) * block..ty.block_elems().max(32) * (block + 1);
                let scale = x[range.clone()].iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for i in range {
                    let err = (x[i] - y[i]).abs();
                    assert!(err <= rel_step * scale + 1e-6, "{ty:?} [{i}]: {} -> {}", x[i], y[i]);
                }
            }
        }
    }

    #[test]
    fn zero_rows_quantize_to_zero() {
        for ty in GgmlType::ALL {
            let x = vec![0.0f32; 256];
            let mut row = vec![0xa5u8; ty.row_bytes(256).unwrap()];
            if !WRITABLE.contains(&ty) {
                assert!(!quantize_row(ty, &x, &mut row), "{ty:?}");
                continue;
            }
            assert!(quantize_row(ty, &x, &mut row));
            let mut y = vec![1.0f32; 256];
            dequantize_row(ty, &row, &mut y);
            assert!(y.iter().all(|&v| v == 0.0), "{ty:?}");
        }
    }
}
