#!/usr/bin/env python3
"""Asynchronous data-parallel training of Fashion-MNIST by N torch processes
through one shmps-server: the 784-256-10 MLP of shmps-train, in PyTorch.

    python3 examples/torch/train.py --workers 4 --epochs 20

The parent starts the server with the model's tensor table (shmps.Server),
sets its weights to the model's own torch initialisation (init), forks the
workers (torch.multiprocessing) and scores the test set at every epoch of
applied pushes. Each worker trains its shard with a RemoteOptimizer: its
.grad and .data are views into shared memory the server reads and writes;
a push rejected as too stale is followed by a pull and the same minibatch
again, so every example counts once per epoch. The data are read from
Debian's dataset-fashion-mnist with the standard library and numpy.
"""

import argparse
import gzip
import math
import os
import signal
import struct
import sys
import time
import zlib

import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import shmps
import shmps.torch

DATA_DIR = "/usr/share/datasets/fashion-mnist"


class Mlp(torch.nn.Module):
    """784 -> 256 -> ReLU -> 10, as shmps-train's (fc1, fc2 in nn.Linear's layout)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 256)
        self.fc2 = torch.nn.Linear(256, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def read_idx(path, magic):
    """The array of the IDX file path + ".gz", else the plain one at path (as shmps-train
    picks them): uint8 images or labels."""
    if os.path.exists(path + ".gz") or not os.path.exists(path):
        path = path + ".gz"
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise SystemExit(f"train.py: {path}: {e.strerror} (Debian: apt-get install dataset-fashion-mnist)")
    except (OSError, EOFError, zlib.error) as e:  # unreadable, or a cut or corrupt gzip stream
        raise SystemExit(f"train.py: {path}: cannot read: {e}")
    ndim = magic & 0xFF
    if len(data) < 4 + 4 * ndim:
        raise SystemExit(f"train.py: {path}: truncated: {len(data)} bytes, the header alone takes {4 + 4 * ndim}")
    (found,) = struct.unpack(">I", data[:4])
    if found != magic:
        raise SystemExit(f"train.py: {path}: magic {found:#010x}, expected {magic:#010x}")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != math.prod(dims):
        raise SystemExit(f"train.py: {path}: {body.size} bytes of data, dims {dims} need {math.prod(dims)}")
    return body.reshape(dims)


def load(data_dir, split, limit):
    images = read_idx(os.path.join(data_dir, f"{split}-images-idx3-ubyte"), 0x00000803)
    labels = read_idx(os.path.join(data_dir, f"{split}-labels-idx1-ubyte"), 0x00000801)
    if len(images) != len(labels):
        raise SystemExit(f"train.py: {split}: {len(images)} images but {len(labels)} labels")
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(images.reshape(len(images), 784).astype(np.float32) / 255.0)
    return x, torch.from_numpy(labels.astype(np.int64))


def pushes_per_epoch(n, workers, batch):
    return sum(math.ceil(len(range(i, n, workers)) / batch) for i in range(workers))


def train_worker(rank, args, name, x, y, results):
    """One worker process: its shard, args.epochs times, one push per minibatch."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed * 1000 + rank)
    model = Mlp()
    with shmps.connect(name, timeout=30) as worker:
        opt = shmps.torch.RemoteOptimizer(model, worker)
        shard = torch.arange(rank, len(x), args.workers)
        generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
        for _ in range(args.epochs):
            order = shard[torch.randperm(len(shard), generator=generator)]
            for start in range(0, len(order), args.batch):
                idx = order[start:start + args.batch]
                while True:  # a stale push: fresh weights, the same minibatch again
                    opt.zero_grad()
                    F.cross_entropy(model(x[idx]), y[idx]).backward()
                    opt.step()
                    if opt.applied:
                        break
        results[2 * rank], results[2 * rank + 1] = opt.pushes, opt.stale


def evaluate(model, x, y):
    with torch.no_grad():
        logits = model(x)
        return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def stop_on_sigterm(signo, _frame):
    """SIGTERM ends the script as an exception does: the workers are terminated
    first, then the with blocks stop the server."""
    raise SystemExit(128 + signo)


def main():
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--max-staleness", type=int, default=8)
    p.add_argument("--train-limit", type=int, default=0, help="use the first N training images (0: all)")
    p.add_argument("--test-limit", type=int, default=0, help="use the first N test images (0: all)")
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--name", default=None, help="the server's segment name (default: a unique one)")
    p.add_argument("--server-bin", default=None, help="shmps-server to run (default: shmps.server_binary())")
    args = p.parse_args()
    if args.workers < 1 or args.epochs < 1 or args.batch < 1:
        p.error("--workers, --epochs and --batch must be >= 1")

    torch.set_num_threads(1)
    x, y = load(args.data_dir, "train", args.train_limit)
    tx, ty = load(args.data_dir, "t10k", args.test_limit)
    torch.manual_seed(args.seed)
    model = Mlp()  # torch's own initialisation; the server takes it by init
    per_epoch = pushes_per_epoch(len(x), args.workers, args.batch)
    ctx = mp.get_context("fork")

    # Each worker's (pushes, stale) counts: memory the forked workers share
    # (no process of its own, so none outlives a parent killed by SIGKILL).
    results = ctx.Array("q", 2 * args.workers, lock=False)
    with shmps.Server(model, optimizer="adam", lr=args.lr, max_staleness=args.max_staleness,
                      max_workers=args.workers + 2, binary=args.server_bin, name=args.name) as server:
        with shmps.connect(server.name) as worker:
            opt = shmps.torch.RemoteOptimizer(model, worker, init=True)  # the parent's view, for scoring
            # Daemons: should the parent end early (an exception, SIGTERM), multiprocessing
            # terminates them as it exits.
            procs = [ctx.Process(target=train_worker, args=(r, args, server.name, x, y, results), daemon=True)
                     for r in range(args.workers)]
            start = time.monotonic()
            try:
                for proc in procs:
                    proc.start()
                next_epoch, last_t, last_v = 1, start, 0
                total = per_epoch * args.epochs
                while True:  # score at every epoch boundary of applied pushes
                    done = not any(proc.is_alive() for proc in procs)
                    stats = worker.stats()
                    # The end is scored once: not again when the last boundary was just scored.
                    if stats.version >= next_epoch * per_epoch or (done and stats.version != last_v):
                        version = opt.pull()
                        loss, _ = evaluate(model, x[:10000], y[:10000])
                        _, acc = evaluate(model, tx, ty)
                        now = time.monotonic()
                        print(f"epoch {version / per_epoch:.2f}  train_loss {loss:.4f}  test_acc {acc:.4f}  "
                              f"pushes/s {(version - last_v) / max(now - last_t, 1e-9):.0f}  "
                              f"rejected {stats.rejected_stale}  avg_staleness {stats.avg_staleness:.2f}", flush=True)
                        last_t, last_v = now, version
                        next_epoch = version // per_epoch + 1
                    if done:
                        break
                    time.sleep(0.02)
                for proc in procs:
                    proc.join()
            except BaseException:
                # The workers first (SIGTERM: their handler raises SystemExit,
                # and their with blocks detach), so that none meets the
                # server stopping under it as the with blocks below end.
                for proc in procs:
                    if proc.is_alive():
                        proc.terminate()
                for proc in procs:
                    if proc.pid is not None:
                        proc.join()
                raise
            wall = time.monotonic() - start
            failed = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
            if failed:
                raise SystemExit(f"train.py: workers {failed} failed (exit codes "
                                 f"{[procs[r].exitcode for r in failed]})")
            applied, stale = sum(results[0::2]), sum(results[1::2])
            stats = worker.stats()
            agree = "agree" if (applied, stale) == (stats.gradients_applied, stats.rejected_stale) else "DISAGREE"
            print(f"pushes: workers applied {applied} rejected {stale}; server applied {stats.gradients_applied} "
                  f"rejected_stale {stats.rejected_stale} ({agree})")
            opt.pull()
            _, acc = evaluate(model, tx, ty)
            print(f"final test accuracy: {acc:.4f} (wall time {wall:.1f} s, {args.workers} workers)")
            if agree != "agree":
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
