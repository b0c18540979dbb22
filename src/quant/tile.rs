//! Batched dot products: one slice of rows against several prepared inputs (a [`TokenTile`]) at
//! once, the inner loop of batched prefill. The SIMD kernels unpack each weight block once per
//! micro-tile of tokens (4 for AVX2, 8 for VNNI: `ByteDot::TILE_TOKENS` in `x86`; 16 tokens in
//! the lanes of one vector for the VNNI family's Q4_K, Q6_K, Q4_0, Q5_0 and Q8_0, `super::lanes`) instead of once per
//! token, and each token's arithmetic is the single-token kernels' own, so [`vec_dot_tile`]
//! returns exactly what [`super::vec_dot_rows`] returns token by token (the tests compare with
//! `assert_eq!`).

use super::lanes::TokenTile;
use super::{check_rows, vec_dot_scalar, GgmlType, KernelFamily};

impl KernelFamily {
    /// `out[t * n_rows + r] = dot(row r, token t)` with this family's kernels.
    pub(super) fn vec_dot_tile(self, ty: GgmlType, rows: &[u8], tile: &TokenTile, out: &mut [f32]) {
        let xs = tile.tokens();
        let Some(first) = xs.first() else {
            assert!(out.is_empty(), "no inputs, but an output of {} values", out.len());
            return;
        };
        let row_bytes = ty
            .row_bytes(first.len())
            .unwrap_or_else(|| panic!("{} elements is not a whole number of {} blocks", first.len(), ty.name()));
        if row_bytes == 0 {
            // Empty input vectors: the row count is unknowable from `rows`, every dot is 0.
            out.fill(0.0);
            return;
        }
        let n_rows = rows.len() / row_bytes;
        assert_eq!(
            Some(out.len()),
            n_rows.checked_mul(xs.len()),
            "{} inputs x {n_rows} rows need that many outputs",
            xs.len()
        );
        for x in xs {
            // Same length and activation format for every input, whole rows.
            check_rows(ty, rows, x, n_rows);
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            KernelFamily::Avx512Vnni => {
                // SAFETY: this family is only constructed after `x86::vnni_supported()` confirmed
                // its features; `check_rows` verified that `rows` is `n_rows` whole rows matching
                // every input, and `out` has `xs.len() * n_rows` values (asserted above).
                unsafe { super::x86::vec_dot_tile_vnni(ty, rows, row_bytes, tile, out) }
            }
            #[cfg(target_arch = "x86_64")]
            KernelFamily::Avx2 => {
                // SAFETY: as above, with `x86::avx2_supported()`.
                unsafe { super::x86::vec_dot_tile_avx2(ty, rows, row_bytes, tile, out) }
            }
            #[cfg(target_arch = "aarch64")]
            KernelFamily::Neon => {
                for (x, out_t) in xs.iter().zip(out.chunks_exact_mut(n_rows)) {
                    super::neon::vec_dot_rows(ty, rows, row_bytes, x, out_t);
                }
            }
            KernelFamily::Scalar => {
                for (x, out_t) in xs.iter().zip(out.chunks_exact_mut(n_rows)) {
                    for (row, dst) in rows.chunks_exact(row_bytes).zip(out_t) {
                        *dst = vec_dot_scalar(ty, row, x);
                    }
                }
            }
        }
    }
}

/// `out[t * n_rows + r] = dot(row r, token t of tile)`: `rows` holds `n_rows = rows.len() /
/// row_bytes` consecutive rows of `ty` and `out` is `[tile.len()][n_rows]`, row-major. Equal, bit for bit, to
/// calling [`super::vec_dot_rows`] once per input, but each weight block is unpacked once per
/// few tokens. Panics on mismatched lengths or formats like [`super::vec_dot_rows`].
pub fn vec_dot_tile(ty: GgmlType, rows: &[u8], tile: &TokenTile, out: &mut [f32]) {
    KernelFamily::detected().vec_dot_tile(ty, rows, tile, out);
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{random_row, Rng};
    use super::super::PreparedInput;
    use super::*;

    /// Every family x type x token count x row length: the tile must equal the family's own
    /// per-token `vec_dot_rows` exactly, and the scalar reference within float-order tolerance.
    #[test]
    fn tile_equals_per_token_rows_and_scalar_reference() {
        let families = KernelFamily::available();
        assert!(
            families.len() > 1,
            "no SIMD family on this CPU: the SIMD tiles were not tested"
        );
        let mut rng = Rng::new(99);
        for ty in GgmlType::ALL {
            let block = ty.block_elems().max(32);
            for n_elems in [block, 1536, 8960] {
                if ty.row_bytes(n_elems).is_none() {
                    continue; // 8960 is not a whole number of 256-element K-quant blocks
                }
                let row_bytes = ty.row_bytes(n_elems).unwrap();
                let n_rows = 5;
                let rows: Vec<u8> = (0..n_rows).flat_map(|_| random_row(&mut rng, ty, n_elems)).collect();
                let inputs: Vec<PreparedInput> = (0..36)
                    .map(|_| {
                        let x: Vec<f32> = (0..n_elems).map(|_| rng.normal()).collect();
                        let mut p = PreparedInput::new();
                        p.prepare(&x, ty);
                        p
                    })
                    .collect();
                let reference: Vec<Vec<f32>> = inputs
                    .iter()
                    .map(|x| {
                        rows.chunks_exact(row_bytes)
                            .map(|row| vec_dot_scalar(ty, row, x))
                            .collect()
                    })
                    .collect();
                // 18 and 36 end in an unpacked group of 2 and a packed one of 4 (token lanes).
                for n_tok in [1, 2, 3, 4, 5, 8, 13, 16, 18, 36] {
                    let xs: Vec<&PreparedInput> = inputs[..n_tok].iter().collect();
                    let token_tile = TokenTile::new(&xs);
                    for family in &families {
                        let mut tile = vec![f32::NAN; n_tok * n_rows];
                        family.vec_dot_tile(ty, &rows, &token_tile, &mut tile);
                        for (t, x) in xs.iter().enumerate() {
                            let mut single = vec![f32::NAN; n_rows];
                            family.vec_dot_rows(ty, &rows, x, &mut single);
                            let got = &tile[t * n_rows..(t + 1) * n_rows];
                            assert_eq!(got, single.as_slice(), "{family:?} {ty:?} n={n_elems} T={n_tok} t={t}");
                            for (r, (&g, &want)) in got.iter().zip(&reference[t]).enumerate() {
                                let tol = 1e-4 * want.abs() + 1e-3;
                                assert!(
                                    (g - want).abs() <= tol,
                                    "{family:?} {ty:?} n={n_elems} T={n_tok} t={t} r={r}: {g} vs scalar {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The public entry point with the detected family, and an empty token list.
    #[test]
    fn public_tile_matches_vec_dot_rows() {
        let mut rng = Rng::new(5);
        let ty = GgmlType::Q4_K;
        let rows: Vec<u8> = (0..3).flat_map(|_| random_row(&mut rng, ty, 512)).collect();
        let inputs: Vec<PreparedInput> = (0..6)
            .map(|_| {
                let mut p = PreparedInput::new();
                p.prepare(&(0..512).map(|_| rng.normal()).collect::<Vec<_>>(), ty);
                p
            })
            .collect();
        let xs: Vec<&PreparedInput> = inputs.iter().collect();
        let mut out = vec![0.0; 18];
        vec_dot_tile(ty, &rows, &TokenTile::new(&xs), &mut out);
        for (t, x) in inputs.iter().enumerate() {
            let mut single = [0.0; 3];
            super::super::vec_dot_rows(ty, &rows, x, &mut single);
            assert_eq!(&out[3 * t..3 * t + 3], &single);
        }
        vec_dot_tile(ty, &rows, &TokenTile::new(&[]), &mut []);
    }

    #[test]
    #[should_panic(expected = "need that many outputs")]
    fn tile_rejects_wrong_output_size() {
        let mut p = PreparedInput::new();
        p.prepare(&[0.5; 32], GgmlType::Q8_0);
        let mut out = [0.0f32; 3];
        vec_dot_tile(GgmlType::Q8_0, &[0u8; 34 * 2], &TokenTile::new(&[&p, &p]), &mut out);
    }
}
