"""The training loop as an object: ``px.fit`` is ``Loop(...).fit(train_data, val_data)``.

Subclass :class:`Loop` to write your own step while phalanx keeps doing everything around it
(global batches, accumulation, precision, reduction, clipping, schedules, metrics, checkpoints,
elastic recovery, the strategy)::

    class WithPenalty(px.Loop):
        def training_step(self, batch):
            inputs, targets = batch
            outputs = self.model(inputs)
            return F.cross_entropy(outputs, targets) + 1e-4 * outputs.pow(2).mean(), outputs

    WithPenalty(model, optimizer, epochs=5, global_batch_size=64).fit(train_data, val_data)

A step that drives its own optimization (several optimizers stepped in turn, a GAN) sets
``automatic_optimization = False`` and calls :meth:`Loop.backward` and :meth:`Loop.optimizer_step`.
A loop is also a callback: define any of :mod:`phalanx.train.callbacks`' hooks on it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from phalanx import elastic, faults, tune
from phalanx.comm import collectives, runtime
from phalanx.data import DistributedLoader, from_dataloader
from phalanx.errors import CheckpointError, ConfigurationError
from phalanx.parallel.clipping import Clipping
from phalanx.parallel.exact import ExactGradients
from phalanx.global_batch import mix_seed
from phalanx.strategies.base import FitOptions, Strategy, announce, resolve as resolve_strategy
from phalanx.train import callbacks as cb, checkpoint, finite, horizon, options, ray_session
from phalanx.train.lr import LearningRates, Schedule, Scheduled, TorchScheduler
from phalanx.train.metrics import Metric, fresh_copies, reduce_metrics, resolve
from phalanx.train.optimizers import OptimizerGroup
from phalanx.train.precision import COMPUTE_DTYPES, Precision, resolve as resolve_precision
from phalanx.train.state import History, LoopPosition, TrainState
from phalanx.train.steps import (ManualStep, StepResult, evaluate_batch, evaluate_batches, loss_of,
                                 takes_step, train_step)

LOG_EVERY_STEPS = 10

logger = logging.getLogger(__name__)


class Loop:
    """``px.fit``'s loop; its arguments are ``px.fit``'s (see :func:`phalanx.train.fit.fit`).

    Override :meth:`training_step` (and :meth:`validation_step` when validation differs) for a
    step of your own. During :meth:`fit`, ``self.model`` is the model as trained (a
    ``px.DataParallel``), ``self.optimizer`` the optimizer (a group of them when given a list)
    and ``self.state`` the loop's position (:class:`~phalanx.train.state.TrainState`).
    """

    #: False: the training step runs its own backward passes and optimizer steps, through
    #: :meth:`backward` and :meth:`optimizer_step` (as Lightning's manual optimization).
    automatic_optimization: bool = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
                 loss_fn: Callable[..., torch.Tensor] | None = None, *, epochs: int, global_batch_size: int,
                 metrics: Sequence[str | Metric] = (), callbacks: Sequence[Any] = (), seed: int | None = None,
                 lr_schedule: Schedule | Scheduled | TorchScheduler | None = None,
                 checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, resume: bool = True,
                 reproducible: bool = False, micro_batch_size: int | None = None, accumulate_steps: int = 1,
                 precision: str = "32", clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
                 step_fn: Callable[..., StepResult] | None = None, verbose: int = 1,
                 log_dir: str | Path | None = None, strategy: Strategy | None = None, on_nonfinite: str = "raise",
                 data_on_device: bool | None = None, max_memory_gb: float | None = None):
        self.model, self.loss_fn, self.step_fn = model, loss_fn, step_fn
        self.several_optimizers = isinstance(optimizer, (list, tuple))
        self.optimizer = OptimizerGroup(optimizer) if self.several_optimizers else optimizer
        if step_fn is not None and takes_step(step_fn):
            self.automatic_optimization = False
        self.epochs, self.global_batch_size, self.seed = epochs, global_batch_size, 0 if seed is None else seed
        self.data_seed = seed  # None: a DataLoader's DistributedSampler's seed orders the data, else 0
        self.metrics, self.callbacks, self.lr_schedule = resolve(metrics), list(callbacks), lr_schedule
        self.checkpoint_dir, self.checkpoint_every, self.resume = checkpoint_dir, checkpoint_every, resume
        self.reproducible, self.accumulate_steps = reproducible, accumulate_steps
        self.micro_batch_size = options.micro_batch_size_for(reproducible, micro_batch_size)
        self.precision = resolve_precision(precision)
        self.clipping = Clipping.from_options(clip_grad_norm, clip_grad_value)
        self.verbose, self.log_dir = verbose, log_dir
        self.strategy = resolve_strategy(strategy)
        self.on_nonfinite = finite.check_policy(on_nonfinite)
        self.data_on_device = data_on_device
        self.max_memory_gb = max_memory_gb
        self.plan: horizon.Plan | None = None
        self.state: TrainState | None = None
        self._manual = ManualStep(Precision(), None)
        self._check()

    def training_step(self, batch: Any) -> StepResult:
        """The mean loss of ``batch`` (on this worker's device), or ``(loss, outputs)`` for metrics
        beyond the loss; the targets are the batch's last part. Runs under the precision's autocast.
        By default ``loss_fn(model(*inputs), targets)``, or ``step_fn(model, batch)``."""
        if self.step_fn is None:
            assert self.loss_fn is not None
            return loss_of(self.model, self.loss_fn, batch)
        return self.step_fn(self.model, batch, *(() if self.automatic_optimization else (self._manual,)))

    def validation_step(self, batch: Any) -> StepResult:
        """The loss (or ``(loss, outputs)``) of a validation batch: by default the training step's,
        with :meth:`backward` and :meth:`optimizer_step` doing nothing."""
        with self._manual.validating():
            return self.training_step(batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` in a training step of your own optimization (scaled under float16);
        the gradients are averaged over workers as in any step."""
        self._refuse_automatic("backward")
        self._manual.backward(loss)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip ``optimizer``'s gradients and step it (a float16 overflow skipped on every rank alike)."""
        self._refuse_automatic("optimizer_step")
        self._manual.step(optimizer)

    def fit(self, train_data: Any, val_data: Any = None) -> History:
        """Train over ``train_data`` for ``epochs`` epochs on every worker of the job; the per-epoch
        :class:`History` of global metrics, the same on every rank."""
        runtime.init()
        faults.point("fit.setup")
        rates = LearningRates(self.lr_schedule, self.optimizer, validates=val_data is not None)
        self.strategy.check(self._fit_options(rates))
        options.check_memory(self.strategy, self.model, self.optimizer, self.max_memory_gb)
        options.check_one_meaning(self.model, train_data, self.global_batch_size, self.accumulate_steps)
        options.check_checkpoints(self.checkpoint_dir, self.checkpoint_every, self.callbacks)
        device = batch_device(self.data_on_device)
        loader = loader_for(train_data, self.global_batch_size, self.data_seed, shuffle=True,
                            micro_batch_size=self.micro_batch_size, argument="train_data", device=device,
                            data_on_device=self.data_on_device)
        val_loader = (None if val_data is None
                      else loader_for(val_data, self.global_batch_size, self.data_seed, shuffle=False,
                                      argument="val_data", device=device, data_on_device=self.data_on_device))
        options.check_not_empty(loader, "train_data")
        if val_loader is not None:
            options.check_not_empty(val_loader, "val_data")
        self.plan = horizon.plan_for(loader, self.epochs, train_data)
        horizon.check_scheduler(rates.torch_scheduler, self.plan)
        if runtime.role() == "server":
            return self._serve(loader, val_loader)
        self._report_plan()
        self.state = self._start(loader, rates)
        ray = ray_session.RaySession.under_ray(self._checkpoint_folder())
        try:
            self._train_with(val_loader, ray)
        finally:
            if ray is not None:
                ray.close()
        return self.state.history

    @property
    def estimated_stepping_batches(self) -> int | None:
        """The optimizer steps :meth:`fit` takes over the whole run (as Lightning's trainer has it),
        known once ``fit`` has read its data (``None`` before, and for a stream of unknown length);
        before ``fit``, ``px.estimated_stepping_batches(train_data, ...)`` gives the same number."""
        return self.plan.total_steps if self.plan is not None else None

    def _report_plan(self) -> None:
        """Rank 0 says how the run reads its data, before training (printed when ``verbose``)."""
        assert self.plan is not None
        if runtime.is_master():
            logger.info(self.plan.describe())
            if self.verbose:
                print(self.plan.describe(), flush=True)

    def _check(self) -> None:
        overridden = type(self).training_step is not Loop.training_step
        options.check_step(self.loss_fn, self.step_fn, overridden, not self.automatic_optimization,
                           self.reproducible, self.accumulate_steps)
        options.check_accumulation(self.accumulate_steps, self.reproducible)
        options.check_precision(self.precision, self.reproducible)

    def _refuse_automatic(self, method: str) -> None:
        if self.automatic_optimization:
            raise ConfigurationError(
                f"Loop.{method} is for a training step that drives its own optimization, but phalanx runs "
                f"backward and the optimizer step itself: set automatic_optimization = False on your Loop.")

    def _fit_options(self, rates: LearningRates) -> FitOptions:
        return FitOptions(self.precision, COMPUTE_DTYPES.get(self.precision), self.clipping, self.reproducible,
                          None if self.checkpoint_dir is None else str(self.checkpoint_dir), self.checkpoint_every,
                          self.several_optimizers, rates.torch_scheduler is not None, elastic.enabled(),
                          not self.automatic_optimization)

    def _start(self, loader: DistributedLoader, rates: LearningRates) -> TrainState:
        """Set the strategy up and the loop's state with it."""
        torch.manual_seed(mix_seed(self.seed, runtime.rank()))
        self.model, self.optimizer = self.strategy.setup(self.model, self.optimizer)
        announce(self.strategy)  # names it to phalanx doctor, if the run is measured
        precision = Precision(self.precision, runtime.device())
        guard = finite.NonFiniteGuard(self.on_nonfinite, self.strategy.nonfinite_agreement, self.precision,
                                      self.clipping, late=finite.reads_late(runtime.device()),
                                      meets=self.strategy.meets_after_step)
        clipping = self.strategy.worker_clipping(self.clipping)  # None where the strategy clips elsewhere
        self._manual = ManualStep(precision, clipping, guard)
        micro = self.micro_batch_size
        return TrainState(self.model, self.optimizer, loader, self.epochs, seed=self.seed, metrics=self.metrics,
                          exact=ExactGradients(self.model, micro, self.seed) if micro else None,
                          accumulate_steps=self.accumulate_steps, precision=precision, clipping=clipping,
                          guard=guard, rates=rates, loss_fn=self.loss_fn, training_step=self.training_step,
                          validation_step=self.validation_step,
                          manual=None if self.automatic_optimization else self._manual)

    def _checkpoint_folder(self) -> str | Path | None:
        """Where checkpoints are written: ``checkpoint_dir``, else a Checkpoint callback's folder."""
        given = [c.directory for c in self.callbacks if isinstance(c, cb.Checkpoint)]
        return self.checkpoint_dir if self.checkpoint_dir is not None or not given else given[0]

    def _train_with(self, val_loader: DistributedLoader | None, ray: ray_session.RaySession | None) -> None:
        """Train under the strategy; a worker that fails drops its connections instead of saying
        goodbye, so that parameter servers count it as lost rather than finished. Under Ray Train,
        checkpoints always exist (in a scratch folder without ``checkpoint_dir``) and are reported."""
        state = self.state
        assert state is not None
        checkpoint_dir = self.checkpoint_dir if ray is None else ray.checkpoint_dir
        for callback in (self, *self.callbacks):  # the loop is a callback too (a subclass's hooks)
            uncalled = cb.uncalled_hooks(callback)
            if uncalled is not None and runtime.rank() == 0:
                logger.warning(uncalled)
        hooks = cb.CallbackList([self, *_callbacks(self.callbacks, self.verbose, self.global_batch_size,
                                                   checkpoint_dir, self.checkpoint_every,
                                                   self.log_dir or self.checkpoint_dir),
                                 *([ray.callback()] if ray is not None else [])])
        prepare = functools.partial(_prepare, state, checkpoint_dir if self.resume else None, self.verbose, ray)
        state.lockstep = not self.strategy.asynchronous
        try:
            self.strategy.train(FitRun(state, hooks, val_loader, self.strategy, checkpoint_dir, prepare))
        except BaseException:
            self.strategy.close()
            raise
        self.strategy.finish(state.history.state_dict())

    def _serve(self, loader: DistributedLoader, val_loader: DistributedLoader | None) -> History:
        """A server process's ``fit``: the strategy serves until the workers are done; their history."""
        shares = runtime.size()
        history = self.strategy.serve(self.model, self.optimizer, train_tasks=len(loader) * shares,
                                      val_tasks=len(val_loader) * shares if val_loader is not None else 0,
                                      metric_values=2 * len(self.metrics), clipping=self.clipping)
        return History.from_state_dict(history) if history is not None else History()


class FitRun:
    """One :meth:`Loop.fit` as its strategy drives it (:class:`phalanx.strategies.base.Run`): the
    loop's lockstep epochs, elastic or not, and the steps a strategy with its own epochs takes."""

    def __init__(self, state: TrainState, hooks: cb.CallbackList, val_loader: DistributedLoader | None,
                 strategy: Strategy, checkpoint_dir: str | Path | None, prepare: Callable[[], None]):
        self.state, self.hooks, self.val_loader = state, hooks, val_loader
        self.strategy, self.checkpoint_dir, self.prepare = strategy, checkpoint_dir, prepare

    def lockstep(self) -> None:
        """Every worker in lockstep, elastic or not."""
        if elastic.enabled():
            _train_elastic(self)
        else:
            self.prepare()
            self.hooks.on_train_begin(self.state)
            _train_epochs(self.state, self.hooks, self.val_loader, Commits())
        faults.point("train.end")
        self.hooks.on_train_end(self.state)

    def train_batch(self, batch: Any) -> bool:
        return train_step(self.state, batch)

    def validate_batch(self, batch: Any, metrics: Sequence[Metric]) -> None:
        evaluate_batch(batch, self.state.validation_step, list(metrics), self.state.precision)

    def fresh_metrics(self) -> list[Metric]:
        return fresh_copies(self.state.metrics)

    def follow_membership(self) -> bool:
        return elastic.follow()


def _prepare(state: TrainState, checkpoint_dir: str | Path | None, verbose: int,
             ray: ray_session.RaySession | None) -> None:
    """Continue from the newest readable checkpoint in ``checkpoint_dir`` or the one Ray handed back
    after a restart, if any (collective), and note the learning rates the schedule starts from."""
    with ray.handed_back() if ray is not None else contextlib.nullcontext() as handed:
        folders = [folder for folder in (checkpoint_dir, handed) if folder is not None]
        if folders:
            faults.point("fit.resume")
            resumed_from = checkpoint.restore(state, folders)
            if resumed_from is not None:
                _report_resume(state, resumed_from, verbose, under_ray=ray is not None)
    if not state.scheduled_lrs:
        state.scheduled_lrs = [group["lr"] for group in state.optimizer.param_groups]


def _report_resume(state: TrainState, path: Path, verbose: int, under_ray: bool) -> None:
    """Rank 0 says which checkpoint the run continues from, and when it leaves nothing to train.

    Epochs are counted from 0, as everywhere in phalanx; the step is the global step, as in the
    file's name. Logged at INFO, and printed too when ``verbose``. The advice for a finished run is
    one that works where it runs: under Ray, deleting checkpoints breaks Ray's record of the run.
    """
    if not runtime.is_master():
        return
    where = (f"epoch {state.epoch} at its step {state.step}" if state.step
             else f"epoch {state.epoch - 1} done" if state.epoch else "before epoch 0")
    lines = [f"resumed from {path} (global step {state.global_step}, {where})"]
    if state.epoch >= state.epochs:
        done = (f"all {state.epochs} epochs, 0-{state.epochs - 1}" if state.epoch == state.epochs
                else f"{state.epoch} epochs, more than epochs={state.epochs}")
        again = ("start the Ray trainer with a new RunConfig(name=...): Ray hands this run's last checkpoint back "
                 "at every start of the same run, and deleting checkpoints breaks its record of it" if under_ray
                 else f"delete {path.parent}")
        lines.append(f"training was already complete ({done}); nothing to do. To train longer, raise epochs above "
                     f"{state.epoch}; to train again from scratch, {again}")
    for line in lines:
        logger.info(line)
        if verbose:
            print(line, flush=True)


def _train_elastic(run: FitRun) -> None:
    """The lockstep loop, committed every ``strategy.commit_every`` steps (after every step unless a
    strategy says otherwise): a lost worker costs at most the steps since the last commit.

    Everything collective happens inside the elastic protection: the replicas are made equal by the
    State's first sync, and the resume from a checkpoint is the first commit (``prepared``), so a
    worker lost at any moment after ``px.init()`` is survived like one lost mid-epoch.
    """
    state, hooks, val_loader = run.state, run.hooks, run.val_loader
    objects = {**run.strategy.committed(state.model, state.optimizer), "loader": state.loader,
               "loop": LoopPosition(state), "precision": state.precision, "lr_schedule": state.rates,
               **({"val_loader": val_loader} if val_loader is not None else {}),
               **({"exact": state.exact} if state.exact is not None else {})}
    from_disk = run.strategy.resumes_from_disk or run.strategy.may_resume_from_disk
    last = None
    if run.checkpoint_dir is not None:
        Path(run.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        # the last commit is worth saving below the minimum only where it holds the whole state
        last = Path(run.checkpoint_dir) / checkpoint.ELASTIC_LAST if run.strategy.commits_whole_state else None
    carried = elastic.State(checkpoint_path=last, prepared=False, **objects)
    begun = False
    read_in: int | None = None  # the generation whose state this worker holds

    def train(carried: elastic.State) -> bool:
        nonlocal begun, read_in
        state.guard.forget_pending()  # back at a committed state: the steps after it are checked again
        generation = _generation()
        if not carried.prepared:
            run.prepare()
            if from_disk and run.checkpoint_dir is not None and state.checkpointed_step != state.global_step:
                checkpoint.save(state, run.checkpoint_dir)  # something to resume from before the first save
            carried.prepared = True
            carried.commit()
        elif generation != read_in and (reason := run.strategy.must_resume_from_disk()) is not None:
            _resume_after_reform(run, reason)
            carried.commit()
        read_in = generation
        if not begun:  # once per process: callbacks are this worker's own objects
            hooks.on_train_begin(state)
            begun = True
        _train_epochs(state, hooks, val_loader, Commits(carried.commit, carried.stepped, run.strategy.commit_every))
        # Members leave together: one lost after its peers' last commit makes them re-form, so that
        # every survivor returns in the same group (one of them rank 0) rather than in a broken one.
        collectives.barrier()
        return True

    if elastic.run(train)(carried) is None:
        # Started after the job had finished, never admitted: it trained nothing, so the script must
        # not go on to use (or save over the job's result) an untrained model; it ends here, status 0.
        raise SystemExit(0)


def _generation() -> int | None:
    view = runtime.membership()
    return view.generation if view is not None else None


def _resume_after_reform(run: FitRun, reason: str) -> None:
    """A re-formed group whose last commit lacks a lost worker's state (``reason``) goes on from the
    last checkpoint on disk, at the new worker count (collective), and says so."""
    if run.checkpoint_dir is None:
        raise CheckpointError(f"the re-formed group of {runtime.size()} cannot go on: {reason}, and px.fit was given "
                              "no checkpoint_dir to resume from; start the job again (with checkpoint_dir, a later "
                              "loss of this kind resumes from the last checkpoint).")
    path = checkpoint.restore(run.state, [run.checkpoint_dir])
    if path is None:
        raise CheckpointError(
            f"the re-formed group of {runtime.size()} cannot go on: {reason}, and {run.checkpoint_dir} has no "
            "checkpoint to resume from (was it emptied during the run?); start the job again.")
    message = (f"phalanx elastic: {reason}, so the new group of {runtime.size()} resumed from {path} "
               f"(global step {run.state.global_step})")
    logger.warning(message)
    if runtime.is_master():
        print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Commits:
    """When the loop commits an elastic job's state: ``commit`` after every ``every`` global steps,
    where a callback stops the run and at each epoch's end; ``stepped`` after each step (the first
    one after a re-form ends the recovery's clock). The defaults: a run that commits nothing."""

    commit: Callable[[], None] = lambda: None
    stepped: Callable[[], None] = lambda: None
    every: int = 1


def _train_epochs(state: TrainState, hooks: Any, val_loader: Any, commits: Commits) -> None:
    """What is left of the run's epochs, committed as ``commits`` says."""
    for epoch in range(state.epoch, state.epochs):
        logs = _train_epoch(state, hooks, epoch, commits)
        if logs is None:  # stopped mid-epoch: the position stays resumable
            return
        if val_loader is not None:
            faults.point("validation")
            logs.update(evaluate_batches(state.model, state.validation_step, val_loader,
                                         fresh_copies(state.metrics), "val_", state.precision))
        state.history.append(epoch, logs)
        state.rates.after_epoch(state, logs)
        hooks.on_epoch_end(epoch, logs, state)
        faults.point("epoch.end")
        commits.commit()
        if state.stop_training:
            return


def _train_epoch(state: TrainState, hooks: Any, epoch: int, commits: Commits) -> dict[str, float] | None:
    """Run what is left of ``epoch``; its global metrics, or ``None`` when a callback stopped it midway."""
    state.model.train()
    if state.epoch != epoch:
        state.epoch, state.step = epoch, 0
    if state.step == 0:  # a run resumed mid-epoch keeps the sums restored from its checkpoint
        for metric in state.metrics:
            metric.reset()
    hooks.on_epoch_begin(epoch, state)
    if state.step < state.steps_per_epoch:  # an elastic recovery can land after the last batch
        state.loader.set_epoch(epoch)
        finished = _train_steps(state, hooks, commits)
        state.guard.settle()  # a verdict still on its way (GPU) is decided before validation and checkpoints
        if not finished:
            return None
    state.epoch, state.step = epoch + 1, 0
    return reduce_metrics(state.metrics)


def _train_steps(state: TrainState, hooks: Any, commits: Commits) -> bool:
    """The epoch's remaining steps, committed as ``commits`` says; False when a callback asked to
    stop before the epoch's end."""
    logs: dict[str, float] = {}
    started, samples = time.perf_counter(), 0
    for batch in state.loader:
        state.rates.before_step(state)
        hooks.on_step_begin(state.step, state)
        faults.point("step.forward")
        train_step(state, batch)
        state.rates.after_step(state)
        faults.point("step.end")
        state.step, state.global_step = state.step + 1, state.global_step + 1
        samples += state.loader.last_global_batch_size
        if state.step % LOG_EVERY_STEPS == 0 or not logs:
            logs = reduce_metrics(state.metrics)
        logs["samples_per_s"] = samples / max(time.perf_counter() - started, 1e-9)
        hooks.on_step_end(state.step - 1, logs, state)
        commits.stepped()
        if state.global_step % commits.every == 0 or state.stop_training:
            commits.commit()
        if state.stop_training and state.step < state.steps_per_epoch:
            return False
    return True


def batch_device(data_on_device: bool | None) -> torch.device | None:
    """The device a loader hands batches over on: this worker's accelerator, or ``None`` on the CPU
    (where the data already is; ``data_on_device=True`` there is refused as meaningless)."""
    device = runtime.device()
    if device.type == "cpu":
        if data_on_device:
            raise ConfigurationError("data_on_device=True keeps the training data on this worker's accelerator, "
                                     "but it trains on the CPU: drop data_on_device.")
        return None
    return device


def loader_for(data: Any, global_batch_size: int, seed: int | None, shuffle: bool,
               micro_batch_size: int | None = None, argument: str = "train_data",
               call: str = "px.fit", device: torch.device | None = None,
               data_on_device: bool | None = None) -> DistributedLoader:
    """``data`` as a :class:`DistributedLoader` (a DataLoader keeps its settings and gets phalanx's
    sampler; ``seed=None`` takes its DistributedSampler's seed, else 0) handing batches over on
    ``device`` (kept there or copied one step ahead: ``data_on_device``); a loader given is used as
    it is. A data-check error's advice names ``call``'s ``argument``."""
    dataloader = isinstance(data, torch.utils.data.DataLoader)
    micro = "" if micro_batch_size is None else f", micro_batch_size={micro_batch_size}"
    hint = (f"pass {argument}=px.data.{'from_dataloader' if dataloader else 'DistributedLoader'}({argument}, "
            f"global_batch_size{micro}, check_same_data=False) to {call}")
    if dataloader:
        return from_dataloader(data, global_batch_size, seed=seed, micro_batch_size=micro_batch_size,
                               opt_out_hint=hint, device=device, data_on_device=data_on_device)
    if not isinstance(data, DistributedLoader):
        return DistributedLoader(data, global_batch_size, shuffle=shuffle, seed=0 if seed is None else seed,
                                 micro_batch_size=micro_batch_size, opt_out_hint=hint, device=device,
                                 data_on_device=data_on_device)
    if micro_batch_size is not None and data.granularity != micro_batch_size:
        raise ConfigurationError(
            f"reproducible mode with micro_batch_size={micro_batch_size} needs a DistributedLoader built with "
            f"micro_batch_size={micro_batch_size}."
        )
    return data


def _callbacks(user: Sequence[Any], verbose: int, global_batch_size: int, checkpoint_dir: str | Path | None,
               checkpoint_every: int | None, log_dir: str | Path | None) -> list:
    chosen: list[Any] = list(user)
    if verbose:
        chosen.append(cb.ProgressBar(global_batch_size))
    if tune.active():
        chosen.append(cb.TuneReport())
    if log_dir is not None:
        chosen.append(cb.CSVLogger(Path(log_dir) / "metrics.csv"))
        if cb.TensorBoard.available():
            chosen.append(cb.TensorBoard(Path(log_dir) / "tensorboard"))
    if checkpoint_dir is not None and not any(isinstance(c, cb.Checkpoint) for c in user):
        chosen.append(cb.Checkpoint(checkpoint_dir, every_steps=checkpoint_every))
    return chosen
