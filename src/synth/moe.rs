//! Synthetic mixture-of-experts GGUF files, because no real MoE weights are reachable here. Both
//! kinds start from a dense llama-architecture GGUF (SmolLM2, stories260K), whose tokenizer they
//! keep, and are written the way llama.cpp reads each architecture, so llama.cpp can serve as the
//! independent reference on the same file:
//! - upcycled (the default): the dense FFN copied into every expert, each copy's values scaled by
//!   `1 + perturb·N(0,1)`, a random router, the attention and embeddings as they are (Q/K rows
//!   un-permuted for the architectures that rotate half-split pairs; QK-norm made nearly the
//!   identity, see [`QK_LINEAR_EPS`]). The chosen experts' weights come close to summing to one
//!   (down is scaled by experts/used where the architecture does not renormalize; Qwen2-MoE's
//!   shared expert, the dense FFN itself behind a gate near sigmoid(0) = 1/2, takes half), so the
//!   model speaks like its dense source and greedy tokens and perplexity mean something;
//! - random: every matrix random at a given shape (`RandomShape`).
//!
//! `gatestream make-moe` is the command.

use std::path::Path;

use super::Rng;
use crate::config::Arch;
use crate::error::{Error, Result};
use crate::gguf::write::{gguf_bytes, TensorOut};
use crate::gguf::{GgufFile, MetaValue};
use crate::model::open_source;
use crate::model::weights::{FfnDown, ModelWeights};
use crate::quant::{quantize_row, GgmlType};
use crate::tensor::Weight;

/// The dimensions of a random model.
#[derive(Clone, Copy, Debug)]
pub struct RandomShape {
    pub hidden: usize,
    /// Each expert's neurons.
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
}

/// What to write.
#[derive(Clone, Debug)]
pub struct MoeSpec {
    /// `Llama` (Mixtral-style), `Qwen2Moe`, `Qwen3Moe` or `Olmoe`.
    pub arch: Arch,
    pub experts: usize,
    pub used: usize,
    /// Type of the expert matrices (random models: of every matrix but the router's).
    pub ty: GgmlType,
    /// Random weights of this shape instead of the dense model's.
    pub random: Option<RandomShape>,
    /// Relative size of each expert's perturbation (upcycling).
    pub perturb: f32,
    pub seed: u64,
}

/// What was written.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MoeReport {
    pub arch: String,
    pub experts: usize,
    pub used: usize,
    pub layers: usize,
    pub hidden: usize,
    pub expert_ffn: usize,
    pub bytes: u64,
}

/// A tensor being written: GGUF dims (fastest first), type and bytes.
struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    bytes: Vec<u8>,
}

/// An F32 vector (give `dims` afterwards for a matrix).
fn f32_tensor(name: String, v: &[f32]) -> Tensor {
    Tensor {
        name,
        dims: vec![v.len() as u64],
        ty: GgmlType::F32,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Rows of `cols` values quantized to `ty`, appended to `out`.
fn quantize_into(ty: GgmlType, rows: &[f32], cols: usize, out: &mut Vec<u8>) -> Result<()> {
    let rb = ty
        .row_bytes(cols)
        .ok_or_else(|| Error::Input(format!("{cols} columns do not fit {} blocks", ty.name())))?;
    for row in rows.chunks_exact(cols) {
        let start = out.len();
        out.resize(start + rb, 0);
        if !quantize_row(ty, row, &mut out[start..]) {
            return Err(Error::Input(format!("quantizing to {} is not implemented", ty.name())));
        }
    }
    Ok(())
}

fn dequantized(w: &Weight) -> Vec<f32> {
    let mut out = vec![0f32; w.rows * w.cols];
    for (r, row) in out.chunks_exact_mut(w.cols).enumerate() {
        w.dequantize_row(r, row);
    }
    out
}

/// A matrix's bytes as stored, rows in `order` (all, in order, when `None`).
fn raw(name: String, w: &Weight, order: Option<&[usize]>) -> Tensor {
    let rows = order.map_or(w.rows, |o| o.len());
    let mut bytes = Vec::with_capacity(rows * w.row_bytes);
    match order {
        Some(o) => o.iter().for_each(|&r| bytes.extend_from_slice(w.row(r))),
        None => (0..w.rows).for_each(|r| bytes.extend_from_slice(w.row(r))),
    }
    Tensor {
        name,
        dims: vec![w.cols as u64, rows as u64],
        ty: w.ty,
        bytes,
    }
}

/// Undoes llama.cpp's permutation of `llama` Q/K rows (adjacent-pair RoPE) for architectures
/// that rotate dimension i with i + head_dim/2: the returned order lists, for each new row,
/// the stored row it comes from.
fn half_split_order(heads: usize, head_dim: usize) -> Vec<usize> {
    let mut order = vec![0; heads * head_dim];
    for h in 0..heads {
        for i in 0..head_dim / 2 {
            for j in 0..2 {
                order[h * head_dim + j * head_dim / 2 + i] = h * head_dim + 2 * i + j;
            }
        }
    }
    order
}

/// The norms' epsilon written when upcycling into a QK-norm architecture (qwen3moe, olmoe), whose
/// source never normalized Q and K. RMSNorm is `x / sqrt(mean(x²) + eps) · w`: with an epsilon far
/// above a projection's mean square it is nearly linear in `x`, and `w = sqrt(eps + typical mean
/// square)` makes it nearly the identity (a token's Q is scaled by `sqrt((eps + typical) / (eps +
/// its own mean square))`, within 0.5% of one while mean squares stay under 100). Normalizing Q
/// and K to a fixed RMS instead, as a real QK-norm model was trained
/// to, damaged the upcycled models beyond use (perplexity ~900–1400 where the source has ~22).
pub const QK_LINEAR_EPS: f32 = 1e4;

/// With [`QK_LINEAR_EPS`] the other norms share that epsilon, so the residual stream is carried
/// this many times larger (the embedding, the attention output and the experts' down are scaled,
/// the output matrix is not; a power of two, and the norms undo it): its mean square then dwarfs
/// the epsilon as the source's did its own.
pub const QK_RESIDUAL_SCALE: f32 = 65536.0;

/// The RMS a projection's rows give an input normalized to unit RMS and scaled by `norm`
/// (uncorrelated inputs): the typical RMS a near-identity QK-norm weight is set for.
fn projected_rms(w: &[f32], cols: usize, norm: &[f32]) -> f32 {
    let rows = w.len() / cols;
    let s: f64 = w
        .chunks_exact(cols)
        .map(|r| {
            r.iter()
                .zip(norm)
                .map(|(a, b)| (a * b) as f64 * (a * b) as f64)
                .sum::<f64>()
        })
        .sum();
    ((s / rows as f64).sqrt() as f32).max(1e-3)
}

/// Writes a synthetic MoE model made from the dense GGUF `dense` to `out` (through a temporary
/// file renamed when complete). `progress(layer, layers)` after each layer.
pub fn write_moe(
    dense: &Path,
    spec: &MoeSpec,
    out: &Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<MoeReport> {
    let arch = spec.arch;
    if !arch.is_moe() && arch != Arch::Llama {
        return Err(Error::Input(format!(
            "{} is not a mixture-of-experts architecture; use llama, qwen2moe, qwen3moe or olmoe",
            arch.name()
        )));
    }
    if arch == Arch::GptOss {
        return Err(Error::Input(
            "make-moe does not write gpt-oss (its sinks, biases and clamped experts are not in a dense \
             model to upcycle); `make-model --arch gpt-oss --shape custom` writes one"
                .into(),
        ));
    }
    if spec.used == 0 || spec.used > spec.experts || spec.experts > 256 {
        return Err(Error::Input(format!(
            "{} experts with {} used per token: need 1 <= used <= experts <= 256",
            spec.experts, spec.used
        )));
    }
    let src = open_source(dense)?;
    let g = GgufFile::open(dense)?;
    let cfg = &src.config;
    if cfg.arch != Arch::Llama || cfg.moe.is_some() {
        return Err(Error::Input(format!(
            "{}: the source must be a dense llama-architecture GGUF (found {}{})",
            dense.display(),
            cfg.arch.name(),
            if cfg.moe.is_some() { " with experts" } else { "" }
        )));
    }
    let weights = match spec.random {
        None => Some(ModelWeights::load(&src.tensors, cfg)?),
        Some(_) => None,
    };
    let shape = spec.random.unwrap_or(RandomShape {
        hidden: cfg.hidden,
        ffn: cfg.ffn,
        layers: cfg.n_layers,
        heads: cfg.n_heads,
        kv_heads: cfg.n_kv_heads,
    });
    let RandomShape {
        hidden: h,
        ffn: f,
        layers,
        heads,
        kv_heads,
    } = shape;
    if h == 0 || heads == 0 || kv_heads == 0 || !h.is_multiple_of(heads) || !heads.is_multiple_of(kv_heads) {
        return Err(Error::Input(format!(
            "shape {shape:?}: heads must divide hidden, kv heads heads"
        )));
    }
    let hd = h / heads;
    // llama.cpp's olmoe has no grouped-query attention: a source's shared K/V heads are repeated
    // (one per query head, which attends the same keys and values as before).
    let kv_heads = if arch == Arch::Olmoe {
        if spec.random.is_some() && kv_heads != heads {
            return Err(Error::Input(format!(
                "olmoe has no grouped-query attention: give as many KV heads as heads ({heads}), not {kv_heads}"
            )));
        }
        heads
    } else {
        kv_heads
    };
    let (q, kv) = (h, kv_heads * hd);
    let (e, k) = (spec.experts, spec.used);
    let normalize = matches!(arch, Arch::Llama | Arch::Qwen3Moe);
    let shared = arch == Arch::Qwen2Moe;
    // Routed experts' share of the dense FFN, and the scale that gives it with ~uniform routing.
    let routed_share = if shared { 0.5 } else { 1.0 };
    let down_scale = routed_share * if normalize { 1.0 } else { e as f32 / k as f32 };
    let mut rng = Rng(spec.seed ^ 0x6d6f_655f_7379_6e74);
    let half_split = arch != Arch::Llama;
    // Upcycled into a QK-norm architecture: the norms' epsilon and the residual stream's scale.
    let qk_linear = spec.random.is_none() && matches!(arch, Arch::Qwen3Moe | Arch::Olmoe);
    let (rms_eps, residual) = match qk_linear {
        true => (QK_LINEAR_EPS, QK_RESIDUAL_SCALE),
        false => (cfg.rms_eps, 1.0),
    };
    // A source matrix times the residual scale: as stored when the scale is 1, else F32 from a
    // float source (exact: a power of two) and Q8_0 from a quantized one.
    let scaled = |name: String, w: &Weight| -> Result<Tensor> {
        if residual == 1.0 {
            return Ok(raw(name, w, None));
        }
        let v: Vec<f32> = dequantized(w).iter().map(|x| x * residual).collect();
        let ty = match w.ty {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => GgmlType::F32,
            _ => GgmlType::Q8_0,
        };
        let mut bytes = Vec::new();
        quantize_into(ty, &v, w.cols, &mut bytes)?;
        Ok(Tensor {
            name,
            dims: vec![w.cols as u64, w.rows as u64],
            ty,
            bytes,
        })
    };

    // Metadata: the source's tokenizer and general keys, the architecture's own keys.
    let a = arch.name();
    let mut meta: Vec<(String, MetaValue)> = g
        .metadata
        .iter()
        .filter(|(key, _)| {
            (key.starts_with("tokenizer.") || key.starts_with("general."))
                && *key != "general.architecture"
                && *key != "general.name"
        })
        .map(|(key, v)| (key.clone(), v.clone()))
        .collect();
    meta.sort_by(|x, y| x.0.cmp(&y.0));
    let source_name = g.get("general.name").and_then(|v| v.as_str()).unwrap_or("model");
    let kind = if spec.random.is_some() { "random" } else { "upcycled" };
    meta.push(("general.architecture".into(), MetaValue::Str(a.into())));
    meta.push((
        "general.name".into(),
        MetaValue::Str(format!("{source_name} {kind} {a} {e}x{k} (synthetic)")),
    ));
    let u = |v: usize| MetaValue::U32(v as u32);
    for (key, v) in [
        ("context_length", u(cfg.context_len)),
        ("embedding_length", u(h)),
        ("feed_forward_length", u(f)),
        ("block_count", u(layers)),
        ("attention.head_count", u(heads)),
        ("attention.head_count_kv", u(kv_heads)),
        ("attention.layer_norm_rms_epsilon", MetaValue::F32(rms_eps)),
        ("rope.freq_base", MetaValue::F32(cfg.rope_theta)),
        ("expert_count", u(e)),
        ("expert_used_count", u(k)),
    ] {
        meta.push((format!("{a}.{key}"), v));
    }
    if matches!(arch, Arch::Qwen2Moe | Arch::Qwen3Moe) {
        meta.push((format!("{a}.expert_feed_forward_length"), u(f)));
    }
    if shared {
        meta.push((format!("{a}.expert_shared_feed_forward_length"), u(f)));
    }

    let mut tensors: Vec<Tensor> = Vec::new();
    // A random matrix [rows, cols] of `ty`, values N(0, 1/cols).
    let random_matrix = |name: String, rows: usize, cols: usize, ty: GgmlType, rng: &mut Rng| -> Result<Tensor> {
        let s = 1.0 / (cols as f32).sqrt();
        let v: Vec<f32> = (0..rows * cols).map(|_| rng.normal() * s).collect();
        let mut bytes = Vec::new();
        quantize_into(ty, &v, cols, &mut bytes)?;
        Ok(Tensor {
            name,
            dims: vec![cols as u64, rows as u64],
            ty,
            bytes,
        })
    };
    let random_norm = |n: usize, rng: &mut Rng| -> Vec<f32> { (0..n).map(|_| 1.0 + 0.1 * rng.normal()).collect() };
    match &weights {
        Some(w) => {
            tensors.push(scaled("token_embd.weight".into(), &w.token_embd)?);
            // qwen2moe and olmoe require an output matrix: a tied source writes its embedding.
            tensors.push(raw("output.weight".into(), &w.output, None));
            tensors.push(f32_tensor("output_norm.weight".into(), &w.output_norm));
        }
        None => {
            let vocab = cfg.vocab;
            tensors.push(random_matrix("token_embd.weight".into(), vocab, h, spec.ty, &mut rng)?);
            tensors.push(random_matrix("output.weight".into(), vocab, h, spec.ty, &mut rng)?);
            tensors.push(f32_tensor("output_norm.weight".into(), &random_norm(h, &mut rng)));
        }
    }

    for l in 0..layers {
        let n = |what: &str| format!("blk.{l}.{what}");
        let lw = weights.as_ref().map(|w| &w.layers[l]);
        let attn_norm = match lw {
            Some(lw) => lw.attn_norm.clone(),
            None => random_norm(h, &mut rng),
        };
        let ffn_norm = match lw {
            Some(lw) => lw.ffn_norm.clone(),
            None => random_norm(h, &mut rng),
        };
        tensors.push(f32_tensor(n("attn_norm.weight"), &attn_norm));
        match lw {
            Some(lw) => {
                // Stored rows of K and V for each written head (repeated for olmoe).
                let src_kv = lw.attn.wk.rows / hd;
                let repeat: Vec<usize> = (0..kv).map(|r| (r / hd) / (kv_heads / src_kv) * hd + r % hd).collect();
                let rotated = |heads: usize| match half_split {
                    true => half_split_order(heads, hd),
                    false => (0..heads * hd).collect(),
                };
                let k_order: Vec<usize> = rotated(kv_heads).iter().map(|&r| repeat[r]).collect();
                tensors.push(raw(n("attn_q.weight"), &lw.attn.wq, Some(&rotated(heads))));
                tensors.push(raw(n("attn_k.weight"), &lw.attn.wk, Some(&k_order)));
                tensors.push(raw(n("attn_v.weight"), &lw.attn.wv, Some(&repeat)));
                tensors.push(scaled(n("attn_output.weight"), &lw.attn.wo)?);
                if matches!(arch, Arch::Qwen3Moe | Arch::Olmoe) {
                    // Near-identity weights (see QK_LINEAR_EPS); repeating heads leaves the RMS.
                    let near_identity = |w: &Weight| {
                        let r = projected_rms(&dequantized(w), h, &attn_norm);
                        (rms_eps + r * r).sqrt()
                    };
                    let (wq, wk) = (near_identity(&lw.attn.wq), near_identity(&lw.attn.wk));
                    let (lq, lk) = if arch == Arch::Olmoe { (q, kv) } else { (hd, hd) };
                    tensors.push(f32_tensor(n("attn_q_norm.weight"), &vec![wq; lq]));
                    tensors.push(f32_tensor(n("attn_k_norm.weight"), &vec![wk; lk]));
                }
            }
            None => {
                for (what, rows, cols) in [
                    ("attn_q.weight", q, h),
                    ("attn_k.weight", kv, h),
                    ("attn_v.weight", kv, h),
                    ("attn_output.weight", h, q),
                ] {
                    tensors.push(random_matrix(n(what), rows, cols, spec.ty, &mut rng)?);
                }
                match arch {
                    Arch::Qwen3Moe => {
                        tensors.push(f32_tensor(n("attn_q_norm.weight"), &random_norm(hd, &mut rng)));
                        tensors.push(f32_tensor(n("attn_k_norm.weight"), &random_norm(hd, &mut rng)));
                    }
                    Arch::Olmoe => {
                        tensors.push(f32_tensor(n("attn_q_norm.weight"), &random_norm(q, &mut rng)));
                        tensors.push(f32_tensor(n("attn_k_norm.weight"), &random_norm(kv, &mut rng)));
                    }
                    _ => {}
                }
            }
        }
        tensors.push(f32_tensor(n("ffn_norm.weight"), &ffn_norm));

        // Router: logits of standard deviation ~0.5 for a unit-RMS input scaled by ffn_norm
        // (upcycled: near-uniform routing keeps the weighted sum near the dense FFN), ~3 for
        // random models (clear choices: a near-tie that rounding flips swaps whole experts, and
        // a reference comparison would measure that rather than the arithmetic).
        let norm_len = ffn_norm.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-3);
        let logit_std = if spec.random.is_some() { 3.0 } else { 0.5 };
        let router: Vec<f32> = (0..e * h).map(|_| rng.normal() * logit_std / norm_len).collect();
        tensors.push(Tensor {
            dims: vec![h as u64, e as u64],
            ..f32_tensor(n("ffn_gate_inp.weight"), &router)
        });

        // Experts: [gate, up] `[f, h]` and down `[h, f]` each, expert outermost.
        let dense = lw
            .map(|lw| -> Result<[Vec<f32>; 3]> {
                let fw = lw.dense("upcycling")?;
                let FfnDown::Rows(down) = &fw.down else {
                    return Err(Error::Internal("a GGUF source with neuron-major down".into()));
                };
                Ok([dequantized(&fw.gate), dequantized(&fw.up), dequantized(down)])
            })
            .transpose()?;
        for (p, (what, cols)) in [
            ("ffn_gate_exps.weight", h),
            ("ffn_up_exps.weight", h),
            ("ffn_down_exps.weight", f),
        ]
        .into_iter()
        .enumerate()
        {
            let rows = f * h / cols;
            let mut bytes = Vec::new();
            let scale = if p == 2 { down_scale * residual } else { 1.0 };
            for _ in 0..e {
                let v: Vec<f32> = match &dense {
                    Some(d) => d[p]
                        .iter()
                        .map(|&x| x * scale * (1.0 + spec.perturb * rng.normal()))
                        .collect(),
                    None => (0..rows * cols).map(|_| rng.normal() / (cols as f32).sqrt()).collect(),
                };
                quantize_into(spec.ty, &v, cols, &mut bytes)?;
            }
            tensors.push(Tensor {
                name: n(what),
                dims: vec![cols as u64, rows as u64, e as u64],
                ty: spec.ty,
                bytes,
            });
        }
        if shared {
            let gate: Vec<f32> = (0..h).map(|_| rng.normal() * 0.05 / norm_len).collect();
            tensors.push(f32_tensor(n("ffn_gate_inp_shexp.weight"), &gate));
            match lw {
                Some(lw) => {
                    let fw = lw.dense("upcycling")?;
                    tensors.push(raw(n("ffn_gate_shexp.weight"), &fw.gate, None));
                    tensors.push(raw(n("ffn_up_shexp.weight"), &fw.up, None));
                    tensors.push(raw(n("ffn_down_shexp.weight"), fw.down.weight(), None));
                }
                None => {
                    tensors.push(random_matrix(n("ffn_gate_shexp.weight"), f, h, spec.ty, &mut rng)?);
                    tensors.push(random_matrix(n("ffn_up_shexp.weight"), f, h, spec.ty, &mut rng)?);
                    tensors.push(random_matrix(n("ffn_down_shexp.weight"), h, f, spec.ty, &mut rng)?);
                }
            }
        }
        progress(l + 1, layers);
    }

    let meta_refs: Vec<(&str, MetaValue)> = meta.iter().map(|(key, v)| (key.as_str(), v.clone())).collect();
    let outs: Vec<TensorOut> = tensors
        .iter()
        .map(|t| TensorOut {
            name: &t.name,
            dims: t.dims.clone(),
            type_id: t.ty.ggml_id(),
            bytes: &t.bytes,
        })
        .collect();
    let bytes = gguf_bytes(&meta_refs, &outs);
    let tmp = out.with_extension("gguf.partial");
    std::fs::write(&tmp, &bytes).map_err(|err| Error::io(&tmp, err))?;
    std::fs::rename(&tmp, out).map_err(|err| Error::io(out, err))?;
    Ok(MoeReport {
        arch: a.into(),
        experts: e,
        used: k,
        layers,
        hidden: h,
        expert_ffn: f,
        bytes: bytes.len() as u64,
    })
}
