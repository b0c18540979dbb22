//! The 2-bit up sketch: a compact copy of a row for cheap estimates of `up·x` when choosing
//! neurons (DESIGN.md, "What the gate predicts"). Blocks of 32 values, each 12 bytes: f16 scale
//! `d`, f16 minimum `m`, then 32 two-bit codes `c` (4 per byte, lowest bits first), decoding to
//! `m + d·c`. Not a ggml type: only the selection step reads it, never the forward pass.

use super::f16_to_f32;

pub const SKETCH_BLOCK_ELEMS: usize = 32;
pub const SKETCH_BLOCK_BYTES: usize = 12;

/// Bytes of one sketched row of `n` values, or None if `n` is not a whole number of blocks.
pub fn sketch_row_bytes(n: usize) -> Option<usize> {
    n.is_multiple_of(SKETCH_BLOCK_ELEMS)
        .then_some(n / SKETCH_BLOCK_ELEMS * SKETCH_BLOCK_BYTES)
}

/// Sketch `x` into `out` (`sketch_row_bytes(x.len())` bytes): per block, min and (max-min)/3.
pub fn sketch_row(x: &[f32], out: &mut [u8]) {
    assert_eq!(sketch_row_bytes(x.len()), Some(out.len()), "sketch row length");
    for (xb, ob) in x
        .chunks_exact(SKETCH_BLOCK_ELEMS)
        .zip(out.chunks_exact_mut(SKETCH_BLOCK_BYTES))
    {
        let min = xb.iter().copied().fold(f32::INFINITY, f32::min);
        let max = xb.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = half::f16::from_f32((max - min) / 3.0);
        let m = half::f16::from_f32(min);
        let (df, mf) = (d.to_f32(), m.to_f32());
        ob[0..2].copy_from_slice(&d.to_bits().to_le_bytes());
        ob[2..4].copy_from_slice(&m.to_bits().to_le_bytes());
        ob[4..].fill(0);
        for (i, &v) in xb.iter().enumerate() {
            let c = if df > 0.0 {
                ((v - mf) / df).round().clamp(0.0, 3.0) as u8
            } else {
                0
            };
            ob[4 + i / 4] |= c << (2 * (i % 4));
        }
    }
}

/// Decode a sketched row.
pub fn sketch_dequantize(row: &[u8], out: &mut [f32]) {
    assert_eq!(sketch_row_bytes(out.len()), Some(row.len()), "sketch row length");
    for (rb, ob) in row
        .chunks_exact(SKETCH_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(SKETCH_BLOCK_ELEMS))
    {
        let d = f16_to_f32(u16::from_le_bytes([rb[0], rb[1]]));
        let m = f16_to_f32(u16::from_le_bytes([rb[2], rb[3]]));
        for (i, o) in ob.iter_mut().enumerate() {
            *o = m + d * ((rb[4 + i / 4] >> (2 * (i % 4))) & 3) as f32;
        }
    }
}

/// The estimate `sketch(row)·x`.
pub fn sketch_dot(row: &[u8], x: &[f32]) -> f32 {
    assert_eq!(sketch_row_bytes(x.len()), Some(row.len()), "sketch row length");
    let mut sum = 0f32;
    for (rb, xb) in row
        .chunks_exact(SKETCH_BLOCK_BYTES)
        .zip(x.chunks_exact(SKETCH_BLOCK_ELEMS))
    {
        let d = f16_to_f32(u16::from_le_bytes([rb[0], rb[1]]));
        let m = f16_to_f32(u16::from_le_bytes([rb[2], rb[3]]));
        let (mut dot_c, mut sum_x) = (0f32, 0f32);
        for (i, &xv) in xb.iter().enumerate() {
            dot_c += ((rb[4 + i / 4] >> (2 * (i % 4))) & 3) as f32 * xv;
            sum_x += xv;
        }
        sum += d * dot_c + m * sum_x;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sketch_round_trips_within_half_a_step_and_dot_matches_decoded() {
        let n = 64;
        let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.1).collect();
        let mut row = vec![0u8; sketch_row_bytes(n).unwrap()];
        sketch_row(&x, &mut row);
        let mut back = vec![0f32; n];
        sketch_dequantize(&row, &mut back);
        for b in 0..n / 32 {
            let blk = &x[b * 32..(b + 1) * 32];
            let step =
                (blk.iter().copied().fold(f32::MIN, f32::max) - blk.iter().copied().fold(f32::MAX, f32::min)) / 3.0;
            for i in b * 32..(b + 1) * 32 {
                assert!(
                    (back[i] - x[i]).abs() <= step / 2.0 + 1e-2,
                    "{i}: {} vs {}",
                    back[i],
                    x[i]
                );
            }
        }
        let y: Vec<f32> = (0..n).map(|i| (i as f32 * 0.3).sin()).collect();
        let decoded: f32 = back.iter().zip(&y).map(|(a, b)| a * b).sum();
        assert!((sketch_dot(&row, &y) - decoded).abs() < 1e-4);
        assert_eq!(sketch_row_bytes(33), None);
    }
}
