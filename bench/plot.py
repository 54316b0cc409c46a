#!/usr/bin/env python3
"""Plots shmps-compare's CSV (--csv FILE) into small PNGs: throughput vs
gradient size per system, push+apply over apply alone vs size (goal 1),
4 KiB latency CDF, scaling. Sections missing from the CSV (--section) are
skipped.
Usage: bench/plot.py results.csv OUTDIR   (needs matplotlib)"""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    cells = defaultdict(dict)  # (section, row) -> {column: value}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            cells[(r["section"], r["row"])][r["column"]] = r["value"]
    return cells


def num(text):
    try:
        return float(text)
    except ValueError:
        return float("nan")


def main():
    cells, out = load(sys.argv[1]), sys.argv[2]
    # Throughput vs size.
    series = defaultdict(list)
    for (section, _), c in cells.items():
        if section == "throughput":
            series[c["system"]].append((num(c["bytes"]), num(c["GB/s"])))
    fig, ax = plt.subplots(figsize=(6, 4), dpi=80)
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                linestyle="--" if name.startswith("ref") else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("gradient bytes")
    ax.set_ylabel("push + apply, GB/s of gradient")
    ax.set_title("Throughput vs gradient size (one worker)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{out}/compare_throughput.png")

    # Push + apply over the apply alone (goal 1: <= 1.2 from 1 MiB).
    ratio = defaultdict(list)
    for (section, _), c in cells.items():
        if section == "throughput" and c["system"] != "ref: memcpy" and "push/apply" in c:
            ratio[c["system"]].append((num(c["bytes"]), num(c["push/apply"])))
            # The default server checks first: also over its own work.
            if c["system"] == "shmps" and "push/check+apply" in c:
                ratio["shmps over its own work (check+apply)"].append(
                    (num(c["bytes"]), num(c["push/check+apply"])))
    if ratio:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=80)
        for name, pts in sorted(ratio.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                    linestyle="--" if name.startswith("ref") else "-")
        ax.axhline(1.2, color="grey", linewidth=0.8, linestyle=":")
        ax.axvline(2**20, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("gradient bytes")
        ax.set_ylabel("push + apply time / in-process reference time")
        ax.set_title("Push over the apply alone (over check+apply: where marked)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(f"{out}/compare_overhead.png")

    # Latency CDF.
    cdf = defaultdict(list)
    for (section, row), c in cells.items():
        if section == "latency_cdf":
            cdf[row] = sorted((num(v), num(q)) for q, v in c.items())
    if not cdf:
        return scaling(cells, out)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=80)
    for name, pts in sorted(cdf.items()):
        ax.step([p[0] / 1000 for p in pts], [p[1] for p in pts], where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("round trip of a 4 KiB push, us (one repeat)")
    ax.set_ylabel("fraction of pushes")
    ax.set_title("4 KiB push latency CDF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{out}/compare_latency_cdf.png")
    scaling(cells, out)


def scaling(cells, out):
    sc = defaultdict(list)
    for (section, _), c in cells.items():
        if section == "scaling":
            sc[c["system"]].append((num(c["workers"]), num(c["GB/s"])))
    if not sc:
        return
    fig, ax = plt.subplots(figsize=(6, 4), dpi=80)
    for name, pts in sorted(sc.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                linestyle="--" if name.startswith("ref") else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("worker processes (2 CPU cores)")
    ax.set_ylabel("aggregate GB/s, 1 MiB pushes")
    ax.set_title("Scaling")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{out}/compare_scaling.png")


if __name__ == "__main__":
    main()
