//! CUDA graphs for repeated work ([`GRAPHS_ENV`]): with them on, the device records its kernel
//! launches and zero-fills instead of issuing them, up to the next point where the host needs
//! the device's results (a copy to the host, an upload into a pooled buffer, an error check) —
//! a *segment*, which for a decode step in device memory is the whole step. A segment's
//! recording is its signature: kernels, launch geometry and every parameter. The first time a
//! signature is seen its operations are launched one by one; the second time they are captured
//! into a CUDA graph (`cuStreamBeginCapture` on the device's stream, each recorded launch again,
//! `cuStreamEndCapture`, instantiate), and from then on that segment is one `cuGraphLaunch`.
//!
//! A repeated segment only matches if its parameters repeat, so what changes from step to step
//! lives in device memory at fixed addresses: the small index lists of a segment (token ids,
//! positions, the KV cache's per-token words, the rows whose logits are wanted) are written to
//! an *arena* (one device buffer, filled from its start in each segment, before the segment's
//! kernels run — stream order), activation buffers come from the pool in the same order every
//! step, and attention's score rows are sized by powers of two.
//!
//! What recording must not break: a recorded kernel reads memory at its launch, not at its
//! recording. So nothing a recorded kernel may read is freed or written before the segment is
//! launched — buffers the pool lets go and index lists the cache drops are held until then
//! (`keep`), host-to-device copies during recording only write fresh allocations or the arena's
//! unused part, and anything else (a streamed weight's copy, a staged upload, page-locking)
//! first launches what is recorded and makes the rest of the segment direct.

use std::any::Any;
use std::hash::{Hash, Hasher};

use cudarc::driver::{sys, CudaGraph, CudaSlice, LaunchConfig};

use super::{Arg, CudaDevice, FastMap};
use crate::error::Result;
use crate::quant::GgmlType;

/// `GATESTREAM_CUDA_GRAPHS`: `1` (or `on`, the default) records and replays repeated segments as
/// CUDA graphs; `0` (`off`) launches every kernel as it comes. On an H100 (2026-11-25) decode
/// with graphs: stories260K 1.80x, a small Qwen2-built model 1.58x, the Qwen2.5-1.5B-shaped
/// model 1.03x the rate without (the same logits, bit for bit).
pub const GRAPHS_ENV: &str = "GATESTREAM_CUDA_GRAPHS";

/// Whether [`GRAPHS_ENV`] asks for graphs (`value`: the variable's value).
pub fn graphs_asked(value: Option<&str>) -> Result<bool> {
    super::switch_asked(
        GRAPHS_ENV,
        value,
        "repeated steps replayed as CUDA graphs",
        "each kernel launched as it comes",
    )
}

/// `GATESTREAM_CUDA_GRAPH_SPLIT`: `N` (at least [`MIN_GRAPH_OPS`]) launches a segment's
/// recording every `N` operations — each part a graph of its own once repeated — so the GPU runs
/// the first parts while the host records the rest of the step; `0` records the whole segment
/// before launching it. A part that would end on an integer product of a token or a batch
/// (`matvec_i8*`) takes the next
/// operation too (which may fuse into it: [`super::FUSE_ENV`]). The same kernels on the same
/// buffers either way. Default [`DEFAULT_GRAPH_SPLIT`].
pub const GRAPH_SPLIT_ENV: &str = "GATESTREAM_CUDA_GRAPH_SPLIT";

/// Operations per launched part when [`GRAPH_SPLIT_ENV`] is not set. On an H100 (session 44,
/// Qwen2.5-1.5B-shaped decode, one run): whole steps 426 tok/s, parts of 24 / 48 / 96 / 192
/// operations 487 / 488 / 482 / 466.
pub const DEFAULT_GRAPH_SPLIT: usize = 48;

/// The operations per launched part that [`GRAPH_SPLIT_ENV`] asks for (0: whole segments).
pub fn graph_split_asked(value: Option<&str>) -> Result<usize> {
    match value.map(str::trim) {
        None | Some("") => Ok(DEFAULT_GRAPH_SPLIT),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if n == 0 || n >= MIN_GRAPH_OPS => Ok(n),
            _ => Err(crate::error::Error::Input(format!(
                "{GRAPH_SPLIT_ENV}={v}: expected 0 (a segment recorded whole, then launched) or a number \
                 of operations, at least {MIN_GRAPH_OPS}, after which the recording so far is launched (default {DEFAULT_GRAPH_SPLIT})"
            ))),
        },
    }
}

/// Segments with fewer operations are never captured (a graph would not pay).
pub const MIN_GRAPH_OPS: usize = 8;
/// Graphs kept; past this the cache starts again (a model's steps need a handful, or a few
/// dozen parts with [`GRAPH_SPLIT_ENV`]).
const GRAPHS_KEPT: usize = 256;
/// Signatures remembered while waiting for a repeat.
const SEEN_KEPT: usize = 4096;
/// u32 words of the index arena.
pub const ARENA_WORDS: usize = 1 << 16;

/// One recorded operation of the device's stream.
#[derive(Clone)]
pub(super) enum Op {
    Launch {
        name: &'static str,
        ty: Option<GgmlType>,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: Vec<Arg>,
    },
    /// `bytes` zero bytes at `ptr`.
    Zero { ptr: u64, bytes: usize },
}

impl Op {
    pub fn launch(name: &'static str, ty: Option<GgmlType>, cfg: &LaunchConfig, args: &[Arg]) -> Op {
        Op::Launch {
            name,
            ty,
            grid: cfg.grid_dim,
            block: cfg.block_dim,
            args: args.to_vec(),
        }
    }

    /// Everything that decides what the operation does, as words (f32 parameters by their bits).
    fn words(&self, out: &mut Vec<u64>) {
        match self {
            Op::Launch {
                name,
                ty,
                grid,
                block,
                args,
            } => {
                let mut h = super::FastHasher::default();
                (name, ty).hash(&mut h);
                out.extend([1, h.finish()]);
                out.extend([grid.0, grid.1, grid.2, block.0, block.1, block.2].map(u64::from));
                out.push(args.len() as u64);
                out.extend(args.iter().map(|a| match *a {
                    Arg::U64(v) => v,
                    Arg::I32(v) => (1 << 40) | u64::from(v as u32),
                    Arg::F32(v) => (2 << 40) | u64::from(v.to_bits()),
                }));
            }
            Op::Zero { ptr, bytes } => out.extend([2, *ptr, *bytes as u64]),
        }
    }
}

/// A segment's signature: its operations as words (compared in full) and their hash.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Signature {
    hash: u64,
    words: Vec<u64>,
}

impl Signature {
    pub fn of(ops: &[Op]) -> Signature {
        let mut words = Vec::with_capacity(ops.len() * 16);
        for op in ops {
            op.words(&mut words);
        }
        let mut h = super::FastHasher::default();
        words.hash(&mut h);
        Signature {
            hash: h.finish(),
            words,
        }
    }
}

/// What graphs did (see [`CudaDevice::graph_counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GraphCounters {
    /// Segments launched as a graph already captured.
    pub replays: u64,
    /// Segments captured into a new graph (then launched).
    pub captures: u64,
    /// Recorded segments launched kernel by kernel (first seen, or too short).
    pub direct_segments: u64,
    /// Operations launched inside graphs (replays and captures), and one by one.
    pub graph_ops: u64,
    pub direct_ops: u64,
    /// Segments that left recording part-way (a streamed weight, a staged upload).
    pub left_recording: u64,
}

/// An instantiated graph.
struct Exec(CudaGraph);
// SAFETY: used only under the device's `graphs` lock, so one thread at a time touches it.
unsafe impl Send for Exec {}
// SAFETY: as for `Send`: every use holds the `graphs` lock.
unsafe impl Sync for Exec {}

/// The recording and the graphs of one device.
#[derive(Default)]
pub(super) struct Graphs {
    pub enabled: bool,
    /// The segment's recorded operations, not yet launched.
    ops: Vec<Op>,
    /// Device memory recorded operations may read, released once they are launched.
    keep: Vec<Box<dyn Any + Send + Sync>>,
    /// The rest of the segment launches as it comes.
    pub direct: bool,
    arena: Option<(CudaSlice<u32>, u64)>,
    arena_used: usize,
    /// The segment's index lists in the arena: words -> device address.
    arena_lists: FastMap<Vec<u32>, u64>,
    cache: FastMap<u64, (Signature, Exec)>,
    seen: FastMap<u64, u32>,
    pub counters: GraphCounters,
    /// Operations after which the recording so far is launched (0: never; [`GRAPH_SPLIT_ENV`]).
    pub split: usize,
}

impl Graphs {
    pub fn recording(&self) -> bool {
        self.enabled && !self.direct
    }

    pub fn record(&mut self, op: Op) {
        self.ops.push(op);
    }

    /// Whether the recording is long enough to launch part-way ([`GRAPH_SPLIT_ENV`]).
    pub fn split_due(&self) -> bool {
        self.split > 0 && self.ops.len() >= self.split
    }

    /// The operation recorded last, taken back (not to be launched) when it is a launch that
    /// `read` makes something of (from its kernel, weight type and arguments): what a launch that
    /// does its work and more (a fused one) replaces, and what `read` made of it.
    pub fn take_last_launch<R>(
        &mut self,
        read: impl FnOnce(&'static str, Option<GgmlType>, &[Arg]) -> Option<R>,
    ) -> Option<(Op, R)> {
        let Some(Op::Launch { name, ty, args, .. }) = self.ops.last().filter(|_| self.recording()) else {
            return None;
        };
        let r = read(name, *ty, args)?;
        Some((self.ops.pop()?, r))
    }

    /// Holds `x` until the recorded operations are launched.
    pub fn keep(&mut self, x: Box<dyn Any + Send + Sync>) {
        self.keep.push(x);
    }
}

impl CudaDevice {
    /// Turns graphs on or off for the work from now on (what is recorded is launched first).
    pub fn set_graphs(&self, on: bool) {
        self.end_segment();
        let mut g = self.graphs.lock().expect("graphs");
        g.enabled = on;
        self.pool.hold(on);
    }

    pub fn graphs(&self) -> bool {
        self.graphs.lock().expect("graphs").enabled
    }

    /// Sets the operations after which a recording is launched part-way (0: whole segments;
    /// see [`GRAPH_SPLIT_ENV`]); what is recorded is launched first.
    pub fn set_graph_split(&self, ops: usize) -> Result<()> {
        let ops = graph_split_asked(Some(&ops.to_string()))?;
        self.end_segment();
        self.graphs.lock().expect("graphs").split = ops;
        Ok(())
    }

    pub fn graph_split(&self) -> usize {
        self.graphs.lock().expect("graphs").split
    }

    /// Launches the recording so far (a part of the segment, [`GRAPH_SPLIT_ENV`]); the segment
    /// goes on recording, its index lists where they are in the arena.
    pub(super) fn launch_part(&self, g: std::sync::MutexGuard<'_, Graphs>) {
        self.launch_recorded(g);
    }

    /// What graphs did so far (launches the recorded segment first, so the figures are whole).
    pub fn graph_counters(&self) -> GraphCounters {
        self.end_segment();
        self.graphs.lock().expect("graphs").counters
    }

    /// `v` in the segment's part of the arena (copied there now, before the segment's kernels
    /// run), when graphs are on and it fits; the same list twice in a segment is copied once.
    pub(super) fn arena_indices(&self, v: &[u32]) -> Option<u64> {
        let mut g = self.graphs.lock().expect("graphs");
        if !g.enabled || v.is_empty() {
            return None;
        }
        if let Some(&p) = g.arena_lists.get(v) {
            return Some(p);
        }
        if g.arena_used + v.len() > ARENA_WORDS {
            return None;
        }
        if g.arena.is_none() {
            // SAFETY: every word is written before a kernel reads it (below).
            let s = self.check("allocating the index arena", unsafe {
                self.stream.alloc::<u32>(ARENA_WORDS)
            })?;
            let p = self.raw(&s);
            g.arena = Some((s, p));
        }
        let at = g.arena_used;
        let (slice, base) = g.arena.as_mut().expect("arena");
        let r = self.stream.memcpy_htod(v, &mut slice.slice_mut(at..at + v.len()));
        self.check("copying indices to the GPU", r)?;
        let p = *base + 4 * at as u64;
        // 16-byte steps, so every list starts aligned like an allocation's start.
        g.arena_used += v.len().next_multiple_of(4);
        g.arena_lists.insert(v.to_vec(), p);
        Some(p)
    }

    /// Launches what is recorded and makes the rest of the segment direct: before work whose
    /// memory the recording cannot track (a streamed weight, a staged upload, page-locking).
    pub(super) fn leave_recording(&self) {
        self.flush(false);
    }

    /// The end of a segment (the host is about to need the device's results): launches what
    /// is recorded, the next segment records afresh.
    pub(super) fn end_segment(&self) {
        self.flush(true);
    }

    fn flush(&self, end: bool) {
        let mut g = self.graphs.lock().expect("graphs");
        if !g.enabled {
            return;
        }
        if end {
            g.direct = false;
            g.arena_used = 0;
            g.arena_lists.clear();
        } else if !g.direct {
            g.direct = true;
            g.counters.left_recording += 1;
        }
        self.launch_recorded(g);
    }

    /// Launches the recorded operations and lets go of what they needed kept; if the driver
    /// would not capture them (graphs then off), the pool stops holding freed buffers.
    fn launch_recorded(&self, mut g: std::sync::MutexGuard<'_, Graphs>) {
        let ops = std::mem::take(&mut g.ops);
        let keep = std::mem::take(&mut g.keep);
        if !ops.is_empty() && !self.failed() {
            self.launch_segment(&mut g, ops);
        }
        let still_on = g.enabled;
        drop(g);
        // Stream-ordered after the launches above.
        drop(keep);
        self.pool.release_held();
        if !still_on {
            self.pool.hold(false);
        }
    }

    fn launch_segment(&self, g: &mut Graphs, ops: Vec<Op>) {
        let sig = Signature::of(&ops);
        if let Some((s, exec)) = g.cache.get(&sig.hash) {
            if *s == sig {
                let r = exec.0.launch();
                if self.check("launching a CUDA graph", r).is_some() {
                    g.counters.replays += 1;
                    g.counters.graph_ops += ops.len() as u64;
                }
                return;
            }
        }
        if g.seen.len() >= SEEN_KEPT {
            g.seen.clear();
        }
        let n = g.seen.entry(sig.hash).or_insert(0);
        *n += 1;
        if *n < 2 || ops.len() < MIN_GRAPH_OPS {
            for op in &ops {
                self.run_op(op);
            }
            g.counters.direct_segments += 1;
            g.counters.direct_ops += ops.len() as u64;
            return;
        }
        let exec = match self.capture(&ops) {
            Ok(exec) => exec,
            Err(msg) => {
                // The driver would not capture: the rest of the run launches kernel by kernel.
                eprintln!("note: CUDA graphs are off for the rest of this run: {msg}");
                g.enabled = false;
                g.cache.clear();
                for op in &ops {
                    self.run_op(op);
                }
                g.counters.direct_segments += 1;
                g.counters.direct_ops += ops.len() as u64;
                return;
            }
        };
        if self.check("launching a CUDA graph", exec.0.launch()).is_none() {
            return;
        }
        g.counters.captures += 1;
        g.counters.graph_ops += ops.len() as u64;
        if g.cache.len() >= GRAPHS_KEPT {
            // An executable graph destroyed while it runs is freed when it completes.
            g.cache.clear();
        }
        g.cache.insert(sig.hash, (sig, exec));
    }

    /// The operations captured into an instantiated graph; none of them has run when this
    /// returns an error (what the driver said).
    fn capture(&self, ops: &[Op]) -> std::result::Result<Exec, String> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.stream
            .begin_capture(mode)
            .map_err(|e| format!("starting a capture: {e}"))?;
        for op in ops {
            self.run_op(op);
        }
        match self.stream.end_capture(sys::CUgraphInstantiate_flags(0)) {
            Ok(Some(g)) => Ok(Exec(g)),
            Ok(None) => Err("the capture ended with no graph".into()),
            Err(e) => Err(format!("capturing or instantiating: {e}")),
        }
    }

    fn run_op(&self, op: &Op) {
        match op {
            Op::Launch {
                name,
                ty,
                grid,
                block,
                args,
            } => {
                let cfg = LaunchConfig {
                    grid_dim: *grid,
                    block_dim: *block,
                    shared_mem_bytes: 0,
                };
                self.launch_now(name, *ty, cfg, args);
            }
            Op::Zero { ptr, bytes } => {
                // SAFETY: `ptr` is a live device buffer of at least `bytes` (held until launch).
                let r = unsafe { cudarc::driver::result::memset_d8_async(*ptr, 0, *bytes, self.stream.cu_stream()) };
                self.check("zeroing device memory", r);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graphs_are_on_unless_turned_off() {
        assert!(graphs_asked(None).unwrap());
        for off in ["0", "off", " off "] {
            assert!(!graphs_asked(Some(off)).unwrap(), "{off:?}");
        }
        for on in ["", "1", "on"] {
            assert!(graphs_asked(Some(on)).unwrap(), "{on:?}");
        }
        let e = graphs_asked(Some("yes")).unwrap_err().to_string();
        assert!(
            e.contains("GATESTREAM_CUDA_GRAPHS=yes") && e.contains("expected 1") && e.contains("or 0"),
            "{e}"
        );
    }

    #[test]
    fn a_split_is_off_or_at_least_the_smallest_graph() {
        assert_eq!(graph_split_asked(None).unwrap(), DEFAULT_GRAPH_SPLIT);
        assert_eq!(graph_split_asked(Some("")).unwrap(), DEFAULT_GRAPH_SPLIT);
        assert_eq!(graph_split_asked(Some(" 0")).unwrap(), 0);
        assert_eq!(graph_split_asked(Some("64")).unwrap(), 64);
        assert_eq!(
            graph_split_asked(Some(&MIN_GRAPH_OPS.to_string())).unwrap(),
            MIN_GRAPH_OPS
        );
        for bad in ["7", "-1", "many"] {
            let e = graph_split_asked(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(&format!("GATESTREAM_CUDA_GRAPH_SPLIT={bad}")) && e.contains("at least 8"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_signature_covers_every_parameter() {
        let cfg = LaunchConfig {
            grid_dim: (4, 1, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        let norm = |name: &'static str, ty: Option<GgmlType>, x: Arg, w: Arg, eps: Arg| {
            Op::launch(name, ty, &cfg, &[x, w, eps])
        };
        let (x, w, eps) = (Arg::U64(4096), Arg::I32(1536), Arg::F32(1e-6));
        let base = || vec![norm("rms_norm", None, x, w, eps), Op::Zero { ptr: 8192, bytes: 64 }];
        let s = Signature::of(&base());
        assert!(s == Signature::of(&base()));
        let mut changed: Vec<Vec<Op>> = vec![
            vec![norm("add", None, x, w, eps), base()[1].clone()],
            vec![norm("rms_norm", Some(GgmlType::F32), x, w, eps), base()[1].clone()],
            vec![norm("rms_norm", None, Arg::U64(4100), w, eps), base()[1].clone()],
            vec![norm("rms_norm", None, x, Arg::I32(1537), eps), base()[1].clone()],
            vec![norm("rms_norm", None, x, w, Arg::F32(1e-5)), base()[1].clone()],
            // The same bits as another kind of parameter.
            vec![
                norm("rms_norm", None, x, w, Arg::U64(1e-6f32.to_bits() as u64)),
                base()[1].clone(),
            ],
            vec![base()[0].clone(), Op::Zero { ptr: 8192, bytes: 68 }],
            vec![base()[1].clone(), base()[0].clone()],
        ];
        let mut grid = base();
        if let Op::Launch { grid: g, .. } = &mut grid[0] {
            g.0 = 5;
        }
        changed.push(grid);
        let mut block = base();
        if let Op::Launch { block: b, .. } = &mut block[0] {
            b.1 = 4;
        }
        changed.push(block);
        for (i, c) in changed.iter().enumerate() {
            assert!(s != Signature::of(c), "variant {i} has the same signature");
        }
    }
}
