//! The layer program's operations on the CUDA device ([`Device`]), and the launches they share
//! (RoPE, norms, products: float, integer and by rows).

use super::launch::params;
use super::*;

/// Record `$to` of [`params`]: after each `from`, the fields named there, each that value's field
/// of the same name; after `set`, the fields given. A field left out, named twice or of another
/// type does not compile.
macro_rules! record {
    ($to:ident $(from $from:ident: $($f:ident),+;)+ $(set $($g:ident: $v:expr),+)?) => {
        params::$to { $($($f: $from.$f,)+)+ $($($g: $v,)+)? }
    };
}

impl Device for CudaDevice {
    fn latent_attention(&self) -> bool {
        // (A latent cache's values are its keys: see `DevKv`.)
        true
    }
    fn attention_sinks(&self) -> bool {
        true
    }
    fn computes_type(&self, ty: crate::quant::GgmlType) -> bool {
        computes_type(ty)
    }
    fn name(&self) -> String {
        self.label.clone()
    }

    fn run<'a>(&self, f: Box<dyn FnOnce() + Send + 'a>) {
        if let Err(e) = self.ctx.bind_to_thread() {
            self.fail(format!("CUDA: binding the context: {e}"));
        }
        f()
    }

    fn take_error(&self) -> Option<Error> {
        self.end_segment();
        self.error.lock().expect("error").take().map(Error::Device)
    }

    fn launch_pending(&self) {
        self.end_segment();
    }

    fn upload(&self, rows: usize, width: usize, values: Vec<f32>) -> Act {
        assert_eq!(values.len(), rows * width, "activation shape");
        // A pooled buffer, which a recorded launch may still read.
        self.end_segment();
        let mut a = self.act(rows, width);
        if let (ActData::Cuda(b), false) = (&mut a.data, values.is_empty()) {
            if let Some(s) = b.slice.as_mut() {
                let r = self.stream.memcpy_htod(&values[..], &mut s.slice_mut(..values.len()));
                self.check("copying activations to the GPU", r);
                self.link.lock().expect("link counters").activation_bytes += 4 * values.len() as u64;
            }
        }
        a
    }

    fn zeros(&self, rows: usize, width: usize) -> Act {
        self.zeroed(rows, width)
    }

    fn copy(&self, x: &Act) -> Act {
        self.end_segment();
        let mut y = self.act(x.rows, x.width);
        if let (ActData::Cuda(src), ActData::Cuda(dst)) = (&x.data, &mut y.data) {
            if let (Some(s), Some(d)) = (src.slice.as_ref(), dst.slice.as_mut()) {
                let r = self.stream.memcpy_dtod(s, d);
                self.check("copying on the GPU", r);
            }
        }
        y
    }

    fn to_host<'a>(&self, a: &'a Act) -> Cow<'a, [f32]> {
        self.end_segment();
        let len = a.rows * a.width;
        let mut out = vec![0f32; len];
        if let ActData::Cuda(b) = &a.data {
            if let (Some(s), false, true) = (b.slice.as_ref(), self.failed(), len > 0) {
                let r = self.stream.memcpy_dtoh(&s.slice(..len), &mut out[..]);
                self.check("copying activations to the host", r);
                let waited = self.launched.swap(false, std::sync::atomic::Ordering::Relaxed);
                let mut link = self.link.lock().expect("link counters");
                link.to_host_bytes += (len * 4) as u64;
                link.host_waits += waited as u64;
            }
        }
        Cow::Owned(out)
    }

    fn download(&self, a: Act) -> Vec<f32> {
        self.to_host(&a).into_owned()
    }

    fn embed(&self, w: &Weight, ids: &[u32], scale: f32) -> Act {
        let out = self.act(ids.len(), w.cols);
        if ids.is_empty() {
            return out;
        }
        if let Some(wd) = self.weight(w) {
            let wp = wd.ptr;
            let idx = self.indices(ids);
            let cfg = LaunchConfig {
                grid_dim: (ids.len() as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            self.k().embed(
                w.ty,
                cfg,
                wp,
                w.row_stride_bytes as u64,
                idx,
                w.cols,
                scale,
                self.buf(&out),
            );
        }
        out
    }

    fn rms_norm(&self, x: &Act, w: &[f32], eps: f32) -> Act {
        let mut y = self.act(x.rows, x.width);
        let blocks = self.fused_blocks(x.rows, x.width);
        self.rms_norm_into(x, w, eps, &y, Self::blocks_ptr(&blocks));
        Self::attach_blocks(&mut y, blocks);
        y
    }

    fn rms_norm_in_place(&self, x: &mut Act, w: &[f32], eps: f32) {
        // The blocks `x` had are replaced below (by new ones or none).
        let blocks = self.fused_blocks(x.rows, x.width);
        self.rms_norm_into(&*x, w, eps, &*x, Self::blocks_ptr(&blocks));
        Self::attach_blocks(x, blocks);
    }

    fn add(&self, x: &mut Act, y: &Act) {
        let len = x.rows * x.width;
        self.k()
            .add(elementwise_cfg(len), self.buf_mut(x), self.buf(y), len as u64);
    }

    fn add_bias(&self, x: &mut Act, b: &[f32]) {
        let len = x.rows * x.width;
        let bp = self.vector(b);
        self.k()
            .add_bias(elementwise_cfg(len), self.buf_mut(x), bp, b.len(), len as u64);
    }

    fn activate_mul(&self, up: &mut Act, gate: &mut Act, f: FfnActivation) {
        let len = up.rows * up.width;
        if gate.rows * gate.width != len {
            self.fail(format!(
                "activate_mul: {len} values times a gate of {}",
                gate.rows * gate.width
            ));
            return;
        }
        let (u, g) = (self.buf_mut(up), self.buf(gate));
        if let Some(blocks) = self.fused_blocks(up.rows, up.width) {
            let n = up.rows * up.width / 256;
            if up.rows <= I8N_MAX.min(MATMUL_WARPS as usize)
                && self.activation_after_products(g, u, activation_code(f), blocks.ptr, up.width / 256, up.rows)
            {
                Self::attach_blocks(up, Some(blocks));
                return;
            }
            let cfg = LaunchConfig {
                grid_dim: (n as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            self.k()
                .activate_mul_q8_k(cfg, u, g, activation_code(f), blocks.ptr, n as u64);
            Self::attach_blocks(up, Some(blocks));
            return;
        }
        self.k()
            .activate_mul(elementwise_cfg(len), u, g, activation_code(f), len as u64);
    }

    fn add_rms_norm(&self, x: &mut Act, y: &Act, w: &[f32], eps: f32) -> Act {
        let mut out = self.act(x.rows, x.width);
        if x.rows == 0 {
            return out;
        }
        if (y.rows, y.width) != (x.rows, x.width) || w.len() != x.width {
            self.fail(format!(
                "add_rms_norm: [{}, {}] plus [{}, {}], a norm of {}",
                x.rows,
                x.width,
                y.rows,
                y.width,
                w.len()
            ));
            return out;
        }
        let wp = self.vector(w);
        let cfg = norm_cfg(x.rows, x.width);
        let blocks = self.fused_blocks(x.rows, x.width);
        if x.rows <= I8N_MAX.min(MATMUL_WARPS as usize) && self.fuse() {
            let (res, a, y) = (self.buf_mut(x), self.buf(y), self.buf(&out));
            if self.norm_after_product(a, res, wp, y, (x.rows, x.width), eps, Self::blocks_ptr(&blocks)) {
                Self::attach_blocks(&mut out, blocks);
                return out;
            }
        }
        self.k().add_rms_norm(
            cfg,
            self.buf_mut(x),
            self.buf(y),
            wp,
            self.buf(&out),
            x.width,
            eps,
            Self::blocks_ptr(&blocks),
        );
        Self::attach_blocks(&mut out, blocks);
        out
    }

    fn mul(&self, x: &mut Act, y: &Act) {
        let len = x.rows * x.width;
        self.k()
            .mul(elementwise_cfg(len), self.buf_mut(x), self.buf(y), len as u64);
    }

    fn activate(&self, x: &mut Act, f: FfnActivation) {
        let len = x.rows * x.width;
        self.k()
            .activate(elementwise_cfg(len), self.buf_mut(x), activation_code(f), len as u64);
    }

    fn softcap(&self, x: &mut Act, cap: f32) {
        let len = x.rows * x.width;
        self.k().softcap(elementwise_cfg(len), self.buf_mut(x), cap, len as u64);
    }

    fn argmax_rows(&self, x: &Act, banned: &[u32]) -> Vec<u32> {
        if x.rows == 0 || x.width == 0 {
            return vec![0; x.rows];
        }
        // One word a row, the kernel's u32 in an f32 buffer's bits.
        let out = self.argmax_launch(x, banned);
        self.to_host(&out).iter().map(|v| v.to_bits()).collect()
    }

    fn top_k_rows(&self, x: &Act, k: usize, banned: &[u32], lse: bool, greedy: bool) -> TopRows {
        assert!(
            (1..=TOP_K_THREADS as usize).contains(&k) && k <= x.width,
            "top_k_rows: k = {k} for rows of {}",
            x.width
        );
        if x.rows == 0 {
            return TopRows::default();
        }
        // The greedy tokens' kernel first, so one wait brings both results.
        let tokens = greedy.then(|| self.argmax_launch(x, banned));
        // Two words a candidate: the id (a u32 in an f32 buffer's bits), then the value; with
        // `lse`, two more a row: the f64's low word, then its high one.
        let width = 2 * k + if lse { 2 } else { 0 };
        let (cfg, idx, out) = self.pick_rows(TOP_K_THREADS, x, banned, width);
        self.k().top_k_rows(
            cfg,
            self.buf(x),
            x.width,
            idx,
            banned.len(),
            k,
            lse as usize,
            self.buf(&out),
        );
        let words = self.to_host(&out);
        let mut top = TopRows {
            pairs: Vec::with_capacity(x.rows * k),
            lse: Vec::with_capacity(if lse { x.rows } else { 0 }),
            tokens: tokens.map_or(Vec::new(), |t| self.to_host(&t).iter().map(|v| v.to_bits()).collect()),
        };
        for row in words.chunks_exact(width) {
            top.pairs
                .extend(row[..2 * k].chunks_exact(2).map(|c| (c[0].to_bits(), c[1])));
            if lse {
                let (lo, hi) = (row[2 * k].to_bits() as u64, row[2 * k + 1].to_bits() as u64);
                top.lse.push(f64::from_bits(hi << 32 | lo));
            }
        }
        top
    }

    fn select_rows(&self, x: &Act, rows: &[usize]) -> Act {
        let out = self.act(rows.len(), x.width);
        if rows.is_empty() || x.width == 0 {
            return out;
        }
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.indices(&ids);
        let cfg = rows_cfg(x.width, rows.len());
        self.k().select_rows(cfg, self.buf(x), idx, x.width, self.buf(&out));
        out
    }

    fn scatter_cols(&self, x: &Act, cols: &[u32], width: usize) -> Act {
        let out = self.zeroed(x.rows, width);
        if cols.is_empty() || x.rows == 0 {
            return out;
        }
        let idx = self.indices(cols);
        let cfg = rows_cfg(cols.len(), x.rows);
        self.k()
            .scatter_cols(cfg, self.buf(x), idx, cols.len(), width, self.buf(&out));
        out
    }

    fn gather_cols(&self, x: &Act, cols: &[u32]) -> Act {
        let out = self.act(x.rows, cols.len());
        if cols.is_empty() || x.rows == 0 {
            return out;
        }
        let idx = self.indices(cols);
        let cfg = rows_cfg(cols.len(), x.rows);
        self.k()
            .gather_cols(cfg, self.buf(x), idx, cols.len(), x.width, self.buf(&out));
        out
    }

    fn matmul(&self, ws: &[&Weight], x: &Act) -> Vec<Act> {
        self.matmul_with(ws, &[], x)
    }

    fn matmul_bias(&self, ws: &[&Weight], biases: &[Option<&[f32]>], x: &Act) -> Vec<Act> {
        self.matmul_with(ws, biases, x)
    }

    fn matmul_rows(&self, w: &Weight, rows: &[u32], x: &Act) -> Act {
        if let Some(path) = self.integer_path(w, x) {
            let (xq, _made) = self.int8_input(x, path == IntegerPath::Dots);
            return match path {
                IntegerPath::Dots => self.product_i8(w, Some(rows), None, xq, x.rows),
                IntegerPath::Tiles => self.product_mmq(w, Some(rows), xq, x.rows),
            };
        }
        let seen = self.activations_for(w.ty, x);
        self.product(w, Some(rows), seen.as_ref().unwrap_or(x), &mut None)
    }

    fn accumulate_rows(&self, w: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        self.accumulate(w, None, rows, acts, out)
    }

    fn accumulate_rows_joined(&self, head: &Weight, tail: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        if let Err(e) = crate::backend::joinable(head, tail) {
            self.fail(e.to_string());
            return;
        }
        self.accumulate(head, Some(tail), rows, acts, out)
    }

    fn rope_qk(
        &self,
        q: &mut Act,
        k: &mut Act,
        positions: &[usize],
        shape: RopeShape,
        q_norm: Option<&[f32]>,
        k_norm: Option<&[f32]>,
        eps: f32,
    ) {
        if positions.is_empty() || shape.head_dim == 0 {
            return;
        }
        self.launch_rope(q, k, positions, (shape, q_norm, k_norm, eps), None);
    }

    fn kv_write(
        &self,
        layer: usize,
        k: &Act,
        v: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &mut [&mut KvCache],
    ) {
        if positions.is_empty() {
            return;
        }
        for c in caches.iter_mut() {
            self.ensure_kv(c);
        }
        let info = self.token_kv(positions, seq_of_token, caches);
        let cfg = rows_cfg(k.width, positions.len());
        self.k().kv_write(cfg, self.buf(k), self.buf(v), info, layer, k.width);
    }

    fn rope_qk_kv_write(
        &self,
        layer: usize,
        q: &mut Act,
        k: &mut Act,
        v: &Act,
        at: (&[usize], &[usize]),
        caches: &mut [&mut KvCache],
        rope: (RopeShape, Option<&[f32]>, Option<&[f32]>, f32),
    ) {
        let (positions, seq_of_token) = at;
        let (shape, q_norm, k_norm, eps) = rope;
        let hd = shape.head_dim;
        let fits = hd > 0
            && q.width.is_multiple_of(hd)
            && k.width.is_multiple_of(hd)
            && (v.rows, v.width) == (k.rows, k.width)
            && q.rows == positions.len()
            && k.rows == positions.len();
        if !self.fuse() || !fits || positions.is_empty() {
            self.rope_qk(q, k, positions, shape, q_norm, k_norm, eps);
            self.kv_write(layer, k, v, positions, seq_of_token, caches);
            return;
        }
        for c in caches.iter_mut() {
            self.ensure_kv(c);
        }
        let info = self.token_kv(positions, seq_of_token, caches);
        self.launch_rope(q, k, positions, rope, Some((v, info, layer)));
    }

    fn attention(
        &self,
        q: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &[&mut KvCache],
        shape: AttnShape<'_>,
    ) -> Act {
        let mut out = self.act(q.rows, q.width);
        if positions.is_empty() {
            return out;
        }
        if shape.head_dim > ATTN_MAX_HEAD_DIM {
            self.fail(format!(
                "CUDA: attention supports heads of at most {ATTN_MAX_HEAD_DIM}, not {}",
                shape.head_dim
            ));
            return out;
        }
        if shape.sinks.is_some_and(|s| s.len() < shape.n_heads) {
            self.fail(format!(
                "CUDA: {} attention sinks for {} query heads",
                shape.sinks.map_or(0, |s| s.len()),
                shape.n_heads
            ));
            return out;
        }
        let sinks = shape.sinks.map_or(0, |s| self.vector(s));
        let info = self.token_kv(positions, seq_of_token, caches);
        // (fewer tokens than a run must average cannot make one: no tiles looked for)
        if self.attn_tiles() && shape.head_dim <= ATTN_TILE_MAX_HEAD_DIM && positions.len() >= ATTN_TILE_MIN_RUN {
            let tiles = attention_tiles(positions, seq_of_token);
            if positions.len() >= ATTN_TILE_MIN_RUN * tiles.len() {
                let flat: Vec<u32> = tiles.iter().flat_map(|&(t, n)| [t as u32, n as u32]).collect();
                let cfg = LaunchConfig {
                    grid_dim: (shape.n_heads as u32, tiles.len() as u32, 1),
                    block_dim: (ATTENTION_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                self.k().attention_tiles(
                    cfg,
                    self.buf(q),
                    info,
                    self.indices(&flat),
                    shape.layer,
                    shape.n_heads,
                    shape.n_kv_heads,
                    shape.head_dim,
                    shape.scale,
                    shape.window.unwrap_or(0),
                    sinks,
                    self.buf(&out),
                );
                return out;
            }
        }
        // Score rows (their length is only a stride to the kernel) and split attention's splits
        // sized by powers of two, so a decode step's buffers and parameters repeat for a CUDA graph.
        let max_len = attention_row(
            positions
                .iter()
                .map(|&p| shape.window.map_or(p + 1, |w| (p + 1).min(w)))
                .max()
                .unwrap_or(1),
        );
        let cfg = LaunchConfig {
            grid_dim: (shape.n_heads as u32, q.rows as u32, 1),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        if self.attn_split() {
            let splits = attention_splits(max_len, q.rows * shape.n_heads);
            let part = (splits > 1).then(|| self.act(q.rows * shape.n_heads * splits, shape.head_dim + 2));
            // Fused, the last split of each head merges (no launch of `attention_merge`), and
            // the output's Q8_K blocks for the integer product after it come with it.
            let heads = q.rows * shape.n_heads;
            let done = if splits > 1 && self.fuse() {
                self.counters(heads)
            } else {
                0
            };
            let groups = attention_q8_groups(shape.n_heads, shape.head_dim).map(|g| q.rows * g);
            let mut blocks = None;
            let mut q8done = 0;
            if let Some(groups) = groups.filter(|_| splits == 1 || done != 0) {
                // (after the merges' counters, when there are any)
                let before = if done != 0 { heads } else { 0 };
                let base = self.counters(before + groups);
                blocks = self.fused_blocks(q.rows, q.width).filter(|_| base != 0);
                q8done = base + 4 * before as u64;
            }
            self.k().attention_split(
                LaunchConfig {
                    grid_dim: (shape.n_heads as u32, q.rows as u32, splits as u32),
                    ..cfg
                },
                self.buf(q),
                info,
                shape.layer,
                shape.n_heads,
                shape.n_kv_heads,
                shape.head_dim,
                shape.scale,
                shape.window.unwrap_or(0),
                sinks,
                max_len / splits,
                part.as_ref().map_or(0, |p| self.buf(p)),
                done,
                self.buf(&out),
                Self::blocks_ptr(&blocks),
                if blocks.is_some() { q8done } else { 0 },
            );
            if done != 0 {
                self.fused_into_last_blocks();
            }
            if blocks.is_some() {
                self.fused_into_last_blocks();
                Self::attach_blocks(&mut out, blocks);
            }
            if let Some(part) = part.filter(|_| done == 0) {
                self.k().attention_merge(
                    cfg,
                    self.buf(&part),
                    shape.n_heads,
                    shape.head_dim,
                    splits,
                    sinks,
                    self.buf(&out),
                );
            }
            return out;
        }
        let scores = self.act(q.rows * shape.n_heads, max_len);
        self.k().attention(
            cfg,
            self.buf(q),
            info,
            shape.layer,
            shape.n_heads,
            shape.n_kv_heads,
            shape.head_dim,
            shape.scale,
            shape.window.unwrap_or(0),
            sinks,
            self.buf(&scores),
            max_len,
            self.buf(&out),
        );
        out
    }
}

impl CudaDevice {
    /// Device-to-device copy bandwidth over `bytes`-sized buffers, counting bytes read and
    /// written (the ceiling a memory-bound kernel reaches), in bytes per second.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64> {
        self.end_segment();
        let n = bytes / 4;
        let a = self.stream.alloc_zeros::<f32>(n).map_err(driver_err("allocating"))?;
        let mut b = self.stream.alloc_zeros::<f32>(n).map_err(driver_err("allocating"))?;
        self.stream.memcpy_dtod(&a, &mut b).map_err(driver_err("copying"))?;
        self.stream.synchronize().map_err(driver_err("synchronizing"))?;
        let reps = 20;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            self.stream.memcpy_dtod(&a, &mut b).map_err(driver_err("copying"))?;
        }
        self.stream.synchronize().map_err(driver_err("synchronizing"))?;
        Ok((2 * n * 4 * reps) as f64 / t.elapsed().as_secs_f64())
    }

    /// Queries and keys (`rope`: shape, per-head norms, eps) in one launch: `rope_norm`; with
    /// `kv` (the values, the tokens' KV words from [`Self::token_kv`], the layer) `rope_norm_kv`,
    /// which also writes the rotated keys and the values into the KV cache.
    pub(super) fn launch_rope(
        &self,
        q: &mut Act,
        k: &mut Act,
        positions: &[usize],
        rope: (RopeShape, Option<&[f32]>, Option<&[f32]>, f32),
        kv: Option<(&Act, u64, usize)>,
    ) {
        let (shape, q_norm, k_norm, eps) = rope;
        let hd = shape.head_dim;
        // Partial RoPE: the leading `rd` dimensions of each head rotate.
        let rd = shape.rope_dims.min(hd);
        let factors = shape.factors.map_or(0, |f| self.vector(f));
        if shape.factors.is_some_and(|f| f.len() < rd / 2) {
            self.fail(format!(
                "CUDA: {} RoPE frequency factors for {rd} rotated dimensions (need {})",
                shape.factors.map_or(0, |f| f.len()),
                rd / 2
            ));
            return;
        }
        let pos: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let pp = self.indices(&pos);
        let style = match shape.style {
            RopeStyle::AdjacentPairs => 0,
            RopeStyle::HalfSplit => 1,
        };
        let (qn, kn) = (
            q_norm.map_or(0, |n| self.vector(n)),
            k_norm.map_or(0, |n| self.vector(n)),
        );
        // Query heads, key heads, then (writing the cache) as many value heads.
        let value_heads = kv.map_or(0, |_| k.width / hd);
        let cfg = LaunchConfig {
            grid_dim: (
                (q.width / hd + k.width / hd + value_heads) as u32,
                positions.len() as u32,
                1,
            ),
            block_dim: (rope_threads(hd), 1, 1),
            shared_mem_bytes: 0,
        };
        let (qp, kp) = (self.buf_mut(q), self.buf_mut(k));
        let (qw, kw, base, pos_scale) = (q.width, k.width, shape.base, shape.pos_scale);
        if let Some((v, info, layer)) =
            kv.filter(|_| positions.len() <= I8N_MAX.min(MATMUL_WARPS as usize) && self.fuse())
        {
            let rope = RopeArgs {
                q_norm: qn,
                k_norm: kn,
                hd,
                rd,
                positions: pp,
                base,
                pos_scale,
                style,
                factors,
                eps,
                info,
                layer,
            };
            if self.rope_after_products([qp, kp, self.buf(v)], [qw, kw], positions.len(), rope) {
                return;
            }
        }
        match kv {
            Some((v, info, layer)) => self.k().rope_norm_kv(
                cfg,
                qp,
                qw,
                qn,
                kp,
                kw,
                kn,
                hd,
                rd,
                pp,
                base,
                pos_scale,
                style,
                factors,
                eps,
                self.buf(v),
                info,
                layer,
            ),
            None => self.k().rope_norm(
                cfg, qp, qw, qn, kp, kw, kn, hd, rd, pp, base, pos_scale, style, factors, eps,
            ),
        }
    }

    /// RMSNorm of `x` into `y` (which may be `x`: the caller drops its blocks first), and into
    /// Q8_K blocks at `blocks` unless 0 ([`Self::fused_blocks`]).
    pub(super) fn rms_norm_into(&self, x: &Act, w: &[f32], eps: f32, y: &Act, blocks: u64) {
        if x.rows == 0 {
            return;
        }
        let wp = self.vector(w);
        let cfg = norm_cfg(x.rows, x.width);
        self.k()
            .rms_norm(cfg, self.buf(x), wp, self.buf(y), x.width, eps, blocks);
    }

    /// `x · w_i` (+ `biases[i]` where given) for each weight: the integer products of one
    /// type in launches of up to three weights (the input quantized once), the others one by one.
    pub(super) fn matmul_with(&self, ws: &[&Weight], biases: &[Option<&[f32]>], x: &Act) -> Vec<Act> {
        let bias = |i: usize| biases.get(i).copied().flatten();
        let mut out: Vec<Option<Act>> = ws.iter().map(|_| None).collect();
        let paths: Vec<Option<IntegerPath>> = ws.iter().map(|w| self.integer_path(w, x)).collect();
        let on = |path: IntegerPath| -> Vec<usize> { (0..ws.len()).filter(|&i| paths[i] == Some(path)).collect() };
        let int8 = on(IntegerPath::Dots);
        if !int8.is_empty() {
            let (xq, _made) = self.int8_input(x, int8.len() == 1);
            // Up to three weights a launch, of one type or not (Q4_K_M's Q and K with a Q6_K
            // V), each reading its rows once for every token.
            for group in int8.chunks(3) {
                let items: Vec<(&Weight, Option<&[f32]>)> = group.iter().map(|&i| (ws[i], bias(i))).collect();
                for (&i, o) in group.iter().zip(self.products_i8(&items, xq, x.rows)) {
                    out[i] = Some(o);
                }
            }
        }
        // Wider batches of the same types as integer tiles, on the input's Q8_K blocks made once.
        let tiles = on(IntegerPath::Tiles);
        if !tiles.is_empty() {
            let (xq, _made) = self.int8_input(x, false);
            for i in tiles {
                let mut o = self.product_mmq(ws[i], None, xq, x.rows);
                if let Some(b) = bias(i) {
                    self.add_bias(&mut o, b);
                }
                out[i] = Some(o);
            }
        }
        // The input as each other weight type's products see it, made once per format (and as
        // the tensor cores take it, once when a product there needs it).
        // (format, the input in it when not `x` itself, the tensor cores' split of it)
        type Seen = ((ActivationFormat, bool), Option<Act>, Option<Act>);
        let mut seen: Vec<Seen> = Vec::new();
        for (i, w) in ws.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let format = (ActivationFormat::for_weights(w.ty), self.quantizes_activations(w.ty));
            let f = match seen.iter().position(|(f, _, _)| *f == format) {
                Some(f) => f,
                None => {
                    seen.push((format, self.activations_for(w.ty, x), None));
                    seen.len() - 1
                }
            };
            let (_, input, f16) = &mut seen[f];
            let mut o = self.product(w, None, input.as_ref().unwrap_or(x), f16);
            if let Some(b) = bias(i) {
                self.add_bias(&mut o, b);
            }
            out[i] = Some(o);
        }
        out.into_iter().map(|o| o.expect("every product made")).collect()
    }

    /// The launch recorded last, taken back (not to be launched) when `read` makes something of
    /// its kernel, weight type and arguments (its record, matched: see [`FUSE_ENV`]): its
    /// geometry and what `read` made of it.
    fn take_back<R>(
        &self,
        read: impl FnOnce(&'static str, Option<GgmlType>, &[Arg]) -> Option<R>,
    ) -> Option<(LaunchConfig, R)> {
        let (op, r) = self.graphs.lock().expect("graphs").take_last_launch(read)?;
        let graph::Op::Launch { grid, block, .. } = op else {
            return None;
        };
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: block,
            shared_mem_bytes: 0,
        };
        Some((cfg, r))
    }

    /// Counts a launch whose last blocks took on the next one's work.
    fn fused_into_last_blocks(&self) {
        self.last_block_fusions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// `rope_norm_kv` of one token's query, key and value rows `qkv` (widths `widths` of the
    /// first two) in the last blocks of the product that wrote them, when that is one launch of
    /// the three integer products (`matvec_i8x3`, `matvec_i8x3_mixed`) and the operation recorded
    /// last (see [`FUSE_ENV`]): it is taken back and recorded again as `matvec_i8x3_rope_kv`.
    /// False (nothing done) otherwise.
    fn rope_after_products(&self, qkv: [u64; 3], widths: [usize; 2], tokens: usize, r: RopeArgs) -> bool {
        let vt = rope_threads(r.hd) as usize;
        let heads = (widths[0] + 2 * widths[1]) / r.hd.max(1);
        let done = self.counters(heads);
        if done == 0 || vt > 32 * MATMUL_WARPS as usize {
            return false;
        }
        if tokens > 1 {
            return self.batch_rope_after_products(qkv, widths, tokens, r, vt, done);
        }
        let Some((cfg, p)) = self.take_back(|name, ty, args| {
            let p = match name {
                "matvec_i8x3" => params::matvec_i8x3::from_args(args)?.mixed(i8_type_code(ty?)),
                "matvec_i8x3_mixed" => params::matvec_i8x3_mixed::from_args(args)?,
                _ => return None,
            };
            let rows = MATMUL_WARPS as usize / p.wpr.max(1);
            let wanted = p.wpr > 0 && r.hd.is_multiple_of(rows) && [p.y0, p.y1, p.y2] == qkv && [p.r0, p.r1] == widths;
            wanted.then_some(p)
        }) else {
            return false;
        };
        record!(matvec_i8x3_rope_kv
            from p: xq, cols, wpr, nb0, nb01, t0, w0, s0, r0, b0, y0, t1, w1, s1, r1, b1, y1, t2, w2, s2, r2, b2, y2;
            from r: q_norm, k_norm, hd, rd, positions, base, pos_scale, style, factors, eps, info, layer;
            set vt: vt, done: done)
        .launch(&self.k(), cfg);
        self.fused_into_last_blocks();
        true
    }

    /// The batch form of [`Self::rope_after_products`]: `matvec_i8nx3` of `tokens` tokens' Q, K
    /// and V taken back and recorded again as `matvec_i8nx3_rope_kv`.
    fn batch_rope_after_products(
        &self,
        qkv: [u64; 3],
        widths: [usize; 2],
        tokens: usize,
        r: RopeArgs,
        vt: usize,
        done: u64,
    ) -> bool {
        let Some((cfg, p)) = self.take_back(|name, _, args| {
            let p = params::matvec_i8nx3::from_args(args).filter(|_| name == "matvec_i8nx3")?;
            let rows = MATMUL_WARPS as usize / p.wpr.max(1);
            let wanted = p.wpr > 0
                && r.hd.is_multiple_of(rows)
                && p.n == tokens
                && [p.y0, p.y1, p.y2] == qkv
                && [p.r0, p.r1] == widths;
            wanted.then_some(p)
        }) else {
            return false;
        };
        record!(matvec_i8nx3_rope_kv
            from p: xq, n, cols, wpr, nb0, nb01, t0, w0, s0, r0, b0, y0, t1, w1, s1, r1, b1, y1, t2, w2, s2, r2, b2, y2;
            from r: q_norm, k_norm, hd, rd, positions, base, pos_scale, style, factors, eps, info, layer;
            set vt: vt, done: done)
        .launch(&self.k(), cfg);
        self.fused_into_last_blocks();
        true
    }

    /// `activate_mul_q8_k` of `tokens` tokens' `gate` and `up` (`n` Q8_K blocks a token into
    /// `out`) in the last blocks of the products that wrote them, when those are one launch of
    /// two integer products (gate, then up: `matvec_i8x3` for a token, `matvec_i8nx3` for a
    /// batch) and the operation recorded last (see [`FUSE_ENV`]): it is taken back and recorded
    /// again as `matvec_i8x3_act` / `matvec_i8nx3_act`. False (nothing done) otherwise.
    fn activation_after_products(&self, gate: u64, up: u64, f: usize, out: u64, n: usize, tokens: usize) -> bool {
        let done = self.counters(n);
        if done == 0 {
            return false;
        }
        if tokens > 1 {
            return self.batch_activation_after_products(gate, up, f, out, n, tokens, done);
        }
        let Some((cfg, (ty, p))) = self.take_back(|name, ty, args| {
            let p = params::matvec_i8x3::from_args(args).filter(|_| name == "matvec_i8x3")?;
            let wanted = [p.y0, p.y1, p.w2] == [gate, up, 0] && [p.r0, p.r1] == [256 * n; 2];
            wanted.then_some((ty?, p))
        }) else {
            return false;
        };
        record!(matvec_i8x3_act
            from p: xq, cols, wpr, nb0, nb01, w0, s0, r0, b0, y0, w1, s1, r1, b1, y1, w2, s2, r2, b2, y2;
            set f: f, out: out, done: done)
        .launch(&self.k(), ty, cfg);
        self.fused_into_last_blocks();
        true
    }

    /// The batch form of [`Self::activation_after_products`]: `matvec_i8nx3` of `tokens` tokens
    /// taken back and recorded again as `matvec_i8nx3_act`.
    #[allow(clippy::too_many_arguments)]
    fn batch_activation_after_products(
        &self,
        gate: u64,
        up: u64,
        f: usize,
        out: u64,
        n: usize,
        tokens: usize,
        done: u64,
    ) -> bool {
        let Some((cfg, p)) = self.take_back(|name, _, args| {
            let p = params::matvec_i8nx3::from_args(args).filter(|_| name == "matvec_i8nx3")?;
            let wanted = p.n == tokens && [p.y0, p.y1, p.w2] == [gate, up, 0] && [p.r0, p.r1] == [256 * n; 2];
            wanted.then_some(p)
        }) else {
            return false;
        };
        record!(matvec_i8nx3_act
            from p: xq, n, cols, wpr, nb0, nb01, t0, w0, s0, r0, b0, y0, t1, w1, s1, r1, b1, y1, t2, w2, s2, r2, b2, y2;
            set f: f, out: out, done: done)
        .launch(&self.k(), cfg);
        self.fused_into_last_blocks();
        true
    }

    /// `add_rms_norm` of `rows.0` rows of `rows.1` (`res += a`, then `y` and its blocks `q8`) in
    /// the last block of the product that wrote `a`, when that product is an integer product of
    /// those rows (one token, or a batch of up to a block's warps) and the operation recorded last
    /// (see [`FUSE_ENV`]): it is taken back and recorded again with the norm after it
    /// (`matvec_i8_norm`, `matvec_i8f_norm`, `matvec_i8n_norm`). False (nothing done) otherwise.
    #[allow(clippy::too_many_arguments)]
    fn norm_after_product(&self, a: u64, res: u64, w: u64, y: u64, rows: (usize, usize), eps: f32, q8: u64) -> bool {
        let (n, width) = rows;
        let done = self.counters(1);
        if done == 0 {
            return false;
        }
        let Some((cfg, (name, ty, p))) = self.take_back(|name, ty, args| {
            let kernel = match n {
                1 => matches!(name, "matvec_i8" | "matvec_i8f"),
                _ => name == "matvec_i8n",
            };
            let p = params::product_i8::from_args(args).filter(|p| kernel && p.n == n && p.y == a)?;
            Some((name, ty?, p))
        }) else {
            return false;
        };
        let vt = norm_threads(width) as usize;
        macro_rules! fused {
            ($to:ident) => {
                record!($to
                    from p: w, row_stride, rows_out, row_ids, cols, x, n, bias, wpr, y;
                    set res: res, nw: w, out: y, eps: eps, q8: q8, vt: vt, done: done)
            };
        }
        let k = self.k();
        match name {
            "matvec_i8n" => fused!(matvec_i8n_norm).launch(&k, ty, cfg),
            "matvec_i8" => fused!(product_i8_norm).launch(&k, "matvec_i8_norm", ty, cfg),
            _ => fused!(product_i8_norm).launch(&k, "matvec_i8f_norm", ty, cfg),
        }
        self.fused_into_last_blocks();
        true
    }

    /// `x · w[rows]` (all rows when `None`; + `bias` when given) for `n` tokens `x` given as
    /// Q8_K blocks, or one token's values the kernel quantizes ([`CudaDevice::int8_input`]), with
    /// integer dot products: one token by `matvec_i8*`, a batch by `matvec_i8n` (each token's
    /// sums and their order as alone).
    pub(super) fn product_i8(
        &self,
        w: &Weight,
        rows: Option<&[u32]>,
        bias: Option<&[f32]>,
        input: Int8Input,
        n: usize,
    ) -> Act {
        let rows_out = rows.map_or(w.rows, |r| r.len());
        let out = self.act(n, rows_out);
        if rows_out == 0 {
            return out;
        }
        let Some(wd) = self.weight(w) else { return out };
        let idx = rows.map_or(0, |r| self.indices(r));
        let bp = bias.map_or(0, |b| self.vector(b));
        let wpr = self.i8_wpr(w.cols);
        let cfg = LaunchConfig {
            grid_dim: (i8_blocks(&[rows_out], wpr)[0].max(1), 1, 1),
            block_dim: (32, MATMUL_WARPS, 1),
            shared_mem_bytes: 0,
        };
        let (kernel, xq) = match input {
            Int8Input::Blocks(p) if n > 1 => ("matvec_i8n", p),
            Int8Input::Values(_) if n > 1 => unreachable!("a batch's input is blocks"),
            Int8Input::Blocks(p) => ("matvec_i8", p),
            Int8Input::Values(p) => ("matvec_i8f", p),
        };
        self.k().product_i8(
            kernel,
            w.ty,
            cfg,
            wd.ptr,
            w.row_stride_bytes as u64,
            rows_out,
            idx,
            w.cols,
            xq,
            n,
            bp,
            wpr,
            self.buf(&out),
        );
        out
    }

    /// `x · w[rows]` (all rows when `None`) for `n` tokens `x` given as Q8_K blocks, as integer
    /// tiles on the tensor cores (`mmq_*`); a split product sums its parts into a buffer of its
    /// own, then adds them in order onto zeros (`accumulate_reduce`).
    pub(super) fn product_mmq(&self, w: &Weight, rows: Option<&[u32]>, input: Int8Input, n: usize) -> Act {
        let rows_out = rows.map_or(w.rows, |r| r.len());
        let Int8Input::Blocks(xq) = input else {
            unreachable!("integer tiles take the input as blocks")
        };
        let out = self.act(n, rows_out);
        if rows_out == 0 || n == 0 {
            return out;
        }
        let Some(wd) = self.weight(w) else { return out };
        let cfg = mmq_cfg(rows_out, n, w.cols);
        let (mut out, partial) = self.parts_target(out, cfg.grid_dim.2 as usize);
        let idx = rows.map_or(0, |r| self.indices(r));
        self.k().mmq(
            if self.mmq_prefetch() { "mmq" } else { "mmq_plain" },
            w.ty,
            cfg,
            wd.ptr,
            w.row_stride_bytes as u64,
            rows_out,
            idx,
            w.cols,
            xq,
            n,
            self.buf(partial.as_ref().unwrap_or(&out)),
        );
        self.reduce_parts(partial, &mut out);
        out
    }

    /// Where a product launched in `parts` parts writes: its output `out` itself for one part;
    /// for several, an output of zeros in its place and a buffer of the parts' sums.
    fn parts_target(&self, out: Act, parts: usize) -> (Act, Option<Act>) {
        if parts > 1 {
            let (n, rows_out) = (out.rows, out.width);
            (self.zeroed(n, rows_out), Some(self.act(parts * n, rows_out)))
        } else {
            (out, None)
        }
    }

    /// Adds the parts' sums `partial` (`parts` × `out`'s rows: from [`Self::parts_target`], or
    /// `accumulate_rows`'s partitions) onto `out`, in order.
    pub(super) fn reduce_parts(&self, partial: Option<Act>, out: &mut Act) {
        if let Some(partial) = partial {
            let len = out.rows * out.width;
            let parts = partial.rows / out.rows;
            self.k().accumulate_reduce(
                elementwise_cfg(len),
                self.buf(&partial),
                parts,
                len as u64,
                self.buf_mut(out),
            );
        }
    }

    /// Several weights with integer products (at most three, the same columns) times the same
    /// input of `n` tokens in one launch: one token by `matvec_i8x3_*` (`matvec_i8x3_mixed` for
    /// weights of different types), a batch by `matvec_i8nx3`; one weight alone as
    /// [`Self::product_i8`].
    pub(super) fn products_i8(&self, items: &[(&Weight, Option<&[f32]>)], input: Int8Input, n: usize) -> Vec<Act> {
        if let [(w, b)] = items {
            return vec![self.product_i8(w, None, *b, input, n)];
        }
        let Int8Input::Blocks(xq) = input else {
            unreachable!("several products take the input as blocks")
        };
        assert!(items.len() <= 3 && items.windows(2).all(|p| p[0].0.cols == p[1].0.cols));
        let mixed = items.windows(2).any(|p| p[0].0.ty != p[1].0.ty);
        let outs: Vec<Act> = items.iter().map(|(w, _)| self.act(n, w.rows)).collect();
        // Each weight's device copy (a streamed weight's lives only as long as this) is kept
        // until the launch.
        let mut segs = Vec::new();
        let mut on_device = Vec::new();
        for (w, b) in items {
            let Some(wd) = self.weight(w) else { return outs };
            segs.push((
                wd.ptr,
                w.row_stride_bytes as u64,
                w.rows,
                b.map_or(0, |b| self.vector(b)),
            ));
            on_device.push(wd);
        }
        let (ty, cols) = (items[0].0.ty, items[0].0.cols);
        let wpr = self.i8_wpr(cols);
        let mut rows: Vec<usize> = segs.iter().map(|s| s.2).collect();
        rows.resize(3, 0);
        let nb = i8_blocks(&rows, wpr);
        let total = nb.iter().sum::<u32>();
        if total == 0 {
            return outs;
        }
        // Each segment's weight, stride, rows, bias and output (all 0 for an absent one).
        let seg = |i: usize| match (segs.get(i), outs.get(i)) {
            (Some(&(wp, stride, r, bp)), Some(o)) => (wp, stride, r, bp, self.buf(o)),
            _ => (0, 0, 0, 0, 0),
        };
        let (s0, s1, s2) = (seg(0), seg(1), seg(2));
        let cfg = LaunchConfig {
            grid_dim: (total, 1, 1),
            block_dim: (32, MATMUL_WARPS, 1),
            shared_mem_bytes: 0,
        };
        let code = |i: usize| items.get(i).map_or(0, |(w, _)| i8_type_code(w.ty));
        if n > 1 {
            self.k().matvec_i8nx3(
                cfg,
                xq,
                n,
                cols,
                wpr,
                nb[0] as usize,
                (nb[0] + nb[1]) as usize,
                code(0),
                s0.0,
                s0.1,
                s0.2,
                s0.3,
                s0.4,
                code(1),
                s1.0,
                s1.1,
                s1.2,
                s1.3,
                s1.4,
                code(2),
                s2.0,
                s2.1,
                s2.2,
                s2.3,
                s2.4,
            );
            drop(on_device);
            return outs;
        }
        if mixed {
            self.k().matvec_i8x3_mixed(
                cfg,
                xq,
                cols,
                wpr,
                nb[0] as usize,
                (nb[0] + nb[1]) as usize,
                code(0),
                s0.0,
                s0.1,
                s0.2,
                s0.3,
                s0.4,
                code(1),
                s1.0,
                s1.1,
                s1.2,
                s1.3,
                s1.4,
                code(2),
                s2.0,
                s2.1,
                s2.2,
                s2.3,
                s2.4,
            );
            drop(on_device);
            return outs;
        }
        self.k().matvec_i8x3(
            ty,
            cfg,
            xq,
            cols,
            wpr,
            nb[0] as usize,
            (nb[0] + nb[1]) as usize,
            s0.0,
            s0.1,
            s0.2,
            s0.3,
            s0.4,
            s1.0,
            s1.1,
            s1.2,
            s1.3,
            s1.4,
            s2.0,
            s2.1,
            s2.2,
            s2.3,
            s2.4,
        );
        drop(on_device);
        outs
    }

    /// `x · w[rows]` (all rows when `None`). `f16`: `x` as the tensor cores take it
    /// ([`CudaDevice::f16_input`]), made here the first time a product of `x` needs it.
    pub(super) fn product(&self, w: &Weight, rows: Option<&[u32]>, x: &Act, f16: &mut Option<Act>) -> Act {
        let rows_out = rows.map_or(w.rows, |r| r.len());
        let mut out = self.act(x.rows, rows_out);
        if x.rows == 0 || rows_out == 0 {
            return out;
        }
        if x.width != w.cols {
            self.fail(format!("{}: {} columns times an input of {}", w.name, w.cols, x.width));
            return out;
        }
        let Some(wd) = self.weight(w) else { return out };
        let wp = wd.ptr;
        let idx = rows.map_or(0, |r| self.indices(r));
        // Several tokens of a block-quantized type: the tensor cores, on the input as two f16
        // a value (a split product sums its parts into a buffer of its own, then adds them in
        // order onto zeros: `accumulate_reduce`). Otherwise a single-token kernel for one token
        // (fewer registers), the FMA loops for several.
        let mut partial = None;
        let (kernel, cfg, input, target) = if self.mma_product(w, x) {
            let cfg = mma_cfg(rows_out, x.rows, w.cols);
            let input = match f16 {
                Some(xh) => self.buf(xh),
                None => self.buf(f16.insert(self.f16_input(x))),
            };
            (out, partial) = self.parts_target(out, cfg.grid_dim.2 as usize);
            ("mma", cfg, input, self.buf(partial.as_ref().unwrap_or(&out)))
        } else {
            let (kernel, cfg) = match (x.rows, self.matvec_rows()) {
                (1, 4) => ("matvec4", matvec_cfg(rows_out, 4)),
                (1, 2) => ("matvec2", matvec_cfg(rows_out, 2)),
                (1, _) => ("matvec", matvec_cfg(rows_out, 1)),
                _ => ("matmul", matmul_cfg(rows_out, x.rows)),
            };
            (kernel, cfg, self.buf(x), self.buf(&out))
        };
        self.k().product(
            kernel,
            w.ty,
            cfg,
            wp,
            w.row_stride_bytes as u64,
            rows_out,
            idx,
            w.cols,
            input,
            x.rows,
            target,
        );
        self.reduce_parts(partial, &mut out);
        out
    }
}

/// What `rope_norm_kv` takes besides its rows (see [`CudaDevice::launch_rope`]): the norms (0:
/// none), the head size and its rotated dimensions, the positions' device list, the rotation (its
/// frequency factors' device vector, 0: none), the KV cache's token words and layer.
#[derive(Clone, Copy)]
struct RopeArgs {
    q_norm: u64,
    k_norm: u64,
    hd: usize,
    rd: usize,
    positions: u64,
    base: f32,
    pos_scale: f32,
    style: usize,
    factors: u64,
    eps: f32,
    info: u64,
    layer: usize,
}

impl params::matvec_i8x3 {
    /// The same products as `matvec_i8x3_mixed`'s record: each weight's type `code`
    /// ([`i8_type_code`]) with its parameters.
    fn mixed(&self, code: usize) -> params::matvec_i8x3_mixed {
        let p = *self;
        record!(matvec_i8x3_mixed
            from p: xq, cols, wpr, nb0, nb01, w0, s0, r0, b0, y0, w1, s1, r1, b1, y1, w2, s2, r2, b2, y2;
            set t0: code, t1: code, t2: code)
    }
}
