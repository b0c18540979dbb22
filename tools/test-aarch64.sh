#!/usr/bin/env bash
# The aarch64 build on an x86-64 Linux machine: cross-compiled (gcc-aarch64-linux-gnu) and run
# under qemu-user. Runs the CPU kernels' tests (NEON against the scalar reference, bit for bit)
# and, with a model, `run` end to end. Installs what it lacks (apt, rustup). Timing under qemu
# is an emulator's: it says nothing about an ARM CPU's speed.
#   tools/test-aarch64.sh [MODEL.gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    apt-get update && apt-get install -y gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user
fi
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
cargo test --release --target "$target" --lib quant::
if [ $# -gt 0 ]; then
    cargo build --release --target "$target"
    qemu-aarch64 -L /usr/aarch64-linux-gnu "target/$target/release/gatestream" run --model "$1" \
        --prompt "The capital of France is" --max-tokens 8 --io pread
fi
