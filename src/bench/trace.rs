//! Traces of which FFN neurons each token used, per layer: recorded by `run --record-trace` (or
//! by `bench` over a text), replayed by `bench` against a `.gst` file without computing.
//!
//! File layout (little-endian): `GSTTRACE` magic, u32 version (1), u32 header length, the header
//! as JSON ([`TraceHeader`]), then `tokens × n_layers` records in token-major order, each two
//! bitsets of `ffn` bits (`ceil(ffn / 8)` bytes, bit `n % 8` of byte `n / 8` = neuron n): the
//! neurons whose up rows were needed, then those whose down columns were (the kept ones).
//! Reading checks the magic, version, header and the exact length before trusting anything.
//!
//! Mixture-of-experts models record routing traces instead ([`RouteTrace`]): the same magic,
//! version 2, the header as JSON ([`RouteHeader`]), then `tokens × n_layers × n_used` expert
//! indices as u16, token-major, each token's experts in the router's order (most likely first).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::model::forward::FfnMask;
use crate::model::generate::PromptAwareMask;

const MAGIC: &[u8; 8] = b"GSTTRACE";
const VERSION: u32 = 1;
/// Routing traces (mixture-of-experts models).
const ROUTE_VERSION: u32 = 2;
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
        let mut out = file_start(VERSION, h)?;
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
        match AnyTrace::read(path)? {
            AnyTrace::Neurons(t) => Ok(t),
            AnyTrace::Routes(_) => Err(malformed(
                path,
                "gatestream trace",
                8,
                "a routing trace of a mixture-of-experts model, not a trace of neurons; bench replays it against that model's .gst"
                    .into(),
            )),
        }
    }

    fn parse(path: &Path, bytes: &[u8], hlen: u32) -> Result<Trace> {
        let bad = |offset: usize, what: String| malformed(path, "gatestream trace", offset, what);
        let header: TraceHeader = parse_header(path, bytes, hlen)?;
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

/// A trace file's first bytes: magic, `version`, the header's length and the header as JSON.
fn file_start(version: u32, header: &impl serde::Serialize) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(header).map_err(|e| Error::Internal(format!("trace header: {e}")))?;
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// The header of a trace file whose first 16 bytes [`AnyTrace::read`] checked.
fn parse_header<H: serde::de::DeserializeOwned>(path: &Path, bytes: &[u8], hlen: u32) -> Result<H> {
    serde_json::from_slice(&bytes[16..16 + hlen as usize])
        .map_err(|e| malformed(path, "gatestream trace", 16, format!("header JSON: {e}")))
}

fn malformed(path: &Path, format: &'static str, offset: usize, what: String) -> Error {
    Error::Malformed {
        path: path.to_path_buf(),
        format,
        offset_bytes: offset as u64,
        what,
    }
}

/// Tokens every layer has recorded (a recorder's per-layer counts' minimum).
fn complete_tokens(next_token: &Mutex<Vec<usize>>) -> usize {
    next_token
        .lock()
        .expect("trace lock")
        .iter()
        .copied()
        .min()
        .unwrap_or(0)
}

/// A trace of either kind, as `run --record-trace` writes it and `bench --trace` reads it.
#[derive(Clone, Debug)]
pub enum AnyTrace {
    Neurons(Trace),
    Routes(RouteTrace),
}

impl AnyTrace {
    pub fn write(&self, path: &Path) -> Result<()> {
        match self {
            AnyTrace::Neurons(t) => t.write(path),
            AnyTrace::Routes(t) => t.write(path),
        }
    }

    /// Either kind, by the version after the magic; the whole file checked.
    pub fn read(path: &Path) -> Result<AnyTrace> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let bad = |offset: usize, what: String| malformed(path, "gatestream trace", offset, what);
        if bytes.len() < 16 || &bytes[..8] != MAGIC {
            return Err(bad(
                0,
                "not a trace file (no GSTTRACE magic); record one with `run --record-trace`".into(),
            ));
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let version = u32_at(8);
        if version != VERSION && version != ROUTE_VERSION {
            return Err(bad(
                8,
                format!("trace version {version} (this build reads {VERSION} and {ROUTE_VERSION})"),
            ));
        }
        let hlen = u32_at(12);
        if hlen > HEADER_MAX_BYTES || 16 + hlen as usize > bytes.len() {
            return Err(bad(12, format!("header length {hlen} does not fit the file")));
        }
        if version == VERSION {
            Ok(AnyTrace::Neurons(Trace::parse(path, &bytes, hlen)?))
        } else {
            Ok(AnyTrace::Routes(RouteTrace::parse(path, &bytes, hlen)?))
        }
    }

    /// One line for people: what was recorded, how much.
    pub fn summary(&self) -> String {
        match self {
            AnyTrace::Neurons(t) => format!(
                "{} tokens x {} layers ({:.1}% of neurons kept)",
                t.header.tokens,
                t.header.n_layers,
                t.header.kept_fraction * 100.0
            ),
            AnyTrace::Routes(t) => format!(
                "{} tokens x {} layers, {} of {} experts per token and layer, {} distinct experts routed to",
                t.header.tokens,
                t.header.n_layers,
                t.header.n_used,
                t.header.n_experts,
                t.distinct_experts()
            ),
        }
    }
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RouteHeader {
    /// The model file the trace was recorded on (name only; replay checks the shape).
    pub model: String,
    pub n_layers: usize,
    pub n_experts: usize,
    /// Experts per token in this trace (the model's own count, or `--experts-used`).
    pub n_used: usize,
    pub tokens: usize,
    /// `dense`, or the neuron mask that ran inside the experts (for people).
    pub mask: String,
    /// The model's leading dense layers (GLM-4.5), which route nothing: their records are
    /// empty (no bytes in the file).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub leading_dense: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Which experts each token was routed to, per layer: what a mixture-of-experts model's
/// streaming reads, replayed by `bench` against its `.gst` without computing.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteTrace {
    pub header: RouteHeader,
    /// `records[token][layer]`: the token's experts, most likely first.
    pub records: Vec<Vec<Vec<u16>>>,
}

impl RouteTrace {
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut out = file_start(ROUTE_VERSION, &self.header)?;
        for e in self.records.iter().flatten().flatten() {
            out.extend_from_slice(&e.to_le_bytes());
        }
        crate::io::write_replacing(path, &out)
    }

    fn parse(path: &Path, bytes: &[u8], hlen: u32) -> Result<RouteTrace> {
        let bad = |offset: usize, what: String| malformed(path, "gatestream routing trace", offset, what);
        let header: RouteHeader = parse_header(path, bytes, hlen)?;
        let h = &header;
        let want = h
            .tokens
            .checked_mul(h.n_layers.saturating_sub(h.leading_dense))
            .and_then(|r| r.checked_mul(h.n_used))
            .and_then(|r| r.checked_mul(2))
            .and_then(|b| b.checked_add(16 + hlen as usize));
        if h.n_layers == 0
            || h.n_used == 0
            || h.n_used > h.n_experts
            || h.n_experts > 1 << 16
            || h.leading_dense >= h.n_layers
        {
            return Err(bad(
                16,
                format!(
                    "{} layers, {} of {} experts per token is not a routing",
                    h.n_layers, h.n_used, h.n_experts
                ),
            ));
        }
        if want != Some(bytes.len()) {
            return Err(bad(
                16,
                format!(
                    "{} tokens x {} layers x {} experts of 2 bytes do not match the file's {} bytes (truncated?)",
                    h.tokens,
                    h.n_layers,
                    h.n_used,
                    bytes.len()
                ),
            ));
        }
        let mut at = 16 + hlen as usize;
        let mut records = Vec::with_capacity(h.tokens);
        for _ in 0..h.tokens {
            let mut layers = Vec::with_capacity(h.n_layers);
            for l in 0..h.n_layers {
                let mut ids = Vec::with_capacity(h.n_used);
                for _ in 0..if l < h.leading_dense { 0 } else { h.n_used } {
                    let e = u16::from_le_bytes([bytes[at], bytes[at + 1]]);
                    if e as usize >= h.n_experts {
                        return Err(bad(at, format!("expert {e} of a model with {}", h.n_experts)));
                    }
                    ids.push(e);
                    at += 2;
                }
                layers.push(ids);
            }
            records.push(layers);
        }
        Ok(RouteTrace { header, records })
    }

    /// Distinct (layer, expert) pairs routed to over the whole trace.
    pub fn distinct_experts(&self) -> usize {
        let mut seen = std::collections::BTreeSet::new();
        for t in &self.records {
            for (l, ids) in t.iter().enumerate() {
                seen.extend(ids.iter().map(|&e| (l, e)));
            }
        }
        seen.len()
    }
}

/// Records which experts every token was routed to, as an [`FfnMask`] that wraps the real mask
/// (if any); pass it wherever the mask would go.
pub struct RouteRecorder<'a> {
    inner: Option<&'a dyn PromptAwareMask>,
    n_layers: usize,
    n_experts: usize,
    leading_dense: usize,
    /// Per layer: tokens recorded so far.
    next_token: Mutex<Vec<usize>>,
    /// Experts per token seen (the routing's; every layer the same).
    n_used: Mutex<usize>,
    routes: Mutex<BTreeMap<(usize, usize), Vec<u16>>>,
}

impl<'a> RouteRecorder<'a> {
    /// For a model of `n_layers` layers whose first `leading_dense` have no experts.
    pub fn new(
        inner: Option<&'a dyn PromptAwareMask>,
        n_layers: usize,
        n_experts: usize,
        leading_dense: usize,
    ) -> Self {
        RouteRecorder {
            inner,
            n_layers,
            n_experts,
            leading_dense,
            // (The dense layers' tokens are counted as the experts' come.)
            next_token: Mutex::new(vec![0; n_layers - leading_dense.min(n_layers)]),
            n_used: Mutex::new(0),
            routes: Mutex::new(BTreeMap::new()),
        }
    }

    /// The trace of every token whose layers were all recorded.
    pub fn trace(&self, model: &str, mask: &str) -> RouteTrace {
        let routes = self.routes.lock().expect("trace lock");
        let tokens = complete_tokens(&self.next_token);
        RouteTrace {
            header: RouteHeader {
                model: model.into(),
                n_layers: self.n_layers,
                n_experts: self.n_experts,
                n_used: *self.n_used.lock().expect("trace lock"),
                tokens,
                mask: mask.into(),
                leading_dense: self.leading_dense,
            },
            records: (0..tokens)
                .map(|t| {
                    (0..self.n_layers)
                        .map(|l| match l < self.leading_dense {
                            true => Vec::new(),
                            false => routes[&(t, l)].clone(),
                        })
                        .collect()
                })
                .collect(),
        }
    }
}

impl FfnMask for RouteRecorder<'_> {
    fn apply(&self, layer: usize, xn: &[f32], gate: &[f32], up: &[f32], hact: &mut [f32]) {
        if let Some(m) = self.inner {
            m.as_mask().apply(layer, xn, gate, up, hact);
        }
    }

    fn up_needed(&self, layer: usize, xn: &[f32], gate: &[f32], need: &mut [bool]) {
        match self.inner {
            Some(m) => m.as_mask().up_needed(layer, xn, gate, need),
            None => need.fill(true),
        }
    }

    fn inside_experts(&self) -> bool {
        self.inner.is_none_or(|m| m.as_mask().inside_experts())
    }

    fn experts_used(&self) -> Option<usize> {
        self.inner.and_then(|m| m.as_mask().experts_used())
    }

    fn masks_neurons(&self) -> bool {
        self.inner.is_some_and(|m| m.as_mask().masks_neurons())
    }

    fn routed(&self, layer: usize, n_used: usize, routes: &[(usize, f32)]) {
        if let Some(m) = self.inner {
            m.as_mask().routed(layer, n_used, routes);
        }
        let n = routes.len() / n_used.max(1);
        let first = {
            let mut next = self.next_token.lock().expect("trace lock");
            let at = &mut next[layer - self.leading_dense];
            let first = *at;
            *at += n;
            first
        };
        *self.n_used.lock().expect("trace lock") = n_used;
        let mut all = self.routes.lock().expect("trace lock");
        for (t, chosen) in routes.chunks_exact(n_used).enumerate() {
            all.insert((first + t, layer), chosen.iter().map(|r| r.0 as u16).collect());
        }
    }
}

impl PromptAwareMask for RouteRecorder<'_> {
    fn prompt_tokens(&self, n: usize) {
        if let Some(m) = self.inner {
            m.prompt_tokens(n);
        }
    }
    fn as_mask(&self) -> &dyn FfnMask {
        self
    }
}

/// The routing trace of `ids` (one pass per batch `passes` allows, from an empty cache) with no
/// neuron mask: which experts each token was routed to, per layer.
pub fn record_routes(
    model: &crate::model::Model,
    passes: crate::model::forward::Passes,
    ids: &[u32],
    text_name: &str,
) -> Result<RouteTrace> {
    let c = &model.config;
    let Some(moe) = &c.moe else {
        return Err(Error::Input(format!(
            "{}: routing traces are of mixture-of-experts models, and this model is dense",
            model.path.display()
        )));
    };
    if ids.is_empty() {
        return Err(Error::Input("a trace needs at least one token".into()));
    }
    let rec = RouteRecorder::new(None, c.n_layers, moe.n_experts, moe.leading_dense);
    let mut cache = crate::kv::KvCache::new(c, ids.len());
    model.forward_in_batches(
        ids,
        &mut cache,
        ids.len() - 1,
        &passes.hooks(Some(&rec), None),
        passes.batch_max(),
    )?;
    let name = model
        .path
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    Ok(rec.trace(&name, &format!("dense, over {text_name}")))
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
        return Err(Error::Input("a trace needs at least one token".into()));
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
        let tokens = complete_tokens(&self.next_token);
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
            let at = &mut next[layer];
            let first = *at;
            *at += n;
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

    #[test]
    fn a_routing_trace_round_trips_and_damage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.trace");
        let t = RouteTrace {
            header: RouteHeader {
                model: "m.gst".into(),
                n_layers: 2,
                n_experts: 300,
                n_used: 3,
                tokens: 2,
                mask: "dense".into(),
                leading_dense: 0,
            },
            records: vec![
                vec![vec![299, 0, 7], vec![1, 2, 3]],
                vec![vec![5, 4, 3], vec![256, 255, 0]],
            ],
        };
        t.write(&p).unwrap();
        match AnyTrace::read(&p).unwrap() {
            AnyTrace::Routes(back) => assert_eq!(back, t),
            AnyTrace::Neurons(_) => panic!("read back as a trace of neurons"),
        }
        assert_eq!(t.distinct_experts(), 12);
        let e = Trace::read(&p).unwrap_err().to_string();
        assert!(e.contains("routing trace") && e.contains("offset 8"), "{e}");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 2]).unwrap();
        let e = AnyTrace::read(&p).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        // An expert index outside the model, at its own offset.
        let mut wrong = bytes.clone();
        let last = wrong.len() - 2;
        wrong[last..].copy_from_slice(&300u16.to_le_bytes());
        std::fs::write(&p, &wrong).unwrap();
        let e = AnyTrace::read(&p).unwrap_err().to_string();
        assert!(
            e.contains("expert 300 of a model with 300") && e.contains(&format!("offset {last}")),
            "{e}"
        );
    }
}
