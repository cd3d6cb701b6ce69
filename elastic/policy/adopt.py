"""Adoption: a controller that starts while a generation is running (its
predecessor was killed, crashed, or lost its leadership) takes that slice
over instead of restarting it.

The journal says what was running (`Inherited`: the generation, its hosts in
rank order, their agents' incarnations, the coordinator); the agents, as
they register again, say what runs now (their incarnation, their worker's
generation, rank, state and step). When every member agrees with the
journal, the slice is adopted as it stands: no new generation, no restore,
no step lost. When one disagrees (its agent restarted, its worker of another
generation, ended, or of another rank) or a member does not come back within
the adoption window, the slice is restarted, saying why. A pure function of
the view and a clock, as `elastic.policy.decide` is.

When the journal says nothing runs but agents report workers of a newer
generation (a leader that died between journaling a start and mirroring its
journal to the bucket, elastic.controller.bucket_lease; or a state dir that
was lost), `discover` rebuilds the generation from the reports alone: one
worker per rank 0..n-1 of the same generation and process count.

The same idea as Kubernetes controllers that rebuild their state from the
cluster's objects after a restart instead of from memory, and as the
adoption of a running slice by a restarted Borgmaster (Verma et al.,
"Large-scale cluster management at Google with Borg", EuroSys 2015: the
elected master "reads state from the Paxos store and polls the Borglets").
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from elastic.policy.view import ClusterView, WorkerState

#: Agents reconnect with jittered exponential backoff of at most this many
#: seconds between attempts (elastic.agent.session).
AGENT_RECONNECT_MAX_S = 2.0


@dataclasses.dataclass(frozen=True)
class Inherited:
    """The generation the journal says was running when its controller
    stopped writing: `hosts` in rank order, the agent `incarnations` they
    had (empty in journals written before they were recorded),
    `coordinator` "host:port", what each member puts in the mesh, whether
    it had made a step (`progressed`) and the restarts before it."""

    generation: int
    hosts: tuple[str, ...]
    incarnations: tuple[str, ...] = ()
    coordinator: str = ""
    devices_per_host: int = 0
    device_kind: str = ""
    progressed: bool = False
    restarts: int = 0

    def describe(self) -> dict:
        """The fields `controller_started` journals about it."""
        return {"generation": self.generation, "hosts": list(self.hosts),
                "progressed": self.progressed}


def window_s(heartbeat_timeout_s: float) -> float:
    """How long (seconds) a controller waits for the members of an
    inherited generation to register before it restarts the slice
    without the missing ones: a heartbeat timeout, and at least two of
    the agents' longest reconnect waits."""
    return max(heartbeat_timeout_s, 2 * AGENT_RECONNECT_MAX_S)


class Verdict(NamedTuple):
    """What `judge` decided: `what` ("adopt", "failure" or "restart"), `why`
    (a sentence), and for a failure the host it is blamed on."""

    what: str
    why: str
    blamed: tuple[str, ...] = ()


def crashed(inherited: Inherited, view: ClusterView) -> list[str]:
    """The members whose worker of the inherited generation failed by itself
    (a nonzero code, a signal; not stopped by its agent: a stop it was told,
    or the agent's self-fencing once no controller was heard for its lease)
    while no controller ran, the likeliest root cause first: a worker that
    exited with a code of its own, then one killed by another signal, then
    an echo of another's failure (WorkerObs.failed_by_peer: a collective
    failed under it, or it was aborted, SIGABRT, which is what JAX's
    coordination service does to the peers of a dead process); in rank
    order within each."""
    g = inherited.generation
    found = [(rank, r.worker) for rank, h in enumerate(inherited.hosts)
             if (r := view.get(h)) is not None and r.worker.generation == g
             and r.worker.state is WorkerState.EXITED and not r.worker.succeeded
             and not r.worker.stopped_on_request]
    found.sort(key=lambda item: (2 if item[1].failed_by_peer else 1 if item[1].signal else 0,
                                 item[0]))
    return [inherited.hosts[rank] for rank, _ in found]


def judge(inherited: Inherited, view: ClusterView, waited_s: float,
          window: float) -> Verdict | None:
    """"adopt" when every member reports the inherited generation as the
    journal has it; "failure" when a member's worker of it failed by itself
    while no controller ran (`crashed`: a failure like any other, counted
    towards the restart budget, the crash loop and quarantine), once every
    member is back or `window` passed — blamed, as a live controller would,
    on a member still missing (its host went away) or else on the likeliest
    crash; "restart" when a member disagrees otherwise, or when `waited_s`
    (seconds since the controller started) reached `window` with members
    still missing; None while it waits for them."""
    g = inherited.generation
    failed = crashed(inherited, view)
    if failed:
        absent = [h for h in inherited.hosts if view.get(h) is None]
        if absent and waited_s < window:
            return None  # (the one missing may be the cause)
        culprit = (absent or failed)[0]
        how = (f"did not register within {window:g} s" if absent else
               f"exited with {view.hosts[culprit].worker.describe_exit()}")
        return Verdict("failure", f"the worker on host {culprit} {how} while no controller "
                                  f"ran", (culprit,))
    missing = []
    for rank, host in enumerate(inherited.hosts):
        record = view.get(host)
        if record is None:
            missing.append(host)
            continue
        if inherited.incarnations and record.incarnation != inherited.incarnations[rank]:
            return Verdict("restart", f"the agent of host {host} restarted while no controller "
                                      f"ran (incarnation {inherited.incarnations[rank]} -> "
                                      f"{record.incarnation})")
        w = record.worker
        if w.generation != g:
            runs = f"a worker of generation {w.generation}" if w.generation else "no worker"
            return Verdict("restart", f"host {host} reports {runs}, not of generation {g}")
        if w.state is WorkerState.EXITED and not w.succeeded:  # (stopped by its agent)
            return Verdict("restart", f"the worker on host {host} was stopped by its agent "
                                      f"({w.describe_exit()})")
        if w.state is WorkerState.IDLE:
            return Verdict("restart", f"host {host} reports no worker of generation {g}")
        if w.num_processes and (w.process_id, w.num_processes) != (rank, len(inherited.hosts)):
            return Verdict("restart", f"host {host} runs rank {w.process_id} of "
                                      f"{w.num_processes}; the journal has rank {rank} of "
                                      f"{len(inherited.hosts)}")
        if inherited.devices_per_host and record.devices < inherited.devices_per_host:
            return Verdict("restart", f"host {host} now has {record.devices} device(s); "
                                      f"generation {g} uses {inherited.devices_per_host} per host")
    if not missing:
        return Verdict("adopt", f"all {len(inherited.hosts)} hosts of generation {g} report "
                                f"its workers as the journal has them")
    if waited_s >= window:
        return Verdict("restart", f"host(s) {', '.join(missing)} of generation {g} did not "
                                  f"register within {window:g} s")
    return None


def discover(view: ClusterView, after_generation: int, waited_s: float,
             window: float, enough_hosts: int) -> Inherited | str | None:
    """A running generation newer than `after_generation` (the journal's
    last) rebuilt from the agents' reports: the hosts of its workers in rank
    order, when every rank of its process count reports one (coordinator
    unknown; devices per host: the fewest any of them has). "" when there
    is none to wait for: `window` seconds passed without a complete set, or
    no host runs such a worker and either the journal never started a
    generation (a new job: hosts register as they come) or `enough_hosts`
    (the job's max_hosts) have registered, every one of them a host that ran
    the journal's last generation (idle spares that never did prove nothing:
    the slice the journal lacks may still be reconnecting, and starting
    without it would reuse its generation number). Otherwise, with hosts
    idle, the others may be the slice, still reconnecting: None, wait. Pure."""
    running = [r for r in view.hosts.values()
               if r.worker.running and r.worker.generation > after_generation]
    if not running:
        if waited_s >= window or (len(view.hosts) >= enough_hosts and all(
                r.worker.generation >= after_generation for r in view.hosts.values())):
            return ""
        return "" if after_generation == 0 and view.hosts else None
    g = max(r.worker.generation for r in running)
    group = [r for r in running if r.worker.generation == g]
    n = group[0].worker.num_processes
    by_rank = {r.worker.process_id: r for r in group}
    if n and len(group) == n and sorted(by_rank) == list(range(n)) and \
            all(r.worker.num_processes == n for r in group):
        ranked = [by_rank[i] for i in range(n)]
        return Inherited(generation=g, hosts=tuple(r.host_id for r in ranked),
                         incarnations=tuple(r.incarnation for r in ranked),
                         devices_per_host=min(r.devices for r in ranked),
                         device_kind=ranked[0].device_kind,
                         progressed=any(r.worker.step >= 0 for r in ranked))
    return "" if waited_s >= window else None
