//! SIMD dot products of the 32-element types (Q4_0, Q4_1, Q5_0, Q8_0) with Q8_0-style
//! activations: one 256-bit vector of weight quants per block, one byte dot product, the block's
//! integer correction, then one fused multiply-add by the block's combined scale.
//!
//! Every kernel takes a tile of `NT` prepared inputs and returns the `NT` dot products of one row
//! with them: each weight block is loaded and unpacked once and then multiplied with every
//! token's activation block. Per token the instructions are exactly those of `NT == 1` (the
//! single-vector matvec), so a tile's results are bit-identical to per-token calls.
//!
//! Saturation: 4- and 5-bit quants are at most 31, activations at most 127 in magnitude, so the
//! AVX2 pair sums stay far below `i16::MAX`; Q8_0 uses `|w|` against `sign(w) * y`, whose pair sums
//! are at most 2 * 128 * 127 = 32512.

use std::arch::x86_64::*;

use super::super::PreparedInput;
use super::{prefetch_block, read_f16, sum_blocks, ByteDot};

const Q4_0_BYTES: usize = 18;
const Q4_1_BYTES: usize = 20;
const Q5_0_BYTES: usize = 22;
const Q8_0_BYTES: usize = 34;

/// 16 bytes of packed nibbles at `p` as 32 bytes: low nibbles (elements 0..16) in the low 128
/// bits, high nibbles (elements 16..32) in the high 128 bits.
#[inline(always)]
pub(super) unsafe fn unpack_nibbles(p: *const u8) -> __m256i {
    let packed = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// `value` in lane 0, zeros elsewhere.
#[inline(always)]
unsafe fn lane0_i32(value: i32) -> __m256i {
    _mm256_zextsi128_si256(_mm_cvtsi32_si128(value))
}

/// The activations of block `b` (32 bytes).
#[inline(always)]
unsafe fn load_y(x: &PreparedInput, b: usize) -> __m256i {
    _mm256_loadu_si256(x.quants.as_ptr().add(32 * b) as *const __m256i)
}

/// Q4_0: `d * (sum(q * y) - 8 * sum(y))`.
#[inline(always)]
pub(super) unsafe fn dot_q4_0<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    sum_blocks!(NT, xs[0].len() / 32, |b, acc| {
        let block = row.add(b * Q4_0_BYTES);
        prefetch_block::<NT, Q4_0_BYTES>(block);
        let d_w = read_f16(block);
        let q = unpack_nibbles(block.add(2));
        for t in 0..NT {
            let x = xs[t];
            let d = d_w * *x.block_scales.get_unchecked(b);
            let offset = -8 * *x.sums_32.get_unchecked(b);
            let qy = D::dot(lane0_i32(offset), q, load_y(x, b));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(qy), acc[t]);
        }
    })
}

/// Q4_1: `d * sum(q * y) + m * sum(y)`. The block's `[d, m]` (adjacent f16s) are converted
/// together and multiplied by the prepared `[y_scale, y_scale * sum(y)]`; the min term then rides
/// in lane 1 of the addend of the block's fused multiply-add.
#[inline(always)]
pub(super) unsafe fn dot_q4_1<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    sum_blocks!(NT, xs[0].len() / 32, |b, acc| {
        let block = row.add(b * Q4_1_BYTES);
        prefetch_block::<NT, Q4_1_BYTES>(block);
        let d_m = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(block as *const i32)));
        let q = unpack_nibbles(block.add(4));
        for t in 0..NT {
            let x = xs[t];
            // Lanes 2 and 3 of `d_m` are 0.0, so the next block's factors (or the padding) read
            // by this 128-bit load contribute nothing.
            let scaled = _mm_mul_ps(d_m, _mm_loadu_ps(x.scale_and_scaled_sum.as_ptr().add(2 * b)));
            let min_lane1 = _mm256_zextps128_ps256(_mm_blend_ps::<0b0001>(scaled, _mm_setzero_ps()));
            let qy = D::dot(_mm256_setzero_si256(), q, load_y(x, b));
            let block_sum = _mm256_fmadd_ps(_mm256_broadcastss_ps(scaled), _mm256_cvtepi32_ps(qy), min_lane1);
            acc[t] = _mm256_add_ps(acc[t], block_sum);
        }
    })
}

/// Q5_0: `d * (sum(q * y) - 16 * sum(y))` with `q = nibble | fifth_bit << 4`.
#[inline(always)]
pub(super) unsafe fn dot_q5_0<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    sum_blocks!(NT, xs[0].len() / 32, |b, acc| {
        let block = row.add(b * Q5_0_BYTES);
        prefetch_block::<NT, Q5_0_BYTES>(block);
        let d_w = read_f16(block);
        let high_bits = std::ptr::read_unaligned(block.add(2) as *const u32);
        let q = _mm256_or_si256(unpack_nibbles(block.add(6)), D::bits_to_0x10(high_bits));
        for t in 0..NT {
            let x = xs[t];
            let d = d_w * *x.block_scales.get_unchecked(b);
            let offset = -16 * *x.sums_32.get_unchecked(b);
            let qy = D::dot(lane0_i32(offset), q, load_y(x, b));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(qy), acc[t]);
        }
    })
}

/// Q8_0: `d * sum(w * y)`, signed by signed via `|w| * (sign(w) * y)`.
#[inline(always)]
pub(super) unsafe fn dot_q8_0<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    sum_blocks!(NT, xs[0].len() / 32, |b, acc| {
        let block = row.add(b * Q8_0_BYTES);
        prefetch_block::<NT, Q8_0_BYTES>(block);
        let d_w = read_f16(block);
        let w = _mm256_loadu_si256(block.add(2) as *const __m256i);
        let w_abs = _mm256_abs_epi8(w);
        for t in 0..NT {
            let x = xs[t];
            let d = d_w * *x.block_scales.get_unchecked(b);
            let y = _mm256_sign_epi8(load_y(x, b), w);
            let qy = D::dot(_mm256_setzero_si256(), w_abs, y);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(qy), acc[t]);
        }
    })
}
