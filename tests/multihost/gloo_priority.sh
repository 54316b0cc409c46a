#!/usr/bin/env bash
# --fed-priority with Gloo, real processes (CTest label multihost): two
# shmps-servers federated through a file store, host 0 at --fed-priority
# idle and host 1 at low. Once both show 2 members, host 0 has exactly two
# threads under SCHED_IDLE (the round loop and Gloo's I/O thread, started
# from a lowered thread) and host 1 exactly two at nice 19; every other
# thread of each is as it started (the consumer serves at full priority).
# Both stop cleanly on SIGTERM.
# Usage: gloo_priority.sh <build-dir>. Exit 77 (skipped) without the Gloo
# plugin, or when run at nice 19 or under a policy other than SCHED_OTHER
# (a lowered thread would look like the others).
set -euo pipefail
build=$1
[ -f "$build/lib/shmps/libshmps_fed_gloo.so" ] || { echo "SKIP: no Gloo plugin in $build (configure found no Gloo)"; exit 77; }
# This shell's nice value and policy: fields 19 and 41 of its stat.
read -r -a self <<<"$(sed 's/.*) //' /proc/$$/stat)"
[ "${self[16]}" != 19 ] && [ "${self[38]}" = 0 ] ||
  { echo "SKIP: this test runs at nice ${self[16]}, policy ${self[38]} already: a lowered thread looks like the others"; exit 77; }
server=$build/bin/shmps-server
inspect=$build/bin/shmps-inspect
name=fedprio$$
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -f /dev/shm/shmps."$name"*.* 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "---- $f"; tail -15 "$f"; done; exit 1; }

priorities=(idle low)
for r in 0 1; do
  "$server" --name "$name" --fed-rank-in-name --federation gloo --fed-store "file:$work/store" --fed-hosts 2 \
    --fed-host "$r" --fed-every-ms 50 --fed-priority "${priorities[$r]}" --tensor w:1000 --optimizer adam \
    --backend host >"$work/host$r.log" 2>&1 &
  pids+=($!)
done
members_of() {
  local n
  n=$("$inspect" "$name.r$1" 2>/dev/null | sed -n 's/^  federation *round [0-9]*, \([0-9]*\) hosts.*/\1/p')
  echo "${n:--1}"
}
for _ in $(seq 300); do
  [ "$(members_of 0)" = 2 ] && [ "$(members_of 1)" = 2 ] && break
  sleep 0.1
done
[ "$(members_of 0)" = 2 ] && [ "$(members_of 1)" = 2 ] || fail "the two hosts did not form a group within 30 s"

# count PID NICE POLICY: threads of PID with that nice value and policy
# (/proc/PID/task/*/stat fields 19 and 41, counted after the command).
count() {
  local n=0 t rest
  for t in /proc/"$1"/task/*/stat; do
    rest=$(sed 's/.*) //' "$t" 2>/dev/null) || continue
    read -r -a f <<<"$rest"
    [ "${f[16]}" = "$2" ] && [ "${f[38]}" = "$3" ] && n=$((n + 1))
  done
  echo $n
}
all_threads() { ls /proc/"$1"/task | wc -l; }
# The nice value the servers started with (this test's own): field 19 of
# the main thread's stat.
base() { local f; read -r -a f <<<"$(sed 's/.*) //' /proc/"$1"/stat)"; echo "${f[16]}"; }
nice0=$(base "${pids[0]}")
idle=$(count "${pids[0]}" "$nice0" 5)  # SCHED_IDLE
low=$(count "${pids[1]}" 19 0)         # SCHED_OTHER at nice 19
[ "$idle" = 2 ] || fail "host 0 (--fed-priority idle) has $idle threads under SCHED_IDLE, not 2"
[ "$low" = 2 ] || fail "host 1 (--fed-priority low) has $low threads at nice 19, not 2"
for r in 0 1; do
  rest=$(($(all_threads "${pids[$r]}") - 2))
  normal=$(count "${pids[$r]}" "$nice0" 0)
  [ "$normal" = "$rest" ] || fail "host $r: $normal of its other $rest threads at nice $nice0 and SCHED_OTHER"
done
echo "host 0: 2 threads under SCHED_IDLE; host 1: 2 at nice 19; the others as started"

for r in 0 1; do kill -TERM "${pids[$r]}"; done
for r in 0 1; do
  wait "${pids[$r]}" || fail "host $r exited with $? on SIGTERM"
done
pids=()
ls /dev/shm/shmps."$name".* >/dev/null 2>&1 && fail "left in /dev/shm: $(ls /dev/shm/shmps."$name".*)"
echo "PASS"
