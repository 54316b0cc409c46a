#!/usr/bin/env python3
"""The federation's figures (docs/federation.md, "Figures"), on this machine:
every "host" a shmps-server of its own (--fed-rank-in-name), federated over
Gloo through a file store, its workers a `shmps-train --connect` on its
share of the data (--shard h/H). The Fashion-MNIST 784-256-10 MLP, Adam lr
1e-3, batch 64, E epochs, the same server initialisation everywhere.

  1  accuracy parity: 1 host x 4 workers (one server, not federated: the
     reference), 2 hosts x 2, 4 hosts x 1; the merged model's final test
     accuracy (medians over --repeats), and test accuracy against wall time
     and against applied updates (host 0's trainer's curve; updates: host
     0's count times the hosts); rounds every --every-ms (50), outer step
     --outer (average)
  2  a period sweep, 10 / 50 / 250 / 1000 ms x {average, nesterov}, 2 hosts
     x 2 workers: final accuracy against the bytes the hosts sent
  3  a round's cost against the engine's own allreduce of the same bytes
     (shmps-fed-bench round; Gloo with 2 and 3 hosts, and MPI under mpirun
     where it is installed), for the 814 KB model and a 64 MiB one, with
     the consumer's snapshot and merge passes beside a memcpy
  4  local serving: push round trips of the 814 KB model at a host, not
     federated against federated with one other host (rounds every 50 ms
     and 10 ms, the federation's threads at --fed-priority normal, low and
     idle; a second server not federated; a group whose rounds never
     come), interleaved, medians over --repeats; with --split-cpus, host
     0 and the pushing worker on one CPU, host 0's federation (--fed-cpus)
     and the other server on the rest (at the default priority only)

  5  with --netns RATE (root): every federated host in a network namespace
     of its own, on a bridge through a veth link shaped to RATE each way
     (tc tbf; netem's delay where the kernel has it, --delay), so that the
     collectives cross a link instead of the loopback; figures 1-3 there

    bench/federation.py [--out DIR] [--repeats 3] [--epochs 20] [--figures 1 2 3 4]
    bench/federation.py --smoke     # a minute: 6,000 images, 1 epoch, 1 repeat
    bench/federation.py --netns 1gbit --figures 3 1

Writes DIR/runs.json, DIR/summary.md (the tables) and, with matplotlib,
DIR/federation_parity.png and DIR/federation_sweep.png.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = ["--tensor", "fc1.weight:256x784", "--tensor", "fc1.bias:256", "--tensor", "fc2.weight:10x256",
         "--tensor", "fc2.bias:10", "--optimizer", "adam", "--lr", "0.001", "--init", "normal",
         "--init-scale", "0.05", "--backend", "host", "--max-staleness", "8"]


def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Network:
    """Each host its own network namespace, joined to the others by a
    bridge in this one through a veth pair shaped at both ends (tc tbf at
    `rate`, so each direction of a host's link carries `rate`; netem adds
    `delay` where the kernel has it). Hosts are 10.77.0.<h+1>. The names
    carry this process's pid; close() removes what this run made."""

    # tbf's bucket: one GSO segment (64 KiB) and a little, so that an idle
    # link does not pass a burst faster than the rate.
    BURST = "80kb"

    def __init__(self, rate, hosts, delay=None):
        self.rate, self.delay, self.hosts = rate, delay, hosts
        self.measured = ""
        tag = os.getpid() % 100000
        self.bridge = f"sfbr{tag}"
        self.names = [(f"shmpsfed{tag}h{h}", f"sf{tag}h{h}a", f"sf{tag}h{h}b") for h in range(hosts)]
        self.made_bridge, self.made_ns = False, []
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            self.made_bridge = True
            sh("ip", "link", "set", self.bridge, "up")
            for h, (ns, outer, inner) in enumerate(self.names):
                sh("ip", "netns", "add", ns)
                self.made_ns.append(ns)
                sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
                sh("ip", "link", "set", inner, "netns", ns)
                sh("ip", "link", "set", outer, "master", self.bridge, "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", inner)
                sh("ip", "-n", ns, "link", "set", inner, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                for prefix, dev in (([], outer), (["ip", "netns", "exec", ns], inner)):
                    shape = (["netem", "delay", delay, "rate", rate] if delay else
                             ["tbf", "rate", rate, "burst", self.BURST, "latency", "20ms"])
                    sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", *shape)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            self.close()
            what = f"{' '.join(e.cmd)}: {e.stderr.strip()}" if isinstance(e, subprocess.CalledProcessError) else str(e)
            raise SystemExit(f"federation.py: --netns: {what} "
                             "(needs root, iproute2 and the kernel's veth, bridge and tbf or netem)")

    def ns(self, h):
        return self.names[h][0]

    @staticmethod
    def address(h):
        return f"10.77.0.{h + 1}"

    # Host 1 echoes what host 0 sends: 1,000 round trips of one byte, then
    # 64 MiB one way (acknowledged with one byte).
    PROBE = r"""
import socket, sys, time
port = 47123
if sys.argv[1] == "serve":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[2], port)); s.listen(1); s.settimeout(30); c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(1000): c.sendall(c.recv(1))
    left = 64 << 20
    while left:
        got = len(c.recv(min(left, 1 << 20)))
        if not got: sys.exit("the sender went away")
        left -= got
    c.sendall(b"k")
else:
    for _ in range(100):
        try:
            c = socket.create_connection((sys.argv[2], port)); break
        except OSError:
            time.sleep(0.05)
    else:
        sys.exit("no answer from the other namespace")
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = time.monotonic()
    for _ in range(1000): c.sendall(b"x"); c.recv(1)
    rtt = (time.monotonic() - t) / 1000
    block = bytes(1 << 20); t = time.monotonic()
    for _ in range(64): c.sendall(block)
    c.recv(1)
    print(rtt * 1e6, 64 * 8 * 2**20 / (time.monotonic() - t) / 1e9)
"""

    def probe(self):
        """The link between hosts 0 and 1: (round trip us, Gbit/s)."""
        server = subprocess.Popen(self.wrap(1, [sys.executable, "-c", self.PROBE, "serve", self.address(1)]))
        try:
            out = subprocess.run(self.wrap(0, [sys.executable, "-c", self.PROBE, "send", self.address(1)]),
                                 capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                raise SystemExit(f"federation.py: --netns: the link probe failed: {out.stderr.strip()}")
            rtt, gbit = out.stdout.split()
            return float(rtt), float(gbit)
        finally:
            server.kill()
            server.wait()

    def wrap(self, h, cmd):
        return ["ip", "netns", "exec", self.ns(h)] + cmd

    def describe(self):
        shaped = f" and {self.delay} (netem)" if self.delay else f" (tbf, burst {self.BURST}; no added delay)"
        return f"each host in its own network namespace, links shaped to {self.rate}{shaped}{self.measured}"

    def close(self):
        for ns in self.made_ns:  # its veth pair goes with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.made_bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.made_ns, self.made_bridge = [], False


class Hosts:
    """H shmps-servers; federated over Gloo (a file store) when H > 1 unless
    `federate` is false, each in its namespace of `net` when given. Each
    server has --parent-pid this process (it stops once this process is
    gone); one that does not join stops them all before the error."""

    JOIN_S = 30  # how long each host may take to join (to serve, alone)

    def __init__(self, bin_dir, hosts, every_ms=50, outer="average", model=MODEL, net=None, fed_args=(),
                 federate=True, split=None):
        # fed_args: more --fed-* options for every host (figure 1's outer lr, figure 4's priority).
        # split: (serving CPU, the other CPUs as taskset lists them): host 0
        # on the first, its federation's threads (--fed-cpus) and every
        # other host on the others, as CPUAffinity= and fed-cpus would.
        self.bin = bin_dir
        self.n = hosts
        self.name = f"fedfig{os.getpid()}_{int(time.monotonic() * 1000) % 100000}"
        self.tmp = tempfile.mkdtemp(prefix="fedfig")
        self.procs = []
        try:
            self._start(hosts, every_ms, outer, model, net, fed_args, federate, split)
        except BaseException:
            self.close(keep_logs=True)  # the error names them
            raise

    def _start(self, hosts, every_ms, outer, model, net, fed_args, federate, split):
        for h in range(hosts):
            cmd = [os.path.join(self.bin, "shmps-server"), "--max-workers", "8", "--parent-pid", str(os.getpid())]
            cmd += model
            federated = hosts > 1 and federate
            cmd += ["--name", self.name if federated or hosts == 1 else self.segment(h)]
            if federated:
                cmd += ["--fed-rank-in-name", "--federation", "gloo", "--fed-store", "file:" + self.tmp + "/store",
                        "--fed-hosts", str(hosts), "--fed-host", str(h), "--fed-every-ms", str(every_ms),
                        "--fed-outer", outer, *fed_args]
                if net:
                    cmd = net.wrap(h, cmd + ["--fed-address", net.address(h)])
                if split and h == 0:
                    cmd += ["--fed-cpus", split[1]]
            if split:
                cmd = ["taskset", "-c", split[0] if h == 0 else split[1]] + cmd
            with open(os.path.join(self.tmp, f"host{h}.log"), "w") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        for h in range(hosts):
            self.wait_for(lambda h=h: self.members(h) == (hosts if hosts > 1 and federate else 0), self.JOIN_S,
                          f"host {h} joined")

    def segment(self, h):
        return self.name + (f".r{h}" if self.n > 1 else "")

    def stats(self, h):
        out = subprocess.run([os.path.join(self.bin, "shmps-inspect"), "--json", self.segment(h)],
                             capture_output=True, text=True)
        return json.loads(out.stdout)["stats"] if out.returncode == 0 else None

    def members(self, h):
        s = self.stats(h)
        return -1 if s is None else int(s["fed_members"])

    def wait_for(self, cond, seconds, what):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if cond():
                return
            time.sleep(0.05)
        raise SystemExit(f"federation.py: {what}: not within {seconds} s (logs in {self.tmp})")

    def settled(self):
        """Once no host trains: every host's last updates merged (no drift,
        two more rounds, which with no updates set W = A everywhere) and the
        anchors equal; the bytes of deltas and headers all hosts sent."""
        if self.n > 1:
            start = max(int(self.stats(h)["fed_round"]) for h in range(self.n))

            def merged():
                s = [self.stats(h) for h in range(self.n)]
                return (all(int(x["fed_drift"]) == 0 and int(x["fed_round"]) >= start + 2 for x in s)
                        and len({x["fed_anchor_hash"] for x in s}) == 1)

            self.wait_for(merged, 60, "every host's updates merged")
        return sum(int(self.stats(h)["fed_bytes"]) for h in range(self.n))

    def close(self, keep_logs=False):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        if not keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)


def train(bin_dir, segment, workers, epochs, seed, shard, train_limit, eval_every, csv):
    cmd = [os.path.join(bin_dir, "shmps-train"), "--connect", segment, "--workers", str(workers), "--epochs",
           str(epochs), "--seed", str(seed), "--eval-every", str(eval_every), "--csv", csv]
    if shard:
        cmd += ["--shard", shard]
    if train_limit:
        cmd += ["--train-limit", str(train_limit)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_curve(csv):
    with open(csv) as f:
        header = f.readline().strip().split(",")
        rows = [dict(zip(header, line.strip().split(","))) for line in f if line.strip()]
    return [(float(r["elapsed_s"]), int(r["version"]), float(r["test_acc"])) for r in rows]


def evaluate(bin_dir, segment):
    out = subprocess.run([os.path.join(bin_dir, "shmps-train"), "--connect", segment, "--evaluate"],
                         capture_output=True, text=True, check=True)
    return float(re.search(r"final test accuracy: ([0-9.]+)", out.stdout).group(1))


def with_lr(model, lr):
    """`model` (the servers' options) with Adam's lr set to `lr`."""
    i = model.index("--lr")
    return model[:i + 1] + [repr(lr)] + model[i + 2:]


def run_job(args, hosts, workers, seed, every_ms=50, outer="average", fed_args=(), lr=None):
    """One job: `hosts` servers, each with a trainer of `workers` workers on
    its share of the data (Adam's lr `lr` when given, else MODEL's); the
    merged model's accuracy, the bytes sent, the wall time and host 0's
    curve."""
    model = MODEL if lr is None else with_lr(MODEL, lr)
    job = Hosts(args.bin, hosts, every_ms, outer, model=model, net=args.net, fed_args=fed_args)
    try:
        trainers, csvs = [], []
        for h in range(hosts):
            csvs.append(os.path.join(job.tmp, f"curve{h}.csv"))
            # Every --eval-every updates of all hosts: each host's trainer
            # counts its own.
            trainers.append(train(args.bin, job.segment(h), workers, args.epochs, seed + h,
                                  f"{h}/{hosts}" if hosts > 1 else None, args.train_limit,
                                  max(1, args.eval_every // hosts), csvs[-1]))
        wall = 0.0  # training time: the slowest host's trainer's, as it prints it (no startup, no scoring)
        for t in trainers:
            out, _ = t.communicate()
            if t.returncode != 0:
                raise SystemExit(f"federation.py: shmps-train failed ({t.returncode}): {out[-2000:]}")
            wall = max(wall, float(re.search(r"wall time ([0-9.]+) s", out).group(1)))
        sent = job.settled()
        accuracy = evaluate(args.bin, job.segment(0))
        curve = [(t, n * hosts, a) for t, n, a in read_curve(csvs[0])]
        return {"hosts": hosts, "workers": workers, "every_ms": every_ms, "outer": outer,
                "fed_args": " ".join(fed_args), "seed": seed, "lr": float(model[model.index("--lr") + 1]),
                "accuracy": accuracy, "bytes": sent, "wall": wall, "curve": curve}
    finally:
        job.close()


def figure_parity(args, runs):
    # The outer lr and momentum when given (nesterov; the servers' defaults
    # otherwise), and the federation's priority.
    fed_args = [] if args.outer_lr is None else ["--fed-outer-lr", str(args.outer_lr)]
    fed_args += [] if args.outer_momentum is None else ["--fed-outer-momentum", str(args.outer_momentum)]
    fed_args += ["--fed-priority", args.priority]
    for rep in range(args.repeats):
        for hosts, workers in ((1, 4), (2, 2), (4, 1)):
            r = run_job(args, hosts, workers, seed=1 + 10 * rep, every_ms=args.every_ms, outer=args.outer,
                        fed_args=fed_args, lr=args.host_lr if hosts > 1 else None)
            r["figure"] = 1
            runs.append(r)
            print(f"  parity {hosts}x{workers} repeat {rep}: accuracy {r['accuracy']:.4f}, wall {r['wall']:.1f} s, "
                  f"{r['bytes'] / 1e6:.1f} MB sent", flush=True)


def figure_sweep(args, runs):
    for rep in range(args.sweep_repeats):
        for outer in ("average", "nesterov"):
            for every in (10, 50, 250, 1000):
                r = run_job(args, 2, 2, seed=1 + 10 * rep, every_ms=every, outer=outer)
                r["figure"] = 2
                runs.append(r)
                print(f"  sweep {outer} {every} ms repeat {rep}: accuracy {r['accuracy']:.4f}, "
                      f"{r['bytes'] / 1e6:.1f} MB sent", flush=True)


def figure_round(args, runs):
    bench = os.path.join(args.bin, "shmps-fed-bench")
    sizes = ["203530", "16777216"] if not args.smoke else ["203530", "1048576"]
    common = ["--elements", *sizes, "--rounds", str(args.rounds), "--repeats", str(3 if not args.smoke else 1)]
    setups = [("gloo", 2), ("gloo", 3)]
    # Not MPI across namespaces: mpirun's ranks reach their local daemon
    # through the loopback, which a namespace of their own cuts off.
    mpi_plugin = os.path.join(args.bin, "..", "lib", "shmps", "libshmps_fed_mpi.so")
    if not args.net and shutil.which("mpirun") and os.path.exists(mpi_plugin):
        setups += [("mpi", 2), ("mpi", 3)]
    for engine, hosts in setups:
        if engine == "gloo":
            store = tempfile.mkdtemp(prefix="fedbench")
            cmds = [[bench, "round", "--federation", "gloo", "--fed-store", "file:" + store, "--fed-hosts",
                     str(hosts), "--fed-host", str(h)] + common for h in range(hosts)]
            if args.net:
                cmds = [args.net.wrap(h, c + ["--fed-address", args.net.address(h)]) for h, c in enumerate(cmds)]
            procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
            outs = [p.communicate()[0] for p in procs]
            shutil.rmtree(store, ignore_errors=True)
            out = outs[0]
        else:
            root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
            out = subprocess.run(["mpirun", *root, "--oversubscribe", "-np", str(hosts), bench, "round",
                                  "--federation", "mpi"] + common, capture_output=True, text=True).stdout
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if not line:
            raise SystemExit(f"federation.py: shmps-fed-bench ({engine}, {hosts}) printed no result:\n{out[-3000:]}")
        print(out[:out.index("RESULT ")], end="", flush=True)
        result = json.loads(line[0][len("RESULT "):])
        result["figure"] = 3
        runs.append(result)


def serving_split():
    """(the CPU of host 0's consumer and the pushing worker, the rest) of
    this process's CPUs, as taskset lists them: figure 4 with --split-cpus."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("federation.py: --split-cpus needs at least 2 CPUs")
    return str(cpus[0]), ",".join(str(c) for c in cpus[1:])


def serve_once(args, hosts, every_ms, priority="normal", federate=True):
    model = ["--tensor", "w:203530", "--optimizer", "adam", "--lr", "0.001", "--backend", "host",
             "--max-staleness", "1000000"]
    split = serving_split() if args.split_cpus else None
    job = Hosts(args.bin, hosts, every_ms, model=model, net=args.net, fed_args=["--fed-priority", priority],
                federate=federate, split=split)
    try:
        bench = [os.path.join(args.bin, "shmps-fed-bench"), "serve", "--connect", job.segment(0),
                 "--elements", "203530", "--pushes", str(args.pushes)]
        if split:
            bench = ["taskset", "-c", split[0]] + bench
        out = subprocess.run(bench, capture_output=True, text=True, check=True).stdout
        r = json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][0][len("RESULT "):])
        r["rounds"] = int(job.stats(0)["fed_round"])
        return r
    finally:
        job.close()


# Figure 4's settings: (label, hosts, period ms, --fed-priority, federated).
# Two that split what federation costs: a second server beside host 0, not
# federated; and a group formed whose rounds never come (an hour apart).
SERVE_SETTINGS = [("off", 1, 50, "normal", False), ("off, a second server", 2, 50, "normal", False),
                  ("on, no round", 2, 3_600_000, "normal", True)] + [
    (f"on, {every} ms" + ("" if priority == "normal" else f", {priority}"), 2, every, priority, True)
    for every in (50, 10) for priority in ("normal", "low", "idle")]


def figure_serve(args, runs):
    # With --split-cpus the federation does not share the serving CPU, so
    # its priority changes nothing there: the default priority only.
    settings = [x for x in SERVE_SETTINGS if not args.split_cpus or x[3] == "normal"]
    for rep in range(args.repeats):
        for label, hosts, every, priority, federate in settings:
            r = serve_once(args, hosts, every, priority, federate)
            r.update({"figure": 4, "setting": label, "repeat": rep, "split_cpus": bool(args.split_cpus)})
            runs.append(r)
            print(f"  serve {label} repeat {rep}: p50 {r['p50_us']:.0f} us, p99 {r['p99_us']:.0f} us, "
                  f"{r['pushes_per_s']:.0f} pushes/s, {r['rounds']} rounds", flush=True)


def med(values):
    return statistics.median(values) if values else float("nan")


def summarize(runs):
    lines = [f"Network: {runs[0].get('network', 'loopback')}", ""] if runs else []
    parity = [r for r in runs if r.get("figure") == 1]
    if parity:
        ref = med([r["accuracy"] for r in parity if r["hosts"] == 1])
        lines += [f"## 1. Accuracy parity (medians over repeats; rounds every {parity[0]['every_ms']} ms, "
                  f"outer step {parity[0]['outer']}; {parity[0].get('fed_args', '')})", "",
                  "| hosts x workers | Adam lr | final accuracy | vs 1 x 4 | training s | MB of deltas (all hosts) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for hosts, workers in ((1, 4), (2, 2), (4, 1)):
            rs = [r for r in parity if r["hosts"] == hosts]
            acc = med([r["accuracy"] for r in rs])
            lr = rs[0].get("lr", 0.001)
            lines.append(f"| {hosts} x {workers} | {lr:g} | {acc:.4f} | {100 * (acc - ref):+.2f} pp | "
                         f"{med([r['wall'] for r in rs]):.1f} | {med([r['bytes'] for r in rs]) / 1e6:.1f} |")
        lines.append("")
    sweep = [r for r in runs if r.get("figure") == 2]
    if sweep:
        lines += ["## 2. Period sweep, 2 hosts x 2 workers (medians over repeats)", "",
                  "| outer step | period ms | final accuracy | MB of deltas (all hosts) |", "|---|---:|---:|---:|"]
        for outer in ("average", "nesterov"):
            for every in (10, 50, 250, 1000):
                rs = [r for r in sweep if r["outer"] == outer and r["every_ms"] == every]
                if rs:
                    lines.append(f"| {outer} | {every} | {med([r['accuracy'] for r in rs]):.4f} | "
                                 f"{med([r['bytes'] for r in rs]) / 1e6:.1f} |")
        lines.append("")
    rounds = [r for r in runs if r.get("figure") == 3]
    if rounds:
        lines += ["## 3. Round cost against the engine's allreduce (ms, medians)", "",
                  "| engine | hosts | model | allreduce | round | round / allreduce | snapshot | merge | memcpy |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rounds:
            for s in r["sizes"]:
                lines.append(f"| {r['engine']} | {r['hosts']} | {s['elements'] * 4 / 2**20:.2f} MiB | "
                             f"{s['allreduce_ms']:.2f} | {s['round_ms']:.2f} | {s['round_ms'] / s['allreduce_ms']:.2f} | "
                             f"{s['snapshot_ms']:.2f} | {s['merge_ms']:.2f} | {s['memcpy_ms']:.2f} |")
        lines.append("")
    serve = [r for r in runs if r.get("figure") == 4]
    if serve:
        off = [r for r in serve if r["setting"] == "off"]
        layout = ("; host 0 and the pushing worker on one CPU, host 0's federation and the other server on the "
                  "others" if serve[0].get("split_cpus") else "")
        lines += [f"## 4. Push round trip of 814 KB at host 0 (medians over repeats{layout}; ranges in brackets)",
                  "", "| federation | p50 us | p99 us | max us | pushes/s | p99 vs off | pushes/s vs off | rounds a run |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for label in [x[0] for x in SERVE_SETTINGS]:
            rs = [r for r in serve if r["setting"] == label]
            if not rs:
                continue
            rate = [r["pushes_per_s"] for r in rs]
            rounds = [r["rounds"] for r in rs]
            lines.append(f"| {label} | {med([r['p50_us'] for r in rs]):.0f} | {med([r['p99_us'] for r in rs]):.0f} | "
                         f"{med([r['max_us'] for r in rs]):.0f} | {med(rate):.0f} ({min(rate):.0f}-{max(rate):.0f}) | "
                         f"{med([r['p99_us'] for r in rs]) / med([r['p99_us'] for r in off]):.2f} | "
                         f"{med(rate) / med([r['pushes_per_s'] for r in off]):.2f} | {'-' if label.startswith('off') else f'{min(rounds)}-{max(rounds)}'} |")
        lines.append("")
    return "\n".join(lines)


def plot(runs, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("federation.py: no matplotlib (apt-get install python3-matplotlib): no plots")
        return
    parity = [r for r in runs if r.get("figure") == 1]
    if parity:
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for hosts, workers in ((1, 4), (2, 2), (4, 1)):
            r = next(r for r in parity if r["hosts"] == hosts)
            a.plot([t for t, _, _ in r["curve"]], [x for _, _, x in r["curve"]], label=f"{hosts} x {workers}")
            b.plot([n for _, n, _ in r["curve"]], [x for _, _, x in r["curve"]], label=f"{hosts} x {workers}")
        a.set_xlabel("wall time (s)")
        b.set_xlabel("applied updates (host 0's x hosts)")
        for ax in (a, b):
            ax.set_ylabel("test accuracy (host 0's weights)")
            ax.set_ylim(0.80, 0.90)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "federation_parity.png"), dpi=90)
    sweep = [r for r in runs if r.get("figure") == 2]
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        for outer in ("average", "nesterov"):
            points = []  # (MB, accuracy, period): medians over the repeats
            for every in (10, 50, 250, 1000):
                rs = [r for r in sweep if r["outer"] == outer and r["every_ms"] == every]
                if rs:
                    points.append((med([r["bytes"] for r in rs]) / 1e6, med([r["accuracy"] for r in rs]), every))
            points.sort()
            ax.plot([m for m, _, _ in points], [a for _, a, _ in points], "o-", label=outer)
            for m, a, every in points:
                ax.annotate(f"{every} ms", (m, a), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("MB of deltas the hosts contributed")
        ax.set_ylabel("final test accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "federation_sweep.png"), dpi=90)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.path.join(ROOT, "build", "default", "bin"))
    p.add_argument("--out", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep-repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--train-limit", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--pushes", type=int, default=3000)
    p.add_argument("--figures", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--every-ms", type=int, default=50, help="figure 1's round period")
    p.add_argument("--outer", default="average", help="figure 1's outer step")
    p.add_argument("--priority", default="normal", help="figure 1's --fed-priority (normal, low, idle)")
    p.add_argument("--outer-lr", type=float, help="figure 1's outer lr (nesterov; the server's default otherwise)")
    p.add_argument("--outer-momentum", type=float, help="figure 1's outer momentum (nesterov; 0: plain SGD on the "
                   "negated mean delta, A' = A + lr x mean)")
    p.add_argument("--host-lr", type=float, help="figure 1: the federated hosts' Adam lr (the 1 x 4 reference "
                   "keeps 1e-3)")
    p.add_argument("--split-cpus", action="store_true", help="figure 4 with host 0 and the pushing worker on the "
                   "first CPU of this process's mask, host 0's federation (--fed-cpus) and the other server on the "
                   "rest: a host whose federation has cores of its own")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--netns", metavar="RATE", help="figure 5: every host in a network namespace, links shaped to "
                   "RATE (tc's units: 1gbit); needs root")
    p.add_argument("--delay", help="with --netns: netem's delay on each link end (0.25ms), where the kernel has netem")
    p.add_argument("--replot", metavar="DIR", help="only redraw DIR's plots from its runs.json")
    args = p.parse_args()
    if args.replot:
        with open(os.path.join(args.replot, "runs.json")) as j:
            plot(json.load(j), args.replot)
        return
    if args.smoke:
        args.repeats, args.sweep_repeats, args.epochs, args.train_limit = 1, 1, 1, 6000
        args.eval_every, args.rounds, args.pushes = 100, 3, 300
    out = args.out or tempfile.mkdtemp(prefix="federation")
    os.makedirs(out, exist_ok=True)
    runs = []
    if args.delay and not args.netns:
        p.error("--delay needs --netns")
    args.net = Network(args.netns, 4 if 1 in args.figures else 3, args.delay) if args.netns else None
    try:
        if args.net:
            rtt, gbit = args.net.probe()
            args.net.measured = f"; measured between two hosts: {rtt:.0f} us round trip, {gbit:.2f} Gbit/s one way"
            print(f"network: {args.net.describe()}", flush=True)
        for f, fn in ((3, figure_round), (4, figure_serve), (1, figure_parity), (2, figure_sweep)):
            if f in args.figures:
                print(f"figure {f}", flush=True)
                fn(args, runs)
                for r in runs:
                    r.setdefault("network", args.net.describe() if args.net else "loopback")
                with open(os.path.join(out, "runs.json"), "w") as j:
                    json.dump(runs, j)
    finally:
        if args.net:
            args.net.close()
    text = summarize(runs)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    plot(runs, out)
    print(f"results in {out}")


if __name__ == "__main__":
    main()
