"""A collective in flight: :class:`Handle` and the helpers that chain and complete handles."""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Callable, Generic, TypeVar

S = TypeVar("S")
T = TypeVar("T")

#: Turns a backend failure inside the ``with`` into a phalanx error naming the operation.
ErrorTranslation = Callable[[str], contextlib.AbstractContextManager[None]]


class Handle(Generic[T]):
    """A collective in flight. ``wait()`` blocks until it is done and returns its result."""

    def __init__(self, name: str, work: Any, finish: Callable[[], T],
                 translate_errors: ErrorTranslation | None = None):
        self._name = name
        self._work = work
        self._finish = finish
        self._translate_errors = translate_errors or (lambda _: contextlib.nullcontext())
        self._result: tuple[T] | None = None

    def wait(self) -> T:
        """Block until the operation completes on this rank; return its result."""
        if self._result is None:
            with self._translate_errors(self._name):
                if self._work is not None:
                    self._work.wait()
            self._result = (self._finish(),)
        return self._result[0]

    def is_completed(self) -> bool:
        """Whether ``wait()`` would return without blocking."""
        return self._result is not None or self._work is None or self._work.is_completed()


class FutureWork:
    """A future as the work object a :class:`Handle` waits on."""

    def __init__(self, future: Any):
        self._future = future

    def wait(self) -> None:
        self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


class Works:
    """Several works (the sends and receives of one exchange, or of one message) waited as one, each
    within ``limit`` where one is given (else the group's timeout)."""

    def __init__(self, works: list[Any], limit: datetime.timedelta | None = None):
        self._works, self._limit = works, limit

    def wait(self) -> None:
        for work in self._works:
            if self._limit is None:
                work.wait()
            elif not work.wait(self._limit):
                raise RuntimeError(f"timed out after {self._limit.total_seconds():.0f}s")

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def then(handle: Handle[S], finish: Callable[[S], T]) -> Handle[T]:
    """A handle that waits for ``handle`` and then returns ``finish`` of its result (once)."""
    return Handle(handle._name, handle, lambda: finish(handle.wait()))


def done(result: T, async_op: bool) -> T | Handle[T]:
    """``result`` as a collective that already completed: itself, or a handle of it."""
    return Handle("completed", None, lambda: result) if async_op else result


def chain(handle: Handle[S], convert: Callable[[S], T], async_op: bool) -> T | Handle[T]:
    """``convert`` of ``handle``'s result: a handle of it, or (not ``async_op``) the result now."""
    chained = then(handle, convert)
    return chained if async_op else chained.wait()
