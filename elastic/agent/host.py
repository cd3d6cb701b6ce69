"""Facts about this host, found without opening any accelerator (opening a
TPU's chips from the agent would lock them away from the worker)."""

from __future__ import annotations

import collections
import glob
import re
import socket


def discover_devices() -> int:
    """Accelerator devices on this host, counted from device nodes only:
    TPU `/dev/accel*` or `/dev/vfio/<n>`, NVIDIA GPU `/dev/nvidia<n>`; 1 for a
    host with none (a CPU host is one device)."""
    for pattern, regex in (("/dev/accel*", r"/dev/accel\d+$"),
                           ("/dev/vfio/*", r"/dev/vfio/\d+$"),
                           ("/dev/nvidia*", r"/dev/nvidia\d+$")):
        found = [p for p in glob.glob(pattern) if re.match(regex, p)]
        if found:
            return len(found)
    return 1


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
