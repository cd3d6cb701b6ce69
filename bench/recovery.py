"""Benchmark: recovery from every fault kind on the reference workload
(workers/lm, 4 local hosts x 2 CPU devices), by phase; and the blocking time
of checkpoint saves as a share of step time.

For each fault kind, `--trials` faults, each on another host, each once the
slice runs on all hosts again (hosts that leave come back, and the slice
grows back). From the journal (elastic.goodput): detection (the fault ->
`slice_stopping`) and recovery (the fault -> first step of the next
generation), median and p95; and for worker SIGKILL the startup phases
process 0 reports (`worker_phases`). A stopped agent whose worker trains on
costs no restart (health.carry_silent_hosts): its row times `agent_silent`
and `agent_heard` instead. A killed controller (`kill-controller`: started
again 2 s later, or with --standby replaced by the standby) costs no restart:
its row times the kill -> `slice_adopted` and counts the steps lost (the
slice's step at the kill minus the step it resumed from; 0 when adopted).

    .venv/bin/python bench/recovery.py --trials 10 --kinds kill-worker kill-host

With --isolate (root): isolated hosts (elastic.local.network), checkpoints in
a GCS emulator's bucket, and the network kinds may be asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import statistics
import sys
import time

import grpc

from common import add_keep_flag, lm_job, machine, summarize, work_dir, write_result

from elastic.chaos import Chaos
from elastic.config import load_spec
from elastic.controller.journal import read_journal
from elastic.controller.status import fetch_status, slice_step
from elastic.goodput import WORKER_PHASES, account
from elastic.local import (journal_dir, kill_controller, restart_agent, restart_controller,
                           start_slice, stop_slice, surroundings)

REPO = pathlib.Path(__file__).resolve().parent.parent
KINDS = ["kill-worker", "kill-host", "stop-worker", "stop-agent", "preempt", "kill-during-save"]
#: the reference job's checkpoint interval (steps)
INTERVAL = 100
#: stop -> first step, back to back (elastic.goodput.startup_phases)
PHASES = ("stop", "launch", *WORKER_PHASES, "report")


#: Seconds between the status calls that wait for the slice: each is a new
#: TLS connection and a goodput account of the whole journal, on the cores
#: the restart being measured runs on (it was 0.1 s).
POLL_S = 0.5


def wait_full(local, hosts: int, steps: int) -> None:
    """Until all hosts are members of a running generation that made `steps` steps."""
    deadline = time.monotonic() + 300
    start = None
    while time.monotonic() < deadline:
        try:
            st = fetch_status(_leader(local) if local.standby else local.address, local.tls)
        except grpc.RpcError:  # the controller is away (kill-controller)
            time.sleep(POLL_S)
            continue
        members = [h for h in st.hosts if h.state == "member"]
        if st.phase == "running" and len(members) == hosts and slice_step(st) >= 0:
            start = slice_step(st) if start is None else start
            if slice_step(st) >= start + steps:
                return
        else:
            start = None
        time.sleep(POLL_S)
    raise TimeoutError("the slice did not come back to all hosts")


def _leader(local) -> str:
    """The address of the controller that leads now (its address file)."""
    try:
        return (local.state_dir / "controller.addr").read_text().strip()
    except OSError:  # between a kill and the standby's start
        return local.address


def controller_kills(journal: list[dict]) -> dict | None:
    """Per kill-controller fault: seconds to `slice_adopted`, whether a
    generation started in between (a restart), and the steps lost."""
    adopted, restarts, lost = [], 0, []
    for i, e in enumerate(journal):
        if e["kind"] != "fault_injected" or e.get("fault") != "kill-controller":
            continue
        after = journal[i + 1:]
        adoption = next((x for x in after if x["kind"] == "slice_adopted"), None)
        started = next((x for x in after if x["kind"] == "generation_started"), None)
        if adoption is not None and (started is None or started["ts"] > adoption["ts"]):
            adopted.append(adoption["ts"] - e["ts"])
            lost.append(max(0, e["step"] - adoption["step"]))
        else:
            restarts += 1
    if not adopted and not restarts:
        return None
    return {"faults": len(adopted) + restarts, "restarts": restarts,
            "to_adopted": summarize(adopted) if adopted else None,
            "lost_steps_max": max(lost) if lost else None}


def regular_saves(journal: list[dict]) -> list[dict]:
    """The `checkpoint_saved` entries of the periodic saves (a step that is
    a multiple of INTERVAL, with a step time) that were not their
    generation's first (a new process's first save also compiles) nor an
    emergency save: what a save costs the loop in steady training. A grow's
    forced save, at any step, is left out unless it falls on the interval."""
    saves, first_done = [], False
    for e in journal:
        if e["kind"] == "generation_started":
            first_done = False
        elif e["kind"] == "checkpoint_saved":
            if first_done and e.get("step_time_s") and not e.get("preemption") and \
                    e["step"] % INTERVAL == 0:
                saves.append(e)
            first_done = True
    return saves


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--kinds", nargs="+", default=KINDS)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--steps-between", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=130,
                        help="steps before the first fault (checkpoint overhead is measured there)")
    parser.add_argument("--isolate", action="store_true",
                        help="isolated hosts (root), checkpoints on a GCS emulator")
    parser.add_argument("--gcs-emulator", action="store_true",
                        help="checkpoints on a GCS emulator (implied by --isolate)")
    parser.add_argument("--standby", action="store_true",
                        help="a standby controller beside the leader (kill-controller then "
                             "fails over to it instead of waiting for a restart)")
    parser.add_argument("--mesh", default="data=-1,model=2",
                        help="the job's mesh, axes in order: model=4,data=-1 puts 'model' "
                             "across hosts (each holds a quarter of every layer on 4 hosts)")
    parser.add_argument("--no-replicas", action="store_true",
                        help="restart.replicate_snapshots = false")
    parser.add_argument("--no-compile-ahead", action="store_true",
                        help="restart.compile_ahead = false (to measure what it saves)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "recovery.json"))
    add_keep_flag(parser)
    args = parser.parse_args()

    with work_dir("elastic-recovery-", args.keep) as work:
        spec_path = lm_job(work, "recovery", args.hosts, INTERVAL, mesh=args.mesh,
                           extra=f'grow = "immediately"\nreplicate_snapshots = '
                                 f'{str(not args.no_replicas).lower()}\n'
                                 f'compile_ahead = {str(not args.no_compile_ahead).lower()}\n'
                                 f'[quarantine]\nfailures = 10000')
        spec = load_spec(spec_path)
        state = work / "state"
        with contextlib.ExitStack() as stack:  # (the surroundings close last)
            around = stack.enter_context(surroundings(state, spec.job_id, args.hosts, args.isolate,
                                                      gcs_emulator=args.gcs_emulator))
            local = start_slice(str(spec_path), spec, args.hosts, 2, state,
                                checkpoint_dir=around.checkpoint_dir, extra_env=around.extra_env,
                                net=around.net, standby=args.standby,
                                shared_cache=around.shared_cache,
                                shared_cache_key=around.shared_cache_key)
            chaos = Chaos(None, local.addresses, local.tls, state,
                          lambda h: restart_agent(local, h), lambda h: local.agents[h].pid,
                          spec.health.heartbeat_timeout_s,
                          keep_running=True, network=around.net,
                          controller=(lambda: kill_controller(local),
                                      lambda: restart_controller(local)))
            chaos.start()  # runs the come-back actions (restarts, SIGCONT) of injected faults
            trial_of: dict[float, str] = {}
            try:
                wait_full(local, args.hosts, args.warmup_steps)
                for kind in args.kinds:
                    for trial in range(args.trials):
                        wait_full(local, args.hosts, args.steps_between)
                        status = chaos._status()
                        host = next(h for h in status.hosts
                                    if h.host_id == f"host-{1 + trial % (args.hosts - 1)}")
                        t0 = time.time()
                        chaos.inject(kind, host, status)
                        trial_of[t0] = kind
                        print(f"{kind} {trial + 1}/{args.trials} on {host.host_id}", flush=True)
                wait_full(local, args.hosts, args.steps_between)
            finally:
                chaos.stop()
                stop_slice(local)

        journal = list(read_journal(journal_dir(state)))  # (a standby's own, when it holds all)
    kills = controller_kills(journal)
    incidents = [i for i in account(journal).incidents if i.kind in args.kinds
                 and i.kind != "kill-controller"]
    phases = {}
    for incident in incidents:
        if incident.startup and incident.restarted:
            for name in PHASES:
                phases.setdefault(incident.kind, {}).setdefault(name, []).append(
                    incident.startup.get(name, 0.0))
    results = {}
    for kind in (k for k in args.kinds if k != "kill-controller"):
        every = [i for i in incidents if i.kind == kind]
        mine = [i for i in every if i.noticed]  # (a throttled link may go unnoticed)
        recovered = [i.recovered_after_s for i in mine if i.recovered_after_s is not None]
        results[kind] = {
            "faults": len(every),
            "unnoticed": len(every) - len(mine),
            # a stopped agent whose worker trains on is ridden out: then
            # "to_first_step" is the time until its heartbeats resumed
            "restarts": sum(i.restarted for i in mine),
            "detection": summarize([i.detected_after_s for i in mine]) if mine else None,
            "to_first_step": summarize(recovered) if recovered else None,
            "worker_phases": {k: summarize(v) for k, v in phases.get(kind, {}).items()},
            "lost_steps_median": statistics.median(i.lost_steps for i in mine) if mine else None,
        }
    if kills is not None:
        results["kill-controller"] = kills
    saves = regular_saves(journal)
    blocking = [e["blocking_s"] for e in saves]
    step_time = statistics.median(e["step_time_s"] for e in saves) if saves else None
    share = statistics.median(blocking) / (INTERVAL * step_time) if blocking else None
    print(f"\n{'fault':18} {'n':>3} {'detect p50':>10} {'p95':>7} {'first step p50':>14} "
          f"{'p95':>7}  stop -> first step p50: " + ", ".join(PHASES))
    for kind, r in results.items():
        if not r["faults"]:
            continue
        if kind == "kill-controller":
            a = r["to_adopted"]
            print(f"{kind:18} {r['faults']:>3}  adopted after {a['median_s']:.2f} s p50, "
                  f"{a['p95_s']:.2f} s p95; {r['restarts']} restart(s); at most "
                  f"{r['lost_steps_max']} step(s) lost" if a else
                  f"{kind:18} {r['faults']:>3}  never adopted: {r['restarts']} restart(s)")
            continue
        if r["detection"] is None or r["to_first_step"] is None:
            print(f"{kind:18} {r['faults']:>3}  {r['unnoticed']} unnoticed (nothing timed out, "
                  f"no restart), {r['restarts']} restart(s)")
            continue
        d, f, ph = r["detection"], r["to_first_step"], r["worker_phases"]
        ridden = r["faults"] - r["unnoticed"] - r["restarts"]
        phase_text = ", ".join(f"{ph[k]['median_s']:.2f}" for k in PHASES if k in ph)
        print(f"{kind:18} {r['faults']:>3} {d['median_s']:9.2f}s {d['p95_s']:6.2f}s "
              f"{f['median_s']:13.2f}s {f['p95_s']:6.2f}s  {phase_text}"
              f"  (steps lost p50 {r['lost_steps_median']:g})"
              + (f"  ({ridden} ridden out without a restart: detection "
                 f"is agent_silent, first step is agent_heard)" if ridden else "")
              + (f"  ({r['unnoticed']} unnoticed)" if r["unnoticed"] else ""))
    restores = [e for e in journal if e["kind"] == "checkpoint_restored"]
    from_snapshots = [e for e in restores if e.get("source") == "snapshot"]
    with_replicas = [e for e in from_snapshots if e.get("replicas_of")]
    print(f"\nmesh {args.mesh}, replicas {'off' if args.no_replicas else 'on'}: "
          f"{len(restores)} restores, {len(from_snapshots)} from local snapshots "
          f"({len(with_replicas)} using replicas), {len(restores) - len(from_snapshots)} "
          f"from checkpoints")
    if share is None:  # every save but the first was a grow's or a preemption's
        print("\ncheckpoint saves: no regular save after the first to time")
    else:
        print(f"\ncheckpoint saves: median blocking {statistics.median(blocking):.3f} s per save "
              f"every {INTERVAL} steps of {step_time:.3f} s -> {100 * share:.2f} % of step time")
    write_result(args.out, {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
                            "hosts": args.hosts, "trials": args.trials, "faults": results,
                            "mesh": args.mesh, "replicas": not args.no_replicas,
                            "restores": {"all": len(restores),
                                         "from_snapshots": len(from_snapshots),
                                         "using_replicas": len(with_replicas)},
                            "isolated": args.isolate, "standby": args.standby,
                            "gcs_emulator": args.isolate or args.gcs_emulator,
                            "checkpoint": {"median_blocking_s":
                                           statistics.median(blocking) if blocking else None,
                                           "median_step_time_s": step_time,
                                           "interval_steps": INTERVAL, "blocking_share": share}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
