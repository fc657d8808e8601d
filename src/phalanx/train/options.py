"""The checks of a ``px.fit`` call's options: each refuses, before anything trains, a setting
phalanx could not honour or two settings that disagree, and says what to do instead."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

from phalanx.comm import runtime
from phalanx.data import DistributedLoader
from phalanx.errors import ConfigurationError
from phalanx.parallel.data_parallel import DataParallel
from phalanx.strategies.base import OptimizerLike, Strategy, held_bytes
from phalanx.train import callbacks as cb


def check_accumulation(accumulate_steps: int, reproducible: bool) -> None:
    """``accumulate_steps`` is a whole number, and not combined with reproducible mode's micro-batches."""
    if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
        raise ConfigurationError(f"accumulate_steps must be a whole number of at least 1, got {accumulate_steps!r}.")
    if accumulate_steps > 1 and reproducible:
        raise ConfigurationError(
            "reproducible=True already runs every step in micro-batches of micro_batch_size samples, so its memory "
            "is that of one micro-batch: drop accumulate_steps.")


def check_step(loss_fn: Callable | None, step_fn: Callable | None, overridden: bool, manual: bool,
               reproducible: bool, accumulate_steps: int) -> None:
    """Refuse a loss given twice or not at all (``loss_fn``, ``step_fn``, an ``overridden``
    training step), or a step phalanx cannot run as asked."""
    if overridden and step_fn is not None:
        raise ConfigurationError("this Loop overrides training_step and was given step_fn= too: drop step_fn "
                                 "(your training_step computes the loss).")
    if not overridden and (loss_fn is None) == (step_fn is None):
        raise ConfigurationError(
            "px.fit computes each batch's loss with loss_fn(model(*inputs), targets) or with your step_fn(model, "
            "batch): give exactly one (loss_fn=None with step_fn=).")
    if reproducible and (overridden or step_fn is not None):
        raise ConfigurationError("reproducible=True with your own training step: reproducible mode runs the model "
                                 "on its own micro-batches through loss_fn; use loss_fn, or reproducible=False.")
    if manual and accumulate_steps > 1:
        raise ConfigurationError(f"accumulate_steps={accumulate_steps} with a training step that runs its own "
                                 "backward passes: phalanx cannot split them; accumulate inside your step, or use "
                                 "accumulate_steps=1.")


def check_precision(precision: str, reproducible: bool) -> None:
    """Bitwise reproducibility is promised in float32 only."""
    if reproducible and precision != "32":
        raise ConfigurationError(
            f"reproducible=True with precision={precision!r}: bitwise identical weights across worker counts are "
            "promised in float32 only; use precision='32' for reproducible runs.")


def check_one_meaning(model: nn.Module, train_data: Any, global_batch_size: int, accumulate_steps: int) -> None:
    """Refuse two settings of one thing that disagree, naming both: a silent winner trains another model."""
    if isinstance(model, DataParallel) and model.accumulate_steps > 1:
        both = f" and px.fit(accumulate_steps={accumulate_steps}) both set" if accumulate_steps > 1 else " sets"
        raise ConfigurationError(
            f"px.DataParallel(accumulate_steps={model.accumulate_steps}){both} gradient accumulation, but px.fit "
            f"accumulates itself: pass accumulate_steps={max(model.accumulate_steps, accumulate_steps)} to px.fit "
            "only and build px.DataParallel without it.")
    if isinstance(train_data, DistributedLoader) and train_data.global_batch_size != global_batch_size:
        raise ConfigurationError(
            f"train_data is a DistributedLoader with global_batch_size={train_data.global_batch_size}, but px.fit "
            f"got global_batch_size={global_batch_size}; give both the same value.")


def check_checkpoints(checkpoint_dir: str | Path | None, checkpoint_every: int | None, user: Sequence[Any]) -> None:
    """A checkpoint setting that would be ignored, or a Checkpoint callback writing where px.fit does
    not resume from, is refused: either would lose the run's checkpoints in silence."""
    if checkpoint_every is not None and checkpoint_dir is None:
        raise ConfigurationError(f"checkpoint_every={checkpoint_every} needs checkpoint_dir=: where to write them.")
    for callback in user:
        if isinstance(callback, cb.Checkpoint) and checkpoint_dir is not None and \
                Path(callback.directory).resolve() != Path(checkpoint_dir).resolve():
            raise ConfigurationError(
                f"callbacks holds px.callbacks.Checkpoint('{callback.directory}'), but px.fit resumes from "
                f"checkpoint_dir='{checkpoint_dir}'; give both the same folder (or drop one).")


def check_not_empty(loader: DistributedLoader, name: str) -> None:
    """An epoch without a step would report ``nan`` and train nothing: say so before training."""
    try:
        if len(loader) > 0:
            return
    except TypeError:  # a stream of unknown length: its first epoch will tell
        return
    if loader.drop_last:
        raise ConfigurationError(
            f"{name} has fewer samples than one global batch of {loader.global_batch_size} and its loader drops the "
            "last partial batch (drop_last=True), so an epoch has no step: use a smaller global_batch_size or "
            "drop_last=False.")
    raise ConfigurationError(f"{name} holds no samples: px.fit needs at least one.")


def micro_batch_size_for(reproducible: bool, micro_batch_size: int | None) -> int | None:
    """Reproducible mode's micro-batch size (required there, refused elsewhere); ``None`` outside it."""
    if not reproducible:
        if micro_batch_size is not None:
            raise ConfigurationError(
                f"micro_batch_size={micro_batch_size} is reproducible mode's unit of work: add reproducible=True, "
                f"or, to bound memory, use accumulate_steps instead.")
        return None
    if micro_batch_size is None:
        raise ConfigurationError(
            "reproducible=True needs micro_batch_size: the fixed number of samples every kernel call sees, "
            "whatever the number of workers (for example 2 or 8; the global batch must hold at least one "
            "micro-batch per worker)."
        )
    return micro_batch_size


def check_memory(strategy: Strategy, model: nn.Module, optimizer: OptimizerLike, max_memory_gb: float | None) -> None:
    """Refuse, before anything trains, a run whose parameters, gradients and optimizer state would
    take more than ``max_memory_gb`` per worker, naming what it needs and the sharding level that fits."""
    if max_memory_gb is None:
        return
    if not max_memory_gb > 0:
        raise ConfigurationError(f"max_memory_gb must be a positive number of GiB, got {max_memory_gb!r}.")
    limit, workers = max_memory_gb * 2**30, runtime.size()
    needed = strategy.memory_needed(model, optimizer)
    if needed <= limit:
        return
    levels = {level: held_bytes(model, optimizer, level, workers) for level in (1, 2, 3)}
    fitting = [level for level, held in levels.items() if held <= limit]
    if fitting:
        advice = (f"strategy=px.Sharded(level={fitting[0]}) holds {levels[fitting[0]] / 2**30:.3g} GiB per worker at "
                  f"{workers} workers")
    else:
        whole = held_bytes(model, optimizer, 0, 1)
        advice = (f"no sharding level fits at {workers} workers; px.Sharded(level=3) fits from "
                  f"{math.ceil(whole / limit)} workers")
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    raise ConfigurationError(
        f"{strategy.name} needs about {needed / 2**30:.3g} GiB per worker for the parameters, gradients and "
        f"{type(optimizer).__name__}'s state of {parameters:,} parameters, more than max_memory_gb={max_memory_gb:g} "
        f"(activations come on top): {advice}.")
