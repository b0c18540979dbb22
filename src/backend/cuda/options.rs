//! What the CUDA device opens with ([`CudaOptions`]): where its libraries and kernel cache are, and
//! its modes (operation fusion, the activations quantized products multiply, rows per warp of
//! one-token products, graphs, host mapping), each parsed from its variable and refused with what
//! its values mean. The library reads no environment: the binary (and the GPU suite) hand the
//! variables over ([`CudaOptions::from_vars`]).

use super::*;

/// `GATESTREAM_CUDA_FUSE`: `1` (or `on`) fuses launches of a decode step that
/// follow each other: RMSNorm (with or without the residual add before it) and the gated
/// activation write, beside their f32 output, the Q8_K blocks the integer products
/// (`GATESTREAM_CUDA_ACTIVATIONS` auto or int8) take as input, so one-token products of Q4_K and
/// Q6_K rows after them need no quantization launch of their own; RoPE writes the keys and
/// values into the KV cache; split attention writes its output's Q8_K blocks too (the block
/// finishing the last head of each 256 values makes them), and a lone integer product whose
/// input has no blocks quantizes that input itself, in each thread block's shared memory; and
/// with launches recorded (graphs on), a one-token integer product's last blocks do what comes
/// next — RoPE and the KV write after the Q, K and V products, the residual add and RMSNorm after
/// the attention output and down products, the gated activation after the gate and up products —
/// and the last of split attention's blocks for a head merges the head's splits (a Qwen2.5 layer:
/// 5 launches, 15 without); so do a batch's (2 to 8 tokens, `matvec_i8n*`: RoPE, the norms and
/// the gated activation, a warp of the last block a token; 5 launches a layer too). The same bytes as the launches they replace. `0` (`off`, the
/// default): each in a launch of its own — on an H200 a Qwen2.5-1.5B-shaped decode step ran 10%
/// faster so (docs/RESULTS.md section 4). Blocks are made for rows of a multiple of 256 values
/// (a token's or a batch's, which the integer batches and tiles take too), once an integer
/// product has run.
pub const FUSE_ENV: &str = "GATESTREAM_CUDA_FUSE";

/// `GATESTREAM_CUDA_MMA`: `1` (or `on`, the default) multiplies several tokens at once (prompts,
/// sequences decoding together; for Q4_K and Q6_K rows, more than [`INT8_TOKENS_ENV`] asks to
/// multiply as integers) with block-quantized weights on the tensor cores (`mma_*` in
/// kernels/mma.cu: each weight unit decoded once per 64 tokens, every value as two f16 so the
/// products are as exact as f32 ones, f32 sums); `0` (`off`): the FMA loops (`matmul_*`, f32
/// inputs, a unit decoded once per 8 tokens).
pub const MMA_ENV: &str = "GATESTREAM_CUDA_MMA";

/// `GATESTREAM_CUDA_MMQ`: `1` (or `on`, the default) multiplies batches of Q4_K and Q6_K rows
/// wider than [`INT8_TOKENS_ENV`] (with `GATESTREAM_CUDA_ACTIVATIONS` auto or int8, and the tensor
/// cores on) as 8-bit integers on the tensor cores (`mmq_*` in kernels/mma.cu, llama.cpp's MMQ
/// approach: the activations as the CPU's Q8_K blocks, int8 `mma` with int32 sums, each
/// super-block's value the one-token integer products' to the bit); `0` (`off`): on the tensor
/// cores as f16 pairs (`mma_*`, the activations' 8-bit blocks decoded to f32).
pub const MMQ_ENV: &str = "GATESTREAM_CUDA_MMQ";

/// Whether [`MMQ_ENV`] asks for the integer tiles (`value`: the variable's value).
pub fn mmq_asked(value: Option<&str>) -> Result<bool> {
    switch_asked(
        MMQ_ENV,
        value,
        "batches of Q4_K and Q6_K rows as 8-bit integers on the tensor cores",
        "as f16 pairs",
    )
}

/// `GATESTREAM_CUDA_ATTN_TILES`: `1` (or `on`, the default) computes attention for runs of a
/// sequence's consecutive tokens (prompts: runs of at least `ATTN_TILE_MIN_RUN` on average, heads of
/// at most 256 values) a tile of 16 tokens a block (`attention_tiles` in kernels/attention.cu:
/// each chunk of keys and values read once for the tile, the softmax kept running); `0` (`off`):
/// as a decode step's tokens ([`ATTN_SPLIT_ENV`]).
pub const ATTN_TILES_ENV: &str = "GATESTREAM_CUDA_ATTN_TILES";

/// Whether [`ATTN_TILES_ENV`] asks for tiled attention (`value`: the variable's value).
pub fn attn_tiles_asked(value: Option<&str>) -> Result<bool> {
    switch_asked(
        ATTN_TILES_ENV,
        value,
        "a prompt's attention 16 tokens a block",
        "as a decode step's tokens",
    )
}

/// `GATESTREAM_CUDA_ATTN_SPLIT`: `1` (or `on`, the default) computes the attention of tokens that
/// take no tiles (decode steps, a token a sequence) split over their positions
/// (`attention_split` in kernels/attention.cu, flash-decoding: up to about 256 blocks of at least
/// 64 positions each, a head's query in registers, a key or value row read whole by a warp; then
/// `attention_merge` where a head has several splits); `0` (`off`): a block per token and head over
/// all its positions (`attention`).
pub const ATTN_SPLIT_ENV: &str = "GATESTREAM_CUDA_ATTN_SPLIT";

/// Whether [`ATTN_SPLIT_ENV`] asks for split attention (`value`: the variable's value).
pub fn attn_split_asked(value: Option<&str>) -> Result<bool> {
    switch_asked(
        ATTN_SPLIT_ENV,
        value,
        "decode attention split over positions",
        "a block per token and head",
    )
}

/// Whether [`MMA_ENV`] asks for the tensor-core products (`value`: the variable's value).
pub fn mma_asked(value: Option<&str>) -> Result<bool> {
    switch_asked(
        MMA_ENV,
        value,
        "batches of quantized products on the tensor cores",
        "FMA loops",
    )
}

/// Whether [`FUSE_ENV`] asks for fused launches (`value`: the variable's value).
pub fn fuse_asked(value: Option<&str>) -> Result<bool> {
    switch_off_asked(
        FUSE_ENV,
        value,
        "each in a launch of its own",
        "norms and activations write the integer products' input blocks, RoPE the KV cache",
    )
}

/// `GATESTREAM_CUDA_ACTIVATIONS`: what the GPU's quantized products multiply. `auto` (the
/// default): Q4_K and Q6_K weights as `int8`, the other types as `f32` — the fastest on an H100
/// (Qwen2.5-1.5B-shaped decode, 2026-11-25: 354 tok/s with `int8` against 206 with `f32` and 194
/// with `q8`). `f32` multiplies quantized weights with the f32 activations; `q8` first
/// replaces the activations by the 8-bit blocks the CPU's products use (blocks of 32 for
/// Q4_0/Q4_1/Q5_0/Q8_0 weights, Q8_K blocks of 256 for K-quants), so the GPU computes what the
/// CPU path (and llama.cpp) computes, to rounding; `int8` also multiplies them as integers
/// (`dp4a`, llama.cpp's approach) in products of Q4_K and Q6_K rows with up to
/// [`INT8_TOKENS_ENV`] tokens, and as integer tiles on the tensor cores past that ([`MMQ_ENV`]),
/// the rest as `q8`. The binary's `--activations` flag sets it (and wins over the variable).
pub const ACTIVATIONS_ENV: &str = "GATESTREAM_CUDA_ACTIVATIONS";

/// What the GPU's quantized products multiply the weights with (see [`ACTIVATIONS_ENV`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// The f32 activations, weights decoded to f32 (dequantize-and-FMA).
    F32,
    /// The CPU's 8-bit activation blocks, decoded to f32.
    Q8,
    /// The CPU's 8-bit blocks multiplied as integers where a kernel does (products of Q4_K and
    /// Q6_K rows: up to [`INT8_TOKENS_ENV`] tokens with `dp4a`, more as integer tiles,
    /// [`MMQ_ENV`]), as [`Activations::Q8`] elsewhere.
    Int8,
    /// The default: weights of the types with integer products (Q4_K, Q6_K) as
    /// [`Activations::Int8`] (integers, as the CPU computes them), the other types as
    /// [`Activations::F32`].
    Auto,
}

/// The weight types with integer products (`matvec_i8_*`, `matvec_i8n_*`).
pub const INT8_TYPES: [GgmlType; 2] = [GgmlType::Q4_K, GgmlType::Q6_K];
/// The most tokens one integer product takes (`I8N_MAX`: `matvec_i8n_*` reads each weight
/// super-block once for all of them).
pub const I8N_MAX: usize = 8;
/// Bytes of one Q8_K activation block for the integer products (`Q8K_BLOCK_BYTES`).
pub(super) const Q8K_BLOCK_BYTES: usize = 304;
/// The widest input (in blocks of 256) `matvec_i8f_*` quantizes itself (`I8F_MAX_BLOCKS`).
pub(super) const I8F_MAX_BLOCKS: usize = 48;

/// How a product runs as integers (`CudaDevice::integer_path`): dot products of up to
/// [`INT8_TOKENS_ENV`] tokens (`matvec_i8*`), or tiles on the tensor cores (`mmq_*`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum IntegerPath {
    Dots,
    Tiles,
}

/// An integer product's input: Q8_K blocks (token after token), or one token's values, which
/// the product's own blocks quantize (`matvec_i8f_*`).
#[derive(Clone, Copy)]
pub(super) enum Int8Input {
    Blocks(u64),
    Values(u64),
}

/// An on/off variable (`name`, its value `value`): `1` or `on` (or unset, or empty: the default)
/// is on, `0` or `off` off; anything else is refused, saying what each means.
pub(crate) fn switch_asked(name: &str, value: Option<&str>, on: &str, off: &str) -> Result<bool> {
    switch_with_default(name, value, true, on, off)
}

/// A switch's value: `1`/`on` true, `0`/`off` false, unset or empty `default`; `on` and `off`
/// say what each means, for the error (the default named first).
fn switch_with_default(name: &str, value: Option<&str>, default: bool, on: &str, off: &str) -> Result<bool> {
    match value.map(str::trim) {
        None | Some("") => Ok(default),
        Some("1") | Some("on") => Ok(true),
        Some("0") | Some("off") => Ok(false),
        Some(other) if default => Err(Error::Input(format!(
            "{name}={other}: expected 1 or on (the default: {on}), or 0 or off ({off})"
        ))),
        Some(other) => Err(Error::Input(format!(
            "{name}={other}: expected 0 or off (the default: {off}), or 1 or on ({on})"
        ))),
    }
}

/// A switch that is off unless asked for: `0`/`off`/unset false, `1`/`on` true; `off` and `on`
/// say what each means, for the error.
pub(crate) fn switch_off_asked(name: &str, value: Option<&str>, off: &str, on: &str) -> Result<bool> {
    switch_with_default(name, value, false, on, off)
}

/// What [`ACTIVATIONS_ENV`] asks for (`value`: the variable's value).
pub fn activations_asked(value: Option<&str>) -> Result<Activations> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Ok(Activations::Auto),
        Some("f32") => Ok(Activations::F32),
        Some("q8") => Ok(Activations::Q8),
        Some("int8") => Ok(Activations::Int8),
        Some(other) => Err(Error::Input(format!(
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
            _ => Err(Error::Input(format!(
                "{MATVEC_ROWS_ENV}={v}: expected 1 (the default), 2 or 4 rows per warp of one-token products"
            ))),
        },
    }
}

/// `GATESTREAM_CUDA_MMQ_PREFETCH`: `1` (or `on`) has the integer tiles ([`MMQ_ENV`]: `mmq_*`)
/// load each thread's weight bytes of the next super-block into registers before multiplying the
/// tile's current one, so that the loads' latency passes while the tensor cores work — at the
/// cost of registers (sm_90: 180 against 134 for Q4_K, 2 blocks a multiprocessor instead of 3);
/// `0` (`off`, the default while neither has been timed on a GPU: `mmq_plain_*`) loads them where
/// they are unpacked. The same values either way.
pub const MMQ_PREFETCH_ENV: &str = "GATESTREAM_CUDA_MMQ_PREFETCH";

/// Whether [`MMQ_PREFETCH_ENV`] asks for the loads ahead (`value`: the variable's value).
pub fn mmq_prefetch_asked(value: Option<&str>) -> Result<bool> {
    switch_off_asked(
        MMQ_PREFETCH_ENV,
        value,
        "each super-block's weights loaded where the integer tiles unpack them",
        "the next super-block's weights loaded while the tiles multiply",
    )
}

/// `GATESTREAM_CUDA_I8_WPR`: warps per weight row of the integer products (`matvec_i8*`), 1, 2, 4
/// or 8 (of a block's 8) for every such product, instead of the default (`auto`:
/// [`i8_warps_per_row`], the most, at most 8, that leave each warp's 4 lane groups 2 super-blocks
/// or more of the row: 1 for 1536 columns, 8 for 8960). Each choice sums a row's super-blocks in
/// another order (within rounding of each other); for timing the products' geometry (the GPU
/// suite's `i8_geometry`).
pub const I8_WPR_ENV: &str = "GATESTREAM_CUDA_I8_WPR";

/// The warps per row [`I8_WPR_ENV`] asks for: 0 for `auto` (`value`: the variable's value).
pub fn i8_wpr_asked(value: Option<&str>) -> Result<usize> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Ok(0),
        Some(v) => match v.parse::<usize>() {
            Ok(n @ (1 | 2 | 4 | 8)) => Ok(n),
            _ => Err(Error::Input(format!(
                "{I8_WPR_ENV}={v}: expected auto (the default: by the row's length), 1, 2, 4 or 8 warps per row of \
                 the integer products"
            ))),
        },
    }
}

/// `GATESTREAM_CUDA_INT8_TOKENS`: the most tokens (1 to 8, the default 8) whose products of
/// Q4_K and Q6_K rows run as integers (`GATESTREAM_CUDA_ACTIVATIONS` auto or int8): a batch of
/// up to that many tokens — a short prompt's piece, sequences decoding together — reads each
/// weight super-block once and multiplies it with every token's Q8_K block (`matvec_i8n_*`),
/// as llama.cpp's integer vector kernels do for batches of up to 8; each token gets the sums it
/// gets alone. Wider batches take the tensor cores (`GATESTREAM_CUDA_MMA`). `1`: only single
/// tokens run as integers, every batch on the tensor cores.
pub const INT8_TOKENS_ENV: &str = "GATESTREAM_CUDA_INT8_TOKENS";

/// The tokens [`INT8_TOKENS_ENV`] asks for (`value`: the variable's value).
pub fn int8_tokens_asked(value: Option<&str>) -> Result<usize> {
    match value.map(str::trim) {
        None | Some("") => Ok(I8N_MAX),
        Some(v) => match v.parse::<usize>() {
            Ok(n @ 1..=I8N_MAX) => Ok(n),
            _ => Err(Error::Input(format!(
                "{INT8_TOKENS_ENV}={v}: expected 1 to {I8N_MAX} (the default {I8N_MAX}), the most tokens whose \
                 Q4_K and Q6_K products run as integers (1: single tokens only, batches on the tensor cores)"
            ))),
        },
    }
}

/// What the CUDA device is opened with.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// The driver library to load first ([`LIBCUDA_ENV`]), else the loader's own search.
    pub libcuda: Option<String>,
    /// The NVRTC library file ([`nvrtc::NVRTC_ENV`]), else the standard names and folders.
    pub nvrtc: Option<String>,
    /// CUDA installations whose `lib64` is searched for NVRTC too (`CUDA_HOME`, `CUDA_PATH`).
    pub cuda_homes: Vec<std::path::PathBuf>,
    /// The folder of compiled kernels ([`nvrtc::CACHE_ENV`], else `~/.cache/gatestream/kernels`);
    /// `None`: compiled at every open.
    pub kernel_cache: Option<std::path::PathBuf>,
    /// What quantized products multiply ([`ACTIVATIONS_ENV`]).
    pub activations: Activations,
    /// Rows per warp of one-token products ([`MATVEC_ROWS_ENV`]).
    pub matvec_rows: usize,
    /// Recorded launches replayed as CUDA graphs ([`GRAPHS_ENV`]).
    pub graphs: bool,
    /// Launches a graph is cut after ([`GRAPH_SPLIT_ENV`]; 0: not cut).
    pub graph_split: usize,
    /// Whether the stream's neuron cache is mapped for kernels to read in place ([`MAP_HOST_ENV`]).
    pub map_host: bool,
    /// Whether launches that follow each other are fused ([`FUSE_ENV`]).
    pub fuse: bool,
    /// Whether batched quantized products run on the tensor cores ([`MMA_ENV`]).
    pub mma: bool,
    /// The most tokens whose Q4_K and Q6_K products run as integers ([`INT8_TOKENS_ENV`]).
    pub int8_tokens: usize,
    /// Warps per row of the integer products, 0 for by the row ([`I8_WPR_ENV`]).
    pub i8_wpr: usize,
    /// Whether the integer tiles load the next super-block ahead ([`MMQ_PREFETCH_ENV`]).
    pub mmq_prefetch: bool,
    /// Whether wider batches of Q4_K and Q6_K rows run as integer tiles ([`MMQ_ENV`]).
    pub mmq: bool,
    /// Whether a prompt's attention runs in tiles of tokens ([`ATTN_TILES_ENV`]).
    pub attn_tiles: bool,
    /// Whether decode attention is split over positions ([`ATTN_SPLIT_ENV`]).
    pub attn_split: bool,
}

impl CudaOptions {
    /// The options the variables `var` returns ask for (`|name| std::env::var(name).ok()` for the
    /// process's environment); an unset or empty variable takes its default.
    pub fn from_vars(var: &dyn Fn(&str) -> Option<String>) -> Result<CudaOptions> {
        let set = |name: &str| var(name).filter(|v| !v.is_empty());
        Ok(CudaOptions {
            libcuda: set(LIBCUDA_ENV),
            nvrtc: set(nvrtc::NVRTC_ENV),
            cuda_homes: ["CUDA_HOME", "CUDA_PATH"]
                .iter()
                .filter_map(|n| set(n))
                .map(std::path::PathBuf::from)
                .collect(),
            kernel_cache: set(nvrtc::CACHE_ENV)
                .map(std::path::PathBuf::from)
                .or_else(|| set("HOME").map(|h| std::path::Path::new(&h).join(".cache/gatestream/kernels"))),
            activations: activations_asked(var(ACTIVATIONS_ENV).as_deref())?,
            matvec_rows: matvec_rows_asked(var(MATVEC_ROWS_ENV).as_deref())?,
            graphs: graphs_asked(var(GRAPHS_ENV).as_deref())?,
            graph_split: graph_split_asked(var(GRAPH_SPLIT_ENV).as_deref())?,
            map_host: map_host_asked(var(MAP_HOST_ENV).as_deref())?,
            fuse: fuse_asked(var(FUSE_ENV).as_deref())?,
            mma: mma_asked(var(MMA_ENV).as_deref())?,
            int8_tokens: int8_tokens_asked(var(INT8_TOKENS_ENV).as_deref())?,
            i8_wpr: i8_wpr_asked(var(I8_WPR_ENV).as_deref())?,
            mmq_prefetch: mmq_prefetch_asked(var(MMQ_PREFETCH_ENV).as_deref())?,
            mmq: mmq_asked(var(MMQ_ENV).as_deref())?,
            attn_tiles: attn_tiles_asked(var(ATTN_TILES_ENV).as_deref())?,
            attn_split: attn_split_asked(var(ATTN_SPLIT_ENV).as_deref())?,
        })
    }
}
