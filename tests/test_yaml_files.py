"""Every YAML file dapo reads from elsewhere (a ``--config`` file, a recipe, a run's
``config.yaml`` on ``--resume``, ``dapo export``, ``dapo eval --config``) is read without
aliases: a few hundred bytes of nested aliases expanded to gigabytes before (the "billion
laughs"), and nesting deeper than the parser recurses was a RecursionError traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from dapo.api import exporting
from dapo.config import dump_yaml, load_config
from dapo.config.loading import read_hardware
from dapo.config.yaml_files import YamlFileError, clipped_repr, read_yaml_file
from dapo.run import checkpoint


def _laughs(levels: int = 3) -> str:
    """A flow list of 10**levels ``x`` from nested aliases (9 levels would be 10**9)."""
    chain = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        chain.append(f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    return f"[{', '.join(chain)}]"


def test_an_alias_is_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f"run:\n  name: r\nrollout:\n  stop_token_ids: {_laughs()}\n")
    with pytest.raises(YamlFileError) as caught:
        read_yaml_file(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: line 4: a YAML alias (*a0): ")
    assert "accepts no YAML anchors and aliases" in message
    assert caught.value.path == path and not caught.value.reason.startswith(str(path))
    # An anchor alone repeats nothing: still read.
    path.write_text("a: &x {b: 1}\nc: [1, 2]\n")
    assert read_yaml_file(path) == {"a": {"b": 1}, "c": [1, 2]}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[" * 100_000, "its lists or mappings nest deeper than the YAML reader recurses"),
        ("a: [1, 2\n", "not valid YAML: "),
        ("a: " + "9" * 5000 + "\n", "not a value dapo reads: Exceeds the limit"),
    ],
    ids=["deep", "broken", "huge-int"],
)
def test_what_cannot_be_read_is_named(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(
        YamlFileError, match=f"^{re.escape(str(path))}: {re.escape(says[:20])}"
    ) as caught:
        read_yaml_file(path)
    assert says in str(caught.value)
    path.write_bytes(b"a: \xff\n")
    with pytest.raises(YamlFileError, match="c.yaml: not UTF-8 text"):
        read_yaml_file(path)


def test_load_config_refuses_an_alias_and_deep_nesting_naming_the_file(tmp_path: Path) -> None:
    """``dapo train --resume`` (the run's config.yaml), ``--config`` and ``dapo eval --config``
    all read a file through load_config; a recipe's hardware through read_hardware."""
    path = tmp_path / "config.yaml"
    path.write_text(f"rollout:\n  stop_token_ids: {_laughs()}\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: line 2: a YAML alias"):
        load_config(path)
    path.write_text(f"hardware: {{gpus: 0, memory_gib: 8}}\nx: {_laughs()}\n")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: line 2: a YAML alias"):
        read_hardware(path)
    path.write_text("rollout:\n  stop_token_ids: " + "[" * 100_000 + "\n")
    with pytest.raises(
        ValueError, match=f"^{re.escape(str(path))}: its lists or mappings nest deeper"
    ):
        load_config(path)
    path.write_text(dump_yaml(load_config(None)))  # what dapo writes reads as it did
    assert load_config(path) == load_config(None, base="demo")


def test_a_value_in_an_error_is_shown_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"train": {"steps": list(range(20_000))}}))
    with pytest.raises(ValueError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith("train.steps: expected int, got [0, 1, 2, 3,")
    assert message.endswith(", 19998, 19999] (128890 characters) (list)")
    assert len(message) < 300
    assert clipped_repr([1, 2]) == "[1, 2]" and clipped_repr("a" * 198) == repr("a" * 198)
    path.write_text(yaml.safe_dump({"train": {"x" * 1_000_000: 1}}))  # a key, not a value
    with pytest.raises(ValueError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith("unknown config key 'train.xxx") and len(message) < 2000
    assert "(1000008 characters); train has " in message


def _run_with_checkpoint(root: Path, model, tokenizer) -> Path:
    """A run directory holding one whole checkpoint of the tiny model (what export reads)."""
    run = root / "run"
    run.mkdir()
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint.save(
        run, step=1, model=model, tokenizer=tokenizer, optimizer=optimizer, trainer_state={}, keep=1
    )
    return run


def test_export_refuses_an_alias_in_the_runs_config(tmp_path: Path, tiny_model, tokenizer):
    run = _run_with_checkpoint(tmp_path, tiny_model, tokenizer)
    config = run / "config.yaml"
    config.write_text(f"rollout:\n  stop_token_ids: {_laughs()}\n")
    with pytest.raises(ValueError) as caught:
        exporting.export(run, tmp_path / "out", log=lambda m: None)
    assert str(caught.value).startswith(f"{config}: unreadable (line 2: a YAML alias (*a0): ")
    assert not (tmp_path / "out").exists()
    config.write_text(yaml.safe_dump({"rollout": {"stop_token_ids": [-1] * 20_000}}))
    with pytest.raises(ValueError) as caught:
        exporting.export(run, tmp_path / "out", log=lambda m: None)
    message = str(caught.value)
    assert message.startswith(f"{config}: rollout.stop_token_ids=[-1, -1,")
    assert message.endswith("-1, -1] (80000 characters)") and len(message) < 400
    for value, shown in [(7, "7"), ("7", "'7'"), ([True], "[True]"), ({"a": 1}, "{'a': 1}")]:
        config.write_text(yaml.safe_dump({"rollout": {"stop_token_ids": value}}))
        with pytest.raises(ValueError, match=re.escape(f"rollout.stop_token_ids={shown}")):
            exporting.export(run, tmp_path / "out", log=lambda m: None)
    assert not (tmp_path / "out").exists()
