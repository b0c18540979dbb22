//! GGML tensor element types: block layouts, scalar dequantization, quantization, and the dot
//! products the CPU backend's matvec is built from.
//!
//! This module owns the bit-exact byte layouts of the GGUF weight types we support (they must
//! match ggml's `block_*` structs, see [`layout`]) and the kernels that read them. It knows bytes
//! and numbers only: it does no I/O, names no other part of the crate, and holds no state apart
//! from the once-cached answer to "which SIMD kernels does this CPU run".
//!
//! Dot products follow llama.cpp: the activation vector is quantized once per matvec into a
//! [`PreparedInput`] (Q8_0-style blocks of 32 for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, IQ4_NL and MXFP4
//! weights, Q8_K blocks of 256 for the K-quants, IQ4_XS and the grid types, plain `f32` for float weights), and each row is then an integer dot product
//! per block scaled in `f32`. [`vec_dot_scalar`] is the reference: every SIMD family computes the
//! same integer dot per block and differs only in float arithmetic (the order of the summation;
//! the wide K-quant and IQ4_XS kernels close each block's exact integers in scalar float), and the tests
//! check each family against it. [`vec_dot_tile`] is the batched form (several prepared inputs,
//! a [`TokenTile`], against the same rows, each weight block unpacked once per few tokens, or
//! read four quants at a time against 16 tokens in vector lanes); its results equal per-input
//! [`vec_dot_rows`] bit for bit.
//!
//! Length mismatches (a row whose byte length does not fit the prepared input, an output slice of
//! the wrong size) are programming errors here and panic; callers validate tensor shapes first.

mod axpy;
mod dequant;
#[rustfmt::skip]
mod grids;
mod iq;
mod lanes;
mod layout;
#[cfg(target_arch = "aarch64")]
mod neon;
mod prepare;
mod quantize;
mod scalar;
pub mod sketch;
mod tile;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod test_util;

use std::sync::OnceLock;

pub use axpy::{axpy_row_f64, axpy_row_f64_scalar};
pub use dequant::dequantize_row;
pub use lanes::TokenTile;
#[cfg(feature = "cuda")]
pub(crate) use prepare::ActivationFormat;
pub use prepare::PreparedInput;
pub use quantize::quantize_row;
pub use scalar::vec_dot_scalar;
pub use tile::vec_dot_tile;

/// A tensor element type this engine can compute with. The discriminant-free enum keeps GGUF's
/// numeric ids in one place ([`GgmlType::from_ggml_id`] / [`GgmlType::ggml_id`]).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    IQ2_XXS,
    IQ2_XS,
    IQ2_S,
    IQ3_XXS,
    IQ3_S,
    IQ1_S,
    IQ1_M,
}

impl GgmlType {
    /// Every supported type, in GGUF id order (handy for tests and for error messages).
    pub const ALL: [GgmlType; 23] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::MXFP4,
    ];

    /// The supported type with GGUF/ggml type id `id`, or `None` (unknown or unsupported).
    pub fn from_ggml_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|ty| ty.ggml_id() == id)
    }

    /// The GGUF/ggml type id (`enum ggml_type` in ggml.h).
    pub fn ggml_id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::IQ4_NL => 20,
            GgmlType::IQ2_XXS => 16,
            GgmlType::IQ2_XS => 17,
            GgmlType::IQ3_XXS => 18,
            GgmlType::IQ1_S => 19,
            GgmlType::IQ3_S => 21,
            GgmlType::IQ2_S => 22,
            GgmlType::IQ4_XS => 23,
            GgmlType::IQ1_M => 29,
            GgmlType::BF16 => 30,
            GgmlType::MXFP4 => 39,
        }
    }

    /// ggml's name for the type ("F32", "Q4_K", ...).
    pub fn name(self) -> &'static str {
        ggml_type_name(self.ggml_id()).expect("every supported type has a ggml name")
    }

    /// Elements per block: 1 for float types, 32 for the legacy quants, IQ4_NL and MXFP4, 256
    /// for the K-quants, IQ4_XS and the grid types (IQ2_*, IQ3_*, IQ1_*).
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::IQ4_NL
            | GgmlType::MXFP4 => layout::QK_LEGACY,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_XS
            | GgmlType::IQ2_XXS
            | GgmlType::IQ2_XS
            | GgmlType::IQ2_S
            | GgmlType::IQ3_XXS
            | GgmlType::IQ3_S
            | GgmlType::IQ1_S
            | GgmlType::IQ1_M => layout::QK_K,
        }
    }

    /// Bytes per block (see [`layout`] for the field offsets).
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => layout::Q4_0_BLOCK_BYTES,
            GgmlType::Q4_1 => layout::Q4_1_BLOCK_BYTES,
            GgmlType::Q5_0 => layout::Q5_0_BLOCK_BYTES,
            GgmlType::Q5_1 => layout::Q5_1_BLOCK_BYTES,
            GgmlType::Q8_0 => layout::Q8_0_BLOCK_BYTES,
            GgmlType::Q2_K => layout::Q2_K_BLOCK_BYTES,
            GgmlType::Q3_K => layout::Q3_K_BLOCK_BYTES,
            GgmlType::Q4_K => layout::Q4_K_BLOCK_BYTES,
            GgmlType::Q5_K => layout::Q5_K_BLOCK_BYTES,
            GgmlType::Q6_K => layout::Q6_K_BLOCK_BYTES,
            GgmlType::IQ4_NL => layout::IQ4_NL_BLOCK_BYTES,
            GgmlType::IQ4_XS => layout::IQ4_XS_BLOCK_BYTES,
            GgmlType::MXFP4 => layout::MXFP4_BLOCK_BYTES,
            GgmlType::IQ2_XXS => iq::IQ2_XXS_BLOCK_BYTES,
            GgmlType::IQ2_XS => iq::IQ2_XS_BLOCK_BYTES,
            GgmlType::IQ2_S => iq::IQ2_S_BLOCK_BYTES,
            GgmlType::IQ3_XXS => iq::IQ3_XXS_BLOCK_BYTES,
            GgmlType::IQ3_S => iq::IQ3_S_BLOCK_BYTES,
            GgmlType::IQ1_S => iq::IQ1_S_BLOCK_BYTES,
            GgmlType::IQ1_M => iq::IQ1_M_BLOCK_BYTES,
        }
    }

    /// Bytes of a row of `n_elems` elements; `None` if `n_elems` is not a whole number of blocks
    /// or the size overflows `usize`.
    pub fn row_bytes(self, n_elems: usize) -> Option<usize> {
        if !n_elems.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n_elems / self.block_elems()).checked_mul(self.block_bytes())
    }
}

/// The names of every supported type, comma-separated in GGUF id order (for error messages).
pub fn supported_type_names() -> String {
    GgmlType::ALL.map(GgmlType::name).join(", ")
}

/// ggml's name for any type id, including ones this engine cannot compute with, so that errors
/// can say "Q3_K is not supported" instead of "type 11". `None` for ids ggml never assigned or
/// has removed.
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

/// IEEE half-precision bits to `f32` (exact).
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// bfloat16 bits to `f32` (exact: bf16 is the top half of an f32).
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// The SIMD kernel families, best first. Each x86 family is a set of `#[target_feature]`
/// functions; the choice is made once per process from CPUID.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KernelFamily {
    /// AVX-512 VNNI (`vpdpbusd` on 256-bit vectors) plus AVX2/FMA/F16C.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// AVX2 `vpmaddubsw`/`vpmaddwd` plus FMA/F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// NEON (every aarch64 CPU) for Q4_0, Q8_0, Q4_K and Q6_K; the scalar code for the rest.
    #[cfg(target_arch = "aarch64")]
    Neon,
    Scalar,
}

impl KernelFamily {
    fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            KernelFamily::Avx512Vnni => "avx512vnni",
            #[cfg(target_arch = "x86_64")]
            KernelFamily::Avx2 => "avx2",
            #[cfg(target_arch = "aarch64")]
            KernelFamily::Neon => "neon",
            KernelFamily::Scalar => "scalar",
        }
    }

    /// Whether this family has the token-lane kernels that read a [`TokenTile`]'s packs.
    fn has_lane_kernels(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self == KernelFamily::Avx512Vnni {
            return true;
        }
        false
    }

    /// The best family this CPU supports. Cached because the matvec asks once per call.
    fn detected() -> KernelFamily {
        static FAMILY: OnceLock<KernelFamily> = OnceLock::new();
        *FAMILY.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if x86::vnni_supported() {
                    return KernelFamily::Avx512Vnni;
                }
                if x86::avx2_supported() {
                    return KernelFamily::Avx2;
                }
            }
            #[cfg(target_arch = "aarch64")]
            return KernelFamily::Neon;
            #[allow(unreachable_code)]
            KernelFamily::Scalar
        })
    }

    /// Every family this CPU can run, best first (the tests check each against the scalar one).
    #[cfg(test)]
    fn available() -> Vec<KernelFamily> {
        let mut families = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if x86::vnni_supported() {
                families.push(KernelFamily::Avx512Vnni);
            }
            if x86::avx2_supported() {
                families.push(KernelFamily::Avx2);
            }
        }
        #[cfg(target_arch = "aarch64")]
        families.push(KernelFamily::Neon);
        families.push(KernelFamily::Scalar);
        families
    }

    /// `out[i] = dot(row i, x)` with this family's kernels.
    fn vec_dot_rows(self, ty: GgmlType, rows: &[u8], x: &PreparedInput, out: &mut [f32]) {
        let row_bytes = check_rows(ty, rows, x, out.len());
        if row_bytes == 0 {
            // An empty input vector: every dot product is the empty sum.
            out.fill(0.0);
            return;
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            KernelFamily::Avx512Vnni => {
                // SAFETY: this family is only constructed (by `detected`/`available`) after
                // `x86::vnni_supported()` confirmed every feature the function enables, and
                // `check_rows` has verified the slice lengths the kernels index by.
                unsafe { x86::vec_dot_rows_vnni(ty, rows, row_bytes, x, out) }
            }
            #[cfg(target_arch = "x86_64")]
            KernelFamily::Avx2 => {
                // SAFETY: as above, with `x86::avx2_supported()`.
                unsafe { x86::vec_dot_rows_avx2(ty, rows, row_bytes, x, out) }
            }
            #[cfg(target_arch = "aarch64")]
            KernelFamily::Neon => neon::vec_dot_rows(ty, rows, row_bytes, x, out),
            KernelFamily::Scalar => {
                for (row, dst) in rows.chunks_exact(row_bytes).zip(out.iter_mut()) {
                    *dst = vec_dot_scalar(ty, row, x);
                }
            }
        }
    }
}

/// Panics unless `rows` is `n_rows` rows of `ty` matching the prepared input; returns the bytes
/// per row.
fn check_rows(ty: GgmlType, rows: &[u8], x: &PreparedInput, n_rows: usize) -> usize {
    assert!(
        x.is_prepared_for(ty),
        "input prepared for {} weights, used with {} weights",
        x.weight_type().name(),
        ty.name()
    );
    let row_bytes = ty
        .row_bytes(x.len())
        .unwrap_or_else(|| panic!("{} elements is not a whole number of {} blocks", x.len(), ty.name()));
    assert_eq!(
        Some(rows.len()),
        row_bytes.checked_mul(n_rows),
        "{n_rows} rows of {} x {} need {row_bytes} bytes each",
        x.len(),
        ty.name()
    );
    row_bytes
}

/// Which kernel family [`vec_dot`] uses on this CPU: "avx512vnni", "avx2", "neon" or "scalar".
/// (There is no separate "avx512" family without VNNI: such CPUs run the AVX2 kernels.)
pub fn kernel_name() -> &'static str {
    KernelFamily::detected().name()
}

/// `dot(row, x)` with the fastest kernel this CPU supports. Panics if `row` is not one row of
/// `ty` with `x.len()` elements or `x` was prepared for an incompatible weight type.
pub fn vec_dot(ty: GgmlType, row: &[u8], x: &PreparedInput) -> f32 {
    let mut out = [0.0f32];
    KernelFamily::detected().vec_dot_rows(ty, row, x, &mut out);
    out[0]
}

/// `out[i] = dot(row i, x)` for `i in 0..out.len()`, where `rows` holds `out.len()` consecutive
/// rows of `ty`. The matvec's inner loop: the dispatch happens once per call, not per row.
/// Panics on mismatched lengths like [`vec_dot`].
pub fn vec_dot_rows(ty: GgmlType, rows: &[u8], x: &PreparedInput, out: &mut [f32]) {
    KernelFamily::detected().vec_dot_rows(ty, rows, x, out);
}

#[cfg(test)]
mod tests {
    use super::test_util::{random_row, Rng};
    use super::*;

    #[test]
    fn type_ids_round_trip_and_sizes_match_ggml() {
        for ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_ggml_id(ty.ggml_id()), Some(ty));
            assert_eq!(ggml_type_name(ty.ggml_id()), Some(ty.name()));
        }
        let sizes = [
            (GgmlType::F32, 1, 4),
            (GgmlType::F16, 1, 2),
            (GgmlType::BF16, 1, 2),
            (GgmlType::Q4_0, 32, 18),
            (GgmlType::Q4_1, 32, 20),
            (GgmlType::Q5_0, 32, 22),
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q4_K, 256, 144),
            (GgmlType::Q5_K, 256, 176),
            (GgmlType::Q6_K, 256, 210),
            (GgmlType::Q5_1, 32, 24),
            (GgmlType::Q2_K, 256, 84),
            (GgmlType::Q3_K, 256, 110),
            (GgmlType::IQ4_NL, 32, 18),
            (GgmlType::IQ4_XS, 256, 136),
            (GgmlType::MXFP4, 32, 17),
            (GgmlType::IQ2_XXS, 256, 66),
            (GgmlType::IQ2_XS, 256, 74),
            (GgmlType::IQ2_S, 256, 82),
            (GgmlType::IQ3_XXS, 256, 98),
            (GgmlType::IQ3_S, 256, 110),
            (GgmlType::IQ1_S, 256, 50),
            (GgmlType::IQ1_M, 256, 56),
        ];
        for (ty, elems, bytes) in sizes {
            assert_eq!((ty.block_elems(), ty.block_bytes()), (elems, bytes), "{ty:?}");
        }
        let ids = [
            (7, "Q5_1"),
            (10, "Q2_K"),
            (11, "Q3_K"),
            (20, "IQ4_NL"),
            (23, "IQ4_XS"),
            (39, "MXFP4"),
            (16, "IQ2_XXS"),
            (17, "IQ2_XS"),
            (18, "IQ3_XXS"),
            (19, "IQ1_S"),
            (21, "IQ3_S"),
            (22, "IQ2_S"),
            (29, "IQ1_M"),
        ];
        for (id, name) in ids {
            assert_eq!(GgmlType::from_ggml_id(id).map(GgmlType::name), Some(name));
        }
        // Still unsupported: the ternary types, Q8_1/Q8_K, the integer and F64 types.
        for id in [9, 15, 24, 25, 26, 27, 28, 34, 35] {
            assert_eq!(GgmlType::from_ggml_id(id), None, "{id}");
        }
        assert_eq!(ggml_type_name(34), Some("TQ1_0"));
        assert_eq!(ggml_type_name(4), None);
        assert_eq!(GgmlType::Q4_K.row_bytes(1536), Some(6 * 144));
        assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
        assert_eq!(GgmlType::F32.row_bytes(usize::MAX), None);
    }

    #[test]
    fn half_helpers_convert_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2.0f32.powi(-24));
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0xc049), -3.140625);
    }

    #[test]
    fn vec_dot_agrees_with_vec_dot_rows_and_scalar() {
        let mut rng = Rng::new(7);
        let n_elems = 512;
        let x: Vec<f32> = (0..n_elems).map(|_| rng.normal()).collect();
        for ty in GgmlType::ALL {
            let mut prepared = PreparedInput::new();
            prepared.prepare(&x, ty);
            let rows: Vec<u8> = (0..3).flat_map(|_| random_row(&mut rng, ty, n_elems)).collect();
            let mut out = [0.0f32; 3];
            vec_dot_rows(ty, &rows, &prepared, &mut out);
            let row_bytes = ty.row_bytes(n_elems).unwrap();
            for (i, row) in rows.chunks_exact(row_bytes).enumerate() {
                let single = vec_dot(ty, row, &prepared);
                let reference = vec_dot_scalar(ty, row, &prepared);
                assert_eq!(single, out[i], "{ty:?}");
                let tol = 1e-4 * (1.0 + reference.abs());
                assert!((single - reference).abs() <= tol, "{ty:?}: {single} vs {reference}");
            }
        }
        assert!(["avx512vnni", "avx2", "neon", "scalar"].contains(&kernel_name()));
    }

    #[test]
    #[should_panic(expected = "need")]
    fn vec_dot_rows_rejects_short_rows() {
        let mut prepared = PreparedInput::new();
        prepared.prepare(&[0.5; 64], GgmlType::Q8_0);
        let mut out = [0.0f32; 2];
        vec_dot_rows(GgmlType::Q8_0, &[0u8; 34 * 3], &prepared, &mut out);
    }
}
