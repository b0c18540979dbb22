//! THE GPU SUITE (`cargo test --release --features cuda --test gpu_cuda`): the CUDA device
//! against the CPU device, on a machine with an NVIDIA GPU. Not a CPU test: without a GPU it
//! says so and runs nothing, and nothing counts as passed (it has its own `main`, so no test
//! is reported as "ok" there).
//!
//! Checks: every weight type's product, row subset, embedding gather and neuron-major product
//! against an f64 reference (Q4_K and Q6_K also in batches of 2-8 tokens as integers, bit-identical
//! to each token alone, and as integer tiles on the tensor cores); a prompt's attention in tiles
//! of tokens against a block per token and the CPU; greedy tokens and top-k candidates found on the device against the
//! host's; stories260K (real weights) and a synthetic model shaped like
//! Qwen2.5-1.5B (random weights in Q4_K_M's types, made here) — the same greedy tokens over 32
//! steps, max |Δlogit| ≤ 1% of the logits' range at every step, perplexity within 0.1% on the
//! same windows (and again with the GPU given the CPU's 8-bit activations,
//! `GATESTREAM_CUDA_ACTIVATIONS=q8`); the same bar for mixture-of-experts models of each architecture (stories260K
//! upcycled into experts, F32); then decode tok/s of the Qwen-shaped model on the GPU beside the bound its
//! memory bandwidth sets (measured in the same run) and beside the CPU; and the same model as a
//! `.gst` streamed from disk under a RAM budget of 40% of the file onto the GPU (every neuron
//! active: the in-device model's logits), with decode tok/s beside the in-device model's; and
//! held in host RAM under a GPU budget of 40% of the file (`--vram-budget`): the same equality,
//! decode tok/s dense and with 50% masks, copies per token against the link measured here.
//! Tiny random-weight models of the architectures whose attention needs more than whole-head
//! RoPE and a plain softmax (`arch_*`: Llama 3.1's RoPE frequency factors, glm4moe's partial
//! RoPE, gpt-oss's sinks, qwen3's per-head QK-norm, deepseek2's latent attention, alone and with
//! V3's routing) meet the same bar.
//! `GATESTREAM_GPU_REPORT=FILE` writes the figures as JSON. Arguments pick checks by name
//! (`gpu_cuda kernels stories260k`). The stories260K checks of the streamed paths and a small
//! model built like the Qwen-shaped one (`small_qwen2_*`: 8 layers, hidden 256) are small enough
//! for the host emulation of the driver (`tests/cuda_emu`), which CI runs some of them on: there
//! the suite says so, and its figures are the kernels' values, never a GPU's speed.

mod common;
// (The bodies the wgpu suite shares; this suite runs some of them.)
mod device_checks;

use std::sync::Arc;
use std::time::Instant;

use gatestream::backend::cpu::CpuBackend;
use gatestream::backend::cuda::{Activations, CudaDevice, CudaOptions, CUDA_TYPES, INT8_TYPES, MAP_HOST_ENV};
use gatestream::backend::ops::log_sum_exp;
use gatestream::backend::{Device, HostLink, LinkCounters};
use gatestream::config::Arch;
use gatestream::kv::KvCache;
use gatestream::model::batch::{Logits, Want};
use gatestream::model::forward::{FfnHooks, FfnMask, LayerStream};
use gatestream::model::sampler::argmax;
use gatestream::model::weights::FfnDown;
use gatestream::model::{LoadOptions, Model};
use gatestream::quant::{quantize_row, GgmlType, PreparedInput};
use gatestream::tensor::Weight;

type Check = fn(&Arc<CudaDevice>, &mut serde_json::Map<String, serde_json::Value>) -> Result<String, String>;

fn main() {
    let dev = match CudaOptions::from_vars(&|name| std::env::var(name).ok()).and_then(|o| CudaDevice::open(0, &o)) {
        Ok(d) => Arc::new(d),
        Err(e) => {
            println!("gpu_cuda: NO GPU SUITE RUN — no CUDA device here ({e}). 0 GPU checks ran; none passed.");
            // The lib's kernel compile check (NVRTC, no GPU needed) passes without running when
            // no NVRTC is found and GATESTREAM_NVRTC is unset: said here, where output is seen.
            if let Ok(o) = CudaOptions::from_vars(&|name| std::env::var(name).ok()) {
                if let Err(e) = gatestream::backend::cuda::nvrtc::Nvrtc::load_from(o.nvrtc, &o.cuda_homes) {
                    println!("gpu_cuda: the NVRTC kernel compile check (lib tests) did NOT RUN either: {e}");
                }
            }
            return;
        }
    };
    println!("gpu_cuda: {}", dev.name());
    // The driver may be tests/cuda_emu's host emulation (CI): the checks then show what the
    // kernels and the device's host code compute, nothing about a GPU.
    let emulated = emulated(&dev);
    let checks: [(&str, Check); 53] = [
        ("kernels_per_type", kernels_per_type),
        ("int8_batches", int8_batches),
        ("attention_tiles", attention_tiles),
        ("attention_split", attention_split),
        ("attention_sinks", attention_sinks),
        ("attention_latent", attention_latent),
        ("kernels_rope_attention", kernels_rope_attention),
        ("i8_geometry", i8_geometry),
        ("fused_q8_blocks", fused_q8_blocks),
        ("fused_last_blocks", fused_last_blocks),
        ("argmax_rows", argmax_rows),
        ("top_k_rows", top_k_rows),
        ("stories260k_cuda_vs_cpu", stories260k),
        ("stories260k_graphs", |d, r| {
            graphs_replay(d, r, &common::stories_dir(), "stories260k_graphs", 0)
        }),
        ("stories260k_graph_split", |d, r| {
            graphs_replay(d, r, &common::stories_dir(), "stories260k_graph_split", 16)
        }),
        // The streamed checks below on stories260K as a `.gst` (F32): small enough for the host
        // emulation of the driver (tests/cuda_emu), where they check the streamed paths' host
        // code and kernels.
        ("stories260k_streamed_to_cuda", |d, r| {
            let gst = stories_gst_path()?;
            streamed_to_cuda(d, r, "stories260k_streamed", "stories260K", &gst, Budget::AboveMinimum)
        }),
        // A split file's dense steps take their FFN rows as views of the prefetch buffers (a
        // bundled file's are gathered into the staging): both must equal the in-device model.
        ("stories260k_streamed_to_cuda_split", |d, r| {
            let gguf = stories_gst_path()?.with_file_name("stories.gguf");
            split_streamed_to_cuda(d, r, &gguf, "stories260k", "stories260K", Budget::AboveMinimum)
        }),
        ("stories260k_vram_budget", |d, r| {
            let gst = stories_gst_path()?;
            vram_budget(
                d,
                r,
                "stories260k_vram_budget",
                "stories260K",
                &gst,
                Budget::AboveMinimum,
            )
        }),
        // The same on the small Qwen2-built model as a `.gst` (Q4_K and Q6_K rows: the
        // integer products on the streamed and staged paths, Q, K and V streamed in one launch).
        ("small_qwen2_streamed_to_cuda", |d, r| {
            let gst = small_qwen_gst_path()?;
            streamed_to_cuda(d, r, "small_qwen2_streamed", "small Qwen2", &gst, Budget::Minimum)
        }),
        ("small_qwen2_streamed_to_cuda_split", |d, r| {
            split_streamed_to_cuda(d, r, &small_qwen_path(), "small_qwen2", "small Qwen2", Budget::Minimum)
        }),
        ("small_qwen2_vram_budget", |d, r| {
            let gst = small_qwen_gst_path()?;
            vram_budget(
                d,
                r,
                "small_qwen2_vram_budget",
                "small Qwen2",
                &gst,
                Budget::AboveMinimum,
            )
        }),
        ("stories260k_auto_vram_budget", auto_vram_budget),
        ("moe_llama_cuda_vs_cpu", |d, r| moe(d, r, Arch::Llama)),
        ("moe_qwen2moe_cuda_vs_cpu", |d, r| moe(d, r, Arch::Qwen2Moe)),
        ("moe_qwen3moe_cuda_vs_cpu", |d, r| moe(d, r, Arch::Qwen3Moe)),
        ("moe_olmoe_cuda_vs_cpu", |d, r| moe(d, r, Arch::Olmoe)),
        // The hybrid executor on a mixture of experts with a shared expert: routed experts on the
        // CPU, the rest on the GPU, against the model in device memory.
        ("moe_qwen2moe_hybrid", |d, r| moe_hybrid(d, r, Arch::Qwen2Moe)),
        // The Qwen-shaped comparisons below on [`SMALL_QWEN`] (8 layers; its figures are not the
        // Qwen-shaped model's, but its products are the same kernels on the same block types).
        ("small_qwen2_cuda_vs_cpu", |d, r| {
            shaped_compare(d, r, &SMALL_QWEN, Against::Same, "small_qwen2")
        }),
        ("small_qwen2_cuda_q8_activations_vs_cpu", |d, r| {
            shaped_compare(d, r, &SMALL_QWEN, Against::Q8Activations, "small_qwen2_q8_activations")
        }),
        ("small_qwen2_cuda_int8_vs_cpu", |d, r| {
            shaped_compare(d, r, &SMALL_QWEN, Against::Int8, "small_qwen2_int8")
        }),
        ("small_qwen2_cuda_vs_cpu_f32_weights", |d, r| {
            shaped_compare(d, r, &SMALL_QWEN, Against::F32Weights, "small_qwen2_cpu_f32_reference")
        }),
        ("small_qwen2_graphs", |d, r| {
            graphs_replay(d, r, &small_qwen_path(), "small_qwen2_graphs", 0)
        }),
        ("small_qwen2_graph_split", |d, r| {
            graphs_replay(d, r, &small_qwen_path(), "small_qwen2_graph_split", 24)
        }),
        ("small_qwen2_fused", |d, r| {
            fused_same(d, r, &small_qwen_path(), "small_qwen2_fused")
        }),
        ("qwen_shaped_cuda_vs_cpu", qwen_shaped),
        ("qwen_shaped_cuda_q8_activations_vs_cpu", qwen_shaped_q8),
        ("qwen_shaped_cuda_int8_vs_cpu", |d, r| {
            shaped_compare(d, r, &QWEN, Against::Int8, "qwen_shaped_int8")
        }),
        ("qwen_shaped_cuda_vs_cpu_f32_weights", qwen_shaped_f32),
        ("qwen_shaped_decode_speed", qwen_speed),
        ("qwen_shaped_graphs", |d, r| {
            graphs_replay(d, r, &qwen_model_path(), "qwen_shaped_graphs", 0)
        }),
        ("qwen_shaped_graph_split", |d, r| {
            graphs_replay(d, r, &qwen_model_path(), "qwen_shaped_graph_split", 48)
        }),
        ("qwen_shaped_fused", |d, r| {
            fused_same(d, r, &qwen_model_path(), "qwen_shaped_fused")
        }),
        ("qwen_shaped_streamed_to_cuda", qwen_streamed),
        ("qwen_shaped_streamed_to_cuda_split", |d, r| {
            split_streamed_to_cuda(
                d,
                r,
                &qwen_model_path(),
                "qwen_shaped",
                "qwen-shaped",
                Budget::OfFile(40),
            )
        }),
        ("qwen_shaped_vram_budget", qwen_vram),
        ("qwen_shaped_vram_budget_70", qwen_vram_hot),
        ("arch_llama31_cuda_vs_cpu", |d, r| arch_model(d, r, Arch::Llama)),
        ("arch_glm4moe_cuda_vs_cpu", |d, r| arch_model(d, r, Arch::Glm4Moe)),
        ("arch_gpt_oss_cuda_vs_cpu", |d, r| arch_model(d, r, Arch::GptOss)),
        ("arch_qwen3_cuda_vs_cpu", |d, r| arch_model(d, r, Arch::Qwen3)),
        ("arch_deepseek2_cuda_vs_cpu", |d, r| arch_deepseek2(d, r, false)),
        ("arch_deepseek2_v3_cuda_vs_cpu", |d, r| arch_deepseek2(d, r, true)),
        // Last: it leaves (and takes back) an error on the device.
        ("cpu_only_types_refused", cpu_only_types_refused),
    ];
    // Arguments (not flags): run the checks whose names contain one of them.
    let only: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let mut report = serde_json::Map::new();
    report.insert("device".into(), dev.name().into());
    report.insert("emulated".into(), emulated.into());
    // A name that selects nothing is a mistake (a check renamed or removed), not a pass.
    if let Some(o) = only
        .iter()
        .find(|o| !checks.iter().any(|(name, _)| name.contains(o.as_str())))
    {
        println!("gpu_cuda: no check's name contains {o:?}: nothing ran for it");
        std::process::exit(2);
    }
    let (mut passed, mut failed) = (0, 0);
    for (name, check) in checks {
        if !only.is_empty() && !only.iter().any(|o| name.contains(o.as_str())) {
            continue;
        }
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&dev, &mut report)));
        let secs = t.elapsed().as_secs_f64();
        match r {
            Ok(Ok(msg)) => {
                passed += 1;
                println!("gpu_cuda: {name} ... ok ({secs:.1} s)\n{msg}");
            }
            Ok(Err(msg)) => {
                failed += 1;
                println!("gpu_cuda: {name} ... FAILED ({secs:.1} s)\n{msg}");
            }
            Err(_) => {
                failed += 1;
                println!("gpu_cuda: {name} ... PANICKED ({secs:.1} s)");
            }
        }
    }
    if emulated {
        println!(
            "gpu_cuda: {passed} passed, {failed} failed ON THE HOST EMULATION OF THE DRIVER (tests/cuda_emu): the kernels \
             and the device's host code compute these values; no GPU ran, and no speed above is a GPU's"
        );
    } else {
        println!("gpu_cuda: {passed} passed, {failed} failed");
    }
    if let Ok(path) = std::env::var("GATESTREAM_GPU_REPORT") {
        let _ = std::fs::write(path, serde_json::to_string_pretty(&report).unwrap());
    }
    if failed > 0 {
        std::process::exit(1);
    }
}

/// xorshift64*: the same draws everywhere.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normalish(&mut self) -> f32 {
        (0..4).map(|_| self.unit()).sum::<f32>() - 2.0
    }
}

/// The architectures whose attention needs more than whole-head RoPE and a plain softmax: a tiny
/// random-weight model of each (`make-model`'s code, a synthetic vocabulary) on both devices,
/// against the same bar as stories260K, fused launches on (RoPE in `rope_norm_kv`, and with
/// graphs a decode step's in the integer products' last blocks, `matvec_i8x3_rope_kv`).
/// `llama31`: Llama 3.1's RoPE frequency factors (Q4_K_M); `glm4moe`: GLM-4.5's partial RoPE (8
/// of each head's 16 dimensions), routed and shared experts (F32, as the MoE checks' experts:
/// Q8_0's products, in f32 on the GPU and in 8-bit on the CPU, move its sigmoid router's near
/// ties); `gpt_oss`: attention sinks, YaRN's frequency factors, sliding-window layers, biases
/// and MXFP4 experts; `qwen3`: per-head QK-norm before RoPE (Q4_K_M). One check an architecture
/// (`arch_` selects these four and [`arch_deepseek2`]'s two).
fn arch_model(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    arch: Arch,
) -> Result<String, String> {
    use gatestream::synth::{write_model, MakeSpec, Mix, OutputFormat, RoutingShape, Shape, TokenizerChoice};
    let (shape, mix, dequantize, what) = match arch {
        Arch::Llama => (
            Shape {
                vocab: 300,
                context_len: 512,
                rope_theta: 500_000.0,
                // Llama 3.1's: factor 8, low and high frequency factors 1 and 4, context 8192.
                rope_factors: Some([8.0, 1.0, 4.0, 8192.0]),
                ..Shape::custom(Arch::Llama, 256, 512, 2, 4, 2, 64)
            },
            Mix::Q4KM,
            false,
            "llama with Llama 3.1's RoPE frequency factors, Q4_K_M",
        ),
        Arch::Glm4Moe => (
            Shape {
                vocab: 300,
                context_len: 512,
                rope_theta: 10000.0,
                rms_eps: 1e-5,
                experts: Some((4, 2)),
                rope_dim: Some(8),
                routing: Some(RoutingShape::glm(128)),
                ..Shape::custom(Arch::Glm4Moe, 64, 64, 2, 4, 2, 16)
            },
            Mix::Q8_0,
            true,
            "glm4moe, partial RoPE (8 of 16), 4 experts (2 used) and a shared one, F32",
        ),
        Arch::GptOss => (
            Shape {
                vocab: 320,
                context_len: 512,
                experts: Some((6, 3)),
                ..Shape::custom(Arch::GptOss, 64, 64, 2, 4, 2, 32)
            },
            Mix::Mxfp4Moe,
            false,
            "gpt-oss, sinks, YaRN, a sliding window, biases, 6 MXFP4 experts (3 used)",
        ),
        Arch::Qwen3 => (
            Shape {
                vocab: 300,
                context_len: 512,
                ..Shape::custom(Arch::Qwen3, 256, 512, 2, 4, 2, 64)
            },
            Mix::Q4KM,
            false,
            "qwen3, per-head QK-norm, Q4_K_M",
        ),
        _ => return Err(format!("no tiny model of {} here", arch.name())),
    };
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = tmp.path().join(format!("{}.gguf", arch.name()));
    let spec = MakeSpec {
        shape,
        mix,
        dequantize,
        tokenizer: TokenizerChoice::Synthetic,
        seed: 3,
        residual_gain: 1.0,
    };
    write_model(&spec, &path, &OutputFormat::Gguf, true, &mut |_, _| {}).map_err(|e| e.to_string())?;
    tiny_against_cpu(dev, report, &format!("arch_{}", arch.name()), what, &path)
}

/// deepseek2 (`arch_deepseek2`): multi-head latent attention, its cache one latent of 160 a
/// position (128 and a rotated part of 32) with no values, attention reading them from the keys
/// (a prompt's in tiles, decode's split over positions); with `moe` (`arch_deepseek2_v3`), V3's
/// routing (sigmoid scores with a bias, grouped top-k, a shared expert, a leading dense layer).
/// The wgpu suite's models (`device_checks::tiny::synth_deepseek2`: F32), against the same bar
/// as the others.
fn arch_deepseek2(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    moe: bool,
) -> Result<String, String> {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = device_checks::tiny::synth_deepseek2(tmp.path(), moe)?;
    let (key, what) = match moe {
        false => (
            "arch_deepseek2",
            "deepseek2, latent attention (a latent of 160 a position), F32",
        ),
        true => (
            "arch_deepseek2_v3",
            "deepseek2, latent attention, V3's grouped sigmoid routing, 8 experts (2 used) and a shared one, F32",
        ),
    };
    tiny_against_cpu(dev, report, key, what, &path)
}

/// The tiny model at `path` on both devices, fused launches on (see [`arch_model`]): the
/// figures under `key` in the report, the line saying `what` it is.
fn tiny_against_cpu(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    key: &str,
    what: &str,
    path: &std::path::Path,
) -> Result<String, String> {
    // Fused launches on, whatever the default: RoPE then runs in the kernels that write the KV
    // cache too (`rope_norm_kv`; with graphs, the integer products' `*_rope_kv`).
    let was = dev.fuse();
    dev.set_fuse(true);
    let r = cpu_vs_cuda(path, dev, &wiki_text(20_000)?);
    dev.set_fuse(was);
    let (mismatches, worst, pc, pg) = r?;
    let rel = (pg / pc - 1.0).abs();
    let msg = format!(
        "  {what}: greedy argmax differs at {mismatches}/32 steps; max |dlogit| = {:.4}% of the range; \
         perplexity ({windows} windows of 256) cpu {pc:.4} cuda {pg:.4} (diff {:.4}%)",
        worst * 100.0,
        rel * 100.0,
        windows = ppl_windows(dev),
    );
    report.insert(
        key.to_string(),
        serde_json::json!({"mismatched_steps": mismatches, "max_dlogit_of_range": worst, "ppl_cpu": pc, "ppl_cuda": pg}),
    );
    judged(mismatches, worst, rel, msg)
}

/// A model holding a type the device has no kernels for (the small Qwen2-built model with its
/// layer-0 `ffn_up` as IQ2_XXS, a grid type; rows of 256, which the grid types' blocks need) is
/// refused at load, naming the tensor and its type; a weight of each such type handed to a
/// product directly fails the operation with the same words (no launch of a missing kernel).
fn cpu_only_types_refused(
    dev: &Arc<CudaDevice>,
    _report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = tmp.path().join("iq2_xxs-up.gguf");
    let src = small_qwen_path();
    let name = "blk.0.ffn_up.weight";
    let g = gatestream::gguf::GgufFile::open(&src).map_err(|e| e.to_string())?;
    let up = g
        .tensors
        .iter()
        .find(|t| t.name == name)
        .ok_or("the small Qwen2 model has no ffn_up")?;
    let (ty, dims) = (GgmlType::IQ2_XXS, up.dims.clone());
    let bytes = vec![0u8; ty.row_bytes(dims[0] as usize).unwrap() * dims[1] as usize];
    let edited = common::gguf_edited(&src, Vec::new(), vec![(name.to_string(), dims, ty.ggml_id(), bytes)]);
    std::fs::write(&path, edited).map_err(|e| e.to_string())?;
    let device: Arc<dyn Device> = dev.clone();
    let m = match Model::load_on(&path, &LoadOptions::default(), device) {
        Ok(_) => return Err("a model with an IQ2_XXS tensor loaded on the CUDA device".into()),
        Err(e) => e.to_string(),
    };
    if !(m.contains(name) && m.contains("IQ2_XXS is computed on the CPU only") && m.contains("--device cpu")) {
        return Err(format!(
            "the refusal does not name the tensor, its type and the way out: {m}"
        ));
    }
    let mut refused = Vec::new();
    for ty in GgmlType::ALL.into_iter().filter(|ty| !CUDA_TYPES.contains(ty)) {
        let cols = 256;
        let bytes = vec![0u8; 2 * ty.row_bytes(cols).unwrap()];
        let w = Weight::owned(&format!("test.{ty:?}"), ty, 2, cols, bytes).unwrap();
        let x = dev.upload(1, cols, vec![0.5; cols]);
        drop(dev.matmul(&[&w], &x));
        let e = dev
            .take_error()
            .ok_or_else(|| format!("{ty:?}: a product ran on the device"))?
            .to_string();
        let want = format!("{}: {} is computed on the CPU only", w.name, ty.name());
        if !e.contains(&want) {
            return Err(format!("{ty:?}: {e}"));
        }
        refused.push(ty.name());
    }
    Ok(format!(
        "refused at load: {m}\nrefused in products: {}",
        refused.join(", ")
    ))
}

/// `rows` random rows of `ty`: normal-ish values quantized, or for the types gatestream reads
/// but does not write (Q2_K, Q3_K, IQ4_NL, IQ4_XS), random blocks ([`random_blocks`]).
fn quantized(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Weight {
    let row_bytes = ty.row_bytes(cols).unwrap();
    let mut bytes = vec![0u8; rows * row_bytes];
    for r in 0..rows {
        let x: Vec<f32> = (0..cols).map(|_| rng.normalish()).collect();
        let row = &mut bytes[r * row_bytes..(r + 1) * row_bytes];
        if !quantize_row(ty, &x, row) {
            random_blocks(ty, row, rng);
        }
    }
    Weight::owned(&format!("test.{ty:?}"), ty, rows, cols, bytes).unwrap()
}

/// Blocks of `ty` with every quant and scale bit random (each bit pattern decodes), and each f16
/// scale (Q2_K's d and dmin at 80 and 82, Q3_K's d at 108, IQ4_NL's and IQ4_XS's d at 0; the
/// GGUF layouts of src/quant/layout.rs) a finite value of either sign within ±0.05.
fn random_blocks(ty: GgmlType, row: &mut [u8], rng: &mut Rng) {
    let f16_at: &[usize] = match ty {
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
        other => panic!("{other:?}: no random blocks made here"),
    };
    for b in row.iter_mut() {
        *b = (rng.next() >> 56) as u8;
    }
    for block in row.chunks_exact_mut(ty.block_bytes()) {
        for &at in f16_at {
            let d = half::f16::from_f32((rng.unit() - 0.5) * 0.1);
            block[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
        }
    }
}

fn dequantized(w: &Weight) -> Vec<Vec<f32>> {
    (0..w.rows)
        .map(|r| {
            let mut v = vec![0f32; w.cols];
            w.dequantize_row(r, &mut v);
            v
        })
        .collect()
}

/// How many of `a`'s values differ from `b`'s in their bits.
fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count()
}

/// Max |a - b| over max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-12);
    max_abs_diff(a.iter().copied(), b.iter().copied()) / scale
}

/// Max |a - b|; infinite where either is NaN (which `f64::max` would skip).
fn max_abs_diff(a: impl Iterator<Item = f32>, b: impl Iterator<Item = f32>) -> f64 {
    a.zip(b)
        .map(|(x, y)| match (x - y).abs() as f64 {
            d if d.is_nan() => f64::INFINITY,
            d => d,
        })
        .fold(0f64, f64::max)
}

/// Every product kernel against f64 (see `kernels_of_each_type`), the device's activation mode
/// restored after (the checks that follow run in it).
fn kernels_per_type(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let (was, mma) = (dev.activations(), dev.mma());
    // The FMA loops first, against f64 at 1e-4; then the tensor-core products of batches.
    dev.set_mma(false);
    let r = kernels_of_each_type(dev, report);
    dev.set_mma(true);
    let mmq = dev.mmq();
    dev.set_mmq(false);
    let r = r.and_then(|msg| Ok(format!("{msg}\n{}", mma_products(dev, report)?)));
    dev.set_mmq(true);
    let r = r.and_then(|msg| Ok(format!("{msg}\n{}", mmq_products(dev, report)?)));
    dev.set_activations(was);
    dev.set_mma(mma);
    dev.set_mmq(mmq);
    r
}

/// Batches of Q4_K and Q6_K rows wider than the integer products take, as integer tiles on the
/// tensor cores (`mmq_*`, kernels/mma.cu), against f64 on the 8-bit activations the CPU sees
/// (the Q8_K blocks): every super-block's integer sums exact, so within 1e-6 of each token's
/// largest value. 130 rows (tiles of 64 and a part tile), 9, 13 and 70 tokens (a part tile of
/// tokens; one a million times larger, one a million times smaller), row subsets crossing tiles,
/// three weights asked at once with a bias; rows of 5 super-blocks in two parts, a 70 x 2048
/// matrix in four (see `mmq_cfg`). With the integer tiles off the same batch takes the f16
/// pairs (`mma_*`): shown by results that differ.
fn mmq_products(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    dev.set_activations(Activations::Auto);
    let tokens = dev.int8_tokens();
    dev.set_int8_tokens(8).map_err(|e| e.to_string())?;
    let r = mmq_products_in(dev, report);
    dev.set_int8_tokens(tokens).map_err(|e| e.to_string())?;
    r
}

fn mmq_products_in(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let mut rng = Rng(29);
    let mut lines = Vec::new();
    let mut worst = 0f64;
    for ty in INT8_TYPES {
        let mut max = 0f64;
        for (rows, cols, widths) in [(130usize, 1280usize, &[9usize, 13, 70][..]), (70, 2048, &[13][..])] {
            let ws: Vec<Weight> = [rows, 7, 19]
                .iter()
                .map(|&r| quantized(ty, r, cols, &mut rng))
                .collect();
            let refs: Vec<&Weight> = ws.iter().collect();
            let deq: Vec<Vec<Vec<f64>>> = ws
                .iter()
                .map(|w| {
                    dequantized(w)
                        .iter()
                        .map(|r| r.iter().map(|&v| v as f64).collect())
                        .collect()
                })
                .collect();
            let bias: Vec<f32> = (0..rows).map(|_| rng.normalish()).collect();
            let subset: Vec<u32> = vec![rows as u32 - 1, 3, 64, 0, 50, 63, 65];
            for &n in widths {
                let mut x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
                if n == 70 {
                    x[5 * cols..6 * cols].iter_mut().for_each(|v| *v *= 1e6);
                    x[6 * cols..7 * cols].iter_mut().for_each(|v| *v *= 1e-6);
                }
                let xa = dev.upload(n, cols, x.clone());
                let three: Vec<Vec<f32>> = dev
                    .matmul_bias(&refs, &[Some(&bias[..]), None, None], &xa)
                    .into_iter()
                    .map(|a| dev.download(a))
                    .collect();
                let part = dev.download(dev.matmul_rows(&ws[0], &subset, &xa));
                dev.set_mmq(false);
                let pairs = dev.download(dev.matmul(&[&ws[0]], &xa).remove(0));
                dev.set_mmq(true);
                let plain = dev.download(dev.matmul(&[&ws[0]], &xa).remove(0));
                if pairs == plain {
                    return Err(format!(
                        "{ty:?}, {n} tokens: the integer tiles gave what the f16 pairs give"
                    ));
                }
                // The tiles that load each super-block where they unpack it (`mmq_plain_*`) against
                // those that load the next one ahead (the default): the same bits, and the row
                // subset's too.
                let was = dev.mmq_prefetch();
                dev.set_mmq_prefetch(!was);
                let other = dev.download(dev.matmul(&[&ws[0]], &xa).remove(0));
                let other_part = dev.download(dev.matmul_rows(&ws[0], &subset, &xa));
                dev.set_mmq_prefetch(was);
                if other != plain || other_part != part {
                    return Err(format!(
                        "{ty:?}, {n} tokens: the integer tiles loading ahead and not differ"
                    ));
                }
                for t in 0..n {
                    let mut p = PreparedInput::new();
                    p.prepare(&x[t * cols..(t + 1) * cols], ty);
                    let seen: Vec<f64> = p.dequantized().iter().map(|&v| v as f64).collect();
                    for (i, w) in ws.iter().enumerate() {
                        let sums: Vec<f64> = deq[i]
                            .iter()
                            .map(|row| row.iter().zip(&seen).map(|(a, b)| a * b).sum::<f64>())
                            .collect();
                        let want: Vec<f32> = sums
                            .iter()
                            .enumerate()
                            .map(|(r, v)| (v + if i == 0 { bias[r] as f64 } else { 0.0 }) as f32)
                            .collect();
                        max = max.max(rel_err(&three[i][t * w.rows..(t + 1) * w.rows], &want));
                        if i == 0 {
                            let unbiased: Vec<f32> = sums.iter().map(|&v| v as f32).collect();
                            let want_part: Vec<f32> = subset.iter().map(|&r| unbiased[r as usize]).collect();
                            max = max
                                .max(rel_err(&plain[t * rows..(t + 1) * rows], &unbiased))
                                .max(rel_err(&part[t * subset.len()..(t + 1) * subset.len()], &want_part));
                        }
                    }
                }
            }
        }
        let line = format!(
            "  {ty:?} as integer tiles: max relative error {max:.2e} against f64 on its 8-bit activations (n=9/13/70, rows, three weights, split in parts); loading ahead and not bit-identical"
        );
        type_verdict(dev, &mut lines, &mut worst, max, 1e-6, line)?;
    }
    report.insert("mmq_products_max_rel_err".into(), worst.into());
    Ok(lines.join("\n"))
}

/// The tensor-core products of several tokens (`mma_*`, kernels/mma.cu) for every block type,
/// against f64: each value split into two f16 (hi + lo), they must be as close as f32 products
/// (1e-5 of each token's largest value; one f16 each would be ~1e-3). One token a million times
/// larger than f16 holds (scaled down by a power of two), one a million times smaller (scaled
/// up). 130 rows (tiles of 64 and a part tile), 2, 13 and 70 tokens (a part tile of tokens), an
/// odd number of units (blocks of 32), row subsets crossing tiles; rows of 1280/1312 values in
/// two parts, and a 70 x 2048 matrix in four (see `mma_cfg`).
fn mma_products(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    dev.set_activations(Activations::F32);
    let mut rng = Rng(11);
    let mut lines = Vec::new();
    let mut worst = 0f64;
    for ty in CUDA_TYPES.into_iter().filter(|t| t.block_elems() > 1) {
        let mut max = 0f64;
        let narrow = if ty.block_elems() == 256 { 1280 } else { 1312 };
        for (rows, cols, widths) in [(130, narrow, &[2usize, 13, 70][..]), (70, 2048, &[13][..])] {
            let w = quantized(ty, rows, cols, &mut rng);
            let deq: Vec<Vec<f64>> = dequantized(&w)
                .iter()
                .map(|r| r.iter().map(|&v| v as f64).collect())
                .collect();
            let subset: Vec<u32> = vec![rows as u32 - 1, 3, 64, 0, 50, 63, 65];
            for &n in widths {
                let mut x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
                if n == 70 {
                    x[5 * cols..6 * cols].iter_mut().for_each(|v| *v *= 1e6);
                    x[6 * cols..7 * cols].iter_mut().for_each(|v| *v *= 1e-6);
                }
                let xa = dev.upload(n, cols, x.clone());
                let full = dev.download(dev.matmul(&[&w], &xa).remove(0));
                let part = dev.download(dev.matmul_rows(&w, &subset, &xa));
                for t in 0..n {
                    let xt = &x[t * cols..(t + 1) * cols];
                    let want: Vec<f32> = deq
                        .iter()
                        .map(|row| row.iter().zip(xt).map(|(a, &b)| a * b as f64).sum::<f64>() as f32)
                        .collect();
                    let want_part: Vec<f32> = subset.iter().map(|&r| want[r as usize]).collect();
                    max = max
                        .max(rel_err(&full[t * rows..(t + 1) * rows], &want))
                        .max(rel_err(&part[t * subset.len()..(t + 1) * subset.len()], &want_part));
                }
            }
        }
        let line = format!(
            "  {ty:?} on the tensor cores: max relative error {max:.2e} against f64 (n=2/13/70, rows, split in parts)"
        );
        type_verdict(dev, &mut lines, &mut worst, max, 1e-5, line)?;
    }
    report.insert("mma_products_max_rel_err".into(), worst.into());
    Ok(lines.join("\n"))
}

/// One weight type's checks ended: the device's error if it has one, else its line added to
/// `lines` and `max` (its worst relative error, into `worst`) held to `bar`.
fn type_verdict(
    dev: &CudaDevice,
    lines: &mut Vec<String>,
    worst: &mut f64,
    max: f64,
    bar: f64,
    line: String,
) -> Result<(), String> {
    if let Some(e) = dev.take_error() {
        return Err(format!("{}: {e}", line.trim()));
    }
    *worst = worst.max(max);
    lines.push(line);
    if max > bar {
        return Err(format!("{}\nerror {max:.2e} > {bar:.0e}", lines.join("\n")));
    }
    Ok(())
}

/// Attention over tiles of a prompt's tokens (`attention_tiles`: 16 tokens a block, a running
/// softmax) against a block per token and head (`attention`) and the CPU, within 1e-5 of each
/// output row's largest value, in one batch of three sequences: a prompt's second piece (37 tokens
/// after 40 cached: tiles of 16, 16 and 5), a decode token after 50, a fresh 21-token prompt;
/// heads of 8 to 256 values, grouped-query ratios 1 to 2, sliding windows of 5 and 20.
fn attention_tiles(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    // (sequence, position) of the cached tokens, then of the batch's.
    let hist: Vec<(usize, usize)> = (0..40).map(|p| (0, p)).chain((0..50).map(|p| (1, p))).collect();
    let batch: Vec<(usize, usize)> = (40..77)
        .map(|p| (0, p))
        .chain([(1, 50)])
        .chain((0..21).map(|p| (2, p)))
        .collect();
    let shapes = [
        (4usize, 2usize, 64usize, None),
        (2, 1, 128, Some(20)),
        (3, 3, 80, None),
        (2, 2, 256, None),
        (8, 4, 8, Some(5)),
    ];
    let (vs_blocks, vs_cpu) = attention_against_blocks(dev, &hist, &batch, 96, &shapes, (true, false, false), "tiles")?;
    report.insert("attention_tiles_max_rel_err".into(), vs_blocks.max(vs_cpu).into());
    let msg = format!(
        "  attention in tiles of 16 tokens: max relative error {vs_blocks:.2e} against a block per token, \
         {vs_cpu:.2e} against the CPU (three sequences in one batch, heads of 8/64/80/128/256, windows 5 and 20)"
    );
    if vs_blocks > 1e-5 || vs_cpu > 1e-5 {
        return Err(format!("{msg}: over 1e-5"));
    }
    Ok(msg)
}

/// Decode attention split over positions (`attention_split`, then `attention_merge` where a head
/// has several splits) against a block per token and head (`attention`) and the CPU, within 1e-5
/// of each output row's largest value: one batch of decode tokens after 700, 130, 63 and 0 cached
/// positions and a run of 5 tokens after 200 (the tiles off), so that splits run full, part full
/// and empty; heads of 8 to 512 values, 1 to 16 splits of 64 to 512 positions (several of a
/// block's 128-position score chunks), grouped-query ratios 1 to 4, windows of 100 and 300.
fn attention_split(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let hist: Vec<(usize, usize)> = [(0, 700), (1, 130), (2, 63), (4, 200)]
        .iter()
        .flat_map(|&(s, n)| (0..n).map(move |p| (s, p)))
        .collect();
    let batch: Vec<(usize, usize)> = [(0, 700), (1, 130), (2, 63), (3, 0)]
        .into_iter()
        .chain((200..205).map(|p| (4, p)))
        .collect();
    // (heads, key heads, head size, window): 8, 2, 4, 16 and 1 splits of 9 tokens' heads.
    let shapes = [
        (2usize, 1usize, 128usize, None),
        (8, 2, 64, None),
        (4, 4, 80, Some(100)),
        (1, 1, 512, None),
        (32, 8, 8, Some(300)),
    ];
    let (vs_blocks, vs_cpu) =
        attention_against_blocks(dev, &hist, &batch, 1024, &shapes, (false, true, false), "splits")?;
    report.insert("attention_split_max_rel_err".into(), vs_blocks.max(vs_cpu).into());
    let msg = format!(
        "  decode attention split over positions: max relative error {vs_blocks:.2e} against a block per token, \
         {vs_cpu:.2e} against the CPU (nine tokens of five sequences, 0 to 700 cached, heads of 8 to 512, \
         1 to 16 splits, windows 100 and 300); fused, its output's Q8_K blocks (heads of 8, 64, 128 and 512) \
         the same input to an integer product as its values"
    );
    if vs_blocks > 1e-5 || vs_cpu > 1e-5 {
        return Err(format!("{msg}: over 1e-5"));
    }
    Ok(msg)
}

/// Attention with sinks (gpt-oss: one logit a query head in each softmax, no value) on every
/// path: in tiles of a prompt's tokens (the batch of [`attention_tiles`]) and split over positions
/// (the decode batch of [`attention_split`]: one split and several, merged by the last split or
/// by `attention_merge`, and the fused output's Q8_K blocks), each against a block per token and
/// head and the CPU, within 1e-5 of each output row's largest value.
fn attention_sinks(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let hist: Vec<(usize, usize)> = (0..40).map(|p| (0, p)).chain((0..50).map(|p| (1, p))).collect();
    let batch: Vec<(usize, usize)> = (40..77).map(|p| (0, p)).chain([(1, 50)]).collect();
    let shapes = [
        (4usize, 2usize, 64usize, None),
        (8, 4, 8, Some(5)),
        (2, 2, 256, Some(20)),
    ];
    let tiles = attention_against_blocks(dev, &hist, &batch, 96, &shapes, (true, false, true), "tiles")?;
    let hist: Vec<(usize, usize)> = [(0, 700), (1, 130), (2, 63)]
        .iter()
        .flat_map(|&(s, n)| (0..n).map(move |p| (s, p)))
        .collect();
    let batch = [(0, 700), (1, 130), (2, 63), (3, 0)];
    let shapes = [
        (8usize, 2usize, 64usize, None),
        (2, 1, 128, Some(300)),
        (32, 8, 8, Some(100)),
    ];
    let split = attention_against_blocks(dev, &hist, &batch, 1024, &shapes, (false, true, true), "splits")?;
    let worst = [tiles.0, tiles.1, split.0, split.1].into_iter().fold(0f64, f64::max);
    report.insert("attention_sinks_max_rel_err".into(), worst.into());
    let msg = format!(
        "  attention with sinks: in tiles, max relative error {:.2e} against a block per token, {:.2e} against \
         the CPU (38 tokens of two sequences, heads of 8/64/256, windows 5 and 20); split over positions, \
         {:.2e} and {:.2e} (decode after 700, 130, 63 and 0, 1 to 16 splits, merged by the last split and by \
         attention_merge, Q8_K blocks of the output; windows 100 and 300)",
        tiles.0, tiles.1, split.0, split.1
    );
    if worst > 1e-5 {
        return Err(format!("{msg}: over 1e-5"));
    }
    Ok(msg)
}

/// Latent attention (deepseek2: a cache of keys alone, each value its key) against the CPU: the
/// body the wgpu suite runs (`device_checks::long::latent_attention_against_cpu`: the first 16
/// positions written with RoPE, the rest by `kv_write`, each given other values the cache must
/// not take; the last position's query, then a run of 16), over 1100 positions with DeepSeek's
/// heads of 576 and over 300 with the small models' 160 — split over positions (one token: 16
/// splits, merged by the last of them; the run: one split a head at 576, tiles at 160), merged by
/// `attention_merge` with RoPE and the cache write in launches apart, and a block per token and
/// head; within 1e-5.
fn attention_latent(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let paths = [
        (
            "splits merged by the last split, RoPE writing the cache",
            true,
            true,
            true,
        ),
        (
            "splits merged by attention_merge, RoPE and the cache write apart",
            true,
            true,
            false,
        ),
        ("a block per token and head", true, false, true),
    ];
    let lines = on_attention_paths(dev, &paths, &|| {
        let a = device_checks::long::latent_attention_against_cpu(dev.as_ref(), 1100, 576, 1e-5)?;
        let b = device_checks::long::latent_attention_against_cpu(dev.as_ref(), 300, 160, 1e-5)?;
        Ok(format!("{a}\n{b}"))
    })?;
    report.insert("attention_latent".into(), true.into());
    Ok(lines)
}

/// RoPE (frequency factors, partial, both styles, per-head norms), cache writes and attention
/// (sinks, windows, grouped heads, two sequences) against the CPU device: the body the wgpu suite
/// runs (`device_checks::rope_attention_against_cpu`), once with a prompt's attention in tiles
/// and decode's split over positions (its splits merged by the last of them), once with both off
/// (a block per token and head), and once split and merged by `attention_merge`.
fn kernels_rope_attention(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let paths = [
        ("tiles and splits merged by the last split", true, true, true),
        ("a block per token and head", false, false, true),
        ("splits merged by attention_merge", false, true, false),
    ];
    let lines = on_attention_paths(dev, &paths, &|| {
        device_checks::rope_attention_against_cpu(dev.as_ref(), 1e-5)
    })?;
    report.insert("kernels_rope_attention".into(), true.into());
    Ok(lines)
}

/// `check` under each of `paths` (what it is; attention in tiles, split over positions, fused
/// launches: the device's switches), its lines under `[what]`, until one fails. The switches
/// are restored.
fn on_attention_paths(
    dev: &CudaDevice,
    paths: &[(&str, bool, bool, bool)],
    check: &dyn Fn() -> Result<String, String>,
) -> Result<String, String> {
    let was = (dev.attn_tiles(), dev.attn_split(), dev.fuse());
    let mut lines = Vec::new();
    let mut outcome = Ok(());
    for &(what, tiles, split, fuse) in paths {
        dev.set_attn_tiles(tiles);
        dev.set_attn_split(split);
        dev.set_fuse(fuse);
        match check() {
            Ok(m) => lines.push(format!("  [{what}]\n{m}")),
            Err(m) => {
                outcome = Err(format!("  [{what}]\n{m}"));
                break;
            }
        }
    }
    dev.set_attn_tiles(was.0);
    dev.set_attn_split(was.1);
    dev.set_fuse(was.2);
    outcome.map(|()| lines.join("\n"))
}

/// Attention of `batch` (sequence, position) tokens over caches of `capacity` positions holding
/// `hist`, on random keys, values and queries (and a random sink a query head with `with_sinks`),
/// for each (heads, key heads, head size, window) of `shapes`: with `(tiles, split)` on against
/// both off (a block per token and head) and against
/// the CPU; with `split`, fused launches on and off (the last split of a head merging, or
/// `attention_merge`) must agree to the bit, and some head must have been merged by its last
/// split. Returns the worst relative error of each comparison; an error where the two device
/// paths agree to the bit (`what` not run?) or the device failed. The switches are restored.
fn attention_against_blocks(
    dev: &Arc<CudaDevice>,
    hist: &[(usize, usize)],
    batch: &[(usize, usize)],
    capacity: usize,
    shapes: &[(usize, usize, usize, Option<usize>)],
    (tiles, split, with_sinks): (bool, bool, bool),
    what: &str,
) -> Result<(f64, f64), String> {
    use gatestream::backend::AttnShape;
    let base = load(&common::stories_dir(), Arc::new(CpuBackend::new(0)))?
        .config
        .clone();
    let cpu = CpuBackend::new(0);
    let sequences = batch.iter().chain(hist).map(|t| t.0 + 1).max().unwrap_or(0);
    // (Fused launches on, whatever the default: the split's merge by its last block is checked
    // against the merge in a launch of its own.)
    let was = (dev.attn_tiles(), dev.attn_split(), dev.fuse());
    dev.set_fuse(true);
    let mut rng = Rng(31);
    let (mut worst_blocks, mut worst_cpu) = (0f64, 0f64);
    let mut outcome = Ok(());
    let mut fused_any = false;
    for &(n_heads, n_kv_heads, head_dim, window) in shapes {
        let mut cfg = base.clone();
        cfg.n_layers = 1;
        cfg.n_heads = n_heads;
        cfg.n_kv_heads = n_kv_heads;
        cfg.head_dim = head_dim;
        let kvd = n_kv_heads * head_dim;
        let mut draw = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normalish()).collect() };
        let (hk, hv) = (draw(hist.len() * kvd), draw(hist.len() * kvd));
        let (bk, bv) = (draw(batch.len() * kvd), draw(batch.len() * kvd));
        let q = draw(batch.len() * n_heads * head_dim);
        // (about as large as the scores: the sink takes a share of each softmax, not all of it;
        // drawn only when asked for, so the other checks' inputs stay the same)
        let sinks = if with_sinks { draw(n_heads) } else { Vec::new() };
        let shape = AttnShape {
            layer: 0,
            n_heads,
            n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window,
            sinks: with_sinks.then_some(&sinks[..]),
        };
        // The attention of `batch` on `d`, given to `f` while its caches live.
        let run_with = |d: &dyn Device, f: &mut dyn FnMut(gatestream::backend::Act)| {
            let mut caches: Vec<KvCache> = (0..sequences).map(|_| KvCache::new(&cfg, capacity)).collect();
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            for (toks, k, v) in [(hist, &hk, &hv), (batch, &bk, &bv)] {
                let pos: Vec<usize> = toks.iter().map(|t| t.1).collect();
                let seq: Vec<usize> = toks.iter().map(|t| t.0).collect();
                let (ka, va) = (
                    d.upload(toks.len(), kvd, k.clone()),
                    d.upload(toks.len(), kvd, v.clone()),
                );
                d.kv_write(0, &ka, &va, &pos, &seq, &mut refs);
            }
            let pos: Vec<usize> = batch.iter().map(|t| t.1).collect();
            let seq: Vec<usize> = batch.iter().map(|t| t.0).collect();
            let qa = d.upload(batch.len(), n_heads * head_dim, q.clone());
            f(d.attention(&qa, &pos, &seq, &refs, shape))
        };
        let run = |d: &dyn Device| -> Vec<f32> {
            let mut out = Vec::new();
            run_with(d, &mut |a| out = d.download(a));
            out
        };
        dev.set_attn_tiles(tiles);
        dev.set_attn_split(split);
        let fused_before = dev.last_block_fusions();
        let tried = run(dev.as_ref());
        if split {
            // The last split of each head merging (fused launches) against `attention_merge`
            // launched after the splits: the same bits.
            fused_any |= dev.last_block_fusions() > fused_before;
            dev.set_fuse(false);
            let other = run(dev.as_ref());
            dev.set_fuse(true);
            if other != tried {
                outcome = Err(format!(
                    "attention, heads of {head_dim}: split attention merged by its last split differs from attention_merge's"
                ));
                break;
            }
            if let Err(e) = attention_q8_blocks(dev, n_heads, head_dim, &|f| run_with(dev.as_ref(), f)) {
                outcome = Err(e);
                break;
            }
        }
        dev.set_attn_tiles(false);
        dev.set_attn_split(false);
        let blocks = run(dev.as_ref());
        let on_cpu = run(&cpu);
        if let Some(e) = dev.take_error() {
            outcome = Err(format!("attention, heads of {head_dim}: {e}"));
            break;
        }
        let width = n_heads * head_dim;
        for t in 0..batch.len() {
            let row = |v: &[f32]| v[t * width..(t + 1) * width].to_vec();
            worst_blocks = worst_blocks.max(rel_err(&row(&tried), &row(&blocks)));
            worst_cpu = worst_cpu.max(rel_err(&row(&tried), &row(&on_cpu)));
        }
        if tried == blocks {
            outcome = Err(format!(
                "attention, heads of {head_dim}: the {what} gave a block per token's sums to the bit (not run?)"
            ));
            break;
        }
    }
    dev.set_attn_tiles(was.0);
    dev.set_attn_split(was.1);
    dev.set_fuse(was.2);
    if outcome.is_ok() && split && !fused_any {
        outcome = Err("split attention: no head's splits were merged by the last of them (fused launches)".into());
    }
    outcome.map(|()| (worst_blocks, worst_cpu))
}

/// One-token integer products of the Qwen2.5-1.5B shapes in Q4_K_M's types (Q, K and V in one
/// launch, the attention output, gate and up in one launch, the down rows as Q6_K and as Q4_K, the
/// output matrix) with each warps per row (`GATESTREAM_CUDA_I8_WPR`: by the row, then 1, 2, 4 and
/// 8): every choice within 1e-5 of the default's outputs, the default's own choice its bits and
/// any other not (it ran); and each product's time in a graph of many, its weights cycling
/// through copies larger than the L2 cache (as a decode step's are never in it), as weight bytes
/// a second beside the device's copy bandwidth. On the emulated driver: 2048 output rows, one copy,
/// and no time that means anything.
fn i8_geometry(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let was = (dev.activations(), dev.graphs(), dev.fuse(), dev.graph_split());
    dev.set_activations(Activations::Auto);
    dev.set_graphs(true);
    dev.set_fuse(true);
    // (A graph of the whole recording: nothing launches before the timed download.)
    dev.set_graph_split(0).map_err(|e| e.to_string())?;
    let r = i8_geometry_in(dev, report);
    dev.set_activations(was.0);
    dev.set_graphs(was.1);
    dev.set_fuse(was.2);
    dev.set_graph_split(was.3).map_err(|e| e.to_string())?;
    dev.set_i8_wpr(0).map_err(|e| e.to_string())?;
    r
}

fn i8_geometry_in(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    use GgmlType::{Q4_K, Q6_K};
    const H: usize = 1536;
    const F: usize = 8960;
    let emu = emulated(dev);
    let vocab = if emu { 2048 } else { 151_936 };
    // Weights cycled through: at least 256 MB of copies (an H100's or H200's L2 is 50 MB).
    const SPAN: usize = 256 << 20;
    // (name, the weights of one launch as (type, rows), input width)
    type Product = (&'static str, Vec<(GgmlType, usize)>, usize);
    let shapes: [Product; 6] = [
        ("q/k/v", vec![(Q4_K, H), (Q4_K, 256), (Q6_K, 256)], H),
        ("attention output", vec![(Q4_K, H)], H),
        ("gate/up", vec![(Q4_K, F), (Q4_K, F)], H),
        ("down (Q6_K)", vec![(Q6_K, H)], F),
        ("down (Q4_K)", vec![(Q4_K, H)], F),
        ("output", vec![(Q6_K, vocab)], H),
    ];
    // Rows quantized once and repeated (the values do not change the time).
    let tiled = |ty: GgmlType, rows: usize, cols: usize, seed: u64| -> Weight {
        let pattern = quantized(ty, 16, cols, &mut Rng(seed));
        let (bytes, row_bytes) = (pattern.span().expect("in memory").0, ty.row_bytes(cols).unwrap());
        let mut all = Vec::with_capacity(rows * row_bytes);
        for r in 0..rows {
            all.extend_from_slice(&bytes[(r % 16) * row_bytes..(r % 16 + 1) * row_bytes]);
        }
        Weight::owned(&format!("geometry.{ty:?}"), ty, rows, cols, all).unwrap()
    };
    let bw = dev.copy_bandwidth(1 << 30).map_err(|e| e.to_string())?;
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    let mut json = Vec::new();
    for (si, (name, ws, cols)) in shapes.iter().enumerate() {
        let bytes: usize = ws.iter().map(|&(ty, rows)| rows * ty.row_bytes(*cols).unwrap()).sum();
        let copies = if emu { 1 } else { SPAN.div_ceil(bytes).clamp(2, 256) };
        let first: Vec<Weight> = ws
            .iter()
            .enumerate()
            .map(|(i, &(ty, rows))| tiled(ty, rows, *cols, 100 + 10 * si as u64 + i as u64))
            .collect();
        let set: Vec<Vec<Weight>> = (0..copies)
            .map(|_| {
                first
                    .iter()
                    .map(|w| Weight::owned(&w.name, w.ty, w.rows, w.cols, w.span().unwrap().0.to_vec()).unwrap())
                    .collect()
            })
            .collect();
        // The input as a norm's output, with its Q8_K blocks (after an integer product has run).
        let mut rng = Rng(7 + si as u64);
        let values: Vec<f32> = (0..*cols).map(|_| rng.normalish()).collect();
        drop(
            dev.download(
                dev.matmul(
                    &[&set[0][0]],
                    &dev.rms_norm(&dev.upload(1, *cols, values.clone()), &vec![1.0; *cols], 1e-6),
                )
                .remove(0),
            ),
        );
        let x = dev.rms_norm(&dev.upload(1, *cols, values), &vec![1.0; *cols], 1e-6);
        if !dev.has_input_blocks(&x) {
            failures.push(format!("{name}: the input has no Q8_K blocks"));
        }
        // Seconds a product (the best round of several: the first launched one by one, the next
        // captured, then graphs), and the first copy's outputs.
        let reps = if emu { 1 } else { copies.max(64) };
        let rounds = if emu { 2 } else { 6 };
        let run = |wpr: usize| -> Result<(f64, Vec<Vec<f32>>), String> {
            dev.set_i8_wpr(wpr).map_err(|e| e.to_string())?;
            let mut best = f64::INFINITY;
            let mut outs = Vec::new();
            for round in 0..rounds {
                let mut last = Vec::new();
                for i in 0..reps {
                    let ws: Vec<&Weight> = set[i % copies].iter().collect();
                    last = dev.matmul(&ws, &x);
                    if i == 0 && round == 0 {
                        outs = last.drain(..).map(|a| dev.download(a)).collect();
                        last = dev.matmul(&ws, &x);
                    }
                }
                let t = Instant::now();
                let got: Vec<Vec<f32>> = last.into_iter().map(|a| dev.download(a)).collect();
                let secs = t.elapsed().as_secs_f64() / reps as f64;
                if round > 0 {
                    best = best.min(secs);
                }
                drop(got);
            }
            if let Some(e) = dev.take_error() {
                return Err(format!("{name}, {wpr} warps a row: {e}"));
            }
            Ok((best, outs))
        };
        let (t_auto, base) = run(0)?;
        let auto = dev.i8_wpr(*cols);
        let mut timed = vec![(0usize, t_auto)];
        for wpr in [1usize, 2, 4, 8] {
            let (t, outs) = run(wpr)?;
            timed.push((wpr, t));
            let same = outs.iter().zip(&base).all(|(a, b)| bits_differ(a, b) == 0);
            let worst = outs.iter().zip(&base).map(|(a, b)| rel_err(a, b)).fold(0f64, f64::max);
            if wpr == auto && !same {
                failures.push(format!(
                    "{name}: {wpr} warps a row (the default's choice) differs from the default"
                ));
            }
            if wpr != auto && same {
                failures.push(format!(
                    "{name}: {wpr} warps a row gave the default's ({auto}) bits (not run?)"
                ));
            }
            if worst > 1e-5 {
                failures.push(format!(
                    "{name}: {wpr} warps a row {worst:.1e} from the default's outputs"
                ));
            }
        }
        let types: Vec<String> = ws.iter().map(|(ty, rows)| format!("{ty:?} {rows}")).collect();
        lines.push(format!(
            "    {name} ({} × {cols}; {:.1} MB, {copies} copies): {}",
            types.join(" + "),
            bytes as f64 / 1e6,
            timed
                .iter()
                .map(|&(w, t)| format!(
                    "{} {:.1} us {:.0} GB/s",
                    if w == 0 {
                        format!("auto ({auto})")
                    } else {
                        w.to_string()
                    },
                    t * 1e6,
                    bytes as f64 / t / 1e9
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        json.push(serde_json::json!({"product": name, "bytes": bytes, "copies": copies, "auto_wpr": auto,
            "seconds_by_wpr": timed.iter().map(|&(w, t)| serde_json::json!({"wpr": w, "seconds": t, "bytes_per_s": bytes as f64 / t})).collect::<Vec<_>>()}));
    }
    report.insert(
        "i8_geometry".into(),
        serde_json::json!({"copy_bandwidth_bytes_s": bw, "products": json, "failures": failures}),
    );
    let msg =
        format!(
        "  i8 geometry: one-token integer products by warps per row (each within 1e-5 of the default's, the default's \
         choice its bits); time a product in a graph, weights cycling through copies past the L2 cache; device copy \
         bandwidth {:.0} GB/s (read + write){}\n{}",
        bw / 1e9,
        if emu { "; EMULATED: no time here means anything" } else { "" },
        lines.join("\n")
    );
    if failures.is_empty() {
        Ok(msg)
    } else {
        Err(format!("{msg}\n  FAILED: {}", failures.join("; ")))
    }
}

/// What takes a device's output while what it was computed from lives.
type ActSink<'a> = dyn FnMut(gatestream::backend::Act) + 'a;

/// Split attention's output (run by `run`, fused launches and 8-bit activations on) carries
/// its Q8_K blocks where its `n_heads` heads of `head_dim` fill whole blocks
/// (`attention_q8_groups`), and not otherwise; a Q4_K product of it (its blocks the input) equals
/// the product of its values uploaded afresh, bit for bit. The device's modes restored after.
fn attention_q8_blocks(
    dev: &Arc<CudaDevice>,
    n_heads: usize,
    head_dim: usize,
    run: &dyn Fn(&mut ActSink),
) -> Result<(), String> {
    let width = n_heads * head_dim;
    let (was_a, was_f) = (dev.activations(), dev.fuse());
    dev.set_activations(Activations::Auto);
    dev.set_fuse(true);
    let want_blocks = gatestream::backend::cuda::attention_q8_groups(n_heads, head_dim).is_some();
    let w = width
        .is_multiple_of(256)
        .then(|| quantized(GgmlType::Q4_K, 37, width, &mut Rng(41)));
    // (An integer product first: blocks are made ahead only once one has run.)
    if let Some(w) = &w {
        drop(dev.download(dev.matmul(&[w], &dev.upload(1, width, vec![0.5; width])).remove(0)));
    }
    let mut outcome = Ok(());
    run(&mut |out| {
        if dev.has_input_blocks(&out) != want_blocks {
            outcome = Err(format!(
                "split attention, {n_heads} heads of {head_dim}: output blocks {}",
                if want_blocks { "missing" } else { "made" }
            ));
            return;
        }
        if let Some(w) = &w {
            let fresh = dev.upload(out.rows, width, dev.to_host(&out).into_owned());
            let got = dev.download(dev.matmul(&[w], &out).remove(0));
            let want = dev.download(dev.matmul(&[w], &fresh).remove(0));
            let differ = bits_differ(&got, &want);
            if differ > 0 {
                outcome = Err(format!(
                    "split attention, {n_heads} heads of {head_dim}: a Q4_K product of its output blocks differs \
                     from the product of its values in {differ} of {} outputs",
                    want.len()
                ));
            }
        }
    });
    dev.set_activations(was_a);
    dev.set_fuse(was_f);
    if let Some(e) = dev.take_error() {
        return Err(format!("split attention's blocks: {e}"));
    }
    outcome
}

/// The device's greedy tokens (`Device::argmax_rows`) against the host's
/// (`sampler::argmax_banned`) on rows made to catch a reduction's mistakes — ties (the first
/// wins, within and across threads and warps), -0 and +0, NaN first and anywhere, infinities,
/// every value -inf or NaN — with banned ids (none, the largest, id 0 with one past the row,
/// a run of ten), widths from 1 to a vocabulary; then greedy generation on stories260K (the
/// stop token banned, prompt lookup on and off): the CPU's tokens, 4 bytes a row back.
fn argmax_rows(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    use gatestream::model::sampler::argmax_banned;
    let mut rng = Rng(0x5DEE_CE66_D1CE_4E5B);
    let (mut rows_checked, mut failures) = (0usize, Vec::new());
    for width in [1usize, 31, 32, 33, 1000, 1025, 4096, 151_936] {
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for kind in 0..10u64 {
            let row: Vec<f32> = (0..width)
                .map(|i| {
                    let r = rng.next();
                    match (kind, r % 61) {
                        (1, _) => (r % 4) as f32,
                        (2, 0) => f32::NAN,
                        (3, 0) => f32::INFINITY,
                        (4, _) => f32::NEG_INFINITY,
                        (5, _) => f32::NAN,
                        (6, _) if i == 0 => f32::NAN,
                        (7, _) => [0.0, -0.0][(r >> 7) as usize % 2],
                        (8, _) => i as f32,
                        (9, _) => -((r % 3) as f32),
                        _ => rng.normalish(),
                    }
                })
                .collect();
            rows.push(row);
        }
        let values: Vec<f32> = rows.concat();
        let x = dev.upload(rows.len(), width, values);
        let top = argmax(&rows[0]);
        let run: Vec<u32> = (0..10).map(|i| (i * 7 % width.max(1)) as u32).collect();
        for banned in [vec![], vec![top], vec![0, width as u32], run] {
            let got = dev.argmax_rows(&x, &banned);
            let want: Vec<u32> = rows.iter().map(|r| argmax_banned(r, &banned)).collect();
            rows_checked += rows.len();
            if got != want {
                failures.push(format!("width {width}, banned {banned:?}: cuda {got:?}, host {want:?}"));
            }
        }
    }
    if let Some(e) = dev.take_error() {
        return Err(e.to_string());
    }
    // Greedy generation through `Want::Greedy` on both devices.
    let (cpu, gpu, ids) = stories_on_both(dev)?;
    let mut generations = Vec::new();
    for lookup in [0, 3] {
        let opts = gatestream::model::generate::GenerateOptions {
            ignore_eos: true,
            lookup,
            ..common::greedy(24)
        };
        let gen = |m: &Model| m.generate_ids(&ids, &opts, None, None, None, &mut |_| {});
        let want = gen(&cpu).map_err(|e| e.to_string())?;
        let before = dev.link().unwrap_or_default().to_host_bytes;
        let got = gen(&gpu).map_err(|e| e.to_string())?;
        let back = dev.link().unwrap_or_default().to_host_bytes - before;
        let rows = 1 + got
            .speculative
            .as_ref()
            .map_or(got.decode_tokens, |s| s.passes + s.drafted);
        let drafted = got.speculative.as_ref().map_or(0, |s| s.drafted);
        if got.tokens != want.tokens || back != 4 * rows as u64 || (lookup > 0) != (drafted > 0) {
            failures.push(format!(
                "stories260K, lookup {lookup}: cuda {:?}, cpu {:?}; {back} bytes back for {rows} rows; {drafted} drafted",
                got.tokens, want.tokens
            ));
        }
        generations.push(format!(
            "lookup {lookup}: {} tokens, {drafted} drafted, {rows} rows, {back} bytes back",
            got.tokens.len()
        ));
    }
    report.insert(
        "argmax_rows".into(),
        serde_json::json!({"rows_checked": rows_checked, "failures": failures.len()}),
    );
    if failures.is_empty() {
        Ok(format!(
            "  argmax_rows: {rows_checked} rows (widths 1 to 151,936) the host's tokens; stories260K greedy (stop \
             token banned) the CPU's tokens, {}",
            generations.join("; ")
        ))
    } else {
        Err(failures.join("\n"))
    }
}

/// stories260K on the CPU and on `dev`, and a prompt that repeats itself (so prompt lookup
/// finds drafts in it).
fn stories_on_both(dev: &Arc<CudaDevice>) -> Result<(Model, Model, Vec<u32>), String> {
    let path = common::stories_dir();
    let (cpu, gpu) = (load(&path, Arc::new(CpuBackend::new(0)))?, load(&path, dev.clone())?);
    let ids = cpu
        .prompt_ids(
            "Once upon a time there was a little girl. Once upon a time there was a little girl. Once upon a time",
            false,
        )
        .map_err(|e| e.to_string())?;
    Ok((cpu, gpu, ids))
}

/// The device's top-k candidates (`Device::top_k_rows`) against the host's
/// (`sampler::most_likely` of the row with the banned ids at -inf), bit for bit, on rows made to
/// catch a radix select's mistakes — ties (lower id first, across the block), -0 below +0, NaNs
/// of either sign (above +inf, below -inf), infinities, every value equal, -inf or NaN — with
/// k of 1, 2, 40, 1024 and the whole row where it fits, and banned ids (none, the largest, id 0
/// with one past the row, a run of ten); every other call with the rows' greedy tokens (the
/// host's `argmax_banned`, exactly) and log-sum-exps, which must match the host's
/// (`ops::log_sum_exp` of the banned row: NaN where it is NaN, else within 1e-12 relative).
/// Then generation on stories260K (sampled with temperature 0.8 and top-k 40,
/// and greedy; the stop token banned; prompt lookup on and off): the tokens of the same
/// device's logits drawn on the host (`logits_on_host`), 8 bytes a candidate back; with
/// log-probabilities, those of the logits to within 1e-5, 8 bytes a row more (greedy: the
/// token, its candidate and the log-sum-exp, 20 bytes a row).
fn top_k_rows(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    use gatestream::model::batch::TOP_K_MAX;
    use gatestream::model::sampler::{argmax_banned, most_likely, SamplerConfig};
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let (mut rows_checked, mut failures) = (0usize, Vec::new());
    let (mut lse_checked, mut lse_worst) = (0usize, 0f64);
    let mut call = 0usize;
    let neg_nan = f32::from_bits(0xffc0_0000);
    for width in [1usize, 2, 33, 1000, 1025, 4096, 151_936] {
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for kind in 0..11u64 {
            let row: Vec<f32> = (0..width)
                .map(|i| {
                    let r = rng.next();
                    match (kind, r % 61) {
                        (1, _) => (r % 4) as f32,
                        (2, 0) => f32::NAN,
                        (2, 1) => neg_nan,
                        (3, 0) => f32::INFINITY,
                        (4, _) => f32::NEG_INFINITY,
                        (5, _) => [f32::NAN, neg_nan][(r >> 7) as usize % 2],
                        (6, _) => 1.5,
                        (7, _) => [0.0, -0.0][(r >> 7) as usize % 2],
                        (8, _) => i as f32,
                        (9, _) => -((r % 3) as f32),
                        // Values alike in their top bytes: the select's later rounds decide.
                        (10, _) => 1.0 + (r % 5000) as f32 * f32::EPSILON,
                        _ => rng.normalish(),
                    }
                })
                .collect();
            rows.push(row);
        }
        let values: Vec<f32> = rows.concat();
        let x = dev.upload(rows.len(), width, values);
        let top = argmax(&rows[0]);
        let run: Vec<u32> = (0..10).map(|i| (i * 7 % width) as u32).collect();
        for banned in [vec![], vec![top], vec![0, width as u32], run] {
            let mut ks = vec![1, 2, 40, TOP_K_MAX, width];
            ks.retain(|&k| k <= width.min(TOP_K_MAX));
            ks.dedup();
            for k in ks {
                call += 1;
                let lse = call.is_multiple_of(2);
                let top = dev.top_k_rows(&x, k, &banned, lse, lse);
                let got = top.pairs;
                let banned_rows: Vec<Vec<f32>> = rows
                    .iter()
                    .map(|r| {
                        let mut r = r.clone();
                        for &b in &banned {
                            if let Some(v) = r.get_mut(b as usize) {
                                *v = f32::NEG_INFINITY;
                            }
                        }
                        r
                    })
                    .collect();
                let want: Vec<(u32, f32)> = banned_rows.iter().flat_map(|r| most_likely(r, k)).collect();
                rows_checked += rows.len();
                if top.lse.len() != if lse { rows.len() } else { 0 } {
                    failures.push(format!(
                        "width {width}, k {k}, lse {lse}: {} log-sum-exps",
                        top.lse.len()
                    ));
                }
                // Asked with the log-sum-exps, each row's greedy token too (at the same wait).
                let greedy: Vec<u32> = match lse {
                    true => rows.iter().map(|r| argmax_banned(r, &banned)).collect(),
                    false => Vec::new(),
                };
                if top.tokens != greedy {
                    failures.push(format!(
                        "width {width}, k {k}, banned {banned:?}: greedy tokens {:?} on the device, {greedy:?} on \
                         the host",
                        top.tokens
                    ));
                }
                for (r, (&z, row)) in top.lse.iter().zip(&banned_rows).enumerate() {
                    let host = gatestream::backend::ops::log_sum_exp(row);
                    lse_checked += 1;
                    let off = (z - host).abs() / host.abs().max(1.0);
                    if host.is_nan() != z.is_nan() || off > 1e-12 {
                        failures.push(format!(
                            "width {width}, k {k}, banned {banned:?}, row {r}: log-sum-exp {z} on the device, {host} \
                             on the host"
                        ));
                    } else if !z.is_nan() {
                        lse_worst = lse_worst.max(off);
                    }
                }
                let bits = |v: &[(u32, f32)]| v.iter().map(|&(i, x)| (i, x.to_bits())).collect::<Vec<_>>();
                if bits(&got) != bits(&want) {
                    let first = (0..want.len().min(got.len()))
                        .find(|&i| bits(&got[i..i + 1]) != bits(&want[i..i + 1]))
                        .unwrap_or(0);
                    failures.push(format!(
                        "width {width}, k {k}, banned {banned:?}: {} pairs, first difference at {first} (row {}): \
                         cuda {:?}, host {:?}",
                        got.len(),
                        first / k,
                        got.get(first),
                        want.get(first)
                    ));
                }
            }
        }
    }
    if let Some(e) = dev.take_error() {
        return Err(e.to_string());
    }
    // Time a vocabulary row's ways to a draw's candidates (each call a sync): top-40 on the
    // device (320 bytes back), the argmax on the device (4 bytes), and the row brought to the
    // host (608 KB) and its top-40 found there.
    let timing = {
        let row: Vec<f32> = (0..151_936).map(|_| rng.normalish() * 4.0).collect();
        let x = dev.upload(1, row.len(), row);
        let reps = if dev.name().contains("host emulation") { 3 } else { 200 };
        let time = |f: &dyn Fn()| {
            f();
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            t.elapsed().as_secs_f64() * 1e6 / reps as f64
        };
        let top = time(&|| {
            dev.top_k_rows(&x, 40, &[], false, false);
        });
        let top_lse = time(&|| {
            dev.top_k_rows(&x, 40, &[], true, false);
        });
        let arg = time(&|| {
            dev.argmax_rows(&x, &[]);
        });
        let host = time(&|| {
            most_likely(&dev.to_host(&x), 40);
        });
        report.insert(
            "top_k_rows_us".into(),
            serde_json::json!({"top_k_40_on_device": top, "top_k_40_and_log_sum_exp_on_device": top_lse,
                               "argmax_on_device": arg, "row_to_host_then_top_k_40": host}),
        );
        format!(
            "a row of 151,936: top-40 on the device {top:.1} µs (with the log-sum-exp {top_lse:.1} µs), argmax on \
             the device {arg:.1} µs, the row to the host and its top-40 there {host:.1} µs (a call each, sync \
             included)"
        )
    };
    // Generation through `Want::Top` (sampled) and `Want::Greedy` / `Want::Top` (greedy, with
    // log-probabilities), against the same device's logits taken to the host.
    let (cpu, gpu, ids) = stories_on_both(dev)?;
    let mut generations = Vec::new();
    let mut lp_worst = 0f32;
    let sampled = SamplerConfig {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed: 7,
    };
    for (name, sampler, per_row, per_row_lp) in [
        ("sampled", sampled, 8 * 40, 8 * 40 + 8),
        ("greedy", common::greedy(0).sampler, 4, 8 + 4 + 8),
    ] {
        for lookup in [0, 3] {
            let opts = gatestream::model::generate::GenerateOptions {
                ignore_eos: true,
                lookup,
                sampler: sampler.clone(),
                ..common::greedy(24)
            };
            let gen = |m: &Model, logprobs: bool, logits_on_host: bool| {
                let opts = gatestream::model::generate::GenerateOptions {
                    logprobs,
                    logits_on_host,
                    ..opts.clone()
                };
                let before = dev.link().unwrap_or_default().to_host_bytes;
                let g = m.generate_ids(&ids, &opts, None, None, None, &mut |_| {});
                let back = dev.link().unwrap_or_default().to_host_bytes - before;
                g.map(|g| {
                    let rows = 1 + g.speculative.as_ref().map_or(g.decode_tokens, |s| s.passes + s.drafted);
                    (g, rows as u64, back)
                })
                .map_err(|e| e.to_string())
            };
            let (want, _, _) = gen(&gpu, true, true)?;
            let (on_cpu, _, _) = gen(&cpu, false, false)?;
            let (got, rows, back) = gen(&gpu, false, false)?;
            let (lp, lp_rows, lp_back) = gen(&gpu, true, false)?;
            let drafted = got.speculative.as_ref().map_or(0, |s| s.drafted);
            let lp_off = lp
                .logprobs
                .iter()
                .zip(&want.logprobs)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            lp_worst = lp_worst.max(lp_off);
            if got.tokens != want.tokens
                || lp.tokens != want.tokens
                || lp.logprobs.len() != want.logprobs.len()
                || lp_off.is_nan()
                || lp_off > 1e-5
                || back != per_row * rows
                || lp_back != per_row_lp * lp_rows
                || (lookup > 0) != (drafted > 0)
            {
                failures.push(format!(
                    "stories260K {name}, lookup {lookup}: picked on the device {:?} (with logprobs {:?}), from the \
                     logits {:?}; logprobs {:?} against {:?}; {back} bytes back for {rows} rows, {lp_back} for \
                     {lp_rows} with logprobs; {drafted} drafted",
                    got.tokens, lp.tokens, want.tokens, lp.logprobs, want.logprobs
                ));
            }
            generations.push(format!(
                "{name}, lookup {lookup}: {} tokens, {drafted} drafted, {rows} rows, {back} bytes back ({lp_back} \
                 with logprobs), the CPU's tokens: {}",
                got.tokens.len(),
                if on_cpu.tokens == got.tokens {
                    "yes"
                } else {
                    "no (its logits differ)"
                }
            ));
        }
    }
    report.insert(
        "top_k_rows".into(),
        serde_json::json!({"rows_checked": rows_checked, "log_sum_exps_checked": lse_checked,
                           "log_sum_exp_worst_relative": lse_worst, "logprob_worst_abs": lp_worst,
                           "failures": failures.len()}),
    );
    if failures.is_empty() {
        Ok(format!(
            "  top_k_rows: {rows_checked} rows (widths 1 to 151,936, k 1 to 1024) the host's candidates, \
             {lse_checked} log-sum-exps within {lse_worst:.1e} of the host's; stories260K's tokens those of its \
             logits, log-probabilities within {lp_worst:.1e}: {}; {timing}",
            generations.join("; ")
        ))
    } else {
        Err(failures.join("\n"))
    }
}

/// The integer products' input blocks a norm or gated activation writes beside its output
/// (`GATESTREAM_CUDA_FUSE`) against blocks made from the same values uploaded afresh: a Q4_K
/// product of each producer's output equal bit for bit, and after each operation that writes
/// an activation in place, the product of the new values (the old blocks dropped): for a token,
/// a batch of 3 (integer batches) and of 13 (integer tiles). The device's modes restored after.
fn fused_q8_blocks(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let (was_a, was_f) = (dev.activations(), dev.fuse());
    dev.set_activations(Activations::Auto);
    dev.set_fuse(true);
    let r = fused_blocks_follow_writes(dev, report);
    dev.set_activations(was_a);
    dev.set_fuse(was_f);
    r
}

fn fused_blocks_follow_writes(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    use gatestream::backend::{Act, RopeShape};
    use gatestream::config::{FfnActivation, RopeStyle};
    // Three super-blocks a row; six heads of 128 for RoPE.
    const COLS: usize = 768;
    const EPS: f32 = 1e-6;
    let mut rng = Rng(11);
    let mut values = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normalish()).collect() };
    let w = quantized(GgmlType::Q4_K, 40, COLS, &mut Rng(12));
    let neurons = quantized(GgmlType::F32, 24, COLS, &mut Rng(13));
    let (norm, norm2, bias) = (values(COLS), values(COLS), values(COLS));
    let mut checked = Vec::new();
    let mut failures = Vec::new();
    // A token (one-token products), a batch of 3 (integer batches) and of 13 (integer tiles).
    for rows in [1usize, 3, 13] {
        let up_values = values(rows * COLS);
        let gate_values = values(rows * COLS);
        let acts_values = values(rows * 24);
        let x = dev.upload(rows, COLS, values(rows * COLS));
        let product = |a: &Act| dev.download(dev.matmul(&[&w], a).remove(0));
        // An integer product first: blocks are made ahead only once one has run.
        product(&x);
        // `blocks`: whether `a` should carry blocks (made with it) or not (written since).
        let mut check = |what: &str, a: &Act, blocks: bool| {
            if dev.has_input_blocks(a) != blocks {
                failures.push(format!(
                    "{what}: input blocks {}",
                    if blocks { "missing" } else { "kept" }
                ));
            }
            let got = product(a);
            let fresh = dev.upload(a.rows, COLS, dev.to_host(a).into_owned());
            let want = product(&fresh);
            let differ = bits_differ(&got, &want);
            if differ > 0 {
                failures.push(format!("{what}: {differ} of {} outputs differ", want.len()));
            }
            checked.push(format!("{what}, {rows} row{}", if rows == 1 { "" } else { "s" }));
        };
        let normed = || dev.rms_norm(&x, &norm, EPS);
        check("rms_norm", &normed(), true);
        let mut y = normed();
        dev.add(&mut y, &x);
        check("add after rms_norm", &y, false);
        let mut y = normed();
        dev.mul(&mut y, &x);
        check("mul after rms_norm", &y, false);
        let mut y = normed();
        dev.add_bias(&mut y, &bias);
        check("add_bias after rms_norm", &y, false);
        let mut y = normed();
        dev.activate(&mut y, FfnActivation::GeluTanh);
        check("activate after rms_norm", &y, false);
        let mut y = normed();
        dev.softcap(&mut y, 0.5);
        check("softcap after rms_norm", &y, false);
        let mut y = normed();
        dev.rms_norm_in_place(&mut y, &norm2, EPS);
        check("rms_norm_in_place after rms_norm", &y, true);
        let mut residual = normed();
        let out = dev.add_rms_norm(&mut residual, &x, &norm2, EPS);
        check("add_rms_norm", &out, true);
        check("add_rms_norm's residual after rms_norm", &residual, false);
        let mut up = dev.upload(rows, COLS, up_values.clone());
        let mut gate = dev.upload(rows, COLS, gate_values.clone());
        dev.activate_mul(&mut up, &mut gate, FfnActivation::Silu);
        check("activate_mul", &up, true);
        dev.add(&mut up, &x);
        check("add after activate_mul", &up, false);
        let mut up = normed();
        dev.activate_mul(&mut up, &mut gate, FfnActivation::GeluTanh);
        check("activate_mul after rms_norm", &up, true);
        let mut out = normed();
        let acts = dev.upload(rows, 24, acts_values);
        dev.accumulate_rows(&neurons, None, &acts, &mut out);
        check("accumulate_rows after rms_norm", &out, false);
        let (mut q, mut k) = (normed(), normed());
        let shape = RopeShape {
            head_dim: 128,
            rope_dims: 128,
            base: 10000.0,
            pos_scale: 1.0,
            style: RopeStyle::HalfSplit,
            factors: None,
        };
        let positions: Vec<usize> = (5..5 + rows).collect();
        dev.rope_qk(&mut q, &mut k, &positions, shape, None, None, EPS);
        check("rope_qk (queries) after rms_norm", &q, false);
        check("rope_qk (keys) after rms_norm", &k, false);
    }
    if let Some(e) = dev.take_error() {
        failures.push(format!("the device: {e}"));
    }
    let msg = format!(
        "  fused input blocks: a Q4_K product of each of {} activations ({}) equal to the product of its values \
         uploaded afresh{}",
        checked.len(),
        checked.join(", "),
        match failures.is_empty() {
            true => String::new(),
            false => format!("; FAILED: {}", failures.join("; ")),
        }
    );
    report.insert(
        "fused_q8_blocks".into(),
        serde_json::json!({"checked": checked, "failures": failures}),
    );
    match failures.is_empty() {
        true => Ok(msg),
        false => Err(msg),
    }
}

fn kernels_of_each_type(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    // f32 activations unless a product below asks for another mode.
    dev.set_activations(Activations::F32);
    let mut rng = Rng(7);
    let mut lines = Vec::new();
    let mut worst = 0f64;
    for ty in CUDA_TYPES {
        // More 32-value units than a warp has lanes (each lane takes several, every lane one).
        let cols = if ty.block_elems() == 256 { 1280 } else { 1312 };
        let rows = 45;
        let w = quantized(ty, rows, cols, &mut rng);
        let deq = dequantized(&w);
        let mut errs = Vec::new();
        for n in [1usize, 13] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
            let xa = dev.upload(n, cols, x.clone());
            // Full product and a row subset.
            let full = dev.download(dev.matmul(&[&w], &xa).remove(0));
            // Every row times each token's activations `acts` [n, cols], in f64.
            let reference = |acts: &[f32]| -> Vec<f32> {
                (0..n)
                    .flat_map(|t| {
                        deq.iter().map(move |row| {
                            row.iter()
                                .zip(&acts[t * cols..(t + 1) * cols])
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>() as f32
                        })
                    })
                    .collect()
            };
            let want = reference(&x);
            errs.push(rel_err(&full, &want));
            let subset: Vec<u32> = vec![44, 3, 17, 0, 29];
            let part = dev.download(dev.matmul_rows(&w, &subset, &xa));
            let want_part: Vec<f32> = (0..n)
                .flat_map(|t| subset.iter().map(move |&r| (t, r)))
                .map(|(t, r)| want[t * rows + r as usize])
                .collect();
            errs.push(rel_err(&part, &want_part));
            // One token: the kernels with 2 and 4 rows per warp (45 rows and the 5-row subset
            // leave a warp with fewer rows than it takes).
            if n == 1 {
                for rpw in [2, 4] {
                    dev.set_matvec_rows(rpw).map_err(|e| e.to_string())?;
                    let full_r = dev.download(dev.matmul(&[&w], &xa).remove(0));
                    let part_r = dev.download(dev.matmul_rows(&w, &subset, &xa));
                    dev.set_matvec_rows(1).map_err(|e| e.to_string())?;
                    errs.push(rel_err(&full_r, &want));
                    errs.push(rel_err(&part_r, &want_part));
                }
            }
            // With the CPU's 8-bit activations: the products of the activations it sees.
            dev.set_activations(Activations::Q8);
            let q8 = dev.download(dev.matmul(&[&w], &xa).remove(0));
            let q8_part = dev.download(dev.matmul_rows(&w, &subset, &xa));
            // The same multiplied as integers (one token of Q4_K and Q6_K rows; the rest as q8).
            dev.set_activations(Activations::Int8);
            let i8_full = dev.download(dev.matmul(&[&w], &xa).remove(0));
            let i8_part = dev.download(dev.matmul_rows(&w, &subset, &xa));
            dev.set_activations(Activations::F32);
            let seen: Vec<f32> = x
                .chunks_exact(cols)
                .flat_map(|t| {
                    let mut p = PreparedInput::new();
                    p.prepare(t, ty);
                    p.dequantized()
                })
                .collect();
            let want_q8 = reference(&seen);
            errs.push(rel_err(&q8, &want_q8));
            let want_q8_part: Vec<f32> = (0..n)
                .flat_map(|t| subset.iter().map(move |&r| (t, r)))
                .map(|(t, r)| want_q8[t * rows + r as usize])
                .collect();
            errs.push(rel_err(&q8_part, &want_q8_part));
            errs.push(rel_err(&i8_full, &want_q8));
            errs.push(rel_err(&i8_part, &want_q8_part));
            // Neuron-major product: out[t] += sum_r acts[t][r] * w[r] over a row list.
            let acts: Vec<f32> = (0..n * rows)
                .map(|i| if i % 5 == 0 { 0.0 } else { rng.normalish() })
                .collect();
            let aa = dev.upload(n, rows, acts.clone());
            let base: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
            let mut out = dev.upload(n, cols, base.clone());
            let kept: Vec<u32> = (0..rows as u32).filter(|r| r % 3 != 1).collect();
            dev.accumulate_rows(&w, Some(&kept), &aa, &mut out);
            let got = dev.download(out);
            let mut want_acc: Vec<f64> = base.iter().map(|&v| v as f64).collect();
            for t in 0..n {
                for &r in &kept {
                    let a = acts[t * rows + r as usize] as f64;
                    for c in 0..cols {
                        want_acc[t * cols + c] += a * deq[r as usize][c] as f64;
                    }
                }
            }
            let want_acc: Vec<f32> = want_acc.iter().map(|&v| v as f32).collect();
            errs.push(rel_err(&got, &want_acc));
        }
        // Float rows may end inside a unit (the products' tail path).
        if ty.block_elems() == 1 {
            let tail_cols = 1310;
            let wt = quantized(ty, rows, tail_cols, &mut rng);
            let deq_t = dequantized(&wt);
            for n in [1usize, 13] {
                let x: Vec<f32> = (0..n * tail_cols).map(|_| rng.normalish()).collect();
                let got = dev.download(dev.matmul(&[&wt], &dev.upload(n, tail_cols, x.clone())).remove(0));
                let want: Vec<f32> = (0..n)
                    .flat_map(|t| {
                        let x = &x;
                        deq_t.iter().map(move |row| {
                            row.iter()
                                .zip(&x[t * tail_cols..(t + 1) * tail_cols])
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>() as f32
                        })
                    })
                    .collect();
                errs.push(rel_err(&got, &want));
            }
        }
        // Embedding gather.
        let ids = [3u32, 0, 44, 3];
        let emb = dev.download(dev.embed(&w, &ids, 0.5));
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| deq[i as usize].iter().map(|v| v * 0.5))
            .collect();
        errs.push(rel_err(&emb, &want));
        if let Some(e) = dev.take_error() {
            return Err(format!("{ty:?}: {e}"));
        }
        let max = errs.iter().cloned().fold(0f64, f64::max);
        worst = worst.max(max);
        lines.push(format!(
            "  {ty:?}: max relative error {max:.2e} (product n=1/13, rows, 1/2/4 rows per warp, the same with 8-bit activations{}, neuron-major, embed)",
            if INT8_TYPES.contains(&ty) {
                " and as integers"
            } else {
                ""
            }
        ));
        if max > 1e-4 {
            return Err(format!("{}\n{ty:?}: error {max:.2e} > 1e-4", lines.join("\n")));
        }
    }
    // Integer products as the attention and FFN launch them: up to three weights in one launch
    // (of a type, or of Q4_K and Q6_K mixed: `matvec_i8x3_mixed`) with biases added, and rows
    // wide enough to be shared by 2, 4 and 8 warps.
    use GgmlType::{Q4_K, Q6_K};
    for tys in [[Q4_K; 3], [Q6_K; 3], [Q4_K, Q4_K, Q6_K], [Q6_K, Q4_K, Q6_K]] {
        let ty = tys[0];
        let mut max = 0f64;
        for super_blocks in [5usize, 8, 16, 35] {
            let cols = 256 * super_blocks;
            let ws: Vec<Weight> = [45usize, 7, 19]
                .iter()
                .zip(tys)
                .map(|(&r, t)| quantized(t, r, cols, &mut rng))
                .collect();
            let biases: Vec<Vec<f32>> = ws
                .iter()
                .map(|w| (0..w.rows).map(|_| rng.normalish()).collect())
                .collect();
            let x: Vec<f32> = (0..cols).map(|_| rng.normalish()).collect();
            let xa = dev.upload(1, cols, x.clone());
            let mut p = PreparedInput::new();
            p.prepare(&x, ty);
            let seen = p.dequantized();
            dev.set_activations(Activations::Int8);
            let refs: Vec<&Weight> = ws.iter().collect();
            let with_bias = [Some(&biases[0][..]), None, Some(&biases[2][..])];
            let c0 = dev.graph_counters();
            let grouped: Vec<gatestream::backend::Act> = dev.matmul_bias(&refs, &with_bias, &xa);
            let c1 = dev.graph_counters();
            // (Recorded with graphs on: the input's blocks, then one launch for the three.)
            let ops = c1.graph_ops + c1.direct_ops - c0.graph_ops - c0.direct_ops;
            if dev.graphs() && ops != 2 {
                return Err(format!(
                    "{tys:?}, {cols} columns: three weights took {ops} operations, not 2 (blocks, one launch)"
                ));
            }
            let grouped: Vec<Vec<f32>> = grouped.into_iter().map(|a| dev.download(a)).collect();
            let pair: Vec<Vec<f32>> = dev
                .matmul(&refs[..2], &xa)
                .into_iter()
                .map(|a| dev.download(a))
                .collect();
            let alone: Vec<Vec<f32>> = refs
                .iter()
                .map(|w| dev.download(dev.matmul(&[w], &xa).remove(0)))
                .collect();
            dev.set_activations(Activations::F32);
            for (i, w) in ws.iter().enumerate() {
                let want: Vec<f32> = dequantized(w)
                    .iter()
                    .enumerate()
                    .map(|(r, row)| {
                        let b = with_bias[i].map_or(0.0, |b| b[r] as f64);
                        row.iter().zip(&seen).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32 + b as f32
                    })
                    .collect();
                max = max.max(rel_err(&grouped[i], &want));
                // The same row sums whichever launch computes them: bit-identical.
                let alone_b: Vec<f32> = alone[i]
                    .iter()
                    .enumerate()
                    .map(|(r, v)| with_bias[i].map_or(*v, |b| v + b[r]))
                    .collect();
                if grouped[i] != alone_b || (i < 2 && pair[i] != alone[i]) {
                    return Err(format!(
                        "{tys:?}, {cols} columns: weight {i} of a grouped launch differs from its own launch"
                    ));
                }
            }
        }
        if let Some(e) = dev.take_error() {
            return Err(format!("{tys:?} grouped: {e}"));
        }
        worst = worst.max(max);
        let what = if tys.iter().all(|&t| t == ty) {
            format!("{ty:?}")
        } else {
            format!("{tys:?}")
        };
        lines.push(format!(
            "  {what} as integers, three weights a launch with biases, rows of 5/8/16/35 super-blocks \
             (1/2/4/8 warps a row): max relative error {max:.2e}; each output bit-identical to its weight launched alone"
        ));
        if max > 1e-4 {
            return Err(format!("{}\n{tys:?} grouped: error {max:.2e} > 1e-4", lines.join("\n")));
        }
    }
    report.insert("kernels_worst_relative_error".into(), worst.into());
    Ok(lines.join("\n"))
}

/// Batches of 2 to 8 tokens multiplied as integers (`matvec_i8n_*`: each weight super-block read
/// once for every token) against each token multiplied alone (`matvec_i8_*`): bit-identical, for
/// whole products with and without biases, row subsets and three weights asked at once, rows of
/// 5, 16 and 65 super-blocks (1, 2 and 8 warps a row), 45 and 130 rows; and within 1e-4 of f64
/// on the 8-bit activations the CPU sees. With the integer tiles off, a batch past `int8_tokens`
/// (and every batch with it at 1) takes the f16 pairs on the tensor cores instead: shown by its
/// results differing from the integer ones.
fn int8_batches(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let (was, tokens) = (dev.activations(), dev.int8_tokens());
    dev.set_activations(Activations::Auto);
    dev.set_int8_tokens(8).map_err(|e| e.to_string())?;
    let r = int8_batches_in(dev, report);
    dev.set_activations(was);
    dev.set_int8_tokens(tokens).map_err(|e| e.to_string())?;
    r
}

fn int8_batches_in(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let mut rng = Rng(23);
    let mut lines = Vec::new();
    let mut worst = 0f64;
    let download_all =
        |acts: Vec<gatestream::backend::Act>| acts.into_iter().map(|a| dev.download(a)).collect::<Vec<_>>();
    for ty in INT8_TYPES {
        let mut max = 0f64;
        for (super_blocks, rows) in [(5usize, 130usize), (16, 45), (65, 45)] {
            let cols = 256 * super_blocks;
            let ws: Vec<Weight> = [rows, 7, 19]
                .iter()
                .map(|&r| quantized(ty, r, cols, &mut rng))
                .collect();
            let refs: Vec<&Weight> = ws.iter().collect();
            // And a weight of the other type in the same launch.
            let other = if ty == GgmlType::Q4_K {
                GgmlType::Q6_K
            } else {
                GgmlType::Q4_K
            };
            let mixed_w = quantized(other, 11, cols, &mut rng);
            let deq = dequantized(&ws[0]);
            let bias: Vec<f32> = (0..rows).map(|_| rng.normalish()).collect();
            let subset: Vec<u32> = vec![rows as u32 - 1, 3, 64.min(rows as u32 - 2), 0, 29];
            for n in 2..=8usize {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
                let xa = dev.upload(n, cols, x.clone());
                let full = dev.download(dev.matmul(&[&ws[0]], &xa).remove(0));
                let biased = dev.download(dev.matmul_bias(&[&ws[0]], &[Some(&bias[..])], &xa).remove(0));
                let part = dev.download(dev.matmul_rows(&ws[0], &subset, &xa));
                let c0 = dev.graph_counters();
                let three = dev.matmul(&refs, &xa);
                let c1 = dev.graph_counters();
                // (Recorded with graphs on: the input's blocks, then one launch for the three.)
                let ops = c1.graph_ops + c1.direct_ops - c0.graph_ops - c0.direct_ops;
                if dev.graphs() && ops != 2 {
                    return Err(format!(
                        "{ty:?}, {cols} columns, {n} tokens: three weights took {ops} operations, not 2 (blocks, one launch)"
                    ));
                }
                let three = download_all(three);
                let mixed = download_all(dev.matmul(&[&ws[0], &mixed_w], &xa));
                for t in 0..n {
                    let xt = &x[t * cols..(t + 1) * cols];
                    let one = dev.upload(1, cols, xt.to_vec());
                    let alone = dev.download(dev.matmul(&[&ws[0]], &one).remove(0));
                    let alone_part = dev.download(dev.matmul_rows(&ws[0], &subset, &one));
                    let alone_biased = dev.download(dev.matmul_bias(&[&ws[0]], &[Some(&bias[..])], &one).remove(0));
                    let alone_three = download_all(dev.matmul(&refs, &one));
                    let alone_other = dev.download(dev.matmul(&[&mixed_w], &one).remove(0));
                    let row = |v: &[f32], width: usize| v[t * width..(t + 1) * width].to_vec();
                    let same = row(&full, rows) == alone
                        && row(&biased, rows) == alone_biased
                        && row(&part, subset.len()) == alone_part
                        && (0..3).all(|i| row(&three[i], ws[i].rows) == alone_three[i])
                        && row(&mixed[0], rows) == alone
                        && row(&mixed[1], mixed_w.rows) == alone_other;
                    if !same {
                        return Err(format!(
                            "{ty:?}, {cols} columns, {n} tokens: token {t} of the batch differs from the token multiplied alone"
                        ));
                    }
                    let mut p = PreparedInput::new();
                    p.prepare(xt, ty);
                    let seen = p.dequantized();
                    let want: Vec<f32> = deq
                        .iter()
                        .map(|r| r.iter().zip(&seen).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32)
                        .collect();
                    max = max.max(rel_err(&alone, &want));
                }
            }
            // Past the integer batches (the integer tiles off): the f16 pairs on the tensor cores,
            // on the f32 values (not the integer sums).
            let mmq = dev.mmq();
            dev.set_mmq(false);
            let n = 9;
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
            let xa = dev.upload(n, cols, x.clone());
            let wide = dev.download(dev.matmul(&[&ws[0]], &xa).remove(0));
            let first = dev.download(
                dev.matmul(&[&ws[0]], &dev.upload(1, cols, x[..cols].to_vec()))
                    .remove(0),
            );
            dev.set_int8_tokens(1).map_err(|e| e.to_string())?;
            let two = dev.upload(2, cols, x[..2 * cols].to_vec());
            let on_cores = dev.download(dev.matmul(&[&ws[0]], &two).remove(0));
            dev.set_int8_tokens(8).map_err(|e| e.to_string())?;
            dev.set_mmq(mmq);
            if wide[..rows] == first[..] || on_cores[..rows] == first[..] {
                return Err(format!(
                    "{ty:?}, {cols} columns: 9 tokens (or 2 with int8_tokens 1) gave the integer sums; the tensor cores were expected"
                ));
            }
        }
        let line = format!(
            "  {ty:?} batches of 2-8 tokens as integers (rows of 5/16/65 super-blocks, biases, row subsets, three weights \
             and a weight of the other type in one launch): \
             every token bit-identical to it alone; max relative error {max:.2e} against f64 on its 8-bit activations"
        );
        type_verdict(dev, &mut lines, &mut worst, max, 1e-4, line)?;
    }
    report.insert("int8_batches_max_rel_err".into(), worst.into());
    Ok(lines.join("\n"))
}

/// The given stream and mask (if any).
fn masked_hooks<'a>(stream: Option<&'a dyn LayerStream>, mask: Option<&'a dyn FfnMask>) -> FfnHooks<'a> {
    FfnHooks {
        observe: None,
        mask,
        stream,
        cancel: None,
    }
}

/// Greedy decoding on both devices from the same prompt (the second model through `stream` when
/// given), the first model's token fed to both: the steps where the argmax differs, and the worst
/// |Δlogit| / range.
fn compare_greedy(
    cpu: &Model,
    gpu: &Model,
    stream: Option<&dyn LayerStream>,
    prompt: &[u32],
    steps: usize,
) -> Result<(usize, f64), String> {
    compare_greedy_masked(cpu, gpu, stream, None, prompt, steps)
}

/// As [`compare_greedy`], both models under masks (`masks`: the first model's, the second's).
fn compare_greedy_masked(
    cpu: &Model,
    gpu: &Model,
    stream: Option<&dyn LayerStream>,
    masks: Option<(&dyn FfnMask, &dyn FfnMask)>,
    prompt: &[u32],
    steps: usize,
) -> Result<(usize, f64), String> {
    let cap = prompt.len() + steps + 1;
    let (mut cc, mut cg) = (KvCache::new(&cpu.config, cap), KvCache::new(&gpu.config, cap));
    let (hc, hg) = (
        masked_hooks(None, masks.map(|m| m.0)),
        masked_hooks(stream, masks.map(|m| m.1)),
    );
    let last_logits = |m: &Model, h: &FfnHooks, tokens: &[u32], c: &mut KvCache| {
        m.forward_with(tokens, c, Logits::Last, h).map_err(|e| e.to_string())
    };
    let (mut lc, mut lg) = (
        last_logits(cpu, &hc, prompt, &mut cc)?,
        last_logits(gpu, &hg, prompt, &mut cg)?,
    );
    let (mut mismatches, mut worst) = (0, 0f64);
    for _ in 0..steps {
        let (min, max) = lc.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        let d = max_abs_diff(lc.iter().copied(), lg.iter().copied());
        worst = worst.max(d / (max - min) as f64);
        let (tc, tg) = (argmax(&lc), argmax(&lg));
        if tc != tg {
            mismatches += 1;
        }
        let t = [tc];
        lc = last_logits(cpu, &hc, &t, &mut cc)?;
        lg = last_logits(gpu, &hg, &t, &mut cg)?;
    }
    Ok((mismatches, worst))
}

/// The neurons each layer's mask kept in one run (the reference's, recorded) for another run of
/// the same tokens to keep (replayed), one layer at a time: the reference computes a step before
/// the run it is compared with (`compare_greedy_masked`), so the latest record of a layer is the
/// one to replay.
#[derive(Default)]
struct KeptNeurons {
    by_layer: std::sync::Mutex<std::collections::HashMap<usize, Vec<bool>>>,
    /// Neurons the replaying run's own mask would have chosen otherwise, and all choices seen.
    differences: std::sync::atomic::AtomicU64,
    choices: std::sync::atomic::AtomicU64,
}

impl KeptNeurons {
    fn recorder<'a>(&'a self, inner: &'a dyn FfnMask) -> RecordedMask<'a> {
        RecordedMask {
            inner,
            kept: self,
            replay: false,
        }
    }

    fn replayer<'a>(&'a self, inner: &'a dyn FfnMask) -> RecordedMask<'a> {
        RecordedMask {
            inner,
            kept: self,
            replay: true,
        }
    }

    fn replayed_differences(&self) -> u64 {
        self.differences.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn replayed_choices(&self) -> u64 {
        self.choices.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn layer(&self, layer: usize, len: usize) -> Vec<bool> {
        let kept = self.by_layer.lock().expect("kept neurons").get(&layer).cloned();
        let kept = kept.unwrap_or_else(|| panic!("layer {layer}: replayed before the reference recorded it"));
        assert_eq!(
            kept.len(),
            len,
            "layer {layer}: replayed over another batch than recorded"
        );
        kept
    }
}

/// A mask that records what it keeps, or keeps what was recorded (see [`KeptNeurons`]).
struct RecordedMask<'a> {
    inner: &'a dyn FfnMask,
    kept: &'a KeptNeurons,
    replay: bool,
}

impl FfnMask for RecordedMask<'_> {
    fn apply(&self, layer: usize, xn: &[f32], gate: &[f32], up: &[f32], hact: &mut [f32]) {
        if !self.replay {
            self.inner.apply(layer, xn, gate, up, hact);
            let kept = hact.iter().map(|&a| a != 0.0).collect();
            self.kept.by_layer.lock().expect("kept neurons").insert(layer, kept);
            return;
        }
        let kept = self.kept.layer(layer, hact.len());
        // What this run's own mask would keep, to count the choices that replaying changes.
        let mut own = hact.to_vec();
        self.inner.apply(layer, xn, gate, up, &mut own);
        let differing = own
            .iter()
            .zip(hact.iter())
            .zip(&kept)
            .filter(|((o, a), &k)| **a != 0.0 && (**o != 0.0) != k)
            .count();
        self.kept
            .differences
            .fetch_add(differing as u64, std::sync::atomic::Ordering::Relaxed);
        self.kept
            .choices
            .fetch_add(hact.len() as u64, std::sync::atomic::Ordering::Relaxed);
        hact.iter_mut()
            .zip(&kept)
            .filter(|(_, &k)| !k)
            .for_each(|(a, _)| *a = 0.0);
    }

    fn up_needed(&self, layer: usize, xn: &[f32], gate: &[f32], need: &mut [bool]) {
        if !(self.replay && self.inner.decides_before_up()) {
            return self.inner.up_needed(layer, xn, gate, need);
        }
        let kept = self.kept.layer(layer, gate.len());
        need.fill(false);
        for row in kept.chunks_exact(need.len()) {
            need.iter_mut().zip(row).for_each(|(n, &k)| *n |= k);
        }
    }

    fn up_needed_reads_input(&self) -> bool {
        true
    }

    fn decides_before_up(&self) -> bool {
        self.inner.decides_before_up()
    }
}

/// Greedy decoding on `m` from `prompt` for `steps` steps: every step's logits (the prompt's
/// last, then each step's), each step feeding the argmax of the one before.
fn greedy_logits(m: &Model, prompt: &[u32], steps: usize) -> Result<Vec<Vec<f32>>, String> {
    let mut c = KvCache::new(&m.config, prompt.len() + steps + 1);
    let h = masked_hooks(None, None);
    let mut out = vec![m
        .forward_with(prompt, &mut c, Logits::Last, &h)
        .map_err(|e| e.to_string())?];
    for _ in 0..steps {
        let t = argmax(out.last().expect("logits"));
        out.push(
            m.forward_with(&[t], &mut c, Logits::Last, &h)
                .map_err(|e| e.to_string())?,
        );
    }
    Ok(out)
}

/// CUDA graphs (`GATESTREAM_CUDA_GRAPHS`) against the same device launching kernel by kernel,
/// on the model at `path`: 32 greedy steps and a 64-token pass, which must give bit-identical
/// logits (the same kernels on the same buffers), with the decode steps replayed as graphs —
/// every step after the few that learn the steps' signatures — and the speed of both. With
/// `split` (`GATESTREAM_CUDA_GRAPH_SPLIT`), the graphs' run launches every `split` operations
/// as they are recorded: then no graph may hold more.
fn graphs_replay(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    path: &std::path::Path,
    key: &str,
    split: usize,
) -> Result<String, String> {
    const STEPS: usize = 32;
    let was = dev.graphs();
    let was_split = dev.graph_split();
    let m = load(path, dev.clone())?;
    let v = m.config.vocab as u32;
    let prompt: Vec<u32> = (0..6).map(|i| (17 + 31 * i) % v).collect();
    let window: Vec<u32> = (0..64).map(|i| (5 + 97 * i) % v).collect();
    /// Each step's logits, the pass's nll, what graphs did in the steps, decode tok/s.
    type Run = (Vec<Vec<f32>>, f64, gatestream::backend::cuda::GraphCounters, f64);
    let run = |on: bool| -> Result<Run, String> {
        dev.set_graphs(on);
        dev.set_graph_split(if on { split } else { 0 })
            .map_err(|e| e.to_string())?;
        let c0 = dev.graph_counters();
        let logits = greedy_logits(&m, &prompt, STEPS)?;
        let c1 = dev.graph_counters();
        let nll = nll(&m, &window)?;
        let rate = decode_rate(&m, None, speed_steps(dev, 64))?;
        let counters = gatestream::backend::cuda::GraphCounters {
            replays: c1.replays - c0.replays,
            captures: c1.captures - c0.captures,
            direct_segments: c1.direct_segments - c0.direct_segments,
            graph_ops: c1.graph_ops - c0.graph_ops,
            direct_ops: c1.direct_ops - c0.direct_ops,
            left_recording: c1.left_recording - c0.left_recording,
        };
        Ok((logits, nll, counters, rate))
    };
    // The run without graphs is the same for every split (`small_qwen2_graphs` and `_graph_split`
    // both compare against it): made once per model and device mode in a process.
    static OFF: std::sync::Mutex<Vec<(String, Run)>> = std::sync::Mutex::new(Vec::new());
    let mode = format!(
        "{} {:?} {} {}",
        path.display(),
        dev.activations(),
        dev.fuse(),
        dev.matvec_rows()
    );
    let kept = OFF
        .lock()
        .unwrap()
        .iter()
        .find(|(k, _)| *k == mode)
        .map(|(_, r)| r.clone());
    let off = match kept {
        Some(r) => Ok(r),
        None => run(false).inspect(|r| OFF.lock().unwrap().push((mode, r.clone()))),
    };
    let on = run(true);
    dev.set_graphs(was);
    dev.set_graph_split(was_split).map_err(|e| e.to_string())?;
    let ((l_off, nll_off, _, rate_off), (l_on, nll_on, c, rate_on)) = (off?, on?);
    let differing = l_off.iter().zip(&l_on).filter(|(a, b)| a != b).count();
    let worst = max_abs_diff(l_off.iter().flatten().copied(), l_on.iter().flatten().copied());
    let per_step = c.graph_ops as f64 / (c.replays + c.captures).max(1) as f64;
    let msg = format!(
        "  {key}: {STEPS} greedy steps with graphs vs without: {differing}/{} logit rows differ (max |d| {worst:e}); \
         64-token pass nll {nll_on:.6} vs {nll_off:.6}; {} decode steps (or parts) replayed as a graph, {} captured, \
         {} launched kernel by kernel, {} left recording part-way; {per_step:.0} operations per graph{}; decode {rate_on:.1} \
         tok/s with graphs, {rate_off:.1} without ({:.2}x)",
        l_off.len(),
        c.replays,
        c.captures,
        c.direct_segments,
        c.left_recording,
        match split {
            0 => String::new(),
            n => format!(" (launched every {n} operations recorded)"),
        },
        rate_on / rate_off
    );
    report.insert(
        key.into(),
        serde_json::json!({"differing_rows": differing, "max_abs_diff": worst, "nll_graphs": nll_on, "nll_direct": nll_off,
            "counters": c, "tok_s_graphs": rate_on, "tok_s_direct": rate_off, "split": split}),
    );
    // The activation pool may hand out its buffers in two orders on alternate steps (seen on
    // stories260K): the first two steps are then seen once each (launched directly), the next
    // two captured, and every step from the fifth on must replay.
    // Split: each step is several graphs, so the replays only grow; none holds more than asked.
    // (A part that would end on a one-token integer product takes one operation more.)
    let too_big = split > 0 && per_step > (split + 1) as f64;
    if differing > 0 || nll_on != nll_off || (c.replays as usize) < STEPS - 4 || c.captures == 0 || too_big {
        return Err(msg);
    }
    Ok(msg)
}

/// Work a one-token integer product's last blocks take on (`GATESTREAM_CUDA_FUSE`, graphs on:
/// the launches are recorded) against the launches apart (fused launches off), bit for bit, each
/// fusion counted and none with graphs off (nothing recorded to fuse):
/// - the residual add and RMSNorm after a product (the residual, the norm's output and a product
///   of that output, which reads the norm's Q8_K blocks): Q4_K and Q6_K rows, an input with
///   blocks (`matvec_i8`: an RMSNorm's output) and without (`matvec_i8f`: values uploaded),
///   outputs of 256 to 8192 values (norms of 64 to 1024 threads, up to 8 values a thread, run by
///   a block of 256);
/// - the gated activation after a gate and up product in one launch (up, the activation, and a
///   product of it through its Q8_K blocks): 256 to 8960 rows of 1 to 64 super-blocks (rows of
///   1 to 8 warps, so 8 to 1 rows a block), SiLU and GELU;
/// - RoPE and the KV write after a token's Q, K and V products in one launch (the rotated
///   queries and keys, attention over the cache written): Q4_K and Q6_K mixed or not, heads of 64
///   to 256 (64 to 128 threads of RoPE), grouped or not, per-head norms or not.
fn fused_last_blocks(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let (was_fuse, was_graphs, was_a) = (dev.fuse(), dev.graphs(), dev.activations());
    dev.set_activations(Activations::Auto);
    let r = fused_last_blocks_in(dev, report);
    dev.set_fuse(was_fuse);
    dev.set_graphs(was_graphs);
    dev.set_activations(was_a);
    r
}

fn fused_last_blocks_in(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    use gatestream::backend::{AttnShape, RopeShape};
    use gatestream::config::{FfnActivation, RopeStyle};
    use GgmlType::{Q4_K, Q6_K};
    let mut rng = Rng(41);
    let eps = 1e-6f32;
    let mut cases = 0usize;
    let mut batch_cases = 0usize;
    // (output rows, input columns, tokens, whether the input comes with its blocks): a token's
    // product (`matvec_i8` / `matvec_i8f`), and batches of 3 and 8 (integer batches: the norm
    // of each row by a warp of the last block).
    let mut norm_cases: Vec<(usize, usize, usize, bool)> =
        [(256usize, 512usize), (1536, 256), (4096, 768), (8192, 256)]
            .iter()
            .flat_map(|&(w, c)| [(w, c, 1, true), (w, c, 1, false)])
            .collect();
    norm_cases.extend([(1536, 256, 3, true), (4096, 768, 8, true), (256, 512, 8, true)]);
    for ty in INT8_TYPES {
        for &(width, cols, n, blocks) in &norm_cases {
            let w = quantized(ty, width, cols, &mut rng);
            let next = quantized(ty, 24, width, &mut rng);
            let gain: Vec<f32> = (0..cols).map(|_| 1.0 + 0.1 * rng.normalish()).collect();
            let nw: Vec<f32> = (0..width).map(|_| 1.0 + 0.1 * rng.normalish()).collect();
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
            let res0: Vec<f32> = (0..n * width).map(|_| 4.0 * rng.normalish()).collect();
            let what = format!(
                "{ty:?}, {width} rows of {cols}, {n} token(s), input {}",
                if blocks { "with blocks" } else { "as values" }
            );
            let names = ["residual", "norm output", "product of the norm output"];
            fused_against_apart(dev, &what, &names, || {
                // (An integer product first: norms make blocks once one has run.)
                let warm = dev.upload(1, cols, x[..cols].to_vec());
                drop(dev.matmul(&[&w], &warm));
                let xin = dev.upload(n, cols, x.clone());
                let mut res = dev.upload(n, width, res0.clone());
                let f0 = dev.last_block_fusions();
                let xin = if blocks { dev.rms_norm(&xin, &gain, eps) } else { xin };
                let y = dev.matmul(&[&w], &xin).remove(0);
                let out = dev.add_rms_norm(&mut res, &y, &nw, eps);
                let p = dev.matmul(&[&next], &out).remove(0);
                let got = vec![dev.download(res), dev.download(out), dev.download(p)];
                Ok((got, dev.last_block_fusions() - f0))
            })?;
            if n == 1 {
                cases += 1;
            } else {
                batch_cases += 1;
            }
        }
    }
    let mut act_cases = 0usize;
    for ty in INT8_TYPES {
        // (rows, super-blocks a row, activation, tokens: one, or a batch of integer products)
        for (rows, super_blocks, f, n) in [
            (256usize, 1usize, FfnActivation::Silu, 1usize),
            (8960, 6, FfnActivation::Silu, 1),
            (1024, 16, FfnActivation::GeluTanh, 1),
            (512, 64, FfnActivation::Silu, 1),
            (8960, 6, FfnActivation::Silu, 8),
            (1024, 16, FfnActivation::GeluTanh, 3),
        ] {
            let cols = 256 * super_blocks;
            let (gate, up) = (quantized(ty, rows, cols, &mut rng), quantized(ty, rows, cols, &mut rng));
            let down = quantized(ty, 24, rows, &mut rng);
            let gain: Vec<f32> = (0..cols).map(|_| 1.0 + 0.1 * rng.normalish()).collect();
            let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
            let what = format!("{ty:?}, gate and up of {rows} rows of {cols}, {f:?}, {n} tokens");
            fused_against_apart(dev, &what, &["activation", "product of the activation"], || {
                let warm = dev.upload(1, cols, x[..cols].to_vec());
                drop(dev.matmul(&[&gate], &warm));
                let xin = dev.upload(n, cols, x.clone());
                let f0 = dev.last_block_fusions();
                let xn = dev.rms_norm(&xin, &gain, eps);
                let mut gu = dev.matmul(&[&gate, &up], &xn);
                let (mut u, mut g) = (gu.remove(1), gu.remove(0));
                dev.activate_mul(&mut u, &mut g, f);
                let d = dev.matmul(&[&down], &u).remove(0);
                let got = vec![dev.download(u), dev.download(d)];
                Ok((got, dev.last_block_fusions() - f0))
            })?;
            act_cases += 1;
        }
    }
    // RoPE (per-head norms or not) and the KV write after a token's Q, K and V products in one
    // launch: the rotated queries and keys, and attention over the cache they were written to.
    // `more`: half of each head rotated, with frequency factors, and attention with sinks.
    let mut rope_cases = 0usize;
    let base_cfg = load(&common::stories_dir(), Arc::new(CpuBackend::new(0)))?
        .config
        .clone();
    // (..., tokens: one, or a batch of integer products at consecutive positions, more)
    for (tys, n_heads, n_kv_heads, hd, cols, norms, style, n, more) in [
        (
            [Q4_K, Q4_K, Q6_K],
            12usize,
            2usize,
            128usize,
            1536usize,
            false,
            RopeStyle::HalfSplit,
            1usize,
            false,
        ),
        (
            [Q4_K, Q4_K, Q4_K],
            8,
            8,
            64,
            512,
            true,
            RopeStyle::AdjacentPairs,
            1,
            false,
        ),
        (
            [Q6_K, Q6_K, Q6_K],
            4,
            2,
            256,
            4096,
            true,
            RopeStyle::HalfSplit,
            1,
            false,
        ),
        (
            [Q4_K, Q4_K, Q6_K],
            12,
            2,
            128,
            1536,
            false,
            RopeStyle::HalfSplit,
            8,
            false,
        ),
        (
            [Q4_K, Q6_K, Q4_K],
            2,
            1,
            256,
            768,
            true,
            RopeStyle::AdjacentPairs,
            3,
            false,
        ),
        ([Q4_K, Q4_K, Q6_K], 4, 2, 128, 512, true, RopeStyle::HalfSplit, 1, true),
        (
            [Q4_K, Q6_K, Q4_K],
            4,
            2,
            64,
            512,
            false,
            RopeStyle::AdjacentPairs,
            3,
            true,
        ),
    ] {
        let (wq, wk, wv) = (
            quantized(tys[0], n_heads * hd, cols, &mut rng),
            quantized(tys[1], n_kv_heads * hd, cols, &mut rng),
            quantized(tys[2], n_kv_heads * hd, cols, &mut rng),
        );
        let (qn, kn): (Vec<f32>, Vec<f32>) = (
            (0..hd).map(|_| 1.0 + 0.1 * rng.normalish()).collect(),
            (0..hd).map(|_| 1.0 + 0.1 * rng.normalish()).collect(),
        );
        let gain: Vec<f32> = (0..cols).map(|_| 1.0 + 0.1 * rng.normalish()).collect();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.normalish()).collect();
        let mut cfg = base_cfg.clone();
        cfg.n_layers = 2;
        cfg.n_heads = n_heads;
        cfg.n_kv_heads = n_kv_heads;
        cfg.head_dim = hd;
        let rope_dims = if more { hd / 2 } else { hd };
        let factors: Vec<f32> = (0..rope_dims / 2).map(|i| 1.0 + i as f32 / 4.0).collect();
        // (drawn only for `more`, so the other cases' inputs stay the same)
        let sinks: Vec<f32> = match more {
            true => (0..n_heads).map(|_| rng.normalish()).collect(),
            false => Vec::new(),
        };
        let rope = RopeShape {
            head_dim: hd,
            rope_dims,
            base: 10000.0,
            pos_scale: 1.0,
            style,
            factors: more.then_some(&factors[..]),
        };
        let attn = AttnShape {
            layer: 1,
            n_heads,
            n_kv_heads,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
            sinks: more.then_some(&sinks[..]),
        };
        let what = format!(
            "{tys:?}, {n_heads}/{n_kv_heads} heads of {hd}, norms {norms}, {n} tokens, partial+factors+sinks {more}"
        );
        let names = ["queries", "keys", "attention over the cache"];
        let positions: Vec<usize> = (7..7 + n).collect();
        let seqs = vec![0usize; n];
        fused_against_apart(dev, &what, &names, || {
            let warm = dev.upload(1, cols, x[..cols].to_vec());
            drop(dev.matmul(&[&wq], &warm));
            let mut cache = KvCache::new(&cfg, 16);
            let xin = dev.upload(n, cols, x.clone());
            let f0 = dev.last_block_fusions();
            let xn = dev.rms_norm(&xin, &gain, eps);
            let mut qkv = dev.matmul(&[&wq, &wk, &wv], &xn);
            let (v, mut k, mut q) = (qkv.pop().unwrap(), qkv.pop().unwrap(), qkv.pop().unwrap());
            let mut caches = [&mut cache];
            let norms = (norms.then_some(&qn[..]), norms.then_some(&kn[..]));
            dev.rope_qk_kv_write(
                1,
                &mut q,
                &mut k,
                &v,
                (&positions, &seqs),
                &mut caches,
                (rope, norms.0, norms.1, eps),
            );
            // (Counted before attention, whose split may be merged by a last block too.)
            let fused = dev.last_block_fusions() - f0;
            let out = dev.attention(&q, &positions, &seqs, &caches, attn);
            Ok((vec![dev.download(q), dev.download(k), dev.download(out)], fused))
        })?;
        rope_cases += 1;
    }
    report.insert("fused_norms_cases".into(), cases.into());
    report.insert("fused_batch_norms_cases".into(), batch_cases.into());
    report.insert("fused_activation_cases".into(), act_cases.into());
    report.insert("fused_rope_cases".into(), rope_cases.into());
    Ok(format!(
        "  residual add and norm in a product's last block: {cases} cases (Q4_K, Q6_K; input with and without blocks; \
         outputs of 256/1536/4096/8192) and {batch_cases} of batches (3 and 8 tokens, a warp a row) bit-identical to the \
         launches apart, each fused once\n  \
         gated activation in the last blocks of its gate and up product: {act_cases} cases (Q4_K, Q6_K; 256 to 8960 rows \
         of 1 to 64 super-blocks; SiLU, GELU; a token, batches of 3 and 8) bit-identical to the launches apart, each \
         fused once\n  \
         RoPE and the KV write in the last blocks of the Q, K and V products: {rope_cases} cases (types mixed and not; \
         heads of 64/128/256, grouped and not; per-head norms and not; both pair styles; a token, batches of 3 and 8; \
         half of each head rotated with frequency factors and attention with sinks, a token and a batch) bit-identical to the launches apart (queries, keys, attention over the cache), each fused once"
    ))
}

/// One piece of `fused_last_blocks`' work (`run`: its outputs, named `names`, and the last-block
/// fusions it made) run three ways: launches fused with graphs on — first, so that its buffers
/// then hold other values and a last block that ran before every block had written its rows
/// would not read the right ones by chance — fused launches off, and graphs off. The same outputs
/// all three ways; one fusion with graphs on, none otherwise.
fn fused_against_apart(
    dev: &Arc<CudaDevice>,
    what: &str,
    names: &[&str],
    run: impl Fn() -> Result<(Vec<Vec<f32>>, u64), String>,
) -> Result<(), String> {
    let mut ways = Vec::new();
    for (fuse, graphs) in [(true, true), (false, true), (true, false)] {
        dev.set_fuse(fuse);
        dev.set_graphs(graphs);
        let got = run()?;
        if let Some(e) = dev.take_error() {
            return Err(format!("{what}: {e}"));
        }
        ways.push(got);
    }
    let [(fused, n_fused), (apart, n_apart), (direct, n_direct)] = &ways[..] else {
        unreachable!("three ways")
    };
    if (*n_fused, *n_apart, *n_direct) != (1, 0, 0) {
        return Err(format!(
            "{what}: {n_fused} / {n_apart} / {n_direct} last-block fusions fused / apart / graphs off (1 / 0 / 0 expected)"
        ));
    }
    for (i, name) in names.iter().enumerate() {
        if apart[i] != fused[i] || apart[i] != direct[i] {
            return Err(format!(
                "{what}: the {name} fused differ from the launches apart (max |d| {:e})",
                max_abs_diff(apart[i].iter().copied(), fused[i].iter().copied())
            ));
        }
    }
    Ok(())
}

/// Fused launches (`GATESTREAM_CUDA_FUSE`, in the default activation mode) against each
/// operation in a launch of its own, on the model at `path` with graphs on (which count the
/// launches): 32 greedy steps and a 64-token pass must give bit-identical logits (the same bytes
/// reach the same kernels), and each pass must launch exactly as many operations fewer as
/// were fused: per layer RoPE with the KV write, and per one-token row one quantization for each
/// input whose next products include an integer one (the attention and FFN norms' outputs, the
/// gated activation, the final norm; of a prompt each row's norms and activation, and only its
/// last row's final norm), and per
/// decode step the last blocks' fusions (`fused_last_blocks`, split attention's merge) — and the speed
/// of both.
fn fused_same(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    path: &std::path::Path,
    key: &str,
) -> Result<String, String> {
    const STEPS: usize = 32;
    let (was_fuse, was_graphs, was_a) = (dev.fuse(), dev.graphs(), dev.activations());
    dev.set_activations(Activations::Auto);
    dev.set_graphs(true);
    let m = load(path, dev.clone())?;
    let v = m.config.vocab as u32;
    let prompt: Vec<u32> = (0..6).map(|i| (17 + 31 * i) % v).collect();
    let window: Vec<u32> = (0..64).map(|i| (5 + 97 * i) % v).collect();
    // What one decode step saves: each input whose next products include an integer one.
    let int8 = |ws: &[&Weight]| ws.iter().any(|w| INT8_TYPES.contains(&w.ty) && w.cols % 256 == 0);
    let output_int8 = usize::from(int8(&[&m.weights.output]));
    let mut saved_per_step = output_int8;
    // The prompt's pass (6 tokens: integer batches) saves the same for the norms' and the gated
    // activation's outputs (its attention output is quantized in a launch of its own either way).
    let mut saved_prompt = 0;
    for l in &m.weights.layers {
        let f = l.dense("fused blocks").map_err(|e| e.to_string())?;
        let down = match &f.down {
            FfnDown::Rows(w) | FfnDown::Columns(w) => w,
        };
        let batch = usize::from(int8(&[&l.attn.wq, &l.attn.wk, &l.attn.wv]))
            + usize::from(int8(&[&f.gate, &f.up]))
            + usize::from(int8(&[down]));
        saved_prompt += batch;
        // (The attention output's product quantizes its own input: one launch saved.)
        saved_per_step += batch + usize::from(int8(&[&l.attn.wo]));
    }
    let layers = m.weights.layers.len();
    // A decode step's last blocks doing the next launch's work: the residual add and norm after
    // each one-token integer product of the attention output and of the FFN down rows (the last
    // layer's: with the final norm), the gated activation after the gate and up products, and
    // split attention's merge where a step's heads take more than one split (its positions are
    // under 256).
    let down_int8 = |l: &gatestream::model::weights::LayerWeights| -> Result<bool, String> {
        let f = l.dense("fused norms").map_err(|e| e.to_string())?;
        Ok(match &f.down {
            FfnDown::Rows(w) | FfnDown::Columns(w) => int8(&[w]),
        })
    };
    let mut last_blocks_per_step = usize::from(
        gatestream::backend::cuda::attention_splits(gatestream::backend::cuda::attention_row(1), m.config.n_heads) > 1,
    ) * layers;
    // Split attention's output written as Q8_K blocks too, where its heads fill whole blocks: a
    // fusion, not a launch fewer (unfused, the output product quantizes its input itself).
    let attention_blocks_per_step =
        usize::from(gatestream::backend::cuda::attention_q8_groups(m.config.n_heads, m.config.head_dim).is_some())
            * layers;
    let all_int8 = |ws: &[&Weight]| ws.iter().all(|w| int8(&[w])) && ws.windows(2).all(|p| p[0].cols == p[1].cols);
    let hd = m.config.head_dim;
    // The prompt's pass (6 tokens: integer batches) fuses too: RoPE and the KV write after the
    // Q, K and V products, the norm after each layer's attention output product and after its
    // down product (not the last layer's, whose output goes on alone: only the prompt's last row
    // is normed), and the gated activation.
    let mut prompt_last_blocks = 0;
    for (i, l) in m.weights.layers.iter().enumerate() {
        let f = l.dense("fused activations").map_err(|e| e.to_string())?;
        let rows = 8 / gatestream::backend::cuda::i8_warps_per_row(l.attn.wq.cols);
        prompt_last_blocks += usize::from(int8(&[&l.attn.wo]))
            + usize::from(down_int8(l)? && i + 1 < layers)
            + usize::from(all_int8(&[&f.gate, &f.up]) && f.gate.rows == f.up.rows && f.gate.rows % 256 == 0)
            + usize::from(all_int8(&[&l.attn.wq, &l.attn.wk, &l.attn.wv]) && hd % rows == 0 && hd / 2 <= 256);
    }
    for l in &m.weights.layers {
        last_blocks_per_step += usize::from(int8(&[&l.attn.wo])) + usize::from(down_int8(l)?);
        // RoPE and the KV write after the Q, K and V products in one launch, whose blocks' rows
        // lie within a head.
        let rows = 8 / gatestream::backend::cuda::i8_warps_per_row(l.attn.wq.cols);
        last_blocks_per_step +=
            usize::from(all_int8(&[&l.attn.wq, &l.attn.wk, &l.attn.wv]) && hd % rows == 0 && hd / 2 <= 256);
        // The gated activation after the gate and up products in one launch.
        let f = l.dense("fused activations").map_err(|e| e.to_string())?;
        last_blocks_per_step +=
            usize::from(int8(&[&f.gate]) && f.gate.ty == f.up.ty && f.gate.rows == f.up.rows && f.gate.rows % 256 == 0);
    }
    /// Each step's logits, the pass's nll, operations launched in the steps, segments left,
    /// decode tok/s, last-block fusions in the steps.
    type Run = (Vec<Vec<f32>>, f64, u64, u64, f64, u64);
    let run = |on: bool| -> Result<Run, String> {
        dev.set_fuse(on);
        let (c0, f0) = (dev.graph_counters(), dev.last_block_fusions());
        let logits = greedy_logits(&m, &prompt, STEPS)?;
        let (c1, f1) = (dev.graph_counters(), dev.last_block_fusions());
        let nll = nll(&m, &window)?;
        let rate = decode_rate(&m, None, speed_steps(dev, 64))?;
        let ops = c1.graph_ops + c1.direct_ops - c0.graph_ops - c0.direct_ops;
        Ok((logits, nll, ops, c1.left_recording - c0.left_recording, rate, f1 - f0))
    };
    let off = run(false);
    let on = run(true);
    dev.set_fuse(was_fuse);
    dev.set_graphs(was_graphs);
    dev.set_activations(was_a);
    let ((l_off, nll_off, ops_off, left_off, rate_off, last_off), (l_on, nll_on, ops_on, left_on, rate_on, last_on)) =
        (off?, on?);
    let differing = l_off.iter().zip(&l_on).filter(|(a, b)| a != b).count();
    let worst = max_abs_diff(l_off.iter().flatten().copied(), l_on.iter().flatten().copied());
    // And RoPE with the KV write in every layer of every pass; the prompt's pass normalizes
    // only its last row before the output product.
    let expected = (STEPS * (saved_per_step + layers + last_blocks_per_step)
        + output_int8
        + layers
        + saved_prompt
        + prompt_last_blocks) as u64;
    let fusions_expected = STEPS * (last_blocks_per_step + attention_blocks_per_step) + prompt_last_blocks;
    let msg = format!(
        "  {key}: {STEPS} greedy steps with launches fused vs not: {differing}/{} logit rows differ (max |d| {worst:e}); 64-token pass nll \
         {nll_on:.6} vs {nll_off:.6}; {ops_on} vs {ops_off} operations ({} fewer; {saved_per_step} input \
         blocks a step and {saved_prompt} in the prompt's pass, {last_blocks_per_step} last-block fusions a step saving a launch and {attention_blocks_per_step} making attention's output blocks, {prompt_last_blocks} in the prompt's pass ({last_on} done, {last_off} unfused) and {layers} RoPE launches a pass expected, {expected} in all); \
         decode {rate_on:.1} tok/s fused, {rate_off:.1} not ({:.2}x)",
        l_off.len(),
        ops_off as i64 - ops_on as i64,
        rate_on / rate_off
    );
    report.insert(
        key.into(),
        serde_json::json!({"differing_rows": differing, "max_abs_diff": worst, "nll_fused": nll_on, "nll_unfused": nll_off,
            "ops_fused": ops_on, "ops_unfused": ops_off, "input_blocks_per_step_expected": saved_per_step, "expected_fewer": expected,
            "tok_s_fused": rate_on, "tok_s_unfused": rate_off, "last_block_fusions": last_on,
            "last_block_fusions_expected": fusions_expected}),
    );
    if differing > 0
        || nll_on != nll_off
        || saved_per_step == 0
        || ops_off.checked_sub(ops_on) != Some(expected)
        || last_on != fusions_expected as u64
        || last_off != 0
        || left_off + left_on > 0
    {
        return Err(msg);
    }
    Ok(msg)
}

/// The bar a model comparison must clear: the same greedy tokens, max |Δlogit| at most 1% of the
/// logits' range, perplexity within 0.1%.
fn judged(mismatches: usize, worst: f64, rel: f64, msg: String) -> Result<String, String> {
    if mismatches > 0 || worst > 0.01 || rel > 0.001 {
        Err(msg)
    } else {
        Ok(msg)
    }
}

/// Mean negative log-likelihood of the second half of `tokens` (one pass).
fn nll(m: &Model, tokens: &[u32]) -> Result<f64, String> {
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

fn load(path: &std::path::Path, device: Arc<dyn Device>) -> Result<Model, String> {
    Model::load_on(path, &LoadOptions::default(), device).map_err(|e| e.to_string())
}

/// A model file on both devices: greedy steps from "Once upon a time" (steps whose argmax differs,
/// worst |dlogit| of the range) and perplexity of 4 windows of 256 of `text` (cpu, cuda).
fn cpu_vs_cuda(path: &std::path::Path, dev: &Arc<CudaDevice>, text: &str) -> Result<(usize, f64, f64, f64), String> {
    let cpu = load(path, Arc::new(CpuBackend::new(0)))?;
    let gpu = load(path, dev.clone())?;
    let prompt = cpu
        .tokenizer
        .encode("Once upon a time", true)
        .map_err(|e| e.to_string())?;
    let (mismatches, worst) = compare_greedy(&cpu, &gpu, None, &prompt, 32)?;
    let opts = gatestream::perplexity::PerplexityOptions {
        ctx: 256,
        windows: ppl_windows(dev),
    };
    let pc = gatestream::perplexity::perplexity(&cpu, text, &opts, &mut |_, _, _| {}).map_err(|e| e.to_string())?;
    let pg = gatestream::perplexity::perplexity(&gpu, text, &opts, &mut |_, _, _| {}).map_err(|e| e.to_string())?;
    Ok((mismatches, worst, pc.perplexity, pg.perplexity))
}

/// The first `chars` characters of wikitext-2's test text.
fn wiki_text(chars: usize) -> Result<String, String> {
    let text =
        std::fs::read_to_string(common::data_dir().join("wikitext-2/wiki.test.raw")).map_err(|e| e.to_string())?;
    Ok(text.chars().take(chars).collect())
}

fn stories260k(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let (mismatches, worst, pc, pg) = cpu_vs_cuda(&common::stories_dir(), dev, &wiki_text(200_000)?)?;
    let rel = (pg / pc - 1.0).abs();
    let msg = format!(
        "  stories260K: greedy argmax differs at {mismatches}/32 steps; max |dlogit| = {:.4}% of the range; \
         perplexity ({windows} windows of 256) cpu {pc:.4} cuda {pg:.4} (diff {:.4}%)",
        worst * 100.0,
        rel * 100.0,
        windows = ppl_windows(dev),
    );
    report.insert(
        "stories260k".into(),
        serde_json::json!({"mismatched_steps": mismatches, "max_dlogit_of_range": worst, "ppl_cpu": pc, "ppl_cuda": pg}),
    );
    judged(mismatches, worst, rel, msg)
}

/// A mixture-of-experts model of architecture `arch` (stories260K upcycled by `make-moe`'s code:
/// 6 F32 experts, 2 per token, a random router) on both devices: routing, grouped expert
/// products and the weighted sum, Qwen2-MoE's shared expert and OLMoE's whole-projection
/// QK-norm, against the same bar as stories260K. One check an architecture (`moe` selects all
/// four), so that runs of the suite can share them out.
fn moe(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    arch: gatestream::config::Arch,
) -> Result<String, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let text = wiki_text(100_000)?;
    let path = common::stories_moe(dir.path(), arch)?;
    let (mismatches, worst, pc, pg) = cpu_vs_cuda(&path, dev, &text)?;
    let rel = (pg / pc - 1.0).abs();
    let msg = format!(
        "  {} (6 experts, 2 used): greedy argmax differs at {mismatches}/32 steps; max |dlogit| = {:.4}% of the \
         range; perplexity ({windows} windows of 256) cpu {pc:.4} cuda {pg:.4} (diff {:.4}%)",
        arch.name(),
        worst * 100.0,
        rel * 100.0,
        windows = ppl_windows(dev),
    );
    report.insert(
        format!("moe_{}", arch.name()),
        serde_json::json!({"mismatched_steps": mismatches, "max_dlogit_of_range": worst, "ppl_cpu": pc, "ppl_cuda": pg}),
    );
    judged(mismatches, worst, rel, msg)
}

/// The MoE of [`moe`] as a `.gst` streamed from host RAM under a GPU budget (a quarter of the
/// file above the minimum) with `--hybrid cpu-cold`: every routed expert computed by the CPU,
/// its output rows sent to the GPU, which computes attention, routers and the shared expert.
/// Greedy steps against the model in device memory, by the same bar; the link's traffic per
/// decode step beside the plain GPU budget's (which copies the routed experts).
fn moe_hybrid(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    arch: gatestream::config::Arch,
) -> Result<String, String> {
    use gatestream::io::{ReadEngine, ReaderOptions};
    use gatestream::stream::cache::CachePolicy;
    use gatestream::stream::hybrid::HybridMode;
    use gatestream::stream::residency::Priority;
    use gatestream::stream::{CostSource, Lookahead, StreamOptions, Streamer, RAM_UNLIMITED};
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let gst = gst_beside(&common::stories_moe(dir.path(), arch)?)?;
    let (file_bytes, in_device, on_disk) = gst_models(dev, &gst)?;
    let opts = |vram: u64| StreamOptions {
        budget_bytes: RAM_UNLIMITED,
        engine: ReadEngine::Uring,
        reader: ReaderOptions::default(),
        cache: CachePolicy::Lru,
        priority: Priority::CacheFirst,
        prefetch_ffn: false,
        merge_gap_bytes: None,
        cost: CostSource::Default,
        lookahead: Lookahead::Off,
        kv_positions: 128,
        batch_tokens_max: 32,
        vram_budget_bytes: Some(vram),
        prefetch_buffers: gatestream::stream::PREFETCH_BUFFERS,
        prefetch_read_bytes: gatestream::stream::PREFETCH_READ_BYTES,
    };
    let e = Streamer::open(&on_disk, &opts(0))
        .err()
        .ok_or("a zero GPU budget was taken")?
        .to_string();
    let min: u64 = e
        .split("at least ")
        .nth(1)
        .and_then(|t| {
            t.chars()
                .take_while(|c| c.is_ascii_digit())
                .collect::<String>()
                .parse()
                .ok()
        })
        .ok_or_else(|| format!("no minimum in: {e}"))?;
    // (Room past the plan for more of the routed experts than a token uses: the device keeps
    // copies of those it was sent, and a later token finds some.)
    let vram = min + file_bytes / 2;
    let steps = speed_steps(dev, 16);
    let prompt: Vec<u32> = (300..316).collect();
    let mut lines = Vec::new();
    let mut rows = serde_json::Map::new();
    let mut bar = (0, 0f64);
    for mode in [HybridMode::CpuCold, HybridMode::GpuStream] {
        let mut s = Streamer::open(&on_disk, &opts(vram)).map_err(|e| e.to_string())?;
        s.enable_hybrid(&on_disk, mode, 0)
            .map_err(|e| format!("  hybrid {}: {e}", mode.name()))?;
        let (mis, w) = compare_greedy(&in_device, &on_disk, Some(&s), &prompt, steps)?;
        let (rate, l, cpu) = masked_decode(&on_disk, Some(&s), None, steps, &|| s.counters().cold_cpu_bytes)?;
        if let Some(e) = dev.take_error() {
            return Err(format!("  hybrid {}: {e}", mode.name()));
        }
        let per = |b: u64| b as f64 / steps as f64;
        lines.push(format!(
            "  {} .gst, GPU budget {:.3} of {:.3} MB, --hybrid {}: argmax differs at {mis}/{steps} steps from in device \
             memory, max |dlogit| = {:.6}% of the range; decode {rate:.1} tok/s; {:.3} MB/token copied, {:.1} KB/token of \
             activations to the GPU, {:.3} MB/token of experts computed by the CPU",
            arch.name(),
            vram as f64 / 1e6,
            file_bytes as f64 / 1e6,
            mode.name(),
            w * 100.0,
            per(l.volatile_bytes) / 1e6,
            per(l.activation_bytes) / 1e3,
            per(cpu) / 1e6
        ));
        if mode == HybridMode::CpuCold && cpu == 0 {
            return Err(format!("{}\n  the CPU computed no expert", lines.join("\n")));
        }
        // What the device copies (the routed experts, with gpu-stream) comes from page-locked
        // memory: the expert cache's buffers are locked as they are made.
        let pinned = l.pinned_bytes as f64 / l.volatile_bytes.max(1) as f64;
        lines.push(format!(
            "    {:.1}% of the copied bytes from page-locked memory",
            pinned * 100.0
        ));
        if l.volatile_bytes > 0 && pinned < 0.999 {
            return Err(format!("{}\n  copies from pageable memory", lines.join("\n")));
        }
        // The room the plan leaves keeps copies of the experts sent (the device's own): with
        // gpu-stream, later uses find some there (and compute the same, checked above).
        if mode == HybridMode::GpuStream {
            lines.push(format!(
                "    {:.3} MB/token of experts found in the device's kept copies ({:.3} MB of room)",
                per(l.kept_bytes) / 1e6,
                s.device_plan.as_ref().map_or(0, |d| d.kept_bytes) as f64 / 1e6
            ));
            if l.kept_bytes == 0 {
                return Err(format!(
                    "{}\n  no expert was found in the device's kept copies",
                    lines.join("\n")
                ));
            }
        }
        rows.insert(
            mode.name().into(),
            serde_json::json!({"mismatched_steps": mis, "max_dlogit_of_range": w, "decode_tok_s": rate,
                "copied_bytes_per_token": per(l.volatile_bytes), "activation_bytes_per_token": per(l.activation_bytes),
                "cpu_bytes_per_token": per(cpu)}),
        );
        bar = (bar.0 + mis, bar.1.max(w));
    }
    report.insert(format!("moe_{}_hybrid", arch.name()), serde_json::Value::Object(rows));
    judged(bar.0, bar.1, 0.0, lines.join("\n"))
}

/// A Qwen2-shaped model with random weights, written by `make-model`'s library
/// (`gatestream::synth`): q/k/v biases, the types llama.cpp's Q4_K_M gives each matrix (Q6_K
/// output, Q6_K attn_v and ffn_down on the layers its `use_more_bits` picks, Q4_K elsewhere),
/// quantized blocks written directly (random quants, scales chosen so weights are centred with
/// std ≈ 0.02), so making 1 GB takes seconds; a synthetic vocabulary of the shape's size (ids are
/// fed directly; no text is tokenized).
///
/// Two choices meant to keep the random network from amplifying rounding differences: the
/// output matrix is its own (untied; the bytes read per token are the same as tied), and each
/// residual branch's last product (attn_output, ffn_down) has weights at `residual_gain` of the
/// others' scale. Measured on an H100 (docs/RESULTS.md section 4): with them, the CPU's 8-bit
/// activation quantization still moves its logits by 4.60% of their range on this model, while
/// the CPU's exact path on the same weights as F32 (`as_f32`: the same draws, decoded) agrees
/// with the GPU to 0.0001% of the range.
fn qwen_shaped_gguf(dir: &std::path::Path, shape: &Shape, residual_gain: f32, as_f32: bool) -> std::path::PathBuf {
    use gatestream::synth::{write_model, MakeSpec, Mix, OutputFormat, TokenizerChoice};
    let spec = MakeSpec {
        shape: gatestream::synth::Shape {
            name: shape.name.into(),
            vocab: shape.vocab,
            context_len: 32768,
            ..gatestream::synth::Shape::custom(
                gatestream::config::Arch::Qwen2,
                shape.hidden,
                shape.ffn,
                shape.layers,
                shape.heads,
                shape.kv_heads,
                shape.hd,
            )
        },
        mix: Mix::Q4KM,
        dequantize: as_f32,
        tokenizer: TokenizerChoice::Synthetic,
        seed: 1,
        residual_gain,
    };
    let path = dir.join(format!("{}{}.gguf", shape.name, if as_f32 { "-f32" } else { "" }));
    write_model(&spec, &path, &OutputFormat::Gguf, true, &mut |_, _| {}).unwrap();
    path
}

/// The dimensions of a Qwen2-shaped random model.
#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    hidden: usize,
    ffn: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    vocab: usize,
    layers: usize,
}

/// Qwen2.5-1.5B's.
const QWEN: Shape = Shape {
    name: "qwen-shaped",
    hidden: 1536,
    ffn: 8960,
    heads: 12,
    kv_heads: 2,
    hd: 128,
    vocab: 151_936,
    layers: 28,
};

/// A small model of the same construction (K-quant rows, 128-wide heads over fewer KV heads,
/// biases, Q6_K on `use_more_bits` layers): small enough for the host emulation of the driver.
const SMALL_QWEN: Shape = Shape {
    name: "small-qwen2",
    hidden: 256,
    ffn: 768,
    heads: 2,
    kv_heads: 1,
    hd: 128,
    vocab: 1024,
    layers: 8,
};

fn qwen_model_path() -> std::path::PathBuf {
    use std::sync::OnceLock;
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    PATH.get_or_init(|| write_qwen(&QWEN, false)).clone()
}

fn small_qwen_path() -> std::path::PathBuf {
    use std::sync::OnceLock;
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    PATH.get_or_init(|| write_qwen(&SMALL_QWEN, false)).clone()
}

fn write_qwen(shape: &Shape, as_f32: bool) -> std::path::PathBuf {
    let dir = std::env::var_os("GATESTREAM_GPU_TMP")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let t = Instant::now();
    let p = qwen_shaped_gguf(&dir, shape, 0.1, as_f32);
    println!(
        "  wrote {} ({:.0} MB) in {:.1} s",
        p.display(),
        std::fs::metadata(&p).unwrap().len() as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    p
}

fn qwen_shaped(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    shaped_compare(dev, report, &QWEN, Against::Same, "qwen_shaped")
}

/// The CUDA path given the CPU's 8-bit activations (`GATESTREAM_CUDA_ACTIVATIONS=q8`) against
/// the CPU on the same Q4_K_M-typed model: with f32 activations the two differ by the CPU's
/// activation quantization (docs/RESULTS.md section 4); with these, each product by rounding
/// alone.
fn qwen_shaped_q8(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    shaped_compare(dev, report, &QWEN, Against::Q8Activations, "qwen_shaped_q8_activations")
}

/// The CUDA path on the Q4_K_M-typed model against the CPU on the same weights dequantized to
/// F32 (the CPU's exact f32 path: what separates the two is then the GPU alone).
fn qwen_shaped_f32(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    shaped_compare(dev, report, &QWEN, Against::F32Weights, "qwen_shaped_cpu_f32_reference")
}

/// What the CPU runs in a comparison with a Qwen2-built model on the GPU: the same file; the same
/// with the GPU given the CPU's 8-bit activations; or the same weights dequantized to F32.
#[derive(Clone, Copy, PartialEq)]
enum Against {
    Same,
    Q8Activations,
    /// The GPU with the CPU's 8-bit activations in integer products (`Activations::Int8`).
    Int8,
    F32Weights,
}

fn shaped_compare(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    shape: &Shape,
    against: Against,
    key: &str,
) -> Result<String, String> {
    let path = if shape.name == QWEN.name {
        qwen_model_path()
    } else {
        small_qwen_path()
    };
    let cpu_path = match against {
        Against::F32Weights => write_qwen(shape, true),
        _ => path.clone(),
    };
    let was = dev.activations();
    dev.set_activations(match against {
        Against::Q8Activations => Activations::Q8,
        Against::Int8 => Activations::Int8,
        // The device's default (integer one-token products of K-quants, f32 elsewhere).
        Against::Same => Activations::Auto,
        Against::F32Weights => Activations::F32,
    });
    let r = qwen_compare(dev, report, &path, &cpu_path, key);
    dev.set_activations(was);
    if against == Against::F32Weights {
        let _ = std::fs::remove_file(&cpu_path);
    }
    r
}

/// The model at `path` on the GPU against the one at `cpu_path` on the CPU: 32 greedy steps from
/// a random prompt, perplexity of two random windows of 128.
fn qwen_compare(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    path: &std::path::Path,
    cpu_path: &std::path::Path,
    key: &str,
) -> Result<String, String> {
    let cpu = load(cpu_path, Arc::new(CpuBackend::new(0)))?;
    let gpu = load(path, dev.clone())?;
    let pieces = (gpu.config.vocab - 259) as u64;
    let mut rng = Rng(11);
    let prompt: Vec<u32> = (0..24).map(|_| 259 + (rng.next() % pieces) as u32).collect();
    let (mismatches, worst) = compare_greedy(&cpu, &gpu, None, &prompt, 32)?;
    let mut rels = Vec::new();
    let mut ppl = Vec::new();
    for w in 0..2 {
        let window: Vec<u32> = (0..128)
            .map(|i| if i == 0 { 1 } else { 259 + (rng.next() % pieces) as u32 })
            .collect();
        let (a, b) = (nll(&cpu, &window)?, nll(&gpu, &window)?);
        let (pa, pb) = (a.exp(), b.exp());
        rels.push((pb / pa - 1.0).abs());
        ppl.push((w, pa, pb));
    }
    let rel = rels.iter().cloned().fold(0f64, f64::max);
    let msg = format!(
        "  {key}: greedy argmax differs at {mismatches}/32 steps; max |dlogit| = {:.4}% of the range; \
         perplexity per window (cpu, cuda): {:?}; worst diff {:.4}%",
        worst * 100.0,
        ppl,
        rel * 100.0
    );
    report.insert(
        key.into(),
        serde_json::json!({"mismatched_steps": mismatches, "max_dlogit_of_range": worst, "ppl_windows": ppl, "worst_ppl_rel_diff": rel}),
    );
    judged(mismatches, worst, rel, msg)
}

/// Bytes one decode step reads: every layer's matrices and the output matrix.
fn bytes_per_token(m: &Model) -> u64 {
    let mut b = m.weights.output.len_bytes() as u64;
    for l in &m.weights.layers {
        let f = l.dense("bytes per token").unwrap();
        let down = match &f.down {
            FfnDown::Rows(w) | FfnDown::Columns(w) => w,
        };
        for w in [&l.attn.wq, &l.attn.wk, &l.attn.wv, &l.attn.wo, &f.gate, &f.up, down] {
            b += w.len_bytes() as u64;
        }
    }
    b
}

/// Whether `dev` is tests/cuda_emu's host emulation of the driver (CI), not a GPU.
fn emulated(dev: &CudaDevice) -> bool {
    dev.name().contains("host emulation")
}

/// The steps a run that times decoding takes: `steps` on a GPU; at most 4 on the emulation,
/// where the time means nothing (what the run's counters show per step is still checked, and
/// every comparison of values takes its full number of steps everywhere).
fn speed_steps(dev: &CudaDevice, steps: usize) -> usize {
    if emulated(dev) {
        steps.min(4)
    } else {
        steps
    }
}

/// The windows of 256 tokens a perplexity comparison takes: four on a GPU, one on the emulation
/// (each window runs the same batched passes; the emulation runs a kernel's threads one at a time).
fn ppl_windows(dev: &CudaDevice) -> usize {
    if emulated(dev) {
        1
    } else {
        4
    }
}

/// Decode tokens per second over `steps` single-token passes (through `stream` when given),
/// after an 8-token prompt and 3 warm-up steps; each pass hands back its greedy token, as `run`
/// asks when greedy (`Want::Greedy`: the argmax found on the device).
fn decode_rate(m: &Model, stream: Option<&dyn LayerStream>, steps: usize) -> Result<f64, String> {
    Ok(masked_decode(m, stream, None, steps, &|| 0)?.0)
}

/// As [`decode_rate`], with a mask (if any); also what the device copied from the host during
/// the timed steps, and how far `mapped` (a stream's count of bytes read in place, across the
/// link; `|| 0` for none) moved meanwhile.
/// Prompt tokens a second in one pass of `n` tokens over `stream` (after one untimed pass).
fn prefill_rate(m: &Model, stream: &dyn LayerStream, n: usize) -> Result<f64, String> {
    let h = masked_hooks(Some(stream), None);
    let v = m.config.vocab as u32;
    let tokens: Vec<u32> = (0..n as u32).map(|t| (600 + t) % v).collect();
    let mut best = f64::INFINITY;
    for _ in 0..2 {
        let mut c = KvCache::new(&m.config, n + 1);
        let t = Instant::now();
        m.forward_with(&tokens, &mut c, Logits::Last, &h)
            .map_err(|e| e.to_string())?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(n as f64 / best)
}

fn masked_decode(
    m: &Model,
    stream: Option<&dyn LayerStream>,
    mask: Option<&dyn FfnMask>,
    steps: usize,
    mapped: &dyn Fn() -> u64,
) -> Result<(f64, LinkCounters, u64), String> {
    masked_decode_as(m, stream, mask, steps, mapped, Want::Greedy { banned: &[] })
}

/// As [`masked_decode`], each pass handing back what `want` asks (`Want::Logits`: the logits
/// copied to the host every step, as sampling at a temperature needs).
fn masked_decode_as(
    m: &Model,
    stream: Option<&dyn LayerStream>,
    mask: Option<&dyn FfnMask>,
    steps: usize,
    mapped: &dyn Fn() -> u64,
    want: Want,
) -> Result<(f64, LinkCounters, u64), String> {
    let mut c = KvCache::new(&m.config, steps + 16);
    let h = masked_hooks(stream, mask);
    let mut pass = |tokens: &[u32]| {
        m.forward_want(tokens, &mut c, Logits::Last, &h, want)
            .map(drop)
            .map_err(|e| e.to_string())
    };
    let v = m.config.vocab as u32;
    pass(&(300..308).map(|t| t % v).collect::<Vec<u32>>())?;
    // Warm-up steps (weights copied on first use, kernels loaded).
    for i in 0..3 {
        pass(&[(400 + i) % v])?;
    }
    let (l0, m0) = (m.device.link().unwrap_or_default(), mapped());
    let t = Instant::now();
    for i in 0..steps as u32 {
        pass(&[(500 + i) % v])?;
    }
    let rate = steps as f64 / t.elapsed().as_secs_f64();
    Ok((rate, m.device.link().unwrap_or_default().minus(&l0), mapped() - m0))
}

fn qwen_speed(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let path = qwen_model_path();
    let gpu = load(&path, dev.clone())?;
    let per_token = bytes_per_token(&gpu);
    // Each activation mode with and without CUDA graphs, then f32 one-token products with 2 and
    // 4 rows per warp (GATESTREAM_CUDA_MATVEC_ROWS); the device's modes restored after each.
    let rate_with = |a: Activations, graphs: bool, rows: usize| -> Result<f64, String> {
        let (was_a, was_g) = (dev.activations(), dev.graphs());
        dev.set_activations(a);
        dev.set_graphs(graphs);
        dev.set_matvec_rows(rows).map_err(|e| e.to_string())?;
        let r = decode_rate(&gpu, None, 128);
        dev.set_activations(was_a);
        dev.set_graphs(was_g);
        dev.set_matvec_rows(1).map_err(|e| e.to_string())?;
        r
    };
    let gpu_rate = rate_with(Activations::Auto, true, 1)?;
    // The defaults with the logits copied to the host every step instead of the token.
    let logits_rate = masked_decode_as(&gpu, None, None, 128, &|| 0, Want::Logits)?.0;
    let gpu_auto_no_graphs = rate_with(Activations::Auto, false, 1)?;
    let gpu_f32_rate = rate_with(Activations::F32, false, 1)?;
    let gpu_f32_graphs = rate_with(Activations::F32, true, 1)?;
    let gpu_q8_rate = rate_with(Activations::Q8, false, 1)?;
    let gpu_int8_rate = rate_with(Activations::Int8, false, 1)?;
    let by_rows = [
        (2, rate_with(Activations::F32, false, 2)?),
        (4, rate_with(Activations::F32, false, 4)?),
    ];
    // The defaults with launches fused (GATESTREAM_CUDA_FUSE=1), and with the recording
    // launched every N operations (GATESTREAM_CUDA_GRAPH_SPLIT=N).
    let was_fuse = dev.fuse();
    dev.set_fuse(true);
    let fused = rate_with(Activations::Auto, true, 1);
    dev.set_fuse(was_fuse);
    let fused = fused?;
    // Graphs in parts of N operations (0: whole steps), the default's restored after each.
    let default_split = dev.graph_split();
    let mut by_split = Vec::new();
    for n in [0, 24, 48, 96, 192] {
        dev.set_graph_split(n).map_err(|e| e.to_string())?;
        let r = rate_with(Activations::Auto, true, 1);
        dev.set_graph_split(default_split).map_err(|e| e.to_string())?;
        by_split.push((n, r?));
    }
    let bw = dev.copy_bandwidth(1 << 30).map_err(|e| e.to_string())?;
    let bound = bw / per_token as f64;
    drop(gpu);
    let cpu = load(&path, Arc::new(CpuBackend::new(0)))?;
    let cpu_rate = decode_rate(&cpu, None, 8)?;
    let msg = format!(
        "  qwen-shaped decode: cuda {gpu_rate:.1} tok/s (the defaults: integer products of K-quants, graphs launched \
         in parts of {default_split} operations, the greedy token found on the GPU; {logits_rate:.1} with the logits copied to the host instead; \
         {gpu_auto_no_graphs:.1} without graphs; f32 activations {gpu_f32_rate:.1}, {gpu_f32_graphs:.1} with graphs; \
         8-bit activations {gpu_q8_rate:.1}; int8 everywhere {gpu_int8_rate:.1}; f32 with 2 rows per warp {:.1}, with 4 {:.1}; \
         the defaults with launches fused {fused:.1}, with graphs launched every N operations (0: whole steps) {}; \
         no graphs unless said), cpu ({} threads) {cpu_rate:.2} tok/s ({:.1}x); \
         {:.0} MB read per token; device copy bandwidth {:.0} GB/s (read + write) -> bound {bound:.0} tok/s; \
         cuda at {:.0}% of the bound",
        by_rows[0].1,
        by_rows[1].1,
        by_split
            .iter()
            .map(|(n, r)| format!("{n}: {r:.1}"))
            .collect::<Vec<_>>()
            .join(", "),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        gpu_rate / cpu_rate,
        per_token as f64 / 1e6,
        bw / 1e9,
        100.0 * gpu_rate / bound
    );
    report.insert(
        "qwen_shaped_decode".into(),
        serde_json::json!({"cuda_tok_s": gpu_rate, "cuda_logits_to_host_tok_s": logits_rate, "cuda_default_no_graphs_tok_s": gpu_auto_no_graphs, "cuda_f32_tok_s": gpu_f32_rate, "cuda_f32_graphs_tok_s": gpu_f32_graphs, "cuda_matvec_rows_f32_tok_s": by_rows, "cuda_q8_activations_tok_s": gpu_q8_rate, "cuda_int8_tok_s": gpu_int8_rate, "cuda_fused_tok_s": fused, "cuda_graph_split_tok_s": by_split, "default_graph_split": default_split, "cpu_tok_s": cpu_rate, "bytes_per_token": per_token, "copy_bandwidth_bytes_s": bw, "bound_tok_s": bound}),
    );
    Ok(msg)
}

/// The Qwen-shaped model as a `.gst`, streamed from disk onto the GPU under a RAM budget of 40%
/// of the file (dense streaming: FFN rows read with each layer, io_uring), every neuron active:
/// its logits against the `.gst` in device memory over 32 greedy steps (the same bar as the other
/// comparisons; the same bytes reach the same kernels, so they should be equal), then decode tok/s
/// of both and disk bytes read per pass. The page cache is not dropped here.
fn qwen_streamed(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    streamed_to_cuda(
        dev,
        report,
        "qwen_shaped_streamed",
        "qwen-shaped",
        &qwen_gst_path()?,
        Budget::OfFile(40),
    )
}

/// [`streamed_to_cuda`] on `gguf` reformatted with a split FFN layout beside it (report key
/// `{name}_streamed_split`, label "`label` (split)").
fn split_streamed_to_cuda(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    gguf: &std::path::Path,
    name: &str,
    label: &str,
    budget: Budget,
) -> Result<String, String> {
    let gst = split_gst_beside(gguf)?;
    streamed_to_cuda(
        dev,
        report,
        &format!("{name}_streamed_split"),
        &format!("{label} (split)"),
        &gst,
        budget,
    )
}

fn streamed_to_cuda(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    key: &str,
    label: &str,
    gst: &std::path::Path,
    budget: Budget,
) -> Result<String, String> {
    use gatestream::io::{ReadEngine, ReaderOptions};
    use gatestream::stream::cache::CachePolicy;
    use gatestream::stream::residency::Priority;
    use gatestream::stream::{CostSource, Lookahead, StreamOptions, Streamer};
    let (file_bytes, in_device, on_disk) = gst_models(dev, gst)?;
    let steps = 32;
    let timed = speed_steps(dev, steps);
    let opts = |budget_bytes| StreamOptions {
        budget_bytes,
        engine: ReadEngine::Uring,
        reader: ReaderOptions::default(),
        cache: CachePolicy::Pinned,
        priority: Priority::CacheFirst,
        prefetch_ffn: true,
        merge_gap_bytes: None,
        cost: CostSource::Default,
        lookahead: Lookahead::Off,
        kv_positions: 32 + steps,
        batch_tokens_max: 32,
        vram_budget_bytes: None,
        prefetch_buffers: gatestream::stream::PREFETCH_BUFFERS,
        prefetch_read_bytes: gatestream::stream::PREFETCH_READ_BYTES,
    };
    let ram = budget.bytes(file_bytes, |b| Streamer::open(&on_disk, &opts(b)).err())?;
    let opts = opts(ram);
    let stream = Streamer::open(&on_disk, &opts).map_err(|e| e.to_string())?;
    let prompt: Vec<u32> = (300..324).collect();
    let (mismatches, worst) = compare_greedy(&in_device, &on_disk, Some(&stream), &prompt, steps)?;
    if let Some(e) = dev.take_error() {
        return Err(format!("  streamed: {e}"));
    }
    // Decode speed: in device memory, then streamed (bytes read per pass from a fresh stream's
    // counters).
    let device_rate = decode_rate(&in_device, None, timed)?;
    let stream = Streamer::open(&on_disk, &opts).map_err(|e| e.to_string())?;
    let (streamed_rate, link, _) = masked_decode(&on_disk, Some(&stream), None, timed, &|| 0)?;
    // Every weight the device copies at each use (streamed attention and gates through the
    // prefetch thread's buffers, FFN rows through the staging) is in page-locked memory.
    let pinned_share = link.pinned_bytes as f64 / link.volatile_bytes.max(1) as f64;
    let link_gbs = link.volatile_bytes as f64 / link.copy_ns.max(1) as f64;
    let c = stream.counters();
    let per_pass = (c.ffn_needed_bytes + c.dense_needed_bytes) as f64 / c.passes.max(1) as f64;
    // The reads that landed straight in the prefetch buffers (page-locked by the device,
    // registered with io_uring), and the FFN rows handed over as views of them (split files).
    let r = stream.read_stats();
    let in_place = r.bytes_in_place as f64 / r.bytes_requested.max(1) as f64;
    let registered = r.bytes_in_place_registered as f64 / r.bytes_in_place.max(1) as f64;
    let views_per_pass = c.ffn_in_place_bytes as f64 / c.passes.max(1) as f64;
    if per_pass <= 0.0 {
        return Err(format!(
            "  {label}: nothing was streamed (the budget kept the whole file)"
        ));
    }
    let msg = format!(
        "  {label} .gst streamed onto the GPU (RAM budget {} of {:.3} MB, uring, dense): argmax differs at \
         {mismatches}/{steps} steps from in device memory; max |dlogit| = {:.6}% of the range; decode {streamed_rate:.2} \
         tok/s streamed ({:.3} MB read per pass, page cache as it was) against {device_rate:.1} in device memory; \
         {:.3} MB/token copied to the GPU, {:.1}% of it from page-locked memory, at {link_gbs:.1} GB/s; \
         {:.1}% of the bytes read in place ({:.1}% of those into registered buffers), {:.3} MB of FFN rows \
         a pass handed over as views of the prefetch buffers",
        budget.describe(ram),
        file_bytes as f64 / 1e6,
        worst * 100.0,
        per_pass / 1e6,
        link.volatile_bytes as f64 / timed as f64 / 1e6,
        100.0 * pinned_share,
        100.0 * in_place,
        100.0 * registered,
        views_per_pass / 1e6
    );
    report.insert(
        key.into(),
        serde_json::json!({"mismatched_steps": mismatches, "max_dlogit_of_range": worst, "streamed_tok_s": streamed_rate, "in_device_tok_s": device_rate, "bytes_read_per_pass": per_pass, "link": link, "pinned_share": pinned_share, "in_place_share": in_place, "in_place_registered_share": registered, "ffn_view_bytes_per_pass": views_per_pass}),
    );
    if pinned_share < 0.999 {
        return Err(format!("{msg}\n  copies from pageable memory"));
    }
    judged(mismatches, worst, 0.0, msg)
}

/// A `.gst`'s size, the model loaded into device memory, and the model with its matrices left
/// on disk (for a stream to feed).
fn gst_models(dev: &Arc<CudaDevice>, gst: &std::path::Path) -> Result<(u64, Model, Model), String> {
    let file_bytes = std::fs::metadata(gst).map_err(|e| e.to_string())?.len();
    let in_device = load(gst, dev.clone())?;
    let on_disk = Model::load_on(
        gst,
        &LoadOptions {
            placement: gatestream::model::Placement::OnDisk,
            ..LoadOptions::default()
        },
        dev.clone(),
    )
    .map_err(|e| e.to_string())?;
    Ok((file_bytes, in_device, on_disk))
}

/// The small Qwen2-built model as a `.gst` beside its GGUF.
fn small_qwen_gst_path() -> Result<std::path::PathBuf, String> {
    use std::sync::OnceLock;
    static PATH: OnceLock<Result<std::path::PathBuf, String>> = OnceLock::new();
    PATH.get_or_init(|| gst_beside(&small_qwen_path())).clone()
}

/// The Qwen-shaped model as a `.gst` beside its GGUF, written once for the checks that stream.
fn qwen_gst_path() -> Result<std::path::PathBuf, String> {
    use std::sync::OnceLock;
    static PATH: OnceLock<Result<std::path::PathBuf, String>> = OnceLock::new();
    PATH.get_or_init(|| gst_beside(&qwen_model_path())).clone()
}

/// `gguf` reformatted to a `.gst` beside it.
fn gst_beside(gguf: &std::path::Path) -> Result<std::path::PathBuf, String> {
    gst_beside_as(gguf, &gguf.with_extension("gst"), &Default::default())
}

/// `gguf` reformatted with a split FFN layout (up rows and down columns in two sections) to
/// NAME.split.gst beside it.
fn split_gst_beside(gguf: &std::path::Path) -> Result<std::path::PathBuf, String> {
    let opts = gatestream::reformat::ReformatOptions {
        ffn_layout: gatestream::format::FfnLayout::Split,
        ..Default::default()
    };
    gst_beside_as(gguf, &gguf.with_extension("split.gst"), &opts)
}

fn gst_beside_as(
    gguf: &std::path::Path,
    gst: &std::path::Path,
    opts: &gatestream::reformat::ReformatOptions,
) -> Result<std::path::PathBuf, String> {
    let gst = gst.to_path_buf();
    // Made anew from this run's GGUF (an earlier run's is refused by `reformat`).
    let _ = std::fs::remove_file(&gst);
    let t = Instant::now();
    gatestream::reformat::reformat(gguf, &gst, opts, &mut |_, _, _| {}).map_err(|e| e.to_string())?;
    println!(
        "  wrote {} ({:.0} MB) in {:.1} s",
        gst.display(),
        std::fs::metadata(&gst).map_err(|e| e.to_string())?.len() as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    Ok(gst)
}

/// The budget a streamed check gives: the issue's 40% of the file (the Qwen-shaped model), or
/// for a model too small for that (stories260K: the KV cache and activations outweigh its
/// weights) the refused minimum plus 40% of the file.
#[derive(Clone, Copy)]
enum Budget {
    /// A share of the file, in percent.
    OfFile(u64),
    AboveMinimum,
    /// The refused minimum itself: attention and gates streamed too (their copies volatile).
    Minimum,
}

impl Budget {
    /// The bytes, given the file's size and what opening with a budget of `b` refuses (the
    /// refusal names the minimum).
    fn bytes(self, file_bytes: u64, refusal: impl Fn(u64) -> Option<gatestream::error::Error>) -> Result<u64, String> {
        let share = file_bytes * 2 / 5;
        match self {
            Budget::OfFile(percent) => Ok(file_bytes * percent / 100),
            Budget::AboveMinimum | Budget::Minimum => {
                let e = refusal(0).ok_or("a zero budget was not refused")?.to_string();
                let min = common::budget_in_refusal(&e);
                Ok(if matches!(self, Budget::Minimum) {
                    min
                } else {
                    min + share
                })
            }
        }
    }

    fn describe(self, bytes: u64) -> String {
        match self {
            Budget::OfFile(percent) => format!("{percent}%"),
            Budget::AboveMinimum => format!("(the minimum + 40% = {:.2} MB)", bytes as f64 / 1e6),
            Budget::Minimum => format!(
                "(the minimum, {:.2} MB: every weight it can streamed)",
                bytes as f64 / 1e6
            ),
        }
    }
}

/// stories260K as a `.gst` (F32) in a directory kept for the run, written once.
fn stories_gst_path() -> Result<std::path::PathBuf, String> {
    use std::sync::OnceLock;
    static PATH: OnceLock<Result<std::path::PathBuf, String>> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?.keep();
        let gguf = common::write_temp(&dir, "stories.gguf", &common::stories_gguf(common::Breakage::None));
        let gst = dir.join("stories.gst");
        gatestream::reformat::reformat(&gguf, &gst, &Default::default(), &mut |_, _, _| {})
            .map_err(|e| e.to_string())?;
        Ok(gst)
    })
    .clone()
}

/// Automatic placement on the GPU (`run --device cuda`, no budget flag): with its free memory
/// the device holds the whole model; on the emulated driver given a memory that cannot
/// (`GATESTREAM_EMU_MEMORY`: the reserve plus 60% of the file), it chooses a budget of what is
/// free less the reserve, says so in `placement.gpu`, and generates the CPU's greedy text.
fn auto_vram_budget(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    let gguf = stories_gst_path()?.with_file_name("stories.gguf");
    let file = std::fs::metadata(&gguf).map_err(|e| e.to_string())?.len();
    let run = |device: &str, memory: Option<u64>| -> Result<serde_json::Value, String> {
        let mut c = std::process::Command::new(gatestream_binary());
        c.args([
            "run",
            "--device",
            device,
            "--max-tokens",
            "12",
            "--json",
            "--prompt",
            "Once upon a time",
            "-m",
        ])
        .arg(&gguf);
        if let Some(m) = memory {
            c.env("GATESTREAM_EMU_MEMORY", m.to_string());
        }
        let out = c.output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "run --device {device}: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| format!("run --device {device}: {e}"))
    };
    let cpu = run("cpu", None)?;
    let whole = run("cuda", None)?;
    let kind = |v: &serde_json::Value| v["placement"]["gpu"]["placed"]["kind"].as_str().map(str::to_string);
    if kind(&whole).as_deref() != Some("whole") {
        return Err(format!(
            "with the device's free memory: placement {}",
            whole["placement"]
        ));
    }
    let mut msg = format!("whole model: {}", whole["placement"]["gpu"]);
    let mut texts = vec![("whole", whole["text"].clone())];
    if emulated(dev) {
        let memory = gatestream::placement::gpu_reserve_bytes(0) + file * 6 / 10;
        let budget = run("cuda", Some(memory))?;
        if kind(&budget).as_deref() != Some("budget") {
            return Err(format!("with {memory} bytes: placement {}", budget["placement"]));
        }
        // What a token copies across the link, at the rate measured at open, bounds the speed.
        let link = &budget["placement"]["expected"]["link"];
        let (copied, rate) = (link["bytes_per_token"].as_u64(), link["link_bytes_per_s"].as_f64());
        if !(copied.is_some_and(|b| b > 0) && rate.is_some_and(|r| r > 0.0)) {
            return Err(format!("with {memory} bytes: no link bound in {}", budget["placement"]));
        }
        msg += &format!(
            "; with {memory} bytes: {}, expected {}",
            budget["placement"]["gpu"], budget["placement"]["expected"]
        );
        texts.push(("budget", budget["text"].clone()));
    }
    for (what, text) in &texts {
        if *text != cpu["text"] {
            return Err(format!("{what}: {text} vs the CPU's {}", cpu["text"]));
        }
    }
    report.insert("stories260k_auto_vram_budget".into(), msg.clone().into());
    Ok(msg)
}

/// The `gatestream` binary: cargo's build of it, or (the suite carried to a GPU machine by
/// tools/gpu-carry.sh) the one beside this suite.
fn gatestream_binary() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_gatestream"));
    match std::env::current_exe() {
        Ok(me) if !built.exists() => me.with_file_name("gatestream"),
        _ => built,
    }
}

/// `--vram-budget 40%` (the GPU streaming issue's figures): the Qwen-shaped `.gst` held in host
/// RAM (no RAM budget), the GPU keeping what a device budget of 40% of the file plans and
/// copying the rest at each use. With every neuron active its logits against the in-device
/// model's over 32 greedy steps (the same bytes reach the same kernels: equal); then decode
/// tok/s dense, with top-K 50% masks (exact and gate criteria) and in device memory, each with
/// the bytes copied per token, the host time in copies and the bandwidth that gives, beside the
/// link measured in the same run (pageable and pinned copies, `bench --device cuda`'s test) and
/// the bound it sets (copied bytes per token / pinned bandwidth).
fn qwen_vram(dev: &Arc<CudaDevice>, report: &mut serde_json::Map<String, serde_json::Value>) -> Result<String, String> {
    vram_budget(
        dev,
        report,
        "qwen_shaped_vram_budget",
        "qwen-shaped",
        &qwen_gst_path()?,
        Budget::OfFile(40),
    )
}

/// As [`qwen_vram`] under a GPU budget of 70% of the file: room after the output, attention
/// and gates for hot neurons (each layer's first), computed from the GPU's own copy, so a dense
/// step copies only the other neurons' rows.
fn qwen_vram_hot(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<String, String> {
    vram_budget(
        dev,
        report,
        "qwen_shaped_vram_budget_70",
        "qwen-shaped",
        &qwen_gst_path()?,
        Budget::OfFile(70),
    )
}

fn vram_budget(
    dev: &Arc<CudaDevice>,
    report: &mut serde_json::Map<String, serde_json::Value>,
    key: &str,
    label: &str,
    gst: &std::path::Path,
    budget: Budget,
) -> Result<String, String> {
    use gatestream::io::{ReadEngine, ReaderOptions};
    use gatestream::sparsity::{Criterion, Masker, Strategy};
    use gatestream::stream::cache::CachePolicy;
    use gatestream::stream::hybrid::HybridMode;
    use gatestream::stream::residency::Priority;
    use gatestream::stream::{CostSource, Lookahead, StreamOptions, Streamer, RAM_UNLIMITED};
    let steps = 32;
    // The runs that time decoding (their link counters are checked too): fewer steps on the
    // emulation, where the time means nothing.
    let timed = speed_steps(dev, steps);
    let link = dev
        .measure_link(&[1 << 20, 16 << 20, 64 << 20])
        .ok_or("the CUDA device measures no link")?
        .map_err(|e| e.to_string())?;
    let best = |f: fn(&gatestream::backend::LinkBandwidth) -> f64| link.iter().map(f).fold(0f64, f64::max);
    let (pinned, pageable) = (best(|r| r.pinned_gb_per_s), best(|r| r.pageable_gb_per_s));
    let (file_bytes, in_device, on_disk) = gst_models(dev, gst)?;
    let opts_in = |sparse: bool, vram: u64| StreamOptions {
        budget_bytes: RAM_UNLIMITED,
        engine: ReadEngine::Uring,
        reader: ReaderOptions::default(),
        cache: if sparse { CachePolicy::Lru } else { CachePolicy::Pinned },
        priority: Priority::CacheFirst,
        prefetch_ffn: !sparse,
        merge_gap_bytes: None,
        cost: CostSource::Default,
        lookahead: Lookahead::Off,
        kv_positions: 64 + steps,
        batch_tokens_max: 32,
        vram_budget_bytes: Some(vram),
        prefetch_buffers: gatestream::stream::PREFETCH_BUFFERS,
        prefetch_read_bytes: gatestream::stream::PREFETCH_READ_BYTES,
    };
    let vram = budget.bytes(file_bytes, |b| Streamer::open(&on_disk, &opts_in(false, b)).err())?;
    let opts = |sparse: bool| opts_in(sparse, vram);
    let stream = Streamer::open(&on_disk, &opts(false)).map_err(|e| e.to_string())?;
    let plan = stream.device_plan.clone().ok_or("no device plan")?;
    let prompt: Vec<u32> = (300..324).collect();
    let (mismatches, worst) = compare_greedy(&in_device, &on_disk, Some(&stream), &prompt, steps)?;
    if let Some(e) = dev.take_error() {
        return Err(format!("  streamed: {e}"));
    }
    drop(stream);
    let (device_rate, _, _) = masked_decode(&in_device, None, None, timed, &|| 0)?;
    let mut lines = vec![format!(
        "  {label} .gst in host RAM, GPU budget {} of {:.3} MB: {:.3} MB kept on the device (output {}, \
         attention {}/{}, gates {}/{}, hot neurons {}/layer: {:.3} MB), {:.3} MB/token copied when dense (plan); every \
         neuron: argmax differs at \
         {mismatches}/{steps} steps from in device memory, max |dlogit| = {:.6}% of the range; link {pageable:.1} GB/s \
         pageable, {pinned:.1} GB/s pinned (best of 1-64 MiB copies)",
        budget.describe(vram),
        file_bytes as f64 / 1e6,
        plan.resident_bytes() as f64 / 1e6,
        if plan.output_resident { "kept" } else { "copied" },
        plan.attention_resident.iter().filter(|&&a| a).count(),
        plan.attention_resident.len(),
        plan.gate_resident.iter().filter(|&&g| g).count(),
        plan.gate_resident.len(),
        plan.hot_neurons.first().copied().unwrap_or(0),
        plan.hot_bytes as f64 / 1e6,
        plan.copied_bytes_per_token as f64 / 1e6,
        worst * 100.0
    )];
    let mut rows = serde_json::Map::new();
    let mut masked_worst = Vec::new();
    for (name, criterion) in [
        ("dense", None),
        ("exact_50", Some(Criterion::Exact)),
        ("gate_50", Some(Criterion::Gate)),
    ] {
        let s = Streamer::open(&on_disk, &opts(criterion.is_some())).map_err(|e| e.to_string())?;
        let mask = match criterion {
            Some(c) => Some(Masker::for_model(&on_disk, Strategy::TopK, c, 0.5, None).map_err(|e| e.to_string())?),
            None => None,
        };
        // Masked: the streamed path (the kept rows read by id, in place, from the neuron cache
        // the device mapped; with GATESTREAM_CUDA_MAP_HOST=0 staged in page-locked buffers and
        // copied in chunks on the copy stream) against the model in device memory keeping the
        // same neurons (its choices replayed), with f32 activations, where both compute their
        // products to rounding: judged. Reported beside it: the same in the device's own mode
        // (8-bit activations for K-quants by default: the streamed down product sums the kept
        // neurons only, the in-device one all
        // of them with zeros, and that rounding moves later activations across 8-bit steps), and
        // each run choosing its own neurons (a score moved across the top-k cut keeps another
        // neuron; a deep random model carries either on).
        let mut compared = String::new();
        if let Some(c) = criterion {
            let replayed = |s: &dyn LayerStream| -> Result<(usize, f64, u64, u64), String> {
                let in_mask = Masker::for_model(&in_device, Strategy::TopK, c, 0.5, None).map_err(|e| e.to_string())?;
                let m = Masker::for_model(&on_disk, Strategy::TopK, c, 0.5, None).map_err(|e| e.to_string())?;
                let kept = KeptNeurons::default();
                let (record, replay) = (kept.recorder(&in_mask), kept.replayer(&m));
                let (mis, w) =
                    compare_greedy_masked(&in_device, &on_disk, Some(s), Some((&record, &replay)), &prompt, steps)?;
                if let Some(e) = dev.take_error() {
                    return Err(format!("  {name} compared: {e}"));
                }
                Ok((mis, w, kept.replayed_differences(), kept.replayed_choices()))
            };
            let mode = dev.activations();
            dev.set_activations(Activations::F32);
            let judged_f32 = replayed(&s);
            dev.set_activations(mode);
            let judged_f32 = judged_f32?;
            let (mis, w, _, _) = judged_f32;
            // In the device's own mode: the same run again unless that mode is f32.
            let (mode_mis, mode_w, differed, choices) = if mode == Activations::F32 {
                judged_f32
            } else {
                let s2 = Streamer::open(&on_disk, &opts(true)).map_err(|e| e.to_string())?;
                replayed(&s2)?
            };
            let s3 = Streamer::open(&on_disk, &opts(true)).map_err(|e| e.to_string())?;
            let in_mask = Masker::for_model(&in_device, Strategy::TopK, c, 0.5, None).map_err(|e| e.to_string())?;
            let own = Masker::for_model(&on_disk, Strategy::TopK, c, 0.5, None).map_err(|e| e.to_string())?;
            let (own_mis, own_w) =
                compare_greedy_masked(&in_device, &on_disk, Some(&s3), Some((&in_mask, &own)), &prompt, steps)?;
            if let Some(e) = dev.take_error() {
                return Err(format!("  {name} compared: {e}"));
            }
            compared = format!(
                "; against in device memory keeping the same neurons, f32 activations: argmax differs at {mis}/{steps} \
                 steps, max |dlogit| = {:.4}% of the range (in the device's mode ({mode:?}): {mode_mis}/{steps}, {:.4}%; \
                 each choosing its own neurons: {own_mis}/{steps}, {:.4}%, {differed} of {choices} kept-neuron choices \
                 not its own)",
                w * 100.0,
                mode_w * 100.0,
                own_w * 100.0,
            );
            masked_worst.push((name, mis, w));
        }
        let mask = mask.as_ref().map(|m| m as &dyn FfnMask);
        let (rate, l, mapped) = masked_decode(&on_disk, Some(&s), mask, timed, &|| s.counters().ffn_mapped_bytes)?;
        if let Some(e) = dev.take_error() {
            return Err(format!("  {name}: {e}"));
        }
        let per_token = l.volatile_bytes as f64 / timed as f64;
        // Kept rows read by id, in place, from the neuron cache the device mapped: link traffic
        // too, beside the copies. A masked run takes that path unless mapping is turned off.
        let mapped_per_token = mapped as f64 / timed as f64;
        let map_on = dev.map_host();
        if criterion.is_some() && (mapped > 0) != map_on {
            return Err(format!(
                "  {name}: {mapped} bytes read in place over {timed} steps with {MAP_HOST_ENV} {}",
                if map_on { "on" } else { "off" }
            ));
        }
        // The other way in the same run: a masked run with the cache mapped against one with it
        // staged (GATESTREAM_CUDA_MAP_HOST=0), or the reverse.
        let (mut other_way, mut other_json) = (String::new(), serde_json::Value::Null);
        if criterion.is_some() {
            dev.set_map_host(!map_on);
            let s2 = Streamer::open(&on_disk, &opts(true)).map_err(|e| e.to_string());
            let other = s2.and_then(|s2| {
                let (rate, l2, m2) =
                    masked_decode(&on_disk, Some(&s2), mask, timed, &|| s2.counters().ffn_mapped_bytes)?;
                Ok((rate, l2.volatile_bytes as f64 / timed as f64, m2 as f64 / timed as f64))
            });
            dev.set_map_host(map_on);
            let (rate2, copied2, mapped2) = other?;
            if let Some(e) = dev.take_error() {
                return Err(format!("  {name} ({MAP_HOST_ENV} flipped): {e}"));
            }
            other_json = serde_json::json!({"map_host": !map_on, "tok_s": rate2, "mapped_bytes_per_token": mapped2, "copied_bytes_per_token": copied2});
            other_way = format!(
                "; with the cache {}: {rate2:.1} tok/s ({:.3} MB/token read in place, {:.3} MB/token copied)",
                if map_on { "staged, not mapped" } else { "mapped" },
                mapped2 / 1e6,
                copied2 / 1e6
            );
        }
        let copy_s = l.copy_ns as f64 / 1e9 / timed as f64;
        let achieved = if l.copy_ns > 0 {
            l.volatile_bytes as f64 / l.copy_ns as f64
        } else {
            0.0
        };
        let bound = pinned * 1e9 / (per_token + mapped_per_token).max(1.0);
        let staged = l.staged_bytes as f64 / l.volatile_bytes.max(1) as f64;
        let pinned_share = l.pinned_bytes as f64 / l.volatile_bytes.max(1) as f64;
        lines.push(format!(
            "  {name}: {rate:.1} tok/s; {:.3} MB/token read in place by id; {:.3} MB/token copied in {:.0} copies ({:.0}% from \
             page-locked memory, {:.0}% staged), {:.2} ms/token in copies ({achieved:.1} GB/s, {:.0}% of pinned); link bound \
             {bound:.0} tok/s{other_way}{compared}",
            mapped_per_token / 1e6,
            per_token / 1e6,
            l.volatile_copies as f64 / timed as f64,
            pinned_share * 100.0,
            staged * 100.0,
            copy_s * 1e3,
            100.0 * achieved / pinned.max(1e-9)
        ));
        rows.insert(
            name.into(),
            serde_json::json!({"tok_s": rate, "map_host_flipped": other_json, "mapped_bytes_per_token": mapped_per_token, "copied_bytes_per_token": per_token, "staged_fraction": staged, "pinned_fraction": pinned_share, "copy_s_per_token": copy_s, "achieved_gb_s": achieved, "link_bound_tok_s": bound}),
        );
    }
    // The hybrid executor: the rows the GPU does not keep computed by the CPU where they lie
    // (cpu-cold), as the cost model decides (auto), and copied to the GPU (gpu-stream, as the
    // dense row above), in one run: decode and prefill rates, the link's traffic, and the
    // greedy tokens against the model in device memory (judged by the same bar).
    let hybrid_steps = speed_steps(dev, steps);
    let mut hybrid_rows = serde_json::Map::new();
    let mut hybrid_worst = Vec::new();
    // On the emulation, where no time means anything, only the CPU's path (auto and gpu-stream
    // copy rows as the dense run above does).
    let modes = match emulated(dev) {
        true => &[HybridMode::CpuCold][..],
        false => &[HybridMode::CpuCold, HybridMode::Auto, HybridMode::GpuStream][..],
    };
    for &mode in modes {
        let mut s = Streamer::open(&on_disk, &opts(false)).map_err(|e| e.to_string())?;
        let note = s
            .enable_hybrid(&on_disk, mode, 0)
            .map_err(|e| format!("  hybrid {}: {e}", mode.name()))?;
        let plan = s.hybrid_plan().cloned();
        let (mis, w) = compare_greedy(&in_device, &on_disk, Some(&s), &prompt, hybrid_steps)?;
        if let Some(e) = dev.take_error() {
            return Err(format!("  hybrid {}: {e}", mode.name()));
        }
        let prefill = prefill_rate(&on_disk, &s, speed_steps(dev, 32))?;
        // The CPU's cold bytes over the timed steps.
        let (rate, l, cpu_bytes) = masked_decode(&on_disk, Some(&s), None, timed, &|| s.counters().cold_cpu_bytes)?;
        if let Some(e) = dev.take_error() {
            return Err(format!("  hybrid {}: {e}", mode.name()));
        }
        let per = |b: u64| b as f64 / timed as f64;
        lines.push(format!(
            "  hybrid {}: decode {rate:.1} tok/s, prefill {prefill:.1} tok/s; argmax differs at {mis}/{hybrid_steps} \
             steps from in device memory, max |dlogit| = {:.6}% of the range; {:.3} MB/token copied, {:.1} KB/token of \
             activations to the GPU; the CPU computed {:.3} MB/token of cold rows{}{}",
            mode.name(),
            w * 100.0,
            per(l.volatile_bytes) / 1e6,
            per(l.activation_bytes) / 1e3,
            per(cpu_bytes) / 1e6,
            plan.as_ref()
                .map_or(String::new(), |p| format!("\n    {}", p.describe())),
            note.map_or(String::new(), |n| format!("\n    {n}"))
        ));
        hybrid_rows.insert(
            mode.name().into(),
            serde_json::json!({"decode_tok_s": rate, "prefill_tok_s": prefill, "mismatched_steps": mis, "max_dlogit_of_range": w,
                "copied_bytes_per_token": per(l.volatile_bytes), "activation_bytes_per_token": per(l.activation_bytes),
                "cpu_bytes_per_token": per(cpu_bytes), "plan": plan}),
        );
        hybrid_worst.push((mis, w));
    }
    lines.push(format!("  in device memory: {device_rate:.1} tok/s"));
    report.insert(
        key.into(),
        serde_json::json!({"file_bytes": file_bytes, "plan": plan, "mismatched_steps": mismatches, "max_dlogit_of_range": worst, "link": link, "in_device_tok_s": device_rate, "streamed": rows, "hybrid": hybrid_rows,
            "masked_against_in_device": masked_worst.iter().map(|(n, m, w)| serde_json::json!({"mask": n, "mismatched_steps": m, "max_dlogit_of_range": w})).collect::<Vec<_>>()}),
    );
    // The masked comparisons are judged by the same bar (the staged bytes are the same rows).
    let masked_mis: usize =
        masked_worst.iter().map(|m| m.1).sum::<usize>() + hybrid_worst.iter().map(|m| m.0).sum::<usize>();
    let masked_w = masked_worst
        .iter()
        .map(|m| m.2)
        .chain(hybrid_worst.iter().map(|m| m.1))
        .fold(0f64, f64::max);
    judged(mismatches + masked_mis, worst.max(masked_w), 0.0, lines.join("\n"))
}
