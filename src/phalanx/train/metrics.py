"""Metrics over the global batch, exactly: ranks add up sums and counts, never average averages.

A metric accumulates a local ``(sum, count)`` pair per step; :func:`reduce_metrics` sums every
metric's pair over all ranks in one allreduce, so a rank with fewer (or no) samples weighs
exactly as much as the samples it saw.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from phalanx.comm import collectives
from phalanx.errors import ConfigurationError


class Metric:
    """A running ``sum / count`` over samples. Subclasses say what one sample contributes."""

    name = "metric"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total = 0.0
        self.count = 0.0

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float) -> None:
        raise NotImplementedError

    def value(self) -> float:
        return self.total / self.count if self.count else float("nan")


class MeanLoss(Metric):
    """The mean of the per-sample loss over all samples seen."""

    name = "loss"

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float) -> None:
        self.total += loss_sum
        self.count += len(targets)


class Accuracy(Metric):
    """The fraction of samples whose highest-scoring class is the target."""

    name = "accuracy"

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float) -> None:
        self.total += float((outputs.argmax(dim=-1) == targets).sum())
        self.count += len(targets)


class TopKAccuracy(Metric):
    """The fraction of samples whose target is among the ``k`` highest-scoring classes."""

    def __init__(self, k: int = 5):
        self.k = k
        self.name = f"top{k}_accuracy"
        super().__init__()

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float) -> None:
        top = outputs.topk(min(self.k, outputs.shape[-1]), dim=-1).indices
        self.total += float((top == targets.unsqueeze(-1)).any(dim=-1).sum())
        self.count += len(targets)


_BY_NAME = {"accuracy": Accuracy, "acc": Accuracy, "loss": MeanLoss}


def resolve(metrics: Sequence[str | Metric]) -> list[Metric]:
    """The loss first, then the user's metrics (names like ``"accuracy"``, ``"top5"``, or objects)."""
    resolved: list[Metric] = [MeanLoss()]
    for metric in metrics:
        if isinstance(metric, Metric):
            resolved.append(metric)
        elif isinstance(metric, str) and metric.startswith("top") and metric[3:].isdigit():
            resolved.append(TopKAccuracy(int(metric[3:])))
        elif metric in _BY_NAME and metric != "loss":
            resolved.append(_BY_NAME[metric]())
        elif metric != "loss":
            raise ConfigurationError(f"unknown metric {metric!r}: use 'accuracy', 'top5', or a px.metrics.Metric.")
    return resolved


def fresh_copies(metrics: Sequence[Metric]) -> list[Metric]:
    """New, empty metrics of the same kinds (for validation beside training)."""
    copies = [copy.copy(metric) for metric in metrics]
    for metric in copies:
        metric.reset()
    return copies


def global_sums(metrics: Sequence[Metric]) -> list[list[float]]:
    """Every metric's (sum, count) summed over all ranks."""
    local = torch.tensor([[float(m.total), float(m.count)] for m in metrics], dtype=torch.float64)
    return collectives.allreduce(local, "sum", check=False).tolist()


def reduce_metrics(metrics: Sequence[Metric], prefix: str = "") -> dict[str, float]:
    """Global values of ``metrics``: one allreduce of every (sum, count) pair, in float64."""
    return {prefix + m.name: (s / c if c else float("nan")) for m, (s, c) in zip(metrics, global_sums(metrics))}
