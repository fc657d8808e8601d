"""Batch-norm running statistics in reproducible mode: per micro-batch, folded in index order.

During a micro-batch's forward each layer runs with momentum 1, so its running statistics become
that micro-batch's mean and unbiased variance, computed by the layer's own kernel. They are
recorded into the micro-batch's row of a table with one row per micro-batch of the global batch,
and the layer's state is put back after the last backward. The table is summed with the
gradients (it rides in the first bucket of the fixed-point reducer): each row is written by
exactly one rank and is zero elsewhere, and adding zeros changes no float64 value (``-0.0`` is
recorded as ``+0.0``), so the sum delivers every row bit for bit, on every rank. The rows are
then folded into the running statistics in index order with each layer's own momentum: the same
bits for any number of workers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class RunningStatsFolding:
    """Records and folds the running statistics of a model's batch-norm layers."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
        self._index = {id(layer): k for k, layer in enumerate(self.layers)}
        widths = [2 * layer.num_features for layer in self.layers]
        self._widths = torch.tensor(widths)
        self._offsets = [sum(widths[:k]) for k in range(len(widths) + 1)]
        self._table = torch.zeros(0, dtype=torch.float64)
        self._row = -1
        self._saved: list[tuple[torch.Tensor, ...]] = []
        self._momenta: dict[int, float | None] = {}
        for layer in self.layers:
            layer.register_forward_pre_hook(self._before)
            layer.register_forward_hook(self._after)

    def table_numel(self, total_micro_batches: int) -> int:
        """How many float64 values the table of a step with ``total_micro_batches`` micro-batches holds."""
        return total_micro_batches * self._offsets[-1]

    def begin_pass(self, table: torch.Tensor) -> None:
        """Start recording one pass over this rank's micro-batches into ``table`` (zeroed float64).

        A redone step starts again with a fresh table.
        """
        if not self.layers:
            return
        self._saved = [(l.running_mean.clone(), l.running_var.clone(), l.num_batches_tracked.clone())
                       for l in self.layers]
        self._table = table.view(-1, self._offsets[-1])

    def begin_micro_batch(self, index: int) -> None:
        """Record the coming forward as micro-batch ``index`` (NaN marks layers that do not run)."""
        self._row = index
        if self.layers:
            self._table[index].fill_(math.nan)

    def end_recording(self) -> None:
        """Stop recording and undo the layers' own updates (after backward: autograd saved them)."""
        self._row = -1
        for layer, (mean, var, count) in zip(self.layers, self._saved):
            layer.running_mean.copy_(mean)
            layer.running_var.copy_(var)
            layer.num_batches_tracked.copy_(count)

    def fold(self) -> None:
        """Fold every micro-batch's statistics in, in index order, once the table has been summed."""
        if not self.layers:
            return
        rows = self._table  # summed over ranks by now
        with torch.no_grad():
            state = torch.cat([torch.cat([l.running_mean, l.running_var]) for l in self.layers]).double()
            ran = ~torch.isnan(rows[:, self._offsets[:-1]])  # micro-batch x layer
            counts = torch.stack([l.num_batches_tracked for l in self.layers]).double()
            fixed = torch.tensor([math.nan if l.momentum is None else l.momentum for l in self.layers],
                                 dtype=torch.float64, device=state.device)
            widths = self._widths.to(state.device)
            for row, ran_row in zip(rows, ran):
                counts += ran_row
                momentum = torch.where(torch.isnan(fixed), 1.0 / counts.clamp_min(1), fixed)
                momentum = momentum.repeat_interleave(widths)
                folded = state * (1 - momentum) + row * momentum
                state = torch.where(torch.isnan(row), state, folded)
            self._write_back(state, ran.sum(dim=0))

    def _write_back(self, state: torch.Tensor, runs: torch.Tensor) -> None:
        for k, layer in enumerate(self.layers):
            c, offset = layer.num_features, self._offsets[k]
            layer.running_mean.copy_(state[offset : offset + c])
            layer.running_var.copy_(state[offset + c : offset + 2 * c])
            layer.num_batches_tracked.add_(runs[k])

    def _before(self, layer: nn.Module, args: tuple) -> None:
        if self._row >= 0 and layer.training:
            self._momenta[id(layer)] = layer.momentum
            layer.momentum = 1.0

    def _after(self, layer: nn.Module, args: tuple, output: Any) -> None:
        if id(layer) in self._momenta:
            layer.momentum = self._momenta.pop(id(layer))
            offset, c = self._offsets[self._index[id(layer)]], layer.num_features
            stats = self._table[self._row, offset : offset + 2 * c]
            stats[:c].copy_(layer.running_mean)
            stats[c:].copy_(layer.running_var)
            stats.add_(0.0)  # -0.0 becomes +0.0, as it would in the sum over ranks
