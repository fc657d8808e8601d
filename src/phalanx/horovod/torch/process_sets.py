"""Process sets: collectives restricted to a subset of the ranks, each set a torch.distributed group.

Every rank must create the same sets in the same order (``hvd.init(process_sets=[...])``, or
``add_process_set`` called on every rank), because forming a group is collective over the job.
A collective given ``process_set=`` runs inside :func:`phalanx.comm.collectives.within` the set's
group, with the same checks, errors and averaging as over the whole job; its negotiated operations
(:mod:`~phalanx.horovod.torch.negotiation`) run on a second pair of groups of its own. A ``root_rank`` is a
global rank, as in Horovod (:func:`root_position` finds it in the set); ``ProcessSet.rank()`` is
a position within the set.

The sets registered belong to one generation of the job (:class:`Registry`, kept on its communicator):
an elastic reset or ``shutdown`` ends it, and with it every set but the global one.
"""

from __future__ import annotations

import datetime
import logging
from typing import Sequence

import torch.distributed as dist

from phalanx.comm import collectives, runtime
from phalanx.comm.communicator import Attachment
from phalanx.errors import ConfigurationError, NotInitializedError
from phalanx.horovod.torch import variables

logger = logging.getLogger(__name__)


class ProcessSet:
    """A set of ranks that run collectives together: ``hvd.ProcessSet([0, 2])``.

    Pass it to ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set`` on every rank, then to
    collectives as ``process_set=``. MPI communicators are not accepted (phalanx uses no MPI).
    """

    def __init__(self, ranks_or_comm: Sequence[int]):
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ConfigurationError(
                "ProcessSet takes a list of ranks; MPI communicators are not supported by phalanx.horovod."
            ) from None
        if any(not isinstance(r, int) for r in ranks):
            raise ConfigurationError(f"ProcessSet should be initialized with a list of process ranks, got {ranks}.")
        self.ranks: list[int] | None = ranks
        self.process_set_id: int | None = None
        self.mpi_comm = None
        self._scope: collectives.Scope | None = None
        self._negotiated: collectives.Scope | None = None  # the groups of its negotiated operations

    def size(self) -> int | None:
        """The number of ranks in the set (``None`` once removed)."""
        if self.process_set_id == 0:
            return runtime.size()  # the global set follows elastic changes of the job
        return None if self.ranks is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's position in the set, or ``None`` if it is not a member."""
        if self.process_set_id == 0:
            return runtime.rank()
        if self.ranks is None or runtime.rank() not in self.ranks:
            return None
        return self.ranks.index(runtime.rank())

    def included(self) -> bool:
        """Whether this process is a member of the set."""
        return self.process_set_id == 0 or (self.ranks is not None and runtime.rank() in self.ranks)

    def invalidate(self) -> None:
        """Forget the set (after ``remove_process_set``)."""
        self.process_set_id, self.ranks, self._scope, self._negotiated = None, None, None, None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class Registry:
    """The process sets of one generation of the job, by id: the global set and those registered on
    it. Closed with its generation, it forgets every set but the global one (their groups belonged
    to that generation); the next generation's registry starts with the global set alone."""

    def __init__(self, size: int, dynamic: bool):
        self.dynamic = dynamic  # whether sets may be added and removed after init
        self.sets: dict[int, ProcessSet] = {0: global_process_set}
        self.next_id = 1
        global_process_set.ranks = list(range(size))

    def register(self, process_set: ProcessSet) -> ProcessSet:
        """Give ``process_set`` its groups and an id (collective over the whole job)."""
        ranks = process_set.ranks or []
        world = runtime.size()
        if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= world:
            raise ConfigurationError(f"a process set needs distinct ranks in [0, {world}), got {ranks}.")
        if any(existing.ranks == ranks for existing in self.sets.values() if existing is not global_process_set):
            raise ConfigurationError(f"a process set with ranks {ranks} is already registered; reuse it.")
        # the whole job: the global group serves its collectives
        process_set._scope = None if ranks == list(range(world)) else new_scope(ranks)
        process_set._negotiated = new_scope(ranks)
        process_set.process_set_id = self.next_id
        self.sets[self.next_id] = process_set
        self.next_id += 1
        logger.debug("process set %s registered", process_set)
        return process_set

    def holds(self, process_set: ProcessSet) -> bool:
        """Whether ``process_set`` is registered here."""
        return process_set.process_set_id is not None and self.sets.get(process_set.process_set_id) is process_set

    def negotiated_scope(self, process_set_id: int) -> collectives.Scope | None:
        """The groups that process set ``process_set_id``'s negotiated operations run on (``None`` in a
        world of one)."""
        return self.sets[process_set_id]._negotiated

    def close(self) -> None:
        """Forget every set but the global one (the generation ends)."""
        for process_set in self.sets.values():
            if process_set is not global_process_set:
                process_set.invalidate()
        self.sets = {0: global_process_set}


REGISTRY: Attachment[Registry] = Attachment("horovod process sets")


def opened(dynamic: bool, static: Sequence[ProcessSet] = ()) -> Registry:
    """The current generation's registry, made with ``static`` registered where it has none yet
    (collective, every rank alike: ``hvd.init`` and an elastic reset)."""
    communicator = runtime.communicator()

    def make() -> Registry:
        made = Registry(communicator.size, dynamic)
        for process_set in static:
            made.register(process_set)
        return made

    return communicator.attached(REGISTRY, make)


def registry() -> Registry:
    """The current generation's process sets; raises :class:`NotInitializedError` before ``hvd.init``."""
    found = runtime.attachment(REGISTRY)
    if found is None:
        raise NotInitializedError("Horovod has not been initialized; use hvd.init().")
    return found


def allows_dynamic() -> bool:
    """Whether the current generation lets sets be added after init (what the next one keeps); before
    ``hvd.init``, what the environment says."""
    found = runtime.attachment(REGISTRY)
    if found is not None:
        return found.dynamic
    return variables.read(runtime.launch_info().horovod_variables).dynamic_process_sets


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a set after ``init`` (needs ``init(process_sets="dynamic")`` or HOROVOD_DYNAMIC_PROCESS_SETS=1).

    Collective: every rank must call it with the same ranks, in the same order.
    """
    sets = registry()
    if not sets.dynamic:
        raise ConfigurationError(
            "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 or call hvd.init(process_sets='dynamic') to add process sets "
            "after initialization; static sets go to hvd.init(process_sets=[...])."
        )
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    return sets.register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a dynamic set on every rank; False for the global set or one not registered."""
    sets = registry()
    if process_set.process_set_id == 0 or not sets.holds(process_set):
        return False
    if not sets.dynamic:
        raise ConfigurationError(
            "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 or call hvd.init(process_sets='dynamic') to remove process sets."
        )
    scopes = [process_set._scope, process_set._negotiated]
    del sets.sets[process_set.process_set_id]
    process_set.invalidate()
    for scope in scopes:
        if scope is not None and runtime.rank() in scope.ranks:
            _destroy(scope)
    return True


def scope_of(process_set: ProcessSet) -> collectives.Scope | None:
    """The collectives scope of ``process_set`` for this rank (``None``: the whole job)."""
    if process_set is global_process_set or process_set.process_set_id == 0:
        return None
    if not registry().holds(process_set):
        raise ConfigurationError(
            f"{process_set} is not registered: pass it to hvd.init(process_sets=[...]) or hvd.add_process_set() "
            "on every rank first."
        )
    if not process_set.included():
        raise ConfigurationError(
            f"rank {runtime.rank()} is not part of {process_set}: only its members may run its collectives."
        )
    return process_set._scope


def members(process_set: ProcessSet) -> list[int]:
    """The global ranks of ``process_set``."""
    return list(range(runtime.size())) if process_set.process_set_id == 0 else list(process_set.ranks or [])


def position(process_set: ProcessSet) -> int:
    """This rank's position in ``process_set`` (its rank, for the global set)."""
    return int(process_set.rank() or 0)


def root_position(process_set: ProcessSet, root_rank: int) -> int:
    """The position in ``process_set`` of the global rank ``root_rank`` (the same on every rank)."""
    ranks = members(process_set)
    if root_rank not in ranks:
        raise ConfigurationError(
            f"root_rank {root_rank} is not a member of {process_set}: a root is a global rank of one of its members.")
    return ranks.index(root_rank)


def set_size(process_set: ProcessSet) -> int:
    """The number of ranks in ``process_set`` (the job's size, for the global set)."""
    return int(process_set.size() or 0)


def new_scope(ranks: list[int]) -> collectives.Scope | None:
    """New groups over ``ranks``, Gloo and (with NCCL) the device's (collective over the whole job);
    ``None`` in a world of one, which has no groups."""
    if not dist.is_initialized():
        return None
    timeout = datetime.timedelta(seconds=runtime.timeout())
    cpu = dist.new_group(ranks, backend="gloo", timeout=timeout)
    device = dist.new_group(ranks, timeout=timeout) if dist.get_backend() == "nccl" else cpu
    return collectives.Scope(tuple(ranks), cpu, device)


def _destroy(scope: collectives.Scope) -> None:
    for group in {id(scope.cpu_group): scope.cpu_group, id(scope.device_group): scope.device_group}.values():
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):
            logger.debug("destroying a process set's group failed", exc_info=True)
