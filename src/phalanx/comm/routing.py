"""Where a collective runs: the backend's own call, or one of the generation's ordered executors.

The backend (torch.distributed: Gloo or NCCL) runs most collectives. A CPU allreduce goes through
this host's shared memory where the transport is (across hosts too, hierarchically), and so does a
CPU reduce whose ranks are all on this host; an allreduce may also run phalanx's algorithms over
point-to-point messages (:mod:`phalanx.comm.algorithms`) on a thread of their own, and
``algorithm="auto"`` lets the alpha-beta model of :mod:`phalanx.comm.cost` choose, with the link
measured once per generation and group. Inside a scope that has shared memory of its own (see
:class:`~phalanx.comm.scopes.Scope`), a CPU allreduce goes through that group on the calling thread.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from phalanx.comm import algorithms, cost, shm
from phalanx.comm.handles import FutureWork, Handle, done
from phalanx.comm.ordered import OrderedExecutor
from phalanx.comm.scopes import Scoped, when_open
from phalanx.errors import ConfigurationError

S = TypeVar("S")
T = TypeVar("T")

#: The reductions, by name, and the backend's operation each runs as.
REDUCE_OPS = algorithms.BACKEND_OPS
#: What an allreduce's ``algorithm`` can be.
ALLREDUCE_ALGORITHMS = ("backend", "auto", *algorithms.ALGORITHMS)


class Routing(Scoped):
    """How the collectives of a generation reach the backend or an executor, and which an allreduce takes."""

    def _launch(self, name: str, start: Callable[[], Any], finish: Callable[[], T], async_op: bool) -> T | Handle[T]:
        """``finish()`` once the backend's work that ``start`` begins is done: now, or as a handle."""
        if self._size() == 1:
            return done(finish(), async_op)
        with self.translate_errors(name):
            work = start()
        handle = Handle(name, self.waits.wrap(work), finish, self.translate_errors)
        return handle if async_op else handle.wait()

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

    def _one_host_executor(self) -> OrderedExecutor[shm.SharedMemoryGroup] | None:
        """The shared-memory executor when every rank of the collective is on this host, else ``None``."""
        shared = self.shared_memory
        return shared if shared is not None and shared.group.cross is None and not self._scoped() else None

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

    def _inline(self, group: shm.SharedMemoryGroup, data: torch.Tensor, op: str, algorithm: str,
                finish: Callable[[torch.Tensor], T], async_op: bool) -> T | Handle[T]:
        """An allreduce of the contiguous ``data`` through a scope's own shared-memory ``group``, on this
        thread (the scope's owner orders its calls: see :class:`~phalanx.comm.scopes.Scope`), then
        ``finish``; an asynchronous call's handle is complete at once."""
        crossing = algorithm if algorithm in ALLREDUCE_ALGORITHMS else "backend"
        with self.translate_errors("allreduce (shared memory)"):
            group.allreduce_(data.view(-1), op, crossing)
        return done(finish(data), async_op)

    def _on(self, executor: OrderedExecutor[Any], name: str, work: Callable[[], S], finish: Callable[[S], T],
            async_op: bool) -> T | Handle[T]:
        """``finish(work())`` with ``work`` run in ``executor``'s order: now, or as a handle. Where the
        generation's waits are abortable and the call waits on Gloo, a synchronous call waits as an
        asynchronous one does (run on this thread, a Gloo wait could outlast an abort)."""
        abortable = self.waits.abortable and _waits_in_gloo(executor)
        if not async_op and not abortable:
            with self.translate_errors(name):
                done = executor.run(work)
            return finish(done)
        future = executor.submit(work)
        waited = FutureWork(future)
        handle = Handle(name, self.waits.wrap(waited) if abortable else waited, lambda: finish(future.result()),
                        self.translate_errors)
        return handle if async_op else handle.wait()

    def cheapest_algorithm(self, tensor: torch.Tensor) -> str:
        """The algorithm the alpha-beta model predicts fastest for ``tensor``. Measures the link on
        first use: every rank is here."""
        links = self.links  # the current generation's: a re-formed group measures its own
        group = self._group(tensor)
        if id(group) not in links:
            with self.translate_errors("allreduce (measuring the link)"):
                links[id(group)] = cost.measure(group)
        return cost.choose_with_backend(tensor.numel() * tensor.element_size(), self.size, links[id(group)])

    @when_open
    def link(self) -> cost.Link | None:
        """The measured link of the CPU group, once ``algorithm="auto"`` needed it (or :meth:`measure_link`)."""
        return self.links.get(id(self._group(None)))

    @when_open
    def measure_link(self) -> cost.Link:
        """Measure the CPU group's alpha and beta now (collective) and keep them for ``algorithm="auto"``."""
        group = self._group(None)
        with self.translate_errors("measuring the link"):
            self.links[id(group)] = cost.measure(group)
        return self.links[id(group)]


def _waits_in_gloo(executor: OrderedExecutor[Any]) -> bool:
    """Whether a call on ``executor`` waits on Gloo messages (phalanx's algorithms, or shared memory's
    crossing between hosts): a wait in shared memory alone ends when its group is aborted."""
    group = executor.group
    return isinstance(group, algorithms.MessageGroup) or (isinstance(group, shm.SharedMemoryGroup)
                                                           and group.cross is not None)
