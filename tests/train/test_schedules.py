"""torch's learning-rate schedulers in px.fit: stepped as a hand-written loop steps them, resumed exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler

import phalanx as px
from phalanx.data import epoch_plan
from tests.harness import run_workers
from tests.train.test_fit import EPOCHS, GLOBAL_BATCH, SAMPLES, _dataset, _model, _optimizer

STEPS_PER_EPOCH = -(-SAMPLES // GLOBAL_BATCH)
SCHEDULERS = {  # name: (how to build it around an optimizer, when it steps)
    "StepLR every 3 steps": (lambda o: lr_scheduler.StepLR(o, step_size=3, gamma=0.7), "step"),
    "OneCycleLR": (lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=EPOCHS * STEPS_PER_EPOCH), "step"),
    "CosineAnnealingLR per epoch": (lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=EPOCHS), "epoch"),
    "ReduceLROnPlateau on val_loss": (lambda o: lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0,
                                                                               threshold=0.5), "epoch"),
}


def _fit(name: str, epochs: int = EPOCHS, checkpoint_dir: str | None = None) -> dict:
    build, interval = SCHEDULERS[name]
    model = _model()
    optimizer = _optimizer(model)
    scheduler = build(optimizer)
    history = px.fit(model, optimizer, F.cross_entropy, _dataset(), epochs=epochs, global_batch_size=GLOBAL_BATCH,
                     val_data=_dataset(), verbose=0, checkpoint_dir=checkpoint_dir,
                     lr_schedule=px.lr.Scheduled(scheduler, interval=interval))
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "lr": optimizer.param_groups[0]["lr"],
            "val_loss": history.history["val_loss"]}


def _reference(name: str) -> dict:
    build, interval = SCHEDULERS[name]
    model, (x, y) = _model(), _dataset()
    optimizer = _optimizer(model)
    scheduler = build(optimizer)
    for epoch in range(EPOCHS):
        for indices in epoch_plan(SAMPLES, GLOBAL_BATCH, seed=0, epoch=epoch, shuffle=True):
            optimizer.zero_grad()
            F.cross_entropy(model(x[indices]), y[indices]).backward()
            optimizer.step()
            if interval == "step":
                scheduler.step()
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            with torch.no_grad():
                scheduler.step(float(F.cross_entropy(model(x), y)))
        elif interval == "epoch":
            scheduler.step()
    return {"weights": model.state_dict(), "lr": optimizer.param_groups[0]["lr"]}


CASES = [(name, 2) for name in sorted(SCHEDULERS)] + [("StepLR every 3 steps", 1)]


@pytest.mark.parametrize("name, world_size", CASES)
def test_a_torch_scheduler_is_stepped_as_a_serial_loop_steps_it(name: str, world_size: int) -> None:
    results = run_workers(_fit, world_size, name, timeout=150)
    reference = _reference(name)
    for result in results:
        assert result["lr"] == pytest.approx(reference["lr"], rel=1e-9)
        for key, value in reference["weights"].items():
            torch.testing.assert_close(result["weights"][key], value, rtol=1e-5, atol=1e-6)
    first_lr = _optimizer(_model()).param_groups[0]["lr"]
    assert reference["lr"] != first_lr, "the scheduler never changed the rate: the test would not see it"


def test_the_scheduler_resumes_where_it_was(tmp_path: Path) -> None:
    name = "StepLR every 3 steps"  # 5 steps an epoch: a resume at an epoch's end falls mid-period
    run_workers(_fit, 2, name, 2, str(tmp_path), timeout=150)
    resumed = run_workers(_fit, 2, name, EPOCHS, str(tmp_path), timeout=150)[0]
    whole = _reference(name)
    assert resumed["lr"] == pytest.approx(whole["lr"], rel=1e-9)
    for key, value in whole["weights"].items():
        torch.testing.assert_close(resumed["weights"][key], value, rtol=1e-5, atol=1e-6)


def test_what_cannot_be_a_schedule_is_refused() -> None:
    px.init()
    model = _model()
    optimizer = _optimizer(model)
    other = lr_scheduler.StepLR(_optimizer(_model()), step_size=1)
    cases = (("every epoch", "must be a function of the fractional epoch"), (other, "another optimizer"),
             (px.lr.Scheduled(lr_scheduler.ReduceLROnPlateau(optimizer), monitor="val_f1"), "monitors 'val_f1'"))
    for schedule, message in cases:
        with pytest.raises(px.ConfigurationError, match=message):
            px.fit(model, optimizer, F.cross_entropy, _dataset(), epochs=1, global_batch_size=GLOBAL_BATCH,
                   val_data=_dataset(), verbose=0, lr_schedule=schedule)
