#!/usr/bin/env bash
# What an operator installs: `cmake --install` into a scratch prefix (the
# unit must point at that prefix), then `cpack -G DEB` and the package's
# files, Depends, and maintainer scripts; the postinst runs against stub
# adduser/getent/install/systemctl and must create the system user shmps.
# Usage: package_deb.sh <build dir>. Exit 77: dpkg-deb or cpack missing.
set -euo pipefail
build=$(cd "$1" && pwd)
for tool in dpkg-deb cpack; do
  if ! command -v $tool >/dev/null; then echo "SKIP: $tool is not installed"; exit 77; fi
done
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

# ---- cmake --install ----
prefix=$scratch/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
for f in bin/shmps-server bin/shmps-inspect include/shmps/worker.hpp include/shmps/status.hpp \
         lib/systemd/system/shmps@.service share/doc/shmps/examples/shmps.conf.example \
         share/doc/shmps/operations.md; do
  [ -e "$prefix/$f" ] || fail "cmake --install: $f missing"
done
ls "$prefix"/lib*/cmake/shmps/shmpsConfig.cmake >/dev/null 2>&1 || fail "cmake --install: shmpsConfig.cmake missing"
ls "$prefix"/lib*/libshmps_worker.* >/dev/null 2>&1 || fail "cmake --install: libshmps_worker missing"
unit=$prefix/lib/systemd/system/shmps@.service
grep -qxF "ExecStart=$prefix/bin/shmps-server --config $prefix/etc/shmps/%i.conf" "$unit" ||
  fail "installed unit's ExecStart does not name the prefix: $(grep ExecStart= "$unit")"
! grep -q '@SHMPS_' "$unit" || fail "unsubstituted @SHMPS_...@ in the installed unit"
echo "ok: cmake --install layout"

# ---- cpack -G DEB ----
(cd "$scratch" && cpack -G DEB --config "$build/CPackConfig.cmake" -B "$scratch/pkg") > "$scratch/cpack.log" 2>&1 ||
  { cat "$scratch/cpack.log"; fail "cpack -G DEB"; }
debs=("$scratch"/pkg/*.deb)
[ -f "${debs[0]}" ] || fail "cpack wrote no .deb"
deb=${debs[0]}
echo "ok: $(basename "$deb")"
dpkg-deb -c "$deb" | awk '{print $NF}' > "$scratch/contents"
for f in ./usr/bin/shmps-server ./usr/bin/shmps-inspect ./usr/include/shmps/worker.hpp \
         ./usr/lib/systemd/system/shmps@.service ./usr/share/doc/shmps/examples/shmps.conf.example \
         ./usr/share/doc/shmps/operations.md; do
  grep -qxF "$f" "$scratch/contents" || fail "the .deb lacks $f"
done
grep -q '^\./usr/lib.*/cmake/shmps/shmpsConfig\.cmake$' "$scratch/contents" || fail "the .deb lacks shmpsConfig.cmake"
grep -q '^\./usr/lib.*/libshmps_worker\.' "$scratch/contents" || fail "the .deb lacks libshmps_worker"
dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/lib/systemd/system/shmps@.service > "$scratch/unit"
grep -qxF 'ExecStart=/usr/bin/shmps-server --config /etc/shmps/%i.conf' "$scratch/unit" ||
  fail "packaged unit's ExecStart: $(grep ExecStart= "$scratch/unit")"
depends=$(dpkg-deb -f "$deb" Depends)
for d in adduser libboost-program-options libsystemd0; do
  grep -q "$d" <<<"$depends" || fail "Depends lacks $d: $depends"
done
[ "$(dpkg-deb -f "$deb" Package)" = shmps ] || fail "package name is not shmps"
echo "ok: contents and Depends ($depends)"

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
printf '#!/bin/sh\nexit 2\n' > "$stubs/getent"   # no such user or group
chmod +x "$stubs"/*
PATH="$stubs:$PATH" sh "$scratch/control/postinst" configure || fail "postinst configure exited $?"
grep -q '^adduser --system --group .*shmps$' "$scratch/calls" || fail "postinst did not create the system user: $(cat "$scratch/calls")"
grep -q '^install -d -m 0755 /etc/shmps$' "$scratch/calls" || fail "postinst did not create /etc/shmps: $(cat "$scratch/calls")"
echo "ok: postinst creates the system user shmps and /etc/shmps"
