//! The read planner: turns the byte extents a layer needs (one per neuron, in file order) into
//! reads. Neighbouring extents are merged into one read when the gap between them (after both
//! are widened to the device's alignment) costs less to read than issuing another request, by a
//! per-device cost model; a read never grows past `max_read_bytes`.
//!
//! Pure: knows offsets, lengths and costs only; never files, neurons' meaning or the reader.

use crate::error::{Error, Result};
use crate::io::Range;

/// What a read costs on this device: a fixed time per request plus its bytes at the device's
/// bandwidth. Gaps shorter than `request_us × bytes_per_us` are cheaper to read than to skip.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct CostModel {
    /// Time one more request costs (at the queue depth the reads run at), microseconds.
    pub request_us: f64,
    /// Sequential bandwidth, bytes per microsecond (= MB/s).
    pub bytes_per_us: f64,
    /// The reader widens every read to this alignment (1 for buffered reads).
    pub align_bytes: u64,
    /// Merged reads stop growing here.
    pub max_read_bytes: u64,
}

impl CostModel {
    /// The development machine's virtio disk, conservatively (docs/DESIGN.md): ~75k IOPS of 4 KiB at queue depth 64
    /// (≈13 µs per request) and ~1.5 GB/s sequential.
    pub fn default_for(align_bytes: u64) -> CostModel {
        CostModel {
            request_us: 13.0,
            bytes_per_us: 1500.0,
            align_bytes: align_bytes.max(1),
            max_read_bytes: 1 << 20,
        }
    }

    /// The largest gap worth reading through rather than starting a new request.
    pub fn merge_gap_bytes(&self) -> u64 {
        (self.request_us * self.bytes_per_us).max(0.0) as u64
    }

    /// Modelled time of a set of reads, microseconds.
    pub fn cost_us(&self, device_bytes: u64, requests: u64) -> f64 {
        requests as f64 * self.request_us + device_bytes as f64 / self.bytes_per_us
    }
}

/// Random reads per batch in [`probe`]: about what one layer of a sparse token issues.
const PROBE_BATCH: usize = 256;

/// Measures a cost model on `reader`'s own file: `random_reads` reads of one 4 KiB block at
/// spread-out offsets in batches of 256, twice, the faster counting (the per-request cost at the reader's queue depth), then
/// `seq_bytes` in `chunk_bytes` reads from one place (the bandwidth). With O_DIRECT the page
/// cache does not answer; through the page cache the figures describe it, not the device.
pub fn probe(
    reader: &dyn crate::io::Reader,
    random_reads: usize,
    seq_bytes: u64,
    chunk_bytes: usize,
    max_read_bytes: u64,
) -> Result<CostModel> {
    let len = reader.len_bytes();
    let block = 4096u64;
    let blocks = (len / block).max(1);
    // Offsets spread over the file by a fixed odd stride (no two alike, nothing cached nearby).
    let stride = (blocks / random_reads.max(1) as u64).max(1) | 1;
    let random: Vec<Range> = (0..random_reads as u64)
        .map(|i| Range::new(((i * stride * 7919) % blocks) * block, block.min(len) as usize))
        .collect();
    // In batches of `PROBE_BATCH` reads, as a layer issues them (each batch drains the queue
    // before the next: the tail is part of what a request costs the pipeline); twice, keeping
    // the faster, since the first pass also pays for waking the device up.
    let mut random_us = f64::INFINITY;
    for _ in 0..2 {
        let t0 = std::time::Instant::now();
        for batch in random.chunks(PROBE_BATCH) {
            reader.read_each(batch, &mut |_, _| Ok(()))?;
        }
        random_us = random_us.min(t0.elapsed().as_secs_f64() * 1e6);
    }
    let seq_bytes = seq_bytes.min(len);
    let chunk = chunk_bytes.max(4096) as u64;
    let start = (len - seq_bytes) / 2 / block * block;
    let seq: Vec<Range> = (0..seq_bytes.div_ceil(chunk))
        .map(|i| {
            let o = start + i * chunk;
            Range::new(o, chunk.min(start + seq_bytes - o) as usize)
        })
        .collect();
    let t1 = std::time::Instant::now();
    reader.read_each(&seq, &mut |_, _| Ok(()))?;
    let seq_us = t1.elapsed().as_secs_f64() * 1e6;
    let bytes_per_us = (seq_bytes as f64 / seq_us.max(1.0)).max(1.0);
    let per_read_us = random_us / random_reads.max(1) as f64;
    Ok(CostModel::from_rates(
        bytes_per_us,
        per_read_us,
        block,
        reader.align_bytes() as u64,
        max_read_bytes,
    ))
}

impl CostModel {
    /// From a sequential bandwidth (bytes/µs) and the time per random read of `read_bytes`
    /// (µs, at the queue depth it ran at): a request costs that time less its bytes' transfer.
    pub fn from_rates(
        bytes_per_us: f64,
        per_read_us: f64,
        read_bytes: u64,
        align_bytes: u64,
        max_read_bytes: u64,
    ) -> CostModel {
        let bytes_per_us = bytes_per_us.max(1.0);
        CostModel {
            request_us: (per_read_us - read_bytes as f64 / bytes_per_us).max(0.1),
            bytes_per_us,
            align_bytes: align_bytes.max(1),
            max_read_bytes,
        }
    }

    /// From a `gatestream bench --json` report's device baseline: its sequential 1 MiB
    /// bandwidth and its smallest random reads (4 KiB at queue depth 64 as bench runs them).
    pub fn from_bench_json(v: &serde_json::Value, align_bytes: u64, max_read_bytes: u64) -> Result<CostModel> {
        let bad = |what: &str| Error::Input(format!("not a gatestream bench report: {what}"));
        let b = v.get("baseline").ok_or_else(|| bad("no \"baseline\""))?;
        let seq = b["sequential_1mib_gb_per_s"]
            .as_f64()
            .filter(|g| g.is_finite() && *g > 0.0)
            .ok_or_else(|| bad("no baseline.sequential_1mib_gb_per_s"))?;
        let (read_bytes, iops) = b["random"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| Some((r["read_bytes"].as_u64()?, r["iops"].as_f64()?)))
            .filter(|&(n, iops)| n > 0 && iops.is_finite() && iops > 0.0)
            .min_by_key(|&(n, _)| n)
            .ok_or_else(|| bad("no baseline.random reads"))?;
        Ok(CostModel::from_rates(
            seq * 1e3,
            1e6 / iops,
            read_bytes,
            align_bytes,
            max_read_bytes,
        ))
    }
}

/// One planned read: `range` covers extents `first..first + count` of the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedRead {
    pub range: Range,
    pub first: usize,
    pub count: usize,
}

/// What a plan reads, for read-amplification reporting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanTotals {
    /// Bytes the extents themselves hold.
    pub needed_bytes: u64,
    /// Bytes the device transfers: merged ranges widened to the alignment.
    pub device_bytes: u64,
    pub reads: u64,
}

fn align_down(x: u64, a: u64) -> u64 {
    x / a * a
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Plans reads for `extents` (`(offset_bytes, len_bytes)`, sorted by offset, not overlapping).
pub fn plan(extents: &[(u64, usize)], cost: &CostModel, out: &mut Vec<PlannedRead>) -> PlanTotals {
    out.clear();
    let a = cost.align_bytes.max(1);
    let gap_max = cost.merge_gap_bytes();
    let mut totals = PlanTotals::default();
    let mut i = 0;
    while i < extents.len() {
        let (start, len) = extents[i];
        let mut end = start + len as u64;
        let mut j = i + 1;
        while j < extents.len() {
            let (o, l) = extents[j];
            debug_assert!(o >= end, "extents must be sorted and disjoint");
            let gap = align_down(o, a).saturating_sub(align_up(end, a));
            let merged_len = align_up(o + l as u64, a) - align_down(start, a);
            if gap > gap_max || merged_len > cost.max_read_bytes {
                break;
            }
            end = o + l as u64;
            j += 1;
        }
        totals.needed_bytes += extents[i..j].iter().map(|e| e.1 as u64).sum::<u64>();
        totals.device_bytes += align_up(end, a) - align_down(start, a);
        totals.reads += 1;
        out.push(PlannedRead {
            range: Range::new(start, (end - start) as usize),
            first: i,
            count: j - i,
        });
        i = j;
    }
    totals
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(gap: u64, align: u64) -> CostModel {
        CostModel {
            request_us: gap as f64,
            bytes_per_us: 1.0,
            align_bytes: align,
            max_read_bytes: 1 << 20,
        }
    }

    #[test]
    fn a_bench_report_gives_the_cost_model_of_its_device_baseline() {
        // 1.5 GB/s sequential; 4 KiB at 50k IOPS = 20 µs per read, of which 4096 B / 1500 B/µs
        // is transfer.
        let v = serde_json::json!({"baseline": {"sequential_1mib_gb_per_s": 1.5, "random": [
            {"read_bytes": 65536, "queue_depth": 64, "iops": 10000.0, "gb_per_s": 0.65},
            {"read_bytes": 4096, "queue_depth": 64, "iops": 50000.0, "gb_per_s": 0.2}]}});
        let c = CostModel::from_bench_json(&v, 512, 1 << 20).unwrap();
        assert!((c.bytes_per_us - 1500.0).abs() < 1e-9);
        assert!((c.request_us - (20.0 - 4096.0 / 1500.0)).abs() < 1e-9, "{c:?}");
        assert_eq!((c.align_bytes, c.max_read_bytes), (512, 1 << 20));
        for bad in [serde_json::json!({}), serde_json::json!({"baseline": {"random": []}})] {
            let e = CostModel::from_bench_json(&bad, 512, 1 << 20).unwrap_err().to_string();
            assert!(e.contains("bench report"), "{e}");
        }
    }

    #[test]
    fn adjacent_extents_become_one_read_and_far_ones_stay_apart() {
        let ext = [(0u64, 100usize), (100, 100), (200, 100), (100_000, 50)];
        let mut out = Vec::new();
        let t = plan(&ext, &cost(4096, 512), &mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].range, Range::new(0, 300));
        assert_eq!((out[0].first, out[0].count), (0, 3));
        assert_eq!(out[1].range, Range::new(100_000, 50));
        assert_eq!(t.needed_bytes, 350);
        // 300 bytes widen to 512; 100_000..100_050 lies in one 512-byte block.
        assert_eq!(t.device_bytes, 512 + 512);
        assert_eq!(t.reads, 2);
    }

    #[test]
    fn gaps_merge_only_when_cheaper_than_a_request() {
        let ext = [(0u64, 512usize), (512 + 1024, 512), (512 + 1024 + 512 + 4096, 512)];
        let mut out = Vec::new();
        plan(&ext, &cost(2048, 512), &mut out);
        // The 1 KiB gap is read through; the 4 KiB one is not.
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].first, out[0].count, out[1].first), (0, 2, 2));
        plan(&ext, &cost(0, 512), &mut out);
        assert_eq!(out.len(), 3);
    }

    #[test]
    fn reads_stop_growing_at_the_maximum() {
        let ext: Vec<(u64, usize)> = (0..64).map(|i| (i * 1000, 1000)).collect();
        let mut out = Vec::new();
        let mut c = cost(1 << 20, 1);
        c.max_read_bytes = 10_000;
        let t = plan(&ext, &c, &mut out);
        assert_eq!(out.len(), 7);
        assert!(out.iter().all(|r| r.range.len_bytes <= 10_000));
        assert_eq!(out.iter().map(|r| r.count).sum::<usize>(), 64);
        assert_eq!(t.needed_bytes, t.device_bytes);
    }

    #[test]
    fn every_extent_is_covered_exactly_once() {
        let mut ext = Vec::new();
        let mut o = 4096u64;
        for i in 0..500u64 {
            o += (i * 7919) % 3000;
            ext.push((o, 700 + (i % 5) as usize * 100));
            o += 1200;
        }
        for gap in [0, 1000, 100_000] {
            let mut out = Vec::new();
            plan(&ext, &cost(gap, 4096), &mut out);
            let mut next = 0;
            for r in &out {
                assert_eq!(r.first, next);
                next += r.count;
                for &(eo, el) in &ext[r.first..r.first + r.count] {
                    assert!(eo >= r.range.offset_bytes);
                    assert!(eo + el as u64 <= r.range.offset_bytes + r.range.len_bytes as u64);
                }
            }
            assert_eq!(next, ext.len());
        }
    }
}
