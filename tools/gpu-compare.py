#!/usr/bin/env python3
"""gatestream's CUDA device beside llama.cpp's CUDA backend, on the same GGUF and GPU, in one run.

    tools/gpu-carry.sh && tools/llama-cpp.sh build-cuda gpupeer   # here (both folders git-excluded)
    python3 tools/gpu-compare.py [--cases decode,prefill,depth,batched,served] [--pairs 2]
                                 [--shape qwen2.5-1.5b] [--deadline 240] [--json FILE]
                                                                # there; carry ["gpucarry", "gpupeer"]

The model is written on the machine (`gatestream make-model --shape SHAPE --tokenizer synthetic`:
random weights in llama.cpp's Q4_K_M type mix; speeds are real, text is not; the synthetic
vocabulary spells English as byte tokens, so N characters of prompt are about N tokens in both
engines). Cases, each timed A B A B (--pairs pairs; ratios are gatestream / llama.cpp, above 1
is gatestream faster; each line gives both medians and the median of the per-pair ratios):

  decode   llama-bench -ngl 99 -p 0 -n 128 (tg128) vs `gatestream run --device cuda --max-tokens
           128 --ignore-eos --json` from a 6-token prompt (decode_tok_per_s)
  prefill  llama-bench -ngl 99 -p 512 -n 0 (pp512) vs `run --max-tokens 1` on a 511-character
           prompt, 512 tokens with BOS (prefill_tok_per_s)
  depth    decode after a prompt: llama-bench -ngl 99 -p 0 -n 128 -d 512 (tg128 at depth 512) vs
           `run --max-tokens 128 --ignore-eos` after the 512-token prompt (decode_tok_per_s)
  batched  N sequences at once, each a 128-token prompt and 128 generated tokens:
           llama-batched-bench -npp 128 -ntg 128 -npl 1,8,32,64 (generated tokens over its whole
           time, prompts included; its decode-only S_TG beside it) vs `gatestream serve --parallel
           64` under tools/serve-bench.py at concurrency N, one request a client (the same tokens,
           through HTTP: the server's overhead counts against gatestream)
  served   llama-server -np 64 vs `gatestream serve --parallel 64`, the same client
           (tools/serve-bench.py: C clients, 2 requests each, 64 tokens, short prompts), C = 1/8/32
  mma      (not a llama.cpp row) gatestream's own prefill of the 512-token prompt with Q4_K/Q6_K
           batches as integer tiles (the default) and as f16 pairs (GATESTREAM_CUDA_MMQ=0), A B A B
  prefetch (not a llama.cpp row) the same prefill with the integer tiles loading the next
           super-block's weights while they multiply (GATESTREAM_CUDA_MMQ_PREFETCH=1) and where
           they unpack them (=0, the default), A B A B
  int8     (not a llama.cpp row) gatestream's batched decode at 2, 4 and 8 sequences (as in
           `batched`) with batches of Q4_K/Q6_K products as integers (GATESTREAM_CUDA_INT8_TOKENS=8,
           the default) and on the tensor cores (=1): the crossover; one run each
  split    (not a llama.cpp row) gatestream's decode at depth 512 (as in `depth`) with attention
           split over positions (GATESTREAM_CUDA_ATTN_SPLIT=1, the default) and a block per head
           (=0), A B A B
  fuse     (not a llama.cpp row) the same decode with launches fused (GATESTREAM_CUDA_FUSE=1:
           norms, activations, merges in the last blocks of the launch before) and each in a
           launch of its own (=0, the default), A B A B
  profile  (not timed against anything) per-kernel GPU time of that prefill under `ncu --metrics
           gpu__time_duration.sum` (upper bounds), summed by kernel into OUT/profile.txt, and of 16
           decode steps after a 6-token prompt (each kernel's time a step) into OUT/profile-decode.txt

Settings: --gatestream (default gpucarry/gatestream, else target/release/gatestream), --llama
(llama.cpp's binaries; default: unpacked from gpupeer/ by its setup.sh into /tmp/llb), --device
(cuda; a dry run here: --device cpu --ngl 0 --llama ~/.cache/gatestream/llama.cpp/bin, llama.cpp's
CPU build from tools/llama-cpp.sh build: every case runs, the switches do nothing, and
nothing it prints is a GPU's figure), --deadline (seconds after which no further case starts).
Logs and results under $OUT (default /tmp/gpu-compare); the table is printed last.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT") or "/tmp/gpu-compare")
START = time.time()
ROWS = []


def log(msg):
    line = f"[{time.strftime('%H:%M:%S')} +{time.time() - START:5.0f}s] {msg}"
    print(line, file=sys.stderr, flush=True)
    with open(OUT / "log.txt", "a") as f:
        f.write(line + "\n")


def run(cmd, name, timeout=300, env=None):
    """Runs cmd with its output in OUT/name.{out,err}; returns (rc, stdout)."""
    t = time.time()
    try:
        p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    (OUT / f"{name}.out").write_text(out)
    (OUT / f"{name}.err").write_text(err)
    log(f"{name}: exit {rc} in {time.time() - t:.1f} s: {' '.join(shlex.quote(str(c)) for c in cmd)[:300]}")
    return rc, out


def row(case, ours, theirs, ratios, note=""):
    med = lambda v: f"{statistics.median(v):.1f}" if v else "-"
    r = {"case": case, "gatestream": med(ours), "llama.cpp": med(theirs),
         "ratio": f"{statistics.median(ratios):.2f}" if ratios else "-",
         "pairs": " ".join(f"{x:.2f}" for x in ratios), "note": note,
         "gatestream_all": ours, "llama_all": theirs}
    ROWS.append(r)
    log(f"ROW {case}: gatestream {r['gatestream']} llama.cpp {r['llama.cpp']} ratio {r['ratio']} ({r['pairs']}) {note}")


def llama_bench(a, ll, env, gguf, p, n, name, depth=0):
    rc, out = run([ll / "llama-bench", "-m", gguf, "-ngl", a.ngl, "-p", p, "-n", n, "-r", 2, "-t", a.threads,
                   "-o", "json"] + (["-d", depth] if depth else []), name, env=env)
    try:
        return float(json.loads(out)[0]["avg_ts"])
    except Exception:
        return None


def ours_run(a, gguf, prompt, tokens, name, field, env=None):
    rc, out = run([a.gatestream, "run", "--device", a.device, "--model", gguf, "--threads", a.threads,
                   "--prompt", prompt, "--max-tokens", tokens, "--ignore-eos", "--json"], name, env=env)
    try:
        d = json.loads(out)
        return float(d[field]), d
    except Exception:
        return None, None


def late(a):
    return time.time() - START > a.deadline


def paired(a, case, pairs, ours_fn, theirs_fn, note=""):
    ours, theirs, ratios = [], [], []
    for i in range(pairs):
        if late(a):
            note += f" (deadline: {i} of {pairs} pairs)"
            break
        order = [("g", ours_fn), ("l", theirs_fn)] if i % 2 == 0 else [("l", theirs_fn), ("g", ours_fn)]
        got = {}
        for k, fn in order:
            got[k] = fn(i)
        if got["g"] is not None:
            ours.append(got["g"])
        if got["l"] is not None:
            theirs.append(got["l"])
        if got["g"] and got["l"]:
            ratios.append(got["g"] / got["l"])
    row(case, ours, theirs, ratios, note)


def serve_bench(a, cmd, label, conc, per_client, tokens, prompt_file, name):
    argv = [sys.executable, ROOT / "tools/serve-bench.py", "--server", cmd, "--label", label,
            "--concurrency", conc, "--requests-per-client", per_client, "--max-tokens", tokens]
    if prompt_file:
        argv += ["--prompt-file", prompt_file]
    rc, out = run(argv, name, timeout=240)
    levels = {}
    for line in out.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        for lv in d.get("levels", []):
            levels[lv["concurrency"]] = lv
    return levels


def profile(a, gguf, prompt, tokens=1, what="prefill", name="profile"):
    """Per-kernel GPU time of one `run` under ncu (a prefill: `tokens` 1; decode: a short prompt
    and `tokens` steps, each kernel's time also a step), summed by kernel name into OUT/NAME.txt."""
    import csv
    import shutil
    if not shutil.which("ncu"):
        log(f"{name}: no ncu on this machine; skipped")
        return
    rc, out = run(["ncu", "--clock-control", "none", "--csv", "--metrics", "gpu__time_duration.sum",
                   a.gatestream, "run", "--device", a.device, "--model", gguf, "--prompt", prompt,
                   "--max-tokens", tokens, "--ignore-eos"], f"{name}-ncu", timeout=150)
    tot, cnt = {}, {}
    rows = csv.DictReader([l for l in out.splitlines() if l.startswith('"')])
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3}.get(r.get("Metric Unit"), 1)
        k = r["Kernel Name"].split("(")[0]
        tot[k] = tot.get(k, 0) + float(r["Metric Value"].replace(",", "")) * unit
        cnt[k] = cnt.get(k, 0) + 1
    total = sum(tot.values()) or 1
    steps = max(tokens - 1, 1)
    lines = [f"{what} ({len(prompt)}-letter prompt, {tokens} tokens): {total / 1e3:.2f} ms of kernel time over "
             f"{sum(cnt.values())} launches (ncu upper bounds)" + ("" if tokens == 1 else f"; per step: / {steps}")]
    lines += [f"  {k:32s} {cnt[k]:6d} launches {v / 1e3:9.3f} ms {100 * v / total:5.1f}%"
              + ("" if tokens == 1 else f" {v / steps:9.1f} us a step")
              for k, v in sorted(tot.items(), key=lambda x: -x[1])[:20]]
    (OUT / f"{name}.txt").write_text("\n".join(lines) + "\n")
    log(f"{name}: " + lines[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="decode,prefill,depth,batched,served,mma,prefetch,int8,split,fuse,profile")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--shape", default="qwen2.5-1.5b", help="make-model's shape (written once into --models)")
    ap.add_argument("--model", help="a GGUF to use instead of making one")
    ap.add_argument("--models", default="/tmp/gsm")
    ap.add_argument("--gatestream")
    ap.add_argument("--llama")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ngl", default="99")
    ap.add_argument("--threads", default=str(os.cpu_count()))
    ap.add_argument("--widths", default="1,8,32,64", help="batched: sequences at once")
    ap.add_argument("--served", default="1,8,32", help="served: clients at once")
    ap.add_argument("--deadline", type=float, default=240)
    ap.add_argument("--json", help="write the rows here (default OUT/compare.json)")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    g = Path(a.gatestream or (ROOT / "gpucarry/gatestream" if (ROOT / "gpucarry/gatestream").exists()
                              else ROOT / "target/release/gatestream"))
    a.gatestream = g
    env = dict(os.environ)
    if a.llama:
        ll = Path(a.llama)
    else:
        setup = ROOT / "gpupeer/setup.sh"
        if not setup.exists():
            sys.exit("no llama.cpp: give --llama DIR, or build gpupeer/ with tools/llama-cpp.sh build-cuda")
        line = subprocess.run(["bash", setup], capture_output=True, text=True).stdout.strip()
        if line.startswith("export LD_LIBRARY_PATH="):
            env["LD_LIBRARY_PATH"] = line.split("=", 1)[1].replace("${LD_LIBRARY_PATH:-}", env.get("LD_LIBRARY_PATH", ""))
        ll = Path("/tmp/llb")
    os.environ["LD_LIBRARY_PATH"] = env.get("LD_LIBRARY_PATH", "")
    rc, _ = run([ll / "llama-bench", "--help"], "llama-starts", timeout=30, env=env)
    if rc != 0:
        run(["ldd", ll / "llama-bench"], "llama-ldd", timeout=30)
        log("llama.cpp's llama-bench does not start (see llama-ldd.out); the comparison needs it")
        sys.exit(1)
    if a.model:
        gguf = Path(a.model)
    else:
        Path(a.models).mkdir(parents=True, exist_ok=True)
        gguf = Path(a.models) / f"{a.shape}.gguf"
        if not gguf.exists():
            rc, _ = run([g, "make-model", gguf, "--shape", a.shape, "--tokenizer", "synthetic", "--force"],
                        "make-model", timeout=600)
            if rc != 0:
                sys.exit("make-model failed (see make-model.err)")
    log(f"model {gguf} ({gguf.stat().st_size / 1e6:.0f} MB), device {a.device}, llama.cpp -ngl {a.ngl}")
    cases = a.cases.split(",")
    # Warm-ups: each engine loads the model once untimed (file in the page cache, kernels compiled).
    # Prompts are ASCII letters, no spaces: a byte token each in the synthetic vocabulary, plus
    # what the tokenizer adds (BOS, a leading word mark), measured here and taken off.
    letters = "".join(c for c in (ROOT / "README.md").read_text(errors="replace") if c.isascii() and c.isalpha())
    _, d = ours_run(a, gguf, letters[:511], 1, "warm-gatestream", "prefill_tok_per_s")
    extra = (d or {}).get("prompt_tokens", 512) - 511
    log(f"a 511-letter prompt is {511 + extra} tokens")
    p512 = letters[:512 - extra]  # 512 tokens in both engines (prefill, depth, mma, split, profile)
    pf = OUT / "prompt128.txt"  # 128 tokens (batched, int8)
    pf.write_text(letters[1000:1128 - extra])
    llama_bench(a, ll, env, gguf, 16, 4, "warm-llama")

    if "decode" in cases:
        paired(a, "decode tg128 (tok/s)", a.pairs,
               lambda i: ours_run(a, gguf, "The capital of France is", 128, f"decode-gs-{i}", "decode_tok_per_s")[0],
               lambda i: llama_bench(a, ll, env, gguf, 0, 128, f"decode-ll-{i}"))
    if "prefill" in cases:
        tokens = []

        def ours(i):
            v, d = ours_run(a, gguf, p512, 1, f"prefill-gs-{i}", "prefill_tok_per_s")
            if d:
                tokens.append(d.get("prompt_tokens"))
            return v
        paired(a, "prefill pp512 (tok/s)", a.pairs, ours,
               lambda i: llama_bench(a, ll, env, gguf, 512, 0, f"prefill-ll-{i}"))
        ROWS[-1]["note"] += f" gatestream's prompt: {sorted(set(tokens))} tokens"
    if "depth" in cases and not late(a):
        paired(a, "decode tg128 at depth 512 (tok/s)", a.pairs,
               lambda i: ours_run(a, gguf, p512, 128, f"depth-gs-{i}", "decode_tok_per_s")[0],
               lambda i: llama_bench(a, ll, env, gguf, 0, 128, f"depth-ll-{i}", depth=512))
    widths = [int(w) for w in a.widths.split(",")]
    par = max(widths + [int(c) for c in a.served.split(",")])
    gs_serve = (f"{g} serve --device {a.device} --model {gguf} --port {{port}} --parallel {par} --ctx-size 512 "
                f"--threads {a.threads}")
    ll_serve = (f"{ll}/llama-server -m {gguf} -ngl {a.ngl} -np {par} -c {512 * par} -t {a.threads} "
                f"--host 127.0.0.1 --port {{port}}")
    if "batched" in cases and not late(a):
        rc, out = run([ll / "llama-batched-bench", "-m", gguf, "-ngl", a.ngl, "-c", 256 * max(widths), "-b", 2048,
                       "-ub", 512, "-npp", 128, "-ntg", 128, "-npl", a.widths, "-t", a.threads,
                       "--output-format", "jsonl"], "batched-ll", timeout=240, env=env)
        llb = {}
        for line in out.splitlines():
            try:
                d = json.loads(line)
                llb[int(d["pl"])] = d
            except (ValueError, KeyError):
                pass
        gsb = serve_bench(a, gs_serve, "gatestream", a.widths, 1, 128, pf, "batched-gs")
        for w in widths:
            lv, d = gsb.get(w), llb.get(w)
            mine = lv["tok_per_s"] if lv and not lv.get("errors") else None
            theirs = d["pl"] * d["tg"] / d["t"] if d else None
            note = f"llama.cpp decode-only S_TG {d['speed_tg']:.0f}" if d else "llama.cpp: no row"
            if lv and lv.get("errors"):
                note += f"; gatestream errors {lv['errors']}: {lv.get('first_error')}"
            row(f"batched {w} x (128+128) (gen tok/s)", [mine] if mine else [], [theirs] if theirs else [],
                [mine / theirs] if mine and theirs else [], note)
    if "served" in cases and not late(a):
        got = {"gs": serve_bench(a, gs_serve, "gatestream", a.served, 2, 64, None, "served-gs"),
               "ll": serve_bench(a, ll_serve, "llama-server", a.served, 2, 64, None, "served-ll")}
        for c in [int(x) for x in a.served.split(",")]:
            lg, lf = got["gs"].get(c), got["ll"].get(c)
            mine = lg["tok_per_s"] if lg and not lg.get("errors") else None
            theirs = lf["tok_per_s"] if lf and not lf.get("errors") else None
            note = ""
            for who, lv in (("gatestream", lg), ("llama-server", lf)):
                if lv and lv.get("errors"):
                    note += f"{who} errors {lv['errors']}: {str(lv.get('first_error'))[:120]}; "
            row(f"served C={c} (tok/s)", [mine] if mine else [], [theirs] if theirs else [],
                [mine / theirs] if mine and theirs else [], note)

    def switch_ab(case, var, tokens, field):
        """gatestream alone on the 512-token prompt, GATESTREAM_CUDA_{var} 1 against 0, A B A B: the
        llama.cpp column is the 0 run."""
        def with_value(v, i):
            return ours_run(a, gguf, p512, tokens, f"{var.lower()}{v}-{i}", field,
                            env=dict(os.environ, **{f"GATESTREAM_CUDA_{var}": v}))[0]
        paired(a, case, a.pairs, lambda i: with_value("1", i), lambda i: with_value("0", i),
               f"gatestream alone: the llama.cpp column is {var}=0")

    if "mma" in cases and not late(a):
        switch_ab("prefill, integer tiles / f16 pairs", "MMQ", 1, "prefill_tok_per_s")
    if "prefetch" in cases and not late(a):
        switch_ab("prefill, tiles loading ahead / not", "MMQ_PREFETCH", 1, "prefill_tok_per_s")
    if "int8" in cases and not late(a):
        on = serve_bench(a, gs_serve, "int8 8", "2,4,8", 1, 128, pf, "int8-8")
        off = serve_bench(a, "env GATESTREAM_CUDA_INT8_TOKENS=1 " + gs_serve, "int8 1", "2,4,8", 1, 128, pf, "int8-1")
        for w in (2, 4, 8):
            lo, lf = on.get(w), off.get(w)
            mine = lo["tok_per_s"] if lo and not lo.get("errors") else None
            base = lf["tok_per_s"] if lf and not lf.get("errors") else None
            row(f"batched {w}, integer / tensor cores", [mine] if mine else [], [base] if base else [],
                [mine / base] if mine and base else [], "gatestream alone: the llama.cpp column is INT8_TOKENS=1")
    if "split" in cases and not late(a):
        switch_ab("decode at depth 512, split / a block a head", "ATTN_SPLIT", 128, "decode_tok_per_s")
    if "fuse" in cases and not late(a):
        switch_ab("decode at depth 512, fused / not", "FUSE", 128, "decode_tok_per_s")
    if "profile" in cases and not late(a):
        profile(a, gguf, p512)
        profile(a, gguf, "The capital of France is", 17, "decode", "profile-decode")

    (Path(a.json) if a.json else OUT / "compare.json").write_text(json.dumps(
        {"model": str(gguf), "device": a.device, "ngl": a.ngl, "rows": ROWS}, indent=1))
    print(f"\n{'case':<36} {'gatestream':>11} {'llama.cpp':>10} {'ratio':>6}  pairs / note")
    for r in ROWS:
        print(f"{r['case']:<36} {r['gatestream']:>11} {r['llama.cpp']:>10} {r['ratio']:>6}  {r['pairs']} {r['note']}")
    for f in ("profile.txt", "profile-decode.txt"):
        if (OUT / f).exists():
            print("\n" + (OUT / f).read_text(), end="")
    if a.device != "cuda":
        print(f"(--device {a.device}: no figure above is a GPU's)")


if __name__ == "__main__":
    main()
