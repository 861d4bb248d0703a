"""Build the docs site and take headless-Chromium screenshots of its pages, to look at how
tables, code blocks and the reference render (``mkdocs build --strict`` checks links, not
looks).

    python scripts/site_screenshots.py --out /tmp/shots                     # the default pages
    python scripts/site_screenshots.py --out /tmp/shots reference/config guides/gpus --width 1024

Needs ``chromium`` (Debian: ``apt-get install chromium``) and the docs extra.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("", "getting-started", "reference/config", "reference/cli", "guides/gpus")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", default=PAGES, help="site paths (default: a few)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNGs")
    parser.add_argument("--width", type=int, default=1280, help="window width (default 1280)")
    parser.add_argument("--height", type=int, default=1400, help="window height (default 1400)")
    args = parser.parse_args(argv)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("no chromium on PATH (Debian: apt-get install chromium)")
    site = Path(tempfile.mkdtemp(prefix="dapo-site-"))
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = ["mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)]
    subprocess.run(build, cwd=ROOT, env=env, check=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for page in args.pages:
        png = args.out / f"{page.replace('/', '-') or 'index'}.png"
        shot = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        shot += [f"--window-size={args.width},{args.height}", f"--screenshot={png}"]
        subprocess.run(
            [*shot, (site / page / "index.html").as_uri()], capture_output=True, timeout=120
        )
        print(png if png.is_file() else f"{page}: no screenshot", file=sys.stderr)
    shutil.rmtree(site, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
