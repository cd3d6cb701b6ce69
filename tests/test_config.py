"""Job spec parsing: strict, and errors name the file and the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elastic.config import MeshSpec, SpecError, load_spec
from elastic.worker_env import WorkerEnv
from tests.conftest import write_spec

GOOD = """
[job]
id = "lm"
command = ["python", "train.py"]
min_hosts = 2
max_hosts = 4
checkpoint_dir = "ckpt"
env = { A = "1" }

[mesh]
data = -1
model = 2

[health]
heartbeat_interval_s = 1
heartbeat_timeout_s = 5.0

[restart]
grow = "never"
"""


def test_good_spec(tmp_path):
    spec = load_spec(write_spec(tmp_path / "job.toml", GOOD))
    assert spec.job_id == "lm" and spec.command == ("python", "train.py")
    assert spec.mesh.axes == (("data", -1), ("model", 2))
    assert spec.health.heartbeat_interval_s == 1.0
    assert spec.checkpoint_dir == str(tmp_path / "ckpt")  # relative to the spec's folder
    assert spec.workdir == str(tmp_path)
    assert spec.restart.grow == "never" and spec.env == {"A": "1"}


@pytest.mark.parametrize("replace,expected", [
    (('id = "lm"', 'id = "lm"\ncolour = "red"'), "unknown key job.colour"),
    (("[restart]", "[restarts]"), "unknown section or key 'restarts'"),
    (('grow = "never"', 'grow = "never"\nbudget = 3'), "unknown key restart.budget"),
    (("min_hosts = 2", 'min_hosts = "2"'), "job.min_hosts must be an integer"),
    (("min_hosts = 2", "min_hosts = 5"), "job.min_hosts (5) is greater than job.max_hosts (4)"),
    (("heartbeat_timeout_s = 5.0", "heartbeat_timeout_s = 1.0"),
     "health.heartbeat_timeout_s (1.0) must be greater than health.heartbeat_interval_s"),
    (("model = 2", "model = -1"), "at most one axis may be -1"),
    (("model = 2", "model = 0"), "axis model has size 0"),
    (('grow = "never"', 'grow = "sometimes"'), "restart.grow is 'sometimes'"),
    (('grow = "never"', 'grow = "never"\nprestart_workers = 1'),
     "restart.prestart_workers must be true or false, got 1"),
    (("heartbeat_timeout_s = 5.0", "heartbeat_timeout_s = 5.0\nreconnect_grace_s = 0"),
     "health.reconnect_grace_s must be > 0"),
    (('command = ["python", "train.py"]', "command = []"), "job.command must be a non-empty"),
    (("data = -1\nmodel = 2", "data = 7\nmodel = 1"),
     "[mesh] mesh data=7,model=1 fits no slice of 2 to 4 hosts"),
    (("heartbeat_interval_s = 1", "heartbeat_interval_s = true"),
     "health.heartbeat_interval_s must be a number"),
    (('grow = "never"', 'grow = "never"\n[local]\nisolate = "yes"'),
     "local.isolate must be true or false"),
    # names the workers could not read back (the mesh goes to them as
    # NAME=SIZE,...): before, accepted, and every worker failed at its start
    (("data = -1", '"data,x" = -1'), "axis name 'data,x' is not a name"),
    (("data = -1", '"a=b" = -1'), "axis name 'a=b' is not a name"),
    (("data = -1", '"" = -1'), "axis name '' is not a name"),
    # before, "" was the spec's own folder: checkpoints among the user's code
    (('checkpoint_dir = "ckpt"', 'checkpoint_dir = ""'), "job.checkpoint_dir is empty"),
    (('checkpoint_dir = "ckpt"', 'workdir = " "'), "job.workdir is empty"),
])
def test_bad_spec_names_the_key(tmp_path, replace, expected):
    old, new = replace
    assert old in GOOD
    path = write_spec(tmp_path / "bad.toml", GOOD.replace(old, new))
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert expected in str(e.value) and str(path) in str(e.value)


def test_impossible_mesh_with_known_devices(tmp_path):
    text = GOOD.replace('id = "lm"', 'id = "lm"\ndevices_per_host = 3').replace("model = 2",
                                                                              "model = 5")
    with pytest.raises(SpecError, match="fits no slice"):
        load_spec(write_spec(tmp_path / "j.toml", text))


def test_failure_domain_larger_than_max_hosts(tmp_path):
    text = GOOD.replace('id = "lm"', 'id = "lm"\nhosts_per_failure_domain = 8')
    with pytest.raises(SpecError, match="hosts_per_failure_domain"):
        load_spec(write_spec(tmp_path / "j.toml", text))


def test_toml_syntax_and_missing_file(tmp_path):
    with pytest.raises(SpecError, match="invalid TOML"):
        load_spec(write_spec(tmp_path / "j.toml", "[job\n"))
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "missing.toml")


@pytest.mark.parametrize("command", ["start", "local"])
def test_elasticd_exits_2_and_starts_nothing(tmp_path, proc_env, command):
    path = write_spec(tmp_path / "bad.toml", GOOD.replace("min_hosts = 2", "min_hosts = 9"))
    out = subprocess.run([sys.executable, "-m", "elastic.cli", command, "--config", str(path),
                          "--state-dir", str(tmp_path / "state")],
                         env=proc_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "job.min_hosts (9) is greater than job.max_hosts (4)" in out.stderr
    assert str(path) in out.stderr
    assert not (tmp_path / "state").exists()


def test_worker_env_names_what_is_missing():
    with pytest.raises(RuntimeError, match="JAX_COORDINATOR_ADDRESS is not set"):
        WorkerEnv.from_environ({})


def test_mesh_text_round_trip_and_errors():
    assert MeshSpec.from_text("data=-1, model=2").to_text() == "data=-1,model=2"
    with pytest.raises(SpecError, match="not NAME=SIZE"):
        MeshSpec.from_text("data")
    with pytest.raises(SpecError, match="at most one axis"):
        MeshSpec.from_text("a=-1,b=-1")


def test_the_sharded_reference_job_spans_hosts_with_its_model_axis():
    """workers/lm/job_sharded.toml: 'model' first, so on hosts of 2 devices
    (laid out host-major) it runs across hosts; slices of 2 or 4 hosts."""
    from elastic.policy.mesh import mesh_shape
    from tests.conftest import REPO

    spec = load_spec(REPO / "workers" / "lm" / "job_sharded.toml")
    assert spec.mesh.names == ("model", "data") and spec.restart.replicate_snapshots
    assert [mesh_shape(spec.mesh, 2 * hosts) for hosts in (1, 2, 3, 4)] == \
        [None, (4, 1), None, (4, 2)]
