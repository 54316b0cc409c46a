#!/usr/bin/env bash
# What an operator installs: `cmake --install` into a scratch prefix (the
# unit must point at that prefix), then `cpack -G DEB` and the packages
# (shmps, shmps-dev, shmps-dbgsym): their files, Depends, man pages,
# stripping, lintian, the unpacked packages on a host without CUDA
# (tests/consumer/check_prefix.sh), and the maintainer scripts: the
# postinst runs against stub adduser/getent/install/systemctl and must
# create the system user shmps.
# Usage: package_deb.sh <build dir>. Exit 77: dpkg-deb or cpack missing.
set -euo pipefail
build=$(cd "$1" && pwd)
for tool in dpkg-deb cpack; do
  if ! command -v $tool >/dev/null; then echo "SKIP: $tool is not installed"; exit 77; fi
done
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# ---- cmake --install ----
prefix=$scratch/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
for f in bin/shmps-server bin/shmps-inspect include/shmps/worker.hpp include/shmps/status.hpp share/man/man1/shmps-server.1.gz \
         lib/systemd/system/shmps@.service share/shmps/shmps.conf.example \
         share/shmps/federation.conf share/doc/shmps/operations.md; do
  [ -e "$prefix/$f" ] || fail "cmake --install: $f missing"
done
ls "$prefix"/lib*/cmake/shmps/shmpsConfig.cmake >/dev/null 2>&1 || fail "cmake --install: shmpsConfig.cmake missing"
ls "$prefix"/lib*/libshmps_worker.* >/dev/null 2>&1 || fail "cmake --install: libshmps_worker missing"
unit=$prefix/lib/systemd/system/shmps@.service
grep -qxF "ExecStart=$prefix/bin/shmps-server --config $prefix/etc/shmps/%i.conf --name %i" "$unit" ||
  fail "installed unit's ExecStart does not name the prefix: $(grep ExecStart= "$unit")"
! grep -q '@SHMPS_' "$unit" || fail "unsubstituted @SHMPS_...@ in the installed unit"
for bin in "$prefix"/bin/*; do
  b=$(basename "$bin")
  [ -s "$prefix/share/man/man1/$b.1.gz" ] || fail "cmake --install: no man page for $b"
  [ "$("$bin" --version)" = "$b $(sed -n 's/^project(shmps VERSION \([0-9.]*\).*/\1/p' "$(dirname "$0")/../../CMakeLists.txt")" ] ||
    fail "$b --version: $("$bin" --version)"
done
echo "ok: cmake --install layout; a man page and --version for each of: $(ls "$prefix/bin" | tr '\n' ' ')"

# ---- cpack -G DEB: shmps, shmps-dev, shmps-dbgsym ----
(cd "$scratch" && cpack -G DEB --config "$build/CPackConfig.cmake" -B "$scratch/pkg") > "$scratch/cpack.log" 2>&1 ||
  { cat "$scratch/cpack.log"; fail "cpack -G DEB"; }
one() { local f=("$scratch"/pkg/$1); [ -f "${f[0]}" ] || fail "cpack wrote no $1: $(ls "$scratch/pkg")"; echo "${f[0]}"; }
deb=$(one 'shmps_*.deb')
dev=$(one 'shmps-dev_*.deb')
dbgsym=$(one 'shmps-dbgsym_*.ddeb')
echo "ok: $(basename "$deb") $(basename "$dev") $(basename "$dbgsym")"
contents() { dpkg-deb -c "$1" | awk '{print $NF}'; }
contents "$deb" > "$scratch/contents"
for f in ./usr/bin/shmps-server ./usr/bin/shmps-inspect ./usr/lib/systemd/system/shmps@.service \
         ./usr/share/shmps/shmps.conf.example ./usr/share/shmps/federation.conf \
         ./usr/share/doc/shmps/operations.md \
         ./usr/share/doc/shmps/copyright ./usr/share/doc/shmps/changelog.Debian.gz; do
  grep -qxF "$f" "$scratch/contents" || fail "shmps lacks $f"
done
! grep -q '^\./usr/include\|\.a$\|/cmake/' "$scratch/contents" || fail "shmps holds development files: $(grep '^\./usr/include\|\.a$\|/cmake/' "$scratch/contents")"
contents "$dev" > "$scratch/dev-contents"
for f in ./usr/include/shmps/worker.hpp ./usr/include/shmps/status.hpp ./usr/share/doc/shmps-dev/copyright \
         ./usr/share/doc/shmps-dev/changelog.Debian.gz; do
  grep -qxF "$f" "$scratch/dev-contents" || fail "shmps-dev lacks $f"
done
for re in '/cmake/shmps/shmpsConfig\.cmake$' '/libshmps_worker\.a$' '/libshmps_shm\.a$' '/libshmps_base\.a$' '/pkgconfig/shmps\.pc$'; do
  grep -q "$re" "$scratch/dev-contents" || fail "shmps-dev lacks $re"
done
# Internal headers stay internal (cli.hpp wraps Program_options; the layout,
# ring and segment are the server's and the library's business).
headers=$(grep '^\./usr/include/.*\.hpp$' "$scratch/dev-contents" | sort | tr '\n' ' ')
[ "$headers" = "./usr/include/shmps/server_process.hpp ./usr/include/shmps/server_stats.hpp ./usr/include/shmps/status.hpp ./usr/include/shmps/worker.hpp " ] ||
  fail "shmps-dev installs other headers than the worker's public API: $headers"
dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/lib/systemd/system/shmps@.service > "$scratch/unit"
grep -qxF 'ExecStart=/usr/bin/shmps-server --config /etc/shmps/%i.conf --name %i' "$scratch/unit" ||
  fail "packaged unit's ExecStart: $(grep ExecStart= "$scratch/unit")"
depends=$(dpkg-deb -f "$deb" Depends)
for d in adduser libboost-program-options libsystemd0; do
  grep -q "$d" <<<"$depends" || fail "Depends lacks $d: $depends"
done
! grep -qi cuda <<<"$depends" || fail "Depends names CUDA: $depends"
! grep -qi mpi <<<"$depends" || fail "Depends names an MPI library: $depends"
! grep -qi gloo <<<"$depends" || fail "Depends names Gloo: $depends"
! grep -q 'libshmps_fed_' "$scratch/contents" || fail "shmps holds a federation plugin (shmps-mpi's or shmps-gloo's)"
# Each federation engine, where the build has it: its own package, on shmps.
for engine in mpi gloo; do
  [ -f "$build/lib/shmps/libshmps_fed_$engine.so" ] || continue
  pkg=$(one "shmps-${engine}_*.deb")
  contents "$pkg" | grep -q "/lib/shmps/libshmps_fed_$engine\\.so\$" || fail "shmps-$engine lacks the plugin"
  grep -q '^shmps (= ' <<<"$(dpkg-deb -f "$pkg" Depends)" || fail "shmps-$engine does not depend on shmps"
  echo "ok: shmps-$engine ($(dpkg-deb -f "$pkg" Depends))"
done
# The steps of README.md and docs/operations.md copy the example from the
# package, outside /usr/share/doc (minimal images' path-exclude drops it).
docs="$(dirname "$0")/../../README.md $(dirname "$0")/../../docs/operations.md"
for path in $(grep -ho '/usr/share/[^ ]*shmps\.conf\.example' $docs | sort -u); do
  grep -qxF ".$path" "$scratch/contents" || fail "the docs copy $path, which shmps does not install"
  case $path in /usr/share/doc/*) fail "the docs copy $path, which minimal images drop" ;; esac
done
# docs/operations.md's table says what shmps-dev holds: every header, static
# library and CMake target it installs.
dev_row=$(grep '^| `shmps-dev` |' "$(dirname "$0")/../../docs/operations.md")
dev_targets=$(dpkg-deb --fsys-tarfile "$dev" | tar -xO --wildcards './usr/lib*/cmake/shmps/shmpsTargets.cmake' |
              sed -n 's/^add_library(\(shmps::[a-z_]*\) .*/\1/p')
[ -n "$dev_targets" ] || fail "no targets in shmps-dev's shmpsTargets.cmake"
for item in $(grep -o 'shmps/[a-z_]*\.hpp$\|lib[a-z_]*\.a$' "$scratch/dev-contents") $dev_targets; do
  grep -qF "\`$item\`" <<<"$dev_row" || fail "docs/operations.md's shmps-dev row does not name $item"
done
echo "ok: the docs' example path is in shmps, outside /usr/share/doc; the shmps-dev row names $(tr '\n' ' ' <<<"$dev_targets")and every header and library"
[ "$(dpkg-deb -f "$deb" Package)" = shmps ] || fail "package name is not shmps"
[ "$(dpkg-deb -f "$dev" Package)" = shmps-dev ] || fail "package name is not shmps-dev"
echo "ok: contents and Depends ($depends)"

# ---- unpacked: stripped, a man page and --version for every program ----
root=$scratch/root
for p in "$deb" "$dev"; do dpkg-deb -x "$p" "$root"; done
for bin in "$root"/usr/bin/*; do
  b=$(basename "$bin")
  file "$bin" | grep -q ', stripped' || fail "$b is not stripped"
  [ -s "$root/usr/share/man/man1/$b.1.gz" ] || fail "no man page for $b"
  [ "$("$bin" --version)" = "$b $(dpkg-deb -f "$deb" Version | sed 's/-[^-]*$//')" ] || fail "$b --version: $("$bin" --version)"
  zcat "$root/usr/share/man/man1/$b.1.gz" | grep -q '^\.SH OPTIONS\|^\.SH DESCRIPTION' || fail "$b's man page has no options"
done
readelf -S "$root"/usr/lib/libshmps_worker.a | grep -q debug_info && fail "libshmps_worker.a carries debug info"
contents "$dbgsym" > "$scratch/dbgsym-contents"
grep -q "/usr/lib/debug/\\.build-id/.*\\.debug$" "$scratch/dbgsym-contents" || fail "shmps-dbgsym holds no debug info"
echo "ok: stripped (debug info in shmps-dbgsym), a man page and --version for each of: $(ls "$root/usr/bin" | tr '\n' ' ')"

# ---- lintian: no errors (docs/operations.md lists the warnings left) ----
if command -v lintian > /dev/null; then
  lintian --fail-on error "$deb" "$dev" > "$scratch/lintian.log" 2>&1 ||
    { cat "$scratch/lintian.log"; fail "lintian reports errors"; }
  echo "ok: lintian: no errors ($(grep -c '^W:' "$scratch/lintian.log" || true) warnings: $(grep '^W:' "$scratch/lintian.log" | awk '{print $3}' | sort -u | tr '\n' ' '))"
else
  echo "lintian not installed: not run"
fi

# ---- the unpacked packages on a host without CUDA (root: hidden; else as is) ----
hide=()
[ "$(id -u)" = 0 ] && unshare -m --propagation private true 2>/dev/null && hide=(--hide-cuda)
"$(dirname "$0")/../consumer/check_prefix.sh" "$root/usr" "$build" "${hide[@]}" || fail "the unpacked packages"

# ---- maintainer scripts ----
dpkg-deb -e "$deb" "$scratch/control"
for s in postinst prerm postrm; do
  [ -x "$scratch/control/$s" ] || fail "$s missing or not executable"
  sh -n "$scratch/control/$s" || fail "$s: syntax"
done
# The postinst on a host without the user: stubs record what it runs.
stubs=$scratch/stubs
mkdir "$stubs"
for cmd in adduser addgroup install systemctl; do
  printf '#!/bin/sh\necho "%s $*" >> "%s/calls"\n' "$cmd" "$scratch" > "$stubs/$cmd"
done
# No such user or group, but for the groups video (Debian's base-passwd
# has it) and mlteam (one an admin made, below: the service user's).
printf '#!/bin/sh\ncase "$1 $2" in "group video"|"group mlteam") exit 0;; esac\nexit 2\n' > "$stubs/getent"
chmod +x "$stubs"/*
PATH="$stubs:$PATH" sh "$scratch/control/postinst" configure || fail "postinst configure exited $?"
grep -q '^adduser --system --group .*shmps$' "$scratch/calls" || fail "postinst did not create the system user: $(cat "$scratch/calls")"
# Each folder only where it is missing (an existing one keeps its mode:
# systemd_unit.sh checks that on a real install).
[ -d /etc/shmps ] || grep -q '^install -d -m 0755 /etc/shmps$' "$scratch/calls" ||
  fail "postinst did not create /etc/shmps: $(cat "$scratch/calls")"
[ -d /var/lib/shmps ] || grep -q '^install -d -m 0750 -o shmps -g shmps /var/lib/shmps$' "$scratch/calls" ||
  fail "postinst did not create /var/lib/shmps: $(cat "$scratch/calls")"
echo "ok: postinst creates the system user shmps, /etc/shmps and /var/lib/shmps"
# It checks each instance's config with this version's shmps-server (as
# the service user: runuser, stubbed to run the command as is) and names
# one it refuses; with the unit's --name <instance>, so that a copy of
# another instance's file (copied.conf, name = good) is named with the line
# that the instance name overrides.
confs=$scratch/confs
mkdir "$confs"
printf 'name = good\ntensor = w:4\n' > "$confs/good.conf"
printf 'name = bad\ntensor = w:4\ninit-seed = 3\n' > "$confs/bad.conf"
printf 'name = good\ntensor = w:4\n' > "$confs/copied.conf"
printf '#!/bin/sh\necho "$*" >> "%s"\nwhile [ "$1" != -- ]; do shift; done\nshift\nexec "$@"\n' \
  "$scratch/runuser-calls" > "$stubs/runuser"
chmod +x "$stubs/runuser"
# The service user's groups: shmps and mlteam (one an admin added).
printf '#!/bin/sh\n[ "$1 $2" = "-Gn shmps" ] && echo shmps mlteam && exit 0\nexec /usr/bin/id "$@"\n' > "$stubs/id"
chmod +x "$stubs/id"
out=$(PATH="$stubs:$build/bin:$PATH" SHMPS_CONFIG_DIR="$confs" sh "$scratch/control/postinst" configure 2>&1) ||
  fail "postinst configure exited $? with configs: $out"
printf '%s\n' "$out" | grep -qF "shmps: $confs/bad.conf does not pass this version's --check-config" ||
  fail "postinst did not name the refused config: $out"
printf '%s\n' "$out" | grep -qF "does not use init-seed" || fail "postinst did not show why: $out"
printf '%s\n' "$out" | grep -qF "good.conf" && fail "postinst named a config that passes: $out"
# As the unit runs it: group shmps, the user's groups (id, stubbed: shmps
# is in mlteam, above) and video (SupplementaryGroups=).
groups="-g shmps -G mlteam -G video"
grep -qvF -- "-u shmps $groups -- shmps-server" "$scratch/runuser-calls" &&
  fail "postinst ran a check other than as the unit runs the server: $(cat "$scratch/runuser-calls")"
grep -qF -- "-u shmps $groups -- shmps-server" "$scratch/runuser-calls" ||
  fail "postinst ran no check as the service user"
printf '%s\n' "$out" | grep -qF "shmps: $confs/copied.conf, as shmps@copied reads it:" ||
  fail "postinst did not name copied.conf, whose name is another instance's: $out"
printf '%s\n' "$out" | grep -qF "copied.conf line 1: key 'name' = good is not used: the command line's --name wins" ||
  fail "postinst did not show copied.conf's overridden name: $out"
echo "ok: postinst names an instance config this version refuses, and one whose name the instance's overrides"
