//! The on-disk block layouts of the supported GGML types, byte for byte as ggml's `block_*`
//! structs in `ggml-common.h` (all multi-byte fields little-endian, blocks packed with no
//! padding, no alignment guaranteed), plus the small field readers the kernels share.
//!
//! | type | elems | bytes | fields (byte offset) | element value |
//! |------|------:|------:|----------------------|---------------|
//! | Q4_0 | 32 | 18 | `d: f16` @0, `qs: [u8; 16]` @2 | `(q - 8) * d` |
//! | Q4_1 | 32 | 20 | `d: f16` @0, `m: f16` @2, `qs: [u8; 16]` @4 | `q * d + m` |
//! | Q5_0 | 32 | 22 | `d: f16` @0, `qh: u32` @2, `qs: [u8; 16]` @6 | `(q - 16) * d` |
//! | Q5_1 | 32 | 24 | `d: f16` @0, `m: f16` @2, `qh: u32` @4, `qs: [u8; 16]` @8 | `q * d + m` |
//! | Q8_0 | 32 | 34 | `d: f16` @0, `qs: [i8; 32]` @2 | `q * d` |
//! | IQ4_NL | 32 | 18 | `d: f16` @0, `qs: [u8; 16]` @2 | `d * IQ4_VALUES[q]` |
//! | MXFP4 | 32 | 17 | `e: u8` (E8M0) @0, `qs: [u8; 16]` @1 | `2^(e - 128) * FP4_VALUES[q]` |
//! | Q2_K | 256 | 84 | `scales: [u8; 16]` @0, `qs: [u8; 64]` @16, `d: f16` @80, `dmin: f16` @82 | `d * (sc[g] & 15) * q - dmin * (sc[g] >> 4)` |
//! | Q3_K | 256 | 110 | `hmask: [u8; 32]` @0, `qs: [u8; 64]` @32, `scales: [u8; 12]` @96, `d: f16` @108 | `d * (sc[g] - 32) * (q - 4)` |
//! | Q4_K | 256 | 144 | `d: f16` @0, `dmin: f16` @2, `scales: [u8; 12]` @4, `qs: [u8; 128]` @16 | `d * sc[s] * q - dmin * m[s]` |
//! | Q5_K | 256 | 176 | as Q4_K, then `qh: [u8; 32]` @16, `qs: [u8; 128]` @48 | as Q4_K with 5-bit `q` |
//! | Q6_K | 256 | 210 | `ql: [u8; 128]` @0, `qh: [u8; 64]` @128, `scales: [i8; 16]` @192, `d: f16` @208 | `d * sc[e / 16] * (q - 32)` |
//! | IQ4_XS | 256 | 136 | `d: f16` @0, `scales_h: u16` @2, `scales_l: [u8; 4]` @4, `qs: [u8; 128]` @8 | `d * (sc[s] - 32) * IQ4_VALUES[q]` |
//! | IQ2_XXS | 256 | 66 | `d: f16` @0, `qs: [u16; 32]` @2 | `d * ls * grid * sign / 8` |
//! | IQ2_XS | 256 | 74 | `d: f16` @0, `qs: [u16; 32]` @2, `scales: [u8; 8]` @66 | `d * ls * grid * sign / 8` |
//! | IQ2_S | 256 | 82 | `d: f16` @0, `qs: [u8; 32]` @2, `signs: [u8; 32]` @34, `qh: [u8; 8]` @66, `scales: [u8; 8]` @74 | `d * ls * grid * sign / 8` |
//! | IQ3_XXS | 256 | 98 | `d: f16` @0, `qs: [u8; 64]` @2, `scales_and_signs: [u32; 8]` @66 | `d * ls * grid * sign / 4` |
//! | IQ3_S | 256 | 110 | `d: f16` @0, `qs: [u8; 64]` @2, `qh: [u8; 8]` @66, `signs: [u8; 32]` @74, `scales: [u8; 4]` @106 | `d * ls * grid * sign` |
//! | IQ1_S | 256 | 50 | `d: f16` @0, `qs: [u8; 32]` @2, `qh: [u16; 8]` @34 | `d * ls * (grid ± 1/8)` |
//! | IQ1_M | 256 | 56 | `qs: [u8; 32]` @0, `qh: [u8; 16]` @32, `scales: [u16; 4]` @48 (`d: f16` in their top nibbles) | `d * ls * (grid ± 1/8)` |
//!
//! Nibble order of the 32-element types: byte `j` of `qs` holds element `j` in its low nibble and
//! element `j + 16` in its high nibble. Q5_0's fifth bit of element `e` is bit `e` of `qh`.
//!
//! K-quant order (256 elements as four chunks of 64): in chunk `c`, element `64c + l` (`l < 32`) is
//! the low nibble of `qs[32c + l]` and element `64c + 32 + l` its high nibble; the sub-block of 32
//! is `s = e / 32`, whose 6-bit scale and min are packed into `scales` as [`unpack_k_scales`]
//! reads them. Q5_K's fifth bit of element `e` is bit `e / 32` of `qh[e % 32]`.
//!
//! Q6_K order (two halves of 128): in half `h`, for `l < 32`, elements `128h + l`, `+32`, `+64`,
//! `+96` take their low four bits from the low nibble of `ql[64h + l]`, low nibble of
//! `ql[64h + 32 + l]`, high nibble of `ql[64h + l]`, high nibble of `ql[64h + 32 + l]`, and their
//! top two bits from bits 0-1, 2-3, 4-5, 6-7 of `qh[32h + l]`.
//!
//! Q5_1 stores its quants as Q5_0 does. IQ4_NL and MXFP4 pack their 4-bit indices as Q4_0 does;
//! the index selects a value of a fixed table ([`IQ4_VALUES`], [`FP4_VALUES`]). MXFP4's scale
//! is a bare power of two (E8M0, [`e8m0_half`]).
//!
//! Q2_K and Q3_K order (two halves of 128, each four quarters of 32): element `e = 128h + 32j +
//! l` (`l < 32`) takes its two low bits from bits `2j..2j + 2` of `qs[32h + l]`; the group of
//! 16 is `g = e / 16`. Q2_K's `scales[g]` holds the group's 4-bit scale (low nibble) and 4-bit
//! min (high nibble). Q3_K's third bit of element `e` is bit `e / 32` of `hmask[e % 32]`; the
//! element's 3-bit quant `q` ([`q3_k_quant`]) stands for `q - 4`, and the sixteen 6-bit scales
//! are packed as [`q3_k_scale`] reads them.
//!
//! IQ4_XS (eight sub-blocks of 32): sub-block `s` reads its 16 index bytes at `qs[16s..]` in the
//! Q4_0 nibble order; its 6-bit scale is nibble `s % 2` of `scales_l[s / 2]` (low 4 bits) with
//! bits `2s..2s + 2` of `scales_h` on top.

//! The grid types (IQ2_*, IQ3_*, IQ1_*) store each group of eight (IQ3: four) elements as an index
//! into a fixed grid of magnitudes ([`super::grids`]), with a sign per element, and an odd integer
//! scale `ls` per group of 16 or 32; [`super::iq`] states each one's bit positions and decodes a
//! sub-block of 32 to signed integers, the form both the dequantization and the dot products use.

/// Elements per block of the 32-element ("legacy") quant types.
pub(crate) const QK_LEGACY: usize = 32;
/// Elements per K-quant super-block.
pub(crate) const QK_K: usize = 256;

pub(crate) const Q4_0_BLOCK_BYTES: usize = 18;
pub(crate) const Q4_1_BLOCK_BYTES: usize = 20;
pub(crate) const Q5_0_BLOCK_BYTES: usize = 22;
pub(crate) const Q8_0_BLOCK_BYTES: usize = 34;
pub(crate) const Q4_K_BLOCK_BYTES: usize = 144;
pub(crate) const Q5_K_BLOCK_BYTES: usize = 176;
pub(crate) const Q6_K_BLOCK_BYTES: usize = 210;
pub(crate) const Q5_1_BLOCK_BYTES: usize = 24;
pub(crate) const Q2_K_BLOCK_BYTES: usize = 84;
pub(crate) const Q3_K_BLOCK_BYTES: usize = 110;
pub(crate) const IQ4_NL_BLOCK_BYTES: usize = 18;
pub(crate) const IQ4_XS_BLOCK_BYTES: usize = 136;
pub(crate) const MXFP4_BLOCK_BYTES: usize = 17;

/// Byte offsets of Q2_K's `qs`, `d` and `dmin`.
pub(crate) const Q2_K_QS_OFFSET: usize = 16;
pub(crate) const Q2_K_D_OFFSET: usize = 80;
/// Byte offsets of Q3_K's `qs`, `scales` and `d` (`hmask` is at 0).
pub(crate) const Q3_K_QS_OFFSET: usize = 32;
pub(crate) const Q3_K_SCALES_OFFSET: usize = 96;
pub(crate) const Q3_K_D_OFFSET: usize = 108;
/// Byte offset of IQ4_XS's `qs`.
pub(crate) const IQ4_XS_QS_OFFSET: usize = 8;

/// The sixteen values a 4-bit IQ4_NL / IQ4_XS index stands for (ggml's `kvalues_iq4nl`), in
/// units of the block scale.
pub(crate) const IQ4_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The sixteen FP4 (E2M1) values of an MXFP4 index, doubled so they are integers (ggml's
/// `kvalues_mxfp4`): bit 3 is the sign, bits 0..3 the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
pub(crate) const FP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of the E8M0 scale `e` (`2^(e - 127) / 2 = 2^(e - 128)`), which multiplies the doubled
/// [`FP4_VALUES`]: exact for every `e`, `2^-128` and `2^-127` being f32 subnormals. (ggml
/// treats 255 as a number too, 2^127, rather than NaN.)
#[inline]
pub(crate) fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(u32::from(e - 1) << 23)
    }
}

/// Q3_K's signed scale of group `g` (0..16): the 6-bit value minus 32, its low four bits from
/// nibble `g / 8` of `packed[g % 8]` and its top two from bits `2 (g / 4)..` of `packed[8 + g %
/// 4]` (ggml's `kmask` shuffle in `dequantize_row_q3_K`).
#[inline]
pub(crate) fn q3_k_scale(g: usize, packed: &[u8]) -> i8 {
    let low = (packed[g % 8] >> (4 * (g / 8))) & 0x0f;
    let high = (packed[8 + g % 4] >> (2 * (g / 4))) & 3;
    (low | (high << 4)) as i8 - 32
}

/// Q3_K's unsigned quant of element `e` (0..8): the two low bits from `qs`, plus 4 if its
/// `hmask` bit is set; the element's value is `(q - 4) * scale` (ggml subtracts 4 when the bit
/// is clear, the same thing).
#[inline]
pub(crate) fn q3_k_quant(e: usize, hmask: &[u8], qs: &[u8]) -> u8 {
    let low = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
    let high = (hmask[e % 32] >> (e / 32)) & 1;
    low | (high << 2)
}

/// Q2_K's two-bit quant of element `e` (the same bit positions as Q3_K's low bits).
#[inline]
pub(crate) fn q2_k_quant(e: usize, qs: &[u8]) -> u8 {
    (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3
}

/// IQ4_XS's 6-bit scale of sub-block `s` (0..8), before subtracting 32.
#[inline]
pub(crate) fn iq4_xs_scale(s: usize, scales_h: u16, scales_l: &[u8]) -> u8 {
    ((scales_l[s / 2] >> (4 * (s % 2))) & 0x0f) | ((((scales_h >> (2 * s)) & 3) as u8) << 4)
}

/// Byte offset of Q5_K's `qs` (after d, dmin, scales and qh).
pub(crate) const Q5_K_QS_OFFSET: usize = 48;
/// Byte offset of Q6_K's `qh`, `scales` and `d`.
pub(crate) const Q6_K_QH_OFFSET: usize = 128;
pub(crate) const Q6_K_SCALES_OFFSET: usize = 192;
pub(crate) const Q6_K_D_OFFSET: usize = 208;

/// The little-endian f16 at `block[offset..offset + 2]`, as `f32`.
#[inline]
pub(crate) fn read_f16(block: &[u8], offset: usize) -> f32 {
    super::f16_to_f32(u16::from_le_bytes([block[offset], block[offset + 1]]))
}

/// The eight 6-bit scales and eight 6-bit mins packed into a Q4_K/Q5_K block's 12 `scales`
/// bytes: for sub-block `j < 4`, the scale is the low 6 bits of byte `j` and the min the low 6
/// bits of byte `j + 4`; for `j >= 4`, byte `j + 4` holds the scale's low 4 bits (low nibble) and
/// the min's low 4 bits (high nibble), and their top 2 bits are the top 2 bits of bytes `j - 4`
/// and `j` respectively. Done with word-wide masks, as the kernels call this once per block.
#[inline]
pub(crate) fn unpack_k_scales(packed: &[u8]) -> ([u8; 8], [u8; 8]) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes(packed[4 * i..4 * i + 4].try_into().unwrap());
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let scales_lo = w0 & LOW6;
    let scales_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
    let mins_lo = w1 & LOW6;
    let mins_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
    let mut scales = [0u8; 8];
    let mut mins = [0u8; 8];
    scales[..4].copy_from_slice(&scales_lo.to_le_bytes());
    scales[4..].copy_from_slice(&scales_hi.to_le_bytes());
    mins[..4].copy_from_slice(&mins_lo.to_le_bytes());
    mins[4..].copy_from_slice(&mins_hi.to_le_bytes());
    (scales, mins)
}

/// Sub-block `j`'s (scale, min) read the way ggml's `get_scale_min_k4` does, one at a time; the
/// reference [`unpack_k_scales`] is tested against.
pub(crate) fn k_scale_min(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// Inverse of [`k_scale_min`]: packs eight 6-bit scales and mins into 12 bytes.
pub(crate) fn pack_k_scales(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for j in 0..8 {
        let (sc, m) = (scales[j] & 63, mins[j] & 63);
        if j < 4 {
            packed[j] |= sc;
            packed[j + 4] |= m;
        } else {
            packed[j + 4] = (sc & 0x0f) | ((m & 0x0f) << 4);
            packed[j - 4] |= (sc >> 4) << 6;
            packed[j] |= (m >> 4) << 6;
        }
    }
    packed
}

#[cfg(test)]
mod tests {
    use super::super::test_util::Rng;
    use super::*;

    #[test]
    fn k_scales_unpack_matches_get_scale_min_and_pack_inverts_it() {
        let mut rng = Rng::new(3);
        for _ in 0..200 {
            let packed: Vec<u8> = (0..12).map(|_| rng.next_u32() as u8).collect();
            let (scales, mins) = unpack_k_scales(&packed);
            for j in 0..8 {
                assert_eq!((scales[j], mins[j]), k_scale_min(j, &packed));
            }
            assert_eq!(pack_k_scales(&scales, &mins).as_slice(), packed.as_slice());
        }
    }
}
