"""Tensors that live once per host: views of one shared-memory segment every worker maps.

Strategies that keep parameters in one place for every worker of a host (central storage, the
sharded strategy's units) move them here: the workers then read the same memory, so a step written
by one rank is seen by all without sending anything.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from phalanx.comm import collectives, runtime

ALIGNMENT = 64  # bytes: each view starts on a cache line


def aligned(offset: int) -> int:
    """``offset`` rounded up to the next cache line."""
    return -(-offset // ALIGNMENT) * ALIGNMENT


def packed_offsets(sizes: Iterable[int], start: int = 0) -> tuple[list[int], int]:
    """Where runs of ``sizes`` bytes lie one after the other from ``start``, each on a cache line (so
    that every run can be viewed as any dtype), and where the last one ends."""
    offsets, end = [], start
    for size in sizes:
        end = aligned(end)
        offsets.append(end)
        end += size
    return offsets, end


def possible(across_hosts: bool = False) -> bool:
    """Whether this job's workers can share host memory: several CPU workers on one host, reducing
    through shared memory (``across_hosts``: or as many on each of several hosts, each host then
    holding its own copy)."""
    if runtime.size() == 1 or runtime.device().type != "cpu":
        return False
    return runtime.shares_one_host() or (across_hosts and runtime.shm_executor() is not None)


def hosts() -> list[list[int]]:
    """The job's ranks on each host, each host's in local order (one host: every rank)."""
    executor = runtime.shm_executor()
    return executor.group.hosts if executor is not None else [list(range(runtime.size()))]


def first_of_host() -> int:
    """The rank of this host's first worker (which writes what :func:`shared_copies` starts from)."""
    return next(ranks[0] for ranks in hosts() if runtime.rank() in ranks)


def shared_copies(tensors: Sequence[torch.Tensor], writer: int, tag: str) -> list[torch.Tensor]:
    """One view per tensor of a segment every worker of this host maps, holding ``writer``'s values
    (a rank of this host; each host of several maps its own segment).

    Collective: every rank passes tensors of the same shapes and dtypes, in the same order.
    """
    offsets, end = packed_offsets(t.numel() * t.element_size() for t in tensors)
    arena = runtime.host_arena(tag, end)
    views = [arena[start: start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
             for start, t in zip(offsets, tensors)]
    if runtime.rank() == writer:
        for view, tensor in zip(views, tensors):
            view.copy_(tensor.detach())
    collectives.barrier()
    return views
