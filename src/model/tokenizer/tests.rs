//! Golden ids come from llama.cpp's own `llama-tokenize` (same GGUF files, `--no-bos` unless
//! stated, special tokens parsed), built from the llama-cpp-python 0.3.36 source package.
use super::bpe::{byte_level_bpe, PreTokenizer};
use super::*;
use std::collections::HashMap;
use std::io::Read;

fn models_dir() -> PathBuf {
    match std::env::var_os("GATESTREAM_MODELS") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/gatestream/models"),
    }
}

fn data_dir() -> PathBuf {
    match std::env::var_os("GATESTREAM_DATA") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("data"),
    }
}

/// The model file, or a failure that says how to fetch it.
fn model_path(fetch_name: &str, file: &str) -> PathBuf {
    let path = models_dir().join(file);
    assert!(
        path.is_file(),
        "{} is missing: run `tools/fetch-models.sh {fetch_name}` (or set GATESTREAM_MODELS)",
        path.display()
    );
    path
}

/// Just enough of GGUF to read `tokenizer.*` metadata (the crate's reader lives elsewhere).
fn read_gguf_vocab(path: &Path) -> GgufVocab {
    #[derive(Debug)]
    enum V {
        U(u64),
        I(i64),
        F(f64),
        B(bool),
        S(String),
        A(Vec<V>),
    }
    fn take<const N: usize>(r: &mut impl Read) -> [u8; N] {
        let mut b = [0u8; N];
        r.read_exact(&mut b).expect("truncated GGUF metadata");
        b
    }
    fn string(r: &mut impl Read) -> String {
        let len = u64::from_le_bytes(take(r)) as usize;
        let mut b = vec![0u8; len];
        r.read_exact(&mut b).expect("truncated GGUF string");
        String::from_utf8_lossy(&b).into_owned()
    }
    fn value(r: &mut impl Read, ty: u32) -> V {
        match ty {
            0 => V::U(take::<1>(r)[0] as u64),
            1 => V::I(take::<1>(r)[0] as i8 as i64),
            2 => V::U(u16::from_le_bytes(take(r)) as u64),
            3 => V::I(i16::from_le_bytes(take(r)) as i64),
            4 => V::U(u32::from_le_bytes(take(r)) as u64),
            5 => V::I(i32::from_le_bytes(take(r)) as i64),
            6 => V::F(f32::from_le_bytes(take(r)) as f64),
            7 => V::B(take::<1>(r)[0] != 0),
            8 => V::S(string(r)),
            9 => {
                let ty = u32::from_le_bytes(take(r));
                let n = u64::from_le_bytes(take(r));
                V::A((0..n).map(|_| value(r, ty)).collect())
            }
            10 => V::U(u64::from_le_bytes(take(r))),
            11 => V::I(i64::from_le_bytes(take(r))),
            12 => V::F(f64::from_le_bytes(take(r))),
            other => panic!("GGUF value type {other}"),
        }
    }
    let file = std::fs::File::open(path).unwrap();
    let mut r = std::io::BufReader::with_capacity(1 << 20, file);
    assert_eq!(&take::<4>(&mut r), b"GGUF");
    let _version = u32::from_le_bytes(take(&mut r));
    let _n_tensors = u64::from_le_bytes(take(&mut r));
    let n_kv = u64::from_le_bytes(take(&mut r));
    let mut kv = HashMap::new();
    for _ in 0..n_kv {
        let key = string(&mut r);
        let ty = u32::from_le_bytes(take(&mut r));
        kv.insert(key, value(&mut r, ty));
    }
    let get = |k: &str| kv.get(&format!("tokenizer.{k}"));
    let s = |k: &str| match get(k) {
        Some(V::S(s)) => Some(s.clone()),
        _ => None,
    };
    let id = |k: &str| match get(k) {
        Some(V::U(u)) => Some(*u as u32),
        Some(V::I(i)) => Some(*i as u32),
        _ => None,
    };
    let flag = |k: &str| match get(k) {
        Some(V::B(b)) => Some(*b),
        _ => None,
    };
    let list = |k: &str| match get(k) {
        Some(V::A(a)) => Some(a),
        _ => None,
    };
    let strings = |k: &str| {
        list(k).map(|a| {
            a.iter()
                .map(|v| if let V::S(s) = v { s.clone() } else { panic!("{k}") })
                .collect()
        })
    };
    GgufVocab {
        model: s("ggml.model").expect("tokenizer.ggml.model"),
        pre: s("ggml.pre"),
        tokens: strings("ggml.tokens").expect("tokenizer.ggml.tokens"),
        scores: list("ggml.scores").map(|a| {
            a.iter()
                .map(|v| if let V::F(f) = v { *f as f32 } else { panic!("score") })
                .collect()
        }),
        token_types: list("ggml.token_type").map(|a| {
            a.iter()
                .map(|v| if let V::I(i) = v { *i as i32 } else { panic!("type") })
                .collect()
        }),
        merges: strings("ggml.merges"),
        bos_id: id("ggml.bos_token_id"),
        eos_id: id("ggml.eos_token_id"),
        eot_id: id("ggml.eot_token_id"),
        eom_id: id("ggml.eom_token_id"),
        unknown_id: id("ggml.unknown_token_id"),
        padding_id: id("ggml.padding_token_id"),
        add_bos: flag("ggml.add_bos_token"),
        add_eos: flag("ggml.add_eos_token"),
        add_space_prefix: flag("ggml.add_space_prefix"),
        chat_template: s("chat_template"),
    }
}

fn load(fetch_name: &str, file: &str) -> Tokenizer {
    let path = model_path(fetch_name, file);
    Tokenizer::from_gguf(&path, &read_gguf_vocab(&path)).unwrap()
}

/// The first 20,000 bytes of wikitext-2's test split, cut back to a character boundary.
fn wiki_20k() -> String {
    let path = data_dir().join("wikitext-2/wiki.test.raw");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; the shared data folder is missing", path.display()));
    let end = (0..=20_000.min(text.len()))
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap();
    text[..end].to_owned()
}

fn fnv1a(ids: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in ids.iter().flat_map(|i| i.to_le_bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const STRINGS: [&str; 8] = [
    "The capital of France is",
    " = Robert Boulter = \n",
    "日本語のテキスト 🤖🎉 naïve café",
    "   leading spaces",
    "<|im_start|>user\nHi<|im_end|>",
    "It's 1234567 dollars, isn't it? 3.14159!",
    "a\n\n\n  b\t\tc    d",
    "<start_of_turn>model\n<b>x</b>   y",
];

/// Golden ids per string, then (length, FNV-1a) of the 20 KB wikitext slice.
fn check_against_llama_cpp(tok: &Tokenizer, golden: [&[u32]; 8], wiki: (usize, u64)) {
    for (text, want) in STRINGS.iter().zip(golden) {
        assert_eq!(tok.encode(text, false).unwrap(), want, "encoding {text:?}");
        let plain = !text.contains("<|") && !text.contains("<start_of_turn>");
        if plain {
            assert_eq!(tok.decode(want).unwrap(), *text, "decoding {text:?}");
        }
    }
    let text = wiki_20k();
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!((ids.len(), fnv1a(&ids)), wiki, "wikitext 20 KB differs from llama.cpp");
    assert_eq!(tok.decode(&ids).unwrap(), text, "wikitext round trip");
    let mut stream = tok.stream_decoder();
    let streamed: String = ids.iter().filter_map(|&id| stream.push(id)).collect();
    assert_eq!(streamed + &stream.flush().unwrap_or_default(), text, "stream decode");
}

#[test]
fn stories260k_llama2c() {
    let path = data_dir().join("stories260K/tok512.bin");
    let tok = Tokenizer::from_llama2c(&path, 1, 2).unwrap();
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.encode("Once upon a time", false).unwrap(), [403, 407, 261, 378]);
    assert_eq!(tok.encode("Once upon a time", true).unwrap(), [1, 403, 407, 261, 378]);
    assert_eq!(tok.decode(&[1, 403, 407, 261, 378]).unwrap(), "Once upon a time");
    assert!(tok.is_stop(2) && !tok.is_stop(1));
    // Characters outside the 512-token vocabulary fall back to bytes and come back whole,
    // one character at a time from the stream decoder.
    let text = "Lily saw 日本 and 🤖.";
    let ids = tok.encode(text, false).unwrap();
    assert!(
        ids.iter().any(|&id| (3..259).contains(&id)),
        "byte fallback used: {ids:?}"
    );
    assert_eq!(tok.decode(&ids).unwrap(), text);
    let mut stream = tok.stream_decoder();
    let chunks: Vec<String> = ids.iter().filter_map(|&id| stream.push(id)).collect();
    assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')), "{chunks:?}");
    assert!(chunks.contains(&"🤖".to_owned()), "{chunks:?}");
    assert_eq!(chunks.concat(), format!(" {text}"));
    assert!(stream.flush().is_none());
}

#[test]
fn smollm2_matches_llama_cpp() {
    let tok = load("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(tok.vocab_size(), 49152);
    assert!(!tok.adds_bos(), "SmolLM2's GGUF says add_bos_token = false");
    assert_eq!(
        tok.encode("The capital of France is", true).unwrap(),
        [504, 3575, 282, 4649, 314]
    );
    assert!(tok.is_stop(2) && tok.is_stop(0) && !tok.is_stop(1));
    check_against_llama_cpp(
        &tok,
        [
            &[504, 3575, 282, 4649, 314],
            &[446, 6356, 389, 9226, 352, 446, 3717],
            &[
                23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 15107, 114,
                240, 10813, 232, 227, 15486, 46494, 37366,
            ],
            &[256, 2899, 5600],
            &[1, 4093, 198, 26843, 2],
            &[
                1589, 506, 216, 33, 34, 35, 36, 37, 38, 39, 8358, 28, 3247, 982, 357, 47, 216, 35, 30, 33, 36, 33, 37,
                41, 17,
            ],
            &[81, 1116, 3805, 278, 197, 197, 83, 333, 287],
            &[
                44, 3738, 79, 1714, 79, 20589, 46, 3980, 198, 44, 82, 46, 104, 9617, 82, 46, 256, 329,
            ],
        ],
        (4697, 0x8bfc_a625_b486_2e76),
    );
}

#[test]
fn qwen25_matches_llama_cpp() {
    let tok = load("qwen1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    assert_eq!(tok.vocab_size(), 151936);
    assert!(!tok.adds_bos());
    for stop in [151643, 151645, 151662, 151663, 151664] {
        assert!(tok.is_stop(stop), "{stop}");
    }
    check_against_llama_cpp(
        &tok,
        [
            &[785, 6722, 315, 9625, 374],
            &[284, 8397, 425, 10965, 465, 284, 715],
            &[
                101059, 102819, 15767, 56833, 61803, 70534, 11162, 97, 244, 144841, 94880, 586, 51950,
            ],
            &[256, 6388, 12621],
            &[151644, 872, 198, 13048, 151645],
            &[
                2132, 594, 220, 16, 17, 18, 19, 20, 21, 22, 11192, 11, 4436, 944, 432, 30, 220, 18, 13, 16, 19, 16, 20,
                24, 0,
            ],
            &[64, 1406, 220, 293, 197, 1444, 262, 294],
            &[
                27, 2468, 3575, 37274, 29, 2528, 198, 33177, 28257, 522, 65, 29, 256, 379,
            ],
        ],
        (4598, 0x1e6c_d8f8_2551_14ea),
    );
}

#[test]
fn gemma3_matches_llama_cpp() {
    let tok = load("gemma3", "gemma-3-270m-q4_k_m.gguf");
    assert_eq!(tok.vocab_size(), 262144);
    assert!(tok.adds_bos());
    assert_eq!(tok.bos_id(), Some(2));
    assert_eq!(
        tok.encode("The capital of France is", true).unwrap(),
        [2, 818, 5279, 529, 7001, 563]
    );
    assert!(tok.is_stop(1) && tok.is_stop(106) && !tok.is_stop(2));
    check_against_llama_cpp(
        &tok,
        [
            &[818, 5279, 529, 7001, 563],
            &[578, 9877, 151936, 589, 578, 236743, 107],
            &[94951, 236945, 95830, 236743, 246143, 242061, 120362, 33443],
            &[139, 26016, 9952],
            &[
                236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 10979, 236820, 236909, 548, 236779, 643, 111038,
            ],
            &[
                1509, 236789, 236751, 236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 11092, 236764,
                5889, 236789, 236745, 625, 236881, 236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819,
                236888,
            ],
            &[236746, 109, 138, 236763, 255969, 236755, 140, 236753],
            &[105, 4368, 107, 200, 236781, 209, 139, 236762],
        ],
        (4544, 0x742f_6f58_c4a6_ed57),
    );
    assert!(!tok.has_chat_template(), "this Gemma GGUF carries no chat template");
    assert!(tok.apply_chat_template("Hi").is_err());
}

#[test]
fn chat_templates_from_gguf() {
    let smol = load("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf");
    let prompt = smol.apply_chat_template("What is 2+2?").unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    // llama-tokenize on the same text.
    assert_eq!(
        smol.encode(&prompt, true).unwrap(),
        [
            1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
            2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198
        ]
    );
    let qwen = load("qwen1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    assert_eq!(
        qwen.apply_chat_template("Hi").unwrap(),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
         assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn hf_folder_matches_gguf() {
    // A tokenizer.json written by the `tokenizers` crate from SmolLM2's GGUF vocabulary, with
    // its control tokens as special added tokens, must encode like the GGUF path.
    let path = model_path("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf");
    let v = read_gguf_vocab(&path);
    let gguf = Tokenizer::from_gguf(&path, &v).unwrap();
    let pre = PreTokenizer::from_gguf_pre(&path, v.pre.as_deref()).unwrap();
    let mut tok = byte_level_bpe(&path, &v.tokens, v.merges.as_ref().unwrap(), pre).unwrap();
    let control: Vec<tokenizers::AddedToken> = (0..17)
        .map(|id| tokenizers::AddedToken::from(v.tokens[id].clone(), true))
        .collect();
    assert_eq!(tok.add_special_tokens(control).unwrap(), 17);
    tok.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
    let dir = std::env::temp_dir().join(format!("gatestream-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    let config = serde_json::json!({
        "add_bos_token": false, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": v.chat_template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let hf = Tokenizer::from_hf_dir(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    let hf = hf.unwrap();
    assert_eq!(hf.vocab_size(), 49152);
    assert_eq!(hf.bos_id(), Some(1));
    assert!(hf.is_stop(2) && hf.is_stop(0));
    assert_eq!(
        hf.apply_chat_template("x").unwrap(),
        gguf.apply_chat_template("x").unwrap()
    );
    for text in STRINGS.iter().copied().chain([wiki_20k().as_str()]) {
        let ids = gguf.encode(text, true).unwrap();
        assert_eq!(hf.encode(text, true).unwrap(), ids, "{text:?}");
        assert_eq!(hf.decode(&ids).unwrap(), gguf.decode(&ids).unwrap());
    }
}

#[test]
fn bad_input_is_an_error() {
    let p = Path::new("bad.gguf");
    let mut v = GgufVocab {
        model: "llama".into(),
        tokens: vec!["a".into()],
        ..Default::default()
    };
    assert!(Tokenizer::from_gguf(p, &v).is_err(), "llama without scores");
    v.scores = Some(vec![0.0, 1.0]);
    assert!(Tokenizer::from_gguf(p, &v).is_err(), "score count mismatch");
    v.scores = Some(vec![0.0]);
    v.bos_id = Some(7);
    assert!(Tokenizer::from_gguf(p, &v).is_err(), "BOS outside the vocabulary");
    v.bos_id = None;
    v.model = "wordpiece".into();
    assert!(Tokenizer::from_gguf(p, &v).is_err());
    v.model = "llama".into();
    let tok = Tokenizer::from_gguf(p, &v).unwrap();
    // "b" has no token and there are no byte tokens: an error, not a panic.
    assert!(tok.encode("b", false).is_err());
    assert!(tok.decode(&[5]).is_err());
    let dir = std::env::temp_dir().join(format!("gatestream-tok-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tok.bin");
    std::fs::write(&file, [0u8, 0, 0, 0, 0, 0, 0, 0, 100, 0, 0, 0, b'a']).unwrap();
    let truncated = Tokenizer::from_llama2c(&file, 1, 2);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(truncated, Err(Error::Malformed { .. })), "{truncated:?}");
}

/// o200k_harmony's (gpt-oss's) markers on SmolLM2's vocabulary (in place of seven of its control
/// tokens): `<|return|>` and `<|call|>` stop generation, `<|end|>` then does not (as llama.cpp:
/// it closes the analysis message, not the reply) and shows in the text with `<|channel|>`,
/// `<|message|>` and `<|start|>`, so a reply's final channel can be found
/// ([`crate::model::chat::harmony_final`]).
#[test]
fn harmony_markers_stop_and_show_as_llama_cpp() {
    let path = model_path("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf");
    let mut v = read_gguf_vocab(&path);
    let markers = [
        "<|return|>",
        "<|call|>",
        "<|end|>",
        "<|channel|>",
        "<|message|>",
        "<|start|>",
        "<|constrain|>",
    ];
    for (i, m) in markers.iter().enumerate() {
        v.tokens[3 + i] = m.to_string();
    }
    let tok = Tokenizer::from_gguf(&path, &v).unwrap();
    assert!(tok.is_stop(3) && tok.is_stop(4), "<|return|> and <|call|> stop");
    assert!(!tok.is_stop(5), "<|end|> does not stop beside <|return|> and <|call|>");
    let reply = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi<|return|>";
    let ids = tok.encode(reply, false).unwrap();
    for id in [3, 5, 6, 7, 8] {
        assert!(ids.contains(&id), "marker {id} parsed in {ids:?}");
    }
    let text = tok.decode(&ids).unwrap();
    assert_eq!(
        text,
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi"
    );
    assert_eq!(crate::model::chat::harmony_final(&text), "Hi");
    // Without `<|call|>`, `<|end|>` keeps stopping (another family's end of turn).
    let mut v = read_gguf_vocab(&path);
    v.tokens[3] = "<|return|>".into();
    v.tokens[5] = "<|end|>".into();
    let tok = Tokenizer::from_gguf(&path, &v).unwrap();
    assert!(tok.is_stop(3) && tok.is_stop(5));
}

/// gpt-oss's `gpt-4o` pre-tokenizer (o200k's split): words with their case pattern and
/// contraction, numbers in threes, punctuation runs with trailing newlines or slashes,
/// newline runs.
#[test]
fn gpt4o_pre_tokenizer_splits_as_o200k() {
    let path = Path::new("gpt4o.gguf");
    let pre = PreTokenizer::from_gguf_pre(path, Some("gpt-4o")).unwrap();
    let tokens: Vec<String> = ["a", "b"].iter().map(|s| s.to_string()).collect();
    let tok = byte_level_bpe(path, &tokens, &[], pre).unwrap();
    use tokenizers::tokenizer::PreTokenizer as _;
    let mut pieces = tokenizers::PreTokenizedString::from("Hello World's HTTPServer 12345 a/b!!\n\n c");
    tok.get_pre_tokenizer().unwrap().pre_tokenize(&mut pieces).unwrap();
    let got: Vec<String> = pieces
        .get_splits(tokenizers::OffsetReferential::Original, tokenizers::OffsetType::Byte)
        .iter()
        .map(|(p, _, _)| p.replace('\u{120}', " ").replace('\u{10a}', "\n"))
        .collect();
    assert_eq!(
        got,
        [
            "Hello",
            " World's",
            " HTTPServer",
            " ",
            "123",
            "45",
            " a",
            "/b",
            "!!\n\n",
            " c"
        ]
    );
}
