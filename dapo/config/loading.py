"""Loading a config: presets, a YAML file and dotted overrides, checked; and what a resume may
change.

Keys that moved since a run was saved (the embedded task's and model's fields left the core
``data`` and ``model`` sections) are read at their new place with a one-line notice, so the
``config.yaml`` of an earlier run, and the recipes, still load.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from dapo.config import presets
from dapo.config.sections import Config, attr_of, field_types, is_subsection, leaves

MOVED_KEYS = {
    "data.num_train": "arith.num_train",
    "data.num_val": "arith.num_val",
    "data.num_warmup": "arith.num_warmup",
    "data.min_terms": "arith.min_terms",
    "data.max_terms": "arith.max_terms",
    "data.operators": "arith.operators",
    "data.solution": "arith.solution",
    "data.seed": "arith.seed",
    "model.cache_dir": "embedded.cache_dir",
    "model.sft_steps": "embedded.sft_steps",
    "model.embedded_hidden": "embedded.hidden",
    "model.embedded_layers": "embedded.layers",
    # dtype cast the whole model, so AdamW stepped bf16 weights; compute_dtype keeps float32
    # weights and optimizer state and computes in it.
    "model.dtype": "model.compute_dtype",
}
"""Old key -> its place now (configs saved by dapo 0.1)."""

_announced: set[str] = set()  # moved keys already noticed in this process


def _coerce(value: Any, typ: Any, where: str, text: str | None = None) -> Any:
    """Check ``value`` against the field type; ints are accepted where floats are expected,
    and text that reads as a number (YAML 1.1's ``1e-5``) where floats are.

    ``text``: what was written on the command line, for a text field: YAML reads ``0612`` as
    an octal 394, ``12:30`` as 750 and ``2e91830`` (a revision) as a float; a name or a
    revision is the text as written.

    A ``Literal`` field takes a string here; whether it is one of the choices is checked with
    everything else in ``validate``, so that every bad value is reported at once.
    """
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        typ = next(a for a in args if a is not type(None))
    if typing.get_origin(typ) is Literal:
        typ = str
    if typ is str and text is not None and not isinstance(value, str | list | dict | None):
        return text  # a number, a bool or a date to YAML
    if typ is float and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if typing.get_origin(typ) is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list such as [1, 2], got {value!r}")
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
    raise ValueError(f"{where}: expected {name}, got {value!r} ({type(value).__name__})")


def set_value(cfg: Config, dotted: str, value: Any, text: str | None = None) -> None:
    """Set ``section.field`` (or ``section.subsection.field``) on ``cfg``; unknown names list
    what exists. A subsection takes a mapping of its fields (YAML's ``lora: {rank: 8}``).
    ``text``: the value as written on the command line (a text field keeps it)."""
    section_name, _, rest = dotted.partition(".")
    sections = [f.name for f in dataclasses.fields(cfg)]
    if section_name not in sections or not rest:
        raise ValueError(f"unknown config key {dotted!r}; sections are {', '.join(sections)}")
    owner, where = getattr(cfg, section_name), section_name
    names = rest.split(".")
    for i, name in enumerate(names):
        types_ = field_types(owner)
        if name not in types_:
            raise ValueError(
                f"unknown config key {dotted!r}; {where} has {', '.join(sorted(types_))}"
            )
        typ, last = types_[name], i == len(names) - 1
        if not is_subsection(typ):
            if not last:
                raise ValueError(f"unknown config key {dotted!r}: {where}.{name} has no fields")
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


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=v`` -> (``a.b``, v) with v read as a YAML scalar (1e-5, true, null, text)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"override {text!r} is not of the form section.field=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
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
                f"{where}: top-level key {section!r} must be a section mapping (e.g. "
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


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
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
    """Resolve base -> preset -> YAML file -> dotted overrides, then validate."""
    tree = _read_yaml(Path(path)) if path is not None else {}
    parsed = [parse_override(o) for o in overrides]
    written = [(k, v, _text(o)) for (k, v), o in zip(parsed, overrides, strict=True)]
    # base and preset shape everything else, so they are resolved first, from the most
    # specific source: flag, then dotted override, then the file (top level or run section).
    run_section = tree.get("run") if isinstance(tree.get("run"), dict) else {}
    file_base = tree.pop("base", None) or run_section.get("base")
    file_preset = tree.pop("preset", None) or run_section.get("preset")
    tree.pop("hardware", None)  # what a recipe is written for: read_hardware, not the run
    base = base or _pick(parsed, "run.base") or file_base
    base = base or ("paper" if path is not None else "demo")
    preset = preset or _pick(parsed, "run.preset") or file_preset or "dapo"
    if base not in presets.BASES:
        raise ValueError(f"run.base: unknown base {base!r}; choose one of {tuple(presets.BASES)}")
    if preset not in presets.ALGORITHMS:
        raise ValueError(
            f"run.preset: unknown preset {preset!r}; choose one of {tuple(presets.ALGORITHMS)}"
        )
    cfg = presets.ALGORITHMS[preset](presets.BASES[base](Config()))
    for key, value, text in _moved([(k, v, None) for k, v in _flatten(tree, str(path))] + written):
        if key not in ("run.base", "run.preset"):
            set_value(cfg, key, value, text)
    validate(cfg)
    return cfg


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A copy of ``cfg`` under dotted overrides (renamed keys followed, as load_config
    does), validated."""
    cfg = copy.deepcopy(cfg)
    for key, value, text in _moved([(*parse_override(o), _text(o)) for o in overrides]):
        set_value(cfg, key, value, text)
    validate(cfg)
    return cfg


def read_hardware(path: str | Path) -> dict[str, Any]:
    """A recipe's top-level ``hardware:`` mapping, checked: ``gpus`` (0 for a CPU) and
    ``gpu_gib`` per GPU, or ``memory_gib`` of host memory for a CPU recipe."""
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
        raise ValueError(f"{path}: hardware.gpus must be an integer >= 0, got {gpus!r}")
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
        raise ValueError(f"{path}: hardware.{need} must be a number > 0, got {size!r}")
    return {"gpus": gpus, need: float(size)}


def _pick(parsed: list[tuple[str, Any]], key: str) -> Any:
    values = [v for k, v in parsed if k == key]
    return values[-1] if values else None


def _choice_errors(name: str, section: Any) -> list[str]:
    """A field typed ``Literal[...]`` must hold one of its values (in subsections too)."""
    errors = []
    for key, typ in field_types(section).items():
        value = getattr(section, attr_of(key))
        if is_subsection(typ):
            errors += _choice_errors(f"{name}.{key}", value)
        elif typing.get_origin(typ) is Literal and value not in typing.get_args(typ):
            errors.append(f"{name}.{key} must be one of {typing.get_args(typ)}, got {value!r}")
    return errors


def _preset_errors(run: Any) -> list[str]:
    errors = []
    if run.preset not in presets.ALGORITHMS:
        errors.append(f"run.preset must be one of {tuple(presets.ALGORITHMS)}")
    if run.base not in presets.BASES:
        errors.append(f"run.base must be one of {tuple(presets.BASES)}")
    return errors


def validate(cfg: Config) -> None:
    """Reject values that cannot work, all at once, naming each field and what is allowed:
    each section's own checks, then the rules that span sections."""
    errors = []
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        errors += _choice_errors(f.name, section) + section.check()
        if f.name == "run":  # names of the presets (which set fields of every section)
            errors += _preset_errors(section)
    a, r, m = cfg.algo, cfg.rollout, cfg.model
    if a.overlong_shaping and not 0 < a.l_cache <= r.max_new_tokens:
        errors.append(
            f"algo.l_cache must be in (0, rollout.max_new_tokens={r.max_new_tokens}] when "
            f"algo.overlong_shaping is on, got {a.l_cache}"
        )
    if not (cfg.train.recompute_old_logprobs or m.param_dtype == m.compute_dtype == "float32"):
        errors.append(
            "train.recompute_old_logprobs=false needs model.param_dtype and model.compute_dtype "
            f"float32 (got {m.param_dtype}, {m.compute_dtype}): in bfloat16 or float16 the "
            "sampler's log-probs differ from a forward pass's; set "
            "train.recompute_old_logprobs=true"
        )
    k = cfg.train.async_staleness
    if k > 0 and r.engine != "dapo" and not cfg.dist.rollout_ranks:
        why = {
            "hf": "its sampling draws from torch's global generator, which evaluation shares",
            "vllm": "its weights live in vLLM, not in a copy the generator thread owns",
        }[r.engine]
        errors.append(
            f"train.async_staleness={k} generates in a thread beside training, and rollout."
            f"engine={r.engine} cannot ({why}): use rollout.engine=dapo, or "
            "train.async_staleness=0 (or generate on ranks of their own: dist.rollout_ranks)"
        )
    if m.param_dtype != "float32" and m.compute_dtype != m.param_dtype:
        errors.append(
            f"model.compute_dtype={m.compute_dtype} with model.param_dtype={m.param_dtype}: "
            "autocast computes in a dtype narrower than float32 weights, not wider or other "
            f"than the weights; set model.compute_dtype={m.param_dtype}"
        )
    if cfg.data.train_file and m.path == "embedded":
        errors.append(
            "data.train_file needs a real model: the embedded model only knows the arith "
            "task's words; set model.path to a Hugging Face model directory"
        )
    if errors:
        raise ValueError("invalid config:\n  " + "\n  ".join(errors))


def config_warnings(cfg: Config) -> list[str]:
    """Settings that work but cost what a user may not expect, one line each."""
    m = cfg.model
    if m.param_dtype == "float32" or m.lora.rank:  # LoRA's adapters stay float32
        return []
    return [
        f"model.param_dtype={m.param_dtype}: AdamW steps {m.param_dtype} weights, whose "
        "spacing is ~0.4% of their size, so small updates round away (at lr 1e-6 almost all "
        "do: one update on a tiny Qwen2 changed 2.6% of its bf16 weights). Keep "
        "param_dtype=float32 and set "
        f"compute_dtype={m.param_dtype} to compute in it."
    ]


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


# Fields a resume may change without changing the trajectory it continues: where things are
# written, how often, how long the run goes on, and how verifier processes are run.
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


def run_changing_differences(saved: Config, new: Config) -> list[str]:
    """``section.field: saved -> new`` for every difference that would change the run."""
    a, b = leaves(saved), leaves(new)
    return [
        f"{key}: {old!r} -> {b[key]!r}"
        for key, old in a.items()
        if key not in RESUME_SAFE_FIELDS and b[key] != old
    ]
