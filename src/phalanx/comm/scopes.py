"""What every collective of a generation stands on: the ranks it spans, and the generation's parts.

:class:`Scoped` is the base of :class:`~phalanx.comm.operations.Collectives` and of the parts it is
made of (:mod:`phalanx.comm.routing`, :mod:`phalanx.comm.agreement`): it declares what they need of
their generation (provided by the :class:`~phalanx.comm.communicator.Communicator`), restricts them
to a :class:`Scope` (:meth:`Scoped.within`), and gives them its ranks, sizes, groups and error
translation in the scope's terms.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from phalanx.comm import algorithms, cost, failures, shm
from phalanx.comm.ordered import OrderedExecutor
from phalanx.comm.waiting import Waits
from phalanx.errors import ConfigurationError


@dataclass(frozen=True)
class Scope:
    """A subgroup of the workers that collectives can be restricted to (see :meth:`Scoped.within`).

    ``ranks`` are global ranks in ascending order; a collective's ranks, size and roots are
    positions in it. ``cpu_group`` carries CPU tensors and ``device_group`` CUDA ones.
    ``shared_memory``: a shared-memory group of the scope's own over every worker (one made beside the
    generation's, :func:`phalanx.comm.formation.shared_memory_beside`), which its CPU allreduces then
    go through, on the calling thread: its owner orders its calls itself (Horovod's negotiation runs
    them in the order every rank agreed), so no executor's thread is involved.
    """

    ranks: tuple[int, ...]
    cpu_group: dist.ProcessGroup
    device_group: dist.ProcessGroup
    shared_memory: shm.SharedMemoryGroup | None = None


_scope: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("phalanx_collective_scope", default=None)

M = TypeVar("M", bound=Callable[..., Any])


def when_open(method: M) -> M:
    """Check that the communicator's generation is open before running ``method``."""
    @functools.wraps(method)
    def call(self: Scoped, *args: Any, **kwargs: Any) -> Any:
        self.ensure_open(method.__name__)
        return method(self, *args, **kwargs)
    return call  # type: ignore[return-value]


class Scoped:
    """A generation's collectives as seen from inside the current scope (the whole job, or a :class:`Scope`)."""

    # What the collectives need of their generation, provided by the Communicator.
    rank: int
    size: int
    timeout_s: float
    device: torch.device
    shared_memory: OrderedExecutor[shm.SharedMemoryGroup] | None
    links: dict[int, cost.Link]
    exchanges: int
    waits: Waits

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

    def _scoped(self) -> bool:
        """Whether a :meth:`within` scope restricts the collectives called now."""
        return _scope.get() is not None

    def _scope_shared_memory(self) -> shm.SharedMemoryGroup | None:
        """The current scope's own shared-memory group, if it has one (see :class:`Scope`)."""
        scope = _scope.get()
        return None if scope is None else scope.shared_memory

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

    def _group(self, tensor: torch.Tensor | None) -> dist.ProcessGroup | None:
        scope = _scope.get()
        if scope is not None:
            return scope.device_group if tensor is not None and tensor.is_cuda else scope.cpu_group
        return self.group_for(tensor)

    def translate_errors(self, operation: str) -> contextlib.AbstractContextManager[None]:
        """Turn a backend failure into a phalanx error naming rank and operation (see :mod:`phalanx.comm.failures`)."""
        return failures.translated(operation, self.rank, self.size, self.timeout_s)
