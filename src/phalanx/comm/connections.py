"""A connection of one's own to the job's ``TCPStore``.

A ``TCPStore`` client is not shared between threads, so each thread that waits on the store opens its
own with ``clone()``. A clone connects within the store's *operation* timeout, which phalanx sets to the
collective timeout (a few seconds in tests and in jobs that want failures found fast); on a loaded host
the connection itself can take longer than that. :func:`own_connection` connects with at least
:data:`CONNECT_TIMEOUT_S` and then gives the new connection the original's operation timeout.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

CONNECT_TIMEOUT_S = 60.0  # at least this long to connect, whatever the operations' timeout

_cloning = threading.Lock()  # the original's timeout is raised only for the time of one clone


def own_connection(store: Any) -> Any:
    """A new client of ``store`` (or ``store`` itself where it cannot be cloned), with the same
    operation timeout, connected within at least :data:`CONNECT_TIMEOUT_S`."""
    if not hasattr(store, "clone"):
        return store
    timeout: datetime.timedelta = store.timeout
    if timeout.total_seconds() >= CONNECT_TIMEOUT_S:
        return store.clone()
    with _cloning:
        store.set_timeout(datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
        try:
            connection = store.clone()
        finally:
            store.set_timeout(timeout)
    connection.set_timeout(timeout)
    return connection
