"""Horovod's collectives without autograd: asynchronous submission, integer handles, ``poll``, ``synchronize``.

Each ``*_async`` launches a phalanx collective at once (in call order, as torch.distributed
matches them) and returns an integer handle; ``synchronize(handle)`` waits and returns the
result, or raises the operation's error (also one found when it started, as Horovod reports
errors with results). The cross-rank check of phalanx's collectives makes mismatched shapes,
dtypes, ops and roots raise :class:`HorovodMismatchError` on every rank; a name still in flight
(submitted and not synchronized, failed or not) raises ``ValueError`` at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from phalanx.comm import collectives
from phalanx.errors import ConfigurationError, PhalanxError
from phalanx.horovod.torch import basics, timeline
from phalanx.horovod.torch.basics import Average, Sum
from phalanx.horovod.torch.exceptions import horovod_errors
from phalanx.horovod.torch.process_sets import ProcessSet, global_process_set, root_position, scope_of, set_size


class _Failed:
    """An operation that failed when it started: ``synchronize`` raises its error, as Horovod
    reports a collective's error with its result (the name stays taken until then)."""

    def __init__(self, error: PhalanxError):
        self.error = error

    def wait(self) -> Any:
        raise self.error

    def is_completed(self) -> bool:
        return True


class AllOf:
    """Several collectives in flight as one: ``wait()`` returns their results in order."""

    def __init__(self, handles: Sequence[Any]):
        self.handles = list(handles)

    def wait(self) -> list[Any]:
        return [handle.wait() for handle in self.handles]

    def is_completed(self) -> bool:
        return all(handle.is_completed() for handle in self.handles)


@dataclass
class _Pending:
    kind: str
    name: str
    named: bool
    work: Any
    finish: Callable[[Any], Any]
    start_us: float
    details: dict[str, Any] = field(default_factory=dict)


_pending: dict[int, _Pending] = {}
_in_flight: dict[str, int] = {}
_handles = itertools.count(1)
_auto_names = itertools.count()


def _submit(kind: str, name: str | None, process_set: ProcessSet, launch: Callable[[], Any],
            finish: Callable[[Any], Any] = lambda result: result, tensors: Sequence[torch.Tensor] = ()) -> int:
    """Launch a collective inside ``process_set``; return its handle."""
    basics.require_init()
    scope = scope_of(process_set)
    if name is not None and name in _in_flight:
        raise ConfigurationError(
            f"Requested to {kind} a tensor with the same name '{name}' as another tensor that is currently being "
            "processed. Synchronize the first one before reusing its name, or give each a distinct name."
        )
    details = {"shapes": [list(t.shape) for t in tensors], "dtype": str(tensors[0].dtype)} \
        if timeline.active() and tensors else {}
    start = timeline.now_us()
    try:
        with horovod_errors(), collectives.within(scope):
            work = launch()
    except PhalanxError as error:  # as in Horovod, the operation's error comes with its result
        work = _Failed(error)
    handle = next(_handles)
    _pending[handle] = _Pending(kind, name or f"{kind}.noname.{next(_auto_names)}", name is not None, work,
                                finish, start, details)
    if name is not None:
        _in_flight[name] = handle
    return handle


def forget() -> None:
    """Drop every operation not synchronized yet (at shutdown: a fresh ``init`` starts clean)."""
    _pending.clear()
    _in_flight.clear()


basics.on_shutdown(forget)


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has completed (then ``synchronize`` does not block)."""
    if handle not in _pending:
        raise ConfigurationError(f"unknown handle {handle!r}: it was never returned or was already synchronized.")
    return bool(_pending[handle].work.is_completed())


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle``; return its output (``None`` for an unknown handle, as Horovod)."""
    pending = _pending.pop(handle, None)
    if pending is None:
        return None
    try:
        with horovod_errors():
            result = pending.finish(pending.work.wait())
    finally:
        if pending.named:
            _in_flight.pop(pending.name, None)
        if timeline.active():
            timeline.record(pending.kind.upper(), pending.name, pending.start_us, pending.details)
    return result


# --- allreduce -------------------------------------------------------------------------------


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``tensor`` in place by ``factor`` as Horovod does: integers in float64 and back
    (truncated toward zero), float16 and bfloat16 on the CPU in float32 math."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point() and (tensor.is_cuda or tensor.dtype not in (torch.float16, torch.bfloat16)):
        return tensor.mul_(factor)
    wide = torch.float32 if tensor.is_floating_point() else torch.float64
    return tensor.copy_(tensor.to(wide).mul_(factor))


def _scaled(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tensor: scale_(tensor, factor)


def _summed_then_scaled(op: str, dtype: torch.dtype, postscale: float, size: int) -> tuple[str, float]:
    """Horovod averages integers as their sum scaled by ``1/size`` (in float64, then truncated):
    the op to send and the factor to apply after it."""
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        return "sum", postscale / size
    return op, postscale


def _allreduce_async(tensor: torch.Tensor, output: torch.Tensor, name: str | None, op: str, prescale: float,
                     postscale: float, process_set: ProcessSet) -> int:
    op, postscale = _summed_then_scaled(op, tensor.dtype, postscale, set_size(process_set))

    def launch() -> Any:
        if output is not tensor:
            output.copy_(tensor)
        scale_(output, prescale)
        return collectives.allreduce_(output, op, async_op=True)

    return _submit("allreduce", name, process_set, launch, _scaled(postscale), [tensor])


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start averaging (or ``op``-reducing) ``tensor`` over the set; the input is not modified."""
    op_name = basics.op_name(op, average)
    return _allreduce_async(tensor, torch.empty_like(tensor), name, op_name, prescale_factor, postscale_factor,
                            process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` in place; ``synchronize`` returns it."""
    op_name = basics.op_name(op, average)
    return _allreduce_async(tensor, tensor, name, op_name, prescale_factor, postscale_factor, process_set)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place over the set and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def _grouped_allreduce_async(tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], name: str | None,
                             op: str, prescale: float, postscale: float, process_set: ProcessSet) -> int:
    """One fused allreduce per (dtype, device) of the list, results copied into ``outputs``."""
    tensors, outputs = list(tensors), list(outputs)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    reductions = [_summed_then_scaled(op, dtype, postscale, set_size(process_set)) for dtype, _ in groups]
    flats: list[torch.Tensor] = []

    def launch() -> AllOf:
        for indices in groups.values():
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in indices])
            flats.append(scale_(flat, prescale))
        return AllOf([collectives.allreduce_(flat, sent, async_op=True) for flat, (sent, _) in zip(flats, reductions)])

    def finish(_: Any) -> list[torch.Tensor]:
        for indices, flat, (_, after) in zip(groups.values(), flats, reductions):
            pieces = scale_(flat, after).split([tensors[i].numel() for i in indices])
            for i, piece in zip(indices, pieces):
                outputs[i].copy_(piece.view_as(outputs[i]))
        return outputs

    return _submit("grouped_allreduce", name, process_set, launch, finish, tensors)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing a list of tensors as one fused operation; the inputs are not modified."""
    op_name = basics.op_name(op, average)
    return _grouped_allreduce_async(tensors, [torch.empty_like(t) for t in tensors], name, op_name,
                                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start reducing a list of tensors in place as one fused operation."""
    op_name = basics.op_name(op, average)
    return _grouped_allreduce_async(tensors, tensors, name, op_name, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors in place; return them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                           process_set: ProcessSet = global_process_set) -> int:
    """Start summing (``hvd.Sum``) or averaging a sparse COO tensor over the set: every rank's
    indices and values are allgathered; ``synchronize`` returns the (coalesced) sparse result."""
    op_name = basics.op_name(op)
    if op_name not in ("sum", "avg"):
        raise ConfigurationError("sparse allreduce supports op=hvd.Average and op=hvd.Sum.")
    if not tensor.is_sparse:
        raise ConfigurationError("sparse_allreduce_async takes a sparse COO tensor; use allreduce_async for a dense one.")
    sparse = tensor.coalesce()
    factor = 1.0 / set_size(process_set) if op_name == "avg" else 1.0
    return _submit("sparse_allreduce", name, process_set, lambda: gather_sparse(sparse),
                   lambda gathered: summed_sparse(gathered, sparse.shape, factor), [sparse.values()])


def gather_sparse(sparse: torch.Tensor) -> AllOf:
    """Start allgathering a coalesced sparse COO tensor's indices (a row per entry) and values over
    the current scope: Horovod's sparse allreduce, also the optimizer's for sparse gradients."""
    return AllOf([collectives.allgather(sparse.indices().t().contiguous(), async_op=True),
                  collectives.allgather(sparse.values().contiguous(), async_op=True)])


def summed_sparse(gathered: list[torch.Tensor], shape: torch.Size, factor: float) -> torch.Tensor:
    """Every rank's entries (:func:`gather_sparse`'s results) as one coalesced sparse sum, times ``factor``."""
    indices, values = gathered
    return torch.sparse_coo_tensor(indices.t(), scale_(values, factor), shape).coalesce()


# --- allgather, broadcast, alltoall, reducescatter --------------------------------------------


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's tensor along dim 0 (first dimensions may differ)."""
    return _submit("allgather", name, process_set, lambda: collectives.allgather(tensor, async_op=True),
                   tensors=[tensor])


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allgathering each tensor of a list; ``synchronize`` returns the list of results."""
    return _submit("grouped_allgather", name, process_set,
                   lambda: AllOf([collectives.allgather(t, async_op=True) for t in tensors]), tensors=list(tensors))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start copying the tensor of global rank ``root_rank`` to every rank of the set (into a new tensor)."""
    root = root_position(process_set, root_rank)
    return _submit("broadcast", name, process_set, lambda: collectives.broadcast(tensor, root, async_op=True),
                   tensors=[tensor])


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting ``tensor`` in place with global rank ``root_rank``'s."""
    root = root_position(process_set, root_rank)
    return _submit("broadcast", name, process_set, lambda: collectives.broadcast_(tensor, root, async_op=True),
                   tensors=[tensor])


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[r]`` rows to rank ``r`` (equal shares without ``splits``).

    ``synchronize`` returns ``(output, received_splits)``: the rows received, in rank order, and
    how many came from each rank (int32).
    """
    counts = None if splits is None else [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor)
                                                           else splits)]

    def launch() -> AllOf:
        main = collectives.alltoall(tensor, counts, async_op=True)
        world = set_size(process_set)
        sent = counts if counts is not None else [tensor.shape[0] // world] * world
        received = collectives.alltoall(torch.tensor(sent, dtype=torch.int64), async_op=True, check=False)
        return AllOf([main, received])

    return _submit("alltoall", name, process_set, launch,
                   lambda results: (results[0], results[1].to(torch.int32)), [tensor])


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over the set and giving each rank its share of dim 0 (the first ranks
    get one row more when it does not divide)."""
    sent, after = _summed_then_scaled(_reducescatter_op(op), tensor.dtype, postscale_factor, set_size(process_set))

    def launch() -> Any:
        work = tensor if prescale_factor == 1.0 else scale_(tensor.clone(), prescale_factor)
        return collectives.reduce_scatter(work, sent, async_op=True)

    return _submit("reducescatter", name, process_set, launch, _scaled(after), [tensor])


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start reduce-scattering each tensor of a list; ``synchronize`` returns the list of shares."""
    op_name = _reducescatter_op(op)
    reductions = [_summed_then_scaled(op_name, t.dtype, postscale_factor, set_size(process_set)) for t in tensors]

    def launch() -> AllOf:
        return AllOf([collectives.reduce_scatter(t if prescale_factor == 1.0 else scale_(t.clone(), prescale_factor),
                                                sent, async_op=True) for t, (sent, _) in zip(tensors, reductions)])

    return _submit("grouped_reducescatter", name, process_set, launch,
                   lambda shares: [scale_(share, after) for share, (_, after) in zip(shares, reductions)],
                   list(tensors))


def _reducescatter_op(op: int) -> str:
    if op not in (Average, Sum):
        raise ConfigurationError("reducescatter supports only op=hvd.Average and op=hvd.Sum.")
    return basics.op_name(op)


# --- synchronisation ---------------------------------------------------------------------------


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set has reached this point."""
    synchronize(_submit("barrier", None, process_set, lambda: collectives.barrier(async_op=True)))


def join(device: int = -1) -> int:
    """This rank has run out of data: add zeros to the other ranks' allreduces (the optimizer's
    included) until every rank has joined. Returns the rank that joined last. ``device`` is unused:
    the zeros are made on this worker's device."""
    basics.require_init()
    with horovod_errors():
        return collectives.join()
