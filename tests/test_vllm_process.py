"""What dapo undoes or explains around vLLM's start, without vLLM: the error of a CPU
tensor-parallel group whose shared memory a dead process left behind."""

from __future__ import annotations

import pytest

from dapo.rollout.vllm_process import shared_memory_checked

VLLM_ERROR = "create shm in SHMManager failed. errno: 17"


def test_a_stale_segment_is_named_with_the_fix(tmp_path):
    for name in ("-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "psm_other"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(RuntimeError) as caught:
        with shared_memory_checked(str(tmp_path)):
            raise RuntimeError(VLLM_ERROR)
    message = str(caught.value)
    first, second = (f"{tmp_path}/-tp:0-[0-1]-cpushm_{r}" for r in (0, 1))
    assert f"Segments found: {first}, {second}. If no other vLLM runs" in message
    assert f"remove them (rm -- '{first}' '{second}') and start again." in message
    assert "psm_other" not in message and str(caught.value.__cause__) == VLLM_ERROR


def test_without_a_stale_file_it_says_so(tmp_path):
    with pytest.raises(
        RuntimeError,
        match=r"Segments found: none of yours in .*\. If no other .* remove them and start",
    ):
        with shared_memory_checked(str(tmp_path)):
            raise RuntimeError(VLLM_ERROR)


@pytest.mark.parametrize(
    "error",
    [RuntimeError("mmap in SHMManager failed. errno: 12"), ValueError(VLLM_ERROR)],
)
def test_other_errors_pass_unchanged(tmp_path, error):
    with pytest.raises(type(error)) as caught:
        with shared_memory_checked(str(tmp_path)):
            raise error
    assert caught.value is error


def test_a_segment_removed_while_the_group_started_is_explained():
    lost = RuntimeError("open shm in SHMManager failed. errno: 2")
    with pytest.raises(RuntimeError, match=r"a vLLM run on this machine ended at that moment"):
        with shared_memory_checked():
            raise lost
