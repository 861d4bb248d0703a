"""This project's DAPO step against TRL's GRPOTrainer (loss_type="dapo") at equal work.

    pip install -e '.[bench]'          # adds trl (and its accelerate, datasets)
    python benchmarks/vs_trl.py [--reps 3] [--steps 3] [--warmup 1] [--new-tokens 32]
    python benchmarks/vs_trl.py --model models/smollm2-135m --prompts 4 --new-tokens 256

Both systems get the same tiny Qwen2 (4 layers, hidden 128, the project's tokenizer, the same
random initial weights), the same arithmetic prompts, 16 prompts x 8 responses per step, every
response exactly ``--new-tokens`` long (EOS ignored), one optimizer step per rollout,
Clip-Higher 0.2 / 0.28, no KL, AdamW at the same learning rate. Repetitions alternate (TRL,
then this project, with fresh weights each time) so drift in the machine hits both alike. Per
system: the median seconds per step over every timed step, and tokens/s (generated tokens, the
same count for both), and the seconds per step spent generating (for TRL, time inside the
model's ``generate``) and in the rest (log-probs, loss, backward, optimizer, rewards). Prints
the figures as text, then one JSON line.

``--model DIR`` gives both systems a saved Hugging Face model instead (e.g. SmolLM2-135M from
``dapo model import``); its prompts are the arith task in chat form (``arith.prompt=chat``),
rendered with the model's chat template for both.

Where the work is not exactly equal (each listed again in the output):
- rewards: TRL calls the verifier in-process; this project grades in its worker process
  (reward.workers=1, its default), paying the round trip.
- pi_old: with one optimizer step per rollout TRL takes pi_old = the current log-probs,
  detached, with no extra pass; this project uses its defaults (see ``--ours``).
- TRL's activation checkpointing (its default) is turned off: this project has none.
- TRL's generation is transformers ``generate``; TRL's ``use_transformers_paged`` and vLLM are
  not used (vLLM needs a GPU; paged generation is a separate option of both systems).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

GROUP = 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the same for both systems


def build(seed: int = 0, model_dir: str = ""):
    from dapo.models import demo

    if model_dir:
        from pathlib import Path

        from transformers import AutoModelForCausalLM

        from dapo.models.policy import tokenizer_from_dir

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return model, tokenizer_from_dir(Path(model_dir))
    tokenizer = demo.build_tokenizer()
    spec = demo.TinyModelSpec(hidden_size=128, intermediate_size=256, num_layers=4)
    return demo.tiny_qwen2(tokenizer, spec, seed=seed), tokenizer


def our_config(prompts: int, new_tokens: int, extra: list[str]):
    from dapo.config import load_config

    return load_config(
        None,
        [
            f"rollout.group_size={GROUP}",
            f"rollout.max_new_tokens={new_tokens}",
            "rollout.ignore_eos=true",
            "sampling.dynamic=false",
            f"train.prompts_per_step={prompts}",
            f"train.responses_per_minibatch={prompts * GROUP}",
            "train.epochs=1",
            "algo.eps_low=0.2",
            "algo.eps_high=0.28",
            "algo.kl_coef=0",
            "optim.lr=1e-5",
            "optim.warmup_steps=0",
            *extra,
        ],
    )


def time_ours(model, tokenizer, problems, cfg, steps: int, warmup: int) -> list[tuple]:
    from dapo.reward.pool import RewardPool
    from dapo.training.state import build_state
    from dapo.training.step import train_step

    state = build_state(cfg, model.to(DEVICE), tokenizer, problems)
    times = []
    with RewardPool(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s) as pool:
        state.pool = pool
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            metrics = train_step(state)
            if i >= warmup:
                times.append((time.perf_counter() - t0, metrics["perf/generate_s"]))
            assert (
                metrics["sampling/tokens_generated"]
                == cfg.responses_per_step * cfg.rollout.max_new_tokens
            )
    return times


def time_trl(
    model, tokenizer, problems, new_tokens: int, steps: int, warmup: int, microbatch: int = 0
) -> list[tuple]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dapo.data.prompts import render_prompt
    from dapo.reward.tasks.math_dapo import math_score

    def reward(completions, answer, **_):
        return [math_score(c, a).score for c, a in zip(completions, answer, strict=True)]

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[tuple] = []
            self.gen = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.gen = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kw):
            self.times.append((time.perf_counter() - self.t0, self.gen))

    timer = StepTimes()
    generate = model.generate

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            timer.gen += time.perf_counter() - t

    model.generate = timed_generate

    rows = len(problems) // (warmup + steps) * GROUP  # the problems are all the steps' prompts
    data = Dataset.from_dict(
        {
            "prompt": [render_prompt(tokenizer, p) for p in problems],
            "answer": [p.answer for p in problems],
        }
    )
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            # One rollout of all rows, one optimizer step, in micro-batches if asked.
            per_device_train_batch_size=microbatch or rows,
            gradient_accumulation_steps=rows // (microbatch or rows),
            num_generations=GROUP,
            max_completion_length=new_tokens,
            generation_kwargs={"min_new_tokens": new_tokens},
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            loss_type="dapo",
            epsilon=0.2,
            epsilon_high=0.28,
            beta=0.0,
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            max_steps=warmup + steps,
            num_iterations=1,
            use_cpu=DEVICE == "cpu",
            bf16=False,
            report_to="none",
            save_strategy="no",
            logging_steps=1_000_000,
            disable_tqdm=True,
            dataloader_num_workers=0,
            # TRL defaults to activation checkpointing (a second forward in backward): off, as
            # this project has none.
            gradient_checkpointing=False,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        trainer.train()
    assert len(timer.times) == warmup + steps, timer.times
    return timer.times[warmup:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="alternating repetitions (default 3)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per repetition (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps (default 1)")
    ap.add_argument("--new-tokens", type=int, default=32, help="response length (default 32)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--model", default="", help="a Hugging Face model directory (default: tiny)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (default 16)")
    ap.add_argument(
        "--trl-microbatch",
        type=int,
        default=0,
        help="TRL's rows per forward/backward (default 0: all; its full-vocabulary logits of "
        "32 rows x 344 tokens of SmolLM2 exceed 24 GB)",
    )
    ap.add_argument(
        "--ours",
        nargs="*",
        default=[],
        metavar="section.field=value",
        help="extra overrides of this project's config (e.g. train.recompute_old_logprobs=true)",
    )
    args = ap.parse_args(argv)
    try:
        import trl
    except ImportError:
        print("benchmarks/vs_trl.py needs TRL: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    from dapo.reward.tasks import arith

    chat = dict(prompt="chat", max_terms=3) if args.model else {}
    pairs = arith.make_splits((args.warmup + args.steps) * args.prompts, 1, 0, seed=1234, **chat)[0]
    problems = [p for p, _ in pairs]
    cfg = our_config(args.prompts, args.new_tokens, args.ours)
    base, tokenizer = build(model_dir=args.model)
    results: dict[str, list[tuple]] = {"trl": [], "dapo": []}
    for rep in range(args.reps):
        trl_times = time_trl(
            copy.deepcopy(base),
            tokenizer,
            problems,
            args.new_tokens,
            args.steps,
            args.warmup,
            args.trl_microbatch,
        )
        our_times = time_ours(
            copy.deepcopy(base), tokenizer, problems, cfg, args.steps, args.warmup
        )
        results["trl"] += trl_times
        results["dapo"] += our_times
        print(
            f"rep {rep + 1}/{args.reps}: TRL "
            + " ".join(f"{t:.2f}" for t, _ in trl_times)
            + " s | dapo "
            + " ".join(f"{t:.2f}" for t, _ in our_times)
            + " s",
            flush=True,
        )
    tokens = args.prompts * GROUP * args.new_tokens
    summary = {
        name: {
            "median_step_s": statistics.median(t for t, _ in times),
            "gen_tokens_per_s": tokens / statistics.median(t for t, _ in times),
            "generate_s": statistics.median(g for _, g in times),
            "rest_s": statistics.median(t - g for t, g in times),
            "steps_timed": len(times),
        }
        for name, times in results.items()
    }
    ratio = summary["dapo"]["gen_tokens_per_s"] / summary["trl"]["gen_tokens_per_s"]
    print(
        f"\n{args.prompts} prompts x {GROUP} responses x {args.new_tokens} tokens = {tokens} "
        f"generated tokens per step; threads {torch.get_num_threads()}; trl {trl.__version__}, "
        f"transformers {transformers.__version__}, torch {torch.__version__}"
    )
    for name, s in summary.items():
        print(
            f"{name:>5}: median {s['median_step_s']:.3f} s/step (generate {s['generate_s']:.3f}, "
            f"rest {s['rest_s']:.3f}), {s['gen_tokens_per_s']:,.0f} tokens/s "
            f"({s['steps_timed']} steps)"
        )
    print(f"ratio (dapo tokens/s over TRL's): {ratio:.2f}")
    print(
        json.dumps(
            {
                "summary": summary,
                "ratio": ratio,
                "model": args.model or "tiny",
                "ours_overrides": args.ours,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
