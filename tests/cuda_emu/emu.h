// Host emulation of the CUDA C++ that kernels/*.cu use, so the kernels compile with a host C++
// compiler and run on the CPU (tests/cuda_emu/driver.cpp runs them behind the CUDA driver API).
// Each GPU thread of a block is a fiber with a stack of its own; a block's fibers run in turn on
// one host thread, switching only at the block barrier (__syncthreads) and at warp shuffles, so
// shared memory (`__shared__` becomes `static`: blocks run one after another) and warp exchanges
// behave as on the GPU. This checks what a kernel computes, never how fast a GPU would run it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define GATESTREAM_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
    unsigned x, y, z;
};
// The vector types with CUDA's alignment (8 and 16 bytes), so a build with the alignment
// sanitizer (build.sh --asan) stops at a vector load from an address a GPU would fault on.
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};

namespace gsemu {

struct Fiber {
    void* sp;                  // saved stack pointer while switched out
    void* stack;               // the mapping (guard page first)
    dim3 tid;
    int linear, lane, warp;
    bool done;
    unsigned bar;              // block barriers entered
    unsigned shfl;             // warp exchanges entered
    int wait;                  // 0 running, 1 at barrier bar - 1, 2 at exchange shfl - 1
};

extern Fiber* current;
extern dim3 grid_dim, block_dim, block_idx;

// A block barrier from source line `line` (a block's threads must meet at the same one).
void sync_threads(int line);
unsigned shfl_xor(unsigned bits, int lane_mask);

// __dp4a with signed operands: c plus the four products of a's and b's signed bytes.
inline int dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}

// IEEE half to float (what `cvt.f32.f16` does), subnormals included.
inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while ((man & 0x400) == 0);
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Float to IEEE half, rounded to nearest even (what `cvt.rn.f16.f32` does), subnormals and
// overflow to infinity included.
inline uint16_t float_to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds past 65504
    if (ax < 0x38800000u) {  // below the smallest normal half: a subnormal (or zero)
        if (ax < 0x33000000u) return (uint16_t)sign;  // below half the smallest subnormal
        uint32_t e = ax >> 23, man = (ax & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)e;  // man >> shift is the subnormal's integer (units of 2^-24)
        uint32_t h = man >> shift, rest = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((ax - 0x38000000u) >> 13), rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

// The m16n8k16 products of f16 fragments into f32 sums that `mma.sync` computes (kernels/mma.cu,
// which gives the layouts), for a warp's 2 x 4 tiles at once (`mma_tiles`): every lane puts its
// fragments in its warp's slot, then each computes its own sums from all of them, adding the
// products of one instruction in k order to its d, instruction after instruction.
struct MmaSlot {
    uint32_t a[32][16];  // a lane's A fragments: [half][mi][4]
    uint32_t b[32][16];  // its B fragments: [half][ni][2]
};
extern MmaSlot mma_slots[32];

// Every half's float, made once (the products below convert ~1500 halves a lane a step).
inline const float* half_table() {
    static float* t = [] {
        static float v[65536];
        for (uint32_t h = 0; h < 65536; h++) v[h] = half_to_float((uint16_t)h);
        return v;
    }();
    return t;
}

// d[0..4] += A·B for this lane, A's words at `ao` of each lane's slot row, B's at `bo`.
inline void mma_tile(const MmaSlot& s, int ao, int bo, float* d) {
    int lane = current->lane, g = lane >> 2, q = lane & 3;
    const float* ht = half_table();
    auto half = [ht](uint32_t w, int k) { return ht[(uint16_t)(w >> (16 * (k & 1)))]; };
    for (int i = 0; i < 4; i++) {
        int row = g + 8 * (i >> 1), col = 2 * q + (i & 1);
        float sum = d[i];
        for (int k = 0; k < 16; k++) {
            float av = half(s.a[(row & 7) * 4 + ((k & 7) >> 1)][ao + (row >> 3) + 2 * (k >> 3)], k);
            float bv = half(s.b[col * 4 + ((k & 7) >> 1)][bo + (k >> 3)], k);
            sum += av * bv;
        }
        d[i] = sum;
    }
}

inline void mma_tiles(float* d, const uint32_t* a, const uint32_t* b, int live) {
    MmaSlot& s = mma_slots[current->warp];
    std::memcpy(s.a[current->lane], a, 64);
    std::memcpy(s.b[current->lane], b, 64);
    (void)shfl_xor(0, 0);  // every lane's fragments are in
    for (int mi = 0; mi < 2; mi++)
        for (int ni = 0; ni < live; ni++) {
            float* t = d + (mi * 4 + ni) * 4;
            mma_tile(s, 8 + 4 * mi, 2 * ni, t);  // a[1][mi] b[0][ni]
            mma_tile(s, 4 * mi, 8 + 2 * ni, t);  // a[0][mi] b[1][ni]
            mma_tile(s, 4 * mi, 2 * ni, t);      // a[0][mi] b[0][ni]
        }
    (void)shfl_xor(0, 0);  // every lane has read them before any writes its next ones
}

// One f16 m16n8k16 product a tile, d[mi][ni] += a[mi]·b[ni] (A's words [mi][4], B's [ni][2]).
inline void mma_f16_once(float* d, const uint32_t* a, const uint32_t* b, int live) {
    MmaSlot& s = mma_slots[current->warp];
    std::memcpy(s.a[current->lane], a, 32);
    std::memcpy(s.b[current->lane], b, 32);
    (void)shfl_xor(0, 0);
    for (int mi = 0; mi < 2; mi++)
        for (int ni = 0; ni < live; ni++) mma_tile(s, 4 * mi, 2 * ni, d + (mi * 4 + ni) * 4);
    (void)shfl_xor(0, 0);
}

// The m16n8k32 (k = 32) and m16n8k16 (k = 16) products of signed 8-bit fragments into int32 sums
// that `mma.sync` computes (exact, so in any order), for a warp's 2 x 4 tiles (`mma_s8_tiles` in
// kernels/mma.cu): A's words [mi][k / 8], B's [ni][k / 16]. The PTX layouts, in 32-bit words of
// four values: word w of row r of a 16-row A is register (r / 8) + 2 (w / 4) of lane 4 (r % 8) +
// w % 4; word w of column c of B is register w / 4 of lane 4 c + w % 4; lane 4 g + q's sums are
// rows g and g + 8 by columns 2q and 2q + 1.
inline void mma_s8_tiles(int* d, const uint32_t* a, const uint32_t* b, int live, int k) {
    MmaSlot& s = mma_slots[current->warp];
    int aw = k / 8, bw = k / 16;
    std::memcpy(s.a[current->lane], a, 2 * aw * 4);
    std::memcpy(s.b[current->lane], b, 4 * bw * 4);
    (void)shfl_xor(0, 0);
    int lane = current->lane, g = lane >> 2, q = lane & 3;
    for (int mi = 0; mi < 2; mi++)
        for (int ni = 0; ni < live; ni++)
            for (int i = 0; i < 4; i++) {
                int row = g + 8 * (i >> 1), col = 2 * q + (i & 1);
                int sum = d[(mi * 4 + ni) * 4 + i];
                for (int w = 0; w < k / 4; w++) {
                    uint32_t av = s.a[(row & 7) * 4 + (w & 3)][mi * aw + (row >> 3) + 2 * (w >> 2)];
                    uint32_t bv = s.b[col * 4 + (w & 3)][ni * bw + (w >> 2)];
                    sum = dp4a((int)av, (int)bv, sum);
                }
                d[(mi * 4 + ni) * 4 + i] = sum;
            }
    (void)shfl_xor(0, 0);
}

}  // namespace gsemu

#define threadIdx (gsemu::current->tid)
#define blockIdx (gsemu::block_idx)
#define blockDim (gsemu::block_dim)
#define gridDim (gsemu::grid_dim)

// (The barrier carries its source line: `sync_threads` checks that a block's threads meet at the
// same one.)
#define __syncthreads() ::gsemu::sync_threads(__LINE__)

inline float __shfl_xor_sync(unsigned, float v, int m) {
    unsigned b;
    std::memcpy(&b, &v, 4);
    b = gsemu::shfl_xor(b, m);
    std::memcpy(&v, &b, 4);
    return v;
}
inline int __shfl_xor_sync(unsigned, int v, int m) { return (int)gsemu::shfl_xor((unsigned)v, m); }
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int m) { return gsemu::shfl_xor(v, m); }
// A warp barrier: an exchange every lane of the warp enters before any goes on.
inline void __syncwarp(unsigned = 0xffffffffu) { (void)gsemu::shfl_xor(0, 0); }

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline long long __double_as_longlong(double d) {
    long long i;
    std::memcpy(&i, &d, 8);
    return i;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
// Fibers switch only at barriers and exchanges, so an atomic is a plain read-modify-write.
inline unsigned atomicAdd(unsigned* a, unsigned v) {
    unsigned old = *a;
    *a = old + v;
    return old;
}
inline unsigned atomicExch(unsigned* a, unsigned v) {
    unsigned old = *a;
    *a = v;
    return old;
}
// One host thread runs every block, so memory is always coherent.
inline void __threadfence() {}
template <typename T> inline T __ldcg(const T* p) { return *p; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max;
using std::min;
