//! Opening a streamer: the residency plan under the budget (the KV cache and one batch's
//! activations counted), the readers and the planner's cost model, the resident copies (or
//! views of a map of the file for the mmap engine), the neuron caches' first fill, the dense
//! prefetch ranges and the staging buffers. The model is only read.

use std::sync::{Arc, Mutex};

use super::cache::{CachePolicy, LayerCache};
use super::plan::{self, plan, CostModel};
use super::prefetch::Prefetcher;
use super::residency::{DeviceResidency, ModelSizes, Residency};
use super::{
    activation_bytes_per_token, CostSource, FfnViews, LayerParts, Lookahead, Part, Readers, State, StreamOptions,
    Streamer,
};
use crate::error::{Error, Result};
use crate::io::{open_parts_reader, ReadEngine, Reader};
use crate::model::forward::AttnWeights;
use crate::model::weights::FfnDown;
use crate::model::Model;
use crate::tensor::Weight;

impl Streamer {
    /// Plans residency for `model` (loaded from a `.gst` file) under the budget, loads what is
    /// resident into memory (reading it past the page cache where the engine allows), and makes
    /// the model's remaining weights streamed.
    ///
    /// The model is only read: a streamer keeps its own resident copies (or, for the mmap
    /// engine, views of its own map), so one model can back several streamers and is best
    /// loaded with `Placement::OnDisk`, which keeps no view of the file a pass without the
    /// stream could read.
    pub fn open(model: &Model, opts: &StreamOptions) -> Result<Streamer> {
        // Two readers: one for the compute thread's FFN reads, one for the prefetch thread.
        let roles = reader_roles(opts, model.config.moe.is_some(), section_max_bytes(model));
        let open = |o: &crate::io::ReaderOptions| -> Result<(Arc<dyn Reader>, bool, Vec<String>)> {
            let o = open_parts_reader(&model.path, &model.parts, opts.engine, o)?;
            Ok((Arc::from(o.reader), o.direct_io_active, o.warnings))
        };
        let (fg, direct_io, mut warnings) = open(&roles.fg)?;
        let (bg, _, w2) = open(&roles.bg)?;
        warnings.extend(w2.into_iter().filter(|w| !warnings.contains(w)).collect::<Vec<_>>());
        let ahead = if opts.lookahead != Lookahead::Off {
            Some(open(&roles.bg)?.0)
        } else {
            None
        };
        Streamer::with_readers(model, opts, Readers { fg, bg, ahead }, direct_io, warnings)
    }

    /// As `open`, with readers supplied (tests use simulated devices). The steps, each a function
    /// of its own: what can stream (`check_streamable`), each layer's parts and sizes
    /// (`dense_parts`), the residency plan (`plan_dense`) and the device's, the read planner's
    /// cost model (`read_cost`), the resident weights (`Resident::load`), the neuron caches'
    /// first fill (`first_fill`), the prefetch ranges and views (`prefetch_ranges`), the
    /// buffers and what the device locks of them (`Buffers::make`).
    pub fn with_readers(
        model: &Model,
        opts: &StreamOptions,
        readers: Readers,
        direct_io: bool,
        warnings: Vec<String>,
    ) -> Result<Streamer> {
        let Readers { fg, bg, ahead } = readers;
        let cfg = model.config.clone();
        // How the device reaches host memory: what the stream locks, maps and hands it.
        let link: &dyn crate::backend::HostLink = model.device.as_ref();
        check_streamable(model, opts)?;
        if cfg.moe.is_some() {
            return Streamer::open_experts(model, opts, Readers { fg, bg, ahead }, direct_io, warnings);
        }
        if opts.cache == super::cache::CachePolicy::Frequency {
            return Err(Error::Input(
                "--cache frequency ranks whole experts of a mixture-of-experts model; a dense model's neuron cache \
                 is lru or pinned"
                    .into(),
            ));
        }
        let (mut layers, mut sizes, rows_layout) = dense_parts(model, opts)?;
        let (residency, lookahead_on, warnings) = plan_dense(model, opts, &mut sizes, warnings)?;
        let device_plan = match opts.vram_budget_bytes {
            Some(v) => Some(sizes.plan_device(v, model.weights.output.len_bytes() as u64, &residency)?),
            None => None,
        };
        let (cost, max_read_bytes) = read_cost(opts, fg.as_ref())?;
        let resident = Resident::load(
            model,
            opts,
            &residency,
            device_plan.as_ref(),
            rows_layout,
            fg.as_ref(),
            &mut layers,
        )?;
        let (caches, hot) = first_fill(model, opts, &residency, device_plan.as_ref(), &layers, fg.as_ref())?;
        if opts.prefetch_ffn && !rows_layout {
            prefetch_ranges(opts, link, &residency, &caches, &hot, &mut layers);
        }
        let bufs = Buffers::make(
            &cfg,
            opts,
            link,
            &residency,
            rows_layout,
            &layers,
            &caches,
            &resident,
            bg.as_ref(),
        );
        let dense_bytes_per_token = dense_plan_bytes(&layers, &residency, &cost, resident.embedding.as_ref());
        fg.reset_stats();
        let prefetcher = Prefetcher::start(bg.clone(), opts.prefetch_read_bytes.max(crate::io::ALIGN_BYTES))?;
        let lookahead = match (lookahead_on, ahead) {
            (false, _) => None,
            (true, r) => {
                // Without a reader of its own it shares the prefetch thread's (tests).
                let r = r.unwrap_or_else(|| bg.clone());
                r.reset_stats();
                Some((Prefetcher::start(r.clone(), max_read_bytes as usize)?, r))
            }
        };
        let Resident {
            output,
            embedding,
            attn: resident_attn,
            gate: resident_gate,
            ffn: resident_ffn,
        } = resident;
        Ok(Streamer {
            batch_tokens_max: opts.batch_tokens_max.max(1),
            kv_positions: opts.kv_positions,
            read_bytes: opts.prefetch_read_bytes.max(crate::io::ALIGN_BYTES),
            residency,
            cost,
            engine: opts.engine,
            direct_io,
            warnings,
            dense_bytes_per_token,
            fg,
            bg,
            prefetcher,
            lookahead,
            layers,
            embedding,
            output,
            resident_attn,
            resident_gate,
            resident_ffn,
            hidden: cfg.hidden,
            pass: Mutex::new(()),
            _registered: bufs.registered,
            _pinned: bufs.pinned,
            state: Mutex::new(State {
                pinned: bufs.pinned_addrs,
                spare: bufs.dense,
                dense_pinned: bufs.dense_addrs,
                ..State::new(caches, bufs.staging_up, bufs.staging_down)
            }),
            decode_start: Mutex::new(None),
            link: model.device.clone(),
            device_plan,
            hot,
            experts: None,
            hybrid: None,
        })
    }
}

/// Why a model cannot stream: its file is none of those a stream reads.
fn not_streamable(model: &Model) -> Error {
    Error::Input(format!(
        "{}: streaming reads a GGUF file, a Hugging Face folder's safetensors or a .gst file; convert it \
         with `gatestream reformat`",
        model.path.display()
    ))
}

/// What any stream needs (a dense model's or a mixture's): a file a stream reads, and
/// `--vram-budget` only on a device with memory of its own.
fn check_streamable(model: &Model, opts: &StreamOptions) -> Result<()> {
    let link: &dyn crate::backend::HostLink = model.device.as_ref();
    if !model.path.is_dir() && !crate::gstfile::is_gst(&model.path) && !crate::gguf::is_gguf(&model.path) {
        return Err(not_streamable(model));
    }
    if let Some(v) = opts.vram_budget_bytes {
        if link.host_memory() {
            return Err(Error::Input(format!(
                "--vram-budget {v}: the model computes on the {}, which works in host memory; --vram-budget plans a \
                 GPU's memory (--device cuda)",
                model.device.name()
            )));
        }
    }
    Ok(())
}

/// A dense model's per-layer parts (its matrices' places) and the sizes the residency plan
/// weighs, and whether its FFN is in the `rows` layout (down as stored: whole matrices, no
/// neuron cache).
fn dense_parts(model: &Model, opts: &StreamOptions) -> Result<(Vec<LayerParts>, ModelSizes, bool)> {
    let cfg = &model.config;
    let not_gst = || not_streamable(model);
    let w = &model.weights;
    let mut layers = Vec::with_capacity(cfg.n_layers);
    let mut sizes = ModelSizes {
        n_layers: cfg.n_layers,
        ffn: cfg.ffn,
        required_bytes: w.output.len_bytes() as u64
            + w.output_norm.len() as u64 * 4
            + w.layers.iter().map(|l| l.vector_bytes()).sum::<u64>(),
        attention_bytes: Vec::new(),
        gate_bytes: Vec::new(),
        neuron_bytes: Vec::new(),
        prefetch_ffn: opts.prefetch_ffn,
        // Every reader's reusable buffers (set with the plan below).
        reader_bytes: 0,
        lookahead: false,
        context_bytes: crate::kv::KvCache::bytes_for(cfg, opts.kv_positions)
            + opts.batch_tokens_max.max(1) as u64 * activation_bytes_per_token(cfg),
        ffn_rows: None,
        prefetch_buffers: opts.prefetch_buffers.max(2),
    };
    // The `rows` layout (down as stored) streams its FFN as whole matrices, no neuron cache.
    let rows_layout = matches!(w.layers.first().map(|l| l.dense("streaming")).transpose()?, Some(f) if matches!(f.down, FfnDown::Rows(_)));
    let mut ffn_rows = super::residency::FfnRows {
        up_bytes: Vec::new(),
        down_bytes: Vec::new(),
    };
    for l in &w.layers {
        let ffn_w = l.dense("streaming")?;
        let down = match (&ffn_w.down, rows_layout) {
            (FfnDown::Columns(d), false) | (FfnDown::Rows(d), true) => d,
            _ => return Err(not_gst()),
        };
        let a = &l.attn;
        sizes
            .attention_bytes
            .push(a.matrices().iter().map(|w| w.len_bytes() as u64).sum());
        sizes.gate_bytes.push(ffn_w.gate.len_bytes() as u64);
        let (up_bytes, down_bytes) = (ffn_w.up.len_bytes() as u64, down.len_bytes() as u64);
        sizes.neuron_bytes.push(match rows_layout {
            // What a neuron's share of the two matrices is (the device plan's unit).
            true => (up_bytes + down_bytes).div_ceil(cfg.ffn.max(1) as u64),
            false => (ffn_w.up.row_bytes + down.row_bytes) as u64,
        });
        ffn_rows.up_bytes.push(up_bytes);
        ffn_rows.down_bytes.push(down_bytes);
        layers.push(LayerParts {
            attn: None,
            gate: None,
            up: Part::of(&ffn_w.up)?,
            down: Part::of(down)?,
            rows_up: None,
            rows_down: None,
            ffn_ranges: Vec::new(),
            views: None,
        });
    }
    if rows_layout {
        sizes.ffn_rows = Some(ffn_rows);
        // Nothing of the FFN is read neuron by neuron.
        sizes.prefetch_ffn = false;
        if opts.lookahead != Lookahead::Off {
            return Err(Error::Input(format!(
                "{}: --lookahead reads a layer's predicted neurons ahead, and this file's FFN is in the rows \
                 layout (read whole); reformat with --ffn-layout split or bundled for neuron reads",
                model.path.display()
            )));
        }
    }
    Ok((layers, sizes, rows_layout))
}

/// The residency plan under the budget, the readers' buffers counted; lookahead from gates is
/// turned off where no layer's gate stays resident (its buffers are worth more as cache), with
/// a warning for it and for layers whose gates stream. Returns the plan, whether lookahead is
/// on, and the warnings.
fn plan_dense(
    model: &Model,
    opts: &StreamOptions,
    sizes: &mut ModelSizes,
    warnings: Vec<String>,
) -> Result<(Residency, bool, Vec<String>)> {
    let cfg = &model.config;
    let roles = reader_roles(opts, false, section_max_bytes(model));
    let plan_with = |sizes: &mut ModelSizes, lookahead: bool| {
        let bg_readers = if lookahead { 2 } else { 1 };
        sizes.reader_bytes = roles.fg.buffer_bytes() + bg_readers * roles.bg.buffer_bytes();
        sizes.lookahead = lookahead;
        let budget = match opts.budget_bytes {
            super::RAM_UNLIMITED => sizes.everything_bytes(),
            b => b,
        };
        sizes.plan(budget, opts.priority)
    };
    let mut residency = plan_with(sizes, opts.lookahead != Lookahead::Off)?;
    let mut warnings = warnings;
    let mut lookahead_on = opts.lookahead != Lookahead::Off;
    let streamed_gates = residency.gate_resident.iter().filter(|&&g| !g).count();
    if opts.lookahead == Lookahead::FromGates && streamed_gates == cfg.n_layers {
        // Nothing to predict with: the lookahead's buffers are worth more as cache.
        residency = plan_with(sizes, false)?;
        lookahead_on = false;
        warnings.push(
            "lookahead is off: this mask's lookahead predicts from resident gates, and no layer's gate is resident \
             under this budget (--residency gate-first or a larger --ram-budget keeps them; the exact criterion \
             needs none)"
                .into(),
        );
    } else if opts.lookahead == Lookahead::FromGates && streamed_gates > 0 {
        warnings.push(format!(
            "lookahead predicts from resident gates, and {streamed_gates} of {} layers' gates stream under this \
             budget: those layers get no lookahead (--residency gate-first or a larger --ram-budget keeps them; \
             the exact criterion needs none)",
            cfg.n_layers
        ));
    }
    Ok((residency, lookahead_on, warnings))
}

/// The read planner's cost model (probed, default or given) and the longest read it plans.
fn read_cost(opts: &StreamOptions, fg: &dyn Reader) -> Result<(CostModel, u64)> {
    // Reads stay within the reader's reusable buffers, even widened by a block at each end
    // (a larger read would get a one-off buffer and pay first-touch page faults).
    let max_read_bytes = opts
        .reader
        .slot_bytes
        .saturating_sub(2 * crate::io::ALIGN_BYTES)
        .max(crate::io::ALIGN_BYTES) as u64;
    let mut cost = match opts.cost {
        // Dense streaming plans no scattered reads (its reads are whole ranges, prefetched):
        // nothing to probe for, and its compute thread's reader has no slots to probe with.
        CostSource::Probe if !opts.prefetch_ffn => {
            plan::probe(fg, 1024, 32 << 20, opts.reader.slot_bytes, max_read_bytes)?
        }
        CostSource::Probe => CostModel {
            max_read_bytes,
            ..CostModel::default_for(fg.align_bytes() as u64)
        },
        CostSource::Default => CostModel {
            max_read_bytes,
            ..CostModel::default_for(fg.align_bytes() as u64)
        },
        CostSource::Given {
            request_us,
            bytes_per_us,
        } => CostModel {
            request_us,
            bytes_per_us,
            align_bytes: fg.align_bytes().max(1) as u64,
            max_read_bytes,
        },
    };
    if let Some(gap) = opts.merge_gap_bytes {
        cost.request_us = gap as f64 / cost.bytes_per_us;
    }
    Ok((cost, max_read_bytes))
}

/// The weights a dense stream keeps in memory: the output matrix, each layer's attention and
/// gate where the plan keeps them, and in the `rows` layout its whole up and down matrices;
/// the embedding's place when it is not the output matrix.
struct Resident {
    output: Weight,
    embedding: Option<Part>,
    attn: Vec<Option<AttnWeights>>,
    gate: Vec<Option<Weight>>,
    ffn: Vec<(Option<Weight>, Option<Weight>)>,
}

impl Resident {
    /// Loads what `residency` keeps — as views of a map of each file for the page-cache engine
    /// (the walk path), else read into memory once, in phase with the file (past the page
    /// cache where O_DIRECT is on) — marking what the device's plan does not keep volatile
    /// (copied at each use); what streams gets its place in `layers`.
    fn load(
        model: &Model,
        opts: &StreamOptions,
        residency: &Residency,
        device_plan: Option<&DeviceResidency>,
        rows_layout: bool,
        fg: &dyn Reader,
        layers: &mut [LayerParts],
    ) -> Result<Resident> {
        let cfg = &model.config;
        let tied = model.weights.output.file_offset() == model.weights.token_embd.file_offset();
        // What the device does not keep is copied to it at each use, as the stream's buffers are.
        let on_device = |w: Weight, keep: bool| if keep { w } else { w.volatile() };
        // Page-cache engines keep resident weights as views of a map of the file (the walk
        // path); the others copy them into memory once, bypassing the page cache where O_DIRECT
        // is on. Either way the streamer owns them: the model is not changed.
        // (One map per file of the model, each at its place.)
        let maps = match opts.engine {
            ReadEngine::Mmap => model
                .parts
                .iter()
                .map(|p| {
                    let f = std::fs::File::open(&p.path).map_err(|e| Error::io(&p.path, e))?;
                    // SAFETY: the file is opened read-only and the map is only read; like every
                    // map of a model file here, it assumes the file is not truncated while the
                    // process runs (the same assumption `gguf`, `safetensors` and `gstfile` make
                    // for theirs).
                    let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(&p.path, e))?;
                    Ok((p, Arc::new(m)))
                })
                .collect::<Result<Vec<_>>>()?,
            _ => Vec::new(),
        };
        let load = |w: &Weight| -> Result<Weight> {
            let offset = w.file_offset().ok_or_else(|| {
                Error::Internal(format!("{}: streaming needs the weight's place in the file", w.name))
            })?;
            match maps.iter().rev().find(|(p, _)| p.base_bytes <= offset) {
                Some((p, m)) => {
                    let at = (offset - p.base_bytes) as usize;
                    let end = at + w.len_bytes();
                    if end > m.len() {
                        return Err(Error::Input(format!(
                            "{}: {} ends at byte {end}, past the end of the file ({} bytes)",
                            p.path.display(),
                            w.name,
                            m.len()
                        )));
                    }
                    Ok(Weight::mapped(
                        &w.name,
                        w.ty,
                        w.rows,
                        w.cols,
                        m.clone(),
                        at,
                        w.row_stride_bytes,
                    ))
                }
                None => {
                    // In phase with the file: read in place, in huge pages.
                    let (bytes, at) = crate::io::read_in_phase(fg, offset, w.len_bytes())?;
                    Weight::shared(&w.name, w.ty, w.rows, w.cols, Arc::new(bytes), at)
                }
            }
        };
        let w = &model.weights;
        let output = on_device(load(&w.output)?, device_plan.is_none_or(|d| d.output_resident));
        let embedding = if tied { None } else { Some(Part::of(&w.token_embd)?) };
        let mut resident_attn = Vec::with_capacity(cfg.n_layers);
        let mut resident_gate = Vec::with_capacity(cfg.n_layers);
        let mut resident_ffn = Vec::new();
        for (l, lw) in w.layers.iter().enumerate() {
            let a = &lw.attn;
            let attn_kept = device_plan.is_none_or(|d| d.attention_resident[l]);
            let gate_kept = device_plan.is_none_or(|d| d.gate_resident[l]);
            if residency.attention_resident[l] {
                resident_attn.push(Some(a.try_map(&mut |w| Ok(on_device(load(w)?, attn_kept)))?));
            } else if a.mla.is_some() {
                return Err(Error::Input(format!(
                    "{}: latent attention is kept in memory when streaming, and this budget leaves no room for \
                     layer {l}'s; give a larger --ram-budget",
                    model.path.display()
                )));
            } else {
                resident_attn.push(None);
                layers[l].attn = Some([Part::of(&a.wq)?, Part::of(&a.wk)?, Part::of(&a.wv)?, Part::of(&a.wo)?]);
            }
            if residency.gate_resident[l] {
                resident_gate.push(Some(on_device(load(&lw.dense("streaming")?.gate)?, gate_kept)));
            } else {
                resident_gate.push(None);
                layers[l].gate = Some(Part::of(&lw.dense("streaming")?.gate)?);
            }
            if rows_layout {
                // Whole up and down matrices: resident (copied to a device at each use: its
                // plan keeps no FFN rows of this layout), or streamed with the layer.
                let f = lw.dense("streaming")?;
                let up = match residency.up_resident[l] {
                    true => Some(on_device(load(&f.up)?, false)),
                    false => {
                        layers[l].rows_up = Some(Part::of(&f.up)?);
                        None
                    }
                };
                let down = match residency.down_resident[l] {
                    true => Some(on_device(load(f.down.weight())?, false)),
                    false => {
                        layers[l].rows_down = Some(Part::of(f.down.weight())?);
                        None
                    }
                };
                resident_ffn.push((up, down));
            }
        }
        Ok(Resident {
            output,
            embedding,
            attn: resident_attn,
            gate: resident_gate,
            ffn: resident_ffn,
        })
    }
}

/// Each layer's neuron cache, filled with its first neurons (the hot prefix of a hot-first
/// file), and the device's hot neurons under a GPU budget (the layer's first `hot_neurons`: a
/// cache of the whole layer stays whole, never written again, and lends the device their
/// rows; a partial one holds the neurons after them).
#[allow(clippy::type_complexity)]
fn first_fill(
    model: &Model,
    opts: &StreamOptions,
    residency: &Residency,
    device_plan: Option<&DeviceResidency>,
    layers: &[LayerParts],
    fg: &dyn Reader,
) -> Result<(Vec<LayerCache>, Vec<Option<(Weight, Weight)>>)> {
    let cfg = &model.config;
    // Neuron caches start with each layer's first neurons (the hot prefix of a hot-first file).
    // Under a GPU budget the device keeps the plan's hot neurons, the layer's first: a cache
    // of the whole layer stays whole (never written again, it lends the device their rows),
    // a partial one holds the neurons after them.
    let mut caches = Vec::with_capacity(cfg.n_layers);
    let mut hot = Vec::with_capacity(cfg.n_layers);
    for (l, parts) in layers.iter().enumerate() {
        let slots = residency.cache_neurons[l];
        let k = device_plan.map_or(0, |d| d.hot_neurons[l]).min(slots);
        let whole = slots == cfg.ffn;
        let first = if whole { 0 } else { k };
        let mut c = LayerCache::new(
            opts.cache,
            cfg.ffn,
            slots - first,
            parts.up.row_bytes,
            parts.down.row_bytes,
        );
        // Up rows and down columns of neurons 0..slots, each row where the file's stride puts it.
        let (mut up, mut down) = (Vec::new(), Vec::new());
        if slots > 0 {
            let read_rows = |p: &Part| -> Result<Vec<u8>> {
                let r = p.range_of(slots);
                fg.read_vec(r.offset_bytes, r.len_bytes)
            };
            (up, down) = (read_rows(&parts.up)?, read_rows(&parts.down)?);
        }
        let row = |p: &Part, n: usize| -> std::ops::Range<usize> {
            let at = n * p.stride_bytes;
            at..at + p.row_bytes
        };
        for n in first..slots {
            c.fill(n - first, n as u32, &up[row(&parts.up, n)], &down[row(&parts.down, n)]);
        }
        hot.push(match (k, whole) {
            (0, _) => None,
            (_, true) => {
                let (ub, db) = c.buffers();
                Some((
                    parts.up.slots(ub, 0, k, cfg.hidden)?,
                    parts.down.slots(db, 0, k, cfg.hidden)?,
                ))
            }
            (_, false) => {
                let rows = |p: &Part, bytes: &[u8]| -> Result<Weight> {
                    let mut b = Vec::with_capacity(k * p.row_bytes);
                    (0..k).for_each(|n| b.extend_from_slice(&bytes[row(p, n)]));
                    Weight::owned(&p.name, p.ty, k, cfg.hidden, b)
                };
                Some((rows(&parts.up, &up)?, rows(&parts.down, &down)?))
            }
        });
        caches.push(c);
    }
    Ok((caches, hot))
}

/// Dense streaming's prefetch: each layer's FFN rows past its cache as exact ranges, and where
/// the pinned cache holds a layer's first rows, views that put them in front of the prefetched
/// ones (`FfnViews`).
fn prefetch_ranges(
    opts: &StreamOptions,
    link: &dyn crate::backend::HostLink,
    residency: &Residency,
    caches: &[LayerCache],
    hot: &[Option<(Weight, Weight)>],
    layers: &mut [LayerParts],
) {
    for (l, p) in layers.iter_mut().enumerate() {
        let spans = p.ffn_extents_from(residency.cache_neurons[l]);
        // Only touching rows merge: the ranges hold exactly the rows.
        let exact = CostModel {
            request_us: 0.0,
            bytes_per_us: 1.0,
            align_bytes: 1,
            max_read_bytes: u64::MAX,
        };
        let mut reads = Vec::new();
        plan(&spans, &exact, &mut reads);
        p.ffn_ranges = reads.iter().map(|r| r.range).collect();
    }
    // Dense steps take their FFN rows as views of the prefetch buffer, the pinned cache's
    // rows copied in front of the prefetched ones by the prefetch thread (see
    // `FfnViews`): strided views of a bundled file only on a device computing in host
    // memory.
    let contiguous = |p: &LayerParts| p.up.stride_bytes == p.up.row_bytes && p.down.stride_bytes == p.down.row_bytes;
    if opts.cache == CachePolicy::Pinned {
        for (l, p) in layers.iter_mut().enumerate() {
            if p.ffn_ranges.is_empty() || !(link.host_memory() || contiguous(p)) {
                continue;
            }
            let cached = residency.cache_neurons[l];
            let first = hot[l].as_ref().map_or(0, |(u, _): &(Weight, Weight)| u.rows);
            // Where each matrix's row `cached` (its first prefetched row) was read.
            let m = p.matrix_count();
            let place = |part: &Part| {
                let (o, _) = part.extent(cached as u32);
                p.ffn_ranges
                    .iter()
                    .position(|r| r.offset_bytes <= o && o < r.offset_bytes + r.len_bytes as u64)
                    .map(|j| (m + j, (o - p.ffn_ranges[j].offset_bytes) as usize))
            };
            let (ub, db) = caches[l].buffers();
            if let (Some(u), Some(d), true) = (place(&p.up), place(&p.down), first <= cached) {
                p.views = Some(FfnViews {
                    first,
                    cached,
                    cache_up: ub.clone(),
                    cache_down: db.clone(),
                    at: [u, d],
                });
            }
        }
    }
}

/// The stream's buffers — the FFN staging, the prefetch thread's, registered with its reader —
/// and what a device with memory of its own locks (or maps) of them and of the resident
/// weights it does not keep.
struct Buffers {
    staging_up: Vec<u8>,
    staging_down: Vec<u8>,
    dense: Vec<Vec<u8>>,
    registered: Vec<crate::io::Registration>,
    pinned: Vec<crate::backend::PinnedHost>,
    pinned_addrs: Vec<usize>,
    dense_addrs: Vec<usize>,
}

impl Buffers {
    #[allow(clippy::too_many_arguments)]
    fn make(
        cfg: &crate::config::ModelConfig,
        opts: &StreamOptions,
        link: &dyn crate::backend::HostLink,
        residency: &Residency,
        rows_layout: bool,
        layers: &[LayerParts],
        caches: &[LayerCache],
        resident: &Resident,
        bg: &dyn Reader,
    ) -> Buffers {
        // Staging for a layer's FFN rows (none in the `rows` layout: nothing is staged).
        let max_row = |f: fn(&LayerParts) -> usize| match rows_layout {
            true => 0,
            false => layers.iter().map(f).max().unwrap_or(0),
        };
        let mut staging_up = vec![0u8; cfg.ffn * max_row(|p| p.up.row_bytes)];
        let mut staging_down = vec![0u8; cfg.ffn * max_row(|p| p.down.row_bytes)];
        prefault(&mut staging_up);
        prefault(&mut staging_down);
        // A device with memory of its own copies the FFN rows from these at each use: locked,
        // at the link's pinned speed (the heap buffers stay where they are when moved below).
        let pinned_staging: Vec<crate::backend::PinnedHost> = match link.host_memory() {
            true => Vec::new(),
            false => [&staging_up, &staging_down]
                .into_iter()
                .filter_map(|b| link.pin_host(b, true))
                .collect(),
        };
        let pinned_addrs = match pinned_staging.is_empty() {
            true => Vec::new(),
            false => vec![staging_up.as_ptr() as usize, staging_down.as_ptr() as usize],
        };
        // The prefetch thread's buffers (a layer's streamed attention and gate, and its FFN rows
        // when prefetched): on such a device two, the layer in use and the next, made at their
        // largest (so never reallocated) and locked, as the staging is. The reads land in them
        // directly (laid out in phase with the file), so in page-locked memory. Made at open on
        // every device (the budget counts them): registered with the reader below.
        let dense_max = layers
            .iter()
            .map(|p| {
                let ranges = p.dense_ranges();
                let leads = p.views.as_ref().map_or(Vec::new(), |v| v.leads(p, ranges.len()));
                crate::io::in_phase_len_max(&ranges, &leads)
            })
            .max()
            .unwrap_or(0);
        let mut dense_bufs: Vec<Vec<u8>> = Vec::new();
        if dense_max > 0 {
            for _ in 0..residency.prefetch_buffers.max(2) {
                let mut b = vec![0u8; dense_max];
                // Large reads land here: in huge pages, each is one device request.
                crate::io::advise_huge_pages(&mut b);
                prefault(&mut b);
                dense_bufs.push(b);
            }
        }
        let pinned_dense: Vec<crate::backend::PinnedHost> = match link.host_memory() {
            true => Vec::new(),
            false => dense_bufs.iter().filter_map(|b| link.pin_host(b, true)).collect(),
        };
        // Registered with the prefetch thread's reader too (io_uring: fixed buffers), so its
        // reads into them skip pinning their pages at every read.
        // SAFETY: these buffers are never reallocated (made at their largest: `read_job` only
        // resizes within it) nor freed while registered: the guards are the streamer's first
        // field, dropped before the buffers, and a buffer leaving `current` while still viewed
        // is retired, not freed (`dense_pinned` names them).
        let registered: Vec<crate::io::Registration> = dense_bufs
            .iter_mut()
            .filter_map(|b| unsafe { bg.register(b) })
            .collect();
        let dense_addrs = match pinned_dense.is_empty() && registered.is_empty() {
            true => Vec::new(),
            false => dense_bufs.iter().map(|b| b.as_ptr() as usize).collect(),
        };
        // And the resident weights the device's plan does not keep, copied at each use.
        let mut pinned = pinned_staging;
        pinned.extend(pinned_dense);
        pinned.extend(super::pin_unkept(
            link,
            &resident.output,
            &resident.attn,
            resident
                .gate
                .iter()
                .flatten()
                .chain(resident.ffn.iter().flat_map(|(u, d)| u.iter().chain(d.iter()))),
        ));
        // And the neuron caches, whose rows a dense step hands over in place (views, copied at
        // each use) and, mapped, a masked decode step's products read by id: a pinned cache is
        // never written again, so the host need not wait for those copies; an LRU cache's slots
        // are, so it does.
        if !link.host_memory() {
            let refilled = opts.cache != CachePolicy::Pinned;
            let bufs = caches.iter().flat_map(|c| {
                let (u, d) = c.buffers();
                [u, d]
            });
            pinned.extend(bufs.filter_map(|b| link.map_host(b, refilled).or_else(|| link.pin_host(b, refilled))));
        }
        Buffers {
            staging_up,
            staging_down,
            dense: dense_bufs,
            registered,
            pinned,
            pinned_addrs,
            dense_addrs,
        }
    }
}

/// The readers' options by role.
pub(crate) struct ReaderRoles {
    /// The compute thread's: whole slots where it reads through them (a sparse FFN's neuron
    /// reads; an expert cache's misses, at most 16 large reads in flight); a dense model
    /// streamed whole reads only token embeddings there, into slots of two blocks.
    pub fg: crate::io::ReaderOptions,
    /// The prefetch (and lookahead) threads': their reads land in place in buffers laid out in
    /// phase with the file, so a slot holds only the partial block at a read's end — unless
    /// experts are read ahead into buffers that are not (two blocks otherwise).
    pub bg: crate::io::ReaderOptions,
}

/// `read_max_bytes`: the longest read the compute thread's reader can be asked for (a read never
/// spans two sections, so a model's largest FFN or expert section bounds it): its slots are no
/// larger than that, widened by a block at each end.
pub(crate) fn reader_roles(opts: &StreamOptions, moe: bool, read_max_bytes: u64) -> ReaderRoles {
    let align = crate::io::ALIGN_BYTES;
    let small = crate::io::ReaderOptions {
        slot_bytes: 2 * align,
        ..opts.reader.clone()
    };
    let fitted = crate::io::ReaderOptions {
        slot_bytes: opts
            .reader
            .slot_bytes
            .min((read_max_bytes as usize).next_multiple_of(align) + 2 * align),
        ..opts.reader.clone()
    };
    let experts = crate::io::ReaderOptions {
        queue_depth: opts.reader.queue_depth.min(16),
        ..fitted.clone()
    };
    ReaderRoles {
        fg: match (moe, opts.prefetch_ffn) {
            (true, _) => experts.clone(),
            (false, true) => small.clone(),
            (false, false) => fitted,
        },
        bg: match moe && opts.lookahead != Lookahead::Off {
            true => experts,
            false => small,
        },
    }
}

/// The bytes of the largest FFN matrix (an expert: all three) any layer holds: no read the
/// compute thread's reader makes is longer.
pub(crate) fn section_max_bytes(model: &Model) -> u64 {
    use crate::model::weights::LayerFfn;
    let span = |w: &Weight| w.extent_bytes() as u64;
    model
        .weights
        .layers
        .iter()
        .map(|l| match &l.ffn {
            LayerFfn::Dense(f) => span(&f.gate).max(span(&f.up)).max(span(f.down.weight())),
            LayerFfn::Experts(e) => e
                .experts
                .iter()
                .chain(e.shared.iter().map(|(f, _)| f))
                .map(|f| span(&f.gate) + span(&f.up) + span(f.down.weight()))
                .max()
                .unwrap_or(0),
        })
        .max()
        .unwrap_or(0)
}

/// Writes each page once, so first-touch faults happen at setup, not while timing tokens.
fn prefault(buf: &mut [u8]) {
    for i in (0..buf.len()).step_by(4096) {
        buf[i] = 0;
    }
}

/// What dense streaming reads per token under `residency`: streamed attention and gate, every
/// neuron the pinned cache does not hold, and one embedding row — planned like the real reads.
fn dense_plan_bytes(layers: &[LayerParts], residency: &Residency, cost: &CostModel, embd: Option<&Part>) -> u64 {
    let mut total = 0;
    let mut out = Vec::new();
    for (l, p) in layers.iter().enumerate() {
        let mut spans: Vec<(u64, usize)> = p
            .matrix_ranges()
            .iter()
            .map(|r| (r.offset_bytes, r.len_bytes))
            .collect();
        if residency.up_resident.is_empty() {
            // Neuron-major: every neuron the pinned cache does not hold.
            spans.extend(p.ffn_extents_from(residency.cache_neurons[l]));
        }
        spans.sort_unstable_by_key(|s| s.0);
        total += plan(&spans, cost, &mut out).device_bytes;
    }
    if let Some(e) = embd {
        total += plan(&[(e.offset_bytes, e.row_bytes)], cost, &mut out).device_bytes;
    }
    total
}
