"""``fusion_threshold_mb="auto"``: time a few thresholds during the first steps, keep the fastest.

Every rank times whole iterations (end of one synchronised backward to the end of the next)
under each candidate. The medians are reduced with MAX, since a step is as slow as its slowest
rank, and the fastest candidate is adopted; the result is the same on every rank by construction.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

import torch

from phalanx.comm import collectives

DEFAULT_CANDIDATES_MB: tuple[float, ...] = (1.0, 4.0, 16.0, 64.0, math.inf)


class FusionTuner:
    """Feeds the reducer the next threshold to try, then the winner, then nothing."""

    def __init__(self, candidates: Sequence[float] = DEFAULT_CANDIDATES_MB, steps_per_candidate: int = 3):
        self.candidates = list(candidates)
        self.steps_per_candidate = steps_per_candidate
        self.chosen: float | None = None
        self.medians: list[float] = []
        self._times: list[list[float]] = [[] for _ in self.candidates]
        self._current = 0
        self._last: float | None = None
        self._skip = 2  # the first step, and the step that lays out the observed order

    @property
    def initial(self) -> float:
        return self.candidates[0]

    def __call__(self, now: float) -> float | None:
        """Called at the end of each synchronised step; returns a threshold to switch to, or None."""
        if self.chosen is not None:
            return None
        elapsed, self._last = (None if self._last is None else now - self._last), now
        if self._skip > 0 or elapsed is None:
            self._skip = max(0, self._skip - 1)
            return None
        self._times[self._current].append(elapsed)
        if len(self._times[self._current]) < self.steps_per_candidate:
            return None
        self._current += 1
        self._skip = 1  # the first step after a switch pays for the new buffers
        if self._current < len(self.candidates):
            return self.candidates[self._current]
        return self._choose()

    def _choose(self) -> float:
        local = torch.tensor([statistics.median(times) for times in self._times], dtype=torch.float64)
        slowest = collectives.allreduce(local, "max", check=False)
        self.medians = slowest.tolist()
        self.chosen = self.candidates[int(torch.argmin(slowest))]
        return self.chosen
