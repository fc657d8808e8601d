"""Exact gradient sums: int64 fixed point, fused into buckets and reduced while backward runs.

Each parameter's gradient is turned into integers with a power-of-two scale per tensor,
``round(grad * 2**e) * samples``, and integers are summed, over a rank's micro-batches and by
allreduce over ranks. Integer addition is exact and associative, so the sum has the same bits
however many ranks take part and however they split the micro-batches. Scaling by a power of two
is exact in floating point, so each entry is rounded once.

The exponents must be agreed before a step. They are kept from the last step and *checked*
during this one: every bucket carries a trailer of four counters per tensor, summed with the
gradients, so every rank learns the same verdict with no extra collective:

``used``     micro-batches in which the tensor got a gradient,
``nonzero``  micro-batches in which its largest term was not zero,
``big``      micro-batches in which its largest term reached ``2**(limit - SLACK_BITS)``,
``over``     micro-batches in which its largest term exceeded ``2**limit`` (or was NaN).

The sum is valid when no term was over the limit (so the total cannot overflow int64) and the
largest term did not waste more than :data:`SLACK_BITS` bits. Otherwise the step is redone with
exponents recalibrated from a MAX allreduce of the gradients' largest entries, leaving
:data:`HEADROOM_BITS` of room to grow. With that room a redo is rare: the first step (nothing to
calibrate from) and a gradient growing 64x or shrinking 1024x from its calibration.

State machine of one bucket during a pass over a rank's micro-batches::

    FILLING --(all its gradients accumulated: quantised into the int64 sums)--> QUANTISED
    QUANTISED --(next micro-batch)--> FILLING
    QUANTISED --(last micro-batch, all earlier buckets launched)--> IN_FLIGHT --wait--> DONE

Buckets launch strictly in order, during the last micro-batch's backward, so the int64 allreduce
overlaps the rest of backward as in :class:`~phalanx.parallel.reducer.GradientReducer`.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Callable, Sequence

import torch

from phalanx.comm import collectives, runtime
from phalanx.errors import NonFiniteGradientError
from phalanx.parallel.buckets import plan_buckets

INT64_HEADROOM_BITS = 62  # a sum stays below 2**62, well inside int64
SLACK_BITS = 16
HEADROOM_BITS = 6
MAX_EXPONENT = 100  # scaled float32 gradients stay far inside float32's exponent range
_FLAGS = 4  # used, nonzero, big, over


def term_limit_bits(total_micro_batches: int) -> int:
    """``limit``: the largest term of a sum of ``total_micro_batches`` terms stays below ``2**limit``."""
    return INT64_HEADROOM_BITS - math.ceil(math.log2(total_micro_batches + 1)) - 1


def calibrated_exponents(global_max: torch.Tensor, limit: int, current: torch.Tensor) -> torch.Tensor:
    """Per tensor, the exponent that puts its largest term :data:`HEADROOM_BITS` below ``2**limit``.

    Tensors whose gradient is zero everywhere keep their current exponent.
    """
    if not bool(torch.isfinite(global_max).all()):
        raise NonFiniteGradientError(
            f"rank {runtime.rank()}: a micro-batch gradient holds NaN or Inf in reproducible mode; every rank "
            "raises this. Lower the learning rate or check the inputs."
        )
    wanted = limit - HEADROOM_BITS - torch.ceil(torch.log2(global_max.clamp_min(1e-300))).long()
    return torch.where(global_max > 0, wanted, current).clamp(-MAX_EXPONENT, MAX_EXPONENT)


class BucketState(enum.Enum):
    FILLING = "filling"
    QUANTISED = "quantised"
    IN_FLIGHT = "in flight"
    DONE = "done"


class _Bucket:
    """The float gradients of a few parameters, their int64 sum and its trailer of counters."""

    def __init__(self, index: int, param_indices: list[int], params: Sequence[torch.Tensor]):
        members = [params[i] for i in param_indices]
        self.index = index
        self.param_indices = param_indices
        self.lengths = [p.numel() for p in members]
        self.numel = sum(self.lengths)
        self.grads = torch.zeros(self.numel, dtype=members[0].dtype, device=members[0].device)
        self.views = [view.view_as(p) for view, p in zip(self.grads.split(self.lengths), members)]
        self.state = BucketState.DONE
        self.pending = 0
        self.fired = [False] * len(members)
        self.used = [0] * len(members)
        self.handle: Any = None
        # float16 cannot hold scaled gradients (its largest value is 65504); other dtypes can.
        self._compute_dtype = torch.float32 if self.grads.dtype == torch.float16 else self.grads.dtype
        self.integers = torch.empty(self.numel, dtype=torch.int64, device=self.grads.device)  # scratch
        self.sums = self.new_sums(0)
        self.local_max = torch.zeros(len(members), dtype=torch.float64)

    def new_sums(self, payload_numel: int) -> torch.Tensor:
        """A zeroed buffer for the int64 sums, the trailer and ``payload_numel`` integers of payload."""
        return torch.zeros(self.numel + _FLAGS * len(self.param_indices) + payload_numel, dtype=torch.int64,
                           device=self.grads.device)

    @property
    def payload(self) -> torch.Tensor:
        return self.sums[self.numel + _FLAGS * len(self.param_indices) :]

    def set_exponents(self, exponents: torch.Tensor) -> None:
        """Scales per tensor (for the checks) and per element (to quantise, and to publish)."""
        lengths = torch.tensor(self.lengths)
        self.tensor_scales = torch.pow(2.0, exponents.double())
        per_element = self.tensor_scales.repeat_interleave(lengths).to(self.grads.device)
        self.scales = per_element.to(self._compute_dtype)  # exact: powers of two within range
        self._per_element = per_element
        self._mean_factors = (0, per_element)

    def mean_factors(self, global_batch_size: int) -> torch.Tensor:
        """Per element, what turns the summed integers into the mean gradient: ``2**-e / N``."""
        if self._mean_factors[0] != global_batch_size:
            self._mean_factors = (global_batch_size, self._per_element.reciprocal().div_(global_batch_size))
        return self._mean_factors[1]

    def scaled_gradients(self) -> torch.Tensor:
        """``grads * 2**e``, in place unless the gradient dtype is too narrow for it."""
        if self._compute_dtype == self.grads.dtype:
            return self.grads.mul_(self.scales)
        return self.grads.to(self._compute_dtype).mul_(self.scales)

    @property
    def trailer(self) -> torch.Tensor:
        return self.sums[self.numel : self.numel + _FLAGS * len(self.param_indices)].view(_FLAGS, -1)


class FixedPointReducer:
    """Hooks, buckets and the pass state of the exact gradient sum of one model.

    A *pass* runs a rank's micro-batches of one step: ``begin_pass``, then per micro-batch
    ``begin_micro_batch`` / backward / ``end_micro_batch`` (or ``launch_without_data`` on a rank
    with none), then ``finish_pass``, which waits and says whether the exponents held, and
    ``publish``. A pass with ``calibrate=True`` only measures the gradients' largest entries
    (nothing is sent) and ``recalibrate`` turns them into exponents; so does a pass that failed.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], threshold_mb: float):
        self.params = list(params)
        order = list(reversed(range(len(self.params))))  # gradients become ready roughly in reverse
        groups = plan_buckets([self.params[i] for i in order], threshold_mb)
        self._buckets = [_Bucket(b, [order[k] for k in group], self.params) for b, group in enumerate(groups)]
        self._slot_of = {index: (bucket, slot) for bucket in self._buckets
                         for slot, index in enumerate(bucket.param_indices)}
        self.set_exponents(torch.zeros(len(self.params), dtype=torch.int64))
        self._active = self._launching = self._calibrate = False
        self._samples = self._next_launch = self._limit_bits = 0
        self._in_flight = False
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(self._hook_for(index))

    def set_exponents(self, exponents: torch.Tensor) -> None:
        """Use these per-tensor exponents (a checkpoint's, or recalibrated ones) from the next pass."""
        self.exponents = exponents.to(torch.int64).clone()
        for bucket in self._buckets:
            bucket.set_exponents(self.exponents[bucket.param_indices])

    # --- one pass ---------------------------------------------------------------------------

    def begin_pass(self, total_micro_batches: int, calibrate: bool = False, payload_numel: int = 0) -> torch.Tensor:
        """Start summing a step whose global batch has ``total_micro_batches`` micro-batches.

        Returns ``payload_numel`` zeroed integers that travel in the first bucket and are summed
        like the gradients: a rider for other exact per-step data (batch-norm statistics), which
        then costs no collective of its own. They hold the sums after :meth:`finish_pass`.
        """
        self._limit_bits = term_limit_bits(total_micro_batches)
        self._calibrate = calibrate
        self._next_launch = 0
        for bucket in self._buckets:
            payload = payload_numel if bucket.index == 0 else 0
            # After a pass that never finished (a group broke: elastic recovery), a collective of the
            # old group may still hold the buffer, so it gets a fresh one.
            if self._in_flight or bucket.payload.numel() != payload:
                bucket.sums = bucket.new_sums(payload)
            else:
                bucket.sums.zero_()
            bucket.local_max.zero_()
            bucket.used = [0] * len(bucket.param_indices)
            bucket.handle, bucket.state = None, BucketState.DONE
        return self._buckets[0].payload

    def begin_micro_batch(self, samples: int, last: bool) -> None:
        """Point every ``.grad`` at its zeroed bucket slot, so that autograd accumulates in place."""
        self._samples, self._launching, self._active = samples, last and not self._calibrate, True
        for bucket in self._buckets:
            bucket.grads.zero_()
            bucket.pending, bucket.fired = len(bucket.param_indices), [False] * len(bucket.param_indices)
            bucket.state = BucketState.FILLING
            for slot, index in enumerate(bucket.param_indices):
                self.params[index].grad = bucket.views[slot]

    def end_micro_batch(self) -> None:
        """Quantise buckets that lacked a gradient for some parameter; if last, launch the rest."""
        for bucket in self._buckets:
            if bucket.state is BucketState.FILLING:
                self._quantise(bucket)
        if self._launching:
            self._launch_ready()
        self._active = False

    def launch_without_data(self) -> None:
        """Take part in the pass's allreduce from a rank that has no micro-batch in this step."""
        if not self._calibrate:
            for bucket in self._buckets:
                bucket.state = BucketState.QUANTISED
            self._launch_ready()

    def finish_pass(self) -> bool:
        """Wait for every bucket; whether the exponents held for every tensor (same on every rank)."""
        if self._calibrate:
            return False
        self._in_flight = False
        held = True
        for bucket in self._buckets:
            bucket.handle.wait()
            bucket.state = BucketState.DONE
            used, nonzero, big, over = bucket.trailer
            at_top = self.exponents[bucket.param_indices] == MAX_EXPONENT
            held &= bool(((over == 0) & ((big > 0) | (nonzero == 0) | at_top)).all())
        return held

    def recalibrate(self) -> None:
        """New exponents from every rank's largest entries (a MAX allreduce)."""
        local = torch.zeros(len(self.params), dtype=torch.float64)
        for bucket in self._buckets:
            local[bucket.param_indices] = bucket.local_max
        local = torch.nan_to_num(local, nan=math.inf)  # a MAX allreduce may drop a NaN, never an Inf
        global_max = collectives.allreduce_(local, "max", check=False)
        self.set_exponents(calibrated_exponents(global_max, self._limit_bits, self.exponents))

    def publish(self, global_batch_size: int) -> None:
        """Leave the mean gradient over the global batch in ``.grad`` (``None`` where no rank had one)."""
        for bucket in self._buckets:
            means = bucket.integers.view(torch.float64)  # the scratch buffer, reused
            bucket.grads.copy_(torch.mul(bucket.sums[: bucket.numel], bucket.mean_factors(global_batch_size),
                                         out=means))
            for slot, count in enumerate(bucket.trailer[0].tolist()):
                self.params[bucket.param_indices[slot]].grad = bucket.views[slot] if count else None

    # --- buckets ----------------------------------------------------------------------------

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient_ready(param: torch.Tensor) -> None:
            if not self._active:
                return
            bucket, slot = self._slot_of[index]
            if param.grad.data_ptr() != bucket.views[slot].data_ptr():
                bucket.views[slot].copy_(param.grad)  # autograd replaced .grad instead of adding into it
                param.grad = bucket.views[slot]
            bucket.fired[slot] = True
            bucket.pending -= 1
            if bucket.pending == 0:
                self._quantise(bucket)
                if self._launching:
                    self._launch_ready()

        return on_gradient_ready

    def _quantise(self, bucket: _Bucket) -> None:
        """Add this micro-batch's terms to the bucket's int64 sums; track each tensor's largest term."""
        bucket.state = BucketState.QUANTISED
        bucket.used = [u + f for u, f in zip(bucket.used, bucket.fired)]
        largest = _largest_entries(bucket.views).double().mul_(self._samples)
        torch.maximum(bucket.local_max, largest, out=bucket.local_max)  # NaN propagates
        if not self._calibrate:  # the float gradients are not needed again: scale them in place
            bucket.integers.copy_(bucket.scaled_gradients().round_())
            bucket.sums[: bucket.numel].add_(bucket.integers, alpha=self._samples)

    def _launch_ready(self) -> None:
        """Launch quantised buckets strictly in bucket order, so all ranks issue the same sequence."""
        while self._next_launch < len(self._buckets) and \
                self._buckets[self._next_launch].state is BucketState.QUANTISED:
            bucket = self._buckets[self._next_launch]
            self._write_trailer(bucket)
            self._in_flight = True
            bucket.handle = collectives.allreduce_(bucket.sums, "sum", async_op=True, check=False)
            bucket.state = BucketState.IN_FLIGHT
            self._next_launch += 1

    def _write_trailer(self, bucket: _Bucket) -> None:
        """Counters whose sums over ranks decide, on every rank alike, whether the exponents held.

        A counter is 1 where this rank's largest term of a tensor passes a test, so its sum is
        non-zero exactly when the global largest term does: no MAX allreduce is needed for it.
        """
        terms = bucket.local_max.mul(bucket.tensor_scales)
        limit = 2.0**self._limit_bits
        checks = torch.stack([torch.tensor(bucket.used, dtype=torch.float64), terms > 0,
                              terms >= limit / 2**SLACK_BITS, ~(terms <= limit)])  # NaN counts as over
        bucket.trailer.copy_(checks)


def _largest_entries(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor's largest absolute entry (NaN if it holds one), in two kernels where torch can."""
    if hasattr(torch, "_foreach_max") and all(view.numel() for view in views):
        return torch.stack(torch._foreach_max(torch._foreach_abs(views)))
    return torch.stack([view.abs().amax() if view.numel() else view.new_zeros(()) for view in views])
