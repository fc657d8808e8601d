"""Asynchronous mode's work queue, kept by parameter server 0: which batch each worker takes next.

An epoch is cut into global batches as in synchronous training, and each global batch into one
*task* per worker share. Tasks are dealt on request, so a fast worker takes more of them than a
slow one, and each is dealt until it was applied: a task counts once its worker asks for the
next one (by then every server has applied its gradient), and a lost worker's task goes back
to the queue. Validation batches are dealt the same way once the epoch's training tasks are done.

The staleness bound lives here too: a worker more than ``max_staleness`` tasks ahead of the
slowest worker still computing is held until that one catches up.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from phalanx.strategies.protocol import Phase


@dataclass
class _Epoch:
    number: int
    phase: Phase
    queue: collections.deque[int]
    in_flight: dict[int, tuple[Phase, int]] = field(default_factory=dict)
    applied: int = 0  # training tasks applied so far
    sums: dict[Phase, torch.Tensor] = field(default_factory=dict)


class Dealer:
    """Deals the tasks of each epoch; the caller holds the lock and waits on its condition."""

    def __init__(self, train_tasks: int, val_tasks: int, metric_values: int, max_staleness: int | None):
        self.train_tasks = train_tasks
        self.val_tasks = val_tasks
        self.metric_values = metric_values
        self.max_staleness = max_staleness
        self.current: _Epoch | None = None
        self.finished: dict[int, torch.Tensor] = {}  # epoch -> train sums then validation sums
        self.done_tasks: collections.Counter[int] = collections.Counter()  # per worker, this epoch

    def confirm(self, worker: int, sums: torch.Tensor) -> None:
        """The worker's last task is applied everywhere: count it and its metric sums."""
        epoch = self.current
        if epoch is None or worker not in epoch.in_flight:
            return
        phase, _ = epoch.in_flight.pop(worker)
        if sums.numel():  # a worker that re-formed its group between two batches may have lost them
            epoch.sums.setdefault(phase, torch.zeros(self.metric_values, dtype=torch.float64)).add_(sums)
        if phase is Phase.TRAIN:
            self.done_tasks[worker] += 1
            epoch.applied += 1

    @property
    def applied(self) -> int:
        """Training tasks of the current epoch applied so far (for progress)."""
        return self.current.applied if self.current is not None else 0

    def lose(self, worker: int) -> None:
        """A lost worker's task goes back to the front of the queue."""
        epoch = self.current
        if epoch is not None and worker in epoch.in_flight:
            phase, task = epoch.in_flight.pop(worker)
            if phase is epoch.phase:
                epoch.queue.appendleft(task)
        self.done_tasks.pop(worker, None)

    def deal(self, worker: int, number: int) -> tuple[str, int, Phase] | None:
        """A task of epoch ``number`` for ``worker``: ``("task", index, phase)``, ``("done", 0, phase)``
        once the epoch is complete, or ``None``: wait (tasks are in flight, or the worker is too far ahead)."""
        if number in self.finished:
            return "done", 0, Phase.TRAIN
        epoch = self._epoch(number)
        if not epoch.queue and not epoch.in_flight:
            if epoch.phase is Phase.TRAIN and self.val_tasks:
                epoch.phase, epoch.queue = Phase.VALIDATE, collections.deque(range(self.val_tasks))
            else:
                self._finish(epoch)
                return "done", 0, Phase.TRAIN
        if not epoch.queue or self._too_far_ahead(worker, epoch):
            return None
        task = epoch.queue.popleft()
        epoch.in_flight[worker] = (epoch.phase, task)
        return "task", task, epoch.phase

    def _epoch(self, number: int) -> _Epoch:
        if self.current is None or self.current.number != number:
            self.current = _Epoch(number, Phase.TRAIN, collections.deque(range(self.train_tasks)))
            self.done_tasks.clear()
        return self.current

    def _finish(self, epoch: _Epoch) -> None:
        zero = torch.zeros(self.metric_values, dtype=torch.float64)
        self.finished[epoch.number] = torch.cat([epoch.sums.get(Phase.TRAIN, zero),
                                                 epoch.sums.get(Phase.VALIDATE, zero)])

    def _too_far_ahead(self, worker: int, epoch: _Epoch) -> bool:
        """Stale-synchronous bound: ahead of the slowest worker computing a training task by more than k."""
        if self.max_staleness is None or epoch.phase is not Phase.TRAIN:
            return False
        computing = [self.done_tasks[w] for w, (phase, _) in epoch.in_flight.items() if phase is Phase.TRAIN]
        return bool(computing) and self.done_tasks[worker] - min(computing) > self.max_staleness
