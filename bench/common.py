"""Helpers shared by the benchmarks."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import time

from elastic.controller.journal import read_journal


def wait_entry(state_dir, kind, timeout_s=60.0, after_ts=0.0, **match) -> dict:
    """The first journal entry of `kind` at or after `after_ts` matching `match`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in read_journal(state_dir):
            if e["kind"] == kind and e["ts"] >= after_ts and \
                    all(e.get(k) == v for k, v in match.items()):
                return e
        time.sleep(0.01)
    raise TimeoutError(f"no {kind} {match} within {timeout_s} s")


def summarize(values: list[float]) -> dict:
    """Median, p95, min, max (seconds) and count."""
    ordered = sorted(values)
    return {"median_s": round(statistics.median(ordered), 3),
            "p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3),
            "min_s": round(ordered[0], 3), "max_s": round(ordered[-1], 3), "n": len(ordered)}


def machine() -> str:
    return f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"


def write_result(path: str, result: dict) -> None:
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten to {out}")


def print_table(results: dict[str, dict]) -> None:
    """Print `summarize` results as a table (seconds)."""
    print(f"\n{'measure':38} {'median':>8} {'p95':>8} {'min':>8} {'max':>8}")
    for name, s in results.items():
        print(f"{name:38} {s['median_s']:8.3f} {s['p95_s']:8.3f} {s['min_s']:8.3f} "
              f"{s['max_s']:8.3f}")
