"""``dapo ablate``: the paper's Table 1 and its reviewers' sweeps as ordinary runs, with seeds.

:mod:`dapo.ablate.plans` names each plan's configurations (pure: rows of overrides),
:mod:`dapo.ablate.runs` runs every (row, seed) as a ``dapo train`` process under one directory
(finished runs skipped, stopped ones resumed, K at a time), and :mod:`dapo.ablate.table`
turns their results into the table: mean over seeds, intervals, paired differences.
"""

from dapo.ablate.plans import PLANS, Row, expand

__all__ = ["PLANS", "Row", "expand"]
