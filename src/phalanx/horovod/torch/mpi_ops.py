"""Horovod's collectives without autograd: asynchronous submission, integer handles, ``poll``, ``synchronize``.

Each ``*_async`` submits its operation to the negotiation (:mod:`~phalanx.horovod.torch.negotiation`)
and returns an integer handle at once; the operation starts when every rank of its process set has
submitted one of the same name (an unnamed one is named by its kind and how many of that kind the
process set had since the last ``barrier`` or ``join``, or the generation's start: ``init``, an
elastic reset), so ranks may submit them in different orders. ``synchronize(handle)`` waits and
returns the result, or raises the operation's error: ranks that disagree on dtype, shape, op or
root all raise :class:`HorovodMismatchError`, with the same message. Having compared the records,
the negotiation starts phalanx's collectives without their own cross-rank check (``check=False``);
an allreduce of one CPU tensor without prescaling also says how its data may travel with its
agreement instead (:class:`~phalanx.horovod.torch.negotiation.Fold`).
A name still being processed on this rank (submitted and not completed) raises ``ValueError`` at
once, on this rank only.
"""

from __future__ import annotations

import itertools
import logging
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from phalanx.comm import collectives, runtime, wire
from phalanx.comm.communicator import Attachment
from phalanx.errors import ConfigurationError
from phalanx.horovod.torch import basics, negotiation, timeline
from phalanx.horovod.torch.basics import Average, Sum
from phalanx.horovod.torch.exceptions import horovod_errors
from phalanx.horovod.torch.process_sets import (
    ProcessSet, global_process_set, members, root_position, scope_of, set_size)

logger = logging.getLogger(__name__)
Finish = Callable[[Any], Any]


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
    work: negotiation.Negotiated
    finish: Finish
    start_us: float
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Operations:
    """This rank's operations in one generation of the job: a new generation (``init``, an elastic
    reset) starts without any, its unnamed operations counted from zero on every rank."""

    pending: dict[int, _Pending] = field(default_factory=dict)  # by handle, until synchronized
    in_flight: dict[str, int] = field(default_factory=dict)  # the handle of each name not synchronized yet
    unnamed: dict[tuple[str, int], int] = field(default_factory=dict)  # how many, by kind and process set


OPERATIONS: Attachment[_Operations] = Attachment("horovod operations")
_handles = itertools.count(1)  # never reused, across generations too


def _operations() -> _Operations:
    """The current generation's operations (before ``init``, none: every handle is unknown)."""
    if not runtime.is_initialized():
        return _Operations()
    return runtime.communicator().attached(OPERATIONS, _Operations)


def _submit(kind: str, name: str | None, process_set: ProcessSet, launch: negotiation.Launch,
            finish: Finish = lambda result: result, tensors: Sequence[torch.Tensor] = (),
            fold: negotiation.Fold | None = None, **agreed: Any) -> int:
    """Submit an operation of ``process_set`` to the negotiation; return its handle.

    ``agreed``: what every rank must pass alike (op, scale factors, root), beside the tensors'
    dtypes, shapes and devices. ``fold``: how the data of an allreduce over the whole job may travel
    with its agreement (ignored for a process set's).
    """
    basics.require_init()
    scope_of(process_set)  # a registered set this rank belongs to
    operations = _operations()
    earlier = operations.pending.get(operations.in_flight.get(name, 0)) if name is not None else None
    if earlier is not None and not earlier.work.is_completed():  # a completed one frees its name, as in Horovod
        raise ConfigurationError(
            f"Requested to {kind} a tensor with the same name '{name}' as another tensor that is currently being "
            "processed. Synchronize the first one before reusing its name, or give each a distinct name."
        )
    set_id = int(process_set.process_set_id or 0)
    if name is None:  # the members of a set submit its unnamed operations of a kind in the same order
        count = operations.unnamed[kind, set_id] = operations.unnamed.get((kind, set_id), -1) + 1
        label = f"{kind}.noname.{count}"
    else:
        label = name
    record = {"kind": kind, "ranks": [int(r) for r in members(process_set)], "dtypes": [str(t.dtype) for t in tensors],
              "shapes": [list(t.shape) for t in tensors], "devices": [t.device.type for t in tensors],
              **{what: _plain(value) for what, value in agreed.items()}}
    details = {"shapes": record["shapes"], "dtype": record["dtypes"][0]} if timeline.active() and tensors else {}
    submission = negotiation.Submission((set_id, label), record, launch, fold if set_id == 0 else None)
    handle = next(_handles)
    operations.pending[handle] = _Pending(kind, label, name is not None, negotiation.current().submit(submission),
                                          finish, timeline.now_us(), details)
    if name is not None:
        operations.in_flight[name] = handle
    return handle


def _plain(value: Any) -> Any:
    """An agreed value as plain data, which the negotiation sends as JSON: a numpy or torch number as
    Python's (a record of anything else would go as a torch.save archive, which refuses numpy's)."""
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, torch.Tensor):
        value = value.item()
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has completed (then ``synchronize`` does not block)."""
    pending = _operations().pending.get(handle)
    if pending is None:
        raise ConfigurationError(f"unknown handle {handle!r}: it was never returned or was already synchronized.")
    return bool(pending.work.is_completed())


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle``; return its output (``None`` for an unknown handle, as Horovod)."""
    operations = _operations()
    pending = operations.pending.pop(handle, None)
    if pending is None:
        return None
    try:
        with horovod_errors():
            result = pending.finish(pending.work.wait())
    finally:
        if pending.named and operations.in_flight.get(pending.name) == handle:
            del operations.in_flight[pending.name]
        if timeline.active():
            timeline.record(pending.kind.upper(), pending.name, pending.start_us, pending.details)
    return result


def _stand_in(record: negotiation.Record) -> negotiation.Launch:
    """A joined rank's part in an allreduce it did not submit: the same collectives, on zeros."""
    device = runtime.device() if "cuda" in record["devices"] else torch.device("cpu")
    zeros = [torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
             for shape, dtype in zip(record["shapes"], record["dtypes"])]
    size, op = len(record["ranks"]), record["op"]
    if record["kind"] == "allreduce":
        return _allreduce_plan(zeros[0], zeros[0], op, record["prescale"], record["postscale"], size)[0]
    return _grouped_allreduce_plan(zeros, zeros, op, record["prescale"], record["postscale"], size)[0]


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


def _allreduce_plan(tensor: torch.Tensor, output: torch.Tensor, op: str, prescale: float, postscale: float,
                    size: int) -> tuple[negotiation.Launch, Finish, negotiation.Fold | None]:
    """How to start reducing ``tensor`` into ``output``, what to do with the result, and how its data may
    go with the agreement instead (a CPU tensor without prescaling, whose in-place preparation can be
    repeated; see :class:`~phalanx.horovod.torch.negotiation.Fold`)."""
    sent, after = _summed_then_scaled(op, tensor.dtype, postscale, size)

    def copied() -> torch.Tensor:
        if output is not tensor:
            output.copy_(tensor)
        return output

    def launch() -> Any:
        return collectives.allreduce_(scale_(copied(), prescale), sent, async_op=True, check=False, algorithm="auto")

    try:
        plan = wire.reduction(tensor.dtype, sent, "allreduce")
    except ConfigurationError:  # a dtype that cannot be reduced: the launch raises it on every rank
        plan = None
    foldable = plan is not None and prescale == 1.0 and not tensor.is_cuda and tensor.numel() > 0
    fold = negotiation.Fold(lambda: copied().detach(), sent, plan, output) if foldable else None
    return launch, _scaled(after), fold


def _allreduce_async(tensor: torch.Tensor, output: torch.Tensor, name: str | None, op: str, prescale: float,
                     postscale: float, process_set: ProcessSet) -> int:
    launch, finish, fold = _allreduce_plan(tensor, output, op, prescale, postscale, set_size(process_set))
    return _submit("allreduce", name, process_set, launch, finish, [tensor], fold=fold, op=op, prescale=prescale,
                   postscale=postscale)


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


def _grouped_allreduce_plan(tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: str,
                            prescale: float, postscale: float, size: int) -> tuple[negotiation.Launch, Finish]:
    """One fused allreduce per (dtype, device) of the list, results copied into ``outputs``."""
    tensors, outputs = list(tensors), list(outputs)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    reductions = [_summed_then_scaled(op, dtype, postscale, size) for dtype, _ in groups]
    flats: list[torch.Tensor] = []

    def launch() -> AllOf:
        for indices in groups.values():
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in indices])
            flats.append(scale_(flat, prescale))
        return AllOf([collectives.allreduce_(flat, sent, async_op=True, check=False, algorithm="auto")
                      for flat, (sent, _) in zip(flats, reductions)])

    def finish(_: Any) -> list[torch.Tensor]:
        for indices, flat, (_, after) in zip(groups.values(), flats, reductions):
            pieces = scale_(flat, after).split([tensors[i].numel() for i in indices])
            for i, piece in zip(indices, pieces):
                outputs[i].copy_(piece.view_as(outputs[i]))
        return outputs

    return launch, finish


def _grouped_allreduce_async(tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], name: str | None,
                             op: str, prescale: float, postscale: float, process_set: ProcessSet) -> int:
    launch, finish = _grouped_allreduce_plan(tensors, outputs, op, prescale, postscale, set_size(process_set))
    return _submit("grouped_allreduce", name, process_set, launch, finish, list(tensors), op=op, prescale=prescale,
                   postscale=postscale)


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


class SparseHandle(int):
    """What ``sparse_allreduce_async`` returns: as in Horovod, a callable that waits and returns the
    coalesced sparse result (``handle()``); it is also an integer handle that ``poll`` and
    ``synchronize`` take, as phalanx's other asynchronous operations return."""

    def __call__(self) -> torch.Tensor:
        return synchronize(self)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                           process_set: ProcessSet = global_process_set) -> SparseHandle:
    """Start summing (``hvd.Sum``) or averaging a sparse COO tensor over the set: every rank's
    indices and values are allgathered. ``handle()`` (or ``synchronize(handle)``) waits and returns
    the coalesced sparse result."""
    op_name = basics.op_name(op)
    if op_name not in ("sum", "avg"):
        raise ConfigurationError("sparse allreduce supports op=hvd.Average and op=hvd.Sum.")
    if not tensor.is_sparse:
        raise ConfigurationError("sparse_allreduce_async takes a sparse COO tensor; use allreduce_async for a dense one.")
    sparse = tensor.coalesce()
    factor = 1.0 / set_size(process_set) if op_name == "avg" else 1.0
    return SparseHandle(_submit("sparse_allreduce", name, process_set, lambda: gather_sparse(sparse),
                                lambda gathered: summed_sparse(gathered, sparse.shape, factor), [sparse.values()],
                                op=op_name, dense_shape=list(sparse.shape)))


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
                   tensors=[tensor], ragged=True)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allgathering each tensor of a list; ``synchronize`` returns the list of results."""
    return _submit("grouped_allgather", name, process_set,
                   lambda: AllOf([collectives.allgather(t, async_op=True) for t in tensors]), tensors=list(tensors),
                   ragged=True)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start copying the tensor of global rank ``root_rank`` to every rank of the set (into a new tensor)."""
    root = root_position(process_set, root_rank)
    return _submit("broadcast", name, process_set,
                   lambda: collectives.broadcast(tensor, root, async_op=True, check=False),
                   tensors=[tensor], root_rank=root_rank)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting ``tensor`` in place with global rank ``root_rank``'s."""
    root = root_position(process_set, root_rank)
    return _submit("broadcast", name, process_set,
                   lambda: collectives.broadcast_(tensor, root, async_op=True, check=False),
                   tensors=[tensor], root_rank=root_rank)


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
        main = collectives.alltoall(tensor, counts, async_op=True, check=False)
        world = set_size(process_set)
        sent = counts if counts is not None else [tensor.shape[0] // world] * world
        received = collectives.alltoall(torch.tensor(sent, dtype=torch.int64), async_op=True, check=False)
        return AllOf([main, received])

    return _submit("alltoall", name, process_set, launch,
                   lambda results: (results[0], results[1].to(torch.int32)), [tensor], ragged=True)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over the set and giving each rank its share of dim 0 (the first ranks
    get one row more when it does not divide)."""
    sent, after = _summed_then_scaled(_reducescatter_op(op), tensor.dtype, postscale_factor, set_size(process_set))

    def launch() -> Any:
        work = tensor if prescale_factor == 1.0 else scale_(tensor.clone(), prescale_factor)
        return collectives.reduce_scatter(work, sent, async_op=True, check=False)

    return _submit("reducescatter", name, process_set, launch, _scaled(after), [tensor], op=op,
                   prescale=prescale_factor, postscale=postscale_factor)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start reduce-scattering each tensor of a list; ``synchronize`` returns the list of shares."""
    op_name = _reducescatter_op(op)
    reductions = [_summed_then_scaled(op_name, t.dtype, postscale_factor, set_size(process_set)) for t in tensors]

    def launch() -> AllOf:
        scaled = [t if prescale_factor == 1.0 else scale_(t.clone(), prescale_factor) for t in tensors]
        return AllOf([collectives.reduce_scatter(t, sent, async_op=True, check=False)
                      for t, (sent, _) in zip(scaled, reductions)])

    return _submit("grouped_reducescatter", name, process_set, launch,
                   lambda shares: [scale_(share, after) for share, (_, after) in zip(shares, reductions)],
                   list(tensors), op=op_name, prescale=prescale_factor, postscale=postscale_factor)


def _reducescatter_op(op: int) -> str:
    if op not in (Average, Sum):
        raise ConfigurationError("reducescatter supports only op=hvd.Average and op=hvd.Sum.")
    return basics.op_name(op)


# --- synchronisation ---------------------------------------------------------------------------


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set has reached this point (the agreement is the barrier: nothing
    else is sent)."""
    synchronize(_submit("barrier", None, process_set, lambda: None))
    set_id = int(process_set.process_set_id or 0)
    unnamed = _operations().unnamed
    for kind, counted in list(unnamed):  # every member is here: the set's unnamed operations count afresh
        if set_id == 0 or counted == set_id:
            del unnamed[kind, counted]


def join(device: int = -1) -> int:
    """This rank has run out of data: add zeros to the other ranks' allreduces (the optimizer's
    included) until every rank has joined; their other collectives raise on *their* ranks meanwhile.
    Returns the rank that joined last, the same on every rank: the negotiation's cycles order the joins
    (the highest rank where several joined in the same cycle). ``device`` is unused: the zeros are made
    on this worker's device."""
    basics.require_init()
    negotiator = negotiation.current()
    joined = negotiator.join(_stand_in)  # negotiated allreduces get zeros, the others fail
    with horovod_errors():
        collectives.join()  # so do the collectives run outside it (DistributedOptimizer's buckets)
    last = negotiator.all_joined(joined)
    _operations().unnamed.clear()  # every rank is here: unnamed operations the joined ones never made are forgotten
    logger.debug("hvd.join() on rank %d: every rank has joined, rank %d last", runtime.rank(), last)
    return last
