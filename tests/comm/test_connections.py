"""A thread's own store connection: connected patiently, answering with the original's timeout.

The stores here live in the pytest process itself, whose later tests fork workers: each store is
destroyed (with its server's thread) before the test ends, so no forked worker inherits one whose
collection would join a thread that does not exist in it.
"""

import datetime
import gc

import torch.distributed as dist

from phalanx.comm import connections
from phalanx.comm.connections import own_connection


class Recording:
    """A store stand-in that records the timeout each clone is made with."""

    def __init__(self, store: dist.TCPStore):
        self.store, self.timeout, self.seen = store, store.timeout, []

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout

    def clone(self) -> dist.TCPStore:
        self.seen.append(self.timeout)
        return self.store.clone()


def test_a_connection_keeps_the_operation_timeout_and_the_original_is_unchanged() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=1))
    connection = own_connection(store)
    assert connection.timeout == store.timeout == datetime.timedelta(seconds=1)
    connection.set("key", "value")
    assert store.get("key") == b"value"
    del connection, store
    gc.collect()


def test_a_connection_waits_for_the_connect_timeout_not_the_operation_timeout() -> None:
    """The clone is made while the original carries the connect timeout (torch's clone copies it)."""
    recording = Recording(dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=2)))
    own_connection(recording)  # the connection itself is dropped at once
    assert recording.seen == [datetime.timedelta(seconds=connections.CONNECT_TIMEOUT_S)]
    assert recording.timeout == datetime.timedelta(seconds=2)
    del recording
    gc.collect()
