"""Forming one generation's groups: the store, the default group (and Gloo beside NCCL), the
shared-memory segment of each host, the groups that join hosts; or adopting the user's group.

Every function here returns a new :class:`~phalanx.comm.communicator.Communicator` or a part of
one; none keeps state: an elastic worker's generations come from :func:`next_generation`, which asks
the launcher's coordinator through the worker's ``ElasticClient`` and forms the group it answers.
Store keys of generation ``g`` live under :func:`prefix` so that a later generation, or a later
``init`` after ``shutdown`` in the same job, never meets an earlier one's.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import secrets
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from phalanx import faults
from phalanx.comm import shm
from phalanx.comm.communicator import Communicator, created_by_first
from phalanx.comm.connections import CONNECT_TIMEOUT_S, own_connection
from phalanx.comm.environment import LaunchInfo
from phalanx.comm.membership import START_TIMEOUT_S, ElasticClient, Membership, MembershipClosed
from phalanx.comm.ordered import OrderedExecutor
from phalanx.comm.sealed_store import sealing
from phalanx.comm.sockets import socket_inodes, sockets_since
from phalanx.comm.waiting import Waits
from phalanx.errors import CollectiveTimeoutError, ConfigurationError, PhalanxError


def connect_store(info: LaunchInfo, timeout_s: float) -> Any:
    """Connect to the launcher's store, or host it on rank 0 when no launcher does.

    A client first waits for the store's port to accept a connection, within ``timeout_s``: torch's
    client retries on its own schedule (a 2 s timeout took 4.7 s here) and prints a C++ stack for
    every try, so an absent store is reported once, in phalanx's words, when the timeout is up. A
    store that listens is then given at least :data:`CONNECT_TIMEOUT_S` to answer (a loaded host
    took over 3 s), and the connection the operations' timeout, ``timeout_s``."""
    is_host = info.rank == 0 and not info.store_hosted
    deadline = time.monotonic() + timeout_s
    try:
        if not is_host:
            _wait_until_listening(info.master_addr, info.master_port, deadline)
        store = dist.TCPStore(
            info.master_addr,
            info.master_port,
            world_size=None if info.store_hosted else info.world_size,
            is_master=is_host,
            timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), CONNECT_TIMEOUT_S)),
            wait_for_workers=False,
        )
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return store
    except (RuntimeError, OSError) as error:
        raise CollectiveTimeoutError(
            f"rendezvous on rank {info.rank} failed: could not reach the store at "
            f"{info.master_addr}:{info.master_port} within {timeout_s:.0f}s ({error}). Check that rank 0 "
            "is running and MASTER_ADDR/MASTER_PORT are the same on every worker."
        ) from error


def _wait_until_listening(address: str, port: int, deadline: float) -> None:
    """Return once ``address:port`` accepts a TCP connection; ``TimeoutError`` at ``deadline``."""
    pause = 0.02
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("nothing accepted a connection there")
        try:
            socket.create_connection((address, port), timeout=min(left, 1.0)).close()
            return
        except OSError:
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(2 * pause, 0.25)


def create_group(info: LaunchInfo, timeout_s: float, backend: str, device: torch.device, *, keys: str,
                 store: Any = None, generation: int = 0, transport: str = "auto", rendezvous: Any = None,
                 abortable: bool = False) -> Communicator:
    """Form the default group (and the transport's) over ``store``, or over ``rendezvous``, a
    connection of its own that an elastic watchdog may cut when a member is lost meanwhile;
    ``abortable``: the watchdog may abort the generation, so its waits must end when it does."""
    if info.master_addr in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = connect_store(info, timeout_s) if store is None else store
    rendezvous = store if rendezvous is None else rendezvous
    timeout_delta = datetime.timedelta(seconds=timeout_s)
    before = socket_inodes()
    sealed = sealing(rendezvous, timeout_s)
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(keys, sealed),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout_delta,
            device_id=device if backend == "nccl" else None,
        )
        cpu_group = dist.new_group(backend="gloo", timeout=timeout_delta) if backend == "nccl" else dist.group.WORLD
        executor = _open_shm(info, sealed, keys, generation, transport, backend, timeout_s)
    except PhalanxError:
        raise
    except (RuntimeError, OSError) as error:
        raise CollectiveTimeoutError(
            f"rendezvous on rank {info.rank} failed: not all {info.world_size} workers joined within "
            f"{timeout_s:.0f}s ({error}). Check that every worker was started with the same world size."
        ) from error
    sockets = sockets_since(before)  # cross-host groups too
    return Communicator(info, timeout_s, backend, device, store=store, cpu_group=cpu_group, generation=generation,
                        prefix=keys, sockets=sockets, transport=transport, shared_memory=executor,
                        group_store=sealed, waits=Waits(abortable))


def _open_shm(info: LaunchInfo, store: Any, keys: str, generation: int, transport: str, backend: str,
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
    hosts = _hosts(info, store, keys) if why_not is None else {}  # store traffic only where it can matter
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
    key = f"{keys}shm/{host}"
    group = created_by_first(index == 0, key, store, timeout_s,
                              lambda create: shm.SharedMemoryGroup(name, index, len(local), timeout_s, create, cross,
                                                                   hosts=_ordered(hosts)))
    dist.barrier()
    if index == 0:  # every rank has it mapped: nothing is left in /dev/shm or the store, whatever happens next
        group.unlink()
        store.delete_key(key)  # a later init in this job (after shutdown) waits for its own segment
    return OrderedExecutor(group, "shm")


def shared_memory_beside(communicator: Communicator, tag: str, message_bytes: int = 0) -> shm.SharedMemoryGroup | None:
    """A shared-memory group of the generation's shape for a layer above that orders its own calls
    apart from the generation's (Horovod's negotiation): a segment of its own on each host (named after
    the generation's and ``tag``, removed once every rank has mapped it) and, across hosts, a Gloo
    group of its own per local index. ``message_bytes``: the group's area for
    :meth:`~phalanx.comm.shm.SharedMemoryGroup.exchange`. ``None`` where the generation reduces without
    shared memory. Collective: every rank calls it at the same point."""
    executor = communicator.shared_memory
    if executor is None:
        return None
    local, store, timeout_s = executor.group, communicator.group_store, communicator.timeout_s
    cross = None
    if local.cross is not None:
        before = socket_inodes()
        cross = _cross_host_groups(_hosts(communicator.info, store, communicator.prefix), local.rank, timeout_s)
        communicator.sockets.update(sockets_since(before))
        if communicator.on_sockets is not None:  # a broken generation's watchdog must be able to cut these too
            communicator.on_sockets(communicator.generation, dict(communicator.sockets))
    name, key = f"{local.name}-{tag}", f"{communicator.prefix}shm/{tag}/{_host_key(communicator.info)}"
    group = created_by_first(local.rank == 0, key, store, timeout_s,
                             lambda create: shm.SharedMemoryGroup(name, local.rank, local.size, timeout_s, create, cross,
                                                                  message_bytes, local.hosts))
    executor.run(local.barrier)
    if local.rank == 0:  # every rank of the host has it mapped: nothing is left in /dev/shm or the store
        group.unlink()
        store.delete_key(key)
    return group


def prefix(generation: int, incarnation: int) -> str:
    """The store keys of a generation's group; ``incarnation`` counts the groups this process left
    with ``shutdown`` (the store still holds their addresses, and every rank shuts down alike)."""
    return f"phalanx/g{generation}/" if incarnation == 0 else f"phalanx/g{generation}.{incarnation}/"


def _cross_host_groups(hosts: dict[str, list[int]], mine: int, timeout_s: float) -> dist.ProcessGroup:
    """One Gloo group per local index, joining that index's rank on every host (every rank creates
    every group, in the same order); returns this rank's."""
    ordered = _ordered(hosts)
    groups = [dist.new_group([ranks[index] for ranks in ordered], backend="gloo",
                             timeout=datetime.timedelta(seconds=timeout_s)) for index in range(len(ordered[0]))]
    return groups[mine]


def _ordered(hosts: dict[str, list[int]]) -> list[list[int]]:
    """Every host's ranks, hosts in the order of their first rank: a cross group's rank is its host's index."""
    return [hosts[key] for key in sorted(hosts, key=lambda key: hosts[key][0])]


def _host_key(info: LaunchInfo) -> str:
    """This rank's host for shared memory: the host name and its launcher (ranks of different
    launchers, say in network namespaces of one machine, count as different hosts: each launcher
    names its own segments)."""
    return f"{socket.gethostname()}/{info.job_id}"


def _hosts(info: LaunchInfo, store: Any, keys: str) -> dict[str, list[int]]:
    """The ranks of each host in this generation, exchanged through the store."""
    prefix = f"{keys}host/"
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
    return store.compare_set("phalanx/job", "", secrets.token_hex(8)).decode()  # unguessable: see shm names


def adopt_existing_group(info: LaunchInfo, timeout_s: float, device: torch.device) -> Communicator:
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
        horovod_variables=info.horovod_variables,
    )
    backend = dist.get_backend()
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return Communicator(adopted, timeout_s, backend, device, store=None, cpu_group=cpu_group)


# --- elastic generations: the launcher's coordinator says who forms each one ----------------------

FORMATION_POLL_S = 0.01


def next_generation(client: ElasticClient, reason: str, generation: int, info: LaunchInfo, timeout_s: float,
                    backend: str, device: torch.device, store: Any, transport: str, incarnation: int) -> Communicator:
    """Ask the coordinator for a place after ``generation`` and form the group it answers; when a
    member is lost while that group forms, mark it broken and ask for the one after. Returns the
    whole communicator (a world of one, not a member, for a worker started after the job did)."""
    while True:
        answer = client.request(reason, generation, _rendezvous_timeout(timeout_s))
        try:
            return _communicator_for_answer(client, answer, info, timeout_s, backend, device, store, transport,
                                            incarnation)
        except CollectiveTimeoutError:
            generation, reason = int(answer["generation"]), "failure"
            try:
                client.mark_broken(generation)
            except (RuntimeError, OSError):
                pass
            leave_group(client)


def leave_group(client: ElasticClient | None) -> None:
    """Destroy this process's groups (after an abort nothing pending can hold it up)."""
    if client is not None:
        client.track(-1, {})
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):
            pass  # already half torn down by the failure; a new default group can still be created
    else:
        _forget_failed_group_name()


def _forget_failed_group_name() -> None:
    """Undo what a failed ``init_process_group`` left counted. torch names a default group after a
    process-wide count (its store keys start with that name) and resets the count only when it
    destroys a group; an init that failed half way (a peer lost while the group connected) has
    counted one, so this process's next group would look for other keys than its peers', whose
    inits succeeded or never started, and all would wait out the timeout."""
    dist.distributed_c10d._world.group_count = 0


def _rendezvous_timeout(timeout_s: float) -> float:
    """How long a worker waits for the coordinator: it may first wait out a silent member's heartbeat
    and then a member's rejoining (each within the timeout), or workers still starting."""
    return max(2.0 * timeout_s, START_TIMEOUT_S) + 30.0


def _communicator_for_answer(client: ElasticClient, answer: dict[str, Any], info: LaunchInfo, timeout_s: float,
                             backend: str, device: torch.device, store: Any, transport: str,
                             incarnation: int) -> Communicator:
    """Build the communicator the coordinator's answer describes (forming the new group), or raise."""
    alone = dataclasses.replace(info, rank=0, world_size=1)
    status = answer.get("status")
    if status == "late":  # the job already runs: px.elastic.run() asks for admission
        return Communicator(alone, timeout_s, backend, device, store=store, generation=-1, transport=transport)
    if status != "ok":
        raise MembershipClosed(answer.get("message", f"the coordinator answered {answer}"), str(status),
                               bool(answer.get("save", False)))
    generation = int(answer["generation"])
    members = tuple(int(m) for m in answer["members"])
    rank = members.index(client.member)
    view = Membership(generation, rank, len(members), members, tuple(answer.get("lost", ())),
                      tuple(answer.get("joined", ())), str(answer.get("reason", "start")),
                      float(answer.get("event_time", 0.0)))
    placed = dataclasses.replace(info, rank=rank, world_size=len(members))
    keys = prefix(generation, incarnation)
    faults.point("reform.group" if generation > 0 else "init.group")
    _await_members(client, store, keys, generation, len(members), timeout_s)
    if len(members) == 1:
        client.track(generation, {})
        return Communicator(placed, timeout_s, backend, device, store=store, generation=generation, prefix=keys,
                            membership=view, transport=transport, on_sockets=client.track)
    if generation > 0:
        faults.point("reform.connect")
    opened = socket_inodes()
    client.track(generation, {}, forming_since=opened)
    forming = own_connection(store)  # a connection of its own, which the watchdog cuts if a member is lost meanwhile
    if client.broken(generation):  # lost while it connected: the cut hit a connect attempt, not the retry that won
        raise CollectiveTimeoutError(f"forming generation {generation} of the elastic group failed: a member was "
                                     "lost while the group connected.")
    made = create_group(placed, timeout_s, backend, device, keys=keys, store=store, generation=generation,
                        transport=transport, rendezvous=forming, abortable=backend == "gloo")
    # The rendezvous connection stays the generation's too: a group it makes later (phalanx's own
    # algorithms') waits on it for every member's address, which a member lost meanwhile never writes.
    rendezvous = {inode: fd for inode, fd in sockets_since(opened).items() if inode not in made.sockets}
    if backend == "gloo":
        made.sockets.update(rendezvous)
    client.track(generation, made.sockets if backend == "gloo" else rendezvous)
    client.stop_also(generation, made.abort_waits)
    made.membership, made.on_sockets = view, client.track
    try:
        # Nobody goes on before every member's group is whole: a member that died right after its own
        # was (at px.fit's start, say) would fail the connections its peers were still making, and
        # those would form the next generation while a peer still waited for them in this one.
        _await_members(client, store, keys, generation, len(members), timeout_s, "connected")
    except CollectiveTimeoutError:
        made.close()
        raise
    return made


def _await_members(client: ElasticClient, store: Any, keys: str, generation: int, size: int,
                   timeout_s: float, stage: str = "arrived") -> None:
    """Wait until every member of ``generation`` has reached ``stage`` ("arrived" to form its group,
    "connected" once it has); raise at once when the coordinator declares one lost meanwhile (a
    group formed without it would wait out the timeout)."""
    reached = f"{keys}{stage}"
    store.add(reached, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(reached, 0) < size:
        if client.broken(generation) or time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"forming generation {generation} of the elastic group failed: a member was lost before all "
                f"{size} {stage}.")
        time.sleep(FORMATION_POLL_S)
