"""Gradient clipping of the gradient about to be applied, wherever it is applied.

Data parallelism and central storage clip where the whole reduced gradient is (every rank, or the
storage rank); parameter servers each hold a shard of it, so their norm is the sum of every
shard's squared norm (``sum_over_shards``), summed in the same order everywhere so that every
server scales its shard by the same factor.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from phalanx.errors import ConfigurationError


class Clipping:
    """Clip the gradients about to be applied: their total norm to ``max_norm`` and/or each entry
    to ``[-max_value, max_value]`` (torch's ``clip_grad_value_`` first, then ``clip_grad_norm_``)."""

    def __init__(self, max_norm: float | None = None, max_value: float | None = None):
        for name, value in (("clip_grad_norm", max_norm), ("clip_grad_value", max_value)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ConfigurationError(f"{name} must be a positive number, got {value!r}.")
        self.max_norm, self.max_value = max_norm, max_value
        self.last_norm: float | None = None  # the norm before clipping, of the last step

    @classmethod
    def from_options(cls, max_norm: float | None, max_value: float | None) -> Clipping | None:
        return None if max_norm is None and max_value is None else cls(max_norm, max_value)

    def clip(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip the gradients of every parameter ``optimizer`` steps; an optimizer that steps a shard of
        them (``px.Sharded``'s) clips its shard by the norm of the whole, through its ``clip_shards``."""
        clip_shards = getattr(optimizer, "clip_shards", None)
        if clip_shards is not None:
            clip_shards(self)
            return
        self.clip_parameters(p for group in optimizer.param_groups for p in group["params"])

    def clip_parameters(self, params: Iterable[torch.Tensor],
                        sum_over_shards: Callable[[float], float] | None = None) -> None:
        """Clip ``params``' gradients; with ``sum_over_shards`` they are one shard of the gradient,
        and the norm is that of the whole (the function sums a squared norm over the shards)."""
        params = [p for p in params if p.grad is not None]
        if self.max_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.max_value)
        if self.max_norm is None:
            return
        if sum_over_shards is None:
            self.last_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_norm))
            return
        squares = sum(float(p.grad.double().square().sum()) for p in params)
        self.last_norm = math.sqrt(sum_over_shards(squares))
        factor = min(1.0, self.max_norm / (self.last_norm + 1e-6))  # torch's clip_grad_norm_ factor
        for param in params:
            param.grad.mul_(factor)
