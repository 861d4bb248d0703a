"""The declared dependency floors are the ones CI tests: scripts/dependency_floors.py reads
them from pyproject.toml, and .ci/run runs .ci/run-floors, which installs exactly them."""

import sys
from pathlib import Path

import pytest
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")


def _script():
    return load_script("scripts/dependency_floors.py")


def test_the_floors_are_read_from_pyproject():
    floors = _script().floors(ROOT / "pyproject.toml")
    assert floors == {
        "torch": "2.13.0",
        "transformers": "4.56.2",
        "tokenizers": "0.22.0",
        "safetensors": "0.4.3",
    }


def test_ci_runs_the_tests_on_the_floors():
    run = (ROOT / ".ci/run").read_text()
    floors = (ROOT / ".ci/run-floors").read_text()
    assert "bash .ci/run-floors" in run
    assert "scripts/dependency_floors.py" in floors and "python -m pytest" in floors
    # The safety tests run on the floors too: crafted checkpoints, links, bad data, rewards.
    for safety in ("test_hostile_inputs.py", "test_custom_reward.py"):
        assert f"--ignore=tests/{safety}" not in floors


def test_a_library_without_a_floor_is_named(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch>=2.13.0", "transformers"]\n')
    with pytest.raises(SystemExit, match="transformers, tokenizers, safetensors"):
        _script().floors(pyproject)
