//! SIMD dot products of the grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)
//! against Q8_K activations. Per sub-block of 32 a kernel builds the 32 weight magnitudes from
//! four (IQ3: eight) grid entries, and the signs as a vector of ±1 that flips the activations
//! (`vpsignb`), so `|w| * (sign(w) * y)` goes through the family's unsigned-by-signed byte dot
//! with the two halves' scales `ls` as its i16 multipliers: the integer of
//! [`super::super::iq::block_integer`], exactly. Each block's integer is then scaled in `f32` by
//! [`super::super::iq::block_value`] and added to a scalar sum in block order, the scalar
//! reference's own operations, so every family equals it bit for bit (the tests use
//! `assert_eq!`). A tile of `NT` tokens builds each sub-block once for all of them.
//!
//! Saturation: the magnitudes are at most 62 (IQ3_XXS; IQ1's `8 * grid ± 1` at most 9), so a
//! `vpmaddubsw` pair is at most 2 * 62 * 127 = 15748 < 32767; a block's integer is at most
//! 256 * 62 * 31 * 127 in magnitude.

use std::arch::x86_64::*;

use super::super::grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
use super::super::iq::{self, IQ1_M_BLOCK_BYTES, IQ1_S_BLOCK_BYTES, IQ2_S_BLOCK_BYTES, IQ2_XS_BLOCK_BYTES};
use super::super::iq::{IQ2_XXS_BLOCK_BYTES, IQ3_S_BLOCK_BYTES, IQ3_XXS_BLOCK_BYTES};
use super::super::{GgmlType, PreparedInput};
use super::kquants::load_y;
use super::{bits_to_byte_mask, prefetch_block, ByteDot};

/// One sub-block, ready for the byte dot: magnitudes, the ±1 (or signed-weight) operand of
/// `vpsignb` for the activations, and the i16 scales of its two halves.
struct Sub {
    w_abs: __m256i,
    sign: __m256i,
    scales: __m256i,
}

#[inline(always)]
unsafe fn byte(block: *const u8, at: usize) -> usize {
    usize::from(*block.add(at))
}

#[inline(always)]
unsafe fn u16_at(block: *const u8, at: usize) -> u16 {
    std::ptr::read_unaligned(block.add(at) as *const u16)
}

#[inline(always)]
unsafe fn u32_at(block: *const u8, at: usize) -> u32 {
    std::ptr::read_unaligned(block.add(at) as *const u32)
}

/// ±1 per byte: -1 where bit `e` of `negative` is set.
#[inline(always)]
unsafe fn signs(negative: u32) -> __m256i {
    _mm256_or_si256(bits_to_byte_mask(negative), _mm256_set1_epi8(1))
}

/// Each 7-bit sign index's eight signs as bytes, 0xFF where negative: `KSIGNS_IQ2XS` spread
/// out, so a group of eight takes its sign mask in one load.
static SIGN_MASKS: [u64; 128] = {
    let mut masks = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        let mut j = 0;
        while j < 8 {
            if KSIGNS_IQ2XS[i] >> j & 1 == 1 {
                masks[i] |= 0xff << (8 * j);
            }
            j += 1;
        }
        i += 1;
    }
    masks
};

/// ±1 per byte for four groups of eight given by their 7-bit sign indices.
#[inline(always)]
unsafe fn signs_of(index: [usize; 4]) -> __m256i {
    let m = |l: usize| *SIGN_MASKS.get_unchecked(index[l]) as i64;
    _mm256_or_si256(_mm256_set_epi64x(m(3), m(2), m(1), m(0)), _mm256_set1_epi8(1))
}

/// The sign indices of an IQ2_XXS / IQ3_XXS sub-block's `aux` word.
#[inline(always)]
fn ksigns4(aux: u32) -> [usize; 4] {
    std::array::from_fn(|l| ((aux >> (7 * l)) & 127) as usize)
}

/// Scales `lo` for elements 0..16, `hi` for 16..32.
#[inline(always)]
unsafe fn halves(lo: i16, hi: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

/// Four grid entries of eight bytes, entry 0 in the low bytes.
#[inline(always)]
unsafe fn grid4(table: &[u64], i: [usize; 4]) -> __m256i {
    let g = |k: usize| *table.get_unchecked(i[k]) as i64;
    _mm256_set_epi64x(g(3), g(2), g(1), g(0))
}

/// Eight grid entries of four bytes.
#[inline(always)]
unsafe fn grid8(table: &[u32], i: [usize; 8]) -> __m256i {
    let g = |k: usize| *table.get_unchecked(i[k]) as i32;
    _mm256_set_epi32(g(7), g(6), g(5), g(4), g(3), g(2), g(1), g(0))
}

/// An IQ1 sub-block: `w = 8 * grid + delta` (delta ±1 per group of eight), signed.
#[inline(always)]
unsafe fn iq1(grid: __m256i, deltas: [i8; 4], scales: __m256i) -> Sub {
    let d = |l: usize| (deltas[l] as u8 as u64 * 0x0101_0101_0101_0101) as i64;
    let w = _mm256_add_epi8(
        _mm256_sign_epi8(_mm256_set1_epi8(8), grid),
        _mm256_set_epi64x(d(3), d(2), d(1), d(0)),
    );
    Sub {
        w_abs: _mm256_abs_epi8(w),
        sign: w,
        scales,
    }
}

#[inline(always)]
unsafe fn iq2_xxs(block: *const u8, s: usize) -> Sub {
    let at = 2 + 8 * s;
    let aux = u32_at(block, at + 4);
    let ls = 2 * (aux >> 28) as i16 + 1;
    Sub {
        w_abs: grid4(&IQ2XXS_GRID, std::array::from_fn(|l| byte(block, at + l))),
        sign: signs_of(ksigns4(aux)),
        scales: _mm256_set1_epi16(ls),
    }
}

#[inline(always)]
unsafe fn iq2_xs(block: *const u8, s: usize) -> Sub {
    let q: [u16; 4] = std::array::from_fn(|l| u16_at(block, 2 + 2 * (4 * s + l)));
    let sc = *block.add(66 + s);
    Sub {
        w_abs: grid4(&IQ2XS_GRID, std::array::from_fn(|l| usize::from(q[l] & 511))),
        sign: signs_of(std::array::from_fn(|l| usize::from(q[l] >> 9))),
        scales: halves(2 * i16::from(sc & 15) + 1, 2 * i16::from(sc >> 4) + 1),
    }
}

#[inline(always)]
unsafe fn iq2_s(block: *const u8, s: usize) -> Sub {
    let qh = byte(block, 66 + s);
    let sc = *block.add(74 + s);
    Sub {
        w_abs: grid4(
            &IQ2S_GRID,
            std::array::from_fn(|l| byte(block, 2 + 4 * s + l) | ((qh >> (2 * l)) & 3) << 8),
        ),
        sign: signs(u32_at(block, 34 + 4 * s)),
        scales: halves(2 * i16::from(sc & 15) + 1, 2 * i16::from(sc >> 4) + 1),
    }
}

#[inline(always)]
unsafe fn iq3_xxs(block: *const u8, s: usize) -> Sub {
    let aux = u32_at(block, 66 + 4 * s);
    Sub {
        w_abs: grid8(&IQ3XXS_GRID, std::array::from_fn(|k| byte(block, 2 + 8 * s + k))),
        sign: signs_of(ksigns4(aux)),
        scales: _mm256_set1_epi16(2 * (aux >> 28) as i16 + 1),
    }
}

#[inline(always)]
unsafe fn iq3_s(block: *const u8, s: usize) -> Sub {
    let qh = byte(block, 66 + s);
    let ls = 2 * i16::from((*block.add(106 + s / 2) >> (4 * (s % 2))) & 15) + 1;
    Sub {
        w_abs: grid8(
            &IQ3S_GRID,
            std::array::from_fn(|k| byte(block, 2 + 8 * s + k) | ((qh >> k) & 1) << 8),
        ),
        sign: signs(u32_at(block, 74 + 4 * s)),
        scales: _mm256_set1_epi16(ls),
    }
}

#[inline(always)]
unsafe fn iq1_s(block: *const u8, s: usize) -> Sub {
    let q = u16_at(block, 34 + 2 * s);
    let delta: i8 = if q & 0x8000 != 0 { -1 } else { 1 };
    let grid = grid4(
        &IQ1S_GRID,
        std::array::from_fn(|l| byte(block, 2 + 4 * s + l) | usize::from((q >> (3 * l)) & 7) << 8),
    );
    iq1(grid, [delta; 4], _mm256_set1_epi16(2 * ((q >> 12) & 7) as i16 + 1))
}

#[inline(always)]
unsafe fn iq1_m(block: *const u8, s: usize) -> Sub {
    let nibble = |l: usize| *block.add(32 + 2 * s + l / 2) >> (4 * (l % 2));
    let grid = grid4(
        &IQ1S_GRID,
        std::array::from_fn(|l| byte(block, 4 * s + l) | usize::from(nibble(l) & 7) << 8),
    );
    let deltas = std::array::from_fn(|l| if nibble(l) & 8 != 0 { -1 } else { 1 });
    let sc = u16_at(block, 48 + 2 * (s / 2)) >> (6 * (s % 2));
    iq1(
        grid,
        deltas,
        halves(2 * (sc & 7) as i16 + 1, 2 * ((sc >> 3) & 7) as i16 + 1),
    )
}

/// Sum of the eight i32 lanes (exact).
#[inline(always)]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let quad = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let pair = _mm_add_epi32(quad, _mm_unpackhi_epi64(quad, quad));
    _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32::<0b01>(pair)))
}

/// The kernel shared by the grid types: `ty`'s blocks of `BYTES`, sub-blocks built by `sub`.
#[inline(always)]
unsafe fn dot<D: ByteDot, const NT: usize, const BYTES: usize>(
    ty: GgmlType,
    row: *const u8,
    xs: &[&PreparedInput; NT],
    sub: impl Fn(*const u8, usize) -> Sub,
) -> [f32; NT] {
    let mult = iq::mult(ty);
    let mut sums = [0.0f32; NT];
    for b in 0..xs[0].len() / 256 {
        let block = row.add(b * BYTES);
        prefetch_block::<NT, BYTES>(block);
        let mut qy = [_mm256_setzero_si256(); NT];
        for s in 0..8 {
            let sub = sub(block, s);
            for t in 0..NT {
                let y = _mm256_sign_epi8(load_y(xs[t], 256 * b + 32 * s), sub.sign);
                qy[t] = D::dot_scaled(qy[t], sub.w_abs, y, sub.scales);
            }
        }
        let d = iq::block_d(ty, std::slice::from_raw_parts(block, BYTES));
        for t in 0..NT {
            let y_scale = *xs[t].block_scales.get_unchecked(b);
            sums[t] += iq::block_value(d, y_scale, hsum_epi32(qy[t]), mult);
        }
    }
    sums
}

macro_rules! grid_kernel {
    ($name:ident, $ty:ident, $bytes:ident, $sub:ident) => {
        #[doc = concat!("`", stringify!($ty), "` against Q8_K activations.")]
        #[inline(always)]
        pub(super) unsafe fn $name<D: ByteDot, const NT: usize>(
            row: *const u8,
            xs: &[&PreparedInput; NT],
        ) -> [f32; NT] {
            dot::<D, NT, $bytes>(GgmlType::$ty, row, xs, |block, s| $sub(block, s))
        }
    };
}

grid_kernel!(dot_iq2_xxs, IQ2_XXS, IQ2_XXS_BLOCK_BYTES, iq2_xxs);
grid_kernel!(dot_iq2_xs, IQ2_XS, IQ2_XS_BLOCK_BYTES, iq2_xs);
grid_kernel!(dot_iq2_s, IQ2_S, IQ2_S_BLOCK_BYTES, iq2_s);
grid_kernel!(dot_iq3_xxs, IQ3_XXS, IQ3_XXS_BLOCK_BYTES, iq3_xxs);
grid_kernel!(dot_iq3_s, IQ3_S, IQ3_S_BLOCK_BYTES, iq3_s);
grid_kernel!(dot_iq1_s, IQ1_S, IQ1_S_BLOCK_BYTES, iq1_s);
grid_kernel!(dot_iq1_m, IQ1_M, IQ1_M_BLOCK_BYTES, iq1_m);
