"""The agent's progress socket takes reports only from its own user."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from elastic.worker.progress import ProgressReceiver, ProgressReporter, Report, decode


def test_reports_from_another_user_are_dropped(proc_env):
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux setpriv to send as another user")
    address = f"@elastic-progress-test-{uuid.uuid4().hex[:8]}"
    received: list[bytes] = []

    async def main():
        got = asyncio.Event()
        receiver = ProgressReceiver(address, lambda data: (received.append(data), got.set()))
        receiver.attach(asyncio.get_running_loop())
        try:
            # the other user sends a well-formed report with the standard
            # library only (it may not be able to read this checkout)
            payload = Report(7, step=10**9).encode()
            forged = ("import socket, sys; s = socket.socket(socket.AF_UNIX, "
                      "socket.SOCK_DGRAM); s.sendto(bytes.fromhex(sys.argv[1]), "
                      "b'\\0' + sys.argv[2][1:].encode())")
            await asyncio.to_thread(subprocess.run, [
                setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                "-I", "-c", forged, payload.hex(), address], env=proc_env, check=True,
                timeout=60)
            ProgressReporter(address, 7).step(3, loss=1.5)  # this user: the worker's
            await asyncio.wait_for(got.wait(), 10)
            return receiver.dropped
        finally:
            receiver.close()

    dropped = asyncio.run(main())
    assert dropped == 1
    assert [decode(d).step for d in received] == [3]
