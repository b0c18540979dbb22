//! Byte-level BPE for GGUF "gpt2" vocabularies: llama.cpp's pre-tokenizer regexes chosen by
//! `tokenizer.ggml.pre`, then byte-level BPE by merge rank, both run by the `tokenizers` crate.
//! Owns the mapping from `pre` names to regexes and the building of the `tokenizers` pipeline; it
//! does not split special tokens (the caller does) and does not decode.

use std::path::Path;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use super::tok_err;
use crate::error::Result;

/// llama.cpp's pre-tokenizer choice for a `tokenizer.ggml.pre` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PreTokenizer {
    /// `LLAMA_VOCAB_PRE_TYPE_DEFAULT` (also used when `pre` is missing).
    Default,
    Gpt2,
    /// GPT-2's regex after splitting every digit apart (smollm, starcoder, ...).
    Gpt2Digits,
    Qwen2,
    Llama3,
    /// `LLAMA_VOCAB_PRE_TYPE_GPT4O` (o200k: gpt-oss's `gpt-4o`, `llama4`).
    Gpt4o,
}

const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// o200k's split as its tokenizer.json gives it (llama.cpp rewrites the case-insensitive
/// contractions for std::regex; fancy-regex reads the original).
const GPT4O_REGEX: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl PreTokenizer {
    pub(super) fn from_gguf_pre(path: &Path, pre: Option<&str>) -> Result<PreTokenizer> {
        Ok(match pre {
            None | Some("default") => PreTokenizer::Default,
            Some(
                "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "mpt" | "olmo"
                | "jais" | "trillion" | "granite-docling",
            ) => PreTokenizer::Gpt2,
            Some("smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b") => {
                PreTokenizer::Gpt2Digits
            }
            Some("qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "stablelm2" | "hunyuan" | "megrez") => {
                PreTokenizer::Qwen2
            }
            Some(
                "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
                | "jina-v5-nano",
            ) => PreTokenizer::Llama3,
            Some("gpt-4o" | "llama4") => PreTokenizer::Gpt4o,
            Some(other) => {
                return Err(tok_err(
                    path,
                    format!(
                        "tokenizer.ggml.pre `{other}` is not supported; supported: default, gpt-2, \
                         smollm, starcoder, qwen2, llama-bpe, gpt-4o and their aliases"
                    ),
                ))
            }
        })
    }

    /// llama.cpp's regexes for this type, applied one after another.
    fn regexes(self) -> &'static [&'static str] {
        match self {
            PreTokenizer::Default => &[r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"],
            PreTokenizer::Gpt2 => &[GPT2_REGEX],
            PreTokenizer::Gpt2Digits => &[r"\p{N}", GPT2_REGEX],
            PreTokenizer::Qwen2 => &[QWEN2_REGEX],
            PreTokenizer::Llama3 => &[LLAMA3_REGEX],
            PreTokenizer::Gpt4o => &[GPT4O_REGEX],
        }
    }

    pub(super) fn default_add_bos(self) -> bool {
        self == PreTokenizer::Llama3
    }
}

pub(super) fn byte_level_bpe(
    path: &Path,
    tokens: &[String],
    merges: &[String],
    pre: PreTokenizer,
) -> Result<tokenizers::Tokenizer> {
    let mut vocab = Vocab::default();
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert(t.clone(), id as u32);
    }
    let merges: Vec<(String, String)> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| tok_err(path, format!("merge {i} `{m}` is not two tokens")))
        })
        .collect::<Result<_>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre == PreTokenizer::Llama3)
        .build()
        .map_err(|e| tok_err(path, format!("cannot build BPE from tokens and merges: {e}")))?;
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    for re in pre.regexes() {
        let split = Split::new(
            SplitPattern::Regex((*re).to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| tok_err(path, format!("pre-tokenizer regex {re:?}: {e}")))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(Sequence::new(steps)));
    Ok(tok)
}
