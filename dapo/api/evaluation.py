"""An evaluation under the paper's protocol, as ``dapo eval`` and :func:`dapo.evaluate` run it:
k samples per problem, avg@k, pass@k and maj@k with 95% bootstrap intervals over problems,
written to ``summary.json`` and ``problems.jsonl`` and resumable from its journal."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dapo.api.eval_inputs import (
    EvalRequest,
    check_sampling,
    data_options,
    graded_as_the_run,
    problems_of,
    run_config,
    weightless_checkpoint_model,
)

DEFAULT_OUT = "evals"


@dataclass(frozen=True)
class EvalResult:
    """Where the evaluation was written, and its metrics: name -> {mean, low, high}."""

    out_dir: Path
    metrics: dict[str, dict[str, float]]
    protocol: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        """``result["avg@k"]`` as ``result.metrics["avg@k"]``; the fields by their names."""
        return (
            getattr(self, key) if key in ("out_dir", "metrics", "protocol") else self.metrics[key]
        )


def _comma(values: str | Sequence[Any]) -> str:
    return values if isinstance(values, str) else ",".join(str(v) for v in values)


def evaluate(
    model_dir: str | Path,
    data: str | Path,
    *,
    k: int = 32,
    pass_k: str | Sequence[int] = (),
    reward_fn: Callable[..., Any] | None = None,
    stop_token_ids: str | Sequence[int] = (),
    phrases: str | Sequence[str] = (),
    **settings: Any,
) -> EvalResult:
    """Evaluate ``model_dir`` (a saved causal LM, or ``"embedded"``) on ``data`` (a problem
    file, or ``"arith"``) as ``dapo eval`` does; ``settings`` are its other flags by their
    names (temperature, top_p, max_new_tokens, seed, greedy, num_problems, reward_mode,
    reward_function, system_prompt, resamples, out, device, engine, dtype, config, threads;
    how the file is read: format, question_key, answer_key, wrap_template, on_bad_row).
    ``reward_fn`` grades every response in place of the verifiers, as ``reward.function``."""
    request = EvalRequest(
        model=str(model_dir),
        data=str(data),
        k=k,
        pass_k=_comma(pass_k),
        stop_token_ids=_comma(stop_token_ids),
        phrases=_comma(phrases),
        **settings,
    )
    if request.out is not None:
        request.out = Path(request.out)
    from dapo.api.process_state import kept_process_state

    with kept_process_state():  # the caller's threads and generator, as they were
        return run(request, reward_fn=reward_fn)


def run(req: EvalRequest, *, reward_fn: Callable[..., Any] | None = None) -> EvalResult:
    """Sample, grade, summarise and write ``req``'s evaluation; a journal left by an
    interrupted one with the same protocol is continued."""
    from dapo.eval.evaluate import sample_records
    from dapo.eval.journal import Journal, fingerprint
    from dapo.eval.metrics import summarize
    from dapo.models.policy import stop_token_ids
    from dapo.rollout import make_engine
    from dapo.training.state import close_episodes, engine_stops, reward_pool, runner_for

    check_request(req, reward_fn)
    ks, phrases = _ks(req.pass_k, req.k), _phrases(req.phrases)
    problems = problems_of(req)
    model, tokenizer = _model(req)  # a model that does not load leaves no directory behind
    out = out_dir(req)
    out.mkdir(parents=True, exist_ok=True)
    identity = [*fingerprint([req.model, req.data]), req.device]  # what a path's files hold
    journal = Journal(out, _protocol(req, len(problems)), identity)
    done = journal.resume([p.uid for p in problems])
    if done:
        print(f"resuming: {len(done)} of {len(problems)} problems already in {journal.path}")
    model.eval()
    extra = _ids(req.stop_token_ids, "--stop-token-ids")
    before_batch = _progress(req, t0 := time.perf_counter())
    settings = run_config(req)
    settings.reward.function = req.reward_function  # the command's, else --config's
    stops = engine_stops(stop_token_ids(model, tokenizer, extra), tokenizer, settings.env)
    engine = make_engine(req.engine, model, tokenizer, stops)
    episodes = runner_for(settings, engine, tokenizer)  # the run's env.class
    # Graded as the run grades (reward.*, code.*); the environment's tools stop with it.
    with reward_pool(settings, reward_fn) as pool, contextlib.ExitStack() as ends:
        ends.callback(close_episodes, episodes)
        records = done + sample_records(
            engine,
            tokenizer,
            problems[len(done) :],
            first_index=len(done),
            k=req.k,
            temperature=req.temperature,
            top_p=req.top_p,
            max_new_tokens=req.max_new_tokens,
            seed=req.seed,
            pool=pool,
            greedy=req.greedy,
            system_prompt=req.system_prompt,
            reward_mode=req.reward_function or req.reward_mode,
            before_batch=lambda i, n: before_batch(len(done) + i, len(done) + n),
            after_batch=journal.append,
            episodes=episodes,
        )
    before_batch(len(problems), len(problems))
    per_problem = _per_problem(records, ks, phrases)
    summary = summarize(list(per_problem.values()), resamples=req.resamples, seed=req.seed)
    protocol = _save(req, out, records, per_problem, summary, seconds=time.perf_counter() - t0)
    journal.finish()
    _print_result(req, summary, protocol, out)
    metrics = {name: asdict(iv) for name, iv in summary.items()}
    return EvalResult(out_dir=out, metrics=metrics, protocol=protocol)


def check_request(req: EvalRequest, reward_fn: Callable[..., Any] | None = None) -> None:
    from dapo.eval.intervals import check_resampling
    from dapo.reward import custom

    if not req.model or not req.data:
        raise ValueError("dapo eval needs MODEL_DIR and --data FILE (or --compare A B)")
    if req.num_problems < 0:
        raise ValueError(f"--num-problems must be >= 0 (0 = all), got {req.num_problems}")
    check_sampling(req)
    # Before the model loads and every problem is sampled, not when the intervals are drawn.
    check_resampling(req.resamples)
    if req.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = auto), got {req.threads}")
    if req.config and not Path(req.config).is_file():
        raise ValueError(f"--config {req.config}: no such file")
    if req.config:  # its refusals (code inside a run directory) before anything is written
        graded_as_the_run(req, reward_fn is not None)
    _ids(req.stop_token_ids, "--stop-token-ids")  # refused before anything loads or is written
    if req.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        from dapo.rollout.vllm_engine import install_hint

        raise ValueError(install_hint("--engine vllm"))
    if not 0 <= req.seed < 2**63:
        raise ValueError(f"--seed must be a non-negative integer below 2**63, got {req.seed}")
    if req.model != "embedded":
        from dapo.models import hub

        found = hub.resolve(req.model, setting="MODEL")
        why = weightless_checkpoint_model(found)  # before transformers names a missing file
        if why is None and not (found / "config.json").is_file():
            why = "not a saved model directory (no config.json), nor a Hub model id in the cache"
            if (found / "adapter_config.json").is_file():  # what `dapo export` of LoRA writes
                why = (
                    "a LoRA adapter directory (adapter_config.json, no config.json), not a "
                    "model: export the run merged, `dapo export RUN --merge --out DIR`, and "
                    "evaluate DIR"
                )
        if why is not None:
            raise ValueError(f"{req.model} is {why}")
    _check_out(out_dir(req))
    if reward_fn is not None:
        req.reward_function = custom.spec_for(reward_fn, req.reward_function)
    if req.reward_function:
        custom.check(req.reward_function, reward_fn)
    if req.reward_function and req.reward_mode:
        raise ValueError(
            "--reward-function grades every row and --reward-mode picks a verifier: give one"
        )


def _check_out(out: Path) -> None:
    """An evaluation writes summary.json and problems.jsonl into ``out``: never over a
    training run's (its summary.json is the run's, which dapo report and ablate read) nor
    over a summary.json it did not write."""
    from dapo.run.rundir import holds_a_run

    if holds_a_run(out):
        raise ValueError(
            f"--out {out} is a training run's directory (its summary.json is the run's); "
            f"give a directory of its own, e.g. --out {out / 'evals' / 'NAME'}"
        )
    summary = out / "summary.json"
    if summary.is_file() and saved_protocol(summary) is None:
        raise ValueError(
            f"--out {out} holds a summary.json that dapo eval did not write; give another --out"
        )


def saved_protocol(summary: Path) -> dict[str, Any] | None:
    """The ``protocol`` of an evaluation's ``summary.json`` (what :func:`_save` writes beside
    the metrics), or None: absent, unreadable, or not an evaluation's."""
    try:
        with summary.open("rb") as f:
            doc = json.loads(f.read(1 << 24))  # an evaluation's is kilobytes
    except (OSError, ValueError, RecursionError):
        return None
    protocol = doc.get("protocol") if isinstance(doc, dict) else None
    return protocol if isinstance(protocol, dict) else None


def _ks(text: str, k: int) -> list[int]:
    if not text:
        return sorted({1, k})
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--pass-k {text!r}: give comma-separated integers, e.g. 1,8,32") from None
    bad = [x for x in ks if not 1 <= x <= k]
    if bad:
        raise ValueError(f"--pass-k: {bad} not in 1..k={k}; pass@k' needs k' <= k samples")
    return ks


def _ids(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated token ids, e.g. 151645") from None


def _phrases(text: str) -> tuple[str, ...]:
    from dapo.eval.metrics import REFLECTIVE_PHRASES

    return tuple(p.strip() for p in text.split(",") if p.strip()) or REFLECTIVE_PHRASES


def _model(req: EvalRequest) -> tuple[Any, Any]:
    """The policy to evaluate on ``req.device`` in ``req.dtype``, and its tokenizer."""
    from dapo.config import load_config
    from dapo.models import policy
    from dapo.training import inputs

    if req.model == "embedded":
        # The demo's starting policy, from the warm-up cache (built first if missing).
        cfg = load_config(None, [])
        warmup, tokenizer = inputs.load_run_data(cfg).warmup_pairs, None
    else:
        cfg = load_config(None, [f"model.path={req.model}"])
        warmup, tokenizer = [], policy.load_tokenizer(cfg)
    # Set after the config is checked: the demo base reuses sampler log-probs in training,
    # which needs float32; an evaluation does not train.
    cfg.model.device = req.device
    # Weights in the evaluation's dtype too: it holds no optimizer state to keep in float32.
    cfg.model.param_dtype = cfg.model.compute_dtype = req.dtype
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731 - stdout is the result table
    return policy.load_policy(cfg, warmup, tokenizer, log=log)


def _per_problem(records: list[dict], ks: list[int], phrases: tuple[str, ...]) -> dict[str, dict]:
    """uid -> the problem's metrics; without maj@k when no response of any had an answer."""
    from dapo.eval.metrics import record_metrics, without_unvoted_majority

    metrics = [record_metrics(r, ks=ks, phrases=phrases) for r in records]
    metrics = without_unvoted_majority(metrics, records)
    return {r["uid"]: m for r, m in zip(records, metrics, strict=True)}


def _print_result(req: EvalRequest, summary: dict, protocol: dict[str, Any], out: Path) -> None:
    """The table on stdout, and under it (on stderr) how many responses were not graded."""
    title = (
        f"{req.model} on {req.data}: {protocol['problems']} problems x {req.k} samples "
        f"(T {req.temperature}, top_p {req.top_p}, seed {req.seed})"
    )
    print(_table(summary, title))
    if protocol["reward_faults"]:
        print(
            f"dapo: warning: {protocol['reward_faults']} of {protocol['problems'] * req.k} "
            "responses could not be graded (reward faults, counted wrong): the table "
            "understates the model; problems.jsonl's `faults` counts them per problem, and "
            "the warnings above say why",
            file=sys.stderr,
        )
    print(f"wrote {out / 'summary.json'} and {out / 'problems.jsonl'}")


def _table(summary: dict, title: str) -> str:
    from dapo.eval.metrics import MAJORITY

    lines = [title, f"{'metric':<18} mean [95% bootstrap interval over problems]"]
    lines += [f"{name:<18} {iv}" for name, iv in summary.items()]
    if MAJORITY not in summary:  # nothing voted (no pred, or no vote cast): maj@k is undefined
        why = "none had an extracted answer, or its verifier casts none, as the code task does"
        lines.append(f"{MAJORITY:<18} - (no response cast a vote: {why})")
    return "\n".join(lines)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _progress(req: EvalRequest, t0: float) -> Callable[[int, int], None]:
    """Before each batch: the thread count for it (``threads``), and a progress line."""
    import torch

    from dapo.run.threads import ThreadGovernor

    governor = ThreadGovernor() if req.threads == 0 else None
    if req.threads:
        torch.set_num_threads(req.threads)

    def before_batch(done: int, total: int) -> None:
        threads = governor.adjust() if governor is not None else torch.get_num_threads()
        print(
            f"  {done}/{total} problems, {time.perf_counter() - t0:.0f} s, {threads} threads",
            file=sys.stderr,
            flush=True,
        )

    return before_batch


def _protocol(req: EvalRequest, problems: int) -> dict[str, Any]:
    """What the evaluation is: its records repeat exactly when all of this does."""
    protocol = {
        "model": str(req.model),
        "data": str(req.data),
        "problems": problems,
        "k": req.k,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_new_tokens": req.max_new_tokens,
        "seed": req.seed,
        "system_prompt": req.system_prompt,
        "stop_token_ids": req.stop_token_ids,
        "engine": req.engine,
        "greedy": req.greedy,
        "reward_mode": req.reward_mode,
        "dtype": req.dtype,
    }
    if req.reward_function:
        protocol["reward_function"] = req.reward_function
    if data_options(req):  # how the file was read, where not as dapo reads it by default
        protocol["data_options"] = data_options(req)
    if req.config:  # its env, code and reward settings shape the records too
        digest = hashlib.sha256(Path(req.config).read_bytes()).hexdigest()
        protocol["config"] = {"path": str(req.config), "sha256": digest}
    return protocol


def _save(
    req: EvalRequest, out: Path, records: list[dict], per_problem: dict, summary, *, seconds
) -> dict[str, Any]:
    """summary.json (the protocol and the metrics) and problems.jsonl (one record each)."""
    protocol = {
        **_protocol(req, len(records)),
        "resamples": req.resamples,
        **({"phrases": list(_phrases(req.phrases))} if req.phrases else {}),
        "reward_faults": sum(r["faults"] for r in records),
        "seconds": round(seconds, 1),
    }
    result = {
        "protocol": protocol,
        "metrics": {k: {"mean": v.mean, "low": v.low, "high": v.high} for k, v in summary.items()},
    }
    _write(out / "summary.json", json.dumps(result, indent=2) + "\n")
    lines = [json.dumps({**r, "metrics": per_problem[r["uid"]]}) for r in records]
    _write(out / "problems.jsonl", "\n".join(lines) + "\n")
    return protocol


def out_dir(req: EvalRequest) -> Path:
    """Where the evaluation goes: ``out``, else ``evals/<model>-<data>-k<k>``, a saved
    model's name followed by 8 hex digits of its resolved path: two runs' ``step_N/model``
    (``--compare`` of a step of each) never share a directory."""
    if req.out:
        return Path(req.out)
    if req.model == "embedded":
        name = "embedded"
    else:
        path = Path(req.model).resolve()
        # runs/<name>/model and checkpoints/step_N/model: the parent says which one.
        name = f"{path.parent.name}-{path.name}" if path.name == "model" else path.name
        name += "-" + hashlib.sha256(str(path).encode()).hexdigest()[:8]
    return Path(DEFAULT_OUT) / f"{name}-{Path(req.data).stem}-k{req.k}"
