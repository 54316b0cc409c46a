#!/usr/bin/env python3
"""tools/check_ctest_skips.py BUILD_DIR CTEST_LOG: fails when the CTest run
whose output is CTEST_LOG skipped a test that needs no GPU.

CTest counts a skipped test as passed, and many of shmps's tests skip where
a dependency is missing (no nanobind: no Python tests at all; no torch: the
torch tests skip; no Gloo, MPI, ip or redis-server: the multihost tests
skip; no mirror: the systemd test skips). On a machine set up by
tools/install-deps.sh, as CI's is, only the tests that need a GPU may skip:
those labelled gpu, and the Python tests marked @cuda. The groups that
skip by not being registered at all (python, torch, multihost; systemd as
root) must be there.

As a user (not root) the root-only tests skip on purpose: the skipped ones
are then listed, and nothing fails.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

# A skip that depends on timing, not on the machine: the SIGHUP must land
# while the server is starting, which a quick start can miss.
TIMING_SKIPS = {"python.test_worker.test_a_sighup_during_the_start_is_applied_once_the_server_serves"}
# Tests of the federation thread's lowered priority, which skip when the
# run itself is already lowered (nice 19, another scheduling policy): a
# lowered thread would look like the others.
PRIORITY_SKIPS = {"multihost_gloo_priority", "test_federation.the_federation_thread_runs_at_its_priority",
                  "test_federation.an_engines_io_thread_is_lowered_and_never_preempts_on_wake_up"}
REQUIRED_LABELS = ["python", "torch", "multihost"]
REQUIRED_LABELS_AS_ROOT = ["systemd"]


def labels_by_test(build_dir):
    listing = subprocess.run(["ctest", "--test-dir", build_dir, "--show-only=json-v1"], check=True,
                             capture_output=True, text=True).stdout
    tests = {}
    for t in json.loads(listing)["tests"]:
        labels = next((p["value"] for p in t.get("properties", []) if p["name"] == "LABELS"), [])
        tests[t["name"]] = set(labels)
    return tests


def cuda_marked_python_tests(source_dir):
    """python.<file>.<test> for each test function decorated with @cuda."""
    names = set()
    for path in sorted((source_dir / "tests" / "python").glob("test_*.py")):
        decorators = []
        for line in path.read_text().splitlines():
            if line.startswith("@"):
                decorators.append(line.strip())
                continue
            m = re.match(r"def (test_\w+)", line)
            if m and "@cuda" in decorators:
                names.add(f"python.{path.stem}.{m.group(1)}")
            decorators = []
    return names


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: check_ctest_skips.py BUILD_DIR CTEST_LOG")
    build_dir, log = sys.argv[1], Path(sys.argv[2]).read_text()
    source_dir = Path(__file__).resolve().parent.parent
    tests = labels_by_test(build_dir)
    as_root = os.geteuid() == 0
    problems = []
    for label in REQUIRED_LABELS + (REQUIRED_LABELS_AS_ROOT if as_root else []):
        if not any(label in labels for labels in tests.values()):
            problems.append(f"no test labelled {label} is registered (a dependency CMake looked for is missing)")
    gpu_only = {name for name, labels in tests.items() if "gpu" in labels} | cuda_marked_python_tests(source_dir)
    skipped = re.findall(r"^\s*\d+ - (\S+) \((?:Skipped|Not Run|Disabled)\)$", log, re.M)
    allowed = gpu_only | TIMING_SKIPS
    if os.nice(0) >= 19 or os.sched_getscheduler(0) != os.SCHED_OTHER:
        allowed |= PRIORITY_SKIPS
    unexpected = [name for name in skipped if name not in allowed]
    print(f"check_ctest_skips: {len(skipped)} skipped, {len(skipped) - len(unexpected)} of them need a GPU "
          f"or timing (or a priority this run lacks); {len(unexpected)} others")
    if unexpected:
        listed = "\n  ".join(unexpected)
        if as_root:
            problems.append(f"skipped, though they need no GPU (their output: ctest --test-dir {build_dir} "
                            f"--output-on-failure -R NAME -V):\n  {listed}")
        else:
            print(f"check_ctest_skips: not root, so these may skip for want of it:\n  {listed}")
    for p in problems:
        print(f"check_ctest_skips: FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
