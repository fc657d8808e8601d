"""Horovod's negotiation: operations are matched across ranks by name, not by the order of the calls.

Ranks meet once per *cycle* and hand over what their process submitted since the last one: one record
per operation (its kind, process set, dtypes, shapes, reduction, root: plain data, never code),
encoded by :mod:`phalanx.comm.codec`'s safe way (JSON for such plain data: nothing received is
unpickled). Every rank then holds the same table and reaches the same decisions in the same order:

- an operation is *ready* when every member of its process set has submitted it; a rank inside
  ``hvd.join()`` counts as having submitted every allreduce, and reduces zeros;
- a ready operation whose records disagree (dtype, shape, op, root, kind), or that a joined rank
  cannot take part in, fails on every rank that submitted it with the same message; nothing is sent.
  The check is the collectives' own (:func:`phalanx.comm.agreement.verdict`), in the same words;
- the others are launched in the table's order, right after the cycle, on groups of their own, so they
  never interleave with the optimizer's buckets or the collectives the user's thread runs: the whole
  job's allreduces through a shared-memory group of the negotiation's own (a second segment beside
  the generation's, :func:`phalanx.comm.formation.shared_memory_beside`; across hosts hierarchical,
  each slice crossing by the measured algorithm), on the thread that ran the cycle, those of one cycle
  together (one buffer per op and dtype, up to HOROVOD_FUSION_THRESHOLD bytes); everything else, and a
  process set's operations, on Gloo groups of their own (one pair per process set);
- an operation that a rank waited for longer than the job's timeout (or HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)
  is *overdue*: that rank says so in the next cycle, and every rank fails it, and every other operation
  still waiting on any of its ranks, on every rank that submitted them, with one report (who submitted
  each, who did not). As with Horovod's stall check, the verdict is the same everywhere: no rank later
  matches an operation that another rank has given up on (a barrier never passes on one rank and times
  out on another). Before that, a rank that has waited HOROVOD_STALL_CHECK_TIME_SECONDS (60 s) logs a
  warning naming the ranks that have not submitted it, as Horovod's stall check does;
- ``hvd.join()`` is told to every rank in a cycle before the joined rank goes on (see :meth:`Negotiator.join`),
  so the cycles order the joins: the rank whose join completed the set is the last to join, the same on
  every rank (the highest of those whose joins came in that one cycle).

Where every rank is on this host, a cycle is one arrival in the negotiation's shared memory (each rank
writes its message, then reads everyone's), and any thread of the process may run it: a caller that
waits in ``synchronize`` runs the cycles itself while it waits (it holds the *baton*), so that a lone
operation needs no hand-off between threads; the background thread runs them when nobody waits here
(operations in flight, or a peer that started a cycle), leaving one that falls due to a caller that
just submitted for a couple of milliseconds. A lone allreduce of one CPU tensor over the whole job
*folds*: its data travels in the very arrival of its cycle, with a fingerprint of its name and record
in place of the message, and where every rank folded the same one each reduces at once (one arrival,
as ``px.allreduce`` takes); otherwise nothing is reduced, the ranks that folded send their messages in
one more arrival, and the operation goes on as any other (a disagreement is named on every rank as
before). Idle, the thread sleeps on its doorbell, a word of that shared memory: a rank that arrives for
a cycle and finds a rank missing once it has spun rings it, and a submission rings it while it naps
(right after a submission it looks every millisecond instead, unrung).

On several hosts the cycles run on the background thread, as one allgather over a Gloo group of their
own, and idle threads wait on the same numbered key of the job's store (a doorbell) that a rank with
news (a submission, a join, leaving) sets. Either way a rank waiting in ``synchronize`` has a cycle run
once a second, so a peer that died shows as a failed cycle within a second, and cycles cost nothing
while nothing moves. Where the job has no store (a process group made by someone else), idle threads
poll instead, backing off to 10 ms. HOROVOD_CYCLE_TIME sets the shortest time from one cycle's start
to the next's (Horovod's cycle time; none by default), so that operations submitted meanwhile travel
together.

Each generation of the job has its own negotiator, kept on its communicator (:func:`opened`), whose
end (``hvd.shutdown()``, an elastic re-form, the process's exit) closes it. Leaving is collective,
like MPI's finalize: a rank that leaves keeps taking part in the cycles until every rank has left
(at most the job's timeout), so the others may go on with operations that do not need it; those
that need it fail on every rank that submitted them, naming it. A lost peer fails every waiting operation with
:class:`HorovodTimeoutError`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from phalanx.comm import agreement, codec, collectives, formation, runtime, shm, wire
from phalanx.comm.communicator import Attachment, Communicator
from phalanx.comm.connections import own_connection
from phalanx.comm.handles import done
from phalanx.errors import PhalanxError
from phalanx.horovod.torch.exceptions import HorovodInternalError, HorovodMismatchError, HorovodTimeoutError
from phalanx.horovod.torch.process_sets import new_scope
from phalanx.horovod.torch.variables import Settings
from phalanx.parallel.buckets import DEFAULT_FUSION_THRESHOLD_MB

logger = logging.getLogger(__name__)

SLOT = 1024  # bytes of each rank's records that travel in a cycle's first allgather (over Gloo)
MESSAGE_BYTES = 64 << 10  # shared memory: each rank's room for its records in one arrival of a cycle
IDLE_WAIT_S = 1.0  # shared memory: the longest sleep of an idle thread on its doorbell before it looks again
CALLER_GRACE_S = 2e-3  # shared memory: how long the thread leaves a due cycle to this rank's active callers
ACTIVE_S = 0.01  # shared memory: callers count as active this long after a submission...
ACTIVE_POLL_S = 1e-3  # ...and meanwhile the thread looks this often, unrung
MAX_PAUSE_S = 0.01  # without a store: the longest sleep between idle cycles
BELL_WAIT = datetime.timedelta(days=1)  # a doorbell wait's timeout: rung long before (torch logs each one)
LIVENESS_S = 1.0  # a rank that waits for an operation rings a cycle this often, to notice a dead peer
JOINABLE = ("allreduce", "grouped_allreduce")  # what a joined rank takes part in, with zeros
NOTHING = torch.empty(0, dtype=torch.uint8)  # the message of a rank with no news
EXCHANGING, FOLDING = -1, -2  # shared memory: a cycle's record, first word (a collective's record starts at 0 or more)
EXCHANGE = (EXCHANGING, 0, 0, 0)  # the record of a rank that only exchanges its message in a cycle's arrival
Key = tuple[int, str]  # (process set id, operation name)
Record = dict[str, Any]
Launch = Callable[[], Any]  # starts the collectives of one operation; returns what to wait on (or None)


@dataclass
class Fold:
    """How an allreduce of one CPU tensor over the whole job can travel in the very arrival of the cycle
    that agrees on it (see :meth:`Negotiator._folded`): ``prepare`` gives the tensor to reduce in place
    (the same whenever it is called again: the fold may be refused and the operation launched later),
    ``op`` the reduction sent, ``plan`` how its dtype travels, ``output`` what the operation's launch
    would have given once waited for."""

    prepare: Callable[[], torch.Tensor]
    op: str
    plan: wire.Reduction
    output: Any


@dataclass
class Submission:
    """One operation of this rank: what it tells the others, and how to start it once agreed (``fold``:
    how its data may go with the agreement instead)."""

    key: Key
    record: Record
    launch: Launch
    fold: Fold | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    @functools.cached_property
    def fingerprint(self) -> list[int]:
        """The record of a cycle's arrival that folds this operation: its name and record, hashed (a
        collision of 192 bits is what it would take for two different operations to pass for one)."""
        digest = hashlib.blake2b(repr((self.key, self.record)).encode(), digest_size=24).digest()
        return [FOLDING, *(int.from_bytes(digest[k: k + 8], "little", signed=True) for k in (0, 8, 16))]


class Negotiated:
    """What ``synchronize`` waits on: the agreement, then the collectives it launched."""

    def __init__(self, negotiator: Negotiator, submission: Submission):
        self.negotiator, self.submission = negotiator, submission

    def wait(self) -> Any:
        launched = self.negotiator.launched(self.submission)
        return None if launched is None else launched.wait()

    def is_completed(self) -> bool:
        future = self.submission.future
        if not future.done():
            return False
        if future.exception() is not None:
            return True
        launched = future.result()
        return launched is None or bool(launched.is_completed())


class _AllLeft(Exception):
    """Every rank has left: the negotiation ends."""


class _NotFolded(Exception):
    """Not every rank folded the same operation into a cycle's arrival: the cycle goes on as an exchange."""


class Negotiator:
    """The negotiation of one generation of the job (see the module's docstring)."""

    def __init__(self, communicator: Communicator, set_scope: Callable[[int], collectives.Scope | None],
                 settings: Settings):
        self.communicator, self.set_scope = communicator, set_scope
        self.stand_in: Callable[[Record], Launch] | None = None  # while this rank is joined (join)
        self.closed = False
        self.rank, self.size, self.timeout_s = communicator.rank, communicator.size, communicator.timeout_s
        self.stall_s = settings.stall_shutdown_s or self.timeout_s  # an operation waited for longer is overdue
        self.stall_warning_s, self.cycle_time_s = settings.stall_warning_s, settings.cycle_time_s
        threshold_mb = settings.fusion_threshold_mb
        # HOROVOD_FUSION_THRESHOLD: the most bytes of allreduces agreed in one cycle that travel together
        self.fusion_bytes = int((DEFAULT_FUSION_THRESHOLD_MB if threshold_mb is None else threshold_mb) * 2**20)
        self._whole_job = new_scope(list(range(self.size)))
        self._stand_ins: list[Any] = []  # a joined rank's zeros in flight
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._outbox: list[Submission] = []
        self._overdue: list[Submission] = []  # waited for past the timeout here: every rank is told next cycle
        self._join_requested = self._leaving = self._wanted = False  # _wanted: a cycle, even with nothing to say
        self._left: set[int] = set()  # ranks that have left (hvd.shutdown())
        self._mine: dict[Key, Submission] = {}  # submitted here, not settled yet
        self._table: dict[Key, dict[int, Record]] = {}  # the same on every rank, in order of first sight
        self._joined: set[int] = set()  # ranks inside hvd.join()
        self._join: concurrent.futures.Future | None = None  # every rank has joined: the last one
        self._join_told: concurrent.futures.Future | None = None  # this rank's join went out in a cycle
        self._ended: PhalanxError | None = None
        self._thread: threading.Thread | None = None
        self._baton = threading.Lock()  # held by the thread of this process that runs cycles now
        self._submitted = -math.inf  # when a caller here last submitted (it is likely to wait at once)
        self._napping = False  # the thread sleeps on the doorbell for long: a submission rings it
        self._started = -math.inf  # when the last cycle started (HOROVOD_CYCLE_TIME)
        # Shared memory of the negotiation's own (the generation's shape: hierarchical across hosts), which
        # the whole job's agreed allreduces go through; on one host the cycles and the doorbell too.
        self._channel = formation.shared_memory_beside(communicator, "horovod", MESSAGE_BYTES) if self.size > 1 \
            else None
        self._local = self._channel is not None and self._channel.cross is None
        if self._channel is not None and self._whole_job is not None:
            self._whole_job = dataclasses.replace(self._whole_job, shared_memory=self._channel)
        store = communicator.store if self.size > 1 and not self._local and hasattr(communicator.store, "clone") \
            else None
        # The store's doorbell (several hosts): one connection for the thread's waits, one for the callers' rings.
        self._bell = (own_connection(store), own_connection(store)) if store is not None else None
        self._bell_prefix, self._bells, self._armed = f"{communicator.prefix}horovod/bell/", 0, ""
        if self.size > 1:  # alone, every operation is agreed as it is submitted
            if not self._local:
                self._control = dist.new_group(list(range(self.size)), backend="gloo",
                                               timeout=datetime.timedelta(seconds=self.timeout_s))
            self._thread = threading.Thread(target=self._serve, name="phalanx-horovod-negotiation", daemon=True)
            self._thread.start()
            logger.debug("horovod negotiation on rank %d: cycles %s, the job's allreduces through %s", self.rank,
                         "in shared memory" if self._local else "over Gloo",
                         "shared memory of its own" if self._channel is not None else "Gloo")

    # --- the caller's side --------------------------------------------------------------------

    def submit(self, submission: Submission) -> Negotiated:
        """Queue ``submission`` for the next cycle; its handle completes once every rank agreed."""
        if self._thread is None:
            self._table[submission.key] = {self.rank: submission.record}
            self._mine[submission.key] = submission
            self._settle_ready()
            return Negotiated(self, submission)
        with self._lock:
            if self._ended is not None:
                submission.future.set_exception(self._ended)
            else:
                self._outbox.append(submission)
                self._submitted = time.monotonic()
                if self._napping or not self._local:  # otherwise the thread looks within CALLER_GRACE_S anyway
                    self._ring()
        return Negotiated(self, submission)

    def join(self, stand_in: Callable[[Record], Launch]) -> concurrent.futures.Future:
        """Declare this rank joined, and return once a cycle has told every rank so; the future
        completes, with the rank that joined last, once every rank has. Meanwhile this rank takes part
        in the others' allreduces with what ``stand_in`` launches for their records.

        Returning only once the join went out orders the joins by cycle: whatever this rank does next
        (``collectives.join()``, which answers the others' gradient buckets) happens after, so a rank
        that gets past a collective thanks to this join joins in a later cycle than this one."""
        with self._lock:
            self.stand_in = stand_in
            future: concurrent.futures.Future = concurrent.futures.Future()
            told: concurrent.futures.Future = concurrent.futures.Future()
            if self._thread is None:
                future.set_result(self.rank)
                return future
            if self._ended is not None:
                future.set_exception(self._ended)
                return future
            self._join, self._join_told, self._join_requested = future, told, True
            self._ring()
        if not self._awaited(told, self.timeout_s):
            raise HorovodTimeoutError(f"hvd.join() on rank {self.rank}: the negotiation did not run a cycle within "
                                      f"{self.timeout_s:.0f}s to tell the other ranks.")
        told.result()  # the negotiation's error, if it ended meanwhile
        return future

    def all_joined(self, joined: concurrent.futures.Future) -> int:
        """Wait for :meth:`join`'s future: every rank has joined (or the negotiation's error). Returns
        the rank whose join completed the set (the highest, where several came in that cycle)."""
        if not self._awaited(joined, self.timeout_s):
            raise HorovodTimeoutError(f"hvd.join() on rank {self.rank}: not every rank joined within "
                                      f"{self.timeout_s:.0f}s; rank(s) {sorted(set(range(self.size)) - self._joined)} "
                                      "did not call hvd.join().")
        return int(joined.result())

    def launched(self, submission: Submission) -> Any:
        """What ``submission`` launched, once agreed; its error. Not agreed within the stall check's
        time, a warning names the ranks that have not submitted it; not within the stall shutdown time
        (the job's timeout by default), it is declared overdue and the next cycle settles it on every
        rank alike (see :meth:`_stall`); a timeout naming the missing ranks only if the negotiation does
        not answer at all."""
        kind, name = submission.record["kind"], submission.key[1]
        waited = 0.0
        if self.stall_warning_s is not None and self.stall_warning_s < self.stall_s:
            waited = self.stall_warning_s
            if not self._awaited(submission.future, waited):
                logger.warning(
                    "rank %d has waited %gs for %s '%s': rank(s) %s have not submitted it yet. Every rank of the "
                    "process set must submit it; it fails after %gs.", self.rank, waited, kind, name,
                    self._missing(submission), self.stall_s)
        if not submission.future.done() and not self._awaited(submission.future, self.stall_s - waited):
            with self._lock:
                self._overdue.append(submission)
                self._ring()
            self._awaited(submission.future, self.timeout_s)
        if submission.future.done():
            return submission.future.result()
        raise HorovodTimeoutError(
            f"{kind} '{name}' on rank {self.rank}: rank(s) {self._missing(submission)} did not submit an operation "
            f"of that name within {self.stall_s:.0f}s. Every rank of the process set must submit it (names are "
            "matched across ranks; an unnamed operation is named by its kind and how many of that kind the set had "
            "since the last barrier, join or init).")

    def _missing(self, submission: Submission) -> list[int]:
        """The ranks of ``submission``'s process set that this rank has not seen submit it."""
        return sorted(set(submission.record["ranks"]) - set(self._table.get(submission.key, {})))

    def _awaited(self, future: concurrent.futures.Future, seconds: float) -> bool:
        """Whether ``future`` completed within ``seconds``. Each second without, a cycle is rung: a
        peer that died meanwhile fails it at once instead of after the timeout.

        With shared memory on one host the waiting thread runs the cycles itself while no other thread
        of this process does (:meth:`_drive`): a lone operation is agreed and launched on the caller's
        thread, with no hand-off between threads (a lone allreduce's data in the same arrival:
        :meth:`_folded`)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if future.done():
                return True
            if self._local and self._ended is None and self._baton.acquire(blocking=False):
                try:
                    self._drive(future, deadline)
                finally:
                    self._let_go()
                continue
            try:
                future.exception(timeout=min(LIVENESS_S, left))
                return True
            except concurrent.futures.TimeoutError:
                self._want_cycle()
        return future.done()

    def _want_cycle(self) -> None:
        """Have a cycle run soon even with nothing to say (a waiter's check that its peers live)."""
        with self._lock:
            self._wanted = True
            self._ring()

    def close(self) -> None:
        """Leave, and take part in the cycles until every rank has (at most the job's timeout). The
        generation's end calls it (the communicator holds this negotiator, see :func:`opened`)."""
        with self._lock:
            self.closed = self._leaving = True
            self._ring()
        if self._thread is not None and threading.current_thread() is not self._thread:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                logger.warning("hvd.shutdown() on rank %d: rank(s) %s did not shut down Horovod within %.0fs; "
                               "leaving without them.", self.rank, sorted(set(range(self.size)) - self._left),
                               self.timeout_s)
        if self._channel is not None:
            self._channel.abort()  # a cycle still waiting gives up
            if self._thread is None or not self._thread.is_alive():
                self._channel.close()  # else its memory stays mapped until the process exits: a wait may still read it

    def scope(self, set_id: int) -> collectives.Scope | None:
        """The groups the operations of process set ``set_id`` run on (0: the whole job; ``None``
        in a world of one, where every collective completes at once)."""
        return self._whole_job if set_id == 0 else self.set_scope(set_id)

    # --- the background thread ----------------------------------------------------------------

    def _ring(self) -> None:
        """Wake this rank's thread, and through the store every rank's (under the lock: a caller has news)."""
        if self._local:
            assert self._channel is not None
            self._channel.ring([self.rank])
        elif self._bell is None:
            self._wake.set()
        elif self._armed:
            self._bell[1].set(self._armed, "1")
            self._armed = ""

    def _serve(self) -> None:
        if self._local:
            self._serve_locally()
            return
        pause = 0.0
        while self._ended is None:
            moved = self._cycle()
            if self._ended is not None:
                return
            if self._bell is not None:
                self._idle(self._bell[0])
            elif not moved:
                pause = min(max(2 * pause, 1e-4), MAX_PAUSE_S)
                self._wake.wait(pause)
                self._wake.clear()
            else:
                pause = 0.0

    def _serve_locally(self) -> None:
        """The thread's part on one host: whenever a cycle is due (news here, or a peer waiting in one)
        and no other thread of this process runs them, run them; between, sleep on the doorbell, which
        a peer rings when it starts a cycle without this rank and a caller here when it has news."""
        channel = self._channel
        assert channel is not None
        due_since = math.inf  # since when a cycle has been due without this thread taking it
        while self._ended is None:
            seen, now = channel.bell(), time.monotonic()
            active = now - self._submitted < ACTIVE_S  # a caller here is likely to wait soon, and run the cycle
            if not self._due():
                due_since = math.inf
                if active:  # look again soon, so that the callers' submissions need no ring
                    channel.wait_bell(seen, ACTIVE_POLL_S)
                else:
                    self._nap(seen)
                continue
            due_since = min(due_since, now)
            if active and now - due_since < CALLER_GRACE_S:
                channel.wait_bell(seen, due_since + CALLER_GRACE_S - now)
            elif self._baton.acquire(blocking=False):
                try:
                    self._drive(None, math.inf)
                finally:
                    self._let_go()
                due_since = math.inf
            else:
                channel.wait_bell(seen, IDLE_WAIT_S)  # the thread that holds the baton rings when it lets go

    def _nap(self, seen: int) -> None:
        """Sleep on the doorbell for up to :data:`IDLE_WAIT_S`; a submission meanwhile rings it."""
        with self._lock:
            self._napping = not self._outbox  # one submitted before this is seen here, one after rings
        if self._napping:
            assert self._channel is not None
            self._channel.wait_bell(seen, IDLE_WAIT_S)
        with self._lock:
            self._napping = False

    def _due(self) -> bool:
        """Whether a cycle should run now (shared memory): news here, or a peer already in one."""
        assert self._channel is not None
        return bool(self._outbox or self._overdue or self._join_requested or self._leaving or self._wanted) \
            or self._channel.ahead()

    def _drive(self, future: concurrent.futures.Future | None, deadline: float) -> None:
        """Run the cycles on this thread (which holds the baton) whenever one is due: until ``future`` is
        done, or, without one, until none is due; at most until ``deadline``. A caller waiting this way
        has a cycle run after each :data:`LIVENESS_S` without one, so that a peer that died is noticed."""
        channel = self._channel
        assert channel is not None
        quiet_since = time.monotonic()
        while self._ended is None and (future is None or not future.done()):
            seen = channel.bell()
            if self._due():
                self._cycle()
                quiet_since = time.monotonic()
                continue
            now = time.monotonic()
            if future is None or now >= deadline:
                return
            if now - quiet_since >= LIVENESS_S:
                self._wanted = True
                continue
            channel.wait_bell(seen, min(deadline, quiet_since + LIVENESS_S) - now)

    def _let_go(self) -> None:
        """Release the baton; where a cycle is still due, ring this rank's doorbell so that the thread
        (or another waiting caller) takes it up."""
        self._baton.release()
        if self._ended is None and self._due():
            with self._lock:
                self._ring()

    def _cycle(self) -> bool:
        """One cycle, no sooner than HOROVOD_CYCLE_TIME after the last one started. Whether anything
        moved; a failure ends the negotiation, and every waiter hears of it."""
        now = time.monotonic()
        if now < self._started + self.cycle_time_s:
            time.sleep(self._started + self.cycle_time_s - now)
            now = time.monotonic()
        self._started = now
        try:
            return self._one_cycle()
        except _AllLeft:
            self._end(HorovodInternalError(f"Horovod was shut down on rank {self.rank}: call hvd.init() first."))
        except Exception as failure:  # noqa: BLE001 - a lost peer, a torn-down group: every waiter hears of it
            logger.debug("horovod negotiation on rank %d ended", self.rank, exc_info=True)
            self._end(HorovodTimeoutError(
                f"Horovod's negotiation on rank {self.rank} failed: a peer died or stopped answering "
                f"({str(failure).splitlines()[0] if str(failure) else type(failure).__name__})."))
        return False

    def _idle(self, bell: Any) -> None:
        """Wait on this round's doorbell key until a rank with news rings it (every rank's thread
        waits on the same key after each cycle; a rank that has news already rings at once)."""
        key = f"{self._bell_prefix}{self._bells}"
        if self.rank == 0 and self._bells:
            bell.delete_key(f"{self._bell_prefix}{self._bells - 1}")  # every thread is past it
        self._bells += 1
        with self._lock:
            news = bool(self._outbox or self._overdue) or self._join_requested or self._leaving or self._wanted
            self._armed = "" if news else key
        if news:
            bell.set(key, "1")
        while not _rung(bell, key):
            pass
        with self._lock:
            self._armed = ""

    def _one_cycle(self) -> bool:
        """Exchange what is new, update the shared table, settle what is ready (or fold a lone
        allreduce: :meth:`_folded`). Whether anything moved."""
        with self._lock:
            outgoing, self._outbox = self._outbox, []
            overdue, self._overdue = self._overdue, []
            joining, self._join_requested = self._join_requested, False
            leaving, self._leaving = self._leaving, False  # said once
            self._wanted = False
        for submission in outgoing:
            self._mine[submission.key] = submission
        message: dict[str, Any] = {}
        if outgoing:
            message["ops"] = [[s.key[0], s.key[1], s.record] for s in outgoing]
        overdue = [s for s in overdue if self._mine.get(s.key) is s]  # not settled since its caller gave up
        if overdue:
            message["overdue"] = [list(s.key) for s in overdue]
        if joining:
            message["join"] = 1
        if leaving:
            message["leave"] = 1
        lone = self._foldable(outgoing, message)
        if lone is not None:
            exchanged = self._folded(lone, lambda: _encoded(message))
            if exchanged is None:
                return True  # every rank agreed on it and its data went with the agreement
        else:
            exchanged = self._exchange(_encoded(message))
        received = [codec.decode(raw, safe=True) if raw else {} for raw in exchanged]
        for rank, news in enumerate(received):
            self._take(rank, news)
        if joining and self._join_told is not None:
            self._join_told.set_result(None)
        if len(self._left) == self.size:
            raise _AllLeft()
        settled = self._settle_ready()  # first: an operation agreed in the cycle that declares it overdue runs
        stalled = self._stall([(set_id, name) for news in received for set_id, name in news.get("overdue", [])])
        self._finish_join([rank for rank, news in enumerate(received) if news.get("join")])
        return settled or stalled or any(received)

    def _take(self, rank: int, message: dict[str, Any]) -> None:
        for set_id, name, record in message.get("ops", []):
            self._table.setdefault((set_id, name), {})[rank] = record
        if message.get("join"):
            self._joined.add(rank)
        if message.get("leave"):
            self._left.add(rank)

    def _exchange(self, payload: torch.Tensor) -> list[bytes]:
        """Every rank's ``payload`` (uint8). On one host, one arrival in the negotiation's shared memory
        (more only for records past :data:`MESSAGE_BYTES`). Otherwise one allgather of a slot holding its
        length and its first bytes, a second of the rest only when some rank's does not fit; the slots are
        filled and read through numpy, which costs a cycle microseconds less than indexing tensors."""
        if self._local:
            assert self._channel is not None
            messages, records = self._channel.exchange(memoryview(payload.numpy()), "negotiating", EXCHANGE)
            if any(row[0] == FOLDING for row in records):  # a fold that was not every rank's: its messages follow
                later, _ = self._channel.exchange(b"", "negotiating", EXCHANGE)
                messages = [sooner or then for sooner, then in zip(messages, later)]
            return messages
        room, length = SLOT - 8, len(payload)
        slot = torch.zeros(SLOT, dtype=torch.uint8)
        mine = slot.numpy()
        mine[:8] = np.frombuffer(length.to_bytes(8, "little"), dtype=np.uint8)
        mine[8:8 + min(length, room)] = payload.numpy()[:room]
        slots = self._gather(slot)
        lengths = [int.from_bytes(theirs.numpy()[:8].tobytes(), "little") for theirs in slots]
        longest = max(lengths) - room
        if longest > 0:
            rest = torch.zeros(longest, dtype=torch.uint8)
            rest.numpy()[:max(length - room, 0)] = payload.numpy()[room:]
            slots = [torch.cat([theirs, tail]) for theirs, tail in zip(slots, self._gather(rest))]
        return [theirs[8:8 + n].numpy().tobytes() for theirs, n in zip(slots, lengths)]

    def _foldable(self, outgoing: list[Submission], message: dict[str, Any]) -> Submission | None:
        """The operation whose data this rank folds into the cycle's arrival (shared memory on one host,
        no rank joined): its only news when that is an operation that can fold; or, with no news, one of
        its own already sent whose fold every rank already in this arrival has started (it went out in a
        cycle that some rank spent on something else, and that rank now folds it)."""
        if not self._local or self._joined:
            return None
        if message:
            lone = outgoing[0] if len(outgoing) == 1 and len(message) == 1 else None
            return lone if lone is not None and lone.fold is not None else None
        assert self._channel is not None
        there = [row for row in self._channel.arrived_records(4) if row is not None]
        if not there or there[0][0] != FOLDING or any(row != there[0] for row in there):
            return None
        return next((mine for mine in self._mine.values() if mine.fold is not None and mine.fingerprint == there[0]),
                    None)

    def _folded(self, submission: Submission, payload: Callable[[], torch.Tensor]) -> list[bytes] | None:
        """Try the cycle of a lone foldable operation as one arrival that carries its data and, as the
        check, its fingerprint (:attr:`Submission.fingerprint`) instead of this rank's message: where
        every rank folded the same, each reduces the data right away (what agreeing, then launching,
        would have done, one arrival sooner, and without encoding a message) and ``None`` is returned.
        Otherwise nothing is reduced; every rank saw a folding record, so in one more arrival the ranks
        that folded send their ``payload`` (the others nothing: theirs came in the first), and every
        rank's message is returned. The operation then runs as any other, so a disagreement is still
        named on every rank."""
        assert self._channel is not None and submission.fold is not None
        mine = submission.fingerprint

        def judge(rows: list[list[int]]) -> bool:
            if any(row != mine for row in rows):
                raise _NotFolded()
            return True

        try:
            self._reduced([submission], (mine, judge))
        except _NotFolded:  # the others read an empty message from this rank: it sends its own now
            logger.debug("rank %d: not every rank folded %s '%s' into this cycle; it runs after its cycle",
                         self.rank, submission.record["kind"], submission.key[1])
            sooner = self._channel.exchanged(b"", "negotiating")
            later, _ = self._channel.exchange(memoryview(payload().numpy()), "negotiating", EXCHANGE)
            return [first or then for first, then in zip(sooner, later)]
        del self._mine[submission.key]
        self._table.pop(submission.key, None)  # sent before: every rank that holds its record folded it too
        return None

    def _reduced(self, group: list[Submission], agreement: shm.Agreement | None = None) -> None:
        """Reduce the data of ``group`` (operations that can fold, of one op and wire dtype) as one flat
        buffer through the negotiation's shared memory, on this thread, as the collectives would each
        (averaged by dividing the sum, each dtype as :mod:`phalanx.comm.wire` moves it), and complete their
        futures. ``agreement``: a check that travels with the first arrival (a fold's); where it raises,
        nothing is reduced and no future completes."""
        folds = [submission.fold for submission in group if submission.fold is not None]
        assert self._channel is not None and len(folds) == len(group)
        op, plan = folds[0].op, folds[0].plan
        prepared = [fold.prepare() for fold in folds]
        wires = [plan.encode(tensor) for tensor in prepared]
        flat = wires[0].view(-1) if len(wires) == 1 else torch.cat([wire.reshape(-1) for wire in wires])
        if agreement is None:
            self._channel.allreduce_(flat, op, "auto")
        else:
            self._channel.allreduce_(flat, op, "auto", agreement, b"")
        if op == "avg":
            flat.div_(self.size)  # as the collectives average
        pieces = wires if len(wires) == 1 else [piece.view(wire.shape) for piece, wire in
                                                 zip(flat.split([wire.numel() for wire in wires]), wires)]
        for submission, fold, tensor, piece in zip(group, folds, prepared, pieces):
            plan.decode(piece, tensor)
            submission.future.set_result(done(fold.output, True))

    def _gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``mine`` (all of the same size)."""
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(everyone, mine, group=self._control)
        return everyone

    def _settle_ready(self) -> bool:
        """Settle every operation that is ready, in the table's order; the agreed allreduces that could
        each have folded (:class:`Fold`: the same on every rank, since it follows from what they agreed
        on) travel together afterwards, one reduction per op and wire dtype (:meth:`_reduced`) of at most
        HOROVOD_FUSION_THRESHOLD bytes (a larger tensor alone; 0: each alone)."""
        together: dict[tuple[str, torch.dtype], list[list[Submission]]] = {}
        settled = False
        for key in list(self._table):
            records = self._table[key]
            first = next(iter(records.values()))
            missing = [r for r in first["ranks"] if r not in records]
            if any(r not in self._joined and r not in self._left for r in missing):
                continue  # a rank that is still running has not submitted it yet
            del self._table[key]
            settled = True
            mine = self._mine.pop(key, None)
            gone = [r for r in missing if r in self._left]
            error = _disagreement(key, records, missing, gone, self.rank, mine.record["kind"] if mine else None)
            if mine is not None and mine.fold is not None and error is None and not missing \
                    and self._channel is not None:
                groups = together.setdefault((mine.fold.op, mine.fold.plan.dtype), [[]])
                if groups[-1] and sum(_nbytes(s) for s in groups[-1]) + _nbytes(mine) > self.fusion_bytes:
                    groups.append([])
                groups[-1].append(mine)
            else:
                self._settle(key, records, missing, mine, error)
        for group in (group for groups in together.values() for group in groups):
            try:
                self._reduced(group)
            except Exception as failure:  # noqa: BLE001 - each caller's synchronize raises it
                for submission in group:
                    submission.future.set_exception(failure)
        return settled

    def _stall(self, overdue: list[Key]) -> bool:
        """Fail the ``overdue`` operations still waiting, and every other operation waiting on any of
        their ranks, on every rank that submitted them, with one report (the same on every rank: the
        table is): those ranks disagree on what to submit, so none of it may be matched later by a
        rank that gave up meanwhile. Whether any failed."""
        ranks = {rank for key in overdue if key in self._table for rank in _members(self._table[key])}
        if not ranks:
            return False
        stalled = [key for key in self._table if ranks & set(_members(self._table[key]))]
        report = "; ".join(_described(key, self._table[key]) for key in stalled)
        for key in stalled:
            del self._table[key]
            mine = self._mine.pop(key, None)
            if mine is not None:
                mine.future.set_exception(HorovodTimeoutError(
                    f"{mine.record['kind']} '{key[1]}' on rank {self.rank}: the ranks did not submit the same "
                    f"operations within {self.timeout_s:.0f}s: {report}. Each fails on every rank that submitted "
                    "it. Every rank of the process set must submit an operation (names are matched across ranks; "
                    "an unnamed operation is named by its kind and how many of that kind the set had since the "
                    "last barrier, join or init)."))
        return True

    def _settle(self, key: Key, records: dict[int, Record], joined: list[int], mine: Submission | None,
                error: HorovodMismatchError | None) -> None:
        """Launch an operation every rank of its set has submitted (or take part with zeros, joined),
        or fail it with ``error``, the records' disagreement; ``joined``: the ranks that did not submit
        it; ``mine``: this rank's submission of it, if any."""
        if mine is not None:
            if error is not None:
                mine.future.set_exception(error)
                return
            try:
                with collectives.within(self.scope(key[0])):
                    mine.future.set_result(mine.launch())
            except Exception as failure:  # noqa: BLE001 - the caller's synchronize raises it
                mine.future.set_exception(failure)
        elif self.rank in joined and error is None:
            assert self.stand_in is not None  # given by join()
            try:
                with collectives.within(self.scope(key[0])):
                    self._stand_ins.append(self.stand_in(next(iter(records.values())))())
            except Exception:  # noqa: BLE001 - the others see the failure in their own collective
                logger.warning("rank %d could not take part with zeros in %s", self.rank, key[1], exc_info=True)

    def _finish_join(self, joined_now: list[int]) -> None:
        """Once every rank has joined (``joined_now`` completed the set in this cycle), wait for this
        rank's zeros in flight and tell its ``join()`` the last rank to join: the highest of ``joined_now``."""
        if len(self._joined) < self.size:
            return
        self._joined.clear()
        for work in self._stand_ins:
            work.wait()
        self._stand_ins.clear()
        with self._lock:
            future, self._join, self._join_told = self._join, None, None
        if future is not None:
            future.set_result(max(joined_now))

    def _end(self, error: PhalanxError) -> None:
        with self._lock:
            self._ended = error
            waiting = [*self._mine.values(), *self._outbox]
            self._mine, self._outbox = {}, []
            futures = [self._join, self._join_told]
            self._join = self._join_told = None
        for submission in waiting:
            if not submission.future.done():
                submission.future.set_exception(error)
        for future in futures:
            if future is not None and not future.done():
                future.set_exception(error)
        if self._local:  # the thread, asleep on the doorbell, sees the end and stops
            assert self._channel is not None
            self._channel.ring([self.rank])


def _nbytes(submission: Submission) -> int:
    """The bytes of a single-tensor operation's tensor, from its agreed record."""
    dtype = getattr(torch, submission.record["dtypes"][0].removeprefix("torch."))
    return math.prod(submission.record["shapes"][0]) * dtype.itemsize


def _encoded(message: dict[str, Any]) -> torch.Tensor:
    """A cycle's ``message`` as bytes, or none when there is no news. The safe codec: a message is plain
    data (dicts, lists, strings, numbers), which it sends as JSON: a peer's bytes never run code here,
    for tens of microseconds a cycle more than pickle (benchmarks/RESULTS.md); a folded cycle sends none."""
    return codec.encode(message, safe=True) if message else NOTHING


def _rung(bell: Any, key: str) -> bool:
    """Whether ``key`` was set within :data:`BELL_WAIT` (a store that fails otherwise raises)."""
    try:
        bell.wait([key], BELL_WAIT)
    except RuntimeError as error:
        if "timeout" not in str(error).lower():
            raise
        return False
    return True


def _members(records: dict[int, Record]) -> list[int]:
    """The ranks of the process set an operation belongs to."""
    return list(next(iter(records.values()))["ranks"])


def _described(key: Key, records: dict[int, Record]) -> str:
    """An operation still waiting, for a stall report: who submitted it and who did not."""
    missing = [rank for rank in _members(records) if rank not in records]
    return (f"{next(iter(records.values()))['kind']} '{key[1]}' (submitted by rank(s) {sorted(records)}, "
            f"rank(s) {missing} did not submit it)")


def _disagreement(key: Key, records: dict[int, Record], joined: list[int], gone: list[int], rank: int,
                  kind: str | None) -> HorovodMismatchError | None:
    """Why the ranks' records of an operation cannot run together (the same explanation on every rank,
    worded for ``rank``, whose own record is of ``kind``), or None: :func:`agreement.verdict` on the
    records as calls, the ranks in ``joined`` as joined ones."""
    first = records[min(records)]
    if not joined and all(record == first for record in records.values()):
        return None  # the verdict on alike records, without reading them as calls (the usual case)
    label = f"{kind or first['kind']} '{key[1]}'"
    if gone:
        return HorovodMismatchError(f"{label} on rank {rank}: rank(s) {gone} have shut down Horovod (hvd.shutdown()) "
                                    "before submitting it.")
    calls = {r: _call(records[r]) if r in records else {"operation": "join"} for r in sorted([*records, *joined])}
    error = agreement.verdict(calls, first["kind"], rank, len(first["ranks"]), label=label, joinable=JOINABLE,
                              ignore_first_dim=bool(first.get("ragged")), matched="names are matched across ranks")
    return None if error is None else HorovodMismatchError(str(error))


def _call(record: Record) -> dict[str, Any]:
    """A record as the fields :func:`agreement.verdict` judges: its kind as the operation, the members of
    its process set; "ragged" is the verdict's ``ignore_first_dim``."""
    call = {"operation": record["kind"], "process_set": record["ranks"]}
    call.update((what, value) for what, value in record.items() if what not in ("kind", "ranks", "ragged"))
    return call


NEGOTIATOR: Attachment[Negotiator] = Attachment("horovod negotiation")


def opened(set_scope: Callable[[int], collectives.Scope | None], settings: Settings) -> Negotiator:
    """The current generation's negotiator, started where it has none yet (collective: every rank
    calls it, at ``hvd.init`` and after an elastic reset), with the cycle time and stall check of
    ``settings``. It lasts as long as the generation: ``shutdown`` or a re-form closes it with the
    communicator, and every rank leaves."""
    communicator = runtime.communicator()
    return communicator.attached(NEGOTIATOR, lambda: Negotiator(communicator, set_scope, settings))


def current() -> Negotiator:
    """The current generation's negotiator; raises where Horovod was not started on it."""
    found = runtime.attachment(NEGOTIATOR)
    if found is None:
        raise HorovodInternalError("Horovod's negotiation is not running: call hvd.init() on every rank.")
    return found
