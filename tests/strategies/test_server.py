"""Parameter server 0's answer to a request for a task: never held longer than a short wait."""

from __future__ import annotations

import threading
import time

import torch

from phalanx.strategies.dealer import Dealer
from phalanx.strategies.protocol import Phase, Status
from phalanx.strategies.server import DEAL_WAIT_S, Server

NO_SUMS = torch.zeros(0, dtype=torch.float64)


class _Recorder:
    """A channel that keeps what the server sends."""

    def __init__(self) -> None:
        self.sent: list[list[int]] = []

    def send(self, tensors: list[torch.Tensor], tag: int) -> None:
        self.sent.append(tensors[0].tolist())


def _server(dealer: Dealer, timeout_s: float) -> Server:
    return Server(shard=None, server=0, mode="async", workers=2, timeout_s=timeout_s, dealer=dealer)  # type: ignore[arg-type]


def test_a_worker_whose_tasks_are_all_held_elsewhere_is_told_to_ask_again_not_held() -> None:
    """The last task in flight at a worker that is re-forming the group (which needs the asker
    too): holding the asker until that task comes back would wait out the job's timeout."""
    dealer = Dealer(train_tasks=1, val_tasks=0, metric_values=2, max_staleness=None)
    server = _server(dealer, timeout_s=30.0)
    assert dealer.deal(1, 0) == ("task", 0, Phase.TRAIN)  # worker 1 holds the epoch's only task
    channel = _Recorder()
    started = time.monotonic()
    server._next(0, channel, 0, NO_SUMS)  # type: ignore[arg-type]
    assert time.monotonic() - started < DEAL_WAIT_S + 1.0
    assert channel.sent[0][0] == Status.WAIT


def test_a_task_freed_while_waiting_is_dealt_at_once() -> None:
    dealer = Dealer(train_tasks=1, val_tasks=0, metric_values=2, max_staleness=None)
    server = _server(dealer, timeout_s=30.0)
    dealer.deal(1, 0)
    channel = _Recorder()

    def lose_worker_1() -> None:
        time.sleep(DEAL_WAIT_S / 5)
        server.live.add(1)
        server._lose(1, RuntimeError("killed"))  # its task goes back to the queue

    threading.Thread(target=lose_worker_1).start()
    server._next(0, channel, 0, NO_SUMS)  # type: ignore[arg-type]
    status, waited, *_, task, _ = channel.sent[0]
    assert (status, waited, task) == (Status.TASK, 1, 0)
