#!/usr/bin/env bash
# Builds the host emulation of the CUDA driver (see driver.cpp) as DIR/libcuda.so.1:
#   tests/cuda_emu/build.sh DIR
#   GATESTREAM_LIBCUDA=DIR/libcuda.so.1 cargo test --release --features cuda --test gpu_cuda -- ...
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: build.sh DIR}"
mkdir -p "$out"
"${CXX:-c++}" -std=c++17 -O2 -fPIC -shared -fno-strict-aliasing -fvisibility=hidden -Wall -Wno-unused-function -Wno-unknown-pragmas \
    -Wl,-soname,libcuda.so.1 -o "$out/libcuda.so.1.tmp" "$here/driver.cpp"
mv "$out/libcuda.so.1.tmp" "$out/libcuda.so.1"
