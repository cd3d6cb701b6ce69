"""Facts about this host, found without opening any accelerator (opening a
TPU's chips from the agent would lock them away from the worker)."""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import socket

from elastic.config import DEVICE_KIND, DEVICE_KIND_CHARS


@dataclasses.dataclass(frozen=True)
class Devices:
    """A host's accelerators: how many and what kind ("tpu", a GPU's model
    name such as "NVIDIA H100 80GB HBM3", "cpu" for a host with none)."""

    count: int
    kind: str


def _nvidia_model(proc_root: str) -> str:
    """The model name the NVIDIA driver gives its first GPU, in the charset
    of a device kind; "gpu" when it cannot be read."""
    for info in sorted(glob.glob(os.path.join(proc_root, "driver/nvidia/gpus/*/information"))):
        try:
            with open(info, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("Model:"):
                        model = re.sub(f"[^{DEVICE_KIND_CHARS}]", "", line[6:]).strip()[:64]
                        if DEVICE_KIND.fullmatch(model):
                            return model
        except OSError:
            continue
    return "gpu"


def discover_devices(dev_root: str = "/dev", proc_root: str = "/proc") -> Devices:
    """Accelerator devices on this host, counted from device nodes only (so
    the agent never opens a chip its worker needs): TPU `accel<n>` or
    `vfio/<n>`, NVIDIA GPU `nvidia<n>` under `dev_root`. A host with none is
    one "cpu" device. The agent counts again at every heartbeat: a node that
    vanishes (a chip the driver gave up on) lowers the count the controller
    plans with.
    """
    for pattern, regex, kind in (("accel*", r"accel\d+$", "tpu"),
                                 ("vfio/*", r"vfio/\d+$", "tpu"),
                                 ("nvidia*", r"nvidia\d+$", "")):
        found = [p for p in glob.glob(os.path.join(dev_root, pattern))
                 if re.search(r"(^|/)" + regex, p)]
        if found:
            return Devices(len(found), kind or _nvidia_model(proc_root))
    return Devices(1, "cpu")


def default_address() -> str:
    """The address peers use for this host: its hostname's address, or
    127.0.0.1 when the name does not resolve."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class PortProber:
    """Finds a free TCP port for the next coordinator, never one of the last
    `remember` ports handed out (a coordinator of an older generation may still
    hold it while it is being torn down)."""

    def __init__(self, bind_address: str = "", remember: int = 16) -> None:
        self.bind_address = bind_address
        self.recent: collections.deque[int] = collections.deque(maxlen=remember)

    def probe(self) -> int:
        """A port the kernel says is free now (0 if none could be bound)."""
        for _ in range(8):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((self.bind_address, 0))
                except OSError:
                    return 0
                port = s.getsockname()[1]
            if port not in self.recent:
                return port
        return 0

    def used(self, port: int) -> None:
        """Remember that `port` was given to a coordinator."""
        self.recent.append(port)
