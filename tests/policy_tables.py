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
