"""Learning-rate rules for large global batches: scaling, warm-up, and decay schedules.

A *schedule* is a function of the fractional epoch (``epoch + step_in_epoch / steps_per_epoch``)
that returns a learning rate; ``px.fit(lr_schedule=...)`` applies it before every step.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from phalanx.errors import ConfigurationError

Schedule = Callable[[float], float]


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
