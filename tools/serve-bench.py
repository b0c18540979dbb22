#!/usr/bin/env python3
"""Throughput of an OpenAI-compatible server against concurrency, and a bounded load test.

    tools/serve-bench.py --server "target/release/gatestream serve --model M --port {port} --parallel 8" \
        [--concurrency 1,2,4,8] [--requests-per-client 2] [--max-tokens 16] [--json OUT]
    tools/serve-bench.py --server "CMD" --load-test 200 --load-concurrency 16 [--time-limit 600]

The server command (gatestream serve, or llama.cpp's llama-server) is started with a free port
in place of {port}, waited for (GET /health), then measured; it is stopped at the end. Each
concurrency level runs C clients at once, each sending its requests one after the other
(distinct short prompts, greedy, POST /v1/completions): total generated tokens (the responses'
usage) over wall time, disk bytes read (/proc/diskstats, the whole machine's) per generated
token, and for gatestream its own /metrics disk bytes and mean batch width. The server's
resident memory (VmRSS) is sampled every 0.2 s. Run it under `tools/llama-cpp.sh capped
LIMIT` to measure under a memory cap (the client is then inside the cap too: ~20 MB).
Standard library only.
"""
import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

TOPICS = ["a lighthouse keeper", "a lost key", "the first snow", "a robot gardener", "an old map",
          "a quiet library", "a river journey", "a broken clock", "a night market", "a mountain village",
          "a paper boat", "a desert well", "a tiny dragon", "a forgotten song", "a city of bridges",
          "a winter fox"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def disk_read_bytes():
    total = 0
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and parts[2] in ("vda", "sda", "nvme0n1"):
                total += int(parts[5]) * 512
    return total


def rss_bytes(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def post(base, path, body, timeout=600):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")[:300]}


def gs_metrics(base):
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except Exception:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("gatestream_"):
            k, v = line.split()
            out[k[len("gatestream_"):]] = float(v)
    return out


class Sampler(threading.Thread):
    """The server's VmRSS every 0.2 s."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], False

    def run(self):
        while not self.stop:
            self.samples.append((time.time(), rss_bytes(self.pid)))
            time.sleep(0.2)


def start(cmd):
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in shlex.split(cmd)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open("/tmp/serve-bench-server.log", "w"))
    base = f"http://127.0.0.1:{port}"
    t = time.time()
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode}); see /tmp/serve-bench-server.log")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except Exception:
            pass
        if time.time() - t > 600:
            sys.exit("the server was not ready within 600 s")
        time.sleep(0.2)
    return proc, base, time.time() - t


def level(base, c, per_client, max_tokens, seed, prompt=None):
    results, errors = [], []

    def client(i):
        for k in range(per_client):
            topic = TOPICS[(seed + i * per_client + k) % len(TOPICS)]
            text = prompt if prompt is not None else f"Here is a short story about {topic}. Once upon a time"
            body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0}
            status, r = post(base, "/v1/completions", body)
            if status == 200:
                results.append(r["usage"]["completion_tokens"])
            else:
                errors.append((status, r))

    m0, d0, t0 = gs_metrics(base), disk_read_bytes(), time.time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall, d1, m1 = time.time() - t0, disk_read_bytes(), gs_metrics(base)
    tokens = sum(results)
    row = {"concurrency": c, "requests": len(results), "errors": len(errors), "generated_tokens": tokens,
           "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 3),
           "disk_bytes_per_token": round((d1 - d0) / max(tokens, 1))}
    if m1:
        dt = m1.get("steps_total", 0) - m0.get("steps_total", 0)
        row["gs_disk_bytes_per_token"] = round((m1["disk_bytes_total"] - m0.get("disk_bytes_total", 0)) / max(tokens, 1))
        row["mean_batch_width"] = round((m1["batch_width_mean"] * m1["steps_total"] -
                                         m0.get("batch_width_mean", 0) * m0.get("steps_total", 0)) / max(dt, 1), 2)
    if errors:
        row["first_error"] = errors[0]
    return row


def load_test(base, n, c, max_tokens, limit_s):
    lock = threading.Lock()
    todo = list(range(n))
    codes, t0 = {}, time.time()

    def client():
        while time.time() - t0 < limit_s:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            body = {"prompt": f"Here is a short story about {TOPICS[i % len(TOPICS)]}. Once upon a time",
                    "max_tokens": max_tokens, "temperature": 0.8, "seed": i}
            status, _ = post(base, "/v1/completions", body)
            with lock:
                codes[status] = codes.get(status, 0) + 1
            if status == 503:
                time.sleep(0.2)
                with lock:
                    todo.append(i)

    threads = [threading.Thread(target=client) for _ in range(c)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"requests": n, "concurrency": c, "status_counts": codes, "wall_s": round(time.time() - t0, 2),
            "unfinished": len(todo)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True, help="server command with {port}")
    ap.add_argument("--label", default="")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--load-test", type=int, default=0, help="N requests instead of the levels")
    ap.add_argument("--load-concurrency", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=600)
    ap.add_argument("--prompt-file", help="every request sends this file's text (default: short story openings)")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    args = ap.parse_args()
    proc, base, ready_s = start(args.server)
    rss = Sampler(proc.pid)
    rss.start()
    out = {"label": args.label, "server": args.server, "ready_s": round(ready_s, 2)}
    try:
        post(base, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})  # warm-up
        if args.load_test:
            out["load_test"] = load_test(base, args.load_test, args.load_concurrency, args.max_tokens, args.time_limit)
        else:
            out["levels"] = []
            for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
                prompt = open(args.prompt_file).read() if args.prompt_file else None
                row = level(base, c, args.requests_per_client, args.max_tokens, seed=i * 5, prompt=prompt)
                out["levels"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        rss.stop = True
        rss.join()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        out["server_exit"] = proc.returncode
    s = [b for _, b in rss.samples if b]
    if s:
        half = len(s) // 2
        out["rss_mb"] = {"max": round(max(s) / 1e6, 1), "first_half_max": round(max(s[:half] or s) / 1e6, 1),
                         "second_half_max": round(max(s[half:]) / 1e6, 1), "samples": len(s)}
    print(json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
