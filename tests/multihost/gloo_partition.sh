#!/usr/bin/env bash
# A host that reaches the Gloo store but not its peers (CTest label
# multihost): hosts 0 and 1 of a job of 3 form a group through a file
# store and make rounds (no workers: a round runs on its timer alone);
# then host 2 starts in a network namespace of its own (`unshare -n`), so
# that the address it publishes, 127.0.0.1, is its own loopback and no
# connection between it and the others goes through, while the store, a
# directory, is shared. Each of its tries to join makes the group re-form
# with it and the rendezvous fail (a connection refused at once, or one
# never made within --fed-timeout-ms); host 2 backs off between tries
# (docs/federation.md, "Gloo"), so that over the window the group of
# hosts 0 and 1 re-forms only a few times and keeps making rounds. Host 2
# then stops at once on SIGTERM while it backs off, and nothing is left in
# /dev/shm.
# Usage: gloo_partition.sh <build-dir>. Exit 77 (skipped) without the Gloo
# plugin, without root, or where `unshare -n` is not permitted.
set -euo pipefail
build=$1
[ -f "$build/lib/shmps/libshmps_fed_gloo.so" ] || { echo "SKIP: no Gloo plugin in $build (configure found no Gloo)"; exit 77; }
[ "$(id -u)" = 0 ] || { echo "SKIP: not root (a network namespace of its own for host 2 needs unshare -n)"; exit 77; }
{ command -v unshare && command -v ip; } >/dev/null ||
  { echo "SKIP: unshare or ip not found (util-linux, iproute2)"; exit 77; }
unshare -n sh -c 'ip link set lo up' 2>/dev/null ||
  { echo "SKIP: unshare -n is not permitted here (a container without CAP_SYS_ADMIN?)"; exit 77; }
server=$build/bin/shmps-server
inspect=$build/bin/shmps-inspect
name=fedpart$$
work=$(mktemp -d)
timeout_ms=1000
every_ms=150
# The window host 2 tries to join in, and the most re-formations of the
# group it may cause there: backed off (a timeout, doubled each try), it
# tries 5 times in 25 s, at about 0, 2, 4, 9 and 18 s.
window_s=25
max_reforms=8
declare -A host_pid=()
cleanup() {
  for p in "${host_pid[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -f /dev/shm/shmps."$name".* 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# A command that fails unchecked names itself (set -e alone would end the
# test silently).
set -E
trap 'echo "FAIL: \"$BASH_COMMAND\" exited $? (line $LINENO${FUNCNAME:+, called from lines ${BASH_LINENO[*]}})" >&2' ERR
fail() {  # to stderr: a failure inside $(...) or >/dev/null is still seen
  {
    echo "FAIL: $*"
    for f in "$work"/host*.log; do
      [ -f "$f" ] || continue
      echo "---- $f"
      tail -25 "$f"
    done
  } >&2
  exit 1
}

# start_host R [WRAPPER...]: host R in the background, its command run by
# WRAPPER when given (host 2's network namespace); its pid is the server's
# (the wrapper execs it).
start_host() {
  local r=$1
  shift
  "$@" "$server" --name "$name" --fed-rank-in-name --federation gloo --fed-store "file:$work/store" --fed-hosts 3 \
    --fed-host "$r" --fed-timeout-ms $timeout_ms --fed-every-ms $every_ms --tensor w:1000 --optimizer adam \
    --backend host >"$work/host$r.log" 2>&1 &
  host_pid[$r]=$!
  for _ in $(seq 100); do [ -e "/dev/shm/shmps.$name.r$r" ] && return 0; sleep 0.1; done
  fail "host $r did not start within 10 s"
}
field() { python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(s['$1'])"; }
stat_of() { "$inspect" --json "$name.r$1" 2>/dev/null | field "$2" 2>/dev/null || echo -1; }
members_of() {
  local n
  n=$("$inspect" "$name.r$1" 2>/dev/null | sed -n 's/^  federation *round [0-9]*, \([0-9]*\) hosts.*/\1/p')
  echo "${n:--1}"
}
in_group() { [ "$(members_of 0)" = 2 ] && [ "$(members_of 1)" = 2 ]; }
# The times host 0 re-formed for a host that waits to join.
reforms() { grep -c "a host waits to join; the group re-forms" "$work/host0.log" || true; }
# In a network namespace of its own, its loopback up: unshare and sh
# exec, so the server keeps the pid the background job started with.
isolated=(unshare -n sh -c 'ip link set lo up && exec "$@"' isolated)

start_host 0
start_host 1
for _ in $(seq 300); do
  in_group && break
  sleep 0.1
done
in_group || fail "hosts 0 and 1 did not form a group within 30 s"
for _ in $(seq 100); do [ "$(stat_of 0 fed_round)" -ge 5 ] && break; sleep 0.1; done
[ "$(stat_of 0 fed_round)" -ge 5 ] || fail "hosts 0 and 1 made no 5 rounds within 10 s"

round0=$(stat_of 0 fed_round) epoch0=$(stat_of 0 fed_epoch)
start_host 2 "${isolated[@]}"
sleep "$window_s"
round1=$(stat_of 0 fed_round) epoch1=$(stat_of 0 fed_epoch) reformed=$(reforms)
tries=$(grep -c "host 2 could not connect to the group's hosts" "$work/host2.log" || true)
echo "over ${window_s} s with host 2 partitioned: hosts 0 and 1 re-formed $reformed times for it" \
  "(epoch $epoch0 -> $epoch1), made $((round1 - round0)) rounds (every $every_ms ms, --fed-timeout-ms $timeout_ms);" \
  "host 2 failed to connect $tries times"
[ "$reformed" -ge 1 ] || fail "host 2 never made the group re-form (did it start its federation?)"
[ "$reformed" -le "$max_reforms" ] ||
  fail "hosts 0 and 1 re-formed $reformed times in $window_s s for a host they cannot reach (limit $max_reforms)"
# Rounds: the group runs most of the window, a round every period or a
# little more (each re-formation costs it about a timeout); at least half
# of the periods of the window. Tried at once, host 2 keeps the group from
# forming at all most of the time (a handful of rounds in 25 s).
min_rounds=$((window_s * 1000 / every_ms / 2))
[ $((round1 - round0)) -ge "$min_rounds" ] ||
  fail "hosts 0 and 1 made $((round1 - round0)) rounds in $window_s s (at least $min_rounds expected)"
grep -q "host 2 could not connect to the group's hosts .*trying again in [0-9.]* s" "$work/host2.log" ||
  fail "host 2's log does not say it backs off"
# The end of host 2's last backoff, in ms since the epoch, from its log's
# last backoff line and its time.
backoff_end_ms() {
  local last wait_ms
  last=$(grep "host 2 could not connect to the group's hosts" "$work/host2.log" | tail -1)
  wait_ms=$(sed -n 's/.*trying again in \([0-9.]*\) s$/\1/p' <<<"$last" | python3 -c "print(int(float(input()) * 1000))")
  echo $(($(date -d "${last%% *}" +%s%3N) + wait_ms))
}
# The window may end during one of host 2's tries (each backoff ends in
# one, which hosts 0 and 1 re-form for, then form again without it):
# until that try has passed (10 s at most; a try takes a settle and a
# failed rendezvous, about 2 s here), hosts 0 and 1 are a group and host 2
# is in a backoff that lasts a while yet (its waits have doubled to
# several seconds by now), so that the SIGTERM below comes during a
# backoff; a stop ends the wait at once.
for _ in $(seq 100); do
  in_group && [ $(($(date +%s%3N) + 300)) -lt "$(backoff_end_ms)" ] && break
  sleep 0.1
done
in_group || fail "hosts 0 and 1 are not in a group at the window's end (nor within 10 s after it)"
until_ms=$(backoff_end_ms)
t0=$(date +%s%N)
[ $((t0 / 1000000 + 300)) -lt "$until_ms" ] ||
  fail "host 2 is not backing off at the window's end (its last backoff ended at $until_ms ms, now $((t0 / 1000000)))"
kill -TERM "${host_pid[2]}"
wait "${host_pid[2]}" || fail "host 2 exited non-zero after SIGTERM"
unset "host_pid[2]"
stopped_ms=$((($(date +%s%N) - t0) / 1000000))
echo "host 2 stopped ${stopped_ms} ms after SIGTERM"
[ "$stopped_ms" -le 2000 ] || fail "host 2 took ${stopped_ms} ms to stop while backing off"
for r in 0 1; do kill -TERM "${host_pid[$r]}"; done
for r in 0 1; do
  wait "${host_pid[$r]}" || fail "host $r exited non-zero after SIGTERM"
  unset "host_pid[$r]"
done
ls /dev/shm/shmps."$name".* >/dev/null 2>&1 && fail "left in /dev/shm: $(ls /dev/shm/shmps."$name".*)"
echo "PASS"
