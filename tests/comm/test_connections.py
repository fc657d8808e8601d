"""A thread's own store connection: connected patiently, answering with the original's timeout."""

import datetime
import torch.distributed as dist

from phalanx.comm import connections
from phalanx.comm.connections import own_connection


def test_a_connection_keeps_the_operation_timeout_and_the_original_is_unchanged() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=1))
    connection = own_connection(store)
    assert connection.timeout == store.timeout == datetime.timedelta(seconds=1)
    connection.set("key", "value")
    assert store.get("key") == b"value"


def test_a_connection_waits_for_the_connect_timeout_not_the_operation_timeout() -> None:
    """The clone is made while the original carries the connect timeout (torch's clone copies it)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=2))
    seen: list[datetime.timedelta] = []

    class Recording:
        timeout = store.timeout

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self.timeout = timeout

        def clone(self):
            seen.append(self.timeout)
            return store.clone()

    recording = Recording()
    own_connection(recording)
    assert seen == [datetime.timedelta(seconds=connections.CONNECT_TIMEOUT_S)]
    assert recording.timeout == datetime.timedelta(seconds=2)
