"""Gradient buckets: which parameters are fused into one allreduce, and each bucket's state.

A bucket owns one flat buffer laid out as ``[grad_0, grad_1, ..., used_0, used_1, ..., samples]``:
the gradients of its parameters, then a *trailer*: one element per parameter that holds 1 where
this rank had a gradient for it, and this rank's sample count. Summed over ranks, the trailer
tells every rank which parameters got a gradient anywhere, and the global sample count, without
a separate collective. After a synchronised step each parameter's ``.grad`` is a view into its
bucket, so the next step fills the bucket without a copy.

State machine of one bucket during a backward that the reducer handles::

    FILLING --(all its gradients packed)--> COMPLETE --(all earlier buckets launched)--> IN_FLIGHT --wait--> DONE

A summation that adds several backwards before it sends (the fixed-point sum of reproducible
mode) takes a ``COMPLETE`` bucket back to ``FILLING`` for the next one and launches only in the last.
Such summations lay out subclasses of :class:`Bucket` with buffers of their own
(:class:`~phalanx.parallel.fixed_point.FixedPointBucket`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


class BucketState(enum.Enum):
    FILLING = "filling"
    COMPLETE = "complete"
    IN_FLIGHT = "in flight"
    DONE = "done"


#: Gradients are fused into buckets of about this size by default; see ``benchmarks/RESULTS.md``.
DEFAULT_FUSION_THRESHOLD_MB = 25.0

#: The first bucket of a step closes at this size (when the threshold is finite and larger), so
#: that communication starts early in backward whatever the threshold; see ``benchmarks/RESULTS.md``.
FIRST_BUCKET_MB = 1.0


def plan_buckets(params: Sequence[torch.Tensor], threshold_mb: float,
                 first_bucket_mb: float | None = None) -> list[list[int]]:
    """Group parameter indices, in the given order (the order gradients become ready), into buckets.

    A bucket is closed as soon as it holds ``threshold_mb`` or more, so a large parameter shares
    its bucket with the small ones ready just before it (typically its own bias) instead of
    leaving them a collective of their own. The first bucket of each dtype and device closes
    already at ``first_bucket_mb`` (default :data:`FIRST_BUCKET_MB`) if that is smaller. ``0``
    gives one tensor per bucket and ``inf`` one bucket per dtype and device. A bucket never mixes
    dtypes or devices.
    """
    first_bucket_mb = FIRST_BUCKET_MB if first_bucket_mb is None else first_bucket_mb
    limit = math.inf if threshold_mb == math.inf else threshold_mb * 2**20
    first_limit = limit if threshold_mb == math.inf else min(limit, first_bucket_mb * 2**20)
    groups: list[list[int]] = []
    open_groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], float] = {}
    caps: dict[tuple[torch.dtype, torch.device], float] = {}
    for index, param in enumerate(params):
        key = (param.dtype, param.device)
        if key not in open_groups:
            open_groups[key] = []
            groups.append(open_groups[key])
            sizes[key] = 0
            caps[key] = limit if key in caps else first_limit
        open_groups[key].append(index)
        sizes[key] += param.numel() * param.element_size()
        if sizes[key] >= caps[key]:
            del open_groups[key]
    return groups


@dataclass
class Bucket:
    """One fused reduction: a flat buffer, the parameters it carries and its per-step state."""

    index: int
    param_indices: list[int]
    flat: torch.Tensor
    views: list[torch.Tensor]
    trailer: torch.Tensor
    pending: int = 0
    used: list[bool] = field(default_factory=list, repr=False)
    #: Per parameter: its gradient was handed over in the backward running now.
    packed: list[bool] = field(default_factory=list, repr=False)
    state: BucketState = BucketState.FILLING
    handle: Any = None
    #: Kept for this bucket from step to step by its reduction (TopK's residual), see ``reductions.py``.
    context: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def allocate(cls, index: int, param_indices: list[int], params: Sequence[torch.Tensor]) -> "Bucket":
        members = [params[i] for i in param_indices]
        numel = sum(p.numel() for p in members)
        flat = torch.zeros(numel + len(members) + 1, dtype=members[0].dtype, device=members[0].device)
        views, offset = [], 0
        for param in members:
            views.append(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        return cls(index, list(param_indices), flat, views, flat[numel:], used=[False] * len(members))

    @property
    def gradient_numel(self) -> int:
        return self.flat.numel() - self.trailer.numel()

    @property
    def gradient(self) -> torch.Tensor:
        """The gradient part of ``flat`` (the trailer follows it)."""
        return self.flat[: self.gradient_numel]

    def reset(self) -> None:
        """Ready for the next backward (its buffer allocated again if :meth:`release` freed it)."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.flat.numel() * self.flat.element_size())
        self.pending = len(self.param_indices)
        self.packed = [False] * len(self.param_indices)
        self.state = BucketState.FILLING
        self.handle = None

    def release(self) -> None:
        """Free the buffer until the next backward: its sums were consumed (a sharded optimizer's
        shard of them, already applied). Views of it, ``.grad`` among them, must be dropped first."""
        self.flat.untyped_storage().resize_(0)

    def write_trailer(self, samples: int) -> None:
        """Write the "had a gradient" flags and the sample count into the trailer (two small operations)."""
        if all(self.used):
            self.trailer[:-1].fill_(1)
        else:
            self.trailer[:-1].copy_(torch.tensor(self.used, dtype=self.trailer.dtype))
        self.trailer[-1].fill_(samples)

    def read_trailer(self) -> tuple[list[float], float]:
        """After the sum over ranks: per parameter, how many ranks had a gradient; and all ranks' samples."""
        values = self.trailer.tolist()
        return values[:-1], values[-1]
