#!/bin/bash
# Prepares what a lent GPU machine needs to run the GPU suite (that machine has the driver, nvcc
# and NVRTC, but no Rust toolchain and no registry): the release binary built here with
# `--features cuda,wgpu` and the GPU suite (one build), stripped, Vulkan's loader (for
# tools/gpu-wgpu.sh, where that machine has none) and `run.sh`, into DIR (default gpucarry; added to
# .git/info/exclude, so it travels with the working tree only when named in the device tool's
# `carry`). The test data (`data/`) travels with the working tree itself.
#
#   tools/gpu-carry.sh [DIR]
#
# Then, on the GPU machine (from the repository root; logs and the JSON report under $OUT):
#   bash gpucarry/run.sh                         # the whole suite (~4 min on an H100)
#   bash gpucarry/run.sh qwen_shaped_vram_budget # some checks
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpucarry}
exclude="$(git rev-parse --git-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx "$dir/" "$exclude" 2>/dev/null || echo "$dir/" >> "$exclude"
cargo build --release --features cuda,wgpu
suite=$(cargo test --release --features cuda,wgpu --test gpu_cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_cuda":
        print(m["executable"])')
[ -x "$suite" ] || { echo "gpu-carry: the GPU suite did not build" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$dir"
cp target/release/gatestream "$suite" "$dir/"
mv "$dir/$(basename "$suite")" "$dir/gpu_cuda"
strip "$dir/gatestream" "$dir/gpu_cuda"
vulkan=$(ldconfig -p | awk '/libvulkan\.so\.1 / {print $NF; exit}')
if [ -n "$vulkan" ]; then
    cp -L "$vulkan" "$dir/libvulkan.so.1"
else
    echo "gpu-carry: no Vulkan loader here (apt-get install libvulkan1): tools/gpu-wgpu.sh then needs the GPU machine's" >&2
fi
git rev-parse HEAD > "$dir/BUILT_FROM"
git status --short >> "$dir/BUILT_FROM"
cat > "$dir/run.sh" <<EOF
#!/bin/bash
# The GPU suite on the GPU machine (see tools/gpu-carry.sh); arguments: checks to run (all when none).
# The suite reads the test data from the working tree's data/ (run from the repository root).
export GATESTREAM_DATA="\$PWD/data"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
GATESTREAM_GPU_REPORT="\$OUT/report.json" timeout 570 "$dir/gpu_cuda" "\$@" > "\$OUT/suite.txt" 2>&1
echo "suite rc \$?"
tail -c 9000 "\$OUT/suite.txt"
EOF
du -sh "$dir"
echo "gpu-carry: $dir ready (built from $(git rev-parse --short HEAD)); carry [\"$dir\"], command: bash $dir/run.sh"
