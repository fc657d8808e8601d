"""The collectives as functions over the current generation: ``px.allreduce(t)`` is
``px.communicator().allreduce(t)``.

What each does, the cross-rank checks and the async handles are documented on the methods
(:class:`~phalanx.comm.operations.Collectives`). These functions look the communicator up at every
call, so code that uses them follows an elastic job from generation to generation by itself.
"""

from __future__ import annotations

import functools
from typing import Callable, Concatenate, ParamSpec, TypeVar

from phalanx.comm import cost, runtime
from phalanx.comm.handles import Handle, then
from phalanx.comm.operations import Collectives
from phalanx.comm.routing import ALLREDUCE_ALGORITHMS, REDUCE_OPS
from phalanx.comm.scopes import Scope

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "ALLREDUCE_ALGORITHMS", "REDUCE_OPS", "Handle", "Scope", "allgather", "allgather_object", "allreduce",
    "allreduce_", "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_object", "broadcast_tensors_",
    "host_barrier", "join", "link", "measure_link", "reduce", "reduce_", "reduce_scatter", "then", "within",
]


def _on_current(method: Callable[Concatenate[Collectives, P], R]) -> Callable[P, R]:
    """``method`` of whichever communicator is current when the function is called (before
    ``px.init``: a world of one, where every collective completes at once)."""
    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        return method(runtime.communicator_or_alone(), *args, **kwargs)
    return call


allreduce = _on_current(Collectives.allreduce)
allreduce_ = _on_current(Collectives.allreduce_)
broadcast = _on_current(Collectives.broadcast)
broadcast_ = _on_current(Collectives.broadcast_)
broadcast_tensors_ = _on_current(Collectives.broadcast_tensors_)
reduce = _on_current(Collectives.reduce)
reduce_ = _on_current(Collectives.reduce_)
allgather = _on_current(Collectives.allgather)
reduce_scatter = _on_current(Collectives.reduce_scatter)
alltoall = _on_current(Collectives.alltoall)
barrier = _on_current(Collectives.barrier)
host_barrier = _on_current(Collectives.host_barrier)
broadcast_object = _on_current(Collectives.broadcast_object)
allgather_object = _on_current(Collectives.allgather_object)
join = _on_current(Collectives.join)
measure_link = _on_current(Collectives.measure_link)
within = _on_current(Collectives.within)


def link() -> cost.Link | None:
    """The measured link of the CPU group, once ``algorithm="auto"`` needed it (or :func:`measure_link`)."""
    return runtime.communicator().link() if runtime.is_initialized() else None

