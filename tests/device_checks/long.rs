//! Attention over a long context: one query token at the end of a cache of many positions
//! (written in one batch), with and without a window and sinks, and over a latent attention
//! cache (values read from the keys), against the CPU device. One body for any device.

use gatestream::backend::cpu::CpuBackend;
use gatestream::backend::{AttnShape, Device, RopeShape};
use gatestream::config::RopeStyle;
use gatestream::kv::KvCache;

use super::{err_of, kv_cache, latent_kv_cache, rel_err, Rng};

/// `positions` cached positions of heads of `hd` (8 query heads over 2 key heads), then the last
/// position's query: its attention over all of them, over a window of a third of them, and with
/// sinks, on `dev` and on the CPU device. Passes within `tol` of the largest value.
pub fn long_attention_against_cpu(dev: &dyn Device, positions: usize, hd: usize, tol: f64) -> Result<String, String> {
    let cpu = CpuBackend::new(1);
    let (n_heads, n_kv) = (8, 2);
    let (qd, kvd) = (n_heads * hd, n_kv * hd);
    let mut rng = Rng(29);
    let sinks = rng.values(n_heads);
    let seed = rng.next();
    let mut worst = 0f64;
    let mut failed = Vec::new();
    for (window, use_sinks) in [(None, false), (Some(positions / 3), false), (None, true)] {
        if use_sinks && !dev.attention_sinks() {
            continue;
        }
        let run = |d: &dyn Device| -> Vec<f32> {
            let mut rng = Rng(seed);
            let mut caches: Vec<KvCache> = vec![kv_cache(1, kvd, positions)];
            let all: Vec<usize> = (0..positions).collect();
            let k = d.upload(positions, kvd, rng.values(positions * kvd));
            let v = d.upload(positions, kvd, rng.values(positions * kvd));
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            d.kv_write(0, &k, &v, &all, &vec![0; positions], &mut refs);
            let q = d.upload(1, qd, rng.values(qd));
            let a = d.attention(
                &q,
                &[positions - 1],
                &[0],
                &refs,
                AttnShape {
                    layer: 0,
                    n_heads,
                    n_kv_heads: n_kv,
                    head_dim: hd,
                    scale: 1.0 / (hd as f32).sqrt(),
                    window,
                    sinks: use_sinks.then_some(&sinks[..]),
                },
            );
            d.to_host(&a).into_owned()
        };
        let got = run(dev);
        err_of(dev)?;
        let want = run(&cpu);
        let e = rel_err(&got, &want);
        worst = worst.max(e);
        if e > tol {
            failed.push(format!("window={window:?} sinks={use_sinks}: {e:.2e}"));
        }
    }
    let msg = format!(
        "  attention of the last of {positions} positions (heads of {hd}, 8 over 2; whole, a window of a third, \
         sinks): worst |diff| / max against the CPU {worst:.2e} (bar {tol:.0e})"
    );
    match failed.is_empty() {
        true => Ok(msg),
        false => Err(format!("{msg}\n  FAILED: {}", failed.join("; "))),
    }
}

/// Latent attention (DeepSeek-V2/V3, Kimi-K2) over `positions` cached positions of a cache that
/// holds one key of `width` a position (the latent and its rotated part: DeepSeek's are 576) and
/// no values: 16 query heads over that one head, each value the key itself. The first 16
/// positions are written with RoPE (`rope_qk_kv_write`, the whole head rotated), the others
/// with `kv_write`, each given other numbers as its values, which a latent cache must not take
/// (written over the keys, they would change every score). Then the last position's query alone
/// and the last 16 positions' queries in one batch (a prompt's run), on `dev` and on the CPU
/// device. Passes within `tol` of the largest value.
pub fn latent_attention_against_cpu(
    dev: &dyn Device,
    positions: usize,
    width: usize,
    tol: f64,
) -> Result<String, String> {
    let cpu = CpuBackend::new(1);
    let (n_heads, run) = (16, 16);
    assert!(positions >= 2 * run, "a span of at least two runs");
    let seed = Rng(37).next();
    let rope = RopeShape {
        head_dim: width,
        rope_dims: width,
        base: 10000.0,
        pos_scale: 1.0,
        style: RopeStyle::AdjacentPairs,
        factors: None,
    };
    let attend = |d: &dyn Device| -> Vec<f32> {
        let mut rng = Rng(seed);
        let mut caches: Vec<KvCache> = vec![latent_kv_cache(1, width, positions)];
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let first: Vec<usize> = (0..run).collect();
        let mut q = d.upload(run, n_heads * width, rng.values(run * n_heads * width));
        let mut k = d.upload(run, width, rng.values(run * width));
        let other = d.upload(run, width, rng.values(run * width));
        d.rope_qk_kv_write(
            0,
            &mut q,
            &mut k,
            &other,
            (&first, &vec![0; run]),
            &mut refs,
            (rope, None, None, 1e-6),
        );
        let rest: Vec<usize> = (run..positions).collect();
        let n = rest.len();
        let k = d.upload(n, width, rng.values(n * width));
        let other = d.upload(n, width, rng.values(n * width));
        d.kv_write(0, &k, &other, &rest, &vec![0; n], &mut refs);
        let shape = AttnShape {
            layer: 0,
            n_heads,
            n_kv_heads: 1,
            head_dim: width,
            scale: 1.0 / (width as f32).sqrt(),
            window: None,
            sinks: None,
        };
        let mut out = Vec::new();
        for tokens in [vec![positions - 1], (positions - run..positions).collect::<Vec<_>>()] {
            let t = tokens.len();
            let q = d.upload(t, n_heads * width, rng.values(t * n_heads * width));
            let a = d.attention(&q, &tokens, &vec![0; t], &refs, shape);
            out.extend(d.to_host(&a).iter());
        }
        out
    };
    let got = attend(dev);
    err_of(dev)?;
    let want = attend(&cpu);
    let e = rel_err(&got, &want);
    let msg = format!(
        "  latent attention over {positions} positions (one key of {width} a position, no values: 16 query heads, \
         the values the keys; the last position's query, then a run of {run}): |diff| / max against the CPU {e:.2e} \
         (bar {tol:.0e})"
    );
    match e <= tol {
        true => Ok(msg),
        false => Err(format!("{msg}\n  FAILED")),
    }
}

/// Each row's k largest values with their ids, log-sum-exp and greedy token on `dev` against the
/// CPU device's: rows of 100, 49152 and 151936 values (many of them tied: values on a grid of
/// 1/8, so the k-th value is tied across the cut), with and without banned ids, k of 1, 40 and
/// 1024 (past a short row: all of it). Pairs and tokens must be the same; log-sum-exp within
/// `tol` (the device sums in f32).
pub fn top_k_against_cpu(dev: &dyn Device, tol: f64) -> Result<String, String> {
    let cpu = CpuBackend::new(1);
    let mut rng = Rng(41);
    let (mut cases, mut worst) = (0, 0f64);
    let mut failed = Vec::new();
    for width in [100usize, 49152, 151936] {
        let rows = 3;
        let values: Vec<f32> = (0..rows * width)
            .map(|_| (rng.normalish() * 16.0).round() / 8.0)
            .collect();
        for banned in [&[][..], &[0u32, 7, 99][..]] {
            for k in [1usize, 40, 1024] {
                let (xd, xc) = (
                    dev.upload(rows, width, values.clone()),
                    cpu.upload(rows, width, values.clone()),
                );
                let got = dev.top_k_rows(&xd, k, banned, true, true);
                err_of(dev)?;
                let want = cpu.top_k_rows(&xc, k, banned, true, true);
                cases += 1;
                let lse = got
                    .lse
                    .iter()
                    .zip(&want.lse)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f64, f64::max);
                worst = worst.max(lse);
                if got.pairs != want.pairs || got.tokens != want.tokens || got.lse.len() != want.lse.len() || lse > tol
                {
                    let at = got.pairs.iter().zip(&want.pairs).position(|(a, b)| a != b);
                    failed.push(format!(
                        "width {width}, k {k}, {} banned: pairs differ at {at:?} ({} vs {} pairs), tokens {:?} vs {:?}, \
                         lse off by {lse:.2e}",
                        banned.len(),
                        got.pairs.len(),
                        want.pairs.len(),
                        got.tokens,
                        want.tokens
                    ));
                }
            }
        }
    }
    let msg = format!(
        "  top-k ({cases} cases: rows of 100 to 151936 tied values, banned ids, k 1 to 1024): pairs and greedy tokens \
         equal to the CPU's, log-sum-exp within {worst:.2e} (bar {tol:.0e})"
    );
    match failed.is_empty() {
        true => Ok(msg),
        false => Err(format!("{msg}\n  FAILED: {}", failed.join("; "))),
    }
}
