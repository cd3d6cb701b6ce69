"""An agent's allow-list of worker programs (elastic.security.allow), by table."""

from __future__ import annotations

import pytest

from elastic.security.allow import AllowList, check_launch

PATH = {"python": "/opt/venv/bin/python", "python3": "/usr/bin/python3", "id": "/usr/bin/id",
        "trainer": "/opt/bin/trainer"}
ALLOW = AllowList.parse(["/opt/venv/bin/python /srv/jobs/*/train.py",
                         "/opt/venv/bin/python -m jobs.lm",
                         "/opt/bin/trainer"],
                        workdirs=["/srv/jobs/*"], env=["PYTHONPATH"])


@pytest.mark.parametrize("argv, env, workdir, refused", [
    (["python", "train.py", "--steps", "10"], {}, "/srv/jobs/lm", None),
    (["/opt/venv/bin/python", "/srv/jobs/lm/train.py"], {}, "/", None),
    (["python", "../lm/train.py"], {}, "/srv/jobs/other", None),
    (["trainer", "--anything"], {"XLA_FLAGS": "x"}, "/tmp", None),
    (["python", "-m", "jobs.lm"], {}, "/srv/jobs/lm", None),
    (["id"], {}, "/srv/jobs/lm", "is not in this host's allow-list"),
    (["python", "-c", "import os"], {}, "/srv/jobs/lm",
     "`/opt/venv/bin/python -c 'import os'` is not in this host's allow-list"),
    (["python", "evil.py"], {}, "/srv/jobs/lm", "is not in this host's allow-list"),
    (["python", "train.py"], {}, "/tmp/evil", "is not in this host's allow-list"),
    (["python3", "/srv/jobs/lm/train.py"], {}, "/", "is not in this host's allow-list"),
    (["python", "-m", "jobs.lm"], {}, "/tmp/evil", "allow the directory with --allow-workdir"),
    (["python", "train.py"], {"LD_PRELOAD": "/tmp/x.so"}, "/srv/jobs/lm",
     "sets LD_PRELOAD, which can make the worker run other code"),
    (["python", "train.py"], {"PATH": "/tmp"}, "/srv/jobs/lm", "sets PATH"),
    (["python", "train.py"], {"PYTHONPATH": "/srv/lib"}, "/srv/jobs/lm", None),  # allowed by name
    (["nope", "train.py"], {}, "/srv/jobs/lm", "is not on this agent's PATH"),
    (["python", "train.py"], {}, "relative", "is not an absolute path"),
    (["python", "tr\0ain.py"], {}, "/srv/jobs/lm", "NUL"),
    ([], {}, "/srv/jobs/lm", "empty"),
])
def test_check_launch(argv, env, workdir, refused):
    reason = check_launch(ALLOW, argv, env, workdir, PATH.get)
    assert (reason is None) == (refused is None), reason
    if refused:
        assert refused in reason


def test_any_worker_still_guards_the_environment():
    anything = AllowList(any_worker=True)
    assert check_launch(anything, ["id"], {}, "/", PATH.get) is None
    assert "LD_AUDIT" in check_launch(anything, ["id"], {"LD_AUDIT": "x"}, "/", PATH.get)


def test_parse_refuses_relative_programs_and_warns_on_bare_interpreters():
    with pytest.raises(ValueError, match="must be an absolute path pattern"):
        AllowList.parse(["python train.py"])
    with pytest.raises(ValueError, match="needs a program"):
        AllowList.parse([""])
    with pytest.raises(ValueError, match="--allow-workdir 'srv'"):
        AllowList.parse(["/bin/x"], workdirs=["srv"])
    assert "allows any Python code" in AllowList.parse(["/usr/bin/python3"]).warnings()[0]
    assert AllowList.parse(["/usr/bin/python3 /srv/train.py"]).warnings() == []
