"""train.keep_checkpoints prunes only what dapo wrote: an older checkpoint holding a file a user
put there is kept (with one warning naming it and the file), the others go as before."""

import torch

from dapo.models.demo import TinyModelSpec, tiny_qwen2
from dapo.run import checkpoint

SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2)


def _save(run_dir, model, tokenizer, opt, step):
    checkpoint.save(
        run_dir,
        step=step,
        model=model,
        tokenizer=tokenizer,
        optimizer=opt,
        trainer_state={"sampler": {"epoch": 0, "pos": step}},
        keep=1,
    )


def test_pruning_keeps_a_checkpoint_holding_a_users_file(tmp_path, tokenizer, capsys):
    model = tiny_qwen2(tokenizer, SPEC, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root = tmp_path / "checkpoints"
    _save(tmp_path, model, tokenizer, opt, step=1)
    notes = root / "step_000001" / "model" / "notes.txt"
    notes.write_text("my notes\n")
    user_tmp = root / ".tmp-mine" / "keep.txt"  # named like no save's temporary: the user's
    user_tmp.parent.mkdir()
    user_tmp.write_text("mine\n")
    _save(tmp_path, model, tokenizer, opt, step=2)
    _save(tmp_path, model, tokenizer, opt, step=3)  # step 2 pruned; step 1 kept, not warned again

    names = sorted(p.name for p in root.iterdir())
    assert names == [".tmp-mine", "latest", "step_000001", "step_000003"]
    assert notes.read_text() == "my notes\n" and user_tmp.read_text() == "mine\n"
    assert (root / "step_000001" / "trainer.json").is_file()  # kept whole, not emptied
    err = capsys.readouterr().err
    assert err.count("dapo: warning:") == 1, err
    assert (
        f"dapo: warning: {root / 'step_000001'} holds files dapo did not write ("
        "model/notes.txt); it was kept, not pruned (train.keep_checkpoints deletes only what "
        "dapo wrote)"
    ) in err
    assert f"rm -rf {root / 'step_000001'}" in err


def test_pruning_still_deletes_a_damaged_checkpoint_of_dapos_own_files(tmp_path, tokenizer):
    """A file of its manifest cut short (a crash, a full disk) is dapo's all the same."""
    model = tiny_qwen2(tokenizer, SPEC, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root = tmp_path / "checkpoints"
    _save(tmp_path, model, tokenizer, opt, step=1)
    (root / "step_000001" / "trainer.json").write_text("{}")
    _save(tmp_path, model, tokenizer, opt, step=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
