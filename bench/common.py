"""Helpers shared by the benchmarks."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator

from elastic.controller.journal import JournalTail
from elastic.controller.status import fetch_status



_tails: dict[str, JournalTail] = {}


def wait_entry(state_dir, kind, timeout_s=60.0, after_ts=0.0, **match) -> dict:
    """The first journal entry of `kind` at or after `after_ts` matching `match`."""
    tail = _tails.setdefault(str(state_dir), JournalTail(state_dir))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in tail.read():
            if e["kind"] == kind and e["ts"] >= after_ts and \
                    all(e.get(k) == v for k, v in match.items()):
                return e
        time.sleep(0.02)
    raise TimeoutError(f"no {kind} {match} within {timeout_s} s")


def run_in_one_generation(local, timeout_s: float) -> list[dict]:
    """Wait for the job of `local` (a LocalSlice) to end, stop the slice
    (always), and return its journal. Raises RuntimeError when it does not
    end within `timeout_s` seconds, does not succeed, or restarted (more
    than one generation)."""
    from elastic.controller.journal import read_journal
    from elastic.local import stop_slice

    state = local.state_dir
    try:
        deadline = time.monotonic() + timeout_s
        while not any(e["kind"] in ("job_succeeded", "job_failed") for e in read_journal(state)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not end within {timeout_s} s: {state}")
            time.sleep(0.5)
    finally:
        stop_slice(local)
    journal = list(read_journal(state))
    kinds = [e["kind"] for e in journal]
    if "job_succeeded" not in kinds or kinds.count("generation_started") != 1:
        raise RuntimeError(f"the run failed or restarted: {state}")
    return journal


def reported_host(local, host_id: str, timeout_s: float = 30.0):
    """`host_id`'s entry in the status of the controller of `local` (a
    LocalSlice; elastic.v1 HostStatus)
    once both its agent and its worker pid are reported; a fault aimed at
    pid 0 would hit the benchmark's own process group. Raises TimeoutError
    after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = fetch_status(local.address, local.tls)
        host = next((h for h in status.hosts if h.host_id == host_id), None)
        if host is not None and host.agent_pid > 0 and host.worker_pid > 0:
            return host
        time.sleep(0.02)
    raise TimeoutError(f"{host_id} reported no agent and worker pid within {timeout_s} s")


def summarize(values: list[float]) -> dict:
    """Median, p95, min, max (seconds) and count."""
    ordered = sorted(values)
    return {"median_s": round(statistics.median(ordered), 3),
            # (nearest rank: the smallest value with 95 % of them at or below it)
            "p95_s": round(ordered[math.ceil(0.95 * len(ordered)) - 1], 3),
            "min_s": round(ordered[0], 3), "max_s": round(ordered[-1], 3), "n": len(ordered)}


def step_window(times_path: pathlib.Path, first: int) -> tuple[float, float]:
    """(mean, median) step time in seconds over steps [first, end) of a
    workers/lm --step-times file written by a run that started at step 0.
    The mean counts every step's share of the time, the slow ones too (a
    snapshot's, a save's); the median leaves those out. Raises RuntimeError
    when the run restarted."""
    recorded = json.loads(times_path.read_text())
    if recorded["first_step"] != 0:
        raise RuntimeError(f"{times_path}: the run restarted (first step {recorded['first_step']})")
    ends = recorded["ends"][first - 1:]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return (ends[-1] - ends[0]) / len(gaps), statistics.median(gaps)


def machine() -> str:
    return f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"


@contextlib.contextmanager
def work_dir(prefix: str, keep: bool = False) -> Iterator[pathlib.Path]:
    """A new working directory for one run (tempfile.mkdtemp(prefix=prefix)):
    its job spec, state directory (journal, logs, the test certificate
    authority's private keys) and checkpoints, which can reach gigabytes.
    Removed when the run ends, so that runs do not pile private keys and
    checkpoints up in /tmp; kept, its path printed, with `keep` or when the
    run ends with an exception (the journal and logs then say why, and the
    errors raised inside name paths in it). Leave the block only after
    everything that reads from it has read, and every process started in it
    has stopped."""
    path = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"kept {path} (the run failed)", flush=True)
        raise
    if keep:
        print(f"kept {path}", flush=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def add_keep_flag(parser: argparse.ArgumentParser) -> None:
    """Add --keep (`work_dir`'s `keep`) to a benchmark's arguments."""
    parser.add_argument("--keep", action="store_true",
                        help="keep each run's working directory, with its journal, logs and "
                             "checkpoints, instead of removing it")


def stolen_cpu_s() -> float | None:
    """CPU seconds the hypervisor has taken from this machine since boot,
    all cores together (the steal column of /proc/stat: time the guest
    wanted to run and did not); None where it does not say."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


#: (monotonic seconds, stolen CPU seconds) when the benchmark started
_STARTED = (time.monotonic(), stolen_cpu_s())


def write_result(path: str, result: dict) -> None:
    """Write `result` as JSON to `path`, with the CPU time the hypervisor
    took from this machine since the benchmark started (`cpu_stolen_s`,
    and its share of the cores' time): on these shared machines a run that
    lost a few percent of its CPU reads slower for it (2026-12-07: 3.2 %
    in one snapshot benchmark, +35 % on two of its rounds)."""
    stolen = stolen_cpu_s()
    if stolen is not None and _STARTED[1] is not None:
        wall_s = time.monotonic() - _STARTED[0]
        share = (stolen - _STARTED[1]) / (wall_s * (os.cpu_count() or 1))
        result = {**result, "cpu_stolen_s": round(stolen - _STARTED[1], 1),
                  "cpu_stolen_share": round(share, 4)}
        print(f"\nthe hypervisor took {stolen - _STARTED[1]:.1f} s of CPU time in this run's "
              f"{wall_s:.0f} s (steal: {100 * share:.1f} % of the {os.cpu_count()} cores)")
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


def lm_job(work: pathlib.Path, job_id: str, hosts: int, checkpoint_every: int = 100,
           extra: str = "", worker_args: tuple[str, ...] = (),
           mesh: str = "data=-1,model=2", file_name: str = "job.toml",
           min_hosts: int = 1) -> pathlib.Path:
    """Write a job spec running workers/lm (endless, on `mesh` (axes in
    order; default data=-1 x model=2), restart budget and crash loop out of
    the way, as benchmarks hit the same hosts again and again) into
    `work`/`file_name`; returns its path (the job's working directory is
    `work`). `extra`: more TOML (in [restart]); `worker_args`: more
    arguments for train.py; `min_hosts`: the hosts the first generation
    waits for."""
    import sys

    repo = pathlib.Path(__file__).resolve().parent.parent
    argv = [sys.executable, str(repo / "workers/lm/train.py"), "--steps", "100000000",
            "--checkpoint-every", str(checkpoint_every), "--eval-every", "100000000", *worker_args]
    mesh_lines = "\n".join(f"{name.strip()} = {size.strip()}" for name, size in
                           (axis.split("=") for axis in mesh.split(",")))
    path = work / file_name
    path.write_text(f"""
[job]
id = "{job_id}"
command = {json.dumps(argv)}
min_hosts = {min_hosts}
max_hosts = {hosts}

[mesh]
{mesh_lines}

[restart]
max_restarts = 10000
crash_loop_failures = 10000
{extra}
""")
    return path
