"""A backend failure in phalanx's words: a lost or silent peer, or a call the backend rejected.

Kept apart so that every collective, whatever runs it (the backend, shared memory, phalanx's own
algorithms), names its rank, operation and cause the same way.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from phalanx.errors import CollectiveError, CollectiveTimeoutError, PhalanxError

_PEER_FAILURE_MARKS = ("timed out", "timeout", "connection", "closed", "reset", "broken pipe", "peer", "abort")


@contextlib.contextmanager
def translated(operation: str, rank: int, size: int, timeout_s: float) -> Iterator[None]:
    """Turn a backend failure inside the ``with`` into a phalanx error naming rank and operation.

    A lost or silent peer becomes :class:`CollectiveTimeoutError`; anything else the backend
    rejects becomes :class:`CollectiveError` with the backend's own words.
    """
    try:
        yield
    except PhalanxError:
        raise
    except (RuntimeError, OSError) as error:
        if not _is_peer_failure(error):
            raise CollectiveError(
                f"{operation} on rank {rank} of {size} was rejected by the backend: {_first_line(error)}"
            ) from error
        raise CollectiveTimeoutError(
            f"{operation} on rank {rank} of {size} failed: a peer died or did not answer "
            f"within the {timeout_s:.0f}s timeout ({_first_line(error)}). The first failing rank's "
            "output names the root cause."
        ) from error


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, OSError) or any(mark in text for mark in _PEER_FAILURE_MARKS)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
