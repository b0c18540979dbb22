//! SIMD dot products of the types read from smaller files: Q2_K, Q3_K and IQ4_XS against Q8_K
//! activations, Q5_1, IQ4_NL and MXFP4 against the blocks of 32. Built like [`super::kquants`]
//! and [`super::legacy`]: per block the integers of the scalar reference ([`super::super::scalar`])
//! are computed exactly in vector lanes, then scaled once in `f32`; a tile of `NT` tokens
//! unpacks each block once and runs each token through the instructions of `NT == 1`, so tiles
//! are bit-identical to per-token calls.
//!
//! The table types (IQ4_NL, IQ4_XS, MXFP4) look their 4-bit indices up with one byte shuffle
//! and multiply signed by signed as `|w| * (sign(w) * y)`, as the Q8_0 kernel does.
//!
//! Saturation (`vpmaddubsw` pairs must fit in i16): Q2_K quants are at most 3, Q3_K's 7 and
//! Q5_1's 31, against activations of at most 127; the tables' magnitudes are at most 127, so a
//! pair is at most 2 * 127 * 127 = 32258 < 32767. Every scaled block sum fits in i32 (at most
//! 256 * 127 * 127 * 32 for IQ4_XS).

use std::arch::x86_64::*;

use super::super::layout::{
    FP4_VALUES, IQ4_VALUES, IQ4_XS_BLOCK_BYTES, IQ4_XS_QS_OFFSET, Q2_K_BLOCK_BYTES, Q2_K_D_OFFSET, Q2_K_QS_OFFSET,
    Q3_K_BLOCK_BYTES, Q3_K_D_OFFSET, Q3_K_QS_OFFSET, Q3_K_SCALES_OFFSET,
};
use super::super::PreparedInput;
use super::kquants::{load_y, scales_i16};
use super::legacy::unpack_nibbles;
use super::{prefetch_block, read_f16, sum_blocks, ByteDot};

const Q5_1_BYTES: usize = 24;
const IQ4_NL_BYTES: usize = 18;
const MXFP4_BYTES: usize = 17;

/// A 16-entry signed byte table in both 128-bit halves, for `vpshufb` lookups.
#[inline(always)]
unsafe fn table(values: &[i8; 16]) -> __m256i {
    _mm256_broadcastsi128_si256(_mm_loadu_si128(values.as_ptr() as *const __m128i))
}

/// Q8_K group-of-16 sums of block `b` (16 i16).
#[inline(always)]
unsafe fn sums_16(x: &PreparedInput, b: usize) -> __m256i {
    _mm256_loadu_si256(x.sums_16.as_ptr().add(16 * b) as *const __m256i)
}

/// Q2_K: `d * sum_g(sc[g] * sum(q * y)) - dmin * sum_g(m[g] * sum_16(y)[g])`.
#[inline(always)]
pub(super) unsafe fn dot_q2_k<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    let three = _mm256_set1_epi8(3);
    let low_nibbles = _mm_set1_epi8(0x0f);
    sum_blocks!(NT, xs[0].len() / 256, |b, acc| {
        let block = row.add(b * Q2_K_BLOCK_BYTES);
        prefetch_block::<NT, Q2_K_BLOCK_BYTES>(block);
        let d_w = read_f16(block.add(Q2_K_D_OFFSET));
        let dmin_w = read_f16(block.add(Q2_K_D_OFFSET + 2));
        let packed_scales = _mm_loadu_si128(block as *const __m128i);
        let scales: [u8; 16] = std::mem::transmute(_mm_and_si128(packed_scales, low_nibbles));
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed_scales), low_nibbles));
        let mut qy = [_mm256_setzero_si256(); NT];
        for half in 0..2 {
            let packed = _mm256_loadu_si256(block.add(Q2_K_QS_OFFSET + 32 * half) as *const __m256i);
            let quarters = [
                _mm256_and_si256(packed, three),
                _mm256_and_si256(_mm256_srli_epi16::<2>(packed), three),
                _mm256_and_si256(_mm256_srli_epi16::<4>(packed), three),
                _mm256_and_si256(_mm256_srli_epi16::<6>(packed), three),
            ];
            for (quarter, q) in quarters.into_iter().enumerate() {
                let group = 8 * half + 2 * quarter;
                let sc = scales_i16(scales[group] as i16, scales[group + 1] as i16);
                for t in 0..NT {
                    let y = load_y(xs[t], 256 * b + 128 * half + 32 * quarter);
                    qy[t] = D::dot_scaled(qy[t], q, y, sc);
                }
            }
        }
        for t in 0..NT {
            let y_scale = *xs[t].block_scales.get_unchecked(b);
            let (d, dmin) = (d_w * y_scale, dmin_w * y_scale);
            let min_sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, sums_16(xs[t], b)));
            let scaled = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(qy[t]));
            acc[t] = _mm256_add_ps(acc[t], _mm256_fnmadd_ps(_mm256_set1_ps(dmin), min_sum, scaled));
        }
    })
}

/// Q3_K's sixteen signed scales (6-bit values minus 32) from its 12 packed bytes, with
/// word-wide masks as ggml unpacks them; equal to [`super::super::layout::q3_k_scale`] for each.
#[inline(always)]
pub(super) fn unpack_q3_k_scales(packed: &[u8; 12]) -> [i8; 16] {
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes(packed[4 * i..4 * i + 4].try_into().unwrap());
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let words = [
        (w0 & LOW4) | ((w2 & LOW2) << 4),
        (w1 & LOW4) | (((w2 >> 2) & LOW2) << 4),
        ((w0 >> 4) & LOW4) | (((w2 >> 4) & LOW2) << 4),
        ((w1 >> 4) & LOW4) | (((w2 >> 6) & LOW2) << 4),
    ];
    let mut scales = [0i8; 16];
    for (i, w) in words.iter().enumerate() {
        for (j, byte) in w.to_le_bytes().into_iter().enumerate() {
            scales[4 * i + j] = byte as i8 - 32;
        }
    }
    scales
}

/// Q3_K: `d * sum_g(sc[g] * (sum(q * y) - 4 * sum_16(y)[g]))` with `q` the unsigned 3-bit quant
/// (two bits from `qs`, the third from `hmask`).
#[inline(always)]
pub(super) unsafe fn dot_q3_k<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    let three = _mm256_set1_epi8(3);
    let four = _mm256_set1_epi8(4);
    sum_blocks!(NT, xs[0].len() / 256, |b, acc| {
        let block = row.add(b * Q3_K_BLOCK_BYTES);
        prefetch_block::<NT, Q3_K_BLOCK_BYTES>(block);
        let d_w = read_f16(block.add(Q3_K_D_OFFSET));
        let scales = unpack_q3_k_scales(&*(block.add(Q3_K_SCALES_OFFSET) as *const [u8; 12]));
        let hmask = _mm256_loadu_si256(block as *const __m256i);
        let mut qy = [_mm256_setzero_si256(); NT];
        for half in 0..2 {
            let packed = _mm256_loadu_si256(block.add(Q3_K_QS_OFFSET + 32 * half) as *const __m256i);
            let low = [
                _mm256_and_si256(packed, three),
                _mm256_and_si256(_mm256_srli_epi16::<2>(packed), three),
                _mm256_and_si256(_mm256_srli_epi16::<4>(packed), three),
                _mm256_and_si256(_mm256_srli_epi16::<6>(packed), three),
            ];
            for (quarter, low) in low.into_iter().enumerate() {
                // Bit 4 half + quarter of each hmask byte, as 4 or 0.
                let bit = _mm256_set1_epi8((1u8 << (4 * half + quarter)) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), bit);
                let q = _mm256_or_si256(low, _mm256_and_si256(set, four));
                let group = 8 * half + 2 * quarter;
                let sc = scales_i16(scales[group] as i16, scales[group + 1] as i16);
                for t in 0..NT {
                    let y = load_y(xs[t], 256 * b + 128 * half + 32 * quarter);
                    qy[t] = D::dot_scaled(qy[t], q, y, sc);
                }
            }
        }
        // 4 * sum_g(sc[g] * sum_16(y)[g]), with i16 madd (|sc * sum| <= 32 * 2032).
        let sc_i16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(scales.as_ptr() as *const __m128i));
        for t in 0..NT {
            let d = d_w * *xs[t].block_scales.get_unchecked(b);
            let offset = _mm256_slli_epi32::<2>(_mm256_madd_epi16(sc_i16, sums_16(xs[t], b)));
            let qy = _mm256_sub_epi32(qy[t], offset);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(qy), acc[t]);
        }
    })
}

/// IQ4_XS: `d * sum_s((sc[s] - 32) * sum(IQ4_VALUES[q] * y))` over the eight sub-blocks of 32.
#[inline(always)]
pub(super) unsafe fn dot_iq4_xs<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    let values = table(&IQ4_VALUES);
    sum_blocks!(NT, xs[0].len() / 256, |b, acc| {
        let block = row.add(b * IQ4_XS_BLOCK_BYTES);
        prefetch_block::<NT, IQ4_XS_BLOCK_BYTES>(block);
        let d_w = read_f16(block);
        let scales_h = std::ptr::read_unaligned(block.add(2) as *const u16);
        let scales_l = std::ptr::read_unaligned(block.add(4) as *const u32);
        let mut qy = [_mm256_setzero_si256(); NT];
        for s in 0..8 {
            let w = _mm256_shuffle_epi8(values, unpack_nibbles(block.add(IQ4_XS_QS_OFFSET + 16 * s)));
            let w_abs = _mm256_abs_epi8(w);
            let ls = ((scales_l >> (4 * s)) & 0x0f) as i16 | ((((scales_h >> (2 * s)) & 3) as i16) << 4);
            let sc = _mm256_set1_epi16(ls - 32);
            for t in 0..NT {
                let y = _mm256_sign_epi8(load_y(xs[t], 256 * b + 32 * s), w);
                qy[t] = D::dot_scaled(qy[t], w_abs, y, sc);
            }
        }
        for t in 0..NT {
            let d = d_w * *xs[t].block_scales.get_unchecked(b);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(qy[t]), acc[t]);
        }
    })
}

/// Q5_1: `d * sum(q * y) + m * sum(y)` with `q = nibble | fifth_bit << 4`; `[d, m]` times the
/// prepared `[y_scale, y_scale * sum(y)]` as in Q4_1's kernel.
#[inline(always)]
pub(super) unsafe fn dot_q5_1<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    sum_blocks!(NT, xs[0].len() / 32, |b, acc| {
        let block = row.add(b * Q5_1_BYTES);
        prefetch_block::<NT, Q5_1_BYTES>(block);
        let d_m = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(block as *const i32)));
        let high_bits = std::ptr::read_unaligned(block.add(4) as *const u32);
        let q = _mm256_or_si256(unpack_nibbles(block.add(8)), D::bits_to_0x10(high_bits));
        for t in 0..NT {
            let x = xs[t];
            // Lanes 2 and 3 of `d_m` are 0.0: what the 128-bit load reads past the pair adds 0.
            let scaled = _mm_mul_ps(d_m, _mm_loadu_ps(x.scale_and_scaled_sum.as_ptr().add(2 * b)));
            let min_lane1 = _mm256_zextps128_ps256(_mm_blend_ps::<0b0001>(scaled, _mm_setzero_ps()));
            let qy = D::dot(_mm256_setzero_si256(), q, load_y(x, 32 * b));
            let block_sum = _mm256_fmadd_ps(_mm256_broadcastss_ps(scaled), _mm256_cvtepi32_ps(qy), min_lane1);
            acc[t] = _mm256_add_ps(acc[t], block_sum);
        }
    })
}

/// A 32-element table type: `scale(block) * y_scale * sum(TABLE[q] * y)`, the indices packed
/// as Q4_0's nibbles at `QS`.
#[inline(always)]
unsafe fn dot_table32<D: ByteDot, const NT: usize, const BYTES: usize, const QS: usize>(
    row: *const u8,
    xs: &[&PreparedInput; NT],
    values: &[i8; 16],
    scale: impl Fn(*const u8) -> f32,
) -> [f32; NT] {
    let values = table(values);
    sum_blocks!(NT, xs[0].len() / 32, |b, acc| {
        let block = row.add(b * BYTES);
        prefetch_block::<NT, BYTES>(block);
        let d_w = scale(block);
        let w = _mm256_shuffle_epi8(values, unpack_nibbles(block.add(QS)));
        let w_abs = _mm256_abs_epi8(w);
        for t in 0..NT {
            let x = xs[t];
            let y = _mm256_sign_epi8(load_y(x, 32 * b), w);
            let qy = D::dot(_mm256_setzero_si256(), w_abs, y);
            let d = d_w * *x.block_scales.get_unchecked(b);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(qy), acc[t]);
        }
    })
}

/// IQ4_NL: `d * sum(IQ4_VALUES[q] * y)`.
#[inline(always)]
pub(super) unsafe fn dot_iq4_nl<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    dot_table32::<D, NT, IQ4_NL_BYTES, 2>(row, xs, &IQ4_VALUES, |block| read_f16(block))
}

/// MXFP4: `2^(e - 128) * sum(FP4_VALUES[q] * y)`.
#[inline(always)]
pub(super) unsafe fn dot_mxfp4<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    dot_table32::<D, NT, MXFP4_BYTES, 1>(row, xs, &FP4_VALUES, |block| super::super::layout::e8m0_half(*block))
}

#[cfg(test)]
mod tests {
    use super::super::super::layout::q3_k_scale;
    use super::super::super::test_util::Rng;
    use super::*;

    #[test]
    fn q3_k_scales_unpack_like_the_reference() {
        let mut rng = Rng::new(12);
        for _ in 0..300 {
            let packed: [u8; 12] = std::array::from_fn(|_| rng.next_u32() as u8);
            let scales = unpack_q3_k_scales(&packed);
            for (g, &sc) in scales.iter().enumerate() {
                assert_eq!(sc, q3_k_scale(g, &packed), "{g}");
            }
        }
    }
}
