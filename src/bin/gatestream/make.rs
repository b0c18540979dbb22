//! `gatestream make-model`: the flags turned into a `synth::MakeSpec`, the file written with a
//! progress bar, the report printed.

use std::path::PathBuf;

use gatestream::config::Arch;
use gatestream::format::FfnLayout;
use gatestream::reformat::{DownType, ReformatOptions};
use gatestream::synth::{MakeSpec, Mix, OutputFormat, RoutingShape, Shape, TokenizerChoice};

use crate::args::{DownArg, LayoutArg, MakeArchArg, MakeModelArgs, MixArg, ModelFormatArg};
use crate::output::Progress;

impl From<LayoutArg> for FfnLayout {
    fn from(a: LayoutArg) -> FfnLayout {
        match a {
            LayoutArg::Bundled => FfnLayout::Bundled,
            LayoutArg::Split => FfnLayout::Split,
            LayoutArg::Rows => FfnLayout::Rows,
        }
    }
}

impl From<DownArg> for DownType {
    fn from(a: DownArg) -> DownType {
        match a {
            DownArg::Q8_0 => DownType::Q8_0,
            DownArg::F16 => DownType::F16,
            DownArg::Same => DownType::Same,
        }
    }
}

/// Where `tools/fetch-models.sh` puts its models (`GATESTREAM_MODELS`, else under HOME).
pub(crate) fn models_dir() -> anyhow::Result<PathBuf> {
    std::env::var_os("GATESTREAM_MODELS")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/gatestream/models")))
        .ok_or_else(|| anyhow::anyhow!("neither GATESTREAM_MODELS nor HOME is set: give the model's path"))
}

pub(crate) fn make_model(c: MakeModelArgs) -> anyhow::Result<()> {
    let MakeModelArgs {
        output,
        shape,
        mix,
        format,
        ffn_layout,
        down_type,
        tokenizer,
        arch,
        hidden,
        ffn,
        layers,
        heads,
        kv_heads,
        head_dim,
        vocab,
        experts,
        experts_used,
        leading_dense,
        dense_ffn,
        shared_experts,
        rope_dim,
        rope_factors,
        mla,
        header_only,
        seed,
        force,
        json,
    } = c;
    let custom_flags = [
        hidden,
        ffn,
        layers,
        heads,
        kv_heads,
        head_dim,
        vocab,
        experts,
        experts_used,
        leading_dense,
        dense_ffn,
        shared_experts,
        rope_dim,
    ];
    let rope_factors = match rope_factors.as_deref() {
        None => None,
        Some(text) => {
            let v: Vec<f32> = text
                .split(',')
                .map(|x| x.trim().parse::<f32>())
                .collect::<Result<_, _>>()
                .map_err(|_| anyhow::anyhow!("--rope-factors {text}: give four numbers, FACTOR,LOW,HIGH,CONTEXT"))?;
            let rule: [f32; 4] = v
                .try_into()
                .map_err(|_| anyhow::anyhow!("--rope-factors {text}: give four numbers, FACTOR,LOW,HIGH,CONTEXT"))?;
            Some(rule)
        }
    };
    let shape = if shape == "custom" {
        let need = |v: Option<usize>, flag: &str| v.ok_or_else(|| anyhow::anyhow!("--shape custom needs {flag}"));
        let (hidden, heads) = (need(hidden, "--hidden")?, need(heads, "--heads")?);
        let arch = match arch {
            MakeArchArg::Llama => Arch::Llama,
            MakeArchArg::Qwen2 => Arch::Qwen2,
            MakeArchArg::Qwen3 => Arch::Qwen3,
            MakeArchArg::Qwen3moe => Arch::Qwen3Moe,
            MakeArchArg::Olmoe => Arch::Olmoe,
            MakeArchArg::Deepseek2 => Arch::Deepseek2,
            MakeArchArg::Glm4moe => Arch::Glm4Moe,
            MakeArchArg::GptOss => Arch::GptOss,
        };
        let mla = match (arch, mla.as_deref()) {
            (Arch::Deepseek2, Some(text)) => {
                let bad = || anyhow::anyhow!("--mla {text}: give five numbers, Q_LORA,KV_LORA,QK_NOPE,QK_ROPE,V_HEAD");
                let v: Vec<usize> = text
                    .split(',')
                    .map(|x| x.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| bad())?;
                let [q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head]: [usize; 5] =
                    v.try_into().map_err(|_| bad())?;
                Some(gatestream::config::Mla {
                    q_lora_rank,
                    kv_lora_rank,
                    qk_nope,
                    qk_rope,
                    v_head,
                })
            }
            (Arch::Deepseek2, None) => {
                anyhow::bail!("--arch deepseek2 needs --mla Q_LORA,KV_LORA,QK_NOPE,QK_ROPE,V_HEAD")
            }
            (_, Some(_)) => anyhow::bail!("--mla goes with --arch deepseek2"),
            (_, None) => None,
        };
        if mla.is_some() && (kv_heads.is_some() || head_dim.is_some()) {
            anyhow::bail!(
                "with --mla, the cache has one head of KV_LORA + QK_ROPE: leave out --kv-heads and --head-dim"
            );
        }
        let glm = arch == Arch::Glm4Moe;
        // (DeepSeek's experts route as GLM's do.)
        let routed = glm || (arch == Arch::Deepseek2 && experts.is_some());
        let ffn = need(ffn, "--ffn")?;
        let head_dim = head_dim.unwrap_or(hidden / heads.max(1));
        if !routed && (leading_dense.is_some() || dense_ffn.is_some() || shared_experts.is_some()) {
            anyhow::bail!(
                "--leading-dense, --dense-ffn and --shared-experts go with --arch glm4moe, or deepseek2 with --experts"
            );
        }
        let kv_heads = match mla {
            Some(_) => 1,
            None => need(kv_heads, "--kv-heads")?,
        };
        let head_dim = mla.as_ref().map_or(head_dim, |m| m.latent());
        Shape {
            // 0: the tokenizer's (a vocabulary padded to 0 tokens is the tokenizer's own).
            vocab: vocab.unwrap_or(0),
            experts: match (experts, experts_used) {
                (None, None) => None,
                (Some(e), Some(k)) => Some((e, k)),
                _ => anyhow::bail!("give --experts and --experts-used together"),
            },
            rope_factors,
            mla,
            rope_dim: rope_dim.or(glm.then_some(head_dim / 2)),
            routing: routed.then(|| RoutingShape {
                leading_dense: leading_dense.unwrap_or(1),
                dense_ffn: dense_ffn.unwrap_or(4 * ffn),
                shared_experts: shared_experts.unwrap_or(1),
                sigmoid: true,
                score_bias: true,
                normalize: true,
                routed_scale: 1.0,
                groups: None,
            }),
            ..Shape::custom(arch, hidden, ffn, need(layers, "--layers")?, heads, kv_heads, head_dim)
        }
    } else {
        if custom_flags.iter().any(|f| f.is_some()) || rope_factors.is_some() || mla.is_some() {
            anyhow::bail!(
                "--shape {shape} sets every dimension; --hidden, --ffn, --layers, --heads, --kv-heads, --head-dim, \
                 --vocab, --experts, --leading-dense, --dense-ffn, --shared-experts, --rope-dim and --rope-factors go \
                 with --shape custom"
            );
        }
        Shape::named(&shape)?
    };
    let tokenizer = match tokenizer.as_deref() {
        Some("synthetic") => TokenizerChoice::Synthetic,
        Some(path) => TokenizerChoice::From(PathBuf::from(path)),
        None => {
            let file = match shape.arch {
                Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Glm4Moe => "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                _ => "SmolLM2-135M-Instruct.Q4_1.gguf",
            };
            let path = models_dir()?.join(file);
            if !path.exists() {
                anyhow::bail!(
                    "the default tokenizer for --shape {} is {}'s, and {} is not there: fetch it with \
                     tools/fetch-models.sh all, or give --tokenizer GGUF (or synthetic)",
                    shape.name,
                    file,
                    path.display()
                );
            }
            TokenizerChoice::From(path)
        }
    };
    if shape.vocab == 0 && matches!(tokenizer, TokenizerChoice::Synthetic) {
        anyhow::bail!("a synthetic tokenizer needs --vocab");
    }
    let format = match format {
        Some(ModelFormatArg::Gguf) => OutputFormat::Gguf,
        Some(ModelFormatArg::Gst) => OutputFormat::Gst(ReformatOptions::default()),
        None => match output.extension().and_then(|e| e.to_str()) {
            Some("gguf") => OutputFormat::Gguf,
            Some("gst") => OutputFormat::Gst(ReformatOptions::default()),
            _ => anyhow::bail!(
                "{}: name a .gguf or .gst file, or say which with --format gguf|gst",
                output.display()
            ),
        },
    };
    let format = match format {
        OutputFormat::Gguf if header_only => OutputFormat::GgufHeaderOnly,
        OutputFormat::Gst(_) if header_only => anyhow::bail!("--header-only writes a GGUF"),
        OutputFormat::Gst(o) => OutputFormat::Gst(ReformatOptions {
            ffn_layout: ffn_layout.into(),
            down_type: down_type.into(),
            ..o
        }),
        f => f,
    };
    let mix = match mix {
        None if shape.arch == Arch::GptOss => Mix::Mxfp4Moe,
        None | Some(MixArg::Q4KM) => Mix::Q4KM,
        Some(MixArg::Q6K) => Mix::Q6K,
        Some(MixArg::Q8_0) => Mix::Q8_0,
        Some(MixArg::Mxfp4Moe) => Mix::Mxfp4Moe,
        Some(MixArg::Q2K) => Mix::Q2K,
        Some(MixArg::Q3KM) => Mix::Q3KM,
        Some(MixArg::IQ4XS) => Mix::IQ4XS,
        Some(MixArg::IQ2XXS) => Mix::IQ2XXS,
    };
    let spec = MakeSpec {
        shape,
        mix,
        dequantize: false,
        tokenizer,
        seed,
        residual_gain: 0.1,
    };
    let mut bar = Progress::new();
    let report = gatestream::synth::write_model(&spec, &output, &format, force, &mut |done, total| {
        bar.update("MB", (done >> 20) as usize, (total >> 20) as usize)
    })?;
    drop(bar);
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let s = &report.shape;
        println!(
            "wrote {} ({:.2} GB, {}): {}-shaped {} {}, {:.2}B parameters, {} layers, hidden {}, ffn {}{}, vocab {} \
             ({} tokenizer) in {:.1} s, peak RSS {:.0} MB",
            report.output.display(),
            report.file_bytes as f64 / 1e9,
            report.format,
            s.name,
            s.arch.name(),
            report.mix,
            report.parameters as f64 / 1e9,
            s.layers,
            s.hidden,
            s.ffn,
            s.experts
                .map_or(String::new(), |(e, k)| format!(" x {e} experts ({k} used)")),
            report.vocab,
            report.tokenizer,
            report.seconds,
            report.peak_rss_bytes as f64 / 1e6
        );
        println!("random weights: quality figures (perplexity, agreement, draft acceptance) mean nothing; speeds, bytes and memory are real");
    }
    Ok(())
}
