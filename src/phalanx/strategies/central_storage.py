"""Central storage: the optimizer state in one place, the parameters on every worker.

Every worker computes gradients as with ``px.DataParallel``; the engine's buckets are *reduced*
onto the storage rank (not all-reduced), which applies the user's optimizer and broadcasts the
new parameters. Optimizer state (Adam's two moments: twice the model) exists on the storage
rank only; the result equals data-parallel training up to float rounding.

When every worker is on one host and reduces through shared memory, the parameters themselves
live once, in a shared segment every worker maps: the storage rank steps them in place between
two barriers, and nothing is broadcast.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.comm import collectives, runtime
from phalanx.errors import ConfigurationError
from phalanx.parallel.buckets import Bucket
from phalanx.parallel.data_parallel import DataParallel
from phalanx.parallel.reductions import Reduction, Waitable
from phalanx.strategies.base import (
    FitOptions,
    Strategy,
    refuse,
    refuse_parameter_servers_launched,
    refuse_without_replicas,
    wrap,
)
from phalanx.strategies import host_memory
from phalanx.strategies.held import HeldOptimizer


class ReduceToStorage(Reduction):
    """Sum every bucket onto the storage rank only; the other ranks' buckets keep their own part."""

    name = "reduce to storage"

    def __init__(self, storage: int):
        self.storage = storage

    def reduce(self, bucket: Bucket) -> Waitable:
        return collectives.reduce_(bucket.flat, root=self.storage, async_op=True, check=False)


class StoredOptimizer(HeldOptimizer):
    """The user's optimizer, stepped on the storage rank only; ``step()`` then broadcasts the parameters.

    Elsewhere it keeps the hyperparameters (learning-rate schedules set them on every rank) and an
    empty ``state``.
    """

    strategy = "px.CentralStorage"

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], storage: int,
                 shared: bool = False):
        super().__init__(optimizer)
        self.params = params
        self.storage = storage
        self.shared = shared  # the parameters live once per host, in shared memory

    @property
    def is_storage(self) -> bool:
        return runtime.rank() == self.storage

    def _step(self) -> None:
        """The storage rank steps; every rank then receives its parameters (one broadcast per dtype,
        or, in shared memory, nothing: the others wait while the storage rank writes)."""
        if self.shared:
            collectives.barrier()  # nobody reads the parameters while they change
        if self.is_storage:
            self.optimizer.step()
        if self.shared:
            collectives.barrier()
            return
        with torch.no_grad():
            collectives.broadcast_tensors_([p.data for p in self.params], root=self.storage)

    def state_dict(self) -> dict[str, Any]:
        """The full state on the storage rank; hyperparameters only elsewhere."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The storage rank takes the whole state; the others only the hyperparameters."""
        self.optimizer.load_state_dict(state_dict if self.is_storage else {**state_dict, "state": {}})


def _refuse_elastic() -> None:
    refuse("px.CentralStorage", "an elastic job", "the optimizer state lives on one rank, which an elastic job could "
           "lose; use px.DataParallel or px.ParameterServer with --min-workers.")


class CentralStorage(Strategy):
    """``px.fit(..., strategy=px.CentralStorage())``: the optimizer state on one rank only.

    ``rank`` is the storage rank (default 0); checkpoints need it to be 0, the rank that writes them.
    ``shared_memory``: ``"auto"`` keeps the parameters once, in shared memory, when every worker is
    on this host and the transport uses shared memory; ``False`` gives each worker its copy.
    """

    name = "px.CentralStorage"
    asynchronous = False
    nonfinite_agreement = "collective"  # each rank holds its own part of the gradient

    def check(self, options: FitOptions) -> None:
        """Refuse what keeping the optimizer state on one rank cannot do, naming the pair."""
        refuse_parameter_servers_launched("px.CentralStorage")
        if options.elastic:
            _refuse_elastic()
        refuse_without_replicas("px.CentralStorage", "on one rank", options)
        if self.rank != 0 and options.checkpoint_dir is not None:
            refuse(f"px.CentralStorage(rank={self.rank})", "checkpoint_dir", "checkpoints are written by rank 0, "
                   "so use CentralStorage(rank=0).")

    def __init__(self, rank: int = 0, shared_memory: bool | str = "auto"):
        if rank < 0:
            raise ConfigurationError(f"CentralStorage(rank=...) must be a worker's rank, got {rank}.")
        if shared_memory not in ("auto", True, False):
            raise ConfigurationError(f"CentralStorage(shared_memory=...) must be 'auto', True or False, "
                                     f"got {shared_memory!r}.")
        self.rank = rank
        self.shared_memory = shared_memory

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[DataParallel, StoredOptimizer]:
        """Wrap ``model`` and ``optimizer`` for this worker (refused in an elastic launch, as ``check``
        refuses it for px.fit: a loop of one's own does not call ``check``)."""
        if runtime.is_elastic():
            _refuse_elastic()
        if self.rank >= runtime.size():
            raise ConfigurationError(f"CentralStorage(rank={self.rank}) but the job has {runtime.size()} worker(s).")
        wrapped = wrap(model)
        wrapped.rebuild_reducer(reduction=ReduceToStorage(self.rank))
        params = list(wrapped.parameters())
        shared = self._share_parameters() and bool(params)
        if shared:  # every rank's parameters become views of one host-wide segment, filled by the storage rank
            for param, view in zip(params, host_memory.shared_copies(params, self.rank, "params")):
                param.data = view
        return wrapped, StoredOptimizer(optimizer, params, self.rank, shared)

    def _share_parameters(self) -> bool:
        possible = host_memory.possible()
        if self.shared_memory is True and not possible:
            raise ConfigurationError("CentralStorage(shared_memory=True) needs several CPU workers on one host "
                                     "with px.init(transport='auto' or 'shm'); use shared_memory='auto'.")
        return possible and self.shared_memory is not False
