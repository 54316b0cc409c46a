#!/usr/bin/env bash
# Installs what shmps needs to build, test and run its main job on Debian 12:
# the toolchain, Boost (Interprocess, Program_options, Test), nlohmann-json,
# OpenBLAS and zlib (training job), the Fashion-MNIST dataset package,
# libsystemd (sd_notify), and for the service tests and the .deb:
# systemd (systemd-analyze only; it does not become PID 1), dpkg-dev
# (dpkg-shlibdeps for cpack -G DEB), and systemd-container (systemd-nspawn)
# with mmdebstrap, which boot the unit under a real systemd in a Debian
# container (test label `systemd`, as root); clang with its libFuzzer
# runtime (libclang-rt-14-dev, only recommended by clang) for the fuzz
# targets; libzmq3-dev for the ZeroMQ baseline of shmps-compare (bench/);
# help2man (the man pages), lintian and file for the package test;
# clang-format for tools/check_format.sh.
# The Python package (python/): Debian's python3 with its headers, torch
# 1.13 (CPU), numpy and pytest, and a venv over them (.venv, made with
# --system-site-packages, git-ignored) holding nanobind and scikit-build-core
# from PyPI, which CMake then uses;
# patchelf and xz-utils for tools/gpu-pack.sh (the build copied to a GPU
# host);
# Open MPI (openmpi-bin, libopenmpi-dev) for the federation's MPI engine,
# Gloo (libgloo-dev) for its elastic engine, and redis-server for the
# Gloo test's Redis store (docs/federation.md); iproute2 (ip) for the
# Gloo partition test's private network namespace.
# Runs apt-get as root, through sudo when started as a user.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  libboost-dev libboost-program-options-dev libboost-test-dev
  nlohmann-json3-dev libopenblas-dev zlib1g-dev
  dataset-fashion-mnist
  libsystemd-dev systemd dpkg-dev systemd-container mmdebstrap
  clang libclang-rt-14-dev
  libzmq3-dev
  help2man lintian file clang-format
  python3-dev python3-venv python3-torch python3-numpy python3-pytest
  patchelf xz-utils
  openmpi-bin libopenmpi-dev libgloo-dev redis-server iproute2
)
as_root=()
if [ "$(id -u)" -ne 0 ]; then as_root=(sudo); fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  "${as_root[@]}" apt-get update -qq
  # env: sudo's env_reset would drop a variable set before it.
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The venv, as the invoking user (not root through sudo), over Debian's
# python3 (not the first python3 on PATH: Debian's torch imports only there).
here=$(cd "$(dirname "$0")/.." && pwd)
venv=$here/.venv
if ! "$venv/bin/python3" -c 'import nanobind, scikit_build_core, torch' 2>/dev/null; then
  rm -rf "$venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check 'nanobind==2.9.2' 'scikit-build-core==0.11.6'
  # Debian's torch imports only under Debian's python3: a venv without it
  # would let every torch test skip.
  "$venv/bin/python3" -c 'import nanobind, scikit_build_core, torch' ||
    { echo "install-deps: $venv cannot import nanobind, scikit_build_core and torch (above)" >&2; exit 1; }
fi
