"""Collective operations over all workers, with cross-rank checks and async handles.

Every tensor operation first compares a small metadata record (operation, dtype, shape) across
ranks, so that a mismatch raises :class:`CollectiveMismatchError` on *every* rank instead of
hanging or silently producing garbage. ``check=False`` skips that round trip for hot paths that
plan their own buffers; ``barrier``, the object collectives and ``broadcast_tensors_`` compare
nothing. Failures of peers surface as :class:`CollectiveTimeoutError` naming the operation.
At world size 1 every operation completes at once without communication.
Each is typed by ``async_op``: the default gives the result, ``async_op=True`` a :class:`Handle` of it.
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Literal, Sequence, TypeVar, overload

import torch
import torch.distributed as dist

from phalanx.comm import algorithms, cost, runtime, shm
from phalanx.comm.ordered import OrderedExecutor
from phalanx.errors import (
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigurationError,
    PhalanxError,
)

S = TypeVar("S")
T = TypeVar("T")

REDUCE_OPS = algorithms.BACKEND_OPS
_OPERATIONS = ("allreduce", "allgather", "broadcast", "reduce", "reduce_scatter", "alltoall", "barrier", "join")
_JOIN = _OPERATIONS.index("join")
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)
# Newer torch renamed the flat-tensor collectives; older releases (>= 2.4) have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_MAX_DIMS = 12
_RECORD_LEN = 4 + _MAX_DIMS  # operation, dtype, op/root, ndim, shape...


class Handle(Generic[T]):
    """A collective in flight. ``wait()`` blocks until it is done and returns its result."""

    def __init__(self, name: str, work: Any, finish: Callable[[], T]):
        self._name = name
        self._work = work
        self._finish = finish
        self._result: tuple[T] | None = None

    def wait(self) -> T:
        """Block until the operation completes on this rank; return its result."""
        if self._result is None:
            with translate_errors(self._name):
                if self._work is not None:
                    self._work.wait()
            self._result = (self._finish(),)
        return self._result[0]

    def is_completed(self) -> bool:
        """Whether ``wait()`` would return without blocking."""
        return self._result is not None or self._work is None or self._work.is_completed()


@dataclass(frozen=True)
class Scope:
    """A subgroup of the workers that collectives can be restricted to (see :func:`within`).

    ``ranks`` are global ranks in ascending order; a collective's ranks, size and roots are
    positions in it. ``cpu_group`` carries CPU tensors and ``device_group`` CUDA ones.
    """

    ranks: tuple[int, ...]
    cpu_group: dist.ProcessGroup
    device_group: dist.ProcessGroup


_scope: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("phalanx_collective_scope", default=None)


@contextlib.contextmanager
def within(scope: Scope | None) -> Iterator[None]:
    """Restrict the collectives called inside to ``scope``'s ranks (``None``: every worker).

    Checks, error translation, averaging and async handles work as for the whole job; roots are
    positions within the scope. The allreduce goes through the backend (never shared memory,
    which spans every worker of the host). Only members of the scope may enter it.
    """
    if scope is not None and runtime.rank() not in scope.ranks:
        raise ConfigurationError(
            f"rank {runtime.rank()} is not a member of the group of ranks {list(scope.ranks)}: only its "
            "members may run its collectives."
        )
    token = _scope.set(scope)
    try:
        yield
    finally:
        _scope.reset(token)


def _size() -> int:
    scope = _scope.get()
    return runtime.size() if scope is None else len(scope.ranks)


def _rank() -> int:
    scope = _scope.get()
    return runtime.rank() if scope is None else scope.ranks.index(runtime.rank())


def _global_rank(rank: int) -> int:
    """The global rank of position ``rank`` in the current scope (the torch.distributed calls' root)."""
    scope = _scope.get()
    return rank if scope is None else scope.ranks[rank]


@contextlib.contextmanager
def translate_errors(operation: str) -> Iterator[None]:
    """Turn a backend failure into a phalanx error naming rank and operation.

    A lost or silent peer becomes :class:`CollectiveTimeoutError`; anything else the backend
    rejects becomes :class:`CollectiveError` with the backend's own words.
    """
    try:
        yield
    except PhalanxError:
        raise
    except (RuntimeError, OSError) as error:
        if not _is_peer_failure(error):
            raise CollectiveError(
                f"{operation} on rank {runtime.rank()} of {runtime.size()} was rejected by the backend: "
                f"{_first_line(error)}"
            ) from error
        raise CollectiveTimeoutError(
            f"{operation} on rank {runtime.rank()} of {runtime.size()} failed: a peer died or did not answer "
            f"within the {runtime.timeout():.0f}s timeout ({_first_line(error)}). The first failing rank's "
            "output names the root cause."
        ) from error


@overload
def allreduce(tensor: torch.Tensor, op: str = ..., *, async_op: Literal[False] = ...,
              check: bool = ..., algorithm: str = ...) -> torch.Tensor: ...
@overload
def allreduce(tensor: torch.Tensor, op: str = ..., *, async_op: Literal[True],
              check: bool = ..., algorithm: str = ...) -> Handle[torch.Tensor]: ...
def allreduce(tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
              check: bool = True, algorithm: str = "backend") -> torch.Tensor | Handle[torch.Tensor]:
    """Reduce ``tensor`` over all ranks with ``op``; return the result as a new tensor.

    ``algorithm`` is ``"backend"`` (torch.distributed's own: Gloo's ring, NCCL's choice, or shared
    memory when the transport is), one of phalanx's over point-to-point messages, ``"ring"``,
    ``"tree"``, ``"halving_doubling"`` (see :mod:`phalanx.comm.algorithms`; they run on a thread
    of their own, so ``async_op`` overlaps them), or ``"auto"``: shared memory where it is in use,
    else the algorithm the alpha-beta model of :mod:`phalanx.comm.cost` predicts fastest. In a
    hierarchical allreduce (shared memory on several hosts) it names how each slice crosses hosts.
    """
    if _scope.get() is not None:
        return _allreduce_in_scope(tensor.clone(), op, async_op, check)
    return _allreduce_into(tensor.clone(), op, async_op, check, algorithm)


@overload
def allreduce_(tensor: torch.Tensor, op: str = ..., *, async_op: Literal[False] = ...,
               check: bool = ..., algorithm: str = ...) -> torch.Tensor: ...
@overload
def allreduce_(tensor: torch.Tensor, op: str = ..., *, async_op: Literal[True],
               check: bool = ..., algorithm: str = ...) -> Handle[torch.Tensor]: ...
def allreduce_(tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
               check: bool = True, algorithm: str = "backend") -> torch.Tensor | Handle[torch.Tensor]:
    """Like :func:`allreduce`, but in place: ``tensor`` receives the result and is returned."""
    if _scope.get() is not None:
        return _allreduce_in_scope(tensor, op, async_op, check)
    return _allreduce_into(tensor, op, async_op, check, algorithm)


def _allreduce_in_scope(tensor: torch.Tensor, op: str, async_op: bool,
                        check: bool) -> torch.Tensor | Handle[torch.Tensor]:
    """The allreduce of a :func:`within` scope: the backend's, over the scope's group."""
    reduce_op = _reduce_op(op, tensor)
    if check:
        _check("allreduce", tensor, REDUCE_OPS_INDEX[op])
    return _backend_allreduce(tensor, reduce_op, _averaging(op, tensor), async_op)


@overload
def broadcast(tensor: torch.Tensor, root: int = ..., *, async_op: Literal[False] = ...,
              check: bool = ...) -> torch.Tensor: ...
@overload
def broadcast(tensor: torch.Tensor, root: int = ..., *, async_op: Literal[True],
              check: bool = ...) -> Handle[torch.Tensor]: ...
def broadcast(tensor: torch.Tensor, root: int = 0, *, async_op: bool = False,
              check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
    """Return a copy of ``root``'s tensor on every rank."""
    return _broadcast_into(tensor.clone(), root, async_op, check)


@overload
def broadcast_(tensor: torch.Tensor, root: int = ..., *, async_op: Literal[False] = ...,
               check: bool = ...) -> torch.Tensor: ...
@overload
def broadcast_(tensor: torch.Tensor, root: int = ..., *, async_op: Literal[True],
               check: bool = ...) -> Handle[torch.Tensor]: ...
def broadcast_(tensor: torch.Tensor, root: int = 0, *, async_op: bool = False,
               check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
    """Overwrite ``tensor`` in place with ``root``'s tensor; return it."""
    return _broadcast_into(tensor, root, async_op, check)


def broadcast_tensors_(tensors: Sequence[torch.Tensor], root: int = 0) -> None:
    """Overwrite every tensor in place with ``root``'s: one broadcast per (dtype, device), not per tensor.

    Each group is concatenated into one flat buffer, sent, and copied back, which for many small
    tensors (a model's parameters, a state dict) costs a few round trips instead of hundreds. Every
    rank must pass tensors of the same shapes and dtypes in the same order: the buffers are not
    checked across ranks. Tensors with no elements are skipped; ``root``'s own tensors are left as
    they are.
    """
    _check_root(root)
    if _size() == 1:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    is_root = _rank() == root
    with torch.no_grad():
        for (dtype, device), group in groups.items():
            if is_root:
                broadcast_(torch.cat([t.detach().reshape(-1) for t in group]), root, check=False)
                continue
            sizes = [t.numel() for t in group]
            flat = broadcast_(torch.empty(sum(sizes), dtype=dtype, device=device), root, check=False)
            for tensor, piece in zip(group, flat.split(sizes)):
                tensor.copy_(piece.view(tensor.shape))


@overload
def reduce(tensor: torch.Tensor, root: int = ..., op: str = ..., *, async_op: Literal[False] = ...,
           check: bool = ...) -> torch.Tensor | None: ...
@overload
def reduce(tensor: torch.Tensor, root: int = ..., op: str = ..., *, async_op: Literal[True],
           check: bool = ...) -> Handle[torch.Tensor | None]: ...
def reduce(tensor: torch.Tensor, root: int = 0, op: str = "sum", *, async_op: bool = False,
           check: bool = True) -> torch.Tensor | None | Handle[torch.Tensor | None]:
    """Reduce ``tensor`` over all ranks onto ``root``. Returns the result on root, ``None`` elsewhere."""
    _check_root(root)
    reduce_op = _reduce_op(op, tensor)
    if check:
        _check("reduce", tensor, root * len(REDUCE_OPS) + REDUCE_OPS_INDEX[op])
    return _reduce_into(tensor.clone(), root, reduce_op, op, async_op)


def reduce_(tensor: torch.Tensor, root: int = 0, op: str = "sum", *, async_op: bool = False,
            check: bool = True) -> torch.Tensor | None | Handle[torch.Tensor | None]:
    """Like :func:`reduce`, but in place: root's ``tensor`` receives the result (and is returned);
    elsewhere ``tensor`` is left unspecified and ``None`` is returned. Saves a copy of the tensor."""
    _check_root(root)
    reduce_op = _reduce_op(op, tensor)
    if check:
        _check("reduce", tensor, root * len(REDUCE_OPS) + REDUCE_OPS_INDEX[op])
    return _reduce_into(tensor, root, reduce_op, op, async_op)


def _reduce_into(result: torch.Tensor, root: int, reduce_op: Any, op: str,
                 async_op: bool) -> torch.Tensor | None | Handle[torch.Tensor | None]:
    scale = _averaging(op, result)
    is_root = _rank() == root
    shared = _one_host_executor()
    if shared is not None and not result.is_cuda:  # every rank gets the sum: as cheap as the reduction
        summed = _through(shared, result, op, "backend", scale, True, name="reduce")
        return _then(summed, lambda total: total if is_root else None, async_op)
    return _launch("reduce", lambda: dist.reduce(result, _global_rank(root), reduce_op, group=_group(result),
                                                 async_op=True),
                   lambda: scale(result) if is_root else None, async_op)


@overload
def allgather(tensor: torch.Tensor, *, async_op: Literal[False] = ..., check: bool = ...) -> torch.Tensor: ...
@overload
def allgather(tensor: torch.Tensor, *, async_op: Literal[True], check: bool = ...) -> Handle[torch.Tensor]: ...
def allgather(tensor: torch.Tensor, *, async_op: bool = False,
              check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
    """Concatenate every rank's tensor along dim 0, in rank order. First dimensions may differ."""
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    if _size() == 1:
        return _done(tensor.clone(), async_op)
    rows = _gather_records("allgather", tensor)
    if check:
        _compare(rows, "allgather", tensor, ignore_first_dim=True)
    lengths = [int(row[4]) for row in rows]
    longest = max(lengths)
    padded = _pad_rows(tensor, longest)
    pieces = [torch.empty_like(padded) for _ in lengths]
    finish = lambda: torch.cat([piece[:n] for piece, n in zip(pieces, lengths)])  # noqa: E731
    return _launch("allgather", lambda: dist.all_gather(pieces, padded, group=_group(tensor), async_op=True),
                   finish, async_op)


@overload
def reduce_scatter(tensor: torch.Tensor, op: str = ..., *, async_op: Literal[False] = ...,
                   check: bool = ...) -> torch.Tensor: ...
@overload
def reduce_scatter(tensor: torch.Tensor, op: str = ..., *, async_op: Literal[True],
                   check: bool = ...) -> Handle[torch.Tensor]: ...
def reduce_scatter(tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                   check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
    """Reduce ``tensor`` over ranks, then give rank ``r`` the ``r``-th of ``size()`` chunks along dim 0.

    Chunks follow ``torch.tensor_split``: when dim 0 is not divisible, the first chunks are one longer.
    """
    reduce_op = _reduce_op(op, tensor)
    if check:
        _check("reduce_scatter", tensor, REDUCE_OPS_INDEX[op])
    chunks = [chunk.contiguous() for chunk in torch.tensor_split(tensor, _size())]
    output = torch.empty_like(chunks[_rank()])
    scale = _averaging(op, output)
    if _size() == 1:
        return _done(scale(output.copy_(chunks[0])), async_op)
    if all(chunk.shape == output.shape for chunk in chunks):
        start = lambda: _reduce_scatter_single(output, tensor.contiguous(), reduce_op,  # noqa: E731
                                                    group=_group(tensor), async_op=True)
    else:
        start = lambda: dist.reduce_scatter(output, chunks, reduce_op, group=_group(tensor), async_op=True)  # noqa: E731
    return _launch("reduce_scatter", start, lambda: scale(output), async_op)


@overload
def alltoall(tensor: torch.Tensor, splits: Sequence[int] | None = ..., *, async_op: Literal[False] = ...,
             check: bool = ...) -> torch.Tensor: ...
@overload
def alltoall(tensor: torch.Tensor, splits: Sequence[int] | None = ..., *, async_op: Literal[True],
             check: bool = ...) -> Handle[torch.Tensor]: ...
def alltoall(tensor: torch.Tensor, splits: Sequence[int] | None = None, *, async_op: bool = False,
             check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
    """Send ``splits[r]`` rows of ``tensor`` (in order) to rank ``r``; return what all ranks sent here.

    Without ``splits`` dim 0 is divided equally. Received pieces are concatenated in rank order.
    """
    world = _size()
    splits = _alltoall_splits(tensor, splits, world)
    sent = torch.tensor(splits, dtype=torch.int64)
    if check:
        _check("alltoall", tensor, 0, ignore_first_dim=True)
    if world == 1:
        return _done(tensor.clone(), async_op)
    received = torch.empty_like(sent)
    with translate_errors("alltoall"):
        dist.all_to_all_single(received, sent, group=_group(None))
    output = tensor.new_empty((int(received.sum()), *tensor.shape[1:]))
    return _launch("alltoall", lambda: dist.all_to_all_single(
        output, tensor.contiguous(), received.tolist(), splits, group=_group(tensor), async_op=True),
        lambda: output, async_op)


@overload
def barrier(*, async_op: Literal[False] = ...) -> None: ...
@overload
def barrier(*, async_op: Literal[True]) -> Handle[None]: ...
def barrier(*, async_op: bool = False) -> None | Handle[None]:
    """Wait until every rank has reached this point."""
    if _size() == 1:
        return _done(None, async_op)
    shared = _one_host_executor()
    if shared is not None:
        return _on(shared, "barrier (shared memory)", shared.group.barrier, lambda _: None, async_op)
    return _launch("barrier", lambda: dist.barrier(group=_group(None), async_op=True),
                   lambda: None, async_op)


@overload
def broadcast_object(obj: Any = ..., root: int = ..., *, async_op: Literal[False] = ...) -> Any: ...
@overload
def broadcast_object(obj: Any = ..., root: int = ..., *, async_op: Literal[True]) -> Handle[Any]: ...
def broadcast_object(obj: Any = None, root: int = 0, *, async_op: bool = False) -> Any:
    """Return ``root``'s picklable object on every rank (peers are trusted: it is unpickled)."""
    _check_root(root)
    if _size() == 1:
        return _done(obj, async_op)
    payload = _to_bytes(obj) if _rank() == root else torch.empty(0, dtype=torch.uint8)
    length = broadcast_(torch.tensor([payload.numel()], dtype=torch.int64), root, check=False)
    if _rank() != root:
        payload = torch.empty(int(length), dtype=torch.uint8)
    handle = broadcast_(payload, root, async_op=True, check=False)
    return _then(handle, _from_bytes, async_op)


@overload
def allgather_object(obj: Any, *, async_op: Literal[False] = ...) -> list[Any]: ...
@overload
def allgather_object(obj: Any, *, async_op: Literal[True]) -> Handle[list[Any]]: ...
def allgather_object(obj: Any, *, async_op: bool = False) -> list[Any] | Handle[list[Any]]:
    """Return the list of every rank's picklable object, in rank order."""
    if _size() == 1:
        return _done([obj], async_op)
    payload = _to_bytes(obj)
    lengths = allgather(torch.tensor([payload.numel()], dtype=torch.int64), check=False).tolist()
    handle = allgather(payload, async_op=True, check=False)
    return _then(handle, lambda flat: [_from_bytes(piece) for piece in torch.split(flat, lengths)], async_op)


REDUCE_OPS_INDEX = {name: index for index, name in enumerate(REDUCE_OPS)}
ALLREDUCE_ALGORITHMS = ("backend", "auto", *algorithms.ALGORITHMS)


def join() -> int:
    """Declare this rank out of data: take part, with zeros, in every checked allreduce the other
    ranks still run, until every rank has called ``join``. Returns the rank that joined last.

    Ranks that have not joined see the joined ones only in the metadata check, so their
    allreduces (``check=True``) need nothing else; any other checked collective raises
    :class:`CollectiveMismatchError` on every rank while a rank has joined.
    """
    if _size() == 1:
        return _rank()
    marker = torch.zeros(0)
    first = 1
    while True:
        rows = _gather_records("join", marker, first)
        first = 0
        active = [row for row in rows if row[0] != _JOIN]
        if not active:
            return max(r for r, row in enumerate(rows) if row[2] == 1)
        other = next((row[0] for row in active if row[0] != _OPERATIONS.index("allreduce")), None)
        if other is not None:
            _raise_joined(rows, _OPERATIONS[other])
        row = active[0]
        op = list(REDUCE_OPS)[row[2] % len(REDUCE_OPS)]
        algorithm = ALLREDUCE_ALGORITHMS[row[2] // len(REDUCE_OPS)]
        zeros = torch.zeros(row[4 : 4 + row[3]], dtype=_DTYPES[row[1]], device=runtime.device())
        allreduce_(zeros, op, check=False, algorithm=algorithm)


def _raise_joined(rows: list[list[int]], operation: str) -> None:
    joined = [r for r, row in enumerate(rows) if row[0] == _JOIN]
    raise CollectiveMismatchError(
        f"{operation} on rank {runtime.rank()}: rank(s) {joined} have joined (run out of data) and take part "
        f"only in allreduce until every rank has joined. Call {operation} after join() has returned on every rank."
    )


def _allreduce_into(tensor: torch.Tensor, op: str, async_op: bool, check: bool,
                    algorithm: str = "backend") -> torch.Tensor | Handle[torch.Tensor]:
    reduce_op = _reduce_op(op, tensor)
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ConfigurationError(f"algorithm must be one of {list(ALLREDUCE_ALGORITHMS)}, got {algorithm!r}.")
    if check:  # the algorithm is part of the record: ranks that disagree would exchange garbage
        _check("allreduce", tensor, REDUCE_OPS_INDEX[op] + len(REDUCE_OPS) * ALLREDUCE_ALGORITHMS.index(algorithm))
    scale = _averaging(op, tensor)
    if tensor.is_cuda and algorithm in algorithms.ALGORITHMS:
        raise ConfigurationError(f"algorithm={algorithm!r} reduces CPU tensors; for CUDA tensors NCCL chooses its "
                                 "own algorithm: use algorithm='backend' or 'auto'.")
    executor, algorithm = _route(algorithm, tensor)
    if executor is None:
        return _backend_allreduce(tensor, reduce_op, scale, async_op)
    return _through(executor, tensor, op, algorithm, scale, async_op)


def _backend_allreduce(tensor: torch.Tensor, reduce_op: Any, scale: Callable[[torch.Tensor], torch.Tensor],
                       async_op: bool) -> torch.Tensor | Handle[torch.Tensor]:
    """torch.distributed's own allreduce over the tensor's group (of the current scope)."""
    return _launch("allreduce", lambda: dist.all_reduce(tensor, reduce_op, group=_group(tensor), async_op=True),
                   lambda: scale(tensor), async_op)


def _route(algorithm: str, tensor: torch.Tensor) -> tuple[Any, str]:
    """Who runs an allreduce, and with which algorithm for the part that crosses the network.

    The backend itself (``None``) for CUDA tensors (NCCL chooses its own algorithm) and at world
    size 1. Shared memory takes ``"backend"`` and ``"auto"``, and on several hosts every
    algorithm (it then names how each slice crosses hosts). Otherwise ``"auto"`` becomes the cost
    model's choice; Gloo's own ring runs as it is (``None``), phalanx's algorithms on their executor.
    """
    if tensor.is_cuda or runtime.size() == 1:
        return None, algorithm
    shared = runtime.shm_executor()
    if shared is not None and (algorithm in ("backend", "auto") or shared.group.cross is not None):
        return shared, algorithm
    if algorithm == "auto":
        algorithm = _cheapest(tensor)
    return (None, algorithm) if algorithm == "backend" else (runtime.message_executor(), algorithm)


_links: dict[int, cost.Link] = {}  # measured once per group (key: the group object's id)


def _cheapest(tensor: torch.Tensor) -> str:
    """The algorithm the alpha-beta model predicts fastest for ``tensor``. Measures the link on
    first use: every rank is here."""
    group = _group(tensor)
    if id(group) not in _links:
        with translate_errors("allreduce (measuring the link)"):
            _links[id(group)] = cost.measure(group)
    return cost.choose_with_backend(tensor.numel() * tensor.element_size(), runtime.size(), _links[id(group)])


def link() -> cost.Link | None:
    """The measured link of the CPU group, once ``algorithm="auto"`` needed it (or :func:`measure_link`)."""
    return _links.get(id(_group(None))) if runtime.is_initialized() else None


def measure_link() -> cost.Link:
    """Measure the CPU group's alpha and beta now (collective) and keep them for ``algorithm="auto"``."""
    group = _group(None)
    with translate_errors("measuring the link"):
        _links[id(group)] = cost.measure(group)
    return _links[id(group)]


def _through(executor: OrderedExecutor[Any], tensor: torch.Tensor, op: str, algorithm: str,
             scale: Callable[[torch.Tensor], torch.Tensor], async_op: bool,
             name: str = "allreduce") -> torch.Tensor | Handle[torch.Tensor]:
    """An allreduce on one of the runtime's ordered executors (shared memory, or phalanx's
    algorithms), in the order of submission: see :mod:`phalanx.comm.ordered`."""
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)

    def finish(_: None) -> torch.Tensor:
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return scale(tensor)

    how = "shared memory" if executor is runtime.shm_executor() else algorithm
    return _on(executor, f"{name} ({how})", lambda: executor.group.allreduce_(flat, op, algorithm), finish, async_op)


def _on(executor: OrderedExecutor[Any], name: str, work: Callable[[], S], finish: Callable[[S], T],
        async_op: bool) -> T | Handle[T]:
    """``finish(work())`` with ``work`` run in ``executor``'s order: now, or as a handle."""
    if not async_op:
        with translate_errors(name):
            done = executor.run(work)
        return finish(done)
    future = executor.submit(work)
    return Handle(name, _FutureWork(future), lambda: finish(future.result()))


class _FutureWork:
    """A future as the work object a :class:`Handle` waits on."""

    def __init__(self, future: Any):
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


def _broadcast_into(tensor: torch.Tensor, root: int, async_op: bool,
                    check: bool) -> torch.Tensor | Handle[torch.Tensor]:
    _check_root(root)
    if check:
        _check("broadcast", tensor, root)
    return _launch("broadcast", lambda: dist.broadcast(tensor, _global_rank(root), group=_group(tensor),
                                                       async_op=True),
                   lambda: tensor, async_op)


def _launch(name: str, start: Callable[[], Any], finish: Callable[[], T], async_op: bool) -> T | Handle[T]:
    if _size() == 1:
        return _done(finish(), async_op)
    with translate_errors(name):
        work = start()
    handle = Handle(name, work, finish)
    return handle if async_op else handle.wait()


def _done(result: T, async_op: bool) -> T | Handle[T]:
    return Handle("completed", None, lambda: result) if async_op else result


def then(handle: Handle[S], finish: Callable[[S], T]) -> Handle[T]:
    """A handle that waits for ``handle`` and then returns ``finish`` of its result (once)."""
    return Handle(handle._name, handle, lambda: finish(handle.wait()))


def _then(handle: Handle[S], convert: Callable[[S], T], async_op: bool) -> T | Handle[T]:
    chained = then(handle, convert)
    return chained if async_op else chained.wait()


def _group(tensor: torch.Tensor | None) -> dist.ProcessGroup | None:
    scope = _scope.get()
    if scope is not None:
        return scope.device_group if tensor is not None and tensor.is_cuda else scope.cpu_group
    return runtime.group_for(tensor)


def _reduce_op(op: str, tensor: torch.Tensor) -> Any:
    if op not in REDUCE_OPS:
        raise ConfigurationError(f"op must be one of {sorted(REDUCE_OPS)}, got {op!r}.")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ConfigurationError(
            f"op='avg' needs a floating-point tensor, got {tensor.dtype}; use op='sum' and divide, or convert first."
        )
    return REDUCE_OPS[op]


def _averaging(op: str, tensor: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    size = _size()
    if op != "avg" or size == 1:
        return lambda t: t
    return lambda t: t.div_(size)


def _check_root(root: int) -> None:
    if not 0 <= root < _size():
        raise ConfigurationError(f"root must be a rank in [0, {_size()}), got {root}.")


def _alltoall_splits(tensor: torch.Tensor, splits: Sequence[int] | None, world: int) -> list[int]:
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if rows % world:
            raise ConfigurationError(
                f"alltoall without splits needs dim 0 ({rows}) divisible by the world size {world}; pass splits."
            )
        return [rows // world] * world
    splits = [int(s) for s in splits]
    if len(splits) != world or sum(splits) != rows or min(splits) < 0:
        raise ConfigurationError(
            f"alltoall splits {splits} must hold {world} non-negative counts summing to dim 0 ({rows})."
        )
    return splits


# --- cross-rank metadata check -------------------------------------------------------------


def _record(operation: str, tensor: torch.Tensor, detail: int) -> torch.Tensor:
    if tensor.dim() > _MAX_DIMS:
        raise ConfigurationError(f"collectives support tensors of up to {_MAX_DIMS} dimensions, got {tensor.dim()}.")
    dtype = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else 99
    row = [_OPERATIONS.index(operation), dtype, detail, tensor.dim(), *tensor.shape]
    return torch.tensor(row + [-1] * (_RECORD_LEN - len(row)), dtype=torch.int64)  # one torch call: hot path


def _gather_records(operation: str, tensor: torch.Tensor, detail: int = 0) -> list[list[int]]:
    record = _record(operation, tensor, detail)
    if _size() == 1:
        return [record.tolist()]
    shared = _one_host_executor()
    if shared is not None:  # through shared memory, in order with the allreduces queued there
        with translate_errors(f"{operation} (metadata check)"):
            return shared.run(lambda: shared.group.allgather_(record)).tolist()
    rows = torch.empty(_size() * _RECORD_LEN, dtype=torch.int64)
    with translate_errors(f"{operation} (metadata check)"):
        _all_gather_single(rows, record, group=_group(None))
    return rows.view(_size(), _RECORD_LEN).tolist()


def _one_host_executor() -> OrderedExecutor[shm.SharedMemoryGroup] | None:
    """The shared-memory executor when every rank of the collective is on this host, else ``None``."""
    shared = runtime.shm_executor()
    return shared if shared is not None and shared.group.cross is None and _scope.get() is None else None


def _check(operation: str, tensor: torch.Tensor, detail: int = 0, ignore_first_dim: bool = False) -> None:
    if _size() > 1:
        _compare(_gather_records(operation, tensor, detail), operation, tensor, ignore_first_dim)


def _compare(rows: list[list[int]], operation: str, tensor: torch.Tensor, ignore_first_dim: bool) -> None:
    if any(row[0] == _JOIN for row in rows):  # ranks in join() add zeros to allreduces, and nothing else
        if operation != "allreduce":
            _raise_joined(rows, operation)
        rows = [row for row in rows if row[0] != _JOIN]
    keys = [_comparable(row, ignore_first_dim) for row in rows]
    if all(key == keys[0] for key in keys):
        return
    described = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(rows))
    what = "shapes (beyond dim 0), dtypes or operations" if ignore_first_dim else "operations, shapes or dtypes"
    raise CollectiveMismatchError(
        f"{operation} on rank {runtime.rank()}: ranks called it with different {what}: {described}. "
        "Every rank must call the same collectives in the same order with matching tensors."
    )


def _comparable(row: list[int], ignore_first_dim: bool) -> tuple[int, ...]:
    return tuple(row[:4] + row[5:]) if ignore_first_dim else tuple(row)


def _describe(row: list[int]) -> str:
    operation = _OPERATIONS[row[0]]
    dtype = _DTYPES[row[1]] if row[1] < len(_DTYPES) else "unsupported dtype"
    shape = tuple(row[4 : 4 + row[3]])
    return f"{operation}({dtype}, shape={list(shape)})"


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _from_bytes(payload: torch.Tensor) -> Any:
    return pickle.loads(payload.numpy().tobytes())


_PEER_FAILURE_MARKS = ("timed out", "timeout", "connection", "closed", "reset", "broken pipe", "peer", "abort")


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, OSError) or any(mark in text for mark in _PEER_FAILURE_MARKS)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
