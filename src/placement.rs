//! Automatic placement: what this process may use of the host's memory (its cgroup's limit and
//! the kernel's MemAvailable, the smaller), and from that and the model's size, whether the model
//! runs in RAM or streams from disk under a budget; on a GPU, from its free memory, whether it
//! holds the whole model or a budget of it (the rest copied across the link at each use). `run`
//! and `serve` take it when no `--ram-budget` is given (or `--ram-budget auto`), the GPU's part
//! when no `--vram-budget` is given either (or `--vram-budget auto`); any explicit budget
//! overrides it.

use std::path::Path;

use serde::Serialize;

/// The memory this process may use, and where the figure comes from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostMemory {
    pub limit_bytes: u64,
    /// "cgroup memory.max", "cgroup memory.limit_in_bytes", "MemAvailable" or
    /// "GATESTREAM_MEMORY_LIMIT" (an override, for tests and for users who know better).
    pub source: String,
}

/// Reads the limit: `given` (the binary's `GATESTREAM_MEMORY_LIMIT`, in bytes) when set; else
/// the smaller of the tightest memory limit of this process's cgroup and its ancestors (v2
/// `memory.max`, v1 `memory.limit_in_bytes`) and `/proc/meminfo`'s MemAvailable. None when none
/// can be read.
pub fn host_memory(given: Option<u64>) -> Option<HostMemory> {
    if let Some(b) = given {
        return Some(HostMemory {
            limit_bytes: b,
            source: "GATESTREAM_MEMORY_LIMIT".into(),
        });
    }
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_limit(&c, Path::new("/sys/fs/cgroup")));
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| meminfo_available(&m))
        .map(|b| HostMemory {
            limit_bytes: b,
            source: "MemAvailable".into(),
        });
    match (cgroup, available) {
        (Some(c), Some(a)) => Some(if c.limit_bytes <= a.limit_bytes { c } else { a }),
        (c, a) => c.or(a),
    }
}

/// MemAvailable from `/proc/meminfo`'s text, in bytes.
pub fn meminfo_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The tightest memory limit over the cgroup named in `/proc/self/cgroup`'s text and its
/// ancestors, under the cgroup file system mounted at `root` (v2's unified hierarchy, or v1's
/// `memory` controller at `root/memory`). "max" and v1's near-2^63 "no limit" count as none.
pub fn cgroup_limit(proc_self_cgroup: &str, root: &Path) -> Option<HostMemory> {
    let read = |p: &Path| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
    let walk = |base: &Path, rel: &str, file: &str| -> Option<u64> {
        let mut best: Option<u64> = None;
        let mut dir = base.join(rel.trim_start_matches('/'));
        loop {
            if let Some(v) = read(&dir.join(file)) {
                // v1 writes "no limit" as the largest page-aligned i64.
                if let Ok(b) = v.parse::<u64>() {
                    if b < (1u64 << 62) {
                        best = Some(best.map_or(b, |x| x.min(b)));
                    }
                }
            }
            if dir == base || !dir.pop() || !dir.starts_with(base) {
                break;
            }
        }
        best
    };
    for line in proc_self_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, rel) = (f.next()?, f.next()?, f.next()?);
        if controllers.is_empty() {
            // v2: "0::/path".
            if let Some(b) = walk(root, rel, "memory.max") {
                return Some(HostMemory {
                    limit_bytes: b,
                    source: "cgroup memory.max".into(),
                });
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            if let Some(b) = walk(&root.join("memory"), rel, "memory.limit_in_bytes") {
                return Some(HostMemory {
                    limit_bytes: b,
                    source: "cgroup memory.limit_in_bytes".into(),
                });
            }
        }
    }
    None
}

/// Memory a run needs besides the weights and its KV cache (the binary, the tokenizer, the
/// allocator's slack, a batch's activations), counted before the model is kept in RAM.
pub const RUN_OVERHEAD_BYTES: u64 = 256 << 20;

/// Where the model runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Placed {
    /// Memory-mapped and computed in RAM: the model, its KV cache and the overhead fit.
    InRam,
    /// Streamed from disk under this budget.
    Streamed { budget_bytes: u64 },
}

/// What automatic placement chose, and from what.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    pub placed: Placed,
    pub memory: HostMemory,
    pub model_bytes: u64,
    pub context_bytes: u64,
    /// On a GPU: what it holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuDecision>,
    /// What streaming it should give, once the stream is open ([`Expected`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected: Option<Expected>,
}

/// The most a streamed model can decode: what a token reads from disk, at the rate the disk
/// gave just now. Compute and the link add to a token's time, and a mixture of experts' cache
/// hits take from its reads, so this bounds the speed from the disk's side only.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Expected {
    /// What a token reads under the plan (a mixture of experts: every routed expert read).
    pub bytes_per_token: u64,
    /// Whether that counts every routed expert read, none found in the expert cache.
    pub experts_all_read: bool,
    /// The disk's rate for large reads, measured at open.
    pub disk_bytes_per_s: f64,
    /// Whether those reads bypassed the page cache (otherwise the rate may be memory's).
    pub direct_io: bool,
    /// `disk_bytes_per_s / bytes_per_token` (None: nothing is read a token).
    pub tok_per_s_max: Option<f64>,
    /// On a GPU under a budget: what a token copies across the link, beside its rate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link: Option<LinkBound>,
}

/// The most a GPU under a budget can decode from the link's side: what a token copies from host
/// memory (what the GPU does not keep), at the link's pinned rate measured at open.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkBound {
    pub bytes_per_token: u64,
    pub link_bytes_per_s: f64,
    /// `link_bytes_per_s / bytes_per_token` (None: nothing is copied a token).
    pub tok_per_s_max: Option<f64>,
}

impl LinkBound {
    pub fn new(bytes_per_token: u64, link_bytes_per_s: f64) -> LinkBound {
        LinkBound {
            bytes_per_token,
            link_bytes_per_s,
            tok_per_s_max: (bytes_per_token > 0).then(|| link_bytes_per_s / bytes_per_token as f64),
        }
    }
}

impl Expected {
    pub fn new(bytes_per_token: u64, experts_all_read: bool, disk_bytes_per_s: f64, direct_io: bool) -> Expected {
        Expected {
            bytes_per_token,
            experts_all_read,
            disk_bytes_per_s,
            direct_io,
            tok_per_s_max: (bytes_per_token > 0).then(|| disk_bytes_per_s / bytes_per_token as f64),
            link: None,
        }
    }

    /// The same, with the link's bound beside the disk's.
    pub fn with_link(self, link: LinkBound) -> Expected {
        Expected {
            link: Some(link),
            ..self
        }
    }

    /// One line for the user.
    pub fn describe(&self) -> String {
        let bound = match self.bytes_per_token {
            0 => "nothing is read from disk a token".to_string(),
            b => format!(
                "at most {:.2} tok/s from the disk: {:.1} MB read a token{} at the {:.2} GB/s it gave now",
                self.tok_per_s_max.unwrap_or(0.0),
                b as f64 / 1e6,
                if self.experts_all_read {
                    " if every routed expert is read (expert cache hits read less)"
                } else {
                    ""
                },
                self.disk_bytes_per_s / 1e9
            ),
        };
        let link = match &self.link {
            None => String::new(),
            Some(l) => match l.tok_per_s_max {
                None => "; the GPU copies nothing a token".into(),
                Some(t) => format!(
                    "; at most {t:.2} tok/s from the link: {:.1} MB copied to the GPU a token at the {:.2} GB/s it gave now",
                    l.bytes_per_token as f64 / 1e6,
                    l.link_bytes_per_s / 1e9
                ),
            },
        };
        format!(
            "expected: {bound}{}{link}",
            if self.direct_io {
                ""
            } else {
                " (through the page cache: the rate may be memory's)"
            }
        )
    }
}

/// What a GPU holds.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum GpuPlaced {
    /// Every weight the host holds (the whole model, or the resident part of a streamed one).
    Whole,
    /// What this budget holds (`--vram-budget`); the rest is copied across the link at each use.
    Budget { budget_bytes: u64 },
}

/// The GPU's part of automatic placement, and from what.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuDecision {
    pub placed: GpuPlaced,
    /// The device's free memory when the run started.
    pub free_bytes: u64,
    /// What the GPU would hold without a budget: the model, or the host's budget when it streams.
    pub weights_bytes: u64,
}

/// Device memory a run needs besides the weights, its KV cache and activations (the math
/// libraries' workspaces, recorded graphs, the context itself): a twentieth of what is free, at
/// least 256 MiB and at most 2 GiB.
pub fn gpu_reserve_bytes(free_bytes: u64) -> u64 {
    (free_bytes / 20).clamp(256 << 20, 2 << 30)
}

/// The GPU's choice, with `free_bytes` free, for weights of `weights_bytes` (the model, or the
/// host's budget when it streams) and a context of `context_bytes`: the whole model when it,
/// the context and [`gpu_reserve_bytes`] fit; otherwise a budget of what is free less the
/// reserve (the streamer counts the context inside it, and refuses a budget below its minimum,
/// naming it).
pub fn decide_gpu(weights_bytes: u64, context_bytes: u64, free_bytes: u64) -> GpuDecision {
    let reserve = gpu_reserve_bytes(free_bytes);
    let placed = if weights_bytes.saturating_add(context_bytes).saturating_add(reserve) <= free_bytes {
        GpuPlaced::Whole
    } else {
        GpuPlaced::Budget {
            budget_bytes: free_bytes.saturating_sub(reserve),
        }
    };
    GpuDecision {
        placed,
        free_bytes,
        weights_bytes,
    }
}

/// The choice for a model of `model_bytes` whose KV cache and activations take `context_bytes`,
/// with `memory` to use: in RAM when the model, its context and [`RUN_OVERHEAD_BYTES`] fit;
/// otherwise streamed under the memory less a tenth (at least 128 MiB, at most 1 GiB: what the
/// process holds outside the budget — the binary, the tokenizer, the allocator's slack). The
/// streamer itself refuses a budget below the model's minimum, naming it.
pub fn decide(model_bytes: u64, context_bytes: u64, memory: &HostMemory) -> Decision {
    let need = model_bytes
        .saturating_add(context_bytes)
        .saturating_add(RUN_OVERHEAD_BYTES);
    let placed = if need <= memory.limit_bytes {
        Placed::InRam
    } else {
        let reserve = (memory.limit_bytes / 10).clamp(128 << 20, 1 << 30);
        Placed::Streamed {
            budget_bytes: memory.limit_bytes.saturating_sub(reserve),
        }
    };
    Decision {
        placed,
        memory: memory.clone(),
        model_bytes,
        context_bytes,
        gpu: None,
        expected: None,
    }
}

impl Decision {
    /// One line for the user: what was chosen and why.
    pub fn describe(&self) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        let gpu = match &self.gpu {
            None => String::new(),
            Some(g) => match g.placed {
                GpuPlaced::Whole => format!(
                    "; the GPU holds it ({:.2} GB of weights; {:.2} GB free)",
                    gb(g.weights_bytes),
                    gb(g.free_bytes)
                ),
                GpuPlaced::Budget { budget_bytes } => format!(
                    "; the GPU holds a {:.2} GB budget of its {:.2} GB ({:.2} GB free), the rest copied at each use \
                     (--vram-budget overrides)",
                    gb(budget_bytes),
                    gb(g.weights_bytes),
                    gb(g.free_bytes)
                ),
            },
        };
        let mem = format!("{} {:.2} GB", self.memory.source, gb(self.memory.limit_bytes));
        let host = match self.placed {
            Placed::InRam => format!(
                "placement: in RAM ({mem}; the model {:.2} GB, its context {:.2} GB and {:.2} GB overhead fit); \
                 --ram-budget streams instead",
                gb(self.model_bytes),
                gb(self.context_bytes),
                gb(RUN_OVERHEAD_BYTES)
            ),
            Placed::Streamed { budget_bytes } => format!(
                "placement: streamed from disk under a {:.2} GB budget ({mem}; the model {:.2} GB and its context \
                 {:.2} GB do not fit); --ram-budget overrides",
                gb(budget_bytes),
                gb(self.model_bytes),
                gb(self.context_bytes)
            ),
        };
        host + &gpu
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(limit: u64) -> HostMemory {
        HostMemory {
            limit_bytes: limit,
            source: "test".into(),
        }
    }

    const G: u64 = 1_000_000_000;
    const M: u64 = 1_000_000;

    /// The decision table: limits × model sizes → in RAM or streamed, and the budget.
    #[test]
    fn the_decision_table() {
        let rows: [(u64, u64, u64, Placed); 7] = [
            // (limit, model, context) → choice
            (24 * G, 98 * M, 10 * M, Placed::InRam),
            (24 * G, 4_920 * M, 130 * M, Placed::InRam),
            (
                2 * G,
                4_920 * M,
                130 * M,
                Placed::Streamed {
                    budget_bytes: 2 * G - 200 * M,
                },
            ),
            (
                3 * G,
                4_920 * M,
                130 * M,
                Placed::Streamed {
                    budget_bytes: 3 * G - 300 * M,
                },
            ),
            (
                6 * G,
                18_600 * M,
                200 * M,
                Placed::Streamed {
                    budget_bytes: 6 * G - 600 * M,
                },
            ),
            // A tenth is at least 128 MiB and at most 1 GiB.
            (
                400 * M,
                500 * M,
                0,
                Placed::Streamed {
                    budget_bytes: 400 * M - (128 << 20),
                },
            ),
            (
                64 * G,
                70 * G,
                0,
                Placed::Streamed {
                    budget_bytes: 64 * G - (1 << 30),
                },
            ),
        ];
        for (limit, model, ctx, want) in rows {
            let d = decide(model, ctx, &mem(limit));
            assert_eq!(d.placed, want, "limit {limit}, model {model}, context {ctx}");
        }
        // The model just fits with its context and the overhead; one byte more streams.
        let limit = 1000 * M;
        let fits = limit - RUN_OVERHEAD_BYTES - 50 * M;
        assert_eq!(decide(fits, 50 * M, &mem(limit)).placed, Placed::InRam);
        assert!(matches!(
            decide(fits + 1, 50 * M, &mem(limit)).placed,
            Placed::Streamed { .. }
        ));
    }

    /// The GPU's table: free memory × weights → the whole model or a budget, and the reserve's
    /// bounds.
    #[test]
    fn the_expected_speed_is_the_disks_rate_over_a_tokens_reads() {
        let e = Expected::new(3_000_000_000, false, 2.2e9, true);
        assert!((e.tok_per_s_max.unwrap() - 2.2 / 3.0).abs() < 1e-12);
        assert_eq!(
            e.describe(),
            "expected: at most 0.73 tok/s from the disk: 3000.0 MB read a token at the 2.20 GB/s it gave now"
        );
        let moe = Expected::new(55_000_000, true, 2.0e9, false).describe();
        assert!(
            moe.contains("36.36 tok/s") && moe.contains("every routed expert") && moe.contains("page cache"),
            "{moe}"
        );
        assert_eq!(
            Expected::new(0, false, 2.0e9, true).describe(),
            "expected: nothing is read from disk a token"
        );
        let gpu = Expected::new(0, false, 2.0e9, true).with_link(LinkBound::new(500_000_000, 25e9));
        assert_eq!(gpu.link.as_ref().unwrap().tok_per_s_max, Some(50.0));
        assert!(
            gpu.describe().ends_with(
                "; at most 50.00 tok/s from the link: 500.0 MB copied to the GPU a token at the 25.00 GB/s it gave now"
            ),
            "{}",
            gpu.describe()
        );
    }

    #[test]
    fn the_gpu_decision_table() {
        const GI: u64 = 1 << 30;
        let rows: [(u64, u64, u64, GpuPlaced); 5] = [
            // (free, weights, context) → choice
            (80 * G, 4_920 * M, 130 * M, GpuPlaced::Whole),
            (
                8 * G,
                18_600 * M,
                200 * M,
                GpuPlaced::Budget {
                    budget_bytes: 8 * G - 400 * M,
                },
            ),
            (140 * G, 63 * G, 2 * G, GpuPlaced::Whole),
            // A twentieth is at least 256 MiB and at most 2 GiB.
            (
                2 * G,
                4_920 * M,
                130 * M,
                GpuPlaced::Budget {
                    budget_bytes: 2 * G - (256 << 20),
                },
            ),
            (
                140 * G,
                200 * G,
                0,
                GpuPlaced::Budget {
                    budget_bytes: 140 * G - 2 * GI,
                },
            ),
        ];
        for (free, weights, ctx, want) in rows {
            assert_eq!(
                decide_gpu(weights, ctx, free).placed,
                want,
                "free {free}, weights {weights}, context {ctx}"
            );
        }
        // Just fits; one byte more takes a budget.
        let free = 10 * G;
        let fits = free - gpu_reserve_bytes(free) - 50 * M;
        assert_eq!(decide_gpu(fits, 50 * M, free).placed, GpuPlaced::Whole);
        assert!(matches!(
            decide_gpu(fits + 1, 50 * M, free).placed,
            GpuPlaced::Budget { .. }
        ));
        let mut d = decide(5 * G, 0, &mem(24 * G));
        d.gpu = Some(decide_gpu(5 * G, 0, 2 * G));
        assert!(
            d.describe().contains("the GPU holds a 1.73 GB budget of its 5.00 GB"),
            "{}",
            d.describe()
        );
    }

    #[test]
    fn meminfo_and_cgroup_files_are_read() {
        let m = "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo_available(m), Some(20_000_000 * 1024));
        assert_eq!(meminfo_available("MemTotal: 5 kB\n"), None);
        let root = tempfile::tempdir().unwrap();
        // v1: the memory controller's hierarchy; the tighter of a cgroup and its parent.
        let v1 = root.path().join("memory/parent/child");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(
            root.path().join("memory/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        std::fs::write(root.path().join("memory/parent/memory.limit_in_bytes"), "3000000000\n").unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "2000000000\n").unwrap();
        let l = cgroup_limit("4:cpu,cpuacct:/x\n3:memory:/parent/child\n", root.path()).unwrap();
        assert_eq!(
            (l.limit_bytes, l.source.as_str()),
            (2_000_000_000, "cgroup memory.limit_in_bytes")
        );
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        let l = cgroup_limit("3:memory:/parent/child\n", root.path()).unwrap();
        assert_eq!(l.limit_bytes, 3_000_000_000, "the parent's limit holds");
        // v2: "max" is no limit.
        let v2 = root.path().join("a/b");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        std::fs::write(root.path().join("a/memory.max"), "6442450944\n").unwrap();
        let l = cgroup_limit("0::/a/b\n", root.path()).unwrap();
        assert_eq!((l.limit_bytes, l.source.as_str()), (6_442_450_944, "cgroup memory.max"));
        std::fs::write(root.path().join("a/memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_limit("0::/a/b\n", root.path()), None);
    }
}
