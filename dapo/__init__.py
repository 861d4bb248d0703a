"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025).

Where each technique lives:

- Clip-Higher, token-level loss, KL penalty: :mod:`dapo.algo.losses`
- group-relative advantage and the dynamic-sampling filter: :mod:`dapo.algo.groups`; the
  sampling loop itself: :mod:`dapo.sampling`
- soft overlong punishment, overlong filtering: :mod:`dapo.algo.shaping`, applied per group
  in :mod:`dapo.trainer`
- rule-based reward: :mod:`dapo.tasks` (``math_dapo``), graded in :mod:`dapo.reward_pool`

One step is :func:`dapo.trainer.train_step` (its update phase :mod:`dapo.update`); the loop
around it is :func:`dapo.loop.fit`. ``docs/architecture.md`` draws the data flow.
"""

__version__ = "0.2.0"
