"""px.Sharded's committed shards in host memory: a lost worker's shards rebuilt with no disk read.

No worker holds another's chunks of the weights and the optimizer state, so an elastic commit of a
sharded run keeps each rank's chunks where every worker of the host can read them: one shared-memory
segment per generation, in which each rank writes, at each commit, its chunks into one of two
*slots* (the commit's version modulo 2) and then stamps the slot with the version. A barrier ends
the commit, so a worker whose commit of version ``v`` completed knows that every rank's slot for
``v`` is whole; the other slot keeps ``v - 1`` whole for the survivors of a death during the commit
(they restore ``v - 1``). The segment outlives any worker of the host: after a re-form a survivor
reads every old rank's chunks from it, the dead ones' too, and broadcasts each unit whole, unit by
unit, to the new group, where every rank keeps its new chunk (:func:`rebuild`).

Cost: two slots of one rank's chunks per worker (``2 * (weights + state) / workers``: 6 bytes a
parameter for Adam in float32 at 4 workers), one copy of the chunks and a barrier per commit.
Copies need every worker on one host (:func:`possible`; a world of one keeps them in its own
memory, for the workers that join it); between hosts a re-formed group resumes from the last
checkpoint on disk.
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


def possible() -> bool:
    """Whether this generation can keep copies: every worker on this host (or a world of one)."""
    return runtime.size() == 1 or host_memory.possible()


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
            unit = units[entry.unit]
            source = unit.shard.detach() if entry.key == WEIGHTS else state[unit.shard][entry.key]
            segment.part(slot, rank, index).copy_(source.reshape(-1))
            if index == len(entries) // 2:
                faults.point("commit.copies")
        segment.stamps[slot, rank] = version
        collectives.barrier()
        del self.segments[:-1]

    def holding(self, version: int) -> Segment | None:
        """The newest segment whose slot for ``version`` is whole for every rank it was made for, if this
        worker maps one."""
        for segment in reversed(self.segments):
            if segment.whole(version % 2, version):
                return segment
        return None


def rebuild(copies: HostCopies, version: int, units: Sequence[Unit], state: dict[Any, dict[str, Any]],
            positions: dict[int, int]) -> bool:
    """Fill this rank's chunks of ``units`` (laid out for the new group, perhaps into other units
    than the copies': level 3 gathers blocks between hosts) and of ``state`` from the copies of
    ``version`` that a survivor maps; whether any member held them (collective: when none does,
    nothing is changed on any rank).

    The holder with the lowest rank broadcasts each old unit's entries whole (the old ranks' parts
    in order), one at a time; every rank keeps what falls in its new chunks, parameter by parameter,
    so a rank holds at most one unit's entry beyond its own chunks.
    """
    segment = copies.holding(version)
    held = collectives.allgather_object(segment is not None, safe=True)
    if not any(held):
        return False
    root = held.index(True)
    entries = collectives.broadcast_object(segment.entries if segment is not None else None, root)
    places = _places(units, positions)
    _check_same_parameters(entries, places)
    for key, dtype in {(entry.key, entry.dtype) for entry in entries if entry.key != WEIGHTS and not entry.scalar}:
        for unit in units:  # filled below where this rank's chunks fall; an empty chunk stays empty
            state.setdefault(unit.shard, {})[key] = torch.zeros(unit.own.stop - unit.own.start, dtype=dtype)
    slot = version % 2
    for index, entry in enumerate(entries):
        if segment is not None and runtime.rank() == root:
            parts = [segment.part(slot, rank, index) for rank in range(len(entry.lengths))]
            whole = parts[0].clone() if entry.scalar else torch.cat(parts)
        else:
            whole = torch.empty(1 if entry.scalar else sum(entry.lengths), dtype=entry.dtype)
        collectives.broadcast_(whole, root)
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
    offsets: dict[tuple[int, int, int], int] = {}
    end = 2 * world * 8  # the stamps, int64
    for slot in range(2):
        for rank in range(world):
            for index, entry in enumerate(entries):
                end = -(-end // host_memory.ALIGNMENT) * host_memory.ALIGNMENT
                offsets[slot, rank, index] = end
                end += entry.lengths[rank] * torch.empty(0, dtype=entry.dtype).element_size()
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
