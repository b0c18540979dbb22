#!/usr/bin/env bash
# llama.cpp, the engine gatestream is compared with: built for this CPU from the source that the
# llama-cpp-python package on the Python package registry vendors, and run the same way each time.
# Nothing in the project needs it; the comparison tools and the llama.cpp-matching checks do.
#
#   tools/llama-cpp.sh build                   build the binaries below (once; ~13 min on 2 cores)
#   tools/llama-cpp.sh build-cuda [DIR]        the CUDA build for a lent GPU (sm_90, built here with
#                                              no GPU from the CUDA 13 wheels; ~25 min on 2 cores):
#                                              llama-bench, llama-batched-bench, llama-completion and
#                                              llama-server packed into DIR (default gpupeer, kept
#                                              out of git) with the CUDA and OpenMP runtimes; on the
#                                              GPU machine `bash DIR/setup.sh` unpacks them into
#                                              /tmp/llb and prints the LD_LIBRARY_PATH to export
#   tools/llama-cpp.sh bin                     print the folder of the binaries (build first)
#   tools/llama-cpp.sh bench MODEL [THREADS]   in-RAM decode: llama-bench -p 0 -n 64, 3 repetitions
#   tools/llama-cpp.sh ppl MODEL TEXT [CHUNKS] perplexity at ctx 512 (default 20 chunks)
#   tools/llama-cpp.sh gen MODEL N [ARGS...]   greedy continuation of "The capital of France is"
#   tools/llama-cpp.sh capped LIMIT CMD...     CMD (any program) in a memory cgroup of LIMIT bytes
#                                              (e.g. 2G) after dropping the page cache; prints its
#                                              wall time, disk bytes read, peak memory, OOM kills
#
# Binaries: llama-bench, llama-completion, llama-perplexity, llama-server, llama-lookup,
# llama-batched-bench, llama-quantize, llama-imatrix, under $GATESTREAM_PEER/bin
# (default ~/.cache/gatestream/llama.cpp/bin).
# Notes for comparing: `-nr` (no repack) keeps weights in the mmap'd file, the fair setting under
# a memory cap; this version spells --no-mmap `--load-mode none`. CPUs that report AMX tiles in a VM
# may not let a process use them ("Illegal instruction"), so AMX is left out of the build there.
# `capped` needs the cgroup v1 memory controller (this machine's) or cgroup v2's memory.max.
set -euo pipefail
version=0.3.36
root=${GATESTREAM_PEER:-$HOME/.cache/gatestream/llama.cpp}
bin=$root/bin
targets=(llama-bench llama-completion llama-perplexity llama-server llama-lookup llama-batched-bench llama-quantize llama-imatrix)

need_bin() { [ -x "$bin/$1" ] || { echo "llama-cpp: $bin/$1 is missing: run tools/llama-cpp.sh build" >&2; exit 1; }; }

fetch_source() {
    local src=$root/src
    mkdir -p "$src"
    local tarball=$src/llama_cpp_python-$version.tar.gz
    if [ ! -f "$tarball" ]; then
        python3 -m pip download -q --no-deps --no-binary llama-cpp-python --disable-pip-version-check -d "$src" "llama-cpp-python==$version"
    fi
    [ -d "$src/llama_cpp_python-$version" ] || tar -xzf "$tarball" -C "$src"
}

build() {
    fetch_source
    local src=$root/src
    if ! command -v cmake >/dev/null; then apt-get update -qq && apt-get install -y -qq cmake; fi
    local flags=""
    if grep -qw amx_tile /proc/cpuinfo; then flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
    cmake -S "$src/llama_cpp_python-$version/vendor/llama.cpp" -B "$root/build" \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON \
        -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" >/dev/null
    cmake --build "$root/build" -j "$(nproc)" --target "${targets[@]}" >/dev/null
    mkdir -p "$bin"
    local t
    for t in "${targets[@]}"; do cp "$root/build/bin/$t" "$bin/"; done
    "$bin/llama-completion" --version 2>&1 | tail -2
}

# The CUDA build. The toolkit comes from NVIDIA's wheels (nvcc, cicc, headers, the runtime and
# cuBLAS to link against); the driver library is on the GPU machine only, so a stand-in exporting
# the symbols ggml-cuda calls lets the binaries link. Flash-attention kernels are left out (they
# more than double the build; decode at short contexts barely uses them).
build_cuda() {
    local out; out=$(realpath -m "${1:-gpupeer}")
    local croot=${GATESTREAM_PEER_CUDA:-$HOME/.cache/gatestream/llama.cpp-cuda}
    local site=$croot/cu13/site tk=$croot/cu13/site/nvidia/cu13
    if [ ! -x "$tk/bin/nvcc" ]; then
        python3 -m pip download -q --no-deps --disable-pip-version-check -d "$croot/cu13/whl" \
            nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-cccl nvidia-cuda-crt nvidia-cublas nvidia-nvvm
        local w
        for w in "$croot"/cu13/whl/*.whl; do python3 -m zipfile -e "$w" "$site"; done
        # (zipfile drops the execute bits)
        chmod +x "$tk"/bin/* "$tk"/nvvm/bin/* 2>/dev/null || true
    fi
    local l
    for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$tk/lib/lib$l.so"; done
    ln -sfn lib "$tk/lib64"
    mkdir -p "$tk/lib/stubs"
    local sym
    for sym in cuInit cuDriverGetVersion cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemCreate \
        cuMemRelease cuMemMap cuMemUnmap cuMemSetAccess cuMemAddressReserve cuMemAddressFree \
        cuMemGetAllocationGranularity; do echo "int $sym(void) { return 0; }"; done > "$tk/lib/stubs/driver.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$tk/lib/stubs/libcuda.so" "$tk/lib/stubs/driver.c"
    if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
        apt-get update -qq && apt-get install -y -qq cmake ninja-build
    fi
    fetch_source
    local ll=$root/src/llama_cpp_python-$version/vendor/llama.cpp
    local map="-ffile-prefix-map=$ll=llama.cpp -ffile-prefix-map=$croot=."
    PATH=$tk/bin:$PATH cmake -S "$ll" -B "$croot/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER="$tk/bin/nvcc" \
        -DCUDAToolkit_ROOT="$tk" -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=OFF \
        -DGGML_BACKEND_DL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DCMAKE_SKIP_RPATH=ON \
        -DCMAKE_C_FLAGS="$map" -DCMAKE_CXX_FLAGS="$map" -DCMAKE_CUDA_FLAGS="-Xcompiler=${map// /,}" >/dev/null
    local gpu_targets=(llama-bench llama-batched-bench llama-completion llama-server)
    PATH=$tk/bin:$PATH ninja -C "$croot/build" -j "$(nproc)" "${gpu_targets[@]}" >/dev/null
    mkdir -p "$out/lib"
    cp "$tk/lib/libcudart.so.13" "$(cc -print-file-name=libgomp.so.1)" "$out/lib/"
    tar -cf - -C "$croot/build/bin" "${gpu_targets[@]}" | xz -T2 --lzma2=preset=6,dict=192MiB > "$out/ll.tar.xz"
    cat > "$out/setup.sh" <<'SETUP'
#!/bin/bash
# On the GPU machine: the llama.cpp CUDA binaries unpacked into /tmp/llb; prints the library path
# to export (the machine's cuBLAS and CUDA runtime first, this pack's runtimes after).
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/llb
[ -x /tmp/llb/llama-bench ] || xz -dc "$here/ll.tar.xz" | tar -xf - -C /tmp/llb
found=$(find /usr /opt -xdev \( -name 'libcublas.so.13' -o -name 'libcublasLt.so.13' -o -name 'libcudart.so.13' \) 2>/dev/null |
    xargs -r -n1 dirname | sort -u | tr '\n' ':')
echo "export LD_LIBRARY_PATH=${found}$here/lib:\${LD_LIBRARY_PATH:-}"
SETUP
    chmod +x "$out/setup.sh"
    du -sh "$out"
    echo "llama-cpp: keep $out out of git (.git/info/exclude) and carry it to the GPU machine" >&2
}

# The memory cgroup for `capped`: v1's limit file and peak, or v2's.
capped() {
    [ $# -ge 2 ] || { echo "usage: tools/llama-cpp.sh capped LIMIT CMD [ARGS...]" >&2; exit 2; }
    local limit=$1; shift
    local cg limit_file peak_file oom_file
    if [ -d /sys/fs/cgroup/memory ]; then
        local parent; parent=$(awk -F: '$2=="memory"{print $3}' /proc/self/cgroup)
        cg=/sys/fs/cgroup/memory${parent%/}/gs-capped-$$
        limit_file=memory.limit_in_bytes peak_file=memory.max_usage_in_bytes oom_file=memory.oom_control
    elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        local parent; parent=$(awk -F: '$1=="0"{print $3}' /proc/self/cgroup)
        cg=/sys/fs/cgroup${parent%/}/gs-capped-$$
        limit_file=memory.max peak_file=memory.peak oom_file=memory.events
    else
        echo "llama-cpp: no cgroup memory controller here" >&2; return 1
    fi
    mkdir -p "$cg"
    echo "$limit" > "$cg/$limit_file"
    sync; echo 3 > /proc/sys/vm/drop_caches
    local dev; dev=$(lsblk -ndo PKNAME "$(df --output=source . | tail -1)" 2>/dev/null || true)
    [ -n "$dev" ] || dev=vda
    local r0 r1 t0 t1 rc=0
    r0=$(awk -v d="$dev" '$3==d{printf "%.0f", $6*512}' /proc/diskstats)
    t0=$(date +%s.%N)
    ( echo "$BASHPID" > "$cg/cgroup.procs"; exec "$@" ) || rc=$?
    t1=$(date +%s.%N)
    r1=$(awk -v d="$dev" '$3==d{printf "%.0f", $6*512}' /proc/diskstats)
    local peak oom
    peak=$(cat "$cg/$peak_file" 2>/dev/null || echo "?")
    oom=$(awk '/oom_kill /{print $2}' "$cg/$oom_file" 2>/dev/null || echo "?")
    echo "capped: limit=$limit rc=$rc wall_s=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}') disk_read_bytes=$((r1 - r0)) peak_bytes=$peak oom_kills=${oom:-0}" >&2
    rmdir "$cg" 2>/dev/null || true
    return $rc
}

cmd=${1:-}
shift || true
case "$cmd" in
    build) build ;;
    build-cuda) build_cuda "$@" ;;
    bin) echo "$bin" ;;
    bench) need_bin llama-bench; "$bin/llama-bench" -m "$1" -p 0 -n 64 -t "${2:-2}" -r 3 -o md ;;
    ppl) need_bin llama-perplexity; "$bin/llama-perplexity" -m "$1" -f "$2" -c 512 --chunks "${3:-20}" -t 2 2>&1 | grep -E "Final estimate" ;;
    gen)
        need_bin llama-completion
        model=$1 n=$2; shift 2
        "$bin/llama-completion" -m "$model" -p "The capital of France is" -n "$n" -t 2 -c 512 --temp 0 -s 1 --ignore-eos -no-cnv "$@" ;;
    capped) capped "$@" ;;
    *) sed -n 5,24p "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
