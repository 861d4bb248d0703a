"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025).

Where each technique lives:

- Clip-Higher, token-level loss, KL penalty: :mod:`dapo.algo.losses`
- group-relative advantage and the dynamic-sampling filter: :mod:`dapo.algo.groups`; the
  sampling loop itself: :mod:`dapo.training.sampling`
- soft overlong punishment, overlong filtering: :mod:`dapo.algo.shaping`, applied per group
  in :mod:`dapo.training.step`
- rule-based reward: :mod:`dapo.reward.tasks` (``math_dapo``), graded in
  :mod:`dapo.reward.pool`

One step is :func:`dapo.training.step.train_step` (its update phase :mod:`dapo.training.update`);
the loop around it is :func:`dapo.training.loop.fit`. ``docs/architecture.md`` shows the layers
of the package and draws the data flow.

The Python API (:mod:`dapo.api`, what the commands run) is here, loaded on first use so that
importing ``dapo`` (as every reward worker does) stays light: ``dapo.train``, ``dapo.evaluate``,
``dapo.export``, ``dapo.load_config``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"

__all__ = [
    "EvalResult",
    "ExportResult",
    "TrainResult",
    "__version__",
    "evaluate",
    "export",
    "load_config",
    "train",
]

_API = frozenset(
    {"EvalResult", "ExportResult", "TrainResult", "evaluate", "export", "load_config", "train"}
)


def __getattr__(name: str) -> Any:
    if name in _API:
        from dapo import api

        return getattr(api, name)
    raise AttributeError(f"module 'dapo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
