#!/usr/bin/env bash
# check_prefix.sh PREFIX BUILD_DIR [--hide-cuda] [cmake args for the consumer...]
# What a user of an installed shmps (cmake --install, or the unpacked .deb
# packages) meets, optionally on a host without CUDA:
#  - no file of the installed CMake or pkg-config package names a path of
#    the build machine (the build tree, the source tree, the CUDA toolkit);
#  - tests/consumer builds against PREFIX with find_package(shmps), and so
#    does README.md's worker snippet, as printed; the consumer also with
#    pkg-config's flags and a plain compiler;
#  - PREFIX/bin/shmps-server serves the consumer (push, pull: w = -g).
# --hide-cuda (root only): all of it runs in a mount namespace where the
# CUDA toolkit's directories are empty tmpfs mounts and /dev/shm is a
# private one; there the README's own server command runs too, and the
# snippet must fail with server_not_running before that server starts and
# succeed once it runs. Exit 77 (skip) when --hide-cuda cannot be had.
set -euo pipefail
prefix=$(cd "$1" && pwd)
build_dir=$(cd "$2" && pwd)
shift 2
hide=0
if [[ ${1:-} == --hide-cuda ]]; then hide=1; shift; fi
source_dir=$(cd "$(dirname "$0")/../.." && pwd)
script=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
fail() { echo "FAIL: $*" >&2; exit 1; }

# The toolkit's directories (nvcc's root, /usr/local/cuda*), each hidden
# by an empty tmpfs, without one inside another.
cuda_roots() {
  local nvcc last=
  {
    if nvcc=$(command -v nvcc); then dirname "$(dirname "$(readlink -f "$nvcc")")"; fi
    for d in /usr/local/cuda /usr/local/cuda-*; do [[ -d $d ]] && readlink -f "$d"; done
  } | sort -u | while read -r d; do
    if [[ -n $last && $d == "$last"/* ]]; then continue; fi
    echo "$d"
    last=$d
  done
}
# Copies of CUDA's libraries and wrappers of its programs outside those
# roots (e.g. /usr/local/lib/libcudart.so.13, /usr/local/bin/nvcc), each
# hidden by an empty file bound over it.
cuda_strays() {
  local roots=$1
  {
    ldconfig -p 2>/dev/null | awk '/libcuda|libnvidia|libnvrtc/ {print $NF}'
    ls /usr/local/lib/libcud* /usr/local/bin/nvcc /usr/bin/nvcc 2>/dev/null || true
  } | while read -r f; do
    f=$(readlink -f "$f")
    [[ -f $f ]] || continue
    inside=0
    for r in $roots; do [[ $f == "$r"/* ]] && inside=1; done
    [[ $inside == 1 ]] || echo "$f"
  done | sort -u
}

if [[ $hide == 1 && -z ${SHMPS_CUDA_HIDDEN:-} ]]; then
  if [[ $(id -u) != 0 ]]; then echo "SKIP: hiding the CUDA toolkit needs root (unshare -m)"; exit 77; fi
  if ! unshare -m --propagation private true 2>/dev/null; then echo "SKIP: unshare -m is not permitted here"; exit 77; fi
  roots=$(cuda_roots | tr '\n' ' ')
  export SHMPS_CUDA_HIDDEN="${roots:-none}"
  SHMPS_CUDA_STRAYS="$(cuda_strays "$roots" | tr '\n' ' ')"
  export SHMPS_CUDA_STRAYS
  exec unshare -m --propagation private "$script" "$prefix" "$build_dir" --hide-cuda "$@"
fi

toolkit_roots=$(cuda_roots)
if [[ -n ${SHMPS_CUDA_HIDDEN:-} ]]; then
  for d in $SHMPS_CUDA_HIDDEN; do [[ $d == none ]] || mount -t tmpfs -o size=1m,mode=0755 none "$d"; done
  for f in ${SHMPS_CUDA_STRAYS:-}; do mount --bind /dev/null "$f"; done
  mount -t tmpfs -o size=256m,mode=1777 none /dev/shm
  ! nvcc --version >/dev/null 2>&1 || fail "nvcc still runs: $(command -v nvcc)"
  for d in $SHMPS_CUDA_HIDDEN; do [[ $d == none || -z $(ls -A "$d") ]] || fail "$d is not hidden"; done
  for f in ${SHMPS_CUDA_STRAYS:-}; do [[ ! -s $f ]] || fail "$f is not hidden"; done
  echo "ok: CUDA hidden (${SHMPS_CUDA_HIDDEN} ${SHMPS_CUDA_STRAYS:-}), /dev/shm private"
  toolkit_roots=$SHMPS_CUDA_HIDDEN
fi

scratch=$(mktemp -d)
server_pid=
cleanup() {
  if [[ -n $server_pid ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  rm -rf "$scratch"
}
trap cleanup EXIT

# ---- the installed package names no path of the build machine ----
package_files=$(ls -d "$prefix"/lib*/cmake/shmps "$prefix"/lib*/pkgconfig "$prefix"/share/pkgconfig 2>/dev/null || true)
[[ -n $package_files ]] || fail "no CMake package under $prefix/lib*/cmake/shmps"
for p in "$build_dir" "$source_dir" $toolkit_roots; do
  [[ $p == none ]] && continue
  hits=$(grep -rlF "$p" $package_files || true)
  [[ -z $hits ]] || fail "the installed package names $p: $hits"
done
echo "ok: the installed CMake package names no path of the build machine"

# ---- README.md's worker snippet, as printed, inside main() ----
snippet=$scratch/readme_snippet.cpp
awk '/^A worker links/ {f = 1} f && /^```cpp/ {inblock = 1; next} inblock && /^```/ {exit} inblock {print}' \
  "$source_dir/README.md" > "$scratch/snippet.txt"
[[ -s $scratch/snippet.txt ]] || fail "no C++ block after 'A worker links' in README.md"
{ grep '^#include' "$scratch/snippet.txt"; echo 'int main() {'; grep -v '^#include' "$scratch/snippet.txt"; echo '}'; } > "$snippet"

# ---- the consumer and the snippet build against the prefix ----
cmake -S "$source_dir/tests/consumer" -B "$scratch/build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DREADME_SNIPPET="$snippet" "$@" > "$scratch/configure.log" 2>&1 || { cat "$scratch/configure.log"; fail "configure the consumer"; }
cmake --build "$scratch/build" > "$scratch/build.log" 2>&1 || { cat "$scratch/build.log"; fail "build the consumer"; }
echo "ok: consumer and README snippet built against $prefix"
# ... and with pkg-config and a plain compiler, as a Makefile would.
pc_dir=$(dirname "$(ls "$prefix"/lib*/pkgconfig/shmps.pc)")
flags=$(PKG_CONFIG_PATH=$pc_dir pkg-config --cflags --libs shmps) || fail "pkg-config shmps"
c++ -std=c++20 -o "$scratch/consumer_pc" "$source_dir/tests/consumer/main.cpp" $flags ||
  fail "c++ main.cpp $flags"
"$scratch/consumer_pc" > /dev/null || fail "the pkg-config consumer"
echo "ok: pkg-config shmps: $flags"
if [[ -n ${SHMPS_CUDA_HIDDEN:-} ]]; then
  for exe in consumer readme_snippet "$prefix/bin/shmps-server" "$prefix/bin/shmps-inspect"; do
    [[ $exe == /* ]] || exe=$scratch/build/$exe
    ! ldd "$exe" | grep -q 'not found' || fail "$exe: $(ldd "$exe" | grep 'not found')"
  done
  echo "ok: every binary finds its libraries without CUDA"
fi

# ---- the installed server serves the consumer ----
name=consumer_$$
"$prefix/bin/shmps-server" --name "$name" --tensor w:4 --optimizer sgd --lr 1 --backend auto \
  > "$scratch/server.log" 2>&1 &
server_pid=$!
"$scratch/build/consumer" "$name" || { cat "$scratch/server.log"; fail "consumer against $prefix/bin/shmps-server"; }
kill "$server_pid"
wait "$server_pid" || { cat "$scratch/server.log"; fail "the server did not stop cleanly"; }
server_pid=
grep -q 'backend host' "$scratch/server.log" || { cat "$scratch/server.log"; fail "the server did not serve with the host backend"; }

# ---- the README's snippet against the README's server (private /dev/shm only) ----
if [[ -n ${SHMPS_CUDA_HIDDEN:-} ]]; then
  if "$scratch/build/readme_snippet" > "$scratch/snippet.out" 2>&1; then fail "the README snippet succeeded with no server"; fi
  grep -q 'server_not_running' "$scratch/snippet.out" && grep -q 'shmps.job1' "$scratch/snippet.out" ||
    { cat "$scratch/snippet.out"; fail "the README snippet without a server did not say server_not_running for job1"; }
  echo "ok: README snippet without a server: $(grep -o 'server_not_running.*' "$scratch/snippet.out" | head -1)"
  # The README's server command (the lines from "bin/shmps-server --name job1" to the last continuation).
  cmd=$(awk '/bin\/shmps-server --name job1/ {f = 1} f {print} f && !/\\$/ {exit}' "$source_dir/README.md" |
        sed -e 's/\\$//' -e 's/#.*//' | tr '\n' ' ' | sed "s|[^ ]*bin/shmps-server|$prefix/bin/shmps-server|")
  [[ $cmd == *"--name job1"* ]] || fail "no server command for job1 in README.md"
  eval "exec $cmd" > "$scratch/job1.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 100); do [[ -e /dev/shm/shmps.job1 ]] && break; sleep 0.1; done
  "$scratch/build/readme_snippet" > "$scratch/snippet.out" 2>&1 ||
    { cat "$scratch/snippet.out" "$scratch/job1.log"; fail "the README snippet against the README's server"; }
  echo "ok: README snippet against the README's server ($cmd)"
  kill "$server_pid"
  wait "$server_pid" || { cat "$scratch/job1.log"; fail "the README's server did not stop cleanly"; }
  server_pid=
fi
echo "ok: $prefix"
