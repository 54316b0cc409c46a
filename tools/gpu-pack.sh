#!/usr/bin/env bash
# tools/gpu-pack.sh BUILD_DIR [PACK_DIR]: what travels to the GPU machine
# for tools/gpu-check.sh (docs/cuda.md, "GPU check"). Run here, on the
# Debian 12 build host, after a CUDA build (cmake --preset default with
# nvcc found, or --preset cuda). PACK_DIR (default .gpu/ in the checkout,
# git-ignored) then holds:
#   build.tar.xz  the build tree as the registered tests need it: bin/*
#                 stripped of debug info, each with DT_RPATH $ORIGIN/../lib;
#                 lib/, every shared library they load beyond glibc (copied
#                 from this host: ldd gives exactly the closure they load,
#                 transitive ones included, and the files are those of the
#                 installed Debian packages); every CTestTestfile.cmake;
#                 packaging/build-tree/; prefix/, the build's `cmake
#                 --install` of the dev component (headers,
#                 libshmps_worker.a and libshmps_shm.a without debug info,
#                 the CMake package), which gpu-check.sh builds the Python
#                 extension against with that machine's python3;
#                 gpu-pack.manifest
#   manifest.txt  that manifest, readable without unpacking: the build and
#                 source directories the tree was made for (gpu-check.sh
#                 rewrites them in the files listed under rewrite=), the
#                 newest glibc symbol version the tree needs, the commit
#   debs/         Debian 12's .deb files of the development packages a
#                 build needs and their libraries (apt-get download), for
#                 gpu-check.sh's build mode where the prebuilt tree cannot
#                 run; downloaded once, kept on later runs
# DT_RPATH, not RUNPATH: it also applies to the dependencies of the carried
# libraries (libsystemd's libgcrypt, OpenBLAS's libgfortran). Prints the
# sizes and fails when the pack and the working tree together pass 60 MiB,
# so that they fit a copy to the GPU host limited to 64 MiB (docs/cuda.md,
# "A GPU session", steps 1-2). Needs patchelf, binutils, apt-get, xz.
set -euo pipefail
usage="usage: tools/gpu-pack.sh BUILD_DIR [PACK_DIR]"
build=$(cd "${1:?$usage}" && pwd -P)
src=$(cd "$(dirname "$0")/.." && pwd -P)
pack=${2:-$src/.gpu}
fail() { echo "gpu-pack: $*" >&2; exit 1; }
for tool in patchelf strip objdump readelf ldd apt-get dpkg-deb cmake xz; do
  command -v "$tool" >/dev/null || fail "$tool not found (tools/install-deps.sh installs patchelf and xz-utils)"
done
[[ -f $build/CTestTestfile.cmake ]] || fail "$build has no CTestTestfile.cmake: not a configured build tree"
[[ -x $build/bin/shmps-gpu-bench ]] || fail "$build/bin/shmps-gpu-bench missing: not a CUDA build (or not built)"
mkdir -p "$pack"
pack=$(cd "$pack" && pwd -P)

# The Debian packages a build from source needs (CMake, the compilers and
# nvcc come from the GPU machine): Boost's headers, Program_options and
# Test; libsystemd; OpenBLAS (pthread flavour, what libopenblas-dev picks)
# with libgfortran and libquadmath; nlohmann-json; zlib; their runtime libraries and those
# of libsystemd; pkgconf in case that machine has no pkg-config.
debs=(
  libboost1.74-dev libboost-program-options1.74-dev libboost-program-options1.74.0
  libboost-test1.74-dev libboost-test1.74.0
  libsystemd-dev libsystemd0 libcap2 libgcrypt20 libgpg-error0 liblz4-1 liblzma5 libzstd1
  libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0
  nlohmann-json3-dev zlib1g-dev zlib1g
  pkgconf pkgconf-bin libpkgconf3
)

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
tree=$stage/tree
mkdir -p "$tree/bin" "$tree/lib"

# glibc's own objects come from the machine there (they must match its
# dynamic loader); everything else is carried.
is_glibc() {
  case $1 in
    linux-vdso.so.*|ld-linux-x86-64.so.*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*) return 0 ;;
    libresolv.so.*|libutil.so.*|libanl.so.*|libmvec.so.*|libnss_*|libBrokenLocale.so.*) return 0 ;;
  esac
  return 1
}

echo "gpu-pack: binaries from $build/bin"
binaries=()
for f in "$build"/bin/*; do
  [[ -f $f && -x $f ]] || continue
  [[ $(head -c 4 "$f" | tr -d '\0') == $'\x7fELF' ]] || continue
  binaries+=("$(basename "$f")")
  cp "$f" "$tree/bin/"
done
[[ ${#binaries[@]} -gt 0 ]] || fail "no programs in $build/bin"

# Libraries: the non-glibc closure of every program, as ldd resolves it
# here, each under the name the programs ask for (its soname).
declare -A lib_from=()
for b in "${binaries[@]}"; do
  while read -r name arrow path _; do
    [[ $arrow == "=>" ]] || continue
    [[ $path == not ]] && fail "ldd $b: $name not found here"
    is_glibc "$name" && continue
    lib_from[$name]=$(readlink -f "$path")
  done < <(ldd "$build/bin/$b")
done
for name in "${!lib_from[@]}"; do
  cp "${lib_from[$name]}" "$tree/lib/$name"
  chmod u+w "$tree/lib/$name"
  # A carried library with its own RUNPATH would not search the programs'
  # DT_RPATH for its dependencies: point it at its neighbours instead.
  if [[ $(readelf -d "$tree/lib/$name") == *'(RUNPATH)'* ]]; then
    patchelf --force-rpath --set-rpath '$ORIGIN' "$tree/lib/$name"
  fi
done

for b in "${binaries[@]}"; do
  strip --strip-all "$tree/bin/$b"  # the symbol tables too: the pack must stay under 60 MiB
  patchelf --force-rpath --set-rpath '$ORIGIN/../lib' "$tree/bin/$b"
done

# Prove the tree before it travels: every non-glibc library of every
# program resolves into lib/, with no help from LD_LIBRARY_PATH.
for b in "${binaries[@]}"; do
  while read -r name arrow path _; do
    [[ $arrow == "=>" ]] || continue
    is_glibc "$name" && continue
    [[ $(readlink -f "$path") == "$tree/lib/"* ]] || fail "bin/$b: $name resolves to $path, not to the carried lib/"
  done < <(env -u LD_LIBRARY_PATH ldd "$tree/bin/$b")
done
env -u LD_LIBRARY_PATH "$tree/bin/shmps-server" --version >/dev/null || fail "the patched shmps-server does not run here"

# What the registered tests read from the build tree besides bin/: the
# CTest files and the systemd unit written for the build tree's binaries.
rewrite=()
while IFS= read -r f; do
  rel=${f#"$build"/}
  mkdir -p "$tree/$(dirname "$rel")"
  cp "$f" "$tree/$rel"
  rewrite+=("$rel")
done < <(find "$build" -name CTestTestfile.cmake -not -path '*/_deps/*' | sort)
if [[ -d $build/packaging/build-tree ]]; then
  mkdir -p "$tree/packaging"
  cp -r "$build/packaging/build-tree" "$tree/packaging/"
  while IFS= read -r f; do rewrite+=("${f#"$tree"/}"); done < <(find "$tree/packaging/build-tree" -type f | sort)
fi

# The installed shmps (find_package(shmps)) the Python extension builds
# against there: python/CMakeLists.txt on its own needs only this and
# nanobind, not CUDA (the CUDA build's worker library loads the driver at
# run time).
cmake --install "$build" --prefix "$tree/prefix" --component dev > /dev/null || fail "cmake --install $build --component dev failed"
[[ -n $(find "$tree/prefix" -name shmpsConfig.cmake) ]] || fail "cmake --install $build --component dev installed no shmpsConfig.cmake"
find "$tree/prefix" -name '*.a' -exec strip --strip-debug {} +

# The newest glibc symbol version the carried objects need, with and
# without the C++ runtime (libstdc++, libgcc_s), and the newest libstdc++
# versions the others need: where that machine's glibc is too old for the
# carried C++ runtime, gpu-check.sh uses that machine's own instead.
versions() {  # versions PREFIX FILE...: the newest PREFIX_x.y referenced
  local prefix=$1; shift
  for f in "$@"; do objdump -T "$f"; done 2>/dev/null | grep -o "${prefix}_[0-9][0-9.]*" | sed "s/${prefix}_//" |
    sort -uV | tail -1
}
own=()
for f in "$tree"/bin/* "$tree"/lib/*; do
  case ${f##*/} in libstdc++.so.*|libgcc_s.so.*) ;; *) own+=("$f") ;; esac
done
glibc_max=$(versions GLIBC "$tree"/bin/* "$tree"/lib/*)
glibc_own=$(versions GLIBC "${own[@]}")
glibcxx_max=$(versions GLIBCXX "${own[@]}")
cxxabi_max=$(versions CXXABI "${own[@]}")

# The .debs, for build mode: downloaded into PACK_DIR/debs once.
mkdir -p "$pack/debs"
missing=()
for p in "${debs[@]}"; do
  compgen -G "$pack/debs/${p}_*.deb" >/dev/null || missing+=("$p")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "gpu-pack: apt-get download ${missing[*]}"
  (cd "$pack/debs" && apt-get download -q "${missing[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
  for p in "${missing[@]}"; do
    compgen -G "$pack/debs/${p}_*.deb" >/dev/null || fail "apt-get download $p failed"
  done
fi
# The same for the libraries of the .debs, which build mode links.
debs_glibc_max=$(
  scratch=$(mktemp -d)
  for d in "$pack"/debs/*.deb; do
    dpkg-deb --fsys-tarfile "$d" | tar -C "$scratch" -x --wildcards '*.so*' 2>/dev/null || true
  done
  find "$scratch" -name '*.so*' -type f -exec objdump -T {} + 2>/dev/null |
    grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1
  rm -rf "$scratch")

build_rel=
[[ $build == "$src"/* ]] && build_rel=${build#"$src"/}
commit=$(git -C "$src" rev-parse HEAD 2>/dev/null || echo unknown)
dirty=no
[[ -z $(git -C "$src" status --porcelain --untracked-files=no 2>/dev/null) ]] || dirty=yes
{
  echo "# tools/gpu-pack.sh manifest: key=value"
  echo "build_dir=$build"
  echo "source_dir=$src"
  echo "build_rel=$build_rel"
  echo "commit=$commit"
  echo "uncommitted_changes=$dirty"
  echo "made_on=$(. /etc/os-release && echo "$PRETTY_NAME"), glibc $(getconf GNU_LIBC_VERSION | awk '{print $2}')"
  echo "cuda_archs=$(grep -o 'sm_[0-9]*' "$build/build.ninja" 2>/dev/null | sort -u | tr '\n' ' ' | sed 's/ $//')"
  echo "cuda_compiler_version=$(sed -n 's/^set(CMAKE_CUDA_COMPILER_VERSION "\(.*\)")/\1/p' "$build"/CMakeFiles/*/CMakeCUDACompiler.cmake | head -1)"
  echo "glibc_needed=$glibc_max"
  echo "glibc_needed_without_cxx_runtime=$glibc_own"
  echo "glibcxx_needed=$glibcxx_max"
  echo "cxxabi_needed=$cxxabi_max"
  echo "debs_glibc_needed=$debs_glibc_max"
  echo "prefix=prefix"
  echo "binaries=${binaries[*]}"
  echo "libraries=$(printf '%s\n' "${!lib_from[@]}" | sort | tr '\n' ' ' | sed 's/ $//')"
  echo "debs=$(cd "$pack/debs" && ls -- *.deb | tr '\n' ' ' | sed 's/ $//')"
  echo "rewrite=${rewrite[*]}"
} > "$tree/gpu-pack.manifest"
cp "$tree/gpu-pack.manifest" "$pack/manifest.txt"

# xz, not gzip: the tree is half the size (15 against 31 MiB; most of it
# is OpenBLAS and the programs' CUDA fatbins), which keeps the pack and the
# working tree under 60 MiB. gpu-check.sh unpacks it with xz, or with python3's
# tarfile where that machine has no xz.
rm -f "$pack/build.tar.gz"
tar -C "$tree" -cf - . | xz -6 -T2 > "$pack/build.tar.xz.tmp"
mv "$pack/build.tar.xz.tmp" "$pack/build.tar.xz"

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
size_tar=$(stat -c %s "$pack/build.tar.xz")
size_debs=$(cat "$pack"/debs/*.deb | wc -c)
size_tree=$(git -C "$src" ls-files -z -co --exclude-standard | (cd "$src" && xargs -0 stat -c %s 2>/dev/null) |
  awk '{ s += $1 } END { print s + 0 }')
total=$((size_tar + size_debs + size_tree))
echo "gpu-pack: ${#binaries[@]} programs, ${#lib_from[@]} libraries, ${#rewrite[@]} files to rewrite; needs glibc $glibc_max ($glibc_own with that machine's libstdc++ of GLIBCXX_$glibcxx_max; Debian 12's libraries of debs/: $debs_glibc_max)"
echo "gpu-pack: $pack/build.tar.xz $(mib "$size_tar") (unpacked $(du -sh "$tree" | cut -f1)), debs/ $(mib "$size_debs") ($(ls "$pack"/debs/*.deb | wc -l) files), working tree $(mib "$size_tree"): $(mib $total) in all"
[[ $total -le $((60 * 1048576)) ]] || fail "more than 60 MiB would travel (the pack and the working tree must fit a 64 MiB copy)"
echo "gpu-pack: copy the working tree and ${pack#"$src"/}/ to the GPU host (docs/cuda.md, \"A GPU session\", step 2)"
