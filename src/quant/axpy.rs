//! `out += a · row`, accumulated in f64, for neuron-major matrices (one row = one FFN neuron's
//! down column). Accumulating in f64 makes the sum independent of row order and of how rows
//! are split across threads: every product `a · w` is exact in f64 (a is an f32, w has at most
//! 24 significant bits), so only the additions round, at 2^-53, far below what f32 keeps. A
//! permuted `.gst` file therefore gives the same f32 result as the original order.
//!
//! Fast paths for the types down columns are stored in (Q8_0, F16) use AVX-512F or AVX2+FMA;
//! each gives exactly the scalar reference's result (same products, same addition order).

use super::{dequantize_row, GgmlType};

/// Scalar reference: dequantize, then add `a * w[i]` to `out[i]`.
pub fn axpy_row_f64_scalar(ty: GgmlType, row: &[u8], a: f32, out: &mut [f64]) {
    let mut w = vec![0f32; out.len()];
    dequantize_row(ty, row, &mut w);
    let a = a as f64;
    for (o, w) in out.iter_mut().zip(&w) {
        *o += a * *w as f64;
    }
}

/// `out[i] += a * row[i]` in f64 with the fastest kernel for `ty` on this CPU.
/// Panics unless `row` is one row of `ty` with `out.len()` elements.
pub fn axpy_row_f64(ty: GgmlType, row: &[u8], a: f32, out: &mut [f64]) {
    assert_eq!(ty.row_bytes(out.len()), Some(row.len()), "axpy row length");
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(k) = x86_kernel(ty) {
            // SAFETY: `x86_kernel` returns a kernel only when CPUID reported every feature it
            // enables; the length check above is the one the kernel's pointer arithmetic needs.
            unsafe { k(row, a, out) };
            return;
        }
    }
    axpy_row_f64_scalar(ty, row, a, out);
}

#[cfg(target_arch = "x86_64")]
type Kernel = unsafe fn(&[u8], f32, &mut [f64]);

#[cfg(target_arch = "x86_64")]
fn x86_kernel(ty: GgmlType) -> Option<Kernel> {
    use std::sync::OnceLock;
    static LEVEL: OnceLock<u8> = OnceLock::new();
    let level = *LEVEL.get_or_init(|| {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx2") {
            2
        } else if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            1
        } else {
            0
        }
    });
    match (ty, level) {
        (GgmlType::Q8_0, 2) => Some(x86::q8_0_avx512),
        (GgmlType::Q8_0, 1) => Some(x86::q8_0_avx2),
        (GgmlType::F16, 2) => Some(x86::f16_avx512),
        (GgmlType::F16, 1) => Some(x86::f16_avx2),
        _ => None,
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// One f16 to f32 with the F16C instruction (the callers enable f16c).
    #[inline(always)]
    unsafe fn f16_to_f32(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    const Q8_0_BLOCK_BYTES: usize = 34;

    /// # Safety
    /// Needs AVX-512F, AVX2 and F16C; `row` is `out.len() / 32` Q8_0 blocks.
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub unsafe fn q8_0_avx512(row: &[u8], a: f32, out: &mut [f64]) {
        let a = a as f64;
        for (b, blk) in row.chunks_exact(Q8_0_BLOCK_BYTES).enumerate() {
            let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) as f64 * a;
            let vd = _mm512_set1_pd(d);
            for g in 0..4 {
                // SAFETY: blk has 34 bytes, so bytes 2 + 8g .. 10 + 8g exist; out has 32 values
                // per block (checked by the caller), so b*32 + 8g .. +8 is in bounds.
                let q = _mm_loadl_epi64(blk.as_ptr().add(2 + 8 * g) as *const __m128i);
                let w = _mm512_cvtepi32_pd(_mm256_cvtepi8_epi32(q));
                let o = out.as_mut_ptr().add(b * 32 + 8 * g);
                _mm512_storeu_pd(o, _mm512_fmadd_pd(w, vd, _mm512_loadu_pd(o)));
            }
        }
    }

    /// # Safety
    /// Needs AVX2, FMA and F16C; `row` is `out.len() / 32` Q8_0 blocks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q8_0_avx2(row: &[u8], a: f32, out: &mut [f64]) {
        let a = a as f64;
        for (b, blk) in row.chunks_exact(Q8_0_BLOCK_BYTES).enumerate() {
            let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) as f64 * a;
            let vd = _mm256_set1_pd(d);
            for g in 0..8 {
                // SAFETY: bytes 2 + 4g .. 6 + 4g of the 34-byte block, and 4 outputs at
                // b*32 + 4g, are in bounds as above.
                let q = _mm_cvtsi32_si128(i32::from_le_bytes([
                    blk[2 + 4 * g],
                    blk[3 + 4 * g],
                    blk[4 + 4 * g],
                    blk[5 + 4 * g],
                ]));
                let w = _mm256_cvtepi32_pd(_mm_cvtepi8_epi32(q));
                let o = out.as_mut_ptr().add(b * 32 + 4 * g);
                _mm256_storeu_pd(o, _mm256_fmadd_pd(w, vd, _mm256_loadu_pd(o)));
            }
        }
    }

    /// # Safety
    /// Needs AVX-512F and AVX2; `row` holds `out.len()` f16 values.
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub unsafe fn f16_avx512(row: &[u8], a: f32, out: &mut [f64]) {
        let va = _mm512_set1_pd(a as f64);
        let n = out.len();
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: 8 f16 values (16 bytes) at byte 2i and 8 outputs at i are in bounds.
            let h = _mm_loadu_si128(row.as_ptr().add(2 * i) as *const __m128i);
            let w = _mm512_cvtps_pd(_mm256_cvtph_ps(h));
            let o = out.as_mut_ptr().add(i);
            _mm512_storeu_pd(o, _mm512_fmadd_pd(w, va, _mm512_loadu_pd(o)));
            i += 8;
        }
        for j in i..n {
            out[j] += a as f64 * f16_to_f32(u16::from_le_bytes([row[2 * j], row[2 * j + 1]])) as f64;
        }
    }

    /// # Safety
    /// Needs AVX2, FMA and F16C; `row` holds `out.len()` f16 values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_avx2(row: &[u8], a: f32, out: &mut [f64]) {
        let va = _mm256_set1_pd(a as f64);
        let n = out.len();
        let mut i = 0;
        while i + 4 <= n {
            // SAFETY: 4 f16 values (8 bytes) at byte 2i and 4 outputs at i are in bounds.
            let h = _mm_loadl_epi64(row.as_ptr().add(2 * i) as *const __m128i);
            let w = _mm256_cvtps_pd(_mm_cvtph_ps(h));
            let o = out.as_mut_ptr().add(i);
            _mm256_storeu_pd(o, _mm256_fmadd_pd(w, va, _mm256_loadu_pd(o)));
            i += 4;
        }
        for j in i..n {
            out[j] += a as f64 * f16_to_f32(u16::from_le_bytes([row[2 * j], row[2 * j + 1]])) as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::quantize_row;
    use super::*;

    #[test]
    fn fast_kernels_equal_the_scalar_reference_bit_for_bit() {
        let n = 1536;
        let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0).collect();
        for ty in [GgmlType::Q8_0, GgmlType::F16, GgmlType::F32] {
            let mut row = vec![0u8; ty.row_bytes(n).unwrap()];
            assert!(quantize_row(ty, &x, &mut row));
            let start: Vec<f64> = (0..n).map(|i| i as f64 * 1e-3).collect();
            let (mut fast, mut slow) = (start.clone(), start.clone());
            for a in [0.37f32, -1.25e-3, 3.0] {
                axpy_row_f64(ty, &row, a, &mut fast);
                axpy_row_f64_scalar(ty, &row, a, &mut slow);
            }
            assert_eq!(fast, slow, "{ty:?}");
        }
    }

    #[test]
    fn order_of_rows_does_not_change_the_f32_result() {
        // The property the f64 accumulation exists for: rows summed in any order round to the
        // same f32.
        let (rows, n) = (64, 64);
        let mut data = Vec::new();
        for r in 0..rows {
            let x: Vec<f32> = (0..n)
                .map(|i| (((r * 131 + i * 17) % 97) as f32 - 48.0) * 0.013)
                .collect();
            let mut q = vec![0u8; GgmlType::Q8_0.row_bytes(n).unwrap()];
            quantize_row(GgmlType::Q8_0, &x, &mut q);
            data.push(q);
        }
        let acts: Vec<f32> = (0..rows).map(|r| ((r * 37 % 11) as f32 - 5.0) * 0.77).collect();
        let sum = |order: &[usize]| -> Vec<f32> {
            let mut out = vec![0f64; n];
            for &r in order {
                axpy_row_f64(GgmlType::Q8_0, &data[r], acts[r], &mut out);
            }
            out.iter().map(|&v| v as f32).collect()
        };
        let forward: Vec<usize> = (0..rows).collect();
        let backward: Vec<usize> = (0..rows).rev().collect();
        assert_eq!(sum(&forward), sum(&backward));
    }
}
