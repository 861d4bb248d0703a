"""Problems and the order they are drawn in.

A :class:`Problem` is one row of the DAPO data format (spec, "Data"): chat messages, an
integer-or-string ground truth and the ``data_source`` that picks the verifier.
:class:`PromptSampler` draws them in seeded, resumable epochs.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    uid: str
    messages: tuple[dict[str, str], ...]
    answer: str
    data_source: str = "math_dapo"


class PromptSampler:
    """Draws problems in seeded epochs: a fresh permutation per epoch, no repeats within one.

    The order is a pure function of (seed, epoch), and ``state_dict`` holds only the cursor,
    so a resumed run draws exactly the prompts an uninterrupted one would.
    """

    def __init__(self, problems: list[Problem], *, seed: int) -> None:
        if not problems:
            raise ValueError("PromptSampler needs at least one problem; the data set is empty")
        self.problems = problems
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self._order = self._permutation(0)
        self.digest = problems_digest(problems)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            if self.pos == len(self._order):
                self.epoch += 1
                self.pos = 0
                self._order = self._permutation(self.epoch)
            out.append(self.problems[self._order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict[str, int | str]:
        """The cursor, and the problems it points into (their count and digest)."""
        return {
            "epoch": self.epoch,
            "pos": self.pos,
            "problems": len(self.problems),
            "digest": self.digest,
        }

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Go on from ``state``, refused when it was saved over other problems: the same cursor
        would then draw other prompts than the run it continues (or none at all)."""
        count, digest = state.get("problems", len(self.problems)), state.get("digest", self.digest)
        if count != len(self.problems) or digest != self.digest:
            raise ValueError(
                f"the run was saved drawing from {count} training problems (digest "
                f"{str(digest)[:12]}), and this run reads {len(self.problems)} (digest "
                f"{self.digest[:12]}): data.train_file changed since; resume with the file the "
                "run started with, or start a new run from its weights"
            )
        epoch, pos = int(state["epoch"]), int(state["pos"])
        if epoch < 0 or not 0 <= pos <= len(self.problems):
            raise ValueError(
                f"the saved prompt cursor (epoch {epoch}, position {pos}) is not within the "
                f"{len(self.problems)} training problems: the checkpoint is damaged"
            )
        self.epoch, self.pos = epoch, pos
        self._order = self._permutation(self.epoch)


def problems_digest(problems: list[Problem]) -> str:
    """SHA-256 of the problems in order: their uids, messages, answers and data sources."""
    h = hashlib.sha256()
    for p in problems:
        row = [p.uid, list(p.messages), p.answer, p.data_source]
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=True).encode() + b"\n")
    return h.hexdigest()
