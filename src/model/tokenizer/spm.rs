//! SentencePiece BPE as llama.cpp's `llm_tokenizer_spm_session` runs it, for GGUF "llama"
//! vocabularies (SentencePiece, Gemma) and llama2.c: repeatedly merge the adjacent pair whose merged
//! text is a token with the highest score (ties: leftmost), then byte fallback `<0xNN>` for what is
//! left. Also owns the `<0xNN>` byte-token spelling and the reader for llama2.c's `tok512.bin`.
//! It sees only plain text runs: special tokens and the space prefix are handled by the caller.

use std::collections::{BinaryHeap, HashMap};
use std::path::Path;

use crate::error::{Error, Result};

/// How a vocabulary spells a space.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum SpaceMarker {
    /// SentencePiece's "▁" (U+2581): spaces in the input are replaced before merging.
    Escaped,
    /// llama2.c: token texts hold plain spaces.
    Plain,
}

pub(super) struct Spm {
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
    pub(super) fn new(tokens: &[String], scores: Vec<f32>, spaces: SpaceMarker) -> Spm {
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

    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
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
pub(super) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

pub(super) fn parse_llama2c(path: &Path, bytes: &[u8]) -> Result<(Vec<String>, Vec<f32>)> {
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
