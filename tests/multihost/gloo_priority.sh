#!/usr/bin/env bash
# --fed-priority with Gloo, real processes (CTest label multihost): three
# shmps-servers federated through a file store, host 0 at --fed-priority
# idle, host 1 at low and host 2 at normal. Once all show 3 members:
# host 0 has exactly two threads under SCHED_IDLE (the round loop and
# Gloo's I/O thread, started from a lowered thread); host 1 one at nice 19
# (the round loop) and one at nice 19 under SCHED_BATCH (the I/O thread);
# host 2 one under SCHED_BATCH (the I/O thread: it never preempts the
# round loop as it wakes); every other thread of each is as it started
# (the consumer serves at full priority). All stop cleanly on SIGTERM.
# Usage: gloo_priority.sh <build-dir>. Exit 77 (skipped) without the Gloo
# plugin, or when run at nice 19 or under a policy other than SCHED_OTHER
# (a lowered thread would look like the others).
set -euo pipefail
build=$1
[ -f "$build/lib/shmps/libshmps_fed_gloo.so" ] || { echo "SKIP: no Gloo plugin in $build (configure found no Gloo)"; exit 77; }
# nice_policy STATFILE: a task's nice value and scheduling policy (fields
# 19 and 41 of /proc/.../stat, counted after the command, which may hold
# spaces); nothing if the task just ended.
nice_policy() {
  local f
  read -r -a f <<<"$(sed 's/.*) //' "$1" 2>/dev/null)" || return 0
  [ "${#f[@]}" -ge 39 ] && echo "${f[16]} ${f[38]}"
}
read -r self_nice self_policy <<<"$(nice_policy /proc/$$/stat)"
[ "$self_nice" != 19 ] && [ "$self_policy" = 0 ] ||
  { echo "SKIP: this test runs at nice $self_nice, policy $self_policy already: a lowered thread looks like the others"; exit 77; }
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

priorities=(idle low normal)
for r in 0 1 2; do
  "$server" --name "$name" --fed-rank-in-name --federation gloo --fed-store "file:$work/store" --fed-hosts 3 \
    --fed-host "$r" --fed-every-ms 50 --fed-timeout-ms 30000 --fed-priority "${priorities[$r]}" --tensor w:1000 --optimizer adam \
    --backend host >"$work/host$r.log" 2>&1 &
  pids+=($!)
done
members_of() {
  local n
  n=$("$inspect" "$name.r$1" 2>/dev/null | sed -n 's/^  federation *round [0-9]*, \([0-9]*\) hosts.*/\1/p')
  echo "${n:--1}"
}
formed() { [ "$(members_of 0)" = 3 ] && [ "$(members_of 1)" = 3 ] && [ "$(members_of 2)" = 3 ]; }
for _ in $(seq 300); do
  formed && break
  sleep 0.1
done
formed || fail "the three hosts did not form a group within 30 s"

# count PID NICE POLICY: threads of PID with that nice value and policy
# (/proc/PID/task/*/stat fields 19 and 41, counted after the command).
count() {
  local n=0 t
  for t in /proc/"$1"/task/*/stat; do
    [ "$(nice_policy "$t")" = "$2 $3" ] && n=$((n + 1))
  done
  echo $n
}
all_threads() { ls /proc/"$1"/task | wc -l; }
# The nice value the servers started with (this test's own): field 19 of
# the main thread's stat.
base() { local nice policy; read -r nice policy <<<"$(nice_policy /proc/"$1"/stat)"; echo "$nice"; }
nice0=$(base "${pids[0]}")
# Policies: 0 SCHED_OTHER, 3 SCHED_BATCH, 5 SCHED_IDLE.
idle=$(count "${pids[0]}" "$nice0" 5)
low=$(count "${pids[1]}" 19 0)
low_io=$(count "${pids[1]}" 19 3)
normal_io=$(count "${pids[2]}" "$nice0" 3)
[ "$idle" = 2 ] || fail "host 0 (--fed-priority idle) has $idle threads under SCHED_IDLE, not 2"
[ "$low" = 1 ] || fail "host 1 (--fed-priority low) has $low threads at nice 19 under SCHED_OTHER, not 1"
[ "$low_io" = 1 ] || fail "host 1 (--fed-priority low) has $low_io threads at nice 19 under SCHED_BATCH, not 1"
[ "$normal_io" = 1 ] || fail "host 2 (--fed-priority normal) has $normal_io threads under SCHED_BATCH, not 1"
for r in 0 1 2; do
  rest=$(($(all_threads "${pids[$r]}") - (r == 2 ? 1 : 2)))
  normal=$(count "${pids[$r]}" "$nice0" 0)
  [ "$normal" = "$rest" ] || fail "host $r: $normal of its other $rest threads at nice $nice0 and SCHED_OTHER"
done
echo "host 0: 2 threads under SCHED_IDLE; host 1: 1 at nice 19, 1 at nice 19 under SCHED_BATCH;" \
  "host 2: 1 under SCHED_BATCH; the others as started"

for r in 0 1 2; do kill -TERM "${pids[$r]}"; done
for r in 0 1 2; do
  wait "${pids[$r]}" || fail "host $r exited with $? on SIGTERM"
done
pids=()
ls /dev/shm/shmps."$name".* >/dev/null 2>&1 && fail "left in /dev/shm: $(ls /dev/shm/shmps."$name".*)"
echo "PASS"
