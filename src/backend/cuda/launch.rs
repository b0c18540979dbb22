//! Typed launchers: one method per kernel of `kernels/*.cu` ([`CudaDevice::k`]), its parameters
//! named and typed in the order of the kernel's `extern "C"` signature; a family of per-type
//! kernels (`matmul_q4_k`, `matmul_q8_0`, …) is one launcher taking the weight type. A launch
//! cannot pass a wrong count or kind of argument. Before it is queued, the launcher checks what
//! the kernel takes for granted: a grid of at least one block, every pointer the kernel reads
//! or writes non-null (those it may take as 0, "none", are declared `Opt`), every `int` within
//! an `i32` (a wrapped count would read the wrong memory), and each kernel's own conditions
//! (`if`). A test holds every list to the signatures in the source.
//!
//! Each launcher has a record too ([`params`], named as the launcher): one field per parameter,
//! named and typed as the launcher takes it. A recorded launch's arguments read as a record
//! (`from_args`: `None` for another count or kind of argument) give back the words they were
//! read from (`words`: pointers and counts as they are, an `int` sign-extended, a float's bits),
//! and a record launches through its launcher (`launch`), checked as any launch. A fusion reads
//! the launch it takes back as its kernel's record, matches on its fields, and launches the
//! kernel that does more from that kernel's own record, built from the fields.

use super::*;

/// A kernel parameter's kind, as its `extern "C"` signature declares it: what each launcher's
/// parameters are declared as (their Rust type and check are [`arg`]'s function of the same
/// name); the test holds the declarations to the source.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// A device pointer the kernel dereferences: never 0.
    Ptr,
    /// A device pointer the kernel may take as 0 ("none": all rows, no bias, no blocks).
    Opt,
    /// A `u64` count or byte stride.
    U64,
    /// An `int`.
    I32,
    /// A `float`.
    F32,
}

#[cfg(test)]
impl Kind {
    /// The kind a parameter's C type has (the test's reading of the source).
    fn of_c_type(decl: &str) -> Option<Kind> {
        let ty = decl.rsplit_once(' ').map_or(decl, |(t, _)| t).trim();
        match ty {
            t if t.ends_with('*') => Some(Kind::Ptr),
            "u64" => Some(Kind::U64),
            "int" => Some(Kind::I32),
            "float" => Some(Kind::F32),
            _ => None,
        }
    }

    /// Whether a parameter of this kind may be declared as one of `source` kind (a nullable
    /// pointer is a pointer).
    fn declares(self, source: Kind) -> bool {
        self == source || (self == Kind::Opt && source == Kind::Ptr)
    }
}

/// The launchers of one device (see the module docs).
pub(super) struct Kernels<'a>(&'a CudaDevice);

impl CudaDevice {
    /// The typed launchers (see [`launch`](self)).
    pub(super) fn k(&self) -> Kernels<'_> {
        Kernels(self)
    }
}

/// Each kind's argument for parameter `name` of `kernel`, checked as the kind says: a launcher
/// calls the function its parameter's kind names.
#[allow(non_snake_case)]
mod arg {
    use super::Arg;

    pub(super) fn Ptr(kernel: &str, name: &str, p: u64) -> Arg {
        assert!(p != 0, "{kernel}: {name} is a null pointer");
        Arg::U64(p)
    }

    pub(super) fn Opt(_kernel: &str, _name: &str, p: u64) -> Arg {
        Arg::U64(p)
    }

    pub(super) fn U64(_kernel: &str, _name: &str, v: u64) -> Arg {
        Arg::U64(v)
    }

    pub(super) fn I32(kernel: &str, name: &str, v: usize) -> Arg {
        Arg::I32(i32::try_from(v).unwrap_or_else(|_| panic!("{kernel}: {name} = {v} does not fit the kernel's int")))
    }

    pub(super) fn F32(_kernel: &str, _name: &str, v: f32) -> Arg {
        Arg::F32(v)
    }
}

macro_rules! rust_type {
    (Ptr) => {
        u64
    };
    (Opt) => {
        u64
    };
    (U64) => {
        u64
    };
    (I32) => {
        usize
    };
    (F32) => {
        f32
    };
}

/// The kernel a launcher launches: its own, or the one of its family it was given (checked).
macro_rules! launch_name {
    ($launcher:ident) => {
        stringify!($launcher)
    };
    ($launcher:ident $kernel:ident [$($alt:literal),+]) => {{
        assert!([$($alt),+].contains(&$kernel), "{} is not one of {:?}", $kernel, [$($alt),+]);
        $kernel
    }};
}

/// The weight type a per-type launcher was given, `None` for the others.
macro_rules! weight_type {
    () => {
        None
    };
    ($typed:ident) => {
        Some($typed)
    };
}

/// The kernels a launcher launches: its own name, or those of its family.
#[cfg(test)]
macro_rules! names {
    ($launcher:ident) => { &[stringify!($launcher)] };
    ($launcher:ident [$($alt:literal),+]) => { &[$($alt),+] };
}

/// `launcher [family names] <typed> (param: Kind, …) if condition;` — see the module docs.
macro_rules! kernels {
    ($(
        $(#[$doc:meta])*
        $launcher:ident $([$($alt:literal),+])? $(<$typed:ident>)? ( $($arg:ident : $kind:ident),* $(,)? )
        $(if $cond:expr)?;
    )*) => {
        /// Each launcher's kernels and their parameter kinds, in order (the test's table).
        #[cfg(test)]
        pub(super) const SIGNATURES: &[(&[&str], &[Kind])] = &[$((names!($launcher $([$($alt),+])?), &[$(Kind::$kind),*])),*];

        /// Each launcher's record, its parameters' kinds, and its record's words from a launch's
        /// arguments (the test's table: a record gives back the words it was read from).
        #[cfg(test)]
        pub(super) const RECORDS: &[(&str, &[Kind], fn(&[Arg]) -> Option<Vec<u64>>)] = &[$((
            stringify!($launcher),
            &[$(Kind::$kind),*],
            (|args| params::$launcher::from_args(args).map(|p| p.words())) as fn(&[Arg]) -> Option<Vec<u64>>,
        )),*];

        /// Each launcher's parameters as a record (see the module docs): one field per parameter,
        /// named as the launcher names it, of the type it takes.
        pub(super) mod params {
            // (Every launcher has its record, whether a fusion reads it or not.)
            #![allow(dead_code)]
            use super::*;
            $(
                #[doc = concat!("`", stringify!($launcher), "`'s parameters, in order.")]
                #[allow(non_camel_case_types)]
                #[derive(Clone, Copy, Debug, PartialEq)]
                pub(in super::super) struct $launcher {
                    $(pub(in super::super) $arg: rust_type!($kind)),*
                }

                impl $launcher {
                    /// How many parameters the kernel takes.
                    pub(in super::super) const COUNT: usize = [$(stringify!($arg)),*].len();

                    /// The record of a recorded launch's arguments: `None` unless they are as many
                    /// as the kernel takes, each of its parameter's kind.
                    pub(in super::super) fn from_args(args: &[Arg]) -> Option<Self> {
                        if args.len() != Self::COUNT {
                            return None;
                        }
                        let mut args = args.iter().copied();
                        Some(Self { $($arg: from_arg!($kind, args.next()?)?),* })
                    }

                    /// The parameters as words (see the module docs), in the kernel's order, after
                    /// `out`'s.
                    pub(in super::super) fn push_words(&self, out: &mut Vec<u64>) {
                        $(out.push(to_word!($kind, self.$arg));)*
                    }

                    /// The parameters as words (see the module docs), in the kernel's order.
                    pub(in super::super) fn words(&self) -> Vec<u64> {
                        let mut out = Vec::with_capacity(Self::COUNT);
                        self.push_words(&mut out);
                        out
                    }

                    /// Launches the kernel (`kernel` of a family; weight type `ty` of a per-type
                    /// one) with these parameters through its launcher, checked as a launch.
                    pub(in super::super) fn launch(
                        &self,
                        kernels: &Kernels<'_>,
                        $(kernel: kernel_name!($($alt),+),)?
                        $($typed: GgmlType,)?
                        cfg: LaunchConfig,
                    ) {
                        kernels.$launcher($(family_arg!(kernel; $($alt)+),)? $($typed,)? cfg, $(self.$arg),*);
                    }
                }
            )*
        }

        impl Kernels<'_> {
            $(
                $(#[$doc])*
                #[allow(clippy::too_many_arguments)]
                pub(super) fn $launcher(
                    &self,
                    $(kernel: kernel_name!($($alt),+),)?
                    $($typed: GgmlType,)?
                    cfg: LaunchConfig,
                    $($arg: rust_type!($kind)),*
                ) {
                    let name: &'static str = launch_name!($launcher $(kernel [$($alt),+])?);
                    let weight_type: Option<GgmlType> = weight_type!($($typed)?);
                    let (g, b) = (cfg.grid_dim, cfg.block_dim);
                    assert!(
                        g.0 * g.1 * g.2 > 0 && b.0 * b.1 * b.2 > 0,
                        "{name}: a launch of {g:?} blocks of {b:?} threads"
                    );
                    $(assert!($cond, "{name}: {}", stringify!($cond));)?
                    self.0.launch(name, weight_type, cfg, &[$(arg::$kind(name, stringify!($arg), $arg)),*]);
                }
            )*
        }
    };
}

/// A family launcher's `kernel` parameter: one of its names.
macro_rules! kernel_name {
    ($($alt:literal),+) => { &'static str };
}

/// A record's field of kind `$kind` from a recorded launch's argument (`$a`, an [`Arg`]): `None`
/// when the argument is of another kind.
macro_rules! from_arg {
    (Ptr, $a:expr) => {
        match $a {
            Arg::U64(v) => Some(v),
            _ => None,
        }
    };
    (Opt, $a:expr) => {
        from_arg!(Ptr, $a)
    };
    (U64, $a:expr) => {
        from_arg!(Ptr, $a)
    };
    (I32, $a:expr) => {
        match $a {
            Arg::I32(v) => Some(v as usize),
            _ => None,
        }
    };
    (F32, $a:expr) => {
        match $a {
            Arg::F32(v) => Some(v),
            _ => None,
        }
    };
}

/// A record's field of kind `$kind` as a word: what the argument it was read from was, an `int`
/// sign-extended, a float's bits.
macro_rules! to_word {
    (Ptr, $v:expr) => {
        $v
    };
    (Opt, $v:expr) => {
        $v
    };
    (U64, $v:expr) => {
        $v
    };
    (I32, $v:expr) => {
        $v as u64
    };
    (F32, $v:expr) => {
        u64::from($v.to_bits())
    };
}

/// A record's first argument to a family's launcher: the kernel of the family it was given.
macro_rules! family_arg {
    ($name:expr; $($alt:literal)+) => {
        $name
    };
}

kernels! {
    /// `x += y`, `len` values.
    add(x: Ptr, y: Ptr, len: U64);
    /// `x *= y`, `len` values.
    mul(x: Ptr, y: Ptr, len: U64);
    /// `x += b` per row of `width`.
    add_bias(x: Ptr, b: Ptr, width: I32, len: U64) if width > 0;
    /// `x = act(x)` (`f`: an ACT_* code).
    activate(x: Ptr, f: I32, len: U64);
    /// `up = act(gate) · up`.
    activate_mul(up: Ptr, gate: Ptr, f: I32, len: U64);
    /// As `activate_mul`, and its rows as Q8_K blocks into `out`.
    activate_mul_q8_k(up: Ptr, gate: Ptr, f: I32, out: Ptr, blocks: U64);
    /// `x = cap · tanh(x / cap)`.
    softcap(x: Ptr, cap: F32, len: U64);
    /// RMSNorm of each row into `y`, and into Q8_K blocks at `q8` unless 0.
    rms_norm(x: Ptr, w: Ptr, y: Ptr, width: I32, eps: F32, q8: Opt);
    /// `x += a`, then RMSNorm of `x` into `y` (and `q8` unless 0).
    add_rms_norm(x: Ptr, a: Ptr, w: Ptr, y: Ptr, width: I32, eps: F32, q8: Opt);
    /// The rows `rows` of `x` into `out`.
    select_rows(x: Ptr, rows: Ptr, width: I32, out: Ptr);
    /// `x`'s `m` columns into columns `cols` of `out` (zero elsewhere).
    scatter_cols(x: Ptr, cols: Ptr, m: I32, width: I32, out: Ptr);
    /// Columns `cols` of `x` (`m` of them) into `out`.
    gather_cols(x: Ptr, cols: Ptr, m: I32, width: I32, out: Ptr);
    /// Each row's largest value's index, the `banned` ids left out.
    argmax_rows(x: Ptr, width: I32, banned: Opt, n_banned: I32, out: Ptr);
    /// Each row's `k` largest values with their ids (and with `lse`, the row's log-sum-exp).
    top_k_rows(x: Ptr, width: I32, banned: Opt, n_banned: I32, k: I32, lse: I32, out: Ptr)
        if (1..=TOP_K_THREADS as usize).contains(&k) && k <= width;
    /// Rotary embedding of the query and key heads (each head normed first where given): the
    /// leading `rd` dimensions of each, their angles divided by `factors` where given.
    rope_norm(
        q: Ptr, q_width: I32, q_norm: Opt, k: Ptr, k_width: I32, k_norm: Opt, hd: I32, rd: I32, positions: Ptr,
        base: F32, pos_scale: F32, style: I32, factors: Opt, eps: F32,
    ) if hd > 0 && hd.is_multiple_of(2) && rd > 0 && rd.is_multiple_of(2) && rd <= hd;
    /// As `rope_norm`, writing the keys and `v` into the KV cache (`info`, `layer`) too.
    rope_norm_kv(
        q: Ptr, q_width: I32, q_norm: Opt, k: Ptr, k_width: I32, k_norm: Opt, hd: I32, rd: I32, positions: Ptr,
        base: F32, pos_scale: F32, style: I32, factors: Opt, eps: F32, v: Ptr, info: Ptr, layer: I32,
    ) if hd > 0 && hd.is_multiple_of(2) && rd > 0 && rd.is_multiple_of(2) && rd <= hd;
    /// Each token's keys and values into the KV cache.
    kv_write(k: Ptr, v: Ptr, info: Ptr, layer: I32, kvd: I32);
    /// Attention of each token's query heads over its sequence's cache (with each head's sink in
    /// its softmax where `sinks` are given).
    attention(
        q: Ptr, info: Ptr, layer: I32, n_heads: I32, n_kv_heads: I32, hd: I32, scale: F32, window: I32,
        sinks: Opt, scores: Ptr, max_len: I32, out: Ptr,
    ) if hd <= ATTN_MAX_HEAD_DIM && n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads);
    /// The same split over positions (`grid.z` splits of `chunk`): the output itself with one
    /// split, else each split's maximum, sum and sums into `part` for `attention_merge` — or,
    /// given `done` (zeroed counters, one per query head and token), merged by the last split;
    /// given `q8` (one split or `done`; zeroed counters `q8done`, one per token and group of
    /// heads filling whole Q8_K blocks), the output's Q8_K blocks there too.
    attention_split(
        q: Ptr, info: Ptr, layer: I32, n_heads: I32, n_kv_heads: I32, hd: I32, scale: F32, window: I32,
        sinks: Opt, chunk: I32, part: Opt, done: Opt, out: Ptr, q8: Opt, q8done: Opt,
    ) if hd <= ATTN_MAX_HEAD_DIM && n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads) && chunk > 0
        && (q8 == 0 || (q8done != 0 && attention_q8_groups(n_heads, hd).is_some()));
    /// The splits of `attention_split` into each head's output (with its sink where given).
    attention_merge(part: Ptr, n_heads: I32, hd: I32, splits: I32, sinks: Opt, out: Ptr)
        if splits > 1 && splits <= ATTN_SPLIT_TARGET_BLOCKS;
    /// The same for the tiles of runs of a sequence's tokens (`tiles`: (first, count) pairs).
    attention_tiles(
        q: Ptr, info: Ptr, tiles: Ptr, layer: I32, n_heads: I32, n_kv_heads: I32, hd: I32, scale: F32, window: I32,
        sinks: Opt, out: Ptr,
    ) if hd <= ATTN_TILE_MAX_HEAD_DIM && n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads);
    /// 8-bit activations: `blocks` blocks of 32 (Q8_0) or 256 (Q8_K) values of `x` into `y`.
    act_q8 ["act_q8_32", "act_q8_k"] (x: Ptr, y: Ptr, blocks: U64);
    /// Q8_K blocks of `x` as the integer products take them.
    act_q8_k_blocks(x: Ptr, out: Ptr, blocks: U64);
    /// `x` as the tensor cores take it: rows scaled by powers of two, split into two f16 each.
    act_f16_rows(x: Ptr, cols: I32, n: I32, out: Ptr) if cols.is_multiple_of(32);
    /// `y = x · w[row_ids]` (all rows when 0) for `n` tokens: the FMA loops (`matmul`, and
    /// `matvec*` for one token) or the tensor cores (`mma`, `x` from `act_f16_rows`).
    product ["matmul", "matvec", "matvec2", "matvec4", "mma"] <ty> (
        w: Ptr, row_stride: U64, rows_out: I32, row_ids: Opt, cols: I32, x: Ptr, n: I32, y: Ptr,
    ) if cols.is_multiple_of(ty.block_elems());
    /// Rows `ids` of `w` (times `scale`) into `out`.
    embed<ty>(w: Ptr, row_stride: U64, ids: Ptr, cols: I32, scale: F32, out: Ptr);
    /// `partial += acts · w[rows]` over neuron-major rows (all `w_rows` when `rows` is 0; rows
    /// from `split` on in `w2`), in `grid.z` ordered parts.
    accumulate<ty>(
        w: Ptr, row_stride: U64, w_rows: I32, rows: Opt, n_rows: I32, cols: I32, acts: Ptr, n: I32,
        partial: Ptr, w2: Opt, row_stride2: U64, split: I32,
    ) if split <= w_rows;
    /// `out += Σ parts` of `partial`, in order.
    accumulate_reduce(partial: Ptr, parts: I32, len: U64, out: Ptr) if parts > 0;
    /// `y = x · w[row_ids] (+ bias)` for `n` tokens with integer dot products: one token as Q8_K
    /// blocks (`matvec_i8`) or values the kernel quantizes (`matvec_i8f`), `n` tokens' blocks,
    /// token after token, each weight super-block read once for all (`matvec_i8n`).
    product_i8 ["matvec_i8", "matvec_i8f", "matvec_i8n"] <ty> (
        w: Ptr, row_stride: U64, rows_out: I32, row_ids: Opt, cols: I32, x: Ptr, n: I32, bias: Opt, wpr: I32, y: Ptr,
    ) if (1..=I8N_MAX).contains(&n) && x.is_multiple_of(16);
    /// A one-token `product_i8` (`matvec_i8`, `matvec_i8f`), then in its last block what
    /// `add_rms_norm` of its output in `vt` threads does: `res += y`, `out` = RMSNorm of `res`
    /// with `nw` (and `q8` unless 0); `done` a zeroed counter.
    product_i8_norm ["matvec_i8_norm", "matvec_i8f_norm"] <ty> (
        w: Ptr, row_stride: U64, rows_out: I32, row_ids: Opt, cols: I32, x: Ptr, n: I32, bias: Opt, wpr: I32, y: Ptr,
        res: Ptr, nw: Ptr, out: Ptr, eps: F32, q8: Opt, vt: I32, done: Ptr,
    ) if n == 1 && x.is_multiple_of(16) && vt.is_multiple_of(32) && (32..=1024).contains(&vt);
    /// `matvec_i8n` of `n` tokens (at most a block's warps), then what `add_rms_norm` of its `n`
    /// output rows does, by its last block (warp t row t); `done` a zeroed counter.
    matvec_i8n_norm<ty>(
        w: Ptr, row_stride: U64, rows_out: I32, row_ids: Opt, cols: I32, x: Ptr, n: I32, bias: Opt, wpr: I32, y: Ptr,
        res: Ptr, nw: Ptr, out: Ptr, eps: F32, q8: Opt, vt: I32, done: Ptr,
    ) if (1..=I8N_MAX.min(MATMUL_WARPS as usize)).contains(&n) && x.is_multiple_of(16) && vt.is_multiple_of(32)
        && (32..=1024).contains(&vt);
    /// `y = x · w[row_ids]` for `n` tokens as integer tiles on the tensor cores, `x` as Q8_K
    /// blocks, token after token (in `grid.z` parts as `accumulate`'s); `mmq` loads the next
    /// super-block's weights while it multiplies, `mmq_plain` when it unpacks them.
    mmq ["mmq", "mmq_plain"] <ty> (w: Ptr, row_stride: U64, rows_out: I32, row_ids: Opt, cols: I32, x: Ptr, n: I32, y: Ptr)
        if cols.is_multiple_of(256) && n > 0;
    /// Up to three products of one Q8_K input in one launch (absent ones all 0). Q8_K blocks
    /// start at a multiple of 16 bytes (the kernels read a lane's quants 16 bytes at a time).
    matvec_i8x3<ty>(
        xq: Ptr, cols: I32, wpr: I32, nb0: I32, nb01: I32,
        w0: Ptr, s0: U64, r0: I32, b0: Opt, y0: Ptr,
        w1: Opt, s1: U64, r1: I32, b1: Opt, y1: Opt,
        w2: Opt, s2: U64, r2: I32, b2: Opt, y2: Opt,
    ) if xq.is_multiple_of(16);
    /// `matvec_i8x3` for weights of different types (`t0`, `t1`, `t2`: their codes,
    /// `i8_type_code`).
    matvec_i8x3_mixed(
        xq: Ptr, cols: I32, wpr: I32, nb0: I32, nb01: I32,
        t0: I32, w0: Ptr, s0: U64, r0: I32, b0: Opt, y0: Ptr,
        t1: I32, w1: Opt, s1: U64, r1: I32, b1: Opt, y1: Opt,
        t2: I32, w2: Opt, s2: U64, r2: I32, b2: Opt, y2: Opt,
    ) if xq.is_multiple_of(16);
    /// Up to three weights' products with `n` tokens as Q8_K blocks (`matvec_i8n`'s sums) in one
    /// launch, each weight's type code `t0` .. `t2`.
    matvec_i8nx3(
        xq: Ptr, n: I32, cols: I32, wpr: I32, nb0: I32, nb01: I32,
        t0: I32, w0: Ptr, s0: U64, r0: I32, b0: Opt, y0: Ptr,
        t1: I32, w1: Opt, s1: U64, r1: I32, b1: Opt, y1: Opt,
        t2: I32, w2: Opt, s2: U64, r2: I32, b2: Opt, y2: Opt,
    ) if xq.is_multiple_of(16) && (1..=I8N_MAX).contains(&n);
    /// `matvec_i8nx3` of `n` tokens' gate (`w0`) and up (`w1`) products of `r0` rows (a multiple
    /// of 256), then each token's `activate_mul_q8_k` (`f`; Q8_K blocks into `out`) by the last
    /// of each 256 rows' blocks (warp t token t); `done`: zeroed counters, one per 256 rows.
    matvec_i8nx3_act(
        xq: Ptr, n: I32, cols: I32, wpr: I32, nb0: I32, nb01: I32,
        t0: I32, w0: Ptr, s0: U64, r0: I32, b0: Opt, y0: Ptr,
        t1: I32, w1: Ptr, s1: U64, r1: I32, b1: Opt, y1: Ptr,
        t2: I32, w2: Opt, s2: U64, r2: I32, b2: Opt, y2: Opt,
        f: I32, out: Ptr, done: Ptr,
    ) if xq.is_multiple_of(16) && (1..=I8N_MAX.min(MATMUL_WARPS as usize)).contains(&n) && r0.is_multiple_of(256)
        && r1 == r0 && w2 == 0;
    /// `matvec_i8nx3` of `n` tokens' Q, K and V weights, then `rope_norm_kv` of their outputs
    /// by the last block of each head's rows (warp t token t, as a block of `vt` threads);
    /// `done`: zeroed counters, one per query, key and value head.
    matvec_i8nx3_rope_kv(
        xq: Ptr, n: I32, cols: I32, wpr: I32, nb0: I32, nb01: I32,
        t0: I32, w0: Ptr, s0: U64, r0: I32, b0: Opt, y0: Ptr,
        t1: I32, w1: Ptr, s1: U64, r1: I32, b1: Opt, y1: Ptr,
        t2: I32, w2: Ptr, s2: U64, r2: I32, b2: Opt, y2: Ptr,
        q_norm: Opt, k_norm: Opt, hd: I32, rd: I32, positions: Ptr, base: F32, pos_scale: F32, style: I32,
        factors: Opt, eps: F32, info: Ptr, layer: I32, vt: I32, done: Ptr,
    ) if xq.is_multiple_of(16) && (1..=I8N_MAX.min(MATMUL_WARPS as usize)).contains(&n) && hd > 0
        && hd.is_multiple_of(2) && rd > 0 && rd.is_multiple_of(2) && rd <= hd && r0.is_multiple_of(hd) && r1 == r2
        && r1.is_multiple_of(hd) && vt.is_multiple_of(32);
    /// `matvec_i8x3_mixed` of a token's Q, K and V weights, then `rope_norm_kv` of their
    /// outputs (as a block of `vt` threads) by the last block of each head's rows; `done`: zeroed
    /// counters, one per query, key and value head.
    matvec_i8x3_rope_kv(
        xq: Ptr, cols: I32, wpr: I32, nb0: I32, nb01: I32,
        t0: I32, w0: Ptr, s0: U64, r0: I32, b0: Opt, y0: Ptr,
        t1: I32, w1: Ptr, s1: U64, r1: I32, b1: Opt, y1: Ptr,
        t2: I32, w2: Ptr, s2: U64, r2: I32, b2: Opt, y2: Ptr,
        q_norm: Opt, k_norm: Opt, hd: I32, rd: I32, positions: Ptr, base: F32, pos_scale: F32, style: I32,
        factors: Opt, eps: F32, info: Ptr, layer: I32, vt: I32, done: Ptr,
    ) if xq.is_multiple_of(16) && hd > 0 && hd.is_multiple_of(2) && rd > 0 && rd.is_multiple_of(2) && rd <= hd
        && r0.is_multiple_of(hd) && r1 == r2 && r1.is_multiple_of(hd) && vt.is_multiple_of(32) && vt <= 256;
    /// `matvec_i8x3` of a gate (`w0`) and an up (`w1`) weight of `r0` rows (a multiple of 256),
    /// then `activate_mul_q8_k` of their outputs (`f`; the Q8_K blocks into `out`) by the last
    /// of each 256 rows' blocks; `done`: zeroed counters, one per 256 rows.
    matvec_i8x3_act<ty>(
        xq: Ptr, cols: I32, wpr: I32, nb0: I32, nb01: I32,
        w0: Ptr, s0: U64, r0: I32, b0: Opt, y0: Ptr,
        w1: Ptr, s1: U64, r1: I32, b1: Opt, y1: Ptr,
        w2: Opt, s2: U64, r2: I32, b2: Opt, y2: Opt,
        f: I32, out: Ptr, done: Ptr,
    ) if xq.is_multiple_of(16) && r0.is_multiple_of(256) && r1 == r0 && w2 == 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The source's `extern "C" __global__` kernels: base name (a macro family's `NAME##` part
    /// left off) and parameter kinds.
    fn source_signatures() -> Vec<(String, Vec<Kind>)> {
        let src = nvrtc::source().replace("\\\n", " ");
        let mut out = Vec::new();
        let mut rest = &src[..];
        while let Some(at) = rest.find("extern \"C\" __global__ void ") {
            rest = &rest[at + "extern \"C\" __global__ void ".len()..];
            let open = rest.find('(').expect("a parameter list");
            // (after launch bounds, where a kernel has them: the name is the last word)
            let name = rest[..open].split_whitespace().last().expect("a kernel's name");
            let name = name.split("_##").next().unwrap_or(name).to_string();
            let close = rest.find(')').expect("the list's end");
            let kinds = rest[open + 1..close]
                .split(',')
                .map(|p| Kind::of_c_type(p.trim()).unwrap_or_else(|| panic!("{name}: a parameter `{}`", p.trim())))
                .collect();
            out.push((name, kinds));
        }
        out
    }

    /// Every launcher's parameters are its kernels' in the source (same count, same kinds, a
    /// nullable pointer a pointer), and every kernel in the source has a launcher.
    #[test]
    fn signatures_match_the_kernel_source() {
        let source = source_signatures();
        assert!(source.len() >= 30, "{} kernels found", source.len());
        for (names, kinds) in SIGNATURES {
            for name in *names {
                let (_, src) = source
                    .iter()
                    .find(|(n, _)| n == name)
                    .unwrap_or_else(|| panic!("{name}: no kernel of that name in kernels/"));
                assert_eq!(kinds.len(), src.len(), "{name}: {kinds:?} against the source's {src:?}");
                for (i, (k, s)) in kinds.iter().zip(src).enumerate() {
                    assert!(k.declares(*s), "{name}: parameter {i} is {k:?}, the source's {s:?}");
                }
            }
        }
        for (name, _) in &source {
            assert!(
                SIGNATURES.iter().any(|(names, _)| names.contains(&name.as_str())),
                "{name}: a kernel without a launcher"
            );
        }
    }

    /// Every launcher's record reads a launch's arguments back as the words they were (each
    /// kind's argument: pointers and counts, negative ints, floats by their bits), and refuses
    /// one argument too few or too many, or an argument of another kind.
    #[test]
    fn records_give_back_the_words_they_were_read_from() {
        assert_eq!(RECORDS.len(), SIGNATURES.len());
        for (name, kinds, words) in RECORDS {
            let args: Vec<Arg> = kinds
                .iter()
                .enumerate()
                .map(|(i, kind)| match kind {
                    Kind::Ptr | Kind::Opt | Kind::U64 => Arg::U64(0x7f00_0000_0000 + 256 * i as u64),
                    Kind::I32 if i % 2 == 0 => Arg::I32(i as i32 + 1),
                    Kind::I32 => Arg::I32(-(i as i32) - 1),
                    Kind::F32 => Arg::F32(i as f32 + 0.25),
                })
                .collect();
            let bits: Vec<u64> = args.iter().map(|a| a.bits()).collect();
            assert_eq!(words(&args).as_deref(), Some(&bits[..]), "{name}");
            assert_eq!(words(&args[1..]), None, "{name}: one argument too few");
            assert_eq!(
                words(&[&args[..], &[Arg::U64(1)]].concat()),
                None,
                "{name}: one too many"
            );
            for (i, kind) in kinds.iter().enumerate() {
                let mut other = args.clone();
                other[i] = match kind {
                    Kind::I32 => Arg::F32(1.0),
                    _ => Arg::I32(1),
                };
                assert_eq!(words(&other), None, "{name}: argument {i} of another kind");
            }
        }
        let p = params::add_bias::from_args(&[Arg::U64(16), Arg::U64(32), Arg::I32(8), Arg::U64(64)]);
        assert_eq!(
            p,
            Some(params::add_bias {
                x: 16,
                b: 32,
                width: 8,
                len: 64
            })
        );
    }

    /// The checks a launcher makes before it queues anything.
    #[test]
    fn launchers_refuse_what_a_kernel_cannot_take() {
        let refuses = |what: &str, f: &dyn Fn()| {
            let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err(what);
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            msg
        };
        assert!(refuses("null", &|| {
            arg::Ptr("add", "x", 0);
        })
        .contains("add: x is a null pointer"));
        assert!(matches!(arg::Opt("rms_norm", "q8", 0), Arg::U64(0)));
        assert!(refuses("wide", &|| {
            arg::I32("matmul", "n", 1 << 31);
        })
        .contains("matmul: n = 2147483648 does not fit the kernel's int"));
        assert!(matches!(arg::I32("matmul", "n", i32::MAX as usize), Arg::I32(i32::MAX)));
    }
}
