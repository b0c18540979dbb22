//! Checks of any device against the CPU device (the reference), shared by the GPU suites: one
//! body, several devices (`tests/gpu_wgpu.rs` runs them on the wgpu device, `tests/gpu_cuda.rs`
//! some on the CUDA device). Each returns a line saying what it compared and the worst
//! difference, or why it failed.
#![allow(dead_code)]

pub mod budget;
pub mod long;
pub mod tiny;

use std::sync::Arc;

use gatestream::backend::cpu::CpuBackend;
use gatestream::backend::ops::log_sum_exp;
use gatestream::backend::{AttnShape, Device, RopeShape};
use gatestream::config::{FfnActivation, RopeStyle};
use gatestream::kv::KvCache;
use gatestream::model::batch::Logits;
use gatestream::model::forward::{FfnHooks, LayerStream};
use gatestream::model::sampler::argmax;
use gatestream::model::{LoadOptions, Model};
use gatestream::quant::{quantize_row, GgmlType};
use gatestream::tensor::Weight;

/// A small deterministic generator (xorshift), so a failure reproduces.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub fn normalish(&mut self) -> f32 {
        (0..4).map(|_| self.unit()).sum::<f32>() - 2.0
    }
    pub fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normalish()).collect()
    }
}

/// `rows` random rows of `cols` quantized to `ty`, or for the types gatestream reads but does
/// not write (Q2_K, Q3_K, IQ4_NL, IQ4_XS) random blocks ([`random_blocks`]).
pub fn quantized(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Weight {
    let row_bytes = ty.row_bytes(cols).expect("whole blocks");
    let mut bytes = vec![0u8; rows * row_bytes];
    for r in 0..rows {
        let x = rng.values(cols);
        let row = &mut bytes[r * row_bytes..(r + 1) * row_bytes];
        if !quantize_row(ty, &x, row) {
            random_blocks(ty, row, rng);
        }
    }
    Weight::owned(&format!("test.{ty:?}"), ty, rows, cols, bytes).expect("weight")
}

/// Blocks of `ty` whose quant and scale bits are all random (every bit pattern decodes) but for
/// the f16 scales (Q2_K's d and dmin at bytes 80 and 82, Q3_K's d at 108, IQ4_NL's and IQ4_XS's
/// d at 0, as src/quant/layout.rs places them), each finite, of either sign, within ±0.05.
fn random_blocks(ty: GgmlType, row: &mut [u8], rng: &mut Rng) {
    let f16_at: &[usize] = match ty {
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
        other => panic!("{other:?}: neither quantized nor made at random here"),
    };
    row.iter_mut().for_each(|b| *b = (rng.next() >> 56) as u8);
    for block in row.chunks_exact_mut(ty.block_bytes()) {
        for &at in f16_at {
            let d = half::f16::from_f32((rng.unit() - 0.5) * 0.1);
            block[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
        }
    }
}

/// Every row of `w`, decoded.
pub fn dequantized(w: &Weight) -> Vec<Vec<f32>> {
    (0..w.rows)
        .map(|r| {
            let mut v = vec![0f32; w.cols];
            w.dequantize_row(r, &mut v);
            v
        })
        .collect()
}

/// Max |a - b|; infinite where either is NaN (which `f64::max` would skip).
pub fn max_abs_diff(a: impl Iterator<Item = f32>, b: impl Iterator<Item = f32>) -> f64 {
    a.zip(b)
        .map(|(x, y)| match (x - y).abs() as f64 {
            d if d.is_nan() => f64::INFINITY,
            d => d,
        })
        .fold(0f64, f64::max)
}

/// Max |a - b| over max |b| (lengths must agree).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-12);
    max_abs_diff(a.iter().copied(), b.iter().copied()) / scale
}

pub fn err_of(dev: &dyn Device) -> Result<(), String> {
    match dev.take_error() {
        Some(e) => Err(e.to_string()),
        None => Ok(()),
    }
}

/// Shapes the products are checked at: (rows, blocks per row) and token counts (one token, a
/// part tile, several tiles).
const PRODUCT_ROWS: [usize; 2] = [1, 67];
const PRODUCT_BLOCKS: [usize; 2] = [1, 3];
const PRODUCT_TOKENS: [usize; 3] = [1, 5, 19];

/// Every type in `types`: the product of all rows and of a row subset against the CPU device's
/// (the quantized types' activations in the CPU's 8-bit blocks), the neuron-major product (all
/// rows and a subset, added to what `out` held; f32 activations) and the embedding gather
/// against f64 sums of the decoded rows; within `tol` of the largest value.
pub fn products_per_type(dev: &dyn Device, types: &[GgmlType], tol: f64) -> Result<String, String> {
    let cpu = CpuBackend::new(1);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut lines = Vec::new();
    let mut failed = Vec::new();
    for &ty in types {
        let mut worst = 0f64;
        for rows in PRODUCT_ROWS {
            for blocks in PRODUCT_BLOCKS {
                let cols = ty.block_elems().max(32) * blocks * if ty.block_elems() == 1 { 8 } else { 1 };
                let w = quantized(ty, rows, cols, &mut rng);
                let d = dequantized(&w);
                for n in PRODUCT_TOKENS {
                    let x = rng.values(n * cols);
                    let xa = dev.upload(n, cols, x.clone());
                    // All rows, and a subset (out of order, repeated), against the CPU device,
                    // which multiplies the same 8-bit activation blocks (quantized types).
                    let xc = cpu.upload(n, cols, x.clone());
                    let got = dev.to_host(&dev.matmul(&[&w], &xa)[0]).into_owned();
                    let want = cpu.download(cpu.matmul(&[&w], &xc).remove(0));
                    worst = worst.max(rel_err(&got, &want));
                    let ids: Vec<u32> = (0..rows as u32).rev().step_by(2).chain([0]).collect();
                    let got = dev.to_host(&dev.matmul_rows(&w, &ids, &xa)).into_owned();
                    let want = cpu.download(cpu.matmul_rows(&w, &ids, &xc));
                    worst = worst.max(rel_err(&got, &want));
                    // Neuron-major: acts [n, rows] times w [rows, cols], onto a base.
                    let acts = rng.values(n * rows);
                    let base = rng.values(n * cols);
                    for subset in [
                        None,
                        Some(ids.iter().copied().filter(|&r| r != 0).collect::<Vec<u32>>()),
                    ] {
                        let aa = dev.upload(n, rows, acts.clone());
                        let mut out = dev.upload(n, cols, base.clone());
                        dev.accumulate_rows(&w, subset.as_deref(), &aa, &mut out);
                        let got = dev.to_host(&out).into_owned();
                        let all: Vec<u32> = (0..rows as u32).collect();
                        let list = subset.as_deref().unwrap_or(&all);
                        let want: Vec<f32> = (0..n)
                            .flat_map(|t| {
                                let (acts, base, d) = (&acts, &base, &d);
                                (0..cols).map(move |c| {
                                    let s: f64 = list
                                        .iter()
                                        .map(|&r| acts[t * rows + r as usize] as f64 * d[r as usize][c] as f64)
                                        .sum();
                                    (base[t * cols + c] as f64 + s) as f32
                                })
                            })
                            .collect();
                        worst = worst.max(rel_err(&got, &want));
                    }
                    // Embedding rows.
                    let tokens: Vec<u32> = (0..n as u32).map(|t| t % rows as u32).collect();
                    let got = dev.to_host(&dev.embed(&w, &tokens, 0.5)).into_owned();
                    let want: Vec<f32> = tokens
                        .iter()
                        .flat_map(|&t| d[t as usize].iter().map(|v| v * 0.5))
                        .collect();
                    worst = worst.max(rel_err(&got, &want));
                }
            }
        }
        err_of(dev).map_err(|e| format!("{ty:?}: {e}"))?;
        lines.push(format!("{}: {worst:.2e}", ty.name()));
        if worst > tol {
            failed.push(ty.name());
        }
    }
    let msg = format!(
        "  products (all rows, row subsets, neuron-major, embedding; {PRODUCT_ROWS:?} rows x {PRODUCT_BLOCKS:?} \
         blocks, {PRODUCT_TOKENS:?} tokens), worst |diff| / max against the CPU or f64 (bar {tol:.0e}): {}",
        lines.join(", ")
    );
    match failed.is_empty() {
        true => Ok(msg),
        false => Err(format!("{msg}\n  FAILED: {}", failed.join(", "))),
    }
}

/// Products over the rows of real models' FFNs, wider than `products_per_type` takes: Qwen2.5-1.5B's
/// down projection (8960 columns: 35 K blocks), each of [`WIDE_TYPES`], one token, a part tile
/// and two tiles of 8, against the CPU device; and the neuron-major product over 8960 rows
/// (all, and every other one). On lavapipe a thread's loops end after 65535 iterations: a kernel that
/// loops over a whole row of 8960 for 8 tokens in one thread stops part way, silently.
pub fn wide_products_against_cpu(dev: &dyn Device, tol: f64) -> Result<String, String> {
    let types = WIDE_TYPES.map(GgmlType::name).join(", ");
    let cpu = CpuBackend::new(1);
    let mut rng = Rng(66);
    let (wide, narrow) = (8960, 64);
    let mut worst = 0f64;
    let mut failed = Vec::new();
    for ty in WIDE_TYPES {
        let w = quantized(ty, narrow, wide, &mut rng);
        let tall = quantized(ty, wide, 256, &mut rng);
        let d = dequantized(&tall);
        for n in [1, 5, 8, 16] {
            let x = rng.values(n * wide);
            let got = dev.download(dev.matmul(&[&w], &dev.upload(n, wide, x.clone())).remove(0));
            let want = cpu.download(cpu.matmul(&[&w], &cpu.upload(n, wide, x)).remove(0));
            let e = rel_err(&got, &want);
            if e > tol {
                failed.push(format!("{} {narrow}x{wide}, {n} tokens: {e:.2e}", ty.name()));
            }
            worst = worst.max(e);
            let acts = rng.values(n * wide);
            let every_other: Vec<u32> = (0..wide as u32).step_by(2).collect();
            for subset in [None, Some(&every_other[..])] {
                let mut out = dev.zeros(n, 256);
                dev.accumulate_rows(&tall, subset, &dev.upload(n, wide, acts.clone()), &mut out);
                let got = dev.download(out);
                let all: Vec<u32> = (0..wide as u32).collect();
                let list = subset.unwrap_or(&all);
                let want: Vec<f32> = (0..n)
                    .flat_map(|t| {
                        let (acts, d) = (&acts, &d);
                        (0..256).map(move |c| {
                            list.iter()
                                .map(|&r| acts[t * wide + r as usize] as f64 * d[r as usize][c] as f64)
                                .sum::<f64>() as f32
                        })
                    })
                    .collect();
                let e = rel_err(&got, &want);
                if e > tol {
                    failed.push(format!(
                        "{} neuron-major over {} of {wide} rows, {n} tokens: {e:.2e}",
                        ty.name(),
                        list.len()
                    ));
                }
                worst = worst.max(e);
            }
        }
        err_of(dev).map_err(|e| format!("{ty:?}: {e}"))?;
    }
    let msg = format!(
        "  rows of 8960 (Qwen2.5-1.5B's FFN; {types}; 1, 5, 8 and 16 tokens) and neuron-major sums over 8960 \
         rows: worst |diff| / max against the CPU or f64 {worst:.2e} (bar {tol:.0e})"
    );
    match failed.is_empty() {
        true => Ok(msg),
        false => Err(format!("{msg}\n  FAILED: {}", failed.join("; "))),
    }
}

/// The types [`wide_products_against_cpu`] multiplies: Qwen2.5-1.5B's two, and each of the
/// other block layouts (super-blocks of 256 with 2- and 3-bit quants and IQ4_XS's sub-block
/// scales; IQ4_NL's and MXFP4's blocks of 32, MXFP4's of 17 bytes so that rows start at any byte).
const WIDE_TYPES: [GgmlType; 7] = [
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_XS,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
];

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// The elementwise operations, norms and row/column moves against the CPU device's, within
/// `tol` of the largest value.
pub fn elementwise_against_cpu(dev: &dyn Device, tol: f64) -> Result<String, String> {
    let cpu = CpuBackend::new(1);
    let mut rng = Rng(7);
    let (n, w) = (5, 300);
    let xv = rng.values(n * w);
    let yv = rng.values(n * w);
    let norm = rng.values(w);
    let bias = rng.values(w);
    let both = |f: &dyn Fn(&dyn Device) -> Vec<f32>| (f(dev), f(&cpu));
    let mut results: Vec<(&str, Vec<f32>, Vec<f32>)> = Vec::new();
    let mut add = |name: &'static str, (a, b): (Vec<f32>, Vec<f32>)| results.push((name, a, b));
    add(
        "rms_norm",
        both(&|d| {
            let x = d.upload(n, w, xv.clone());
            d.download(d.rms_norm(&x, &norm, 1e-5))
        }),
    );
    add(
        "rms_norm_in_place",
        both(&|d| {
            let mut x = d.upload(n, w, xv.clone());
            d.rms_norm_in_place(&mut x, &norm, 1e-6);
            d.download(x)
        }),
    );
    add(
        "add, mul, add_bias",
        both(&|d| {
            let mut x = d.upload(n, w, xv.clone());
            let y = d.upload(n, w, yv.clone());
            d.add(&mut x, &y);
            d.mul(&mut x, &y);
            d.add_bias(&mut x, &bias);
            d.download(x)
        }),
    );
    for f in [FfnActivation::Silu, FfnActivation::GeluTanh] {
        add(
            "activate",
            both(&|d| {
                let mut x = d.upload(n, w, xv.clone());
                d.activate(&mut x, f);
                d.download(x)
            }),
        );
        add(
            "activate_mul",
            both(&|d| {
                let mut up = d.upload(n, w, xv.clone());
                let mut gate = d.upload(n, w, yv.clone());
                d.activate_mul(&mut up, &mut gate, f);
                d.download(up)
            }),
        );
    }
    add(
        "softcap",
        both(&|d| {
            let mut x = d.upload(n, w, xv.iter().map(|v| v * 20.0).collect());
            d.softcap(&mut x, 30.0);
            d.download(x)
        }),
    );
    add(
        "select_rows",
        both(&|d| {
            let x = d.upload(n, w, xv.clone());
            d.download(d.select_rows(&x, &[4, 0, 2, 2]))
        }),
    );
    let cols: Vec<u32> = vec![7, 3, 299, 0, 150];
    add(
        "gather_cols",
        both(&|d| {
            let x = d.upload(n, w, xv.clone());
            d.download(d.gather_cols(&x, &cols))
        }),
    );
    add(
        "scatter_cols",
        both(&|d| {
            let x = d.upload(n, cols.len(), xv[..n * cols.len()].to_vec());
            d.download(d.scatter_cols(&x, &cols, w))
        }),
    );
    add(
        "copy, zeros",
        both(&|d| {
            let x = d.upload(n, w, xv.clone());
            let mut c = d.copy(&x);
            d.add(&mut c, &d.zeros(n, w));
            d.download(c)
        }),
    );
    err_of(dev)?;
    let mut worst = 0f64;
    let mut failed = Vec::new();
    for (name, got, want) in &results {
        let e = rel_err(got, want);
        worst = worst.max(e);
        if e > tol {
            failed.push(format!("{name} ({e:.2e})"));
        }
    }
    let msg = format!(
        "  elementwise ops, norms, row and column moves ({} checks): worst |diff| / max against the CPU {worst:.2e} \
         (bar {tol:.0e})",
        results.len()
    );
    match failed.is_empty() {
        true => Ok(msg),
        false => Err(format!("{msg}\n  FAILED: {}", failed.join(", "))),
    }
}

/// RoPE (both styles, with and without per-head norms, partial, with frequency factors when the
/// device applies them), then the cache writes and attention (grouped heads, a sliding window,
/// sinks when the device computes them, a batch of two sequences at different positions, a
/// context longer than a workgroup's 64 positions), against the CPU device.
pub fn rope_attention_against_cpu(dev: &dyn Device, tol: f64) -> Result<String, String> {
    let cpu = CpuBackend::new(1);
    let mut rng = Rng(11);
    let (n_heads, n_kv) = (6, 2);
    let cfg_layers = 2;
    // Two sequences: the first has 150 cached positions, the second 3; then a batch of 3 tokens
    // (two of the first sequence, one of the second).
    let prefill = [150usize, 3];
    let sinks = rng.values(n_heads);
    let mut worst = 0f64;
    let mut cases = 0;
    let mut failed = Vec::new();
    for (hd, style, partial, normed, window, use_sinks, use_factors) in [
        (64, RopeStyle::AdjacentPairs, false, false, None, false, false),
        (64, RopeStyle::HalfSplit, false, true, Some(40), false, false),
        (64, RopeStyle::HalfSplit, true, true, None, true, true),
        (64, RopeStyle::AdjacentPairs, false, true, Some(3), true, false),
        // Gemma 3's heads: 256 wide (four values a thread in the attention kernel).
        (256, RopeStyle::HalfSplit, false, true, Some(100), false, false),
    ] {
        let (qd, kvd) = (n_heads * hd, n_kv * hd);
        let q_norm = rng.values(hd);
        let k_norm = rng.values(hd);
        let factors: Vec<f32> = (0..hd / 2).map(|i| 1.0 + i as f32 / 8.0).collect();
        if (partial && !dev.rope_partial())
            || (use_sinks && !dev.attention_sinks())
            || (use_factors && !dev.rope_freq_factors())
        {
            continue;
        }
        let shape = RopeShape {
            head_dim: hd,
            rope_dims: if partial { hd / 2 } else { hd },
            base: 10000.0,
            pos_scale: 1.0,
            style,
            factors: use_factors.then_some(&factors[..]),
        };
        let run = |d: &dyn Device, rng: &mut Rng| -> Vec<f32> {
            let mut caches: Vec<KvCache> = (0..2).map(|_| kv_cache(cfg_layers, kvd, 160)).collect();
            let mut out = Vec::new();
            // Prefill each sequence alone, then the mixed batch.
            let batches: Vec<(Vec<usize>, Vec<usize>)> = vec![
                ((0..prefill[0]).collect(), vec![0; prefill[0]]),
                ((0..prefill[1]).collect(), vec![1; prefill[1]]),
                (vec![prefill[0], prefill[1], prefill[0] + 1], vec![0, 1, 0]),
            ];
            for (positions, seqs) in batches {
                let t = positions.len();
                let mut q = d.upload(t, qd, rng.values(t * qd));
                let mut k = d.upload(t, kvd, rng.values(t * kvd));
                let v = d.upload(t, kvd, rng.values(t * kvd));
                d.rope_qk(
                    &mut q,
                    &mut k,
                    &positions,
                    shape,
                    normed.then_some(&q_norm[..]),
                    normed.then_some(&k_norm[..]),
                    1e-6,
                );
                out.extend(d.to_host(&q).iter().copied());
                out.extend(d.to_host(&k).iter().copied());
                let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
                d.kv_write(1, &k, &v, &positions, &seqs, &mut refs);
                let a = d.attention(
                    &q,
                    &positions,
                    &seqs,
                    &refs,
                    AttnShape {
                        layer: 1,
                        n_heads,
                        n_kv_heads: n_kv,
                        head_dim: hd,
                        scale: 1.0 / (hd as f32).sqrt(),
                        window,
                        sinks: use_sinks.then_some(&sinks[..]),
                    },
                );
                out.extend(d.to_host(&a).iter().copied());
            }
            out
        };
        let seed = rng.next();
        let got = run(dev, &mut Rng(seed));
        let want = run(&cpu, &mut Rng(seed));
        err_of(dev)?;
        let e = rel_err(&got, &want);
        worst = worst.max(e);
        cases += 1;
        if e > tol {
            failed.push(format!(
                "head {hd} {style:?} partial={partial} norms={normed} window={window:?} sinks={use_sinks} factors={use_factors}: \
                 {e:.2e}"
            ));
        }
    }
    let msg = format!(
        "  RoPE, cache writes and attention ({cases} cases: heads of 64 and 256, both styles, norms, partial, \
         factors, windows, sinks, grouped heads, two sequences, 152 positions): worst |diff| / max against the CPU {worst:.2e} (bar {tol:.0e})"
    );
    match failed.is_empty() {
        true => Ok(msg),
        false => Err(format!("{msg}\n  FAILED: {}", failed.join("; "))),
    }
}

/// A cache of `layers` layers of `kv_dim` for `capacity` positions.
pub fn kv_cache(layers: usize, kv_dim: usize, capacity: usize) -> KvCache {
    let c = cache_of(layers, kv_dim, capacity, None);
    assert_eq!(c.bytes(), 2 * 4 * layers * capacity * kv_dim, "the test's cache shape");
    c
}

/// A latent attention cache (DeepSeek-V2/V3, Kimi-K2) of `layers` layers for `capacity`
/// positions: one key of `width` a position (the latent and its rotated part) and no values,
/// which attention reads from the keys.
pub fn latent_kv_cache(layers: usize, width: usize, capacity: usize) -> KvCache {
    // (Only that the model has latent attention shapes the cache, not its ranks.)
    let c = cache_of(layers, width, capacity, Some(crate::common::small_mla(0)));
    assert_eq!(
        c.bytes(),
        4 * layers * capacity * width,
        "the test's latent cache shape"
    );
    c
}

fn cache_of(layers: usize, kv_dim: usize, capacity: usize, mla: Option<gatestream::config::Mla>) -> KvCache {
    use std::sync::OnceLock;
    static BASE: OnceLock<gatestream::config::ModelConfig> = OnceLock::new();
    let mut cfg = BASE
        .get_or_init(|| {
            load(&crate::common::stories_dir(), Arc::new(CpuBackend::new(1)))
                .expect("stories260K (data/stories260K)")
                .config
                .clone()
        })
        .clone();
    cfg.mla = mla;
    cfg.n_layers = layers;
    cfg.n_kv_heads = 1;
    cfg.head_dim = kv_dim;
    KvCache::new(&cfg, capacity)
}

/// Each row's greedy token on the device against the host's argmax (ties to the lower id,
/// banned ids skipped, one row whose largest values are banned).
pub fn argmax_against_host(dev: &dyn Device) -> Result<String, String> {
    let mut rng = Rng(3);
    let (rows, width) = (5, 49_999);
    let mut v = rng.values(rows * width);
    // Row 1: a tie (the lower id wins); row 2: its largest value banned.
    v[width + 10] = 9.0;
    v[width + 4000] = 9.0;
    v[2 * width + 77] = 50.0;
    let banned = [77u32, 12];
    let x = dev.upload(rows, width, v.clone());
    let got = dev.argmax_rows(&x, &banned);
    err_of(dev)?;
    let want: Vec<u32> = v
        .chunks(width)
        .map(|r| {
            let mut r = r.to_vec();
            for &b in &banned {
                r[b as usize] = f32::NEG_INFINITY;
            }
            argmax(&r)
        })
        .collect();
    let msg = format!("  argmax of {rows} rows of {width} (a tie, banned ids): device {got:?}, host {want:?}");
    match got == want {
        true => Ok(msg),
        false => Err(msg),
    }
}

pub fn load(path: &std::path::Path, device: Arc<dyn Device>) -> Result<Model, String> {
    Model::load_on(path, &LoadOptions::default(), device).map_err(|e| e.to_string())
}

/// Greedy decoding on both models from the same prompt, the first model's token fed to both:
/// the steps whose argmax differs, and the worst |Δlogit| over the logits' range.
pub fn compare_greedy(cpu: &Model, dev: &Model, prompt: &[u32], steps: usize) -> Result<(usize, f64), String> {
    compare_greedy_through(cpu, dev, None, prompt, steps)
}

/// As [`compare_greedy`], the second model's passes through `stream` when given (its weights
/// read from disk or host memory as the stream plans).
pub fn compare_greedy_through(
    first: &Model,
    second: &Model,
    stream: Option<&dyn LayerStream>,
    prompt: &[u32],
    steps: usize,
) -> Result<(usize, f64), String> {
    let cap = prompt.len() + steps + 1;
    let (mut cf, mut cs) = (KvCache::new(&first.config, cap), KvCache::new(&second.config, cap));
    let hooks = FfnHooks {
        observe: None,
        mask: None,
        stream,
        cancel: None,
    };
    let last = |m: &Model, tokens: &[u32], c: &mut KvCache, h: &FfnHooks| {
        m.forward_with(tokens, c, Logits::Last, h).map_err(|e| e.to_string())
    };
    let none = FfnHooks::dense();
    let (mut lf, mut ls) = (
        last(first, prompt, &mut cf, &none)?,
        last(second, prompt, &mut cs, &hooks)?,
    );
    let (mut mismatches, mut worst) = (0, 0f64);
    for _ in 0..steps {
        let (min, max) = lf.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        let d = max_abs_diff(lf.iter().copied(), ls.iter().copied());
        worst = worst.max(d / (max - min) as f64);
        let (tf, ts) = (argmax(&lf), argmax(&ls));
        if tf != ts {
            mismatches += 1;
        }
        let t = [tf];
        lf = last(first, &t, &mut cf, &none)?;
        ls = last(second, &t, &mut cs, &hooks)?;
    }
    Ok((mismatches, worst))
}

/// A model file on the CPU and on `dev`: greedy steps from `prompt` (steps whose argmax differs,
/// worst |Δlogit| of the range) and perplexity over `windows` windows of `ctx` tokens of `text`
/// (cpu, device). Passes when no step's token differs and the perplexities are within 0.1% of
/// each other (the bar), and, given `dlogit_bar`, the worst |Δlogit| is within it (of
/// the logits' range). Without it the worst |Δlogit| is reported, not judged: on a quantized
/// model one activation rounded to the other side of an 8-bit step moves logits by more than
/// the f32 sums do (SmolLM2 on lavapipe: 3.5% of the range at worst over 16 steps, tokens
/// equal); a model of F32 matrices has no such step, and there the logits themselves judge.
#[allow(clippy::too_many_arguments)]
pub fn model_against_cpu(
    name: &str,
    path: &std::path::Path,
    dev: Arc<dyn Device>,
    prompt: &str,
    steps: usize,
    text: &str,
    (ctx, windows): (usize, usize),
    dlogit_bar: Option<f64>,
) -> Result<String, String> {
    let cpu = load(path, Arc::new(CpuBackend::new(0)))?;
    let on_dev = load(path, dev)?;
    let tokens = cpu.tokenizer.encode(prompt, true).map_err(|e| e.to_string())?;
    let (mismatches, worst) = compare_greedy(&cpu, &on_dev, &tokens, steps)?;
    let opts = gatestream::perplexity::PerplexityOptions { ctx, windows };
    let pc = gatestream::perplexity::perplexity(&cpu, text, &opts, &mut |_, _, _| {}).map_err(|e| e.to_string())?;
    let pd = gatestream::perplexity::perplexity(&on_dev, text, &opts, &mut |_, _, _| {}).map_err(|e| e.to_string())?;
    let rel = (pd.perplexity / pc.perplexity - 1.0).abs();
    let msg = format!(
        "  {name}: greedy argmax differs at {mismatches}/{steps} steps; max |dlogit| = {:.5}% of the range{}; \
         perplexity ({windows} windows of {ctx}) cpu {:.4} device {:.4} (diff {:.4}%)",
        worst * 100.0,
        dlogit_bar.map_or(String::new(), |b| format!(" (bar {:.3}%)", b * 100.0)),
        pc.perplexity,
        pd.perplexity,
        rel * 100.0
    );
    match mismatches == 0 && rel <= 0.001 && dlogit_bar.is_none_or(|b| worst <= b) {
        true => Ok(msg),
        false => Err(msg),
    }
}

/// `w` decoded to F32 (the same values, exactly).
fn f32_matrix(w: &Weight) -> Weight {
    let mut bytes = Vec::with_capacity(w.rows * w.cols * 4);
    let mut row = vec![0f32; w.cols];
    for r in 0..w.rows {
        w.dequantize_row(r, &mut row);
        bytes.extend(row.iter().flat_map(|v| v.to_le_bytes()));
    }
    Weight::owned(&w.name, GgmlType::F32, w.rows, w.cols, bytes).expect("an F32 matrix")
}

/// Every product's matrix of a dense model (attention, FFN, output; the embedding's rows are
/// decoded on the host by every device) replaced by `f32s` in order, made on first use.
fn with_f32_matrices(m: &mut Model, f32s: &mut Vec<Weight>) {
    use gatestream::model::weights::{FfnDown, LayerFfn};
    let mut i = 0;
    let mut swap = |w: &mut Weight| {
        if f32s.len() <= i {
            f32s.push(f32_matrix(w));
        }
        *w = f32s[i].clone();
        i += 1;
    };
    for l in m.weights.layers.iter_mut() {
        for w in [&mut l.attn.wq, &mut l.attn.wk, &mut l.attn.wv, &mut l.attn.wo] {
            swap(w);
        }
        if let LayerFfn::Dense(f) = &mut l.ffn {
            swap(&mut f.gate);
            swap(&mut f.up);
            if let FfnDown::Rows(d) = &mut f.down {
                swap(d);
            }
        }
    }
    swap(&mut m.weights.output);
}

/// As [`model_against_cpu`], with the model's matrices decoded to F32 on both devices: the
/// products then multiply the f32 activations themselves, not the CPU's 8-bit blocks, so what
/// separates the two is the device's arithmetic alone (no activation rounded to another 8-bit
/// step, which moves a quantized model's logits by a few percent of their range). Passes when
/// no step's token differs and the perplexities are within `bar` (relative) of each other.
#[allow(clippy::too_many_arguments)]
pub fn model_f32_against_cpu(
    name: &str,
    path: &std::path::Path,
    dev: Arc<dyn Device>,
    prompt: &str,
    steps: usize,
    text: &str,
    (ctx, windows): (usize, usize),
    bar: f64,
) -> Result<String, String> {
    let mut cpu = load(path, Arc::new(CpuBackend::new(0)))?;
    let mut on_dev = load(path, dev)?;
    let mut f32s = Vec::new();
    with_f32_matrices(&mut cpu, &mut f32s);
    with_f32_matrices(&mut on_dev, &mut f32s);
    drop(f32s);
    let tokens = cpu.tokenizer.encode(prompt, true).map_err(|e| e.to_string())?;
    let (mismatches, worst) = compare_greedy(&cpu, &on_dev, &tokens, steps)?;
    let opts = gatestream::perplexity::PerplexityOptions { ctx, windows };
    let pc = gatestream::perplexity::perplexity(&cpu, text, &opts, &mut |_, _, _| {}).map_err(|e| e.to_string())?;
    let pd = gatestream::perplexity::perplexity(&on_dev, text, &opts, &mut |_, _, _| {}).map_err(|e| e.to_string())?;
    let rel = (pd.perplexity / pc.perplexity - 1.0).abs();
    let msg = format!(
        "  {name}, matrices decoded to F32: greedy argmax differs at {mismatches}/{steps} steps; max |dlogit| = \
         {:.5}% of the range; perplexity ({windows} windows of {ctx}) cpu {:.6} device {:.6} (diff {:.5}%, bar {:.3}%)",
        worst * 100.0,
        pc.perplexity,
        pd.perplexity,
        rel * 100.0,
        bar * 100.0
    );
    match mismatches == 0 && rel <= bar {
        true => Ok(msg),
        false => Err(msg),
    }
}

/// Mean negative log-likelihood of the second half of `tokens` (one pass).
pub fn nll(m: &Model, tokens: &[u32]) -> Result<f64, String> {
    let mut c = KvCache::new(&m.config, tokens.len());
    let half = tokens.len() / 2;
    let logits = m
        .forward(tokens, &mut c, Logits::From(half - 1))
        .map_err(|e| e.to_string())?;
    let v = m.config.vocab;
    let mut sum = 0f64;
    for (i, row) in logits.chunks(v).enumerate().take(tokens.len() - half) {
        sum += log_sum_exp(row) - row[tokens[half + i] as usize] as f64;
    }
    Ok(sum / (tokens.len() - half) as f64)
}
