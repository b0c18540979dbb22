//! Compute devices. A [`Device`] runs the layer program's operations on activations that live
//! on it ([`Act`]); the forward pass (`model::forward`, `model::ffn`) is written once against
//! this trait. The CPU device (`cpu`) is the reference for every other path and the fast path
//! on this hardware. A device computes on weights it is handed; it never opens files or
//! decides what to read (that is `model`'s and `stream`'s job).
//!
//! Why operations, and why these: a layer-level device ("run layer l") would re-implement
//! attention, the sparse FFN, streaming and experts once per device; a ggml-style graph fights
//! the data-dependent shapes this engine lives on (the neurons a mask keeps, the tokens routed
//! to an expert are known only mid-layer). About twenty coarse operations per layer — a product
//! of a weight with every token of a batch, a norm over all rows, RoPE over all heads,
//! attention over a batch's sequences — are cheap to launch, keep the hidden state on the
//! device between them, and leave the only per-layer host syncs where the host must decide:
//! the mask's scores (`to_host`) and, for experts, the router's choices. Small vectors (norms,
//! biases) are passed as host slices; a device that keeps them resident caches them by address.
//! Products take `Weight`s, which say where their bytes are (`tensor`); a device copies what it
//! needs to its memory (the CPU device reads them in place).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod modes;
pub mod ops;
pub mod pick;
pub mod standin;
#[cfg(feature = "wgpu")]
pub mod wgpu_device;

use std::borrow::Cow;

use crate::config::{FfnActivation, RopeStyle};
use crate::kv::KvCache;
use crate::quant::PreparedInput;
use crate::tensor::{StagedBytes, Weight};

/// Which device a command computes on (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
    /// CUDA when a driver and a GPU are found (and this build has CUDA), else the CPU.
    Auto,
    /// The host stand-in for a device with memory of its own ([`standin`]): tests of the paths
    /// that feed a GPU, run where there is none.
    HostStandIn,
    /// The portable GPU device on wgpu (Vulkan, Metal, DX12): `wgpu_device`, cargo feature `wgpu`.
    Wgpu,
}

/// Opens the device `kind` names (`threads`: the CPU device's pool, 0 = one per core). `var`
/// hands over the variables a CUDA device is opened with (the binary passes the process's
/// environment: see `cuda::CudaOptions`); the library reads none itself. With `Auto`, the reason
/// CUDA was not used comes back as a one-line notice for the caller to print.
pub fn open_device(
    kind: DeviceKind,
    threads: usize,
    var: &dyn Fn(&str) -> Option<String>,
) -> crate::error::Result<(std::sync::Arc<dyn Device>, Option<String>)> {
    use std::sync::Arc;
    let cpu = || -> Arc<dyn Device> { Arc::new(cpu::CpuBackend::new(threads)) };
    match kind {
        DeviceKind::Cpu => Ok((cpu(), None)),
        DeviceKind::HostStandIn => Ok((Arc::new(standin::HostStandIn::new(threads)), None)),
        DeviceKind::Cuda => open_cuda(var).map(|d| (d, None)),
        DeviceKind::Wgpu => open_wgpu(var).map(|d| (d, None)),
        DeviceKind::Auto => match open_cuda(var) {
            Ok(d) => Ok((d, None)),
            Err(e) => Ok((cpu(), Some(format!("--device auto: running on the CPU ({e})")))),
        },
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(var: &dyn Fn(&str) -> Option<String>) -> crate::error::Result<std::sync::Arc<dyn Device>> {
    let opts = cuda::CudaOptions::from_vars(var)?;
    Ok(std::sync::Arc::new(cuda::CudaDevice::open(0, &opts)?))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_var: &dyn Fn(&str) -> Option<String>) -> crate::error::Result<std::sync::Arc<dyn Device>> {
    Err(crate::error::Error::Input(
        "CUDA: this gatestream was built without CUDA; rebuild with `cargo build --release --features cuda` \
         (use --device cpu to run on the CPU)"
            .into(),
    ))
}

/// `--activations` (through its variable) for the wgpu device: `Some(true)` packed 8-bit
/// products (int8), `Some(false)` the 8-bit blocks decoded to f32 (q8), `None` the device's
/// default (auto). f32 is refused: the wgpu device multiplies quantized weights with the CPU's
/// 8-bit activation blocks only.
pub fn wgpu_packed_dots(var: &dyn Fn(&str) -> Option<String>) -> crate::error::Result<Option<bool>> {
    let flag = modes::CUDA_FLAGS.iter().find(|f| f.key == "activations");
    let Some(v) = flag.and_then(|f| var(f.var)) else {
        return Ok(None);
    };
    match v.trim() {
        "" | "auto" => Ok(None),
        "int8" => Ok(Some(true)),
        "q8" => Ok(Some(false)),
        other => Err(crate::error::Error::Input(format!(
            "--activations {other} with --device wgpu: the wgpu device multiplies quantized weights with the CPU's \
             8-bit activation blocks, as packed integers (int8, the default where the adapter's WGSL has \
             dot4I8Packed) or decoded to f32 (q8); use auto, int8 or q8"
        ))),
    }
}

#[cfg(feature = "wgpu")]
fn open_wgpu(var: &dyn Fn(&str) -> Option<String>) -> crate::error::Result<std::sync::Arc<dyn Device>> {
    let packed = wgpu_packed_dots(var)?;
    let dev = wgpu_device::WgpuDevice::open()?;
    if let Some(on) = packed {
        dev.set_packed_dots(on);
    }
    Ok(std::sync::Arc::new(dev))
}

#[cfg(not(feature = "wgpu"))]
fn open_wgpu(_var: &dyn Fn(&str) -> Option<String>) -> crate::error::Result<std::sync::Arc<dyn Device>> {
    Err(crate::error::Error::Input(
        "wgpu: this gatestream was built without the wgpu device; rebuild with `cargo build --release --features \
         wgpu` (use --device cpu to run on the CPU)"
            .into(),
    ))
}

/// Matrix products over quantized host weights: the CPU device's inner interface.
pub trait Backend: Send + Sync {
    fn name(&self) -> String;
    /// `out[t * w.rows + r] = dot(w.row(r), xs[t])` for every token `t` and row `r`.
    fn matmul(&self, w: &Weight, xs: &[PreparedInput], out: &mut [f32]);
    /// Only the listed rows: `out[t * rows.len() + i] = dot(w.row(rows[i]), xs[t])`. The sparse
    /// FFN computes gate/up for a subset of neurons with it.
    fn matmul_rows(&self, w: &Weight, rows: &[u32], xs: &[PreparedInput], out: &mut [f32]);
    /// The transposed product, for matrices stored neuron-major (`[n, cols]`, row r = neuron r's
    /// down column): `out[t * w.cols + c] += sum_r acts[t * w.rows + r] * w[r][c]` over `rows`
    /// (all rows when `None`). Rows whose activation is exactly zero for a token add nothing.
    fn accumulate_rows(&self, w: &Weight, rows: Option<&[u32]>, acts: &[f32], out: &mut [f32]);
}

/// Activations on a device: `rows` vectors of `width` f32 values (tokens × features).
pub struct Act {
    pub rows: usize,
    pub width: usize,
    data: ActData,
}

/// Where an activation's values are. A device with memory of its own adds its variant here.
enum ActData {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Cuda(cuda::DevBuf),
    #[cfg(feature = "wgpu")]
    Wgpu(wgpu_device::WgpuBuf),
}

impl Act {
    /// Host values `[rows, width]`.
    pub fn host(rows: usize, width: usize, values: Vec<f32>) -> Act {
        assert_eq!(values.len(), rows * width, "activation shape");
        Act {
            rows,
            width,
            data: ActData::Host(values),
        }
    }

    pub fn zeros(rows: usize, width: usize) -> Act {
        Act::host(rows, width, vec![0.0; rows * width])
    }

    /// The values, when they are in host memory (always, on the CPU device).
    pub fn as_host(&self) -> Option<&[f32]> {
        match &self.data {
            ActData::Host(v) => Some(v),
            #[cfg(feature = "cuda")]
            ActData::Cuda(_) => None,
            #[cfg(feature = "wgpu")]
            ActData::Wgpu(_) => None,
        }
    }

    pub fn as_host_mut(&mut self) -> Option<&mut [f32]> {
        match &mut self.data {
            ActData::Host(v) => Some(v),
            #[cfg(feature = "cuda")]
            ActData::Cuda(_) => None,
            #[cfg(feature = "wgpu")]
            ActData::Wgpu(_) => None,
        }
    }

    pub fn into_host(self) -> Option<Vec<f32>> {
        match self.data {
            ActData::Host(v) => Some(v),
            #[cfg(feature = "cuda")]
            ActData::Cuda(_) => None,
            #[cfg(feature = "wgpu")]
            ActData::Wgpu(_) => None,
        }
    }
}

/// Each row's most likely values ([`Device::top_k_rows`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TopRows {
    /// `[rows, k]` (id, value) pairs, each row's largest first.
    pub pairs: Vec<(u32, f32)>,
    /// Each row's ln Σ exp of its values (the banned ids left out) when asked, else empty: a
    /// candidate's log-probability is its value less its row's.
    pub lse: Vec<f64>,
    /// Each row's greedy token ([`Device::argmax_rows`]) when asked, else empty.
    pub tokens: Vec<u32>,
}

/// [`Device::argmax_rows`] of `rows` rows of `width` values on the host.
fn host_argmax_rows(values: &[f32], rows: usize, width: usize, banned: &[u32]) -> Vec<u32> {
    (0..rows)
        .map(|r| pick::argmax_banned(&values[r * width..(r + 1) * width], banned))
        .collect()
}

/// [`Device::top_k_rows`] of rows of `width` values on the host.
pub(crate) fn host_top_k_rows(
    values: &[f32],
    width: usize,
    k: usize,
    banned: &[u32],
    lse: bool,
    greedy: bool,
) -> TopRows {
    let rows = values.len() / width.max(1);
    let mut out = TopRows {
        pairs: Vec::with_capacity(rows * k),
        lse: Vec::with_capacity(if lse { rows } else { 0 }),
        tokens: match greedy {
            true => host_argmax_rows(values, rows, width, banned),
            false => Vec::new(),
        },
    };
    for row in values.chunks_exact(width.max(1)) {
        let banned_row;
        let row = if banned.is_empty() {
            row
        } else {
            banned_row = {
                let mut r = row.to_vec();
                pick::ban(&mut r, banned);
                r
            };
            &banned_row[..]
        };
        out.pairs.extend(pick::most_likely(row, k));
        if lse {
            out.lse.push(ops::log_sum_exp(row));
        }
    }
    out
}

/// Weights a device with memory of its own copied from the host (see [`HostLink::link`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LinkCounters {
    /// Bytes of resident weights, copied once each.
    pub resident_bytes: u64,
    /// Bytes of volatile weights (the stream's buffers, weights the device plan keeps on the
    /// host), copied at every use, and how many copies.
    pub volatile_bytes: u64,
    pub volatile_copies: u64,
    /// Of the volatile bytes, those staged by [`HostLink::begin_upload`] (page-locked memory on
    /// CUDA, copied a chunk at a time on the copy stream while the rest is still being staged).
    pub staged_bytes: u64,
    /// Of the volatile bytes, those copied from page-locked memory: staged, or in a buffer the
    /// stream registered ([`HostLink::pin_host`]).
    pub pinned_bytes: u64,
    /// Time in those copies, nanoseconds: host time of synchronous copies, plus the device time
    /// (between events) of the staged, asynchronous ones.
    pub copy_ns: u64,
    /// Bytes copied the other way, device to host: a pass's logits (or a greedy pass's tokens,
    /// 4 bytes a row: [`Device::argmax_rows`]), the gate's scores a mask picks neurons from.
    pub to_host_bytes: u64,
    /// Copies to the host that waited for kernels launched since the one before (each a point
    /// where the host waits for the device and the device then for the host): with a mask, a
    /// decode step's layers; then the logits or tokens. Counted by CUDA only (0 elsewhere).
    pub host_waits: u64,
    /// Activations copied to the device ([`Device::upload`]): a prompt's embeddings, the hybrid
    /// executor's partial FFN outputs, a mask's edited activations.
    pub activation_bytes: u64,
    /// Volatile weights' bytes a use found in the device's own kept copies
    /// ([`HostLink::keep_keyed`]): routed experts not copied again.
    pub kept_bytes: u64,
}

impl LinkCounters {
    pub fn minus(&self, o: &LinkCounters) -> LinkCounters {
        LinkCounters {
            resident_bytes: self.resident_bytes - o.resident_bytes,
            volatile_bytes: self.volatile_bytes - o.volatile_bytes,
            volatile_copies: self.volatile_copies - o.volatile_copies,
            staged_bytes: self.staged_bytes - o.staged_bytes,
            pinned_bytes: self.pinned_bytes - o.pinned_bytes,
            copy_ns: self.copy_ns - o.copy_ns,
            to_host_bytes: self.to_host_bytes - o.to_host_bytes,
            host_waits: self.host_waits - o.host_waits,
            activation_bytes: self.activation_bytes - o.activation_bytes,
            kept_bytes: self.kept_bytes - o.kept_bytes,
        }
    }
}

/// Host-to-device copy bandwidth for one copy size (see [`HostLink::measure_link`]).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct LinkBandwidth {
    pub bytes: usize,
    /// Copies from ordinary (pageable) memory, which the driver stages through its own pinned
    /// buffer, and from page-locked memory (not write-combined), which it copies directly.
    pub pageable_gb_per_s: f64,
    pub pinned_gb_per_s: f64,
    /// Copies timed per size (after one untimed).
    pub copies: usize,
}

/// Copy sizes `bench --device cuda` measures the link at: 4 KiB (one neuron's rows are
/// smaller) to 64 MiB (a large layer's FFN), by factors of 4.
pub const LINK_SIZES: [usize; 8] = [
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
];

/// The size a decode step's staged rows are handed to the device in ([`Upload::send`]): large
/// enough that a copy runs near the link's bandwidth (`bench --device cuda` shows ~1 MiB does on
/// PCIe), small enough that the first chunks copy while later rows are still being read.
pub const UPLOAD_CHUNK_BYTES: usize = 1 << 20;

/// Staging buffers a device keeps for reuse, and the granularity of their sizes. A decode step
/// stages a layer's up rows, then (once the up product has run) its down columns: one buffer in
/// use at a time, two kept, and a buffer too small for a new staging is freed before a larger
/// one is made — so staging holds at most about one layer's FFN rows (two matrices), inside the
/// room the device plan keeps for one layer's copies.
pub const UPLOAD_BUFFERS_KEPT: usize = 2;
pub const UPLOAD_BUFFER_GRAIN: usize = 64 << 10;

/// Host memory a decode step's streamed rows are staged in for a device with memory of its own
/// ([`HostLink::begin_upload`]): rows are written in place, and each chunk is handed to the device
/// as soon as it is complete, so its copy runs while later rows are still arriving.
pub trait Upload: Send {
    /// The staging buffer (as long as asked), written in place.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// Bytes `start..end` are final: the device copies them now (CUDA: asynchronously, on its
    /// copy stream; the product that reads them waits for that copy's event). They must not be
    /// written again, nor sent twice.
    fn send(&mut self, start: usize, end: usize);
    /// Every byte the weight will read has been sent: the buffer, as a weight's storage
    /// ([`Weight::staged`]). The device returns it to its pool when the last weight over it
    /// drops, after the work that reads it.
    fn finish(self: Box<Self>) -> std::sync::Arc<dyn StagedBytes>;
}

/// `head`'s rows then `tail`'s, as one weight in host memory (see
/// [`Device::accumulate_rows_joined`]): volatile, a copy for one use.
pub fn join_rows(head: &Weight, tail: &Weight) -> crate::error::Result<Weight> {
    joinable(head, tail)?;
    let mut bytes = Vec::with_capacity(head.len_bytes() + tail.len_bytes());
    for w in [head, tail] {
        for r in 0..w.rows {
            bytes.extend_from_slice(w.row(r));
        }
    }
    Ok(Weight::owned(&head.name, head.ty, head.rows + tail.rows, head.cols, bytes)?.volatile())
}

/// Whether `head`'s and `tail`'s rows join into one matrix: one type and width.
pub fn joinable(head: &Weight, tail: &Weight) -> crate::error::Result<()> {
    match head.ty == tail.ty && head.cols == tail.cols {
        true => Ok(()),
        false => Err(crate::error::Error::Internal(format!(
            "{} and {}: rows of different types or widths ({:?} x {}, {:?} x {}) do not join",
            head.name, tail.name, head.ty, head.cols, tail.ty, tail.cols
        ))),
    }
}

/// Host memory a device page-locked for its copies ([`HostLink::pin_host`]); unlocked on drop.
pub struct PinnedHost(pub Box<dyn Send + Sync>);

/// A weight's bytes in host memory a device mapped ([`HostLink::map_host`]), as the storage of
/// the weight [`HostLink::in_place`] returns: the device that mapped it (`device`, its own id)
/// reads them at `device_address`; any other reads the bytes as host memory.
pub struct MappedHost {
    /// The weight over the host bytes (keeps them alive).
    pub weight: Weight,
    pub device: u64,
    pub device_address: u64,
}

impl MappedHost {
    /// `w` as a weight over host memory mapped by device `device` at `device_address` (what
    /// [`HostLink::in_place`] returns).
    pub fn weight_over(w: &Weight, device: u64, device_address: u64) -> Option<Weight> {
        let mapped = MappedHost {
            weight: w.clone(),
            device,
            device_address,
        };
        Weight::staged(&w.name, w.ty, w.rows, w.cols, std::sync::Arc::new(mapped)).ok()
    }
}

impl StagedBytes for MappedHost {
    fn bytes(&self) -> &[u8] {
        self.weight.span().map_or(&[], |(b, _)| b)
    }

    fn mapped(&self) -> Option<(u64, u64)> {
        Some((self.device, self.device_address))
    }
}

/// Staging in ordinary memory: what a device that reads host memory in place gets (sending is
/// nothing to do).
pub struct HostUpload(Vec<u8>);

impl HostUpload {
    pub fn new(bytes: usize) -> HostUpload {
        HostUpload(vec![0; bytes])
    }
}

impl StagedBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl Upload for HostUpload {
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
    fn send(&mut self, _start: usize, _end: usize) {}
    fn finish(self: Box<Self>) -> std::sync::Arc<dyn StagedBytes> {
        std::sync::Arc::new(self.0)
    }
}

/// How a layer's attention reads its cache.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape<'a> {
    pub layer: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Sliding window (local layers): positions before `pos + 1 - window` are not attended.
    pub window: Option<usize>,
    /// Attention sinks (gpt-oss), one logit per query head: each head's softmax has this extra
    /// logit (not scaled), which takes probability mass and adds no value. A device that does
    /// not compute them says so in [`Device::attention_sinks`].
    pub sinks: Option<&'a [f32]>,
}

/// RoPE's parameters for one layer.
#[derive(Clone, Copy, Debug)]
pub struct RopeShape<'a> {
    pub head_dim: usize,
    /// The leading dimensions of each head that rotate (`head_dim`, or fewer: partial RoPE,
    /// whose angles take `rope_dims` as the head's size and whose other dimensions pass
    /// through). A device that cannot says so in [`Device::rope_partial`].
    pub rope_dims: usize,
    pub base: f32,
    pub pos_scale: f32,
    pub style: RopeStyle,
    /// Per-frequency divisors of the angles (`head_dim / 2`; Llama 3.1+), or None (all 1). A
    /// device that cannot apply them says so in [`Device::rope_freq_factors`].
    pub factors: Option<&'a [f32]>,
}

/// The most candidates a row of [`Device::top_k_rows`] (a pass's `Want::Top`) may ask for: a
/// GPU block sorts them.
pub const TOP_K_MAX: usize = 1024;

/// How a device reaches host memory: whether it computes in it, what it copied across the link,
/// and the memory the stream lends it (pinned or mapped buffers, staged uploads, weights read in
/// place). The stream sees a device only through this; the layer program through [`Device`].
pub trait HostLink: Send + Sync {
    /// Whether activations live in host memory (the CPU device). A device with memory of its
    /// own copies weights to it: resident ones once (by address), streamed ones at each use
    /// ([`Weight::is_volatile`]).
    fn host_memory(&self) -> bool {
        true
    }
    /// Bytes of the device's own memory free now (a device with memory of its own; `None` for
    /// the CPU device, or where it cannot be read): what automatic placement fits a model into.
    fn memory_free(&self) -> Option<u64> {
        None
    }
    /// What the device copied from the host so far (a device with memory of its own; `None`
    /// for the CPU device, which reads weights in place).
    fn link(&self) -> Option<LinkCounters> {
        None
    }
    /// Measures host-to-device copy bandwidth for each copy size in `sizes` (bytes), from
    /// pageable and from pinned host memory (`bench --device cuda`); `None` for a device that
    /// copies nothing (the CPU).
    fn measure_link(&self, _sizes: &[usize]) -> Option<crate::error::Result<Vec<LinkBandwidth>>> {
        None
    }
    /// A staging buffer of `bytes` for rows the device will compute on once (a decode step's
    /// streamed FFN rows), handed over a chunk at a time ([`Upload`]). The default stages in
    /// ordinary memory; a device with memory of its own stages in memory it copies from fastest
    /// (page-locked on CUDA), reused from step to step.
    fn begin_upload(&self, bytes: usize) -> Box<dyn Upload> {
        Box::new(HostUpload::new(bytes))
    }
    /// Page-locks host memory the device copies from at each use — a buffer the stream
    /// refills, such as its FFN staging (`refilled`), or resident weights the device does not
    /// keep (not refilled: a copy from them need not be waited for by the host) — so those
    /// copies run at the link's pinned speed; `None` where the device copies nothing (the CPU)
    /// or the memory could not be locked (then copies from it stay ordinary ones). The guard
    /// unlocks it when dropped, and must be dropped before the memory is freed.
    fn pin_host(&self, _bytes: &[u8], _refilled: bool) -> Option<PinnedHost> {
        None
    }
    /// Lets a device with memory of its own keep copies of keyed volatile weights
    /// ([`crate::tensor::Weight::keyed`]: routed experts) in up to `bytes` of its memory, the
    /// least recently used replaced, so a use that finds one copies nothing (a GPU budget's
    /// room left after the plan). Nothing for a device computing in host memory.
    fn keep_keyed(&self, _bytes: u64) {}
    /// Page-locks host memory as `pin_host` does and maps it into the device's address space,
    /// so that besides copies at pinned speed, the device's kernels can read weights over it in
    /// place, across the link, without a copy ([`HostLink::in_place`]): the stream's neuron cache,
    /// whose kept rows a masked decode step reads by id. `None` where the device reads host
    /// memory anyway (the CPU), does not map (then the caller pins), or the driver refused.
    fn map_host(&self, _bytes: &[u8], _refilled: bool) -> Option<PinnedHost> {
        None
    }
    /// `w`, over host memory this device mapped ([`HostLink::map_host`]), as a weight its products
    /// read in place: `matmul_rows` and `accumulate_rows` with ids then move only the listed
    /// rows across the link, nothing is staged or copied. `None` where `w` is not over mapped
    /// memory.
    fn in_place(&self, _w: &Weight) -> Option<Weight> {
        None
    }
    /// Copies resident weights to the device now, as their first use would, and waits for the
    /// copies (a device with memory of its own: the model's weights at load, so that the first
    /// pass is not also the upload); nothing for the CPU or streamed weights. A failure is the
    /// device's error ([`Device::take_error`]).
    fn keep_resident(&self, _ws: &[&Weight]) {}
    /// The size of the chunks staged rows are sent in ([`UPLOAD_CHUNK_BYTES`]; a test device
    /// may ask for smaller ones).
    fn upload_chunk_bytes(&self) -> usize {
        UPLOAD_CHUNK_BYTES
    }
}

/// The layer program's operations (see the module docs). Shapes are `[rows, width]`; a batch's
/// tokens are the rows. Every device is also a [`HostLink`].
pub trait Device: HostLink {
    fn name(&self) -> String;
    /// Whether [`Device::rope_qk`] applies [`RopeShape::factors`] (Llama 3.1+'s frequency
    /// factors); a model that has them is refused at load on a device that does not.
    fn rope_freq_factors(&self) -> bool {
        true
    }
    /// Whether the device's attention reads a cache without values of its own (latent
    /// attention's values are the keys' first numbers: [`crate::kv::KvCache`]); a model with
    /// latent attention is refused at load on a device that does not.
    fn latent_attention(&self) -> bool {
        true
    }
    /// Whether [`Device::rope_qk`] rotates only [`RopeShape::rope_dims`] of each head when that
    /// is fewer than its size; a model with partial RoPE is refused at load on a device that
    /// does not.
    fn rope_partial(&self) -> bool {
        true
    }
    /// Whether [`Device::attention`] computes [`AttnShape::sinks`] (gpt-oss); a model that has
    /// them is refused at load on a device that does not.
    fn attention_sinks(&self) -> bool {
        false
    }
    /// Why the device does not run a model of this configuration, if it does not (a device
    /// checked against the CPU on some architectures only); the model is refused at load.
    fn refuses_model(&self, _cfg: &crate::config::ModelConfig) -> Option<String> {
        None
    }
    /// Whether the device multiplies weights of `ty`; a model holding a matrix of another type
    /// is refused at load on it (the CPU device computes every [`crate::quant::GgmlType`]).
    fn computes_type(&self, _ty: crate::quant::GgmlType) -> bool {
        true
    }
    /// Runs `f` where the device's work starts cheapest (the CPU device: on its own threads).
    fn run<'a>(&self, f: Box<dyn FnOnce() + Send + 'a>);
    /// The first error an operation met since the last call (a device whose operations can
    /// fail — out of memory, a failed launch — records it and skips later work; the pass then
    /// returns it). The CPU device's operations cannot fail.
    fn take_error(&self) -> Option<crate::error::Error> {
        None
    }
    /// Starts what the device was asked so far (one that records operations to launch them
    /// together launches them now), so it computes while the host works on something else.
    fn launch_pending(&self) {}
    /// Host values to the device.
    fn upload(&self, rows: usize, width: usize, values: Vec<f32>) -> Act;
    fn zeros(&self, rows: usize, width: usize) -> Act;
    fn copy(&self, x: &Act) -> Act;
    /// The values on the host: a sync point (the CPU device lends its own memory).
    fn to_host<'a>(&self, a: &'a Act) -> Cow<'a, [f32]>;
    /// The values on the host, giving the activation up (the CPU device hands its vector over).
    fn download(&self, a: Act) -> Vec<f32>;
    /// Row `ids[t]` of `w` (dequantized) times `scale`, for every token.
    fn embed(&self, w: &Weight, ids: &[u32], scale: f32) -> Act;
    /// Every row normalized by RMS and scaled by `w`, into a new activation.
    fn rms_norm(&self, x: &Act, w: &[f32], eps: f32) -> Act;
    /// As `rms_norm`, in place.
    fn rms_norm_in_place(&self, x: &mut Act, w: &[f32], eps: f32);
    /// `x += y`.
    fn add(&self, x: &mut Act, y: &Act);
    /// `x[t] += b` for every row.
    fn add_bias(&self, x: &mut Act, b: &[f32]);
    /// `x = x * y` elementwise.
    fn mul(&self, x: &mut Act, y: &Act);
    /// `x = f(x)` elementwise.
    fn activate(&self, x: &mut Act, f: FfnActivation);
    /// `up = up · f(gate)` elementwise: `activate`, then `mul`, unless a device does both at once
    /// (with the same result). `gate` is left activated or as it was: not to be read after.
    fn activate_mul(&self, up: &mut Act, gate: &mut Act, f: FfnActivation) {
        self.activate(gate, f);
        self.mul(up, gate);
    }
    /// `x += y`, then `x` normalized by RMS and scaled by `w`, into a new activation: `add`,
    /// then `rms_norm`, unless a device does both at once (with the same result).
    fn add_rms_norm(&self, x: &mut Act, y: &Act, w: &[f32], eps: f32) -> Act {
        self.add(x, y);
        self.rms_norm(x, w, eps)
    }
    /// `x = cap * tanh(x / cap)`.
    fn softcap(&self, x: &mut Act, cap: f32);
    /// Each row's greedy token ([`pick::argmax`], the `banned` ids counted as
    /// -inf): a sync point, as `to_host`, that brings 4 bytes a row to the host instead of the
    /// row (a vocabulary of logits) when the device is a GPU.
    fn argmax_rows(&self, x: &Act, banned: &[u32]) -> Vec<u32> {
        host_argmax_rows(&self.to_host(x), x.rows, x.width, banned)
    }
    /// Each row's `k` largest values with their ids, largest first (ties: lower id first, in
    /// `f32::total_cmp`'s order), the `banned` ids counted as -inf: `[rows, k]` pairs, as
    /// [`pick::most_likely`] finds them (`Want::Top`); with `lse`, each row's
    /// [`ops::log_sum_exp`] too (banned ids left out), so that the candidates' log-probabilities
    /// need no row on the host; with `greedy`, each row's [`Device::argmax_rows`] too, at the
    /// same sync. A sync point that brings 8 bytes a candidate (and 8 a row for `lse`, 4 for
    /// `greedy`) to the host instead of the rows when the device is a GPU. `k` is at least 1 and
    /// at most the row's width and [`TOP_K_MAX`].
    fn top_k_rows(&self, x: &Act, k: usize, banned: &[u32], lse: bool, greedy: bool) -> TopRows {
        host_top_k_rows(&self.to_host(x), x.width, k, banned, lse, greedy)
    }
    /// The listed rows, in order.
    fn select_rows(&self, x: &Act, rows: &[usize]) -> Act;
    /// `[n, m]` values into columns `cols` of a zero `[n, width]`.
    fn scatter_cols(&self, x: &Act, cols: &[u32], width: usize) -> Act;
    /// Columns `cols` of `x`, `[n, cols.len()]`.
    fn gather_cols(&self, x: &Act, cols: &[u32]) -> Act;
    /// `out[rows[i]] += scales[i] · y[i]` for every row `i` of `y` (the experts' weighted sum).
    /// This default works on any device through the host (a sync point per call).
    fn add_rows_scaled(&self, out: &mut Act, y: &Act, rows: &[usize], scales: &[f32]) {
        assert!(
            y.rows == rows.len() && rows.len() == scales.len() && y.width == out.width,
            "row scatter shape"
        );
        let w = out.width;
        let yv = self.to_host(y);
        let scatter = |o: &mut [f32]| {
            for ((&r, &s), src) in rows.iter().zip(scales).zip(yv.chunks_exact(w)) {
                o[r * w..(r + 1) * w].iter_mut().zip(src).for_each(|(a, b)| *a += s * b);
            }
        };
        match out.as_host_mut() {
            Some(o) => scatter(o),
            None => {
                let mut o = self.to_host(out).into_owned();
                scatter(&mut o);
                *out = self.upload(out.rows, w, o);
            }
        }
    }
    /// `x · w_i` for each weight (`[n, w_i.rows]` each); one input serves several products.
    fn matmul(&self, ws: &[&Weight], x: &Act) -> Vec<Act>;
    /// `x · w_i + b_i` for each weight, a bias added to the outputs that have one
    /// (`biases[i]` for `ws[i]`): `matmul`, then `add_bias`, unless a device does both at once.
    fn matmul_bias(&self, ws: &[&Weight], biases: &[Option<&[f32]>], x: &Act) -> Vec<Act> {
        let mut out = self.matmul(ws, x);
        for (o, b) in out.iter_mut().zip(biases) {
            if let Some(b) = b {
                self.add_bias(o, b);
            }
        }
        out
    }
    /// `x · w[rows]`: only the listed rows, `[n, rows.len()]`.
    fn matmul_rows(&self, w: &Weight, rows: &[u32], x: &Act) -> Act;
    /// `out[t] += Σ_r acts[t][r] · w[r]` over `rows` (all when `None`), neuron-major `w`,
    /// summed in f64 so neither order nor thread count changes a result.
    fn accumulate_rows(&self, w: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act);
    /// `out[t] += Σ_r acts[t][r] · w[r]` as `accumulate_rows`, the sum starting from `base`
    /// (`[n, w.cols]`, f64: a share of the same product summed elsewhere, the hybrid executor's
    /// CPU share) and rounded once, so the split does not change the result. This default
    /// rounds `base` and the device's own sum each to f32 (a device whose products sum in f32
    /// anyway); the CPU device sums both in f64.
    fn accumulate_rows_onto(&self, w: &Weight, rows: Option<&[u32]>, acts: &Act, base: Vec<f64>, out: &mut Act) {
        self.accumulate_rows(w, rows, acts, out);
        let shared = self.upload(out.rows, out.width, base.iter().map(|&v| v as f32).collect());
        self.add(out, &shared);
    }
    /// `accumulate_rows` over the matrix whose rows are `head`'s, then `tail`'s (one type and
    /// width; `acts` `[n, head.rows + tail.rows]`, `rows` indexing the joined rows), summed
    /// exactly as that one matrix would be: the result is `accumulate_rows`'s over it, bit for
    /// bit. (A device keeping a layer's hot neurons sums their down columns with the rest's
    /// streamed ones as one product, so the result does not depend on the split.) This default
    /// joins the bytes in host memory; a device with memory of its own reads both where they are.
    fn accumulate_rows_joined(&self, head: &Weight, tail: &Weight, rows: Option<&[u32]>, acts: &Act, out: &mut Act) {
        self.accumulate_rows(&join_rows(head, tail).expect("rows that join"), rows, acts, out)
    }
    /// Queries and keys, per head of width `shape.head_dim`: the optional per-head RMS norm
    /// (`q_norm`, `k_norm`), then RoPE at each row's position (one table per position serves
    /// both).
    #[allow(clippy::too_many_arguments)]
    fn rope_qk(
        &self,
        q: &mut Act,
        k: &mut Act,
        positions: &[usize],
        shape: RopeShape,
        q_norm: Option<&[f32]>,
        k_norm: Option<&[f32]>,
        eps: f32,
    );
    /// Row t's keys and values into `caches[seq_of_token[t]]` at `positions[t]`.
    fn kv_write(
        &self,
        layer: usize,
        k: &Act,
        v: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &mut [&mut KvCache],
    );
    /// [`Device::rope_qk`], then [`Device::kv_write`] of the keys it leaves and `v`: `at` is
    /// `(positions, seq_of_token)`, `rope` `(shape, q_norm, k_norm, eps)`. A device may do both
    /// in one pass.
    #[allow(clippy::too_many_arguments)]
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
        self.rope_qk(q, k, positions, shape, q_norm, k_norm, eps);
        self.kv_write(layer, k, v, positions, seq_of_token, caches);
    }
    /// Row t's query heads over its own sequence's cached positions `..=positions[t]`.
    fn attention(
        &self,
        q: &Act,
        positions: &[usize],
        seq_of_token: &[usize],
        caches: &[&mut KvCache],
        shape: AttnShape<'_>,
    ) -> Act;
}

#[cfg(test)]
mod tests {
    use super::wgpu_packed_dots;

    /// `--activations` (through its variable) for the wgpu device: int8 and q8 set the products,
    /// auto and nothing leave the device's default, f32 and anything else are refused naming the
    /// values it takes.
    #[test]
    fn wgpu_activations_values() {
        let with = |v: Option<&str>| {
            let v = v.map(str::to_string);
            wgpu_packed_dots(&move |name: &str| (name == "GATESTREAM_CUDA_ACTIVATIONS").then(|| v.clone()).flatten())
        };
        assert_eq!(with(None).unwrap(), None);
        assert_eq!(with(Some("auto")).unwrap(), None);
        assert_eq!(with(Some("int8")).unwrap(), Some(true));
        assert_eq!(with(Some("q8")).unwrap(), Some(false));
        for bad in ["f32", "i8"] {
            let e = with(Some(bad)).unwrap_err().to_string();
            assert!(
                e.contains(bad) && e.contains("int8") && e.contains("q8") && e.contains("--device wgpu"),
                "{e}"
            );
        }
    }
}
