//! The grid types: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M (super-blocks of 256,
//! eight sub-blocks of 32). Each group of eight elements (four for IQ3) is an index into a fixed
//! grid of magnitudes ([`super::grids`]), each element has a sign bit, and each group of 16 an odd
//! integer scale `ls`. This module states where every bit lives by decoding one sub-block of 32 to
//! signed integers `w` and the two `ls` of its halves ([`decode_sub_block`]); an element's value
//! is then `d * ls * w * MULT`, with `d` the block's f16 scale and `MULT` a power of two per type
//! ([`mult`]), and the dot with Q8_K activations `y` is `d * y_scale * MULT * sum(ls * sum(w * y))`,
//! one exact integer per block. The SIMD kernels ([`super::x86`]) compute the same integer.
//!
//! Per type, for sub-block `s` (elements `32s..32s + 32`) and group of eight `l` (0..4):
//!
//! - IQ2_XXS: the eight bytes at `qs[8s..]` are four grid indices (`IQ2XXS_GRID`) then a `u32`
//!   `aux`: `ls = 2 * (aux >> 28) + 1` for the whole sub-block, the signs of group `l` are
//!   `KSIGNS_IQ2XS[(aux >> 7l) & 127]`; `MULT = 1/8`.
//! - IQ2_XS: the `u16` `qs[4s + l]` holds the 9-bit grid index (`IQ2XS_GRID`) and a 7-bit sign
//!   index on top; `scales[s]`'s low nibble `n` gives the first half's `ls = 2n + 1`, its high
//!   nibble the second's; `MULT = 1/8`.
//! - IQ2_S: the grid index (`IQ2S_GRID`) is `qs[4s + l]` with bits `2l..2l + 2` of `qh[s]` as
//!   bits 8-9, the sign byte is `signs[4s + l]` (bit `j` negates element `j`); scales as IQ2_XS;
//!   `MULT = 1/8`.
//! - IQ3_XXS: groups of four: indices `qs[8s + 2l]` and `qs[8s + 2l + 1]` (`IQ3XXS_GRID`) give
//!   the group of eight's two halves; the `u32` `scales_and_signs[s]` holds the signs and `ls` as
//!   IQ2_XXS's `aux` does; `MULT = 1/4`.
//! - IQ3_S: indices `qs[8s + 2l]`, `qs[8s + 2l + 1]` (`IQ3S_GRID`) with bits `2l` and `2l + 1` of
//!   `qh[s]` as bit 8, the sign byte `signs[4s + l]`, `ls = 2n + 1` for the nibble `s % 2` of
//!   `scales[s / 2]` (one scale for all 32); `MULT = 1`.
//! - IQ1_S: `q = qh[s]` (u16); index `qs[4s + l]` with bits `3l..3l + 3` of `q` as bits 8-10
//!   (`IQ1S_GRID`, values in {-1, 0, 1}); `ls = 2 * ((q >> 12) & 7) + 1`; every element is
//!   shifted by `-1/8` if bit 15 of `q` is set, else `+1/8`. As integers `w = 8 * grid ± 1` and
//!   `MULT = 1/8`.
//! - IQ1_M: no `d` field: the f16 `d` is the top nibbles of the four `u16` `scales`, `scales[0]`'s
//!   lowest. Index `qs[4s + l]` with the nibble `n = qh[2s + l / 2] >> (4 (l % 2))`'s low three
//!   bits as bits 8-10, and its bit 3 the sign of the `±1/8` shift of group `l`; the 3-bit scales
//!   at bits `6 (s % 2)` (first half) and `6 (s % 2) + 3` (second) of `scales[s / 2]`, `ls = 2n + 1`;
//!   `w = 8 * grid ± 1`, `MULT = 1/8`.
//!
//! None of these types can be written by this crate ([`super::quantize_row`] declines them):
//! their quantizers search the grid with an importance matrix, which a `.gst` conversion does not
//! have, so a down column of one is re-quantized into another type as for the other types
//! without a quantizer.

use super::grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
use super::layout::QK_K;
use super::{f16_to_f32, GgmlType};

pub(crate) const IQ2_XXS_BLOCK_BYTES: usize = 66;
pub(crate) const IQ2_XS_BLOCK_BYTES: usize = 74;
pub(crate) const IQ2_S_BLOCK_BYTES: usize = 82;
pub(crate) const IQ3_XXS_BLOCK_BYTES: usize = 98;
pub(crate) const IQ3_S_BLOCK_BYTES: usize = 110;
pub(crate) const IQ1_S_BLOCK_BYTES: usize = 50;
pub(crate) const IQ1_M_BLOCK_BYTES: usize = 56;

/// The power of two that turns `d * ls * w` into the element's value.
pub(crate) fn mult(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::IQ3_XXS => 0.25,
        GgmlType::IQ3_S => 1.0,
        _ => 0.125,
    }
}

/// The bits of the block's f16 scale `d` (IQ1_M's spread over the top nibbles of its scales).
#[inline]
pub(crate) fn d_bits(ty: GgmlType, block: &[u8]) -> u16 {
    if ty == GgmlType::IQ1_M {
        let sc = |i: usize| u16::from_le_bytes([block[48 + 2 * i], block[49 + 2 * i]]);
        (sc(0) >> 12) | ((sc(1) >> 8) & 0x00f0) | ((sc(2) >> 4) & 0x0f00) | (sc(3) & 0xf000)
    } else {
        u16::from_le_bytes([block[0], block[1]])
    }
}

/// The block's scale `d` as `f32`.
#[inline]
pub(crate) fn block_d(ty: GgmlType, block: &[u8]) -> f32 {
    f16_to_f32(d_bits(ty, block))
}

/// One sub-block of 32 as integers: element `j`'s value is `d * ls[j / 16] * w[j] * mult(ty)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SubBlock {
    pub(crate) w: [i8; 32],
    pub(crate) ls: [i16; 2],
}

/// Eight grid bytes (element 0 the lowest byte) with the signs of `signs` (bit `j` negates
/// element `j`) into `w[8l..8l + 8]`.
fn put8(w: &mut [i8; 32], l: usize, grid: [u8; 8], signs: u8) {
    for j in 0..8 {
        let v = grid[j] as i8;
        w[8 * l + j] = if signs >> j & 1 == 1 { -v } else { v };
    }
}

fn u16_at(block: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([block[at], block[at + 1]])
}

fn u32_at(block: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(block[at..at + 4].try_into().unwrap())
}

/// Two IQ3 grid entries (four bytes each) as one group of eight.
fn pair(a: u32, b: u32) -> [u8; 8] {
    (u64::from(a) | (u64::from(b) << 32)).to_le_bytes()
}

/// Decodes sub-block `s` (0..8) of one block of the grid type `ty`. Panics for other types or a
/// block of the wrong length.
pub(crate) fn decode_sub_block(ty: GgmlType, block: &[u8], s: usize) -> SubBlock {
    assert_eq!(block.len(), ty.block_bytes(), "one {} block", ty.name());
    assert!(s < 8);
    let mut w = [0i8; 32];
    let ls = match ty {
        GgmlType::IQ2_XXS => {
            let at = 2 + 8 * s;
            let aux = u32_at(block, at + 4);
            for l in 0..4 {
                let grid = IQ2XXS_GRID[usize::from(block[at + l])].to_le_bytes();
                put8(&mut w, l, grid, KSIGNS_IQ2XS[(aux >> (7 * l)) as usize & 127]);
            }
            let ls = 2 * (aux >> 28) as i16 + 1;
            [ls, ls]
        }
        GgmlType::IQ2_XS => {
            for l in 0..4 {
                let q = u16_at(block, 2 + 2 * (4 * s + l));
                let grid = IQ2XS_GRID[usize::from(q & 511)].to_le_bytes();
                put8(&mut w, l, grid, KSIGNS_IQ2XS[usize::from(q >> 9)]);
            }
            let sc = block[66 + s];
            [2 * i16::from(sc & 15) + 1, 2 * i16::from(sc >> 4) + 1]
        }
        GgmlType::IQ2_S => {
            let qh = usize::from(block[66 + s]);
            for l in 0..4 {
                let index = usize::from(block[2 + 4 * s + l]) | ((qh >> (2 * l)) & 3) << 8;
                put8(&mut w, l, IQ2S_GRID[index].to_le_bytes(), block[34 + 4 * s + l]);
            }
            let sc = block[74 + s];
            [2 * i16::from(sc & 15) + 1, 2 * i16::from(sc >> 4) + 1]
        }
        GgmlType::IQ3_XXS => {
            let aux = u32_at(block, 66 + 4 * s);
            for l in 0..4 {
                let a = IQ3XXS_GRID[usize::from(block[2 + 8 * s + 2 * l])];
                let b = IQ3XXS_GRID[usize::from(block[2 + 8 * s + 2 * l + 1])];
                put8(&mut w, l, pair(a, b), KSIGNS_IQ2XS[(aux >> (7 * l)) as usize & 127]);
            }
            let ls = 2 * (aux >> 28) as i16 + 1;
            [ls, ls]
        }
        GgmlType::IQ3_S => {
            let qh = usize::from(block[66 + s]);
            for l in 0..4 {
                let a = usize::from(block[2 + 8 * s + 2 * l]) | ((qh >> (2 * l)) & 1) << 8;
                let b = usize::from(block[2 + 8 * s + 2 * l + 1]) | ((qh >> (2 * l + 1)) & 1) << 8;
                put8(&mut w, l, pair(IQ3S_GRID[a], IQ3S_GRID[b]), block[74 + 4 * s + l]);
            }
            let ls = 2 * i16::from((block[106 + s / 2] >> (4 * (s % 2))) & 15) + 1;
            [ls, ls]
        }
        GgmlType::IQ1_S => {
            let q = u16_at(block, 34 + 2 * s);
            let delta: i8 = if q & 0x8000 != 0 { -1 } else { 1 };
            for l in 0..4 {
                let index = usize::from(block[2 + 4 * s + l]) | usize::from((q >> (3 * l)) & 7) << 8;
                put_iq1(&mut w, l, IQ1S_GRID[index], delta);
            }
            let ls = 2 * ((q >> 12) & 7) as i16 + 1;
            [ls, ls]
        }
        GgmlType::IQ1_M => {
            for l in 0..4 {
                let nibble = block[32 + 2 * s + l / 2] >> (4 * (l % 2));
                let index = usize::from(block[4 * s + l]) | usize::from(nibble & 7) << 8;
                let delta: i8 = if nibble & 8 != 0 { -1 } else { 1 };
                put_iq1(&mut w, l, IQ1S_GRID[index], delta);
            }
            let sc = u16_at(block, 48 + 2 * (s / 2)) >> (6 * (s % 2));
            [2 * (sc & 7) as i16 + 1, 2 * ((sc >> 3) & 7) as i16 + 1]
        }
        _ => panic!("{} is not a grid type", ty.name()),
    };
    SubBlock { w, ls }
}

/// An IQ1 group of eight: `8 * grid + delta` (the grid's bytes are -1, 0 or 1).
fn put_iq1(w: &mut [i8; 32], l: usize, grid: u64, delta: i8) {
    for (j, &g) in grid.to_le_bytes().iter().enumerate() {
        w[8 * l + j] = 8 * (g as i8) + delta;
    }
}

/// `sum_s(sum_half(ls * sum(w * y)))` over one block's eight sub-blocks: the exact integer of
/// the block's dot product with the Q8_K quants `y` (256 of them). At most 256 * 62 * 31 * 127 in
/// magnitude (IQ3_XXS), well inside `i32`.
pub(crate) fn block_integer(ty: GgmlType, block: &[u8], y: &[i8]) -> i32 {
    (0..8)
        .map(|s| {
            let sub = decode_sub_block(ty, block, s);
            let y = &y[32 * s..32 * s + 32];
            (0..2)
                .map(|h| {
                    let qy: i32 = (0..16)
                        .map(|j| i32::from(sub.w[16 * h + j]) * i32::from(y[16 * h + j]))
                        .sum();
                    i32::from(sub.ls[h]) * qy
                })
                .sum::<i32>()
        })
        .sum()
}

/// One block's dot product: `(d * y_scale) * integer * MULT`, the float operations every kernel
/// performs in this order.
#[inline]
pub(crate) fn block_value(d: f32, y_scale: f32, integer: i32, mult: f32) -> f32 {
    d * y_scale * integer as f32 * mult
}

/// Dequantizes one block into `dst` (256 values): `d * (ls * w) * MULT`, exact in `f32` (an f16
/// times an integer below 2^11, times a power of two), so equal to ggml's values bit for bit.
pub(crate) fn dequantize_block(ty: GgmlType, block: &[u8], dst: &mut [f32]) {
    debug_assert_eq!(dst.len(), QK_K);
    let d = block_d(ty, block);
    let m = mult(ty);
    for (s, dst) in dst.chunks_exact_mut(32).enumerate() {
        let sub = decode_sub_block(ty, block, s);
        for (j, value) in dst.iter_mut().enumerate() {
            *value = d * f32::from(sub.ls[j / 16] * i16::from(sub.w[j])) * m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::grids::CHECKSUMS;
    use super::*;

    fn fnv1a64(bytes: impl IntoIterator<Item = u8>) -> u64 {
        bytes.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    /// What one sub-block of a hand-built block holds: per group of eight its grid index (IQ3:
    /// per group of four, `idx[2l]` and `idx[2l + 1]`), its sign byte, its IQ1 shift sign; the
    /// raw scale field of each half (a nibble, or IQ1's three bits).
    #[derive(Clone, Copy)]
    struct Spec {
        idx: [usize; 8],
        signs: [u8; 4],
        shift_negative: [bool; 4],
        scale: [u8; 2],
    }

    /// Packs `subs` into one block of `ty` with scale bits `d`, bit by bit as ggml's structs lay
    /// them out (the inverse of the decoding under test, written field by field).
    fn encode(ty: GgmlType, d: u16, subs: &[Spec; 8]) -> Vec<u8> {
        let mut b = vec![0u8; ty.block_bytes()];
        if ty != GgmlType::IQ1_M {
            b[..2].copy_from_slice(&d.to_le_bytes());
        }
        let sign7 = |s: u8| {
            assert_eq!(KSIGNS_IQ2XS[usize::from(s & 127)], s, "{s:#x} is not a ksigns byte");
            u32::from(s & 127)
        };
        for (s, sp) in subs.iter().enumerate() {
            match ty {
                GgmlType::IQ2_XXS | GgmlType::IQ3_XXS => {
                    let mut aux = u32::from(sp.scale[0]) << 28;
                    for l in 0..4 {
                        aux |= sign7(sp.signs[l]) << (7 * l);
                    }
                    if ty == GgmlType::IQ2_XXS {
                        for l in 0..4 {
                            b[2 + 8 * s + l] = sp.idx[l] as u8;
                        }
                        b[2 + 8 * s + 4..2 + 8 * s + 8].copy_from_slice(&aux.to_le_bytes());
                    } else {
                        for k in 0..8 {
                            b[2 + 8 * s + k] = sp.idx[k] as u8;
                        }
                        b[66 + 4 * s..70 + 4 * s].copy_from_slice(&aux.to_le_bytes());
                    }
                }
                GgmlType::IQ2_XS => {
                    for l in 0..4 {
                        let q = sp.idx[l] as u16 | (sign7(sp.signs[l]) as u16) << 9;
                        b[2 + 2 * (4 * s + l)..4 + 2 * (4 * s + l)].copy_from_slice(&q.to_le_bytes());
                    }
                    b[66 + s] = sp.scale[0] | sp.scale[1] << 4;
                }
                GgmlType::IQ2_S => {
                    for l in 0..4 {
                        b[2 + 4 * s + l] = sp.idx[l] as u8;
                        b[66 + s] |= ((sp.idx[l] >> 8) as u8) << (2 * l);
                        b[34 + 4 * s + l] = sp.signs[l];
                    }
                    b[74 + s] = sp.scale[0] | sp.scale[1] << 4;
                }
                GgmlType::IQ3_S => {
                    for k in 0..8 {
                        b[2 + 8 * s + k] = sp.idx[k] as u8;
                        b[66 + s] |= ((sp.idx[k] >> 8) as u8) << k;
                    }
                    b[74 + 4 * s..78 + 4 * s].copy_from_slice(&sp.signs);
                    b[106 + s / 2] |= sp.scale[0] << (4 * (s % 2));
                }
                GgmlType::IQ1_S => {
                    let mut q = u16::from(sp.scale[0]) << 12 | u16::from(sp.shift_negative[0]) << 15;
                    for l in 0..4 {
                        b[2 + 4 * s + l] = sp.idx[l] as u8;
                        q |= ((sp.idx[l] >> 8) as u16) << (3 * l);
                    }
                    b[34 + 2 * s..36 + 2 * s].copy_from_slice(&q.to_le_bytes());
                }
                GgmlType::IQ1_M => {
                    for l in 0..4 {
                        b[4 * s + l] = sp.idx[l] as u8;
                        let nibble = (sp.idx[l] >> 8) as u8 | u8::from(sp.shift_negative[l]) << 3;
                        b[32 + 2 * s + l / 2] |= nibble << (4 * (l % 2));
                    }
                    let fields = u16::from(sp.scale[0]) | u16::from(sp.scale[1]) << 3;
                    let at = 48 + 2 * (s / 2);
                    let sc = u16::from_le_bytes([b[at], b[at + 1]]) | fields << (6 * (s % 2));
                    b[at..at + 2].copy_from_slice(&sc.to_le_bytes());
                }
                _ => unreachable!(),
            }
        }
        if ty == GgmlType::IQ1_M {
            for i in 0..4 {
                let at = 48 + 2 * i;
                let sc = u16::from_le_bytes([b[at], b[at + 1]]) | ((d >> (4 * i)) & 15) << 12;
                b[at..at + 2].copy_from_slice(&sc.to_le_bytes());
            }
        }
        b
    }

    /// The value of element `j` of sub-block `sp`, by ggml's formulas (`dequantize_row_iq*`), in
    /// f64: `d * (0.5 + n) / 4` (IQ2), `/ 2` (IQ3_XXS), `d * (1 + 2n)` (IQ3_S) or `d * (2n + 1)`
    /// with the grid value shifted by ±1/8 (IQ1), times the signed grid magnitude.
    fn expected(ty: GgmlType, d: f64, sp: &Spec, j: usize) -> f64 {
        let (l, k) = (j / 8, j % 8);
        let negative = sp.signs[l] >> k & 1 == 1;
        let sign = if negative { -1.0 } else { 1.0 };
        let byte8 = |table: &[u64]| f64::from(table[sp.idx[l]].to_le_bytes()[k]);
        let byte4 = |table: &[u32]| f64::from(table[sp.idx[2 * l + k / 4]].to_le_bytes()[k % 4]);
        let half = usize::from(j >= 16);
        let n = |h: usize| f64::from(sp.scale[h]);
        let iq1 = |scale: f64| {
            let g = f64::from(IQ1S_GRID[sp.idx[l]].to_le_bytes()[k] as i8);
            let shift = if sp.shift_negative[l] { -0.125 } else { 0.125 };
            d * (2.0 * scale + 1.0) * (g + shift)
        };
        match ty {
            GgmlType::IQ2_XXS => d * (0.5 + n(0)) * 0.25 * byte8(&IQ2XXS_GRID) * sign,
            GgmlType::IQ2_XS => d * (0.5 + n(half)) * 0.25 * byte8(&IQ2XS_GRID) * sign,
            GgmlType::IQ2_S => d * (0.5 + n(half)) * 0.25 * byte8(&IQ2S_GRID) * sign,
            GgmlType::IQ3_XXS => d * (0.5 + n(0)) * 0.5 * byte4(&IQ3XXS_GRID) * sign,
            GgmlType::IQ3_S => d * (1.0 + 2.0 * n(0)) * byte4(&IQ3S_GRID) * sign,
            GgmlType::IQ1_S => iq1(n(0)),
            GgmlType::IQ1_M => iq1(n(half)),
            _ => unreachable!(),
        }
    }

    const GRID_TYPES: [GgmlType; 7] = [
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ2_S,
        GgmlType::IQ3_XXS,
        GgmlType::IQ3_S,
        GgmlType::IQ1_S,
        GgmlType::IQ1_M,
    ];

    /// Hand-built blocks of every grid type: every grid index used once, sign bytes of every
    /// kind (none, all, alternating, random), the smallest and largest scale fields, both IQ1
    /// shifts, and the scales `d` = 1, -2, the largest f16 (65504), the smallest subnormal and 0.
    /// The dequantized row must equal ggml's formula exactly (the values are exact in f32), and
    /// the scalar dot must equal the dot of those values with the dequantized activations.
    #[test]
    fn hand_built_blocks_decode_to_ggmls_values() {
        use super::super::test_util::{dequantized_activations, Rng};
        use super::super::{dequantize_row, vec_dot_scalar, PreparedInput};
        let mut rng = Rng::new(64);
        for ty in GRID_TYPES {
            let (grid_len, per_sub, scale_max, sign_kind) = match ty {
                GgmlType::IQ2_XXS => (256, 4, 15, 0),
                GgmlType::IQ2_XS => (512, 4, 15, 0),
                GgmlType::IQ2_S => (1024, 4, 15, 1),
                GgmlType::IQ3_XXS => (256, 8, 15, 0),
                GgmlType::IQ3_S => (512, 8, 15, 1),
                _ => (2048, 4, 7, 2), // IQ1: no signs
            };
            let subs_needed = grid_len / per_sub;
            let ds = [0x3c00u16, 0xc000, 0x7bff, 0x0001, 0x0000];
            let n_blocks = (subs_needed / 8).max(ds.len());
            let mut row = Vec::new();
            let mut specs = Vec::new();
            for b in 0..n_blocks {
                let d = ds[b % ds.len()];
                let subs: [Spec; 8] = std::array::from_fn(|s| {
                    let first = ((8 * b + s) * per_sub) % grid_len;
                    let idx = std::array::from_fn(|k| if k < per_sub { first + k } else { 0 });
                    let mut pattern = |l: usize| match (s + l) % 4 {
                        0 => 0x00,
                        1 => 0xff,
                        2 => 0x55,
                        _ => rng.next_u32() as u8,
                    };
                    let signs = std::array::from_fn(|l| match sign_kind {
                        0 => KSIGNS_IQ2XS[usize::from(pattern(l)) & 127],
                        1 => pattern(l),
                        _ => 0,
                    });
                    let scale = match s % 3 {
                        0 => [0, scale_max],
                        1 => [scale_max, 0],
                        _ => [(rng.next_u32() % (scale_max as u32 + 1)) as u8; 2],
                    };
                    let scale = if matches!(ty, GgmlType::IQ2_XS | GgmlType::IQ2_S | GgmlType::IQ1_M) {
                        scale
                    } else {
                        [scale[0]; 2] // one scale for the whole sub-block
                    };
                    let shift_negative = std::array::from_fn(|l| match ty {
                        GgmlType::IQ1_S => s % 2 == 1,
                        _ => (s + l) % 2 == 1,
                    });
                    Spec {
                        idx,
                        signs,
                        shift_negative,
                        scale,
                    }
                });
                row.extend(encode(ty, d, &subs));
                specs.push((d, subs));
            }
            let n = 256 * n_blocks;
            let mut values = vec![f32::NAN; n];
            dequantize_row(ty, &row, &mut values);
            for (b, (d, subs)) in specs.iter().enumerate() {
                let d = f64::from(half::f16::from_bits(*d).to_f32());
                for (s, sp) in subs.iter().enumerate() {
                    for j in 0..32 {
                        let e = 256 * b + 32 * s + j;
                        assert_eq!(
                            f64::from(values[e]),
                            expected(ty, d, sp, j),
                            "{ty:?} block {b} sub {s} elem {j}"
                        );
                    }
                }
            }
            // The dot: against the dequantized values and activations, in f64.
            let x: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
            let mut p = PreparedInput::new();
            p.prepare(&x, ty);
            let y = dequantized_activations(&p);
            let got = f64::from(vec_dot_scalar(ty, &row, &p));
            let want: f64 = values.iter().zip(&y).map(|(&w, &y)| f64::from(w) * f64::from(y)).sum();
            let abs: f64 = values
                .iter()
                .zip(&y)
                .map(|(&w, &y)| (f64::from(w) * f64::from(y)).abs())
                .sum();
            assert!((got - want).abs() <= 1e-6 * abs, "{ty:?}: {got} vs {want}");
        }
    }

    /// Every SIMD family gives the scalar reference's result bit for bit on random rows (each
    /// block's integer is exact, and the float steps are the reference's own, in its order),
    /// for one token and through the tiles.
    #[test]
    fn simd_equals_scalar_bit_for_bit() {
        use super::super::lanes::TokenTile;
        use super::super::test_util::{random_row, Rng};
        use super::super::{vec_dot_scalar, KernelFamily, PreparedInput};
        let mut rng = Rng::new(65);
        for ty in GRID_TYPES {
            for n_elems in [256, 1536, 4096] {
                let n_rows = 3;
                let rows: Vec<u8> = (0..n_rows).flat_map(|_| random_row(&mut rng, ty, n_elems)).collect();
                let row_bytes = ty.row_bytes(n_elems).unwrap();
                let inputs: Vec<PreparedInput> = (0..11)
                    .map(|_| {
                        let x: Vec<f32> = (0..n_elems).map(|_| rng.normal()).collect();
                        let mut p = PreparedInput::new();
                        p.prepare(&x, ty);
                        p
                    })
                    .collect();
                let xs: Vec<&PreparedInput> = inputs.iter().collect();
                let tile = TokenTile::new(&xs);
                for family in KernelFamily::available() {
                    let mut tiled = vec![f32::NAN; n_rows * xs.len()];
                    family.vec_dot_tile(ty, &rows, &tile, &mut tiled);
                    for (t, x) in xs.iter().enumerate() {
                        let mut out = vec![f32::NAN; n_rows];
                        family.vec_dot_rows(ty, &rows, x, &mut out);
                        let reference: Vec<f32> =
                            rows.chunks_exact(row_bytes).map(|r| vec_dot_scalar(ty, r, x)).collect();
                        assert_eq!(out, reference, "{family:?} {ty:?} n={n_elems} t={t}");
                        assert_eq!(
                            &tiled[t * n_rows..(t + 1) * n_rows],
                            out.as_slice(),
                            "{family:?} {ty:?}"
                        );
                    }
                }
            }
        }
    }

    /// Each table's length and checksum are those the generator read from ggml's header, and
    /// the values have the shape the format gives them.
    #[test]
    fn grid_tables_are_pinned() {
        let le64 = |t: &[u64]| t.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let le32 = |t: &[u32]| t.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let tables: [(&str, Vec<u8>, usize); 7] = [
            ("KSIGNS_IQ2XS", KSIGNS_IQ2XS.to_vec(), KSIGNS_IQ2XS.len()),
            ("IQ2XXS_GRID", le64(&IQ2XXS_GRID), IQ2XXS_GRID.len()),
            ("IQ2XS_GRID", le64(&IQ2XS_GRID), IQ2XS_GRID.len()),
            ("IQ2S_GRID", le64(&IQ2S_GRID), IQ2S_GRID.len()),
            ("IQ3XXS_GRID", le32(&IQ3XXS_GRID), IQ3XXS_GRID.len()),
            ("IQ3S_GRID", le32(&IQ3S_GRID), IQ3S_GRID.len()),
            ("IQ1S_GRID", le64(&IQ1S_GRID), IQ1S_GRID.len()),
        ];
        for ((name, bytes, len), (pinned, pinned_len, sum)) in tables.into_iter().zip(CHECKSUMS) {
            assert_eq!((name, len), (pinned, pinned_len));
            assert_eq!(fnv1a64(bytes), sum, "{name}");
        }
        // Sign bytes: the low seven bits are the index, the eighth makes the count even.
        for (i, &s) in KSIGNS_IQ2XS.iter().enumerate() {
            assert_eq!(usize::from(s & 127), i);
            assert_eq!(s.count_ones() % 2, 0, "{i}");
        }
        // Magnitudes: the IQ2 grids' bytes are 8, 25 or 43, IQ3_XXS's 4, 12, .., 52, 62 and
        // IQ3_S's the odd numbers to 15 (what the kernels' saturation bounds rely on).
        for table in [&IQ2XXS_GRID[..], &IQ2XS_GRID[..], &IQ2S_GRID[..]] {
            assert!(table
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .all(|b| [8, 25, 43].contains(&b)));
        }
        let iq3xxs = [4, 12, 20, 28, 36, 44, 52, 62];
        assert!(IQ3XXS_GRID
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .all(|b| iq3xxs.contains(&b)));
        assert!(IQ3S_GRID
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .all(|b| b % 2 == 1 && b <= 15));
        assert!(IQ1S_GRID
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .all(|b| matches!(b as i8, -1..=1)));
        // Every entry of a grid differs from every other.
        let mut all: Vec<u64> = IQ1S_GRID.to_vec();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), IQ1S_GRID.len());
    }
}
