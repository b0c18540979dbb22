//! `gatestream run`: generation from a prompt, in RAM or streamed, dense, sparse or both side by side.

use super::*;

pub(crate) fn run(c: RunArgs) -> anyhow::Result<()> {
    let RunArgs {
        model,
        prompt,
        max_tokens,
        ctx_size,
        temperature,
        top_k,
        top_p,
        seed,
        chat,
        logprobs,
        lookup,
        ignore_eos,
        draft,
        draft_max,
        mode,
        sparse,
        stream,
        json,
    } = c;
    if !(0.0..=1.0).contains(&top_p) || top_p == 0.0 {
        anyhow::bail!("--top-p {top_p} must be in (0, 1]");
    }
    if temperature < 0.0 || !temperature.is_finite() {
        anyhow::bail!("--temperature {temperature} must be 0 (greedy) or positive");
    }
    if stream.queue_depth == 0 {
        anyhow::bail!("--queue-depth must be at least 1");
    }
    if (lookup > 0 || draft.is_some()) && stream.record_trace.is_some() {
        anyhow::bail!(
            "--record-trace records one token per position; with --lookup or --draft a pass also runs drafts \
                 that are then rejected: record traces without them"
        );
    }
    let draft = draft.as_deref().map(|p| (p, draft_max));
    let opts = GenerateOptions {
        max_tokens,
        sampler: SamplerConfig {
            temperature,
            top_k,
            top_p,
            seed,
        },
        chat,
        ctx: ctx_size,
        batch_tokens_max: 0,
        logprobs,
        lookup,
        ignore_eos,
        logits_on_host: false,
    };
    stop_on_ctrl_c();
    let asked = sparse.ask();
    let mut stdout = std::io::stdout();
    let live = !json && mode != ModeArg::Compare;
    let mut print = |s: &str| {
        if live {
            let _ = write!(stdout, "{s}");
            let _ = stdout.flush();
        }
    };
    let device = device_of(&model)?;
    match mode {
        ModeArg::Dense | ModeArg::Sparse => {
            let sparse = (mode == ModeArg::Sparse).then_some(&asked);
            let out = generate_one(
                &device,
                &model,
                sparse,
                &stream,
                stream.record_trace.as_deref(),
                draft,
                &prompt,
                &opts,
                &mut print,
            )?;
            if json {
                println!("{}", out.json()?);
            } else {
                println!();
                out.print_stats("");
            }
        }
        ModeArg::Compare => {
            // With --experts-used (a mixture-of-experts model): the model with its own
            // count of experts per token against that many, no neuron mask; else the
            // dense model against the mask.
            let experts = model.experts_used;
            let own = ModelArgs {
                experts_used: None,
                ..model.clone()
            };
            let mask = experts.is_none().then_some(&asked);
            gatestream::runtime::check_streamed_mask(
                &model_path(&model)?,
                stream_ask(
                    &stream,
                    &model_path(&model)?,
                    prompt.len() + opts.max_tokens + 1,
                    &*device,
                )?
                .0
                .is_some(),
                mask.is_some(),
            )?;
            // One device (one thread pool) serves both runs.
            let dense = generate_one(&device, &own, None, &stream, None, draft, &prompt, &opts, &mut |_| {})?;
            // Give the first run's memory back before the second measures its peak.
            gatestream::stream::release_free_memory();
            let sparse = generate_one(
                &device,
                &model,
                mask,
                &stream,
                stream.record_trace.as_deref(),
                draft,
                &prompt,
                &opts,
                &mut |_| {},
            )?;
            let labels = match experts {
                Some(k) => ("own experts".to_string(), format!("{k} experts")),
                None => ("dense".to_string(), "sparse".to_string()),
            };
            let (d, s) = (&dense.generation, &sparse.generation);
            let n = d.tokens.len().min(s.tokens.len());
            let same = d.tokens.iter().zip(&s.tokens).filter(|(a, b)| a == b).count();
            let first_difference = d.tokens.iter().zip(&s.tokens).position(|(a, b)| a != b);
            let agreement = if n == 0 { 1.0 } else { same as f64 / n as f64 };
            let ratios = match (&dense.stream, &sparse.stream) {
                (Some(ds), Some(ss)) => Some(serde_json::json!({
                    "disk_bytes_per_token": ss.disk_bytes_per_token / ds.disk_bytes_per_token.max(1.0),
                    "time_per_token": ds.decode_tok_per_s / ss.decode_tok_per_s.max(1e-9),
                })),
                _ => None,
            };
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "dense": dense.json()?, "sparse": sparse.json()?, "agreement": agreement,
                        "first_difference": first_difference, "sparse_vs_dense": ratios,
                        "experts_used": experts,
                    })
                );
            } else {
                let width = labels.0.len().max(labels.1.len());
                println!("{:width$}: {}", labels.0, d.text);
                println!("{:width$}: {}", labels.1, s.text);
                println!(
                    "agreement: {same}/{n} tokens ({:.1}%), first difference at {}",
                    agreement * 100.0,
                    first_difference.map_or("none".into(), |i| format!("token {i}"))
                );
                dense.print_stats(&format!("{:width$} ", labels.0));
                sparse.print_stats(&format!("{:width$} ", labels.1));
                if let Some(r) = ratios {
                    let time = r["time_per_token"].as_f64().unwrap_or(0.0);
                    eprintln!(
                        "{} / {}: {:.3}x disk bytes per token, {time:.3}x time per token",
                        labels.1,
                        labels.0,
                        r["disk_bytes_per_token"].as_f64().unwrap_or(0.0),
                    );
                    match &sparse.stream {
                        Some(ss) if time > 1.0 && experts.is_none() => eprintln!("{}", slower_sparse_hint(ss)),
                        _ => {}
                    }
                }
            }
        }
    }
    Ok(())
}
