//! Bad input gets a clear error, never a panic: broken copies of a real model (stories260K
//! written as GGUF), truncated at many lengths, and damaged safetensors folders.

mod common;

use common::*;
use gatestream::model::{LoadOptions, Model};
use gatestream::Error;

fn load_bytes(bytes: &[u8]) -> Result<Model, Error> {
    let tmp = tempfile::tempdir().unwrap();
    let p = write_temp(tmp.path(), "m.gguf", bytes);
    Model::load(
        &p,
        &LoadOptions {
            threads: 1,
            ..Default::default()
        },
    )
}

fn message(e: &Error) -> String {
    e.to_string()
}

#[test]
fn truncated_gguf_is_an_error_at_every_length() {
    let good = stories_gguf(Breakage::None);
    assert!(load_bytes(&good).is_ok());
    // Every cut inside the header and index, and a spread of cuts through the data.
    let header_end = 40_000.min(good.len());
    let mut cuts: Vec<usize> = (0..header_end).step_by(97).collect();
    cuts.extend((header_end..good.len()).step_by(good.len() / 50));
    cuts.push(good.len() - 1);
    for cut in cuts {
        let e = load_bytes(&good[..cut])
            .err()
            .unwrap_or_else(|| panic!("a file cut to {cut} bytes loaded"));
        let m = message(&e);
        assert!(m.contains("m.gguf"), "error does not name the file: {m}");
    }
    let e = load_bytes(&good[..good.len() - 100]).err().unwrap();
    assert!(message(&e).contains("truncated"), "{}", message(&e));
}

#[test]
fn bad_magic_and_unknown_version_are_named() {
    let mut bytes = stories_gguf(Breakage::None);
    bytes[0..4].copy_from_slice(b"GGML");
    let m = message(&load_bytes(&bytes).err().unwrap());
    assert!(m.contains("bad magic") && m.contains("offset 0"), "{m}");
    let mut bytes = stories_gguf(Breakage::None);
    bytes[4..8].copy_from_slice(&7u32.to_le_bytes());
    let m = message(&load_bytes(&bytes).err().unwrap());
    assert!(m.contains("version 7"), "{m}");
}

#[test]
fn absurd_counts_are_rejected_before_allocating() {
    let mut bytes = stories_gguf(Breakage::None);
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes()); // tensor count
    let m = message(&load_bytes(&bytes).err().unwrap());
    assert!(m.contains("tensor count"), "{m}");
    let mut bytes = stories_gguf(Breakage::None);
    bytes[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes()); // metadata count
    let m = message(&load_bytes(&bytes).err().unwrap());
    assert!(m.contains("metadata count"), "{m}");
}

#[test]
fn unsupported_tensor_type_names_the_tensor_and_type() {
    let e = load_bytes(&stories_gguf(Breakage::UnsupportedType)).err().unwrap();
    assert!(matches!(e, Error::UnsupportedTensorType { .. }), "{e:?}");
    let m = message(&e);
    assert!(m.contains("blk.0.ffn_up.weight") && m.contains("TQ1_0"), "{m}");
    assert!(m.contains("ggml type id 34"), "{m}");
    // The list of supported types names every one, the newer ones included.
    for name in [
        "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "Q4_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
        "IQ1_S", "IQ1_M",
    ] {
        assert!(m.contains(name), "{name} missing from {m}");
    }
}

/// A tensor of Q5_1 (a type the CPU computes without token-lane kernels) loads on the CPU and
/// runs: a batch's logits equal the token-by-token ones (the tiled products against one-token
/// ones) and stay near the all-F32 model's (the Q5_1 rounding of one matrix).
#[test]
fn q5_1_tensor_loads_and_runs_on_the_cpu() {
    use gatestream::kv::KvCache;
    use gatestream::model::batch::Logits;
    let model = load_bytes(&stories_gguf(Breakage::Q5_1Up)).unwrap();
    let f32_model = load_bytes(&stories_gguf(Breakage::None)).unwrap();
    let ids = model
        .tokenizer
        .encode("Once upon a time, there was a little cat", true)
        .unwrap();
    assert!(ids.len() > 8, "more than one tile of tokens");
    let v = model.config.vocab;
    let run = |m: &Model| {
        let mut c = KvCache::new(&m.config, ids.len());
        m.forward(&ids, &mut c, Logits::From(0)).unwrap()
    };
    let (batched, plain) = (run(&model), run(&f32_model));
    let mut c = KvCache::new(&model.config, ids.len());
    let mut worst = 0f32;
    for (i, &t) in ids.iter().enumerate() {
        let one = model.forward(&[t], &mut c, Logits::Last).unwrap();
        let row = &batched[i * v..(i + 1) * v];
        let d = one.iter().zip(row).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d < 1e-3, "position {i}: batch and one-token logits differ by {d}");
        let f = &plain[i * v..(i + 1) * v];
        worst = worst.max(row.iter().zip(f).fold(0f32, |m, (a, b)| m.max((a - b).abs())));
    }
    let spread = plain.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(
        worst > 0.0 && worst < 0.05 * spread,
        "Q5_1 vs F32: {worst} (logits up to {spread})"
    );
}

#[test]
fn missing_tensor_is_named() {
    let e = load_bytes(&stories_gguf(Breakage::MissingTensor)).err().unwrap();
    assert!(matches!(e, Error::MissingTensor { .. }), "{e:?}");
    assert!(message(&e).contains("blk.1.ffn_down.weight"), "{}", message(&e));
}

#[test]
fn wrong_shape_says_expected_and_found() {
    let e = load_bytes(&stories_gguf(Breakage::WrongShape)).err().unwrap();
    assert!(matches!(e, Error::WrongShape { .. }), "{e:?}");
    let m = message(&e);
    assert!(
        m.contains("blk.0.ffn_gate.weight") && m.contains("[172, 64]") && m.contains("[86, 128]"),
        "{m}"
    );
}

#[test]
fn unsupported_architecture_is_named() {
    let e = load_bytes(&stories_gguf(Breakage::UnknownArch)).err().unwrap();
    assert!(matches!(e, Error::UnsupportedArchitecture { .. }), "{e:?}");
    assert!(message(&e).contains("gpt-neox"), "{}", message(&e));
}

/// A tensor the architecture's computation does not read refuses the file, naming the tensor
/// (a Llama file with gpt-oss's attention sinks is another model, not this one).
#[test]
fn a_tensor_nothing_reads_refuses_the_file() {
    let e = load_bytes(&stories_gguf(Breakage::ExtraTensor)).err().unwrap();
    assert!(matches!(e, Error::UnusedTensor { .. }), "{e:?}");
    let m = message(&e);
    assert!(
        m.contains("blk.0.attn_sinks.weight") && m.contains("`llama`") && m.contains("offset"),
        "{m}"
    );
}

/// A RoPE scaling kind that is not computed refuses the file, naming the key and the kind.
#[test]
fn an_unknown_rope_scaling_is_refused_by_name() {
    let e = load_bytes(&stories_gguf(Breakage::UnknownScaling)).err().unwrap();
    assert!(matches!(e, Error::Config { .. }), "{e:?}");
    let m = message(&e);
    assert!(m.contains("llama.rope.scaling.type") && m.contains("longrope"), "{m}");
}

/// RoPE over part of a head in a llama file (which llama.cpp refuses too: "invalid n_rot") is
/// refused naming the key; glm4moe's partial RoPE is computed (tests/models.rs).
#[test]
fn partial_rope_is_refused_by_key() {
    let m = message(&load_bytes(&stories_gguf(Breakage::PartialRope)).err().unwrap());
    assert!(
        m.contains("llama.rope.dimension_count") && m.contains("4 of a head's 8"),
        "{m}"
    );
}

/// RoPE frequency factors of the wrong count, or not finite, are refused.
#[test]
fn bad_rope_frequency_factors_are_refused() {
    // stories260K's heads are 8 wide: 4 factors.
    let m = message(
        &load_bytes(&stories_gguf_with(Breakage::None, Some(&[1.0; 3])))
            .err()
            .unwrap(),
    );
    assert!(
        m.contains("3 RoPE frequency factors") && m.contains("head_dim / 2 = 4"),
        "{m}"
    );
    let m = message(
        &load_bytes(&stories_gguf_with(Breakage::None, Some(&[1.0, f32::NAN, 1.0, 1.0])))
            .err()
            .unwrap(),
    );
    assert!(m.contains("RoPE frequency factor is NaN"), "{m}");
}

#[test]
fn missing_tokenizer_is_an_error() {
    let e = load_bytes(&stories_gguf(Breakage::NoTokenizer)).err().unwrap();
    assert!(matches!(e, Error::Tokenizer { .. }), "{e:?}");
    // A safetensors folder without any tokenizer file.
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(stories_dir().join(f), tmp.path().join(f)).unwrap();
    }
    let e = Model::load(tmp.path(), &LoadOptions::default()).err().unwrap();
    assert!(matches!(e, Error::Tokenizer { .. }), "{e:?}");
    assert!(message(&e).contains("tokenizer.json"), "{}", message(&e));
}

#[test]
fn damaged_safetensors_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "tok512.bin"] {
        std::fs::copy(stories_dir().join(f), tmp.path().join(f)).unwrap();
    }
    let good = std::fs::read(stories_dir().join("model.safetensors")).unwrap();
    // Truncated data.
    std::fs::write(tmp.path().join("model.safetensors"), &good[..good.len() / 2]).unwrap();
    let m = message(&Model::load(tmp.path(), &LoadOptions::default()).err().unwrap());
    assert!(m.contains("model.safetensors"), "{m}");
    // Header length beyond the file.
    let mut bad = good.clone();
    bad[0..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    std::fs::write(tmp.path().join("model.safetensors"), &bad).unwrap();
    let m = message(&Model::load(tmp.path(), &LoadOptions::default()).err().unwrap());
    assert!(m.contains("header length"), "{m}");
    // A config that names an unsupported architecture.
    std::fs::write(tmp.path().join("model.safetensors"), &good).unwrap();
    std::fs::write(
        tmp.path().join("config.json"),
        r#"{"model_type": "gpt2", "hidden_size": 64}"#,
    )
    .unwrap();
    let e = Model::load(tmp.path(), &LoadOptions::default()).err().unwrap();
    assert!(matches!(e, Error::UnsupportedArchitecture { .. }), "{e:?}");
}

/// A model path that is no model says what a model path can be: a folder without config.json,
/// a path that does not exist, a file that is neither GGUF nor .gst.
#[test]
fn a_path_that_is_no_model_says_what_a_model_path_is() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("notes.txt"), "hello").unwrap();
    for path in [
        tmp.path().to_path_buf(),
        tmp.path().join("missing.gguf"),
        tmp.path().join("notes.txt"),
    ] {
        let e = Model::load(&path, &LoadOptions::default()).err().unwrap();
        assert!(matches!(e, Error::Input(_)), "{e:?}");
        let m = message(&e);
        assert!(m.contains(&path.display().to_string()), "{m}");
        assert!(
            m.contains("a model path is a .gguf file, a .gst file") && m.contains("config.json"),
            "{m}"
        );
        assert!(!m.contains("os error 2): No such file"), "{m}");
    }
}

/// The safetensors crate's rejections reach the user as the project's errors, with the file
/// and where in it: bad JSON, a tensor whose offsets leave a gap, an unsupported dtype.
#[test]
fn safetensors_header_rejections_name_file_and_offset() {
    use gatestream::safetensors::parse_header;
    let file = |header: &str, data: usize| {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.resize(b.len() + data, 0);
        b
    };
    let p = std::path::Path::new("m.safetensors");
    let ok = file(r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#, 16);
    let t = parse_header(p, &ok, 0).unwrap();
    assert_eq!((t.len(), t[0].shape.clone(), t[0].len_bytes), (1, vec![2, 2], 16));
    for (bytes, want) in [
        (file("{not json", 0), "offset 8: header is not a JSON object"),
        (
            file(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#, 12),
            "offset 8: tensor `a`: data_offsets",
        ),
        (
            file(r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#, 12),
            "does not match its shape",
        ),
        (
            file(r#"{"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}"#, 8),
            "dtype I32 is not supported",
        ),
        (
            file(r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#, 4),
            "truncated",
        ),
        (ok[..5].to_vec(), "too short for a header"),
    ] {
        let m = message(&parse_header(p, &bytes, 0).err().unwrap());
        assert!(m.contains("m.safetensors") && m.contains(want), "want {want:?} in: {m}");
    }
}

/// Writes the fuzz targets' seed corpora (`fuzz/corpus/`, git-ignored): a tiny llama model as
/// GGUF (F32 and Q8_0 matrices) and as a safetensors folder input (config.json length, config,
/// model.safetensors), and a tiny Qwen2-MoE as GGUF and as .gst, each loadable, so mutations
/// start from files that reach every check.
/// Run by `tools/fuzz.sh`.
#[test]
#[ignore = "writes fuzz/corpus/{gguf,safetensors_dir}; run by tools/fuzz.sh, not a check"]
fn write_fuzz_seeds() {
    use gatestream::gguf::MetaValue;
    let (hidden, heads, kv, hd, ffn, vocab) = (32u64, 4u64, 2u64, 8u64, 64u64, 32u64);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
    // (GGUF name, Hugging Face name, GGUF dims); layer tensors get their "blk.0." / "model.layers.0." prefixes.
    let mut shapes: Vec<(String, String, Vec<u64>)> = vec![
        (
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
            vec![hidden, vocab],
        ),
        ("output_norm.weight".into(), "model.norm.weight".into(), vec![hidden]),
    ];
    for (g, h, d) in [
        ("attn_norm", "input_layernorm", vec![hidden]),
        ("attn_q", "self_attn.q_proj", vec![hidden, heads * hd]),
        ("attn_k", "self_attn.k_proj", vec![hidden, kv * hd]),
        ("attn_v", "self_attn.v_proj", vec![hidden, kv * hd]),
        ("attn_output", "self_attn.o_proj", vec![heads * hd, hidden]),
        ("ffn_norm", "post_attention_layernorm", vec![hidden]),
        ("ffn_gate", "mlp.gate_proj", vec![hidden, ffn]),
        ("ffn_up", "mlp.up_proj", vec![hidden, ffn]),
        ("ffn_down", "mlp.down_proj", vec![ffn, hidden]),
    ] {
        shapes.push((format!("blk.0.{g}.weight"), format!("model.layers.0.{h}.weight"), d));
    }
    let value = |i: usize| ((i * 7919 % 200) as f32 - 100.0) / 400.0;
    let f32_bytes = |n: u64| {
        (0..n as usize)
            .flat_map(|i| value(i).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    // Q8_0: per 32 values an f16 scale and 32 signed bytes.
    let q8_bytes = |n: u64| {
        let mut b = Vec::new();
        for blk in 0..(n / 32) as usize {
            b.extend_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            b.extend((0..32).map(|i| ((blk * 32 + i) * 37 % 255) as u8));
        }
        b
    };
    let meta = || -> Vec<(&'static str, MetaValue)> {
        vec![
            ("general.architecture", MetaValue::Str("llama".into())),
            ("llama.context_length", MetaValue::U32(64)),
            ("llama.embedding_length", MetaValue::U32(hidden as u32)),
            ("llama.feed_forward_length", MetaValue::U32(ffn as u32)),
            ("llama.block_count", MetaValue::U32(1)),
            ("llama.attention.head_count", MetaValue::U32(heads as u32)),
            ("llama.attention.head_count_kv", MetaValue::U32(kv as u32)),
            ("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(1e-5)),
            ("llama.rope.freq_base", MetaValue::F32(10000.0)),
            ("tokenizer.ggml.model", MetaValue::Str("llama".into())),
            (
                "tokenizer.ggml.tokens",
                MetaValue::Array((0..vocab).map(|i| MetaValue::Str(format!("t{i}"))).collect()),
            ),
            (
                "tokenizer.ggml.scores",
                MetaValue::Array((0..vocab).map(|i| MetaValue::F32(-(i as f32))).collect()),
            ),
            (
                "tokenizer.ggml.token_type",
                MetaValue::Array((0..vocab).map(|i| MetaValue::I32(if i < 3 { 3 } else { 1 })).collect()),
            ),
            ("tokenizer.ggml.bos_token_id", MetaValue::U32(1)),
            ("tokenizer.ggml.eos_token_id", MetaValue::U32(2)),
        ]
    };
    std::fs::create_dir_all(root.join("gguf")).unwrap();
    for (name, quantized) in [("tiny-f32.gguf", false), ("tiny-q8_0.gguf", true)] {
        let owned: Vec<(String, Vec<u64>, u32, Vec<u8>)> = shapes
            .iter()
            .map(|(g, _, d)| {
                let n: u64 = d.iter().product();
                if quantized && d.len() == 2 {
                    (g.to_string(), d.clone(), 8, q8_bytes(n))
                } else {
                    (g.to_string(), d.clone(), 0, f32_bytes(n))
                }
            })
            .collect();
        let bytes = gguf_of(&meta(), &owned);
        if let Err(e) = load_bytes(&bytes) {
            panic!("the {name} seed does not load: {e}");
        }
        std::fs::write(root.join("gguf").join(name), bytes).unwrap();
    }
    // The safetensors folder input: u16 config length, config.json, model.safetensors.
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "hidden_act": "silu",
    })
    .to_string();
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (_, hf, d) in &shapes {
        let shape: Vec<u64> = d.iter().rev().copied().collect();
        let b = f32_bytes(d.iter().product());
        header.insert(
            hf.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [data.len(), data.len() + b.len()]}),
        );
        data.extend(b);
    }
    let header = serde_json::Value::Object(header).to_string();
    let mut input = (config.len() as u16).to_le_bytes().to_vec();
    input.extend_from_slice(config.as_bytes());
    input.extend_from_slice(&(header.len() as u64).to_le_bytes());
    input.extend_from_slice(header.as_bytes());
    input.extend(data);
    std::fs::create_dir_all(root.join("safetensors_dir")).unwrap();
    std::fs::write(root.join("safetensors_dir/tiny-f32"), input).unwrap();

    // Mixture of experts: a tiny random Qwen2-MoE (router, experts as 3-D tensors, shared expert
    // and its gate) as GGUF, and the same model as .gst (format 3: one section per expert, the
    // shared expert's section) for the index parser.
    let tmp = tempfile::tempdir().unwrap();
    let dense = write_temp(tmp.path(), "stories.gguf", &stories_gguf(Breakage::None));
    let spec = gatestream::synth::MoeSpec {
        arch: gatestream::config::Arch::Qwen2Moe,
        experts: 4,
        used: 2,
        ty: gatestream::quant::GgmlType::Q8_0,
        random: Some(gatestream::synth::RandomShape {
            hidden: 32,
            ffn: 32,
            layers: 1,
            heads: 4,
            kv_heads: 2,
        }),
        perturb: 0.0,
        seed: 3,
    };
    let gguf = tmp.path().join("moe.gguf");
    gatestream::synth::write_moe(&dense, &spec, &gguf, &mut |_, _| {}).unwrap();
    let gst = tmp.path().join("moe.gst");
    gatestream::reformat::reformat(&gguf, &gst, &Default::default(), &mut |_, _, _| {}).unwrap();
    for (from, to) in [
        (&gguf, "gguf/tiny-qwen2moe.gguf"),
        (&gst, "gst_index/tiny-qwen2moe.gst"),
    ] {
        let bytes = std::fs::read(from).unwrap();
        assert!(
            bytes.len() <= 262_144,
            "{to}: {} bytes, over tools/fuzz.sh's -max_len",
            bytes.len()
        );
        std::fs::create_dir_all(root.join(to).parent().unwrap()).unwrap();
        std::fs::write(root.join(to), bytes).unwrap();
    }
}

/// Command-line mistakes get a message, never an abort: a thread count no pool can start, a
/// reformat into a folder that does not exist.
#[test]
fn command_line_mistakes_are_messages() {
    let bin = env!("CARGO_BIN_EXE_gatestream");
    let out = std::process::Command::new(bin)
        .args(["run", "--threads", "100000"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("more than the 1024"), "{err}");
    let out = std::process::Command::new(bin)
        .arg("reformat")
        .arg(stories_dir())
        .arg("/nonexistent-gatestream-dir/m.gst")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("is the folder there and writable"),
        "{err}"
    );
    // A neuron-sparse mask asked of a streamed GGUF: refused before anything runs, with the
    // command that makes a .gst (in sparse mode and in compare mode, whose dense run comes first).
    let tmp = tempfile::tempdir().unwrap();
    let gguf = write_temp(tmp.path(), "m.gguf", &stories_gguf(Breakage::None));
    for mode in ["sparse", "compare"] {
        let out = std::process::Command::new(bin)
            .args([
                "run",
                "--ram-budget",
                "1G",
                "--max-tokens",
                "2",
                "--mode",
                mode,
                "--model",
            ])
            .arg(&gguf)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{mode}: {err}");
        assert!(
            err.contains("gatestream reformat") && err.contains("neuron-major"),
            "{mode}: {err}"
        );
        assert!(
            !err.contains("tok/s") && said.trim().is_empty(),
            "{mode}: ran before refusing: {err}"
        );
    }
}

/// Sizes, budgets and engines are parsed with the arguments: a bad one is refused before
/// anything is opened, naming the flag and what it takes.
#[test]
fn bad_budgets_and_engines_are_refused_with_the_arguments() {
    let cases: [(&[&str], &str); 5] = [
        (&["run", "--ram-budget", "12Q"], "auto or off"),
        (&["run", "--vram-budget", "1Q"], "or auto"),
        (
            &["perplexity", "--text", "/nonexistent", "--ram-budget", "auto"],
            "a share of the file",
        ),
        (
            &["eval", "--text", "/nonexistent", "--ram-budget", "150%"],
            "a share of the file",
        ),
        (
            &["bench", "--model", "/nonexistent", "--engines", "uring,foo"],
            "uring, pread, mmap",
        ),
    ];
    for (args, says) in cases {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gatestream"))
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let flag = args[args.len() - 2];
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag) && err.contains(says), "{args:?}: {err}");
    }
}

/// `--activations` and `--map-host` are flags of their own: they parse (the run then stops at
/// the missing model, not at its arguments), a bad value is refused listing the values, and as
/// `--cuda-opt` keys they are refused naming the flag to use instead, before any model is read.
#[test]
fn activations_and_map_host_are_flags_not_cuda_opts() {
    let gs = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gatestream"))
            .args(args)
            .env_remove("GATESTREAM_CUDA_OPTS")
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = gs(&[
        "run",
        "--model",
        "/nonexistent.gguf",
        "--activations",
        "int8",
        "--map-host",
        "off",
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("/nonexistent.gguf"), "{err}");
    let (code, err) = gs(&["run", "--model", "/nonexistent.gguf", "--activations", "i8"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--activations") && err.contains("int8"), "{err}");
    for (opt, flag) in [
        ("activations=int8", "--activations int8"),
        ("map-host=off", "--map-host off"),
    ] {
        for cmd in [&["run"][..], &["perplexity", "--text", "/nonexistent.txt"]] {
            let args = [cmd, &["--model", "/nonexistent.gguf", "--cuda-opt", opt]].concat();
            let (code, err) = gs(&args);
            assert_eq!(code, Some(1), "{args:?}: {err}");
            assert!(
                err.contains(flag) && err.contains("flag of its own") && !err.contains("/nonexistent.gguf"),
                "{args:?}: {err}"
            );
        }
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gatestream"))
        .args(["run", "--cuda-opt", "help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    assert!(
        help.lines()
            .any(|l| l.starts_with("--activations") && l.contains("auto, f32, q8, int8"))
            && help
                .lines()
                .any(|l| l.starts_with("--map-host") && l.contains("on, off"))
            && !help
                .lines()
                .any(|l| l.starts_with("activations ") || l.starts_with("map-host ")),
        "{help}"
    );
}

/// `run -h` fits a screen (one line a flag, grouped under headings); `--help` keeps every flag
/// with its long text, the flags `-h` leaves out among them.
#[test]
fn run_short_help_fits_a_screen_and_long_help_keeps_every_flag() {
    let help = |flag: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gatestream"))
            .args(["run", flag])
            .output()
            .unwrap();
        assert!(out.status.success(), "run {flag}");
        String::from_utf8(out.stdout).unwrap()
    };
    let (short, long) = (help("-h"), help("--help"));
    assert!(
        short.lines().count() <= 50,
        "run -h is {} lines:\n{short}",
        short.lines().count()
    );
    for heading in ["Model and device:", "Generation:", "Sparsity:", "Streaming and GPU:"] {
        assert!(short.contains(heading), "{heading} missing from run -h");
    }
    for flag in [
        "--ram-budget",
        "--vram-budget",
        "--mode",
        "--temperature",
        "--device",
        "--activations",
        "--map-host",
    ] {
        assert!(short.contains(flag), "{flag} missing from run -h");
    }
    // Left out of -h, kept in --help with the long text.
    for flag in ["--merge-gap-bytes", "--cost-model", "--read-bytes", "--queue-depth"] {
        assert!(!short.contains(flag), "{flag} in run -h");
        assert!(long.contains(flag), "{flag} missing from run --help");
    }
    assert!(
        long.contains("GATESTREAM_MEMORY_LIMIT"),
        "--ram-budget's long text missing from --help"
    );
}

/// The byte position of tensor `name`'s data offset field in a GGUF's header (after its name,
/// dimension count, dimensions and type).
fn offset_field(bytes: &[u8], name: &str) -> usize {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(name.as_bytes());
    let at = bytes.windows(key.len()).position(|w| w == key).expect("tensor info") + key.len();
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    at + 4 + 8 * n_dims + 4
}

/// A tensor whose data offset is not a multiple of the file's alignment, or whose data runs past
/// the end of the file, is refused when loaded and when streamed (`--ram-budget`), naming the
/// file, the tensor and the header offset, never read from the wrong place.
#[test]
fn unaligned_and_overrunning_tensors_are_refused_loaded_and_streamed() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = stories_gguf(Breakage::None);
    let at = offset_field(&bytes, "blk.0.attn_q.weight");
    let offset = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let mut unaligned = bytes.clone();
    unaligned[at..at + 8].copy_from_slice(&(offset + 16).to_le_bytes());
    let mut overrun = bytes.clone();
    overrun[at..at + 8].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    for (name, b, want) in [
        ("unaligned.gguf", &unaligned, "not aligned to 32"),
        ("overrun.gguf", &overrun, "runs past the end of the file"),
    ] {
        let p = write_temp(tmp.path(), name, b);
        let e = Model::load(&p, &LoadOptions::default()).err().expect("refused");
        let m = message(&e);
        assert!(
            m.contains(name) && m.contains("blk.0.attn_q.weight") && m.contains(want),
            "{m}"
        );
        assert!(m.contains("byte offset"), "{m}");
        // Streamed: refused the same way, before anything runs.
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gatestream"))
            .args(["run", "--model"])
            .arg(&p)
            .args(["--ram-budget", "600K", "--max-tokens", "1"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want) && err.contains(name),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// A glm4moe file without a layer's expert score bias (`exp_probs_b`, which GLM-4.5 routes by)
/// is refused naming the tensor and the architecture, not run without it; an unknown gating
/// function is refused naming its key.
#[test]
fn glm4moe_without_its_score_bias_is_refused_by_name() {
    use gatestream::config::Arch;
    use gatestream::gguf::MetaValue;
    use gatestream::synth::{write_model, MakeSpec, Mix, OutputFormat, RoutingShape, Shape, TokenizerChoice};
    let tmp = tempfile::tempdir().unwrap();
    let spec = MakeSpec {
        shape: Shape {
            vocab: 300,
            context_len: 256,
            rope_theta: 10000.0,
            rms_eps: 1e-5,
            experts: Some((4, 2)),
            rope_dim: Some(8),
            routing: Some(RoutingShape::glm(128)),
            ..Shape::custom(Arch::Glm4Moe, 64, 64, 2, 4, 2, 16)
        },
        mix: Mix::Q8_0,
        dequantize: false,
        tokenizer: TokenizerChoice::Synthetic,
        seed: 3,
        residual_gain: 1.0,
    };
    let good = tmp.path().join("glm.gguf");
    write_model(&spec, &good, &OutputFormat::Gguf, true, &mut |_, _| {}).unwrap();
    assert!(Model::load(&good, &LoadOptions::default()).is_ok());
    let g = gatestream::gguf::GgufFile::open(&good).unwrap();
    let meta: Vec<(&str, MetaValue)> = g.metadata.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = g
        .tensors
        .iter()
        .filter(|t| t.name != "blk.1.exp_probs_b.bias")
        .map(|t| (t.name.clone(), t.dims.clone(), t.type_id, g.tensor_bytes(t).to_vec()))
        .collect();
    let e = load_bytes(&gguf_of(&meta, &tensors)).err().expect("refused");
    let m = message(&e);
    assert!(m.contains("blk.1.exp_probs_b.bias") && m.contains("glm4moe"), "{m}");
    let bad = gguf_edited(
        &good,
        vec![("glm4moe.expert_gating_func".into(), MetaValue::U32(4))],
        vec![],
    );
    let m = message(&load_bytes(&bad).err().expect("refused"));
    assert!(m.contains("glm4moe.expert_gating_func"), "{m}");
}

/// A gpt-oss file without a layer's attention sinks is refused naming the tensor (the sinks
/// change every head's softmax: running without them would compute another model).
#[test]
fn gpt_oss_without_attention_sinks_is_refused_naming_the_tensor() {
    use gatestream::config::Arch;
    use gatestream::gguf::MetaValue;
    use gatestream::synth::{write_model, MakeSpec, Mix, OutputFormat, Shape, TokenizerChoice};
    let tmp = tempfile::tempdir().unwrap();
    let spec = MakeSpec {
        shape: Shape {
            vocab: 300,
            context_len: 512,
            experts: Some((4, 2)),
            ..Shape::custom(Arch::GptOss, 64, 64, 2, 4, 2, 32)
        },
        mix: Mix::Mxfp4Moe,
        dequantize: false,
        tokenizer: TokenizerChoice::Synthetic,
        seed: 1,
        residual_gain: 1.0,
    };
    let good = tmp.path().join("good.gguf");
    write_model(&spec, &good, &OutputFormat::Gguf, true, &mut |_, _| {}).unwrap();
    assert!(Model::load(&good, &LoadOptions::default()).is_ok());
    let g = gatestream::gguf::GgufFile::open(&good).unwrap();
    let meta: Vec<(&str, MetaValue)> = g.metadata.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)> = g
        .tensors
        .iter()
        .filter(|t| t.name != "blk.1.attn_sinks.weight")
        .map(|t| (t.name.clone(), t.dims.clone(), t.type_id, g.tensor_bytes(t).to_vec()))
        .collect();
    let e = load_bytes(&gguf_of(&meta, &tensors)).err().unwrap();
    assert!(matches!(e, Error::MissingTensor { .. }), "{e:?}");
    let m = message(&e);
    assert!(m.contains("blk.1.attn_sinks.weight") && m.contains("gpt-oss"), "{m}");
}
