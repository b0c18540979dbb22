// Batched products on the tensor cores: Y[t][r] = dot(W[row r], X[t]) for a batch of tokens
// (prompts, several sequences decoding together), with `mma.sync` m16n8k16 on f16 inputs and
// f32 sums. Each block computes a tile of MMA_BM weight rows by MMA_BN tokens: per step of
// MMA_BK columns its threads decode the tile's weight units (decode_unit, kernels/quant.cu) into
// shared memory and copy the tokens' values beside them, then each warp multiplies its 32 rows
// by 32 tokens. A weight unit is decoded once per MMA_BN tokens (matmul_body decodes it once
// per MM_TOKENS).
//
// Every value is held as two f16, hi = f16(v) and lo = f16(v - hi) (22 bits of significand
// between them), and each tile's product is hi·hi + hi·lo + lo·hi (lo·lo, below 2^-22 of the
// product, is left out): as exact as f32 products, where one f16 each would round every weight
// and input to 11 bits (a logit moved by 1% on the small Qwen2 check). To keep the low halves
// out of f16's subnormals, weights are multiplied by MMA_W_SCALE and each token's values by a
// power of two that brings its largest |x| to [2^13, 2^14) (`act_f16_rows`); the sums are
// divided back. Compiled after quant.cu (one translation unit; see its head).

#define MMA_BM 64
#define MMA_BN 64
#define MMA_BK 64
// Threads per block: four warps, two by two over the tile.
#define MMA_THREADS 128
// 32-bit words per shared row: 32 of values and 4 of padding, so the 8 rows one fragment load
// touches (36 words apart) fall in 8 distinct banks.
#define MMA_ROW_WORDS 36
// Weights are multiplied by this before their split (a power of two: exact); a |w| up to 1000
// stays below f16's largest finite value (65504).
#define MMA_W_SCALE 64.0f

__device__ __forceinline__ u16 f32_to_f16(float f) {
#ifdef GATESTREAM_HOST_EMULATION
    return gsemu::float_to_half(f);
#else
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// d += A · B for one 16x8 tile of a warp (the PTX fragment layouts of m16n8k16 .f16: a holds
// rows g and g + 8, columns 2q, 2q + 1 and those + 8; b columns g, rows 2q, 2q + 1 and + 8; d
// rows g and g + 8, columns 2q and 2q + 1; g = lane / 4, q = lane % 4).
#ifndef GATESTREAM_HOST_EMULATION
__device__ __forceinline__ void mma_16816(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// A warp's 2 x 4 tiles of one 16-column step: d[mi][ni] += a[1][mi]·b[0][ni] + a[0][mi]·b[1][ni]
// + a[0][mi]·b[0][ni] (low halves' terms first; [0] the high halves, [1] the low ones), as
// three mma.sync each, for the first `live` token tiles (the others hold no token: a batch
// narrower than the block's 64). (The emulated driver exchanges the warp's fragments once.)
__device__ __forceinline__ void mma_tiles(float (&d)[2][4][4], const u32 (&a)[2][2][4], const u32 (&b)[2][4][2],
                                          int live) {
#ifdef GATESTREAM_HOST_EMULATION
    gsemu::mma_tiles(&d[0][0][0], &a[0][0][0], &b[0][0][0], live);
#else
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            if (ni < live) {  // the same for the whole warp
                mma_16816(d[mi][ni], a[1][mi], b[0][ni]);
                mma_16816(d[mi][ni], a[0][mi], b[1][ni]);
                mma_16816(d[mi][ni], a[0][mi], b[0][ni]);
            }
        }
#endif
}

// X [n][cols] f32 -> out: n rows of cols f16 (hi), n rows of cols f16 (lo), then n f32 scales:
// row t's values divided by scale[t], a power of two that brings its largest |x| to [2^13,
// 2^14) (1 for a row of zeros), split as hi + lo. One block a row; cols even.
extern "C" __global__ void act_f16_rows(const float* X, int cols, int n, u16* out) {
    __shared__ float part[MMA_THREADS];
    int t = blockIdx.x;
    const float* x = X + (u64)t * cols;
    float m = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, fabsf(x[i]));
    part[threadIdx.x] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) part[threadIdx.x] = fmaxf(part[threadIdx.x], part[threadIdx.x + s]);
        __syncthreads();
    }
    float big = part[0], scale = 1.f;
    // (bounded: an infinite or NaN |x| leaves the loops with some power of two)
    for (int k = 0; k < 256 && big >= 16384.f * scale; k++) scale *= 2.f;
    for (int k = 0; k < 256 && big > 0.f && big < 8192.f * scale; k++) scale *= 0.5f;
    float inv = 1.f / scale;  // exact: a power of two (scale stays a normal float)
    u16* hi = out + (u64)t * cols;
    u16* lo = out + ((u64)n + t) * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = x[i] * inv;
        u16 h = f32_to_f16(v);
        hi[i] = h;
        lo[i] = f32_to_f16(v - f16_to_f32(h));
    }
    if (threadIdx.x == 0) ((float*)(out + 2 * (u64)n * cols))[t] = scale;
}

// grid = (ceil(rows_out / MMA_BM), ceil(n / MMA_BN), parts), MMA_THREADS threads; cols a
// multiple of 32 (whole units). Xh as act_f16_rows writes it (hi rows, lo rows, scales). With parts > 1 (few tiles, long rows: a down projection for a few tokens) block z
// sums its share of the units (an even count; the last share what is left) into Y + z * n *
// rows_out, and `accumulate_reduce` (kernels/quant.cu) adds the parts in order onto zeros: the
// result never depends on scheduling.
// A warp's 2 x 4 tiles of sums (4 a lane each), set to zero.
__device__ __forceinline__ void zero_tiles(float (&t)[2][4][4]) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) t[i][j][k] = 0.f;
}

// A warp's fragments of one 8-word step from shared rows `row_words` apart (the m16n8k16 f16 and
// m16n8k32 s8 layouts, in words): A of rows r0 + mi * 16 (+ g, + g + 8), words w0 + q and
// w0 + q + 4; B of tokens t0 + ni * 8 + g, the same words.
__device__ __forceinline__ void load_a_frags(const u32* sh, int row_words, int r0, int w0, u32 (&a)[2][4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; mi++) {
        const u32* p = sh + (r0 + mi * 16 + g) * row_words + w0 + q;
        a[mi][0] = p[0];
        a[mi][1] = p[8 * row_words];
        a[mi][2] = p[4];
        a[mi][3] = p[8 * row_words + 4];
    }
}

__device__ __forceinline__ void load_b_frags(const u32* sh, int row_words, int t0, int w0, u32 (&b)[4][2]) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int ni = 0; ni < 4; ni++) {
        const u32* p = sh + (t0 + ni * 8 + g) * row_words + w0 + q;
        b[ni][0] = p[0];
        b[ni][1] = p[4];
    }
}

// A warp's 32 x 32 sums into Y [n][rows_out] from row r0 and token t0 on (those past the ends
// left out), each times scale[t] / div where `scale` is given.
__device__ __forceinline__ void store_tiles(const float (&acc)[2][4][4], float* Y, int r0, int t0, int rows_out, int n,
                                            const float* scale, float div) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int rr = r0 + mi * 16 + g + 8 * (i >> 1), t = t0 + ni * 8 + 2 * q + (i & 1);
                if (rr < rows_out && t < n)
                    Y[(u64)t * rows_out + rr] = scale ? acc[mi][ni][i] * (scale[t] / div) : acc[mi][ni][i];
            }
}

template <int TY>
__device__ void mma_body(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, int cols, const u16* Xh,
                         int n, float* Y) {
    // [0]: the high halves, [1]: the low ones.
    __shared__ u32 ws[2][MMA_BM * MMA_ROW_WORDS];
    __shared__ u32 xs[2][MMA_BN * MMA_ROW_WORDS];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int m0 = blockIdx.x * MMA_BM, n0 = blockIdx.y * MMA_BN;
    int wm = (warp & 1) * 32, wn = (warp >> 1) * 32;
    // The unit this thread decodes each step: row dr of the tile, the step's unit du.
    int dr = tid >> 1, du = tid & 1;
    int r = min(m0 + dr, rows_out - 1);  // past the end: the last row again (computed, not stored)
    const u8* row = W + (u64)(row_ids ? row_ids[r] : (u32)r) * row_stride;
    const u32* xhi = (const u32*)Xh;
    const u32* xlo = (const u32*)(Xh + (u64)n * cols);
    int row_words = cols / 2;
    float acc[2][4][4];
    zero_tiles(acc);
    // The warp's 8-token tiles that hold tokens of the batch (0 to 4).
    int live = min(4, max(0, (n - n0 - wn + 7) / 8));
    int units = cols / 32, parts = gridDim.z;
    int per = ((units + parts - 1) / parts + 1) & ~1;
    int u_end = min(units, (int)(blockIdx.z + 1) * per);
    Y += (u64)blockIdx.z * n * rows_out;
    for (int u0 = blockIdx.z * per; u0 < u_end; u0 += 2) {
        // This step's sums, added to acc once: acc's rounding then comes once a step, not at
        // every instruction (2e-6 of the result against f64 the other way, 10x the FMA loops').
        float step[2][4][4];
        zero_tiles(step);
        {
            int at = dr * MMA_ROW_WORDS + du * 16;
            if (u0 + du < u_end) {
                float w[32];
                decode_unit<TY>(row, u0 + du, w);
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    float a = w[2 * i] * MMA_W_SCALE, b = w[2 * i + 1] * MMA_W_SCALE;
                    u16 ha = f32_to_f16(a), hb = f32_to_f16(b);
                    ws[0][at + i] = (u32)ha | ((u32)hb << 16);
                    ws[1][at + i] = (u32)f32_to_f16(a - f16_to_f32(ha)) | ((u32)f32_to_f16(b - f16_to_f32(hb)) << 16);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 16; i++) ws[0][at + i] = ws[1][at + i] = 0;
            }
        }
        // The tokens' values: each warp copies whole rows, a word a lane (coalesced).
        int words = min(32, (u_end - u0) * 16);
#pragma unroll 4
        for (int i = 0; i < MMA_BN / 4; i++) {
            int tt = warp + 4 * i, t = n0 + tt;
            bool in = t < n && lane < words;
            u64 at = (u64)t * row_words + u0 * 16 + lane;
            xs[0][tt * MMA_ROW_WORDS + lane] = in ? xhi[at] : 0u;
            xs[1][tt * MMA_ROW_WORDS + lane] = in ? xlo[at] : 0u;
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < MMA_BK / 2; ks += 8) {
            u32 a[2][2][4], b[2][4][2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                load_a_frags(ws[h], MMA_ROW_WORDS, wm, ks, a[h]);
                load_b_frags(xs[h], MMA_ROW_WORDS, wn, ks, b[h]);
            }
            mma_tiles(step, a, b, live);
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int k = 0; k < 4; k++) acc[i][j][k] += step[i][j][k];
        __syncthreads();
    }
    store_tiles(acc, Y, m0 + wm, n0 + wn, rows_out, n, (const float*)(Xh + 2 * (u64)n * cols), MMA_W_SCALE);
}

#define MMA_KERNEL(NAME, TY)                                                                             \
    extern "C" __global__ void mma_##NAME(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, \
                                          int cols, const u16* Xh, int n, float* Y) {                    \
        mma_body<TY>(W, row_stride, rows_out, row_ids, cols, Xh, n, Y);                                  \
    }

MMA_KERNEL(f32, TY_F32)
MMA_KERNEL(f16, TY_F16)
MMA_KERNEL(bf16, TY_BF16)
MMA_KERNEL(q4_0, TY_Q4_0)
MMA_KERNEL(q4_1, TY_Q4_1)
MMA_KERNEL(q5_0, TY_Q5_0)
MMA_KERNEL(q8_0, TY_Q8_0)
MMA_KERNEL(q4_k, TY_Q4_K)
MMA_KERNEL(q5_k, TY_Q5_K)
MMA_KERNEL(q6_k, TY_Q6_K)
MMA_KERNEL(iq4_nl, TY_IQ4_NL)
MMA_KERNEL(mxfp4, TY_MXFP4)
MMA_KERNEL(q2_k, TY_Q2_K)
MMA_KERNEL(q3_k, TY_Q3_K)
MMA_KERNEL(iq4_xs, TY_IQ4_XS)
MMA_KERNEL(q5_1, TY_Q5_1)

// ---------------------------------------------------------------------------------------------
// Integer tiles (llama.cpp's MMQ approach): batched products of Q4_K and Q6_K rows with the
// activations as Q8_K blocks (act_q8_k_blocks: per token and 256 values a float scale, 16 sums
// of 16 quants, 256 signed 8-bit quants), on the tensor cores as 8-bit integers with int32 sums.
// Each block computes MMA_BM rows by MMA_BN tokens, a super-block (256 values) a step: its
// threads unpack the tile's weight quants into shared memory as bytes (Q4_K 0..15, Q6_K 0..63)
// beside each row's scales, and copy the tokens' quants, sums and scales; then each warp
// multiplies its 32 rows by 32 tokens: Q4_K a 32-value sub-block an `mma` (m16n8k32), its sums
// times the row's sub-block scale added as integers, the mins' term sum_s m[s]·(y sums of s) one
// f16 `mma` (m16n8k16: the mins, at most 63, and the sums of 16 quants, at most 2032 in
// magnitude, are exact f16 integers, each product and their sum exact in f32); Q6_K a 16-value
// group an `mma` (m16n8k16), minus 32 times the group's y sum, times its scale. A super-block's
// integer sums are exact and its value is the one-token integer products' expression
// (q4_k_i8_dot, q6_k_i8_dot in quant.cu) to the bit; super-blocks are added in order.

// 32-bit words per shared row of quants: 64 of values and 4 of padding, so the 8 rows a fragment
// load touches (68 words apart) fall in 8 distinct banks.
#define MMQ_ROW_WORDS 68

#ifndef GATESTREAM_HOST_EMULATION
__device__ __forceinline__ void mma_s8_16832(int* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_s8_16816(int* d, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]));
}
#endif

// A warp's 2 x 4 tiles of one K-value step of 8-bit products, d[mi][ni] += a[mi]·b[ni], for the
// first `live` token tiles. K = 32: a tile's A is 4 words (rows g and g + 8, words q and q + 4),
// its B 2 (column g, words q and q + 4); K = 16: A 2 words (rows g and g + 8, word q), B 1 (word
// q) — in words the f16 m16n8k16 / m16n8k8 layouts.
template <int K>
__device__ __forceinline__ void mma_s8_tiles(int (&d)[2][4][4], const u32 (&a)[2][K / 8], const u32 (&b)[4][K / 16],
                                             int live) {
#ifdef GATESTREAM_HOST_EMULATION
    gsemu::mma_s8_tiles(&d[0][0][0], &a[0][0], &b[0][0], live, K);
#else
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            if (ni < live) {
                if (K == 32)
                    mma_s8_16832(d[mi][ni], a[mi], b[ni]);
                else
                    mma_s8_16816(d[mi][ni], a[mi], b[ni]);
            }
        }
#endif
}

// A warp's 2 x 4 tiles of one f16 m16n8k16 product each, d[mi][ni] += a[mi]·b[ni].
__device__ __forceinline__ void mma_f16_once(float (&d)[2][4][4], const u32 (&a)[2][4], const u32 (&b)[4][2], int live) {
#ifdef GATESTREAM_HOST_EMULATION
    gsemu::mma_f16_once(&d[0][0][0], &a[0][0], &b[0][0], live);
#else
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
            if (ni < live) mma_16816(d[mi][ni], a[mi], b[ni]);
#endif
}

__device__ __forceinline__ void zero_int_tiles(int (&t)[2][4][4]) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) t[i][j][k] = 0;
}

// Two small integers (|v| <= 2048: exact) as the f16 pair of one word; one, twice.
__device__ __forceinline__ u32 f16_pair(int lo, int hi) {
    return (u32)f32_to_f16((float)lo) | ((u32)f32_to_f16((float)hi) << 16);
}
__device__ __forceinline__ u32 f16_twice(int v) {
    u32 h = f32_to_f16((float)v);
    return h | (h << 16);
}

// A thread's half super-block of weight bytes for the integer tiles, as loaded (mmq_load): the
// quants (Q4_K: bytes 32j..32j+31 of the quants for j = 2du, 2du + 1; Q6_K: ql bytes 64du..64du+63
// and qh bytes 32du..32du+31) and, for the thread of half 0, the block's scales and d (Q4_K: the
// first 16 bytes, d, dmin and the 12 scale bytes; Q6_K: the 16 scale bytes, and d).
template <int TY> struct MmqRaw {
    u32 q[TY == TY_Q4_K ? 16 : 24];
    u32 h[4];
    u16 d;
};

template <int N, int AT, int M> __device__ __forceinline__ void ld_words_at(const u8* p, u32 (&w)[M]) {
    u32 t[N];
    ld_words(p, t);
#pragma unroll
    for (int i = 0; i < N; i++) w[AT + i] = t[i];
}

// Byte i of four little-endian words.
__device__ __forceinline__ u32 word_byte(const u32 (&w)[4], int i) { return (w[i >> 2] >> (8 * (i & 3))) & 0xffu; }

template <int TY> __device__ __forceinline__ void mmq_load(const u8* row, int sb, int du, MmqRaw<TY>& r) {
    if (TY == TY_Q4_K) {
        const u8* b = row + 144 * (u64)sb;
        ld_words_at<8, 0>(b + 16 + 32 * (2 * du), r.q);
        ld_words_at<8, 8>(b + 16 + 32 * (2 * du + 1), r.q);
        if (du == 0) ld_words(b, r.h);
    } else {
        const u8* b = row + 210 * (u64)sb;
        const u8* ql = b + 64 * du;
        ld_words_at<8, 0>(ql, r.q);
        ld_words_at<8, 8>(ql + 32, r.q);
        ld_words_at<8, 16>(b + 128 + 32 * du, r.q);
        if (du == 0) {
            ld_words(b + 192, r.h);
            r.d = ld16(b + 208);
        }
    }
}

// `r` into the tile's shared rows: the quants as bytes of values (Q4_K 0..15, Q6_K 0..63) into
// `wrow`, and for half 0 the scales (and mins) into `sc` and d (and dmin) into `d`.
template <int TY>
__device__ __forceinline__ void mmq_unpack(const MmqRaw<TY>& r, int du, u32* wrow, int* sc, float* d) {
    if (TY == TY_Q4_K) {
        // Bytes 32j..32j+31 of the quants: sub-block 2j in the low nibbles, 2j + 1 in the high.
#pragma unroll
        for (int jj = 0; jj < 2; jj++) {
            int j = 2 * du + jj;
#pragma unroll
            for (int w = 0; w < 8; w++) {
                u32 v = r.q[8 * jj + w];
                wrow[16 * j + w] = v & 0x0f0f0f0fu;
                wrow[16 * j + 8 + w] = (v >> 4) & 0x0f0f0f0fu;
            }
        }
        if (du == 0) {
            // ggml's get_scale_min_k4 on the 12 scale bytes (bytes 4..15 of the block).
#pragma unroll
            for (int s = 0; s < 8; s++) {
                u32 q = word_byte(r.h, 4 + s), q4 = word_byte(r.h, 8 + s);
                if (s < 4) {
                    sc[s] = (int)(q & 63);
                    sc[8 + s] = (int)(q4 & 63);
                } else {
                    u32 lo = word_byte(r.h, 4 + s - 4), hi = word_byte(r.h, 4 + s);
                    sc[s] = (int)((q4 & 0x0f) | ((lo >> 6) << 4));
                    sc[8 + s] = (int)((q4 >> 4) | ((hi >> 6) << 4));
                }
            }
            d[0] = f16_to_f32((u16)(r.h[0] & 0xffffu));
            d[1] = f16_to_f32((u16)(r.h[0] >> 16));
        }
    } else {
        // Half du (values 128du..128du+127): quarter k from the low (k even) or high nibbles of
        // ql (bytes 32 (k % 2) on) and bits 2k, 2k + 1 of qh.
#pragma unroll
        for (int w = 0; w < 8; w++) {
            u32 l0 = r.q[w], l1 = r.q[8 + w], h = r.q[16 + w];
            wrow[32 * du + w] = (l0 & 0x0f0f0f0fu) | ((h & 0x03030303u) << 4);
            wrow[32 * du + 8 + w] = (l1 & 0x0f0f0f0fu) | (((h >> 2) & 0x03030303u) << 4);
            wrow[32 * du + 16 + w] = ((l0 >> 4) & 0x0f0f0f0fu) | (((h >> 4) & 0x03030303u) << 4);
            wrow[32 * du + 24 + w] = ((l1 >> 4) & 0x0f0f0f0fu) | (((h >> 6) & 0x03030303u) << 4);
        }
        if (du == 0) {
#pragma unroll
            for (int s = 0; s < 16; s++) sc[s] = (int)(i8)(u8)word_byte(r.h, s);
            d[0] = f16_to_f32(r.d);
        }
    }
}

// grid = (ceil(rows_out / MMA_BM), ceil(n / MMA_BN), parts), MMA_THREADS threads; cols a multiple
// of 256. Xq: token t's Q8_K blocks from t * (cols / 256) on. With parts > 1 block z sums its
// share of the super-blocks into Y + z * n * rows_out, and `accumulate_reduce` adds the parts in
// order onto zeros (as mma_body's). PF: each thread's weight bytes for the next super-block are
// loaded into registers (`MmqRaw`) before the tile's products of this one, so their latency is
// spent while the tensor cores work (`mmq_*`, GATESTREAM_CUDA_MMQ_PREFETCH=1: NVRTC 12.9, sm_90,
// 180 / 169 registers, 2 blocks a multiprocessor); without, loaded where they are unpacked
// (`mmq_plain_*`, the default: 134 / 140, 3 blocks). The same values either way.
template <int TY, bool PF>
__device__ void mmq_body(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, int cols, const u8* Xq, int n,
                         float* Y) {
    __shared__ u32 ws[MMA_BM * MMQ_ROW_WORDS];
    __shared__ u32 xs[MMA_BN * MMQ_ROW_WORDS];
    // (rows of 17 words: the 8 rows or tokens one read touches fall in distinct banks)
    __shared__ int wsc[MMA_BM][17];  // Q4_K: the 8 sub-blocks' scales, then their mins; Q6_K: the 16 scales
    __shared__ float wd[MMA_BM][2];  // d (and Q4_K's dmin)
    __shared__ int xsum[MMA_BN][17];  // each token's 16 sums of 16 quants
    __shared__ float xd[MMA_BN];
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    int m0 = blockIdx.x * MMA_BM, n0 = blockIdx.y * MMA_BN;
    int wm = (warp & 1) * 32, wn = (warp >> 1) * 32;
    // The half super-block this thread unpacks each step: row dr of the tile, half du.
    int dr = tid >> 1, du = tid & 1;
    int r = min(m0 + dr, rows_out - 1);  // past the end: the last row again (computed, not stored)
    const u8* row = W + (u64)(row_ids ? row_ids[r] : (u32)r) * row_stride;
    int nsb = cols / 256, parts = gridDim.z;
    int per = (nsb + parts - 1) / parts;
    int sb_end = min(nsb, (int)(blockIdx.z + 1) * per);
    int live = min(4, max(0, (n - n0 - wn + 7) / 8));
    Y += (u64)blockIdx.z * n * rows_out;
    float acc[2][4][4];
    zero_tiles(acc);
    int sb0 = (int)blockIdx.z * per;
    MmqRaw<TY> raw;
    if (PF && sb0 < sb_end) mmq_load(row, sb0, du, raw);
    for (int sb = sb0; sb < sb_end; sb++) {
        if (!PF) mmq_load(row, sb, du, raw);
        mmq_unpack(raw, du, ws + dr * MMQ_ROW_WORDS, wsc[dr], wd[dr]);
        // The tokens' blocks (76 words: the scale, 8 words of sums, 3 unused, 64 of quants): a warp a token
        // at a time, a word a lane.
#pragma unroll 4
        for (int i = 0; i < MMA_BN / 4; i++) {
            int tt = warp + 4 * i, t = n0 + tt;
            bool in = t < n;
            const u32* blk = (const u32*)(Xq + ((u64)(in ? t : 0) * nsb + sb) * Q8K_BLOCK_BYTES);
            xs[tt * MMQ_ROW_WORDS + lane] = in ? blk[Q8K_QS / 4 + lane] : 0u;
            xs[tt * MMQ_ROW_WORDS + 32 + lane] = in ? blk[Q8K_QS / 4 + 32 + lane] : 0u;
            if (lane < 16) xsum[tt][lane] = in ? (int)((const short*)(blk + Q8K_BSUMS / 4))[lane] : 0;
            if (lane == 16) xd[tt] = in ? *(const float*)blk : 0.f;
        }
        __syncthreads();
        // (The unpacked tile is in shared memory: the registers take the next super-block.)
        if (PF && sb + 1 < sb_end) mmq_load(row, sb + 1, du, raw);
        int qy[2][4][4];
        zero_int_tiles(qy);
        if (TY == TY_Q4_K) {
#pragma unroll
            for (int s = 0; s < 8; s++) {
                u32 a[2][4], b[4][2];
                load_a_frags(ws, MMQ_ROW_WORDS, wm, 8 * s, a);
                load_b_frags(xs, MMQ_ROW_WORDS, wn, 8 * s, b);
                int t[2][4][4];
                zero_int_tiles(t);
                mma_s8_tiles<32>(t, a, b, live);
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int sc = wsc[wm + mi * 16 + g + 8 * (i >> 1)][s];
#pragma unroll
                        for (int ni = 0; ni < 4; ni++) qy[mi][ni][i] += sc * t[mi][ni][i];
                    }
            }
            // The mins' term: A[row][k] = m[row][k / 2], B[k][token] = the token's k-th sum.
            u32 a[2][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const int* lo = wsc[wm + mi * 16 + g] + 8;
                const int* hi = wsc[wm + mi * 16 + g + 8] + 8;
                a[mi][0] = f16_twice(lo[q]);
                a[mi][1] = f16_twice(hi[q]);
                a[mi][2] = f16_twice(lo[4 + q]);
                a[mi][3] = f16_twice(hi[4 + q]);
            }
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const int* ys = xsum[wn + ni * 8 + g];
                b[ni][0] = f16_pair(ys[2 * q], ys[2 * q + 1]);
                b[ni][1] = f16_pair(ys[8 + 2 * q], ys[9 + 2 * q]);
            }
            float my[2][4][4];
            zero_tiles(my);
            mma_f16_once(my, a, b, live);
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int rl = wm + mi * 16 + g + 8 * (i >> 1), tl = wn + ni * 8 + 2 * q + (i & 1);
                        float d8 = xd[tl];
                        float d = wd[rl][0] * d8, dmin = wd[rl][1] * d8;
                        acc[mi][ni][i] += d * (float)qy[mi][ni][i] - dmin * my[mi][ni][i];
                    }
        } else {
#pragma unroll
            for (int s = 0; s < 16; s++) {
                u32 a[2][2], b[4][1];
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    const u32* p = ws + (wm + mi * 16 + g) * MMQ_ROW_WORDS + 4 * s + q;
                    a[mi][0] = p[0];
                    a[mi][1] = p[8 * MMQ_ROW_WORDS];
                }
#pragma unroll
                for (int ni = 0; ni < 4; ni++) b[ni][0] = xs[(wn + ni * 8 + g) * MMQ_ROW_WORDS + 4 * s + q];
                int t[2][4][4];
                zero_int_tiles(t);
                mma_s8_tiles<16>(t, a, b, live);
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int sc = wsc[wm + mi * 16 + g + 8 * (i >> 1)][s];
#pragma unroll
                        for (int ni = 0; ni < 4; ni++) {
                            int ys = xsum[wn + ni * 8 + 2 * q + (i & 1)][s];
                            qy[mi][ni][i] += sc * (t[mi][ni][i] - 32 * ys);
                        }
                    }
            }
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        int rl = wm + mi * 16 + g + 8 * (i >> 1), tl = wn + ni * 8 + 2 * q + (i & 1);
                        acc[mi][ni][i] += wd[rl][0] * xd[tl] * (float)qy[mi][ni][i];
                    }
        }
        __syncthreads();
    }
    store_tiles(acc, Y, m0 + wm, n0 + wn, rows_out, n, nullptr, 1.f);
}

#define MMQ_KERNEL(t, TY)                                                                                   \
    extern "C" __global__ void mmq_##t(const u8* W, u64 row_stride, int rows_out, const u32* row_ids,       \
                                       int cols, const u8* Xq, int n, float* Y) {                           \
        mmq_body<TY, true>(W, row_stride, rows_out, row_ids, cols, Xq, n, Y);                               \
    }                                                                                                       \
    extern "C" __global__ void mmq_plain_##t(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, \
                                             int cols, const u8* Xq, int n, float* Y) {                     \
        mmq_body<TY, false>(W, row_stride, rows_out, row_ids, cols, Xq, n, Y);                              \
    }

MMQ_KERNEL(q4_k, TY_Q4_K)
MMQ_KERNEL(q6_k, TY_Q6_K)
#undef MMQ_KERNEL
