"""Background prefetch: a daemon thread fills a bounded queue from an iterator.

The consumer gets items in order; an exception raised by the producer is re-raised in the
consumer. :meth:`Prefetcher.close` (also run when the consumer is garbage collected) stops the
thread, so breaking out of a loop early leaves no thread behind.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["Prefetcher", "THREAD_NAME"]

T = TypeVar("T")

THREAD_NAME = "phalanx-prefetch"
_POLL_S = 0.05
_JOIN_S = 10.0


class _End:
    """Marks the end of the source."""


class _Failure:
    """Carries an exception from the producer thread to the consumer."""

    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[T]):
    """Iterate ``source`` in a daemon thread, keeping up to ``depth`` items ready.

    The thread holds no reference to this object, so dropping the prefetcher stops the thread.
    """

    def __init__(self, source: Iterator[T], depth: int):
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(
            target=_produce, args=(source, self._queue, self._stop), name=THREAD_NAME, daemon=True
        )
        self._thread.start()

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, (_End, _Failure)):
            self._finished = True
            self._thread.join(_JOIN_S)
            if isinstance(item, _Failure):
                raise item.error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the producer thread and wait for it (it finishes the item it is building)."""
        self._finished = True
        self._stop.set()
        _drain(self._queue)
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)

    def __del__(self) -> None:
        self._stop.set()


def _produce(source: Iterator, out: queue.Queue, stop: threading.Event) -> None:
    """Thread body: move items from ``source`` into ``out`` until done, failed or stopped."""
    try:
        for item in source:
            if not _put(out, item, stop):
                return
        _put(out, _End(), stop)
    except BaseException as error:  # noqa: BLE001 - every failure must reach the consumer
        _put(out, _Failure(error), stop)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def _put(out: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Put ``item`` into ``out``, polling ``stop``; false when stopped before it fit."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _drain(items: queue.Queue) -> None:
    """Empty a queue without blocking, so a blocked producer can notice the stop flag."""
    while True:
        try:
            items.get_nowait()
        except queue.Empty:
            return
