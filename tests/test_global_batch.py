"""Pure index arithmetic: shares, plans, seeds."""

from __future__ import annotations

import pytest
import torch

from phalanx.global_batch import (
    epoch_permutation,
    epoch_plan,
    epoch_seed,
    local_share,
    mix_seed,
    num_steps,
    share_bounds,
    validate_global_batch_size,
)
from phalanx.errors import ConfigurationError

torch.set_num_threads(1)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("batch_len", [0, 1, 3, 4, 5, 29, 30])
def test_shares_are_contiguous_in_rank_order_and_differ_by_at_most_one(batch_len: int, world_size: int) -> None:
    bounds = [share_bounds(batch_len, world_size, r) for r in range(world_size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == batch_len
    assert all(prev[1] == cur[0] for prev, cur in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the remainder goes to the lowest ranks


def test_share_sizes_follow_the_formula() -> None:
    assert [share_bounds(30, 4, r) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]


def test_local_shares_concatenate_to_the_global_batch() -> None:
    batch = torch.tensor([9, 4, 7, 1, 0, 3, 5])
    assert torch.equal(torch.cat([local_share(batch, 3, r) for r in range(3)]), batch)


@pytest.mark.parametrize("n,b,drop_last", [(100, 30, False), (100, 30, True), (90, 30, True), (7, 10, False), (0, 4, False)])
def test_plan_covers_each_sample_once(n: int, b: int, drop_last: bool) -> None:
    plan = epoch_plan(n, b, seed=3, epoch=1, drop_last=drop_last)
    assert len(plan) == num_steps(n, b, drop_last)
    flat = torch.cat(plan).tolist() if plan else []
    assert len(flat) == len(set(flat))
    assert len(flat) == (n // b * b if drop_last else n)
    assert all(len(batch) == b for batch in plan[:-1])


def test_plan_resumed_at_start_continues_with_the_next_sample() -> None:
    perm = epoch_permutation(50, seed=1, epoch=2)
    plan = epoch_plan(50, 8, seed=1, epoch=2, start=13)
    assert torch.equal(torch.cat(plan), perm[13:])
    assert num_steps(50, 8, start=13) == len(plan) == 5


def test_permutation_depends_on_seed_and_epoch_only() -> None:
    assert torch.equal(epoch_permutation(64, 5, 0), epoch_permutation(64, 5, 0))
    assert not torch.equal(epoch_permutation(64, 5, 0), epoch_permutation(64, 5, 1))
    assert not torch.equal(epoch_permutation(64, 5, 0), epoch_permutation(64, 6, 0))
    assert torch.equal(epoch_permutation(5, 5, 0, shuffle=False), torch.arange(5))


def test_seeds_are_stable_non_negative_63_bit() -> None:
    assert mix_seed(1, 2) == mix_seed(1, 2) != mix_seed(2, 1)
    assert epoch_seed(0, 0) == mix_seed(0, 0)
    assert all(0 <= mix_seed(s, e) < 2**63 for s in (-1, 0, 2**40) for e in range(3))


def test_invalid_arguments_raise_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="world_size=4"):
        validate_global_batch_size(3, 4)
    for bad in (lambda: share_bounds(4, 2, 2), lambda: share_bounds(4, 0, 0), lambda: share_bounds(-1, 2, 0),
                lambda: num_steps(4, 0), lambda: epoch_plan(4, 2, seed=0, epoch=0, start=5)):
        with pytest.raises(ConfigurationError):
            bad()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_micro_batch_granularity_gives_whole_micro_batches_in_order(world_size: int) -> None:
    for batch_len in (24, 10, 7):
        bounds = [share_bounds(batch_len, world_size, r, granularity=2) for r in range(world_size)]
        assert bounds[0][0] == 0 and bounds[-1][1] == batch_len
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert all(start % 2 == 0 for start, stop in bounds if stop > start)  # on micro-batch boundaries


def test_loader_refuses_fewer_micro_batches_than_workers() -> None:
    from phalanx.data import DistributedLoader
    from phalanx.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="fewer than the 4 workers"):
        DistributedLoader(torch.zeros(10), 6, micro_batch_size=2, rank=0, world_size=4)
