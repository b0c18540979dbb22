//! Traces of which FFN neurons each token used, per layer: recorded by `run --record-trace` (or
//! by `bench` over a text), replayed by `bench` against a `.gst` file without computing.
//!
//! File layout (little-endian): `GSTTRACE` magic, u32 version (1), u32 header length, the header
//! as JSON ([`TraceHeader`]), then `tokens × n_layers` records in token-major order, each two
//! bitsets of `ffn` bits (`ceil(ffn / 8)` bytes, bit `n % 8` of byte `n / 8` = neuron n): the
//! neurons whose up rows were needed, then those whose down columns were (the kept ones).
//! Reading checks the magic, version, header and the exact length before trusting anything.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::model::forward::FfnMask;
use crate::model::generate::PromptAwareMask;

const MAGIC: &[u8; 8] = b"GSTTRACE";
const VERSION: u32 = 1;
const HEADER_MAX_BYTES: u32 = 1 << 20;

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TraceHeader {
    /// The model file the trace was recorded on (name only; replay checks the shape).
    pub model: String,
    pub n_layers: usize,
    pub ffn: usize,
    pub tokens: usize,
    /// `dense`, or the mask as `strategy criterion level` (for people; replay ignores it).
    pub mask: String,
    /// Mean share of neurons whose down columns were needed.
    pub kept_fraction: f64,
}

/// One token's use of one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerUse {
    pub up: Vec<u32>,
    pub down: Vec<u32>,
}

#[derive(Clone, Debug)]
pub struct Trace {
    pub header: TraceHeader,
    /// `records[token][layer]`.
    pub records: Vec<Vec<LayerUse>>,
}

fn bits_of(set: &[u32], ffn: usize) -> Vec<u8> {
    let mut b = vec![0u8; ffn.div_ceil(8)];
    for &n in set {
        b[n as usize / 8] |= 1 << (n % 8);
    }
    b
}

fn set_of(bits: &[u8], ffn: usize) -> Vec<u32> {
    (0..ffn as u32)
        .filter(|&n| bits[n as usize / 8] >> (n % 8) & 1 == 1)
        .collect()
}

impl Trace {
    pub fn write(&self, path: &Path) -> Result<()> {
        let h = &self.header;
        let json = serde_json::to_vec(h).map_err(|e| Error::Invalid(format!("trace header: {e}")))?;
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(json.len() as u32).to_le_bytes());
        out.extend_from_slice(&json);
        for t in &self.records {
            for u in t {
                out.extend_from_slice(&bits_of(&u.up, h.ffn));
                out.extend_from_slice(&bits_of(&u.down, h.ffn));
            }
        }
        // A trace exists only when complete.
        crate::io::write_replacing(path, &out)
    }

    pub fn read(path: &Path) -> Result<Trace> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let bad = |offset: usize, what: String| Error::Malformed {
            path: path.to_path_buf(),
            format: "gatestream trace",
            offset_bytes: offset as u64,
            what,
        };
        if bytes.len() < 16 || &bytes[..8] != MAGIC {
            return Err(bad(
                0,
                "not a trace file (no GSTTRACE magic); record one with `run --record-trace`".into(),
            ));
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        if u32_at(8) != VERSION {
            return Err(bad(
                8,
                format!("trace version {} (this build reads {VERSION})", u32_at(8)),
            ));
        }
        let hlen = u32_at(12);
        if hlen > HEADER_MAX_BYTES || 16 + hlen as usize > bytes.len() {
            return Err(bad(12, format!("header length {hlen} does not fit the file")));
        }
        let header: TraceHeader =
            serde_json::from_slice(&bytes[16..16 + hlen as usize]).map_err(|e| bad(16, format!("header JSON: {e}")))?;
        let row = header.ffn.div_ceil(8);
        let want = header
            .tokens
            .checked_mul(header.n_layers)
            .and_then(|r| r.checked_mul(2 * row))
            .and_then(|b| b.checked_add(16 + hlen as usize));
        if header.ffn == 0 || header.n_layers == 0 || want != Some(bytes.len()) {
            return Err(bad(
                16,
                format!(
                    "{} tokens x {} layers x 2 bitsets of {} neurons do not match the file's {} bytes (truncated?)",
                    header.tokens,
                    header.n_layers,
                    header.ffn,
                    bytes.len()
                ),
            ));
        }
        let mut at = 16 + hlen as usize;
        let mut records = Vec::with_capacity(header.tokens);
        for _ in 0..header.tokens {
            let mut layers = Vec::with_capacity(header.n_layers);
            for _ in 0..header.n_layers {
                let up = set_of(&bytes[at..at + row], header.ffn);
                let down = set_of(&bytes[at + row..at + 2 * row], header.ffn);
                at += 2 * row;
                layers.push(LayerUse { up, down });
            }
            records.push(layers);
        }
        Ok(Trace { header, records })
    }
}

/// Records which neurons a mask (or, with no mask, the dense model) uses, as an [`FfnMask`] that
/// wraps the real one; pass it wherever the mask would go.
pub struct TraceRecorder<'a> {
    inner: Option<&'a dyn PromptAwareMask>,
    ffn: usize,
    hidden: usize,
    n_layers: usize,
    /// Per layer: tokens recorded so far (a batch advances it by its size).
    next_token: Mutex<Vec<usize>>,
    uses: Mutex<BTreeMap<(usize, usize), LayerUse>>,
}

/// The trace of `ids` (one pass per batch `passes` allows, from an empty cache) under `mask`:
/// which neurons each token's FFN needed, per layer. `text_name` and the mask's description go
/// into the trace's header.
pub fn record(
    model: &crate::model::Model,
    passes: crate::model::forward::Passes,
    ids: &[u32],
    mask: &crate::sparsity::Masker,
    text_name: &str,
) -> Result<Trace> {
    if ids.is_empty() {
        return Err(Error::Invalid("a trace needs at least one token".into()));
    }
    let c = &model.config;
    let rec = TraceRecorder::new(Some(mask), c.n_layers, c.hidden, c.ffn);
    let mut cache = crate::kv::KvCache::new(c, ids.len());
    model.forward_in_batches(
        ids,
        &mut cache,
        ids.len() - 1,
        &passes.hooks(Some(&rec), None),
        passes.batch_max(),
    )?;
    let what = format!("{} {} {}", mask.strategy.name(), mask.criterion.name(), mask.sparsity);
    Ok(rec.trace(text_name, &what))
}

impl<'a> TraceRecorder<'a> {
    pub fn new(inner: Option<&'a dyn PromptAwareMask>, n_layers: usize, hidden: usize, ffn: usize) -> Self {
        TraceRecorder {
            inner,
            ffn,
            hidden,
            n_layers,
            next_token: Mutex::new(vec![0; n_layers]),
            uses: Mutex::new(BTreeMap::new()),
        }
    }

    /// The trace of every token whose layers were all recorded.
    pub fn trace(&self, model: &str, mask: &str) -> Trace {
        let uses = self.uses.lock().expect("trace lock");
        let tokens = self
            .next_token
            .lock()
            .expect("trace lock")
            .iter()
            .copied()
            .min()
            .unwrap_or(0);
        let records: Vec<Vec<LayerUse>> = (0..tokens)
            .map(|t| (0..self.n_layers).map(|l| uses[&(t, l)].clone()).collect())
            .collect();
        let kept: usize = records.iter().flatten().map(|u| u.down.len()).sum();
        let slots = (tokens * self.n_layers * self.ffn).max(1);
        Trace {
            header: TraceHeader {
                model: model.into(),
                n_layers: self.n_layers,
                ffn: self.ffn,
                tokens,
                mask: mask.into(),
                kept_fraction: kept as f64 / slots as f64,
            },
            records,
        }
    }
}

impl FfnMask for TraceRecorder<'_> {
    fn apply(&self, layer: usize, xn: &[f32], gate: &[f32], up: &[f32], hact: &mut [f32]) {
        let (f, h) = (self.ffn, self.hidden);
        let n = hact.len() / f;
        let mut need = vec![true; f];
        if let Some(m) = self.inner {
            m.as_mask().apply(layer, xn, gate, up, hact);
        }
        let first = {
            let mut next = self.next_token.lock().expect("trace lock");
            let first = next[layer];
            next[layer] += n;
            first
        };
        let mut uses = self.uses.lock().expect("trace lock");
        for t in 0..n {
            let row = &hact[t * f..(t + 1) * f];
            let down: Vec<u32> = match self.inner {
                None => (0..f as u32).collect(),
                Some(_) => (0..f as u32).filter(|&i| row[i as usize] != 0.0).collect(),
            };
            let up = match self.inner {
                Some(m) if !m.as_mask().decides_before_up() => {
                    m.as_mask()
                        .up_needed(layer, &xn[t * h..(t + 1) * h], &gate[t * f..(t + 1) * f], &mut need);
                    (0..f as u32).filter(|&i| need[i as usize]).collect()
                }
                _ => down.clone(),
            };
            uses.insert((first + t, layer), LayerUse { up, down });
        }
    }

    fn up_needed(&self, layer: usize, xn: &[f32], gate: &[f32], need: &mut [bool]) {
        match self.inner {
            Some(m) => m.as_mask().up_needed(layer, xn, gate, need),
            None => need.fill(true),
        }
    }

    fn up_needed_reads_input(&self) -> bool {
        self.inner.is_some_and(|m| m.as_mask().up_needed_reads_input())
    }

    fn decides_before_up(&self) -> bool {
        self.inner.is_none_or(|m| m.as_mask().decides_before_up())
    }
}

impl PromptAwareMask for TraceRecorder<'_> {
    fn prompt_tokens(&self, n: usize) {
        if let Some(m) = self.inner {
            m.prompt_tokens(n);
        }
    }
    fn as_mask(&self) -> &dyn FfnMask {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_round_trips_and_damage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.trace");
        let t = Trace {
            header: TraceHeader {
                model: "m".into(),
                n_layers: 2,
                ffn: 13,
                tokens: 2,
                mask: "topk gate 0.5".into(),
                kept_fraction: 0.5,
            },
            records: vec![
                vec![
                    LayerUse {
                        up: vec![0, 3, 12],
                        down: vec![3],
                    },
                    LayerUse {
                        up: vec![],
                        down: vec![],
                    },
                ],
                vec![
                    LayerUse {
                        up: (0..13).collect(),
                        down: vec![1, 2, 8],
                    },
                    LayerUse {
                        up: vec![7],
                        down: vec![7],
                    },
                ],
            ],
        };
        t.write(&p).unwrap();
        let back = Trace::read(&p).unwrap();
        assert_eq!(back.header, t.header);
        assert_eq!(back.records, t.records);
        let bytes = std::fs::read(&p).unwrap();
        for (cut, what) in [(bytes.len() - 1, "truncated"), (10, "does not fit"), (4, "magic")] {
            std::fs::write(&p, &bytes[..cut]).unwrap();
            let e = Trace::read(&p).unwrap_err().to_string();
            assert!(e.contains("trace"), "{e}");
            let _ = what;
        }
        let mut wrong = bytes.clone();
        wrong[8] = 9;
        std::fs::write(&p, &wrong).unwrap();
        assert!(Trace::read(&p).unwrap_err().to_string().contains("version 9"));
    }
}
