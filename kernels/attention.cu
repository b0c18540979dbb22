// The KV cache in device memory and attention over it. A sequence's cache is two allocations
// (keys, values), each [layer][capacity][kv_dim] f32. Every token of a batch carries four u64s:
// its sequence's key and value base addresses, its position and the cache's capacity, so one
// launch serves a batch of several sequences. A latent-attention cache (DeepSeek-V2/V3, Kimi-K2:
// one latent and its rotated part a position) is the keys alone: its value base is its key base,
// so attention reads each value as its key's first numbers (the same row stride), and a write
// of values there writes nothing (`latent`).

// The widest head: DeepSeek's latent heads are 576 (a latent of 512 and a rotated part of 64).
#define ATTN_MAX_HEAD_DIM 576

struct TokenKv {
    u64 k, v, pos, cap;
};

// Whether the token's cache holds no values of its own (latent attention: they are its keys).
__device__ __forceinline__ bool latent(const TokenKv& ti) { return ti.v == ti.k; }

// Row t of k and v into its sequence's cache at its position, layer `layer` (v not, latent).
extern "C" __global__ void kv_write(const float* k, const float* v, const TokenKv* info, int layer, int kvd) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= kvd) return;
    int t = blockIdx.y;
    TokenKv ti = info[t];
    u64 at = ((u64)layer * ti.cap + ti.pos) * kvd + c;
    ((float*)ti.k)[at] = k[(u64)t * kvd + c];
    if (!latent(ti)) ((float*)ti.v)[at] = v[(u64)t * kvd + c];
}

// Block `h` of `rope_norm_kv` for token t, run by a block of at least `vt` threads
// (`rope_head`); WARP: by one warp of a block, as that block would (`rope_head_warp`).
template <bool WARP = false>
__device__ void rope_kv_head(int h, int t, float* q, int q_width, const float* q_norm, float* k, int k_width,
                             const float* k_norm, int hd, int rd, const u32* positions, float base,
                             float pos_scale, int style, const float* factors, float eps, const float* v,
                             const TokenKv* info, int layer, int vt) {
    int q_heads = q_width / hd, kv_heads = k_width / hd;
    int tid = WARP ? threadIdx.x & 31 : threadIdx.x + blockDim.x * threadIdx.y;
    int threads = WARP ? 32 : blockDim.x * blockDim.y;
    auto rope = [&](float* head) {
        if (WARP)
            rope_head_warp(head, h < q_heads ? q_norm : k_norm, hd, rd, positions[t], base, pos_scale, style, factors,
                           eps, vt, tid);
        else
            rope_head(head, h < q_heads ? q_norm : k_norm, hd, rd, positions[t], base, pos_scale, style, factors, eps,
                      vt);
    };
    if (h < q_heads) {
        rope(q + (u64)t * q_width + (u64)h * hd);
        return;
    }
    TokenKv ti = info[t];
    u64 at = ((u64)layer * ti.cap + ti.pos) * k_width;
    if (h < q_heads + kv_heads) {
        int head = h - q_heads;
        float* kh = k + (u64)t * k_width + (u64)head * hd;
        rope(kh);
        if (!WARP) __syncthreads();  // (rope_head_warp ends with its warp's barrier)
        for (int j = tid; j < hd; j += threads) ((float*)ti.k)[at + (u64)head * hd + j] = kh[j];
        return;
    }
    if (latent(ti)) return;  // (no values: the rotated keys written above are them)
    int head = h - q_heads - kv_heads;
    const float* vh = v + (u64)t * k_width + (u64)head * hd;
    for (int j = tid; j < hd; j += threads) ((float*)ti.v)[at + (u64)head * hd + j] = __ldcg(vh + j);
}

// `rope_norm`, then `kv_write` of its keys and `v`, in one launch (the same values): blocks past
// the query and key heads copy the value heads (as many as the key heads) into the cache (into
// a latent cache none); each key head is copied there once rotated. positions[t] is token t's
// position in `info`.
extern "C" __global__ void rope_norm_kv(float* q, int q_width, const float* q_norm, float* k, int k_width,
                                        const float* k_norm, int hd, int rd, const u32* positions, float base,
                                        float pos_scale, int style, const float* factors, float eps, const float* v,
                                        const TokenKv* info, int layer) {
    rope_kv_head(blockIdx.x, blockIdx.y, q, q_width, q_norm, k, k_width, k_norm, hd, rd, positions, base, pos_scale,
                 style, factors, eps, v, info, layer, blockDim.x);
}

// The Q, K and V products of n tokens (BATCH: `matvec_i8nx3`'s, n up to the block's warps; else
// one token's, `matvec_i8x3_mixed`'s; `t0` .. `t2` each weight's type), then `rope_norm_kv` of
// their outputs without a launch of its own: the product blocks writing a head's rows (a
// block's rows never straddle two heads: hd a multiple of them) count at done[h] (h as
// `rope_norm_kv`'s block: query heads, key heads, value heads), and the last of them does that
// head as a block of `vt` = rope_threads(hd) threads would (`rope_kv_head`; a batch's warp t
// token t).
template <bool BATCH>
__device__ void qkv_rope_kv(const u8* Xq, int n, int cols, int wpr, int nb0, int nb01, int t0, const u8* W0, u64 s0,
                            int r0, const float* b0, float* y0, int t1, const u8* W1, u64 s1, int r1, const float* b1,
                            float* y1, int t2, const u8* W2, u64 s2, int r2, const float* b2, float* y2,
                            const float* q_norm, const float* k_norm, int hd, int rd, const u32* positions,
                            float base, float pos_scale, int style, const float* factors, float eps,
                            const TokenKv* info, int layer, int vt, u32* done) {
    auto rows_of = [&](int ty, const u8* W, u64 s, int r, const float* bias, float* y, int lb) {
        if (BATCH)
            matvec_i8n_rows_of(ty, W, s, r, cols, Xq, n, bias, wpr, y, lb);
        else
            matvec_i8_rows_of(ty, W, s, r, cols, Xq, bias, wpr, y, lb);
    };
    int b = blockIdx.x, rows = blockDim.y / wpr, h;
    if (b < nb0) {
        rows_of(t0, W0, s0, r0, b0, y0, b);
        h = b * rows / hd;
    } else if (b < nb01) {
        rows_of(t1, W1, s1, r1, b1, y1, b - nb0);
        h = r0 / hd + (b - nb0) * rows / hd;
    } else {
        rows_of(t2, W2, s2, r2, b2, y2, b - nb01);
        h = r0 / hd + r1 / hd + (b - nb01) * rows / hd;
    }
    if (!last_arrival(done + h, hd / rows)) return;
    int t = BATCH ? (threadIdx.x + blockDim.x * threadIdx.y) >> 5 : 0;
    if (t < n)
        rope_kv_head<BATCH>(h, t, y0, r0, q_norm, y1, r1, k_norm, hd, rd, positions, base, pos_scale, style, factors,
                            eps, y2, info, layer, vt);
}

extern "C" __global__ void matvec_i8nx3_rope_kv(
    const u8* Xq, int n, int cols, int wpr, int nb0, int nb01, int t0, const u8* W0, u64 s0, int r0, const float* b0,
    float* y0, int t1, const u8* W1, u64 s1, int r1, const float* b1, float* y1, int t2, const u8* W2, u64 s2, int r2,
    const float* b2, float* y2, const float* q_norm, const float* k_norm, int hd, int rd, const u32* positions,
    float base, float pos_scale, int style, const float* factors, float eps, const TokenKv* info, int layer, int vt,
    u32* done) {
    qkv_rope_kv<true>(Xq, n, cols, wpr, nb0, nb01, t0, W0, s0, r0, b0, y0, t1, W1, s1, r1, b1, y1, t2, W2, s2, r2, b2,
                      y2, q_norm, k_norm, hd, rd, positions, base, pos_scale, style, factors, eps, info, layer, vt,
                      done);
}

extern "C" __global__ void I8_ONE_BOUNDS matvec_i8x3_rope_kv(
    const u8* Xq, int cols, int wpr, int nb0, int nb01, int t0, const u8* W0, u64 s0, int r0, const float* b0,
    float* y0, int t1, const u8* W1, u64 s1, int r1, const float* b1, float* y1, int t2, const u8* W2, u64 s2, int r2,
    const float* b2, float* y2, const float* q_norm, const float* k_norm, int hd, int rd, const u32* positions,
    float base, float pos_scale, int style, const float* factors, float eps, const TokenKv* info, int layer, int vt,
    u32* done) {
    qkv_rope_kv<false>(Xq, 1, cols, wpr, nb0, nb01, t0, W0, s0, r0, b0, y0, t1, W1, s1, r1, b1, y1, t2, W2, s2, r2, b2,
                       y2, q_norm, k_norm, hd, rd, positions, base, pos_scale, style, factors, eps, info, layer, vt,
                       done);
}

// One block per (query head, token): scores over the token's cached positions
// (max(0, pos + 1 - window) ..= pos; window 0 = all) into `scores` (one row of `max_len` per
// block) — each warp takes every (warps)-th position, its lanes a stride of the head's
// dimensions, so a key row is read whole by one warp in one go — then softmax, then the weighted
// sum of values, each output dimension summed in position order. Given `sinks` (one logit a query
// head: gpt-oss), the head's sink joins the softmax's maximum and sum and adds no value
// (ops::softmax_sink).
extern "C" __global__ void attention(const float* q, const TokenKv* info, int layer, int n_heads, int n_kv_heads,
                                     int hd, float scale, int window, const float* sinks, float* scores, int max_len,
                                     float* out) {
    __shared__ float qs[ATTN_MAX_HEAD_DIM];
    int head = blockIdx.x, t = blockIdx.y;
    TokenKv ti = info[t];
    int qd = n_heads * hd, kvd = n_kv_heads * hd;
    int pos = (int)ti.pos;
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int len = pos + 1 - first;
    int kvh = head / (n_heads / n_kv_heads);
    const float* K = (const float*)ti.k + ((u64)layer * ti.cap + first) * kvd + (u64)kvh * hd;
    const float* V = (const float*)ti.v + ((u64)layer * ti.cap + first) * kvd + (u64)kvh * hd;
    const float* qh = q + (u64)t * qd + (u64)head * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qh[d];
    __syncthreads();
    float* sc = scores + ((u64)t * n_heads + head) * max_len;
    float m = -3.402823466e38f;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int j = warp; j < len; j += warps) {
        const float* kj = K + (u64)j * kvd;
        float s = 0.f;
        for (int d = lane; d < hd; d += 32) s += qs[d] * kj[d];
        s = warp_sum(s) * scale;  // every lane has it
        if (lane == 0) sc[j] = s;
        m = fmaxf(m, s);
    }
    // (block_max's barrier also makes the scores written above visible to the whole block.)
    m = block_max(m);
    if (sinks) m = fmaxf(m, sinks[head]);
    float sum = 0.f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        float e = expf(sc[j] - m);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum);
    if (sinks) sum += expf(sinks[head] - m);
    __syncthreads();
    float inv = 1.f / sum;
    float* o = out + (u64)t * qd + (u64)head * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < len; j++) acc += sc[j] * V[(u64)j * kvd + d];
        o[d] = acc * inv;
    }
}

// Attention split over positions (flash-decoding): one block per (query head, token, split),
// split z taking positions first + z·chunk .. + chunk of the token's window (those past its own
// position none). A block keeps its query head in registers (lane l: dimensions l + 32i), its
// warps take ATTN_SPLIT_ROWS positions at a time each (every key and value row read whole by one
// warp, a warp's rows' loads issued together), ATTN_SPLIT_SUB positions' scores at once in shared
// memory with a running maximum and sum; the warps' weighted sums of values are then added in
// warp order. With one split (gridDim.z == 1) it writes the head's output; with several, each
// block writes (maximum, sum, hd unnormalized sums) to `part` (row ((t · n_heads + head) · splits
// + z), hd + 2 floats; a split with no positions: sum 0) for `attention_merge` — or, given
// `done` (a zeroed counter per (head, token)), the last of a head's splits to finish merges them
// itself (`merge_splits`, `last_arrival`): the same output without the merge's launch. The order
// of every sum is fixed, so the result does not depend on scheduling. Given `q8` too (one split,
// or `done`), each token's output is written as its Q8_K blocks there as well (the bytes
// `act_q8_k_blocks` makes, which the output product takes as its input): the block writing the
// last head of a group of whole Q8_K blocks (`head_q8_k_blocks`) makes that group's blocks.
// Given `sinks`, the head's sink joins the softmax where its output is written: by the one split
// (`sink_weights`), or in the merge (`merge_splits`; `attention_merge` takes them too).
#define ATTN_SPLIT_SUB 128
#define ATTN_SPLIT_ROWS 4
#define ATTN_SPLIT_WARPS 4
#define ATTN_SPLIT_LANE_DIMS (ATTN_MAX_HEAD_DIM / 32)

__device__ void merge_splits(const float* pr, int hd, int splits, const float* sink, float* o);

// A sink's share of a softmax whose other logits have maximum m and sum of exponentials l (taken
// at m): the scale of their weighted sum of values (e^(m - M)) and its divisor (l e^(m - M) +
// e^(sink - M)), M the larger of m and the sink, as ops::softmax_sink takes its maximum.
__device__ __forceinline__ void sink_weights(float m, float l, float sink, float* scale, float* divisor) {
    float mx = fmaxf(m, sink), a = expf(m - mx);
    *scale = a;
    *divisor = l * a + expf(sink - mx);
}

// After the block has written head `head` (`hd` values) of a token's output row `orow`: the heads
// of whole Q8_K blocks group together (256 / hd heads a group when hd divides 256, else each head
// of a multiple of 256 its own), each group counting its written heads at q8done[group]; the
// block writing a group's last head makes the group's Q8_K blocks (a warp a block) into the
// token's blocks `q8row`, reading the other heads past the L1 cache.
__device__ void head_q8_k_blocks(const float* orow, int head, int hd, u8* q8row, u32* q8done) {
    int per = hd < 256 ? 256 / hd : 1, g = head / per;
    if (!last_arrival(q8done + g, per)) return;
    int first = g * per * hd / 256, blocks = per * hd / 256;
    int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int b = first + (threadIdx.x >> 5); b < first + blocks; b += warps)
        q8_k_block<true>(orow + (u64)b * 256, q8row + (u64)b * Q8K_BLOCK_BYTES, lane);
}

extern "C" __global__ void attention_split(const float* q, const TokenKv* info, int layer, int n_heads,
                                           int n_kv_heads, int hd, float scale, int window, const float* sinks,
                                           int chunk, float* part, u32* done, float* out, u8* q8, u32* q8done) {
    __shared__ float sc[ATTN_SPLIT_SUB];
    __shared__ float sums[ATTN_SPLIT_WARPS][ATTN_MAX_HEAD_DIM];
    int head = blockIdx.x, t = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    TokenKv ti = info[t];
    int qd = n_heads * hd, kvd = n_kv_heads * hd;
    int pos = (int)ti.pos;
    int first = window > 0 ? max(0, pos + 1 - window) : 0;
    int lo = first + split * chunk, hi = min(lo + chunk, pos + 1);
    int kvh = head / (n_heads / n_kv_heads);
    const float* K = (const float*)ti.k + (u64)layer * ti.cap * kvd + (u64)kvh * hd;
    const float* V = (const float*)ti.v + (u64)layer * ti.cap * kvd + (u64)kvh * hd;
    const float* qh = q + (u64)t * qd + (u64)head * hd;
    float qr[ATTN_SPLIT_LANE_DIMS], acc[ATTN_SPLIT_LANE_DIMS];
#pragma unroll
    for (int i = 0; i < ATTN_SPLIT_LANE_DIMS; i++) {
        int d = lane + 32 * i;
        qr[i] = d < hd ? qh[d] : 0.f;
        acc[i] = 0.f;
    }
    float m = -3.402823466e38f, l = 0.f;
    for (int c0 = lo; c0 < hi; c0 += ATTN_SPLIT_SUB) {
        int c1 = min(c0 + ATTN_SPLIT_SUB, hi);
        float mw = -3.402823466e38f;
        // Scores: warp w takes rows c0 + w + ATTN_SPLIT_WARPS · (r + ATTN_SPLIT_ROWS · k).
        for (int j0 = c0 + warp; j0 < c1; j0 += ATTN_SPLIT_WARPS * ATTN_SPLIT_ROWS) {
            float s[ATTN_SPLIT_ROWS];
#pragma unroll
            for (int r = 0; r < ATTN_SPLIT_ROWS; r++) {
                int j = j0 + r * ATTN_SPLIT_WARPS;
                s[r] = 0.f;
                if (j < c1) {
                    const float* kj = K + (u64)j * kvd;
#pragma unroll
                    for (int i = 0; i < ATTN_SPLIT_LANE_DIMS; i++) {
                        int d = lane + 32 * i;
                        if (d < hd) s[r] += qr[i] * kj[d];
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < ATTN_SPLIT_ROWS; r++) {
                int j = j0 + r * ATTN_SPLIT_WARPS;
                float v = warp_sum(s[r]) * scale;  // every lane has it
                if (j < c1) {
                    if (lane == 0) sc[j - c0] = v;
                    mw = fmaxf(mw, v);
                }
            }
        }
        // (block_max's barrier also makes the scores written above visible to the whole block.)
        float m_new = fmaxf(m, block_max(mw));
        float alpha = expf(m - m_new);
        float ps = 0.f;
        for (int j = threadIdx.x; j < c1 - c0; j += blockDim.x) {
            float e = expf(sc[j] - m_new);
            sc[j] = e;
            ps += e;
        }
        ps = block_sum(ps);  // its barriers make the weights visible
        l = l * alpha + ps;
        m = m_new;
#pragma unroll
        for (int i = 0; i < ATTN_SPLIT_LANE_DIMS; i++) acc[i] *= alpha;
#pragma unroll 4
        for (int j = c0 + warp; j < c1; j += ATTN_SPLIT_WARPS) {
            float p = sc[j - c0];
            const float* vj = V + (u64)j * kvd;
#pragma unroll
            for (int i = 0; i < ATTN_SPLIT_LANE_DIMS; i++) {
                int d = lane + 32 * i;
                if (d < hd) acc[i] += p * vj[d];
            }
        }
        __syncthreads();  // the weights are read before the next positions' scores
    }
#pragma unroll
    for (int i = 0; i < ATTN_SPLIT_LANE_DIMS; i++) {
        int d = lane + 32 * i;
        if (d < hd) sums[warp][d] = acc[i];
    }
    __syncthreads();
    float* dst = splits == 1 ? out + (u64)t * qd + (u64)head * hd
                             : part + (((u64)t * n_heads + head) * splits + split) * (hd + 2) + 2;
    float mul = 1.f, div = l;
    if (splits == 1 && sinks) sink_weights(m, l, sinks[head], &mul, &div);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < ATTN_SPLIT_WARPS; w++) s += sums[w][d];
        dst[d] = splits == 1 ? s * mul / div : s;
    }
    if (splits > 1 && threadIdx.x == 0) {
        dst[-2] = m;
        dst[-1] = l;
    }
    // With `done`, the last of a (head, token)'s splits to finish merges them.
    u64 row = (u64)t * n_heads + head;
    bool wrote = splits == 1;
    if (splits > 1 && done && last_arrival(done + row, splits)) {
        merge_splits(part + row * splits * (hd + 2), hd, splits, sinks ? sinks + head : nullptr, out + row * hd);
        wrote = true;
    }
    if (q8 && wrote) {
        int groups = qd / (hd < 256 ? 256 : hd);
        head_q8_k_blocks(out + (u64)t * qd, head, hd, q8 + (u64)t * (qd / 256) * Q8K_BLOCK_BYTES,
                         q8done + (u64)t * groups);
    }
}

// The splits of `attention_split` into each head's output: one block per (query head, token);
// out = sum_z sums_z · w_z / sum_z l_z · w_z, w_z = e^(m_z − M) (0 for a split without positions),
// M the largest m_z of the splits that had positions; each split's weight computed once, every
// sum in split order; given the head's `sink`, it joins M and the divisor (`sink_weights`). At
// most ATTN_SPLIT_MAX splits.
#define ATTN_SPLIT_MAX 256

// Splits `pr` (splits × (m, l, hd sums)) into one head's output `o`, by a block.
__device__ void merge_splits(const float* pr, int hd, int splits, const float* sink, float* o) {
    __shared__ float wz[ATTN_SPLIT_MAX];
    float mx = -3.402823466e38f;
    for (int z = 0; z < splits; z++)
        if (__ldcg(pr + z * (hd + 2) + 1) > 0.f) mx = fmaxf(mx, __ldcg(pr + z * (hd + 2)));
    for (int z = threadIdx.x; z < splits; z += blockDim.x) {
        float l = __ldcg(pr + z * (hd + 2) + 1);
        wz[z] = l > 0.f ? expf(__ldcg(pr + z * (hd + 2)) - mx) : 0.f;
    }
    __syncthreads();
    float total = 0.f;
    for (int z = 0; z < splits; z++) total += __ldcg(pr + z * (hd + 2) + 1) * wz[z];
    float mul = 1.f;
    if (sink) sink_weights(mx, total, *sink, &mul, &total);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float s = 0.f;
        for (int z = 0; z < splits; z++)
            if (wz[z] > 0.f) s += __ldcg(pr + z * (hd + 2) + 2 + d) * wz[z];
        o[d] = s * mul / total;
    }
}

// One block per (query head, token).
extern "C" __global__ void attention_merge(const float* part, int n_heads, int hd, int splits, const float* sinks,
                                           float* out) {
    u64 row = (u64)blockIdx.y * n_heads + blockIdx.x;
    merge_splits(part + row * splits * (hd + 2), hd, splits, sinks ? sinks + blockIdx.x : nullptr, out + row * hd);
}

// Flash-style attention for runs of one sequence's consecutive tokens (a prompt, a draft): one
// block per (query head, tile of up to ATTN_TILE_Q tokens) takes the tile's keys ATTN_TILE_K
// positions at a time into shared memory once for all its tokens, with a running maximum and sum
// per token (the softmax rescaled as the maximum grows), instead of a block per token reading
// every key and value again. `tiles` holds (first token, tokens) pairs: tokens of one sequence at
// consecutive positions. Heads of at most ATTN_TILE_MAX_HD values; four warps. Given `sinks`, the
// head's sink joins each token's softmax at the end (`sink_weights`).
#define ATTN_TILE_Q 16
#define ATTN_TILE_K 16
#define ATTN_TILE_MAX_HD 256

extern "C" __global__ void attention_tiles(const float* q, const TokenKv* info, const u32* tiles, int layer,
                                           int n_heads, int n_kv_heads, int hd, float scale, int window,
                                           const float* sinks, float* out) {
    __shared__ float qs[ATTN_TILE_Q][ATTN_TILE_MAX_HD + 1];
    __shared__ float kv[ATTN_TILE_K][ATTN_TILE_MAX_HD + 1];  // the chunk's keys, then its values
    __shared__ float p[ATTN_TILE_Q][ATTN_TILE_K];
    __shared__ float rescale[ATTN_TILE_Q], total[ATTN_TILE_Q], final_scale[ATTN_TILE_Q];
    int head = blockIdx.x, t0 = (int)tiles[2 * blockIdx.y], nt = (int)tiles[2 * blockIdx.y + 1];
    int tid = threadIdx.x;
    TokenKv ti = info[t0];
    int qd = n_heads * hd, kvd = n_kv_heads * hd;
    int pos0 = (int)ti.pos;
    int kvh = head / (n_heads / n_kv_heads);
    const float* K = (const float*)ti.k + (u64)layer * ti.cap * kvd + (u64)kvh * hd;
    const float* V = (const float*)ti.v + (u64)layer * ti.cap * kvd + (u64)kvh * hd;
    for (int i = tid; i < ATTN_TILE_Q * hd; i += blockDim.x) {
        int r = i / hd, d = i % hd;
        qs[r][d] = r < nt ? q[(u64)(t0 + r) * qd + (u64)head * hd + d] : 0.f;
    }
    // Scores: thread tid takes token qi = tid / 8 and keys 2 (tid % 8), + 1 of each chunk; the 8
    // threads of a token keep its running maximum m and sum l.
    int qi = tid >> 3, kj = 2 * (tid & 7);
    int my_pos = pos0 + qi;
    int my_first = window > 0 ? max(0, my_pos + 1 - window) : 0;
    float m = -3.402823466e38f, l = 0.f;
    // Sums: thread tid takes dimensions tid and tid + blockDim.x of every token.
    float o[ATTN_TILE_Q][2];
#pragma unroll
    for (int r = 0; r < ATTN_TILE_Q; r++) o[r][0] = o[r][1] = 0.f;
    int first = window > 0 ? max(0, pos0 + 1 - window) : 0, last = pos0 + nt - 1;
    for (int c0 = first; c0 <= last; c0 += ATTN_TILE_K) {
        __syncthreads();  // the previous chunk's values and weights are used
        for (int i = tid; i < ATTN_TILE_K * hd; i += blockDim.x) {
            int r = i / hd, d = i % hd;
            kv[r][d] = c0 + r <= last ? K[(u64)(c0 + r) * kvd + d] : 0.f;
        }
        __syncthreads();
        float s[2];
        bool ok[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int j = c0 + kj + e;
            ok[e] = qi < nt && j <= my_pos && j >= my_first;
            float acc = 0.f;
            for (int d = 0; d < hd; d++) acc += qs[qi][d] * kv[kj + e][d];
            s[e] = acc * scale;
        }
        float mx = fmaxf(ok[0] ? s[0] : -3.402823466e38f, ok[1] ? s[1] : -3.402823466e38f);
#pragma unroll
        for (int o8 = 1; o8 < 8; o8 <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o8));
        float m_new = fmaxf(m, mx);
        float p0 = ok[0] ? expf(s[0] - m_new) : 0.f, p1 = ok[1] ? expf(s[1] - m_new) : 0.f;
        float ps = p0 + p1;
#pragma unroll
        for (int o8 = 1; o8 < 8; o8 <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o8);
        float alpha = expf(m - m_new);
        l = l * alpha + ps;
        m = m_new;
        p[qi][kj] = p0;
        p[qi][kj + 1] = p1;
        if ((tid & 7) == 0) rescale[qi] = alpha;
        __syncthreads();  // scores read from the keys; weights written
        for (int i = tid; i < ATTN_TILE_K * hd; i += blockDim.x) {
            int r = i / hd, d = i % hd;
            kv[r][d] = c0 + r <= last ? V[(u64)(c0 + r) * kvd + d] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int d = tid + h * blockDim.x;
            if (d >= hd) continue;
#pragma unroll
            for (int r = 0; r < ATTN_TILE_Q; r++) {
                float acc = o[r][h] * rescale[r];
#pragma unroll
                for (int j = 0; j < ATTN_TILE_K; j++) acc += p[r][j] * kv[j][d];
                o[r][h] = acc;
            }
        }
    }
    if ((tid & 7) == 0) {
        float mul = 1.f, div = l;
        // (a token past the tile's has no positions: its m is no score, and it is not written)
        if (sinks && qi < nt) sink_weights(m, l, sinks[head], &mul, &div);
        total[qi] = div;
        final_scale[qi] = mul;
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int d = tid + h * blockDim.x;
        if (d >= hd) continue;
        for (int r = 0; r < nt; r++)
            out[(u64)(t0 + r) * qd + (u64)head * hd + d] = o[r][h] * final_scale[r] / total[r];
    }
}
