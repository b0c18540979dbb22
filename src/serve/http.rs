//! The routes: OpenAI's `/v1/models`, `/v1/completions`, `/v1/chat/completions` (JSON or SSE),
//! the seeds' `/v1/infer`, llama-server's `/tokenize`, `/detokenize`, `/health`, `/metrics`,
//! `/stats` (the figures the chat page shows, as JSON), and the chat page at `/` (unless
//! `--no-webui`).

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{self, ApiError, Mode};
use super::worker::{Command, Out, Submission};
use super::{AppState, Loaded, Ticket};
use crate::engine::Request;
use crate::model::chat::{HarmonyPiece, HarmonySplit};
use crate::model::generate::Finish;

pub(crate) async fn serve(listener: tokio::net::TcpListener, state: Arc<AppState>) -> crate::Result<()> {
    let mut app = Router::new();
    if state.opts.webui {
        app = app.route("/", get(|| async { super::webui::page() }));
    }
    let app = app
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/infer", post(infer))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics))
        .route("/stats", get(stats))
        .fallback(|| async {
            error(
                ApiError {
                    status: 404,
                    ..ApiError::invalid("no such endpoint")
                }
                .with_code("not_found"),
            )
        })
        .layer(DefaultBodyLimit::max(state.opts.max_body_bytes))
        .with_state(state.clone());
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown(state))
        .await
        .map_err(|e| crate::Error::Device(format!("the HTTP server stopped: {e}")))
}

/// Resolves at SIGINT or SIGTERM: the listener closes and requests in flight may finish; after
/// the grace period they are cancelled (they end with what they generated). Also resolves when
/// the engine thread ends.
async fn shutdown(state: Arc<AppState>) {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let term = async {
        match term.as_mut() {
            Some(t) => {
                t.recv().await;
            }
            None => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
        // The engine is gone (the model failed to load): nothing left to serve.
        _ = state.engine_ended.notified() => return,
    }
    eprintln!(
        "shutting down: no new connections; requests in flight get {:.0} s to finish",
        state.opts.shutdown_grace.as_secs_f64()
    );
    let grace = state.opts.shutdown_grace;
    tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        let _ = state.to_worker.send(Command::CancelAll);
    });
}

fn error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, Json(e.body())).into_response();
    if e.status == 503 {
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    }
    r
}

fn respond(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(error)
}

/// The body's bytes, or 413 when over the limit.
fn body_bytes(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|rej| {
        if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError {
                status: 413,
                ..ApiError::invalid(format!(
                    "the request body is larger than the server's limit of {limit} bytes (--max-body-bytes)"
                ))
            }
            .with_code("request_too_large")
        } else {
            ApiError::invalid(format!("cannot read the request body: {rej}"))
        }
    })
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    respond(st.loaded().map(|_| Json(json!({"status": "ok"})).into_response()))
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    let meta = match st.loaded() {
        Ok(l) => {
            let c = &l.rt.model.config;
            json!({"n_vocab": c.vocab, "n_ctx": l.ctx, "n_layers": c.n_layers, "n_embd": c.hidden,
                   "parallel": st.opts.parallel, "streaming": l.rt.stream.is_some(), "sparse": l.sparse,
                   "default_mode": st.opts.default_mode.name()})
        }
        Err(_) => Value::Null,
    };
    Json(json!({"object": "list", "data": [{
        "id": st.opts.model_id, "object": "model", "created": now_s(), "owned_by": "gatestream", "meta": meta
    }]}))
    .into_response()
}

/// Checks a request against the context and the queue, then hands it to the engine thread.
fn submit(
    st: &Arc<AppState>,
    l: &Loaded,
    mode: Mode,
    req: Request,
    id: String,
) -> Result<(UnboundedReceiver<Out>, Ticket), ApiError> {
    if mode == Mode::Sparse && !l.sparse {
        return Err(ApiError::invalid(
            "this server has no sparse mask: start it with --mode sparse (or give --sparsity) to run sparse requests",
        ));
    }
    crate::engine::check(&l.rt.model, &req, l.ctx).map_err(ApiError::from)?;
    let Some(ticket) = Ticket::take(st) else {
        st.metrics.rejected.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::unavailable(format!(
            "the server is busy: {} requests running and {} waiting (--parallel, --queue); retry later",
            st.opts.parallel, st.opts.queue
        ))
        .with_code("queue_full"));
    };
    let (tx, rx) = unbounded_channel();
    st.metrics.requests.fetch_add(1, Ordering::Relaxed);
    st.to_worker
        .send(Command::Submit(Submission {
            mode,
            request: req,
            out: tx,
            id,
            at: Instant::now(),
        }))
        .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    Ok((rx, ticket))
}

/// Which response shape a generation is written in.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

/// One generation's response being written: ids, token texts for log-probabilities, usage.
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    loaded: Arc<Loaded>,
    prompt_tokens: usize,
    /// Completions' legacy log-probabilities, chat's, or none.
    logprobs: bool,
    include_usage: bool,
    /// A chat reply of a gpt-oss (Harmony) model: its analysis channel is given as
    /// `reasoning_content`, its final channel as `content`, the markers left out.
    harmony: bool,
}

/// One token's ln p and its most likely alternatives.
type TokenLogprobs = (Option<f32>, Vec<(u32, f32)>);

/// What a finished generation gathered.
#[derive(Default)]
struct Gathered {
    text: String,
    tokens: Vec<u32>,
    /// Per token: ln p and the top alternatives.
    logprobs: Vec<TokenLogprobs>,
    finish: Option<Finish>,
    completion_tokens: usize,
    disk_bytes: f64,
}

impl Reply {
    fn new(
        st: &AppState,
        kind: Kind,
        loaded: Arc<Loaded>,
        prompt_tokens: usize,
        logprobs: bool,
        include_usage: bool,
    ) -> Reply {
        let n = st.next_id.fetch_add(1, Ordering::Relaxed);
        let prefix = match kind {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        };
        Reply {
            kind,
            harmony: kind == Kind::Chat && loaded.rt.model.tokenizer.chat_is_harmony(),
            id: format!("{prefix}-{n}-{:x}", any_seed(st)),
            created: now_s(),
            model: st.opts.model_id.clone(),
            loaded,
            prompt_tokens,
            logprobs,
            include_usage,
        }
    }

    /// A token's bytes (SentencePiece word starts keep their space) and their text.
    fn piece(&self, t: u32) -> (&[u8], String) {
        let bytes = self.loaded.rt.model.tokenizer.piece(t).unwrap_or_default();
        (bytes, String::from_utf8_lossy(bytes).into_owned())
    }

    /// The `object` a response of this kind names (`chunk`: a streamed one).
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn usage(&self, completion_tokens: usize) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
               "total_tokens": self.prompt_tokens + completion_tokens})
    }

    /// Log-probabilities of `tokens` in this reply's shape; completions' `text_offset` counts
    /// token bytes from `text_offset0`.
    fn logprobs_json(&self, tokens: &[u32], lps: &[TokenLogprobs], text_offset0: usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => {
                let entry = |t: u32, lp: Option<f32>| {
                    let (bytes, text) = self.piece(t);
                    json!({"token": text, "logprob": lp, "bytes": bytes})
                };
                let content: Vec<Value> = tokens
                    .iter()
                    .zip(lps)
                    .map(|(&t, (lp, top))| {
                        let mut e = entry(t, *lp);
                        e["top_logprobs"] = top.iter().map(|&(u, l)| entry(u, Some(l))).collect();
                        e
                    })
                    .collect();
                json!({"content": content})
            }
            Kind::Completion => {
                let mut offset = text_offset0;
                let mut out = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
                for (&t, (lp, top)) in tokens.iter().zip(lps) {
                    let (bytes, s) = self.piece(t);
                    out["tokens"].as_array_mut().expect("array").push(json!(s));
                    out["token_logprobs"].as_array_mut().expect("array").push(json!(lp));
                    let alts: serde_json::Map<String, Value> =
                        top.iter().map(|&(u, l)| (self.piece(u).1, json!(l))).collect();
                    out["top_logprobs"]
                        .as_array_mut()
                        .expect("array")
                        .push(Value::Object(alts));
                    out["text_offset"].as_array_mut().expect("array").push(json!(offset));
                    offset += bytes.len();
                }
                out
            }
        }
    }

    /// One streamed chunk: `text` (None: the role-opening chunk of a chat), `finish` on the last.
    fn chunk(&self, text: Option<&str>, logprobs: Value, finish: Option<Finish>) -> Value {
        let finish = finish.map(api::finish_reason);
        match self.kind {
            Kind::Completion => {
                json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}]})
            }
            Kind::Chat => {
                let delta = match (text, finish) {
                    (None, _) => json!({"role": "assistant", "content": ""}),
                    (Some(""), Some(_)) => json!({}),
                    (Some(t), _) => json!({"content": t}),
                };
                json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
            }
        }
    }

    /// A streamed chat chunk of a Harmony reply: the piece's reasoning and answer (an empty
    /// `content` when it has neither), `finish` on the last.
    fn harmony_chunk(&self, p: HarmonyPiece, logprobs: Value, finish: Option<Finish>) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": harmony_delta(&p, finish.is_some()), "logprobs": logprobs,
                         "finish_reason": finish.map(api::finish_reason)}]})
    }

    /// The whole (non-streamed) response.
    fn whole(&self, g: &Gathered) -> Value {
        let finish = g.finish.map(api::finish_reason);
        let logprobs = self.logprobs_json(&g.tokens, &g.logprobs, 0);
        let choice = match self.kind {
            Kind::Completion => json!({"index": 0, "text": g.text, "logprobs": logprobs, "finish_reason": finish}),
            // A gpt-oss (Harmony) reply: the answer is its final channel, the analysis before it
            // its reasoning.
            Kind::Chat if self.harmony => {
                json!({"index": 0, "message": harmony_message(&g.text), "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": g.text},
                                 "logprobs": logprobs, "finish_reason": finish}),
        };
        json!({"id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
               "choices": [choice], "usage": self.usage(g.completion_tokens)})
    }
}

/// A whole Harmony (gpt-oss) reply as a chat message: its final channel as `content`, its
/// analysis as `reasoning_content` (llama-server's field; absent when there is none).
fn harmony_message(text: &str) -> Value {
    let mut split = HarmonySplit::new();
    let (mut p, rest) = (split.push(text), split.finish());
    p.reasoning.push_str(&rest.reasoning);
    p.answer.push_str(&rest.answer);
    let mut message = json!({"role": "assistant", "content": p.answer});
    if !p.reasoning.is_empty() {
        message["reasoning_content"] = json!(p.reasoning);
    }
    message
}

/// A streamed piece of a Harmony reply as a chat delta: `reasoning_content` and `content` where
/// the piece has them (an empty `content` when it has neither, but on the `last` chunk, which
/// may be empty).
fn harmony_delta(p: &HarmonyPiece, last: bool) -> Value {
    let mut delta = serde_json::Map::new();
    if !p.reasoning.is_empty() {
        delta.insert("reasoning_content".into(), json!(p.reasoning));
    }
    if !p.answer.is_empty() || (p.reasoning.is_empty() && !last) {
        delta.insert("content".into(), json!(p.answer));
    }
    Value::Object(delta)
}

/// Waits for a generation's end, gathering it.
async fn gather(rx: &mut UnboundedReceiver<Out>) -> Result<Gathered, ApiError> {
    let mut g = Gathered::default();
    loop {
        match rx.recv().await {
            Some(Out::Token {
                token,
                text,
                logprob,
                top,
            }) => {
                g.text.push_str(&text);
                g.tokens.push(token);
                g.logprobs.push((logprob, top));
            }
            Some(Out::Done {
                finish,
                text,
                completion_tokens,
                disk_bytes,
            }) => {
                g.text.push_str(&text);
                g.finish = Some(finish);
                g.completion_tokens = completion_tokens;
                g.disk_bytes = disk_bytes;
                return Ok(g);
            }
            Some(Out::Failed(e)) => return Err(e),
            None => return Err(ApiError::unavailable("the server is shutting down")),
        }
    }
}

/// The response: gathered whole, or streamed as server-sent events ending with `[DONE]`.
async fn answer(
    reply: Reply,
    mut rx: UnboundedReceiver<Out>,
    ticket: Ticket,
    stream: bool,
) -> Result<Response, ApiError> {
    if !stream {
        let g = gather(&mut rx).await?;
        drop(ticket);
        return Ok(Json(reply.whole(&g)).into_response());
    }
    // The stream owns the receiver and the ticket: a client that goes away drops both, which
    // the engine thread sees as a closed channel and cancels the request.
    enum At {
        Opening,
        Tokens,
        Usage(usize),
        Done,
        End,
    }
    let state = (reply, rx, ticket, At::Opening, 0usize, HarmonySplit::new());
    let events = futures_util::stream::unfold(state, |(reply, mut rx, ticket, at, offset, mut split)| async move {
        let data = |v: Value| Ok::<_, Infallible>(SseEvent::default().data(v.to_string()));
        match at {
            At::Opening if reply.kind == Kind::Chat => {
                let ev = data(reply.chunk(None, Value::Null, None));
                Some((ev, (reply, rx, ticket, At::Tokens, offset, split)))
            }
            At::Opening | At::Tokens => match rx.recv().await {
                Some(Out::Token {
                    token,
                    text,
                    logprob,
                    top,
                }) => {
                    let lp = reply.logprobs_json(&[token], &[(logprob, top)], offset);
                    let ev = match reply.harmony {
                        true => data(reply.harmony_chunk(split.push(&text), lp, None)),
                        false => data(reply.chunk(Some(&text), lp, None)),
                    };
                    let offset = offset + reply.piece(token).0.len();
                    Some((ev, (reply, rx, ticket, At::Tokens, offset, split)))
                }
                Some(Out::Done {
                    finish,
                    text,
                    completion_tokens,
                    ..
                }) => {
                    // The finish chunk carries the text held back to the end, if any.
                    let last = match reply.harmony {
                        true => {
                            let mut p = split.push(&text);
                            let rest = split.finish();
                            p.reasoning.push_str(&rest.reasoning);
                            p.answer.push_str(&rest.answer);
                            reply.harmony_chunk(p, Value::Null, Some(finish))
                        }
                        false => reply.chunk(Some(&text), Value::Null, Some(finish)),
                    };
                    let next = if reply.include_usage {
                        At::Usage(completion_tokens)
                    } else {
                        At::Done
                    };
                    Some((data(last), (reply, rx, ticket, next, offset, split)))
                }
                Some(Out::Failed(e)) => {
                    let ev = data(e.body());
                    Some((ev, (reply, rx, ticket, At::Done, offset, split)))
                }
                None => {
                    let ev = data(ApiError::unavailable("the server is shutting down").body());
                    Some((ev, (reply, rx, ticket, At::Done, offset, split)))
                }
            },
            At::Usage(n) => {
                let v = json!({"id": reply.id, "object": reply.object(true), "created": reply.created, "model": reply.model,
                               "choices": [], "usage": reply.usage(n)});
                Some((data(v), (reply, rx, ticket, At::Done, offset, split)))
            }
            At::Done => {
                let ev = Ok(SseEvent::default().data("[DONE]"));
                Some((ev, (reply, rx, ticket, At::End, offset, split)))
            }
            At::End => None,
        }
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}

/// Runs `f` (tokenizing: up to a whole request body's worth) off the HTTP threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(ApiError::server(format!("a worker task failed: {e}"))))
}

/// A seed for a request that names none: distinct per request.
fn any_seed(st: &AppState) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos
        ^ st.next_id
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// What both completion endpoints do once the prompt is encoded: check and queue the request,
/// then answer whole or as a stream.
async fn generate(
    st: &Arc<AppState>,
    l: Arc<Loaded>,
    kind: Kind,
    sampling: &api::Sampling,
    ids: Vec<u32>,
    default_max: usize,
    (logprobs, top_logprobs): (bool, u32),
) -> Result<Response, ApiError> {
    let mode = api::mode_of(sampling.mode.as_deref(), st.opts.default_mode)?;
    let mut req = api::request(sampling, ids, default_max, logprobs, top_logprobs, any_seed(st))?;
    req.lookup = st.opts.lookup;
    let prompt_tokens = req.prompt_ids.len();
    let reply = Reply::new(st, kind, l.clone(), prompt_tokens, logprobs, sampling.include_usage());
    let (rx, ticket) = submit(st, &l, mode, req, reply.id.clone())?;
    answer(reply, rx, ticket, sampling.stream()).await
}

async fn completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(completions_inner(&st, body).await)
}

async fn completions_inner(st: &Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let l = st.loaded()?;
    let b: api::CompletionBody = api::parse(&body_bytes(body, st.opts.max_body_bytes)?)?;
    if b.echo {
        return Err(ApiError::invalid("echo is not supported"));
    }
    let text = match &b.prompt {
        api::Prompt::Text(t) => Some(t.clone()),
        api::Prompt::Texts(v) if v.len() == 1 => Some(v[0].clone()),
        api::Prompt::Texts(v) => {
            return Err(ApiError::invalid(format!(
                "{} prompts given; one prompt per request is supported",
                v.len()
            )))
        }
        api::Prompt::Ids(_) => None,
    };
    let ids = match (text, &b.prompt) {
        (Some(t), _) => {
            let l = l.clone();
            blocking(move || l.rt.model.prompt_ids(&t, false).map_err(ApiError::from)).await?
        }
        (None, api::Prompt::Ids(v)) => v.clone(),
        (None, _) => unreachable!("only token ids have no text"),
    };
    // OpenAI's default for completions: 16 tokens.
    let top = b.logprobs.unwrap_or(0);
    generate(
        st,
        l,
        Kind::Completion,
        &b.sampling,
        ids,
        16,
        (b.logprobs.is_some(), top),
    )
    .await
}

async fn chat(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(chat_inner(&st, body).await)
}

async fn chat_inner(st: &Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let l = st.loaded()?;
    let b: api::ChatBody = api::parse(&body_bytes(body, st.opts.max_body_bytes)?)?;
    let messages = api::messages(&b)?;
    let ids = {
        let l = l.clone();
        blocking(move || {
            let borrowed: Vec<_> = messages.iter().map(|(r, t)| (*r, t.as_str())).collect();
            l.rt.model.chat_ids(&borrowed).map_err(ApiError::from)
        })
        .await?
    };
    let top = b.top_logprobs.unwrap_or(0);
    let logprobs = b.logprobs.unwrap_or(false) || top > 0;
    // No limit given: until the context is full (the engine stops there).
    generate(st, l, Kind::Chat, &b.sampling, ids, usize::MAX, (logprobs, top)).await
}

async fn infer(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(infer_inner(&st, body).await)
}

/// `/v1/infer`: the next-token predictions and a greedy continuation, dense, sparse or both
/// side by side (agreement, and disk bytes per token when streaming).
async fn infer_inner(st: &Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let l = st.loaded()?;
    let b: api::InferBody = api::parse(&body_bytes(body, st.opts.max_body_bytes)?)?;
    let modes = match b.mode.as_deref() {
        Some("compare") => vec![Mode::Dense, Mode::Sparse],
        other => vec![api::mode_of(other, st.opts.default_mode)?],
    };
    let ids = {
        let (l, prompt, chat) = (l.clone(), b.prompt.clone(), b.chat);
        blocking(move || l.rt.model.prompt_ids(&prompt, chat).map_err(ApiError::from)).await?
    };
    let sampling = api::Sampling {
        max_tokens: Some(b.max_tokens),
        temperature: Some(0.0),
        ..Default::default()
    };
    // Both continuations are submitted before either is awaited, so they decode side by side.
    let mut pending = Vec::new();
    for &m in &modes {
        let mut req = api::request(&sampling, ids.clone(), 0, false, b.top, 0)?;
        req.lookup = st.opts.lookup;
        let id = format!("infer-{}", st.next_id.fetch_add(1, Ordering::Relaxed));
        pending.push((m, submit(st, &l, m, req, id)?));
    }
    let tokenizer = &l.rt.model.tokenizer;
    let piece = |t: u32| String::from_utf8_lossy(tokenizer.piece(t).unwrap_or_default()).into_owned();
    let streaming = l.rt.stream.is_some();
    let mut results = serde_json::Map::new();
    let mut tokens_of = Vec::new();
    for (m, (mut rx, ticket)) in pending {
        let g = gather(&mut rx).await?;
        drop(ticket);
        let predictions: Vec<Value> = g.logprobs.first().map_or(Vec::new(), |(_, top)| {
            top.iter()
                .map(|&(t, lp)| json!({"token": t, "text": piece(t), "prob": (lp as f64).exp()}))
                .collect()
        });
        let per_token = g.disk_bytes / g.completion_tokens.max(1) as f64;
        results.insert(
            m.name().into(),
            json!({"text": g.text, "tokens": g.tokens, "predictions": predictions,
                   "finish": g.finish.map(|f| f.name()),
                   "disk_bytes_per_token": if streaming { json!(per_token) } else { Value::Null }}),
        );
        tokens_of.push(g.tokens);
    }
    let mut out = json!({"prompt": b.prompt, "prompt_tokens": ids.len(), "model": st.opts.model_id});
    if let [d, s] = &tokens_of[..] {
        let n = d.len().min(s.len());
        let same = d.iter().zip(s).filter(|(a, b)| a == b).count();
        out["agreement"] = json!(if n == 0 { 1.0 } else { same as f64 / n as f64 });
        out["first_difference"] = json!(d.iter().zip(s).position(|(a, b)| a != b));
        if streaming {
            let (dd, sd) = (
                &results["dense"]["disk_bytes_per_token"],
                &results["sparse"]["disk_bytes_per_token"],
            );
            if let (Some(dd), Some(sd)) = (dd.as_f64(), sd.as_f64()) {
                out["sparse_vs_dense_disk_bytes"] = json!(sd / dd.max(1.0));
            }
        }
    }
    for (k, v) in results {
        out[k] = v;
    }
    Ok(Json(out).into_response())
}

async fn tokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(
        with_tokenizer(&st, body, |t, b: api::TokenizeBody| {
            Ok(json!({"tokens": t.encode(&b.content, b.add_special)?}))
        })
        .await,
    )
}

async fn detokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(
        with_tokenizer(&st, body, |t, b: api::DetokenizeBody| {
            Ok(json!({"content": t.decode(&b.tokens)?}))
        })
        .await,
    )
}

/// A tokenizer endpoint: the body read as `B`, `f` run on it off the HTTP threads, its JSON answered.
async fn with_tokenizer<B: serde::de::DeserializeOwned + Send + 'static>(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
    f: impl FnOnce(&crate::model::tokenizer::Tokenizer, B) -> crate::Result<Value> + Send + 'static,
) -> Result<Response, ApiError> {
    let l = st.loaded()?;
    let b: B = api::parse(&body_bytes(body, st.opts.max_body_bytes)?)?;
    let v = blocking(move || f(&l.rt.model.tokenizer, b).map_err(ApiError::from)).await?;
    Ok(Json(v).into_response())
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.metrics;
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let generated = get(&m.generated_tokens);
    let disk = get(&m.disk_bytes);
    let steps = get(&m.steps);
    let per_step = get(&m.step_sequences) as f64 / steps.max(1) as f64;
    let per_token = disk as f64 / generated.max(1) as f64;
    let admitted = st.admitted.load(Ordering::Relaxed) as f64;
    // One row per metric: name, type, help, value.
    #[rustfmt::skip]
    let rows: [(&str, &str, &str, f64); 20] = [
        ("requests_total", "counter", "Requests accepted.", get(&m.requests) as f64),
        ("requests_rejected_total", "counter", "Requests answered 503 because the queue was full.", get(&m.rejected) as f64),
        ("requests_finished_total", "counter", "Requests that ended (at a stop, a limit, or cancelled).", get(&m.finished) as f64),
        ("requests_cancelled_total", "counter", "Requests whose client went away.", get(&m.cancelled) as f64),
        ("steps_failed_total", "counter", "Engine steps that failed (their requests got the error).", get(&m.failed) as f64),
        ("prompt_tokens_total", "counter", "Prompt tokens admitted.", get(&m.prompt_tokens) as f64),
        ("generated_tokens_total", "counter", "Tokens generated.", generated as f64),
        ("queue_depth", "gauge", "Requests waiting for a slot.", get(&m.queued) as f64),
        ("running", "gauge", "Requests decoding.", get(&m.running) as f64),
        ("steps_total", "counter", "Engine steps (forward passes).", steps as f64),
        ("batch_width", "gauge", "Sequences in the last step.", get(&m.batch_width) as f64),
        ("batch_width_mean", "gauge", "Sequences per step, averaged over all steps.", per_step),
        ("step_seconds_total", "counter", "Time spent in steps.", get(&m.step_ns) as f64 / 1e9),
        ("disk_bytes_total", "counter", "Bytes read from disk by the stream (0 in RAM).", disk as f64),
        ("disk_bytes_per_generated_token", "gauge", "Disk bytes over generated tokens since start (prefill reads included).", per_token),
        ("admitted", "gauge", "Requests queued or running.", admitted),
        ("draft_tokens_total", "counter", "Draft tokens verified (--lookup or --draft).", get(&m.drafted) as f64),
        ("draft_tokens_accepted_total", "counter", "Draft tokens kept.", get(&m.accepted) as f64),
        ("cache_lookups_total", "counter", "Streamed FFN neurons (or routed experts) the passes needed (0 in RAM).", get(&m.cache_lookups) as f64),
        ("cache_hits_total", "counter", "Of those, the ones the neuron (expert) cache served.", get(&m.cache_hits) as f64),
    ];
    let s: String = rows
        .iter()
        .map(|(name, kind, help, v)| {
            format!("# HELP gatestream_{name} {help}\n# TYPE gatestream_{name} {kind}\ngatestream_{name} {v}\n")
        })
        .collect();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s).into_response()
}

/// `/stats`: what the chat page shows beside the chat, as one JSON object. Counters since start
/// (a client takes differences between two reads for rates now), gauges, the stream's budget and
/// the disk's bandwidth its plan assumes, and the last requests that ended ([`super::ReplyFigures`]).
async fn stats(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.metrics;
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let steps = get(&m.steps);
    let loaded = st.loaded().ok();
    let stream = loaded.as_ref().and_then(|l| l.rt.stream.as_ref());
    let replies: Vec<super::ReplyFigures> = m.replies.lock().expect("replies").iter().cloned().collect();
    Json(json!({
        "model": st.opts.model_id,
        "ready": loaded.is_some(),
        "streaming": stream.is_some(),
        // What the stream's cache holds: a mixture of experts' routed experts, or FFN neurons;
        // null in RAM and where the stream keeps no cache (dense streaming of a GGUF).
        "cache": stream.and_then(|s| if s.experts.is_some() {
            Some("experts")
        } else {
            s.residency.cache_neurons.iter().any(|&n| n > 0).then_some("neurons")
        }),
        "parallel": st.opts.parallel,
        "ctx": loaded.as_ref().map(|l| l.ctx),
        "running": get(&m.running),
        "queue_depth": get(&m.queued),
        "batch_width": get(&m.batch_width),
        "batch_width_mean": get(&m.step_sequences) as f64 / steps.max(1) as f64,
        "requests_total": get(&m.requests),
        "requests_cancelled_total": get(&m.cancelled),
        "prompt_tokens_total": get(&m.prompt_tokens),
        "generated_tokens_total": get(&m.generated_tokens),
        "steps_total": steps,
        "step_seconds_total": get(&m.step_ns) as f64 / 1e9,
        "disk_bytes_total": get(&m.disk_bytes),
        // The sequential bandwidth the stream's plan uses: probed at start-up, this machine's
        // default, or --cost-model's.
        "disk_bytes_per_s": stream.map(|s| s.cost.bytes_per_us * 1e6),
        "cache_lookups_total": get(&m.cache_lookups),
        "cache_hits_total": get(&m.cache_hits),
        "rss_bytes": crate::stream::rss_bytes(),
        "peak_rss_bytes": crate::stream::peak_rss_bytes(),
        "ram_budget_bytes": stream.map(|s| s.residency.budget_bytes),
        "replies": replies,
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gpt-oss reply, whole and streamed token by token: the answer as `content`, the analysis
    /// as `reasoning_content`, no Harmony markers in either; the deltas add up to the message.
    #[test]
    fn harmony_replies_give_their_answer_as_content_and_their_analysis_as_reasoning() {
        let tokens = [
            "<|channel|>",
            "analysis",
            "<|message|>",
            "Say",
            " hi.",
            "<|end|>",
            "<|start|>",
            "assistant",
            "<|channel|>",
            "final",
            "<|message|>",
            "Hi",
            "!",
        ];
        let whole = harmony_message(&tokens.concat());
        assert_eq!(
            whole,
            json!({"role": "assistant", "content": "Hi!", "reasoning_content": "Say hi."})
        );
        let mut split = HarmonySplit::new();
        let (mut reasoning, mut content) = (String::new(), String::new());
        for t in tokens {
            let d = harmony_delta(&split.push(t), false);
            assert!(
                d.get("content").is_some() || d.get("reasoning_content").is_some(),
                "{d}"
            );
            reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(d["content"].as_str().unwrap_or(""));
        }
        assert_eq!(harmony_delta(&split.finish(), true), json!({}));
        assert_eq!((reasoning.as_str(), content.as_str()), ("Say hi.", "Hi!"));
        assert_eq!(
            harmony_message("no channels"),
            json!({"role": "assistant", "content": "no channels"})
        );
    }
}
