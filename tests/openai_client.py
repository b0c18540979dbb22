#!/usr/bin/env python3
"""The official `openai` Python client against `gatestream serve` on 127.0.0.1.

    python tests/openai_client.py --binary target/release/gatestream --model MODEL.gguf

Starts the server on a free port, then: lists models; chat without and with streaming;
a completion; stop strings; a multi-turn conversation; errors the client raises as
exceptions (a prompt beyond the context, a bad parameter); `curl -N` reads the SSE stream.
Every check must pass: the script exits non-zero at the first failure. `.ci/run` installs
the client into a virtual environment and runs this.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import openai


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print(f"ok: {what.splitlines()[0][:100]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    srv = subprocess.Popen(
        [args.binary, "serve", "--model", args.model, "--port", "0", "--parallel", "4", "--ctx-size", "512"],
        stderr=subprocess.PIPE, text=True)
    try:
        base = None
        for line in srv.stderr:
            m = re.match(r"listening on (http://\S+)", line)
            if m:
                base = m.group(1)
                break
        check(base is not None, "the server printed its address")
        # Keep reading its stderr so the server never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in srv.stderr], daemon=True).start()
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/health") as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if time.time() > deadline:
                raise AssertionError("the server was not ready within 60 s")
            time.sleep(0.05)
        run_checks(base)
    finally:
        srv.terminate()
        code = srv.wait(timeout=30)
        print(f"server exited with {code} after SIGTERM")
    if code != 0:
        sys.exit(f"the server exited with {code}")


def run_checks(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    models = client.models.list()
    ids = [m.id for m in models.data]
    check(len(ids) == 1 and ids[0].endswith(".gguf"), f"models.list: {ids}")
    model = ids[0]

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    text = chat.choices[0].message.content
    check("Paris" in text, f"chat: {text!r}")
    check(chat.choices[0].message.role == "assistant", "chat: the assistant's role")
    check(chat.usage.completion_tokens > 0 and chat.usage.total_tokens ==
          chat.usage.prompt_tokens + chat.usage.completion_tokens, f"chat: usage {chat.usage}")

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    check("".join(pieces) == text, f"chat stream equals the whole answer: {''.join(pieces)!r}")
    check(finish == chat.choices[0].finish_reason, f"chat stream finish_reason {finish}")
    check(usage is not None and usage.completion_tokens == chat.usage.completion_tokens, f"stream usage {usage}")

    comp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    check(comp.choices[0].text.startswith(" Paris"), f"completion: {comp.choices[0].text!r}")
    check(comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 8, "completion: length, 8 tokens")

    full = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0).choices[0].text
    stop = full[10:14]
    stopped = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop])
    check(stopped.choices[0].text == full[:full.index(stop)] and stopped.choices[0].finish_reason == "stop",
          f"stop string {stop!r}: {stopped.choices[0].text!r}")

    conv = client.chat.completions.create(model=model, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a colour."}])
    check(conv.choices[0].message.content.strip() != "", f"multi-turn chat: {conv.choices[0].message.content!r}")

    sampled = [client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0.9,
                                         top_p=0.9, seed=7).choices[0].text for _ in range(2)]
    check(sampled[0] == sampled[1], "the same seed samples the same text")
    unseeded = {client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0)
                .choices[0].text for _ in range(4)}
    check(len(unseeded) > 1, f"without a seed, requests sample differently: {len(unseeded)} distinct of 4")

    try:
        client.completions.create(model=model, prompt="word " * 600, max_tokens=4)
        check(False, "a prompt beyond the context is refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "context" in str(e), f"a prompt beyond the context: 400 {e.body}")
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2)
        check(False, "n=2 is refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and isinstance(e.body, dict) and e.body.get("type") == "invalid_request_error",
              f"n=2: 400 {e.body}")

    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": True})
    out = subprocess.run(["curl", "-sN", base + "/v1/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=60).stdout
    events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
    check(events[-1] == "[DONE]" and len(events) >= 5, f"curl -N: {len(events)} events ending with [DONE]")
    check("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]).startswith(" Paris"), "curl -N text")


if __name__ == "__main__":
    main()
