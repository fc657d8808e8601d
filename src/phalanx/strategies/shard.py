"""One parameter server's part of the model: its parameters in flat groups, and its optimizer.

The server applies the user's own optimizer (same class, hyperparameters and ``param_groups``)
to its shard only, so each optimizer state tensor exists once in the job. Received gradients are
sums of per-sample gradients with a trailer (per parameter "had a gradient", then the sample
count); dividing by the count gives the global-batch average.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch

from phalanx.parallel.clipping import Clipping
from phalanx.strategies.placement import Group


class Shard:
    """The parameters ``groups`` name, held in one flat tensor per group, and their optimizer."""

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, groups: list[Group]):
        self.groups = groups
        self.indices = [index for group in groups for index in group.params]
        self.flats = [torch.empty(group.numel, dtype=group.dtype) for group in groups]
        self.params: dict[int, torch.nn.Parameter] = {}
        for group, flat in zip(groups, self.flats):
            offset = 0
            for index, numel in zip(group.params, group.numels):
                param = params[index]
                view = flat[offset:offset + numel].view_as(param)
                view.copy_(param.detach())
                param.data = view  # the flat is the parameter: replies send it without a copy
                self.params[index] = param
                offset += numel
        position = {id(param): index for index, param in enumerate(params)}
        self.optimizer = _shard_optimizer(optimizer, position, set(self.indices))
        self._order = [position[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def gradient_buffers(self) -> list[torch.Tensor]:
        """Receive buffers for one push: per group its gradients, flags and sample count."""
        return [torch.zeros(group.numel + len(group.params) + 1, dtype=group.dtype) for group in self.groups]

    def apply(self, pushed: Sequence[torch.Tensor], rates: Sequence[float], clipping: Clipping | None = None,
              sum_over_shards: Callable[[float], float] | None = None) -> None:
        """One optimizer step with the summed pushes (gradients divided by their summed count), clipped
        first when asked (``sum_over_shards`` makes the norm the whole gradient's, see :class:`Clipping`)."""
        for group, buffer in zip(self.groups, pushed):
            numel, total = group.numel, float(buffer[-1])
            gradients = buffer[:numel].div_(total) if total else buffer[:numel].zero_()
            used = buffer[numel:-1].tolist()
            offset = 0
            for index, size, flag in zip(group.params, group.numels, used):
                param = self.params[index]
                param.grad = gradients[offset:offset + size].view_as(param) if flag > 0 else None
                offset += size
        if clipping is not None:
            clipping.clip_parameters(self.params.values(), sum_over_shards)
        for param_group, rate in zip(self.optimizer.param_groups, rates):
            param_group["lr"] = rate
        self.optimizer.step()

    def snapshot(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """A copy of the parameters and optimizer state, to go back one step (elastic jobs)."""
        return [flat.clone() for flat in self.flats], copy.deepcopy(self.optimizer.state_dict())

    def restore(self, snapshot: tuple[list[torch.Tensor], dict[str, Any]]) -> None:
        flats, state = snapshot
        self.load_parameters(flats)
        self.optimizer.load_state_dict(state)

    def load_parameters(self, flats: Sequence[torch.Tensor]) -> None:
        for mine, given in zip(self.flats, flats):
            mine.copy_(given)

    def optimizer_state(self) -> dict[int, dict[str, Any]]:
        """The optimizer state of each of this shard's parameters, keyed by model parameter index."""
        state = self.optimizer.state_dict()["state"]
        return {self._order[local]: value for local, value in state.items()}

    def load_optimizer_state(self, states: dict[int, dict[str, Any]]) -> None:
        """Take per-parameter optimizer state keyed by model parameter index (see :meth:`optimizer_state`)."""
        local = {self._order.index(index): value for index, value in states.items() if index in self._order}
        self.optimizer.load_state_dict({"state": local, "param_groups": self.optimizer.state_dict()["param_groups"]})


def _shard_optimizer(optimizer: torch.optim.Optimizer, position: dict[int, int], mine: set[int]) -> torch.optim.Optimizer:
    """The user's optimizer class over this shard: every param group kept (maybe empty), hyperparameters as given."""
    groups = []
    for group in optimizer.param_groups:
        hyper = {key: value for key, value in group.items() if key != "params"}
        groups.append({**hyper, "params": [p for p in group["params"] if position.get(id(p)) in mine]})
    return type(optimizer)(groups, **optimizer.defaults)
