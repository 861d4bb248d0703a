"""Every metric a run logs, with its meaning: the source of ``docs/reference/metrics.md``.

A metric is named ``area/name`` and written once per step to ``metrics.jsonl``, TensorBoard
and W&B; ``SUMMARY`` lists the keys of a run's ``summary.json``. ``tests/test_metric_docs.py``
keeps these tables and the code in step both ways: every name a training run logs is here,
and every name here is one the code writes.
"""

from __future__ import annotations

AREAS: dict[str, str] = {
    "rollout": "What the policy generated this step, over every response of every round.",
    "reward": "The verifier's health.",
    "sampling": "What dynamic sampling did and what it cost (DAPO §3.2).",
    "train": "The updates: loss, entropy, optimisation.",
    "clip": "The clipped objective (Clip-Higher, DAPO §3.1; dual-clip).",
    "mismatch": "Rollout correction, for engines whose log-probs are not the trainer's (vllm).",
    "val": "Held-out evaluation, on evaluation steps only (step 0, every eval.every, the end).",
    "async": "Generation ahead of training (train.async_staleness > 0 or dist.rollout_ranks "
    "only): how old the sampling weights were (who waited: perf/*_idle_s).",
    "perf": "Where the step's time went. With tools/seconds, the only metrics that differ "
    "between identical runs.",
    "tools": "Tool calls in multi-turn episodes (env.class only), per response of the step.",
    "episode": "Multi-turn episodes (env.class only): turns and the environment's tokens.",
}

METRICS: dict[str, str] = {
    # rollout
    "rollout/accuracy": "Share of the step's responses graded correct (all rounds, kept or not).",
    "rollout/reward_mean": "Mean shaped reward R_correct + R_length of those responses.",
    "rollout/response_len_mean": "Mean response length in tokens (the model's: an "
    "environment's observations are not counted).",
    "rollout/response_len_max": "Longest response in tokens (the model's).",
    "rollout/truncated_frac": "Share of responses with no stop token within L_max "
    "(rollout.max_new_tokens).",
    # reward
    "reward/faults": "Responses whose verifier raised, hung past reward.timeout_s, ran out "
    "of reward.memory_mb or scored beyond reward.max_abs: graded incorrect, and training goes "
    "on.",
    # sampling
    "sampling/rounds": "Generation rounds this step (1 without dynamic sampling).",
    "sampling/prompts_drawn": "Prompts drawn over the rounds.",
    "sampling/groups_mixed": "Groups with 0 < #correct < G, the ones dynamic sampling keeps.",
    "sampling/groups_kept": "Groups trained on: N (train.prompts_per_step), or fewer when "
    "sampling.on_max_rounds=train ran out of rounds.",
    "sampling/kept_frac": "groups_kept / prompts_drawn.",
    "sampling/groups_surplus": "Mixed groups drawn beyond N and dropped (over-sampling's margin).",
    "sampling/exhausted": "1 when sampling.max_rounds ran out before N groups were kept "
    "(with sampling.on_max_rounds=train), else 0.",
    "sampling/tokens_generated": "Tokens generated this step, every response counted (the "
    "model's: an environment's observations are not generated).",
    "sampling/tokens_per_kept_group": "tokens_generated / groups_kept: what a kept group cost "
    "(null when none was kept).",
    "sampling/all_correct_frac": "Share of the step's groups (all rounds) whose responses are "
    "all correct: zero advantage, no gradient.",
    "sampling/all_wrong_frac": "Share of the step's groups (all rounds) whose responses are all "
    "wrong: zero advantage unless shaping separates them.",
    "sampling/groups_with_gradient": "Trained groups with a nonzero advantage on a response "
    "the loss keeps (not masked by overlong filtering): the "
    "effective batch (groups_kept with dynamic sampling; fewer without it as groups become all "
    "right).",
    # train
    "train/loss": "Mean policy loss over the step's updates (-J, plus the KL term for GRPO).",
    "train/entropy": (
        "Mean entropy of the policy's token distribution per trained token (null in a step "
        "that trained no token: loss, token_prob_mean, kl and clip/* too)."
    ),
    "train/token_prob_mean": "Mean pi_old probability of the trained tokens.",
    "train/grad_norm": "Mean gradient norm over the updates applied, before clipping (null "
    "when none was).",
    "train/lr": "Learning rate of the step (after warm-up).",
    "train/updates": "Optimizer updates applied this step.",
    "train/skipped_updates": "Updates skipped for a non-finite loss or gradient norm.",
    "train/tokens": "Response tokens trained on per epoch (the token-level loss's divisor "
    "summed over mini-batches).",
    "train/kl": "k3 estimate of KL(pi_theta || pi_ref), averaged as the loss aggregates its "
    "KL term (algo.loss_agg): per token under token-mean, a mean of per-sequence means under "
    "seq-mean-token-mean (the GRPO baseline); only with a reference model (algo.kl_coef > 0).",
    "train/sampler_logprob_gap": "Largest gap between the sampler's log-probs and a forward "
    "pass, checked on a process's first step when train.recompute_old_logprobs=false.",
    "train/scaler_overflows": "float16 only: updates skipped because the scaled gradient "
    "overflowed (the loss scale is halved; not counted toward train.max_consecutive_skips).",
    "train/loss_scale": "float16 only: the loss scaler's scale after the step.",
    # clip
    "clip/low_frac": "Share of trained tokens where the lower clip 1 - eps_low is active.",
    "clip/high_frac": "Share of trained tokens where the upper clip 1 + eps_high is active.",
    "clip/high_prob_mean": "Mean pi_old probability of the up-clipped tokens (the paper's "
    "Clip-Higher diagnostic); null on a step with no up-clipped token.",
    "clip/dual_frac": "Share of trained tokens capped by dual-clip (algo.clip_ratio_c).",
    # mismatch
    # async
    "async/staleness_mean": "Mean over the step's kept groups of the training steps (not "
    "optimizer updates: a step makes train/updates of them) between the weights that drew "
    "them and the weights trained: min(step - 1, k) under the fixed schedule, where step s "
    "samples from the weights after max(0, s - 1 - k) steps.",
    "async/staleness_max": "The largest of those.",
    "mismatch/abs_log_ratio": "Mean |log pi_old - log pi_rollout| per trained token.",
    "mismatch/kl": "k3 estimate of KL(pi_rollout || pi_old) from the sampled tokens.",
    "mismatch/corrected_frac": "Share of trained tokens whose correction weight was truncated "
    "(TIS) or zeroed (MIS).",
    # val
    "val/accuracy": "Held-out avg@k: the mean over problems of the share of k samples "
    "graded correct (k = eval.num_samples).",
    "val/accuracy_low": "Lower end of val/accuracy's 95% bootstrap interval over problems "
    "(Wilson's score interval where every problem scores the same).",
    "val/accuracy_high": "Upper end of val/accuracy's 95% bootstrap interval over problems.",
    "val/pass@{k}": "Held-out pass@k (unbiased estimator, Chen et al. 2021), k = "
    "eval.num_samples: the metric's name carries the number, val/pass@4 on the demo.",
    "val/maj@k": "Held-out majority vote over the k extracted answers, equal answers as one "
    "vote under math_verify (a response without one does not vote; absent when no response "
    "had one, e.g. a reward function returning a bool or a float, or the code task).",
    "val/response_len_mean": "Mean held-out response length in tokens.",
    "val/truncated_frac": "Share of held-out responses truncated at eval.max_new_tokens.",
    "val/num_problems": "Distinct held-out problems evaluated.",
    "val/num_samples": "Samples per problem, k.",
    "val/reward_faults": "Held-out responses whose verifier faulted (graded incorrect).",
    "val/tool_call_frac": "Share of held-out episodes that called a tool (env.class only).",
    # tools and episodes (env.class)
    "tools/calls_per_response": "Tool calls per response (every response of the step).",
    "tools/call_frac": "Share of responses that called a tool at least once.",
    "tools/error_frac": "Share of tool calls that failed: an exception, the deadline "
    "(env.tool_wall_s) or a limit.",
    "tools/seconds": "Seconds the step's tool calls took, summed (they run env.workers at a "
    "time, so more than the wall-clock time they cost): a timing, which differs between "
    "identical runs as perf/* do.",
    "episode/turns": "Model turns per response.",
    "episode/env_tokens": "Tokens the environment wrote per response (observations: context, "
    "never trained, outside the loss's divisor and the overlong shaping's length).",
    # perf
    "perf/step_s": "Seconds of the step; the phases below add up to it. Drawn ahead "
    "(train.async_staleness > 0, dist.rollout_ranks), trainer_idle_s, logprobs_s, train_s and "
    "other_s add up to it, and generate_s and reward_s are the generator's, overlapped.",
    "perf/generate_s": "Seconds generating (every round); drawn ahead, the generator's.",
    "perf/reward_s": "Seconds grading the responses; drawn ahead, the generator's.",
    "perf/logprobs_s": "Seconds of the pi_old / pi_ref forward passes.",
    "perf/train_s": "Seconds of the updates (forward, backward, optimizer).",
    "perf/other_s": "Seconds of the rest of the step.",
    "perf/gen_tokens_per_s": "Generated tokens per second of generation.",
    "perf/train_tokens_per_s": "Trained tokens per second of training.",
    "perf/gen_padding_frac": "Share of generation slots computed after their response ended.",
    "perf/train_padding_frac": "Share of micro-batch positions that are padding (null when "
    "the step computed none).",
    "perf/weight_sync_s": "Seconds giving the engine the new weights (vllm; the gathered "
    "copy under FSDP).",
    "perf/trainer_idle_s": "Drawn ahead only: seconds the trainer waited for this step's rollouts.",
    "perf/generator_idle_s": "Drawn ahead only: seconds the generator waited for the weights "
    "of this step's rollouts before drawing them.",
    "perf/threads": "torch threads used this step (run.threads=0 follows the free cores).",
}


SUMMARY: dict[str, str] = {
    "steps": "Steps trained.",
    "val/accuracy_start": "val/accuracy at step 0, the starting policy.",
    "val/accuracy_end": "val/accuracy at the last evaluation.",
    "train_seconds": "Seconds of the whole run, over every process of a resumed one.",
    "gen_tokens": "Tokens generated for training (what train.max_gen_tokens limits).",
    "step_seconds": "Seconds of the training steps (what train.max_seconds limits).",
    "limits": "What the run was asked for: steps, max_gen_tokens, max_seconds (dapo ablate "
    "tells a finished run by them).",
}
"""The keys of a run's ``summary.json``, written when it ends."""


def metric_pattern(name: str) -> str | None:
    """The catalogue entry a logged name belongs to: ``val/pass@8`` -> ``val/pass@{k}``."""
    if name in METRICS:
        return name
    area, _, rest = name.partition("/")
    if area == "val" and rest.startswith("pass@") and rest[5:].isdigit():
        return "val/pass@{k}"
    return None
