"""Helpers shared by several test modules (fixtures are in conftest.py)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from dapo.config import load_config
from dapo.models.demo import build_tokenizer
from dapo.reward.tasks import arith
from dapo.rollout import Rollout, make_engine

ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}

SMALL = [
    "rollout.group_size=4",
    "rollout.max_new_tokens=12",
    "algo.l_cache=4",
    "train.steps=4",
    "train.prompts_per_step=2",
    "train.responses_per_minibatch=4",
    "train.save_every=1",
    "sampling.dynamic=false",
    "eval.num_samples=1",
    "eval.every=0",
    "reward.workers=0",
]
"""A run of a few seconds on the tiny test model."""


LENGTH_SHAPED = [
    "rollout.max_new_tokens=12",
    "algo.l_cache=8",  # lengths past 4 shape the rewards: advantages without a verifier
    "rollout.group_size=4",
    "sampling.dynamic=false",
    "train.prompts_per_step=2",
    "optim.warmup_steps=0",
    "reward.workers=0",
    "run.threads=1",
]
"""Steps of 2 prompts x 4 responses on the tiny model, rewarded by their lengths alone (with
:func:`plus_one_problems`), in one thread."""


def setup_run(tmp_path, tiny_model, *overrides):
    """(config, train problems, val problems, an empty run directory, a copy of the model)."""
    cfg = load_config(None, [*SMALL, f"run.out_dir={tmp_path}", *overrides])
    train, val, _ = arith.make_splits(40, 3, seed=0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    start = copy.deepcopy(tiny_model)
    return cfg, [p for p, _ in train], [p for p, _ in val], run_dir, start


def plus_one_problems(n: int) -> list:
    """``n`` problems ``p0``, ``p1``, ... asking "i + 1", each with the answer "1" (the tiny
    model's rewards come from lengths here, not from the verifier)."""
    from dapo.data.problems import Problem

    return [Problem(f"p{i}", ({"role": "user", "content": f"{i} + 1"},), "1") for i in range(n)]


def quiet_fit(cfg, model, tokenizer, train, val, run_dir, *, resume=False):
    """``dapo.training.loop.fit`` with its progress lines sent to /dev/null."""
    from dapo.training import loop

    with open(os.devnull, "w") as quiet:
        return loop.fit(
            cfg, model, tokenizer, train, val, run_dir=run_dir, stream=quiet, resume=resume
        )


def logged_metrics(run_dir: Path) -> list[dict]:
    """The lines of a run's metrics.jsonl without their ``perf/`` timings (which vary)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if not k.startswith("perf/")} for x in lines]


def save_model(
    path: Path, arch: str, *, context: int = 512, tokenizer: bool = True, heads: int = 2
) -> Path:
    """A tiny random Qwen2 or Llama saved with save_pretrained, with the demo's tokenizer;
    ``heads`` attention heads, one key-value head (or ``heads`` of them when it is over 2,
    for tensor parallelism to split)."""
    tok = build_tokenizer()  # word-level, with a chat template ("User: ...\nAssistant:\n")
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=1 if heads <= 2 else heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    model_cls(config).save_pretrained(path)
    if tokenizer:
        tok.save_pretrained(path)
    return path


def question_file(path: Path, questions: list[str]) -> Path:
    """A JSONL data file of ``questions``, row i's answer ``str(i)``."""
    import json

    rows = [{"question": q, "answer": str(i)} for i, q in enumerate(questions)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def small_run(tmp_path: Path, model: Path, train: Path, val: Path, *extra: str) -> list[str]:
    """Overrides for a small run of ``model`` on ``train`` and ``val`` (groups of 4, 16 new
    tokens, 2 prompts a step, no dynamic sampling, rewards in-process) under ``tmp_path``."""
    return [
        f"model.path={model}",
        f"data.train_file={train}",
        f"data.val_file={val}",
        "rollout.group_size=4",
        "rollout.max_new_tokens=16",
        "algo.l_cache=4",
        "train.prompts_per_step=2",
        "sampling.dynamic=false",
        "train.responses_per_minibatch=8",
        "reward.workers=0",
        f"run.out_dir={tmp_path}",
        *extra,
    ]


class Started(Exception):
    """Raised in place of training (the ``no_training`` fixture): every check passed and the
    run started."""


def run_tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes, a directory as ``b"/"`` (the lock file aside:
    who last held it)."""
    return {
        str(p.relative_to(path)): p.read_bytes() if p.is_file() else b"/"
        for p in sorted(path.rglob("*"))
        if p.name != ".dapo-lock"
    }


def generate(model, tokenizer, prompts: list[str], *, engine: str = "dapo", **kwargs) -> Rollout:
    """``make_engine(engine, model, tokenizer).generate(prompts, **kwargs)``."""
    return make_engine(engine, model, tokenizer).generate(prompts, **kwargs)


def load_script(relative: str):
    """A script of the repository (``scripts/NAME.py``, not a package) as a module."""
    path = Path(__file__).resolve().parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_checkpoint(run: Path) -> Path:
    """A step-1 checkpoint of ``run`` that is whole and whose counters resume (no weights): for
    the checks made before a model loads. The ``latest`` pointer names it."""
    import json

    from dapo.run import checkpoint, manifest, trainer_file

    ckpt = run / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    trainer = dict.fromkeys(trainer_file.RESUMED, 0)
    trainer.update(step=1, format_version=checkpoint.FORMAT_VERSION, sampler={"epoch": 0, "pos": 0})
    trainer.update(val_start={}, val_last={})
    (ckpt / "trainer.json").write_text(json.dumps(trainer))
    manifest.write(ckpt, checkpoint.FORMAT_VERSION, 1, None)
    (run / "checkpoints" / "latest").write_text("step_000001\n")
    return ckpt


def spawn_ranks(fn, *args, nprocs: int = 2) -> None:
    """``fn(rank, port, *args)`` in ``nprocs`` spawned processes, ``port`` a free local port
    for their process group (``init_method=f"tcp://127.0.0.1:{port}"``); returns when all
    have finished, raising what any of them raised."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ends_at_once, args=(fn, port, *args), nprocs=nprocs, start_method="spawn")


def _ends_at_once(rank: int, fn, port: int, *args) -> None:
    """``fn(rank, port, *args)``, then the process ends without running C++ destructors: at
    interpreter exit a rank's gloo threads were sometimes destroyed still joinable, and the
    rank died of SIGABRT ("terminate called without an active exception") after its test had
    passed (seen under load in CI, 2026-12-04). What ``fn`` raises still reaches the parent.
    It first removes what finalizers would have, as dapo's own ranks do before ``os._exit``
    (a vLLM engine's temporary directory)."""
    import os
    import sys

    from dapo.cli import before_exit

    fn(rank, port, *args)
    before_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The demo at a tiny scale that still keeps and drops groups, trains several micro-batches per
# update and checkpoints every step: the runs that kill -9 and --resume compare exactly.
RESUMABLE_DEMO = [
    # Big enough to be right sometimes: dynamic sampling keeps groups and every step trains.
    "embedded.sft_steps=100",
    "embedded.hidden=64",
    "arith.max_terms=2",
    "arith.num_warmup=256",
    "arith.num_train=200",
    "arith.num_val=8",
    "rollout.group_size=4",
    "train.steps=6",
    "train.prompts_per_step=4",
    "sampling.prompts_per_round=8",
    "sampling.on_max_rounds=train",
    "train.responses_per_minibatch=8",  # 2 updates per step
    "train.tokens_per_microbatch=300",  # several micro-batches per update
    "eval.num_samples=2",
    "eval.every=2",
    "train.save_every=1",
    "train.keep_checkpoints=2",
    "run.threads=1",
    # What a GPU run needs to resume exactly (docs/guides/gpus.md); on a CPU it changes no
    # value, and here it shows every op of training, evaluation and resume has such a kernel.
    "run.deterministic=true",
]


ROOT = Path(__file__).resolve().parents[1]


def start_run(
    out_dir: Path, name: str, cache: Path, overrides: list[str], *extra: str
) -> subprocess.Popen:
    """``dapo train *extra`` in a subprocess; a new run takes ``overrides``, its directory and
    the embedded model's cache (``--resume DIR`` in ``extra`` takes nothing else)."""
    cmd = [sys.executable, "-m", "dapo", "train", *extra]
    if "--resume" not in extra:
        cmd += [*overrides, f"embedded.cache_dir={cache}", f"run.out_dir={out_dir}"]
        cmd += [f"run.name={name}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish_run(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a run :func:`start_run` started."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once, of the tensors ops make under it (a
    fused kernel's own temporaries are not seen); ``inputs`` made before it are left out."""

    def __init__(self, *inputs: torch.Tensor):
        super().__init__()
        self.live: dict[int, int] = {}
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            ptr = storage.data_ptr() if storage is not None else None
            if ptr is not None and ptr not in self.live and ptr not in self.inputs:
                self.live[ptr] = storage.nbytes()
                weakref.finalize(storage, self.live.pop, ptr)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


TINY_DEMO = [
    # Right sometimes, so dynamic sampling keeps some groups and drops others.
    "embedded.sft_steps=100",
    "embedded.hidden=64",
    "arith.max_terms=2",
    "arith.num_warmup=256",
    "arith.num_train=200",
    "arith.num_val=8",
    "rollout.group_size=4",
    "rollout.max_new_tokens=24",
    "algo.l_cache=4",
    "train.prompts_per_step=4",
    "sampling.prompts_per_round=6",
    "sampling.on_max_rounds=train",
    "train.responses_per_minibatch=8",  # 2 updates per step
    "train.tokens_per_microbatch=300",  # several micro-batches per update
    "reward.workers=0",
    "optim.lr=1e-3",  # large enough that two steps move every weight visibly
]
"""The demo at a tiny scale that keeps and drops groups and trains several micro-batches per
update, in seconds."""

TORCHRUN_DEMO = [
    *TINY_DEMO,
    "train.steps=3",
    "eval.num_samples=2",
    "eval.every=2",
    "train.save_every=1",
    "run.threads=1",
    "dist.timeout_s=60",
]
"""3 steps of :data:`TINY_DEMO` under torchrun as in one process: a checkpoint every step."""


def dapo_train(ranks: int, *args: str, out_dir: Path, wait: bool = True):
    """``python -m dapo train ARGS`` in one process (ranks 0) or under torchrun."""
    launch = [sys.executable, "-m", "dapo"]
    if ranks:
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
        launch += ["--standalone", "-m", "dapo"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [*launch, "train", *args]
    if "--resume" not in args:
        cmd += [f"run.out_dir={out_dir}"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if not wait:
        return proc
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{cmd}\n{out[-2000:]}\n{err[-4000:]}"
    return out
