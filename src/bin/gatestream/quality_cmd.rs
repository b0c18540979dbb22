//! `gatestream perplexity`, `eval`, `recommend` and `calibrate`: quality figures, and what a `.gst` file
//! keeps of them.

use super::*;

pub(crate) fn perplexity(c: PerplexityArgs) -> anyhow::Result<()> {
    let PerplexityArgs {
        model,
        text,
        ctx,
        windows,
        json,
        ram_budget,
        io,
    } = c;
    let body = std::fs::read_to_string(&text).with_context(|| format!("reading {}", text.display()))?;
    let rt = open_for_passes(&model, ram_budget, io, ctx)?;
    let passes = gatestream::model::forward::Passes {
        stream: rt.layer_stream(),
        batch_tokens_max: 0,
        cancel: None,
    };
    let mut bar = Progress::new();
    let report = perplexity_with(
        &rt.model,
        passes,
        &body,
        &PerplexityOptions { ctx, windows },
        &mut |done, total, ppl| bar.update(&format!("ppl {ppl:.3}"), done, total),
    )?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "perplexity {:.4} over {} windows of {} tokens ({} scored) in {:.1} s ({:.1} tok/s)",
            report.perplexity, report.windows, report.ctx, report.scored_tokens, report.seconds, report.tokens_per_s
        );
    }
    Ok(())
}

pub(crate) fn eval(c: EvalArgs) -> anyhow::Result<()> {
    let EvalArgs {
        model,
        text,
        ctx,
        windows,
        sparsity,
        strategy,
        criterion,
        calibrate_tokens,
        max_ppl_increase,
        per_layer_tokens,
        experts,
        plot,
        store,
        store_in,
        json,
        checkpoint,
        windows_this_run,
        jitter_seeds,
        ram_budget,
        io,
    } = c;
    use gatestream::eval::{eval_with, table, EvalOptions};
    let checkpoint = checkpoint.or_else(|| {
        json.as_ref().map(|j| {
            let mut name = j.as_os_str().to_owned();
            name.push(".checkpoint");
            PathBuf::from(name)
        })
    });
    if windows_this_run.is_some() && checkpoint.is_none() {
        anyhow::bail!("--windows-this-run needs a checkpoint to continue from: pass --checkpoint FILE or --json FILE");
    }
    // KV positions: a window, a calibration window (512 + BOS), the sensitivity tokens.
    let kv = ctx.max(513).max(per_layer_tokens + 1);
    let rt = open_for_passes(&model, ram_budget, io, kv)?;
    let passes = gatestream::model::forward::Passes {
        stream: rt.layer_stream(),
        batch_tokens_max: 0,
        cancel: None,
    };
    let model = &rt.model;
    let body = std::fs::read_to_string(&text).with_context(|| format!("reading {}", text.display()))?;
    let opts = EvalOptions {
        ctx,
        windows,
        sparsities: sparsity,
        strategies: strategy.iter().map(|&s| strategy_of(s)).collect(),
        criteria: criterion.iter().map(|&c| criterion_of(c)).collect(),
        calibrate_tokens,
        max_ppl_increase_pct: max_ppl_increase,
        per_layer_tokens,
        checkpoint: checkpoint.clone(),
        windows_this_run,
        jitter_seeds,
        experts,
    };
    let name = text.file_name().and_then(|n| n.to_str()).unwrap_or("text").to_string();
    let mut bar = Progress::new();
    let Some(report) = eval_with(model, passes, &body, &name, &opts, &mut |stage, d, n| {
        bar.update(stage, d, n)
    })?
    else {
        eprintln!(
                "stopped after --windows-this-run {} windows; progress is saved in {}: run the same command again to continue",
                windows_this_run.unwrap_or(0),
                checkpoint.as_ref().expect("checked above").display()
            );
        return Ok(());
    };
    print!("{}", table(&report));
    if let Some(path) = json {
        write_file(&path, &serde_json::to_string_pretty(&report)?)?;
    }
    if let Some(path) = plot {
        write_file(&path, &gatestream::eval::chart(&report).svg())?;
    }
    if let Some(path) = &checkpoint {
        // The report is written: the progress it was made from is no longer needed.
        if path.exists() {
            std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    if store || store_in.is_some() {
        let target = store_in.clone().unwrap_or_else(|| model.path.clone());
        let evaluated = model.path.clone();
        drop(rt);
        let r = &report;
        store_frontier(
            &r.rows,
            r.max_ppl_increase_pct,
            &r.text,
            r.windows,
            r.ctx,
            &evaluated,
            &target,
        )?;
    }
    Ok(())
}

pub(crate) fn recommend(c: RecommendArgs) -> anyhow::Result<()> {
    let RecommendArgs {
        report,
        model,
        max_ppl_increase,
    } = c;
    let mut reports = Vec::with_capacity(report.len());
    for path in &report {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let r: gatestream::eval::SavedReport = serde_json::from_slice(&bytes)
            .with_context(|| format!("{}: not an eval report (gatestream eval --json)", path.display()))?;
        reports.push((path.display().to_string(), r));
    }
    let r = gatestream::eval::merge_reports(reports)?;
    store_frontier(
        &r.rows,
        max_ppl_increase,
        &r.text,
        r.windows,
        r.ctx,
        std::path::Path::new(&r.model),
        &model,
    )?;
    Ok(())
}

pub(crate) fn calibrate(c: CalibrateArgs) -> anyhow::Result<()> {
    let CalibrateArgs {
        model,
        text,
        tokens,
        threads,
    } = c;
    let mut bar = Progress::new();
    let cal = gatestream::reformat::recalibrate(&model, &text, tokens, threads, &mut |stage, d, n| {
        bar.update(stage, d, n)
    })?;
    let n = cal.layers.len().max(1) as f32;
    println!(
        "{}: calibrated on {}; first 10% / 25% of neurons cover {:.1}% / {:.1}% of activations on average",
        model.display(),
        cal.text,
        cal.layers.iter().map(|l| l.hot_prefix_10).sum::<f32>() / n * 100.0,
        cal.layers.iter().map(|l| l.hot_prefix_25).sum::<f32>() / n * 100.0
    );
    Ok(())
}
