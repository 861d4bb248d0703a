"""Checkpoints as a review found them wanting: a full disk that safetensors reports (no
OSError), optimizer settings changed with --force on resume, links where a run keeps its
checkpoints, a checkpoint altered at its size, and a generator or optimizer state that does
not fit."""

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from helpers import TINY_DEMO, spawn_ranks
from safetensors import SafetensorError
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from dapo import dist
from dapo.cli import main
from dapo.dist import dcp, fsdp
from dapo.models import policy
from dapo.models.demo import TinyModelSpec, tiny_qwen2
from dapo.run import checkpoint, manifest, sharded_checkpoint, state_files

SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2)
FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def _trained(tokenizer, **hyper):
    model = tiny_qwen2(tokenizer, SPEC, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **hyper)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(run_dir, model, tok, opt, step, save=checkpoint.save, **extra):
    state = {"sampler": {"epoch": 0, "pos": step}}
    return save(
        run_dir,
        step=step,
        model=model,
        tokenizer=tok,
        optimizer=opt,
        trainer_state=state,
        keep=3,
        **extra,
    )


def _full_disk(*args, **kwargs):
    raise SafetensorError(FULL)  # what safetensors raises on ENOSPC: no OSError


def _reseal(ckpt: Path) -> None:
    """The manifest written again over edited files: their digests then match."""
    (ckpt / manifest.MANIFEST).unlink()
    manifest.write(ckpt, checkpoint.FORMAT_VERSION, int(ckpt.name[5:]), None)


# ----------------------------------------------------------------------------- a full disk


def test_a_full_disk_that_safetensors_reports_names_the_intact_checkpoint(
    tmp_path, tokenizer, monkeypatch
):
    model, opt = _trained(tokenizer)
    _save(tmp_path, model, tokenizer, opt, step=1)
    monkeypatch.setattr(state_files, "save_file", _full_disk)
    with pytest.raises(checkpoint.CheckpointError) as err:
        _save(tmp_path, model, tokenizer, opt, step=2)
    assert str(err.value) == (
        f"could not write the checkpoint of step 2 under {tmp_path / 'checkpoints'}: the disk "
        f"is full; the previous checkpoint {tmp_path / 'checkpoints' / 'step_000001'} is "
        f"intact. Free space and resume with: dapo train --resume {tmp_path}"
    )
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000001"]  # no .tmp-step_000002-PID left behind


def test_a_full_disk_in_a_sharded_save_is_named_and_its_temporary_removed(
    tmp_path, tokenizer, monkeypatch
):
    model, opt = _trained(tokenizer)
    rollouts = {"ahead": torch.zeros(2)}
    _save(tmp_path, model, tokenizer, opt, 1, sharded_checkpoint.save, rollouts=rollouts)
    monkeypatch.setattr(sharded_checkpoint, "save_file", _full_disk)
    with pytest.raises(checkpoint.CheckpointError) as err:
        _save(tmp_path, model, tokenizer, opt, 2, sharded_checkpoint.save, rollouts=rollouts)
    assert str(err.value) == (
        f"could not write the checkpoint of step 2 under {tmp_path / 'checkpoints'}: the disk "
        f"is full; resume with: dapo train --resume {tmp_path}"
    )
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000001"]


def test_broken_weights_in_a_sharded_save_say_how_to_go_on(tmp_path, tokenizer):
    """Refused at a run's first save, it said to resume from a last checkpoint there was not."""
    model, opt = _trained(tokenizer)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.raises(checkpoint.CheckpointError) as err:
        _save(tmp_path, model, tokenizer, opt, 1, sharded_checkpoint.save)
    assert str(err.value).endswith(
        "It stopped before its first checkpoint, so there is nothing to resume: start it again "
        "with the same command, optim.lr=<lower> and --overwrite"
    )
    assert checkpoint.find_latest(tmp_path) is None


def test_a_full_disk_while_the_shards_are_written_is_named_and_its_temporary_removed(
    tmp_path, tokenizer, monkeypatch
):
    """DCP reports a rank's failure as a CheckpointException, a BaseException with every
    rank's traceback: it passed every handler, and .tmp-step_N-PID stayed."""

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    model, opt = _trained(tokenizer)
    _save(tmp_path, model, tokenizer, opt, 1, sharded_checkpoint.save)
    monkeypatch.setattr(HuggingFaceStorageWriter, "write_data", full)
    with pytest.raises(checkpoint.CheckpointError) as err:
        _save(tmp_path, model, tokenizer, opt, 2, sharded_checkpoint.save)
    assert str(err.value) == (
        f"could not write the checkpoint of step 2 under {tmp_path / 'checkpoints'}: the disk "
        f"is full; resume with: dapo train --resume {tmp_path}"
    )
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000001"]


def test_a_shard_that_cannot_be_read_is_named_with_the_fix(tmp_path, monkeypatch):
    """An I/O error while DCP read the shards came out as its CheckpointException (a
    BaseException) with a traceback per rank."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    dcp.save(tmp_path / "state", model, opt)

    def broken(self, plan, planner):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(dcp.SafeReader, "read_data", broken)
    wanted = dcp.stored_tensors(tmp_path / "state")
    for load in (
        lambda: dcp.load(tmp_path / "state", model, opt),
        lambda: dcp.read_tensors(tmp_path / "state", wanted),
    ):
        with pytest.raises(dcp.UnsafeCheckpointError) as err:
            load()
        assert str(err.value) == (
            f"{tmp_path / 'state'}: the checkpoint shards could not be read (OSError: [Errno 5] "
            "Input/output error): the checkpoint is damaged; resume from an earlier one (move "
            "this step's directory out of checkpoints/)"
        )


def _rank_on_a_full_disk(rank: int, port: int, run_dir: str, where: str) -> None:
    """Rank 1's disk is full while it writes its shards, or rank 0's as it writes
    optimizer.json; both ranks return the error."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    dist.join_long_waits(60.0)
    if rank == 1 and where == "shards":
        HuggingFaceStorageWriter.write_data = _full_write
    if rank == 0 and where == "json":
        write_text = Path.write_text

        def full(self, *args, **kwargs):
            if self.name == dcp.OPTIMIZER_JSON:
                raise OSError(errno.ENOSPC, "No space left on device")
            return write_text(self, *args, **kwargs)

        Path.write_text = full
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    try:
        _save(Path(run_dir), model, None, opt, 1, sharded_checkpoint.save)
    except checkpoint.CheckpointError as exc:
        (Path(run_dir) / f"rank_{rank}.txt").write_text(str(exc))
    finally:
        dist.shutdown()


def _full_write(self, plan, planner):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["shards", "json"])
def test_a_full_disk_on_one_rank_stops_every_rank_with_its_words(tmp_path, where):
    """Rank 0 failing to write optimizer.json waited for the other rank in a gather while
    that one waited in a barrier: both for the collectives' timeout, the cause unsaid."""
    spawn_ranks(_rank_on_a_full_disk, str(tmp_path), where)
    for rank in (0, 1):
        assert (tmp_path / f"rank_{rank}.txt").read_text() == (
            f"could not write the checkpoint of step 1 under {tmp_path / 'checkpoints'}: the "
            f"disk is full; resume with: dapo train --resume {tmp_path}"
        )
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("export", [checkpoint.export_model, sharded_checkpoint.export_model])
def test_a_full_disk_while_the_model_is_written_leaves_nothing_half_written(
    tmp_path, tokenizer, monkeypatch, export
):
    model, _ = _trained(tokenizer)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", _full_disk)
    with pytest.raises(checkpoint.CheckpointError) as err:
        export(model, tokenizer, tmp_path / "model")
    assert str(err.value) == (
        f"could not write the model {tmp_path / 'model'}: the disk is full; nothing was left "
        "there, and the run's checkpoints are as they were. Free space and finish the run "
        f"with: dapo train --resume {tmp_path} (or export its last checkpoint: dapo export "
        f"{tmp_path} --out {tmp_path / 'model'})"
    )
    assert list(tmp_path.iterdir()) == []  # no .model.tmp


def test_other_write_failures_keep_their_own_words():
    assert checkpoint.write_failure(SafetensorError(FULL)) == "the disk is full"
    assert checkpoint.write_failure(OSError(28, "No space left on device")) == "the disk is full"
    assert checkpoint.write_failure(OSError(13, "Permission denied")) == "Permission denied"
    other = "Error while serializing: I/O error: Input/output error (os error 5)"
    assert checkpoint.write_failure(SafetensorError(other)) == other


# ----------------------------------------------------------------------------- --force optim.*


def _groups(opt):
    return [(g["betas"], g["weight_decay"], g["lr"]) for g in opt.param_groups]


def test_a_resume_steps_with_the_configs_betas_and_weight_decay(tmp_path, tokenizer):
    model, opt = _trained(tokenizer, betas=(0.9, 0.999), weight_decay=0.1)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=1)
    other, forced = _trained(tokenizer, betas=(0.5, 0.9), weight_decay=0.5)
    checkpoint.load(ckpt, model=other, optimizer=forced)
    assert _groups(forced) == [((0.5, 0.9), 0.5, 1e-2)]
    for p, q in zip(opt.param_groups[0]["params"], forced.param_groups[0]["params"], strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], forced.state[q]["exp_avg"])  # still loaded
    again = _save(tmp_path, other, tokenizer, forced, step=2)
    groups = json.loads((again / "optimizer.json").read_text())["param_groups"]
    assert groups[0]["betas"] == {"__tuple__": [0.5, 0.9]} and groups[0]["weight_decay"] == 0.5
    # Nothing changed: the groups are the saved ones exactly.
    same, same_opt = _trained(tokenizer, betas=(0.9, 0.999), weight_decay=0.1)
    checkpoint.load(ckpt, model=same, optimizer=same_opt)
    assert same_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def test_a_sharded_resume_steps_with_the_configs_betas_and_weight_decay(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.999), weight_decay=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    dcp.save(tmp_path / "state", model, opt)
    fresh = torch.nn.Linear(3, 2)
    forced = torch.optim.AdamW(fresh.parameters(), betas=(0.5, 0.9), weight_decay=0.5)
    dcp.load(tmp_path / "state", fresh, forced)
    assert _groups(forced) == [((0.5, 0.9), 0.5, 1e-3)]
    assert torch.equal(forced.state[fresh.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
    whole = torch.nn.Linear(3, 2)  # a one-process checkpoint read into a sharded run
    forced = torch.optim.AdamW(whole.parameters(), betas=(0.5, 0.9), weight_decay=0.5)
    dcp.load_full(whole, forced, dict(model.state_dict()), opt.state_dict())
    assert _groups(forced) == [((0.5, 0.9), 0.5, 1e-3)]


# ----------------------------------------------------------------------------- runs on disk


@pytest.fixture(scope="module")
def run(tmp_path_factory, demo_cache):
    """A 2-step run of one process with checkpoints at steps 1 and 2 (never altered: copy)."""
    out = tmp_path_factory.mktemp("review")
    args = [*TINY_DEMO, "train.steps=2", "train.save_every=1", "eval.num_samples=0"]
    args += ["eval.every=0", f"embedded.cache_dir={demo_cache}"]
    assert main(["train", "--quiet", *args, f"run.out_dir={out}", "run.name=r"]) == 0
    return out / "r"


def _copy(run: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(run, dest, symlinks=True)
    (dest / ".dapo-lock").unlink(missing_ok=True)
    return dest


@pytest.fixture()
def loads(monkeypatch) -> list:
    """The policy loads a command made (none, for a resume refused before one)."""
    made: list = []
    monkeypatch.setattr(policy, "load_policy", lambda *a, **k: made.append(a))
    return made


def _resume(copy: Path, capsys, *extra: str) -> tuple[int, str]:
    rc = main(["train", "--quiet", "--resume", str(copy), "train.steps=3", *extra])
    return rc, capsys.readouterr().err


def test_a_forced_resume_saves_the_new_optimizer_settings(run, tmp_path, capsys):
    copy = _copy(run, tmp_path)
    forced = ["--force", "optim.weight_decay=0.5", "optim.beta1=0.5", "optim.beta2=0.9"]
    rc, err = _resume(copy, capsys, *forced)
    assert rc == 0, err
    saved = json.loads((copy / "checkpoints" / "step_000003" / "optimizer.json").read_text())
    group = saved["param_groups"][0]
    assert (group["betas"], group["weight_decay"]) == ({"__tuple__": [0.5, 0.9]}, 0.5)


def _move_out(path: Path, tmp_path: Path) -> Path:
    """``path`` moved out of the run, a link to it in its place."""
    target = tmp_path / "outside" / path.name
    target.parent.mkdir(exist_ok=True)
    shutil.move(path, target)
    path.symlink_to(target, target_is_directory=target.is_dir())
    return target


@pytest.mark.parametrize(
    ("linked", "fix"),
    [
        ("checkpoints/step_000002", "or move the link out of"),
        ("checkpoints", "put the directory it leads to in its place: rm"),
        ("checkpoints/latest", "the newest whole checkpoint is then used"),
    ],
)
def test_a_link_for_checkpoints_latest_or_a_step_is_refused_before_a_model_loads(
    run, tmp_path, capsys, loads, linked, fix
):
    copy = _copy(run, tmp_path)
    link = copy / linked
    target = _move_out(link, tmp_path)
    says = f"{link} is a symbolic link: dapo reads no checkpoint through a link"
    rc, err = _resume(copy, capsys)
    assert rc == 1 and says in err and fix in err and "Traceback" not in err, err
    assert loads == []
    if target.is_dir():
        assert str(target) in err  # the command that puts it back names it
    rc, err = main(["export", str(copy), "--out", str(tmp_path / "x")]), capsys.readouterr().err
    assert rc == 1 and says in err and not (tmp_path / "x").exists()
    with pytest.raises(checkpoint.CheckpointError, match="is a symbolic link"):
        checkpoint.find_latest(copy)
    if linked != "checkpoints/latest":  # export --step reads the step's directory
        rc = main(["export", str(copy), "--step", "2", "--out", str(tmp_path / "y")])
        assert rc == 1 and says in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_a_linked_step_directory_is_never_whole(run, tmp_path):
    copy = _copy(run, tmp_path)
    step = copy / "checkpoints" / "step_000002"
    _move_out(step, tmp_path)
    assert manifest.verify(step) == (
        f"{step} is a link: a checkpoint is a directory of the run, never a link to one (it "
        "could lead outside the run); put the directory it leads to in its place"
    )


def test_a_file_altered_at_its_size_is_refused_before_a_model_loads_naming_the_fix(
    run, tmp_path, capsys, loads
):
    copy = _copy(run, tmp_path)
    newest = copy / "checkpoints" / "step_000002"
    path = newest / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one byte of a tensor: the size and the header as they were
    path.write_bytes(bytes(data))
    rc, err = _resume(copy, capsys)
    assert rc == 1 and loads == [], err
    assert (
        f"checkpoint {newest} is incomplete or altered: {path} is not the file that was "
        "written (its SHA-256 differs from the manifest's): it was altered or damaged since. "
        f"Move step_000002 out of {copy / 'checkpoints'} to use step_000001, the newest whole "
        "checkpoint before it"
    ) in err
    (copy / "checkpoints" / "step_000001" / "optimizer.safetensors").write_bytes(b"cut")
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.read_trainer_state(newest)  # no whole checkpoint precedes it now
    assert str(info.value).endswith(
        "Restore it from a copy of the run: no whole checkpoint precedes it"
    )


def test_a_resume_hashes_each_file_once(run, tmp_path, monkeypatch):
    copy = _copy(run, tmp_path)
    ckpt = copy / "checkpoints" / "step_000002"
    files = manifest.manifest_files(ckpt)
    hashed: list[Path] = []
    real = manifest.sha256
    monkeypatch.setattr(manifest, "sha256", lambda p: hashed.append(p) or real(p))
    assert checkpoint.verify(ckpt, digests=True) is None  # before the model loads
    assert checkpoint.verify(ckpt, digests=(0, 1)) is None  # as it loads: nothing hashed again
    assert len(hashed) == len(files)
    path = ckpt / "rng.json"
    data = bytearray(path.read_bytes())
    data[-3] ^= 1  # rewritten since: hashed again, and refused
    path.write_bytes(bytes(data))
    assert "rng.json is not the file that was written" in checkpoint.verify(ckpt, digests=(0, 1))


# ------------------------------------------------------------------------ states that do not fit


def test_a_generator_state_cut_short_is_named_with_the_fix(tmp_path, tokenizer):
    model, opt = _trained(tokenizer)
    _save(tmp_path, model, tokenizer, opt, step=1)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=2)
    rng = json.loads((ckpt / "rng.json").read_text())
    rng["python"][1] = rng["python"][1][:10]
    (ckpt / "rng.json").write_text(json.dumps(rng))
    _reseal(ckpt)
    for load in (checkpoint.load, sharded_checkpoint.load):
        with pytest.raises(checkpoint.CheckpointError) as info:
            load(ckpt, model=model, optimizer=opt)
        assert str(info.value) == (
            f"checkpoint {ckpt} is incomplete or altered: {ckpt / 'rng'}.json / rng.safetensors "
            "hold a state that does not fit the generators (ValueError: state vector is the "
            f"wrong size). Move step_000002 out of {tmp_path / 'checkpoints'} to use "
            "step_000001, the newest whole checkpoint before it"
        )


def test_a_one_process_optimizer_state_that_does_not_fit_a_sharded_model_is_named(
    tmp_path, tokenizer, monkeypatch
):
    """Read into a sharded run (whole tensors, sharded on load), an optimizer state of more
    parameters than the model trains raised torch's bare IndexError."""
    model, opt = _trained(tokenizer)
    _save(tmp_path, model, tokenizer, opt, step=1)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=2)
    saved = json.loads((ckpt / "optimizer.json").read_text())
    saved["param_groups"][0]["params"].append(len(list(model.parameters())))
    (ckpt / "optimizer.json").write_text(json.dumps(saved))
    _reseal(ckpt)
    monkeypatch.setattr(fsdp, "is_sharded", lambda module: True)
    with pytest.raises(checkpoint.CheckpointError) as info:
        sharded_checkpoint.load(ckpt, model=model, optimizer=opt)
    assert str(info.value) == (
        f"checkpoint {ckpt} is incomplete or altered: {ckpt / 'model'} and "
        f"{ckpt / 'optimizer'}.json / optimizer.safetensors hold a state that does not fit "
        "this run's model (IndexError: list index out of range). Move step_000002 out of "
        f"{tmp_path / 'checkpoints'} to use step_000001, the newest whole checkpoint before it"
    )


def test_running_out_of_memory_while_a_one_process_checkpoint_loads_is_not_called_damage(
    tmp_path, tokenizer, monkeypatch
):
    model, opt = _trained(tokenizer)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=1)
    monkeypatch.setattr(fsdp, "is_sharded", lambda module: True)

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(dcp, "load_full", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):  # not "move the checkpoint out"
        sharded_checkpoint.load(ckpt, model=model, optimizer=opt)


def test_optimizer_groups_that_do_not_fit_are_named_with_the_fix(tmp_path, tokenizer):
    model, opt = _trained(tokenizer)
    _save(tmp_path, model, tokenizer, opt, step=1)
    ckpt = _save(tmp_path, model, tokenizer, opt, step=2)
    saved = json.loads((ckpt / "optimizer.json").read_text())
    saved["param_groups"][0]["params"] = saved["param_groups"][0]["params"][:3]
    (ckpt / "optimizer.json").write_text(json.dumps(saved))
    _reseal(ckpt)
    for load in (checkpoint.load, sharded_checkpoint.load):
        with pytest.raises(checkpoint.CheckpointError) as info:
            load(ckpt, model=model, optimizer=opt)
        message = str(info.value)
        assert message.startswith(
            f"checkpoint {ckpt} is incomplete or altered: {ckpt / 'optimizer'}.json / "
            "optimizer.safetensors hold a state that does not fit this run's optimizer "
            "(ValueError: loaded state dict contains a parameter group that doesn't match"
        )
        assert message.endswith(
            f"Move step_000002 out of {tmp_path / 'checkpoints'} to use step_000001, the newest "
            "whole checkpoint before it"
        )


def test_a_sharded_checkpoints_generator_state_that_does_not_fit_is_named(tmp_path, tokenizer):
    model, opt = _trained(tokenizer)
    ckpt = _save(tmp_path, model, tokenizer, opt, 1, sharded_checkpoint.save)
    stem = ckpt / "rng" / "rank_0"
    rng = json.loads(stem.with_suffix(".json").read_text())
    rng["python"][1] = rng["python"][1][:10]
    stem.with_suffix(".json").write_text(json.dumps(rng))
    _reseal(ckpt)
    with pytest.raises(checkpoint.CheckpointError) as info:
        sharded_checkpoint.load(ckpt, model=model, optimizer=opt)
    assert str(info.value).startswith(
        f"checkpoint {ckpt} is incomplete or altered: {stem}.json / rank_0.safetensors hold a "
        "state that does not fit the generators (ValueError: state vector is the wrong size). "
        "Restore it from a copy of the run"
    )
