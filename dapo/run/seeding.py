"""Seeds derived from names, so that a resumed run repeats the sequence of an uninterrupted one.

Rollouts are seeded from (run seed, step, round), mini-batch orders from (seed, step), the
held-out evaluation from (seed, "eval"): no random state has to carry over between steps.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from (run seed, step, round, ...), so a resumed run repeats the sequence."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
