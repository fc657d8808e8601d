"""Several optimizers as one: ``px.fit(model, [optimizer_a, optimizer_b], ...)``.

Each optimizer keeps its own parameters, hyperparameters and state (one per part of a model, say
SGD for a body and Adam for a head); the loop zeroes, steps, saves and restores them together,
and precision, clipping and learning-rate schedules see all their parameter groups.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from phalanx.errors import ConfigurationError


class OptimizerGroup:
    """``optimizers`` zeroed, stepped, saved and restored together, in the order given."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        if not self.optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in self.optimizers):
            raise ConfigurationError("px.fit takes an optimizer or a list of torch optimizers, one per part of the "
                                     f"model; got {[type(o).__name__ for o in self.optimizers]}.")
        params = [id(p) for o in self.optimizers for group in o.param_groups for p in group["params"]]
        if len(params) != len(set(params)):
            raise ConfigurationError("two of px.fit's optimizers hold the same parameter: each would step it; give "
                                     "each optimizer its own part of the model.")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's parameter groups, in order (the dicts themselves: setting a rate sets it)."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {key: value for optimizer in self.optimizers for key, value in optimizer.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ConfigurationError("a list of optimizers steps without a closure.")
        for optimizer in self.optimizers:
            optimizer.step()

    def holds(self, optimizer: object) -> bool:
        """Whether ``optimizer`` is one of the group (a learning-rate scheduler's, say)."""
        return any(optimizer is member for member in self.optimizers)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ConfigurationError(f"the checkpoint holds {len(saved)} optimizers' state and px.fit was given "
                                     f"{len(self.optimizers)}: resume with the same optimizers.")
        for optimizer, one in zip(self.optimizers, saved):
            optimizer.load_state_dict(one)
