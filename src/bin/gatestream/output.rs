//! What the binary prints: progress on stderr, per-run figures, sparsity levels as a user
//! reads them, and the note that explains a slower sparse run.

use gatestream::model::Model;
use gatestream::runtime::Outcome;

/// Writes a report file (`--json`, `--plot`), naming the file when that fails.
pub(crate) fn write_file(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
}

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

/// Progress on stderr through `indicatif`: one bar per stage (reformat, calibrate, eval, bench)
/// with elapsed time and ETA, drawn only when stderr is a terminal; when it is not (a log, CI),
/// one line per finished stage instead, so logs keep what was done and how long it took.
pub(crate) struct Progress {
    bar: Option<(String, indicatif::ProgressBar)>,
    tty: bool,
    /// The last stage finished (its final state is shown once, however often it is reported).
    finished: Option<String>,
}

impl Progress {
    pub(crate) fn new() -> Progress {
        use std::io::IsTerminal;
        Progress {
            bar: None,
            tty: std::io::stderr().is_terminal(),
            finished: None,
        }
    }

    pub(crate) fn update(&mut self, stage: &str, done: usize, total: usize) {
        if done >= total && self.bar.is_none() && self.finished.as_deref() == Some(stage) {
            return;
        }
        if self.bar.as_ref().is_none_or(|(s, _)| s != stage) {
            self.finish();
            let bar = if self.tty {
                indicatif::ProgressBar::new(total as u64)
            } else {
                indicatif::ProgressBar::hidden()
            };
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{prefix:>10} [{bar:30}] {pos}/{len}  {elapsed} elapsed, eta {eta}",
                )
                .expect("a valid template")
                .progress_chars("#>-"),
            );
            bar.set_prefix(stage.to_string());
            self.bar = Some((stage.to_string(), bar));
        }
        let (_, bar) = self.bar.as_ref().expect("set above");
        bar.set_length(total as u64);
        bar.set_position(done.min(total) as u64);
        if done >= total {
            self.finish();
        }
    }

    fn finish(&mut self) {
        if let Some((stage, bar)) = self.bar.take() {
            bar.finish();
            self.finished = Some(stage.clone());
            if !self.tty {
                eprintln!(
                    "{stage:>10}: {}/{} in {:.1} s",
                    bar.position(),
                    bar.length().unwrap_or(0),
                    bar.elapsed().as_secs_f64()
                );
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
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
        v["placement"] = serde_json::to_value(&self.placement)?;
        Ok(v)
    }

    fn print_stats(&self, label: &str) {
        let g = &self.generation;
        eprintln!(
            "{label}prompt {} tokens: {:.1} tok/s prefill; generated {} tokens: {:.2} tok/s decode ({})",
            g.prompt_tokens,
            g.prefill_tok_per_s,
            g.tokens.len(),
            g.decode_tok_per_s,
            g.finish.name()
        );
        if let Some(sp) = &g.speculative {
            let source = match sp.source {
                "draft" => format!("draft model, {:.2} s drafting", sp.draft_seconds),
                _ => "prompt lookup".to_string(),
            };
            eprintln!(
                "{label}{source} (up to {} drafts per pass): {} of {} drafts kept ({:.1}%), {:.2} tokens per pass \
                 over {} passes",
                sp.lookup_max,
                sp.accepted,
                sp.drafted,
                sp.acceptance_rate * 100.0,
                sp.tokens_per_pass,
                sp.passes
            );
        }
        if let Some(r) = &self.stream {
            let mb = |b: f64| b / 1e6;
            eprintln!(
                "{label}streamed ({}{}): {:.1} MB/token from disk (dense streaming: {:.1} MB planned), read amplification {:.2}, \
                 {:.0}% read in place ({:.0}% of that into registered buffers), \
                 cache hits {:.1}%, waiting for reads {:.0}% of decode time, peak RSS {:.1} MB (budget {:.1} MB)",
                r.engine,
                if r.direct_io { ", O_DIRECT" } else { "" },
                mb(r.disk_bytes_per_token),
                mb(r.dense_disk_bytes_per_token),
                r.read_amplification,
                r.in_place_fraction * 100.0,
                r.in_place_registered_fraction * 100.0,
                r.cache_hit_rate * 100.0,
                r.io_wait_fraction * 100.0,
                mb(r.peak_rss_bytes as f64),
                mb(r.ram_budget_bytes as f64)
            );
            if let Some(k) = &r.link {
                eprintln!(
                    "{label}to the device: {:.1} MB/token in {:.0} copies, {:.0}% from page-locked memory ({:.0}% staged, \
                     copied while the rest was read; {:.2} ms/token in copies{}), {} back to the host{}{}",
                    mb(k.bytes_per_token),
                    k.copies_per_token,
                    k.pinned_fraction * 100.0,
                    k.staged_fraction * 100.0,
                    k.copy_s_per_token * 1e3,
                    if k.copy_gb_per_s > 0.0 {
                        format!(", {:.1} GB/s", k.copy_gb_per_s)
                    } else {
                        String::new()
                    },
                    match k.to_host_bytes_per_token {
                        b if b < 1e3 => format!("{b:.0} bytes/token"),
                        b => format!("{:.1} KB/token", b / 1e3),
                    },
                    match k.host_waits_per_token {
                        w if w > 0.0 => format!(" in {w:.1} waits/token"),
                        _ => String::new(),
                    },
                    match &r.device_plan {
                        Some(d) if d.kept_bytes > 0 => format!(
                            "; device budget {:.1} MB, {:.1} MB of it keeping copies of routed experts, {:.1} MB/token \
                             of experts found there (not copied)",
                            mb(d.budget_bytes as f64),
                            mb(d.kept_bytes as f64),
                            mb(k.kept_bytes_per_token)
                        ),
                        Some(d) => format!(
                            "; device budget {:.1} MB, {:.1} MB resident ({:.1} MB of it hot neurons, {:.1} MB/token \
                             computed from them), {:.1} MB/token planned for dense",
                            mb(d.budget_bytes as f64),
                            mb(d.resident_bytes() as f64),
                            mb(d.hot_bytes as f64),
                            mb(k.hot_bytes_per_token),
                            mb(d.copied_bytes_per_token as f64)
                        ),
                        None => String::new(),
                    }
                );
            }
            if let Some(h) = &r.hybrid {
                eprintln!(
                    "{label}hybrid ({}): the CPU computed the {} of {:.1} layers/token, {:.1} MB/token in {:.2} ms/token \
                     ({:.1} GB/s){}",
                    h.plan.mode.name(),
                    h.plan.what,
                    h.cpu_layers_per_token,
                    mb(h.cpu_bytes_per_token),
                    h.cpu_s_per_token * 1e3,
                    h.cpu_gb_per_s,
                    match &r.link {
                        Some(k) => format!(
                            "; activations to the device {:.1} KB/token",
                            k.activation_bytes_per_token / 1e3
                        ),
                        None => String::new(),
                    }
                );
            }
            if let Some(x) = &r.experts {
                eprintln!(
                    "{label}experts: {:.1} routed per token, {:.1} read on demand and {:.1} ahead; {} cache of {} of {} \
                     experts ({:.1} MB each): {:.1}% hits, {:.1}% in memory when the layer ran (cache or lookahead)",
                    x.routed_per_token,
                    x.read_per_token,
                    x.read_ahead_per_token,
                    x.policy,
                    x.cache_slots,
                    x.experts_total,
                    mb(x.expert_bytes as f64),
                    x.cache_hit_rate * 100.0,
                    x.in_memory_rate * 100.0
                );
            }
            if let (Some(a), Some(_)) = (&r.lookahead, &r.experts) {
                eprintln!(
                    "{label}lookahead: {:.1}% of the experts read ahead were used; {:.1} MB/token read in vain",
                    a.hit_rate * 100.0,
                    mb(a.wasted_bytes_per_token)
                );
            } else if let Some(a) = &r.lookahead {
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
    let ffn = match &c.moe {
        None => format!("ffn {}", c.ffn),
        Some(m) => {
            format!(
                "{} experts of ffn {}, {} per token{}",
                m.n_experts,
                c.ffn,
                m.n_used,
                if m.shared_ffn > 0 {
                    format!(", a shared expert of ffn {}", m.shared_ffn)
                } else {
                    String::new()
                }
            ) + &if m.leading_dense > 0 {
                format!(" (the first {} layers dense, ffn {})", m.leading_dense, m.dense_ffn)
            } else {
                String::new()
            }
        }
    };
    eprintln!(
        "loaded {} ({}, {} layers, hidden {}, {ffn}, vocab {}) in {seconds:.2} s on {}",
        model.path.display(),
        c.arch.name(),
        c.n_layers,
        c.hidden,
        c.vocab,
        model.device.name()
    );
}

/// What a dense model's streaming plan keeps and reads (stderr): the fixed parts, then each
/// kind of weight kept with what a byte of it saves per token (the plan's order of
/// preference), and the bytes read per token.
pub(crate) fn print_residency(s: &gatestream::stream::Streamer, open_s: f64, sparsity: Option<f32>) {
    let r = &s.residency;
    let mb = |b: u64| b as f64 / 1e6;
    let count = |v: &[bool]| format!("{}/{}", v.iter().filter(|&&k| k).count(), v.len());
    let buffers = match r.prefetch_buffers {
        0 => format!("buffers {:.1} MB", mb(r.working_bytes)),
        n => format!(
            "buffers {:.1} MB ({n} prefetch x {:.1} MB, readers and staging {:.1} MB)",
            mb(r.working_bytes),
            mb(r.prefetch_buffer_bytes),
            mb(r.working_bytes - n as u64 * r.prefetch_buffer_bytes)
        ),
    };
    eprintln!(
        "streaming under {:.1} MB ({:.2} s to load what is resident): required {:.1} MB (output matrix, norms), \
         {buffers}, KV cache + batch {:.1} MB",
        mb(r.budget_bytes),
        open_s,
        mb(r.required_bytes),
        mb(r.context_bytes),
    );
    let ffn = match r.up_resident.is_empty() {
        true => {
            // A cached neuron saves its bytes only when the mask keeps it.
            let share = sparsity.map_or(1.0, |s| 1.0 - s);
            format!(
                "neuron cache {:.1} MB ({} neurons/layer: {:.2} per byte, the share of neurons a token uses)",
                mb(r.cache_bytes),
                r.cache_neurons.first().copied().unwrap_or(0),
                share
            )
        }
        false => format!(
            "up {} and down {} layers ({:.1} MB)",
            count(&r.up_resident),
            count(&r.down_resident),
            mb(r.ffn_matrix_bytes)
        ),
    };
    eprintln!(
        "  kept, by bytes saved per token per byte kept: attention {} layers ({:.1} MB), gate {} layers ({:.1} MB) \
         and every whole matrix save 1 per byte; {ffn}; {:.1} MB read per token when dense",
        count(&r.attention_resident),
        mb(r.attention_bytes),
        count(&r.gate_resident),
        mb(r.gate_bytes),
        mb(s.dense_bytes_per_token)
    );
}
