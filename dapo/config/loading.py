"""Loading a config: presets, a YAML file and dotted overrides, checked; and what a resume may
change.

Keys that moved since a run was saved (the embedded task's and model's fields left the core
``data`` and ``model`` sections) are read at their new place with a one-line notice, so the
``config.yaml`` of an earlier run, and the recipes, still load.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from dapo.config import presets
from dapo.config.file_values import file_number
from dapo.config.moved import MOVED_KEYS
from dapo.config.sections import Config, attr_of, did_you_mean, field_types, is_subsection, leaves
from dapo.config.validation import config_errors, invalid_config, validate
from dapo.config.validation import config_warnings as config_warnings
from dapo.config.yaml_files import WrittenNumber, clipped_repr, read_override_value, read_yaml_file

_announced: set[str] = set()  # moved keys already noticed in this process


def _coerce(value: Any, typ: Any, where: str, text: str | None = None) -> Any:
    """Check ``value`` against the field type; ints are accepted where floats are expected,
    and text that reads as a number (YAML 1.1's ``1e-5``) where floats are.

    ``text``: what was written on the command line, for a text or number field: YAML reads
    ``0612`` as an octal 394, ``12:30`` as 750 and ``2e91830`` (a revision) as a float; a name
    or a revision is the text as written, a number is read in decimal.

    A ``Literal`` field takes a string here; whether it is one of the choices is checked with
    everything else in ``validate``, so that every bad value is reported at once.
    """
    optional = False
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        optional = type(None) in args
        typ = next(a for a in args if a is not type(None))
    if typing.get_origin(typ) is Literal:
        typ = str
    if isinstance(value, WrittenNumber):  # a config file's number, with its text
        value = file_number(value, typ, where)
    if text is not None and typ in (str, int):
        return _as_written(value, text, typ, optional, where)
    if text is not None and typ is float and not (optional and text in _NULLS):
        text = text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
        with contextlib.suppress(ValueError):  # decimal, as written: 010 is 10.0, not octal 8
            return float(text)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and (isinstance(value, int) or ":" in text):  # 0x10, 1:30 (YAML's .inf: on)
            raise ValueError(f"{where}: write a decimal number, got {text!r}")
    if value is None and optional:
        return None
    if typ is float and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if typing.get_origin(typ) is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list such as [1, 2], got {clipped_repr(value)}")
        (item,) = typing.get_args(typ)
        return [_coerce(v, item, f"{where}[{k}]") for k, v in enumerate(value)]
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    name = getattr(typ, "__name__", str(typ))
    got = f"{clipped_repr(value)} ({type(value).__name__})"  # a file's value may be megabytes
    raise ValueError(f"{where}: expected {name}, got {got}")


_NULLS = ("null", "Null", "NULL", "~")
_DECIMAL = re.compile(r"[+-]?[0-9][0-9_]*")


def _as_written(value: Any, text: str, typ: type, optional: bool, where: str) -> Any:
    """A text or integer field's value from the command line's ``text``. YAML would cut text
    at `` #`` (a comment), read ``-`` as a list and ``a: b`` as a mapping, and read ``010`` as
    an octal 8 and ``1:30`` as 90: text is kept as written unless quoted (then YAML's reading
    of the quotes) or null on a field that may be None, and an integer is read in decimal."""
    if optional and text in _NULLS:
        return None
    if typ is int:
        if _DECIMAL.fullmatch(text):
            with contextlib.suppress(ValueError):  # 1__0: not a number
                return int(text)
        if isinstance(value, int) and not isinstance(value, bool):
            raise ValueError(f"{where}: write a decimal integer, got {text!r}")
        return _coerce(value, int, where)
    quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
    return value if quoted and isinstance(value, str) else text


def set_value(cfg: Config, dotted: str, value: Any, text: str | None = None) -> None:
    """Set ``section.field`` (or ``section.subsection.field``) on ``cfg``; unknown names list
    what exists. A subsection takes a mapping of its fields (YAML's ``lora: {rank: 8}``).
    ``text``: the value as written on the command line (a text field keeps it)."""
    section_name, _, rest = dotted.partition(".")
    shown = clipped_repr(dotted)  # a YAML file's key may be megabytes long
    sections = [f.name for f in dataclasses.fields(cfg)]
    if section_name not in sections or not rest:
        guess = did_you_mean(section_name, sections, "")
        raise ValueError(f"unknown config key {shown}; sections are {', '.join(sections)}{guess}")
    owner, where = getattr(cfg, section_name), section_name
    names = rest.split(".")
    for i, name in enumerate(names):
        types_ = field_types(owner)
        if name not in types_:
            listed, guess = ", ".join(sorted(types_)), did_you_mean(name, types_, f"{where}.")
            raise ValueError(f"unknown config key {shown}; {where} has {listed}{guess}")
        typ, last = types_[name], i == len(names) - 1
        if not is_subsection(typ):
            if not last:
                raise ValueError(f"unknown config key {shown}: {where}.{name} has no fields")
            setattr(owner, attr_of(name), _coerce(value, typ, dotted, text))
            return
        if last:
            if not isinstance(value, dict):
                fields = ", ".join(field_types(getattr(owner, attr_of(name))))
                raise ValueError(
                    f"{dotted}: a section of fields ({fields}); set one, e.g. "
                    f"{dotted}.{next(iter(field_types(getattr(owner, attr_of(name)))))}=..."
                )
            for key, item in value.items():
                set_value(cfg, f"{dotted}.{key}", item)
            return
        owner, where = getattr(owner, attr_of(name)), f"{where}.{name}"


def parse_override(text: str, *, numbers_as_written: bool = False) -> tuple[str, Any]:
    """``a.b=v`` -> (``a.b``, v) with v read as a YAML scalar (1e-5, true, null, text).
    ``numbers_as_written``: the numbers of a list or mapping are ``WrittenNumber``s, read as
    a config file's are (``load_config`` reads them so)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"override {text!r} is not of the form section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError):  # ValueError: an int past Python's digit limit
        value = raw  # as written: a text field keeps it, any other names itself
    if isinstance(value, dict | list):
        value = read_override_value(raw, key.strip(), numbers_as_written)
    # YAML 1.1 reads "1e-5" as a string; a float field wants the number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.strip(), value


def _text(override: str) -> str:
    """An override's value as written (``a.b=v``: ``v``, without surrounding spaces)."""
    return override.partition("=")[2].strip()


def _flatten(tree: dict[str, Any], where: str) -> list[tuple[str, Any]]:
    out = []
    for section, values in tree.items():
        if not isinstance(values, dict):
            raise ValueError(
                f"{where}: top-level key {clipped_repr(section)} must be a section mapping (e.g. "
                f"'optim: {{lr: 1e-6}}'), or one of base, preset"
            )
        out.extend((f"{section}.{k}", v) for k, v in values.items())
    return out


def _moved(items: list[tuple[str, Any, str | None]]) -> list[tuple[str, Any, str | None]]:
    """``items`` (key, value, text) with moved keys renamed; one line on stderr names the
    ones not yet noticed."""
    new = [m for m in dict.fromkeys(k for k, *_ in items if k in MOVED_KEYS) if m not in _announced]
    if new:
        _announced.update(new)
        pairs = ", ".join(f"{k} -> {MOVED_KEYS[k]}" for k in new)
        print(f"dapo: notice: config keys read at their new place: {pairs}", file=sys.stderr)
    return [(MOVED_KEYS.get(k, k), *rest) for k, *rest in items]


def saved_before_keys_moved(path: str | Path) -> bool:
    """Whether a config file uses keys of dapo 0.1 (a run saved by it)."""
    tree = _read_yaml(Path(path))
    tree.pop("base", None), tree.pop("preset", None)
    return any(key in MOVED_KEYS for key, _ in _flatten(tree, str(path)))


def _read_yaml(path: Path, numbers_as_written: bool = False) -> dict[str, Any]:
    try:  # aliases refused, every failure named (dapo.config.yaml_files)
        tree = read_yaml_file(path, numbers_as_written=numbers_as_written) or {}
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror}") from exc
    if not isinstance(tree, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections")
    return dict(tree)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    base: str | None = None,
    preset: str | None = None,
) -> Config:
    """Resolve base -> preset -> YAML file -> dotted overrides, then validate. A preset
    given here (``preset`` or a ``run.preset`` override) that differs from the file's is
    applied again after the file: its switches win over the file's."""
    tree = _read_yaml(Path(path), numbers_as_written=True) if path is not None else {}
    parsed = [parse_override(o, numbers_as_written=True) for o in overrides]
    written = [(k, v, _text(o)) for (k, v), o in zip(parsed, overrides, strict=True)]
    # base and preset shape everything else, so they are resolved first, from the most
    # specific source: flag, then dotted override, then the file (top level or run section).
    run_section = tree.get("run") if isinstance(tree.get("run"), dict) else {}
    file_base = tree.pop("base", None) or run_section.get("base")
    file_preset = tree.pop("preset", None) or run_section.get("preset")
    tree.pop("hardware", None)  # what a recipe is written for: read_hardware, not the run
    base = base or _pick(parsed, "run.base") or file_base
    base = base or ("paper" if path is not None else "demo")
    asked = preset or _pick(parsed, "run.preset")
    preset = asked or file_preset or "dapo"
    for field, name, names in (
        ("base", base, presets.BASES),
        ("preset", preset, presets.ALGORITHMS),
    ):
        if not isinstance(name, str) or name not in names:  # a list names none (nor hashes)
            raise ValueError(
                f"run.{field}: unknown {field} {clipped_repr(name)}; choose one of {tuple(names)}"
            )
    cfg = presets.ALGORITHMS[preset](presets.BASES[base](Config()))
    from_file = [(k, v, None) for k, v in _flatten(tree, str(path))]
    errors = _set_each(cfg, from_file)
    if asked and path is not None and asked != (file_preset or "dapo"):
        # An algorithm asked for over a file of another's: its switches win over the file's
        # (a recipe's eps_high 0.28 under --preset grpo was Clip-Higher in the GRPO run, and
        # a saved config.yaml, which lists every field, left nothing of the preset but its
        # name on --resume).
        presets.ALGORITHMS[preset](cfg)
    _validate_with(cfg, {**errors, **_set_each(cfg, written)})
    return cfg


def _set_each(cfg: Config, items: list[tuple[str, Any, str | None]]) -> dict[str, str]:
    """Set every (key, value, text) of ``items`` (renamed keys followed; base and preset are
    resolved already); the error of each key that cannot be set, to report with the rest."""
    errors = {}
    for key, value, text in _moved(items):
        if key not in ("run.base", "run.preset"):
            try:
                set_value(cfg, key, value, text)
            except ValueError as exc:
                errors[key] = str(exc)
    return errors


def _validate_with(cfg: Config, unset: dict[str, str]) -> None:
    """:func:`validate`, with the errors of values that could not be set (``unset``): every
    bad value at once (one alone keeps its own words). A check that names a field left unset
    is left out: it judged the default, not what was written."""
    if not unset:
        validate(cfg)
        return
    errors = list(unset.values())
    lines = [x.strip() for error in config_errors(cfg) for x in error.splitlines()]
    errors += [x for x in lines if not any(re.search(rf"\b{re.escape(k)}\b", x) for k in unset)]
    if len(errors) == 1:
        raise ValueError(errors[0])
    raise ValueError(invalid_config(errors))


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A copy of ``cfg`` under dotted overrides (renamed keys followed, as load_config
    does), validated."""
    cfg = copy.deepcopy(cfg)
    written = [(*parse_override(o, numbers_as_written=True), _text(o)) for o in overrides]
    _validate_with(cfg, _set_each(cfg, written))
    return cfg


def read_hardware(path: str | Path) -> dict[str, Any]:
    """A recipe's top-level ``hardware:`` mapping, checked: ``gpus`` (0 for a CPU) and
    ``gpu_gib`` per GPU, or ``memory_gib`` of host memory for a CPU recipe; optionally
    ``prompt_tokens``, the longest prompt its memory plan assumes (its data's)."""
    path = Path(path)
    hardware = _read_yaml(path).get("hardware")
    if not isinstance(hardware, dict):
        raise ValueError(
            f"{path}: no hardware: mapping; a recipe states what it is written for, e.g. "
            "hardware: {gpus: 8, gpu_gib: 80} (or {gpus: 0, memory_gib: 24} on a CPU)"
        )
    gpus = hardware.get("gpus")
    need = "gpu_gib" if gpus else "memory_gib"
    size = hardware.get(need)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 0:
        raise ValueError(f"{path}: hardware.gpus must be an integer >= 0, got {clipped_repr(gpus)}")
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise ValueError(f"{path}: hardware.{need} must be a number > 0, got {clipped_repr(size)}")
    read = {"gpus": gpus, need: float(size)}
    if "prompt_tokens" in hardware:
        n = hardware["prompt_tokens"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(
                f"{path}: hardware.prompt_tokens must be an integer >= 1, got {clipped_repr(n)}"
            )
        read["prompt_tokens"] = n
    return read


def _pick(parsed: list[tuple[str, Any]], key: str) -> Any:
    values = [v for k, v in parsed if k == key]
    return values[-1] if values else None


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# Fields a resume may change without changing the trajectory it continues: where things are
# written, how often, how long the run goes on, and how verifier processes are run. Two more
# conditions are checked once the run directory is open (dapo.training.resume): run.out_dir
# and run.name may only name the directory resumed (the run stays in it), and a train.steps
# below the checkpoint's step is refused; RESUME_INEXACT_FIELDS are warned of.
RESUME_SAFE_FIELDS = frozenset(
    {
        "run.out_dir",
        "run.name",
        "run.threads",
        "run.deterministic",
        "run.tensorboard",
        "run.progress",
        "run.wandb",
        "run.wandb_project",
        "embedded.cache_dir",
        "train.steps",
        "train.max_gen_tokens",
        "train.max_seconds",
        "train.save_every",
        "train.keep_checkpoints",
        "train.max_consecutive_skips",
        "eval.every",
        "reward.workers",
        "reward.timeout_s",
        "reward.memory_mb",
        "reward.batch_timeout_s",
        "reward.function_sha256",
        "dist.activation_checkpointing",
        "dist.cpu_offload",
        "dist.grad_sync",
        "dist.reshard_after_forward",
        "dist.rollout_ranks",  # the same schedule, on generator ranks or in a thread
        "dist.timeout_s",
        "dist.wait_timeout_s",
        "rollout.tp_size",
        "vllm.gpu_memory_utilization",
        "vllm.kv_cache_gib",
        "vllm.sleep",
    }
)


RESUME_INEXACT_FIELDS = {
    "run.threads": "CPU kernels then sum in another order",
    "rollout.tp_size": "the engine then splits its sums over another number of GPUs",
    "run.deterministic": "a GPU's kernels then sum in another order",
}
"""Fields of RESUME_SAFE_FIELDS that keep the run going but change its last bits, and why:
a resume that changes one warns that the run is no longer bit-identical to an uninterrupted
one."""


def run_changing_differences(saved: Config, new: Config) -> list[str]:
    """``section.field: saved -> new`` for every difference that would change the run, each
    config as a run settles it (:func:`dapo.config.local_paths.as_settled`)."""
    from dapo.config.local_paths import absolute_paths, as_settled

    a, b = leaves(absolute_paths(saved)), leaves(as_settled(new, saved))
    return [
        f"{key}: {old!r} -> {b[key]!r}"
        for key, old in a.items()
        if key not in RESUME_SAFE_FIELDS and b[key] != old
    ]
