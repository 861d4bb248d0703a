"""Run hostile programs through the sandbox as the user this script runs as (a helper of
tests/test_sandbox.py and benchmarks/sandbox.py, started as an ordinary user by root).

Reads one JSON object from stdin, ``{"source": ..., "modes": [...], "audit": bool,
"wall_s": float, "cpu_s": float}``, runs the source once in each mode available here, and
prints ``{mode: {"returncode", "output", "timed_out", "elapsed_s"}}`` (output: stdout and
stderr, as latin-1 text). Standard library and ``dapo.reward`` only: the interpreter may be
the system's, with the repository on PYTHONPATH.
"""

import json
import sys

from dapo.reward.sandbox import SandboxLimits, available_modes, run_python


def main() -> None:
    job = json.load(sys.stdin)
    limits = SandboxLimits(wall_s=job["wall_s"], cpu_s=job["cpu_s"])
    results = {}
    for mode in [m for m in job["modes"] if m in available_modes()]:
        r = run_python(job["source"], mode=mode, limits=limits, audit=job["audit"])
        results[mode] = {
            "returncode": r.returncode,
            "output": (r.stdout + r.stderr).decode("latin-1"),
            "timed_out": r.timed_out,
            "elapsed_s": r.elapsed_s,
        }
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
