#!/usr/bin/env python3
"""The memory-order rule of the house style, checked (in the spirit of
iceoryx's check_atomic_usage.sh): every acquire, release or acq_rel access
(std::memory_order_*, or the GCC builtins' __ATOMIC_*)
carries a SYNC(tag) naming what it publishes or consumes, on its statement
or in the comment right above it, and every tag appears at two places at
least (both ends of the pair). Relaxed and seq_cst accesses say why in
prose, which no script can judge. Usage: tools/check_atomics.py [ROOT];
exit 1 with one line per finding, 0 when clean.
"""

import collections
import os
import re
import sys

# The code that speaks the protocol; tests/ and fuzz/ play peers that break
# it on purpose.
DIRS = ("base", "shm", "kernels", "server", "worker_lib", "python", "tools", "bench", "examples")
SUFFIXES = (".cpp", ".hpp", ".cu", ".h")
ORDER = re.compile(r"memory_order_(?:acquire|release|acq_rel)\b|__ATOMIC_(?:ACQUIRE|RELEASE|ACQ_REL)\b")
SYNC = re.compile(r"SYNC\(([a-z0-9_]+)\)")
ABOVE = 4  # comment lines above an access that may carry its tag or reason


def statement_context(lines, i):
    """Line i, the other lines of its statement (a statement continued over
    lines), and the comment lines right above the statement, joined."""
    out = [lines[i]]
    k = i
    while k + 1 < len(lines) and len(out) < 4 and not lines[k].split("//")[0].rstrip().endswith((";", "{", "}")):
        k += 1
        out.append(lines[k])
    j = i - 1
    while j >= 0 and len(out) < 4 and lines[j].strip() and not lines[j].rstrip().endswith((";", "{", "}")) \
            and not lines[j].strip().startswith("//"):
        out.append(lines[j])
        j -= 1
    comments = 0
    while j >= 0 and comments < ABOVE and lines[j].strip().startswith("//"):
        out.append(lines[j])
        j -= 1
        comments += 1
    return " ".join(out)


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    findings = []
    tags = collections.Counter()
    for d in DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            for name in sorted(files):
                if not name.endswith(SUFFIXES):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = f.read().splitlines()
                for i, line in enumerate(lines):
                    for tag in SYNC.findall(line):
                        tags[tag] += 1
                    orders = ORDER.findall(line.split("//")[0])
                    if orders and not SYNC.search(statement_context(lines, i)):
                        findings.append(f"{rel}:{i + 1}: {'/'.join(orders)} without a SYNC(tag): {line.strip()}")
    for tag, n in sorted(tags.items()):
        if n < 2:
            findings.append(f"SYNC({tag}) appears once: its other end is missing")
    for f in findings:
        print(f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
