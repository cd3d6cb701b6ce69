"""The controller's view of checkpoints in Google Cloud Storage.

Workers write and read checkpoints through Orbax (etils.epath over gcsfs,
TensorStore for the arrays). The controller needs less and asks the bucket
directly, through google-cloud-storage: which steps are committed, whether
the bucket is there and writable before anything starts. On GCS, Orbax
cannot rename a directory into place, so a step is committed when its
directory holds `commit_success.txt` (written last); a step directory
without it is a save cut short and never counts.

Every call retries transient answers (429, 5xx, a dropped connection) with
tenacity: exponential backoff with jitter, bounded by `RETRY_S`. The
library's own retry is turned off, so that there is one policy.
`STORAGE_EMULATOR_HOST` (read by google-cloud-storage itself) points the
client at an emulator (fake-gcs-server in the tests).
"""

from __future__ import annotations

import uuid

import tenacity

from elastic.checkpoint.storage import StorageError

#: The marker Orbax writes last into a step directory on GCS.
COMMIT_MARKER = "commit_success.txt"
#: How long one call keeps retrying transient errors (seconds).
RETRY_S = 30.0
#: The longest one request may take (seconds; at most the retries' time):
#: without it the client waits 60 s on a bucket that answers nothing.
REQUEST_TIMEOUT_S = 10.0


def split(url: str) -> tuple[str, str]:
    """"gs://bucket/a/b" -> ("bucket", "a/b/"); the prefix ends with "/"
    (or is "" for the bucket's root). Raises StorageError for a malformed URL."""
    if not url.startswith("gs://") or not url[5:].split("/", 1)[0]:
        raise StorageError(f"{url!r} is not a gs://bucket[/prefix] URL")
    bucket, _, prefix = url[5:].partition("/")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/") if prefix else ""


def transient(error: BaseException) -> bool:
    """Whether `error` from google-cloud-storage is worth retrying: a 429,
    a 5xx, a dropped connection or a timeout."""
    from google.api_core import exceptions
    import requests

    return isinstance(error, (exceptions.TooManyRequests, exceptions.InternalServerError,
                              exceptions.BadGateway, exceptions.ServiceUnavailable,
                              exceptions.GatewayTimeout, requests.ConnectionError,
                              requests.Timeout))


def _request_timeout_s(retry_s: float) -> float:
    return max(1.0, min(REQUEST_TIMEOUT_S, retry_s))


def _retrying(retry_s: float) -> tenacity.Retrying:
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(transient),
        wait=tenacity.wait_exponential_jitter(multiplier=0.1, max=5.0, jitter=0.1),
        stop=tenacity.stop_after_delay(retry_s), reraise=True)


def client():
    """A google-cloud-storage client with the environment's credentials (or
    the emulator's, when STORAGE_EMULATOR_HOST is set). Raises StorageError
    when the package is missing or there are no credentials."""
    try:
        from google.cloud import storage
    except ImportError:
        raise StorageError("gs:// checkpoint directories need google-cloud-storage and "
                           "gcsfs: pip install 'elastic[gcs]'") from None
    import google.auth.exceptions

    try:
        return storage.Client()
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise StorageError(f"no Google Cloud credentials for the checkpoint bucket: "
                           f"{str(e).splitlines()[0]}") from None


def _explain(url: str, error: Exception) -> StorageError:
    """One line for a failed call on `url`."""
    from google.api_core import exceptions

    if isinstance(error, exceptions.NotFound):
        return StorageError(f"checkpoint directory {url}: bucket {split(url)[0]!r} does not "
                            f"exist")
    if isinstance(error, (exceptions.Forbidden, exceptions.Unauthorized)):
        return StorageError(f"checkpoint directory {url}: permission denied "
                            f"({type(error).__name__}: {error.message})")
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return StorageError(f"checkpoint directory {url}: {type(error).__name__}: {text[:300]}",
                        transient=transient(error))


def committed_steps(url: str, retry_s: float = RETRY_S, gcs=None) -> list[int]:
    """The committed checkpoint steps under `url` (gs://bucket/prefix),
    ascending: step directories holding COMMIT_MARKER. Raises StorageError
    (one line) when the bucket cannot be listed, after retrying transient
    errors for `retry_s` seconds."""
    bucket, prefix = split(url)
    gcs = gcs or client()

    def listing() -> list[int]:
        blobs = gcs.list_blobs(bucket, prefix=prefix, match_glob=f"{prefix}*/{COMMIT_MARKER}",
                               retry=None, timeout=_request_timeout_s(retry_s))
        steps = []
        for blob in blobs:
            step = blob.name[len(prefix):].split("/", 1)[0]
            if step.isdigit() and blob.name == f"{prefix}{step}/{COMMIT_MARKER}":
                steps.append(int(step))
        return sorted(steps)

    try:
        return _retrying(retry_s)(listing)
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure becomes one line
        raise _explain(url, e) from None


def check_writable(url: str, retry_s: float = RETRY_S, gcs=None) -> None:
    """Check, before anything starts, that the bucket of `url` exists and
    that objects can be written and deleted under its prefix (a probe object
    `<prefix>.elastic-probe-<random>`, removed again). Raises StorageError
    with one line saying what is wrong: no package, no credentials, no such
    bucket, permission denied, or the error the service gave."""
    bucket_name, prefix = split(url)
    gcs = gcs or client()
    probe = f"{prefix}.elastic-probe-{uuid.uuid4().hex[:12]}"

    def write() -> None:
        gcs.bucket(bucket_name).blob(probe).upload_from_string(
            b"elastic: can this job write here?", retry=None,
            timeout=_request_timeout_s(retry_s))

    def delete() -> None:
        from google.api_core import exceptions

        try:
            gcs.bucket(bucket_name).blob(probe).delete(retry=None,
                                                       timeout=_request_timeout_s(retry_s))
        except exceptions.NotFound:  # a retry of a delete whose answer was lost
            pass

    try:
        # each call retried on its own: a lost answer repeats one call, not both
        _retrying(retry_s)(write)
        _retrying(retry_s)(delete)
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001
        raise _explain(url, e) from None
