//! Random tensor bytes: quantized blocks written directly (random quants under fixed scales, so a
//! gigabyte takes a second, not the minutes quantizing random floats would), norms, biases and
//! routers as F32. Each tensor's bytes depend only on the seed, its name and its shape — not on
//! the order tensors are made in or the number of threads — so a GGUF and a `.gst` written from
//! the same seed hold the same weights.
//!
//! Scales: every matrix's values are centred with a standard deviation of about 0.02 × `gain`
//! (as trained transformers' are); norms are near 1, biases near 0, and a router's logits have a
//! standard deviation of about 3 for a unit-RMS input (clear expert choices, so a rounding
//! difference rarely swaps an expert).

use rayon::prelude::*;

use super::Rng;
use crate::error::{Error, Result};
use crate::quant::GgmlType;

/// Rows generated per independently seeded chunk (the unit of parallel work).
const ROWS_PER_CHUNK: usize = 64;

/// A seed for `name` under `seed` (FNV-1a of the name, mixed with the seed).
pub fn name_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    let mut r = Rng(h ^ seed.rotate_left(17));
    r.next()
}

fn f16(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

fn fill_random(rng: &mut Rng, out: &mut [u8]) {
    for chunk in out.chunks_mut(8) {
        let b = rng.next().to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Writes one random block of `ty` (values centred, standard deviation ~0.02 × gain) into `out`.
fn random_block(ty: GgmlType, gain: f32, rng: &mut Rng, out: &mut [u8]) {
    // A block's scale varies by up to ±50% around the one that gives the target spread.
    let scale = |base: f32, rng: &mut Rng| gain * base * (0.5 + rng.unit());
    let signed = |d: f32, rng: &mut Rng| if rng.unit() < 0.5 { -d } else { d };
    match ty {
        GgmlType::Q4_K => {
            // d, dmin, 12 bytes of 6-bit scales and mins (all 15), 128 bytes of 4-bit quants:
            // value = 15·d·q − 15·dmin, q in 0..16, dmin = 7.5·d centres it (std 69·d).
            let d = scale(3e-4, rng);
            out[0..2].copy_from_slice(&f16(d));
            out[2..4].copy_from_slice(&f16(7.5 * d));
            out[4..12].fill(15);
            out[12..16].fill(0xff);
            fill_random(rng, &mut out[16..144]);
        }
        GgmlType::Q5_K => {
            // As Q4_K with a fifth bit per quant (32 bytes of high bits): q in 0..32, dmin = 15.5·d.
            let d = scale(1.5e-4, rng);
            out[0..2].copy_from_slice(&f16(d));
            out[2..4].copy_from_slice(&f16(15.5 * d));
            out[4..12].fill(15);
            out[12..16].fill(0xff);
            fill_random(rng, &mut out[16..176]);
        }
        GgmlType::Q6_K => {
            // 128 bytes of low and 64 of high quant bits, 16 signed scales (16), d:
            // value = d·16·(q − 32), q in 0..64 (std 295·d).
            fill_random(rng, &mut out[0..192]);
            out[192..208].fill(16);
            let d = scale(7e-5, rng);
            out[208..210].copy_from_slice(&f16(d));
        }
        GgmlType::Q8_0 => {
            // d, 32 signed quants (std 74·d).
            let d = scale(2.8e-4, rng);
            out[0..2].copy_from_slice(&f16(d));
            fill_random(rng, &mut out[2..34]);
        }
        GgmlType::Q5_0 => {
            // d, 4 bytes of fifth bits, 16 of nibbles: value = d·(q − 16) (std 9.2·d).
            let d = scale(2.2e-3, rng);
            out[0..2].copy_from_slice(&f16(d));
            fill_random(rng, &mut out[2..22]);
        }
        GgmlType::MXFP4 => {
            // An E8M0 scale e, 32 random FP4 codes (doubled values 0..12, mean square 34.25):
            // value = 2^(e - 128)·code. The scale is a power of two: the block's is the one
            // that gives the target spread or half it (mean square 0.625 of the larger's).
            let top = (0.02 * gain / (0.625f32 * 34.25).sqrt()).log2().round() as i32;
            let e = (top + 128 - (rng.unit() < 0.5) as i32).clamp(0, 254);
            out[0] = e as u8;
            fill_random(rng, &mut out[1..17]);
        }
        GgmlType::Q4_0 => {
            // d, 16 bytes of nibbles: value = d·(q − 8) (std 4.6·d); d's sign at random centres
            // the values (the quants' mean is −0.5), as llama.cpp's signed d does.
            let d = signed(scale(4.3e-3, rng), rng);
            out[0..2].copy_from_slice(&f16(d));
            fill_random(rng, &mut out[2..18]);
        }
        GgmlType::Q5_1 => {
            // d, m, 4 bytes of fifth bits, 16 of nibbles: value = d·q + m, q in 0..32, m = −15.5·d.
            let d = scale(2.2e-3, rng);
            out[0..2].copy_from_slice(&f16(d));
            out[2..4].copy_from_slice(&f16(-15.5 * d));
            fill_random(rng, &mut out[4..24]);
        }
        GgmlType::IQ4_NL => {
            // d, 16 bytes of nibbles indexing the 16-value codebook (RMS 67, mean −5.9):
            // value = d·kvalue, d of either sign.
            let d = signed(scale(3e-4, rng), rng);
            out[0..2].copy_from_slice(&f16(d));
            fill_random(rng, &mut out[2..18]);
        }
        GgmlType::IQ4_XS => {
            // d, the scales' high bits (2 each) and low nibbles, all 33 (a sub-block scale of
            // 1), 128 bytes of codebook nibbles: value = d·kvalue, d of either sign.
            let d = signed(scale(3e-4, rng), rng);
            out[0..2].copy_from_slice(&f16(d));
            out[2..4].copy_from_slice(&0xaaaau16.to_le_bytes());
            out[4..8].fill(0x11);
            fill_random(rng, &mut out[8..136]);
        }
        GgmlType::Q2_K => {
            // 16 scale/min bytes (both 15), 64 bytes of 2-bit quants, d, dmin:
            // value = 15·d·q − 15·dmin, q in 0..4, dmin = 1.5·d centres it (std 16.8·d).
            out[0..16].fill(0xff);
            fill_random(rng, &mut out[16..80]);
            let d = scale(1.2e-3, rng);
            out[80..82].copy_from_slice(&f16(d));
            out[82..84].copy_from_slice(&f16(1.5 * d));
        }
        GgmlType::Q3_K => {
            // 32 bytes of high bits, 64 of 2-bit quants, 12 bytes of packed 6-bit scales (all
            // 40: nibbles 8, high bits 2), d: value = d·(40 − 32)·(q − 4), q in 0..8 (std 18·d),
            // d of either sign.
            fill_random(rng, &mut out[0..96]);
            out[96..104].fill(0x88);
            out[104..108].fill(0xaa);
            let d = signed(scale(1.1e-3, rng), rng);
            out[108..110].copy_from_slice(&f16(d));
        }
        GgmlType::IQ2_XXS => {
            // d, then per 32 values four grid indices and a word of four 7-bit sign indices
            // under a 4-bit scale, here 7: value = d·7.5/4·grid·sign (grid values 8, 25, 43).
            let d = scale(4.6e-4, rng);
            out[0..2].copy_from_slice(&f16(d));
            fill_random(rng, &mut out[2..66]);
            for g in 0..8 {
                let top = &mut out[2 + 8 * g + 7];
                *top = (*top & 0x0f) | 0x70;
            }
        }
        _ => unreachable!("random_block is only called for the types random_matrix accepts"),
    }
}

/// The types [`random_matrix`] makes.
pub const RANDOM_TYPES: [GgmlType; 13] = [
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::IQ2_XXS,
    GgmlType::MXFP4,
];

/// Bytes of a random `[rows, cols]` matrix of `ty` (rows of whole blocks along `cols`), made in
/// parallel chunks of rows, each seeded from `seed` and its index.
pub fn random_matrix(ty: GgmlType, rows: usize, cols: usize, gain: f32, seed: u64) -> Result<Vec<u8>> {
    if !RANDOM_TYPES.contains(&ty) {
        return Err(Error::Input(format!(
            "random weights are made as {} blocks, not {}",
            RANDOM_TYPES.map(GgmlType::name).join(", "),
            ty.name()
        )));
    }
    let row_bytes = ty
        .row_bytes(cols)
        .ok_or_else(|| Error::Input(format!("{cols} columns are not a whole number of {} blocks", ty.name())))?;
    let (block_elems, block_bytes) = (ty.block_elems(), ty.block_bytes());
    let len = rows
        .checked_mul(row_bytes)
        .ok_or_else(|| Error::Input(format!("a {rows} x {cols} matrix does not fit in memory")))?;
    let mut out = vec![0u8; len];
    out.par_chunks_mut(ROWS_PER_CHUNK * row_bytes)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut rng = Rng(seed ^ (c as u64).wrapping_mul(0xd6e8_feb8_6659_fd93));
            for block in chunk.chunks_exact_mut(block_bytes) {
                random_block(ty, gain, &mut rng, block);
            }
        });
    debug_assert_eq!(cols % block_elems, 0);
    Ok(out)
}

/// A norm's weights: about 1 (1 + 0.05·N(0,1)).
pub fn random_norm(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..len).map(|_| 1.0 + 0.05 * rng.normal()).collect()
}

/// A bias: about 0 (0.1·N(0,1)).
pub fn random_bias(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..len).map(|_| 0.1 * rng.normal()).collect()
}

/// gpt-oss's attention sinks, one logit per head: about 3 (3 + 1.5·N(0,1)), so each takes a
/// share of its head's probability comparable to a window's positions' (they matter).
pub fn random_sinks(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..len).map(|_| 3.0 + 1.5 * rng.normal()).collect()
}

/// A router `[experts, hidden]`: logits of standard deviation ~3 for a unit-RMS input (the
/// norm before it is ~1, so each row's values are N(0, 1) · 3 / sqrt(hidden)).
pub fn random_router(experts: usize, hidden: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    let s = 3.0 / (hidden as f32).sqrt();
    (0..experts * hidden).map(|_| rng.normal() * s).collect()
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A quantized matrix's bytes decoded to F32 (the same weights, stored exactly).
pub fn dequantized_bytes(ty: GgmlType, bytes: &[u8], cols: usize) -> Vec<u8> {
    let row_bytes = ty.row_bytes(cols).expect("rows of whole blocks");
    let mut row = vec![0f32; cols];
    let mut out = Vec::with_capacity(bytes.len() / row_bytes * cols * 4);
    for r in bytes.chunks_exact(row_bytes) {
        crate::quant::dequantize_row(ty, r, &mut row);
        out.extend(row.iter().flat_map(|v| v.to_le_bytes()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_matrices_are_centred_near_the_target_spread_and_reproducible() {
        for ty in RANDOM_TYPES {
            let (rows, cols) = (130, 512);
            let a = random_matrix(ty, rows, cols, 1.0, 7).unwrap();
            assert_eq!(a, random_matrix(ty, rows, cols, 1.0, 7).unwrap(), "{ty:?}");
            assert_ne!(a, random_matrix(ty, rows, cols, 1.0, 8).unwrap(), "{ty:?}");
            let f: Vec<f32> = dequantized_bytes(ty, &a, cols)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let n = f.len() as f64;
            let mean = f.iter().map(|&v| v as f64).sum::<f64>() / n;
            let std = (f.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            // Q5_0's quants (−16..15) are not symmetric about zero: random ones are off centre
            // by a twentieth of the spread.
            assert!(mean.abs() < 0.06 * std, "{ty:?}: mean {mean}");
            assert!((0.017..0.026).contains(&std), "{ty:?}: std {std}");
            assert!(f.iter().all(|v| v.is_finite()));
        }
        assert!(random_matrix(GgmlType::F16, 4, 64, 1.0, 1).is_err());
        assert_ne!(name_seed(1, "blk.0.ffn_up.weight"), name_seed(1, "blk.1.ffn_up.weight"));
    }
}
