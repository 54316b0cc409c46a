#!/usr/bin/env bash
# tools/gpu-check-rehearsal.sh [BUILD_DIR] [MODE...]: tools/gpu-check.sh
# as the GPU machine will run it, here, so that a piece the pack lacks
# fails here and not there (docs/cuda.md, "GPU check"). BUILD_DIR (default
# build/default) is a CUDA build; MODEs are prebuilt and build (default
# both). It
#  - runs tools/gpu-pack.sh BUILD_DIR (into .gpu/, what travels to the GPU
#    host);
#  - copies the working tree as step 2 of docs/cuda.md's "A GPU session"
#    does (tracked and untracked, not ignored, files) plus .gpu/ to a
#    scratch folder at another absolute path (mktemp's, mode 0700:
#    prebuilt also rehearses a checkout that other users cannot reach);
#  - per MODE, in a mount namespace (unshare -m): a fresh /tmp and
#    /dev/shm; Boost, OpenBLAS (and every BLAS), libgfortran,
#    nlohmann-json, zlib's development files, libsystemd, ZeroMQ and the
#    Fashion-MNIST dataset hidden (their entries left out of views of
#    /usr/lib/x86_64-linux-gnu, /usr/include, /usr/share/cmake and
#    /usr/share/pkgconfig bound over those folders, so they are "not
#    found", as there); the original checkout and its build trees hidden
#    under an empty tmpfs; checks with ldd, the compiler, the linker and
#    pkg-config that all of it is gone; in prebuilt also xz, so that the
#    tree unpacks with python3's tarfile; then gpu-check.sh with
#    SHMPS_GPU_CHECK_MODE=MODE. With no driver here the GPU tests skip with
#    their reason, shmps-gpu-bench prints "no CUDA device: skipped", and a
#    stand-in compute-sanitizer runs the sanitizer steps' programs. The
#    stand-in for that machine's python3 is the project's .venv (Debian's
#    python3 3.11, its torch 1.13 for the CPU, nanobind from PyPI) behind a
#    wrapper first on PATH that gives back the hidden libraries Debian's
#    numpy and torch load (a pip-installed torch brings its own); its CUDA
#    cases skip;
#  - checks its results: exit 0, the mode taken, no FAILED row, GPU cases
#    skipped, suite rows passed, the bench's skip line, the Python step
#    (the stand-in chosen, the extension built for it: against the carried
#    prefix, or by the tree's build configured with it; pytest passed, at
#    least 20 tests passed, the three CUDA cases skipped), and OUTDIR
#    within the check's limit on its results (8 files, 16 MiB each, no
#    deeper than OUTDIR/a/file).
# Root only (mount namespaces): exit 77 (skipped) otherwise. Takes, on 2
# cores: the pack 20-60 s, prebuilt 40-125 s (mostly the suite; the Python
# step 15-20 s of it), build 4-9 minutes (a full build; the longer times
# on a shared machine).
# SHMPS_REHEARSAL_KEEP=1 keeps the scratch folder.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd -P)
fail() { echo "FAIL: $*" >&2; exit 1; }
# explain OUTDIR: the failed rows and the failing tests' own messages, printed
# just before the FAIL line, since CI keeps only the end of the output.
explain() {
  echo "== what failed"
  grep -F '**FAILED**' "$1/results.md" 2>/dev/null | head -10 || true
  grep -E 'error: in "|\*\*\*(Failed|Timeout|Exception)|^E   |^FAILED ' "$1/gpu-check.log" 2>/dev/null | tail -25 || true
}

# ---- inside the namespace: hide, verify, run, check ----
if [[ ${1:-} == --inside ]]; then
  mode=$2 scratch=$3 src=$4 orig_build=$5
  repo=$scratch/repo out=$scratch/out-$mode
  mount --make-rprivate /
  mount -t tmpfs -o mode=1777 none /tmp
  # The views' links must resolve for every user (a test runs the server
  # as nobody), so they live in the fresh /tmp, not in the 0700 scratch.
  hide=/tmp/.shmps-rehearsal-hide
  mount -t tmpfs -o mode=1777 none /dev/shm
  mkdir -p "$hide"
  shopt -s dotglob nullglob extglob

  # The stand-in for the GPU machine's python3 (3.12, torch 2.x, nanobind):
  # the project's .venv (tools/install-deps.sh: Debian's python3 3.11 with
  # its torch 1.13 for the CPU and numpy, nanobind from PyPI), bound to
  # $hide/venv before the checkout is hidden. Debian's numpy and torch load
  # OpenBLAS, libgfortran and ZeroMQ, which the hiding takes away, where a
  # pip-installed torch brings its own: the stand-in gets back exactly the
  # hidden libraries they load (py_lib: their closure, recorded now).
  venv=$src/.venv
  "$venv/bin/python3" -c 'import nanobind, numpy, pytest, torch' 2>/dev/null ||
    fail "$venv lacks nanobind, numpy, pytest or torch: run tools/install-deps.sh"
  py_objs=()
  while IFS= read -r d; do py_objs+=("$d"/*.so "$d"/*/*.so "$d"/*/*/*.so); done < <(
    "$venv/bin/python3" -c 'import os, numpy, torch; print(os.path.dirname(numpy.__file__)); print(os.path.dirname(torch.__file__))')
  declare -A py_lib=()
  while read -r name arrow path _; do
    [[ $arrow == "=>" && $path == /* ]] && py_lib[$name]=$(readlink -f "$path")
  done < <(ldd "${py_objs[@]}" 2>/dev/null)

  # view ORIG VIEW PATTERN...: VIEW gets a link to every entry of ORIG but
  # those matching a PATTERN (globs relative to ORIG; a/b goes one folder
  # down, which then becomes a view of its own).
  view() {
    local orig=$1 view=$2; shift 2
    local e name p hidden down sub
    mkdir -p "$view"
    for e in "$orig"/*; do
      name=${e##*/} hidden=0 down=0 sub=()
      for p in "$@"; do
        if [[ $p == */* ]]; then
          # shellcheck disable=SC2053
          if [[ $name == ${p%%/*} ]]; then down=1; sub+=("${p#*/}"); fi
        # shellcheck disable=SC2053
        elif [[ $name == $p ]]; then hidden=1; fi
      done
      if [[ $hidden == 1 ]]; then continue
      elif [[ $down == 1 && -d $e && ! -L $e ]]; then view "$e" "$view/$name" "${sub[@]}"
      # A link keeps its own target: a relative one then resolves from
      # the folder's real place (../lib/llvm-14/...), or to a hidden
      # neighbour not at all, as it would there.
      elif [[ -L $e ]]; then ln -s "$(readlink "$e")" "$view/$name"
      else ln -s "$e" "$view/$name"; fi
    done
  }
  # hide_in DIR PATTERN...: DIR shows its view; the original stays
  # reachable (for the view's links) under $hide.
  hide_in() {
    local dir=$1; shift
    local key=${dir//\//_}
    mkdir -p "$hide/orig$key"
    mount --bind "$dir" "$hide/orig$key"
    view "$hide/orig$key" "$hide/view$key" "$@"
    mount --bind "$hide/view$key" "$dir"
  }
  hide_in /usr/lib/x86_64-linux-gnu \
    'libboost_*' 'libopenblas*' openblas-pthread blas lapack 'libblas.*' 'liblapack*' \
    'libgfortran.*' 'libquadmath.*' 'libsystemd.*' libz.so libz.a \
    'libzmq.*' 'libsodium.*' 'libpgm*' 'libnorm.*' \
    'cmake/Boost-*' 'cmake/BoostDetectToolset-*' 'cmake/boost_*' cmake/openblas cmake/norm \
    pkgconfig/libsystemd.pc 'pkgconfig/openblas*.pc' 'pkgconfig/blas*.pc' 'pkgconfig/lapack*.pc' \
    pkgconfig/zlib.pc pkgconfig/libzmq.pc pkgconfig/libsodium.pc 'pkgconfig/openpgm*.pc' pkgconfig/norm.pc
  hide_in /usr/include boost systemd nlohmann zlib.h zconf.h zmq.h zmq_utils.h \
    'x86_64-linux-gnu/cblas*' x86_64-linux-gnu/f77blas.h 'x86_64-linux-gnu/openblas*'
  hide_in /usr/share/cmake nlohmann_json
  hide_in /usr/share/pkgconfig nlohmann_json.pc
  [[ -d /usr/share/datasets ]] && mount -t tmpfs -o size=1m,mode=0755 none /usr/share/datasets
  # prebuilt also rehearses a machine without xz: the tree then unpacks
  # with python3's tarfile (an empty, non-executable file over xz).
  if [[ $mode == prebuilt ]]; then
    xz_bin=$(command -v xz) || fail "no xz here"
    : > "$hide/no-xz" && chmod 0644 "$hide/no-xz"
    mount --bind "$hide/no-xz" "$xz_bin"
    ! xz --version >/dev/null 2>&1 || fail "xz still runs after hiding it"
  fi

  # The stand-in python3: a wrapper first on PATH (from $hide/bin, below)
  # that puts the hidden libraries numpy and torch load, as links into the
  # originals, on LD_LIBRARY_PATH; the programs it starts carry DT_RPATH,
  # which goes first.
  mkdir -p "$hide/venv" "$hide/py-lib" "$hide/bin"
  mount --bind "$venv" "$hide/venv"
  for round in 1 2 3 4 5 6; do
    missing=$( (LD_LIBRARY_PATH=$hide/py-lib ldd "${py_objs[@]}" 2>/dev/null || true) | awk '$2 == "=>" && $3 == "not" {print $1}' | sort -u)
    [[ -n $missing ]] || break
    for name in $missing; do
      real=${py_lib[$name]:-}
      [[ $real == /usr/lib/x86_64-linux-gnu/* ]] || fail "the stand-in python3 misses $name (${real:-not loaded before the hiding})"
      ln -sfn "$hide/orig_usr_lib_x86_64-linux-gnu/${real#/usr/lib/x86_64-linux-gnu/}" "$hide/py-lib/$name"
    done
  done
  [[ -z $missing ]] || fail "the stand-in python3 still misses: $missing"
  cat > "$hide/bin/python3" <<WRAP
#!/bin/sh
export LD_LIBRARY_PATH=$hide/py-lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
exec $hide/venv/bin/python3 "\$@"
WRAP
  chmod +x "$hide/bin/python3"
  "$hide/bin/python3" -c 'import numpy, torch, nanobind, pytest' || fail "the stand-in python3 cannot import numpy, torch, nanobind and pytest"

  # Proof that it is gone: the build host's own programs miss their
  # libraries, and nothing compiles, links or configures against them.
  for b in shmps-server test_shm shmps-train shmps-compare; do
    [[ -x $orig_build/bin/$b ]] || continue
    libs=$(ldd "$orig_build/bin/$b" 2>&1 || true)
    grep -q 'not found' <<< "$libs" || fail "ldd $b still finds all its libraries: $(tr '\n' ' ' <<< "$libs")"
  done
  libs=$(ldd "$orig_build/bin/shmps-server" 2>&1 || true)
  found=$(grep -E 'boost|systemd' <<< "$libs" | grep -v 'not found' || true)
  [[ -z $found ]] || fail "shmps-server still finds Boost or libsystemd: $found"
  for h in boost/version.hpp systemd/sd-daemon.h nlohmann/json.hpp zlib.h cblas.h zmq.h; do
    if printf '#include <%s>\n' "$h" | c++ -x c++ -E - -o /dev/null 2>/dev/null; then fail "<$h> still compiles"; fi
  done
  for l in boost_program_options boost_unit_test_framework systemd openblas blas z zmq; do
    if echo 'int main() {}' | c++ -x c++ - -o "$hide/a.out" "-l$l" 2>/dev/null; then fail "-l$l still links"; fi
  done
  for m in libsystemd openblas blas zlib nlohmann_json libzmq; do
    if pkg-config --exists "$m" 2>/dev/null; then fail "pkg-config still finds $m"; fi
  done
  # ... while the machine's own tools still work.
  cmake --version >/dev/null && c++ --version >/dev/null && python3 -c 'import xml.etree.ElementTree' ||
    fail "hiding broke cmake, c++ or python3"
  # The build host's checkout (its build trees, its .gpu/) is gone too.
  mount -t tmpfs -o size=1m,mode=0755 none "$src"
  [[ -z $(ls -A "$src") ]] || fail "$src is not hidden"
  echo "ok: Boost, OpenBLAS, libgfortran, nlohmann-json, zlib's development files, libsystemd, ZeroMQ, the dataset and $src hidden"

  # No GPU here: compute-sanitizer is a stand-in that drops its options
  # and runs the program, so the sanitizer steps' plumbing (their test
  # filters included) runs.
  cat > "$hide/bin/compute-sanitizer" <<'STUB'
#!/bin/sh
while [ $# -gt 0 ]; do
  case $1 in --tool|--error-exitcode|--target-processes) shift 2 ;; --*) shift ;; *) break ;; esac
done
echo "========= COMPUTE-SANITIZER (the rehearsal's stand-in)"
"$@"; rc=$?
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
STUB
  chmod +x "$hide/bin/compute-sanitizer"
  export PATH=$hide/bin:$PATH
  # The scratch folder is mktemp's (0700): prebuilt rehearses a checkout
  # other users cannot reach (the trees go under /tmp), build one they can.
  if [[ $mode == build ]]; then chmod 0755 "$scratch"; else chmod 0700 "$scratch"; fi
  rc=0
  # A build on this machine's cores takes longer than the GPU machine's
  # budget allows.
  budget=500
  [[ $mode == build ]] && budget=$((500 + 270 * 16 / $(nproc)))
  (cd "$scratch" && SHMPS_GPU_CHECK_MODE=$mode SHMPS_GPU_CHECK_ALLOW_NO_GPU=1 SHMPS_GPU_CHECK_BUDGET_S=$budget TMPDIR=/tmp \
    "$repo/tools/gpu-check.sh" "$out") > "$scratch/run-$mode.txt" 2>&1 || rc=$?
  cat "$scratch/run-$mode.txt"
  echo "----"
  [[ $rc == 0 ]] || { explain "$out"; fail "gpu-check.sh exited $rc ($mode); see $out/results.md and $out/gpu-check.log"; }
  grep -q "^mode: $mode$" "$out/probe.txt" || fail "the probe chose $(sed -n 's/^mode: //p' "$out/probe.txt"), not $mode"
  grep -q '^- verdict: \*\*passed' "$out/results.md" || fail "verdict ($mode): $(grep '^- verdict' "$out/results.md")"
  ! grep -q '\*\*FAILED\*\*' "$out/results.md" || { explain "$out"; fail "FAILED rows ($mode)"; }
  grep -Eq '^\| test_gpu_ipc\.[a-z_0-9]+ \| skipped' "$out/results.md" || fail "no skipped test_gpu_ipc case in results.md"
  grep -Eq '^\| test_cuda_kernels\.[a-z_0-9]+ \| skipped' "$out/results.md" || fail "no skipped test_cuda_kernels case"
  suite_passed=$(grep -E '^\| [^|]+ \| - \| passed' "$out/results.md" | grep -vc '^| python\.' || true)
  [[ $suite_passed -ge 50 ]] || fail "only $suite_passed suite rows passed"
  ! grep -q 'not started' "$out/results.md" || fail "the budget cut a ctest run ($mode)"
  grep -q 'no CUDA device: skipped' "$out/bench-quick.txt" || fail "bench-quick.txt lacks the skip line"
  for run in "memcheck test_cuda_kernels" "racecheck test_cuda_kernels" "memcheck test_gpu_ipc"; do
    grep -q "^| compute-sanitizer $run | 0 |" "$out/results.md" || fail "compute-sanitizer $run: $(grep "compute-sanitizer $run" "$out/results.md")"
  done
  # The Python step: this machine's stand-in python3 chosen, the extension
  # built for it, every test of tests/python run; the CUDA cases skip.
  grep -q "^python step: runs ($hide/bin/python3; " "$out/probe.txt" ||
    fail "the probe's python step ($mode): $(grep -E '^(python3|python step)' "$out/probe.txt")"
  grep -q '^| python: pytest tests/python | 0 |' "$out/results.md" ||
    fail "the Python step ($mode): $(grep '^| python' "$out/results.md" | grep -v '^| python\.' | tr '\n' ' ')"
  py_passed=$(grep -Ec '^\| python\.test_(worker|torch)\.[^|]+ \| - \| - \| passed' "$out/results.md" || true)
  [[ $py_passed -ge 20 ]] || fail "only $py_passed Python tests passed ($mode)"
  for t in test_device_buffers_and_remote_optimizer_on_cuda_match_the_cpu_run test_register_device_buffer_takes_a_torch_tensor \
           test_expandable_segments_fail_with_a_pointer_to_alloc_device_buffer; do
    grep -Eq "^\| python\.test_torch\.$t \| - \| - \| skipped \([0-9.]+ s; torch sees no CUDA device\)" "$out/results.md" ||
      fail "python.test_torch.$t not skipped for want of a CUDA device ($mode): $(grep -F "$t" "$out/results.md")"
  done
  n=$(find "$out" -type f | wc -l)
  [[ $n -le 8 ]] || fail "$n files in OUTDIR: the check's limit is 8"
  big=$(find "$out" -type f -size +16M)
  [[ -z $big ]] || fail "over 16 MiB: $big"
  [[ -z $(find "$out" -mindepth 3) ]] || fail "OUTDIR nests deeper than OUTDIR/a/file, the check's limit"
  if [[ $mode == prebuilt ]]; then
    grep -q '^ldd: [0-9]* programs, 0 with unresolved' "$out/probe.txt" || fail "ldd found unresolved libraries"
    grep -q "^unpacked into /tmp/shmps-gpu-check/trees/build/default " "$out/probe.txt" ||
      fail "a checkout other users cannot reach did not put the tree under /tmp/shmps-gpu-check/trees"
    grep -q "^unpacked with python3's tarfile (no xz here)$" "$out/probe.txt" ||
      fail "without xz the tree did not unpack with python3: $(grep '^unpacked with' "$out/probe.txt")"
    grep -q '^| python: build the extension against the carried prefix | 0 |' "$out/results.md" ||
      fail "the extension did not build against the carried prefix"
    # This machine's C++ runtime instead of the carried one (what a glibc
    # older than the carried libstdc++ needs) also resolves every library.
    SHMPS_GPU_CHECK_CXX_RUNTIME=host TMPDIR=/tmp "$repo/tools/gpu-check.sh" --probe-only "$scratch/probe-host-cxx" > /dev/null ||
      fail "--probe-only with SHMPS_GPU_CHECK_CXX_RUNTIME=host exited non-zero"
    grep -q "^C++ runtime: this machine's" "$scratch/probe-host-cxx/probe.txt" &&
      grep -q '^ldd: [0-9]* programs, 0 with unresolved' "$scratch/probe-host-cxx/probe.txt" ||
      fail "with this machine's C++ runtime: $(grep -E '^(C\+\+ runtime|ldd):' "$scratch/probe-host-cxx/probe.txt")"
  else
    grep -q 'not reachable by other users' "$out/probe.txt" && fail "the probe says other users cannot reach $repo"
    grep -q '^unpacked with tar and xz$' "$out/probe.txt" || fail "the tree did not unpack with xz: $(grep '^unpacked with' "$out/probe.txt")"
    libs=$(ldd "$repo/build/cuda/bin/shmps-server")
    grep -q '/tmp/shmps-gpu-check/sysroot/.*libboost_program_options' <<< "$libs" ||
      fail "the built shmps-server does not load Boost from the sysroot"
    grep -q "^Python_EXECUTABLE:[A-Z]*=$hide/bin/python3\$" "$repo/build/cuda/CMakeCache.txt" ||
      fail "the build was not configured with the stand-in python3: $(grep '^Python_EXECUTABLE' "$repo/build/cuda/CMakeCache.txt")"
    compgen -G "$repo/build/cuda/python/shmps/_shmps*.so" > /dev/null || fail "the tree's build made no Python extension"
  fi
  echo "ok: $mode: $suite_passed suite tests and $py_passed Python tests passed, GPU and CUDA cases skipped, bench skipped, $n files in OUTDIR"
  # Named in CI's output: what passed only at its second try.
  grep -o 'passed on a second try: [^|;]*' "$out/results.md" | sed "s/^/note ($mode): /" || true
  exit 0
fi

# ---- outside: pack, copy, one namespace per mode ----
# In a function, so that bash has read all of it before it runs (an edit
# of this file during a run changes nothing).
main() {
  build=$(cd "${1:-$src/build/default}" && pwd -P)
  shift || true
  modes=("$@")
  [[ ${#modes[@]} -gt 0 ]] || modes=(prebuilt build)
  if [[ $(id -u) != 0 ]]; then echo "SKIP: the rehearsal needs root (unshare -m)"; exit 77; fi
  if ! unshare -m --propagation private true 2>/dev/null; then echo "SKIP: unshare -m is not permitted here"; exit 77; fi
  # Each mode runs under a fresh /tmp, which would hide a checkout there.
  case "$src/" in
    /tmp/*) echo "FAIL: the checkout $src is under /tmp, which the rehearsal replaces: clone it elsewhere" >&2; exit 1 ;;
  esac

  t=$SECONDS
  "$src/tools/gpu-pack.sh" "$build"
  echo "pack: $((SECONDS - t)) s"
  scratch=$(mktemp -d /var/tmp/shmps-gpu-rehearsal.XXXXXX)
  [[ ${SHMPS_REHEARSAL_KEEP:-0} == 1 ]] || trap 'rm -rf "$scratch"' EXIT
  mkdir -p "$scratch/repo"
  (cd "$src" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -C "$scratch/repo" -xf -
  cp -a "$src/.gpu" "$scratch/repo/.gpu"
  echo "working tree and .gpu copied to $scratch/repo"

  for mode in "${modes[@]}"; do
    t=$SECONDS
    echo "== rehearsal: $mode"
    rc=0
    unshare -m --propagation private "$scratch/repo/tools/gpu-check-rehearsal.sh" --inside "$mode" "$scratch" "$src" "$build" ||
      rc=$?
    echo "== rehearsal: $mode: exit $rc after $((SECONDS - t)) s"
    if [[ $rc != 0 ]]; then
      if [[ ${SHMPS_REHEARSAL_KEEP:-0} == 1 ]]; then echo "scratch folder kept: $scratch"
      else echo "(SHMPS_REHEARSAL_KEEP=1 keeps the scratch folder with OUTDIR and the copied tree)"; fi
      exit 1
    fi
  done
  echo "rehearsal passed: ${modes[*]}"
}
main "$@"
exit
