"""Warm the fixture cache before tests run (CI calls this once per job).

Usage: ``python scripts/build_fixtures.py [--model] [--cache-dir DIR]``,
the same options as ``onehop fixtures``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout that may not be installed, so make the repo importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onehop.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["fixtures", *sys.argv[1:]]))
