"""Loading straight into FSDP2 shards (dapo.models.sharded_load) on 2 gloo ranks gives every
rank exactly what loading the whole model and sharding it gives: the same local shards, the
same buffers, the same whole generation copy and sharded KL reference, the same losses before
and after a training step; each rank reads only its own rows of the safetensors files."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
from helpers import ARCHS, SMALL, spawn_ranks
from safetensors.torch import load_file, save_file

from dapo.models.demo import build_tokenizer

RANKS = 2
VOCAB = 125  # the demo tokenizer's: odd, so the embeddings and the head shard unevenly


def _save(path: Path, arch: str, *, tied: bool, files: int, dtype=torch.float32) -> Path:
    """A tiny random model saved with save_pretrained in ``dtype``, with the demo's tokenizer;
    with ``files=2`` its tensors are split over two files and an index, as a large model's
    are."""
    tok = build_tokenizer()
    assert len(tok) == VOCAB
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(len(str(path)))
    model_cls(config).to(dtype).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    if files == 2:
        weights = load_file(path / "model.safetensors")
        names = sorted(weights)
        halves = {"model-00001-of-00002.safetensors": names[::2]}
        halves["model-00002-of-00002.safetensors"] = names[1::2]
        for file, part in halves.items():
            save_file({n: weights[n] for n in part}, path / file, metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {n: f for f, ns in halves.items() for n in ns}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        (path / "model.safetensors").unlink()
    return path


def _config(model_dir: Path, *extra: str):
    from dapo.config import load_config

    preset = "grpo" if "preset=grpo" in extra else None
    extra = tuple(x for x in extra if x != "preset=grpo")
    return load_config(None, [*SMALL, f"model.path={model_dir}", *extra], preset=preset)


class _Recorder:
    """``safe_open`` that records every read: (file, tensor, rows read or None for whole)."""

    def __init__(self, real, reads: list) -> None:
        self.real, self.reads = real, reads

    def __call__(self, filename, framework, **kwargs):
        return _File(self.real(filename, framework=framework, **kwargs), filename, self.reads)


class _File:
    def __init__(self, f, filename, reads: list) -> None:
        self.f, self.name, self.reads = f, Path(filename).name, reads

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        self.reads.append((self.name, name, None))
        return self.f.get_tensor(name)

    def get_slice(self, name):
        return _Slice(self.f.get_slice(name), self.name, name, self.reads)


class _Slice:
    def __init__(self, s, file, name, reads: list) -> None:
        self.s, self.file, self.name, self.reads = s, file, name, reads

    def get_shape(self):
        return self.s.get_shape()

    def __getitem__(self, index):
        part = self.s[index]
        rows = index[0]
        self.reads.append((self.file, self.name, (rows.start, rows.stop), part.numel()))
        return part


def _differences(old: dict, new: dict) -> list[str]:
    """The names whose tensors are not identical (values, dtype, device)."""
    if old.keys() != new.keys():
        return [f"names: {sorted(old.keys() ^ new.keys())}"]
    return [
        k
        for k, a in old.items()
        if a.dtype != new[k].dtype or a.device != new[k].device or not torch.equal(a, new[k])
    ]


def _local(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _buffers(model) -> dict:
    return {n: b.clone() for n, b in model.named_buffers()}


def _case(rank: int, model_dir: Path, extra: list[str], problems) -> dict:
    """Both loads of one model on this rank, compared; the new one's reads recorded."""
    from dapo.dist import fsdp
    from dapo.models import policy, sharded_load
    from dapo.training.state import build_state
    from dapo.training.step import train_step

    cfg = _config(model_dir, *extra)
    torch.manual_seed(0)
    whole, tok = policy.load_policy(cfg)
    old = build_state(cfg, whole, tok, problems)
    reads: list = []
    real = sharded_load.safe_open
    sharded_load.safe_open = _Recorder(real, reads)
    try:
        # One rank after the other, as `dapo train` loads (the others wait in a barrier): the
        # load makes no collective call.
        if rank > 0:
            torch.distributed.barrier()
        torch.manual_seed(0)
        model, _ = policy.load_policy(cfg, shard=True, log=lambda _: None)
        if rank == 0:
            torch.distributed.barrier()
    finally:
        sharded_load.safe_open = real
    new = build_state(cfg, model, tok, problems)
    out = {"sharded": fsdp.is_sharded(model), "reads": reads}
    out["expected_rows"] = {n: _rows(p.shape[0], rank) for n, p in model.named_parameters()}
    out["local_rows"] = {n: p.shape[0] for n, p in _local(model).items()}
    out["local_numel"] = sum(p.numel() for p in _local(model).values())
    out["shards"] = _differences(_local(old.model), _local(new.model))
    out["buffers"] = _differences(_buffers(old.model), _buffers(new.model))
    out["config"] = [
        old.model.config.to_dict() == new.model.config.to_dict(),
        old.model.generation_config.to_dict() == new.model.generation_config.to_dict(),
        old.model.training == new.model.training,
    ]
    out["tied"] = [_tied(old.model), _tied(new.model), _tied(old.gen_model), _tied(new.gen_model)]
    out["gen"] = _differences(old.gen_model.state_dict(), new.gen_model.state_dict())
    out["gen"] += _differences(_buffers(old.gen_model), _buffers(new.gen_model))
    out["gen_frozen"] = not new.gen_model.training and not any(
        p.requires_grad for p in new.gen_model.parameters()
    )
    out["gen_config"] = [
        old.gen_model.config.to_dict() == new.gen_model.config.to_dict(),
        old.gen_model.generation_config.to_dict() == new.gen_model.generation_config.to_dict(),
    ]
    out["ref"] = None
    if old.ref_model is not None:
        out["ref"] = _differences(_local(old.ref_model), _local(new.ref_model))
        out["ref"] += _differences(_buffers(old.ref_model), _buffers(new.ref_model))
        out["ref_frozen"] = not new.ref_model.training and not any(
            p.requires_grad for p in new.ref_model.parameters()
        )
    out["losses"] = [_step(old), _step(new)]
    out["stepped"] = _differences(_local(old.model), _local(new.model))
    metrics = []
    for state in (old, new):
        torch.manual_seed(1)
        m = train_step(state)
        metrics.append({k: v for k, v in m.items() if not k.startswith(("perf/", "time/"))})
    out["metrics"] = metrics
    out["trained"] = _differences(_local(old.model), _local(new.model))
    return out


def _rows(n: int, rank: int) -> tuple[int, int]:
    """FSDP2's rows of rank ``rank``: chunks of ceil(n / ranks), the last rank fewer."""
    chunk = -(-n // RANKS)
    return min(rank * chunk, n), min((rank + 1) * chunk, n)


def _tied(model) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def _step(state) -> list[float]:
    """The loss of a forward pass on fixed tokens, and after an AdamW step on its gradient
    (and a second step)."""
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):
        state.model.train()
        logits = state.model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        losses.append(float(loss.detach()))
    state.sync_engine()  # the generation copy samples from the stepped weights
    return losses


def _rank(rank: int, port: int, dirs: dict[str, Path], out: Path) -> None:
    from dapo.models import policy
    from dapo.reward.tasks import arith

    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=RANKS,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    try:
        problems = [p for p, _ in arith.make_splits(40, 3, seed=0)[0]]
        results = {
            "tied": _case(rank, dirs["tied"], ["preset=grpo", "algo.kl_coef=0.1"], problems),
            "untied": _case(
                rank,
                dirs["untied"],
                ["model.compute_dtype=bfloat16", "train.recompute_old_logprobs=true"],
                problems,
            ),
        }
        for name in ("missing", "missing_in_file"):
            try:
                policy.load_policy(_config(dirs[name]), shard=True)
                results[name] = "loaded"
            except ValueError as exc:
                results[name] = str(exc)
        notes: list[str] = []
        model, _ = policy.load_policy(_config(dirs["bin"]), shard=True, log=notes.append)
        reference, _ = policy.load_policy(_config(dirs["tied"]))
        results["bin"] = (
            notes,
            type(model).__name__,
            _differences(_local(reference), _local(model)),
        )
        torch.save(results, out / f"rank_{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    dirs = {
        "tied": _save(root / "tied", "qwen2", tied=True, files=1),
        # Stored in bfloat16, loaded in float32 (model.param_dtype).
        "untied": _save(root / "untied", "llama", tied=False, files=2, dtype=torch.bfloat16),
        "missing": _save(root / "missing", "qwen2", tied=True, files=1),
        "missing_in_file": _save(root / "missing2", "llama", tied=False, files=2),
    }
    weights = load_file(dirs["missing"] / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, dirs["missing"] / "model.safetensors", metadata={"format": "pt"})
    index = json.loads((dirs["missing_in_file"] / "model.safetensors.index.json").read_text())
    file = dirs["missing_in_file"] / index["weight_map"]["lm_head.weight"]
    weights = load_file(file)
    del weights["lm_head.weight"]  # the index still names this file
    save_file(weights, file, metadata={"format": "pt"})
    # Pickled weights only: the same tied model, saved as pytorch_model.bin.
    dirs["bin"] = root / "bin"
    dirs["bin"].mkdir()
    for f in dirs["tied"].iterdir():
        if f.name != "model.safetensors":
            (dirs["bin"] / f.name).write_bytes(f.read_bytes())
    torch.save(load_file(dirs["tied"] / "model.safetensors"), dirs["bin"] / "pytorch_model.bin")
    spawn_ranks(_rank, dirs, root, nprocs=RANKS)
    return {r: torch.load(root / f"rank_{r}.pt", weights_only=False) for r in range(RANKS)}


@pytest.mark.parametrize("case", ["tied", "untied"])
def test_shards_buffers_and_copies_equal_loading_whole_then_sharding(ranks, case):
    for rank, results in ranks.items():
        r = results[case]
        assert r["sharded"], rank
        assert r["shards"] == [] and r["buffers"] == [], (rank, r["shards"], r["buffers"])
        assert r["config"] == [True, True, True], rank
        assert r["gen"] == [] and r["gen_frozen"] and r["gen_config"] == [True, True], rank
        tied = case == "tied"
        assert r["tied"] == [tied] * 4, rank
        if tied:  # the GRPO reference, sharded
            assert r["ref"] == [] and r["ref_frozen"], rank
        else:
            assert r["ref"] is None
        # The embeddings' 125 rows are split 63 + 62 (FSDP2 pads rank 1's shard).
        assert r["local_rows"]["model.embed_tokens.weight"] == (63, 62)[rank]


@pytest.mark.parametrize("case", ["tied", "untied"])
def test_a_training_step_gives_the_same_losses_and_weights(ranks, case):
    for rank, results in ranks.items():
        r = results[case]
        (before_old, after_old), (before_new, after_new) = r["losses"]
        assert before_new == before_old and after_new == after_old, rank
        assert after_old < before_old  # the step moved the weights
        assert r["stepped"] == [], rank
        old, new = r["metrics"]
        # NaN is a mean over nothing (clip/high_prob_mean with no up-clipped token): equal too
        assert {k: None if v != v else v for k, v in new.items()} == {
            k: None if v != v else v for k, v in old.items()
        }, rank
        assert r["trained"] == [], rank


@pytest.mark.parametrize("case", ["tied", "untied"])
def test_each_rank_reads_only_its_rows(ranks, case):
    for rank, results in ranks.items():
        r = results[case]
        reads = r["reads"]
        assert all(rows is not None for _, _, rows, *_ in reads), "a whole tensor was read"
        read = {name: rows for _, name, rows, _ in reads}
        assert len(read) == len(reads), "a tensor was read twice"
        # Every parameter once, its own rows only (the tied head is not in the file: it is
        # the embeddings, read once).
        assert read == r["expected_rows"], rank
        assert sum(n for *_, n in reads) == r["local_numel"], rank


def test_a_missing_tensor_is_named_with_its_file_and_the_fix(ranks):
    for results in ranks.values():
        message = results["missing"]
        assert "model.layers.1.mlp.up_proj.weight" in message and "model.safetensors" in message
        assert "save_pretrained(DIR, safe_serialization=True)" in message
        message = results["missing_in_file"]
        assert "lm_head.weight" in message and "model-00001-of-00002.safetensors" in message
        assert "the file model.safetensors.index.json names for it" in message


def test_pickled_weights_keep_the_whole_load_with_a_note(ranks):
    for results in ranks.values():
        notes, cls, differences = results["bin"]
        assert cls == "Qwen2ForCausalLM" and differences == []
        assert len(notes) == 1 and "has no model.safetensors" in notes[0]


def test_cpu_offload_on_the_cpu_is_refused_before_loading(tmp_path):
    from dapo.models import sharded_load

    model_dir = _save(tmp_path / "m", "qwen2", tied=True, files=1)
    cfg = _config(model_dir, "dist.cpu_offload=true")
    with pytest.raises(ValueError, match="trains on the CPU already: drop dist.cpu_offload"):
        sharded_load.load(cfg, model_dir, torch.device("cpu"))


def _one_gpu_rank(rank: int, port: int, model_dir: Path, out: Path) -> None:
    """One torchrun-like rank on cuda:0 (NCCL): both loads, with the shards on the GPU and
    offloaded to the host, compared."""
    import os

    from dapo import dist
    from dapo.models import policy
    from dapo.reward.tasks import arith
    from dapo.training.state import build_state

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_from_env(timeout_s=120)
    try:
        problems = [p for p, _ in arith.make_splits(8, 1, seed=0)[0]]
        results = {}
        for offload in ("false", "true"):
            cfg = _config(
                model_dir,
                "model.compute_dtype=bfloat16",
                "train.recompute_old_logprobs=true",
                f"dist.cpu_offload={offload}",
            )
            whole, tok = policy.load_policy(cfg)
            old = build_state(cfg, whole, tok, problems)
            model, _ = policy.load_policy(cfg, shard=True)
            new = build_state(cfg, model, tok, problems)
            devices = sorted({str(p.device) for p in _local(new.model).values()})
            ids = torch.randint(0, VOCAB, (2, 8), device="cuda")
            with torch.no_grad():
                same = torch.equal(old.model(input_ids=ids).logits, new.model(input_ids=ids).logits)
            results[offload] = {
                "shards": _differences(_local(old.model), _local(new.model)),
                "buffers": _differences(_buffers(old.model), _buffers(new.model)),
                "gen": _differences(old.gen_model.state_dict(), new.gen_model.state_dict()),
                "devices": devices,  # before a forward (the root stays gathered after it)
                "logits": same,
            }
        torch.save(results, out / "gpu.pt")
    finally:
        dist.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_with_and_without_cpu_offload(tmp_path):
    model_dir = _save(tmp_path / "m", "qwen2", tied=True, files=1)
    spawn_ranks(_one_gpu_rank, model_dir, tmp_path, nprocs=1)
    results = torch.load(tmp_path / "gpu.pt", weights_only=False)
    for offload, r in results.items():
        assert r["shards"] == [] and r["buffers"] == [] and r["gen"] == [], offload
        assert r["logits"], offload
        assert r["devices"] == (["cpu"] if offload == "true" else ["cuda:0"]), offload
