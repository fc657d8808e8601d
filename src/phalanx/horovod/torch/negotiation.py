"""Horovod's negotiation: operations are matched across ranks by name, not by the order of the calls.

A background thread on every rank meets the others' once per cycle, over a Gloo group of its own,
and hands over what its process submitted since the last cycle: one record per operation (its
kind, process set, dtypes, shapes, reduction, root: plain data, never code), encoded by
:mod:`phalanx.comm.codec`'s safe way (JSON for such plain data: nothing received is unpickled).
Every rank then holds the same table and reaches the same decisions in the same order:

- an operation is *ready* when every member of its process set has submitted it; a rank inside
  ``hvd.join()`` counts as having submitted every allreduce, and reduces zeros;
- a ready operation whose records disagree (dtype, shape, op, root, kind), or that a joined rank
  cannot take part in, fails on every rank that submitted it with the same message; nothing is sent.
  The check is the collectives' own (:func:`phalanx.comm.agreement.verdict`), in the same words;
- the others are launched in the table's order on groups of their own (one pair per process set),
  so they never interleave with the collectives the rest of phalanx runs from the user's thread;
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

Each generation of the job has its own negotiator, kept on its communicator (:func:`opened`), whose
end (``hvd.shutdown()``, an elastic re-form, the process's exit) closes it. Leaving is collective,
like MPI's finalize: a rank that leaves keeps taking part in the cycles until every rank has left
(at most the job's timeout), so the others may go on with operations that do not need it; those
that need it fail on every rank that submitted them, naming it. A lost peer fails every waiting operation with
:class:`HorovodTimeoutError`.

Cycles cost nothing while nothing moves: after each cycle every thread waits on the same numbered key
of the job's store (a doorbell), and a rank with news (a submission, a join, leaving) sets it; a rank waiting in ``synchronize`` rings it once a second, so a peer that
died shows as a failed cycle within a second. Where the job has no store (a process group made by someone else),
idle threads poll instead, backing off to 10 ms. HOROVOD_CYCLE_TIME sets the shortest time from one
cycle's start to the next's (Horovod's cycle time; none by default), so that operations submitted
meanwhile travel together.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from phalanx.comm import agreement, codec, collectives, runtime
from phalanx.comm.communicator import Attachment, Communicator
from phalanx.comm.connections import own_connection
from phalanx.errors import PhalanxError
from phalanx.horovod.torch.exceptions import HorovodInternalError, HorovodMismatchError, HorovodTimeoutError
from phalanx.horovod.torch.process_sets import new_scope
from phalanx.horovod.torch.variables import Settings

logger = logging.getLogger(__name__)

SLOT = 1024  # bytes of each rank's records that travel in a cycle's first allgather
MAX_PAUSE_S = 0.01  # without a store: the longest sleep between idle cycles
BELL_WAIT = datetime.timedelta(days=1)  # a doorbell wait's timeout: rung long before (torch logs each one)
LIVENESS_S = 1.0  # a rank that waits for an operation rings a cycle this often, to notice a dead peer
JOINABLE = ("allreduce", "grouped_allreduce")  # what a joined rank takes part in, with zeros
NOTHING = torch.empty(0, dtype=torch.uint8)  # the message of a rank with no news
Key = tuple[int, str]  # (process set id, operation name)
Record = dict[str, Any]
Launch = Callable[[], Any]  # starts the collectives of one operation; returns what to wait on (or None)


@dataclass
class Submission:
    """One operation of this rank: what it tells the others, and how to start it once agreed."""

    key: Key
    record: Record
    launch: Launch
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


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
        self._whole_job = new_scope(list(range(self.size)))
        self._stand_ins: list[Any] = []  # a joined rank's zeros in flight
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._outbox: list[Submission] = []
        self._overdue: list[Submission] = []  # waited for past the timeout here: every rank is told next cycle
        self._join_requested = self._leaving = False
        self._left: set[int] = set()  # ranks that have left (hvd.shutdown())
        self._mine: dict[Key, Submission] = {}  # submitted here, not settled yet
        self._table: dict[Key, dict[int, Record]] = {}  # the same on every rank, in order of first sight
        self._joined: set[int] = set()  # ranks inside hvd.join()
        self._join: concurrent.futures.Future | None = None  # every rank has joined: the last one
        self._join_told: concurrent.futures.Future | None = None  # this rank's join went out in a cycle
        self._ended: PhalanxError | None = None
        self._thread: threading.Thread | None = None
        store = communicator.store if self.size > 1 and hasattr(communicator.store, "clone") else None
        # The doorbell: one store connection for the thread's waits, one for the callers' rings.
        self._bell = (own_connection(store), own_connection(store)) if store is not None else None
        self._bell_prefix, self._bells, self._armed = f"{communicator.prefix}horovod/bell/", 0, ""
        if self.size > 1:  # alone, every operation is agreed as it is submitted
            self._control = dist.new_group(list(range(self.size)), backend="gloo",
                                           timeout=datetime.timedelta(seconds=self.timeout_s))
            self._thread = threading.Thread(target=self._serve, name="phalanx-horovod-negotiation", daemon=True)
            self._thread.start()

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
        if not self._awaited(submission.future, self.stall_s - waited):
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
        peer that died meanwhile fails it at once instead of after the timeout."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                future.exception(timeout=min(LIVENESS_S, left))
                return True
            except concurrent.futures.TimeoutError:
                with self._lock:
                    self._ring()
        return future.done()

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

    def scope(self, set_id: int) -> collectives.Scope | None:
        """The groups the operations of process set ``set_id`` run on (0: the whole job; ``None``
        in a world of one, where every collective completes at once)."""
        return self._whole_job if set_id == 0 else self.set_scope(set_id)

    # --- the background thread ----------------------------------------------------------------

    def _ring(self) -> None:
        """Wake every rank's thread (under the lock: a caller has news)."""
        if self._bell is None:
            self._wake.set()
        elif self._armed:
            self._bell[1].set(self._armed, "1")
            self._armed = ""

    def _serve(self) -> None:
        pause, started = 0.0, -math.inf
        try:
            while True:
                time.sleep(max(0.0, started + self.cycle_time_s - time.monotonic()))  # HOROVOD_CYCLE_TIME
                started = time.monotonic()
                moved = self._one_cycle()
                if self._bell is not None:
                    self._idle(self._bell[0])
                elif not moved:
                    pause = min(max(2 * pause, 1e-4), MAX_PAUSE_S)
                    self._wake.wait(pause)
                    self._wake.clear()
                else:
                    pause = 0.0
        except _AllLeft:
            self._end(HorovodInternalError(f"Horovod was shut down on rank {self.rank}: call hvd.init() first."))
        except Exception as failure:  # noqa: BLE001 - a lost peer, a torn-down group: every waiter hears of it
            logger.debug("horovod negotiation on rank %d ended", self.rank, exc_info=True)
            self._end(HorovodTimeoutError(
                f"Horovod's negotiation on rank {self.rank} failed: a peer died or stopped answering "
                f"({str(failure).splitlines()[0] if str(failure) else type(failure).__name__})."))

    def _idle(self, bell: Any) -> None:
        """Wait on this round's doorbell key until a rank with news rings it (every rank's thread
        waits on the same key after each cycle; a rank that has news already rings at once)."""
        key = f"{self._bell_prefix}{self._bells}"
        if self.rank == 0 and self._bells:
            bell.delete_key(f"{self._bell_prefix}{self._bells - 1}")  # every thread is past it
        self._bells += 1
        with self._lock:
            news = bool(self._outbox or self._overdue) or self._join_requested or self._leaving
            self._armed = "" if news else key
        if news:
            bell.set(key, "1")
        while not _rung(bell, key):
            pass
        with self._lock:
            self._armed = ""

    def _one_cycle(self) -> bool:
        """Exchange what is new, update the shared table, settle what is ready. Whether anything moved."""
        with self._lock:
            outgoing, self._outbox = self._outbox, []
            overdue, self._overdue = self._overdue, []
            joining, self._join_requested = self._join_requested, False
            leaving, self._leaving = self._leaving, False  # said once
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
        # The safe codec: a message is plain data (dicts, lists, strings, numbers), which it sends as
        # JSON: a peer's bytes never run code here, for tens of microseconds a cycle more than pickle
        # (below a cycle's noise: benchmarks/RESULTS.md).
        received = [codec.decode(raw, safe=True) if len(raw) else {} for raw in
                    self._exchange(codec.encode(message, safe=True) if message else NOTHING)]
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

    def _exchange(self, payload: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``payload`` (uint8): one allgather of a slot holding its length and its first
        bytes, a second of the rest only when some rank's does not fit. The slots are filled and read
        through numpy, which costs a cycle microseconds less than indexing tensors."""
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
        return [theirs[8:8 + n] if n else NOTHING for theirs, n in zip(slots, lengths)]

    def _gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``mine`` (all of the same size)."""
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(everyone, mine, group=self._control)
        return everyone

    def _settle_ready(self) -> bool:
        settled = False
        for key in list(self._table):
            records = self._table[key]
            first = next(iter(records.values()))
            missing = [r for r in first["ranks"] if r not in records]
            if any(r not in self._joined and r not in self._left for r in missing):
                continue  # a rank that is still running has not submitted it yet
            del self._table[key]
            self._settle(key, records, missing, [r for r in missing if r in self._left])
            settled = True
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

    def _settle(self, key: Key, records: dict[int, Record], joined: list[int], gone: list[int]) -> None:
        """Launch an operation every rank of its set has submitted (or take part with zeros, joined),
        or fail it where the records disagree; ``joined``: the ranks that did not submit it, ``gone``
        those of them that have left."""
        mine = self._mine.pop(key, None)
        error = _disagreement(key, records, joined, gone, self.rank, mine.record["kind"] if mine else None)
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
