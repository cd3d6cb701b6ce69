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

import itertools
from collections.abc import Mapping, Sequence


def buddies(hosts: Sequence[str], domains: Mapping[str, str],
            can_receive: Mapping[str, bool]) -> dict[str, str]:
    """host -> its buddy, for the hosts of one generation in rank order.

    domains: each host's failure domain; can_receive: whether its agent
    serves a port (replicas go there). Hosts without a possible buddy (a
    slice of one, no other host that can receive) are left out."""
    out: dict[str, str] = {}
    n = len(hosts)
    for i, host in enumerate(hosts):
        after = [hosts[(i + k) % n] for k in range(1, n)]
        receivers = [h for h in after if can_receive.get(h, False)]
        elsewhere = [h for h in receivers if domains.get(h) != domains.get(host)]
        chosen = (elsewhere or receivers or [None])[0]
        if chosen is not None:
            out[host] = chosen
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
