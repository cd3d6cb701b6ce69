"""Probe: can the surviving processes of a multi-process JAX job go on after
one of them is killed, on this machine's backend?

Issue 19's fastest restart keeps the survivors' processes, buffers and
compiled executables and restarts only what died. That needs the survivors
to get out of the collective the dead process will never join. JAX offers
`jax_enable_recoverability` for it (docs.jax.dev, "Fault Tolerant Distributed
JAX": experimental, "only works fully on GPUs"). This probe starts
`--processes` processes x 2 CPU devices, each summing a global array in a
loop (one cross-process all-reduce a step), SIGKILLs the last one at step
`--kill-at`, and reports for each survivor what it did within `--wait-s`:
raised (the exception), exited (its code), or still blocked in the step.
Every process is killed at the end.

    .venv/bin/python bench/jax_recoverability.py --wait-s 30
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

from common import machine, write_result

from elastic.checkpoint.emulator import free_port

REPO = pathlib.Path(__file__).resolve().parent.parent


def child(process_id: int, processes: int, port: int, kill_at: int, recoverable: bool) -> None:
    """One process of the probe: print a JSON line per event, SIGKILL itself
    at step `kill_at` if it is the last process."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def say(**fields) -> None:
        print(json.dumps({"process": process_id, "t": time.time(), **fields}), flush=True)

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_enable_recoverability", recoverable)
    jax.distributed.initialize(f"127.0.0.1:{port}", processes, process_id,
                               heartbeat_timeout_seconds=5, initialization_timeout=60)
    mesh = jax.make_mesh((2 * processes,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.make_array_from_callback((2 * processes,), NamedSharding(mesh, P("d")),
                                     lambda index: jnp.ones((1,)))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    for step in range(1_000_000):
        if process_id == processes - 1 and step == kill_at:
            say(event="killed", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            float(total(x))
        except Exception as e:  # noqa: BLE001 - what the survivors get is the finding
            say(event="raised", step=step, error=f"{type(e).__name__}: {e}"[:300])
            return
        if step >= kill_at:
            say(event="stepped", step=step)
        time.sleep(0.01)


def _read_events(stdout, events: queue.Queue) -> None:
    """Put each JSON line a child prints into `events`, until it ends."""
    for line in stdout:
        if line.startswith("{"):
            events.put(json.loads(line))


def probe(processes: int, kill_at: int, wait_s: float, recoverable: bool) -> dict:
    """Run the probe; returns {"survivors": {process: {...}}, ...}. Raises
    RuntimeError when the processes do not reach the kill within 120 s."""
    port = free_port()
    events: queue.Queue = queue.Queue()
    procs = []
    for i in range(processes):
        p = subprocess.Popen([sys.executable, __file__, "--child", str(i), "--processes",
                              str(processes), "--port", str(port), "--kill-at", str(kill_at)]
                             + ([] if recoverable else ["--not-recoverable"]),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        procs.append(p)
        threading.Thread(target=_read_events, args=(p.stdout, events), daemon=True).start()
    try:
        killed_at, survivors = None, {i: {"state": "blocked"} for i in range(processes - 1)}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                e = events.get(timeout=0.2)
            except queue.Empty:
                e = None
            if e and e["event"] == "killed":
                killed_at = e["t"]
                deadline = time.monotonic() + wait_s
            elif e and e["event"] in ("raised", "stepped") and killed_at is not None:
                survivors[e["process"]] = {"state": e["event"], "after_s": round(e["t"] - killed_at, 3),
                                           **({"error": e["error"]} if "error" in e else {})}
            for i, p in enumerate(procs[:-1]):
                if p.poll() is not None and survivors[i]["state"] == "blocked":
                    survivors[i] = {"state": "exited", "code": p.returncode,
                                    "after_s": round(time.time() - (killed_at or time.time()), 3)}
        if killed_at is None:
            raise RuntimeError("the processes did not reach the kill within 120 s")
        return {"processes": processes, "recoverable": recoverable, "kill_at": kill_at,
                "wait_s": wait_s, "survivors": survivors}
    finally:
        for p in procs:  # (JAX takes SIGTERM for a preemption notice: SIGKILL)
            p.kill()
            p.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=50)
    parser.add_argument("--wait-s", type=float, default=30.0)
    parser.add_argument("--not-recoverable", action="store_true",
                        help="leave jax_enable_recoverability off (JAX's default)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "jax_recoverability.json"))
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.processes, args.port, args.kill_at, not args.not_recoverable)
        return 0
    import jax

    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "jax": jax.__version__,
              **probe(args.processes, args.kill_at, args.wait_s, not args.not_recoverable)}
    for i, s in result["survivors"].items():
        print(f"process {i}: {s['state']}" + (f" after {s['after_s']} s" if "after_s" in s else
                                               f" {args.wait_s:.0f} s after the kill")
              + (f" ({s.get('error') or s.get('code')})" if "error" in s or "code" in s else ""))
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
