"""The plans of ``dapo ablate``: rows of config overrides, one row per configuration.

Pure and torch-free: a plan expands, and is tested, without running anything.

- ``table1``: the spec's cumulative chain (DAPO Table 1), from naive GRPO to DAPO, each row
  the previous one plus one technique. Two choices the table leaves open: soft overlong
  punishment replaces overlong filtering (DAPO keeps only the punishment), and the last row
  also drops the KL penalty, so that it is exactly the ``dapo`` preset.
- ``eps-high``: DAPO with epsilon_high in {0.20, 0.24, 0.28, 0.32, 0.36}, against 0.28.
- ``2x2``: clip-higher x dynamic sampling, everything else DAPO, against both on.
- ``successors``: DAPO, Dr. GRPO, GSPO and CISPO (their presets), against DAPO.
- ``async``: DAPO at ``train.async_staleness`` 0, 1 and 2, against 0.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One configuration of a plan."""

    name: str
    overrides: tuple[str, ...]
    """``section.field=value`` overrides that make it, applied first: the command's own come
    last, and one that would undo the plan is refused (:func:`check_extra`)."""
    compare_to: str | None = None
    """The row its paired difference is taken against (None: none)."""
    expect: int | None = None
    """The paper's sign of (this row - ``compare_to``): +1 better, -1 worse, None when the
    paper makes no claim about this pair. The verdict tests it."""
    paper: str = ""
    """What the paper measured for that difference, as printed beside the verdict."""


def table1() -> list[Row]:
    # Each technique's gain in the paper's Table 1: AIME 2024 avg@32 of Qwen2.5-32B.
    chain = [
        ("naive GRPO", ["run.preset=grpo"], ""),
        ("+ overlong filtering", ["algo.overlong_filter=true"], "+6 (30 to 36)"),
        ("+ clip-higher", ["algo.eps_high=0.28"], "+2 (36 to 38)"),
        (
            "+ soft overlong punishment",
            ["algo.overlong_filter=false", "algo.overlong_shaping=true"],
            "+3 (38 to 41)",
        ),
        ("+ token-level loss", ["algo.loss_agg=token-mean"], "+1 (41 to 42)"),
        (
            "+ dynamic sampling (= DAPO)",
            ["sampling.dynamic=true", "algo.kl_coef=0.0"],
            "+8 (42 to 50)",
        ),
    ]
    rows: list[Row] = []
    overrides: list[str] = []
    for name, extra, paper in chain:
        overrides = overrides + extra
        before = rows[-1].name if rows else None
        rows.append(Row(name, tuple(overrides), before, 1 if before else None, paper))
    return rows


def eps_high() -> list[Row]:
    values = ("0.20", "0.24", "0.28", "0.32", "0.36")
    # The paper's one claim here: 0.28 over the symmetric 0.20 (Clip-Higher, Table 1).
    return [
        Row(
            f"eps_high={v}",
            ("run.preset=dapo", f"algo.eps_high={v}"),
            _unless(v, "0.28"),
            -1 if v == "0.20" else None,
            "-2 (clip-higher's gain, Table 1)" if v == "0.20" else "",
        )
        for v in values
    ]


def _unless(value: str, base: str) -> str | None:
    """The eps-high row to compare with: 0.28's, except for 0.28 itself."""
    return None if value == base else f"eps_high={base}"


def two_by_two() -> list[Row]:
    rows = []
    for clip in (False, True):
        for dynamic in (False, True):
            on_off = ("on" if clip else "off", "on" if dynamic else "off")
            name = "clip-higher {}, dynamic sampling {}".format(*on_off)
            overrides = ["run.preset=dapo", f"sampling.dynamic={str(dynamic).lower()}"]
            if not clip:
                overrides.append("algo.eps_high=0.2")
            rows.append(Row(name, tuple(overrides)))
    # Both on is DAPO; the paper finds each technique helps, so every other cell is worse.
    best = rows[-1].name
    return [
        r if r.name == best else Row(r.name, r.overrides, best, -1, "each helps (Table 1)")
        for r in rows
    ]


def successors() -> list[Row]:
    names = {"dapo": "DAPO", "dr_grpo": "Dr. GRPO", "gspo": "GSPO", "cispo": "CISPO"}
    return [
        Row(label, (f"run.preset={preset}",), None if preset == "dapo" else "DAPO")
        for preset, label in names.items()
    ]


def async_staleness() -> list[Row]:
    """DAPO with generation and training in turn (0) and generation ahead by 1 and 2 updates,
    against 0: what the overlap buys in time and costs in accuracy."""
    return [
        Row(
            f"async_staleness={k}",
            ("run.preset=dapo", f"train.async_staleness={k}"),
            None if k == 0 else "async_staleness=0",
        )
        for k in (0, 1, 2)
    ]


PLANS = {
    "table1": table1,
    "eps-high": eps_high,
    "2x2": two_by_two,
    "successors": successors,
    "async": async_staleness,
}


def interaction_2x2() -> dict[str, float]:
    """The 2x2's interaction as weights on its rows: (both on) - (clip-higher only) -
    (dynamic sampling only) + (neither), how much more the two give together than apart."""
    off_off, off_on, on_off, on_on = (r.name for r in two_by_two())
    return {on_on: 1.0, on_off: -1.0, off_on: -1.0, off_off: 1.0}


CONTRASTS = {"2x2": ("interaction", interaction_2x2)}
"""Per plan, a named weighted sum of its rows reported below the table."""


@dataclass(frozen=True)
class Job:
    """One run of an ablation: a row at one seed."""

    row: Row
    seed: int
    name: str
    """Its run directory's name under the ablation's directory."""
    overrides: tuple[str, ...]


def slug(name: str) -> str:
    """A row name as a directory name: ``+ clip-higher`` -> ``clip-higher``."""
    kept = "".join(c if c.isalnum() or c in ".-" else "-" for c in name.lower())
    return "-".join(part for part in kept.split("-") if part)


UNCAPPED_STEPS = 1_000_000
"""``train.steps`` under a token or seconds budget: the budget, not the step count, ends a run."""


def parse_budget(budget: str | None) -> tuple[str, ...]:
    """A budget as overrides (None: the config's own ``train.steps``): ``steps=N`` rollout
    steps, ``tokens=N`` generated tokens (``train.max_gen_tokens``) or ``seconds=S`` of
    training steps (``train.max_seconds``); a run stops after the step that spends it."""
    if budget is None:
        return ()
    kind, _, value = budget.partition("=")
    how = "give steps=N, tokens=N (N >= 1) or seconds=S (S > 0)"
    if kind in ("steps", "tokens"):
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"--budget {budget!r}: {how}")
        if kind == "steps":
            return (f"train.steps={int(value)}",)
        return (f"train.max_gen_tokens={int(value)}", f"train.steps={UNCAPPED_STEPS}")
    if kind == "seconds":
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds < float("inf"):
            raise ValueError(f"--budget {budget!r}: {how}")
        return (f"train.max_seconds={seconds}", f"train.steps={UNCAPPED_STEPS}")
    raise ValueError(f"--budget {budget!r}: {how}")


def expand(plan: str, *, seeds: int, budget: str | None = None, extra: tuple[str, ...] = ()):
    """Every (row, seed) of ``plan`` as a :class:`Job`: the row's overrides, then the budget,
    then the seed (``train.seed``), then ``extra`` (the command's own overrides, last; one
    that would undo the plan is refused: :func:`check_extra`)."""
    if plan not in PLANS:
        raise ValueError(f"--plan {plan!r}: choose one of {', '.join(PLANS)}")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    limit = parse_budget(budget)
    rows = PLANS[plan]()
    check_extra(plan, rows, budget, extra)
    return [
        Job(
            row,
            seed,
            f"{slug(row.name)}-seed{seed}",
            (*row.overrides, *limit, f"train.seed={seed}", *extra),
        )
        for row in rows
        for seed in range(seeds)
    ]


def override_key(override: str) -> str:
    """The config key an override sets, as ``load_config`` reads it: spaces around it
    dropped, and a key renamed since dapo 0.1 at its new place."""
    from dapo.config import MOVED_KEYS

    key = override.partition("=")[0].strip()
    return MOVED_KEYS.get(key, key)


def check_extra(plan: str, rows: list[Row], budget: str | None, extra: tuple[str, ...]) -> None:
    """Refuse an override of ``extra`` that the plan's jobs set themselves: coming last, it
    would win over every row's own (rows alike, labelled apart), every seed (one run counted
    as many, and p-values from it) or the budget (a length other than ``--budget``'s).
    ``run.name`` and ``run.out_dir`` are the ablation's to set (each job's run directory):
    they would be dropped, so they are refused too."""
    varied = {override_key(o) for row in rows for o in row.overrides}
    for override in extra:
        key = override_key(override)
        if key == "train.seed":
            why = "each run's seed is its own (train.seed 0 to N-1 under --seeds N); drop it"
        elif key == "run.preset" or key in varied:
            why = (
                f"the plan's rows set {key} themselves, and an override for every run would "
                "make them one configuration under different names; drop it (to train one "
                "configuration alone, use dapo train)"
            )
        elif key in PLACE_KEYS:
            why = (
                "dapo ablate names each run <configuration>-seed<N> and puts it in the "
                "ablation's directory; drop it, and give --out DIR for where the runs go"
            )
        elif budget is not None and key in BUDGET_KEYS:
            why = f"--budget {budget} sets how long every run goes on; drop it, or change --budget"
        else:
            continue
        raise ValueError(f"dapo ablate --plan {plan}: the override {override!r}: {why}")


PLACE_KEYS = frozenset({"run.name", "run.out_dir"})
"""Where a run is written, which ``dapo ablate`` sets for each job (``--out``, the job's name)."""

BUDGET_KEYS = frozenset({"train.steps", "train.max_gen_tokens", "train.max_seconds"})
"""The fields a ``--budget`` is made of (:func:`parse_budget`); with one given, an override
of any of them would end the runs at another length than the budget's."""
