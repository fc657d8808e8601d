"""``px.fit``: train a model on every worker with global-batch semantics, in one call."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from phalanx import elastic, faults, tune
from phalanx.comm import collectives, runtime
from phalanx.data import DistributedLoader, from_dataloader
from phalanx.sharding import mix_seed
from phalanx.errors import ConfigurationError
from phalanx.parallel.data_parallel import DataParallel
from phalanx.parallel.exact import ExactGradients
from phalanx.train import callbacks as cb, checkpoint
from phalanx.strategies.base import FitOptions, Replicated, Strategy
from phalanx.strategies.client import ServerOptimizer
from phalanx.strategies.parameter_server import ParameterServer
from phalanx.train.async_loop import train_async
from phalanx.train.lr import LearningRates, Schedule, Scheduled, TorchScheduler
from phalanx.train.metrics import Metric, fresh_copies, reduce_metrics, resolve
from phalanx.train.optimizers import OptimizerGroup
from phalanx.train.precision import Clipping, Precision, resolve as resolve_precision
from phalanx.train.state import History, LoopPosition, TrainState
from phalanx.train.steps import evaluate_batches, takes_step, train_step

LOG_EVERY_STEPS = 10


logger = logging.getLogger(__name__)


def fit(model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loss_fn: Callable[..., torch.Tensor] | None, train_data: Any, *, epochs: int, global_batch_size: int,
        val_data: Any = None, metrics: Sequence[str | Metric] = (),
        callbacks: Sequence[Any] = (), seed: int = 0, lr_schedule: Schedule | Scheduled | TorchScheduler | None = None,
        checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, resume: bool = True,
        reproducible: bool = False, micro_batch_size: int | None = None, accumulate_steps: int = 1,
        precision: str = "32", clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
        step_fn: Callable[..., torch.Tensor | tuple[torch.Tensor, Any]] | None = None,
        verbose: int = 1, log_dir: str | Path | None = None, strategy: Strategy | None = None) -> History:
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
    Returns the per-epoch :class:`History` of global metrics, the same on every rank.
    """
    runtime.init()
    faults.point("fit.setup")
    micro = _micro_batch_size(reproducible, micro_batch_size)
    _check_accumulation(accumulate_steps, reproducible)
    precision = resolve_precision(precision)
    clipping = Clipping.from_options(clip_grad_norm, clip_grad_value)
    _check_precision(precision, reproducible)
    manual = _check_step(loss_fn, step_fn, reproducible, accumulate_steps)
    several = isinstance(optimizer, (list, tuple))
    optimizer = OptimizerGroup(optimizer) if several else optimizer
    rates = LearningRates(lr_schedule, optimizer, validates=val_data is not None)
    strategy = strategy if strategy is not None else Replicated()
    strategy.check(FitOptions(precision, clipping is not None, reproducible,
                              None if checkpoint_dir is None else str(checkpoint_dir), checkpoint_every, several,
                              rates.torch_scheduler is not None, elastic.enabled(), manual))
    _check_one_meaning(model, train_data, global_batch_size, accumulate_steps)
    _check_checkpoints(checkpoint_dir, checkpoint_every, callbacks)
    loader = _loader(train_data, global_batch_size, seed, shuffle=True, micro_batch_size=micro)
    val_loader = None if val_data is None else _loader(val_data, global_batch_size, seed, shuffle=False)
    _check_not_empty(loader, "train_data")
    if val_loader is not None:
        _check_not_empty(val_loader, "val_data")
    if runtime.role() == "server":
        return _serve(strategy, model, optimizer, loader, val_loader, len(resolve(metrics)))
    torch.manual_seed(mix_seed(seed, runtime.rank()))
    model, optimizer = strategy.setup(model, optimizer)
    state = TrainState(model, optimizer, loader, epochs, seed=seed, metrics=resolve(metrics),
                       exact=ExactGradients(model, micro, seed) if micro else None, accumulate_steps=accumulate_steps,
                       precision=Precision(precision, runtime.device()), clipping=clipping, rates=rates,
                       step_fn=step_fn, manual_step=manual)
    hooks = cb.CallbackList(_callbacks(callbacks, verbose, global_batch_size, checkpoint_dir, checkpoint_every,
                                       log_dir))
    prepare = functools.partial(_prepare, state, checkpoint_dir if resume else None, verbose)
    _train_with(strategy, state, hooks, loss_fn, val_loader, checkpoint_dir, prepare)
    return state.history


def evaluate(model: nn.Module, loss_fn: Callable[..., torch.Tensor], data: Any, *, global_batch_size: int,
             metrics: Sequence[str | Metric] = ()) -> dict[str, float]:
    """Global loss and metrics of ``model`` over ``data``, each worker evaluating its share."""
    runtime.init()
    return evaluate_batches(model, loss_fn, _loader(data, global_batch_size, 0, shuffle=False), resolve(metrics), "")


def _serve(strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DistributedLoader,
           val_loader: DistributedLoader | None, num_metrics: int) -> History:
    """A parameter server's ``fit``: serve its shard until the workers are done; their history."""
    if not isinstance(strategy, ParameterServer):
        raise ConfigurationError(
            "this process is a parameter server (phalanx run --servers), so px.fit needs "
            "strategy=px.ParameterServer(...); without one, launch without --servers.")
    shares = runtime.size()
    history = strategy.serve(model, optimizer, train_tasks=len(loader) * shares,
                             val_tasks=len(val_loader) * shares if val_loader is not None else 0,
                             metric_values=2 * num_metrics)
    return History.from_state_dict(history) if history is not None else History()


def _train_with(strategy: Strategy, state: TrainState, hooks: Any, loss_fn: Callable, val_loader: Any,
                checkpoint_dir: str | Path | None, prepare: Callable[[], None]) -> None:
    """Train under ``strategy``; a worker that fails drops its connections instead of saying goodbye,
    so that parameter servers count it as lost rather than finished."""
    state.lockstep = not strategy.asynchronous
    try:
        if state.lockstep:
            _train(state, hooks, loss_fn, val_loader, checkpoint_dir, prepare)
        else:
            prepare()
            train_async(state, hooks, loss_fn, val_loader, strategy.client)
    except BaseException:
        strategy.close()
        raise
    strategy.finish(state.history.state_dict())


def _prepare(state: TrainState, checkpoint_dir: str | Path | None, verbose: int) -> None:
    """Continue from the newest readable checkpoint in ``checkpoint_dir``, if any (collective), and
    note the learning rates the schedule starts from."""
    if checkpoint_dir is not None:
        faults.point("fit.resume")
        resumed_from = checkpoint.restore(state, checkpoint_dir)
        if resumed_from is not None:
            _report_resume(state, resumed_from, checkpoint_dir, verbose)
    if not state.scheduled_lrs:
        state.scheduled_lrs = [group["lr"] for group in state.optimizer.param_groups]


def _report_resume(state: TrainState, path: Path, checkpoint_dir: str | Path, verbose: int) -> None:
    """Rank 0 says which checkpoint the run continues from, and when it leaves nothing to train.

    The epoch is the one (counted from 1) of the last step the checkpoint holds; the step is the
    global step, as in the file's name. Logged at INFO, and printed too when ``verbose``.
    """
    if not runtime.is_master():
        return
    epoch = state.epoch + 1 if state.step else state.epoch
    lines = [f"resumed from {path} (epoch {epoch}, step {state.global_step})"]
    if state.epoch >= state.epochs:
        done = (f"{state.epoch} of {state.epochs} epochs" if state.epoch == state.epochs
                else f"{state.epoch} epochs, more than epochs={state.epochs}")
        lines.append(f"training was already complete ({done}); nothing to do — delete {checkpoint_dir} "
                     "or pass resume=False to train again")
    for line in lines:
        logger.info(line)
        if verbose:
            print(line, flush=True)


def _train(state: TrainState, hooks: Any, loss_fn: Callable, val_loader: Any, checkpoint_dir: str | Path | None,
           prepare: Callable[[], None]) -> None:
    if elastic.enabled():
        _train_elastic(state, hooks, loss_fn, val_loader, checkpoint_dir, prepare)
    else:
        prepare()
        hooks.on_train_begin(state)
        _train_epochs(state, hooks, loss_fn, val_loader, commit=lambda: None)
    faults.point("train.end")
    hooks.on_train_end(state)


def _train_elastic(state: TrainState, hooks: Any, loss_fn: Callable, val_loader: Any,
                   checkpoint_dir: str | Path | None, prepare: Callable[[], None]) -> None:
    """The same loop, committed after every step: a lost worker costs at most the step in flight.

    Everything collective happens inside the elastic protection: the replicas are made equal by the
    State's first sync, and the resume from a checkpoint is the first commit (``prepared``), so a
    worker lost at any moment after ``px.init()`` is survived like one lost mid-epoch.
    """
    optimizer = state.optimizer.position if isinstance(state.optimizer, ServerOptimizer) else state.optimizer
    objects = {"model": state.model, "optimizer": optimizer, "loader": state.loader,
               "loop": LoopPosition(state), "precision": state.precision, "lr_schedule": state.rates,
               **({"val_loader": val_loader} if val_loader is not None else {}),
               **({"exact": state.exact} if state.exact is not None else {})}
    last = None
    if checkpoint_dir is not None:
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        last = Path(checkpoint_dir) / checkpoint.ELASTIC_LAST
    carried = elastic.State(checkpoint_path=last, prepared=False, **objects)
    begun = False

    def train(carried: elastic.State) -> None:
        nonlocal begun
        if not carried.prepared:
            prepare()
            carried.prepared = True
            carried.commit()
        if not begun:  # once per process: callbacks are this worker's own objects
            hooks.on_train_begin(state)
            begun = True
        _train_epochs(state, hooks, loss_fn, val_loader, carried.commit)
        # Members leave together: one lost after its peers' last commit makes them re-form, so that
        # every survivor returns in the same group (one of them rank 0) rather than in a broken one.
        collectives.barrier()

    elastic.run(train)(carried)


def _train_epochs(state: TrainState, hooks: Any, loss_fn: Callable, val_loader: Any,
                  commit: Callable[[], None]) -> None:
    for epoch in range(state.epoch, state.epochs):
        logs = _train_epoch(state, hooks, loss_fn, epoch, commit)
        if logs is None:  # stopped mid-epoch: the position stays resumable
            return
        if val_loader is not None:
            faults.point("validation")
            logs.update(evaluate_batches(state.model, loss_fn, val_loader, fresh_copies(state.metrics), "val_",
                                         state.precision, state.step_fn))
        state.history.append(epoch, logs)
        state.rates.after_epoch(state, logs)
        hooks.on_epoch_end(epoch, logs, state)
        faults.point("epoch.end")
        commit()
        if state.stop_training:
            return


def _train_epoch(state: TrainState, hooks: Any, loss_fn: Callable, epoch: int,
                 commit: Callable[[], None]) -> dict[str, float] | None:
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
        if not _train_steps(state, hooks, loss_fn, commit):
            return None
    state.epoch, state.step = epoch + 1, 0
    return reduce_metrics(state.metrics)


def _train_steps(state: TrainState, hooks: Any, loss_fn: Callable, commit: Callable[[], None]) -> bool:
    """The epoch's remaining steps; False when a callback asked to stop before its end."""
    logs: dict[str, float] = {}
    started, samples = time.perf_counter(), 0
    for batch in state.loader:
        state.rates.before_step(state)
        hooks.on_step_begin(state.step, state)
        faults.point("step.forward")
        train_step(state, batch, loss_fn)
        state.rates.after_step(state)
        faults.point("step.end")
        state.step, state.global_step = state.step + 1, state.global_step + 1
        samples += state.loader.last_global_batch_size
        if state.step % LOG_EVERY_STEPS == 0 or not logs:
            logs = reduce_metrics(state.metrics)
        logs["samples_per_s"] = samples / max(time.perf_counter() - started, 1e-9)
        hooks.on_step_end(state.step - 1, logs, state)
        commit()
        if state.stop_training and state.step < state.steps_per_epoch:
            return False
    return True


def _check_accumulation(accumulate_steps: int, reproducible: bool) -> None:
    if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
        raise ConfigurationError(f"accumulate_steps must be a whole number of at least 1, got {accumulate_steps!r}.")
    if accumulate_steps > 1 and reproducible:
        raise ConfigurationError(
            "reproducible=True already runs every step in micro-batches of micro_batch_size samples, so its memory "
            "is that of one micro-batch: drop accumulate_steps.")


def _check_step(loss_fn: Callable | None, step_fn: Callable | None, reproducible: bool,
                accumulate_steps: int) -> bool:
    """Refuse a loss that is given twice or not at all, or a step_fn phalanx cannot run as asked;
    whether ``step_fn`` drives its own backward passes and optimizers."""
    if (loss_fn is None) == (step_fn is None):
        raise ConfigurationError(
            "px.fit computes each batch's loss with loss_fn(model(*inputs), targets) or with your step_fn(model, "
            "batch): give exactly one (loss_fn=None with step_fn=).")
    if step_fn is not None and reproducible:
        raise ConfigurationError("reproducible=True with step_fn: reproducible mode runs the model on its own "
                                 "micro-batches through loss_fn; use loss_fn, or reproducible=False.")
    manual = step_fn is not None and takes_step(step_fn)
    if manual and accumulate_steps > 1:
        raise ConfigurationError(f"accumulate_steps={accumulate_steps} with a step_fn(model, batch, step) that runs its "
                                 "own backward passes: phalanx cannot split them; accumulate inside your step, or "
                                 "use accumulate_steps=1.")
    return manual


def _check_precision(precision: str, reproducible: bool) -> None:
    if reproducible and precision != "32":
        raise ConfigurationError(
            f"reproducible=True with precision={precision!r}: bitwise identical weights across worker counts are "
            "promised in float32 only; use precision='32' for reproducible runs.")


def _check_one_meaning(model: nn.Module, train_data: Any, global_batch_size: int, accumulate_steps: int) -> None:
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


def _check_checkpoints(checkpoint_dir: str | Path | None, checkpoint_every: int | None, user: Sequence[Any]) -> None:
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


def _check_not_empty(loader: DistributedLoader, name: str) -> None:
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


def _micro_batch_size(reproducible: bool, micro_batch_size: int | None) -> int | None:
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


def _loader(data: Any, global_batch_size: int, seed: int, shuffle: bool,
            micro_batch_size: int | None = None) -> DistributedLoader:
    if isinstance(data, torch.utils.data.DataLoader):  # its settings kept, its sampler replaced
        return from_dataloader(data, global_batch_size, seed=seed, micro_batch_size=micro_batch_size)
    if not isinstance(data, DistributedLoader):
        return DistributedLoader(data, global_batch_size, shuffle=shuffle, seed=seed, micro_batch_size=micro_batch_size)
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
    log_dir = log_dir or checkpoint_dir
    if log_dir is not None:
        chosen.append(cb.CSVLogger(Path(log_dir) / "metrics.csv"))
        if cb.TensorBoard.available():
            chosen.append(cb.TensorBoard(Path(log_dir) / "tensorboard"))
    if checkpoint_dir is not None and not any(isinstance(c, cb.Checkpoint) for c in user):
        chosen.append(cb.Checkpoint(checkpoint_dir, every_steps=checkpoint_every))
    return chosen
