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

use std::collections::{BinaryHeap, HashMap};
use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use crate::error::{Error, Result};

/// What a GGUF file's `tokenizer.*` metadata holds (filled by the GGUF reader).
#[derive(Clone, Debug, Default)]
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
        let (tokens, scores) = parse_llama2c(path, &bytes)?;
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
        hf::load(dir)
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

    fn piece(&self, id: u32) -> Result<&[u8]> {
        self.pieces.get(id as usize).map(|p| &p[..]).ok_or_else(|| {
            Error::Invalid(format!(
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

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// A single-turn user prompt rendered with the model's chat template, the assistant turn
    /// opened, ready for `encode(.., true)` (BOS is not written into the text).
    pub fn apply_chat_template(&self, user_prompt: &str) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            tok_err(
                &self.path,
                "the model has no chat template; pass the prompt as plain text",
            )
        })?;
        super::chat::render_user_turn(template, user_prompt).map_err(|what| tok_err(&self.path, what))
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

// ---------------------------------------------------------------------------------------------
// Special tokens: llama.cpp's `tokenizer_st_partition`.

/// A piece of the input after special tokens are cut out.
#[derive(Debug, PartialEq, Eq)]
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// Tokens matched whole in the text, and a byte trie to find which occur in a given input.
#[derive(Default)]
struct Specials {
    /// (text, id), in llama.cpp's order: longest text first (ties by id).
    tokens: Vec<(String, u32)>,
    /// Trie over the token texts; `nodes[0]` is the root.
    nodes: Vec<TrieNode>,
}

#[derive(Default)]
struct TrieNode {
    /// (byte, child node), sorted by byte.
    children: Vec<(u8, u32)>,
    /// Index into `Specials::tokens` of the token ending here.
    token: Option<u32>,
}

impl Specials {
    fn new(texts: &[String], kinds: &[TokenKind]) -> Specials {
        let mut tokens: Vec<(String, u32)> = texts
            .iter()
            .zip(kinds)
            .enumerate()
            .filter(|(_, (t, k))| k.is_matched_whole() && !t.is_empty())
            .map(|(id, (t, _))| (t.clone(), id as u32))
            .collect();
        tokens.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut nodes = vec![TrieNode::default()];
        for (index, (text, _)) in tokens.iter().enumerate() {
            let mut node = 0usize;
            for &b in text.as_bytes() {
                node = match nodes[node].children.binary_search_by_key(&b, |c| c.0) {
                    Ok(i) => nodes[node].children[i].1 as usize,
                    Err(i) => {
                        let child = nodes.len();
                        nodes.push(TrieNode::default());
                        nodes[node].children.insert(i, (b, child as u32));
                        child
                    }
                };
            }
            // Two tokens with the same text: the first in order (lower id) wins, as the
            // partition would match it first.
            nodes[node].token.get_or_insert(index as u32);
        }
        Specials { tokens, nodes }
    }

    /// Indices into `tokens` of the special tokens that occur somewhere in `text`, sorted.
    fn occurring(&self, text: &str) -> Vec<u32> {
        let mut found = Vec::new();
        if self.tokens.is_empty() {
            return found;
        }
        let bytes = text.as_bytes();
        for start in 0..bytes.len() {
            let mut node = 0usize;
            for &b in &bytes[start..] {
                let children = &self.nodes[node].children;
                match children.binary_search_by_key(&b, |c| c.0) {
                    Ok(i) => node = children[i].1 as usize,
                    Err(_) => break,
                }
                if let Some(t) = self.nodes[node].token {
                    found.push(t);
                }
            }
        }
        found.sort_unstable();
        found.dedup();
        found
    }

    /// Splits `text` the way llama.cpp does: for each special token, longest first, every
    /// non-overlapping occurrence (left to right) inside the remaining text runs becomes a token.
    fn partition<'t>(&self, text: &'t str) -> Vec<Fragment<'t>> {
        let mut frags = vec![Fragment::Text(text)];
        if text.is_empty() {
            return Vec::new();
        }
        for index in self.occurring(text) {
            let (special, id) = &self.tokens[index as usize];
            let mut next = Vec::with_capacity(frags.len() + 2);
            for frag in frags {
                let Fragment::Text(mut rest) = frag else {
                    next.push(frag);
                    continue;
                };
                while let Some(at) = rest.find(special.as_str()) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(*id));
                    rest = &rest[at + special.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            frags = next;
        }
        frags
    }
}

// ---------------------------------------------------------------------------------------------
// SentencePiece BPE: llama.cpp's `llm_tokenizer_spm_session`.

/// How a vocabulary spells a space.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SpaceMarker {
    /// SentencePiece's "▁" (U+2581): spaces in the input are replaced before merging.
    Escaped,
    /// llama2.c: token texts hold plain spaces.
    Plain,
}

struct Spm {
    /// Token text to id; for duplicate texts the last id wins, as in llama.cpp's map.
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// The `<0xNN>` token for each byte value.
    byte_ids: [Option<u32>; 256],
    spaces: SpaceMarker,
}

/// A candidate merge of two adjacent symbols; the heap pops the highest score, then leftmost.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len_bytes: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score.total_cmp(&other.score).then(other.left.cmp(&self.left))
    }
}

/// A run of the text in the symbol list; `len_bytes == 0` once merged into its left neighbour.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len_bytes: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    fn new(tokens: &[String], scores: Vec<f32>, spaces: SpaceMarker) -> Spm {
        let mut ids = HashMap::with_capacity(tokens.len());
        let mut byte_ids = [None; 256];
        for (id, t) in tokens.iter().enumerate() {
            ids.insert(t.clone(), id as u32);
            if let Some(b) = parse_byte_token(t) {
                byte_ids[b as usize].get_or_insert(id as u32);
            }
        }
        Spm {
            ids,
            scores,
            byte_ids,
            spaces,
        }
    }

    fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        let escaped;
        let text = match self.spaces {
            SpaceMarker::Escaped => {
                escaped = text.replace(' ', "\u{2581}");
                escaped.as_str()
            }
            SpaceMarker::Plain => text,
        };
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, c) in text.char_indices() {
            let index = symbols.len();
            symbols.push(Symbol {
                start,
                len_bytes: c.len_utf8(),
                prev: index.checked_sub(1),
                next: None,
            });
            if let Some(prev) = index.checked_sub(1) {
                symbols[prev].next = Some(index);
            }
        }
        let mut queue = BinaryHeap::with_capacity(symbols.len());
        for right in 1..symbols.len() {
            self.try_add_bigram(text, &symbols, right - 1, right, &mut queue);
        }
        while let Some(bigram) = queue.pop() {
            let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
            // Stale: one side was merged away or grew since this pair was queued.
            if l.len_bytes == 0 || r.len_bytes == 0 || l.len_bytes + r.len_bytes != bigram.len_bytes {
                continue;
            }
            symbols[bigram.left].len_bytes += r.len_bytes;
            symbols[bigram.right].len_bytes = 0;
            symbols[bigram.left].next = r.next;
            if let Some(next) = r.next {
                symbols[next].prev = Some(bigram.left);
            }
            if let Some(prev) = l.prev {
                self.try_add_bigram(text, &symbols, prev, bigram.left, &mut queue);
            }
            if let Some(next) = r.next {
                self.try_add_bigram(text, &symbols, bigram.left, next, &mut queue);
            }
        }
        let mut at = if symbols.is_empty() { None } else { Some(0) };
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len_bytes];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                // Every merge made a token, so only a single character can be missing here.
                None => {
                    for &b in piece.as_bytes() {
                        let id = self.byte_ids[b as usize]
                            .ok_or_else(|| format!("no token for {piece:?} and no byte token <0x{b:02X}>"))?;
                        out.push(id);
                    }
                }
            }
            at = s.next;
        }
        Ok(())
    }

    fn try_add_bigram(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        let (l, r) = (symbols[left], symbols[right]);
        let len_bytes = l.len_bytes + r.len_bytes;
        if let Some(&id) = self.ids.get(&text[l.start..l.start + len_bytes]) {
            let score = self.scores.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY);
            queue.push(Bigram {
                score,
                left,
                right,
                len_bytes,
            });
        }
    }
}

/// `<0xNN>` to the byte NN.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

fn parse_llama2c(path: &Path, bytes: &[u8]) -> Result<(Vec<String>, Vec<f32>)> {
    /// llama2.c vocabularies are small; this bounds what a corrupt count can make us allocate.
    const TOKEN_LEN_MAX_BYTES: usize = 1 << 16;
    let malformed = |offset: usize, what: String| Error::Malformed {
        path: path.to_path_buf(),
        format: "llama2.c tokenizer",
        offset_bytes: offset as u64,
        what,
    };
    let word = |offset: usize| -> Result<[u8; 4]> {
        bytes
            .get(offset..offset + 4)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| malformed(offset, "file ends inside a 4-byte field".into()))
    };
    let _max_token_len = i32::from_le_bytes(word(0)?);
    let mut offset = 4;
    let (mut tokens, mut scores) = (Vec::new(), Vec::new());
    while offset < bytes.len() {
        let score = f32::from_le_bytes(word(offset)?);
        let len = i32::from_le_bytes(word(offset + 4)?);
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= TOKEN_LEN_MAX_BYTES)
            .ok_or_else(|| malformed(offset + 4, format!("token length {len} is out of range")))?;
        let start = offset + 8;
        let text = bytes
            .get(start..start + len)
            .ok_or_else(|| malformed(start, format!("file ends inside a {len}-byte token")))?;
        let text = String::from_utf8(text.to_vec()).map_err(|_| malformed(start, "token text is not UTF-8".into()))?;
        tokens.push(text);
        scores.push(score);
        offset = start + len;
    }
    if tokens.is_empty() {
        return Err(malformed(4, "no tokens".into()));
    }
    Ok((tokens, scores))
}

// ---------------------------------------------------------------------------------------------
// Byte-level BPE (GGUF "gpt2").

/// llama.cpp's pre-tokenizer choice for a `tokenizer.ggml.pre` value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PreTokenizer {
    /// `LLAMA_VOCAB_PRE_TYPE_DEFAULT` (also used when `pre` is missing).
    Default,
    Gpt2,
    /// GPT-2's regex after splitting every digit apart (smollm, starcoder, ...).
    Gpt2Digits,
    Qwen2,
    Llama3,
}

const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl PreTokenizer {
    fn from_gguf_pre(path: &Path, pre: Option<&str>) -> Result<PreTokenizer> {
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
            Some(other) => {
                return Err(tok_err(
                    path,
                    format!(
                        "tokenizer.ggml.pre `{other}` is not supported; supported: default, gpt-2, \
                         smollm, starcoder, qwen2, llama-bpe and their aliases"
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
        }
    }

    fn default_add_bos(self) -> bool {
        self == PreTokenizer::Llama3
    }
}

fn byte_level_bpe(
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

/// How a vocabulary writes the bytes of its normal tokens.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PieceSpelling {
    /// GPT-2's byte-to-unicode alphabet ("Ġ" is a space).
    ByteLevel,
    /// SentencePiece: "▁" is a space.
    SentencePiece,
    /// The text is the bytes (llama2.c).
    Plain,
}

/// GPT-2's printable stand-in for each byte, inverted: char to byte.
fn byte_level_decoder() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\u{FFFD}')
        };
        map.insert(c, b);
    }
    map
}

/// The bytes each token decodes to, as llama.cpp's `token_to_piece` (special = false) gives.
fn gguf_pieces(tokens: &[String], kinds: &[TokenKind], spelling: PieceSpelling) -> Vec<Box<[u8]>> {
    let byte_level = (spelling == PieceSpelling::ByteLevel).then(byte_level_decoder);
    tokens
        .iter()
        .zip(kinds)
        .map(|(text, kind)| -> Box<[u8]> {
            match kind {
                k if k.is_hidden() => Box::default(),
                TokenKind::UserDefined => text.as_bytes().into(),
                TokenKind::Byte => match parse_byte_token(text) {
                    Some(b) => Box::new([b]),
                    None => text.as_bytes().into(),
                },
                _ => match (spelling, &byte_level) {
                    (PieceSpelling::ByteLevel, Some(map)) => {
                        let mut out = Vec::with_capacity(text.len());
                        for c in text.chars() {
                            match map.get(&c) {
                                Some(&b) => out.push(b),
                                // Not in the byte alphabet: keep the character itself.
                                None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                            }
                        }
                        out.into()
                    }
                    (PieceSpelling::SentencePiece, _) => text.replace('\u{2581}', " ").into_bytes().into(),
                    _ => text.as_bytes().into(),
                },
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Hugging Face folders.

mod hf {
    use std::path::Path;

    use serde_json::Value;

    use super::STOP_TOKEN_TEXTS;
    use super::{gguf_pieces, tok_err, Engine, PieceSpelling, Specials, TokenKind, Tokenizer};
    use crate::error::{Error, Result};

    fn read_json(path: &Path) -> Result<Option<Value>> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| tok_err(path, format!("not valid JSON: {e}"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(path, e)),
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

    pub(super) fn load(dir: &Path) -> Result<Tokenizer> {
        let json_path = dir.join("tokenizer.json");
        if !json_path.is_file() {
            return Err(tok_err(dir, "no tokenizer.json in this folder"));
        }
        let tok = tokenizers::Tokenizer::from_file(&json_path)
            .map_err(|e| tok_err(&json_path, format!("cannot load: {e}")))?;
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let model_config = read_json(&dir.join("config.json"))?.unwrap_or(Value::Null);

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
        let strips_space =
            decoder.contains("Strip") || (decoder.contains("Metaspace") && !decoder.contains("\"never\""));

        let added = tok.get_added_tokens_decoder();
        let mut texts = Vec::with_capacity(vocab_size);
        let mut kinds = Vec::with_capacity(vocab_size);
        for id in 0..vocab_size as u32 {
            let text = tok.id_to_token(id).unwrap_or_default();
            let kind = match added.get(&id) {
                Some(t) if t.special => TokenKind::Control,
                Some(_) => TokenKind::UserDefined,
                None if text.is_empty() => TokenKind::Unused,
                None if spelling == PieceSpelling::SentencePiece && super::parse_byte_token(&text).is_some() => {
                    TokenKind::Byte
                }
                None => TokenKind::Normal,
            };
            texts.push(text);
            kinds.push(kind);
        }
        let template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(t) => Some(t),
            Err(_) => chat_template(config.get("chat_template")),
        };
        Ok(Tokenizer {
            path: json_path,
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
}

#[cfg(test)]
mod tests {
    //! Golden ids come from llama.cpp's own `llama-tokenize` (same GGUF files, `--no-bos` unless
    //! stated, special tokens parsed), built from the llama-cpp-python 0.3.36 source package.
    use super::*;
    use std::io::Read;

    fn models_dir() -> PathBuf {
        match std::env::var_os("GATESTREAM_MODELS") {
            Some(dir) => PathBuf::from(dir),
            None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/gatestream/models"),
        }
    }

    fn data_dir() -> PathBuf {
        let beside = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data");
        if beside.is_dir() {
            beside
        } else {
            PathBuf::from("/work/shared/data")
        }
    }

    /// The model file, or a failure that says how to fetch it.
    fn model_path(fetch_name: &str, file: &str) -> PathBuf {
        let path = models_dir().join(file);
        assert!(
            path.is_file(),
            "{} is missing: run `../shared/models/fetch.sh {fetch_name}` (or set GATESTREAM_MODELS)",
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
                    23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 15107,
                    114, 240, 10813, 232, 227, 15486, 46494, 37366,
                ],
                &[256, 2899, 5600],
                &[1, 4093, 198, 26843, 2],
                &[
                    1589, 506, 216, 33, 34, 35, 36, 37, 38, 39, 8358, 28, 3247, 982, 357, 47, 216, 35, 30, 33, 36, 33,
                    37, 41, 17,
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
                    2132, 594, 220, 16, 17, 18, 19, 20, 21, 22, 11192, 11, 4436, 944, 432, 30, 220, 18, 13, 16, 19, 16,
                    20, 24, 0,
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
                    236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 10979, 236820, 236909, 548, 236779, 643,
                    111038,
                ],
                &[
                    1509, 236789, 236751, 236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 11092,
                    236764, 5889, 236789, 236745, 625, 236881, 236743, 236800, 236761, 236770, 236812, 236770, 236810,
                    236819, 236888,
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
                1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
                8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198
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
}
