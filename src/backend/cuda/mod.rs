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

mod driver;
mod graph;
mod kv;
mod launch;
mod link;
mod memory;
pub mod nvrtc;
mod ops;
mod options;
mod registry;
mod upload;
mod weights;
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

pub use driver::LIBCUDA_ENV;
use driver::*;
pub(crate) use memory::DevBuf;
use memory::*;
pub use options::*;
pub use registry::*;

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
    /// Copies of keyed volatile weights (routed experts) kept here (`HostLink::keep_keyed`).
    kept: Mutex<weights::Kept>,
    /// Whether `map_host` maps (see [`upload::MAP_HOST_ENV`]).
    map_host: std::sync::atomic::AtomicBool,
    /// Which KV buffers are this device's (several devices may live in one process).
    id: usize,
    /// What quantized products multiply (see [`ACTIVATIONS_ENV`]): an [`Activations`] as u8.
    activations: std::sync::atomic::AtomicU8,
    /// Rows per warp of one-token products (see [`MATVEC_ROWS_ENV`]).
    matvec_rows: std::sync::atomic::AtomicUsize,
    /// Warps per row of the integer products, 0 for by the row (see [`I8_WPR_ENV`]).
    i8_wpr: std::sync::atomic::AtomicUsize,
    /// Whether the integer tiles load the next super-block ahead (see [`MMQ_PREFETCH_ENV`]).
    mmq_prefetch: std::sync::atomic::AtomicBool,
    /// Weight copies from the host (see [`HostLink::link`]).
    link: Arc<Mutex<super::LinkCounters>>,
    /// Recorded launches and CUDA graphs (see [`GRAPHS_ENV`]).
    graphs: Mutex<graph::Graphs>,
    /// Whether launches that follow each other are fused (see [`FUSE_ENV`]).
    fuse: std::sync::atomic::AtomicBool,
    /// Whether batched quantized products run on the tensor cores (see [`MMA_ENV`]).
    mma: std::sync::atomic::AtomicBool,
    /// The most tokens whose Q4_K and Q6_K products run as integers (see [`INT8_TOKENS_ENV`]).
    int8_tokens: std::sync::atomic::AtomicUsize,
    /// Whether wider batches of Q4_K and Q6_K rows run as integer tiles (see [`MMQ_ENV`]).
    mmq: std::sync::atomic::AtomicBool,
    /// Whether a prompt's attention runs in tiles of tokens (see [`ATTN_TILES_ENV`]).
    attn_tiles: std::sync::atomic::AtomicBool,
    /// Whether decode attention is split over positions (see [`ATTN_SPLIT_ENV`]).
    attn_split: std::sync::atomic::AtomicBool,
    /// Whether an integer product has been launched (before one, no blocks are made ahead).
    int8_seen: std::sync::atomic::AtomicBool,
    /// Whether a kernel has been launched since the last copy to the host (which then waits
    /// for it: `LinkCounters::host_waits`).
    launched: std::sync::atomic::AtomicBool,
    /// The launch counters ([`CudaDevice::counters`]), made at first use.
    counters: Mutex<Option<CudaSlice<u32>>>,
    /// Launches that took on the next one's work in their last block (see [`FUSE_ENV`]).
    last_block_fusions: std::sync::atomic::AtomicU64,
}

impl CudaDevice {
    /// What a row-picking kernel (`argmax_rows`, `top_k_rows`) runs with: a block of `threads`
    /// a row of `x`, the `banned` ids on the device, and an output of `out_width` words a row.
    fn pick_rows(&self, threads: u32, x: &Act, banned: &[u32], out_width: usize) -> (LaunchConfig, u64, Act) {
        let cfg = LaunchConfig {
            grid_dim: (x.rows as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        (cfg, self.indices(banned), self.act(x.rows, out_width))
    }

    /// Each row's argmax, the `banned` ids left out: one word a row, the kernel's u32 in an f32
    /// buffer's bits.
    fn argmax_launch(&self, x: &Act, banned: &[u32]) -> Act {
        let (cfg, idx, out) = self.pick_rows(ARGMAX_THREADS, x, banned, 1);
        self.k()
            .argmax_rows(cfg, self.buf(x), x.width, idx, banned.len(), self.buf(&out));
        out
    }

    /// GPU `ordinal`: the driver, a device, NVRTC no newer than the driver, the kernels compiled
    /// for the device (or read from the cache) and loaded, the modes `opts` asks for.
    pub fn open(ordinal: usize, opts: &CudaOptions) -> Result<CudaDevice> {
        let CudaOptions {
            activations,
            matvec_rows,
            graphs,
            graph_split,
            map_host,
            fuse,
            mma,
            int8_tokens,
            i8_wpr,
            mmq_prefetch,
            mmq,
            attn_tiles,
            attn_split,
            ..
        } = *opts;
        ensure_driver(opts.libcuda.as_deref())?;
        let count = CudaContext::device_count().map_err(|e| {
            Error::Device(format!(
                "CUDA: the driver did not start ({e}); is the NVIDIA kernel module loaded (nvidia-smi)?"
            ))
        })?;
        if count <= 0 {
            return Err(Error::Device(
                "CUDA: the driver found no GPU (use --device cpu to run on the CPU)".into(),
            ));
        }
        if ordinal >= count as usize {
            return Err(Error::Input(format!(
                "CUDA: GPU {ordinal} asked for, the driver found {count}"
            )));
        }
        let driver = driver_version()?;
        let nvrtc = nvrtc::Nvrtc::load_from(opts.nvrtc.clone(), &opts.cuda_homes)?;
        if nvrtc.version > driver {
            return Err(Error::Device(format!(
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
        let (cubin, cached) = nvrtc::compiled_module(&nvrtc, arch, opts.kernel_cache.as_deref(), true)?;
        let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)) {
            Ok(m) => m,
            // A damaged cache entry: compile again (the new module replaces it).
            Err(_) if cached => {
                let (cubin, _) = nvrtc::compiled_module(&nvrtc, arch, opts.kernel_cache.as_deref(), false)?;
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
            pinned: Arc::new(Mutex::new(Default::default())),
            kept: Mutex::new(Default::default()),
            map_host: std::sync::atomic::AtomicBool::new(map_host),
            id,
            activations: std::sync::atomic::AtomicU8::new(activations as u8),
            matvec_rows: std::sync::atomic::AtomicUsize::new(matvec_rows),
            i8_wpr: std::sync::atomic::AtomicUsize::new(i8_wpr),
            mmq_prefetch: std::sync::atomic::AtomicBool::new(mmq_prefetch),
            link,
            graphs: Mutex::new(graph::Graphs::default()),
            fuse: std::sync::atomic::AtomicBool::new(fuse),
            mma: std::sync::atomic::AtomicBool::new(mma),
            int8_tokens: std::sync::atomic::AtomicUsize::new(int8_tokens),
            mmq: std::sync::atomic::AtomicBool::new(mmq),
            attn_tiles: std::sync::atomic::AtomicBool::new(attn_tiles),
            attn_split: std::sync::atomic::AtomicBool::new(attn_split),
            int8_seen: std::sync::atomic::AtomicBool::new(false),
            launched: std::sync::atomic::AtomicBool::new(false),
            counters: Mutex::new(None),
            last_block_fusions: std::sync::atomic::AtomicU64::new(0),
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

    /// Sets the most tokens whose Q4_K and Q6_K products run as integers (see
    /// [`INT8_TOKENS_ENV`]; 1 to [`I8N_MAX`]).
    pub fn set_int8_tokens(&self, n: usize) -> Result<()> {
        let n = int8_tokens_asked(Some(&n.to_string()))?;
        self.int8_tokens.store(n, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    pub fn int8_tokens(&self) -> usize {
        self.int8_tokens.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How a product of `w` with `x` runs as integers, if it does: Q4_K or Q6_K rows of whole
    /// super-blocks, activations auto or int8; up to [`Self::int8_tokens`] tokens with `dp4a`
    /// (`matvec_i8*`), more as tiles on the tensor cores (`mmq_*`) when they and the integer
    /// tiles are on.
    fn integer_path(&self, w: &Weight, x: &Act) -> Option<IntegerPath> {
        let integer = matches!(self.activations(), Activations::Int8 | Activations::Auto)
            && x.rows > 0
            && x.width == w.cols
            && INT8_TYPES.contains(&w.ty)
            && w.cols.is_multiple_of(256);
        if !integer {
            None
        } else if x.rows <= self.int8_tokens() {
            self.int8_seen.store(true, std::sync::atomic::Ordering::Relaxed);
            Some(IntegerPath::Dots)
        } else if self.mma() && self.mmq() {
            Some(IntegerPath::Tiles)
        } else {
            None
        }
    }

    /// `x` as the integer products' input: the Q8_K blocks (`Q8K_BLOCK_BYTES` per 256 values,
    /// token after token) the kernel that wrote `x` made (see [`FUSE_ENV`]), else a buffer of
    /// them made now (returned with it, to keep until the product is launched) — or, for one
    /// product (`one`) of one token with launches fused, the values, which that product
    /// quantizes itself.
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
        let blocks = x.rows * x.width / 256;
        if one && self.fuse() && x.rows == 1 && blocks <= I8F_MAX_BLOCKS {
            return (Int8Input::Values(self.buf(x)), None);
        }
        let out = self.act(1, blocks * Q8K_BLOCK_BYTES / 4);
        if blocks > 0 {
            let cfg = warp_per_block_cfg(blocks);
            self.k()
                .act_q8_k_blocks(cfg, self.buf(x), self.buf(&out), blocks as u64);
        }
        (Int8Input::Blocks(self.buf(&out)), Some(out))
    }

    /// The device address of `n` launch counters (`last_arrival` in kernels/ops.cu: a kernel
    /// whose last block to finish takes on the next step's work counts its blocks there and sets
    /// each counter back to zero; the launches that use them run one after another on the
    /// device's stream), zeroed when first made; 0 (none) past [`COUNTER_WORDS`] or when they
    /// could not be made.
    fn counters(&self, n: usize) -> u64 {
        if n == 0 || n > COUNTER_WORDS {
            return 0;
        }
        let mut c = self.counters.lock().expect("counters");
        if c.is_none() {
            // (Zeroed on the stream, before any launch recorded from now on runs.)
            *c = self.check(
                "allocating launch counters",
                self.stream.alloc_zeros::<u32>(COUNTER_WORDS),
            );
        }
        c.as_ref().map_or(0, |s| self.raw(s))
    }

    /// Launches so far whose last blocks did the next launch's work (RoPE, a residual add and
    /// norm, or the gated activation after one-token integer products; split attention's merge,
    /// and its output's Q8_K blocks, each counted; see [`FUSE_ENV`]).
    pub fn last_block_fusions(&self) -> u64 {
        self.last_block_fusions.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets whether the launches from now on are fused (see [`FUSE_ENV`]).
    pub fn set_fuse(&self, on: bool) {
        self.fuse.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn fuse(&self) -> bool {
        self.fuse.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets whether batched quantized products from now on run on the tensor cores (see
    /// [`MMA_ENV`]).
    pub fn set_mma(&self, on: bool) {
        self.mma.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn mma(&self) -> bool {
        self.mma.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets whether wider batches of Q4_K and Q6_K rows run as integer tiles from now on (see
    /// [`MMQ_ENV`]).
    pub fn set_mmq(&self, on: bool) {
        self.mmq.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn mmq(&self) -> bool {
        self.mmq.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets whether a prompt's attention runs in tiles of tokens from now on (see
    /// [`ATTN_TILES_ENV`]).
    pub fn set_attn_tiles(&self, on: bool) {
        self.attn_tiles.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn attn_tiles(&self) -> bool {
        self.attn_tiles.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets whether decode attention is split over positions from now on (see
    /// [`ATTN_SPLIT_ENV`]).
    pub fn set_attn_split(&self, on: bool) {
        self.attn_split.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn attn_split(&self) -> bool {
        self.attn_split.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether `x · w` runs on the tensor cores: several tokens, a block-quantized type (float
    /// weights keep the exact f32 products), whole 32-value units (the callers take the integer
    /// products first where they apply: [`Self::integer_path`]).
    fn mma_product(&self, w: &Weight, x: &Act) -> bool {
        x.rows > 1 && self.mma() && w.ty.block_elems() > 1 && w.cols.is_multiple_of(32)
    }

    /// `x` as the tensor-core products take it (`act_f16_rows`): its rows scaled by powers of
    /// two and split into two f16 each (high rows, low rows), then the rows' scales.
    fn f16_input(&self, x: &Act) -> Act {
        let out = self.act(1, x.rows * x.width + x.rows);
        let cfg = LaunchConfig {
            grid_dim: (x.rows as u32, 1, 1),
            block_dim: (MMA_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.k().act_f16_rows(cfg, self.buf(x), x.width, x.rows, self.buf(&out));
        out
    }

    /// Whether `a` carries the integer products' input blocks of its values (see [`FUSE_ENV`]).
    pub fn has_input_blocks(&self, a: &Act) -> bool {
        matches!(&a.data, ActData::Cuda(DevBuf { blocks: Some(_), .. }))
    }

    /// A buffer for the Q8_K blocks of an output `[rows, width]` its kernel writes too, when
    /// the integer products may take it (see [`FUSE_ENV`]); `None` otherwise.
    fn fused_blocks(&self, rows: usize, width: usize) -> Option<DevBuf> {
        let yes = self.fuse()
            && rows > 0
            && width > 0
            && width.is_multiple_of(256)
            && matches!(self.activations(), Activations::Int8 | Activations::Auto)
            && self.int8_seen.load(std::sync::atomic::Ordering::Relaxed);
        yes.then(|| self.alloc(rows * width / 256 * Q8K_BLOCK_BYTES / 4))
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

    /// Sets whether the integer tiles launched from now on load the next super-block ahead (see
    /// [`MMQ_PREFETCH_ENV`]).
    pub fn set_mmq_prefetch(&self, on: bool) {
        self.mmq_prefetch.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn mmq_prefetch(&self) -> bool {
        self.mmq_prefetch.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sets the warps per row of the integer products launched from now on (see
    /// [`I8_WPR_ENV`]): 1, 2, 4 or 8, or 0 for by the row's length (the default).
    pub fn set_i8_wpr(&self, wpr: usize) -> Result<()> {
        let n = i8_wpr_asked(Some(&wpr.to_string()).filter(|_| wpr != 0).map(|s| s.as_str()))?;
        self.i8_wpr.store(n, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// The warps per row the integer products of rows of `cols` values take (see
    /// [`I8_WPR_ENV`]).
    pub fn i8_wpr(&self, cols: usize) -> usize {
        match self.i8_wpr.load(std::sync::atomic::Ordering::Relaxed) {
            0 => i8_warps_per_row(cols),
            n => n,
        }
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
            self.k().act_q8(kernel, cfg, self.buf(x), self.buf(&out), blocks as u64);
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
            #[cfg(feature = "wgpu")]
            ActData::Wgpu(_) => {
                self.fail("CUDA: an activation of the wgpu device was handed to the CUDA device".into());
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
            // (Not between a one-token integer product and what may fuse into it next.)
            if g.split_due()
                && !matches!(
                    name,
                    "matvec_i8" | "matvec_i8f" | "matvec_i8x3" | "matvec_i8x3_mixed" | "matvec_i8n" | "matvec_i8nx3"
                )
            {
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
        // SAFETY: each kernel's parameters are the (u64 pointer / i32 / f32) values its typed
        // launcher passes, in order (`launch`, held to the source by its test), and every pointer
        // is a live device buffer of the size it reads.
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
        self.k().accumulate(
            w.ty,
            cfg,
            wd.ptr,
            w.row_stride_bytes as u64,
            joined_rows,
            idx,
            n_rows,
            w.cols,
            self.buf(acts),
            n,
            self.buf(&partial),
            tp,
            tstride,
            w.rows,
        );
        self.reduce_parts(Some(partial), out);
    }
}

/// A kernel argument as it is queued or recorded (made by the typed launchers, `launch`).
#[derive(Clone, Copy, Debug)]
enum Arg {
    U64(u64),
    I32(i32),
    F32(f32),
}

#[cfg(test)]
impl Arg {
    /// The value as a launcher's record gives it back (`words`): a pointer or count, an `int`
    /// (sign-extended), a float's bits.
    fn bits(self) -> u64 {
        match self {
            Arg::U64(v) => v,
            Arg::I32(v) => v as u64,
            Arg::F32(v) => u64::from(v.to_bits()),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The constants the host shares with `kernels/*.cu` equal the source's `#define`s.
    #[test]
    fn constants_shared_with_the_kernels_match_their_source() {
        let src = nvrtc::source();
        let defined = |name: &str| -> usize {
            let line = src
                .lines()
                .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
                .unwrap_or_else(|| panic!("kernels/ defines no {name}"));
            let value = line.split_whitespace().nth(2).unwrap_or_else(|| panic!("{line}"));
            value
                .parse()
                .unwrap_or_else(|_| panic!("{name}: {value} is not a number"))
        };
        assert_eq!(defined("MM_TOKENS"), MATMUL_TOKENS);
        assert_eq!(defined("MMA_BM"), MMA_ROWS);
        assert_eq!(defined("MMA_BN"), MMA_TOKENS);
        assert_eq!(defined("MMA_THREADS"), MMA_THREADS as usize);
        assert_eq!(defined("TOPK_MAX"), TOP_K_THREADS as usize);
        assert_eq!(defined("TOPK_MAX"), crate::backend::TOP_K_MAX);
        assert_eq!(defined("ATTN_MAX_HEAD_DIM"), ATTN_MAX_HEAD_DIM);
        assert_eq!(defined("ATTN_TILE_Q"), ATTN_TILE_TOKENS);
        assert_eq!(defined("ATTN_TILE_MAX_HD"), ATTN_TILE_MAX_HEAD_DIM);
        assert_eq!(defined("ATTN_SPLIT_WARPS"), ATTN_SPLIT_WARPS);
        assert_eq!(defined("ATTN_SPLIT_MAX"), ATTN_SPLIT_TARGET_BLOCKS);
        assert_eq!(defined("Q8K_BLOCK_BYTES"), Q8K_BLOCK_BYTES);
        for ty in INT8_TYPES {
            assert_eq!(
                defined(&format!("TY_{}", type_suffix(ty).to_uppercase())),
                i8_type_code(ty)
            );
        }
        assert_eq!(defined("I8F_MAX_BLOCKS"), I8F_MAX_BLOCKS);
        assert_eq!(defined("I8N_MAX"), I8N_MAX);
        assert_eq!(defined("ACT_SILU"), activation_code(FfnActivation::Silu));
        assert_eq!(defined("ACT_GELU_TANH"), activation_code(FfnActivation::GeluTanh));
    }

    /// Each type of [`CUDA_TYPES`] has its code, block layout (elements and bytes of a block, as
    /// the CPU reads it) and `decode_unit` in kernels/quant.cu, and its float families from the
    /// macros; every other type is refused with a message naming it.
    #[test]
    fn each_cuda_type_has_its_layout_and_decoder_in_the_source() {
        let src = nvrtc::source();
        let mut codes = Vec::new();
        for ty in CUDA_TYPES {
            let code = format!("TY_{}", type_suffix(ty).to_uppercase());
            let define = src
                .lines()
                .find(|l| l.split_whitespace().take(2).eq(["#define", code.as_str()]))
                .unwrap_or_else(|| panic!("kernels/ defines no {code}"));
            codes.push(define.split_whitespace().nth(2).unwrap().to_string());
            let layout = format!(
                "template <> struct Layout<{code}> {{ enum {{ BLOCK = {}, BYTES = {} }}; }};",
                ty.block_elems(),
                ty.block_bytes()
            );
            assert!(src.contains(&layout), "{ty:?}: no `{layout}` in kernels/");
            if ty.block_elems() > 1 {
                assert!(
                    src.contains(&format!("void decode_unit<{code}>(")),
                    "{ty:?}: no decode_unit"
                );
            }
            let suffix = type_suffix(ty);
            assert!(src.contains(&format!("QUANT_KERNELS({suffix}, {code})")), "{ty:?}");
            assert!(src.contains(&format!("MMA_KERNEL({suffix}, {code})")), "{ty:?}");
        }
        let distinct: std::collections::HashSet<_> = codes.iter().collect();
        assert_eq!(distinct.len(), codes.len(), "type codes repeat: {codes:?}");
        // The grid types only (IQ2_*, IQ3_*, IQ1_*).
        let refused: Vec<GgmlType> = GgmlType::ALL.into_iter().filter(|t| !computes_type(*t)).collect();
        assert_eq!(refused.len(), 7, "{refused:?}");
        assert!(refused
            .iter()
            .all(|t| t.name().starts_with("IQ") && t.block_elems() == 256));
        for ty in refused {
            let m = cpu_only_message("blk.0.ffn_up.weight", ty);
            let named = format!("blk.0.ffn_up.weight: {} is computed on the CPU only", ty.name());
            assert!(
                m.starts_with(&named) && m.contains("Q2_K, Q3_K, IQ4_XS") && m.ends_with("run with --device cpu"),
                "{m}"
            );
        }
    }

    #[test]
    fn every_kernel_name_is_defined_in_the_source() {
        let src = nvrtc::source();
        for name in kernel_names() {
            let (kind, suffix) = name.split_once('_').unwrap_or((&name, ""));
            // (After the launch bounds where a kernel has them.)
            let direct = src.contains(&format!("void {name}(")) || src.contains(&format!("void I8_ONE_BOUNDS {name}("));
            // The quantized kernels come from the QUANT_KERNELS macro.
            let by_macro = TYPED.contains(&kind)
                && src.contains(&format!("void {kind}_##NAME("))
                && (src.contains(&format!("QUANT_KERNELS({suffix},"))
                    || src.contains(&format!("MMA_KERNEL({suffix},")));
            // The integer products come from the MATVEC_I8_KERNELS, MATVEC_I8F_KERNELS and
            // MATVEC_I8X3_ACT_KERNEL macros.
            let int8 = [
                ("matvec_i8x3", "MATVEC_I8_KERNELS"),
                ("matvec_i8n", "MATVEC_I8_KERNELS"),
                ("mmq_plain", "MMQ_KERNEL"),
                ("mmq", "MMQ_KERNEL"),
                ("matvec_i8f", "MATVEC_I8F_KERNELS"),
                ("matvec_i8_norm", "MATVEC_I8F_KERNELS"),
                ("matvec_i8f_norm", "MATVEC_I8F_KERNELS"),
                ("matvec_i8n_norm", "MATVEC_I8F_KERNELS"),
                ("matvec_i8x3_act", "MATVEC_I8X3_ACT_KERNEL"),
                ("matvec_i8", "MATVEC_I8_KERNELS"),
            ]
            .iter()
            .any(|(family, mac)| {
                name.strip_prefix(&format!("{family}_"))
                    .is_some_and(|t| src.contains(&format!(" {family}_##t(")) && src.contains(&format!("{mac}({t},")))
            });
            assert!(direct || by_macro || int8, "{name} is not in kernels/");
        }
    }

    /// Split attention's Q8_K blocks of its output: groups of heads that fill whole blocks.
    #[test]
    fn attention_q8_groups_cover_whole_blocks_only() {
        // (heads, head size) → groups of heads filling whole Q8_K blocks
        assert_eq!(attention_q8_groups(12, 128), Some(6));
        assert_eq!(attention_q8_groups(8, 64), Some(2));
        assert_eq!(attention_q8_groups(32, 8), Some(1));
        assert_eq!(attention_q8_groups(1, 512), Some(1));
        assert_eq!(attention_q8_groups(4, 256), Some(4));
        assert_eq!(attention_q8_groups(4, 80), None);
        assert_eq!(attention_q8_groups(8, 96), None);
        assert_eq!(attention_q8_groups(3, 128), None);
        assert_eq!(attention_q8_groups(0, 128), None);
        assert_eq!(attention_q8_groups(4, 0), None);
    }

    /// Split attention: powers of two, at most ~256 blocks, splits of at least 64 positions,
    /// always at least one; the switch parsed by name.
    #[test]
    fn attention_splits_fill_the_target_without_short_splits() {
        // One decode token of a 12-head model: 8 splits of 32 would be under 64 positions.
        assert_eq!(attention_splits(256, 12), 4);
        assert_eq!(attention_splits(1024, 12), 16);
        assert_eq!(attention_splits(32768, 12), 16);
        // Eight sequences: 96 rows, two splits; 64 sequences: 768 rows, none.
        assert_eq!(attention_splits(1024, 96), 2);
        assert_eq!(attention_splits(1024, 768), 1);
        assert_eq!(attention_splits(256, 1), 4);
        assert_eq!(attention_splits(1 << 20, 1), 256);
        for (len, rows) in [(256, 0), (256, 1000), (512, 3), (4096, 7)] {
            let z = attention_splits(len, rows);
            assert!(z.is_power_of_two() && len.is_multiple_of(z));
            assert!(z == 1 || (len / z >= ATTN_SPLIT_MIN_POSITIONS && z * rows <= ATTN_SPLIT_TARGET_BLOCKS));
        }
        assert!(attn_split_asked(None).unwrap());
        assert!(!attn_split_asked(Some("0")).unwrap());
        assert!(attn_split_asked(Some("2"))
            .unwrap_err()
            .to_string()
            .contains(ATTN_SPLIT_ENV));
    }

    /// Tiles are runs of one sequence at consecutive positions, at most 16 tokens, in order.
    #[test]
    fn attention_tiles_split_at_sequences_gaps_and_sixteen() {
        // 20 tokens of sequence 0 from 5, a decode token of 1, 3 of 2, a gap in 2, 2 of 0 again.
        let mut pos: Vec<usize> = (5..25).collect();
        let mut seq = vec![0; 20];
        pos.extend([9, 0, 1, 2, 7, 25, 26]);
        seq.extend([1, 2, 2, 2, 2, 0, 0]);
        assert_eq!(
            attention_tiles(&pos, &seq),
            vec![(0, 16), (16, 4), (20, 1), (21, 3), (24, 1), (25, 2)]
        );
        assert!(attention_tiles(&[], &[]).is_empty());
        assert!(attn_tiles_asked(None).unwrap());
        assert!(!attn_tiles_asked(Some("off")).unwrap());
        assert!(!mmq_asked(Some("0")).unwrap());
        assert!(!mmq_prefetch_asked(None).unwrap() && mmq_prefetch_asked(Some("on")).unwrap());
        assert!(mmq_prefetch_asked(Some("2"))
            .unwrap_err()
            .to_string()
            .contains(MMQ_PREFETCH_ENV));
        assert!(mmq_asked(Some("f16")).unwrap_err().to_string().contains(MMQ_ENV));
    }

    #[test]
    fn activation_mode_is_auto_unless_asked() {
        assert_eq!(activations_asked(None).unwrap(), Activations::Auto);
        assert_eq!(activations_asked(Some("")).unwrap(), Activations::Auto);
        assert_eq!(activations_asked(Some("auto")).unwrap(), Activations::Auto);
        assert_eq!(activations_asked(Some("f32")).unwrap(), Activations::F32);
        assert_eq!(activations_asked(Some(" q8 ")).unwrap(), Activations::Q8);
        assert_eq!(activations_asked(Some("int8")).unwrap(), Activations::Int8);
        assert_eq!(int8_tokens_asked(None).unwrap(), I8N_MAX);
        assert_eq!(int8_tokens_asked(Some(" 1")).unwrap(), 1);
        for bad in ["0", "9", "many"] {
            let e = int8_tokens_asked(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(INT8_TOKENS_ENV) && e.contains("1 to 8"), "{e}");
        }
        assert_eq!(i8_wpr_asked(None).unwrap(), 0);
        assert_eq!(i8_wpr_asked(Some("auto")).unwrap(), 0);
        assert_eq!(i8_wpr_asked(Some(" 8")).unwrap(), 8);
        for bad in ["0", "3", "16", "wide"] {
            let e = i8_wpr_asked(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(I8_WPR_ENV) && e.contains("1, 2, 4 or 8"), "{e}");
        }
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
    fn fused_launches_are_off_unless_asked_for() {
        assert!(!fuse_asked(None).unwrap());
        assert!(fuse_asked(Some("on")).unwrap());
        assert!(!fuse_asked(Some(" 0")).unwrap());
        let e = fuse_asked(Some("no")).unwrap_err().to_string();
        assert!(e.contains("GATESTREAM_CUDA_FUSE=no") && e.contains("or 1"), "{e}");
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
