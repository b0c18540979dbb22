// Attention of query heads over one sequence's cached keys and values (the wgpu device), as
// ops::attend computes it: softmax(scale * q.k_j) over positions first..=pos, with an optional
// sink logit (gpt-oss) that joins the softmax's sum and adds no value. One workgroup of 64
// threads a (token, query head); grouped heads read their key/value head (head / group). The
// positions are taken 64 at a time (one score a thread) with a running maximum and sum
// (online softmax), so any context length runs in the same workgroup memory; each thread keeps
// the output values of dimensions lid, lid + 64, ... (head_dim at most 256).

struct Params {
    tokens: u32,
    n_heads: u32,
    group: u32,
    head_dim: u32,
    kv_dim: u32,
    q_width: u32,
    window: u32,
    has_sinks: u32,
    groups_x: u32,
    scale: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> kc: array<f32>;
@group(0) @binding(2) var<storage, read> vc: array<f32>;
// Per token of this sequence: its row in q and out, and its position.
@group(0) @binding(3) var<storage, read> at: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read> sinks: array<f32>;
@group(0) @binding(5) var<uniform> p: Params;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

var<workgroup> qh: array<f32, 256>;
var<workgroup> sc: array<f32, 64>;
var<workgroup> here: vec2<u32>;

const LOWEST: f32 = -3.4028235e38;

@compute @workgroup_size(64)
fn attention(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = wg.x + wg.y * p.groups_x;
    if (g >= p.tokens * p.n_heads) {
        return;
    }
    let ti = g / p.n_heads;
    let h = g % p.n_heads;
    if (lid == 0u) {
        here = at[ti];
    }
    // The row and position, uniform across the workgroup (the loop over positions has barriers).
    let rp = workgroupUniformLoad(&here);
    let row = rp.x;
    let pos = rp.y;
    let qoff = row * p.q_width + h * p.head_dim;
    let koff = (h / p.group) * p.head_dim;
    var first = 0u;
    if (p.window > 0u && pos + 1u > p.window) {
        first = pos + 1u - p.window;
    }
    for (var i = lid; i < p.head_dim; i += 64u) {
        qh[i] = q[qoff + i];
    }
    workgroupBarrier();
    var m = LOWEST;
    var l = 0.0;
    if (p.has_sinks != 0u) {
        m = sinks[h];
        l = 1.0;
    }
    var acc: array<f32, 4>;
    for (var j0 = first; j0 <= pos; j0 += 64u) {
        let j = j0 + lid;
        var s = LOWEST;
        if (j <= pos) {
            var d = 0.0;
            let k = j * p.kv_dim + koff;
            for (var i = 0u; i < p.head_dim; i += 1u) {
                d += qh[i] * kc[k + i];
            }
            s = d * p.scale;
        }
        sc[lid] = s;
        workgroupBarrier();
        let n = min(64u, pos + 1u - j0);
        var mt = m;
        for (var i = 0u; i < n; i += 1u) {
            mt = max(mt, sc[i]);
        }
        let alpha = exp(m - mt);
        l *= alpha;
        for (var c = 0u; c < 4u; c += 1u) {
            acc[c] *= alpha;
        }
        for (var i = 0u; i < n; i += 1u) {
            let e = exp(sc[i] - mt);
            l += e;
            let v = (j0 + i) * p.kv_dim + koff;
            for (var c = 0u; c < 4u; c += 1u) {
                let dim = lid + 64u * c;
                if (dim < p.head_dim) {
                    acc[c] += e * vc[v + dim];
                }
            }
        }
        m = mt;
        workgroupBarrier();
    }
    for (var c = 0u; c < 4u; c += 1u) {
        let dim = lid + 64u * c;
        if (dim < p.head_dim) {
            out[qoff + dim] = acc[c] / l;
        }
    }
}
