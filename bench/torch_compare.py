#!/usr/bin/env python3
"""What a PyTorch user would do instead, side by side with shmps, on one job:
the Fashion-MNIST 784-256-10 MLP, batch 64, Adam lr 1e-3, E epochs, by
1, 2 and 4 processes, each with torch.set_num_threads(1) and
OPENBLAS_NUM_THREADS=1:

  hogwild      torch.multiprocessing Hogwild (pytorch/examples mnist_hogwild):
               one shared model, a private Adam per process
  a3c          the A3C pattern (ikostrikov/pytorch-a3c): a local model per
               process pulls the shared state_dict, hands its gradients to
               the shared model and steps one Adam whose state is in
               shared memory
  shmps        shmps.torch.RemoteOptimizer through a shmps-server (a stale
               push: fresh weights, the same minibatch again)
  shmps-train  the C++ job of this repository (examples/train)

Runs are interleaved (repeat, then processes, then arm) and the table gives
medians over the repeats. Every arm is scored the same way: the parent
snapshots the weights every --eval-every updates while the workers train
and scores the snapshots after training, so the times are training alone
(shmps-train does the same with its --eval-every).

    bench/torch_compare.py [--repeats 3] [--epochs 20] [--procs 1 2 4] [--out DIR]
    bench/torch_compare.py --smoke        # seconds: 3,000 images, 1 epoch

Writes DIR/runs.json, DIR/summary.md (the table) and DIR/torch_compare.png
(test accuracy against wall time at the largest process count; needs
matplotlib). docs/python.md holds the results.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples", "torch"))
ARMS = ["hogwild", "a3c", "shmps", "shmps-train"]
TARGETS = (0.87, 0.88)


# ---------------------------------------------------------------- one run

def run_torch_arm(arm, procs, epochs, seed, train_limit, eval_every, lr, batch, staleness_policy="reject",
                  max_staleness=8, slow_rank_delay=0.0, inspect=None):
    """One run of a Python arm in this process (the parent) and its forked workers.
    shmps: the server's `staleness_policy` and `max_staleness`; rank 0 sleeps
    `slow_rank_delay` seconds per step (a straggler); `inspect`, the path of
    shmps-inspect: the server's staleness histogram is read at the end."""
    import torch
    import torch.multiprocessing as mp
    import torch.nn.functional as F
    import train as example  # examples/torch/train.py: the data and the model

    torch.set_num_threads(1)
    x, y = example.load(example.DATA_DIR, "train", train_limit)
    tx, ty = example.load(example.DATA_DIR, "t10k", 0)
    torch.manual_seed(seed)
    shared = example.Mlp()
    ctx = mp.get_context("fork")
    # Per worker, each written by its own process only (no lost increments).
    updates = ctx.Array("q", procs, lock=False)
    stale = ctx.Array("q", procs, lock=False)
    gate = ctx.Event()

    def batches(rank, gen):
        shard = torch.arange(rank, len(x), procs)
        for _ in range(epochs):
            order = shard[torch.randperm(len(shard), generator=gen)]
            for start in range(0, len(order), batch):
                yield order[start:start + batch]

    def worker(rank, server_name):
        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        gate.wait()
        if arm == "hogwild":
            opt = torch.optim.Adam(shared.parameters(), lr=lr)  # private state, shared weights
            for idx in batches(rank, gen):
                opt.zero_grad()
                F.cross_entropy(shared(x[idx]), y[idx]).backward()
                opt.step()
                updates[rank] += 1
        elif arm == "a3c":
            local = example.Mlp()
            for idx in batches(rank, gen):
                local.load_state_dict(shared.state_dict())
                local.zero_grad()
                F.cross_entropy(local(x[idx]), y[idx]).backward()
                for lp, sp in zip(local.parameters(), shared.parameters()):
                    sp._grad = lp.grad
                shared_opt.step()
                updates[rank] += 1
        else:
            import shmps
            import shmps.torch
            model = example.Mlp()
            with shmps.connect(server_name, timeout=60) as w:
                opt = shmps.torch.RemoteOptimizer(model, w)
                for idx in batches(rank, gen):
                    while True:
                        opt.zero_grad()
                        F.cross_entropy(model(x[idx]), y[idx]).backward()
                        if rank == 0 and slow_rank_delay:
                            time.sleep(slow_rank_delay)
                        opt.step()
                        if opt.applied:
                            break
                        stale[rank] += 1
                    updates[rank] += 1

    server = None
    snapshot = None
    if arm == "hogwild" or arm == "a3c":
        shared.share_memory()
        if arm == "a3c":
            shared_opt = torch.optim.Adam(shared.parameters(), lr=lr)
            for p in shared.parameters():  # the optimizer's state in shared memory, before the fork
                st = shared_opt.state[p]
                st["step"] = torch.zeros(()).share_memory_()
                st["exp_avg"] = torch.zeros_like(p).share_memory_()
                st["exp_avg_sq"] = torch.zeros_like(p).share_memory_()

        def snapshot():
            return [p.detach().clone() for p in shared.parameters()]
    else:
        import shmps
        import shmps.torch
        server = shmps.Server(shared, optimizer="adam", lr=lr, max_staleness=max_staleness, max_workers=procs + 2,
                              staleness_policy=staleness_policy)
        server.start()
        parent = shmps.connect(server.name)
        view = shmps.torch.RemoteOptimizer(shared, parent, init=True)

        def snapshot():
            view.pull()
            return [p.detach().clone() for p in shared.parameters()]

    try:
        workers = [ctx.Process(target=worker, args=(r, server.name if server else None)) for r in range(procs)]
        for w in workers:
            w.start()
        snaps = [(0.0, 0, snapshot())]
        start = time.monotonic()
        gate.set()
        next_eval = eval_every
        # (workers still running, seconds, updates) each time one ends: how
        # much of the run the last workers trained without the others.
        ends = []
        alive = procs
        while alive:
            done = sum(updates)
            if done >= next_eval:
                snaps.append((time.monotonic() - start, done, snapshot()))
                next_eval = (done // eval_every + 1) * eval_every
            now_alive = sum(w.is_alive() for w in workers)
            if now_alive != alive:
                ends.append((now_alive, time.monotonic() - start, sum(updates)))
                alive = now_alive
            time.sleep(0.002)
        wall = time.monotonic() - start
        for w in workers:
            w.join()
        if any(w.exitcode != 0 for w in workers):
            raise SystemExit(f"{arm}: a worker failed: {[w.exitcode for w in workers]}")
        snaps.append((wall, sum(updates), snapshot()))
        staleness = None
        if server is not None and inspect:
            out = subprocess.run([inspect, "--json", server.name], capture_output=True, text=True, check=True)
            stats = json.loads(out.stdout)["stats"]
            h = stats["histograms"]["staleness"]
            # max, p50 and p99 are strings of digits (p50, p99: null before the first value).
            staleness = {k: None if h[k] is None else int(h[k]) for k in ("p50", "p99", "max")}
            staleness.update({"buckets": h["buckets"], "pulls_waited": stats["pulls_waited"],
                              "wait_s": int(stats["wait_ns"]) / 1e9, "pushes_scaled": stats["pushes_scaled"]})
    finally:
        if server is not None:
            parent.close()
            server.stop()

    return {"wall": wall, "updates": sum(updates), "rejected": sum(stale), "curve": score(snaps, tx, ty),
            "staleness": staleness, "ends": ends}


def score(snaps, tx, ty):
    """The (time, updates, test accuracy) curve of weight snapshots (time, updates, parameters)."""
    import torch
    import train as example

    scorer = example.Mlp()
    curve = []
    for t, n, params in snaps:
        with torch.no_grad():
            for p, v in zip(scorer.parameters(), params):
                p.copy_(v)
            curve.append((t, n, (scorer(tx).argmax(1) == ty).float().mean().item()))
    return curve


def run_shmps_train(procs, epochs, seed, train_limit, eval_every, bin_dir):
    with tempfile.TemporaryDirectory() as tmp:
        csv = os.path.join(tmp, "curve.csv")
        cmd = [os.path.join(bin_dir, "shmps-train"), "--workers", str(procs), "--epochs", str(epochs), "--seed", str(seed),
               "--eval-every", str(eval_every), "--csv", csv]
        if train_limit:
            cmd += ["--train-limit", str(train_limit)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"shmps-train failed ({out.returncode}): {out.stderr[-2000:]}")
        with open(csv) as f:
            header = f.readline().strip().split(",")
            rows = [dict(zip(header, line.strip().split(","))) for line in f if line.strip()]
    curve = [(float(r["elapsed_s"]), int(r["version"]), float(r["test_acc"])) for r in rows]
    wall = float([line for line in out.stdout.splitlines() if line.startswith("final test accuracy")][0]
                 .split("wall time ")[1].split(" s")[0])
    return {"wall": wall, "updates": curve[-1][1], "rejected": int(rows[-1]["rejected"]), "curve": curve}


# ---------------------------------------------------------------- driver

def time_to(curve, target):
    for t, _, acc in curve:
        if acc >= target:
            return t
    return None


def step_cost(seed):
    """Microseconds per RemoteOptimizer step without the model's work (push +
    pull of all 203,530 parameters) and per forward+backward of a batch of 64,
    one process, medians of 5 x 300."""
    import torch
    import torch.nn.functional as F
    import shmps
    import shmps.torch
    import train as example

    torch.set_num_threads(1)
    x, y = example.load(example.DATA_DIR, "train", 640)
    torch.manual_seed(seed)
    model = example.Mlp()
    with shmps.Server(model, optimizer="adam", lr=1e-3) as server, shmps.connect(server.name) as w:
        opt = shmps.torch.RemoteOptimizer(model, w, init=True)
        sync, compute = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(300):
                opt.step()
            sync.append((time.perf_counter() - t0) / 300 * 1e6)
            t0 = time.perf_counter()
            for k in range(300):
                idx = slice((k % 10) * 64, (k % 10) * 64 + 64)
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
            compute.append((time.perf_counter() - t0) / 300 * 1e6)
    return statistics.median(sync), statistics.median(compute)


def summarize(runs, procs_list, repeats):
    lines = ["| processes | arm | final test acc | time to 0.87 | time to 0.88 | wall | updates/s | rejected |",
             "|---|---|---|---|---|---|---|---|"]

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def fmt(v, spec, unit=""):
        return "never" if v is None else f"{v:{spec}}{unit}"

    for n in procs_list:
        for arm in ARMS:
            rs = [r for r in runs if r["arm"] == arm and r["procs"] == n]
            if not rs:
                continue
            t87 = [time_to(r["curve"], 0.87) for r in rs]
            t88 = [time_to(r["curve"], 0.88) for r in rs]
            reached87 = sum(t is not None for t in t87)
            lines.append(
                f"| {n} | {arm} | {med([r['curve'][-1][2] for r in rs]):.4f} | "
                f"{fmt(med(t87), '.1f', ' s')}{'' if reached87 == len(rs) else f' ({reached87}/{len(rs)})'} | "
                f"{fmt(med(t88), '.1f', ' s')} | {med([r['wall'] for r in rs]):.1f} s | "
                f"{med([r['updates'] / r['wall'] for r in rs]):.0f} | {med([r['rejected'] for r in rs]):.0f} |")
    top = max(procs_list)
    pairs = []
    for rep in range(repeats):
        by = {r["arm"]: r for r in runs if r["procs"] == top and r["repeat"] == rep}
        if "shmps" in by and "hogwild" in by:
            pairs.append(by["shmps"]["wall"] / by["hogwild"]["wall"])
    lines.append("")
    if pairs:
        lines.append(f"shmps / hogwild wall time at {top} processes, pair by pair: "
                     + ", ".join(f"{p:.2f}" for p in pairs))
    return "\n".join(lines)


def plot(runs, procs, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm and r["procs"] == procs]
        if rs:
            r = rs[0]
            ax.plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]], label=arm)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.75, 0.9)
    ax.axhline(0.87, color="grey", lw=0.5)
    ax.axhline(0.88, color="grey", lw=0.5)
    ax.set_title(f"Fashion-MNIST MLP, {procs} processes, first repeat")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    p.add_argument("--train-limit", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=235, help="updates between snapshots (0.25 epoch at 4 processes)")
    p.add_argument("--bin", default=os.path.join(ROOT, "build", "default", "bin"), help="folder of shmps-train")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="3,000 images, 1 epoch, 1 repeat, 1 and 2 processes")
    p.add_argument("--run-one", nargs=3, metavar=("ARM", "PROCS", "REPEAT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.repeats, args.epochs, args.procs, args.train_limit, args.eval_every = 1, 1, [1, 2], 3000, 10

    if args.run_one:  # a fresh interpreter per run: nothing carries over between runs
        arm, procs, repeat = args.run_one[0], int(args.run_one[1]), int(args.run_one[2])
        seed = 1 + repeat
        if arm == "shmps-train":
            r = run_shmps_train(procs, args.epochs, seed, args.train_limit, args.eval_every, args.bin)
        else:
            r = run_torch_arm(arm, procs, args.epochs, seed, args.train_limit, args.eval_every, 1e-3, 64)
        print(json.dumps(r))
        return 0

    out = args.out or tempfile.mkdtemp(prefix="torch_compare-")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    runs = []
    for repeat in range(args.repeats):
        for n in args.procs:
            for arm in args.arms:
                t0 = time.monotonic()
                res = subprocess.run([sys.executable, __file__, "--run-one", arm, str(n), str(repeat),
                                      "--epochs", str(args.epochs), "--train-limit", str(args.train_limit),
                                      "--eval-every", str(args.eval_every), "--bin", args.bin],
                                     capture_output=True, text=True, env=env)
                if res.returncode != 0:
                    print(res.stdout[-3000:], res.stderr[-3000:], file=sys.stderr)
                    return 1
                r = json.loads(res.stdout.strip().splitlines()[-1])
                r.update(arm=arm, procs=n, repeat=repeat)
                runs.append(r)
                print(f"repeat {repeat} procs {n} {arm:11s} final {r['curve'][-1][2]:.4f} wall {r['wall']:.1f} s "
                      f"updates {r['updates']} rejected {r['rejected']} ({time.monotonic() - t0:.0f} s)", flush=True)
                with open(os.path.join(out, "runs.json"), "w") as f:
                    json.dump(runs, f)
    table = summarize(runs, args.procs, args.repeats)
    sync, compute = step_cost(1)
    table += (f"\nPer step in Python, one process: push + pull of all 203,530 parameters (RemoteOptimizer.step) "
              f"{sync:.0f} us; forward + backward of a batch of 64 {compute:.0f} us (medians of 5 x 300).")
    print(table)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(table + "\n")
    plot(runs, max(args.procs), os.path.join(out, "torch_compare.png"))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
