//! The residency plan: under a RAM budget, what stays in memory and what is read from disk for
//! every token. Pure arithmetic on sizes, so it is tested without a model.
//!
//! Order of preference (each item is read in full every token when it is not resident, so
//! keeping it saves exactly its size; a cached neuron saves its size only when it is used):
//! 1. required: norms, the output matrix (every token multiplies all of it), the staging
//!    buffers one layer's FFN needs (and two more with lookahead), and the prefetch buffers
//!    when anything dense streams;
//! 2. attention matrices, layer by layer;
//! 3. gate matrices, layer by layer, then a neuron cache (up row + down column per neuron) with
//!    the rest, split evenly over layers — or, with [`Priority::CacheFirst`], the cache first
//!    and gates with what is left. For dense streaming both save the same bytes; for sparse
//!    streaming a cache that keeps recently used neurons saves scattered reads, which cost more
//!    than the gate's one sequential read.
//!
//! The token embedding is never resident unless it is the output matrix: a token needs one row.

use crate::error::{Error, Result};

/// Sizes of what the model holds, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSizes {
    pub n_layers: usize,
    pub ffn: usize,
    /// Output matrix (the embedding when tied) and every norm and bias.
    pub required_bytes: u64,
    /// Per layer: wq + wk + wv + wo.
    pub attention_bytes: Vec<u64>,
    /// Per layer: the gate matrix.
    pub gate_bytes: Vec<u64>,
    /// Per layer: one neuron's up row + down column.
    pub neuron_bytes: Vec<u64>,
    /// Prefetch every layer's FFN rows with its dense parts (dense streaming: all are needed).
    pub prefetch_ffn: bool,
    /// The readers' own buffers.
    pub reader_bytes: u64,
    /// Lookahead: two more buffers of one layer's FFN rows (the next layer's predicted rows in
    /// flight, this layer's in use).
    pub lookahead: bool,
    /// The pass's own memory: the KV cache of every position allocated and one batch's
    /// activations (a prompt is prefilled in batches of at most that many tokens).
    pub context_bytes: u64,
    /// The `rows` layout: each layer's whole up and down matrices, kept or streamed like the
    /// attention and gate matrices (there is no neuron cache); `None`: neuron-major.
    pub ffn_rows: Option<FfnRows>,
    /// Prefetch buffers (at least 2: the layer in use and the one being read; each more lets
    /// one more layer be read ahead, so the device never waits between layers).
    pub prefetch_buffers: usize,
}

/// The `rows` layout's FFN matrices, per layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FfnRows {
    pub up_bytes: Vec<u64>,
    pub down_bytes: Vec<u64>,
}

/// What the budget goes to after attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    GateFirst,
    CacheFirst,
}

/// What stays in RAM.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Residency {
    pub budget_bytes: u64,
    pub attention_resident: Vec<bool>,
    pub gate_resident: Vec<bool>,
    /// Neurons each layer's cache holds.
    pub cache_neurons: Vec<usize>,
    /// The `rows` layout: whether each layer's up and down matrices are resident (empty for
    /// a neuron-major file).
    pub up_resident: Vec<bool>,
    pub down_resident: Vec<bool>,
    /// Bytes of each kind, as planned (they sum to at most the budget).
    pub required_bytes: u64,
    pub working_bytes: u64,
    /// The KV cache and one batch's activations.
    pub context_bytes: u64,
    pub attention_bytes: u64,
    pub gate_bytes: u64,
    pub cache_bytes: u64,
    /// The `rows` layout's resident up and down matrices.
    pub ffn_matrix_bytes: u64,
    /// Prefetch buffers and the bytes of each (0 when nothing dense streams).
    pub prefetch_buffers: usize,
    pub prefetch_buffer_bytes: u64,
}

impl Residency {
    /// Whether any attention or gate matrix (or, when FFN rows are prefetched, any neuron the
    /// cache lacks; in the `rows` layout, any up or down matrix) is read per token by the
    /// prefetch thread.
    fn streams_dense(&self, prefetch_ffn: bool, ffn: usize) -> bool {
        self.attention_resident.iter().any(|&a| !a)
            || self.gate_resident.iter().any(|&g| !g)
            || self.up_resident.iter().chain(&self.down_resident).any(|&r| !r)
            || (prefetch_ffn && self.up_resident.is_empty() && self.cache_neurons.iter().any(|&c| c < ffn))
    }

    pub fn resident_bytes(&self) -> u64 {
        self.required_bytes
            + self.working_bytes
            + self.context_bytes
            + self.attention_bytes
            + self.gate_bytes
            + self.cache_bytes
            + self.ffn_matrix_bytes
    }
}

impl ModelSizes {
    /// Staging for one layer's whole FFN (dense streaming reads every neuron of a layer at once),
    /// twice more with lookahead; none in the `rows` layout, whose FFN streams as matrices.
    /// (With the readers' buffers, which are always there.)
    fn staging_bytes(&self) -> u64 {
        if self.ffn_rows.is_some() {
            return self.reader_bytes;
        }
        let layer = (0..self.n_layers)
            .map(|l| self.ffn as u64 * self.neuron_bytes[l])
            .max()
            .unwrap_or(0);
        self.reader_bytes + if self.lookahead { 3 * layer } else { layer }
    }

    /// What one prefetch buffer holds for layer `l` under `r` (everything streamed when `None`):
    /// its streamed attention, gate and — when prefetched — FFN rows (in the `rows` layout, its
    /// streamed up and down matrices). (Each range's place in phase pads it by less than a
    /// block, which the plan leaves out.)
    fn prefetched_layer_bytes(&self, l: usize, r: Option<&Residency>) -> u64 {
        let streams = |v: Option<&Vec<bool>>| v.is_none_or(|v| !v.get(l).copied().unwrap_or(false));
        let mut bytes = 0;
        if streams(r.map(|r| &r.attention_resident)) {
            bytes += self.attention_bytes[l];
        }
        if streams(r.map(|r| &r.gate_resident)) {
            bytes += self.gate_bytes[l];
        }
        match &self.ffn_rows {
            Some(f) => {
                if streams(r.map(|r| &r.up_resident)) {
                    bytes += f.up_bytes[l];
                }
                if streams(r.map(|r| &r.down_resident)) {
                    bytes += f.down_bytes[l];
                }
            }
            // Dense steps' views hold the whole layer's FFN (the cached rows copied in front).
            None if self.prefetch_ffn && r.is_none_or(|r| r.cache_neurons[l] < self.ffn) => {
                bytes += self.ffn as u64 * self.neuron_bytes[l];
            }
            None => {}
        }
        bytes
    }

    /// The prefetch buffers for `r` (everything streamed when `None`): each sized for the
    /// layer that streams the most.
    fn prefetch_bytes_for(&self, r: Option<&Residency>) -> u64 {
        let layer = (0..self.n_layers)
            .map(|l| self.prefetched_layer_bytes(l, r))
            .max()
            .unwrap_or(0);
        self.prefetch_buffers.max(2) as u64 * layer
    }

    /// The smallest budget that runs: required + staging + prefetch buffers.
    pub fn minimum_bytes(&self) -> u64 {
        self.required_bytes + self.context_bytes + self.staging_bytes() + self.prefetch_bytes_for(None)
    }

    /// Plans residency under `budget_bytes`; refuses a budget below the minimum, naming it.
    /// The prefetch buffers are sized by what the plan streams: planned first for the most any
    /// layer could stream, then again with the buffers the plan needs (smaller buffers leave
    /// more resident, which streams less), until they no longer shrink.
    pub fn plan(&self, budget_bytes: u64, priority: Priority) -> Result<Residency> {
        let min = self.minimum_bytes();
        if budget_bytes < min {
            let mb = |b: u64| b as f64 / 1e6;
            return Err(Error::Input(format!(
                "--ram-budget {} is too small for this model: at least {} ({:.1} MB) is needed for the output \
                 matrix and norms ({:.1} MB), the buffers one layer streams through ({:.1} MB), the KV cache and one \
                 batch's activations ({:.1} MB)",
                budget_bytes,
                min,
                mb(min),
                mb(self.required_bytes),
                mb(self.staging_bytes() + self.prefetch_bytes_for(None)),
                mb(self.context_bytes)
            )));
        }
        let staging = self.staging_bytes();
        // Prefetch buffers only when something dense streams.
        let plan = self.plan_with(budget_bytes, priority, staging, 0);
        if !plan.streams_dense(self.prefetch_ffn, self.ffn) {
            return Ok(plan);
        }
        let mut prefetch = self.prefetch_bytes_for(None);
        let mut plan = self.plan_with(budget_bytes, priority, staging, prefetch);
        for _ in 0..8 {
            let need = self.prefetch_bytes_for(Some(&plan));
            if need >= prefetch {
                break;
            }
            prefetch = need;
            plan = self.plan_with(budget_bytes, priority, staging, prefetch);
        }
        Ok(plan)
    }

    fn plan_with(&self, budget_bytes: u64, priority: Priority, staging: u64, prefetch: u64) -> Residency {
        let n = self.n_layers;
        let working = staging + prefetch;
        let mut left = budget_bytes - self.required_bytes - self.context_bytes - working;
        let take = |bytes: &[u64], left: &mut u64| -> (Vec<bool>, u64) {
            let mut taken = 0;
            let keep = bytes
                .iter()
                .map(|&b| {
                    let fits = b <= *left;
                    if fits {
                        *left -= b;
                        taken += b;
                    }
                    fits
                })
                .collect();
            (keep, taken)
        };
        if let Some(f) = &self.ffn_rows {
            return self.plan_rows(f, budget_bytes, left, working, prefetch);
        }
        let (attention_resident, attention_bytes) = take(&self.attention_bytes, &mut left);
        let cache = |left: &mut u64| -> (Vec<usize>, u64) {
            if self.ffn_rows.is_some() {
                return (vec![0; n], 0);
            }
            let per_layer = *left / n.max(1) as u64;
            let neurons: Vec<usize> = (0..n)
                .map(|l| ((per_layer / self.neuron_bytes[l].max(1)) as usize).min(self.ffn))
                .collect();
            let bytes = (0..n).map(|l| neurons[l] as u64 * self.neuron_bytes[l]).sum();
            *left -= bytes;
            (neurons, bytes)
        };
        let ((gate_resident, gate_bytes), (cache_neurons, cache_bytes)) = match priority {
            Priority::GateFirst => {
                let g = take(&self.gate_bytes, &mut left);
                (g, cache(&mut left))
            }
            Priority::CacheFirst => {
                let c = cache(&mut left);
                (take(&self.gate_bytes, &mut left), c)
            }
        };
        Residency {
            budget_bytes,
            attention_resident,
            gate_resident,
            cache_neurons,
            up_resident: Vec::new(),
            down_resident: Vec::new(),
            required_bytes: self.required_bytes,
            working_bytes: working,
            context_bytes: self.context_bytes,
            attention_bytes,
            gate_bytes,
            cache_bytes,
            ffn_matrix_bytes: 0,
            prefetch_buffers: self.buffers_if(prefetch),
            prefetch_buffer_bytes: prefetch / self.buffers_if(prefetch).max(1) as u64,
        }
    }

    fn buffers_if(&self, prefetch: u64) -> usize {
        match prefetch {
            0 => 0,
            _ => self.prefetch_buffers.max(2),
        }
    }

    /// The `rows` layout's plan: every matrix of a layer (attention as one, gate, up, down)
    /// saves its bytes at every token, so any choice keeps as many bytes as another; the plan
    /// keeps them where the most is streamed — each step the largest matrix that fits of the
    /// layer that streams the most — so layers stream alike and the prefetch buffers, sized
    /// for the layer that streams the most, stay small.
    fn plan_rows(&self, f: &FfnRows, budget_bytes: u64, mut left: u64, working: u64, prefetch: u64) -> Residency {
        let n = self.n_layers;
        // Per layer: attention, gate, up, down.
        let sizes: Vec<[u64; 4]> = (0..n)
            .map(|l| {
                [
                    self.attention_bytes[l],
                    self.gate_bytes[l],
                    f.up_bytes[l],
                    f.down_bytes[l],
                ]
            })
            .collect();
        let mut kept = vec![[false; 4]; n];
        let streamed =
            |kept: &[[bool; 4]], l: usize| -> u64 { (0..4).filter(|&m| !kept[l][m]).map(|m| sizes[l][m]).sum() };
        loop {
            // (layer's streamed bytes, matrix bytes, layer, matrix): the largest first.
            let best = (0..n)
                .flat_map(|l| (0..4).map(move |m| (l, m)))
                .filter(|&(l, m)| !kept[l][m] && sizes[l][m] <= left)
                .max_by_key(|&(l, m)| (streamed(&kept, l), sizes[l][m], std::cmp::Reverse(l)));
            let Some((l, m)) = best else { break };
            kept[l][m] = true;
            left -= sizes[l][m];
        }
        let column = |m: usize| -> (Vec<bool>, u64) {
            let keep: Vec<bool> = kept.iter().map(|k| k[m]).collect();
            let bytes = (0..n).filter(|&l| keep[l]).map(|l| sizes[l][m]).sum();
            (keep, bytes)
        };
        let ((attention_resident, attention_bytes), (gate_resident, gate_bytes)) = (column(0), column(1));
        let ((up_resident, up_bytes), (down_resident, down_bytes)) = (column(2), column(3));
        Residency {
            budget_bytes,
            attention_resident,
            gate_resident,
            cache_neurons: vec![0; n],
            up_resident,
            down_resident,
            required_bytes: self.required_bytes,
            working_bytes: working,
            context_bytes: self.context_bytes,
            attention_bytes,
            gate_bytes,
            cache_bytes: 0,
            ffn_matrix_bytes: up_bytes + down_bytes,
            prefetch_buffers: self.buffers_if(prefetch),
            prefetch_buffer_bytes: prefetch / self.buffers_if(prefetch).max(1) as u64,
        }
    }
}

/// What a device with memory of its own keeps under `--vram-budget` (a GPU fed by the stream):
/// a plan over the weights the host holds, in the RAM plan's order of preference. Required on
/// the device: norms and biases, the KV cache and one batch's activations, and room for the
/// largest set of weights copied for one use (one layer's streamed attention, gate and FFN
/// rows, or the output matrix when it is not resident). Then, while the budget lasts: the
/// output matrix (every token multiplies all of it), attention layer by layer, gates layer by
/// layer — each only where the host keeps it resident (what streams from disk reaches the
/// device through the stream's buffers, copied at each use) — then hot neurons: with what is
/// left, split evenly over layers, each layer's first neurons (the hot prefix of a hot-first
/// file; up row and down column) up to what the host's neuron cache holds. A step computes
/// those from the device's copy and streams only the rest of its FFN rows (the host's cache
/// then holds the neurons after the prefix). Everything else is copied to the device at each
/// use.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceResidency {
    pub budget_bytes: u64,
    /// The smallest budget that runs (see above).
    pub minimum_bytes: u64,
    pub output_resident: bool,
    pub attention_resident: Vec<bool>,
    pub gate_resident: Vec<bool>,
    /// Bytes of each kind, as planned (they sum to at most the budget): the required part
    /// (with room for the output matrix's copy when it is not resident), then the resident
    /// weights.
    pub required_bytes: u64,
    pub output_bytes: u64,
    pub attention_bytes: u64,
    pub gate_bytes: u64,
    /// Per layer: the neurons (the layer's first) whose up row and down column the device
    /// keeps, and their bytes in all.
    pub hot_neurons: Vec<usize>,
    pub hot_bytes: u64,
    /// What a dense decode step copies to the device under this plan: every weight not
    /// resident there, the FFN rows of every neuron but the hot ones included.
    pub copied_bytes_per_token: u64,
    /// A mixture of experts: the room the plan leaves, where the device keeps copies of the
    /// routed experts it was sent, the least recently used replaced (0 for a dense model).
    pub kept_bytes: u64,
}

impl ModelSizes {
    /// The budget that keeps everything resident: the minimum's required parts and buffers,
    /// every attention and gate matrix, and a neuron cache of every neuron (nothing is read
    /// per token). What streaming with no RAM budget of its own plans with.
    pub fn everything_bytes(&self) -> u64 {
        let ffn: u64 = match &self.ffn_rows {
            Some(f) => f.up_bytes.iter().chain(&f.down_bytes).sum(),
            None => (0..self.n_layers).map(|l| self.ffn as u64 * self.neuron_bytes[l]).sum(),
        };
        self.required_bytes
            + self.context_bytes
            + self.staging_bytes()
            + self.attention_bytes.iter().sum::<u64>()
            + self.gate_bytes.iter().sum::<u64>()
            + ffn
    }

    /// The device's plan under `budget_bytes` (see [`DeviceResidency`]); `output_bytes`: the
    /// output matrix's part of `required_bytes`; `ram`: what the host keeps. Refuses a budget
    /// below the minimum, naming it.
    pub fn plan_device(&self, budget_bytes: u64, output_bytes: u64, ram: &Residency) -> Result<DeviceResidency> {
        let vectors = self.required_bytes.saturating_sub(output_bytes);
        let layer_use = (0..self.n_layers)
            .map(|l| self.attention_bytes[l] + self.gate_bytes[l] + self.ffn as u64 * self.neuron_bytes[l])
            .max()
            .unwrap_or(0);
        // Room for one layer's copies; the output matrix needs as much room for its copy when it
        // is not resident, so the minimum holds the larger of the two.
        let base = vectors + self.context_bytes + layer_use;
        let minimum = vectors + self.context_bytes + layer_use.max(output_bytes);
        if budget_bytes < minimum {
            return Err(Error::Input(format!(
                "--vram-budget {} is too small for this model: at least {} ({:.1} MB) is needed on the device for \
                 norms, the KV cache and one batch's activations, and the largest set of weights copied for one \
                 use (one layer's attention, gate and FFN rows, or the output matrix)",
                budget_bytes,
                minimum,
                minimum as f64 / 1e6
            )));
        }
        let output_resident = output_bytes <= budget_bytes - base;
        let required = if output_resident { base } else { minimum };
        let mut left = budget_bytes - required - if output_resident { output_bytes } else { 0 };
        let mut take = |b: u64, host_keeps: bool| -> bool {
            let fits = host_keeps && b <= left;
            if fits {
                left -= b;
            }
            fits
        };
        let attention_resident: Vec<bool> = (0..self.n_layers)
            .map(|l| take(self.attention_bytes[l], ram.attention_resident[l]))
            .collect();
        let gate_resident: Vec<bool> = (0..self.n_layers)
            .map(|l| take(self.gate_bytes[l], ram.gate_resident[l]))
            .collect();
        // Hot neurons with the rest, split evenly over layers, within what the host caches.
        let per_layer = left / self.n_layers.max(1) as u64;
        let hot_neurons: Vec<usize> = (0..self.n_layers)
            .map(|l| {
                let fit = (per_layer / self.neuron_bytes[l].max(1)) as usize;
                fit.min(self.ffn).min(ram.cache_neurons.get(l).copied().unwrap_or(0))
            })
            .collect();
        let hot_bytes: u64 = (0..self.n_layers)
            .map(|l| hot_neurons[l] as u64 * self.neuron_bytes[l])
            .sum();
        let sum_where = |bytes: &[u64], keep: &[bool], want: bool| -> u64 {
            bytes.iter().zip(keep).filter(|(_, &k)| k == want).map(|(b, _)| b).sum()
        };
        let ffn: u64 = (0..self.n_layers).map(|l| self.ffn as u64 * self.neuron_bytes[l]).sum();
        Ok(DeviceResidency {
            budget_bytes,
            minimum_bytes: minimum,
            output_resident,
            required_bytes: required,
            output_bytes: if output_resident { output_bytes } else { 0 },
            attention_bytes: sum_where(&self.attention_bytes, &attention_resident, true),
            gate_bytes: sum_where(&self.gate_bytes, &gate_resident, true),
            copied_bytes_per_token: if output_resident { 0 } else { output_bytes }
                + sum_where(&self.attention_bytes, &attention_resident, false)
                + sum_where(&self.gate_bytes, &gate_resident, false)
                + ffn
                - hot_bytes,
            attention_resident,
            gate_resident,
            hot_neurons,
            hot_bytes,
            kept_bytes: 0,
        })
    }
}

impl DeviceResidency {
    /// Bytes of the device's memory the plan uses.
    pub fn resident_bytes(&self) -> u64 {
        self.required_bytes
            + self.output_bytes
            + self.attention_bytes
            + self.gate_bytes
            + self.hot_bytes
            + self.kept_bytes
    }
}

/// Parses a RAM budget: bytes with an optional K/M/G suffix (powers of 1000; KiB/MiB/GiB for
/// powers of 1024), or a percentage of `file_bytes` ("40%").
pub fn parse_budget(s: &str, file_bytes: u64) -> Result<u64> {
    parse_budget_for("--ram-budget", s, file_bytes)
}

/// As [`parse_budget`], for the flag `flag` (named in the error).
pub fn parse_budget_for(flag: &str, s: &str, file_bytes: u64) -> Result<u64> {
    let size = BudgetSize::parse(s).ok_or_else(|| Error::Input(format!("{flag} {s:?}: {}", BudgetSize::EXPECTED)))?;
    Ok(size.bytes(file_bytes))
}

/// A budget as given, before the model's size is known: bytes, or a share of the model file.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BudgetSize {
    Bytes(u64),
    /// Percent of the file, 0 to 100.
    Percent(f64),
}

impl BudgetSize {
    /// What [`BudgetSize::parse`] takes, for messages.
    pub const EXPECTED: &'static str =
        "give bytes with an optional suffix (700M, 1.5G, 512MiB) or a share of the file (40%)";

    /// Bytes with an optional K/M/G suffix (powers of 1000; KiB/MiB/GiB for powers of 1024), or
    /// a percentage ("40%"); None when `s` is neither.
    pub fn parse(s: &str) -> Option<BudgetSize> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let p: f64 = p.trim().parse().ok()?;
            return (0.0..=100.0).contains(&p).then_some(BudgetSize::Percent(p));
        }
        let units: [(&str, f64); 8] = [
            ("KiB", 1024.0),
            ("MiB", 1024.0 * 1024.0),
            ("GiB", 1024.0 * 1024.0 * 1024.0),
            ("K", 1e3),
            ("M", 1e6),
            ("G", 1e9),
            ("B", 1.0),
            ("", 1.0),
        ];
        for (suffix, mult) in units {
            if let Some(num) = t.strip_suffix(suffix) {
                if let Ok(v) = num.trim().parse::<f64>() {
                    if v >= 0.0 && v.is_finite() {
                        return Some(BudgetSize::Bytes((v * mult) as u64));
                    }
                }
            }
        }
        None
    }

    /// The bytes this is of a model file of `file_bytes`.
    pub fn bytes(self, file_bytes: u64) -> u64 {
        match self {
            BudgetSize::Bytes(b) => b,
            BudgetSize::Percent(p) => (file_bytes as f64 * p / 100.0) as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes() -> ModelSizes {
        ModelSizes {
            n_layers: 4,
            ffn: 100,
            required_bytes: 1000,
            attention_bytes: vec![300; 4],
            gate_bytes: vec![500; 4],
            neuron_bytes: vec![10; 4],
            prefetch_ffn: false,
            reader_bytes: 0,
            context_bytes: 0,
            lookahead: false,
            ffn_rows: None,
            prefetch_buffers: 2,
        }
    }

    #[test]
    fn a_budget_below_the_minimum_is_refused_with_the_minimum() {
        let s = sizes();
        // required 1000 + staging 100 x 10 + prefetch 2 x 800
        assert_eq!(s.minimum_bytes(), 3600);
        let e = s.plan(3599, Priority::GateFirst).unwrap_err().to_string();
        assert!(e.contains("3600"), "{e}");
        assert!(s.plan(3600, Priority::GateFirst).is_ok());
        // Lookahead holds two more layers of FFN rows (in flight and in use).
        let l = ModelSizes {
            lookahead: true,
            ..sizes()
        };
        assert_eq!(l.minimum_bytes(), 3600 + 2 * 1000);
    }

    #[test]
    fn attention_then_gates_then_cache_and_never_over_budget() {
        let s = sizes();
        for budget in [3600u64, 4000, 5000, 6000, 7000, 8000, 20_000] {
            let c = s.plan(budget, Priority::CacheFirst).unwrap();
            assert!(c.resident_bytes() <= budget, "{budget}: {c:?}");
            // Whatever streams has its prefetch buffers in the budget, sized by what the plan
            // streams: staging 1000 + 2 x (the most one layer streams: 300 attention + 500 gate).
            for r in [&c, &s.plan(budget, Priority::GateFirst).unwrap()] {
                let layer = (0..4)
                    .map(|l| 300 * !r.attention_resident[l] as u64 + 500 * !r.gate_resident[l] as u64)
                    .max()
                    .unwrap();
                assert_eq!(r.working_bytes, 1000 + 2 * layer, "{budget}: {r:?}");
                assert_eq!(r.prefetch_buffer_bytes, layer, "{budget}: {r:?}");
            }
            if c.gate_resident.iter().any(|&g| g) {
                assert_eq!(c.cache_neurons, vec![100; 4], "{budget}: gates only after a full cache");
            }
            let r = s.plan(budget, Priority::GateFirst).unwrap();
            assert!(r.resident_bytes() <= budget, "{budget}: {r:?}");
            // A gate is only resident once every attention is.
            if r.gate_resident.iter().any(|&g| g) {
                assert!(r.attention_resident.iter().all(|&a| a));
            }
            if r.cache_bytes > 0 && r.working_bytes > 1000 {
                assert!(r.gate_resident.iter().all(|&g| g) || r.cache_neurons.iter().all(|&c| c < 80));
            }
        }
        // Everything fits: no prefetch buffers, all resident, a full cache.
        let r = s.plan(20_000, Priority::GateFirst).unwrap();
        assert_eq!(r.working_bytes, 1000);
        assert!(r.attention_resident.iter().all(|&a| a) && r.gate_resident.iter().all(|&g| g));
        assert_eq!(r.cache_neurons, vec![100; 4]);
    }

    #[test]
    fn the_device_plan_keeps_output_attention_then_gates_the_host_holds_within_its_budget() {
        let s = sizes();
        let ram = s.plan(20_000, Priority::GateFirst).unwrap();
        // Norms 1000 - output 400 = 600; one layer's use 300 + 500 + 100 x 10 = 1800 > output.
        let min = 600 + 1800;
        let e = s.plan_device(min - 1, 400, &ram).unwrap_err().to_string();
        assert!(e.contains("--vram-budget") && e.contains(&min.to_string()), "{e}");
        let d = s.plan_device(min, 400, &ram).unwrap();
        assert_eq!(d.minimum_bytes, min);
        // An output matrix larger than a layer's copies: the minimum leaves room for its copy,
        // and keeping it resident needs no second room.
        let b = ModelSizes {
            required_bytes: 5600,
            ..sizes()
        };
        let big = b.plan_device(600 + 5000, 5000, &ram).unwrap();
        assert!(!big.output_resident && big.resident_bytes() <= 5600, "{big:?}");
        assert!(b.plan_device(600 + 4999, 5000, &ram).is_err());
        let kept = b.plan_device(600 + 1800 + 5000, 5000, &ram).unwrap();
        assert!(kept.output_resident && kept.resident_bytes() <= 7400, "{kept:?}");
        assert!(!d.output_resident && d.attention_resident.iter().all(|&a| !a));
        // Nothing resident: output + attention + gates + every FFN row per token.
        assert_eq!(d.copied_bytes_per_token, 400 + 4 * 300 + 4 * 500 + 4 * 1000);
        for budget in [
            min,
            min + 399,
            min + 400,
            min + 700,
            min + 1600,
            min + 2100,
            min + 10_000,
        ] {
            let d = s.plan_device(budget, 400, &ram).unwrap();
            assert!(d.resident_bytes() <= budget, "{budget}: {d:?}");
            // Output first, then attention layer by layer, then gates (what does not fit at its
            // turn is skipped; a gate, larger than any attention here, fits only after all of it).
            assert_eq!(d.output_resident, budget - min >= 400, "{budget}: {d:?}");
            if d.gate_resident.iter().any(|&g| g) {
                assert!(d.attention_resident.iter().all(|&a| a), "{budget}: {d:?}");
            }
            let kept = d.output_bytes + d.attention_bytes + d.gate_bytes + d.hot_bytes;
            assert_eq!(d.copied_bytes_per_token + kept, 400 + 1200 + 2000 + 4000, "{budget}");
            // Hot neurons take only what no gate fitted in (less than one gate's 500 bytes).
            if d.gate_resident.iter().any(|&g| !g) {
                assert!(d.hot_bytes < 500, "{budget}: {d:?}");
            }
        }
        let gates = s.plan_device(min + 400 + 1200 + 2000, 400, &ram).unwrap();
        assert!(gates.gate_resident.iter().all(|&g| g));
        assert_eq!(
            (gates.hot_bytes, gates.copied_bytes_per_token),
            (0, 4000),
            "only the FFN rows are copied"
        );
        let all = s.plan_device(min + 10_000, 400, &ram).unwrap();
        assert!(all.output_resident && all.gate_resident.iter().all(|&g| g));
        assert_eq!(all.hot_neurons, vec![100; 4], "every neuron fits");
        assert_eq!(all.copied_bytes_per_token, 0);
        // What the host streams, the device does not keep: it arrives in the stream's buffers.
        let tight = s.plan(3600, Priority::GateFirst).unwrap();
        assert!(tight.attention_resident.iter().any(|&a| !a));
        let d = s.plan_device(min + 10_000, 400, &tight).unwrap();
        for l in 0..4 {
            assert!(!d.attention_resident[l] || tight.attention_resident[l]);
            assert!(!d.gate_resident[l] || tight.gate_resident[l]);
        }
    }

    #[test]
    fn hot_neurons_take_the_device_budget_left_evenly_within_what_the_host_caches() {
        let s = sizes();
        let ram = s.plan(20_000, Priority::GateFirst).unwrap();
        let min = 600 + 1800;
        let after_gates = min + 400 + 1200 + 2000;
        // 1000 left: 250 a layer, 25 neurons of 10 bytes each.
        let d = s.plan_device(after_gates + 1000, 400, &ram).unwrap();
        assert_eq!(d.hot_neurons, vec![25; 4]);
        assert_eq!(d.hot_bytes, 1000);
        assert_eq!(d.copied_bytes_per_token, 4000 - 1000);
        assert_eq!(d.resident_bytes(), after_gates + 1000);
        // A remainder smaller than a neuron a layer stays unused.
        let d = s.plan_device(after_gates + 1039, 400, &ram).unwrap();
        assert_eq!(d.hot_neurons, vec![25; 4]);
        assert!(d.resident_bytes() <= after_gates + 1039);
        // Layers of different neuron sizes get the same bytes each.
        let mixed = ModelSizes {
            neuron_bytes: vec![10, 20, 10, 20],
            ..sizes()
        };
        let mram = mixed.plan(40_000, Priority::GateFirst).unwrap();
        let mmin = 600 + 300 + 500 + 100 * 20;
        let d = mixed.plan_device(mmin + 400 + 1200 + 2000 + 800, 400, &mram).unwrap();
        assert_eq!(d.hot_neurons, vec![20, 10, 20, 10]);
        // Never more than the host's cache holds (the device's copy comes from it).
        let partial = s.plan(3600 + 1200 + 2000 + 4 * 70, Priority::GateFirst).unwrap();
        assert!(partial.cache_neurons.iter().all(|&c| c < 100), "{partial:?}");
        let d = s.plan_device(min + 10_000, 400, &partial).unwrap();
        assert_eq!(d.hot_neurons, partial.cache_neurons);
        // Mixture-of-experts plans have no neuron cache: no hot neurons.
        let none = Residency {
            cache_neurons: vec![0; 4],
            ..ram.clone()
        };
        assert_eq!(s.plan_device(min + 10_000, 400, &none).unwrap().hot_bytes, 0);
    }

    #[test]
    fn everything_resident_is_a_plan_that_reads_nothing() {
        let s = sizes();
        let r = s.plan(s.everything_bytes(), Priority::GateFirst).unwrap();
        assert!(r.attention_resident.iter().all(|&a| a) && r.gate_resident.iter().all(|&g| g));
        assert_eq!(r.cache_neurons, vec![100; 4]);
        assert!(
            s.plan(s.everything_bytes() - 1, Priority::GateFirst)
                .unwrap()
                .cache_neurons[0]
                < 100
        );
    }

    #[test]
    fn budgets_parse_in_bytes_units_and_percent() {
        assert_eq!(parse_budget("700M", 0).unwrap(), 700_000_000);
        assert_eq!(parse_budget("1.5G", 0).unwrap(), 1_500_000_000);
        assert_eq!(parse_budget("512MiB", 0).unwrap(), 512 << 20);
        assert_eq!(parse_budget("4096", 0).unwrap(), 4096);
        assert_eq!(parse_budget("40%", 1000).unwrap(), 400);
        for bad in ["", "abc", "-5M", "150%", "12Q"] {
            assert!(parse_budget(bad, 1000).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_budget_parsed_before_the_file_is_known_gives_the_same_bytes() {
        assert_eq!(BudgetSize::parse("40%"), Some(BudgetSize::Percent(40.0)));
        assert_eq!(BudgetSize::parse("1.5G"), Some(BudgetSize::Bytes(1_500_000_000)));
        for s in ["700M", "1.5G", "512MiB", "4096", "40%", "0.5 %", " 3K "] {
            let b = BudgetSize::parse(s).unwrap();
            assert_eq!(b.bytes(123_456_789), parse_budget(s, 123_456_789).unwrap(), "{s}");
        }
        for bad in ["", "abc", "-5M", "150%", "12Q", "x%", "auto", "off"] {
            assert_eq!(BudgetSize::parse(bad), None, "{bad}");
        }
    }
}
