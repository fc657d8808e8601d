"""One training step, one evaluation pass, batches: shared by every way of driving epochs.

``px.fit``'s lockstep loop (:mod:`phalanx.train.loop`) and a strategy with epochs of its own (the
asynchronous parameter servers' :mod:`phalanx.strategies.dealt_epochs`, through the loop's
``FitRun``) run steps the same way; only how batches reach them differs. Both compute a batch's loss with the loop's step (``state.training_step(batch)``, a
``BatchStep``), whatever it is made of: ``loss_fn``, the user's ``step_fn`` or an overridden
:meth:`~phalanx.train.loop.Loop.training_step`.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Union

import torch
from torch import nn

from phalanx.comm import runtime
from phalanx.data._batch import map_tensors
from phalanx.errors import ConfigurationError, NonFiniteGradientError
from phalanx.parallel.clipping import Clipping
from phalanx.train.finite import NonFiniteGuard
from phalanx.train.metrics import Metric, reduce_metrics
from phalanx.train.precision import Precision
from phalanx.train.state import TrainState

#: A batch's mean loss, or ``(loss, outputs)`` for metrics beyond the loss: what a step returns.
StepResult = Union[torch.Tensor, tuple[torch.Tensor, Any]]
#: The loss of one batch already on this worker's device.
BatchStep = Callable[[Any], StepResult]


def train_step(state: TrainState, batch: Any) -> bool:
    """One optimizer step on this worker's ``batch``; the state's metrics count its samples. Whether
    the step was applied (``False``: every rank skipped it, under ``on_nonfinite="skip"``).

    The loss of a batch (or chunk) is ``state.training_step(batch)``; phalanx runs it under the
    precision's autocast, accumulates chunks, reduces, clips and steps around it (unless the step
    drives its own optimization: ``state.manual``). A non-finite loss or reduced gradient stops the
    step on every rank before it is applied (:mod:`phalanx.train.finite`).
    """
    state.optimizer.zero_grad(set_to_none=True)
    guard = state.guard
    guard.begin_step(position(state))
    batch = to_device(batch)
    if state.manual is not None:
        _own_step(state, batch)
        return not guard.skipped
    counts: list[tuple[Any, Any, torch.Tensor, int]] = []
    if state.exact is not None:
        inputs, targets = split_batch(batch)
        try:
            results = state.exact.backward(guard.watching(state.loss_fn), inputs, targets,
                                           state.loader.last_global_batch_size)
        except NonFiniteGradientError as error:  # raised on every rank by the exact sum
            guard.fail(cause=error)
            return False
        counts = [(outputs, micro_targets, loss, len(micro_targets)) for outputs, micro_targets, loss in results]
    elif samples_in(batch) == 0 and not state.model.passes_without_data:
        state.model.reduce_without_data()
    else:
        counts = _backward_in_chunks(state, batch)
    if not guard.allows_step(_parameters(state.optimizer)):
        state.optimizer.zero_grad(set_to_none=True)
        if guard.steps_on_its_own:
            state.optimizer.step()  # empty (no gradient, no change), but counted by the strategy's schedule
        return False
    for outputs, targets, loss, samples in counts:
        _count(state.metrics, outputs, targets, loss, samples)
    if not state.precision.step(state.optimizer, state.clipping):
        guard.after_overflow(state.precision.scaler.get_scale())
    return True


def position(state: TrainState) -> str:
    """Where the loop is, as messages say it: ``global step 17 (epoch 1, its step 5; counted from 0)``."""
    return f"global step {state.global_step} (epoch {state.epoch}, its step {state.step}; counted from 0)"


def _parameters(optimizer: Any) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def _backward_in_chunks(state: TrainState, batch: Any) -> list[tuple[Any, Any, torch.Tensor, int]]:
    """Forward and backward the batch's samples in ``state.accumulate_steps`` chunks, reducing over
    ranks only in the last: the gradient of the whole batch's mean loss, with one chunk's memory.
    Each chunk's ``(outputs, targets, loss, samples)``, for the metrics once the step is taken.

    A model whose hooks issue collectives inside its passes (``passes_without_data``) runs every
    chunk on every rank, an empty one as a pass without data, so that all ranks issue the same ones."""
    samples = samples_in(batch)
    every_pass = state.model.passes_without_data
    chunks = state.accumulate_steps if every_pass else min(state.accumulate_steps, samples)
    parts = split_samples(batch, chunks, state.accumulate_steps) if chunks > 1 else [batch]
    counts = []
    for index, part in enumerate(parts):
        with state.model.no_sync() if index < chunks - 1 else contextlib.nullcontext():
            if samples_in(part) == 0:
                _pass_without_data(state, part)
                continue
            share = samples_in(part) / samples
            with state.precision.autocast():
                loss, outputs, targets = checked(state.training_step(part), part, state.metrics)
            watched = state.guard.for_backward(loss)
            state.precision.backward(watched * share if share != 1 else watched)
        counts.append((outputs, targets, loss, samples_in(part)))
    return counts


def _pass_without_data(state: TrainState, batch: Any) -> None:
    """The forward and backward of a zero-row batch, adding nothing to the gradient: this rank still
    issues the collectives the model's hooks issue inside its passes (``px.Sharded``'s level 3 gathers
    each block there). The loss of no sample (NaN, for a mean) is multiplied by zero before the backward,
    and the model's buffers (BatchNorm's count of batches) are put back as they were."""
    buffers = [(buffer, buffer.clone()) for buffer in state.model.buffers()]
    with state.precision.autocast():
        loss, _, _ = checked(state.training_step(batch), batch, [])
    (loss * 0).backward()
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)


class ManualStep:
    """How a step that drives its own backward passes and optimizers runs them (a GAN's alternating
    updates, say): ``step_fn(model, batch, step)`` is given one, and
    :meth:`~phalanx.train.loop.Loop.backward`/``optimizer_step`` use the loop's. ``backward(loss)``
    runs backward (scaled under float16, outside autocast), and the gradient engine averages the
    gradients over workers as in any step; ``step(optimizer)`` clips that optimizer's gradients and
    steps it, skipping a float16 overflow on every rank alike, and stops at a non-finite loss or
    gradient as any step does (:mod:`phalanx.train.finite`). In validation both do nothing."""

    def __init__(self, precision: Precision, clipping: Clipping | None, guard: NonFiniteGuard | None = None):
        self.precision, self.clipping, self.training = precision, clipping, True
        self.guard = guard if guard is not None else NonFiniteGuard("ignore")

    def backward(self, loss: torch.Tensor) -> None:
        if self.training:
            self.precision.backward_outside_autocast(self.guard.for_backward(loss))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.training:
            return
        if self.guard.allows_step(_parameters(optimizer)):
            self.precision.apply(optimizer, self.clipping)
        else:
            optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def validating(self) -> Iterator[None]:
        """Within, ``backward`` and ``step`` do nothing: validation runs the training step as it is."""
        self.training = False
        try:
            yield
        finally:
            self.training = True


def _own_step(state: TrainState, batch: Any) -> None:
    """A step of the user's that drives its own backward passes and optimizers (see :class:`ManualStep`)."""
    with state.precision.autocast():
        loss, outputs, targets = checked(state.training_step(batch), batch, state.metrics)
    state.precision.update()
    if state.precision.scaler is not None:
        state.guard.after_overflow(state.precision.scaler.get_scale())
    if not state.guard.skipped:
        _count(state.metrics, outputs, targets, loss, samples_in(batch))


@torch.no_grad()
def _count(metrics: list[Metric], outputs: Any, targets: Any, loss: torch.Tensor, samples: int) -> None:
    """Add a batch's (or chunk's) outputs and mean loss, weighted by its samples, to ``metrics``."""
    for metric in metrics:
        metric.update(outputs, targets, loss.detach() * samples)


def loss_of(model: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: Any) -> tuple[torch.Tensor, Any]:
    """``(loss_fn(model(*inputs), targets), outputs)`` of a batch of ``(inputs..., targets)``."""
    inputs, targets = split_batch(batch)
    outputs = model(*inputs)
    return loss_fn(outputs, targets), outputs


def takes_step(step_fn: Callable) -> bool:
    """Whether ``step_fn`` drives its own backward and optimizers: it takes a third argument, the step."""
    positional = [p for p in inspect.signature(step_fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3


def checked(result: StepResult, batch: Any, metrics: list[Metric]) -> tuple[torch.Tensor, Any, Any]:
    """A step's ``loss`` or ``(loss, outputs)``, checked, with the batch's targets (its last part)."""
    loss, outputs = result if isinstance(result, tuple) else (result, None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ConfigurationError(
            f"the training step must return the batch's mean loss as a scalar tensor, or (loss, outputs); got "
            f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else f' of shape {list(loss.shape)}'}.")
    targets = batch[-1] if isinstance(batch, (tuple, list)) else torch.empty(samples_in(batch))
    if outputs is None and any(metric.name != "loss" for metric in metrics):
        raise ConfigurationError(
            f"metrics {[m.name for m in metrics if m.name != 'loss']} need the model's outputs: let the training "
            "step return (loss, outputs), with the targets last in the batch.")
    return loss, _detached(outputs), targets


def _detached(outputs: Any) -> Any:
    return outputs.detach() if isinstance(outputs, torch.Tensor) else outputs


def samples_in(batch: Any) -> int:
    """The samples in ``batch``: dim 0 of its first tensor (in tuples, lists and dicts); 0 without one."""
    first = _first_tensor(batch)
    if first is None:
        return 0
    return int(first.shape[0]) if first.dim() else 1


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    parts = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    return next((found for found in map(_first_tensor, parts) if found is not None), None)


def split_samples(batch: Any, chunks: int, accumulate_steps: int) -> list[Any]:
    """``batch`` cut into ``chunks`` parts along its samples (every tensor's first dimension)."""
    samples = samples_in(batch)

    def cut(part: Any) -> list[Any]:
        if isinstance(part, torch.Tensor) and part.dim() and part.shape[0] == samples:
            return list(torch.tensor_split(part, chunks))
        if isinstance(part, (tuple, list)):
            return [type(part)(pieces) for pieces in zip(*(cut(p) for p in part))]
        if isinstance(part, dict):
            split = {key: cut(value) for key, value in part.items()}
            return [{key: pieces[k] for key, pieces in split.items()} for k in range(chunks)]
        raise ConfigurationError(
            f"accumulate_steps={accumulate_steps} splits every part of a batch along its first dimension: give "
            "batches of tensors (in tuples, lists or dicts) with one row per sample, or accumulate_steps=1.")
    return cut(batch)


@torch.no_grad()
def evaluate_batches(model: nn.Module, step: BatchStep, loader: Any, metrics: list[Metric], prefix: str,
                     precision: Precision | None = None) -> dict[str, float]:
    """Global ``metrics`` of ``model`` over every worker's batches of ``loader`` (names get ``prefix``),
    each batch's loss from ``step``, forward and loss in ``precision`` (as in training)."""
    was_training = model.training
    model.eval()
    for metric in metrics:
        metric.reset()
    empty_too = getattr(model, "passes_without_data", False)  # a plain module (px.evaluate's) has no hooks
    for batch in loader:
        evaluate_batch(batch, step, metrics, precision, empty_too=empty_too)
    model.train(was_training)
    return reduce_metrics(metrics, prefix)


def evaluate_batch(batch: Any, step: BatchStep, metrics: list[Metric], precision: Precision | None,
                   empty_too: bool = False) -> None:
    """Add one batch's loss and outputs on this worker to ``metrics`` (forward and loss in ``precision``).
    An empty batch is skipped, or run for the collectives in the model's forward (``empty_too``)."""
    batch = to_device(batch)
    samples = samples_in(batch)
    if samples or empty_too:
        with precision.autocast() if precision is not None else contextlib.nullcontext():
            loss, outputs, targets = checked(step(batch), batch, metrics)
        if samples:
            _count(metrics, outputs, targets, loss, samples)


def split_batch(batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``(inputs..., targets)`` of a batch, refused with a clear error when it is not one."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ConfigurationError(
            "px.fit expects batches of (inputs..., targets); give a dataset whose items are (x, y) pairs, "
            "or a step_fn(model, batch) that computes the loss of batches of another shape."
        )
    return tuple(batch[:-1]), batch[-1]


def to_device(batch: Any) -> Any:
    """``batch`` with every tensor on this worker's device (copied asynchronously from pinned memory;
    a batch already there, as the loader hands it over on a GPU, is left as it is)."""
    device = runtime.device()
    return map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True))
