#!/usr/bin/env python3
"""gatestream beside llama.cpp on this machine, in one run, as docs/RESULTS.md section 3 reports it.

    tools/compare-llama-cpp.py [--pairs 3] [--windows 10] [--models smollm2,gemma,qwen]
                               [--model-file NAME=PATH ...] [--caps 504M:400M,881M:800M]
                               [--skip ram,prefill,ppl,capped] [--json FILE]

Cases, each on the same GGUF, 2 threads, release build:
  decode   in RAM, 64 tokens: llama-bench -p 0 -n 64 -r 1 vs `gatestream run --max-tokens 64
           --ignore-eos --json`
  prefill  in RAM, a 512-token prompt: llama-bench -p 512 -n 0 -r 1 vs `run --max-tokens 1` on a
           prompt of wikitext that encodes to about 512 tokens (prefill_tok_per_s)
  ppl      perplexity, wikitext-2 test, ctx 512, the first --windows windows: llama-perplexity vs
           `gatestream perplexity` (a quality check: the two should agree closely)
  capped   decode of 64 tokens under a memory cap (cgroup, page cache dropped first, via
           tools/llama-cpp.sh capped): llama-completion -nr (weights left in the mmap'd
           file) vs `gatestream run --ram-budget B` on the model's .gst (written by `gatestream
           reformat` into --work if missing); each cap is CAP:BUDGET (the budget leaves the
           process's own ~75-100 MB inside the cap)

Timings alternate A B A B (--pairs pairs) so drift on this noisy machine hits both sides; each
line prints both medians and the median of the per-pair ratios (gatestream / llama.cpp for
speeds: above 1 is gatestream faster). Needs llama.cpp built (`tools/llama-cpp.sh
build`; this script builds it when missing) and the models (`tools/fetch-models.sh all`).
GATESTREAM_BIN=PATH times that binary instead of building target/release/gatestream.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "tools/llama-cpp.sh"
MODELS_DIR = Path(os.environ.get("GATESTREAM_MODELS", Path.home() / ".cache/gatestream/models"))
PEER_BIN = Path(os.environ.get("GATESTREAM_PEER", Path.home() / ".cache/gatestream/llama.cpp")) / "bin"
WIKI = ROOT / "data/wikitext-2/wiki.test.raw"

MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma": "gemma-3-270m-q4_k_m.gguf",
    "qwen": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}
PROMPT = "The capital of France is"


def sh(cmd, **kw):
    """Runs cmd; returns (stdout, stderr); exits with both shown if it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p.stdout, p.stderr


def gatestream_bin():
    if os.environ.get("GATESTREAM_BIN"):
        return Path(os.environ["GATESTREAM_BIN"])
    b = ROOT / "target/release/gatestream"
    print("building gatestream (release)...", file=sys.stderr)
    sh(["cargo", "build", "--release", "--quiet"], cwd=ROOT)
    return b


def llama_bench(model, prompt, gen):
    out, _ = sh([PEER_BIN / "llama-bench", "-m", model, "-p", str(prompt), "-n", str(gen), "-t", "2", "-r", "1", "-o", "json"])
    return json.loads(out)[0]["avg_ts"]


def gs_run(gs, model, *args, prefix=()):
    out, err = sh([*prefix, gs, "run", "--model", model, "--json", *args])
    return json.loads(out), err


def alternate(pairs, a, b):
    """a() and b() return a figure each; runs A B A B...; returns (values a, values b)."""
    va, vb = [], []
    for _ in range(pairs):
        va.append(a())
        vb.append(b())
    return va, vb


def line(results, case, model, unit, gs_vals, ll_vals, higher_is_better=True, extra=None):
    ratios = [g / l if higher_is_better else l / g for g, l in zip(gs_vals, ll_vals) if l > 0 and g > 0]
    r = {
        "case": case,
        "model": model,
        "unit": unit,
        "gatestream": statistics.median(gs_vals),
        "llama_cpp": statistics.median(ll_vals),
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratios": ratios,
        "gatestream_runs": gs_vals,
        "llama_cpp_runs": ll_vals,
    }
    if extra:
        r.update(extra)
    results.append(r)
    ratio = f"{r['ratio_median']:.2f}x" if r["ratio_median"] is not None else "-"
    more = "".join(f"  {k}={v}" for k, v in (extra or {}).items())
    print(f"{case:<8} {model:<8} {r['gatestream']:>10.2f} {r['llama_cpp']:>10.2f}  {unit:<8} {ratio:>7}  "
          f"(pairs: {', '.join(f'{x:.2f}' for x in ratios)}){more}", flush=True)


def prompt_tokens(gs, model, prompt):
    """How many tokens `prompt` encodes to, without running the model: with --ctx-size 1 any
    prompt is refused before any work, and the refusal names the count."""
    p = subprocess.run([gs, "run", "--model", model, "--ctx-size", "1", "--prompt", prompt], capture_output=True, text=True)
    found = re.search(r"the prompt is (\d+) tokens", p.stderr)
    if not found:
        sys.exit(f"cannot count the prompt's tokens:\n{p.stderr[-2000:]}")
    return int(found.group(1))


def prompt_of_tokens(gs, model, n):
    """Wikitext words (from the middle of the file) that encode to about n tokens for this model."""
    words = WIKI.read_text(encoding="utf-8").split()[5000:5000 + 4 * n]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose prompt encodes to <= n tokens
        mid = (lo + hi + 1) // 2
        if prompt_tokens(gs, model, " ".join(words[:mid])) <= n:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def capped(limit, cmd):
    """Runs cmd under the peer script's memory cap; returns (stdout, stderr, capped-line fields)."""
    p = subprocess.run(["bash", PEER, "capped", limit, *map(str, cmd)], capture_output=True, text=True)
    m = re.search(r"capped: (.*)", p.stderr)
    if p.returncode != 0 or not m:
        sys.exit(f"capped run failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stderr[-3000:]}")
    fields = dict(kv.split("=") for kv in m.group(1).split())
    return p.stdout, p.stderr, fields


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="A/B pairs per timed case (default 3)")
    ap.add_argument("--windows", type=int, default=10, help="perplexity windows of 512 tokens (default 10)")
    ap.add_argument("--models", default="smollm2,gemma,qwen", help="comma-separated: smollm2, gemma, qwen ('' for none)")
    ap.add_argument("--model-file", action="append", default=[], metavar="NAME=PATH",
                    help="also compare this GGUF, named NAME in the table (repeatable; e.g. a make-model file)")
    ap.add_argument("--caps", default="504M:400M,881M:800M", help="CAP:BUDGET pairs for the capped case (Qwen)")
    ap.add_argument("--skip", default="", help="cases to leave out: ram, prefill, ppl, capped")
    ap.add_argument("--work", default="/tmp/gatestream-compare", help="where Qwen's .gst is written")
    ap.add_argument("--json", help="also write every figure to this file")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))

    if not (PEER_BIN / "llama-bench").exists():
        print("building llama.cpp with tools/llama-cpp.sh build (once; minutes)...", file=sys.stderr)
        sh(["bash", PEER, "build"])
    gs = gatestream_bin()
    models = {k: MODELS_DIR / MODELS[k] for k in filter(None, a.models.split(","))}
    for k, p in models.items():
        if not p.exists():
            sys.exit(f"{p} is missing: run tools/fetch-models.sh {k}")
    for spec in a.model_file:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            sys.exit(f"--model-file {spec}: expected NAME=PATH of an existing GGUF")
        models[name] = Path(path)
    version = sh([PEER_BIN / "llama-completion", "--version"])[1].strip().splitlines()[0]
    commit = sh(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT)[0].strip()
    print(f"gatestream {commit} vs llama.cpp ({version}); 2 threads; {a.pairs} A/B pairs per timed case; "
          f"ratio = gatestream / llama.cpp (speeds), pairs' median")
    print(f"{'case':<8} {'model':<8} {'gatestream':>10} {'llama.cpp':>10}  {'unit':<8} {'ratio':>7}")
    results = []
    t0 = time.time()

    if "ram" not in skip:
        for k, m in models.items():
            g, l = alternate(a.pairs,
                             lambda: gs_run(gs, m, "--max-tokens", "64", "--ignore-eos", "--prompt", PROMPT)[0]["decode_tok_per_s"],
                             lambda: llama_bench(m, 0, 64))
            line(results, "decode", k, "tok/s", g, l)
    if "prefill" not in skip:
        for k, m in models.items():
            prompt = prompt_of_tokens(gs, m, 512)
            g, l = alternate(a.pairs,
                             lambda: gs_run(gs, m, "--max-tokens", "1", "--prompt", prompt)[0]["prefill_tok_per_s"],
                             lambda: llama_bench(m, 512, 0))
            line(results, "prefill", k, "tok/s", g, l)
    if "ppl" not in skip:
        for k, m in models.items():
            out, _ = sh([gs, "perplexity", "--model", m, "--text", WIKI, "--ctx", "512", "--windows", str(a.windows), "--json"])
            g = json.loads(out)["perplexity"]
            _, err = sh([PEER_BIN / "llama-perplexity", "-m", m, "-f", WIKI, "-c", "512", "--chunks", str(a.windows), "-t", "2"])
            found = re.search(r"Final estimate: PPL = ([0-9.]+)", err)
            if not found:
                sys.exit(f"no perplexity in llama-perplexity's output:\n{err[-2000:]}")
            l = float(found.group(1))
            # For perplexity the ratio is gatestream / llama.cpp as is (1.00 = the same quality).
            line(results, "ppl", k, "ppl", [g], [l], extra={"windows": a.windows})
            results[-1]["ratio_median"] = g / l
    if "capped" not in skip:
        gguf = MODELS_DIR / MODELS["qwen"]
        gst = Path(a.work) / "qwen.gst"
        if not gst.exists():
            gst.parent.mkdir(parents=True, exist_ok=True)
            sh([gs, "reformat", gguf, gst])
        size = gst.stat().st_size
        for cap_budget in a.caps.split(","):
            cap, budget = cap_budget.split(":")

            def gatestream():
                out, _, f = capped(cap, [gs, "run", "--model", gst, "--ram-budget", budget, "--max-tokens", "64",
                                         "--prompt", PROMPT, "--json"])
                d = json.loads(out)
                gs_bytes.append(d["stream"]["disk_bytes_per_token"])
                return d["decode_tok_per_s"]

            def llama():
                _, err, f = capped(cap, [PEER_BIN / "llama-completion", "-m", gguf, "-p", PROMPT, "-n", "64", "-t", "2",
                                         "-c", "512", "--temp", "0", "-s", "1", "--ignore-eos", "-no-cnv", "-nr"])
                found = re.search(r"\beval time =\s*([0-9.]+) ms /\s*(\d+) runs", err)
                ll_bytes.append(int(f["disk_read_bytes"]) / 64)
                return 1000.0 * int(found.group(2)) / float(found.group(1)) if found else 0.0

            gs_bytes, ll_bytes = [], []
            g, l = alternate(a.pairs, gatestream, llama)
            line(results, "capped", "qwen", "tok/s", g, l, extra={
                "cap": cap, "budget": budget, "budget_share": f"{int(parse_size(budget) / size * 100)}% of the .gst",
                "gs_MB_per_tok": round(statistics.median(gs_bytes) / 1e6, 1),
                "llama_MB_per_tok": round(statistics.median(ll_bytes) / 1e6, 1),
            })
    print(f"done in {time.time() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"gatestream": commit, "llama_cpp": version, "results": results}, indent=1))


def parse_size(s):
    units = {"K": 1e3, "M": 1e6, "G": 1e9}
    return float(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else float(s)


if __name__ == "__main__":
    main()
