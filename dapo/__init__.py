"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025).

Where each technique lives:

- Clip-Higher, token-level loss, KL penalty, entropy: :mod:`dapo.algo`
- Soft overlong punishment and overlong filtering: :mod:`dapo.algo` (``overlong_penalty``)
  applied in :mod:`dapo.trainer`
- Dynamic sampling: :mod:`dapo.sampling` (the filter itself is ``dapo.algo.mixed_groups``)
- Rule-based reward: :mod:`dapo.rewards`
"""

__version__ = "0.1.0"
