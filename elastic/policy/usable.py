"""Which hosts a new generation may use, and which it waits for.

Pure functions over a host's record in the ClusterView and the SliceState,
shared by the controller's decisions (elastic.policy.decide) and quarantine's
early release (elastic.policy.quarantine).
"""

from __future__ import annotations

from elastic.policy import silence
from elastic.policy.mesh import Candidate
from elastic.policy.state import SliceState
from elastic.policy.view import ClusterView, HostRecord


def usable(record: HostRecord, state: SliceState, view: ClusterView) -> bool:
    """A host a new generation may use: heartbeating, idle, not set aside,
    not being taken away, and reachable: its agent's stream is open (a
    message came on it since it registered, and it has not closed). A start
    for a host that only registered waits in its outbox until gRPC takes
    up its stream, which with thousands of agents connecting at once is
    seconds later (bench/scale.py: 5.6 s of start fan-out at 2,000 agents)."""
    return (record.streamed and record.host_id not in state.lost
            and not record.worker.running and record.host_id not in state.quarantined
            and not record.preemption and record.host_id not in view.disconnected)


def opening_count(state: SliceState, view: ClusterView, now: float) -> int:
    """Hosts that registered and whose stream has not sent its first message
    yet, for at most silence.STREAM_OPEN_S (+ the controller's lag): then
    their silence counts and they are lost. A slice below max_hosts waits for
    them, but not for a host that keeps registering again without ever
    sending on a stream: that wait counts from its first such registration.
    O(hosts)."""
    limit = silence.STREAM_OPEN_S + view.lag_s
    return sum(silence.opening(r, now, view.lag_s) and r.host_id not in state.lost
               and now - r.unstreamed_since <= limit for r in view.hosts.values())


def opening_text(opening: int) -> str:
    """"N registered hosts have not opened a stream yet" (N = `opening`)."""
    which = "1 registered host has" if opening == 1 else f"{opening} registered hosts have"
    return f"{which} not opened a stream yet"


def candidate(record: HostRecord) -> Candidate:
    """The planner's view of a host (elastic.policy.mesh.Candidate)."""
    return Candidate(record.host_id, record.failure_domain, record.devices, record.device_kind)
