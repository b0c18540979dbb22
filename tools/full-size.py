#!/usr/bin/env python3
"""gatestream beside llama.cpp on a full-size model shape, on this machine, in one run.

    tools/full-size.py [--shape llama3-8b] [--work DIR] [--pairs 3] [--tokens 8]
                       [--caps 2G:1.8G,3G:2.7G] [--cases ram,prefill,dense,gguf,auto,gate,exact,lookup,draft]
                       [--json FILE]

The model is synthetic (`gatestream make-model`: random weights in the shape and type mix of the
real one), so speeds, bytes and memory are real and quality figures mean nothing. It is made in
--work once (GGUF for llama.cpp and the in-RAM cases, the `rows` .gst for dense streaming, the
`bundled` .gst for neuron-sparse streaming, and a small draft model with the same vocabulary).

Cases (2 threads, release builds, A B A B for --pairs pairs; ratio = gatestream / llama.cpp):
  ram      decode in RAM, --tokens tokens: `run --model GGUF` vs llama-bench -p 0 -n N
  prefill  a 64-token prompt in RAM: `run --max-tokens 1` vs llama-bench -p 64 -n 0
  under each cap (cgroup memory limit, page cache dropped, tools/llama-cpp.sh capped),
  against llama-completion -nr (weights left in the mmap'd GGUF: its best setting under a cap):
  dense    `run --model ROWS.gst --ram-budget B`
  gguf     `run --model GGUF --ram-budget B`: the downloaded file streamed directly (no .gst)
  auto     `run --model GGUF` with no budget flag: automatic placement under the cap (the budget it
           chose is printed as auto_budget_MB)
  gate     `run --model BUNDLED.gst --ram-budget B --mode sparse --sparsity 0.5 --criterion gate`
  exact    the same with --criterion exact
  lookup   `--lookup 8` on a repetitive prompt (the same prompt for llama.cpp)
  draft    `--draft SMALL.gguf` (random weights: its drafts are rarely kept; the figure shows what a
           pass costs when they are not)
Before each pair under a cap, `bench --device-only --quick` measures the disk's sequential rate,
so each streamed read rate is quoted beside the device's in the same run. Each line prints both
medians, the median of the per-pair ratios, gatestream's bytes per token, achieved GB/s, time to
first token, peak resident memory (the process's, beside its budget: the cgroup's own peak is the
cap itself once the page cache fills it), and the device's sequential GB/s.
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
PEER_BIN = Path(os.environ.get("GATESTREAM_PEER", Path.home() / ".cache/gatestream/llama.cpp")) / "bin"
PROMPT = "The capital of France is"
REPETITIVE = "one two three four five six seven eight nine ten. " * 6


def sh(cmd, **kw):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p.stdout, p.stderr


def capped(limit, cmd):
    """cmd under the peer script's memory cap: (stdout, stderr, the capped line's fields)."""
    p = subprocess.run(["bash", str(PEER), "capped", limit, *map(str, cmd)], capture_output=True, text=True)
    m = re.search(r"capped: (.*)", p.stderr)
    if p.returncode != 0 or not m:
        sys.exit(f"capped run failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stderr[-3000:]}")
    return p.stdout, p.stderr, dict(kv.split("=") for kv in m.group(1).split())


def llama_eval(err):
    """(decode tok/s, prompt seconds) from llama-completion's timings."""
    ev = re.search(r"\beval time =\s*([0-9.]+) ms /\s*(\d+) runs", err)
    pr = re.search(r"prompt eval time =\s*([0-9.]+) ms", err)
    tok = 1000.0 * int(ev.group(2)) / float(ev.group(1)) if ev else 0.0
    return tok, float(pr.group(1)) / 1000.0 if pr else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--work", default="/tmp/gatestream-full-size")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--caps", default="2G:1.8G,3G:2.7G", help="CAP:BUDGET pairs")
    ap.add_argument("--cases", default="ram,prefill,dense,gguf,auto,gate,exact,lookup,draft")
    ap.add_argument("--json")
    a = ap.parse_args()
    cases = set(a.cases.split(","))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if not (PEER_BIN / "llama-completion").exists():
        sys.exit(f"{PEER_BIN}/llama-completion is missing: run {PEER} build")
    print("building gatestream (release)...", file=sys.stderr)
    sh(["cargo", "build", "--release", "--quiet"], cwd=ROOT)
    gs = ROOT / "target/release/gatestream"
    gguf, rows, bundled, draft = (work / f"{a.shape}{s}" for s in (".gguf", "-rows.gst", "-bundled.gst", "-draft.gguf"))
    made = {}
    if not gguf.exists():
        out, _ = sh([gs, "make-model", gguf, "--shape", a.shape, "--json"])
        made["gguf"] = json.loads(out)
    if not rows.exists():
        sh([gs, "reformat", gguf, rows, "--ffn-layout", "rows"])
    if {"gate", "exact"} & cases and not bundled.exists():
        sh([gs, "reformat", gguf, bundled, "--ffn-layout", "bundled"])
    if "draft" in cases and not draft.exists():
        vocab_n = json.loads(sh([gs, "inspect", rows, "--json"])[0])["config"]["vocab"]
        arch = "qwen2" if a.shape.startswith("qwen") else "llama"
        sh([gs, "make-model", draft, "--shape", "custom", "--arch", arch, "--hidden", "512", "--ffn", "1536",
            "--layers", "4", "--heads", "8", "--kv-heads", "2", "--vocab", str(vocab_n), "--seed", "2"])
    size = lambda p: p.stat().st_size
    commit = sh(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT)[0].strip()
    version = sh([PEER_BIN / "llama-completion", "--version"])[1].strip().splitlines()[0]
    print(f"gatestream {commit} vs llama.cpp ({version}); {a.shape}: GGUF {size(gguf) / 1e9:.2f} GB, rows .gst "
          f"{size(rows) / 1e9:.2f} GB; 2 threads; {a.pairs} pairs; ratio = gatestream / llama.cpp, pairs' median")
    results = []
    t0 = time.time()

    def line(case, cap, gv, lv, extra):
        ratios = [g / l for g, l in zip(gv, lv) if g > 0 and l > 0]
        r = {"case": case, "cap": cap, "gatestream": statistics.median(gv), "llama_cpp": statistics.median(lv),
             "ratio_median": statistics.median(ratios) if ratios else None, "ratios": ratios,
             "gatestream_runs": gv, "llama_cpp_runs": lv, **extra}
        results.append(r)
        more = "  ".join(f"{k}={v}" for k, v in extra.items())
        ratio = f"{r['ratio_median']:.2f}x" if ratios else "-"
        print(f"{case:<8} {cap:<10} {r['gatestream']:>8.3f} {r['llama_cpp']:>8.3f} tok/s {ratio:>7} "
              f"(pairs {', '.join(f'{x:.2f}' for x in ratios)})  {more}", flush=True)

    n = str(a.tokens)
    if "ram" in cases:
        gv, lv = [], []
        for _ in range(a.pairs):
            d = json.loads(sh([gs, "run", "--model", gguf, "--max-tokens", n, "--ignore-eos", "--prompt", PROMPT,
                               "--json"])[0])
            gv.append(d["decode_tok_per_s"])
            lv.append(json.loads(sh([PEER_BIN / "llama-bench", "-m", gguf, "-p", "0", "-n", n, "-t", "2", "-r", "1",
                                     "-o", "json"])[0])[0]["avg_ts"])
        line("ram", "-", gv, lv, {})
    if "prefill" in cases:
        words = " ".join(["word"] * 63)
        gv, lv = [], []
        for _ in range(a.pairs):
            d = json.loads(sh([gs, "run", "--model", gguf, "--max-tokens", "1", "--prompt", words, "--json"])[0])
            gv.append(d["prefill_tok_per_s"])
            lv.append(json.loads(sh([PEER_BIN / "llama-bench", "-m", gguf, "-p", "64", "-n", "0", "-t", "2", "-r", "1",
                                     "-o", "json"])[0])[0]["avg_ts"])
        line("prefill", "-", gv, lv, {"prompt_tokens": d["prompt_tokens"]})
    for cap_budget in a.caps.split(","):
        cap, budget = cap_budget.split(":")
        for case in ["dense", "gguf", "auto", "gate", "exact", "lookup", "draft"]:
            if case not in cases:
                continue
            model = bundled if case in ("gate", "exact") else gguf if case in ("gguf", "auto") else rows
            budget_args = [] if case == "auto" else ["--ram-budget", budget]
            prompt = REPETITIVE if case == "lookup" else PROMPT
            extra_args = {"gate": ["--mode", "sparse", "--sparsity", "0.5", "--criterion", "gate"],
                          "exact": ["--mode", "sparse", "--sparsity", "0.5", "--criterion", "exact"],
                          "lookup": ["--lookup", "8"], "draft": ["--draft", draft]}.get(case, [])
            gv, lv, figs = [], [], []
            for _ in range(a.pairs):
                curve = work / "curve.json"
                sh([gs, "bench", "--model", gguf, "--device-only", "--quick", "--json", curve])
                seq = json.loads(curve.read_text())["best_sequential_gb_per_s"]
                out, _, f = capped(cap, [gs, "run", "--model", model, *budget_args, "--max-tokens", n,
                                         "--ignore-eos", "--prompt", prompt, "--json", *extra_args])
                d = json.loads(out)
                s = d["stream"]
                if s is None:
                    sys.exit(f"{case} under {cap}: the model ran in RAM (placement {d.get('placement')})")
                gv.append(d["decode_tok_per_s"])
                gbs = s["disk_bytes_per_token"] * s["decode_tok_per_s"] / 1e9
                figs.append({"GB_per_tok": s["disk_bytes_per_token"] / 1e9, "GB_per_s": gbs, "device_GB_per_s": seq,
                             "of_device": gbs / seq if seq else 0, "ttft_s": d["prefill_s"],
                             "peak_rss_MB": s["peak_rss_bytes"] / 1e6, "budget_MB": s["ram_budget_bytes"] / 1e6,
                             "tokens_per_pass": (d.get("speculative") or {}).get("tokens_per_pass", 1.0)})
                if case == "auto":
                    figs[-1]["auto_budget_MB"] = d["placement"]["placed"]["budget_bytes"] / 1e6
                _, err, f = capped(cap, [PEER_BIN / "llama-completion", "-m", gguf, "-p", prompt, "-n", n, "-t", "2",
                                         "-c", "512", "--temp", "0", "-s", "1", "--ignore-eos", "-no-cnv", "-nr"])
                tok, ttft = llama_eval(err)
                lv.append(tok)
                figs[-1]["llama_ttft_s"] = ttft
                figs[-1]["llama_GB_per_tok"] = int(f["disk_read_bytes"]) / 1e9 / (a.tokens + 1)
            med = {k: round(statistics.median(x[k] for x in figs), 3) for k in figs[0]}
            line(case, cap, gv, lv, med)
    print(f"done in {time.time() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"gatestream": commit, "llama_cpp": version, "shape": a.shape,
                                            "made": made, "results": results}, indent=1))


if __name__ == "__main__":
    main()
