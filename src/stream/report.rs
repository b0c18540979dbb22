//! What a streamer counted, and the end-of-run figures of a streamed generation.

use super::plan::CostModel;
use super::residency::Residency;
use super::Streamer;
use crate::io::ReadEngine;

/// Counters since the streamer was opened (see [`Streamer::counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Counters {
    /// Forward passes (prefill batches and decode steps).
    pub passes: u64,
    /// FFN neurons the passes needed (up or down part), and how many the cache served.
    pub cache_lookups: u64,
    pub cache_hits: u64,
    /// Bytes of FFN rows read from disk, and what the plan transferred (merged gaps and
    /// alignment included), in how many reads.
    pub ffn_needed_bytes: u64,
    pub ffn_device_bytes: u64,
    pub ffn_reads: u64,
    /// Bytes of streamed dense parts (attention, gate, embedding rows) asked for.
    pub dense_needed_bytes: u64,
    /// Time the compute thread waited for reads, nanoseconds.
    pub io_wait_ns: u64,
    /// Lookahead: neurons predicted and read ahead, and how many of them the layer then used
    /// (their rows' bytes too). The rest were read in vain.
    pub ahead_neurons: u64,
    pub ahead_used_neurons: u64,
    pub ahead_bytes: u64,
    pub ahead_used_bytes: u64,
    /// FFN bytes the layers took from lookahead reads: predicted rows and rows the reads
    /// covered by reading through gaps (part of `ffn_needed_bytes`).
    pub ahead_served_bytes: u64,
    /// FFN bytes handed to the compute in place, not copied into staging: views of the neuron
    /// cache (a set held in consecutive slots: a dense step over a cache holding the layer; a
    /// device copies the view at its use), of the prefetch buffer (a dense step's rows read with
    /// the layer, the pinned cache's copied in front of them), or rows a device reads by id from
    /// the cache it mapped (`ffn_mapped_bytes`).
    pub ffn_in_place_bytes: u64,
    /// Of those, the rows a device's products read by id across the link from the mapped cache
    /// (a masked decode step's up rows and kept down columns): moved, but never copied.
    pub ffn_mapped_bytes: u64,
    /// FFN bytes the device computed from its own copy of the hot neurons (`--vram-budget`'s
    /// plan): neither read, staged nor moved across the link.
    pub ffn_hot_bytes: u64,
    /// The hybrid executor: bytes of weights the CPU computed with (cold FFN rows or routed
    /// experts, each read once a pass, whatever its width), its time in them (nanoseconds), and
    /// the layers it computed for.
    pub cold_cpu_bytes: u64,
    pub cold_cpu_ns: u64,
    pub cold_cpu_layers: u64,
}

impl Counters {
    pub fn minus(&self, o: &Counters) -> Counters {
        Counters {
            passes: self.passes - o.passes,
            cache_lookups: self.cache_lookups - o.cache_lookups,
            cache_hits: self.cache_hits - o.cache_hits,
            ffn_needed_bytes: self.ffn_needed_bytes - o.ffn_needed_bytes,
            ffn_device_bytes: self.ffn_device_bytes - o.ffn_device_bytes,
            ffn_reads: self.ffn_reads - o.ffn_reads,
            dense_needed_bytes: self.dense_needed_bytes - o.dense_needed_bytes,
            io_wait_ns: self.io_wait_ns - o.io_wait_ns,
            ahead_neurons: self.ahead_neurons - o.ahead_neurons,
            ahead_used_neurons: self.ahead_used_neurons - o.ahead_used_neurons,
            ahead_bytes: self.ahead_bytes - o.ahead_bytes,
            ahead_used_bytes: self.ahead_used_bytes - o.ahead_used_bytes,
            ahead_served_bytes: self.ahead_served_bytes - o.ahead_served_bytes,
            ffn_in_place_bytes: self.ffn_in_place_bytes - o.ffn_in_place_bytes,
            ffn_mapped_bytes: self.ffn_mapped_bytes - o.ffn_mapped_bytes,
            ffn_hot_bytes: self.ffn_hot_bytes - o.ffn_hot_bytes,
            cold_cpu_bytes: self.cold_cpu_bytes - o.cold_cpu_bytes,
            cold_cpu_ns: self.cold_cpu_ns - o.cold_cpu_ns,
            cold_cpu_layers: self.cold_cpu_layers - o.cold_cpu_layers,
        }
    }
}

/// Peak resident set size of this process (VmHWM), bytes; 0 where /proc is unavailable.
pub fn peak_rss_bytes() -> u64 {
    status_bytes("VmHWM:")
}

/// Resident set size of this process now (VmRSS), bytes; 0 where /proc is unavailable.
pub fn rss_bytes() -> u64 {
    status_bytes("VmRSS:")
}

/// A `kB` field of `/proc/self/status`, in bytes.
fn status_bytes(field: &str) -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Returns freed heap memory to the system (glibc keeps freed blocks for reuse otherwise), so a
/// second run in the same process measures its own peak.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory held by the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Restarts the peak RSS count from the current RSS (Linux: `/proc/self/clear_refs` = 5);
/// returns false where that is not possible.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// End-of-run figures of a streamed generation, per decoded token (the prompt's pass left out).
#[derive(Clone, Debug, serde::Serialize)]
pub struct StreamReport {
    pub engine: &'static str,
    pub direct_io: bool,
    pub ram_budget_bytes: u64,
    pub residency: Residency,
    pub cost_model: CostModel,
    /// Decode steps measured (generated tokens after the first, which the prompt's pass yields).
    pub decode_tokens: u64,
    pub decode_tok_per_s: f64,
    /// Bytes the device transferred per decode step (both readers, alignment included).
    pub disk_bytes_per_token: f64,
    /// What dense streaming reads per token under the same budget (planned by the same read
    /// planner; `run --mode compare` also measures it).
    pub dense_disk_bytes_per_token: f64,
    /// Device bytes per byte needed (FFN rows, streamed matrices, embedding rows).
    pub read_amplification: f64,
    /// Share of the bytes asked of the readers that the device wrote straight into the buffer
    /// they were for (io_uring into the prefetch buffers, laid out in phase with the file; on a
    /// GPU, page-locked memory): not copied on the host.
    pub in_place_fraction: f64,
    /// The share of those bytes that landed in memory registered with the reader (io_uring
    /// fixed buffers: pages pinned once, not at every read).
    pub in_place_registered_fraction: f64,
    /// Share of needed FFN neurons the neuron cache served.
    pub cache_hit_rate: f64,
    /// Share of decode time the compute thread waited for reads.
    pub io_wait_fraction: f64,
    pub peak_rss_bytes: u64,
    /// With lookahead: how well it predicted.
    pub lookahead: Option<LookaheadReport>,
    /// A mixture-of-experts model: what its expert cache did (the counters' cache and
    /// lookahead fields then count whole experts, not neurons).
    pub experts: Option<ExpertReport>,
    /// Under `--vram-budget`: what the device keeps.
    pub device_plan: Option<super::residency::DeviceResidency>,
    /// A device with memory of its own: what it copied from the host per decoded token.
    pub link: Option<LinkReport>,
    /// The hybrid executor (`--hybrid`): its plan and what the CPU computed per decoded token.
    pub hybrid: Option<HybridReport>,
    pub counters: Counters,
}

/// The hybrid executor's work per decoded token (see [`super::hybrid`]).
#[derive(Clone, Debug, serde::Serialize)]
pub struct HybridReport {
    pub plan: super::hybrid::HybridPlan,
    /// Layers whose cold rows the CPU computed, per token (the model's layer count when every
    /// decode step took them).
    pub cpu_layers_per_token: f64,
    /// Bytes of cold rows the CPU computed per token, its time in them, and its rate (GB/s).
    pub cpu_bytes_per_token: f64,
    pub cpu_s_per_token: f64,
    pub cpu_gb_per_s: f64,
}

/// Host-to-device copies of weights per decoded token (see [`crate::backend::HostLink::link`]).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct LinkReport {
    /// Bytes copied at each use (streamed rows and matrices, weights the device does not keep),
    /// and in how many copies.
    pub bytes_per_token: f64,
    pub copies_per_token: f64,
    /// The share of those bytes staged in the device's own (page-locked) buffers and copied
    /// asynchronously, a chunk at a time, while the rest was still being read (masked decode
    /// steps' FFN rows); the rest is copied synchronously at its use.
    pub staged_fraction: f64,
    /// The share of those bytes copied from page-locked memory: staged, or from the stream's
    /// FFN staging, which the device locks (dense steps' and prompts' FFN rows).
    pub pinned_fraction: f64,
    /// Resident weights copied during decoding (first uses), bytes in all.
    pub resident_bytes: u64,
    /// Time in the copies per token — host time of the synchronous ones, device time (between
    /// events) of the staged ones — and the bandwidth that time gives (GB/s; 0 where the device
    /// does not time its copies).
    pub copy_s_per_token: f64,
    pub copy_gb_per_s: f64,
    /// Bytes the device's products read in place per token, across the link, from host memory
    /// it mapped (kept FFN rows read by id from the neuron cache): link traffic besides the
    /// copies above.
    pub mapped_bytes_per_token: f64,
    /// FFN bytes per token the device computed from its own copy of the hot neurons (no
    /// link traffic).
    pub hot_bytes_per_token: f64,
    /// Bytes per token copied back to the host: logits, or 4 a row when greedy decoding finds
    /// the token on the device; the gate's scores when a mask picks neurons.
    pub to_host_bytes_per_token: f64,
    /// Copies to the host per token that waited for the device's kernels (CUDA counts them;
    /// 0 elsewhere): see [`crate::backend::LinkCounters::host_waits`].
    pub host_waits_per_token: f64,
    /// Activation bytes per token copied to the device (the hybrid executor's partial outputs
    /// among them).
    pub activation_bytes_per_token: f64,
    /// Routed experts' bytes per token the device found in its own kept copies (not copied).
    pub kept_bytes_per_token: f64,
}

/// Expert streaming per decoded token (see [`super::experts`]).
#[derive(Clone, Debug, serde::Serialize)]
pub struct ExpertReport {
    /// `lru` or `frequency`.
    pub policy: &'static str,
    pub cache_slots: usize,
    /// Experts in the model (layers × experts per layer).
    pub experts_total: usize,
    pub expert_bytes: u64,
    /// Experts the tokens were routed to, per token (layers × experts used).
    pub routed_per_token: f64,
    /// Experts read from disk per token: on demand, and ahead by the lookahead.
    pub read_per_token: f64,
    pub read_ahead_per_token: f64,
    /// Share of routed experts the cache held already.
    pub cache_hit_rate: f64,
    /// Share of routed experts that were in memory when the layer ran (cache or lookahead).
    pub in_memory_rate: f64,
}

/// Lookahead figures per decoded token (see [`Streamer`]).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct LookaheadReport {
    /// Share of the neurons read ahead that the layer then used.
    pub hit_rate: f64,
    /// Share of the FFN bytes the layers needed from disk that lookahead had read.
    pub coverage: f64,
    /// Rows read ahead and not used (bytes of the rows; device bytes include merged gaps).
    pub wasted_bytes_per_token: f64,
}

impl StreamReport {
    pub fn new(s: &Streamer, g: &crate::model::generate::Generation) -> StreamReport {
        let (c, r) = s.decode_counters();
        // Generated tokens: one per pass, or several when speculation verified drafts.
        let decode_tokens = match g.speculative {
            Some(_) => g.decode_tokens as u64,
            None => c.passes,
        };
        let steps = decode_tokens.max(1) as f64;
        let needed = (c.ffn_needed_bytes + c.dense_needed_bytes) as f64;
        StreamReport {
            engine: match s.engine {
                ReadEngine::Uring => "uring",
                ReadEngine::Pread => "pread",
                ReadEngine::Mmap => "mmap",
            },
            direct_io: s.direct_io,
            ram_budget_bytes: s.residency.budget_bytes,
            residency: s.residency.clone(),
            cost_model: s.cost,
            decode_tokens,
            decode_tok_per_s: g.decode_tok_per_s,
            disk_bytes_per_token: r.bytes_device as f64 / steps,
            dense_disk_bytes_per_token: s.dense_bytes_per_token as f64,
            read_amplification: if needed > 0.0 {
                r.bytes_device as f64 / needed
            } else {
                1.0
            },
            in_place_fraction: r.bytes_in_place as f64 / r.bytes_requested.max(1) as f64,
            in_place_registered_fraction: r.bytes_in_place_registered as f64 / r.bytes_in_place.max(1) as f64,
            cache_hit_rate: if c.cache_lookups > 0 {
                c.cache_hits as f64 / c.cache_lookups as f64
            } else {
                0.0
            },
            io_wait_fraction: if g.decode_s > 0.0 {
                (c.io_wait_ns as f64 / 1e9 / g.decode_s).min(1.0)
            } else {
                0.0
            },
            peak_rss_bytes: peak_rss_bytes(),
            lookahead: (s.lookahead.is_some() || s.experts.as_ref().is_some_and(|x| x.lookahead)).then(|| {
                LookaheadReport {
                    hit_rate: c.ahead_used_neurons as f64 / c.ahead_neurons.max(1) as f64,
                    coverage: c.ahead_served_bytes as f64 / c.ffn_needed_bytes.max(1) as f64,
                    wasted_bytes_per_token: c.ahead_bytes.saturating_sub(c.ahead_used_bytes) as f64 / steps,
                }
            }),
            experts: s.experts.as_ref().map(|x| ExpertReport {
                policy: x.policy.name(),
                cache_slots: x.cache_slots,
                experts_total: x.experts_total(),
                expert_bytes: x.expert_bytes,
                routed_per_token: c.cache_lookups as f64 / steps,
                read_per_token: c.ffn_reads as f64 / steps,
                read_ahead_per_token: c.ahead_neurons as f64 / steps,
                cache_hit_rate: c.cache_hits as f64 / c.cache_lookups.max(1) as f64,
                in_memory_rate: (c.cache_hits + c.ahead_used_neurons) as f64 / c.cache_lookups.max(1) as f64,
            }),
            device_plan: s.device_plan.clone(),
            link: s.decode_link().map(|l| LinkReport {
                bytes_per_token: l.volatile_bytes as f64 / steps,
                copies_per_token: l.volatile_copies as f64 / steps,
                staged_fraction: l.staged_bytes as f64 / l.volatile_bytes.max(1) as f64,
                pinned_fraction: l.pinned_bytes as f64 / l.volatile_bytes.max(1) as f64,
                resident_bytes: l.resident_bytes,
                copy_s_per_token: l.copy_ns as f64 / 1e9 / steps,
                copy_gb_per_s: if l.copy_ns > 0 {
                    (l.volatile_bytes + l.resident_bytes) as f64 / l.copy_ns as f64
                } else {
                    0.0
                },
                mapped_bytes_per_token: c.ffn_mapped_bytes as f64 / steps,
                hot_bytes_per_token: c.ffn_hot_bytes as f64 / steps,
                to_host_bytes_per_token: l.to_host_bytes as f64 / steps,
                host_waits_per_token: l.host_waits as f64 / steps,
                activation_bytes_per_token: l.activation_bytes as f64 / steps,
                kept_bytes_per_token: l.kept_bytes as f64 / steps,
            }),
            hybrid: s.hybrid_plan().map(|p| HybridReport {
                plan: p.clone(),
                cpu_layers_per_token: c.cold_cpu_layers as f64 / steps,
                cpu_bytes_per_token: c.cold_cpu_bytes as f64 / steps,
                cpu_s_per_token: c.cold_cpu_ns as f64 / 1e9 / steps,
                cpu_gb_per_s: c.cold_cpu_bytes as f64 / c.cold_cpu_ns.max(1) as f64,
            }),
            counters: c,
        }
    }
}
