#!/usr/bin/env bash
# tools/gpu-check.sh OUTDIR: the CUDA backend's check on a machine with a
# GPU (docs/cuda.md, "GPU check"). Configures with the cuda preset (sm_90)
# into OUTDIR/build, builds, runs every test labelled gpu and then the whole
# default suite against the GPU build (--backend auto picks cuda there),
# and runs shmps-gpu-bench --quick. Writes OUTDIR/gpu-check.log,
# OUTDIR/bench.txt and OUTDIR/results.md (one row per test,
# pass/fail/skip; written on every exit, a failed configure or build
# included). Bounded: the step timeouts add up to 360 s, so the whole
# run stays under 6 minutes on one H200 (16 cores). The full benchmark
# (without --quick) is a separate run: OUTDIR/build/bin/shmps-gpu-bench.
set -uo pipefail
out=${1:?usage: tools/gpu-check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
src=$(cd "$(dirname "$0")/.." && pwd)
log=$out/gpu-check.log
build=$out/build
: > "$log"
rm -f "$out/gpu-tests.xml" "$out/suite.xml" "$out/bench.txt" "$out/results.md"  # never report an earlier run
cd "$src" || exit 1  # --preset reads CMakePresets.json of the current directory
step() { echo "== $*" | tee -a "$log"; }
gpu_rc=skipped suite_rc=skipped bench_rc=skipped

step "device"
(nvidia-smi -L; nvidia-smi --query-gpu=name,pci.bus_id,compute_mode,driver_version --format=csv) >> "$log" 2>&1 \
  || echo "nvidia-smi failed: no driver?" | tee -a "$log"

step "configure (cuda preset, sm_90)"
built=0
if ! timeout 30 cmake -S "$src" -B "$build" --preset cuda -DCMAKE_CUDA_ARCHITECTURES=90 >> "$log" 2>&1; then
  echo "configure FAILED or timed out: see $log" | tee -a "$log"
else
  step "build"
  if timeout 150 cmake --build "$build" -j"$(nproc)" >> "$log" 2>&1; then built=1
  else echo "build FAILED or timed out (a rerun continues it): see $log" | tee -a "$log"; fi
fi

if [[ $built == 1 ]]; then
step "GPU tests (label gpu)"
timeout 90 ctest --test-dir "$build" -L gpu --output-on-failure --output-junit "$out/gpu-tests.xml" >> "$log" 2>&1
gpu_rc=$?
step "whole suite on the GPU build (backend auto = cuda), soak excluded"
timeout 60 ctest --test-dir "$build" -LE "soak|gpu" -E gpu_bench_smoke -j"$(nproc)" --output-junit "$out/suite.xml" >> "$log" 2>&1
suite_rc=$?

if [[ -x $build/bin/shmps-gpu-bench ]]; then
  step "GPU benchmark (--quick)"
  timeout 30 "$build/bin/shmps-gpu-bench" --quick > "$out/bench.txt" 2>> "$log"
  bench_rc=$?
  cat "$out/bench.txt" >> "$log"
else
  echo "shmps-gpu-bench not built (a build without CUDA?)" | tee -a "$log"
  bench_rc=1
fi
fi  # built

{
  echo "# gpu-check $(date -u +%FT%TZ)"
  echo
  nvidia-smi --query-gpu=name,pci.bus_id,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
  echo
  [[ $built == 1 ]] || echo "**configure or build FAILED: nothing ran; see gpu-check.log**"
  echo
  echo "| suite | exit code |"
  echo "|---|---|"
  echo "| ctest -L gpu | $gpu_rc |"
  echo "| ctest -LE 'soak|gpu' (GPU build) | $suite_rc |"
  echo "| shmps-gpu-bench | $bench_rc |"
  echo
  echo "| test | result |"
  echo "|---|---|"
  for x in "$out/gpu-tests.xml" "$out/suite.xml"; do
    [[ -f $x ]] || continue
    python3 - "$x" <<'PY'
import sys, xml.etree.ElementTree as ET
for tc in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    r = "passed"
    if tc.find("failure") is not None: r = "FAILED"
    elif tc.find("skipped") is not None or tc.get("status") == "notrun": r = "skipped"
    print(f"| {tc.get('name')} | {r} |")
PY
  done
  [[ -f $out/bench.txt ]] && { echo; echo '```'; cat "$out/bench.txt"; echo '```'; }
} > "$out/results.md"
cat "$out/results.md"
[[ $built == 1 && $gpu_rc == 0 && $suite_rc == 0 && $bench_rc == 0 ]]
