"""``hvd.elastic``: Horovod's elastic API on phalanx's elastic runtime (:mod:`phalanx.elastic`).

``TorchState`` and ``ObjectState`` are ``px.elastic.State``s: ``commit()`` copies the model,
optimizer, samplers and values into memory and raises ``HostsUpdatedInterrupt`` when workers
join or leave at this boundary; ``run`` re-forms the group after a lost worker (a collective
raised ``HorovodInternalError``) or a membership change, synchronises and restores the last
commit, calls the reset callbacks and calls the function again. Launch with
``phalanx run -np N --min-workers K script.py`` (see docs/elastic.md).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Sequence, Sized, TypeVar

import torch

from phalanx import elastic as px_elastic
from phalanx.comm import runtime
from phalanx.elastic.state import MembershipChanged, _check_membership
from phalanx.horovod.torch import basics, process_sets
from phalanx.horovod.torch.exceptions import HorovodInternalError, HostsUpdatedInterrupt

T = TypeVar("T")

__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "TorchState", "run"]


class ObjectState(px_elastic.State):
    """Plain values (``ObjectState(epoch=0, batch=0)``) committed and restored together.

    ``bcast_object`` and ``get_rank`` are accepted for Horovod's signature; the state travels
    through phalanx's own synchronisation.
    """

    def __init__(self, bcast_object: Callable[..., Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any):
        object.__setattr__(self, "_reset_callbacks", [])
        super().__init__(verbose=False, **kwargs)

    def commit(self) -> None:
        """Copy everything into memory; raise ``HostsUpdatedInterrupt`` when workers join or leave here."""
        try:
            super().commit()
        except HostsUpdatedInterrupt:
            raise
        except MembershipChanged as change:
            raise HostsUpdatedInterrupt(change.reason) from change

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` when the group changes at the next commit boundary."""
        if runtime.is_elastic():
            try:
                _check_membership(self.version)
            except MembershipChanged as change:
                raise HostsUpdatedInterrupt(change.reason) from change

    def register_reset_callbacks(self, callbacks: Sequence[Callable[[], None]]) -> None:
        """Call ``callbacks`` after every reset (the group re-formed, the state restored)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (``run`` calls it before calling the function again)."""
        for callback in self._reset_callbacks:
            callback()


class TorchState(ObjectState):
    """``TorchState(model=model, optimizer=optimizer, epoch=0, batch=0, sampler=sampler)``.

    Objects with ``state_dict``/``load_state_dict`` (model, optimizer, samplers, schedulers) and
    plain values, as attributes: ``state.epoch``, ``state.model``.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any):
        entries = {name: value for name, value in (("model", model), ("optimizer", optimizer)) if value is not None}
        super().__init__(**entries, **kwargs)


def run(func: Callable[..., T]) -> Callable[..., T | None]:
    """Wrap ``func(state, ...)`` so that it survives lost workers and admits new ones.

    Each generation of the job after a reset starts Horovod afresh before the call (on every member
    alike, joiners included): the process-level answers (size, cross rank) are agreed anew, the
    process sets are the global one alone (the others' groups belonged to the old group; whether
    sets may be added is kept) and a new negotiation runs; then ``state.on_reset()`` runs first.
    """

    @functools.wraps(func)
    def wrapper(state: ObjectState, *args: Any, **kwargs: Any) -> T | None:
        calls = 0
        dynamic = process_sets.allows_dynamic()

        def attempt(state: ObjectState, *args: Any, **kwargs: Any) -> T:
            nonlocal calls
            basics.begin_generation(dynamic)  # a no-op on the generation hvd.init began
            if calls:
                state.on_reset()
            calls += 1
            return func(state, *args, **kwargs)

        return px_elastic.run(attempt)(state, *args, **kwargs)

    return wrapper


class ElasticSampler(torch.utils.data.Sampler):
    """Shares a dataset among the ranks, remembers what was processed this epoch, and after a
    reset shares the rest among the new set of ranks.

    Every rank runs the same batches in lockstep, so ``record_batch(batch_idx, batch_size)``
    marks that batch of every rank processed without communicating. Put the sampler in the
    ``TorchState`` so that it is committed and restored with the model.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.rank, self.num_replicas = basics.rank(), basics.size()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order, nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` (of ``batch_size`` samples per rank) processed on every rank."""
        for replica in range(self.num_replicas):
            self.processed_indices.update(self._padded[replica::self.num_replicas][
                batch_idx * batch_size:(batch_idx + 1) * batch_size])

    def record_indices(self, indices: Sequence[int]) -> None:
        """Mark these dataset indices processed."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's indices of batch ``batch_idx``."""
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def reset(self) -> None:
        """Share what is left of this epoch among the current ranks (padded to equal shares)."""
        if self.shuffle:
            order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(len(self.dataset))
        remaining = [i for i in order.tolist() if i not in self.processed_indices]
        self.num_samples = -(-len(remaining) // self.num_replicas) if remaining else 0
        padding = self.num_samples * self.num_replicas - len(remaining)
        self._padded = remaining + remaining[:padding]
        self.indices = self._padded[self.rank::self.num_replicas]

    def reshard(self, rank: int, world_size: int) -> None:
        """The group changed: this rank's place in it (the protocol of ``px.elastic.State``)."""
        self.rank, self.num_replicas = rank, world_size
        self.reset()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
