"""The epochs of asynchronous parameter servers: batches dealt on request, not in lockstep.

Each worker asks parameter server 0 for a task (one worker share of one global batch), trains on
it (the push and the pull are the optimizer step), and asks again; the request reports the
task's metric sums. Workers never wait for one another, so a lost worker costs only its batch,
which is dealt again (under ``--min-workers`` the others re-form their group between batches).
Once an epoch's training tasks are all applied, its validation batches are
dealt the same way, then every worker learns the epoch's global metrics from server 0, pulls
the final parameters and runs the epoch-end callbacks (checkpoints included) together.
``px.ParameterServer(mode="async").train`` runs them through px.fit's :class:`~phalanx.strategies.base.Run`.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from phalanx.strategies.base import Run
from phalanx.strategies.client import ServerClient, Task


def train_dealt(run: Run, client: ServerClient) -> None:
    """Train every remaining epoch on tasks dealt by parameter server 0."""
    state, hooks = run.state, run.hooks
    if not state.scheduled_lrs:
        state.scheduled_lrs = [group["lr"] for group in state.optimizer.param_groups]
    hooks.on_train_begin(state)
    for epoch in range(state.epoch, state.epochs):
        logs = _epoch(run, client, epoch)
        state.epoch, state.step = epoch + 1, 0
        state.history.append(epoch, logs)
        hooks.on_epoch_end(epoch, logs, state)
        if state.stop_training:
            break
    hooks.on_train_end(state)


def _epoch(run: Run, client: ServerClient, epoch: int) -> dict[str, float]:
    state, hooks = run.state, run.hooks
    state.model.train()
    state.epoch, state.step = epoch, 0
    hooks.on_epoch_begin(epoch, state)
    started, samples = time.perf_counter(), 0
    # a lost worker's batch is dealt again; an elastic group re-forms between batches
    dealing = client.deal(epoch, before_each=run.follow_membership)
    for task in dealing:
        if task.training:
            sums = _train_task(run, epoch, task)
            samples += state.loader.last_local_batch_size
            state.step, state.global_step = task.progress + 1, state.global_step + 1  # the epoch's progress
            hooks.on_step_end(task.step, {**_values(state.metrics, sums),
                                          "samples_per_s": samples / max(time.perf_counter() - started, 1e-9)}, state)
        else:
            sums = _validate_task(run, task)
        dealing.report(sums)
    totals = dealing.totals
    assert totals is not None
    half = totals.numel() // 2
    logs = _values(state.metrics, totals[:half])
    if run.val_loader is not None:
        logs.update(_values(state.metrics, totals[half:], "val_"))
    return logs


def _train_task(run: Run, epoch: int, task: Task) -> torch.Tensor:
    state = run.state
    batch = state.loader.batch_at(epoch, task.step, task.share, task.shares)
    state.step = task.step
    state.rates.before_step(state)
    run.hooks.on_step_begin(task.step, state)
    for metric in state.metrics:
        metric.reset()
    run.train_batch(batch)
    return _sums(state.metrics)


@torch.no_grad()
def _validate_task(run: Run, task: Task) -> torch.Tensor:
    metrics = run.fresh_metrics()
    run.state.model.eval()
    run.validate_batch(run.val_loader.batch_at(0, task.step, task.share, task.shares), metrics)
    run.state.model.train()
    return _sums(metrics)


def _sums(metrics: Sequence[Any]) -> torch.Tensor:
    return torch.tensor([value for m in metrics for value in (float(m.total), float(m.count))], dtype=torch.float64)


def _values(metrics: Sequence[Any], sums: torch.Tensor, prefix: str = "") -> dict[str, float]:
    pairs = sums.view(-1, 2).tolist()
    return {prefix + m.name: (total / count if count else float("nan")) for m, (total, count) in zip(metrics, pairs)}
