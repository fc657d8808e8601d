"""Who keeps whose chunks between hosts: every buddy on another host wherever there is one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.strategies.shard_copies import BuddyCopies, buddies_of
from tests.harness import run_workers


def _hosts(sizes: list[int]) -> list[tuple[int, int]]:
    """(index on its host, host) of each rank, ranks host by host."""
    return [(local, host) for host, size in enumerate(sizes) for local in range(size)]


@pytest.mark.parametrize("sizes", [[2, 2], [1, 2], [2, 1], [3, 1], [1, 1, 3], [2, 2, 2], [4]])
def test_each_buddy_is_on_another_host_wherever_there_is_one(sizes: list[int]) -> None:
    places = _hosts(sizes)
    buddies = buddies_of(places)
    for rank, buddy in enumerate(buddies):
        assert buddy != rank
        if len(sizes) > 1:
            assert places[buddy][1] != places[rank][1], (sizes, buddies)


def test_hosts_of_equal_size_pair_each_worker_with_one_ward() -> None:
    """Equal hosts: the buddies are a ring, each worker keeping exactly one other's chunks."""
    buddies = buddies_of(_hosts([2, 2]))
    assert sorted(buddies) == [0, 1, 2, 3]


def test_the_lone_worker_of_a_smaller_host_keeps_both_others_chunks() -> None:
    """Hosts of 1 and 2 workers: a ring of three would pair the two of one host; instead both send to
    the lone worker, whose chunks go to the first of the other host."""
    assert buddies_of(_hosts([1, 2])) == [1, 0, 0]


def _committed_with_hosts_of_one_and_two() -> dict[int, list[torch.Tensor]]:
    """One commit of a level-2 model's chunks (each worker its own units), the buddies those of hosts of 1 and 2 workers
    (rank 0 alone on its host); what this rank holds afterwards, and its own parts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))
    strategy = px.Sharded(level=2, fusion_threshold_mb=0.001, shared_memory=False)
    wrapped, optimizer = strategy.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    F.cross_entropy(wrapped(torch.randn(6, 10)), torch.tensor([0, 1, 2, 0, 1, 2])).backward()
    optimizer.step()
    copies = BuddyCopies()
    copies.buddies = buddies_of(_hosts([1, 2]))
    positions = {id(p): i for i, p in enumerate(model.parameters())}
    copies.commit(1, optimizer.units, optimizer.stepping.state, positions)
    holding = copies.holding(1)
    assert holding is not None
    return holding.parts


def test_the_buddy_of_several_keeps_each_wards_chunks_whole() -> None:
    parts = run_workers(_committed_with_hosts_of_one_and_two, 3)
    assert sorted(parts[0]) == [0, 1, 2] and sorted(parts[1]) == [0, 1] and sorted(parts[2]) == [2]
    for ward in (1, 2):
        assert len(parts[0][ward]) == len(parts[ward][ward]) > 0
        for kept, own in zip(parts[0][ward], parts[ward][ward]):
            assert torch.equal(kept, own), ward
    for kept, own in zip(parts[1][0], parts[0][0]):
        assert torch.equal(kept, own)
