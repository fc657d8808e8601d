"""Waits an aborted generation ends: a wait in progress returns at once, later ones fail at once,
a work's own failure still reaches its caller, and two threads' waits never queue behind each other.
(A survivor left in Gloo's wait after a peer's death is tests/elastic/test_faults.py's.)"""

from __future__ import annotations

import threading
import time

import pytest

from phalanx.comm.waiting import GenerationAborted, Waits


class BlockedWork:
    """A work that completes when ``finish`` is called (or fails with ``error``)."""

    def __init__(self, error: Exception | None = None):
        self._done = threading.Event()
        self._error = error
        self.waited_on: list[str] = []

    def finish(self) -> None:
        self._done.set()

    def wait(self) -> None:
        self.waited_on.append(threading.current_thread().name)
        if not self._done.wait(30):
            raise TimeoutError("never finished")
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return self._done.is_set() and self._error is None


def test_an_abort_ends_a_wait_in_progress_and_fails_the_ones_after() -> None:
    waits = Waits(abortable=True)
    work = BlockedWork()
    threading.Timer(0.2, waits.abort).start()
    started = time.monotonic()
    with pytest.raises(GenerationAborted, match="abort"):
        waits.wrap(work).wait()
    assert time.monotonic() - started < 5.0
    with pytest.raises(GenerationAborted):
        waits.wait(BlockedWork())
    work.finish()
    waits.close()


def test_a_completed_work_is_waited_on_the_callers_thread_and_a_failure_reaches_the_caller() -> None:
    waits = Waits(abortable=True)
    done = BlockedWork()
    done.finish()
    waits.wait(done)
    assert done.waited_on == [threading.current_thread().name]
    failing = BlockedWork(error=RuntimeError("Connection closed by peer"))
    threading.Timer(0.1, failing.finish).start()
    with pytest.raises(RuntimeError, match="closed by peer"):
        waits.wait(failing)
    assert failing.waited_on == ["phalanx-wait"]
    waits.close()


def test_waits_that_are_not_abortable_are_the_backends_own() -> None:
    waits = Waits()
    work = BlockedWork()
    assert waits.wrap(work) is work
    threading.Timer(0.1, work.finish).start()
    waits.wait(work)
    assert work.waited_on == [threading.current_thread().name]


def test_two_threads_waits_do_not_queue_behind_each_other() -> None:
    """The second thread's work completes only after the first thread's wait returned: one helper
    for both would wait forever."""
    waits = Waits(abortable=True)
    first, second = BlockedWork(), BlockedWork()

    def other_thread() -> None:
        waits.wait(first)
        second.finish()

    threading.Timer(0.1, first.finish).start()
    caller = threading.Thread(target=lambda: (time.sleep(0.05), other_thread()))
    caller.start()
    waits.wait(second)  # posted first, on this thread's own helper
    caller.join(5)
    assert not caller.is_alive()
    waits.close()
