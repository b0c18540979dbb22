//! The CUDA device (feature `cuda`): the layer program's operations as kernels (`kernels/*.cu`,
//! compiled by NVRTC when the device opens), activations and the KV cache in device memory.
//! Weights are copied to the GPU the first time a product uses them and kept there, keyed by the
//! address of their bytes (the cache holds a handle on those bytes, so the address cannot be
//! reused while cached); norms and biases likewise, checked against a host copy on every use.
//! The driver is loaded at run time: on a machine without one, `open` returns an error naming
//! what is missing — cudarc would panic, so everything it needs is checked first.
//!
//! Errors inside an operation (the `Device` methods return no `Result`) are recorded; every
//! later launch is skipped, and the pass returns the first one through [`Device::take_error`].
//!
//! With [`GRAPHS_ENV`] on, launches are recorded up to the point where the host needs results,
//! and a recording seen before is replayed as one CUDA graph (see `graph`).

mod graph;
pub mod nvrtc;
mod upload;
pub use upload::{map_host_asked, MAP_HOST_ENV};

pub use graph::{graph_split_asked, graphs_asked, GraphCounters, GRAPHS_ENV, GRAPH_SPLIT_ENV};

use std::any::Any;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use super::{Act, ActData, AttnShape, Device, RopeShape, TopRows};
use crate::config::{FfnActivation, RopeStyle};
use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::quant::{ActivationFormat, GgmlType};
use crate::tensor::Weight;

/// Environment variable naming the driver library (`libcuda.so.1`) when it is not on the
/// loader's path.
pub const LIBCUDA_ENV: &str = "GATESTREAM_LIBCUDA";

/// Threads per block of the elementwise kernels.
const ELEMENTWISE_THREADS: u32 = 256;
/// Warps per block of the matmul kernels (one output row each).
const MATMUL_WARPS: u32 = 8;
/// Tokens per matmul block (`MM_TOKENS` in kernels/quant.cu).
const MATMUL_TOKENS: usize = 8;
/// Threads per block of attention and of the partial sums of `accumulate_rows`.
const ATTENTION_THREADS: u32 = 128;
const ACCUMULATE_THREADS: u32 = 64;
/// Threads of the block that finds one row's argmax (a vocabulary of ~150k logits: ~150 each).
const ARGMAX_THREADS: u32 = 1024;
/// Threads of the block that finds one row's top-k (`TOPK_MAX` in kernels/ops.cu: one a
/// candidate when they are ranked).
const TOP_K_THREADS: u32 = super::TOP_K_MAX as u32;
/// The largest head the attention kernel's shared query holds (`ATTN_MAX_HEAD_DIM`).
const ATTN_MAX_HEAD_DIM: usize = 512;
/// Bytes of freed activation buffers kept for reuse.
const POOL_BYTES_MAX: usize = 1 << 30;

/// The kernel name suffix of a weight type.
pub fn type_suffix(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
    }
}

/// The per-type kernel families (`{family}_{type}` in kernels/quant.cu).
const TYPED: [&str; 6] = ["matmul", "matvec", "matvec2", "matvec4", "embed", "accumulate"];
/// The kernels that are not per type.
const OPS: [&str; 22] = [
    "accumulate_reduce",
    "argmax_rows",
    "top_k_rows",
    "activate_mul",
    "activate_mul_q8_k",
    "add_rms_norm",
    "act_q8_32",
    "act_q8_k",
    "act_q8_k_blocks",
    "rms_norm",
    "add",
    "mul",
    "add_bias",
    "activate",
    "softcap",
    "select_rows",
    "scatter_cols",
    "gather_cols",
    "rope_norm",
    "rope_norm_kv",
    "kv_write",
    "attention",
];

/// A kernel: a name, and the weight type for the per-type families (looked up per launch
/// without building its name).
type KernelKey = (&'static str, Option<GgmlType>);

/// Every kernel the device launches, with its name in the module.
fn kernel_keys() -> Vec<(KernelKey, String)> {
    let typed = GgmlType::ALL
        .iter()
        .flat_map(|&ty| TYPED.map(|k| ((k, Some(ty)), format!("{k}_{}", type_suffix(ty)))));
    let int8 = INT8_TYPES.iter().flat_map(|&ty| {
        ["matvec_i8", "matvec_i8x3", "matvec_i8f"].map(|k| ((k, Some(ty)), format!("{k}_{}", type_suffix(ty))))
    });
    typed
        .chain(int8)
        .chain(OPS.iter().map(|&k| ((k, None), k.to_string())))
        .collect()
}

/// Every kernel's name in the module.
pub fn kernel_names() -> Vec<String> {
    kernel_keys().into_iter().map(|(_, n)| n).collect()
}

/// One thread per element of a row of `width`, one row of blocks per row.
fn rows_cfg(width: usize, rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((width as u32).div_ceil(ELEMENTWISE_THREADS).max(1), rows as u32, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One thread per element.
pub fn elementwise_cfg(len: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((len as u32).div_ceil(ELEMENTWISE_THREADS).max(1), 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per output row, `MATMUL_TOKENS` tokens per block row.
pub fn matmul_cfg(rows_out: usize, n: usize) -> LaunchConfig {
    let mut c = matvec_cfg(rows_out, 1);
    c.grid_dim.1 = n.div_ceil(MATMUL_TOKENS).max(1) as u32;
    c
}

/// One-token products with `rows_per_warp` rows per warp (`matvec`, `matvec2`, `matvec4`).
pub fn matvec_cfg(rows_out: usize, rows_per_warp: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            (rows_out as u32).div_ceil(MATMUL_WARPS * rows_per_warp as u32).max(1),
            1,
            1,
        ),
        block_dim: (32, MATMUL_WARPS, 1),
        shared_mem_bytes: 0,
    }
}

/// Warps per row of the integer one-token products (`matvec_i8_*`) for rows of `cols` values:
/// one while a warp's 4 groups of 8 lanes cover the row's super-blocks in at most two passes,
/// then 2, 4 or 8 (a wide row, such as an FFN's down row, shared by a block's warps so that
/// enough of them read at once: 1536 rows of 8960 make only 1536 warps otherwise).
pub fn i8_warps_per_row(cols: usize) -> usize {
    let super_blocks = cols / 256;
    let mut w = 1;
    while w < MATMUL_WARPS as usize && 8 * w <= super_blocks {
        w *= 2;
    }
    w
}

/// Launch geometry of the integer products: blocks of `MATMUL_WARPS` warps, each row taking
/// `wpr` of them; the blocks each of up to three weights' `rows` need, in order.
pub fn i8_blocks(rows: &[usize], wpr: usize) -> Vec<u32> {
    let rows_per_block = MATMUL_WARPS as usize / wpr;
    rows.iter().map(|r| r.div_ceil(rows_per_block) as u32).collect()
}

/// Threads of a norm's block (`rms_norm`, `add_rms_norm`: one block per row): enough for each
/// to hold `NORM_PER_THREAD` (4) values of the row in registers, whole warps, at most 1024.
pub fn norm_threads(width: usize) -> u32 {
    (width.div_ceil(4).next_multiple_of(32)).clamp(32, 1024) as u32
}

/// A norm's launch: one block of [`norm_threads`] per row.
fn norm_cfg(rows: usize, width: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (norm_threads(width), 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Partitions of the rows in `accumulate_rows` (each summed in order by one thread per column
/// unit, then the partitions added in order): enough to fill the GPU, at least 64 rows each.
pub fn accumulate_parts(n_rows: usize) -> usize {
    n_rows.div_ceil(64).clamp(1, 64)
}

/// One warp per activation block (the 8-bit activation kernels): `blocks` warps in blocks of
/// `ELEMENTWISE_THREADS` threads.
pub fn warp_per_block_cfg(blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((blocks as u32).div_ceil(ELEMENTWISE_THREADS / 32), 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The length of a token's score row in attention for `positions` cached positions: the next
/// power of two, at least 256 (the kernel takes it as a stride only).
pub fn attention_row(positions: usize) -> usize {
    positions.next_power_of_two().max(256)
}

/// Threads of a RoPE block: one per rotated pair, whole warps (the optional norm reduces over
/// the block).
pub fn rope_threads(head_dim: usize) -> u32 {
    ((head_dim / 2).div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// Freed activation buffers by length, reused by the next allocation of that length (a decode
/// step allocates the same few dozen shapes every layer).
#[derive(Default)]
struct Pool {
    free: Mutex<FreeLists>,
    /// While graphs are on, buffers the free lists cannot take wait here for the recorded
    /// launches that may read them (see `graph`), instead of being freed at once.
    held: Mutex<Option<Vec<CudaSlice<f32>>>>,
}

impl Pool {
    fn hold(&self, on: bool) {
        let mut h = self.held.lock().expect("pool");
        match (on, h.is_some()) {
            (true, false) => *h = Some(Vec::new()),
            (false, true) => *h = None,
            _ => {}
        }
    }

    /// Frees the held buffers (in stream order, after the launches that read them).
    fn release_held(&self) {
        if let Some(h) = self.held.lock().expect("pool").as_mut() {
            h.clear();
        }
    }
}

/// A fast hash for the device's own maps, whose keys come from this process (addresses,
/// lengths, index lists, the words of a graph's signature; nothing adversarial): a rotate, xor
/// and multiply per 8 bytes (as rustc's FxHash), against SipHash's rounds — a decode step looks
/// up weights, vectors and kernels hundreds of times and hashes its whole signature once.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher(u64);

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl std::hash::Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }
    fn write_u8(&mut self, v: u8) {
        self.add(u64::from(v));
    }
    fn write_u32(&mut self, v: u32) {
        self.add(u64::from(v));
    }
    fn write_u64(&mut self, v: u64) {
        self.add(v);
    }
    fn write_usize(&mut self, v: usize) {
        self.add(v as u64);
    }
}

/// A map hashed with [`FastHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<FastHasher>>;

/// Free buffers by length, and their bytes in all.
type FreeLists = (FastMap<usize, Vec<CudaSlice<f32>>>, usize);
/// Host vectors (norms, biases) on the device, by host address and length: the contents copied
/// (to notice a change), the device slice and its address.
type VectorCache = FastMap<(usize, usize), (Vec<f32>, CudaSlice<f32>, u64)>;
/// Index lists uploaded once: the device slice and its address.
type IndexCache = FastMap<Vec<u32>, (CudaSlice<u32>, u64)>;

/// An activation's device buffer; dropping it returns the memory to the pool. Work already
/// queued on the device's one stream that reads it runs before any later reuse.
pub(crate) struct DevBuf {
    slice: Option<CudaSlice<f32>>,
    ptr: u64,
    pool: Arc<Pool>,
    /// The integer products' Q8_K blocks of this buffer's values, written by the kernel that
    /// wrote them (see [`FUSE_ENV`]), for the activation's shape `(rows, width)` then; dropped
    /// by anything that writes the buffer again ([`CudaDevice::buf_mut`]).
    blocks: Option<((usize, usize), Box<DevBuf>)>,
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            let mut free = self.pool.free.lock().expect("pool");
            let bytes = s.len() * 4;
            if free.1 + bytes <= POOL_BYTES_MAX {
                free.1 += bytes;
                free.0.entry(s.len()).or_default().push(s);
            } else if let Some(held) = self.pool.held.lock().expect("pool").as_mut() {
                held.push(s);
            }
        }
    }
}

/// A weight's bytes on the device; `_keep` holds the host bytes so their address (the key)
/// stays theirs while cached.
struct DevWeight {
    _buf: CudaSlice<u8>,
    ptr: u64,
    _keep: Arc<dyn Any + Send + Sync>,
}

/// A weight's device address for one launch; a streamed (volatile) weight's copy lives as long as
/// this does, so keep it until the kernel that reads it is launched.
struct OnDevice {
    ptr: u64,
    _transient: Option<CudaSlice<u8>>,
    /// A staged buffer (its device twin is `ptr`'s), returned to the pool after the launch.
    _staged: Option<Arc<dyn Any + Send + Sync>>,
}

/// A sequence's keys and values on the device: `[layer][capacity][kv_dim]` each.
struct DevKv {
    _k: CudaSlice<f32>,
    _v: CudaSlice<f32>,
    k: u64,
    v: u64,
    shape: (usize, usize, usize),
    device: usize,
}

pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: FastMap<KernelKey, CudaFunction>,
    label: String,
    weights: Mutex<FastMap<(usize, usize, usize), DevWeight>>,
    vectors: Mutex<VectorCache>,
    /// Index lists in use, and those the last flush retired (see [`CudaDevice::indices`]).
    indices: Mutex<(IndexCache, IndexCache)>,
    pool: Arc<Pool>,
    error: Arc<Mutex<Option<String>>>,
    /// Page-locked staging buffers and the copy stream (see `upload`).
    uploads: Arc<upload::Uploads>,
    /// Host ranges page-locked for the stream (`HostLink::pin_host`, `map_host`).
    pinned: upload::PinnedRanges,
    /// Whether `map_host` maps (see [`upload::MAP_HOST_ENV`]).
    map_host: std::sync::atomic::AtomicBool,
    /// Which KV buffers are this device's (several devices may live in one process).
    id: usize,
    /// What quantized products multiply (see [`ACTIVATIONS_ENV`]): an [`Activations`] as u8.
    activations: std::sync::atomic::AtomicU8,
    /// Rows per warp of one-token products (see [`MATVEC_ROWS_ENV`]).
    matvec_rows: std::sync::atomic::AtomicUsize,
    /// Weight copies from the host (see [`HostLink::link`]).
    link: Arc<Mutex<super::LinkCounters>>,
    /// Recorded launches and CUDA graphs (see [`GRAPHS_ENV`]).
    graphs: Mutex<graph::Graphs>,
    /// Whether launches that follow each other are fused (see [`FUSE_ENV`]).
    fuse: std::sync::atomic::AtomicBool,
    /// Whether an integer product has been launched (before one, no blocks are made ahead).
    int8_seen: std::sync::atomic::AtomicBool,
    /// Whether a kernel has been launched since the last copy to the host (which then waits
    /// for it: `LinkCounters::host_waits`).
    launched: std::sync::atomic::AtomicBool,
}

/// `GATESTREAM_CUDA_FUSE`: `1` (or `on`, the default) fuses launches of a decode step that
/// follow each other: RMSNorm (with or without the residual add before it) and the gated
/// activation write, beside their f32 output, the Q8_K blocks the integer products
/// (`GATESTREAM_CUDA_ACTIVATIONS` auto or int8) take as input, so one-token products of Q4_K and
/// Q6_K rows after them need no quantization launch of their own; RoPE writes the keys and
/// values into the KV cache; a lone integer product whose input has no blocks (attention's
/// output) quantizes that input itself, in each thread block's shared memory (five launches fewer
/// a layer on Qwen2.5). The same bytes as the launches they replace. `0` (`off`): each in a
/// launch of its own. Blocks are made only for one-token rows of a multiple of 256 values, once
/// an integer product has run.
pub const FUSE_ENV: &str = "GATESTREAM_CUDA_FUSE";

/// Whether [`FUSE_ENV`] asks for fused launches (`value`: the variable's value).
pub fn fuse_asked(value: Option<&str>) -> Result<bool> {
    switch_asked(
        FUSE_ENV,
        value,
        "norms and activations write the integer products' input blocks, RoPE the KV cache",
        "each in a launch of its own",
    )
}

/// `GATESTREAM_CUDA_ACTIVATIONS`: what the GPU's quantized products multiply. `auto` (the
/// default): Q4_K and Q6_K weights as `int8`, the other types as `f32` — the fastest on an H100
/// (Qwen2.5-1.5B-shaped decode, 2026-11-25: 354 tok/s with `int8` against 206 with `f32` and 194
/// with `q8`). `f32` multiplies quantized weights with the f32 activations; `q8` first
/// replaces the activations by the 8-bit blocks the CPU's products use (blocks of 32 for
/// Q4_0/Q4_1/Q5_0/Q8_0 weights, Q8_K blocks of 256 for K-quants), so the GPU computes what the
/// CPU path (and llama.cpp) computes, to rounding; `int8` also multiplies them as integers
/// (`dp4a`, llama.cpp's approach) in one-token products of Q4_K and Q6_K rows, the rest as `q8`.
pub const ACTIVATIONS_ENV: &str = "GATESTREAM_CUDA_ACTIVATIONS";

/// What the GPU's quantized products multiply the weights with (see [`ACTIVATIONS_ENV`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// The f32 activations, weights decoded to f32 (dequantize-and-FMA).
    F32,
    /// The CPU's 8-bit activation blocks, decoded to f32.
    Q8,
    /// The CPU's 8-bit blocks multiplied as integers where a kernel does (one-token products of
    /// Q4_K and Q6_K rows), as [`Activations::Q8`] elsewhere.
    Int8,
    /// The default: weights of the types with integer products (Q4_K, Q6_K) as
    /// [`Activations::Int8`] (integers for one token, the CPU's 8-bit blocks for a batch, as the
    /// CPU computes them), the other types as [`Activations::F32`].
    Auto,
}

/// The weight types with integer one-token products (`matvec_i8_*`).
pub const INT8_TYPES: [GgmlType; 2] = [GgmlType::Q4_K, GgmlType::Q6_K];
/// Bytes of one Q8_K activation block for the integer products (`Q8K_BLOCK_BYTES`).
const Q8K_BLOCK_BYTES: usize = 292;
/// The widest input (in blocks of 256) `matvec_i8f_*` quantizes itself (`I8F_MAX_BLOCKS`).
const I8F_MAX_BLOCKS: usize = 48;

/// A one-token integer product's input: Q8_K blocks, or the values, which the product's own
/// blocks quantize (`matvec_i8f_*`).
#[derive(Clone, Copy)]
enum Int8Input {
    Blocks(u64),
    Values(u64),
}

/// An on/off variable (`name`, its value `value`): `1` or `on` (or unset, or empty: the default)
/// is on, `0` or `off` off; anything else is refused, saying what each means.
pub(crate) fn switch_asked(name: &str, value: Option<&str>, on: &str, off: &str) -> Result<bool> {
    match value.map(str::trim) {
        Some("0") | Some("off") => Ok(false),
        None | Some("") | Some("1") | Some("on") => Ok(true),
        Some(other) => Err(Error::Invalid(format!(
            "{name}={other}: expected 1 or on (the default: {on}), or 0 or off ({off})"
        ))),
    }
}

/// What [`ACTIVATIONS_ENV`] asks for (`value`: the variable's value).
pub fn activations_asked(value: Option<&str>) -> Result<Activations> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Ok(Activations::Auto),
        Some("f32") => Ok(Activations::F32),
        Some("q8") => Ok(Activations::Q8),
        Some("int8") => Ok(Activations::Int8),
        Some(other) => Err(Error::Invalid(format!(
            "{ACTIVATIONS_ENV}={other}: expected auto (the default: int8 for Q4_K and Q6_K weights, f32 for the \
             others), f32 (f32 activations), q8 (the CPU's 8-bit activation blocks) or int8 (those blocks in \
             integer products where a kernel does)"
        ))),
    }
}

/// `GATESTREAM_CUDA_MATVEC_ROWS`: rows per warp of one-token (decode) products — 1 (the default:
/// `matvec`, one warp per row), 2 or 4 (`matvec2`/`matvec4`: each lane loads a unit of the input
/// once for that many rows), for the f32-activation products. The same sums in the same order;
/// slower on an H100 (Qwen2.5-1.5B-shaped decode, f32: 213.7 tok/s with 1, 196.7 with 2, 169.5
/// with 4).
pub const MATVEC_ROWS_ENV: &str = "GATESTREAM_CUDA_MATVEC_ROWS";

/// The rows per warp [`MATVEC_ROWS_ENV`] asks for (`value`: the variable's value).
pub fn matvec_rows_asked(value: Option<&str>) -> Result<usize> {
    match value.map(str::trim) {
        None | Some("") => Ok(1),
        Some(v) => match v.parse::<usize>() {
            Ok(n @ (1 | 2 | 4)) => Ok(n),
            _ => Err(Error::Invalid(format!(
                "{MATVEC_ROWS_ENV}={v}: expected 1 (the default), 2 or 4 rows per warp of one-token products"
            ))),
        },
    }
}

fn driver_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Invalid(format!("CUDA: {what}: {e}"))
}

/// Makes the driver library loadable by its standard name: `GATESTREAM_LIBCUDA` is loaded first
/// (the loader then finds it by its soname), and its absence is reported before cudarc could
/// panic on it.
fn ensure_driver() -> Result<()> {
    use std::sync::OnceLock;
    static PRELOADED: OnceLock<std::result::Result<Option<libloading::Library>, String>> = OnceLock::new();
    let pre = PRELOADED.get_or_init(|| match std::env::var(LIBCUDA_ENV) {
        Ok(p) if !p.is_empty() => {
            // SAFETY: loading the driver runs its initializers, which have no preconditions.
            unsafe { libloading::Library::new(&p) }
                .map(Some)
                .map_err(|e| format!("CUDA: {LIBCUDA_ENV}={p} could not be loaded: {e}"))
        }
        _ => Ok(None),
    });
    if let Err(e) = pre {
        return Err(Error::Invalid(e.clone()));
    }
    // SAFETY: only tries to load the library by its standard names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Invalid(format!(
            "CUDA: the NVIDIA driver library (libcuda.so.1) was not found on the library path; this machine has \
             no NVIDIA driver. Install one, or set {LIBCUDA_ENV}=/path/to/libcuda.so.1 (use --device cpu to run on the CPU)"
        )));
    }
    Ok(())
}

/// The driver's CUDA version, `(major, minor)`.
fn driver_version() -> Result<(i32, i32)> {
    let mut v = 0;
    // SAFETY: the driver library is present (checked by `ensure_driver`); the call writes one int.
    let r = unsafe { sys::cuDriverGetVersion(&mut v) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Invalid(format!("CUDA: cuDriverGetVersion failed: {r:?}")));
    }
    Ok((v / 1000, (v % 1000) / 10))
}

impl CudaDevice {
    /// A block of `threads` a row of `x` running `kernel` (`argmax_rows`, `top_k_rows`), whose
    /// arguments are the rows, their width, the `banned` ids and their count, `extra`, then an
    /// output of `out_width` words a row, which is returned.
    fn pick_rows(
        &self,
        kernel: &'static str,
        threads: u32,
        x: &Act,
        banned: &[u32],
        extra: &[Arg],
        out_width: usize,
    ) -> Act {
        let out = self.act(x.rows, out_width);
        let idx = self.indices(banned);
        let cfg = LaunchConfig {
            grid_dim: (x.rows as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = vec![ptr(self.buf(x)), int(x.width), ptr(idx), int(banned.len())];
        args.extend_from_slice(extra);
        args.push(ptr(self.buf(&out)));
        self.launch(kernel, None, cfg, &args);
        out
    }

    /// GPU `ordinal`: the driver, a device, NVRTC no newer than the driver, the kernels compiled
    /// for the device (or read from the cache) and loaded.
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        let activations = activations_asked(std::env::var(ACTIVATIONS_ENV).ok().as_deref())?;
        let matvec_rows = matvec_rows_asked(std::env::var(MATVEC_ROWS_ENV).ok().as_deref())?;
        let graphs = graphs_asked(std::env::var(GRAPHS_ENV).ok().as_deref())?;
        let graph_split = graph_split_asked(std::env::var(GRAPH_SPLIT_ENV).ok().as_deref())?;
        let map_host = upload::map_host_asked(std::env::var(upload::MAP_HOST_ENV).ok().as_deref())?;
        let fuse = fuse_asked(std::env::var(FUSE_ENV).ok().as_deref())?;
        ensure_driver()?;
        let count = CudaContext::device_count().map_err(|e| {
            Error::Invalid(format!(
                "CUDA: the driver did not start ({e}); is the NVIDIA kernel module loaded (nvidia-smi)?"
            ))
        })?;
        if count <= 0 {
            return Err(Error::Invalid(
                "CUDA: the driver found no GPU (use --device cpu to run on the CPU)".into(),
            ));
        }
        if ordinal >= count as usize {
            return Err(Error::Invalid(format!(
                "CUDA: GPU {ordinal} asked for, the driver found {count}"
            )));
        }
        let driver = driver_version()?;
        let nvrtc = nvrtc::Nvrtc::load()?;
        if nvrtc.version > driver {
            return Err(Error::Invalid(format!(
                "CUDA: NVRTC {}.{} ({}) is newer than the driver, which supports CUDA {}.{}; its code would not load. \
                 Point {} at an NVRTC no newer than {}.{}, or update the driver",
                nvrtc.version.0,
                nvrtc.version.1,
                nvrtc.path,
                driver.0,
                driver.1,
                nvrtc::NVRTC_ENV,
                driver.0,
                driver.1
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("creating a context"))?;
        let (major, minor) = ctx.compute_capability().map_err(driver_err("compute capability"))?;
        let arch = (major * 10 + minor) as u32;
        let (cubin, cached) = nvrtc::compiled_module(&nvrtc, arch, true)?;
        let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)) {
            Ok(m) => m,
            // A damaged cache entry: compile again (the new module replaces it).
            Err(_) if cached => {
                let (cubin, _) = nvrtc::compiled_module(&nvrtc, arch, false)?;
                ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                    .map_err(driver_err("loading the kernels"))?
            }
            Err(e) => return Err(driver_err("loading the kernels")(e)),
        };
        let mut kernels = FastMap::default();
        for (key, name) in kernel_keys() {
            let f = module
                .load_function(&name)
                .map_err(driver_err(&format!("kernel {name}")))?;
            kernels.insert(key, f);
        }
        let stream = ctx.new_stream().map_err(driver_err("creating a stream"))?;
        // SAFETY: every operation of this device runs on its one stream, which orders them; the
        // per-buffer events cudarc would record for several streams are not needed.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().unwrap_or_else(|_| "GPU".into());
        let mem = ctx.total_mem().unwrap_or(0) as f64 / (1u64 << 30) as f64;
        static NEXT_ID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (error, link) = (
            Arc::new(Mutex::new(None)),
            Arc::new(Mutex::new(super::LinkCounters::default())),
        );
        let uploads = upload::Uploads::new(ctx.clone(), stream.clone(), link.clone(), error.clone(), id)
            .map_err(driver_err("creating the copy stream"))?;
        let dev = CudaDevice {
            label: format!(
                "cuda {ordinal}: {name} (sm_{arch}, {mem:.0} GiB, driver CUDA {}.{}, NVRTC {}.{}{})",
                driver.0,
                driver.1,
                nvrtc.version.0,
                nvrtc.version.1,
                if cached { ", cached kernels" } else { "" }
            ),
            ctx,
            stream,
            kernels,
            weights: Mutex::new(FastMap::default()),
            vectors: Mutex::new(FastMap::default()),
            indices: Mutex::new((FastMap::default(), FastMap::default())),
            pool: Arc::new(Pool::default()),
            error,
            uploads: Arc::new(uploads),
            pinned: Arc::new(Mutex::new(Vec::new())),
            map_host: std::sync::atomic::AtomicBool::new(map_host),
            id,
            activations: std::sync::atomic::AtomicU8::new(activations as u8),
            matvec_rows: std::sync::atomic::AtomicUsize::new(matvec_rows),
            link,
            graphs: Mutex::new(graph::Graphs::default()),
            fuse: std::sync::atomic::AtomicBool::new(fuse),
            int8_seen: std::sync::atomic::AtomicBool::new(false),
            launched: std::sync::atomic::AtomicBool::new(false),
        };
        dev.set_graphs(graphs);
        dev.set_graph_split(graph_split)?;
        Ok(dev)
    }

    /// Whether `map_host` maps host memory from now on (see [`upload::MAP_HOST_ENV`]); ranges
    /// already mapped stay so.
    pub fn set_map_host(&self, on: bool) {
        self.map_host.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn map_host(&self) -> bool {
        self.map_host.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets what products launched from now on multiply (see [`ACTIVATIONS_ENV`]).
    pub fn set_activations(&self, a: Activations) {
        self.activations.store(a as u8, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn activations(&self) -> Activations {
        match self.activations.load(std::sync::atomic::Ordering::Relaxed) {
            0 => Activations::F32,
            1 => Activations::Q8,
            2 => Activations::Int8,
            _ => Activations::Auto,
        }
    }

    /// Whether a product of `w` with `x` runs as integers (`matvec_i8_*`).
    fn int8_product(&self, w: &Weight, x: &Act) -> bool {
        let yes = matches!(self.activations(), Activations::Int8 | Activations::Auto)
            && x.rows == 1
            && x.width == w.cols
            && INT8_TYPES.contains(&w.ty)
            && w.cols.is_multiple_of(256);
        if yes {
            self.int8_seen.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        yes
    }

    /// `x` (one token) as the integer products' input: the Q8_K blocks (`Q8K_BLOCK_BYTES` per
    /// 256 values) the kernel that wrote `x` made (see [`FUSE_ENV`]), else a buffer of them made
    /// now (returned with it, to keep until the product is launched) — or, for one product
    /// (`one`) with launches fused, the values, which that product quantizes itself.
    fn int8_input(&self, x: &Act, one: bool) -> (Int8Input, Option<Act>) {
        if let ActData::Cuda(DevBuf {
            blocks: Some((shape, b)),
            ..
        }) = &x.data
        {
            if *shape == (x.rows, x.width) {
                return (Int8Input::Blocks(b.ptr), None);
            }
        }
        let blocks = x.width / 256;
        if one && self.fuse() && x.rows == 1 && blocks <= I8F_MAX_BLOCKS {
            return (Int8Input::Values(self.buf(x)), None);
        }
        let out = self.act(1, blocks * Q8K_BLOCK_BYTES / 4);
        if blocks > 0 {
            let cfg = warp_per_block_cfg(blocks);
            self.launch(
                "act_q8_k_blocks",
                None,
                cfg,
                &[ptr(self.buf(x)), ptr(self.buf(&out)), ptr(blocks as u64)],
            );
        }
        (Int8Input::Blocks(self.buf(&out)), Some(out))
    }

    /// Sets whether the launches from now on are fused (see [`FUSE_ENV`]).
    pub fn set_fuse(&self, on: bool) {
        self.fuse.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn fuse(&self) -> bool {
        self.fuse.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether `a` carries the integer products' input blocks of its values (see [`FUSE_ENV`]).
    pub fn has_input_blocks(&self, a: &Act) -> bool {
        matches!(&a.data, ActData::Cuda(DevBuf { blocks: Some(_), .. }))
    }

    /// A buffer for the Q8_K blocks of an output `[rows, width]` its kernel writes too, when
    /// the integer products may take it (see [`FUSE_ENV`]); `None` otherwise.
    fn fused_blocks(&self, rows: usize, width: usize) -> Option<DevBuf> {
        let yes = self.fuse()
            && rows == 1
            && width > 0
            && width.is_multiple_of(256)
            && matches!(self.activations(), Activations::Int8 | Activations::Auto)
            && self.int8_seen.load(std::sync::atomic::Ordering::Relaxed);
        yes.then(|| self.alloc(width / 256 * Q8K_BLOCK_BYTES / 4))
    }

    /// Gives `a` the blocks its values were just written as (by the launch that wrote them).
    fn attach_blocks(a: &mut Act, blocks: Option<DevBuf>) {
        let shape = (a.rows, a.width);
        if let ActData::Cuda(b) = &mut a.data {
            b.blocks = blocks.map(|k| (shape, Box::new(k)));
        }
    }

    /// Blocks the integer products may read at `p` (as from [`Self::fused_blocks`]): 0 for none.
    fn blocks_ptr(blocks: &Option<DevBuf>) -> u64 {
        blocks.as_ref().map_or(0, |b| b.ptr)
    }

    /// Sets the rows per warp of one-token products launched from now on (see
    /// [`MATVEC_ROWS_ENV`]): 1, 2 or 4.
    pub fn set_matvec_rows(&self, rows: usize) -> Result<()> {
        let n = matvec_rows_asked(Some(&rows.to_string()))?;
        self.matvec_rows.store(n, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    pub fn matvec_rows(&self) -> usize {
        self.matvec_rows.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether products with `ty` weights take the CPU's 8-bit activations (in this mode).
    fn quantizes_activations(&self, ty: GgmlType) -> bool {
        match self.activations() {
            Activations::F32 => false,
            Activations::Auto => INT8_TYPES.contains(&ty),
            Activations::Q8 | Activations::Int8 => true,
        }
    }

    /// With 8-bit activations on: `x` as the CPU's products with `ty` weights see it (`None`
    /// when off, or for float weights, which take `x` itself).
    fn activations_for(&self, ty: GgmlType, x: &Act) -> Option<Act> {
        if !self.quantizes_activations(ty) {
            return None;
        }
        let (kernel, block) = match ActivationFormat::for_weights(ty) {
            ActivationFormat::F32 => return None,
            ActivationFormat::Q8Blocks32 => ("act_q8_32", 32),
            ActivationFormat::Q8K => ("act_q8_k", 256),
        };
        let out = self.act(x.rows, x.width);
        if !x.width.is_multiple_of(block) {
            self.fail(format!(
                "8-bit activations for {ty:?} weights need rows of whole {block}-value blocks, not {}",
                x.width
            ));
            return Some(out);
        }
        let blocks = x.rows * x.width / block;
        if blocks > 0 {
            let cfg = warp_per_block_cfg(blocks);
            self.launch(
                kernel,
                None,
                cfg,
                &[ptr(self.buf(x)), ptr(self.buf(&out)), ptr(blocks as u64)],
            );
        }
        Some(out)
    }

    /// The device address of an activation a kernel is about to write: its blocks (see
    /// [`FUSE_ENV`]) no longer stand for its values, so they go.
    fn buf_mut(&self, a: &mut Act) -> u64 {
        if let ActData::Cuda(b) = &mut a.data {
            b.blocks = None;
        }
        self.buf(a)
    }

    /// The device address of an activation; a host one (a caller's bug) is recorded as an
    /// error, so no kernel runs on it.
    fn buf(&self, a: &Act) -> u64 {
        match &a.data {
            ActData::Cuda(b) => b.ptr,
            ActData::Host(_) => {
                self.fail("CUDA: an activation in host memory was handed to the GPU device".into());
                0
            }
        }
    }

    fn failed(&self) -> bool {
        self.error.lock().expect("error").is_some()
    }

    fn fail(&self, msg: String) {
        let mut e = self.error.lock().expect("error");
        if e.is_none() {
            *e = Some(msg);
        }
    }

    fn check<T>(&self, what: &str, r: std::result::Result<T, cudarc::driver::DriverError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.fail(format!("CUDA: {what}: {e}"));
                None
            }
        }
    }

    fn raw<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    /// A buffer of `len` floats (contents undefined), from the pool when one of that length is
    /// free. Never zero-sized (the driver refuses that).
    fn alloc(&self, len: usize) -> DevBuf {
        let len = len.max(1);
        let reused = {
            let mut free = self.pool.free.lock().expect("pool");
            // The free buffer of this length with the lowest address, whatever order they came
            // back in: a step that allocates and frees as the step before it gets the same
            // buffers, so its recorded launches repeat exactly (CUDA graphs replay them).
            let s = free.0.get_mut(&len).and_then(|v| {
                let lowest = (0..v.len()).min_by_key(|&i| self.raw(&v[i]))?;
                Some(v.swap_remove(lowest))
            });
            if s.is_some() {
                free.1 -= len * 4;
            }
            s
        };
        let slice = match reused {
            Some(s) => Some(s),
            // SAFETY: every caller writes the buffer before reading it, or zeroes it.
            None => self.check("allocating device memory", unsafe { self.stream.alloc::<f32>(len) }),
        };
        let ptr = slice.as_ref().map_or(0, |s| self.raw(s));
        DevBuf {
            slice,
            ptr,
            pool: self.pool.clone(),
            blocks: None,
        }
    }

    fn act(&self, rows: usize, width: usize) -> Act {
        Act {
            rows,
            width,
            data: ActData::Cuda(self.alloc(rows * width)),
        }
    }

    fn zeroed(&self, rows: usize, width: usize) -> Act {
        let mut a = self.act(rows, width);
        if let ActData::Cuda(b) = &mut a.data {
            if let Some(s) = b.slice.as_mut() {
                let mut g = self.graphs.lock().expect("graphs");
                if g.recording() {
                    g.record(graph::Op::Zero {
                        ptr: b.ptr,
                        bytes: s.len() * 4,
                    });
                } else {
                    drop(g);
                    let r = self.stream.memset_zeros(s);
                    self.check("zeroing device memory", r);
                }
            }
        }
        a
    }

    /// Launches kernel `name` (of weight type `ty` for the per-type families) on the stream —
    /// or records it, when graphs are on (see `graph`) — unless an earlier error stopped the
    /// device's work.
    fn launch(&self, name: &'static str, ty: Option<GgmlType>, cfg: LaunchConfig, args: &[Arg]) {
        if self.failed() {
            return;
        }
        self.launched.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut g = self.graphs.lock().expect("graphs");
        if g.recording() {
            // Checked now, so the error names the operation that asked for it.
            if !self.kernels.contains_key(&(name, ty)) {
                self.fail(format!("CUDA: no kernel {name} for {ty:?}"));
                return;
            }
            g.record(graph::Op::launch(name, ty, &cfg, args));
            if g.split_due() {
                self.launch_part(g);
            }
            return;
        }
        drop(g);
        self.launch_now(name, ty, cfg, args);
    }

    /// Launches kernel `name` on the stream now.
    fn launch_now(&self, name: &'static str, ty: Option<GgmlType>, cfg: LaunchConfig, args: &[Arg]) {
        let Some(f) = self.kernels.get(&(name, ty)) else {
            self.fail(format!("CUDA: no kernel {name} for {ty:?}"));
            return;
        };
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::U64(v) => b.arg(v),
                Arg::I32(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        // SAFETY: each kernel's parameters are the (u64 pointer / i32 / f32) values its callers
        // below pass, in order, and every pointer is a live device buffer of the size it reads.
        let r = unsafe { b.launch(cfg) };
        self.check(name, r);
    }

    /// `accumulate_rows` over `w`'s rows, then `tail`'s when given (joined: see
    /// [`Device::accumulate_rows_joined`]); one kernel reads each row where it is, so the sums
    /// are those of the one joined matrix.
    fn accumulate(&self, w: &Weight, tail: Option<&Weight>, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        let n = out.rows;
        let joined_rows = w.rows + tail.map_or(0, |t| t.rows);
        let n_rows = rows.map_or(joined_rows, |r| r.len());
        if n == 0 || n_rows == 0 {
            return;
        }
        if !w.cols.is_multiple_of(32) {
            self.fail(format!(
                "{}: the GPU's neuron-major product needs a multiple of 32 columns, not {}",
                w.name, w.cols
            ));
            return;
        }
        let Some(wd) = self.weight(w) else { return };
        // Rows from `w.rows` on are the tail's (none without one).
        let td = match tail.filter(|t| t.rows > 0) {
            Some(t) => match self.weight(t) {
                Some(d) => Some((d, t.row_stride_bytes as u64)),
                None => return,
            },
            None => None,
        };
        let (tp, tstride) = td.as_ref().map_or((0, 0), |(d, s)| (d.ptr, *s));
        let idx = rows.map_or(0, |r| self.indices(r));
        let parts = accumulate_parts(n_rows);
        let partial = self.act(parts * n, w.cols);
        let units = (w.cols / 32) as u32;
        let cfg = LaunchConfig {
            grid_dim: (units.div_ceil(ACCUMULATE_THREADS), parts as u32, n as u32),
            block_dim: (ACCUMULATE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            "accumulate",
            Some(w.ty),
            cfg,
            &[
                ptr(wd.ptr),
                ptr(w.row_stride_bytes as u64),
                int(joined_rows),
                ptr(idx),
                int(n_rows),
                int(w.cols),
                ptr(self.buf(acts)),
                int(n),
                ptr(self.buf(&partial)),
                ptr(tp),
                ptr(tstride),
                int(w.rows),
            ],
        );
        let len = n * w.cols;
        self.launch(
            "accumulate_reduce",
            None,
            elementwise_cfg(len),
            &[
                ptr(self.buf(&partial)),
                int(parts),
                ptr(len as u64),
                ptr(self.buf_mut(out)),
            ],
        );
    }

    /// A device copy of a weight's bytes (copied on first use), by the address of row 0.
    fn weight(&self, w: &Weight) -> Option<OnDevice> {
        let Some((bytes, keep)) = w.span() else {
            self.fail(format!(
                "{}: its bytes are on disk, not read into memory by the stream (a bug: streamed weights reach the \
                 device as the stream's buffers)",
                w.name
            ));
            return None;
        };
        let copy = |what: &str| {
            let t0 = std::time::Instant::now();
            let buf = self.check(
                &format!("copying {what} {} ({} bytes) to the GPU", w.name, bytes.len()),
                self.stream
                    .clone_htod(if bytes.is_empty() { &[0u8][..] } else { bytes }),
            );
            let mut link = self.link.lock().expect("link counters");
            link.copy_ns += t0.elapsed().as_nanos() as u64;
            if w.is_volatile() {
                link.volatile_bytes += bytes.len() as u64;
                link.volatile_copies += 1;
            } else {
                link.resident_bytes += bytes.len() as u64;
            }
            buf
        };
        if w.is_volatile() {
            // Its copy, staging or page-locked range lives only for this use: what is recorded
            // is launched, and the rest of the segment too as it comes.
            self.leave_recording();
        }
        // Mapped host memory (`in_place`): the kernels read it where it is, across the link.
        if let Some(m) = keep
            .downcast_ref::<super::MappedHost>()
            .filter(|m| m.device == self.id as u64)
        {
            let at = bytes.as_ptr() as u64 - crate::tensor::StagedBytes::bytes(m).as_ptr() as u64;
            return Some(OnDevice {
                ptr: m.device_address + at,
                _transient: None,
                _staged: Some(keep),
            });
        }
        if let Some(staged) = keep.downcast_ref::<upload::CudaStaged>() {
            match staged.device_address(self.id, bytes) {
                Some(Ok(ptr)) => {
                    return Some(OnDevice {
                        ptr,
                        _transient: None,
                        _staged: Some(keep),
                    })
                }
                Some(Err(msg)) => {
                    self.fail(format!("{}: {msg}", w.name));
                    return None;
                }
                // Staged for another GPU: copied below like any streamed buffer.
                None => {}
            }
        }
        let pinned = match w.is_volatile() && !bytes.is_empty() {
            true => upload::pinned_range(&self.pinned, bytes),
            false => None,
        };
        if let Some(refilled) = pinned {
            // Page-locked (a buffer the stream refills, or a resident weight the device does not
            // keep): copied on the copy stream, the host waiting for the copy only where the
            // stream may refill the buffer.
            return match upload::copy_pinned(&self.uploads, bytes, refilled) {
                Ok((ptr, holder)) => Some(OnDevice {
                    ptr,
                    _transient: None,
                    _staged: Some(holder),
                }),
                Err(msg) => {
                    self.fail(format!("{}: {msg}", w.name));
                    None
                }
            };
        }
        if w.is_volatile() {
            // A buffer the stream refills: copied for this use only. The copy from pageable
            // memory has left the host buffer when `clone_htod` returns; dropping the slice after
            // the launch frees it in stream order (or after a synchronize).
            let buf = copy("streamed")?;
            let ptr = self.raw(&buf);
            return Some(OnDevice {
                ptr,
                _transient: Some(buf),
                _staged: None,
            });
        }
        let key = (bytes.as_ptr() as usize, bytes.len(), w.row_stride_bytes);
        let mut cache = self.weights.lock().expect("weights");
        if let Some(d) = cache.get(&key) {
            return Some(OnDevice {
                ptr: d.ptr,
                _transient: None,
                _staged: None,
            });
        }
        let buf = copy("resident")?;
        let ptr = self.raw(&buf);
        cache.insert(
            key,
            DevWeight {
                _buf: buf,
                ptr,
                _keep: keep,
            },
        );
        Some(OnDevice {
            ptr,
            _transient: None,
            _staged: None,
        })
    }

    /// A host vector (norm, bias) on the device, copied again if its contents changed.
    fn vector(&self, v: &[f32]) -> u64 {
        let key = (v.as_ptr() as usize, v.len());
        let mut cache = self.vectors.lock().expect("vectors");
        if let Some((host, _, ptr)) = cache.get(&key) {
            // Compared as bytes (one memcmp): a decode step asks for every norm and bias again.
            if f32_bytes(host) == f32_bytes(v) {
                return *ptr;
            }
        }
        let data = if v.is_empty() { &[0f32][..] } else { v };
        match self.check("copying a vector to the GPU", self.stream.clone_htod(data)) {
            Some(s) => {
                let ptr = self.raw(&s);
                if let Some(old) = cache.insert(key, (v.to_vec(), s, ptr)) {
                    // A recorded launch may still read the old copy.
                    self.keep_until_launched(Box::new(old.1));
                }
                ptr
            }
            None => 0,
        }
    }

    /// Holds device memory until the recorded launches (which may read it) are issued; freed
    /// now (in stream order) when nothing is recorded.
    fn keep_until_launched(&self, x: Box<dyn Any + Send + Sync>) {
        let mut g = self.graphs.lock().expect("graphs");
        if g.enabled {
            g.keep(x);
        }
    }

    /// An index list on the device; the last few hundred distinct lists stay (a pass's
    /// positions and row lists repeat every layer).
    fn indices(&self, v: &[u32]) -> u64 {
        if let Some(p) = self.arena_indices(v) {
            return p;
        }
        let mut guard = self.indices.lock().expect("indices");
        let (cache, retired) = &mut *guard;
        if let Some((_, ptr)) = cache.get(v) {
            return *ptr;
        }
        if let Some(e) = retired.remove(v) {
            let ptr = e.1;
            cache.insert(v.to_vec(), e);
            return ptr;
        }
        if cache.len() >= 256 {
            // The lists the flush before this one retired go, freed in stream order: launches
            // already queued that read them run first (and recorded ones are issued before
            // they go). This flush's stay a round more: a list handed out just before it, to
            // a launch that asks for two (RoPE with the KV write: the tokens' KV words, then
            // the positions), must outlive the queueing of that launch.
            let old = std::mem::replace(retired, std::mem::take(cache));
            self.keep_until_launched(Box::new(old));
        }
        let data = if v.is_empty() { &[0u32][..] } else { v };
        match self.check("copying indices to the GPU", self.stream.clone_htod(data)) {
            Some(s) => {
                let ptr = self.raw(&s);
                cache.insert(v.to_vec(), (s, ptr));
                ptr
            }
            None => 0,
        }
    }

    /// Each token's `TokenKv` (key base, value base, position, capacity) as u32 words.
    fn token_kv(&self, positions: &[usize], seq_of_token: &[usize], caches: &[&mut KvCache]) -> u64 {
        let mut words = Vec::with_capacity(positions.len() * 8);
        for (&pos, &s) in positions.iter().zip(seq_of_token) {
            let (k, v, cap) = match caches[s].device.as_ref().and_then(|d| d.downcast_ref::<DevKv>()) {
                Some(d) => (d.k, d.v, d.shape.1 as u64),
                None => (0, 0, 0),
            };
            for x in [k, v, pos as u64, cap] {
                words.push(x as u32);
                words.push((x >> 32) as u32);
            }
        }
        self.indices(&words)
    }

    /// Gives `cache` device buffers for its shape if it has none of this device's.
    fn ensure_kv(&self, cache: &mut KvCache) {
        let shape = (cache.k.len(), cache.capacity, cache.kv_dim);
        let ok = cache
            .device
            .as_ref()
            .and_then(|d| d.downcast_ref::<DevKv>())
            .is_some_and(|d| d.shape == shape && d.device == self.id);
        if ok {
            return;
        }
        let len = (shape.0 * shape.1 * shape.2).max(1);
        let k = self.check("allocating the KV cache", self.stream.alloc_zeros::<f32>(len));
        let v = self.check("allocating the KV cache", self.stream.alloc_zeros::<f32>(len));
        if let (Some(k), Some(v)) = (k, v) {
            let (kp, vp) = (self.raw(&k), self.raw(&v));
            cache.device = Some(Box::new(DevKv {
                _k: k,
                _v: v,
                k: kp,
                v: vp,
                shape,
                device: self.id,
            }));
        }
    }
}

/// A kernel parameter.
#[derive(Clone, Copy, Debug)]
enum Arg {
    U64(u64),
    I32(i32),
    F32(f32),
}

/// `activate`'s code for an activation (ACT_* in kernels/ops.cu).
fn activation_code(f: FfnActivation) -> usize {
    match f {
        FfnActivation::Silu => 0,
        FfnActivation::GeluTanh => 1,
    }
}

/// The bytes of `v` (an f32's bits, in memory order).
fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and every byte of an f32 is initialized; u8 needs no alignment.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn int(v: usize) -> Arg {
    Arg::I32(v as i32)
}

fn ptr(v: u64) -> Arg {
    Arg::U64(v)
}

impl CudaDevice {
    /// Host-to-device bandwidth per copy size (see [`HostLink::measure_link`]): about 256 MB
    /// copied per size and memory kind (3 to 1000 copies), one copy first untimed, timed on the
    /// host from the first copy's start to the stream's end.
    fn link_bandwidth(&self, sizes: &[usize]) -> Result<Vec<super::LinkBandwidth>> {
        let max = sizes.iter().copied().max().unwrap_or(0).max(1);
        let mut dev = self
            .stream
            .alloc_zeros::<u8>(max)
            .map_err(driver_err("allocating the link test's device buffer"))?;
        let pageable = vec![1u8; max];
        // SAFETY: the memory is written (filled) below before any copy reads it.
        let mut pinned = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(max, 0) }
            .map_err(driver_err("allocating page-locked host memory"))?;
        pinned
            .as_mut_slice()
            .map_err(driver_err("page-locked host memory"))?
            .fill(1);
        let mut rows = Vec::with_capacity(sizes.len());
        for &size in sizes {
            let size = size.max(1);
            let copies = ((256usize << 20) / size).clamp(3, 1000);
            let mut time = |src: &[u8]| -> Result<f64> {
                let mut run = |n: usize| -> Result<f64> {
                    let t0 = std::time::Instant::now();
                    for _ in 0..n {
                        let mut dst = dev.slice_mut(..size);
                        self.stream
                            .memcpy_htod(&src[..size], &mut dst)
                            .map_err(driver_err("copying to the GPU"))?;
                    }
                    self.stream.synchronize().map_err(driver_err("waiting for copies"))?;
                    Ok(t0.elapsed().as_secs_f64())
                };
                run(1)?;
                let s = run(copies)?;
                Ok((copies * size) as f64 / s.max(1e-9) / 1e9)
            };
            let pageable_gb_per_s = time(&pageable)?;
            let pinned_src = pinned.as_slice().map_err(driver_err("page-locked host memory"))?;
            let pinned_gb_per_s = time(pinned_src)?;
            rows.push(super::LinkBandwidth {
                bytes: size,
                pageable_gb_per_s,
                pinned_gb_per_s,
                copies,
            });
        }
        Ok(rows)
    }
}

impl super::HostLink for CudaDevice {
    fn host_memory(&self) -> bool {
        false
    }

    fn link(&self) -> Option<super::LinkCounters> {
        self.end_segment();
        self.uploads.reap_free();
        Some(*self.link.lock().expect("link counters"))
    }

    fn pin_host(&self, bytes: &[u8], refilled: bool) -> Option<super::PinnedHost> {
        self.leave_recording();
        upload::pin_host(&self.ctx, &self.pinned, bytes, refilled, false)
    }

    fn map_host(&self, bytes: &[u8], refilled: bool) -> Option<super::PinnedHost> {
        if !CudaDevice::map_host(self) {
            return None;
        }
        self.leave_recording();
        upload::pin_host(&self.ctx, &self.pinned, bytes, refilled, true)
    }

    fn in_place(&self, w: &Weight) -> Option<Weight> {
        let (bytes, _) = w.span()?;
        let device_address = upload::mapped_address(&self.pinned, bytes)?;
        super::MappedHost::weight_over(w, self.id as u64, device_address)
    }

    fn begin_upload(&self, bytes: usize) -> Box<dyn super::Upload> {
        // Its slot's reuse is ordered by events on the compute stream after earlier readers.
        self.leave_recording();
        match upload::begin(&self.uploads, bytes) {
            Some(u) => Box::new(u),
            // The error is set; stage in ordinary memory so the step can end and return it.
            None => Box::new(super::HostUpload::new(bytes)),
        }
    }

    fn measure_link(&self, sizes: &[usize]) -> Option<Result<Vec<super::LinkBandwidth>>> {
        self.end_segment();
        Some(self.link_bandwidth(sizes))
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        self.label.clone()
    }

    fn run<'a>(&self, f: Box<dyn FnOnce() + Send + 'a>) {
        if let Err(e) = self.ctx.bind_to_thread() {
            self.fail(format!("CUDA: binding the context: {e}"));
        }
        f()
    }

    fn take_error(&self) -> Option<Error> {
        self.end_segment();
        self.error.lock().expect("error").take().map(Error::Invalid)
    }

    fn upload(&self, rows: usize, width: usize, values: Vec<f32>) -> Act {
        assert_eq!(values.len(), rows * width, "activation shape");
        // A pooled buffer, which a recorded launch may still read.
        self.end_segment();
        let mut a = self.act(rows, width);
        if let (ActData::Cuda(b), false) = (&mut a.data, values.is_empty()) {
            if let Some(s) = b.slice.as_mut() {
                let r = self.stream.memcpy_htod(&values[..], &mut s.slice_mut(..values.len()));
                self.check("copying activations to the GPU", r);
            }
        }
        a
    }

    fn zeros(&self, rows: usize, width: usize) -> Act {
        self.zeroed(rows, width)
    }

    fn copy(&self, x: &Act) -> Act {
        self.end_segment();
        let mut y = self.act(x.rows, x.width);
        if let (ActData::Cuda(src), ActData::Cuda(dst)) = (&x.data, &mut y.data) {
            if let (Some(s), Some(d)) = (src.slice.as_ref(), dst.slice.as_mut()) {
                let r = self.stream.memcpy_dtod(s, d);
                self.check("copying on the GPU", r);
            }
        }
        y
    }

    fn to_host<'a>(&self, a: &'a Act) -> Cow<'a, [f32]> {
        self.end_segment();
        let len = a.rows * a.width;
        let mut out = vec![0f32; len];
        if let ActData::Cuda(b) = &a.data {
            if let (Some(s), false, true) = (b.slice.as_ref(), self.failed(), len > 0) {
                let r = self.stream.memcpy_dtoh(&s.slice(..len), &mut out[..]);
                self.check("copying activations to the host", r);
                let waited = self.launched.swap(false, std::sync::atomic::Ordering::Relaxed);
                let mut link = self.link.lock().expect("link counters");
                link.to_host_bytes += (len * 4) as u64;
                link.host_waits += waited as u64;
            }
        }
        Cow::Owned(out)
    }

    fn download(&self, a: Act) -> Vec<f32> {
        self.to_host(&a).into_owned()
    }

    fn embed(&self, w: &Weight, ids: &[u32], scale: f32) -> Act {
        let out = self.act(ids.len(), w.cols);
        if ids.is_empty() {
            return out;
        }
        if let Some(wd) = self.weight(w) {
            let wp = wd.ptr;
            let idx = self.indices(ids);
            let cfg = LaunchConfig {
                grid_dim: (ids.len() as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch(
                "embed",
                Some(w.ty),
                cfg,
                &[
                    ptr(wp),
                    ptr(w.row_stride_bytes as u64),
                    ptr(idx),
                    int(w.cols),
                    Arg::F32(scale),
                    ptr(self.buf(&out)),
                ],
            );
        }
        out
    }

    fn rms_norm(&self, x: &Act, w: &[f32], eps: f32) -> Act {
        let mut y = self.act(x.rows, x.width);
        let blocks = self.fused_blocks(x.rows, x.width);
        self.rms_norm_into(x, w, eps, &y, Self::blocks_ptr(&blocks));
        Self::attach_blocks(&mut y, blocks);
        y
    }

    fn rms_norm_in_place(&self, x: &mut Act, w: &[f32], eps: f32) {
        // The blocks `x` had are replaced below (by new ones or none).
        let blocks = self.fused_blocks(x.rows, x.width);
        self.rms_norm_into(&*x, w, eps, &*x, Self::blocks_ptr(&blocks));
        Self::attach_blocks(x, blocks);
    }

    fn add(&self, x: &mut Act, y: &Act) {
        let len = x.rows * x.width;
        self.launch(
            "add",
            None,
            elementwise_cfg(len),
            &[ptr(self.buf_mut(x)), ptr(self.buf(y)), ptr(len as u64)],
        );
    }

    fn add_bias(&self, x: &mut Act, b: &[f32]) {
        let len = x.rows * x.width;
        let bp = self.vector(b);
        self.launch(
            "add_bias",
            None,
            elementwise_cfg(len),
            &[ptr(self.buf_mut(x)), ptr(bp), int(b.len()), ptr(len as u64)],
        );
    }

    fn activate_mul(&self, up: &mut Act, gate: &mut Act, f: FfnActivation) {
        let len = up.rows * up.width;
        if gate.rows * gate.width != len {
            self.fail(format!(
                "activate_mul: {len} values times a gate of {}",
                gate.rows * gate.width
            ));
            return;
        }
        let (u, g) = (self.buf_mut(up), self.buf(gate));
        if let Some(blocks) = self.fused_blocks(up.rows, up.width) {
            let n = up.width / 256;
            self.launch(
                "activate_mul_q8_k",
                None,
                LaunchConfig {
                    grid_dim: (n as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                },
                &[ptr(u), ptr(g), int(activation_code(f)), ptr(blocks.ptr), ptr(n as u64)],
            );
            Self::attach_blocks(up, Some(blocks));
            return;
        }
        self.launch(
            "activate_mul",
            None,
            elementwise_cfg(len),
            &[ptr(u), ptr(g), int(activation_code(f)), ptr(len as u64)],
        );
    }

    fn add_rms_norm(&self, x: &mut Act, y: &Act, w: &[f32], eps: f32) -> Act {
        let mut out = self.act(x.rows, x.width);
        if x.rows == 0 {
            return out;
        }
        if (y.rows, y.width) != (x.rows, x.width) || w.len() != x.width {
            self.fail(format!(
                "add_rms_norm: [{}, {}] plus [{}, {}], a norm of {}",
                x.rows,
                x.width,
                y.rows,
                y.width,
                w.len()
            ));
            return out;
        }
        let wp = self.vector(w);
        let cfg = norm_cfg(x.rows, x.width);
        let blocks = self.fused_blocks(x.rows, x.width);
        self.launch(
            "add_rms_norm",
            None,
            cfg,
            &[
                ptr(self.buf_mut(x)),
                ptr(self.buf(y)),
                ptr(wp),
                ptr(self.buf(&out)),
                int(x.width),
                Arg::F32(eps),
                ptr(Self::blocks_ptr(&blocks)),
            ],
        );
        Self::attach_blocks(&mut out, blocks);
        out
    }

    fn mul(&self, x: &mut Act, y: &Act) {
        let len = x.rows * x.width;
        self.launch(
            "mul",
            None,
            elementwise_cfg(len),
            &[ptr(self.buf_mut(x)), ptr(self.buf(y)), ptr(len as u64)],
        );
    }

    fn activate(&self, x: &mut Act, f: FfnActivation) {
        let len = x.rows * x.width;
        self.launch(
            "activate",
            None,
            elementwise_cfg(len),
            &[ptr(self.buf_mut(x)), int(activation_code(f)), ptr(len as u64)],
        );
    }

    fn softcap(&self, x: &mut Act, cap: f32) {
        let len = x.rows * x.width;
        self.launch(
            "softcap",
            None,
            elementwise_cfg(len),
            &[ptr(self.buf_mut(x)), Arg::F32(cap), ptr(len as u64)],
        );
    }

    fn argmax_rows(&self, x: &Act, banned: &[u32]) -> Vec<u32> {
        if x.rows == 0 || x.width == 0 {
            return vec![0; x.rows];
        }
        // One word a row, the kernel's u32 in an f32 buffer's bits.
        let out = self.pick_rows("argmax_rows", ARGMAX_THREADS, x, banned, &[], 1);
        self.to_host(&out).iter().map(|v| v.to_bits()).collect()
    }

    fn top_k_rows(&self, x: &Act, k: usize, banned: &[u32], lse: bool, greedy: bool) -> TopRows {
        assert!(
            (1..=TOP_K_THREADS as usize).contains(&k) && k <= x.width,
            "top_k_rows: k = {k} for rows of {}",
            x.width
        );
        if x.rows == 0 {
            return TopRows::default();
        }
        // The greedy tokens' kernel first, so one wait brings both results.
        let tokens = greedy.then(|| self.pick_rows("argmax_rows", ARGMAX_THREADS, x, banned, &[], 1));
        // Two words a candidate: the id (a u32 in an f32 buffer's bits), then the value; with
        // `lse`, two more a row: the f64's low word, then its high one.
        let width = 2 * k + if lse { 2 } else { 0 };
        let out = self.pick_rows(
            "top_k_rows",
            TOP_K_THREADS,
            x,
            banned,
            &[int(k), int(lse as usize)],
            width,
        );
        let words = self.to_host(&out);
        let mut top = TopRows {
            pairs: Vec::with_capacity(x.rows * k),
            lse: Vec::with_capacity(if lse { x.rows } else { 0 }),
            tokens: tokens.map_or(Vec::new(), |t| self.to_host(&t).iter().map(|v| v.to_bits()).collect()),
        };
        for row in words.chunks_exact(width) {
            top.pairs
                .extend(row[..2 * k].chunks_exact(2).map(|c| (c[0].to_bits(), c[1])));
            if lse {
                let (lo, hi) = (row[2 * k].to_bits() as u64, row[2 * k + 1].to_bits() as u64);
                top.lse.push(f64::from_bits(hi << 32 | lo));
            }
        }
        top
    }

    fn select_rows(&self, x: &Act, rows: &[usize]) -> Act {
        let out = self.act(rows.len(), x.width);
        if rows.is_empty() || x.width == 0 {
            return out;
        }
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.indices(&ids);
        let cfg = rows_cfg(x.width, rows.len());
        self.launch(
            "select_rows",
            None,
            cfg,
            &[ptr(self.buf(x)), ptr(idx), int(x.width), ptr(self.buf(&out))],
        );
        out
    }

    fn scatter_cols(&self, x: &Act, cols: &[u32], width: usize) -> Act {
        let out = self.zeroed(x.rows, width);
        if cols.is_empty() || x.rows == 0 {
            return out;
        }
        let idx = self.indices(cols);
        let cfg = rows_cfg(cols.len(), x.rows);
        self.launch(
            "scatter_cols",
            None,
            cfg,
            &[
                ptr(self.buf(x)),
                ptr(idx),
                int(cols.len()),
                int(width),
                ptr(self.buf(&out)),
            ],
        );
        out
    }

    fn gather_cols(&self, x: &Act, cols: &[u32]) -> Act {
        let out = self.act(x.rows, cols.len());
        if cols.is_empty() || x.rows == 0 {
            return out;
        }
        let idx = self.indices(cols);
        let cfg = rows_cfg(cols.len(), x.rows);
        self.launch(
            "gather_cols",
            None,
            cfg,
            &[
                ptr(self.buf(x)),
                ptr(idx),
                int(cols.len()),
                int(x.width),
                ptr(self.buf(&out)),
            ],
        );
        out
    }

    fn matmul(&self, ws: &[&Weight], x: &Act) -> Vec<Act> {
        self.matmul_with(ws, &[], x)
    }

    fn matmul_bias(&self, ws: &[&Weight], biases: &[Option<&[f32]>], x: &Act) -> Vec<Act> {
        self.matmul_with(ws, biases, x)
    }

    fn matmul_rows(&self, w: &Weight, rows: &[u32], x: &Act) -> Act {
        if self.int8_product(w, x) {
            let (xq, _made) = self.int8_input(x, true);
            return self.product_i8(w, Some(rows), None, xq);
        }
        let seen = self.activations_for(w.ty, x);
        self.product(w, Some(rows), seen.as_ref().unwrap_or(x))
    }

    fn accumulate_rows(&self, w: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        self.accumulate(w, None, rows, acts, out)
    }

    fn accumulate_rows_joined(&self, head: &Weight, tail: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        if let Err(e) = super::joinable(head, tail) {
            self.fail(e.to_string());
            return;
        }
        self.accumulate(head, Some(tail), rows, acts, out)
    }

    fn rope_qk(
        &self,
        q: &mut Act,
        k: &mut Act,
        positions: &[usize],
        shape: RopeShape,
        q_norm: Option<&[f32]>,
        k_norm: Option<&[f32]>,
        eps: f32,
    ) {
        if positions.is_empty() || shape.head_dim == 0 {
            return;
        }
        self.launch_rope(q, k, positions, (shape, q_norm, k_norm, eps), None);
    }

    fn kv_write(
        &self,
        layer: usize,
        k: &Act,
        v: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &mut [&mut KvCache],
    ) {
        if positions.is_empty() {
            return;
        }
        for c in caches.iter_mut() {
            self.ensure_kv(c);
        }
        let info = self.token_kv(positions, seq_of_token, caches);
        let cfg = rows_cfg(k.width, positions.len());
        self.launch(
            "kv_write",
            None,
            cfg,
            &[ptr(self.buf(k)), ptr(self.buf(v)), ptr(info), int(layer), int(k.width)],
        );
    }

    fn rope_qk_kv_write(
        &self,
        layer: usize,
        q: &mut Act,
        k: &mut Act,
        v: &Act,
        at: (&[usize], &[usize]),
        caches: &mut [&mut KvCache],
        rope: (RopeShape, Option<&[f32]>, Option<&[f32]>, f32),
    ) {
        let (positions, seq_of_token) = at;
        let (shape, q_norm, k_norm, eps) = rope;
        let hd = shape.head_dim;
        let fits = hd > 0
            && q.width.is_multiple_of(hd)
            && k.width.is_multiple_of(hd)
            && (v.rows, v.width) == (k.rows, k.width)
            && q.rows == positions.len()
            && k.rows == positions.len();
        if !self.fuse() || !fits || positions.is_empty() {
            self.rope_qk(q, k, positions, shape, q_norm, k_norm, eps);
            self.kv_write(layer, k, v, positions, seq_of_token, caches);
            return;
        }
        for c in caches.iter_mut() {
            self.ensure_kv(c);
        }
        let info = self.token_kv(positions, seq_of_token, caches);
        self.launch_rope(q, k, positions, rope, Some((v, info, layer)));
    }

    fn attention(
        &self,
        q: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &[&mut KvCache],
        shape: AttnShape,
    ) -> Act {
        let out = self.act(q.rows, q.width);
        if positions.is_empty() {
            return out;
        }
        if shape.head_dim > ATTN_MAX_HEAD_DIM {
            self.fail(format!(
                "CUDA: attention supports heads of at most {ATTN_MAX_HEAD_DIM}, not {}",
                shape.head_dim
            ));
            return out;
        }
        let info = self.token_kv(positions, seq_of_token, caches);
        // Score rows (their length is only a stride to the kernel) sized by powers of two, so a
        // decode step's buffers and parameters repeat for a CUDA graph.
        let max_len = attention_row(
            positions
                .iter()
                .map(|&p| shape.window.map_or(p + 1, |w| (p + 1).min(w)))
                .max()
                .unwrap_or(1),
        );
        let scores = self.act(q.rows * shape.n_heads, max_len);
        let cfg = LaunchConfig {
            grid_dim: (shape.n_heads as u32, q.rows as u32, 1),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch(
            "attention",
            None,
            cfg,
            &[
                ptr(self.buf(q)),
                ptr(info),
                int(shape.layer),
                int(shape.n_heads),
                int(shape.n_kv_heads),
                int(shape.head_dim),
                Arg::F32(shape.scale),
                int(shape.window.unwrap_or(0)),
                ptr(self.buf(&scores)),
                int(max_len),
                ptr(self.buf(&out)),
            ],
        );
        out
    }
}

impl CudaDevice {
    /// Device-to-device copy bandwidth over `bytes`-sized buffers, counting bytes read and
    /// written (the ceiling a memory-bound kernel reaches), in bytes per second.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64> {
        self.end_segment();
        let n = bytes / 4;
        let a = self.stream.alloc_zeros::<f32>(n).map_err(driver_err("allocating"))?;
        let mut b = self.stream.alloc_zeros::<f32>(n).map_err(driver_err("allocating"))?;
        self.stream.memcpy_dtod(&a, &mut b).map_err(driver_err("copying"))?;
        self.stream.synchronize().map_err(driver_err("synchronizing"))?;
        let reps = 20;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            self.stream.memcpy_dtod(&a, &mut b).map_err(driver_err("copying"))?;
        }
        self.stream.synchronize().map_err(driver_err("synchronizing"))?;
        Ok((2 * n * 4 * reps) as f64 / t.elapsed().as_secs_f64())
    }

    /// Queries and keys (`rope`: shape, per-head norms, eps) in one launch: `rope_norm`; with
    /// `kv` (the values, the tokens' KV words from [`Self::token_kv`], the layer) `rope_norm_kv`,
    /// which also writes the rotated keys and the values into the KV cache.
    fn launch_rope(
        &self,
        q: &mut Act,
        k: &mut Act,
        positions: &[usize],
        rope: (RopeShape, Option<&[f32]>, Option<&[f32]>, f32),
        kv: Option<(&Act, u64, usize)>,
    ) {
        let (shape, q_norm, k_norm, eps) = rope;
        let hd = shape.head_dim;
        let pos: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let pp = self.indices(&pos);
        let style = match shape.style {
            RopeStyle::AdjacentPairs => 0,
            RopeStyle::HalfSplit => 1,
        };
        let (qn, kn) = (
            q_norm.map_or(0, |n| self.vector(n)),
            k_norm.map_or(0, |n| self.vector(n)),
        );
        // Query heads, key heads, then (writing the cache) as many value heads.
        let value_heads = kv.map_or(0, |_| k.width / hd);
        let cfg = LaunchConfig {
            grid_dim: (
                (q.width / hd + k.width / hd + value_heads) as u32,
                positions.len() as u32,
                1,
            ),
            block_dim: (rope_threads(hd), 1, 1),
            shared_mem_bytes: 0,
        };
        let (v, info, layer) = kv.map_or((0, 0, 0), |(v, info, layer)| (self.buf(v), info, layer));
        let args = [
            ptr(self.buf_mut(q)),
            int(q.width),
            ptr(qn),
            ptr(self.buf_mut(k)),
            int(k.width),
            ptr(kn),
            int(hd),
            ptr(pp),
            Arg::F32(shape.base),
            Arg::F32(shape.pos_scale),
            int(style),
            Arg::F32(eps),
            ptr(v),
            ptr(info),
            int(layer),
        ];
        // `rope_norm` takes the first 12 parameters.
        match kv {
            Some(_) => self.launch("rope_norm_kv", None, cfg, &args),
            None => self.launch("rope_norm", None, cfg, &args[..12]),
        }
    }

    /// RMSNorm of `x` into `y` (which may be `x`: the caller drops its blocks first), and into
    /// Q8_K blocks at `blocks` unless 0 ([`Self::fused_blocks`]).
    fn rms_norm_into(&self, x: &Act, w: &[f32], eps: f32, y: &Act, blocks: u64) {
        if x.rows == 0 {
            return;
        }
        let wp = self.vector(w);
        let cfg = norm_cfg(x.rows, x.width);
        self.launch(
            "rms_norm",
            None,
            cfg,
            &[
                ptr(self.buf(x)),
                ptr(wp),
                ptr(self.buf(y)),
                int(x.width),
                Arg::F32(eps),
                ptr(blocks),
            ],
        );
    }

    /// `x · w_i` (+ `biases[i]` where given) for each weight: the integer products of one
    /// type in launches of up to three weights (the input quantized once), the others one by one.
    fn matmul_with(&self, ws: &[&Weight], biases: &[Option<&[f32]>], x: &Act) -> Vec<Act> {
        let bias = |i: usize| biases.get(i).copied().flatten();
        let mut out: Vec<Option<Act>> = ws.iter().map(|_| None).collect();
        let int8: Vec<usize> = (0..ws.len()).filter(|&i| self.int8_product(ws[i], x)).collect();
        if !int8.is_empty() {
            let (xq, _made) = self.int8_input(x, int8.len() == 1);
            for ty in INT8_TYPES {
                let same: Vec<usize> = int8.iter().copied().filter(|&i| ws[i].ty == ty).collect();
                for group in same.chunks(3) {
                    let items: Vec<(&Weight, Option<&[f32]>)> = group.iter().map(|&i| (ws[i], bias(i))).collect();
                    for (&i, o) in group.iter().zip(self.products_i8(&items, xq)) {
                        out[i] = Some(o);
                    }
                }
            }
        }
        // The input as each other weight type's products see it, made once per format.
        let mut seen: Vec<((ActivationFormat, bool), Option<Act>)> = Vec::new();
        for (i, w) in ws.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let format = (ActivationFormat::for_weights(w.ty), self.quantizes_activations(w.ty));
            let f = match seen.iter().position(|(f, _)| *f == format) {
                Some(f) => f,
                None => {
                    seen.push((format, self.activations_for(w.ty, x)));
                    seen.len() - 1
                }
            };
            let mut o = self.product(w, None, seen[f].1.as_ref().unwrap_or(x));
            if let Some(b) = bias(i) {
                self.add_bias(&mut o, b);
            }
            out[i] = Some(o);
        }
        out.into_iter().map(|o| o.expect("every product made")).collect()
    }

    /// `x · w[rows]` (all rows when `None`; + `bias` when given) for one token `x` given as
    /// Q8_K blocks, or values the kernel quantizes ([`CudaDevice::int8_input`]), with integer
    /// dot products.
    fn product_i8(&self, w: &Weight, rows: Option<&[u32]>, bias: Option<&[f32]>, input: Int8Input) -> Act {
        let rows_out = rows.map_or(w.rows, |r| r.len());
        let out = self.act(1, rows_out);
        if rows_out == 0 {
            return out;
        }
        let Some(wd) = self.weight(w) else { return out };
        let idx = rows.map_or(0, |r| self.indices(r));
        let bp = bias.map_or(0, |b| self.vector(b));
        let wpr = i8_warps_per_row(w.cols);
        let cfg = LaunchConfig {
            grid_dim: (i8_blocks(&[rows_out], wpr)[0].max(1), 1, 1),
            block_dim: (32, MATMUL_WARPS, 1),
            shared_mem_bytes: 0,
        };
        let (kernel, xq) = match input {
            Int8Input::Blocks(p) => ("matvec_i8", p),
            Int8Input::Values(p) => ("matvec_i8f", p),
        };
        self.launch(
            kernel,
            Some(w.ty),
            cfg,
            &[
                ptr(wd.ptr),
                ptr(w.row_stride_bytes as u64),
                int(rows_out),
                ptr(idx),
                int(w.cols),
                ptr(xq),
                ptr(bp),
                int(wpr),
                ptr(self.buf(&out)),
            ],
        );
        out
    }

    /// Several weights of one integer-product type (at most three, the same columns) times the
    /// same one-token input in one launch (`matvec_i8x3_*`); one alone as [`Self::product_i8`].
    fn products_i8(&self, items: &[(&Weight, Option<&[f32]>)], input: Int8Input) -> Vec<Act> {
        if let [(w, b)] = items {
            return vec![self.product_i8(w, None, *b, input)];
        }
        let Int8Input::Blocks(xq) = input else {
            unreachable!("several products take the input as blocks")
        };
        assert!(
            items.len() <= 3
                && items
                    .windows(2)
                    .all(|p| p[0].0.ty == p[1].0.ty && p[0].0.cols == p[1].0.cols)
        );
        let outs: Vec<Act> = items.iter().map(|(w, _)| self.act(1, w.rows)).collect();
        // Each weight's device copy (a streamed weight's lives only as long as this) is kept
        // until the launch.
        let mut segs = Vec::new();
        let mut on_device = Vec::new();
        for (w, b) in items {
            let Some(wd) = self.weight(w) else { return outs };
            segs.push((
                wd.ptr,
                w.row_stride_bytes as u64,
                w.rows,
                b.map_or(0, |b| self.vector(b)),
            ));
            on_device.push(wd);
        }
        let (ty, cols) = (items[0].0.ty, items[0].0.cols);
        let wpr = i8_warps_per_row(cols);
        let mut rows: Vec<usize> = segs.iter().map(|s| s.2).collect();
        rows.resize(3, 0);
        let nb = i8_blocks(&rows, wpr);
        let total = nb.iter().sum::<u32>();
        if total == 0 {
            return outs;
        }
        let mut args = vec![
            ptr(xq),
            int(cols),
            int(wpr),
            int(nb[0] as usize),
            int((nb[0] + nb[1]) as usize),
        ];
        for i in 0..3 {
            match (segs.get(i), outs.get(i)) {
                (Some(&(wp, stride, r, bp)), Some(o)) => {
                    args.extend([ptr(wp), ptr(stride), int(r), ptr(bp), ptr(self.buf(o))]);
                }
                _ => args.extend([ptr(0), ptr(0), int(0), ptr(0), ptr(0)]),
            }
        }
        let cfg = LaunchConfig {
            grid_dim: (total, 1, 1),
            block_dim: (32, MATMUL_WARPS, 1),
            shared_mem_bytes: 0,
        };
        self.launch("matvec_i8x3", Some(ty), cfg, &args);
        drop(on_device);
        outs
    }

    /// `x · w[rows]` (all rows when `None`).
    fn product(&self, w: &Weight, rows: Option<&[u32]>, x: &Act) -> Act {
        let rows_out = rows.map_or(w.rows, |r| r.len());
        let out = self.act(x.rows, rows_out);
        if x.rows == 0 || rows_out == 0 {
            return out;
        }
        if x.width != w.cols {
            self.fail(format!("{}: {} columns times an input of {}", w.name, w.cols, x.width));
            return out;
        }
        let Some(wd) = self.weight(w) else { return out };
        let wp = wd.ptr;
        let idx = rows.map_or(0, |r| self.indices(r));
        // One token (decode): a single-token kernel, with fewer registers.
        let (kernel, cfg) = match (x.rows, self.matvec_rows()) {
            (1, 4) => ("matvec4", matvec_cfg(rows_out, 4)),
            (1, 2) => ("matvec2", matvec_cfg(rows_out, 2)),
            (1, _) => ("matvec", matvec_cfg(rows_out, 1)),
            _ => ("matmul", matmul_cfg(rows_out, x.rows)),
        };
        self.launch(
            kernel,
            Some(w.ty),
            cfg,
            &[
                ptr(wp),
                ptr(w.row_stride_bytes as u64),
                int(rows_out),
                ptr(idx),
                int(w.cols),
                ptr(self.buf(x)),
                int(x.rows),
                ptr(self.buf(&out)),
            ],
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_name_is_defined_in_the_source() {
        let src = nvrtc::source();
        for name in kernel_names() {
            let (kind, suffix) = name.split_once('_').unwrap_or((&name, ""));
            let direct = src.contains(&format!("void {name}("));
            // The quantized kernels come from the QUANT_KERNELS macro.
            let by_macro = TYPED.contains(&kind)
                && src.contains(&format!("void {kind}_##NAME("))
                && src.contains(&format!("QUANT_KERNELS({suffix},"));
            // The integer products come from the MATVEC_I8_KERNELS and MATVEC_I8F_KERNEL macros.
            let int8 = [
                ("matvec_i8x3", "MATVEC_I8_KERNELS"),
                ("matvec_i8f", "MATVEC_I8F_KERNEL"),
                ("matvec_i8", "MATVEC_I8_KERNELS"),
            ]
            .iter()
            .any(|(family, mac)| {
                name.strip_prefix(&format!("{family}_")).is_some_and(|t| {
                    src.contains(&format!("void {family}_##t(")) && src.contains(&format!("{mac}({t},"))
                })
            });
            assert!(direct || by_macro || int8, "{name} is not in kernels/");
        }
    }

    #[test]
    fn activation_mode_is_auto_unless_asked() {
        assert_eq!(activations_asked(None).unwrap(), Activations::Auto);
        assert_eq!(activations_asked(Some("")).unwrap(), Activations::Auto);
        assert_eq!(activations_asked(Some("auto")).unwrap(), Activations::Auto);
        assert_eq!(activations_asked(Some("f32")).unwrap(), Activations::F32);
        assert_eq!(activations_asked(Some(" q8 ")).unwrap(), Activations::Q8);
        assert_eq!(activations_asked(Some("int8")).unwrap(), Activations::Int8);
        assert_eq!(matvec_rows_asked(None).unwrap(), 1);
        assert_eq!(matvec_rows_asked(Some(" 4")).unwrap(), 4);
        let e = matvec_rows_asked(Some("3")).unwrap_err().to_string();
        assert!(
            e.contains(MATVEC_ROWS_ENV) && e.contains("1 (the default), 2 or 4"),
            "{e}"
        );
        let e = activations_asked(Some("i8")).unwrap_err().to_string();
        assert!(
            e.contains(ACTIVATIONS_ENV) && e.contains("i8:") && e.contains("q8") && e.contains("int8"),
            "{e}"
        );
    }

    #[test]
    fn fused_input_blocks_are_on_unless_turned_off() {
        assert!(fuse_asked(None).unwrap());
        assert!(fuse_asked(Some("on")).unwrap());
        assert!(!fuse_asked(Some(" 0")).unwrap());
        let e = fuse_asked(Some("no")).unwrap_err().to_string();
        assert!(e.contains("GATESTREAM_CUDA_FUSE=no") && e.contains("or 0"), "{e}");
    }

    #[test]
    fn launch_geometry_covers_every_element() {
        for len in [1usize, 255, 256, 257, 1 << 20] {
            let c = elementwise_cfg(len);
            assert!((c.grid_dim.0 * c.block_dim.0) as usize >= len);
            assert!((((c.grid_dim.0 - 1) * c.block_dim.0) as usize) < len);
        }
        let c = matmul_cfg(1536, 1);
        assert_eq!((c.grid_dim, c.block_dim), ((192, 1, 1), (32, 8, 1)));
        let c = matmul_cfg(151_936, 17);
        assert_eq!(c.grid_dim, (18_992, 3, 1));
        assert_eq!(matvec_cfg(1536, 1).grid_dim, matmul_cfg(1536, 1).grid_dim);
        for rows in [1usize, 31, 32, 33, 8960] {
            for rpw in [1usize, 2, 4] {
                let c = matvec_cfg(rows, rpw);
                let per_block = (c.block_dim.1 as usize) * rpw;
                assert!(c.grid_dim.0 as usize * per_block >= rows, "{rows} rows, {rpw} per warp");
                assert!(
                    (c.grid_dim.0 as usize - 1) * per_block < rows,
                    "{rows} rows, {rpw} per warp"
                );
            }
        }
        assert_eq!(accumulate_parts(1), 1);
        assert_eq!(accumulate_parts(8960), 64);
        assert_eq!(accumulate_parts(640), 10);
        assert_eq!(rope_threads(8), 32);
        assert_eq!(rope_threads(128), 64);
        assert_eq!(rope_threads(256), 128);
        // Norms: 4 values a thread in registers up to 4096 wide, whole warps.
        assert_eq!(norm_threads(1536), 384);
        assert_eq!(norm_threads(256), 64);
        assert_eq!(norm_threads(1), 32);
        assert_eq!(norm_threads(4096), 1024);
        assert_eq!(norm_threads(8960), 1024);
        // Integer products: a row's warps cover its super-blocks in one or two passes of 4.
        assert_eq!(i8_warps_per_row(1536), 1); // 6 super-blocks
        assert_eq!(i8_warps_per_row(2048), 2); // 8
        assert_eq!(i8_warps_per_row(4096), 4); // 16
        assert_eq!(i8_warps_per_row(8960), 8); // 35
        assert_eq!(i8_warps_per_row(256 * 1000), 8);
        for wpr in [1usize, 2, 4, 8] {
            for rows in [1usize, 7, 8, 9, 1536] {
                let nb = i8_blocks(&[rows, 0], wpr);
                let per_block = MATMUL_WARPS as usize / wpr;
                assert!(nb[0] as usize * per_block >= rows && (nb[0] as usize - 1) * per_block < rows);
                assert_eq!(nb[1], 0);
            }
        }
    }
}
