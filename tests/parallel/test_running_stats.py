"""Reproducible mode's batch-norm running statistics equal a sequential pass over the micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px

MICRO = 3


class _SometimesSkipsANorm(nn.Module):
    """Two batch-norm layers; the second runs only on micro-batches whose first input is positive."""

    def __init__(self, momentum: float | None):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4, momentum=momentum)
        self.extra = nn.BatchNorm2d(4, momentum=momentum)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x)))
        if float(x[0, 0, 0, 0]) > 0:
            h = self.extra(h)
        return self.head(h.mean(dim=(2, 3)))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_statistics_match_one_micro_batch_after_another(momentum: float | None) -> None:
    torch.manual_seed(0)
    model = _SometimesSkipsANorm(momentum)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    exact = px.ExactGradients(model, micro_batch_size=MICRO)
    for _ in range(3):
        x, y = torch.randn(8, 2, 5, 5, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        exact.backward(F.cross_entropy, (x,), y, global_batch_size=8)
        for start in range(0, 8, MICRO):
            reference(x[start : start + MICRO])
    for (name, ours), theirs in zip(model.named_buffers(), reference.buffers()):
        if name.endswith("num_batches_tracked"):
            assert int(ours) == int(theirs), name
        else:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)
    assert int(model.extra.num_batches_tracked) < int(model.norm.num_batches_tracked)  # the skip happened


def test_a_step_leaves_the_layers_in_training_mode_with_their_own_momentum() -> None:
    model = _SometimesSkipsANorm(0.1)
    exact = px.ExactGradients(model, micro_batch_size=MICRO)
    exact.backward(F.cross_entropy, (torch.ones(4, 2, 5, 5),), torch.zeros(4, dtype=torch.long), 4)
    assert model.norm.momentum == 0.1 and model.extra.momentum == 0.1 and model.training
