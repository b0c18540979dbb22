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
# 40% / 70%; moe: Qwen3-30B-A3B-shaped at 25%; big: Qwen2.5-32B-shaped at 25%. Settings by
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
    local shape=$1
    # (the synthetic tokenizer: the GPU machine has no real model to take one from)
    [ -s "$M/$shape.gguf" ] || "$G" make-model "$M/$shape.gguf" --shape "$shape" --tokenizer synthetic --force >> "$OUT/make.txt" 2>&1 || return 1
    [ -s "$M/$shape.gst" ] || "$G" reformat "$M/$shape.gguf" "$M/$shape.gst" --ffn-layout split --force >> "$OUT/make.txt" 2>&1 || return 1
}

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

dense_set() { # NAME SHAPE FRACTION_PERCENT
    local name=$1 shape=$2 pct=$3
    make "$shape" || { log "$name: make-model failed (see make.txt)"; return; }
    for h in gpu-stream auto cpu-cold; do
        log "$name: gatestream --hybrid $h"
        ours "$name-$h" "$M/$shape.gst" "$pct%" "$h"
    done
    local n ngl
    n=$(layers_of "$M/$shape.gst")
    ngl=$(( (n * pct + 50) / 100 ))
    log "$name: llama.cpp -ngl $ngl of $n"
    theirs "$name-llama-ngl$ngl" "$M/$shape.gguf" -ngl "$ngl"
}

for set in $SETS; do
    case $set in
        qwen40) dense_set qwen40 qwen2.5-1.5b 40 ;;
        qwen70) dense_set qwen70 qwen2.5-1.5b 70 ;;
        # (a 32B GGUF and its .gst take 40 GB of the machine's 64: removed after their runs)
        big) late || dense_set big qwen2.5-32b 25; rm -f "$M"/qwen2.5-32b.* ;;
        moe)
            late && continue
            make qwen3-30b-a3b || { log "moe: make-model failed"; continue; }
            for h in gpu-stream auto cpu-cold; do
                log "moe: gatestream --hybrid $h"
                ours "moe-$h" "$M/qwen3-30b-a3b.gst" 25% "$h"
            done
            n=$(layers_of "$M/qwen3-30b-a3b.gst")
            log "moe: llama.cpp -ngl 99 --n-cpu-moe $n"
            theirs moe-llama-ncmoe "$M/qwen3-30b-a3b.gguf" -ngl 99 -ncmoe "$n"
            rm -f "$M"/qwen3-30b-a3b.*
            ;;
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
