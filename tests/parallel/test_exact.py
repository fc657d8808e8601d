"""reproducible=True: trained weights are bitwise identical for 1, 2, 3 and 4 workers."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.train import checkpoint_io
from tests.harness import run_workers

SAMPLES, GLOBAL_BATCH, MICRO, EPOCHS = 130, 24, 2, 4  # 6 steps an epoch (the last of 10): 24 steps
STEPS = EPOCHS * -(-SAMPLES // GLOBAL_BATCH)


def _dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, 1, 8, 8, generator=generator)
    return x, (x.mean(dim=(1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 0.5).long()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Dropout(0.3), nn.Linear(8 * 4 * 4, 3))


class _StopAt:
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, step: int, logs: dict, state) -> None:
        if state.global_step == self.step:
            state.stop_training = True


class _ExecutedSteps:
    """Records the global step number of every optimizer step the run executes."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, step: int, logs: dict, state) -> None:
        self.steps.append(state.global_step)


def _train(checkpoint_dir: str | None = None, stop_at: int | None = None, callbacks: tuple = ()) -> str:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    px.fit(model, optimizer, F.cross_entropy, _dataset(), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH,
           reproducible=True, micro_batch_size=MICRO, verbose=0, checkpoint_dir=checkpoint_dir,
           checkpoint_every=10 if checkpoint_dir else None,
           callbacks=[*callbacks, *([_StopAt(stop_at)] if stop_at else [])], metrics=["accuracy"])
    return _digest(model.state_dict())


def _resume(checkpoint_dir: str) -> tuple[str, list[int]]:
    """Train on from ``checkpoint_dir``: the weights' digest and the global steps this run executed."""
    executed = _ExecutedSteps()
    return _train(checkpoint_dir, callbacks=(executed,)), executed.steps


def _digest(state: dict) -> str:
    hasher = hashlib.sha256()
    for name, tensor in state.items():
        hasher.update(name.encode())
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


@pytest.fixture(scope="module")
def single_worker_digest() -> str:
    return run_workers(_train, 1, timeout=120)[0]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_weights_are_bitwise_identical_for_any_worker_count(world_size: int, single_worker_digest: str) -> None:
    digests = run_workers(_train, world_size, timeout=180)
    assert digests == [single_worker_digest] * world_size


def test_a_run_stopped_at_step_10_resumes_bitwise_at_another_worker_count(tmp_path: Path,
                                                                       single_worker_digest: str) -> None:
    run_workers(_train, 2, str(tmp_path), 10, timeout=120)
    assert checkpoint_io.list_checkpoints(tmp_path)[0].name.endswith("000000010.pt")
    results = run_workers(_resume, 3, str(tmp_path), timeout=180)
    assert [digest for digest, _ in results] == [single_worker_digest] * 3
    for rank, (_, executed) in enumerate(results):
        assert executed == list(range(11, STEPS + 1)), (
            f"rank {rank} executed global steps {executed}; resuming the checkpoint of step 10 must run 11..{STEPS}")


def test_reproducible_mode_needs_a_micro_batch_size() -> None:
    model = _model()
    with pytest.raises(px.ConfigurationError, match="micro_batch_size"):
        px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, _dataset(), epochs=1,
               global_batch_size=GLOBAL_BATCH, reproducible=True, verbose=0)


def _custom_loop() -> str:
    model = px.DataParallel(_model())
    exact = px.ExactGradients(model, micro_batch_size=MICRO, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = px.data.DistributedLoader(_dataset(), GLOBAL_BATCH, micro_batch_size=MICRO, seed=0)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            exact.backward(F.cross_entropy, (inputs,), targets, loader.last_global_batch_size)
            optimizer.step()
    return _digest(model.state_dict())


def test_the_documented_custom_loop_is_bitwise_reproducible_too() -> None:
    assert run_workers(_custom_loop, 3, timeout=120) == run_workers(_custom_loop, 1, timeout=120) * 3


def _loop_with_idle_ranks_and_redone_steps() -> tuple[str, int]:
    """Global batch 8 = 4 micro-batches, the last batch 1 (three of four workers idle); the loss jumps 1000x."""
    model = px.DataParallel(_model())
    exact = px.ExactGradients(model, micro_batch_size=MICRO, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = px.data.DistributedLoader(_dataset(), 8, micro_batch_size=MICRO, seed=0)
    factors = iter([1.0] * 4 + [1000.0] * 3 + [1e-3] * 3 + [1.0] * 1000)
    for inputs, targets in loader:
        factor = next(factors)
        optimizer.zero_grad()
        exact.backward(lambda out, y: F.cross_entropy(out, y) * factor, (inputs,), targets,
                       loader.last_global_batch_size)
        optimizer.step()
    return _digest(model.state_dict()), exact.redone_steps


def test_workers_without_a_micro_batch_and_redone_steps_keep_the_bits() -> None:
    reference = run_workers(_loop_with_idle_ranks_and_redone_steps, 1, timeout=120)[0]
    assert reference[1] >= 3  # calibration, the jump up, the jump down
    assert run_workers(_loop_with_idle_ranks_and_redone_steps, 4, timeout=180) == [reference] * 4


def test_reproducible_mode_does_not_warn_about_small_batch_norm_batches() -> None:
    model = px.DataParallel(_model())
    exact = px.ExactGradients(model, micro_batch_size=MICRO)
    x, y = _dataset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exact.backward(F.cross_entropy, (x[:8],), y[:8], global_batch_size=8)
    assert not [w for w in caught if "batch-norm" in str(w.message)]


def test_the_step_fixes_threads_and_kernels_and_then_puts_them_back() -> None:
    torch.set_num_threads(2)
    seen: list[tuple[int, bool]] = []

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen.append((torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()))
        return F.cross_entropy(outputs, targets)

    try:
        exact = px.ExactGradients(_model(), micro_batch_size=4, threads=1)
        assert torch.get_num_threads() == 2  # building it changes nothing process-wide
        x, y = _dataset()
        exact.backward(loss_fn, (x[:8],), y[:8], global_batch_size=8)
        assert seen and all(entry == (1, True) for entry in seen)
        assert torch.get_num_threads() == 2 and not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_num_threads(1)


def test_a_step_after_a_backward_that_raised_has_the_same_bits() -> None:
    from tests.parallel.test_data_parallel import _Fails, _FailsInBackward

    x, y = _dataset()
    grads = []
    for interrupt in (False, True):
        layers = list(_model())
        model = nn.Sequential(layers[0], _Fails(), *layers[1:])  # raises after the later layers' hooks ran
        exact = px.ExactGradients(model, micro_batch_size=4)
        exact.backward(F.cross_entropy, (x[16:24],), y[16:24], global_batch_size=8)  # calibrated from here on
        if interrupt:
            _FailsInBackward.armed = True
            try:
                with pytest.raises(RuntimeError, match="on purpose"):
                    exact.backward(F.cross_entropy, (x[:8],), y[:8], global_batch_size=8)
            finally:
                _FailsInBackward.armed = False
        exact.backward(F.cross_entropy, (x[8:16],), y[8:16], global_batch_size=8)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
