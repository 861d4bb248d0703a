"""Problems and the order they are drawn in.

A :class:`Problem` is one row of the DAPO data format (spec, "Data"): chat messages, an
integer-or-string ground truth and the ``data_source`` that picks the verifier.
:class:`PromptSampler` draws them in seeded, resumable epochs.
"""

from __future__ import annotations

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

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._permutation(self.epoch)
