//! The kernels the device launches (their names in the module, per weight type or not) and
//! each family's launch geometry; the constants shared with `kernels/*.cu` (checked against the
//! source by the tests in `mod.rs`).

use super::*;

/// Threads per block of the elementwise kernels.
pub(super) const ELEMENTWISE_THREADS: u32 = 256;
/// Warps per block of the matmul kernels (one output row each).
pub(super) const MATMUL_WARPS: u32 = 8;
/// Tokens per matmul block (`MM_TOKENS` in kernels/quant.cu).
pub(super) const MATMUL_TOKENS: usize = 8;
/// Threads per block of attention (the warps of split attention, [`ATTN_SPLIT_WARPS`]).
pub(super) const ATTENTION_THREADS: u32 = 32 * ATTN_SPLIT_WARPS as u32;
/// Threads per block of the partial sums of `accumulate_rows`.
pub(super) const ACCUMULATE_THREADS: u32 = 64;
/// Threads of the block that finds one row's argmax (a vocabulary of ~150k logits: ~150 each).
pub(super) const ARGMAX_THREADS: u32 = 1024;
/// Threads of the block that finds one row's top-k (`TOPK_MAX` in kernels/ops.cu: one a
/// candidate when they are ranked).
pub(super) const TOP_K_THREADS: u32 = crate::backend::TOP_K_MAX as u32;
/// The largest head the attention kernel's shared query holds (`ATTN_MAX_HEAD_DIM`): DeepSeek's
/// latent heads are 576.
pub(super) const ATTN_MAX_HEAD_DIM: usize = 576;
/// Tokens of a tile of tiled attention (`ATTN_TILE_Q`) and the largest head it takes
/// (`ATTN_TILE_MAX_HD`; its blocks have [`ATTENTION_THREADS`] threads).
pub(super) const ATTN_TILE_TOKENS: usize = 16;
pub(super) const ATTN_TILE_MAX_HEAD_DIM: usize = 256;
/// The fewest tokens the batch's runs must average for tiled attention (decode batches, a token
/// a sequence, keep a block per token).
pub(super) const ATTN_TILE_MIN_RUN: usize = 4;
/// Warps of a split-attention block (`ATTN_SPLIT_WARPS`: its blocks have [`ATTENTION_THREADS`]
/// threads).
pub(super) const ATTN_SPLIT_WARPS: usize = 4;
/// The fewest positions a block of split attention is given (a split of fewer would cost more in
/// its launch and merge than it saves).
pub(super) const ATTN_SPLIT_MIN_POSITIONS: usize = 64;
/// The blocks split attention aims for: about two a multiprocessor of an H100 (132). A constant,
/// not the device's count, so that a launch's geometry depends only on the batch and its
/// context (and repeats for a CUDA graph).
pub(super) const ATTN_SPLIT_TARGET_BLOCKS: usize = 256;
/// u32 launch counters a device keeps (`last_arrival` in kernels/ops.cu): a fused merge of
/// split attention takes one per (query head, token), a fused norm one, a fused gated
/// activation one per 256 values, a fused RoPE one per query, key and value head.
pub const COUNTER_WORDS: usize = 1 << 16;
/// Bytes of freed activation buffers kept for reuse.
pub(super) const POOL_BYTES_MAX: usize = 1 << 30;

/// A weight type's code in kernels/quant.cu (`TY_Q4_K`, `TY_Q6_K`: `matvec_i8x3_mixed` takes each
/// weight's), for the types with integer products.
pub(super) fn i8_type_code(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_K => 7,
        GgmlType::Q6_K => 9,
        other => panic!("{other:?} has no integer products"),
    }
}

/// The weight types the device has kernels for (kernels/quant.cu: `decode_unit` and the
/// `QUANT_KERNELS` and `MMA_KERNEL` families of each); a model holding another (the grid types
/// IQ2_*, IQ3_*, IQ1_*) is refused at load ([`computes_type`], [`cpu_only_message`] naming the
/// tensor and its type), its types computed on the CPU only.
pub const CUDA_TYPES: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::BF16,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_XS,
    GgmlType::Q5_1,
];

/// Whether the device has kernels for weights of `ty`.
pub fn computes_type(ty: GgmlType) -> bool {
    CUDA_TYPES.contains(&ty)
}

/// The message for a weight of a type the device has no kernels for.
pub(super) fn cpu_only_message(tensor: &str, ty: GgmlType) -> String {
    format!(
        "{tensor}: {} is computed on the CPU only (the CUDA device has kernels for {}); run with --device cpu",
        ty.name(),
        CUDA_TYPES.map(GgmlType::name).join(", ")
    )
}

/// The kernel name suffix of a weight type (types without kernels have one too, unused).
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
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::IQ4_NL => "iq4_nl",
        GgmlType::IQ4_XS => "iq4_xs",
        GgmlType::MXFP4 => "mxfp4",
        GgmlType::IQ2_XXS => "iq2_xxs",
        GgmlType::IQ2_XS => "iq2_xs",
        GgmlType::IQ2_S => "iq2_s",
        GgmlType::IQ3_XXS => "iq3_xxs",
        GgmlType::IQ3_S => "iq3_s",
        GgmlType::IQ1_S => "iq1_s",
        GgmlType::IQ1_M => "iq1_m",
    }
}

/// The per-type kernel families (`{family}_{type}` in kernels/quant.cu).
pub(super) const TYPED: [&str; 7] = ["matmul", "matvec", "matvec2", "matvec4", "embed", "accumulate", "mma"];
/// The kernels that are not per type.
pub(super) const OPS: [&str; 31] = [
    "accumulate_reduce",
    "act_f16_rows",
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
    "attention_split",
    "attention_merge",
    "attention_tiles",
    "matvec_i8x3_mixed",
    "matvec_i8x3_rope_kv",
    "matvec_i8nx3",
    "matvec_i8nx3_act",
    "matvec_i8nx3_rope_kv",
];

/// A kernel: a name, and the weight type for the per-type families (looked up per launch
/// without building its name).
pub(super) type KernelKey = (&'static str, Option<GgmlType>);

/// Every kernel the device launches, with its name in the module.
pub(super) fn kernel_keys() -> Vec<(KernelKey, String)> {
    let typed = CUDA_TYPES
        .iter()
        .flat_map(|&ty| TYPED.map(|k| ((k, Some(ty)), format!("{k}_{}", type_suffix(ty)))));
    let int8 = INT8_TYPES.iter().flat_map(|&ty| {
        [
            "matvec_i8",
            "matvec_i8x3",
            "matvec_i8f",
            "matvec_i8n",
            "mmq",
            "mmq_plain",
            "matvec_i8_norm",
            "matvec_i8f_norm",
            "matvec_i8n_norm",
            "matvec_i8x3_act",
        ]
        .map(|k| ((k, Some(ty)), format!("{k}_{}", type_suffix(ty))))
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

/// The tiles of tiled attention over a batch: (first token, tokens) pairs, each a run of one
/// sequence's tokens at consecutive positions, at most [`ATTN_TILE_TOKENS`] long.
pub fn attention_tiles(positions: &[usize], seq_of_token: &[usize]) -> Vec<(usize, usize)> {
    let mut tiles: Vec<(usize, usize)> = Vec::new();
    for t in 0..positions.len() {
        match tiles.last_mut() {
            Some((_, n))
                if *n < ATTN_TILE_TOKENS
                    && seq_of_token[t] == seq_of_token[t - 1]
                    && positions[t] == positions[t - 1] + 1 =>
            {
                *n += 1
            }
            _ => tiles.push((t, 1)),
        }
    }
    tiles
}

/// How many splits of its positions split attention gives each (query head, token) of a batch
/// of `rows` such pairs whose score rows are `max_len` long (a power of two, [`attention_row`]):
/// the largest power of two that keeps the blocks within [`ATTN_SPLIT_TARGET_BLOCKS`] and each
/// split at least [`ATTN_SPLIT_MIN_POSITIONS`] long, at least 1. A split takes `max_len / splits`
/// positions.
pub fn attention_splits(max_len: usize, rows: usize) -> usize {
    let want = ATTN_SPLIT_TARGET_BLOCKS / rows.max(1);
    let most = want.min(max_len / ATTN_SPLIT_MIN_POSITIONS).max(1);
    1 << most.ilog2()
}

/// The groups of query heads (`n_heads` of `hd` values) whose outputs fill whole Q8_K blocks,
/// which split attention writes as blocks too (`head_q8_k_blocks` in kernels/attention.cu):
/// `256 / hd` heads a group where `hd` divides 256, each head its own where 256 divides `hd`;
/// `None` for other heads, or rows not of whole blocks.
pub fn attention_q8_groups(n_heads: usize, hd: usize) -> Option<usize> {
    let width = n_heads * hd;
    let per = match hd {
        0 => return None,
        h if 256 % h == 0 => 256 / h,
        h if h % 256 == 0 => 1,
        _ => return None,
    };
    (n_heads > 0 && width.is_multiple_of(256) && n_heads.is_multiple_of(per)).then_some(n_heads / per)
}

/// One thread per element of a row of `width`, one row of blocks per row.
pub(super) fn rows_cfg(width: usize, rows: usize) -> LaunchConfig {
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

/// Weight rows, tokens and threads of a tensor-core product's block (`MMA_BM`, `MMA_BN`,
/// `MMA_THREADS` in kernels/mma.cu).
pub(super) const MMA_ROWS: usize = 64;
pub(super) const MMA_TOKENS: usize = 64;
pub(super) const MMA_THREADS: u32 = 128;

/// Blocks a tensor-core product aims for (two an H100 multiprocessor): fewer tiles than this
/// split the rows' units into parts.
pub(super) const MMA_TARGET_BLOCKS: usize = 264;
/// The fewest 32-value units a part of a split product sums.
pub(super) const MMA_MIN_PART_UNITS: usize = 16;

/// A tensor-core product's grid: a block per `MMA_ROWS` rows by `MMA_TOKENS` tokens by part of
/// the columns (see `mma_body`), parts enough to reach [`MMA_TARGET_BLOCKS`] blocks while each
/// sums at least [`MMA_MIN_PART_UNITS`] units.
pub fn mma_cfg(rows_out: usize, n: usize, cols: usize) -> LaunchConfig {
    tiles_cfg(rows_out, n, cols / 32 / MMA_MIN_PART_UNITS)
}

/// The fewest super-blocks a part of a split integer-tile product sums.
pub(super) const MMQ_MIN_PART_SUPER_BLOCKS: usize = 2;

/// An integer-tile product's grid (`mmq_*`): as [`mma_cfg`]'s, the parts splitting the rows'
/// super-blocks (at least [`MMQ_MIN_PART_SUPER_BLOCKS`] each).
pub fn mmq_cfg(rows_out: usize, n: usize, cols: usize) -> LaunchConfig {
    tiles_cfg(rows_out, n, cols / 256 / MMQ_MIN_PART_SUPER_BLOCKS)
}

/// A block per tile of rows by tokens by part, at most `max_parts` parts.
fn tiles_cfg(rows_out: usize, n: usize, max_parts: usize) -> LaunchConfig {
    let (row_tiles, token_tiles) = (rows_out.div_ceil(MMA_ROWS).max(1), n.div_ceil(MMA_TOKENS).max(1));
    let parts = MMA_TARGET_BLOCKS
        .div_ceil(row_tiles * token_tiles)
        .min(max_parts)
        .max(1);
    LaunchConfig {
        grid_dim: (row_tiles as u32, token_tiles as u32, parts as u32),
        block_dim: (MMA_THREADS, 1, 1),
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
/// to take [`NORM_PER_THREAD`] values of the row, whole warps, at most 1024. A norm fused into
/// the last block of a product (`then_add_rms_norm`) runs as this many virtual threads, so it
/// sums in the same order.
pub fn norm_threads(width: usize) -> u32 {
    (width.div_ceil(NORM_PER_THREAD).next_multiple_of(32)).clamp(32, 1024) as u32
}

/// Values of a row each thread of a norm's block takes.
pub(super) const NORM_PER_THREAD: usize = 4;

/// A norm's launch: one block of [`norm_threads`] per row.
pub(super) fn norm_cfg(rows: usize, width: usize) -> LaunchConfig {
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
