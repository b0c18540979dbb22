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
/// `sink`: an attention sink's logit (gpt-oss), one more term of the softmax's sum with no value
/// (ggml's `soft_max` with sinks): the probabilities then sum to less than one.
#[allow(clippy::too_many_arguments)] // the cache layout is spelled out rather than bundled in a type for one caller
pub fn attend(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    stride: usize,
    offset: usize,
    positions: std::ops::Range<usize>,
    scale: f32,
    sink: Option<f32>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVX2: OnceLock<bool> = OnceLock::new();
        if *AVX2.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            // SAFETY: the CPU has AVX2 and FMA (checked above), all the function enables.
            unsafe { attend_avx2(q, keys, values, stride, offset, positions, scale, sink, scores, out) };
            return;
        }
    }
    attend_body(q, keys, values, stride, offset, positions, scale, sink, scores, out);
}

/// `attend` with AVX2/FMA: explicit vector kernels for head sizes that are a multiple of 8 (every
/// model here: 64-256), else the plain loops compiled for these features (the default x86-64
/// target only has SSE2). The plain loops' value sum was a load, multiply, add and store per 8
/// values per position; here each 64 values of the output stay in registers over all positions.
/// Every float operation is the plain loops' own, in their order (multiply then add, no fused
/// multiply-add; lanes summed first to last), so the result is theirs bit for bit: a model's
/// activations are quantized to 8 bits before each product, which turns any last-bit change
/// into visibly different tokens on small models.
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
    sink: Option<f32>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let d = q.len();
    if !d.is_multiple_of(8) || d == 0 {
        attend_body(q, keys, values, stride, offset, positions, scale, sink, scores, out);
        return;
    }
    assert_eq!(out.len(), d, "one head's output");
    let last = positions.end.checked_sub(1).map_or(0, |j| j * stride + offset + d);
    assert!(
        positions.is_empty() || (last <= keys.len() && last <= values.len()),
        "positions past the cache"
    );
    // SAFETY (every load and store below): key/value j spans `j * stride + offset .. + d`, inside
    // both caches for every j in `positions` (asserted above for the last, which is the
    // furthest); `q` and `out` have `d` elements, a multiple of 8.
    use std::arch::x86_64::*;
    let key = |j: usize| keys.as_ptr().add(j * stride + offset);
    scores.clear();
    let mut j = positions.start;
    while j + 4 <= positions.end {
        let k = [key(j), key(j + 1), key(j + 2), key(j + 3)];
        let mut acc = [_mm256_setzero_ps(); 4];
        for c in (0..d).step_by(8) {
            let qv = _mm256_loadu_ps(q.as_ptr().add(c));
            for (a, k) in acc.iter_mut().zip(&k) {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(qv, _mm256_loadu_ps(k.add(c))));
            }
        }
        scores.extend(acc.map(|a| lane_sum(a) * scale));
        j += 4;
    }
    for j in j..positions.end {
        let mut acc = _mm256_setzero_ps();
        for c in (0..d).step_by(8) {
            let qk = _mm256_mul_ps(_mm256_loadu_ps(q.as_ptr().add(c)), _mm256_loadu_ps(key(j).add(c)));
            acc = _mm256_add_ps(acc, qk);
        }
        scores.push(lane_sum(acc) * scale);
    }
    softmax_sink(scores, sink);
    // out = sum_j p_j v_j, 64 (or the last 8..56) values at a time held in registers.
    let value = |j: usize| values.as_ptr().add(j * stride + offset);
    let mut c0 = 0;
    while c0 < d {
        let width = (d - c0).min(64);
        let mut acc = [_mm256_setzero_ps(); 8];
        for (j, &p) in positions.clone().zip(scores.iter()) {
            let (p, v) = (_mm256_set1_ps(p), value(j).add(c0));
            for (i, a) in acc.iter_mut().enumerate().take(width / 8) {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(p, _mm256_loadu_ps(v.add(8 * i))));
            }
        }
        for (i, a) in acc.iter().enumerate().take(width / 8) {
            _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * i), *a);
        }
        c0 += width;
    }
}

/// The eight lanes summed first to last, as the plain loops' `iter().sum()` does.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn lane_sum(v: std::arch::x86_64::__m256) -> f32 {
    let mut lanes = [0f32; 8];
    std::arch::x86_64::_mm256_storeu_ps(lanes.as_mut_ptr(), v);
    lanes.iter().sum()
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
    sink: Option<f32>,
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
    softmax_sink(scores, sink);
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

/// Precomputed cos/sin for one position (shared by every head of a token); `factors` divide
/// each pair's angle (Llama 3.1+'s frequency factors).
pub fn rope_table(
    pos: usize,
    head_dim: usize,
    base: f32,
    pos_scale: f32,
    factors: Option<&[f32]>,
    out: &mut Vec<(f32, f32)>,
) {
    out.clear();
    let p = pos as f64 / pos_scale as f64;
    for i in 0..head_dim / 2 {
        let mut theta = p * (base as f64).powf(-2.0 * i as f64 / head_dim as f64);
        if let Some(f) = factors {
            theta /= f[i] as f64;
        }
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

/// In-place softmax with an optional sink: `sink`'s logit joins the maximum and the sum (as in
/// ggml's `soft_max` with sinks) but gets no probability of its own, so the others sum to less
/// than one.
#[inline(always)]
pub fn softmax_sink(x: &mut [f32], sink: Option<f32>) {
    let Some(sink) = sink else {
        return softmax(x);
    };
    let max = x.iter().copied().fold(sink, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum += (sink - max).exp();
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
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

/// GELU, tanh approximation (as `gelu_pytorch_tanh` and ggml's gelu):
/// `0.5 x (1 + tanh(u))`, computed as the equal `x / (1 + exp(-2u))` — one `exp` instead of
/// libm's `tanhf` (which calls `expm1f`), a sixth of Gemma's prefill time.
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x);
    x / (1.0 + (-2.0 * u).exp())
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
        rope_table(7, d, 10000.0, 1.0, None, &mut table);
        let mut b = x.clone();
        rope_apply(&mut b, &table, RopeStyle::HalfSplit);
        assert_eq!(a, b);
    }

    #[test]
    fn rope_factors_divide_each_pairs_angle() {
        // Every factor f: positions divided by f (linear scaling), bit for bit.
        let (d, pos) = (16, 1234);
        let (mut scaled, mut factored) = (Vec::new(), Vec::new());
        rope_table(pos, d, 500000.0, 8.0, None, &mut scaled);
        rope_table(pos, d, 500000.0, 1.0, Some(&[8.0; 8]), &mut factored);
        for (a, b) in scaled.iter().zip(&factored) {
            assert!((a.0 - b.0).abs() < 1e-6 && (a.1 - b.1).abs() < 1e-6, "{a:?} vs {b:?}");
        }
        // Each pair by its own factor: pair 3's angle divided by 5, the others untouched.
        let mut f = [1.0f32; 8];
        f[3] = 5.0;
        let (mut plain, mut one) = (Vec::new(), Vec::new());
        rope_table(pos, d, 500000.0, 1.0, None, &mut plain);
        rope_table(pos, d, 500000.0, 1.0, Some(&f), &mut one);
        for i in 0..8 {
            if i == 3 {
                let theta = pos as f64 * 500000f64.powf(-2.0 * 3.0 / d as f64) / 5.0;
                assert_eq!(one[i], (theta.cos() as f32, theta.sin() as f32));
                assert_ne!(one[i], plain[i]);
            } else {
                assert_eq!(one[i], plain[i]);
            }
        }
    }

    #[test]
    fn attend_matches_naive_attention() {
        let (d, n, stride, offset) = (12, 11, 30, 6);
        let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.7).cos()).collect();
        let keys: Vec<f32> = (0..n * stride).map(|i| (i as f32 * 0.13).sin()).collect();
        let values: Vec<f32> = (0..n * stride).map(|i| (i as f32 * 0.29).cos()).collect();
        let (mut scores, mut out) = (Vec::new(), vec![0f32; d]);
        attend(
            &q,
            &keys,
            &values,
            stride,
            offset,
            2..n,
            0.5,
            None,
            &mut scores,
            &mut out,
        );
        let mut w: Vec<f32> = (2..n)
            .map(|j| (0..d).map(|i| q[i] * keys[j * stride + offset + i]).sum::<f32>() * 0.5)
            .collect();
        softmax(&mut w);
        for i in 0..d {
            let want: f32 = (2..n).zip(&w).map(|(j, p)| p * values[j * stride + offset + i]).sum();
            assert!((out[i] - want).abs() < 1e-5, "{i}: {} vs {want}", out[i]);
        }
    }

    /// An attention sink is one more logit in the softmax with no value: the output is the plain
    /// attention's times `sum / (sum + exp(sink))` (both kernels), a very negative sink changes
    /// nothing, and a large one drives the output to zero.
    #[test]
    fn attention_sink_takes_mass_and_adds_no_value() {
        for d in [12, 64] {
            let (n, stride, offset) = (9, 2 * d, d / 2);
            let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.7).cos()).collect();
            let keys: Vec<f32> = (0..n * stride).map(|i| (i as f32 * 0.13).sin()).collect();
            let values: Vec<f32> = (0..n * stride).map(|i| (i as f32 * 0.29).cos()).collect();
            let mut scores = Vec::new();
            let run = |sink: Option<f32>, scores: &mut Vec<f32>| {
                let mut out = vec![0f32; d];
                attend(&q, &keys, &values, stride, offset, 1..n, 0.3, sink, scores, &mut out);
                out
            };
            let plain = run(None, &mut scores);
            let logits: Vec<f64> = (1..n)
                .map(|j| {
                    (0..d)
                        .map(|i| q[i] as f64 * keys[j * stride + offset + i] as f64)
                        .sum::<f64>()
                        * 0.3
                })
                .collect();
            let sum: f64 = logits.iter().map(|l| l.exp()).sum();
            for sink in [-0.5f32, 0.0, 1.5] {
                let with = run(Some(sink), &mut scores);
                let kept = sum / (sum + (sink as f64).exp());
                for i in 0..d {
                    let want = plain[i] as f64 * kept;
                    assert!(
                        (with[i] as f64 - want).abs() < 1e-5,
                        "d {d} sink {sink} [{i}]: {} vs {want}",
                        with[i]
                    );
                }
                assert_ne!(with, plain);
            }
            assert_eq!(run(Some(-1e4), &mut scores), plain);
            assert!(run(Some(80.0), &mut scores).iter().all(|v| v.abs() < 1e-20));
        }
    }

    /// The vector kernels (head sizes a multiple of 8, 64 values per register pass, key groups
    /// of four and a tail) against the same naive attention, windows starting anywhere, and
    /// bit for bit against the plain loops.
    #[test]
    fn attend_matches_naive_attention_for_model_head_sizes() {
        for (d, n, first) in [(8, 1, 0), (64, 9, 3), (128, 37, 0), (136, 6, 2), (256, 23, 5)] {
            let (stride, offset) = (3 * d, d);
            let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.7).cos()).collect();
            let keys: Vec<f32> = (0..n * stride).map(|i| (i as f32 * 0.13).sin()).collect();
            let values: Vec<f32> = (0..n * stride).map(|i| (i as f32 * 0.29).cos()).collect();
            let (mut scores, mut out) = (Vec::new(), vec![f32::NAN; d]);
            attend(
                &q,
                &keys,
                &values,
                stride,
                offset,
                first..n,
                0.1,
                None,
                &mut scores,
                &mut out,
            );
            let mut plain = vec![f32::NAN; d];
            attend_body(
                &q,
                &keys,
                &values,
                stride,
                offset,
                first..n,
                0.1,
                None,
                &mut scores,
                &mut plain,
            );
            assert_eq!(out, plain, "d={d}: the vector kernels give the plain loops' bits");
            let mut w: Vec<f64> = (first..n)
                .map(|j| {
                    (0..d)
                        .map(|i| f64::from(q[i] * keys[j * stride + offset + i]))
                        .sum::<f64>()
                        * 0.1
                })
                .collect();
            let max = w.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            w.iter_mut().for_each(|v| *v = (*v - max).exp());
            let sum: f64 = w.iter().sum();
            for i in 0..d {
                let want: f64 = (first..n)
                    .zip(&w)
                    .map(|(j, p)| p / sum * f64::from(values[j * stride + offset + i]))
                    .sum();
                assert!(
                    (f64::from(out[i]) - want).abs() < 1e-5,
                    "d={d} n={n} {i}: {} vs {want}",
                    out[i]
                );
            }
        }
    }

    /// The exp form of GELU-tanh against the tanh form in f64, across the range where it
    /// matters and far out (where exp overflows to inf or underflows to 0).
    #[test]
    fn gelu_tanh_matches_the_tanh_form() {
        for i in -2000..=2000 {
            let x = i as f32 * 0.01;
            let xd = f64::from(x);
            let want = 0.5 * xd * (1.0 + (0.797_884_560_802_865_4 * xd * (1.0 + 0.044715 * xd * xd)).tanh());
            let got = f64::from(gelu_tanh(x));
            assert!((got - want).abs() <= 1e-6 * (1.0 + want.abs()), "{x}: {got} vs {want}");
        }
        assert_eq!(gelu_tanh(100.0), 100.0);
        assert_eq!(gelu_tanh(-100.0), 0.0);
        assert_eq!(gelu_tanh(0.0), 0.0);
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
