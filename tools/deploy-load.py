#!/usr/bin/env python3
"""A bounded load through a router with the official `openai` client; optionally a kill mid-load.

    deploy-load.py --base-url http://127.0.0.1:18080/v1 --requests 48 --concurrency 8 \
        [--max-tokens 32] [--kill-after 16 | --kill-at SECONDS] [--kill-cmd "podman kill gs-b"] \
        [--label NAME] [--json OUT]

C client threads send --requests chat completions between them (distinct short prompts,
greedy, --max-tokens each), one after the other per thread, with the client's own retries
(max_retries=2: a 5xx or a broken connection is sent again after a short back-off). Each request
records its start and end, outcome (served, or the exception's class and message), the retries
it took and the replica that answered (the router's X-Upstream header). With --kill-after K the
kill command runs once K requests have ended (--kill-at T: T seconds after the start). Prints, and writes as JSON: requests sent, served
(first try / after a retry), failed (each with its clean error), generated tokens and tok/s over
the wall time, p50/p99 latency of the requests that ended before the kill and of those that
started after it (and of the ones in flight when it came), the replicas that served them.
Everything goes to 127.0.0.1 only; the run stops at --time-limit.
"""
import argparse
import json
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import openai

TOPICS = ["a lighthouse keeper", "a lost key", "the first snow", "a robot gardener", "an old map",
          "a quiet library", "a river journey", "a broken clock", "a night market", "a mountain village",
          "a paper boat", "a desert well", "a tiny dragon", "a forgotten song", "a city of bridges",
          "a winter fox"]


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    # Nearest rank.
    k = max(0, min(len(xs) - 1, int(round(p / 100 * len(xs) + 0.5)) - 1))
    return xs[k]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kill-after", type=int, default=0)
    ap.add_argument("--kill-at", type=float, default=0.0, help="or this many seconds after the start")
    ap.add_argument("--kill-cmd", default="")
    ap.add_argument("--timeout", type=float, default=120.0, help="per attempt, seconds")
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--label", default="load")
    ap.add_argument("--json")
    a = ap.parse_args()
    host = urlparse(a.base_url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"deploy-load: loopback only, not {host}")

    client = openai.OpenAI(base_url=a.base_url, api_key="none", max_retries=2, timeout=a.timeout)
    model = client.models.list().data[0].id
    lock = threading.Lock()
    next_i = [0]
    results = []
    kill = {"t": None, "rc": None}
    t0 = time.time()
    deadline = t0 + a.time_limit

    def maybe_kill():
        # Called with the lock held, after each request ends.
        if a.kill_after and kill["t"] is None and len(results) >= a.kill_after:
            kill["t"] = time.time()
            kill["rc"] = subprocess.run(a.kill_cmd, shell=True, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL).returncode

    def kill_at():
        time.sleep(a.kill_at)
        with lock:
            if kill["t"] is None:
                kill["t"] = time.time()
        # Outside the lock: `podman stop` waits for the requests in flight to finish.
        kill["rc"] = subprocess.run(a.kill_cmd, shell=True, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL).returncode

    killer = None
    if a.kill_at:
        killer = threading.Thread(target=kill_at, daemon=True)
        killer.start()

    def worker():
        while True:
            with lock:
                i = next_i[0]
                if i >= a.requests or time.time() > deadline:
                    return
                next_i[0] += 1
            msgs = [{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]} (#{i})."}]
            r = {"i": i, "start": time.time()}
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=model, messages=msgs, max_tokens=a.max_tokens, temperature=0)
                c = raw.parse()
                r.update(ok=True, retries=raw.retries_taken, upstream=raw.headers.get("x-upstream"),
                         tokens=c.usage.completion_tokens)
            except openai.APIError as e:
                r.update(ok=False, error=f"{type(e).__name__}: {str(e)[:160]}",
                         status=getattr(e, "status_code", None))
            except Exception as e:  # not the client's own error class: not a clean error
                r.update(ok=False, error=f"UNCLEAN {type(e).__name__}: {str(e)[:160]}")
            r["end"] = time.time()
            with lock:
                results.append(r)
                maybe_kill()

    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    if killer is not None:
        # (`podman stop` returns once the container has exited.)
        killer.join(timeout=60)

    served = [r for r in results if r["ok"]]
    failed = [r for r in results if not r["ok"]]
    lat = lambda rs: [r["end"] - r["start"] for r in rs]
    kt = kill["t"]
    groups = {"all": results}
    if kt is not None:
        groups = {
            "before_kill": [r for r in results if r["end"] <= kt],
            "in_flight_at_kill": [r for r in results if r["start"] < kt < r["end"]],
            "after_kill": [r for r in results if r["start"] >= kt],
        }
    upstreams = {}
    for r in served:
        upstreams[r["upstream"]] = upstreams.get(r["upstream"], 0) + 1
    tokens = sum(r["tokens"] for r in served)
    rep = {
        "label": a.label,
        "requests_sent": len(results),
        "served": len(served),
        "served_first_try": sum(1 for r in served if r["retries"] == 0),
        "served_after_client_retry": sum(1 for r in served if r["retries"] > 0),
        "failed": len(failed),
        "failed_unclean": sum(1 for r in failed if r["error"].startswith("UNCLEAN")),
        "failures": [r["error"] for r in failed],
        "generated_tokens": tokens,
        "wall_s": round(wall, 2),
        "tok_per_s": round(tokens / wall, 2),
        "served_by": upstreams,
        "kill": None if kt is None else {"after_requests": a.kill_after or None, "at_s": round(kt - t0, 2),
                                         "cmd_rc": kill["rc"]},
        "latency_s": {k: {"n": len(v), "ok": sum(1 for r in v if r["ok"]),
                          "p50": pct(lat(v), 50), "p99": pct(lat(v), 99)} for k, v in groups.items()},
    }
    for g in rep["latency_s"].values():
        for k in ("p50", "p99"):
            if g[k] is not None:
                g[k] = round(g[k], 3)
    print(f"== {a.label}: {rep['requests_sent']} sent, {rep['served']} served "
          f"({rep['served_first_try']} first try, {rep['served_after_client_retry']} after a client retry), "
          f"{rep['failed']} failed ({rep['failed_unclean']} unclean)")
    print(f"   {tokens} tokens in {wall:.2f} s = {rep['tok_per_s']} tok/s; served by {upstreams}")
    if kt is not None:
        after = f"after {a.kill_after} requests ended, " if a.kill_after else ""
        print(f"   `{a.kill_cmd}` {after}at {kt - t0:.2f} s (exit {kill['rc']})")
    for k, g in rep["latency_s"].items():
        print(f"   latency {k}: n={g['n']} ok={g['ok']} p50={g['p50']} s p99={g['p99']} s")
    for e in rep["failures"]:
        print(f"   failure: {e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
