"""``hvd.Compression``: what a tensor travels as. ``fp16`` is phalanx's ``reduction="fp16"``.

A compressor's ``compress(tensor)`` returns the tensor to send and a context, ``decompress``
turns the received one back. ``wire_dtype`` tells ``DistributedOptimizer`` which dtype its
gradient buckets travel in (``None``: as they are).
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Sends tensors as they are (the base of every compressor)."""

    wire_dtype: torch.dtype | None = None

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return the tensor to send and what ``decompress`` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the received tensor in its original form."""
        return tensor


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16: half the bytes, about three significant digits."""

    wire_dtype = torch.float16

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point() and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
