//! The CPU kernels at the shapes and tensor types of the three models here (SmolLM2-135M Q4_1,
//! Gemma-3-270M Q4_K_M, Qwen2.5-1.5B Q4_K_M), and the smaller types (Q2_K, Q3_K, Q5_1, IQ4_NL,
//! IQ4_XS, MXFP4, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) at Qwen's shapes, one thread, in GB/s of weight bytes, beside the memory read
//! bandwidth of one thread measured in the same run (`memory/read`):
//!
//!     cargo bench --bench kernels [-- FILTER]
//!
//! - `matvec/<model>/<tensor>`: one token's product over every row (decode).
//! - `matmul32/<model>/<tensor>`: 32 tokens at once (the batched prefill kernel); its GB/s
//!   counts the weight bytes once, so ×32 tokens of work per byte.
//! - `axpy/qwen/ffn_down_t`: the sparse FFN's neuron-major down columns (Q8_0, as a .gst stores
//!   them) added into an f64 accumulator for half the neurons.
//! - `plan/qwen/50%`: the read planner over half of Qwen's neurons in one FFN section.
//!
//! Weights are random values quantized into each type (the kernels' speed does not depend on
//! the values); activations are random. Matrices of a few MB stay in the caches between
//! iterations, so their GB/s is the caches' rather than memory's; the output matrices (56–191 MB)
//! stream from memory.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gatestream::quant::{axpy_row_f64, quantize_row, vec_dot_rows, vec_dot_tile, GgmlType, PreparedInput, TokenTile};
use gatestream::stream::plan::{plan, CostModel};
use std::hint::black_box;
use std::time::Duration;

/// (model, tensor, type, rows, cols) as the GGUF files store them.
const SHAPES: &[(&str, &str, GgmlType, usize, usize)] = &[
    ("smollm2", "ffn_up", GgmlType::Q4_1, 1536, 576),
    ("smollm2", "ffn_down", GgmlType::Q4_1, 576, 1536),
    ("smollm2", "output", GgmlType::Q8_0, 49152, 576),
    ("gemma", "ffn_up", GgmlType::Q5_0, 2048, 640),
    ("gemma", "ffn_down", GgmlType::Q6_K, 640, 2048),
    ("gemma", "attn_output", GgmlType::Q4_K, 640, 1024),
    ("gemma", "output", GgmlType::Q8_0, 262144, 640),
    ("qwen", "ffn_up", GgmlType::Q4_K, 8960, 1536),
    ("qwen", "ffn_down", GgmlType::Q6_K, 1536, 8960),
    ("qwen", "output", GgmlType::Q6_K, 151936, 1536),
    // The smaller types big models ship in, at Qwen's ffn_up shape (in the caches) and, for the
    // two a 2G budget streams most, its output shape (from memory).
    ("qwen", "ffn_up", GgmlType::Q2_K, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::Q3_K, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::Q5_1, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::IQ4_NL, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::IQ4_XS, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::MXFP4, 8960, 1536),
    ("qwen", "output", GgmlType::Q2_K, 151936, 1536),
    ("qwen", "output", GgmlType::IQ4_XS, 151936, 1536),
    // The grid types (IQ2_*, IQ3_*, IQ1_*), at the same shapes.
    ("qwen", "ffn_up", GgmlType::IQ2_XXS, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::IQ2_XS, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::IQ2_S, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::IQ3_XXS, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::IQ3_S, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::IQ1_S, 8960, 1536),
    ("qwen", "ffn_up", GgmlType::IQ1_M, 8960, 1536),
    ("qwen", "output", GgmlType::IQ2_XXS, 151936, 1536),
    ("qwen", "output", GgmlType::IQ3_XXS, 151936, 1536),
];

/// Where each block of the types without a quantizer here keeps its f16 scales (byte offsets),
/// or for MXFP4 its E8M0 exponent: random bytes elsewhere, a normal value there (a random f16
/// could be a subnormal or NaN, whose arithmetic runs at another speed).
fn scale_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
        GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ3_XXS
        | GgmlType::IQ3_S
        | GgmlType::IQ1_S => &[0],
        // IQ1_M's f16 scale is the top nibbles of its four u16 scales (bytes 48..56).
        GgmlType::IQ1_M => &[48, 50, 52, 54],
        GgmlType::MXFP4 => &[0],
        _ => &[],
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// `rows` random rows of `cols` values quantized to `ty` (one row quantized, then repeated with
/// a varying first block so no two rows are byte-identical; speed does not depend on values).
fn weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let row_bytes = ty.row_bytes(cols).expect("whole blocks");
    let distinct = 64.min(rows);
    let mut base = vec![0u8; row_bytes * distinct];
    for r in base.chunks_exact_mut(row_bytes) {
        let x: Vec<f32> = (0..cols).map(|_| rng.next()).collect();
        if quantize_row(ty, &x, r) {
            continue;
        }
        // No quantizer for the type: random blocks with normal scales.
        assert!(
            !scale_fields(ty).is_empty(),
            "{} neither quantizes nor has scale fields here",
            ty.name()
        );
        for b in r.iter_mut() {
            *b = (rng.next() * 127.0 + 128.0) as u8;
        }
        for block in r.chunks_exact_mut(ty.block_bytes()) {
            for &at in scale_fields(ty) {
                match ty {
                    GgmlType::MXFP4 => block[at] = 120, // 2^-7
                    GgmlType::IQ1_M => {
                        // Nibble (at - 48) / 2 of 0x2c00 (0.0625) on top of the u16 at `at`.
                        let nibble = (0x2c00u16 >> (2 * (at - 48))) & 0xf;
                        block[at + 1] = (block[at + 1] & 0x0f) | (nibble << 4) as u8;
                    }
                    _ => block[at..at + 2].copy_from_slice(&0x2c00u16.to_le_bytes()), // 0.0625
                }
            }
        }
    }
    let mut out = Vec::with_capacity(row_bytes * rows);
    while out.len() < row_bytes * rows {
        let take = (row_bytes * rows - out.len()).min(base.len());
        out.extend_from_slice(&base[..take]);
    }
    out
}

fn prepared(ty: GgmlType, cols: usize, rng: &mut Rng) -> PreparedInput {
    let x: Vec<f32> = (0..cols).map(|_| rng.next()).collect();
    let mut p = PreparedInput::new();
    p.prepare(&x, ty);
    p
}

fn configure(c: &mut Criterion) -> criterion::BenchmarkGroup<'_, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group("kernels");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    g
}

fn memory(c: &mut Criterion) {
    let words = vec![1u64; 256 << 17]; // 256 MiB
    let mut g = configure(c);
    g.throughput(Throughput::Bytes((words.len() * 8) as u64));
    g.bench_function("memory/read", |b| {
        b.iter(|| {
            // Four independent sums so the loop is bound by loads, not by one add chain.
            let mut s = [0u64; 4];
            for w in words.chunks_exact(4) {
                for k in 0..4 {
                    s[k] = s[k].wrapping_add(w[k]);
                }
            }
            black_box(s)
        })
    });
}

fn products(c: &mut Criterion) {
    let mut rng = Rng(0x5eed);
    let mut g = configure(c);
    for &(model, tensor, ty, rows, cols) in SHAPES {
        let w = weights(ty, rows, cols, &mut rng);
        g.throughput(Throughput::Bytes(w.len() as u64));
        let x = prepared(ty, cols, &mut rng);
        let mut out = vec![0f32; rows];
        g.bench_function(
            BenchmarkId::new(format!("matvec/{model}"), format!("{tensor}-{}", ty.name())),
            |b| b.iter(|| vec_dot_rows(ty, black_box(&w), &x, &mut out)),
        );
        let xs: Vec<PreparedInput> = (0..32).map(|_| prepared(ty, cols, &mut rng)).collect();
        let refs: Vec<&PreparedInput> = xs.iter().collect();
        let mut out = vec![0f32; rows * 32];
        g.bench_function(
            BenchmarkId::new(format!("matmul32/{model}"), format!("{tensor}-{}", ty.name())),
            // The tile is built per product, as the CPU backend builds it once per matrix.
            |b| b.iter(|| vec_dot_tile(ty, black_box(&w), &TokenTile::new(&refs), &mut out)),
        );
    }
}

fn sparse(c: &mut Criterion) {
    let mut rng = Rng(0xa11);
    let (neurons, hidden) = (8960, 1536);
    let ty = GgmlType::Q8_0;
    let cols = weights(ty, neurons, hidden, &mut rng);
    let row_bytes = ty.row_bytes(hidden).unwrap();
    let kept: Vec<usize> = (0..neurons).filter(|i| i % 2 == 0).collect();
    let coef: Vec<f32> = kept.iter().map(|_| rng.next()).collect();
    let mut acc = vec![0f64; hidden];
    let mut g = configure(c);
    g.throughput(Throughput::Bytes((kept.len() * row_bytes) as u64));
    g.bench_function("axpy/qwen/ffn_down_t-Q8_0-50%", |b| {
        b.iter(|| {
            for (&n, &a) in kept.iter().zip(&coef) {
                axpy_row_f64(ty, &cols[n * row_bytes..(n + 1) * row_bytes], a, &mut acc);
            }
            black_box(&acc);
        })
    });
    // The read planner: one extent per kept neuron of a neuron-major up section.
    let up_bytes = GgmlType::Q4_K.row_bytes(hidden).unwrap();
    let extents: Vec<(u64, usize)> = kept.iter().map(|&n| ((n * up_bytes) as u64, up_bytes)).collect();
    let cost = CostModel::default_for(4096);
    let mut reads = Vec::new();
    g.throughput(Throughput::Elements(extents.len() as u64));
    g.bench_function("plan/qwen/ffn_up-50%", |b| {
        b.iter(|| black_box(plan(black_box(&extents), &cost, &mut reads)))
    });
}

criterion_group!(benches, memory, products, sparse);
criterion_main!(benches);
