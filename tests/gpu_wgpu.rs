//! THE WGPU SUITE (`cargo test --release --features wgpu --test gpu_wgpu`): the portable GPU
//! device (wgpu: Vulkan, Metal, DX12) against the CPU device. Not a CPU test: where wgpu finds no
//! adapter it says so and runs nothing, and nothing counts as passed (it has its own `main`).
//! CI runs it on Mesa's software Vulkan (lavapipe), which runs the kernels on the CPU: there the
//! checks say what the kernels compute, and nothing about a GPU's speed.
//!
//! Checks (bodies shared with any device: tests/device_checks): every weight type the device
//! multiplies — products of all rows and of row subsets, neuron-major products, embedding rows,
//! one token and batches — against f64 sums; the elementwise ops, norms and moves, RoPE (both
//! styles, norms, partial, factors), cache writes and attention (grouped heads, windows, sinks,
//! two sequences) and argmax against the CPU device; types the device has no kernels for refused
//! at load, naming the type; small models of each architecture the device runs (qwen3, Llama
//! 3.1's RoPE factors, the mixtures of experts: llama, qwen2moe, qwen3moe, olmoe, glm4moe,
//! gpt-oss, and deepseek2's latent attention); then real models — stories260K, SmolLM2-135M
//! (Q4_1), Gemma 3 270M (Q5_0/Q8_0/Q4_K/Q6_K) and Qwen2.5-Coder-1.5B (Q4_K/Q6_K) — with the same
//! greedy tokens as the CPU and perplexity within 0.1% of the CPU's, and each with its matrices
//! decoded to F32 on both devices, within 0.01%. Arguments pick checks by name
//! (`gpu_wgpu kernels stories`). The real models other than stories260K need
//! `tools/fetch-models.sh all`; a missing one fails its check, naming the command. On a software
//! adapter a run without names leaves five of them out and says so (`LONG_ON_SOFTWARE`).

mod common;
mod device_checks;

use std::sync::Arc;

use device_checks::tiny::{synth_deepseek2, synth_model};
use gatestream::backend::wgpu_device::{WgpuDevice, WGPU_TYPES};
use gatestream::backend::Device;
use gatestream::quant::GgmlType;

type Check = fn(&Arc<WgpuDevice>) -> Result<String, String>;

/// Checks a run without names leaves out on a software adapter, saying so; named, they run. The
/// quantized real models are judged against the CPU's own 8-bit activations, where which values
/// f32 rounding moves to the next 8-bit step moves the perplexity by tenths of a percent either
/// way, so they pass or fail the 0.1% bar by chance (docs/WGPU.md, "Measured here"); the two
/// larger models as F32 take minutes on lavapipe (SmolLM2 as F32, half a minute, runs).
const LONG_ON_SOFTWARE: [&str; 5] = [
    "smollm2_wgpu_vs_cpu",
    "gemma3_wgpu_vs_cpu",
    "qwen1.5b_wgpu_vs_cpu",
    "gemma3_f32_wgpu_vs_cpu",
    "qwen1.5b_f32_wgpu_vs_cpu",
];

/// Greedy steps and perplexity windows of the real-model checks: on a software adapter
/// (lavapipe, CI's 2 cores) fewer, so the suite stays within minutes.
fn model_budget(dev: &WgpuDevice, big: bool) -> (usize, (usize, usize)) {
    let software = dev.software();
    match (software, big) {
        (false, _) => (32, (256, 4)),
        (true, false) => (16, (128, 1)),
        (true, true) => (4, (64, 1)),
    }
}

fn wiki_text(chars: usize) -> Result<String, String> {
    let text =
        std::fs::read_to_string(common::data_dir().join("wikitext-2/wiki.test.raw")).map_err(|e| e.to_string())?;
    Ok(text.chars().take(chars).collect())
}

fn real_model(dev: &Arc<WgpuDevice>, name: &str, file: &str, fetch: &str, big: bool) -> Result<String, String> {
    let path = models_dir().join(file);
    if !path.exists() {
        return Err(format!(
            "{}: not found; fetch it with `tools/fetch-models.sh {fetch}`",
            path.display()
        ));
    }
    let (steps, ppl) = model_budget(dev, big);
    device_checks::model_against_cpu(
        name,
        &path,
        dev.clone(),
        "The capital of France is",
        steps,
        &wiki_text(100_000)?,
        ppl,
        None,
    )
}

/// A real model with its matrices decoded to F32 on both devices (see
/// `device_checks::model_f32_against_cpu`): the device's arithmetic against the CPU's exact path,
/// within 0.01% in perplexity.
fn real_model_f32(dev: &Arc<WgpuDevice>, name: &str, file: &str, fetch: &str, ctx: usize) -> Result<String, String> {
    let path = models_dir().join(file);
    if !path.exists() {
        return Err(format!(
            "{}: not found; fetch it with `tools/fetch-models.sh {fetch}`",
            path.display()
        ));
    }
    let (steps, (ctx, windows)) = match dev.software() {
        true => (4, (ctx, 1)),
        false => (32, (256, 4)),
    };
    device_checks::model_f32_against_cpu(
        name,
        &path,
        dev.clone(),
        "The capital of France is",
        steps,
        &wiki_text(100_000)?,
        (ctx, windows),
        1e-4,
    )
}

/// Greedy steps and perplexity window of the small-model checks (random or upcycled weights):
/// fewer on a software adapter.
fn small_budget(dev: &WgpuDevice) -> (usize, (usize, usize)) {
    match dev.software() {
        true => (16, (128, 1)),
        false => (32, (256, 2)),
    }
}

/// A small model of an architecture the device runs beyond the real models', on both devices
/// (see `device_checks::model_against_cpu`): the CPU's greedy tokens, perplexity within 0.1%,
/// and every step's logits within 0.01% of their range of the CPU's. Its matrices are F32
/// (stories260K's, or random ones), so the products multiply the f32 activations on both
/// devices and nothing but the device's operations separates the two.
fn small_model(dev: &Arc<WgpuDevice>, name: &str, prompt: &str, make: SmallModel) -> Result<String, String> {
    small_model_judged(dev, name, prompt, make, Some(1e-4))
}

/// As [`small_model`], the logits judged by `dlogit_bar` (of their range): a quantized model's
/// take [`QUANT_DLOGIT_BAR`].
fn small_model_judged(
    dev: &Arc<WgpuDevice>,
    name: &str,
    prompt: &str,
    make: SmallModel,
    dlogit_bar: Option<f64>,
) -> Result<String, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let path = make(dir.path())?;
    let (steps, ppl) = small_budget(dev);
    let text = wiki_text(100_000)?;
    device_checks::model_against_cpu(name, &path, dev.clone(), prompt, steps, &text, ppl, dlogit_bar)
}

type SmallModel = fn(&std::path::Path) -> Result<std::path::PathBuf, String>;

/// stories260K with Llama 3.1's RoPE frequency factors (`rope_freqs.weight`: factor 8, low
/// and high frequency factors 1 and 4, original context 64, so the factors span 1 to 8).
fn stories_rope_factors(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    let factors = gatestream::config::llama3_rope_factors(8, 10000.0, 8.0, 1.0, 4.0, 64.0);
    let bytes = common::stories_gguf_with(common::Breakage::None, Some(&factors));
    Ok(common::write_temp(dir, "stories-rope-freqs.gguf", &bytes))
}

/// Dense qwen3: per-head Q/K norms before RoPE, no biases.
fn synth_qwen3(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    use gatestream::config::Arch;
    use gatestream::synth::{Mix, Shape};
    synth_model(dir, Shape::custom(Arch::Qwen3, 64, 128, 2, 4, 2, 16), Mix::Q8_0, true)
}

/// glm4moe: a leading dense layer, sigmoid routing with a score bias, a shared expert not
/// gated, Q/K/V biases, half of each head rotated.
fn synth_glm4moe(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    use gatestream::config::Arch;
    use gatestream::synth::{Mix, RoutingShape, Shape};
    let shape = Shape {
        experts: Some((4, 2)),
        rope_dim: Some(8),
        routing: Some(RoutingShape::glm(128)),
        ..Shape::custom(Arch::Glm4Moe, 64, 64, 2, 4, 2, 16)
    };
    synth_model(dir, shape, Mix::Q8_0, true)
}

/// gpt-oss: attention sinks, Q/K/V/O biases, sliding-window layers, routed experts with
/// biases and the clamped SwiGLU (the experts' MXFP4 values decoded to F32).
fn synth_gpt_oss(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    use gatestream::synth::Mix;
    synth_model(dir, gpt_oss_shape(), Mix::Mxfp4Moe, true)
}

/// The gpt-oss of [`synth_gpt_oss`] as gpt-oss is published: its experts MXFP4, every other
/// matrix Q8_0 (both multiply activations in 8-bit blocks of 32).
fn synth_gpt_oss_mxfp4(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    synth_model(dir, gpt_oss_shape(), gatestream::synth::Mix::Mxfp4Moe, false)
}

/// The worst |Δlogit| (of the range) the small quantized models may show. Their products
/// multiply 8-bit activation blocks, where an activation that f32 rounding puts on the other
/// side of a step moves the logits by more than the f32 sums do (a real model: percents), so
/// the bar is wider than the F32 models' 0.01%; on these 2-layer models lavapipe gives 1e-7,
/// and a wrong operation more (sinks' logits off by 0.5: 1%, with the tokens and perplexity
/// still within their bars).
const QUANT_DLOGIT_BAR: f64 = 1e-3;

/// A random dense llama (2 layers of width 256, 4 heads of 64 over 2 KV heads) in each of the
/// quantized mixes whose types only the newer kernels decode — `Q2_K` (Q2_K, Q3_K, Q6_K),
/// `Q3_K_M` (Q3_K, Q4_K, Q5_K, Q6_K), `IQ4_XS` (IQ4_XS, Q6_K) — on both devices: the CPU's
/// greedy tokens, perplexity within 0.1% and logits within [`QUANT_DLOGIT_BAR`].
fn quant_mixes(dev: &Arc<WgpuDevice>) -> Result<String, String> {
    use gatestream::config::Arch;
    use gatestream::synth::{Mix, Shape};
    let (steps, ppl) = small_budget(dev);
    let text = wiki_text(100_000)?;
    let mut lines = Vec::new();
    let mut failed = false;
    for mix in [Mix::Q2K, Mix::Q3KM, Mix::IQ4XS] {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let path = synth_model(
            dir.path(),
            Shape::custom(Arch::Llama, 256, 256, 2, 4, 2, 64),
            mix,
            false,
        )?;
        let name = format!("random llama ({})", mix.name());
        let prompt = "The capital of France is";
        let bar = Some(QUANT_DLOGIT_BAR);
        match device_checks::model_against_cpu(&name, &path, dev.clone(), prompt, steps, &text, ppl, bar) {
            Ok(m) => lines.push(m),
            Err(m) => {
                failed = true;
                lines.push(m)
            }
        }
    }
    match failed {
        false => Ok(lines.join("\n")),
        true => Err(lines.join("\n")),
    }
}

/// 2 layers of width 64, 4 heads of 16 over 2 KV heads, 4 experts of 64, 2 used a token.
fn gpt_oss_shape() -> gatestream::synth::Shape {
    use gatestream::config::Arch;
    use gatestream::synth::Shape;
    Shape {
        experts: Some((4, 2)),
        ..Shape::custom(Arch::GptOss, 64, 64, 2, 4, 2, 16)
    }
}

/// `HostLink::measure_link` (what `bench --device wgpu` prints): a positive rate for each size
/// asked, in order (on a software adapter a memcpy's, no GPU's).
fn link_rates(dev: &Arc<WgpuDevice>) -> Result<String, String> {
    let sizes = [4096, 1 << 20, 16 << 20];
    let rates = gatestream::backend::HostLink::measure_link(dev.as_ref(), &sizes)
        .ok_or("no link measurement")?
        .map_err(|e| e.to_string())?;
    let ok = rates.len() == sizes.len()
        && rates
            .iter()
            .zip(sizes)
            .all(|(r, s)| r.bytes == s && r.pinned_gb_per_s > 0.0 && r.copies >= 4);
    let shown: Vec<String> = rates
        .iter()
        .map(|r| format!("{} B: {:.2} GB/s", r.bytes, r.pinned_gb_per_s))
        .collect();
    match ok {
        true => Ok(format!("host to device through the queue: {}", shown.join(", "))),
        false => Err(format!("rates {shown:?} for sizes {sizes:?}")),
    }
}

/// The binary on SmolLM2: `run --device wgpu` in RAM and streamed under `--ram-budget 60M`
/// (every weight streamed: the device copies the stream's buffers at each use) against
/// `--device cpu`: the same greedy text, which starts " Paris.".
fn smollm2_run_streamed(_dev: &Arc<WgpuDevice>) -> Result<String, String> {
    let model = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.exists() {
        return Err(format!(
            "{}: not found; fetch it with `tools/fetch-models.sh smollm2`",
            model.display()
        ));
    }
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_gatestream"));
    let bin = match std::env::current_exe() {
        Ok(me) if !built.exists() => me.with_file_name("gatestream"),
        _ => built,
    };
    let run = |extra: &[&str]| -> Result<String, String> {
        let out = std::process::Command::new(&bin)
            .args(["run", "--max-tokens", "8", "--model"])
            .arg(&model)
            .args(extra)
            .output()
            .map_err(|e| format!("{}: {e}", bin.display()))?;
        if !out.status.success() {
            return Err(format!(
                "gatestream run {extra:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let cpu = run(&["--device", "cpu"])?;
    let in_ram = run(&["--device", "wgpu"])?;
    let streamed = run(&["--device", "wgpu", "--ram-budget", "60M"])?;
    let msg =
        format!("  8 greedy tokens: cpu {cpu:?}, wgpu {in_ram:?}, wgpu streamed under --ram-budget 60M {streamed:?}");
    match cpu == in_ram && in_ram == streamed && cpu.starts_with(" Paris.") {
        true => Ok(msg),
        false => Err(msg),
    }
}

fn models_dir() -> std::path::PathBuf {
    std::env::var_os("GATESTREAM_MODELS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/gatestream/models")
        })
}

/// Runs `body` with the device's products set each way `modes` lists (packed 8-bit or f32; one
/// thread or one workgroup a row, or `None`: as the body sets it), each result under its
/// heading; the device's own settings are put back after.
fn in_modes(
    d: &WgpuDevice,
    modes: &[(bool, Option<bool>)],
    body: impl Fn() -> Result<String, String>,
) -> Result<String, String> {
    let own = (d.packed_dots(), d.row_per_thread());
    let mut out = Vec::new();
    let mut ok = true;
    for &(packed, per_thread) in modes {
        d.set_packed_dots(packed);
        d.set_row_per_thread(per_thread.unwrap_or(own.1));
        let what = format!(
            "[{} products{}]",
            match d.packed_dots() {
                true => "packed 8-bit",
                false => "f32",
            },
            match per_thread {
                Some(true) => ", one thread a row",
                Some(false) => ", one workgroup a row",
                None => "",
            }
        );
        let r = body();
        ok = r.is_ok();
        out.push(format!("  {what}\n{}", r.unwrap_or_else(|e| e)));
        if !ok {
            break;
        }
    }
    d.set_packed_dots(own.0);
    d.set_row_per_thread(own.1);
    match ok {
        true => Ok(out.join("\n")),
        false => Err(out.join("\n")),
    }
}

/// Every way the device multiplies: packed 8-bit and f32 products, each one thread and one
/// workgroup a row.
const ALL_MODES: [(bool, Option<bool>); 4] = [
    (true, Some(false)),
    (true, Some(true)),
    (false, Some(false)),
    (false, Some(true)),
];

/// The widest rows one thread takes (IQ4_XS: the most loop steps a chunk of the packed
/// products; Q5_K, Q3_K), one token and a tile of 8, against the CPU: on lavapipe, whose loop
/// budget a thread past it would overrun without an error, this checks the device's count of a
/// thread's loops is an upper bound.
fn widest_thread_rows(dev: &Arc<WgpuDevice>) -> Result<String, String> {
    use device_checks::{quantized, rel_err, Rng};
    let cpu = gatestream::backend::cpu::CpuBackend::new(1);
    let mut rng = Rng(23);
    let mut worst = 0f64;
    let mut widths = Vec::new();
    for n in [1, 8] {
        let cols = dev.widest_thread_row(n);
        widths.push(format!("{cols} columns for {n} token{}", if n == 1 { "" } else { "s" }));
        for ty in [GgmlType::IQ4_XS, GgmlType::Q5_K, GgmlType::Q3_K] {
            let w = quantized(ty, 64, cols, &mut rng);
            let x = rng.values(n * cols);
            let got = dev.download(dev.matmul(&[&w], &dev.upload(n, cols, x.clone())).remove(0));
            let want = cpu.download(cpu.matmul(&[&w], &cpu.upload(n, cols, x)).remove(0));
            let e = rel_err(&got, &want);
            if e > 1e-4 {
                return Err(format!(
                    "  {} 64 x {cols}, {n} tokens: {e:.2e} against the CPU (bar 1e-4)",
                    ty.name()
                ));
            }
            worst = worst.max(e);
        }
    }
    Ok(format!(
        "  IQ4_XS, Q5_K, Q3_K at the widest rows a thread takes ({}): worst {worst:.2e} against the CPU (bar 1e-4)",
        widths.join(", ")
    ))
}

/// The two product kernels (one workgroup a row, one thread a row) sum in the same order: the
/// same bits for every type, one token and a batch, all rows and listed rows; packed 8-bit
/// products and f32 ones each.
fn kernels_agree(dev: &Arc<WgpuDevice>) -> Result<String, String> {
    in_modes(dev, &[(true, None), (false, None)], || kernels_agree_now(dev))
}

fn kernels_agree_now(dev: &Arc<WgpuDevice>) -> Result<String, String> {
    use device_checks::{quantized, Rng};
    let mut rng = Rng(17);
    let default = dev.row_per_thread();
    let mut differ = Vec::new();
    for ty in WGPU_TYPES {
        let cols = ty.block_elems().max(32) * 3 * if ty.block_elems() == 1 { 8 } else { 1 };
        let w = quantized(ty, 67, cols, &mut rng);
        for n in [1, 19] {
            let xa = dev.upload(n, cols, rng.values(n * cols));
            let mut got = Vec::new();
            for per_thread in [false, true] {
                dev.set_row_per_thread(per_thread);
                let all = dev.download(dev.matmul(&[&w], &xa).remove(0));
                let listed = dev.download(dev.matmul_rows(&w, &[66, 0, 31, 31], &xa));
                got.push((all, listed));
            }
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            if bits(&got[0].0) != bits(&got[1].0) || bits(&got[0].1) != bits(&got[1].1) {
                differ.push(format!("{} ({n} tokens)", ty.name()));
            }
        }
    }
    dev.set_row_per_thread(default);
    match differ.is_empty() {
        true => Ok(format!(
            "  both product kernels give the same bits: {} types, 1 and 19 tokens, all and listed rows",
            WGPU_TYPES.len()
        )),
        false => Err(format!("  the product kernels differ: {}", differ.join(", "))),
    }
}

/// A weight larger than the adapter binds at once (Gemma's and Qwen's embeddings on lavapipe)
/// is held in several buffers of whole rows: its products (all rows, one token and a batch, both
/// kernels) are those of the weight in one buffer bit for bit, its neuron-major products within
/// 1e-6 (each buffer's sum is added on its own), and a product of listed rows is refused naming
/// the tensor. Checked on small weights by lowering the limit.
fn split_weights(dev: &Arc<WgpuDevice>) -> Result<String, String> {
    use device_checks::{quantized, rel_err, Rng};
    let mut rng = Rng(5);
    let mut worst = 0f64;
    let default = dev.row_per_thread();
    for (ty, rows, part_rows) in [
        (GgmlType::Q4_K, 67, 5),
        (GgmlType::Q8_0, 67, 5),
        (GgmlType::F16, 67, 5),
        (GgmlType::Q6_K, 300, 130),
    ] {
        let cols = 512;
        for per_thread in [false, true] {
            dev.set_row_per_thread(per_thread);
            for n in [1, 11] {
                // Each case its own weight (weights are kept by address once copied).
                let w = quantized(ty, rows, cols, &mut rng);
                let x = rng.values(n * cols);
                let acts = rng.values(n * rows);
                let whole = {
                    dev.set_max_binding(None);
                    let xa = dev.upload(n, cols, x.clone());
                    let aa = dev.upload(n, rows, acts.clone());
                    let mut out = dev.zeros(n, cols);
                    dev.accumulate_rows(&w, None, &aa, &mut out);
                    let p = dev.download(dev.matmul(&[&w], &xa).remove(0));
                    (p, dev.download(out))
                };
                let w2 =
                    gatestream::tensor::Weight::owned(&w.name, w.ty, w.rows, w.cols, w.rows_bytes(0, w.rows).to_vec())
                        .map_err(|e| e.to_string())?;
                dev.set_max_binding(Some(part_rows * w.row_bytes as u64 + 3));
                let xa = dev.upload(n, cols, x.clone());
                let aa = dev.upload(n, rows, acts.clone());
                let mut out = dev.zeros(n, cols);
                dev.accumulate_rows(&w2, None, &aa, &mut out);
                let split = (dev.download(dev.matmul(&[&w2], &xa).remove(0)), dev.download(out));
                let _ = dev.matmul_rows(&w2, &[3, 1], &xa);
                let refused = dev.take_error().map(|e| e.to_string()).unwrap_or_default();
                dev.set_max_binding(None);
                if !refused.contains(&w.name) || !refused.contains("buffers") {
                    dev.set_row_per_thread(default);
                    return Err(format!(
                        "{}: listed rows of a split weight not refused: {refused:?}",
                        ty.name()
                    ));
                }
                if split.0.iter().zip(&whole.0).any(|(a, b)| a.to_bits() != b.to_bits()) {
                    dev.set_row_per_thread(default);
                    return Err(format!("{}: the split product differs from the whole one", ty.name()));
                }
                worst = worst.max(rel_err(&split.1, &whole.1));
            }
        }
    }
    dev.set_row_per_thread(default);
    let msg = format!(
        "  weights in buffers of 5 rows (Q4_K, Q8_0, F16; 67 x 512) and 130 rows (Q6_K, 300 x 512); 1 and 11 tokens; both kernels): products the \
         weight's in one buffer bit for bit, neuron-major products within {worst:.2e} of it (bar 1e-6); listed \
         rows refused"
    );
    match worst <= 1e-6 {
        true => Ok(msg),
        false => Err(msg),
    }
}

/// A model holding a type the device has no kernels for is refused at load, naming the type.
fn refused_types(dev: &Arc<WgpuDevice>) -> Result<String, String> {
    let missing: Vec<GgmlType> = GgmlType::ALL.into_iter().filter(|t| !WGPU_TYPES.contains(t)).collect();
    let mut seen = Vec::new();
    for ty in missing {
        // A product asked directly records an error naming the type and the tensor (zero
        // blocks: the bytes are never read).
        let cols = ty.block_elems().max(32);
        let bytes = vec![0u8; ty.row_bytes(cols).expect("row")];
        let w =
            gatestream::tensor::Weight::owned("blk.0.ffn_up.weight", ty, 1, cols, bytes).map_err(|e| e.to_string())?;
        let x = dev.upload(1, cols, vec![1.0; cols]);
        let _ = dev.matmul(&[&w], &x);
        let e = dev.take_error().map(|e| e.to_string()).unwrap_or_default();
        if dev.computes_type(ty) || !e.contains(ty.name()) || !e.contains("blk.0.ffn_up.weight") {
            return Err(format!("{}: not refused as it should be (error: {e:?})", ty.name()));
        }
        seen.push(ty.name());
    }
    Ok(format!("  refused, naming the type and tensor: {}", seen.join(", ")))
}

fn main() {
    let dev = match WgpuDevice::open() {
        Ok(d) => Arc::new(d),
        Err(e) => {
            println!("gpu_wgpu: NO WGPU SUITE RUN — {e}. 0 wgpu checks ran; none passed.");
            return;
        }
    };
    println!("gpu_wgpu: {}", dev.name());
    if dev.software() {
        println!(
            "gpu_wgpu: a software adapter (the kernels run on the CPU): its results are checked, its speed is no GPU's"
        );
    }
    let checks: [(&str, Check); 35] = [
        // Both product kernels (one workgroup a row, one thread a row), whichever the adapter
        // takes by default.
        // Packed 8-bit products on both kernels; f32 ones on the kernel the adapter takes
        // (`kernels_agree` holds the other to its bits).
        ("kernels_per_type", |d| {
            in_modes(d, &[(true, Some(false)), (true, Some(true)), (false, None)], || {
                device_checks::products_per_type(d.as_ref(), &WGPU_TYPES, 1e-4)
            })
        }),
        // Rows wider than one thread's loops reach on lavapipe (Qwen2.5-1.5B's FFN), every way.
        ("kernels_wide_rows", |d| {
            in_modes(d, &ALL_MODES, || {
                device_checks::wide_products_against_cpu(d.as_ref(), 1e-4)
            })
        }),
        ("kernels_widest_thread_rows", |d| {
            in_modes(d, &[(true, Some(true)), (false, Some(true))], || widest_thread_rows(d))
        }),
        ("kernels_elementwise", |d| {
            device_checks::elementwise_against_cpu(d.as_ref(), 1e-5)
        }),
        ("kernels_rope_attention", |d| {
            device_checks::rope_attention_against_cpu(d.as_ref(), 1e-4)
        }),
        ("kernels_attention_split", |d| {
            // Spans past 64 positions split over workgroups, then joined: the same bar.
            d.set_attention_chunk(Some(64));
            let r = device_checks::rope_attention_against_cpu(d.as_ref(), 1e-4).and_then(|a| {
                device_checks::long::long_attention_against_cpu(d.as_ref(), 300, 64, 1e-4).map(|b| format!("{a}\n{b}"))
            });
            d.set_attention_chunk(None);
            r.map(|m| format!("  (split every 64 positions)\n{m}"))
        }),
        ("attention_long_context", |d| {
            // Heads of 128 past lavapipe's one-thread budget, and DeepSeek's latent heads of 576,
            // as any heads and as a latent cache (the values read from the keys).
            let a = device_checks::long::long_attention_against_cpu(d.as_ref(), 7000, 128, 1e-4)?;
            let b = device_checks::long::long_attention_against_cpu(d.as_ref(), 1500, 576, 1e-4)?;
            let c = device_checks::long::latent_attention_against_cpu(d.as_ref(), 1500, 576, 1e-4)?;
            Ok(format!("{a}\n{b}\n{c}"))
        }),
        ("kernels_argmax", |d| device_checks::argmax_against_host(d.as_ref())),
        ("kernels_top_k", |d| {
            device_checks::long::top_k_against_cpu(d.as_ref(), 1e-5)
        }),
        ("kernels_split_weights", split_weights),
        ("kernels_agree", kernels_agree),
        ("refused_types", refused_types),
        ("stories260k_wgpu_vs_cpu", |d| {
            let (steps, ppl) = model_budget(d, false);
            device_checks::model_against_cpu(
                "stories260K",
                &common::stories_dir(),
                d.clone(),
                "Once upon a time",
                steps.max(32),
                &wiki_text(200_000)?,
                (256, ppl.1.max(2)),
                None,
            )
        }),
        ("stories260k_gpu_budget", |d| {
            let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            let gst = device_checks::budget::stories_gst(dir.path())?;
            device_checks::budget::gpu_budget_against_whole(d.clone(), &gst, 0.5, 1e-4)
        }),
        ("llama31_rope_factors_wgpu_vs_cpu", |d| {
            small_model(
                d,
                "stories260K, Llama 3.1 RoPE factors",
                "Once upon a time",
                stories_rope_factors,
            )
        }),
        ("qwen3_wgpu_vs_cpu", |d| {
            small_model(d, "random qwen3 (F32)", "The capital of France is", synth_qwen3)
        }),
        ("moe_llama_wgpu_vs_cpu", |d| {
            small_model(d, "stories260K, 6 experts (llama)", "Once upon a time", |p| {
                common::stories_moe(p, gatestream::config::Arch::Llama)
            })
        }),
        ("moe_qwen2moe_wgpu_vs_cpu", |d| {
            small_model(d, "stories260K, 6 experts (qwen2moe)", "Once upon a time", |p| {
                common::stories_moe(p, gatestream::config::Arch::Qwen2Moe)
            })
        }),
        ("moe_qwen3moe_wgpu_vs_cpu", |d| {
            small_model(d, "stories260K, 6 experts (qwen3moe)", "Once upon a time", |p| {
                common::stories_moe(p, gatestream::config::Arch::Qwen3Moe)
            })
        }),
        ("moe_olmoe_wgpu_vs_cpu", |d| {
            small_model(d, "stories260K, 6 experts (olmoe)", "Once upon a time", |p| {
                common::stories_moe(p, gatestream::config::Arch::Olmoe)
            })
        }),
        ("moe_glm4moe_wgpu_vs_cpu", |d| {
            small_model(d, "random glm4moe (F32)", "The capital of France is", synth_glm4moe)
        }),
        ("moe_gpt_oss_wgpu_vs_cpu", |d| {
            small_model(d, "random gpt-oss (F32)", "The capital of France is", synth_gpt_oss)
        }),
        ("moe_gpt_oss_mxfp4_wgpu_vs_cpu", |d| {
            small_model_judged(
                d,
                "random gpt-oss (MXFP4 experts, Q8_0)",
                "The capital of France is",
                synth_gpt_oss_mxfp4,
                Some(QUANT_DLOGIT_BAR),
            )
        }),
        ("quant_mixes_wgpu_vs_cpu", quant_mixes),
        ("moe_qwen3moe_gpu_budget", |d| {
            // The routed experts copied at each use, or computed by the CPU where they lie.
            let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
            let gguf = common::stories_moe(dir.path(), gatestream::config::Arch::Qwen3Moe)?;
            device_checks::budget::gpu_budget_against_whole(d.clone(), &gguf, 0.5, 1e-4)
        }),
        ("smollm2_run_streamed", smollm2_run_streamed),
        ("smollm2_wgpu_vs_cpu", |d| {
            real_model(
                d,
                "SmolLM2-135M (Q4_1)",
                "SmolLM2-135M-Instruct.Q4_1.gguf",
                "smollm2",
                false,
            )
        }),
        ("deepseek2_wgpu_vs_cpu", |d| {
            small_model(
                d,
                "random deepseek2 (F32, latent attention)",
                "The capital of France is",
                |p| synth_deepseek2(p, false),
            )
        }),
        ("moe_deepseek2_wgpu_vs_cpu", |d| {
            small_model(
                d,
                "random deepseek2 (F32, latent attention, V3 routing)",
                "The capital of France is",
                |p| synth_deepseek2(p, true),
            )
        }),
        ("link_rates", link_rates),
        ("gemma3_wgpu_vs_cpu", |d| {
            real_model(d, "Gemma 3 270M (Q4_K_M)", "gemma-3-270m-q4_k_m.gguf", "gemma3", false)
        }),
        ("qwen1.5b_wgpu_vs_cpu", |d| {
            real_model(
                d,
                "Qwen2.5-Coder-1.5B (Q4_K_M)",
                "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                "qwen1.5b",
                true,
            )
        }),
        ("smollm2_f32_wgpu_vs_cpu", |d| {
            real_model_f32(d, "SmolLM2-135M", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2", 128)
        }),
        ("gemma3_f32_wgpu_vs_cpu", |d| {
            real_model_f32(d, "Gemma 3 270M", "gemma-3-270m-q4_k_m.gguf", "gemma3", 128)
        }),
        ("qwen1.5b_f32_wgpu_vs_cpu", |d| {
            real_model_f32(
                d,
                "Qwen2.5-Coder-1.5B",
                "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                "qwen1.5b",
                32,
            )
        }),
    ];
    let only: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    if let Some(o) = only
        .iter()
        .find(|o| !checks.iter().any(|(n, _)| n.contains(o.as_str())))
    {
        println!("gpu_wgpu: no check is named like {o:?}");
        std::process::exit(2);
    }
    let (mut ran, mut failed, mut not_run) = (0, Vec::new(), Vec::new());
    for (name, check) in checks {
        let named = only.iter().any(|o| name.contains(o.as_str()));
        if !only.is_empty() && !named {
            continue;
        }
        // The larger real models take minutes each on a software adapter: run when named.
        if dev.software() && LONG_ON_SOFTWARE.contains(&name) && !named {
            not_run.push(name);
            continue;
        }
        ran += 1;
        let t0 = std::time::Instant::now();
        let r = check(&dev).and_then(|msg| match dev.take_error() {
            Some(e) => Err(format!("{msg}\n  device error: {e}")),
            None => Ok(msg),
        });
        let secs = t0.elapsed().as_secs_f64();
        match r {
            Ok(msg) => println!("ok   {name} ({secs:.1} s)\n{msg}"),
            Err(msg) => {
                println!("FAIL {name} ({secs:.1} s)\n{msg}");
                failed.push(name);
            }
        }
    }
    println!(
        "gpu_wgpu: {ran} checks ran, {} passed, {} failed{}",
        ran - failed.len(),
        failed.len(),
        match failed.is_empty() {
            true => String::new(),
            false => format!(": {}", failed.join(", ")),
        }
    );
    if !not_run.is_empty() {
        println!(
            "gpu_wgpu: NOT RUN on this software adapter (the quantized models judged against the CPU's 8-bit activations, the larger F32 ones minutes each: docs/WGPU.md; name them to run them): {}",
            not_run.join(", ")
        );
    }
    if !failed.is_empty() {
        std::process::exit(1);
    }
}
