"""Waits that the end of an elastic generation can cut short.

Gloo leaves a send or a receive that was part-way through when its peer's connection closed waiting
until the group's timeout: a pair that fails fails the operations it had not started, not the one it
was writing or reading at the time (``Pair::signalException`` in gloo's ``transport/tcp/pair.cc``).
Shutting the connections down, as the elastic watchdog does when a member is lost, does not end such
a wait either; a survivor caught in one stays in the lost generation for the whole timeout while the
coordinator forms the next one without it; a worker whose parameter server died part-way through a
message waits the same. So where that matters (an elastic job, a channel to a server) a blocking
wait runs on a helper thread of the calling thread's own, and the caller leaves as soon as the waits
are aborted: by the elastic watchdog, or by the caller itself when the group's connection it watches
has closed (Gloo closes a failed pair's socket). The helper is left to the backend's timeout (the work
keeps its tensors and its Gloo context alive until then, so nothing is freed under it). Elsewhere a
wait is the backend's own.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Protocol

#: How often a wait that watches its connections looks at them.
WATCH_INTERVAL_S = 0.2


class Work(Protocol):
    """What a wait needs of a backend's work (a ``torch.distributed`` work, or phalanx's own)."""

    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


class GenerationAborted(RuntimeError):
    """A wait ended because its group was aborted (a member or a connection was lost). Its message
    carries "abort", which :mod:`phalanx.comm.failures` reads as a lost peer."""


class Waits:
    """How one group's works are waited for: directly by the backend, or (``abortable``) so that
    :meth:`abort` ends every wait in progress at once and fails those that come after. ``broken``,
    asked every :data:`WATCH_INTERVAL_S` while a wait lasts, aborts them when it answers true (a
    connection of the group closed)."""

    def __init__(self, abortable: bool = False, broken: Callable[[], bool] | None = None):
        self.abortable = abortable
        self._broken = broken
        self._lock = threading.Lock()
        self._aborted: str | None = None  # why, once aborted
        self._waiting: set[threading.Lock] = set()
        self._helpers: list[_Helper] = []
        self._own = threading.local()

    @property
    def aborted(self) -> str | None:
        """Why the waits were aborted, once they were (``None`` until then)."""
        return self._aborted

    def wrap(self, work: Work) -> Work:
        """``work`` as its handle waits for it: itself, or (abortable) one whose wait :meth:`abort` ends."""
        return _Abortable(work, self) if self.abortable else work

    def wait(self, work: Work) -> None:
        """Wait for ``work``; raise :class:`GenerationAborted` if the generation is aborted first."""
        if not self.abortable or work.is_completed():
            work.wait()
            return
        done = threading.Lock()  # released when the wait ends (a lock hands off in half an Event's time)
        done.acquire()
        with self._lock:
            if self._aborted is not None:
                raise GenerationAborted(f"the wait was aborted: {self._aborted}")
            self._waiting.add(done)
        outcome: list[BaseException | None] = []
        try:
            self._helper().post(work, outcome, done)
            if self._broken is None:
                done.acquire()
            else:
                while not done.acquire(timeout=WATCH_INTERVAL_S):
                    if self._broken():
                        self.abort("a connection of its group closed part-way through a transfer")
        finally:
            with self._lock:
                self._waiting.discard(done)
        if not outcome:
            raise GenerationAborted(f"the wait was aborted: {self._aborted}")
        if outcome[0] is not None:
            raise outcome[0]

    def abort(self, reason: str = "this generation lost a member") -> None:
        """End every wait in progress (its caller raises :class:`GenerationAborted`) and fail later ones."""
        with self._lock:
            if self._aborted is None:
                self._aborted = reason
            for done in self._waiting:
                _release(done)

    def close(self) -> None:
        """Stop the helper threads once their waits end (at once where they are idle)."""
        with self._lock:
            helpers, self._helpers = self._helpers, []
        for helper in helpers:
            helper.stop()

    def _helper(self) -> _Helper:
        helper: _Helper | None = getattr(self._own, "helper", None)
        if helper is None:
            helper = self._own.helper = _Helper()
            with self._lock:
                self._helpers.append(helper)
        return helper


class _Helper:
    """The thread that waits for one calling thread's works (one each, so that two callers never wait
    behind each other: one caller's work may need what the other does next)."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="phalanx-wait", daemon=True).start()

    def post(self, work: Work, outcome: list[BaseException | None], done: threading.Lock) -> None:
        self._tasks.put((work, outcome, done))

    def stop(self) -> None:
        self._tasks.put(None)

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            work, outcome, done = task
            try:
                work.wait()
                outcome.append(None)
            except BaseException as failure:  # noqa: BLE001 - handed to the caller, if it still waits
                outcome.append(failure)
            _release(done)
            del task, work  # nothing of a finished wait (its tensors) is kept while the next is awaited


def _release(done: threading.Lock) -> None:
    """End a wait (the helper's work done, or an abort): whichever comes second finds it released."""
    try:
        done.release()
    except RuntimeError:
        pass


class _Abortable:
    """A work whose ``wait`` goes through :meth:`Waits.wait`."""

    def __init__(self, work: Work, waits: Waits):
        self._work, self._waits = work, waits

    def wait(self) -> None:
        self._waits.wait(self._work)

    def is_completed(self) -> bool:
        return self._work.is_completed()
