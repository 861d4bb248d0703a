"""The documentation: generated reference pages match the code, every config field is
documented, every page of the site's navigation exists, and the README is a front page whose
two commands are the ones CI runs.

``mkdocs build --strict`` itself (broken links and anchors) runs in ``.ci/run``, where the
``docs`` extra is installed.
"""

import dataclasses
import re
from pathlib import Path

import yaml
from helpers import load_script

from dapo.config import Config
from dapo.config.sections import key_of

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
INSTALL_AND_RUN = 'pip install torch==2.13.0 && pip install -e ".[test]" && dapo train'
TEST_COMMAND = "python -m pytest -q -n auto"


def _generator():
    return load_script("scripts/gen_reference.py")


def test_generated_reference_pages_match_the_code():
    stale = _generator().stale_pages()
    assert not stale, (
        f"stale: {', '.join(stale)}; run `python scripts/gen_reference.py`\n"
        + "\n".join(stale.values())
    )


def test_a_default_of_zero_is_shown_in_the_cli_reference():
    # 0 == False: a membership test against (None, False, ...) left these cells blank.
    cli = _generator().render_cli()
    make = cli.split("## dapo data make", 1)[1].split("\n#", 1)[0]
    assert "| `--seed SEED` | `0` |" in make and "| `--skip SKIP` | `0` |" in make
    evaluate = cli.split("## dapo eval", 1)[1].split("\n#", 1)[0]
    assert "| `--num-problems NUM_PROBLEMS` | `0` |" in evaluate
    assert "| `--overwrite` |  |" in cli  # a flag's False default is still left blank


def test_every_config_field_appears_in_the_docs():
    text = "\n".join(p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md"))
    config = Config()
    keys = [
        f"{section.name}.{key_of(f.name)}"  # env.class, held in EnvConfig.class_
        for section in dataclasses.fields(config)
        for f in dataclasses.fields(getattr(config, section.name))
    ]
    assert len(keys) >= 100
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, f"config fields nowhere under docs/: {missing}"


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_pages(v)]
    return [p for item in nav for p in _nav_pages(item)]


def test_every_page_of_the_site_exists_and_every_page_is_in_the_nav():
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = _nav_pages(site["nav"])
    assert [p for p in pages if not (DOCS / p).is_file()] == []
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk


def test_the_readme_is_a_front_page_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert INSTALL_AND_RUN in text and TEST_COMMAND in text
    # CI runs exactly the README's test command.
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(rf"^{re.escape(TEST_COMMAND)}$", ci, flags=re.MULTILINE)
    # Every link of the README into docs/ points at a page that exists.
    targets = re.findall(r"\]\((docs/[^)#\s]+)", text)
    assert targets and [t for t in targets if not (ROOT / t).exists()] == []


def test_the_fields_a_resume_may_change_are_listed_in_troubleshooting():
    """The page listed "the three dist.* fields" where the code had seven, and left out
    run.deterministic, reward.batch_timeout_s and rollout.tp_size."""
    from dapo.config.loading import RESUME_SAFE_FIELDS

    page = (DOCS / "troubleshooting.md").read_text()
    start = page.index("These fields may change without `--force`:")
    listed = set(re.findall(r"`([a-z_]+\.[a-z_0-9]+)`", page[start : page.index("\n\n", start)]))
    assert listed == set(RESUME_SAFE_FIELDS)
