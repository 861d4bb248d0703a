"""``model.path`` as a Hugging Face Hub model id: resolved into a Hub cache that the tests lay out
as huggingface_hub does (refs, snapshots, blobs), offline, since this machine has no Hub."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import save_model
from test_hf_models import files, train_args  # noqa: F401 (a fixture)

from dapo.cli import main
from dapo.config import load_config
from dapo.models import hub
from dapo.models.policy import check_model_path, load_policy, load_tokenizer, model_dir


def lay_out(cache: Path, repo: str, model: Path, *, ref: str = "main") -> Path:
    """``model``'s files as the snapshot of ``repo`` under ``ref`` in the Hub cache ``cache``:
    each file a link to its blob, the ref naming the commit. Returns the snapshot."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}@{ref}".encode()).hexdigest()
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for f in sorted(model.iterdir()):
        blob = repo_dir / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture()
def offline_cache(tmp_path, monkeypatch):
    """An empty Hub cache, offline (what HF_HUB_CACHE and HF_HUB_OFFLINE=1 set)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_what_is_a_hub_id():
    for repo in ("Qwen/Qwen2.5-Math-1.5B", "gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert hub.looks_like_hub_id(repo), repo
    for path in ("./models/x", "/abs/model", "~/m", "a/b/c", "bad name/x", "x/.."):
        assert not hub.looks_like_hub_id(path), path


def test_a_hub_id_trains_from_the_cache_offline(tmp_path, files, offline_cache):  # noqa: F811
    snapshot = lay_out(offline_cache, "tiny-org/tiny-qwen", save_model(tmp_path / "m", "qwen2"))
    cfg = load_config(None, ["model.path=tiny-org/tiny-qwen"])
    assert model_dir(cfg) == snapshot == check_model_path(cfg)
    assert main(train_args(tmp_path, "tiny-org/tiny-qwen", files)) == 0
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    # The run records the id, not this machine's cache path: it resumes wherever the id does.
    assert "path: tiny-org/tiny-qwen" in (tmp_path / "r" / "config.yaml").read_text()


def test_the_policy_loaded_by_id_is_the_snapshots(tmp_path, offline_cache):
    saved = save_model(tmp_path / "m", "llama")
    lay_out(offline_cache, "org/tiny-llama", saved)
    by_id, _ = load_policy(load_config(None, ["model.path=org/tiny-llama", "model.device=cpu"]))
    by_dir, _ = load_policy(load_config(None, [f"model.path={saved}", "model.device=cpu"]))
    theirs = by_dir.state_dict()
    assert list(by_id.state_dict()) == list(theirs)
    for name, a in by_id.state_dict().items():
        assert torch.equal(a, theirs[name]), name


def test_a_revision_picks_its_snapshot(tmp_path, offline_cache):
    main_snap = lay_out(offline_cache, "org/m", save_model(tmp_path / "a", "qwen2"))
    tagged = lay_out(offline_cache, "org/m", save_model(tmp_path / "b", "llama"), ref="v1")
    assert model_dir(load_config(None, ["model.path=org/m"])) == main_snap
    assert model_dir(load_config(None, ["model.path=org/m", "model.revision=v1"])) == tagged
    by_commit = load_config(None, ["model.path=org/m", f"model.revision={tagged.name}"])
    assert model_dir(by_commit) == tagged


def test_a_model_missing_offline_names_the_id_and_the_fix(tmp_path, files, offline_cache, capsys):  # noqa: F811
    assert main(train_args(tmp_path, "org/absent-model", files)) == 2
    err = capsys.readouterr().err
    assert "model.path=org/absent-model: no such local directory" in err
    assert "HF_HUB_OFFLINE=1" in err and str(offline_cache) in err
    assert "hf download org/absent-model" in err
    assert f"a relative path is read from the working directory, {Path.cwd()}" in err
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="hf download org/absent-model --revision v2"):
        model_dir(load_config(None, ["model.path=org/absent-model", "model.revision=v2"]))


def test_a_revision_with_a_local_directory_is_refused(tmp_path):
    saved = save_model(tmp_path / "m", "qwen2")
    with pytest.raises(ValueError, match="model.revision=v1 is set, but model.path=.* is a local"):
        model_dir(load_config(None, [f"model.path={saved}", "model.revision=v1"]))


def test_a_download_fetches_only_safetensors_and_configs(tmp_path, monkeypatch):
    """Online, the id is fetched with huggingface_hub into its cache, without pickled
    weights or code (the download itself is huggingface_hub's, stood in for here)."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    calls = []
    saved = save_model(tmp_path / "m", "qwen2")

    def fetch(repo, **kwargs):
        calls.append((repo, kwargs))
        return str(lay_out(tmp_path / "hub", repo, saved))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    said = []
    path = hub.resolve("org/online", None, log=said.append)
    assert (path / "config.json").is_file()
    [(repo, kwargs)] = calls
    assert repo == "org/online" and kwargs["local_files_only"] is False
    patterns = kwargs["allow_patterns"]
    assert "*.safetensors" in patterns and "*.json" in patterns
    assert not any(p.endswith((".bin", ".py", ".pt", ".pth", ".pkl")) for p in patterns)
    assert said and "org/online" in said[0] and str(tmp_path / "hub") in said[0]
    hub.resolve("org/online", None, log=said.append)
    assert len(calls) == 1  # resolved once per process


def test_the_memory_plan_sizes_a_hub_id_without_downloading(tmp_path, offline_cache):
    from dapo.memory_plan import recipe_shape
    from dapo.training.model_shape import KNOWN_SHAPES, ModelShape

    cfg = load_config(None, ["model.path=Qwen/Qwen2.5-1.5B"])
    assert recipe_shape(cfg) == ModelShape.from_hf_config(KNOWN_SHAPES["qwen2.5-1.5b"])
    lay_out(offline_cache, "org/tiny", save_model(tmp_path / "m", "qwen2"))
    tiny = recipe_shape(load_config(None, ["model.path=org/tiny"]))
    assert tiny.hidden == 32 and tiny.layers == 2


def test_eval_and_data_check_take_a_hub_id(tmp_path, files, offline_cache, capsys):  # noqa: F811
    saved = save_model(tmp_path / "m", "qwen2")
    lay_out(offline_cache, "org/tiny", saved)
    args = ["--data", str(files[1]), "--k", "2"]
    args += ["--max-new-tokens", "4", "--resamples", "50", "--num-problems", "3"]
    assert main(["eval", "org/tiny", *args, "--out", str(tmp_path / "by-id")]) == 0
    assert main(["eval", str(saved), *args, "--out", str(tmp_path / "by-dir")]) == 0
    by_id = (tmp_path / "by-id" / "problems.jsonl").read_text()
    assert by_id == (tmp_path / "by-dir" / "problems.jsonl").read_text()
    capsys.readouterr()
    assert main(["data", "check", str(files[1]), "--tokenizer", "org/tiny"]) == 0
    assert "prompt tokens: min " in capsys.readouterr().out
    assert main(["eval", "org/absent", *args]) == 2
    assert "MODEL=org/absent: no such local directory" in capsys.readouterr().err


def test_a_download_brings_the_chat_templates(tmp_path, monkeypatch):
    """What recent transformers saves a chat template as (``chat_template.jinja``, more in
    ``additional_chat_templates/``) comes with the download, and the tokenizer renders with it;
    the download stand-in keeps only what ``allow_patterns`` matches, as huggingface_hub's."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import filter_repo_objects
    from transformers import AutoTokenizer

    from dapo.data.problems import Problem
    from dapo.data.prompts import render_prompt

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    saved = save_model(tmp_path / "m", "qwen2")
    (saved / "additional_chat_templates").mkdir()
    (saved / "additional_chat_templates" / "terse.jinja").write_text("{{ messages[0].content }}")
    (saved / "model.bin").write_bytes(b"pickled")
    assert (saved / "chat_template.jinja").is_file()

    def fetch(repo, *, allow_patterns, **kwargs):
        folder = tmp_path / "snapshot"
        names = [str(f.relative_to(saved)) for f in saved.rglob("*") if f.is_file()]
        for name in filter_repo_objects(names, allow_patterns=allow_patterns):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(saved / name, folder / name)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    path = hub.resolve("org/templated", None, log=lambda _: None)
    assert (path / "chat_template.jinja").is_file() and not (path / "model.bin").exists()
    got, want = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(saved)
    assert got.chat_template and got.chat_template == want.chat_template
    problem = Problem(uid="p", messages=({"role": "user", "content": "1+1?"},), answer="2")
    assert render_prompt(got, problem) == render_prompt(want, problem) != "1+1?"


def test_the_docs_download_what_dapo_downloads():
    docs = Path(__file__).parent.parent / "docs"
    commands = [
        line.strip()
        for page in docs.rglob("*.md")
        for line in page.read_text().splitlines()
        if line.startswith("hf download") and "--include" in line
    ]
    assert commands
    for command in commands:
        repo = command.split()[2]
        assert command == hub.download_command(repo), command


def test_a_tokenizer_without_a_chat_template_is_warned_of_once(tmp_path, files, capsys):  # noqa: F811
    saved = save_model(tmp_path / "m", "qwen2")
    (saved / "chat_template.jinja").unlink()
    assert main([*train_args(tmp_path, saved, files), "--dry-run"]) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if "chat template" in x]
    assert len(warned) == 1
    assert f"model.path={saved} has no chat template" in warned[0]
    assert "data.apply_chat_template=false" in warned[0]
    args = [*train_args(tmp_path, saved, files), "data.apply_chat_template=false", "--dry-run"]
    assert main(args) == 0
    assert "chat template" not in capsys.readouterr().err


def test_a_hub_model_cached_without_its_template_names_the_download(tmp_path, offline_cache):
    from dapo.training.inputs import missing_chat_template

    saved = save_model(tmp_path / "m", "qwen2")
    (saved / "chat_template.jinja").unlink()
    lay_out(offline_cache, "org/plain", saved, ref="v1")
    cfg = load_config(None, ["model.path=org/plain", "model.revision=v1"])
    warning = missing_chat_template(cfg, load_tokenizer(cfg))
    assert "model.path=org/plain (model.revision=v1) has no chat template" in warning
    assert hub.download_command("org/plain", "v1") in warning and "'*.jinja'" in warning
    with_template = save_model(tmp_path / "t", "qwen2")
    lay_out(offline_cache, "org/templated", with_template)
    cfg = load_config(None, ["model.path=org/templated"])
    assert missing_chat_template(cfg, load_tokenizer(cfg)) is None
