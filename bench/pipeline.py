#!/usr/bin/env python3
"""shmps-train with and without --pipeline (docs/benchmarks.md, "A
pipelined worker"): per worker count, runs alternate between the two loops
(--pairs of them), and the table gives medians (ranges in brackets) of the
training wall time, the CPUs busy while it trains (/proc/stat, from 1 s
after the workers start to 0.5 s before the first scoring), the time to the first evaluation at or above
--target (weights snapshotted every --eval-every updates and scored after
training, so the times are training alone) and the final test accuracy.

    bench/pipeline.py [--pairs 3] [--epochs 12] [--workers 1 2] [--target 0.87]
"""

import argparse
import csv
import os
import re
import statistics
import subprocess
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_times():
    """(busy, total) jiffies of all CPUs, and the CPU count."""
    with open("/proc/stat") as f:
        lines = f.read().splitlines()
    fields = [int(x) for x in lines[0].split()[1:9]]
    idle = fields[3] + fields[4]
    cpus = sum(1 for line in lines if re.match(r"cpu\d", line))
    return sum(fields) - idle, sum(fields), cpus


def run(bin_dir, workers, pipeline, args, tmp):
    out_csv = os.path.join(tmp, "curve.csv")
    cmd = [os.path.join(bin_dir, "shmps-train"), "--workers", str(workers), "--epochs", str(args.epochs),
           "--eval-every", str(args.eval_every), "--csv", out_csv] + (["--pipeline"] if pipeline else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, marks = [], {}  # marks: when training started ("... epochs of N pushes") and was first scored

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "epochs of" in line:
                marks.setdefault("start", time.monotonic())
            if line.startswith("epoch "):
                marks.setdefault("end", time.monotonic())

    reader = threading.Thread(target=read)
    reader.start()
    samples = []  # (time, busy, total)
    while proc.poll() is None:
        busy, total, cpus = cpu_times()
        samples.append((time.monotonic(), busy, total))
        time.sleep(0.25)
    reader.join()
    out = "".join(lines)
    if proc.returncode != 0:
        raise SystemExit(f"pipeline.py: {' '.join(cmd)} failed ({proc.returncode}):\n{out[-2000:]}")
    start, end = marks.get("start", 0) + 1.0, marks.get("end", 0) - 0.5
    window = [s for s in samples if start <= s[0] <= end]
    busy = (window[-1][1] - window[0][1]) / (window[-1][2] - window[0][2]) * cpus if len(window) > 1 else float("nan")
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    reached = [float(r["elapsed_s"]) for r in rows if float(r["test_acc"]) >= args.target]
    return {"wall": float(re.search(r"wall time ([0-9.]+) s", out).group(1)), "busy": busy,
            "to_target": reached[0] if reached else float("nan"),
            "accuracy": float(re.search(r"final test accuracy: ([0-9.]+)", out).group(1))}


def cell(values, fmt):
    m = statistics.median(values)
    return f"{m:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.path.join(ROOT, "build", "default", "bin"))
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--target", type=float, default=0.87)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeline") as tmp:
        for workers in args.workers:
            for pair in range(args.pairs):
                for pipeline in (False, True):
                    r = run(args.bin, workers, pipeline, args, tmp)
                    results.setdefault((workers, pipeline), []).append(r)
                    print(f"  {workers} workers, {'pipelined' if pipeline else 'one step at a time'}, pair {pair}: "
                          f"{r['wall']:.1f} s, {r['busy']:.2f} CPUs busy, {args.target} at {r['to_target']:.1f} s, "
                          f"accuracy {r['accuracy']:.4f}", flush=True)
    print(f"\nshmps-train, {args.epochs} epochs, {args.pairs} alternating pairs (medians, ranges)\n")
    print(f"| workers | loop | wall s | CPUs busy | s to {args.target} | final accuracy |")
    print("|---:|---|---:|---:|---:|---:|")
    for (workers, pipeline), rs in results.items():
        print(f"| {workers} | {'--pipeline' if pipeline else 'default'} | {cell([r['wall'] for r in rs], '.1f')} | "
              f"{cell([r['busy'] for r in rs], '.2f')} | {cell([r['to_target'] for r in rs], '.1f')} | "
              f"{cell([r['accuracy'] for r in rs], '.4f')} |")


if __name__ == "__main__":
    main()
