"""EarlyStopping(restore_best=True) leaves the best epoch's weights on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import phalanx as px
from tests.harness import run_workers
from tests.train.test_fit import GLOBAL_BATCH, _dataset, _model


class _EpochWeights(px.callbacks.Callback):
    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_epoch_end(self, epoch, logs, state) -> None:  # type: ignore[no-untyped-def]
        self.weights.append({k: v.clone() for k, v in state.model.state_dict().items()})


def _stop_early_and_restore() -> dict:
    recorder = _EpochWeights()
    stopping = px.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best=True)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=3.0)  # too large: the validation loss soon worsens
    history = px.fit(model, optimizer, F.cross_entropy, _dataset(), epochs=12, global_batch_size=GLOBAL_BATCH,
                     val_data=_dataset(), verbose=0, callbacks=[recorder, stopping])
    losses = history["val_loss"]
    best = min(range(len(losses)), key=losses.__getitem__)
    return {"best": best, "chosen": stopping.best_epoch, "epochs": len(losses),
            "restored": all(torch.equal(v, recorder.weights[best][k]) for k, v in model.state_dict().items()),
            "last_differs": any(not torch.equal(v, recorder.weights[-1][k]) for k, v in model.state_dict().items())}


def test_early_stopping_restores_the_best_epoch_on_every_rank() -> None:
    for result in run_workers(_stop_early_and_restore, 2, timeout=150):
        assert result["chosen"] == result["best"] and result["epochs"] < 12, result
        assert result["restored"] and result["last_differs"], result
