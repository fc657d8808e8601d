"""How a ready bucket is summed over ranks: the engine's extension point.

The reducer (:mod:`phalanx.parallel.reducer`) owns everything around a reduction: the hooks, the
bucket layout, launching buckets strictly in order and waiting at the end of backward. A
reduction is its hook, as a communication hook is DDP's: when a bucket is complete the reducer
calls ``reduction.reduce(bucket)``:

* ``bucket.gradient`` holds this rank's gradients of the bucket's parameters, each already
  multiplied by the weight the reduction's own :meth:`Reduction.weights` gave (by default this
  rank's share of the global batch, ``n_rank / N``, so their *sum* over ranks is the average);
* ``bucket.trailer`` follows it in ``bucket.flat``: per parameter 1 where this rank had a gradient,
  then this rank's sample count. Its sum over ranks must arrive exactly;
* ``bucket.context`` is a dict kept for this bucket from step to step (TopK keeps its residual).

``reduce`` starts the sum and returns a handle (anything with ``wait()``; a
:class:`~phalanx.comm.collectives.Handle` from an ``async_op=True`` collective, or
:func:`~phalanx.comm.collectives.then` of one) whose ``wait()`` leaves the sum over ranks in
``bucket.flat``. Buffers arrive already weighted, so casting after this "divide first" cannot
overflow where the average itself would not. The built-in reductions are :class:`Average` (the
default), :class:`Cast` (``"fp16"``/``"bf16"``) and :class:`TopK`; the strategies add the
parameter-server push and central storage's reduction onto one rank, and reproducible mode's
fixed-point sum is a summation of the reducer (:mod:`phalanx.parallel.fixed_point`).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from phalanx.comm import collectives
from phalanx.errors import ConfigurationError
from phalanx.parallel.buckets import Bucket
from phalanx.parallel.weights import ShareWeights, Weights


class Waitable(Protocol):
    """What ``Reduction.reduce`` returns: ``wait()`` completes the sum in the bucket's buffer."""

    def wait(self) -> Any: ...


class Reduction:
    """Sums buckets as they are: one in-place allreduce each (exact in float).

    The engine's hook: subclass it and override :meth:`reduce` for another way (see
    docs/architecture.md). Everything that differs between ways of summing is the reduction's own
    business, asked for through its methods: how this rank's gradients are weighted
    (:meth:`weights`), the order and grouping of its buckets (:meth:`agree_order`,
    :meth:`bucket_groups`) and the state it carries from step to step.
    """

    name = "average"
    #: How the allreduce crosses the network (``px.DataParallel(algorithm=...)`` sets it): ``"auto"``
    #: (shared memory within a host, the cost model's choice between hosts), ``"backend"``,
    #: ``"ring"``, ``"tree"`` or ``"halving_doubling"``; see :func:`phalanx.comm.collectives.allreduce`.
    algorithm = "auto"

    def weights(self) -> Weights:
        """How this rank's gradients are weighted before the sum (see :mod:`phalanx.parallel.weights`).

        By default each rank's share of the global batch, its count summed every step: a sum that
        is not known to be exact and linear cannot be rescaled afterwards. An exact sum may return
        ``ShareWeights(predict=True)`` and save that count allreduce on most steps.
        """
        return ShareWeights(predict=False)

    def agree_order(self, observed: list[int], count: int) -> list[int] | None:
        """The order of the ``count`` parameters that buckets follow from now on, given the order in
        which their gradients became ready in the first step (``observed``); ``None`` keeps the
        layout. By default rank 0's order (then parameters never ready), agreed by one broadcast."""
        return ranks_zero_order(observed, count)

    def reduce(self, bucket: Bucket) -> Waitable:
        """Start summing ``bucket.flat`` over ranks; the returned handle's ``wait()`` completes it."""
        return collectives.allreduce_(bucket.flat, "sum", async_op=True, check=False, algorithm=self.algorithm)

    def bucket_groups(self, groups: list[list[int]], params: Sequence[torch.Tensor]) -> list[list[int]]:
        """The parameter indices of each bucket, in launch order; by default the reducer's plan
        ``groups`` (fused by size in the order gradients become ready). A reduction that sends
        buckets to fixed destinations lays them out its own way; buckets never mix dtypes."""
        return groups

    def split_state(self, state: dict[str, Any], lengths: list[int]) -> list[torch.Tensor | None]:
        """A bucket's carried state cut per parameter (``lengths`` elements each), so that it
        survives a new bucket layout; ``None`` where there is none. Plain sums carry nothing."""
        return [None] * len(lengths)

    def join_state(self, parts: list[torch.Tensor | None], lengths: list[int]) -> dict[str, Any]:
        """The state of a new bucket from its parameters' parts (the inverse of :meth:`split_state`)."""
        return {}

    def rollback(self, state: dict[str, Any]) -> None:
        """Undo what reducing a bucket did to ``state``, for a step that is redone (elastic recovery)."""


def ranks_zero_order(observed: list[int], count: int) -> list[int]:
    """Rank 0's order of readiness of ``count`` parameters (then those never ready), on every rank."""
    seen = set(observed)
    missing = [index for index in reversed(range(count)) if index not in seen]
    return collectives.broadcast_object(observed + missing, root=0)


class Average(Reduction):
    """The default: the plain sum, which is exact, so the weights may assume last step's count."""

    def weights(self) -> Weights:
        return ShareWeights(predict=True)


class Cast(Reduction):
    """Sends buckets as float16 or bfloat16: half the bytes, about three significant digits."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def reduce(self, bucket: Bucket) -> Waitable:
        if bucket.flat.dtype == self.dtype or not bucket.flat.is_floating_point():
            return super().reduce(bucket)
        compact = bucket.flat.to(self.dtype)
        handle = collectives.allreduce_(compact, "sum", async_op=True, check=False, algorithm=self.algorithm)
        return collectives.then(handle, lambda _: bucket.flat.copy_(compact))


class TopK(Reduction):
    """Sends only the ``ratio`` largest-magnitude entries of each bucket, over allgather.

    With ``error_feedback`` the entries left out are remembered per bucket and added to the next
    step's gradient, so nothing is lost for good, only delayed (Stich et al., 2018).
    """

    name = "topk"

    def __init__(self, ratio: float, error_feedback: bool = True):
        if not 0.0 < ratio <= 1.0:
            raise ConfigurationError(f"TopK ratio must be in (0, 1], got {ratio}.")
        self.ratio = ratio
        self.error_feedback = error_feedback

    def reduce(self, bucket: Bucket) -> Waitable:
        gradient, trailer, state = bucket.gradient, bucket.trailer, bucket.context
        if self.error_feedback and "residual" in state:
            gradient.add_(state["residual"])
        k = max(1, int(gradient.numel() * self.ratio))
        indices = gradient.abs().topk(k, sorted=False).indices
        values = gradient[indices]
        if self.error_feedback:
            residual = gradient.clone()
            residual[indices] = 0
            state["before"], state["residual"] = state.get("residual"), residual
        gathered_values = collectives.allgather(torch.cat([values, trailer]), async_op=True, check=False)
        gathered_indices = collectives.allgather(indices, async_op=True, check=False)
        return collectives.then(gathered_values, lambda values: self._scatter(bucket, k, values,
                                                                               gathered_indices.wait()))

    def split_state(self, state: dict[str, Any], lengths: list[int]) -> list[torch.Tensor | None]:
        residual = state.get("residual")
        return [None] * len(lengths) if residual is None else list(residual.split(lengths))

    def join_state(self, parts: list[torch.Tensor | None], lengths: list[int]) -> dict[str, Any]:
        known = [part for part in parts if part is not None]
        if not known:
            return {}
        return {"residual": torch.cat([part if part is not None else known[0].new_zeros(length)
                                       for part, length in zip(parts, lengths)])}

    def rollback(self, state: dict[str, Any]) -> None:
        if "before" in state:
            previous = state.pop("before")
            if previous is None:
                state.pop("residual", None)
            else:
                state["residual"] = previous

    @staticmethod
    def _scatter(bucket: Bucket, k: int, values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        per_rank = values.view(-1, k + bucket.trailer.numel())
        bucket.flat.zero_()
        bucket.gradient.index_add_(0, indices, per_rank[:, :k].reshape(-1))
        bucket.trailer.copy_(per_rank[:, k:].sum(0))
        return bucket.flat


def resolve(reduction: str | Reduction | None) -> Reduction:
    """Turn the user's ``reduction=`` (or ``compression=``) argument into a :class:`Reduction`."""
    if reduction is None or reduction in ("none", "average"):
        return Average()
    if isinstance(reduction, Reduction):
        return reduction
    casts = {"fp16": torch.float16, "bf16": torch.bfloat16}
    if reduction in casts:
        return Cast(casts[reduction])
    raise ConfigurationError(
        f"reduction must be None, 'fp16', 'bf16', px.TopK(ratio) or a px.Reduction, got {reduction!r}."
    )
