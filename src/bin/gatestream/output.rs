//! What the binary prints: progress on stderr, per-run figures, sparsity levels as a user
//! reads them, and the note that explains a slower sparse run.

use gatestream::model::Model;
use gatestream::runtime::Outcome;

/// Why sparse streaming can take longer than dense, in this run's own figures: on a device
/// where a request costs as much as reading many KB, scattered neuron reads save bytes but not
/// time; what saves time there is the neuron cache.
pub(crate) fn slower_sparse_hint(s: &gatestream::stream::StreamReport) -> String {
    let c = &s.cost_model;
    format!(
        "note: sparse streaming took longer than dense here. The read planner read through gaps under {:.1} KB \
         between needed neurons (its cost model: {:.1} µs per request at {:.0} MB/s; read amplification {:.2}) and \
         paid one request per remaining run: where a request costs as long as reading several KB, the bytes saved \
         do not save time. What does: neurons served from RAM (cache hits {:.0}% here) — a larger --ram-budget — \
         or dense streaming.",
        c.merge_gap_bytes() as f64 / 1e3,
        c.request_us,
        c.bytes_per_us,
        s.read_amplification,
        s.cache_hit_rate * 100.0
    )
}

/// A sparsity level as a user reads it: up to three decimals, no float noise (0.575, 0.6).
pub(crate) fn level(s: f32) -> String {
    let t = format!("{s:.3}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Progress on stderr: a bar redrawn in place (at most 10 times a second) on a terminal, a line
/// every 10 seconds otherwise, and always the final state.
pub(crate) struct Progress {
    started: std::time::Instant,
    last_draw: Option<std::time::Instant>,
    tty: bool,
    /// The stage whose final state was printed (it is printed once).
    finished_stage: Option<String>,
}

impl Progress {
    pub(crate) fn new() -> Progress {
        use std::io::IsTerminal;
        Progress {
            started: std::time::Instant::now(),
            last_draw: None,
            tty: std::io::stderr().is_terminal(),
            finished_stage: None,
        }
    }

    pub(crate) fn update(&mut self, stage: &str, done: usize, total: usize) {
        let total = total.max(1);
        let finished = done >= total;
        let every = if self.tty { 0.1 } else { 10.0 };
        if !finished && self.last_draw.is_some_and(|t| t.elapsed().as_secs_f64() < every) {
            return;
        }
        if finished {
            if self.finished_stage.as_deref() == Some(stage) {
                return;
            }
            self.finished_stage = Some(stage.to_string());
        }
        self.last_draw = Some(std::time::Instant::now());
        let elapsed = self.started.elapsed().as_secs_f64();
        let eta = elapsed / done.max(1) as f64 * (total - done.min(total)) as f64;
        let bar = "#".repeat(30 * done.min(total) / total);
        let line = format!("{stage:>10} [{bar:<30}] {done}/{total}  {elapsed:.0} s elapsed, eta {eta:.0} s");
        if self.tty {
            eprint!("\r{line} ");
            if finished {
                eprintln!();
            }
        } else {
            eprintln!("{line}");
        }
    }
}

/// One generation and what it measured, as `run` prints it.
pub(crate) trait Report {
    fn json(&self) -> anyhow::Result<serde_json::Value>;
    fn print_stats(&self, label: &str);
}

impl Report for Outcome {
    fn json(&self) -> anyhow::Result<serde_json::Value> {
        let mut v = serde_json::to_value(&self.generation)?;
        v["sparsity"] = self.sparsity.clone().unwrap_or(serde_json::Value::Null);
        v["stream"] = serde_json::to_value(&self.stream)?;
        Ok(v)
    }

    fn print_stats(&self, label: &str) {
        let g = &self.generation;
        eprintln!(
            "{label}prompt {} tokens: {:.1} tok/s prefill; generated {} tokens: {:.2} tok/s decode ({})",
            g.prompt_tokens.len(),
            g.prefill_tok_per_s,
            g.tokens.len(),
            g.decode_tok_per_s,
            g.finish.name()
        );
        if let Some(r) = &self.stream {
            let mb = |b: f64| b / 1e6;
            eprintln!(
                "{label}streamed ({}{}): {:.1} MB/token from disk (dense streaming: {:.1} MB planned), read amplification {:.2}, \
                 cache hits {:.1}%, waiting for reads {:.0}% of decode time, peak RSS {:.1} MB (budget {:.1} MB)",
                r.engine,
                if r.direct_io { ", O_DIRECT" } else { "" },
                mb(r.disk_bytes_per_token),
                mb(r.dense_disk_bytes_per_token),
                r.read_amplification,
                r.cache_hit_rate * 100.0,
                r.io_wait_fraction * 100.0,
                mb(r.peak_rss_bytes as f64),
                mb(r.ram_budget_bytes as f64)
            );
            if let Some(a) = &r.lookahead {
                eprintln!(
                    "{label}lookahead: {:.1}% of the neurons read ahead were used; it read {:.1}% of the FFN bytes \
                     the layers needed; {:.1} MB/token read in vain",
                    a.hit_rate * 100.0,
                    a.coverage * 100.0,
                    mb(a.wasted_bytes_per_token)
                );
            }
        }
    }
}

pub(crate) fn print_loaded(model: &Model, seconds: f64) {
    let c = &model.config;
    eprintln!(
        "loaded {} ({}, {} layers, hidden {}, ffn {}, vocab {}) in {seconds:.2} s on {}",
        model.path.display(),
        c.arch.name(),
        c.n_layers,
        c.hidden,
        c.ffn,
        c.vocab,
        model.device.name()
    );
}
