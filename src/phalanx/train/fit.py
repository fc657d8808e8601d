"""``px.fit``: train a model on every worker with global-batch semantics, in one call."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from phalanx.comm import runtime
from phalanx.errors import ConfigurationError
from phalanx.strategies.base import Strategy
from phalanx.train import horizon
from phalanx.train.loop import Loop, batch_device, loader_for
from phalanx.train.lr import Schedule, Scheduled, TorchScheduler
from phalanx.train.metrics import Metric, resolve
from phalanx.train.state import History
from phalanx.train.steps import StepResult, evaluate_batches, loss_of


def fit(model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loss_fn: Callable[..., torch.Tensor] | None, train_data: Any, *, epochs: int, global_batch_size: int,
        val_data: Any = None, metrics: Sequence[str | Metric] = (),
        callbacks: Sequence[Any] = (), seed: int | None = None,
        lr_schedule: Schedule | Scheduled | TorchScheduler | None = None,
        checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, resume: bool = True,
        reproducible: bool = False, micro_batch_size: int | None = None, accumulate_steps: int = 1,
        precision: str = "32", clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
        step_fn: Callable[..., StepResult] | None = None,
        verbose: int = 1, log_dir: str | Path | None = None, strategy: Strategy | None = None,
        on_nonfinite: str = "raise", data_on_device: bool | None = None,
        max_memory_gb: float | None = None) -> History:
    """Train ``model`` for ``epochs`` epochs over ``train_data`` on every worker of the job.

    ``global_batch_size`` is the batch of one optimizer step summed over all workers; each worker
    takes its sample-level share, and the result does not depend on the number of workers.
    ``loss_fn(outputs, targets)`` must return the mean over its samples; or, for batches of another
    shape, a model that computes its own loss or an extra term, ``step_fn(model, batch)`` returns the
    batch's mean loss (or ``(loss, outputs)`` for metrics beyond the loss) in place of
    ``loss_fn`` (pass ``None``): phalanx still runs precision, accumulation, reduction, clipping
    and the step around it, in training and validation. A ``step_fn(model, batch, step)`` that takes
    a third argument drives its own backward passes and optimizers (``step.backward(loss)``,
    ``step.step(optimizer)``: a GAN's alternating updates), see :class:`~phalanx.train.steps.ManualStep`.
    ``train_data`` is a dataset, tensors, or a :class:`~phalanx.data.DistributedLoader`; batches are
    ``(inputs..., targets)``; a ``torch.utils.data.DataLoader`` keeps its dataset and loading settings
    and gets phalanx's distributed sampler (:mod:`phalanx.data.torch_loaders`). With
    ``checkpoint_dir`` a checkpoint is written every epoch (and every ``checkpoint_every`` steps),
    and ``resume=True`` continues from the newest readable one (rank 0 says which, and when training
    was already complete).
    To write the step as a method instead, subclass :class:`~phalanx.train.loop.Loop` (this function
    is ``Loop(...).fit(train_data, val_data)``).
    ``reproducible=True`` with ``micro_batch_size=m`` makes the trained weights bitwise identical
    for any number of workers (see :mod:`phalanx.parallel.exact` and docs/reproducibility.md).
    ``accumulate_steps=k`` runs each worker's share of a step in ``k`` forward-backward passes and
    reduces over workers once, in the last: the same step with ``1/k`` of the activation memory, so
    a global batch ``k`` times larger costs no more memory and one allreduce (``phalanx doctor``'s
    accumulation advice).
    ``precision`` is ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"`` (autocast in forward and loss; for
    float16 a gradient scaler whose overflow skips are agreed by every rank, checkpointed with the
    run). ``clip_grad_norm``/``clip_grad_value`` clip the global (reduced) gradient before each step,
    after unscaling; see :mod:`phalanx.train.precision`. ``lr_schedule`` is a function of the
    fractional epoch (:mod:`phalanx.train.lr`) or a ``torch.optim.lr_scheduler`` object, stepped
    once per optimizer step (``px.lr.Scheduled(s, interval="epoch")`` for per epoch;
    ``ReduceLROnPlateau`` is fed ``val_loss`` each epoch); its state is checkpointed.
    ``optimizer`` may be a list, one optimizer per part of the model (:mod:`phalanx.train.optimizers`).
    ``strategy`` places parameters and optimizer state otherwise than on every worker (the default,
    :class:`~phalanx.strategies.base.Replicated`, is ``px.DataParallel``'s; each strategy refuses the
    options it cannot honour, naming the pair):
    :class:`px.ParameterServer <phalanx.strategies.parameter_server.ParameterServer>` (in a server
    process ``fit`` serves, and returns the workers' history) or
    :class:`px.CentralStorage <phalanx.strategies.central_storage.CentralStorage>`; see docs/strategies.md.
    A loss or averaged gradient that goes NaN or Inf stops the run on every rank before the step is
    applied (``px.NonFiniteLossError``/``px.NonFiniteGradientError`` naming the step and the ranks),
    so no checkpoint ever holds non-finite weights; ``on_nonfinite="skip"`` skips such steps on
    every rank instead, ``"ignore"`` applies them (see :mod:`phalanx.train.finite`).
    On a GPU, a dataset of tensors that takes at most half its free memory is kept there for the run
    and batches are gathered on it (``data_on_device=None``, said in the plan line); other data, or
    ``data_on_device=False``, is copied batch by batch on a side stream, one step ahead.
    ``max_memory_gb`` bounds what a worker may hold for parameters, gradients and optimizer state:
    a run that would need more is refused before it trains, naming the need and the
    ``px.Sharded`` level that fits (:class:`px.Sharded <phalanx.strategies.sharded.Sharded>`,
    docs/sharding.md, which ``strategy`` also takes).
    Returns the per-epoch :class:`History` of global metrics, the same on every rank.
    """
    loop = Loop(model, optimizer, loss_fn, epochs=epochs, global_batch_size=global_batch_size, metrics=metrics,
                callbacks=callbacks, seed=seed, lr_schedule=lr_schedule, checkpoint_dir=checkpoint_dir,
                checkpoint_every=checkpoint_every, resume=resume, reproducible=reproducible,
                micro_batch_size=micro_batch_size, accumulate_steps=accumulate_steps, precision=precision,
                clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value, step_fn=step_fn, verbose=verbose,
                log_dir=log_dir, strategy=strategy, on_nonfinite=on_nonfinite,
                data_on_device=data_on_device, max_memory_gb=max_memory_gb)
    return loop.fit(train_data, val_data)


def evaluate(model: nn.Module, loss_fn: Callable[..., torch.Tensor], data: Any, *, global_batch_size: int,
             metrics: Sequence[str | Metric] = ()) -> dict[str, float]:
    """Global loss and metrics of ``model`` over ``data``, each worker evaluating its share."""
    runtime.init()
    return evaluate_batches(model, lambda batch: loss_of(model, loss_fn, batch),
                            loader_for(data, global_batch_size, 0, shuffle=False, argument="data",
                                       call="px.evaluate", device=batch_device(None)), resolve(metrics), "")


def steps_per_epoch(train_data: Any, *, global_batch_size: int) -> int:
    """The optimizer steps ``px.fit`` takes in one epoch of ``train_data`` (joining the job first, as
    ``px.fit`` does, since a DataLoader's ``batch_size`` may be read as one worker's share): what a
    per-step schedule such as ``OneCycleLR(steps_per_epoch=...)`` needs, where ``len(train_loader)``
    may count something else."""
    runtime.init()
    plan = horizon.plan_for(loader_for(train_data, global_batch_size, 0, shuffle=False), 1, train_data)
    if plan.steps_per_epoch is None:
        raise ConfigurationError("train_data is a stream of unknown length, so its steps per epoch are not known "
                                 "before it is read: give the schedule a horizon of your own, or a dataset with "
                                 "__len__.")
    return plan.steps_per_epoch


def estimated_stepping_batches(train_data: Any, *, epochs: int, global_batch_size: int) -> int:
    """The optimizer steps of ``px.fit(..., train_data, epochs=epochs, global_batch_size=...)`` over the
    whole run (Lightning's ``estimated_stepping_batches``): ``OneCycleLR(total_steps=...)``,
    ``CosineAnnealingLR(T_max=...)``. The loop checks such horizons against it before training."""
    return steps_per_epoch(train_data, global_batch_size=global_batch_size) * epochs
