"""dapo.dist: no-ops in one process, sums over ranks under a process group (2 gloo ranks)."""

from __future__ import annotations

import datetime
import time

import torch.distributed
import torch.multiprocessing as mp
from helpers import spawn_ranks

from dapo import dist


def test_one_process_is_world_size_one_and_sums_nothing():
    assert (dist.world_size(), dist.rank(), dist.is_main()) == (1, 0, True)
    assert dist.all_reduce_sum(7) == 7 and type(dist.all_reduce_sum(7)) is int
    assert dist.all_reduce_sum(0.25) == 0.25


def _rank_main(rank: int, port: int, out) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    try:
        # A mini-batch's token count: each rank holds part of it, every rank needs the whole.
        out.put(
            (rank, dist.world_size(), dist.rank(), dist.is_main(), dist.all_reduce_sum(3 + rank))
        )
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_agree_on_the_sum():
    out = mp.get_context("spawn").SimpleQueue()
    spawn_ranks(_rank_main, out)
    results = sorted(out.get() for _ in range(2))
    assert results == [(0, 2, 0, True, 7), (1, 2, 1, False, 7)]


def _two_ranks_with_long_waits(rank: int, port: int) -> None:
    """Rank ``rank`` of 2 gloo ranks whose collectives time out after 1 s, and whose long
    waits (dapo.dist.wait_for_all, patient collectives) after 60 s. The rendezvous waits
    60 s too: two spawned processes importing torch on a busy machine may start seconds
    apart, past a 1 s rendezvous (seen in CI: "1/2 clients joined")."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    torch.distributed.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1)
    )
    dist.join_long_waits(60.0)


def _waiting_rank(rank: int, port: int, out) -> None:
    _two_ranks_with_long_waits(rank, port)
    try:
        if rank == 0:
            time.sleep(3)  # rank 0 alone loads (or writes) the model, past the 1 s timeout
        start = time.monotonic()
        dist.wait_for_all()
        waited = time.monotonic() - start
        try:  # the training collectives keep their own, short timeout
            if rank == 1:
                dist.barrier()
            out.put((rank, waited, "ok"))
        except RuntimeError:
            out.put((rank, waited, "timed out"))
    finally:
        dist.shutdown()


def test_ranks_wait_for_rank_0_past_the_collective_timeout():
    out = mp.get_context("spawn").SimpleQueue()
    spawn_ranks(_waiting_rank, out)
    results = dict((rank, (waited, status)) for rank, waited, status in (out.get(), out.get()))
    assert results[1][0] > 2.5  # rank 1 waited the 3 s, far past the group's 1 s timeout
    assert results[1][1] == "timed out"  # while a plain barrier alone gives up after 1 s


def _patient_rank(rank: int, port: int, out) -> None:
    _two_ranks_with_long_waits(rank, port)
    try:
        if rank == 0:
            time.sleep(3)  # rank 0 alone writes, fsyncs and prunes a checkpoint
        out.put((rank, dist.broadcast("saved" if rank == 0 else None, patient=True)))
    finally:
        dist.shutdown()


def test_a_patient_broadcast_waits_for_rank_0s_solo_work():
    """After work rank 0 does alone (a checkpoint's files, its deletes), the others learn how
    it went through a broadcast that waits dist.wait_timeout_s, not the 1 s collective one."""
    out = mp.get_context("spawn").SimpleQueue()
    spawn_ranks(_patient_rank, out)
    assert dict((out.get(), out.get())) == {0: "saved", 1: "saved"}
