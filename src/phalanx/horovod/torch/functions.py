"""Broadcasting a model's parameters and an optimizer's state, and the object collectives."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from phalanx.comm import collectives
from phalanx.errors import ConfigurationError
from phalanx.horovod.torch import basics
from phalanx.horovod.torch.exceptions import horovod_errors
from phalanx.horovod.torch.optimizer import DistributedOptimizer
from phalanx.horovod.torch.process_sets import ProcessSet, global_process_set, root_position, scope_of


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every tensor of ``params`` in place with ``root_rank``'s.

    ``params`` is a ``state_dict()``, ``named_parameters()`` or a list of tensors. The ranks
    first compare names, shapes and dtypes (a model built differently raises on every rank);
    then the tensors travel in one broadcast per dtype.
    """
    basics.require_init()
    items = list(params.items()) if isinstance(params, Mapping) else [
        item if isinstance(item, tuple) else (str(index), item) for index, item in enumerate(params)]
    tensors = [tensor for _, tensor in items if isinstance(tensor, torch.Tensor)]
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in items if isinstance(t, torch.Tensor)]
    root = root_position(process_set, root_rank)
    with horovod_errors(), collectives.within(scope_of(process_set)):
        everyone = collectives.allgather_object(layout)
        differing = [r for r, other in enumerate(everyone) if other != everyone[root]]
        if differing:
            raise ConfigurationError(
                f"broadcast_parameters on rank {basics.rank()}: rank(s) {differing} hold tensors whose names, shapes "
                f"or dtypes differ from root {root_rank}'s ({len(everyone[root])} tensors). Build the same "
                "model on every rank before broadcasting it."
            )
        collectives.broadcast_tensors_(tensors, root)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: ProcessSet = global_process_set) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters (``state_dict``).

    An optimizer that has no state yet (before its first step) gets it as Horovod makes it: every
    trainable parameter without a gradient gets a zero one, and the wrapped torch optimizer takes
    one local step, on every rank alike; then root's state replaces it.
    """
    basics.require_init()
    if not optimizer.state_dict()["state"]:
        _create_state(optimizer)
    root = root_position(process_set, root_rank)
    with horovod_errors(), collectives.within(scope_of(process_set)):
        state = collectives.broadcast_object(optimizer.state_dict() if basics.rank() == root_rank else None, root)
    if basics.rank() != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return global rank ``root_rank``'s picklable object on every rank of the set (unpickled:
    peers are trusted, as in :meth:`phalanx.broadcast_object`)."""
    basics.require_init()
    root = root_position(process_set, root_rank)
    with horovod_errors(), collectives.within(scope_of(process_set)):
        return collectives.broadcast_object(obj, root)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return the list of every rank's picklable object, in rank order (unpickled: peers are
    trusted, as in :meth:`phalanx.allgather_object`)."""
    basics.require_init()
    with horovod_errors(), collectives.within(scope_of(process_set)):
        return collectives.allgather_object(obj)


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero gradients where there are none, and one step of the torch optimizer (not the
    distributed one, whose step would wait for the other ranks' gradients)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
    (optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer).step()
