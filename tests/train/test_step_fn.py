"""Your own step and several optimizers in px.fit, against hand-written torch loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from tests.harness import run_workers
from tests.train.test_fit import EPOCHS, GLOBAL_BATCH, _dataset, _model, global_batches

PENALTY = 1e-2


def _optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """SGD with momentum for the first layer, Adam for the last: one optimizer per part."""
    return [torch.optim.SGD(model[0].parameters(), lr=0.2, momentum=0.9), torch.optim.Adam(model[2].parameters(), lr=0.01)]


def _step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy plus a penalty on the last layer's weights; the outputs for accuracy."""
    inputs, targets = batch
    outputs = model(inputs)
    last = model.module[2] if isinstance(model, px.DataParallel) else model[2]
    return F.cross_entropy(outputs, targets) + PENALTY * last.weight.square().sum(), outputs


def _fit(options: dict) -> dict:
    model = _model()
    history = px.fit(model, _optimizers(model), None, _dataset(), step_fn=_step, epochs=EPOCHS,
                     global_batch_size=GLOBAL_BATCH, val_data=_dataset(), metrics=["accuracy"], verbose=0, **options)
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "history": history.history}


def _reference() -> dict:
    model, (x, y) = _model(), _dataset()
    optimizers = _optimizers(model)
    for indices in global_batches():
        for optimizer in optimizers:
            optimizer.zero_grad()
        _step(model, (x[indices], y[indices]))[0].backward()
        for optimizer in optimizers:
            optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("world_size, options", [(1, {}), (2, {}), (2, {"accumulate_steps": 2})])
def test_a_step_of_your_own_with_two_optimizers_trains_as_the_serial_loop(world_size: int, options: dict) -> None:
    results = run_workers(_fit, world_size, options, timeout=150)
    reference = _reference()
    for result in results:
        for name, value in reference.items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6)
        assert result["history"] == results[0]["history"]
    history = results[0]["history"]
    assert set(history) == {"loss", "accuracy", "val_loss", "val_accuracy"} and history["val_accuracy"][-1] > 0.6


def test_what_a_step_cannot_be_is_refused() -> None:
    px.init()
    model = _model()
    data = _dataset()
    common = dict(epochs=1, global_batch_size=GLOBAL_BATCH, verbose=0)
    cases = (
        (dict(loss_fn=F.cross_entropy, step_fn=_step), "give exactly one"),
        (dict(loss_fn=None), "give exactly one"),
        (dict(loss_fn=None, step_fn=lambda m, b: m(b[0])), r"scalar tensor, or \(loss, outputs\); got Tensor of shape"),
        (dict(loss_fn=None, step_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), metrics=["accuracy"]),
         r"metrics \['accuracy'\] need the model's outputs"),
        (dict(loss_fn=F.cross_entropy, strategy=px.CentralStorage()), "px.CentralStorage with a list of optimizers"),
    )
    for options, message in cases:
        loss_fn = options.pop("loss_fn")
        with pytest.raises(px.ConfigurationError, match=message):
            px.fit(model, _optimizers(model), loss_fn, data, **common, **options)


class _TwoPlayers(torch.nn.Module):
    """A generator and a critic; the model's forward is the critic's, so its samples are counted."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G = torch.nn.Linear(10, 10)
        self.D = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.D(x)


class _AlternatingStep:
    """A GAN's step: the critic's update on real and generated samples, then the generator's."""

    def __init__(self, players: _TwoPlayers) -> None:
        self.critic = torch.optim.SGD(players.D.parameters(), lr=0.1)
        self.generator = torch.optim.SGD(players.G.parameters(), lr=0.1)

    def __call__(self, model, batch, step):  # type: ignore[no-untyped-def]
        real = batch[0]
        players = model.module if isinstance(model, px.DataParallel) else model
        fake = players.G(real.flip(1) * 0.5)
        critic_loss = F.softplus(-model(real)).mean() + F.softplus(model(fake.detach())).mean()
        step.backward(critic_loss)
        step.step(self.critic)
        generator_loss = F.softplus(-model(fake)).mean()
        step.backward(generator_loss)
        step.step(self.generator)
        return critic_loss.detach() + generator_loss.detach()


class _Serial:
    def __init__(self) -> None:
        self.training = True

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


def _fit_adversarial() -> dict:
    players = _TwoPlayers()
    step = _AlternatingStep(players)
    history = px.fit(players, [step.critic, step.generator], None, _dataset(), step_fn=step, epochs=EPOCHS,
                     global_batch_size=GLOBAL_BATCH, val_data=_dataset(), verbose=0)
    return {"weights": {k: v.clone() for k, v in players.state_dict().items()}, "history": history.history}


def serial_adversarial() -> dict:
    """The alternating critic/generator step run serially over every global batch: the weights."""
    players, (x, y) = _TwoPlayers(), _dataset()
    serial = _AlternatingStep(players)
    for indices in global_batches():
        serial.critic.zero_grad()
        serial.generator.zero_grad()
        serial(players, (x[indices], y[indices]), _Serial())
    return players.state_dict()


def test_a_step_that_drives_its_own_backward_and_optimizers_trains_as_the_serial_loop() -> None:
    reference = serial_adversarial()
    for result in run_workers(_fit_adversarial, 2, timeout=150):
        for name, value in reference.items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6)
        assert set(result["history"]) == {"loss", "val_loss"}
