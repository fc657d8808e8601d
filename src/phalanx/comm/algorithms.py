"""Collective algorithms of phalanx's own, over ``torch.distributed`` point-to-point messages.

``torch.distributed`` offers no per-call choice of algorithm (Gloo always runs its ring; NCCL
chooses internally), so these are built from ``isend``/``irecv``:

* ``ring``: reduce-scatter then allgather around a ring, ``2(p-1)`` steps of ``n/p`` elements;
  bandwidth-optimal, latency grows with ``p``.
* ``tree``: reduce up a binomial tree to rank 0, broadcast back down; ``2 log2 p`` steps of the
  whole tensor: few messages, for small tensors.
* ``halving_doubling``: recursive halving reduce-scatter, recursive doubling allgather
  (Rabenseifner); ``2 log2 p`` steps moving ``2 n (p-1)/p`` elements in all. A world that is not
  a power of two first folds its extra ranks into partners and hands them the result at the end.

Every rank ends with the same bits: each element is combined on one rank, in one order, and
copied to the others. Each function reduces a flat, contiguous CPU tensor in place.

Besides the allreduces, one-round exchanges (:func:`post_exchange`): a reduce-scatter
(:class:`ReduceScatterExchange`: the shared-memory reduce-scatter's step between hosts, and px's CPU
reduce-scatter without shared memory) and px's CPU allgather without shared memory. Gloo's
reduce-scatter moves an allreduce's bytes, and its allgather leaves a link idle between steps.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

Combine = Callable[[torch.Tensor, torch.Tensor], None]

ALGORITHMS = ("ring", "tree", "halving_doubling")

#: The backend's operation for each op name ("avg" is summed, then divided: Gloo has no average).
BACKEND_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
               "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}


def combiner(op: str) -> Combine:
    """``into <- into (op) other``, elementwise and in place."""
    if op in ("sum", "avg"):
        return lambda into, other: into.add_(other)
    if op == "product":
        return lambda into, other: into.mul_(other)
    if op == "min":
        return lambda into, other: torch.minimum(into, other, out=into)
    return lambda into, other: torch.maximum(into, other, out=into)


def combiner_into(op: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """``out <- a (op) b``: one pass instead of a copy and a combine."""
    function = {"sum": torch.add, "avg": torch.add, "product": torch.mul, "min": torch.minimum,
                "max": torch.maximum}[op]
    return lambda a, b, out: function(a, b, out=out)


def allreduce(flat: torch.Tensor, op: str, algorithm: str, group: dist.ProcessGroup | None) -> None:
    """Reduce ``flat`` (1-D, contiguous) over ``group`` in place with ``algorithm``."""
    size = dist.get_world_size(group)
    if size == 1 or flat.numel() == 0:
        return
    run = {"ring": _ring, "tree": _tree, "halving_doubling": _halving_doubling}[algorithm]
    run(flat, combiner(op), dist.get_rank(group), size, group)


def reduce_scatter(chunks: Sequence[torch.Tensor], op: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Reduce each of ``chunks`` (one per rank of ``group``, 1-D) over the group and return this
    rank's, reduced (a new tensor; ``chunks`` are only read): one exchange (:class:`ReduceScatterExchange`),
    a reduce-scatter's bytes (Gloo's reduce-scatter moves those of a whole allreduce)."""
    rank = dist.get_rank(group)
    exchange = ReduceScatterExchange(chunks, rank)
    for work in exchange.post(group):
        work.wait()
    return exchange.reduce(op, torch.empty_like(chunks[rank]))


class ReduceScatterExchange:
    """A reduce-scatter as one exchange: chunk ``r`` of ``chunks`` goes to rank ``r``, and every other
    rank's chunk ``rank`` arrives here; once the posted works are done, :meth:`reduce` combines
    them with this rank's own in rank order (the same order, so the same bits, whatever arrived first)."""

    def __init__(self, chunks: Sequence[torch.Tensor], rank: int):
        self.chunks, self.rank = chunks, rank
        self.arrived = [None if r == rank else torch.empty_like(chunks[rank]) for r in range(len(chunks))]

    def post(self, group: dist.ProcessGroup | None, tag: int = 0) -> list[dist.Work]:
        sends = [None if r == self.rank else chunk for r, chunk in enumerate(self.chunks)]
        return post_exchange(sends, self.arrived, group, tag)

    def reduce(self, op: str, out: torch.Tensor) -> torch.Tensor:
        """This rank's chunk reduced with the arrived ones into ``out`` (after the works are done)."""
        pieces = [self.chunks[r] if piece is None else piece for r, piece in enumerate(self.arrived)]
        if len(pieces) == 1:
            return out.copy_(pieces[0])
        combiner_into(op)(pieces[0], pieces[1], out)
        combine = combiner(op)
        for piece in pieces[2:]:
            combine(out, piece)
        return out


class MessageGroup:
    """Phalanx's algorithms over a Gloo group of their own, for :class:`~phalanx.comm.ordered.OrderedExecutor`.

    The group is used by the executor's thread only, so an algorithm can run beside backward
    while the main thread's collectives use the default group (a Gloo group must not be driven
    from two threads). Every wait is bounded by the group's timeout.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def allreduce_(self, flat: torch.Tensor, op: str, algorithm: str) -> None:
        """``flat`` reduced over the group with ``algorithm``, in place."""
        allreduce(flat, op, algorithm, self.group)

    def abort(self) -> None:
        """Nothing to interrupt: a wait ends with the group's timeout or a peer's closed socket."""

    def close(self) -> None:
        """The group goes with the default group it was created beside."""


def _exchange(send: torch.Tensor | None, to: int, receive: torch.Tensor | None, source: int,
              group: dist.ProcessGroup | None) -> None:
    """Send and receive at once (either may be empty or absent); wait for both."""
    for work in _post(send, to, receive, source, group):
        work.wait()


def _post(send: torch.Tensor | None, to: int, receive: torch.Tensor | None, source: int,
          group: dist.ProcessGroup | None, tag: int = 0) -> list[dist.Work]:
    """Post a receive from ``source`` and a send to ``to`` (ranks of ``group``; empty or absent ones skipped)."""
    works = []
    if receive is not None and receive.numel():
        works.append(dist.irecv(receive, _global(group, source), group=group, tag=tag))
    if send is not None and send.numel():
        works.append(dist.isend(send, _global(group, to), group=group, tag=tag))
    return works


def _pass_around(pieces: Sequence[torch.Tensor], first: int, right: int, left: int,
                 group: dist.ProcessGroup | None) -> None:
    """Every piece to every rank around the ring: each rank holds piece ``first`` complete, sends it
    right and receives the one before it from the left, then passes that one on, ``p - 1`` times."""
    size = len(pieces)
    for step in range(size - 1):
        _exchange(pieces[(first - step) % size], right, pieces[(first - step - 1) % size], left, group)


def post_exchange(sends: Sequence[torch.Tensor | None], receives: Sequence[torch.Tensor | None],
                  group: dist.ProcessGroup | None, tag: int = 0) -> list[dist.Work]:
    """Post at once a send of ``sends[r]`` to and a receive into ``receives[r]`` from every other rank
    ``r`` of ``group`` (empty or absent ones skipped) and return the works; the caller waits for them.
    Each rank sends to rank ``r`` what only ``r`` needs, so an exchange moves what a ring does, but
    in one round: a link stays busy (Gloo's alltoall and allgather leave it idle between steps)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    works = []
    for step in range(1, size):  # staggered, so that no rank is everyone's first peer
        to, source = (rank + step) % size, (rank - step) % size
        works += _post(sends[to], to, receives[source], source, group, tag)
    return works


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


def _ring(flat: torch.Tensor, combine: Combine, rank: int, size: int, group: dist.ProcessGroup | None) -> None:
    chunks = flat.tensor_split(size)
    right, left = (rank + 1) % size, (rank - 1) % size
    scratch = torch.empty_like(chunks[0])
    for step in range(size - 1):  # reduce-scatter: chunk (rank + 1) ends complete here
        sending, receiving = chunks[(rank - step) % size], chunks[(rank - step - 1) % size]
        incoming = scratch[: receiving.numel()]
        _exchange(sending, right, incoming, left, group)
        combine(receiving, incoming)
    _pass_around(chunks, rank + 1, right, left, group)  # allgather: the complete chunks


def _tree(flat: torch.Tensor, combine: Combine, rank: int, size: int, group: dist.ProcessGroup | None) -> None:
    scratch = torch.empty_like(flat)
    mask = 1
    while mask < size:  # reduce up a binomial tree to rank 0
        if rank & mask:
            _exchange(flat, rank - mask, None, 0, group)
            break
        if rank + mask < size:
            _exchange(None, 0, scratch, rank + mask, group)
            combine(flat, scratch)
        mask <<= 1
    mask = 1 << max(size - 1, 1).bit_length()
    while mask > 1:  # broadcast back down the same tree
        mask >>= 1
        if rank % (2 * mask) == 0 and rank + mask < size:
            _exchange(flat, rank + mask, None, 0, group)
        elif rank % (2 * mask) == mask:
            _exchange(None, 0, flat, rank - mask, group)


def _halving_doubling(flat: torch.Tensor, combine: Combine, rank: int, size: int,
                      group: dist.ProcessGroup | None) -> None:
    power = 1 << (size.bit_length() - 1)  # the largest power of two <= size
    extra = size - power
    # Fold: the first 2 * extra ranks pair up; even ones hand their tensor to the odd one and wait.
    if rank < 2 * extra:
        if rank % 2 == 0:
            _exchange(flat, rank + 1, None, 0, group)
            _exchange(None, 0, flat, rank + 1, group)
            return
        scratch = torch.empty_like(flat)
        _exchange(None, 0, scratch, rank - 1, group)
        combine(flat, scratch)
    virtual = rank // 2 if rank < 2 * extra else rank - extra

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    ranges = _halve(flat, virtual, power, combine, real, group)
    for (low, high, keep_low), distance in zip(reversed(ranges), _distances(power, ascending=True)):
        partner = real(virtual ^ distance)
        middle = low + (high - low) // 2
        mine, theirs = (flat[low:middle], flat[middle:high]) if keep_low else (flat[middle:high], flat[low:middle])
        _exchange(mine, partner, theirs, partner, group)
    if rank < 2 * extra:  # the odd partner hands the result back
        _exchange(flat, rank - 1, None, 0, group)


def _halve(flat: torch.Tensor, virtual: int, power: int, combine: Combine, real: Callable[[int], int],
           group: dist.ProcessGroup | None) -> list[tuple[int, int, bool]]:
    """Recursive halving: each step keeps half of the range and reduces it with the partner's copy."""
    low, high, ranges = 0, flat.numel(), []
    scratch = torch.empty_like(flat)
    for distance in _distances(power, ascending=False):
        partner = real(virtual ^ distance)
        middle = low + (high - low) // 2
        keep_low = (virtual & distance) == 0
        (keep, send) = ((low, middle), (middle, high)) if keep_low else ((middle, high), (low, middle))
        incoming = scratch[: keep[1] - keep[0]]
        _exchange(flat[send[0]:send[1]], partner, incoming, partner, group)
        combine(flat[keep[0]:keep[1]], incoming)
        ranges.append((low, high, keep_low))
        low, high = keep
    return ranges


def _distances(power: int, ascending: bool) -> list[int]:
    distances = [1 << k for k in range(power.bit_length() - 1)]
    return distances if ascending else distances[::-1]
