//! `gatestream reformat`, `make-moe`, `inspect` and `verify`: writing and checking model files.

use super::*;

pub(crate) fn reformat(c: ReformatArgs) -> anyhow::Result<()> {
    let ReformatArgs {
        input,
        output,
        ffn_layout,
        down_type,
        order,
        calibrate,
        calibrate_tokens,
        matrix_type,
        up_sketch,
        force,
        threads,
        json,
    } = c;
    use gatestream::format::{NeuronOrder, UpSketch};
    use gatestream::quant::GgmlType;
    use gatestream::reformat::{reformat, ReformatOptions};
    let opts = ReformatOptions {
        ffn_layout: ffn_layout.into(),
        down_type: down_type.into(),
        order: match order {
            OrderArg::Original => NeuronOrder::Original,
            OrderArg::HotFirst => NeuronOrder::HotFirst,
        },
        calibrate_text: calibrate,
        calibrate_tokens,
        matrix_type: matrix_type.map(|t| match t {
            TypeArg::F32 => GgmlType::F32,
            TypeArg::F16 => GgmlType::F16,
            TypeArg::Bf16 => GgmlType::BF16,
            TypeArg::Q8_0 => GgmlType::Q8_0,
        }),
        up_sketch: match up_sketch {
            SketchArg::None => UpSketch::None,
            SketchArg::TwoBit => UpSketch::TwoBit,
        },
        force,
        threads,
    };
    let mut bar = Progress::new();
    let report = reformat(&input, &output, &opts, &mut |stage, done, total| {
        bar.update(stage, done, total)
    })?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let errs = &report.down_requant_rel_rms;
        let max = errs.iter().copied().fold(0f32, f32::max);
        let mean = errs.iter().sum::<f32>() / errs.len().max(1) as f32;
        let down = if errs.is_empty() {
            "down kept as stored (the rows layout and experts are not re-quantized)".to_string()
        } else {
            format!("down re-quantization relative RMS error: mean {mean:.4}, max {max:.4}")
        };
        println!(
            "wrote {} ({:.1} MB, {} sections) in {:.1} s (calibration {:.1} s); {down}",
            report.output.display(),
            report.file_len_bytes as f64 / 1e6,
            report.sections,
            report.seconds,
            report.calibration_seconds,
        );
    }
    Ok(())
}

pub(crate) fn make_moe(c: MakeMoeArgs) -> anyhow::Result<()> {
    let MakeMoeArgs {
        model,
        output,
        arch,
        experts,
        used,
        ty,
        random,
        perturb,
        seed,
        force,
        json,
    } = c;
    use gatestream::config::Arch;
    use gatestream::quant::GgmlType;
    let dense = match model {
        Some(m) => m,
        None => default_model()?,
    };
    if output.exists() && !force {
        anyhow::bail!("{} exists; pass --force to replace it", output.display());
    }
    let spec = gatestream::synth::MoeSpec {
        arch: match arch {
            MoeArchArg::Llama => Arch::Llama,
            MoeArchArg::Qwen2moe => Arch::Qwen2Moe,
            MoeArchArg::Qwen3moe => Arch::Qwen3Moe,
            MoeArchArg::Olmoe => Arch::Olmoe,
        },
        experts,
        used,
        ty: match ty {
            MoeTypeArg::F32 => GgmlType::F32,
            MoeTypeArg::F16 => GgmlType::F16,
            MoeTypeArg::Q8_0 => GgmlType::Q8_0,
            MoeTypeArg::Q4_0 => GgmlType::Q4_0,
            MoeTypeArg::Q4K => GgmlType::Q4_K,
            MoeTypeArg::Q6K => GgmlType::Q6_K,
        },
        random,
        perturb,
        seed,
    };
    let mut bar = Progress::new();
    let report = gatestream::synth::write_moe(&dense, &spec, &output, &mut |done, total| {
        bar.update("layers", done, total)
    })?;
    drop(bar);
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "wrote {} ({:.1} MB): {} {} experts, {} used, {} layers, hidden {}, expert FFN {}",
            output.display(),
            report.bytes as f64 / 1e6,
            report.arch,
            report.experts,
            report.used,
            report.layers,
            report.hidden,
            report.expert_ffn
        );
    }
    Ok(())
}

pub(crate) fn inspect(c: InspectArgs) -> anyhow::Result<()> {
    let InspectArgs { file, json } = c;
    let g = gatestream::gstfile::GstFile::open(&file)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&g.index)?);
    } else {
        print!("{}", gatestream::inspect::describe(&g));
    }
    Ok(())
}

pub(crate) fn verify(c: VerifyArgs) -> anyhow::Result<()> {
    let VerifyArgs { file } = c;
    let g = gatestream::gstfile::GstFile::open(&file)?;
    let mut bar = Progress::new();
    let mb = |done: u64, total: u64| if done == total { total.div_ceil(1 << 20) } else { done >> 20 } as usize;
    g.verify(&mut |done, total| bar.update("verify MB", mb(done, total), mb(total, total)))?;
    println!(
        "{}: header, index and {} sections verified ({:.1} MB)",
        file.display(),
        g.index.sections.len(),
        g.header.file_len_bytes as f64 / 1e6
    );
    Ok(())
}
