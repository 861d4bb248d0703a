"""Config files and flags that were read silently otherwise (review 22): a key written twice
in a YAML file or a second ``--config`` dropped the first; YAML 1.1 read ``0612`` as octal;
a list for ``run.base`` was a TypeError; a 300-byte or NUL ``run.name`` failed only at mkdir;
a file of any size was parsed, and every one of its errors printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dapo import cli
from dapo.config import load_config, parse_override
from dapo.config.loading import read_hardware
from dapo.config.setup import MAX_NAME_BYTES
from dapo.config.validation import MAX_SHOWN_ERRORS
from dapo.config.yaml_files import MAX_FILE_BYTES, YamlFileError, read_yaml_file

ROOT = Path(__file__).resolve().parents[1]
REPEAT = "YAML keeps only the last, dropping the first silently: write it once"


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


# 1. A key written twice in one mapping


@pytest.mark.parametrize(
    ("text", "line", "where", "first"),
    [
        ("base: demo\noptim:\n  lr: 1e-5\noptim:\n  warmup_steps: 3\n", 4, "optim", 2),
        ("base: demo\noptim:\n  lr: 1e-5\n  lr: 2e-5\n", 4, "optim.lr", 3),
        ('base: demo\noptim:\n  lr: 1e-5\n  "lr": 2e-5\n', 4, "optim.lr", 3),  # as one key
        ("model:\n  lora: {rank: 8, alpha: 2, rank: 4}\n", 2, "model.lora.rank", 2),
        ("a:\n  - {b: 1}\n  - {b: 1, c: 2,\n     b: 3}\n", 4, "a[1].b", 3),
    ],
    ids=["section", "field", "quoted", "flow", "in-a-list"],
)
def test_a_key_written_twice_is_refused_naming_file_line_and_key(
    tmp_path: Path, text: str, line: int, where: str, first: int
) -> None:
    path = _file(tmp_path, text)
    said = f"{path}: line {line}: {where} is written twice (first on line {first}), and {REPEAT}"
    for read in (load_config, read_yaml_file, read_hardware):  # a config, a run's, a recipe's
        with pytest.raises(YamlFileError) as caught:
            read(path)
        assert str(caught.value) == f"{said} (merge the two into one)"


def test_the_recipes_hold_no_key_twice() -> None:
    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert len(recipes) >= 10
    for recipe in [*recipes, ROOT / "tests" / "data" / "config-0.1-demo.yaml"]:
        assert isinstance(read_yaml_file(recipe), dict), recipe


def test_a_key_written_twice_in_an_override_is_refused() -> None:
    with pytest.raises(ValueError) as caught:
        parse_override("model.lora={rank: 8, rank: 0}")
    assert str(caught.value) == (
        "model.lora.rank is written twice in '{rank: 8, rank: 0}'; write it once"
    )
    assert parse_override("model.lora={rank: 8, alpha: 4}") == (
        "model.lora",
        {"rank": 8, "alpha": 4},
    )


# 2. --config given twice


@pytest.mark.parametrize(
    "command",
    [["train"], ["bench"], ["ablate", "--plan", "table1"], ["eval", "embedded", "--data", "arith"]],
)
def test_a_second_config_is_refused(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.parse_args([*command, "--config", "a.yaml", "--config=b.yaml"])
    assert caught.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (
        f"dapo {command[0]}: error: argument --config: given twice (a.yaml and b.yaml): dapo "
        "reads one config file; merge the two into one, or set what the second changes as "
        "section.field=value overrides"
    )
    assert str(cli.parse_args([*command, "--config", "a.yaml"]).config) == "a.yaml"


# 3. A base or preset that is not a name


BASES, PRESETS = "('paper', 'demo')", "('dapo', 'grpo', 'dr_grpo', 'gspo', 'cispo')"


@pytest.mark.parametrize(
    ("file", "overrides", "said"),
    [
        (None, ["run.preset=[a]"], f"run.preset: unknown preset ['a']; choose one of {PRESETS}"),
        (None, ["run.base=[a]"], f"run.base: unknown base ['a']; choose one of {BASES}"),
        ("base: [demo]\n", [], f"run.base: unknown base ['demo']; choose one of {BASES}"),
        ("preset: {a: 1}\n", [], f"run.preset: unknown preset {{'a': 1}}; choose one of {PRESETS}"),
        ("run: {base: 0}\n", [], f"run.base: unknown base 0; choose one of {BASES}"),
        (None, ["run.base=nope"], f"run.base: unknown base 'nope'; choose one of {BASES}"),
    ],
)
def test_a_base_or_preset_that_is_not_a_name_is_refused(
    tmp_path: Path, file: str | None, overrides: list[str], said: str
) -> None:
    path = _file(tmp_path, file) if file is not None else None
    with pytest.raises(ValueError) as caught:
        load_config(path, overrides)
    assert str(caught.value) == said


# 4. run.name


def _name_errors(name: str) -> list[str]:
    with pytest.raises(ValueError) as caught:
        load_config(None, [f"run.name={name}"])
    return str(caught.value).splitlines()[1:]


def test_a_run_name_longer_than_a_directory_name_is_refused() -> None:
    assert MAX_NAME_BYTES == 236  # 255, less ".NAME.replaced-12345678" of --overwrite
    assert load_config(None, ["run.name=" + "a" * 236]).run.name == "a" * 236
    assert load_config(None, ["run.name=" + "é" * 118]).run.name == "é" * 118  # 236 bytes
    (error,) = _name_errors("é" * 119)
    assert error.startswith(
        "  run.name must be at most 236 bytes in UTF-8 (a file system takes 255, and "
        "--overwrite adds 19), got 238: 'éééé"
    )
    (error,) = _name_errors("a" * 300)
    assert "got 300: 'aaa" in error and len(error) < 300  # the name shown clipped


def test_a_nul_in_a_run_name_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as caught:
        load_config(_file(tmp_path, 'base: demo\nrun:\n  name: "a\\0b"\n'))
    assert str(caught.value) == (
        "invalid config:\n  run.name must not hold a NUL character, got 'a\\x00b'"
    )
    (error,) = _name_errors("a/b")  # refused as before
    assert error == (
        "  run.name must be one plain directory name (no '/', not '.' or '..'), got 'a/b'; put "
        "the parent directories in run.out_dir"
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("run.out_dir", "runs\0x"),
        ("model.path", "/models/m\0x"),
        ("model.revision", "ma\0in"),
        ("embedded.cache_dir", "~/.cache/d\0"),
        ("data.train_file", "t\0.jsonl"),
        ("data.val_file", "v\0.jsonl"),
        ("reward.function", "r\0.py:score"),
        ("env.class", "e\0.py:Env"),
    ],
)
def test_a_nul_in_a_path_field_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: str
) -> None:
    # Each passed validation and failed later as Python's bare "embedded null byte" (run.out_dir,
    # reward.function, env.class), or printed the NUL inside a "no such file" (the others).
    section, field = key.split(".")
    text = f'base: demo\n{section}:\n  {field}: "{value.replace(chr(0), chr(92) + "0")}"\n'
    shown = repr(value)
    with pytest.raises(ValueError) as caught:
        load_config(_file(tmp_path, text))
    lines = str(caught.value).splitlines()  # data.train_file: the other rules' lines too
    assert lines[0] == "invalid config:"
    assert f"  {key} must not hold a NUL character (no file system takes one), got {shown}" in lines
    assert cli.main(["train", "--dry-run", "run.base=demo", f"{key}={value}"]) == 2
    err = capsys.readouterr().err
    assert f"{key} must not hold a NUL character" in err and "embedded null byte" not in err


# 5. Numbers of a file as written


@pytest.mark.parametrize(
    ("text", "name"),
    [("0612", "0612"), ("12:30", "12:30"), ("1.50", "1.50"), ("1_000", "1_000"), ("7", "7")],
)
def test_a_text_field_keeps_a_number_as_written(tmp_path: Path, text: str, name: str) -> None:
    path = _file(tmp_path, f"base: demo\nrun:\n  name: {text}\nmodel:\n  revision: {text}\n")
    cfg = load_config(path)
    assert (cfg.run.name, cfg.model.revision) == (name, name)
    path = _file(tmp_path, f"base: demo\nmodel:\n  lora:\n    target_modules: [{text}, q_proj]\n")
    assert load_config(path).model.lora.target_modules == [name, "q_proj"]


@pytest.mark.parametrize(
    ("field", "text", "read"),
    [
        ("train.steps", "010", "octal, 8"),
        ("train.steps", "0x10", "hexadecimal, 16"),
        ("train.steps", "0b11", "binary, 3"),
        ("train.steps", "1:30", "base 60 (as a time, h:m:s), 90"),
        ("optim.lr", "010", "octal, 8"),
        ("optim.lr", "1:30.5", "base 60 (as a time, h:m:s), 90.5"),
        ("model.lora.rank", "-010", "octal, -8"),
    ],
)
def test_a_number_field_refuses_a_number_not_written_in_decimal(
    tmp_path: Path, field: str, text: str, read: str
) -> None:
    *sections, key = field.split(".")
    nested = "".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections))
    path = _file(tmp_path, f"base: demo\n{nested}{'  ' * len(sections)}{key}: {text}\n")
    with pytest.raises(ValueError) as caught:
        load_config(path)
    assert str(caught.value) == f"{field}: YAML reads {text} as {read}: write the number in decimal"


def test_decimal_numbers_of_a_file_read_as_before(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        "base: demo\ntrain:\n  steps: 1_000\noptim:\n  lr: 1.5e-4\n  warmup_steps: 0\n"
        "  grad_clip: 2\n  weight_decay: .5\nrollout:\n  stop_token_ids: [3, 0]\n",
    )
    cfg = load_config(path)
    assert (cfg.train.steps, cfg.optim.lr, cfg.optim.warmup_steps) == (1000, 1.5e-4, 0)
    assert (cfg.optim.grad_clip, cfg.optim.weight_decay) == (2.0, 0.5)
    assert type(cfg.optim.grad_clip) is float and type(cfg.train.steps) is int
    assert cfg.rollout.stop_token_ids == [3, 0]
    with pytest.raises(ValueError, match=r"^sampling.dynamic: expected bool, got 1 \(int\)$"):
        load_config(_file(tmp_path, "base: demo\nsampling:\n  dynamic: 1\n"))
    # Another reader of YAML files (dapo report, dapo export) sees numbers as YAML reads them.
    assert read_yaml_file(_file(tmp_path, "a: 010\nb: [0612]\n")) == {"a": 8, "b": [394]}


# 6. Size and errors bounded


def test_a_file_over_the_cap_is_refused_unread(tmp_path: Path) -> None:
    path = _file(tmp_path, "base: demo\n" + "#" * MAX_FILE_BYTES + "\n")
    with pytest.raises(YamlFileError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"{path}: larger than 1 MiB, the most dapo reads from a YAML file (a run's config.yaml "
        "is a few KiB): give the config file meant"
    )
    path.write_text("base: demo\n" + "#" * (MAX_FILE_BYTES - 12) + "\n")  # 1 MiB exactly
    assert path.stat().st_size == MAX_FILE_BYTES and load_config(path).run.base == "demo"


def test_at_most_so_many_errors_are_listed(tmp_path: Path) -> None:
    keys = "".join(f"  k{i}: 1\n" for i in range(MAX_SHOWN_ERRORS + 30))
    with pytest.raises(ValueError) as caught:
        load_config(_file(tmp_path, f"base: demo\noptim:\n{keys}"), ["train.steps=-1"])
    lines = str(caught.value).splitlines()
    assert lines[0] == "invalid config:" and len(lines) == 1 + MAX_SHOWN_ERRORS + 1
    assert re.fullmatch(r"  unknown config key 'optim.k0'; optim has beta1, .*", lines[1])
    assert lines[-1] == "  ... and 31 more"  # 30 keys and train.steps
