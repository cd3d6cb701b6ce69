"""Self-fencing: an agent that has not heard its controller for a lease stops
its worker on its own, so a host cut off from the controller never trains
on beside the generation that replaced it.

The controller answers every heartbeat (HeartbeatAck) and declares a silent
host lost after `heartbeat_timeout_s`. The agent's lease is shorter by one
heartbeat interval (`lease_s`), so that the host has stopped its worker by
the time the controller gives up on it and starts a generation without it.
This is the lease of Gray and Cheriton ("Leases", SOSP 1989) as fencing uses
it: the holder stops acting before the grantor acts as if it had.

A lease counts the agent's own running time: when its checks were held up
(the agent was stopped with SIGSTOP, or starved), it first gives the
controller `grace_s` to be heard again instead of fencing on a stale clock.
Pure functions of monotonic seconds; the agent owns the clock.
"""

from __future__ import annotations

#: An agent whose checks were held up this much longer than their interval
#: was not running; its lease clock restarts with a grace.
HELD_UP_S = 1.0


def lease_s(heartbeat_interval_s: float, heartbeat_timeout_s: float) -> float:
    """The agent's lease (seconds): one heartbeat interval inside the
    controller's timeout, and at least one interval."""
    return max(heartbeat_interval_s, heartbeat_timeout_s - heartbeat_interval_s)


def check(heard_at: float, checked_at: float, now: float, lease: float,
          tick_s: float, grace_s: float) -> tuple[bool, float]:
    """One check, at `now`, of a lease last renewed at `heard_at` and last
    checked at `checked_at`, checked every `tick_s`. Returns (fence,
    heard_at): fence is True when the lease has run out; heard_at is moved
    forward to `now - lease + grace_s` when the checks were held up (the
    agent was not running, so silence means nothing yet)."""
    if now - checked_at > tick_s + HELD_UP_S:
        heard_at = max(heard_at, now - lease + grace_s)
    return now - heard_at > lease, heard_at
