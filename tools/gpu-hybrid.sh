#!/bin/bash
# The hybrid executor beside today's GPU budget and llama.cpp's partial offload, on a lent GPU
# machine (see tools/gpu-carry.sh): for each model, decode and prefill tok/s of
#   gatestream --vram-budget F --hybrid gpu-stream | auto | cpu-cold
#   llama.cpp  llama-bench -ngl N (N = F of the layers), and for a mixture of experts -ngl 99
#              --n-cpu-moe L (every layer's experts on the CPU)
# Models are made on the machine (`gatestream make-model`, random weights of real shapes: their
# speeds are real, their text is not). Logs and JSON under $OUT; the table is printed last.
#
#   tools/gpu-carry.sh && tools/llama-cpp.sh build-cuda gpupeer   # here (gpupeer: git-excluded)
#   bash tools/gpu-hybrid.sh [SETS]          # there; carry ["gpucarry", "gpupeer"]
#
# SETS (default: "qwen40 qwen70 moe big"): qwen40 / qwen70: Qwen2.5-1.5B-shaped at --vram-budget
# 40% / 70%; moe: Qwen3-30B-A3B-shaped at 25%; big: Qwen2.5-32B-shaped at 25%; dense:SHAPE:PCT and
# moe:SHAPE:PCT any shape at any share. A mixture of experts gets two llama.cpp rows: every layer's
# experts on the CPU, and --n-cpu-moe N holding what the budget holds on the GPU (N from the GGUF's
# tensor sizes). Models already in MODELS are used as they are; KEEP=1 leaves them there. MODES
# (default "gpu-stream auto cpu-cold"): the --hybrid values run; LLAMA_ROWS=0 leaves llama.cpp's
# rows out (and its GGUFs unwritten). Settings by
# environment: GATESTREAM (binary), GPU_DEVICE (cuda; host-standin runs the script here, with no
# GPU and nothing it prints a GPU's figure), LLAMA_BIN (llama.cpp's binaries; default /tmp/llb
# from gpupeer/setup.sh), MODELS (where models are written; default /tmp/gsm), TOKENS (32),
# PROMPT_CHARS (420: about 512 tokens of the synthetic tokenizer, whose spaces are 3 byte tokens), THREADS (all cores), DEADLINE (420: seconds after which
# no further run starts, so a device call of 600 s ends with its table).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-hybrid}
mkdir -p "$OUT"
G=${GATESTREAM:-gpucarry/gatestream}
DEV=${GPU_DEVICE:-cuda}
M=${MODELS:-/tmp/gsm}
TOKENS=${TOKENS:-32}
THREADS=${THREADS:-$(nproc)}
SETS=${*:-qwen40 qwen70 moe big}
mkdir -p "$M"
START=$SECONDS
late() { [ $((SECONDS - START)) -ge "${DEADLINE:-420}" ]; }
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/log.txt" >&2; }
[ -x "$G" ] || { log "no gatestream binary at $G (tools/gpu-carry.sh builds it)"; exit 1; }
text=data/wikitext-2/wiki.test.raw
PROMPT=$(head -c "${PROMPT_CHARS:-420}" "$text" | tr -d '\000')
if [ -z "${LLAMA_BIN:-}" ] && [ -f gpupeer/setup.sh ]; then
    eval "$(bash gpupeer/setup.sh)"
    LLAMA_BIN=/tmp/llb
fi
LL=${LLAMA_BIN:-/tmp/llb}
if "$LL/llama-bench" --help >/dev/null 2>&1; then
    log "llama.cpp: $LL/llama-bench starts"
else
    log "llama.cpp: $LL/llama-bench does not start (ldd: $(ldd "$LL/llama-bench" 2>&1 | grep -c 'not found') libraries not found); its rows are skipped"
    ldd "$LL/llama-bench" > "$OUT/llama-ldd.txt" 2>&1
    LL=
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/log.txt"
rows="$OUT/rows.tsv"
: > "$rows"

make() { # SHAPE -> $M/SHAPE.gguf and $M/SHAPE.gst (split layout for dense, experts' sections for MoE)
    local shape=$1 f
    # (the synthetic tokenizer: the GPU machine has no real model to take one from; make-model
    # writes the .gst itself, in parallel, rather than reformat copying the GGUF)
    local formats=(gguf gst)
    [ "${LLAMA_ROWS:-1}" = 0 ] && formats=(gst)
    for f in "${formats[@]}"; do
        [ -s "$M/$shape.$f" ] || "$G" make-model "$M/$shape.$f" --shape "$shape" --tokenizer synthetic --force >> "$OUT/make.txt" 2>&1 || return 1
    done
}

drop() { [ "${KEEP:-0}" = 1 ] || rm -f "$M/$1".gguf "$M/$1".gst; }

ours() { # LABEL MODEL.gst VRAM HYBRID
    local label=$1 f="$OUT/$1.json"
    late && { printf '%s\tgatestream\tnot run (deadline)\t-\t-\n' "$label" >> "$rows"; return; }
    timeout 300 "$G" run --device "$DEV" --model "$2" --vram-budget "$3" --hybrid "$4" --threads "$THREADS" \
        --prompt "$PROMPT" --max-tokens "$TOKENS" --ignore-eos --json > "$f" 2> "$OUT/$label.err"
    local rc=$?
    python3 - "$f" "$label" "$rc" "$3" >> "$rows" <<'EOF'
import json, sys
f, label, rc, vram = sys.argv[1:]
try:
    d = json.load(open(f))
except Exception:
    print(f"{label}\tgatestream --vram-budget {vram}\tfailed (exit {rc})\t-\t-")
    sys.exit()
s = d.get("stream") or {}
h = s.get("hybrid") or {}
l = s.get("link") or {}
plan = h.get("plan") or {}
note = f"copied {l.get('bytes_per_token', 0)/1e6:.0f} MB/tok"
if h:
    w = plan.get('max_width') or 0
    note += f"; CPU {h.get('cpu_bytes_per_token', 0)/1e6:.0f} MB/tok at {h.get('cpu_gb_per_s', 0):.1f} GB/s, CPU passes <= {'any' if w > 1 << 40 else w} tokens"
print(f"{label}\tgatestream --vram-budget {vram}\t{d.get('prefill_tok_per_s', 0):.1f}\t{d.get('decode_tok_per_s', 0):.2f}\t{note}")
EOF
}

theirs() { # LABEL MODEL.gguf ARGS...
    local label=$1 gguf=$2
    shift 2
    [ -n "$LL" ] || { printf '%s\tllama.cpp %s\tnot run (no llama.cpp)\t-\t-\n' "$label" "$*" >> "$rows"; return; }
    late && { printf '%s\tllama.cpp %s\tnot run (deadline)\t-\t-\n' "$label" "$*" >> "$rows"; return; }
    timeout 300 "$LL/llama-bench" -m "$gguf" -p 512 -n "$TOKENS" -t "$THREADS" -r 2 -o json "$@" \
        > "$OUT/$label.json" 2> "$OUT/$label.err"
    local rc=$?
    python3 - "$OUT/$label.json" "$label" "$rc" "$*" >> "$rows" <<'EOF'
import json, sys
f, label, rc, args = sys.argv[1:]
try:
    runs = json.load(open(f))
    pp = next(r["avg_ts"] for r in runs if r["n_prompt"] > 0)
    tg = next(r["avg_ts"] for r in runs if r["n_gen"] > 0)
    print(f"{label}\tllama.cpp {args}\t{pp:.1f}\t{tg:.2f}\t")
except Exception:
    print(f"{label}\tllama.cpp {args}\tfailed (exit {rc})\t-\t-")
EOF
}

layers_of() { "$G" inspect "$1" --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["config"]["n_layers"])'; }

# (GGUF -> "EXPERT_BYTES TOTAL_BYTES LAYERS", read from its tensor infos: what --n-cpu-moe moves)
gguf_sizes() { python3 - "$1" <<'EOF'
import os, struct, sys
f = open(sys.argv[1], "rb")
rd = lambda t: struct.unpack("<" + t, f.read(struct.calcsize("<" + t)))[0]
s = lambda: f.read(rd("Q")).decode()
W = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
def val(t):
    if t == 8:
        return s()
    if t == 9:
        et, n = rd("I"), rd("Q")
        return [val(et) for _ in range(n)]
    return rd(W[t])
assert f.read(4) == b"GGUF"
rd("I"); nt = rd("Q"); nkv = rd("Q")
align, layers = 32, 0
for _ in range(nkv):
    k = s(); v = val(rd("I"))
    align = v if k == "general.alignment" else align
    layers = v if k.endswith(".block_count") else layers
infos = []
for _ in range(nt):
    name = s(); nd = rd("I"); [rd("Q") for _ in range(nd)]; rd("I"); infos.append((rd("Q"), name))
end = os.path.getsize(sys.argv[1]) - (f.tell() + align - 1) // align * align
infos.sort()
sz = [((infos[i + 1][0] if i + 1 < len(infos) else end) - o, n) for i, (o, n) in enumerate(infos)]
print(sum(b for b, n in sz if "_exps" in n), sum(b for b, _ in sz), layers)
EOF
}

dense_set() { # NAME SHAPE FRACTION_PERCENT
    local name=$1 shape=$2 pct=$3
    make "$shape" || { log "$name: make-model failed (see make.txt)"; return; }
    for h in ${MODES:-gpu-stream auto cpu-cold}; do
        log "$name: gatestream --hybrid $h"
        ours "$name-$h" "$M/$shape.gst" "$pct%" "$h"
    done
    local n ngl
    n=$(layers_of "$M/$shape.gst")
    ngl=$(( (n * pct + 50) / 100 ))
    [ "${LLAMA_ROWS:-1}" = 0 ] && return
    log "$name: llama.cpp -ngl $ngl of $n"
    theirs "$name-llama-ngl$ngl" "$M/$shape.gguf" -ngl "$ngl"
}

moe_set() { # NAME SHAPE FRACTION_PERCENT
    local name=$1 shape=$2 pct=$3 h
    late && return
    make "$shape" || { log "$name: make-model failed (see make.txt)"; drop "$shape"; return; }
    for h in ${MODES:-gpu-stream auto cpu-cold}; do
        log "$name: gatestream --hybrid $h"
        ours "$name-$h" "$M/$shape.gst" "$pct%" "$h"
    done
    local exps total n same
    [ "${LLAMA_ROWS:-1}" = 0 ] && { drop "$shape"; return; }
    read -r exps total n < <(gguf_sizes "$M/$shape.gguf")
    # (the layers whose experts fit on the GPU beside everything else in PCT of the model)
    same=$(python3 -c "e,t,n,p=$exps,$total,$n,$pct; k=int(max(0,t*p/100-(t-e))/(e/n)); print(n-min(n,k))")
    log "$name: llama.cpp -ngl 99 --n-cpu-moe $n (all experts on the CPU) and $same (the budget's GPU memory)"
    theirs "$name-llama-ncmoe$n" "$M/$shape.gguf" -ngl 99 -ncmoe "$n"
    [ "$same" != "$n" ] && theirs "$name-llama-ncmoe$same" "$M/$shape.gguf" -ngl 99 -ncmoe "$same"
    drop "$shape"
}

for set in $SETS; do
    case $set in
        dense:*:*) IFS=: read -r _ shape pct <<< "$set"; dense_set "${shape}-$pct" "$shape" "$pct" ;;
        moe:*:*) IFS=: read -r _ shape pct <<< "$set"; moe_set "${shape}-$pct" "$shape" "$pct" ;;
        qwen40) dense_set qwen40 qwen2.5-1.5b 40 ;;
        qwen70) dense_set qwen70 qwen2.5-1.5b 70 ;;
        # (a 32B GGUF and its .gst take 40 GB of the machine's 64: removed after their runs)
        big) late || dense_set big qwen2.5-32b 25; drop qwen2.5-32b ;;
        moe) moe_set moe qwen3-30b-a3b 25 ;;
        *) log "unknown set $set" ;;
    esac
done
echo
echo "device: $DEV ($(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
# (the table aligned by python3: the GPU machine has no `column`)
printf 'case\tsystem\tprefill tok/s\tdecode tok/s\tnotes\n' | cat - "$rows" | python3 -c 'import sys
rows = [l.rstrip("\n").split("\t") for l in sys.stdin]
w = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(max(map(len, rows)))]
for r in rows:
    print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())'
