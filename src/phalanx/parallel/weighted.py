"""The weighted average: the summation of ``px.DataParallel``'s reducer in ordinary training.

The hook writes each gradient, multiplied by this rank's weight, into its bucket slot (and makes
``.grad`` a view of that slot); a complete bucket is summed over ranks by the model's
:class:`~phalanx.parallel.reductions.Reduction`; after the wait, ``.grad`` points at the sums.
How gradients are weighted is the reduction's choice (:meth:`Reduction.weights`, see
:mod:`phalanx.parallel.weights`): by default each rank's share of the global batch, so that
uneven shares still give the exact global-batch average.
"""

from __future__ import annotations

from typing import Sequence

import torch

from phalanx.parallel.buckets import Bucket, BucketState
from phalanx.parallel.reductions import Reduction, Waitable


class WeightedAverage:
    """Sample-weighted gradients in float buckets, summed over ranks by a :class:`Reduction`."""

    def __init__(self, reduction: Reduction):
        self.reduction = reduction
        self.weights = reduction.weights()
        self.params: list[torch.nn.Parameter] = []
        self._weight = 0.0

    def bind(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.weights.bind(self.params)

    def agree_order(self, observed: list[int]) -> list[int] | None:
        """The bucket order from the next step on: the reduction's to decide."""
        return self.reduction.agree_order(observed, len(self.params))

    # --- forward side ---------------------------------------------------------------------

    def expect_backward(self, local_samples: int, reduces: bool) -> None:
        """Record a training forward of ``local_samples`` (the weights may start counting globally)."""
        self.weights.count(local_samples, reduces)

    def reset(self, buckets: Sequence[Bucket]) -> None:
        """Forget the step in progress; reductions' state goes back to before a step in flight."""
        for bucket in buckets:
            if bucket.state is BucketState.IN_FLIGHT:  # launched in the step that is redone
                self.reduction.rollback(bucket.context)
        self.weights.reset()

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
        self._weight = self.weights.weight()

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
        bucket.write_trailer(self.weights.local_samples())
        return self.reduction.reduce(bucket)

    def end_backward(self, buckets: Sequence[Bucket], reduced: bool) -> None:
        """After the wait: the averages in ``.grad``; this step's count weights the next one."""
        total = None
        for bucket in buckets:
            total = self._publish(bucket)
        self.weights.end_step(total)

    def _publish(self, bucket: Bucket) -> int:
        """Point ``.grad`` at the averaged slot; parameters no rank had a gradient for keep ``None``.

        Returns the global sample count the trailer carried; the weights settle the sums with it
        first (rescaling them where they assumed another count).
        """
        used, samples = bucket.read_trailer()
        total = int(round(samples))
        self.weights.settle(bucket, total)
        for slot, index in enumerate(bucket.param_indices):
            self.params[index].grad = bucket.views[slot] if used[slot] > 0 else None
        return total
