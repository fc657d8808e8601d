"""How a tensor of each dtype and layout travels through a collective: alike on every transport.

Gloo's collectives take float16/32/64, bfloat16, int8/32/64, uint8, bool and complex tensors (and
reduce complex ones by sum only); shared memory and phalanx's algorithms reduce with torch's kernels.
So that a collective gives the same result, or the same error, whatever the transport:

* Reductions run in a dtype every path reduces exactly: floating-point and int8/uint8/int32/int64
  tensors as they are; bool as uint8 (sum and max are "any", product and min "all", as 0 or 1);
  int16 and uint16 widened to int32, uint32 to int64 (narrowed back, wrapping as the dtype's own
  arithmetic does); uint64 as int64 bits (min and max with the sign bit flipped, which keeps the
  unsigned order); complex as real and imaginary parts (sum and avg: complex numbers have no order
  and Gloo no complex product). Other dtypes have no arithmetic to reduce with and are refused.
* Moving collectives (broadcast, allgather, alltoall) carry any dtype but quantized ones as bytes.
* The tensor that travels is contiguous: a view of the caller's where possible, else a copy that
  is written back. Tensors that need grad travel detached, as in ``torch.distributed``.

Every decision depends on the dtype and op alone, which the ranks agree on (the metadata check), so
a refusal is raised on every rank before anything is exchanged.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from phalanx.errors import ConfigurationError

_SIGN = -(2**63)  # int64 with only the sign bit: XOR maps uint64's order onto int64's
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
_DIRECT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                     torch.int8, torch.uint8, torch.int32, torch.int64})
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})
_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BOOL_OPS = {"sum": "max", "max": "max", "product": "min", "min": "min"}


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class Reduction:
    """How one dtype is reduced with one op: ``view`` reinterprets the caller's memory in the
    dtype that travels (``dtype``, after widening), reduced with ``op``; ``flip`` XORs the sign bit."""

    op: str
    dtype: torch.dtype
    view: Callable[[torch.Tensor], torch.Tensor] = _same
    flip: bool = False

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        """The contiguous tensor that travels for ``tensor``: ``tensor``'s own memory where possible."""
        view = self.view(tensor)
        wire = view if view.dtype == self.dtype and view.is_contiguous() else view.to(self.dtype).contiguous()
        return wire.bitwise_xor(_SIGN) if self.flip else wire

    def decode(self, wire: torch.Tensor, tensor: torch.Tensor) -> None:
        """Write the reduced ``wire`` back into ``tensor``, unless it is ``tensor``'s memory."""
        target = self.view(tensor)
        if self.flip:
            wire.bitwise_xor_(_SIGN)
        if wire is not target and not _same_memory(wire, target):
            target.copy_(wire)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape, a.stride(), a.data_ptr()) == (b.dtype, b.shape, b.stride(), b.data_ptr())


@functools.lru_cache(maxsize=None)
def reduction(dtype: torch.dtype, op: str, operation: str) -> Reduction:
    """How ``operation`` reduces ``dtype`` tensors with ``op`` (a name of ``REDUCE_OPS``).

    Raises :class:`ConfigurationError` for a dtype or op that cannot be reduced exactly; it depends
    on the arguments alone, so every rank that agreed on them raises it.
    """
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise _refusal(operation, dtype, op, "averaging needs a floating-point tensor",
                       "use op='sum' and divide, or convert first")
    if dtype in _DIRECT:
        return Reduction(op, dtype)
    if dtype in _WIDER:
        return Reduction(op, _WIDER[dtype])
    if dtype == torch.bool:
        return Reduction(_BOOL_OPS[op], torch.uint8, lambda t: t.view(torch.uint8))
    if dtype == torch.uint64:
        return Reduction(op, torch.int64, lambda t: t.view(torch.int64), flip=op in ("min", "max"))
    if dtype in _COMPLEX:
        return _complex(dtype, op, operation)
    raise _refusal(operation, dtype, op, "torch has no arithmetic to reduce it with",
                   "dequantize it first (t.dequantize())" if dtype in _QUANTIZED else
                   "convert it to a dtype that has one (e.g. t.float()) and back")


def _complex(dtype: torch.dtype, op: str, operation: str) -> Reduction:
    if op in ("min", "max"):
        raise _refusal(operation, dtype, op, "complex numbers have no order",
                       "reduce their absolute values or real parts (torch.view_as_real) instead")
    if op == "product":
        raise _refusal(operation, dtype, op, "torch.distributed has no product of complex numbers",
                       "allgather the tensors and multiply them (torch.prod over the gathered dimension)")
    return Reduction(op, dtype.to_real(), torch.view_as_real)


def _refusal(operation: str, dtype: torch.dtype, op: str, why: str, fix: str) -> ConfigurationError:
    return ConfigurationError(
        f"{operation}(op={op!r}) cannot reduce {dtype} tensors: {why}. Every rank raises this error; {fix}."
    )


def check_movable(dtype: torch.dtype, operation: str) -> None:
    """Refuse quantized tensors (their scale is not part of the data), alike on every rank."""
    if dtype in _QUANTIZED:
        raise ConfigurationError(
            f"{operation} cannot carry {dtype} tensors: their scale and zero point are not part of the data. "
            "Every rank raises this error; send t.int_repr() and the quantization parameters, or t.dequantize()."
        )


def to_bytes(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    """``tensor``'s bytes as a contiguous uint8 tensor of one row per index of dim 0 (a 0-dim tensor
    is one row): its own memory where it is contiguous and ``copy`` is false, else a copy."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
    flat = _as_integers(tensor).contiguous().view(-1)  # its own memory when contiguous
    if copy and tensor.is_contiguous():
        flat = flat.clone()
    return flat.view(torch.uint8).view(rows, row_bytes)


def from_bytes(data: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The contiguous bytes ``data`` seen as a tensor of ``dtype`` and ``shape`` (a view)."""
    integers = _INTEGER_OF_SIZE.get(dtype.itemsize, dtype)
    return data.reshape(-1).view(integers).view(dtype).view(shape)


def write_bytes(data: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy the bytes ``data`` (from :func:`to_bytes`) into ``tensor``, unless they are its memory."""
    if not (tensor.is_contiguous() and data.data_ptr() == tensor.data_ptr()):
        _as_integers(tensor).copy_(_as_integers(from_bytes(data, tensor.dtype, tensor.shape)))


def _as_integers(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` viewed as integers of its element size (copyable, whatever its dtype), where there are some."""
    integers = _INTEGER_OF_SIZE.get(tensor.element_size())
    return tensor if integers is None else tensor.view(integers)
