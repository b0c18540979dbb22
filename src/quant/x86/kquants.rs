//! SIMD dot products of the K-quants (Q4_K, Q5_K, Q6_K) with Q8_K activations. Per super-block
//! of 256, the per-sub-block scales are applied in integers with [`ByteDot::dot_scaled`] (i16
//! scales against the i16 pair sums), the min/offset terms come from the activations' group sums,
//! and the block's integer vector is scaled once in `f32`.
//!
//! As in [`super::legacy`], every kernel dots one row with a tile of `NT` prepared inputs:
//! a super-block's quants and scales are unpacked once per tile, and each token's instructions
//! are exactly those of `NT == 1`, so tile results are bit-identical to per-token calls.
//!
//! Saturation: quants are at most 63 and activations at most 127 in magnitude, so a `vpmaddubsw`
//! pair is at most 2 * 63 * 127 = 16002 < `i16::MAX`, and the scaled quad sums fit easily in i32.

use std::arch::x86_64::*;

use super::super::layout::unpack_k_scales;
use super::super::PreparedInput;
use super::{prefetch_block, read_f16, sum_blocks, ByteDot};

const Q4_K_BYTES: usize = 144;
const Q5_K_BYTES: usize = 176;
const Q6_K_BYTES: usize = 210;

/// The 32 activations starting at element `e` of the input.
#[inline(always)]
pub(super) unsafe fn load_y(x: &PreparedInput, e: usize) -> __m256i {
    _mm256_loadu_si256(x.quants.as_ptr().add(e) as *const __m256i)
}

/// An i16 scale vector: `lo` for the low 128 bits (elements 0..16 of a 32-byte vector), `hi` for
/// the high 128 bits.
#[inline(always)]
pub(super) unsafe fn scales_i16(lo: i16, hi: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

/// `m[s] * sum_32(y)[s]` per lane `s` for the Q4_K/Q5_K min term. `mins_pairs` holds `m[s]` in
/// both i16 halves of lane `s`, so one `vpmaddwd` against the two group-of-16 sums that make up
/// `sum_32(y)[s]` gives the same exact i32 as a 32-bit multiply, at a third of its latency.
#[inline(always)]
unsafe fn mins_term(mins_pairs: __m256i, x: &PreparedInput, b: usize) -> __m256i {
    let sums_16 = _mm256_loadu_si256(x.sums_16.as_ptr().add(16 * b) as *const __m256i);
    _mm256_madd_epi16(sums_16, mins_pairs)
}

/// Q4_K/Q5_K body: `d * sum_s(sc[s] * sum(q * y)) - dmin * sum_s(m[s] * sum(y))`. `FIFTH_BITS`
/// selects Q5_K (fifth bits at byte 16, quants at 48) over Q4_K (quants at 16).
#[inline(always)]
unsafe fn dot_k4_k5<D: ByteDot, const FIFTH_BITS: bool, const NT: usize>(
    row: *const u8,
    xs: &[&PreparedInput; NT],
) -> [f32; NT] {
    let block_bytes = if FIFTH_BITS { Q5_K_BYTES } else { Q4_K_BYTES };
    let qs_offset = if FIFTH_BITS { 48 } else { 16 };
    let low_nibbles = _mm256_set1_epi8(0x0f);
    sum_blocks!(NT, xs[0].len() / 256, |b, acc| {
        let block = row.add(b * block_bytes);
        if FIFTH_BITS {
            prefetch_block::<NT, Q5_K_BYTES>(block);
        } else {
            prefetch_block::<NT, Q4_K_BYTES>(block);
        }
        let d_w = read_f16(block);
        let dmin_w = read_f16(block.add(2));
        let (scales, mins) = unpack_k_scales(&*(block.add(4) as *const [u8; 12]));
        // Bits 2c and 2c+1 of each byte are the fifth bits of chunk c's low and high halves;
        // shifting right by 2 per chunk keeps them at bits 0 and 1 (16-bit shifts pull in bits
        // only above bit 7 - 2c, which the masks drop).
        let mut high = if FIFTH_BITS {
            _mm256_loadu_si256(block.add(16) as *const __m256i)
        } else {
            _mm256_setzero_si256()
        };
        let mut qy = [_mm256_setzero_si256(); NT];
        for chunk in 0..4 {
            let packed = _mm256_loadu_si256(block.add(qs_offset + 32 * chunk) as *const __m256i);
            let mut lo = _mm256_and_si256(packed, low_nibbles);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low_nibbles);
            if FIFTH_BITS {
                let one = _mm256_set1_epi8(1);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(high, one)));
                let two = _mm256_set1_epi8(2);
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(high, two)));
                high = _mm256_srli_epi16::<2>(high);
            }
            let sc_lo = _mm256_set1_epi16(scales[2 * chunk] as i16);
            let sc_hi = _mm256_set1_epi16(scales[2 * chunk + 1] as i16);
            for t in 0..NT {
                let y_lo = load_y(xs[t], 256 * b + 64 * chunk);
                let y_hi = load_y(xs[t], 256 * b + 64 * chunk + 32);
                qy[t] = D::dot_scaled(qy[t], lo, y_lo, sc_lo);
                qy[t] = D::dot_scaled(qy[t], hi, y_hi, sc_hi);
            }
        }
        let mins_i32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(mins.as_ptr() as *const __m128i));
        let mins_pairs = _mm256_or_si256(mins_i32, _mm256_slli_epi32::<16>(mins_i32));
        for t in 0..NT {
            let y_scale = *xs[t].block_scales.get_unchecked(b);
            let (d, dmin) = (d_w * y_scale, dmin_w * y_scale);
            let min_sum = _mm256_cvtepi32_ps(mins_term(mins_pairs, xs[t], b));
            let scaled = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(qy[t]));
            acc[t] = _mm256_add_ps(acc[t], _mm256_fnmadd_ps(_mm256_set1_ps(dmin), min_sum, scaled));
        }
    })
}

#[inline(always)]
pub(super) unsafe fn dot_q4_k<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    dot_k4_k5::<D, false, NT>(row, xs)
}

#[inline(always)]
pub(super) unsafe fn dot_q5_k<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    dot_k4_k5::<D, true, NT>(row, xs)
}

/// Bits 0..2 of each byte of `bits`, moved to bits 4..6 (the top two bits of a 6-bit quant).
#[inline(always)]
unsafe fn top_bits(bits: __m256i) -> __m256i {
    _mm256_slli_epi16::<4>(_mm256_and_si256(bits, _mm256_set1_epi8(3)))
}

/// Q6_K: `d * sum_g(sc[g] * (sum(q * y) - 32 * sum(y)))` over the 16 groups of 16.
#[inline(always)]
pub(super) unsafe fn dot_q6_k<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    let low_nibbles = _mm256_set1_epi8(0x0f);
    sum_blocks!(NT, xs[0].len() / 256, |b, acc| {
        let block = row.add(b * Q6_K_BYTES);
        prefetch_block::<NT, Q6_K_BYTES>(block);
        let d_w = read_f16(block.add(208));
        let scales = block.add(192) as *const i8;
        let mut qy = [_mm256_setzero_si256(); NT];
        for half in 0..2 {
            let ql_a = _mm256_loadu_si256(block.add(64 * half) as *const __m256i);
            let ql_b = _mm256_loadu_si256(block.add(64 * half + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(block.add(128 + 32 * half) as *const __m256i);
            let quarters = [
                _mm256_or_si256(_mm256_and_si256(ql_a, low_nibbles), top_bits(qh)),
                _mm256_or_si256(
                    _mm256_and_si256(ql_b, low_nibbles),
                    top_bits(_mm256_srli_epi16::<2>(qh)),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql_a), low_nibbles),
                    top_bits(_mm256_srli_epi16::<4>(qh)),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql_b), low_nibbles),
                    top_bits(_mm256_srli_epi16::<6>(qh)),
                ),
            ];
            for (quarter, q) in quarters.into_iter().enumerate() {
                let group = 8 * half + 2 * quarter;
                let sc = scales_i16(*scales.add(group) as i16, *scales.add(group + 1) as i16);
                for t in 0..NT {
                    let y = load_y(xs[t], 256 * b + 128 * half + 32 * quarter);
                    qy[t] = D::dot_scaled(qy[t], q, y, sc);
                }
            }
        }
        // 32 * sum_g(sc[g] * sum_16(y)[g]), with i16 madd (|sc * sum| < 128 * 2032).
        let sc_i16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(scales as *const __m128i));
        for t in 0..NT {
            let d = d_w * *xs[t].block_scales.get_unchecked(b);
            let sums = _mm256_loadu_si256(xs[t].sums_16.as_ptr().add(16 * b) as *const __m256i);
            let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc_i16, sums));
            let qy = _mm256_sub_epi32(qy[t], offset);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(qy), acc[t]);
        }
    })
}
