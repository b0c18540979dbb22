//! SIMD dot products of float weights (F32, F16, BF16) with `f32` activations: 32 elements per
//! iteration in four independent FMA accumulators, then a scalar tail. The same code serves both
//! families (it needs only AVX2/FMA/F16C).

use std::arch::x86_64::*;

use super::super::{bf16_to_f32, f16_to_f32, PreparedInput};
use super::hsum_ps;

/// Shared loop: `load(p, i)` converts 8 weights starting at element `i` to f32x8, `scalar(p, i)`
/// converts one (for the tail).
macro_rules! float_dot {
    ($row:expr, $x:expr, $elem_bytes:expr, |$p:ident| $load8:expr, $load1:expr) => {{
        let row: *const u8 = $row;
        let values = $x.values_f32.as_ptr();
        let n = $x.len();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, acc_k) in acc.iter_mut().enumerate() {
                let $p = row.add((i + 8 * k) * $elem_bytes);
                let y = _mm256_loadu_ps(values.add(i + 8 * k));
                *acc_k = _mm256_fmadd_ps($load8, y, *acc_k);
            }
            i += 32;
        }
        while i + 8 <= n {
            let $p = row.add(i * $elem_bytes);
            acc[0] = _mm256_fmadd_ps($load8, _mm256_loadu_ps(values.add(i)), acc[0]);
            i += 8;
        }
        let mut sum = hsum_ps(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ));
        while i < n {
            let $p = row.add(i * $elem_bytes);
            sum += $load1 * *values.add(i);
            i += 1;
        }
        sum
    }};
}

#[inline(always)]
pub(super) unsafe fn dot_f32(row: *const u8, x: &PreparedInput) -> f32 {
    float_dot!(row, x, 4, |p| _mm256_loadu_ps(p as *const f32), {
        f32::from_le_bytes(std::ptr::read_unaligned(p as *const [u8; 4]))
    })
}

#[inline(always)]
pub(super) unsafe fn dot_f16(row: *const u8, x: &PreparedInput) -> f32 {
    float_dot!(row, x, 2, |p| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), {
        f16_to_f32(u16::from_le_bytes(std::ptr::read_unaligned(p as *const [u8; 2])))
    })
}

#[inline(always)]
pub(super) unsafe fn dot_bf16(row: *const u8, x: &PreparedInput) -> f32 {
    // bf16 is the top half of an f32: widen to 32 bits and shift into place.
    float_dot!(
        row,
        x,
        2,
        |p| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(
            p as *const __m128i
        )))),
        bf16_to_f32(u16::from_le_bytes(std::ptr::read_unaligned(p as *const [u8; 2])))
    )
}
