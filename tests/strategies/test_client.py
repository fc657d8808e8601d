"""A worker's side of asynchronous dealing: a ``WAIT`` answer sends it back to follow its group."""

from __future__ import annotations

import pytest
import torch

from phalanx.comm import runtime
from phalanx.errors import CollectiveTimeoutError
from phalanx.strategies.client import Dealing, Task
from phalanx.strategies.protocol import Phase, Status


class _Client:
    """Answers with ``answers`` in turn (then always the last) and counts pulls and the sums sent."""

    def __init__(self, answers: list[Task]):
        self.answers, self.pulls, self.sums_sent = answers, 0, []

    def next_task(self, epoch: int, sums: torch.Tensor | None) -> Task:
        self.sums_sent.append(sums)
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def pull(self) -> None:
        self.pulls += 1


def test_a_worker_told_to_wait_follows_its_group_before_each_new_request_then_pulls() -> None:
    done = Task(Status.EPOCH_DONE, totals=torch.zeros(2, dtype=torch.float64))
    client = _Client([Task(Status.TASK, Phase.TRAIN, 0), Task(Status.WAIT, waited=True),
                      Task(Status.WAIT, waited=True), Task(Status.TASK, Phase.TRAIN, 1), done])
    follows: list[int] = []
    dealing = Dealing(client, 0, before_each=lambda: follows.append(len(client.sums_sent)))  # type: ignore[arg-type]
    steps = []
    for task in dealing:
        steps.append((task.step, client.pulls))
        dealing.report(torch.ones(2, dtype=torch.float64))
    assert follows == [0, 1, 2, 3, 4]  # before every request, the repeated ones too
    assert steps == [(0, 1), (1, 2)]  # the newest parameters pulled after the wait
    assert [s is None for s in client.sums_sent] == [True, False, True, True, False]  # sums sent once


def test_a_wait_longer_than_the_job_timeout_is_an_error_naming_the_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "timeout", lambda: 0.2)
    dealing = Dealing(_Client([Task(Status.WAIT, waited=True)]), 3, before_each=lambda: None)  # type: ignore[arg-type]
    with pytest.raises(CollectiveTimeoutError, match="dealt no task of epoch 3 for"):
        list(dealing)
