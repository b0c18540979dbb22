//! The CPU backend: quantized dot products from `quant` (SIMD chosen at run time), split across
//! threads by rows. Rows are processed in chunks that stay in cache while every token of a batch
//! is multiplied with them (`vec_dot_tile`, which unpacks each weight block once per few tokens),
//! so batched prefill reads and decodes each weight once per tile of tokens, not once per token.

use rayon::prelude::*;

use super::Backend;
use crate::quant::{axpy_row_f64, vec_dot, vec_dot_rows, vec_dot_tile, PreparedInput};
use crate::tensor::Weight;

/// Rows per work item: small enough to balance two threads, large enough that scheduling is
/// noise next to the dot products (a Q4_K row of 1536 is 864 bytes; 64 rows stay in L2).
const CHUNK_ROWS: usize = 64;
/// Tokens per `vec_dot_tile` call in the batched matmul: the chunk's rows stream through the
/// kernels once per this many tokens, whose outputs (16 x 64 floats) live on the stack.
const CHUNK_TOKENS: usize = 16;

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl CpuBackend {
    /// `threads == 0` means one per available core.
    pub fn new(threads: usize) -> CpuBackend {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        CpuBackend { pool, threads }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }
}

/// A raw output pointer shared by workers that write disjoint indices.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: workers write through it only at indices no other worker touches (disjoint row
// chunks), and the owning slice outlives the parallel scope that uses it.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!(
            "cpu ({} threads, {} kernels)",
            self.threads,
            crate::quant::kernel_name()
        )
    }

    fn matmul(&self, w: &Weight, xs: &[PreparedInput], out: &mut [f32]) {
        let n_tok = xs.len();
        assert_eq!(out.len(), n_tok * w.rows, "matmul output size");
        if !w.is_contiguous() {
            let all: Vec<u32> = (0..w.rows as u32).collect();
            return self.matmul_rows(w, &all, xs, out);
        }
        if n_tok == 1 {
            let chunk = CHUNK_ROWS.max(w.rows / (self.threads * 8)).max(1);
            self.pool.install(|| {
                out.par_chunks_mut(chunk).enumerate().for_each(|(c, o)| {
                    let start = c * chunk;
                    vec_dot_rows(w.ty, w.rows_bytes(start, start + o.len()), &xs[0], o);
                })
            });
            return;
        }
        // Batched: each chunk of rows is multiplied with the tokens a tile at a time, so every
        // weight block is unpacked once per few tokens rather than once per token.
        let xs: Vec<&PreparedInput> = xs.iter().collect();
        let ptr = OutPtr(out.as_mut_ptr());
        let n_chunks = w.rows.div_ceil(CHUNK_ROWS);
        self.pool.install(|| {
            (0..n_chunks).into_par_iter().for_each(|c| {
                let start = c * CHUNK_ROWS;
                let end = (start + CHUNK_ROWS).min(w.rows);
                let n = end - start;
                let rows = w.rows_bytes(start, end);
                let mut local = [0f32; CHUNK_TOKENS * CHUNK_ROWS];
                for (g, group) in xs.chunks(CHUNK_TOKENS).enumerate() {
                    let local = &mut local[..group.len() * n];
                    vec_dot_tile(w.ty, rows, group, local);
                    let dst = ptr;
                    for (i, out_t) in local.chunks_exact(n).enumerate() {
                        let t = g * CHUNK_TOKENS + i;
                        // SAFETY: rows start..end of token t lie inside `out` ([n_tok, rows],
                        // asserted above) and belong to this chunk only; `out_t` is a local
                        // buffer, so the ranges cannot overlap.
                        unsafe {
                            std::ptr::copy_nonoverlapping(out_t.as_ptr(), dst.0.add(t * w.rows + start), n);
                        }
                    }
                }
            })
        });
    }

    fn matmul_rows(&self, w: &Weight, rows: &[u32], xs: &[PreparedInput], out: &mut [f32]) {
        let n = rows.len();
        assert_eq!(out.len(), xs.len() * n, "matmul_rows output size");
        let ptr = OutPtr(out.as_mut_ptr());
        self.pool.install(|| {
            rows.par_chunks(CHUNK_ROWS).enumerate().for_each(|(c, chunk)| {
                for (t, x) in xs.iter().enumerate() {
                    for (i, &r) in chunk.iter().enumerate() {
                        let v = vec_dot(w.ty, w.row(r as usize), x);
                        let dst = ptr;
                        // SAFETY: index t*n + c*CHUNK_ROWS + i is inside `out` and owned by this chunk.
                        unsafe { *dst.0.add(t * n + c * CHUNK_ROWS + i) = v };
                    }
                }
            })
        });
    }

    fn accumulate_rows(&self, w: &Weight, rows: Option<&[u32]>, acts: &[f32], out: &mut [f32]) {
        let n_tok = out.len() / w.cols;
        assert_eq!(out.len(), n_tok * w.cols, "accumulate_rows output size");
        assert_eq!(acts.len(), n_tok * w.rows, "accumulate_rows activations size");
        let all: Vec<u32>;
        let rows = match rows {
            Some(r) => r,
            None => {
                all = (0..w.rows as u32).collect();
                &all
            }
        };
        if n_tok > TOKENS_PER_TILE / 2 {
            return self.accumulate_tiled(w, rows, acts, n_tok, out);
        }
        // Few tokens (decode): each thread sums its share of the rows into a private buffer; the
        // buffers are added at the end, so no two threads write the same output.
        let per = rows.len().div_ceil(self.threads).max(1);
        let partials: Vec<Vec<f64>> = self.pool.install(|| {
            rows.par_chunks(per)
                .map(|chunk| {
                    let mut local = vec![0f64; out.len()];
                    Self::accumulate_range(w, chunk, acts, n_tok, &mut local);
                    local
                })
                .collect()
        });
        for (i, o) in out.iter_mut().enumerate() {
            *o += partials.iter().map(|p| p[i]).sum::<f64>() as f32;
        }
    }
}

/// Tokens whose f64 accumulators are kept together while the rows stream past (batched path).
const TOKENS_PER_TILE: usize = 16;
/// Output columns per tile: 16 tokens x 256 columns x 8 bytes = 32 KiB of accumulators (L1).
const COLS_PER_TILE: usize = 256;

impl CpuBackend {
    /// Many tokens (prefill): tiles of (tokens x columns) own their outputs, so threads split
    /// the columns and no reduction is needed; every row's segment is dequantized into the
    /// tile's f64 accumulators, which stay in L1 instead of streaming a whole `[tokens, cols]`
    /// buffer through the cache for every row.
    fn accumulate_tiled(&self, w: &Weight, rows: &[u32], acts: &[f32], n_tok: usize, out: &mut [f32]) {
        let block = w.ty.block_elems();
        // Column tiles must cut rows at block boundaries; fall back to whole rows otherwise.
        let tile_cols = if COLS_PER_TILE.is_multiple_of(block) && w.cols.is_multiple_of(block) {
            COLS_PER_TILE.min(w.cols)
        } else {
            w.cols
        };
        let n_col_tiles = w.cols.div_ceil(tile_cols);
        let n_tok_tiles = n_tok.div_ceil(TOKENS_PER_TILE);
        let ptr = OutPtr(out.as_mut_ptr());
        self.pool.install(|| {
            (0..n_col_tiles * n_tok_tiles).into_par_iter().for_each(|tile| {
                let (ct, tt) = (tile % n_col_tiles, tile / n_col_tiles);
                let (c0, c1) = (ct * tile_cols, ((ct + 1) * tile_cols).min(w.cols));
                let (t0, t1) = (tt * TOKENS_PER_TILE, ((tt + 1) * TOKENS_PER_TILE).min(n_tok));
                let width = c1 - c0;
                // Byte range of columns [c0, c1) inside a row (whole blocks by construction).
                let b0 = w.ty.row_bytes(c0).expect("block-aligned tile start");
                let b1 = w.ty.row_bytes(c1).expect("block-aligned tile end");
                let mut acc = vec![0f64; (t1 - t0) * width];
                for &r in rows {
                    let r = r as usize;
                    let segment = &w.row(r)[b0..b1];
                    for t in t0..t1 {
                        let a = acts[t * w.rows + r];
                        if a != 0.0 {
                            let i = t - t0;
                            axpy_row_f64(w.ty, segment, a, &mut acc[i * width..(i + 1) * width]);
                        }
                    }
                }
                let dst = ptr;
                for t in t0..t1 {
                    for (c, v) in (c0..c1).zip(&acc[(t - t0) * width..(t - t0 + 1) * width]) {
                        // SAFETY: (t, c) lies inside `out` ([n_tok, cols], asserted by the
                        // caller) and inside this tile, which no other task touches.
                        unsafe { *dst.0.add(t * w.cols + c) += *v as f32 };
                    }
                }
            })
        });
    }

    /// Sums in f64: the result then does not depend on the order of the rows (neuron order in
    /// the file) or on how they are split across threads. In f32 it would, and the models'
    /// quantized activations amplify such last-bit differences into visible logit changes.
    fn accumulate_range(w: &Weight, rows: &[u32], acts: &[f32], n_tok: usize, local: &mut [f64]) {
        for &r in rows {
            let r = r as usize;
            for t in 0..n_tok {
                let a = acts[t * w.rows + r];
                if a != 0.0 {
                    axpy_row_f64(w.ty, w.row(r), a, &mut local[t * w.cols..(t + 1) * w.cols]);
                }
            }
        }
    }
}

impl CpuBackend {
    /// Run `f` on this backend's threads (attention and other per-head work).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}
