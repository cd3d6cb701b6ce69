"""The systemd units pass `systemd-analyze verify` (where the tool exists)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

UNITS = pathlib.Path(__file__).resolve().parent.parent / "workers" / "systemd"


@pytest.mark.parametrize("unit", ["elastic-agent.service", "elasticd.service"])
def test_unit_verifies(tmp_path, unit):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    text = (UNITS / unit).read_text()
    # point ExecStart at the binaries of this environment so verify can check them
    text = text.replace("/opt/elastic/.venv/bin", str(pathlib.Path(sys.executable).parent))
    assert "Restart=always" in text and "KillMode=" in text
    (tmp_path / unit).write_text(text)
    out = subprocess.run([tool, "verify", str(tmp_path / unit)], capture_output=True, text=True,
                         timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines()
                if unit in line or "Unknown" in line or "error" in line.lower()]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr
