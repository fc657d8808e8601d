"""The loop says how it reads its data and how many steps it takes, before training, and a torch
scheduler sized for another number of steps is refused (or warned about) instead of running half way."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR, OneCycleLR
from torch.utils.data import DataLoader, TensorDataset

import phalanx as px
from tests.harness import run_workers

SAMPLES, GLOBAL_BATCH, EPOCHS = 1500, 128, 2  # 12 steps an epoch; a DataLoader of 64 has 24 batches


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=generator)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=64, shuffle=True)


def _fit_one_cycle(sized_by: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = _loader()
    steps = {"len(train_loader)": len(train_loader),
             "px.steps_per_epoch": px.steps_per_epoch(train_loader, global_batch_size=GLOBAL_BATCH)}[sized_by]
    schedule = OneCycleLR(optimizer, max_lr=0.5, epochs=EPOCHS, steps_per_epoch=steps)
    loop = px.Loop(model, optimizer, F.cross_entropy, epochs=EPOCHS, global_batch_size=GLOBAL_BATCH,
                   lr_schedule=schedule)
    try:
        loop.fit(train_loader)
    except px.ConfigurationError as error:
        return {"error": str(error)}
    return {"lr": optimizer.param_groups[0]["lr"], "steps": loop.estimated_stepping_batches,
            "estimated": px.estimated_stepping_batches(train_loader, epochs=EPOCHS, global_batch_size=GLOBAL_BATCH)}


def test_a_one_cycle_schedule_sized_from_len_of_the_loader_is_refused_at_two_workers(capfd) -> None:
    results = run_workers(_fit_one_cycle, 2, "len(train_loader)")
    for result in results:  # every rank refuses, before training
        error = result["error"]
        assert "OneCycleLR was built for 48 steps, but px.fit will take 24 optimizer steps" in error, error
        assert "len(DataLoader)=24 counts its batches, not steps" in error and "total_steps=24" in error, error


def test_the_steps_the_loop_gives_finish_the_schedule_and_the_plan_is_printed_first(capfd) -> None:
    results = run_workers(_fit_one_cycle, 2, "px.steps_per_epoch")
    assert [r["steps"] for r in results] == [r["estimated"] for r in results] == [24, 24]
    assert all(result["lr"] < 0.01 for result in results), results  # the cycle ran to its end (half way: 0.16)
    out = capfd.readouterr().out
    plan = ("train_data: 1500 samples in global batches of 128 (64 on each of 2 workers); the DataLoader's "
            "batch_size=64 is read as each worker's share of the global batch; 12 steps an epoch x 2 epochs = 24 "
            "optimizer steps")
    assert out.count(plan) == 1, out  # rank 0 alone, before the first epoch's line
    assert out.index(plan) < out.index("epoch ")


def test_a_cosine_horizon_that_differs_is_warned_about() -> None:
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        px.fit(model, optimizer, F.cross_entropy, _loader(), epochs=1, global_batch_size=64, verbose=0,
               lr_schedule=CosineAnnealingLR(optimizer, T_max=100))
    said = [str(w.message) for w in caught if "CosineAnnealingLR(T_max=100)" in str(w.message)]
    assert said and "it takes 24 optimizer steps" in said[0], [str(w.message) for w in caught]


def test_the_steps_of_a_stream_are_not_guessed() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(torch.zeros(2), 0)] * 10)
    with pytest.raises(px.ConfigurationError, match="stream of unknown length"):
        px.steps_per_epoch(Stream(), global_batch_size=4)
