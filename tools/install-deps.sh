#!/usr/bin/env bash
# Installs what shmps needs to build, test and run its main job on Debian 12:
# the toolchain, Boost (Interprocess, Program_options, Test), nlohmann-json,
# OpenBLAS and zlib (training job), the Fashion-MNIST dataset package,
# libsystemd (sd_notify), and for the service tests and the .deb:
# systemd (systemd-analyze only; it does not become PID 1) and dpkg-dev
# (dpkg-shlibdeps for cpack -G DEB); clang with its libFuzzer runtime
# (libclang-rt-14-dev, only recommended by clang) for the fuzz targets;
# libzmq3-dev for the ZeroMQ baseline of shmps-compare (bench/);
# help2man (the man pages), lintian and file for the package test;
# patchelf for tools/gpu-pack.sh (the GPU machine's carried tree).
# Runs apt-get as root, through sudo when started as a user.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  libboost-dev libboost-program-options-dev libboost-test-dev
  nlohmann-json3-dev libopenblas-dev zlib1g-dev
  dataset-fashion-mnist
  libsystemd-dev systemd dpkg-dev
  clang libclang-rt-14-dev
  libzmq3-dev
  help2man lintian file
  patchelf
)
as_root=()
if [ "$(id -u)" -ne 0 ]; then as_root=(sudo); fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  "${as_root[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
