"""The elastic membership protocol, worker side: store keys, generations, heartbeats, aborts.

A worker of an elastic job (``phalanx run --min-workers K``) talks to the coordinator in the
launcher of node 0 through the rendezvous store: it pushes requests onto an inbox queue and waits
for an answer key; a watchdog thread beats a heartbeat key and watches the generation's "broken"
flag. When a generation breaks, the watchdog shuts down the group's Gloo sockets, so that a
collective pending on it fails at once, here and on the peers, not at the timeout.

Heartbeats and the generation's flags are :class:`Statements`: values sealed with the job's
secret, never counters. Anyone who reaches the store can bump a counter or write any value, so a
flag that an ``add`` could raise would let an outsider break generations at will, and a forged
value read by ``add`` cuts the reader's store connection (the server fails to parse it).
:mod:`phalanx.comm.runtime` builds process groups from the answers.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from phalanx import faults
from phalanx.comm import auth
from phalanx.comm.connections import own_connection
from phalanx.comm.sockets import shutdown_sockets, sockets_since
from phalanx.errors import AuthenticationError, CollectiveTimeoutError, WorkerFailedError

HEARTBEAT_INTERVAL_S = 0.25
WATCH_INTERVAL_S = 0.05
STATEMENT_READ_TIMEOUT_S = 5.0  # a statement seen by check() but deleted before get() (an outsider's doing)
START_TIMEOUT_S = 60.0  # generation 0 waits at least this long for workers still starting

logger = logging.getLogger(__name__)


class Keys:
    """The store keys of the elastic protocol, shared by workers and the launcher's coordinator."""

    PREFIX = "phalanx/elastic/"
    INBOX = PREFIX + "inbox"  # a queue of JSON messages to the coordinator
    STATUS = PREFIX + "status"  # "failed: <why>" once the job fell below its minimum
    COMPLETED = PREFIX + "completed"  # set once any worker exited with 0

    @staticmethod
    def answer(member: int, seq: int) -> str:
        return f"{Keys.PREFIX}answer/{member}/{seq}"

    @staticmethod
    def heartbeat(member: int) -> str:
        return f"{Keys.PREFIX}heartbeat/{member}"

    @staticmethod
    def kill(member: int) -> str:
        return f"{Keys.PREFIX}kill/{member}"

    @staticmethod
    def signal(generation: int) -> str:
        """Stated once generation ``generation`` should end (a failure, or joiners waiting)."""
        return f"{Keys.PREFIX}g{generation}/signal"

    @staticmethod
    def broken(generation: int) -> str:
        """Stated once generation ``generation`` lost a member: its collectives cannot complete."""
        return f"{Keys.PREFIX}g{generation}/broken"

    @staticmethod
    def boundary(generation: int) -> str:
        """The commit after which generation ``generation`` ends to admit joiners (agreed by compare_set)."""
        return f"{Keys.PREFIX}g{generation}/boundary"


class Statements:
    """What the job's processes tell each other through the store, sealed for its key with the job's
    secret: a generation broken or ending, a member's heartbeat count. A value that does not open (an
    outsider's) says nothing: :meth:`read` ignores it, with one warning per key. One per thread, on
    a connection of its own (a store client is not shared across threads), unless ``share`` says
    that the caller's thread owns ``store`` (then what it writes there and here stays in order)."""

    def __init__(self, store: Any, secret: auth.JobSecret, share: bool = False,
                 on_forged: Callable[[str], None] | None = None):
        self.store, self.secret = (store if share else own_connection(store)), secret
        if not share:  # a shared store keeps its owner's timeout
            self.store.set_timeout(datetime.timedelta(seconds=STATEMENT_READ_TIMEOUT_S))
        self._warned: set[str] = set()
        self._on_forged = on_forged if on_forged is not None else _log_forged

    def state(self, key: str, value: str = "1") -> None:
        self.store.set(key, self.secret.seal(key, value))

    def read(self, key: str) -> str | None:
        """The value stated at ``key``; ``None`` when nothing, or nothing sealed with the secret, is there."""
        if not self.store.check([key]):
            return None
        try:
            return self.secret.open(key, self.store.get(key))[0].decode()
        except AuthenticationError:
            if key not in self._warned:
                self._warned.add(key)
                self._on_forged(key)
        except (RuntimeError, OSError):  # deleted between check and get
            pass
        return None

    def holds(self, key: str) -> bool:
        return self.read(key) is not None

    def agree(self, key: str, proposed: str) -> str | None:
        """The value stated first at ``key``: ``proposed`` if nobody stated one before; ``None`` when
        the key holds a value without the secret (whoever wrote it first, it decides nothing)."""
        current = self.store.compare_set(key, "", self.secret.seal(key, proposed))
        try:
            return self.secret.open(key, current)[0].decode()
        except AuthenticationError:
            logger.warning("phalanx elastic: the value at %s does not carry the job's secret", key)
            return None


@dataclass(frozen=True)
class Membership:
    """One generation of an elastic job as this worker sees it.

    ``members`` are the launcher-assigned member ids in rank order; ``lost`` and ``joined``
    compare with the previous generation. ``event_time`` is the wall-clock time (on node 0) of
    the event that ended the previous generation: a member's loss, or the first request.
    """

    generation: int
    rank: int
    size: int
    members: tuple[int, ...]
    lost: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    reason: str = "start"
    event_time: float = 0.0


class MembershipClosed(WorkerFailedError):
    """The coordinator gave this worker no place in the job.

    ``reason`` is ``"below-min"`` (too few workers are left), ``"finished"`` (the job ended before
    this worker could join) or ``"excluded"`` (this worker was declared dead). ``save_checkpoint``
    is true on the one survivor chosen to save the last committed state.
    """

    def __init__(self, message: str, reason: str, save_checkpoint: bool = False):
        super().__init__(message)
        self.reason = reason
        self.save_checkpoint = save_checkpoint


class ElasticClient:
    """This worker's side of the protocol: requests, heartbeats, and aborting a broken generation."""

    def __init__(self, store: Any, member: int, secret: auth.JobSecret):
        self.store = store
        self.member = member
        self.secret = secret
        self.seq = 0
        self._lock = threading.Lock()
        self._generation = -1
        self._sockets: dict[str, int] = {}
        self._forming_since: dict[str, int] | None = None
        self._stops: list[Callable[[], None]] = []  # what else ends the tracked generation's waits
        self._aborted = -1
        self._stop = threading.Event()
        self.statements = Statements(store, secret)  # the main thread's
        self._watch_statements = Statements(store, secret)  # the watchdog thread's
        self._watch_statements.state(Keys.heartbeat(member), str(time.monotonic_ns()))
        self._thread = threading.Thread(target=self._watch, name="phalanx-elastic-watchdog", daemon=True)
        self._thread.start()

    def request(self, reason: str, generation: int, timeout_s: float) -> dict[str, Any]:
        """Ask the coordinator for a place in the generation after ``generation``; wait for the answer."""
        try:
            self.seq = int(self.store.add(f"{Keys.PREFIX}seq/{self.member}", 1))  # unique even after a re-init
            message = {"type": "request", "member": self.member, "seq": self.seq, "generation": generation,
                       "reason": reason, "time": time.time()}
            key = Keys.answer(self.member, self.seq)
            self.store.queue_push(Keys.INBOX, self.secret.seal(Keys.INBOX, json.dumps(message)))
            if reason != "start":
                faults.point("reform.request")
            self.store.wait([key], datetime.timedelta(seconds=timeout_s))
            from phalanx.comm.sealed_store import SealedStore  # a worker's: the launcher never needs torch's Store

            return dict(json.loads(SealedStore(self.store, self.secret, timeout_s).get(key)))
        except AuthenticationError as error:
            raise AuthenticationError(
                f"elastic rendezvous of member {self.member}: no answer to its request carries the job's secret "
                f"({error}); this worker was started with another secret than node 0's launcher.") from error
        except (RuntimeError, OSError) as error:
            raise CollectiveTimeoutError(
                f"elastic rendezvous of member {self.member} failed: no answer from the launcher's coordinator "
                f"within {timeout_s:.0f}s ({str(error).splitlines()[0][:200]}). Check that the launcher of node 0 "
                "is still running."
            ) from error

    def mark_broken(self, generation: int) -> None:
        """State that ``generation`` lost a member and should end (its peers' watchdogs abort it)."""
        self.statements.state(Keys.broken(generation))
        self.statements.state(Keys.signal(generation))  # members between collectives see it at commit

    def agree_boundary(self, generation: int, proposed: int) -> int | None:
        agreed = self.statements.agree(Keys.boundary(generation), str(proposed))
        return None if agreed is None else int(agreed)

    def broken(self, generation: int) -> bool:
        return self.statements.holds(Keys.broken(generation))

    def signalled(self, generation: int) -> bool:
        return self.statements.holds(Keys.signal(generation))

    def track(self, generation: int, sockets: dict[str, int], forming_since: dict[str, int] | None = None) -> None:
        """Remember the generation this worker is in now, and its group's connections; while the
        group forms (``forming_since``: the sockets open before), every connection opened since."""
        with self._lock:
            if generation != self._generation:
                self._stops = []
            self._generation, self._sockets, self._forming_since = generation, sockets, forming_since

    def stop_also(self, generation: int, stop: Callable[[], None]) -> None:
        """Call ``stop`` too when ``generation`` is aborted: it ends the waits no socket carries (on
        shared memory, a peer that left the generation alive is never found dead)."""
        with self._lock:
            if generation == self._generation:
                self._stops.append(stop)

    def abort(self, generation: int) -> None:
        """Shut down the connections of ``generation`` if it is the current one (once), and end its
        other waits."""
        with self._lock:
            if generation < 0 or generation != self._generation or self._aborted == generation:
                return
            self._aborted = generation
            since = self._forming_since
            shutdown_sockets(self._sockets if since is None else sockets_since(since))
            for stop in self._stops:
                stop()

    def _watch(self) -> None:
        last_beat = 0.0
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                now = time.monotonic()
                if now - last_beat >= HEARTBEAT_INTERVAL_S:
                    # a count that only grows, even across a re-init: an old beat replayed is no sign of life
                    self._watch_statements.state(Keys.heartbeat(self.member), str(time.monotonic_ns()))
                    last_beat = now
                generation = self._generation
                if generation >= 0 and self._aborted != generation and \
                        self._watch_statements.holds(Keys.broken(generation)):
                    self.abort(generation)
            except Exception:  # noqa: BLE001 - the store is gone (the launcher ended): nothing to watch
                self._stop.wait(1.0)

    def leave(self) -> None:
        """Tell the coordinator this worker is done: its silence from now on is not a failure."""
        try:
            self.store.queue_push(Keys.INBOX, self.secret.seal(Keys.INBOX, json.dumps({"type": "leave",
                                                                                      "member": self.member})))
        except (RuntimeError, OSError):
            pass  # the launcher reports the exit anyway

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


def _log_forged(key: str) -> None:
    """How a value without the secret is reported, unless the reader says otherwise (once per key)."""
    logger.warning("phalanx elastic: ignoring the value at %s: it does not carry the job's secret "
                   "(someone without it wrote there)", key)
