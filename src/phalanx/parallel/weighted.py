"""The weighted average: the summation of ``px.DataParallel``'s reducer in ordinary training.

The hook writes each gradient, multiplied by this rank's weight, into its bucket slot (and makes
``.grad`` a view of that slot); a complete bucket is summed over ranks by the model's
:class:`~phalanx.parallel.reductions.Reduction`; after the wait, ``.grad`` points at the sums.

Weights make the average exact when ranks hold different numbers of samples: rank ``r``
contributes ``n_r / N`` of its mean gradient. The global count ``N`` of the first synchronised
step is summed by a tiny allreduce launched at forward time. Every bucket's trailer also carries
the sample counts, so after each step all ranks know that step's ``N``; from then on (for exact,
uncompressed sums of float32/float64 buckets) the next step is weighted with the last ``N`` and
needs no count allreduce at all: one collective and one synchronisation point fewer per step.
Should the count differ after all (a short last batch), every rank sees so in the trailer and
rescales its summed buckets by ``N_assumed / N``, which gives the same average up to rounding.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from phalanx.comm import collectives, runtime
from phalanx.parallel.buckets import Bucket, BucketState
from phalanx.parallel.reductions import Reduction, Waitable


class WeightedAverage:
    """Sample-weighted gradients in float buckets, summed over ranks by a :class:`Reduction`."""

    #: Steps follow the model's forward and backward (the forward counts the samples).
    follows_forward = True
    launching = True  # every synchronised backward sends its buckets
    step_ends = True  # and waits for them at its end

    def __init__(self, reduction: Reduction):
        self.reduction = reduction
        self.active = True  # the coming backward is synchronised (``DataParallel`` decides)
        self.params: list[torch.nn.Parameter] = []
        self._reset_counts()
        self._predicted_total: int | None = None  # last step's global count: this step's assumed one
        self._weight = 1.0 / runtime.size()

    @property
    def learns_order(self) -> bool:
        """Whether the reducer should learn the gradient order of the first step for the layout."""
        return self.reduction.follows_gradient_order

    def bind(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self._can_predict = self.reduction.rescalable and all(
            p.dtype in (torch.float32, torch.float64) for p in self.params)

    def _reset_counts(self) -> None:
        self._local_samples = 0
        self._count_handle: Any = None
        self._counted = False  # a training forward registered samples for the coming synchronised step
        self._weight_total: int | None = None  # the assumed count this step's weights used, if any

    # --- forward side ---------------------------------------------------------------------

    def expect_backward(self, local_samples: int) -> None:
        """Record a training forward of ``local_samples``; start summing the global count unless it is known."""
        self._local_samples += local_samples
        if self.active and runtime.size() > 1 and self.reduction.weights_by_share:
            self._counted = True
            if self._predicted_total is None:
                count = torch.tensor([self._local_samples], dtype=torch.int64)
                self._count_handle = collectives.allreduce_(count, "sum", async_op=True, check=False)

    def reset(self, buckets: Sequence[Bucket]) -> None:
        """Forget the step in progress; reductions' state goes back to before a step in flight."""
        for bucket in buckets:
            if bucket.state is BucketState.IN_FLIGHT:  # launched in the step that is redone
                self.reduction.rollback(bucket.context)
        self.active = True
        self._reset_counts()
        self._predicted_total = None

    # --- buckets ----------------------------------------------------------------------------

    def layout(self, groups: list[list[int]], previous: Sequence[Bucket]) -> list[Bucket]:
        """Buckets for ``groups``; reduction state (TopK residuals) and gradients move into them."""
        carried = self.carried_state(previous)
        groups = self.reduction.bucket_groups(groups, self.params)
        buckets = [Bucket.allocate(b, group, self.params) for b, group in enumerate(groups)]
        for bucket in buckets:
            bucket.context = self.reduction.join_state([carried.get(i) for i in bucket.param_indices],
                                                       self._lengths(bucket))
            for slot, index in enumerate(bucket.param_indices):
                self._adopt_gradient(self.params[index], bucket.views[slot])
        return buckets

    def carried_state(self, buckets: Sequence[Bucket]) -> dict[int, torch.Tensor]:
        """Each parameter's part of its bucket's reduction state (TopK residuals), before a re-layout."""
        carried: dict[int, torch.Tensor] = {}
        for bucket in buckets:
            parts = self.reduction.split_state(bucket.context, self._lengths(bucket))
            carried.update({index: part for index, part in zip(bucket.param_indices, parts) if part is not None})
        return carried

    def _lengths(self, bucket: Bucket) -> list[int]:
        return [self.params[index].numel() for index in bucket.param_indices]

    @staticmethod
    def _adopt_gradient(param: torch.nn.Parameter, view: torch.Tensor) -> None:
        if param.grad is not None:
            view.copy_(param.grad)
            param.grad = view

    # --- one backward -----------------------------------------------------------------------

    def begin_backward(self) -> None:
        self._weight = self._resolve_weight()

    def _resolve_weight(self) -> float:
        self._weight_total = None
        if not self.reduction.weights_by_share:  # the receiver divides by the summed counts
            return float(self._local_samples)
        if self._count_handle is not None:
            total = int(self._count_handle.wait())
            return self._local_samples / total if total else 0.0
        if self._counted and self._predicted_total is not None:
            self._weight_total = self._predicted_total  # checked against the trailers once summed
            return self._local_samples / self._predicted_total
        return 1.0 / runtime.size()

    def pack(self, bucket: Bucket, slot: int, param: torch.nn.Parameter) -> None:
        """Write this parameter's weighted gradient into its bucket slot (zero if it has none)."""
        view, grad = bucket.views[slot], param.grad
        if grad is None or self._weight == 0.0:
            view.zero_()  # also clears the NaN a mean over an empty batch produces
        elif grad.data_ptr() == view.data_ptr():
            view.mul_(self._weight)
        else:
            torch.mul(grad, self._weight, out=view)
            param.grad = view
        bucket.used[slot] = grad is not None  # the trailer is written once, at launch

    def fill(self, bucket: Bucket, slot: int) -> None:
        """No hook ran for this parameter: it sends what ``.grad`` holds (zero if nothing)."""
        self.pack(bucket, slot, self.params[bucket.param_indices[slot]])

    def complete(self, bucket: Bucket) -> None:
        """Nothing to add: the weighted gradients are in place."""

    def launch(self, bucket: Bucket) -> Waitable:
        bucket.write_trailer(self._local_samples)
        return self.reduction.reduce(bucket)

    def end_backward(self, buckets: Sequence[Bucket]) -> None:
        """After the wait: the averages in ``.grad``; this step's count weights the next one."""
        total = None
        for bucket in buckets:
            total = self._publish(bucket)
        self._learn_total(total)
        self._reset_counts()

    def _publish(self, bucket: Bucket) -> int:
        """Point ``.grad`` at the averaged slot; parameters no rank had a gradient for keep ``None``.

        Returns the global sample count the trailer carried. Where the weights assumed another
        (non-zero) count, the summed gradients are rescaled to the true one first.
        """
        used, samples = bucket.read_trailer()
        total = int(round(samples))
        if self._weight_total is not None and total not in (0, self._weight_total):
            bucket.flat[: bucket.gradient_numel].mul_(self._weight_total / total)
        for slot, index in enumerate(bucket.param_indices):
            self.params[index].grad = bucket.views[slot] if used[slot] > 0 else None
        return total

    def _learn_total(self, total: int | None) -> None:
        """Remember this step's global count, to weight the next step with it.

        Every rank holds the same summed trailer, so every rank makes the same decision here and
        all of them skip (or launch) the next count allreduce together. Counts above 2**24 are
        not exact in a float32 trailer, and a step without samples cannot be rescaled later.
        """
        if total is not None and self._can_predict and runtime.size() > 1 and 0 < total < 2**24:
            self._predicted_total = total
        else:
            self._predicted_total = None
