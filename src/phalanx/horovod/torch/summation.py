"""Horovod's gradient average as a summation of phalanx's gradient engine (:mod:`phalanx.parallel.reducer`).

The engine's hooks write each gradient into its bucket as soon as it is final; complete buckets
are allreduced asynchronously, in order, while backward goes on; the end of backward waits and
points ``.grad`` at the averages. What this summation adds is Horovod's arithmetic: every rank
counts the same (``Average`` divides by the set's size, ``Sum`` does not), the optional
``gradient_predivide_factor`` split of that division, float16 buckets for ``Compression.fp16``,
``backward_passes_per_step`` (local accumulation over several backwards, one allreduce), explicit
``groups`` and the set's group. Buckets go through the checked allreduce, so ranks that called
``hvd.join()`` take part with zeros. A sparse gradient (``nn.Embedding(sparse=True)``) travels as
Horovod's sparse allreduce does, its indices and values allgathered beside its bucket; with
``sparse_as_dense`` it is averaged densely in its bucket and handed back sparse, as Horovod does
(the rows where the average is not zero), so optimizers that take only sparse gradients
(``torch.optim.SparseAdam``) work either way.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from phalanx.comm import collectives
from phalanx.errors import ConfigurationError
from phalanx.horovod.torch import timeline
from phalanx.horovod.torch.mpi_ops import AllOf, gather_sparse, summed_sparse
from phalanx.parallel.accumulation import Accumulation
from phalanx.parallel.buckets import Bucket
from phalanx.parallel.reducer import Phase
from phalanx.parallel.reductions import Waitable, ranks_zero_order


class HorovodAverage:
    """Gradients weighted alike on every rank, summed over a process set, after ``passes`` backwards."""

    def __init__(self, scope: collectives.Scope | None, size: int, average: bool, predivide: float,
                 wire_dtype: torch.dtype | None, passes: int, groups: list[list[int]] | None,
                 sparse_as_dense: bool, names: Sequence[str]):
        self.scope, self.wire_dtype = scope, wire_dtype
        # Average: divide by the size before the sum (fused into the copy into the bucket), or split the
        # division around it with gradient_predivide_factor as Horovod does.
        self.prescale = (1.0 / size if predivide == 1.0 else 1.0 / predivide) if average else 1.0
        self.postscale = (predivide / size if predivide != 1.0 else 1.0) if average else 1.0
        self.groups, self.sparse_as_dense, self.names = groups, sparse_as_dense, list(names)
        self.params: list[torch.nn.Parameter] = []
        self.forced = False  # synchronize() reduces what .grad holds now
        self.accumulation = Accumulation(passes)  # backward_passes_per_step: phalanx's one accumulation
        self.reduced = False  # a reduction ended and step() has not run yet
        self._task = -1
        self._reducing = False  # the backward now running reduces
        self._started: list[float] = []
        self._sparse: dict[int, torch.Tensor] = {}  # this backward's sparse gradients, prescaled, by parameter
        self._densified: dict[int, int] = {}  # sparse gradients averaged densely (sparse_as_dense): sparse dims
        self._gathered: dict[int, AllOf] = {}  # their allgathers in flight (indices and values)

    def agree_order(self, observed: list[int]) -> list[int] | None:
        """Buckets follow the first step's gradient order, agreed over the whole job, unless the
        user grouped the parameters or a process set reduces them."""
        if self.groups is not None or self.scope is not None:
            return None
        return ranks_zero_order(observed, len(self.params))

    @property
    def backwards(self) -> int:
        """Backwards run since the last reduction (their gradients wait in ``.grad``)."""
        return self.accumulation.pending

    def phase(self) -> Phase:
        """The engine's schedule, asked when a backward's first gradient arrives (the optimizer sees
        no forward): it reduces when it is the ``passes``-th since the last reduction, or forced."""
        if self.forced:
            return Phase.REDUCE
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._task:
            self._task = task
            if self.reduced:
                raise ConfigurationError(
                    "Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Call optimizer.step() after each reduction, or increase backward_passes_per_step to "
                    "accumulate gradients locally."
                )
            self._reducing = self.accumulation.next_backward()
        return Phase.REDUCE if self._reducing else Phase.IDLE

    def bind(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)

    def expect_backward(self, local_samples: int, reduces: bool) -> None:
        """Nothing to count: every rank weighs the same."""

    def layout(self, groups: list[list[int]], previous: Sequence[Bucket]) -> list[Bucket]:
        """The engine's buckets, or one per user group (split by dtype); gradients move into them."""
        if self.groups is not None:
            groups = _by_dtype(self.groups, self.params)
        buckets = [Bucket.allocate(b, group, self.params) for b, group in enumerate(groups)]
        for bucket in buckets:
            for slot, index in enumerate(bucket.param_indices):
                param = self.params[index]
                if param.grad is not None and not param.grad.is_sparse:
                    bucket.views[slot].copy_(param.grad)
                    param.grad = bucket.views[slot]
        return buckets

    def begin_backward(self) -> None:
        self._started, self._sparse, self._gathered, self._densified = [], {}, {}, {}

    def pack(self, bucket: Bucket, slot: int, param: torch.nn.Parameter) -> None:
        """Write this parameter's gradient, prescaled, into its slot; ``.grad`` becomes a view of it."""
        view, grad = bucket.views[slot], param.grad
        if grad is not None and grad.is_sparse:
            if not self.sparse_as_dense:
                self._sparse[bucket.param_indices[slot]] = grad.coalesce() * self.prescale
                view.zero_()
                bucket.used[slot] = False
                return
            self._densified[bucket.param_indices[slot]] = grad.sparse_dim()
            grad = grad.to_dense()
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():
            view.mul_(self.prescale)
        else:
            torch.mul(grad, self.prescale, out=view)
            param.grad = view
        bucket.used[slot] = grad is not None

    def fill(self, bucket: Bucket, slot: int) -> None:
        """No hook ran for this parameter in this backward: send what ``.grad`` holds (zero if nothing)."""
        self.pack(bucket, slot, self.params[bucket.param_indices[slot]])

    def complete(self, bucket: Bucket) -> None:
        """Nothing to add: the prescaled gradients are in place."""

    def launch(self, bucket: Bucket) -> Waitable:
        """Allreduce the bucket (checked, so joined ranks can answer), as float16 with ``Compression.fp16``."""
        bucket.write_trailer(0)
        self._started.append(timeline.now_us())
        flat = bucket.flat
        with collectives.within(self.scope):
            if self.wire_dtype is None or flat.dtype == self.wire_dtype or not flat.is_floating_point():
                dense = collectives.allreduce_(flat, "sum", async_op=True)
            else:
                compact = flat.to(self.wire_dtype)
                dense = collectives.then(collectives.allreduce_(compact, "sum", async_op=True),
                                         lambda _: flat.copy_(compact))
            sparse = [index for index in bucket.param_indices if index in self._sparse]
            for index in sparse:
                self._gathered[index] = gather_sparse(self._sparse[index])
        return AllOf([dense, *(self._gathered[index] for index in sparse)])

    def end_backward(self, buckets: Sequence[Bucket], reduced: bool) -> None:
        """After the wait: postscale, point ``.grad`` at the averages (``None`` where no rank had one)."""
        for bucket, started in zip(buckets, self._started):
            used, _ = bucket.read_trailer()
            if self.postscale != 1.0:
                bucket.gradient.mul_(self.postscale)
            for slot, index in enumerate(bucket.param_indices):
                self.params[index].grad = self._averaged(bucket.views[slot], index) if used[slot] > 0 \
                    else self._sparse_sum(index)
            if timeline.active():
                timeline.record("ALLREDUCE", f"gradients.bucket{bucket.index}", started,
                                {"parameters": [self.names[i] for i in bucket.param_indices]})
        timeline.cycle()
        self.accumulation.restart()
        self.reduced, self._reducing = True, False

    def _averaged(self, dense: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s averaged gradient from its bucket: sparse again (its nonzero rows, the
        same on every rank) where it came sparse and was averaged densely (``sparse_as_dense``)."""
        if index in self._densified:
            return dense.to_sparse(self._densified[index])
        return dense

    def _sparse_sum(self, index: int) -> torch.Tensor | None:
        """Parameter ``index``'s summed sparse gradient, postscaled, if it had one (else ``None``)."""
        if index not in self._gathered:
            return None
        return summed_sparse(self._gathered[index].wait(), self._sparse[index].shape, self.postscale)

    def stepped(self) -> None:
        """``synchronize()`` or ``step()`` ran: the next backward starts a new accumulation."""
        self.reduced = False

    def reset(self, buckets: Sequence[Bucket]) -> None:
        """Forget the step in progress (an elastic group was re-formed)."""
        self.accumulation.restart()
        self.forced, self.reduced, self._task, self._reducing = False, False, -1, False


def _by_dtype(groups: list[list[int]], params: Sequence[torch.Tensor]) -> list[list[int]]:
    """Split each group so that no bucket mixes dtypes or devices."""
    split: list[list[int]] = []
    for group in groups:
        parts: dict[Any, list[int]] = {}
        for index in group:
            parts.setdefault((params[index].dtype, params[index].device), []).append(index)
        split.extend(parts.values())
    return split
