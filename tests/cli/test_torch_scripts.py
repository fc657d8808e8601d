"""Scripts written for torchrun run unchanged under ``phalanx run``, and phalanx scripts under torchrun.

The launcher hosts the rendezvous store on ``MASTER_PORT``; like torchrun's agent it tells torch's
``env://`` rendezvous (``TORCHELASTIC_USE_AGENT_STORE``) to connect to it instead of starting a
second server there on rank 0.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_launcher import phalanx_command, run_on_hosts, worker_env, write_script
from tests.elastic.launch import clean_env, free_port
from tests import warm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="launcher tests run on Linux")

DDP_SCRIPT = """\
    import os, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    for _ in range(5):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    weights = [torch.zeros_like(model.module.weight) for _ in range(world)]
    dist.all_gather(weights, model.module.weight.detach())
    assert all(torch.equal(weights[0], w) for w in weights), "replicas diverged"
    expected = {"GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE"}
    assert expected <= set(os.environ), expected - set(os.environ)
    print(f"rank {rank} of {world} (local {os.environ['LOCAL_RANK']}, node {os.environ['GROUP_RANK']}) in step")
    dist.destroy_process_group()
"""


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = write_script(tmp_path, "ddp.py", DDP_SCRIPT)
    return warm.run(phalanx_command(*args, str(script)), cwd=tmp_path, env=worker_env(),
                    capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("workers", [2, 3])
def test_a_torchrun_ddp_script_runs_unchanged(tmp_path: Path, workers: int) -> None:
    done = _launch(tmp_path, "-n", str(workers))
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        f"[{r}] rank {r} of {workers} (local {r}, node 0) in step" for r in range(workers)]


def test_a_torchrun_ddp_script_runs_in_an_elastic_job(tmp_path: Path) -> None:
    done = _launch(tmp_path, "-n", "2", "--min-workers", "1")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2, done.stdout


def test_a_torchrun_ddp_script_runs_across_two_hosts(tmp_path: Path, two_hosts: list[str]) -> None:
    script = write_script(tmp_path, "ddp.py", DDP_SCRIPT)
    common = ["-n", "1", "--nnodes", "2", "--master-addr", "198.18.0.1", "--master-port", "29519"]
    codes, outputs = run_on_hosts(two_hosts, common, [str(script)], tmp_path, clean_env())
    assert codes == [0, 0], outputs
    assert "[0] rank 0 of 2 (local 0, node 0) in step" in outputs[0][0]
    assert "[1] rank 1 of 2 (local 0, node 1) in step" in outputs[1][0]


def test_a_phalanx_script_runs_under_torchrun(tmp_path: Path) -> None:
    script = write_script(tmp_path, "px_script.py", """\
        import sys, torch
        import phalanx as px
        from phalanx.comm.runtime import launch_info
        px.init()
        total = int(px.allreduce(torch.ones(2))[0])
        with open(f"{sys.argv[1]}/{px.rank()}.out", "w") as out:
            out.write(f"{launch_info().source} {px.rank()} {total}")
    """)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script), str(tmp_path)],
                          cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert [(tmp_path / f"{r}.out").read_text() for r in range(2)] == ["torchrun 0 2", "torchrun 1 2"]
