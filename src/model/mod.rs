//! Models: architecture config, weights, tokenizer, forward pass, sampling and generation.
//! `model` never opens a file except through `gguf`/`safetensors` at load time and never names a
//! read engine: weights are byte slices it is handed.

pub mod batch;
pub mod chat;
pub mod draft;
pub mod ffn;
pub mod forward;
pub mod generate;
mod mla;
pub mod sampler;
pub mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::cpu::CpuBackend;
use crate::backend::Device;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gguf::{GgufFile, MetaValue};
use crate::gstfile::GstFile;
use crate::safetensors::SafetensorsModel;
use tokenizer::{GgufVocab, Tokenizer, TokenizerSpec};
use weights::{ModelWeights, TensorSource};

pub struct Model {
    pub path: PathBuf,
    /// The files its weights are in, each at its place in one byte space (one file, or a Hugging
    /// Face folder's shards): what a stream reads. Weights left on disk have offsets in it.
    pub parts: Vec<crate::io::FilePart>,
    pub config: ModelConfig,
    pub weights: ModelWeights,
    pub tokenizer: Tokenizer,
    /// Where the matrices' bytes are (`OnDisk`: only a stream can read them).
    pub placement: Placement,
    /// Where the forward pass computes (the CPU today; one device, one thread pool, per model).
    pub device: Arc<dyn Device>,
    /// A `.gst` file's index as read at load (its calibration, its recommended mask), kept so
    /// nothing opens the file again to read it; None for other formats.
    pub gst_index: Option<crate::format::Index>,
}

/// Options for loading.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Worker threads; 0 = one per core.
    pub threads: usize,
    /// Where the matrices' bytes are.
    pub placement: Placement,
    /// A mixture-of-experts model routes each token to this many experts instead of its own
    /// count (`expert_used_count`); refused for a dense model and outside 1..=experts.
    pub experts_used: Option<usize>,
}

/// Where a loaded model's matrices live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Memory-mapped from the model file: every pass can read every weight.
    #[default]
    Mapped,
    /// Left on disk (the streaming path): the model knows only where each matrix is, and a pass
    /// must be given the stream that reads them (`stream::Streamer`). Norms and biases are still
    /// decoded into memory. Nothing can page the file in behind the budget's back.
    OnDisk,
}

/// A model source opened but not yet turned into weights: what `reformat` reads.
pub struct Source {
    pub tensors: TensorSource,
    pub config: ModelConfig,
    pub tokenizer: TokenizerSpec,
}

/// What `--model` (and every model path) can name, for messages about paths that are none of these.
pub const MODEL_PATH_KINDS: &str = "a model path is a .gguf file, a .gst file (written by `gatestream reformat`), \
     or a Hugging Face folder holding config.json, model.safetensors (or model.safetensors.index.json and its \
     shards) and tokenizer.json";

/// Open a `.gguf` file, a `.gst` file (recognised by its magic) or a Hugging Face folder.
pub fn open_source(path: &Path) -> Result<Source> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::Input(format!(
            "{}: no such file or folder; {MODEL_PATH_KINDS}",
            path.display()
        )),
        _ => Error::io(path, e),
    })?;
    if meta.is_dir() {
        if !path.join("config.json").exists() {
            return Err(Error::Input(format!(
                "{}: this folder has no config.json, so it is not a model; {MODEL_PATH_KINDS}",
                path.display()
            )));
        }
        return open_hf_dir(path);
    }
    // The first bytes say which format the file is (read once; the parsers check them again).
    let mut head = Vec::with_capacity(8);
    std::fs::File::open(path)
        .and_then(|f| std::io::Read::read_to_end(&mut std::io::Read::take(f, 8), &mut head))
        .map_err(|e| Error::io(path, e))?;
    if head == crate::format::MAGIC {
        let g = GstFile::open(path)?;
        let (bytes, offset_bytes) = g.tokenizer_bytes()?;
        let tokenizer: TokenizerSpec = serde_json::from_slice(bytes).map_err(|e| Error::Malformed {
            path: g.path.clone(),
            format: "gst",
            offset_bytes,
            what: format!("tokenizer section is not a tokenizer description: {e}"),
        })?;
        let config = g.index.config.clone().validate(path)?;
        return Ok(Source {
            tensors: TensorSource::Gst(Box::new(g)),
            config,
            tokenizer,
        });
    }
    if !head.starts_with(b"GGUF") {
        return Err(Error::Input(format!(
            "{}: not a model file: bad magic {:?} at offset 0 (neither GGUF's nor a .gst file's); {MODEL_PATH_KINDS}",
            path.display(),
            String::from_utf8_lossy(&head[..head.len().min(4)])
        )));
    }
    gguf_source(GgufFile::open(path)?)
}

/// What a parsed GGUF file describes: config and tokenizer from its metadata, its tensors. (The
/// GGUF fuzz target starts here with bytes parsed in memory.)
pub fn gguf_source(g: GgufFile) -> Result<Source> {
    let tokenizer = TokenizerSpec::Gguf { vocab: gguf_vocab(&g)? };
    let config = gguf_config(&g)?;
    Ok(Source {
        tensors: TensorSource::Gguf(g),
        config,
        tokenizer,
    })
}

/// A GGUF's config, its vocabulary the embedding's rows (authoritative).
fn gguf_config(g: &GgufFile) -> Result<ModelConfig> {
    let embd = g.tensor("token_embd.weight").ok_or_else(|| Error::MissingTensor {
        path: g.path.clone(),
        tensor: "token_embd.weight".into(),
        arch: g
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .unwrap_or("?")
            .into(),
    })?;
    let vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
    ModelConfig::from_gguf(g, vocab)
}

/// The bytes of the model at `path`: the file's length, or the sum of a Hugging Face folder's
/// safetensors files (what placement and `--ram-budget` percentages size against).
pub fn model_bytes(path: &Path) -> Result<u64> {
    if path.is_dir() {
        return Ok(SafetensorsModel::open_dir(path)?
            .parts()
            .iter()
            .map(|p| p.len_bytes)
            .sum());
    }
    Ok(std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len())
}

/// Only the config of the model at `path` (a .gst's index, a GGUF's metadata, a folder's
/// config.json): what sizing decisions need, without building its tokenizer.
pub fn open_config(path: &Path) -> Result<ModelConfig> {
    if crate::gstfile::is_gst(path) {
        return GstFile::open(path)?.index.config.clone().validate(path);
    }
    if crate::gguf::is_gguf(path) {
        return gguf_config(&GgufFile::open(path)?);
    }
    Ok(open_source(path)?.config)
}

impl Model {
    /// Load a `.gguf` file, a `.gst` file or a Hugging Face safetensors folder, on a CPU device
    /// of its own (`opts.threads` threads).
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Model> {
        Model::load_on(path, opts, Arc::new(CpuBackend::new(opts.threads)))
    }

    /// As `load`, computing on `device`: several models (the two runs of `run --mode compare`,
    /// later a draft model beside its target) share one device and its thread pool instead of
    /// each starting its own (`opts.threads` is then the device's business).
    pub fn load_on(path: &Path, opts: &LoadOptions, device: Arc<dyn Device>) -> Result<Model> {
        Model::from_source(path, open_source(path)?, opts, device)
    }

    /// The model `src` describes (its tensors checked against its config, its tokenizer built).
    pub fn from_source(path: &Path, mut src: Source, opts: &LoadOptions, device: Arc<dyn Device>) -> Result<Model> {
        if let Some(k) = opts.experts_used {
            let Some(moe) = src.config.moe.as_mut() else {
                return Err(Error::Input(format!(
                    "{}: --experts-used applies to mixture-of-experts models, and this model is dense",
                    path.display()
                )));
            };
            if k == 0 || k > moe.n_experts {
                return Err(Error::Input(format!(
                    "{}: --experts-used {k}: this model has {} experts per layer (it uses {} per token); \
                     give 1 to {}",
                    path.display(),
                    moe.n_experts,
                    moe.n_used,
                    moe.n_experts
                )));
            }
            moe.n_used = k;
        }
        if src.config.attn_sinks && !device.attention_sinks() {
            return Err(Error::Input(format!(
                "{}: a {} model: its attention sinks (`blk.N.attn_sinks`, an extra logit in each head's \
                 softmax) are not computed by the {} device; run it with --device cpu",
                path.display(),
                src.config.arch.name(),
                device.name()
            )));
        }
        if src.config.rope_freq_factors.is_some() && !device.rope_freq_factors() {
            return Err(Error::Input(format!(
                "{}: this model's RoPE has per-frequency factors (Llama 3.1+'s `rope_freqs.weight`, or YaRN \
                 scaling), which the {} device does not apply yet; run it with --device cpu",
                path.display(),
                device.name()
            )));
        }
        if src.config.mla.is_some() && !device.latent_attention() {
            return Err(Error::Input(format!(
                "{}: this model has multi-head latent attention ({}), which the {} device does not compute \
                 yet; run it with --device cpu",
                path.display(),
                src.config.arch.name(),
                device.name()
            )));
        }
        if src.config.rope_dims() < src.config.head_dim && !device.rope_partial() {
            return Err(Error::Input(format!(
                "{}: this {} model rotates {} of each head's {} dimensions (partial RoPE), which the {} device does \
                 not compute yet (its RoPE rotates whole heads); run it with --device cpu",
                path.display(),
                src.config.arch.name(),
                src.config.rope_dims(),
                src.config.head_dim,
                device.name()
            )));
        }
        if let Some(why) = device.refuses_model(&src.config) {
            return Err(Error::Input(format!(
                "{}: {why}; run it with --device cpu",
                path.display()
            )));
        }
        let tokenizer = Tokenizer::from_spec(path, &src.tokenizer)?;
        let mut weights = ModelWeights::load(&src.tensors, &src.config)?;
        if let Some(w) = weights.matrices().into_iter().find(|w| !device.computes_type(w.ty)) {
            return Err(Error::Input(format!(
                "{}: tensor `{}` has type {ty}: {ty} is computed on the CPU only (the {} device has no kernels \
                 for it); run it with --device cpu",
                path.display(),
                w.name,
                device.name(),
                ty = w.ty.name(),
            )));
        }
        if opts.placement == Placement::OnDisk {
            weights.leave_on_disk(&src.tensors);
        }
        let parts = src.tensors.parts();
        let gst_index = match src.tensors {
            TensorSource::Gst(g) => Some(g.index),
            _ => None,
        };
        Ok(Model {
            parts,
            gst_index,
            placement: opts.placement,
            path: path.to_path_buf(),
            config: src.config,
            weights,
            tokenizer,
            device,
        })
    }
}

fn open_hf_dir(dir: &Path) -> Result<Source> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: cfg_path.clone(),
        what: format!("not JSON: {e}"),
    })?;
    let config = ModelConfig::from_hf_config(&cfg_path, &json)?;
    let tokenizer = if dir.join("tokenizer.json").exists() {
        TokenizerSpec::read_hf_dir(dir)?
    } else if let Some(bin) = find_llama2c_tokenizer(dir) {
        let id = |k: &str, d: u32| json.get(k).and_then(|v| v.as_u64()).map(|v| v as u32).unwrap_or(d);
        let bytes = std::fs::read(&bin).map_err(|e| Error::io(&bin, e))?;
        TokenizerSpec::Llama2c {
            bin: bytes,
            bos_id: id("bos_token_id", 1),
            eos_id: id("eos_token_id", 2),
        }
    } else {
        return Err(Error::Tokenizer {
            path: dir.to_path_buf(),
            what: "no tokenizer.json (or llama2.c tok*.bin) in the model folder; copy the model's tokenizer.json beside config.json".into(),
        });
    };
    let model = SafetensorsModel::open_dir(dir)?;
    Ok(Source {
        tensors: TensorSource::Safetensors {
            dir: dir.to_path_buf(),
            model,
        },
        config,
        tokenizer,
    })
}

fn find_llama2c_tokenizer(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("tok") && name.ends_with(".bin")
        })
        .collect();
    found.sort();
    found.into_iter().next()
}

/// The GGUF metadata that holds `v` (what [`gguf_vocab`] reads back): `tokenizer.ggml.*` and
/// `tokenizer.chat_template`, each present field under its llama.cpp key.
pub fn gguf_vocab_metadata(v: &GgufVocab) -> Vec<(String, MetaValue)> {
    let key = |k: &str| format!("tokenizer.ggml.{k}");
    let strings = |s: &[String]| MetaValue::Array(s.iter().map(|t| MetaValue::Str(t.clone())).collect());
    let mut m = vec![
        (key("model"), MetaValue::Str(v.model.clone())),
        (key("tokens"), strings(&v.tokens)),
    ];
    if let Some(p) = &v.pre {
        m.push((key("pre"), MetaValue::Str(p.clone())));
    }
    if let Some(s) = &v.scores {
        m.push((
            key("scores"),
            MetaValue::Array(s.iter().map(|&f| MetaValue::F32(f)).collect()),
        ));
    }
    if let Some(t) = &v.token_types {
        m.push((
            key("token_type"),
            MetaValue::Array(t.iter().map(|&i| MetaValue::I32(i)).collect()),
        ));
    }
    if let Some(mg) = &v.merges {
        m.push((key("merges"), strings(mg)));
    }
    for (k, id) in [
        ("bos_token_id", v.bos_id),
        ("eos_token_id", v.eos_id),
        ("eot_token_id", v.eot_id),
        ("eom_token_id", v.eom_id),
        ("unknown_token_id", v.unknown_id),
        ("padding_token_id", v.padding_id),
    ] {
        if let Some(id) = id {
            m.push((key(k), MetaValue::U32(id)));
        }
    }
    for (k, flag) in [
        ("add_bos_token", v.add_bos),
        ("add_eos_token", v.add_eos),
        ("add_space_prefix", v.add_space_prefix),
    ] {
        if let Some(f) = flag {
            m.push((key(k), MetaValue::Bool(f)));
        }
    }
    if let Some(t) = &v.chat_template {
        m.push(("tokenizer.chat_template".into(), MetaValue::Str(t.clone())));
    }
    m
}

/// Gather the tokenizer.* metadata of a GGUF file.
pub fn gguf_vocab(g: &GgufFile) -> Result<GgufVocab> {
    let get = |k: &str| g.get(&format!("tokenizer.ggml.{k}"));
    let id = |k: &str| get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
    let flag = |k: &str| get(k).and_then(|v| v.as_bool());
    let strings =
        |v: &MetaValue| -> Option<Vec<String>> { v.as_array()?.iter().map(|s| s.as_str().map(String::from)).collect() };
    let bad = |what: &str| Error::Tokenizer {
        path: g.path.clone(),
        what: what.into(),
    };
    let model = get("model")
        .and_then(|v| v.as_str())
        .ok_or_else(|| bad("no tokenizer.ggml.model in the GGUF metadata"))?;
    let tokens = get("tokens")
        .and_then(strings)
        .ok_or_else(|| bad("no tokenizer.ggml.tokens array in the GGUF metadata"))?;
    Ok(GgufVocab {
        model: model.to_string(),
        pre: get("pre").and_then(|v| v.as_str()).map(String::from),
        tokens,
        scores: get("scores").and_then(|v| v.as_array()?.iter().map(|s| s.as_f64().map(|f| f as f32)).collect()),
        token_types: get("token_type")
            .and_then(|v| v.as_array()?.iter().map(|s| s.as_i64().map(|i| i as i32)).collect()),
        merges: get("merges").and_then(strings),
        bos_id: id("bos_token_id"),
        eos_id: id("eos_token_id"),
        eot_id: id("eot_token_id"),
        eom_id: id("eom_token_id"),
        unknown_id: id("unknown_token_id"),
        padding_id: id("padding_token_id"),
        add_bos: flag("add_bos_token"),
        add_eos: flag("add_eos_token"),
        add_space_prefix: flag("add_space_prefix"),
        chat_template: g
            .get("tokenizer.chat_template")
            .and_then(|v| v.as_str())
            .map(String::from),
    })
}
