"""What px.fit's loop asks of a strategy: where parameters and optimizer state live.

A strategy is one small object (as Lightning's ``Strategy`` is): ``check`` refuses, before anything
trains, the options it cannot honour (naming the pair); ``setup`` turns the user's model and
optimizer into the ones the loop trains (a ``px.DataParallel`` and an optimizer whose ``step`` does
what the strategy needs); ``finish``/``close`` end it cleanly or after a failure. ``asynchronous``
says whether workers run in lockstep; ``nonfinite_agreement`` how every rank comes to the same
decision about a non-finite step (:mod:`phalanx.train.finite`'s ``AGREEMENTS``). :class:`Replicated` (every worker holds everything, the
default), :class:`~phalanx.strategies.central_storage.CentralStorage` and
:class:`~phalanx.strategies.parameter_server.ParameterServer` implement it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from phalanx.comm import runtime
from phalanx.errors import ConfigurationError
from phalanx.parallel.clipping import Clipping
from phalanx.parallel.data_parallel import DataParallel


@dataclass(frozen=True)
class FitOptions:
    """The options of one ``px.fit`` call that a strategy may have to refuse."""

    precision: str = "32"
    clipping: Clipping | None = None
    reproducible: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    several_optimizers: bool = False
    torch_scheduler: bool = False
    elastic: bool = False
    manual_step: bool = False  # a step_fn that runs its own backward passes and optimizer steps


class OptimizerLike(Protocol):
    """A torch optimizer, or several stepped as one (``px.fit`` takes a list)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def step(self) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Strategy(Protocol):
    """Where the parameters and the optimizer state live (see the module's docstring)."""

    asynchronous: bool
    nonfinite_agreement: str

    def check(self, options: FitOptions) -> None: ...
    def setup(self, model: nn.Module, optimizer: OptimizerLike) -> tuple[DataParallel, OptimizerLike]: ...
    def finish(self, history: dict[str, Any] | None = None) -> None: ...
    def close(self) -> None: ...


class Replicated:
    """Every worker holds the parameters and the optimizer state; gradients are averaged by
    ``px.DataParallel`` during backward. The default strategy."""

    asynchronous = False
    nonfinite_agreement = "gradient"  # every rank holds the same averaged gradient

    def check(self, options: FitOptions) -> None:
        refuse_parameter_servers_launched("px.DataParallel")

    def setup(self, model: nn.Module, optimizer: OptimizerLike) -> tuple[DataParallel, OptimizerLike]:
        return wrap(model), optimizer

    def finish(self, history: dict[str, Any] | None = None) -> None:
        """Nothing to tear down."""

    def close(self) -> None:
        """Nothing to tear down."""


def wrap(model: nn.Module) -> DataParallel:
    """``model`` as the loop trains it: a ``px.DataParallel`` on this worker's device (as given if it is one)."""
    return model if isinstance(model, DataParallel) else DataParallel(model.to(runtime.device()))


def refuse_parameter_servers_launched(strategy: str) -> None:
    """A job launched with ``--servers`` trains only with ``px.ParameterServer``."""
    if runtime.role() == "worker" and runtime.num_servers():
        raise ConfigurationError(
            f"the job was launched with parameter servers (--servers), but px.fit trains with {strategy}: pass "
            "strategy=px.ParameterServer(), or launch without --servers.")


def refuse_without_replicas(strategy: str, where: str, options: FitOptions) -> None:
    """Refuse what needs the optimizer on every worker (reproducible mode, several optimizers, a
    step_fn that steps its own) under a strategy that keeps it ``where`` (on one rank, on the servers)."""
    if options.reproducible:
        refuse(strategy, "reproducible=True", "reproducible mode trains with px.DataParallel only; drop strategy= or "
               "reproducible=.")
    if options.manual_step:
        refuse(strategy, "a step_fn that steps its own optimizers", f"the optimizer steps {where}; give "
               "step_fn(model, batch) and let px.fit step.")
    if options.several_optimizers:
        refuse(strategy, "a list of optimizers", f"one optimizer's state lives {where}; use one optimizer with "
               "parameter groups.")


def refuse(strategy: str, what: str, why: str) -> None:
    """Refuse an option this strategy cannot honour, naming both."""
    raise ConfigurationError(f"{strategy} with {what}: {why}")

