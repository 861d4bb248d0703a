"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025).

Where each technique lives:

- Clip-Higher, token-level loss, KL penalty: :mod:`dapo.algo.losses`
- group-relative advantage and the dynamic-sampling filter: :mod:`dapo.algo.groups`; the
  sampling loop itself: :mod:`dapo.train.sampling`
- soft overlong punishment, overlong filtering: :mod:`dapo.algo.shaping`, applied per group
  in :mod:`dapo.train.step`
- rule-based reward: :mod:`dapo.reward.tasks` (``math_dapo``), graded in
  :mod:`dapo.reward.pool`

One step is :func:`dapo.train.step.train_step` (its update phase :mod:`dapo.train.update`);
the loop around it is :func:`dapo.train.loop.fit`. ``docs/architecture.md`` shows the layers
of the package and draws the data flow.
"""

__version__ = "0.2.0"
