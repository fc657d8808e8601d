"""Asynchronous work dealing: every task applied exactly once, lost work dealt again, staleness bounded."""

from __future__ import annotations

import torch

from phalanx.strategies.dealer import Dealer
from phalanx.strategies.protocol import Phase

SUMS = torch.ones(2, dtype=torch.float64)


def test_every_task_is_dealt_once_then_validation_then_done() -> None:
    dealer = Dealer(train_tasks=5, val_tasks=2, metric_values=2, max_staleness=None)
    dealt = []
    for _ in range(5):
        what, task, phase = dealer.deal(0, 0)
        dealt.append(task)
        dealer.confirm(0, SUMS)
    assert sorted(dealt) == list(range(5))
    assert dealer.deal(0, 0)[2] is Phase.VALIDATE and dealer.deal(1, 0)[2] is Phase.VALIDATE
    assert dealer.deal(2, 0) is None  # validation in flight elsewhere: wait
    dealer.confirm(0, SUMS)
    dealer.confirm(1, 2 * SUMS)
    assert dealer.deal(2, 0) == ("done", 0, Phase.TRAIN)
    assert dealer.finished[0].tolist() == [5.0, 5.0, 3.0, 3.0]  # training sums, then validation sums
    assert dealer.deal(0, 0) == ("done", 0, Phase.TRAIN)  # a late asker learns the same
    assert dealer.deal(0, 1)[:2] == ("task", 0)  # the next epoch starts afresh


def test_a_lost_workers_task_is_dealt_again_and_counted_once() -> None:
    dealer = Dealer(train_tasks=2, val_tasks=0, metric_values=2, max_staleness=None)
    assert dealer.deal(0, 0)[1] == 0
    assert dealer.deal(1, 0)[1] == 1
    dealer.lose(1)
    dealer.confirm(0, SUMS)
    assert dealer.deal(0, 0)[1] == 1
    dealer.confirm(0, SUMS)
    assert dealer.deal(0, 0)[0] == "done"
    assert dealer.finished[0][:2].tolist() == [2.0, 2.0]


def test_a_worker_too_far_ahead_waits_for_the_slowest() -> None:
    dealer = Dealer(train_tasks=100, val_tasks=0, metric_values=2, max_staleness=1)
    dealer.deal(1, 0)  # the slow worker holds a task and finishes none
    for _ in range(2):
        assert dealer.deal(0, 0)[0] == "task"
        dealer.confirm(0, SUMS)
    assert dealer.deal(0, 0) is None  # two ahead of a worker still on its first task: held
    dealer.confirm(1, SUMS)
    dealer.deal(1, 0)
    assert dealer.deal(0, 0)[0] == "task"  # the slow one caught up to within one
