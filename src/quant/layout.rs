//! The on-disk block layouts of the supported GGML types, byte for byte as ggml's `block_*`
//! structs in `ggml-common.h` (all multi-byte fields little-endian, blocks packed with no
//! padding, no alignment guaranteed), plus the small field readers the kernels share.
//!
//! | type | elems | bytes | fields (byte offset) | element value |
//! |------|------:|------:|----------------------|---------------|
//! | Q4_0 | 32 | 18 | `d: f16` @0, `qs: [u8; 16]` @2 | `(q - 8) * d` |
//! | Q4_1 | 32 | 20 | `d: f16` @0, `m: f16` @2, `qs: [u8; 16]` @4 | `q * d + m` |
//! | Q5_0 | 32 | 22 | `d: f16` @0, `qh: u32` @2, `qs: [u8; 16]` @6 | `(q - 16) * d` |
//! | Q8_0 | 32 | 34 | `d: f16` @0, `qs: [i8; 32]` @2 | `q * d` |
//! | Q4_K | 256 | 144 | `d: f16` @0, `dmin: f16` @2, `scales: [u8; 12]` @4, `qs: [u8; 128]` @16 | `d * sc[s] * q - dmin * m[s]` |
//! | Q5_K | 256 | 176 | as Q4_K, then `qh: [u8; 32]` @16, `qs: [u8; 128]` @48 | as Q4_K with 5-bit `q` |
//! | Q6_K | 256 | 210 | `ql: [u8; 128]` @0, `qh: [u8; 64]` @128, `scales: [i8; 16]` @192, `d: f16` @208 | `d * sc[e / 16] * (q - 32)` |
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
