"""Helpers for iterable (streaming) datasets: a seeded shuffle buffer, chunking, look-ahead.

Every rank reads the whole stream and runs these with the same seed, so all ranks agree on
the order and on the global batches without communicating.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["shuffle_buffer", "chunked", "mark_last"]

T = TypeVar("T")


def shuffle_buffer(items: Iterable[T], buffer_size: int, seed: int) -> Iterator[T]:
    """Approximately shuffle a stream with a buffer of ``buffer_size`` items.

    Each new item replaces a randomly chosen buffered one, which is emitted; at the end the
    rest of the buffer is emitted in random order. Deterministic for a given stream and seed.
    """
    rng = random.Random(seed)
    buffer: list[T] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        slot = rng.randrange(buffer_size)
        yield buffer[slot]
        buffer[slot] = item
    rng.shuffle(buffer)
    yield from buffer


def chunked(items: Iterable[T], size: int, drop_last: bool) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items; the last shorter one is kept unless ``drop_last``."""
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk and not drop_last:
        yield chunk


def mark_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Pairs ``(item, is_last)``, looking one item ahead to know which one is last."""
    iterator = iter(items)
    sentinel: Any = object()
    current = next(iterator, sentinel)
    while current is not sentinel:
        following = next(iterator, sentinel)
        yield current, following is sentinel
        current = following
