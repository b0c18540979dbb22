//! Hugging Face model folders: `tokenizer.json` run as the `tokenizers` crate runs it (including
//! its own added tokens), with special ids, `add_bos_token` and the chat template taken from
//! `tokenizer_config.json`, `config.json` and `chat_template.jinja` when present. Owns reading
//! those JSON files; the per-token decode bytes come from [`super::pieces`].

use std::path::Path;

use serde_json::Value;

use super::pieces::{gguf_pieces, PieceSpelling};
use super::specials::Specials;
use super::spm::parse_byte_token;
use super::STOP_TOKEN_TEXTS;
use super::{tok_err, Engine, TokenKind, Tokenizer};
use crate::error::Result;

fn parse_json(path: &Path, what: &str, text: Option<&str>) -> Result<Value> {
    match text {
        None => Ok(Value::Null),
        Some(t) => serde_json::from_str(t).map_err(|e| tok_err(path, format!("{what} is not valid JSON: {e}"))),
    }
}

/// `"<s>"` or `{"content": "<s>", ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `2` or `[2, 32000]`.
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().and_then(|n| u32::try_from(n).ok()).into_iter().collect(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|n| n.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

/// A string, or a list of `{name, template}` from which "default" (else the first) is taken.
fn chat_template(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
            };
            named("default")
                .or(list.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        }
        _ => None,
    }
}

/// Build from the texts of a Hugging Face folder's files; `path` names the source in errors.
pub(super) fn load(
    path: &Path,
    tokenizer_json: &str,
    tokenizer_config_json: Option<&str>,
    config_json: Option<&str>,
    chat_template_jinja: Option<String>,
) -> Result<Tokenizer> {
    let tok = <tokenizers::Tokenizer as std::str::FromStr>::from_str(tokenizer_json)
        .map_err(|e| tok_err(path, format!("cannot load tokenizer.json: {e}")))?;
    let config = parse_json(path, "tokenizer_config.json", tokenizer_config_json)?;
    let model_config = parse_json(path, "config.json", config_json)?;

    let vocab_size = tok.get_vocab_size(true);
    let by_text = |v: Option<&Value>| token_text(v).and_then(|t| tok.token_to_id(&t));
    let bos_id = ids(model_config.get("bos_token_id"))
        .first()
        .copied()
        .or_else(|| by_text(config.get("bos_token")))
        .filter(|&id| (id as usize) < vocab_size);
    let mut stop_ids = ids(model_config.get("eos_token_id"));
    stop_ids.extend(by_text(config.get("eos_token")));
    stop_ids.extend(STOP_TOKEN_TEXTS.iter().filter_map(|t| tok.token_to_id(t)));
    stop_ids.retain(|&id| (id as usize) < vocab_size);
    stop_ids.sort_unstable();
    stop_ids.dedup();

    let adds_bos = match config.get("add_bos_token").and_then(Value::as_bool) {
        Some(flag) => flag,
        // No flag: does the post-processor put BOS first?
        None => {
            let probe = tok.encode_fast("a", true).map(|e| e.get_ids().first().copied());
            matches!((probe, bos_id), (Ok(Some(first)), Some(bos)) if first == bos)
        }
    } && bos_id.is_some();

    let decoder = tok
        .get_decoder()
        .and_then(|d| serde_json::to_string(d).ok())
        .unwrap_or_default();
    let spelling = if decoder.contains("ByteLevel") {
        PieceSpelling::ByteLevel
    } else if decoder.contains("ByteFallback") || decoder.contains("Metaspace") || decoder.contains('\u{2581}') {
        PieceSpelling::SentencePiece
    } else {
        PieceSpelling::Plain
    };
    // SentencePiece decoders drop the space the normalizer put in front.
    let strips_space = decoder.contains("Strip") || (decoder.contains("Metaspace") && !decoder.contains("\"never\""));

    let added = tok.get_added_tokens_decoder();
    let mut texts = Vec::with_capacity(vocab_size);
    let mut kinds = Vec::with_capacity(vocab_size);
    for id in 0..vocab_size as u32 {
        let text = tok.id_to_token(id).unwrap_or_default();
        let kind = match added.get(&id) {
            Some(t) if t.special => TokenKind::Control,
            Some(_) => TokenKind::UserDefined,
            None if text.is_empty() => TokenKind::Unused,
            None if spelling == PieceSpelling::SentencePiece && parse_byte_token(&text).is_some() => TokenKind::Byte,
            None => TokenKind::Normal,
        };
        texts.push(text);
        kinds.push(kind);
    }
    let template = chat_template_jinja.or_else(|| chat_template(config.get("chat_template")));
    Ok(Tokenizer {
        path: path.to_path_buf(),
        pieces: gguf_pieces(&texts, &kinds, spelling),
        engine: Engine::Hf(Box::new(tok)),
        specials: Specials::default(),
        add_space_prefix: strips_space,
        bos_id,
        adds_bos,
        stop_ids,
        chat_template: template,
    })
}
