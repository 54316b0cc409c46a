#!/usr/bin/env bash
# Installs the build into a scratch prefix, then configures, builds and runs
# tests/consumer against it with find_package(shmps).
set -euo pipefail
build_dir=$1
shift  # the rest: extra cmake arguments for the consumer (e.g. sanitizer flags)
source_dir=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build_dir" --prefix "$scratch/prefix" >/dev/null
cmake -S "$source_dir" -B "$scratch/build" -G Ninja -DCMAKE_PREFIX_PATH="$scratch/prefix" "$@" >/dev/null
cmake --build "$scratch/build"
"$scratch/build/consumer"
