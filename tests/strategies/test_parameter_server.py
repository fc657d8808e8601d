"""Parameter servers and central storage, end to end under ``phalanx run``.

Every job trains the same MLP with Adam (``ps_train.py``); rank 0 saves the weights, which are
compared with px.DataParallel's on the same data.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phalanx.data import epoch_plan

from tests.cli.test_launcher import phalanx_command, run_on_hosts, worker_env
from tests.elastic.launch import free_port
from tests import warm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="launcher tests run on Linux")

SCRIPT = str(Path(__file__).with_name("ps_train.py"))


def launch(tmp_path: Path, launcher: list[str], *script_args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = warm.run(phalanx_command("--timeout", "60", *launcher, SCRIPT, *script_args), cwd=tmp_path,
                    env=worker_env(), capture_output=True, text=True, timeout=timeout)
    return done


def trained(tmp_path: Path, name: str, launcher: list[str], *script_args: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{name}.pt"
    done = launch(tmp_path, launcher, script_args[0], str(out), *script_args[1:])
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out)


_references: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}


def reference(tmp_path: Path, workers: int, *script_args: str) -> dict[str, torch.Tensor]:
    """px.DataParallel's weights for this launch, trained once per test session."""
    key = (str(workers), *script_args)
    if key not in _references:
        _references[key] = trained(tmp_path, "dp", ["-n", str(workers)], "dp", *script_args)
    return _references[key]


def assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def _serial_fit(clip_value: float | None = None, clip_norm: float | None = None,
                step_size: int | None = None) -> dict[str, torch.Tensor]:
    """ps_train.py's px.fit (2 epochs, global batch 32, Adam) as one process runs it: the weights
    any number of workers must reach; with clipping and a StepLR as torch's own functions apply them."""
    torch.manual_seed(0)
    x = torch.randn(480, 20)
    y = (x[:, :3].sum(1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size or 1000, gamma=0.5)
    for epoch in range(2):
        for indices in epoch_plan(480, 32, seed=0, epoch=epoch, shuffle=True):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[indices]), y[indices]).backward()
            if clip_value is not None:
                torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            optimizer.step()
            scheduler.step()
    return model.state_dict()


@pytest.mark.parametrize("workers,servers", [(3, 2)])  # one server: the accumulating fit test below
def test_sync_parameter_servers_train_like_data_parallel(tmp_path: Path, workers: int, servers: int) -> None:
    """30 Adam steps through the custom-loop API give DataParallel's weights (more workers than
    servers, each server holding part of the parameters)."""
    got = trained(tmp_path, "ps", ["-n", str(workers), "--servers", str(servers)], "sync")
    assert_close(got, reference(tmp_path, workers))


def test_fit_with_servers_resumes_their_optimizer_state(tmp_path: Path) -> None:
    """An epoch, a stop, a resumed second epoch: the servers get their Adam state back from the
    checkpoint, and the run ends with the serial loop's weights."""
    expected = _serial_fit()
    checkpoints = str(tmp_path / "ckpt")
    trained(tmp_path, "first", ["-n", "2", "--servers", "2"], "sync", "--loop", "fit", "--epochs", "1",
            "--checkpoint-dir", checkpoints)
    out = tmp_path / "resumed.pt"
    done = launch(tmp_path, ["-n", "2", "--servers", "2"], "sync", str(out), "--loop", "fit", "--epochs", "2",
                  "--checkpoint-dir", checkpoints, "--verbose", "1")
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout and "(global step 15, epoch 0 done)" in done.stdout, done.stdout
    assert_close(torch.load(out), expected)
    histories = re.findall(r"(worker|server) history (\{.*\})", done.stdout)
    assert len(histories) == 4 and len({h for _, h in histories}) == 1, histories  # the same on servers


def test_fit_accumulating_through_servers_trains_like_whole_batches(tmp_path: Path) -> None:
    """px.fit(accumulate_steps=2): two passes per step, one push to the servers, the serial loop's weights."""
    got = trained(tmp_path, "ps-accumulating", ["-n", "2", "--servers", "1"], "sync", "--loop", "fit",
                  "--accumulate-steps", "2")
    assert_close(got, _serial_fit())


def test_sync_servers_clip_the_gradient_they_apply_and_follow_a_torch_scheduler(tmp_path: Path) -> None:
    """Clipped by value and by norm (over both servers' shards, summed through the store), with a
    torch StepLR: the serial loop's weights (test_shard.py checks the shards' arithmetic, for
    asynchronous servers too). An outsider who reaches the store's port writes every step's
    squared norms first (issue 40): the servers wait past values without the job's secret, and
    the weights are the same."""
    port, out, forged = free_port(), tmp_path / "ps-clipped.pt", tmp_path / "forged"
    job = warm.Popen(phalanx_command("--timeout", "60", "--master-port", str(port), "-n", "2", "--servers", "2",
                                     SCRIPT, "sync", str(out), "--loop", "fit", "--clip-value", "0.02",
                                     "--clip-norm", "0.05", "--step-lr", "4", "--start-after", str(forged)),
                     cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        outsider = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                 timeout=datetime.timedelta(seconds=30))
        for step in range(30):  # 2 epochs of 15 global batches, before the job's first (it waits for the file)
            for server in range(2):
                outsider.set(f"phalanx/ps/squared-norm/{step}/{server}", "1e30")
        forged.touch()
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, stdout + stderr
    got = torch.load(out)
    assert_close(got, _serial_fit(clip_value=0.02, clip_norm=0.05, step_size=4))
    assert any(not torch.allclose(got[key], value, atol=1e-4)  # the clipping bit
               for key, value in _serial_fit(step_size=4).items())


def test_central_storage_trains_like_data_parallel_with_state_on_one_rank(tmp_path: Path) -> None:
    out = tmp_path / "cs.pt"
    done = launch(tmp_path, ["-n", "3"], "cs", str(out))
    assert done.returncode == 0, done.stderr
    assert_close(torch.load(out), reference(tmp_path, 3))
    entries = dict(re.findall(r"rank (\d) optimizer state entries (\d+)", done.stdout))
    assert entries == {"0": "4", "1": "0", "2": "0"}, done.stdout


def test_async_parameter_servers_learn_digits(tmp_path: Path) -> None:
    """3 workers and 1 server, updates applied as they arrive: digits reach 95 % validation accuracy."""
    done = warm.run(phalanx_command("--timeout", "60", "-n", "3", "--servers", "1",
                                    str(Path(__file__).with_name("ps_digits.py")), "async", "1e-3", "8"),
                    cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    accuracies = [float(a) for a in re.search(r"val_accuracy \[(.*)\]", done.stdout).group(1).split(",")]
    assert len(accuracies) == 8 and max(accuracies) >= 0.95, accuracies


def test_async_histories_are_the_same_everywhere(tmp_path: Path) -> None:
    done = launch(tmp_path, ["-n", "3", "--servers", "1"], "async", str(tmp_path / "a.pt"), "--loop", "fit")
    assert done.returncode == 0, done.stderr
    histories = re.findall(r"(?:worker|server) history (\{.*\})", done.stdout)
    assert len(histories) == 4 and len(set(histories)) == 1, histories


def test_a_killed_server_is_named_on_every_worker(tmp_path: Path) -> None:
    started = time.monotonic()
    done = launch(tmp_path, ["-n", "2", "--servers", "2"], "sync", str(tmp_path / "k.pt"), "--steps", "100000",
                  "--kill-server-after", "3", timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode != 0, done.stderr
    assert elapsed < 30, (elapsed, done.stderr)
    assert "parameter server" in done.stderr and "failed with signal SIGKILL" in done.stderr, done.stderr
    # Each worker names the server it could not reach, or (when it was already past its exchange with
    # that server, in a collective among workers) the worker that failed first, which named it.
    named_the_server = [rank for rank in (0, 1) if re.search(
        rf"\[{rank}\] .*ServerFailedError: rank {rank}: could not .* parameter server \d", done.stderr)]
    assert named_the_server, done.stderr
    for rank in {0, 1} - set(named_the_server):
        assert re.search(rf"\[{rank}\] .*CollectiveTimeoutError: .* on rank {rank} of 2 failed", done.stderr), \
            done.stderr


def test_sync_servers_survive_a_lost_worker_under_min_workers(tmp_path: Path) -> None:
    """Rank 2 dies at step 5: the others re-form, redo the step as two, and end with the serial loop's weights."""
    expected = _serial_fit()
    out = tmp_path / "elastic.pt"
    done = launch(tmp_path, ["-n", "3", "--min-workers", "2", "--servers", "1"], "sync", str(out), "--loop", "fit",
                  "--kill-rank-at-step", "2", "5")
    assert done.returncode == 0, done.stderr
    assert "worker rank 2" in done.stderr and "lost" in done.stderr, done.stderr
    assert_close(torch.load(out), expected)
    histories = re.findall(r"(?:worker|server) history (\{.*\})", done.stdout)
    assert len(histories) == 3 and len(set(histories)) == 1, histories


def test_async_servers_drop_a_lost_worker_and_go_on(tmp_path: Path) -> None:
    done = launch(tmp_path, ["-n", "3", "--min-workers", "2", "--servers", "1"], "async", str(tmp_path / "a.pt"),
                  "--loop", "fit", "--epochs", "3", "--kill-rank-at-step", "2", "4")
    assert done.returncode == 0, done.stderr
    assert "lost worker" in done.stdout + done.stderr
    histories = re.findall(r"(?:worker|server) history (\{.*\})", done.stdout)
    assert len(histories) == 3 and len(set(histories)) == 1, histories


def test_servers_on_two_hosts_train_like_data_parallel(tmp_path: Path, two_hosts: list[str]) -> None:
    """One worker and one server per host (two network namespaces): DataParallel's weights."""
    expected = reference(tmp_path, 2)
    common = ["--timeout", "60", "-n", "1", "--servers", "1", "--nnodes", "2", "--master-addr", "198.18.0.1",
              "--master-port", "29531"]
    out = tmp_path / "hosts.pt"
    codes, outputs = run_on_hosts(two_hosts, common, [SCRIPT, "sync", str(out)], tmp_path, worker_env(), 120)
    assert codes == [0, 0], outputs
    assert_close(torch.load(out), expected)
