"""px.elastic.State: commit, restore, checkpoints, and sync between real workers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx import elastic
from phalanx.comm import runtime
from phalanx.data import DistributedLoader
from tests.harness import run_workers


def setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)  # the same data on every rank, whatever the seed
    data = (torch.randn(40, 4, generator=generator), torch.randn(40, 1, generator=generator))
    return model, optimizer, data


def train_steps(model, optimizer, batches, state=None) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        if state is not None:
            state.step += 1
            state.commit()


def test_restore_returns_to_the_last_commit_and_keeps_no_alias() -> None:
    model, optimizer, data = setup()
    loader = DistributedLoader(data, 8, seed=2, rank=0, world_size=1)
    state = elastic.State(model=model, optimizer=optimizer, loader=loader, step=0, epoch=0)
    iterator = iter(loader)
    train_steps(model, optimizer, [next(iterator) for _ in range(2)], state)
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    moment = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    train_steps(model, optimizer, [next(iterator)])  # an uncommitted step: lost on restore
    state.step = 99
    state.restore()
    assert state.step == 2 and state.version == 2  # two commits after the initial one
    assert all(torch.equal(model.state_dict()[k], v) for k, v in committed.items())
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], moment)
    assert loader.state_dict()["consumed"] == 16
    train_steps(model, optimizer, [next(iter(loader))])  # training on must not change the commit
    state.restore()
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], moment)
    assert [p.grad for p in model.parameters()] == [None] * 4


def test_epoch_follows_the_loader() -> None:
    model, optimizer, data = setup()
    loader = DistributedLoader(data, 20, seed=2, rank=0, world_size=1)
    state = elastic.State(model=model, loader=loader, epoch=0)
    for epoch in range(state.epoch, 2):
        loader.set_epoch(epoch)
        for _ in loader:
            state.commit()
            if epoch == 0:
                expected = 0 if loader.state_dict()["consumed"] else 1
                assert state.epoch == expected
    assert state.epoch == 2


def test_save_and_load(tmp_path: Path) -> None:
    model, optimizer, data = setup()
    state = elastic.State(model=model, optimizer=optimizer, step=0, checkpoint_path=tmp_path / "c.pt")
    train_steps(model, optimizer, [data], state)
    assert Path(state.save()).exists()
    other_model, other_optimizer, _ = setup(seed=5)
    other = elastic.State(model=other_model, optimizer=other_optimizer, step=0)
    other.load(tmp_path / "c.pt")
    assert other.step == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other_model.parameters()))
    with pytest.raises(px.CheckpointError, match="was not written by"):
        torch.save({"x": 1}, tmp_path / "other.pt")
        other.load(tmp_path / "other.pt")


def test_a_save_removes_the_temporary_file_a_killed_save_left(tmp_path: Path) -> None:
    left = tmp_path / ".c.pt.0123abcd.tmp"  # what a survivor killed while saving leaves
    left.write_bytes(b"half a commit")
    then = time.time() - 3600  # an hour: far longer than atomic.STALE_AFTER_S
    os.utime(left, (then, then))
    model, optimizer, data = setup()
    elastic.State(model=model, optimizer=optimizer, step=0, checkpoint_path=tmp_path / "c.pt").save()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["c.pt"]


def test_entries_and_errors() -> None:
    model, _, _ = setup()
    state = elastic.State(model=model, step=3, best=None)
    assert state.model is model and state.step == 3 and state.best is None
    state.best = 0.5
    with pytest.raises(AttributeError, match="entries"):
        _ = state.missing
    with pytest.raises(AttributeError, match="in place"):
        state.model = model
    with pytest.raises(px.ConfigurationError, match="reserved"):
        elastic.State(commit=1)
    with pytest.raises(px.ConfigurationError, match="needs something"):
        elastic.State()


def test_run_outside_an_elastic_launch_just_calls_the_function() -> None:
    model, _, _ = setup()
    state = elastic.State(model=model, step=0)
    assert not elastic.enabled() and elastic.membership() is None
    assert elastic.run(lambda s, k: s.step + k)(state, 4) == 4


def _sync_from_the_newest_commit() -> tuple:
    """Rank 1 trained two more steps and committed them; rank 0 (fresh model) receives its state."""
    rank = runtime.rank()
    model, optimizer, data = setup(seed=rank)
    dp = px.DataParallel(model, broadcast=False)
    loader = DistributedLoader(data, 8, seed=2)
    state = elastic.State(model=dp, optimizer=optimizer, loader=loader, step=0)
    state.sync()  # the first sync makes every member equal (rank 0's state, everyone fresh)
    state.restore()
    if rank == 1:  # diverges locally, as a survivor whose last step completed where others failed
        local = DistributedLoader(data, 8, seed=2, rank=0, world_size=1)
        batches = iter(local)
        with dp.no_sync():  # local steps, without the peer
            train_steps(dp, optimizer, [next(batches) for _ in range(2)], state)
        loader.load_state_dict(local.state_dict())
        state.commit()
    root = state.sync()
    state.restore()
    dp.rebuild_reducer()
    x, y = next(iter(loader))
    optimizer.zero_grad()
    F.mse_loss(dp(x), y).backward()  # the rebuilt reducer works
    optimizer.step()
    return root, state.step, state.version, loader.state_dict()["consumed"], [p.detach().clone() for p in model.parameters()]


def test_sync_broadcasts_the_newest_commit_and_reshards() -> None:
    first, second = run_workers(_sync_from_the_newest_commit, 2, timeout=120)
    assert first[:4] == second[:4] == (1, 2, 3, 24)  # root 1; 2 steps; 3 commits; 3 batches of 8
    assert all(torch.equal(a, b) for a, b in zip(first[4], second[4]))


class _Opaque:
    """A value torch.load(weights_only=True) refuses: it must not travel between members."""


def _sync_an_opaque_value() -> str:
    state = elastic.State(step=0, notes={"epoch": 3, "object": _Opaque() if runtime.rank() == 0 else None})
    try:
        state.sync()
    except px.ConfigurationError as error:
        return str(error)
    return "synced"


def test_a_state_value_that_could_run_code_is_refused_on_every_member() -> None:
    """The structure travels as torch.save bytes loaded with weights_only=True: an arbitrary
    object (which unpickling could turn into code) is refused by its sender, on every rank."""
    for message in run_workers(_sync_an_opaque_value, 2):
        assert "cannot travel safely" in message and "weights_only" in message, message


def test_restore_gives_back_the_random_streams_of_the_commit() -> None:
    import random

    import numpy as np

    model, _, _ = setup()
    state = elastic.State(model=model, step=0)
    state.commit()
    drawn = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(5), random.random(), np.random.rand()  # the step that fails draws more
    state.restore()  # the redo of the step draws the same numbers again
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(drawn[0], again[0]) and drawn[1:] == again[1:]


def test_a_sharded_optimizer_is_refused_as_a_whole_object_naming_what_to_hold_instead() -> None:
    """Its state dict would gather the whole state on every rank at each commit, laid out for the old
    group after a re-form: the State holds what the strategy commits instead."""
    model = nn.Linear(4, 2)
    strategy = px.Sharded(level=2)
    sharded, optimizer = strategy.setup(model, torch.optim.Adam(model.parameters()))
    with pytest.raises(px.ConfigurationError, match=r"State\(optimizer=\.\.\.\).*\*\*strategy\.committed"):
        elastic.State(model=sharded, optimizer=optimizer, step=0)
    state = elastic.State(**strategy.committed(sharded, optimizer), step=0)
    assert state.step == 0
