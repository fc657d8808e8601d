"""Gradient buckets: which parameters are fused into one allreduce, and each bucket's state.

A bucket owns one flat buffer laid out as ``[grad_0, grad_1, ..., used_0, used_1, ...]``: the
gradients of its parameters, then one *trailer* element per parameter that holds 1 where this
rank had a gradient for it. Summed over ranks, the trailer tells every rank which parameters got
a gradient anywhere, without a separate collective. After a synchronised step each parameter's
``.grad`` is a view into its bucket, so the next step fills the bucket without a copy.

State machine of one bucket during a synchronised backward::

    FILLING --(all its gradients packed, all earlier buckets launched)--> IN_FLIGHT --wait--> DONE
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


class BucketState(enum.Enum):
    FILLING = "filling"
    IN_FLIGHT = "in flight"
    DONE = "done"


def plan_buckets(params: Sequence[torch.Tensor], threshold_mb: float) -> list[list[int]]:
    """Group parameter indices, in the given order, into buckets of about ``threshold_mb``.

    ``0`` gives one tensor per bucket and ``inf`` one bucket per dtype and device. A bucket never
    mixes dtypes or devices, and a parameter larger than the threshold gets a bucket of its own.
    """
    limit = math.inf if threshold_mb == math.inf else threshold_mb * 2**20
    groups: list[list[int]] = []
    open_groups: dict[tuple[torch.dtype, torch.device], tuple[list[int], list[int]]] = {}
    for index, param in enumerate(params):
        key = (param.dtype, param.device)
        group, size = open_groups.get(key, (None, [0]))
        nbytes = param.numel() * param.element_size()
        if group is None or (group and size[0] + nbytes > limit):
            group, size = [], [0]
            groups.append(group)
            open_groups[key] = (group, size)
        group.append(index)
        size[0] += nbytes
    return groups


@dataclass
class Bucket:
    """One fused allreduce: a flat buffer and the parameters it carries."""

    index: int
    param_indices: list[int]
    flat: torch.Tensor
    views: list[torch.Tensor]
    trailer: torch.Tensor
    pending: int = 0
    used: list[bool] = field(default_factory=list, repr=False)
    state: BucketState = BucketState.FILLING
    handle: Any = None
    residual: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def allocate(cls, index: int, param_indices: list[int], params: Sequence[torch.Tensor]) -> "Bucket":
        members = [params[i] for i in param_indices]
        numel = sum(p.numel() for p in members)
        flat = torch.zeros(numel + len(members), dtype=members[0].dtype, device=members[0].device)
        views, offset = [], 0
        for param in members:
            views.append(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        return cls(index, list(param_indices), flat, views, flat[numel:], used=[False] * len(members))

    @property
    def gradient_numel(self) -> int:
        return self.flat.numel() - self.trailer.numel()

    def reset(self) -> None:
        """Ready for the next synchronised backward."""
        self.pending = len(self.param_indices)
        self.state = BucketState.FILLING
        self.handle = None

    def write_trailer(self) -> None:
        """Copy the per-parameter "had a gradient" flags into the trailer: one tensor operation."""
        if all(self.used):
            self.trailer.fill_(1)
        else:
            self.trailer.copy_(torch.tensor(self.used, dtype=self.trailer.dtype))
