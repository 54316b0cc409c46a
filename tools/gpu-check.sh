#!/usr/bin/env bash
# tools/gpu-check.sh [--probe-only] OUTDIR: the CUDA backend's check on the
# GPU machine (docs/cuda.md, "GPU check"), a host with a GPU, CUDA, CMake
# and Ninja but maybe no Boost, libsystemd, OpenBLAS or nlohmann-json and
# no package registry. It works from what tools/gpu-pack.sh left in .gpu/:
#  1. probe (seconds): GPU, driver, kernel, glibc, disk, compilers and
#     tools, development files, the carried tree unpacked and tried (ldd,
#     shmps-server --version, --check-config, a --backend cuda start), and
#     the python3 the Python step uses (the first on PATH with torch) with
#     its torch, CUDA and nanobind, then the DECISION: prebuilt (the carried
#     tree, its paths rewritten to this checkout), build (the carried .debs
#     unpacked into a sysroot, then the cuda preset configured against it,
#     that python3 included, and built with all cores), or stop with the
#     reason; and whether the Python step can run. --probe-only ends here.
#  2. every test labelled gpu; a server started with --device set to the
#     UUID nvidia-smi -L prints; shmps-gpu-bench --quick; the whole suite
#     on the CUDA build (--backend auto picks cuda there), without the
#     labels soak, gpu and host-tools (tests that need the build host's
#     tools); the Python package: its extension built for that python3
#     (prebuilt: python/ on its own against the carried install prefix;
#     build: by the tree's build) and pytest tests/python, CUDA cases
#     included; compute-sanitizer memcheck and racecheck on the GPU tests
#     when it is on PATH and runs a trivial CUDA program here (else those
#     steps are not run, with its message); the full shmps-gpu-bench when
#     time is left.
# OUTDIR receives at most six files, rewritten after every step so that a
# killed run still leaves them: probe.txt, results.md (steps with exit
# codes, one row per test, the bench), gpu-check.log (cut to 4 MiB),
# bench-quick.txt, bench.txt, sanitizer.txt. Work files go to
# $TMPDIR/shmps-gpu-check. Bounded: each step has a cap (in prebuilt mode
# they add up to 650 s, build mode adds up to 335 s on 16 cores, so the
# budget cuts the last ones when every step runs to its cap), and no step
# outlives SHMPS_GPU_CHECK_BUDGET_S (default 500) from the start.
# Exit 0: every step ran and passed; 1: a step failed or timed out, or no
# GPU was visible; 2: stopped (nothing could run; the probe says why).
# Environment: SHMPS_GPU_CHECK_MODE=auto|prebuilt|build (default auto),
# SHMPS_GPU_CHECK_PACK (default .gpu), SHMPS_GPU_CHECK_BUDGET_S,
# SHMPS_GPU_CHECK_PYTHON (the python3 of the Python step; default: the
# first python3 on PATH that imports torch, else nanobind, else the first),
# SHMPS_GPU_CHECK_ALLOW_NO_GPU=1 (no GPU is no failure: the rehearsal),
# SHMPS_GPU_CHECK_CXX_RUNTIME=auto|carried|host (prebuilt: whose libstdc++
# and libgcc_s load; auto: the carried ones unless glibc is too old).
set -uo pipefail
probe_only=0
if [[ ${1:-} == --probe-only ]]; then probe_only=1; shift; fi
out=${1:?usage: tools/gpu-check.sh [--probe-only] OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd -P) || exit 2
src=$(cd "$(dirname "$0")/.." && pwd -P)
pack=${SHMPS_GPU_CHECK_PACK:-$src/.gpu}
mode_wanted=${SHMPS_GPU_CHECK_MODE:-auto}
budget=${SHMPS_GPU_CHECK_BUDGET_S:-500}
allow_no_gpu=${SHMPS_GPU_CHECK_ALLOW_NO_GPU:-0}
work=${TMPDIR:-/tmp}/shmps-gpu-check
sysroot=$work/sysroot
log=$work/gpu-check.log
t0=$SECONDS
cores=$(nproc 2>/dev/null || echo 4)
# The toolkit is often installed without being on PATH.
for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
  [[ -d $d ]] && [[ :$PATH: != *:$d:* ]] && PATH=$PATH:$d
done
export PATH
mkdir -p "$work"
# Per-run files go; build trees kept there (trees/) are reused.
find "$work" -mindepth 1 -maxdepth 1 ! -name trees -exec rm -rf {} +
: > "$log"
rm -f "$out"/{probe.txt,results.md,gpu-check.log,bench-quick.txt,bench.txt,sanitizer.txt}  # never report an earlier run
say() { echo "$*" | tee -a "$log"; }
have() { command -v "$1" >/dev/null 2>&1; }
first_line() { timeout 10 "$@" 2>&1 | head -1; }
ver_ge() { [[ $(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1) == "$2" ]]; }  # $1 >= $2
manifest() { sed -n "s/^$1=//p" "$pack/manifest.txt" 2>/dev/null | head -1; }
# Whether uid 65534 (nobody) may reach and run $1: a test runs
# shmps-server as that user. Always true when not root (the test skips).
nobody_reaches() {
  [[ $(id -u) == 0 ]] || return 0
  if have setpriv; then setpriv --reuid=65534 --regid=65534 --clear-groups test -x "$1"
  elif have python3; then
    python3 -c 'import os, sys; os.setgid(65534); os.setgroups([]); os.setuid(65534); sys.exit(0 if os.access(sys.argv[1], os.X_OK) else 1)' "$1"
  fi
}

# ---------------------------------------------------------------- probe --
mode=stop reason="" build="" trees=$src gpu_ok=0 device_line=""
probe() {
  echo "# gpu-check probe $(date -u +%FT%TZ)"
  echo "checkout: $src"
  echo
  echo "## machine"
  echo "kernel: $(uname -r)"
  echo "os: $( (. /etc/os-release 2>/dev/null && echo "${PRETTY_NAME:-?}") || echo '?')"
  echo "cpus: $cores; memory: $(awk '/^MemTotal:/ {t = $2} /^MemAvailable:/ {a = $2} END {printf "%.0f GiB, %.0f GiB available", t / 1048576, a / 1048576}' /proc/meminfo)"
  echo "disk free: checkout $(df -h --output=avail "$src" 2>/dev/null | tail -1 | tr -d ' '), $work $(df -h --output=avail "$work" 2>/dev/null | tail -1 | tr -d ' ')"
  # Build trees lie in the checkout when other users can reach it, else
  # under $work/trees (test_protocol's server_of_another_user case runs
  # shmps-server as nobody).
  if nobody_reaches "$src"; then trees=$src
  else trees=$work/trees; echo "checkout: not reachable by other users: build trees go under $trees"; fi
  host_glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
  echo "glibc: ${host_glibc:-?}"
  local cxxlib
  cxxlib=$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
  echo "libstdc++: ${cxxlib:-none in ldconfig} $( [[ -n $cxxlib ]] && grep -ao 'GLIBCXX_3\.4\.[0-9]*' "$cxxlib" | sort -uV | tail -1)"
  echo
  echo "## GPU"
  if have nvidia-smi; then
    timeout 15 nvidia-smi -L 2>&1 | sed 's/^/nvidia-smi -L: /'
    device_line=$(timeout 15 nvidia-smi --query-gpu=name,pci.bus_id,driver_version,compute_mode,memory.total \
      --format=csv,noheader 2>&1 | head -1)
    echo "device (name, bus id, driver, compute mode, memory): $device_line"
    timeout 15 nvidia-smi -L >/dev/null 2>&1 && [[ $(timeout 15 nvidia-smi -L 2>/dev/null | grep -c '^GPU') -gt 0 ]] && gpu_ok=1
  else
    echo "nvidia-smi: not found (no driver?)"
  fi
  echo "/dev/nvidia*: $(ls /dev/nvidia* 2>/dev/null | tr '\n' ' ')"
  echo "CUDA_VISIBLE_DEVICES: ${CUDA_VISIBLE_DEVICES-unset}"
  echo
  echo "## tools"
  local t
  for t in cmake ctest ninja c++ g++ gcc clang++ nvcc compute-sanitizer pkg-config dpkg-deb ar tar gzip xz python3 gdb; do
    if have "$t"; then
      case $t in
        nvcc) echo "$t: $(command -v $t): $(timeout 10 nvcc --version 2>&1 | grep -i release)" ;;
        tar|gzip|xz|ar|dpkg-deb) echo "$t: $(command -v $t)" ;;
        *) echo "$t: $(command -v $t): $(first_line "$t" --version)" ;;
      esac
    else
      echo "$t: not found"
    fi
  done
  echo
  probe_python
  echo
  echo "## development files on this machine"
  local h
  for h in boost/version.hpp systemd/sd-daemon.h nlohmann/json.hpp zlib.h; do
    if [[ -f /usr/include/$h ]]; then echo "$h: /usr/include/$h"; else echo "$h: missing"; fi
  done
  h=$(find /usr/include -maxdepth 3 -name cblas.h 2>/dev/null | head -1)
  echo "cblas.h: ${h:-missing}"
  for h in libboost_program_options libboost_unit_test_framework libsystemd libopenblas libz libgomp; do
    local found="" path
    for path in $(ldconfig -p 2>/dev/null | awk -v n="$h" 'index($1, n ".so") == 1 && /x86-64/ {print $NF}'); do
      [[ -e $path ]] && found+="$path "
    done
    echo "$h: ${found:-missing}"
  done
  echo
  echo "## carried pack ($pack)"
  if [[ ! -f $pack/manifest.txt || ! -f $pack/build.tar.xz ]]; then
    echo "missing: no manifest.txt or build.tar.xz (run tools/gpu-pack.sh on the build host first, and copy .gpu/ with the tree)"
    prebuilt_why="no carried tree"
  else
    grep -E '^(build_dir|source_dir|commit|uncommitted_changes|made_on|cuda_|glibc|cxxabi|debs_glibc)' "$pack/manifest.txt"
    echo "debs: $(ls "$pack"/debs/*.deb 2>/dev/null | wc -l) files"
    probe_prebuilt
  fi
  echo
  echo "## decision"
  decide
  echo "mode: $mode"
  echo "reason: $reason"
  decide_python
  if [[ -z $python_why ]]; then echo "python step: runs ($py; $python_how)"
  else echo "python step: not run: $python_why"; fi
  echo "probe took $((SECONDS - t0)) s"
}

# Unpacks the carried tree where it was made relative to the checkout (or
# in build/gpu-prebuilt when that place holds a tree of this machine's
# own), then tries it.
prebuilt_why=""
probe_prebuilt() {
  local rel old_build old_src
  rel=$(manifest build_rel)
  build=$trees/${rel:-build/gpu-prebuilt}
  if [[ -e $build && ! -f $build/gpu-pack.manifest ]]; then build=$trees/build/gpu-prebuilt; fi
  rm -rf "$build" && mkdir -p "$build"
  local t=$SECONDS
  local how
  if xz --version >/dev/null 2>&1; then
    how="tar and xz"
    tar -C "$build" -xJf "$pack/build.tar.xz" 2>&1 || { prebuilt_why="build.tar.xz does not unpack"; return; }
  elif have python3; then
    # The tree is the pack's own: links and modes as they are.
    how="python3's tarfile (no xz here)"
    python3 -c 'import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    t.extractall(sys.argv[2], **({"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}))' \
      "$pack/build.tar.xz" "$build" 2>&1 || { prebuilt_why="build.tar.xz does not unpack with python3"; return; }
  else
    prebuilt_why="neither xz nor python3 here to unpack build.tar.xz"; return
  fi
  echo "unpacked into $build in $((SECONDS - t)) s"
  echo "unpacked with $how"
  old_build=$(manifest build_dir) old_src=$(manifest source_dir)
  # Paths of the build host, in the order longest first (the build tree
  # may lie inside the source tree).
  local f
  for f in $(manifest rewrite); do
    [[ -f $build/$f ]] || continue
    OLD_BUILD=$old_build NEW_BUILD=$build OLD_SRC=$old_src NEW_SRC=$src perl -pi -e \
      's/\Q$ENV{OLD_BUILD}\E/$ENV{NEW_BUILD}/g; s/\Q$ENV{OLD_SRC}\E/$ENV{NEW_SRC}/g' "$build/$f" 2>/dev/null ||
      sed -i -e "s|$old_build|$build|g" -e "s|$old_src|$src|g" "$build/$f"
  done
  echo "paths rewritten: $old_build -> $build, $old_src -> $src ($(manifest rewrite | wc -w) files)"
  # The carried C++ runtime (Debian 12's libstdc++, libgcc_s) needs a newer
  # glibc than the rest: where this machine's glibc is older, or when
  # asked, this machine's own runtime serves if it has the versions needed.
  local need own cxx_runtime=${SHMPS_GPU_CHECK_CXX_RUNTIME:-auto}
  need=$(manifest glibc_needed) own=$(manifest glibc_needed_without_cxx_runtime)
  if [[ $cxx_runtime == auto && -n $need && -n ${host_glibc:-} ]] && ! ver_ge "$host_glibc" "$need"; then
    cxx_runtime=host
  fi
  if [[ $cxx_runtime == host ]]; then
    local cxxlib
    cxxlib=$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
    if [[ -n $cxxlib ]] && grep -aq "GLIBCXX_$(manifest glibcxx_needed)" "$cxxlib" &&
       grep -aq "CXXABI_$(manifest cxxabi_needed)" "$cxxlib" && [[ $(ldconfig -p 2>/dev/null) == *'libgcc_s.so.1 (libc6,x86-64)'* ]]; then
      mkdir -p "$build/lib/not-loaded"
      mv "$build/lib/libstdc++.so.6" "$build/lib/libgcc_s.so.1" "$build/lib/not-loaded/"
      echo "C++ runtime: this machine's ($cxxlib has GLIBCXX_$(manifest glibcxx_needed)); the carried one, which needs glibc $need, moved to lib/not-loaded"
    else
      echo "C++ runtime: the carried one (this machine's libstdc++ lacks GLIBCXX_$(manifest glibcxx_needed) or CXXABI_$(manifest cxxabi_needed))"
      cxx_runtime=carried
    fi
  else
    echo "C++ runtime: the carried one"
  fi
  if [[ -n $need && -n ${host_glibc:-} ]]; then
    [[ $cxx_runtime == host ]] && need=$own
    if ver_ge "$host_glibc" "$need"; then echo "glibc: the tree needs $need, this machine has $host_glibc: ok"
    else echo "glibc: the tree needs $need, this machine has $host_glibc: TOO OLD"; fi
  fi
  local b bad=0 n=0 missing=""
  for b in "$build"/bin/*; do
    n=$((n + 1))
    local lines
    lines=$(ldd "$b" 2>&1 | grep -E 'not found|error while loading|file too short|wrong ELF class')
    if [[ -n $lines ]]; then bad=$((bad + 1)); missing+=$'\n'"  $(basename "$b"): $(echo "$lines" | tr -s ' \t' ' ' | sort -u | tr '\n' ';')"; fi
  done
  echo "ldd: $n programs, $bad with unresolved libraries or versions${missing}"
  local v rc
  v=$(timeout 10 "$build/bin/shmps-server" --version 2>&1); rc=$?
  echo "shmps-server --version: rc $rc: $(echo "$v" | head -1)"
  [[ $bad -eq 0 ]] || prebuilt_why="ldd: $bad programs miss libraries or symbol versions"
  [[ $rc -eq 0 ]] || prebuilt_why="${prebuilt_why:+$prebuilt_why; }shmps-server --version exits $rc"
  [[ -n $prebuilt_why ]] && return
  v=$(timeout 10 "$build/bin/shmps-server" --name gpucheck_probe --tensor w:1024 --backend cuda --check-config 2>&1); rc=$?
  echo "shmps-server --backend cuda --check-config: rc $rc"
  v=$(timeout 10 "$build/bin/test_gpu_ipc" --list_content 2>&1 | head -3); rc=$?
  echo "test_gpu_ipc --list_content: rc $rc: $(echo "$v" | head -1)"
  # A real start with the CUDA backend: its start-up probes (device, compute
  # mode, IPC, peers) run, then it serves until stopped.
  local name=gpucheck_probe_$$ slog=$work/probe-server.log pid i
  "$build/bin/shmps-server" --name "$name" --tensor w:1024 --backend cuda > "$slog" 2>&1 &
  pid=$!
  for i in $(seq 1 100); do
    grep -q "serving" "$slog" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"; wait "$pid"; rc=$?
    echo "shmps-server --backend cuda: started$(grep -q serving "$slog" && echo ", serving" || echo " (not serving after 10 s)"), stopped by SIGTERM: rc $rc"
  else
    wait "$pid"; rc=$?
    echo "shmps-server --backend cuda: exited $rc at start-up"
  fi
  sed 's/^/  | /' "$slog" | head -20
}

# The python3 of the Python step: SHMPS_GPU_CHECK_PYTHON, else the first
# python3 on PATH (or in the usual places) that imports torch, else one
# that imports nanobind, else the first. Its path as found, not
# sys.executable: a venv or a wrapper stays what it is.
py="" py_facts=""
pick_python() {
  if [[ -n ${SHMPS_GPU_CHECK_PYTHON:-} ]]; then py=$SHMPS_GPU_CHECK_PYTHON; echo "python3 asked for: $py"; return; fi
  local c cands=() seen=" " first="" with_nanobind=""
  while IFS= read -r c; do cands+=("$c"); done < <(type -ap python3 2>/dev/null)
  cands+=(/usr/local/bin/python3 /opt/conda/bin/python3 /usr/bin/python3)
  for c in "${cands[@]}"; do
    [[ -x $c && $seen != *" $c "* ]] || continue
    seen+="$c "
    first=${first:-$c}
    if timeout 60 "$c" -c 'import torch' >/dev/null 2>&1; then py=$c; break; fi
    [[ -z $with_nanobind ]] && timeout 20 "$c" -c 'import nanobind' >/dev/null 2>&1 && with_nanobind=$c
  done
  [[ -n $py ]] || py=${with_nanobind:-$first}
  echo "python3 tried:$seen(the first with torch, else with nanobind, else the first)"
}

# The "## Python" section: what the Python step would run with. py_facts
# keeps the lines decide_python reads.
probe_python() {
  echo "## Python (the Python step)"
  pick_python
  if [[ -z $py ]]; then echo "python3: none found"; return; fi
  py_facts=$(timeout 90 "$py" - 2>&1 <<'PY'
import importlib, os, sys, sysconfig
print(f"python3: {sys.executable}: {sys.version.split()[0]}")
inc = sysconfig.get_paths().get("include") or "?"
h = os.path.join(inc, "Python.h")
print(f"Python.h: {h}" if os.path.exists(h) else f"Python.h: missing (not in {inc})")
def load(name):
    try:
        return importlib.import_module(name)
    except Exception as e:
        print(f"{name}: missing ({type(e).__name__}: {str(e)[:200]})")
torch = load("torch")
if torch:
    line = f"torch: {torch.__version__} (built for CUDA {torch.version.cuda}"
    available = torch.cuda.is_available()
    line += f"; torch.cuda.is_available(): {available}"
    if available:
        line += f", {torch.cuda.device_count()} device(s), cuda:0 {torch.cuda.get_device_name(0)}"
    print(line + ")")
nb = load("nanobind")
if nb:
    d = nb.cmake_dir()
    ok = os.path.exists(os.path.join(d, "nanobind-config.cmake"))
    print(f"nanobind: {nb.__version__}; cmake dir {d}" + ("" if ok else " (missing: no nanobind-config.cmake there)"))
for name in ("pytest", "numpy"):
    m = load(name)
    if m:
        print(f"{name}: {m.__version__}")
PY
)
  echo "$py_facts"
  echo "PYTORCH_CUDA_ALLOC_CONF: ${PYTORCH_CUDA_ALLOC_CONF-unset} (the Python step unsets it; the test that needs it sets it)"
}

# Whether the Python step can run in $mode: python_why is empty or says
# why not; python_how says what it builds.
python_why="" python_how=""
py_fact() { sed -n "s/^$1: //p" <<< "$py_facts" | head -1; }
decide_python() {
  local why="" v
  if [[ $mode == stop ]]; then python_why="the check stopped"; return; fi
  if [[ -z $py ]]; then python_why="no python3"; return; fi
  v=$(py_fact python3); v=${v##*: }
  if [[ -z $v ]]; then python_why="$py does not run: $(head -1 <<< "$py_facts")"; return; fi
  ver_ge "$v" 3.9 || why+="Python $v is older than 3.9; "
  [[ $(py_fact Python.h) == missing* ]] && why+="no Python.h for $v (its development headers are not installed); "
  [[ -z $(py_fact nanobind) || $(py_fact nanobind) == missing* ]] && why+="no nanobind for $py; "
  [[ $(py_fact pytest) == missing* ]] && why+="no pytest; "
  [[ $(py_fact numpy) == missing* ]] && why+="no numpy (both test files import it); "
  if ! have cmake; then why+="no cmake; "
  elif ! ver_ge "$(cmake --version | awk 'NR == 1 {print $3}')" 3.24; then why+="cmake older than 3.24; "; fi
  have c++ || have g++ || why+="no C++ compiler; "
  if [[ $mode == prebuilt ]]; then
    if [[ -z $(find "$build/$(manifest prefix)" -name shmpsConfig.cmake 2>/dev/null) ]]; then
      why+="the carried tree has no install prefix (a pack older than the Python step: rerun tools/gpu-pack.sh); "
    fi
    python_how="python/ built on its own against $build/$(manifest prefix)"
  else
    python_how="the module from the tree's build"
  fi
  local torch
  torch=$(py_fact torch)
  if [[ -z $torch || $torch == missing* ]]; then python_how+="; no torch: test_torch.py skips"
  elif [[ $torch != *'is_available(): True'* ]]; then python_how+="; torch sees no CUDA device: the CUDA cases skip"
  else python_how+="; torch ${torch%% *} on CUDA: the CUDA cases run"; fi
  python_why=${why%; }
}

build_mode_why() {
  local why=""
  have cmake || why+="no cmake; "
  # 3.25: CMakePresets.json's version 6 (build mode runs cmake --preset).
  if have cmake && ! ver_ge "$(cmake --version | awk 'NR == 1 {print $3}')" 3.25; then why+="cmake older than 3.25; "; fi
  have ninja || why+="no ninja; "
  have nvcc || why+="no nvcc; "
  have c++ || have g++ || why+="no C++ compiler; "
  compgen -G "$pack/debs/libboost1.74-dev_*.deb" >/dev/null || why+="no carried .debs ($pack/debs); "
  have dpkg-deb || have python3 || why+="neither dpkg-deb nor python3 to unpack the .debs; "
  local need
  need=$(manifest debs_glibc_needed)
  if [[ -n $need && -n ${host_glibc:-} ]] && ! ver_ge "$host_glibc" "$need"; then
    why+="glibc $host_glibc is older than the $need Debian 12's libraries need; "
  fi
  echo "${why%; }"
}

decide() {
  local bwhy
  bwhy=$(build_mode_why)
  case $mode_wanted in
    prebuilt)
      if [[ -z $prebuilt_why ]]; then mode=prebuilt reason="asked for (SHMPS_GPU_CHECK_MODE=prebuilt); the carried tree runs here"
      else mode=stop reason="prebuilt asked for, but: $prebuilt_why"; fi ;;
    build)
      if [[ -z $bwhy ]]; then mode=build reason="asked for (SHMPS_GPU_CHECK_MODE=build)"
      else mode=stop reason="build asked for, but: $bwhy"; fi ;;
    auto)
      if [[ -z $prebuilt_why ]]; then mode=prebuilt reason="the carried tree runs here"
      elif [[ -z $bwhy ]]; then mode=build reason="the carried tree cannot run here ($prebuilt_why); building from source"
      else mode=stop reason="the carried tree cannot run here ($prebuilt_why), and no build is possible ($bwhy)"; fi ;;
    *) mode=stop reason="SHMPS_GPU_CHECK_MODE must be auto, prebuilt or build, not '$mode_wanted'" ;;
  esac
  if [[ $mode != stop && $gpu_ok == 0 && $allow_no_gpu != 1 ]]; then
    reason+=" (NOTE: no GPU visible: the GPU tests will skip and the check fails)"
  fi
}

# ------------------------------------------------------------ publishing --
names=() rcs=() secs=() notes=() finished=0
publish() {
  local size
  size=$(stat -c %s "$log" 2>/dev/null || echo 0)
  if [[ $size -gt $((4 << 20)) ]]; then
    { head -c $((1 << 20)) "$log"; printf '\n\n[... %d bytes cut ...]\n\n' $((size - (4 << 20))); tail -c $((3 << 20)) "$log"; } > "$out/gpu-check.log"
  else
    cp "$log" "$out/gpu-check.log"
  fi
  [[ -f $work/sanitizer.txt ]] && tail -c $((4 << 20)) "$work/sanitizer.txt" > "$out/sanitizer.txt"
  write_results > "$out/results.md.tmp" && mv "$out/results.md.tmp" "$out/results.md"
}

verdict() {
  local i failed=0 skipped=0
  [[ $mode == stop ]] && { echo "STOPPED: $reason"; return; }
  for i in "${!rcs[@]}"; do
    case ${rcs[$i]} in 0) ;; -) skipped=$((skipped + 1)) ;; *) failed=$((failed + 1)) ;; esac
  done
  if [[ $failed -gt 0 ]]; then echo "FAILED: $failed step(s) failed or timed out"
  elif [[ $gpu_ok == 0 && $allow_no_gpu != 1 ]]; then echo "FAILED: no GPU visible (nvidia-smi); every GPU test skipped"
  else echo "passed$([[ $skipped -gt 0 ]] && echo " ($skipped step(s) not run)")$([[ $gpu_ok == 0 ]] && echo "; no GPU here: the GPU tests skipped")"; fi
}

write_results() {
  echo "# gpu-check $(date -u +%FT%TZ)"
  echo
  echo "- device: ${device_line:-none (nvidia-smi: $(have nvidia-smi && echo failed || echo not found))}"
  echo "- mode: **$mode**: $reason"
  echo "- build tree: ${build:-none}; commit $(manifest commit) (uncommitted changes: $(manifest uncommitted_changes))"
  echo "- elapsed: $((SECONDS - t0)) s of a $budget s budget"
  if [[ $finished == 1 ]]; then echo "- verdict: **$(verdict)**"
  else echo "- verdict: **running** (this file is rewritten after every step; a killed run leaves it here)"; fi
  echo
  echo "## Steps"
  echo
  echo "| step | exit code | seconds | note |"
  echo "|---|---|---|---|"
  local i
  for i in "${!names[@]}"; do
    echo "| ${names[$i]} | ${rcs[$i]} | ${secs[$i]} | ${notes[$i]} |"
  done
  echo
  echo "## Tests"
  echo
  if have python3; then
    python3 - "$work/gpu-tests.xml" "$work/suite.xml" "$work/python.xml" <<'PY'
import os, sys, xml.etree.ElementTree as ET
runs = [("ctest -L gpu", sys.argv[1]), ("suite on the CUDA build", sys.argv[2]), ("pytest tests/python", sys.argv[3])]
rows, have = {}, []
for col, path in runs:
    if not os.path.exists(path):
        continue
    have.append(col)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        print(f"({path}: {e})")
        continue
    for tc in root.iter("testcase"):
        r, why = "passed", ""
        if tc.find("failure") is not None or tc.find("error") is not None or tc.get("status") == "fail":
            r = "**FAILED**"
        elif tc.find("skipped") is not None or tc.get("status") in ("notrun", "disabled"):
            r = "skipped"
        name = tc.get("name")
        if col.startswith("pytest"):
            # python.<file>.<test>, as CTest names them; a skip with its reason
            name = f"python.{(tc.get('classname') or '?').split('.')[-1]}.{name}"
            if r == "skipped":
                why = "; " + tc.find("skipped").get("message", "").replace("|", "/").replace("\n", " ")[:100]
        rows.setdefault(name, {})[col] = f"{r} ({float(tc.get('time') or 0):.1f} s{why})"
if not have:
    print("(no test ran)")
else:
    print("| test | " + " | ".join(have) + " |")
    print("|---|" + "---|" * len(have))
    for name in sorted(rows):
        print(f"| {name} | " + " | ".join(rows[name].get(c, "-") for c in have) + " |")
    for c in have:
        cells = [r[c].split(" ")[0] for r in rows.values() if c in r]
        print(f"\n{c}: {cells.count('passed')} passed, {cells.count('**FAILED**')} failed, {cells.count('skipped')} skipped")
PY
  else
    echo "(no python3: see gpu-check.log)"
  fi
  local f
  for f in bench-quick.txt bench.txt; do
    [[ -s $out/$f ]] || continue
    echo
    echo "## $f"
    echo
    echo '```'
    head -c 20000 "$out/$f"
    echo '```'
  done
}

# One step: its cap, cut to what is left of the budget; skipped (exit code
# "-") when under 10 s are left. STEP_OUT names a file for its stdout.
step() {
  local name=$1 cap=$2; shift 2
  local left=$((budget - (SECONDS - t0) - 5)) t rc start=$SECONDS
  t=$(( cap < left ? cap : left ))
  say "== $name (cap ${t} s)"
  if [[ $t -lt 10 ]]; then
    names+=("$name") rcs+=("-") secs+=(0) notes+=("not run: no time left in the budget")
    say "   not run: no time left"; publish; return 0
  fi
  if [[ -n ${STEP_OUT:-} ]]; then timeout -k 5 "$t" "$@" > "$STEP_OUT" 2>> "$log"; rc=$?
  else timeout -k 5 "$t" "$@" >> "$log" 2>&1; rc=$?; fi
  local note=${STEP_NOTE:-}
  [[ $rc == 124 || $rc == 137 ]] && note="TIMED OUT after $t s${note:+; $note}"
  names+=("$name") rcs+=("$rc") secs+=($((SECONDS - start))) notes+=("$note")
  say "   exit $rc after $((SECONDS - start)) s"
  publish
  return 0
}
not_run() { names+=("$1") rcs+=("-") secs+=(0) notes+=("$2"); say "== $1: not run: $2"; }

finish() {
  trap - EXIT TERM INT
  finished=1
  publish
  cat "$out/results.md"
  local v
  v=$(verdict)
  case $v in passed*) exit 0 ;; STOPPED*) exit 2 ;; *) exit 1 ;; esac
}
trap 'say "interrupted"; finish' TERM INT

cd "$src" || exit 2  # cmake --preset reads the CMakePresets.json of the current directory
probe > "$out/probe.txt" 2>&1
cat "$out/probe.txt" >> "$log"
cat "$out/probe.txt"
if [[ $probe_only == 1 ]]; then
  cp "$log" "$out/gpu-check.log"
  [[ $mode == stop ]] && exit 2
  exit 0
fi
trap finish EXIT
[[ $mode == stop ]] && { say "stopped: $reason"; exit 2; }

# ------------------------------------------------------------- build mode --
# The carried .debs unpacked into a sysroot: their pkg-config files
# pointed at it, pkgconf run from it, and the programs built with DT_RPATH
# (--disable-new-dtags) so that the sysroot's libraries and their own
# dependencies (libsystemd's libcap, OpenBLAS's libgfortran) load from it.
# LD_LIBRARY_PATH is not set: it would also put Debian 12's libzstd or
# liblzma under this machine's cmake and compilers.
unpack_debs() {
  mkdir -p "$sysroot"
  local d
  for d in "$pack"/debs/*.deb; do
    if have dpkg-deb; then dpkg-deb -x "$d" "$sysroot" || return 1
    else
      python3 - "$d" "$sysroot" <<'PY' || return 1
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"!<arch>\n", "not an ar archive"
pos = 8
while pos < len(data):
    name = data[pos:pos + 16].decode().strip().rstrip("/")
    size = int(data[pos + 48:pos + 58].decode().strip())
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(body)).extractall(sys.argv[2])
    pos += 60 + size + (size & 1)
PY
    fi
  done
  local lib=$sysroot/usr/lib/x86_64-linux-gnu
  # Absolute links in the packages point at /usr: into the sysroot instead.
  find "$sysroot" -type l -lname '/*' | while read -r l; do ln -sfn "$sysroot$(readlink "$l")" "$l"; done
  find "$sysroot" -name '*.pc' | while read -r pc; do
    sed -i -E "s#^(prefix|exec_prefix|libdir|includedir|sharedlibdir)=/usr#\1=$sysroot/usr#" "$pc"
  done
  mkdir -p "$sysroot/bin"
  cat > "$sysroot/bin/pkg-config" <<EOF
#!/bin/sh
export PKG_CONFIG_LIBDIR=$lib/pkgconfig:$lib/openblas-pthread/pkgconfig:$sysroot/usr/share/pkgconfig
LD_LIBRARY_PATH=$lib exec $sysroot/usr/bin/pkgconf "\$@"
EOF
  chmod +x "$sysroot/bin/pkg-config"
  "$sysroot/bin/pkg-config" --modversion libsystemd openblas zlib
}

if [[ $mode == build ]]; then
  lib=$sysroot/usr/lib/x86_64-linux-gnu
  build=$trees/build/cuda  # the cuda preset's binaryDir when in the checkout
  say "== unpack the carried .debs into $sysroot"
  s=$SECONDS
  unpack_debs >> "$log" 2>&1; rc=$?
  names+=("unpack .debs into the sysroot") rcs+=("$rc") secs+=($((SECONDS - s))) notes+=("$sysroot")
  publish
  [[ $rc == 0 ]] || { reason="the .debs did not unpack"; exit 1; }
  # The Python package (SHMPS_PYTHON=AUTO) for the Python step's python3:
  # built when it has its headers and nanobind.
  python_def=()
  [[ -n $py ]] && python_def=(-DPython_EXECUTABLE="$py")
  STEP_NOTE="cuda preset, SHMPS_WERROR=OFF (another compiler may warn otherwise)${py:+, Python_EXECUTABLE=$py}" \
  step "configure (cuda preset, sm_90, against the sysroot)" 60 \
    cmake -S "$src" -B "$build" --preset cuda -DSHMPS_WERROR=OFF "${python_def[@]}" \
      -DCMAKE_PREFIX_PATH="$sysroot/usr" \
      -DBoost_DIR="$lib/cmake/Boost-1.74.0" -DBoost_NO_SYSTEM_PATHS=ON \
      -Dnlohmann_json_DIR="$sysroot/usr/share/cmake/nlohmann_json" \
      -DZLIB_INCLUDE_DIR="$sysroot/usr/include" -DZLIB_LIBRARY="$lib/libz.so" \
      -DPKG_CONFIG_EXECUTABLE="$sysroot/bin/pkg-config" \
      -DCMAKE_EXE_LINKER_FLAGS="-Wl,--disable-new-dtags -Wl,-rpath-link,$lib:$lib/openblas-pthread" \
      -DCMAKE_SHARED_LINKER_FLAGS="-Wl,--disable-new-dtags -Wl,-rpath-link,$lib:$lib/openblas-pthread"
  [[ ${rcs[-1]} == 0 ]] || { say "configure FAILED: see gpu-check.log"; exit 1; }
  # 270 s on 16 cores; longer on fewer (the rehearsal's 2 cores), where
  # SHMPS_GPU_CHECK_BUDGET_S must grow with it.
  build_cap=$(( cores >= 16 ? 270 : 270 * 16 / cores ))
  # -k 0 builds all it can: when every failed edge lies in python/, the
  # C++ checks still run (and the Python step says it has no module).
  log_at=$(stat -c %s "$log")
  STEP_NOTE="$cores cores; a rerun continues it" step "build" "$build_cap" cmake --build "$build" -j"$cores" -- -k 0
  if [[ ${rcs[-1]} != 0 ]]; then
    failed_edges=$(tail -c +$((log_at + 1)) "$log" | grep '^FAILED: ')
    if [[ ${rcs[-1]} == 1 && -n $failed_edges ]] && ! grep -qv '^FAILED: python/' <<< "$failed_edges"; then
      notes[-1]+="; only the Python package failed to build"
      python_build_failed=1
      publish
    else
      say "build FAILED: see gpu-check.log"; exit 1
    fi
  fi
else
  names+=("prepare: carried tree unpacked, paths rewritten") rcs+=(0) secs+=(0) notes+=("$build")
fi

# ----------------------------------------------------------------- checks --
export SHMPS_BUILD_DIR=$build SHMPS_SERVER_BIN=$build/bin/shmps-server SHMPS_SOURCE_DIR=$src
# ctest stops starting tests at --stop-time, and still writes its JUnit
# file, a few seconds before timeout would kill it. A test that fails is
# run once more (a timing test on a loaded machine, where a rerun of the
# whole check would cost the budget): it fails the step only if it fails
# twice, and the step's note names every test that needed the second try
# (ctest prints its passing rerun without the "N/M" count).
ctest_step() {
  local name=$1 cap=$2 junit=$3; shift 3
  local left=$((budget - (SECONDS - t0) - 5)) t total ran log_at retried
  t=$(( cap < left ? cap : left ))
  total=$(ctest --test-dir "$build" -N "$@" 2>/dev/null | sed -n 's/^Total Tests: //p')
  log_at=$(stat -c %s "$log")
  STEP_NOTE="${total:-?} tests" step "$name" "$cap" ctest --test-dir "$build" --output-on-failure \
    --repeat until-pass:2 --stop-time "$(date -d "@$(( $(date +%s) + t - 8 ))" +%H:%M:%S)" \
    --output-junit "$junit" "$@"
  ran=$(grep -c '<testcase ' "$junit" 2>/dev/null)
  if [[ -n $total && ${ran:-0} -lt $total ]]; then
    notes[-1]+="; stopped at the budget: $((total - ${ran:-0})) not started"
    publish
  fi
  retried=$(tail -c +$((log_at + 1)) "$log" | sed -nE 's/^ +Test +#[0-9]+: ([^ ]+) \.+ +Passed.*/\1/p' | sort -u | paste -sd' ')
  if [[ -n $retried ]]; then
    notes[-1]+="; passed on a second try: $retried"
    publish
  fi
}
ctest_step "ctest -L gpu" 100 "$work/gpu-tests.xml" -L gpu

# --device as nvidia-smi -L prints it (GPU-xxxxxxxx-..., the form
# docs/cuda.md asks for): the server starts on that device and names it.
uuid=$(timeout 15 nvidia-smi -L 2>/dev/null | sed -n 's/.*(UUID: \(GPU-[^)]*\)).*/\1/p' | head -1)
if [[ -n $uuid ]]; then
  STEP_NOTE="$uuid, the first nvidia-smi -L names" step "shmps-server --device <UUID as nvidia-smi -L prints it>" 30 \
    bash -c 'slog=$1/device-server.log
      "$2/bin/shmps-server" --name "gpucheck_device_$$" --tensor w:1024 --backend cuda --device "$3" > "$slog" 2>&1 &
      pid=$!
      for i in $(seq 1 200); do grep -q "serving" "$slog" && break; kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -TERM "$pid" 2>/dev/null; wait "$pid"; rc=$?
      cat "$slog"
      grep -q "serving" "$slog" || { echo "FAIL: not serving with --device $3"; exit 1; }
      grep -qiF "($3, PCI" "$slog" || { echo "FAIL: the log names no backend on $3"; exit 1; }
      exit "$rc"' _ "$work" "$build" "$uuid"
else
  not_run "shmps-server --device <UUID as nvidia-smi -L prints it>" "nvidia-smi -L names no UUID here (no GPU visible)"
fi

if [[ -x $build/bin/shmps-gpu-bench ]]; then
  STEP_OUT=$out/bench-quick.txt step "shmps-gpu-bench --quick" 40 "$build/bin/shmps-gpu-bench" --quick
  cat "$out/bench-quick.txt" >> "$log"
else
  not_run "shmps-gpu-bench --quick" "not built (a build without CUDA?)"
fi

ctest_step "suite on the CUDA build (-LE 'soak|gpu|host-tools')" 120 "$work/suite.xml" \
  -LE 'soak|gpu|host-tools' -E '^gpu_bench_smoke$' -j"$cores"

# The Python package on this machine's python3: the extension (prebuilt:
# python/ configured on its own against the carried install prefix; build:
# the tree's build made it), then all of tests/python with the server of
# this build. pytest gets SIGINT 8 s before the step's cap: it then ends
# the session and still writes its JUnit file.
python_pkg=""
if [[ -n $python_why ]]; then
  not_run "python: pytest tests/python" "$python_why"
elif [[ $mode == prebuilt ]]; then
  pybuild=$trees/build/gpu-python  # kept: a later call reuses it (docs/cuda.md, "A GPU session")
  generator=()
  have ninja && generator=(-G Ninja)
  # nanobind's own sources and the extension: the cap grows below 8 cores
  # (docs/cuda.md, "GPU check", gives the times).
  STEP_NOTE="$py, nanobind $(py_fact nanobind | cut -d';' -f1), against $build/$(manifest prefix)" \
  step "python: build the extension against the carried prefix" $(( cores >= 8 ? 60 : 60 * 8 / cores )) \
    bash -c 'cmake -S "$1/python" -B "$2" "${@:6}" -DCMAKE_PREFIX_PATH="$3" -DPython_EXECUTABLE="$4" \
               -DSHMPS_SERVER_BIN="$5/bin/shmps-server" && cmake --build "$2" -j"$(nproc)"' \
      _ "$src" "$pybuild" "$build/$(manifest prefix)" "$py" "$build" "${generator[@]}"
  [[ ${rcs[-1]} == 0 ]] && python_pkg=$pybuild/python
elif [[ ${python_build_failed:-0} == 1 ]]; then
  not_run "python: pytest tests/python" "the tree's build of the Python package failed (see the build in gpu-check.log)"
else
  if compgen -G "$build/python/shmps/_shmps*.so" >/dev/null; then python_pkg=$build/python
  else not_run "python: pytest tests/python" "the tree's build made no python/shmps/_shmps*.so (see its configure and build in gpu-check.log)"; fi
fi
if [[ -n $python_pkg ]]; then
  left=$((budget - (SECONDS - t0) - 5))
  cap=$(( 120 < left ? 120 : left ))
  STEP_NOTE="$python_pkg; ${python_how##*; }" \
  step "python: pytest tests/python" 120 \
    env -u PYTORCH_CUDA_ALLOC_CONF PYTHONPATH="$python_pkg${PYTHONPATH:+:$PYTHONPATH}" \
      SHMPS_SERVER_BIN="$build/bin/shmps-server" OPENBLAS_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 \
      timeout -s INT -k 5 $((cap - 8)) "$py" -m pytest -q -rA -p no:cacheprovider -o faulthandler_timeout=60 \
        --junitxml="$work/python.xml" tests/python
fi

# Whether compute-sanitizer works on this machine at all: a trivial CUDA
# program (an allocation, a kernel, a copy back), built here with nvcc, run
# alone, then under memcheck. Some machines refuse the tool (a gVisor
# sandbox: "Device not supported", then error 999 at the first
# allocation): the sanitizer steps are then not run, with its message,
# instead of failing the check for what no change to the code can mend.
# sanitizer_why stays empty when the steps should run: the tool works, or
# it cannot be judged (no nvcc; the program fails alone, as without a GPU).
sanitizer_why=""
probe_sanitizer() {
  local dir=$work/sanitizer-probe rc left=$((budget - (SECONDS - t0) - 5))
  # Within the budget, and a third of what is left at most (the steps follow).
  if [[ $left -lt 30 ]]; then echo "sanitizer probe: not run, $left s left in the budget: the steps run"; return; fi
  local cap=$(( left / 3 < 60 ? left / 3 : 60 ))
  mkdir -p "$dir"
  cat > "$dir/probe.cu" <<'CU'
#include <cstdio>
__global__ void fill(int* p, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = i;
}
int main() {
  constexpr int n = 1024;
  static int host[n];
  int* dev = nullptr;
  cudaError_t e = cudaMalloc(&dev, n * sizeof(int));
  if (e == cudaSuccess) {
    fill<<<n / 256, 256>>>(dev, n);
    e = cudaMemcpy(host, dev, sizeof host, cudaMemcpyDeviceToHost);
    cudaFree(dev);
  }
  std::printf("%s\n", e != cudaSuccess ? cudaGetErrorName(e) : host[n - 1] == n - 1 ? "ok" : "wrong values");
  return e == cudaSuccess && host[n - 1] == n - 1 ? 0 : 1;
}
CU
  if ! have nvcc; then echo "sanitizer probe: no nvcc to build its program: the steps run"; return; fi
  if ! timeout "$cap" nvcc -o "$dir/probe" "$dir/probe.cu" > "$dir/nvcc.txt" 2>&1; then
    echo "sanitizer probe: its program did not build ($(head -3 "$dir/nvcc.txt" | tr '\n' ' ')): the steps run"; return
  fi
  if ! timeout "$cap" "$dir/probe" > "$dir/alone.txt" 2>&1; then
    echo "sanitizer probe: its program fails without the tool ($(head -1 "$dir/alone.txt")): the steps run"; return
  fi
  timeout "$cap" compute-sanitizer --tool memcheck --error-exitcode 99 "$dir/probe" > "$dir/under.txt" 2>&1; rc=$?
  { echo "== compute-sanitizer --tool memcheck on the probe's trivial program: exit $rc"; cat "$dir/under.txt"; } >> "$work/sanitizer.txt"
  if [[ $rc == 0 ]]; then echo "sanitizer probe: compute-sanitizer runs a trivial CUDA program: the steps run"; return; fi
  # Its own words, for the results table (no '|', one line, 300 characters).
  local said
  said=$(sed -e 's/^=* *//' "$dir/under.txt" | grep -v -e '^ *$' -e '^COMPUTE-SANITIZER' | head -3 | paste -sd';' - | sed 's/;/; /g' | tr '|' '/' | cut -c1-300)
  sanitizer_why="compute-sanitizer unsupported here (${said:-no output}; exit $rc on a trivial CUDA program that runs without it)"
  echo "sanitizer probe: $sanitizer_why"
}

# compute-sanitizer: the kernels (memcheck, racecheck) and the IPC path
# with its server process (memcheck on two cases, every process).
if have compute-sanitizer; then
  say "== compute-sanitizer's probe"
  probe_sanitizer > "$work/sanitizer-probe.txt" 2>&1
  tee -a "$log" < "$work/sanitizer-probe.txt"
fi
if have compute-sanitizer && [[ -n $sanitizer_why ]]; then
  for run in "memcheck test_cuda_kernels" "racecheck test_cuda_kernels" "memcheck test_gpu_ipc"; do
    not_run "compute-sanitizer $run" "$sanitizer_why"
  done
  publish
elif have compute-sanitizer; then
  seed=gpu_ipc/seed_push_at_version_0_returns_1_and_applies_sgd_from_device_memory,two_gradients_at_offsets_of_one_allocation_read_only_their_ranges
  for run in "memcheck test_cuda_kernels" "racecheck test_cuda_kernels" "memcheck test_gpu_ipc"; do
    set -- $run
    args=()
    [[ $2 == test_gpu_ipc ]] && args=(--run_test="$seed")
    echo "== compute-sanitizer --tool $1 $2 ${args[*]}" >> "$work/sanitizer.txt"
    # racecheck takes longer than memcheck over the kernel tests' large
    # tensors (docs/cuda.md, "Status").
    STEP_OUT=$work/sanitizer.part step "compute-sanitizer $1 $2" $([[ $1 == racecheck ]] && echo 90 || echo 45) \
      compute-sanitizer --tool "$1" --error-exitcode 99 --target-processes all \
        "$build/bin/$2" "${args[@]}" --log_level=test_suite --color_output=no
    cat "$work/sanitizer.part" >> "$work/sanitizer.txt" 2>/dev/null
    grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$work/sanitizer.part" 2>/dev/null | tail -3 | sed 's/^/   /' | tee -a "$log"
  done
  publish
else
  not_run "compute-sanitizer" "not on PATH (nor in /usr/local/cuda/bin)"
fi

if [[ -x $build/bin/shmps-gpu-bench ]]; then
  if [[ $((budget - (SECONDS - t0))) -ge 60 ]]; then
    STEP_OUT=$out/bench.txt step "shmps-gpu-bench (full)" 75 "$build/bin/shmps-gpu-bench"
    cat "$out/bench.txt" >> "$log"
  else
    not_run "shmps-gpu-bench (full)" "under 60 s left in the budget: run $build/bin/shmps-gpu-bench by hand"
  fi
fi
finish
