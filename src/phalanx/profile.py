"""The event recorder of ``phalanx doctor``: ``None`` unless a doctor session switched it on.

The engine, the loader and the fit loop call :func:`mark` at a few points (a forward, the start
of backward, a batch handed over); with no recorder that is one global lookup and a comparison.
The analysis lives in :mod:`phalanx.doctor`, which the engine never imports: it installs a
:class:`Recorder` here, with the reduction wrapper that times buckets and measures gradient norms.
:func:`note` keeps facts about the run that are not events (the strategy it trains with).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")

#: One event: its name, ``time.perf_counter()`` when it happened, and a few numbers.
Event = tuple[str, float, dict[str, float]]


class Recorder:
    """Collects events in order; ``wrap_reduction`` instruments a model's bucket reduction."""

    def __init__(self, wrap_reduction: Callable[[Any], Any]):
        self.events: list[Event] = []
        self.notes: dict[str, Any] = {}
        self.wrap_reduction = wrap_reduction

    def mark(self, name: str, **fields: float) -> None:
        """Record that ``name`` happened now."""
        self.events.append((name, time.perf_counter(), fields))


recorder: Recorder | None = None


def mark(name: str, **fields: float) -> None:
    """Record an event if a doctor session is on (otherwise nothing)."""
    if recorder is not None:
        recorder.mark(name, **fields)


def note(name: str, value: Any) -> None:
    """Keep a fact about the run (JSON-serializable) under ``name`` if a doctor session is on."""
    if recorder is not None:
        recorder.notes[name] = value


def wrap(reduction: T) -> T:
    """The reduction a model should use: instrumented during a doctor session, else itself."""
    return reduction if recorder is None else recorder.wrap_reduction(reduction)


def timed(items: Iterable[T], name: str) -> Iterable[T]:
    """``items``, with the wait for each one recorded as ``name`` (a span) during a doctor session."""
    return items if recorder is None else _timed(iter(items), name, recorder)


def _timed(items: Iterator[T], name: str, into: Recorder) -> Iterator[T]:
    while True:
        started = time.perf_counter()
        try:
            item = next(items)
        except StopIteration:
            return
        into.mark(name, started=started)
        yield item
