"""The process's place in the job: its current communicator, ``init``/``shutdown``, elastic re-forming.

``init()`` reads the launch environment (see :mod:`phalanx.comm.environment`), connects to the
rendezvous store and creates the default ``torch.distributed`` process group, so user code may
also call ``torch.distributed`` directly. A world of one creates no group and opens no socket.

Everything ``init`` establishes is one :class:`~phalanx.comm.communicator.Communicator`, which this
module holds as the process's current one; the functions below (``rank()``, ``store()``, ...) are
thin queries of it, and the collectives' ``px.*`` functions call its methods. An elastic job
replaces it at each new generation: the old one is closed first, so a caller that kept it gets a
clear error instead of a dead group.
"""

from __future__ import annotations

import atexit
import logging
import sys
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from phalanx import faults
from phalanx.comm import auth, cost, devices, formation, shm
from phalanx.comm.communicator import Attachment, Communicator
from phalanx.comm.environment import LaunchInfo, detect
from phalanx.comm.membership import ElasticClient, Membership
from phalanx.comm.sockets import shutdown_sockets
from phalanx.comm.ordered import OrderedExecutor
from phalanx.errors import ConfigurationError, NotInitializedError

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 300.0
TRANSPORTS = ("auto", "shm", "gloo")

logger = logging.getLogger(__name__)

#: The process's current generation; ``None`` before ``init`` and after ``shutdown``.
_current: Communicator | None = None
#: This worker's place in an elastic job, which outlives the generations it takes part in.
_elastic: ElasticClient | None = None
#: How many groups this process has left with shutdown(): a later init keys its rendezvous apart.
_incarnation = 0


def init(backend: str | None = None, timeout: float | None = None, transport: str = "auto") -> None:
    """Join the job this process was launched into. Calling it again does nothing.

    ``backend`` defaults to NCCL when CUDA is available and Gloo otherwise. ``timeout`` (seconds,
    default ``$PHALANX_TIMEOUT`` or 300) bounds the rendezvous and every collective.
    ``transport``: ``"auto"`` reduces CPU tensors through shared memory when every worker is on
    this host (Linux), ``"shm"`` insists on it, ``"gloo"`` keeps Gloo's sockets; see
    :mod:`phalanx.comm.shm`.
    """
    global _current
    if _current is not None:
        return
    info = detect()
    timeout_s = _resolve_timeout(timeout, info)
    backend = devices.resolve_backend(backend, info.device)
    if transport not in TRANSPORTS:
        raise ConfigurationError(f"transport must be one of {list(TRANSPORTS)}, got {transport!r}.")
    _current = _first_communicator(info, timeout_s, backend, transport)
    _shutdown_at_exit()
    if info.role != "server":
        faults.point("init.done")


def _first_communicator(info: LaunchInfo, timeout_s: float, backend: str, transport: str) -> Communicator:
    """The communicator ``init`` starts with, for whatever way this process was launched."""
    if info.role == "server":  # a parameter server meets the workers through the store only
        return Communicator(info, timeout_s, "gloo", torch.device("cpu"), store=formation.connect_store(info, timeout_s))
    device = _select_device(backend, info)
    if dist.is_initialized():
        return formation.adopt_existing_group(info, timeout_s, device)
    if info.elastic_member is not None:
        return _init_elastic(info, info.elastic_member, timeout_s, backend, device, transport)
    if info.world_size == 1:  # no group; the store only where parameter servers wait for this worker
        return Communicator(info, timeout_s, backend, device,
                            store=formation.connect_store(info, timeout_s) if info.num_servers else None)
    return formation.create_group(info, timeout_s, backend, device, keys=formation.prefix(0, _incarnation),
                                  transport=transport)


def shutdown() -> None:
    """Leave the job: destroy the process groups phalanx created. ``init`` may be called again.

    Called by itself when the interpreter exits, so scripts need not call it.
    """
    _shutdown(done=True)


def _shutdown(done: bool) -> None:
    """Destroy the groups; ``done`` tells an elastic coordinator the worker finished (not failed).

    A worker that failed may leave collectives pending that its peers will never join: its
    connections are shut down first, so that tearing the group down does not wait for them.
    """
    global _current, _elastic, _incarnation
    if _elastic is not None:
        if done:
            _elastic.leave()
        _elastic.close()
        _elastic = None
    closing, _current = _current, None
    if closing is None:
        return
    if not done:
        shutdown_sockets(closing.sockets)
    closing.close()
    if closing.store is not None and dist.is_initialized():
        dist.destroy_process_group()
        _incarnation += 1


_exit_hook_registered = False


def _shutdown_at_exit() -> None:
    """Register (once) the shutdown that runs when the interpreter exits.

    torch leaves the Gloo group to interpreter teardown, which aborts the process (SIGABRT) in a
    good share of runs; destroying it from ``atexit`` ends every run cleanly. ``atexit`` runs after
    non-daemon threads were joined and before daemon threads (loader prefetch, the elastic
    watchdog) are frozen, so the group is torn down while nothing else uses it.
    """
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_exit)
        _exit_hook_registered = True


def _exit() -> None:
    # An uncaught exception leaves sys.last_value behind: the worker failed and must not tell an
    # elastic coordinator it finished.
    failed = getattr(sys, "last_value", None) is not None
    try:
        _shutdown(done=not failed)
    except Exception:  # noqa: BLE001 - exit must not fail on a half torn-down group
        logger.debug("shutdown at exit failed", exc_info=True)


def communicator() -> Communicator:
    """The current generation's communicator: the job's ranks, groups and transport, and its
    collectives as methods. An elastic re-forming closes it and makes a new one; ask again then."""
    if _current is None:
        raise NotInitializedError("phalanx is not initialised: call `px.init()` first.")
    return _current


def attachment(key: Attachment[T]) -> T | None:
    """What a layer above keeps on the current generation under ``key``
    (:meth:`Communicator.attachment <phalanx.comm.communicator.Communicator.attachment>`); ``None``
    before ``init`` or where it has none."""
    current = _current  # read once: another thread's re-form may replace it meanwhile
    return current.attachment(key) if current is not None else None


def communicator_or_alone() -> Communicator:
    """The current communicator; before ``init``, a world of one (collectives complete at once),
    so that single-process code may call the collectives without ``px.init()``."""
    global _alone
    if _current is not None:
        return _current
    if _alone is None:
        _alone = Communicator(LaunchInfo(source="not initialised"), DEFAULT_TIMEOUT_S, "gloo", torch.device("cpu"))
    return _alone


_alone: Communicator | None = None


# --- thin queries of the current communicator (defaults before ``init``) ----------------------


def is_initialized() -> bool:
    """Whether ``init`` has run in this process (and ``shutdown`` has not)."""
    return _current is not None


def rank() -> int:
    """This worker's rank in ``[0, size())``; 0 before ``init``."""
    return _current.rank if _current else 0


def size() -> int:
    """The number of workers in the job; 1 before ``init``."""
    return _current.size if _current else 1


def local_rank() -> int:
    """This worker's index among the workers on its host (selects its GPU)."""
    return _current.info.local_rank if _current else 0


def local_size() -> int:
    """The number of workers on this host."""
    return _current.info.local_world_size if _current else 1


def node_rank() -> int:
    """The index of this host among the job's hosts."""
    return _current.info.node_rank if _current else 0


def is_master() -> bool:
    """True on rank 0, the worker that writes checkpoints and logs; never for an elastic worker
    that is not a member of a generation (started after the job did and not yet admitted)."""
    current = _current  # read once: another thread's re-form may replace it meanwhile
    return current is None or (current.rank == 0 and current.generation >= 0)


def worker_id() -> int:
    """An id for this worker that stays the same across elastic re-formings (its rank otherwise)."""
    return _elastic.member if _elastic is not None else rank()


def role() -> str:
    """``"worker"``, or ``"server"`` in a parameter-server process (``phalanx run --servers``).

    A server's ``rank()`` is ``size()`` plus its index among the servers; ``size()`` is the
    number of workers everywhere. Servers take part in no collective: ``px.fit`` serves in them.
    """
    return launch_info().role


def num_servers() -> int:
    """The number of parameter-server processes in the job (0 without ``--servers``)."""
    return launch_info().num_servers


def server_rank() -> int:
    """This parameter server's index in ``[0, num_servers())``; raises in a worker."""
    info = communicator().info
    if info.role != "server":
        raise ConfigurationError("server_rank() is only defined in a parameter-server process (px.role() == 'server').")
    return info.server_rank


def timeout() -> float:
    """The timeout in seconds that bounds the rendezvous and every collective."""
    return _current.timeout_s if _current else _resolve_timeout(None, detect())


def device() -> torch.device:
    """The device this worker computes on: its local GPU with NCCL, otherwise the CPU."""
    return _current.device if _current else torch.device("cpu")


def launch_info() -> LaunchInfo:
    """How and where this worker was launched (in this generation: its rank and world size)."""
    return _current.info if _current else detect()


def group_for(tensor: torch.Tensor | None = None) -> dist.ProcessGroup | None:
    """The current process group for a tensor: the default group for CUDA tensors, Gloo for CPU ones."""
    return communicator().group_for(tensor)


def shm_executor() -> OrderedExecutor[shm.SharedMemoryGroup] | None:
    """The shared-memory allreduce of the current group, when its transport is shared memory."""
    return _current.shared_memory if _current else None


def host_arena(tag: str, nbytes: int) -> torch.Tensor:
    """``nbytes`` of shared memory mapped by every worker of this host (see
    :meth:`Communicator.host_arena <phalanx.comm.communicator.Communicator.host_arena>`)."""
    return communicator().host_arena(tag, nbytes)


def shares_one_host() -> bool:
    """Whether every worker is on this host and reduces through shared memory."""
    return _current is not None and _current.shares_one_host()


def links() -> dict[int, cost.Link]:
    """The current generation's measured links, by group id (filled by the collectives)."""
    return communicator().links


def store() -> Any:
    """The rendezvous key-value store shared by all workers (``None`` in a world of one)."""
    return communicator().store


def _resolve_timeout(timeout: float | None, info: LaunchInfo) -> float:
    """``px.init``'s ``timeout``, else the launch's ``$PHALANX_TIMEOUT``, else the default."""
    if timeout is None:
        timeout = info.timeout_s if info.timeout_s is not None else DEFAULT_TIMEOUT_S
    if timeout <= 0:
        raise ConfigurationError(f"timeout must be positive seconds, got {timeout}.")
    return float(timeout)


def _select_device(backend: str, info: LaunchInfo) -> torch.device:
    """This worker's device (see :mod:`phalanx.comm.devices`), made CUDA's current one."""
    device = devices.device_for(backend, info.local_rank, info.local_world_size, devices.visible_gpus(),
                                f"{info.source} launch")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


# --------------------------------------------------------------------------------------------
# Elastic membership: the group is re-formed, generation after generation, over the same store.
# Generation g's process group lives under the store prefix "phalanx/g{g}/"; the protocol with the
# launcher's coordinator is in phalanx.comm.membership.
# --------------------------------------------------------------------------------------------


def is_elastic() -> bool:
    """Whether this worker was launched elastic (``phalanx run --min-workers`` or ``--nnodes MIN:MAX``)."""
    return _elastic is not None


def membership() -> Membership | None:
    """The generation this worker belongs to; ``None`` outside elastic jobs and before admission."""
    return _current.membership if _current else None


def generation_ending(generation: int) -> str | None:
    """Whether elastic ``generation`` is ending, as its members and the coordinator stated it:
    ``"failure"`` (it lost a member), ``"planned"`` (joiners wait), or ``None``."""
    if _elastic is None:
        return None
    if not _elastic.signalled(generation):
        return None
    return "failure" if _elastic.broken(generation) else "planned"


def agree_boundary(generation: int, proposed: int) -> int | None:
    """The commit after which elastic ``generation`` ends for joiners: the first member's proposal,
    agreed through the store and sealed; ``None`` when the key holds a value without the secret."""
    assert _elastic is not None
    return _elastic.agree_boundary(generation, proposed)


def mark_broken() -> None:
    """Declare the current generation broken: every member aborts its pending collectives now."""
    current = _current
    if current is None or _elastic is None or current.membership is None:
        return
    try:
        _elastic.mark_broken(current.generation)
    except (RuntimeError, OSError):
        pass  # the peers learn it from their own failures, or from the coordinator
    _elastic.abort(current.generation)


def rejoin(reason: str = "failure") -> Membership:
    """Close the current generation and join the next one the coordinator forms.

    ``reason`` is ``"failure"`` (a collective failed: the generation is marked broken first),
    ``"planned"`` (every member reached the agreed step boundary) or ``"join"`` (a worker started
    after the job did asks to be admitted). Raises :class:`~phalanx.comm.membership.MembershipClosed`
    when there is no place.
    """
    global _current
    old = communicator()
    if _elastic is None:
        raise ConfigurationError("rejoin() needs an elastic launch: `phalanx run --min-workers K ...`.")
    if reason == "failure":
        mark_broken()
    formation.leave_group(_elastic)
    old.close()
    # While the next generation forms, the closed one stays current: other threads' queries (rank,
    # size, is_master) answer its values, never a world that does not exist; its collectives raise
    # GenerationClosedError. The new one replaces it in one assignment, once it is whole.
    formed = formation.next_generation(_elastic, reason, old.generation, old.info, old.timeout_s, old.backend,
                                       old.device, old.store, old.transport, _incarnation)
    assert formed.membership is not None
    _current = formed
    return formed.membership


def _init_elastic(info: LaunchInfo, member: int, timeout_s: float, backend: str, device: torch.device,
                  transport: str = "auto") -> Communicator:
    """Join generation 0, or, when the job already runs, wait as a world of one for admission."""
    global _elastic
    secret = auth.required("an elastic worker", "start elastic jobs with phalanx run")
    store = formation.connect_store(info, timeout_s)
    _elastic = ElasticClient(store, member, secret)
    return formation.next_generation(_elastic, "start", -1, info, timeout_s, backend, device, store, transport,
                                     _incarnation)
