"""The GPU path, mode by mode (``cuda`` marker: skipped without a GPU). Each test runs a job of
tests/cuda_job.py with the GPUs visible; the CPU dry run keeps that script working where none is.

The device-placement logic is tested on the CPU by faking GPU counts (tests/comm/test_devices.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_launcher import phalanx_command, worker_env
from tests.conftest import gpu_count, gpu_environment
from tests import warm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="launcher tests run on Linux")

JOB = str(Path(__file__).with_name("cuda_job.py"))


def run_check(tmp_path: Path, check: str, *launch: str, device: str = "cuda", timeout: float = 300) -> dict[str, Any]:
    """The figures of ``check`` (several, separated by commas: a dict by name) run by one job."""
    out = tmp_path / "figures.json"
    env = gpu_environment(worker_env()) if device == "cuda" else worker_env()
    done = warm.run(phalanx_command("--timeout", "120", "--device", device, *launch, JOB, check, str(out)),
                    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    return figures if "," in check else figures[check]


def test_the_checks_run_on_the_cpu_too(tmp_path: Path) -> None:
    """The script's own use of the API, in one job without a GPU (the figures are the CPU's; the
    precision check's reference is CUDA's, compiling needs a compiler, parameter servers --servers,
    and the reproducible and central-storage checks are px.fit's options, as the fit check)."""
    checks = ("fit", "allreduce", "compression", "syncbn", "horovod", "sharded")  # reproducible, central storage: fit's
    figures = run_check(tmp_path, ",".join(checks), "-n", "1", device="cpu")
    assert figures["allreduce"] == {"is_cuda": False, "value": [1.0] * 4}
    for check in ("fit", "compression", "syncbn"):
        assert figures[check]["device"] == "cpu" and figures[check]["accuracy"] > 0.9, figures
    assert not figures["fit"]["pinned"] and figures["horovod"]["last_loss"] < figures["horovod"]["first_loss"]
    assert all(level["accuracy"] > 0.9 and level["difference"] < 1e-5 for level in figures["sharded"].values()), figures
    assert not figures["fit"]["kept"] and figures["fit"]["kept_batches_equal"] and figures["fit"]["copied_batches_equal"]


cuda = pytest.mark.cuda


@cuda
def test_fit_trains_on_the_gpu_with_its_data_kept_there_or_copied_one_step_ahead(tmp_path: Path) -> None:
    figures = run_check(tmp_path, "fit", "-n", "1")
    assert figures["device"] == "cuda:0" and figures["parameters_on"] == ["cuda:0"]
    assert figures["accuracy"] > 0.9 and figures["copied_accuracy"] > 0.9, figures
    assert figures["kept"] and figures["kept_batches_on"] == ["cuda:0"] and figures["kept_batches_equal"], figures
    assert figures["pinned"] and figures["copied_batches_on"] == ["cuda:0"] and figures["copied_batches_equal"], figures
    assert figures["fused_max_carries_nan"]  # what the non-finite check and the exact sum rely on there


@cuda
def test_a_collective_on_a_gpu_tensor_stays_on_the_gpu(tmp_path: Path) -> None:
    workers = min(gpu_count(), 2)
    figures = run_check(tmp_path, "allreduce", "-n", str(workers))
    assert figures["is_cuda"] and figures["value"] == [float(sum(range(1, workers + 1)))] * 4


@cuda
def test_reproducible_mode_is_bitwise_identical_run_to_run_and_across_gpu_counts(tmp_path: Path) -> None:
    first, again = (run_check(tmp_path, "reproducible", "-n", "1") for _ in range(2))
    assert first["digest"] == again["digest"] and first["parameters_on"] == ["cuda:0"]
    if gpu_count() >= 2:
        assert run_check(tmp_path, "reproducible", "-n", "2")["digest"] == first["digest"]


@cuda
def test_mixed_precision_and_clipping_match_the_hand_written_gpu_loop(tmp_path: Path) -> None:
    figures = run_check(tmp_path, "precision", "-n", "1")
    assert figures["bf16-mixed"] < 1e-3 and figures["16-mixed"] < 1e-3, figures


@cuda
@pytest.mark.parametrize("check, launch", [("compression", ()), ("syncbn", ()), ("central_storage", ()),
                                           ("parameter_server", ("--servers", "1")), ("compile", ())])
def test_every_mode_trains_on_the_gpu(tmp_path: Path, check: str, launch: tuple[str, ...]) -> None:
    figures = run_check(tmp_path, check, "-n", "1", *launch)
    assert figures["device"] == "cuda:0" and figures["accuracy"] > 0.9, figures
    if check == "compile":
        assert figures["gradient_difference"] < 1e-5, figures


@cuda
def test_every_sharding_level_trains_on_the_gpus_as_unsharded(tmp_path: Path) -> None:
    """With two GPUs or more, NCCL's reduce-scatter and all-gather carry the shards."""
    workers = min(gpu_count(), 4)
    for level, figures in run_check(tmp_path, "sharded", "-n", str(workers)).items():
        assert figures["device"] == "cuda:0" and figures["parameters_on"] == ["cuda:0"], (level, figures)
        assert figures["accuracy"] > 0.9 and figures["difference"] < 1e-5, (level, figures)


@cuda
def test_the_horovod_api_trains_on_the_gpu(tmp_path: Path) -> None:
    figures = run_check(tmp_path, "horovod", "-n", "1")
    assert figures["device"] == "cuda:0" and figures["last_loss"] < figures["first_loss"]


@cuda
def test_more_workers_than_gpus_is_refused_before_the_rendezvous(tmp_path: Path) -> None:
    env = gpu_environment(worker_env())
    done = warm.run(phalanx_command("--timeout", "300", "-n", str(gpu_count() + 1), JOB, "fit", "x.json"),
                    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"but {gpu_count()} GPU" in done.stderr, done.stderr
    assert "--device cpu" in done.stderr and os.environ["CUDA_VISIBLE_DEVICES"] == ""
