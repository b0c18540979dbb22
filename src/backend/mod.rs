//! Compute backends. The CPU backend is the reference for every other path and the fast path on
//! this hardware. A backend computes on weights it is handed; it never opens files or decides
//! what to read (that is `model`'s and, later, `stream`'s job).

pub mod cpu;
pub mod ops;

use crate::quant::PreparedInput;
use crate::tensor::Weight;

/// Matrix products over quantized weights, the bulk of the work.
pub trait Backend: Send + Sync {
    fn name(&self) -> String;
    /// `out[t * w.rows + r] = dot(w.row(r), xs[t])` for every token `t` and row `r`.
    fn matmul(&self, w: &Weight, xs: &[PreparedInput], out: &mut [f32]);
    /// Only the listed rows: `out[t * rows.len() + i] = dot(w.row(rows[i]), xs[t])`. The sparse
    /// FFN computes gate/up for a subset of neurons with it.
    fn matmul_rows(&self, w: &Weight, rows: &[u32], xs: &[PreparedInput], out: &mut [f32]);
    /// The transposed product, for matrices stored neuron-major (`[n, cols]`, row r = neuron r's
    /// down column): `out[t * w.cols + c] += sum_r acts[t * w.rows + r] * w[r][c]` over `rows`
    /// (all rows when `None`). Rows whose activation is exactly zero for a token add nothing.
    fn accumulate_rows(&self, w: &Weight, rows: Option<&[u32]>, acts: &[f32], out: &mut [f32]);
}
