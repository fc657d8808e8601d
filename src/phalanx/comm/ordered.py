"""One background thread that runs a process's collectives on one group in submission order.

Every rank issues its collectives in the same order, so one FIFO keeps them matched across ranks
whether they come from the user's thread or the gradient engine's hooks. Asynchronous ones run on
a daemon thread, beside backward (torch's kernels release the GIL); a synchronous one runs on the
caller's thread when nothing is queued, saving two thread hand-offs. ``close`` aborts a wait in
progress, so a failing process never waits for its peers.

The group is the host's shared memory (:mod:`phalanx.comm.shm`) or phalanx's own algorithms over
a Gloo group of their own (:mod:`phalanx.comm.algorithms`); the work is any call on it.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable, Generic, Protocol, TypeVar

T = TypeVar("T")
CLOSE_WAIT_S = 2.0  # how long close() waits for an aborted call to return before freeing its group


class Group(Protocol):
    """What the executor tears down: ``abort`` ends a wait in progress, ``close`` frees the group."""

    def abort(self) -> None: ...
    def close(self) -> None: ...


G = TypeVar("G", bound=Group)


class OrderedExecutor(Generic[G]):
    """Runs calls on one group in the order they were submitted (see the module's docstring)."""

    def __init__(self, group: G, name: str):
        self.group = group
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._state = threading.Lock()
        self._pending = 0
        self._thread = threading.Thread(target=self._serve, name=f"phalanx-{name}", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], T]) -> concurrent.futures.Future:
        """Queue ``work`` behind the calls already queued; its future completes with its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._state:
            self._pending += 1
        self._queue.put((work, future))
        return future

    def run(self, work: Callable[[], T]) -> T:
        """``work`` now: inline when the queue is empty, else behind the queued calls."""
        with self._state:
            inline = self._pending == 0
            if inline:
                self._pending += 1
        if not inline:
            return self.submit(work).result()
        try:
            return work()
        finally:
            with self._state:
                self._pending -= 1

    def _serve(self) -> None:
        while (task := self._queue.get()) is not None:
            self._serve_one(*task)
            del task  # the thread keeps nothing of a call (its tensors) while it waits for the next

    def _serve_one(self, work: Callable[[], object], future: concurrent.futures.Future) -> None:
        try:
            result, error = work(), None
        except BaseException as failure:  # noqa: BLE001 - handed to whoever waits
            result, error = None, failure
        with self._state:  # before the waiter wakes: its next call may then run inline
            self._pending -= 1
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def close(self) -> None:
        """Abort a wait in progress, stop the thread, then free the group; a group whose call is
        still running after :data:`CLOSE_WAIT_S` is left for the process's exit to free (its
        memory must outlive the call: unmapping it under a waiting thread crashes the process)."""
        self.group.abort()
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self.group.close()
