// Queries' or keys' heads (the wgpu device): the optional per-head RMS norm, then RoPE from a
// table the host computes per token (cos, sin of each frequency, in f64 then rounded, as
// ops::rope_table), so the angles are the CPU's bit for bit. One workgroup of 64 threads a
// (token, head); the first `rope_dims` of a head rotate (adjacent pairs or the two halves),
// the rest pass through.

struct Params {
    rows: u32,
    width: u32,
    head_dim: u32,
    rope_dims: u32,
    half_split: u32,
    has_norm: u32,
    groups_x: u32,
    eps: f32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> table: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> norm: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

var<workgroup> head: array<f32, 1024>;
var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn rope(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let heads = p.width / p.head_dim;
    let g = wg.x + wg.y * p.groups_x;
    if (g >= p.rows * heads) {
        return;
    }
    let t = g / heads;
    let off = t * p.width + (g % heads) * p.head_dim;
    var ss = 0.0;
    for (var i = lid; i < p.head_dim; i += 64u) {
        let v = x[off + i];
        head[i] = v;
        ss += v * v;
    }
    red[lid] = ss;
    workgroupBarrier();
    if (p.has_norm != 0u) {
        for (var s = 32u; s > 0u; s >>= 1u) {
            if (lid < s) {
                red[lid] += red[lid + s];
            }
            workgroupBarrier();
        }
        let scale = 1.0 / sqrt(red[0] / f32(p.head_dim) + p.eps);
        for (var i = lid; i < p.head_dim; i += 64u) {
            head[i] = head[i] * scale * norm[i];
        }
        workgroupBarrier();
    }
    let pairs = p.rope_dims / 2u;
    for (var i = lid; i < pairs; i += 64u) {
        let cs = table[t * pairs + i];
        var a = 2u * i;
        var b = 2u * i + 1u;
        if (p.half_split != 0u) {
            a = i;
            b = i + pairs;
        }
        let x0 = head[a];
        let x1 = head[b];
        x[off + a] = x0 * cs.x - x1 * cs.y;
        x[off + b] = x0 * cs.y + x1 * cs.x;
    }
    for (var i = p.rope_dims + lid; i < p.head_dim; i += 64u) {
        x[off + i] = head[i];
    }
}
