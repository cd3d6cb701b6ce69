"""Where checkpoints live. The one seam between a checkpoint directory string
and the path object Orbax writes through (etils.epath): local paths today;
`gs://` needs gcsfs and goes through the same function."""

from __future__ import annotations

from etils import epath


class StorageError(RuntimeError):
    """A checkpoint directory that cannot be used; the message says why."""


def resolve(directory: str) -> epath.Path:
    """The path Orbax should use for `directory` (a local path or gs://bucket/dir).

    Raises StorageError for an empty directory, an unsupported scheme, or gs://
    without gcsfs installed."""
    if not directory:
        raise StorageError("no checkpoint directory (ELASTIC_CHECKPOINT_DIR is empty)")
    scheme = directory.split("://", 1)[0] if "://" in directory else ""
    if scheme not in ("", "gs"):
        raise StorageError(f"checkpoint directory {directory!r}: scheme {scheme}:// is not "
                           f"supported (use a local path or gs://)")
    if scheme == "gs":
        try:
            import gcsfs  # noqa: F401  (etils.epath needs it for gs://)
        except ImportError:
            raise StorageError(f"checkpoint directory {directory!r} needs gcsfs: "
                               f"pip install 'elastic[gcs]'") from None
    return epath.Path(directory)
