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

This is not an engine of its own but a summation of :class:`~phalanx.parallel.reducer.GradientReducer`
(the one ``px.DataParallel`` uses): the reducer's hooks hand gradients to :class:`FixedPointSum`,
and its buckets are :class:`FixedPointBucket`. State machine of one bucket during a pass over a
rank's micro-batches::

    FILLING --(all its gradients scaled, rounded and added to the sums)--> COMPLETE
    COMPLETE --(next micro-batch)--> FILLING
    COMPLETE --(last micro-batch, all earlier buckets launched)--> IN_FLIGHT --wait--> DONE

Buckets launch strictly in order, during the last micro-batch's backward, so the allreduce
overlaps the rest of backward as in ordinary data parallelism.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from phalanx import profile
from phalanx.comm import collectives, runtime
from phalanx.comm.handles import done
from phalanx.errors import NonFiniteGradientError
from phalanx.parallel.buckets import Bucket, BucketState
from phalanx.parallel.reductions import Reduction, Waitable

EXACT_BITS = 53  # float64 holds every integer below 2**53
SLACK_BITS = 16
HEADROOM_BITS = 6
MAX_EXPONENT = 100  # scaled float32 gradients stay far inside float32's exponent range
QUANTISE_CHUNK = 1 << 17  # elements: with their sums, about 2 MB, one core's L2 here
STREAM_MIN_NUMEL = 1 << 15  # tensors this large are rounded and added as soon as their gradient is ready
_FLAGS = 4  # used, nonzero, big, over


def term_limit_bits(total_micro_batches: int) -> int:
    """``limit``: terms below ``2**limit`` keep a sum of ``total_micro_batches`` of them below ``2**52``."""
    return EXACT_BITS - math.ceil(math.log2(total_micro_batches + 1)) - 1


def calibrated_exponents(global_max: torch.Tensor, limit: int, current: torch.Tensor) -> torch.Tensor:
    """Per tensor, the exponent that puts its largest term :data:`HEADROOM_BITS` below ``2**limit``.

    Tensors whose gradient is zero everywhere keep their current exponent.
    """
    wanted = limit - HEADROOM_BITS - torch.ceil(torch.log2(global_max.clamp_min(1e-300))).long()
    return torch.where(global_max > 0, wanted, current).clamp(-MAX_EXPONENT, MAX_EXPONENT)


class FixedPointBucket(Bucket):
    """A bucket of the exact sum: ``views`` are slots of ``scaled``, the scaled gradients (float32,
    or float64 for float64 parameters), and ``flat``, the buffer that is sent, holds the float64
    sums of their terms, the ``trailer`` of four counters per tensor and the ``payload``."""

    scaled: torch.Tensor
    lengths: list[int]
    numel: int
    exact_dtype: bool  # .grad can be a view of ``scaled``
    streamed: list[bool]  # rounded and added in chunks from the hook
    small_runs: list[tuple[int, int]]  # the other tensors' element ranges, rounded and added per bucket
    local_max: torch.Tensor  # each tensor's largest term on this rank, unscaled
    scales: list[float]
    scale_tensor: torch.Tensor
    at_top: torch.Tensor  # per tensor: its exponent is MAX_EXPONENT (on the bucket's device)
    used_flags: tuple[list[bool], torch.Tensor]  # the last ``used`` list sent, and it as a tensor on the device
    sum_views: list[torch.Tensor]
    payload: torch.Tensor

    @classmethod
    def allocate(cls, index: int, param_indices: list[int], params: Sequence[torch.Tensor]) -> "FixedPointBucket":
        members = [params[i] for i in param_indices]
        lengths = [p.numel() for p in members]
        # float16 cannot hold scaled gradients (its largest value is 65504); float32 can.
        compute = torch.float64 if members[0].dtype == torch.float64 else torch.float32
        scaled = torch.zeros(sum(lengths), dtype=compute, device=members[0].device)
        views = [view.view_as(p) for view, p in zip(scaled.split(lengths), members)]
        bucket = cls(index, list(param_indices), scaled, views, scaled[:0], used=[False] * len(members),
                     state=BucketState.DONE)
        bucket.scaled, bucket.lengths, bucket.numel = scaled, lengths, sum(lengths)
        bucket.exact_dtype = members[0].dtype == compute
        bucket.streamed = [n >= STREAM_MIN_NUMEL for n in lengths]
        bucket.small_runs = _runs_of_small_tensors(lengths, bucket.streamed)
        bucket.local_max = torch.zeros(len(members), dtype=torch.float64, device=scaled.device)
        bucket.used_flags = ([], bucket.local_max[:0])
        bucket.allocate_sums(0)
        return bucket

    def set_exponents(self, exponents: list[int]) -> None:
        self.scales = [2.0**e for e in exponents]
        self.scale_tensor = torch.tensor(self.scales, dtype=torch.float64, device=self.scaled.device)
        self.at_top = torch.tensor([e == MAX_EXPONENT for e in exponents], device=self.scaled.device)

    def used_tensor(self) -> torch.Tensor:
        """``used`` as float64 on the device, copied there only when it changed (a copy from the host
        makes a GPU's host wait for all queued work)."""
        if self.used_flags[0] != self.used:
            self.used_flags = (list(self.used), torch.tensor(self.used, dtype=torch.float64, device=self.scaled.device))
        return self.used_flags[1]

    def allocate_sums(self, payload_numel: int) -> None:
        """A fresh, zeroed buffer for the sums, the trailer and ``payload_numel`` values of payload."""
        flags = _FLAGS * len(self.param_indices)
        self.flat = torch.zeros(self.numel + flags + payload_numel, dtype=torch.float64, device=self.scaled.device)
        self.sum_views = [view.view_as(v) for view, v in zip(self.flat[: self.numel].split(self.lengths), self.views)]
        self.trailer = self.flat[self.numel : self.numel + flags].view(_FLAGS, -1)
        self.payload = self.flat[self.numel + flags :]

    @property
    def gradient_numel(self) -> int:
        return self.numel


class ExactSum(Reduction):
    """Reproducible mode's reduction: a bucket's float64 integer sums, checks and payload, summed by
    one allreduce, which is exact in any order (every partial sum stays below ``2**53``)."""

    name = "exact"


class FixedPointSum:
    """The exact sum as the reducer's summation: integers in float64 over a rank's micro-batches.

    ``ExactGradients`` drives it: a *pass* runs a rank's micro-batches of one step:
    ``begin_pass``, then per micro-batch ``begin_micro_batch`` and a backward the reducer expects
    (gathering; the last one reducing: it launches and waits; a rank with none calls the
    reducer's ``reduce_without_data`` after expecting a reducing backward), then ``finish_pass``,
    which says whether the exponents held, and ``publish``. A pass with ``calibrate=True`` only
    measures the gradients' largest entries (nothing is sent) and ``recalibrate`` turns them into
    exponents; so does a pass that failed.
    """

    def __init__(self) -> None:
        self.reduction = profile.wrap(ExactSum())  # timed per bucket during a doctor session
        self.params: list[torch.nn.Parameter] = []
        self.exponents = torch.zeros(0, dtype=torch.int64)
        self._buckets: list[FixedPointBucket] = []
        self._calibrate = self._in_flight = self._held = False
        self._samples = self._limit_bits = 0

    def bind(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        if len(self.exponents) != len(self.params):
            self.exponents = torch.zeros(len(self.params), dtype=torch.int64)

    def agree_order(self, observed: list[int]) -> list[int] | None:
        """The layout is the caller's: the order is never relearnt."""
        return None

    def layout(self, groups: list[list[int]], previous: Sequence[Bucket]) -> list[Bucket]:
        self._buckets = [FixedPointBucket.allocate(b, group, self.params) for b, group in enumerate(groups)]
        self.set_exponents(self.exponents)
        self._in_flight = False  # fresh buffers: no collective of an old group holds them
        return list(self._buckets)

    def set_exponents(self, exponents: torch.Tensor) -> None:
        """Use these per-tensor exponents (a checkpoint's, or recalibrated ones) from the next pass.
        They are kept on the CPU, whatever the parameters' device (checkpoints load anywhere)."""
        self.exponents = exponents.to("cpu", torch.int64, copy=True)
        for bucket in self._buckets:
            bucket.set_exponents(self.exponents[bucket.param_indices].tolist())

    def expect_backward(self, local_samples: int, reduces: bool) -> None:
        """Samples come with ``begin_micro_batch`` here."""

    def reset(self, buckets: Sequence[Bucket]) -> None:
        """Forget the pass in progress: the next one starts with :meth:`begin_pass`, which gives
        buffers an interrupted pass may still have in flight fresh ones."""

    # --- one pass ---------------------------------------------------------------------------

    def begin_pass(self, total_micro_batches: int, calibrate: bool = False, payload_numel: int = 0) -> torch.Tensor:
        """Start summing a step whose global batch has ``total_micro_batches`` micro-batches.

        Returns ``payload_numel`` zeroed float64 values that travel in the first bucket and are
        summed with the gradients: a rider for other per-step data (batch-norm statistics), which
        then costs no collective of its own. They hold the sums after :meth:`finish_pass`.
        """
        self._limit_bits = term_limit_bits(total_micro_batches)
        self._calibrate = calibrate
        for bucket in self._buckets:
            payload = payload_numel if bucket.index == 0 else 0
            # After a pass that never finished (a group broke: elastic recovery), a collective of the
            # old group may still hold the buffer, so it gets a fresh one.
            if self._in_flight or bucket.payload.numel() != payload:
                bucket.allocate_sums(payload)
            else:
                bucket.flat.zero_()
            bucket.local_max.zero_()
            bucket.used = [False] * len(bucket.param_indices)
            bucket.handle, bucket.state = None, BucketState.DONE
        return self._buckets[0].payload

    def begin_micro_batch(self, samples: int) -> None:
        """Clear every ``.grad``, so that autograd hands each gradient over in a fresh tensor."""
        self._samples = samples
        for param in self.params:
            param.grad = None

    def finish_pass(self) -> bool:
        """Whether the exponents held for every tensor (the same on every rank)."""
        return self._held

    def recalibrate(self) -> None:
        """New exponents from every rank's largest entries (a MAX allreduce).

        Raises :class:`NonFiniteGradientError` on every rank if a gradient held NaN or Inf.
        """
        local = torch.zeros(len(self.params), dtype=torch.float64, device=self._buckets[0].local_max.device)
        for bucket in self._buckets:
            local[bucket.param_indices] = bucket.local_max
        local = torch.nan_to_num(local, nan=math.inf)  # a MAX allreduce may drop a NaN, never an Inf
        global_max = collectives.allreduce_(local, "max", check=False).cpu()
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

    # --- the reducer's calls ----------------------------------------------------------------

    def begin_backward(self) -> None:
        """Nothing to resolve: ``begin_micro_batch`` set the samples."""

    def pack(self, bucket: Bucket, slot: int, param: torch.nn.Parameter) -> None:
        self._quantise(bucket, slot, param.grad)  # type: ignore[arg-type]
        param.grad = None  # its float copy lives on, scaled, in the bucket

    def fill(self, bucket: Bucket, slot: int) -> None:
        bucket.views[slot].zero_()  # no gradient here: clear the previous micro-batch's

    def _quantise(self, bucket: FixedPointBucket, slot: int, grad: torch.Tensor) -> None:
        """Scale one parameter's gradient into its bucket slot: ``grad * 2**e``.

        A large tensor's terms, ``round(grad * 2**e) * samples``, are added to the sums right
        away, in chunks that fit a core's cache, so that the scaled values are rounded and added
        while still there (about half the memory traffic of whole-tensor passes). Small tensors
        are rounded and added together when their bucket is complete: two kernels for many.
        """
        bucket.used[slot] = True
        view, scale = bucket.views[slot], bucket.scales[slot]
        if self._calibrate:
            view.copy_(grad)
        elif not bucket.streamed[slot]:
            _scale_into(view, grad, scale)
        else:
            grad, view, sums = grad.reshape(-1), view.view(-1), bucket.sum_views[slot].view(-1)
            chunk_numel = QUANTISE_CHUNK if grad.device.type == "cpu" else grad.numel()  # a GPU has no L2 to fit
            for start in range(0, grad.numel(), chunk_numel):
                chunk = slice(start, start + chunk_numel)
                sums[chunk].add_(_scale_into(view[chunk], grad[chunk], scale).round_(), alpha=self._samples)

    def complete(self, bucket: FixedPointBucket) -> None:  # type: ignore[override]
        """Add the small tensors' terms; track each tensor's largest term (unscaled, for recalibrating)."""
        if not self._calibrate:
            for start, stop in bucket.small_runs:
                bucket.flat[start:stop].add_(bucket.scaled[start:stop].round_(), alpha=self._samples)
        largest = _largest_entries(bucket.views).double().mul_(self._samples)
        if not self._calibrate:
            largest.div_(bucket.scale_tensor)  # exact: powers of two
        torch.maximum(bucket.local_max, largest, out=bucket.local_max)  # NaN propagates

    def launch(self, bucket: FixedPointBucket) -> Waitable:  # type: ignore[override]
        """Send the sums; a calibrating pass only measured the gradients and sends nothing."""
        if self._calibrate:
            return done(None, async_op=True)
        self._write_trailer(bucket)
        self._in_flight = True
        return self.reduction.reduce(bucket)

    def end_backward(self, buckets: Sequence[Bucket], reduced: bool) -> None:
        """After the last micro-batch's wait: did the exponents hold? (Never in a calibrating pass.)"""
        if reduced:
            self._in_flight = False
            self._held = not self._calibrate and bool(torch.stack([self._held_in(b) for b in self._buckets]).all())

    @staticmethod
    def _held_in(bucket: FixedPointBucket) -> torch.Tensor:
        """Whether the exponents held for every tensor of ``bucket`` (a tensor: one sync for all buckets)."""
        _, nonzero, big, over = bucket.trailer
        return ((over == 0) & ((big > 0) | (nonzero == 0) | bucket.at_top)).all()

    def _write_trailer(self, bucket: FixedPointBucket) -> None:
        """Counters whose sums over ranks decide, on every rank alike, whether the exponents held.

        A counter is 1 where this rank's largest term of a tensor passes a test, so its sum is
        non-zero exactly when the global largest term does: no MAX allreduce is needed for it.
        """
        terms = bucket.local_max.mul(bucket.scale_tensor)
        limit = 2.0**self._limit_bits
        checks = torch.stack([bucket.used_tensor(), terms > 0,
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
    """Each tensor's largest absolute entry (NaN if it holds one), in one pass over each: on a GPU
    one fused kernel for all (tests/test_cuda.py checks that it carries NaN), on a CPU each tensor's
    min and max (the fused kernel is 10x slower there)."""
    if views[0].is_cuda:
        return torch.stack(torch._foreach_norm(list(views), math.inf))
    zero = torch.zeros((), dtype=views[0].dtype, device=views[0].device)
    extremes = [torch.aminmax(view) if view.numel() else (zero, zero) for view in views]
    smallest, largest = torch.stack([e[0] for e in extremes]), torch.stack([e[1] for e in extremes])
    return torch.maximum(largest, smallest.neg())
