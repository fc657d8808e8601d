"""Gradient accumulation is one mechanism, and the engine is rebuilt, never re-pointed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.parallel.accumulation import Accumulation


def test_only_the_last_backward_of_a_step_reduces() -> None:
    accumulation = Accumulation(3)
    assert [accumulation.next_backward() for _ in range(7)] == [False, False, True, False, False, True, False]
    assert accumulation.pending == 1
    accumulation.restart()
    assert [accumulation.next_backward() for _ in range(3)] == [False, False, True]


def test_backwards_inside_no_sync_accumulate_and_the_next_one_reduces_them_all() -> None:
    accumulation = Accumulation(1)
    with accumulation.no_sync():
        assert [accumulation.next_backward() for _ in range(2)] == [False, False]
        with accumulation.no_sync():  # nested blocks, as DDP allows
            assert not accumulation.next_backward()
        assert not accumulation.next_backward()
    assert accumulation.next_backward() and accumulation.pending == 0


@pytest.mark.parametrize("steps", [0, -1, 1.5, "2"])
def test_a_step_needs_a_whole_number_of_backwards(steps: object) -> None:
    with pytest.raises(px.ConfigurationError, match="at least 1"):
        Accumulation(steps)  # type: ignore[arg-type]


class Counting(px.Reduction):
    def __init__(self) -> None:
        self.calls = 0

    def reduce(self, bucket):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().reduce(bucket)


def test_rebuilding_the_engine_replaces_it_and_its_hooks() -> None:
    px.init()
    model = px.DataParallel(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), fusion_threshold_mb=0)
    counting = Counting()
    first = model.rebuild_reducer(reduction=counting)
    second = model.rebuild_reducer(threshold_mb=float("inf"))  # one bucket: the same reduction, a new engine
    assert model.reducer is second and second is not first and len(second.bucket_sizes) == 1
    model(torch.randn(5, 4)).sum().backward()
    assert counting.calls == 1, "the first engine's hooks were left behind"
    with model.no_sync():
        model(torch.randn(5, 4)).sum().backward()
    assert counting.calls == 1
    model(torch.randn(5, 4)).sum().backward()
    assert counting.calls == 2
