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
import http.client
import logging
import urllib.error
import urllib.request
from collections.abc import Callable

log = logging.getLogger("elastic-agent")

GCE_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance"


def notice(preempted: str | None, maintenance: str | None) -> str | None:
    """Why this VM is going away, from the two metadata values (None when a
    value could not be read), or None if it is not. A maintenance event
    that is a live migration (`MIGRATE_ON_HOST_MAINTENANCE`) is not: the VM
    pauses briefly and stays (a worker that misses heartbeats meanwhile is
    the hang and silence detectors' business); any other value but NONE
    (`TERMINATE_ON_HOST_MAINTENANCE`, one not known yet) is."""
    if preempted is not None and preempted.strip().upper() == "TRUE":
        return "GCE preemption notice (instance/preempted = TRUE)"
    event = (maintenance or "").strip().upper()
    if event not in ("", "NONE") and not event.startswith("MIGRATE"):
        return f"GCE maintenance event ({maintenance.strip()})"
    return None


def on_sigterm(preemption: str, leaving: bool) -> str:
    """What a SIGTERM to the agent means, given the preemption it already
    knows of (`preemption`, "" if none) and whether it is leaving once its
    worker stopped (`leaving`: that preemption was a SIGTERM too):
    "preempt" (the first word of it: save, then leave), "leave" (a metadata
    notice came first, and this is the shutdown it announced — systemd
    stopping the VM's services — so the worker goes on saving and the
    agent leaves after it), or "hard" (a second SIGTERM: stop now)."""
    if not preemption:
        return "preempt"
    return "hard" if leaving else "leave"


def _get(url: str, timeout_s: float) -> str | None:
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        # (a truncated body, a bad status line: the next poll asks again;
        # raised, it ended the watcher for good)
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
