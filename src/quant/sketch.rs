//! The 2-bit up sketch: a compact copy of a row for cheap estimates of `up·x` when choosing
//! neurons (docs/DESIGN.md, "What the gate predicts"). Blocks of 32 values, each 12 bytes: f16 scale
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

/// `out[r] = sketch(row r)·x` for the consecutive sketched rows in `rows`, with the fastest
/// kernel this CPU has (each block's `m·Σx` is computed once per `x`, not once per row).
/// Equal to [`sketch_dot`] per row up to f32 rounding (summation order).
pub fn sketch_dots(rows: &[u8], x: &[f32], out: &mut [f32]) {
    let row_bytes = sketch_row_bytes(x.len()).expect("sketch rows need whole blocks");
    assert_eq!(rows.len(), out.len() * row_bytes, "sketch rows length");
    let sums: Vec<f32> = x.chunks_exact(SKETCH_BLOCK_ELEMS).map(|b| b.iter().sum()).collect();
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVX2: OnceLock<bool> = OnceLock::new();
        if *AVX2.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            // SAFETY: AVX2 and FMA were reported by CPUID; the lengths asserted above are the
            // bounds every load in the kernel stays within.
            unsafe { sketch_dots_avx2(rows, row_bytes, x, &sums, out) };
            return;
        }
    }
    for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
        *o = dot_with_sums(row, x, &sums);
    }
}

fn block_scales(rb: &[u8]) -> (f32, f32) {
    (
        f16_to_f32(u16::from_le_bytes([rb[0], rb[1]])),
        f16_to_f32(u16::from_le_bytes([rb[2], rb[3]])),
    )
}

fn dot_with_sums(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    let mut sum = 0f32;
    for ((rb, xb), &sx) in row
        .chunks_exact(SKETCH_BLOCK_BYTES)
        .zip(x.chunks_exact(SKETCH_BLOCK_ELEMS))
        .zip(sums)
    {
        let (d, m) = block_scales(rb);
        let dot_c: f32 = xb
            .iter()
            .enumerate()
            .map(|(i, &xv)| ((rb[4 + i / 4] >> (2 * (i % 4))) & 3) as f32 * xv)
            .sum();
        sum += d * dot_c + m * sx;
    }
    sum
}

/// Eight codes at a time: two code bytes broadcast to eight lanes, lane `i` shifted right by
/// `2i` and masked to its code, converted and multiplied with eight values of `x`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sketch_dots_avx2(rows: &[u8], row_bytes: usize, x: &[f32], sums: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    let three = _mm256_set1_epi32(3);
    for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
        let mut total = _mm256_setzero_ps();
        let mut mins = 0f32;
        for (b, rb) in row.chunks_exact(SKETCH_BLOCK_BYTES).enumerate() {
            let (d, m) = block_scales(rb);
            let mut acc = _mm256_setzero_ps();
            for k in 0..4 {
                let w = u16::from_le_bytes([rb[4 + 2 * k], rb[5 + 2 * k]]) as i32;
                let c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), shifts), three);
                // In bounds: block b's 32 values of x, x.len() = blocks * 32 (asserted).
                let xv = _mm256_loadu_ps(x.as_ptr().add(b * SKETCH_BLOCK_ELEMS + 8 * k));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), xv, acc);
            }
            total = _mm256_fmadd_ps(acc, _mm256_set1_ps(d), total);
            mins += m * sums[b];
        }
        let half = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
        let half = _mm_add_ps(half, _mm_movehl_ps(half, half));
        let one = _mm_add_ss(half, _mm_shuffle_ps(half, half, 1));
        *o = _mm_cvtss_f32(one) + mins;
    }
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

    #[test]
    fn batched_dots_match_the_reference_per_row() {
        let (n, rows) = (256, 37);
        let w: Vec<f32> = (0..n * rows)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.4) * 2.0)
            .collect();
        let mut sk = vec![0u8; rows * sketch_row_bytes(n).unwrap()];
        for (r, o) in sk.chunks_exact_mut(sketch_row_bytes(n).unwrap()).enumerate() {
            sketch_row(&w[r * n..(r + 1) * n], o);
        }
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).cos() * 1.5).collect();
        let mut got = vec![0f32; rows];
        sketch_dots(&sk, &x, &mut got);
        let scale: f32 = x.iter().map(|v| v.abs()).sum::<f32>() * 2.0;
        let sums: Vec<f32> = x.chunks_exact(32).map(|b| b.iter().sum()).collect();
        for (r, g) in got.iter().enumerate() {
            let row = &sk[r * 96..(r + 1) * 96];
            let want = sketch_dot(row, &x);
            assert!((g - want).abs() <= 1e-5 * scale, "row {r}: {g} vs {want}");
            let portable = dot_with_sums(row, &x, &sums);
            assert!((portable - want).abs() <= 1e-5 * scale, "row {r}: {portable} vs {want}");
        }
    }
}
