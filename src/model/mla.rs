//! Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; [`crate::config::Mla`]), computed as
//! llama.cpp computes it with the up-projections absorbed: each position caches one normalized
//! latent `c` (`kv_lora_rank` wide) and one rotated key part `k_pe` (`qk_rope`), shared by all
//! heads. Head h's score against a position is `q_nope·(k_b[h] c) + q_pe·k_pe`, computed as
//! `(k_b[h]ᵀ q_nope)·c + q_pe·k_pe`: the query moves into the latent space instead of every
//! cached position moving out of it. The attention is then one-KV-head attention over
//! `[c; k_pe]` with values `c`, and each head's latent output is brought back by `v_b[h]`.
//! The products run on the model's device; the per-head gathers, norms and RoPE on the host.

use crate::backend::ops::{rms_norm, rope_apply, rope_table};
use crate::backend::{Act, AttnShape, Device};
use crate::config::Mla;
use crate::kv::KvCache;
use crate::model::batch::Batch;
use crate::model::forward::{AttnWeights, MlaWeights};
use crate::model::Model;
use crate::tensor::Weight;

impl Model {
    /// The attention block's output for the normalized input `xn` (see the module docs).
    pub(crate) fn latent_attention(
        &self,
        l: usize,
        a: &AttnWeights,
        (m, mw): (&Mla, &MlaWeights),
        xn: &Act,
        batch: &Batch,
        caches: &mut [&mut KvCache],
    ) -> Act {
        let cfg = &self.config;
        let dev = &*self.device;
        let (n, heads) = (xn.rows, cfg.n_heads);
        let (qh, lat) = (m.q_head(), m.latent());
        // The query (through its bottleneck and norm where it has one) and the latent with the
        // rotated key part, from one prepared input.
        let (q, kv) = match (&mw.q_a, &mw.q_a_norm) {
            (Some(q_a), Some(q_a_norm)) => {
                let mut out = dev.matmul(&[q_a, &a.wk], xn);
                let kv = out.pop().expect("kv");
                let mut q_lat = out.pop().expect("q_a");
                dev.rms_norm_in_place(&mut q_lat, q_a_norm, cfg.rms_eps);
                (dev.matmul(&[&a.wq], &q_lat).remove(0), kv)
            }
            _ => {
                let mut out = dev.matmul(&[&a.wq, &a.wk], xn);
                let kv = out.pop().expect("kv");
                (out.pop().expect("q"), kv)
            }
        };
        let (mut q, mut kv) = (dev.download(q), dev.download(kv));
        // RoPE over the rotated parts: the key's once, each head's query's.
        let mut table = Vec::with_capacity(m.qk_rope / 2);
        for (t, &pos) in batch.positions.iter().enumerate() {
            rope_table(
                pos,
                m.qk_rope,
                cfg.rope_theta,
                cfg.rope_scale_global,
                cfg.rope_freq_factors.as_deref(),
                &mut table,
            );
            let row = &mut kv[t * lat..(t + 1) * lat];
            rms_norm(&mut row[..m.kv_lora_rank], &mw.kv_a_norm, cfg.rms_eps);
            rope_apply(&mut row[m.kv_lora_rank..], &table, cfg.rope_style);
            for head in q[t * heads * qh..(t + 1) * heads * qh].chunks_mut(qh) {
                rope_apply(&mut head[m.qk_nope..], &table, cfg.rope_style);
            }
        }
        // Each head's unrotated query part into the latent space: k_b[h]ᵀ q_nope is the product
        // with head h's `kv_lora_rank` rows of `[qk_nope]`, i.e. q_nope against each row; the
        // rotated part follows it.
        let mut q_abs = vec![0f32; n * heads * lat];
        per_head(
            dev,
            &mw.k_b,
            m.kv_lora_rank,
            (&q, qh, m.qk_nope),
            (&mut q_abs, lat),
            n,
            heads,
        );
        for (row, q_row) in q_abs.chunks_exact_mut(lat).zip(q.chunks_exact(qh)) {
            row[m.kv_lora_rank..].copy_from_slice(&q_row[m.qk_nope..]);
        }
        let k = dev.upload(n, lat, kv);
        // (The values are the keys' first `kv_lora_rank` numbers: the cache keeps them once.)
        dev.kv_write(l, &k, &k, &batch.positions, &batch.seq_of_token, caches);
        let shape = AttnShape {
            layer: l,
            n_heads: heads,
            n_kv_heads: 1,
            head_dim: lat,
            scale: cfg.attn_scale,
            window: None,
            sinks: None,
        };
        let attn = dev.download(dev.attention(
            &dev.upload(n, heads * lat, q_abs),
            &batch.positions,
            &batch.seq_of_token,
            caches,
            shape,
        ));
        // Each head's latent output through its value up-projection, then the output matrix.
        let mut heads_out = vec![0f32; n * heads * m.v_head];
        per_head(
            dev,
            &a.wv,
            m.v_head,
            (&attn, lat, m.kv_lora_rank),
            (&mut heads_out, m.v_head),
            n,
            heads,
        );
        dev.matmul(&[&a.wo], &dev.upload(n, heads * m.v_head, heads_out))
            .remove(0)
    }
}

/// For each head h of `n` tokens: `w`'s rows `h·out..(h+1)·out` (head h's matrix of the stacked
/// tensor) times the first `width` numbers of each token's head h in `src` (`stride` a head),
/// written to the start of the token's head h in `dst` (`dst_stride` a head).
fn per_head(
    dev: &dyn Device,
    w: &Weight,
    out: usize,
    (src, stride, width): (&[f32], usize, usize),
    (dst, dst_stride): (&mut [f32], usize),
    n: usize,
    heads: usize,
) {
    for h in 0..heads {
        let input: Vec<f32> = (0..n)
            .flat_map(|t| &src[(t * heads + h) * stride..(t * heads + h) * stride + width])
            .copied()
            .collect();
        let got = dev.download(
            dev.matmul(&[&w.rows_view(h * out, out)], &dev.upload(n, width, input))
                .remove(0),
        );
        for (t, row) in got.chunks_exact(out).enumerate() {
            let at = (t * heads + h) * dst_stride;
            dst[at..at + out].copy_from_slice(row);
        }
    }
}
