"""px.DataParallel under torch.compile: the gradients of eager mode, and buckets still sent while
backward runs (a compiled model in one graph would send them all after it)."""

from __future__ import annotations

import time

import torch

import phalanx as px
from phalanx.parallel.reductions import Average
from tests.harness import run_workers


class _Recorded(Average):
    """The default reduction, noting when each bucket is sent."""

    def __init__(self, events: list[tuple[str, float]]) -> None:
        self.events = events

    def reduce(self, bucket):  # type: ignore[no-untyped-def]
        self.events.append(("bucket sent", time.perf_counter()))
        return super().reduce(bucket)


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(*[layer for _ in range(4) for layer in (torch.nn.Linear(256, 256), torch.nn.Tanh())])


def _gradients_and_events() -> dict:
    torch.manual_seed(0)
    inputs = torch.randn(64, 256)[px.rank() * 32:(px.rank() + 1) * 32]
    eager = px.DataParallel(_model())
    eager(inputs).square().mean().backward()
    events: list[tuple[str, float]] = []
    wrapped = px.DataParallel(_model(), fusion_threshold_mb=0.25, reduction=_Recorded(events))
    compiled = torch.compile(wrapped, backend="aot_eager")
    for _ in range(2):  # the second step runs the buckets laid out in the order gradients came
        events.clear()
        wrapped.zero_grad()
        first = wrapped.module[0].weight.register_hook(lambda grad: events.append(("first layer", time.perf_counter())))
        compiled(inputs).square().mean().backward()
        first.remove()
    return {"difference": max(float((a.grad - b.grad).abs().max()) for a, b in zip(eager.parameters(),
                                                                                     wrapped.parameters())),
            "order": [name for name, _ in sorted(events, key=lambda event: event[1])]}


def test_a_compiled_model_reduces_as_in_eager_mode_while_backward_runs() -> None:
    for result in run_workers(_gradients_and_events, 2, timeout=120):
        assert result["difference"] == 0.0
        order = result["order"]
        assert order[:order.index("first layer")].count("bucket sent") >= 3, order  # the later layers' went first
        assert order.count("bucket sent") == 4, order
