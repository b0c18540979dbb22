//! The 32-element types with an offset (Q4_0, Q5_0, Q8_0), Q5_1 (a min instead) and the 32-element
//! table types (IQ4_NL, MXFP4, their values stored plus an offset) for the AVX-512 VNNI family, in two
//! forms that give the same bits, like [`super::wide`] for the K-quants:
//!
//! - one token ([`dot`]): eight blocks at a time, each block's `vpdpbusd` sums reduced together
//!   to one vector of eight exact integers (one lane a block), scaled and added in eight lanes;
//! - sixteen tokens ([`lanes`]) against a [`LanePack`]: four quants of a row broadcast to every
//!   lane, one `vpdpbusd` per 4 quants x 16 tokens.
//!
//! Per block both compute `J = sum(u * y) - offset * sum(y)` exactly, where `u` are the quants as
//! unsigned bytes (`q + offset`: Q4_0 8, Q5_0 16, Q8_0 128, IQ4_NL 128, MXFP4 16), and then `acc[b % 8] += J * (d *
//! y_scale)` with one fused multiply-add, in block order; the dot is the eight partial sums added
//! as `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`. Each token's result is therefore the
//! same in both forms and whatever the other tokens of a pack. `|J| <= 32 * 255 * 127 + 128 * 32
//! * 127`, inside i32.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::lanes::{LanePack, LANES};
use super::super::layout::{e8m0_half, FP4_VALUES, IQ4_VALUES};
use super::super::PreparedInput;
use super::legacy::unpack_nibbles;
use super::{hsum_ps, prefetch_ahead};

/// A 32-element type whose quants are stored as `q + offset` in an unsigned form.
pub(super) trait OffsetType {
    /// Bytes per block; the block starts with its f16 scale `d`.
    const BYTES: usize;
    /// `log2(offset)`.
    const OFFSET_SHIFT: i32;
    /// The block's 32 quants plus the offset, as unsigned bytes in element order.
    unsafe fn unpack(block: *const u8) -> __m256i;

    /// Whether the block has a min `m` (an f16 at byte 2): its term `m * y_scale * sum(y)` is
    /// added after `J`'s, with one more fused multiply-add.
    const MIN: bool = false;

    /// The mins of the eight blocks of [`OffsetType::scales_8`] (only read when `MIN`).
    #[inline(always)]
    unsafe fn mins_8(first: *const u8, mask: u8) -> __m256 {
        let offsets = _mm256_mullo_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(Self::BYTES as i32),
        );
        let words = _mm256_mmask_i32gather_epi32::<1>(_mm256_setzero_si256(), mask, offsets, first as *const i32);
        _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32::<16>(words)))
    }

    /// The min of the block at `block` in every lane (only read when `MIN`).
    #[inline(always)]
    unsafe fn min_16(block: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_set1_epi16(std::ptr::read_unaligned(block.add(2) as *const i16)))
    }

    /// The scales of the (up to) eight consecutive blocks from `first` that `mask` selects, as
    /// f32 lanes (0 elsewhere): here f16 `d`s at the blocks' starts, gathered as the low halves
    /// of 32-bit loads (each inside its block).
    #[inline(always)]
    unsafe fn scales_8(first: *const u8, mask: u8) -> __m256 {
        let offsets = _mm256_mullo_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(Self::BYTES as i32),
        );
        let words = _mm256_mmask_i32gather_epi32::<1>(_mm256_setzero_si256(), mask, offsets, first as *const i32);
        _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words))
    }

    /// The scale of the block at `block` in every lane.
    #[inline(always)]
    unsafe fn scale_16(block: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_set1_epi16(std::ptr::read_unaligned(block as *const i16)))
    }
}

/// Q4_0: 16 bytes of nibbles after `d`, offset 8.
pub(super) struct Q4_0;
impl OffsetType for Q4_0 {
    const BYTES: usize = 18;
    const OFFSET_SHIFT: i32 = 3;
    #[inline(always)]
    unsafe fn unpack(block: *const u8) -> __m256i {
        unpack_nibbles(block.add(2))
    }
}

/// Q5_0: the fifth bits (32 bits) and 16 bytes of nibbles after `d`, offset 16.
pub(super) struct Q5_0;
impl OffsetType for Q5_0 {
    const BYTES: usize = 22;
    const OFFSET_SHIFT: i32 = 4;
    #[inline(always)]
    unsafe fn unpack(block: *const u8) -> __m256i {
        let fifth_bits = std::ptr::read_unaligned(block.add(2) as *const u32);
        _mm256_or_si256(
            unpack_nibbles(block.add(6)),
            _mm256_maskz_mov_epi8(fifth_bits, _mm256_set1_epi8(0x10)),
        )
    }
}

/// Q8_0: 32 signed bytes after `d`, offset 128.
pub(super) struct Q8_0;
impl OffsetType for Q8_0 {
    const BYTES: usize = 34;
    const OFFSET_SHIFT: i32 = 7;
    #[inline(always)]
    unsafe fn unpack(block: *const u8) -> __m256i {
        // i8 + 128 as u8: flip the sign bit.
        _mm256_xor_si256(
            _mm256_loadu_si256(block.add(2) as *const __m256i),
            _mm256_set1_epi8(-128),
        )
    }
}

/// Q5_1: `d`, the min `m`, the fifth bits (32 bits) and 16 bytes of nibbles; the quants are
/// unsigned (0..32), so there is no offset (a shift of 32 makes it 0), and `m` adds its term.
pub(super) struct Q5_1;
impl OffsetType for Q5_1 {
    const BYTES: usize = 24;
    const OFFSET_SHIFT: i32 = 32;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn unpack(block: *const u8) -> __m256i {
        let fifth_bits = std::ptr::read_unaligned(block.add(4) as *const u32);
        _mm256_or_si256(
            unpack_nibbles(block.add(8)),
            _mm256_maskz_mov_epi8(fifth_bits, _mm256_set1_epi8(0x10)),
        )
    }
}

/// IQ4_NL: 16 bytes of 4-bit table indices after `d`, the table values plus 128.
pub(super) struct Iq4Nl;
impl OffsetType for Iq4Nl {
    const BYTES: usize = 18;
    const OFFSET_SHIFT: i32 = 7;
    #[inline(always)]
    unsafe fn unpack(block: *const u8) -> __m256i {
        let values = _mm_xor_si128(
            _mm_loadu_si128(IQ4_VALUES.as_ptr() as *const __m128i),
            _mm_set1_epi8(-128),
        );
        _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(values), unpack_nibbles(block.add(2)))
    }
}

/// MXFP4: the E8M0 exponent, then 16 bytes of 4-bit indices into the doubled FP4 values, which
/// are stored plus 16 (4..=28); the scale is [`e8m0_half`] of the exponent.
pub(super) struct Mxfp4;
impl OffsetType for Mxfp4 {
    const BYTES: usize = 17;
    const OFFSET_SHIFT: i32 = 4;
    #[inline(always)]
    unsafe fn unpack(block: *const u8) -> __m256i {
        let values = _mm_add_epi8(
            _mm_loadu_si128(FP4_VALUES.as_ptr() as *const __m128i),
            _mm_set1_epi8(16),
        );
        _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(values), unpack_nibbles(block.add(1)))
    }

    /// [`e8m0_half`] of each exponent: `(e - 1) << 23` as f32 bits for `e >= 2`, the subnormal
    /// `0x0020_0000 << e` below.
    #[inline(always)]
    unsafe fn scales_8(first: *const u8, mask: u8) -> __m256 {
        let offsets = _mm256_mullo_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(Self::BYTES as i32),
        );
        let words = _mm256_mmask_i32gather_epi32::<1>(_mm256_setzero_si256(), mask, offsets, first as *const i32);
        let e = _mm256_and_si256(words, _mm256_set1_epi32(0xff));
        let normal = _mm256_slli_epi32::<23>(_mm256_sub_epi32(e, _mm256_set1_epi32(1)));
        let tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x0020_0000), e);
        let is_normal = _mm256_cmpge_epu32_mask(e, _mm256_set1_epi32(2));
        _mm256_castsi256_ps(_mm256_maskz_mov_epi32(
            mask,
            _mm256_mask_blend_epi32(is_normal, tiny, normal),
        ))
    }

    #[inline(always)]
    unsafe fn scale_16(block: *const u8) -> __m512 {
        _mm512_set1_ps(e8m0_half(*block))
    }
}

/// Per 128-bit half: `[x0 + x2, y0 + y2, x1 + x3, y1 + y3]`.
#[inline(always)]
unsafe fn sum_pairs(x: __m256i, y: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y))
}

/// Per 128-bit half, from two [`sum_pairs`] results: that half's sums of their four inputs.
#[inline(always)]
unsafe fn sum_quads(wx: __m256i, yz: __m256i) -> __m256i {
    _mm256_add_epi32(_mm256_unpacklo_epi64(wx, yz), _mm256_unpackhi_epi64(wx, yz))
}

/// Lane `i` = the sum of the eight i32 lanes of `v[i]` (exact).
#[inline(always)]
unsafe fn reduce_8(v: &[__m256i; 8]) -> __m256i {
    let low = sum_quads(sum_pairs(v[0], v[1]), sum_pairs(v[2], v[3]));
    let high = sum_quads(sum_pairs(v[4], v[5]), sum_pairs(v[6], v[7]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(low, high),
        _mm256_permute2x128_si256::<0x31>(low, high),
    )
}

/// One row against one token.
#[inline(always)]
pub(super) unsafe fn dot<T: OffsetType>(row: *const u8, x: &PreparedInput) -> f32 {
    let n_blocks = x.len() / 32;
    let mut acc = _mm256_setzero_ps();
    for b0 in (0..n_blocks).step_by(8) {
        let n = (n_blocks - b0).min(8);
        let mask = (0xffu32 >> (8 - n)) as u8;
        let mut dots = [_mm256_setzero_si256(); 8];
        for (i, dot) in dots.iter_mut().enumerate().take(n) {
            let block = row.add((b0 + i) * T::BYTES);
            prefetch_ahead(block, T::BYTES);
            let y = _mm256_loadu_si256(x.quants.as_ptr().add(32 * (b0 + i)) as *const __m256i);
            *dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), T::unpack(block), y);
        }
        let y_sums = _mm256_maskz_loadu_epi32(mask, x.sums_32.as_ptr().add(b0));
        let j = _mm256_sub_epi32(
            reduce_8(&dots),
            _mm256_sllv_epi32(y_sums, _mm256_set1_epi32(T::OFFSET_SHIFT)),
        );
        let y_scales = _mm256_maskz_loadu_ps(mask, x.block_scales.as_ptr().add(b0));
        let d = T::scales_8(row.add(b0 * T::BYTES), mask);
        let c = _mm256_mul_ps(d, y_scales);
        acc = _mm256_mask3_fmadd_ps(_mm256_cvtepi32_ps(j), c, acc, mask);
        if T::MIN {
            let m = _mm256_mul_ps(T::mins_8(row.add(b0 * T::BYTES), mask), y_scales);
            acc = _mm256_mask3_fmadd_ps(_mm256_cvtepi32_ps(y_sums), m, acc, mask);
        }
    }
    hsum_ps(acc)
}

/// A block's 32 quants (plus offset) in element order, for the broadcast loads.
#[repr(align(32))]
#[derive(Clone, Copy)]
struct Unpacked([u8; 32]);

/// `R` rows against the pack's 16 tokens over blocks `blocks`: block `b` is added into
/// `acc[r][b % 8]`, lane `t` for token `t`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // `r` indexes several arrays in step
pub(super) unsafe fn lanes<T: OffsetType, const R: usize>(
    rows: [*const u8; R],
    p: &LanePack,
    blocks: Range<usize>,
    acc: &mut [[__m512; 8]; R],
) {
    let shift = _mm512_set1_epi32(T::OFFSET_SHIFT);
    for b in blocks {
        let block = rows.map(|row| row.add(b * T::BYTES));
        let mut unpacked = [Unpacked([0; 32]); R];
        for r in 0..R {
            _mm256_store_si256(unpacked[r].0.as_mut_ptr() as *mut __m256i, T::unpack(block[r]));
        }
        let mut sums = [_mm512_setzero_si512(); R];
        for k in 0..8 {
            let y = _mm512_loadu_si512(p.quants.as_ptr().add((8 * b + k) * LANES) as *const __m512i);
            for r in 0..R {
                let w = _mm512_set1_epi32(std::ptr::read_unaligned(unpacked[r].0.as_ptr().add(4 * k) as *const i32));
                sums[r] = _mm512_dpbusd_epi32(sums[r], w, y);
            }
        }
        let y_scales = _mm512_loadu_ps(p.scales.as_ptr().add(b * LANES));
        let offsets = _mm512_sllv_epi32(
            _mm512_loadu_si512(p.block_sums.as_ptr().add(b * LANES) as *const __m512i),
            shift,
        );
        for r in 0..R {
            let j = _mm512_sub_epi32(sums[r], offsets);
            let d = T::scale_16(block[r]);
            let acc = &mut acc[r][b % 8];
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(j), _mm512_mul_ps(d, y_scales), *acc);
            if T::MIN {
                let sums = _mm512_loadu_si512(p.block_sums.as_ptr().add(b * LANES) as *const __m512i);
                let m = _mm512_mul_ps(T::min_16(block[r]), y_scales);
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), m, *acc);
            }
        }
    }
}

/// The eight partial sums of [`lanes`] added as [`dot`]'s `hsum_ps` adds its eight lanes.
#[inline(always)]
pub(super) unsafe fn finish(a: &[__m512; 8]) -> __m512 {
    // No closures here: they would not inherit the caller's target features (and not inline).
    let even = _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6]));
    let odd = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
    _mm512_add_ps(even, odd)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector E8M0 conversion equals [`e8m0_half`] for every exponent, the subnormals included.
    #[test]
    fn mxfp4_scales_equal_e8m0_half() {
        if !super::super::vnni_supported() {
            return;
        }
        let blocks: Vec<u8> = (0..=255u8).flat_map(|e| std::iter::once(e).chain([0x5a; 16])).collect();
        for b0 in (0..256).step_by(8) {
            let mut got = [0f32; 8];
            // SAFETY: the CPU has the VNNI family's features (checked above); the eight gathered
            // 4-byte loads start at blocks b0..b0 + 8, each inside `blocks`.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), Mxfp4::scales_8(blocks.as_ptr().add(b0 * 17), 0xff)) };
            for (i, &g) in got.iter().enumerate() {
                assert_eq!(g.to_bits(), e8m0_half((b0 + i) as u8).to_bits(), "e = {}", b0 + i);
            }
        }
    }
}
