//! Special and added tokens cut out of the text before any engine runs, as llama.cpp's
//! `tokenizer_st_partition` does: for each token matched whole (control, user-defined, unknown),
//! longest text first, every non-overlapping occurrence in the remaining text runs becomes its id.
//! Owns the byte trie that finds which of those tokens occur in an input; it does not encode the
//! plain text between them (that is the engine's job) and knows nothing of vocabulary files.

use super::TokenKind;

/// A piece of the input after special tokens are cut out.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// Tokens matched whole in the text, and a byte trie to find which occur in a given input.
#[derive(Default)]
pub(super) struct Specials {
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
    pub(super) fn new(texts: &[String], kinds: &[TokenKind]) -> Specials {
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
    pub(super) fn partition<'t>(&self, text: &'t str) -> Vec<Fragment<'t>> {
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
