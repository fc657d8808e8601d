"""The collective operations over all workers, as the methods of :class:`Collectives`, typed by ``async_op``.

Every tensor operation first compares a small metadata record (operation, dtype, shape, and
whether this rank's arguments are valid) across ranks (:mod:`phalanx.comm.agreement`), so that a
mismatch raises :class:`CollectiveMismatchError`, and an invalid argument or a dtype the operation
cannot handle :class:`ConfigurationError`, on *every* rank before anything else is exchanged, instead
of one rank raising while the others hang or go on out of step. Where an allreduce or reduce goes
through this host's shared memory (:mod:`phalanx.comm.routing`), the record travels with the data's
first exchange instead of a round trip of its own, and every rank judges all records before anything
is reduced (an asynchronous call then raises from ``wait()``). ``check=False`` skips the check for hot
paths that plan their own buffers (then each rank validates alone); ``barrier``, the object
collectives (:mod:`phalanx.comm.objects`) and ``broadcast_tensors_`` compare nothing. Any dtype,
layout, and tensors that need grad are handled alike on every transport (see :mod:`phalanx.comm.wire`).
Failures of peers surface as :class:`CollectiveTimeoutError` naming the operation.
At world size 1 every operation completes at once without communication.
Each is typed by ``async_op``: the default gives the result, ``async_op=True`` a :class:`Handle` of it.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence, TypeVar, overload

import torch
import torch.distributed as dist

from phalanx.comm import algorithms, joining, objects, shm, wire
from phalanx.comm.agreement import BAD_SPLITS, Agreeing, problem_code, read, reduction_detail, refuse_scalar
from phalanx.comm.handles import Handle, Works, done
from phalanx.comm.ordered import OrderedExecutor
from phalanx.comm.routing import ALLREDUCE_ALGORITHMS, REDUCE_OPS
from phalanx.comm.scopes import when_open
from phalanx.errors import CollectiveMismatchError, ConfigurationError

T = TypeVar("T")

#: the tags of point-to-point exchanges (reduce-scatter and allgather of CPU tensors): counted round
EXCHANGE_TAG_BASE, EXCHANGE_TAGS = 1 << 20, 1 << 16

# Newer torch renamed the flat-tensor reduce-scatter; older releases (>= 2.4) have only the old name.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NO_DATA = torch.empty(0)  # the record of an operation that carries no tensor (a barrier, a join)


class Collectives(Agreeing):
    """The collective operations of one generation's :class:`~phalanx.comm.communicator.Communicator`.

    Kept apart from the communicator's state and lifecycle so that each file holds one idea; every
    method first checks that the generation is still open (a call on a closed one raises
    :class:`~phalanx.errors.GenerationClosedError`). Scopes (``within``) and what the collectives
    need of their generation are :mod:`phalanx.comm.scopes`; where they run, :mod:`phalanx.comm.routing`.
    """

    @overload
    def allreduce(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[False] = ...,
                  check: bool = ..., algorithm: str = ...) -> torch.Tensor: ...

    @overload
    def allreduce(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[True],
                  check: bool = ..., algorithm: str = ...) -> Handle[torch.Tensor]: ...

    @when_open
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

    @when_open
    def allreduce_(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                   check: bool = True, algorithm: str = "backend") -> torch.Tensor | Handle[torch.Tensor]:
        """Like :meth:`allreduce`, but in place: ``tensor`` receives the result and is returned."""
        return self._allreduce(tensor, op, async_op, check, algorithm, in_place=True)

    def _allreduce(self, tensor: torch.Tensor, op: str, async_op: bool, check: bool, algorithm: str,
                   in_place: bool) -> torch.Tensor | Handle[torch.Tensor]:
        """Agree on the call, then reduce ``tensor`` itself (``in_place``) or a copy. In a :meth:`within`
        scope it is the backend's allreduce over the scope's group, whatever ``algorithm`` says."""
        scoped = self._scoped()
        how = 0 if scoped or algorithm not in ALLREDUCE_ALGORITHMS else ALLREDUCE_ALGORITHMS.index(algorithm)
        problem = problem_code(tensor.shape, self._size(), op=op, algorithm=None if scoped else algorithm)
        detail = reduction_detail(op, how)
        folds = not tensor.is_cuda and algorithm in ("backend", "auto") and self._one_host_executor() is not None
        plan, agreement = self._agree_or_fold("allreduce", tensor, detail, problem, check, folds,
                                              lambda: wire.reduction(tensor.dtype, op, "allreduce"))
        work = _detached(tensor) if in_place else _copy(tensor)
        finish = self._finisher(plan, work, tensor if in_place else work)
        if scoped:
            shared = None if tensor.is_cuda else self._scope_shared_memory()
            if shared is not None:
                return self._inline(shared, plan.encode(work), plan.op, algorithm, finish, async_op)
            return self._backend_allreduce(plan.encode(work), plan.op, finish, async_op)
        return self._allreduce_routed(plan.encode(work), plan.op, algorithm, finish, async_op, agreement)

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

    @when_open
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

    @when_open
    def broadcast_(self, tensor: torch.Tensor, root: int = 0, *, async_op: bool = False,
                   check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
        """Overwrite ``tensor`` in place with ``root``'s tensor; return it."""
        return self._broadcast(tensor, root, async_op, check, in_place=True)

    @when_open
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

    @when_open
    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str = "sum", *, async_op: bool = False,
               check: bool = True) -> torch.Tensor | None | Handle[torch.Tensor | None]:
        """Reduce ``tensor`` over all ranks onto ``root``. Returns the result on root, ``None`` elsewhere."""
        return self._reduce(tensor, root, op, async_op, check, in_place=False)

    @when_open
    def reduce_(self, tensor: torch.Tensor, root: int = 0, op: str = "sum", *, async_op: bool = False,
                check: bool = True) -> torch.Tensor | None | Handle[torch.Tensor | None]:
        """Like :meth:`reduce`, but in place: root's ``tensor`` receives the result (and is returned);
        elsewhere ``tensor`` is left unspecified and ``None`` is returned. Saves a copy of the tensor."""
        return self._reduce(tensor, root, op, async_op, check, in_place=True)

    def _reduce(self, tensor: torch.Tensor, root: int, op: str, async_op: bool, check: bool,
                in_place: bool) -> torch.Tensor | None | Handle[torch.Tensor | None]:
        """Agree on the call, then reduce ``tensor`` itself (``in_place``) or a copy onto ``root``."""
        shared = self._one_host_executor()
        plan, agreement = self._agree_or_fold("reduce", tensor, reduction_detail(op, root),
                                              problem_code(tensor.shape, self._size(), op=op, root=root), check,
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
    def allgather(self, tensor: torch.Tensor, *, async_op: Literal[False] = ..., check: bool = ...,
                  lengths: Sequence[int] | None = ..., buffer: torch.Tensor | None = ...) -> torch.Tensor: ...

    @overload
    def allgather(self, tensor: torch.Tensor, *, async_op: Literal[True], check: bool = ...,
                  lengths: Sequence[int] | None = ..., buffer: torch.Tensor | None = ...) -> Handle[torch.Tensor]: ...

    @when_open
    def allgather(self, tensor: torch.Tensor, *, async_op: bool = False, check: bool = True,
                  lengths: Sequence[int] | None = None,
                  buffer: torch.Tensor | None = None) -> torch.Tensor | Handle[torch.Tensor]:
        """Concatenate every rank's tensor along dim 0, in rank order. First dimensions may differ.

        A 0-dim tensor counts as one row. The rows travel as bytes, so any dtype but quantized ones can.
        ``lengths``: every rank's first dimension, where the caller knows them all (a sharded
        layout); with ``check=False`` the call then skips the exchange of lengths, one round trip.
        ``buffer``: the result is this tensor's memory where it fits exactly (contiguous, ``tensor``'s
        dtype and row shape, all the rows); on the CPU the rows arrive straight into it, so a gather
        repeated into the same place allocates and copies nothing more. It must not be touched
        until the gather is done.
        """
        tensor = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
        wire.check_movable(tensor.dtype, "allgather")
        if lengths is None or check:
            problem = problem_code(tensor.shape, self._size())
            rows = self._gather_records("allgather", tensor, 0, problem)
            self._compare(rows, "allgather", ignore_first_dim=True, problems_only=not check)
            exchanged = [read(row).shape[0] for row in rows]
            if lengths is not None and list(lengths) != exchanged:
                raise CollectiveMismatchError(f"rank {self.rank}: allgather was told the ranks' lengths are {list(lengths)}, "
                                      f"but they are {exchanged}; pass the lengths every rank really has.")
            lengths = exchanged
        elif len(lengths) != self._size() or lengths[self._rank()] != tensor.shape[0]:
            raise ConfigurationError(f"rank {self.rank}: allgather was told the lengths {list(lengths)} for "
                                  f"{self._size()} ranks, but this rank's tensor has {tensor.shape[0]} rows; "
                                  "pass one length per rank, this rank's its tensor's first dimension.")
        shape = (sum(lengths), *tensor.shape[1:])
        data = wire.to_bytes(tensor, copy=False)
        fits = buffer is not None and _fits(buffer, tensor, shape[0])
        whole = wire.to_bytes(buffer, copy=False) if fits else data.new_empty((shape[0], data.shape[1]))
        if self._size() == 1:
            return done(wire.from_bytes(whole.copy_(data), tensor.dtype, shape), async_op)
        shared = self.shared_memory
        if shared is not None and not tensor.is_cuda and not self._scoped():
            return self._allgather_shared(shared, data, lengths, tensor.dtype, shape, async_op, whole)
        if not tensor.is_cuda and not self._scoped():
            return self._allgather_exchanged(data, lengths, tensor.dtype, shape, async_op, whole)
        padded = _pad_rows(data, max(lengths))
        pieces = [torch.empty_like(padded) for _ in lengths]

        def finish() -> torch.Tensor:
            return wire.from_bytes(torch.cat([piece[:n] for piece, n in zip(pieces, lengths)], out=whole),
                                   tensor.dtype, shape)
        start = lambda: dist.all_gather(pieces, padded, group=self._group(tensor), async_op=True)  # noqa: E731
        return self._launch("allgather", start, finish, async_op)

    def _allgather_exchanged(self, data: torch.Tensor, lengths: Sequence[int], dtype: torch.dtype,
                             shape: tuple[int, ...], async_op: bool,
                             whole: torch.Tensor) -> torch.Tensor | Handle[torch.Tensor]:
        """A CPU allgather of rows of bytes as one exchange: this rank's rows go to every other rank
        and theirs arrive straight into place (uneven lengths without padding). Gloo's own allgather
        leaves a link idle between its steps (10.5 MB a rank between two hosts at 1 Gbit/s: 106-125
        against 88 ms)."""
        rank = self._rank()
        places = list(whole.split(list(lengths)))

        def start() -> Works:
            if places[rank].data_ptr() != data.data_ptr():  # this rank's rows may already lie in place
                places[rank].copy_(data)
            return Works(algorithms.post_exchange([None if r == rank else data for r in range(len(places))],
                                                  [None if r == rank else place for r, place in enumerate(places)],
                                                  self._group(data), self._next_exchange_tag()))
        return self._launch("allgather", start, lambda: wire.from_bytes(whole, dtype, shape), async_op)

    def _allgather_shared(self, shared: OrderedExecutor[shm.SharedMemoryGroup], data: torch.Tensor,
                          lengths: Sequence[int], dtype: torch.dtype, shape: tuple[int, ...],
                          async_op: bool, whole: torch.Tensor) -> torch.Tensor | Handle[torch.Tensor]:
        """An allgather of rows of bytes through shared memory, without Gloo's sockets within a host;
        across hosts only each host's own rows leave it (see :meth:`SharedMemoryGroup.allgather_`)."""
        byte_lengths = [n * data.shape[1] for n in lengths]
        work = lambda: shared.group.allgather_(data.view(-1), byte_lengths, whole.view(-1))  # noqa: E731
        return self._on(shared, "allgather (shared memory)", work, lambda _: wire.from_bytes(whole, dtype, shape),
                        async_op)

    @overload
    def reduce_scatter(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[False] = ...,
                       check: bool = ...) -> torch.Tensor: ...

    @overload
    def reduce_scatter(self, tensor: torch.Tensor, op: str = ..., *, async_op: Literal[True],
                       check: bool = ...) -> Handle[torch.Tensor]: ...

    @when_open
    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
                       check: bool = True) -> torch.Tensor | Handle[torch.Tensor]:
        """Reduce ``tensor`` over ranks, then give rank ``r`` the ``r``-th of ``size()`` chunks along dim 0.

        Chunks follow ``torch.tensor_split``: when dim 0 is not divisible, the first chunks are one longer.
        """
        problem = problem_code(tensor.shape, self._size(), op=op)
        self._agree("reduce_scatter", tensor, reduction_detail(op), problem, check)
        plan = wire.reduction(tensor.dtype, op, "reduce_scatter")
        refuse_scalar(tensor, "reduce_scatter", "to split among the ranks")
        output = torch.empty_like(torch.tensor_split(tensor.detach(), self._size())[self._rank()],
                                  memory_format=torch.contiguous_format)
        data = plan.encode(tensor.detach())  # the input is only read
        chunks = torch.tensor_split(data, self._size())  # contiguous: rows of a contiguous tensor
        received = torch.empty_like(chunks[self._rank()])
        finish = self._finisher(plan, output, output)
        if self._size() == 1:
            return done(finish(received.copy_(chunks[0])), async_op)
        shared = self.shared_memory
        if shared is not None and not data.is_cuda and not self._scoped():
            flat, counts = data.contiguous().view(-1), [chunk.numel() for chunk in chunks]
            work = lambda: shared.group.reduce_scatter_(flat, counts, plan.op, received.view(-1))  # noqa: E731
            return self._on(shared, "reduce_scatter (shared memory)", work, lambda _: finish(received), async_op)
        if not data.is_cuda and not self._scoped():
            return self._reduce_scatter_exchanged(chunks, received, plan.op, finish, async_op)
        reduce_op = REDUCE_OPS[plan.op]
        if all(chunk.shape == received.shape for chunk in chunks):
            start = lambda: _reduce_scatter_single(received, data, reduce_op, group=self._group(data), async_op=True)  # noqa: E731
        else:
            start = lambda: dist.reduce_scatter(received, list(chunks), reduce_op, group=self._group(data), async_op=True)  # noqa: E731
        return self._launch("reduce_scatter", start, lambda: finish(received), async_op)

    def _reduce_scatter_exchanged(self, chunks: Sequence[torch.Tensor], received: torch.Tensor, op: str,
                                  finish: Callable[[torch.Tensor], T], async_op: bool) -> T | Handle[T]:
        """A CPU reduce-scatter as one exchange: each rank sends every other rank that rank's chunk (see
        :class:`algorithms.ReduceScatterExchange`) and reduces the chunks that arrive with its own, in rank order.
        Each rank sends ``(p - 1) / p`` of the tensor; Gloo's own reduce-scatter moves an allreduce's
        bytes, twice that (21 MB between two hosts at 1 Gbit/s: 193 against 88 ms)."""
        exchange = algorithms.ReduceScatterExchange(chunks, self._rank())
        start = lambda: Works(exchange.post(self._group(received), self._next_exchange_tag()))  # noqa: E731
        return self._launch("reduce_scatter", start, lambda: finish(exchange.reduce(op, received)), async_op)

    def _next_exchange_tag(self) -> int:
        """A tag of its own for each exchange (every rank counts the same collectives), so that two in
        flight between the same ranks never take each other's messages."""
        self.exchanges = (self.exchanges + 1) % EXCHANGE_TAGS
        return EXCHANGE_TAG_BASE + self.exchanges

    @overload
    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | None = ..., *, async_op: Literal[False] = ...,
                 check: bool = ..., buffer: torch.Tensor | None = ...) -> torch.Tensor: ...

    @overload
    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | None = ..., *, async_op: Literal[True],
                 check: bool = ..., buffer: torch.Tensor | None = ...) -> Handle[torch.Tensor]: ...

    @when_open
    def alltoall(self, tensor: torch.Tensor, splits: Sequence[int] | None = None, *, async_op: bool = False,
                 check: bool = True, buffer: torch.Tensor | None = None) -> torch.Tensor | Handle[torch.Tensor]:
        """Send ``splits[r]`` rows of ``tensor`` (in order) to rank ``r``; return what all ranks sent here.

        Without ``splits`` dim 0 is divided equally. Received pieces are concatenated in rank order.
        The rows travel as bytes, so any dtype but quantized ones can. ``buffer``: received into (the
        result is then its memory) where it fits exactly (contiguous, ``tensor``'s dtype and row
        shape, as many rows as arrive), else into a new tensor: an exchange repeated at the same
        sizes then allocates (and faults in) nothing.
        """
        world = self._size()
        counts = _alltoall_splits(tensor, splits, world)
        problem = BAD_SPLITS if counts is None else problem_code(tensor.shape, world)
        self._agree("alltoall", tensor, 0, problem, check, ignore_first_dim=True)
        wire.check_movable(tensor.dtype, "alltoall")
        refuse_scalar(tensor, "alltoall", "whose rows to send")
        if world == 1:
            if buffer is not None and _fits(buffer, tensor, tensor.shape[0]):
                return done(buffer.copy_(tensor.detach()), async_op)
            copied = wire.to_bytes(tensor.detach(), copy=True)
            return done(wire.from_bytes(copied, tensor.dtype, tensor.shape), async_op)
        data = wire.to_bytes(tensor.detach(), copy=False)
        sent = torch.tensor(counts, dtype=torch.int64)
        received = torch.empty_like(sent)
        with self.translate_errors("alltoall"):
            dist.all_to_all_single(received, sent, group=self._group(None))
        rows = int(received.sum())
        fits = buffer is not None and _fits(buffer, tensor, rows)
        output = wire.to_bytes(buffer, copy=False) if fits else data.new_empty((rows, data.shape[1]))
        shape = (rows, *tensor.shape[1:])
        return self._launch("alltoall", lambda: dist.all_to_all_single(
            output, data, received.tolist(), counts, group=self._group(data), async_op=True),
            lambda: wire.from_bytes(output, tensor.dtype, shape), async_op)

    @overload
    def barrier(self, *, async_op: Literal[False] = ...) -> None: ...

    @overload
    def barrier(self, *, async_op: Literal[True]) -> Handle[None]: ...

    @when_open
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

    @when_open
    def host_barrier(self) -> None:
        """Wait until every rank of this host has reached this point: the ranks that share its
        memory, where the CPU transport is shared memory (a few microseconds, no cross-rank check, no
        message between hosts); elsewhere, and within a scope, :meth:`barrier`. For code that hands
        memory between the workers of a host (px.Sharded's units, stepped in place)."""
        executor = self.shared_memory
        if executor is None or self._scoped() or self._size() == 1:
            self.barrier()
            return
        self._on(executor, "barrier within the host (shared memory)", executor.group.barrier, lambda _: None, False)

    @overload
    def broadcast_object(self, obj: Any = ..., root: int = ..., *, async_op: Literal[False] = ...,
                         safe: bool = ...) -> Any: ...

    @overload
    def broadcast_object(self, obj: Any = ..., root: int = ..., *, async_op: Literal[True],
                         safe: bool = ...) -> Handle[Any]: ...

    @when_open
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
        return objects.broadcast_object(lambda data: self.broadcast_(data, root, async_op=True, check=False), obj,
                                        root, self._rank(), async_op, safe)

    @overload
    def allgather_object(self, obj: Any, *, async_op: Literal[False] = ..., safe: bool = ...) -> list[Any]: ...

    @overload
    def allgather_object(self, obj: Any, *, async_op: Literal[True], safe: bool = ...) -> Handle[list[Any]]: ...

    @when_open
    def allgather_object(self, obj: Any, *, async_op: bool = False,
                         safe: bool = False) -> list[Any] | Handle[list[Any]]:
        """Return the list of every rank's object, in rank order, encoded as :meth:`broadcast_object`
        encodes (pickled and trusted by default; ``safe=True``: only what loads with ``weights_only``).
        An object some rank cannot encode raises :class:`ConfigurationError` on every rank."""
        if self._size() == 1:
            return done([obj], async_op)
        return objects.allgather_object(lambda data: self.allgather(data, async_op=True, check=False), obj, async_op,
                                        safe)

    @when_open
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
        return joining.join(lambda first: self._gather_records("join", _NO_DATA, first),
                            lambda zeros, op, algorithm: self.allreduce_(zeros, op, check=False, algorithm=algorithm),
                            self.device, self.rank)

    def _broadcast(self, tensor: torch.Tensor, root: int, async_op: bool, check: bool,
                   in_place: bool) -> torch.Tensor | Handle[torch.Tensor]:
        """Agree on the call, then send root's bytes into ``tensor`` itself (``in_place``) or a new tensor."""
        self._agree("broadcast", tensor, root, problem_code(tensor.shape, self._size(), root=root), check)
        wire.check_movable(tensor.dtype, "broadcast")
        data = wire.to_bytes(tensor.detach(), copy=not in_place)
        if in_place:
            finish = lambda: _holding(tensor, data)  # noqa: E731
        else:
            finish = lambda: wire.from_bytes(data, tensor.dtype, tensor.shape)  # noqa: E731
        start = lambda: dist.broadcast(data, self._global_rank(root), group=self._group(data), async_op=True)  # noqa: E731
        return self._launch("broadcast", start, finish, async_op)

    def _averaging(self, op: str) -> Callable[[torch.Tensor], torch.Tensor]:
        size = self._size()
        if op != "avg" or size == 1:
            return lambda t: t
        return lambda t: t.div_(size)

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self._size():
            raise ConfigurationError(f"root must be a rank in [0, {self._size()}), got {root}.")


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


def _fits(buffer: torch.Tensor, tensor: torch.Tensor, rows: int) -> bool:
    """Whether ``buffer`` can take ``rows`` rows of ``tensor``'s dtype, device and row shape as they are."""
    return (buffer.is_contiguous() and buffer.dtype == tensor.dtype and buffer.device == tensor.device
            and buffer.shape == (rows, *tensor.shape[1:]))


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded
