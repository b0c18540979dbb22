// Each row's k largest values with their ids (the wgpu device), in f32::total_cmp's order as
// pick::most_likely has it, the m ids in `banned` taken as -inf; and the row's maximum and
// Σ exp(v - maximum) for its log-sum-exp. One workgroup of 256 threads a row. The k-th largest
// value is found by a radix select over order-preserving u32 keys, 8 bits a pass from the top
// (a 256-bin histogram of the values still in the running); then every value above it is
// written (any order: the host sorts the k pairs) and the values equal to it, lowest ids first,
// as many as k leaves. Each thread takes a contiguous run of the row, so the ties' ranks follow
// the ids. Loops per thread: about 9 × ceil(width / 256) × (m + 1), and 1300 more on thread 0.

struct Params {
    rows: u32,
    width: u32,
    k: u32,
    m: u32,
    groups_x: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> banned: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;
// Per row: k (id, value bits) pairs.
@group(0) @binding(3) var<storage, read_write> pairs: array<vec2<u32>>;
// Per row: its maximum and Σ exp(v - maximum), the banned ids left out.
@group(0) @binding(4) var<storage, read_write> sums: array<vec2<f32>>;

var<workgroup> hist: array<atomic<u32>, 256>;
var<workgroup> red: array<f32, 256>;
var<workgroup> ties: array<u32, 256>;
// The key prefix chosen so far, its mask, and how many values equal to the prefix's key remain
// to be taken.
var<workgroup> chosen: vec3<u32>;
var<workgroup> above: atomic<u32>;

// -inf's bits: a banned id's value.
const NEG_INF_BITS: u32 = 0xff800000u;
const LOWEST: f32 = -3.4028235e38;

// The bits of row r's value c (-inf when banned).
fn bits(r: u32, c: u32) -> u32 {
    for (var b = 0u; b < p.m; b += 1u) {
        if (banned[b] == c) {
            return NEG_INF_BITS;
        }
    }
    return bitcast<u32>(x[r * p.width + c]);
}

fn is_banned(c: u32) -> bool {
    for (var b = 0u; b < p.m; b += 1u) {
        if (banned[b] == c) {
            return true;
        }
    }
    return false;
}

// An order-preserving key: a larger key is a larger value in total_cmp's order.
fn key(b: u32) -> u32 {
    return select(b ^ 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

@compute @workgroup_size(256)
fn top_k(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x + wg.y * p.groups_x;
    if (r >= p.rows) {
        return;
    }
    let per = (p.width + 255u) / 256u;
    let lo = min(lid * per, p.width);
    let hi = min(lo + per, p.width);
    // The row's maximum and sum of exponentials (f32: the host's are f64).
    var mx = LOWEST;
    for (var c = lo; c < hi; c += 1u) {
        if (!is_banned(c)) {
            mx = max(mx, x[r * p.width + c]);
        }
    }
    red[lid] = mx;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    let row_max = red[0];
    workgroupBarrier();
    var sum = 0.0;
    for (var c = lo; c < hi; c += 1u) {
        if (!is_banned(c)) {
            sum += exp(x[r * p.width + c] - row_max);
        }
    }
    red[lid] = sum;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        sums[r] = vec2<f32>(row_max, red[0]);
        chosen = vec3<u32>(0u, 0u, p.k);
        atomicStore(&above, 0u);
    }
    workgroupBarrier();
    // Four passes of 8 bits: the k-th largest key.
    for (var shift = 24i; shift >= 0i; shift -= 8i) {
        atomicStore(&hist[lid], 0u);
        let want = workgroupUniformLoad(&chosen);
        for (var c = lo; c < hi; c += 1u) {
            let kv = key(bits(r, c));
            if ((kv & want.y) == want.x) {
                atomicAdd(&hist[(kv >> u32(shift)) & 255u], 1u);
            }
        }
        workgroupBarrier();
        if (lid == 0u) {
            var left = want.z;
            var b = 255u;
            loop {
                let n = atomicLoad(&hist[b]);
                if (n >= left || b == 0u) {
                    break;
                }
                left -= n;
                b -= 1u;
            }
            chosen = vec3<u32>(want.x | (b << u32(shift)), want.y | (255u << u32(shift)), left);
        }
        workgroupBarrier();
    }
    let t = workgroupUniformLoad(&chosen);
    // Slots 0 .. k - t.z: the values above the k-th (any order).
    let out = r * p.k;
    var equal = 0u;
    for (var c = lo; c < hi; c += 1u) {
        let v = bits(r, c);
        let kv = key(v);
        if (kv > t.x) {
            let i = atomicAdd(&above, 1u);
            pairs[out + i] = vec2<u32>(c, v);
        } else if (kv == t.x) {
            equal += 1u;
        }
    }
    // Then t.z values equal to it, lowest ids first: each thread's rank among the ties is the
    // ties of the threads before it.
    ties[lid] = equal;
    workgroupBarrier();
    if (lid == 0u) {
        var run = 0u;
        for (var i = 0u; i < 256u; i += 1u) {
            let n = ties[i];
            ties[i] = run;
            run += n;
        }
    }
    workgroupBarrier();
    var rank = ties[lid];
    let first_tie = p.k - t.z;
    for (var c = lo; c < hi; c += 1u) {
        if (rank >= t.z) {
            break;
        }
        let v = bits(r, c);
        if (key(v) == t.x) {
            pairs[out + first_tie + rank] = vec2<u32>(c, v);
            rank += 1u;
        }
    }
}
