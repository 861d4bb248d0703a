"""``torchrun ... -m dapo COMMAND`` ran every command but ``train`` whole on each rank: two
exports into one directory, one failing ("appeared meanwhile") and torchrun reporting the job
FAILED; an evaluation writing its files twice at once. Only ``train`` uses ranks; the others
are refused before they do anything (the ranks' environment stands in for torchrun here)."""

import pytest

import dapo.cli
from dapo.cli import main, once_per_rank


def _ranks(monkeypatch, world: str, local_rank: str = "0") -> None:
    env = {"RANK": local_rank, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "LOCAL_RANK": local_rank}.items():
        monkeypatch.setenv(key, value)


def _refusal(command: str) -> str:
    return (
        f"dapo {command} runs in one process; torchrun starts it once per rank "
        f"(WORLD_SIZE=2): run python -m dapo {command} ... (or dapo {command} ...) without "
        "torchrun (only dapo train uses ranks)"
    )


# Each would fail at once in one process (no such input, a bad number), so that without the
# refusal the test fails on its message instead of running a command.
@pytest.mark.parametrize(
    "argv",
    [
        ["export", "runs/x", "--out", "exported"],
        ["eval", "no-such-model", "--data", "no-such.jsonl", "--k", "1"],
        ["report", "runs/x"],
        ["data", "check", "train.jsonl"],
        ["bench", "--steps", "0"],
        ["ablate", "--plan", "table1", "--parallel", "0"],
        ["model", "import", "m.gguf", "imported"],
    ],
)
def test_commands_other_than_train_are_refused_on_each_rank(argv, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)  # nothing is written: the refusal comes first
    # A rank that fails leaves with os._exit: here it returns, so that a command run on
    # the way to failing shows as a failed assertion, not as pytest gone.
    monkeypatch.setattr(dapo.cli, "failed", lambda code: code)
    _ranks(monkeypatch, "2")
    assert main(argv) == 2
    assert capsys.readouterr() == ("", f"dapo: error: {_refusal(argv[0])}\n")
    assert list(tmp_path.iterdir()) == []
    _ranks(monkeypatch, "2", local_rank="1")  # said once a node: the other ranks only exit
    assert main(argv) == 2
    assert capsys.readouterr() == ("", "")


def test_train_runs_under_torchrun_and_one_rank_runs_anything(monkeypatch, capsys):
    _ranks(monkeypatch, "2")
    assert main(["train", "--print-config", "train.steps=7"]) == 0
    out, err = capsys.readouterr()
    assert "  steps: 7\n" in out and "runs in one process" not in err
    # One rank runs a command once: nothing to refuse. Outside torchrun, nothing either.
    _ranks(monkeypatch, "1")
    assert once_per_rank("export") is None
    monkeypatch.delenv("MASTER_ADDR")
    outside = [once_per_rank(c) for c in ("export", "eval", "train")]
    assert outside == [None, None, None]
    _ranks(monkeypatch, "2")
    assert once_per_rank("train") is None and once_per_rank("export") == _refusal("export")
