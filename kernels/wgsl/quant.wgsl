// Products of quantized weights with f32 activations (the wgpu device, src/backend/wgpu/).
// The host prepends `const TYPE: u32 = ...;` (a GgmlType's code below) and compiles one module
// per weight type, so each `deq` is one type's decoder. Weights are the host's bytes as they are
// in the file, read as u32 words: rows start at any byte (an 18-byte Q4_0 block is not word
// aligned), so every field is read by its byte address. Each element is decoded exactly as
// src/quant/dequant.rs decodes it; products sum in f32 (the CPU's reference sums f64 or integer
// dots: the suite compares within a tolerance, not bit for bit).

const T_F32: u32 = 0u;
const T_F16: u32 = 1u;
const T_BF16: u32 = 2u;
const T_Q4_0: u32 = 3u;
const T_Q4_1: u32 = 4u;
const T_Q5_0: u32 = 5u;
const T_Q5_1: u32 = 6u;
const T_Q8_0: u32 = 7u;
const T_Q4_K: u32 = 8u;
const T_Q5_K: u32 = 9u;
const T_Q6_K: u32 = 10u;
const T_Q2_K: u32 = 11u;
const T_Q3_K: u32 = 12u;
const T_IQ4_NL: u32 = 13u;
const T_IQ4_XS: u32 = 14u;
const T_MXFP4: u32 = 15u;

// Lookup tables as little-endian i8 bytes in four words (a vector indexes at run time where a
// const array need not): IQ4_NL/IQ4_XS's sixteen values (ggml's `kvalues_iq4nl`) and MXFP4's
// doubled FP4 values (`kvalues_mxfp4`), as src/quant/layout.rs lists them.
const IQ4_TABLE: vec4<u32> = vec4<u32>(0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u);
const FP4_TABLE: vec4<u32> = vec4<u32>(0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu);

// One launch's shape. `rows`: output rows (matmul: the weight's rows or the listed ids; the
// neuron-major product: the rows summed over); `stride`: bytes from one weight row to the next;
// `base`: row 0's byte in `w`; `groups_x`: workgroups per row of the dispatch grid (a grid is
// at most 65535 wide); `act_width`: the neuron-major product's activation width; `out_width`:
// the product's output rows (a weight split into several buffers is multiplied a buffer at a
// time: `rows` of them from output row `first`); `first`: for the neuron-major product, the
// buffer's first row (its activation); `row0`: for the neuron-major product, the first of the
// `rows` summed over this launch (a software adapter bounds each thread's loops: lavapipe ends
// them past 65535 iterations, so a long sum is cut into launches, each adding to `y`).
struct Params {
    rows: u32,
    cols: u32,
    ntok: u32,
    stride: u32,
    use_ids: u32,
    groups_x: u32,
    base: u32,
    act_width: u32,
    out_width: u32,
    first: u32,
    row0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<uniform> p: Params;

fn byte_at(a: u32) -> u32 {
    return (w[a >> 2u] >> ((a & 3u) * 8u)) & 0xffu;
}

// A 16-bit field at an even byte address (never across two words).
fn u16_at(a: u32) -> u32 {
    return (w[a >> 2u] >> ((a & 2u) * 8u)) & 0xffffu;
}

fn f16_at(a: u32) -> f32 {
    return unpack2x16float(u16_at(a)).x;
}

fn i8_of(b: u32) -> f32 {
    return f32((i32(b) << 24u) >> 24u);
}

// Entry `q` (0..16) of a table of i8 bytes packed four to a word.
fn table_at(t: vec4<u32>, q: u32) -> f32 {
    return i8_of((t[q >> 2u] >> ((q & 3u) * 8u)) & 0xffu);
}

// Half of the E8M0 scale `e` (2^(e - 128)), which multiplies the doubled FP4 values: 2^-128 and
// 2^-127 are subnormal (src/quant/layout.rs `e8m0_half`).
fn e8m0_half(e: u32) -> f32 {
    if (e < 2u) {
        return bitcast<f32>(0x00200000u << e);
    }
    return bitcast<f32>((e - 1u) << 23u);
}

// The 2-bit quant of element `k` of a Q2_K/Q3_K block whose `qs` start at `qs`.
fn k_low2(k: u32, qs: u32) -> u32 {
    return (byte_at(qs + 32u * (k >> 7u) + (k & 31u)) >> (2u * ((k & 127u) >> 5u))) & 3u;
}

// The 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K block whose packed scales start at `s`.
fn k_scale_min(j: u32, s: u32) -> vec2<f32> {
    if (j < 4u) {
        return vec2<f32>(f32(byte_at(s + j) & 63u), f32(byte_at(s + j + 4u) & 63u));
    }
    let sc = (byte_at(s + j + 4u) & 15u) | ((byte_at(s + j - 4u) >> 6u) << 4u);
    let m = (byte_at(s + j + 4u) >> 4u) | ((byte_at(s + j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

// Element `e` of the row starting at byte `row`.
fn deq(row: u32, e: u32) -> f32 {
    if (TYPE == T_F32) {
        return bitcast<f32>(w[(row >> 2u) + e]);
    }
    if (TYPE == T_F16) {
        return f16_at(row + 2u * e);
    }
    if (TYPE == T_BF16) {
        return bitcast<f32>(u16_at(row + 2u * e) << 16u);
    }
    if (TYPE == T_IQ4_NL || TYPE == T_MXFP4) {
        let j = e & 31u;
        let bb = select(18u, 17u, TYPE == T_MXFP4);
        let qs = select(2u, 1u, TYPE == T_MXFP4);
        let blk = row + (e >> 5u) * bb;
        let byte = byte_at(blk + qs + (j & 15u));
        let q = select(byte & 15u, byte >> 4u, j >= 16u);
        if (TYPE == T_MXFP4) {
            return table_at(FP4_TABLE, q) * e8m0_half(byte_at(blk));
        }
        return f16_at(blk) * table_at(IQ4_TABLE, q);
    }
    if (TYPE == T_Q4_0 || TYPE == T_Q4_1 || TYPE == T_Q5_0 || TYPE == T_Q5_1 || TYPE == T_Q8_0) {
        let j = e & 31u;
        if (TYPE == T_Q8_0) {
            let blk = row + (e >> 5u) * 34u;
            return i8_of(byte_at(blk + 2u + j)) * f16_at(blk);
        }
        var bb = 18u;
        var qs = 2u;
        if (TYPE == T_Q4_1) { bb = 20u; qs = 4u; }
        if (TYPE == T_Q5_0) { bb = 22u; qs = 6u; }
        if (TYPE == T_Q5_1) { bb = 24u; qs = 8u; }
        let blk = row + (e >> 5u) * bb;
        let byte = byte_at(blk + qs + (j & 15u));
        var q = select(byte & 15u, byte >> 4u, j >= 16u);
        let d = f16_at(blk);
        if (TYPE == T_Q5_0 || TYPE == T_Q5_1) {
            let hb = select(blk + 2u, blk + 4u, TYPE == T_Q5_1);
            q = q | (((byte_at(hb + (j >> 3u)) >> (j & 7u)) & 1u) << 4u);
        }
        if (TYPE == T_Q4_0) {
            return f32(i32(q) - 8) * d;
        }
        if (TYPE == T_Q5_0) {
            return f32(i32(q) - 16) * d;
        }
        return f32(q) * d + f16_at(blk + 2u);
    }
    let k = e & 255u;
    if (TYPE == T_Q2_K) {
        // scales[16] at 0 (scale low nibble, min high), qs[64] at 16, d at 80, dmin at 82.
        let blk = row + (e >> 8u) * 84u;
        let sc = byte_at(blk + (k >> 4u));
        let scale = f16_at(blk + 80u) * f32(sc & 15u);
        return scale * f32(k_low2(k, blk + 16u)) - f16_at(blk + 82u) * f32(sc >> 4u);
    }
    if (TYPE == T_Q3_K) {
        // hmask[32] at 0, qs[64] at 32, the sixteen 6-bit scales packed in 12 bytes at 96, d at 108.
        let blk = row + (e >> 8u) * 110u;
        let g = k >> 4u;
        let low = (byte_at(blk + 96u + (g & 7u)) >> (4u * (g >> 3u))) & 15u;
        let high = (byte_at(blk + 104u + (g & 3u)) >> (2u * (g >> 2u))) & 3u;
        let scale = f16_at(blk + 108u) * f32(i32(low | (high << 4u)) - 32);
        let hbit = (byte_at(blk + (k & 31u)) >> (k >> 5u)) & 1u;
        return scale * f32(i32(k_low2(k, blk + 32u) | (hbit << 2u)) - 4);
    }
    if (TYPE == T_IQ4_XS) {
        // d at 0, the scales' high bits (2 each) at 2, their low nibbles at 4, qs[128] at 8.
        let blk = row + (e >> 8u) * 136u;
        let s = k >> 5u;
        let j = k & 31u;
        let sl = (byte_at(blk + 4u + (s >> 1u)) >> (4u * (s & 1u))) & 15u;
        let sh = (u16_at(blk + 2u) >> (2u * s)) & 3u;
        let scale = f16_at(blk) * f32(i32(sl | (sh << 4u)) - 32);
        let byte = byte_at(blk + 8u + 16u * s + (j & 15u));
        return scale * table_at(IQ4_TABLE, select(byte & 15u, byte >> 4u, j >= 16u));
    }
    if (TYPE == T_Q6_K) {
        let blk = row + (e >> 8u) * 210u;
        let half = k >> 7u;
        let within = k & 127u;
        let quarter = within >> 5u;
        let l = within & 31u;
        let low_byte = byte_at(blk + 64u * half + l + 32u * (quarter & 1u));
        let low = select(low_byte & 15u, low_byte >> 4u, quarter >= 2u);
        let high = (byte_at(blk + 128u + 32u * half + l) >> (2u * quarter)) & 3u;
        let q = i32(low | (high << 4u)) - 32;
        return f16_at(blk + 208u) * i8_of(byte_at(blk + 192u + (k >> 4u))) * f32(q);
    }
    // Q4_K and Q5_K.
    let bb = select(144u, 176u, TYPE == T_Q5_K);
    let qs = select(16u, 48u, TYPE == T_Q5_K);
    let blk = row + (e >> 8u) * bb;
    let sub = k >> 5u;
    let byte = byte_at(blk + qs + 32u * (k >> 6u) + (k & 31u));
    var q = select(byte >> 4u, byte & 15u, (sub & 1u) == 0u);
    if (TYPE == T_Q5_K) {
        q = q | (((byte_at(blk + 16u + (k & 31u)) >> sub) & 1u) << 4u);
    }
    let sm = k_scale_min(sub, blk + 4u);
    return f16_at(blk) * sm.x * f32(q) - f16_at(blk + 2u) * sm.y;
}

const TILE: u32 = 8u;
var<workgroup> red: array<f32, 512>;

fn group_index(wg: vec3<u32>) -> u32 {
    return wg.x + wg.y * p.groups_x;
}

// What one invocation of a row product computes: output row `i` (weight row ids[i] when
// use_ids, a row subset, else i; it starts at byte `row`) for the `nt` tokens from `t0`; `ok`
// false past the last (row, token tile).
struct RowJob {
    i: u32,
    row: u32,
    t0: u32,
    nt: u32,
    ok: bool,
}

// The job of the `rows_a_group` rows' group, thread `lane` of it, that workgroup `wg` takes
// (one row a workgroup: rows_a_group 1, lane 0; one a thread: 64 and the thread's index).
fn row_job(wg: vec3<u32>, rows_a_group: u32, lane: u32) -> RowJob {
    let g = group_index(wg);
    let groups = (p.rows + rows_a_group - 1u) / rows_a_group;
    let tiles = (p.ntok + TILE - 1u) / TILE;
    let i = (g % groups) * rows_a_group + lane;
    if (g >= groups * tiles || i >= p.rows) {
        return RowJob(0u, 0u, 0u, 0u, false);
    }
    var r = i;
    if (p.use_ids != 0u) {
        r = ids[i];
    }
    let t0 = (g / groups) * TILE;
    return RowJob(i, p.base + r * p.stride, t0, min(TILE, p.ntok - t0), true);
}

// The workgroup kernels' end: each token's 64 partial sums (one a thread) added in a tree in
// workgroup memory, and written as output row `j.i`.
fn reduce_store(acc: array<f32, 8>, lid: u32, j: RowJob) {
    for (var t = 0u; t < TILE; t += 1u) {
        red[t * 64u + lid] = acc[t];
    }
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (lid < s) {
            for (var t = 0u; t < TILE; t += 1u) {
                red[t * 64u + lid] += red[t * 64u + lid + s];
            }
        }
        workgroupBarrier();
    }
    if (lid < j.nt) {
        y[(j.t0 + lid) * p.out_width + p.first + j.i] = red[lid * 64u];
    }
}

// The one-thread kernels' end: each token's 64 partial sums (`part[lane * TILE + t]`) added in
// the workgroup kernels' tree, so the two give the same bits, and written as output row `j.i`.
fn tree_store(part: ptr<function, array<f32, 512>>, j: RowJob) {
    for (var s = 32u; s > 0u; s >>= 1u) {
        for (var l = 0u; l < s; l += 1u) {
            for (var t = 0u; t < j.nt; t += 1u) {
                (*part)[l * TILE + t] += (*part)[(l + s) * TILE + t];
            }
        }
    }
    for (var t = 0u; t < j.nt; t += 1u) {
        y[(j.t0 + t) * p.out_width + p.first + j.i] = (*part)[t];
    }
}

// y[t][i] = dot(w row r_i, x[t]) for a tile of up to 8 tokens: one workgroup per (output row,
// token tile), its 64 threads over the row's elements, each element decoded once per tile.
@compute @workgroup_size(64)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let j = row_job(wg, 1u, 0u);
    if (!j.ok) {
        return;
    }
    var acc: array<f32, 8>;
    for (var e = lid; e < p.cols; e += 64u) {
        let v = deq(j.row, e);
        for (var t = 0u; t < j.nt; t += 1u) {
            acc[t] += v * x[(j.t0 + t) * p.cols + e];
        }
    }
    reduce_store(acc, lid, j);
}

// The neuron-major product: y[t][c] += sum over rows r (ids, or all) of x[t][r] * w[r][c]; one
// workgroup per (64 columns, token tile), each thread one column, rows in order.
@compute @workgroup_size(64)
fn accumulate(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = group_index(wg);
    let col_groups = (p.cols + 63u) / 64u;
    let tiles = (p.ntok + TILE - 1u) / TILE;
    if (g >= col_groups * tiles) {
        return;
    }
    let c = (g % col_groups) * 64u + lid;
    let t0 = (g / col_groups) * TILE;
    if (c >= p.cols) {
        return;
    }
    let nt = min(TILE, p.ntok - t0);
    var acc: array<f32, 8>;
    for (var i = p.row0; i < p.row0 + p.rows; i += 1u) {
        var r = i;
        if (p.use_ids != 0u) {
            r = ids[i];
        }
        let v = deq(p.base + r * p.stride, c);
        for (var t = 0u; t < nt; t += 1u) {
            acc[t] += x[(t0 + t) * p.act_width + p.first + r] * v;
        }
    }
    for (var t = 0u; t < nt; t += 1u) {
        y[(t0 + t) * p.cols + c] += acc[t];
    }
}

// As `matmul`, one thread an output row (64 rows a workgroup) and no workgroup memory or
// barriers: what a software adapter (lavapipe, which runs a workgroup's threads in SIMD lanes
// and pays for every barrier) runs fastest. The device picks it on software adapters. It sums
// in the workgroup kernel's order: 64 strided partial sums (element e into partial e % 64, in
// increasing e), then added in the same tree. The two kernels' results are then the same bits,
// so checking one model on either checks both.
@compute @workgroup_size(64)
fn matmul_thread(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let j = row_job(wg, 64u, lid);
    if (!j.ok) {
        return;
    }
    var part: array<f32, 512>;
    for (var e = 0u; e < p.cols; e += 1u) {
        let v = deq(j.row, e);
        let lane = (e & 63u) * TILE;
        for (var t = 0u; t < j.nt; t += 1u) {
            part[lane + t] += v * x[(j.t0 + t) * p.cols + e];
        }
    }
    tree_store(&part, j);
}

// ---- Packed 8-bit products: weights times the activations' 8-bit quants (ops.wgsl
// `quantize_q8_packed`), four byte products a `dot4I8Packed`, as the CPU's integer dot products
// (src/quant/scalar.rs) compute them: integer sums over each 16 or 32 quants, then scaled in f32.
// A row is taken 32 elements (a chunk) at a time: the weight's quants unpacked into eight words
// of i8 bytes (`qw`), dotted with the activation's eight words.

@group(0) @binding(5) var<storage, read> xq: array<u32>;

// The activations' blocks: 32 for the legacy types (Q8_0-like), 256 for the K types (Q8_K).
const XB: u32 = select(256u, 32u, TYPE < T_Q4_K || TYPE == T_IQ4_NL || TYPE == T_MXFP4);

// Whether a type's chunks take the activation sums (offsets, mins); the others skip reading them.
const SUMS: bool = !(TYPE == T_Q8_0 || TYPE == T_IQ4_NL || TYPE == T_IQ4_XS || TYPE == T_MXFP4);

var<private> qw: array<u32, 8>;

// A chunk's weight side: its value over one token is
// `xs * (da * dot(a, (qy0, qy1, s0, s1)) + db * dot(b, (s0, s1)))`, qy0 and qy1 the integer
// products over its two halves of 16, s0 and s1 the activation quants' sums over them, xs the
// activation block's scale.
struct Chunk {
    a: vec4<i32>,
    b: vec2<i32>,
    da: f32,
    db: f32,
}

// Four bytes from byte address `a` (any alignment), as one word.
fn word_at(a: u32) -> u32 {
    let i = a >> 2u;
    let sh = (a & 3u) * 8u;
    if (sh == 0u) {
        return w[i];
    }
    return (w[i] >> sh) | (w[i + 1u] << (32u - sh));
}

// Four 4-bit indices (the low nibble of each byte of `n`) through a table of i8 bytes.
fn table4(t: vec4<u32>, n: u32) -> u32 {
    var r = 0u;
    for (var i = 0u; i < 4u; i += 1u) {
        let q = (n >> (8u * i)) & 15u;
        r |= ((t[q >> 2u] >> ((q & 3u) * 8u)) & 0xffu) << (8u * i);
    }
    return r;
}

// Bits 0..3 of `b` to bit 0 of bytes 0..3.
fn spread4(b: u32) -> u32 {
    return (b & 1u) | ((b & 2u) << 7u) | ((b & 4u) << 14u) | ((b & 8u) << 21u);
}

// Sixteen 4-bit quants from 16 bytes at `qs`, low nibbles first (elements 0..15), then high.
fn nibbles16(qs: u32) {
    for (var k = 0u; k < 4u; k += 1u) {
        let l = word_at(qs + 4u * k);
        qw[k] = l & 0x0f0f0f0fu;
        qw[k + 4u] = (l >> 4u) & 0x0f0f0f0fu;
    }
}

// Chunk `c` of the row starting at byte `row`: fills `qw` and returns its scales.
fn chunk(row: u32, c: u32) -> Chunk {
    var ch = Chunk(vec4<i32>(1, 1, 0, 0), vec2<i32>(0, 0), 0.0, 0.0);
    if (TYPE == T_Q8_0) {
        let blk = row + c * 34u;
        for (var k = 0u; k < 8u; k += 1u) {
            qw[k] = word_at(blk + 2u + 4u * k);
        }
        ch.da = f16_at(blk);
        return ch;
    }
    if (TYPE == T_IQ4_NL || TYPE == T_MXFP4) {
        let mx = TYPE == T_MXFP4;
        let blk = row + c * select(18u, 17u, mx);
        nibbles16(blk + select(2u, 1u, mx));
        let t = select(IQ4_TABLE, FP4_TABLE, mx);
        for (var k = 0u; k < 8u; k += 1u) {
            qw[k] = table4(t, qw[k]);
        }
        ch.da = select(f16_at(blk), e8m0_half(byte_at(blk)), mx);
        return ch;
    }
    if (TYPE == T_Q4_0 || TYPE == T_Q4_1 || TYPE == T_Q5_0 || TYPE == T_Q5_1) {
        // Unsigned quants; Q4_0's and Q5_0's offset is taken off through the activation sums,
        // Q4_1's and Q5_1's min added through them.
        var bb = 18u;
        var qs = 2u;
        if (TYPE == T_Q4_1) { bb = 20u; qs = 4u; }
        if (TYPE == T_Q5_0) { bb = 22u; qs = 6u; }
        if (TYPE == T_Q5_1) { bb = 24u; qs = 8u; }
        let blk = row + c * bb;
        nibbles16(blk + qs);
        if (TYPE == T_Q5_0 || TYPE == T_Q5_1) {
            let qh = word_at(blk + qs - 4u);
            for (var k = 0u; k < 4u; k += 1u) {
                qw[k] |= spread4((qh >> (4u * k)) & 15u) << 4u;
                qw[k + 4u] |= spread4((qh >> (16u + 4u * k)) & 15u) << 4u;
            }
        }
        ch.da = f16_at(blk);
        if (TYPE == T_Q4_0) {
            ch.a = vec4<i32>(1, 1, -8, -8);
        }
        if (TYPE == T_Q5_0) {
            ch.a = vec4<i32>(1, 1, -16, -16);
        }
        if (TYPE == T_Q4_1 || TYPE == T_Q5_1) {
            ch.b = vec2<i32>(1, 1);
            ch.db = f16_at(blk + 2u);
        }
        return ch;
    }
    // The K types and IQ4_XS: sub-block `s` (of 32) of super-block `c / 8`.
    let s = c & 7u;
    if (TYPE == T_Q4_K || TYPE == T_Q5_K) {
        let blk = row + (c >> 3u) * select(144u, 176u, TYPE == T_Q5_K);
        let qs = blk + select(16u, 48u, TYPE == T_Q5_K) + 32u * (s >> 1u);
        for (var k = 0u; k < 8u; k += 1u) {
            qw[k] = (word_at(qs + 4u * k) >> (4u * (s & 1u))) & 0x0f0f0f0fu;
            if (TYPE == T_Q5_K) {
                qw[k] |= ((word_at(blk + 16u + 4u * k) >> s) & 0x01010101u) << 4u;
            }
        }
        let sm = vec2<i32>(k_scale_min(s, blk + 4u));
        ch.a = vec4<i32>(sm.x, sm.x, 0, 0);
        ch.b = vec2<i32>(sm.y, sm.y);
        ch.da = f16_at(blk);
        ch.db = -f16_at(blk + 2u);
        return ch;
    }
    if (TYPE == T_Q6_K) {
        let blk = row + (c >> 3u) * 210u;
        let half = s >> 2u;
        let quarter = s & 3u;
        let ql = blk + 64u * half + 32u * (quarter & 1u);
        let qh = blk + 128u + 32u * half;
        for (var k = 0u; k < 8u; k += 1u) {
            let low = (word_at(ql + 4u * k) >> (4u * (quarter >> 1u))) & 0x0f0f0f0fu;
            let high = (word_at(qh + 4u * k) >> (2u * quarter)) & 0x03030303u;
            qw[k] = low | (high << 4u);
        }
        let s0 = i32(i8_of(byte_at(blk + 192u + 2u * s)));
        let s1 = i32(i8_of(byte_at(blk + 193u + 2u * s)));
        ch.a = vec4<i32>(s0, s1, -32 * s0, -32 * s1);
        ch.da = f16_at(blk + 208u);
        return ch;
    }
    if (TYPE == T_Q2_K || TYPE == T_Q3_K) {
        let q3 = TYPE == T_Q3_K;
        let blk = row + (c >> 3u) * select(84u, 110u, q3);
        let qs = blk + select(16u, 32u, q3) + 32u * (s >> 2u);
        for (var k = 0u; k < 8u; k += 1u) {
            qw[k] = (word_at(qs + 4u * k) >> (2u * (s & 3u))) & 0x03030303u;
            if (q3) {
                qw[k] |= ((word_at(blk + 4u * k) >> s) & 0x01010101u) << 2u;
            }
        }
        if (q3) {
            var sc = vec2<i32>(0, 0);
            for (var h = 0u; h < 2u; h += 1u) {
                let g = 2u * s + h;
                let low = (byte_at(blk + 96u + (g & 7u)) >> (4u * (g >> 3u))) & 15u;
                let high = (byte_at(blk + 104u + (g & 3u)) >> (2u * (g >> 2u))) & 3u;
                sc[h] = i32(low | (high << 4u)) - 32;
            }
            ch.a = vec4<i32>(sc.x, sc.y, -4 * sc.x, -4 * sc.y);
            ch.da = f16_at(blk + 108u);
            return ch;
        }
        let b0 = byte_at(blk + 2u * s);
        let b1 = byte_at(blk + 2u * s + 1u);
        ch.a = vec4<i32>(i32(b0 & 15u), i32(b1 & 15u), 0, 0);
        ch.b = vec2<i32>(i32(b0 >> 4u), i32(b1 >> 4u));
        ch.da = f16_at(blk + 80u);
        ch.db = -f16_at(blk + 82u);
        return ch;
    }
    // IQ4_XS.
    let blk = row + (c >> 3u) * 136u;
    nibbles16(blk + 8u + 16u * s);
    for (var k = 0u; k < 8u; k += 1u) {
        qw[k] = table4(IQ4_TABLE, qw[k]);
    }
    let sl = (byte_at(blk + 4u + (s >> 1u)) >> (4u * (s & 1u))) & 15u;
    let sh = (u16_at(blk + 2u) >> (2u * s)) & 3u;
    let sc = i32(sl | (sh << 4u)) - 32;
    ch.a = vec4<i32>(sc, sc, 0, 0);
    ch.da = f16_at(blk);
    return ch;
}

// The chunk's value (in `qw`, scales `ch`) over token `t`'s chunk `c`.
fn chunk_dot(ch: Chunk, t: u32, c: u32) -> f32 {
    let words = p.ntok * p.cols / 4u;
    let xw = t * p.cols / 4u + 8u * c;
    var q0 = 0i;
    var q1 = 0i;
    for (var k = 0u; k < 4u; k += 1u) {
        q0 += dot4I8Packed(qw[k], xq[xw + k]);
        q1 += dot4I8Packed(qw[k + 4u], xq[xw + 4u + k]);
    }
    let e = t * p.cols + 32u * c;
    let xs = bitcast<f32>(xq[words + e / XB]);
    var s = vec2<i32>(0, 0);
    if (SUMS) {
        let sums = words + p.ntok * p.cols / XB + e / 16u;
        s = vec2<i32>(bitcast<i32>(xq[sums]), bitcast<i32>(xq[sums + 1u]));
    }
    return xs * (ch.da * f32(dot(ch.a, vec4<i32>(q0, q1, s.x, s.y))) + ch.db * f32(dot(ch.b, s)));
}

// As `matmul`, on the packed 8-bit activations: its 64 threads over the row's chunks.
@compute @workgroup_size(64)
fn matmul_q8(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let j = row_job(wg, 1u, 0u);
    if (!j.ok) {
        return;
    }
    var acc: array<f32, 8>;
    for (var c = lid; c < p.cols / 32u; c += 64u) {
        let ch = chunk(j.row, c);
        for (var t = 0u; t < j.nt; t += 1u) {
            acc[t] += chunk_dot(ch, j.t0 + t, c);
        }
    }
    reduce_store(acc, lid, j);
}

// As `matmul_thread`, on the packed 8-bit activations: the sums of `matmul_q8` in its order
// (chunk c into partial c % 64), so the two give the same bits.
@compute @workgroup_size(64)
fn matmul_q8_thread(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let j = row_job(wg, 64u, lid);
    if (!j.ok) {
        return;
    }
    var part: array<f32, 512>;
    for (var c = 0u; c < p.cols / 32u; c += 1u) {
        let ch = chunk(j.row, c);
        let lane = (c & 63u) * TILE;
        for (var t = 0u; t < j.nt; t += 1u) {
            part[lane + t] += chunk_dot(ch, j.t0 + t, c);
        }
    }
    tree_store(&part, j);
}
