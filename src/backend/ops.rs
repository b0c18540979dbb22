//! The small per-element operations of a transformer on the CPU, in plain Rust written so the
//! compiler vectorizes it: RMSNorm, rotary embeddings, softmax, activations, f32 dot products.

use crate::config::RopeStyle;

/// Sum of products with 8 independent accumulators, so the loop vectorizes.
#[inline(always)]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for i in 0..8 {
            acc[i] += a[c * 8 + i] * b[c * 8 + i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// Dot products of `q` with four keys at once: four independent accumulator chains keep the FMA
/// units busy where one chain would wait on its own latency (head_dim is only 64–256).
#[inline(always)]
fn dot_f32_x4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let mut acc = [[0f32; 8]; 4];
    let n8 = q.len() / 8 * 8;
    for c in (0..n8).step_by(8) {
        for (a, key) in acc.iter_mut().zip(&k) {
            for i in 0..8 {
                a[i] += q[c + i] * key[c + i];
            }
        }
    }
    let mut out = [0f32; 4];
    for (o, (a, key)) in out.iter_mut().zip(acc.iter().zip(&k)) {
        *o = a.iter().sum::<f32>() + (n8..q.len()).map(|i| q[i] * key[i]).sum::<f32>();
    }
    out
}

/// Scaled dot-product attention of one query head over cached positions `positions`:
/// `out = sum_j softmax_j(scale * q·k_j) * v_j`, where position j's key for this head is
/// `keys[j * stride + offset..][..q.len()]` (values likewise). `scores` is scratch space.
#[allow(clippy::too_many_arguments)] // the cache layout is spelled out rather than bundled in a type for one caller
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    stride: usize,
    offset: usize,
    positions: std::ops::Range<usize>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVX2: OnceLock<bool> = OnceLock::new();
        if *AVX2.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            // SAFETY: the CPU has AVX2 and FMA (checked above), all the function enables.
            unsafe { attend_avx2(q, keys, values, stride, offset, positions, scale, scores, out) };
            return;
        }
    }
    attend_body(q, keys, values, stride, offset, positions, scale, scores, out);
}

/// `attend` compiled with AVX2/FMA, so the loops it inlines vectorize 8 wide (the default
/// x86-64 target only has SSE2).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_avx2(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    stride: usize,
    offset: usize,
    positions: std::ops::Range<usize>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    attend_body(q, keys, values, stride, offset, positions, scale, scores, out);
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_body(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    stride: usize,
    offset: usize,
    positions: std::ops::Range<usize>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let d = q.len();
    let key = |j: usize| &keys[j * stride + offset..j * stride + offset + d];
    scores.clear();
    let mut j = positions.start;
    while j + 4 <= positions.end {
        let s = dot_f32_x4(q, [key(j), key(j + 1), key(j + 2), key(j + 3)]);
        scores.extend(s.iter().map(|v| v * scale));
        j += 4;
    }
    for j in j..positions.end {
        scores.push(dot_f32(q, key(j)) * scale);
    }
    softmax(scores);
    out.fill(0.0);
    for (j, &p) in positions.zip(scores.iter()) {
        axpy(p, &values[j * stride + offset..j * stride + offset + d], out);
    }
}

/// `y += a * x`
#[inline(always)]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// In-place RMSNorm: x * w / sqrt(mean(x²) + eps). The sum of squares is accumulated in f64 as
/// ggml does, which keeps long hidden vectors exact enough to match the reference.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for (xi, wi) in x.iter_mut().zip(w) {
        *xi = *xi * scale * wi;
    }
}

/// Rotate one head's vector in place for position `pos`. Frequencies follow the usual
/// `theta_i = pos / scale * base^(-2i/d)`.
pub fn rope(x: &mut [f32], pos: usize, base: f32, pos_scale: f32, style: RopeStyle) {
    let d = x.len();
    let half = d / 2;
    let p = pos as f64 / pos_scale as f64;
    for i in 0..half {
        let theta = p * (base as f64).powf(-2.0 * i as f64 / d as f64);
        let (sin, cos) = (theta.sin() as f32, theta.cos() as f32);
        let (a, b) = match style {
            RopeStyle::AdjacentPairs => (2 * i, 2 * i + 1),
            RopeStyle::HalfSplit => (i, i + half),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos - x1 * sin;
        x[b] = x0 * sin + x1 * cos;
    }
}

/// Precomputed cos/sin for one position (shared by every head of a token).
pub fn rope_table(pos: usize, head_dim: usize, base: f32, pos_scale: f32, out: &mut Vec<(f32, f32)>) {
    out.clear();
    let p = pos as f64 / pos_scale as f64;
    for i in 0..head_dim / 2 {
        let theta = p * (base as f64).powf(-2.0 * i as f64 / head_dim as f64);
        out.push((theta.cos() as f32, theta.sin() as f32));
    }
}

pub fn rope_apply(x: &mut [f32], table: &[(f32, f32)], style: RopeStyle) {
    let half = x.len() / 2;
    for (i, &(cos, sin)) in table.iter().enumerate() {
        let (a, b) = match style {
            RopeStyle::AdjacentPairs => (2 * i, 2 * i + 1),
            RopeStyle::HalfSplit => (i, i + half),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos - x1 * sin;
        x[b] = x0 * sin + x1 * cos;
    }
}

/// In-place softmax.
#[inline(always)]
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (as `gelu_pytorch_tanh` and ggml's gelu).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
}

/// log(sum(exp(x))) in f64, for perplexity.
pub fn log_sum_exp(x: &[f32]) -> f64 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + s.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_styles_agree_under_the_gguf_permutation() {
        // GGUF llama files permute Q/K rows so adjacent-pair rotation of the permuted vector
        // equals half-split rotation of the original. Check that the two styles are related by
        // exactly that permutation.
        let d = 8;
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
        // permuted[2i] = x[i], permuted[2i+1] = x[i + d/2]
        let mut perm = vec![0f32; d];
        for i in 0..d / 2 {
            perm[2 * i] = x[i];
            perm[2 * i + 1] = x[i + d / 2];
        }
        let mut a = x.clone();
        rope(&mut a, 7, 10000.0, 1.0, RopeStyle::HalfSplit);
        rope(&mut perm, 7, 10000.0, 1.0, RopeStyle::AdjacentPairs);
        for i in 0..d / 2 {
            assert!((a[i] - perm[2 * i]).abs() < 1e-6);
            assert!((a[i + d / 2] - perm[2 * i + 1]).abs() < 1e-6);
        }
        let mut table = Vec::new();
        rope_table(7, d, 10000.0, 1.0, &mut table);
        let mut b = x.clone();
        rope_apply(&mut b, &table, RopeStyle::HalfSplit);
        assert_eq!(a, b);
    }

    #[test]
    fn attend_matches_naive_attention() {
        let (d, n, stride, offset) = (12, 11, 30, 6);
        let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.7).cos()).collect();
        let keys: Vec<f32> = (0..n * stride).map(|i| (i as f32 * 0.13).sin()).collect();
        let values: Vec<f32> = (0..n * stride).map(|i| (i as f32 * 0.29).cos()).collect();
        let (mut scores, mut out) = (Vec::new(), vec![0f32; d]);
        attend(&q, &keys, &values, stride, offset, 2..n, 0.5, &mut scores, &mut out);
        let mut w: Vec<f32> = (2..n)
            .map(|j| (0..d).map(|i| q[i] * keys[j * stride + offset + i]).sum::<f32>() * 0.5)
            .collect();
        softmax(&mut w);
        for i in 0..d {
            let want: f32 = (2..n).zip(&w).map(|(j, p)| p * values[j * stride + offset + i]).sum();
            assert!((out[i] - want).abs() < 1e-5, "{i}: {} vs {want}", out[i]);
        }
    }

    #[test]
    fn dot_and_softmax_match_naive() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.1).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 - i as f32 * 0.05).collect();
        let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot_f32(&a, &b) - naive).abs() < 1e-4);
        let mut s = vec![1.0, 2.0, 3.0];
        softmax(&mut s);
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(s[2] > s[1] && s[1] > s[0]);
        assert!((log_sum_exp(&[0.0, 0.0]) - 2f64.ln()).abs() < 1e-12);
    }
}
