"""Untrusted code runs under a temporary directory that is too long for a socket or that
others may not search.

Python 3.11's forkserver binds "<temp dir>/pymp-XXXXXXXX/listener-XXXXXXXX", which a Unix socket
holds only up to 107 bytes: under a 76-byte TMPDIR (a pytest directory on the CI machine) the
first reward worker failed with "OSError: AF_UNIX path too long". And as root, a sandboxed run
has a uid of its own, which could not reach a working directory under a TMPDIR of mode 0700:
every run failed its confinement (exit status 121), and every program was graded wrong."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dapo.reward import sandbox
from dapo.reward.start_method import FORKSERVER_PATH_EXTRA, SOCKET_PATH_MAX, default_start_method

ROOT = Path(__file__).resolve().parents[1]
AS_ROOT = os.geteuid() == 0


def test_the_forkserver_is_used_while_its_socket_path_fits(monkeypatch):
    longest = "/" + "t" * (SOCKET_PATH_MAX - FORKSERVER_PATH_EXTRA - 1)
    assert len(longest) + len("/pymp-abcdefgh/listener-abcdefgh") == 107
    monkeypatch.setattr(tempfile, "tempdir", longest)
    assert default_start_method() == "forkserver"
    monkeypatch.setattr(tempfile, "tempdir", longest + "t")
    assert default_start_method() == "spawn"
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    assert default_start_method() == "forkserver"


CHILD = r"""
import json, sys
from dapo.env.python_tool import Launcher
from dapo.reward import sandbox
from dapo.reward.pool import Job, RewardPool
import pytest

from dapo.reward import sandbox
from dapo.reward.start_method import default_start_method

with RewardPool(workers=1) as pool:
    graded = pool.grade([Job("math_dapo", "so Answer: 12", "12")] * 2)
ran = Launcher(1).run("print(6 * 7)", sandbox.SandboxLimits(), "process")
print(json.dumps({"method": default_start_method(), "scores": [s.score for s in graded.scores],
                  "faults": len(graded.faults), "out": ran.stdout.decode(), "rc": ran.returncode}))
"""


def test_workers_and_tool_helpers_start_under_a_long_temp_dir(tmp_path):
    temp = tmp_path / ("d" * max(1, 90 - len(str(tmp_path))))
    temp.mkdir()
    assert len(str(temp)) + FORKSERVER_PATH_EXTRA > SOCKET_PATH_MAX
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"method": "spawn", "scores": [1.0, 1.0], "faults": 0, "out": "42\n", "rc": 0}
    left = list(temp.iterdir())  # no forkserver directory, no run's; as root, no marker
    assert [p.name for p in left] == (["dapo-sandbox-runs-0"] if AS_ROOT else [])
    assert [list(p.iterdir()) for p in left] == [[] for _ in left]


@pytest.mark.skipif(not AS_ROOT, reason="needs root (a uid per run)")
@pytest.mark.parametrize("mode", [m for m in sandbox.available_modes() if m != "bwrap"])
def test_a_run_with_its_own_uid_works_under_a_temp_dir_it_cannot_reach(tmp_path, monkeypatch, mode):
    # tmp_path is under /tmp/pytest-of-root, of mode 0700: a run's uid cannot pass it.
    unreachable, reachable = tmp_path / "temp", Path("/tmp") / f"dapo-test-{tmp_path.name}"
    for top in (unreachable, reachable):
        top.mkdir(mode=0o755)
    source = "import os; open('f', 'w').write('x'); print(6 * 7, os.path.dirname(os.getcwd()))"
    try:
        for temp, parent in ((unreachable, "/tmp"), (reachable, str(reachable))):
            monkeypatch.setattr(tempfile, "tempdir", str(temp))
            ran = sandbox.run_python(source, limits=sandbox.SandboxLimits(), mode=mode)
            assert (ran.returncode, ran.stdout, ran.stderr) == (0, f"42 {parent}\n".encode(), b"")
            assert [p.name for p in temp.iterdir()] == ["dapo-sandbox-runs-0"]  # no run's
    finally:
        shutil.rmtree(reachable, ignore_errors=True)
