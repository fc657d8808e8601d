"""The alpha-beta cost model of the allreduce algorithms, with alpha and beta measured, not assumed.

A message of n bytes between two ranks takes ``alpha + n * beta``. With p ranks (see
docs/transport.md for the derivations):

* ring: ``2(p-1) alpha + 2 (p-1)/p n beta``
* tree (binomial reduce, then broadcast): ``2 ceil(log2 p) (alpha + n beta)``
* halving-doubling: ``2 ceil(log2 p) alpha + 2 (p-1)/p n beta`` (two more steps of n when p is not a
  power of two)

:func:`measure` times ping-pongs between ranks 0 and 1 of the group: the median half round trip of
a one-element message is alpha, and the extra time of a 4 MiB one per byte is beta. The backend's
own allreduce (Gloo's ring, in C++) gets figures of its own, fitted to the ring's formula from its
times at the same two sizes: its per-step cost is not that of Python-driven messages. Rank 0's
figures are broadcast, so every rank computes the same choice.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

LARGE_BYTES = 4 << 20
ROUNDS = 7


@dataclass(frozen=True)
class Link:
    """Measured per-message latency (s) and per-byte time (s/B) of the group's messages."""

    alpha_s: float
    beta_s_per_byte: float
    #: The backend's own ring, fitted to the ring's formula (``None``: assume the same figures).
    backend: Link | None = None

    @property
    def bandwidth_gbit(self) -> float:
        return 8e-9 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else math.inf


def predict(algorithm: str, nbytes: int, world: int, link: Link) -> float:
    """Predicted seconds of one allreduce of ``nbytes`` over ``world`` ranks."""
    if world <= 1:
        return 0.0
    alpha, beta, steps = link.alpha_s, link.beta_s_per_byte, math.ceil(math.log2(world))
    share = (world - 1) / world * nbytes
    if algorithm == "ring":
        return 2 * (world - 1) * alpha + 2 * share * beta
    if algorithm == "tree":
        return 2 * steps * (alpha + nbytes * beta)
    if algorithm == "halving_doubling":
        fold = 0 if world & (world - 1) == 0 else 2 * (alpha + nbytes * beta)
        return 2 * steps * alpha + 2 * share * beta + fold
    raise ValueError(f"no cost model for {algorithm!r}")


def choose(nbytes: int, world: int, link: Link, algorithms: tuple[str, ...]) -> str:
    """The algorithm with the least predicted time (ties: the earlier one)."""
    return min(algorithms, key=lambda name: predict(name, nbytes, world, link))


#: A phalanx algorithm replaces the backend's own only when predicted this much faster: the
#: figures are medians of a few noisy round trips, and the backend's steps run in C++.
MARGIN = 0.9


def choose_with_backend(nbytes: int, world: int, link: Link) -> str:
    """The cheapest of phalanx's algorithms, with the backend's own ring (the same steps, in C++)
    standing for ``"ring"``: returns ``"backend"``, ``"tree"`` or ``"halving_doubling"``."""
    ours = min(("tree", "halving_doubling"), key=lambda name: predict(name, nbytes, world, link))
    backend = predict("ring", nbytes, world, link.backend or link)
    return ours if predict(ours, nbytes, world, link) < MARGIN * backend else "backend"


def measure(group: dist.ProcessGroup | None) -> Link:
    """Ping-pong between ranks 0 and 1 of ``group`` (collective: every rank calls it)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    figures = torch.zeros(4, dtype=torch.float64)
    if rank < 2 and world > 1:
        small = _round_trip(torch.zeros(1), rank, group)
        large = _round_trip(torch.zeros(LARGE_BYTES // 4), rank, group)
        figures[0], figures[1] = small / 2, max(large / 2 - small / 2, 0.0) / LARGE_BYTES
    if world > 1:  # every rank takes part in the backend's allreduce
        small, large = _backend_time(torch.zeros(1), group), _backend_time(torch.zeros(LARGE_BYTES // 4), group)
        figures[2] = small / (2 * (world - 1))
        figures[3] = max(large - small, 0.0) / (2 * (world - 1) / world * LARGE_BYTES)
    dist.broadcast(figures, _global(group, 0), group=group)
    return Link(float(figures[0]), float(figures[1]), backend=Link(float(figures[2]), float(figures[3])))


def _backend_time(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """The median time of the backend's own allreduce of ``tensor`` over ``group``."""
    times = []
    for _ in range(ROUNDS):
        dist.barrier(group=group)
        started = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _round_trip(tensor: torch.Tensor, rank: int, group: dist.ProcessGroup | None) -> float:
    peer = _global(group, 1 - rank)
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        if rank == 0:
            dist.send(tensor, peer, group=group)
            dist.recv(tensor, peer, group=group)
        else:
            dist.recv(tensor, peer, group=group)
            dist.send(tensor, peer, group=group)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)
