#!/usr/bin/env bash
# run.sh BUILD_DIR [--hide-cuda] [cmake args for the consumer...]
# Installs the build into a scratch prefix (cmake --install), then runs
# check_prefix.sh on it: the out-of-tree consumer and README.md's worker
# snippet build against it with find_package(shmps), and its shmps-server
# serves them; with --hide-cuda, on a host made to look as if it had no CUDA.
set -euo pipefail
build_dir=$(cd "$1" && pwd)
shift
here=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build_dir" --prefix "$scratch/prefix" >/dev/null
"$here/check_prefix.sh" "$scratch/prefix" "$build_dir" "$@"
