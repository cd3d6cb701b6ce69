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
