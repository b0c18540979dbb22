//! 512-bit K-quant kernels for the AVX-512 VNNI family (Q4_K and Q6_K, the types of the large
//! matrices of the Q4_K_M models here), in two forms that give the same bits:
//!
//! - one token ([`dot_q4_k`], [`dot_q6_k`]): each 32-byte chunk of quants broadcast to a 512-bit
//!   vector, one `vpmaddubsw` + `vpdpwssd` pair per 64 quants; per block the integer sums are
//!   reduced to scalars and closed in scalar float arithmetic;
//! - sixteen tokens ([`q4_k_lanes`], [`q6_k_lanes`]) against a [`LanePack`]: four quants of the
//!   row broadcast to every lane, one `vpdpbusd` per 4 quants x 16 tokens, and the sub-block
//!   scales, the offsets and the float arithmetic applied to 16 tokens (lanes) at once — about
//!   half the multiply-unit work per token of the one-token form, which is what prefill is bound by.
//!
//! Per block both forms compute the same exact integers — Q4_K: `I = sum_s sc[s] * sum(q * y)`
//! and `M = sum_s m[s] * sum_32(y)[s]`; Q6_K (quants stored plus 32):
//! `J = sum_g sc[g] * sum(q * y) - 32 * sum_g sc[g] * sum_16(y)[g]` — and then the same float
//! operations in the same order ([`close_q4_k`], [`close_q6_k`]), so a token's result depends
//! neither on the form nor on the other tokens of a pack: batched products equal one-token
//! products bit for bit. Measured on this machine's AMD Zen 5 only; on cores that split 512-bit
//! operations in two (Zen 4) they may gain less.
//!
//! Ranges: `|I| <= 8 * 63 * 32 * 15 * 127`, `|J| <= 16 * 128 * 16 * 63 * 127 + 32 * 16 * 128 *
//! 2032`, both inside i32; a `vpmaddubsw` pair is at most 2 * 63 * 127 < `i16::MAX`.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::lanes::{LanePack, LANES};
use super::super::layout::{unpack_k_scales, Q4_K_BLOCK_BYTES as Q4_K_BYTES, Q6_K_BLOCK_BYTES as Q6_K_BYTES};
use super::super::PreparedInput;
use super::{prefetch_block, read_f16};

/// The 64 activations starting at element `e` of the input.
#[inline(always)]
pub(super) unsafe fn load_y64(x: &PreparedInput, e: usize) -> __m512i {
    _mm512_loadu_si512(x.quants.as_ptr().add(e) as *const __m512i)
}

/// The 32 bytes at `p` in both 256-bit halves.
#[inline(always)]
pub(super) unsafe fn broadcast_32(p: *const u8) -> __m512i {
    _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i))
}

/// `acc + pair sums of q * y, each i16 pair sum multiplied by its lane's scale, quads summed`:
/// the VNNI family's `dot_scaled` on 512 bits.
#[inline(always)]
pub(super) unsafe fn dot_scaled(acc: __m512i, q: __m512i, y: __m512i, scales_i16: __m512i) -> __m512i {
    _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q, y), scales_i16)
}

/// i16 lane `j` of the result is lane `first + (j >> LOG2_PER)` of `table` (16 i16 lanes in the
/// low 256 bits): `1 << LOG2_PER` consecutive lanes share one scale.
#[inline(always)]
pub(super) unsafe fn spread_scales<const LOG2_PER: u32>(table: __m512i, first: i16) -> __m512i {
    let lane = _mm512_set_epi16(
        31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
        1, 0,
    );
    let index = _mm512_add_epi16(_mm512_set1_epi16(first), _mm512_srli_epi16::<LOG2_PER>(lane));
    _mm512_permutexvar_epi16(index, table)
}

/// One Q4_K block closed in float: `acc + I * (d * y_scale) - M * (dmin * y_scale)`, each step
/// rounded as the lane form's `vmulps` / `vfmadd` / `vfnmadd` round it.
#[inline(always)]
pub(super) fn close_q4_k(acc: f32, i: i32, m: i32, d: f32, dmin: f32, y_scale: f32) -> f32 {
    let acc = (i as f32).mul_add(d * y_scale, acc);
    (-(m as f32)).mul_add(dmin * y_scale, acc)
}

/// One Q6_K block closed in float: `acc + J * (d * y_scale)`.
#[inline(always)]
pub(super) fn close_q6_k(acc: f32, j: i32, d: f32, y_scale: f32) -> f32 {
    (j as f32).mul_add(d * y_scale, acc)
}

/// The sums of the eight i32 lanes of each 256-bit half of `v` (exact).
#[inline(always)]
pub(super) unsafe fn sum_halves(v: __m512i) -> (i32, i32) {
    // Swap 128-bit lanes within each half, then 64-bit pairs, then 32-bit neighbours.
    let v = _mm512_add_epi32(v, _mm512_shuffle_i64x2::<0b10_11_00_01>(v, v));
    let v = _mm512_add_epi32(v, _mm512_shuffle_epi32::<0b01_00_11_10>(v));
    let v = _mm512_add_epi32(v, _mm512_shuffle_epi32::<0b10_11_00_01>(v));
    (
        _mm_cvtsi128_si32(_mm512_castsi512_si128(v)),
        _mm_cvtsi128_si32(_mm512_extracti32x4_epi32::<2>(v)),
    )
}

/// Q4_K, one token (see [`super::kquants`] for the layout): each 32-byte chunk of quants
/// broadcast to both halves, low nibbles kept in the low half and high nibbles in the high half,
/// is the block's elements `64 * chunk ..` in order, against one 64-byte load of activations.
#[inline(always)]
pub(super) unsafe fn dot_q4_k(row: *const u8, x: &PreparedInput) -> f32 {
    let low_nibbles = _mm512_set1_epi8(0x0f);
    // Shift 16-bit lanes by 0 in the low half, 4 in the high half.
    let nibble_shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    let mut acc = 0.0f32;
    for b in 0..x.len() / 256 {
        let block = row.add(b * Q4_K_BYTES);
        prefetch_block::<1, Q4_K_BYTES>(block);
        let (scales, mins) = unpack_k_scales(&*(block.add(4) as *const [u8; 12]));
        let scale_table = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(scales.as_ptr() as *const __m128i)));
        let mut qy = _mm512_setzero_si512();
        for chunk in 0..4 {
            let packed = broadcast_32(block.add(16 + 32 * chunk));
            let q = _mm512_and_si512(_mm512_srlv_epi16(packed, nibble_shift), low_nibbles);
            let sc = spread_scales::<4>(scale_table, 2 * chunk as i16);
            qy = dot_scaled(qy, q, load_y64(x, 256 * b + 64 * chunk), sc);
        }
        // m[s] in both i16 halves of lane s against the two group-of-16 sums of group s: the
        // eight products of M, beside I's partial sums folded to eight lanes; both reduced at once.
        let mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64(mins.as_ptr() as *const __m128i));
        let mins_pairs = _mm256_or_si256(mins, _mm256_slli_epi32::<16>(mins));
        let sums_16 = _mm256_loadu_si256(x.sums_16.as_ptr().add(16 * b) as *const __m256i);
        let i_folded = _mm256_add_epi32(_mm512_castsi512_si256(qy), _mm512_extracti64x4_epi64::<1>(qy));
        let (i, m) = sum_halves(_mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(i_folded),
            _mm256_madd_epi16(sums_16, mins_pairs),
        ));
        let y_scale = *x.block_scales.get_unchecked(b);
        acc = close_q4_k(acc, i, m, read_f16(block), read_f16(block.add(2)), y_scale);
    }
    acc
}

/// Q6_K, one token (see [`super::kquants`]): per half of 128, the 64 bytes of low bits give
/// elements 0..64 (low nibbles) and 64..128 (high nibbles) in order, each with its two top bits
/// taken from the broadcast `qh` shifted by a different amount in each 256-bit half.
#[inline(always)]
unsafe fn unpack_q6_k_half(block: *const u8, half: usize) -> (__m512i, __m512i) {
    let low_nibbles = _mm512_set1_epi8(0x0f);
    let two_bits = _mm512_set1_epi8(3);
    // Top bits of elements 0..32 / 32..64 of a half: qh >> 0 / >> 2; of 64..96 / 96..128: >> 4 / >> 6.
    let shift_a = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
    let shift_b = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(6));
    let ql = _mm512_loadu_si512(block.add(64 * half) as *const __m512i);
    let qh = broadcast_32(block.add(128 + 32 * half));
    let top = |shift: __m512i| _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srlv_epi16(qh, shift), two_bits));
    let first = _mm512_or_si512(_mm512_and_si512(ql, low_nibbles), top(shift_a));
    let second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), low_nibbles), top(shift_b));
    (first, second)
}

/// Q6_K, one token: the quants as stored (0..64) against the activations with each group of
/// 16's scale, and the stored offset of 32 taken from the activations' group sums.
#[inline(always)]
pub(super) unsafe fn dot_q6_k(row: *const u8, x: &PreparedInput) -> f32 {
    let mut acc = 0.0f32;
    for b in 0..x.len() / 256 {
        let block = row.add(b * Q6_K_BYTES);
        prefetch_block::<1, Q6_K_BYTES>(block);
        let scales = _mm_loadu_si128(block.add(192) as *const __m128i);
        let scale_table = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(scales));
        let mut qy = _mm512_setzero_si512();
        for half in 0..2 {
            let (first, second) = unpack_q6_k_half(block, half);
            let e = 256 * b + 128 * half;
            qy = dot_scaled(
                qy,
                first,
                load_y64(x, e),
                spread_scales::<3>(scale_table, 8 * half as i16),
            );
            qy = dot_scaled(
                qy,
                second,
                load_y64(x, e + 64),
                spread_scales::<3>(scale_table, 8 * half as i16 + 4),
            );
        }
        // sum_g sc[g] * sum_16(y)[g]: 16 i16 products summed in pairs by one `vpmaddwd`.
        let sums = _mm256_loadu_si256(x.sums_16.as_ptr().add(16 * b) as *const __m256i);
        let offsets = _mm256_madd_epi16(_mm256_cvtepi8_epi16(scales), sums);
        let offset = _mm512_reduce_add_epi32(_mm512_zextsi256_si512(offsets));
        let j = _mm512_reduce_add_epi32(qy) - 32 * offset;
        acc = close_q6_k(acc, j, read_f16(block.add(208)), *x.block_scales.get_unchecked(b));
    }
    acc
}

/// The pack's 64 bytes of group `g` of 4 elements: four activation quants per lane.
#[inline(always)]
pub(super) unsafe fn load_lanes(p: &LanePack, g: usize) -> __m512i {
    _mm512_loadu_si512(p.quants.as_ptr().add(g * LANES) as *const __m512i)
}

/// The pack's `[i16; 2]` pair sums of `sums` at pair `i`, one pair per lane.
#[inline(always)]
pub(super) unsafe fn load_lane_pairs(sums: &[[i16; 2]], i: usize) -> __m512i {
    _mm512_loadu_si512(sums.as_ptr().add(i * LANES) as *const __m512i)
}

/// The 4 bytes at `p` in every 32-bit lane.
#[inline(always)]
pub(super) unsafe fn broadcast_4(p: *const u8) -> __m512i {
    _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

/// Two i16 values in one i32 lane, `lo` in the low half, for `vpdpwssd` against pair sums.
#[inline(always)]
pub(super) fn i16_pair(lo: i32, hi: i32) -> i32 {
    (lo & 0xffff) | (hi << 16)
}

/// Q4_K against 16 tokens, `R` rows at a time over blocks `blocks`, added to `acc` (lane `t`
/// of `acc[r]` accumulates the dot of row `r` with token `t` of the pack). Four bytes of a
/// 32-byte chunk hold elements `64 * chunk + 4k ..` (low nibbles, sub-block `2 * chunk`) and
/// `64 * chunk + 32 + 4k ..` (high nibbles, sub-block `2 * chunk + 1`); each load of the pack's
/// activations serves all `R` rows.
#[inline(always)]
pub(super) unsafe fn q4_k_lanes<const R: usize>(
    rows: [*const u8; R],
    p: &LanePack,
    blocks: Range<usize>,
    acc: &mut [__m512; R],
) {
    let low_nibbles = _mm512_set1_epi8(0x0f);
    for b in blocks {
        let block = rows.map(|row| row.add(b * Q4_K_BYTES));
        // One accumulator per row and sub-block: 8 * R dependency chains side by side.
        let mut sums = [[_mm512_setzero_si512(); 8]; R];
        for k in 0..8 {
            for chunk in 0..4 {
                let g = 64 * b + 16 * chunk + k;
                let (y_low, y_high) = (load_lanes(p, g), load_lanes(p, g + 8));
                for r in 0..R {
                    let w = broadcast_4(block[r].add(16 + 32 * chunk + 4 * k));
                    let w_low = _mm512_and_si512(w, low_nibbles);
                    let w_high = _mm512_and_si512(_mm512_srli_epi32::<4>(w), low_nibbles);
                    sums[r][2 * chunk] = _mm512_dpbusd_epi32(sums[r][2 * chunk], w_low, y_low);
                    sums[r][2 * chunk + 1] = _mm512_dpbusd_epi32(sums[r][2 * chunk + 1], w_high, y_high);
                }
            }
        }
        let y_scale = _mm512_loadu_ps(p.scales.as_ptr().add(b * LANES));
        for r in 0..R {
            let (scales, mins) = unpack_k_scales(&*(block[r].add(4) as *const [u8; 12]));
            let mut total = _mm512_setzero_si512();
            for (s, sum) in sums[r].into_iter().enumerate() {
                total = _mm512_add_epi32(total, _mm512_mullo_epi32(sum, _mm512_set1_epi32(i32::from(scales[s]))));
            }
            let mut m = _mm512_setzero_si512();
            for pair in 0..4 {
                let mins_pair = _mm512_set1_epi32(i16_pair(i32::from(mins[2 * pair]), i32::from(mins[2 * pair + 1])));
                m = _mm512_dpwssd_epi32(m, load_lane_pairs(&p.sums_32, 4 * b + pair), mins_pair);
            }
            let d = _mm512_mul_ps(_mm512_set1_ps(read_f16(block[r])), y_scale);
            let dmin = _mm512_mul_ps(_mm512_set1_ps(read_f16(block[r].add(2))), y_scale);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), d, acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), dmin, acc[r]);
        }
    }
}

/// A block's 256 quants in element order, 64-byte aligned for the broadcast loads.
#[repr(align(64))]
#[derive(Clone, Copy)]
pub(super) struct Unpacked(pub(super) [u8; 256]);

/// Q6_K against 16 tokens, `R` rows at a time over blocks `blocks`, added to `acc` as in
/// [`q4_k_lanes`]: each row's block unpacked in element order once (512-bit operations, as in
/// [`dot_q6_k`]), then read back four quants at a time per group of 16 elements.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `i` and `r` index several arrays in step
pub(super) unsafe fn q6_k_lanes<const R: usize>(
    rows: [*const u8; R],
    p: &LanePack,
    blocks: Range<usize>,
    acc: &mut [__m512; R],
) {
    let mut unpacked = [Unpacked([0; 256]); R];
    for b in blocks {
        let block = rows.map(|row| row.add(b * Q6_K_BYTES));
        for r in 0..R {
            let q = unpacked[r].0.as_mut_ptr();
            for half in 0..2 {
                let (first, second) = unpack_q6_k_half(block[r], half);
                _mm512_store_si512(q.add(128 * half) as *mut __m512i, first);
                _mm512_store_si512(q.add(128 * half + 64) as *mut __m512i, second);
            }
        }
        let mut total = [_mm512_setzero_si512(); R];
        // Four groups of 16 at a time: 4 * R dependency chains side by side.
        for g0 in (0..16).step_by(4) {
            let mut sums = [[_mm512_setzero_si512(); 4]; R];
            for k in 0..4 {
                for i in 0..4 {
                    let y = load_lanes(p, 64 * b + 4 * (g0 + i) + k);
                    for r in 0..R {
                        let w = broadcast_4(unpacked[r].0.as_ptr().add(16 * (g0 + i) + 4 * k));
                        sums[r][i] = _mm512_dpbusd_epi32(sums[r][i], w, y);
                    }
                }
            }
            for r in 0..R {
                let scales = &*(block[r].add(192) as *const [i8; 16]);
                for (i, sum) in sums[r].into_iter().enumerate() {
                    let sc = _mm512_set1_epi32(i32::from(scales[g0 + i]));
                    total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(sum, sc));
                }
            }
        }
        let y_scale = _mm512_loadu_ps(p.scales.as_ptr().add(b * LANES));
        for r in 0..R {
            let scales = &*(block[r].add(192) as *const [i8; 16]);
            let mut offset = _mm512_setzero_si512();
            for pair in 0..8 {
                let sc_pair = _mm512_set1_epi32(i16_pair(i32::from(scales[2 * pair]), i32::from(scales[2 * pair + 1])));
                offset = _mm512_dpwssd_epi32(offset, load_lane_pairs(&p.sums_16, 8 * b + pair), sc_pair);
            }
            let j = _mm512_sub_epi32(total[r], _mm512_slli_epi32::<5>(offset));
            let d = _mm512_mul_ps(_mm512_set1_ps(read_f16(block[r].add(208))), y_scale);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(j), d, acc[r]);
        }
    }
}
