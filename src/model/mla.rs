//! Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; [`crate::config::Mla`]), computed as
//! llama.cpp computes it with the up-projections absorbed: each position caches one normalized
//! latent `c` (`kv_lora_rank` wide) and one rotated key part `k_pe` (`qk_rope`), shared by all
//! heads. Head h's score against a position is `q_nope·(k_b[h] c) + q_pe·k_pe`, computed as
//! `(k_b[h]ᵀ q_nope)·c + q_pe·k_pe`: the query moves into the latent space instead of every
//! cached position moving out of it. The attention is then one-KV-head attention over
//! `[c; k_pe]` with values `c`, and each head's latent output is brought back by `v_b[h]`.
//! The products run on the model's device; the per-head gathers, norms and RoPE on the host.

use crate::backend::ops::{rms_norm, rope_apply, rope_table};
use crate::backend::{Act, AttnShape};
use crate::config::Mla;
use crate::kv::KvCache;
use crate::model::batch::Batch;
use crate::model::forward::{AttnWeights, MlaWeights};
use crate::model::Model;

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
        // with head h's `kv_lora_rank` rows of `[qk_nope]`, i.e. q_nope against each row.
        let mut q_abs = vec![0f32; n * heads * lat];
        for h in 0..heads {
            let nope: Vec<f32> = (0..n)
                .flat_map(|t| &q[(t * heads + h) * qh..(t * heads + h) * qh + m.qk_nope])
                .copied()
                .collect();
            let k_b = mw.k_b.rows_view(h * m.kv_lora_rank, m.kv_lora_rank);
            let out = dev.download(dev.matmul(&[&k_b], &dev.upload(n, m.qk_nope, nope)).remove(0));
            for t in 0..n {
                let at = (t * heads + h) * lat;
                q_abs[at..at + m.kv_lora_rank].copy_from_slice(&out[t * m.kv_lora_rank..(t + 1) * m.kv_lora_rank]);
                q_abs[at + m.kv_lora_rank..at + lat]
                    .copy_from_slice(&q[(t * heads + h) * qh + m.qk_nope..(t * heads + h + 1) * qh]);
            }
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
        for h in 0..heads {
            let latent: Vec<f32> = (0..n)
                .flat_map(|t| &attn[(t * heads + h) * lat..(t * heads + h) * lat + m.kv_lora_rank])
                .copied()
                .collect();
            let v_b = a.wv.rows_view(h * m.v_head, m.v_head);
            let out = dev.download(dev.matmul(&[&v_b], &dev.upload(n, m.kv_lora_rank, latent)).remove(0));
            for t in 0..n {
                let at = (t * heads + h) * m.v_head;
                heads_out[at..at + m.v_head].copy_from_slice(&out[t * m.v_head..(t + 1) * m.v_head]);
            }
        }
        dev.matmul(&[&a.wo], &dev.upload(n, heads * m.v_head, heads_out))
            .remove(0)
    }
}
