"""Run a command, then print the peak resident memory of its largest process.

`.ci/run` wraps the test suite in it: the suite must fit beside other work on a
24 GiB machine, so a peak over the bound fails the run even when every test passed.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bound-mib", type=int, required=True, help="fail when the peak is above this")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    rc = subprocess.call(command)
    # ru_maxrss of the children is the largest resident set of any one waited-for process, in KiB.
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"peak RSS of the test run: {peak_mib:.0f} MiB (bound {args.bound_mib} MiB)", flush=True)
    if rc == 0 and peak_mib > args.bound_mib:
        print("the test run's peak memory is over its bound: failing the run", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
