#!/usr/bin/env bash
# shmps@.service under a real systemd, as README.md and docs/operations.md
# promise it to an operator: a Debian root bootstrapped with mmdebstrap
# (systemd plus the package's Depends) is booted with systemd-nspawn, the
# runtime .deb installed in it with dpkg -i, /etc/shmps/job1.conf written
# from the packaged example (a small model, checkpoints), then
#   enable --now        returns with the segment live: a worker attaches at once
#   status              shows the server's STATUS= line
#   group shmps         a user in it attaches, one outside it is refused
#   reload              lr changes (journal line, shmps-inspect, a push's step)
#   SIGSTOP             the watchdog kills the server, systemd restarts it, it
#                       restores its checkpoint, a reconnecting worker carries on
#   stop                final checkpoint written, segment removed, exit 0
#   journal             each checked line at its priority (info, warning, err)
# and the package's maintainer scripts and its unit around them:
#   install             a config written before it (checkpoint-dir under
#                       /var/lib/shmps) passes the postinst's check, and
#                       `--check-config` as user shmps passes before the first start
#   a copied config     job1.conf copied as job2.conf (name = job1) serves
#                       job2 under shmps@job2, next to job1, with a warning
#   reinstall, upgrade  the postinst keeps /etc/shmps's mode, names the running
#                       instances (an activating one too), the version they
#                       still run only on an upgrade, and what a restart does
#   remove, purge       remove keeps the instance enabled; purge disables it
#                       (its links go, an admin's own shmps@ link stays), keeps
#                       the config and the checkpoints; a reinstall enables nothing
# A drop-in shortens WatchdogSec to 3 s, so the restart takes seconds.
# Usage: systemd_unit.sh <build dir> <shmps-service-worker binary>
# Exit 77 (skipped, with the reason): not root, a tool missing, no Debian
# mirror to bootstrap from, or a container that does not boot.
#
# The bootstrapped root is cached in <build dir>/systemd-root/<key>/root,
# keyed by the release, the package list and the host's apt sources. It is
# never written to: the container boots it with --volatile=overlay (writes
# go to a tmpfs that ends with the container), under a shared lock that a
# run bootstrapping another key (and deleting the old one) waits for. The
# container runs in a cgroup of its own under this script's: without one,
# systemd-nspawn puts its payload/ and supervisor/ cgroups beside the
# caller and leaves them there. A detached reaper kills the container and
# removes the cgroups and nspawn's files if this script dies without its
# trap (systemd-nspawn killed by SIGKILL leaves its container running).
set -euo pipefail
export LC_ALL=C
skipped=0
skip() { echo "SKIP: $*"; skipped=1; exit 77; }

[ $# -eq 2 ] || { echo "usage: $0 <build dir> <shmps-service-worker>"; exit 2; }
build=$(cd "$1" && pwd)
worker_bin=$2
[ "$(id -u)" -eq 0 ] || skip "needs root (systemd-nspawn boots a container); run as root to test the unit under systemd"
for tool in systemd-nspawn mmdebstrap nsenter setsid flock findmnt dpkg dpkg-deb cpack sha256sum timeout; do
  command -v $tool >/dev/null ||
    skip "$tool is not installed (tools/install-deps.sh installs systemd-container, mmdebstrap, util-linux, dpkg-dev)"
done
[ -x "$worker_bin" ] || { echo "FAIL: no worker binary $worker_bin"; exit 1; }
suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ -n "$suite" ] || skip "/etc/os-release names no release (VERSION_CODENAME) to bootstrap"

cache=$build/systemd-root
mkdir -p "$cache"
scratch=$(mktemp -d "$cache/run.XXXXXX")
share=$scratch/share          # the container's /srv/shmps-test, read-only
mkdir "$share"
chmod 0755 "$scratch" "$share"
machine=shmps-test-$$
root=
nspawn_pid=
reaper_pid=
ct_pid1=
cgroups=()
created_run_dirs=()

# ---- teardown: also run by the reaper, so it uses nothing but these variables ----
teardown() {
  local cg f pid alive
  # Every process of the container is in our cgroups; nsenter'd ones are in
  # its PID namespace and die with its PID 1.
  for _ in $(seq 50); do
    alive=0
    for cg in "${cgroups[@]}"; do
      for f in $(find "$cg" -name cgroup.procs 2>/dev/null); do
        for pid in $(cat "$f" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null && alive=1; done
      done
    done
    # By pid too, for a run without a cgroup of its own; the name guards against a reused pid.
    [ -n "$nspawn_pid" ] && [ "$(cat /proc/$nspawn_pid/comm 2>/dev/null)" = systemd-nspawn ] &&
      kill -KILL "$nspawn_pid" 2>/dev/null && alive=1
    [ -n "$ct_pid1" ] && [ "$(cat /proc/$ct_pid1/comm 2>/dev/null)" = systemd ] &&
      kill -KILL "$ct_pid1" 2>/dev/null && alive=1
    [ $alive -eq 0 ] && break
    sleep 0.2
  done
  for cg in "${cgroups[@]}"; do find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null; done
  # What nspawn removes itself when it is not killed: its lock on the root, its propagation directory.
  [ -n "$root" ] && [ -d "$root" ] && rm -f "/run/systemd/nspawn/locks/inode-$(stat -c %d:%i "$root")"
  rmdir "/run/systemd/nspawn/propagate/$machine" 2>/dev/null
  for d in "${created_run_dirs[@]}"; do find "$d" -depth -type d -empty -delete 2>/dev/null; done
  rm -rf --one-file-system "$scratch"
}

# No consumer in a pipeline stops reading early (head, grep -q, awk's exit):
# its producer would die of SIGPIPE, and pipefail would fail the pipeline.
first_child() {  # first_child PID: the first child process of PID, or nothing
  local children
  children=$(cat /proc/"$1"/task/*/children 2>/dev/null || true)
  echo "${children%% *}"
}
ct_t() {  # ct_t SECONDS command...: a command in the container, as root, in a clean environment
  local limit=$1
  shift
  timeout "$limit" nsenter -t "$ct_pid1" -a env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LC_ALL=C "$@"
}
ct() { ct_t 60 "$@"; }
as_user() {  # as_user USER command...: in the container, as USER with its groups
  local user=$1
  shift
  ct setpriv --reuid="$user" --regid="$user" --init-groups -- "$@"
}
unit=shmps@job1
conf=/etc/shmps/job1.conf
journal() { ct journalctl -u $unit --no-pager "$@"; }

on_exit() {
  local status=$?
  set +e
  trap - ERR
  [ $status -eq 77 ] && [ $skipped -eq 0 ] && status=1   # a command's own 77 is no skip
  if [ $status -ne 0 ] && [ $status -ne 77 ] && [ -n "$ct_pid1" ] && kill -0 "$ct_pid1" 2>/dev/null; then
    echo "---- systemctl status $unit"
    ct systemctl status --no-pager -l -n 0 $unit 2>&1
    echo "---- journalctl -u $unit (last 60)"
    journal -n 60 -o short-monotonic 2>&1
    echo "---- $conf"
    ct cat $conf 2>&1 | grep -v '^#' | grep .
    for f in attach.log bob.log train.log; do
      [ -f "$scratch/$f" ] && { echo "---- $f"; cat "$scratch/$f"; }
    done
    echo "---- container console (last 10)"
    tail -n 10 "$scratch/console.log"
  fi
  if [ -n "$ct_pid1" ] && kill -0 "$ct_pid1" 2>/dev/null; then
    timeout 10 nsenter -t "$ct_pid1" -a systemctl poweroff >/dev/null 2>&1
    for _ in $(seq 100); do kill -0 "$nspawn_pid" 2>/dev/null || break; sleep 0.1; done
  fi
  [ -n "$reaper_pid" ] && kill "$reaper_pid" 2>/dev/null
  teardown
  exit $status
}
trap on_exit EXIT
trap 'exit 143' TERM INT HUP
# A command that fails unchecked names itself (set -e would end the test silently).
set -E
trap 'echo "FAIL: \"$BASH_COMMAND\" exited $? (line $LINENO${FUNCNAME:+, called from lines ${BASH_LINENO[*]}})"' ERR
fail() {
  echo "FAIL: $*"
  exit 1
}
t0=$SECONDS
step() { echo "[$((SECONDS - t0)) s] $*"; }
wait_for() {  # wait_for SECONDS DESCRIPTION command...: polls every 0.2 s, fails with DESCRIPTION
  local limit=$1 what=$2
  shift 2
  local deadline=$((SECONDS + limit))
  until "$@"; do
    [ $SECONDS -lt $deadline ] || fail "after ${limit} s: $what"
    sleep 0.2
  done
}
journal_has() {  # journal_has PRIORITY TEXT: a line of the unit containing TEXT at exactly that priority
  journal -p "$1..$1" -o cat | grep -F -- "$2" > /dev/null
}

# ---- the runtime package: shmps_<version>_<arch>.deb, not -dev or -dbgsym ----
step "cpack -G DEB"
(cd "$scratch" && timeout 300 cpack -G DEB --config "$build/CPackConfig.cmake" -B "$scratch/pkg") > "$scratch/cpack.log" 2>&1 ||
  { cat "$scratch/cpack.log"; fail "cpack -G DEB"; }
arch=$(dpkg --print-architecture)
debs=()
for f in "$scratch"/pkg/shmps_*_"$arch".deb; do
  case $(basename "$f") in *-dev*|*-dbgsym*) ;; *) [ -f "$f" ] && debs+=("$f") ;; esac
done
[ ${#debs[@]} -eq 1 ] || fail "expected one runtime package shmps_*_$arch.deb, got: $(ls "$scratch/pkg")"
deb=${debs[0]}
cp "$deb" "$worker_bin" "$share/"
printf '[Service]\nWatchdogSec=3s\n' > "$share/watchdog.conf"
# The same package as a later version, for the upgrade's postinst.
version=$(dpkg-deb -f "$deb" Version)
next_version=$version+next
dpkg-deb -R "$deb" "$scratch/next"
sed -i "s/^Version: .*/Version: $next_version/" "$scratch/next/DEBIAN/control"
dpkg-deb -b "$scratch/next" "$share/next.deb" > /dev/null
rm -rf "$scratch/next"
# An instance that stays activating with its process running (a server
# still restoring a large checkpoint): never READY=1.
printf '[Service]\nExecStart=\nExecStart=/bin/sleep 120\n' > "$share/activating.conf"

# ---- the root: systemd plus the package's dependencies (first alternatives) ----
packages=$( { echo systemd; echo systemd-sysv; echo dbus
              dpkg-deb -f "$deb" Pre-Depends Depends | sed -E 's/^[A-Za-z-]+: //' | tr ',' '\n' |
                sed -E 's/\|.*//; s/\(.*\)//; s/:any//; s/[[:space:]]//g'; } | grep . | sort -u | paste -sd, -)
sources=()
[ -s /etc/apt/sources.list ] && sources+=(/etc/apt/sources.list)
for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do [ -f "$f" ] && sources+=("$f"); done
key=$( { echo "mmdebstrap --variant=minbase $suite $packages"; cat "${sources[@]}" /dev/null; } | sha256sum | cut -c1-16)
# fd 9: exclusive while bootstrapping (and deleting other keys' roots),
# shared while a container uses the root; held until this script and
# systemd-nspawn (which inherits it) are gone.
exec 9> "$cache/lock"
flock -w 240 -x 9 || fail "another run held $cache/lock for 240 s"
if [ ! -f "$cache/$key/complete" ]; then
  step "mmdebstrap $suite (packages $packages), cached in $cache/$key"
  find "$cache" -mindepth 1 -maxdepth 1 -type d ! -name 'run.*' -exec rm -rf --one-file-system {} +
  mkdir -p "$cache/$key"
  if ! timeout 300 mmdebstrap --variant=minbase --include="$packages" "$suite" "$cache/$key/root.tmp" \
         "${sources[@]}" > "$cache/$key/mmdebstrap.log" 2>&1; then
    tail -n 15 "$cache/$key/mmdebstrap.log"
    if grep -qiE "resolv|failed to fetch|connect|network|unreachable|timed out" "$cache/$key/mmdebstrap.log"; then
      rm -rf --one-file-system "$cache/$key"
      skip "mmdebstrap could not reach the Debian mirror (its log above)"
    fi
    rm -rf --one-file-system "$cache/$key/root.tmp"
    fail "mmdebstrap failed (log: $cache/$key/mmdebstrap.log)"
  fi
  mv "$cache/$key/root.tmp" "$cache/$key/root"
  touch "$cache/$key/complete"
fi
flock -s 9
root=$cache/$key/root

# ---- boot, in a cgroup of its own, with a reaper in case this script is killed ----
for mnt in $(findmnt -rn -t cgroup2 -o TARGET) $(findmnt -rn -t cgroup -O name=systemd -o TARGET); do
  if [ "$(findmnt -rn -o FSTYPE "$mnt")" = cgroup2 ]; then
    rel=$(sed -n 's/^0:://p' /proc/self/cgroup)
  else
    rel=$(sed -n 's/^[0-9]*:name=systemd://p' /proc/self/cgroup)
  fi
  [ -n "$rel" ] && mkdir "$mnt${rel%/}/$machine" 2>/dev/null && cgroups+=("$mnt${rel%/}/$machine")
done
[ ${#cgroups[@]} -gt 0 ] || echo "note: no cgroup of its own for the container (cgroup file system not writable)"
for d in /run/systemd/nspawn /run/systemd; do [ -d "$d" ] || created_run_dirs+=("$d"); done
step "boot (systemd-nspawn, machine $machine)"
(
  for cg in "${cgroups[@]}"; do echo "$BASHPID" > "$cg/cgroup.procs"; done
  exec systemd-nspawn -q -D "$root" -M "$machine" --volatile=overlay --bind-ro="$share:/srv/shmps-test" \
    -b --private-network --register=no --keep-unit --console=read-only
) > "$scratch/console.log" 2>&1 < /dev/null &
nspawn_pid=$!
# The reaper: once this script is gone (or after 10 minutes), tear down.
reaper=$(declare -p scratch root machine nspawn_pid cgroups created_run_dirs; declare -f teardown first_child)
setsid bash -c "$reaper"'
  for _ in $(seq 600); do kill -0 '"$$"' 2>/dev/null || break; sleep 1; done
  ct_pid1=$(first_child $nspawn_pid)
  teardown' > /dev/null 2>&1 < /dev/null 9>&- &
reaper_pid=$!

booted=
for _ in $(seq 300); do
  kill -0 $nspawn_pid 2>/dev/null || break
  pid=$(first_child $nspawn_pid)
  if [ -n "$pid" ] && [ "$(cat /proc/$pid/comm 2>/dev/null)" = systemd ]; then
    ct_pid1=$pid
    state=$(ct_t 5 systemctl is-system-running 2>/dev/null || true)
    case $state in running|degraded) booted=$state; break ;; esac
  fi
  sleep 0.2
done
if [ -z "$booted" ]; then
  tail -n 20 "$scratch/console.log"
  kill -0 $nspawn_pid 2>/dev/null || skip "systemd-nspawn exited before the container booted (its output above)"
  skip "the container did not boot within 60 s (its console above)"
fi
[ "$booted" = running ] || echo "note: the container is $booted: $(ct systemctl --failed --no-legend --plain | tr '\n' ' ')"
step "booted: PID 1 is $ct_pid1 on the host, $(ct systemctl --version | sed -n 1p)"

# ---- install, users, the config ----
# A config written before the install (configuration management), its
# checkpoint-dir under the StateDirectory that no start has created yet:
# the postinst's check, as user shmps, must pass it.
ct mkdir /etc/shmps
ct sh -c 'printf "name = pre\ntensor = w:4\ncheckpoint-dir = /var/lib/shmps/pre\n" > /etc/shmps/pre.conf'
ct dpkg -i "/srv/shmps-test/$(basename "$deb")" > "$scratch/dpkg.log" 2>&1 || { cat "$scratch/dpkg.log"; fail "dpkg -i"; }
! grep '^shmps: ' "$scratch/dpkg.log" ||
  fail "the postinst reported a config written before the install: $(cat "$scratch/dpkg.log")"
state_dir=$(ct stat -c '%A %U %G' /var/lib/shmps)
[ "$state_dir" = "drwxr-x--- shmps shmps" ] || fail "/var/lib/shmps after the install: '$state_dir'"
ct rm /etc/shmps/pre.conf
uid=$(ct getent passwd shmps | cut -d: -f3)
[ -n "$uid" ] && [ "$uid" -lt 1000 ] || fail "the package did not create a system user shmps: uid '$uid'"
ct install -m 0755 "/srv/shmps-test/$(basename "$worker_bin")" /usr/local/bin/shmps-service-worker
step "installed $(basename "$deb"); system user shmps (uid $uid)"
# The package's Depends must bring every library its programs load (the
# root holds nothing else): nothing of CUDA, which the server links
# statically.
programs="$(ct dpkg -L "$(dpkg-deb -f "$deb" Package)" | grep '^/usr/bin/shmps-' | tr '\n' ' ') /usr/local/bin/shmps-service-worker"
missing=$(ct sh -c "ldd $programs || true" | grep 'not found' || true)
[ -z "$missing" ] || fail "libraries the package's Depends do not bring: $missing"
ct useradd --no-create-home --groups shmps alice
ct useradd --no-create-home bob

# As README.md: the example, a small model, checkpoints under the StateDirectory.
ct cp /usr/share/shmps/shmps.conf.example $conf
ct sed -i -e '/^tensor = /d' -e 's/^name = .*/name = job1/' \
  -e 's|^# checkpoint-dir = .*|checkpoint-dir = /var/lib/shmps/job1|' \
  -e 's/^# checkpoint-every = .*/checkpoint-every = 500/' -e '$a tensor = w:64x64\ntensor = b:64' $conf
for line in 'name = job1' 'lr = 0.001' 'group-access = true' 'checkpoint-dir = /var/lib/shmps/job1' \
            'checkpoint-every = 500' '# max-workers = 16' 'tensor = w:64x64' 'tensor = b:64'; do
  ct grep -qxF "$line" $conf || fail "job1.conf from the example lacks '$line' (the example changed?)"
done
ct shmps-server --config $conf --check-config > /dev/null || fail "--check-config refused job1.conf"
# As docs/operations.md advises, with the service's permissions, before the first start.
as_user shmps shmps-server --config $conf --check-config > /dev/null 2> "$scratch/check.log" ||
  fail "--check-config as user shmps refused job1.conf before the first start: $(cat "$scratch/check.log")"
ct mkdir -p /etc/systemd/system/$unit.service.d
ct cp /srv/shmps-test/watchdog.conf /etc/systemd/system/$unit.service.d/test-watchdog.conf
ct systemctl daemon-reload

# ---- enable --now: returns once the segment is live ----
step "systemctl enable --now $unit"
ct systemctl enable --now $unit 2>&1 || fail "systemctl enable --now $unit"
ct test -e /dev/shm/shmps.job1 || fail "enable --now returned before /dev/shm/shmps.job1 existed"
as_user alice shmps-service-worker attach job1 > "$scratch/attach.log" 2>&1 ||
  fail "alice (group shmps) could not attach right after enable --now: $(cat "$scratch/attach.log")"
grep -q 'step -0.001$' "$scratch/attach.log" || fail "the first push did not step by -lr (0.001): $(cat "$scratch/attach.log")"
mode=$(ct stat -c '%A %U %G' /dev/shm/shmps.job1)
[ "$mode" = "-rw-rw---- shmps shmps" ] || fail "segment mode/owner: $mode"
[ "$(ct systemctl is-enabled $unit)" = enabled ] || fail "$unit is not enabled"
[ "$(ct systemctl show -p WatchdogUSec --value $unit)" = 3s ] ||
  fail "the drop-in did not set WatchdogSec=3s: $(ct systemctl show -p WatchdogUSec $unit)"
if as_user bob shmps-service-worker attach job1 > "$scratch/bob.log" 2>&1 ||
   ! grep -q 'permission' "$scratch/bob.log"; then
  fail "bob (not in group shmps) was not refused with kPermission: $(cat "$scratch/bob.log")"
fi
step "segment live at once ($mode); alice attached: $(tail -n1 "$scratch/attach.log"); bob refused"

# ---- a copy of job1.conf (name = job1) as shmps@job2: serves job2, job1 untouched ----
job1_pid=$(ct systemctl show -p MainPID --value $unit)
ct cp $conf /etc/shmps/job2.conf
ct sed -i 's|^checkpoint-dir = .*|checkpoint-dir = /var/lib/shmps/job2|' /etc/shmps/job2.conf
ct systemctl start shmps@job2 || fail "shmps@job2, from a copy of job1.conf, did not start: $(ct journalctl -u shmps@job2 --no-pager -n 20 -o cat)"
ct test -e /dev/shm/shmps.job2 || fail "shmps@job2 does not serve /dev/shm/shmps.job2"
[ "$(ct systemctl show -p MainPID --value $unit)" = "$job1_pid" ] || fail "job1's server changed under shmps@job2"
ct shmps-inspect job1 | grep -E "^ *server +pid $job1_pid " > /dev/null || fail "job1's segment is not job1's server's: $(ct shmps-inspect job1)"
ct journalctl -u shmps@job2 -p warning..warning -o cat --no-pager |
  grep -F "config file /etc/shmps/job2.conf line $(ct grep -n '^name = ' /etc/shmps/job2.conf | cut -d: -f1): key 'name' = job1 is not used: the command line's --name wins" > /dev/null ||
  fail "no warning of job2.conf's name: $(ct journalctl -u shmps@job2 --no-pager -o cat)"
! journal -p warning..warning -o cat | grep -F "key 'name'" > /dev/null || fail "job1, whose file sets its own name, warns of it"
ct systemctl stop shmps@job2
ct rm /etc/shmps/job2.conf
step "a copy of job1.conf started as shmps@job2 served job2 (name overridden, warned of); job1 untouched"

# ---- reinstall, upgrade: /etc/shmps keeps its mode; the running instances named ----
# An admin's choice the package must keep: the configs readable by the service only.
ct chgrp shmps /etc/shmps
ct chmod 0750 /etc/shmps
ct mkdir -p /etc/systemd/system/shmps@slow.service.d
ct cp /srv/shmps-test/activating.conf /etc/systemd/system/shmps@slow.service.d/activating.conf
ct systemctl daemon-reload
ct systemctl start --no-block shmps@slow
slow_activating() { [ "$(ct systemctl is-active shmps@slow || true)" = activating ]; }
wait_for 10 "shmps@slow is not activating" slow_activating
ct dpkg -i "/srv/shmps-test/$(basename "$deb")" > "$scratch/dpkg.log" 2>&1 || { cat "$scratch/dpkg.log"; fail "dpkg -i (reinstall)"; }
[ "$(ct stat -c '%a %U %G' /etc/shmps)" = "750 root shmps" ] ||
  fail "the reinstall changed /etc/shmps to $(ct stat -c '%a %U %G' /etc/shmps)"
for line in "shmps: not restarted (running as before this install):" \
            "  $unit.service: checkpoint-dir /var/lib/shmps/job1: a restart writes a final checkpoint there and the new server resumes from it" \
            "  shmps@slow.service: no checkpoint-dir: a restart starts it again from its initial weights (its trained weights are lost)"; do
  grep -qxF -- "$line" "$scratch/dpkg.log" || fail "the reinstall's postinst did not print '$line': $(cat "$scratch/dpkg.log")"
done
! grep -E 'version|drops' "$scratch/dpkg.log" || fail "the reinstall's postinst speaks of another version"
ct dpkg -i /srv/shmps-test/next.deb > "$scratch/dpkg.log" 2>&1 || { cat "$scratch/dpkg.log"; fail "dpkg -i (upgrade)"; }
grep -qF "shmps: not restarted, still running version $version until each is restarted" "$scratch/dpkg.log" ||
  fail "the upgrade's postinst did not name the version still running: $(cat "$scratch/dpkg.log")"
grep -qxF "  $unit.service: checkpoint-dir /var/lib/shmps/job1: a restart writes a final checkpoint there and the new server resumes from it" \
  "$scratch/dpkg.log" || fail "the upgrade's postinst did not name $unit: $(cat "$scratch/dpkg.log")"
[ "$(ct systemctl show -p MainPID --value $unit)" = "$job1_pid" ] || fail "the reinstall or upgrade restarted $unit"
ct systemctl stop shmps@slow
ct rm -r /etc/systemd/system/shmps@slow.service.d
ct systemctl daemon-reload
step "reinstall and upgrade to $next_version: /etc/shmps kept 0750 root:shmps; job1 and the activating shmps@slow named, not restarted"

# ---- status: the server's STATUS= line ----
status_out=$(ct systemctl status --no-pager $unit || true)
grep -qE "Status: \"shmps [^ ]+ 'job1': [0-9]+ workers attached, [0-9.]+ pushes/s, version [0-9]+\"" <<<"$status_out" ||
  fail "systemctl status shows no STATUS= line of the server: $status_out"
step "status: $(grep -o 'Status: .*' <<<"$status_out")"

# ---- reload: lr live; a restart-only key (warning); a broken file (err) ----
# systemctl reload returns once ExecReload has sent SIGHUP; the journal line
# marks the moment the server has applied the file.
ct sed -i 's/^lr = 0.001$/lr = 0.0005/' $conf
ct systemctl reload $unit || fail "systemctl reload $unit"
wait_for 10 "no 'reload: lr 0.001 -> 5e-04' at info in the journal" journal_has info 'reload: lr 0.001 -> 5e-04'
journal -o json | grep -F 'reload: lr 0.001 -> 5e-04' | grep -F '"PRIORITY":"6"' > /dev/null ||
  fail "the reload line's PRIORITY is not 6: $(journal -o json | grep -F 'reload: lr')"
ct shmps-inspect job1 | grep 'lr 0.0005,' > /dev/null || fail "shmps-inspect does not show lr 0.0005: $(ct shmps-inspect job1)"
as_user alice shmps-service-worker attach job1 > "$scratch/attach.log" 2>&1 || fail "attach after the reload"
grep -q 'step -0.0005$' "$scratch/attach.log" || fail "a push after the reload did not step by the new lr: $(cat "$scratch/attach.log")"
step "reload: lr 0.001 -> 5e-04 (journal at info, PRIORITY=6; shmps-inspect; a push steps by -0.0005)"

ct sed -i 's/^# max-workers = 16$/max-workers = 8/' $conf
ct systemctl reload $unit || fail "systemctl reload $unit (max-workers)"
wait_for 10 "no 'max-workers 16 -> 8 needs a restart' at warning" journal_has warning 'reload: max-workers 16 -> 8 needs a restart; still 16'
ct sed -i -e 's/^max-workers = 8$/# max-workers = 16/' -e '$a learning-rate = 0.1' $conf
broken_line=$(ct grep -n '^learning-rate = ' $conf | cut -d: -f1)
ct systemctl reload $unit || fail "systemctl reload $unit (broken file)"
wait_for 10 "no 'reload failed' at err" journal_has err \
  "reload failed, keeping the running configuration: config file $conf line $broken_line: unknown key 'learning-rate'"
ct sed -i '/^learning-rate = /d' $conf
[ "$(ct systemctl is-active $unit)" = active ] || fail "$unit not active after the reloads"
step "reload: a restart-only key at warning, a broken file at err, the server still active"

# ---- the watchdog: a stopped server is killed, restarted, restores its checkpoint ----
ct_t 120 setpriv --reuid=alice --regid=alice --init-groups -- shmps-service-worker train job1 60 \
  > "$scratch/train.log" 2>&1 &
train_pid=$!
wait_for 10 "the training worker did not attach" grep -q '^attached:' "$scratch/train.log"
# A checkpoint on disk (temp files are dot files, which ls leaves out).
checkpoint_on_disk() { [ -n "$(ct ls /var/lib/shmps/job1 2>/dev/null)" ]; }
wait_for 10 "no periodic checkpoint in /var/lib/shmps/job1" checkpoint_on_disk
journal_has info 'handed to the writer' || fail "no 'checkpoint ... handed to the writer' at info"
status_attached() { ct systemctl show -p StatusText --value $unit | grep "': 1 workers attached, " > /dev/null; }
wait_for 5 "STATUS= does not count the training worker" status_attached
main_pid=$(ct systemctl show -p MainPID --value $unit)
step "training worker attached ($(ct systemctl show -p StatusText --value $unit)); kill -STOP $main_pid"
ct sh -c "kill -STOP $main_pid"   # the shell's kill: the root has no procps
restarted() {
  [ "$(ct systemctl show -p NRestarts --value $unit)" -ge 1 ] &&
    [ "$(ct systemctl is-active $unit)" = active ] &&
    [ "$(ct systemctl show -p MainPID --value $unit)" != "$main_pid" ]
}
wait_for 30 "the stopped server was not restarted" restarted
step "restarted: MainPID $(ct systemctl show -p MainPID --value $unit), NRestarts $(ct systemctl show -p NRestarts --value $unit)"
journal -o cat | grep "Watchdog timeout" > /dev/null || fail "no 'Watchdog timeout' from systemd in the journal"
wait_for 10 "no 'restored checkpoint' at info after the restart" journal_has info 'restored checkpoint /var/lib/shmps/job1/'
restored=$(journal -o cat | grep -o 'restored checkpoint .*' | tail -n1)
[[ $restored =~ version\ [1-9][0-9]*$ ]] || fail "restored no update: $restored"
wait "$train_pid" || fail "the reconnecting worker did not carry on after the restart: $(cat "$scratch/train.log")"
grep -q '^continued: ' "$scratch/train.log" || fail "train: $(cat "$scratch/train.log")"
step "$restored; worker: $(grep '^continued: ' "$scratch/train.log")"

# ---- stop: final checkpoint, segment removed, exit 0 ----
# One more push, so the final version is not one a periodic checkpoint wrote.
as_user alice shmps-service-worker attach job1 > "$scratch/attach.log" 2>&1 || fail "attach after the restart"
final=$(sed -n 's/^pushed: version [0-9]* -> \([0-9]*\),.*/\1/p' "$scratch/attach.log")
[ -n "$final" ] || fail "attach after the restart: $(cat "$scratch/attach.log")"
ct systemctl stop $unit || fail "systemctl stop $unit"
result=$(ct systemctl show -p Result --value $unit)
[ "$result" = success ] || fail "stop: Result=$result (exit status $(ct systemctl show -p ExecMainStatus --value $unit))"
! ct test -e /dev/shm/shmps.job1 || fail "/dev/shm/shmps.job1 still exists after stop"
wait_for 10 "no 'final checkpoint written: version $final' at info" \
  journal_has info "final checkpoint written: version $final in /var/lib/shmps/job1"
wait_for 10 "no 'stopped: version' at info" journal_has info 'stopped: version '
ct ls /var/lib/shmps/job1 | grep -E "(^|[^0-9])0*$final([^0-9]|$)" > /dev/null ||
  fail "no checkpoint file of version $final: $(ct ls /var/lib/shmps/job1)"
step "stopped: final checkpoint written: version $final; segment removed"

# ---- remove keeps the instance enabled; purge disables it, keeps config and checkpoints ----
link=/etc/systemd/system/multi-user.target.wants/$unit.service
own=/etc/systemd/system/multi-user.target.wants/shmps@own.service   # an admin's own unit, not the template's
ct ln -s /etc/systemd/system/shmps@own.service $own
ct dpkg -r shmps > "$scratch/dpkg.log" 2>&1 || { cat "$scratch/dpkg.log"; fail "dpkg -r"; }
ct test -L $link || fail "dpkg -r removed $link (remove keeps the configuration)"
ct dpkg --purge shmps > "$scratch/dpkg.log" 2>&1 || { cat "$scratch/dpkg.log"; fail "dpkg --purge"; }
! ct test -L $link || fail "dpkg --purge left $link -> $(ct readlink $link)"
ct test -L $own || fail "dpkg --purge removed $own, a link to no unit of the package"
ct test -f $conf || fail "dpkg --purge removed $conf"
ct ls /var/lib/shmps/job1 | grep . > /dev/null || fail "dpkg --purge removed the checkpoints in /var/lib/shmps/job1"
ct getent passwd shmps > /dev/null || fail "dpkg --purge removed the user shmps"
ct rm $own
ct dpkg -i /srv/shmps-test/next.deb > "$scratch/dpkg.log" 2>&1 || { cat "$scratch/dpkg.log"; fail "dpkg -i after the purge"; }
enabled=$(ct systemctl is-enabled $unit || true)
[ "$enabled" = disabled ] || fail "after purge and reinstall, $unit is '$enabled'"
step "remove kept $unit enabled; purge disabled it (kept $conf, the checkpoints, the user); reinstalled: $enabled"
echo "ok: shmps@.service under systemd $(ct systemctl --version | sed -n '1s/^systemd \([0-9]*\).*/\1/p'), in $((SECONDS - t0)) s"
