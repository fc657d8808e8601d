"""The differentiable collectives: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter``.

Gradients follow Horovod's definitions: allreduce's gradient is the same allreduce of the
output gradient; allgather's is the average of the output gradients, cut to this rank's rows;
broadcast's is that average on the root and zero elsewhere; alltoall's sends each gradient row
back where it came from; reducescatter's gathers the shares' gradients (scaled like the forward).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from phalanx.horovod.torch import basics
from phalanx.horovod.torch.basics import Average, Sum
from phalanx.horovod.torch.compression import Compressor, NoneCompressor
from phalanx.horovod.torch.mpi_ops import (
    allgather_async,
    allreduce_async,
    alltoall_async,
    broadcast_async,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_reducescatter_async,
    reducescatter_async,
    synchronize,
)
from phalanx.horovod.torch.process_sets import ProcessSet, global_process_set, position, set_size


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, prescale: float, postscale: float, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale, postscale, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(allreduce_async(grad.contiguous(), None, None, op, prescale, postscale, process_set))
        return reduced, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = NoneCompressor, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Average (or ``op``-reduce) ``tensor`` over the set; differentiable; the input is not modified.
    Where no gradient can flow (a metric, a loss under ``no_grad``) it skips autograd's node, which
    costs about as much as the rest of the call's own work."""
    basics.op_name(op, average)  # validates and warns once, here
    op = op if op is not None else (Average if average is None or average else Sum)
    compressed, context = compression.compress(tensor)
    if torch.is_grad_enabled() and compressed.requires_grad:
        reduced = _Allreduce.apply(compressed, op, prescale_factor, postscale_factor, name, process_set)
    else:
        reduced = synchronize(allreduce_async(compressed, None, name, op, prescale_factor, postscale_factor,
                                              process_set))
    return compression.decompress(reduced, context)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: int, prescale: float, postscale: float, name: str | None, process_set: ProcessSet,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, prescale, postscale,
                                                         process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], None, None, op, prescale,
                                                      postscale, process_set))
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] = NoneCompressor, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one fused operation; differentiable; the inputs are not modified."""
    basics.op_name(op, average)
    op = op if op is not None else (Average if average is None or average else Sum)
    compressed, contexts = zip(*[compression.compress(t) for t in tensors])
    reduced = _GroupedAllreduce.apply(op, prescale_factor, postscale_factor, name, process_set, *compressed)
    return [compression.decompress(t, c) for t, c in zip(reduced, contexts)]


def _rows_before(rows: int, process_set: ProcessSet) -> int:
    """How many rows the ranks before this one contributed to an allgather of ``rows`` each."""
    counts = synchronize(allgather_async(torch.tensor([rows], dtype=torch.int64), None, process_set))
    return int(counts[:position(process_set)].sum())


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.process_set = (tensor.shape[0] if tensor.dim() else 1), process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = synchronize(allreduce_async(grad.contiguous(), None, None, Average, 1.0, 1.0, ctx.process_set))
        offset = _rows_before(ctx.rows, ctx.process_set)
        return averaged.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0, in rank order; differentiable."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        """Each input's rows of the gradient averaged over the set, as ``allgather``'s backward."""
        averaged = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], None, None, Average, 1.0, 1.0,
                                                       ctx.process_set))
        offsets = _rows_before_each(ctx.rows, ctx.process_set)
        return (None, None, *(g.narrow(0, offset, rows) for g, offset, rows in zip(averaged, offsets, ctx.rows)))


def _rows_before_each(rows: list[int], process_set: ProcessSet) -> list[int]:
    """For each tensor of a grouped allgather, the rows the ranks before this one contributed."""
    counts = synchronize(allgather_async(torch.tensor([rows], dtype=torch.int64), None, process_set))
    return counts[:position(process_set)].sum(dim=0).tolist()


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor of a list as one operation; differentiable."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        averaged = synchronize(allreduce_async(grad.contiguous(), None, None, Average, 1.0, 1.0, ctx.process_set))
        if basics.rank() != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s tensor on every rank of the set; differentiable; the input is not modified."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple:
        returned, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set))
        return returned, None, None, None


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[r]`` rows to rank ``r``; differentiable. Returns the rows received, and with
    ``splits`` also how many came from each rank."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet,
                prescale: float, postscale: float) -> torch.Tensor:
        ctx.args = (op, process_set, prescale * postscale)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale, postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        op, process_set, scale = ctx.args
        gathered = synchronize(allgather_async(grad.contiguous(), None, process_set))
        return _scatter_gradient(gathered, op, process_set, scale), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: type[Compressor] = NoneCompressor,
                  op: int = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the set and return this rank's share of dim 0; differentiable."""
    compressed, context = compression.compress(tensor)
    share = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(share, context)


def _scatter_gradient(gathered: torch.Tensor, op: int, process_set: ProcessSet, scale: float) -> torch.Tensor:
    """A reduce-scatter's input gradient from the allgathered output gradients, as Horovod defines it:
    with ``Sum`` every rank's share counts ``size`` times, with ``Average`` once; then the
    forward's pre- and postscale."""
    if op == Sum:
        scale *= set_size(process_set)
    return gathered.mul_(scale) if scale != 1.0 else gathered


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, process_set: ProcessSet, prescale: float, postscale: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, process_set, prescale * postscale)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set, prescale,
                                                             postscale)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        op, process_set, scale = ctx.args
        gathered = synchronize(grouped_allgather_async([g.contiguous() for g in grads], None, process_set))
        return (None, None, None, None, None, *(_scatter_gradient(g, op, process_set, scale) for g in gathered))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = NoneCompressor, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce-scatter each tensor of a list as one operation; differentiable."""
    compressed, contexts = zip(*[compression.compress(t) for t in tensors])
    shares = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor, *compressed)
    return [compression.decompress(s, c) for s, c in zip(shares, contexts)]
