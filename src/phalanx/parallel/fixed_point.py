"""Exact gradient sums: fixed point, fused into buckets and reduced while backward runs.

Each parameter's gradient is turned into integers with a power-of-two scale per tensor,
``round(grad * 2**e) * samples``, and the integers are summed, over a rank's micro-batches and by
allreduce over ranks. They are held as float64, which represents every integer below ``2**53``
exactly; the scales keep every partial sum below that, so each addition is exact and the sum has
the same bits in any order: however many ranks take part, however they split the micro-batches,
whatever order the allreduce adds in. Scaling by a power of two is exact, so each entry of a
gradient is rounded once. (float64 rather than int64: the conversion pass and the int64 scratch
buffer disappear, and the budget of 53 bits still gives the largest term of each tensor at least
``36 - ceil(log2(m + 1))`` bits for ``m`` micro-batches, more than float32's 24 up to 2**10 of them.)

The exponents must be agreed before a step. They are kept from the last step and *checked*
during this one: every bucket carries a trailer of four counters per tensor, summed with the
gradients, so every rank learns the same verdict with no extra collective:

``used``     ranks on which the tensor got a gradient in some micro-batch,
``nonzero``  ranks on which its largest term was not zero,
``big``      ranks on which its largest term reached ``2**(limit - SLACK_BITS)``,
``over``     ranks on which its largest term exceeded ``2**limit`` (or was NaN).

The sum is valid when no term was over the limit (so no partial sum can reach ``2**53``) and the
largest term did not waste more than :data:`SLACK_BITS` bits. Otherwise the step is redone with
exponents recalibrated from a MAX allreduce of the gradients' largest entries, leaving
:data:`HEADROOM_BITS` of room to grow. With that room a redo is rare: the first step (nothing to
calibrate from) and a gradient growing 64x or shrinking about 1000x from its calibration.

State machine of one bucket during a pass over a rank's micro-batches::

    FILLING --(all its gradients scaled, rounded and added to the sums)--> QUANTISED
    QUANTISED --(next micro-batch)--> FILLING
    QUANTISED --(last micro-batch, all earlier buckets launched)--> IN_FLIGHT --wait--> DONE

Buckets launch strictly in order, during the last micro-batch's backward, so the allreduce
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

EXACT_BITS = 53  # float64 holds every integer below 2**53
SLACK_BITS = 16
HEADROOM_BITS = 6
MAX_EXPONENT = 100  # scaled float32 gradients stay far inside float32's exponent range
QUANTISE_CHUNK = 1 << 17  # elements: with their sums, about 2 MB, one core's L2 here
STREAM_MIN_NUMEL = 1 << 15  # tensors this large are rounded and added as soon as their gradient is ready
_FLAGS = 4  # used, nonzero, big, over


class BucketState(enum.Enum):
    FILLING = "filling"
    QUANTISED = "quantised"
    IN_FLIGHT = "in flight"
    DONE = "done"


def term_limit_bits(total_micro_batches: int) -> int:
    """``limit``: terms below ``2**limit`` keep a sum of ``total_micro_batches`` of them below ``2**52``."""
    return EXACT_BITS - math.ceil(math.log2(total_micro_batches + 1)) - 1


def calibrated_exponents(global_max: torch.Tensor, limit: int, current: torch.Tensor) -> torch.Tensor:
    """Per tensor, the exponent that puts its largest term :data:`HEADROOM_BITS` below ``2**limit``.

    Tensors whose gradient is zero everywhere keep their current exponent.
    """
    wanted = limit - HEADROOM_BITS - torch.ceil(torch.log2(global_max.clamp_min(1e-300))).long()
    return torch.where(global_max > 0, wanted, current).clamp(-MAX_EXPONENT, MAX_EXPONENT)


class _Bucket:
    """A few parameters' scaled gradients, the float64 sums of their terms and the trailer."""

    def __init__(self, index: int, param_indices: list[int], params: Sequence[torch.Tensor]):
        members = [params[i] for i in param_indices]
        self.index = index
        self.param_indices = param_indices
        self.lengths = [p.numel() for p in members]
        self.numel = sum(self.lengths)
        # float16 cannot hold scaled gradients (its largest value is 65504); float32 can.
        compute = torch.float64 if members[0].dtype == torch.float64 else torch.float32
        self.scaled = torch.zeros(self.numel, dtype=compute, device=members[0].device)
        self.views = [view.view_as(p) for view, p in zip(self.scaled.split(self.lengths), members)]
        self.exact_dtype = members[0].dtype == compute  # .grad can be a view of ``scaled``
        self.streamed = [n >= STREAM_MIN_NUMEL for n in self.lengths]
        self.small_runs = _runs_of_small_tensors(self.lengths, self.streamed)
        self.state = BucketState.DONE
        self.pending = 0
        self.fired = [False] * len(members)
        self.used = [False] * len(members)
        self.handle: Any = None
        self.local_max = torch.zeros(len(members), dtype=torch.float64)
        self.set_exponents([0] * len(members))
        self.allocate_sums(0)

    def set_exponents(self, exponents: list[int]) -> None:
        self.scales = [2.0**e for e in exponents]
        self.scale_tensor = torch.tensor(self.scales, dtype=torch.float64)

    def allocate_sums(self, payload_numel: int) -> None:
        """A fresh, zeroed buffer for the sums, the trailer and ``payload_numel`` values of payload."""
        self.sums = torch.zeros(self.numel + _FLAGS * len(self.param_indices) + payload_numel, dtype=torch.float64,
                                device=self.scaled.device)
        self.sum_views = [view.view_as(v) for view, v in zip(self.sums[: self.numel].split(self.lengths), self.views)]

    @property
    def trailer(self) -> torch.Tensor:
        return self.sums[self.numel : self.numel + _FLAGS * len(self.param_indices)].view(_FLAGS, -1)

    @property
    def payload(self) -> torch.Tensor:
        return self.sums[self.numel + _FLAGS * len(self.param_indices) :]


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
        self._active = self._launching = self._calibrate = self._in_flight = False
        self._samples = self._next_launch = self._limit_bits = 0
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(self._hook_for(index))

    def set_exponents(self, exponents: torch.Tensor) -> None:
        """Use these per-tensor exponents (a checkpoint's, or recalibrated ones) from the next pass."""
        self.exponents = exponents.to(torch.int64).clone()
        for bucket in self._buckets:
            bucket.set_exponents(self.exponents[bucket.param_indices].tolist())

    # --- one pass ---------------------------------------------------------------------------

    def begin_pass(self, total_micro_batches: int, calibrate: bool = False, payload_numel: int = 0) -> torch.Tensor:
        """Start summing a step whose global batch has ``total_micro_batches`` micro-batches.

        Returns ``payload_numel`` zeroed float64 values that travel in the first bucket and are
        summed with the gradients: a rider for other per-step data (batch-norm statistics), which
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
                bucket.allocate_sums(payload)
            else:
                bucket.sums.zero_()
            bucket.local_max.zero_()
            bucket.used = [False] * len(bucket.param_indices)
            bucket.handle, bucket.state = None, BucketState.DONE
        return self._buckets[0].payload

    def begin_micro_batch(self, samples: int, last: bool) -> None:
        """Clear every ``.grad``, so that autograd hands each gradient over in a fresh tensor."""
        self._samples, self._launching, self._active = samples, last and not self._calibrate, True
        for bucket in self._buckets:
            bucket.pending, bucket.fired = len(bucket.param_indices), [False] * len(bucket.param_indices)
            bucket.state = BucketState.FILLING
        for param in self.params:
            param.grad = None

    def end_micro_batch(self) -> None:
        """Complete buckets that lacked a gradient for some parameter; if last, launch the rest."""
        for bucket in self._buckets:
            if bucket.state is BucketState.FILLING:
                for slot, fired in enumerate(bucket.fired):
                    if not fired:
                        bucket.views[slot].zero_()  # no gradient here: clear the previous micro-batch's
                self._complete(bucket)
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
            _, nonzero, big, over = bucket.trailer
            at_top = self.exponents[bucket.param_indices] == MAX_EXPONENT
            held &= bool(((over == 0) & ((big > 0) | (nonzero == 0) | at_top)).all())
        return held

    def recalibrate(self) -> None:
        """New exponents from every rank's largest entries (a MAX allreduce).

        Raises :class:`NonFiniteGradientError` on every rank if a gradient held NaN or Inf.
        """
        local = torch.zeros(len(self.params), dtype=torch.float64)
        for bucket in self._buckets:
            local[bucket.param_indices] = bucket.local_max
        local = torch.nan_to_num(local, nan=math.inf)  # a MAX allreduce may drop a NaN, never an Inf
        global_max = collectives.allreduce_(local, "max", check=False)
        if not bool(torch.isfinite(global_max).all()):
            raise NonFiniteGradientError(
                f"rank {runtime.rank()}: a micro-batch gradient holds NaN or Inf in reproducible mode; every "
                "rank raises this. Lower the learning rate or check the inputs."
            )
        self.set_exponents(calibrated_exponents(global_max, self._limit_bits, self.exponents))

    def publish(self, global_batch_size: int) -> None:
        """Leave the mean gradient over the global batch in ``.grad`` (``None`` where no rank had one)."""
        for bucket in self._buckets:
            used = bucket.trailer[0].tolist()
            for slot, index in enumerate(bucket.param_indices):
                param = self.params[index]
                if not used[slot]:
                    param.grad = None
                    continue
                divisor = bucket.scales[slot] * global_batch_size  # exact: a power of two times N
                if bucket.exact_dtype:  # converting first, then dividing in place: a third of the traffic
                    param.grad = bucket.views[slot].copy_(bucket.sum_views[slot]).div_(divisor)
                else:
                    param.grad = (bucket.sum_views[slot] / divisor).to(param.dtype)

    # --- buckets ----------------------------------------------------------------------------

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient_ready(param: torch.Tensor) -> None:
            if not self._active:
                return
            bucket, slot = self._slot_of[index]
            self._quantise(bucket, slot, param.grad)
            param.grad = None  # its float copy lives on, scaled, in the bucket
            bucket.pending -= 1
            if bucket.pending == 0:
                self._complete(bucket)
                if self._launching:
                    self._launch_ready()

        return on_gradient_ready

    def _quantise(self, bucket: _Bucket, slot: int, grad: torch.Tensor) -> None:
        """Scale one parameter's gradient into its bucket slot: ``grad * 2**e``.

        A large tensor's terms, ``round(grad * 2**e) * samples``, are added to the sums right
        away, in chunks that fit a core's cache, so that the scaled values are rounded and added
        while still there (about half the memory traffic of whole-tensor passes). Small tensors
        are rounded and added together when their bucket is complete: two kernels for many.
        """
        bucket.fired[slot] = bucket.used[slot] = True
        view, scale = bucket.views[slot], bucket.scales[slot]
        if self._calibrate:
            view.copy_(grad)
        elif not bucket.streamed[slot]:
            _scale_into(view, grad, scale)
        else:
            grad, view, sums = grad.reshape(-1), view.view(-1), bucket.sum_views[slot].view(-1)
            for start in range(0, grad.numel(), QUANTISE_CHUNK):
                chunk = slice(start, start + QUANTISE_CHUNK)
                sums[chunk].add_(_scale_into(view[chunk], grad[chunk], scale).round_(), alpha=self._samples)

    def _complete(self, bucket: _Bucket) -> None:
        """Add the small tensors' terms; track each tensor's largest term (unscaled, for recalibrating)."""
        bucket.state = BucketState.QUANTISED
        if not self._calibrate:
            for start, stop in bucket.small_runs:
                bucket.sums[start:stop].add_(bucket.scaled[start:stop].round_(), alpha=self._samples)
        largest = _largest_entries(bucket.views).double().mul_(self._samples)
        if not self._calibrate:
            largest.div_(bucket.scale_tensor)  # exact: powers of two
        torch.maximum(bucket.local_max, largest, out=bucket.local_max)  # NaN propagates

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
        terms = bucket.local_max.mul(bucket.scale_tensor)
        limit = 2.0**self._limit_bits
        checks = torch.stack([torch.tensor(bucket.used, dtype=torch.float64), terms > 0,
                              terms >= limit / 2**SLACK_BITS, ~(terms <= limit)])  # NaN counts as over
        bucket.trailer.copy_(checks)


def _runs_of_small_tensors(lengths: list[int], streamed: list[bool]) -> list[tuple[int, int]]:
    """Element ranges of consecutive tensors that are not streamed, to be processed as one."""
    runs: list[tuple[int, int]] = []
    offset = 0
    for length, is_streamed in zip(lengths, streamed):
        if not is_streamed:
            if runs and runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], offset + length)
            else:
                runs.append((offset, offset + length))
        offset += length
    return runs


def _scale_into(out: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``out = grad * scale`` computed in ``out``'s dtype (a float16 gradient would overflow in its own)."""
    if grad.dtype == out.dtype:
        return torch.mul(grad, scale, out=out)
    return out.copy_(grad).mul_(scale)


def _largest_entries(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor's largest absolute entry (NaN if it holds one), in one pass over each."""
    zero = torch.zeros((), dtype=views[0].dtype, device=views[0].device)
    extremes = [torch.aminmax(view) if view.numel() else (zero, zero) for view in views]
    smallest, largest = torch.stack([e[0] for e in extremes]), torch.stack([e[1] for e in extremes])
    return torch.maximum(largest, smallest.neg())
