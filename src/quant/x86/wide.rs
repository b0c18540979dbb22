//! 512-bit forms of the K-quant kernels for the AVX-512 VNNI family (Q4_K and Q6_K, the types
//! of the large matrices of the Q4_K_M models here). On CPUs with full-width 512-bit units one
//! `vpmaddubsw` + `vpdpwssd` pair then covers 64 quants instead of 32, which is what the batched
//! (prefill) products are bound by. Measured on this machine's AMD Zen 5 only; on cores that
//! split 512-bit operations in two (Zen 4) they may gain less.
//!
//! Per block the integers are those of the 256-bit kernels; the float side differs: each token
//! keeps one 16-lane accumulator, and the weights' offsets (Q4_K's mins, Q6_K's 32) are taken
//! in floating point against the activations' scaled group sums (`scaled_sums_16`), which left
//! about a third of the per-block instructions of the 256-bit kernels' closing arithmetic. Each
//! token's float operations do not depend on the tile size, so a tile's results equal per-token
//! products bit for bit, as in the other kernels.

use std::arch::x86_64::*;

use super::super::layout::{unpack_k_scales, Q4_K_BLOCK_BYTES as Q4_K_BYTES, Q6_K_BLOCK_BYTES as Q6_K_BYTES};
use super::super::PreparedInput;
use super::{prefetch_block, read_f16, ByteDot};

/// The 64 activations starting at element `e` of the input.
#[inline(always)]
unsafe fn load_y64(x: &PreparedInput, e: usize) -> __m512i {
    _mm512_loadu_si512(x.quants.as_ptr().add(e) as *const __m512i)
}

/// The 32 bytes at `p` in both 256-bit halves.
#[inline(always)]
unsafe fn broadcast_32(p: *const u8) -> __m512i {
    _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i))
}

/// `acc + pair sums of q * y, each i16 pair sum multiplied by its lane's scale, quads summed`:
/// the VNNI family's `dot_scaled` on 512 bits.
#[inline(always)]
unsafe fn dot_scaled(acc: __m512i, q: __m512i, y: __m512i, scales_i16: __m512i) -> __m512i {
    _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(q, y), scales_i16)
}

/// i16 lane `j` of the result is lane `first + (j >> LOG2_PER)` of `table` (16 i16 lanes in the
/// low 256 bits): `1 << LOG2_PER` consecutive lanes share one scale.
#[inline(always)]
unsafe fn spread_scales<const LOG2_PER: u32>(table: __m512i, first: i16) -> __m512i {
    let lane = _mm512_set_epi16(
        31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
        1, 0,
    );
    let index = _mm512_add_epi16(_mm512_set1_epi16(first), _mm512_srli_epi16::<LOG2_PER>(lane));
    _mm512_permutexvar_epi16(index, table)
}

/// Sums blocks `0..n_blocks` of a tile of `NT` tokens into one `f32x16` accumulator per token
/// and reduces each to one `f32`. `$body` is run for each block `$b` with `$acc: &mut [__m512;
/// NT]`; each token's float operations do not depend on `NT`, so tiles equal single tokens.
macro_rules! sum_blocks_wide {
    ($nt:expr, $n_blocks:expr, |$b:ident, $acc:ident| $body:block) => {{
        let mut acc = [_mm512_setzero_ps(); $nt];
        for $b in 0..$n_blocks {
            let $acc = &mut acc;
            $body
        }
        acc.map(|v| _mm512_reduce_add_ps(v))
    }};
}

/// `acc + cvt(qy) * d_w * y_scale - offsets * scaled_sums_16`, the closing float arithmetic of
/// one K-quant block for one token: `offsets` holds the weights' per-group-of-16 integer offset
/// times its float scale, so the activation side needs only its prepared group sums.
#[inline(always)]
unsafe fn close_block(acc: __m512, qy: __m512i, d_w: __m512, offsets: __m512, x: &PreparedInput, b: usize) -> __m512 {
    let y_scale = _mm512_set1_ps(*x.block_scales.get_unchecked(b));
    let sums = _mm512_loadu_ps(x.scaled_sums_16.as_ptr().add(16 * b));
    let scaled = _mm512_fmadd_ps(_mm512_mul_ps(d_w, _mm512_cvtepi32_ps(qy)), y_scale, acc);
    _mm512_fnmadd_ps(offsets, sums, scaled)
}

/// Q4_K (see [`super::kquants`]): each 32-byte chunk of quants broadcast to both halves, low
/// nibbles kept in the low half and high nibbles in the high half, is the block's 64 elements
/// `64 * chunk ..` in order, against one 64-byte load of activations. The min term is
/// `dmin * m[s]` per group of 16 against the activations' scaled group sums.
#[inline(always)]
pub(super) unsafe fn dot_q4_k<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    let low_nibbles = _mm512_set1_epi8(0x0f);
    // Shift 16-bit lanes by 0 in the low half, 4 in the high half.
    let nibble_shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    sum_blocks_wide!(NT, xs[0].len() / 256, |b, acc| {
        let block = row.add(b * Q4_K_BYTES);
        prefetch_block::<NT, Q4_K_BYTES>(block);
        let d_w = _mm512_set1_ps(read_f16(block));
        let dmin_w = _mm512_set1_ps(read_f16(block.add(2)));
        let (scales, mins) = unpack_k_scales(&*(block.add(4) as *const [u8; 12]));
        let scale_table = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(scales.as_ptr() as *const __m128i)));
        let mins = _mm_loadl_epi64(mins.as_ptr() as *const __m128i);
        // m[s] for both groups of 16 of sub-block s, times dmin.
        let offsets = _mm512_mul_ps(
            dmin_w,
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(mins, mins))),
        );
        let mut qy = [_mm512_setzero_si512(); NT];
        for chunk in 0..4 {
            let packed = broadcast_32(block.add(16 + 32 * chunk));
            let q = _mm512_and_si512(_mm512_srlv_epi16(packed, nibble_shift), low_nibbles);
            let sc = spread_scales::<4>(scale_table, 2 * chunk as i16);
            for t in 0..NT {
                let y = load_y64(xs[t], 256 * b + 64 * chunk);
                qy[t] = dot_scaled(qy[t], q, y, sc);
            }
        }
        for t in 0..NT {
            acc[t] = close_block(acc[t], qy[t], d_w, offsets, xs[t], b);
        }
    })
}

/// Q6_K (see [`super::kquants`]): per half of 128, the 64 bytes of low bits give elements
/// 0..64 (low nibbles) and 64..128 (high nibbles) in order, each with its two top bits taken
/// from the broadcast `qh` shifted by a different amount in each 256-bit half. The quants are
/// stored plus 32: the offset is `32 * d * sc[g]` per group of 16.
#[inline(always)]
pub(super) unsafe fn dot_q6_k<D: ByteDot, const NT: usize>(row: *const u8, xs: &[&PreparedInput; NT]) -> [f32; NT] {
    let low_nibbles = _mm512_set1_epi8(0x0f);
    let two_bits = _mm512_set1_epi8(3);
    // Top bits of elements 0..32 / 32..64 of a half: qh >> 0 / >> 2; of 64..96 / 96..128: >> 4 / >> 6.
    let shift_a = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
    let shift_b = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(6));
    sum_blocks_wide!(NT, xs[0].len() / 256, |b, acc| {
        let block = row.add(b * Q6_K_BYTES);
        prefetch_block::<NT, Q6_K_BYTES>(block);
        let d_w = _mm512_set1_ps(read_f16(block.add(208)));
        let scales = _mm_loadu_si128(block.add(192) as *const __m128i);
        let scale_table = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(scales));
        let offsets = _mm512_mul_ps(
            _mm512_mul_ps(d_w, _mm512_set1_ps(32.0)),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scales)),
        );
        let mut qy = [_mm512_setzero_si512(); NT];
        for half in 0..2 {
            let ql = _mm512_loadu_si512(block.add(64 * half) as *const __m512i);
            let qh = broadcast_32(block.add(128 + 32 * half));
            let top = |shift: __m512i| _mm512_slli_epi16::<4>(_mm512_and_si512(_mm512_srlv_epi16(qh, shift), two_bits));
            let q_first = _mm512_or_si512(_mm512_and_si512(ql, low_nibbles), top(shift_a));
            let q_second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), low_nibbles), top(shift_b));
            let sc_first = spread_scales::<3>(scale_table, 8 * half as i16);
            let sc_second = spread_scales::<3>(scale_table, 8 * half as i16 + 4);
            for t in 0..NT {
                let e = 256 * b + 128 * half;
                qy[t] = dot_scaled(qy[t], q_first, load_y64(xs[t], e), sc_first);
                qy[t] = dot_scaled(qy[t], q_second, load_y64(xs[t], e + 64), sc_second);
            }
        }
        for t in 0..NT {
            acc[t] = close_block(acc[t], qy[t], d_w, offsets, xs[t], b);
        }
    })
}
