//! Text to token ids and back, matching llama.cpp's tokenizer exactly for GGUF models.
//!
//! Owns three ways to get a vocabulary — GGUF `tokenizer.*` metadata (filled by the GGUF reader),
//! a Hugging Face `tokenizer.json` folder, and llama2.c's binary `tok512.bin` — and turns them into
//! one [`Tokenizer`]. For GGUF files the ids must equal llama.cpp's (perplexity is compared with
//! it), so this module reproduces llama.cpp's `llama-vocab.cpp` step by step:
//!
//! 1. Special tokens (control, user-defined, unknown) are cut out of the text first, longest token
//!    text first, exactly as `tokenizer_st_partition` does; `<|im_start|>` is then one id.
//! 2. `gpt2` vocabularies: the pre-tokenizer regexes llama.cpp uses for `tokenizer.ggml.pre`, then
//!    byte-level BPE by merge rank — both run by the `tokenizers` crate.
//! 3. `llama` vocabularies (SentencePiece BPE, Gemma) and llama2.c: llama.cpp's SPM algorithm,
//!    implemented here — repeatedly merge the adjacent pair whose merged text is a token with the
//!    highest score (ties: leftmost), then byte fallback `<0xNN>` for what is left. Done directly
//!    rather than through derived BPE merges because it is then identical by construction (equal
//!    scores, ties and user-defined tokens behave as llama.cpp's) and builds in milliseconds.
//!
//! Decoding maps every id to its bytes once at load time; [`StreamDecoder`] emits text as soon as
//! it is complete UTF-8. Chat templates are recognised by family in [`super::chat`], not run.
//! This module does no model-file parsing (the GGUF reader fills [`GgufVocab`]) and reads no
//! environment variables.
//!
//! Layout: this file holds the public API ([`Tokenizer`], [`GgufVocab`], [`StreamDecoder`]), the
//! token kinds and the dispatch to an encoding engine; `specials` cuts special tokens out of the
//! text, `spm` is the SentencePiece/llama2.c score-merge encoder, `bpe` builds the gpt2 byte-level
//! BPE with llama.cpp's pre-tokenizer regexes, `pieces` maps token texts to the bytes they decode
//! to, and `hf` loads a Hugging Face `tokenizer.json` folder.

mod bpe;
mod hf;
mod pieces;
mod specials;
mod spm;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use bpe::{byte_level_bpe, PreTokenizer};
use pieces::{gguf_pieces, PieceSpelling};
use specials::{Fragment, Specials};
use spm::{parse_byte_token, parse_llama2c, SpaceMarker, Spm};

/// What a GGUF file's `tokenizer.*` metadata holds (filled by the GGUF reader).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE with scores).
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. "smollm", "qwen2", "default", "llama-bpe".
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    /// 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// "a b" pairs for gpt2.
    pub merges: Option<Vec<String>>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub eot_id: Option<u32>,
    pub eom_id: Option<u32>,
    pub unknown_id: Option<u32>,
    pub padding_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    pub chat_template: Option<String>,
}

/// Everything needed to rebuild a tokenizer, in a form that serializes (a `.gst` file stores it):
/// the GGUF metadata, the Hugging Face files' texts, or llama2.c's binary vocabulary.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TokenizerSpec {
    Gguf {
        vocab: GgufVocab,
    },
    HfFiles {
        tokenizer_json: String,
        tokenizer_config_json: Option<String>,
        config_json: Option<String>,
        chat_template_jinja: Option<String>,
    },
    Llama2c {
        bin: Vec<u8>,
        bos_id: u32,
        eos_id: u32,
    },
}

impl TokenizerSpec {
    /// The texts of a Hugging Face folder's tokenizer files (`tokenizer.json` is required).
    pub fn read_hf_dir(dir: &Path) -> Result<TokenizerSpec> {
        let json_path = dir.join("tokenizer.json");
        let tokenizer_json = match std::fs::read_to_string(&json_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(tok_err(dir, "no tokenizer.json in this folder"));
            }
            Err(e) => return Err(Error::io(&json_path, e)),
        };
        let optional = |name: &str| -> Result<Option<String>> {
            let p = dir.join(name);
            match std::fs::read_to_string(&p) {
                Ok(t) => Ok(Some(t)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(Error::io(&p, e)),
            }
        };
        Ok(TokenizerSpec::HfFiles {
            tokenizer_json,
            tokenizer_config_json: optional("tokenizer_config.json")?,
            config_json: optional("config.json")?,
            chat_template_jinja: optional("chat_template.jinja")?,
        })
    }
}

/// A token's kind, as llama.cpp's token attributes classify it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    fn from_gguf(code: i32) -> TokenKind {
        match code {
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            // 1, and undefined codes, which llama.cpp also treats as normal text.
            _ => TokenKind::Normal,
        }
    }

    /// Cut out of the text before the model runs (llama.cpp's special-token cache).
    fn is_matched_whole(self) -> bool {
        matches!(self, TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown)
    }

    /// Left out of decoded text (llama.cpp's `token_to_piece` with `special = false`).
    fn is_hidden(self) -> bool {
        matches!(self, TokenKind::Control | TokenKind::Unknown | TokenKind::Unused)
    }
}

/// Token texts llama.cpp treats as end-of-generation (and forces to control) when present.
/// From `llama-vocab.cpp`'s EOG and FIM pad/repo/sep lists, for the families gatestream runs.
const STOP_TOKEN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    // o200k_harmony (gpt-oss): the end of a reply, and of a tool call.
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<|fim_pad|>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<reponame>",
    "<|file_sep|>",
];

/// The engine that turns a piece of plain text (no special tokens in it) into ids.
enum Engine {
    /// Byte-level BPE run by `tokenizers` (GGUF "gpt2"); special tokens handled by [`Specials`].
    ByteBpe(Box<tokenizers::Tokenizer>),
    /// llama.cpp's SentencePiece BPE (GGUF "llama", llama2.c).
    Spm(Box<Spm>),
    /// A Hugging Face `tokenizer.json`, run exactly as the `tokenizers` crate runs it, including
    /// its own added tokens.
    Hf(Box<tokenizers::Tokenizer>),
}

/// A loaded tokenizer: encoding engine, per-token bytes for decoding, special ids and flags.
pub struct Tokenizer {
    /// Where the vocabulary came from, for error messages.
    path: PathBuf,
    engine: Engine,
    specials: Specials,
    /// SPM only: a space is put in front of every text run that starts the input or follows a
    /// special token (llama.cpp's `add_space_prefix`), and decode drops it again.
    add_space_prefix: bool,
    /// The bytes each id decodes to (empty for hidden tokens).
    pieces: Vec<Box<[u8]>>,
    bos_id: Option<u32>,
    adds_bos: bool,
    /// Sorted, deduplicated.
    stop_ids: Vec<u32>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.pieces.len())
            .field("bos_id", &self.bos_id)
            .field("adds_bos", &self.adds_bos)
            .field("stop_ids", &self.stop_ids)
            .finish_non_exhaustive()
    }
}

fn tok_err(path: &Path, what: impl Into<String>) -> Error {
    Error::Tokenizer {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

impl Tokenizer {
    /// Builds the tokenizer llama.cpp would build from this GGUF metadata. `path` is only used in
    /// error messages.
    pub fn from_gguf(path: &Path, v: &GgufVocab) -> Result<Tokenizer> {
        let n = v.tokens.len();
        if n == 0 {
            return Err(tok_err(path, "tokenizer.ggml.tokens is empty"));
        }
        if u32::try_from(n).is_err() {
            return Err(tok_err(path, format!("{n} tokens do not fit 32-bit ids")));
        }
        let check_len = |name: &str, len: usize| -> Result<()> {
            if len != n {
                return Err(tok_err(path, format!("{name} has {len} entries for {n} tokens")));
            }
            Ok(())
        };
        let mut kinds: Vec<TokenKind> = match &v.token_types {
            Some(types) => {
                check_len("tokenizer.ggml.token_type", types.len())?;
                types.iter().map(|&t| TokenKind::from_gguf(t)).collect()
            }
            None => v
                .tokens
                .iter()
                .map(|t| {
                    if parse_byte_token(t).is_some() {
                        TokenKind::Byte
                    } else {
                        TokenKind::Normal
                    }
                })
                .collect(),
        };
        let check_id = |name: &str, id: Option<u32>| -> Result<Option<u32>> {
            match id {
                Some(id) if id as usize >= n => Err(tok_err(
                    path,
                    format!("{name} = {id} is outside the vocabulary of {n} tokens"),
                )),
                other => Ok(other),
            }
        };
        let bos_id = check_id("tokenizer.ggml.bos_token_id", v.bos_id)?;
        let eos_id = check_id("tokenizer.ggml.eos_token_id", v.eos_id)?;
        let eot_id = check_id("tokenizer.ggml.eot_token_id", v.eot_id)?;
        let eom_id = check_id("tokenizer.ggml.eom_token_id", v.eom_id)?;
        check_id("tokenizer.ggml.unknown_token_id", v.unknown_id)?;
        check_id("tokenizer.ggml.padding_token_id", v.padding_id)?;

        // llama.cpp marks the end-of-generation look-alikes as control, whatever the file says.
        let mut stop_ids: Vec<u32> = [eos_id, eot_id, eom_id].into_iter().flatten().collect();
        for (id, text) in v.tokens.iter().enumerate() {
            if STOP_TOKEN_TEXTS.contains(&text.as_str()) {
                kinds[id] = TokenKind::Control;
                stop_ids.push(id as u32);
            }
        }
        // As llama.cpp: with o200k_harmony's `<|return|>` and `<|call|>`, `<|end|>` closes a
        // message (the analysis before the answer), not the reply, and is shown as text; its
        // `<|channel|>`, `<|message|>`, `<|start|>` and `<|constrain|>` are shown too.
        let id_of = |text: &str| v.tokens.iter().position(|t| t == text);
        if let (Some(_), Some(_), Some(end)) = (id_of("<|return|>"), id_of("<|call|>"), id_of("<|end|>")) {
            stop_ids.retain(|&id| id as usize != end);
            kinds[end] = TokenKind::UserDefined;
            for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
                if let Some(id) = id_of(text) {
                    kinds[id] = TokenKind::UserDefined;
                }
            }
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();

        let (engine, add_space_prefix, default_add_bos) = match v.model.as_str() {
            "gpt2" => {
                let merges = v
                    .merges
                    .as_ref()
                    .ok_or_else(|| tok_err(path, "gpt2 vocabulary without tokenizer.ggml.merges"))?;
                let pre = PreTokenizer::from_gguf_pre(path, v.pre.as_deref())?;
                let tok = byte_level_bpe(path, &v.tokens, merges, pre)?;
                (Engine::ByteBpe(Box::new(tok)), false, pre.default_add_bos())
            }
            "llama" => {
                let scores = v
                    .scores
                    .as_ref()
                    .ok_or_else(|| tok_err(path, "llama (SentencePiece) vocabulary without tokenizer.ggml.scores"))?;
                check_len("tokenizer.ggml.scores", scores.len())?;
                let spm = Spm::new(&v.tokens, scores.clone(), SpaceMarker::Escaped);
                (Engine::Spm(Box::new(spm)), v.add_space_prefix.unwrap_or(true), true)
            }
            other => {
                return Err(tok_err(
                    path,
                    format!("tokenizer.ggml.model `{other}` is not supported; supported: gpt2, llama"),
                ))
            }
        };
        let pieces = match &engine {
            Engine::ByteBpe(_) => gguf_pieces(&v.tokens, &kinds, PieceSpelling::ByteLevel),
            _ => gguf_pieces(&v.tokens, &kinds, PieceSpelling::SentencePiece),
        };
        let adds_bos = v.add_bos.unwrap_or(default_add_bos) && bos_id.is_some();
        Ok(Tokenizer {
            path: path.to_path_buf(),
            engine,
            specials: Specials::new(&v.tokens, &kinds),
            add_space_prefix,
            pieces,
            bos_id,
            adds_bos,
            stop_ids,
            chat_template: v.chat_template.clone(),
        })
    }

    /// llama2.c's binary tokenizer (`tok512.bin`): i32 max token length, then per token an f32
    /// score, an i32 byte length and the bytes. Token texts hold plain spaces; encoding prepends
    /// one space and merges by score like SentencePiece, with `<0xNN>` byte fallback.
    pub fn from_llama2c(path: &Path, bos_id: u32, eos_id: u32) -> Result<Tokenizer> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::from_llama2c_bytes(path, &bytes, bos_id, eos_id)
    }

    /// As [`Tokenizer::from_llama2c`], from the file's bytes (`path` names them in errors).
    pub fn from_llama2c_bytes(path: &Path, bytes: &[u8], bos_id: u32, eos_id: u32) -> Result<Tokenizer> {
        let (tokens, scores) = parse_llama2c(path, bytes)?;
        let n = tokens.len();
        for (name, id) in [("BOS", bos_id), ("EOS", eos_id)] {
            if id as usize >= n {
                return Err(tok_err(path, format!("{name} id {id} is outside the {n} tokens")));
            }
        }
        // The file has no token types: BOS, EOS and `<unk>` are control, `<0xNN>` are bytes.
        let kinds: Vec<TokenKind> = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| {
                if id as u32 == bos_id || id as u32 == eos_id || t == "<unk>" {
                    TokenKind::Control
                } else if parse_byte_token(t).is_some() {
                    TokenKind::Byte
                } else {
                    TokenKind::Normal
                }
            })
            .collect();
        let pieces = gguf_pieces(&tokens, &kinds, PieceSpelling::Plain);
        Ok(Tokenizer {
            path: path.to_path_buf(),
            engine: Engine::Spm(Box::new(Spm::new(&tokens, scores, SpaceMarker::Plain))),
            // llama2.c never splits special tokens out of the text.
            specials: Specials::default(),
            add_space_prefix: true,
            pieces,
            bos_id: Some(bos_id),
            adds_bos: true,
            stop_ids: vec![eos_id],
            chat_template: None,
        })
    }

    /// A Hugging Face model folder: `tokenizer.json`, plus special ids, `add_bos_token` and the
    /// chat template from `tokenizer_config.json` and `config.json` when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer> {
        Self::from_spec(dir, &TokenizerSpec::read_hf_dir(dir)?)
    }

    /// Build from a [`TokenizerSpec`] (what a `.gst` file stores); `path` names it in errors.
    pub fn from_spec(path: &Path, spec: &TokenizerSpec) -> Result<Tokenizer> {
        match spec {
            TokenizerSpec::Gguf { vocab } => Self::from_gguf(path, vocab),
            TokenizerSpec::Llama2c { bin, bos_id, eos_id } => Self::from_llama2c_bytes(path, bin, *bos_id, *eos_id),
            TokenizerSpec::HfFiles {
                tokenizer_json,
                tokenizer_config_json,
                config_json,
                chat_template_jinja,
            } => hf::load(
                path,
                tokenizer_json,
                tokenizer_config_json.as_deref(),
                config_json.as_deref(),
                chat_template_jinja.clone(),
            ),
        }
    }

    /// Text to ids. BOS is prepended only when `add_bos` is asked for and the model uses BOS
    /// (`adds_bos`). Special-token texts in `text` (e.g. `<|im_start|>`) become their single ids,
    /// as llama.cpp does with `parse_special = true`.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos && self.adds_bos {
            out.extend(self.bos_id);
        }
        if let Engine::Hf(tok) = &self.engine {
            let enc = tok
                .encode_fast(text, false)
                .map_err(|e| tok_err(&self.path, format!("encoding failed: {e}")))?;
            out.extend_from_slice(enc.get_ids());
            return Ok(out);
        }
        let mut prev_special = true;
        for frag in self.specials.partition(text) {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(run) => {
                    self.encode_run(run, prev_special, &mut out)?;
                    prev_special = false;
                }
            }
        }
        Ok(out)
    }

    fn encode_run(&self, run: &str, prev_special: bool, out: &mut Vec<u32>) -> Result<()> {
        match &self.engine {
            Engine::ByteBpe(tok) | Engine::Hf(tok) => {
                let enc = tok
                    .encode_fast(run, false)
                    .map_err(|e| tok_err(&self.path, format!("encoding failed: {e}")))?;
                out.extend_from_slice(enc.get_ids());
                Ok(())
            }
            Engine::Spm(spm) => {
                let prefixed;
                let run = if self.add_space_prefix && prev_special {
                    prefixed = format!(" {run}");
                    prefixed.as_str()
                } else {
                    run
                };
                spm.encode(run, out).map_err(|what| tok_err(&self.path, what))
            }
        }
    }

    /// Ids to text, leaving out control/unknown/unused tokens. Invalid UTF-8 (a lone byte token)
    /// becomes U+FFFD. The space SentencePiece put in front of the text is removed again.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.piece(id)?);
        }
        let mut text = String::from_utf8_lossy(&bytes).into_owned();
        if self.add_space_prefix && text.starts_with(' ') {
            text.remove(0);
        }
        Ok(text)
    }

    /// The bytes token `id` stands for (a SentencePiece word start keeps its leading space).
    pub fn piece(&self, id: u32) -> Result<&[u8]> {
        self.pieces.get(id as usize).map(|p| &p[..]).ok_or_else(|| {
            Error::Input(format!(
                "token id {id} is outside the vocabulary of {} tokens",
                self.pieces.len()
            ))
        })
    }

    /// Incremental decoding for generation; see [`StreamDecoder`].
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            tokenizer: self,
            pending: Vec::new(),
        }
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Whether `encode(text, true)` puts BOS first (the model's `add_bos` flag).
    pub fn adds_bos(&self) -> bool {
        self.adds_bos
    }

    /// EOS, EOT, EOM, and the end-of-turn tokens llama.cpp stops on (`<|im_end|>`,
    /// `<end_of_turn>`, `<|endoftext|>`, ...) when the vocabulary has them.
    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.binary_search(&id).is_ok()
    }

    /// The ids [`Tokenizer::is_stop`] is true of, ascending.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Whether the model's chat template is gpt-oss's Harmony format, whose replies carry their
    /// reasoning and their answer in channels ([`super::chat::HarmonySplit`]).
    pub fn chat_is_harmony(&self) -> bool {
        self.chat_template.as_deref().and_then(super::chat::ChatFamily::detect)
            == Some(super::chat::ChatFamily::Harmony)
    }

    /// A single-turn user prompt rendered with the model's chat template, the assistant turn
    /// opened, ready for `encode(.., true)` (BOS is not written into the text).
    pub fn apply_chat_template(&self, user_prompt: &str) -> Result<String> {
        self.apply_chat_template_to(&[(super::chat::Role::User, user_prompt)])
    }

    /// A conversation rendered with the model's chat template, the assistant turn opened (see
    /// [`super::chat::ChatFamily::render`]).
    pub fn apply_chat_template_to(&self, messages: &[(super::chat::Role, &str)]) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            tok_err(
                &self.path,
                "the model has no chat template; pass the prompt as plain text",
            )
        })?;
        super::chat::render(template, messages).map_err(|what| tok_err(&self.path, what))
    }
}

/// Turns generated ids into text as soon as the bytes form complete UTF-8, so a character split
/// over several byte tokens (`<0xE6><0x97><0xA5>`) comes out once, whole.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    /// Bytes of an unfinished UTF-8 sequence (at most 3).
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    /// Adds one id; returns the text it completes, if any. An id outside the vocabulary, or bytes
    /// that can never become UTF-8, yield U+FFFD rather than an error: generation goes on.
    pub fn push(&mut self, id: u32) -> Option<String> {
        match self.tokenizer.piece(id) {
            Ok(piece) => self.pending.extend_from_slice(piece),
            Err(_) => self.pending.extend_from_slice("\u{FFFD}".as_bytes()),
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The first `valid_up_to` bytes were just checked to be UTF-8.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete sequence at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
        (!out.is_empty()).then_some(out)
    }

    /// Whatever is still pending at the end of generation (an unfinished sequence as U+FFFD).
    pub fn flush(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        Some(out)
    }
}
