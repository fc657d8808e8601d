"""How a rank's gradients are weighted before a bucket is summed: each reduction's own choice.

A reduction (:mod:`phalanx.parallel.reductions`) answers :meth:`Reduction.weights` with one of
these; the engine only asks it for this step's weight and hands it each summed bucket.

* :class:`ShareWeights`: rank ``r`` contributes ``n_r / N`` of its mean gradient, so the plain sum
  over ranks is the global-batch average even when ranks hold different numbers of samples. The
  global count ``N`` of the first synchronised step is summed by a tiny allreduce launched at
  forward time. Every bucket's trailer also carries the counts, so after each step all ranks know
  that step's ``N``; with ``predict=True`` (for exact, linear sums of float32/float64 buckets) the
  next step is weighted with the last ``N`` and needs no count allreduce at all. Should the count
  differ after all (a short last batch), every rank sees so in the trailer and rescales its summed
  buckets by ``N_assumed / N``, which gives the same average up to rounding.
* :class:`SampleWeights`: rank ``r`` contributes ``n_r`` times its mean gradient and no collective
  runs among ranks; the receiver divides the sum by the summed counts (a parameter server).

Weights are applied before the sum, so a reduction that casts after them ("divide first") cannot
overflow where the average itself would not.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from phalanx.comm import collectives, runtime
from phalanx.parallel.buckets import Bucket


class Weights(Protocol):
    """The weighting of this rank's gradients over a step, as the engine drives it."""

    def bind(self, params: Sequence[torch.nn.Parameter]) -> None: ...
    def count(self, local_samples: int, syncing: bool) -> None: ...
    def weight(self) -> float: ...
    def local_samples(self) -> int: ...
    def settle(self, bucket: Bucket, total: int) -> None: ...
    def end_step(self, total: int | None) -> None: ...
    def reset(self) -> None: ...


class ShareWeights:
    """Each rank's share ``n_r / N`` of the global batch (see the module's docstring)."""

    def __init__(self, predict: bool):
        self.predict = predict
        self._can_predict = False
        self._predicted_total: int | None = None  # last step's global count: this step's assumed one
        self._start_step()

    def bind(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._can_predict = self.predict and all(p.dtype in (torch.float32, torch.float64) for p in params)

    def _start_step(self) -> None:
        self._local = 0
        self._count_handle: Any = None
        self._counted = False  # a training forward registered samples for the coming synchronised step
        self._assumed_total: int | None = None  # the count this step's weights assumed, if any

    def count(self, local_samples: int, syncing: bool) -> None:
        """A training forward of ``local_samples``; start summing the global count unless it is known."""
        self._local += local_samples
        if syncing and runtime.size() > 1:
            self._counted = True
            if self._predicted_total is None:
                count = torch.tensor([self._local], dtype=torch.int64)
                self._count_handle = collectives.allreduce_(count, "sum", async_op=True, check=False)

    def local_samples(self) -> int:
        return self._local

    def weight(self) -> float:
        """This step's weight, resolved when its backward starts."""
        self._assumed_total = None
        if self._count_handle is not None:
            total = int(self._count_handle.wait())
            return self._local / total if total else 0.0
        if self._counted and self._predicted_total is not None:
            self._assumed_total = self._predicted_total  # checked against the trailers once summed
            return self._local / self._predicted_total
        return 1.0 / runtime.size()

    def settle(self, bucket: Bucket, total: int) -> None:
        """Where the weights assumed another (non-zero) count than the ``total`` summed, rescale."""
        if self._assumed_total is not None and total not in (0, self._assumed_total):
            bucket.flat[: bucket.gradient_numel].mul_(self._assumed_total / total)

    def end_step(self, total: int | None) -> None:
        """Remember this step's global count, to weight the next step with it.

        Every rank holds the same summed trailer, so every rank makes the same decision here and
        all of them skip (or launch) the next count allreduce together. Counts above 2**24 are
        not exact in a float32 trailer, and a step without samples cannot be rescaled later.
        """
        exact = total is not None and self._can_predict and runtime.size() > 1 and 0 < total < 2**24
        self._predicted_total = total if exact else None
        self._start_step()

    def reset(self) -> None:
        """Forget the step in progress and the count learnt (the group changed)."""
        self._predicted_total = None
        self._start_step()


class SampleWeights:
    """Each rank's sample count ``n_r``, with no collective: the receiver divides by the summed counts."""

    def __init__(self) -> None:
        self._local = 0

    def bind(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Nothing depends on the parameters."""

    def count(self, local_samples: int, syncing: bool) -> None:
        self._local += local_samples

    def local_samples(self) -> int:
        return self._local

    def weight(self) -> float:
        return float(self._local)

    def settle(self, bucket: Bucket, total: int) -> None:
        """The receiver already divided."""

    def end_step(self, total: int | None) -> None:
        self._local = 0

    def reset(self) -> None:
        self._local = 0
