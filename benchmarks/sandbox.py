"""What the code task's sandbox costs per response, and what each isolation mode blocks.

    python benchmarks/sandbox.py [--n 30] [--json]

For each mode available here: the median wall time of grading one trivial correct response
(``grade_code``: the sandbox, the harness and the tests), of running ``pass`` in the sandbox
(``run_python``), and of a plain ``python -I -S -c pass`` of the same interpreter, without a
sandbox; the difference of the last two is the sandbox's own overhead. Then each hostile
program of ``tests/test_sandbox.py`` runs in each mode, first without the audit hook (the
isolation layers alone) and, where something got through, with it:

- ``blocked``: nothing got out with the layers alone;
- ``blocked by the hook``: only the audit hook stopped it;
- ``removed after the run``: the program wrote outside its working directory while it ran
  (seen from outside), and the cleanup deleted it;
- anything else names what got out even with the hook.

Progress goes to stderr; the tables (or, with ``--json``, one JSON object) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_sandbox import (  # noqa: E402  (the tests' programs and runner, not a copy)
    FAST,
    MARGIN_S,
    SYSTEM_PYTHON,
    Trap,
    as_ordinary_user,
)

from dapo.reward.sandbox import available_modes, kernel_layers, run_python  # noqa: E402
from dapo.reward.tasks.code import grade_code  # noqa: E402

CORRECT = "```python\ndef add(a, b):\n    return a + b\n```"
TRUTH = json.dumps({"entry_point": "add", "tests": "assert add(2, 3) == 5"})
EXIT_EARLY = "```python\ndef add(a, b):\n    return a + b\nimport os\nos._exit(0)\n```"


def overhead(mode: str, n: int) -> dict[str, float]:
    """Median milliseconds: grading a correct response, a sandboxed ``pass``, a plain one. The
    three take turns, so that a load on the machine weighs on each alike."""
    python = run_python("import sys; print(sys.executable)", mode=mode).stdout.decode().strip()
    plain = [python, "-I", "-S", "-c", "pass"]
    graded = grade_code(CORRECT, TRUTH, mode=mode)
    assert graded.correct, graded
    calls = {
        "grade_ms": lambda: grade_code(CORRECT, TRUTH, mode=mode),
        "sandboxed_pass_ms": lambda: run_python("pass", mode=mode),
        "plain_pass_ms": lambda: subprocess.run(plain, check=True),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(n):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    row = {name: 1000 * statistics.median(t) for name, t in times.items()}
    row["overhead_ms"] = row["sandboxed_pass_ms"] - row["plain_pass_ms"]
    return row


def _attempt(trap: Trap, name: str, source: str, mode: str, audit: bool) -> list[str]:
    """What got out of one run of a hostile program (empty: nothing)."""
    seen: set[Path] = set()
    done = threading.Event()

    def watch() -> None:  # files outside the working directory, while the program runs
        while not done.is_set():
            seen.update(p for p in trap.outside if p.exists())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = run_python(source, mode=mode, limits=FAST, audit=audit)
    done.set()
    watcher.join()
    got_out = trap.escaped(result.stdout + result.stderr)
    if result.elapsed_s > FAST.wall_s + MARGIN_S:
        got_out.append(f"ran {result.elapsed_s:.1f} s")
    if name == "8 GB allocation" and b"allocated" in result.stdout:
        got_out.append("allocated 8 GB")
    if name == "1 GB of output" and len(result.stdout) > FAST.output_bytes:
        got_out.append("unbounded output")
    if not got_out and seen:
        return ["removed after the run"]
    return got_out


def hostile(trap: Trap, modes: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """Each hostile program in each mode: what stopped it."""
    programs = trap.programs()
    programs["write outside"] += "import time\ntime.sleep(0.3)\n"  # long enough to be seen
    table: dict[str, dict[str, str]] = {}
    for name, source in programs.items():
        for mode in modes:
            print(f"{mode}: {name}", file=sys.stderr)
            got_out = _attempt(trap, name, source, mode, audit=False)
            if got_out and got_out != ["removed after the run"]:
                with_hook = _attempt(trap, name, source, mode, audit=True)
                cell = "blocked by the hook" if not with_hook else ", ".join(with_hook)
            else:
                cell = got_out[0] if got_out else "blocked"
            table.setdefault(name, {})[mode] = cell
    table["exit 0 before the tests"] = {
        mode: "graded wrong" if not grade_code(EXIT_EARLY, TRUTH, mode=mode).correct else "passed"
        for mode in modes
    }
    return table


def as_user(trap: Trap) -> dict[str, dict[str, str]]:
    """Each hostile program in each mode an ordinary user (uid 65534) has, the hook off, then
    on where something got out: the columns ``MODE, user``."""
    table: dict[str, dict[str, str]] = {}
    for name, source in trap.programs().items():
        print(f"ordinary user: {name}", file=sys.stderr)
        for mode, result in as_ordinary_user(source, audit=False).items():
            got_out = trap.escaped(result["output"].encode("latin-1"))
            if got_out:
                hooked = as_ordinary_user(source, audit=True).get(mode, {})
                again = trap.escaped(hooked.get("output", "").encode("latin-1"))
                cell = "blocked by the hook" if not again else ", ".join(again)
            else:
                cell = "blocked"
            table.setdefault(name, {})[f"{mode}, user"] = cell
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=30, help="responses timed per mode")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    modes = available_modes()
    costs = {}
    for mode in modes:
        print(f"{mode}: timing {args.n} responses", file=sys.stderr)
        costs[mode] = overhead(mode, args.n)
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        trap = Trap(Path(tmp), patch)
        try:
            table = hostile(trap, modes)
            if os.geteuid() == 0 and os.path.exists(SYSTEM_PYTHON):
                for name, cells in as_user(trap).items():
                    table.setdefault(name, {}).update(cells)
        finally:
            trap.close()
    inside = run_python("import sys; print(sys.executable, sys.version.split()[0])").stdout
    landlock, seccomp = kernel_layers()
    machine = (
        f"python {platform.python_version()}, {platform.machine()}, Linux {platform.release()}, "
        f"{os.cpu_count()} CPUs; the sandbox runs {inside.decode().strip()}; Landlock ABI "
        f"{landlock}, seccomp filter {'on' if seccomp else 'off'}; "
        f"{'root' if os.geteuid() == 0 else 'not root'}"
    )
    if args.json:
        print(json.dumps({"machine": machine, "overhead": costs, "hostile": table}, indent=2))
        return
    print("| mode | grading a correct response | sandboxed `pass` | plain `pass` | overhead |")
    print("|---|---|---|---|---|")
    for mode, row in costs.items():
        cells = [f"{row[k]:.1f} ms" for k in ("grade_ms", "sandboxed_pass_ms", "plain_pass_ms")]
        print(f"| {mode} | {' | '.join(cells)} | {row['overhead_ms']:.1f} ms |")
    print()
    columns = list(dict.fromkeys(c for row in table.values() for c in row))
    print(f"| hostile program | {' | '.join(columns)} |")
    print(f"|---|{'---|' * len(columns)}")
    for name, row in table.items():
        print(f"| {name} | {' | '.join(row.get(c, '-') for c in columns)} |")
    print()
    print(machine)


if __name__ == "__main__":
    main()
