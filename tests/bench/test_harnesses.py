"""The Python benchmark harnesses (bench/*.py): what they refuse and what
they clean up, without training anything and without a timing."""

import os
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
