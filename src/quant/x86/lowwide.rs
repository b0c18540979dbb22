//! 512-bit kernels for Q2_K, Q3_K and IQ4_XS in the AVX-512 VNNI family, in the two forms of
//! [`super::wide`] that give the same bits:
//!
//! - one token ([`dot_q2_k`], [`dot_q3_k`], [`dot_iq4_xs`]): Q2_K and Q3_K 64 quants per 512-bit
//!   vector in element order against one 64-byte load of activations, one `vpmaddubsw` +
//!   `vpdpwssd` pair each with the group scales spread over the i16 pair sums (IQ4_XS as in
//!   [`super::lowbit`], 32 per 256-bit vector); per block the integer sums are reduced to
//!   scalars and closed in scalar float arithmetic;
//! - sixteen tokens ([`q2_k_lanes`], [`q3_k_lanes`], [`iq4_xs_lanes`]) against a [`LanePack`]:
//!   each row's block unpacked once in element order (unsigned bytes), then four quants at a
//!   time broadcast to every lane, one `vpdpbusd` per 4 quants x 16 tokens, each group's sum
//!   scaled in i32 and the offsets taken from the pack's group sums.
//!
//! Per block both forms compute the same exact integers and close them with the same float
//! operations in the same order ([`close_q4_k`] / [`close_q6_k`]):
//! - Q2_K: `I = sum_g sc[g] * sum(q * y)`, `M = sum_g m[g] * sum_16(y)[g]`, closed as Q4_K's;
//! - Q3_K (quants stored unsigned, `q + 4`): `J = sum_g sc[g] * sum(q * y) - 4 * sum_g sc[g] *
//!   sum_16(y)[g]`, closed as Q6_K's;
//! - IQ4_XS: `J = sum_s sc[s] * sum(v * y)` with `v = IQ4_VALUES[q]`; the lane form multiplies
//!   `v + 128` (unsigned) and subtracts `128 * sum_s sc[s] * sum_32(y)[s]`; closed as Q6_K's.
//!
//! So a batched product equals a one-token one bit for bit, whatever the other tokens.
//!
//! Ranges: Q2_K `|I| <= 16 * 15 * 16 * 3 * 127`, Q3_K `|J| <= 16 * 32 * 16 * 7 * 127 + 4 * 16 *
//! 32 * 2032`, IQ4_XS `|sc * sum((v + 128) * y)| <= 32 * 32 * 241 * 127` per sub-block and `|J| <=
//! 8 * 32 * 32 * 127 * 127`: all inside i32. `vpmaddubsw` pairs (one-token forms): at most
//! 2 * 7 * 127 (Q3_K) and 2 * 127 * 127 (IQ4_XS, `|v|` against `sign(v) * y`) < `i16::MAX`.
//!
//! Measured on this machine's Intel Xeon (Sapphire Rapids class), one thread, Qwen's ffn_up
//! shape in the caches (`lowwide::timing` below, best of 40 alternating passes, load ~9 on 2
//! cores): Q3_K one-token 5.6 -> 13.0 GB/s (the 256-bit form unpacked its scales through
//! memory and built its third bits with a compare per 32); Q2_K 13.5 -> 11.5 (the per-block
//! reduction the lane form's contract needs costs more than the wider vectors save on its
//! 84-byte blocks); IQ4_XS 14.6 -> 15.2.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::lanes::{LanePack, LANES};
use super::super::layout::{
    IQ4_VALUES, IQ4_XS_BLOCK_BYTES, IQ4_XS_QS_OFFSET, Q2_K_BLOCK_BYTES, Q2_K_D_OFFSET, Q2_K_QS_OFFSET,
    Q3_K_BLOCK_BYTES, Q3_K_D_OFFSET, Q3_K_QS_OFFSET, Q3_K_SCALES_OFFSET,
};
use super::super::PreparedInput;
use super::kquants::load_y;
use super::legacy::unpack_nibbles;
use super::wide::{
    broadcast_32, broadcast_4, close_q4_k, close_q6_k, dot_scaled, i16_pair, load_lane_pairs, load_lanes, load_y64,
    spread_scales, sum_halves, Unpacked,
};
use super::{prefetch_block, read_f16, ByteDot, VnniDot};

/// Q3_K's sixteen signed scales (6-bit values minus 32) from the 12 bytes at `block + 96`, as
/// bytes of one 128-bit vector: the low four bits of scales 0..8 / 8..16 are the low / high
/// nibbles of bytes 0..8, the top two bits of scale `4k + i` are bits `2k..2k+2` of byte `8 + i`.
#[inline(always)]
pub(super) unsafe fn q3_k_scales(block: *const u8) -> __m128i {
    // Bytes 94..110 of the block, moved down by two: bytes 96..108 at 0..12 (no read past it).
    let raw = _mm_srli_si128::<2>(_mm_loadu_si128(block.add(Q3_K_SCALES_OFFSET - 2) as *const __m128i));
    // 32-bit lanes [w0, w1, w0 >> 4, w1 >> 4] & 0x0f.., and [w2, w2 >> 2, w2 >> 4, w2 >> 6] & 0x03...
    let low = _mm_and_si128(
        _mm_srlv_epi32(_mm_shuffle_epi32::<0b01_00_01_00>(raw), _mm_set_epi32(4, 4, 0, 0)),
        _mm_set1_epi8(0x0f),
    );
    let high = _mm_and_si128(
        _mm_srlv_epi32(_mm_shuffle_epi32::<0b10_10_10_10>(raw), _mm_set_epi32(6, 4, 2, 0)),
        _mm_set1_epi8(3),
    );
    _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi32::<4>(high)), _mm_set1_epi8(32))
}

/// Shifts that put quarter `2 * pair` of a broadcast 32-byte chunk of 2-bit quants in the low
/// 256 bits and quarter `2 * pair + 1` in the high 256 bits (lanes shifted by 0/2, 4/6; the
/// width of the lanes does not matter under the 2-bit mask, and 64-bit variable shifts are one
/// instruction where 16-bit ones are three on Intel cores).
#[inline(always)]
unsafe fn quarter_shifts(pair: usize) -> __m512i {
    let lo = _mm256_set1_epi64x(4 * pair as i64);
    let hi = _mm256_set1_epi64x(4 * pair as i64 + 2);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The 64 two-bit quants of elements `128 * half + 64 * pair ..` of a Q2_K/Q3_K block whose
/// `qs` starts at `qs`, in element order (0..4 per byte).
#[inline(always)]
unsafe fn two_bit_quants(qs: *const u8, half: usize, pair: usize) -> __m512i {
    let packed = broadcast_32(qs.add(32 * half));
    _mm512_and_si512(_mm512_srlv_epi64(packed, quarter_shifts(pair)), _mm512_set1_epi8(3))
}

/// Q3_K's unsigned quants (`q + 4`, 0..8) of elements `128 * half + 64 * pair ..`: the two low
/// bits plus 4 where bit `4 * half + 2 * pair (+ 1 in the high 256 bits)` of `hmask[e % 32]` is set.
#[inline(always)]
unsafe fn q3_k_quants(block: *const u8, hmask: __m512i, half: usize, pair: usize) -> __m512i {
    let low = two_bit_quants(block.add(Q3_K_QS_OFFSET), half, pair);
    let bit = 4 * half + 2 * pair;
    let select = _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_set1_epi8((1u8 << bit) as i8)),
        _mm256_set1_epi8((1u8 << (bit + 1)) as i8),
    );
    let set = _mm512_test_epi8_mask(hmask, select);
    _mm512_mask_add_epi8(low, set, low, _mm512_set1_epi8(4))
}

/// Sum of the 8 i32 lanes of `v` (exact).
#[inline(always)]
unsafe fn sum_256(v: __m256i) -> i32 {
    let quad = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let pair = _mm_add_epi32(quad, _mm_unpackhi_epi64(quad, quad));
    _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32::<0b01>(pair)))
}

/// The two 256-bit halves of `v` added.
#[inline(always)]
unsafe fn fold(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// Q3_K, one token: `J` per block (see the module docs), closed as Q6_K's.
#[inline(always)]
pub(super) unsafe fn dot_q3_k(row: *const u8, x: &PreparedInput) -> f32 {
    let mut acc = 0.0f32;
    for b in 0..x.len() / 256 {
        let block = row.add(b * Q3_K_BLOCK_BYTES);
        prefetch_block::<1, Q3_K_BLOCK_BYTES>(block);
        let scales = _mm256_cvtepi8_epi16(q3_k_scales(block));
        let scale_table = _mm512_castsi256_si512(scales);
        let hmask = broadcast_32(block);
        let mut qy = _mm512_setzero_si512();
        for half in 0..2 {
            for pair in 0..2 {
                let q = q3_k_quants(block, hmask, half, pair);
                let sc = spread_scales::<3>(scale_table, (8 * half + 4 * pair) as i16);
                qy = dot_scaled(qy, q, load_y64(x, 256 * b + 128 * half + 64 * pair), sc);
            }
        }
        // 4 * sum_g sc[g] * sum_16(y)[g]: 16 i16 products summed in pairs by one `vpmaddwd`.
        let sums = _mm256_loadu_si256(x.sums_16.as_ptr().add(16 * b) as *const __m256i);
        let offsets = _mm256_madd_epi16(scales, sums);
        let j = sum_256(_mm256_sub_epi32(fold(qy), _mm256_slli_epi32::<2>(offsets)));
        acc = close_q6_k(
            acc,
            j,
            read_f16(block.add(Q3_K_D_OFFSET)),
            *x.block_scales.get_unchecked(b),
        );
    }
    acc
}

/// Q2_K, one token: `I` and `M` per block (see the module docs), closed as Q4_K's.
#[inline(always)]
pub(super) unsafe fn dot_q2_k(row: *const u8, x: &PreparedInput) -> f32 {
    let low_nibbles = _mm_set1_epi8(0x0f);
    let mut acc = 0.0f32;
    for b in 0..x.len() / 256 {
        let block = row.add(b * Q2_K_BLOCK_BYTES);
        prefetch_block::<1, Q2_K_BLOCK_BYTES>(block);
        let packed_scales = _mm_loadu_si128(block as *const __m128i);
        let scale_table = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(packed_scales, low_nibbles)));
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(packed_scales), low_nibbles));
        let mut qy = _mm512_setzero_si512();
        for half in 0..2 {
            for pair in 0..2 {
                let q = two_bit_quants(block.add(Q2_K_QS_OFFSET), half, pair);
                let sc = spread_scales::<3>(scale_table, (8 * half + 4 * pair) as i16);
                qy = dot_scaled(qy, q, load_y64(x, 256 * b + 128 * half + 64 * pair), sc);
            }
        }
        // I's partial sums folded to eight lanes beside M's eight pair products; both reduced at once.
        let sums = _mm256_loadu_si256(x.sums_16.as_ptr().add(16 * b) as *const __m256i);
        let (i, m) = sum_halves(_mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(fold(qy)),
            _mm256_madd_epi16(mins, sums),
        ));
        let (d, dmin) = (
            read_f16(block.add(Q2_K_D_OFFSET)),
            read_f16(block.add(Q2_K_D_OFFSET + 2)),
        );
        acc = close_q4_k(acc, i, m, d, dmin, *x.block_scales.get_unchecked(b));
    }
    acc
}

/// IQ4_XS's eight signed sub-block scales (6-bit values minus 32) as i16 lanes 0..8.
#[inline(always)]
unsafe fn iq4_xs_scales(block: *const u8) -> __m128i {
    let scales_h = std::ptr::read_unaligned(block.add(2) as *const u16);
    let scales_l = std::ptr::read_unaligned(block.add(4) as *const u32);
    let low = _mm256_srlv_epi32(
        _mm256_set1_epi32(scales_l as i32),
        _mm256_set_epi32(28, 24, 20, 16, 12, 8, 4, 0),
    );
    let high = _mm256_srlv_epi32(
        _mm256_set1_epi32(i32::from(scales_h)),
        _mm256_set_epi32(14, 12, 10, 8, 6, 4, 2, 0),
    );
    let scales = _mm256_or_si256(
        _mm256_and_si256(low, _mm256_set1_epi32(0x0f)),
        _mm256_slli_epi32::<4>(_mm256_and_si256(high, _mm256_set1_epi32(3))),
    );
    _mm256_cvtepi32_epi16(_mm256_sub_epi32(scales, _mm256_set1_epi32(32)))
}

/// IQ4_XS's 4-bit indices of sub-blocks `2 * pair` and `2 * pair + 1` (elements `64 * pair ..`)
/// in element order: per sub-block the low nibbles of its 16 bytes, then the high nibbles.
#[inline(always)]
unsafe fn iq4_xs_indices(block: *const u8, pair: usize) -> __m512i {
    let packed = _mm512_castsi256_si512(_mm256_loadu_si256(
        block.add(IQ4_XS_QS_OFFSET + 32 * pair) as *const __m256i
    ));
    // 128-bit lanes [a, a, b, b], shifted right by 0, 4, 0, 4 (under the nibble mask).
    let doubled = _mm512_shuffle_i64x2::<0b01_01_00_00>(packed, packed);
    let shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    _mm512_and_si512(_mm512_srlv_epi64(doubled, shifts), _mm512_set1_epi8(0x0f))
}

/// IQ4_XS, one token: `J` per block (see the module docs), closed as Q6_K's, on 256-bit vectors
/// (one sub-block each; a 512-bit form, which has no `vpsignb`, measured 14% slower). The table
/// values are multiplied signed by signed as `|v| * (sign(v) * y)`.
#[inline(always)]
pub(super) unsafe fn dot_iq4_xs(row: *const u8, x: &PreparedInput) -> f32 {
    let values = _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i));
    let mut acc = 0.0f32;
    for b in 0..x.len() / 256 {
        let block = row.add(b * IQ4_XS_BLOCK_BYTES);
        prefetch_block::<1, IQ4_XS_BLOCK_BYTES>(block);
        let scales_h = std::ptr::read_unaligned(block.add(2) as *const u16);
        let scales_l = std::ptr::read_unaligned(block.add(4) as *const u32);
        let mut qy = _mm256_setzero_si256();
        for s in 0..8 {
            let w = _mm256_shuffle_epi8(values, unpack_nibbles(block.add(IQ4_XS_QS_OFFSET + 16 * s)));
            let ls = ((scales_l >> (4 * s)) & 0x0f) as i16 | ((((scales_h >> (2 * s)) & 3) as i16) << 4);
            let y = _mm256_sign_epi8(load_y(x, 256 * b + 32 * s), w);
            qy = VnniDot::dot_scaled(qy, _mm256_abs_epi8(w), y, _mm256_set1_epi16(ls - 32));
        }
        acc = close_q6_k(acc, sum_256(qy), read_f16(block), *x.block_scales.get_unchecked(b));
    }
    acc
}

/// `sum_g scales[r][g] * sum(q * y)` per lane for `R` rows whose block `b` is unpacked in
/// element order (unsigned quants) in `unpacked[r]`, over `256 / (4 * G4)` groups of `4 * G4`
/// elements against the pack's block `b`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `i` and `r` index several arrays in step
unsafe fn scaled_groups_lanes<const R: usize, const G4: usize>(
    unpacked: &[Unpacked; R],
    scales: &[[i32; 16]; R],
    p: &LanePack,
    b: usize,
) -> [__m512i; R] {
    let mut total = [_mm512_setzero_si512(); R];
    // Four groups at a time: 4 * R dependency chains side by side.
    for g0 in (0..64 / G4).step_by(4) {
        let mut sums = [[_mm512_setzero_si512(); 4]; R];
        for k in 0..G4 {
            for i in 0..4 {
                let y = load_lanes(p, 64 * b + G4 * (g0 + i) + k);
                for r in 0..R {
                    let w = broadcast_4(unpacked[r].0.as_ptr().add(4 * G4 * (g0 + i) + 4 * k));
                    sums[r][i] = _mm512_dpbusd_epi32(sums[r][i], w, y);
                }
            }
        }
        for r in 0..R {
            for (i, sum) in sums[r].into_iter().enumerate() {
                let sc = _mm512_set1_epi32(scales[r][g0 + i]);
                total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(sum, sc));
            }
        }
    }
    total
}

/// `sum_p pairs[p] . sums[first + p]` per lane: the pack's `[i16; 2]` group sums against pairs
/// of scales (`N` pairs), exact in i32.
#[inline(always)]
unsafe fn pair_products<const N: usize>(sums: &[[i16; 2]], first: usize, scales: &[i32]) -> __m512i {
    let mut total = _mm512_setzero_si512();
    for pair in 0..N {
        let sc_pair = _mm512_set1_epi32(i16_pair(scales[2 * pair], scales[2 * pair + 1]));
        total = _mm512_dpwssd_epi32(total, load_lane_pairs(sums, first + pair), sc_pair);
    }
    total
}

/// Stores a 128-bit vector of 16 signed bytes as 16 i32.
#[inline(always)]
unsafe fn widen_i8(v: __m128i) -> [i32; 16] {
    let mut out = [0i32; 16];
    _mm512_storeu_si512(out.as_mut_ptr() as *mut __m512i, _mm512_cvtepi8_epi32(v));
    out
}

/// Q3_K against 16 tokens, `R` rows at a time over blocks `blocks`, added to `acc` (lane `t` of
/// `acc[r]` accumulates the dot of row `r` with token `t` of the pack), as
/// [`super::wide::q6_k_lanes`] with Q3_K's unpacking and an offset of 4.
#[inline(always)]
pub(super) unsafe fn q3_k_lanes<const R: usize>(
    rows: [*const u8; R],
    p: &LanePack,
    blocks: Range<usize>,
    acc: &mut [__m512; R],
) {
    let mut unpacked = [Unpacked([0; 256]); R];
    let mut scales = [[0i32; 16]; R];
    for b in blocks {
        let block = rows.map(|row| row.add(b * Q3_K_BLOCK_BYTES));
        for r in 0..R {
            let q = unpacked[r].0.as_mut_ptr();
            let hmask = broadcast_32(block[r]);
            for half in 0..2 {
                for pair in 0..2 {
                    let quants = q3_k_quants(block[r], hmask, half, pair);
                    _mm512_store_si512(q.add(128 * half + 64 * pair) as *mut __m512i, quants);
                }
            }
            scales[r] = widen_i8(q3_k_scales(block[r]));
        }
        let total = scaled_groups_lanes::<R, 4>(&unpacked, &scales, p, b);
        let y_scale = _mm512_loadu_ps(p.scales.as_ptr().add(b * LANES));
        for r in 0..R {
            let offset = pair_products::<8>(&p.sums_16, 8 * b, &scales[r]);
            let j = _mm512_sub_epi32(total[r], _mm512_slli_epi32::<2>(offset));
            let d = _mm512_mul_ps(_mm512_set1_ps(read_f16(block[r].add(Q3_K_D_OFFSET))), y_scale);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(j), d, acc[r]);
        }
    }
}

/// Q2_K against 16 tokens, `R` rows at a time over blocks `blocks`, added to `acc` as in
/// [`q3_k_lanes`]; closed as [`super::wide::q4_k_lanes`] closes Q4_K.
#[inline(always)]
pub(super) unsafe fn q2_k_lanes<const R: usize>(
    rows: [*const u8; R],
    p: &LanePack,
    blocks: Range<usize>,
    acc: &mut [__m512; R],
) {
    let mut unpacked = [Unpacked([0; 256]); R];
    let mut scales = [[0i32; 16]; R];
    let mut mins = [[0i32; 16]; R];
    for b in blocks {
        let block = rows.map(|row| row.add(b * Q2_K_BLOCK_BYTES));
        for r in 0..R {
            let q = unpacked[r].0.as_mut_ptr();
            for half in 0..2 {
                for pair in 0..2 {
                    let quants = two_bit_quants(block[r].add(Q2_K_QS_OFFSET), half, pair);
                    _mm512_store_si512(q.add(128 * half + 64 * pair) as *mut __m512i, quants);
                }
            }
            let packed = _mm_loadu_si128(block[r] as *const __m128i);
            let low_nibbles = _mm_set1_epi8(0x0f);
            scales[r] = widen_i8(_mm_and_si128(packed, low_nibbles));
            mins[r] = widen_i8(_mm_and_si128(_mm_srli_epi16::<4>(packed), low_nibbles));
        }
        let total = scaled_groups_lanes::<R, 4>(&unpacked, &scales, p, b);
        let y_scale = _mm512_loadu_ps(p.scales.as_ptr().add(b * LANES));
        for r in 0..R {
            let m = pair_products::<8>(&p.sums_16, 8 * b, &mins[r]);
            let d = _mm512_mul_ps(_mm512_set1_ps(read_f16(block[r].add(Q2_K_D_OFFSET))), y_scale);
            let dmin = _mm512_mul_ps(_mm512_set1_ps(read_f16(block[r].add(Q2_K_D_OFFSET + 2))), y_scale);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), d, acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), dmin, acc[r]);
        }
    }
}

/// IQ4_XS against 16 tokens, `R` rows at a time over blocks `blocks`, added to `acc` as in
/// [`q3_k_lanes`]: the table values stored plus 128 (unsigned), the offset of 128 taken from
/// the pack's group-of-32 sums.
#[inline(always)]
pub(super) unsafe fn iq4_xs_lanes<const R: usize>(
    rows: [*const u8; R],
    p: &LanePack,
    blocks: Range<usize>,
    acc: &mut [__m512; R],
) {
    let table = _mm_xor_si128(
        _mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i),
        _mm_set1_epi8(-128),
    );
    let values = _mm512_broadcast_i32x4(table);
    let mut unpacked = [Unpacked([0; 256]); R];
    let mut scales = [[0i32; 16]; R];
    for b in blocks {
        let block = rows.map(|row| row.add(b * IQ4_XS_BLOCK_BYTES));
        for r in 0..R {
            let q = unpacked[r].0.as_mut_ptr();
            for pair in 0..4 {
                let quants = _mm512_shuffle_epi8(values, iq4_xs_indices(block[r], pair));
                _mm512_store_si512(q.add(64 * pair) as *mut __m512i, quants);
            }
            let mut sc = [0i32; 16];
            _mm256_storeu_si256(
                sc.as_mut_ptr() as *mut __m256i,
                _mm256_cvtepi16_epi32(iq4_xs_scales(block[r])),
            );
            scales[r] = sc;
        }
        let total = scaled_groups_lanes::<R, 8>(&unpacked, &scales, p, b);
        let y_scale = _mm512_loadu_ps(p.scales.as_ptr().add(b * LANES));
        for r in 0..R {
            let offset = pair_products::<4>(&p.sums_32, 4 * b, &scales[r]);
            let j = _mm512_sub_epi32(total[r], _mm512_slli_epi32::<7>(offset));
            let d = _mm512_mul_ps(_mm512_set1_ps(read_f16(block[r])), y_scale);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(j), d, acc[r]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::test_util::Rng;
    use super::super::lowbit::unpack_q3_k_scales;
    use super::*;

    #[test]
    fn q3_k_scales_unpack_like_the_scalar_unpacking() {
        if !super::super::vnni_supported() {
            return;
        }
        let mut rng = Rng::new(21);
        for _ in 0..300 {
            let block: [u8; Q3_K_BLOCK_BYTES] = std::array::from_fn(|_| rng.next_u32() as u8);
            let packed: &[u8; 12] = block[Q3_K_SCALES_OFFSET..Q3_K_SCALES_OFFSET + 12].try_into().unwrap();
            // SAFETY: the CPU has the VNNI family's features (checked above) and the read stays
            // inside the block (bytes 94..110).
            let got: [i8; 16] = unsafe { std::mem::transmute(q3_k_scales(block.as_ptr())) };
            assert_eq!(got, unpack_q3_k_scales(packed));
        }
    }
}
