#!/usr/bin/env python3
"""Plots the curves bench/train_curves.sh lists: test accuracy vs training
wall time, one line per configuration, with the target as a dashed line.
Usage: bench/train_curves_plot.py PLOT_LIST.csv TARGET OUT.png  (needs matplotlib)"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


COLOURS = {"1": "tab:blue", "2": "tab:orange", "4": "tab:green"}


def main():
    plot_list, target, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    with open(plot_list, newline="") as f:
        series = list(csv.DictReader(f))
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=80)
    for s in series:
        with open(s["csv"], newline="") as f:
            rows = list(csv.DictReader(f))
        t = [float(r["elapsed_s"]) for r in rows]
        acc = [float(r["test_acc"]) for r in rows]
        # Colour: the worker count (black: in-process); dashed: max_staleness 0.
        label = s["label"]
        colour = "black" if label.startswith("in-process") else COLOURS.get(label.split()[0], None)
        style = "--" if "max_staleness 0" in label else "-"
        width = 2.0 if label.startswith("in-process") else 1.2
        ax.plot(t, acc, color=colour, linestyle=style, linewidth=width, label=label)
    ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")
    lo = max(0.0, target - 0.12)
    ax.set_ylim(lo, min(1.0, target + 0.05))
    ax.set_xlabel("training wall time, s (evaluation excluded)")
    ax.set_ylabel("test accuracy")
    ax.set_title("shmps-train on Fashion-MNIST: accuracy vs time (2 shared cores)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
