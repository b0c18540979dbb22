//! The hybrid executor's host side (`--hybrid`): under a GPU budget, what the device does not
//! keep is computed by the host's CPU where it lies, and only activations cross the link. A
//! dense model: the FFN rows past the device's hot neurons, from the stream's neuron caches
//! (each holding its whole layer in host memory); the layer's input and gate go to the host,
//! the CPU's f64 down sums come back (`hidden` values a token) and the device finishes them with
//! its own (`model::ffn`'s hybrid step). A mixture of experts: every routed expert, as the
//! stream hands it over in host memory (cached, or read on a miss), its output rows sent to the
//! device, which computes attention, routers and shared experts meanwhile. Which passes do so is
//! decided once, at open, from a cost model measured there: the CPU's time for one layer's share
//! at one token and at [`MEASURE_WIDTH`] tokens (a line through the two), against the link's time
//! to copy those bytes (its pinned bandwidth, measured by the device). Passes of up to
//! [`HybridPlan::max_width`] tokens — decode, narrow batches — compute on the CPU; wider ones (a
//! prompt's batches) copy the bytes to the device as the plain `--vram-budget` path does. The
//! GPU's own time for its share is not in the model: both sides are compared on the CPU's
//! share alone.

use std::time::Instant;

use crate::backend::cpu::CpuBackend;
use crate::backend::HostLink;
use crate::config::FfnActivation;
use crate::error::{Error, Result};
use crate::model::ffn::{cold_ffn, host_ffn};
use crate::model::weights::FfnWeights;
use crate::tensor::Weight;

/// Tokens of the second CPU measurement (the first takes one).
pub const MEASURE_WIDTH: usize = 8;

/// The link bandwidth assumed where the device measures none (the host stand-in): PCIe 4.0
/// x16's practical rate.
pub const ASSUMED_LINK_GB_PER_S: f64 = 25.0;

/// Copy size the link is measured at: about one large layer's cold rows.
const LINK_PROBE_BYTES: usize = 16 << 20;

/// What `--hybrid` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum HybridMode {
    /// The cost model decides per pass width (the default).
    Auto,
    /// No CPU compute: every row the device does not keep is copied to it (as `GpuStream`).
    Off,
    /// Every pass computes the cold rows on the CPU, whatever its width.
    CpuCold,
    /// Every pass copies the cold rows to the device (today's `--vram-budget`).
    GpuStream,
}

impl HybridMode {
    pub fn name(&self) -> &'static str {
        match self {
            HybridMode::Auto => "auto",
            HybridMode::Off => "off",
            HybridMode::CpuCold => "cpu-cold",
            HybridMode::GpuStream => "gpu-stream",
        }
    }
}

/// The cost model measured at open, and what it decided (printed at start, in `--json`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct HybridPlan {
    pub mode: HybridMode,
    /// What the CPU computes: "cold FFN rows" (a dense model: the neurons the GPU does not
    /// keep) or "routed experts" (a mixture of experts: every routed expert; the GPU keeps
    /// attention, routers and shared experts).
    pub what: String,
    /// CPU threads computing cold rows.
    pub threads: usize,
    /// What the CPU computes per layer and token, bytes: cold rows (up and down, averaged over
    /// the layers), or the routed experts of one token (experts used x one expert's bytes).
    pub cold_bytes_per_layer: f64,
    /// The CPU's time for one layer's share: one token, and each token after it.
    pub cpu_s_one_token: f64,
    pub cpu_s_per_extra_token: f64,
    /// The CPU's rate at one token, GB/s of cold rows.
    pub cpu_gb_per_s: f64,
    /// The link's pinned copy rate, GB/s, and whether the device measured it (else
    /// [`ASSUMED_LINK_GB_PER_S`]).
    pub link_gb_per_s: f64,
    pub link_measured: bool,
    /// The link's time to copy one layer's cold rows.
    pub link_s: f64,
    /// Passes of at most this many tokens compute cold rows on the CPU (0: none).
    pub max_width: usize,
}

impl HybridPlan {
    /// The plan as a line for the user.
    pub fn describe(&self) -> String {
        let ms = |s: f64| s * 1e3;
        let width = match self.max_width {
            0 => "no pass computes them on the CPU: every pass copies them to the device".to_string(),
            usize::MAX => "every pass computes them on the CPU".to_string(),
            w => format!(
                "passes of up to {w} token{} compute them on the CPU, wider ones copy them to the device",
                if w == 1 { "" } else { "s" }
            ),
        };
        format!(
            "hybrid ({}): {} {:.1} MB a layer and token; the CPU ({} threads) computes them in {:.2} ms \
             for 1 token ({:.1} GB/s) + {:.3} ms per further token; the link copies them in {:.2} ms ({:.1} GB/s \
             pinned, {}); {width}",
            self.mode.name(),
            self.what,
            self.cold_bytes_per_layer / 1e6,
            self.threads,
            ms(self.cpu_s_one_token),
            self.cpu_gb_per_s,
            ms(self.cpu_s_per_extra_token),
            ms(self.link_s),
            self.link_gb_per_s,
            if self.link_measured {
                "measured"
            } else {
                "assumed: the device measures no link"
            }
        )
    }
}

/// The widest pass for which the CPU's time `one + extra · (n - 1)` stays within `link`
/// (0 when even one token takes longer; `cap` when every width up to it does).
pub fn crossover(one: f64, extra: f64, link: f64, cap: usize) -> usize {
    if one > link {
        return 0;
    }
    if extra <= 0.0 {
        return cap;
    }
    let n = 1.0 + ((link - one) / extra).floor();
    if n >= cap as f64 {
        cap
    } else {
        n as usize
    }
}

/// What the cost model times on the CPU at open: one layer's cold rows (up rows and down
/// columns, neuron-major), or one expert (gate, up and down rows).
pub enum Probe<'a> {
    Cold(&'a Weight, &'a Weight),
    Expert(&'a FfnWeights, FfnActivation),
}

impl Probe<'_> {
    fn bytes(&self) -> usize {
        match self {
            Probe::Cold(u, d) => u.len_bytes() + d.len_bytes(),
            Probe::Expert(f, _) => f.gate.len_bytes() + f.up.len_bytes() + f.down.weight().len_bytes(),
        }
    }
}

/// The host side of the hybrid executor: the CPU, each layer's cold rows (views of the caches'
/// bytes, which a cache holding its whole layer never rewrites; none for a mixture of
/// experts, whose experts the stream hands over) and the plan.
pub struct Hybrid {
    cpu: CpuBackend,
    /// Per layer: the hot neurons the device keeps, and the host's rows after them when the
    /// stream holds them all in place (else they are staged at each step).
    cold: Vec<(usize, Option<(Weight, Weight)>)>,
    pub plan: HybridPlan,
}

impl Hybrid {
    /// Measures the cost model on `probe` (scaled to `bytes_per_layer`, what a layer gives the
    /// CPU per token) and `link`, and decides for `mode` (never `Off` or `GpuStream`: those
    /// open no hybrid). `cap`: the most tokens a pass takes.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        mode: HybridMode,
        threads: usize,
        cold: Vec<(usize, Option<(Weight, Weight)>)>,
        what: &str,
        bytes_per_layer: f64,
        probe: Probe,
        link: &dyn HostLink,
        cap: usize,
    ) -> Result<Hybrid> {
        let cpu = CpuBackend::new(threads);
        let width = match &probe {
            Probe::Cold(u, _) => u.cols,
            Probe::Expert(f, _) => f.gate.cols,
        };
        // Best of a few runs at each width, on a deterministic input.
        let time = |n: usize, runs: usize| -> f64 {
            let x: Vec<f32> = (0..n * width)
                .map(|i| ((i * 7919) % 1999) as f32 / 1999.0 - 0.5)
                .collect();
            (0..runs)
                .map(|_| {
                    let t = Instant::now();
                    match &probe {
                        Probe::Cold(up, down) => {
                            let g: Vec<f32> = (0..n * up.rows).map(|i| ((i * 104729) % 997) as f32 / 997.0).collect();
                            std::hint::black_box(cold_ffn(&cpu, up, down, None, x.clone(), g, n));
                        }
                        Probe::Expert(f, act) => {
                            std::hint::black_box(host_ffn(&cpu, f, x.clone(), n, *act));
                        }
                    }
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        let probe_bytes = probe.bytes() as f64;
        if probe_bytes == 0.0 || bytes_per_layer == 0.0 {
            return Err(Error::Input(
                "the hybrid executor found nothing for the CPU to compute".into(),
            ));
        }
        let one = time(1, 3);
        let wide = time(MEASURE_WIDTH, 2);
        let extra = ((wide - one) / (MEASURE_WIDTH - 1) as f64).max(0.0);
        // Scaled from the probe to a layer's share.
        let scale = bytes_per_layer / probe_bytes;
        let (one, extra) = (one * scale, extra * scale);
        let measured = match link.measure_link(&[LINK_PROBE_BYTES]) {
            Some(r) => r?.first().map(|b| b.pinned_gb_per_s).filter(|&g| g > 0.0),
            None => None,
        };
        let link_gb_per_s = measured.unwrap_or(ASSUMED_LINK_GB_PER_S);
        let link_s = bytes_per_layer / (link_gb_per_s * 1e9);
        let max_width = match mode {
            HybridMode::CpuCold => usize::MAX,
            HybridMode::Auto => crossover(one, extra, link_s, cap.max(1)),
            HybridMode::Off | HybridMode::GpuStream => 0,
        };
        let plan = HybridPlan {
            mode,
            what: what.to_string(),
            threads: cpu.threads(),
            cold_bytes_per_layer: bytes_per_layer,
            cpu_s_one_token: one,
            cpu_s_per_extra_token: extra,
            cpu_gb_per_s: bytes_per_layer / one.max(1e-12) / 1e9,
            link_gb_per_s,
            link_measured: measured.is_some(),
            link_s,
            max_width,
        };
        Ok(Hybrid { cpu, cold, plan })
    }

    /// Layer `l`'s cold rows for a pass of `n` tokens, when the plan gives it to the CPU.
    pub fn rows(&self, l: usize, n: usize) -> Option<crate::model::forward::ColdRows<'_>> {
        let (first, rows) = self.cold.get(l)?;
        Some(crate::model::forward::ColdRows {
            first: *first,
            rows: rows.as_ref().map(|(u, d)| (u, d)),
            cpu: self.cpu_for(n)?,
        })
    }

    /// The CPU, for a pass of `n` tokens the plan gives it.
    pub fn cpu_for(&self, n: usize) -> Option<&CpuBackend> {
        (n <= self.plan.max_width).then_some(&self.cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::crossover;

    #[test]
    fn the_crossover_is_the_widest_pass_the_cpu_finishes_within_the_link_time() {
        // 1 ms for one token, 0.25 ms per further one, 2 ms on the link: 1 + 4 · 0.25 = 2.
        assert_eq!(crossover(1e-3, 0.25e-3, 2e-3, 64), 5);
        assert_eq!(crossover(1e-3, 0.25e-3, 1.9e-3, 64), 4);
        // Slower than the link at one token: never.
        assert_eq!(crossover(3e-3, 0.0, 2e-3, 64), 0);
        // No cost per token: up to the widest pass.
        assert_eq!(crossover(1e-3, 0.0, 2e-3, 64), 64);
        assert_eq!(crossover(1e-3, 1e-9, 2e-3, 32), 32);
        // Exactly the link's time at one token still counts.
        assert_eq!(crossover(2e-3, 1e-3, 2e-3, 64), 1);
    }
}
