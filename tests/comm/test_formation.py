"""Forming an elastic generation: a member lost while the group forms ends the attempt at once.

The store and the watchdog live in the pytest process, whose later tests fork workers: both are
closed and the store collected before the test ends (see tests/comm/test_connections.py).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import time
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from phalanx.comm import formation
from phalanx.comm.auth import JobSecret
from phalanx.comm.environment import LaunchInfo
from phalanx.comm.membership import ElasticClient
from phalanx.errors import CollectiveTimeoutError
from tests.harness import run_workers

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


def _form_again_after_one_rank_failed_alone() -> float:
    """Rank 1 first tries to form a group alone and fails half way; then both form one together."""
    import phalanx as px

    rank = px.rank()
    px.shutdown()  # the harness's group: these ranks form their own below
    info = LaunchInfo(source="test", rank=rank, world_size=2, master_port=int(os.environ["MASTER_PORT"]),
                      store_hosted=True)
    store = formation.connect_store(info, TIMEOUT_S)
    if rank == 1:  # its peer never comes: the attempt fails inside torch's init, after torch named the group
        with pytest.raises(CollectiveTimeoutError):
            formation.create_group(info, 1.0, "gloo", torch.device("cpu"), keys="lonely/", store=store)
        formation.leave_group(None)
    store.set(f"ready/{rank}", "1")
    store.wait(["ready/0", "ready/1"])
    started = time.monotonic()
    formed = formation.create_group(info, TIMEOUT_S, "gloo", torch.device("cpu"), keys="together/", store=store)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total, group=formed.cpu_group)
    assert total.item() == 3.0
    formation.leave_group(None)
    return time.monotonic() - started


def test_a_rank_whose_last_forming_failed_half_way_forms_the_next_group_with_its_peers() -> None:
    """torch names a default group after a count that only a destroyed group resets: a rank whose
    last forming failed inside torch's init (a member lost while the group connected) must look
    for the same store keys as its peers next time, not wait out the timeout for keys nobody writes
    (seen in the suite: a death at ``fit.setup`` left two ranks' init failed, the third's done)."""
    seconds = run_workers(_form_again_after_one_rank_failed_alone, 2, timeout=60)
    assert max(seconds) < TIMEOUT_S / 2, seconds


@contextlib.contextmanager
def _formed_generation(generation: int, secret: str, transport: str) -> Iterator[tuple[int, ElasticClient, Any]]:
    """This harness worker's rank, elastic client and communicator once both workers formed
    ``generation`` as its two members, on one host (the harness's own group left first); all closed after."""
    import phalanx as px

    rank = px.rank()
    px.shutdown()
    info = LaunchInfo(source="test", rank=rank, world_size=2, local_rank=rank, local_world_size=2,
                      master_port=int(os.environ["MASTER_PORT"]), store_hosted=True)
    store = formation.connect_store(info, TIMEOUT_S)
    client = ElasticClient(store, member=rank, secret=JobSecret(bytes.fromhex(secret)))
    answer = {"status": "ok", "generation": generation, "members": [0, 1]}
    formed = formation._communicator_for_answer(client, answer, info, TIMEOUT_S, "gloo", torch.device("cpu"),
                                                store, transport, 0)
    try:
        yield rank, client, formed
    finally:
        formed.close()
        formation.leave_group(client)
        client.close()


def _a_later_group_while_the_other_member_is_lost(secret: str) -> float | None:
    """Both members form generation 1; then member 1 is lost (it stops and the coordinator's verdict
    is stated), while member 0 makes the generation's group for phalanx's own algorithms."""
    generation = 1
    with _formed_generation(generation, secret, "gloo") as (rank, client, formed):
        if rank == 1:
            time.sleep(0.5)  # member 0 is waiting for this member's address by now
            client.mark_broken(generation)
            return None
        started = time.monotonic()
        with pytest.raises((RuntimeError, CollectiveTimeoutError)):
            formed.message_executor()
        return time.monotonic() - started


def test_a_group_made_later_in_a_generation_that_loses_a_member_fails_at_once() -> None:
    """A group a generation makes after it formed (phalanx's own algorithms', at their first use)
    waits on the generation's rendezvous connection for every member's address; a member lost
    before it wrote its own must end that wait when the generation breaks, not at the timeout."""
    waited = run_workers(_a_later_group_while_the_other_member_is_lost, 2, JobSecret.generate().hex(), timeout=60)[0]
    assert waited < TIMEOUT_S / 2, waited


def _an_allreduce_through_shared_memory_while_the_other_member_leaves(secret: str) -> float | None:
    """Both members form generation 1 on one host (shared memory); member 1 starts an allreduce that
    member 0 never joins: member 0 leaves the generation alive (as after a failure it saw first) and
    states it broken."""
    generation = 1
    with _formed_generation(generation, secret, "auto") as (rank, client, formed):
        assert formed.shares_one_host()
        if rank == 0:
            time.sleep(0.5)  # member 1 is waiting in shared memory for this one by now
            client.mark_broken(generation)
            client.store.wait(["member-1-done"], datetime.timedelta(seconds=TIMEOUT_S))  # alive and gone meanwhile
            return None
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError):
            formed.allreduce(torch.ones(1000))
        client.store.set("member-1-done", "1")
        return time.monotonic() - started


def test_a_wait_in_shared_memory_ends_when_the_generation_breaks_though_the_peer_lives() -> None:
    """Shared memory finds a dead peer by its pid, but a peer that left a broken generation alive (to
    form the next) is never dead: the watchdog that cuts the generation's sockets must also end its
    shared-memory waits, or a survivor waits out the timeout while the others re-form without it
    (seen in the suite: a death at ``step.reduce``, one survivor still in a bucket's allreduce)."""
    waited = run_workers(_an_allreduce_through_shared_memory_while_the_other_member_leaves, 2,
                         JobSecret.generate().hex(), timeout=60)[1]
    assert waited < TIMEOUT_S / 2, waited
