"""A link in place of a lock file is refused in the words of the directory it locks: an
ablation's ``.dapo-ablate-lock`` names the ablation directory (it had the run directory's
"start the run in another directory"), a run's ``.dapo-lock`` keeps the run directory's."""

from __future__ import annotations

import pytest

from dapo.ablate.runs import ABLATION_LOCK, ablation_lock
from dapo.run.lock import LOCK_NAME, RunLock
from dapo.run.nofollow import LinkRefused


def test_a_link_for_the_ablation_lock_names_the_ablation_directory(tmp_path):
    out = tmp_path / "abl"
    out.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (out / ABLATION_LOCK).symlink_to(target)
    with pytest.raises(LinkRefused) as refused, ablation_lock(out):
        pass
    assert str(refused.value) == (
        f"{out / ABLATION_LOCK} is a symbolic link: dapo takes no lock through a link (it could "
        "lead to any file). Remove the link, or use another ablation directory"
    )
    assert target.read_text() == "keep me\n"  # nothing written through it


def test_a_link_for_a_runs_lock_keeps_the_run_directorys_words(tmp_path):
    (tmp_path / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(LinkRefused, match="start the run in another directory$"):
        RunLock(tmp_path).acquire()
    assert not (tmp_path / "elsewhere").exists()
