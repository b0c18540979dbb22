#!/usr/bin/env python3
"""The chat page of `gatestream serve` (`GET /`) in a real browser: Debian's `chromium`, headless,
driven over the Chrome DevTools protocol (a websocket client written here with the standard
library: nothing to install but the browser).

    python3 tests/webui.py --binary target/release/gatestream --model SmolLM2.gguf \\
        [--screenshot target/webui/chat.png] [--chromium /usr/bin/chromium]

Starts the server on a free port of 127.0.0.1 and the browser, loads `/`, then, typing and
clicking as a user does:
  1. sets temperature 0 and a system prompt, types "The capital of France is", presses Enter:
     the request carries the settings and streams; the reply contains "Paris"; the figures beside
     it show the reply's tok/s; a screenshot is saved (the test's artifact);
  2. asks for a long story, sees the reply grow token by token, presses Stop: the server's
     request ends (cancelled, nothing running, no more tokens generated) well before its limit;
  3. asks for an HTML page with a <script> tag: the model's reply shows `<script>` as text (in a
     code block), and no script element is made;
  4. a reply (the server's response replaced in the browser by the protocol's Fetch domain) with
     raw `<script>`, `<img onerror>` and `<b>` outside any code block: shown as text, nothing runs;
and throughout: no script error, no console error, no dialog, no request to anywhere but the
server, the page served with its Content-Security-Policy.

Every check must pass: the script exits non-zero at the first failure (a missing chromium is a
failure too). `.ci/run` installs chromium with apt-get and runs this.
"""
import argparse
import base64
import collections
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what.splitlines()[0][:110]}", flush=True)


# ---- A websocket client (RFC 6455, client side: text frames, masked; enough for the protocol).


class WebSocket:
    def __init__(self, url, timeout=30):
        u = urllib.parse.urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
             f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            b = self.sock.recv(1)
            if not b:
                raise ConnectionError(f"websocket handshake: connection closed after {head!r}")
            head += b
        accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
        if not head.startswith(b"HTTP/1.1 101") or accept not in head:
            raise ConnectionError(f"websocket handshake refused: {head!r}")
        self.buf = b""

    def _frame(self, opcode, payload):
        n = len(payload)
        hdr = bytearray([0x80 | opcode])
        if n < 126:
            hdr.append(0x80 | n)
        elif n < 1 << 16:
            hdr.append(0x80 | 126)
            hdr += n.to_bytes(2, "big")
        else:
            hdr.append(0x80 | 127)
            hdr += n.to_bytes(8, "big")
        mask = os.urandom(4)
        masked = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
        self.sock.sendall(bytes(hdr) + mask + masked)

    def send(self, text):
        self._frame(0x1, text.encode())

    def _exact(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buf)))
            if not chunk:
                raise ConnectionError("the browser closed the websocket")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def recv(self, timeout):
        """One whole text message; socket.timeout when none comes within `timeout` seconds."""
        self.sock.settimeout(max(0.001, timeout))
        parts = []
        while True:
            b0, b1 = self._exact(2)
            fin, opcode, n = b0 & 0x80, b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = int.from_bytes(self._exact(2), "big")
            elif n == 127:
                n = int.from_bytes(self._exact(8), "big")
            mask = self._exact(4) if b1 & 0x80 else None
            payload = self._exact(n)
            if mask:
                payload = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
            if opcode == 0x8:
                raise ConnectionError("the browser closed the websocket")
            if opcode == 0x9:
                self._frame(0xA, payload)
                continue
            if opcode in (0x0, 0x1, 0x2):
                parts.append(payload)
                if fin:
                    return b"".join(parts).decode()


# ---- The DevTools protocol over it.


class Cdp:
    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0
        self.exceptions = []
        self.console_errors = []
        self.dialogs = []
        self.requests = []  # (url, method, postData)
        self.responses = {}  # url -> headers
        self.paused = collections.deque()

    def _event(self, msg):
        method, p = msg["method"], msg.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.exceptions.append(d.get("exception", {}).get("description") or d.get("text"))
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            self.console_errors.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            e = p["entry"]
            self.console_errors.append(f"{e.get('source')}: {e.get('text')} {e.get('url', '')}")
        elif method == "Page.javascriptDialogOpening":
            # A dialog stops the page's script: whatever opened it ran, which must never happen.
            self.dialogs.append(p.get("message"))
            raise AssertionError(f"a dialog opened ({p.get('type')}: {p.get('message')!r}): script ran")
        elif method == "Network.requestWillBeSent":
            r = p["request"]
            self.requests.append((r["url"], r["method"], r.get("postData")))
        elif method == "Network.responseReceived":
            self.responses[p["response"]["url"]] = {k.lower(): v for k, v in p["response"]["headers"].items()}
        elif method == "Fetch.requestPaused":
            self.paused.append(p)

    def call(self, method, timeout=30, **params):
        self.next_id += 1
        my = self.next_id
        self.ws.send(json.dumps({"id": my, "method": method, "params": params}))
        deadline = time.time() + timeout
        while True:
            left = deadline - time.time()
            if left <= 0:
                raise AssertionError(f"{method}: no answer from the browser within {timeout} s")
            try:
                msg = json.loads(self.ws.recv(left))
            except socket.timeout:
                continue
            if msg.get("id") == my:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self._event(msg)

    def pump(self, seconds):
        """Takes the browser's events for `seconds`."""
        deadline = time.time() + seconds
        while (left := deadline - time.time()) > 0:
            try:
                msg = json.loads(self.ws.recv(left))
            except socket.timeout:
                return
            if "method" in msg:
                self._event(msg)

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"evaluating {expr[:80]!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expr, timeout, what):
        deadline = time.time() + timeout
        while True:
            v = self.eval(expr)
            if v:
                return v
            if time.time() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s ({expr})")
            self.pump(0.05)

    def click(self, selector):
        box = self.eval(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            if (!e) return null; const r = e.getBoundingClientRect();
            return {{x: r.x + r.width / 2, y: r.y + r.height / 2, disabled: !!e.disabled}}; }})()""")
        if box is None:
            raise AssertionError(f"no {selector} on the page")
        if box["disabled"]:
            raise AssertionError(f"{selector} is disabled")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left", clickCount=1)

    def type_text(self, selector, text):
        self.click(selector)
        self.call("Input.insertText", text=text)

    def press_enter(self):
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                      windowsVirtualKeyCode=13, nativeVirtualKeyCode=13, **({"text": "\r"} if kind == "keyDown" else {}))

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", format="png")["data"]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))


# ---- The server and the browser.


def start_server(binary, model):
    srv = subprocess.Popen(
        # Streamed from disk under a RAM budget, so the page has the stream's figures to show.
        [binary, "serve", "--model", model, "--port", "0", "--threads", "2", "--parallel", "1", "--ctx-size", "1024",
         "--ram-budget", "128M"],
        stderr=subprocess.PIPE, text=True)
    log = collections.deque(maxlen=200)
    base = None
    for line in srv.stderr:
        log.append(line)
        m = re.match(r"listening on (http://\S+)", line)
        if m:
            base = m.group(1)
            break
    if base is None:
        raise AssertionError("the server ended before listening:\n" + "".join(log))
    threading.Thread(target=lambda: [log.append(l) for l in srv.stderr], daemon=True).start()
    deadline = time.time() + 60
    while True:
        try:
            with urllib.request.urlopen(base + "/health") as r:
                if r.status == 200:
                    return srv, base, log
        except Exception:
            pass
        if time.time() > deadline:
            raise AssertionError("the server was not ready within 60 s:\n" + "".join(log))
        time.sleep(0.05)


def start_browser(chromium, profile):
    # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start (the browser only
    # loads the test's own page from 127.0.0.1).
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
           f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--window-size=1400,900", "about:blank"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    log = collections.deque(maxlen=100)
    threading.Thread(target=lambda: [log.append(l) for l in proc.stderr], daemon=True).start()
    port_file = os.path.join(profile, "DevToolsActivePort")
    deadline = time.time() + 60
    while not (os.path.exists(port_file) and open(port_file).read().count("\n") >= 1):
        if proc.poll() is not None or time.time() > deadline:
            raise AssertionError(f"chromium did not start (exit {proc.poll()}):\n" + "".join(log))
        time.sleep(0.05)
    port = int(open(port_file).read().split("\n")[0])
    deadline = time.time() + 30
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        if pages:
            return proc, pages[0]["webSocketDebuggerUrl"], log
        if time.time() > deadline:
            raise AssertionError("chromium opened no page")
        time.sleep(0.05)


def metric(base, name):
    with urllib.request.urlopen(base + "/metrics") as r:
        text = r.read().decode()
    m = re.search(rf"^gatestream_{name} (\S+)$", text, re.M)
    if not m:
        raise AssertionError(f"no {name} in /metrics")
    return float(m.group(1))


def stats(base):
    with urllib.request.urlopen(base + "/stats") as r:
        return json.load(r)


def fmt_bytes(b):
    """As the page writes bytes: decimal units, about three significant digits."""
    units = ["B", "kB", "MB", "GB", "TB"]
    i = 0
    while abs(b) >= 1000 and i < len(units) - 1:
        b /= 1000
        i += 1
    return f"{b:.{0 if i == 0 or b >= 100 else 1 if b >= 10 else 2}f} {units[i]}"


# ---- The checks.

LAST = "[...document.querySelectorAll('.msg.assistant')].at(-1)"


def set_field(cdp, id_, value):
    cdp.eval(f"(() => {{ const e = document.getElementById({json.dumps(id_)}); e.value = {json.dumps(value)};"
             " e.dispatchEvent(new Event('input', {bubbles: true})); })()")


def ask(cdp, text, how="click"):
    cdp.type_text("#prompt", text)
    n = cdp.eval("document.querySelectorAll('.msg.assistant').length")
    if how == "enter":
        cdp.press_enter()
    else:
        cdp.click("#send")
    cdp.wait_for(f"document.querySelectorAll('.msg.assistant').length === {n + 1}", 10, "the reply's box appears")


def wait_reply(cdp, timeout):
    cdp.wait_for(f"{LAST}.dataset.state !== 'streaming' && document.body.dataset.busy === '0'", timeout,
                 "the reply ends")
    return cdp.eval(f"({{state: {LAST}.dataset.state, text: {LAST}.textContent, id: {LAST}.dataset.id}})")


def run_checks(cdp, base, screenshot):
    cdp.call("Page.enable")
    cdp.call("Runtime.enable")
    cdp.call("Log.enable")
    cdp.call("Network.enable")
    cdp.call("Emulation.setDeviceMetricsOverride", width=1400, height=900, deviceScaleFactor=1, mobile=False)
    cdp.call("Page.navigate", url=base + "/")
    cdp.wait_for("document.readyState === 'complete' && !!document.getElementById('prompt')", 20, "the page loads")
    cdp.wait_for("document.getElementById('status').textContent === 'ready'", 20, "the page reads /stats")
    headers = cdp.responses.get(base + "/", {})
    csp = headers.get("content-security-policy", "")
    check("script-src 'nonce-" in csp and "connect-src 'self'" in csp, f"the page comes with its CSP: {csp[:70]}")
    model = cdp.eval("document.getElementById('model').textContent")
    check("SmolLM2" in model, f"the page names the model: {model!r}")

    # 1. "The capital of France is", greedy, with a system prompt: the reply streams and says Paris.
    set_field(cdp, "temperature", "0")
    set_field(cdp, "top-p", "1")
    set_field(cdp, "max-tokens", "48")
    set_field(cdp, "system", "You answer briefly.")
    ask(cdp, "The capital of France is", how="enter")
    sent = [json.loads(p) for u, m, p in cdp.requests if u == base + "/v1/chat/completions" and m == "POST" and p]
    check(len(sent) == 1, "one POST /v1/chat/completions")
    b = sent[0]
    check(b.get("stream") is True and b.get("temperature") == 0 and b.get("top_p") == 1 and b.get("max_tokens") == 48,
          f"the request streams and carries the settings: {dict((k, b.get(k)) for k in ('stream', 'temperature', 'top_p', 'max_tokens'))}")
    check(b["messages"] == [{"role": "system", "content": "You answer briefly."},
                            {"role": "user", "content": "The capital of France is"}],
          f"the request carries the system prompt and the message: {b['messages']}")
    r = wait_reply(cdp, 60)
    check(r["state"] == "done" and "Paris" in r["text"], f"the reply contains Paris: {r['text']!r}")
    check(r["id"] and r["id"].startswith("chatcmpl-"), f"the reply's id: {r['id']}")
    tps = cdp.wait_for("(() => { const v = parseFloat(document.getElementById('f-tps').textContent);"
                       " return v > 0 && document.getElementById('f-tokens').textContent.includes('prompt') ? v : 0; })()",
                       10, "the figures show the reply's tok/s")
    server = [x for x in stats(base)["replies"] if x["id"] == r["id"]]
    check(len(server) == 1 and abs(server[0]["tok_per_s"] - tps) < 0.06,
          f"the page shows the server's tok/s for this reply: {tps} (server {server[0]['tok_per_s']:.2f})")
    figs = cdp.eval("Object.fromEntries([...document.querySelectorAll('aside dd, #f-budget')].map(e => [e.id, e.textContent]))")
    print("   figures:", json.dumps(figs))
    f = server[0]
    check(figs["f-bpt"] == fmt_bytes(f["disk_bytes_per_token"]) and figs["f-bpt"].endswith(" MB"),
          f"the page shows the reply's disk bytes per token: {figs['f-bpt']}")
    check(figs["f-read"] == fmt_bytes(f["read_bytes_per_s"]) + "/s", f"and its read rate: {figs['f-read']}")
    check(figs["f-disk"] == "1.50 GB/s" or figs["f-disk"].endswith("B/s"), f"beside the disk's: {figs['f-disk']}")
    check(figs["f-budget"].startswith("RAM budget 128 MB") and figs["f-rss"].endswith("of 128 MB"),
          f"resident memory against the budget: {figs['f-rss']}; {figs['f-budget']}")
    check(figs["f-width"] == "1.00" and figs["f-queue"] == "0", "batch width and queue depth")
    cdp.screenshot(screenshot)
    check(os.path.getsize(screenshot) > 10000, f"screenshot saved: {screenshot} ({os.path.getsize(screenshot)} bytes)")

    # 2. A long reply, seen growing token by token, then Stop: the server's request ends.
    cdp.click("#new-chat")
    set_field(cdp, "max-tokens", "2000")
    ask(cdp, "Write a long story about a dragon.")
    lengths = []
    deadline = time.time() + 60
    while len(set(lengths)) < 4 or lengths[-1] < 150:
        s = cdp.eval(f"({{state: {LAST}.dataset.state, n: {LAST}.textContent.length}})")
        if s["state"] != "streaming":
            raise AssertionError(f"the long reply ended before Stop was pressed: {s}")
        if time.time() > deadline:
            raise AssertionError(f"the long reply did not grow: {lengths}")
        if s["n"] > 0:
            lengths.append(s["n"])
        cdp.pump(0.03)
    check(lengths == sorted(lengths) and len(set(lengths)) >= 4,
          f"the reply streams in token by token (lengths seen: {sorted(set(lengths))[:8]}…)")
    check(metric(base, "running") == 1, "the server is generating it")
    cancelled = metric(base, "requests_cancelled_total")
    cdp.click("#stop")
    t = time.time()
    while metric(base, "requests_cancelled_total") < cancelled + 1 or metric(base, "running") != 0:
        if time.time() - t > 15:
            raise AssertionError("the server's request went on after Stop")
        time.sleep(0.02)
    check(True, f"Stop ended the server's request (cancelled, nothing running) in {time.time() - t:.2f} s")
    r = wait_reply(cdp, 10)
    check(r["state"] == "stopped", f"the page marks the reply stopped ({len(r['text'])} characters)")
    generated, shown = metric(base, "generated_tokens_total"), r["text"]
    cdp.pump(0.5)
    check(metric(base, "generated_tokens_total") == generated and cdp.eval(f"{LAST}.textContent") == shown,
          "no token after Stop, on the server or on the page")
    ended = [x for x in stats(base)["replies"] if x["id"] == r["id"]]
    check(len(ended) == 1 and ended[0]["finish"] == "cancelled" and ended[0]["completion_tokens"] < 1500,
          f"the server ended it as cancelled after {ended[0]['completion_tokens'] if ended else '?'} of up to 2000 tokens")

    # 3. The model writes <script> (in a code block): shown as text.
    cdp.click("#new-chat")
    set_field(cdp, "max-tokens", "200")
    ask(cdp, "Write a minimal HTML page with a <script> tag that shows an alert.")
    r = wait_reply(cdp, 60)
    check(r["state"] == "done" and "<script>" in r["text"], f"the model's reply shows <script> as text: {r['text'][:60]!r}")
    n = cdp.eval(f"({{scripts: {LAST}.querySelectorAll('script').length,"
                 f" code: [...{LAST}.querySelectorAll('pre code')].some(c => c.textContent.includes('<script>'))}})")
    check(n["scripts"] == 0 and n["code"], f"it is in a code block, and no script element was made: {n}")

    # 4. Raw HTML outside any code block (the server's answer replaced in the browser).
    cdp.call("Fetch.enable", patterns=[{"urlPattern": "*/v1/chat/completions", "requestStage": "Request"}])
    cdp.click("#new-chat")
    ask(cdp, "Show me raw HTML.")
    deadline = time.time() + 10
    while not cdp.paused:
        if time.time() > deadline:
            raise AssertionError("the chat request was not intercepted")
        cdp.pump(0.05)
    paused = cdp.paused.popleft()
    pieces = ["Raw: <scr", "ipt>window.__pwned = 1</script> and ",
              '<img src=x onerror="window.__pwned = 2"> and <b>bold?</b>', "\n\n**real bold** and `<i>code</i>`"]
    chunk = lambda delta, finish=None: {"id": "chatcmpl-canned", "object": "chat.completion.chunk", "created": 0,
                                        "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    events = [chunk({"role": "assistant", "content": ""})] + [chunk({"content": p}) for p in pieces] + [chunk({}, "stop")]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    cdp.call("Fetch.fulfillRequest", requestId=paused["requestId"], responseCode=200,
             responseHeaders=[{"name": "Content-Type", "value": "text/event-stream"}],
             body=base64.b64encode(sse.encode()).decode())
    r = wait_reply(cdp, 10)
    cdp.call("Fetch.disable")
    raw = "".join(pieces)
    check(r["state"] == "done" and "<script>window.__pwned = 1</script>" in r["text"]
          and '<img src=x onerror="window.__pwned = 2">' in r["text"] and "<b>bold?</b>" in r["text"],
          "a reply with raw <script>, <img onerror> and <b> shows them as text")
    dom = cdp.eval(f"({{bad: {LAST}.querySelectorAll('script, img, b, i').length,"
                   f" strong: {LAST}.querySelector('strong')?.textContent, code: {LAST}.querySelector('code')?.textContent,"
                   " pwned: typeof window.__pwned})")
    check(dom == {"bad": 0, "strong": "real bold", "code": "<i>code</i>", "pwned": "undefined"},
          f"no element from the reply's HTML, its Markdown rendered, nothing ran: {dom}")
    check(raw.replace("**", "").replace("`", "").replace("\n\n", "") in r["text"].replace("\n", ""),
          "the text shown is the reply's")

    # Throughout.
    cdp.pump(0.3)
    check(not cdp.exceptions, f"no script error on the page: {cdp.exceptions}")
    check(not cdp.console_errors, f"no console error: {cdp.console_errors}")
    check(not cdp.dialogs, "no dialog opened")
    elsewhere = [u for u, _, _ in cdp.requests if not (u.startswith(base + "/") or u.startswith("data:") or u == "about:blank")]
    check(not elsewhere, f"every request went to the server ({len(cdp.requests)} requests): {elsewhere}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--screenshot", default="target/webui/chat.png")
    ap.add_argument("--chromium", default=os.environ.get("CHROMIUM") or shutil.which("chromium"))
    args = ap.parse_args()
    if not args.chromium or not os.path.exists(args.chromium):
        sys.exit("FAILED: chromium not found: install it (`apt-get install -y --no-install-recommends chromium`, "
                 "as .ci/run does) or give --chromium")
    srv, base, srv_log = start_server(args.binary, args.model)
    profile = tempfile.mkdtemp(prefix="gatestream-webui-")
    browser = None
    cdp = None
    ok = False
    try:
        browser, ws_url, browser_log = start_browser(args.chromium, profile)
        cdp = Cdp(WebSocket(ws_url))
        t = time.time()
        run_checks(cdp, base, args.screenshot)
        ok = True
        print(f"all checks passed in {time.time() - t:.1f} s; screenshot: {args.screenshot}")
    except Exception as e:
        print(f"FAILED: {e}", file=sys.stderr)
        if cdp is not None:
            try:
                failed = os.path.splitext(args.screenshot)[0] + "-failed.png"
                cdp.screenshot(failed)
                print(f"the page at the failure: {failed}", file=sys.stderr)
                print("its messages: " + json.dumps(cdp.eval(
                    "[...document.querySelectorAll('.msg')].map(m => [m.className, m.dataset.state, m.textContent])")),
                    file=sys.stderr)
            except Exception as e2:
                print(f"(no screenshot of the failure: {e2})", file=sys.stderr)
        print("server log (last lines):\n" + "".join(list(srv_log)[-20:]), file=sys.stderr)
    finally:
        if browser is not None:
            try:
                os.killpg(browser.pid, 15)
                browser.wait(timeout=10)
            except Exception:
                os.killpg(browser.pid, 9)
        shutil.rmtree(profile, ignore_errors=True)
        srv.terminate()
        code = srv.wait(timeout=30)
        print(f"server exited with {code} after SIGTERM")
    if not ok:
        sys.exit(1)
    if code != 0:
        sys.exit(f"the server exited with {code}")


if __name__ == "__main__":
    main()
