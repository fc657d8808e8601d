"""The open loop's options under px.CentralStorage: it trains as the hand-written loop does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader, TensorDataset

import phalanx as px
from tests.harness import run_workers
from tests.train.test_fit import EPOCHS, GLOBAL_BATCH, _dataset, _model, _optimizer, global_batches

CLIP = 0.5


def _fit_with_everything(precision: str) -> dict:
    """A DataLoader, clipping, a StepLR scheduler and ``precision``, under central storage."""
    model = _model()
    optimizer = _optimizer(model)
    px.fit(model, optimizer, F.cross_entropy, DataLoader(TensorDataset(*_dataset()), batch_size=GLOBAL_BATCH,
                                                         shuffle=True),
           epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, verbose=0, clip_grad_norm=CLIP, precision=precision,
           lr_schedule=lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5), strategy=px.CentralStorage())
    return {k: v.clone() for k, v in model.state_dict().items()}


def _reference(dtype: torch.dtype | None) -> dict:
    model, (x, y) = _model(), _dataset()
    optimizer = _optimizer(model)
    scheduler = lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    for indices in global_batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x[indices]), y[indices])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
    return model.state_dict()


def test_central_storage_clips_schedules_and_loads_a_dataloader_as_the_serial_loop() -> None:
    reference = _reference(None)
    for weights in run_workers(_fit_with_everything, 2, "32", timeout=150):
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)


def test_central_storage_in_bf16_as_the_serial_autocast_loop() -> None:
    reference = _reference(torch.bfloat16)
    for weights in run_workers(_fit_with_everything, 2, "bf16-mixed", timeout=150):
        for name, value in reference.items():
            torch.testing.assert_close(weights[name], value, rtol=0.05, atol=0.02)
