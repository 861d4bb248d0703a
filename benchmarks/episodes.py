"""Multi-turn episodes on the native engine: continued from parked KV caches, or computed
again from the start of the episode at every turn.

    python benchmarks/episodes.py                                    # the embedded demo model
    python benchmarks/episodes.py --model models/smollm2-135m --rows 32 --new-tokens 512
    python benchmarks/episodes.py --model DIR --device cuda --json

The environment ends a model turn at ``--turn-end`` (a piece the model writes often: "." by
default) and answers with a fixed observation of about ``--observation-tokens`` tokens, up to
``--turns`` model turns; the model's EOS ends an episode. Both ways draw the same episodes
from the same seeds (checked: the rows whose tokens differ, by rounding, are counted), so the
work is equal but for what each prefill computes. For each repetition both run, their order
reversed on every other one; the figures are medians: seconds per rollout, episode tokens per
second (model and environment tokens), and the prefill positions computed (rows x columns
of every forward pass wider than one token).

Prints a line per measurement and a summary; with ``--json`` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from engines import log, prepare, prompts_for

from dapo.data.problems import Problem
from dapo.env import Environment, History, Observation
from dapo.rollout import make_engine
from dapo.rollout.episodes import EpisodeRunner, with_turn_ends


class Echo(Environment):
    """Ends a turn at ``turn_end`` and answers ``text``; the model's EOS ends the episode."""

    def __init__(self, turn_end: str, text: str) -> None:
        self.turn_ends, self.text = (turn_end,), text

    def step(self, history: History) -> Observation:
        if history.finished:
            return Observation(done=True)
        return Observation(self.text, tool_call=True)


def count_prefills(model: torch.nn.Module) -> list[int]:
    """A list that every forward pass wider than one position adds its rows x columns to."""
    seen: list[int] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            seen.append(ids.numel())

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def run_once(runner: EpisodeRunner, prompts, problems, args, seed: int, prefills: list[int]):
    """(seconds, rollout, prefill positions) of one rollout of episodes."""
    prefills.clear()
    t0 = time.perf_counter()
    rollout = runner.generate(
        problems, prompts, group_size=args.group, max_new_tokens=args.new_tokens, seed=seed
    )
    if runner.engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, rollout, sum(prefills)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="", help="a Hugging Face model directory (default: demo)")
    ap.add_argument("--rows", type=int, default=32, help="rows per rollout (default 32)")
    ap.add_argument("--group", type=int, default=4, help="episodes per prompt (default 4)")
    ap.add_argument("--new-tokens", type=int, default=256, help="L_max (default 256)")
    ap.add_argument("--turns", type=int, default=4, help="model turns at most (default 4)")
    ap.add_argument("--turn-end", default=".", help='what ends a turn (default ".")')
    ap.add_argument("--observation-tokens", type=int, default=16, help="(default 16)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument(
        "--chat",
        action="store_true",
        help="chat prompts (default: plain text, which a base model continues at length)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    args = ap.parse_args(argv)
    if args.rows % args.group:
        ap.error(f"--rows {args.rows} is not a multiple of --group {args.group}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device, model, tokenizer = prepare(args)
    prompts = prompts_for(tokenizer, args.rows // args.group, chat=args.chat)
    problems = [Problem(f"p{i}", (), "", "arith") for i in range(len(prompts))]
    env = Echo(
        args.turn_end, "\n```output\n" + " 7" * max(1, args.observation_tokens - 4) + "\n```\n"
    )
    stops = with_turn_ends([tokenizer.eos_token_id], tokenizer, env)
    runners = {}
    for way in ("parked", "again"):
        engine = make_engine("dapo", model, tokenizer, stops, device=device)
        engine.continues_from_cache = way == "parked"
        runners[way] = EpisodeRunner(engine, tokenizer, env, max_turns=args.turns)
    prefills = count_prefills(model)
    for runner in runners.values():  # kernels chosen and loaded before any timing
        run_once(
            runner,
            prompts[:1],
            problems[:1],
            argparse.Namespace(**{**vars(args), "new_tokens": 8}),
            0,
            prefills,
        )
    figures: dict[str, dict[str, list[float]]] = {
        way: {"seconds": [], "tokens_per_s": [], "prefill_positions": []} for way in runners
    }
    differ = turns = env_tokens = tokens = 0
    for rep in range(args.reps):
        order = list(runners) if rep % 2 == 0 else list(runners)[::-1]
        results = {}
        for way in order:
            seconds, rollout, positions = run_once(
                runners[way], prompts, problems, args, rep, prefills
            )
            results[way] = rollout
            n = int(rollout.lengths_B.sum())
            figures[way]["seconds"].append(seconds)
            figures[way]["tokens_per_s"].append(n / seconds)
            figures[way]["prefill_positions"].append(positions)
            log(
                f"rep {rep + 1}/{args.reps} {way}: {seconds:.2f} s, {n / seconds:,.1f} tokens/s, "
                f"{positions:,} prefill positions"
            )
        a, b = (results[w].samples() for w in ("parked", "again"))
        differ += sum(
            x.response_ids.tolist() != y.response_ids.tolist() for x, y in zip(a, b, strict=True)
        )
        turns += sum(s.trace.turns for s in a)
        env_tokens += sum(s.trace.env_tokens for s in a)
        tokens += sum(len(s.response_ids) for s in a)
    rows = args.rows * args.reps
    summary = {
        "model": args.model or "embedded demo",
        "device": str(device),
        "rows": args.rows,
        "new_tokens": args.new_tokens,
        "turns_per_episode": turns / rows,
        "tokens_per_episode": tokens / rows,
        "env_tokens_per_episode": env_tokens / rows,
        "rows_that_differ": differ,
        **{
            f"{way}_{name}": statistics.median(values)
            for way, by_name in figures.items()
            for name, values in by_name.items()
        },
    }
    summary["speedup"] = summary["again_seconds"] / summary["parked_seconds"]
    print(
        f"{summary['model']} on {device}: {args.rows} episodes, "
        f"{summary['turns_per_episode']:.2f} turns and {summary['tokens_per_episode']:.1f} tokens "
        f"each ({summary['env_tokens_per_episode']:.1f} from the environment)\n"
        f"  parked caches: {summary['parked_seconds']:.2f} s "
        f"({summary['parked_tokens_per_s']:,.1f} tokens/s, "
        f"{summary['parked_prefill_positions']:,.0f} prefill positions)\n"
        f"  computed again: {summary['again_seconds']:.2f} s "
        f"({summary['again_tokens_per_s']:,.1f} tokens/s, "
        f"{summary['again_prefill_positions']:,.0f} prefill positions)\n"
        f"  speed-up x{summary['speedup']:.2f}; rows that differ (rounding): {differ} of {rows}"
    )
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
