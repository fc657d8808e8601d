"""One training step, one evaluation pass, batches: shared by both loops.

``px.fit``'s loop (:mod:`phalanx.train.fit`) and the asynchronous parameter-server loop
(:mod:`phalanx.train.async_loop`) run steps the same way; only how batches reach them differs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from phalanx.comm import runtime
from phalanx.errors import ConfigurationError
from phalanx.train.metrics import Metric, reduce_metrics
from phalanx.train.precision import Precision
from phalanx.train.state import TrainState


def train_step(state: TrainState, batch: Any, loss_fn: Callable) -> None:
    """One optimizer step on this worker's ``batch``; the state's metrics count its samples."""
    inputs, targets = split_batch(batch)
    metrics = state.metrics
    state.optimizer.zero_grad(set_to_none=True)
    if state.exact is not None:
        for outputs, micro_targets, loss in state.exact.backward(loss_fn, inputs, targets,
                                                                 state.loader.last_global_batch_size):
            for metric in metrics:
                metric.update(outputs, micro_targets, loss * len(micro_targets))
    elif len(targets) == 0:
        state.model.reduce_without_data()
    else:
        _backward_in_chunks(state, inputs, targets, loss_fn)
    state.precision.step(state.optimizer, state.clipping)


def _backward_in_chunks(state: TrainState, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor,
                        loss_fn: Callable) -> None:
    """Forward and backward ``targets``' samples in ``state.accumulate_steps`` chunks, reducing over
    ranks only in the last: the gradient of the whole batch's mean loss, with one chunk's memory."""
    chunks = min(state.accumulate_steps, len(targets))
    if chunks > 1 and not all(isinstance(part, torch.Tensor) and len(part) == len(targets) for part in inputs):
        raise ConfigurationError(
            f"accumulate_steps={state.accumulate_steps} splits every input of a batch along its first dimension, "
            "like the targets: give batches of tensors with one row per sample, or accumulate_steps=1.")
    whole = (*inputs, targets)
    parts = zip(*(torch.tensor_split(part, chunks) for part in whole)) if chunks > 1 else [whole]
    for index, (*chunk_inputs, chunk_targets) in enumerate(parts):
        share = len(chunk_targets) / len(targets)
        with state.model.no_sync() if index < chunks - 1 else contextlib.nullcontext():
            with state.precision.autocast():
                outputs = state.model(*chunk_inputs)
                loss = loss_fn(outputs, chunk_targets)
            state.precision.backward(loss * share if share != 1 else loss)
        with torch.no_grad():
            for metric in state.metrics:
                metric.update(outputs.detach(), chunk_targets, loss.detach() * len(chunk_targets))


@torch.no_grad()
def evaluate_batches(model: nn.Module, loss_fn: Callable, loader: Any, metrics: list[Metric],
                     prefix: str, precision: Precision | None = None) -> dict[str, float]:
    """Global ``metrics`` of ``model`` over every worker's batches of ``loader`` (names get ``prefix``),
    forward and loss in ``precision`` (as in training)."""
    was_training = model.training
    model.eval()
    for metric in metrics:
        metric.reset()
    for batch in loader:
        inputs, targets = split_batch(batch)
        if len(targets):
            with precision.autocast() if precision is not None else contextlib.nullcontext():
                outputs = model(*inputs)
                loss = loss_fn(outputs, targets)
            for metric in metrics:
                metric.update(outputs, targets, loss * len(targets))
    model.train(was_training)
    return reduce_metrics(metrics, prefix)


def split_batch(batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``(inputs..., targets)`` moved to this worker's device."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ConfigurationError(
            "px.fit expects batches of (inputs..., targets); give a dataset whose items are (x, y) pairs."
        )
    device = runtime.device()
    moved = [part.to(device, non_blocking=True) if isinstance(part, torch.Tensor) else part for part in batch]
    return tuple(moved[:-1]), moved[-1]
