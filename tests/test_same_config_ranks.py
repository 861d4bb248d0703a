"""Every rank of a job must hold the same config: a node given other overrides trained its
shards at another learning rate (the run exited 0, its config.yaml naming rank 0's), or
waited on a collective the others never reached until a timeout that named nothing."""

import pytest
import torch
from helpers import spawn_ranks

from dapo.api.training import check_same_config
from dapo.config import load_config


def _rank(rank: int, port: int, overrides: dict[int, list[str]], out: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        check_same_config(load_config(None, overrides.get(rank, [])))
        message = "accepted"
    except ValueError as exc:
        message = str(exc)
    finally:
        torch.distributed.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        f.write(message)


@pytest.mark.parametrize(
    "overrides,says",
    [
        ({0: ["optim.lr=1e-3"], 1: ["optim.lr=1e-3"]}, "accepted"),
        (
            {1: ["optim.lr=0.1", "train.steps=3"]},
            "the job's ranks were started with different settings: rank 1: train.steps=3 "
            "(rank 0: 120), optim.lr=0.1 (rank 0: 0.0003). Every rank (on every node) must run "
            "the same command, with the same config file and overrides",
        ),
    ],
    ids=["same", "another-lr-and-steps"],
)
def test_ranks_with_different_configs_are_refused_on_every_rank(tmp_path, overrides, says):
    spawn_ranks(_rank, overrides, str(tmp_path / "said"))
    for rank in (0, 1):
        assert (tmp_path / f"said.{rank}").read_text() == says
