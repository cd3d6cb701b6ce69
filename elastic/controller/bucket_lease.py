"""Leadership through the checkpoint bucket, for controllers that share only
the bucket (a standby on another host, no shared file system).

The lease is the job's journal itself, one object in the bucket beside the
checkpoint directory (never in it: Orbax removes what it finds there that is
not a committed step): `gs://bucket/a/b` keeps it in
`gs://bucket/a/b.elastic-controller/events.jsonl`. The leader uploads its
journal every `lease_s / 4`, and at once after an entry a standby needs
(PROMPT_KINDS: the leader's start and term, a generation started, stopping,
ended), with `ifGenerationMatch` = the generation it wrote last: each upload
renews the lease and mirrors the journal. A standby polls the object's
generation; when it has not changed for `lease_s` by the standby's own
monotonic clock (so no clock skew between hosts matters), it downloads the
journal at that generation into its state directory and claims the object by
uploading it back with `ifGenerationMatch` = that generation: of two
standbys only one succeeds. A leader whose upload fails its precondition has
been deposed and stops at once; a failed upload (a 429, a 503, a timeout) is
tried again with jittered backoff (tenacity), and one that could not upload
for `lease_s / 2`, counted from when its last successful upload was sent (a
partition from the bucket), stops too, before any standby can have taken
over. The object names its holder in its metadata: the random id of the
holder's state directory (`controller-id`, made once) and of the controller
process. A controller restarted on the holder's own state directory (which
it locks, elastic.controller.leadership) takes the lease back at once
instead of waiting it out, keeping the lines it journaled after its last
upload; an upload whose answer was lost and whose retry then finds the
object written by the same process goes on from that generation. An object
deleted under a leader (a lifecycle rule, a cleanup of the prefix) is
uploaded again at its next renewal; a standby claims a missing object only
once it has been missing for `lease_s`, as it would a silent one.

This is the lease-with-fencing-token pattern (Kleppmann, "How to do
distributed locking", 2016) with the object generation as the token, as
GCS documents for `ifGenerationMatch` ("Request preconditions").
"""

from __future__ import annotations

import logging
import os
import pathlib
import secrets
import socket
import time
from collections.abc import Callable

import tenacity

from elastic.checkpoint import gcs
from elastic.checkpoint.storage import StorageError
from elastic.controller.journal import JOURNAL_NAME, entry_job, parse_line
from elastic.security.files import open_private, write_private

log = logging.getLogger("elasticd")

SUFFIX = ".elastic-controller/" + JOURNAL_NAME
#: The file in a controller's state directory that names it as a lease holder.
ID_NAME = "controller-id"
#: Entries uploaded at once, not at the next renewal: what a standby needs
#: to adopt the slice (the generation running, whether it is stopping), and
#: the leader's term (`controller_started`), which its agents learn as they
#: register: a standby taking over must lead with a higher one, and its own
#: clock, which floors its term, may be behind this leader's.
PROMPT_KINDS = frozenset({"controller_started", "generation_started", "first_progress",
                          "slice_adopted", "slice_stopping", "slice_stopped", "job_succeeded",
                          "job_failed"})


def holder_id(state_dir: pathlib.Path) -> str:
    """The lease holder name of controllers on `state_dir`: this host's
    name and a random id made once in `state_dir/controller-id` (two hosts
    may share a name and a path; they do not share the id). Raises OSError
    when it cannot be read or made."""
    path = state_dir / ID_NAME
    if not path.exists():
        # written whole beside it, then linked in: of two controllers
        # starting at once, one id wins and neither reads a half-written one
        tmp = state_dir / f".{ID_NAME}.{os.getpid()}"
        write_private(tmp, secrets.token_hex(8).encode())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return f"{socket.gethostname()}/{path.read_text().strip()}"


def merge_tools_lines(journal: bytes, local: bytes, job_id: str = "") -> bytes:
    """`journal` (the bucket's) with the local copy's lines that it lacks
    and that are not this job's (`job_id`): the lines tools wrote there
    (`fault_*` entries of elasticd local's fault injector: they go to the
    state dir's journal, not to the leader) and, with `job_id`, the
    stretches of other jobs that ran in the state dir meanwhile (each job's
    bucket object holds only its own: their generations and checkpoint
    directories count for it too, elastic.controller.journal.recorded), in
    time order. This job's other local lines are a deposed controller's and
    are dropped."""
    have = set(journal.splitlines())
    extra, other_job = [], False
    for line in local.splitlines():
        entry = parse_line(line)
        if entry is None:
            continue
        named = entry_job(entry) if job_id else None
        if named is not None:
            other_job = named != job_id
        if line not in have and (other_job or entry["kind"].startswith("fault_")):
            extra.append(line)
    if not extra:
        return journal
    lines = [line for line in journal.splitlines() if line.strip()] + extra
    keyed = [(entry["ts"] if (entry := parse_line(line)) else 0.0, i, line)
             for i, line in enumerate(lines)]
    return b"".join(line + b"\n" for _, _, line in sorted(keyed))


def ran_here(journal: bytes, job_id: str) -> bool:
    """Whether a controller of job `job_id` started on the state directory
    whose journal is `journal` (a `controller_started` naming that job)."""
    return any((entry := parse_line(line)) is not None and entry_job(entry) == job_id
               for line in journal.splitlines())


class _LostAnswer(Exception):
    """An upload went through but its answer was lost (retried)."""


class BucketLease:
    """The lease on the journal object beside `checkpoint_url`
    (gs://bucket/prefix; raises StorageError for a bucket's root, which
    leaves no place outside the checkpoints) for a controller with
    `state_dir`.

    `try_acquire()` (polled by a starting controller) and `renew()` (by the
    leader, every `lease_s / 4`) do blocking I/O: call them from a thread.
    `gcs`: a google-cloud-storage client (default: elastic.checkpoint.gcs);
    `job_id`: the job whose journal the object holds (a claim keeps the
    local journal's stretches of other jobs: merge_tools_lines).
    `clock`: monotonic seconds. `standby`: a controller started with
    --standby, which never takes a missing object at once (see try_acquire)."""

    def __init__(self, checkpoint_url: str, state_dir: str | os.PathLike[str], lease_s: float,
                 gcs_client=None, clock: Callable[[], float] = time.monotonic,
                 job_id: str = "", standby: bool = False) -> None:
        bucket, prefix = gcs.split(checkpoint_url)
        if not prefix:
            raise StorageError(f"checkpoint directory {checkpoint_url} is a bucket's root: the "
                               f"controllers' journal needs a place beside it (use "
                               f"gs://BUCKET/PREFIX)")
        self._blob_name = prefix.rstrip("/") + SUFFIX
        self.url = f"gs://{bucket}/{self._blob_name}"
        self.state_dir = pathlib.Path(state_dir).resolve()
        self.holder = holder_id(self.state_dir)
        self.instance = secrets.token_hex(8)  # this process's, in the object's metadata
        self.lease_s = lease_s
        self.clock = clock
        self.job_id = job_id
        self.standby = standby
        self._gcs = gcs_client or gcs.client()
        self._bucket = self._gcs.bucket(bucket)
        self.generation = 0  # of our last upload (0: not the leader)
        self.renewed_at = float("-inf")
        self._seen: tuple[int, float] | None = None  # (generation, first seen at)

    def _journal(self) -> pathlib.Path:
        return self.state_dir / JOURNAL_NAME

    def try_acquire(self) -> bool:
        """Claim the lease if the object is our own state directory's, or
        has not changed for `lease_s` since this controller first saw its
        generation; the journal it holds replaces the local one (for our own
        state directory's, the local one is kept when it holds all the
        object does). A missing object is claimed at once only by a
        controller that is not a standby and whose journal has no entry of
        this job (the job's first start); else after `lease_s` missing
        (deleted, or a leader not yet up: a leader uploads it again). False
        while another controller holds it. Raises StorageError when the
        bucket cannot be used (`transient` for an outage: a 429, a 5xx, a
        dropped connection, a timeout)."""
        try:
            return self._try_acquire()
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes one line
            raise StorageError(f"the lease on {self.url}: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}"[:300],
                               transient=gcs.transient(e)) from None

    def _try_acquire(self) -> bool:
        from google.api_core import exceptions

        blob = self._bucket.get_blob(self._blob_name, retry=None, timeout=self.lease_s / 4)
        now = self.clock()
        path = self._journal()
        if blob is None:
            local = path.read_bytes() if path.exists() else b""
            if not self.standby and not ran_here(local, self.job_id):
                return self._claim(0, local)  # the job's first controller
            # Deleted (a lifecycle rule, a cleanup of the prefix), or not
            # yet made by the leader a standby waits for: a leader makes it
            # again at its next renewal (renew), so it is claimed only as a
            # silent one is, after lease_s unseen.
            return self._silent_for_lease(0, now) and self._claim(0, local)
        ours = (blob.metadata or {}).get("holder") == self.holder  # (our state dir's)
        if not ours and not self._silent_for_lease(blob.generation, now):
            return False
        try:
            journal = blob.download_as_bytes(if_generation_match=blob.generation, retry=None,
                                             timeout=self.lease_s / 4)
        except exceptions.PreconditionFailed:
            return False  # it was renewed meanwhile
        if ours and path.exists() and (local := path.read_bytes()).startswith(journal):
            # Its own state dir's journal holds all the object does and what
            # it journaled since its last upload (a crash, a SIGKILL): before,
            # those lines were dropped as a deposed controller's.
            journal = local
        return self._claim(blob.generation, journal)

    def _silent_for_lease(self, generation: int, now: float) -> bool:
        """Whether the object has stayed at `generation` (0: missing) for
        `lease_s` since this controller first saw it so, by its own clock."""
        if self._seen is None or self._seen[0] != generation:
            self._seen = (generation, now)
            return False
        return now - self._seen[1] >= self.lease_s

    def _claim(self, generation: int, journal: bytes) -> bool:
        from google.api_core import exceptions

        path = self._journal()
        local = path.read_bytes() if path.exists() else b""
        journal = merge_tools_lines(journal, local, self.job_id)
        if journal != local:  # (a journal of its own left as it is: no window to tear it)
            # rewritten in place (the same file: a tool appending to it, such as
            # elasticd local's fault injector, goes on appending to the journal)
            with open_private(path, "wb") as f:
                f.write(journal)
        sent_at = self.clock()
        try:
            self.generation = self._upload(journal, generation)
        except exceptions.PreconditionFailed:
            return False
        self.renewed_at = sent_at
        log.info("leading through %s (generation %d)", self.url, self.generation)
        return True

    def _upload(self, data: bytes, if_generation_match: int) -> int:
        blob = self._bucket.blob(self._blob_name)
        blob.metadata = {"holder": self.holder, "instance": self.instance}
        blob.upload_from_string(data, content_type="application/jsonl",
                                if_generation_match=if_generation_match, retry=None,
                                timeout=self.lease_s / 4)
        return blob.generation

    def renew(self) -> str:
        """Upload the local journal, renewing the lease; a failed upload is
        tried again (jittered exponential backoff up to lease_s / 10) while
        the lease lasts. Returns "" when renewed, else why this controller
        must stop leading: deposed (the object changed under it) or cut off
        from the bucket for `lease_s / 2`."""
        from google.api_core import exceptions

        def out_of_time(_: tenacity.RetryCallState) -> bool:
            return self.clock() - self.renewed_at >= self.lease_s / 2

        def warn(state: tenacity.RetryCallState) -> None:
            log.warning("cannot renew the lease on %s (try %d, %.1f s since the last "
                        "renewal): %s", self.url, state.attempt_number,
                        self.clock() - self.renewed_at, state.outcome.exception())

        try:
            for attempt in tenacity.Retrying(
                    retry=tenacity.retry_if_not_exception_type(exceptions.PreconditionFailed),
                    wait=tenacity.wait_random_exponential(multiplier=self.lease_s / 40,
                                                          max=self.lease_s / 10),
                    stop=out_of_time, before_sleep=warn, reraise=True):
                with attempt:
                    sent_at = self.clock()
                    data = self._journal().read_bytes()
                    try:
                        self.generation = self._upload(data, self.generation)
                    except exceptions.PreconditionFailed:
                        self._refused(data, attempt.retry_state.attempt_number)
                    self.renewed_at = sent_at
            return ""
        except exceptions.PreconditionFailed:
            return (f"deposed: the journal object {self.url} was written by another "
                    f"controller")
        except Exception as e:  # noqa: BLE001 - any failure to renew counts against the lease
            silent = self.clock() - self.renewed_at
            return (f"could not renew the lease on {self.url} for {silent:.1f} s "
                    f"(health.leader_lease_s = {self.lease_s:g}): a standby may take over "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"[:500])

    def _refused(self, data: bytes, attempt: int) -> None:
        """After an upload refused its precondition: raises _LostAnswer if
        an earlier try of this renewal (`attempt` > 1) went through, its
        answer lost (the object's generation becomes ours); uploads `data`
        anew if the object is gone (deleted: no controller holds it, and
        a standby waits `lease_s` before it claims a missing one); else
        raises PreconditionFailed (deposed). Raises as the client does."""
        from google.api_core import exceptions

        blob = self._bucket.get_blob(self._blob_name, retry=None, timeout=self.lease_s / 4)
        if blob is None:
            log.warning("the journal object %s is gone (deleted?): uploading it again", self.url)
            self.generation = self._upload(data, 0)
            return
        if attempt > 1 and (blob.metadata or {}).get("instance") == self.instance:
            self.generation = blob.generation
            raise _LostAnswer()
        raise exceptions.PreconditionFailed("the journal object was written by another "
                                            "controller")
