// The KV cache in device memory and attention over it. A sequence's cache is two allocations
// (keys, values), each [layer][capacity][kv_dim] f32. Every token of a batch carries four u64s:
// its sequence's key and value base addresses, its position and the cache's capacity, so one
// launch serves a batch of several sequences.

#define ATTN_MAX_HEAD_DIM 512

struct TokenKv {
    u64 k, v, pos, cap;
};

// Row t of k and v into its sequence's cache at its position, layer `layer`.
extern "C" __global__ void kv_write(const float* k, const float* v, const TokenKv* info, int layer, int kvd) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= kvd) return;
    int t = blockIdx.y;
    TokenKv ti = info[t];
    u64 at = ((u64)layer * ti.cap + ti.pos) * kvd + c;
    ((float*)ti.k)[at] = k[(u64)t * kvd + c];
    ((float*)ti.v)[at] = v[(u64)t * kvd + c];
}

// `rope_norm`, then `kv_write` of its keys and `v`, in one launch (the same values): blocks past
// the query and key heads copy the value heads (as many as the key heads) into the cache; each
// key head is copied there once rotated. positions[t] is token t's position in `info`.
extern "C" __global__ void rope_norm_kv(float* q, int q_width, const float* q_norm, float* k, int k_width,
                                        const float* k_norm, int hd, const u32* positions, float base, float pos_scale,
                                        int style, float eps, const float* v, const TokenKv* info, int layer) {
    int q_heads = q_width / hd, kv_heads = k_width / hd, t = blockIdx.y, h = blockIdx.x;
    if (h < q_heads) {
        rope_head(q + (u64)t * q_width + (u64)h * hd, q_norm, hd, positions[t], base, pos_scale, style, eps);
        return;
    }
    TokenKv ti = info[t];
    u64 at = ((u64)layer * ti.cap + ti.pos) * k_width;
    if (h < q_heads + kv_heads) {
        int head = h - q_heads;
        float* kh = k + (u64)t * k_width + (u64)head * hd;
        rope_head(kh, k_norm, hd, positions[t], base, pos_scale, style, eps);
        __syncthreads();
        for (int j = threadIdx.x; j < hd; j += blockDim.x) ((float*)ti.k)[at + (u64)head * hd + j] = kh[j];
        return;
    }
    int head = h - q_heads - kv_heads;
    const float* vh = v + (u64)t * k_width + (u64)head * hd;
    for (int j = threadIdx.x; j < hd; j += blockDim.x) ((float*)ti.v)[at + (u64)head * hd + j] = vh[j];
}

// One block per (query head, token): scores over the token's cached positions
// (max(0, pos + 1 - window) ..= pos; window 0 = all) into `scores` (one row of `max_len` per
// block) — each warp takes every (warps)-th position, its lanes a stride of the head's
// dimensions, so a key row is read whole by one warp in one go — then softmax, then the weighted
// sum of values, each output dimension summed in position order.
extern "C" __global__ void attention(const float* q, const TokenKv* info, int layer, int n_heads, int n_kv_heads,
                                     int hd, float scale, int window, float* scores, int max_len, float* out) {
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
    float sum = 0.f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        float e = expf(sc[j] - m);
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum);
    __syncthreads();
    float inv = 1.f / sum;
    float* o = out + (u64)t * qd + (u64)head * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < len; j++) acc += sc[j] * V[(u64)j * kvd + d];
        o[d] = acc * inv;
    }
}
