"""Which device each worker takes, and layouts refused before any rendezvous: checked on the CPU by
faking how many GPUs a host has (tests/test_cuda.py runs the real thing on a GPU)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import phalanx as px
from phalanx.cli import config as launch_config, main as cli
from phalanx.cli.config import LaunchConfig
from phalanx.comm import devices, runtime
from phalanx.comm.environment import detect


def test_each_local_rank_takes_its_own_gpu_and_gloo_stays_on_the_cpu() -> None:
    assert [devices.device_for("nccl", rank, 4, 4, "test") for rank in range(4)] == \
        [torch.device("cuda", rank) for rank in range(4)]
    assert devices.device_for("nccl", 1, 2, 8, "test") == torch.device("cuda", 1)  # spare GPUs are fine
    assert devices.device_for("gloo", 3, 4, 1, "test") == torch.device("cpu")  # Gloo: GPUs do not matter


def test_more_workers_than_gpus_is_refused_naming_both_counts_and_the_way_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(px.ConfigurationError) as refused:
        devices.device_for("nccl", 0, 2, 1, "torchrun launch")
    message = str(refused.value)
    for part in ("torchrun launch: 2 workers on this host, but 1 GPU visible here (CUDA_VISIBLE_DEVICES='3')",
                 "phalanx run -n 1", "--device cpu", "backend='gloo'"):
        assert part in message, message


@pytest.mark.parametrize("requested, device, gpus, backend", [
    (None, "auto", 0, "gloo"), (None, "auto", 2, "nccl"), (None, "cpu", 2, "gloo"), ("gloo", "auto", 2, "gloo"),
    (None, "cuda", 1, "nccl"), ("nccl", "auto", 1, "nccl")])
def test_the_backend_follows_the_launch(monkeypatch: pytest.MonkeyPatch, requested: str | None, device: str,
                                        gpus: int, backend: str) -> None:
    monkeypatch.setattr(devices, "visible_gpus", lambda: gpus)
    assert devices.resolve_backend(requested, device) == backend


@pytest.mark.parametrize("requested, device, gpus, message", [
    ("nccl", "cpu", 2, "launched with --device cpu"), ("nccl", "auto", 0, "needs CUDA and NCCL"),
    (None, "cuda", 0, "launched with --device cuda, but this process sees no GPU"), ("mpi", "auto", 0, "'gloo' or")])
def test_a_backend_the_launch_cannot_have_is_refused(monkeypatch: pytest.MonkeyPatch, requested: str | None,
                                                     device: str, gpus: int, message: str) -> None:
    monkeypatch.setattr(devices, "visible_gpus", lambda: gpus)
    with pytest.raises(px.ConfigurationError, match=message):
        devices.resolve_backend(requested, device)


def test_init_under_torchrun_with_more_workers_than_gpus_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No store is listening: a rendezvous would wait out the timeout; the refusal comes first."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(devices, "visible_gpus", lambda: 1)
    started = time.monotonic()
    with pytest.raises(px.ConfigurationError, match="torchrun launch: 2 workers on this host, but 1 GPU"):
        runtime.init(timeout=60)
    assert time.monotonic() - started < 5
    assert not px.is_initialized()


@pytest.fixture()
def no_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[LaunchConfig]:
    """``phalanx run`` up to the launch; the configurations it would launch."""
    launched: list[LaunchConfig] = []
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    monkeypatch.setattr(cli, "launch", lambda config: launched.append(config) or 0)
    return launched


def test_phalanx_run_refuses_more_workers_than_gpus_before_starting_any(
        no_launch: list[LaunchConfig], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(launch_config, "visible_gpus", lambda: 1)
    assert cli.main(["run", "-n", "2", "x.py"]) == 2 and not no_launch  # auto: GPUs are here, so on GPUs
    assert "-n 2: 2 workers on this host, but 1 GPU visible here" in capsys.readouterr().err
    assert cli.main(["run", "-n", "1", "--device", "cuda", "x.py"]) == 0
    assert cli.main(["run", "-n", "2", "--device", "cpu", "x.py"]) == 0  # Gloo on the CPU: any number
    variables = no_launch[-1].worker_specs(1234)[1].variables
    assert variables["PHALANX_DEVICE"] == "cpu" and detect(variables).device == "cpu"
    monkeypatch.setattr(launch_config, "visible_gpus", lambda: 0)
    assert cli.main(["run", "-n", "2", "--device", "cuda", "x.py"]) == 2
    assert "--device cuda, but no GPU usable with NCCL is visible on this host" in capsys.readouterr().err
    assert cli.main(["run", "-n", "2", "x.py"]) == 0  # auto without GPUs: the CPU
    assert "PHALANX_DEVICE" not in no_launch[-1].worker_specs(1234)[0].variables
