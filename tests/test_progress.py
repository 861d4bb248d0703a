"""Console output: a live display on a terminal, one plain line per step elsewhere (CI logs)."""

import io

from helpers import setup_run

from dapo.training import loop


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(tmp_path, tiny_model, tokenizer, stream, *overrides):
    cfg, train, val, run_dir, _ = setup_run(tmp_path, tiny_model, "train.steps=2", *overrides)
    loop.fit(cfg, tiny_model, tokenizer, train, val, run_dir=run_dir, stream=stream)
    return stream.getvalue()


def test_not_a_terminal_gives_one_plain_line_per_step(tmp_path, tiny_model, tokenizer):
    out = _run(tmp_path, tiny_model, tokenizer, io.StringIO())
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["0", "1", "2"]
    assert "\x1b[" not in out  # no terminal control codes in a log file


def test_a_terminal_gets_the_live_display(tmp_path, tiny_model, tokenizer):
    out = _run(tmp_path, tiny_model, tokenizer, FakeTerminal())
    assert "2/2" in out and "reward" in out and "acc" in out
    assert "held-out accuracy at start" in out and "held-out accuracy:" in out
    assert not any(line.startswith("step ") for line in out.splitlines())


def test_plain_progress_on_a_terminal(tmp_path, tiny_model, tokenizer):
    out = _run(tmp_path, tiny_model, tokenizer, FakeTerminal(), "run.progress=plain")
    assert sum(line.startswith("step ") for line in out.splitlines()) == 3
