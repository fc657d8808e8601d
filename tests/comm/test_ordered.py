"""The ordered executor frees its group only once an aborted call has left it."""

from __future__ import annotations

import threading
import time

from phalanx.comm.ordered import OrderedExecutor


class _Group:
    """A group whose call waits until aborted, then still reads its memory for a moment."""

    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.closed = False
        self.used_after_close = False

    def abort(self) -> None:
        self.aborted.set()

    def close(self) -> None:
        self.closed = True

    def wait(self) -> None:
        self.aborted.wait(10)
        time.sleep(0.2)  # waking up, reading the counters in the segment
        self.used_after_close = self.closed


def test_close_waits_for_the_aborted_call_before_freeing_the_group() -> None:
    group = _Group()
    executor = OrderedExecutor(group, "test")
    pending = executor.submit(group.wait)
    time.sleep(0.05)  # the call is waiting
    executor.close()
    pending.result(timeout=5)
    assert group.closed and not group.used_after_close
