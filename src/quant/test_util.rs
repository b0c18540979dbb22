//! Test helpers: a small deterministic RNG and random rows of every type whose quant bytes are
//! arbitrary (every bit pattern is exercised) while their f16 scales stay finite and modest.

use super::{GgmlType, PreparedInput};

/// xorshift64* — deterministic, dependency-free, good enough for test data.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(crate) fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in [0, 1).
    pub(crate) fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Roughly standard normal (sum of four uniforms, rescaled).
    pub(crate) fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform()).sum();
        (s - 2.0) * 1.732
    }
}

fn f16_le(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// A row of `n_elems` elements of `ty`: random bytes, with every f16 scale overwritten by a
/// finite value of either sign in about ±0.05 (float types get random normal values).
pub(crate) fn random_row(rng: &mut Rng, ty: GgmlType, n_elems: usize) -> Vec<u8> {
    let mut row: Vec<u8> = (0..ty.row_bytes(n_elems).unwrap())
        .map(|_| rng.next_u32() as u8)
        .collect();
    let scale = |rng: &mut Rng| f16_le((rng.uniform() - 0.5) * 0.1);
    match ty {
        GgmlType::F32 => {
            for chunk in row.chunks_exact_mut(4) {
                chunk.copy_from_slice(&rng.normal().to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for chunk in row.chunks_exact_mut(2) {
                chunk.copy_from_slice(&f16_le(rng.normal()));
            }
        }
        GgmlType::BF16 => {
            for chunk in row.chunks_exact_mut(2) {
                chunk.copy_from_slice(&half::bf16::from_f32(rng.normal()).to_bits().to_le_bytes());
            }
        }
        GgmlType::Q4_0
        | GgmlType::Q5_0
        | GgmlType::Q8_0
        | GgmlType::IQ4_NL
        | GgmlType::IQ4_XS
        | GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ3_XXS
        | GgmlType::IQ3_S
        | GgmlType::IQ1_S => {
            for block in row.chunks_exact_mut(ty.block_bytes()) {
                block[..2].copy_from_slice(&scale(rng));
            }
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => {
            for block in row.chunks_exact_mut(ty.block_bytes()) {
                block[..2].copy_from_slice(&scale(rng));
                block[2..4].copy_from_slice(&scale(rng));
            }
        }
        GgmlType::Q6_K => {
            for block in row.chunks_exact_mut(ty.block_bytes()) {
                block[208..210].copy_from_slice(&scale(rng));
            }
        }
        GgmlType::Q2_K => {
            for block in row.chunks_exact_mut(ty.block_bytes()) {
                block[80..82].copy_from_slice(&scale(rng));
                block[82..84].copy_from_slice(&scale(rng));
            }
        }
        GgmlType::Q3_K => {
            for block in row.chunks_exact_mut(ty.block_bytes()) {
                block[108..110].copy_from_slice(&scale(rng));
            }
        }
        GgmlType::IQ1_M => {
            // The f16 scale lives in the top nibbles of the four u16 scales (bytes 48..56).
            for block in row.chunks_exact_mut(ty.block_bytes()) {
                let d = u16::from_le_bytes(scale(rng));
                for i in 0..4 {
                    let at = 48 + 2 * i;
                    let sc = u16::from_le_bytes([block[at], block[at + 1]]) & 0x0fff;
                    let top = (d >> (4 * i)) & 0xf;
                    block[at..at + 2].copy_from_slice(&(sc | (top << 12)).to_le_bytes());
                }
            }
        }
        GgmlType::MXFP4 => {
            // E8M0 exponents 118..126: scales 2^-10 to 2^-2, as modest as the f16 ones.
            for block in row.chunks_exact_mut(ty.block_bytes()) {
                block[0] = 118 + (rng.next_u32() % 9) as u8;
            }
        }
    }
    row
}

/// The activations a quantized [`PreparedInput`] stands for (quant times block scale).
pub(crate) fn dequantized_activations(p: &PreparedInput) -> Vec<f32> {
    if p.quants.is_empty() {
        return p.values_f32.clone();
    }
    let block = p.len() / p.block_scales.len();
    p.quants
        .iter()
        .enumerate()
        .map(|(i, &q)| q as f32 * p.block_scales[i / block])
        .collect()
}
