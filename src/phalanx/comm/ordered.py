"""One background thread that runs a process's allreduces in submission order.

Every rank issues its collectives in the same order, so one FIFO keeps them matched across ranks
whether they come from the user's thread or the gradient engine's hooks. Asynchronous ones run on
a daemon thread, beside backward (torch's kernels release the GIL); a synchronous one runs on the
caller's thread when nothing is queued, saving two thread hand-offs. ``close`` aborts a wait in
progress, so a failing process never waits for its peers.

The work itself is a :class:`ReducingGroup`: the host's shared memory (:mod:`phalanx.comm.shm`) or
phalanx's own algorithms over a Gloo group of their own (:mod:`phalanx.comm.algorithms`).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Protocol

import torch


class ReducingGroup(Protocol):
    """What the executor drives: an in-place allreduce of a flat CPU tensor, and its teardown."""

    def allreduce_(self, flat: torch.Tensor, op: str, algorithm: str) -> None: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...


class OrderedExecutor:
    """Runs one group's allreduces in the order they were submitted (see the module's docstring)."""

    def __init__(self, group: ReducingGroup, name: str):
        self.group = group
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._state = threading.Lock()
        self._pending = 0
        self._thread = threading.Thread(target=self._serve, name=f"phalanx-{name}", daemon=True)
        self._thread.start()

    def submit(self, flat: torch.Tensor, op: str, algorithm: str = "backend") -> concurrent.futures.Future:
        """Queue an allreduce behind the others; its future completes when it has."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._state:
            self._pending += 1
        self._queue.put((flat, op, algorithm, future))
        return future

    def run(self, flat: torch.Tensor, op: str, algorithm: str = "backend") -> None:
        """An allreduce now: inline when the queue is empty, else behind the queued ones."""
        with self._state:
            inline = self._pending == 0
            if inline:
                self._pending += 1
        if not inline:
            self.submit(flat, op, algorithm).result()
            return
        try:
            self.group.allreduce_(flat, op, algorithm)
        finally:
            with self._state:
                self._pending -= 1

    def _serve(self) -> None:
        while (task := self._queue.get()) is not None:
            flat, op, algorithm, future = task
            try:
                self.group.allreduce_(flat, op, algorithm)
                future.set_result(None)
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(error)
            finally:
                with self._state:
                    self._pending -= 1

    def close(self) -> None:
        self.group.abort()
        self._queue.put(None)
        self.group.close()
