"""Training over slow links: workers step on their own and synchronize every ``period`` steps.

``px.LocalSGD(period=H)`` (local SGD, as PyTorch's post-local SGD and Accelerate's ``LocalSGD``)
and ``px.DiLoCo(period=H, ...)`` (Douillard et al., 2023) replace the allreduce of every gradient
by one exchange every H optimizer steps. Each worker steps the user's optimizer (the *inner* one)
on the gradient of its own share of each global batch; nothing crosses the network in between
(the ``px.DataParallel`` the strategy returns stays inside ``no_sync()``). Every H steps:

* LocalSGD replaces the parameters by their average over the workers;
* DiLoCo averages the *outer gradient*, the parameters of the last outer step minus the current
  ones, and an outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9 by default) applies it to those
  saved parameters; every worker goes on from the result. With SGD as the inner optimizer,
  ``period=1`` and an outer SGD of lr 1, that is ``px.DataParallel`` (the averaged change is the
  averaged gradient times the learning rate).

Both are the same machinery (:mod:`phalanx.strategies.local_steps`), an optimizer whose
``step()`` is the inner step and, at their turn, the exchanges. With ``fragments=F`` (Streaming
DiLoCo) the parameters, in the model's order, are cut into F runs of about equal size; fragment
``i`` starts its exchange after each step ``t`` with ``t % H == i * H // F``, without waiting, and
merges it after step ``t + delay``: the outer step is applied then and the fragment's parameters
are set to its result (the local steps taken on that fragment meanwhile are dropped: Streaming
DiLoCo's merge with mixing factor 0), so the exchange crosses the network while ``delay`` inner
steps compute. An exchange goes through a :class:`~phalanx.parallel.reductions.Reduction`
(``"bf16"``, ``px.TopK``), one bucket per dtype and device of a fragment. When training ends
(``finish()``), every fragment that changed since its last merge is synchronized once more, so
every worker ends with the same weights. docs/strategies.md says when to choose which.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from phalanx.comm import runtime
from phalanx.errors import ConfigurationError
from phalanx.parallel import reductions
from phalanx.parallel.data_parallel import DataParallel
from phalanx.parallel.reductions import Reduction
from phalanx.strategies.base import (Exchanges, FitOptions, OptimizerLike, Strategy, announce, held_bytes, refuse,
                                     refuse_parameter_servers_launched, state_per_parameter, wrap)
from phalanx.strategies.local_steps import LocalSteps, OuterOptimizer, OuterSteps, leave_gradients_local


def paper_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum 0.9 and learning rate 0.7."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class LocalSGD(Strategy):
    """``px.fit(..., strategy=px.LocalSGD(period=H))``: every worker steps on its own gradients and
    the parameters are averaged over the workers every ``period`` steps (see the module's docstring)."""

    asynchronous = False
    nonfinite_agreement = "exchanges"  # each rank decides its own steps; the verdict goes with the exchanges

    def __init__(self, period: int):
        self.period = _whole("period", period, 1)
        self.optimizer: LocalSteps | None = None
        self._local = contextlib.ExitStack()  # holds the model's no_sync() while the strategy trains

    @property
    def name(self) -> str:
        return f"px.LocalSGD(period={self.period})"

    def check(self, options: FitOptions) -> None:
        """Refuse, naming the pair, what stepping each worker on its own gradients cannot do."""
        refuse_parameter_servers_launched(self.name)
        if options.reproducible:
            refuse(self.name, "reproducible=True", "reproducible mode sums every step's gradients exactly over the "
                   "workers, and this strategy sums none; drop reproducible= (the same seed still gives the same "
                   "weights run to run at a given worker count).")
        if options.manual_step:
            refuse(self.name, "a step_fn that steps its own optimizers", "the synchronization happens inside the "
                   "strategy's optimizer.step(); give step_fn(model, batch) and let px.fit step.")
        if options.several_optimizers:
            refuse(self.name, "a list of optimizers", "the strategy wraps one optimizer; use one optimizer with "
                   "parameter groups.")

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[DataParallel, LocalSteps]:
        """Wrap ``model`` so that backward sends nothing, and ``optimizer`` so that its ``step()`` also
        synchronizes at each fragment's turn (the replicas start from rank 0's weights)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(f"{self.name} wraps one torch optimizer, got {type(optimizer).__name__}; use "
                                     "one optimizer with parameter groups.")
        wrapped = wrap(model)
        self._local.close()
        self._local.enter_context(wrapped.no_sync())
        leave_gradients_local(wrapped)
        self.optimizer = self._wrap(optimizer, wrapped)
        announce(self)  # in a loop of your own too, phalanx doctor names the strategy
        return wrapped, self.optimizer

    def exchanges(self) -> Exchanges:
        """One exchange every ``period`` steps: the parameters' average."""
        return Exchanges(self.period, what="the parameters, averaged")

    def meets_after_step(self) -> bool:
        """Whether the step about to be taken completes an exchange (the workers meet there anyway)."""
        return self.optimizer is None or self.optimizer.merges_in_next_step()

    def _wrap(self, optimizer: torch.optim.Optimizer, model: DataParallel) -> LocalSteps:
        return LocalSteps(optimizer, model, self.period)

    def memory_needed(self, model: nn.Module, optimizer: OptimizerLike) -> int:
        """Data parallel's, and a copy of the parameters to exchange."""
        return held_bytes(model, optimizer, level=0, workers=runtime.size()) + _weight_bytes(model)

    def finish(self, history: dict[str, Any] | None = None) -> None:
        """The last synchronization, so that every worker ends with the same weights; then the model
        reduces gradients again, as any ``px.DataParallel``."""
        if self.optimizer is not None:
            self.optimizer.synchronize()
        self._local.close()

    def close(self) -> None:
        """After a failure: the exchanges in flight are dropped."""
        if self.optimizer is not None:
            self.optimizer.forget_in_flight()
        self._local.close()


class DiLoCo(LocalSGD):
    """``px.fit(..., strategy=px.DiLoCo(period=H))``: inner steps on each worker's own gradients, an
    outer step every ``period`` steps (see the module's docstring and docs/strategies.md).

    ``outer_optimizer`` makes the outer optimizer from a list of tensors (default: SGD, lr 0.7,
    Nesterov momentum 0.9, as the paper). ``fragments=F`` synchronizes F runs of the parameters at
    staggered steps (Streaming DiLoCo), each merged ``delay`` inner steps after it started (default:
    1 with fragments, 0 without). ``reduction`` compresses the exchange: ``"bf16"``, ``"fp16"``,
    ``px.TopK(ratio)`` or a ``px.Reduction`` of yours.
    """

    def __init__(self, period: int, outer_optimizer: OuterOptimizer | None = None, fragments: int = 1,
                 delay: int | None = None, reduction: str | Reduction | None = None):
        super().__init__(period)
        self.fragments = _whole("fragments", fragments, 1)
        if self.fragments > self.period:
            raise ConfigurationError(f"px.DiLoCo(fragments={fragments}) synchronizes each fragment at its own step "
                                     f"of the period, so it needs period >= fragments, got period={period}.")
        self.delay = _whole("delay", delay if delay is not None else int(self.fragments > 1), 0)
        if self.delay >= self.period:
            raise ConfigurationError(f"px.DiLoCo(delay={delay}) must merge an exchange before its fragment's next "
                                     f"turn: give delay < period={period}.")
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise ConfigurationError("px.DiLoCo(outer_optimizer=...) takes a function of a list of tensors that "
                                     "makes the optimizer, such as functools.partial(torch.optim.SGD, lr=0.7).")
        self.outer_optimizer = outer_optimizer or paper_outer_optimizer
        self.reduction = reductions.resolve(reduction)

    @property
    def name(self) -> str:
        streaming = f", fragments={self.fragments}, delay={self.delay}" if self.fragments > 1 or self.delay else ""
        return f"px.DiLoCo(period={self.period}{streaming})"

    def exchanges(self) -> Exchanges:
        """``fragments`` exchanges every ``period`` steps, each merged ``delay`` steps after it starts."""
        return Exchanges(self.period, self.fragments, self.delay,
                         "the outer gradient: the parameters' change since the last outer step")

    def _wrap(self, optimizer: torch.optim.Optimizer, model: DataParallel) -> OuterSteps:
        return OuterSteps(optimizer, model, self.period, self.fragments, self.delay, self.reduction,
                          self.outer_optimizer)

    def memory_needed(self, model: nn.Module, optimizer: OptimizerLike) -> int:
        """LocalSGD's, with the parameters of the last outer step and the outer optimizer's state."""
        outer = self.outer_optimizer([p.detach() for p in model.parameters() if p.requires_grad])
        return super().memory_needed(model, optimizer) + (1 + state_per_parameter(outer)) * _weight_bytes(model)


def _whole(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigurationError(f"{name} must be a whole number of steps >= {least}, got {value!r}.")
    return value


def _weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
