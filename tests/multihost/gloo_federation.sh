#!/usr/bin/env bash
# Federation over Gloo with real processes (CTest label multihost): three
# shmps-servers started as plain processes on this machine, each its own
# "host" (--fed-rank-in-name), meeting through a file store, with
# checkpoints every second and shmps-train workers on them.
#  1. SIGKILL host 1 past round 10: hosts 0 and 2 show 2 members within the
#     timeout plus 1 s; restarted from its checkpoint, host 1 joins again:
#     3 members, equal anchors; every worker's run finishes without error.
#  2. SIGSTOP host 2 (a hung host): hosts 0 and 1 show 2 members within the
#     timeout plus 1 s, their workers see no error; after SIGCONT host 2
#     joins again: 3 members, equal anchors, a good merged model. Then
#     the store wiped under the group (and again as it re-forms) and host
#     1 restarted: it joins within the timeout plus 1 s.
#  2b. Two servers given one --fed-host id: one says so and ends its
#     federation, the group forms with the other.
#  2c. A host paused (SIGSTOP) while the others restart without their
#     checkpoints: on SIGCONT it is refused as another lineage, keeping
#     its anchor, and the others go on without it.
#  2d. A host that served alone (the other two stopped: no majority) and
#     checkpointed its training, killed, restarted once the others went on
#     without it: its join keeps that training, rebased onto their anchor.
#  2e. Two hosts killed as one of them re-formed, restarted at once: the
#     dead server's want at the newest attempt is passed, not taken for a
#     second server given the same id; the two form a group again.
#  2f. A host paused alone for many attempts, then a group formed: its
#     rank 0 sweeps the attempts before its epoch from the store, which
#     holds about one attempt's keys; a host restarted joins through it.
#  3. The same group formed through a Redis store (a redis-server this test
#     starts on 127.0.0.1), a SIGKILLed host left behind there too, and
#     part 2f through it.
# Then SIGTERM: every server stops cleanly, nothing is left in /dev/shm.
# First of all, a host whose other hosts never arrive says so with the fix
# in its log (after the timeout), serves its workers alone, and stops at
# once on SIGTERM.
# Usage: gloo_federation.sh <build-dir>. Exit 77 (skipped) without the Gloo
# plugin; part 3 is skipped (said so) without redis-server.
set -euo pipefail
build=$1
[ -f "$build/lib/shmps/libshmps_fed_gloo.so" ] || { echo "SKIP: no Gloo plugin in $build (configure found no Gloo)"; exit 77; }
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] ||
  { echo "SKIP: Fashion-MNIST is not at /usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist)"; exit 77; }
server=$build/bin/shmps-server
inspect=$build/bin/shmps-inspect
train=$build/bin/shmps-train
name=fedgloo$$
work=$(mktemp -d)
timeout_ms=2000
declare -A host_pid=()
redis_pid=
cleanup() {
  for p in "${host_pid[@]}" $redis_pid; do kill -KILL "$p" 2>/dev/null || true; done
  pkill -KILL -f "shmps-server --name $name" 2>/dev/null || true
  pkill -KILL -f "connect $name" 2>/dev/null || true
  rm -f /dev/shm/shmps."$name"*.* 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# A command that fails unchecked names itself (set -e alone would end the
# test silently).
set -E
trap 'echo "FAIL: \"$BASH_COMMAND\" exited $? (line $LINENO${FUNCNAME:+, called from lines ${BASH_LINENO[*]}})" >&2' ERR
# fail MESSAGE: to stderr (a failure inside $(...) or >/dev/null is still
# seen), with the current part's server logs, their periodic checkpoint
# lines left out so that the federation's story fits.
fail() {
  {
    echo "FAIL: $*"
    for f in "$work/${job:-}".host*.log "$work/${job:-}"b.host*.log; do
      [ -f "$f" ] || continue
      echo "---- $f"
      grep -v "checkpoint of version .* handed to the writer" "$f" | tail -40
    done
  } >&2
  exit 1
}
model=(--tensor fc1.weight:256x784 --tensor fc1.bias:256 --tensor fc2.weight:10x256 --tensor fc2.bias:10
       --optimizer adam --lr 0.001 --init normal --init-scale 0.05 --backend host)

# start_host JOB R STORE: host R of job JOB (its segment JOB.rR) in the
# background, a round every $every_ms ms (50 unless set).
start_host() {
  local job=$1 r=$2 store=$3
  "$server" --name "$job" --fed-rank-in-name --federation gloo --fed-store "$store" --fed-hosts 3 --fed-host "$r" \
    --fed-timeout-ms $timeout_ms --fed-every-ms "${every_ms:-50}" "${model[@]}" \
    --checkpoint-dir "$work/ckpt-$job" --checkpoint-interval-s 1 >>"$work/$job.host$r.log" 2>&1 &
  host_pid[$job.$r]=$!
  for _ in $(seq 100); do [ -e "/dev/shm/shmps.$job.r$r" ] && return 0; sleep 0.1; done
  fail "host $r of $job did not start within 10 s"
}
field() { python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(s['$1'])"; }
stat_of() { "$inspect" --json "$1.r$2" 2>/dev/null | field "$3" 2>/dev/null || echo -1; }
# The hosts a server shows now, from shmps-inspect's text (cheap enough to
# poll every 20 ms); -1 while it shows none.
members_of() {
  local n
  n=$("$inspect" "$1.r$2" 2>/dev/null | sed -n 's/^  federation *round [0-9]*, \([0-9]*\) hosts.*/\1/p')
  echo "${n:--1}"
}
accuracy() { sed -n 's/^final test accuracy: \([0-9.]*\).*/\1/p' "$1"; }
# await_log FILE PATTERN: until the log has the line (10 s; a server writes
# it a moment after its segment appears).
await_log() {
  for _ in $(seq 200); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done
  fail "no line '$2' in $1 within 10 s"
}

# await_members JOB N HOSTS... : until each named host shows N members;
# prints the seconds it took. Fails after 30 s.
await_members() {
  local job=$1 want=$2 start
  shift 2
  start=$(date +%s%N)
  for _ in $(seq 1500); do
    local all=1
    for r in "$@"; do [ "$(members_of "$job" "$r")" = "$want" ] || all=; done
    if [ -n "$all" ]; then
      python3 -c "print(f'{($(date +%s%N) - $start) / 1e9:.2f}')"
      return 0
    fi
    sleep 0.02
  done
  fail "hosts $* of $job did not show $want members within 30 s"
}
# await_equal_anchors JOB: the three hosts' anchor hashes agree (10 s).
await_equal_anchors() {
  local job=$1
  for _ in $(seq 100); do
    local h0 h1 h2
    h0=$(stat_of "$job" 0 fed_anchor_hash) h1=$(stat_of "$job" 1 fed_anchor_hash) h2=$(stat_of "$job" 2 fed_anchor_hash)
    if [ "$h0" = "$h1" ] && [ "$h1" = "$h2" ] && [ "$h0" != -1 ]; then
      echo "anchor hash $h0 on all three hosts, round $(stat_of "$job" 0 fed_round), epoch $(stat_of "$job" 0 fed_epoch)"
      return 0
    fi
    sleep 0.1
  done
  fail "the anchor hashes of $job never agreed"
}
await_round() {  # JOB ROUND HOSTS...
  local job=$1 round=$2
  shift 2
  for _ in $(seq 300); do
    local all=1
    for r in "$@"; do [ "$(stat_of "$job" "$r" fed_round)" -ge "$round" ] || all=; done
    [ -n "$all" ] && return 0
    sleep 0.1
  done
  fail "hosts $* of $job did not reach round $round within 30 s"
}
# within_limit SECONDS: the timeout plus 1 s (twice that in a sanitizer
# build, whose servers run several times slower).
slack=1
grep -q '^SHMPS_SANITIZER:STRING=.' "$build/CMakeCache.txt" 2>/dev/null && slack=2
within_limit() { python3 -c "import sys; sys.exit(0 if $1 <= $slack * ($timeout_ms / 1000 + 1) else 1)"; }

# ---- 0. A host whose job's other hosts never arrive: after the timeout it
# says so with the fix, serves its workers alone, and stops at once.
job=${name}lone
start_host "$job" 0 "file:$work/lone-store"
await_log "$work/$job.host0.log" "no majority to form its first group: start the others"
# StatsBlock::fed_state 3 (paused), and shmps-inspect says so, for a
# host that never formed a group too.
[ "$(stat_of "$job" 0 fed_state)" = 3 ] || fail "the lone host's fed_state is $(stat_of "$job" 0 fed_state), not 3 (paused)"
"$inspect" "$job.r0" | grep -q "federation      paused: no majority" ||
  fail "shmps-inspect shows: $("$inspect" "$job.r0" | grep federation)"
"$train" --connect "$job.r0" --evaluate >"$work/lone.log" 2>&1 || fail "host 0 alone does not serve: $(tail -3 "$work/lone.log")"
t0=$(date +%s%N)
kill -TERM "${host_pid[$job.0]}"
wait "${host_pid[$job.0]}" || fail "the lone host exited non-zero after SIGTERM"
unset "host_pid[$job.0]"
echo "a lone host of 3 paused with the fix in its log, served, and stopped in $((($(date +%s%N) - t0) / 1000000)) ms"

# ---- 1. SIGKILL host 1 past round 10, then restart it from its checkpoint.
job=$name
for r in 0 1 2; do start_host "$job" $r "file:$work/store"; done
echo "formed with 3 members in $(await_members "$job" 3 0 1 2) s"
[ "$(stat_of "$job" 1 fed_state)" = 2 ] || fail "host 1's fed_state is $(stat_of "$job" 1 fed_state), not 2 (in a group)"
declare -A trainer=()
for r in 0 1 2; do
  "$train" --workers 1 --epochs 3 --train-limit 20000 --connect "$job.r$r" --seed $((r + 1)) >"$work/train$r.log" 2>&1 &
  trainer[$r]=$!
done
await_round "$job" 10 0 1 2
for _ in $(seq 100); do [ -n "$(ls "$work/ckpt-$job/r1" 2>/dev/null)" ] && break; sleep 0.1; done
sleep 1.2  # a checkpoint of host 1 with training in it
kill -KILL "${host_pid[$job.1]}" "${trainer[1]}"
wait "${host_pid[$job.1]}" 2>/dev/null || true
wait "${trainer[1]}" 2>/dev/null || true
took=$(await_members "$job" 2 0 2)
echo "SIGKILL of host 1: hosts 0 and 2 showed 2 members after $took s (limit: $timeout_ms ms + 1 s)"
within_limit "$took" || fail "re-forming after a SIGKILL took $took s"
rm -f "/dev/shm/shmps.$job.r1"
start_host "$job" 1 "file:$work/store"
await_log "$work/$job.host1.log" "restored checkpoint .*federation round"
echo "host 1 restarted from its checkpoint: 3 members after $(await_members "$job" 3 0 1 2) s"
"$inspect" "$job.r0" | grep -q "3 hosts (epoch " || fail "shmps-inspect shows no epoch: $("$inspect" "$job.r0" | grep federation)"
await_log "$work/$job.host1.log" "joined as rank . of 3 .* resumed at round"
"$train" --workers 1 --epochs 1 --train-limit 10000 --connect "$job.r1" --seed 9 >"$work/train1b.log" 2>&1 &
trainer[1]=$!
for r in 0 1 2; do wait "${trainer[$r]}" || fail "host $r's worker saw an error: $(tail -3 "$work/train$r.log")"; done
await_equal_anchors "$job"

# ---- 2. SIGSTOP host 2 (hung), workers on hosts 0 and 1 going on; SIGCONT.
for r in 0 1; do
  "$train" --workers 1 --epochs 2 --train-limit 20000 --connect "$job.r$r" --seed $((r + 11)) >"$work/hung$r.log" 2>&1 &
  trainer[$r]=$!
done
sleep 0.5
kill -STOP "${host_pid[$job.2]}"
took=$(await_members "$job" 2 0 1)
echo "SIGSTOP of host 2: hosts 0 and 1 showed 2 members after $took s (limit: $timeout_ms ms + 1 s)"
within_limit "$took" || fail "re-forming after a SIGSTOP took $took s"
sleep 1
kill -CONT "${host_pid[$job.2]}"
echo "host 2 continued: 3 members after $(await_members "$job" 3 0 1 2) s"
for r in 0 1; do wait "${trainer[$r]}" || fail "host $r's worker saw an error: $(tail -3 "$work/hung$r.log")"; done
await_equal_anchors "$job"
epoch=$(stat_of "$job" 0 fed_epoch)
[ "$epoch" -ge 5 ] || fail "epoch $epoch after 4 re-formations"
"$train" --connect "$job.r2" --evaluate >"$work/merged.log" 2>&1 || fail "scoring the merged model failed"
merged=$(accuracy "$work/merged.log")
echo "merged model: test accuracy $merged"
python3 -c "import sys; sys.exit(0 if $merged >= 0.80 else 1)" || fail "the merged model reached only $merged"
# The store wiped under the running group (as a Redis restarted without
# persistence loses it), then host 1 SIGKILLed and restarted: it meets
# the group at the attempt after its epoch within the limit, rather than
# counting attempts up from 1 (a settle time each).
kill -KILL "${host_pid[$job.1]}"
wait "${host_pid[$job.1]}" 2>/dev/null || true
await_members "$job" 2 0 2 >/dev/null
epoch=$(stat_of "$job" 0 fed_epoch)
find "$work/store" -mindepth 1 -delete
start_host "$job" 1 "file:$work/store"
took=$(await_members "$job" 3 0 1 2)
echo "store wiped under the group at epoch $epoch: host 1 restarted, 3 members after $took s, epoch $(stat_of "$job" 0 fed_epoch)"
within_limit "$took" || fail "rejoining through a wiped store took $took s"
await_equal_anchors "$job"
# The same with the store wiped while the others re-form (100 ms after
# the SIGKILL: they see it within a round, then wait up to 200 ms for host
# 1's want): the group forms past attempts the store no longer has.
kill -KILL "${host_pid[$job.1]}"
sleep 0.1
find "$work/store" -mindepth 1 -delete
wait "${host_pid[$job.1]}" 2>/dev/null || true
await_members "$job" 2 0 2 >/dev/null
start_host "$job" 1 "file:$work/store"
took=$(await_members "$job" 3 0 1 2)
echo "store wiped as the group re-formed: host 1 restarted, 3 members after $took s, epoch $(stat_of "$job" 0 fed_epoch)"
within_limit "$took" || fail "rejoining through a store wiped during a re-formation took $took s"
await_equal_anchors "$job"
for r in 0 1 2; do kill -TERM "${host_pid[$job.$r]}"; done
for r in 0 1 2; do
  wait "${host_pid[$job.$r]}" || fail "host $r exited non-zero after SIGTERM"
  unset "host_pid[$job.$r]"
done
ls /dev/shm/shmps."$job".* >/dev/null 2>&1 && fail "left in /dev/shm: $(ls /dev/shm/shmps."$job".*)"

# ---- 2b. Two servers given one --fed-host id (the second under another
# name): the one that finds the other's want says so, with the fix, and
# ends its federation; the group forms with the other.
job=${name}dup
start_host "$job" 0 "file:$work/dup-store"
start_host "$job" 1 "file:$work/dup-store"
start_host "${job}b" 1 "file:$work/dup-store"
for _ in $(seq 200); do
  grep -q "two servers were given --fed-host 1" "$work/$job.host1.log" "$work/${job}b.host1.log" && break
  sleep 0.05
done
if grep -q "two servers were given --fed-host 1" "$work/${job}b.host1.log"; then
  refused=${job}b kept=$job
elif grep -q "two servers were given --fed-host 1" "$work/$job.host1.log"; then
  refused=$job kept=${job}b
else
  fail "neither server of host 1 said it shares its id within 10 s"
fi
[ "$(stat_of "$refused" 1 fed_state)" = 4 ] || fail "the refused host 1's fed_state is $(stat_of "$refused" 1 fed_state), not 4 (ended)"
echo "a second host 1 ended its federation naming the shared id; the group: $(await_members "$kept" 2 1) s to 2 members"
for j in "$job.0" "$job.1" "${job}b.1"; do
  kill -TERM "${host_pid[$j]}"
  wait "${host_pid[$j]}" || fail "$j exited non-zero after SIGTERM"
  unset "host_pid[$j]"
done

# ---- 2c. A host paused through a restart of the others without their
# checkpoints: the group it meets on SIGCONT is a new job's (another
# lineage) at a higher round. It is refused with the fix and ends its
# federation, its anchor and round as they are, instead of taking the new
# job's anchor; the others re-form without it.
job=${name}lin
for r in 0 1 2; do start_host "$job" $r "file:$work/lin-store"; done
await_members "$job" 3 0 1 2 >/dev/null
await_round "$job" 3 0 1 2
kill -STOP "${host_pid[$job.2]}"
await_members "$job" 2 0 1 >/dev/null
paused_round=$(stat_of "$job" 2 fed_round) paused_hash=$(stat_of "$job" 2 fed_anchor_hash)
for r in 0 1; do kill -KILL "${host_pid[$job.$r]}"; wait "${host_pid[$job.$r]}" 2>/dev/null || true; done
rm -rf "$work/ckpt-$job/r0" "$work/ckpt-$job/r1" /dev/shm/shmps."$job".r0 /dev/shm/shmps."$job".r1
for r in 0 1; do start_host "$job" $r "file:$work/lin-store"; done
await_members "$job" 2 0 1 >/dev/null
await_round "$job" $((paused_round + 5)) 0 1
kill -CONT "${host_pid[$job.2]}"
for _ in $(seq 300); do [ "$(stat_of "$job" 2 fed_state)" = 4 ] && break; sleep 0.1; done
[ "$(stat_of "$job" 2 fed_state)" = 4 ] || fail "the paused host's fed_state is $(stat_of "$job" 2 fed_state), not 4 (ended)"
grep -q "unrelated lineages.*rank 2, outside the majority" "$work/$job.host2.log" ||
  fail "the paused host did not name the lineages: $(grep federation "$work/$job.host2.log" | tail -3)"
# Its own round still: the one it was at, or the round in flight when it
# stopped (published as it continues), never the new group's (5 past it).
now_round=$(stat_of "$job" 2 fed_round)
[ "$now_round" -le $((paused_round + 1)) ] ||
  fail "the paused host took another round: $now_round, was $paused_round"
[ "$now_round" != "$paused_round" ] || [ "$(stat_of "$job" 2 fed_anchor_hash)" = "$paused_hash" ] ||
  fail "the paused host's anchor changed at round $now_round"
before=$(stat_of "$job" 0 fed_round)
await_members "$job" 2 0 1 >/dev/null
await_round "$job" $((before + 3)) 0 1
"$train" --connect "$job.r2" --evaluate >"$work/lin.log" 2>&1 || fail "the paused host does not serve: $(tail -3 "$work/lin.log")"
echo "a host paused through a restart of the others without checkpoints: refused at round $paused_round, its anchor kept; the others went on"
for r in 0 1 2; do
  kill -TERM "${host_pid[$job.$r]}"
  wait "${host_pid[$job.$r]}" || fail "host $r of $job exited non-zero after SIGTERM"
  unset "host_pid[$job.$r]"
done

# ---- 2d. A host that served alone keeps its training. Hosts 0 and 1
# stopped (SIGSTOP): host 2 has no majority, pauses, serves its worker
# alone and checkpoints that training at its last round; it is SIGKILLed,
# hosts 0 and 1 continue and complete rounds without it. Restarted from
# that checkpoint, host 2 is in none of the rounds since (the record of
# groups names their members), so its join rebases the checkpoint's drift
# onto their anchor instead of dropping it. The stop comes right after a
# round completed, rounds every 500 ms: one inside a round's collectives
# could leave that round completed at hosts 0 and 1 with host 2 in it
# (then its drift is merged, and rightly not kept).
job=${name}solo
every_ms=500
for r in 0 1 2; do start_host "$job" $r "file:$work/solo-store"; done
await_members "$job" 3 0 1 2 >/dev/null
await_round "$job" 3 0 1 2
done_round=$(stat_of "$job" 0 fed_round)
for _ in $(seq 300); do [ "$(stat_of "$job" 0 fed_round)" -gt "$done_round" ] && break; sleep 0.005; done
kill -STOP "${host_pid[$job.0]}" "${host_pid[$job.1]}"
for _ in $(seq 300); do [ "$(stat_of "$job" 2 fed_state)" = 3 ] && break; sleep 0.1; done
[ "$(stat_of "$job" 2 fed_state)" = 3 ] || fail "host 2 alone: fed_state $(stat_of "$job" 2 fed_state), not 3 (paused)"
"$train" --workers 1 --epochs 1 --train-limit 3000 --connect "$job.r2" --seed 21 >"$work/solo.log" 2>&1 ||
  fail "host 2 alone does not serve its worker: $(tail -3 "$work/solo.log")"
version=$(stat_of "$job" 2 version)
ckpt=$(printf 'ckpt-%020d.shmps' "$version")
for _ in $(seq 100); do [ -e "$work/ckpt-$job/r2/$ckpt" ] && break; sleep 0.1; done
[ -e "$work/ckpt-$job/r2/$ckpt" ] || fail "host 2 wrote no checkpoint of version $version within 10 s"
solo_round=$(stat_of "$job" 2 fed_round)
kill -KILL "${host_pid[$job.2]}"
wait "${host_pid[$job.2]}" 2>/dev/null || true
rm -f "/dev/shm/shmps.$job.r2"
kill -CONT "${host_pid[$job.0]}" "${host_pid[$job.1]}"
await_members "$job" 2 0 1 >/dev/null
await_round "$job" $((solo_round + 3)) 0 1
start_host "$job" 2 "file:$work/solo-store"
await_members "$job" 3 0 1 2 >/dev/null
await_log "$work/$job.host2.log" "the join rebases the checkpoint's weights of round $solo_round"
grep -q "so its [1-9][0-9]* local updates not merged as of the checkpoint are kept" "$work/$job.host2.log" ||
  fail "host 2 kept no updates: $(grep 'the join' "$work/$job.host2.log" | tail -2)"
await_equal_anchors "$job" >/dev/null
echo "a host that trained alone at round $solo_round (version $version), killed and restarted at round" \
  "$(stat_of "$job" 2 fed_round): $(sed -n 's/.*so its \([0-9]*\) local updates not merged.*/\1/p' "$work/$job.host2.log") local updates rebased"
for r in 0 1 2; do
  kill -TERM "${host_pid[$job.$r]}"
  wait "${host_pid[$job.$r]}" || fail "host $r of $job exited non-zero after SIGTERM"
  unset "host_pid[$job.$r]"
done
unset every_ms

# ---- 2e. A host killed as it re-formed, restarted at once. Host 0 of a
# group of two is killed; host 1, re-forming, has written its want at the
# highest attempt in the store when it is killed too. Restarted, the new
# host 1 finds that want at its first attempt: a dead server's, not a
# second server given its id, so it must not end its federation. The
# kill comes inside a paused host's try: a second after the pause it
# writes its want, then settles for the timeout (4 s here) before writing
# what it saw (after which a newcomer's attempt is the next one).
job=${name}kill
timeout_ms=4000
for r in 0 1; do start_host "$job" $r "file:$work/kill-store"; done
await_members "$job" 2 0 1 >/dev/null
await_round "$job" 3 0 1
kill -KILL "${host_pid[$job.0]}"
wait "${host_pid[$job.0]}" 2>/dev/null || true
await_log "$work/$job.host1.log" "no majority: federation pauses"
sleep 2.5
kill -KILL "${host_pid[$job.1]}"
wait "${host_pid[$job.1]}" 2>/dev/null || true
rm -f /dev/shm/shmps."$job".r0 /dev/shm/shmps."$job".r1
for r in 0 1; do start_host "$job" $r "file:$work/kill-store"; done
took=$(await_members "$job" 2 0 1)
! grep -q "two servers were given" "$work/$job.host1.log" || fail "the restarted host 1 took its predecessor's want for a second server's"
grep -q "has another server's want as host 1" "$work/$job.host1.log" ||
  fail "the restarted host 1 met no want of its predecessor (killed outside its try?): $(grep federation "$work/$job.host1.log" | tail -4)"
echo "hosts 0 and 1 killed as host 1 re-formed, restarted: 2 members after $took s"
for r in 0 1; do
  kill -TERM "${host_pid[$job.$r]}"
  wait "${host_pid[$job.$r]}" || fail "host $r of $job exited non-zero after SIGTERM"
  unset "host_pid[$job.$r]"
done
timeout_ms=2000

# ---- 2f. The store swept. sweep_check JOB STORE KEYS FLOOR LOWER: host 0
# of JOB alone for 8 s, paused, tries every half second or so (a 300 ms
# timeout: a settle, then a pause of half of it), each try an attempt's
# keys in the store; then hosts 1 and 2 start, and the group forms at an
# epoch past those attempts. Its rank 0 moves the floor to the epoch
# before its own (FLOOR prints the store's floor) and erases the attempts
# below, a few a round: some rounds later the store holds one attempt's
# keys and a few records (KEYS prints how many keys), not two per
# attempt. Then a floor value far below is added, as a rank 0 of an old
# group, stopped as it moved the floor, would add it late (LOWER N adds
# N): the floor stays where it was (the highest value counts). Host 2,
# SIGKILLed and restarted, joins through the swept store within the limit
# (from a lowered floor it would count attempts up, a try each, over the
# erased ones), and the store stays as small.
sweep_check() {
  local job=$1 store=$2 count=$3 floor=$4 lower=$5 epoch keys took at
  timeout_ms=300
  start_host "$job" 0 "$store"
  sleep 8
  for r in 1 2; do start_host "$job" $r "$store"; done
  await_members "$job" 3 0 1 2 >/dev/null
  epoch=$(stat_of "$job" 0 fed_epoch)
  [ "$epoch" -ge 12 ] || fail "host 0 alone made only $epoch attempts in 8 s: too few to test the sweep"
  await_round "$job" $(($(stat_of "$job" 0 fed_round) + 10)) 0 1 2
  keys=$($count)
  at=$($floor)
  echo "sweep ($store): the group formed at epoch $epoch; 10 rounds later the floor is $at, $keys keys in the store"
  [ "$at" = $((epoch - 1)) ] || fail "the floor is $at, not $((epoch - 1)) (the epoch before the group's)"
  [ "$keys" -le 24 ] || fail "the store of a group at epoch $epoch holds $keys keys: the attempts before it were not swept"
  $lower 2
  [ "$($floor)" = "$at" ] || fail "a floor value of 2 added late moved the floor from $at to $($floor)"
  kill -KILL "${host_pid[$job.2]}"
  wait "${host_pid[$job.2]}" 2>/dev/null || true
  await_members "$job" 2 0 1 >/dev/null
  rm -f "/dev/shm/shmps.$job.r2"
  start_host "$job" 2 "$store"
  took=$(await_members "$job" 3 0 1 2)
  within_limit "$took" || fail "host 2 took $took s to join through the swept store"
  await_round "$job" $(($(stat_of "$job" 0 fed_round) + 10)) 0 1 2
  keys=$($count)
  echo "sweep ($store): host 2 killed and restarted, 3 members after $took s, epoch $(stat_of "$job" 0 fed_epoch), floor $($floor); $keys keys"
  [ "$keys" -le 24 ] || fail "after host 2's restart the store holds $keys keys"
  for r in 0 1 2; do
    kill -TERM "${host_pid[$job.$r]}"
    wait "${host_pid[$job.$r]}" || fail "host $r of $job exited non-zero after SIGTERM"
    unset "host_pid[$job.$r]"
  done
  timeout_ms=2000
}
file_keys() { find "$work/sweep-store" -type f | wc -l; }
file_floor() { ls "$work/sweep-store/floors" 2>/dev/null | sort -n | tail -1; }
file_lower() { : >"$work/sweep-store/floors/$1"; }
sweep_check "${name}sweep" "file:$work/sweep-store" file_keys file_floor file_lower

# ---- 3. The Redis store.
if ! command -v redis-server >/dev/null; then
  echo "redis part SKIPPED: redis-server not found (tools/install-deps.sh installs it)"
  echo "PASS"
  exit 0
fi
port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >"$work/redis.log" 2>&1 &
redis_pid=$!
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
job=${name}x
for r in 0 1 2; do start_host "$job" $r "redis:127.0.0.1:$port/$job"; done
echo "redis store: formed with 3 members in $(await_members "$job" 3 0 1 2) s"
await_round "$job" 5 0 1 2
await_equal_anchors "$job"
kill -KILL "${host_pid[$job.0]}"
took=$(await_members "$job" 2 1 2)
echo "redis store: SIGKILL of host 0: hosts 1 and 2 showed 2 members after $took s"
within_limit "$took" || fail "re-forming through redis took $took s"
for r in 1 2; do
  kill -TERM "${host_pid[$job.$r]}"
  wait "${host_pid[$job.$r]}" || fail "host $r exited non-zero"
  unset "host_pid[$job.$r]"
done
redis_keys() { redis-cli -p "$port" --scan --pattern "${name}rs/*" | wc -l; }
redis_floor() { redis-cli -p "$port" zrevrange "${name}rs/floors" 0 0; }
redis_lower() { redis-cli -p "$port" zadd "${name}rs/floors" "$1" "$1" >/dev/null; }
sweep_check "${name}rs" "redis:127.0.0.1:$port/${name}rs" redis_keys redis_floor redis_lower
echo "PASS"
