//! A device with memory of its own under a GPU budget (`--vram-budget`): what it does not keep
//! copied at each use, or computed by the CPU where it lies (the hybrid executor), against the
//! same model held whole in the device's memory. One body for any such device.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gatestream::backend::Device;
use gatestream::io::{ReadEngine, ReaderOptions};
use gatestream::model::{LoadOptions, Model, Placement};
use gatestream::stream::cache::CachePolicy;
use gatestream::stream::hybrid::HybridMode;
use gatestream::stream::residency::Priority;
use gatestream::stream::{CostSource, Lookahead, StreamOptions, Streamer, RAM_UNLIMITED};

use super::compare_greedy_through;

/// stories260K (F32) as a `.gst` in `dir` (neuron-major rows: the hybrid executor's cold rows
/// lie where the CPU computes them).
pub fn stories_gst(dir: &Path) -> Result<PathBuf, String> {
    let gguf = crate::common::write_temp(
        dir,
        "stories.gguf",
        &crate::common::stories_gguf(crate::common::Breakage::None),
    );
    let gst = dir.join("stories.gst");
    gatestream::reformat::reformat(&gguf, &gst, &Default::default(), &mut |_, _, _| {}).map_err(|e| e.to_string())?;
    Ok(gst)
}

/// `file` (a neuron-major `.gst`, or a mixture of experts' GGUF: its routed experts are what the
/// device does not keep) on `dev` under a GPU budget of `share` of the file, the rest in host RAM:
/// the rows the device does not keep copied at each use (`gpu-stream`), and computed by the CPU (`cpu-cold`,
/// and `auto`, which the cost model measures on this device's link), against the model held
/// whole in the device's memory. Passes when no step's token differs and the logits are within
/// `tol` of the range (the CPU sums a cold row's share in another order than the device).
pub fn gpu_budget_against_whole(dev: Arc<dyn Device>, file: &Path, share: f64, tol: f64) -> Result<String, String> {
    let steps = 16;
    let file_bytes = std::fs::metadata(file).map_err(|e| e.to_string())?.len();
    let whole = Model::load_on(file, &LoadOptions::default(), dev.clone()).map_err(|e| e.to_string())?;
    let on_disk = Model::load_on(
        file,
        &LoadOptions {
            placement: Placement::OnDisk,
            ..LoadOptions::default()
        },
        dev.clone(),
    )
    .map_err(|e| e.to_string())?;
    let vram = (file_bytes as f64 * share) as u64;
    let opts = StreamOptions {
        budget_bytes: RAM_UNLIMITED,
        engine: ReadEngine::Uring,
        reader: ReaderOptions::default(),
        cache: CachePolicy::Pinned,
        priority: Priority::CacheFirst,
        prefetch_ffn: true,
        merge_gap_bytes: None,
        cost: CostSource::Default,
        lookahead: Lookahead::Off,
        kv_positions: 64 + steps,
        batch_tokens_max: 32,
        vram_budget_bytes: Some(vram),
        prefetch_buffers: gatestream::stream::PREFETCH_BUFFERS,
        prefetch_read_bytes: gatestream::stream::PREFETCH_READ_BYTES,
    };
    let prompt: Vec<u32> = (300..324).collect();
    let mut lines = Vec::new();
    let mut failed = false;
    for mode in [HybridMode::GpuStream, HybridMode::CpuCold, HybridMode::Auto] {
        let mut s = Streamer::open(&on_disk, &opts).map_err(|e| format!("{}: {e}", mode.name()))?;
        let plan = s.device_plan.clone().ok_or("no device plan under a GPU budget")?;
        let note = s
            .enable_hybrid(&on_disk, mode, 0)
            .map_err(|e| format!("  hybrid {}: {e}", mode.name()))?;
        let (mismatches, worst) = compare_greedy_through(&whole, &on_disk, Some(&s), &prompt, steps)?;
        if let Some(e) = dev.take_error() {
            return Err(format!("  {}: {e}", mode.name()));
        }
        let cold = s.counters().cold_cpu_bytes;
        // `cpu-cold` must have computed on the CPU, or it checked nothing the plain budget did not.
        let idle_cpu = mode == HybridMode::CpuCold && cold == 0;
        failed |= mismatches > 0 || worst > tol || idle_cpu;
        lines.push(format!(
            "  {}: GPU budget {:.3} of {:.3} MB ({:.3} MB kept); argmax differs at {mismatches}/{steps} steps from the \
             whole model in device memory, max |dlogit| = {:.2e} of the range; the CPU computed {:.3} MB of cold rows{}{}",
            mode.name(),
            vram as f64 / 1e6,
            file_bytes as f64 / 1e6,
            plan.resident_bytes() as f64 / 1e6,
            worst,
            cold as f64 / 1e6,
            if idle_cpu { " (NONE: cpu-cold left the CPU idle)" } else { "" },
            note.map_or(String::new(), |n| format!("; {n}"))
        ));
    }
    let msg = lines.join("\n");
    match failed {
        true => Err(msg),
        false => Ok(msg),
    }
}
