"""px.Sharded's committed shards: a lost worker's shards rebuilt with no disk read.

No worker holds another's chunks of the weights and the optimizer state, so an elastic commit of a
sharded run keeps a copy of each rank's chunks somewhere a death does not take them, in one of two
*slots* (the commit's version modulo 2): the other slot keeps ``v - 1`` whole for the survivors of a
death during the commit of ``v`` (they restore ``v - 1``).

* :class:`HostCopies`, every worker on one host: one shared-memory segment per generation, in which
  each rank writes its chunks and stamps its slot with the version; a barrier ends the commit, so a
  worker whose commit of ``v`` completed knows every rank's slot for ``v`` is whole. The segment
  outlives any worker of the host: the survivors read every old rank's chunks from it, the dead
  ones' too. Cost: ``2 * (weights + state) / workers`` per worker (6 bytes a parameter for Adam in
  float32 at 4 workers), one copy of the chunks and a barrier per commit.
* :class:`BuddyCopies`, workers on several hosts (or without shared memory): each rank keeps its
  chunks in its own memory and sends them to its *buddy*, the next rank on another host in a ring
  that visits every host before it visits a host again (the next rank, on one host), which keeps
  them too. A worker's chunks survive unless it and its buddy die together; a whole host's loss
  costs nothing, since every buddy is on another host wherever there is one. Cost: ``4 * (weights +
  state) / workers`` per worker (its own two slots and its ward's) where hosts run as many workers
  each; a worker of a smaller host is the buddy of several and keeps each one's chunks. Each commit
  sends one rank's chunks over the network (an alltoall in which each rank sends only to its buddy).

:class:`Copies` keeps each generation's commits the way its shape allows (a job formed on one host
that workers on other hosts join moves to buddies at its next commit). After a re-form
:func:`rebuild` finds, for every old rank, a survivor that holds its chunks of the
agreed version, and every rank keeps its new chunks of each unit, assembled from those holders.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from phalanx import faults
from phalanx.comm import collectives, runtime
from phalanx.errors import PhalanxError
from phalanx.strategies import host_memory
from phalanx.strategies.shard_layout import Unit

logger = logging.getLogger(__name__)

WEIGHTS = "weights"  # the entry of a unit's chunk of the parameters; the others are optimizer state keys


@dataclass(frozen=True)
class Entry:
    """One tensor of a unit that each rank copies its part of: ``lengths`` per rank, in rank order
    (a scalar of the optimizer state, the same on every rank, has length 1 everywhere)."""

    unit: int
    key: str
    dtype: torch.dtype
    lengths: tuple[int, ...]
    params: tuple[tuple[int, int], ...]  # the unit's parameters: (position among the model's, elements)
    scalar: bool = False


@dataclass
class Segment:
    """One generation's copies: the entries, where each rank's part of each lies in each slot, and
    the slots' version stamps (``stamps[slot, rank]``)."""

    entries: list[Entry]
    arena: torch.Tensor
    stamps: torch.Tensor
    offsets: dict[tuple[int, int, int], int]  # (slot, rank, entry index) -> byte offset

    def part(self, slot: int, rank: int, index: int) -> torch.Tensor:
        entry = self.entries[index]
        start = self.offsets[slot, rank, index]
        count = entry.lengths[rank]
        size = torch.empty(0, dtype=entry.dtype).element_size()
        return self.arena[start: start + count * size].view(entry.dtype)

    def whole(self, slot: int, version: int) -> bool:
        """Whether every rank stamped ``slot`` with ``version`` (its copies there are complete)."""
        return bool((self.stamps[slot] == version).all())


def in_host_memory() -> bool:
    """Whether this generation keeps its copies in host memory: every worker on this host (or a world
    of one); elsewhere buddies keep them."""
    return runtime.size() == 1 or host_memory.possible()


class Copies:
    """An elastic job's copies, kept where each generation can keep them: in host memory while every
    worker is on one host, with buddies while the workers span hosts (a job formed on one host that
    others join moves from one to the other at its next commit, and back)."""

    def __init__(self) -> None:
        self.host, self.buddies = HostCopies(), BuddyCopies()

    def retire(self) -> None:
        self.host.retire()
        self.buddies.retire()

    def commit(self, version: int, units: Sequence[Unit], state: dict[Any, dict[str, Any]],
               positions: dict[int, int]) -> None:
        """This generation's kind of copy of ``version`` (collective: every member is in the same generation)."""
        (self.host if in_host_memory() else self.buddies).commit(version, units, state, positions)

    def holding(self, version: int) -> Holding | None:
        """The parts of ``version`` this worker can give, from whichever kind made that commit."""
        return self.host.holding(version) or self.buddies.holding(version)


class HostCopies:
    """Each rank's committed chunks, in host shared memory (see the module's docstring)."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []  # newest last; older ones kept until a commit in the newest is whole
        self.retired = True  # the next commit opens a segment of its own (every member of a new group does)

    def retire(self) -> None:
        """A re-formed group commits into a segment of its own (a joiner does not map the old one); the
        old ones stay readable until then."""
        self.retired = True

    def commit(self, version: int, units: Sequence[Unit], state: dict[Any, dict[str, Any]],
               positions: dict[int, int]) -> None:
        """Copy this rank's chunks of ``units`` (weights and ``state``, the stepping optimizer's) into
        the slot of ``version`` and stamp it; ``positions`` maps a parameter's id to its position
        among the model's. Collective (ends with a barrier)."""
        entries = _entries(units, state, positions)
        if self.retired or self.segments[-1].entries != entries:
            self.segments.append(_segment(entries))
            self.retired = False
        segment, slot, rank = self.segments[-1], version % 2, runtime.rank()
        segment.stamps[slot, rank] = -1  # torn until the copy below is done
        for index, entry in enumerate(entries):
            segment.part(slot, rank, index).copy_(_part(entry, units, state))
            if index == len(entries) // 2:
                faults.point("commit.copies")
        segment.stamps[slot, rank] = version
        collectives.barrier()
        del self.segments[:-1]

    def holding(self, version: int) -> Holding | None:
        """Every old rank's parts of ``version``, from the newest segment whose slot for it is whole,
        if this worker maps one."""
        for segment in reversed(self.segments):
            if segment.whole(version % 2, version):
                world = len(segment.stamps[0])
                return Holding(segment.entries, {rank: [segment.part(version % 2, rank, index)
                                                        for index in range(len(segment.entries))]
                                                 for rank in range(world)})
        return None


@dataclass
class Holding:
    """What one worker can give back of one commit: the entries, and the parts of the old ranks it
    holds (old rank -> one tensor per entry)."""

    entries: list[Entry]
    parts: dict[int, list[torch.Tensor]]


class BuddyCopies:
    """Each rank's committed chunks in its own memory and its buddy's (see the module's docstring)."""

    def __init__(self) -> None:
        self.slots: list[tuple[int, Holding] | None] = [None, None]  # (version, holding) by version % 2
        # each slot's memory, (kept and sent, received), reused by the commit two later where sizes agree
        self.buffers: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None, None]
        self.buddies: list[int] | None = None  # this generation's buddy of each rank (made at its first commit)

    def retire(self) -> None:
        """A re-formed group chooses its buddies again; the holdings name the old ranks they hold, and
        stay until commits of the new group replace them."""
        self.buddies = None

    def commit(self, version: int, units: Sequence[Unit], state: dict[Any, dict[str, Any]],
               positions: dict[int, int]) -> None:
        """Keep this rank's chunks of ``units`` (weights and ``state``) for ``version``, send them to the
        buddy and keep the wards' (the ranks whose buddy this one is). Collective (an alltoall, then a
        barrier); where it fails the slot of ``version`` holds nothing (its commit two before, which no
        restore reads once this one starts, gave its memory to this one)."""
        entries = _entries(units, state, positions)
        rank, world = runtime.rank(), runtime.size()
        places, size = _packing(entries, rank)
        slot = version % 2
        # The slot's commit (two before) is never restored once this one starts: its memory is reused,
        # the slot emptied first, so that a commit that fails here leaves no half-written holding.
        self.slots[slot] = None
        kept, arrived = self.buffers[slot] or (None, None)
        sent = kept if kept is not None and kept.numel() == size else torch.empty(size, dtype=torch.uint8)
        for entry, (start, stop) in zip(entries, places):  # this rank's parts, kept as its copy and sent as they are
            sent[start:stop].copy_(_part(entry, units, state).view(torch.uint8))
        parts = {rank: _unpacked(sent, entries, places)}
        faults.point("commit.copies")
        received = None
        if world > 1:
            if self.buddies is None:
                self.buddies = _buddies()
            splits = [size if r == self.buddies[rank] else 0 for r in range(world)]
            # the wards' bytes, in rank order
            received = collectives.alltoall(sent, splits, check=False, buffer=arrived)
            offset = 0
            for ward in (r for r in range(world) if self.buddies[r] == rank):
                ward_places, ward_size = _packing(entries, ward)
                parts[ward] = _unpacked(received[offset: offset + ward_size], entries, ward_places)
                offset += ward_size
        collectives.barrier()
        self.slots[slot] = (version, Holding(entries, parts))
        self.buffers[slot] = (sent, received)

    def holding(self, version: int) -> Holding | None:
        """The parts of ``version`` this worker holds (its own and its wards'), if it committed it."""
        kept = self.slots[version % 2]
        return kept[1] if kept is not None and kept[0] == version else None


def _part(entry: Entry, units: Sequence[Unit], state: dict[Any, dict[str, Any]]) -> torch.Tensor:
    """This rank's part of ``entry`` as it trains: its chunk of the unit's weights or of a state tensor,
    flat (a view)."""
    shard = units[entry.unit].shard
    return (shard.detach() if entry.key == WEIGHTS else state[shard][entry.key]).reshape(-1)


def _buddies() -> list[int]:
    """Each rank's buddy (collective). The ranks in a ring ordered by index on their host, then by host,
    so that consecutive ranks are on different hosts wherever there are several; a rank's buddy is
    the next one on another host (the next one, on one host). Where hosts run different numbers of
    workers, a worker of a smaller host is the buddy of several."""
    return buddies_of(collectives.allgather_object((runtime.local_rank(), runtime.node_rank()), safe=True))


def buddies_of(places: Sequence[tuple[int, int]]) -> list[int]:
    """:func:`_buddies` of ranks at ``places`` (each rank's index on its host, and its host)."""
    ring = sorted(range(len(places)), key=lambda rank: (*places[rank], rank))
    buddies = [0] * len(ring)
    for at, rank in enumerate(ring):
        following = ring[at + 1:] + ring[:at]
        buddies[rank] = next((other for other in following if places[other][1] != places[rank][1]), following[0])
    return buddies


def _packing(entries: Sequence[Entry], rank: int) -> tuple[list[tuple[int, int]], int]:
    """Where ``rank``'s part of each entry lies in the bytes it keeps and sends, each starting on a
    cache line (so that every part can be viewed as its dtype), and their length."""
    sizes = [torch.empty(0, dtype=entry.dtype).element_size() * entry.lengths[rank] for entry in entries]
    starts, end = host_memory.packed_offsets(sizes)
    return [(start, start + size) for start, size in zip(starts, sizes)], host_memory.aligned(end)


def _unpacked(packed: torch.Tensor, entries: Sequence[Entry], places: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """The parts of ``entries`` in ``packed`` (laid out by :func:`_packing`), as views of their dtypes."""
    return [packed[start:stop].view(entry.dtype) for entry, (start, stop) in zip(entries, places)]


def rebuild(copies: Copies, version: int, units: Sequence[Unit], state: dict[Any, dict[str, Any]],
            positions: dict[int, int]) -> bool:
    """Fill this rank's chunks of ``units`` (laid out for the new group, perhaps into other units
    than the copies': level 3 gathers blocks between hosts) and of ``state`` from the copies of
    ``version`` the survivors hold; whether every old rank's were held (collective: where one's are
    lost, nothing is changed on any rank).

    Each old rank's parts come from the lowest new rank that holds them. One entry of one old unit at
    a time, every rank writes the parts it gives in their place in a buffer of zeros, and the
    buffers are summed as bytes (exact: each byte is one holder's, the others' zeros), or, where one
    rank gives them all (host memory), broadcast from it; every rank keeps what falls in its new
    chunks, so a rank holds at most one unit's entry beyond its own.
    """
    holding = copies.holding(version)
    offered = collectives.allgather_object(sorted(holding.parts) if holding is not None else [], safe=True)
    givers = [new for new, ranks in enumerate(offered) if ranks]
    if not givers:
        return False
    entries = collectives.broadcast_object(holding.entries if holding is not None else None, givers[0])
    old_world = len(entries[0].lengths) if entries else 0
    giver = {}
    for new, ranks in enumerate(offered):
        for old in ranks:
            giver.setdefault(old, new)
    if len(giver) < old_world:
        lost = sorted(set(range(old_world)) - set(giver))
        logger.warning("px.Sharded: the copies of commit %d of old rank(s) %s died with the workers that held "
                       "them", version, lost)
        return False
    places = _places(units, positions)
    _check_same_parameters(entries, places)
    for key, dtype in {(entry.key, entry.dtype) for entry in entries if entry.key != WEIGHTS and not entry.scalar}:
        for unit in units:  # filled below where this rank's chunks fall; an empty chunk stays empty
            state.setdefault(unit.shard, {})[key] = torch.zeros(unit.own.stop - unit.own.start, dtype=dtype)
    me, single = runtime.rank(), len(set(giver.values())) == 1
    for index, entry in enumerate(entries):
        lengths = (1,) if entry.scalar else entry.lengths
        whole = torch.zeros(sum(lengths), dtype=entry.dtype)
        offset = 0
        for old, length in enumerate(lengths):
            if giver[old] == me:
                assert holding is not None
                whole[offset: offset + length].copy_(holding.parts[old][index])
            offset += length
        if single:
            collectives.broadcast_(whole, giver[0])
        else:
            collectives.allreduce_(whole.view(torch.uint8), "sum", check=False)
        _keep_mine(entry, whole, units, places, state)
    return True


def _keep_mine(entry: Entry, whole: torch.Tensor, units: Sequence[Unit], places: dict[int, tuple[int, int]],
               state: dict[Any, dict[str, Any]]) -> None:
    """Copy the parts of an old unit's ``whole`` entry that fall in this rank's new chunks."""
    offset = 0
    for position, count in entry.params:
        unit_index, start = places[position]
        unit = units[unit_index]
        if entry.scalar:
            state.setdefault(unit.shard, {})[entry.key] = whole.reshape(()).clone()
            continue
        own = unit.own
        low, high = max(start, own.start), min(start + count, own.stop)
        if low < high:
            target = unit.shard.detach() if entry.key == WEIGHTS else state[unit.shard][entry.key]
            target[low - own.start: high - own.start].copy_(whole[offset + low - start: offset + high - start])
        offset += count


def _places(units: Sequence[Unit], positions: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Where each parameter lies in ``units``: its position -> (unit index, offset in the unit's flat)."""
    places = {}
    for index, unit in enumerate(units):
        offset = 0
        for param in unit.params:
            places[positions[id(param)]] = (index, offset)
            offset += param.numel()
    return places


def _entries(units: Sequence[Unit], state: dict[Any, dict[str, Any]], positions: dict[int, int]) -> list[Entry]:
    """What each rank copies of ``units``: the weights' chunk, then each state tensor (sorted by key)."""
    entries = []
    for index, unit in enumerate(units):
        lengths = tuple(unit.lengths)
        params = tuple((positions[id(param)], param.numel()) for param in unit.params)
        entries.append(Entry(index, WEIGHTS, unit.shard.dtype, lengths, params))
        for key, value in sorted(state.get(unit.shard, {}).items()):
            if torch.is_tensor(value):
                scalar = value.dim() == 0
                entries.append(Entry(index, key, value.dtype, (1,) * len(lengths) if scalar else lengths, params,
                                     scalar))
    return entries


def _segment(entries: list[Entry]) -> Segment:
    """A fresh segment for ``entries``, two slots of every rank's parts (collective)."""
    world = runtime.size()
    places = [(slot, rank, index) for slot in range(2) for rank in range(world) for index in range(len(entries))]
    starts, end = host_memory.packed_offsets(  # after the stamps, int64
        (entries[index].lengths[rank] * torch.empty(0, dtype=entries[index].dtype).element_size()
         for _, rank, index in places), start=2 * world * 8)
    offsets = dict(zip(places, starts))
    arena = runtime.host_arena("sharded-copies", end) if world > 1 else torch.empty(end, dtype=torch.uint8)
    stamps = arena[: 2 * world * 8].view(torch.int64).view(2, world)
    if runtime.rank() == 0:
        stamps.fill_(-1)
    collectives.barrier()
    logger.debug("px.Sharded: committed copies in a host segment of %d bytes", end)
    return Segment(entries, arena, stamps, offsets)


def _check_same_parameters(entries: list[Entry], places: dict[int, tuple[int, int]]) -> None:
    """The copies hold the parameters the re-formed group's units hold."""
    copied = {position for entry in entries if entry.key == WEIGHTS for position, _ in entry.params}
    if copied != set(places):
        raise PhalanxError("px.Sharded: the committed copies hold other parameters than the re-formed group's "
                           "units; this is a bug in phalanx, please report it.")
