"""The device nodes of a simulated host.

A host of `elasticd local` has a directory of its own standing in for its
/dev: `<state-dir>/hosts/<host-id>/dev`, with one empty file `accel<n>` per
device. Its agent counts them exactly as a real agent counts /dev/accel<n>
(`elastic.agent.host.discover_devices`, at start and at every heartbeat),
so a test or the `lose-device` chaos fault can take a device away from a
running host, and give it back, the way a failed and repaired chip would.
"""

from __future__ import annotations

import pathlib
import re

from elastic.security.files import private_dir

_NODE = re.compile(r"accel(\d+)$")


def device_dir(state_dir: pathlib.Path, host_id: str) -> pathlib.Path:
    """Where the simulated host `host_id` of the slice in `state_dir` keeps its nodes."""
    return pathlib.Path(state_dir) / "hosts" / host_id / "dev"


def nodes(path: pathlib.Path) -> list[pathlib.Path]:
    """The device nodes in `path`, by number."""
    found = [(int(m.group(1)), p) for p in pathlib.Path(path).glob("accel*")
             if (m := _NODE.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def set_devices(path: pathlib.Path, count: int) -> None:
    """Make `path` hold exactly `count` nodes, accel0 .. accel<count-1>.
    Raises ValueError for a count below 1, OSError when `path` cannot be made."""
    if count < 1:
        raise ValueError(f"a host has at least 1 device, not {count}")
    private_dir(path)
    for node in nodes(path):
        if int(_NODE.fullmatch(node.name).group(1)) >= count:
            node.unlink()
    for i in range(count):
        (path / f"accel{i}").touch(mode=0o600)


def remove_device(path: pathlib.Path) -> str | None:
    """Take the highest-numbered device away (a chip that failed); its name,
    or None when only one is left (a host keeps at least one)."""
    present = nodes(path)
    if len(present) <= 1:
        return None
    present[-1].unlink()
    return present[-1].name


def restore_device(path: pathlib.Path, name: str) -> None:
    """Give back a device `remove_device` took (the chip was repaired)."""
    (pathlib.Path(path) / name).touch(mode=0o600)
