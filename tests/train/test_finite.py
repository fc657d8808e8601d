"""A non-finite loss never trains silently: every rank stops (or skips) at the same step, and no
checkpoint is written or resumed with NaN weights."""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.train import checkpoint_io, finite
from tests.harness import run_workers

SAMPLES, GLOBAL_BATCH = 96, 16  # 6 steps an epoch
MARKED = 77  # the sample whose output is NaN, in tests that make one sample poison its step


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 6, generator=generator)
    x[:, -1] = torch.arange(SAMPLES, dtype=torch.float32)  # each sample's index, for MarkedNaN
    return x, (x[:, 0] > 0).long()


class MarkedNaN(nn.Module):
    """A small network whose output is NaN for the sample with index ``MARKED`` (wherever it lands)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x[:, :-1])
        return torch.where(x[:, -1:] == MARKED, torch.full_like(out, math.nan), out)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _nan_on(rank: int, call: int, constant: bool = False):
    """A loss_fn whose ``call``-th loss (counted from 0) on ``rank`` is NaN: the whole loss, or (``constant``)
    only a term without a gradient, so that the gradients stay finite."""
    calls = [0]

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(outputs, targets)
        calls[0] += 1
        if px.rank() == rank and calls[0] - 1 == call:
            return loss + torch.tensor(-math.inf) if constant else loss * math.nan
        return loss
    return loss_fn


def _stop_at_nan(checkpoints: str, constant: bool, late: bool = False) -> dict:
    if late:  # as on a GPU: each step's verdict read when the next step is about to be applied
        finite.reads_late = lambda device: True
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        px.fit(model, optimizer, _nan_on(rank=1, call=8, constant=constant), _data(), epochs=3,
               global_batch_size=GLOBAL_BATCH, clip_grad_norm=1.0, checkpoint_dir=checkpoints, checkpoint_every=2,
               verbose=0)
    except px.NonFiniteLossError as error:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        return {"message": str(error), "ranks": error.ranks, "weights": weights}
    return {"message": None}


@pytest.mark.parametrize("constant", [False, True], ids=["nan-loss", "nan-constant-term"])
def test_a_nan_loss_on_one_rank_stops_every_rank_before_the_step(tmp_path: Path, constant: bool) -> None:
    results = run_workers(_stop_at_nan, 2, str(tmp_path), constant)
    messages = [result["message"] for result in results]
    assert messages[0] == messages[1] and messages[0] is not None, messages
    message = messages[0]
    # the 9th step: global step 8, epoch 1's step 2, rank 1 named; advice that fits a run that clips
    assert "global step 8 (epoch 1, its step 2" in message and "on rank 1" in message, message
    assert "already clipped (clip_grad_norm=1" in message and "on_nonfinite='skip'" in message, message
    assert results[0]["ranks"] == results[1]["ranks"] == [1]
    assert torch.equal(results[0]["weights"], results[1]["weights"])
    assert torch.isfinite(results[0]["weights"]).all()
    steps = [checkpoint_io.step_of(path) for path in checkpoint_io.list_checkpoints(tmp_path)]
    assert steps and max(steps) == 8, steps  # written every 2 steps, up to the last finite one
    for path in checkpoint_io.list_checkpoints(tmp_path):
        weights = torch.load(path, weights_only=True)["model"]
        assert all(torch.isfinite(tensor).all() for tensor in weights.values()), path


def test_on_a_gpu_the_verdict_comes_a_step_late_and_no_checkpoint_holds_the_applied_step(tmp_path: Path) -> None:
    """The same run as above, reading each verdict a step late (a GPU's way, forced here on the CPU):
    every rank raises the same error naming the same step, at the next one, with the update applied."""
    results = run_workers(_stop_at_nan, 2, str(tmp_path), False, True)
    message = results[0]["message"]
    assert message is not None and message == results[1]["message"], results
    assert "global step 8 (epoch 1, its step 2" in message and "on rank 1" in message, message
    assert "read one step late" in message and "update was applied" in message, message
    assert results[0]["ranks"] == results[1]["ranks"] == [1]
    first, second = results[0]["weights"], results[1]["weights"]
    assert not torch.isfinite(first).all() and torch.equal(first.nan_to_num(), second.nan_to_num())
    steps = [checkpoint_io.step_of(path) for path in checkpoint_io.list_checkpoints(tmp_path)]
    assert steps and max(steps) == 8, steps
    for path in checkpoint_io.list_checkpoints(tmp_path):
        weights = torch.load(path, weights_only=True)["model"]
        assert all(torch.isfinite(tensor).all() for tensor in weights.values()), path


def _late_at_the_last_step() -> dict:
    """A NaN in the epoch's last step, read late: decided at the epoch's end, before validation."""
    finite.reads_late = lambda device: True
    model, seen = _model(), []

    class Seen(px.callbacks.Callback):
        def on_epoch_begin(self, epoch, state) -> None:  # noqa: ANN001
            seen.append(f"epoch {epoch}")

        def on_epoch_end(self, epoch, logs, state) -> None:  # noqa: ANN001
            seen.append(f"end of epoch {epoch}")

    try:
        px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _nan_on(rank=0, call=5), _data(), epochs=2,
               global_batch_size=GLOBAL_BATCH, val_data=_data(), verbose=0, callbacks=[Seen()])
    except px.NonFiniteLossError as error:
        return {"message": str(error), "seen": seen}
    return {"message": None, "seen": seen}


def test_a_late_verdict_of_an_epochs_last_step_is_decided_at_its_end() -> None:
    result = run_workers(_late_at_the_last_step, 1)[0]
    assert result["message"] is not None and "global step 5 (epoch 0, its step 5" in result["message"], result
    assert result["seen"] == ["epoch 0"]  # no validation, no epoch-end callbacks (checkpoints), no next epoch


def _skip_marked(micro_batch_size: int) -> dict:
    model = MarkedNaN()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loop = px.Loop(model, optimizer, F.cross_entropy, epochs=2, global_batch_size=GLOBAL_BATCH, verbose=0,
                   on_nonfinite="skip", reproducible=True, micro_batch_size=micro_batch_size)
    history = loop.fit(_data())
    return {"weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
            "loss": history["loss"], "skipped": loop.state.guard.skipped_steps}


def test_skipped_steps_are_skipped_alike_at_any_worker_count() -> None:
    """The step holding the poisoned sample is skipped on every rank, once an epoch, bitwise the same
    at 1 and 2 workers (reproducible mode), and its samples do not count in the epoch's loss."""
    alone = run_workers(_skip_marked, 1, 4)[0]
    pair = run_workers(_skip_marked, 2, 4)
    assert alone["skipped"] == pair[0]["skipped"] == pair[1]["skipped"] == 2
    assert all(math.isfinite(loss) for loss in alone["loss"]), alone["loss"]
    assert torch.isfinite(alone["weights"]).all()
    assert torch.equal(alone["weights"], pair[0]["weights"]) and torch.equal(pair[0]["weights"], pair[1]["weights"])
    assert alone["loss"] == pytest.approx(pair[0]["loss"], rel=1e-6)  # metrics are summed in float


class NaNStep(px.Loop):
    """A loop whose own step goes NaN at its fourth call."""

    calls = 0

    def training_step(self, batch):
        inputs, targets = batch
        NaNStep.calls += 1
        loss = F.cross_entropy(self.model(inputs), targets)
        return loss * math.nan if NaNStep.calls == 4 else loss


@pytest.mark.parametrize("how", ["accumulating", "bf16", "own loop", "manual optimization"])
def test_every_kind_of_step_stops_at_a_nan_loss(how: str) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options: dict = {"epochs": 2, "global_batch_size": GLOBAL_BATCH, "verbose": 0}
    loss_fn = _nan_on(rank=0, call=3 if how != "accumulating" else 7)  # two chunks a step: the 4th step's second
    if how == "accumulating":
        loop = px.Loop(model, optimizer, loss_fn, accumulate_steps=2, **options)
    elif how == "bf16":
        loop = px.Loop(model, optimizer, loss_fn, precision="bf16-mixed", **options)
    elif how == "own loop":
        NaNStep.calls = 0
        loop = NaNStep(model, optimizer, **options)
    else:
        def step_fn(model, batch, step):
            inputs, targets = batch
            loss = loss_fn(model(inputs), targets)
            step.backward(loss)
            step.step(optimizer)
            return loss
        loop = px.Loop(model, optimizer, step_fn=step_fn, **options)
    before = None

    class Watch(px.callbacks.Callback):
        def on_step_end(self, step, logs, state):
            nonlocal before
            before = [p.detach().clone() for p in model.parameters()]

    loop.callbacks.append(Watch())
    with pytest.raises(px.NonFiniteLossError, match=r"global step 3 \(epoch 0, its step 3.*on rank 0|on rank 0.*"
                                                   r"global step 3 \(epoch 0, its step 3"):
        loop.fit(_data())
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters())), "the NaN step was applied"


def test_float16_overflows_stay_the_scalers_until_its_scale_falls_below_one() -> None:
    """Under "16-mixed" a non-finite step is skipped by the scaler as always (tests/train/test_precision.py);
    a loss that stays NaN makes it skip step after step, and once its scale falls below 1 the run stops."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = [0]

    def loss_fn(outputs, targets):  # NaN from the third step on
        calls[0] += 1
        loss = F.cross_entropy(outputs, targets)
        return loss * math.nan if calls[0] > 2 else loss
    with pytest.raises(px.NonFiniteLossError, match=r"global step 18 .*scale fell to 0.5.*bf16-mixed"):
        px.fit(model, optimizer, loss_fn, _data(), epochs=4, global_batch_size=GLOBAL_BATCH, verbose=0,
               precision="16-mixed")


def test_a_gradient_that_goes_nan_without_a_nan_loss_is_named_as_such() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = [0]

    def loss_fn(outputs, targets):  # at the second step, a finite loss (+ sqrt(0)) whose gradient is not
        calls[0] += 1
        loss = F.cross_entropy(outputs, targets)
        return loss + (outputs[0, 0] - outputs[0, 0].detach()).sqrt() if calls[0] == 2 else loss
    with pytest.raises(px.NonFiniteGradientError, match="though every rank's loss was finite") as raised:
        px.fit(model, optimizer, loss_fn, _data(), epochs=1, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert not isinstance(raised.value, px.NonFiniteLossError) and "clip the gradients" in str(raised.value)


def test_ignore_trains_on_as_before_but_writes_no_nan_checkpoint(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = px.fit(model, optimizer, _nan_on(rank=0, call=3), _data(), epochs=2,
                         global_batch_size=GLOBAL_BATCH, on_nonfinite="ignore", checkpoint_dir=tmp_path,
                         checkpoint_every=2, verbose=0)
    assert math.isnan(history["loss"][-1])
    refused = [str(w.message) for w in caught if "not writing the checkpoint" in str(w.message)]
    assert refused and "holds NaN or Inf" in refused[0], [str(w.message) for w in caught]
    assert [checkpoint_io.step_of(p) for p in checkpoint_io.list_checkpoints(tmp_path)] == [2]


def test_a_checkpoint_with_nan_weights_is_not_resumed_and_the_advice_works(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    model = _model()
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, _data(), epochs=2,
           global_batch_size=GLOBAL_BATCH, checkpoint_dir=folder, verbose=0)
    newest = checkpoint_io.list_checkpoints(folder)[0]
    payload = torch.load(newest, weights_only=True)  # as an older phalanx would have written it
    payload["model"]["0.weight"][0, 0] = math.nan
    torch.save(payload, newest)

    def resume() -> px.History:
        model = _model()
        return px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, _data(), epochs=3,
                      global_batch_size=GLOBAL_BATCH, checkpoint_dir=folder, verbose=0)
    with pytest.raises(px.CheckpointError, match="'0.weight' has NaN or Inf") as refused:
        resume()
    assert f"Move {newest.name}" in str(refused.value)
    shutil.move(str(newest), str(tmp_path / newest.name))  # the advice, followed
    history = resume()
    assert history.epochs == [0, 1, 2] and all(math.isfinite(loss) for loss in history["loss"])


def test_the_option_is_checked() -> None:
    model = _model()
    with pytest.raises(px.ConfigurationError, match="on_nonfinite must be one of"):
        px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, _data(), epochs=1,
               global_batch_size=GLOBAL_BATCH, on_nonfinite="stop")


@pytest.mark.parametrize("entries, bad", [
    ([3e38, 3e38], False),  # finite entries whose float32 sum overflows: looked at again, and finite
    ([1.0, math.nan], True), ([1.0, math.inf], True), ([-math.inf, math.inf], True), ([-math.inf, 2.0], True),
], ids=["overflowing-sum", "nan", "inf", "inf-minus-inf", "minus-inf"])
def test_the_gradient_check_finds_every_nan_or_inf_and_nothing_else(entries: list[float], bad: bool) -> None:
    """The check sums each gradient on a CPU; a sum that overflowed is not a non-finite gradient.
    The other parameters mix dtypes (a float64 gradient beyond float32's range, a bfloat16 one)."""
    params = [torch.zeros(2), torch.zeros(1, dtype=torch.float64), torch.zeros(3, dtype=torch.bfloat16)]
    params[0].grad = torch.tensor(entries)
    params[1].grad = torch.tensor([1e300], dtype=torch.float64)
    params[2].grad = torch.ones(3, dtype=torch.bfloat16)
    guard = finite.NonFiniteGuard("skip")
    guard.begin_step("a test's step")
    assert guard.allows_step(params) is not bad and guard.skipped is bad
