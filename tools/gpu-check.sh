#!/usr/bin/env bash
# tools/gpu-check.sh [--probe-only] OUTDIR: the CUDA backend's check on the
# GPU machine (docs/cuda.md, "GPU check"), a host with a GPU, CUDA, CMake
# and Ninja but maybe no Boost, libsystemd, OpenBLAS or nlohmann-json and
# no package registry. It works from what tools/gpu-pack.sh left in .gpu/:
#  1. probe (seconds): GPU, driver, kernel, glibc, disk, compilers and
#     tools, development files, the carried tree unpacked and tried (ldd,
#     shmps-server --version, --check-config, a --backend cuda start), and
#     the DECISION: prebuilt (the carried tree, its paths rewritten to this
#     checkout), build (the carried .debs unpacked into a sysroot, then the
#     cuda preset configured against it and built with all cores), or stop
#     with the reason. --probe-only ends here.
#  2. every test labelled gpu; shmps-gpu-bench --quick; the whole suite on
#     the CUDA build (--backend auto picks cuda there), without the labels
#     soak, gpu and host-tools (tests that need the build host's tools);
#     compute-sanitizer memcheck and racecheck on the GPU tests when it is
#     on PATH; the full shmps-gpu-bench when time is left.
# OUTDIR receives at most six files, rewritten after every step so that a
# killed run still leaves them: probe.txt, results.md (steps with exit
# codes, one row per test, the bench), gpu-check.log (cut to 4 MiB),
# bench-quick.txt, bench.txt, sanitizer.txt. Work files go to
# $TMPDIR/shmps-gpu-check. Bounded: each step has a cap (in prebuilt mode
# they add up to 470 s; build mode adds up to 335 s on 16 cores), and no
# step outlives SHMPS_GPU_CHECK_BUDGET_S (default 500) from the start.
# Exit 0: every step ran and passed; 1: a step failed or timed out, or no
# GPU was visible; 2: stopped (nothing could run; the probe says why).
# Environment: SHMPS_GPU_CHECK_MODE=auto|prebuilt|build (default auto),
# SHMPS_GPU_CHECK_PACK (default .gpu), SHMPS_GPU_CHECK_BUDGET_S,
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
  for t in cmake ctest ninja c++ g++ gcc clang++ nvcc compute-sanitizer pkg-config dpkg-deb ar tar gzip python3 gdb; do
    if have "$t"; then
      case $t in
        nvcc) echo "$t: $(command -v $t): $(timeout 10 nvcc --version 2>&1 | grep -i release)" ;;
        tar|gzip|ar|dpkg-deb) echo "$t: $(command -v $t)" ;;
        *) echo "$t: $(command -v $t): $(first_line "$t" --version)" ;;
      esac
    else
      echo "$t: not found"
    fi
  done
  if have python3; then
    timeout 30 python3 - <<'PY' 2>&1 | sed 's/^/python: /'
import importlib
for name in ("torch", "nanobind", "pybind11", "scikit_build_core"):
    try:
        m = importlib.import_module(name)
        line = f"{name} {getattr(m, '__version__', '?')}"
        if name == "torch":
            line += f" (CUDA {m.version.cuda}, available {m.cuda.is_available()}, devices {m.cuda.device_count()})"
        print(line)
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {e}")
PY
  fi
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
  if [[ ! -f $pack/manifest.txt || ! -f $pack/build.tar.gz ]]; then
    echo "missing: no manifest.txt or build.tar.gz (run tools/gpu-pack.sh here first, and carry .gpu)"
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
  if ! tar -C "$build" -xzf "$pack/build.tar.gz" 2>&1; then prebuilt_why="build.tar.gz does not unpack"; return; fi
  echo "unpacked into $build in $((SECONDS - t)) s"
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

build_mode_why() {
  local why=""
  have cmake || why+="no cmake; "
  if have cmake && ! ver_ge "$(cmake --version | awk 'NR == 1 {print $3}')" 3.24; then why+="cmake older than 3.24; "; fi
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
    python3 - "$work/gpu-tests.xml" "$work/suite.xml" <<'PY'
import os, sys, xml.etree.ElementTree as ET
runs = [("ctest -L gpu", sys.argv[1]), ("suite on the CUDA build", sys.argv[2])]
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
        r = "passed"
        if tc.find("failure") is not None or tc.get("status") == "fail":
            r = "**FAILED**"
        elif tc.find("skipped") is not None or tc.get("status") in ("notrun", "disabled"):
            r = "skipped"
        rows.setdefault(tc.get("name"), {})[col] = f"{r} ({float(tc.get('time') or 0):.1f} s)"
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
  STEP_NOTE="cuda preset, SHMPS_WERROR=OFF (another compiler may warn otherwise)" \
  step "configure (cuda preset, sm_90, against the sysroot)" 60 \
    cmake -S "$src" -B "$build" --preset cuda -DSHMPS_WERROR=OFF \
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
  STEP_NOTE="$cores cores; a rerun continues it" step "build" "$build_cap" cmake --build "$build" -j"$cores"
  [[ ${rcs[-1]} == 0 ]] || { say "build FAILED: see gpu-check.log"; exit 1; }
else
  names+=("prepare: carried tree unpacked, paths rewritten") rcs+=(0) secs+=(0) notes+=("$build")
fi

# ----------------------------------------------------------------- checks --
export SHMPS_BUILD_DIR=$build SHMPS_SERVER_BIN=$build/bin/shmps-server SHMPS_SOURCE_DIR=$src
# ctest stops starting tests at --stop-time, and still writes its JUnit
# file, a few seconds before timeout would kill it.
ctest_step() {
  local name=$1 cap=$2 junit=$3; shift 3
  local left=$((budget - (SECONDS - t0) - 5)) t total ran
  t=$(( cap < left ? cap : left ))
  total=$(ctest --test-dir "$build" -N "$@" 2>/dev/null | sed -n 's/^Total Tests: //p')
  STEP_NOTE="${total:-?} tests" step "$name" "$cap" ctest --test-dir "$build" --output-on-failure \
    --stop-time "$(date -d "@$(( $(date +%s) + t - 8 ))" +%H:%M:%S)" --output-junit "$junit" "$@"
  ran=$(grep -c '<testcase ' "$junit" 2>/dev/null)
  if [[ -n $total && ${ran:-0} -lt $total ]]; then
    notes[-1]+="; stopped at the budget: $((total - ${ran:-0})) not started"
    publish
  fi
}
ctest_step "ctest -L gpu" 100 "$work/gpu-tests.xml" -L gpu

if [[ -x $build/bin/shmps-gpu-bench ]]; then
  STEP_OUT=$out/bench-quick.txt step "shmps-gpu-bench --quick" 40 "$build/bin/shmps-gpu-bench" --quick
  cat "$out/bench-quick.txt" >> "$log"
else
  not_run "shmps-gpu-bench --quick" "not built (a build without CUDA?)"
fi

ctest_step "suite on the CUDA build (-LE 'soak|gpu|host-tools')" 120 "$work/suite.xml" \
  -LE 'soak|gpu|host-tools' -E '^gpu_bench_smoke$' -j"$cores"

# compute-sanitizer: the kernels (memcheck, racecheck) and the IPC path
# with its server process (memcheck on two cases, every process).
if have compute-sanitizer; then
  seed=gpu_ipc/seed_push_at_version_0_returns_1_and_applies_sgd_from_device_memory,two_gradients_at_offsets_of_one_allocation_read_only_their_ranges
  for run in "memcheck test_cuda_kernels" "racecheck test_cuda_kernels" "memcheck test_gpu_ipc"; do
    set -- $run
    args=()
    [[ $2 == test_gpu_ipc ]] && args=(--run_test="$seed")
    echo "== compute-sanitizer --tool $1 $2 ${args[*]}" >> "$work/sanitizer.txt"
    STEP_OUT=$work/sanitizer.part step "compute-sanitizer $1 $2" 45 \
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
