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
    /// Bytes of each kind, as planned (they sum to at most the budget).
    pub required_bytes: u64,
    pub working_bytes: u64,
    /// The KV cache and one batch's activations.
    pub context_bytes: u64,
    pub attention_bytes: u64,
    pub gate_bytes: u64,
    pub cache_bytes: u64,
}

impl Residency {
    /// Whether any attention or gate matrix (or, when FFN rows are prefetched, any neuron the
    /// cache lacks) is read per token by the prefetch thread.
    fn streams_dense(&self, prefetch_ffn: bool, ffn: usize) -> bool {
        self.attention_resident.iter().any(|&a| !a)
            || self.gate_resident.iter().any(|&g| !g)
            || (prefetch_ffn && self.cache_neurons.iter().any(|&c| c < ffn))
    }

    pub fn resident_bytes(&self) -> u64 {
        self.required_bytes
            + self.working_bytes
            + self.context_bytes
            + self.attention_bytes
            + self.gate_bytes
            + self.cache_bytes
    }
}

impl ModelSizes {
    /// Staging for one layer's whole FFN (dense streaming reads every neuron of a layer at once),
    /// twice more with lookahead. (With the readers' buffers, which are always there.)
    fn staging_bytes(&self) -> u64 {
        let layer = (0..self.n_layers)
            .map(|l| self.ffn as u64 * self.neuron_bytes[l])
            .max()
            .unwrap_or(0);
        self.reader_bytes + if self.lookahead { 3 * layer } else { layer }
    }

    /// Two layers' streamed attention + gate (+ FFN rows when prefetched): the one in use and
    /// the one being read.
    fn prefetch_bytes(&self) -> u64 {
        let ffn = |l: usize| {
            if self.prefetch_ffn {
                self.ffn as u64 * self.neuron_bytes[l]
            } else {
                0
            }
        };
        2 * (0..self.n_layers)
            .map(|l| self.attention_bytes[l] + self.gate_bytes[l] + ffn(l))
            .max()
            .unwrap_or(0)
    }

    /// The smallest budget that runs: required + staging + prefetch buffers.
    pub fn minimum_bytes(&self) -> u64 {
        self.required_bytes + self.context_bytes + self.staging_bytes() + self.prefetch_bytes()
    }

    /// Plans residency under `budget_bytes`; refuses a budget below the minimum, naming it.
    pub fn plan(&self, budget_bytes: u64, priority: Priority) -> Result<Residency> {
        let min = self.minimum_bytes();
        if budget_bytes < min {
            return Err(Error::Invalid(format!(
                "--ram-budget {} is too small for this model: at least {} ({:.1} MB) is needed for the output \
                 matrix, norms, the buffers one layer streams through, the KV cache and one batch's activations",
                budget_bytes,
                min,
                min as f64 / 1e6
            )));
        }
        let staging = self.staging_bytes();
        // Prefetch buffers only when something dense streams: plan without them first, and
        // again with them if the plan streams anything.
        let plan = self.plan_with(budget_bytes, priority, staging);
        if plan.streams_dense(self.prefetch_ffn, self.ffn) {
            Ok(self.plan_with(budget_bytes, priority, staging + self.prefetch_bytes()))
        } else {
            Ok(plan)
        }
    }

    fn plan_with(&self, budget_bytes: u64, priority: Priority, working: u64) -> Residency {
        let n = self.n_layers;
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
        let (attention_resident, attention_bytes) = take(&self.attention_bytes, &mut left);
        let cache = |left: &mut u64| -> (Vec<usize>, u64) {
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
            required_bytes: self.required_bytes,
            working_bytes: working,
            context_bytes: self.context_bytes,
            attention_bytes,
            gate_bytes,
            cache_bytes,
        }
    }
}

/// Parses a RAM budget: bytes with an optional K/M/G suffix (powers of 1000; KiB/MiB/GiB for
/// powers of 1024), or a percentage of `file_bytes` ("40%").
pub fn parse_budget(s: &str, file_bytes: u64) -> Result<u64> {
    let bad = || {
        Error::Invalid(format!(
            "--ram-budget {s:?}: give bytes with an optional suffix (700M, 1.5G, 512MiB) or a share of the file (40%)"
        ))
    };
    let t = s.trim();
    if let Some(p) = t.strip_suffix('%') {
        let p: f64 = p.trim().parse().map_err(|_| bad())?;
        if !(0.0..=100.0).contains(&p) {
            return Err(bad());
        }
        return Ok((file_bytes as f64 * p / 100.0) as u64);
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
                    return Ok((v * mult) as u64);
                }
            }
        }
    }
    Err(bad())
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
            // Whatever streams has its prefetch buffers in the budget (staging 1000 + 2 x 800).
            for r in [&c, &s.plan(budget, Priority::GateFirst).unwrap()] {
                let streams = r.gate_resident.iter().chain(&r.attention_resident).any(|&x| !x);
                assert_eq!(r.working_bytes, if streams { 2600 } else { 1000 }, "{budget}: {r:?}");
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
}
