"""Central storage: the optimizer state in one place, the parameters on every worker.

Every worker computes gradients as with ``px.DataParallel``; the engine's buckets are *reduced*
onto the storage rank (not all-reduced), which applies the user's optimizer and broadcasts the
new parameters. Optimizer state (Adam's two moments: twice the model) exists on the storage
rank only; the result equals data-parallel training up to float rounding.
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

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], storage: int):
        super().__init__(optimizer)
        self.params = params
        self.storage = storage

    @property
    def is_storage(self) -> bool:
        return runtime.rank() == self.storage

    def _step(self) -> None:
        """The storage rank steps; every rank then receives its parameters (one broadcast per dtype)."""
        if self.is_storage:
            self.optimizer.step()
        with torch.no_grad():
            collectives.broadcast_tensors_([p.data for p in self.params], root=self.storage)

    def state_dict(self) -> dict[str, Any]:
        """The full state on the storage rank; hyperparameters only elsewhere."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The storage rank takes the whole state; the others only the hyperparameters."""
        self.optimizer.load_state_dict(state_dict if self.is_storage else {**state_dict, "state": {}})


class CentralStorage:
    """``px.fit(..., strategy=px.CentralStorage())``: the optimizer state on one rank only.

    ``rank`` is the storage rank (default 0); checkpoints need it to be 0, the rank that writes them.
    """

    asynchronous = False

    def __init__(self, rank: int = 0):
        if rank < 0:
            raise ConfigurationError(f"CentralStorage(rank=...) must be a worker's rank, got {rank}.")
        self.rank = rank

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[DataParallel, StoredOptimizer]:
        """Wrap ``model`` and ``optimizer`` for this worker."""
        if self.rank >= runtime.size():
            raise ConfigurationError(f"CentralStorage(rank={self.rank}) but the job has {runtime.size()} worker(s).")
        wrapped = model if isinstance(model, DataParallel) else DataParallel(model.to(runtime.device()))
        wrapped.use_reduction(ReduceToStorage(self.rank))
        return wrapped, StoredOptimizer(optimizer, list(wrapped.parameters()), self.rank)

    def finish(self, history: dict[str, Any] | None = None) -> None:
        """Nothing to tear down."""

    def close(self) -> None:
        """Nothing to tear down."""
