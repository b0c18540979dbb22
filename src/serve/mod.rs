//! `gatestream serve`: an OpenAI-compatible HTTP server over the [`crate::engine`] — continuous
//! batching, so every sequence decoding in a step shares each byte the step streams from disk.
//!
//! Owns: the HTTP surface (`http`: routes, SSE, errors in OpenAI's shape, limits, metrics), the
//! request bodies and their checks (`api`), the chat page at `/` (`webui`), and the engine
//! thread (`worker`) that admits requests, steps the engines and hands tokens to each request's
//! channel. Does not own the
//! model's assembly (the caller opens the [`Runtime`]: the binary, as for `run`), generation
//! (`engine`) or sampling rules (`sampler`).
//!
//! Threads: the HTTP side runs on a small tokio runtime; the engine runs on one thread of its own
//! (its passes use the model's thread pool). They meet through a channel of commands and one
//! channel per request. The model loads on the engine thread while HTTP already answers
//! (`/health` is 503 until it is ready).

pub mod api;
mod http;
mod webui;
mod worker;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::runtime::Runtime;

pub use api::Mode;

/// How the server listens and schedules.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    /// Sequences decoding at once (the batch width); more requests wait in the queue.
    pub parallel: usize,
    /// Requests that may wait beyond `parallel`; one more is answered 503 with `Retry-After`.
    pub queue: usize,
    /// Each sequence's context (prompt + generated); 0 = the model's, at most
    /// [`crate::runtime::SLOT_CONTEXT_DEFAULT`].
    pub ctx: usize,
    /// Tokens per engine step (decode tokens first, then pieces of prompts being prefilled).
    pub step_tokens: usize,
    /// Request bodies larger than this are answered 413.
    pub max_body_bytes: usize,
    /// The mode requests run in when they do not name one.
    pub default_mode: Mode,
    /// The name `/v1/models` lists and responses carry.
    pub model_id: String,
    /// After SIGINT / SIGTERM: how long requests in flight may go on before they are cancelled.
    pub shutdown_grace: Duration,
    /// Draft tokens per request and step by prompt lookup (0 = off).
    pub lookup: usize,
    /// Whether `GET /` serves the chat page (`--no-webui` turns it off; the API is the same).
    pub webui: bool,
}

/// What `/metrics` reports (Prometheus text format).
#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    /// Requests answered 503 because the queue was full.
    pub rejected: AtomicU64,
    pub finished: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub queued: AtomicU64,
    pub running: AtomicU64,
    pub steps: AtomicU64,
    /// Sequences summed over steps (÷ steps = mean batch width).
    pub step_sequences: AtomicU64,
    /// Sequences in the last step.
    pub batch_width: AtomicU64,
    pub step_ns: AtomicU64,
    /// Bytes the stream's readers got from the device (0 in RAM).
    pub disk_bytes: AtomicU64,
    /// Prompt-lookup draft tokens verified and kept.
    pub drafted: AtomicU64,
    pub accepted: AtomicU64,
    /// Streaming: the FFN neurons (or a mixture of experts' routed experts) the passes needed,
    /// and how many the cache served (0 in RAM).
    pub cache_lookups: AtomicU64,
    pub cache_hits: AtomicU64,
    /// The last [`REPLIES_KEPT`] requests that ended, oldest first (`/stats`).
    pub replies: Mutex<VecDeque<ReplyFigures>>,
}

/// How many ended requests `/stats` lists.
pub const REPLIES_KEPT: usize = 32;

/// One ended request's figures (`/stats`; the chat page shows its own reply's). Its decode steps
/// are the steps it took part in after its first token (the prompt's passes left out).
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReplyFigures {
    /// The response's `id` (`chatcmpl-…`, `cmpl-…`; `infer-…` for `/v1/infer`).
    pub id: String,
    /// How it ended (`stop_token`, `max_tokens`, `context_full`, `cancelled`, `stop_string`).
    pub finish: &'static str,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Seconds waiting for a slot, in the prompt's passes, and from then to the end.
    pub queued_s: f64,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Tokens sampled in decode passes, and their rate (`decode_tokens / decode_s`).
    pub decode_tokens: usize,
    pub tok_per_s: f64,
    /// Disk bytes of its decode steps, each step's bytes shared equally among the requests in
    /// it, per decode token (0 in RAM).
    pub disk_bytes_per_token: f64,
    /// All the bytes its decode steps read over their time: the read rate while it decoded.
    pub read_bytes_per_s: f64,
    /// Of the neurons (experts) its decode steps needed, the share the cache served; `None`
    /// where nothing was looked up (in RAM).
    pub cache_hit_rate: Option<f64>,
    /// Sequences per decode step, averaged over its steps.
    pub batch_width_mean: f64,
}

impl Metrics {
    /// Keeps `r` among the last [`REPLIES_KEPT`].
    pub(crate) fn record_reply(&self, r: ReplyFigures) {
        let mut q = self.replies.lock().expect("replies");
        if q.len() == REPLIES_KEPT {
            q.pop_front();
        }
        q.push_back(r);
    }
}

/// The model, once loaded.
pub(crate) struct Loaded {
    pub rt: Arc<Runtime>,
    /// Whether sparse requests can run (the server has a mask).
    pub sparse: bool,
    /// Each request's context ([`crate::runtime::slot_context`] of `--ctx-size`).
    pub ctx: usize,
}

pub(crate) enum Phase {
    Loading,
    Ready(Arc<Loaded>),
    Failed(String),
}

/// What every handler shares.
pub(crate) struct AppState {
    pub opts: ServeOptions,
    pub phase: RwLock<Phase>,
    pub metrics: Metrics,
    pub to_worker: crossbeam_channel::Sender<worker::Command>,
    /// Requests admitted (queued or running): at most `parallel + queue`.
    pub admitted: AtomicUsize,
    pub next_id: AtomicU64,
    /// Notified when the engine thread ends (the model failed to load, or it stopped): the
    /// server then shuts down and `serve` returns the engine's error.
    pub engine_ended: tokio::sync::Notify,
}

/// Serves until SIGINT or SIGTERM. `load` opens the model (on the engine thread, while
/// `/health` answers 503); `on_listening` is told the bound address (the port, when 0 was asked).
pub fn serve(
    opts: ServeOptions,
    load: Box<dyn FnOnce() -> Result<Runtime> + Send>,
    on_listening: &mut dyn FnMut(SocketAddr),
) -> Result<()> {
    if opts.parallel == 0 {
        return Err(Error::Input("--parallel must be at least 1".into()));
    }
    let tokio_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::Device(format!("cannot start the HTTP runtime: {e}")))?;
    let (tx, rx) = crossbeam_channel::unbounded();
    let state = Arc::new(AppState {
        opts: opts.clone(),
        phase: RwLock::new(Phase::Loading),
        metrics: Metrics::default(),
        to_worker: tx,
        admitted: AtomicUsize::new(0),
        next_id: AtomicU64::new(1),
        engine_ended: tokio::sync::Notify::new(),
    });
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = tokio_rt.block_on(tokio::net::TcpListener::bind(&addr)).map_err(|e| {
        Error::Input(format!(
            "cannot listen on {addr}: {e} (is another server on that port?)"
        ))
    })?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::Device(format!("cannot read the bound address: {e}")))?;
    on_listening(local);

    let engine_state = state.clone();
    let engine_thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let st = engine_state;
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load_and_run(&st, load, rx)))
                .unwrap_or_else(|p| {
                    let what = p
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| p.downcast_ref::<&str>().copied())
                        .unwrap_or("no message");
                    Err(Error::Internal(format!("the engine thread panicked: {what}")))
                });
            if let Err(e) = &r {
                *st.phase.write().expect("phase") = Phase::Failed(e.to_string());
            }
            st.engine_ended.notify_one();
            r
        })
        .map_err(|e| Error::Device(format!("cannot start the engine thread: {e}")))?;

    let served = tokio_rt.block_on(http::serve(listener, state.clone()));
    let _ = state.to_worker.send(worker::Command::Quit);
    let engine = engine_thread
        .join()
        .unwrap_or_else(|_| Err(Error::Internal("the engine thread panicked".into())));
    served?;
    engine
}

/// The engine thread's work: load the model, build the engines (the server is ready then),
/// serve requests until told to quit.
fn load_and_run(
    st: &AppState,
    load: Box<dyn FnOnce() -> Result<Runtime> + Send>,
    rx: crossbeam_channel::Receiver<worker::Command>,
) -> Result<()> {
    let rt = Arc::new(load()?);
    let masker = rt.masker()?;
    let limits = worker::Limits {
        parallel: st.opts.parallel,
        ctx: crate::runtime::slot_context(&rt.model, st.opts.ctx),
        step_tokens: st.opts.step_tokens,
    };
    let loaded = Arc::new(Loaded {
        rt: rt.clone(),
        sparse: masker.is_some(),
        ctx: limits.ctx,
    });
    worker::run(&rt, masker.as_ref(), limits, rx, &st.metrics, &mut || {
        *st.phase.write().expect("phase") = Phase::Ready(loaded.clone());
    })
}

impl AppState {
    pub(crate) fn loaded(&self) -> std::result::Result<Arc<Loaded>, api::ApiError> {
        match &*self.phase.read().expect("phase") {
            Phase::Ready(l) => Ok(l.clone()),
            Phase::Loading => Err(api::ApiError::unavailable("Loading model").with_code("loading")),
            Phase::Failed(e) => Err(api::ApiError::unavailable(format!("the model failed to load: {e}"))),
        }
    }
}

/// A request counted against `parallel + queue`; uncounted when dropped.
pub(crate) struct Ticket(Arc<AppState>);

impl Ticket {
    /// Counts a request in, or `None` when `parallel + queue` are taken.
    pub(crate) fn take(state: &Arc<AppState>) -> Option<Ticket> {
        let cap = state.opts.parallel + state.opts.queue;
        state
            .admitted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < cap).then_some(n + 1))
            .ok()
            .map(|_| Ticket(state.clone()))
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::SeqCst);
    }
}
