"""What the trainers say when a generator rank (``dist.rollout_ranks``) fails, dies or stalls,
in one process: a failed draw travels as its error and is raised as the generator thread's
trainer raises it; a receive that fails names the generator rank, the step awaited and
``dist.wait_timeout_s``; a stop signal whose save a failure cut short says so. The runs under
torchrun are in test_rollout_ranks.py."""

from __future__ import annotations

import io
import json
import os
import signal
from contextlib import nullcontext

import pytest
import torch

from dapo.dist import roles
from dapo.run.interrupt import GracefulStop, RunStopped, StepAborted
from dapo.training import exchange
from dapo.training.exchange import (
    GeneratorRankError,
    failed_draw,
    failure,
    receive_step,
)
from dapo.training.rollout_files import decode, encode
from dapo.training.sampling import DynamicSamplingExhausted, SamplingResult
from dapo.training.sources import StepRollouts

GLOO_TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms "
    "for recv operation to complete"
)
GLOO_CLOSED = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:29610"
)


@pytest.mark.parametrize(
    "said,why",
    [
        (GLOO_TIMEOUT, "none came within dist.wait_timeout_s"),
        (GLOO_CLOSED, "its connection closed (the rank ended, failed or was killed)"),
    ],
    ids=["stalled", "died"],
)
def test_a_lost_generator_rank_is_named_with_the_step_and_the_setting(monkeypatch, said, why):
    """The trainers' receive of step 3 (from 0: the log's step 4) from generator rank 2 fails:
    the error names the rank, the step and dist.wait_timeout_s with its value, and keeps
    gloo's error as its cause. It was gloo's RuntimeError alone, naming none of them."""
    asked = []

    def lost(src: int) -> torch.Tensor:
        asked.append(src)
        raise RuntimeError(said)

    monkeypatch.setattr(roles, "recv_bytes", lost)
    with pytest.raises(GeneratorRankError) as raised:
        receive_step(2, 3, 20.0)
    assert asked == [2]
    assert str(raised.value) == (
        f"generator rank 2 sent no rollouts for step 4: {why}. Look for that rank's own "
        "error in the job's log, if a rank wrote one; if they were still drawing, raise "
        "dist.wait_timeout_s (now 20 s)"
    )
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert str(raised.value.__cause__) == said
    # With 3 generators the first sends for them all: the one lost may be any (review r39).
    with pytest.raises(GeneratorRankError) as raised:
        receive_step(2, 3, 20.0, generators=3)
    assert str(raised.value).startswith(
        f"generator ranks 2-4 (rank 2 sends for them all) sent no rollouts for step 4: {why}. "
        "Look for those ranks' own errors in the job's log, if a rank wrote one;"
    )


@pytest.mark.parametrize(
    ("exc", "lost"),
    [
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error"), True),
        (RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting"), True),
        (torch.distributed.DistBackendError("NCCL communicator was aborted"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (DynamicSamplingExhausted("dynamic sampling: 3 of 8 groups after 1 rounds"), False),
        (ValueError("sampling.max_rounds must be at least 1"), False),
    ],
)
def test_a_lost_peer_is_told_from_a_failed_draw(exc, lost):
    """A generator whose collective with another generator fails re-raises (its traceback
    names the peer) instead of sending the trainers a failed draw (review r39)."""
    assert roles.lost_peer(exc) is lost


def test_a_received_step_is_passed_on_as_it_came(monkeypatch):
    message = torch.arange(4, dtype=torch.uint8)
    monkeypatch.setattr(roles, "recv_bytes", lambda src: message)
    assert receive_step(1, 0, 60.0) is message


def _failed(exc: Exception, step: int = 2) -> dict:
    """``exc`` raised, then sent as the failed draw of ``step``, and decoded by a trainer."""
    try:
        raise exc
    except Exception as caught:
        sent = failure(caught, step)
    empty = StepRollouts(step, 1, SamplingResult(groups=[]), {}, 0.0, 0.5)
    back, extra = decode(encode(empty, {"failed": sent, "sampler": {"pos": 8}, "prior": [3, 6]}))
    assert (back.step, back.version, back.result.generated) == (step, 1, [])
    assert (extra["sampler"], extra["prior"]) == ({"pos": 8}, [3, 6])
    return extra["failed"]


def test_a_failed_draw_is_raised_by_the_trainers_as_its_own_type_and_text(capsys):
    """Dynamic sampling giving up (and a ValueError, which the command line prints in one
    line) comes back as the same type and text, as the generator thread's trainer raises it:
    fit adds the resume to the first. The generator rank prints nothing of its own."""
    text = "dynamic sampling kept 1 of 4 groups after 1 rounds (6 prompts drawn): ..."
    sent = _failed(DynamicSamplingExhausted(text))
    assert sent == {"type": "DynamicSamplingExhausted", "message": text, "rank": 0, "step": 2}
    raised = failed_draw(sent)
    assert type(raised) is DynamicSamplingExhausted and str(raised) == text
    raised = failed_draw(_failed(ValueError("reward.function=x: no module 'x'")))
    assert type(raised) is ValueError and str(raised) == "reward.function=x: no module 'x'"
    assert capsys.readouterr().err == ""


def test_any_other_failed_draw_names_the_rank_and_step_and_leaves_its_traceback_there(capsys):
    sent = _failed(ZeroDivisionError("division by zero"), step=5)
    err = capsys.readouterr().err
    assert err.startswith(
        "dapo: generator rank 0: drawing step 6 failed; the trainers raise it when they reach "
        "that step:\nTraceback (most recent call last):"
    )
    assert err.rstrip().endswith("ZeroDivisionError: division by zero")
    raised = failed_draw(sent)
    assert type(raised) is GeneratorRankError
    assert str(raised) == (
        "generator rank 0 failed drawing the rollouts of step 6: ZeroDivisionError: division "
        "by zero (its traceback is in that rank's log)"
    )


def test_only_the_errors_that_name_their_fix_are_rebuilt():
    assert exchange.REBUILT == {
        "DynamicSamplingExhausted": DynamicSamplingExhausted,
        "ValueError": ValueError,
    }


# ----------------------------------------------------------------------------- a stop signal


NOTE = (
    "SIGTERM was received, but the run failed before it could stop after a save (its error "
    "follows): a resume starts from the last checkpoint written\n"
)


@pytest.mark.parametrize(
    "signalled,error,noted",
    [
        (True, RuntimeError("Connection closed by peer"), True),
        (False, RuntimeError("Connection closed by peer"), False),
        (True, RunStopped("stopped by SIGTERM after step 2 of 3; checkpoint saved.", 15), False),
        (True, StepAborted("SIGTERM"), False),
        (True, None, False),
    ],
    ids=["failed-after-a-signal", "failed", "stopped-after-the-save", "aborted", "ended"],
)
def test_a_failure_after_a_stop_signal_takes_back_the_save_it_promised(signalled, error, noted):
    """Under torchrun a trainer waiting for a generator rank that died gets torchrun's SIGTERM
    and printed that it would save a checkpoint, which its failure then prevented: it now says
    so. A stop that saved, a second signal's abort and a run that ends add nothing."""
    stream = io.StringIO()
    with pytest.raises(type(error)) if error else nullcontext():
        with GracefulStop(stream=stream):
            if signalled:
                os.kill(os.getpid(), signal.SIGTERM)
            if error is not None:
                raise error
    announced = "SIGTERM received: finishing this step, then saving a checkpoint"
    assert stream.getvalue().startswith(f"\n{announced}") == signalled
    assert stream.getvalue().endswith(NOTE) == noted
    assert stream.getvalue().count("was received, but") == noted


def test_a_message_of_no_episode_carries_no_tensor_in_its_safetensors_part():
    """A failed draw's message is a step of no episode: its tensors have no element, which
    safetensors 0.4.3 (the floor) cannot read back from bytes; they travel in the JSON."""
    from safetensors.torch import load as st_load

    from dapo.training.rollout_files import EMPTY_TENSORS

    empty = StepRollouts(4, 3, SamplingResult(groups=[]), {}, 0.0, 0.0)
    data = encode(empty, {"prior": [1, 2]}).numpy().tobytes()
    n = int.from_bytes(data[:8], "little")
    assert st_load(data[8 + n :]) == {}
    named = json.loads(data[8 : 8 + n])[EMPTY_TENSORS]
    assert named["prompt_ids_lengths"] == ["int64", [0]]
    assert len(named) == 6
    back, extra = decode(encode(empty, {"prior": [1, 2]}))
    assert (back.step, back.version, back.result.groups, extra) == (4, 3, [], {"prior": [1, 2]})
    forged = data[8 : 8 + n].replace(b'"int64", [0]', b'"int64", [3]')
    buffer = bytearray(len(forged).to_bytes(8, "little") + forged + data[8 + n :])
    with pytest.raises(ValueError, match="tensor 'prompt_ids_lengths' is not empty"):
        decode(torch.frombuffer(buffer, dtype=torch.uint8))
