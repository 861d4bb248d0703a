"""A sharded checkpoint of an optimizer that has not stepped yet (a stop during the first
evaluation, or every update so far skipped) keeps it, and loads it, without state, as the
one-process checkpoint does: torch's ``get_state_dict`` and ``set_state_dict`` make one up
(a step of zero gradients at lr 0: AdamW's step 1, zero moments), which would shrink the
first real update to about 0.74x of the one-process run's, live and after a resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import spawn_ranks

from dapo import dist
from dapo.dist import dcp, fsdp

LR = 1e-2
BATCH = torch.arange(8.0).reshape(2, 4) / 8 - 0.3  # one process takes both rows, rank r row r


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])  # fsdp.shard's "decoder"
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _fresh(sharded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _Net()
    if sharded:
        fsdp.shard(model, compute_dtype=torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()  # the ranks' gradients are summed: the whole batch's
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a DTensor), or ``t``."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: _full(p) for k, p in model.named_parameters()}


def _moments(optimizer: torch.optim.Optimizer) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
    """Each parameter's (step, whole exp_avg, whole exp_avg_sq), in the parameters' order."""
    states = [optimizer.state[p] for g in optimizer.param_groups for p in g["params"]]
    return [(float(s["step"]), _full(s["exp_avg"]), _full(s["exp_avg_sq"])) for s in states]


def _sharded_rank(rank: int, port: int, out: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    dist.join_long_waits(60.0)
    try:
        torch.save(
            _save_update_load(Path(out), sharded=True, x=BATCH[rank : rank + 1]),
            Path(out) / f"rank_{rank}.pt",
        )
    finally:
        dist.shutdown()


def _save_update_load(out: Path, *, sharded: bool, x: torch.Tensor) -> dict:
    """Save before any step and update once; load that checkpoint, and a one-process one
    (:func:`dcp.load_full`), into fresh models and update each once; save the stepped
    optimizer and load it into another fresh one."""
    model, optimizer = _fresh(sharded)
    dcp.save(out / "unstepped", model, optimizer)
    result: dict = {"states_after_save": len(optimizer.state)}
    resumed, resumed_optimizer = _fresh(sharded)
    dcp.load(out / "unstepped", resumed, resumed_optimizer)
    result["states_after_load"] = len(resumed_optimizer.state)
    # A one-process checkpoint before the first step: whole weights, no optimizer state.
    full, full_optimizer = _fresh(sharded)
    one, one_optimizer = _fresh(sharded=False)
    dcp.load_full(full, full_optimizer, dict(one.state_dict()), one_optimizer.state_dict())
    result["states_after_load_full"] = len(full_optimizer.state)
    for net, opt in ((model, optimizer), (resumed, resumed_optimizer), (full, full_optimizer)):
        _update(net, opt, x)
    result["saved"], result["resumed"], result["full"] = (
        _whole(model),
        _whole(resumed),
        _whole(full),
    )
    dcp.save(out / "stepped", model, optimizer)  # a checkpoint with state still loads it
    again, again_optimizer = _fresh(sharded)
    dcp.load(out / "stepped", again, again_optimizer)
    result["moments"], result["loaded_moments"] = _moments(optimizer), _moments(again_optimizer)
    return result


def _one_process_first_update() -> dict[str, torch.Tensor]:
    model, optimizer = _fresh(sharded=False)
    _update(model, optimizer, BATCH)
    return _whole(model)


def _check(result: dict, expected: dict[str, torch.Tensor]) -> None:
    assert result["states_after_save"] == 0  # not AdamW's made-up step 1 and zero moments
    assert result["states_after_load"] == 0
    assert result["states_after_load_full"] == 0
    start = _whole(_Net())
    for run in ("saved", "resumed", "full"):
        for name, weight in result[run].items():
            torch.testing.assert_close(
                weight, expected[name], rtol=0, atol=1e-6, msg=f"{run} {name}"
            )
            # The first update of Adam moves each weight by lr (the bias correction of step 1).
            assert float((weight - start[name]).abs().max()) > 0.9 * LR, (run, name)
    assert [m[0] for m in result["moments"]] == [1.0] * 4  # one real step
    for (step, m, v), (loaded_step, loaded_m, loaded_v) in zip(
        result["moments"], result["loaded_moments"], strict=True
    ):
        assert loaded_step == step
        torch.testing.assert_close(loaded_m, m, rtol=0, atol=0)
        torch.testing.assert_close(loaded_v, v, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, intended
def test_a_checkpoint_before_the_first_step_keeps_the_optimizer_unstepped(tmp_path):
    expected = _one_process_first_update()
    _check(_save_update_load(tmp_path, sharded=False, x=BATCH), expected)


def test_a_sharded_checkpoint_before_the_first_step_keeps_the_optimizer_unstepped(tmp_path):
    expected = _one_process_first_update()
    spawn_ranks(_sharded_rank, str(tmp_path))
    for rank in range(2):
        _check(torch.load(tmp_path / f"rank_{rank}.pt", weights_only=True), expected)
