// Per-element and per-row operations of the layer program: RMSNorm, residual adds, biases, gated
// activations, softcap, row selection and column scatter/gather, and RoPE with the optional
// per-head QK-norm. Each mirrors the CPU device's loop in src/backend/cpu.rs and ops.rs.

#define ACT_SILU 0
#define ACT_GELU_TANH 1

// A reduction over a block (blockDim.x a multiple of 32, at most 1024) with `op`: every thread
// gets the result.
struct ReduceSum {
    __device__ float operator()(float a, float b) const { return a + b; }
};
struct ReduceMax {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct ReduceMin {
    __device__ int operator()(int a, int b) const { return min(a, b); }
};

template <typename T, typename Op> __device__ T block_reduce(T v, Op op) {
    __shared__ T part[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    int tid = threadIdx.x + blockDim.x * threadIdx.y;  // (blocks of one or two dimensions)
    int lane = tid & 31, warp = tid >> 5;
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    int warps = (blockDim.x * blockDim.y) >> 5;
    T r = part[0];
    for (int i = 1; i < warps; i++) r = op(r, part[i]);
    return r;
}

// Whether the calling block is the last of `expected` blocks to arrive at `*counter` (each
// arriving once, every thread of it, after its writes): that block then sees the others' writes
// (read past the L1 cache: `__ldcg`), and the counter is back at 0 for the next launch. A launch
// that fuses a following step's work into its last block instead of a launch of its own (the
// counter zeroed once at allocation; the launches that share it run one after another).
__device__ bool last_arrival(u32* counter, u32 expected) {
    __shared__ int last;
    __threadfence();  // this thread's writes reach the device before its block arrives
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
        last = atomicAdd(counter, 1u) == expected - 1;
        if (last) {
            __threadfence();  // (acquire: the others' writes before their arrivals are seen)
            atomicExch(counter, 0u);
        }
    }
    __syncthreads();
    return last;
}

__device__ float block_sum(float v) { return block_reduce(v, ReduceSum()); }
__device__ float block_max(float v) { return block_reduce(v, ReduceMax()); }
__device__ int block_min(int v) { return block_reduce(v, ReduceMin()); }

// A row's RMSNorm as a block of `vt` threads computes it (`vt` a multiple of 32, at most 1024:
// `norm_threads` on the host), whatever block runs it: virtual thread v takes values v, v + vt,
// ... in order; the sum of their squares is reduced within each virtual warp by the exchanges of
// `block_reduce` and then over the virtual warps in order; so every block, of any shape, that
// runs a row with the same `vt` gets the same bits. The running block's threads (linear index,
// whole warps) take virtual threads tid, tid + threads, ...: with `vt` threads, one each.
// ADD: x += a first (a read past the L1 cache: it may have been written by other blocks of this
// kernel, `last_arrival`); then y = x / rms(x) * w; y may be x.
template <bool ADD>
__device__ void norm_row(float* xr, const float* ar, const float* w, float* yr, int width, float eps, int vt) {
    __shared__ float part[32];
    int tid = threadIdx.x + blockDim.x * threadIdx.y, threads = blockDim.x * blockDim.y;
    __syncthreads();  // (`part` may be in use by an earlier reduction)
    for (int v = tid; v < vt; v += threads) {  // the same rounds for a whole warp
        float ss = 0.f;
#pragma unroll 4
        for (int i = v; i < width; i += vt) {
            float t = ADD ? xr[i] + __ldcg(ar + i) : xr[i];
            ss += t * t;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if ((tid & 31) == 0) part[v >> 5] = ss;
    }
    __syncthreads();
    float total = part[0];
    for (int i = 1; i < vt >> 5; i++) total += part[i];
    float scale = rsqrtf(total / (float)width + eps);
    for (int v = tid; v < vt; v += threads)
#pragma unroll 4
        for (int i = v; i < width; i += vt) {
            float t = ADD ? xr[i] + __ldcg(ar + i) : xr[i];
            if (ADD) xr[i] = t;
            yr[i] = t * scale * w[i];
        }
}

template <bool CG = false> __device__ void q8_k_block(const float* xb, u8* ob, int lane);

// The sum of value(i)² over i < len as a block of `vt` threads sums it (`norm_row`, and
// `rope_head`'s per-head norm: thread v takes i = v, v + vt, ... in order, each warp's sum is
// reduced by `block_reduce`'s exchanges, the warps' sums added in order), by one warp (lane
// `lane`): lane l plays virtual thread 32k + l of each virtual warp k in turn. The same bits.
template <typename F> __device__ __forceinline__ float warp_vt_sum_sq(int len, int vt, int lane, F value) {
    float total = 0.f;
    for (int k = 0; k < vt >> 5; k++) {
        float ss = 0.f;
#pragma unroll 4
        for (int i = 32 * k + lane; i < len; i += vt) {
            float t = value(i);
            ss += t * t;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        total = k == 0 ? ss : total + ss;
    }
    return total;
}

// `norm_row<true>` of one row by one warp (lane `lane`), the same bits (`warp_vt_sum_sq`); then
// the row's Q8_K blocks (`q8` unless null) by the same warp. `ar` is read past the L1 cache
// (other blocks may have written it: `last_arrival`).
__device__ void add_norm_row_warp(float* xr, const float* ar, const float* w, float* yr, int width, float eps,
                                  u8* q8, int vt, int lane) {
    float total = warp_vt_sum_sq(width, vt, lane, [&](int i) { return xr[i] + __ldcg(ar + i); });
    float scale = rsqrtf(total / (float)width + eps);
    for (int k = 0; k < vt >> 5; k++)
#pragma unroll 4
        for (int i = 32 * k + lane; i < width; i += vt) {
            float t = xr[i] + __ldcg(ar + i);
            xr[i] = t;
            yr[i] = t * scale * w[i];
        }
    __syncwarp();  // (the row's values, each lane's, before the blocks read them)
    if (q8)
        for (int b = 0; b < width / 256; b++) q8_k_block(yr + b * 256, q8 + (u64)b * Q8K_BLOCK_BYTES, lane);
}

// The Q8_K blocks of a norm's output row `yr` (`width` a multiple of 256) into `q8`, by the
// norm's block once every thread has written its values: warp w takes blocks w, w + warps, ...
// The same bytes `act_q8_k_blocks` makes of that row.
__device__ void norm_row_q8_k(const float* yr, u8* q8, int width) {
    __syncthreads();
    int tid = threadIdx.x + blockDim.x * threadIdx.y;
    int warps = (blockDim.x * blockDim.y) >> 5, lane = tid & 31;
    for (int b = tid >> 5; b < width / 256; b += warps) q8_k_block(yr + b * 256, q8 + (u64)b * Q8K_BLOCK_BYTES, lane);
}

// y[row] = x[row] / rms(x[row]) * w. One block per row; y may be x. With `q8` (not null; width
// a multiple of 256), y's rows as Q8_K blocks there too (`norm_row_q8_k`).
extern "C" __global__ void rms_norm(const float* x, const float* w, float* y, int width, float eps, u8* q8) {
    u64 off = (u64)blockIdx.x * width;
    norm_row<false>((float*)x + off, 0, w, y + off, width, eps, blockDim.x);
    if (q8) norm_row_q8_k(y + off, q8 + (u64)blockIdx.x * (width / 256) * Q8K_BLOCK_BYTES, width);
}

// x[row] += a[row], then y[row] = x[row] / rms(x[row]) * w: `add` then `rms_norm` in one pass,
// the same values. One block per row; `q8` as in `rms_norm`.
extern "C" __global__ void add_rms_norm(float* x, const float* a, const float* w, float* y, int width, float eps, u8* q8) {
    u64 off = (u64)blockIdx.x * width;
    norm_row<true>(x + off, a + off, w, y + off, width, eps, blockDim.x);
    if (q8) norm_row_q8_k(y + off, q8 + (u64)blockIdx.x * (width / 256) * Q8K_BLOCK_BYTES, width);
}

extern "C" __global__ void add(float* x, const float* y, u64 len) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] += y[i];
}

extern "C" __global__ void mul(float* x, const float* y, u64 len) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] *= y[i];
}

extern "C" __global__ void add_bias(float* x, const float* b, int width, u64 len) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] += b[i % width];
}

__device__ __forceinline__ float act_fn(float v, int f) {
    if (f == ACT_SILU) return v / (1.f + expf(-v));
    const float k = 0.7978846f;
    return 0.5f * v * (1.f + tanhf(k * v * (1.f + 0.044715f * v * v)));
}

extern "C" __global__ void activate(float* x, int f, u64 len) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] = act_fn(x[i], f);
}

// up[i] = up[i] * f(gate[i]): `activate` then `mul` in one pass, the same values.
extern "C" __global__ void activate_mul(float* up, const float* gate, int f, u64 len) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    float a = act_fn(gate[i], f);
    up[i] *= a;
}

extern "C" __global__ void softcap(float* x, float cap, u64 len) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] = cap * tanhf(x[i] / cap);
}

// out[i] = x[rows[i]] (rows of `width`). grid.y = output row.
extern "C" __global__ void select_rows(const float* x, const u32* rows, int width, float* out) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    out[(u64)blockIdx.y * width + c] = x[(u64)rows[blockIdx.y] * width + c];
}

// out [n, width] is zero; out[t][cols[i]] = x[t][i]. grid.y = token.
extern "C" __global__ void scatter_cols(const float* x, const u32* cols, int m, int width, float* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    u64 t = blockIdx.y;
    out[t * width + cols[i]] = x[t * m + i];
}

// out[t][i] = x[t][cols[i]]. grid.y = token.
extern "C" __global__ void gather_cols(const float* x, const u32* cols, int m, int width, float* out) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    u64 t = blockIdx.y;
    out[t * m + i] = x[t * width + cols[i]];
}

// (bv, bi) takes (v, i) when v is larger, or equal with a lower index: the first largest wins,
// -0 and +0 are equal, and a NaN never wins (every comparison with it is false).
__device__ __forceinline__ void argmax_take(float& bv, u32& bi, float v, u32 i) {
    if (v > bv || (v == bv && i < bi)) {
        bv = v;
        bi = i;
    }
}

// Each row's greedy token, as sampler::argmax finds it after generation's stop-token ban: the
// index of the row's largest value, the lowest index winning ties, NaN never chosen (a NaN first
// value: 0), the `n_banned` ids of `banned` counted as -inf. out[row] = the index. grid.x = row,
// blockDim.x a multiple of 32 (at most 1024). The reduction's order is fixed and its rule picks
// one answer whatever the order, so the result does not depend on scheduling.
extern "C" __global__ void argmax_rows(const float* x, int width, const u32* banned, int n_banned, u32* out) {
    const float* xr = x + (u64)blockIdx.x * width;
    const float neg_inf = __int_as_float((int)0xff800000u);
    float bv = neg_inf;
    u32 bi = 0xffffffffu;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = xr[i];
        for (int k = 0; k < n_banned; k++)
            if (banned[k] == (u32)i) v = neg_inf;
        argmax_take(bv, bi, v, (u32)i);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        u32 oi = __shfl_xor_sync(0xffffffffu, bi, o);
        argmax_take(bv, bi, ov, oi);
    }
    __shared__ float part_v[32];
    __shared__ u32 part_i[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        part_v[warp] = bv;
        part_i[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) argmax_take(bv, bi, part_v[w], part_i[w]);
    bool first_banned = false;
    for (int k = 0; k < n_banned; k++) first_banned |= banned[k] == 0u;
    float first = width > 0 ? xr[0] : 0.f;
    // A NaN first value (not banned) is the answer, as a scan that starts with it keeps it; no
    // value at all that can win (every one NaN): 0 as well.
    if ((!first_banned && first != first) || bi == 0xffffffffu) bi = 0;
    out[blockIdx.x] = bi;
}

// The most candidates top_k_rows sorts (crate::model::batch::TOP_K_MAX): one a thread.
#define TOPK_MAX 1024

// v's place in f32::total_cmp's order as an unsigned key (larger key, later in the order): +0
// above -0, a NaN with its sign bit clear above +inf, one with it set below -inf.
__device__ __forceinline__ u32 total_order_key(float v) {
    u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Element i of a row, -inf when i is one of the `n_banned` ids of `banned`.
__device__ __forceinline__ float unbanned(const float* xr, int i, const u32* banned, int n_banned) {
    float v = xr[i];
    for (int k = 0; k < n_banned; k++)
        if (banned[k] == (u32)i) v = __int_as_float((int)0xff800000u);
    return v;
}

// Element i of a row as top_k_rows orders it: the value's key above, ~i below (a lower index
// is larger), so every element has a key of its own; the `banned` ids count as -inf.
__device__ __forceinline__ u64 top_k_key(const float* xr, int i, const u32* banned, int n_banned) {
    return ((u64)total_order_key(unbanned(xr, i, banned, n_banned)) << 32) | (u64)(~(u32)i);
}

// Each row's k largest values with their indices, largest first, ties lower index first, in
// f32::total_cmp's order, the `n_banned` ids of `banned` counted as -inf: as sampler::most_likely
// lists them after generation's stop-token ban. out[row][2j] = the index, out[row][2j + 1] = the
// value's bits. grid.x = row, blockDim.x = TOPK_MAX, 1 <= k <= min(width, TOPK_MAX).
// With `lse` (not 0), each row of out is 2k + 2 words, the last two the low and high words of
// ln sum exp(row) as an f64, the banned ids left out (ops::log_sum_exp of the banned row: the
// maximum, then the sum of exp(v - max) in f64; each thread's elements in order, then a fixed
// tree over the block, so the result does not depend on scheduling either). Log-probabilities
// of the candidates are then value - that, with no row brought to the host.
// A radix select over the 64-bit keys (top_k_key), a byte at a time from the top: each round
// counts the keys that share the bytes chosen so far by their next byte, and keeps the byte
// where the k-th largest lies; it ends once that byte's keys are exactly the ones still needed
// (at the latest on the last byte: keys are unique). The k keys at or above the chosen bytes are
// then gathered and ranked. Counts are integers and ranks are by unique keys, so the result does
// not depend on scheduling.
extern "C" __global__ void top_k_rows(const float* x, int width, const u32* banned, int n_banned, int k, int lse,
                                      u32* out) {
    const float* xr = x + (u64)blockIdx.x * width;
    u32* row_out = out + (u64)blockIdx.x * (2 * k + (lse ? 2 : 0));
    if (lse) {
        __shared__ double sums[TOPK_MAX];
        float m = __int_as_float((int)0xff800000u);
        for (int i = threadIdx.x; i < width; i += blockDim.x) m = fmaxf(m, unbanned(xr, i, banned, n_banned));
        m = block_max(m);
        double s = 0.0;
        for (int i = threadIdx.x; i < width; i += blockDim.x)
            s += exp((double)unbanned(xr, i, banned, n_banned) - (double)m);
        sums[threadIdx.x] = s;
        __syncthreads();
        for (int half = blockDim.x / 2; half > 0; half >>= 1) {
            if ((int)threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
            __syncthreads();
        }
        if (threadIdx.x == 0) {
            u64 bits = (u64)__double_as_longlong((double)m + log(sums[0]));
            row_out[2 * k] = (u32)bits;
            row_out[2 * k + 1] = (u32)(bits >> 32);
        }
    }
    __shared__ u32 hist[256];
    __shared__ u64 keys[TOPK_MAX];
    __shared__ u64 prefix, mask;
    __shared__ u32 need, done, gathered;
    if (threadIdx.x == 0) {
        prefix = 0;
        mask = 0;
        need = (u32)k;
        done = 0;
        gathered = 0;
    }
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        if (done) break;
        u64 m = mask, p = prefix;
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            u64 key = top_k_key(xr, i, banned, n_banned);
            if ((key & m) == p) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // The keys sharing the bytes so far number at least `need`: from the top byte down,
            // the first whose keys, with those above it, reach `need`.
            u32 rest = need;
            int b = 255;
            while (b > 0 && hist[b] < rest) rest -= hist[b--];
            prefix |= (u64)b << shift;
            mask |= (u64)255 << shift;
            need = rest;
            done = hist[b] == rest;
        }
        __syncthreads();
    }
    // The keys above the chosen bytes, and all of those with them: exactly k.
    u64 m = mask, p = prefix;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        u64 key = top_k_key(xr, i, banned, n_banned);
        if ((key & m) >= p) {
            u32 slot = atomicAdd(&gathered, 1u);
            if (slot < TOPK_MAX) keys[slot] = key;
        }
    }
    __syncthreads();
    int n = min((int)gathered, k);
    if ((int)threadIdx.x >= n) return;
    u64 mine = keys[threadIdx.x];
    int rank = 0;
    for (int j = 0; j < n; j++) rank += keys[j] > mine;
    u32 hi = (u32)(mine >> 32);
    u32 bits = (hi & 0x80000000u) ? (hi & 0x7fffffffu) : ~hi;
    u32* o = row_out + 2 * rank;
    o[0] = ~(u32)mine;
    o[1] = bits;
}

// Pair i of the head at `v` rotated to `position`, of its leading `rd` dimensions (partial RoPE:
// rd < the head's size, the rest passing through; the angles take rd as the head's size): angles
// in f64 as on the CPU (ops::rope_table), each divided by factors[i] where given (Llama 3.1+'s
// frequency factors, YaRN's); style 0: adjacent pairs, 1: halves of the rd dimensions. Read past
// the L1 cache (other blocks or threads may have written the head).
__device__ __forceinline__ void rope_pair(float* v, int i, int rd, u32 position, float base, float pos_scale,
                                          int style, const float* factors) {
    int half = rd / 2;
    double p = (double)position / (double)pos_scale;
    double theta = p * pow((double)base, -2.0 * (double)i / (double)rd);
    if (factors) theta /= (double)factors[i];
    float c = (float)cos(theta), s = (float)sin(theta);
    int a = style == 0 ? 2 * i : i;
    int b = style == 0 ? 2 * i + 1 : i + half;
    float x0 = __ldcg(v + a), x1 = __ldcg(v + b);
    v[a] = x0 * c - x1 * s;
    v[b] = x0 * s + x1 * c;
}

// Per-head RMSNorm (when `norm` is given, over all hd dimensions), then RoPE at `position` of its
// leading `rd` dimensions (`rope_pair`), of the head at `v` (hd wide), as a block of `vt` threads
// (hd/2 rounded up to a warp: `rope_threads`) computes it; every thread of the running block (one
// or two dimensions, at least `vt` threads) calls it, those past `vt` adding nothing to the norm's
// sum (so it is the same sum). `v` is read past the L1 cache (other blocks of a launch may have
// written it: `last_arrival`).
__device__ void rope_head(float* v, const float* norm, int hd, int rd, u32 position, float base, float pos_scale,
                          int style, const float* factors, float eps, int vt) {
    int i = threadIdx.x + blockDim.x * threadIdx.y;
    if (norm) {
        float ss = 0.f;
        if (i < vt)
            for (int j = i; j < hd; j += vt) {
                float x = __ldcg(v + j);
                ss += x * x;
            }
        ss = block_sum(ss);
        float scale = rsqrtf(ss / (float)hd + eps);
        if (i < vt)
            for (int j = i; j < hd; j += vt) v[j] = __ldcg(v + j) * scale * norm[j];
        __syncthreads();
    }
    if (i < rd / 2) rope_pair(v, i, rd, position, base, pos_scale, style, factors);
}

// `rope_head` by one warp (lane `lane`), the same values: the per-head norm's sum as the head's
// block of `vt` threads sums it (`warp_vt_sum_sq`), then pairs lane, lane + 32, ...
__device__ void rope_head_warp(float* v, const float* norm, int hd, int rd, u32 position, float base, float pos_scale,
                               int style, const float* factors, float eps, int vt, int lane) {
    if (norm) {
        float total = warp_vt_sum_sq(hd, vt, lane, [&](int j) { return __ldcg(v + j); });
        float scale = rsqrtf(total / (float)hd + eps);
        for (int k = 0; k < vt >> 5; k++)
            for (int j = 32 * k + lane; j < hd; j += vt) v[j] = __ldcg(v + j) * scale * norm[j];
        __syncwarp();
    }
    for (int i = lane; i < rd / 2; i += 32) rope_pair(v, i, rd, position, base, pos_scale, style, factors);
    __syncwarp();
}

// `rope_head` of the query heads (q, rows of q_width) and then the key heads (k, rows of
// k_width) at positions[t] (`rd` dimensions of each rotated, `factors` or none): one launch for
// both. One block per (head, token): blockIdx.x below
// q_width / hd is a query head, the rest key heads.
extern "C" __global__ void rope_norm(float* q, int q_width, const float* q_norm, float* k, int k_width,
                                     const float* k_norm, int hd, int rd, const u32* positions, float base,
                                     float pos_scale, int style, const float* factors, float eps) {
    int q_heads = q_width / hd, t = blockIdx.y;
    bool is_q = (int)blockIdx.x < q_heads;
    int head = is_q ? blockIdx.x : blockIdx.x - q_heads;
    float* v = is_q ? q + (u64)t * q_width + (u64)head * hd : k + (u64)t * k_width + (u64)head * hd;
    rope_head(v, is_q ? q_norm : k_norm, hd, rd, positions[t], base, pos_scale, style, factors, eps, blockDim.x);
}

// The activations the CPU's quantized products see (src/quant/prepare.rs,
// `PreparedInput::dequantized`), each value replaced by its 8-bit quant times its block's scale,
// so that the f32-activation products compute what the CPU's integer products do (to rounding).
// One warp per block; `x` holds whole blocks (rows of a multiple of the block's length).
//
// Blocks of 32 (Q4_0/Q4_1/Q5_0/Q8_0 weights): scale = absmax / 127, quants rounded half away
// from zero (roundf).
extern "C" __global__ void act_q8_32(const float* x, float* y, u64 blocks) {
    u64 b = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;  // the whole warp (b depends on the warp only)
    int lane = threadIdx.x & 31;
    float v = x[b * 32 + lane];
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float d = amax / 127.f;
    float id = d != 0.f ? 1.f / d : 0.f;
    y[b * 32 + lane] = roundf(v * id) * d;
}

// Q8_K blocks of 256 (K-quant weights): the scale carries the sign of the first element of
// largest magnitude (iscale = -127 / max), quants rounded half to even (rintf) and capped at 127;
// a block of zeros stays zero. Lane `lane` of the block's warp loads values 8·lane .. 8·lane + 7
// into v[] (two 16-byte loads where xb allows) and gets iscale (0 for a block of zeros). The
// largest magnitude and the lowest index holding it are a maximum and a minimum over the warp,
// the same whichever lane holds which values. CG: the values are read past the L1 cache (other
// blocks of the launch may have written them: `last_arrival`).
template <bool CG> __device__ __forceinline__ float ld_f(const float* p) { return CG ? __ldcg(p) : *p; }
template <bool CG> __device__ __forceinline__ float4 ld_f4(const float4* p) { return CG ? __ldcg(p) : *p; }
template <bool CG = false> __device__ float q8_k_iscale(const float* xb, int lane, float (&v)[8]) {
    const float* p = xb + 8 * lane;
    if ((((u64)xb) & 15) == 0) {
        float4 a = ld_f4<CG>((const float4*)p), c = ld_f4<CG>((const float4*)p + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = c.x, v[5] = c.y, v[6] = c.z, v[7] = c.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = ld_f<CG>(p + i);
    }
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    // The lowest index holding that magnitude (this lane's first, then the warp's least).
    int first = 256;
#pragma unroll
    for (int i = 7; i >= 0; i--) {
        if (fabsf(v[i]) == amax) first = 8 * lane + i;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
    return amax == 0.f || first >= 256 ? 0.f : -127.f / ld_f<CG>(xb + first);
}

__device__ __forceinline__ int q8_k_quant(float iscale, float v) {
    return iscale == 0.f ? 0 : (int)fminf(rintf(iscale * v), 127.f);
}

// The blocks as the float values they stand for. One warp per block.
extern "C" __global__ void act_q8_k(const float* x, float* y, u64 blocks) {
    u64 b = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;
    int lane = threadIdx.x & 31;
    float v[8];
    float iscale = q8_k_iscale(x + b * 256, lane, v);
    float d = iscale == 0.f ? 0.f : 1.f / iscale;
#pragma unroll
    for (int i = 0; i < 8; i++) y[b * 256 + 8 * lane + i] = (float)q8_k_quant(iscale, v[i]) * d;
}

// The same blocks as integers, for the integer dot products (matvec_i8_* in quant.cu): per block
// of 256, Q8K_BLOCK_BYTES bytes — the scale d (f32, 0 for a block of zeros), the sums of each 16
// quants (i16), the quants (i8). Lane `lane` of the warp that writes block `ob` from the 256
// values at `xb` (which every lane of the warp sees) holds values 8·lane .. 8·lane + 7
// (q8_k_iscale), so a group of 16 quants is two lanes' (one exchange for its sum) and its quants
// two words.
template <bool CG> __device__ void q8_k_block(const float* xb, u8* ob, int lane) {
    float v[8];
    float iscale = q8_k_iscale<CG>(xb, lane, v);
    u32 w[2] = {0u, 0u};
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int q = q8_k_quant(iscale, v[i]);
        sum += q;
        w[i >> 2] |= (u32)(u8)(i8)q << (8 * (i & 3));
    }
    u32* qs = (u32*)(ob + Q8K_QS);
    qs[2 * lane] = w[0];
    qs[2 * lane + 1] = w[1];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if ((lane & 1) == 0) ((short*)(ob + Q8K_BSUMS))[lane >> 1] = (short)sum;
    if (lane == 0) *(float*)ob = iscale == 0.f ? 0.f : 1.f / iscale;
}

// One warp per block.
extern "C" __global__ void act_q8_k_blocks(const float* x, u8* out, u64 blocks) {
    u64 b = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;
    q8_k_block(x + b * 256, out + b * Q8K_BLOCK_BYTES, threadIdx.x & 31);
}

// A one-token integer product whose input came without blocks (attention's output): the block's
// warps first make the input's Q8_K blocks in shared memory — the bytes act_q8_k_blocks makes —
// then take their rows as matvec_i8_* does (n is 1). One launch instead of two; every block quantizes the
// input again (at most I8F_MAX_BLOCKS blocks of 256: wider inputs take act_q8_k_blocks).
#define I8F_MAX_BLOCKS 48
template <int TY>
__device__ void matvec_i8f_body(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, int cols,
                                const float* X, const float* bias, int wpr, float* Y) {
    __shared__ uint4 xq_vec[I8F_MAX_BLOCKS * Q8K_BLOCK_BYTES / 16];
    u8* xq = (u8*)xq_vec;
    for (int b = threadIdx.y; b < cols / 256; b += blockDim.y)
        q8_k_block(X + (u64)b * 256, xq + b * Q8K_BLOCK_BYTES, threadIdx.x);
    __syncthreads();
    matvec_i8_rows<TY, 1>(W, row_stride, rows_out, row_ids, cols, xq, 1, bias, wpr, Y, blockIdx.x);
}

// After a one-token product Y of `width` rows, its launch's last block (`last_arrival` at
// `done`) does what `add_rms_norm` of one row in `vt` threads does — res += Y, out = res /
// rms(res) * nw, and out's Q8_K blocks at `q8` unless null — the same bytes, without a launch of
// its own (the residual add and norm after a layer's attention output and FFN down products).
__device__ void then_add_rms_norm(const float* Y, int width, float* res, const float* nw, float* out, float eps,
                                  u8* q8, int vt, u32* done) {
    if (!last_arrival(done, gridDim.x)) return;
    norm_row<true>(res, Y, nw, out, width, eps, vt);
    if (q8) norm_row_q8_k(out, q8, width);
}

// After a product Y of `n` tokens (n at most the block's warps), its launch's last block does
// what `add_rms_norm` of those n rows does, warp t row t (`add_norm_row_warp`): the same bytes.
__device__ void then_add_rms_norm_rows(const float* Y, int width, int n, float* res, const float* nw, float* out,
                                       float eps, u8* q8, int vt, u32* done) {
    if (!last_arrival(done, gridDim.x)) return;
    int t = (threadIdx.x + blockDim.x * threadIdx.y) >> 5, lane = threadIdx.x & 31;
    if (t >= n) return;
    u64 off = (u64)t * width;
    add_norm_row_warp(res + off, Y + off, nw, out + off, width, eps,
                      q8 ? q8 + (u64)t * (width / 256) * Q8K_BLOCK_BYTES : nullptr, vt, lane);
}

// matvec_i8f_*: as described above; matvec_i8_norm_* and matvec_i8f_norm_*: matvec_i8_* and
// matvec_i8f_*, then `then_add_rms_norm`; matvec_i8n_norm_*: matvec_i8n_*, then
// `then_add_rms_norm_rows` (a batch of up to 8 tokens).
#define MATVEC_I8F_KERNELS(t, TY)                                                                               \
    extern "C" __global__ void I8_ONE_BOUNDS matvec_i8f_##t(const u8* W, u64 row_stride, int rows_out,         \
                                                            const u32* row_ids, int cols, const float* X, int n, \
                                                            const float* bias, int wpr, float* Y) {              \
        matvec_i8f_body<TY>(W, row_stride, rows_out, row_ids, cols, X, bias, wpr, Y);                           \
    }                                                                                                           \
    extern "C" __global__ void I8_ONE_BOUNDS matvec_i8_norm_##t(                                                \
        const u8* W, u64 row_stride, int rows_out, const u32* row_ids, int cols, const u8* Xq, int n,           \
        const float* bias, int wpr, float* Y, float* res, const float* nw, float* out, float eps, u8* q8, int vt, \
        u32* done) {                                                                                            \
        matvec_i8_rows<TY, 1>(W, row_stride, rows_out, row_ids, cols, Xq, 1, bias, wpr, Y, blockIdx.x);       \
        then_add_rms_norm(Y, rows_out, res, nw, out, eps, q8, vt, done);                                        \
    }                                                                                                           \
    extern "C" __global__ void I8_ONE_BOUNDS matvec_i8f_norm_##t(                                               \
        const u8* W, u64 row_stride, int rows_out, const u32* row_ids, int cols, const float* X, int n,         \
        const float* bias, int wpr, float* Y, float* res, const float* nw, float* out, float eps, u8* q8, int vt, \
        u32* done) {                                                                                            \
        matvec_i8f_body<TY>(W, row_stride, rows_out, row_ids, cols, X, bias, wpr, Y);                           \
        then_add_rms_norm(Y, rows_out, res, nw, out, eps, q8, vt, done);                                        \
    }                                                                                                           \
    extern "C" __global__ void matvec_i8n_norm_##t(                                                             \
        const u8* W, u64 row_stride, int rows_out, const u32* row_ids, int cols, const u8* Xq, int n,           \
        const float* bias, int wpr, float* Y, float* res, const float* nw, float* out, float eps, u8* q8, int vt, \
        u32* done) {                                                                                            \
        matvec_i8_rows<TY, I8N_MAX>(W, row_stride, rows_out, row_ids, cols, Xq, n, bias, wpr, Y, blockIdx.x);   \
        then_add_rms_norm_rows(Y, rows_out, n, res, nw, out, eps, q8, vt, done);                                \
    }
MATVEC_I8F_KERNELS(q4_k, TY_Q4_K)
MATVEC_I8F_KERNELS(q6_k, TY_Q6_K)
#undef MATVEC_I8F_KERNELS


// `activate_mul` of Q8_K block `b` (256 values) of `up` and `gate`, then written as that Q8_K
// block to `out`, by a block of 256 threads (one or two dimensions), a value a thread: the same
// values and bytes as `activate_mul` then `act_q8_k_blocks`. `gate` and `up` are read past the
// L1 cache (other blocks of the launch may have written them: `last_arrival`).
__device__ void activate_mul_q8_k_block(float* up, const float* gate, int f, u8* out, u64 b) {
    __shared__ float vals[256];
    int t = threadIdx.x + blockDim.x * threadIdx.y, lane = t & 31;
    float x = __ldcg(up + b * 256 + t) * act_fn(__ldcg(gate + b * 256 + t), f);
    up[b * 256 + t] = x;
    vals[t] = x;
    // The block's largest magnitude, then the lowest index holding it (as q8_k_iscale).
    float amax = block_max(fabsf(x));
    int first = block_min(fabsf(x) == amax ? t : 256);
    float iscale = amax == 0.f || first >= 256 ? 0.f : -127.f / vals[first];
    u8* ob = out + b * Q8K_BLOCK_BYTES;
    int q = q8_k_quant(iscale, x);
    ((i8*)(ob + Q8K_QS))[t] = (i8)q;
    // The sums of each 16 quants: lanes 0..15 of a warp are group 2w, lanes 16..31 group 2w + 1.
    int sum = q;
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if ((lane & 15) == 0) ((short*)(ob + Q8K_BSUMS))[t >> 4] = (short)sum;
    if (t == 0) *(float*)ob = iscale == 0.f ? 0.f : 1.f / iscale;
}

// One thread block of 256 per Q8_K block, so that an FFN's 35 blocks keep 35 multiprocessors
// busy rather than 35 warps (H100, Qwen2.5-1.5B's 8960 values, ncu: 11.0 µs a launch with a warp
// a block, 3.6 µs so).
extern "C" __global__ void activate_mul_q8_k(float* up, const float* gate, int f, u8* out, u64 blocks) {
    if (blockIdx.x >= blocks) return;
    activate_mul_q8_k_block(up, gate, f, out, blockIdx.x);
}

// The gate and up products of one token (`matvec_i8x3_*` with two weights of `r0` rows, a
// multiple of 256), then the gated activation and its Q8_K blocks (`activate_mul_q8_k`) without
// a launch of its own: the product blocks that write rows of Q8_K block q count at done[q] (256
// / rows-a-block of each weight's), and the last of them makes that block
// (`activate_mul_q8_k_block`). A launch's blocks of 8 warps.
#define MATVEC_I8X3_ACT_KERNEL(t, TY)                                                                        \
    extern "C" __global__ void I8_ONE_BOUNDS matvec_i8x3_act_##t(                                            \
        const u8* Xq, int cols, int wpr, int nb0, int nb01, const u8* W0, u64 s0, int r0, const float* b0,   \
        float* y0, const u8* W1, u64 s1, int r1, const float* b1, float* y1, const u8* W2, u64 s2, int r2,   \
        const float* b2, float* y2, int f, u8* out, u32* done) {                                             \
        int b = blockIdx.x, up = b >= nb0;                                                                   \
        if (!up)                                                                                             \
            matvec_i8_rows<TY, 1>(W0, s0, r0, 0, cols, Xq, 1, b0, wpr, y0, b);                               \
        else                                                                                                 \
            matvec_i8_rows<TY, 1>(W1, s1, r1, 0, cols, Xq, 1, b1, wpr, y1, b - nb0);                         \
        int rows = blockDim.y / wpr, q = (up ? b - nb0 : b) * rows / 256;                                    \
        if (last_arrival(done + q, 2 * (256 / rows))) activate_mul_q8_k_block(y1, y0, f, out, q);           \
    }
MATVEC_I8X3_ACT_KERNEL(q4_k, TY_Q4_K)
MATVEC_I8X3_ACT_KERNEL(q6_k, TY_Q6_K)
#undef MATVEC_I8X3_ACT_KERNEL

// The gate and up products of n tokens (`matvec_i8nx3` with two weights of `r0` rows, a
// multiple of 256; each weight's type `t0`, `t1`), then the gated activation of each token and
// its Q8_K blocks without a launch of their own: as `matvec_i8x3_act_*`, the last of the blocks
// writing rows of Q8_K block q makes block q of every token, warp t token t (up to 8): the
// activated values written back to `y1`, then their Q8_K block (`q8_k_block`: as
// `act_q8_k_blocks` makes it of those values, and `activate_mul_q8_k` too). `out`: token t's
// blocks from t · (r0 / 256) on.
extern "C" __global__ void matvec_i8nx3_act(const u8* Xq, int n, int cols, int wpr, int nb0, int nb01, int t0,
                                            const u8* W0, u64 s0, int r0, const float* b0, float* y0, int t1,
                                            const u8* W1, u64 s1, int r1, const float* b1, float* y1, int t2,
                                            const u8* W2, u64 s2, int r2, const float* b2, float* y2, int f, u8* out,
                                            u32* done) {
    int b = blockIdx.x, up = b >= nb0;
    if (!up)
        matvec_i8n_rows_of(t0, W0, s0, r0, cols, Xq, n, b0, wpr, y0, b);
    else
        matvec_i8n_rows_of(t1, W1, s1, r1, cols, Xq, n, b1, wpr, y1, b - nb0);
    int rows = blockDim.y / wpr, q = (up ? b - nb0 : b) * rows / 256;
    if (!last_arrival(done + q, 2 * (256 / rows))) return;
    int t = (threadIdx.x + blockDim.x * threadIdx.y) >> 5, lane = threadIdx.x & 31;
    if (t >= n) return;
    float* u = y1 + (u64)t * r1 + (u64)q * 256;
    const float* g = y0 + (u64)t * r0 + (u64)q * 256;
#pragma unroll
    for (int i = 0; i < 8; i++) u[lane + 32 * i] = __ldcg(u + lane + 32 * i) * act_fn(__ldcg(g + lane + 32 * i), f);
    __syncwarp();
    q8_k_block(u, out + ((u64)t * (r0 / 256) + q) * Q8K_BLOCK_BYTES, lane);
}
