//! The engine thread: owns the engines (dense, and sparse when the server has a mask), admits
//! queued requests while fewer than `parallel` run, steps every engine with work, and hands
//! each request its tokens over its channel. A request whose channel is closed (its client went
//! away) is cancelled at the next step.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::Receiver;
use tokio::sync::mpsc::UnboundedSender;

use super::api::{ApiError, Mode};
use super::{Metrics, ReplyFigures};
use crate::engine::{Engine, Event, Request, RequestId, RequestStats};
use crate::error::{Error, Result};
use crate::model::generate::Finish;
use crate::runtime::Runtime;
use crate::sparsity::Masker;

/// What the HTTP side asks of the engine thread.
pub(crate) enum Command {
    Submit(Submission),
    /// Shutting down: end every request now (they finish as cancelled, with what they have).
    CancelAll,
    Quit,
}

pub(crate) struct Submission {
    pub mode: Mode,
    pub request: Request,
    pub out: UnboundedSender<Out>,
    /// The response's id, for the request's figures ([`ReplyFigures`]).
    pub id: String,
    /// When the HTTP side handed it over (its time in the queue starts here).
    pub at: Instant,
}

/// What a request's channel carries.
#[derive(Debug)]
pub(crate) enum Out {
    Token {
        token: u32,
        text: String,
        logprob: Option<f32>,
        top: Vec<(u32, f32)>,
    },
    Done {
        finish: Finish,
        /// Text held back until the end (see `engine::Event::Finished`).
        text: String,
        completion_tokens: usize,
        /// Disk bytes read by the passes this request was in, each pass's bytes shared equally
        /// among the requests in it.
        disk_bytes: f64,
    },
    /// The request was refused or its pass failed (the error says why, with the HTTP status its
    /// kind of error takes); the request is over.
    Failed(ApiError),
}

struct Client {
    out: UnboundedSender<Out>,
    completion_tokens: usize,
    disk_bytes: f64,
    cancelled: bool,
    id: String,
    prompt_tokens: usize,
    queued_s: f64,
    /// Whether it had a token before the step now running (a decode step for it).
    decoding: bool,
    /// Its decode steps: how many, sequences in them, their seconds, all the bytes they read,
    /// its share of those bytes, the cache's lookups and hits in them.
    decode: DecodeSteps,
}

#[derive(Default)]
struct DecodeSteps {
    steps: u64,
    sequences: u64,
    seconds: f64,
    bytes: u64,
    share: f64,
    lookups: u64,
    hits: u64,
}

impl Client {
    fn figures(&self, finish: Finish, stats: &RequestStats) -> ReplyFigures {
        let d = &self.decode;
        let per_s = |x: f64, s: f64| if s > 0.0 { x / s } else { 0.0 };
        ReplyFigures {
            id: self.id.clone(),
            finish: finish.name(),
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            queued_s: self.queued_s,
            prefill_s: stats.prefill_s,
            decode_s: stats.decode_s,
            decode_tokens: stats.decode_tokens,
            tok_per_s: per_s(stats.decode_tokens as f64, stats.decode_s),
            disk_bytes_per_token: d.share / stats.decode_tokens.max(1) as f64,
            read_bytes_per_s: per_s(d.bytes as f64, d.seconds),
            cache_hit_rate: (d.lookups > 0).then(|| d.hits as f64 / d.lookups as f64),
            batch_width_mean: d.sequences as f64 / d.steps.max(1) as f64,
        }
    }
}

/// Engine settings from the command line.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub parallel: usize,
    pub ctx: usize,
    pub step_tokens: usize,
}

fn disk_bytes(rt: &Runtime) -> u64 {
    rt.stream.as_ref().map_or(0, |s| s.read_stats().bytes_device)
}

/// The stream's cache lookups and hits so far ((0, 0) in RAM). Read between steps: no pass holds
/// the stream's state then.
fn cache_counts(rt: &Runtime) -> (u64, u64) {
    rt.stream.as_ref().map_or((0, 0), |s| {
        let c = s.counters();
        (c.cache_lookups, c.cache_hits)
    })
}

/// Builds the engines, calls `ready`, then runs until `Quit` or until every sender is gone.
pub(crate) fn run(
    rt: &Runtime,
    mask: Option<&Masker>,
    limits: Limits,
    rx: Receiver<Command>,
    metrics: &Metrics,
    ready: &mut dyn FnMut(),
) -> Result<()> {
    // engines[0] runs dense requests, engines[1] (when there is a mask) sparse ones.
    let make = |e: usize| -> Result<Engine> {
        let mut engine = Engine::new(&rt.model, rt.layer_stream(), limits.step_tokens).with_context(limits.ctx);
        if let Some(d) = &rt.draft {
            engine = engine.with_drafter(d);
        }
        match mask {
            Some(m) if e == 1 => engine.with_mask(m),
            _ => Ok(engine),
        }
    };
    let mut engines = [Some(make(0)?), None];
    if mask.is_some() {
        engines[1] = Some(make(1)?);
    }
    let step = engines[0].as_ref().map_or(0, |e| e.step_tokens());
    if limits.parallel > step {
        return Err(Error::Input(format!(
            "--parallel {} is more than the {step} tokens a step takes (--step-tokens; 32 at most when streaming): \
             the requests beyond it would wait for steps that never have room; give --parallel {step} or less",
            limits.parallel
        )));
    }
    ready();
    // After `CancelAll` (shutdown): requests still arriving are ended at once.
    let mut draining = false;
    let slot = |m: Mode| match m {
        Mode::Dense => 0,
        Mode::Sparse => 1,
    };
    let mut waiting: VecDeque<Submission> = VecDeque::new();
    let mut clients: HashMap<(usize, RequestId), Client> = HashMap::new();
    loop {
        let idle = clients.is_empty() && waiting.is_empty();
        let first = if idle {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return Ok(()),
            }
        } else {
            None
        };
        for c in first.into_iter().chain(rx.try_iter()) {
            match c {
                Command::Submit(s) if draining => {
                    let _ = s.out.send(cancelled());
                }
                Command::Submit(s) => waiting.push_back(s),
                Command::CancelAll => {
                    draining = true;
                    for s in waiting.drain(..) {
                        let _ = s.out.send(cancelled());
                    }
                    for (&(e, id), c) in clients.iter_mut() {
                        if let Some(engine) = engines[e].as_mut() {
                            engine.cancel(id);
                        }
                        c.cancelled = true;
                    }
                }
                Command::Quit => return Ok(()),
            }
        }
        // Clients that went away: their requests end at this step.
        for (&(e, id), c) in clients.iter_mut() {
            if c.out.is_closed() && !c.cancelled {
                c.cancelled = true;
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                if let Some(engine) = engines[e].as_mut() {
                    engine.cancel(id);
                }
            }
        }
        waiting.retain(|s| {
            let gone = s.out.is_closed();
            if gone {
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            !gone
        });
        // Admission: new requests join between steps while fewer than `parallel` run.
        while clients.len() < limits.parallel {
            let Some(s) = waiting.pop_front() else { break };
            let e = slot(s.mode);
            let Some(engine) = engines[e].as_mut() else {
                let _ = s
                    .out
                    .send(Out::Failed(ApiError::invalid("the server has no sparse mask")));
                continue;
            };
            let prompt_tokens = s.request.prompt_ids.len();
            match engine.submit(s.request) {
                Ok(id) => {
                    metrics.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
                    clients.insert(
                        (e, id),
                        Client {
                            out: s.out,
                            completion_tokens: 0,
                            disk_bytes: 0.0,
                            cancelled: false,
                            id: s.id,
                            prompt_tokens,
                            queued_s: s.at.elapsed().as_secs_f64(),
                            decoding: false,
                            decode: DecodeSteps::default(),
                        },
                    );
                }
                Err(err) => {
                    let _ = s.out.send(Out::Failed(ApiError::of(&err, "generation failed")));
                }
            }
        }
        metrics.queued.store(waiting.len() as u64, Ordering::Relaxed);
        metrics.running.store(clients.len() as u64, Ordering::Relaxed);
        for (e, slot_engine) in engines.iter_mut().enumerate() {
            let Some(engine) = slot_engine.as_mut() else { continue };
            let members = engine.active();
            if members == 0 {
                continue;
            }
            let bytes0 = disk_bytes(rt);
            let cache0 = cache_counts(rt);
            for (_, c) in clients.iter_mut().filter(|((ce, _), _)| *ce == e) {
                c.decoding = c.completion_tokens > 0;
            }
            let drafts0 = engine.drafts();
            let t = Instant::now();
            let stepped = engine.step();
            let drafts1 = engine.drafts();
            metrics.drafted.fetch_add(drafts1.0 - drafts0.0, Ordering::Relaxed);
            metrics.accepted.fetch_add(drafts1.1 - drafts0.1, Ordering::Relaxed);
            metrics.steps.fetch_add(1, Ordering::Relaxed);
            metrics.step_sequences.fetch_add(members as u64, Ordering::Relaxed);
            metrics.batch_width.store(members as u64, Ordering::Relaxed);
            let seconds = t.elapsed();
            metrics.step_ns.fetch_add(seconds.as_nanos() as u64, Ordering::Relaxed);
            let read = disk_bytes(rt) - bytes0;
            metrics.disk_bytes.fetch_add(read, Ordering::Relaxed);
            let cache1 = cache_counts(rt);
            let (lookups, hits) = (cache1.0 - cache0.0, cache1.1 - cache0.1);
            metrics.cache_lookups.fetch_add(lookups, Ordering::Relaxed);
            metrics.cache_hits.fetch_add(hits, Ordering::Relaxed);
            let share = read as f64 / members as f64;
            for (_, c) in clients.iter_mut().filter(|((ce, _), _)| *ce == e) {
                c.disk_bytes += share;
                if c.decoding {
                    let d = &mut c.decode;
                    d.steps += 1;
                    d.sequences += members as u64;
                    d.seconds += seconds.as_secs_f64();
                    d.bytes += read;
                    d.share += share;
                    d.lookups += lookups;
                    d.hits += hits;
                }
            }
            match stepped {
                Ok(events) => {
                    for ev in events {
                        route(ev, e, &mut clients, metrics);
                    }
                }
                Err(err) => {
                    // The pass failed: every request in this engine ends with the error (a
                    // server error whatever its kind: the pass was shared, so no one request is
                    // at fault) and the engine starts afresh (its sequences' caches are in an
                    // unknown state).
                    let failed = ApiError::server(format!("generation failed: {err}"));
                    metrics.failed.fetch_add(1, Ordering::Relaxed);
                    clients.retain(|&(ce, _), c| {
                        if ce == e {
                            let _ = c.out.send(Out::Failed(failed.clone()));
                        }
                        ce != e
                    });
                    *slot_engine = Some(make(e)?);
                }
            }
        }
        metrics.running.store(clients.len() as u64, Ordering::Relaxed);
    }
}

/// The end of a request that never ran.
fn cancelled() -> Out {
    Out::Done {
        finish: Finish::Cancelled,
        text: String::new(),
        completion_tokens: 0,
        disk_bytes: 0.0,
    }
}

fn route(ev: Event, e: usize, clients: &mut HashMap<(usize, RequestId), Client>, metrics: &Metrics) {
    match ev {
        Event::Token {
            request,
            token,
            text,
            logprob,
            top,
        } => {
            metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
            if let Some(c) = clients.get_mut(&(e, request)) {
                c.completion_tokens += 1;
                let _ = c.out.send(Out::Token {
                    token,
                    text,
                    logprob,
                    top,
                });
            }
        }
        Event::Finished {
            request,
            finish,
            text,
            stats,
        } => {
            if let Some(c) = clients.remove(&(e, request)) {
                metrics.finished.fetch_add(1, Ordering::Relaxed);
                metrics.record_reply(c.figures(finish, &stats));
                let _ = c.out.send(Out::Done {
                    finish,
                    text,
                    completion_tokens: c.completion_tokens,
                    disk_bytes: c.disk_bytes,
                });
            }
        }
    }
}
