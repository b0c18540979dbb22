//! The CPU backend: quantized dot products from `quant` (SIMD chosen at run time), split across
//! threads by rows. Rows are processed in chunks that stay in cache while every token of a batch
//! is multiplied with them (`vec_dot_tile`, which unpacks each weight block once per few tokens),
//! so batched prefill reads and decodes each weight once per tile of tokens, not once per token.

use rayon::prelude::*;

use std::borrow::Cow;
use std::sync::Mutex;

use super::ops::{attend, gelu_tanh, rms_norm, rope_apply, rope_table, silu};
use super::{Act, AttnShape, Backend, Device, RopeShape};
use crate::config::FfnActivation;
use crate::kv::KvCache;
use crate::quant::{axpy_row_f64, dequantize_row, vec_dot, vec_dot_rows, vec_dot_tile, PreparedInput, TokenTile};
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
    /// Prepared-input buffers reused across products (taken and put back, so concurrent
    /// passes each get their own).
    scratch: Mutex<Vec<Vec<PreparedInput>>>,
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
        CpuBackend {
            pool,
            threads,
            scratch: Mutex::new(Vec::new()),
        }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Groups of [`CHUNK_TOKENS`] tokens for [`CpuBackend::matmul_tiled`], their token-lane packs
    /// built on the pool's threads: once per preparation, shared by every weight that reads it.
    /// One token needs none (it takes the one-token path).
    fn token_tiles<'a>(&self, xs: &[&'a PreparedInput]) -> Vec<TokenTile<'a>> {
        if xs.len() < 2 {
            return Vec::new();
        }
        self.pool
            .install(|| xs.par_chunks(CHUNK_TOKENS).map(TokenTile::new).collect())
    }

    /// [`Backend::matmul`] with `tiles` = [`CpuBackend::token_tiles`] of `xs`.
    fn matmul_tiled(&self, w: &Weight, xs: &[PreparedInput], tiles: &[TokenTile], out: &mut [f32]) {
        let n_tok = xs.len();
        assert_eq!(out.len(), n_tok * w.rows, "matmul output size");
        if !w.is_contiguous() {
            let all: Vec<u32> = (0..w.rows as u32).collect();
            return Backend::matmul_rows(self, w, &all, xs, out);
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
        debug_assert_eq!(tiles.iter().map(TokenTile::len).sum::<usize>(), n_tok, "tiles of xs");
        let ptr = OutPtr(out.as_mut_ptr());
        let n_chunks = w.rows.div_ceil(CHUNK_ROWS);
        self.pool.install(|| {
            (0..n_chunks).into_par_iter().for_each(|c| {
                let start = c * CHUNK_ROWS;
                let end = (start + CHUNK_ROWS).min(w.rows);
                let n = end - start;
                let rows = w.rows_bytes(start, end);
                let mut local = [0f32; CHUNK_TOKENS * CHUNK_ROWS];
                for (g, tile) in tiles.iter().enumerate() {
                    let local = &mut local[..tile.len() * n];
                    vec_dot_tile(w.ty, rows, tile, local);
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
}

/// A raw output pointer shared by workers that write disjoint indices.
#[derive(Clone, Copy)]
struct OutPtr<T>(*mut T);
// SAFETY: workers write through it only at indices no other worker touches (disjoint row
// chunks), and the owning slice outlives the parallel scope that uses it.
unsafe impl<T> Send for OutPtr<T> {}
// SAFETY: as for `Send`: shared references only write disjoint indices.
unsafe impl<T> Sync for OutPtr<T> {}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!(
            "cpu ({} threads, {} kernels)",
            self.threads,
            crate::quant::kernel_name()
        )
    }

    fn matmul(&self, w: &Weight, xs: &[PreparedInput], out: &mut [f32]) {
        let refs: Vec<&PreparedInput> = xs.iter().collect();
        self.matmul_tiled(w, xs, &self.token_tiles(&refs), out);
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
        let mut sums = vec![0f64; out.len()];
        self.accumulate_rows_f64(w, rows, acts, &mut sums);
        for (o, s) in out.iter_mut().zip(&sums) {
            *o += *s as f32;
        }
    }
}

impl CpuBackend {
    /// [`Backend::accumulate_rows`]'s sums added to `out` in f64, not rounded: a share of a
    /// product whose other share is summed elsewhere (the hybrid executor's cold neurons),
    /// rounded once where the shares meet ([`Device::accumulate_rows_onto`]).
    pub fn accumulate_rows_f64(&self, w: &Weight, rows: Option<&[u32]>, acts: &[f32], out: &mut [f64]) {
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
            *o += partials.iter().map(|p| p[i]).sum::<f64>();
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
    fn accumulate_tiled(&self, w: &Weight, rows: &[u32], acts: &[f32], n_tok: usize, out: &mut [f64]) {
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
                        unsafe { *dst.0.add(t * w.cols + c) += *v };
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

    fn with_prep<R>(&self, f: impl FnOnce(&mut Vec<PreparedInput>) -> R) -> R {
        let mut prep = self.scratch.lock().expect("scratch").pop().unwrap_or_default();
        let r = f(&mut prep);
        self.scratch.lock().expect("scratch").push(prep);
        r
    }
}

/// Every token of `xs` (rows of `width`) prepared for products with `ty` weights, a prefill's
/// many tokens in parallel on `pool`.
fn prepare_rows(
    pool: &rayon::ThreadPool,
    xs: &[f32],
    width: usize,
    ty: crate::quant::GgmlType,
    out: &mut Vec<PreparedInput>,
) {
    let n = xs.len() / width;
    out.resize_with(n, PreparedInput::new);
    let prepare = |(t, p): (usize, &mut PreparedInput)| p.prepare(&xs[t * width..(t + 1) * width], ty);
    if n == 1 {
        prepare((0, &mut out[0])); // a decode step: no hand-off to the pool
    } else {
        pool.install(|| out.par_iter_mut().enumerate().with_min_len(4).for_each(prepare));
    }
}

fn host(a: &Act) -> &[f32] {
    a.as_host()
        .expect("the CPU device holds its activations in host memory")
}

fn host_mut(a: &mut Act) -> &mut [f32] {
    a.as_host_mut()
        .expect("the CPU device holds its activations in host memory")
}

/// The CPU device: activations are host vectors, products run on this backend's threads.
impl super::HostLink for CpuBackend {}

impl Device for CpuBackend {
    fn attention_sinks(&self) -> bool {
        true
    }
    fn name(&self) -> String {
        Backend::name(self)
    }

    fn run<'a>(&self, f: Box<dyn FnOnce() + Send + 'a>) {
        // Run the whole pass on the pool's threads: the many parallel loops inside it then
        // start from a pool thread, which joins the work directly, instead of parking the
        // caller's thread on a lock for every matrix (that cost ~10% of decode time).
        self.pool.install(f)
    }

    fn upload(&self, rows: usize, width: usize, values: Vec<f32>) -> Act {
        Act::host(rows, width, values)
    }

    fn zeros(&self, rows: usize, width: usize) -> Act {
        Act::zeros(rows, width)
    }

    fn copy(&self, x: &Act) -> Act {
        Act::host(x.rows, x.width, host(x).to_vec())
    }

    fn download(&self, a: Act) -> Vec<f32> {
        a.into_host()
            .expect("the CPU device holds its activations in host memory")
    }

    fn to_host<'a>(&self, a: &'a Act) -> Cow<'a, [f32]> {
        Cow::Borrowed(host(a))
    }

    fn embed(&self, w: &Weight, ids: &[u32], scale: f32) -> Act {
        let h = w.cols;
        let mut x = vec![0f32; ids.len() * h];
        for (row, &id) in x.chunks_mut(h).zip(ids) {
            dequantize_row(w.ty, w.row(id as usize), row);
            if scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        Act::host(ids.len(), h, x)
    }

    fn rms_norm(&self, x: &Act, w: &[f32], eps: f32) -> Act {
        let mut y = Act::host(x.rows, x.width, host(x).to_vec());
        self.rms_norm_in_place(&mut y, w, eps);
        y
    }

    fn rms_norm_in_place(&self, x: &mut Act, w: &[f32], eps: f32) {
        let width = x.width;
        for row in host_mut(x).chunks_mut(width) {
            rms_norm(row, w, eps);
        }
    }

    fn add(&self, x: &mut Act, y: &Act) {
        host_mut(x).iter_mut().zip(host(y)).for_each(|(a, b)| *a += b);
    }

    fn add_bias(&self, x: &mut Act, b: &[f32]) {
        for row in host_mut(x).chunks_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
        }
    }

    fn mul(&self, x: &mut Act, y: &Act) {
        host_mut(x).iter_mut().zip(host(y)).for_each(|(a, b)| *a *= b);
    }

    fn activate(&self, x: &mut Act, f: FfnActivation) {
        // One loop per function, so each is inlined (a function pointer per element costs ~5% of
        // prefill).
        // Split across the threads in pieces of 16 Ki values (a prefill's activations are
        // millions of values; a decode step's few thousand stay on one thread).
        const PIECE: usize = 1 << 14;
        let apply = |v: &mut [f32]| match f {
            FfnActivation::Silu => v.iter_mut().for_each(|v| *v = silu(*v)),
            FfnActivation::GeluTanh => v.iter_mut().for_each(|v| *v = gelu_tanh(*v)),
        };
        let v = host_mut(x);
        if v.len() <= PIECE {
            apply(v);
        } else {
            self.pool.install(|| v.par_chunks_mut(PIECE).for_each(apply));
        }
    }

    fn softcap(&self, x: &mut Act, cap: f32) {
        host_mut(x).iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
    }

    fn select_rows(&self, x: &Act, rows: &[usize]) -> Act {
        let (w, src) = (x.width, host(x));
        let mut out = Vec::with_capacity(rows.len() * w);
        for &r in rows {
            out.extend_from_slice(&src[r * w..(r + 1) * w]);
        }
        Act::host(rows.len(), w, out)
    }

    fn scatter_cols(&self, x: &Act, cols: &[u32], width: usize) -> Act {
        let (n, m, src) = (x.rows, cols.len(), host(x));
        let mut out = vec![0f32; n * width];
        for t in 0..n {
            for (i, &c) in cols.iter().enumerate() {
                out[t * width + c as usize] = src[t * m + i];
            }
        }
        Act::host(n, width, out)
    }

    fn gather_cols(&self, x: &Act, cols: &[u32]) -> Act {
        let (n, w, m, src) = (x.rows, x.width, cols.len(), host(x));
        let mut out = vec![0f32; n * m];
        for t in 0..n {
            for (i, &c) in cols.iter().enumerate() {
                out[t * m + i] = src[t * w + c as usize];
            }
        }
        Act::host(n, m, out)
    }

    fn matmul(&self, ws: &[&Weight], x: &Act) -> Vec<Act> {
        self.with_prep(|prep| {
            // Consecutive weights of one type share one preparation of the input, and its tiles.
            let mut outs = Vec::with_capacity(ws.len());
            for same in ws.chunk_by(|a, b| a.ty == b.ty) {
                prepare_rows(&self.pool, host(x), x.width, same[0].ty, prep);
                let refs: Vec<&PreparedInput> = prep.iter().collect();
                let tiles = self.token_tiles(&refs);
                for w in same {
                    let mut out = vec![0f32; x.rows * w.rows];
                    if w.rows > 0 && x.rows > 0 {
                        self.matmul_tiled(w, prep, &tiles, &mut out);
                    }
                    outs.push(Act::host(x.rows, w.rows, out));
                }
            }
            outs
        })
    }

    fn matmul_rows(&self, w: &Weight, rows: &[u32], x: &Act) -> Act {
        self.with_prep(|prep| {
            prepare_rows(&self.pool, host(x), x.width, w.ty, prep);
            let mut out = vec![0f32; x.rows * rows.len()];
            Backend::matmul_rows(self, w, rows, prep, &mut out);
            Act::host(x.rows, rows.len(), out)
        })
    }

    fn accumulate_rows(&self, w: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        Backend::accumulate_rows(self, w, rows, host(acts), host_mut(out));
    }

    fn accumulate_rows_onto(&self, w: &Weight, rows: Option<&[u32]>, acts: &Act, base: Vec<f64>, out: &mut Act) {
        let mut sums = base;
        self.accumulate_rows_f64(w, rows, host(acts), &mut sums);
        for (o, s) in host_mut(out).iter_mut().zip(&sums) {
            *o += *s as f32;
        }
    }

    fn rope_qk(
        &self,
        q: &mut Act,
        k: &mut Act,
        positions: &[usize],
        shape: RopeShape,
        q_norm: Option<&[f32]>,
        k_norm: Option<&[f32]>,
        eps: f32,
    ) {
        let (qd, kd, hd) = (q.width, k.width, shape.head_dim);
        // Partial RoPE: the first `rd` dimensions rotate (their own size in the angles).
        let rd = shape.rope_dims.min(hd);
        let (qv, kv) = (host_mut(q), host_mut(k));
        let mut table = Vec::with_capacity(rd / 2);
        for (t, &pos) in positions.iter().enumerate() {
            rope_table(pos, rd, shape.base, shape.pos_scale, shape.factors, &mut table);
            for (row, norm) in [
                (&mut qv[t * qd..(t + 1) * qd], q_norm),
                (&mut kv[t * kd..(t + 1) * kd], k_norm),
            ] {
                for head in row.chunks_mut(hd) {
                    if let Some(n) = norm {
                        rms_norm(head, n, eps);
                    }
                    rope_apply(&mut head[..rd], &table, shape.style);
                }
            }
        }
    }

    fn kv_write(
        &self,
        layer: usize,
        k: &Act,
        v: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &mut [&mut KvCache],
    ) {
        let kvd = k.width;
        let (k, v) = (host(k), host(v));
        for (t, (&pos, &s)) in positions.iter().zip(seq_of_token).enumerate() {
            let c = &mut caches[s];
            c.k[layer][pos * kvd..(pos + 1) * kvd].copy_from_slice(&k[t * kvd..(t + 1) * kvd]);
            // (Latent attention: the values are the keys' first numbers; nothing more to write.)
            if !c.v[layer].is_empty() {
                c.v[layer][pos * kvd..(pos + 1) * kvd].copy_from_slice(&v[t * kvd..(t + 1) * kvd]);
            }
        }
    }

    fn attention(
        &self,
        q: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &[&mut KvCache],
        shape: AttnShape<'_>,
    ) -> Act {
        let (qd, hd, l) = (q.width, shape.head_dim, shape.layer);
        let kvd = shape.n_kv_heads * hd;
        let group = shape.n_heads / shape.n_kv_heads;
        let qv = host(q);
        let mut attn = vec![0f32; q.rows * qd];
        self.pool.install(|| {
            attn.par_chunks_mut(hd)
                .enumerate()
                .for_each_init(Vec::new, |scores, (i, out)| {
                    let (t, head) = (i / shape.n_heads, i % shape.n_heads);
                    let pos = positions[t];
                    let c = &caches[seq_of_token[t]];
                    let first = shape.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    let qh = &qv[t * qd + head * hd..t * qd + (head + 1) * hd];
                    attend(
                        qh,
                        &c.k[l],
                        c.values(l),
                        kvd,
                        (head / group) * hd,
                        first..pos + 1,
                        shape.scale,
                        shape.sinks.map(|s| s[head]),
                        scores,
                        out,
                    );
                })
        });
        Act::host(q.rows, qd, attn)
    }
}
