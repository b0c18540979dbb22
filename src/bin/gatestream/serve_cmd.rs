//! `gatestream serve`: the OpenAI-compatible server.

use super::*;

pub(crate) fn serve(c: ServeArgs) -> anyhow::Result<()> {
    let ServeArgs {
        model,
        host,
        port,
        parallel,
        queue,
        ctx_size,
        step_tokens,
        max_body_bytes,
        alias,
        mode,
        sparse,
        lookup,
        draft,
        draft_max,
        shutdown_grace,
        no_webui,
        stream,
    } = c;
    if stream.record_trace.is_some() {
        anyhow::bail!("--record-trace records one run's neurons; it is not for serve (use `run`)");
    }
    if sparse.strategy == Some(StrategyArg::Union) {
        anyhow::bail!(
            "--strategy union learns one set of neurons from one prompt; a server decodes several requests \
                 at once: use topk or threshold"
        );
    }
    if mode == ModeArg::Compare {
        anyhow::bail!(
            "--mode compare runs two generations side by side; a server compares per request: start it \
                 with --mode dense or sparse and POST /v1/infer with \"mode\": \"compare\""
        );
    }
    if !(shutdown_grace.is_finite() && shutdown_grace >= 0.0) {
        anyhow::bail!("--shutdown-grace {shutdown_grace} must be a number of seconds, 0 or more");
    }
    let path = model_path(&model)?;
    let device = device_of(&model)?;
    let slot_ctx = if ctx_size == 0 {
        gatestream::runtime::SLOT_CONTEXT_DEFAULT
    } else {
        ctx_size
    };
    let (stream_opts, placement) = stream_ask(&stream, &path, slot_ctx.saturating_mul(parallel.max(1)), &*device)?;
    if let Some(d) = &placement {
        eprintln!("{}", d.describe());
    }
    let streaming = stream_opts.is_some();
    let sparse = (mode == ModeArg::Sparse || !streaming).then(|| sparse.ask());
    let opts = OpenOptions {
        threads: model.threads,
        stream: stream_opts,
        sparse,
        // Streaming, the budget counts every slot's KV cache.
        kv_positions: KvPositions::Sequences {
            ctx: ctx_size,
            sequences: parallel,
        },
        experts_used: model.experts_used,
    };
    let model_id = alias.unwrap_or_else(|| {
        path.file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned())
    });
    let serve_opts = gatestream::serve::ServeOptions {
        host,
        port,
        parallel,
        queue,
        ctx: ctx_size,
        step_tokens,
        max_body_bytes,
        default_mode: if mode == ModeArg::Sparse {
            gatestream::serve::Mode::Sparse
        } else {
            gatestream::serve::Mode::Dense
        },
        model_id,
        shutdown_grace: std::time::Duration::from_secs_f64(shutdown_grace),
        lookup,
        webui: !no_webui,
    };
    let load = Box::new(move || {
        gatestream::stream::reset_peak_rss();
        let t = std::time::Instant::now();
        let mut rt = gatestream::runtime::open_on(&path, &opts, device)?;
        if let Some(d) = &draft {
            rt.attach_draft(d, draft_max)?;
        }
        let _ = describe(&rt, t.elapsed().as_secs_f64());
        let ctx = gatestream::runtime::slot_context(&rt.model, ctx_size);
        eprintln!(
            "ready: {parallel} sequences at once, {ctx} tokens of context each, {}",
            if rt.mask.is_some() {
                "dense and sparse requests"
            } else {
                "dense requests"
            }
        );
        Ok(rt)
    });
    gatestream::serve::serve(serve_opts, load, &mut |addr| {
        eprintln!("listening on http://{addr} (the model loads meanwhile: /health answers 503 until ready)");
        if !no_webui {
            eprintln!("chat page: http://{addr}/ (--no-webui turns it off)");
        }
    })?;
    Ok(())
}
