"""Shards balanced by bytes and identical in every process; groups split by dtype."""

from __future__ import annotations

import pytest
import torch

from phalanx.errors import ConfigurationError
from phalanx.strategies.placement import all_groups, groups, place


def test_largest_first_onto_the_least_loaded_server() -> None:
    params = [torch.zeros(n) for n in (100, 10, 60, 50, 1)]
    owner = place(params, 2)
    load = [sum(p.numel() for p, o in zip(params, owner) if o == s) for s in range(2)]
    assert owner == [0, 0, 1, 1, 0] and load == [111, 110]
    assert place(params, 2) == owner  # deterministic


def test_bytes_not_elements_are_balanced() -> None:
    params = [torch.zeros(100, dtype=torch.float64), torch.zeros(100), torch.zeros(100)]
    assert place(params, 2) == [0, 1, 1]


def test_groups_split_by_dtype_in_index_order() -> None:
    params = [torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(4)]
    found = groups(params, [0, 0, 0], 0)
    assert [(g.dtype, g.params, g.numels) for g in found] == [(torch.float32, (0, 2), (3, 4)),
                                                             (torch.float64, (1,), (2,))]
    assert [g.index for g in found] == [0, 1]
    assert sum(g.numel for g in all_groups(params, 2)) == 9


def test_more_servers_than_parameters_is_an_error() -> None:
    with pytest.raises(ConfigurationError, match="at most 2 servers"):
        place([torch.zeros(1), torch.zeros(1)], 3)
