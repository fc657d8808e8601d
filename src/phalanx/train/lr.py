"""Learning-rate rules for large global batches: scaling, warm-up, and decay schedules.

A *schedule* is a function of the fractional epoch (``epoch + step_in_epoch / steps_per_epoch``)
that returns a learning rate; ``px.fit(lr_schedule=...)`` applies it before every step. It also
takes any ``torch.optim.lr_scheduler`` object (stepped once per optimizer step, or per epoch:
:class:`Scheduled`), whose state is checkpointed with the run.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from phalanx.errors import ConfigurationError

Schedule = Callable[[float], float]
TorchScheduler = torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau


def scale_lr(base_lr: float, global_batch_size: int, base_batch_size: int, rule: str = "linear") -> float:
    """The learning rate for ``global_batch_size``, given one tuned for ``base_batch_size``.

    ``"linear"`` multiplies by the batch ratio (Goyal et al., 2017), ``"sqrt"`` by its square root
    (Krizhevsky, 2014; Hoffer et al., 2017), which suits adaptive optimizers better.
    """
    if global_batch_size <= 0 or base_batch_size <= 0:
        raise ConfigurationError("batch sizes must be positive.")
    ratio = global_batch_size / base_batch_size
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    raise ConfigurationError(f"rule must be 'linear' or 'sqrt', got {rule!r}.")


def constant(lr: float) -> Schedule:
    """The same rate throughout."""
    return lambda epoch: lr


def step_decay(lr: float, milestones: Sequence[float], gamma: float = 0.1) -> Schedule:
    """Multiply the rate by ``gamma`` at each milestone epoch (as in Goyal et al.: 30, 60, 80)."""
    return lambda epoch: lr * gamma ** sum(epoch >= m for m in milestones)


def cosine(lr: float, epochs: float, final_lr: float = 0.0) -> Schedule:
    """Cosine decay from ``lr`` to ``final_lr`` over ``epochs`` (Loshchilov & Hutter, 2017)."""
    return lambda epoch: final_lr + (lr - final_lr) * 0.5 * (1 + math.cos(math.pi * min(epoch / epochs, 1.0)))


def warmup(schedule: Schedule | float, epochs: float, start_factor: float = 0.0) -> Schedule:
    """Ramp linearly from ``start_factor`` times the scheduled rate up to it over ``epochs``.

    Goyal et al. (2017) warm up for 5 epochs from the single-worker rate to the scaled one,
    which avoids the early instability of a large learning rate. Composes with any schedule.
    """
    inner = constant(schedule) if isinstance(schedule, (int, float)) else schedule
    if epochs <= 0:
        return inner
    return lambda epoch: inner(epoch) * warmup_factor(epoch / epochs, start_factor)


def warmup_factor(progress: float, start_factor: float) -> float:
    """The warm-up multiplier after ``progress`` (0 to 1) of the warm-up."""
    return start_factor + (1.0 - start_factor) * min(max(progress, 0.0), 1.0)


class Scheduled:
    """A ``torch.optim.lr_scheduler`` object as ``px.fit``'s ``lr_schedule``, with when to step it.

    ``interval="step"`` steps it once per optimizer step (after the step, as a hand-written loop
    does; never per micro-batch or accumulation pass); ``"epoch"`` once per epoch, after
    validation. ``ReduceLROnPlateau`` is stepped per epoch with the logged value of ``monitor``
    (default ``"val_loss"``, or ``"loss"`` without validation data). A scheduler passed to ``px.fit``
    directly is wrapped with these defaults.
    """

    def __init__(self, scheduler: TorchScheduler, interval: str | None = None, monitor: str | None = None):
        plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        interval = interval or ("epoch" if plateau else "step")
        if interval not in ("step", "epoch"):
            raise ConfigurationError(f"Scheduled(interval=...) must be 'step' or 'epoch', got {interval!r}.")
        if plateau and interval != "epoch":
            raise ConfigurationError("ReduceLROnPlateau follows a metric logged once per epoch: use interval='epoch'.")
        self.scheduler, self.interval, self.monitor, self.plateau = scheduler, interval, monitor, plateau


class LearningRates:
    """The learning rates of every step: a schedule of the fractional epoch, a torch scheduler, or
    the optimizer's own rates. ``state.scheduled_lrs`` holds the rates the schedule set, so that a
    warm-up callback (:class:`~phalanx.train.callbacks.LRWarmup`) scales them for the coming step
    without compounding into the scheduler's next step."""

    def __init__(self, schedule: Schedule | Scheduled | TorchScheduler | None, optimizer: torch.optim.Optimizer | None,
                 validates: bool):
        if _is_scheduler(schedule):
            schedule = Scheduled(schedule)
        elif schedule is not None and not callable(schedule) and not isinstance(schedule, Scheduled):
            raise ConfigurationError(
                f"lr_schedule must be a function of the fractional epoch (px.lr.cosine(...)), a "
                f"torch.optim.lr_scheduler object or px.lr.Scheduled(...), got {type(schedule).__name__}.")
        if isinstance(schedule, Scheduled):
            owner = getattr(schedule.scheduler, "optimizer", optimizer)
            if owner is not optimizer and not (hasattr(optimizer, "holds") and optimizer.holds(owner)):
                raise ConfigurationError("the lr_schedule's scheduler was built around another optimizer than the one "
                                         "px.fit was given: build it around that optimizer.")
            schedule.monitor = schedule.monitor or ("val_loss" if validates else "loss")
        self.schedule = schedule

    @property
    def torch_scheduler(self) -> Scheduled | None:
        return self.schedule if isinstance(self.schedule, Scheduled) else None

    def before_step(self, state: Any) -> None:
        """Set every param group's rate for the coming step (the schedule's, or the last one set)."""
        if self.schedule is not None and self.torch_scheduler is None:
            rate = self.schedule(state.fractional_epoch)
            state.scheduled_lrs = [rate] * len(state.optimizer.param_groups)
        for group, rate in zip(state.optimizer.param_groups, state.scheduled_lrs):
            group["lr"] = rate

    def after_step(self, state: Any) -> None:
        """Step a per-step scheduler, from the rates it set (a warm-up's factor undone)."""
        scheduled = self.torch_scheduler
        if scheduled is not None and scheduled.interval == "step":
            self._step(state, scheduled, ())

    def after_epoch(self, state: Any, logs: dict[str, float]) -> None:
        """Step a per-epoch scheduler; ``ReduceLROnPlateau`` is given the monitored value."""
        scheduled = self.torch_scheduler
        if scheduled is None or scheduled.interval != "epoch":
            return
        if not scheduled.plateau:
            self._step(state, scheduled, ())
        elif scheduled.monitor not in logs:
            raise ConfigurationError(f"ReduceLROnPlateau monitors '{scheduled.monitor}', but the logs hold "
                                     f"{sorted(logs)}: pass px.lr.Scheduled(scheduler, monitor=...).")
        else:
            self._step(state, scheduled, (logs[scheduled.monitor],))

    @staticmethod
    def _step(state: Any, scheduled: Scheduled, args: tuple[float, ...]) -> None:
        for group, rate in zip(state.optimizer.param_groups, state.scheduled_lrs):
            group["lr"] = rate
        scheduled.scheduler.step(*args)
        state.scheduled_lrs = [group["lr"] for group in state.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        scheduled = self.torch_scheduler
        return {"scheduler": scheduled.scheduler.state_dict() if scheduled is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scheduled = self.torch_scheduler
        if scheduled is not None and state.get("scheduler") is not None:
            scheduled.scheduler.load_state_dict(state["scheduler"])


def _is_scheduler(schedule: Any) -> bool:
    """A torch scheduler, or an object like one (``step`` and ``state_dict``, not a function)."""
    if isinstance(schedule, TorchScheduler):
        return True
    return not callable(schedule) and hasattr(schedule, "step") and hasattr(schedule, "state_dict")
