"""The gradient reducer: averages gradients over ranks while backpropagation runs.

Each parameter has a post-accumulate-grad hook. When a parameter's gradient is final, the hook
writes it, multiplied by this rank's weight, into its bucket (and makes ``.grad`` a view of that
slot). A bucket whose gradients are all written is launched asynchronously, strictly in bucket
order, so every rank issues the same collectives in the same order. When autograd finishes, a
callback launches the buckets still open (parameters that got no gradient contribute zero),
waits for all of them, and leaves the averaged gradients in ``.grad``.

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

import time
from typing import Any, Callable, Sequence

import torch

from phalanx.comm import collectives, runtime
from phalanx.errors import NonFiniteGradientError
from phalanx.parallel.buckets import Bucket, BucketState, plan_buckets
from phalanx.parallel.reductions import Reduction


class GradientReducer:
    """Hooks, buckets and the per-step state machine of one :class:`DataParallel` model."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], threshold_mb: float,
                 reduction: Reduction, check_finite: bool = False,
                 on_step_end: Callable[[float], float | None] | None = None):
        self.params = list(params)
        self.names = list(names)
        self.reduction = reduction
        self.check_finite = check_finite
        self.threshold_mb = threshold_mb
        self.syncing = True
        self._on_step_end = on_step_end
        self._local_samples = 0
        self._count_handle: Any = None
        self._counted = False  # a training forward registered samples for the coming synchronised step
        self._predicted_total: int | None = None  # last step's global count: this step's assumed one
        self._weight_total: int | None = None  # the assumed count this step's weights used, if any
        self._can_predict = reduction.rescalable and all(
            p.dtype in (torch.float32, torch.float64) for p in self.params)
        self._weight = 1.0 / runtime.size()
        self._in_backward = False
        self._packed: list[bool] = []
        self._next_launch = 0
        self._observed_order: list[int] | None = []
        self._buckets: list[Bucket] = []
        self._install(list(reversed(range(len(self.params)))), threshold_mb)
        self._hooks = [param.register_post_accumulate_grad_hook(self._hook_for(index))
                       for index, param in enumerate(self.params)]

    # --- forward side ---------------------------------------------------------------------

    def expect_backward(self, local_samples: int) -> None:
        """Record a training forward of ``local_samples``; start summing the global count unless it is known."""
        self._local_samples += local_samples
        if self.syncing and runtime.size() > 1:
            self._counted = True
            if self._predicted_total is None:
                count = torch.tensor([self._local_samples], dtype=torch.int64)
                self._count_handle = collectives.allreduce_(count, "sum", async_op=True, check=False)

    def reduce_without_data(self) -> None:
        """Take part in a synchronised step with no backward here: contribute only what ``.grad`` holds."""
        self.expect_backward(0)
        if self.syncing:
            self._begin_backward(queue_finish=False)
            self._finish_backward()

    def remove(self) -> None:
        """Detach every hook; the model goes back to plain local gradients."""
        for hook in self._hooks:
            hook.remove()

    def reset(self, threshold_mb: float | None = None) -> None:
        """Forget the step in progress, for a group that broke or was re-formed (elastic training).

        Drops in-flight handles and the partial sample count, lays out fresh buckets (with
        ``threshold_mb`` if given; reductions' state, such as TopK residuals, is kept, as they were before the step
        in flight) and learns the gradient order
        again on the next synchronised step. Every member of the new group must call it, so that
        reducers caught in different phases by a failure agree again.
        """
        for bucket in self._buckets:
            if bucket.state is BucketState.IN_FLIGHT:  # launched in the step that is redone
                self.reduction.rollback(bucket.context)
        self.syncing = True
        self._local_samples = 0
        self._count_handle = None
        self._counted = False
        self._predicted_total = None
        self._weight_total = None
        self._in_backward = False
        self._packed = []
        self._next_launch = 0
        self._observed_order = []
        self._install(self._order, self.threshold_mb if threshold_mb is None else threshold_mb)

    # --- backward side --------------------------------------------------------------------

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient_ready(_: torch.Tensor) -> None:
            if not self.syncing:
                return
            if not self._in_backward:
                self._begin_backward(queue_finish=True)
            if self._observed_order is not None:
                self._observed_order.append(index)
            bucket = self._pack(index)
            bucket.pending -= 1
            if bucket.pending == 0 and bucket.index == self._next_launch:
                self._launch_ready_buckets()

        return on_gradient_ready

    def _begin_backward(self, queue_finish: bool) -> None:
        self._in_backward = True
        self._weight = self._resolve_weight()
        self._packed = [False] * len(self.params)
        self._next_launch = 0
        for bucket in self._buckets:
            bucket.reset()
        if queue_finish:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _resolve_weight(self) -> float:
        self._weight_total = None
        if self._count_handle is not None:
            total = int(self._count_handle.wait())
            return self._local_samples / total if total else 0.0
        if self._counted and self._predicted_total is not None:
            self._weight_total = self._predicted_total  # checked against the trailers once summed
            return self._local_samples / self._predicted_total
        return 1.0 / runtime.size()

    def _pack(self, index: int) -> Bucket:
        """Write this parameter's weighted gradient into its bucket slot (zero if it has none)."""
        bucket, slot = self._slot_of[index]
        param, view = self.params[index], bucket.views[slot]
        grad = param.grad
        if grad is None or self._weight == 0.0:
            view.zero_()  # also clears the NaN a mean over an empty batch produces
        elif grad.data_ptr() == view.data_ptr():
            view.mul_(self._weight)
        else:
            torch.mul(grad, self._weight, out=view)
            param.grad = view
        bucket.used[slot] = grad is not None  # the trailer is written once, at launch
        self._packed[index] = True
        return bucket

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            bucket = self._buckets[self._next_launch]
            bucket.write_trailer(self._local_samples)
            bucket.handle = self.reduction.reduce(bucket)
            bucket.state = BucketState.IN_FLIGHT
            self._next_launch += 1

    def _finish_backward(self) -> None:
        """Launch what is still open, wait for every bucket, publish the averages in ``.grad``."""
        for bucket in self._buckets[self._next_launch:]:
            for index in bucket.param_indices:
                if not self._packed[index]:
                    self._pack(index)
            bucket.pending = 0
        self._launch_ready_buckets()
        total = None
        for bucket in self._buckets:
            bucket.handle.wait()
            bucket.state = BucketState.DONE
            total = self._publish(bucket)
        self._learn_total(total)
        self._in_backward = False
        self._local_samples = 0
        self._count_handle = None
        self._counted = False
        if self.check_finite:
            self._raise_if_not_finite()
        self._after_step()

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

    def _raise_if_not_finite(self) -> None:
        for index, param in enumerate(self.params):
            if param.grad is not None and not bool(torch.isfinite(param.grad).all()):
                raise NonFiniteGradientError(
                    f"rank {runtime.rank()}: the averaged gradient of '{self.names[index]}' holds NaN or Inf, so "
                    "at least one rank produced a non-finite gradient this step. Lower the learning rate, clip "
                    "gradients, or check that rank's inputs; every rank raises this same error."
                )

    # --- bucket layout --------------------------------------------------------------------

    def _after_step(self) -> None:
        """Adopt the observed gradient order once, and any fusion threshold the tuner picked."""
        order = None
        if self._observed_order is not None:
            order = self._agreed_order(self._observed_order)
            self._observed_order = None
        threshold = self._on_step_end(time.perf_counter()) if self._on_step_end else None
        if order is not None or threshold is not None:
            self._install(order or self._order, threshold if threshold is not None else self.threshold_mb)

    def _agreed_order(self, observed: list[int]) -> list[int]:
        """Rank 0's order of readiness (then parameters never ready), identical on every rank."""
        missing = [i for i in reversed(range(len(self.params))) if i not in set(observed)]
        return collectives.broadcast_object(observed + missing, root=0)

    def _install(self, order: list[int], threshold_mb: float) -> None:
        """Lay out buckets for ``order``, moving any existing gradients into their new slots."""
        carried = self._carried_state()
        self._order, self.threshold_mb = list(order), threshold_mb
        ordered = [self.params[i] for i in order]
        self._buckets = [Bucket.allocate(b, [order[k] for k in group], self.params)
                         for b, group in enumerate(plan_buckets(ordered, threshold_mb))]
        for bucket in self._buckets:
            bucket.context = self.reduction.join_state([carried.get(i) for i in bucket.param_indices],
                                                       self._lengths(bucket))
        self._slot_of: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self._buckets:
            for slot, index in enumerate(bucket.param_indices):
                self._slot_of[index] = (bucket, slot)
                self._adopt_gradient(index, bucket.views[slot])

    def _carried_state(self) -> dict[int, torch.Tensor]:
        """Each parameter's part of its bucket's reduction state (TopK residuals), before a re-layout."""
        carried: dict[int, torch.Tensor] = {}
        for bucket in self._buckets:
            parts = self.reduction.split_state(bucket.context, self._lengths(bucket))
            carried.update({index: part for index, part in zip(bucket.param_indices, parts) if part is not None})
        return carried

    def _lengths(self, bucket: Bucket) -> list[int]:
        return [self.params[index].numel() for index in bucket.param_indices]

    def _adopt_gradient(self, index: int, view: torch.Tensor) -> None:
        param = self.params[index]
        if param.grad is not None:
            view.copy_(param.grad)
            param.grad = view

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of gradient elements in each bucket, in launch order."""
        return [bucket.gradient_numel for bucket in self._buckets]
