//! Picking from a row of logits: its greedy token and its k most likely — the definitions every
//! device's row picks agree with (the CPU device computes them with these; the GPU's kernels are
//! checked against them).

/// Index of the largest value; the lowest index wins ties, so greedy decoding is deterministic.
/// NaNs are passed over (a NaN first: 0), as a scan keeping the first value nothing beats would.
/// Two passes the compiler vectorizes (a vocabulary of 152k logits every decode step; ~10x
/// faster than one scan here): the largest value over 16 lanes, then the first block holding
/// it and its first place there (equal as floats: -0 and +0 alike, as the scan's `>` sees them).
pub fn argmax(x: &[f32]) -> u32 {
    const LANES: usize = 16;
    const BLOCK: usize = 64;
    let Some(&first) = x.first().filter(|v| !v.is_nan()) else {
        return 0;
    };
    let mut lane = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            lane[j] = if c[j] > lane[j] { c[j] } else { lane[j] };
        }
    }
    let mut max = first;
    for &v in lane.iter().chain(tail) {
        if v > max {
            max = v;
        }
    }
    // `max` started at `first` and only grew: equal (as floats), the first value is the answer.
    if max == first {
        return 0;
    }
    for (b, block) in x.chunks(BLOCK).enumerate() {
        if block.iter().fold(false, |hit, &v| hit | (v == max)) {
            let k = block.iter().position(|&v| v == max).expect("the block holds it");
            return (b * BLOCK + k) as u32;
        }
    }
    0
}

/// [`argmax`] of `x` with the `banned` ids (those inside `x`) counted as -inf, as generation
/// bans stop tokens under `--ignore-eos`.
pub fn argmax_banned(x: &[f32], banned: &[u32]) -> u32 {
    // Banning lowers values only at the banned ids: the first largest of the rest stays the
    // answer (a NaN first value, 0, too, unless 0 is banned). So the row is copied only when the
    // answer is banned.
    let t = argmax(x);
    if !banned.contains(&t) {
        return t;
    }
    let mut row = x.to_vec();
    ban(&mut row, banned);
    argmax(&row)
}

/// The `banned` ids of `row` (those inside it) set to -inf: a stop token never sampled under
/// `--ignore-eos`.
pub fn ban(row: &mut [f32], banned: &[u32]) {
    for &b in banned {
        if let Some(v) = row.get_mut(b as usize) {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// [`argmax`] as one scan (the definition the lanes must agree with).
#[cfg(test)]
pub(crate) fn argmax_scan(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// The `k` largest logits with their ids, largest first (ties: lower id first), in
/// `f32::total_cmp`'s order (+0 above -0, a NaN with its sign bit clear above +inf).
pub fn most_likely(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut all: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    if k < all.len() {
        all.select_nth_unstable_by(k - 1, by_logit);
        all.truncate(k);
    }
    all.sort_unstable_by(by_logit);
    all
}
