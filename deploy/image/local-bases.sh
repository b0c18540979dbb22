#!/usr/bin/env bash
# Makes, without any container registry, the two base images the Containerfile starts from:
#
#   docker.io/library/debian:bookworm-slim      Debian's minbase from debootstrap (the runtime)
#   localhost/gatestream-rust:1.95-bookworm     that rootfs + gcc, libc6-dev, binutils and this
#                                               machine's rustup toolchain (the build stage's
#                                               stand-in for docker.io/library/rust:1.95-bookworm)
#
# Usage: deploy/image/local-bases.sh [podman|docker] [WORKDIR]   (root; WORKDIR default
# /var/tmp/gatestream-bases). Needs debootstrap (apt-get install debootstrap) and a Debian mirror
# (taken from /etc/apt/sources.list*). With registry access none of this is needed: the
# Containerfile's defaults pull the official images.
set -euo pipefail
engine=${1:-podman}
work=${2:-/var/tmp/gatestream-bases}
toolchain=${RUST_TOOLCHAIN_DIR:-$(rustc --print sysroot)}
mirror=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]*debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
    grep -oE 'https?://[^ ]*' | grep -v security | head -1 || true)
mirror=${DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}
mkdir -p "$work"

if ! "$engine" image exists docker.io/library/debian:bookworm-slim 2>/dev/null &&
    ! { [ "$engine" = docker ] && docker image inspect debian:bookworm-slim >/dev/null 2>&1; }; then
    if [ ! -x "$work/rootfs/bin/bash" ]; then
        echo "debootstrap --variant=minbase bookworm from $mirror" >&2
        debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log"
        rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
    fi
    tar -C "$work/rootfs" -c . | "$engine" import - docker.io/library/debian:bookworm-slim
fi

builder=localhost/gatestream-rust:1.95-bookworm
if ! "$engine" image inspect "$builder" >/dev/null 2>&1; then
    b="$work/rootfs-build"
    if [ ! -x "$b/usr/local/rust/bin/cargo" ]; then
        rm -rf "$b" && cp -a "$work/rootfs" "$b"
        cp /etc/resolv.conf "$b/etc/resolv.conf"
        chroot "$b" apt-get update -q >/dev/null
        chroot "$b" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
            gcc libc6-dev binutils ca-certificates >/dev/null
        chroot "$b" apt-get clean
        rm -rf "$b/var/lib/apt/lists/"*
        # The toolchain without its documentation: rustc and cargo find their libraries
        # relative to themselves, so no rustup is needed.
        mkdir -p "$b/usr/local/rust"
        tar -C "$toolchain" --exclude=./share/doc -c . | tar -C "$b/usr/local/rust" -x
    fi
    # The host's own CAs (here: the sandbox's TLS-inspecting egress proxy), so cargo inside the
    # build reaches crates.io as the host does.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$b/usr/local/share/ca-certificates/"
        chroot "$b" update-ca-certificates >/dev/null
    fi
    "$b/usr/local/rust/bin/rustc" --version >&2
    tar -C "$b" -c . | "$engine" import \
        --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV CARGO_HOME=/usr/local/cargo' - "$builder"
fi
"$engine" images
