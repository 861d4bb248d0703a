"""The settings of an optimizer's parameter groups that a resumed run keeps from the optimizer
it built rather than from the checkpoint's (:func:`kernels_kept`): the one-process load
(:mod:`dapo.run.checkpoint`) and the sharded ones (:mod:`dapo.dist.dcp`) share it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def kernels_kept(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Loading an optimizer's state replaces its parameter groups with the saved ones, its
    implementation among them (AdamW's ``fused``, ``foreach``): a checkpoint written on a GPU
    would step a CPU run with the fused kernel, one written on a CPU a GPU run without it. The
    block's load keeps the implementation this process chose
    (:func:`dapo.training.state.adamw`) and the settings of this run's config (a resume with
    ``--force optim.beta1=...`` steps with them, as its config.yaml says: :data:`CONFIG_KEYS`),
    and each step counter goes where that implementation keeps it: on the parameter's device
    for the fused kernel, on the host otherwise."""
    kept = [
        {k: group.get(k) for k in KERNEL_KEYS} | {k: group[k] for k in CONFIG_KEYS if k in group}
        for group in optimizer.param_groups
    ]
    yield
    for group, kernel in zip(optimizer.param_groups, kept, strict=True):
        group.update(kernel)
        on_device = bool(kernel["fused"] or group.get("capturable"))
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor):
                where = param.device if on_device else torch.device("cpu")
                optimizer.state[param]["step"] = step.to(dtype=torch.float32, device=where)


KERNEL_KEYS = ("fused", "foreach")
"""An optimizer's parameter-group settings that pick its implementation, not its maths."""
CONFIG_KEYS = ("betas", "weight_decay")
"""Its settings that the config sets (``optim.*``; the learning rate is set at every step)."""
