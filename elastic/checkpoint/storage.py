"""Where checkpoints live. The one seam between a checkpoint directory string
and the path object Orbax writes through (etils.epath): a local path, or
gs://bucket/prefix (gcsfs for Orbax; the controller's own view of a bucket
is elastic.checkpoint.gcs, through google-cloud-storage)."""

from __future__ import annotations

import os


class StorageError(RuntimeError):
    """A checkpoint directory that cannot be used; the message says why.
    `transient`: the storage service did not answer, or answered that it
    is unavailable (a 429, a 5xx, a dropped connection, a timeout), after
    retries: what an outage gives, not a mistake in the job's spec."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def scheme(directory: str) -> str:
    """The storage scheme of a checkpoint directory: "gs" for
    gs://bucket/dir, "" for a local path."""
    return directory.split("://", 1)[0] if "://" in directory else ""


def resolve(directory: str) -> "epath.Path":  # noqa: F821 (etils, imported when used)
    """The path Orbax should use for `directory` (a local path or gs://bucket/dir).

    Raises StorageError for an empty directory, an unsupported scheme, or gs://
    without gcsfs installed."""
    if not directory:
        raise StorageError("no checkpoint directory (ELASTIC_CHECKPOINT_DIR is empty)")
    kind = scheme(directory)
    if kind not in ("", "gs"):
        raise StorageError(f"checkpoint directory {directory!r}: scheme {kind}:// is not "
                           f"supported (use a local path or gs://)")
    if kind == "gs":
        try:
            import gcsfs  # noqa: F401  (etils.epath needs it for gs://)
        except ImportError:
            raise StorageError(f"checkpoint directory {directory!r} needs gcsfs: "
                               f"pip install 'elastic[gcs]'") from None
    from etils import epath

    return epath.Path(directory)


def check(directory: str | None, retry_s: float | None = None) -> None:
    """Before anything starts: a gs:// checkpoint directory needs the `gcs`
    extra, credentials, an existing bucket and the right to write under its
    prefix (elastic.checkpoint.gcs.check_writable; transient errors retried
    for `retry_s` seconds, default gcs.RETRY_S). Local directories are made
    by the workers. Raises StorageError with one line."""
    if not directory or not directory.startswith("gs://"):
        return
    resolve(directory)  # the gcsfs check
    from elastic.checkpoint import gcs

    gcs.check_writable(directory, gcs.RETRY_S if retry_s is None else retry_s)


def latest_step(directory: str | None) -> int:
    """The highest committed checkpoint step in `directory`, local or gs://
    (-1 if none, or when it cannot be read: this only bounds what the
    controller believes, see elastic.controller.admission)."""
    if directory and directory.startswith("gs://"):
        from elastic.checkpoint import gcs

        try:
            return max(gcs.committed_steps(directory, retry_s=5.0), default=-1)
        except StorageError:
            return -1
    return latest_local_step(directory)


def latest_local_step(directory: str | None) -> int:
    """The highest step of a committed Orbax checkpoint in the local
    `directory` (a subdirectory named by its step; a save cut short leaves
    `<step>.orbax-checkpoint-tmp...`, which does not count), -1 if there is
    none, the directory is unreadable, or it is not local (gs:// goes
    through the storage client, not listed here)."""
    if not directory or "://" in directory:
        return -1
    try:
        names = os.listdir(directory)
    except OSError:
        return -1
    return max((int(n) for n in names if n.isdigit()), default=-1)
