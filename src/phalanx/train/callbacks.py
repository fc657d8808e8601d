"""Callbacks: objects with any of ``on_train_begin(state)``, ``on_epoch_begin(epoch, state)``,
``on_step_begin(step, state)``, ``on_step_end(step, logs, state)``, ``on_epoch_end(epoch, logs,
state)``, ``on_train_end(state)``. Every rank runs every callback with the same (global) logs, so
decisions such as early stopping are identical everywhere; output is written by rank 0 only.
"""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from phalanx.comm import runtime
from phalanx.tune import trial
from phalanx.errors import ConfigurationError
from phalanx.train import checkpoint
from phalanx.train.lr import warmup_factor
from phalanx.train.state import TrainState

HOOKS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_step_end", "on_epoch_end", "on_train_end")

#: Hooks of Keras and Lightning callbacks, and px.fit's hook that is called where they would be.
FOREIGN_HOOKS = {"on_train_batch_begin": "on_step_begin", "on_train_batch_end": "on_step_end",
                 "on_batch_begin": "on_step_begin", "on_batch_end": "on_step_end", "on_step_start": "on_step_begin",
                 "on_train_epoch_start": "on_epoch_begin", "on_train_epoch_end": "on_epoch_end",
                 "on_epoch_start": "on_epoch_begin", "on_train_start": "on_train_begin",
                 "on_fit_start": "on_train_begin", "on_fit_end": "on_train_end"}


class Callback:
    """Base class with every hook as a no-op; a callback need not inherit from it."""


def uncalled_hooks(callback: Any) -> str | None:
    """What to tell the user of a callback whose ``on_*`` methods px.fit would never call (Keras's
    ``on_train_batch_end``, Lightning's ``on_train_epoch_end``, ...): ``None`` when there are none."""
    names = sorted(name for name in dir(callback)
                   if name.startswith("on_") and name not in HOOKS and callable(getattr(callback, name, None)))
    if not names:
        return None
    named = ", ".join(f"{name} (px.fit's is {FOREIGN_HOOKS[name]})" if name in FOREIGN_HOOKS else name
                      for name in names)
    return (f"phalanx: the callback {type(callback).__name__} defines {named}, which px.fit never calls: its hooks are "
            f"{', '.join(HOOKS)}; rename them, or the callback does nothing there.")


class CallbackList:
    """Calls a hook on every callback that has it, in order."""

    def __init__(self, callbacks: Sequence[Any]):
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str) -> Any:
        if hook not in HOOKS:
            raise AttributeError(hook)

        def dispatch(*args: Any) -> None:
            for callback in self.callbacks:
                method = getattr(callback, hook, None)
                if method is not None:
                    method(*args)

        return dispatch


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    ``restore_best=True`` keeps a copy of the weights of the best epoch (in host memory) and loads
    it into the model when training ends, stopped early or not; every rank sees the same global
    logs, so every rank restores the same epoch's weights.
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "auto",
                 restore_best: bool = False):
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.mode = ("max" if "acc" in monitor else "min") if mode == "auto" else mode
        self.best = math.inf if self.mode == "min" else -math.inf
        self.waited = 0
        self.stopped_epoch: int | None = None
        self.restore_best = restore_best
        self.best_epoch: int | None = None
        self._best_weights: dict[str, torch.Tensor] | None = None

    def on_epoch_end(self, epoch: int, logs: dict[str, float], state: TrainState) -> None:
        if self.monitor not in logs:
            raise ConfigurationError(f"EarlyStopping monitors '{self.monitor}', but the logs hold {sorted(logs)}.")
        value = logs[self.monitor]
        improved = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if improved:
            self.best, self.waited, self.best_epoch = value, 0, epoch
            if self.restore_best:
                self._best_weights = {k: v.detach().to("cpu", copy=True) for k, v in state.model.state_dict().items()}
            return
        self.waited += 1
        if self.waited >= self.patience:
            state.stop_training = True
            self.stopped_epoch = epoch

    def on_train_end(self, state: TrainState) -> None:
        if self.restore_best and self._best_weights is not None:
            state.model.load_state_dict(self._best_weights)


class LRWarmup(Callback):
    """Ramp each learning rate linearly up to its scheduled value (Goyal et al., 2017).

    Give ``warmup_epochs`` or ``warmup_steps``. The rate starts at ``start_factor`` times the
    scheduled one; after the warm-up the schedule (or the optimizer's rate) applies unchanged.
    """

    def __init__(self, warmup_epochs: float | None = None, warmup_steps: int | None = None,
                 start_factor: float = 0.1):
        if (warmup_epochs is None) == (warmup_steps is None):
            raise ConfigurationError("LRWarmup needs exactly one of warmup_epochs or warmup_steps.")
        self.warmup_epochs, self.warmup_steps, self.start_factor = warmup_epochs, warmup_steps, start_factor

    def on_step_begin(self, step: int, state: TrainState) -> None:
        length = self.warmup_steps or (self.warmup_epochs or 0) * state.steps_per_epoch
        factor = warmup_factor(state.global_step / length if length else 1.0, self.start_factor)
        for group, scheduled in zip(state.optimizer.param_groups, state.scheduled_lrs):
            group["lr"] = scheduled * factor


class Checkpoint(Callback):
    """Save a resumable checkpoint every ``every_steps`` steps and/or every ``every_epochs`` epochs,
    keeping the ``keep`` newest readable ones.

    Every rank takes part (each contributes its random-number state); rank 0 writes the file.
    """

    def __init__(self, directory: str | Path, every_steps: int | None = None, every_epochs: int | None = 1,
                 keep: int = 3):
        if keep < 1:
            raise ConfigurationError(f"Checkpoint(keep={keep}): keep must be at least 1, the newest checkpoint.")
        self.directory, self.every_steps, self.every_epochs, self.keep = Path(directory), every_steps, every_epochs, keep

    def on_step_end(self, step: int, logs: dict[str, float], state: TrainState) -> None:
        if self.every_steps and state.global_step % self.every_steps == 0:
            checkpoint.save(state, self.directory, self.keep)

    def on_epoch_end(self, epoch: int, logs: dict[str, float], state: TrainState) -> None:
        if self.every_epochs and (epoch + 1) % self.every_epochs == 0:
            checkpoint.save(state, self.directory, self.keep)


class TuneReport(Callback):
    """Inside a ``phalanx tune`` trial (added by px.fit): report each epoch's metrics, and stop
    training when the pruner says so (the trial then ends normally, recorded as pruned)."""

    def on_epoch_end(self, epoch: int, logs: dict[str, float], state: TrainState) -> None:
        if trial.report(epoch + 1, **logs):
            state.stop_training = True


class ProgressBar(Callback):
    """A progress bar on rank 0 with loss, samples/s and ETA, and a summary line per epoch.

    The bar (tqdm) is drawn only on an interactive terminal (``phalanx run`` tells workers whether
    its own output is one); logs and pipes get the summary lines alone.
    """

    def __init__(self, global_batch_size: int):
        self.global_batch_size = global_batch_size
        self._bar: Any = None
        self._started = 0.0

    def on_epoch_begin(self, epoch: int, state: TrainState) -> None:
        if not runtime.is_master():
            return
        self._started = time.perf_counter()
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        if not _interactive():
            return
        self._bar = tqdm(total=state.steps_per_epoch, initial=state.step, desc=f"epoch {epoch}/{state.epochs - 1}",
                         unit="step", dynamic_ncols=True, leave=True)

    def on_step_end(self, step: int, logs: dict[str, float], state: TrainState) -> None:
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{logs.get('loss', float('nan')):.4f}",
                                  samples_s=f"{logs.get('samples_per_s', 0):.0f}", refresh=False)
            self._bar.update(max(0, state.step - self._bar.n))  # asynchronous workers jump to the global count

    def on_epoch_end(self, epoch: int, logs: dict[str, float], state: TrainState) -> None:
        if not runtime.is_master():
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        shown = "  ".join(f"{k} {v:.4f}" for k, v in logs.items())
        print(f"epoch {epoch}/{state.epochs - 1}  {shown}  ({time.perf_counter() - self._started:.1f}s)", flush=True)


def _interactive() -> bool:
    launched = os.environ.get("PHALANX_INTERACTIVE")
    return launched == "1" if launched is not None else sys.stdout.isatty()


class CSVLogger(Callback):
    """Append each epoch's logs to a CSV file (rank 0)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_epoch_end(self, epoch: int, logs: dict[str, float], state: TrainState) -> None:
        if not runtime.is_master():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        with self.path.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["epoch", *logs])
            if new:
                writer.writeheader()
            writer.writerow({"epoch": epoch, **logs})


class TensorBoard(Callback):
    """Write epoch and step logs for TensorBoard when ``tensorboard`` is installed (rank 0)."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    @staticmethod
    def available() -> bool:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            return False
        return True

    def on_train_begin(self, state: TrainState) -> None:
        if runtime.is_master():
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.log_dir))

    def on_epoch_end(self, epoch: int, logs: dict[str, float], state: TrainState) -> None:
        if self._writer is not None:
            for key, value in logs.items():
                self._writer.add_scalar(f"epoch/{key}", value, epoch)

    def on_train_end(self, state: TrainState) -> None:
        if self._writer is not None:
            self._writer.close()
