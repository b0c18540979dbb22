#!/bin/bash
# Everything a session lent a GPU runs, in one device call of at most TOTAL_S seconds (default 540:
# a device call of 570 s ends with its table; issue 65's four
# parts): the GPU suite's checks of what has not yet run on a GPU; `tools/gpu-compare.py` beside
# llama.cpp's CUDA build with whatever failed turned off; the hybrid executor beside llama.cpp's
# partial offload (`tools/gpu-hybrid.sh`); the machine's disk, dense and neuron-sparse; one table
# last. Logs under $OUT.
#
#   tools/gpu-carry.sh && cp -r ../shared/peer/cuda gpupeer    # here (or tools/llama-cpp.sh build-cuda gpupeer)
#   OUT=/tmp/gs PACK=$OUT/logs.tgz bash tools/gpu-session.sh   # there; carry ["gpucarry", "gpupeer"]
#
# PARTS (default "checks compare wgpu hybrid"; add "disk" to measure the machine's disk), in this
# order:
# 0. While the checks run, the hybrid's and the disk's models are written in the background
#    (`make-model`, niced: DENSE_SHAPE, default qwen2.5-7b; MOE_SHAPE, default qwen3-30b-a3b; each
#    as a GGUF and a split .gst under MODELS, default /tmp/gsm), MoE only where the disk has room.
# 1. checks: the GPU suite (`gpucarry/gpu_cuda`), at most CHECK_S seconds (default 120): CHECKS
#    (default below). A failed check turns its path off for everything after:
#      kernels_per_type       GATESTREAM_CUDA_MMQ=0 (batches as f16 pairs, not integer tiles)
#      int8_batches           GATESTREAM_CUDA_INT8_TOKENS=1 (batches of 2-8 on the tensor cores)
#      attention_tiles        GATESTREAM_CUDA_ATTN_TILES=0
#      attention_split        GATESTREAM_CUDA_ATTN_SPLIT=0
#    A failed small_qwen2* or qwen_shaped* check is reported, not mapped: read suite.txt.
# 2. compare: `tools/gpu-compare.py --cases CASES --deadline DEADLINE` (default CASES
#    decode,prefill,depth,batched,served,profile; DEADLINE 95 s: no case starts later), killed where the
#    hybrid's and the disk's parts (220 s) would not fit.
# 2b. wgpu: `tools/gpu-wgpu.sh` on gpu-compare's model: `--device wgpu` (Vulkan) beside `--device
#    cuda`, and its packed 8-bit products beside its f32 ones, decode and prefill; about 40 s,
#    nothing measured (said in the table) where Vulkan finds no NVIDIA adapter.
# 3. hybrid: `tools/gpu-hybrid.sh dense:DENSE_SHAPE:25 moe:MOE_SHAPE:25 dense:DENSE_SHAPE:50`, no
#    run starting after HYBRID_S seconds (default 130), killed where the disk's part would not fit.
# 4. disk: `bench --device-only --quick`, then DENSE_SHAPE's .gst streamed from disk on the CPU
#    under `--ram-budget DISK_BUDGET` (default 2G), dense and with a 50% top-K gate mask,
#    DISK_TOKENS tokens each (default 4); about 90 s.
# 5. The table: each check's verdict, what was turned off, gpu-compare's rows, the hybrid's rows,
#    the disk's rows.
#
# Settings by environment: TOTAL_S, PARTS, CHECKS, CHECK_S, CASES, DEADLINE, COMPARE (the compare
# command; default `python3 tools/gpu-compare.py`), SUITE (default gpucarry/gpu_cuda), GATESTREAM
# (default gpucarry/gatestream), GPU_DEVICE (cuda), DENSE_SHAPE, MOE_SHAPE, MODELS, HYBRID_S,
# DISK_BUDGET, DISK_TOKENS, PACK (an archive to pack the logs into). A dry run here (nothing it prints is then a GPU's figure):
# GATESTREAM_LIBCUDA=.../libcuda.so.1 SUITE=target/release/deps/gpu_cuda-... COMPARE=true
# GATESTREAM=target/release/gatestream GPU_DEVICE=cpu LLAMA_BIN=~/.cache/gatestream/llama.cpp/bin
# DENSE_SHAPE=qwen2.5-1.5b MOE_SHAPE=olmoe-1b-7b bash tools/gpu-session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-session}
export OUT
mkdir -p "$OUT"
START=$SECONDS
log() { echo "[$(date +%T) +$((SECONDS - START))s] $*" | tee -a "$OUT/session.txt" >&2; }
TOTAL=${TOTAL_S:-540}
# (seconds left before TOTAL_S, less $1 kept for the parts after)
left() { local l=$((TOTAL - (SECONDS - START) - ${1:-0})); echo $((l > 1 ? l : 1)); }
PARTS=${PARTS:-checks compare wgpu hybrid}
part() { [[ " $PARTS " == *" $1 "* ]]; }
SUITE=${SUITE:-gpucarry/gpu_cuda}
G=${GATESTREAM:-gpucarry/gatestream}
export GATESTREAM=$G
M=${MODELS:-/tmp/gsm}
export MODELS=$M
DENSE=${DENSE_SHAPE:-qwen2.5-7b}
MOE=${MOE_SHAPE:-qwen3-30b-a3b}
DEV=${GPU_DEVICE:-cuda}
CHECKS=${CHECKS:-moe_qwen2moe_hybrid kernels_per_type int8_batches attention_tiles attention_split fused_last_blocks small_qwen2 qwen_shaped_cuda_vs_cpu qwen_shaped_decode_speed}
[ -x "$G" ] || { log "no gatestream binary at $G (tools/gpu-carry.sh builds gpucarry/)"; exit 1; }
[ -f gpucarry/BUILT_FROM ] && log "gpucarry built from $(head -1 gpucarry/BUILT_FROM)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/session.txt"
log "cores $(nproc), memory $(awk '/MemTotal/ {printf "%.0f GB", $2 / 1e6}' /proc/meminfo), free disk at $M: $(mkdir -p "$M" && df -BG --output=avail "$M" | tail -1 | tr -d ' ')"
# The suite reads the test data from the working tree's data/.
export GATESTREAM_DATA="$PWD/data"

# 0. The models of the hybrid and the disk, written in the background while the checks run.
make_models() {
    local shape f need
    for shape in "$DENSE" "$MOE"; do
        if [ "$shape" = "$MOE" ]; then
            # (the MoE's GGUF and .gst beside the dense pair and gpu-compare's model)
            need=${MOE_NEED_GB:-44}
            [ "$(df -BG --output=avail "$M" | tail -1 | tr -dc 0-9)" -ge "$need" ] || { echo "make: $MOE skipped: under $need GB free"; continue; }
        fi
        for f in gguf gst; do
            [ -s "$M/$shape.$f" ] || nice -n 19 "$G" make-model "$M/$shape.$f" --shape "$shape" --tokenizer synthetic --force --json || echo "make: $shape.$f failed"
        done
    done
}
maker=
if part hybrid || part disk; then
    make_models > "$OUT/make.txt" 2>&1 &
    maker=$!
    log "writing $DENSE and $MOE under $M in the background (pid $maker)"
fi

# 1. The checks.
off=()
suite_rc=-
verdicts=
if part checks; then
    if [ -x "$SUITE" ]; then
        # shellcheck disable=SC2086
        GATESTREAM_GPU_REPORT="$OUT/report.json" timeout "${CHECK_S:-120}" "$SUITE" $CHECKS > "$OUT/suite.txt" 2>&1
        suite_rc=$?
        log "suite: exit $suite_rc ($( [ "$suite_rc" = 124 ] && echo "stopped at ${CHECK_S:-120} s: the checks after the last line of suite.txt did not run" || echo done))"
        verdicts=$(sed -n 's/^gpu_cuda: \([a-z0-9_]*\) \.\.\. \(ok\|FAILED\).*/\1 \2/p' "$OUT/suite.txt")
    else
        log "no GPU suite at $SUITE (tools/gpu-carry.sh builds gpucarry/): checks skipped"
    fi
fi
failed() { echo "$verdicts" | grep -q "^$1.* FAILED$"; }
failed kernels_per_type && off+=(GATESTREAM_CUDA_MMQ=0)
failed int8_batches && off+=(GATESTREAM_CUDA_INT8_TOKENS=1)
failed attention_tiles && off+=(GATESTREAM_CUDA_ATTN_TILES=0)
failed attention_split && off+=(GATESTREAM_CUDA_ATTN_SPLIT=0)
CASES=${CASES:-decode,prefill,depth,batched,served,profile}
log "turned off for what follows: ${off[*]:-nothing}"
for kv in "${off[@]}"; do export "${kv?}"; done
if [ -n "$maker" ]; then
    log "waiting for the background models (at most 60 s)"
    for _ in $(seq 60); do kill -0 "$maker" 2>/dev/null || break; sleep 1; done
    kill -0 "$maker" 2>/dev/null && { log "models not written in time: stopped (make.txt)"; pkill -P "$maker"; kill "$maker"; }
    wait "$maker"
    log "models: $(ls -s --block-size=M "$M" 2>/dev/null | tail -n +2 | tr '\n' ' ')"
fi

# 2. The comparison.
if part compare; then
    compare=${COMPARE:-python3 tools/gpu-compare.py}
    # shellcheck disable=SC2086
    OUT="$OUT/compare" timeout "$(left $((220 + $(part wgpu && echo 45 || echo 0))))" $compare --cases "$CASES" --deadline "${DEADLINE:-95}" \
        > "$OUT/compare.txt" 2>&1
    log "gpu-compare: exit $? (log: compare.txt, rows: compare/compare.json)"
fi

# 2b. The portable device beside CUDA.
if part wgpu; then
    OUT="$OUT/wgpu" BASE=$DEV DEADLINE=25 timeout "$(left 220)" bash tools/gpu-wgpu.sh "$M/qwen2.5-1.5b.gguf" \
        > "$OUT/wgpu.txt" 2>&1
    log "gpu-wgpu: exit $? (log: wgpu.txt, wgpu/)"
fi

# 3. The hybrid.
if part hybrid; then
    OUT="$OUT/hybrid" KEEP=1 GPU_DEVICE=$DEV DEADLINE=${HYBRID_S:-130} timeout "$(left 90)" \
        bash tools/gpu-hybrid.sh "dense:$DENSE:25" "moe:$MOE:25" "dense:$DENSE:50" > "$OUT/hybrid.txt" 2>&1
    log "gpu-hybrid: exit $? (log: hybrid.txt, hybrid/)"
    rm -f "$M/$MOE".gguf "$M/$MOE".gst
fi

# 4. The disk.
disk_rows="$OUT/disk.tsv"
: > "$disk_rows"
if part disk; then
    timeout 25 "$G" bench --device-only --quick --model "$M/$DENSE.gst" --json "$OUT/disk-device.json" > "$OUT/disk-device.txt" 2>&1
    log "bench --device-only: exit $?"
    prompt=$(head -c 200 data/wikitext-2/wiki.test.raw | tr -d '\000')
    for mode in dense sparse; do
        args=()
        [ "$mode" = sparse ] && args=(--mode sparse --sparsity 0.5 --strategy topk --criterion gate)
        sync
        echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
        timeout "$(left 5)" "$G" run --device cpu --model "$M/$DENSE.gst" --ram-budget "${DISK_BUDGET:-2G}" --threads "$(nproc)" \
            --prompt "$prompt" --max-tokens "${DISK_TOKENS:-4}" --ignore-eos --json "${args[@]}" > "$OUT/disk-$mode.json" 2> "$OUT/disk-$mode.err"
        log "disk $mode: exit $?"
    done
    python3 - "$OUT" > "$disk_rows" <<'EOF'
import json, sys
out = sys.argv[1]
try:
    d = json.load(open(f"{out}/disk-device.json"))
    print(f"device\tsequential reads, best\t{d.get('best_sequential_gb_per_s', 0):.2f} GB/s\t")
    for p in d.get("random", []):
        print(f"device\trandom {p.get('read_bytes', 0) // 1024} KiB reads, QD {p.get('queue_depth')}\t{p.get('gb_per_s', 0):.2f} GB/s\t")
except Exception as e:
    print(f"device\tbench --device-only\tno figures ({e})\t")
for mode in ("dense", "sparse"):
    try:
        r = json.load(open(f"{out}/disk-{mode}.json"))
        s = r.get("stream") or {}
        gb = s.get("disk_bytes_per_token", 0) / 1e9
        tps = r.get("decode_tok_per_s", 0)
        print(f"stream\t{mode}\t{tps:.3f} tok/s\t{gb:.2f} GB a token at {gb * tps:.2f} GB/s")
    except Exception as e:
        print(f"stream\t{mode}\tno figures ({e})\t")
EOF
fi

# 5. The table, last.
{
    echo
    echo "== checks (suite exit $suite_rc; $(echo "$verdicts" | grep -c ' ok$') ok, $(echo "$verdicts" | grep -c ' FAILED$') failed)"
    echo "$verdicts" | sed 's/^/  /'
    [ -f "$OUT/suite.txt" ] && grep -h "FAILED" -A2 "$OUT/suite.txt" | grep -v "^gpu_cuda:" | head -20 | sed 's/^/  | /'
    echo "== turned off for what follows: ${off[*]:-nothing}"
    [ -f "$OUT/suite.txt" ] && grep -h "qwen-shaped decode: cuda" "$OUT/suite.txt" | sed 's/^ */  /'
    [ -f "$OUT/suite.txt" ] && sed -n '/i8 geometry:/,/^gpu_cuda:/p' "$OUT/suite.txt" | grep -v "^gpu_cuda:" | sed 's/^ */  /'
    echo "== gpu-compare (gatestream / llama.cpp)"
    [ -f "$OUT/compare.txt" ] && sed -n '/^case  /,$p' "$OUT/compare.txt"
    [ -f "$OUT/wgpu/wgpu-table.txt" ] && cat "$OUT/wgpu/wgpu-table.txt"
    echo "== hybrid"
    [ -f "$OUT/hybrid.txt" ] && sed -n '/^case  /,$p' "$OUT/hybrid.txt"
    echo "== disk ($DENSE, --ram-budget ${DISK_BUDGET:-2G}, CPU)"
    sed 's/^/  /' "$disk_rows"
    log "session: $((SECONDS - START)) s"
} | tee "$OUT/table.txt"
# (the device tool brings back at most 8 files: PACK=FILE packs every log into one archive)
[ -n "${PACK:-}" ] && tar czf "$PACK" -C "$OUT" --exclude='*.gguf' --exclude='*.gst' . && log "logs packed into $PACK"
