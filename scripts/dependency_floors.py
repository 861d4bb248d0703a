"""Print the oldest versions ``pyproject.toml`` declares of the libraries the model code calls,
as pip requirements (``torch==2.13.0 transformers==4.56.0 ...``): what ``.ci/run-floors``
installs, so that a floor in ``pyproject.toml`` is always the version CI tests.

    python scripts/dependency_floors.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

FLOORED = ("torch", "transformers", "tokenizers", "safetensors")
"""The libraries whose oldest declared version CI runs the test suite with."""


def floors(pyproject: Path) -> dict[str, str]:
    """{name: oldest version} from ``name>=version`` in the project's dependencies."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    found = {}
    for dep in deps:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)(\s*,\s*<.*)?", dep.strip())
        if m and m.group(1) in FLOORED:
            found[m.group(1)] = m.group(2)
    missing = [name for name in FLOORED if name not in found]
    if missing:
        raise SystemExit(f"{pyproject}: no 'NAME>=VERSION' dependency for {', '.join(missing)}")
    return found


def main() -> int:
    found = floors(Path(__file__).resolve().parent.parent / "pyproject.toml")
    print(" ".join(f"{name}=={version}" for name, version in found.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
