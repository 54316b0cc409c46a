#!/usr/bin/env python3
"""What a reload costs serving: the worst push + pull step of one worker in
1 s windows with one SIGHUP each, against windows without, for a server
whose config file holds 4096 tensor lines (a large model's table, whose
parse takes tens of milliseconds). Given two build directories, their
servers run in turns (interleaved, 3 turns each), so that both see the
same machine. Prints a table of medians (docs/operations.md, "Change the
learning rate live").

    PYTHONPATH=build/default/python python3 bench/reload_stall.py \
        --builds OLD_BUILD NEW_BUILD [--windows 9]
"""
import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time

import shmps


def measure(server_bin, windows, out, work):
    """Appends the worst step of each window to out[False] (no reload)
    and out[True] (one SIGHUP 0.3 s into it)."""
    name = "reloadstall%d" % os.getpid()
    cfg = os.path.join(work, name + ".conf")
    with open(cfg, "w") as f:
        f.write("name = %s\n" % name + "".join("tensor = layer%d.weight:8\n" % i for i in range(4096)))
    with open(cfg + ".log", "w") as log:
        server = subprocess.Popen([server_bin, "--config", cfg, "--backend", "host"], stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        w = None
        deadline = time.time() + 30
        while w is None:
            try:
                w = shmps.connect(name)
            except shmps.Error:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        grad = w.register_buffer(4 * w.total_elements)
        weights = w.register_buffer(4 * w.total_elements)
        version = w.pull(weights)
        for _ in range(windows):
            for reload in (False, True):
                worst, sent, end = 0.0, False, time.time() + 1.0
                while time.time() < end:
                    if reload and not sent and time.time() > end - 0.7:
                        os.kill(server.pid, signal.SIGHUP)
                        sent = True
                    t0 = time.perf_counter()
                    version = w.push(grad, version)
                    version = w.pull(weights)
                    worst = max(worst, time.perf_counter() - t0)
                out[reload].append(worst)
        w.close()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--builds", nargs="+", required=True, help="build directories (their bin/shmps-server)")
    p.add_argument("--windows", type=int, default=9, help="windows of each kind per build (in 3 turns)")
    a = p.parse_args()
    results = {b: {False: [], True: []} for b in a.builds}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(3):
            for b in a.builds:
                measure(os.path.join(b, "bin", "shmps-server"), max(1, a.windows // 3), results[b], work)
    print("| build | worst step, no reload (ms) | worst step, one reload (ms) | ratio |")
    print("|---|---|---|---|")
    for b in a.builds:
        quiet = statistics.median(results[b][False]) * 1e3
        loaded = statistics.median(results[b][True]) * 1e3
        print("| %s | %.2f | %.2f | %.1fx |" % (b, quiet, loaded, loaded / quiet))


if __name__ == "__main__":
    main()
