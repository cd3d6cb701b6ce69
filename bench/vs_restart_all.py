"""Benchmark: this project against what a JAX user runs without it, under
the same seeded faults.

Two arms, one after the other, each for `--duration` seconds on `--hosts`
processes x 2 CPU devices, with the same fault schedule
(elastic.chaos.schedule: the same seed gives the same gaps, kinds and host
picks; each fault comes at its time on one timeline from the arm's start,
as elastic.chaos times them, once the job steps):
  elastic     -- workers/lm under `elasticd local` (bench/soak.py's setup);
  restart-all -- bench/plain_lm.py (jax.distributed with its 10 s heartbeat
                 timeout, Orbax async checkpoints and its preemption save,
                 JAX's persistent compile cache) under `RestartAll`: every
                 process is restarted together from the latest Orbax
                 checkpoint whenever one of them ends, as a JobSet
                 "Recreate" failure policy or per-host systemd units with a
                 gang restart do.

The faults (`--kinds`, default kill-worker+kill-host+stop-worker+preempt),
as each arm meets them:
  kill-worker -- SIGKILL the host's training process;
  kill-host   -- SIGKILL it and keep the host away for `--host-down-s`
                 (default: elastic's heartbeat timeout + 2 s, a reboot; 600
                 for a repair). The supervisor does not see a dead host's
                 process end (the machine is gone): the others end when
                 JAX's heartbeat timeout takes them down, or after
                 NODE_LOST_S (Kubernetes' node-monitor-grace-period);
  stop-worker -- SIGSTOP it (a hang: JAX's heartbeat timeout ends the rest);
  preempt     -- SIGTERM to the host's agent (elastic) or its process
                 (restart-all: JAX's preemption sync point, an Orbax save,
                 every process exits); the host is back at once.

The figure per arm is its ETTR measured the same way for both: the steps
the job stands at when the time is up (net of the steps rolled back by
restarts; from process 0's own log of its steps: train.py --sample-log,
plain_lm.py --progress-log) times the undisturbed step time of the restart-all arm's
`--hosts`-process job (the median gap between consecutive steps of one
process, leaving out each start's first STEADY_AFTER steps), over the
duration. Elastic's own report (elastic.goodput) is printed beside it. On
this machine slices of fewer hosts step faster (the processes share 2
cores), which flatters the elastic arm when it shrinks: its time at each
slice size is printed too, and its ETTR and the ratio once more with each
surviving step weighted by its slice's share of the hosts
(`full_size_steps`).

    .venv/bin/python bench/vs_restart_all.py --duration 600 --mtbf 60 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

from common import add_keep_flag, lm_job, machine, work_dir, write_result

from elastic.chaos import Chaos, ChaosSpec, faults_scheduled, schedule
from elastic.checkpoint.emulator import free_port
from elastic.config import load_spec
from elastic.controller.journal import read_journal
from elastic.goodput import account
from elastic.local import restart_agent, start_slice, stop_slice, surroundings
from elastic.procs import WORKER_PROCESS_GROUP, signal_group, signal_pid

REPO = pathlib.Path(__file__).resolve().parent.parent
KINDS = ("kill-worker", "kill-host", "stop-worker", "preempt")
#: Seconds after which a supervisor that cannot see a host any more
#: restarts the job anyway: Kubernetes' node-monitor-grace-period (40 s).
NODE_LOST_S = 40.0
#: Steps after each start left out of the undisturbed step time (compile,
#: restore and the first steps' warm-up).
STEADY_AFTER = 5


class RestartAll:
    """A supervisor of `hosts` bench/plain_lm.py processes (2 CPU devices
    each) that restarts them all together: when any process on a host that
    is up ends (any exit code: the job can not go on without it), it kills
    the rest and starts every process again, with a new coordinator port,
    once every host is up. Process 0 appends its steps to `progress_log`.
    `events` lists (time.time(), what) for each start and stop."""

    def __init__(self, hosts: int, work: pathlib.Path, checkpoint_every: int,
                 host_down_s: float) -> None:
        self.hosts, self.work, self.checkpoint_every = hosts, work, checkpoint_every
        self.host_down_s = host_down_s  # how long a killed host stays away
        self.progress_log = work / "progress.jsonl"
        self.progress_log.touch()
        self.procs: list[subprocess.Popen | None] = [None] * hosts
        self.killed_at = [-1e9] * hosts  # time.monotonic() each host was last killed
        self.started_at = 0.0  # time.time() of the newest start
        self.events: list[tuple[float, str]] = []

    @property
    def running(self) -> bool:
        return any(p is not None for p in self.procs)

    def start_all(self) -> None:
        coordinator = f"127.0.0.1:{free_port()}"
        self.started_at = time.time()
        logs = self.work / "logs"
        logs.mkdir(exist_ok=True)
        self.procs = []
        for i in range(self.hosts):
            argv = [sys.executable, str(REPO / "bench" / "plain_lm.py"), "--process-id", str(i),
                    "--num-processes", str(self.hosts), "--coordinator", coordinator,
                    "--checkpoint-dir", str(self.work / "ckpt"), "--steps", "100000000",
                    "--eval-every", "100000000", "--checkpoint-every", str(self.checkpoint_every),
                    "--compile-cache-dir", str(self.work / "compile-cache"),
                    "--progress-log", str(self.progress_log)]
            with open(logs / f"process-{i}.log", "a") as log:
                self.procs.append(subprocess.Popen(
                    argv, stdout=subprocess.DEVNULL, stderr=log,
                    env={**os.environ, "XLA_FLAGS": ""}, **WORKER_PROCESS_GROUP))
        self.events.append((self.started_at, "start"))

    def stop_all(self, why: str) -> None:
        for p in self.procs:
            if p is not None:
                signal_group(p.pid)  # SIGKILL, stopped processes too
        for p in self.procs:
            if p is not None:
                p.wait()
        self.procs = [None] * self.hosts
        self.events.append((time.time(), why))

    def tick(self) -> None:
        """Restart what needs it; call every few tens of milliseconds."""
        now = time.monotonic()
        if self.running:
            down = [now - t < self.host_down_s for t in self.killed_at]
            ended = [i for i, p in enumerate(self.procs)
                     if p is not None and p.poll() is not None and not down[i]]
            if ended:
                self.stop_all(f"process {ended[0]} ended ({self.procs[ended[0]].returncode})")
            elif any(down[i] and now - t > NODE_LOST_S for i, t in enumerate(self.killed_at)):
                self.stop_all("a host lost for the node grace period")
        if not self.running and all(now - t >= self.host_down_s for t in self.killed_at):
            self.start_all()

    def stepping(self) -> bool:
        """Whether process 0 has stepped since the newest start."""
        last = last_progress(self.progress_log)
        return self.running and last is not None and last["ts"] > self.started_at

    def inject(self, kind: str, host: int) -> None:
        """One fault of `kind` on process `host` (see the module docstring)."""
        pid = self.procs[host].pid
        if kind == "kill-worker":
            signal_group(pid)
        elif kind == "kill-host":
            self.killed_at[host] = time.monotonic()
            signal_group(pid)
        elif kind == "stop-worker":
            signal_pid(pid, signal.SIGSTOP)
        elif kind == "preempt":
            signal_pid(pid, signal.SIGTERM)
        else:
            raise ValueError(f"restart-all: fault kind {kind!r} not supported")
        self.events.append((time.time(), f"{kind} process {host}"))


def last_progress(path: pathlib.Path) -> dict | None:
    """The last complete line of a --progress-log (or train.py --sample-log)
    file, or None. Reads only its last 64 KiB."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 65536))
        lines = [line for line in f.read().split(b"\n")[:-1] if line]
    return json.loads(lines[-1]) if lines else None


def undisturbed_step_s(path: pathlib.Path) -> float | None:
    """The median gap (seconds) between consecutive steps of one process in
    a --progress-log file, each start's first STEADY_AFTER steps left out;
    None when no start stepped that far."""
    runs: dict[int, list[dict]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        runs.setdefault(entry["pid"], []).append(entry)
    gaps = [b["ts"] - a["ts"] for run in runs.values() for a, b in
            zip(run[STEADY_AFTER:], run[STEADY_AFTER + 1:]) if b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else None


def run_restart_all(args, spec: ChaosSpec, host_down_s: float) -> dict:
    """Run the restart-all arm for args.duration seconds under the faults of
    `spec` (killed hosts away `host_down_s` seconds). Returns {steps: the
    step count process 0 stood at when the time was up, faults_injected,
    starts, step_s: the undisturbed step in seconds (None if no start ran
    long enough), work: its directory (removed on return unless args.keep),
    events: what the supervisor did}."""
    with work_dir("elastic-vs-plain-", args.keep) as work:
        sup = RestartAll(args.hosts, work, args.checkpoint_every, host_down_s)
        faults = iter(schedule(spec, 100_000))
        t0 = time.monotonic()
        deadline = t0 + args.duration
        gap, kind, pick = next(faults)
        due = t0 + gap  # (each fault at its own time from the start, as elastic.chaos)
        injected = 0
        try:
            while time.monotonic() < deadline:
                sup.tick()
                if time.monotonic() >= due and sup.stepping():
                    sup.inject(kind, int(pick * args.hosts))
                    injected += 1
                    gap, kind, pick = next(faults)
                    due += gap
                time.sleep(0.05)
            last = last_progress(sup.progress_log)
        finally:
            if sup.running:
                sup.stop_all("the end")
        return {"steps": last["step"] + 1 if last else 0, "faults_injected": injected,
                "faults_scheduled": faults_scheduled(spec, args.duration),
                "starts": sum(what == "start" for _, what in sup.events),
                "step_s": undisturbed_step_s(sup.progress_log), "work": str(work),
                "events": [what for _, what in sup.events]}


def full_size_steps(samples: list[dict], hosts_of: dict[int, int], hosts: int) -> float:
    """The steps the job stands at, each weighted by the share of the
    `hosts` hosts its generation ran on: what they are worth on hardware
    where a slice's throughput scales with its hosts (on this machine's 2
    shared cores a smaller slice steps faster instead). `samples`: the
    job's --sample-log lines in order ({generation, step}); a step's last
    line is the computation that survived. `hosts_of`: generation -> its
    number of hosts."""
    if not samples:
        return 0.0
    generation_of = {s["step"]: s["generation"] for s in samples}
    return sum(hosts_of[generation_of[step]] / hosts
               for step in range(samples[-1]["step"] + 1) if step in generation_of)


def run_elastic(args, spec: ChaosSpec, spec_path: pathlib.Path) -> dict:
    """Run the elastic arm (bench/soak.py's setup) of the job at `spec_path`
    for args.duration seconds under the faults of `spec`. Returns {steps
    (as run_restart_all's), full_size_steps, faults_injected, starts
    (generations), report_ettr (elastic.goodput's, 0-1), seconds_at_hosts:
    slice size -> seconds, state: its state directory}."""
    job = load_spec(spec_path)
    state = spec_path.parent / "state"
    progress = spec_path.parent / "samples.jsonl"  # the job's --sample-log
    progress.touch()
    with surroundings(state, job.job_id, args.hosts, False, gcs_emulator=False) as around:
        local = start_slice(str(spec_path), job, args.hosts, 2, state,
                            checkpoint_dir=around.checkpoint_dir, extra_env=around.extra_env,
                            shared_cache=around.shared_cache,
                            shared_cache_key=around.shared_cache_key)
        chaos = Chaos(spec, local.address, local.tls, state, lambda h: restart_agent(local, h),
                      lambda h: local.agents[h].pid, job.health.heartbeat_timeout_s)
        t0 = time.time()
        chaos.start()
        try:
            time.sleep(args.duration)
            size = progress.stat().st_size  # what was logged by the end
        finally:
            chaos.stop()
            stop_slice(local)
    chaos.check()
    journal = list(read_journal(state))
    end = t0 + args.duration
    started = [e for e in journal if e["kind"] == "generation_started"]
    sizes: dict[int, float] = {}  # slice size -> seconds from its generations' starts
    for e, until in zip(started, [n["ts"] for n in started[1:]] + [end]):
        n = len(e["hosts"])
        sizes[n] = sizes.get(n, 0.0) + max(0.0, min(until, end) - e["ts"])
    logged = progress.read_bytes()[:size].rpartition(b"\n")[0]
    samples = [json.loads(line) for line in logged.splitlines()]
    hosts_of = {e["generation"]: len(e["hosts"]) for e in started}
    return {"steps": samples[-1]["step"] + 1 if samples else 0,
            "full_size_steps": round(full_size_steps(samples, hosts_of, args.hosts), 1),
            "faults_injected": chaos.injected,
            "faults_scheduled": faults_scheduled(spec, args.duration),
            "starts": len(started), "report_ettr": account(journal).ettr,
            "seconds_at_hosts": {n: round(s, 1) for n, s in sizes.items()},
            "state": str(state)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--mtbf", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--host-down-s", type=float, default=None,
                        help="seconds a killed host stays down (default: elastic's heartbeat "
                             "timeout + 2 s, a reboot; 600 for a repair)")
    parser.add_argument("--kinds", default="+".join(KINDS))
    parser.add_argument("--checkpoint-every", type=int, default=100,
                        help="persistent checkpoint interval of both arms, in steps")
    parser.add_argument("--arms", default="elastic+restart-all")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "vs_restart_all.json"))
    add_keep_flag(parser)
    args = parser.parse_args()
    kinds = tuple(args.kinds.split("+"))
    if not set(kinds) <= set(KINDS):
        parser.error(f"--kinds: only {'+'.join(KINDS)} (what both arms can meet)")
    arms = args.arms.split("+")
    if not arms or not set(arms) <= {"elastic", "restart-all"}:
        parser.error("--arms: elastic, restart-all or both joined by +")
    with work_dir("elastic-vs-elastic-", args.keep) as work:  # the elastic arm's
        # quarantine out of the way: faults picked at random are not a bad host
        spec_path = lm_job(work, "vs", args.hosts, args.checkpoint_every,
                           "[quarantine]\nfailures = 1000000",
                           ("--sample-log", str(work / "samples.jsonl")))
        heartbeat_timeout_s = load_spec(spec_path).health.heartbeat_timeout_s
        host_down_s = args.host_down_s if args.host_down_s is not None else heartbeat_timeout_s + 2
        spec = ChaosSpec(args.mtbf, args.seed, kinds, host_down_s=host_down_s)
        results = {}
        for arm in arms:
            results[arm] = run_elastic(args, spec, spec_path) if arm == "elastic" else \
                run_restart_all(args, spec, host_down_s)
            print(f"{arm}: {json.dumps({k: v for k, v in results[arm].items() if k != 'events'})}",
                  flush=True)
    print(f"\n{args.hosts} processes x 2 CPU devices, {args.duration:.0f} s an arm, a fault "
          f"every {args.mtbf:.0f} s on average (seed {args.seed}, {'+'.join(kinds)}), killed "
          f"hosts down {host_down_s:.0f} s; {machine()}")
    step_s = results.get("restart-all", {}).get("step_s")
    if step_s is None:
        print(f"no undisturbed step time: no restart-all run stepped {STEADY_AFTER + 2} steps "
              "in a row (run it with a longer --duration or --mtbf)")
    else:
        print(f"undisturbed step ({args.hosts} processes, restart-all arm): {step_s:.4f} s")
        for arm, r in results.items():
            r["ettr"] = r["steps"] * step_s / args.duration
            r["full_size_ettr"] = r.get("full_size_steps", r["steps"]) * step_s / args.duration
            extra = (f" ({100 * r['full_size_ettr']:.1f} % with each step weighted by its "
                     f"slice's share of the {args.hosts} hosts); elastic's report: ETTR "
                     f"{100 * r['report_ettr']:.1f} %, time at "
                     + ", ".join(f"{n} hosts {s:.0f} s" for n, s in
                                 sorted(r["seconds_at_hosts"].items(), reverse=True))
                     if arm == "elastic" else "")
            print(f"{arm:12}: {r['steps']} steps, ETTR {100 * r['ettr']:.1f} %, "
                  f"{r['faults_injected']} faults of {r['faults_scheduled']} scheduled, "
                  f"{r['starts']} starts{extra}")
        if len(results) == 2:
            plain = max(results["restart-all"]["ettr"], 1e-9)
            ratio = results["elastic"]["ettr"] / plain
            full_size = results["elastic"]["full_size_ettr"] / plain
            print(f"elastic / restart-all: x{ratio:.2f} (x{full_size:.2f} weighted by slice size)")
            results["ratio"], results["full_size_ratio"] = ratio, full_size
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "duration_s": args.duration, "mtbf_s": args.mtbf, "seed": args.seed,
                            "host_down_s": host_down_s, "kinds": list(kinds), **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
