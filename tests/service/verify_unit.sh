#!/usr/bin/env bash
# systemd-analyze verify on shmps@.service, as the template and as an
# instance, written for the build tree's binaries (the installed unit names
# /usr/bin/shmps-server, which need not exist here). Any diagnostic fails
# the test: verify exits 0 on unknown keys and bad values, it only prints
# them. A deliberately broken copy must draw diagnostics, or verify's
# silence proves nothing. Then the hardening must stay at exposure <= 2.5
# ("OK") in systemd-analyze security. Last, the unit with the federation
# drop-in (packaging/systemd/federation.conf) applied: no diagnostics, the
# drop-in's settings in force, and its exposure reported.
# Usage: verify_unit.sh <shmps@.service> [federation.conf]. Exit 77:
# systemd-analyze missing.
set -euo pipefail
unit=$1
dropin=${2:-}
if ! command -v systemd-analyze >/dev/null; then
  echo "SKIP: systemd-analyze is not installed (Debian: apt-get install systemd)"
  exit 77
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/good" "$scratch/broken"
cp "$unit" "$scratch/good/shmps@.service"
sed -e 's/^Type=notify$/Type=notify-bogus/' -e 's/^UMask=0007$/UMask=0007\nNoSuchKey=1/' "$unit" > "$scratch/broken/shmps@.service"

verify() {  # prints every diagnostic of verify on $1
  (cd "$scratch" && systemd-analyze verify --man=no "$1" 2>&1) || true
}

broken=$(verify "$scratch/broken/shmps@ci.service")
if ! grep -q "NoSuchKey" <<<"$broken" || ! grep -q "notify-bogus" <<<"$broken"; then
  echo "FAIL: systemd-analyze verify did not flag a broken unit here; got:"
  echo "$broken"
  exit 1
fi

status=0
for name in "shmps@.service" "shmps@ci.service"; do
  out=$(verify "$scratch/good/$name")
  if [ -n "$out" ]; then
    echo "FAIL: systemd-analyze verify $name:"
    echo "$out"
    status=1
  else
    echo "ok: systemd-analyze verify $name"
  fi
done

if systemd-analyze security --help 2>/dev/null | grep -q -- --offline; then
  if ! report=$(cd "$scratch" && systemd-analyze security --offline=true --threshold=25 --no-pager \
                  "$scratch/good/shmps@.service" 2>&1); then
    echo "FAIL: exposure above 2.5; systemd-analyze security says:"
    echo "$report"
    status=1
  else
    echo "ok: $(grep -i 'overall exposure' <<<"$report" || echo 'exposure within 2.5')"
  fi
else
  echo "note: this systemd-analyze has no 'security --offline'; exposure not checked"
fi

if [ -n "$dropin" ]; then
  mkdir -p "$scratch/fed/shmps@.service.d"
  cp "$unit" "$scratch/fed/shmps@.service"
  cp "$dropin" "$scratch/fed/shmps@.service.d/federation.conf"
  # verify reads drop-ins beside the unit: a bogus key in a copy must show.
  printf 'NoSuchFederationKey=1\n' >>"$scratch/fed/shmps@.service.d/federation.conf"
  grep -q "NoSuchFederationKey" <<<"$(verify "$scratch/fed/shmps@ci.service")" ||
    { echo "FAIL: systemd-analyze verify did not read the drop-in beside the unit"; exit 1; }
  cp "$dropin" "$scratch/fed/shmps@.service.d/federation.conf"
  out=$(verify "$scratch/fed/shmps@ci.service")
  if [ -n "$out" ]; then
    echo "FAIL: systemd-analyze verify with the federation drop-in:"
    echo "$out"
    status=1
  else
    echo "ok: systemd-analyze verify with the federation drop-in"
  fi
  if systemd-analyze security --help 2>/dev/null | grep -q -- --offline; then
    report=$(cd "$scratch/fed" && systemd-analyze security --offline=true --no-pager "$scratch/fed/shmps@.service" 2>&1) || true
    # The drop-in is in force: the network is no longer private.
    grep -q "PrivateNetwork=" <<<"$report" && grep -E "PrivateNetwork=" <<<"$report" | grep -q "✗" ||
      { echo "FAIL: the federation drop-in's PrivateNetwork=no is not in force:"; echo "$report"; exit 1; }
    echo "ok: with the federation drop-in, $(grep -i 'overall exposure' <<<"$report")"
  fi
fi
exit $status
