"""The gradient engine: hooks, buckets, launching in order and the end-of-backward wait.

Each parameter has one post-accumulate-grad hook. When a parameter's gradient is final, the hook
hands it to the reducer's *summation*, which puts it into the parameter's bucket slot. A bucket
whose gradients are all there is complete; complete buckets are launched asynchronously,
strictly in bucket order, so every rank issues the same collectives in the same order. When
autograd finishes, a callback completes the buckets still open (parameters that got no gradient
contribute zero), launches them, waits for all of them, and lets the summation publish the result.

Whoever drives the steps tells the reducer what each backward does, a :class:`Phase`: nothing
(gradients accumulate in ``.grad``), gather into the buckets without sending (an exact sum's
micro-batches), or reduce. Which backward of a step reduces is decided by the one accumulation
mechanism (:mod:`phalanx.parallel.accumulation`). What differs between ways of summing is the
summation (see :class:`Summation`):

* :class:`~phalanx.parallel.weighted.WeightedAverage`, ``px.DataParallel``'s: sample-weighted
  float gradients summed by a pluggable :class:`~phalanx.parallel.reductions.Reduction`;
* :class:`~phalanx.parallel.fixed_point.FixedPointSum`, reproducible mode's: gradients turned into
  integers and added exactly over several backwards (micro-batches) before the last one sends them.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Callable, Protocol, Sequence

import torch

from phalanx import faults, profile
from phalanx.comm import runtime
from phalanx.errors import NonFiniteGradientError
from phalanx.parallel.buckets import Bucket, BucketState, plan_buckets
from phalanx.parallel.reductions import Reduction, Waitable
from phalanx.parallel.weighted import WeightedAverage

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    """What one backward does with the gradients."""

    IDLE = "idle"  # nothing: they accumulate in ``.grad`` (a backward that is not the step's last)
    GATHER = "gather"  # into the buckets, nothing sent (an exact sum's micro-batch that is not the last)
    REDUCE = "reduce"  # into the buckets; complete buckets sent, waited for at the end, published


class Summation(Protocol):
    """What a bucket holds and how it is summed: the part of the engine that differs per mode."""

    def bind(self, params: Sequence[torch.nn.Parameter]) -> None: ...
    def agree_order(self, observed: list[int]) -> list[int] | None: ...
    def expect_backward(self, local_samples: int, reduces: bool) -> None: ...
    def layout(self, groups: list[list[int]], previous: Sequence[Bucket]) -> list[Bucket]: ...
    def begin_backward(self) -> None: ...
    def pack(self, bucket: Bucket, slot: int, param: torch.nn.Parameter) -> None: ...
    def fill(self, bucket: Bucket, slot: int) -> None: ...
    def complete(self, bucket: Bucket) -> None: ...
    def launch(self, bucket: Bucket) -> Waitable: ...
    def end_backward(self, buckets: Sequence[Bucket], reduced: bool) -> None: ...
    def reset(self, buckets: Sequence[Bucket]) -> None: ...


class GradientReducer:
    """Hooks, buckets and the per-backward state machine of one model's gradients.

    Built once per way of summing and per group: ``summation`` is a :class:`Summation`, or a
    :class:`Reduction` for the weighted average. To change either, :meth:`close` this reducer and
    build another with ``previous=`` it: the new buckets take over the old ones' carried state
    (TopK residuals, gradients in ``.grad``) and the gradient order learnt.

    Each backward's :class:`Phase` is the one :meth:`expect_backward` set, or, given ``schedule``,
    what it answers when the backward's first gradient arrives (for a driver that sees no forward).
    ``follows_forward``: steps end with the backwards the model's forward announced (the gradient
    order is learnt, the tuner and the finite check run); ``False`` where a caller drives its own
    steps (reproducible mode) and the model's forward leaves the reducer alone.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], threshold_mb: float,
                 summation: Summation | Reduction, check_finite: bool = False,
                 on_step_end: Callable[[float], float | None] | None = None,
                 previous: GradientReducer | None = None, schedule: Callable[[], Phase] | None = None,
                 follows_forward: bool = True):
        self.follows_forward = follows_forward
        self.phase = Phase.REDUCE
        self.awaiting_backward = False  # announced by expect_backward, not ended yet
        self._schedule = schedule or (lambda: self.phase)
        self.params = list(params)
        self.names = list(names)
        self.check_finite = check_finite
        self.threshold_mb = threshold_mb
        self._on_step_end = on_step_end
        self._buckets: list[Bucket] = list(previous._buckets) if previous else []  # their state moves over
        # gradients become ready roughly in reverse, until a first step shows the order
        self._order = list(previous._order) if previous else list(reversed(range(len(self.params))))
        self.summation = WeightedAverage(summation) if isinstance(summation, Reduction) else summation
        self.summation.bind(self.params)
        self._restart(threshold_mb)
        self._hooks = [param.register_post_accumulate_grad_hook(self._hook_for(index))
                       for index, param in enumerate(self.params)]

    def close(self) -> None:
        """Detach every hook and forget the step in flight (reductions' state goes back to before
        it); the buckets stay readable for a successor built with ``previous=`` this reducer."""
        for hook in self._hooks:
            hook.remove()
        self.summation.reset(self._buckets)

    @property
    def reduction(self) -> Reduction:
        """The weighted average's reduction (only in that mode)."""
        return self.summation.reduction  # type: ignore[attr-defined]

    # --- forward side ---------------------------------------------------------------------

    def expect_backward(self, local_samples: int, phase: Phase) -> None:
        """Announce a backward of ``local_samples`` that does ``phase`` (the summation may start
        counting samples across ranks for a reducing one)."""
        self.forget_interrupted_backward()
        self.phase, self.awaiting_backward = phase, True
        self.summation.expect_backward(local_samples, phase is Phase.REDUCE)

    def forget_interrupted_backward(self) -> None:
        """Start afresh if the last backward raised before it ended (and the caller carried on).

        Its buckets, counts and half-written slots would otherwise leak into the next step: the
        reducer resets as after an elastic failure (every rank that caught the same error does
        so alike). A forward run inside a backward (activation checkpointing) is not a new step.
        """
        if self._in_backward and torch._C._current_graph_task_id() == -1:
            logger.warning("phalanx: the last backward raised before it ended; its reduction is dropped.")
            self.reset()

    def reduce_without_data(self) -> None:
        """End the expected backward in which no hook ran (this rank had no samples, or no gradient
        reached a parameter): it still takes part in the step's collectives, with zeros."""
        phase = self._schedule()
        if phase is not Phase.IDLE:
            self._begin_backward(phase, queue_finish=False)
            self._end_backward()

    def reset(self) -> None:
        """Forget the step in progress: a backward that raised before it ended (see
        :meth:`forget_interrupted_backward`). Drops in-flight handles and the summation's step
        state, lays out fresh buckets (reductions' state, such as TopK residuals, is kept, as it was
        before the step in flight) and learns the gradient order again on the next synchronised
        step."""
        self.summation.reset(self._buckets)
        self._restart(self.threshold_mb)

    def _restart(self, threshold_mb: float) -> None:
        self._in_backward = False
        self._phase_now = Phase.IDLE
        self._next_launch = 0
        self._observed_order: list[int] | None = [] if self.follows_forward else None
        self._install(self._order, threshold_mb)

    # --- backward side --------------------------------------------------------------------

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient_ready(param: torch.Tensor) -> None:
            if not self._in_backward:
                phase = self._schedule()
                if phase is Phase.IDLE:
                    return
                self._begin_backward(phase, queue_finish=True)
            if self._observed_order is not None:
                self._observed_order.append(index)
            bucket, slot = self._slot_of[index]
            self.summation.pack(bucket, slot, param)
            bucket.packed[slot] = True
            bucket.pending -= 1
            if bucket.pending == 0:
                self._complete(bucket)

        return on_gradient_ready

    def _begin_backward(self, phase: Phase, queue_finish: bool) -> None:
        profile.mark("backward")
        self._in_backward, self._phase_now = True, phase
        self.summation.begin_backward()
        self._next_launch = 0
        for bucket in self._buckets:
            bucket.reset()
        if queue_finish:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _complete(self, bucket: Bucket) -> None:
        self.summation.complete(bucket)
        bucket.state = BucketState.COMPLETE
        if bucket.index == self._next_launch and self._phase_now is Phase.REDUCE:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch complete buckets strictly in bucket order, so all ranks issue the same sequence."""
        while self._next_launch < len(self._buckets) and \
                self._buckets[self._next_launch].state is BucketState.COMPLETE:
            bucket = self._buckets[self._next_launch]
            bucket.handle = self.summation.launch(bucket)
            bucket.state = BucketState.IN_FLIGHT
            self._next_launch += 1

    def _end_backward(self) -> None:
        """Complete and launch what is still open; at a step's end wait for every bucket; publish."""
        self._complete_open_buckets()
        self._in_backward = self.awaiting_backward = False
        reduced = self._phase_now is Phase.REDUCE
        if reduced:
            self._wait_for_buckets()
        self.summation.end_backward(self._buckets, reduced)
        if reduced and self.follows_forward:
            if self.check_finite:
                self._raise_if_not_finite()
            self._after_step()

    def _complete_open_buckets(self) -> None:
        """Parameters that got no gradient in this backward contribute zero (or what ``.grad`` holds)."""
        for bucket in self._buckets:
            if bucket.state is BucketState.FILLING:
                for slot, packed in enumerate(bucket.packed):
                    if not packed:
                        self.summation.fill(bucket, slot)
                self._complete(bucket)

    def _wait_for_buckets(self) -> None:
        faults.point("step.reduce")
        for bucket in self._buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                # done: dropped, with whatever the collective still holds (a reduce-scatter's output)
                bucket.handle, bucket.state = None, BucketState.DONE

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
        """Adopt the gradient order the summation agrees on after the first step, and any fusion
        threshold the tuner picked."""
        order = None
        if self._observed_order is not None:
            order = self.summation.agree_order(self._observed_order)
            self._observed_order = None
        threshold = self._on_step_end(time.perf_counter()) if self._on_step_end else None
        if order is not None or threshold is not None:
            self._install(order or self._order, threshold if threshold is not None else self.threshold_mb)

    def _install(self, order: list[int], threshold_mb: float) -> None:
        """Lay out buckets for ``order``; the summation moves what it carries into them."""
        self._order, self.threshold_mb = list(order), threshold_mb
        ordered = [self.params[i] for i in order]
        groups = [[order[k] for k in group] for group in plan_buckets(ordered, threshold_mb)]
        self._buckets = self.summation.layout(groups, self._buckets)
        self._slot_of: list[tuple[Bucket, int]] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self._buckets:
            for slot, index in enumerate(bucket.param_indices):
                self._slot_of[index] = (bucket, slot)

    def release_buckets(self) -> None:
        """Free every bucket's memory until the next backward, dropping the ``.grad`` views of it:
        for a caller that has consumed the step's sums (a sharded optimizer, which keeps only its
        shard). Between steps the model then holds no gradient memory at all."""
        for bucket in self._buckets:
            for index in bucket.param_indices:
                self.params[index].grad = None
            bucket.release()

    @property
    def bucket_params(self) -> list[list[int]]:
        """The parameter indices of each bucket, in launch order."""
        return [list(bucket.param_indices) for bucket in self._buckets]

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of gradient elements in each bucket, in launch order."""
        return [bucket.gradient_numel for bucket in self._buckets]

    @property
    def gradient_buffers(self) -> list[torch.Tensor]:
        """Every bucket's flat buffer (gradients and trailer; no memory while released), in launch
        order: the gradient memory the engine holds, for counting it (``phalanx doctor``)."""
        return [bucket.flat for bucket in self._buckets]
