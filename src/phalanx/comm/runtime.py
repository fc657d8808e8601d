"""The process's place in the job: initialisation, process groups, rank queries, timeouts.

``init()`` reads the launch environment (see :mod:`phalanx.comm.environment`), connects to the
rendezvous store and creates the default ``torch.distributed`` process group, so user code may
also call ``torch.distributed`` directly. A world of one creates no group and opens no socket.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from phalanx import faults
from phalanx.comm import algorithms, cost, shm
from phalanx.comm.environment import LaunchInfo, detect
from phalanx.comm.ordered import OrderedExecutor
from phalanx.comm.membership import (
    START_TIMEOUT_S,
    ElasticClient,
    Keys,
    Membership,
    MembershipClosed,
    shutdown_sockets,
    socket_inodes,
    sockets_since,
)
from phalanx.errors import CollectiveTimeoutError, ConfigurationError, PhalanxError

DEFAULT_TIMEOUT_S = 300.0
TRANSPORTS = ("auto", "shm", "gloo")

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Runtime:
    """Everything ``init`` established; replaced as a whole, never patched field by field."""

    info: LaunchInfo
    timeout_s: float
    backend: str
    device: torch.device
    store: Any = None
    cpu_group: dist.ProcessGroup | None = None
    generation: int = 0
    membership: Membership | None = None
    sockets: dict[str, int] = dataclasses.field(default_factory=dict)  # the group's connections
    transport: str = "auto"
    shm: OrderedExecutor[shm.SharedMemoryGroup] | None = None  # shared memory (hierarchical across hosts)
    #: phalanx's own algorithms on a Gloo group of their own; created by the first collective call
    #: that needs it (set after construction, like the links below)
    messages: OrderedExecutor[algorithms.MessageGroup] | None = None
    #: the links measured for ``algorithm="auto"``, per group of this generation (key: the group's id);
    #: a new generation starts without, so it never inherits a dead group's figures
    links: dict[int, cost.Link] = dataclasses.field(default_factory=dict)


_runtime: _Runtime | None = None
#: How many groups this process has left with shutdown(): a later init keys its rendezvous apart,
#: since the store still holds the earlier group's addresses (every rank shuts down alike).
_incarnation = 0


def init(backend: str | None = None, timeout: float | None = None, transport: str = "auto") -> None:
    """Join the job this process was launched into. Calling it again does nothing.

    ``backend`` defaults to NCCL when CUDA is available and Gloo otherwise. ``timeout`` (seconds,
    default ``$PHALANX_TIMEOUT`` or 300) bounds the rendezvous and every collective.
    ``transport``: ``"auto"`` reduces CPU tensors through shared memory when every worker is on
    this host (Linux), ``"shm"`` insists on it, ``"gloo"`` keeps Gloo's sockets; see
    :mod:`phalanx.comm.shm`.
    """
    global _runtime
    if _runtime is not None:
        return
    info = detect()
    timeout_s = _resolve_timeout(timeout, info)
    backend = _resolve_backend(backend)
    if transport not in TRANSPORTS:
        raise ConfigurationError(f"transport must be one of {list(TRANSPORTS)}, got {transport!r}.")
    if info.role == "server":  # a parameter server meets the workers through the store only
        _runtime = _Runtime(info, timeout_s, "gloo", torch.device("cpu"), store=_connect_store(info, timeout_s))
        _shutdown_at_exit()
        return
    device = _select_device(backend, info)
    if dist.is_initialized():
        _runtime = _adopt_existing_group(info, timeout_s, device)
    elif info.elastic_member is not None:
        _runtime = _init_elastic(info, info.elastic_member, timeout_s, backend, device, transport)
    elif info.world_size == 1:  # no group; the store only where parameter servers wait for this worker
        _runtime = _Runtime(info, timeout_s, backend, device,
                            store=_connect_store(info, timeout_s) if info.num_servers else None)
    else:
        _runtime = _create_group(info, timeout_s, backend, device, transport=transport)
    _shutdown_at_exit()
    faults.point("init.done")


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
    global _runtime, _elastic, _incarnation
    if _elastic is not None:
        if done:
            _elastic.leave()
        _elastic.close()
        _elastic = None
    if not done and _runtime is not None:
        shutdown_sockets(_runtime.sockets)
    if _runtime is not None:
        _close_executors(_runtime)
    if _runtime is not None and _runtime.store is not None and dist.is_initialized():
        dist.destroy_process_group()
        _incarnation += 1
    _runtime = None


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


def is_initialized() -> bool:
    """Whether ``init`` has run in this process (and ``shutdown`` has not)."""
    return _runtime is not None


def rank() -> int:
    """This worker's rank in ``[0, size())``; 0 before ``init``."""
    return _runtime.info.rank if _runtime else 0


def size() -> int:
    """The number of workers in the job; 1 before ``init``."""
    return _runtime.info.world_size if _runtime else 1


def local_rank() -> int:
    """This worker's index among the workers on its host (selects its GPU)."""
    return _runtime.info.local_rank if _runtime else 0


def local_size() -> int:
    """The number of workers on this host."""
    return _runtime.info.local_world_size if _runtime else 1


def node_rank() -> int:
    """The index of this host among the job's hosts."""
    return _runtime.info.node_rank if _runtime else 0


def is_master() -> bool:
    """True on rank 0, the worker that writes checkpoints and logs."""
    return rank() == 0


def worker_id() -> int:
    """An id for this worker that stays the same across elastic re-formings (its rank otherwise)."""
    return _elastic.member if _elastic is not None else rank()


def role() -> str:
    """``"worker"``, or ``"server"`` in a parameter-server process (``phalanx run --servers``).

    A server's ``rank()`` is ``size()`` plus its index among the servers; ``size()`` is the
    number of workers everywhere. Servers take part in no collective: ``px.fit`` serves in them.
    """
    return _runtime.info.role if _runtime else detect().role


def num_servers() -> int:
    """The number of parameter-server processes in the job (0 without ``--servers``)."""
    return (_runtime.info if _runtime else detect()).num_servers


def server_rank() -> int:
    """This parameter server's index in ``[0, num_servers())``; raises in a worker."""
    info = _require_runtime().info
    if info.role != "server":
        raise ConfigurationError("server_rank() is only defined in a parameter-server process (px.role() == 'server').")
    return info.server_rank


def timeout() -> float:
    """The timeout in seconds that bounds the rendezvous and every collective."""
    return _runtime.timeout_s if _runtime else _resolve_timeout(None, detect())


def device() -> torch.device:
    """The device this worker computes on: its local GPU with NCCL, otherwise the CPU."""
    return _runtime.device if _runtime else torch.device("cpu")


def launch_info() -> LaunchInfo:
    """How and where this worker was launched."""
    return _runtime.info if _runtime else detect()


def group_for(tensor: torch.Tensor | None = None) -> dist.ProcessGroup | None:
    """The process group for a tensor: the default group for CUDA tensors, Gloo for CPU ones."""
    runtime = _require_runtime()
    if tensor is not None and tensor.is_cuda:
        return dist.group.WORLD
    return runtime.cpu_group


def shm_executor() -> OrderedExecutor[shm.SharedMemoryGroup] | None:
    """The shared-memory allreduce of this group, when its transport is shared memory."""
    return _runtime.shm if _runtime else None


def host_arena(tag: str, nbytes: int) -> torch.Tensor:
    """``nbytes`` of shared memory mapped by every worker, when all of them are on this host.

    Collective: every worker calls it with the same ``tag`` and size. The first rank creates the
    segment (named after the job, generation and tag, so the launcher removes it after a crash),
    and once every rank has mapped it its name is removed. Raises :class:`ConfigurationError` where
    the transport does not use shared memory on one host (see :func:`shares_one_host`).
    """
    runtime = _require_runtime()
    if not shares_one_host():
        raise ConfigurationError("shared memory between workers needs every worker on this host and "
                                 "px.init(transport='auto' or 'shm').")
    executor = runtime.shm
    assert executor is not None
    name, key = f"{executor.group.name}-{tag}", f"{_prefix(runtime.generation)}arena/{tag}"
    mapping = _created_by_first(executor.group.rank == 0, key, runtime.store, runtime.timeout_s,
                                lambda create: shm.map_segment(name, nbytes, create))
    executor.run(executor.group.barrier)
    if executor.group.rank == 0:  # both names can serve the next arena...
        shm.unlink_segment(name)
        runtime.store.delete_key(key)
    executor.run(executor.group.barrier)  # ...once they are gone: nobody may find the old ones
    return torch.frombuffer(mapping, dtype=torch.uint8)


def shares_one_host() -> bool:
    """Whether every worker is on this host and reduces through shared memory."""
    return _runtime is not None and _runtime.shm is not None and _runtime.shm.group.cross is None


def message_executor() -> OrderedExecutor[algorithms.MessageGroup]:
    """The executor of phalanx's own allreduce algorithms (:mod:`phalanx.comm.algorithms`) on a Gloo
    group of their own, created at the first call: a collective, every rank calls it at the same point."""
    runtime = _require_runtime()
    if runtime.messages is None:
        before = socket_inodes()
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=runtime.timeout_s))
        runtime.sockets.update(sockets_since(before))
        if _elastic is not None:  # a broken generation's watchdog must be able to cut these too
            _elastic.track(runtime.generation, dict(runtime.sockets))
        runtime.messages = OrderedExecutor(algorithms.MessageGroup(group), "messages")
    return runtime.messages


def links() -> dict[int, cost.Link]:
    """The current generation's measured links, by group id (filled by the collectives)."""
    return _require_runtime().links


def _close_executors(runtime: _Runtime) -> None:
    for executor in (runtime.shm, runtime.messages):
        if executor is not None:
            executor.close()


def store() -> Any:
    """The rendezvous key-value store shared by all workers (``None`` in a world of one)."""
    return _require_runtime().store


def _require_runtime() -> _Runtime:
    if _runtime is None:
        from phalanx.errors import NotInitializedError

        raise NotInitializedError("phalanx is not initialised: call `px.init()` first.")
    return _runtime


def _resolve_timeout(timeout: float | None, info: LaunchInfo) -> float:
    """``px.init``'s ``timeout``, else the launch's ``$PHALANX_TIMEOUT``, else the default."""
    if timeout is None:
        timeout = info.timeout_s if info.timeout_s is not None else DEFAULT_TIMEOUT_S
    if timeout <= 0:
        raise ConfigurationError(f"timeout must be positive seconds, got {timeout}.")
    return float(timeout)


def _resolve_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigurationError(f"backend must be 'gloo' or 'nccl', got {backend!r}.")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigurationError("backend='nccl' needs CUDA, which is not available here; use backend='gloo'.")
    return backend


def _select_device(backend: str, info: LaunchInfo) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    index = info.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _connect_store(info: LaunchInfo, timeout_s: float) -> Any:
    """Connect to the launcher's store, or host it on rank 0 when no launcher does."""
    is_host = info.rank == 0 and not info.store_hosted
    try:
        return dist.TCPStore(
            info.master_addr,
            info.master_port,
            world_size=None if info.store_hosted else info.world_size,
            is_master=is_host,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as error:
        raise CollectiveTimeoutError(
            f"rendezvous on rank {info.rank} failed: could not reach the store at "
            f"{info.master_addr}:{info.master_port} within {timeout_s:.0f}s ({error}). Check that rank 0 "
            "is running and MASTER_ADDR/MASTER_PORT are the same on every worker."
        ) from error


def _create_group(info: LaunchInfo, timeout_s: float, backend: str, device: torch.device,
                  store: Any = None, generation: int = 0, transport: str = "auto", rendezvous: Any = None) -> _Runtime:
    """Form the default group (and the transport's) over ``store``, or over ``rendezvous``, a
    connection of its own that an elastic watchdog may cut when a member is lost meanwhile."""
    if info.master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = _connect_store(info, timeout_s) if store is None else store
    rendezvous = store if rendezvous is None else rendezvous
    timeout_delta = datetime.timedelta(seconds=timeout_s)
    before = socket_inodes()
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(_prefix(generation), rendezvous),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout_delta,
            device_id=device if backend == "nccl" else None,
        )
        cpu_group = dist.new_group(backend="gloo", timeout=timeout_delta) if backend == "nccl" else dist.group.WORLD
        executor = _open_shm(info, rendezvous, generation, transport, backend, timeout_s)
    except PhalanxError:
        raise
    except (RuntimeError, OSError) as error:
        raise CollectiveTimeoutError(
            f"rendezvous on rank {info.rank} failed: not all {info.world_size} workers joined within "
            f"{timeout_s:.0f}s ({error}). Check that every worker was started with the same world size."
        ) from error
    sockets = sockets_since(before)  # cross-host groups too
    return _Runtime(info, timeout_s, backend, device, store=store, cpu_group=cpu_group, generation=generation,
                    sockets=sockets, transport=transport, shm=executor)


def _open_shm(info: LaunchInfo, store: Any, generation: int, transport: str, backend: str,
              timeout_s: float) -> OrderedExecutor[shm.SharedMemoryGroup] | None:
    """Map this host's segment of this generation when the transport allows it.

    All ranks on one host: the allreduce is the shared-memory one. Several hosts with the same
    number of ranks each: hierarchical, with one Gloo group per local index across the hosts, so
    that each local rank carries its slice between hosts. The host's first rank creates the
    segment, the others map it, and once all have (a barrier) its name is removed.
    """
    if transport == "gloo":
        return None
    why_not = "the backend is NCCL" if backend != "gloo" else "this system has no /dev/shm" if not shm.available() \
        else None
    hosts = _hosts(info, store, generation) if why_not is None else {}  # store traffic only where it can matter
    host = _host_key(info)
    sizes = {len(ranks) for ranks in hosts.values()}
    why_not = why_not or ("hosts run different numbers of workers" if len(sizes) > 1
                          else "every host runs a single worker" if sizes == {1} else None)
    if why_not is not None:
        if transport == "shm":
            raise ConfigurationError(f"transport='shm' needs Gloo and several workers per host, but {why_not}; "
                                     "use transport='auto' or 'gloo'.")
        return None
    local = hosts[host]
    index = local.index(info.rank)
    cross = _cross_host_groups(hosts, index, timeout_s) if len(hosts) > 1 else None
    name = shm.segment_name(_job_id(store, info), generation)
    key = f"{_prefix(generation)}shm/{host}"
    group = _created_by_first(index == 0, key, store, timeout_s,
                              lambda create: shm.SharedMemoryGroup(name, index, len(local), timeout_s, create, cross))
    dist.barrier()
    if index == 0:  # every rank has it mapped: nothing is left in /dev/shm or the store, whatever happens next
        group.unlink()
        store.delete_key(key)  # a later init in this job (after shutdown) waits for its own segment
    return OrderedExecutor(group, "shm")


def _created_by_first(first: bool, key: str, store: Any, timeout_s: float, open_segment: Callable[[bool], T]) -> T:
    """A host's shared segment: its first rank creates it (``open_segment(True)``) and then sets
    ``key``; the others wait for ``key`` and open it (``open_segment(False)``)."""
    if first:
        made = open_segment(True)
        store.set(key, "created")
        return made
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return open_segment(False)


def _prefix(generation: int) -> str:
    """The store keys of this generation's group (and of this process's incarnation after a shutdown)."""
    return f"phalanx/g{generation}/" if _incarnation == 0 else f"phalanx/g{generation}.{_incarnation}/"


def _cross_host_groups(hosts: dict[str, list[int]], mine: int, timeout_s: float) -> dist.ProcessGroup:
    """One Gloo group per local index, joining that index's rank on every host (every rank creates
    every group, in the same order); returns this rank's."""
    ordered = [hosts[key] for key in sorted(hosts, key=lambda key: hosts[key][0])]
    groups = [dist.new_group([ranks[index] for ranks in ordered], backend="gloo",
                             timeout=datetime.timedelta(seconds=timeout_s)) for index in range(len(ordered[0]))]
    return groups[mine]


def _host_key(info: LaunchInfo) -> str:
    """This rank's host for shared memory: the host name and its launcher (ranks of different
    launchers, say in network namespaces of one machine, count as different hosts: each launcher
    names its own segments)."""
    return f"{socket.gethostname()}/{info.job_id}"


def _hosts(info: LaunchInfo, store: Any, generation: int) -> dict[str, list[int]]:
    """The ranks of each host in this generation, exchanged through the store."""
    prefix = f"{_prefix(generation)}host/"
    store.set(f"{prefix}{info.rank}", _host_key(info))
    keys = [f"{prefix}{rank}" for rank in range(info.world_size)]
    store.wait(keys)
    hosts: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        hosts.setdefault(store.get(key).decode(), []).append(rank)
    return hosts


def _job_id(store: Any, info: LaunchInfo) -> str:
    """The launcher's job id, or one agreed through the store (other launchers)."""
    if info.job_id:
        return info.job_id
    return store.compare_set("phalanx/job", "", secrets.token_hex(4)).decode()


def _adopt_existing_group(info: LaunchInfo, timeout_s: float, device: torch.device) -> _Runtime:
    """The user created the process group themselves: use it as it is."""
    adopted = LaunchInfo(
        source=f"{info.source}+existing-group",
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=info.local_rank,
        local_world_size=info.local_world_size,
        node_rank=info.node_rank,
        master_addr=info.master_addr,
        master_port=info.master_port,
    )
    backend = dist.get_backend()
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return _Runtime(adopted, timeout_s, backend, device, store=None, cpu_group=cpu_group)




# --------------------------------------------------------------------------------------------
# Elastic membership: the group is re-formed, generation after generation, over the same store.
# Generation g's process group lives under the store prefix "phalanx/g{g}/"; the protocol with the
# launcher's coordinator is in phalanx.comm.membership.
# --------------------------------------------------------------------------------------------

_elastic: ElasticClient | None = None
FORMATION_POLL_S = 0.01


def is_elastic() -> bool:
    """Whether this worker was launched elastic (``phalanx run --min-workers`` or ``--nnodes MIN:MAX``)."""
    return _elastic is not None


def membership() -> Membership | None:
    """The generation this worker belongs to; ``None`` outside elastic jobs and before admission."""
    return _runtime.membership if _runtime else None


def mark_broken() -> None:
    """Declare the current generation broken: every member aborts its pending collectives now."""
    runtime = _runtime
    if runtime is None or _elastic is None or runtime.membership is None:
        return
    try:
        runtime.store.add(Keys.broken(runtime.generation), 1)
        runtime.store.add(Keys.signal(runtime.generation), 1)  # members between collectives see it at commit
    except (RuntimeError, OSError):
        pass  # the peers learn it from their own failures, or from the coordinator
    _elastic.abort(runtime.generation)


def rejoin(reason: str = "failure") -> Membership:
    """Leave the current group and join the next generation the coordinator forms.

    ``reason`` is ``"failure"`` (a collective failed: the generation is marked broken first),
    ``"planned"`` (every member reached the agreed step boundary) or ``"join"`` (a worker started
    after the job did asks to be admitted). Raises :class:`MembershipClosed` when there is no place.
    """
    global _runtime
    current = _require_runtime()
    if _elastic is None:
        raise ConfigurationError("rejoin() needs an elastic launch: `phalanx run --min-workers K ...`.")
    if reason == "failure":
        mark_broken()
    _leave_group()
    _close_executors(current)
    base = current.info
    _runtime = _Runtime(dataclasses.replace(base, rank=0, world_size=1), current.timeout_s, current.backend,
                        current.device, store=current.store, generation=-1, transport=current.transport)
    _runtime = _next_generation(reason, current.generation, base, current.timeout_s, current.backend, current.device,
                                current.store, current.transport)
    assert _runtime.membership is not None
    return _runtime.membership


def _next_generation(reason: str, generation: int, info: LaunchInfo, timeout_s: float, backend: str,
                     device: torch.device, store: Any, transport: str) -> _Runtime:
    """Ask the coordinator for a place after ``generation`` and form the group it answers; when a
    member is lost while that group forms, mark it broken and ask for the one after."""
    assert _elastic is not None
    while True:
        answer = _elastic.request(reason, generation, _rendezvous_timeout(timeout_s))
        try:
            return _runtime_for_answer(answer, info, timeout_s, backend, device, store, transport)
        except CollectiveTimeoutError:
            generation, reason = int(answer["generation"]), "failure"
            try:
                store.add(Keys.broken(generation), 1)
            except (RuntimeError, OSError):
                pass
            _leave_group()


def _rendezvous_timeout(timeout_s: float) -> float:
    """How long a worker waits for the coordinator: it may first wait out a silent member's heartbeat
    and then a member's rejoining (each within the timeout), or workers still starting."""
    return max(2.0 * timeout_s, START_TIMEOUT_S) + 30.0


def _init_elastic(info: LaunchInfo, member: int, timeout_s: float, backend: str, device: torch.device,
                  transport: str = "auto") -> _Runtime:
    """Join generation 0, or, when the job already runs, wait as a world of one for admission."""
    global _elastic
    store = _connect_store(info, timeout_s)
    _elastic = ElasticClient(store, member)
    return _next_generation("start", -1, info, timeout_s, backend, device, store, transport)


def _runtime_for_answer(answer: dict[str, Any], info: LaunchInfo, timeout_s: float, backend: str,
                        device: torch.device, store: Any, transport: str = "auto") -> _Runtime:
    """Build the runtime the coordinator's answer describes (forming the new group), or raise."""
    alone = dataclasses.replace(info, rank=0, world_size=1)
    status = answer.get("status")
    if status == "late":  # the job already runs: px.elastic.run() asks for admission
        return _Runtime(alone, timeout_s, backend, device, store=store, generation=-1, transport=transport)
    if status != "ok":
        raise MembershipClosed(answer.get("message", f"the coordinator answered {answer}"), str(status),
                               bool(answer.get("save", False)))
    generation = int(answer["generation"])
    members = tuple(int(m) for m in answer["members"])
    assert _elastic is not None
    rank = members.index(_elastic.member)
    view = Membership(generation, rank, len(members), members, tuple(answer.get("lost", ())),
                      tuple(answer.get("joined", ())), str(answer.get("reason", "start")),
                      float(answer.get("event_time", 0.0)))
    placed = dataclasses.replace(info, rank=rank, world_size=len(members))
    faults.point("reform.group" if generation > 0 else "init.group")
    _await_members(store, generation, len(members), timeout_s)
    if len(members) == 1:
        _elastic.track(generation, {})
        return _Runtime(placed, timeout_s, backend, device, store=store, generation=generation, membership=view,
                        transport=transport)
    if generation > 0:
        faults.point("reform.connect")
    _elastic.track(generation, {}, forming_since=socket_inodes())
    forming = store.clone()  # a connection of its own, which the watchdog cuts if a member is lost meanwhile
    runtime = _create_group(placed, timeout_s, backend, device, store=store, generation=generation,
                            transport=transport, rendezvous=forming)
    _elastic.track(generation, runtime.sockets if backend == "gloo" else {})
    return dataclasses.replace(runtime, membership=view)


def _await_members(store: Any, generation: int, size: int, timeout_s: float) -> None:
    """Wait until every member of ``generation`` is here to form its group; raise at once when the
    coordinator declares one lost meanwhile (a group formed without it would wait out the timeout)."""
    arrived = f"{_prefix(generation)}arrived"
    store.add(arrived, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(arrived, 0) < size:
        if store.add(Keys.broken(generation), 0) > 0 or time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"forming generation {generation} of the elastic group failed: a member was lost before all "
                f"{size} arrived.")
        time.sleep(FORMATION_POLL_S)


def _leave_group() -> None:
    """Destroy this process's groups (after an abort nothing pending can hold it up)."""
    if _elastic is not None:
        _elastic.track(-1, {})
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):
            pass  # already half torn down by the failure; a new default group can still be created
