#!/usr/bin/env bash
# Federation over MPI with real processes (CTest label multihost): three
# shmps-servers started by one `mpirun --oversubscribe -np 3` on this
# machine, each its own "host" (--fed-rank-in-name: segments <name>.r0..2),
# and one shmps-train --connect per host on a Fashion-MNIST subset, all at
# once. Checks: every host completes rounds and, once training is done,
# shows the same anchor hash; the merged model's test accuracy (scored by
# shmps-train --evaluate) is at least the single-host run's of the same
# per-host budget (one worker, same epochs and subset, its own server)
# minus 1 pp; a SIGTERM to mpirun stops every server cleanly (each
# announces its leave) and leaves nothing in /dev/shm. Then MPI's
# fail-stop and its recovery: with checkpoints every second and trainers
# running, a SIGKILLed rank (past round 10) ends the whole job and
# mpirun's message names that rank; the job restarted from the
# checkpoints resumes the rounds (each host's version restored, every
# host at the round of the newest checkpointed anchor or past it), the
# anchors are equal, and a further round of training merges into a model
# that still scores well. Then one rank SIGTERMed alone: it stops, removes
# its segment and says that its process ends with the job's (MPI_Finalize
# waits for every rank), alive meanwhile, while the others serve. Last, a
# host SIGSTOPped while another stops: the
# stopping server leaves its federation thread behind in the collective and
# writes no final checkpoint without the federation's state, so the job's
# restart restores its newest checkpoint, which holds it.
# Usage: mpi_federation.sh <build-dir>. Exit 77 (skipped) without mpirun or
# without the MPI plugin.
set -euo pipefail
build=$1
command -v mpirun >/dev/null || { echo "SKIP: mpirun not found (tools/install-deps.sh installs openmpi-bin)"; exit 77; }
[ -f "$build/lib/shmps/libshmps_fed_mpi.so" ] || { echo "SKIP: no MPI plugin in $build (configure found no MPI)"; exit 77; }
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] ||
  { echo "SKIP: Fashion-MNIST is not at /usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist)"; exit 77; }
server=$build/bin/shmps-server
inspect=$build/bin/shmps-inspect
train=$build/bin/shmps-train
name=fedmpi$$
work=$(mktemp -d)
mpi_pid=
cleanup() {
  [ -n "$mpi_pid" ] && kill -KILL "$mpi_pid" 2>/dev/null || true
  pkill -KILL -f "shmps-server --name $name" 2>/dev/null || true
  rm -f /dev/shm/shmps."$name".* 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
# A command that fails unchecked names itself (set -e alone would end the
# test silently).
set -E
trap 'echo "FAIL: \"$BASH_COMMAND\" exited $? (line $LINENO${FUNCNAME:+, called from lines ${BASH_LINENO[*]}})" >&2' ERR
fail() {  # to stderr: a failure inside $(...) or >/dev/null is still seen
  { echo "FAIL: $*"; for f in "$work"/*.log; do echo "---- $f"; tail -20 "$f"; done; } >&2
  exit 1
}
as_root=()
[ "$(id -u)" -eq 0 ] && as_root=(--allow-run-as-root)
model=(--tensor fc1.weight:256x784 --tensor fc1.bias:256 --tensor fc2.weight:10x256 --tensor fc2.bias:10
       --optimizer adam --lr 0.001 --init normal --init-scale 0.05 --backend host)
subset=(--workers 1 --epochs 3 --train-limit 30000)

# start_job LOG [server options...]
start_job() {
  local log=$1
  shift
  # Open MPI's shared-memory segments in the test's directory: a job whose
  # rank was killed leaves them behind, and /dev/shm must not keep them.
  # Ranks not bound to cores: each server runs where the test does.
  mpirun "${as_root[@]}" --oversubscribe --bind-to none --mca btl_vader_backing_directory "$work" -np 3 "$server" --name "$name" --fed-rank-in-name --federation mpi \
    --fed-every-ms 50 "${model[@]}" "$@" >"$work/$log.log" 2>&1 &
  mpi_pid=$!
  for _ in $(seq 100); do
    [ -e /dev/shm/shmps.$name.r0 ] && [ -e /dev/shm/shmps.$name.r1 ] && [ -e /dev/shm/shmps.$name.r2 ] && return 0
    sleep 0.1
  done
  fail "the three servers did not start within 10 s"
}
# start_trainers LOG SEED [shmps-train options]: one trainer per host in
# the background (LOG<host>.log, seeds SEED, SEED+1, ...); pids in `pids`.
start_trainers() {
  local log=$1 seed=$2
  shift 2
  pids=()
  for r in 0 1 2; do
    "$train" "$@" --connect "$name.r$r" --seed $((r + seed)) >"$work/$log$r.log" 2>&1 &
    pids+=($!)
  done
}
# score_at_least_reference LOG HOST WHAT: scores HOST's weights (shmps-train
# --evaluate) and fails below the single-host reference minus 1 pp.
score_at_least_reference() {
  "$train" --connect "$name.r$2" --evaluate >"$work/$1.log" 2>&1 || fail "scoring $3 failed"
  local acc
  acc=$(accuracy "$work/$1.log")
  echo "$3: test accuracy $acc (single host: $reference)"
  python3 -c "import sys; sys.exit(0 if $acc >= $reference - 0.01 else 1)" ||
    fail "$3 reached $acc, below the single-host $reference - 1 pp"
}
# stop_job LOG: SIGTERM to mpirun; every server must log a clean stop
# (Open MPI's mpirun forwards the SIGTERM and then exits 1 whatever its
# ranks did, so the servers' own log says).
stop_job() {
  kill -TERM "$mpi_pid"
  wait "$mpi_pid" || true
  mpi_pid=
  local stops
  stops=$(grep -c "shmps-server info: stopped: version" "$work/$1.log" || true)
  [ "$stops" = 3 ] || fail "$stops of 3 servers logged a clean stop ($1)"
}
accuracy() { sed -n 's/^final test accuracy: \([0-9.]*\).*/\1/p' "$1"; }
field() { python3 -c "import json,sys; s=json.load(sys.stdin)['stats']; print(s['$1'])"; }
stat_of() { "$inspect" --json "$name.r$1" | field "$2"; }
pid_of_rank() { "$inspect" --json "$name.r$1" | python3 -c "import json,sys; print(json.load(sys.stdin)['header']['server_pid'])"; }

# Waits (up to 10 s) until the three hosts show the same anchor hash; sets
# `hashes` and `rounds`, and `same` to host 0's round (empty on failure).
await_equal_anchors() {
  same=
  for _ in $(seq 100); do
    hashes=() rounds=()
    for r in 0 1 2; do
      j=$("$inspect" --json "$name.r$r") || fail "shmps-inspect $name.r$r"
      rounds+=("$(field fed_round <<<"$j")")
      hashes+=("$(field fed_anchor_hash <<<"$j")")
    done
    if [ "${hashes[0]}" = "${hashes[1]}" ] && [ "${hashes[1]}" = "${hashes[2]}" ]; then
      same=${rounds[0]}
      return 0
    fi
    sleep 0.1
  done
}

# ---- the single-host reference: the same per-host budget, alone.
"$train" "${subset[@]}" --seed 1 >"$work/reference.log" 2>&1 || fail "the single-host reference run failed"
reference=$(accuracy "$work/reference.log")

# ---- three hosts, one trainer each.
# The federation's threads on the first CPU this test may use.
allowed=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/$$/status)
first_cpu=${allowed%%[-,]*}
[ "$first_cpu" != "$allowed" ] ||
  echo "NOTE: this test may use CPU $allowed only, so the federation's placement is not told apart from the consumer's"
start_job servers --fed-cpus "$first_cpu"
start_trainers train 1 "${subset[@]}"
# Each server's threads by name: one consumer (shmps-server: the trainer's
# 203,530-element tensor is below the size whose updates OpenMP splits),
# the round loop (shmps-fed), and whatever MPI started, named and placed
# as an engine's own threads are (shmps-fed-io; or shmps-fed, started
# later from the round loop); the checkpoint writer (shmps-ckpt), the
# reload parser (shmps-reload) and the orphan sweeper (shmps-sweep). The
# federation's on --fed-cpus; the consumer where mpirun started it (not
# bound: --bind-to none), on every CPU the test has.
for r in 0 1 2; do
  server_pid=$("$inspect" --json "$name.r$r" | python3 -c "import json,sys; print(json.load(sys.stdin)['header']['server_pid'])")
  consumers=0 loops=0 others=""
  for t in /proc/"$server_pid"/task/*; do
    comm=$(cat "$t/comm" 2>/dev/null) || continue
    cpus=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' "$t/status" 2>/dev/null) || continue
    case $comm in
      shmps-server)
        consumers=$((consumers + 1))
        [ "$cpus" = "$allowed" ] || fail "host $r's consumer on CPUs $cpus, not $allowed (the federation's: $first_cpu)"
        ;;
      shmps-fed | shmps-fed-io)
        [ "$comm" = shmps-fed ] && loops=$((loops + 1))
        [ "$cpus" = "$first_cpu" ] || fail "host $r: $comm on CPUs $cpus, not --fed-cpus $first_cpu"
        ;;
      shmps-ckpt | shmps-reload | shmps-sweep) ;;
      *) others="$others '$comm'" ;;
    esac
  done
  [ "$consumers" = 1 ] && [ "$loops" -ge 1 ] && [ -z "$others" ] ||
    fail "host $r's server: $consumers threads named shmps-server (not 1), $loops shmps-fed (none), others:$others"
done
for r in 0 1 2; do wait "${pids[$r]}" || fail "shmps-train on host $r failed"; done

# The same anchor on every host: once the trainers are done no host has
# updates, so the rounds that follow move no anchor and the three hashes
# stay put (read until they agree).
await_equal_anchors
[ -n "$same" ] || fail "the anchor hashes never agreed: ${hashes[*]} at rounds ${rounds[*]}"
[ "$same" -ge 5 ] || fail "only $same rounds"
members=$(stat_of 1 fed_members)
[ "$members" = 3 ] || fail "host 1 saw $members members"
echo "rounds ${rounds[*]}: anchor hash ${hashes[0]} on all three hosts"

# Each trainer scored its host's weights as it ended (other hosts may
# still have been training, so these are a host's passing state); the
# federation's result is the merged model, the same on every host now.
for r in 0 1 2; do echo "host $r: test accuracy $(accuracy "$work/train$r.log") as its trainer ended"; done
score_at_least_reference merged 2 "the merged model"
stop_job servers
ls /dev/shm/shmps.$name.* >/dev/null 2>&1 && fail "left in /dev/shm: $(ls /dev/shm/shmps.$name.*)"
grep -q "shmps-server error" "$work/servers.log" && fail "a server logged an error"

# ---- fail-stop: SIGKILL rank 1 past round 10, trainers running and
# checkpoints every second; mpirun ends the job and names it.
ckpt=$work/ckpt
start_job killed --checkpoint-dir "$ckpt" --checkpoint-interval-s 1
start_trainers doomed 4 --workers 1 --epochs 20 --train-limit 30000
victim=$(pgrep -f "shmps-server --name $name" | while read -r p; do
  if tr '\0' ' ' </proc/$p/environ 2>/dev/null | grep -q "OMPI_COMM_WORLD_RANK=1 "; then echo "$p"; fi
done)
[ -n "$victim" ] || fail "rank 1's process not found"
for _ in $(seq 300); do
  ready=1
  for r in 0 1 2; do
    [ "$(stat_of $r fed_round)" -ge 10 ] && [ -n "$(ls "$ckpt/r$r" 2>/dev/null)" ] || ready=
  done
  [ -n "$ready" ] && break
  sleep 0.1
done
[ -n "$ready" ] || fail "no round 10 with a checkpoint on every host within 30 s"
sleep 1.2  # a checkpoint with training in it on every host
start=$(date +%s%N)
kill -KILL "$victim"
for _ in $(seq 200); do kill -0 "$mpi_pid" 2>/dev/null || break; sleep 0.05; done
kill -0 "$mpi_pid" 2>/dev/null && fail "mpirun still runs 10 s after rank 1 was killed"
set +e
wait "$mpi_pid"
rc=$?
set -e
mpi_pid=
ms=$((($(date +%s%N) - start) / 1000000))
[ "$rc" -ne 0 ] || fail "mpirun exited 0 after a rank was killed"
grep -q "rank 1" "$work/killed.log" || fail "mpirun's message does not name rank 1"
echo "a SIGKILLed rank ended the job in $ms ms (mpirun exit $rc)"
for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
rm -f /dev/shm/shmps."$name".* 2>/dev/null || true

# ---- the whole-job restart from the checkpoints.
start_job restarted --checkpoint-dir "$ckpt" --checkpoint-interval-s 1
# Each server logs its restore before it publishes its segment.
for _ in $(seq 200); do
  [ "$(grep -c "federation over mpi" "$work/restarted.log" || true)" = 3 ] && break
  sleep 0.05
done
for r in 0 1 2; do
  for _ in $(seq 200); do "$inspect" "$name.r$r" >/dev/null 2>&1 && break; sleep 0.05; done
done
newest=0
for r in 0 1 2; do
  round=$(sed -n "s|.*restored checkpoint $ckpt/r$r/.*federation round \([0-9]*\).*|\1|p" "$work/restarted.log")
  [ -n "$round" ] || fail "host $r restored no checkpoint with a federation state"
  [ "$round" -gt "$newest" ] && newest=$round
  echo "host $r restored its checkpoint of round $round, version $(stat_of $r version)"
  [ "$(stat_of $r version)" -gt 0 ] || fail "host $r restored no training"
done
for _ in $(seq 100); do
  [ "$(grep -c "resumed at round $newest from rank" "$work/restarted.log" || true)" = 3 ] && break
  sleep 0.1
done
[ "$(grep -c "resumed at round $newest from rank" "$work/restarted.log" || true)" = 3 ] ||
  fail "the three hosts did not all resume at round $newest (the newest checkpointed anchor)"
await_equal_anchors
[ -n "$same" ] || fail "after the restart the anchor hashes never agreed: ${hashes[*]} at rounds ${rounds[*]}"
[ "$same" -ge "$newest" ] || fail "resumed at round $same, below the newest checkpointed round $newest"
echo "resumed at round $newest: anchor hash ${hashes[0]} on all three hosts"
# The run goes on: two more epochs per host, merged, still a good model.
# The checkpoints hold a second or two of training (the kill comes soon
# after round 10), so the resumed run is given about the rest of the
# reference's budget: with less, the score sits within noise of the 1 pp
# margin.
start_trainers resumed 7 --workers 1 --epochs 2 --train-limit 30000
for r in 0 1 2; do wait "${pids[$r]}" || fail "shmps-train on host $r failed after the restart"; done
await_equal_anchors
[ -n "$same" ] || fail "after more training the anchor hashes never agreed: ${hashes[*]}"
score_at_least_reference resumed 0 "the model after the restart and two more epochs"
# ---- one rank stopped alone while the others run: it announces its
# leave, stops and removes its segment, then says that its process ends
# only when every rank has stopped (MPI_Finalize waits for them: mpirun
# would abort the job without it); the other two go on serving. The
# job's stop then ends all three (rank 2's "stopped" line is already in
# the log: stop_job still counts 3).
finalizing="this process ends when every rank of the job has stopped"
r2=$(pid_of_rank 2)
kill -TERM "$r2"
for _ in $(seq 200); do grep -q "$finalizing" "$work/restarted.log" && break; sleep 0.05; done
grep -q "$finalizing" "$work/restarted.log" ||
  fail "rank 2 did not say within 10 s of its SIGTERM that its process waits for the other ranks"
[ -e "/dev/shm/shmps.$name.r2" ] && fail "rank 2's segment is still in /dev/shm after its stop"
kill -0 "$r2" 2>/dev/null || fail "rank 2's process ended while the other ranks run (no MPI_Finalize wait?)"
for r in 0 1; do "$inspect" "$name.r$r" >/dev/null || fail "host $r does not answer after rank 2 stopped"; done
echo "rank 2 stopped alone: segment removed, its process waits in MPI_Finalize for the two others, which serve"
stop_job restarted
# The lines come after each "stopped": read until all three are there.
for _ in $(seq 200); do [ "$(grep -c "$finalizing" "$work/restarted.log" || true)" = 3 ] && break; sleep 0.05; done
[ "$(grep -c "$finalizing" "$work/restarted.log" || true)" = 3 ] ||
  fail "$(grep -c "$finalizing" "$work/restarted.log" || true) of 3 servers said their process waits for the others"
# mpirun may exit before its ranks do: rank 2 ends with the others.
for _ in $(seq 200); do kill -0 "$r2" 2>/dev/null || break; sleep 0.05; done
kill -0 "$r2" 2>/dev/null && fail "rank 2's process still runs 10 s after the job's stop"

# ---- a host that hangs (SIGSTOP) while another stops: the stopping
# server's federation thread stays inside a collective and is left behind.
# Its final checkpoint is then not written: one without the federation's
# state would be its newest, and its restart would take it as a host that
# never federated. The newest checkpoint still holds the state: the job's
# restart restores a federation round from it.
hung=$work/ckpt_hung
start_job hung --checkpoint-dir "$hung" --checkpoint-interval-s 1
for _ in $(seq 300); do
  [ "$(stat_of 0 fed_round)" -ge 3 ] && [ -n "$(ls "$hung/r0" 2>/dev/null)" ] && break
  sleep 0.1
done
[ -n "$(ls "$hung/r0" 2>/dev/null)" ] || fail "host 0 wrote no checkpoint within 30 s"
sleep 1.2  # a checkpoint at a merged round past the first
r0=$(pid_of_rank 0)
r1=$(pid_of_rank 1)
kill -STOP "$r1"
sleep 0.3  # the next round's collective waits for host 1
# Updates after the newest checkpoint, applied while the round is stuck:
# the stop has a version to checkpoint.
"$train" --connect "$name.r0" --workers 1 --epochs 1 --train-limit 640 --test-limit 100 >"$work/hung_train.log" 2>&1 ||
  fail "training on host 0 while host 1 is stopped failed"
kill -TERM "$r0"
for _ in $(seq 300); do kill -0 "$r0" 2>/dev/null || break; sleep 0.05; done
kill -0 "$r0" 2>/dev/null && fail "host 0 still runs 15 s after its SIGTERM, host 1 stopped"
kill -CONT "$r1"
grep -q "leaving it behind" "$work/hung.log" || fail "host 0's federation thread was not left behind"
grep -q "final checkpoint of version [0-9]* not written: the federation's state cannot be had" "$work/hung.log" ||
  fail "host 0 did not say that its final checkpoint was not written"
# Its engine left behind is never closed: no line says the process waits.
grep -q "$finalizing" "$work/hung.log" && fail "host 0 says its engine closes, though it was left behind"
kill -KILL "$mpi_pid" 2>/dev/null || true
wait "$mpi_pid" 2>/dev/null || true
mpi_pid=
pkill -KILL -f "shmps-server --name $name" 2>/dev/null || true
rm -f /dev/shm/shmps."$name".* 2>/dev/null || true
start_job rehung --checkpoint-dir "$hung"
for _ in $(seq 200); do
  [ "$(grep -c "federation over mpi" "$work/rehung.log" || true)" = 3 ] && break
  sleep 0.05
done
grep -q "restored checkpoint $hung/r0/.*federation round" "$work/rehung.log" ||
  fail "host 0's newest checkpoint holds no federation state"
echo "a stop that left the federation behind kept host 0's newest checkpoint with its federation state"
stop_job rehung
echo "PASS"
