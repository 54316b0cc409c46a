#!/usr/bin/env bash
# Runs every fuzz target of a SHMPS_FUZZ build for a bounded time on a copy
# of its seed corpus (fuzz/corpus/<target>/; the repository is never
# modified). Fails on the first target that finds a crash, a leak, a
# timeout (an input slower than 10 s: poll_once() never sleeps) or out of
# memory; the failing input is kept under <build dir>/fuzz-artifacts/.
#   fuzz/run.sh <build dir> [seconds per target, default 60]
set -euo pipefail
build=$(cd "${1:?usage: fuzz/run.sh <build dir> [seconds]}" && pwd)
seconds=${2:-60}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$build/fuzz-artifacts"
for seeds in "$here"/corpus/*/; do
  target=$(basename "$seeds")
  cp -r "$seeds" "$work/$target"
  log="$build/fuzz-artifacts/$target.log"
  echo "== $target: ${seconds} s on $(ls "$work/$target" | wc -l) seeds"
  if ! "$build/bin/$target" -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
         -artifact_prefix="$build/fuzz-artifacts/$target-" "$work/$target" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "FAILED: $target (log $log, input $(ls "$build/fuzz-artifacts/$target-"* 2>/dev/null | grep -v '\.log$' | head -n 1))"
    exit 1
  fi
  grep -E '^#[0-9]+[[:space:]]+DONE|^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" || true
done
