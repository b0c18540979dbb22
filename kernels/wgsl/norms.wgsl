// RMS norm over rows (the wgpu device): one workgroup of 64 threads a row, as ops::rms_norm
// (which sums the squares in f64; here f32, in a tree).

struct Params {
    rows: u32,
    width: u32,
    groups_x: u32,
    eps: f32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> red: array<f32, 64>;

fn scale_of(off: u32, lid: u32) -> f32 {
    var ss = 0.0;
    for (var i = lid; i < p.width; i += 64u) {
        let v = x[off + i];
        ss += v * v;
    }
    red[lid] = ss;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    return 1.0 / sqrt(red[0] / f32(p.width) + p.eps);
}

// y[r] = x[r] * scale * w
@compute @workgroup_size(64)
fn rms_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x + wg.y * p.groups_x;
    if (r >= p.rows) {
        return;
    }
    let off = r * p.width;
    let scale = scale_of(off, lid);
    for (var i = lid; i < p.width; i += 64u) {
        y[off + i] = x[off + i] * scale * w[i];
    }
}

// x[r] = x[r] * scale * w
@compute @workgroup_size(64)
fn rms_norm_in_place(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x + wg.y * p.groups_x;
    if (r >= p.rows) {
        return;
    }
    let off = r * p.width;
    let scale = scale_of(off, lid);
    for (var i = lid; i < p.width; i += 64u) {
        x[off + i] = x[off + i] * scale * w[i];
    }
}
