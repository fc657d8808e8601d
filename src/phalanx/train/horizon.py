"""How many optimizer steps a run will take, said before it trains, and schedulers checked against it.

A DataLoader handed to ``px.fit`` may be read two ways (its ``batch_size`` as the global batch, or
as each worker's share of it), so ``len(train_loader)`` is not always the number of steps an epoch:
at 2 workers with ``batch_size=64`` and ``global_batch_size=128`` it counts 24 batches of 64 while
the loop takes 12 steps. A schedule sized from it would run half way and end at the wrong rate in
silence. So the loop states how it reads the data (:class:`Plan`), exposes the number of steps
(``px.estimated_stepping_batches``, as Lightning's trainer does) and refuses or warns, before
training, when a torch scheduler's horizon disagrees with it.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from phalanx.data import DistributedLoader
from phalanx.errors import ConfigurationError
from phalanx.train.lr import Scheduled

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """How a run reads its training data: batches, workers, steps."""

    global_batch_size: int
    world_size: int
    epochs: int
    steps_per_epoch: int | None  # None: a stream of unknown length
    samples: int | None = None
    dataloader_batch_size: int | None = None  # the batch_size of a torch DataLoader that was given
    dataloader_length: int | None = None  # and its len(): batches of that size, not always steps
    placement: str | None = None  # where batches are built on an accelerator, and why

    @property
    def total_steps(self) -> int | None:
        """Optimizer steps over the whole run (``None`` for a stream of unknown length)."""
        return None if self.steps_per_epoch is None else self.steps_per_epoch * self.epochs

    def describe(self) -> str:
        """One line a user reads before training starts."""
        low, high = self.global_batch_size // self.world_size, -(-self.global_batch_size // self.world_size)
        share = f"{low}" if low == high else f"{low}-{high}"
        data = "a stream" if self.samples is None else f"{self.samples} samples"
        workers = "on 1 worker" if self.world_size == 1 else f"({share} on each of {self.world_size} workers)"
        line = f"train_data: {data} in global batches of {self.global_batch_size} {workers}"
        if self.dataloader_batch_size is not None:
            reading = ("the global batch" if self.dataloader_batch_size == self.global_batch_size
                       else "each worker's share of the global batch")
            line += f"; the DataLoader's batch_size={self.dataloader_batch_size} is read as {reading}"
        if self.steps_per_epoch is None:
            line += f"; {self.epochs} epochs of unknown length"
        else:
            line += (f"; {self.steps_per_epoch} steps an epoch x {self.epochs} epochs = {self.total_steps} "
                     "optimizer steps")
        return line if self.placement is None else f"{line}; {self.placement}"


def plan_for(loader: DistributedLoader, epochs: int, given: object) -> Plan:
    """The :class:`Plan` of training ``epochs`` epochs over ``loader``, made from ``given`` (the user's train_data)."""
    try:
        steps: int | None = len(loader)
    except TypeError:  # a stream of unknown length
        steps = None
    dataloader = given if isinstance(given, torch.utils.data.DataLoader) else None
    try:
        dataloader_length: int | None = len(dataloader) if dataloader is not None else None
    except TypeError:
        dataloader_length = None
    return Plan(loader.global_batch_size, loader.world_size, epochs, steps, loader.num_samples,
                dataloader.batch_size if dataloader is not None else None, dataloader_length,
                loader.placement.reason if loader.placement is not None else None)


def check_scheduler(scheduled: Scheduled | None, plan: Plan) -> None:
    """Refuse a torch scheduler whose horizon cannot fit the run (OneCycleLR's total steps), and warn
    where one likely does not (CosineAnnealingLR's ``T_max``, a ``total_iters`` past the run's end)."""
    if scheduled is None or plan.total_steps is None:
        return
    scheduler = scheduled.scheduler
    per_step = scheduled.interval == "step"
    run, unit = (plan.total_steps, "optimizer steps") if per_step else (plan.epochs, "epochs")
    how = (f"px.fit will take {plan.total_steps} optimizer steps ({plan.steps_per_epoch} an epoch x {plan.epochs} "
           f"epochs{_dataloader_note(plan)})")
    fix = (f"px.estimated_stepping_batches(train_data, epochs={plan.epochs}, global_batch_size="
           f"{plan.global_batch_size}) gives {plan.total_steps}")
    name = type(scheduler).__name__
    if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        horizon = scheduler.total_steps
        if per_step and horizon != run:
            ending = (f"stop half way at a high rate (its step {run} of {horizon})" if horizon > run else
                      f"fail at step {horizon + 1}")
            raise ConfigurationError(
                f"lr_schedule: OneCycleLR was built for {horizon} steps, but {how}, so the schedule would {ending}. "
                f"Build it with total_steps={run} (or epochs={plan.epochs}, steps_per_epoch={plan.steps_per_epoch}); "
                f"{fix}.")
        return
    horizon_of = {torch.optim.lr_scheduler.CosineAnnealingLR: "T_max",
                  torch.optim.lr_scheduler.LinearLR: "total_iters",
                  torch.optim.lr_scheduler.PolynomialLR: "total_iters"}
    attribute = next((attr for kind, attr in horizon_of.items() if isinstance(scheduler, kind)), None)
    if attribute is None:
        return
    horizon = getattr(scheduler, attribute)
    cosine = attribute == "T_max"
    if (cosine and horizon != run) or (not cosine and horizon > run):
        warnings.warn(f"phalanx: lr_schedule {name}({attribute}={horizon}) does not match the run: it takes {run} "
                      f"{unit}; {how}. If that is not meant, build it with {attribute}={run} ({fix}).", stacklevel=4)


def _dataloader_note(plan: Plan) -> str:
    if plan.dataloader_batch_size is None or plan.dataloader_batch_size == plan.global_batch_size:
        return ""
    return (f"; the DataLoader's batch_size={plan.dataloader_batch_size} is each of {plan.world_size} workers' share "
            f"of the global batch of {plan.global_batch_size}, so len(DataLoader)={plan.dataloader_length} counts "
            "its batches, not steps")
