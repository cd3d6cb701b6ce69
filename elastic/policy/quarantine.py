"""Quarantine: a host that fails again and again is set aside for a while.

Pure functions over two maps kept in the SliceState:
failures (host -> times of failures attributed to it) and
quarantined (host -> (until, reason)).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

from elastic.config import JobSpec


def record_failures(failures: Mapping[str, tuple[float, ...]],
                    quarantined: Mapping[str, tuple[float, str]], hosts: Iterable[str],
                    now: float, spec: JobSpec, why: str, usable: Set[str]
                    ) -> tuple[dict, dict, list[tuple[str, str]]]:
    """Attribute a failure at `now` to `hosts`. Returns the new failures and
    quarantined maps and the (host, reason) pairs newly quarantined: those
    with `quarantine.failures` failures within `quarantine.window_s` — unless
    that would leave fewer than `job.min_hosts` of the `usable` hosts (those
    the controller knows and has not lost) outside quarantine (when every
    host fails, setting them all aside only stops the job; the restart
    budget and crash loop bound that case)."""
    q = spec.quarantine
    failures, quarantined, newly = dict(failures), dict(quarantined), []
    for host in hosts:
        times = tuple(t for t in failures.get(host, ()) if t > now - q.window_s) + (now,)
        failures[host] = times
        if len(times) >= q.failures and host not in quarantined and \
                len(usable - quarantined.keys() - {host}) >= spec.min_hosts:
            reason = (f"{len(times)} failures within {q.window_s:g} s "
                      f"(quarantine.failures = {q.failures}), last: {why}; "
                      f"set aside for {q.cooldown_s:g} s")
            quarantined[host] = (now + q.cooldown_s, reason)
            failures[host] = ()
            newly.append((host, reason))
    return failures, quarantined, newly


def release(quarantined: Mapping[str, tuple[float, str]], now: float
            ) -> tuple[dict, list[str]]:
    """Drop quarantines whose cooldown is over; returns (map, released hosts)."""
    done = [h for h, (until, _) in quarantined.items() if until <= now]
    return {h: v for h, v in quarantined.items() if h not in done}, done
