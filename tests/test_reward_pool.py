"""Tests for dapo.reward.pool: verifier faults cost one response, never the run."""

from __future__ import annotations

import os
import sys
import time
import types

import faulty_verifiers
import pytest

from dapo.reward import tasks
from dapo.reward.pool import FAULT_KINDS, FAULT_SCORE, Fault, Job, RewardPool
from dapo.reward.tasks.base import Score
from dapo.reward.tasks.math_dapo import math_score
from dapo.reward.worker import CappedText

# Deadline for the misbehaving verifiers; the grade() calls that meet one must
# return in well under HUNG_CALL_LIMIT_S.
TIMEOUT_S = 0.5
HUNG_CALL_LIMIT_S = 3.0

REAL = [
    Job("math_dapo", "5 * 7 = 35, minus 1.\nAnswer: 34", "34"),
    Job("math_dapo", "So the total is\nAnswer: $\\boxed{1,000}$.", "1000"),
    Job("math_dapo", "I could not finish.", "3"),
    Job("arith", "12 + 30 = 42\nAnswer: 42", "42"),
    Job("arith", "Answer: 41", "42"),
    Job("math_dapo", "x" * 5000 + "\nAnswer: 7", "7"),
    Job("math_dapo", "Answer: 90^\\circ", "90"),
    Job("math_dapo", "", "0"),
    Job("math_dapo", "Answer: 12\nAnswer: 13", "13"),
    Job("arith", "Answer: +5", "5"),
    Job("math_dapo", "Answer: ３４", "34"),
    Job("math_dapo", "Answer:   \n", "1"),
    Job("arith", "the answer: -17", "-17"),
]


def ok_jobs(n: int) -> list[Job]:
    """n jobs for the "ok" verifier (math_score), alternating right and wrong."""
    return [Job("ok", f"step {i}\nAnswer: {i}", str(i if i % 2 else i + 1)) for i in range(n)]


def expected(jobs: list[Job]) -> list[Score]:
    """Each job graded in-process by its verifier: the registered task's, or "ok"'s."""

    def verifier(source: str):
        return math_score if source == "ok" else tasks.get_verifier(source)

    return [verifier(job.data_source)(job.response, job.answer) for job in jobs]


def with_bad(n: int, bad: dict[int, str]) -> list[Job]:
    """n "ok" jobs with the verifier at each index in ``bad`` swapped for a faulty one."""
    jobs = ok_jobs(n)
    for index, verifier in bad.items():
        jobs[index] = Job(verifier, f"response {index}", "1")
    return jobs


def assert_others_graded(jobs: list[Job], scores: list[Score], faulted: set[int]) -> None:
    assert len(scores) == len(jobs)
    for index, (job, score) in enumerate(zip(jobs, scores, strict=True)):
        if index in faulted:
            assert score == FAULT_SCORE
        else:
            assert score == math_score(job.response, job.answer), index


def pid_of(score: Score) -> int:
    """The worker pid reported by the "probe" verifier."""
    return int(score.pred.split()[0])


def is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def pool(workers: int = 1, **kwargs) -> RewardPool:
    kwargs.setdefault("timeout_s", TIMEOUT_S)
    return RewardPool(workers=workers, resolve=faulty_verifiers.resolve, **kwargs)


# --- the normal case ----------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_real_responses_match_math_score(workers):
    jobs = REAL * 2  # 26 jobs: uneven chunks over 2 workers
    with RewardPool(workers=workers) as reward_pool:
        first = reward_pool.grade(jobs)
        second = reward_pool.grade(jobs[:5])
    assert first.scores == expected(jobs)
    assert first.faults == []
    assert second.scores == expected(jobs[:5])
    assert second.faults == []


def test_empty_batch():
    with pool(workers=2) as reward_pool:
        result = reward_pool.grade([])
    assert result.scores == [] and result.faults == []


def test_workers_can_import_test_verifiers_and_do_not_load_torch():
    # conftest imported torch in this process; a worker must not have it.
    assert "torch" in sys.modules
    with pool(workers=2) as reward_pool:
        scores = reward_pool.grade([Job("probe", "", ""), Job("probe", "", "")]).scores
    pids = {pid_of(score) for score in scores}
    assert len(pids) == 2 and os.getpid() not in pids
    assert [score.pred.split()[1] for score in scores] == ["False", "False"]


# --- faults in workers --------------------------------------------------------------------


def test_raise_is_an_error_fault_naming_the_exception():
    jobs = with_bad(7, {3: "raise"})
    with pool(workers=2) as reward_pool:
        result = reward_pool.grade(jobs)
    assert [(f.index, f.kind) for f in result.faults] == [(3, "error")]
    detail = result.faults[0].detail
    assert detail.startswith("verifier 'raise' raised ValueError: cannot grade 'response 3'")
    assert "\n" not in detail and "second line" in detail
    assert_others_graded(jobs, result.scores, {3})


def test_fault_detail_is_one_bounded_line():
    jobs = with_bad(3, {1: "raise_long"})
    with pool(workers=1) as reward_pool:
        result = reward_pool.grade(jobs)
    (fault,) = result.faults
    assert fault.kind == "error" and "ValueError: xxx" in fault.detail
    assert len(fault.detail) <= 300 and fault.detail.endswith("...")
    assert_others_graded(jobs, result.scores, {1})


@pytest.mark.parametrize("verifier", ["hang", "sleep"])
def test_hang_times_out_and_a_replacement_grades_the_rest_of_the_chunk(verifier):
    # One worker, so the hung job sits mid-chunk with jobs after it.
    jobs = [Job("probe", "", ""), *with_bad(5, {2: verifier}), Job("probe", "", "")]
    with pool(workers=1) as reward_pool:
        reward_pool.grade(ok_jobs(2))  # start-up is not what we time
        start = time.monotonic()
        result = reward_pool.grade(jobs)
        elapsed = time.monotonic() - start
        assert elapsed < HUNG_CALL_LIMIT_S
        assert result.faults == [
            Fault(index=3, kind="timeout", detail=f"verifier {verifier!r} ran past 0.5 s")
        ]
        assert_others_graded(jobs[1:-1], result.scores[1:-1], {2})
        hung_pid, replacement_pid = pid_of(result.scores[0]), pid_of(result.scores[-1])
        assert hung_pid != replacement_pid
        assert is_gone(hung_pid)
        # The pool is still usable, on the replacement worker.
        again = reward_pool.grade([*ok_jobs(3), Job("probe", "", "")])
        assert again.faults == []
        assert again.scores[:3] == expected(ok_jobs(3))
        assert pid_of(again.scores[3]) == replacement_pid


def test_hangs_in_several_chunks_cost_about_one_timeout_each():
    jobs = with_bad(10, {1: "hang", 3: "sleep", 7: "hang"})  # chunks [0..4] and [5..9]
    with pool(workers=2) as reward_pool:
        reward_pool.grade(ok_jobs(4))
        start = time.monotonic()
        result = reward_pool.grade(jobs)
        elapsed = time.monotonic() - start
    assert [(f.index, f.kind) for f in result.faults] == [
        (1, "timeout"),
        (3, "timeout"),
        (7, "timeout"),
    ]
    # Chunk 0 meets two deadlines in a row; chunk 1 waits out its one in parallel.
    assert elapsed < 2 * TIMEOUT_S + 2.5
    assert_others_graded(jobs, result.scores, {1, 3, 7})


def test_runaway_allocation_is_a_memory_fault():
    # On Linux RLIMIT_AS makes the mmap behind each 50 MB bytes object fail once
    # the worker would pass its limit, so CPython raises MemoryError inside the
    # verifier: "memory", not "crash". The pages are calloc'ed and never touched,
    # so resident memory stays small and the OOM killer has no reason to act.
    jobs = [Job("probe", "", ""), *with_bad(4, {1: "hog"}), Job("probe", "", "")]
    with pool(workers=1, memory_mb=400) as reward_pool:
        result = reward_pool.grade(jobs)
        assert result.faults == [
            Fault(index=2, kind="memory", detail="verifier 'hog' raised MemoryError")
        ]
        assert_others_graded(jobs[1:-1], result.scores[1:-1], {1})
        # A worker that ran out of memory is replaced, whatever it kept allocated.
        assert pid_of(result.scores[0]) != pid_of(result.scores[-1])
        assert reward_pool.grade(ok_jobs(3)).scores == expected(ok_jobs(3))


@pytest.mark.parametrize(
    ("verifier", "how"), [("exit", "exit code 3"), ("segfault", "killed by SIGSEGV")]
)
def test_dead_worker_is_a_crash_fault(verifier, how):
    jobs = with_bad(6, {1: verifier, 4: verifier})
    with pool(workers=2) as reward_pool:
        result = reward_pool.grade(jobs)
        assert result.faults == [
            Fault(
                index=i, kind="crash", detail=f"worker grading verifier {verifier!r} died ({how})"
            )
            for i in (1, 4)
        ]
        assert_others_graded(jobs, result.scores, {1, 4})
        assert reward_pool.grade(ok_jobs(5)).scores == expected(ok_jobs(5))


@pytest.mark.parametrize(
    ("verifier", "detail"),
    [
        ("notascore", "verifier 'notascore' returned float, not Score"),
        ("nan", "verifier 'nan' returned a malformed Score: ValueError: score is nan"),
        ("sys_exit", "verifier 'sys_exit' raised SystemExit: 0"),
        ("recurse", "verifier 'recurse' raised RecursionError: maximum recursion depth exceeded"),
        ("unknown", "verifier 'unknown' raised ValueError: no verifier 'unknown'"),
        # Bytes to a text stream: the verifier's TypeError, not a worker crash.
        (
            "bytes_out",
            "verifier 'bytes_out' raised TypeError: write() argument must be str, not bytes",
        ),
        # A verdict must be a bool: "False" is truthy and would be graded correct.
        (
            "str_correct",
            "verifier 'str_correct' returned a malformed Score: "
            "TypeError: correct is str, not bool",
        ),
        # maj@k compares votes as text: a vote of 1 would never meet a vote of "1".
        (
            "int_vote",
            "verifier 'int_vote' returned a malformed Score: TypeError: vote is int, not str",
        ),
    ],
)
def test_bad_verdicts_are_error_faults(verifier, detail):
    jobs = with_bad(4, {2: verifier})
    with pool(workers=1) as reward_pool:
        result = reward_pool.grade(jobs)
    assert result.faults == [Fault(index=2, kind="error", detail=detail)]
    assert_others_graded(jobs, result.scores, {2})


@pytest.mark.parametrize("workers", [0, 1])
def test_a_numpy_bool_verdict_is_a_bool(workers):
    with pool(workers=workers) as reward_pool:
        result = reward_pool.grade([Job("numpy_correct", "x", "1")])
    assert result.faults == [] and result.scores == [Score(score=1.0, correct=True, pred="1")]
    assert type(result.scores[0].correct) is bool


def test_a_text_stream_refuses_bytes_as_a_real_one_does():
    sink = CappedText()
    with pytest.raises(TypeError, match="must be str, not bytes"):
        sink.write(b"raw")  # type: ignore[arg-type]
    sink.write("kept")
    assert sink.take() == ("kept", 0)


def test_unknown_data_source_with_the_real_registry():
    jobs = [REAL[0], Job("no_such_task", "Answer: 1", "1"), REAL[3]]
    with RewardPool(workers=1) as reward_pool:
        result = reward_pool.grade(jobs)
    (fault,) = result.faults
    assert (fault.index, fault.kind) == (1, "error")
    assert "no reward function for data_source 'no_such_task'" in fault.detail
    assert result.scores == [math_score(REAL[0].response, "34"), FAULT_SCORE, expected(REAL)[3]]


def test_long_pred_is_truncated():
    with pool(workers=1) as reward_pool:
        (score,) = reward_pool.grade([Job("long_pred", "", "")]).scores
    assert score == Score(score=-1.0, correct=False, pred="7" * 1000)


def test_spawn_fallback_works_too():
    # Where forkserver does not exist the pool uses spawn; children must still find
    # the test verifiers (sys.path travels with the process) and behave the same.
    jobs = with_bad(6, {1: "raise", 2: "hang", 4: "exit"})
    with pool(workers=2, start_method="spawn") as reward_pool:
        result = reward_pool.grade(jobs)
        assert [(f.index, f.kind) for f in result.faults] == [
            (1, "error"),
            (2, "timeout"),
            (4, "crash"),
        ]
        assert_others_graded(jobs, result.scores, {1, 2, 4})
        (probe,) = reward_pool.grade([Job("probe", "", "")]).scores
    assert probe.pred.endswith(" False")


# --- in-process mode ------------------------------------------------------------------------


def test_in_process_faults_never_escape():
    bad = {1: "raise", 2: "memory_error", 4: "recurse", 5: "notascore", 6: "nan", 8: "unknown"}
    bad[9] = "sys_exit"  # a verifier's sys.exit() is its fault, not the trainer's end
    jobs = with_bad(11, bad)
    with pool(workers=0) as reward_pool:
        result = reward_pool.grade(jobs)
    kinds = [(f.index, f.kind) for f in result.faults]
    assert kinds == [
        (1, "error"),
        (2, "memory"),
        (4, "error"),
        (5, "error"),
        (6, "error"),
        (8, "error"),
        (9, "error"),
    ]
    assert result.faults[0].detail.startswith("verifier 'raise' raised ValueError: cannot grade")
    assert result.faults[-1].detail == "verifier 'sys_exit' raised SystemExit: 0"
    assert result.faults[1].detail == "verifier 'memory_error' raised MemoryError"
    assert all(f.kind in FAULT_KINDS and "\n" not in f.detail for f in result.faults)
    assert_others_graded(jobs, result.scores, set(bad))


def test_in_process_and_worker_faults_agree():
    jobs = with_bad(7, {0: "raise", 2: "memory_error", 3: "notascore", 5: "recurse", 6: "sys_exit"})
    with pool(workers=0) as in_process, pool(workers=2) as workers:
        assert in_process.grade(jobs) == workers.grade(jobs)


def test_ctrl_c_while_grading_in_process_stops_the_caller():
    with pool(workers=0) as reward_pool, pytest.raises(KeyboardInterrupt):
        reward_pool.grade(with_bad(3, {1: "interrupt"}))


# --- lifecycle and configuration -----------------------------------------------------------


def test_close_is_idempotent_and_kills_the_workers():
    reward_pool = pool(workers=2)
    scores = reward_pool.grade([Job("probe", "", ""), Job("probe", "", "")]).scores
    pids = [pid_of(score) for score in scores]
    assert not any(is_gone(pid) for pid in pids)
    reward_pool.close()
    assert all(is_gone(pid) for pid in pids)
    reward_pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        reward_pool.grade(ok_jobs(1))


def test_context_manager_closes():
    with pool(workers=1) as reward_pool:
        (score,) = reward_pool.grade([Job("probe", "", "")]).scores
    assert is_gone(pid_of(score))


def test_resolve_that_cannot_be_pickled_is_rejected_up_front():
    with pytest.raises(ValueError, match="picklable"):
        RewardPool(workers=1, resolve=lambda data_source: math_score)
    RewardPool(workers=0, resolve=lambda data_source: math_score).close()  # never pickled


def test_worker_that_cannot_start_is_an_error_not_a_fault(monkeypatch):
    # Picklable here (found in sys.modules), unimportable in a fresh worker: a
    # setup error, which must be loud rather than fault every response.
    ghost = types.ModuleType("ghost_verifiers")

    def ghost_resolve(data_source):
        return math_score

    ghost_resolve.__module__ = ghost.__name__
    ghost_resolve.__qualname__ = "ghost_resolve"
    ghost.ghost_resolve = ghost_resolve
    monkeypatch.setitem(sys.modules, ghost.__name__, ghost)
    with RewardPool(workers=1, resolve=ghost_resolve) as reward_pool:
        with pytest.raises(RuntimeError, match="died while starting"):
            reward_pool.grade(ok_jobs(2))


@pytest.mark.parametrize(
    "kwargs", [{"workers": -1}, {"timeout_s": 0}, {"timeout_s": float("nan")}, {"memory_mb": -1}]
)
def test_invalid_settings(kwargs):
    with pytest.raises(ValueError):
        RewardPool(**kwargs)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_score_beyond_max_abs_is_a_fault_not_a_reward(workers):
    with pool(workers=workers) as reward_pool:
        result = reward_pool.grade([Job("huge", "r", "1"), *ok_jobs(1)])
    assert result.scores == [FAULT_SCORE, *expected(ok_jobs(1))]
    (fault,) = result.faults
    assert (fault.index, fault.kind) == (0, "out_of_bounds")
    assert "score 1e+200, beyond reward.max_abs=1e+06" in fault.detail
    with pool(workers=workers, max_abs=0.5) as reward_pool:  # the right answer's +1 too
        assert reward_pool.grade(ok_jobs(2)).faults[1].kind == "out_of_bounds"
    with pytest.raises(ValueError, match="max_abs must be > 0"):
        RewardPool(max_abs=0)


def test_grading_in_process_keeps_only_its_own_threads_output(capsys):
    """reward.workers=0 in a generator thread: what the main thread prints while a verifier
    runs reaches the console (a process-wide redirect swallowed it into the verifier's
    output), and the verifier's own print is still captured."""
    import threading

    from dapo.reward.worker import CappedText, captured

    started, release = threading.Event(), threading.Event()

    def grade():
        print("verifier")
        started.set()
        release.wait(10)
        return ("ok", 1.0, True, "1", None)

    sink = CappedText()
    thread = threading.Thread(target=captured, args=(sink, grade))
    thread.start()
    assert started.wait(10)
    print("step 3: loss 0.25")  # the main thread, meanwhile
    release.set()
    thread.join(10)
    assert sink.take()[0] == "verifier\n"
    assert capsys.readouterr().out == "step 3: loss 0.25\n"
    print("after")  # the streams are the originals again
    assert capsys.readouterr().out == "after\n"


@pytest.mark.parametrize("workers", [0, 1])
def test_what_verifiers_print_is_capped_and_counted_never_written_out(workers, capfd):
    from dapo.reward.jobs import MAX_SHOWN_OUTPUT
    from dapo.reward.worker import MAX_OUTPUT_CHARS

    with pool(workers=workers) as reward_pool:
        result = reward_pool.grade([Job("chatty", "r", "1")] * 3)
    assert [s.correct for s in result.scores] == [True] * 3 and result.faults == []
    printed = 3 * 10_001  # print adds a newline
    assert len(result.output) == MAX_SHOWN_OUTPUT and set(result.output) == {"x"}
    assert result.output_dropped == printed - MAX_SHOWN_OUTPUT
    assert MAX_OUTPUT_CHARS <= MAX_SHOWN_OUTPUT  # each response's cap, then the batch's
    out, err = capfd.readouterr()
    assert "x" * 100 not in out + err
    if workers:  # in-process, a descriptor write is the caller's own stdout
        assert "y" * 100 not in out + err


def _dead_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_stuck_in_a_verifier_die_with_a_trainer_killed_by_sigkill(tmp_path):
    """Nothing kills a hung worker once its pool's process is SIGKILLed (the OOM killer, a
    preemption): it spun at 100% CPU for good, its forkserver parent kept alive by it."""
    import signal
    import subprocess

    script = tmp_path / "owner.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import faulty_verifiers\n"
        "from dapo.reward.pool import Job, RewardPool\n"
        "if __name__ == '__main__':\n"
        "    pool = RewardPool(workers=2, timeout_s=120, resolve=faulty_verifiers.resolve)\n"
        "    probes = pool.grade([Job('probe', '', ''), Job('probe', '', '')]).scores\n"
        "    print(*(s.pred.split()[0] for s in probes), flush=True)\n"
        "    pool.grade([Job('hang', '', '1'), Job('hang', '', '1')])\n"
    )
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in owner.stdout.readline().split()]
    assert len(pids) == 2 and not any(_dead_or_zombie(pid) for pid in pids)
    time.sleep(1.0)  # both workers are in the verifier's loop by now
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 10
    while not all(_dead_or_zombie(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in pids if not _dead_or_zombie(pid)]
    for pid in alive:  # leave nothing spinning behind a failed assertion
        os.kill(pid, signal.SIGKILL)
    assert not alive


def test_a_worker_that_died_idle_is_replaced_without_faulting_the_next_batch():
    """The OOM killer took a worker between two batches: the next batch's first response was
    faulted as a crash that no verifier ever saw."""
    import signal

    with pool(workers=1) as reward_pool:
        (probe,) = reward_pool.grade([Job("probe", "", "")]).scores
        os.kill(pid_of(probe), signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not _dead_or_zombie(pid_of(probe)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # the forkserver reports the exit status
        jobs = ok_jobs(3)
        result = reward_pool.grade(jobs)
    assert result.faults == []
    assert_others_graded(jobs, result.scores, set())
