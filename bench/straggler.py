#!/usr/bin/env python3
"""The case for an asynchronous server, measured: a straggler. The
Fashion-MNIST 784-256-10 MLP, batch 64, Adam lr 1e-3, E epochs, 4 worker
processes (torch.set_num_threads(1), OPENBLAS_NUM_THREADS=1), each on its
own quarter of the data, trained

  shmps-reject  through a shmps-server, --staleness-policy reject (a stale
                push is thrown away; the worker pulls and computes that
                minibatch again)
  shmps-wait    --staleness-policy wait (SSP: a worker max_staleness pushes
                ahead of the slowest waits in its pull)
  shmps-scale   --staleness-policy scale (every push applied; past
                max_staleness versions with lr * max_staleness / staleness)
  ddp           torch DistributedDataParallel, gloo backend on the CPU: every
                step all-reduces the gradients, so each waits for the slowest
                rank (the same data, 4 x 64 images per averaged step)

without and with a straggler: worker 0 sleeps, every step, twice the others'
step time (so its steps take 3x theirs; the others' step time is measured
in the same repeat's first straggler-free 4-worker shmps run, reject's when
it runs, or given with --straggler-delay-ms; a straggler run with neither is
refused), and one process alone (shmps-reject, no straggler: the accuracy
reference). Runs are interleaved
(repeat, then configuration) and every figure is a median over the repeats;
each run is scored from weight snapshots taken while it trains (the
parent's pulls for shmps, rank 0's copies for ddp), scored after training.

    bench/straggler.py [--repeats 3] [--epochs 20] [--max-staleness 4] [--out DIR]
                       [--arms single shmps-reject ...] [--conditions plain straggler]
                       [--straggler-delay-ms MS]
    bench/straggler.py --smoke      # a minute: 6,000 images, 1 epoch, 1 repeat

Writes DIR/runs.json, DIR/summary.md (the table and the goals) and
DIR/straggler.png (test accuracy against wall time, first repeat; needs
matplotlib). docs/design.md ("Staleness policies") holds the results.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples", "torch"))
import torch_compare  # noqa: E402  the shmps arm, score(), time_to()

PROCS = 4
ARMS = ["shmps-reject", "shmps-wait", "shmps-scale", "ddp"]
TARGET = 0.87


# ---------------------------------------------------------------- ddp

def run_ddp(procs, epochs, seed, train_limit, eval_every, lr, batch, slow_rank_delay):
    """torch DDP over gloo: `procs` forked ranks on 127.0.0.1; rank 0 keeps
    a copy of the weights every `eval_every` updates (one update: one rank's
    minibatch, as for the asynchronous arms) and the parent scores them."""
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn.functional as F
    import train as example

    torch.set_num_threads(1)
    x, y = example.load(example.DATA_DIR, "train", train_limit)
    tx, ty = example.load(example.DATA_DIR, "t10k", 0)
    ctx = mp.get_context("fork")
    gate = ctx.Event()
    start = ctx.Value("d", 0.0)
    store_dir = tempfile.mkdtemp(prefix="ddp-")
    store = os.path.join(store_dir, "store")
    snaps_path = os.path.join(store_dir, "snaps.pt")

    def rank_main(rank):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=procs)
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = torch.nn.parallel.DistributedDataParallel(example.Mlp())
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        shard = torch.arange(rank, len(x), procs)
        steps_per_epoch = (len(shard) + batch - 1) // batch
        # Every rank runs the same number of steps (DDP needs it): the
        # shortest shard's.
        steps_per_epoch = min(steps_per_epoch, (len(x) // procs + batch - 1) // batch)
        snaps = [(0.0, 0, [p.detach().clone() for p in model.module.parameters()])]
        dist.barrier()
        gate.wait()
        updates = 0
        next_eval = eval_every
        for _ in range(epochs):
            order = shard[torch.randperm(len(shard), generator=gen)]
            for k in range(steps_per_epoch):
                idx = order[k * batch:(k + 1) * batch]
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()  # all-reduce: waits for every rank
                if rank == 0 and slow_rank_delay:
                    time.sleep(slow_rank_delay)
                opt.step()
                updates += procs
                if rank == 0 and updates >= next_eval:
                    snaps.append((time.monotonic() - start.value, updates,
                                  [p.detach().clone() for p in model.module.parameters()]))
                    next_eval = (updates // eval_every + 1) * eval_every
        if rank == 0:
            snaps.append((time.monotonic() - start.value, updates,
                          [p.detach().clone() for p in model.module.parameters()]))
            torch.save(snaps, snaps_path)
        dist.destroy_process_group()

    ranks = [ctx.Process(target=rank_main, args=(r,)) for r in range(procs)]
    for r in ranks:
        r.start()
    time.sleep(0.5)  # the ranks meet in init_process_group and the barrier
    start.value = time.monotonic()
    gate.set()
    for r in ranks:
        r.join()
    wall = time.monotonic() - start.value
    if any(r.exitcode != 0 for r in ranks):
        raise SystemExit(f"ddp: a rank failed: {[r.exitcode for r in ranks]}")
    snaps = torch.load(snaps_path)
    for f in os.listdir(store_dir):
        os.unlink(os.path.join(store_dir, f))
    os.rmdir(store_dir)
    return {"wall": wall, "updates": snaps[-1][1], "rejected": 0, "curve": torch_compare.score(snaps, tx, ty),
            "staleness": None}


# ---------------------------------------------------------------- driver

def run_one(arm, procs, delay, args, repeat):
    seed = 1 + repeat
    if arm == "ddp":
        return run_ddp(procs, args.epochs, seed, args.train_limit, args.eval_every, 1e-3, 64, delay)
    policy = arm.split("-", 1)[1]
    inspect = os.path.join(args.bin, "shmps-inspect")
    return torch_compare.run_torch_arm("shmps", procs, args.epochs, seed, args.train_limit, args.eval_every, 1e-3, 64,
                                       staleness_policy=policy, max_staleness=args.max_staleness,
                                       slow_rank_delay=delay, inspect=inspect)


def configurations(arms=None, conditions=("plain", "straggler")):
    """(label, arm, procs, straggler) in run order, of `arms` (default: all,
    and "single", the one-process reference) under `conditions` (plain:
    no straggler)."""
    arms = arms or ["single"] + ARMS
    out = [("1 process", "shmps-reject", 1, False)] if "single" in arms else []
    for straggler in [c == "straggler" for c in ("plain", "straggler") if c in conditions]:
        for arm in ARMS:
            if arm in arms:
                out.append((f"{arm}{', straggler' if straggler else ''}", arm, PROCS, straggler))
    return out


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def tail_share(run):
    """The share of a run's updates made after its first worker ended (the
    others trained on without it), or None where the run does not say."""
    ends = run.get("ends")
    if not ends or not run["updates"]:
        return None
    return (run["updates"] - ends[0][2]) / run["updates"]


def check_straggler_runs(runs):
    """Refuses (SystemExit) a run whose record contradicts its label: a
    straggler run whose worker 0 slept 0 ms, or a plain run that slept."""
    for r in runs:
        if r["straggler"] != r["label"].endswith(", straggler"):
            raise SystemExit(f"straggler.py: run '{r['label']}' (repeat {r['repeat']}) says straggler={r['straggler']}")
        if r["straggler"] and not r["delay"] > 0.0:
            raise SystemExit(f"straggler.py: run '{r['label']}' (repeat {r['repeat']}) is a straggler run whose "
                             f"worker 0 slept {r['delay']} ms per step")
        if not r["straggler"] and r["delay"] != 0.0:
            raise SystemExit(f"straggler.py: run '{r['label']}' (repeat {r['repeat']}) has no straggler but a "
                             f"delay of {r['delay']} ms")


def summarize(runs, args):
    check_straggler_runs(runs)
    delay = med([r['delay'] for r in runs if r['straggler']])
    straggler = "no straggler" if delay is None else \
        f"straggler: worker 0 sleeps {delay:.2f} ms per step (" + \
        ("--straggler-delay-ms" if getattr(args, "straggler_delay_ms", None) else "2x the others' step time") + ")"
    lines = [f"{PROCS} workers (and 1 alone), {args.epochs} epochs, max_staleness {args.max_staleness}, "
             f"medians of {args.repeats}; {straggler}", "",
             f"| configuration | final test acc | time to {TARGET} | wall | updates | wasted (rejected) | "
             "staleness p50 / p99 / max | pulls held (time) | pushes scaled | updates after the first worker ended |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by_label = {}
    for label, arm, procs, straggler in configurations():
        rs = [r for r in runs if r["label"] == label and r["straggler"] == straggler]
        if not rs:
            continue
        by_label[label] = rs
        t = [torch_compare.time_to(r["curve"], TARGET) for r in rs]
        reached = sum(v is not None for v in t)
        st = [r["staleness"] for r in rs if r["staleness"]]
        stal = "-" if not st else " / ".join(
            f"{med([s[k] for s in st]):.0f}" if med([s[k] for s in st]) is not None else "-" for k in ("p50", "p99", "max"))
        held = "-" if not st else f"{med([s['pulls_waited'] for s in st]):.0f} ({med([s['wait_s'] for s in st]):.1f} s)"
        scaled = "-" if not st else f"{med([s['pushes_scaled'] for s in st]):.0f}"
        t_text = "never" if med(t) is None else f"{med(t):.1f} s"
        if reached != len(rs):
            t_text += f" ({reached}/{len(rs)})"
        tails = [tail_share(r) for r in rs]
        tail = "-" if med(tails) is None else f"{100 * med(tails):.1f}%"
        lines.append(f"| {label} | {med([r['curve'][-1][2] for r in rs]):.4f} | {t_text} | "
                     f"{med([r['wall'] for r in rs]):.1f} s | {med([r['updates'] for r in rs]):.0f} | "
                     f"{med([r['rejected'] for r in rs]):.0f} | {stal} | {held} | {scaled} | {tail} |")

    def acc(label):
        return med([r["curve"][-1][2] for r in by_label.get(label, [])])

    def t87(label):
        return med([torch_compare.time_to(r["curve"], TARGET) for r in by_label.get(label, [])])

    def wasted(label):
        return med([r["rejected"] for r in by_label.get(label, [])])

    goals = []
    one = acc("1 process")
    if one is not None:
        best = max((acc(a) or 0, a) for a in ARMS[:3])
        goals.append((f"no straggler: best policy ({best[1]}) within 0.2 pp of 1 process",
                      f"{100 * (best[0] - one):+.2f} pp", best[0] >= one - 0.002))
    for straggler, bound, text in ((True, 1.5, ">= 1.5x sooner"), (False, 1 / 1.2, "within 1.2x")):
        suffix = ", straggler" if straggler else ""
        ddp = t87("ddp" + suffix)
        times = [(t87(a + suffix), a) for a in ARMS[:3] if t87(a + suffix) is not None]
        if times and ddp is not None:
            best_t, best_a = min(times)
            ratio = ddp / best_t
            goals.append((f"{'straggler' if straggler else 'no straggler'}: shmps ({best_a}) reaches {TARGET} "
                          f"{text} of ddp", f"ddp / shmps = {ratio:.2f}", ratio >= bound))
    for policy in ("wait", "scale"):
        for suffix in ("", ", straggler"):
            r, p = wasted("shmps-reject" + suffix), wasted(f"shmps-{policy}" + suffix)
            ra, pa = acc("shmps-reject" + suffix), acc(f"shmps-{policy}" + suffix)
            if r is None or p is None:
                continue
            fewer = 1 - p / r if r else 0.0
            goals.append((f"{policy}{suffix}: >= 90% fewer wasted gradients than reject, accuracy >= reject's",
                          f"{p:.0f} vs {r:.0f} ({100 * fewer:.0f}% fewer), acc {pa:.4f} vs {ra:.4f}",
                          (r == 0 or fewer >= 0.9) and pa >= ra))
    lines += ["", "| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {'MET' if ok else 'MISSED'} |" for g, m, ok in goals]
    return "\n".join(lines)


def plot(runs, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, straggler in zip(axes, (False, True)):
        for label, arm, procs, s in configurations():
            if s != straggler and label != "1 process":
                continue
            rs = [r for r in runs if r["label"] == label and r["repeat"] == 0]
            if rs:
                ax.plot([c[0] for c in rs[0]["curve"]], [c[2] for c in rs[0]["curve"]], label=label)
        ax.set_xlabel("wall time (s)")
        ax.set_title("with a straggler (worker 0 at 1/3 speed)" if straggler else "no straggler")
        ax.axhline(TARGET, color="grey", lw=0.5)
        ax.set_ylim(0.75, 0.9)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("test accuracy")
    fig.suptitle("Fashion-MNIST MLP, 4 workers, first repeat")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--arms", nargs="+", choices=["single"] + ARMS, default=None,
                   help="run only these (single: one process alone)")
    p.add_argument("--conditions", nargs="+", choices=["plain", "straggler"], default=["plain", "straggler"],
                   help="without a straggler (plain), with one, or both")
    p.add_argument("--straggler-delay-ms", type=float, default=None,
                   help="the straggler's sleep per step (default: 2x the others' step time, measured in each "
                        "repeat's first straggler-free 4-worker shmps run)")
    p.add_argument("--train-limit", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=235, help="updates between snapshots (0.25 epoch at 4 workers)")
    p.add_argument("--bin", default=os.path.join(ROOT, "build", "default", "bin"), help="folder of shmps-inspect")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="6,000 images, 1 epoch, 1 repeat")
    p.add_argument("--run-one", nargs=4, metavar=("ARM", "PROCS", "DELAY_S", "REPEAT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.repeats, args.epochs, args.train_limit, args.eval_every = 1, 1, 6000, 20

    if args.run_one:  # a fresh interpreter per run: nothing carries over between runs
        arm, procs, delay, repeat = args.run_one[0], int(args.run_one[1]), float(args.run_one[2]), int(args.run_one[3])
        print(json.dumps(run_one(arm, procs, delay, args, repeat)))
        return 0

    configs = configurations(args.arms, args.conditions)
    if args.straggler_delay_ms is not None and not args.straggler_delay_ms > 0:
        p.error(f"--straggler-delay-ms must be > 0, got {args.straggler_delay_ms}")
    measured = any(procs == PROCS and not straggler and arm.startswith("shmps") for _, arm, procs, straggler in configs)
    if any(straggler for *_, straggler in configs) and not measured and args.straggler_delay_ms is None:
        # The straggler's sleep is 2x the others' step time, measured in a
        # plain 4-worker shmps run of the same repeat: without one it would
        # be 0, and the "straggler" runs would have none.
        p.error("a straggler run needs the others' step time: add --conditions plain with an shmps arm "
                "(it is measured there), or give --straggler-delay-ms")

    out = args.out or tempfile.mkdtemp(prefix="straggler-")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    runs = []
    for repeat in range(args.repeats):
        given = args.straggler_delay_ms is not None
        delay = args.straggler_delay_ms / 1e3 if given else 0.0
        for label, arm, procs, straggler in configs:
            t0 = time.monotonic()
            d = delay if straggler else 0.0
            if straggler and not d > 0.0:
                raise SystemExit(f"{label}: no straggler delay measured before it (repeat {repeat})")
            res = subprocess.run([sys.executable, __file__, "--run-one", arm, str(procs), str(d), str(repeat),
                                  "--epochs", str(args.epochs), "--train-limit", str(args.train_limit),
                                  "--eval-every", str(args.eval_every), "--max-staleness", str(args.max_staleness),
                                  "--bin", args.bin], capture_output=True, text=True, env=env)
            if res.returncode != 0:
                raise SystemExit(f"{label}: failed ({res.returncode}):\n{res.stderr[-3000:]}")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            r.update(label=label, arm=arm, procs=procs, repeat=repeat, straggler=straggler, delay=1e3 * d)
            runs.append(r)
            if procs == PROCS and not straggler and arm.startswith("shmps") and not given and delay == 0.0:
                # The others' step time: a worker's updates over the run's
                # wall time, in the first straggler-free shmps run (reject's
                # when it runs: it comes first).
                delay = 2 * r["wall"] / (r["updates"] / procs)
            print(f"repeat {repeat} {label}: acc {r['curve'][-1][2]:.4f}, wall {r['wall']:.1f} s, "
                  f"rejected {r['rejected']} ({time.monotonic() - t0:.0f} s)", flush=True)
            with open(os.path.join(out, "runs.json"), "w") as f:
                json.dump(runs, f)
    summary = summarize(runs, args)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary + "\n")
    print(summary)
    plot(runs, os.path.join(out, "straggler.png"))
    print(f"\nwritten: {out}/runs.json, summary.md, straggler.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
