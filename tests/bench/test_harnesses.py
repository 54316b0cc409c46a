"""The Python benchmark harnesses (bench/*.py): what they refuse and what
they clean up, without training anything and without a timing."""

import os
import tempfile
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)

import straggler  # noqa: E402


def run_straggler(*args):
    return subprocess.run([sys.executable, os.path.join(BENCH, "straggler.py"), "--smoke", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [["--arms", "ddp"], ["--conditions", "straggler"],
                                  ["--arms", "single", "ddp", "--conditions", "plain", "straggler"]])
def test_straggler_refuses_straggler_runs_with_no_step_time_to_measure(tmp_path, args):
    """The straggler sleeps 2x a step time measured in a plain 4-worker
    shmps run of the same repeat: with none, it is refused at once."""
    out = run_straggler(*args, "--out", str(tmp_path))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "a straggler run needs the others' step time" in out.stderr
    assert not (tmp_path / "runs.json").exists()


def test_straggler_refuses_a_delay_that_is_not_positive(tmp_path):
    out = run_straggler("--arms", "ddp", "--conditions", "straggler", "--straggler-delay-ms", "0",
                        "--out", str(tmp_path))
    assert out.returncode == 2
    assert "--straggler-delay-ms must be > 0" in out.stderr


def fake_run(label, straggler_flag, delay_ms):
    return {"label": label, "arm": "ddp", "procs": 4, "repeat": 0, "straggler": straggler_flag, "delay": delay_ms,
            "wall": 1.0, "updates": 100, "rejected": 0, "staleness": None, "curve": [(0.5, 100, 0.8)]}


class Args:
    epochs, max_staleness, repeats, straggler_delay_ms = 1, 4, 1, None


def test_straggler_summary_refuses_a_straggler_run_that_slept_zero():
    with pytest.raises(SystemExit, match="slept 0.0 ms"):
        straggler.summarize([fake_run("ddp", False, 0.0), fake_run("ddp, straggler", True, 0.0)], Args())
    with pytest.raises(SystemExit, match="says straggler=False"):
        straggler.summarize([fake_run("ddp, straggler", False, 0.0)], Args())
    summary = straggler.summarize([fake_run("ddp", False, 0.0), fake_run("ddp, straggler", True, 12.5)], Args())
    assert "worker 0 sleeps 12.50 ms per step" in summary
    assert "| ddp, straggler |" in summary


def test_federation_hosts_that_do_not_join_are_stopped(tmp_path, monkeypatch):
    """bench/federation.py's Hosts: when a host does not join in time, the
    servers it started are stopped and reaped before the error, and each
    was started with --parent-pid this process."""
    import federation

    started = tmp_path / "started"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A server that never serves, and an inspect that finds none.
    (bin_dir / "shmps-server").write_text(f'#!/bin/sh\necho "$$ $*" >> {started}\nexec sleep 600\n')
    (bin_dir / "shmps-inspect").write_text("#!/bin/sh\nexit 1\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setattr(federation.Hosts, "JOIN_S", 1, raising=False)
    # The logs Hosts keeps for the error go under tmp_path, not /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pids = []
    try:
        with pytest.raises(SystemExit, match="host 0 joined: not within"):
            federation.Hosts(str(bin_dir), 2)
        lines = started.read_text().splitlines()
        assert len(lines) == 2, lines
        pids = [int(line.split()[0]) for line in lines]
        for pid in pids:
            with pytest.raises(ProcessLookupError):  # stopped and reaped
                os.kill(pid, 0)
        for line in lines:
            assert f"--parent-pid {os.getpid()}" in line, line
    finally:
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
