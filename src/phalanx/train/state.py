"""What the fit loop knows at any moment, shared with callbacks, and the per-epoch history."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.parallel.clipping import Clipping
from phalanx.train.finite import NonFiniteGuard
from phalanx.train.lr import LearningRates
from phalanx.train.precision import Precision


class History:
    """Per-epoch logs, identical on every rank: ``history["val_accuracy"][-1]``."""

    def __init__(self, records: dict[str, list[float]] | None = None, epochs: list[int] | None = None):
        self.history: dict[str, list[float]] = {k: list(v) for k, v in (records or {}).items()}
        self.epochs: list[int] = list(epochs or [])

    def append(self, epoch: int, logs: dict[str, float]) -> None:
        self.epochs.append(epoch)
        for key, value in logs.items():
            self.history.setdefault(key, []).append(float(value))

    def __getitem__(self, key: str) -> list[float]:
        return self.history[key]

    def __contains__(self, key: str) -> bool:
        return key in self.history

    def last(self) -> dict[str, float]:
        """The logs of the latest epoch."""
        return {key: values[-1] for key, values in self.history.items() if values}

    def state_dict(self) -> dict[str, Any]:
        return {"records": self.history, "epochs": self.epochs}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "History":
        return cls(state["records"], state["epochs"])

    def __repr__(self) -> str:
        return f"History(epochs={self.epochs}, last={self.last()})"


@dataclass
class TrainState:
    """The loop's position and objects. ``epoch`` is counted from 0; ``step`` counts completed steps
    in the current epoch, ``global_step`` since the run began (docs/training.md lists every field)."""

    model: Any
    optimizer: torch.optim.Optimizer
    loader: Any
    epochs: int
    epoch: int = 0
    step: int = 0
    global_step: int = 0
    history: History = field(default_factory=History)
    scheduled_lrs: list[float] = field(default_factory=list)
    stop_training: bool = False
    seed: int = 0
    metrics: list = field(default_factory=list)
    exact: Any = None
    accumulate_steps: int = 1  # forward and backward passes per step, each over a chunk of the local batch
    precision: Precision = field(default_factory=Precision)  # autocast, the float16 scaler, the step
    clipping: Clipping | None = None  # of the reduced gradients, before the step
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)  # stops or skips a non-finite step
    loss_fn: Any = None  # loss_fn(outputs, targets), or None when the training step computes the loss
    training_step: Any = None  # batch -> loss | (loss, outputs): the loop's (phalanx.train.steps.BatchStep)
    validation_step: Any = None  # the same, in validation
    manual: Any = None  # the ManualStep of a training step that drives its own optimization, else None
    rates: LearningRates = field(default_factory=lambda: LearningRates(None, None, False))  # lr_schedule
    lockstep: bool = True  # workers finish every step together (False: asynchronous parameter servers)
    # The step of this run's newest checkpoint, written or resumed from (None: none yet); the
    # checkpoint folder's files past it are another run's (see phalanx.train.checkpoint.save).
    checkpointed_step: int | None = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.loader)

    @property
    def total_steps(self) -> int | None:
        """Optimizer steps over the whole run; ``None`` for a stream of unknown length."""
        try:
            return self.epochs * self.steps_per_epoch
        except TypeError:
            return None

    @property
    def fractional_epoch(self) -> float:
        """``epoch + step / steps_per_epoch``: the clock learning-rate schedules run on."""
        return self.epoch + self.step / max(self.steps_per_epoch, 1)


class LoopPosition:
    """The loop's counters and the epoch's running metric sums, as one stateful object.

    Checkpoints and elastic commits store it. ``state_dict`` is collective: the metric sums are
    summed over ranks (only mid-epoch, where they matter), and ``load_state_dict`` hands them to
    rank 0 alone, so the next reduction counts every sample exactly once.
    """

    def __init__(self, state: TrainState):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        from phalanx.train.metrics import global_sums

        state = self.state
        return {"epoch": state.epoch, "step": state.step, "global_step": state.global_step,
                "history": state.history.state_dict(), "scheduled_lrs": list(state.scheduled_lrs),
                "running_metrics": global_sums(state.metrics) if state.step > 0 else []}

    def load_state_dict(self, position: dict[str, Any]) -> None:
        from phalanx.comm import runtime

        state = self.state
        state.epoch, state.step, state.global_step = position["epoch"], position["step"], position["global_step"]
        state.history = History.from_state_dict(position["history"])
        state.scheduled_lrs = list(position["scheduled_lrs"])
        state.stop_training = False
        sums = position["running_metrics"] or [[0.0, 0.0]] * len(state.metrics)
        for metric, (total, count) in zip(state.metrics, sums):
            metric.total, metric.count = (total, count) if runtime.is_master() else (0.0, 0.0)
