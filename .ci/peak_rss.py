"""Run a command, then print its peak resident memory: the largest process's, and the whole
process tree's, summed.

`.ci/run` wraps the test suite in it: the suite must fit beside other work on a
24 GiB machine, so a peak over the bound fails the run even when every test passed.
Tests start servers, agent CLIs and load tools as child processes, so the bound applies to
the tree's sum, sampled every `INTERVAL_S` from /proc (a peak shorter than that can be
missed; the largest single process's peak, from the kernel, is exact).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading

INTERVAL_S = 0.2
_PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        tree.setdefault(parent, []).append(int(entry))
    return tree


def _tree_rss_kib(root: int) -> int:
    tree, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        todo += tree.get(pid, [])
        try:
            with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
                total += int(statm.read().split()[1]) * _PAGE_KIB
        except (OSError, ValueError, IndexError):
            continue
    return total


def _sample(root: int, done: threading.Event, peak: list[int]) -> None:
    while not done.wait(INTERVAL_S):
        peak[0] = max(peak[0], _tree_rss_kib(root))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bound-mib", type=int, required=True, help="fail when the tree's summed peak is above this")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    process = subprocess.Popen(command)
    done, tree_peak = threading.Event(), [0]
    sampler = threading.Thread(target=_sample, args=(process.pid, done, tree_peak), daemon=True)
    sampler.start()
    rc = process.wait()
    done.set()
    sampler.join()
    # ru_maxrss of the children is the largest resident set of any one waited-for process, in KiB.
    largest_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    tree_mib = max(tree_peak[0] / 1024, largest_mib)
    print(
        f"peak RSS of the test run: {tree_mib:.0f} MiB, all its processes together "
        f"(largest one process: {largest_mib:.0f} MiB; bound {args.bound_mib} MiB)",
        flush=True,
    )
    if rc == 0 and tree_mib > args.bound_mib:
        print("the test run's peak memory is over its bound: failing the run", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
