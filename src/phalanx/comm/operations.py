"""Collective operations over all workers, with cross-rank checks and async handles.

Every tensor operation first compares a small metadata record (operation, dtype, shape, and
whether this rank's arguments are valid) across ranks, so that a mismatch raises
:class:`CollectiveMismatchError`, and an invalid argument or a dtype the operation cannot handle
:class:`ConfigurationError`, on *every* rank before anything else is exchanged, instead of one rank
raising while the others hang or go on out of step. Where an allreduce or reduce goes through this
host's shared memory, the record travels with the data's first exchange instead of a round trip
of its own, and every rank judges all records before anything is reduced (an asynchronous call
then raises from ``wait()``). ``check=False`` skips the check for hot paths that plan their own
buffers (then each rank validates alone); ``barrier``, the object
collectives and ``broadcast_tensors_`` compare nothing. Any dtype, layout, and tensors that need
grad are handled alike on every transport (see :mod:`phalanx.comm.wire`). Failures of peers
surface as :class:`CollectiveTimeoutError` naming the operation.
At world size 1 every operation completes at once without communication.
Each is typed by ``async_op``: the default gives the result, ``async_op=True`` a :class:`Handle` of it.
"""

from __future__ import annotations

import contextlib
import functools
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Sequence, TypeVar, overload

import torch
import torch.distributed as dist

from phalanx.comm import algorithms, codec, cost, shm, wire
from phalanx.comm.handles import FutureWork, Handle, chain, done
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
_DTYPES += tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)} - set(_DTYPES), key=str))
_DTYPE_INDEX = {dtype: index for index, dtype in enumerate(_DTYPES)}  # every dtype: each has its own code
# Newer torch renamed the flat-tensor collectives; older releases (>= 2.4) have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_MAX_DIMS = 12
_OP, _DTYPE, _DETAIL, _PROBLEM, _NDIM, _SHAPE = range(6)  # a record's fields: op/root in detail, shape last
_RECORD_LEN = _SHAPE + _MAX_DIMS


@dataclass(frozen=True)
class Scope:
    """A subgroup of the workers that collectives can be restricted to (see :meth:`within`).

    ``ranks`` are global ranks in ascending order; a collective's ranks, size and roots are
    positions in it. ``cpu_group`` carries CPU tensors and ``device_group`` CUDA ones.
    """

    ranks: tuple[int, ...]
    cpu_group: dist.ProcessGroup
    device_group: dist.ProcessGroup


_scope: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("phalanx_collective_scope", default=None)


REDUCE_OPS_INDEX = {name: index for index, name in enumerate(REDUCE_OPS)}
_NO_DATA = torch.empty(0)  # the record of an operation that carries no tensor (a barrier)
ALLREDUCE_ALGORITHMS = ("backend", "auto", *algorithms.ALGORITHMS)


M = TypeVar("M", bound=Callable[..., Any])


def _when_open(method: M) -> M:
    """Check that the communicator's generation is open before running ``method``."""
    @functools.wraps(method)
    def call(self: Collectives, *args: Any, **kwargs: Any) -> Any:
        self.ensure_open(method.__name__)
        return method(self, *args, **kwargs)
    return call  # type: ignore[return-value]


class Collectives:
    """The collective operations of one generation's :class:`~phalanx.comm.communicator.Communicator`.

    Kept apart from the communicator's state and lifecycle so that each file holds one idea; every
    method first checks that the generation is still open (a call on a closed one raises
    :class:`~phalanx.errors.GenerationClosedError`).
    """

    # What the operations need of their generation, provided by the Communicator.
    rank: int
    size: int
    timeout_s: float
    device: torch.device
    shared_memory: OrderedExecutor[shm.SharedMemoryGroup] | None
    links: dict[int, cost.Link]

    def ensure_open(self, operation: str) -> None:
        raise NotImplementedError

    def group_for(self, tensor: torch.Tensor | None = None) -> dist.ProcessGroup | None:
        raise NotImplementedError

    def message_executor(self) -> OrderedExecutor[algorithms.MessageGroup]:
        raise NotImplementedError

    @contextlib.contextmanager
    def within(self, scope: Scope | None) -> Iterator[None]:
        """Restrict the collectives called inside to ``scope``'s ranks (``None``: every worker).

        Checks, error translation, averaging and async handles work as for the whole job; roots are
        positions within the scope. The allreduce goes through the backend (never shared memory,
        which spans every worker of the host). Only members of the scope may enter it.
        """
        if scope is not None and self.rank not in scope.ranks:
            raise ConfigurationError(
                f"rank {self.rank} is not a member of the group of ranks {list(scope.ranks)}: only its "
                "members may run its collectives."
            )
        token = _scope.set(scope)
        try:
            yield
        finally:
            _scope.reset(token)

    def _size(self) -> int:
        scope = _scope.get()
        return self.size if scope is None else len(scope.ranks)

    def _rank(self) -> int:
        scope = _scope.get()
        return self.rank if scope is None else scope.ranks.index(self.rank)

    def _global_rank(self, rank: int) -> int:
        """The global rank of position ``rank`` in the current scope (the torch.distributed calls' root)."""
        scope = _scope.get()
        return rank if scope is None else scope.ranks[rank]

    @contextlib.contextmanager
    def translate_errors(self, operation: str) -> Iterator[None]:
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
                    f"{operation} on rank {self.rank} of {self.size} was rejected by the backend: "
                    f"{_first_line(error)}"
                ) from error
            raise CollectiveTimeoutError(
                f"{operation} on rank {self.rank} of {self.size} failed: a peer died or did not answer "
                f"within the {self.timeout_s:.0f}s timeout ({_first_line(error)}). The first failing rank's "
                "output names the root cause."
            ) from error

    @overload
    def allreduce(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[False] = ...,
                  check: bool = ..., algorithm: str = ...) -> torch.Tensor: ...

    @overload
    def allreduce(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[True],
                  check: bool = ..., algorithm: str = ...) -> Handle[torch.Tensor]: ...

    @_when_open
    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                  check: bool = True, algorithm: str = "backend") -> torch.Tensor | Handle[torch.Tensor]:
        """Reduce ``tensor`` over all ranks with ``op``; return the result as a new tensor.

        ``algorithm`` is ``"backend"`` (torch.distributed's own: Gloo's ring, NCCL's choice, or shared
        memory when the transport is), one of phalanx's over point-to-point messages, ``"ring"``,
        ``"tree"``, ``"halving_doubling"`` (see :mod:`phalanx.comm.algorithms`; they run on a thread
        of their own, so ``async_op`` overlaps them), or ``"auto"``: shared memory where it is in use,
        else the algorithm the alpha-beta model of :mod:`phalanx.comm.cost` predicts fastest. In a
        hierarchical allreduce (shared memory on several hosts) it names how each slice crosses hosts.
        A tensor that needs grad is reduced detached (as by ``torch.distributed``): the result does not.
        """
        return self._allreduce(tensor, op, async_op, check, algorithm, in_place=False)

    @overload
    def allreduce_(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[False] = ...,
                   check: bool = ..., algorithm: str = ...) -> torch.Tensor: ...

    @overload
    def allreduce_(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[True],
                   check: bool = ..., algorithm: str = ...) -> Handle[torch.Tensor]: ...

    @_when_open
    def allreduce_(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                   check: bool = True, algorithm: str = "backend") -> torch.Tensor | Handle[torch.Tensor]:
        """Like :meth:`allreduce`, but in place: ``tensor`` receives the result and is returned."""
        return self._allreduce(tensor, op, async_op, check, algorithm, in_place=True)

    def _allreduce(self, tensor: torch.Tensor, op: str, async_op: bool, check: bool, algorithm: str,
                   in_place: bool) -> torch.Tensor | Handle[torch.Tensor]:
        """Agree on the call, then reduce ``tensor`` itself (``in_place``) or a copy. In a :meth:`within`
        scope it is the backend's allreduce over the scope's group, whatever ``algorithm`` says."""
        scoped = _scope.get() is not None
        detail = _op_code(op) + (0 if scoped else len(REDUCE_OPS) * _code(ALLREDUCE_ALGORITHMS, algorithm))
        problem = self._problem(tensor, op=op, algorithm=None if scoped else algorithm)
        folds = not tensor.is_cuda and algorithm in ("backend", "auto") and self._one_host_executor() is not None
        plan, agreement = self._agree_or_fold("allreduce", tensor, detail, problem, check, folds,
                                              lambda: wire.reduction(tensor.dtype, op, "allreduce"))
        work = _detached(tensor) if in_place else _copy(tensor)
        finish = self._finisher(plan, work, tensor if in_place else work)
        if scoped:
            return self._backend_allreduce(plan.encode(work), plan.op, finish, async_op)
        return self._allreduce_routed(plan.encode(work), plan.op, algorithm, finish, async_op, agreement)

    def _allreduce_routed(self, data: torch.Tensor, op: str, algorithm: str, finish: Callable[[torch.Tensor], T],
                          async_op: bool, agreement: shm.Agreement | None = None) -> T | Handle[T]:
        """The allreduce of ``data`` through whatever :meth:`_route` chooses for ``algorithm``, then ``finish``
        (``agreement``: the metadata check folded into shared memory's exchange, which the route then is)."""
        if data.is_cuda and algorithm in algorithms.ALGORITHMS:
            raise ConfigurationError(f"algorithm={algorithm!r} reduces CPU tensors; for CUDA tensors NCCL chooses its "
                                     "own algorithm: use algorithm='backend' or 'auto'.")
        executor, algorithm = self._route(algorithm, data)
        if executor is None:
            return self._backend_allreduce(data, op, finish, async_op)
        return self._through(executor, data, op, algorithm, finish, async_op, agreement=agreement)

    def _finisher(self, plan: wire.Reduction, work: torch.Tensor, result: T) -> Callable[[torch.Tensor], T]:
        """What turns the reduced tensor that travelled into the caller's ``result``: averaged for
        "avg", and written back into ``work`` where it was a converted copy."""
        scale = self._averaging(plan.op)

        def finish(reduced: torch.Tensor) -> T:
            plan.decode(scale(reduced), work)
            return result
        return finish

    @overload
    def broadcast(self, tensor: torch.Tensor, root: int = ..., *, async_op: Literal[False] = ...,
                  check: bool = ...) -> torch.Tensor: ...

    @overload
    def broadcast(self, tensor: torch.Tensor, root: int = ..., *, async_op: Literal[True],
                  check: bool = ...) -> Handle[torch.Tensor]: ...

    @_when_open
    def broadcast(self, tensor: torch.Tensor, root: int = 0, *, async_op: bool = False,
                  check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
        """Return a copy of ``root``'s tensor on every rank (contiguous, not needing grad)."""
        return self._broadcast(tensor, root, async_op, check, in_place=False)

    @overload
    def broadcast_(self, tensor: torch.Tensor, root: int = ..., *, async_op: Literal[False] = ...,
                   check: bool = ...) -> torch.Tensor: ...

    @overload
    def broadcast_(self, tensor: torch.Tensor, root: int = ..., *, async_op: Literal[True],
                   check: bool = ...) -> Handle[torch.Tensor]: ...

    @_when_open
    def broadcast_(self, tensor: torch.Tensor, root: int = 0, *, async_op: bool = False,
                   check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
        """Overwrite ``tensor`` in place with ``root``'s tensor; return it."""
        return self._broadcast(tensor, root, async_op, check, in_place=True)

    @_when_open
    def broadcast_tensors_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        """Overwrite every tensor in place with ``root``'s: one broadcast per (dtype, device), not per tensor.

        Each group is concatenated into one flat buffer, sent, and copied back, which for many small
        tensors (a model's parameters, a state dict) costs a few round trips instead of hundreds. Every
        rank must pass tensors of the same shapes and dtypes in the same order: the buffers are not
        checked across ranks. Tensors with no elements are skipped; ``root``'s own tensors are left as
        they are.
        """
        self._check_root(root)
        if self._size() == 1:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for tensor in tensors:
            if tensor.numel():
                groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        is_root = self._rank() == root
        with torch.no_grad():
            for (dtype, device), group in groups.items():
                if is_root:
                    self.broadcast_(torch.cat([t.detach().reshape(-1) for t in group]), root, check=False)
                    continue
                sizes = [t.numel() for t in group]
                flat = self.broadcast_(torch.empty(sum(sizes), dtype=dtype, device=device), root, check=False)
                for tensor, piece in zip(group, flat.split(sizes)):
                    tensor.copy_(piece.view(tensor.shape))

    @overload
    def reduce(self, tensor: torch.Tensor, root: int = ..., op: str = ..., *, async_op: Literal[False] = ...,
               check: bool = ...) -> torch.Tensor | None: ...

    @overload
    def reduce(self, tensor: torch.Tensor, root: int = ..., op: str = ..., *, async_op: Literal[True],
               check: bool = ...) -> Handle[torch.Tensor | None]: ...

    @_when_open
    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str = "sum", *, async_op: bool = False,
               check: bool = True) -> torch.Tensor | None | Handle[torch.Tensor | None]:
        """Reduce ``tensor`` over all ranks onto ``root``. Returns the result on root, ``None`` elsewhere."""
        return self._reduce(tensor, root, op, async_op, check, in_place=False)

    @_when_open
    def reduce_(self, tensor: torch.Tensor, root: int = 0, op: str = "sum", *, async_op: bool = False,
                check: bool = True) -> torch.Tensor | None | Handle[torch.Tensor | None]:
        """Like :meth:`reduce`, but in place: root's ``tensor`` receives the result (and is returned);
        elsewhere ``tensor`` is left unspecified and ``None`` is returned. Saves a copy of the tensor."""
        return self._reduce(tensor, root, op, async_op, check, in_place=True)

    def _reduce(self, tensor: torch.Tensor, root: int, op: str, async_op: bool, check: bool,
                in_place: bool) -> torch.Tensor | None | Handle[torch.Tensor | None]:
        """Agree on the call, then reduce ``tensor`` itself (``in_place``) or a copy onto ``root``."""
        shared = self._one_host_executor()
        plan, agreement = self._agree_or_fold("reduce", tensor, root * len(REDUCE_OPS) + _op_code(op),
                                              self._problem(tensor, op=op, root=root), check,
                                              shared is not None and not tensor.is_cuda,
                                              lambda: wire.reduction(tensor.dtype, op, "reduce"))
        work = _detached(tensor) if in_place else _copy(tensor)
        finish = self._finisher(plan, work, (tensor if in_place else work) if self._rank() == root else None)
        data = plan.encode(work)
        if shared is not None and not data.is_cuda:  # every rank gets the sum: as cheap as the reduction
            return self._through(shared, data, plan.op, "backend", finish, async_op, name="reduce", agreement=agreement)
        start = lambda: dist.reduce(data, self._global_rank(root), REDUCE_OPS[plan.op],  # noqa: E731
                                    group=self._group(data), async_op=True)
        return self._launch("reduce", start, lambda: finish(data), async_op)

    @overload
    def allgather(self, tensor: torch.Tensor, *, async_op: Literal[False] = ..., check: bool = ...) -> torch.Tensor: ...

    @overload
    def allgather(self, tensor: torch.Tensor, *, async_op: Literal[True], check: bool = ...) -> Handle[torch.Tensor]: ...

    @_when_open
    def allgather(self, tensor: torch.Tensor, *, async_op: bool = False,
                  check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
        """Concatenate every rank's tensor along dim 0, in rank order. First dimensions may differ.

        A 0-dim tensor counts as one row. The rows travel as bytes, so any dtype but quantized ones can.
        """
        tensor = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
        rows = self._gather_records("allgather", tensor, 0, self._problem(tensor))  # always: the lengths are needed
        self._compare(rows, "allgather", ignore_first_dim=True, problems_only=not check)
        wire.check_movable(tensor.dtype, "allgather")
        lengths = [row[_SHAPE] for row in rows]
        shape = (sum(lengths), *tensor.shape[1:])
        data = wire.to_bytes(tensor, copy=self._size() == 1)
        if self._size() == 1:
            return done(wire.from_bytes(data, tensor.dtype, shape), async_op)
        padded = _pad_rows(data, max(lengths))
        pieces = [torch.empty_like(padded) for _ in lengths]
        finish = lambda: wire.from_bytes(torch.cat([p[:n] for p, n in zip(pieces, lengths)]), tensor.dtype, shape)  # noqa: E731
        start = lambda: dist.all_gather(pieces, padded, group=self._group(tensor), async_op=True)  # noqa: E731
        return self._launch("allgather", start, finish, async_op)

    @overload
    def reduce_scatter(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[False] = ...,
                       check: bool = ...) -> torch.Tensor: ...

    @overload
    def reduce_scatter(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[True],
                       check: bool = ...) -> Handle[torch.Tensor]: ...

    @_when_open
    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                       check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
        """Reduce ``tensor`` over ranks, then give rank ``r`` the ``r``-th of ``size()`` chunks along dim 0.

        Chunks follow ``torch.tensor_split``: when dim 0 is not divisible, the first chunks are one longer.
        """
        self._agree("reduce_scatter", tensor, _op_code(op), self._problem(tensor, op=op), check)
        plan = wire.reduction(tensor.dtype, op, "reduce_scatter")
        _refuse_scalar(tensor, "reduce_scatter", "to split among the ranks")
        output = torch.empty_like(torch.tensor_split(tensor.detach(), self._size())[self._rank()],
                                  memory_format=torch.contiguous_format)
        data = plan.encode(tensor.detach())  # the input is only read
        chunks = torch.tensor_split(data, self._size())  # contiguous: rows of a contiguous tensor
        received = torch.empty_like(chunks[self._rank()])
        finish = self._finisher(plan, output, output)
        if self._size() == 1:
            return done(finish(received.copy_(chunks[0])), async_op)
        reduce_op = REDUCE_OPS[plan.op]
        if all(chunk.shape == received.shape for chunk in chunks):
            start = lambda: _reduce_scatter_single(received, data, reduce_op, group=self._group(data), async_op=True)  # noqa: E731
        else:
            start = lambda: dist.reduce_scatter(received, list(chunks), reduce_op, group=self._group(data), async_op=True)  # noqa: E731
        return self._launch("reduce_scatter", start, lambda: finish(received), async_op)

    @overload
    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | None = ..., *, async_op: Literal[False] = ...,
                 check: bool = ...) -> torch.Tensor: ...

    @overload
    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | None = ..., *, async_op: Literal[True],
                 check: bool = ...) -> Handle[torch.Tensor]: ...

    @_when_open
    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | None = None, *, async_op: bool = False,
                 check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
        """Send ``splits[r]`` rows of ``tensor`` (in order) to rank ``r``; return what all ranks sent here.

        Without ``splits`` dim 0 is divided equally. Received pieces are concatenated in rank order.
        The rows travel as bytes, so any dtype but quantized ones can.
        """
        world = self._size()
        counts = _alltoall_splits(tensor, splits, world)
        self._agree("alltoall", tensor, 0, _BAD_SPLITS if counts is None else self._problem(tensor), check, ignore_first_dim=True)
        wire.check_movable(tensor.dtype, "alltoall")
        _refuse_scalar(tensor, "alltoall", "whose rows to send")
        data = wire.to_bytes(tensor.detach(), copy=world == 1)
        if world == 1:
            return done(wire.from_bytes(data, tensor.dtype, tensor.shape), async_op)
        sent = torch.tensor(counts, dtype=torch.int64)
        received = torch.empty_like(sent)
        with self.translate_errors("alltoall"):
            dist.all_to_all_single(received, sent, group=self._group(None))
        output = data.new_empty((int(received.sum()), data.shape[1]))
        shape = (output.shape[0], *tensor.shape[1:])
        return self._launch("alltoall", lambda: dist.all_to_all_single(
            output, data, received.tolist(), counts, group=self._group(data), async_op=True),
            lambda: wire.from_bytes(output, tensor.dtype, shape), async_op)

    @overload
    def barrier(self, *, async_op: Literal[False] = ...) -> None: ...

    @overload
    def barrier(self, *, async_op: Literal[True]) -> Handle[None]: ...

    @_when_open
    def barrier(self, *, async_op: bool = False) -> None | Handle[None]:
        """Wait until every rank has reached this point.

        The barrier is the cross-rank check every collective starts with: each rank's record of
        "barrier" meets the others', so a rank that reached another collective instead makes every
        rank raise :class:`CollectiveMismatchError` (both still in step), where a bare barrier would
        have let one side pass and the other fail alone.
        """
        if self._size() == 1:
            return done(None, async_op)
        self._agree("barrier", _NO_DATA, 0, 0, check=True)
        return done(None, async_op)

    @overload
    def broadcast_object(self, obj: Any = ..., root: int = ..., *, async_op: Literal[False] = ...,
                         safe: bool = ...) -> Any: ...

    @overload
    def broadcast_object(self, obj: Any = ..., root: int = ..., *, async_op: Literal[True],
                         safe: bool = ...) -> Handle[Any]: ...

    @_when_open
    def broadcast_object(self, obj: Any = None, root: int = 0, *, async_op: bool = False, safe: bool = False) -> Any:
        """Return ``root``'s object on every rank, through :mod:`phalanx.comm.codec`.

        By default the object is pickled, so it can run code when it arrives: this trusts every peer
        of the group, which under ``phalanx run`` are processes that proved they hold the job's
        secret (docs/security.md). ``safe=True`` sends only what ``torch.load(weights_only=True)``
        reads (tensors, numbers, strings, containers of them). An object the root cannot send that
        way raises :class:`ConfigurationError` on every rank, naming why.
        """
        self._check_root(root)
        if self._size() == 1:
            return done(obj, async_op)
        payload, problem = codec.encoded(obj, safe) if self._rank() == root else (torch.empty(0, dtype=torch.uint8), None)
        length = self.broadcast_(torch.tensor([-1 if problem else payload.numel()], dtype=torch.int64), root, check=False)
        if int(length) < 0:  # the same message on every rank; the root's says why in its cause
            raise ConfigurationError(f"broadcast_object: the root, rank {root}, could not encode its object"
                                     f"{_SAFE_HINT if safe else ''}. Every rank raises this error.") \
                from (ValueError(problem) if problem else None)
        if self._rank() != root:
            payload = torch.empty(int(length), dtype=torch.uint8)
        handle = self.broadcast_(payload, root, async_op=True, check=False)
        return chain(handle, lambda data: codec.decode(data, safe), async_op)

    @overload
    def allgather_object(self, obj: Any, *, async_op: Literal[False] = ..., safe: bool = ...) -> list[Any]: ...

    @overload
    def allgather_object(self, obj: Any, *, async_op: Literal[True], safe: bool = ...) -> Handle[list[Any]]: ...

    @_when_open
    def allgather_object(self, obj: Any, *, async_op: bool = False,
                         safe: bool = False) -> list[Any] | Handle[list[Any]]:
        """Return the list of every rank's object, in rank order, encoded as :meth:`broadcast_object`
        encodes (pickled and trusted by default; ``safe=True``: only what loads with ``weights_only``).
        An object some rank cannot encode raises :class:`ConfigurationError` on every rank."""
        if self._size() == 1:
            return done([obj], async_op)
        payload, problem = codec.encoded(obj, safe)
        lengths = self.allgather(torch.tensor([-1 if problem else payload.numel()], dtype=torch.int64), check=False).tolist()
        failed = [rank for rank, length in enumerate(lengths) if length < 0]
        if failed:  # the same message on every rank; a failed rank's says why in its cause
            raise ConfigurationError(f"allgather_object: rank(s) {failed} could not encode their object"
                                     f"{_SAFE_HINT if safe else ''}. Every rank raises this error.") \
                from (ValueError(problem) if problem else None)
        handle = self.allgather(payload, async_op=True, check=False)
        return chain(handle, lambda flat: [codec.decode(piece, safe) for piece in torch.split(flat, lengths)], async_op)

    @_when_open
    def join(self) -> int:
        """Declare this rank out of data: take part, with zeros, in every checked allreduce the other
        ranks still run, until every rank has called ``join``. Returns the rank that joined last.

        Ranks that have not joined see the joined ones only in the metadata check, so their
        allreduces (``check=True``) need nothing else. Any other checked collective raises
        :class:`CollectiveMismatchError` on the ranks that called it, as do allreduces they called
        with different arguments; the joined ranks go on waiting (as in Horovod).
        """
        if self._size() == 1:
            return self._rank()
        marker = torch.zeros(0)
        first = 1
        while True:
            rows = self._gather_records("join", marker, first)
            first = 0
            active = [row for row in rows if row[_OP] != _JOIN]
            if not active:
                return max(r for r, row in enumerate(rows) if row[_DETAIL] == 1)
            if any(row[_OP] != _OPERATIONS.index("allreduce") for row in active):
                continue  # the ranks that called it raise; nothing travels
            try:
                self._compare(rows, "allreduce", ignore_first_dim=False)
            except PhalanxError:
                continue  # the ranks still running raise this, before any data
            row = active[0]
            op = list(REDUCE_OPS)[row[_DETAIL] % len(REDUCE_OPS)]
            algorithm = ALLREDUCE_ALGORITHMS[row[_DETAIL] // len(REDUCE_OPS)]
            zeros = torch.zeros(_shape(row), dtype=_DTYPES[row[_DTYPE]], device=self.device)
            self.allreduce_(zeros, op, check=False, algorithm=algorithm)

    def _raise_joined(self, rows: list[list[int]], operation: str) -> None:
        joined = [r for r, row in enumerate(rows) if row[_OP] == _JOIN]
        raise CollectiveMismatchError(
            f"{operation} on rank {self.rank}: rank(s) {joined} have joined (run out of data) and take part "
            f"only in allreduce until every rank has joined. Call {operation} after join() has returned on every rank."
        )

    def _backend_allreduce(self, data: torch.Tensor, op: str, finish: Callable[[torch.Tensor], T],
                           async_op: bool) -> T | Handle[T]:
        """torch.distributed's own allreduce of ``data`` over its group (of the current scope), then ``finish``."""
        start = lambda: dist.all_reduce(data, REDUCE_OPS[op], group=self._group(data), async_op=True)  # noqa: E731
        return self._launch("allreduce", start, lambda: finish(data), async_op)

    def _route(self, algorithm: str, tensor: torch.Tensor) -> tuple[Any, str]:
        """Who runs an allreduce, and with which algorithm for the part that crosses the network.

        The backend itself (``None``) for CUDA tensors (NCCL chooses its own algorithm) and at world
        size 1. Shared memory takes ``"backend"`` and ``"auto"``, and on several hosts every
        algorithm (it then names how each slice crosses hosts). Otherwise ``"auto"`` becomes the cost
        model's choice; Gloo's own ring runs as it is (``None``), phalanx's algorithms on their executor.
        """
        if tensor.is_cuda or self.size == 1:
            return None, algorithm
        shared = self.shared_memory
        if shared is not None and (algorithm in ("backend", "auto") or shared.group.cross is not None):
            return shared, algorithm
        if algorithm == "auto":
            algorithm = self.cheapest_algorithm(tensor)
        return (None, algorithm) if algorithm == "backend" else (self.message_executor(), algorithm)

    def cheapest_algorithm(self, tensor: torch.Tensor) -> str:
        """The algorithm the alpha-beta model predicts fastest for ``tensor``. Measures the link on
        first use: every rank is here."""
        links = self.links  # the current generation's: a re-formed group measures its own
        group = self._group(tensor)
        if id(group) not in links:
            with self.translate_errors("allreduce (measuring the link)"):
                links[id(group)] = cost.measure(group)
        return cost.choose_with_backend(tensor.numel() * tensor.element_size(), self.size, links[id(group)])

    @_when_open
    def link(self) -> cost.Link | None:
        """The measured link of the CPU group, once ``algorithm="auto"`` needed it (or :meth:`measure_link`)."""
        return self.links.get(id(self._group(None)))

    @_when_open
    def measure_link(self) -> cost.Link:
        """Measure the CPU group's alpha and beta now (collective) and keep them for ``algorithm="auto"``."""
        group = self._group(None)
        with self.translate_errors("measuring the link"):
            self.links[id(group)] = cost.measure(group)
        return self.links[id(group)]

    def _through(self, executor: OrderedExecutor[Any], data: torch.Tensor, op: str, algorithm: str,
                 finish: Callable[[torch.Tensor], T], async_op: bool, name: str = "allreduce",
                 agreement: shm.Agreement | None = None) -> T | Handle[T]:
        """An allreduce of the contiguous ``data`` on one of the runtime's ordered executors (shared
        memory, or phalanx's algorithms), in the order of submission (see :mod:`phalanx.comm.ordered`),
        then ``finish``. ``agreement`` (shared memory only): the metadata check, folded into the exchange."""
        how = "shared memory" if executor is self.shared_memory else algorithm
        flat = data.view(-1)
        if agreement is None:
            work = lambda: executor.group.allreduce_(flat, op, algorithm)  # noqa: E731
        else:
            work = lambda: executor.group.allreduce_(flat, op, algorithm, agreement)  # noqa: E731
        return self._on(executor, f"{name} ({how})", work, lambda _: finish(data), async_op)

    def _on(self, executor: OrderedExecutor[Any], name: str, work: Callable[[], S], finish: Callable[[S], T],
            async_op: bool) -> T | Handle[T]:
        """``finish(work())`` with ``work`` run in ``executor``'s order: now, or as a handle."""
        if not async_op:
            with self.translate_errors(name):
                done = executor.run(work)
            return finish(done)
        future = executor.submit(work)
        return Handle(name, FutureWork(future), lambda: finish(future.result()), self.translate_errors)

    def _broadcast(self, tensor: torch.Tensor, root: int, async_op: bool, check: bool,
                   in_place: bool) -> torch.Tensor | Handle[torch.Tensor]:
        """Agree on the call, then send root's bytes into ``tensor`` itself (``in_place``) or a new tensor."""
        self._agree("broadcast", tensor, root, self._problem(tensor, root=root), check)
        wire.check_movable(tensor.dtype, "broadcast")
        data = wire.to_bytes(tensor.detach(), copy=not in_place)
        if in_place:
            finish = lambda: _holding(tensor, data)  # noqa: E731
        else:
            finish = lambda: wire.from_bytes(data, tensor.dtype, tensor.shape)  # noqa: E731
        start = lambda: dist.broadcast(data, self._global_rank(root), group=self._group(data), async_op=True)  # noqa: E731
        return self._launch("broadcast", start, finish, async_op)

    def _launch(self, name: str, start: Callable[[], Any], finish: Callable[[], T], async_op: bool) -> T | Handle[T]:
        if self._size() == 1:
            return done(finish(), async_op)
        with self.translate_errors(name):
            work = start()
        handle = Handle(name, work, finish, self.translate_errors)
        return handle if async_op else handle.wait()

    def _group(self, tensor: torch.Tensor | None) -> dist.ProcessGroup | None:
        scope = _scope.get()
        if scope is not None:
            return scope.device_group if tensor is not None and tensor.is_cuda else scope.cpu_group
        return self.group_for(tensor)

    def _averaging(self, op: str) -> Callable[[torch.Tensor], torch.Tensor]:
        size = self._size()
        if op != "avg" or size == 1:
            return lambda t: t
        return lambda t: t.div_(size)

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self._size():
            raise ConfigurationError(f"root must be a rank in [0, {self._size()}), got {root}.")

    def _problem(self, tensor: torch.Tensor, op: str | None = None, algorithm: str | None = None,
                 root: int | None = None) -> int:
        """The code of what is wrong with this rank's arguments (0: nothing), for its record."""
        if op is not None and op not in REDUCE_OPS:
            return _BAD_OP
        if algorithm is not None and algorithm not in ALLREDUCE_ALGORITHMS:
            return _BAD_ALGORITHM
        if root is not None and not 0 <= root < self._size():
            return _BAD_ROOT
        return _TOO_MANY_DIMS if tensor.dim() > _MAX_DIMS else 0

    def _agree(self, operation: str, tensor: torch.Tensor, detail: int, problem: int, check: bool,
               ignore_first_dim: bool = False) -> None:
        """Raise alike on every rank where any rank's arguments are wrong or the ranks' metadata differ.

        Without ``check`` (or alone) nothing is exchanged and only this rank's arguments are judged.
        """
        if check and self._size() > 1:
            self._compare(self._gather_records(operation, tensor, detail, problem), operation, ignore_first_dim)
        elif problem:
            raise self._problem_error(operation, problem, [self._rank()])

    def _agree_or_fold(self, operation: str, tensor: torch.Tensor, detail: int, problem: int, check: bool, folds: bool,
                       plan: Callable[[], wire.Reduction]) -> tuple[wire.Reduction, shm.Agreement | None]:
        """Agree on the call (:meth:`_agree`) and make its reduction ``plan``; or, where the reduction
        ``folds`` (it goes through this host's shared memory), return the check to travel with the
        data's first arrival instead of a round trip of its own. A rank whose arguments are wrong, or
        whose dtype cannot be reduced, checks alone first (one arrival too) and so raises what every
        rank raises: the others judge its record in their first arrival."""
        if not (folds and check and problem == 0 and self._size() > 1):
            self._agree(operation, tensor, detail, problem, check)
            return plan(), None
        try:
            made = plan()
        except PhalanxError:
            self._agree(operation, tensor, detail, problem, check)
            raise
        return made, (_record_row(operation, tensor, detail, problem), lambda rows: self._judge(rows, operation))

    def _judge(self, rows: list[list[int]], operation: str) -> bool:
        """A folded check's verdict on every rank's record: raise as :meth:`_agree` does; False where a
        rank has joined (it sent its record alone: the data must go again, with its zeros)."""
        self._compare(rows, operation, ignore_first_dim=False)
        return all(row[_OP] != _JOIN for row in rows)

    def _gather_records(self, operation: str, tensor: torch.Tensor, detail: int = 0, problem: int = 0) -> list[list[int]]:
        row = _record_row(operation, tensor, detail, problem)
        if self._size() == 1:
            return [row]
        shared = self._one_host_executor()
        if shared is not None:  # through shared memory, in order with the allreduces queued there
            with self.translate_errors(f"{operation} (metadata check)"):
                return shared.run(lambda: shared.group.gather_records(row))
        rows = torch.empty(self._size() * _RECORD_LEN, dtype=torch.int64)
        with self.translate_errors(f"{operation} (metadata check)"):
            _all_gather_single(rows, torch.tensor(row, dtype=torch.int64), group=self._group(None))
        return rows.view(self._size(), _RECORD_LEN).tolist()

    def _one_host_executor(self) -> OrderedExecutor[shm.SharedMemoryGroup] | None:
        """The shared-memory executor when every rank of the collective is on this host, else ``None``."""
        shared = self.shared_memory
        return shared if shared is not None and shared.group.cross is None and _scope.get() is None else None

    def _compare(self, rows: list[list[int]], operation: str, ignore_first_dim: bool, problems_only: bool = False) -> None:
        """Raise, alike on every rank, for the first rank's invalid arguments, else (unless
        ``problems_only``) for metadata that differ between ranks."""
        if any(row[_OP] == _JOIN for row in rows):  # ranks in self.join() add zeros to allreduces, and nothing else
            if operation != "allreduce":
                self._raise_joined(rows, operation)
        ranked = [(rank, row) for rank, row in enumerate(rows) if row[_OP] != _JOIN]
        problems = [(row[_PROBLEM], rank) for rank, row in ranked if row[_PROBLEM]]
        if problems:
            code = problems[0][0]
            raise self._problem_error(operation, code, [rank for problem, rank in problems if problem == code])
        keys = [_comparable(row, ignore_first_dim) for _, row in ranked]
        if problems_only or all(key == keys[0] for key in keys):
            return
        described = "; ".join(f"rank {rank}: {_describe(row)}" for rank, row in ranked)
        what = "shapes (beyond dim 0), dtypes or operations" if ignore_first_dim else "operations, shapes or dtypes"
        raise CollectiveMismatchError(
            f"{operation} on rank {self.rank}: ranks called it with different {what}: {described}. "
            "Every rank must call the same collectives in the same order with matching tensors."
        )

    def _problem_error(self, operation: str, code: int, ranks: list[int]) -> ConfigurationError:
        rule = _PROBLEMS[code].format(ops=sorted(REDUCE_OPS), algorithms=list(ALLREDUCE_ALGORITHMS), size=self._size(),
                                      dims=_MAX_DIMS)
        return ConfigurationError(f"{operation} on rank(s) {ranks} of {self._size()}: {rule}.")


# --- cross-rank metadata check -------------------------------------------------------------


#: What a rank's arguments can be wrong in, as a code in its record: every rank reads the same words.
_PROBLEMS = ("", "op must be one of {ops}", "algorithm must be one of {algorithms}", "root must be a rank in [0, {size})",
             "collectives take tensors of up to {dims} dimensions",
             "splits must hold {size} non-negative counts summing to dim 0 (without splits, dim 0 must be "
             "divisible by {size})")
_BAD_OP, _BAD_ALGORITHM, _BAD_ROOT, _TOO_MANY_DIMS, _BAD_SPLITS = range(1, len(_PROBLEMS))


_SAFE_HINT = f" (safe=True sends only {codec.SAFE_CONTENTS})"
_PEER_FAILURE_MARKS = ("timed out", "timeout", "connection", "closed", "reset", "broken pipe", "peer", "abort")


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory, writable in place even where it needs grad (as ``torch.distributed`` does)."""
    return tensor.detach() if tensor.requires_grad else tensor


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` that does not need grad: what the copying collectives work on."""
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _holding(tensor: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``tensor``, its memory holding the bytes ``data`` received for it."""
    wire.write_bytes(data, tensor.detach())
    return tensor


def _alltoall_splits(tensor: torch.Tensor, splits: Sequence[int] | None, world: int) -> list[int] | None:
    """The rows this rank sends to each rank, or ``None`` where ``splits`` cannot be (every rank raises)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        return None if rows % world else [rows // world] * world
    counts = [int(s) for s in splits]
    return counts if len(counts) == world and sum(counts) == rows and min(counts) >= 0 else None


def _refuse_scalar(tensor: torch.Tensor, operation: str, what: str) -> None:
    """Refuse a 0-dim tensor where dim 0 is split: it has no rows (the ranks agreed on its shape)."""
    if tensor.dim() == 0:
        raise ConfigurationError(f"{operation} needs a tensor with a dimension {what}, got a 0-dim one. Every rank "
                                 "raises this error; pass t.reshape(1).")


def _op_code(op: str) -> int:
    return REDUCE_OPS_INDEX.get(op, 0)  # an unknown op is reported by its problem code


def _code(names: Sequence[str], name: str) -> int:
    return names.index(name) if name in names else 0


def _record_row(operation: str, tensor: torch.Tensor, detail: int, problem: int) -> list[int]:
    shape = list(tensor.shape) if tensor.dim() <= _MAX_DIMS else []
    row = [_OPERATIONS.index(operation), _DTYPE_INDEX[tensor.dtype], detail, problem, tensor.dim(), *shape]
    return row + [-1] * (_RECORD_LEN - len(row))


def _comparable(row: list[int], ignore_first_dim: bool) -> tuple[int, ...]:
    return tuple(row[:_SHAPE] + row[_SHAPE + 1:]) if ignore_first_dim else tuple(row)


def _shape(row: list[int]) -> list[int]:
    return row[_SHAPE : _SHAPE + row[_NDIM]]


def _describe(row: list[int]) -> str:
    return f"{_OPERATIONS[row[_OP]]}({_DTYPES[row[_DTYPE]]}, shape={_shape(row)})"


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, OSError) or any(mark in text for mark in _PEER_FAILURE_MARKS)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
