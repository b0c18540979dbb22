//! The portable GPU device (`--device wgpu`, cargo feature `wgpu`): the layer program's
//! operations as WGSL compute shaders (kernels/wgsl/, one file per op family) run through wgpu,
//! on Vulkan (Linux, Windows; Mesa's software `lavapipe` in CI), Metal (macOS) or DX12.
//!
//! Activations live in device buffers ([`WgpuBuf`]). Resident weights are copied once, as the
//! host's bytes (still quantized), and kept by the address of those bytes; streamed (volatile)
//! weights are copied at each use. The product kernels decode each element from the weight's
//! bytes (read as u32 words) and sum in f32: one token or a tile of 8 tokens per workgroup,
//! each element decoded once per tile. RoPE's angles come from a table the host computes as
//! the CPU does (so frequency factors and partial RoPE cost nothing more); attention reads the
//! cache of each sequence with an online softmax (any context length, sliding windows, grouped
//! heads, sinks). Types without a decoder here ([`WGPU_TYPES`] lists those with one) are
//! refused at load, as is latent attention. Operations are recorded into one command buffer,
//! submitted every few hundred and wherever the host reads values back (the only waits).
//!
//! Errors: an operation that cannot run (a weight larger than the adapter's largest buffer, a
//! weight not in memory, a wgpu validation or out-of-memory error) is recorded, and the pass
//! returns it ([`Device::take_error`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use wgpu::util::DeviceExt;

use super::ops::rope_table;
use super::{Act, ActData, AttnShape, Device, HostLink, LinkBandwidth, LinkCounters, RopeShape, TopRows, TOP_K_MAX};
use crate::config::{FfnActivation, RopeStyle};
use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::quant::{dequantize_row, GgmlType};
use crate::tensor::Weight;

/// The weight types the device's product kernels decode (kernels/wgsl/quant.wgsl); a model
/// holding a matrix of any other type is refused at load.
pub const WGPU_TYPES: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

/// The type's code in quant.wgsl (`TYPE`).
fn type_code(ty: GgmlType) -> Option<u32> {
    WGPU_TYPES.iter().position(|&t| t == ty).map(|i| i as u32)
}

/// Why a matrix of `ty` is refused (at load, or by a product asked directly).
pub fn refused_type_message(tensor: &str, ty: GgmlType) -> String {
    format!(
        "{tensor}: {} is computed on the CPU only (the wgpu device has kernels for {}); run with --device cpu",
        ty.name(),
        WGPU_TYPES.map(GgmlType::name).join(", ")
    )
}

const QUANT_WGSL: &str = include_str!("../../kernels/wgsl/quant.wgsl");
const OPS_WGSL: &str = include_str!("../../kernels/wgsl/ops.wgsl");
const NORMS_WGSL: &str = include_str!("../../kernels/wgsl/norms.wgsl");
const ROPE_WGSL: &str = include_str!("../../kernels/wgsl/rope.wgsl");
const ATTENTION_WGSL: &str = include_str!("../../kernels/wgsl/attention.wgsl");
const TOPK_WGSL: &str = include_str!("../../kernels/wgsl/topk.wgsl");

/// A shader module: one of the op families, or the products for one weight type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Module {
    Quant(u32),
    Ops,
    Norms,
    Rope,
    Attention,
    TopK,
}

impl Module {
    fn source(self) -> Cow<'static, str> {
        match self {
            Module::Quant(code) => Cow::Owned(format!("const TYPE: u32 = {code}u;\n{QUANT_WGSL}")),
            Module::Ops => Cow::Borrowed(OPS_WGSL),
            Module::Norms => Cow::Borrowed(NORMS_WGSL),
            Module::Rope => Cow::Borrowed(ROPE_WGSL),
            Module::Attention => Cow::Borrowed(ATTENTION_WGSL),
            Module::TopK => Cow::Borrowed(TOPK_WGSL),
        }
    }
}

/// Activations on the device: `[rows, width]` f32 values (the buffer may be larger).
pub struct WgpuBuf(wgpu::Buffer);

/// A layer's keys and values on the device, per layer, for a cache's capacity.
struct WgpuKv {
    device: u64,
    k: Vec<wgpu::Buffer>,
    /// None for latent attention: its values are the keys' first numbers, read from `k`.
    v: Option<Vec<wgpu::Buffer>>,
}

/// Rows `first..first + rows` of a weight in one device buffer (a weight larger than the
/// adapter binds at once is in several).
#[derive(Clone)]
struct Part {
    buf: wgpu::Buffer,
    first: usize,
    rows: usize,
}

/// A resident weight's copy and the host storage its key's address belongs to (kept alive so
/// the address is not reused by other bytes while the copy is kept).
struct Resident {
    parts: Vec<Part>,
    _keep: Arc<dyn std::any::Any + Send + Sync>,
}

/// Commands recorded before they are submitted without a wait.
const RECORDED_MAX: usize = 256;

/// Largest workgroup grid side (WebGPU's limit on each dimension).
const GRID_SIDE: u32 = 65535;

/// Tokens a product's workgroup multiplies together (`TILE` in quant.wgsl).
const TILE: usize = 8;

/// Widest head the attention kernel keeps (10 values a thread, 64 threads): DeepSeek's latent
/// heads are 576.
const MAX_HEAD_DIM: usize = 640;

/// Widest head the RoPE kernel keeps in workgroup memory.
const MAX_ROPE_HEAD: usize = 1024;

/// Loop iterations one shader invocation may run on a software adapter. Mesa's lavapipe
/// (gallivm) bounds every invocation's loops, all of them together, to 65535 iterations
/// (`LP_MAX_TGSI_LOOP_ITERATIONS`) and past that ends them early, without an error: a kernel
/// whose thread loops longer computes a partial result. The one-thread-a-row product over
/// Qwen2.5-1.5B's FFN (8960 columns, a tile of 8 tokens: 80640 iterations) did, and gave wrong
/// logits from 6 tokens on. Kernels are launched so that no invocation passes this (with room
/// for the loops not counted here).
const LOOP_BUDGET: usize = 60_000;

/// Loop iterations of one `matmul_thread` invocation: each element of the row times the tile's
/// tokens, then the 64 partial sums added in a tree (an upper bound).
fn matmul_thread_loops(cols: usize, tokens: usize) -> usize {
    (cols + 64) * (tokens.min(TILE) + 2)
}

/// Loop iterations of one `matmul_q8_thread` invocation: per chunk of 32 elements, its eight
/// words unpacked (table types: four lookups each) and each token's four dot steps; then the
/// tree (an upper bound).
fn matmul_q8_thread_loops(cols: usize, tokens: usize) -> usize {
    let nt = tokens.min(TILE);
    (cols / 32) * (48 + 6 * nt) + 64 * (nt + 2)
}

/// Loop iterations of one thread a row's product: packed or f32.
fn thread_loops(packed: bool, cols: usize, tokens: usize) -> usize {
    match packed {
        true => matmul_q8_thread_loops(cols, tokens),
        false => matmul_thread_loops(cols, tokens),
    }
}

/// Positions one attention workgroup takes: a (token, head) whose span is longer is split over
/// several (`attention_part`, then `attention_join`). A decoding token's heads alone are too few
/// workgroups to fill a GPU over a long context, and a software adapter's thread loops over
/// 1024 positions within its budget (heads of 640: 24448 iterations).
const ATTENTION_CHUNK: usize = 1024;

/// Loop iterations of one `attention_join` invocation over `splits` partials (an upper bound).
fn join_loops(splits: usize) -> usize {
    splits * 8 + 16
}

/// Loop iterations of one `attention` invocation over `positions` cached positions: per tile of
/// 64 positions, the query's dot product with a key, the tile's maximum and the value sums (an
/// upper bound).
fn attention_loops(head_dim: usize, positions: usize) -> usize {
    positions.div_ceil(64) * (head_dim + 64 * 13 + 16) + head_dim
}

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub struct WgpuDevice {
    id: u64,
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    pipelines: Mutex<HashMap<(Module, &'static str), wgpu::ComputePipeline>>,
    weights: Mutex<HashMap<(usize, usize, usize), Resident>>,
    error: Arc<Mutex<Option<String>>>,
    link: Mutex<LinkCounters>,
    /// Commands recorded and not yet submitted, and how many.
    pending: Mutex<Option<(wgpu::CommandEncoder, usize)>>,
    /// The most bytes of a weight one buffer holds: the adapter's largest storage binding, or
    /// less for tests ([`WgpuDevice::set_max_binding`]).
    max_binding: std::sync::atomic::AtomicU64,
    /// Products one thread a row (`matmul_thread`: software adapters) or one workgroup a row
    /// (`matmul`: GPUs). See [`WgpuDevice::set_row_per_thread`].
    row_per_thread: std::sync::atomic::AtomicBool,
    /// Bound where a kernel's buffer is unused this launch (no ids, no norm, no sinks).
    empty: wgpu::Buffer,
    /// Positions one attention workgroup takes ([`ATTENTION_CHUNK`], or fewer for tests:
    /// [`WgpuDevice::set_attention_chunk`]).
    attention_chunk: std::sync::atomic::AtomicUsize,
    /// Products of quantized weights on packed 8-bit activations (`matmul_q8`: where WGSL has
    /// `dot4I8Packed`) or on the activations decoded back to f32 (`matmul`). See
    /// [`WgpuDevice::set_packed_dots`].
    packed_dots: std::sync::atomic::AtomicBool,
    /// Whether this WGSL has `dot4I8Packed` at all.
    packed_available: bool,
}

/// How [`WgpuDevice::prepared`] left the activations for a product.
enum Prepared {
    /// Decoded back to f32 (the `matmul` kernels).
    Decoded(wgpu::Buffer),
    /// Packed 8-bit quants, scales and sums (the `matmul_q8` kernels).
    Packed(wgpu::Buffer),
}

/// Whether an adapter can run at all, and the reason when not: the adapters wgpu found here.
fn no_adapter_message(e: &dyn std::fmt::Display) -> String {
    format!(
        "wgpu: no GPU adapter found ({e}). On Linux the device runs on Vulkan: install a Vulkan driver \
         (Debian/Ubuntu: apt-get install mesa-vulkan-drivers libvulkan1, which includes the software \
         lavapipe); on macOS it runs on Metal. Use --device cpu to run on the CPU"
    )
}

impl WgpuDevice {
    /// Opens the first adapter wgpu prefers (a discrete GPU before an integrated one before a
    /// software one), with the adapter's own limits (the largest buffers it allows).
    pub fn open() -> Result<WgpuDevice> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
        desc.flags = wgpu::InstanceFlags::empty();
        let instance = wgpu::Instance::new(desc);
        let packed_available = instance
            .wgsl_language_features()
            .contains(wgpu::WgslLanguageFeatures::Packed4x8IntegerDotProduct);
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            force_fallback_adapter: false,
            compatible_surface: None,
            apply_limit_buckets: false,
        }))
        .map_err(|e| Error::Device(no_adapter_message(&e)))?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("gatestream"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| Error::Device(format!("wgpu: adapter {} refused a device: {e}", info.name)))?;
        let error = Arc::new(Mutex::new(None::<String>));
        let sink = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = sink.lock().expect("error");
            if slot.is_none() {
                *slot = Some(format!("wgpu: {e}"));
            }
        }));
        let empty = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("unused binding"),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        Ok(WgpuDevice {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            device,
            queue,
            info: info.clone(),
            limits: limits.clone(),
            pipelines: Mutex::new(HashMap::new()),
            weights: Mutex::new(HashMap::new()),
            error,
            link: Mutex::new(LinkCounters::default()),
            pending: Mutex::new(None),
            max_binding: std::sync::atomic::AtomicU64::new(
                limits
                    .max_storage_buffer_binding_size
                    .min(limits.max_buffer_size)
                    .min(u32::MAX as u64),
            ),
            row_per_thread: std::sync::atomic::AtomicBool::new(info.device_type == wgpu::DeviceType::Cpu),
            empty,
            attention_chunk: std::sync::atomic::AtomicUsize::new(ATTENTION_CHUNK),
            packed_dots: std::sync::atomic::AtomicBool::new(packed_available),
            packed_available,
        })
    }

    /// The adapter: its name, backend (Vulkan, Metal, DX12) and kind (a CPU adapter is a
    /// software renderer such as lavapipe).
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    /// Whether products run one thread a row (`true`: the default on a software adapter, where
    /// barriers are dear) or one workgroup a row (`false`: the default on a GPU). The suite checks
    /// both kernels on whatever adapter it has.
    pub fn set_row_per_thread(&self, on: bool) {
        self.row_per_thread.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Splits weights larger than `bytes` into buffers of whole rows (the adapter's own limit
    /// when `None`), as weights larger than the adapter binds are: lets the suite check split
    /// products on small weights. Weights already copied keep their buffers.
    pub fn set_max_binding(&self, bytes: Option<u64>) {
        let adapter = self
            .limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
            .min(u32::MAX as u64);
        let v = bytes.map_or(adapter, |b| b.min(adapter));
        self.max_binding.store(v, std::sync::atomic::Ordering::Relaxed);
    }

    /// Splits attention spans longer than `positions` over several workgroups
    /// ([`ATTENTION_CHUNK`] when `None`): lets the suite check split attention on short ones.
    pub fn set_attention_chunk(&self, positions: Option<usize>) {
        let v = positions.map_or(ATTENTION_CHUNK, |n| n.clamp(1, ATTENTION_CHUNK));
        self.attention_chunk.store(v, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether products of quantized weights take the activations as packed 8-bit quants and
    /// sum four byte products a `dot4I8Packed` (`true`: the default where WGSL has it; a GPU
    /// with integer dot products runs it as one instruction, others as the shader compiler's
    /// own four multiplies) or decode the quants back to f32 and multiply in f32 (`false`).
    /// Both multiply the same 8-bit activations the CPU's integer products do; the suite checks
    /// both on whatever adapter it has. Asking for packed products where WGSL lacks them leaves
    /// them off.
    pub fn set_packed_dots(&self, on: bool) {
        self.packed_dots
            .store(on && self.packed_available, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn packed_dots(&self) -> bool {
        self.packed_dots.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The widest row (columns, a multiple of 256) one thread a row multiplies for a batch of
    /// `tokens` on a software adapter, on the products [`WgpuDevice::packed_dots`] picks: wider
    /// rows go to one workgroup a row, within the adapter's loop budget ([`LOOP_BUDGET`]). Lets
    /// the suite check the widest rows a thread takes.
    pub fn widest_thread_row(&self, tokens: usize) -> usize {
        let mut cols = 256;
        while thread_loops(self.packed_dots(), cols + 256, tokens) <= LOOP_BUDGET {
            cols += 256;
        }
        cols
    }

    pub fn row_per_thread(&self) -> bool {
        self.row_per_thread.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the adapter is a software renderer (lavapipe, WARP): the kernels run on the CPU.
    pub fn software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    fn fail(&self, msg: String) {
        let mut e = self.error.lock().expect("error");
        if e.is_none() {
            *e = Some(msg);
        }
    }

    fn failed(&self) -> bool {
        self.error.lock().expect("error").is_some()
    }

    fn pipeline(&self, module: Module, entry: &'static str) -> wgpu::ComputePipeline {
        let mut pipes = self.pipelines.lock().expect("pipelines");
        if let Some(p) = pipes.get(&(module, entry)) {
            return p.clone();
        }
        let m = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(entry),
            source: wgpu::ShaderSource::Wgsl(module.source()),
        });
        let p = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout: None,
            module: &m,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        });
        pipes.insert((module, entry), p.clone());
        p
    }

    /// A grid of `groups` workgroups: `(x, y)`, x at most [`GRID_SIDE`] (kernels index
    /// `wg.x + wg.y * x`).
    fn grid(groups: usize) -> (u32, u32) {
        let x = groups.clamp(1, GRID_SIDE as usize);
        (x as u32, groups.div_ceil(x).max(1) as u32)
    }

    /// One kernel launch over `groups` workgroups: `params` (u32 words; floats as bits) are
    /// bound at `param_binding`, `binds` at theirs.
    fn launch(
        &self,
        module: Module,
        entry: &'static str,
        binds: &[(u32, &wgpu::Buffer)],
        (param_binding, params): (u32, &[u32]),
        grid: (u32, u32),
    ) {
        if self.failed() {
            return;
        }
        if grid.1 > GRID_SIDE {
            self.fail(format!(
                "wgpu: {entry}: {} x {} workgroups is past the grid's limit",
                grid.0, grid.1
            ));
            return;
        }
        let pipeline = self.pipeline(module, entry);
        let mut words = params.to_vec();
        words.resize(params.len().div_ceil(4) * 4, 0);
        let uniform = self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("params"),
            contents: &words_bytes(&words),
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let mut entries: Vec<wgpu::BindGroupEntry> = binds
            .iter()
            .map(|&(binding, buf)| wgpu::BindGroupEntry {
                binding,
                resource: buf.as_entire_binding(),
            })
            .collect();
        entries.push(wgpu::BindGroupEntry {
            binding: param_binding,
            resource: uniform.as_entire_binding(),
        });
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(entry),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        self.record(|enc| {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(entry),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(grid.0, grid.1, 1);
        });
    }

    /// Records work into the pending command buffer (submitted every [`RECORDED_MAX`] commands
    /// and wherever the host waits: one submission per few hundred launches, not one each).
    fn record(&self, f: impl FnOnce(&mut wgpu::CommandEncoder)) {
        let mut pending = self.pending.lock().expect("pending commands");
        let (enc, n) = pending.get_or_insert_with(|| {
            let enc = self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("gatestream"),
            });
            (enc, 0)
        });
        f(enc);
        *n += 1;
        if *n >= RECORDED_MAX {
            let (enc, _) = pending.take().expect("pending commands");
            self.queue.submit([enc.finish()]);
        }
    }

    /// Submits what is recorded.
    fn flush(&self) {
        if let Some((enc, _)) = self.pending.lock().expect("pending commands").take() {
            self.queue.submit([enc.finish()]);
        }
    }

    /// A new device buffer of `values` (activations, ids, tables).
    fn buffer_of(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        let padded;
        let contents = if bytes.len() < 16 {
            padded = {
                let mut v = bytes.to_vec();
                v.resize(16, 0);
                v
            };
            &padded[..]
        } else {
            bytes
        };
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        })
    }

    fn f32_buffer(&self, label: &str, values: &[f32]) -> wgpu::Buffer {
        self.buffer_of(label, &f32_bytes(values))
    }

    fn u32_buffer(&self, label: &str, values: &[u32]) -> wgpu::Buffer {
        self.buffer_of(label, &words_bytes(values))
    }

    /// A zeroed buffer of `len` f32 values (wgpu zeroes new buffers).
    fn zeroed(&self, len: usize) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("activations"),
            size: (len.max(4) * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    fn act(&self, rows: usize, width: usize, buf: wgpu::Buffer) -> Act {
        Act {
            rows,
            width,
            data: ActData::Wgpu(WgpuBuf(buf)),
        }
    }

    /// Bytes of `buf` read back to the host (waits for the work queued before).
    fn read_back(&self, buf: &wgpu::Buffer, bytes: usize) -> Vec<u8> {
        if bytes == 0 || self.failed() {
            return vec![0; bytes];
        }
        let size = (bytes as u64).div_ceil(4) * 4;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read back"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.record(|enc| enc.copy_buffer_to_buffer(buf, 0, &staging, 0, size));
        self.flush();
        let slice = staging.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        if let Err(e) = self.device.poll(wgpu::PollType::wait_indefinitely()) {
            self.fail(format!("wgpu: waiting for the device: {e}"));
            return vec![0; bytes];
        }
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                self.fail(format!("wgpu: reading values back: {e}"));
                return vec![0; bytes];
            }
            Err(_) => {
                self.fail("wgpu: reading values back: the map was dropped".into());
                return vec![0; bytes];
            }
        }
        let out = match slice.get_mapped_range() {
            Ok(view) => view[..bytes].to_vec(),
            Err(e) => {
                self.fail(format!("wgpu: reading values back: {e}"));
                return vec![0; bytes];
            }
        };
        staging.unmap();
        self.link.lock().expect("link counters").to_host_bytes += bytes as u64;
        out
    }

    fn read_f32(&self, buf: &wgpu::Buffer, len: usize) -> Vec<f32> {
        self.read_back(buf, len * 4)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// A weight's bytes on the device (copied on first use and kept by address; a volatile
    /// weight's at each use), and the code of its decoder.
    fn weight(&self, w: &Weight) -> Option<(Vec<Part>, u32)> {
        let Some(code) = type_code(w.ty) else {
            self.fail(refused_type_message(&w.name, w.ty));
            return None;
        };
        let Some((bytes, keep)) = w.span() else {
            self.fail(format!(
                "{}: its bytes are on disk, not read into memory by the stream (a bug: streamed weights reach the \
                 device as the stream's buffers)",
                w.name
            ));
            return None;
        };
        // Rows per buffer: all, or as many as the adapter binds at once (a large embedding).
        let max = self.max_binding.load(std::sync::atomic::Ordering::Relaxed) as usize;
        let stride = w.row_stride_bytes.max(1);
        let per_part = match bytes.len() <= max {
            true => w.rows.max(1),
            false => max.saturating_sub(w.row_bytes) / stride + 1,
        };
        if bytes.len() > max && (w.row_bytes > max || per_part == 0) {
            self.fail(format!(
                "{}: a row of {} bytes is more than the largest buffer the wgpu adapter {} binds ({max} bytes); run \
                 with --device cpu",
                w.name, w.row_bytes, self.info.name
            ));
            return None;
        }
        let upload = |what: &str, first: usize, rows: usize| {
            let t0 = std::time::Instant::now();
            let from = first * stride;
            let to = match rows {
                0 => from,
                n => (first + n - 1) * stride + w.row_bytes,
            };
            let part = &bytes[from..to];
            let mut padded;
            let contents = if part.len() % 4 != 0 || part.len() < 16 {
                padded = part.to_vec();
                padded.resize(part.len().div_ceil(4).max(4) * 4, 0);
                &padded[..]
            } else {
                part
            };
            let buf = self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(what),
                contents,
                usage: wgpu::BufferUsages::STORAGE,
            });
            let mut link = self.link.lock().expect("link counters");
            link.copy_ns += t0.elapsed().as_nanos() as u64;
            if w.is_volatile() {
                link.volatile_bytes += part.len() as u64;
                link.volatile_copies += 1;
            } else {
                link.resident_bytes += part.len() as u64;
            }
            Part { buf, first, rows }
        };
        let parts = |what: &str| -> Vec<Part> {
            (0..w.rows.max(1))
                .step_by(per_part)
                .map(|first| upload(what, first, per_part.min(w.rows - first.min(w.rows))))
                .collect()
        };
        if w.is_volatile() {
            return Some((parts("streamed weight"), code));
        }
        let key = (bytes.as_ptr() as usize, bytes.len(), w.row_stride_bytes);
        let mut cache = self.weights.lock().expect("weights");
        if let Some(r) = cache.get(&key) {
            return Some((r.parts.clone(), code));
        }
        let made = parts(&w.name);
        cache.insert(
            key,
            Resident {
                parts: made.clone(),
                _keep: keep,
            },
        );
        Some((made, code))
    }

    /// `u32` for a shader's index arithmetic, or a recorded error naming what is too large.
    fn fits(&self, what: &str, n: usize) -> Option<u32> {
        match u32::try_from(n) {
            Ok(v) => Some(v),
            Err(_) => {
                self.fail(format!("wgpu: {what}: {n} is past the kernels' 32-bit indices"));
                None
            }
        }
    }

    /// `x`'s values as the CPU prepares them for products with weights of `ty` (8-bit blocks
    /// for the quantized types, packed or decoded back; the values themselves for F32, F16,
    /// BF16), so the products multiply what the CPU's multiply. `None`: `x` as it is.
    fn prepared(&self, x: &Act, ty: GgmlType) -> Option<Prepared> {
        let m = ty.block_elems();
        if m == 1 || x.rows * x.width == 0 {
            return None;
        }
        if !x.width.is_multiple_of(m) {
            self.fail(format!(
                "wgpu: activations of {} are not whole {} blocks",
                x.width,
                ty.name()
            ));
            return None;
        }
        let n = x.rows * x.width;
        let blocks = n / m;
        let grid = Self::grid(blocks.div_ceil(256));
        let params = [blocks as u32, x.width as u32, m as u32, grid.0, 0, 0, 0, 0];
        if self.packed_dots() {
            // Quants four to a word, a scale a block, a sum each 16 quants.
            let out = self.zeroed(n / 4 + blocks + n / 16);
            self.launch(
                Module::Ops,
                "quantize_q8_packed",
                &[(1, buf(x)), (6, &out)],
                (3, &params),
                grid,
            );
            return Some(Prepared::Packed(out));
        }
        let out = self.zeroed(n);
        self.launch(
            Module::Ops,
            "quantize_q8",
            &[(1, buf(x)), (4, &out)],
            (3, &params),
            grid,
        );
        Some(Prepared::Decoded(out))
    }

    /// `x` (`[n, x.width]`) times `w`'s rows (`ids`, or all), into `[n, rows]`; `xq`: `x` as
    /// [`WgpuDevice::prepared`] made it for `w`'s type.
    fn product(&self, w: &Weight, ids: Option<&[u32]>, x: &Act, xq: Option<&Prepared>) -> Act {
        let rows = ids.map_or(w.rows, <[u32]>::len);
        let out = self.zeroed(x.rows * rows);
        if x.rows == 0 || rows == 0 || x.width != w.cols {
            if x.width != w.cols {
                self.fail(format!(
                    "{}: {} columns times an activation of {}",
                    w.name, w.cols, x.width
                ));
            }
            return self.act(x.rows, rows, out);
        }
        let Some((parts, code)) = self.weight(w) else {
            return self.act(x.rows, rows, out);
        };
        if ids.is_some() && parts.len() > 1 {
            self.fail(split_refusal(w, parts.len()));
            return self.act(x.rows, rows, out);
        }
        let id_buf = ids.map(|ids| self.u32_buffer("row ids", ids));
        // On a software adapter a row too wide for one thread's loop budget is multiplied by a
        // workgroup (the same sums in the same order: the same bits).
        let packed = matches!(xq, Some(Prepared::Packed(_)));
        let per_thread = self.row_per_thread.load(std::sync::atomic::Ordering::Relaxed)
            && thread_loops(packed, w.cols, x.rows) <= LOOP_BUDGET;
        let (entry, rows_a_group) = match (packed, per_thread) {
            (false, true) => ("matmul_thread", 64),
            (false, false) => ("matmul", 1),
            (true, true) => ("matmul_q8_thread", 64),
            (true, false) => ("matmul_q8", 1),
        };
        for part in &parts {
            // Rows of this buffer: the listed ones (one buffer), or the part's own.
            let part_rows = if ids.is_some() { rows } else { part.rows };
            let row_groups = part_rows.div_ceil(rows_a_group);
            let grid = Self::grid(row_groups * x.rows.div_ceil(TILE));
            let (Some(r), Some(c), Some(n), Some(s), Some(all), Some(off)) = (
                self.fits("rows", part_rows),
                self.fits("columns", w.cols),
                self.fits("tokens", x.rows),
                self.fits("row stride", w.row_stride_bytes),
                self.fits("rows", rows),
                self.fits("rows", part.first),
            ) else {
                return self.act(x.rows, rows, out);
            };
            self.launch(
                Module::Quant(code),
                entry,
                &[
                    (0, &part.buf),
                    match xq {
                        Some(Prepared::Packed(b)) => (5, b),
                        Some(Prepared::Decoded(b)) => (1, b),
                        None => (1, buf(x)),
                    },
                    (2, &out),
                    (3, id_buf.as_ref().unwrap_or(&self.empty)),
                ],
                (4, &[r, c, n, s, ids.is_some() as u32, grid.0, 0, 0, all, off, 0, 0]),
                grid,
            );
        }
        self.act(x.rows, rows, out)
    }

    /// `n` values of `x` through an elementwise kernel (`x` read and written, `y` read).
    fn elementwise(
        &self,
        entry: &'static str,
        x: &wgpu::Buffer,
        y: Option<&wgpu::Buffer>,
        n: usize,
        width: usize,
        f: f32,
    ) {
        if n == 0 {
            return;
        }
        let grid = Self::grid(n.div_ceil(256));
        let mut binds = vec![(0, x)];
        if let Some(y) = y {
            binds.push((1, y));
        }
        self.launch(
            Module::Ops,
            entry,
            &binds,
            (3, &[n as u32, width as u32, 0, grid.0, f.to_bits(), 0, 0, 0]),
            grid,
        );
    }

    /// A move kernel (select_rows, scatter_cols, gather_cols): `out` from `y` by `ids`.
    fn moved(
        &self,
        entry: &'static str,
        y: &Act,
        ids: &[u32],
        (n, width, m): (usize, usize, usize),
        out: &wgpu::Buffer,
    ) {
        if n == 0 {
            return;
        }
        let id_buf = self.u32_buffer("ids", ids);
        let grid = Self::grid(n.div_ceil(256));
        self.launch(
            Module::Ops,
            entry,
            &[(1, buf(y)), (2, &id_buf), (4, out)],
            (3, &[n as u32, width as u32, m as u32, grid.0, 0, 0, 0, 0]),
            grid,
        );
    }

    fn norm(&self, entry: &'static str, x: &Act, w: &[f32], eps: f32, out: Option<&wgpu::Buffer>) {
        if x.rows == 0 {
            return;
        }
        if w.len() != x.width {
            self.fail(format!("wgpu: a norm of {} values over rows of {}", w.len(), x.width));
            return;
        }
        let wb = self.f32_buffer("norm weights", w);
        let grid = Self::grid(x.rows);
        let mut binds = vec![(0, buf(x)), (1, &wb)];
        if let Some(o) = out {
            binds.push((3, o));
        }
        self.launch(
            Module::Norms,
            entry,
            &binds,
            (2, &[x.rows as u32, x.width as u32, grid.0, eps.to_bits()]),
            grid,
        );
    }

    /// RoPE (and the per-head norm) over every head of `x`, rows at `positions`.
    fn rope_heads(&self, x: &Act, table: &wgpu::Buffer, shape: &RopeShape, norm: Option<&[f32]>, eps: f32) {
        if x.rows == 0 {
            return;
        }
        let hd = shape.head_dim;
        if hd == 0 || !x.width.is_multiple_of(hd) || hd > MAX_ROPE_HEAD {
            self.fail(format!(
                "wgpu: RoPE over heads of {hd} in rows of {} (at most {MAX_ROPE_HEAD})",
                x.width
            ));
            return;
        }
        let nb = norm.map(|n| self.f32_buffer("head norm", n));
        let grid = Self::grid(x.rows * (x.width / hd));
        let rd = shape.rope_dims.min(hd);
        self.launch(
            Module::Rope,
            "rope",
            &[(0, buf(x)), (1, table), (2, nb.as_ref().unwrap_or(&self.empty))],
            (
                3,
                &[
                    x.rows as u32,
                    x.width as u32,
                    hd as u32,
                    rd as u32,
                    (shape.style == RopeStyle::HalfSplit) as u32,
                    norm.is_some() as u32,
                    grid.0,
                    eps.to_bits(),
                ],
            ),
            grid,
        );
    }

    /// The cache's buffers on this device (made on first use).
    fn kv<'a>(&self, cache: &'a mut KvCache) -> &'a WgpuKv {
        let mine =
            matches!(cache.device.as_ref().and_then(|d| d.downcast_ref::<WgpuKv>()), Some(kv) if kv.device == self.id);
        if !mine {
            let bytes = (cache.capacity * cache.kv_dim).max(4) as u64 * 4;
            let make = |label: &str| {
                (0..cache.k.len())
                    .map(|_| {
                        self.device.create_buffer(&wgpu::BufferDescriptor {
                            label: Some(label),
                            size: bytes,
                            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                            mapped_at_creation: false,
                        })
                    })
                    .collect::<Vec<_>>()
            };
            // (Latent attention's host cache has no values: nor has the device's.)
            let latent = cache.v.first().is_some_and(|v| v.is_empty());
            let kv = WgpuKv {
                device: self.id,
                k: make("keys"),
                v: (!latent).then(|| make("values")),
            };
            cache.device = Some(Box::new(kv));
        }
        cache
            .device
            .as_ref()
            .and_then(|d| d.downcast_ref::<WgpuKv>())
            .expect("the cache's buffers on this device")
    }
}

/// Why a product over a row subset of a weight split into several buffers is not computed.
fn split_refusal(w: &Weight, parts: usize) -> String {
    format!(
        "{}: a product of listed rows of a weight the wgpu device holds in {parts} buffers (larger than the \
         adapter binds at once) is not computed; run with --device cpu",
        w.name
    )
}

fn buf(a: &Act) -> &wgpu::Buffer {
    match &a.data {
        ActData::Wgpu(b) => &b.0,
        _ => panic!("the wgpu device computes on activations in its own buffers (use its upload)"),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn words_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl HostLink for WgpuDevice {
    fn host_memory(&self) -> bool {
        false
    }

    fn link(&self) -> Option<LinkCounters> {
        Some(*self.link.lock().expect("link counters"))
    }

    /// Host-to-device copies of each size through the queue (`write_buffer`: wgpu stages the
    /// host's bytes itself, so the pageable and pinned columns are the same copies), after one
    /// untimed, as many as make 64 MiB (4 to 64), waited for.
    fn measure_link(&self, sizes: &[usize]) -> Option<Result<Vec<LinkBandwidth>>> {
        self.flush();
        let wait = || {
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map(|_| ())
                .map_err(|e| Error::Device(format!("wgpu: waiting for the device: {e}")))
        };
        let measure = || -> Result<Vec<LinkBandwidth>> {
            let mut out = Vec::with_capacity(sizes.len());
            for &bytes in sizes {
                let size = (bytes.max(4) as u64).div_ceil(4) * 4;
                let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("link"),
                    size,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                let host = vec![1u8; size as usize];
                self.queue.write_buffer(&buf, 0, &host);
                self.queue.submit([]);
                wait()?;
                let copies = ((64usize << 20) / bytes.max(1)).clamp(4, 64);
                let t = std::time::Instant::now();
                for _ in 0..copies {
                    self.queue.write_buffer(&buf, 0, &host);
                }
                self.queue.submit([]);
                wait()?;
                let gb_per_s = (copies * bytes) as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9;
                out.push(LinkBandwidth {
                    bytes,
                    pageable_gb_per_s: gb_per_s,
                    pinned_gb_per_s: gb_per_s,
                    copies,
                });
            }
            Ok(out)
        };
        Some(measure())
    }

    fn keep_resident(&self, ws: &[&Weight]) {
        for w in ws {
            if !w.is_volatile() && w.in_memory() && type_code(w.ty).is_some() {
                self.weight(w);
            }
        }
        self.flush();
        if let Err(e) = self.device.poll(wgpu::PollType::wait_indefinitely()) {
            self.fail(format!("wgpu: waiting for the device: {e}"));
        }
    }
}

impl Device for WgpuDevice {
    fn name(&self) -> String {
        format!(
            "wgpu ({}, {:?}, {:?}{}; {} products)",
            self.info.name,
            self.info.backend,
            self.info.device_type,
            match self.info.driver_info.is_empty() {
                true => String::new(),
                false => format!(", {}", self.info.driver_info),
            },
            match self.packed_dots() {
                true => "packed 8-bit",
                false => "f32",
            }
        )
    }

    fn latent_attention(&self) -> bool {
        true
    }

    fn attention_sinks(&self) -> bool {
        true
    }

    fn computes_type(&self, ty: GgmlType) -> bool {
        type_code(ty).is_some()
    }

    fn run<'a>(&self, f: Box<dyn FnOnce() + Send + 'a>) {
        f()
    }

    fn launch_pending(&self) {
        self.flush();
    }

    fn take_error(&self) -> Option<Error> {
        self.flush();
        self.error.lock().expect("error").take().map(Error::Device)
    }

    fn upload(&self, rows: usize, width: usize, values: Vec<f32>) -> Act {
        assert_eq!(values.len(), rows * width, "activation shape");
        self.link.lock().expect("link counters").activation_bytes += 4 * values.len() as u64;
        let b = self.f32_buffer("activations", &values);
        self.act(rows, width, b)
    }

    fn zeros(&self, rows: usize, width: usize) -> Act {
        let b = self.zeroed(rows * width);
        self.act(rows, width, b)
    }

    fn copy(&self, x: &Act) -> Act {
        let out = self.zeroed(x.rows * x.width);
        if x.rows * x.width > 0 {
            self.record(|enc| enc.copy_buffer_to_buffer(buf(x), 0, &out, 0, (x.rows * x.width * 4) as u64));
        }
        self.act(x.rows, x.width, out)
    }

    fn to_host<'a>(&self, a: &'a Act) -> Cow<'a, [f32]> {
        match &a.data {
            ActData::Host(v) => Cow::Borrowed(v),
            _ => Cow::Owned(self.read_f32(buf(a), a.rows * a.width)),
        }
    }

    fn download(&self, a: Act) -> Vec<f32> {
        self.to_host(&a).into_owned()
    }

    fn embed(&self, w: &Weight, ids: &[u32], scale: f32) -> Act {
        // Rows gathered and decoded on the host (a few rows a pass), then copied.
        let h = w.cols;
        let mut x = vec![0f32; ids.len() * h];
        if !w.in_memory() {
            self.fail(format!("{}: the embedding's bytes are not in memory", w.name));
            return self.zeros(ids.len(), h);
        }
        for (row, &id) in x.chunks_mut(h).zip(ids) {
            if id as usize >= w.rows {
                self.fail(format!("{}: token id {id} is past its {} rows", w.name, w.rows));
                return self.zeros(ids.len(), h);
            }
            dequantize_row(w.ty, w.row(id as usize), row);
            if scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        self.upload(ids.len(), h, x)
    }

    fn rms_norm(&self, x: &Act, w: &[f32], eps: f32) -> Act {
        let out = self.zeroed(x.rows * x.width);
        self.norm("rms_norm", x, w, eps, Some(&out));
        self.act(x.rows, x.width, out)
    }

    fn rms_norm_in_place(&self, x: &mut Act, w: &[f32], eps: f32) {
        self.norm("rms_norm_in_place", x, w, eps, None);
    }

    fn add(&self, x: &mut Act, y: &Act) {
        assert_eq!((x.rows, x.width), (y.rows, y.width), "add shape");
        self.elementwise("add", buf(x), Some(buf(y)), x.rows * x.width, x.width, 0.0);
    }

    fn add_bias(&self, x: &mut Act, b: &[f32]) {
        assert_eq!(b.len(), x.width, "bias width");
        let bb = self.f32_buffer("bias", b);
        self.elementwise("add_bias", buf(x), Some(&bb), x.rows * x.width, x.width, 0.0);
    }

    fn mul(&self, x: &mut Act, y: &Act) {
        assert_eq!((x.rows, x.width), (y.rows, y.width), "mul shape");
        self.elementwise("mul", buf(x), Some(buf(y)), x.rows * x.width, x.width, 0.0);
    }

    fn activate(&self, x: &mut Act, f: FfnActivation) {
        let entry = match f {
            FfnActivation::Silu => "act_silu",
            FfnActivation::GeluTanh => "act_gelu",
        };
        self.elementwise(entry, buf(x), None, x.rows * x.width, x.width, 0.0);
    }

    fn activate_mul(&self, up: &mut Act, gate: &mut Act, f: FfnActivation) {
        assert_eq!((up.rows, up.width), (gate.rows, gate.width), "activate_mul shape");
        let entry = match f {
            FfnActivation::Silu => "silu_mul",
            FfnActivation::GeluTanh => "gelu_mul",
        };
        self.elementwise(entry, buf(up), Some(buf(gate)), up.rows * up.width, up.width, 0.0);
    }

    fn softcap(&self, x: &mut Act, cap: f32) {
        self.elementwise("softcap", buf(x), None, x.rows * x.width, x.width, cap);
    }

    fn argmax_rows(&self, x: &Act, banned: &[u32]) -> Vec<u32> {
        if x.rows == 0 {
            return Vec::new();
        }
        let out = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("tokens"),
            size: (x.rows.max(4) * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let bb = self.u32_buffer("banned", banned);
        let grid = Self::grid(x.rows);
        self.launch(
            Module::Ops,
            "argmax",
            &[(1, buf(x)), (2, &bb), (5, &out)],
            (
                3,
                &[x.rows as u32, x.width as u32, banned.len() as u32, grid.0, 0, 0, 0, 0],
            ),
            grid,
        );
        self.read_back(&out, x.rows * 4)
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// Each row's k largest values on the device (`top_k` in topk.wgsl): k pairs and two
    /// numbers a row come back, not the row. The pairs are sorted here (ties: lower id first),
    /// the log-sum-exp is the row's maximum plus the log of its f32 sum of exponentials. A
    /// software adapter whose loop budget the row (and its banned ids) would pass, or a k past
    /// [`TOP_K_MAX`], takes the host's path.
    fn top_k_rows(&self, x: &Act, k: usize, banned: &[u32], lse: bool, greedy: bool) -> TopRows {
        let k = k.min(x.width);
        let loops = 9 * x.width.div_ceil(256) * (banned.len() + 1) + 1400;
        if x.rows == 0 || k == 0 || k > TOP_K_MAX || (self.software() && loops > LOOP_BUDGET) {
            return super::host_top_k_rows(&self.to_host(x), x.width, k, banned, lse, greedy);
        }
        let storage = |label: &str, bytes: usize| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes.max(16) as u64,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            })
        };
        let (pairs, sums) = (
            storage("top-k pairs", x.rows * k * 8),
            storage("top-k sums", x.rows * 8),
        );
        let bb = self.u32_buffer("banned", banned);
        let grid = Self::grid(x.rows);
        self.launch(
            Module::TopK,
            "top_k",
            &[(0, buf(x)), (1, &bb), (3, &pairs), (4, &sums)],
            (
                2,
                &[
                    x.rows as u32,
                    x.width as u32,
                    k as u32,
                    banned.len() as u32,
                    grid.0,
                    0,
                    0,
                    0,
                ],
            ),
            grid,
        );
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let mut out = TopRows {
            pairs: self
                .read_back(&pairs, x.rows * k * 8)
                .chunks_exact(8)
                .map(|b| (word(&b[..4]), f32::from_bits(word(&b[4..]))))
                .collect(),
            lse: Vec::new(),
            tokens: Vec::new(),
        };
        for row in out.pairs.chunks_exact_mut(k) {
            row.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        }
        if lse {
            out.lse = self
                .read_back(&sums, x.rows * 8)
                .chunks_exact(8)
                .map(|b| {
                    let (max, sum) = (f32::from_bits(word(&b[..4])), f32::from_bits(word(&b[4..])));
                    max as f64 + (sum as f64).ln()
                })
                .collect();
        }
        if greedy {
            out.tokens = self.argmax_rows(x, banned);
        }
        out
    }

    fn select_rows(&self, x: &Act, rows: &[usize]) -> Act {
        let out = self.zeroed(rows.len() * x.width);
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        self.moved("select_rows", x, &ids, (rows.len() * x.width, x.width, 0), &out);
        self.act(rows.len(), x.width, out)
    }

    fn scatter_cols(&self, x: &Act, cols: &[u32], width: usize) -> Act {
        let out = self.zeroed(x.rows * width);
        self.moved("scatter_cols", x, cols, (x.rows * cols.len(), width, cols.len()), &out);
        self.act(x.rows, width, out)
    }

    fn gather_cols(&self, x: &Act, cols: &[u32]) -> Act {
        let out = self.zeroed(x.rows * cols.len());
        self.moved("gather_cols", x, cols, (x.rows * cols.len(), x.width, cols.len()), &out);
        self.act(x.rows, cols.len(), out)
    }

    fn matmul(&self, ws: &[&Weight], x: &Act) -> Vec<Act> {
        // One preparation of the input per block size (weights of one size share it).
        let mut prepared: Vec<(usize, Option<Prepared>)> = Vec::new();
        ws.iter()
            .map(|w| {
                let m = w.ty.block_elems();
                if !prepared.iter().any(|(size, _)| *size == m) {
                    prepared.push((m, self.prepared(x, w.ty)));
                }
                let xq = prepared
                    .iter()
                    .find(|(size, _)| *size == m)
                    .and_then(|(_, b)| b.as_ref());
                self.product(w, None, x, xq)
            })
            .collect()
    }

    fn matmul_rows(&self, w: &Weight, rows: &[u32], x: &Act) -> Act {
        let xq = self.prepared(x, w.ty);
        self.product(w, Some(rows), x, xq.as_ref())
    }

    fn accumulate_rows(&self, w: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        let n = rows.map_or(w.rows, <[u32]>::len);
        if acts.rows == 0 || n == 0 || w.cols == 0 {
            return;
        }
        if acts.width != w.rows || out.width != w.cols || out.rows != acts.rows {
            self.fail(format!(
                "{}: a neuron-major product of {}x{} with activations {}x{} into {}x{}",
                w.name, w.rows, w.cols, acts.rows, acts.width, out.rows, out.width
            ));
            return;
        }
        let Some((parts, code)) = self.weight(w) else { return };
        if rows.is_some() && parts.len() > 1 {
            self.fail(split_refusal(w, parts.len()));
            return;
        }
        let id_buf = rows.map(|ids| self.u32_buffer("row ids", ids));
        let grid = Self::grid(w.cols.div_ceil(64) * acts.rows.div_ceil(TILE));
        // A thread sums its column over the rows, each row times the tile's tokens: on a software
        // adapter, rows in launches short enough for its loop budget (see [`LOOP_BUDGET`]).
        let chunk = match self.software() {
            true => (LOOP_BUDGET / (acts.rows.min(TILE) + 2)).max(1),
            false => usize::MAX,
        };
        for part in &parts {
            let part_rows = if rows.is_some() { n } else { part.rows };
            let mut row0 = 0;
            while row0 < part_rows {
                let len = chunk.min(part_rows - row0);
                let (Some(r), Some(c), Some(t), Some(s), Some(off), Some(r0)) = (
                    self.fits("rows", len),
                    self.fits("columns", w.cols),
                    self.fits("tokens", acts.rows),
                    self.fits("row stride", w.row_stride_bytes),
                    self.fits("rows", part.first),
                    self.fits("rows", row0),
                ) else {
                    return;
                };
                self.launch(
                    Module::Quant(code),
                    "accumulate",
                    &[
                        (0, &part.buf),
                        (1, buf(acts)),
                        (2, buf(out)),
                        (3, id_buf.as_ref().unwrap_or(&self.empty)),
                    ],
                    (
                        4,
                        &[
                            r,
                            c,
                            t,
                            s,
                            rows.is_some() as u32,
                            grid.0,
                            0,
                            w.rows as u32,
                            0,
                            off,
                            r0,
                            0,
                        ],
                    ),
                    grid,
                );
                row0 += len;
            }
        }
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
        let rd = shape.rope_dims.min(shape.head_dim);
        let mut table = Vec::with_capacity(positions.len() * rd);
        let mut one = Vec::with_capacity(rd / 2);
        for &pos in positions {
            rope_table(pos, rd, shape.base, shape.pos_scale, shape.factors, &mut one);
            table.extend(one.iter().flat_map(|&(c, s)| [c, s]));
        }
        let tb = self.f32_buffer("rope table", &table);
        self.rope_heads(q, &tb, &shape, q_norm, eps);
        self.rope_heads(k, &tb, &shape, k_norm, eps);
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
        if self.failed() || positions.is_empty() {
            return;
        }
        let kvd = k.width;
        let row = (kvd * 4) as u64;
        let mut copies = Vec::with_capacity(positions.len());
        for (t, (&pos, &s)) in positions.iter().zip(seq_of_token).enumerate() {
            let cache = &mut *caches[s];
            if pos >= cache.capacity || kvd != cache.kv_dim {
                self.fail(format!(
                    "wgpu: a key of {kvd} at position {pos} into a cache of {} x {}",
                    cache.capacity, cache.kv_dim
                ));
                return;
            }
            let kv = self.kv(cache);
            copies.push((
                t as u64 * row,
                pos as u64 * row,
                kv.k[layer].clone(),
                kv.v.as_ref().map(|v| v[layer].clone()),
            ));
        }
        self.record(|enc| {
            for (from, to, kc, vc) in &copies {
                enc.copy_buffer_to_buffer(buf(k), *from, kc, *to, row);
                if let Some(vc) = vc {
                    enc.copy_buffer_to_buffer(buf(v), *from, vc, *to, row);
                }
            }
        });
    }

    fn attention(
        &self,
        q: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &[&mut KvCache],
        shape: AttnShape<'_>,
    ) -> Act {
        let out = self.zeroed(q.rows * q.width);
        let hd = shape.head_dim;
        if q.rows == 0 {
            return self.act(q.rows, q.width, out);
        }
        if hd > MAX_HEAD_DIM || shape.n_kv_heads == 0 || !shape.n_heads.is_multiple_of(shape.n_kv_heads) {
            self.fail(format!(
                "wgpu: attention over heads of {hd} (at most {MAX_HEAD_DIM}), {} query heads over {} key heads",
                shape.n_heads, shape.n_kv_heads
            ));
            return self.act(q.rows, q.width, out);
        }
        let chunk = self.attention_chunk.load(std::sync::atomic::Ordering::Relaxed);
        let span = |p: usize| shape.window.map_or(p + 1, |w| (p + 1).min(w));
        // A software adapter ends a thread's loops past its budget (see [`LOOP_BUDGET`]): a
        // span a join would loop over past it is refused, not cut short (millions of positions).
        let longest = positions.iter().map(|&p| span(p)).max().unwrap_or(0);
        if self.software()
            && (attention_loops(hd, chunk) > LOOP_BUDGET || join_loops(longest.div_ceil(chunk)) > LOOP_BUDGET)
        {
            self.fail(format!(
                "wgpu: attention over {longest} positions with heads of {hd} is past what one thread of the software \
                 adapter {} loops over (lavapipe ends a thread's loops after 65535 iterations); run with --device cpu \
                 or a shorter context",
                self.info.name
            ));
            return self.act(q.rows, q.width, out);
        }
        let sinks = shape.sinks.map(|s| self.f32_buffer("sinks", s));
        let sinks = sinks.as_ref().unwrap_or(&self.empty);
        let mut seqs: Vec<usize> = seq_of_token.to_vec();
        seqs.sort_unstable();
        seqs.dedup();
        for s in seqs {
            let at: Vec<u32> = positions
                .iter()
                .zip(seq_of_token)
                .enumerate()
                .filter(|(_, (_, &st))| st == s)
                .flat_map(|(t, (&pos, _))| [t as u32, pos as u32])
                .collect();
            let Some(kv) = caches[s].device.as_ref().and_then(|d| d.downcast_ref::<WgpuKv>()) else {
                self.fail("wgpu: attention over a cache this device never wrote".into());
                return self.act(q.rows, q.width, out);
            };
            let tokens = at.len() / 2;
            let splits = at
                .chunks_exact(2)
                .map(|t| span(t[1] as usize).div_ceil(chunk))
                .max()
                .unwrap_or(1);
            let at_buf = self.u32_buffer("token positions", &at);
            let params = |groups_x: u32| {
                [
                    tokens as u32,
                    shape.n_heads as u32,
                    (shape.n_heads / shape.n_kv_heads) as u32,
                    hd as u32,
                    (shape.n_kv_heads * hd) as u32,
                    q.width as u32,
                    shape.window.unwrap_or(0) as u32,
                    shape.sinks.is_some() as u32,
                    groups_x,
                    shape.scale.to_bits(),
                    chunk as u32,
                    splits as u32,
                ]
            };
            let k = &kv.k[shape.layer];
            let v = kv.v.as_ref().map_or(k, |v| &v[shape.layer]);
            let grid = Self::grid(tokens * shape.n_heads);
            if splits <= 1 {
                let binds = [(0, buf(q)), (1, k), (2, v), (3, &at_buf), (4, sinks), (6, &out)];
                self.launch(Module::Attention, "attention", &binds, (5, &params(grid.0)), grid);
                continue;
            }
            let part = self.zeroed(tokens * shape.n_heads * splits * (hd + 2));
            let part_grid = Self::grid(tokens * shape.n_heads * splits);
            let binds = [(0, buf(q)), (1, k), (2, v), (3, &at_buf), (4, sinks), (7, &part)];
            self.launch(
                Module::Attention,
                "attention_part",
                &binds,
                (5, &params(part_grid.0)),
                part_grid,
            );
            let binds = [(3, &at_buf), (4, sinks), (6, &out), (7, &part)];
            self.launch(Module::Attention, "attention_join", &binds, (5, &params(grid.0)), grid);
        }
        self.act(q.rows, q.width, out)
    }
}
