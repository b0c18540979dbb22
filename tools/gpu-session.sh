#!/bin/bash
# Everything a session lent a GPU runs, in one device call of about 7.5 minutes: the GPU suite's
# checks of the kernels that have not yet run on a GPU, then `tools/gpu-compare.py` beside
# llama.cpp's CUDA build with whatever failed turned off, then one table. Logs under $OUT.
#
#   tools/gpu-carry.sh && tools/llama-cpp.sh build-cuda gpupeer   # here
#   bash tools/gpu-session.sh                 # there; carry ["gpucarry", "gpupeer"]
#
# 1. Checks (the GPU suite, `gpucarry/gpu_cuda`), at most CHECK_S seconds (default 180):
#    CHECKS (default below). A failed check turns its path off for the comparison:
#      kernels_per_type       GATESTREAM_CUDA_MMQ=0 (batches as f16 pairs, not integer tiles)
#      int8_batches           GATESTREAM_CUDA_INT8_TOKENS=1 (batches of 2-8 on the tensor cores)
#      attention_tiles        GATESTREAM_CUDA_ATTN_TILES=0
#      attention_split        GATESTREAM_CUDA_ATTN_SPLIT=0
#      fused_* (any)          GATESTREAM_CUDA_FUSE=0
#      small_qwen2_pdl        gpu-compare's pdl case left out (GATESTREAM_CUDA_PDL is off by default)
#    A failed small_qwen2* or qwen_shaped* check is reported, not mapped: read suite.txt.
# 2. `tools/gpu-compare.py --cases CASES --deadline DEADLINE` (default all its cases, 205 s: no case
#    starts later), killed at COMPARE_S (default 250 s).
# 3. The table: each check's verdict, what was turned off, gpu-compare's rows, and the decode
#    speeds the suite printed.
#
# Settings by environment: CHECKS, CHECK_S, CASES, DEADLINE, COMPARE_S, COMPARE (the compare
# command; default `python3 tools/gpu-compare.py`), SUITE (default gpucarry/gpu_cuda). For a dry
# run here on the emulated driver: GATESTREAM_LIBCUDA=.../libcuda.so.1 SUITE=target/release/deps/
# gpu_cuda-... COMPARE=true bash tools/gpu-session.sh (nothing it prints is then a GPU's figure).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-session}
export OUT
mkdir -p "$OUT"
START=$SECONDS
log() { echo "[$(date +%T) +$((SECONDS - START))s] $*" | tee -a "$OUT/session.txt" >&2; }
SUITE=${SUITE:-gpucarry/gpu_cuda}
CHECKS=${CHECKS:-kernels_per_type int8_batches attention_tiles attention_split fused_q8_blocks fused_last_blocks i8_geometry small_qwen2 qwen_shaped_cuda_vs_cpu qwen_shaped_decode_speed}
[ -x "$SUITE" ] || { log "no GPU suite at $SUITE (tools/gpu-carry.sh builds gpucarry/)"; exit 1; }
[ -f gpucarry/BUILT_FROM ] && log "gpucarry built from $(head -1 gpucarry/BUILT_FROM)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/session.txt"
# The suite reads the test data from the working tree's data/.
export GATESTREAM_DATA="$PWD/data"

# 1. The checks.
# shellcheck disable=SC2086
GATESTREAM_GPU_REPORT="$OUT/report.json" timeout "${CHECK_S:-180}" "$SUITE" $CHECKS > "$OUT/suite.txt" 2>&1
suite_rc=$?
log "suite: exit $suite_rc ($( [ $suite_rc = 124 ] && echo "stopped at ${CHECK_S:-180} s: the checks after the last line of suite.txt did not run" || echo done))"
verdicts=$(sed -n 's/^gpu_cuda: \([a-z0-9_]*\) \.\.\. \(ok\|FAILED\).*/\1 \2/p' "$OUT/suite.txt")
failed() { echo "$verdicts" | grep -q "^$1.* FAILED$"; }
off=()
failed kernels_per_type && off+=(GATESTREAM_CUDA_MMQ=0)
failed int8_batches && off+=(GATESTREAM_CUDA_INT8_TOKENS=1)
failed attention_tiles && off+=(GATESTREAM_CUDA_ATTN_TILES=0)
failed attention_split && off+=(GATESTREAM_CUDA_ATTN_SPLIT=0)
{ failed fused_ || failed small_qwen2_fused; } && off+=(GATESTREAM_CUDA_FUSE=0)
# (GATESTREAM_CUDA_PDL is off unless asked; a failed small_qwen2_pdl leaves gpu-compare's pdl
# case out.)
failed small_qwen2_pdl && CASES=$(echo "${CASES:-decode,prefill,depth,batched,served,mma,prefetch,int8,split,fuse,pdl,profile}" | sed 's/,pdl//; s/^pdl,//')
log "turned off for the comparison: ${off[*]:-nothing}"

# 2. The comparison.
compare=${COMPARE:-python3 tools/gpu-compare.py}
# shellcheck disable=SC2086
env "${off[@]}" OUT="$OUT/compare" timeout "${COMPARE_S:-250}" $compare --cases "${CASES:-decode,prefill,depth,batched,served,mma,prefetch,int8,split,fuse,pdl,profile}" \
    --deadline "${DEADLINE:-205}" > "$OUT/compare.txt" 2>&1
log "gpu-compare: exit $? (log: compare.txt, rows: compare/compare.json)"

# 3. The table, last.
{
    echo
    echo "== checks (suite exit $suite_rc; $(echo "$verdicts" | grep -c ' ok$') ok, $(echo "$verdicts" | grep -c ' FAILED$') failed)"
    echo "$verdicts" | sed 's/^/  /'
    grep -h "FAILED" -A2 "$OUT/suite.txt" | grep -v "^gpu_cuda:" | head -20 | sed 's/^/  | /'
    echo "== turned off for the comparison: ${off[*]:-nothing}"
    grep -h "qwen-shaped decode: cuda" "$OUT/suite.txt" | sed 's/^ */  /'
    sed -n '/i8 geometry:/,/^gpu_cuda:/p' "$OUT/suite.txt" | grep -v "^gpu_cuda:" | sed 's/^ */  /'
    echo "== gpu-compare (gatestream / llama.cpp)"
    sed -n '/^case  /,$p' "$OUT/compare.txt"
} | tee "$OUT/table.txt"
