"""px.Loop subclassed: your own training_step, your own optimization, the loop's own hooks,
against the same hand-written torch loops as step_fn's."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from tests.harness import run_workers
from tests.train.test_fit import EPOCHS, GLOBAL_BATCH, _dataset, _model
from tests.train.test_step_fn import _AlternatingStep, _optimizers, _reference, _step, _TwoPlayers, serial_adversarial


class _WithPenalty(px.Loop):
    """The penalised step of test_step_fn, as a method; the loop counts its own epochs."""

    def training_step(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _step(self.model, batch)

    def on_epoch_end(self, epoch: int, logs: dict[str, float], state: Any) -> None:
        self.epochs_seen = [*getattr(self, "epochs_seen", []), epoch]


def _fit_with_penalty(options: dict) -> dict:
    model = _model()
    loop = _WithPenalty(model, _optimizers(model), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH,
                        metrics=["accuracy"], verbose=0, **options)
    history = loop.fit(_dataset(), val_data=_dataset())
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "history": history.history,
            "epochs_seen": loop.epochs_seen}


@pytest.mark.parametrize("world_size, options", [(1, {}), (2, {"accumulate_steps": 2})])
def test_a_loop_with_its_own_training_step_trains_as_the_serial_loop(world_size: int, options: dict) -> None:
    results = run_workers(_fit_with_penalty, world_size, options, timeout=150)
    reference = _reference()
    for result in results:
        for name, value in reference.items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6)
        assert result["history"] == results[0]["history"]
        assert result["epochs_seen"] == list(range(EPOCHS))
    assert results[0]["history"]["val_accuracy"][-1] > 0.6


class _Adversarial(px.Loop):
    """A GAN's alternating updates through the loop's own backward and optimizer_step."""

    automatic_optimization = False

    def __init__(self, players: _TwoPlayers, **options: Any) -> None:
        self.players = _AlternatingStep(players)
        super().__init__(players, [self.players.critic, self.players.generator], **options)

    def training_step(self, batch: Any) -> torch.Tensor:
        return self.players(self.model, batch, self)

    def step(self, optimizer: torch.optim.Optimizer) -> None:  # the name _AlternatingStep calls
        self.optimizer_step(optimizer)


def _fit_adversarial() -> dict:
    players = _TwoPlayers()
    history = _Adversarial(players, epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, verbose=0).fit(
        _dataset(), val_data=_dataset())
    return {"weights": {k: v.clone() for k, v in players.state_dict().items()}, "history": history.history}


def test_a_loop_that_drives_its_own_optimization_trains_as_the_serial_loop() -> None:
    reference = serial_adversarial()
    results = run_workers(_fit_adversarial, 2, timeout=150)
    for result in results:
        for name, value in reference.items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6)
        assert set(result["history"]) == {"loss", "val_loss"}
    assert results[0]["history"] == results[1]["history"]


class _Automatic(px.Loop):
    def training_step(self, batch: Any) -> torch.Tensor:
        loss = F.cross_entropy(self.model(batch[0]), batch[1])
        self.backward(loss)
        return loss


def test_what_a_loop_cannot_be_is_refused() -> None:
    px.init()
    model = _model()
    common: dict[str, Any] = dict(epochs=1, global_batch_size=GLOBAL_BATCH, verbose=0)
    with pytest.raises(px.ConfigurationError, match="overrides training_step and was given step_fn"):
        _WithPenalty(model, _optimizers(model), step_fn=_step, **common)
    with pytest.raises(px.ConfigurationError, match="reproducible=True with your own training step"):
        _WithPenalty(model, _optimizers(model), reproducible=True, micro_batch_size=4, **common)
    with pytest.raises(px.ConfigurationError, match="give exactly one"):
        px.Loop(model, _optimizers(model), **common)
    with pytest.raises(px.ConfigurationError, match="set automatic_optimization = False"):
        _Automatic(model, torch.optim.SGD(model.parameters(), lr=0.1), **common).fit(_dataset())


class _KerasHabits(px.Callback):
    """A callback written with Keras's and Lightning's hook names, and one of px.fit's."""

    def __init__(self) -> None:
        self.epochs = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        raise AssertionError("px.fit has no such hook")

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        raise AssertionError("px.fit has no such hook")

    def on_epoch_end(self, epoch: int, logs: dict, state: Any) -> None:
        self.epochs += 1


def _fit_with_foreign_hooks() -> tuple[list[str], int]:
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("phalanx.train.loop").addHandler(handler)
    model, callback = _model(), _KerasHabits()
    px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, _dataset(), epochs=2,
           global_batch_size=GLOBAL_BATCH, verbose=0, callbacks=[callback, px.callbacks.EarlyStopping(monitor="loss")])
    return said, callback.epochs


def test_a_callback_with_hooks_px_fit_never_calls_is_named_with_the_hooks_it_means() -> None:
    """Keras's on_train_batch_end and Lightning's on_train_epoch_end would be silently never called:
    rank 0 says so, naming px.fit's hooks; the hooks it does have run as usual."""
    results = run_workers(_fit_with_foreign_hooks, 2)
    said, epochs = results[0]
    warned = [message for message in said if "never calls" in message]
    assert len(warned) == 1, said
    assert ("the callback _KerasHabits defines on_train_batch_end (px.fit's is on_step_end), on_train_epoch_end "
            "(px.fit's is on_epoch_end), which px.fit never calls") in warned[0], warned[0]
    assert epochs == 2
    assert not [message for message in results[1][0] if "never calls" in message]  # rank 0 alone says it


class _LightningHabits(px.Loop):
    def on_train_epoch_end(self) -> None:
        raise AssertionError("px.Loop has no such hook")


def _loop_with_a_foreign_hook() -> list[str]:
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("phalanx.train.loop").addHandler(handler)
    model = _model()
    _LightningHabits(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, epochs=1,
                     global_batch_size=GLOBAL_BATCH, verbose=0).fit(_dataset())
    return said


def test_a_loop_subclass_with_a_hook_it_never_gets_is_named_too() -> None:
    said = run_workers(_loop_with_a_foreign_hook, 1)[0]
    assert any("the callback _LightningHabits defines on_train_epoch_end (px.fit's is on_epoch_end)" in message
               for message in said), said
