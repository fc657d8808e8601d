"""Forming an elastic generation: a member lost while the group forms ends the attempt at once.

The store and the watchdog live in the pytest process, whose later tests fork workers: both are
closed and the store collected before the test ends (see tests/comm/test_connections.py).
"""

from __future__ import annotations

import datetime
import gc
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.comm import formation
from phalanx.comm.auth import JobSecret
from phalanx.comm.environment import LaunchInfo
from phalanx.comm.membership import ElasticClient
from phalanx.errors import CollectiveTimeoutError

TIMEOUT_S = 6.0


def test_a_member_lost_while_the_group_connects_ends_the_forming_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watchdog cuts the connections opened since the forming began; one that is still
    connecting then (its attempt cut) retries and connects after the cut. The forming must not go on
    through that connection to wait out the timeout for the lost member (the launcher declares
    the survivors dead meanwhile): seen once in the suite, a death at ``reform.connect``."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    client = ElasticClient(store, member=0, secret=JobSecret.generate())
    generation = 1
    store.add(f"{formation.prefix(generation, 0)}arrived", 1)  # the other member arrived, then died
    connect = formation.own_connection

    def cut_while_connecting(of: Any) -> Any:
        client.mark_broken(generation)  # the coordinator's verdict, and the watchdog's cut ...
        client.abort(generation)
        return connect(of)  # ... before the attempt that connects

    monkeypatch.setattr(formation, "own_connection", cut_while_connecting)
    info = LaunchInfo(source="test", world_size=2, master_port=store.port, store_hosted=True)
    answer = {"status": "ok", "generation": generation, "members": [0, 1]}
    started = time.monotonic()
    try:
        with pytest.raises(CollectiveTimeoutError, match="lost while the group connected"):
            formation._communicator_for_answer(client, answer, info, TIMEOUT_S, "gloo", torch.device("cpu"),
                                               store, "gloo", 0)
        assert time.monotonic() - started < TIMEOUT_S / 3
    finally:
        formation.leave_group(None)
        client.close()
        del client, store
        gc.collect()
