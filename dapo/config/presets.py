"""Presets: plain functions that set fields of a :class:`~dapo.config.Config` in place.

Two kinds, applied in this order by :func:`dapo.config.load_config`:

- a base scale (``run.base``): ``paper`` (the dataclass defaults, the paper's Qwen2.5-32B
  setup) or ``demo`` (the embedded CPU task, minutes);
- an algorithm (``run.preset``): ``dapo``, ``grpo`` (the spec's naive baseline), or one of
  DAPO's successors, ``dr_grpo``, ``gspo`` and ``cispo``.

Each returns the config it was given, so ``demo(Config())`` reads naturally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dapo.config.sections import Config


def paper(cfg: Config) -> Config:
    """The paper's Qwen2.5-32B setup (spec, "Paper hyper-parameters"): the dataclass defaults."""
    cfg.run.base = "paper"
    return cfg


def demo(cfg: Config) -> Config:
    """The embedded CPU demo: a 0.3M-parameter Qwen2 on 2- to 5-term additions, minutes.

    L_max 28 with L_cache 8 leaves 20 tokens penalty-free, room for the longest correct answer
    (18 tokens with EOS), so the soft punishment only bites on responses that wander.
    """
    cfg.run.base = "demo"
    cfg.embedded.sft_steps = 200
    cfg.rollout.group_size = 16
    cfg.rollout.max_new_tokens = 28
    cfg.algo.l_cache = 8
    cfg.train.steps = 120
    cfg.train.prompts_per_step = 32
    cfg.train.responses_per_minibatch = 128
    cfg.train.tokens_per_microbatch = 16384
    cfg.sampling.prompts_per_round = 40
    # float32 on CPU: the sampler's log-probs are the forward pass's to 1e-6 (checked at step 1).
    cfg.train.recompute_old_logprobs = False
    cfg.optim.lr = 3e-4
    cfg.optim.warmup_steps = 2
    cfg.optim.weight_decay = 0.0
    cfg.eval.every = 20
    cfg.eval.num_samples = 4
    # The demo measures the policy it trains: samples at the training temperature, no top-p
    # (the paper's protocol, top_p 0.7, is the paper base's default).
    cfg.eval.top_p = 1.0
    return cfg


def dapo(cfg: Config) -> Config:
    """DAPO: Clip-Higher, token-level loss, soft overlong punishment, dynamic sampling, no KL."""
    cfg.run.preset = "dapo"
    defaults = type(cfg.algo)()  # the fields' defaults: the paper's
    cfg.algo.eps_low, cfg.algo.eps_high = defaults.eps_low, defaults.eps_high
    cfg.algo.loss_agg = "token-mean"
    cfg.algo.adv_norm, cfg.algo.ratio_level, cfg.algo.loss_fn = "group", "token", "clip"
    cfg.algo.kl_coef = 0.0
    cfg.algo.overlong_shaping = True
    cfg.algo.overlong_filter = False
    cfg.sampling.dynamic = True
    return cfg


def grpo(cfg: Config) -> Config:
    """The spec's naive baseline: symmetric clip, sample-level loss, a KL penalty to a frozen
    reference, hard -1 for truncated responses, no dynamic sampling."""
    cfg.run.preset = "grpo"
    # Every field another preset sets: over a saved config.yaml (which lists them all) of a
    # cispo or gspo run, grpo kept its loss_fn, ratio_level and eps_low.
    cfg.algo.eps_low = cfg.algo.eps_high = type(cfg.algo)().eps_low
    cfg.algo.adv_norm, cfg.algo.ratio_level, cfg.algo.loss_fn = "group", "token", "clip"
    cfg.algo.loss_agg = "seq-mean-token-mean"
    cfg.algo.kl_coef = 0.001  # verl's GRPO default kl_loss_coef
    cfg.algo.overlong_shaping = False
    cfg.algo.overlong_filter = False
    cfg.sampling.dynamic = False
    return cfg


# DAPO's successors: each is DAPO (dynamic sampling, soft overlong punishment, no KL) with
# its one change to the objective, so that a comparison isolates that change.


def dr_grpo(cfg: Config) -> Config:
    """Dr. GRPO (Liu et al., 2025): no std normalisation of the advantage, and each response's
    loss summed and divided by the constant L_max instead of its own length."""
    dapo(cfg)
    cfg.run.preset = "dr_grpo"
    cfg.algo.adv_norm = "none"
    cfg.algo.loss_agg = "seq-mean-token-sum-norm"
    return cfg


def gspo(cfg: Config) -> Config:
    """GSPO (Zheng et al., 2025): the length-normalised sequence-level ratio, clipped at
    3e-4 / 4e-4, averaged over responses."""
    dapo(cfg)
    cfg.run.preset = "gspo"
    cfg.algo.ratio_level = "sequence"
    cfg.algo.eps_low, cfg.algo.eps_high = 3e-4, 4e-4
    cfg.algo.loss_agg = "seq-mean-token-mean"
    return cfg


def cispo(cfg: Config) -> Config:
    """CISPO (MiniMax-M1, 2025): the clipped ratio as a stop-gradient weight on log pi, so no
    token's gradient is dropped; no lower bound (eps_low = 1), DAPO's eps_high 0.28 kept as the
    upper one, token-level mean."""
    dapo(cfg)
    cfg.run.preset = "cispo"
    cfg.algo.loss_fn = "cispo"
    cfg.algo.eps_low = 1.0
    return cfg


BASES: dict[str, Callable[[Config], Config]] = {"paper": paper, "demo": demo}
ALGORITHMS: dict[str, Callable[[Config], Config]] = {
    "dapo": dapo,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "gspo": gspo,
    "cispo": cispo,
}
