"""Held-out evaluation: sampling and grading k responses per problem, the per-problem metrics
(avg@k, pass@k, maj@k) and their intervals."""
