#!/usr/bin/env bash
# Installs what shmps needs to build, test and run its main job on Debian 12:
# the toolchain, Boost (Interprocess, Program_options, Test), nlohmann-json,
# OpenBLAS and zlib (training job), and the Fashion-MNIST dataset package.
# Runs apt-get as root, through sudo when started as a user.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  libboost-dev libboost-program-options-dev libboost-test-dev
  nlohmann-json3-dev libopenblas-dev zlib1g-dev
  dataset-fashion-mnist
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
