"""Checkpoint files: what pruning keeps, and a new run in a folder that holds an older run's."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx import elastic
from phalanx.atomic import save_atomically
from phalanx.data import DistributedLoader
from phalanx.train import checkpoint, checkpoint_io
from phalanx.train.state import LoopPosition, TrainState

STEPS_PER_EPOCH = 5


def _write(folder: Path, steps: range | tuple[int, ...]) -> None:
    for step in steps:
        save_atomically({"model": {"w": torch.full((2,), float(step))}}, checkpoint_io.checkpoint_path(folder, step))


def _damage(folder: Path, step: int) -> None:
    path = checkpoint_io.checkpoint_path(folder, step)
    path.write_bytes(path.read_bytes()[:40])  # truncated, as by a writer that did not write atomically


def _steps(folder: Path) -> list[int]:
    return [int(path.stem.removeprefix("checkpoint-")) for path in checkpoint_io.list_checkpoints(folder)]


def test_pruning_counts_only_readable_checkpoints_and_says_which_it_skipped(tmp_path: Path) -> None:
    _write(tmp_path, range(1, 6))
    _damage(tmp_path, 5)
    _damage(tmp_path, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        deleted = checkpoint_io.prune(tmp_path, keep=2)
    assert _steps(tmp_path) == [5, 4, 3, 2], "damaged files were counted as kept, or pushed readable ones out"
    assert [p.name for p in deleted] == ["checkpoint-000000001.pt"]
    said = " ".join(str(w.message) for w in caught if "not counting a damaged checkpoint" in str(w.message))
    assert "checkpoint-000000005.pt" in said and "checkpoint-000000004.pt" in said and "000003" not in said
    with pytest.warns(UserWarning, match="skipping a damaged checkpoint"):
        assert checkpoint_io.load_latest(tmp_path)["model"]["w"].tolist() == [3.0, 3.0]
    with pytest.raises(px.ConfigurationError, match="keep"):
        checkpoint_io.prune(tmp_path, keep=0)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(8 * STEPS_PER_EPOCH, 4, generator=generator)
    return x, (x.sum(1) > 0).long()


def _fit(folder: Path, epochs: int, resume: bool, seed: int = 0, keep: int = 3) -> tuple[nn.Module, px.History]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = px.fit(model, optimizer, F.cross_entropy, _data(), epochs=epochs, global_batch_size=8,
                     checkpoint_dir=folder, resume=resume, seed=seed, verbose=0,
                     callbacks=[px.callbacks.Checkpoint(folder, keep=keep)])
    return model, history


def _elastic_commit(folder: Path, global_step: int) -> None:
    """An elastic job's last commit at ``global_step``, in the shape ``px.fit`` leaves it."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DistributedLoader(_data(), 8, rank=0, world_size=1)
    loop = LoopPosition(TrainState(model, optimizer, loader, epochs=9, epoch=4, global_step=global_step))
    elastic.State(model=model, optimizer=optimizer, loader=loader, loop=loop).save(folder / checkpoint.ELASTIC_LAST)


def _older_run(folder: Path, keep: int = 3) -> list[str]:
    """An older run's files in ``folder``: checkpoints up to step 20, an elastic commit, a damaged file."""
    _fit(folder, epochs=4, resume=False, seed=1, keep=keep)
    _elastic_commit(folder, 4 * STEPS_PER_EPOCH)
    _write(folder, (999,))
    _damage(folder, 999)
    return sorted(path.name for path in folder.iterdir() if path.suffix == ".pt")


def test_a_new_run_in_an_older_runs_folder_keeps_its_checkpoint_and_moves_the_older_ones_aside(
        tmp_path: Path) -> None:
    older = _older_run(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, epochs=1, resume=False)
    assert _steps(tmp_path) == [STEPS_PER_EPOCH], "the new run's checkpoint is gone, or the older run's remain"
    (aside,) = tmp_path.glob("earlier-run-*")
    assert sorted(path.name for path in aside.iterdir()) == older  # moved, not deleted
    (said,) = [str(w.message) for w in caught if "held checkpoints past this run's" in str(w.message)]
    assert "started afresh" in said and str(aside) in said


def test_a_resume_after_a_new_run_in_an_older_runs_folder_continues_the_new_run(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    _older_run(folder, keep=10)  # nothing pruned: only the choice of the resume is at stake
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said by the test above
        _fit(folder, epochs=1, resume=False, keep=10)
        resumed, history = _fit(folder, epochs=2, resume=True, keep=10)
    reference, _ = _fit(tmp_path / "uninterrupted", epochs=2, resume=False)
    assert history.epochs == [0, 1], "the resume took an older run's checkpoint for the new run's"
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value)


def test_a_save_removes_the_temporary_file_a_killed_save_of_another_step_left(tmp_path: Path) -> None:
    left = tmp_path / ".checkpoint-000000007.pt.0123abcd.tmp"
    left.write_bytes(b"half a checkpoint")
    then = time.time() - 3600  # an hour: far longer than atomic.STALE_AFTER_S
    os.utime(left, (then, then))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fresh folder: nothing to set aside, nothing damaged
        _fit(tmp_path, epochs=1, resume=False)
    assert not left.exists()
    assert _steps(tmp_path) == [STEPS_PER_EPOCH]
