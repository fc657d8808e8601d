"""The coordinator's decisions, driven message by message through a real in-process store."""

from __future__ import annotations

import datetime
import json
import time

import pytest
import torch.distributed as dist

from phalanx.comm.auth import JobSecret
from phalanx.comm.membership import Keys
from phalanx.cli.coordinator import Coordinator, CoordinatorConfig

SECRET = JobSecret.generate()


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=5))


def make(store, min_workers=2, max_workers=4, heartbeat=5.0, rendezvous=30.0) -> Coordinator:
    return Coordinator(store, SECRET, CoordinatorConfig(min_workers, max_workers, heartbeat, rendezvous))


def post(store, **message) -> None:
    store.queue_push(Keys.INBOX, SECRET.seal(Keys.INBOX, json.dumps(message)))


def spawn(store, member: int, node: int = 0, local_rank: int | None = None) -> None:
    post(store, type="spawn", member=member, node=node, local_rank=member if local_rank is None else local_rank,
         label=str(member))


def beat(store, member: int) -> None:
    """A heartbeat as a member's watchdog states it: a count that only grows, sealed."""
    store.set(Keys.heartbeat(member), SECRET.seal(Keys.heartbeat(member), str(time.monotonic_ns())))


def stated(store, key: str) -> bool:
    """Whether the coordinator stated ``key`` (sealed with the job's secret). It writes on a connection
    of its own, whose set may reach the server after this connection's next request: wait for it."""
    store.wait([key], datetime.timedelta(seconds=5))
    return SECRET.open(key, store.get(key))[0] == b"1"


def request(store, member: int, seq: int, reason: str, generation: int = -1) -> None:
    beat(store, member)
    post(store, type="request", member=member, seq=seq, generation=generation, reason=reason, time=0.0)


def answer(store, member: int, seq: int) -> dict | None:
    key = Keys.answer(member, seq)
    return json.loads(SECRET.open(key, store.get(key))[0]) if store.check([key]) else None


def form(store, coordinator: Coordinator, members: list[int]) -> None:
    for member in members:
        spawn(store, member)
    for member in members:
        request(store, member, 1, "start")
    coordinator.step()
    assert coordinator.generation == 0 and coordinator.current == members


def test_generation_zero_waits_for_every_started_worker(store) -> None:
    coordinator = make(store)
    for member, node in ((1, 1), (2, 0), (3, 0)):
        spawn(store, member, node=node, local_rank=0 if member != 3 else 1)
    request(store, 1, 1, "start")
    request(store, 3, 1, "start")
    coordinator.step()
    assert coordinator.generation == -1 and answer(store, 1, 1) is None  # member 2 is still starting
    request(store, 2, 1, "start")
    coordinator.step()
    first = answer(store, 1, 1)
    assert first["status"] == "ok" and first["generation"] == 0
    assert first["members"] == [2, 3, 1]  # ordered by (node, local rank)
    assert answer(store, 2, 1) == first == answer(store, 3, 1)


def test_a_lost_member_breaks_the_generation_and_survivors_reform(store) -> None:
    coordinator = make(store)
    form(store, coordinator, [1, 2, 3])
    post(store, type="exit", member=2, code=137, time=123.0)
    coordinator.step()
    assert stated(store, Keys.broken(0)) and stated(store, Keys.signal(0))
    request(store, 3, 2, "failure", generation=0)
    coordinator.step()
    assert answer(store, 3, 2) is None  # member 1 has not asked yet
    request(store, 1, 2, "failure", generation=0)
    coordinator.step()
    new = answer(store, 1, 2)
    assert new["members"] == [1, 3] and new["lost"] == [2] and new["generation"] == 1
    assert new["reason"] == "failure" and new["event_time"] == 123.0


def test_a_silent_member_is_declared_dead_and_killed(store) -> None:
    coordinator = make(store, heartbeat=0.3)
    form(store, coordinator, [1, 2])
    beat(store, 1)
    coordinator._last_heartbeat_poll = 0.0
    coordinator.step()
    time.sleep(0.5)
    beat(store, 1)
    coordinator._last_heartbeat_poll = 0.0
    coordinator.step()
    assert store.check([Keys.kill(2)]) and not store.check([Keys.kill(1)])
    assert stated(store, Keys.broken(0))
    request(store, 1, 2, "failure", generation=0)
    coordinator.step()
    assert answer(store, 1, 2)["status"] == "below-min"  # one left, two needed
    assert answer(store, 1, 2)["save"] is True
    assert SECRET.open(Keys.STATUS, store.get(Keys.STATUS))[0].startswith(b"failed: only 1 worker(s) left")


def test_joiners_are_admitted_at_a_boundary_after_the_members(store) -> None:
    coordinator = make(store)
    form(store, coordinator, [1, 2])
    spawn(store, 5)
    request(store, 5, 1, "start")
    coordinator.step()
    assert answer(store, 5, 1)["status"] == "late"
    request(store, 5, 2, "join")
    coordinator.step()
    assert stated(store, Keys.signal(0)) and not store.check([Keys.broken(0)])
    for member in (2, 1):
        request(store, member, 2, "planned", generation=0)
    coordinator.step()
    admitted = answer(store, 5, 2)
    assert admitted["members"] == [1, 2, 5] and admitted["joined"] == [5] and admitted["reason"] == "planned"


def test_a_stale_request_is_excluded_and_late_joiners_of_a_finished_job_are_told(store) -> None:
    coordinator = make(store, min_workers=1)
    form(store, coordinator, [1, 2])
    request(store, 2, 2, "failure", generation=7)
    coordinator.step()
    assert answer(store, 2, 2)["status"] == "excluded"
    for member in (1, 2):
        post(store, type="exit", member=member, code=0)
    spawn(store, 9)
    request(store, 9, 1, "start")
    coordinator.step()
    assert answer(store, 9, 1)["status"] == "late"
    request(store, 9, 2, "join")
    coordinator.step()
    assert coordinator.status == "finished" and answer(store, 9, 2)["status"] == "finished"


def test_a_coordinator_whose_store_fails_gives_up_once_with_a_clear_error() -> None:
    """Its store gone (here: the server stopped), the coordinator retries on new connections for a
    heartbeat timeout, logging once, then records why it failed: the launcher stops the job on it
    rather than wait forever for members it can no longer hear."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=0.3))
    said: list[str] = []
    coordinator = Coordinator(client, SECRET, CoordinatorConfig(1, 2, 0.5, 30.0), log=said.append)
    form(client, coordinator, [1])
    coordinator.start()
    del server  # the store's server goes away
    deadline = time.monotonic() + 20
    while coordinator.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    coordinator.stop()
    assert coordinator.failure is not None and "could not use the store" in coordinator.failure, said
    assert not coordinator.busy()
    errors = [line for line in said if "coordinator" in line]
    assert len(errors) == 2 and "retrying" in errors[0] and "stopping the job" in errors[1], said
    assert all("frame #" not in line for line in errors), errors
