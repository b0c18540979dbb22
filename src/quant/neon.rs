//! The NEON kernels (aarch64: every such CPU has NEON, Apple's M chips among them) for the types
//! most models are made of: Q4_0, Q8_0, Q4_K and Q6_K. Each computes the scalar reference's
//! integers (one per block or group, [`super::scalar`]) sixteen lanes at a time — signed 8-bit
//! products widened to 16 bits (`smull`), added pairwise into 32-bit lanes (`sadalp`) — and
//! scales them in `f32` exactly as the scalar code does, in its order: the same bits. Other
//! types take the scalar path.

use std::arch::aarch64::*;

use super::layout::{read_f16, unpack_k_scales, Q6_K_D_OFFSET, Q6_K_QH_OFFSET, Q6_K_SCALES_OFFSET, QK_K, QK_LEGACY};
use super::scalar::vec_dot_scalar;
use super::{GgmlType, PreparedInput};

/// Whether [`vec_dot_rows`] has a NEON kernel for rows of `ty` (else it runs the scalar one).
#[cfg(test)]
fn has_kernel(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q6_K)
}

/// `out[i] = dot(row i, x)`, rows of `row_bytes` (checked by the caller).
pub(super) fn vec_dot_rows(ty: GgmlType, rows: &[u8], row_bytes: usize, x: &PreparedInput, out: &mut [f32]) {
    for (row, dst) in rows.chunks_exact(row_bytes).zip(out.iter_mut()) {
        // SAFETY: NEON is part of every aarch64 target (the `neon` feature is on by default);
        // each kernel reads whole blocks of `row` and the matching quants of `x`, whose lengths
        // `check_rows` matched to the row.
        *dst = unsafe {
            match ty {
                GgmlType::Q4_0 | GgmlType::Q8_0 => legacy(ty, row, x),
                GgmlType::Q4_K => q4_k(row, x),
                GgmlType::Q6_K => q6_k(row, x),
                _ => vec_dot_scalar(ty, row, x),
            }
        };
    }
}

/// `acc + Σ a[i] · b[i]` over 16 signed bytes, in four 32-bit lanes.
#[inline(always)]
unsafe fn dot16(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    let hi = vmull_high_s8(a, b);
    vpadalq_s16(vpadalq_s16(acc, lo), hi)
}

/// 16 activation quants from `y[at..]`.
#[inline(always)]
unsafe fn load_y(y: &[i8], at: usize) -> int8x16_t {
    debug_assert!(at + 16 <= y.len());
    vld1q_s8(y.as_ptr().add(at))
}

/// 16 bytes from `b[at..]`.
#[inline(always)]
unsafe fn load_u8(b: &[u8], at: usize) -> uint8x16_t {
    debug_assert!(at + 16 <= b.len());
    vld1q_u8(b.as_ptr().add(at))
}

/// Q4_0 and Q8_0 rows: blocks of 32 (`legacy_block_dot`'s integers and scaling).
unsafe fn legacy(ty: GgmlType, row: &[u8], x: &PreparedInput) -> f32 {
    let mut sum = 0.0f32;
    for (b, block) in row.chunks_exact(ty.block_bytes()).enumerate() {
        let y = &x.quants[QK_LEGACY * b..QK_LEGACY * (b + 1)];
        let d = read_f16(block, 0) * x.block_scales[b];
        let zero = vdupq_n_s32(0);
        sum += match ty {
            GgmlType::Q4_0 => {
                let qs = load_u8(block, 2);
                let lo = vreinterpretq_s8_u8(vandq_u8(qs, vdupq_n_u8(0x0f)));
                let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(qs));
                let qy = vaddvq_s32(dot16(dot16(zero, lo, load_y(y, 0)), hi, load_y(y, 16)));
                d * (qy - 8 * x.sums_32[b]) as f32
            }
            _ => {
                let w0 = vreinterpretq_s8_u8(load_u8(block, 2));
                let w1 = vreinterpretq_s8_u8(load_u8(block, 18));
                let qy = vaddvq_s32(dot16(dot16(zero, w0, load_y(y, 0)), w1, load_y(y, 16)));
                d * qy as f32
            }
        };
    }
    sum
}

/// Q4_K rows (`k4_k5_block_dot`): per super-block, eight sub-blocks of 32 4-bit quants, the
/// low nibbles of 32 bytes then their high nibbles.
unsafe fn q4_k(row: &[u8], x: &PreparedInput) -> f32 {
    let mut sum = 0.0f32;
    for (b, block) in row.chunks_exact(GgmlType::Q4_K.block_bytes()).enumerate() {
        let y = &x.quants[QK_K * b..QK_K * (b + 1)];
        let sums_32 = &x.sums_32[8 * b..8 * (b + 1)];
        let d = read_f16(block, 0) * x.block_scales[b];
        let dmin = read_f16(block, 2) * x.block_scales[b];
        let (scales, mins) = unpack_k_scales(&block[4..16]);
        let qs = &block[16..];
        let (mut scaled_qy, mut scaled_mins) = (0i32, 0i32);
        for pair in 0..4 {
            let (q0, q1) = (load_u8(qs, 32 * pair), load_u8(qs, 32 * pair + 16));
            let mask = vdupq_n_u8(0x0f);
            let zero = vdupq_n_s32(0);
            let (s, t) = (2 * pair, 2 * pair + 1);
            let lo = dot16(
                dot16(zero, vreinterpretq_s8_u8(vandq_u8(q0, mask)), load_y(y, 32 * s)),
                vreinterpretq_s8_u8(vandq_u8(q1, mask)),
                load_y(y, 32 * s + 16),
            );
            let hi = dot16(
                dot16(zero, vreinterpretq_s8_u8(vshrq_n_u8::<4>(q0)), load_y(y, 32 * t)),
                vreinterpretq_s8_u8(vshrq_n_u8::<4>(q1)),
                load_y(y, 32 * t + 16),
            );
            scaled_qy += i32::from(scales[s]) * vaddvq_s32(lo);
            scaled_mins += i32::from(mins[s]) * sums_32[s];
            scaled_qy += i32::from(scales[t]) * vaddvq_s32(hi);
            scaled_mins += i32::from(mins[t]) * sums_32[t];
        }
        sum += d * scaled_qy as f32 - dmin * scaled_mins as f32;
    }
    sum
}

/// Q6_K rows (`q6_k_block_dot`): per super-block, 16 groups of 16 6-bit quants, each the low
/// or high nibble of a `ql` byte and two bits of a `qh` byte.
unsafe fn q6_k(row: &[u8], x: &PreparedInput) -> f32 {
    let mut sum = 0.0f32;
    for (b, block) in row.chunks_exact(GgmlType::Q6_K.block_bytes()).enumerate() {
        let y = &x.quants[QK_K * b..QK_K * (b + 1)];
        let sums_16 = &x.sums_16[16 * b..16 * (b + 1)];
        let d = read_f16(block, Q6_K_D_OFFSET) * x.block_scales[b];
        let ql = &block[..Q6_K_QH_OFFSET];
        let qh = &block[Q6_K_QH_OFFSET..Q6_K_SCALES_OFFSET];
        let scales = &block[Q6_K_SCALES_OFFSET..Q6_K_D_OFFSET];
        let mut total = 0i32;
        for g in 0..16 {
            // Group g: elements 16g..16g + 16, all in one half, quarter and run of l.
            let e = 16 * g;
            let (half, quarter, l) = (e / 128, (e % 128) / 32, e % 32);
            let low_bytes = load_u8(ql, 64 * half + l + 32 * (quarter % 2));
            let low = match quarter < 2 {
                true => vandq_u8(low_bytes, vdupq_n_u8(0x0f)),
                false => vshrq_n_u8::<4>(low_bytes),
            };
            let h = load_u8(qh, 32 * half + l);
            let high = match quarter {
                0 => vandq_u8(h, vdupq_n_u8(3)),
                1 => vandq_u8(vshrq_n_u8::<2>(h), vdupq_n_u8(3)),
                2 => vandq_u8(vshrq_n_u8::<4>(h), vdupq_n_u8(3)),
                _ => vshrq_n_u8::<6>(h),
            };
            let q = vreinterpretq_s8_u8(vorrq_u8(low, vshlq_n_u8::<4>(high)));
            let qy = vaddvq_s32(dot16(vdupq_n_s32(0), q, load_y(y, e)));
            total += i32::from(scales[g] as i8) * (qy - 32 * i32::from(sums_16[g]));
        }
        sum += d * total as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{random_row, Rng};
    use super::*;

    /// Each NEON kernel against the scalar reference: the same bits (the same integers, scaled
    /// and summed in the same order), on one block, odd block counts and the model widths 1536
    /// and 8960; every other type through the scalar path.
    #[test]
    fn neon_kernels_are_the_scalar_bits() {
        let mut rng = Rng::new(7);
        let mut checked = 0;
        for ty in GgmlType::ALL {
            let block = ty.block_elems().max(32);
            for n_elems in [block, 3 * block, 1536, 8960] {
                if ty.row_bytes(n_elems).is_none() {
                    continue;
                }
                let x: Vec<f32> = (0..n_elems).map(|_| rng.normal()).collect();
                let mut prepared = PreparedInput::new();
                prepared.prepare(&x, ty);
                let n_rows = 3;
                let rows: Vec<u8> = (0..n_rows).flat_map(|_| random_row(&mut rng, ty, n_elems)).collect();
                let row_bytes = ty.row_bytes(n_elems).unwrap();
                let mut out = vec![f32::NAN; n_rows];
                vec_dot_rows(ty, &rows, row_bytes, &prepared, &mut out);
                for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
                    let want = vec_dot_scalar(ty, row, &prepared);
                    assert_eq!(
                        out[r].to_bits(),
                        want.to_bits(),
                        "{ty:?} x {n_elems}, row {r}: {} vs {want}",
                        out[r]
                    );
                }
                checked += usize::from(has_kernel(ty));
            }
        }
        assert_eq!(checked, 4 * 4, "every NEON kernel at every width");
    }
}
