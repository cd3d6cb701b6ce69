"""The systemd units pass `systemd-analyze verify`, keep their sandbox
(`systemd-analyze security` exposure) within the issue's targets, and the
user they run as is what elastic.sysusers.conf creates (where the tools exist)."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

UNITS = pathlib.Path(__file__).resolve().parent.parent / "workers" / "systemd"
#: Highest acceptable "Overall exposure level" (0 safest, 10 unsafe) per unit.
MAX_EXPOSURE = {"elastic-agent.service": 6.0, "elasticd.service": 3.0}
#: The user each unit runs as (the controller's apart from the workers').
USERS = {"elastic-agent.service": "elastic", "elasticd.service": "elasticd"}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (apt-get install systemd)")
    return path


def copy_unit(tmp_path: pathlib.Path, unit: str) -> pathlib.Path:
    """`unit` in tmp_path, ExecStart pointing at the binaries of this environment."""
    text = (UNITS / unit).read_text()
    text = text.replace("/opt/elastic/.venv/bin", str(pathlib.Path(sys.executable).parent))
    assert "Restart=always" in text and "KillMode=" in text and f"User={USERS[unit]}\n" in text
    (tmp_path / unit).write_text(text)
    return tmp_path / unit


@pytest.mark.parametrize("unit", sorted(MAX_EXPOSURE))
def test_unit_verifies(tmp_path, unit):
    analyze = tool("systemd-analyze")
    out = subprocess.run([analyze, "verify", str(copy_unit(tmp_path, unit))],
                         capture_output=True, text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines()
                if unit in line or "Unknown" in line or "error" in line.lower()]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr


@pytest.mark.parametrize("unit", sorted(MAX_EXPOSURE))
def test_unit_sandbox_exposure(tmp_path, unit):
    analyze = tool("systemd-analyze")
    out = subprocess.run([analyze, "security", "--offline=true", "--no-pager",
                          str(copy_unit(tmp_path, unit))],
                         capture_output=True, text=True, timeout=60)
    if "--offline" in out.stderr and out.returncode != 0:
        pytest.skip(f"systemd-analyze security --offline needs systemd 250+: {out.stderr}")
    found = re.search(rf"Overall exposure level for {re.escape(unit)}: (\d+\.\d+)", out.stdout)
    assert out.returncode == 0 and found, out.stdout + out.stderr
    exposure = float(found.group(1))
    print(f"{unit}: exposure {exposure} (at most {MAX_EXPOSURE[unit]})")
    assert exposure <= MAX_EXPOSURE[unit], out.stdout


def test_the_controller_restarts_well_inside_the_agents_lease():
    """systemd restarts a crashed controller within RestartSec; the agents
    keep their workers for the default controller lease, so the restarted
    controller finds the slice training and adopts it."""
    from elastic.config import HealthSpec

    text = (UNITS / "elasticd.service").read_text()
    delay = float(re.search(r"\nRestartSec=(\d+(?:\.\d+)?)\n", text).group(1))
    assert "\nRestart=always\n" in text and delay + 5.0 < HealthSpec().controller_lease_s


def test_the_unit_and_elasticd_local_restart_the_same_exits():
    """The controller unit's RestartPreventExitStatus is the controller's
    FINAL_EXITS, which `elasticd local`'s restarts follow too: a controller
    that stepped down (3), crashed (70) or was killed starts again."""
    from elastic.controller.server import CRASHED_EXIT, DEPOSED_EXIT, FINAL_EXITS
    from elastic.local.controllers import restarts_after

    text = (UNITS / "elasticd.service").read_text()
    final = re.search(r"\nRestartPreventExitStatus=([\d ]+)\n", text).group(1).split()
    assert {int(code) for code in final} == FINAL_EXITS
    codes = (None, 0, 1, 2, DEPOSED_EXIT, CRASHED_EXIT, 143, -9)
    assert [restarts_after(c) for c in codes] == [False] * 4 + [True] * 4


def test_sysusers_creates_the_units_user(tmp_path):
    sysusers = tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    conf = (UNITS / "elastic.sysusers.conf").read_text()
    out = subprocess.run([sysusers, f"--root={tmp_path}", "-"], input=conf,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    users = {line.split(":")[0]: line.split(":") for line in
             (tmp_path / "etc" / "passwd").read_text().splitlines()}
    groups = {line.split(":")[0] for line in (tmp_path / "etc" / "group").read_text().splitlines()}
    for unit, user in USERS.items():
        assert user in users and user in groups, users
        assert int(users[user][2]) < 1000 and users[user][6].endswith("nologin")
        text = (UNITS / unit).read_text()
        assert f"\nUser={user}\n" in text and f"\nGroup={user}\n" in text, unit
