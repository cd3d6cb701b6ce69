"""Preemption notices from the GCE metadata server.

A spot/preemptible VM learns it is being reclaimed from
`instance/preempted` ("TRUE"), and a VM about to be live-migrated or
terminated for host maintenance from `instance/maintenance-event`
(anything but "NONE"), both under
http://metadata.google.internal/computeMetadata/v1/ with the header
`Metadata-Flavor: Google` (GCE docs: "Detect if a VM was preempted",
"Get maintenance notifications"). The base URL is configurable so tests can
run a fake server on loopback.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request
from collections.abc import Callable

log = logging.getLogger("elastic-agent")

GCE_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance"


def notice(preempted: str | None, maintenance: str | None) -> str | None:
    """Why this VM is going away, from the two metadata values (None when a
    value could not be read), or None if it is not."""
    if preempted is not None and preempted.strip().upper() == "TRUE":
        return "GCE preemption notice (instance/preempted = TRUE)"
    if maintenance is not None and maintenance.strip().upper() not in ("", "NONE"):
        return f"GCE maintenance event ({maintenance.strip()})"
    return None


def _get(url: str, timeout_s: float) -> str | None:
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None


async def watch_metadata(base_url: str, on_notice: Callable[[str], None],
                         interval_s: float = 1.0, timeout_s: float = 2.0) -> None:
    """Poll `base_url`/preempted and /maintenance-event every `interval_s`
    seconds; call `on_notice(reason)` once, then return. Runs until cancelled.
    An unreachable server is logged once and polled again."""
    base = base_url.rstrip("/")
    warned = False
    while True:
        preempted, maintenance = await asyncio.gather(
            asyncio.to_thread(_get, f"{base}/preempted", timeout_s),
            asyncio.to_thread(_get, f"{base}/maintenance-event", timeout_s))
        if preempted is None and maintenance is None and not warned:
            log.warning("metadata server %s unreachable; still polling", base)
            warned = True
        reason = notice(preempted, maintenance)
        if reason:
            on_notice(reason)
            return
        await asyncio.sleep(interval_s)
