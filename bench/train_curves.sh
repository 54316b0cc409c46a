#!/usr/bin/env bash
# Time to accuracy of shmps-train (issue #7): the in-process ceiling, then
# 1, 2 and 4 workers through a shmps-server with shmps-train's default
# max_staleness and with 0. Every run scores its weights every --eval-every
# updates (snapshotted during training, scored after it, so the times are
# training alone); the table gives per configuration the median over the
# runs of the wall time to the first evaluation at or above the target,
# the final test accuracy and the applied updates per second.
#
# Usage: bench/train_curves.sh [--smoke] [--runs N] [--epochs E] [--target A]
#          [--eval-every N] [--bin DIR] [--out DIR] [--png FILE]
#   --smoke   a few seconds: 6,000 images, 1 epoch, target 0.5, one run
#   --bin     folder of shmps-train and shmps-server (default build/default/bin)
#   --out     folder for the CSVs, logs and summary.csv (default a temp dir)
#   --png     the plot (default OUT/train_curves.png; needs python3 + matplotlib,
#             skipped with a message otherwise)
# Writes OUT/summary.csv (one row per configuration) and OUT/runs.csv (one
# row per run). Exit: 0 done, 1 a run failed, 2 bad usage, 77 no dataset.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/../build/default/bin"
out=""
png=""
runs=2
epochs=8
target=0.87
eval_every=94  # 0.1 epoch of 60,000 images at batch 64
extra=()
smoke=0
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) smoke=1; shift ;;
    --runs) runs="$2"; shift 2 ;;
    --epochs) epochs="$2"; shift 2 ;;
    --target) target="$2"; shift 2 ;;
    --eval-every) eval_every="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --png) png="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "train_curves.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [ "$smoke" = 1 ]; then
  runs=1; epochs=1; target=0.5; eval_every=8
  extra=(--train-limit 6000 --test-limit 500)
fi
train="$bin/shmps-train"
if [ ! -x "$train" ]; then echo "train_curves.sh: no $train (build it, or pass --bin)" >&2; exit 2; fi
if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  echo "train_curves.sh: Fashion-MNIST missing (apt-get install dataset-fashion-mnist); skipped"
  exit 77
fi
if [ -z "$out" ]; then out="$(mktemp -d /tmp/train_curves.XXXXXX)"; fi
mkdir -p "$out"
[ -n "$png" ] || png="$out/train_curves.png"
# The server that shmps-train starts gets a passive OpenMP wait policy from
# it; the in-process run applies the same kernels in its own process, so
# it gets the same policy here (libgomp reads it at load).
export OMP_WAIT_POLICY=passive

# shmps-train's default bound, as its --help states it.
default_staleness="$("$train" --help | sed -n 's/.*--max-staleness arg (=\([0-9]*\)).*/\1/p')"
[ -n "$default_staleness" ] || { echo "train_curves.sh: cannot read the default max_staleness" >&2; exit 1; }

# name|label|options
configs=(
  "inproc|in-process (ceiling)|--in-process"
  "w1_s${default_staleness}|1 worker (max_staleness ${default_staleness})|--workers 1"
  "w2_s${default_staleness}|2 workers (max_staleness ${default_staleness})|--workers 2"
  "w4_s${default_staleness}|4 workers (max_staleness ${default_staleness})|--workers 4"
  "w1_s0|1 worker (max_staleness 0)|--workers 1 --max-staleness 0"
  "w2_s0|2 workers (max_staleness 0)|--workers 2 --max-staleness 0"
  "w4_s0|4 workers (max_staleness 0)|--workers 4 --max-staleness 0"
)

echo "train_curves.sh: $runs run(s) of ${#configs[@]} configurations, $epochs epochs, eval every $eval_every updates, target $target; output in $out"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "config,run,time_to_target_s,updates_to_target,epoch_to_target,final_acc,updates_per_s,rejected,load1" >"$out/runs.csv"
# Runs interleaved (run 1 of every configuration, then run 2, ...), so a
# change of the machine's load spreads over all of them.
for ((r = 1; r <= runs; r++)); do
  for c in "${configs[@]}"; do
    IFS='|' read -r name label opts <<<"$c"
    csv="$out/${name}_run$r.csv"
    # shellcheck disable=SC2086  # opts are words
    if ! "$train" $opts --epochs "$epochs" --eval-every "$eval_every" "${extra[@]}" --csv "$csv" \
        >"$out/${name}_run$r.log" 2>&1; then
      echo "train_curves.sh: $label run $r failed:" >&2
      tail -20 "$out/${name}_run$r.log" >&2
      exit 1
    fi
    load1="$(cut -d' ' -f1 /proc/loadavg)"
    # First evaluation at or above the target; the last row is the end.
    awk -F, -v t="$target" -v name="$name" -v run="$r" -v load="$load1" '
      NR == 1 { next }
      !hit && $5 + 0 >= t { hit = 1; ts = $9; tv = $2; te = $1 }
      { acc = $5; v = $2; el = $9; rej = $7 }
      END {
        if (!hit) { ts = "NA"; tv = "NA"; te = "NA" }
        printf "%s,%d,%s,%s,%s,%.4f,%.0f,%d,%s\n", name, run, ts, tv, te, acc, (el > 0 ? v / el : 0), rej, load
      }' "$csv" >>"$out/runs.csv"
    echo "  $label, run $r: $(tail -1 "$out/runs.csv" | cut -d, -f3,6,7 | awk -F, '{printf "to %s: %s s, final %s, %s updates/s", "'"$target"'", $1, $2, $3}')"
  done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

# Medians per configuration (a run that never reached the target counts as
# slower than any that did; the median is NA when half or more did not).
echo "config,label,runs,time_to_target_s,final_acc,updates_per_s,reached" >"$out/summary.csv"
median() { sort -g | awk '{ if ($1 == "NA") $1 = "inf"; v[NR] = $1 } END {
  if (NR == 0) { print "NA"; exit }
  m = (NR % 2) ? v[(NR + 1) / 2] : ((v[NR / 2] == "inf" || v[NR / 2 + 1] == "inf") ? "inf" : (v[NR / 2] + v[NR / 2 + 1]) / 2)
  print (m == "inf" ? "NA" : m) }'; }
for c in "${configs[@]}"; do
  IFS='|' read -r name label _ <<<"$c"
  rows="$(awk -F, -v n="$name" '$1 == n' "$out/runs.csv")"
  t="$(cut -d, -f3 <<<"$rows" | sed 's/^NA$/inf/' | median)"
  acc="$(cut -d, -f6 <<<"$rows" | median)"
  ups="$(cut -d, -f7 <<<"$rows" | median)"
  reached="$(cut -d, -f3 <<<"$rows" | grep -vc '^NA$' || true)"
  printf '%s,%s,%d,%s,%s,%s,%d\n' "$name" "$label" "$runs" "$t" "$acc" "$ups" "$reached" >>"$out/summary.csv"
done

echo
printf '| %-30s | %-16s | %-14s | %-10s |\n' "configuration" "time to $target" "final test acc" "updates/s"
printf '|%s|%s|%s|%s|\n' "--------------------------------" "------------------" "----------------" "------------"
tail -n +2 "$out/summary.csv" | while IFS=, read -r _ label n t acc ups reached; do
  if [ "$t" = NA ]; then tt="not reached"; else tt="$(printf '%.2f s' "$t")"; fi
  [ "$reached" = "$n" ] || tt="$tt ($reached/$n)"
  printf '| %-30s | %-16s | %-14s | %-10s |\n' "$label" "$tt" "$(printf '%.4f' "$acc")" "$(printf '%.0f' "$ups")"
done
echo "(medians of $runs run(s); wall time from the start of training, evaluation excluded)"

# The plot: one line per configuration, the run whose time to the target
# is the median (the first run when none reached it).
plot_list="$out/plot_list.csv"
echo "label,csv" >"$plot_list"
for c in "${configs[@]}"; do
  IFS='|' read -r name label _ <<<"$c"
  pick="$(awk -F, -v n="$name" '$1 == n { print ($3 == "NA" ? "inf" : $3), $2 }' "$out/runs.csv" | sort -g |
    awk '{ r[NR] = $2 } END { print r[int((NR + 1) / 2)] }')"
  echo "$label,$out/${name}_run${pick}.csv" >>"$plot_list"
done
if command -v python3 >/dev/null && python3 -c 'import matplotlib' 2>/dev/null; then
  python3 "$here/train_curves_plot.py" "$plot_list" "$target" "$png"
  echo "plot: $png"
else
  echo "plot skipped: python3 with matplotlib not found (pip install matplotlib)"
fi
