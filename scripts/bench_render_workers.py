"""The render cache under `--workers N`: what a turn costs on a worker that has not seen the last k turns.

Each gateway worker keeps its own turn cache, and a conversation reaches the worker
its connection was accepted by. A client that keeps its connection alive between turns
stays on one worker; a new connection (after an idle gap longer than the server's or
the client's keep-alive bound) lands on any worker, which tokenizes the turns it has
not seen since it last served the conversation.

Two measurements, on `scripts/bench_render.py`'s agent sessions (40 turns reaching
~140K tokens, a shared system prompt and 24 tools; the embedded Qwen3 tokenizer):

- **a miss of k turns**: turn 40 rendered by a worker whose cache last saw the
  conversation at turn 40 − k (k = 1 is the ordinary next turn on the same worker;
  "cold" is a worker that never saw it): render CPU and the tokens tokenized;
- **N workers** (`--workers`, 2 by default): sessions played turn by turn (round-robin
  over sessions) through N renderers, each with its own cache, as N worker processes
  hold them; each turn goes to the session's worker, except that with probability p it
  comes on a new connection and goes to any worker at random (p = 0: kept alive
  throughout; p = 1: a new connection every turn, as behind a proxy that pools its
  connections to the gateway). Per turn: render CPU p50/p99/mean and tokens tokenized;
  at the end, all caches' bytes (a conversation seen by several workers is held by each).

CPU is the process's (it counts `tokenizers`' own threads).

    .venv/bin/python scripts/bench_render_workers.py [--sessions 10] [--workers 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.qwen3.fixtures import ensure_tokenizer  # noqa: E402
from gateway.render.local import LocalRenderer  # noqa: E402
from gateway.render.turn_cache import TurnCache  # noqa: E402
from scripts.bench_render import TURNS, Workload, _commit, _machine, _pct, _timed  # noqa: E402

MISSES = (1, 2, 4, 8, 16, TURNS - 1)
"""Turns since the worker last saw the conversation; TURNS - 1: only turn 1 seen."""
REPEATS = 3
RECONNECT = (0.0, 0.25, 1.0)
"""Chance that a turn comes on a new connection (to either worker)."""
WORKERS = 2


class Counted:
    """A renderer and the tokens it tokenized (its `on_cache` report)."""

    def __init__(self) -> None:
        self.tokenized = 0
        self.renderer = LocalRenderer(ensure_tokenizer(), workers=1, on_cache=self._count)

    def _count(self, hits: int, tokenized: int) -> None:
        self.tokenized += tokenized

    def forget(self) -> None:
        self.renderer.turn_cache = TurnCache(self.renderer.turn_cache.budget)

    def render(self, workload: Workload, session: int, turn: int) -> tuple[float, float, int]:
        """(CPU s, wall s, tokens tokenized) of rendering `session`'s `turn`."""
        before = self.tokenized
        cpu, wall, _ = _timed(partial(self.renderer.chat_sync, workload.request(session, turn)))
        return cpu, wall, self.tokenized - before


def run_misses(workload: Workload) -> list[dict[str, Any]]:
    """Turn 40 on a worker that last saw turn 40 - k, and on one that never saw the conversation."""
    worker = Counted()
    rows = []
    try:
        for missed in (*MISSES, None):
            runs = []
            for _ in range(REPEATS):
                worker.forget()
                if missed is not None:
                    worker.render(workload, 0, TURNS - missed)
                runs.append(worker.render(workload, 0, TURNS))
            rows.append({
                "missed_turns": "cold" if missed is None else missed,
                "cpu_ms": statistics.median(r[0] for r in runs) * 1e3,
                "wall_ms": statistics.median(r[1] for r in runs) * 1e3,
                "tokenized": runs[0][2],
            })
    finally:
        worker.renderer.close()
    return rows


def run_workers(workload: Workload, count: int, sessions: int, reconnect: float, seed: int) -> dict[str, Any]:
    """Every session's 40 turns, round-robin over sessions, through `count` workers' caches."""
    workers = [Counted() for _ in range(count)]
    rng = random.Random(f"connections {seed} {reconnect}")
    home = [session % count for session in range(sessions)]
    cpu: list[float] = []
    tokenized: list[int] = []
    moved = 0
    try:
        for turn in range(1, TURNS + 1):
            for session in range(sessions):
                if turn > 1 and rng.random() < reconnect:
                    chosen = rng.randrange(count)  # the kernel's pick for a new connection
                    moved += chosen != home[session]
                    home[session] = chosen
                spent, _, new = workers[home[session]].render(workload, session, turn)
                cpu.append(spent)
                tokenized.append(new)
        return {
            "workers": count,
            "reconnect": reconnect,
            "sessions": sessions,
            "moved": moved,
            "cpu_p50_ms": _pct(cpu, 0.5) * 1e3,
            "cpu_p99_ms": _pct(cpu, 0.99) * 1e3,
            "cpu_mean_ms": statistics.fmean(cpu) * 1e3,
            "tokenized_mean": statistics.fmean(tokenized),
            "cache_mb": sum(worker.renderer.cached_bytes for worker in workers) / 2**20,
        }
    finally:
        for worker in workers:
            worker.renderer.close()


def report(results: dict[str, Any]) -> Iterator[str]:
    yield f"commit {results['commit']}, {results['machine']}"
    yield ""
    yield "| turn 40 on a worker that last saw the conversation | render CPU | wall | tokens tokenized |"
    yield "|---|---:|---:|---:|"
    for row in results["misses"]:
        missed = row["missed_turns"]
        label = "never (cold)" if missed == "cold" else f"{missed} turn{'s' if missed != 1 else ''} ago"
        yield f"| {label} | {row['cpu_ms']:.1f} ms | {row['wall_ms']:.1f} ms | {row['tokenized']:,} |"
    yield ""
    first = results["workers"][0]
    yield f"| {first['workers']} workers, {first['sessions']} sessions × {TURNS} turns: a turn on a new connection | turns that changed worker | render per turn, p50 (CPU) | p99 | mean | tokens tokenized per turn | all caches |"  # fmt: skip
    yield "|---|---:|---:|---:|---:|---:|---:|"
    for row in results["workers"]:
        label = {0.0: "never (kept alive)", 1.0: "every turn"}.get(row["reconnect"], f"{row['reconnect']:.0%} of turns")
        yield (f"| {label} | {row['moved']} | {row['cpu_p50_ms']:.1f} ms | {row['cpu_p99_ms']:.1f} ms | "
               f"{row['cpu_mean_ms']:.1f} ms | {row['tokenized_mean']:,.0f} | {row['cache_mb']:.0f} MiB |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    workload = Workload(args.seed)
    results: dict[str, Any] = {"commit": _commit(), "machine": _machine(), "misses": run_misses(workload)}
    results["workers"] = [run_workers(workload, args.workers, args.sessions, p, args.seed) for p in RECONNECT]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
