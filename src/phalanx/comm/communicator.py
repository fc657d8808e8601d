"""One generation of the job: its ranks, process groups, transport, store, timeout and caches.

A :class:`Communicator` is made when a process joins a job (``px.init``) and again each time an
elastic job re-forms; the one it replaces is closed first, and a collective called on a closed one
raises :class:`~phalanx.errors.GenerationClosedError` instead of using a dead group. The process's
current communicator is held by :mod:`phalanx.comm.runtime` (``px.communicator()``); the
collectives themselves are its methods (:class:`~phalanx.comm.operations.Collectives`).
How a generation's groups are formed is :mod:`phalanx.comm.formation`. A layer above keeps what it
holds per generation on the communicator itself (:meth:`Communicator.attached`), so that it ends with
the generation and the next one starts without it.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import torch
import torch.distributed as dist

from phalanx.comm import algorithms, cost, shm
from phalanx.comm.environment import LaunchInfo
from phalanx.comm.membership import Membership
from phalanx.comm.operations import Collectives
from phalanx.comm.ordered import OrderedExecutor
from phalanx.comm.sockets import socket_inodes, sockets_since
from phalanx.comm.waiting import Waits
from phalanx.errors import CollectiveTimeoutError, ConfigurationError, GenerationClosedError

T = TypeVar("T")

#: How :meth:`Communicator.arrive` paces its questions to the store: from the first pause, doubling
#: to the last (an abort or the others' arrival is then seen within 20 ms).
ARRIVAL_FIRST_PAUSE_S = 0.0002
ARRIVAL_LAST_PAUSE_S = 0.02


class Attachment(Generic[T]):
    """The key of one kind of object a layer above keeps per generation (:meth:`Communicator.attached`);
    keys compare by identity, so two layers never share one by accident."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Attachment({self.name!r})"


@dataclass(eq=False)
class Communicator(Collectives):
    """Everything one generation of the job established; closed as a whole, never patched.

    ``store`` is the rendezvous store (``None`` in a world of one without servers, or in a group
    the user created); ``cpu_group`` carries CPU tensors (Gloo, also beside NCCL); ``prefix`` keys
    this generation's entries in the store. ``sockets`` are the group's connections (an elastic
    watchdog cuts them when a peer is lost); ``on_sockets`` is told of connections opened later.
    """

    info: LaunchInfo
    timeout_s: float
    backend: str
    device: torch.device
    store: Any = None
    cpu_group: dist.ProcessGroup | None = None
    generation: int = 0
    prefix: str = "phalanx/g0/"
    membership: Membership | None = None
    sockets: dict[str, int] = dataclasses.field(default_factory=dict)
    transport: str = "auto"
    #: shared memory on this host (hierarchical across hosts), when the transport is
    shared_memory: OrderedExecutor[shm.SharedMemoryGroup] | None = None
    on_sockets: Callable[[int, dict[str, int]], None] | None = None
    #: how its works are waited for: abortable where a watchdog may abort the generation (elastic)
    waits: Waits = dataclasses.field(default_factory=Waits)
    #: the store under the generation's groups (sealed with the job's secret): kept alive while they
    #: live, since torch calls back into it whenever a group is made
    group_store: Any = None
    #: phalanx's own algorithms on a Gloo group of their own, made by the first call that needs it
    messages: OrderedExecutor[algorithms.MessageGroup] | None = dataclasses.field(default=None, init=False)
    #: the links measured for ``algorithm="auto"``, by group id: a new generation starts without
    links: dict[int, cost.Link] = dataclasses.field(default_factory=dict, init=False)
    #: point-to-point exchanges (CPU reduce-scatters and allgathers) started, counted alike on every
    #: rank: each takes its own tag
    exchanges: int = dataclasses.field(default=0, init=False)
    #: how often this rank arrived at each name (:meth:`arrive`), counted alike on every rank
    arrivals: dict[str, int] = dataclasses.field(default_factory=dict, init=False)
    closed: bool = dataclasses.field(default=False, init=False)
    #: what runs first when the generation ends (a layer above stopping its threads on these groups)
    closing: list[Callable[[], None]] = dataclasses.field(default_factory=list, init=False)
    #: what layers above keep for this generation, by key (:meth:`attached`)
    attachments: dict[Attachment[Any], Any] = dataclasses.field(default_factory=dict, init=False)
    _attaching: threading.RLock = dataclasses.field(default_factory=threading.RLock, init=False, repr=False)

    @property
    def rank(self) -> int:  # type: ignore[override]
        """This worker's rank in the generation."""
        return self.info.rank

    @property
    def size(self) -> int:  # type: ignore[override]
        """The number of workers in the generation."""
        return self.info.world_size

    def ensure_open(self, operation: str) -> None:
        """Raise :class:`GenerationClosedError` when this generation has ended."""
        if self.closed:
            raise GenerationClosedError(
                f"{operation} on rank {self.rank}: generation {self.generation} of the job has ended (elastic "
                "re-forming or px.shutdown() closed it). Use px.communicator() for the current one, or the "
                "px.* functions, which always do.")

    def attached(self, key: Attachment[T], make: Callable[[], T]) -> T:
        """This generation's object of ``key``: made by ``make()`` on first use, then the same one for
        as long as the generation lasts. One with a ``close`` method is closed with the generation
        (among ``closing``, newest first), and the next generation starts without it: a layer above
        keeps its per-generation state here instead of in globals it must rebuild. ``make`` runs once,
        whichever threads ask; where it is collective, every rank must ask at the same point."""
        with self._attaching:
            if key not in self.attachments:
                self.ensure_open(f"attaching {key.name}")
                made = self.attachments[key] = make()
                close = getattr(made, "close", None)
                if callable(close):
                    self.closing.append(close)
            return self.attachments[key]

    def attachment(self, key: Attachment[T]) -> T | None:
        """``key``'s object if :meth:`attached` made one on this generation (still there once it has
        ended, closed), else ``None``; never makes one."""
        return self.attachments.get(key)

    def group_for(self, tensor: torch.Tensor | None = None) -> dist.ProcessGroup | None:
        """The process group for a tensor: the default group for CUDA tensors, Gloo for CPU ones."""
        self.ensure_open("group_for")
        if tensor is not None and tensor.is_cuda:
            return dist.group.WORLD
        return self.cpu_group

    def message_executor(self) -> OrderedExecutor[algorithms.MessageGroup]:
        """The executor of phalanx's own allreduce algorithms on a Gloo group of their own, created at
        the first call: a collective, every rank calls it at the same point."""
        self.ensure_open("message_executor")
        if self.messages is None:
            before = socket_inodes()
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
            self.sockets.update(sockets_since(before))
            if self.on_sockets is not None:  # a broken generation's watchdog must be able to cut these too
                self.on_sockets(self.generation, dict(self.sockets))
            self.messages = OrderedExecutor(algorithms.MessageGroup(group), "messages")
        return self.messages

    def abort_waits(self) -> None:
        """End at once the waits in progress on any thread (for the elastic watchdog, when the
        generation breaks: a peer that left it alive is never found dead on shared memory, and Gloo
        does not end a transfer cut part-way until its timeout; see :mod:`phalanx.comm.waiting`). The
        generation is unusable after, as it is once broken."""
        self.waits.abort()
        if self.shared_memory is not None:
            self.shared_memory.group.abort()

    def arrive(self, name: str, advice: str) -> None:
        """Wait, through the store, until every rank of the generation has arrived at ``name`` as often
        as this one: before a call whose collectives no rank may start alone (a call some ranks make
        while the others run collectives of their own would be matched with theirs, silently where the
        sizes agree). A rank still without the others after most of the timeout (so that its error,
        not the others' timeouts, is the first) raises :class:`ConfigurationError` naming ``name``
        and saying ``advice``; one whose generation is aborted meanwhile (an elastic job lost a
        member) raises :class:`CollectiveTimeoutError` at once, as its other waits do.

        It asks the store (``check``) rather than waiting on it: a wait cut into slices, to see an
        abort, would have torch print a warning for every slice. The pause between asks grows from
        0.2 ms, so ranks that arrive together pass at once."""
        if self.size == 1 or self.store is None:
            return
        count = self.arrivals[name] = self.arrivals.get(name, 0) + 1
        key = f"{self.prefix}arrive/{name}/{count}"
        everyone = f"{key}/all"
        if int(self.store.add(key, 1)) == self.size:
            self.store.set(everyone, "1")
            return
        waited = max(self.timeout_s * 0.8, min(self.timeout_s, 1.0))
        deadline, pause = time.monotonic() + waited, ARRIVAL_FIRST_PAUSE_S
        while not self.store.check([everyone]):
            if self.waits.aborted is not None:
                raise CollectiveTimeoutError(f"{name} on rank {self.rank} of {self.size} failed: the wait for every "
                                             f"rank was aborted ({self.waits.aborted}).")
            if time.monotonic() > deadline:
                arrived = int(self.store.add(key, 0))
                raise ConfigurationError(
                    f"{name} on rank {self.rank}: only {arrived} of {self.size} ranks reached it within "
                    f"{waited:.0f}s. It is collective: {advice}")
            time.sleep(pause)
            pause = min(2 * pause, ARRIVAL_LAST_PAUSE_S)

    def shares_one_host(self) -> bool:
        """Whether every worker is on this host and reduces through shared memory."""
        return self.shared_memory is not None and self.shared_memory.group.cross is None

    def host_arena(self, tag: str, nbytes: int) -> torch.Tensor:
        """``nbytes`` of shared memory mapped by every worker of this host (each host its own segment
        where the job spans several, which then hold nothing in common).

        Collective: every worker calls it with the same ``tag`` and size. Each host's first rank
        creates its segment (named after the job, generation and tag, so the launcher removes it after
        a crash), and once every rank has mapped it its name is removed. Raises
        :class:`ConfigurationError` where the transport does not reduce through shared memory.
        """
        self.ensure_open("host_arena")
        executor = self.shared_memory
        if executor is None:
            raise ConfigurationError("shared memory between workers needs several workers on each host (as many on "
                                     "every host) and px.init(transport='auto' or 'shm').")
        host = executor.group.host_index
        name, key = f"{executor.group.name}-h{host}-{tag}", f"{self.prefix}arena/{host}/{tag}"
        mapping = created_by_first(executor.group.rank == 0, key, self.store, self.timeout_s,
                                   lambda create: shm.map_segment(name, nbytes, create))
        executor.run(executor.group.barrier)
        if executor.group.rank == 0:  # both names can serve the next arena...
            shm.unlink_segment(name)
            self.store.delete_key(key)
        executor.run(executor.group.barrier)  # ...once they are gone: nobody may find the old ones
        return torch.frombuffer(mapping, dtype=torch.uint8)

    def close(self) -> None:
        """End this generation: run its ``closing`` callbacks (newest first; the attachments' ``close``
        among them), stop its executors; later calls raise :class:`GenerationClosedError`.

        The process groups themselves are torn down by :mod:`phalanx.comm.runtime`, which owns the
        default group that the next generation replaces.
        """
        self.closed = True
        for stop in reversed(self.closing):
            stop()
        for executor in (self.shared_memory, self.messages):
            if executor is not None:
                executor.close()
        self.waits.close()


def created_by_first(first: bool, key: str, store: Any, timeout_s: float, open_segment: Callable[[bool], Any]) -> Any:
    """A host's shared segment: its first rank creates it (``open_segment(True)``) and then sets
    ``key``; the others wait for ``key`` and open it (``open_segment(False)``)."""
    if first:
        made = open_segment(True)
        store.set(key, "created")
        return made
    store.wait([key], datetime.timedelta(seconds=timeout_s))
    return open_segment(False)
