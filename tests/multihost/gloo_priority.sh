#!/usr/bin/env bash
# --fed-priority and --fed-cpus with Gloo, and the server's thread names,
# real processes (CTest label multihost): three shmps-servers federated
# through a file store, host 0 at --fed-priority idle, host 1 at low with
# --fed-cpus set to the first CPU this test may use, and host 2 at
# normal. Once all show 3 members, each server's threads are the consumer
# (shmps-server), the checkpoint writer (shmps-ckpt), the reload parser
# (shmps-reload), the orphan sweeper (shmps-sweep), one round loop
# (shmps-fed) and one Gloo I/O thread (shmps-fed-io), and:
# host 0's round loop and I/O thread are under SCHED_IDLE; host 1's round
# loop at nice 19 and its I/O thread at nice 19 under SCHED_BATCH; host 2's
# round loop as started and its I/O thread under SCHED_BATCH (it never
# preempts the round loop as it wakes); every other thread of each is as
# it started (the consumer serves at full priority). Host 1's round loop
# and I/O thread run on that one CPU, every other thread on the CPUs this
# test has. All stop cleanly on SIGTERM.
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
# A command that fails unchecked names itself (set -e alone would end the
# test silently).
set -E
trap 'echo "FAIL: \"$BASH_COMMAND\" exited $? (line $LINENO${FUNCNAME:+, called from lines ${BASH_LINENO[*]}})" >&2' ERR
fail() {  # to stderr: a failure inside $(...) or >/dev/null is still seen
  { echo "FAIL: $*"; for f in "$work"/*.log; do echo "---- $f"; tail -15 "$f"; done; } >&2
  exit 1
}

priorities=(idle low normal)
# The CPUs this test may use ("0-1"), and the first of them.
allowed=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/$$/status)
first_cpu=${allowed%%[-,]*}
[ "$first_cpu" != "$allowed" ] ||
  echo "NOTE: this test may use CPU $allowed only, so host 1's placement is not told apart from the others'"
fed_cpus=("$allowed" "$first_cpu" "$allowed")
for r in 0 1 2; do
  placement=()
  [ "$r" != 1 ] || placement=(--fed-cpus "$first_cpu")
  "$server" --name "$name" --fed-rank-in-name --federation gloo --fed-store "file:$work/store" --fed-hosts 3 \
    --fed-host "$r" --fed-every-ms 50 --fed-timeout-ms 30000 --fed-priority "${priorities[$r]}" --tensor w:1000 --optimizer adam \
    --backend host --checkpoint-dir "$work/ckpt$r" "${placement[@]}" >"$work/host$r.log" 2>&1 &
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

# The nice value the servers started with (this test's own): field 19 of
# the main thread's stat.
read -r nice0 _ <<<"$(nice_policy /proc/"${pids[0]}"/stat)"
# Policies: 0 SCHED_OTHER, 3 SCHED_BATCH, 5 SCHED_IDLE. For each host, the
# round loop's and the I/O thread's nice value and policy.
fed=("$nice0 5" "19 0" "$nice0 0")
fed_io=("$nice0 5" "19 3" "$nice0 3")
for r in 0 1 2; do
  seen=""
  for t in /proc/"${pids[$r]}"/task/*; do
    comm=$(cat "$t/comm" 2>/dev/null) || continue
    np=$(nice_policy "$t/stat")
    [ -n "$np" ] || continue
    cpus=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' "$t/status" 2>/dev/null) || continue
    case $comm in
      shmps-fed) want=${fed[$r]} want_cpus=${fed_cpus[$r]} ;;
      shmps-fed-io) want=${fed_io[$r]} want_cpus=${fed_cpus[$r]} ;;
      shmps-server | shmps-ckpt | shmps-reload | shmps-sweep) want="$nice0 0" want_cpus=$allowed ;;
      *) fail "host $r (--fed-priority ${priorities[$r]}): a thread named '$comm'" ;;
    esac
    [ "$np" = "$want" ] ||
      fail "host $r (--fed-priority ${priorities[$r]}): $comm at nice and policy $np, not $want"
    [ "$cpus" = "$want_cpus" ] || fail "host $r: $comm on CPUs $cpus, not $want_cpus"
    seen="$seen $comm"
  done
  for comm in shmps-server shmps-ckpt shmps-sweep shmps-fed shmps-fed-io; do
    n=$(tr ' ' '\n' <<<"$seen" | grep -cx -- "$comm" || true)
    case $comm in shmps-server) ok=$((n >= 1)) ;; *) ok=$((n == 1)) ;; esac
    [ "$ok" = 1 ] || fail "host $r: $n threads named $comm"
  done
done
echo "host 0: shmps-fed and shmps-fed-io under SCHED_IDLE; host 1: shmps-fed at nice 19, shmps-fed-io at nice 19" \
  "under SCHED_BATCH, both on CPU $first_cpu; host 2: shmps-fed-io under SCHED_BATCH; shmps-server, shmps-ckpt" \
  "and shmps-sweep as started, on CPUs $allowed"

for r in 0 1 2; do kill -TERM "${pids[$r]}"; done
for r in 0 1 2; do
  wait "${pids[$r]}" || fail "host $r exited with $? on SIGTERM"
done
pids=()
ls /dev/shm/shmps."$name".* >/dev/null 2>&1 && fail "left in /dev/shm: $(ls /dev/shm/shmps."$name".*)"
echo "PASS"
