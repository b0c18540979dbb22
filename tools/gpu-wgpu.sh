#!/bin/bash
# The portable path's cost on an NVIDIA GPU (issue 66, must-show 2): `run --device wgpu` (Vulkan)
# beside `run --device cuda` on the same model, decode and prefill, in rounds taken in turn (cuda,
# wgpu, wgpu with f32 products: what the packed 8-bit products give a GPU); one table last. Part `wgpu` of tools/gpu-session.sh, or alone:
#
#   OUT=/tmp/gw bash tools/gpu-wgpu.sh [MODEL.gguf]     # default: $MODELS/qwen2.5-1.5b.gguf
#
# The binary (GATESTREAM, default gpucarry/gatestream) must be built with `--features cuda,wgpu`
# (tools/gpu-carry.sh does). Vulkan: the machine's loader, else the one tools/gpu-carry.sh copies
# into gpucarry/; NVIDIA's driver, through its own ICD file, else one written here for the
# driver's libGLX_nvidia.so.0. Where wgpu still finds no NVIDIA adapter the table says so (and
# which adapter it found, if any) and nothing of wgpu is measured. Settings: PAIRS (2), TOKENS
# (128, decode), BASE (cuda: the device wgpu is set beside; a dry run here: BASE=cpu), DEADLINE
# (seconds; no pair starts later, default 60).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-wgpu}
mkdir -p "$OUT"
G=${GATESTREAM:-gpucarry/gatestream}
MODEL=${1:-${MODELS:-/tmp/gsm}/qwen2.5-1.5b.gguf}
BASE=${BASE:-cuda}
START=$SECONDS
log() { echo "[wgpu +$((SECONDS - START))s] $*" | tee -a "$OUT/wgpu-log.txt" >&2; }
[ -x "$G" ] || { log "no gatestream binary at $G"; exit 1; }
[ -s "$MODEL" ] || { log "no model at $MODEL (gpu-compare writes it: make-model --shape qwen2.5-1.5b)"; exit 1; }

# Vulkan: a loader, and an ICD for NVIDIA's driver.
if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1 ' && [ -f gpucarry/libvulkan.so.1 ]; then
    export LD_LIBRARY_PATH="$PWD/gpucarry${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    log "Vulkan loader: the carried gpucarry/libvulkan.so.1"
fi
icds=$(ls /usr/share/vulkan/icd.d/nvidia* /etc/vulkan/icd.d/nvidia* 2>/dev/null | head -1)
if [ -z "$icds" ]; then
    glx=$(ldconfig -p 2>/dev/null | awk '/libGLX_nvidia\.so\.0 / {print $NF; exit}')
    if [ -n "$glx" ]; then
        printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$glx" > "$OUT/nvidia_icd.json"
        export VK_ICD_FILENAMES="$OUT/nvidia_icd.json"
        log "Vulkan ICD: written for $glx"
    else
        log "Vulkan ICD: none for NVIDIA and no libGLX_nvidia.so.0 (the driver's Vulkan part is not installed here)"
    fi
else
    log "Vulkan ICD: $icds"
fi

letters=$(tr -cd 'A-Za-z' < README.md | head -c 511)
one() { # DEVICE PROMPT TOKENS NAME -> "decode prefill" tok/s, or "- -" (wgpu-q8: wgpu, f32 products)
    local out dev=("--device" "$1")
    [ "$1" = wgpu-q8 ] && dev=(--device wgpu --activations q8)
    out=$(timeout 120 "$G" run "${dev[@]}" --model "$MODEL" --threads "$(nproc)" --prompt "$2" --max-tokens "$3" \
        --ignore-eos --json 2> "$OUT/$4.err")
    echo "$out" > "$OUT/$4.json"
    python3 -c 'import json,sys
try:
    d = json.loads(sys.argv[1]); print(d["decode_tok_per_s"], d["prefill_tok_per_s"])
except Exception:
    print("- -")' "$out"
}
# Warm-ups (shaders and kernels compiled, the file in the page cache); the adapter wgpu found.
one "$BASE" "$letters" 1 warm-base > /dev/null
one wgpu "$letters" 1 warm-wgpu > /dev/null
adapter=$(sed -n 's/.* on \(wgpu (.*)\).*/\1/p' "$OUT/warm-wgpu.err" | head -1)
log "wgpu adapter: ${adapter:-none ($(grep -m1 -i 'error' "$OUT/warm-wgpu.err"))}"
rows=()
if [ -z "$adapter" ] || ! grep -qi nvidia <<< "$adapter"; then
    [ "$BASE" = cuda ] && rows+=("wgpu	no NVIDIA adapter through Vulkan: nothing measured (${adapter:-no adapter})")
fi
if [ ${#rows[@]} -eq 0 ]; then
    for i in $(seq "${PAIRS:-2}"); do
        [ $((SECONDS - START)) -gt "${DEADLINE:-60}" ] && { log "deadline: $((i - 1)) pairs"; break; }
        for dev in "$BASE" wgpu wgpu-q8; do
            read -r dec _ <<< "$(one "$dev" "The capital of France is" "${TOKENS:-128}" "decode-$dev-$i")"
            read -r _ pre <<< "$(one "$dev" "$letters" 1 "prefill-$dev-$i")"
            echo "$i $dev $dec $pre" >> "$OUT/wgpu-pairs.txt"
            log "pair $i $dev: decode $dec tok/s, prefill $pre tok/s"
        done
    done
fi
{
    echo "== wgpu beside $BASE ($MODEL; wgpu: ${adapter:-none})"
    for r in "${rows[@]}"; do echo "  $r"; done
    [ -f "$OUT/wgpu-pairs.txt" ] && python3 - "$OUT/wgpu-pairs.txt" "$BASE" <<'EOF'
import sys
rows = [l.split() for l in open(sys.argv[1])]
base = sys.argv[2]
def num(s):
    try:
        return float(s)
    except ValueError:
        return None
for k, what in ((2, "decode"), (3, "prefill")):
    pairs = {}
    for r in rows:
        pairs.setdefault(r[0], {})[r[1]] = num(r[k])
    b = [p.get(base) for p in pairs.values()]
    w = [p.get("wgpu") for p in pairs.values()]
    q = [p.get("wgpu-q8") for p in pairs.values()]
    ratio = lambda a, c: ", ".join(f"{x / y:.2f}" for x, y in zip(a, c) if x and y) or "-"
    fmt = lambda v: " / ".join("-" if x is None else f"{x:.1f}" for x in v)
    print(f"  {what:8} wgpu {fmt(w)} tok/s, {base} {fmt(b)}, wgpu f32 products {fmt(q)}; "
          f"wgpu / {base}: {ratio(w, b)}; packed / f32 products: {ratio(w, q)}")
EOF
} | tee "$OUT/wgpu-table.txt"
