//! The bytes each token id decodes to, computed once at load time as llama.cpp's
//! `token_to_piece` (special = false) gives them: hidden tokens are empty, byte tokens are their
//! byte, and normal tokens are un-spelled from GPT-2's byte alphabet or SentencePiece's "▁".
//! Owns only that table's construction; joining pieces into text is [`super::Tokenizer`]'s.

use std::collections::HashMap;

use super::spm::parse_byte_token;
use super::TokenKind;

/// How a vocabulary writes the bytes of its normal tokens.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum PieceSpelling {
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
pub(super) fn gguf_pieces(tokens: &[String], kinds: &[TokenKind], spelling: PieceSpelling) -> Vec<Box<[u8]>> {
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
