"""The Strategy interface is all px.fit's loop knows of a strategy: a new one, written here and
nowhere in phalanx, trains through px.fit with its own reduction, its own optimizer step and its
own epochs, and ends where the serial loop over the same global batches ends."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.parallel.buckets import Bucket
from phalanx.strategies.base import FitOptions, Run, Strategy, refuse
from tests.harness import run_workers
from tests.train.test_fit import EPOCHS, GLOBAL_BATCH, SAMPLES, _dataset, _model, _optimizer, _serial_reference


class _Done:
    def wait(self) -> None:
        """Nothing in flight."""


class _KeepLocal(px.Reduction):
    """Each rank keeps its gradient, weighted by its share of the global batch: nothing is sent."""

    name = "keep local"

    def reduce(self, bucket: Bucket) -> _Done:
        return _Done()


class _SummedUpdates:
    """The user's optimizer steps on this rank's weighted gradient; the ranks' updates are then summed.

    SGD with momentum is linear in the gradient, so the summed update is the global batch's: the
    result equals data-parallel training, with a reduction of parameters instead of gradients.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.steps = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        self.optimizer.step()
        for param, old in zip(params, before):
            update = px.allreduce(param - old)
            param.copy_(old + update)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class SummedUpdates(Strategy):
    """A fifth strategy: parameter updates summed after each local step, epochs driven by itself."""

    def __init__(self) -> None:
        self.optimizer: _SummedUpdates | None = None
        self.finished_with: dict[str, Any] | None = None

    def check(self, options: FitOptions) -> None:
        if options.reproducible:
            refuse("SummedUpdates", "reproducible=True", "its sum of updates is not the exact sum.")

    def setup(self, model: nn.Module, optimizer: Any) -> tuple[px.DataParallel, _SummedUpdates]:
        wrapped = px.DataParallel(model)
        wrapped.rebuild_reducer(reduction=_KeepLocal())
        self.optimizer = _SummedUpdates(optimizer)
        return wrapped, self.optimizer

    def train(self, run: Run) -> None:
        """Its own epochs: every batch a step, then validation summed over ranks."""
        state, hooks = run.state, run.hooks
        hooks.on_train_begin(state)
        for epoch in range(state.epoch, state.epochs):
            state.epoch, state.step = epoch, 0
            state.loader.set_epoch(epoch)
            state.model.train()
            for batch in state.loader:
                run.train_batch(batch)
                state.step, state.global_step = state.step + 1, state.global_step + 1
            metrics = run.fresh_metrics()
            with torch.no_grad():
                state.model.eval()
                for batch in run.val_loader:
                    run.validate_batch(batch, metrics)
            sums = px.allreduce(torch.tensor([[m.total, m.count] for m in metrics], dtype=torch.float64))
            logs = {f"val_{m.name}": float(total / count) for m, (total, count) in zip(metrics, sums)}
            state.history.append(epoch, logs)
            hooks.on_epoch_end(epoch, logs, state)
        state.epoch, state.step = state.epochs, 0
        hooks.on_train_end(state)

    def finish(self, history: dict[str, Any] | None = None) -> None:
        self.finished_with = history


class _EpochsEnded(px.callbacks.Callback):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, float], state: Any) -> None:
        self.epochs.append(epoch)


def _fit_with_summed_updates() -> dict:
    model, strategy, ended = _model(), SummedUpdates(), _EpochsEnded()
    history = px.fit(model, _optimizer(model), F.cross_entropy, _dataset(), epochs=EPOCHS,
                     global_batch_size=GLOBAL_BATCH, val_data=_dataset(), metrics=["accuracy"], verbose=0,
                     strategy=strategy, callbacks=[ended])
    assert strategy.optimizer is not None and strategy.finished_with is not None
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "history": history.history,
            "steps": strategy.optimizer.steps, "epochs_ended": ended.epochs,
            "finished_with": strategy.finished_with["records"]}


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_strategy_written_outside_phalanx_trains_through_fit(world_size: int) -> None:
    results = run_workers(_fit_with_summed_updates, world_size, timeout=150)
    reference, _ = _serial_reference()
    steps = EPOCHS * -(-SAMPLES // GLOBAL_BATCH)
    for result in results:
        for name, value in reference.items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6)
        assert result["steps"] == steps and result["epochs_ended"] == list(range(EPOCHS))
        assert result["history"] == results[0]["history"] == result["finished_with"]
    assert set(results[0]["history"]) == {"val_loss", "val_accuracy"}  # its epochs, not the loop's
    assert len(results[0]["history"]["val_loss"]) == EPOCHS
    assert results[0]["history"]["val_accuracy"][-1] > 0.6


def _refused() -> str:
    model = _model()
    with pytest.raises(px.ConfigurationError) as refused:
        px.fit(model, _optimizer(model), F.cross_entropy, _dataset(), epochs=1, global_batch_size=GLOBAL_BATCH,
               verbose=0, strategy=SummedUpdates(), reproducible=True, micro_batch_size=2)
    return str(refused.value)


def test_the_loop_asks_the_new_strategy_what_it_refuses() -> None:
    assert "SummedUpdates with reproducible=True" in run_workers(_refused, 1)[0]


def test_parameter_server_workers_leave_clipping_to_the_servers() -> None:
    """Their gradients are pushed during backward: a clip on the worker afterwards would change nothing."""
    from phalanx.parallel.clipping import Clipping
    from phalanx.strategies.base import Replicated

    clipping = Clipping(max_norm=1.0)
    assert px.ParameterServer().worker_clipping(clipping) is None
    assert Replicated().worker_clipping(clipping) is clipping and px.CentralStorage().worker_clipping(clipping) is clipping
