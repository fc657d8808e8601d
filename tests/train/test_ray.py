"""px.fit inside Ray Train on a local Ray cluster: reporting, checkpoints, a restart after a kill."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.comm.environment import detect
from phalanx.train import checkpoint_io, ray_session
from phalanx.train.ray_session import CHECKPOINT_PREFIX

HERE = Path(__file__).parent
JOB = HERE / "ray_job.py"


def test_a_ray_train_worker_is_detected_with_rays_node_rank() -> None:
    # Ranks 0-2 on node 0, rank 3 alone on node 1: torchrun's rule, rank // local size, would say node 3.
    env = {"RAY_JOB_ID": "01000000", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "NODE_RANK": "1"}
    info = detect(env)
    assert (info.source, info.rank, info.world_size, info.local_rank, info.node_rank) == ("ray", 3, 4, 0, 1)
    env.pop("RAY_JOB_ID")
    assert (detect(env).source, detect(env).node_rank) == ("torchrun", 3)


def final_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    found = checkpoint_io.find_latest(folder)
    assert found is not None, f"no checkpoint in {folder}"
    return found[1]["model"]


@pytest.mark.timeout(360)  # a Ray Train run restarted once: 45 s here, more on a loaded host
def test_fit_reports_to_ray_and_a_killed_worker_resumes_from_rays_checkpoint_bitwise(ray_cluster: dict[str, str],
                                                                                   tmp_path: Path) -> None:
    storage, reference = tmp_path / "storage", tmp_path / "reference"
    # the same training without Ray, one process, while Ray trains: the bitwise reference
    alone = subprocess.Popen([sys.executable, str(JOB), "--reference", str(reference)], cwd=tmp_path,
                             env={k: v for k, v in ray_cluster.items() if k != "RAY_ADDRESS"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ran = subprocess.run([sys.executable, str(JOB), str(storage), "killed", "--kill-at-epoch", "3"], cwd=tmp_path,
                         env=ray_cluster, capture_output=True, text=True, timeout=300)
    _, alone_errors = alone.communicate(timeout=120)
    assert alone.returncode == 0, alone_errors[-3000:]
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-5000:]
    result = json.loads(ran.stdout.split("RESULT ", 1)[1])
    assert result["killed"], "the worker was not killed: the test tested nothing"
    # Reporting: the last epoch's global metrics are Ray's result, with phalanx's checkpoint in Ray's storage.
    assert result["metrics"]["epoch"] == 4 and result["metrics"]["global_step"] == 32
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(result["metrics"])
    assert Path(result["checkpoint"]).parent == storage / "killed"
    # The attempt that finished began after epoch 1 on every rank, from what Ray handed back.
    assert len(result["traces"]) == 2, result["traces"]
    for trace in result["traces"]:
        assert trace["layout"]["px"] == trace["layout"]["ray"]
        assert trace["started"][0][0] >= 1 and trace["started"][0][1] == 0, trace
        assert [epoch for epoch, _ in trace["started"]] == list(range(trace["started"][0][0], 4))
    # Bitwise: the restarted 2-worker run ends where one uninterrupted process without Ray does.
    expected, got = final_weights(reference), final_weights(result["checkpoint"])
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    # The attempt Ray restarted said where it resumed from: the checkpoint Ray handed back.
    assert any(line.startswith("resumed from ") and CHECKPOINT_PREFIX in line for line in result["log"]), \
        result["log"]


class HandedBack:
    """What ``ray.train.get_checkpoint()`` returns: a checkpoint whose ``as_directory()`` is a folder."""

    def __init__(self, folder: Path):
        self.folder = folder

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        yield str(self.folder)


def test_a_finished_run_that_ray_hands_back_advises_a_new_run_name_not_deleting_checkpoints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Started again under the same name, Ray hands the last checkpoint back: px.fit says training was
    complete and advises what works under Ray, a new RunConfig(name=...); deleting checkpoints, the
    advice elsewhere, breaks Ray's record of the run. (Ray's side of the hand-back is the killed run's.)"""
    inputs = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    data = (inputs, (inputs.sum(dim=1) > 0).long())

    def fit(checkpoint_dir: Path | None) -> list[str]:
        model = torch.nn.Linear(4, 2)
        px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, data, epochs=2,
               global_batch_size=16, checkpoint_dir=checkpoint_dir, verbose=1)
        return capsys.readouterr().out.splitlines()

    fit(tmp_path / "ray-storage")  # the run Ray recorded; started again under its name, it is handed back
    handed = HandedBack(tmp_path / "ray-storage")
    monkeypatch.setattr(ray_session, "reporting_api", lambda: SimpleNamespace(get_checkpoint=lambda: handed))
    printed = fit(None)
    complete = [line for line in printed if "training was already complete" in line]
    assert complete and "a new RunConfig(name=...)" in complete[0] and "delete" not in complete[0], printed
    assert not any(line.startswith("epoch ") for line in printed), printed


def test_px_fit_outside_ray_imports_no_ray() -> None:
    script = ("import sys, torch, torch.nn.functional as F, phalanx as px\n"
              "model = torch.nn.Linear(2, 2)\n"
              "px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,\n"
              "       (torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)), epochs=1, global_batch_size=2, verbose=0)\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))\n")
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip().splitlines()[-1] == "[]"


TUNE_FUNCTION = """\
import json, sys
import torch, torch.nn.functional as F
from ray import tune
import phalanx as px

def trial(config):
    torch.set_num_threads(1)
    inputs = torch.randn(128, 4, generator=torch.Generator().manual_seed(0))
    targets = (inputs.sum(dim=1) > 0).long()
    torch.manual_seed(0)  # the same first weights every run: some others learn too little in 12 steps
    model = torch.nn.Linear(4, 2)
    px.fit(model, torch.optim.SGD(model.parameters(), lr=config["lr"]), F.cross_entropy, (inputs, targets),
           val_data=(inputs, targets), epochs=3, global_batch_size=32, verbose=0)

grid = tune.Tuner(trial, param_space={"lr": tune.grid_search([0.1])},
                  run_config=tune.RunConfig(storage_path=sys.argv[1], name="function")).fit()
result = grid[0]
print("RESULT " + json.dumps({"epoch": result.metrics["epoch"], "val_loss": result.metrics["val_loss"],
                              "reports": result.metrics["training_iteration"], "checkpoint": result.checkpoint.path}))
"""


def test_fit_in_a_ray_tune_function_reports_each_epoch_to_tune_with_its_checkpoint(ray_cluster: dict[str, str],
                                                                                  tmp_path: Path) -> None:
    script = tmp_path / "tune_function.py"
    script.write_text(TUNE_FUNCTION)
    ran = subprocess.run([sys.executable, str(script), str(tmp_path / "storage")], cwd=tmp_path, env=ray_cluster,
                         capture_output=True, text=True, timeout=180)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-5000:]
    result = json.loads(ran.stdout.split("RESULT ", 1)[1])
    assert (result["epoch"], result["reports"]) == (3, 3), result  # one report per epoch
    assert result["val_loss"] < 0.69, result  # chance is ln 2 = 0.693
    assert checkpoint_io.find_latest(result["checkpoint"])[1]["global_step"] == 12
