// Quantized products on the GPU: the GGML block types of CUDA_TYPES (src/backend/cuda/registry.rs:
// every type the CPU path reads but the grid types IQ2_*, IQ3_*, IQ1_*), decoded 32 values at a
// time ("a unit": one legacy block, or one sub-block of a K-quant or IQ4_XS super-block) into
// registers and multiplied with f32 activations (dequantize-and-FMA). Compiled at run time by
// NVRTC with no headers, so types and f16 conversion are spelled out here. The three files of
// kernels/ are one translation unit in the order quant.cu, ops.cu, attention.cu.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define TY_F32 0
#define TY_F16 1
#define TY_BF16 2
#define TY_Q4_0 3
#define TY_Q4_1 4
#define TY_Q5_0 5
#define TY_Q8_0 6
#define TY_Q4_K 7
#define TY_Q5_K 8
#define TY_Q6_K 9
#define TY_IQ4_NL 10
#define TY_MXFP4 11
#define TY_Q2_K 12
#define TY_Q3_K 13
#define TY_IQ4_XS 14
#define TY_Q5_1 15

// Tokens one matmul block multiplies with each decoded unit (grid.y tiles the batch).
#define MM_TOKENS 8

__device__ __forceinline__ float f16_to_f32(u16 h) {
#ifdef GATESTREAM_HOST_EMULATION
    return gsemu::half_to_float(h);  // tests/cuda_emu: the kernels compiled for the CPU
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

// Two little-endian bytes at p: one half-word load where p is even (every f16 field of the block
// types), else two byte loads.
__device__ __forceinline__ u16 ld16(const u8* p) {
    return (((u64)p) & 1) == 0 ? *(const u16*)p : (u16)((u16)p[0] | ((u16)p[1] << 8));
}
__device__ __forceinline__ float ldf16(const u8* p) { return f16_to_f32(ld16(p)); }
__device__ __forceinline__ u32 ld32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// The N little-endian words at p (bytes p .. p + 4N, none past them), in as few loads as p's
// alignment allows: 16-byte loads at a multiple of 16 (N a multiple of 4), words at a multiple
// of 4, half-words at a multiple of 2, else bytes — the same values as ld32 at p + 4i. Block
// types whose blocks are not a multiple of 4 bytes (Q6_K's 210) have blocks at every alignment
// 2 apart; byte loads would take four load instructions a word.
template <int N> __device__ __forceinline__ void ld_words(const u8* p, u32 (&w)[N]) {
    u64 a = (u64)p;
    if (N % 4 == 0 && (a & 15) == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; i++) {
            uint4 v = ((const uint4*)p)[i];
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    } else if ((a & 3) == 0) {
#pragma unroll
        for (int i = 0; i < N; i++) w[i] = ((const u32*)p)[i];
    } else if ((a & 1) == 0) {
#pragma unroll
        for (int i = 0; i < N; i++) w[i] = (u32)((const u16*)p)[2 * i] | ((u32)((const u16*)p)[2 * i + 1] << 16);
    } else {
#pragma unroll
        for (int i = 0; i < N; i++) w[i] = ld32(p + 4 * i);
    }
}

// Six-bit scale and min of sub-block j of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4).
__device__ __forceinline__ void k_scale_min(int j, const u8* q, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// Elements per unit is 32 for every type; bytes per block and elements per block:
template <int TY> struct Layout;
template <> struct Layout<TY_F32> { enum { BLOCK = 1, BYTES = 4 }; };
template <> struct Layout<TY_F16> { enum { BLOCK = 1, BYTES = 2 }; };
template <> struct Layout<TY_BF16> { enum { BLOCK = 1, BYTES = 2 }; };
template <> struct Layout<TY_Q4_0> { enum { BLOCK = 32, BYTES = 18 }; };
template <> struct Layout<TY_Q4_1> { enum { BLOCK = 32, BYTES = 20 }; };
template <> struct Layout<TY_Q5_0> { enum { BLOCK = 32, BYTES = 22 }; };
template <> struct Layout<TY_Q8_0> { enum { BLOCK = 32, BYTES = 34 }; };
template <> struct Layout<TY_Q4_K> { enum { BLOCK = 256, BYTES = 144 }; };
template <> struct Layout<TY_Q5_K> { enum { BLOCK = 256, BYTES = 176 }; };
template <> struct Layout<TY_Q6_K> { enum { BLOCK = 256, BYTES = 210 }; };
template <> struct Layout<TY_IQ4_NL> { enum { BLOCK = 32, BYTES = 18 }; };
template <> struct Layout<TY_MXFP4> { enum { BLOCK = 32, BYTES = 17 }; };
template <> struct Layout<TY_Q2_K> { enum { BLOCK = 256, BYTES = 84 }; };
template <> struct Layout<TY_Q3_K> { enum { BLOCK = 256, BYTES = 110 }; };
template <> struct Layout<TY_IQ4_XS> { enum { BLOCK = 256, BYTES = 136 }; };
template <> struct Layout<TY_Q5_1> { enum { BLOCK = 32, BYTES = 24 }; };

// Values 32u..32u+31 of a row into w[].
template <int TY> __device__ __forceinline__ void decode_unit(const u8* row, int u, float* w);

template <> __device__ __forceinline__ void decode_unit<TY_F32>(const u8* row, int u, float* w) {
    const float* p = (const float*)(row) + 32 * u;
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = p[i];
}

template <> __device__ __forceinline__ void decode_unit<TY_F16>(const u8* row, int u, float* w) {
    const u8* p = row + 64 * u;
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = ldf16(p + 2 * i);
}

template <> __device__ __forceinline__ void decode_unit<TY_BF16>(const u8* row, int u, float* w) {
    const u8* p = row + 64 * u;
#pragma unroll
    for (int i = 0; i < 32; i++) w[i] = __int_as_float((int)((u32)ld16(p + 2 * i) << 16));
}

template <> __device__ __forceinline__ void decode_unit<TY_Q4_0>(const u8* row, int u, float* w) {
    const u8* b = row + 18 * u;
    float d = ldf16(b);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[2 + j];
        w[j] = (float)((int)(q & 0x0f) - 8) * d;
        w[j + 16] = (float)((int)(q >> 4) - 8) * d;
    }
}

template <> __device__ __forceinline__ void decode_unit<TY_Q4_1>(const u8* row, int u, float* w) {
    const u8* b = row + 20 * u;
    float d = ldf16(b), m = ldf16(b + 2);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[4 + j];
        w[j] = (float)(q & 0x0f) * d + m;
        w[j + 16] = (float)(q >> 4) * d + m;
    }
}

template <> __device__ __forceinline__ void decode_unit<TY_Q5_0>(const u8* row, int u, float* w) {
    const u8* b = row + 22 * u;
    float d = ldf16(b);
    u32 qh = ld32(b + 2);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[6 + j];
        int lo = (int)((q & 0x0f) | (((qh >> j) & 1) << 4));
        int hi = (int)((q >> 4) | (((qh >> (j + 16)) & 1) << 4));
        w[j] = (float)(lo - 16) * d;
        w[j + 16] = (float)(hi - 16) * d;
    }
}

template <> __device__ __forceinline__ void decode_unit<TY_Q8_0>(const u8* row, int u, float* w) {
    const u8* b = row + 34 * u;
    float d = ldf16(b);
#pragma unroll
    for (int j = 0; j < 32; j++) w[j] = (float)((i8)b[2 + j]) * d;
}

template <> __device__ __forceinline__ void decode_unit<TY_Q4_K>(const u8* row, int u, float* w) {
    const u8* b = row + 144 * (u >> 3);
    int j = u & 7;
    int shift = (j & 1) * 4;
    const u8* qs = b + 16 + 32 * (j >> 1);
    if ((((u64)b) & 15) == 0) {
        // Aligned super-block (every row of a contiguous matrix): whole-word loads.
        u32 dd = *(const u32*)b;
        u32 sw[3] = {*(const u32*)(b + 4), *(const u32*)(b + 8), *(const u32*)(b + 12)};
        u8 sc8[12];
#pragma unroll
        for (int i = 0; i < 12; i++) sc8[i] = (u8)(sw[i >> 2] >> (8 * (i & 3)));
        float sc, m;
        k_scale_min(j, sc8, &sc, &m);
        float d = f16_to_f32((u16)(dd & 0xffff)) * sc, dm = f16_to_f32((u16)(dd >> 16)) * m;
        uint4 a = ((const uint4*)qs)[0], c = ((const uint4*)qs)[1];
        u32 words[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int k = 0; k < 4; k++) w[4 * i + k] = d * (float)((words[i] >> (8 * k + shift)) & 0x0f) - dm;
        return;
    }
    float sc, m;
    k_scale_min(j, b + 4, &sc, &m);
    float d = ldf16(b) * sc, dm = ldf16(b + 2) * m;
#pragma unroll
    for (int l = 0; l < 32; l++) w[l] = d * (float)((qs[l] >> shift) & 0x0f) - dm;
}

template <> __device__ __forceinline__ void decode_unit<TY_Q5_K>(const u8* row, int u, float* w) {
    const u8* b = row + 176 * (u >> 3);
    int j = u & 7;
    float sc, m;
    k_scale_min(j, b + 4, &sc, &m);
    float d = ldf16(b) * sc, dm = ldf16(b + 2) * m;
    const u8* qh = b + 16;
    const u8* qs = b + 48 + 32 * (j >> 1);
    int shift = (j & 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int q = ((qs[l] >> shift) & 0x0f) | (((qh[l] >> j) & 1) << 4);
        w[l] = d * (float)q - dm;
    }
}

template <> __device__ __forceinline__ void decode_unit<TY_Q6_K>(const u8* row, int u, float* w) {
    const u8* b = row + 210 * (u >> 3);
    int j = u & 7;
    int half = j >> 2, quarter = j & 3;
    float d = ldf16(b + 208);
    const u8* ql = b + 64 * half + 32 * (quarter & 1);
    const u8* qh = b + 128 + 32 * half;
    const i8* scales = (const i8*)(b + 192) + 8 * half + 2 * quarter;
    int lshift = (quarter >> 1) * 4, hshift = 2 * quarter;
    float d0 = d * (float)scales[0], d1 = d * (float)scales[1];
    if ((((u64)b) & 1) == 0) {
        // Even address (a block is 210 bytes): 16-bit loads, half the instructions.
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u32 lo = ((const u16*)ql)[i], hi = ((const u16*)qh)[i];
#pragma unroll
            for (int k = 0; k < 2; k++) {
                int l = 2 * i + k;
                int q = (int)(((lo >> (8 * k + lshift)) & 0x0f) | (((hi >> (8 * k + hshift)) & 3) << 4)) - 32;
                w[l] = (l < 16 ? d0 : d1) * (float)q;
            }
        }
        return;
    }
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int q = (int)(((ql[l] >> lshift) & 0x0f) | (((qh[l] >> hshift) & 3) << 4)) - 32;
        w[l] = (l < 16 ? d0 : d1) * (float)q;
    }
}

// Q5_1: Q5_0's quants (a fifth bit per value in qh) with Q4_1's d and m.
template <> __device__ __forceinline__ void decode_unit<TY_Q5_1>(const u8* row, int u, float* w) {
    const u8* b = row + 24 * u;
    float d = ldf16(b), m = ldf16(b + 2);
    u32 qh = ld32(b + 4);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[8 + j];
        u32 lo = (q & 0x0f) | (((qh >> j) & 1) << 4);
        u32 hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4);
        w[j] = (float)lo * d + m;
        w[j + 16] = (float)hi * d + m;
    }
}

// Entry i (0..15) of a table of sixteen signed bytes held as two little-endian words, entries
// 0..7 in lo and 8..15 in hi: selected in registers (no table in memory, no divergent loads).
__device__ __forceinline__ float table16(u64 lo, u64 hi, u32 i) {
    return (float)(i8)(u8)((i < 8 ? lo : hi) >> (8 * (i & 7)));
}
// The IQ4_NL / IQ4_XS values of a 4-bit index (ggml's kvalues_iq4nl: -127, -104, -83, -65, -49,
// -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113).
#define IQ4_LO 0xf6eaddcfbfad9881ull
#define IQ4_HI 0x7159453526190d01ull
// MXFP4's E2M1 values of a 4-bit index, doubled to integers (0, 1, 2, 3, 4, 6, 8, 12, then the
// same negated; ggml's kvalues_mxfp4).
#define FP4_LO 0x0c08060403020100ull
#define FP4_HI 0xf4f8fafcfdfeff00ull

template <> __device__ __forceinline__ void decode_unit<TY_IQ4_NL>(const u8* row, int u, float* w) {
    const u8* b = row + 18 * u;
    float d = ldf16(b);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[2 + j];
        w[j] = d * table16(IQ4_LO, IQ4_HI, q & 0x0f);
        w[j + 16] = d * table16(IQ4_LO, IQ4_HI, q >> 4);
    }
}

// Half of the E8M0 scale e, 2^(e - 128), which multiplies the doubled FP4 values: exact for
// every e (2^-128 and 2^-127 are f32 subnormals; 255 is 2^127, as ggml reads it, not NaN).
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __int_as_float((int)(e < 2 ? 0x00200000u << e : (e - 1) << 23));
}

template <> __device__ __forceinline__ void decode_unit<TY_MXFP4>(const u8* row, int u, float* w) {
    const u8* b = row + 17 * u;
    float d = e8m0_half(b[0]);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u8 q = b[1 + j];
        w[j] = table16(FP4_LO, FP4_HI, q & 0x0f) * d;
        w[j + 16] = table16(FP4_LO, FP4_HI, q >> 4) * d;
    }
}

// Q2_K and Q3_K: unit j (0..7) of a super-block is quarter j % 4 of half j / 4; its value l
// (0..31) takes its two low bits from bits 2(j % 4).. of qs[32(j / 4) + l], and lies in group of
// 16 g = 2j + l / 16.
template <> __device__ __forceinline__ void decode_unit<TY_Q2_K>(const u8* row, int u, float* w) {
    const u8* b = row + 84 * (u >> 3);
    int j = u & 7, shift = 2 * (j & 3);
    float d = ldf16(b + 80), dmin = ldf16(b + 82);
    u32 q[8];
    ld_words(b + 16 + 32 * (j >> 2), q);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        u8 sc = b[2 * j + h];
        float scale = d * (float)(sc & 0x0f), m = dmin * (float)(sc >> 4);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int l = 16 * h + i;
            w[l] = scale * (float)((q[l >> 2] >> (8 * (l & 3) + shift)) & 3) - m;
        }
    }
}

// Q3_K's 6-bit scale of group g (0..15) from its 12 packed bytes, minus 32.
__device__ __forceinline__ int q3_k_scale(int g, const u8* packed) {
    int low = (packed[g & 7] >> (4 * (g >> 3))) & 0x0f;
    int high = (packed[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
    return (low | (high << 4)) - 32;
}

template <> __device__ __forceinline__ void decode_unit<TY_Q3_K>(const u8* row, int u, float* w) {
    const u8* b = row + 110 * (u >> 3);
    int j = u & 7, shift = 2 * (j & 3);
    float d = ldf16(b + 108);
    u32 q[8], hm[8];
    ld_words(b + 32 + 32 * (j >> 2), q);
    ld_words(b, hm);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float scale = d * (float)q3_k_scale(2 * j + h, b + 96);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int l = 16 * h + i, at = 8 * (l & 3);
            int v = (int)(((q[l >> 2] >> (at + shift)) & 3) | (((hm[l >> 2] >> (at + j)) & 1) << 2));
            w[l] = scale * (float)(v - 4);
        }
    }
}

// IQ4_XS: unit s (0..7) of a super-block reads 16 index bytes at qs[16s] in Q4_0's nibble order;
// its 6-bit scale is nibble s % 2 of scales_l[s / 2] with bits 2s.. of scales_h on top.
template <> __device__ __forceinline__ void decode_unit<TY_IQ4_XS>(const u8* row, int u, float* w) {
    const u8* b = row + 136 * (u >> 3);
    int s = u & 7;
    u32 sh = ld16(b + 2);
    int sc = (int)(((b[4 + (s >> 1)] >> (4 * (s & 1))) & 0x0f) | (((sh >> (2 * s)) & 3) << 4)) - 32;
    float scale = ldf16(b) * (float)sc;
    u32 q[4];
    ld_words(b + 8 + 16 * s, q);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u32 byte = (q[j >> 2] >> (8 * (j & 3))) & 0xff;
        w[j] = scale * table16(IQ4_LO, IQ4_HI, byte & 0x0f);
        w[j + 16] = scale * table16(IQ4_LO, IQ4_HI, byte >> 4);
    }
}

// One value of a float row (the tail of a row whose length is not a multiple of 32).
template <int TY> __device__ __forceinline__ float decode_one(const u8* row, int i) {
    if (TY == TY_F32) return ((const float*)row)[i];
    if (TY == TY_F16) return ldf16(row + 2 * i);
    return __int_as_float((int)((u32)ld16(row + 2 * i) << 16));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Y[t][i] = dot(W[row_ids ? row_ids[i] : i], X[t]) for i < rows_out, t < n. One warp per output
// row (blockDim = 32 x warps); grid.y tiles the tokens NT at a time, so each decoded unit serves
// that many tokens (NT = MM_TOKENS for batches; 1 for decode, which then needs fewer registers
// and keeps more warps in flight). Lanes take units round-robin, then one warp reduction per token.
template <int TY, int NT>
__device__ void matmul_body(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, int cols,
                            const float* X, int n, float* Y) {
    int r = blockIdx.x * blockDim.y + threadIdx.y;
    if (r >= rows_out) return;
    int lane = threadIdx.x;
    const u8* row = W + (u64)(row_ids ? row_ids[r] : (u32)r) * row_stride;
    int t0 = blockIdx.y * NT;
    int nt = min(NT, n - t0);
    const float* x0 = X + (u64)t0 * cols;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    int units = cols / 32;
    bool vec4 = (cols & 3) == 0;
    for (int u = lane; u < units; u += 32) {
        float w[32];
        decode_unit<TY>(row, u, w);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                const float* x = x0 + (u64)t * cols + 32 * u;
                float s = 0.f;
                if (vec4) {
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        float4 v = ((const float4*)x)[i];
                        s += w[4 * i] * v.x + w[4 * i + 1] * v.y + w[4 * i + 2] * v.z + w[4 * i + 3] * v.w;
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 32; i++) s += w[i] * x[i];
                }
                acc[t] += s;
            }
        }
    }
    if (Layout<TY>::BLOCK == 1) {
        for (int i = units * 32 + lane; i < cols; i += 32) {
            float wi = decode_one<TY>(row, i);
            for (int t = 0; t < nt; t++) acc[t] += wi * x0[(u64)t * cols + i];
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0 && t < nt) Y[(u64)(t0 + t) * rows_out + r] = s;
    }
}

// The one-token product with RPW rows per warp: y[i] = dot(W[row i], x) for the warp's rows
// r0..r0+RPW. Each lane loads a unit of x once into registers and multiplies it with that unit
// of each of its rows, so x is read once per RPW rows and each warp has RPW rows' loads in
// flight (RPW = 1 is `matvec`'s work with x in registers). Same summation order per row as
// matmul_body with NT = 1: units round-robin over lanes, then one warp reduction.
template <int TY, int RPW>
__device__ void matvec_rows_body(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, int cols,
                                 const float* x, float* y) {
    int r0 = (blockIdx.x * blockDim.y + threadIdx.y) * RPW;
    if (r0 >= rows_out) return;
    int lane = threadIdx.x;
    int nr = min(RPW, rows_out - r0);
    const u8* rows[RPW];
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        int r = r0 + min(k, nr - 1);  // past the end: the last row again (computed, not stored)
        rows[k] = W + (u64)(row_ids ? row_ids[r] : (u32)r) * row_stride;
    }
    float acc[RPW];
#pragma unroll
    for (int k = 0; k < RPW; k++) acc[k] = 0.f;
    int units = cols / 32;
    bool vec4 = (cols & 3) == 0;
    for (int u = lane; u < units; u += 32) {
        float xv[32];
        if (vec4) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float4 v = ((const float4*)(x + 32 * u))[i];
                xv[4 * i] = v.x;
                xv[4 * i + 1] = v.y;
                xv[4 * i + 2] = v.z;
                xv[4 * i + 3] = v.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 32; i++) xv[i] = x[32 * u + i];
        }
#pragma unroll
        for (int k = 0; k < RPW; k++) {
            float w[32];
            decode_unit<TY>(rows[k], u, w);
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++)
                s += w[4 * i] * xv[4 * i] + w[4 * i + 1] * xv[4 * i + 1] + w[4 * i + 2] * xv[4 * i + 2] +
                     w[4 * i + 3] * xv[4 * i + 3];
            acc[k] += s;
        }
    }
    if (Layout<TY>::BLOCK == 1) {
        for (int i = units * 32 + lane; i < cols; i += 32) {
#pragma unroll
            for (int k = 0; k < RPW; k++) acc[k] += decode_one<TY>(rows[k], i) * x[i];
        }
    }
#pragma unroll
    for (int k = 0; k < RPW; k++) {
        float s = warp_sum(acc[k]);
        if (lane == 0 && k < nr) y[r0 + k] = s;
    }
}

// Row ids[t] of W, dequantized, times scale: out [n, cols]. One block per token.
template <int TY>
__device__ void embed_body(const u8* W, u64 row_stride, const u32* ids, int cols, float scale, float* out) {
    int t = blockIdx.x;
    const u8* row = W + (u64)ids[t] * row_stride;
    float* o = out + (u64)t * cols;
    int units = cols / 32;
    for (int u = threadIdx.x; u < units; u += blockDim.x) {
        float w[32];
        decode_unit<TY>(row, u, w);
#pragma unroll
        for (int i = 0; i < 32; i++) o[32 * u + i] = w[i] * scale;
    }
    if (Layout<TY>::BLOCK == 1)
        for (int i = units * 32 + threadIdx.x; i < cols; i += blockDim.x) o[i] = decode_one<TY>(row, i) * scale;
}

// The transposed product of a neuron-major matrix (row r = neuron r's down column), in
// partitions: partial[p][t][c] = sum over the p-th slice of the rows r (all, or rows[]) of
// acts[t][r] * W[r][c], each slice summed in row order. `accumulate_reduce` then adds the
// partitions in order, so the result never depends on scheduling (no float atomics).
// grid = (ceil(units / blockDim.x), partitions, n); each thread owns one unit of 32 columns.
// Rows from `split` on are another matrix's, W2 (row r at W2 + (r - split) * row_stride2): a
// matrix joined from two places sums exactly as one (split = w_rows: W alone).
template <int TY>
__device__ void accumulate_body(const u8* W, u64 row_stride, int w_rows, const u32* rows, int n_rows, int cols,
                                const float* acts, int n, float* partial, const u8* W2, u64 row_stride2,
                                int split) {
    int u = blockIdx.x * blockDim.x + threadIdx.x;
    int units = cols / 32;
    int p = blockIdx.y, parts = gridDim.y, t = blockIdx.z;
    if (u >= units) return;
    int per = (n_rows + parts - 1) / parts;
    int r0 = p * per, r1 = min(n_rows, r0 + per);
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; i++) acc[i] = 0.f;
    const float* a = acts + (u64)t * w_rows;
    for (int k = r0; k < r1; k++) {
        u32 r = rows ? rows[k] : (u32)k;
        float ar = a[r];
        if (ar == 0.f) continue;
        float w[32];
        const u8* src = r < (u32)split ? W + (u64)r * row_stride : W2 + (u64)(r - (u32)split) * row_stride2;
        decode_unit<TY>(src, u, w);
#pragma unroll
        for (int i = 0; i < 32; i++) acc[i] += ar * w[i];
    }
    float* o = partial + ((u64)p * n + t) * cols + 32 * u;
#pragma unroll
    for (int i = 0; i < 32; i++) o[i] = acc[i];
}

#define QUANT_KERNELS(NAME, TY)                                                                              \
    extern "C" __global__ void matmul_##NAME(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, \
                                             int cols, const float* X, int n, float* Y) {                   \
        matmul_body<TY, MM_TOKENS>(W, row_stride, rows_out, row_ids, cols, X, n, Y);                         \
    }                                                                                                        \
    extern "C" __global__ void matvec_##NAME(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, \
                                             int cols, const float* X, int n, float* Y) {                   \
        matmul_body<TY, 1>(W, row_stride, rows_out, row_ids, cols, X, n, Y);                                 \
    }                                                                                                        \
    extern "C" __global__ void matvec2_##NAME(const u8* W, u64 row_stride, int rows_out, const u32* row_ids,\
                                              int cols, const float* X, int n, float* Y) {                  \
        matvec_rows_body<TY, 2>(W, row_stride, rows_out, row_ids, cols, X, Y);                               \
    }                                                                                                        \
    extern "C" __global__ void matvec4_##NAME(const u8* W, u64 row_stride, int rows_out, const u32* row_ids,\
                                              int cols, const float* X, int n, float* Y) {                  \
        matvec_rows_body<TY, 4>(W, row_stride, rows_out, row_ids, cols, X, Y);                               \
    }                                                                                                        \
    extern "C" __global__ void embed_##NAME(const u8* W, u64 row_stride, const u32* ids, int cols,          \
                                            float scale, float* out) {                                       \
        embed_body<TY>(W, row_stride, ids, cols, scale, out);                                                \
    }                                                                                                        \
    extern "C" __global__ void accumulate_##NAME(const u8* W, u64 row_stride, int w_rows, const u32* rows,  \
                                                 int n_rows, int cols, const float* acts, int n,             \
                                                 float* partial, const u8* W2, u64 row_stride2, int split) { \
        accumulate_body<TY>(W, row_stride, w_rows, rows, n_rows, cols, acts, n, partial, W2, row_stride2,    \
                            split);                                                                          \
    }

QUANT_KERNELS(f32, TY_F32)
QUANT_KERNELS(f16, TY_F16)
QUANT_KERNELS(bf16, TY_BF16)
QUANT_KERNELS(q4_0, TY_Q4_0)
QUANT_KERNELS(q4_1, TY_Q4_1)
QUANT_KERNELS(q5_0, TY_Q5_0)
QUANT_KERNELS(q8_0, TY_Q8_0)
QUANT_KERNELS(q4_k, TY_Q4_K)
QUANT_KERNELS(q5_k, TY_Q5_K)
QUANT_KERNELS(q6_k, TY_Q6_K)
QUANT_KERNELS(iq4_nl, TY_IQ4_NL)
QUANT_KERNELS(mxfp4, TY_MXFP4)
QUANT_KERNELS(q2_k, TY_Q2_K)
QUANT_KERNELS(q3_k, TY_Q3_K)
QUANT_KERNELS(iq4_xs, TY_IQ4_XS)
QUANT_KERNELS(q5_1, TY_Q5_1)

// ---------------------------------------------------------------------------------------------
// Integer dot products (llama.cpp's approach): one-token products of K-quant rows with the
// activations as the CPU's Q8_K blocks (`act_q8_k_blocks` in ops.cu: per 256 values a float
// scale, 16 sums of 16 quants, 256 signed 8-bit quants), four weight and activation quants per
// `dp4a`. Each super-block's integer sums are exact and its value is the CPU's expression
// (src/quant/scalar.rs) to the last bit; only the order in which super-blocks are added differs.

// Bytes of one activation block: d (f32), bsums (16 x i16), 12 bytes unused, quants (256 x i8):
// a multiple of 16 bytes with the quants 16 bytes in, so that where the blocks start at a
// multiple of 16 (device allocations, `matvec_i8f`'s shared copy) a lane reads its quants in
// 16- or 8-byte loads.
#define Q8K_BLOCK_BYTES 304
#define Q8K_BSUMS 4
#define Q8K_QS 48

__device__ __forceinline__ int dp4a(int a, int b, int c) {
#ifdef GATESTREAM_HOST_EMULATION
    return gsemu::dp4a(a, b, c);
#else
    return __dp4a(a, b, c);
#endif
}

__device__ __forceinline__ int sum8_lanes(int v) {
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The most tokens one integer product takes (`matvec_i8n_*`): a batch of up to I8N_MAX tokens
// reads each weight super-block once and multiplies it with every token's block.
#define I8N_MAX 8

// A Q4_K super-block's part for lane k (0..7) of its group of 8, loaded once for every token
// (q4_k_i8_dot): 16 bytes of quants (values 16h..16h+15 of sub-blocks 2g and 2g+1, g = k / 2,
// h = k % 2, low and high nibbles), those two sub-blocks' six-bit scales and mins, and for lane
// 0, d and dmin.
struct Q4kLane {
    u32 w[4];
    int sc0, m0, sc1, m1;
    float d, dmin;
};
__device__ __forceinline__ void q4_k_i8_load(const u8* b, int k, Q4kLane& l) {
    ld_words(b + 16 + 16 * k, l.w);
    int g = k >> 1;
    float sc0, m0, sc1, m1;
    k_scale_min(2 * g, b + 4, &sc0, &m0);
    k_scale_min(2 * g + 1, b + 4, &sc1, &m1);
    l.sc0 = (int)sc0, l.m0 = (int)m0, l.sc1 = (int)sc1, l.m1 = (int)m1;
    if (k == 0) {  // (the lane that adds the super-block's value)
        l.d = ldf16(b);
        l.dmin = ldf16(b + 2);
    }
}

// Lane k's share, with one token's Q8_K block `a`, of sum_s(sc[s] * sum(q * y)) in *qy and of
// sum_s(m[s] * sum(y)) in *my.
__device__ __forceinline__ void q4_k_i8_dot(const Q4kLane& l, const u8* a, int k, int* qy, int* my) {
    int g = k >> 1, h = k & 1;
    uint4 lo4 = *(const uint4*)(a + Q8K_QS + 32 * (2 * g) + 16 * h);
    uint4 hi4 = *(const uint4*)(a + Q8K_QS + 32 * (2 * g + 1) + 16 * h);
    const u32 lo[4] = {lo4.x, lo4.y, lo4.z, lo4.w}, hi[4] = {hi4.x, hi4.y, hi4.z, hi4.w};
    int slo = 0, shi = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        slo = dp4a((int)(l.w[i] & 0x0f0f0f0fu), (int)lo[i], slo);
        shi = dp4a((int)((l.w[i] >> 4) & 0x0f0f0f0fu), (int)hi[i], shi);
    }
    const short* bs = (const short*)(a + Q8K_BSUMS);
    *qy = l.sc0 * slo + l.sc1 * shi;
    *my = l.m0 * (int)bs[4 * g + h] + l.m1 * (int)bs[4 * g + 2 + h];
}

// A Q6_K super-block's part for lane k (0..7), loaded once for every token (q6_k_i8_dot): half
// k / 4, positions l0..l0+7 (l0 = 8 * (k % 4)) of its four quarters, the scales of the groups
// of 16 they lie in, and for lane 0, d.
struct Q6kLane {
    u32 l0w[2], l1w[2], hw[2];
    int sc[4];
    float d;
};
__device__ __forceinline__ void q6_k_i8_load(const u8* b, int k, Q6kLane& l) {
    int half = k >> 2, l0 = 8 * (k & 3);
    const u8* ql = b + 64 * half + l0;
    ld_words(ql, l.l0w);
    ld_words(ql + 32, l.l1w);
    ld_words(b + 128 + 32 * half + l0, l.hw);
    const i8* scales = (const i8*)(b + 192) + 8 * half;
#pragma unroll
    for (int q = 0; q < 4; q++) l.sc[q] = (int)scales[2 * q + (l0 >> 4)];
    if (k == 0) l.d = ldf16(b + 208);  // (the lane that adds the super-block's value)
}

// Lane k's share with one token's Q8_K block `a`. The quants are taken as stored (0..63) and
// 32 * sum(y) is subtracted per group of 16, as the CPU does; the lane starting a group
// subtracts for the whole group.
__device__ __forceinline__ int q6_k_i8_dot(const Q6kLane& l, const u8* a, int k) {
    int half = k >> 2, l0 = 8 * (k & 3);
    const short* bs = (const short*)(a + Q8K_BSUMS);
    int total = 0;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        int qy = 0;
        uint2 y2 = *(const uint2*)(a + Q8K_QS + 128 * half + 32 * q + l0);
        const u32 y[2] = {y2.x, y2.y};
#pragma unroll
        for (int j = 0; j < 2; j++) {
            u32 low = ((q & 1) ? l.l1w[j] : l.l0w[j]) >> (4 * (q >> 1));
            u32 v = (low & 0x0f0f0f0fu) | (((l.hw[j] >> (2 * q)) & 0x03030303u) << 4);
            qy = dp4a((int)v, (int)y[j], qy);
        }
        int grp = 8 * half + 2 * q + (l0 >> 4);
        if ((l0 & 15) == 0) qy -= 32 * (int)bs[grp];
        total += l.sc[q] * qy;
    }
    return total;
}

// One row's integer products with n tokens (n <= NMAX) as Q8_K blocks (Xq: token t's blocks
// from t * nsb on), the share of warp `part` of the `wpr` warps that take the row: each group of
// 8 lanes takes a super-block (4 per warp at a time: super-blocks 4·part + group, then every
// 4·wpr on), loads its part of the weights and scales once, reduces each token's integer sums,
// and its first lane adds each token's super-block value; acc[t] is the warp's sum for token t
// on every lane. A token's sums and their order do not depend on n: one token in a batch gets
// what it gets alone.
template <int TY, int NMAX>
__device__ void i8_row_parts(const u8* row, int nsb, const u8* Xq, int n, int part, int wpr, float (&acc)[NMAX]) {
    int lane = threadIdx.x, grp = lane >> 3, k = lane & 7;
#pragma unroll
    for (int t = 0; t < NMAX; t++) acc[t] = 0.f;
    for (int base = 4 * part; base < nsb; base += 4 * wpr) {
        int sb = base + grp;
        bool valid = sb < nsb;  // every lane reduces (the shuffles need the whole warp)
        int at = valid ? sb : 0;
        if (TY == TY_Q4_K) {
            Q4kLane l;
            l.d = l.dmin = 0.f;  // (set by the load for lane 0 only)
            if (valid) q4_k_i8_load(row + 144 * (u64)at, k, l);
#pragma unroll
            for (int t = 0; t < NMAX; t++) {
                if (t >= n) break;  // the same for the whole warp
                const u8* a = Xq + ((u64)t * nsb + at) * Q8K_BLOCK_BYTES;
                float d8 = *(const float*)a;
                int qy = 0, my = 0;
                if (valid) q4_k_i8_dot(l, a, k, &qy, &my);
                qy = sum8_lanes(qy);
                my = sum8_lanes(my);
                if (valid && k == 0) {
                    float d = l.d * d8, dmin = l.dmin * d8;
                    acc[t] += d * (float)qy - dmin * (float)my;
                }
            }
        } else {
            Q6kLane l;
            l.d = 0.f;  // (set by the load for lane 0 only)
            if (valid) q6_k_i8_load(row + 210 * (u64)at, k, l);
#pragma unroll
            for (int t = 0; t < NMAX; t++) {
                if (t >= n) break;
                const u8* a = Xq + ((u64)t * nsb + at) * Q8K_BLOCK_BYTES;
                float d8 = *(const float*)a;
                int s = valid ? q6_k_i8_dot(l, a, k) : 0;
                s = sum8_lanes(s);
                if (valid && k == 0) acc[t] += l.d * d8 * (float)s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NMAX; t++)
        if (t < n) acc[t] = warp_sum(acc[t]);
}

// Y[t][i] = dot(W[row i], x_t) (+ bias[i] when given) for n tokens (n <= NMAX), x as Q8_K blocks
// (Xq), over block `lb` of the rows: the block's 8 warps take 8 / wpr rows, `wpr` warps each
// (wide rows: a row's warps add their sums in order through shared memory). wpr is 1, 2, 4 or
// 8, the same for the whole launch (the barrier below is reached by every warp of a block).
template <int TY, int NMAX>
__device__ void matvec_i8_rows(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, int cols,
                               const u8* Xq, int n, const float* bias, int wpr, float* Y, int lb) {
    __shared__ float part_sum[8][NMAX];
    int r = lb * (blockDim.y / wpr) + threadIdx.y / wpr, part = threadIdx.y % wpr;
    bool valid = r < rows_out;  // whole warps: no warp returns before the barrier
    float s[NMAX];
    if (valid) {
        const u8* row = W + (u64)(row_ids ? row_ids[r] : (u32)r) * row_stride;
        i8_row_parts<TY, NMAX>(row, cols / 256, Xq, n, part, wpr, s);
    } else {
#pragma unroll
        for (int t = 0; t < NMAX; t++) s[t] = 0.f;
    }
    if (wpr > 1) {
        if (threadIdx.x == 0)
#pragma unroll
            for (int t = 0; t < NMAX; t++) part_sum[threadIdx.y][t] = s[t];
        __syncthreads();
        if (threadIdx.x == 0 && part == 0)
            for (int i = 1; i < wpr; i++)
#pragma unroll
                for (int t = 0; t < NMAX; t++) s[t] += part_sum[threadIdx.y + i][t];
    }
    if (valid && part == 0 && threadIdx.x == 0)
#pragma unroll
        for (int t = 0; t < NMAX; t++)
            if (t < n) Y[(u64)t * rows_out + r] = bias ? s[t] + bias[r] : s[t];
}

// Up to three weights of one type multiplied with the same input in one launch (Q, K and V;
// gate and up): blocks [0, nb0) are the first's, [nb0, nb01) the second's, the rest the third's.
// The one-token kernels' 256 threads at most 40 registers each (6 blocks a multiprocessor), as
// they compile on their own; matvec_i8n_* holds a sum per token.
#define I8_ONE_BOUNDS __launch_bounds__(256, 6)
// matvec_i8_*: one token (n is 1); matvec_i8n_*: n tokens (1..I8N_MAX) in one launch, each weight
// super-block read once.
#define MATVEC_I8_KERNELS(t, TY)                                                                             \
    extern "C" __global__ void I8_ONE_BOUNDS matvec_i8_##t(const u8* W, u64 row_stride, int rows_out,       \
                                                           const u32* row_ids, int cols, const u8* Xq, int n, \
                                                           const float* bias, int wpr, float* Y) {           \
        matvec_i8_rows<TY, 1>(W, row_stride, rows_out, row_ids, cols, Xq, 1, bias, wpr, Y, blockIdx.x);      \
    }                                                                                                        \
    extern "C" __global__ void matvec_i8n_##t(const u8* W, u64 row_stride, int rows_out, const u32* row_ids, \
                                              int cols, const u8* Xq, int n, const float* bias, int wpr,     \
                                              float* Y) {                                                    \
        matvec_i8_rows<TY, I8N_MAX>(W, row_stride, rows_out, row_ids, cols, Xq, n, bias, wpr, Y, blockIdx.x); \
    }                                                                                                        \
    extern "C" __global__ void I8_ONE_BOUNDS matvec_i8x3_##t(                                                          \
        const u8* Xq, int cols, int wpr, int nb0, int nb01, const u8* W0, u64 s0, int r0, const float* b0,   \
        float* y0, const u8* W1, u64 s1, int r1, const float* b1, float* y1, const u8* W2, u64 s2, int r2,   \
        const float* b2, float* y2) {                                                                        \
        int b = blockIdx.x;                                                                                  \
        if (b < nb0)                                                                                         \
            matvec_i8_rows<TY, 1>(W0, s0, r0, 0, cols, Xq, 1, b0, wpr, y0, b);                               \
        else if (b < nb01)                                                                                   \
            matvec_i8_rows<TY, 1>(W1, s1, r1, 0, cols, Xq, 1, b1, wpr, y1, b - nb0);                         \
        else                                                                                                 \
            matvec_i8_rows<TY, 1>(W2, s2, r2, 0, cols, Xq, 1, b2, wpr, y2, b - nb01);                        \
    }

MATVEC_I8_KERNELS(q4_k, TY_Q4_K)
MATVEC_I8_KERNELS(q6_k, TY_Q6_K)
#undef MATVEC_I8_KERNELS

// `matvec_i8_rows` of one token for a weight of type `ty` (TY_Q4_K or TY_Q6_K), chosen at run
// time (the same for a whole block).
__device__ void matvec_i8_rows_of(int ty, const u8* W, u64 row_stride, int rows_out, int cols, const u8* Xq,
                                  const float* bias, int wpr, float* Y, int lb) {
    if (ty == TY_Q4_K)
        matvec_i8_rows<TY_Q4_K, 1>(W, row_stride, rows_out, 0, cols, Xq, 1, bias, wpr, Y, lb);
    else
        matvec_i8_rows<TY_Q6_K, 1>(W, row_stride, rows_out, 0, cols, Xq, 1, bias, wpr, Y, lb);
}

// `matvec_i8_rows` of n tokens (n <= I8N_MAX) for a weight of type `ty`, as `matvec_i8_rows_of`.
__device__ void matvec_i8n_rows_of(int ty, const u8* W, u64 row_stride, int rows_out, int cols, const u8* Xq, int n,
                                   const float* bias, int wpr, float* Y, int lb) {
    if (ty == TY_Q4_K)
        matvec_i8_rows<TY_Q4_K, I8N_MAX>(W, row_stride, rows_out, 0, cols, Xq, n, bias, wpr, Y, lb);
    else
        matvec_i8_rows<TY_Q6_K, I8N_MAX>(W, row_stride, rows_out, 0, cols, Xq, n, bias, wpr, Y, lb);
}

// Up to three weights' products with the same n tokens (n <= I8N_MAX; `matvec_i8n_*`'s sums) in
// one launch, each weight's type `t0` .. `t2` (Q, K and V; gate and up of a batch).
extern "C" __global__ void matvec_i8nx3(const u8* Xq, int n, int cols, int wpr, int nb0, int nb01, int t0,
                                        const u8* W0, u64 s0, int r0, const float* b0, float* y0, int t1,
                                        const u8* W1, u64 s1, int r1, const float* b1, float* y1, int t2,
                                        const u8* W2, u64 s2, int r2, const float* b2, float* y2) {
    int b = blockIdx.x;
    if (b < nb0)
        matvec_i8n_rows_of(t0, W0, s0, r0, cols, Xq, n, b0, wpr, y0, b);
    else if (b < nb01)
        matvec_i8n_rows_of(t1, W1, s1, r1, cols, Xq, n, b1, wpr, y1, b - nb0);
    else
        matvec_i8n_rows_of(t2, W2, s2, r2, cols, Xq, n, b2, wpr, y2, b - nb01);
}

// `matvec_i8x3_*` for weights of different types (Q, K and V where V is Q6_K and the others
// Q4_K, as in llama.cpp's Q4_K_M mix): each weight's type `t0`, `t1`, `t2` (TY_Q4_K, TY_Q6_K);
// the same sums as each weight's own kernel.
extern "C" __global__ void I8_ONE_BOUNDS matvec_i8x3_mixed(const u8* Xq, int cols, int wpr, int nb0, int nb01,
                                                           int t0, const u8* W0, u64 s0, int r0, const float* b0,
                                                           float* y0, int t1, const u8* W1, u64 s1, int r1,
                                                           const float* b1, float* y1, int t2, const u8* W2, u64 s2,
                                                           int r2, const float* b2, float* y2) {
    int b = blockIdx.x;
    if (b < nb0)
        matvec_i8_rows_of(t0, W0, s0, r0, cols, Xq, b0, wpr, y0, b);
    else if (b < nb01)
        matvec_i8_rows_of(t1, W1, s1, r1, cols, Xq, b1, wpr, y1, b - nb0);
    else
        matvec_i8_rows_of(t2, W2, s2, r2, cols, Xq, b2, wpr, y2, b - nb01);
}

// out[t][c] += sum_p partial[p][t][c], p in order. One thread per (t, c).
extern "C" __global__ void accumulate_reduce(const float* partial, int parts, u64 len, float* out) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    float s = 0.f;
    for (int p = 0; p < parts; p++) s += partial[(u64)p * len + i];
    out[i] += s;
}
