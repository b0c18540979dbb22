//! The one assembly point: `runtime::open` loads a model, opens its stream when a RAM budget
//! is given (the model then keeps its matrices on disk, so nothing reads past the budget),
//! settles the sparse mask (asked for, or the `.gst` file's stored recommendation) and builds
//! what the mask needs (sketches of up, read through the stream when streaming). `run` goes
//! through it; `Runtime::generate` runs one request and gathers what it measured.
//!
//! Owns: the order of assembly and the choices that depend on more than one part (dense
//! streaming prefetches FFN rows, a sparse one caches by LRU by default; lookahead follows the
//! mask; the KV cache and one batch's activations are counted in the budget). Does not own
//! arithmetic (`model`), reading (`stream`, `io`) or masks (`sparsity`).

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::cpu::CpuBackend;
use crate::backend::Device;
use crate::bench::trace::{AnyTrace, RouteRecorder, TraceRecorder};
use crate::error::{Error, Result};
use crate::gstfile::{is_gst, GstFile};
use crate::io::{ReadEngine, ReaderOptions};
use crate::model::draft::Drafter;
use crate::model::forward::LayerStream;
use crate::model::generate::{GenerateOptions, Generation, PromptAwareMask, TokenEvent};
use crate::model::{LoadOptions, Model, Placement};
use crate::sparsity::{up_set_reads_input, Criterion, Masker, Strategy, UpSketches};
use crate::stream::cache::CachePolicy;
use crate::stream::residency::Priority;
use crate::stream::{CostSource, Lookahead, StreamOptions, StreamReport, Streamer};

/// The sparse configuration asked for; unset parts come from the file's stored recommendation
/// when nothing is set, else top-K, exact, 0.3.
#[derive(Clone, Debug, Default)]
pub struct SparseAsk {
    pub strategy: Option<Strategy>,
    pub criterion: Option<Criterion>,
    pub sparsity: Option<f32>,
}

/// The mask a runtime runs with.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskConfig {
    pub strategy: Strategy,
    pub criterion: Criterion,
    pub sparsity: f32,
    /// Per-layer levels (a budget stored in the file).
    pub per_layer: Option<Vec<f32>>,
    /// Taken from the file's stored recommendation.
    pub stored: bool,
}

/// How to stream (what the caller chooses; the runtime fills in what follows from the mask).
#[derive(Clone, Debug)]
pub struct StreamAsk {
    pub budget_bytes: u64,
    pub engine: ReadEngine,
    pub reader: ReaderOptions,
    /// `None`: LRU when sparse, pinned (the file's hot prefix) when dense.
    pub cache: Option<CachePolicy>,
    pub priority: Priority,
    pub merge_gap_bytes: Option<u64>,
    pub cost: CostSource,
    /// Read the next layer's predicted neurons ahead (sparse only).
    pub lookahead: bool,
    /// The most tokens per pass (prefill batches); 0 = [`crate::stream::default_batch_tokens`].
    pub batch_tokens_max: usize,
    /// A GPU's memory budget ([`StreamOptions::vram_budget_bytes`]).
    pub vram_budget_bytes: Option<u64>,
    /// Prefetch buffers ([`StreamOptions::prefetch_buffers`]); 0 = the default.
    pub prefetch_buffers: usize,
    /// Bytes per prefetch read ([`StreamOptions::prefetch_read_bytes`]); 0 = the default.
    pub prefetch_read_bytes: usize,
    /// Under a GPU budget, whether the CPU computes the rows the GPU does not keep
    /// ([`crate::stream::hybrid`]).
    pub hybrid: crate::stream::hybrid::HybridMode,
}

/// How many KV positions the budget holds.
#[derive(Clone, Debug)]
pub enum KvPositions {
    Exactly(usize),
    /// What the prompt (as generation encodes it) needs to generate `extra` tokens in a context
    /// of `ctx` positions (0 = the model's): a prompt that does not fit is refused here, before
    /// anything is read.
    Prompt {
        prompt: String,
        chat: bool,
        extra: usize,
        ctx: usize,
    },
    /// `sequences` contexts of `ctx` positions each (see [`slot_context`]): a server's slots.
    Sequences {
        ctx: usize,
        sequences: usize,
    },
}

#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// Worker threads; 0 = one per core.
    pub threads: usize,
    pub stream: Option<StreamAsk>,
    pub sparse: Option<SparseAsk>,
    /// Only used when streaming (in RAM the KV cache is allocated per request).
    pub kv_positions: KvPositions,
    /// Experts per token for a mixture-of-experts model (see [`LoadOptions::experts_used`]).
    pub experts_used: Option<usize>,
}

/// A model ready to run: the model, its stream, its mask.
pub struct Runtime {
    pub model: Model,
    pub stream: Option<Streamer>,
    pub mask: Option<MaskConfig>,
    sketches: Option<UpSketches>,
    /// Seconds spent opening the stream (planning, loading what is resident).
    pub stream_open_s: f64,
    /// Things the caller should tell the user (the stream's fallbacks, costly choices).
    pub warnings: Vec<String>,
    /// A draft model for speculative decoding ([`Runtime::attach_draft`]).
    pub draft: Option<Drafter>,
}

/// What one request produced and measured.
pub struct Outcome {
    pub generation: Generation,
    /// Mask, levels and achieved sparsity per layer (sparse runs).
    pub sparsity: Option<serde_json::Value>,
    pub stream: Option<StreamReport>,
    /// The neurons every token used, or for a mixture of experts the experts each token was
    /// routed to (when asked to record).
    pub trace: Option<AnyTrace>,
    /// What automatic placement chose, when it chose (the caller sets it).
    pub placement: Option<crate::placement::Decision>,
}

/// A server slot's context: `ctx`, or when 0 the model's trained context capped at
/// [`SLOT_CONTEXT_DEFAULT`] (each slot's KV cache holds this many positions).
pub fn slot_context(model: &Model, ctx: usize) -> usize {
    if ctx == 0 {
        model.config.context_len.min(SLOT_CONTEXT_DEFAULT)
    } else {
        ctx
    }
}

/// A server slot's context when none is asked for (or the model's, when shorter).
pub const SLOT_CONTEXT_DEFAULT: usize = 4096;

/// The sparse configuration a `.gst` file recommends, if it stores one.
pub fn stored_mask(path: &Path) -> Result<Option<MaskConfig>> {
    if !is_gst(path) {
        return Ok(None);
    }
    Ok(recommended_mask(&GstFile::open(path)?.index))
}

/// The sparse configuration a `.gst` file's `index` recommends, if it stores one.
pub fn recommended_mask(index: &crate::format::Index) -> Option<MaskConfig> {
    let r = index.recommended_sparse.as_ref()?;
    Some(MaskConfig {
        strategy: Strategy::from_name(&r.strategy)?,
        criterion: Criterion::from_name(&r.criterion)?,
        sparsity: r.sparsity,
        per_layer: r.per_layer_sparsity.clone(),
        stored: true,
    })
}

/// Loads `path` and assembles what `opts` asks for (see the module docs), on a CPU device of
/// its own.
pub fn open(path: &Path, opts: &OpenOptions) -> Result<Runtime> {
    open_on(path, opts, Arc::new(CpuBackend::new(opts.threads)))
}

/// Refuses what a streamed file cannot give before anything is loaded: a neuron-sparse mask
/// streams only the kept neurons' rows, which a GGUF (its FFN stored by rows, read whole) does
/// not lay out; the message gives the command that makes a `.gst` that does.
pub fn check_streamed_mask(path: &Path, streamed: bool, sparse: bool) -> Result<()> {
    if streamed && sparse && crate::gguf::is_gguf(path) {
        return Err(Error::Input(format!(
            "{}: a neuron-sparse mask streams only the kept neurons' rows, which needs the FFN stored neuron-major, \
             as a .gst holds it; this GGUF stores it by rows (streamed whole). Make one with `gatestream reformat {} \
             MODEL.gst` (a second copy of the weights), or stream the GGUF dense (no --sparsity, --mode dense)",
            path.display(),
            path.display()
        )));
    }
    Ok(())
}

/// As `open`, computing on `device` (shared with other runtimes: one device, one thread pool).
pub fn open_on(path: &Path, opts: &OpenOptions, device: Arc<dyn Device>) -> Result<Runtime> {
    check_streamed_mask(path, opts.stream.is_some(), opts.sparse.is_some())?;
    let placement = if opts.stream.is_some() {
        Placement::OnDisk
    } else {
        Placement::Mapped
    };
    let model = Model::load_on(
        path,
        &LoadOptions {
            threads: opts.threads,
            placement,
            experts_used: opts.experts_used,
        },
        device,
    )?;
    // A GPU holding the whole model takes its weights now: the first pass then computes only
    // (its prefill figure is not also the model's upload), and a model too large fails here.
    if opts.stream.is_none() && !model.device.host_memory() {
        model.device.keep_resident(&model.weights.matrices());
        if let Some(e) = model.device.take_error() {
            return Err(e);
        }
    }
    let mask = match &opts.sparse {
        None => None,
        Some(ask) => {
            let stored = if ask.strategy.is_none() && ask.criterion.is_none() && ask.sparsity.is_none() {
                model.gst_index.as_ref().and_then(recommended_mask)
            } else {
                None
            };
            Some(stored.unwrap_or(MaskConfig {
                strategy: ask.strategy.unwrap_or(Strategy::TopK),
                criterion: ask.criterion.unwrap_or(Criterion::Exact),
                sparsity: ask.sparsity.unwrap_or(0.3),
                per_layer: None,
                stored: false,
            }))
        }
    };
    let mut warnings = Vec::new();
    let t = Instant::now();
    let stream = match &opts.stream {
        None => None,
        Some(ask) => {
            let kv_positions = match &opts.kv_positions {
                KvPositions::Exactly(n) => *n,
                KvPositions::Sequences { ctx, sequences } => slot_context(&model, *ctx).saturating_mul(*sequences),
                KvPositions::Prompt {
                    prompt,
                    chat,
                    extra,
                    ctx,
                } => {
                    model
                        .context_plan(model.prompt_ids(prompt, *chat)?.len(), *extra, *ctx)?
                        .kv_positions
                }
            };
            let sparse = mask.is_some();
            let open = |batch_tokens_max: usize| {
                Streamer::open(
                    &model,
                    &StreamOptions {
                        budget_bytes: ask.budget_bytes,
                        engine: ask.engine,
                        reader: ask.reader.clone(),
                        // Unasked: hot neurons pinned for a dense model, recency for a mask or an
                        // expert cache (pinned means nothing to experts, and asking for it warns).
                        cache: ask.cache.unwrap_or(if sparse || model.config.moe.is_some() {
                            CachePolicy::Lru
                        } else {
                            CachePolicy::Pinned
                        }),
                        priority: ask.priority,
                        prefetch_ffn: !sparse,
                        merge_gap_bytes: ask.merge_gap_bytes,
                        cost: ask.cost.clone(),
                        lookahead: match &mask {
                            Some(m) if ask.lookahead => {
                                Lookahead::for_mask(up_set_reads_input(m.strategy, m.criterion))
                            }
                            // Experts are predicted from the next layer's router (always resident).
                            None if ask.lookahead && model.config.moe.is_some() => Lookahead::FromGates,
                            _ => Lookahead::Off,
                        },
                        kv_positions,
                        vram_budget_bytes: ask.vram_budget_bytes,
                        prefetch_buffers: match ask.prefetch_buffers {
                            0 => crate::stream::PREFETCH_BUFFERS,
                            n => n,
                        },
                        prefetch_read_bytes: match ask.prefetch_read_bytes {
                            0 => crate::stream::PREFETCH_READ_BYTES,
                            n => n,
                        },
                        batch_tokens_max,
                    },
                )
            };
            // Unasked, a GPU budget's stream without a RAM budget prefills in wide passes (no
            // wider than the context), or in the streaming default where the budget holds no
            // wide pass's activations.
            let wide = crate::stream::default_batch_tokens(ask.budget_bytes, ask.vram_budget_bytes)
                .min(kv_positions.max(crate::stream::STREAM_BATCH_TOKENS));
            let mut s = match ask.batch_tokens_max {
                // (Only the GPU budget's refusal, made before anything is read, is tried again.)
                0 if wide > crate::stream::STREAM_BATCH_TOKENS => match open(wide) {
                    Err(Error::Input(m)) if m.starts_with("--vram-budget") => open(crate::stream::STREAM_BATCH_TOKENS)?,
                    r => r?,
                },
                0 => open(crate::stream::STREAM_BATCH_TOKENS)?,
                n => open(n)?,
            };
            warnings.extend(s.warnings.iter().cloned());
            if let Some(w) = s.enable_hybrid(&model, ask.hybrid, opts.threads)? {
                warnings.push(w);
            }
            Some(s)
        }
    };
    let stream_open_s = t.elapsed().as_secs_f64();
    let sketches = match (&mask, &stream) {
        (Some(m), _) if m.criterion != Criterion::Sketch => None,
        (None, _) => None,
        (Some(_), None) => UpSketches::build(&model),
        (Some(_), Some(s)) => {
            warnings.push(
                "the sketch criterion builds its sketches from every up row at start-up, which reads all of up once \
                 (through the stream, counted in its reads)"
                    .into(),
            );
            UpSketches::build_with(&model, &|w| s.read_matrix(w))?
        }
    };
    Ok(Runtime {
        model,
        stream,
        mask,
        sketches,
        stream_open_s,
        warnings,
        draft: None,
    })
}

impl Runtime {
    /// Drafts up to `max` tokens per decode pass with the model at `path` (sharing this model's
    /// vocabulary; in RAM, on this model's device) for every request from now on.
    pub fn attach_draft(&mut self, path: &Path, max: usize) -> Result<()> {
        let model = Model::load_on(
            path,
            &LoadOptions {
                threads: 0,
                placement: Placement::Mapped,
                experts_used: None,
            },
            self.model.device.clone(),
        )?;
        if self.stream.is_some() {
            let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
            self.warnings.push(format!(
                "the draft model {} ({:.1} MB) is memory-mapped beside --ram-budget, which does not count it",
                path.display(),
                bytes as f64 / 1e6
            ));
        }
        self.draft = Some(Drafter::new(model, &self.model, max)?);
        Ok(())
    }

    /// The mask to run with, built fresh (its counters start at zero).
    pub fn masker(&self) -> Result<Option<Masker<'_>>> {
        let Some(m) = &self.mask else {
            return Ok(None);
        };
        let masker = Masker::for_model(&self.model, m.strategy, m.criterion, m.sparsity, self.sketches.as_ref())?;
        Ok(Some(match &m.per_layer {
            Some(p) => masker.with_per_layer(p.clone()),
            None => masker,
        }))
    }

    /// Refuses a request needing more KV positions than the stream's budget holds.
    pub fn check_positions(&self, needed: usize) -> Result<()> {
        match &self.stream {
            Some(s) if needed > s.kv_positions => Err(Error::Input(format!(
                "the request needs {needed} KV positions but the RAM budget was planned for {} \
                 (the KV cache is counted in --ram-budget)",
                s.kv_positions
            ))),
            _ => Ok(()),
        }
    }

    pub fn layer_stream(&self) -> Option<&dyn LayerStream> {
        self.stream.as_ref().map(|s| s as &dyn LayerStream)
    }

    /// Runs one request: `prompt_ids` continued as `opts` says, every token handed to
    /// `on_token`; `record_trace` keeps the neurons every token used.
    pub fn generate(
        &self,
        prompt_ids: &[u32],
        opts: &GenerateOptions,
        record_trace: bool,
        cancel: Option<&AtomicBool>,
        on_token: &mut dyn FnMut(&TokenEvent),
    ) -> Result<Outcome> {
        let plan = self.model.context_plan(prompt_ids.len(), opts.max_tokens, opts.ctx)?;
        self.check_positions(plan.kv_positions)?;
        let masker = self.masker()?;
        let mask = masker.as_ref().map(|m| m as &dyn PromptAwareMask);
        let c = &self.model.config;
        // A mixture of experts records its routing; a dense model, its neurons.
        let (neurons, routes) = match (record_trace, &c.moe) {
            (false, _) => (None, None),
            (true, None) => (Some(TraceRecorder::new(mask, c.n_layers, c.hidden, c.ffn)), None),
            (true, Some(moe)) => (
                None,
                Some(RouteRecorder::new(mask, c.n_layers, moe.n_experts, moe.leading_dense)),
            ),
        };
        let mask = match (&neurons, &routes) {
            (Some(r), _) => Some(r as &dyn PromptAwareMask),
            (_, Some(r)) => Some(r as &dyn PromptAwareMask),
            _ => mask,
        };
        let generation = self.model.generate_ids_drafted(
            prompt_ids,
            opts,
            mask,
            self.layer_stream(),
            cancel,
            self.draft.as_ref(),
            on_token,
        )?;
        let name = self
            .model
            .path
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned());
        let what = masker.as_ref().map_or("dense".into(), |m| {
            format!("{} {} {}", m.strategy.name(), m.criterion.name(), m.sparsity)
        });
        let trace = match (neurons, routes) {
            (Some(r), _) => Some(AnyTrace::Neurons(r.trace(&name, &what))),
            (_, Some(r)) => Some(AnyTrace::Routes(r.trace(&name, &what))),
            _ => None,
        };
        let sparsity = masker.as_ref().map(|m| {
            serde_json::json!({
                "strategy": m.strategy, "criterion": m.criterion, "level": m.sparsity,
                "level_per_layer": m.per_layer,
                "achieved_per_layer": m.achieved_sparsity(),
                "computed_in": if self.stream.is_some() { "stream" } else { "ram" }
            })
        });
        let stream = self.stream.as_ref().map(|s| StreamReport::new(s, &generation));
        Ok(Outcome {
            generation,
            sparsity,
            stream,
            trace,
            placement: None,
        })
    }
}
