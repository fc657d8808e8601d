"""Learning-rate rules, callbacks, metrics and checkpoint files, each on its own."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import phalanx as px
from phalanx.atomic import save_atomically
from phalanx.train import checkpoint_io
from phalanx.train.state import TrainState


def test_scale_lr_rules() -> None:
    assert px.scale_lr(0.1, 1024, 256) == pytest.approx(0.4)
    assert px.scale_lr(0.1, 1024, 256, rule="sqrt") == pytest.approx(0.2)
    with pytest.raises(px.ConfigurationError, match="linear' or 'sqrt"):
        px.scale_lr(0.1, 1024, 256, rule="cubic")


def test_warmup_ramps_linearly_then_hands_over_to_the_decay_schedule() -> None:
    schedule = px.lr.warmup(px.lr.step_decay(0.8, milestones=[3]), epochs=2, start_factor=0.25)
    assert schedule(0) == pytest.approx(0.2)
    assert schedule(1) == pytest.approx(0.5)
    assert schedule(2) == pytest.approx(0.8)
    assert schedule(3.5) == pytest.approx(0.08)
    cosine = px.lr.cosine(1.0, epochs=10)
    assert cosine(0) == pytest.approx(1.0) and cosine(5) == pytest.approx(0.5) and cosine(20) == pytest.approx(0.0)


class _Loader:
    def __len__(self) -> int:
        return 10


def _state(lr: float = 1.0) -> TrainState:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return TrainState(model=None, optimizer=optimizer, loader=_Loader(), epochs=5, scheduled_lrs=[lr])


def test_lr_warmup_callback_ramps_over_steps() -> None:
    state, warm = _state(), px.callbacks.LRWarmup(warmup_epochs=1, start_factor=0.0)
    seen = []
    for step in range(12):
        state.global_step = step
        warm.on_step_begin(step, state)
        seen.append(state.optimizer.param_groups[0]["lr"])
    assert seen[0] == 0.0 and seen[5] == pytest.approx(0.5) and seen[10:] == [1.0, 1.0]


def test_early_stopping_stops_after_patience_epochs_without_improvement() -> None:
    state, stopper = _state(), px.callbacks.EarlyStopping("val_loss", patience=2)
    for epoch, value in enumerate([1.0, 0.8, 0.9, 0.85]):
        stopper.on_epoch_end(epoch, {"val_loss": value}, state)
    assert state.stop_training and stopper.stopped_epoch == 3
    with pytest.raises(px.ConfigurationError, match="monitors 'val_acc'"):
        px.callbacks.EarlyStopping("val_acc").on_epoch_end(0, {"loss": 1.0}, state)


def test_metrics_add_sums_and_counts() -> None:
    px.init()
    accuracy, top2 = px.metrics.Accuracy(), px.metrics.TopKAccuracy(2)
    outputs = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.1, 0.4], [0.2, 0.3, 0.5]])
    targets = torch.tensor([1, 2, 0])
    for metric in (accuracy, top2):
        metric.update(outputs, targets, 0.0)
        metric.update(outputs[:0], targets[:0], 0.0)  # an empty share changes nothing
    assert px.metrics.reduce_metrics([accuracy, top2]) == {"accuracy": pytest.approx(1 / 3),
                                                           "top2_accuracy": pytest.approx(2 / 3)}
    with pytest.raises(px.ConfigurationError, match="unknown metric"):
        px.metrics.resolve(["f1"])


def test_checkpoints_are_atomic_and_a_damaged_newest_one_falls_back(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_atomically({"model": {"w": torch.full((2,), float(step))}},
                                      checkpoint_io.checkpoint_path(tmp_path, step))
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    newest = checkpoint_io.list_checkpoints(tmp_path)[0]
    newest.write_bytes(newest.read_bytes()[:40])  # truncated, as by a crash of another writer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        payload = checkpoint_io.load_latest(tmp_path)
    assert payload is not None and payload["model"]["w"].tolist() == [2.0, 2.0]
    assert any("damaged checkpoint" in str(w.message) for w in caught)
    with pytest.warns(UserWarning, match="not counting a damaged checkpoint"):
        checkpoint_io.prune(tmp_path, keep=1)
    assert [p.name for p in checkpoint_io.list_checkpoints(tmp_path)] == [newest.name, "checkpoint-000000002.pt"]


def test_checkpoints_load_with_weights_only_and_refuse_arbitrary_objects(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint-000000001.pt"
    torch.save({"model": {}, "evil": Path("/x")}, path)  # an arbitrary class is not plain data
    with pytest.raises(px.CheckpointError, match="cannot be read"):
        checkpoint_io.load(path)
    assert checkpoint_io.load(path, weights_only=False)["evil"] == Path("/x")
