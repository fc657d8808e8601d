"""Central storage on one host: the parameters live once, in shared memory, and training equals
the single-process run; with ``shared_memory=False`` every worker keeps a copy, kept equal by broadcast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.comm import shm
from phalanx.global_batch import share_bounds
from tests.harness import run_workers

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm here")

SAMPLES, STEPS = 12, 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 3, (SAMPLES,), generator=generator)


def _train(shared_memory: bool | str) -> dict:
    net = _model()
    model, optimizer = px.CentralStorage(shared_memory=shared_memory).setup(
        net, torch.optim.Adam(net.parameters(), lr=0.05))
    x, y = _data()
    start, stop = share_bounds(SAMPLES, px.size(), px.rank())
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(model(x[start:stop]), y[start:stop]).backward()
        optimizer.step()
    trained = [p.detach().clone() for p in model.parameters()]
    weight = model.module[0].weight
    seen = None
    if optimizer.shared:  # rank 0 writes, the others read it with no message in between but a barrier
        px.barrier()  # every rank has its copy of the trained values
        if px.rank() == 0:
            with torch.no_grad():
                weight[0, 0] = 1234.5
        px.barrier()
        seen = float(weight[0, 0])
    return {"params": trained, "shared": optimizer.shared,
            "seen": seen, "state": len(optimizer.state)}


def _reference() -> list[torch.Tensor]:
    net = _model()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.05)
    x, y = _data()
    for _ in range(STEPS):
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("world_size,shared_memory", [(2, "auto"), (3, "auto"), (2, False)])
def test_central_storage_trains_like_one_process(world_size: int, shared_memory: bool | str) -> None:
    results = run_workers(_train, world_size, shared_memory)
    expected = _reference()
    for rank, result in enumerate(results):
        assert result["shared"] == (shared_memory == "auto"), rank
        assert result["state"] == (4 if rank == 0 else 0), rank  # Adam's state on the storage rank only
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if shared_memory == "auto":
        assert [r["seen"] for r in results] == [1234.5] * world_size  # one copy of the parameters


def test_shared_memory_true_without_shared_memory_is_refused() -> None:
    def refuse() -> str:
        try:
            px.CentralStorage(shared_memory=True).setup(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
        except px.ConfigurationError as error:
            return str(error)
        return "accepted"

    assert "needs several CPU workers on one host" in run_workers(refuse, 1)[0]
