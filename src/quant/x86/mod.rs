//! x86-64 SIMD dot products, in two families chosen at run time: AVX2 (`vpmaddubsw` +
//! `vpmaddwd`) and AVX-512 VNNI (`vpdpbusd`/`vpdpwssd`: on 256-bit vectors for the 32-element
//! types, where one code path serves both families — a 512-bit form measured slower — and on
//! 512-bit vectors for the K-quants ([`wide`], and [`lowwide`] for Q2_K, Q3_K and IQ4_XS), whose
//! batched form puts 16 tokens in the lanes of one vector).
//! One-token products prefetch the weights a few KiB ahead ([`prefetch_block`]).
//!
//! The kernels are written once, generic over [`ByteDot`] (the only place the families differ),
//! as `#[inline(always)]` functions, and instantiated inside the two `#[target_feature]` entry
//! points, so LLVM inlines the whole kernel, intrinsics included, into code compiled for that
//! family's features.
//!
//! Safety contract shared by every `unsafe fn` in this module tree: (1) the CPU supports the
//! features of the family being run (AVX2, FMA and F16C at least; VNNI kernels also AVX-512F/BW/
//! VL/VNNI), which the entry points' callers establish with [`avx2_supported`] /
//! [`vnni_supported`]; (2) a row pointer is valid for reading one row of `x.len()` elements of
//! its type, and `x` is prepared in that type's activation format with the same length — which
//! [`super::check_rows`] asserts before any kernel runs. Every load below is an unaligned load
//! (`loadu`) inside those bounds, because rows come from mmapped files with no alignment.

mod exact32;
mod float;
mod grid;
mod kquants;
mod legacy;
mod lowbit;
mod lowwide;
mod wide;

use std::arch::x86_64::*;

use super::lanes::{TokenTile, LANES};
use super::{GgmlType, PreparedInput};

/// Whether the AVX2 family can run (AVX2 + FMA + F16C).
pub(super) fn avx2_supported() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// Whether the AVX-512 VNNI family can run (the AVX2 family's features plus AVX-512F/BW/VL/VNNI).
pub(super) fn vnni_supported() -> bool {
    avx2_supported()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// Unsigned-by-signed byte dot products, the instruction-level difference between families.
pub(super) trait ByteDot {
    /// Tokens per micro-tile (4 or 8): one row's unpacked block is multiplied with this many
    /// tokens' activations while it sits in registers. Each token holds an integer and two float
    /// accumulators, so the widest tile that fits depends on the vector register count.
    const TILE_TOKENS: usize;

    /// Whether the K-quant kernels of [`wide`] (512-bit vectors) replace those of [`kquants`]
    /// for this family (same integers per block, a different float summation).
    const WIDE: bool;

    /// `acc + [sum of a[4i..4i+4] * b[4i..4i+4] for each i32 lane i]`, `a` unsigned, `b` signed.
    /// Exact as long as adjacent pairs `a[2k]*b[2k] + a[2k+1]*b[2k+1]` fit in i16 (the AVX2
    /// implementation saturates there; every caller keeps within it, see the kernels).
    unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;

    /// Like [`ByteDot::dot`], with the pair sums of i16 lane `k` multiplied by `scales_i16[k]`.
    unsafe fn dot_scaled(acc: __m256i, a: __m256i, b: __m256i, scales_i16: __m256i) -> __m256i;

    /// Byte `e` is 0x10 if bit `e` of `bits` is set, else 0 (Q5_0's fifth bits in place).
    unsafe fn bits_to_0x10(bits: u32) -> __m256i;
}

/// AVX2: `vpmaddubsw` to i16 pairs, then `vpmaddwd` to i32 quads.
pub(super) struct Avx2Dot;

impl ByteDot for Avx2Dot {
    /// Sixteen vector registers: eight tokens would spill accumulators (measured slower).
    const TILE_TOKENS: usize = 4;
    const WIDE: bool = false;

    #[inline(always)]
    unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(a, b);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    #[inline(always)]
    unsafe fn dot_scaled(acc: __m256i, a: __m256i, b: __m256i, scales_i16: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(a, b);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scales_i16))
    }

    #[inline(always)]
    unsafe fn bits_to_0x10(bits: u32) -> __m256i {
        _mm256_and_si256(bits_to_byte_mask(bits), _mm256_set1_epi8(0x10))
    }
}

/// AVX-512 VNNI on 256-bit vectors: `vpdpbusd` (no intermediate saturation) and `vpdpwssd`.
pub(super) struct VnniDot;

// The AVX-512 intrinsics and target features were stabilized in Rust 1.89; this family (and
// `vec_dot_rows_vnni`) therefore needs the crate's `rust-version` to be at least 1.89.
#[clippy::msrv = "1.89"]
impl ByteDot for VnniDot {
    /// AVX-512VL gives 32 vector registers, room for eight tokens' accumulators (measured ~1.3x
    /// faster than four on Q4_K/Q8_0 prefill).
    const TILE_TOKENS: usize = 8;
    /// The wide kernels (512-bit vectors).
    const WIDE: bool = true;

    #[inline(always)]
    unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, a, b)
    }

    #[inline(always)]
    unsafe fn dot_scaled(acc: __m256i, a: __m256i, b: __m256i, scales_i16: __m256i) -> __m256i {
        _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(a, b), scales_i16)
    }

    #[inline(always)]
    unsafe fn bits_to_0x10(bits: u32) -> __m256i {
        // AVX-512BW byte masking: one `kmovd` and one masked move.
        _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10))
    }
}

/// Byte `e` is 0xFF if bit `e` of `bits` is set, else 0.
#[inline(always)]
unsafe fn bits_to_byte_mask(bits: u32) -> __m256i {
    // Broadcast byte e/8 of `bits` to byte e, then test bit e%8 by OR-ing in all other bits.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0x0000_0000_0000_0000,
        ),
    );
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
    _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1))
}

/// `out[i] = dot(row i, x)` with the AVX2 kernels.
///
/// # Safety
/// The module's contract: AVX2/FMA/F16C present, `rows` holds `out.len()` rows of `row_bytes`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_rows_avx2(
    ty: GgmlType,
    rows: &[u8],
    row_bytes: usize,
    x: &PreparedInput,
    out: &mut [f32],
) {
    vec_dot_rows_generic::<Avx2Dot>(ty, rows, row_bytes, x, out)
}

/// `out[i] = dot(row i, x)` with the AVX-512 VNNI kernels.
///
/// # Safety
/// The module's contract: the VNNI family's features present, `rows` as for the AVX2 entry.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn vec_dot_rows_vnni(
    ty: GgmlType,
    rows: &[u8],
    row_bytes: usize,
    x: &PreparedInput,
    out: &mut [f32],
) {
    vec_dot_rows_generic::<VnniDot>(ty, rows, row_bytes, x, out)
}

/// `out[t * n_rows + r] = dot(row r, xs[t])` with the AVX2 kernels.
///
/// # Safety
/// The module's contract: AVX2/FMA/F16C present, `rows` holds whole rows of `row_bytes`, every
/// token of `tile` is prepared for them, and `out.len() == tile.len() * rows.len() / row_bytes`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn vec_dot_tile_avx2(ty: GgmlType, rows: &[u8], row_bytes: usize, tile: &TokenTile, out: &mut [f32]) {
    vec_dot_tile_generic::<Avx2Dot>(ty, rows, row_bytes, tile, out)
}

/// `out[t * n_rows + r] = dot(row r, xs[t])` with the AVX-512 VNNI kernels.
///
/// # Safety
/// The module's contract: the VNNI family's features present, arguments as for the AVX2 entry.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn vec_dot_tile_vnni(ty: GgmlType, rows: &[u8], row_bytes: usize, tile: &TokenTile, out: &mut [f32]) {
    vec_dot_tile_generic::<VnniDot>(ty, rows, row_bytes, tile, out)
}

/// How far ahead of the block being read a one-token product asks for the bytes that follow:
/// these products stream their weights from memory once, and the hardware prefetcher alone left
/// one thread's streaming matvec at ~83% of its read bandwidth (Qwen's Q6_K output matrix,
/// `cargo bench --bench kernels`: 29.1 GiB/s, 35.0 with this; Qwen decode +16%). Asking per
/// block measured better than asking for a whole row at its start (decode +9% only).
const PREFETCH_AHEAD: usize = 4096;

/// For a one-token product (`NT == 1`), asks the cache for the lines holding the `BYTES` bytes
/// `PREFETCH_AHEAD` past the block at `block`; tiles reuse their rows from the cache and skip
/// it. A prefetch is a hint: lines past the end of the weights are not read and cannot fault.
#[inline(always)]
unsafe fn prefetch_block<const NT: usize, const BYTES: usize>(block: *const u8) {
    if NT == 1 {
        prefetch_ahead(block, BYTES);
    }
}

/// [`prefetch_block`] for a one-token product whose block size is not a constant parameter.
#[inline(always)]
unsafe fn prefetch_ahead(block: *const u8, bytes: usize) {
    let ahead = block.wrapping_add(PREFETCH_AHEAD);
    let mut offset = 0;
    while offset < bytes {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(offset) as *const i8);
        offset += 64;
    }
    // The last byte's line, which the steps of 64 can miss when the block straddles lines.
    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(bytes - 1) as *const i8);
}

/// The per-row loop, one arm per type so the dispatch is outside it. The quantized kernels are
/// the tile kernels with a tile of one token.
#[inline(always)]
unsafe fn vec_dot_rows_generic<D: ByteDot>(
    ty: GgmlType,
    rows: &[u8],
    row_bytes: usize,
    x: &PreparedInput,
    out: &mut [f32],
) {
    debug_assert_eq!(rows.len(), row_bytes * out.len());
    macro_rules! each_row {
        ($kernel:expr) => {
            for (i, dst) in out.iter_mut().enumerate() {
                *dst = $kernel(rows.as_ptr().add(i * row_bytes), x);
            }
        };
    }
    macro_rules! each_row_tile1 {
        ($kernel:expr) => {
            for (i, dst) in out.iter_mut().enumerate() {
                *dst = $kernel(rows.as_ptr().add(i * row_bytes), &[x])[0];
            }
        };
    }
    match ty {
        GgmlType::F32 => each_row!(float::dot_f32),
        GgmlType::F16 => each_row!(float::dot_f16),
        GgmlType::BF16 => each_row!(float::dot_bf16),
        GgmlType::Q4_0 if D::WIDE => each_row!(exact32::dot::<exact32::Q4_0>),
        GgmlType::Q4_0 => each_row_tile1!(legacy::dot_q4_0::<D, 1>),
        GgmlType::Q4_1 => each_row_tile1!(legacy::dot_q4_1::<D, 1>),
        GgmlType::Q5_0 if D::WIDE => each_row!(exact32::dot::<exact32::Q5_0>),
        GgmlType::Q5_0 => each_row_tile1!(legacy::dot_q5_0::<D, 1>),
        GgmlType::Q8_0 if D::WIDE => each_row!(exact32::dot::<exact32::Q8_0>),
        GgmlType::Q8_0 => each_row_tile1!(legacy::dot_q8_0::<D, 1>),
        GgmlType::Q4_K if D::WIDE => each_row!(wide::dot_q4_k),
        GgmlType::Q4_K => each_row_tile1!(kquants::dot_q4_k::<D, 1>),
        GgmlType::Q5_K => each_row_tile1!(kquants::dot_q5_k::<D, 1>),
        GgmlType::Q6_K if D::WIDE => each_row!(wide::dot_q6_k),
        GgmlType::Q6_K => each_row_tile1!(kquants::dot_q6_k::<D, 1>),
        GgmlType::Q5_1 if D::WIDE => each_row!(exact32::dot::<exact32::Q5_1>),
        GgmlType::Q5_1 => each_row_tile1!(lowbit::dot_q5_1::<D, 1>),
        GgmlType::Q2_K if D::WIDE => each_row!(lowwide::dot_q2_k),
        GgmlType::Q2_K => each_row_tile1!(lowbit::dot_q2_k::<D, 1>),
        GgmlType::Q3_K if D::WIDE => each_row!(lowwide::dot_q3_k),
        GgmlType::Q3_K => each_row_tile1!(lowbit::dot_q3_k::<D, 1>),
        GgmlType::IQ4_NL if D::WIDE => each_row!(exact32::dot::<exact32::Iq4Nl>),
        GgmlType::IQ4_NL => each_row_tile1!(lowbit::dot_iq4_nl::<D, 1>),
        GgmlType::IQ4_XS if D::WIDE => each_row!(lowwide::dot_iq4_xs),
        GgmlType::IQ4_XS => each_row_tile1!(lowbit::dot_iq4_xs::<D, 1>),
        GgmlType::MXFP4 if D::WIDE => each_row!(exact32::dot::<exact32::Mxfp4>),
        GgmlType::MXFP4 => each_row_tile1!(lowbit::dot_mxfp4::<D, 1>),
        GgmlType::IQ2_XXS => each_row_tile1!(grid::dot_iq2_xxs::<D, 1>),
        GgmlType::IQ2_XS => each_row_tile1!(grid::dot_iq2_xs::<D, 1>),
        GgmlType::IQ2_S => each_row_tile1!(grid::dot_iq2_s::<D, 1>),
        GgmlType::IQ3_XXS => each_row_tile1!(grid::dot_iq3_xxs::<D, 1>),
        GgmlType::IQ3_S => each_row_tile1!(grid::dot_iq3_s::<D, 1>),
        GgmlType::IQ1_S => each_row_tile1!(grid::dot_iq1_s::<D, 1>),
        GgmlType::IQ1_M => each_row_tile1!(grid::dot_iq1_m::<D, 1>),
    }
}

/// Rows per pass of the K-quant token-lane kernels over a block range: their float
/// accumulators (one vector each) live on the stack.
const LANE_ROWS: usize = 64;
/// K-quant blocks per pass when the pack does not fit in L1: 4 KiB of its activations each.
const LANE_BLOCKS: usize = 4;
/// Rows per pass of the 32-element types' token-lane kernels (eight vectors each).
const LANE_ROWS_32: usize = 32;

/// Writes lanes `0..tokens` of `lanes` (one row's dots with a pack's tokens) to
/// `out[first + t * stride]`.
///
/// # Safety
/// Every index written is inside `out` (the tile loop's bounds: `first = t0 * n_rows + r`,
/// `stride = n_rows`, `t0 + tokens <= xs.len()`, `out.len() == xs.len() * n_rows`).
#[inline(always)]
unsafe fn store_lanes(out: &mut [f32], lanes: __m512, tokens: usize, first: usize, stride: usize) {
    let mut dots = [0f32; LANES];
    _mm512_storeu_ps(dots.as_mut_ptr(), lanes);
    for (t, &dot) in dots[..tokens].iter().enumerate() {
        *out.get_unchecked_mut(first + t * stride) = dot;
    }
}

/// Asks the cache for `rows[start .. start + len]` (clipped to `rows`): the next rows of a
/// token-lane pass, which reads two rows at a time and leaves the hardware prefetcher behind
/// when the rows come from memory.
#[inline(always)]
unsafe fn prefetch_rows(rows: &[u8], start: usize, len: usize) {
    let end = (start + len).min(rows.len());
    let mut at = start;
    while at < end {
        _mm_prefetch::<_MM_HINT_T0>(rows.as_ptr().add(at) as *const i8);
        at += 64;
    }
}

/// Whether a pack's activations (16 bytes per element) fit in L1 beside the rows passing them.
fn fits_l1(pack: &super::lanes::LanePack) -> bool {
    std::mem::size_of_val(pack.quants.as_slice()) <= 32 * 1024
}

/// The tile loop. The wide family's Q4_K, Q6_K, Q2_K, Q3_K, IQ4_XS, Q4_0, Q5_0, Q5_1, Q8_0, IQ4_NL
/// and MXFP4 run each packed group of [`LANES`] tokens through the token-lane kernels row by row, and
/// a group left unpacked (fewer than [`super::lanes::MIN_TOKENS`] tokens) through the one-token
/// kernels. The other kernels take tokens in groups of [`ByteDot::TILE_TOKENS`], then of four,
/// then the remainder as one smaller group; within a group every row, so the group's activations
/// stay in L1 while the rows stream past.
#[inline(always)]
unsafe fn vec_dot_tile_generic<D: ByteDot>(
    ty: GgmlType,
    rows: &[u8],
    row_bytes: usize,
    tile: &TokenTile,
    out: &mut [f32],
) {
    let xs = tile.tokens();
    let n_rows = rows.len() / row_bytes;
    debug_assert_eq!(rows.len(), row_bytes * n_rows);
    debug_assert_eq!(out.len(), xs.len() * n_rows);
    // One group of `$nt` tokens starting at token `$t0`, over every row.
    macro_rules! group {
        ($module:ident :: $kernel:ident, $nt:literal, $t0:expr) => {{
            let t0: usize = $t0;
            let group: &[&PreparedInput; $nt] = xs[t0..t0 + $nt].try_into().unwrap();
            for r in 0..n_rows {
                let dots = $module::$kernel::<D, $nt>(rows.as_ptr().add(r * row_bytes), group);
                for (t, dot) in dots.into_iter().enumerate() {
                    // In bounds: t0 + t < xs.len() and r < n_rows, and the caller guarantees
                    // `out.len() == xs.len() * n_rows` (the entry points' safety contract).
                    *out.get_unchecked_mut((t0 + t) * n_rows + r) = dot;
                }
            }
        }};
    }
    macro_rules! tiled {
        ($module:ident :: $kernel:ident) => {{
            let mut t0 = 0;
            if D::TILE_TOKENS == 8 {
                while t0 + 8 <= xs.len() {
                    group!($module::$kernel, 8, t0);
                    t0 += 8;
                }
            }
            while t0 + 4 <= xs.len() {
                group!($module::$kernel, 4, t0);
                t0 += 4;
            }
            match xs.len() - t0 {
                0 => {}
                1 => group!($module::$kernel, 1, t0),
                2 => group!($module::$kernel, 2, t0),
                3 => group!($module::$kernel, 3, t0),
                _ => unreachable!("fewer than four tokens remain"),
            }
        }};
    }
    // An unpacked group of tokens `$t0 ..` through the one-token kernel `$one`, token by token.
    macro_rules! each_token {
        ($group:expr, $t0:expr, $one:expr) => {
            for (t, x) in $group.iter().enumerate() {
                for r in 0..n_rows {
                    // In bounds as in `group!`.
                    *out.get_unchecked_mut(($t0 + t) * n_rows + r) = $one(rows.as_ptr().add(r * row_bytes), x);
                }
            }
        };
    }
    // Packed groups through the token-lane kernel (`$two` rows at a time, `$one_row` for an odd
    // last row), unpacked ones token by token through `$one`. Each row's accumulator starts as
    // `$zero` and ends as `$finish(&accumulator)`; `$per_pass` blocks at a time over up to
    // `$rows` rows, or whole rows when the pack fits in L1 (the rows then stream in order).
    macro_rules! lanes {
        ($two:expr, $one_row:expr, $one:expr, $zero:expr, $finish:expr, $rows:expr, $per_pass:expr) => {{
            for (g, group) in xs.chunks(LANES).enumerate() {
                let t0 = g * LANES;
                match tile.pack(g) {
                    Some(pack) => {
                        debug_assert_eq!(pack.tokens, group.len());
                        let per_pass = if fits_l1(pack) { pack.blocks } else { $per_pass };
                        // Weight blocks cover activation blocks one to one in these types.
                        let block_bytes = row_bytes / pack.blocks;
                        for r0 in (0..n_rows).step_by($rows) {
                            let r1 = (r0 + $rows).min(n_rows);
                            let mut acc = [$zero; $rows];
                            let row = |r: usize| rows.as_ptr().add(r * row_bytes);
                            for b0 in (0..pack.blocks).step_by(per_pass) {
                                let blocks = b0..(b0 + per_pass).min(pack.blocks);
                                let mut r = r0;
                                while r + 2 <= r1 {
                                    let pair = (&mut acc[r - r0..r - r0 + 2]).try_into().unwrap();
                                    // This pass's blocks of the next two rows.
                                    for next in r + 2..r + 4 {
                                        let start = next * row_bytes + b0 * block_bytes;
                                        prefetch_rows(rows, start, blocks.len() * block_bytes);
                                    }
                                    $two([row(r), row(r + 1)], pack, blocks.clone(), pair);
                                    r += 2;
                                }
                                if r < r1 {
                                    let one = (&mut acc[r - r0..r - r0 + 1]).try_into().unwrap();
                                    $one_row([row(r)], pack, blocks.clone(), one);
                                }
                            }
                            for (r, partial) in (r0..r1).zip(&acc) {
                                store_lanes(out, $finish(partial), group.len(), t0 * n_rows + r, n_rows);
                            }
                        }
                    }
                    None => each_token!(group, t0, $one),
                }
            }
        }};
    }
    // The 32-element types: eight partial sums per row (block b in b % 8), as their one-token
    // kernels keep them; eight blocks (4 KiB of the pack) per pass.
    macro_rules! lanes32 {
        ($ty:ty) => {
            lanes!(
                exact32::lanes::<$ty, 2>,
                exact32::lanes::<$ty, 1>,
                exact32::dot::<$ty>,
                [_mm512_setzero_ps(); 8],
                exact32::finish,
                LANE_ROWS_32,
                8
            )
        };
    }
    // The K-quants and IQ4_XS: one sum per row; four blocks (16 KiB of the pack) per pass.
    macro_rules! lanes_k {
        ($module:ident :: $lanes:ident, $one:ident) => {
            lanes!(
                $module::$lanes::<2>,
                $module::$lanes::<1>,
                $module::$one,
                _mm512_setzero_ps(),
                |sum: &__m512| *sum,
                LANE_ROWS,
                LANE_BLOCKS
            )
        };
    }
    // Float weights have no unpacking to share: one token at a time.
    macro_rules! per_token {
        () => {
            for (t, x) in xs.iter().enumerate() {
                vec_dot_rows_generic::<D>(ty, rows, row_bytes, x, &mut out[t * n_rows..(t + 1) * n_rows]);
            }
        };
    }
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => per_token!(),
        GgmlType::Q4_0 if D::WIDE => lanes32!(exact32::Q4_0),
        GgmlType::Q4_0 => tiled!(legacy::dot_q4_0),
        GgmlType::Q4_1 => tiled!(legacy::dot_q4_1),
        GgmlType::Q5_0 if D::WIDE => lanes32!(exact32::Q5_0),
        GgmlType::Q5_0 => tiled!(legacy::dot_q5_0),
        GgmlType::Q8_0 if D::WIDE => lanes32!(exact32::Q8_0),
        GgmlType::Q8_0 => tiled!(legacy::dot_q8_0),
        GgmlType::Q4_K if D::WIDE => lanes_k!(wide::q4_k_lanes, dot_q4_k),
        GgmlType::Q4_K => tiled!(kquants::dot_q4_k),
        GgmlType::Q5_K => tiled!(kquants::dot_q5_k),
        GgmlType::Q6_K if D::WIDE => lanes_k!(wide::q6_k_lanes, dot_q6_k),
        GgmlType::Q6_K => tiled!(kquants::dot_q6_k),
        GgmlType::Q5_1 if D::WIDE => lanes32!(exact32::Q5_1),
        GgmlType::Q5_1 => tiled!(lowbit::dot_q5_1),
        GgmlType::Q2_K if D::WIDE => lanes_k!(lowwide::q2_k_lanes, dot_q2_k),
        GgmlType::Q2_K => tiled!(lowbit::dot_q2_k),
        GgmlType::Q3_K if D::WIDE => lanes_k!(lowwide::q3_k_lanes, dot_q3_k),
        GgmlType::Q3_K => tiled!(lowbit::dot_q3_k),
        GgmlType::IQ4_NL if D::WIDE => lanes32!(exact32::Iq4Nl),
        GgmlType::IQ4_NL => tiled!(lowbit::dot_iq4_nl),
        GgmlType::IQ4_XS if D::WIDE => lanes_k!(lowwide::iq4_xs_lanes, dot_iq4_xs),
        GgmlType::IQ4_XS => tiled!(lowbit::dot_iq4_xs),
        GgmlType::MXFP4 if D::WIDE => lanes32!(exact32::Mxfp4),
        GgmlType::MXFP4 => tiled!(lowbit::dot_mxfp4),
        GgmlType::IQ2_XXS => tiled!(grid::dot_iq2_xxs),
        GgmlType::IQ2_XS => tiled!(grid::dot_iq2_xs),
        GgmlType::IQ2_S => tiled!(grid::dot_iq2_s),
        GgmlType::IQ3_XXS => tiled!(grid::dot_iq3_xxs),
        GgmlType::IQ3_S => tiled!(grid::dot_iq3_s),
        GgmlType::IQ1_S => tiled!(grid::dot_iq1_s),
        GgmlType::IQ1_M => tiled!(grid::dot_iq1_m),
    }
}

/// Sum of the eight lanes.
#[inline(always)]
unsafe fn hsum_ps(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    let single = _mm_add_ss(pair, _mm_movehdup_ps(pair));
    _mm_cvtss_f32(single)
}

/// The little-endian f16 at `p`, as `f32` (F16C).
#[inline(always)]
unsafe fn read_f16(p: *const u8) -> f32 {
    let bits = std::ptr::read_unaligned(p as *const u16);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}
/// Sums blocks `0..n_blocks` for a tile of `$nt` tokens into two independent `f32x8`
/// accumulators per token (even and odd blocks), so consecutive blocks' float adds do not wait
/// on each other, then reduces each token's pair to one `f32`; evaluates to `[f32; $nt]`.
/// `$body` updates `$acc: &mut [__m256; $nt]` (token `t`'s accumulator is `$acc[t]`) for block
/// `$b`. Each token's float operations do not depend on `$nt`, which is what makes a tile's
/// results bit-identical to one token at a time.
macro_rules! sum_blocks {
    ($nt:expr, $n_blocks:expr, |$b:ident, $acc:ident| $body:block) => {{
        let n_blocks: usize = $n_blocks;
        let mut acc_even = [_mm256_setzero_ps(); $nt];
        let mut acc_odd = [_mm256_setzero_ps(); $nt];
        let mut block = 0;
        while block + 2 <= n_blocks {
            {
                let ($b, $acc) = (block, &mut acc_even);
                $body
            }
            {
                let ($b, $acc) = (block + 1, &mut acc_odd);
                $body
            }
            block += 2;
        }
        if block < n_blocks {
            let ($b, $acc) = (block, &mut acc_even);
            $body
        }
        let mut sums = [0.0f32; $nt];
        for (sum, (even, odd)) in sums.iter_mut().zip(acc_even.into_iter().zip(acc_odd)) {
            *sum = super::hsum_ps(_mm256_add_ps(even, odd));
        }
        sums
    }};
}
use sum_blocks;

#[cfg(test)]
mod tests {
    use super::super::test_util::{dequantized_activations, random_row, Rng};
    use super::super::{dequantize_row, vec_dot_scalar, KernelFamily};
    use super::*;

    /// Every SIMD family against the scalar reference, for every type, on one block, a few
    /// blocks (odd counts exercise the loop tails), and the model sizes 1536 and 8960.
    #[test]
    fn every_family_matches_scalar_reference() {
        let families = KernelFamily::available();
        assert!(
            families.len() > 1,
            "no SIMD family on this CPU: the SIMD kernels were not tested"
        );
        let mut rng = Rng::new(42);
        for ty in GgmlType::ALL {
            let block = ty.block_elems().max(32);
            let mut lengths = vec![block, 3 * block, 1536, 8960];
            if ty.block_elems() == 1 {
                lengths.extend([1, 7, 33, 100]);
            }
            for n_elems in lengths {
                let x: Vec<f32> = (0..n_elems).map(|_| rng.normal()).collect();
                let mut prepared = PreparedInput::new();
                prepared.prepare(&x, ty);
                let n_rows = 3;
                let rows: Vec<u8> = (0..n_rows).flat_map(|_| random_row(&mut rng, ty, n_elems)).collect();
                let row_bytes = ty.row_bytes(n_elems).unwrap();
                let y = dequantized_activations(&prepared);
                for family in &families {
                    let mut out = vec![f32::NAN; n_rows];
                    family.vec_dot_rows(ty, &rows, &prepared, &mut out);
                    for (r, row) in rows.chunks_exact(row_bytes).enumerate() {
                        let reference = vec_dot_scalar(ty, row, &prepared);
                        let mut w = vec![0.0f32; n_elems];
                        dequantize_row(ty, row, &mut w);
                        let abs_sum: f32 = w.iter().zip(&y).map(|(a, b)| (a * b).abs()).sum();
                        let tol = 1e-4 * (reference.abs() + abs_sum) + 1e-6;
                        assert!(
                            (out[r] - reference).abs() <= tol,
                            "{family:?} {ty:?} n={n_elems} row {r}: {} vs scalar {reference}",
                            out[r]
                        );
                    }
                }
            }
        }
    }

    /// With every weight scale 1 and activations that quantize to themselves (integers, one
    /// of 127 per block so the activation scale is ±1), every product, block sum and float
    /// partial sum is an integer below 2^24: exact in any order. Each family's per-block
    /// integers must then give the scalar reference's result bit for bit.
    #[test]
    fn integer_blocks_equal_scalar_bit_for_bit() {
        let mut rng = Rng::new(77);
        let one = 0x3c00u16.to_le_bytes();
        for ty in GgmlType::ALL.into_iter().filter(|ty| ty.block_elems() > 1) {
            let n_elems = 512;
            let n_rows = 4;
            let mut rows: Vec<u8> = (0..n_rows).flat_map(|_| random_row(&mut rng, ty, n_elems)).collect();
            for block in rows.chunks_exact_mut(ty.block_bytes()) {
                let scale_fields: &[usize] = match ty {
                    GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
                    GgmlType::Q2_K => &[80, 82],
                    GgmlType::Q3_K => &[108],
                    GgmlType::Q6_K => &[208],
                    GgmlType::MXFP4 => &[],
                    _ => &[0],
                };
                for &at in scale_fields {
                    block[at..at + 2].copy_from_slice(&one);
                }
                if ty == GgmlType::MXFP4 {
                    block[0] = 128; // 2^(128 - 128)
                }
            }
            let x: Vec<f32> = (0..n_elems)
                .map(|i| {
                    if i % 32 == 5 {
                        127.0
                    } else {
                        (rng.next_u32() % 7) as f32 - 3.0
                    }
                })
                .collect();
            let mut prepared = PreparedInput::new();
            prepared.prepare(&x, ty);
            assert!(prepared.block_scales.iter().all(|s| s.abs() == 1.0), "{ty:?}");
            let row_bytes = ty.row_bytes(n_elems).unwrap();
            let reference: Vec<f32> = rows
                .chunks_exact(row_bytes)
                .map(|row| vec_dot_scalar(ty, row, &prepared))
                .collect();
            for family in KernelFamily::available() {
                let mut out = vec![f32::NAN; n_rows];
                family.vec_dot_rows(ty, &rows, &prepared, &mut out);
                assert_eq!(out, reference, "{family:?} {ty:?}");
            }
        }
    }

    /// Saturation edge: the largest weight quants against activations of ±127 everywhere.
    #[test]
    fn extreme_quants_do_not_saturate() {
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::Q5_1,
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::IQ4_NL,
            GgmlType::IQ4_XS,
            GgmlType::MXFP4,
        ] {
            for fill in [0x00u8, 0x7f, 0x80, 0xff] {
                let n_elems = 512;
                let mut row = vec![fill; ty.row_bytes(n_elems).unwrap()];
                for block in row.chunks_exact_mut(ty.block_bytes()) {
                    let one = 0x3c00u16.to_le_bytes();
                    match ty {
                        GgmlType::Q6_K => block[208..210].copy_from_slice(&one),
                        GgmlType::Q2_K => {
                            block[80..82].copy_from_slice(&one);
                            block[82..84].copy_from_slice(&one);
                        }
                        GgmlType::Q3_K => block[108..110].copy_from_slice(&one),
                        GgmlType::MXFP4 => block[0] = 127,
                        GgmlType::Q5_1 => {
                            block[..2].copy_from_slice(&one);
                            block[2..4].copy_from_slice(&one);
                        }
                        GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K => {
                            block[..2].copy_from_slice(&one);
                            block[2..4].copy_from_slice(&one);
                        }
                        _ => block[..2].copy_from_slice(&one),
                    }
                }
                for sign in [1.0f32, -1.0] {
                    let x: Vec<f32> = (0..n_elems).map(|i| if i % 3 == 0 { sign } else { -sign }).collect();
                    let mut prepared = PreparedInput::new();
                    prepared.prepare(&x, ty);
                    let reference = vec_dot_scalar(ty, &row, &prepared);
                    for family in KernelFamily::available() {
                        let mut out = [0.0f32];
                        family.vec_dot_rows(ty, &row, &prepared, &mut out);
                        let tol = 1e-4 * reference.abs().max(1.0);
                        assert!(
                            (out[0] - reference).abs() <= tol,
                            "{family:?} {ty:?} {fill:#x}: {} vs {reference}",
                            out[0]
                        );
                    }
                }
            }
        }
    }
}
