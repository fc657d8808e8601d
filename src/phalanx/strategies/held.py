"""The user's optimizer held by a strategy that steps it elsewhere (servers, the storage rank).

Workers keep the optimizer object for its hyperparameters: learning-rate schedules and callbacks
set ``param_groups`` on it as usual, and its ``state`` stays empty where it is not stepped. A
strategy subclasses :class:`HeldOptimizer` and says what ``step`` and the state dicts do.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from phalanx.errors import ConfigurationError


class HeldOptimizer:
    """Delegates hyperparameters to ``optimizer``; subclasses define ``_step`` and the state dicts."""

    #: Named in the error a closure gets.
    strategy = "this strategy"

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def held_beside(self) -> list[torch.Tensor]:
        """The tensors the strategy keeps beside the model, its gradients and the stepping optimizer's
        state (``phalanx doctor`` counts them): none unless a strategy says otherwise."""
        return []

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """One optimizer step, taken where the strategy keeps the optimizer state."""
        if closure is not None:
            raise ConfigurationError(f"{self.strategy}'s optimizer takes no closure: compute the loss before step().")
        self._step()
        # A torch LR scheduler built on the user's optimizer tells a schedule stepped before its
        # optimizer by this mark, which its wrapper of the optimizer's own step() sets: that step is
        # never called here, so without it every schedule warns, wrongly, that its first value is skipped.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def _step(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError
