#!/usr/bin/env bash
# CTest smoke test of bench/train_curves.sh (the time-to-accuracy
# benchmark): runs its --smoke mode and checks that summary.csv holds the
# seven configurations in order, each with one run, a final accuracy in
# (0, 1], updates/s > 0 and a time to the target or NA, and that runs.csv
# and every curve exist. Exit 77 (skipped) without the dataset.
# Usage: check_train_curves.sh SOURCE_DIR BIN_DIR OUT_DIR
set -euo pipefail
src="$1" bin="$2" out="$3"
rm -rf "$out"
rc=0
"$src/bench/train_curves.sh" --smoke --bin "$bin" --out "$out" || rc=$?
if [ "$rc" -eq 77 ]; then exit 77; fi
if [ "$rc" -ne 0 ]; then echo "FAIL: train_curves.sh exited $rc"; exit 1; fi

fail() { echo "FAIL: $*" >&2; exit 1; }
[ -f "$out/summary.csv" ] || fail "no summary.csv"
[ "$(head -1 "$out/summary.csv")" = "config,label,runs,time_to_target_s,final_acc,updates_per_s,reached" ] ||
  fail "summary.csv header: $(head -1 "$out/summary.csv")"
s="$("$bin/shmps-train" --help | sed -n 's/.*--max-staleness arg (=\([0-9]*\)).*/\1/p')"
want="inproc w1_s$s w2_s$s w4_s$s w1_s0 w2_s0 w4_s0"
have="$(tail -n +2 "$out/summary.csv" | cut -d, -f1 | tr '\n' ' ' | sed 's/ $//')"
[ "$have" = "$want" ] || fail "configurations: want '$want', have '$have'"
tail -n +2 "$out/summary.csv" | awk -F, '
  NF != 7 { print "FAIL: " NF " fields: " $0; bad = 1; next }
  $3 != 1 { print "FAIL: runs " $3 ": " $0; bad = 1 }
  !($5 > 0 && $5 <= 1) { print "FAIL: final_acc " $5 ": " $0; bad = 1 }
  !($6 > 0) { print "FAIL: updates_per_s " $6 ": " $0; bad = 1 }
  !($4 == "NA" || $4 >= 0) { print "FAIL: time_to_target_s " $4 ": " $0; bad = 1 }
  END { exit bad }' || exit 1
[ "$(tail -n +2 "$out/runs.csv" | wc -l)" -eq 7 ] || fail "runs.csv: want 7 rows"
for c in $want; do
  [ "$(tail -n +2 "$out/${c}_run1.csv" | wc -l)" -ge 3 ] || fail "${c}_run1.csv: fewer than 3 evaluations"
done
echo "train_curves.sh smoke: 7 configurations, all rows present"
