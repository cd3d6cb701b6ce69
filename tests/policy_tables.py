"""Builders shared by the table tests of the pure decisions (fake clock: T0
and offsets from it, in controller-monotonic seconds)."""

from __future__ import annotations

import dataclasses

from elastic.config import HealthSpec, JobSpec, RestartSpec
from elastic.policy import decide as d
from elastic.policy.decide import Phase, SliceState, decide
from elastic.policy.view import (ClusterView, HeartbeatReceived, Registered, WorkerExited,
                                 WorkerObs, WorkerState, observe)

T0 = 1000.0


def spec(**kw) -> JobSpec:
    health = HealthSpec(heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0, stop_grace_s=2.0,
                        stop_timeout_s=10.0, rendezvous_settle_s=1.0)
    restart = RestartSpec(**kw.pop("restart", {}))
    return JobSpec(command=("w",), min_hosts=kw.pop("min_hosts", 1),
                   max_hosts=kw.pop("max_hosts", 4), health=health, restart=restart, **kw)


def register(view: ClusterView, host: str, now: float = T0, domain: str | None = None,
             devices: int = 2, incarnation: str | None = None, kind: str = "cpu",
             stream: bool = True) -> list:
    """Register `host` (its journal facts returned) and, with `stream`, its
    stream's first message (a heartbeat at the same instant, of the worker
    the record holds), as an agent does."""
    inc = incarnation or f"inc-{host}"
    facts = observe(view, Registered(host, inc, devices, "10.0.0.1", domain or host, 100,
                                     5000 + int(host[-1]), WorkerObs(), kind), now)[1]
    if stream:
        observe(view, HeartbeatReceived(host, inc, view.hosts[host].worker, 0), now)
    return facts


def worker(view: ClusterView, host: str, now: float, generation: int, state: WorkerState,
           step: int = -1, exit_code: int = 0, sig: int = 0) -> None:
    inc = view.hosts[host].incarnation
    obs = WorkerObs(generation=generation, state=state, pid=42, exit_code=exit_code, signal=sig,
                    step=step)
    event = (WorkerExited(host, inc, obs) if state is WorkerState.EXITED
             else HeartbeatReceived(host, inc, obs, 0))
    observe(view, event, now)


def heartbeat_all(view: ClusterView, now: float) -> None:
    for record in list(view.hosts.values()):
        observe(view, HeartbeatReceived(record.host_id, record.incarnation, record.worker, 0), now)


def kinds(decision: d.Decision) -> list[str]:
    return [a.kind for a in decision.actions if isinstance(a, d.Journal)]


def running_slice(view: ClusterView, hosts: list[str], now: float = T0,
                  generation: int = 1, progressed: bool = True, **kw) -> SliceState:
    for h in hosts:
        worker(view, h, now, generation, WorkerState.RUNNING, step=5 if progressed else -1)
    kw.setdefault("devices_per_host", min(view.hosts[h].devices for h in hosts))
    kw.setdefault("device_kind", view.hosts[hosts[0]].device_kind)
    return SliceState(phase=Phase.RUNNING if progressed else Phase.STARTING,
                      generation=generation, phase_since=now, members=tuple(hosts),
                      incarnations=tuple(view.hosts[h].incarnation for h in hosts),
                      progressed=progressed, **kw)


def three_hosts_leased(lease_s: float = 30.0) -> tuple[JobSpec, ClusterView, SliceState]:
    """A spec whose agents keep their workers `lease_s` without a controller
    (health.controller_lease_s), and generation 1 running on h0, h1, h2
    (process 0 on h0): (spec, view, state)."""
    s = spec()
    s = dataclasses.replace(s, health=dataclasses.replace(s.health, controller_lease_s=lease_s))
    view = ClusterView()
    for h in ("h0", "h1", "h2"):
        register(view, h)
    return s, view, running_slice(view, ["h0", "h1", "h2"])


def stop_and_settle(state, view, now, s):
    """From a failure to the decision after all stop acknowledgements."""
    decision = decide(state, view, now, s)
    assert decision.state.phase is Phase.STOPPING
    for h in decision.state.members:
        if view.hosts[h].worker.running and h not in decision.state.lost:
            worker(view, h, now + 0.1, decision.state.generation, WorkerState.EXITED, sig=9)
    return decide(decision.state, view, now + 0.2, s)


def restart_cycles(steps, s, period_s: float = 200.0, kinds_of_stop=None):
    """One host; each generation starts, makes its first step 100 s later
    (restore, compile) and reaches `steps[i]` (None: no step at all), then
    its worker exits with code 1 5 s later, or, where `kinds_of_stop[i]`
    is "preemption", its host gets a notice and the drain ends it (the
    emergency save fails); generations start `period_s` apart. Returns the
    last state and every decision with its time (for a journal)."""
    view = ClusterView()
    register(view, "h0")
    state, decisions, t = SliceState(phase_since=T0), [], T0 + 2
    for i, step in enumerate(steps):
        heartbeat_all(view, t)
        view.hosts["h0"].free_port = 6000 + i
        started = decide(state, view, t, s)
        decisions.append((started, t))
        state = started.state
        assert state.phase is Phase.STARTING, state.reason
        worker(view, "h0", t + 100, state.generation, WorkerState.RUNNING,
               step=-1 if step is None else step)
        running = decide(state, view, t + 100, s)
        decisions.append((running, t + 100))
        state = running.state
        end = t + 105  # (the stop: within the hang timeout of the first step)
        if (kinds_of_stop or {}).get(i) == "preemption":
            observe(view, HeartbeatReceived("h0", "inc-h0", view.hosts["h0"].worker, 0,
                                            "SIGTERM to the agent"), end)
            view.emergency_failed_at = end
        else:
            worker(view, "h0", end, state.generation, WorkerState.EXITED, exit_code=1,
                   step=-1 if step is None else step)
        stopping = decide(state, view, end, s)
        decisions.append((stopping, end))
        assert stopping.state.stop_kind == (kinds_of_stop or {}).get(i, "failure")
        if view.hosts["h0"].worker.running:
            worker(view, "h0", end + 0.1, state.generation, WorkerState.EXITED, sig=9,
                   step=-1 if step is None else step)
        stopped = decide(stopping.state, view, end + 0.2, s)
        decisions.append((stopped, end + 0.2))
        state = stopped.state
        view.hosts["h0"].preemption = ""  # (a notice that came to nothing: the host stays)
        if state.phase is Phase.FAILED:
            break
        t += period_s
    return state, decisions
