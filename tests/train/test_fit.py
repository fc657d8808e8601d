"""px.fit trains exactly like a single-process loop over the same samples, at any world size."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.train import checkpoint_io
from phalanx.data import epoch_plan
from tests.cli.test_launcher import assert_all_gone
from tests.harness import run_workers
from tests import warm

SAMPLES, GLOBAL_BATCH, EPOCHS = 140, 30, 4  # 5 steps an epoch, the last of 20 samples: 20 steps
STEPS = EPOCHS * -(-SAMPLES // GLOBAL_BATCH)


def _dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 10, generator=generator)
    return x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def _fit_everywhere(options: dict | None = None) -> dict:
    options = dict(options or {})
    if options.pop("central_storage", False):
        options["strategy"] = px.CentralStorage()
    model = _model()
    history = px.fit(model, _optimizer(model), F.cross_entropy, _dataset(), epochs=EPOCHS,
                     global_batch_size=GLOBAL_BATCH, val_data=_dataset(), metrics=["accuracy"], verbose=0, **options)
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "history": history.history}


def global_batches() -> Iterator[torch.Tensor]:
    """The sample indices of every global batch the serial loops train on, epoch after epoch."""
    for epoch in range(EPOCHS):
        yield from epoch_plan(SAMPLES, GLOBAL_BATCH, seed=0, epoch=epoch, shuffle=True)


def _serial_reference() -> tuple[dict, list[float]]:
    model, (x, y) = _model(), _dataset()
    optimizer = _optimizer(model)
    epoch_losses = []
    for epoch in range(EPOCHS):
        total = 0.0
        for indices in epoch_plan(SAMPLES, GLOBAL_BATCH, seed=0, epoch=epoch, shuffle=True):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[indices]), y[indices])
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(indices)
        epoch_losses.append(total / SAMPLES)
    return model.state_dict(), epoch_losses


ACCUMULATING = {
    "1 worker, 4 chunks": (1, {"accumulate_steps": 4}),
    "3 workers, 3 chunks": (3, {"accumulate_steps": 3}),  # shares of 10 and 7 samples: uneven chunks
    "2 workers, central storage, 2 chunks": (2, {"accumulate_steps": 2, "central_storage": True}),
}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fit_matches_a_serial_loop_over_the_same_samples(world_size: int) -> None:
    _assert_matches_serial_loop(run_workers(_fit_everywhere, world_size, timeout=150))


@pytest.mark.parametrize("case", sorted(ACCUMULATING))
def test_accumulating_in_chunks_matches_the_serial_loop_over_whole_batches(case: str) -> None:
    world_size, options = ACCUMULATING[case]
    _assert_matches_serial_loop(run_workers(_fit_everywhere, world_size, options, timeout=150))


def test_accumulation_refuses_bad_settings() -> None:
    px.init()
    model = _model()
    for options, message in (({"accumulate_steps": 0}, "at least 1"),
                             ({"accumulate_steps": 2, "reproducible": True, "micro_batch_size": 2}, "drop accumulate")):
        with pytest.raises(px.ConfigurationError, match=message):
            px.fit(model, _optimizer(model), F.cross_entropy, _dataset(), epochs=1, global_batch_size=GLOBAL_BATCH,
                   verbose=0, **options)


def test_two_settings_of_one_thing_are_refused_naming_both_before_anything_trains() -> None:
    px.init()
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cases = [
        (px.DataParallel(model, accumulate_steps=3), _dataset(), {"accumulate_steps": 2},
         r"DataParallel\(accumulate_steps=3\) and px.fit\(accumulate_steps=2\)"),
        (px.DataParallel(model, accumulate_steps=3), _dataset(), {}, r"accumulate_steps=3"),
        (model, px.data.DistributedLoader(_dataset(), global_batch_size=32), {},
         r"global_batch_size=32, but px.fit got global_batch_size=30"),
        (model, _dataset(), {"micro_batch_size": 2}, r"micro_batch_size=2 is reproducible mode's"),
        (model, _dataset(), {"checkpoint_every": 2}, r"checkpoint_every=2 needs checkpoint_dir"),
        (model, _dataset(), {"checkpoint_dir": "a", "callbacks": [px.callbacks.Checkpoint("b")]},
         r"Checkpoint\('b'\), but px.fit resumes from checkpoint_dir='a'"),
    ]
    for target, data, options, message in cases:
        with pytest.raises(px.ConfigurationError, match=message):
            px.fit(target, _optimizer(model), F.cross_entropy, data, epochs=1, global_batch_size=GLOBAL_BATCH,
                   verbose=0, **options)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_data_without_a_step_is_refused_before_training() -> None:
    px.init()
    model = _model()
    x, y = _dataset()
    empty = (x[:0], y[:0])
    for train, val, extra, message in (
            (empty, None, {}, "train_data holds no samples"),
            ((x, y), empty, {}, "val_data holds no samples"),
            (px.data.DistributedLoader((x[:10], y[:10]), global_batch_size=GLOBAL_BATCH, drop_last=True), None, {},
             "fewer samples than one global batch of 30")):
        with pytest.raises(px.ConfigurationError, match=message):
            px.fit(model, _optimizer(model), F.cross_entropy, train, val_data=val, epochs=1,
                   global_batch_size=GLOBAL_BATCH, verbose=0, **extra)


def _assert_matches_serial_loop(results: list[dict]) -> None:
    reference, losses = _serial_reference()
    for rank, result in enumerate(results):
        for name, value in reference.items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
        assert result["history"] == results[0]["history"], "history differs between ranks"
    history = results[0]["history"]
    torch.testing.assert_close(torch.tensor(history["loss"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    assert set(history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history["val_accuracy"][-1] > 0.6


class _StopAfter:
    """Stops training once the given global step is done."""

    def __init__(self, global_step: int):
        self.global_step = global_step

    def on_step_end(self, step: int, logs: dict, state) -> None:
        if state.global_step == self.global_step:
            state.stop_training = True


def test_a_resumed_run_says_what_it_resumed_and_when_nothing_was_left_to_train(
        tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="phalanx.train.loop")

    def fit(*callbacks: object, epochs: int = EPOCHS) -> list[str]:
        capsys.readouterr()
        caplog.clear()
        model = _model()
        px.fit(model, _optimizer(model), F.cross_entropy, _dataset(), epochs=epochs, global_batch_size=GLOBAL_BATCH,
               checkpoint_dir=tmp_path, checkpoint_every=1, callbacks=callbacks)
        return capsys.readouterr().out.splitlines()

    fit(_StopAfter(7))  # mid-epoch 2: its steps 1 and 2 of 5 are done
    resumed = f"resumed from {tmp_path / 'checkpoint-000000007.pt'} (global step 7, epoch 1 at its step 2)"
    plan = ("train_data: 140 samples in global batches of 30 on 1 worker; 5 steps an epoch x 4 epochs "
            "= 20 optimizer steps")
    assert fit()[:2] == [plan, resumed]
    assert caplog.messages == [plan, resumed]

    printed = fit()
    assert printed == [
        plan,
        f"resumed from {tmp_path / f'checkpoint-{STEPS:09d}.pt'} (global step {STEPS}, epoch {EPOCHS - 1} done)",
        f"training was already complete (all {EPOCHS} epochs, 0-{EPOCHS - 1}); nothing to do. To train longer, raise "
        f"epochs above {EPOCHS}; to train again from scratch, delete {tmp_path}",
    ], "a run resumed after the last epoch must say so and train nothing"
    assert caplog.messages == printed
    # its advice, followed: more epochs train on from there; the folder deleted trains from scratch
    longer = fit(epochs=EPOCHS + 1)
    assert f"(global step {STEPS}, epoch {EPOCHS - 1} done)" in longer[1] and longer[2].startswith(f"epoch {EPOCHS}/")
    shutil.rmtree(tmp_path)
    again = fit()
    assert not any("resumed" in line for line in again) and again[1].startswith(f"epoch 0/{EPOCHS - 1}"), again


_KILLABLE_SCRIPT = textwrap.dedent('''
    import os, sys, torch, torch.nn.functional as F
    from torch import nn
    import phalanx as px
    print(f"worker pid {os.getpid()}", flush=True)

    class Announce:
        def on_step_end(self, step, logs, state):
            if px.is_master():
                print(f"global step {state.global_step} done", flush=True)

    torch.set_num_threads(1)
    px.init()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 6, generator=g); y = (x.sum(1) > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    px.fit(model, optimizer, F.cross_entropy, (x, y), epochs=3, global_batch_size=24, verbose=0,
           checkpoint_dir=sys.argv[1], checkpoint_every=3, callbacks=[Announce()],
           lr_schedule=px.lr.warmup(0.01, epochs=1))
    if px.is_master():
        torch.save(model.state_dict(), sys.argv[2])
''')


_KILLABLE_STEPS = 27  # 3 epochs of ceil(200 / 24) = 9 steps


def _launch(script: Path, *args: str) -> subprocess.Popen:
    return warm.Popen([sys.executable, "-m", "phalanx", "run", "-n", "2", "--no-prefix", str(script), *args],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(process: subprocess.Popen) -> str:
    try:
        output, _ = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == 0, output
    return output


def test_a_killed_job_resumes_from_its_checkpoint_and_ends_where_an_uninterrupted_run_does(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_KILLABLE_SCRIPT)
    _finish(_launch(script, str(tmp_path / "uninterrupted"), str(tmp_path / "reference.pt")))

    victim = _launch(script, str(tmp_path / "run"), str(tmp_path / "resumed.pt"))
    deadline = time.monotonic() + 90
    workers = []
    for line in victim.stdout:  # type: ignore[union-attr]
        workers += [int(pid) for pid in re.findall(r"^worker pid (\d+)$", line)]
        if "global step 13 done" in line or time.monotonic() > deadline:
            break
    os.killpg(victim.pid, signal.SIGKILL)  # the launcher; its workers die with it, moments later
    victim.wait(timeout=30)
    assert len(workers) == 2, workers
    assert_all_gone(workers)  # before the checkpoints are listed: a worker still running could add one
    assert not (tmp_path / "resumed.pt").exists()
    saved = checkpoint_io.list_checkpoints(tmp_path / "run")
    assert saved, "no checkpoint was written before the kill"
    saved_step = int(saved[0].stem.removeprefix("checkpoint-"))

    output = _finish(_launch(script, str(tmp_path / "run"), str(tmp_path / "resumed.pt")))
    executed = [int(step) for step in re.findall(r"^global step (\d+) done$", output, re.MULTILINE)]
    assert executed == list(range(saved_step + 1, _KILLABLE_STEPS + 1)), (
        f"the resumed run executed global steps {executed}; it should have continued from the checkpoint "
        f"of step {saved_step} with steps {saved_step + 1}..{_KILLABLE_STEPS}")
    reference = torch.load(tmp_path / "reference.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    for name, value in reference.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6)
