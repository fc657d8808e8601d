"""init/shutdown, rank queries, timeouts, and the world of one."""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import phalanx as px
from phalanx.comm import runtime
from phalanx.comm.communicator import Attachment
from tests.harness import run_workers


def test_world_of_one_needs_no_network_and_init_is_idempotent() -> None:
    px.init()
    px.init()
    assert (px.rank(), px.size(), px.local_rank(), px.local_size(), px.node_rank()) == (0, 1, 0, 1, 0)
    assert px.is_master() and px.is_initialized()
    assert not dist.is_initialized()  # nothing listens
    first = px.communicator()
    assert first is px.communicator() and (first.rank, first.size) == (0, 1)
    px.shutdown()
    assert not px.is_initialized()
    assert float(px.allreduce(torch.ones(1))) == 1.0  # a world of one needs no init
    with pytest.raises(px.GenerationClosedError, match=r"generation 0 .* has ended.*px.communicator\(\)"):
        first.allreduce(torch.ones(1))
    with pytest.raises(px.NotInitializedError, match=r"px.init\(\)"):
        px.communicator()


class _Closable:
    def __init__(self, name: str, closed: list[str]):
        self.name, self.closed = name, closed

    def close(self) -> None:
        self.closed.append(self.name)


def test_what_a_layer_attaches_is_made_once_and_ends_with_its_generation() -> None:
    first_key, second_key, plain_key = Attachment("first"), Attachment("second"), Attachment("plain")
    closed: list[str] = []
    made: list[str] = []

    def make(name: str) -> _Closable:
        made.append(name)
        return _Closable(name, closed)

    px.init()
    generation = px.communicator()
    assert runtime.attachment(first_key) is None and generation.attachment(first_key) is None
    first = generation.attached(first_key, lambda: make("first"))
    assert generation.attached(first_key, lambda: make("again")) is first and made == ["first"]
    second = generation.attached(second_key, lambda: make("second"))
    plain = generation.attached(plain_key, lambda: {"nothing": "to close"})
    assert runtime.attachment(second_key) is second and runtime.attachment(plain_key) is plain
    px.shutdown()
    assert closed == ["second", "first"]  # with the generation, newest first
    assert generation.attachment(first_key) is first and runtime.attachment(first_key) is None
    with pytest.raises(px.GenerationClosedError, match="attaching late"):
        generation.attached(Attachment("late"), lambda: make("late"))
    px.init()
    assert px.communicator().attachment(first_key) is None  # the next generation starts without
    assert px.communicator().attached(first_key, lambda: make("next")) is not first
    px.shutdown()
    assert closed == ["second", "first", "next"] and made == ["first", "second", "next"]


def test_timeout_comes_from_argument_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_TIMEOUT", "12")
    px.init()
    assert px.timeout() == 12
    px.shutdown()
    px.init(timeout=3)
    assert px.timeout() == 3
    px.shutdown()
    monkeypatch.setenv("PHALANX_TIMEOUT", "soon")
    with pytest.raises(px.ConfigurationError, match="PHALANX_TIMEOUT"):
        px.init()


def test_collectives_before_init_name_the_fix() -> None:
    with pytest.raises(px.NotInitializedError, match=r"px.init\(\)"):
        from phalanx.comm import runtime

        runtime.store()


def _describe_job() -> tuple:
    px.init()  # already initialised by the harness: a no-op
    return (px.rank(), px.size(), px.local_rank(), px.is_master(), dist.is_initialized(), dist.get_rank())


def test_ranks_and_the_default_process_group_in_a_real_job() -> None:
    described = run_workers(_describe_job, 3)
    assert described == [(r, 3, r, r == 0, True, r) for r in range(3)]


def _init_without_its_store(answers: Any) -> None:
    """A worker whose launcher's store is absent (nothing listens on port 9): px.init's error."""
    px.shutdown()  # this process's world of one, if a test here made it, is not the worker's
    os.environ.clear()
    os.environ.update({"PHALANX_RANK": "1", "PHALANX_WORLD_SIZE": "2", "PHALANX_LOCAL_RANK": "1",
                       "PHALANX_LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9",
                       "PHALANX_STORE_HOSTED": "1", "PATH": "/usr/bin:/bin"})
    started = time.monotonic()
    try:
        px.init(timeout=2)
        answers.put(("initialized", 0.0))
    except px.CollectiveTimeoutError as error:
        answers.put((str(error), time.monotonic() - started))


def test_rendezvous_with_an_absent_store_fails_clearly_within_the_timeout() -> None:
    """(Forked from this process, torch already imported: the environment is read at px.init.)"""
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    worker = context.Process(target=_init_without_its_store, args=(answers,), daemon=True)
    worker.start()
    try:
        said, seconds = answers.get(timeout=60)
    finally:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
    assert "rendezvous on rank 1 failed" in said, said
    assert seconds < 10, f"px.init(timeout=2) took {seconds:.1f}s to fail"


def _init_again_and_again() -> list[float]:
    """Leave the job and join it again twice (the Horovod pattern hvd.shutdown(); hvd.init())."""
    sums = []
    for _ in range(2):
        left = px.communicator()
        px.shutdown()
        px.init()
        assert px.communicator() is not left and left.closed
        with pytest.raises(px.GenerationClosedError):  # the group it used is gone: it must not be touched
            left.allreduce(torch.ones(3))
        sums.append(float(px.communicator().allreduce(torch.ones(3))[0]))
        sums.append(float(px.allreduce(torch.ones(2), algorithm="tree")[0]))
    net = torch.nn.Linear(4, 2)
    for _ in range(2):  # two segments of central storage in turn, the second under the first's names
        sums.append(float(px.CentralStorage().setup(net, torch.optim.SGD(net.parameters(), lr=0.1))[1].shared))
    return sums


def test_init_after_shutdown_joins_a_fresh_group() -> None:
    """The store still holds the first group's addresses and segment names: a new init must not use them."""
    assert run_workers(_init_again_and_again, 3) == [[3.0, 3.0, 3.0, 3.0, 1.0, 1.0]] * 3
