//! Shared helpers for the integration tests: where the shared data and models are, and a
//! converter that writes the real stories260K model as a GGUF file (with the Q/K row permutation
//! and SentencePiece-style vocabulary llama.cpp's converter produces), so the GGUF path is tested
//! on real weights and broken copies of a real file exercise the error paths.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use gatestream::gguf::write::{gguf_bytes, TensorOut};
use gatestream::gguf::MetaValue;
use gatestream::safetensors::SafetensorsModel;

/// The repository's test data (`data/`): `GATESTREAM_DATA` when set, else `data/` in the checkout
/// this was built from, else `data/` under the working directory (a lent GPU machine runs the
/// suite binary from a copy of the working tree at another path).
pub fn data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("GATESTREAM_DATA") {
        return PathBuf::from(d);
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("data");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("data")
    }
}

pub fn stories_dir() -> PathBuf {
    let d = data_dir().join("stories260K");
    assert!(
        d.join("model.safetensors").exists(),
        "missing {}: the repository's data/ folder (or GATESTREAM_DATA) holds it",
        d.display()
    );
    d
}

/// A real model fetched by tools/fetch-models.sh; fails (never skips) when it is absent.
pub fn model_file(name: &str, fetch_name: &str) -> PathBuf {
    let dir = std::env::var_os("GATESTREAM_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache/gatestream/models"));
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is missing: run tools/fetch-models.sh {fetch_name} first (CI does)",
        p.display()
    );
    p
}

/// llama2.c's tok512.bin: (token bytes, score) per id.
pub fn read_llama2c_vocab(path: &Path) -> Vec<(Vec<u8>, f32)> {
    let b = std::fs::read(path).unwrap();
    let mut pos = 4;
    let mut out = Vec::new();
    while pos < b.len() {
        let score = f32::from_le_bytes(b[pos..pos + 4].try_into().unwrap());
        let len = i32::from_le_bytes(b[pos + 4..pos + 8].try_into().unwrap()) as usize;
        out.push((b[pos + 8..pos + 8 + len].to_vec(), score));
        pos += 8 + len;
    }
    out
}

/// What to break in the converted file.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Breakage {
    None,
    /// Give `blk.0.ffn_up.weight` ggml type 34 (TQ1_0), which gatestream does not compute on.
    UnsupportedType,
    /// Store `blk.0.ffn_up.weight` as Q5_1 (ggml type 7): a type of 32-value blocks (the rows of
    /// 64 take no larger) that no other fixture holds and the CPU computes without token-lane
    /// kernels.
    Q5_1Up,
    /// Leave out `blk.1.ffn_down.weight`.
    MissingTensor,
    /// Swap the dimensions of `blk.0.attn_q.weight`'s neighbour: make ffn_gate [hidden, ffn+1].
    WrongShape,
    /// general.architecture = "gpt-neox".
    UnknownArch,
    /// No tokenizer.ggml.* keys.
    NoTokenizer,
    /// An extra tensor `blk.0.attn_sinks.weight` (gpt-oss's attention sinks) that the llama
    /// computation does not read.
    ExtraTensor,
    /// `llama.rope.scaling.type = "longrope"`, a RoPE scaling not computed.
    UnknownScaling,
    /// `llama.rope.dimension_count = 4`: RoPE over half of each 8-wide head (not computed).
    PartialRope,
}

/// stories260K as GGUF bytes, as llama.cpp's converter would write it (F32, llama arch, Q/K rows
/// permuted for adjacent-pair RoPE), optionally broken.
pub fn stories_gguf(breakage: Breakage) -> Vec<u8> {
    stories_gguf_with(breakage, None)
}

/// [`stories_gguf`] with `rope_freqs.weight` holding `rope_factors` when given (as Llama 3.1+
/// files carry their RoPE frequency factors).
pub fn stories_gguf_with(breakage: Breakage, rope_factors: Option<&[f32]>) -> Vec<u8> {
    let dir = stories_dir();
    let st = SafetensorsModel::open_dir(&dir).unwrap();
    let (hidden, n_heads, n_kv, head_dim, layers, ffn) = (64u64, 8usize, 4usize, 8usize, 5, 172u64);
    let vocab = read_llama2c_vocab(&dir.join("tok512.bin"));
    let tokens: Vec<MetaValue> = vocab
        .iter()
        .map(|(b, _)| MetaValue::Str(String::from_utf8_lossy(b).replace(' ', "\u{2581}")))
        .collect();
    let scores: Vec<MetaValue> = vocab.iter().map(|(_, s)| MetaValue::F32(*s)).collect();
    let types: Vec<MetaValue> = vocab
        .iter()
        .enumerate()
        .map(|(i, (b, _))| {
            let t = if i < 3 {
                3
            } else if b.starts_with(b"<0x") && b.len() == 6 {
                6
            } else {
                1
            };
            MetaValue::I32(t)
        })
        .collect();
    let arch = if breakage == Breakage::UnknownArch {
        "gpt-neox"
    } else {
        "llama"
    };
    let mut meta: Vec<(&str, MetaValue)> = vec![
        ("general.architecture", MetaValue::Str(arch.into())),
        ("general.name", MetaValue::Str("stories260K".into())),
        ("llama.context_length", MetaValue::U32(512)),
        ("llama.embedding_length", MetaValue::U32(hidden as u32)),
        ("llama.feed_forward_length", MetaValue::U32(ffn as u32)),
        ("llama.block_count", MetaValue::U32(layers as u32)),
        ("llama.attention.head_count", MetaValue::U32(n_heads as u32)),
        ("llama.attention.head_count_kv", MetaValue::U32(n_kv as u32)),
        ("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-5)),
        ("llama.rope.freq_base", MetaValue::F32(10000.0)),
    ];
    if breakage == Breakage::PartialRope {
        meta.push(("llama.rope.dimension_count", MetaValue::U32(4)));
    }
    if breakage == Breakage::UnknownScaling {
        meta.extend([
            ("llama.rope.scaling.type", MetaValue::Str("longrope".into())),
            ("llama.rope.scaling.factor", MetaValue::F32(4.0)),
        ]);
    }
    if breakage != Breakage::NoTokenizer {
        meta.extend([
            ("tokenizer.ggml.model", MetaValue::Str("llama".into())),
            ("tokenizer.ggml.tokens", MetaValue::Array(tokens)),
            ("tokenizer.ggml.scores", MetaValue::Array(scores)),
            ("tokenizer.ggml.token_type", MetaValue::Array(types)),
            ("tokenizer.ggml.bos_token_id", MetaValue::U32(1)),
            ("tokenizer.ggml.eos_token_id", MetaValue::U32(2)),
            ("tokenizer.ggml.unknown_token_id", MetaValue::U32(0)),
            ("tokenizer.ggml.add_bos_token", MetaValue::Bool(true)),
            ("tokenizer.ggml.add_space_prefix", MetaValue::Bool(true)),
        ]);
    }
    // (gguf name, hf name, permute rows for n heads)
    let mut names: Vec<(String, String, Option<usize>)> = vec![
        ("token_embd.weight".into(), "model.embed_tokens.weight".into(), None),
        ("output_norm.weight".into(), "model.norm.weight".into(), None),
    ];
    for l in 0..layers {
        for (g, h, p) in [
            ("attn_norm.weight", "input_layernorm.weight", None),
            ("attn_q.weight", "self_attn.q_proj.weight", Some(n_heads)),
            ("attn_k.weight", "self_attn.k_proj.weight", Some(n_kv)),
            ("attn_v.weight", "self_attn.v_proj.weight", None),
            ("attn_output.weight", "self_attn.o_proj.weight", None),
            ("ffn_norm.weight", "post_attention_layernorm.weight", None),
            ("ffn_gate.weight", "mlp.gate_proj.weight", None),
            ("ffn_up.weight", "mlp.up_proj.weight", None),
            ("ffn_down.weight", "mlp.down_proj.weight", None),
        ] {
            names.push((format!("blk.{l}.{g}"), format!("model.layers.{l}.{h}"), p));
        }
    }
    let mut owned: Vec<(String, Vec<u64>, u32, Vec<u8>)> = Vec::new();
    for (g, h, permute) in names {
        if breakage == Breakage::MissingTensor && g == "blk.1.ffn_down.weight" {
            continue;
        }
        let t = st.tensors.get(&h).unwrap_or_else(|| panic!("stories260K lacks {h}"));
        let mut bytes = st.bytes(t).to_vec();
        let mut dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        if let Some(n) = permute {
            // Rows of head h: [h*hd, (h+1)*hd); permuted row 2i+j = original row j*hd/2 + i.
            let row = hidden as usize * 4;
            let src = bytes.clone();
            for head in 0..n {
                for i in 0..head_dim / 2 {
                    for j in 0..2 {
                        let to = head * head_dim + 2 * i + j;
                        let from = head * head_dim + j * head_dim / 2 + i;
                        bytes[to * row..(to + 1) * row].copy_from_slice(&src[from * row..(from + 1) * row]);
                    }
                }
            }
        }
        let mut type_id = 0;
        if breakage == Breakage::UnsupportedType && g == "blk.0.ffn_up.weight" {
            type_id = 34;
        }
        if breakage == Breakage::Q5_1Up && g == "blk.0.ffn_up.weight" {
            let ty = gatestream::quant::GgmlType::Q5_1;
            let x: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let mut q = vec![0u8; ty.row_bytes(x.len()).unwrap()];
            assert!(gatestream::quant::quantize_row(ty, &x, &mut q));
            (type_id, bytes) = (ty.ggml_id(), q);
        }
        if breakage == Breakage::WrongShape && g == "blk.0.ffn_gate.weight" {
            // Same bytes, claimed as [ffn/2, hidden*2]: the element count still matches the data.
            dims = vec![hidden * 2, ffn / 2];
        }
        owned.push((g, dims, type_id, bytes));
    }
    if breakage == Breakage::ExtraTensor {
        owned.push((
            "blk.0.attn_sinks.weight".into(),
            vec![n_heads as u64],
            0,
            vec![0; n_heads * 4],
        ));
    }
    if let Some(f) = rope_factors {
        owned.push(("rope_freqs.weight".into(), vec![f.len() as u64], 0, f32_bytes(f)));
    }
    gguf_of(&meta, &owned)
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A copy of the GGUF file `src` with `meta` keys set (added or replaced) and `tensors` (name,
/// GGUF dims, ggml type id, bytes) in place of its own of the same name, or added after them.
pub fn gguf_edited(
    src: &Path,
    meta: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
) -> Vec<u8> {
    let g = gatestream::gguf::GgufFile::open(src).unwrap();
    let mut keys: Vec<(String, MetaValue)> = g
        .metadata
        .iter()
        .filter(|(k, _)| !meta.iter().any(|(m, _)| m == *k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    keys.sort_by(|a, b| a.0.cmp(&b.0));
    keys.extend(meta);
    let meta_refs: Vec<(&str, MetaValue)> = keys.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let mut owned: Vec<(String, Vec<u64>, u32, Vec<u8>)> = g
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), t.type_id, g.tensor_bytes(t).to_vec()))
        .collect();
    for t in tensors {
        match owned.iter_mut().find(|o| o.0 == t.0) {
            Some(o) => *o = t,
            None => owned.push(t),
        }
    }
    gguf_of(&meta_refs, &owned)
}

/// GGUF bytes of `meta` and tensors given as (name, GGUF dims, ggml type id, bytes).
pub fn gguf_of(meta: &[(&str, MetaValue)], tensors: &[(String, Vec<u64>, u32, Vec<u8>)]) -> Vec<u8> {
    let tensors: Vec<TensorOut> = tensors
        .iter()
        .map(|(n, d, ty, b)| TensorOut {
            name: n,
            dims: d.clone(),
            type_id: *ty,
            bytes: b,
        })
        .collect();
    gguf_bytes(meta, &tensors)
}

pub fn write_temp(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Greedy decoding of `max_tokens` tokens, no chat template.
pub fn greedy(max_tokens: usize) -> gatestream::model::generate::GenerateOptions {
    gatestream::model::generate::GenerateOptions {
        max_tokens,
        sampler: gatestream::model::sampler::SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        chat: false,
        ctx: 0,
        batch_tokens_max: 0,
        logprobs: false,
        lookup: 0,
        ignore_eos: false,
        logits_on_host: false,
    }
}

/// Eight short prompts (one longer than a step of 16 tokens) for batching tests.
pub const EIGHT_PROMPTS: [&str; 8] = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colours are",
    "In 1969, the first",
    "Water boils at",
    "My favourite food is",
    "The history of the city begins with a small settlement on the river. Over the centuries merchants arrived and",
];

/// `prompt` through `model` in one batched pass and token by token: per position, the largest
/// difference between the two passes' logits.
pub fn batched_vs_one_by_one(model: &gatestream::model::Model, prompt: &[u32]) -> Vec<f32> {
    use gatestream::kv::KvCache;
    use gatestream::model::batch::Logits;
    let v = model.config.vocab;
    let mut c1 = KvCache::new(&model.config, prompt.len());
    let batched = model.forward(prompt, &mut c1, Logits::From(0)).unwrap();
    let mut c2 = KvCache::new(&model.config, prompt.len());
    prompt
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let one = model.forward(&[t], &mut c2, Logits::Last).unwrap();
            one.iter()
                .zip(&batched[i * v..(i + 1) * v])
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max)
        })
        .collect()
}

/// Logits of a prompt pass (every position) followed by `steps` single-token passes, each fed
/// the previous greedy token: the prefill and decode paths both.
#[allow(dead_code)]
pub fn prompt_then_greedy(
    model: &gatestream::model::Model,
    stream: Option<&dyn gatestream::model::forward::LayerStream>,
    mask: Option<&dyn gatestream::model::forward::FfnMask>,
    text: &str,
    steps: usize,
) -> Vec<f32> {
    use gatestream::model::batch::Logits;
    use gatestream::model::forward::FfnHooks;
    let ids = model.tokenizer.encode(text, true).unwrap();
    let mut cache = gatestream::kv::KvCache::new(&model.config, ids.len() + steps);
    let hooks = FfnHooks {
        observe: None,
        mask,
        stream,
        cancel: None,
    };
    let mut all = model.forward_with(&ids, &mut cache, Logits::From(0), &hooks).unwrap();
    let vocab = model.config.vocab;
    for _ in 0..steps {
        let last = &all[all.len() - vocab..];
        let next = (0..vocab).max_by(|&a, &b| last[a].total_cmp(&last[b])).unwrap() as u32;
        all.extend(model.forward_with(&[next], &mut cache, Logits::Last, &hooks).unwrap());
    }
    all
}

/// The budget N a refusal names ("... at least N (x MB) is needed ...").
#[allow(dead_code)]
pub fn budget_in_refusal(e: &str) -> u64 {
    let n: String = e
        .split("at least ")
        .nth(1)
        .unwrap_or_else(|| panic!("no minimum in: {e}"))
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    n.parse().unwrap()
}

/// Streaming through the pread reader under `budget_bytes`, passes of at most `batch` tokens
/// (0: the stream's own limit), the cache policy the runtime picks.
pub fn pread_stream(budget_bytes: u64, batch: usize) -> gatestream::runtime::StreamAsk {
    gatestream::runtime::StreamAsk {
        budget_bytes,
        engine: gatestream::io::ReadEngine::Pread,
        reader: gatestream::io::ReaderOptions::default(),
        cache: None,
        priority: gatestream::stream::residency::Priority::CacheFirst,
        merge_gap_bytes: None,
        cost: gatestream::stream::CostSource::Default,
        lookahead: false,
        batch_tokens_max: batch,
        vram_budget_bytes: None,
        prefetch_buffers: 0,
        prefetch_read_bytes: 0,
        hybrid: gatestream::stream::hybrid::HybridMode::Auto,
    }
}

/// Tensors `(name, dtype, shape, bytes)` written as a Hugging Face model's safetensors in
/// `shards` files (`model-0000i-of-0000n.safetensors`, the tensors in order, about as many in
/// each) with their `model.safetensors.index.json`; file i's header padded by `pad * (i + 1)`
/// spaces, so each file's data starts at another offset.
pub fn write_safetensors_shards(
    dest: &Path,
    tensors: &[(String, &str, Vec<usize>, Vec<u8>)],
    shards: usize,
    pad: usize,
) {
    let per = tensors.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (i, chunk) in tensors.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        let (mut header, mut data) = (serde_json::Map::new(), Vec::new());
        for (name, dtype, shape, bytes) in chunk {
            let begin = data.len();
            data.extend_from_slice(bytes);
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
            );
            weight_map.insert(name.clone(), file.clone().into());
        }
        let mut h = serde_json::to_vec(&header).unwrap();
        h.resize(h.len() + pad * (i + 1), b' ');
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend(h);
        bytes.extend(data);
        std::fs::write(dest.join(&file), bytes).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dest.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

/// stories260K upcycled into 6 F32 experts, 2 used a token, of `arch` (Mixtral-style llama,
/// qwen2moe with its gated shared expert, qwen3moe, olmoe), as a GGUF in `dir`.
pub fn stories_moe(dir: &Path, arch: gatestream::config::Arch) -> Result<PathBuf, String> {
    let dense = write_temp(dir, "stories.gguf", &stories_gguf(Breakage::None));
    let spec = gatestream::synth::MoeSpec {
        arch,
        experts: 6,
        used: 2,
        ty: gatestream::quant::GgmlType::F32,
        random: None,
        perturb: 0.05,
        seed: 3,
    };
    let path = dir.join(format!("{}.gguf", arch.name()));
    gatestream::synth::write_moe(&dense, &spec, &path, &mut |_, _| {}).map_err(|e| e.to_string())?;
    Ok(path)
}

/// The small deepseek2 models' latent attention (the tests' and the device suites'): a latent of
/// 128 and a rotated key part of 32 a position, heads of 64 + 32 query dimensions and 64 values;
/// `q_lora_rank` 0 projects the query from the input directly (V2-Lite).
pub fn small_mla(q_lora_rank: usize) -> gatestream::config::Mla {
    gatestream::config::Mla {
        q_lora_rank,
        kv_lora_rank: 128,
        qk_nope: 64,
        qk_rope: 32,
        v_head: 64,
    }
}
