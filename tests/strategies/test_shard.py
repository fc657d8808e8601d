"""A parameter server's shard applies the averaged gradient as the user's optimizer would, clipped
by value and by the norm of the whole gradient when that gradient is split over several servers."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from phalanx.parallel.clipping import Clipping
from phalanx.strategies.placement import groups, place
from phalanx.strategies.shard import Shard

SAMPLES = 8


def _model_and_gradient() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return model, [torch.randn_like(p) for p in model.parameters()]


def _push(shard: Shard, gradient: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the workers' pushes sum to: per group the gradient summed over SAMPLES samples, the
    "had a gradient" flags and the sample count."""
    buffers = shard.gradient_buffers()
    for group, buffer in zip(shard.groups, buffers):
        summed = torch.cat([gradient[index].flatten() * SAMPLES for index in group.params])
        buffer[:group.numel] = summed
        buffer[group.numel:-1] = 1
        buffer[-1] = SAMPLES
    return buffers


def _applied_by_servers(servers: int, clipping: Clipping) -> dict[int, torch.Tensor]:
    """The parameters after one step of SGD over ``servers`` shards, each clipping its part in its own
    thread; the squared norms are summed in server order, as the servers do through the store."""
    model, gradient = _model_and_gradient()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=1.0)
    owner = place(params, servers)
    shards = [Shard(params, optimizer, groups(params, owner, server)) for server in range(servers)]
    published: dict[int, float] = {}
    everyone = threading.Barrier(servers)

    def sum_over_shards(server: int, mine: float) -> float:
        published[server] = mine
        everyone.wait(timeout=10)
        return sum(published[s] for s in range(servers))

    def apply(server: int) -> None:
        shards[server].apply(_push(shards[server], gradient), [1.0], copy.copy(clipping),
                             (lambda mine: sum_over_shards(server, mine)) if servers > 1 else None)

    threads = [threading.Thread(target=apply, args=(server,)) for server in range(servers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    return {index: param.detach().clone() for index, param in enumerate(params)}


@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("max_norm, max_value", [(0.5, None), (None, 0.1), (0.3, 0.2)])
def test_a_shard_clips_as_torch_clips_the_whole_gradient(servers: int, max_norm: float | None,
                                                         max_value: float | None) -> None:
    model, gradient = _model_and_gradient()
    for param, grad in zip(model.parameters(), gradient):
        param.grad = grad.clone()
    if max_value is not None:
        torch.nn.utils.clip_grad_value_(model.parameters(), max_value)
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        assert norm > max_norm  # the case clips
    with torch.no_grad():
        expected = [param - param.grad for param in model.parameters()]
    got = _applied_by_servers(servers, Clipping(max_norm, max_value))
    for index, value in enumerate(expected):
        torch.testing.assert_close(got[index], value, rtol=1e-6, atol=1e-7)
