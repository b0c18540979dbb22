#!/usr/bin/env bash
# Builds the host emulation of the CUDA driver (see driver.cpp) as DIR/libcuda.so.1:
#   tests/cuda_emu/build.sh [--asan] DIR
#   GATESTREAM_LIBCUDA=DIR/libcuda.so.1 cargo test --release --features cuda --test gpu_cuda -- ...
# --asan builds it with AddressSanitizer, so a kernel reading or writing outside a device
# allocation stops the run with the kernel's source line, and with the alignment sanitizer, so a
# load or store from an address a GPU would fault on (a 16-byte `uint4` at an address not a
# multiple of 16, a `u32` not of 4, ...) stops it too; the process that loads it then needs
# LD_PRELOAD="$(c++ -print-file-name=libasan.so)" (and ASAN_OPTIONS=detect_leaks=0).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
flags=(-O2)
if [ "${1:-}" = "--asan" ]; then
    flags=(-O2 -g -fsanitize=address,alignment -fno-sanitize-recover=alignment -fno-omit-frame-pointer)
    shift
fi
out="${1:?usage: build.sh [--asan] DIR}"
mkdir -p "$out"
"${CXX:-c++}" -std=c++17 "${flags[@]}" -fPIC -shared -fno-strict-aliasing -fvisibility=hidden -Wall \
    -Wno-unused-function -Wno-unknown-pragmas -Wl,-soname,libcuda.so.1 -o "$out/libcuda.so.1.tmp" "$here/driver.cpp"
mv "$out/libcuda.so.1.tmp" "$out/libcuda.so.1"
