"""What one worker holds in tensors during a doctor session, counted as benchmarks/bench_shard.py counts.

Tensor bytes, not the resident size: glibc keeps memory a process freed, so RSS says more about
the allocator's history than about what training holds (docs/doctor.md). Each storage counts once,
in the first kind it belongs to (a gradient that is a view of a bucket counts with the bucket); a
storage in memory every worker of the host maps (px.Sharded's units on one host) counts for its
share, 1 / the workers of the host.

* parameters: those the user's optimizer steps (the model's that train) and, under px.Sharded, the
  rank's chunks (the optimizer that torch's hooks see stepping is the one over them; a chunk's
  storage is its unit's where the chunk is a view of it);
* gradients: theirs and the gradient buckets of the px.DataParallel models (those the session's
  probes are part of, and px.Sharded's);
* optimizer state: the stepped optimizer's (px.Sharded: its chunks' state);
* strategy: what the strategy keeps beside those (``HeldOptimizer.held_beside``): px.LocalSGD's
  exchange buffers, px.DiLoCo's too and its outer parameters and outer optimizer's state;
* activations: the tensors autograd saves for backward during a training forward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters left out, each storage once and a view
  of a larger storage (a batch sliced from the dataset) for its own elements; of several forwards in
  one step (accumulation), the largest.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch
from torch import nn

from phalanx.comm import runtime
from phalanx.parallel.data_parallel import DataParallel
from phalanx.parallel.reductions import Reduction
from phalanx.strategies.held import HeldOptimizer
from phalanx.strategies.sharded import ShardedOptimizer

logger = logging.getLogger(__name__)

T = TypeVar("T")


def held(optimizer: torch.optim.Optimizer, models: Iterable[DataParallel]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """This worker's parameters, gradients and optimizer state in bytes (its share of shared memory),
    with what the predictions need (the model's trained bytes and parameters, the sharding level,
    whether the units are in host shared memory); and the parameters (the model's and the chunks).
    ``optimizer`` is the one the training steps; the gradient buckets of ``models`` count (and of
    px.Sharded's model, found through its optimizer)."""
    sharded = _referring(optimizer, ShardedOptimizer, lambda owner: owner.stepping is optimizer)
    held_by = sharded or _referring(optimizer, HeldOptimizer, lambda owner: owner.optimizer is optimizer)
    trained = [p for group in (sharded.optimizer if sharded else optimizer).param_groups for p in group["params"]]
    params = trained + ([p for group in optimizer.param_groups for p in group["params"]] if sharded else [])
    engines = {id(model): model for model in models if model.reducer is not None}
    if sharded is not None and sharded.model.reducer is not None:
        engines[id(sharded.model)] = sharded.model
    grads: list[Any] = [p.grad for p in params]
    grads += [flat for model in engines.values() for flat in model.reducer.gradient_buffers]
    state = [value for entry in optimizer.state.values() for value in entry.values()]
    shared, share = shared_ranges(), 1 / (runtime.local_size() if runtime.is_initialized() else 1)
    counted: dict[int, int] = {}
    found: dict[str, Any] = {}
    beside = held_by.held_beside() if held_by is not None else []
    for kind, tensors in (("parameters", params), ("gradients", grads), ("optimizer_state", state),
                          ("strategy", beside)):
        mine = {ptr: n for ptr, n in _storages(tensors).items() if ptr not in counted}
        counted.update(mine)
        found[kind] = sum(n * (share if _within(ptr, shared) else 1) for ptr, n in mine.items())
    trained = [p for p in trained if p.requires_grad]  # their shapes stay where level 3 frees their memory
    found.update(trained_bytes=sum(p.numel() * p.element_size() for p in trained),
                 parameter_count=sum(p.numel() for p in trained),
                 level=sharded.level if sharded is not None else 0,
                 shared=bool(sharded is not None and sharded.shared))
    return found, params


def models_of(reductions: Iterable[Reduction]) -> list[DataParallel]:
    """The px.DataParallel models whose reduction is one of ``reductions`` (the session's probes)."""
    found = {id(model): model for reduction in reductions
             for model in [_referring(reduction, DataParallel, lambda owner: True)] if model is not None}
    return list(found.values())


class Activations:
    """Bytes autograd saves for backward during training forwards, counted between :meth:`start` and
    :meth:`stop` (a saved-tensor hook that records and hands the tensor back unchanged)."""

    def __init__(self) -> None:
        self._hooks: Any = None
        self._parameters: list[torch.Tensor] = []
        self._exclude: set[int] = set()  # addresses of the parameters' storages, as last looked up
        self._kept: set[int] = set()  # addresses found not to be a parameter's
        self._views: dict[int, set[tuple[int, int]]] = {}  # storage -> (offset, bytes) of each view saved
        self._sizes: dict[int, int] = {}
        self._samples = 0
        self.largest: tuple[int, int] = (0, 0)  # (bytes, samples) of the largest forward so far

    @property
    def on(self) -> bool:
        return self._hooks is not None

    def start(self, parameters: Sequence[torch.Tensor]) -> None:
        """Count from now, leaving out tensors that live in ``parameters``' storages (level 3 gathers
        them into new memory during the forward, so their addresses are looked up as tensors come)."""
        self._parameters = list(parameters)
        self._exclude = set(_storages(self._parameters))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def forward(self, samples: int) -> None:
        """A training forward of ``samples`` samples begins: close the previous one's count."""
        self._close()
        self._samples = samples

    def stop(self) -> tuple[int, int]:
        """Stop counting; the largest forward's bytes and its samples."""
        self._close()
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        self._parameters, self._exclude = [], set()
        return self.largest

    def _close(self) -> None:
        total = sum(min(sum(size for _, size in views), self._sizes[ptr]) for ptr, views in self._views.items())
        if total > self.largest[0]:
            self.largest = (total, self._samples)
        self._views.clear()
        self._kept.clear()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, a wrapper subclass)
            return tensor
        if isinstance(tensor, nn.Parameter) or not storage.nbytes() or self._is_parameter(ptr):
            return tensor
        self._sizes[ptr] = storage.nbytes()
        self._views.setdefault(ptr, set()).add(
            (tensor.storage_offset(), _extent(tensor) * tensor.element_size()))
        return tensor

    def _is_parameter(self, ptr: int) -> bool:
        if ptr not in self._exclude and ptr not in self._kept:
            self._exclude = set(_storages(self._parameters))
            if ptr not in self._exclude:
                self._kept.add(ptr)
        return ptr in self._exclude


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _extent(tensor: torch.Tensor) -> int:
    """Elements of storage a view spans (its own elements where it is contiguous)."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))


def _referring(target: Any, kind: type[T], accept: Callable[[T], bool]) -> T | None:
    """An object of ``kind`` that refers to ``target`` (directly or through its ``__dict__``) and
    that ``accept`` takes, if any.

    Found among the objects that refer to ``target``: a scan of every object (``gc.get_objects``)
    would hold a reference to a tuple another thread is still building (the loader's prefetch),
    which then fails to resize.
    """
    for referrer in gc.get_referrers(target):
        owners = gc.get_referrers(referrer) if isinstance(referrer, dict) else [referrer]
        for owner in owners:
            if isinstance(owner, kind) and accept(owner):
                return owner
    return None


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    """Address -> bytes of each distinct storage that holds memory."""
    found: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None or not torch.is_tensor(tensor):
            continue
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def shared_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's shared mappings (Linux; elsewhere none is known)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, perms = line.split()[:2]
                if perms[3] == "s":
                    low, high = span.split("-")
                    ranges.append((int(low, 16), int(high, 16)))
    except OSError:
        logger.debug("doctor: /proc/self/maps unreadable; shared memory counted whole")
    return ranges


def _within(ptr: int, ranges: list[tuple[int, int]]) -> bool:
    return any(low <= ptr < high for low, high in ranges)
