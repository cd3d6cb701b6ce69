"""Which host keeps a replica of each host's local snapshots (its buddy).

Pure. A replica is of use only if it outlives the host it copies, so a
host's buddy is in another failure domain whenever the slice has one: hosts
of one TPU slice or rack fail together (GEMINI, Wang et al., SOSP 2023,
places checkpoint replicas the same way). Each host sends to the next host
in rank order, cyclically, that is in a different failure domain and can
receive (its agent serves a port); when every host of the slice shares one
domain, the next host that can receive (a lost host is still covered; a
lost domain is not). Hosts pick buddies in rank order, so with domains of
equal size every host also receives about one replica.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence


def buddies(hosts: Sequence[str], domains: Mapping[str, str],
            can_receive: Mapping[str, bool]) -> dict[str, str]:
    """host -> its buddy, for the hosts of one generation in rank order.

    domains: each host's failure domain; can_receive: whether its agent
    serves a port (replicas go there). Hosts without a possible buddy (a
    slice of one, no other host that can receive) are left out.
    O(hosts log hosts): 10,000 hosts in milliseconds (the plain scan of
    every host's successors took 0.6 s at 2,000 hosts, in the pass that
    starts a generation)."""
    receivers = [i for i, h in enumerate(hosts) if can_receive.get(h, False)]
    if not receivers:
        return {}
    m = len(receivers)
    domain = [domains.get(h) for h in hosts]
    # other[j]: the first receiver at or after receivers[j], in cyclic
    # order (an index into receivers twice over), whose domain differs from
    # receivers[j]'s; 2m when none does (every receiver in one domain)
    other = [2 * m] * (2 * m)
    for t in range(2 * m - 2, -1, -1):
        same = domain[receivers[(t + 1) % m]] == domain[receivers[t % m]]
        other[t] = other[t + 1] if same else t + 1
    out: dict[str, str] = {}
    for i, host in enumerate(hosts):
        t = bisect.bisect_right(receivers, i)  # the first receiver after i (m: wrap)
        first = receivers[t % m]
        if first == i:  # i is the only receiver
            continue
        if domain[first] != domain[i]:
            out[host] = hosts[first]
            continue
        elsewhere = other[t % m]
        out[host] = hosts[receivers[elsewhere % m]] if elsewhere < t % m + m else hosts[first]
    return out


#: Sets of hosts to leave out that `keep_replicas_within` tries at most.
MAX_TRIES = 10_000


def keep_replicas_within(pool: Sequence[str], size: int, gone: Sequence[str],
                         buddy_of: Mapping[str, str]) -> tuple[str, ...] | None:
    """`size` hosts of `pool` (in preference order, kept in it) such that
    every host of the last generation that the new one will not have —
    `gone` (lost, or otherwise unusable) and the pool's hosts left out —
    has its buddy (`buddy_of`, the last generation's) among them: then the
    new slice holds every host's last snapshot, its own or a replica, and
    a state sharded across hosts resumes from the newest snapshot step
    instead of the checkpoint. Pure.

    Returns the first such choice (leaving out the least preferred hosts
    that can be), the pool's first `size` hosts if they do already, or None
    when no choice does within MAX_TRIES (a host and its buddy both gone:
    the caller keeps its own plan)."""
    pool = list(pool)
    if size > len(pool):
        return None
    needed = {buddy_of[h] for h in gone if h in buddy_of}
    if not needed <= set(pool):
        return None
    for tries, out in enumerate(itertools.combinations(reversed(pool), len(pool) - size)):
        if tries >= MAX_TRIES:
            return None
        left = set(out)
        if not needed & left and all(buddy_of.get(h) in pool and buddy_of[h] not in left
                                     for h in left if h in buddy_of):
            return tuple(h for h in pool if h not in left)
    return None
