// Attention of query heads over one sequence's cached keys and values (the wgpu device), as
// ops::attend computes it: softmax(scale * q.k_j) over positions first..=pos, with an optional
// sink logit (gpt-oss) that joins the softmax's sum and adds no value. One workgroup of 64
// threads a (token, query head); grouped heads read their key/value head (head / group). The
// positions are taken 64 at a time (one score a thread) with a running maximum and sum
// (online softmax), so any context length runs in the same workgroup memory; each thread keeps
// the output values of dimensions lid, lid + 64, ... (head_dim at most 640: DeepSeek's latent
// heads are 576; their values are the keys, `vc` bound to the key cache). A span longer than
// `chunk` positions is split over `splits` workgroups a (token, head), each writing its maximum,
// sum and weighted values to `part` (`attention_part`), which `attention_join` merges: a long
// context fills more of the GPU, and no invocation loops past a software adapter's budget.

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
    // Positions a workgroup takes (split spans only) and workgroups a (token, head).
    chunk: u32,
    splits: u32,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> kc: array<f32>;
@group(0) @binding(2) var<storage, read> vc: array<f32>;
// Per token of this sequence: its row in q and out, and its position.
@group(0) @binding(3) var<storage, read> at: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read> sinks: array<f32>;
@group(0) @binding(5) var<uniform> p: Params;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;
// Per (token, head, split): its maximum, sum, then head_dim weighted values.
@group(0) @binding(7) var<storage, read_write> part: array<f32>;

var<workgroup> qh: array<f32, 640>;
var<workgroup> sc: array<f32, 64>;
var<workgroup> here: vec2<u32>;

const LOWEST: f32 = -3.4028235e38;

// One (token, head)'s online softmax over chunk `c` of its span (the whole span when
// `p.splits` is 1), starting from the sink's logit when `with_sink`: the running maximum, sum
// and this thread's weighted values.
struct Partial {
    m: f32,
    l: f32,
    acc: array<f32, 10>,
}

fn attend(g: u32, lid: u32, c: u32, with_sink: bool) -> Partial {
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
    var lo = first;
    var hi = pos;
    if (p.splits > 1u) {
        lo = first + c * p.chunk;
        hi = min(pos, lo + p.chunk - 1u);
    }
    for (var i = lid; i < p.head_dim; i += 64u) {
        qh[i] = q[qoff + i];
    }
    workgroupBarrier();
    var r: Partial;
    r.m = LOWEST;
    r.l = 0.0;
    if (with_sink) {
        r.m = sinks[h];
        r.l = 1.0;
    }
    for (var j0 = lo; j0 <= hi; j0 += 64u) {
        let j = j0 + lid;
        var s = LOWEST;
        if (j <= hi) {
            var d = 0.0;
            let k = j * p.kv_dim + koff;
            for (var i = 0u; i < p.head_dim; i += 1u) {
                d += qh[i] * kc[k + i];
            }
            s = d * p.scale;
        }
        sc[lid] = s;
        workgroupBarrier();
        let n = min(64u, hi + 1u - j0);
        var mt = r.m;
        for (var i = 0u; i < n; i += 1u) {
            mt = max(mt, sc[i]);
        }
        let alpha = exp(r.m - mt);
        r.l *= alpha;
        for (var c = 0u; c < 10u; c += 1u) {
            r.acc[c] *= alpha;
        }
        for (var i = 0u; i < n; i += 1u) {
            let e = exp(sc[i] - mt);
            r.l += e;
            let v = (j0 + i) * p.kv_dim + koff;
            for (var c = 0u; c < 10u; c += 1u) {
                let dim = lid + 64u * c;
                if (dim < p.head_dim) {
                    r.acc[c] += e * vc[v + dim];
                }
            }
        }
        r.m = mt;
        workgroupBarrier();
    }
    return r;
}

// The whole span in one workgroup a (token, head): its output.
@compute @workgroup_size(64)
fn attention(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = wg.x + wg.y * p.groups_x;
    if (g >= p.tokens * p.n_heads) {
        return;
    }
    let r = attend(g, lid, 0u, p.has_sinks != 0u);
    let rp = at[g / p.n_heads];
    let qoff = rp.x * p.q_width + (g % p.n_heads) * p.head_dim;
    for (var c = 0u; c < 10u; c += 1u) {
        let dim = lid + 64u * c;
        if (dim < p.head_dim) {
            out[qoff + dim] = r.acc[c] / r.l;
        }
    }
}

// Chunk g % splits of (token, head) g / splits: its partial softmax into `part` (no sink: the
// join adds it once). A chunk past its token's span writes an empty partial (sum 0).
@compute @workgroup_size(64)
fn attention_part(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let gs = wg.x + wg.y * p.groups_x;
    if (gs >= p.tokens * p.n_heads * p.splits) {
        return;
    }
    let r = attend(gs / p.splits, lid, gs % p.splits, false);
    let base = gs * (p.head_dim + 2u);
    if (lid == 0u) {
        part[base] = r.m;
        part[base + 1u] = r.l;
    }
    for (var c = 0u; c < 10u; c += 1u) {
        let dim = lid + 64u * c;
        if (dim < p.head_dim) {
            part[base + 2u + dim] = r.acc[c];
        }
    }
}

// (token, head) g's output from its `splits` partials (and its sink): each rescaled to the
// largest maximum, summed, divided by the summed sums.
@compute @workgroup_size(64)
fn attention_join(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = wg.x + wg.y * p.groups_x;
    if (g >= p.tokens * p.n_heads) {
        return;
    }
    let h = g % p.n_heads;
    let qoff = at[g / p.n_heads].x * p.q_width + h * p.head_dim;
    let stride = p.head_dim + 2u;
    var mx = LOWEST;
    if (p.has_sinks != 0u) {
        mx = sinks[h];
    }
    for (var s = 0u; s < p.splits; s += 1u) {
        mx = max(mx, part[(g * p.splits + s) * stride]);
    }
    var l = 0.0;
    if (p.has_sinks != 0u) {
        l = exp(sinks[h] - mx);
    }
    var acc: array<f32, 10>;
    for (var s = 0u; s < p.splits; s += 1u) {
        let base = (g * p.splits + s) * stride;
        let w = exp(part[base] - mx);
        l += part[base + 1u] * w;
        for (var c = 0u; c < 10u; c += 1u) {
            let dim = lid + 64u * c;
            if (dim < p.head_dim) {
                acc[c] += part[base + 2u + dim] * w;
            }
        }
    }
    for (var c = 0u; c < 10u; c += 1u) {
        let dim = lid + 64u * c;
        if (dim < p.head_dim) {
            out[qoff + dim] = acc[c] / l;
        }
    }
}
