"""Hand dapo careless and hostile input, area by area, and count what happened.

    python benchmarks/hostile_inputs.py

Every case runs in a scratch directory beside a tree of files dapo did not write; the table
says, per area, how many inputs were tried, how many were refused or named (an error that
names the file, row, field or run and the fix, never a traceback), whether any file outside
dapo's own runs was deleted, and whether any crafted file ran code. The security page of the
docs (docs/security.md) quotes the table; ``tests/test_hostile_inputs.py`` has a test per
kind of case.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from dapo import cli
from dapo.data.files import DataError, load_problems
from dapo.dist import dcp
from dapo.reward.tasks.math_dapo import math_score, math_score_boxed
from dapo.reward.tasks.math_lenient import lenient_score
from dapo.reward.tasks.math_verify import math_verify_score


class _RunsCode:
    def __init__(self, call: Callable, *args: object) -> None:
        self.call, self.args = call, args

    def __reduce__(self):
        return (self.call, self.args)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        yield err


def _refused(argv: list[str]) -> bool:
    """Whether ``dapo ARGV`` stopped with a one-line error (exit 2), not a traceback."""
    with _quiet() as err:
        code = cli.main(argv)
    return code == 2 and err.getvalue().startswith("dapo: error: ")


def run_directories(root: Path) -> tuple[int, int, int]:
    keep = root / "keep"
    (keep / "a" / "b").mkdir(parents=True)
    (keep / "a" / "b" / "notes.txt").write_text("mine")
    project = root / "myproject"
    project.mkdir()
    (project / "config.yaml").write_text("x: 1\n")
    (project / "thesis.tex").write_text("precious")
    (root / "link").symlink_to(keep)
    base = ["train", "--overwrite", f"run.out_dir={root}"]
    cases = [
        [*base, f"run.out_dir={keep}/a/b/c", f"run.name={name}", "model.path=/nonexistent"]
        for name in ("..", ".", "x/y", "/etc", "a\\b")
    ]
    cases += [
        [*base, "run.name=myproject", "model.path=/nonexistent"],
        [*base, "run.name=myproject"],  # every check passes; the mark is missing
        [*base, "run.name=link"],
        [*base, "run.name=keep"],  # not a run at all
    ]
    before = _snapshot(root)
    refused = sum(_refused(argv) for argv in cases)
    after = _snapshot(root)
    return len(cases), refused, sum(after.get(k) != v for k, v in before.items())


def _pickled_dcp(state: Path, payload: bytes) -> None:
    """DCP's own format, its .metadata listing a non-tensor item whose bytes are ``payload``,
    appended to a shard: what torch's default planner unpickles."""
    import torch.distributed.checkpoint as torch_dcp

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch_dcp.save(
        {"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=state
    )
    metadata = torch_dcp.FileSystemReader(str(state)).read_metadata()
    shard = next(state.glob("*.distcp"))
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(payload)
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("optim.param_groups"):
            info.offset, info.length = offset, len(payload)
    (state / ".metadata").write_bytes(pickle.dumps(metadata))


def checkpoints(root: Path) -> tuple[int, int, bool]:
    """Crafted DCP directories: pickles where dapo's format has none (a .metadata, a bytes
    item of a shard, a shard that is a pickle), shards outside the directory, garbled ones."""
    marker = root / "ran"
    payloads = [
        pickle.dumps(_RunsCode(open, str(marker), "w")),
        pickle.dumps(_RunsCode(os.system, f"touch {marker}")),
        pickle.dumps(_RunsCode(eval, f"open({str(marker)!r}, 'w')")),
        pickle.dumps(_RunsCode(exec, f"open({str(marker)!r}, 'w')")),
        pickle.dumps(_RunsCode(Path.touch, marker)),
    ]
    cases: list[Callable[[Path], None]] = []
    for payload in payloads:
        cases.append(lambda d, p=payload: _pickled_dcp(d, p))  # the bytes-item attack
        cases.append(lambda d, p=payload: (_dapo_dcp(d), (d / ".metadata").write_bytes(p)))
        cases.append(lambda d, p=payload: _replace_shard(d, p))  # a "shard" that is a pickle

    def outside(d: Path) -> None:
        _dapo_dcp(d)
        shard = next(d.glob("*.safetensors"))
        shard.rename(root / f"moved-{d.name}.safetensors")
        shard.symlink_to(root / f"moved-{d.name}.safetensors")

    def truncated(d: Path) -> None:
        _dapo_dcp(d)
        shard = next(d.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:40])

    cases += [outside, truncated, lambda d: _replace_shard(d, b"\x80\x04garbage")]
    refused = 0
    for i, make in enumerate(cases):
        state = root / f"state-{i}"
        make(state)
        fresh = torch.nn.Linear(3, 2)
        try:
            dcp.load(state, fresh, torch.optim.AdamW(fresh.parameters()))
        except dcp.UnsafeCheckpointError:
            refused += 1
    return len(cases), refused, marker.exists()


def _dapo_dcp(state: Path) -> None:
    model = torch.nn.Linear(3, 2)
    dcp.save(state, model, torch.optim.AdamW(model.parameters()))


def _replace_shard(state: Path, data: bytes) -> None:
    _dapo_dcp(state)
    next(state.glob("*.safetensors")).write_bytes(data)


def data_files(root: Path) -> tuple[int, int]:
    row = '{"prompt": [{"role": "user", "content": "%s"}], "reward_model": {"ground_truth": %s}}'
    bad_lines = [
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        (row % ("x", "9" * 5000)).encode(),
        (row % ("a \\ud800 b", '"1"')).encode(),
        (row % ("a \xff b", '"1"')).encode("latin-1"),
        (row % ("a" * (100 * 2**20), '"1"')).encode(),
        b"[1, 2, 3]",
        b'{"prompt": "x"}',
        (row % ("x", '""')).encode(),
        b"not json at all",
    ]
    good = (row % ("1+1?", '"2"')).encode()
    files = [good + b"\n" + line + b"\n" for line in bad_lines]
    files += [b"", b"\n\n"]
    named = 0
    for i, content in enumerate(files):
        path = root / f"bad{i}.jsonl"
        path.write_bytes(content)
        try:
            load_problems(path)
        except DataError as exc:
            named += str(exc).startswith(str(path))
    return len(files), named


def model_outputs() -> tuple[int, int, float]:
    hostile = [
        "$" * 10**6,
        "{" * 10**6 + "\\boxed{",
        "\\boxed{" * 10**5,
        "Answer: " + "9^{" * 2000,
        "Answer: \\frac{" * 5000,
        "\ud800" * 1000,
        "Answer: " + "1" * 10**6,
        "\x00" * 10**6,
    ]
    verifiers = (math_score, math_score_boxed, lenient_score, math_verify_score)
    bounded, slowest = 0, 0.0
    for text in hostile:
        for verify in verifiers:
            start = time.perf_counter()
            score = verify(text, "1")
            took = time.perf_counter() - start
            slowest = max(slowest, took)
            bounded += (not score.correct) and took < 2.0
    return len(hostile) * len(verifiers), bounded, slowest


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for area in ("runs", "ckpt", "data"):
            (root / area).mkdir()
        runs = run_directories(root / "runs")
        ckpt = checkpoints(root / "ckpt")
        data = data_files(root / "data")
        outputs = model_outputs()
    header = "| area | inputs tried | refused or named | others' files changed | ran code |"
    print(header)
    print("|---|---|---|---|---|")
    print(f"| run directories (--overwrite, run.name) | {runs[0]} | {runs[1]} | {runs[2]} | - |")
    ran = "yes" if ckpt[2] else "no"
    print(f"| checkpoint shards (DCP) | {ckpt[0]} | {ckpt[1]} | - | {ran} |")
    print(f"| data files (JSON Lines) | {data[0]} | {data[1]} | - | - |")
    print(
        f"| model outputs x 4 verifiers | {outputs[0]} | {outputs[1]} graded wrong in < 2 s "
        f"(slowest {outputs[2]:.2f} s) | - | - |"
    )
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
