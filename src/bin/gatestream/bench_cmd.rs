//! `gatestream bench`: the I/O benchmark, and the device's own curve.

use super::*;

pub(crate) fn bench(c: BenchArgs) -> anyhow::Result<()> {
    let BenchArgs {
        model,
        trace,
        text,
        trace_tokens,
        sparsity,
        strategy,
        criterion,
        tokens,
        engines,
        queue_depths,
        gate_resident,
        cache_neurons,
        merge_gap_bytes,
        token_batches,
        quick,
        device_only,
        cache_experts,
        json,
        plot,
        device,
    } = c;
    use gatestream::bench::{bench, link_table, plot as bench_plot, table, BenchOptions, EngineConfig};
    if device_only {
        let mut bar = Progress::new();
        let curve = gatestream::bench::device_curve(
            &model,
            &[256 << 10, 1 << 20, 4 << 20],
            &[4, 16, 64],
            if quick { 64 << 20 } else { 256 << 20 },
            &[4096, 16384, 65536, 262144, 1 << 20],
            if quick { 1024 } else { 4096 },
            &mut |stage, done, total| bar.update(stage, done, total),
        )?;
        drop(bar);
        print!("{}", gatestream::bench::curve_table(&curve));
        if let Some(p) = json {
            std::fs::write(&p, serde_json::to_vec_pretty(&curve)?)?;
        }
        return Ok(());
    }
    // The link first: a missing GPU is refused before the disk work starts.
    let link = match device {
        DeviceArg::Cpu => None,
        kind => {
            let dev = open_named_device(kind, 0, &[], &[])?;
            let sizes: Vec<usize> = if quick {
                vec![64 << 10, 1 << 20, 16 << 20]
            } else {
                gatestream::backend::LINK_SIZES.to_vec()
            };
            match dev.measure_link(&sizes) {
                Some(rows) => {
                    let rows = rows?;
                    print!("{}", link_table(&rows));
                    Some(rows)
                }
                None => None,
            }
        }
    };
    let (tokens, trace_tokens, sparsity, queue_depths) = if quick {
        (2, 16, vec![0.5], vec![8, 64])
    } else {
        (tokens, trace_tokens, sparsity, queue_depths)
    };
    let moe = gatestream::gstfile::GstFile::open(&model)
        .ok()
        .and_then(|g| g.index.config.moe.clone().map(|m| (m, g.index.config.expert_layers())));
    let mut traces = Vec::new();
    let mut routes = Vec::new();
    for p in &trace {
        match (AnyTrace::read(p)?, &moe) {
            (AnyTrace::Neurons(t), None) => traces.push(t),
            (AnyTrace::Routes(t), Some(_)) => routes.push(t),
            (AnyTrace::Neurons(_), Some(_)) => anyhow::bail!(
                "{}: a trace of neurons; {} is a mixture-of-experts model, whose bench replays routing traces \
                     (`run --record-trace FILE` on it)",
                p.display(),
                model.display()
            ),
            (AnyTrace::Routes(_), None) => anyhow::bail!(
                "{}: a routing trace of a mixture-of-experts model; {} is dense",
                p.display(),
                model.display()
            ),
        }
    }
    // Built-in traces over the start of --text: routing traces of a mixture of experts,
    // else one trace of neurons per --sparsity.
    if (moe.is_some() && routes.is_empty()) || (moe.is_none() && traces.is_empty()) {
        let text = text.unwrap_or_else(|| PathBuf::from("data/wikitext-2/wiki.test.raw"));
        let body = std::fs::read_to_string(&text)
            .with_context(|| format!("reading {} (give --text or --trace)", text.display()))?;
        let rt = open_plain(&model, Arc::new(CpuBackend::new(0)), 0, None, IoArg::Pread, 0, None)?;
        let m = &rt.model;
        let mut ids = m.tokenizer.encode(&body, true)?;
        ids.truncate(trace_tokens.max(1));
        let name = text
            .file_name()
            .map_or("text".into(), |n| n.to_string_lossy().into_owned());
        let passes = gatestream::model::forward::Passes::default;
        if moe.is_some() {
            routes.push(gatestream::bench::trace::record_routes(m, passes(), &ids, &name)?);
        }
        for &s in sparsity.iter().filter(|_| moe.is_none()) {
            let masker = Masker::for_model(m, strategy_of(strategy), criterion_of(criterion), s, None)?;
            traces.push(gatestream::bench::trace::record(m, passes(), &ids, &masker, &name)?);
        }
    }
    let mut configs = Vec::new();
    let deepest = queue_depths.iter().copied().max().unwrap_or(64);
    for e in &engines {
        match e {
            IoArg::Uring => {
                for &qd in &queue_depths {
                    configs.push(EngineConfig {
                        engine: "uring",
                        queue_depth: qd,
                        fixed_buffers: true,
                    });
                }
                configs.push(EngineConfig {
                    engine: "uring",
                    queue_depth: deepest,
                    fixed_buffers: false,
                });
            }
            IoArg::Pread => configs.push(EngineConfig {
                engine: "pread",
                queue_depth: deepest,
                fixed_buffers: false,
            }),
            IoArg::Mmap => configs.push(EngineConfig {
                engine: "mmap",
                queue_depth: 1,
                fixed_buffers: false,
            }),
        }
    }
    let opts = BenchOptions {
        engines: configs,
        tokens,
        gate_streamed: !gate_resident,
        cache_neurons,
        baseline_sizes: vec![4096, 16384, 65536, 262144],
        baseline_random_reads: if quick { 256 } else { 4096 },
        baseline_seq_bytes: if quick { 16 << 20 } else { 256 << 20 },
        merge_gap_bytes,
        token_batches,
    };
    if let Some((m, n_layers)) = &moe {
        use gatestream::bench::experts::{bench_experts, table as experts_table, ExpertBenchOptions};
        let all = n_layers * m.n_experts;
        let mut sizes = Vec::new();
        for c in &cache_experts {
            let n = match c.strip_suffix('%') {
                Some(p) => {
                    let share: f64 = p
                        .parse()
                        .ok()
                        .filter(|s: &f64| (0.0..=100.0).contains(s))
                        .with_context(|| format!("--cache-experts {c}: a share from 0% to 100%"))?;
                    (all as f64 * share / 100.0).round() as usize
                }
                None => c
                    .parse()
                    .with_context(|| format!("--cache-experts {c}: a count of experts or a share (30%)"))?,
            };
            if !sizes.contains(&n) {
                sizes.push(n);
            }
        }
        let x = ExpertBenchOptions {
            cache_experts: sizes,
            policies: vec![CachePolicy::Lru, CachePolicy::Frequency],
        };
        let mut bar = Progress::new();
        let mut report = bench_experts(&model, &routes, &opts, &x, &mut |stage, d, n| bar.update(stage, d, n))?;
        report.link = link;
        print!("{}", experts_table(&report));
        if let Some(path) = json {
            write_file(&path, &serde_json::to_string_pretty(&report)?)?;
        }
        if let Some(path) = plot {
            write_file(&path, &gatestream::bench::experts::plot(&report))?;
        }
        return Ok(());
    }
    let mut bar = Progress::new();
    let mut report = bench(&model, &traces, &opts, &mut |stage, d, n| bar.update(stage, d, n))?;
    report.link = link;
    print!("{}", table(&report));
    if let Some(path) = json {
        write_file(&path, &serde_json::to_string_pretty(&report)?)?;
    }
    if let Some(path) = plot {
        write_file(&path, &bench_plot(&report))?;
    }
    Ok(())
}
