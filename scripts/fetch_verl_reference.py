"""Fetch verl's reference verifiers for tests/test_math_dapo.py, without installing verl.

    python scripts/fetch_verl_reference.py [DIR]   # default: .verl-reference/

Writes ``math_dapo-0.4.1.py`` (the DAPO era's rules: the default ``dapo`` reward) and
``math_dapo-0.9.1.py`` (``math_dapo_boxed``), each the ``verl/utils/reward_score/math_dapo.py``
of that verl wheel, downloaded with ``pip download --no-deps`` and read from the archive: none
of verl's training stack is installed, and the tests read each file alone. Files already
there are kept.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSIONS = ("0.4.1", "0.9.1")
MEMBER = "verl/utils/reward_score/math_dapo.py"


def fetch(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for version in VERSIONS:
        dest = out / f"math_dapo-{version}.py"
        if dest.is_file():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
                + [f"verl=={version}", "-d", tmp],
                check=True,
            )
            wheel = next(Path(tmp).glob(f"verl-{version}-*.whl"))
            with zipfile.ZipFile(wheel) as archive:
                dest.write_bytes(archive.read(MEMBER))
        print(f"wrote {dest}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", nargs="?", type=Path, default=Path(".verl-reference"))
    fetch(parser.parse_args().dir)
