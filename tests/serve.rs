//! `gatestream serve` run as a user runs it (the binary, on a free port of 127.0.0.1), spoken to
//! over plain HTTP/1.1: OpenAI's endpoints, server-sent events, stop strings, errors, a full
//! queue, a client that goes away, SIGTERM; and eight concurrent greedy requests, each of which
//! must give exactly the text it gives when run alone in this process; the chat page at `/`
//! (served, or off with `--no-webui`) and the figures `/stats` gives it, in RAM and streamed.
//! The official `openai` Python client is tested against the same server by
//! `tests/openai_client.py`, and the chat page in a real browser by `tests/webui.py` (`.ci/run`).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use gatestream::model::{LoadOptions, Model};
use serde_json::{json, Value};

fn smollm2_path() -> std::path::PathBuf {
    model_file("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2")
}

struct Server {
    child: Child,
    addr: String,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Server {
    /// Starts `gatestream serve` with `args` on a free port and waits until /health is 200.
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_gatestream"))
            .args(["serve", "--port", "0", "--threads", "2", "--model"])
            .arg(smollm2_path())
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = String::new();
        let addr = loop {
            let line = lines
                .next()
                .unwrap_or_else(|| panic!("serve ended before listening: {seen}"))
                .unwrap();
            seen.push_str(&line);
            seen.push('\n');
            if let Some(rest) = line.strip_prefix("listening on http://") {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        // Keep reading stderr (so the server never blocks on a full pipe), for failure messages.
        let log = std::sync::Arc::new(std::sync::Mutex::new(seen));
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(|l| l.ok()) {
                sink.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let s = Server { child, addr, log };
        let t = Instant::now();
        while s.get("/health").0 != 200 {
            assert!(t.elapsed() < Duration::from_secs(60), "not ready: {}", s.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        s
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn get(&self, path: &str) -> (u16, String, String) {
        http(&self.addr, "GET", path, None)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, _, text) = http(&self.addr, "POST", path, Some(body.to_string().as_bytes()));
        let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"));
        (status, v)
    }

    /// POSTs each body to /v1/completions at once, each from its own thread; the responses (each
    /// checked to be 200) in the bodies' order.
    fn complete_at_once(&self, bodies: impl Iterator<Item = Value>) -> Vec<Value> {
        let handles: Vec<_> = bodies
            .map(|body| {
                let addr = self.addr.clone();
                std::thread::spawn(move || {
                    let (status, _, text) = http(&addr, "POST", "/v1/completions", Some(body.to_string().as_bytes()));
                    assert_eq!(status, 200, "{text}");
                    serde_json::from_str::<Value>(&text).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn stats(&self) -> Value {
        let (status, _, text) = self.get("/stats");
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, _, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("gatestream_{name} ")))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
            .parse()
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange (connection closed after it): status, headers, body (de-chunked).
fn http(addr: &str, method: &str, path: &str, body: Option<&[u8]>) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.unwrap_or(b"");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    // A body over the server's limit may be refused before it is all sent.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP response: {raw:?}"));
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, head.to_string(), body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// The `data:` payloads of a server-sent event stream.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

const PROMPTS: [&str; 8] = EIGHT_PROMPTS;

#[test]
fn serve_speaks_openai_and_batched_requests_equal_each_alone() {
    let m = Model::load(&smollm2_path(), &LoadOptions::default()).unwrap();
    let alone: Vec<String> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let ids = m.prompt_ids(p, false).unwrap();
            m.generate_ids(&ids, &greedy(12 + 4 * i), None, None, None, &mut |_| {})
                .unwrap()
                .text
        })
        .collect();
    let s = Server::start(&["--parallel", "8", "--ctx-size", "512"]);

    let (status, _, models) = s.get("/v1/models");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1.gguf");

    // Eight concurrent greedy completions: each exactly as alone, and they did share steps.
    let bodies = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| json!({"prompt": p, "max_tokens": 12 + 4 * i, "temperature": 0}));
    for (i, r) in s.complete_at_once(bodies).into_iter().enumerate() {
        assert_eq!(
            r["choices"][0]["text"], alone[i],
            "request {i} differs from its run alone"
        );
        assert_eq!(r["object"], "text_completion");
        assert_eq!(r["usage"]["completion_tokens"], 12 + 4 * i as u64);
        assert_eq!(r["choices"][0]["finish_reason"], "length");
    }
    assert!(s.metric("batch_width_mean") > 1.5, "the requests were not batched");
    assert_eq!(
        s.metric("generated_tokens_total"),
        (0..8).map(|i| 12.0 + 4.0 * i as f64).sum::<f64>()
    );

    // Chat, whole and streamed: the same text; the stream opens with the role, ends with the
    // finish reason, the usage chunk and [DONE].
    let chat = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "max_tokens": 24, "temperature": 0});
    let (status, whole) = s.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{whole}");
    let text = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(text.contains("Paris"), "{text}");
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, head, body) = http(
        &s.addr,
        "POST",
        "/v1/chat/completions",
        Some(streamed.to_string().as_bytes()),
    );
    assert_eq!(status, 200);
    assert!(head.contains("text/event-stream"), "{head}");
    let data = sse_data(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let joined: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(joined, text);
    let usage = &chunks[chunks.len() - 1]["usage"];
    assert_eq!(usage, &whole["usage"]);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );

    // The chat page, and the figures /stats gives it: each reply's, found by its response's id.
    let (status, head, page) = s.get("/");
    assert_eq!(status, 200);
    let head = head.to_ascii_lowercase();
    assert!(head.contains("content-type: text/html; charset=utf-8"), "{head}");
    assert!(
        head.contains("content-security-policy: default-src 'none'; script-src 'nonce-"),
        "{head}"
    );
    assert!(page.contains("<title>gatestream</title>") && page.contains("/v1/chat/completions"));
    assert!(!page.contains("__CSP_NONCE__"), "the nonce was not filled in");
    let st = s.stats();
    assert_eq!(st["ready"], true);
    assert_eq!(st["streaming"], false);
    assert!(st["ram_budget_bytes"].is_null() && st["disk_bytes_per_s"].is_null() && st["cache"].is_null());
    assert_eq!(st["parallel"], 8);
    assert_eq!(st["ctx"], 512);
    assert_eq!(
        st["generated_tokens_total"].as_f64().unwrap(),
        s.metric("generated_tokens_total")
    );
    assert!(st["rss_bytes"].as_u64().unwrap() > 50 << 20, "{st}");
    let replies = st["replies"].as_array().unwrap();
    // The eight completions, then the chat whole and streamed.
    assert_eq!(replies.len(), 10, "{st}");
    for (r, id) in [(&whole, &whole["id"]), (&whole, &chunks[0]["id"])] {
        let f = replies
            .iter()
            .find(|f| &f["id"] == id)
            .unwrap_or_else(|| panic!("no {id} in {st}"));
        assert_eq!(f["completion_tokens"], r["usage"]["completion_tokens"], "{f}");
        assert_eq!(f["prompt_tokens"], r["usage"]["prompt_tokens"], "{f}");
        assert_eq!(f["finish"], "stop_token", "{f}");
        assert!(f["tok_per_s"].as_f64().unwrap() > 0.0, "{f}");
        assert_eq!(f["disk_bytes_per_token"], 0.0, "{f}");
        assert!(f["cache_hit_rate"].is_null(), "{f}");
        // Alone: one sequence in each of its steps.
        assert_eq!(f["batch_width_mean"], 1.0, "{f}");
    }
    // The batched completions shared their steps.
    let widest = replies
        .iter()
        .map(|f| f["batch_width_mean"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(widest > 1.5, "{st}");

    // A conversation with a system message and an earlier assistant turn: the chat template's
    // text, as `run --chat` would encode it for the same turns.
    let conv = [
        ("system", "You answer briefly."),
        ("user", "Hi"),
        ("assistant", "Hello."),
        ("user", "What is the capital of France?"),
    ];
    let turns: Vec<_> = conv
        .iter()
        .map(|(r, t)| (gatestream::model::chat::Role::from_name(r).unwrap(), *t))
        .collect();
    let ids = m.chat_ids(&turns).unwrap();
    let want = m
        .generate_ids(&ids, &greedy(10), None, None, None, &mut |_| {})
        .unwrap();
    let messages: Vec<Value> = conv.iter().map(|(r, t)| json!({"role": r, "content": t})).collect();
    let (_, r) = s.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 10, "temperature": 0}),
    );
    assert_eq!(r["usage"]["prompt_tokens"], ids.len());
    assert_eq!(r["choices"][0]["message"]["content"], want.text);

    // A stop string: the text up to it, finish "stop".
    let full = &alone[1];
    let stop: String = full.chars().skip(12).take(5).collect();
    let (status, r) = s.post(
        "/v1/completions",
        &json!({"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "stop": [stop]}),
    );
    assert_eq!(status, 200);
    assert_eq!(r["choices"][0]["text"], full[..full.find(&stop).unwrap()]);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");

    // Log-probabilities: the chosen token's, and the top alternatives, most likely first.
    let (_, r) = s.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
                "logprobs": true, "top_logprobs": 2}),
    );
    let lp = &r["choices"][0]["logprobs"]["content"];
    assert_eq!(lp.as_array().unwrap().len(), 3);
    assert_eq!(lp[0]["top_logprobs"][0]["token"], lp[0]["token"]);
    assert!(lp[0]["logprob"].as_f64().unwrap() <= 0.0);

    // /v1/infer: the next-token predictions and both continuations side by side.
    let (status, r) = s.post(
        "/v1/infer",
        &json!({"prompt": "The capital of France is", "top": 3, "mode": "compare", "max_tokens": 6}),
    );
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["dense"]["predictions"].as_array().unwrap().len(), 3);
    assert_eq!(r["dense"]["predictions"][0]["text"], " Paris");
    assert_eq!(
        r["dense"]["text"],
        alone[0][..r["dense"]["text"].as_str().unwrap().len()]
    );
    assert_eq!(r["sparse"]["tokens"].as_array().unwrap().len(), 6);
    assert_eq!(r["dense"]["tokens"].as_array().unwrap().len(), 6);
    // Agreement 1 exactly when there is no first difference.
    assert_eq!(
        r["agreement"].as_f64().unwrap() == 1.0,
        r["first_difference"].is_null(),
        "{r}"
    );

    // Tokenize and back.
    let (_, t) = s.post("/tokenize", &json!({"content": "Hello world", "add_special": false}));
    let (_, d) = s.post("/detokenize", &json!({"tokens": t["tokens"]}));
    assert_eq!(d["content"], "Hello world");

    // Errors, in OpenAI's shape.
    let long = "word ".repeat(600);
    for (path, body, status, what) in [
        ("/v1/completions", json!({"prompt": long}), 400, "context"),
        ("/v1/completions", json!({"prompt": "x", "n": 3}), 400, "n = 1"),
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": "hot"}),
            400,
            "invalid type",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            400,
            "wizard",
        ),
        ("/v1/completions", json!({"prompt": [1, 2, 999999]}), 400, "vocabulary"),
        ("/v1/infer", json!({"prompt": "x", "mode": "fast"}), 400, "fast"),
    ] {
        let (got, r) = s.post(path, &body);
        assert_eq!(got, status, "{body}: {r}");
        assert_eq!(r["error"]["type"], "invalid_request_error");
        assert!(r["error"]["message"].as_str().unwrap().contains(what), "{r}");
    }
    let (status, _, r) = http(&s.addr, "POST", "/v1/completions", Some(b"{not json"));
    assert_eq!(status, 400, "{r}");
    let huge = vec![b'a'; 2 << 20];
    let (status, _, r) = http(&s.addr, "POST", "/v1/completions", Some(&huge));
    assert_eq!(status, 413, "{r}");
    assert!(r.contains("request_too_large"), "{r}");
    assert_eq!(s.get("/v1/nothing").0, 404);

    // A client that goes away mid-stream: its request is cancelled.
    let before = s.metric("requests_cancelled_total");
    {
        let mut c = TcpStream::connect(&s.addr).unwrap();
        let body =
            json!({"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": true}).to_string();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut first = [0u8; 64];
        c.read_exact(&mut first).unwrap();
    }
    let t = Instant::now();
    while s.metric("requests_cancelled_total") == before {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the request went on after its client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // A client that leaves while waiting for a whole (non-streamed) answer: cancelled too.
    let submitted = s.metric("requests_total");
    {
        let mut c = TcpStream::connect(&s.addr).unwrap();
        let body = json!({"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}).to_string();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        while s.metric("requests_total") == submitted {
            assert!(t.elapsed() < Duration::from_secs(30), "the request never came");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    while s.metric("requests_cancelled_total") < before + 2.0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "a whole-answer request went on after its client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Ended: nothing runs and no more tokens come.
    while s.metric("running") > 0.0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "still running after its cancellation"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let generated = s.metric("generated_tokens_total");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(s.metric("generated_tokens_total"), generated);
}

/// `serve --draft`: every request drafts from its own state of the draft model (here the
/// model itself), verified in the shared steps: four concurrent greedy requests each get the
/// text they get alone, and drafts were verified and kept. A request with `ignore_eos` goes on
/// past the stop token its greedy run ends at, to `max_tokens`, with the same text up to there.
#[test]
fn serve_drafts_per_request_and_ignores_eos_when_asked() {
    let m = Model::load(&smollm2_path(), &LoadOptions::default()).unwrap();
    let alone: Vec<String> = PROMPTS[..4]
        .iter()
        .map(|p| {
            let ids = m.prompt_ids(p, false).unwrap();
            m.generate_ids(&ids, &greedy(16), None, None, None, &mut |_| {})
                .unwrap()
                .text
        })
        .collect();
    let draft = smollm2_path();
    let s = Server::start(&[
        "--parallel",
        "4",
        "--ctx-size",
        "256",
        "--draft",
        draft.to_str().unwrap(),
        "--draft-max",
        "3",
    ]);
    let bodies = PROMPTS[..4]
        .iter()
        .map(|p| json!({"prompt": p, "max_tokens": 16, "temperature": 0}));
    for (i, r) in s.complete_at_once(bodies).into_iter().enumerate() {
        assert_eq!(
            r["choices"][0]["text"], alone[i],
            "request {i} differs from its run alone"
        );
    }
    let (drafted, kept) = (s.metric("draft_tokens_total"), s.metric("draft_tokens_accepted_total"));
    assert!(drafted > 0.0 && kept > 0.0, "drafted {drafted}, kept {kept}");

    let chat = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "max_tokens": 48, "temperature": 0});
    let (status, ends) = s.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{ends}");
    assert_eq!(ends["choices"][0]["finish_reason"], "stop", "{ends}");
    let mut on = chat.clone();
    on["ignore_eos"] = json!(true);
    let (status, goes_on) = s.post("/v1/chat/completions", &on);
    assert_eq!(status, 200, "{goes_on}");
    assert_eq!(goes_on["choices"][0]["finish_reason"], "length", "{goes_on}");
    assert_eq!(goes_on["usage"]["completion_tokens"], 48, "{goes_on}");
    let (a, b) = (
        ends["choices"][0]["message"]["content"].as_str().unwrap(),
        goes_on["choices"][0]["message"]["content"].as_str().unwrap(),
    );
    assert!(b.len() > a.len() && b.starts_with(a), "{a:?} / {b:?}");
}

#[test]
fn a_full_queue_is_503_and_sigterm_lets_requests_finish() {
    let mut s = Server::start(&["--parallel", "1", "--queue", "0", "--shutdown-grace", "120"]);
    // One long request holds the only slot.
    let addr = s.addr.clone();
    let running = std::thread::spawn(move || {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0});
        http(&addr, "POST", "/v1/completions", Some(body.to_string().as_bytes()))
    });
    let t = Instant::now();
    while s.metric("running") < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(60), "the request never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (status, head, body) = http(
        &s.addr,
        "POST",
        "/v1/completions",
        Some(json!({"prompt": "x", "max_tokens": 2}).to_string().as_bytes()),
    );
    assert_eq!(status, 503, "{body}");
    assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
    assert!(body.contains("queue_full"), "{body}");
    assert_eq!(s.metric("requests_rejected_total"), 1.0);

    // SIGTERM: no new connections, the running request still completes, the process exits 0.
    let status = Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let (status, _, body) = running.join().unwrap();
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(r["usage"]["completion_tokens"], 200, "{r}");
    let t = Instant::now();
    let code = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st.code();
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "still running after SIGTERM: {}",
            s.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code, Some(0), "{}", s.log());
    assert!(s.log().contains("shutting down"), "{}", s.log());
    assert!(TcpStream::connect(&s.addr).is_err(), "still accepting after SIGTERM");
}

/// A model that cannot be opened ends the server with the reason, not a server that answers 503
/// forever.
#[test]
fn a_model_that_fails_to_load_ends_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write_temp(dir.path(), "broken.gguf", b"GGUF but not really");
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_gatestream"))
        .args(["serve", "--port", "0", "--model"])
        .arg(&bad)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("broken.gguf"), "{stderr}");
    assert!(t.elapsed() < Duration::from_secs(30), "{stderr}");

    // More slots than a step has tokens: refused once the engines are built, naming both.
    let out = Command::new(env!("CARGO_BIN_EXE_gatestream"))
        .args([
            "serve",
            "--port",
            "0",
            "--parallel",
            "40",
            "--step-tokens",
            "32",
            "--model",
        ])
        .arg(smollm2_path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--parallel 40") && stderr.contains("32 tokens"),
        "{stderr}"
    );
}

/// `--no-webui`: `/` is 404, the API and `/stats` unchanged. Streamed under a RAM budget, `/stats`
/// has the stream's figures: its budget, the disk's bandwidth, disk bytes per token and the read
/// rate of each reply.
#[test]
fn no_webui_turns_the_page_off_and_stats_show_the_stream() {
    let s = Server::start(&[
        "--no-webui",
        "--ram-budget",
        "64M",
        "--parallel",
        "1",
        "--ctx-size",
        "256",
    ]);
    let (status, _, body) = s.get("/");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("not_found"), "{body}");
    let (status, r) = s.post(
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}),
    );
    assert_eq!(status, 200, "{r}");
    assert!(r["choices"][0]["text"].as_str().unwrap().contains("Paris"), "{r}");
    let st = s.stats();
    assert_eq!(st["streaming"], true, "{st}");
    assert_eq!(st["ram_budget_bytes"], 64_000_000, "{st}");
    assert!(st["disk_bytes_per_s"].as_f64().unwrap() > 0.0, "{st}");
    // Dense streaming of a GGUF keeps whole matrices, no neuron cache.
    assert!(st["cache"].is_null(), "{st}");
    assert_eq!(st["cache_lookups_total"], 0, "{st}");
    let disk = st["disk_bytes_total"].as_f64().unwrap();
    assert!(disk > 0.0, "{st}");
    assert_eq!(disk, s.metric("disk_bytes_total"));
    let f = &st["replies"][0];
    assert_eq!(f["id"], r["id"], "{st}");
    assert_eq!(f["completion_tokens"], 6, "{f}");
    assert_eq!(f["finish"], "max_tokens", "{f}");
    // Dense streaming reads what is not resident once a pass: about that many bytes a token, and
    // no more than the whole run read.
    let per_token = f["disk_bytes_per_token"].as_f64().unwrap();
    assert!(per_token > 1e6 && per_token * 5.0 <= disk, "{f} of {disk}");
    assert!(f["read_bytes_per_s"].as_f64().unwrap() > 0.0, "{f}");
}
