"""The wire protocol's version: an agent and a controller of releases that
would misread each other refuse each other at registration, saying so,
instead of misbehaving quietly.

Agents and the controller meet only through `proto/elastic/v1/control.proto`,
and a change to what a message means breaks a pair of releases without an
error: a controller that names no replica senders makes every newer agent
refuse every replica; an agent that does not know a field ignores it. So
each registration carries the agent's `PROTOCOL` and release, each answer
the controller's, and a mismatch is refused on both sides with the two
releases named (the controller answers FAILED_PRECONDITION and journals
`message_refused`; the agent logs the error and tries again later, so an
upgrade of the other side lets it in). Protocol 0 is a peer of a release
before this check. Upgrade agents and controllers together: a running slice
survives a controller restart on the new release only when its agents speak
the same protocol.

`tests/test_protocol.py` keeps `PROTOCOL_FINGERPRINT` equal to the compiled
proto's: a change to the proto fails it until someone decides whether the
change needs a new `PROTOCOL` (a field whose absence an older peer would
misread) or not (one it can safely ignore), and records the new fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata

from elastic.security.text import clean_text
from elastic.v1 import control_pb2 as pb

#: Characters of a peer's release string shown (it is the peer's text).
RELEASE_CHARS = 40

#: The version of the wire protocol's meaning (see the module docstring).
PROTOCOL = 1
#: `fingerprint()` of the proto that PROTOCOL was last looked at for (WorkerStatus
#: .failure_cause, 2026-11-29, left it at 1: a peer of the release before
#: neither sends it nor reads it; a failure without it is blamed as before,
#: but for a SIGABRT, which now waits up to 1 s for another cause).
PROTOCOL_FINGERPRINT = "f8f78525ddc8e6c6"


@functools.cache
def release() -> str:
    """This installation's release of `elastic` ("unknown" when it runs
    from a source tree that was never installed)."""
    try:
        return importlib.metadata.version("elastic")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def fingerprint() -> str:
    """The first 16 hex digits of the SHA-256 of the compiled
    control.proto (its messages, fields, numbers and types; not its
    comments)."""
    return hashlib.sha256(pb.DESCRIPTOR.serialized_pb).hexdigest()[:16]


def mismatch(theirs: int, their_release: str, them: str, us: str) -> str | None:
    """Why a peer (`them`: "agent" or "controller", of release
    `their_release`, shown cleaned and cut to RELEASE_CHARS) speaking wire
    protocol `theirs` cannot work with this process (`us`); None when it can."""
    if theirs == PROTOCOL:
        return None
    their_release = clean_text(their_release[:RELEASE_CHARS], RELEASE_CHARS)
    what = f"protocol {theirs}" if theirs else "no protocol version (a release before the check)"
    return (f"the {them} (release {their_release or 'unknown'}) speaks {what}; this {us} "
            f"(release {release()}) speaks protocol {PROTOCOL}: run agents and controller of "
            f"one release (upgrade them together)")
