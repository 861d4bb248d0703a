"""``dapo.rewards.math_score``: the name the first release gave the DAPO verifier, kept for
code that imports it. The verifiers live in :mod:`dapo.reward.tasks` (``math_dapo.py`` for
these two); ``get_verifier`` there picks one by ``data_source`` or ``reward.mode``."""

from dapo.reward.tasks import Score
from dapo.reward.tasks.math_dapo import math_score, math_score_boxed

__all__ = ["Score", "math_score", "math_score_boxed"]
