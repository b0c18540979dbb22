// Elementwise operations, row and column moves, and argmax (the wgpu device). One thread per
// value, 256 a workgroup, the grid `groups_x` wide (src/backend/ops.rs and cpu.rs compute the same).

struct Params {
    n: u32,
    width: u32,
    m: u32,
    groups_x: u32,
    f: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(6) var<storage, read_write> packed: array<u32>;

fn index(wg: vec3<u32>, lid: u32) -> u32 {
    return (wg.x + wg.y * p.groups_x) * 256u + lid;
}

// x += y
@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        x[i] += y[i];
    }
}

// x *= y
@compute @workgroup_size(256)
fn mul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        x[i] *= y[i];
    }
}

// x[t] += y (one row of `width`) for every row t
@compute @workgroup_size(256)
fn add_bias(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        x[i] += y[i % p.width];
    }
}

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

// As ops::gelu_tanh: x / (1 + exp(-2u)), u = sqrt(2/pi) x (1 + 0.044715 x^2).
fn gelu_tanh(v: f32) -> f32 {
    let u = 0.7978846 * v * (1.0 + 0.044715 * v * v);
    return v / (1.0 + exp(-2.0 * u));
}

@compute @workgroup_size(256)
fn act_silu(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        x[i] = silu(x[i]);
    }
}

@compute @workgroup_size(256)
fn act_gelu(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        x[i] = gelu_tanh(x[i]);
    }
}

// x = f(y) * x: the gated FFN's product, the gate activated as it is read.
@compute @workgroup_size(256)
fn silu_mul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        x[i] *= silu(y[i]);
    }
}

@compute @workgroup_size(256)
fn gelu_mul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        x[i] *= gelu_tanh(y[i]);
    }
}

// x = cap * tanh(x / cap), cap = f
@compute @workgroup_size(256)
fn softcap(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        x[i] = p.f * tanh(x[i] / p.f);
    }
}

// out[r] = y[ids[r]] for rows of `width` (n = rows out * width)
@compute @workgroup_size(256)
fn select_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        out[i] = y[ids[i / p.width] * p.width + i % p.width];
    }
}

// out[t][ids[j]] = y[t][j]: y is [rows, m], out (zeroed) [rows, width]; n = rows * m
@compute @workgroup_size(256)
fn scatter_cols(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        let t = i / p.m;
        let j = i % p.m;
        out[t * p.width + ids[j]] = y[i];
    }
}

// out[t][j] = y[t][ids[j]]: y is [rows, width], out [rows, m]; n = rows * m
@compute @workgroup_size(256)
fn gather_cols(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if (i < p.n) {
        let t = i / p.m;
        let j = i % p.m;
        out[i] = y[t * p.width + ids[j]];
    }
}

var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;

// Whether `a` (value va) wins over `b` (value vb) as pick::argmax has it: the larger value, the
// lower id on ties. (NaN values are skipped before: a row of logits with NaN is a broken pass,
// which the host's argmax answers with 0 only when the first value is NaN.)
fn wins(va: f32, a: u32, vb: f32, b: u32) -> bool {
    if (va > vb) {
        return true;
    }
    if (va == vb) {
        return a < b;
    }
    return false;
}

// tokens[r] = the id of row r's largest value (rows of `width`), the `m` ids in `ids` banned.
// One workgroup a row (n rows).
@compute @workgroup_size(256)
fn argmax(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x + wg.y * p.groups_x;
    if (r >= p.n) {
        return;
    }
    var bv = -3.4028235e38;
    var bi = 0xffffffffu;
    for (var c = lid; c < p.width; c += 256u) {
        var banned = false;
        for (var b = 0u; b < p.m; b += 1u) {
            if (ids[b] == c) {
                banned = true;
            }
        }
        let v = y[r * p.width + c];
        let nan = (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
        if (!banned && !nan && (bi == 0xffffffffu || wins(v, c, bv, bi))) {
            bv = v;
            bi = c;
        }
    }
    best_v[lid] = bv;
    best_i[lid] = bi;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            let oi = best_i[lid + s];
            if (oi != 0xffffffffu && (best_i[lid] == 0xffffffffu || wins(best_v[lid + s], oi, best_v[lid], best_i[lid]))) {
                best_v[lid] = best_v[lid + s];
                best_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        tokens[r] = select(best_i[0], 0u, best_i[0] == 0xffffffffu);
    }
}

// The activations as the CPU prepares them for products with quantized weights
// (src/quant/prepare.rs): blocks of `m` values (n blocks) in 8 bits. m = 32 (legacy types):
// scale max|x| / 127, quants rounded half away from zero; m = 256 (K types, ggml's Q8_K): the
// scale of the first value of largest magnitude (signed), quants rounded half to even and capped
// at 127. `q8_scale` gives a block's (scale, 1 / scale), `q8_quant` one value's quant.
fn q8_scale(off: u32) -> vec2<f32> {
    var amax = 0.0;
    var first = 0.0;
    for (var i = 0u; i < p.m; i += 1u) {
        let v = y[off + i];
        if (abs(v) > amax) {
            amax = abs(v);
            first = v;
        }
    }
    if (p.m == 32u) {
        let scale = amax / 127.0;
        return vec2<f32>(scale, select(0.0, 1.0 / scale, scale != 0.0));
    }
    if (amax == 0.0) {
        return vec2<f32>(0.0, 0.0);
    }
    let inv = -127.0 / first;
    return vec2<f32>(1.0 / inv, inv);
}

fn q8_quant(v: f32, inv: f32) -> f32 {
    if (p.m == 32u) {
        let s = v * inv;
        let t = trunc(s);
        return t + select(0.0, 1.0, s - t >= 0.5) - select(0.0, 1.0, s - t <= -0.5);
    }
    return min(round(inv * v), 127.0);
}

// The quants decoded back to f32 (`out`): the f32 products then multiply the weights with the
// values the CPU's integer dot products multiply them with.
@compute @workgroup_size(256)
fn quantize_q8(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let b = index(wg, lid);
    if (b >= p.n) {
        return;
    }
    let off = b * p.m;
    let s = q8_scale(off);
    for (var i = 0u; i < p.m; i += 1u) {
        out[off + i] = q8_quant(y[off + i], s.y) * s.x;
    }
}

// The quants as they are, for the packed 8-bit products (kernels/wgsl/quant.wgsl
// `matmul_q8`), in `packed` as u32 words: the n * m quants four to a word (little-endian i8,
// in order), then the n scales (f32 bits), then the sum of each 16 quants (i32 bits).
@compute @workgroup_size(256)
fn quantize_q8_packed(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let b = index(wg, lid);
    if (b >= p.n) {
        return;
    }
    let off = b * p.m;
    let total = p.n * p.m;
    let s = q8_scale(off);
    packed[total / 4u + b] = bitcast<u32>(s.x);
    for (var g = off / 16u; g < (off + p.m) / 16u; g += 1u) {
        var sum = 0i;
        for (var k = 0u; k < 4u; k += 1u) {
            var word = 0u;
            for (var i = 0u; i < 4u; i += 1u) {
                let q = i32(q8_quant(y[g * 16u + k * 4u + i], s.y));
                sum += q;
                word |= (u32(q) & 0xffu) << (8u * i);
            }
            packed[g * 4u + k] = word;
        }
        packed[total / 4u + p.n + g] = bitcast<u32>(sum);
    }
}
