//! Scalar dequantization of one row: the executable statement of each block layout in
//! [`super::layout`]. Written for clarity, not speed; the engine uses it for embedding lookups and
//! the tests use it as the ground truth the quantized dot products are checked against.

use super::layout::{
    e8m0_half, iq4_xs_scale, k_scale_min, q2_k_quant, q3_k_quant, q3_k_scale, read_f16, FP4_VALUES, IQ4_VALUES,
    IQ4_XS_QS_OFFSET, Q2_K_D_OFFSET, Q2_K_QS_OFFSET, Q3_K_D_OFFSET, Q3_K_QS_OFFSET, Q3_K_SCALES_OFFSET, Q5_K_QS_OFFSET,
    Q6_K_D_OFFSET, Q6_K_QH_OFFSET, Q6_K_SCALES_OFFSET, QK_K, QK_LEGACY,
};
use super::{bf16_to_f32, f16_to_f32, GgmlType};

/// Decodes one row of `ty` into `out`. Panics unless `row.len() == ty.row_bytes(out.len())`.
pub fn dequantize_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    assert_eq!(
        Some(row.len()),
        ty.row_bytes(out.len()),
        "a {} row of {} elements",
        ty.name(),
        out.len()
    );
    let blocks = row.chunks_exact(ty.block_bytes());
    match ty {
        GgmlType::F32 => {
            for (dst, src) in out.iter_mut().zip(blocks) {
                *dst = f32::from_le_bytes(src.try_into().unwrap());
            }
        }
        GgmlType::F16 => {
            for (dst, src) in out.iter_mut().zip(blocks) {
                *dst = f16_to_f32(u16::from_le_bytes([src[0], src[1]]));
            }
        }
        GgmlType::BF16 => {
            for (dst, src) in out.iter_mut().zip(blocks) {
                *dst = bf16_to_f32(u16::from_le_bytes([src[0], src[1]]));
            }
        }
        GgmlType::Q4_0 => {
            for (dst, block) in out.chunks_exact_mut(QK_LEGACY).zip(blocks) {
                let d = read_f16(block, 0);
                for (j, &byte) in block[2..18].iter().enumerate() {
                    dst[j] = ((byte & 0x0f) as i32 - 8) as f32 * d;
                    dst[j + 16] = ((byte >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (dst, block) in out.chunks_exact_mut(QK_LEGACY).zip(blocks) {
                let (d, m) = (read_f16(block, 0), read_f16(block, 2));
                for (j, &byte) in block[4..20].iter().enumerate() {
                    dst[j] = (byte & 0x0f) as f32 * d + m;
                    dst[j + 16] = (byte >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q5_0 => {
            for (dst, block) in out.chunks_exact_mut(QK_LEGACY).zip(blocks) {
                let d = read_f16(block, 0);
                let qh = u32::from_le_bytes(block[2..6].try_into().unwrap());
                for (j, &byte) in block[6..22].iter().enumerate() {
                    let lo = (byte & 0x0f) as u32 | (((qh >> j) & 1) << 4);
                    let hi = (byte >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
                    dst[j] = (lo as i32 - 16) as f32 * d;
                    dst[j + 16] = (hi as i32 - 16) as f32 * d;
                }
            }
        }
        GgmlType::Q5_1 => {
            for (dst, block) in out.chunks_exact_mut(QK_LEGACY).zip(blocks) {
                let (d, m) = (read_f16(block, 0), read_f16(block, 2));
                let qh = u32::from_le_bytes(block[4..8].try_into().unwrap());
                for (j, &byte) in block[8..24].iter().enumerate() {
                    let lo = (byte & 0x0f) as u32 | (((qh >> j) & 1) << 4);
                    let hi = (byte >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
                    dst[j] = lo as f32 * d + m;
                    dst[j + 16] = hi as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (dst, block) in out.chunks_exact_mut(QK_LEGACY).zip(blocks) {
                let d = read_f16(block, 0);
                for (value, &q) in dst.iter_mut().zip(&block[2..34]) {
                    *value = q as i8 as f32 * d;
                }
            }
        }
        GgmlType::IQ4_NL => {
            for (dst, block) in out.chunks_exact_mut(QK_LEGACY).zip(blocks) {
                let d = read_f16(block, 0);
                for (j, &byte) in block[2..18].iter().enumerate() {
                    dst[j] = d * f32::from(IQ4_VALUES[usize::from(byte & 0x0f)]);
                    dst[j + 16] = d * f32::from(IQ4_VALUES[usize::from(byte >> 4)]);
                }
            }
        }
        GgmlType::MXFP4 => {
            for (dst, block) in out.chunks_exact_mut(QK_LEGACY).zip(blocks) {
                let d = e8m0_half(block[0]);
                for (j, &byte) in block[1..17].iter().enumerate() {
                    dst[j] = f32::from(FP4_VALUES[usize::from(byte & 0x0f)]) * d;
                    dst[j + 16] = f32::from(FP4_VALUES[usize::from(byte >> 4)]) * d;
                }
            }
        }
        GgmlType::Q2_K => {
            for (dst, block) in out.chunks_exact_mut(QK_K).zip(blocks) {
                let (d, dmin) = (read_f16(block, Q2_K_D_OFFSET), read_f16(block, Q2_K_D_OFFSET + 2));
                let qs = &block[Q2_K_QS_OFFSET..Q2_K_D_OFFSET];
                for (e, value) in dst.iter_mut().enumerate() {
                    let sc = block[e / 16];
                    let (scale, min) = (d * f32::from(sc & 0x0f), dmin * f32::from(sc >> 4));
                    *value = scale * f32::from(q2_k_quant(e, qs)) - min;
                }
            }
        }
        GgmlType::Q3_K => {
            for (dst, block) in out.chunks_exact_mut(QK_K).zip(blocks) {
                let d = read_f16(block, Q3_K_D_OFFSET);
                let hmask = &block[..Q3_K_QS_OFFSET];
                let qs = &block[Q3_K_QS_OFFSET..Q3_K_SCALES_OFFSET];
                let packed = &block[Q3_K_SCALES_OFFSET..Q3_K_D_OFFSET];
                for (e, value) in dst.iter_mut().enumerate() {
                    let scale = d * f32::from(q3_k_scale(e / 16, packed));
                    *value = scale * f32::from(q3_k_quant(e, hmask, qs) as i8 - 4);
                }
            }
        }
        GgmlType::IQ4_XS => {
            for (dst, block) in out.chunks_exact_mut(QK_K).zip(blocks) {
                let d = read_f16(block, 0);
                let scales_h = u16::from_le_bytes([block[2], block[3]]);
                for (s, (dst, qs)) in dst
                    .chunks_exact_mut(32)
                    .zip(block[IQ4_XS_QS_OFFSET..].chunks_exact(16))
                    .enumerate()
                {
                    let scale = d * f32::from(iq4_xs_scale(s, scales_h, &block[4..8]) as i8 - 32);
                    for (j, &byte) in qs.iter().enumerate() {
                        dst[j] = scale * f32::from(IQ4_VALUES[usize::from(byte & 0x0f)]);
                        dst[j + 16] = scale * f32::from(IQ4_VALUES[usize::from(byte >> 4)]);
                    }
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            for (dst, block) in out.chunks_exact_mut(QK_K).zip(blocks) {
                dequantize_k4_k5_block(ty, block, dst);
            }
        }
        GgmlType::Q6_K => {
            for (dst, block) in out.chunks_exact_mut(QK_K).zip(blocks) {
                dequantize_q6_k_block(block, dst);
            }
        }
        GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ3_XXS
        | GgmlType::IQ3_S
        | GgmlType::IQ1_S
        | GgmlType::IQ1_M => {
            for (dst, block) in out.chunks_exact_mut(QK_K).zip(blocks) {
                super::iq::dequantize_block(ty, block, dst);
            }
        }
    }
}

/// One Q4_K or Q5_K super-block (they differ only in Q5_K's fifth bits and `qs` offset).
fn dequantize_k4_k5_block(ty: GgmlType, block: &[u8], dst: &mut [f32]) {
    let (d, dmin) = (read_f16(block, 0), read_f16(block, 2));
    let packed_scales = &block[4..16];
    let (qh, qs) = if ty == GgmlType::Q5_K {
        (Some(&block[16..48]), &block[Q5_K_QS_OFFSET..])
    } else {
        (None, &block[16..])
    };
    for (e, value) in dst.iter_mut().enumerate() {
        let sub_block = e / 32;
        let byte = qs[32 * (e / 64) + e % 32];
        let mut q = if sub_block % 2 == 0 { byte & 0x0f } else { byte >> 4 };
        if let Some(qh) = qh {
            q |= ((qh[e % 32] >> sub_block) & 1) << 4;
        }
        let (sc, m) = k_scale_min(sub_block, packed_scales);
        *value = d * sc as f32 * q as f32 - dmin * m as f32;
    }
}

fn dequantize_q6_k_block(block: &[u8], dst: &mut [f32]) {
    let d = read_f16(block, Q6_K_D_OFFSET);
    let ql = &block[..Q6_K_QH_OFFSET];
    let qh = &block[Q6_K_QH_OFFSET..Q6_K_SCALES_OFFSET];
    let scales = &block[Q6_K_SCALES_OFFSET..Q6_K_D_OFFSET];
    for (e, value) in dst.iter_mut().enumerate() {
        let (half, within) = (e / 128, e % 128);
        let (quarter, l) = (within / 32, within % 32);
        // Quarters 0 and 2 read ql[l], 1 and 3 read ql[l + 32]; 2 and 3 use the high nibble.
        let low_byte = ql[64 * half + l + 32 * (quarter % 2)];
        let low = if quarter < 2 { low_byte & 0x0f } else { low_byte >> 4 };
        let high = (qh[32 * half + l] >> (2 * quarter)) & 3;
        let q = (low | (high << 4)) as i32 - 32;
        *value = d * (scales[e / 16] as i8) as f32 * q as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE_F16: [u8; 2] = 0x3c00u16.to_le_bytes();
    const HALF_F16: [u8; 2] = 0x3800u16.to_le_bytes();
    const TWO_F16: [u8; 2] = 0x4000u16.to_le_bytes();

    fn decode(ty: GgmlType, block: &[u8]) -> Vec<f32> {
        let mut out = vec![0.0; ty.block_elems() * block.len() / ty.block_bytes()];
        dequantize_row(ty, block, &mut out);
        out
    }

    #[test]
    fn float_types() {
        let row: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(decode(GgmlType::F32, &row), [1.5, -2.0]);
        assert_eq!(decode(GgmlType::F16, &[0x00, 0x3c, 0x00, 0xc0]), [1.0, -2.0]);
        assert_eq!(decode(GgmlType::BF16, &[0x80, 0x3f, 0x00, 0xc0]), [1.0, -2.0]);
    }

    #[test]
    fn q4_0_known_block() {
        // Byte j = (j + 1) << 4 | j: element j is j - 8, element j + 16 is (j + 1) % 16 - 8.
        let mut block = HALF_F16.to_vec();
        block.extend((0..16u8).map(|j| (((j + 1) % 16) << 4) | j));
        let out = decode(GgmlType::Q4_0, &block);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(out[j + 16], (((j + 1) % 16) as f32 - 8.0) * 0.5);
        }
    }

    #[test]
    fn q4_1_known_block() {
        let mut block = TWO_F16.to_vec();
        block.extend(0xbc00u16.to_le_bytes()); // m = -1
        block.extend((0..16u8).map(|j| (15 - j) << 4 | j));
        let out = decode(GgmlType::Q4_1, &block);
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 2.0 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 2.0 - 1.0);
        }
    }

    #[test]
    fn q5_0_known_block() {
        // Fifth bit set for elements 1 and 20 only.
        let mut block = ONE_F16.to_vec();
        block.extend(((1u32 << 1) | (1u32 << 20)).to_le_bytes());
        block.extend((0..16u8).map(|j| (j << 4) | j));
        let out = decode(GgmlType::Q5_0, &block);
        for j in 0..16 {
            let high_lo = if j == 1 { 16 } else { 0 };
            let high_hi = if j + 16 == 20 { 16 } else { 0 };
            assert_eq!(out[j], (j as f32 + high_lo as f32) - 16.0);
            assert_eq!(out[j + 16], (j as f32 + high_hi as f32) - 16.0);
        }
    }

    #[test]
    fn q8_0_known_block() {
        let mut block = HALF_F16.to_vec();
        block.extend((0..32i32).map(|j| (j * 8 - 128) as i8 as u8));
        let out = decode(GgmlType::Q8_0, &block);
        for (j, &v) in out.iter().enumerate() {
            assert_eq!(v, (j as f32 * 8.0 - 128.0) * 0.5);
        }
    }

    #[test]
    fn q4_k_known_block() {
        // Sub-block s has scale s + 1 and min 2s (6-bit values, exercising both packings),
        // d = 0.5, dmin = 1; the nibble of element e is e % 16.
        let scales: [u8; 8] = std::array::from_fn(|s| s as u8 + 1 + 40 * (s as u8 / 6));
        let mins: [u8; 8] = std::array::from_fn(|s| 2 * s as u8 + 17 * (s as u8 / 7));
        let mut block = HALF_F16.to_vec();
        block.extend(ONE_F16);
        block.extend(super::super::layout::pack_k_scales(&scales, &mins));
        let mut qs = [0u8; 128];
        for e in 0..256 {
            let byte = &mut qs[32 * (e / 64) + e % 32];
            *byte |= ((e % 16) as u8) << (4 * ((e / 32) % 2));
        }
        block.extend(qs);
        let out = decode(GgmlType::Q4_K, &block);
        for (e, &v) in out.iter().enumerate() {
            let s = e / 32;
            assert_eq!(v, 0.5 * scales[s] as f32 * (e % 16) as f32 - mins[s] as f32, "{e}");
        }
    }

    #[test]
    fn q5_k_known_block() {
        // As the Q4_K block, plus the fifth bit set on every odd element.
        let scales = [3u8, 1, 4, 1, 5, 9, 2, 6];
        let mins = [2u8, 7, 1, 8, 2, 8, 1, 8];
        let mut block = ONE_F16.to_vec();
        block.extend(HALF_F16);
        block.extend(super::super::layout::pack_k_scales(&scales, &mins));
        let mut qh = [0u8; 32];
        let mut qs = [0u8; 128];
        for e in 0..256 {
            let q = (e % 32) as u8;
            qs[32 * (e / 64) + e % 32] |= (q & 0x0f) << (4 * ((e / 32) % 2));
            qh[e % 32] |= (q >> 4) << (e / 32);
        }
        block.extend(qh);
        block.extend(qs);
        let out = decode(GgmlType::Q5_K, &block);
        for (e, &v) in out.iter().enumerate() {
            let s = e / 32;
            assert_eq!(v, scales[s] as f32 * (e % 32) as f32 - 0.5 * mins[s] as f32, "{e}");
        }
    }

    #[test]
    fn q5_1_known_block() {
        // d = 2, m = -1; quant of element j is (7 j) % 32 (every value 0..32 once), its fifth bit
        // in bit j of qh.
        let q: Vec<u8> = (0..32u32).map(|j| ((7 * j) % 32) as u8).collect();
        let mut block = TWO_F16.to_vec();
        block.extend(0xbc00u16.to_le_bytes());
        let qh: u32 = (0..32).map(|j| u32::from(q[j] >> 4) << j).sum();
        block.extend(qh.to_le_bytes());
        block.extend((0..16).map(|j| (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4)));
        let out = decode(GgmlType::Q5_1, &block);
        for j in 0..32 {
            assert_eq!(out[j], q[j] as f32 * 2.0 - 1.0, "{j}");
        }
        // By hand: element 9 is 63 % 32 = 31 (all five bits), 20 is 140 % 32 = 12, 0 is 0.
        assert_eq!((out[9], out[20], out[0]), (61.0, 23.0, -1.0));
    }

    /// IQ4_NL: byte j holds index j (low) and 15 - j (high): every table entry, both nibbles.
    #[test]
    fn iq4_nl_known_block() {
        const TABLE: [f32; 16] = [
            -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0,
        ];
        let mut block = HALF_F16.to_vec();
        block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let out = decode(GgmlType::IQ4_NL, &block);
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * TABLE[j], "{j}");
            assert_eq!(out[j + 16], 0.5 * TABLE[15 - j], "{j}");
        }
    }

    /// MXFP4: every FP4 code (sign bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) and E8M0 scales
    /// from the smallest (2^-127, a subnormal) to the largest.
    #[test]
    fn mxfp4_known_blocks() {
        const FP4: [f32; 16] = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        for e in [0u8, 1, 2, 100, 126, 127, 128, 130, 254, 255] {
            let mut block = vec![e];
            block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
            let out = decode(GgmlType::MXFP4, &block);
            let scale = 2f64.powi(i32::from(e) - 127);
            // Exact in f64, then rounded once to f32 (6 * 2^127 and up overflow to infinity).
            for j in 0..16 {
                assert_eq!(out[j], (FP4[j] as f64 * scale) as f32, "e={e} j={j}");
                assert_eq!(out[j + 16], (FP4[15 - j] as f64 * scale) as f32, "e={e} j={j}");
            }
            if e == 0 {
                assert_eq!(out[1], 2f32.powi(-128)); // 0.5 * 2^-127, subnormal
            }
        }
    }

    /// Q2_K, filled in ggml's loop order: two halves of 128, four shifts, two groups of 16 per
    /// shift. Group g has scale g (low nibble) and min 15 - g (high nibble): every nibble value
    /// of both; quant of element e is (e + e / 16) % 4.
    #[test]
    fn q2_k_known_block() {
        let quant = |e: usize| ((e + e / 16) % 4) as u8;
        let mut scales = [0u8; 16];
        for (g, sc) in scales.iter_mut().enumerate() {
            *sc = g as u8 | ((15 - g as u8) << 4);
        }
        let mut qs = [0u8; 64];
        let mut e = 0;
        for half in 0..2 {
            for shift in 0..4 {
                for l in 0..32 {
                    qs[32 * half + l] |= quant(e) << (2 * shift);
                    e += 1;
                }
            }
        }
        let mut block = scales.to_vec();
        block.extend(qs);
        block.extend(HALF_F16); // d
        block.extend(TWO_F16); // dmin
        let out = decode(GgmlType::Q2_K, &block);
        for (e, &v) in out.iter().enumerate() {
            let g = e / 16;
            let want = 0.5 * g as f32 * quant(e) as f32 - 2.0 * (15 - g) as f32;
            assert_eq!(v, want, "{e}");
        }
    }

    /// Q3_K: the sixteen 6-bit scales 0, 63, 1, 62, ... (signed -32..31, both ends), packed as
    /// ggml's `quantize_row_q3_K_ref` packs them; quant q (0..8) of element e is (e + e / 32) %
    /// 8, its third bit in `hmask` at bit e / 32 of byte e % 32. Value: d * (sc - 32) * (q - 4).
    #[test]
    fn q3_k_known_block() {
        let sc: [u8; 16] = std::array::from_fn(|g| if g % 2 == 0 { (g / 2) as u8 } else { 63 - (g / 2) as u8 });
        let quant = |e: usize| ((e + e / 32) % 8) as u8;
        let mut packed = [0u8; 12];
        for (j, &l) in sc.iter().enumerate() {
            if j < 8 {
                packed[j] = l & 0x0f;
            } else {
                packed[j - 8] |= (l & 0x0f) << 4;
            }
            packed[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
        }
        let mut hmask = [0u8; 32];
        let mut qs = [0u8; 64];
        for e in 0..256 {
            let q = quant(e);
            let (half, quarter, l) = (e / 128, (e % 128) / 32, e % 32);
            qs[32 * half + l] |= (q & 3) << (2 * quarter);
            hmask[l] |= (q >> 2) << (e / 32);
        }
        let mut block = hmask.to_vec();
        block.extend(qs);
        block.extend(packed);
        block.extend(TWO_F16);
        let out = decode(GgmlType::Q3_K, &block);
        for (e, &v) in out.iter().enumerate() {
            let want = 2.0 * (sc[e / 16] as f32 - 32.0) * (quant(e) as f32 - 4.0);
            assert_eq!(v, want, "{e}");
        }
        assert_eq!(out[16], 2.0 * 31.0 * (quant(16) as f32 - 4.0));
        assert_eq!(out[0], 2.0 * -32.0 * -4.0);
    }

    /// IQ4_XS: sub-block s has 6-bit scale [0, 63, 32, 31, 1, 62, 17, 48][s] (split into
    /// `scales_l` nibbles and two `scales_h` bits); index of element 32 s + j is (j + s) % 16.
    #[test]
    fn iq4_xs_known_block() {
        const TABLE: [f32; 16] = [
            -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0,
        ];
        let ls = [0u16, 63, 32, 31, 1, 62, 17, 48];
        let scales_h: u16 = (0..8).map(|s| (ls[s] >> 4) << (2 * s)).sum();
        let mut scales_l = [0u8; 4];
        for s in 0..8 {
            scales_l[s / 2] |= ((ls[s] & 0x0f) as u8) << (4 * (s % 2));
        }
        let index = |s: usize, j: usize| (j + s) % 16;
        let mut block = HALF_F16.to_vec();
        block.extend(scales_h.to_le_bytes());
        block.extend(scales_l);
        for s in 0..8 {
            block.extend((0..16).map(|j| (index(s, j) | (index(s, j + 16) << 4)) as u8));
        }
        let out = decode(GgmlType::IQ4_XS, &block);
        for (e, &v) in out.iter().enumerate() {
            let (s, j) = (e / 32, e % 32);
            let want = 0.5 * (ls[s] as f32 - 32.0) * TABLE[index(s, j)];
            assert_eq!(v, want, "{e}");
        }
    }

    #[test]
    fn q6_k_known_block() {
        // q(e) = e % 64, scale of group g = g - 8 (negative scales included), d = 2.
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for e in 0..256 {
            let q = (e % 64) as u8;
            let (half, quarter, l) = (e / 128, (e % 128) / 32, e % 32);
            ql[64 * half + l + 32 * (quarter % 2)] |= (q & 0x0f) << (4 * (quarter / 2));
            qh[32 * half + l] |= (q >> 4) << (2 * quarter);
        }
        let mut block = ql.to_vec();
        block.extend(qh);
        block.extend((0..16i8).map(|g| (g - 8) as u8));
        block.extend(TWO_F16);
        let out = decode(GgmlType::Q6_K, &block);
        for (e, &v) in out.iter().enumerate() {
            let expected = 2.0 * ((e / 16) as f32 - 8.0) * ((e % 64) as f32 - 32.0);
            assert_eq!(v, expected, "{e}");
        }
    }
}
