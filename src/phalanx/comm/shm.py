"""Allreduce among the workers of one host through shared memory, without the kernel's sockets;
across hosts, hierarchical: shared memory within each host, Gloo between hosts for each slice.

One segment per job and generation (``/dev/shm/phalanx-JOB-gGEN``): a header with each rank's pid,
arrival counter and two metadata records (one per arrival parity), then the slots. A tensor goes
through in rounds of at most a slot. With two ranks on one host (1 MiB slots: a 1 MB tensor in one
round; 512 KB rounds took 89 us for it against 79 here) every rank copies its part into its slot
and arrives once; each then reduces both slots straight into its tensor (its own part read from the
tensor), in rank order, so both get the same bits. Alternate arrivals use two sets of slots: a rank
writes a set again two arrivals later, once its peer has arrived in between and so has read it.
With more ranks, or several hosts (4 MiB slots), each rank reduces its 1/p slice of all slots into
a result area (torch's kernels, the GIL released) and arrives again; every rank copies the result
out. On several hosts each rank first allreduces its reduced slice with the same local rank of
every other host (a Gloo group per local index, so every rank's link carries a share). Two arrivals
per round there: a round's writes cannot overtake a rank still reading the last one, because that
rank has not yet arrived for the new round.

A reduce-scatter and an allgather (:meth:`SharedMemoryGroup.reduce_scatter_`, ``allgather_``) of
chunks in rank order go in rounds too: every rank copies a piece of each rank's chunk into its slot,
placed by local index, then reduces (or copies out) only what it needs; across hosts each local
rank first reduces (or, gathering, receives over its Gloo group) the pieces of its local index on
every host, so only other hosts' chunks cross the network.

The collectives' cross-rank metadata check travels with the data: a rank writes its record into
its header before arriving for the first round, and after that wait every rank judges all records
before it reduces anything (``agreement`` of :meth:`SharedMemoryGroup.allreduce_`), so a mismatch
raises on every rank at the same arrival and nothing reaches the caller's tensor. A check alone
(another collective's) is one arrival with a record (:meth:`SharedMemoryGroup.gather_records`).

A group made with a message area (a layer above that runs a protocol of its own on a segment of its
own: Horovod's negotiation) also exchanges byte messages, each rank's in one arrival (an area per
rank and arrival parity, the same rule as the slots'; longer ones in more arrivals), with a record
beside them that an :meth:`SharedMemoryGroup.allreduce_` folding a check into the same arrival
reads: so the first arrival of an allreduce can be an exchange for ranks that only exchange. Each
rank's control line holds a doorbell: a word it sleeps on (a futex) while it has nothing to do, which
a rank that arrives for an exchange rings once it has spun in vain for the rank, and a thread of its
own process rings when it has news; every ring writes a value the word never held, so a wait given
the value read before looking for news misses no ring.

Waiting spins for 50 us (about what blocking costs: a rank blocked on another, idle core is woken
25-30 us after its peer arrives on this machine; spinning as long as blocking costs is at most twice
the best choice, whenever the peer comes), then blocks in the kernel on a futex: the counter of a
peer it still waits for (Linux on x86_64 and aarch64; the counter's low 32 bits). A rank that
arrives wakes the ranks marked as blocked on its counter. A blocked rank takes no core, so on a busy
host the cores go to the peers it waits for (and to the other processes there). With more ranks
than cores it blocks at once: spinning holds a core that a queued peer needs. A blocked wait times
out after 2 ms, doubling to 50 ms (an arriving rank reads the marks without a memory fence, so it
can, rarely, miss a rank that is just blocking; the timeout bounds the cost). Without futexes
(another system or architecture) a waiting rank spins, yields the core (not with more ranks than
cores), then sleeps in steps growing to 1 ms. A waiting rank checks that its peers live every
50 ms (a dead peer is named at once), gives up after the job's timeout, and stops at once on
:meth:`SharedMemoryGroup.abort`. The segment is unlinked as soon as every rank has mapped it, so
nothing is left in /dev/shm whatever happens later; the launcher also removes its job's names,
for a worker killed in between.
"""

from __future__ import annotations

import array
import ctypes
import itertools
import mmap
import os
import platform
import sys
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.comm import algorithms, cost
from phalanx.errors import CollectiveTimeoutError
from phalanx.lifetime import is_alive

SHM_DIR = "/dev/shm"
PREFIX = "phalanx-"
SLOT_BYTES = 4 << 20  # more than two ranks, or several hosts
DIRECT_SLOT_BYTES = 1 << 20  # two ranks (two sets of slots)
LINE = 64  # a rank's control line: pid, arrival counter, the rank it blocks on (+1; 0: none), doorbell
RECORD_WORDS = 32  # int64s of a metadata record
HEADER = LINE + 2 * RECORD_WORDS * 8  # per rank: the control line, then a record per arrival parity
SPIN_S = 50e-6  # then block (futex), or yield the core where there are no futexes: measured, see above
YIELD_S = 5e-3  # no futexes: then sleep, in steps growing to 1 ms
FIRST_BLOCK_S = 2e-3  # a blocking wait's first timeout, doubling up to LIVENESS_EVERY_S
LIVENESS_EVERY_S = 0.05
IDLE_POLL_S = 0.01  # no futexes: the longest sleep of a doorbell's waiter between looks
_PID, _COUNTER, _BLOCKED_ON, _BELL = range(4)  # int64 words of the control line

Combine = Callable[[torch.Tensor, torch.Tensor], None]
CombineInto = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
#: A metadata check folded into an allreduce: this rank's record, and what judges every rank's
#: (raises to refuse the call, alike on every rank; False: the data must go again without a record).
Agreement = tuple[Sequence[int], Callable[[list[list[int]]], bool]]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_FUTEX_SYSCALL = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 2**31 - 1


def _load_futex() -> Callable[..., int] | None:
    """libc's ``syscall`` set up for futex calls, or ``None`` where they cannot be used as here."""
    number = _FUTEX_SYSCALL.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or sys.byteorder != "little" or number is None:
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_int]
    probe = ctypes.c_int32(0)
    if call(number, ctypes.addressof(probe), _FUTEX_WAKE, 1, None, None, 0) != 0:  # seccomp, an emulator
        return None

    def futex(address: int, operation: int, value: int, timeout: _Timespec | None = None) -> int:
        return call(number, address, operation, value, None if timeout is None else ctypes.byref(timeout), None, 0)
    return futex


_futex = _load_futex()


def segment_name(job: str, generation: int) -> str:
    return f"{PREFIX}{job}-g{generation}"


def available() -> bool:
    """Whether this host offers POSIX shared memory the way phalanx uses it (Linux ``/dev/shm``)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class SharedMemoryGroup:
    """The ranks of one host, reducing through one mapped segment. ``create`` on local rank 0."""

    def __init__(self, name: str, rank: int, size: int, timeout_s: float, create: bool,
                 cross: dist.ProcessGroup | None = None, message_bytes: int = 0,
                 hosts: Sequence[Sequence[int]] | None = None):
        self.name, self.rank, self.size, self.timeout_s = name, rank, size, timeout_s
        self.message_bytes = message_bytes  # per rank and arrival parity, for exchange() (0: none)
        self.cross = cross  # several hosts: this local rank's Gloo group with its peers on the others
        # the job's ranks of every host in local order (None: one host, ranks 0..size-1); a cross group's
        # ranks are its members' job ranks sorted (torch's rule): where each piece goes in a slot
        ranks_by_host = [list(ranks) for ranks in hosts] if hosts is not None else [list(range(size))]
        self.hosts = ranks_by_host
        self._members = [sorted(ranks[local] for ranks in ranks_by_host) for local in range(size)]
        self.job_rank = self._members[rank][dist.get_rank(cross) if cross is not None else 0]
        self.host_index = next(index for index, ranks in enumerate(ranks_by_host) if ranks[rank] == self.job_rank)
        # a slot holds each rank's piece local-index-major, cross rank within: each local rank's together
        self._position = {job_rank: local * len(ranks_by_host) + index for local, members in enumerate(self._members)
                          for index, job_rank in enumerate(members)}
        self.cross_link: cost.Link | None = None  # measured at the first "auto" allreduce
        self.direct = size == 2 and cross is None  # each rank reduces everything itself, one arrival a round
        sets, self.slot_bytes = (2, DIRECT_SLOT_BYTES) if self.direct else (1, SLOT_BYTES)
        header, slot_bytes = size * HEADER, self.slot_bytes
        slots_end = header + sets * size * slot_bytes
        messages_at = slots_end + (0 if self.direct else slot_bytes)
        self._map = map_segment(name, messages_at + 2 * size * message_bytes, create)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._words = memoryview(self._map)[:header].cast("q")  # plain reads: ~0.1 us, not a torch op
        self._bytes = memoryview(self._map)
        self._messages_at = messages_at
        words_per_rank = HEADER // 8
        self._pid_at = [r * words_per_rank + _PID for r in range(size)]
        self._counter_at = [r * words_per_rank + _COUNTER for r in range(size)]
        self._blocked_at = [r * words_per_rank + _BLOCKED_ON for r in range(size)]
        self._record_at = [r * words_per_rank + LINE // 8 for r in range(size)]
        self._others_blocked_at = [self._blocked_at[r] for r in range(size) if r != rank]
        self._slots = [raw[header + k * slot_bytes: header + (k + 1) * slot_bytes] for k in range(sets * size)]
        self._result = None if self.direct else raw[slots_end:messages_at]
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._anchor = ctypes.c_char.from_buffer(self._map)  # the segment's address (and it stays mapped)
        self._counter_address = [ctypes.addressof(self._anchor) + 8 * at for at in self._counter_at]
        self._bell_at = [r * words_per_rank + _BELL for r in range(size)]
        self._bell_address = [ctypes.addressof(self._anchor) + 8 * at for at in self._bell_at]
        self._rings = itertools.count(1)  # each ring's value differs from every earlier one of this rank's
        self._words[self._pid_at[rank]] = os.getpid()
        self._arrivals = 0
        self._record_length = 0
        # More ranks than cores: a spinning or yielding rank holds a core that a peer waiting in another
        # core's run queue needs (yield only lets this core's queue go first), so block or sleep at once.
        crowded = size > len(os.sched_getaffinity(0))
        self._spin_s, self._yield_s = (0.0, 0.0) if crowded else (SPIN_S, YIELD_S)
        self._futex = _futex
        self._aborted = False

    def abort(self) -> None:
        """Make a wait in progress (on any thread) give up at once; the group is unusable after."""
        self._aborted = True
        futex, addresses = self._futex, [*self._counter_address, self._bell_address[self.rank]]
        if futex is not None:
            for address in addresses:  # this process's blocked thread wakes; the peers' look and block again
                futex(address, _FUTEX_WAKE, _WAKE_ALL)

    def unlink(self) -> None:
        """Remove the name (mappings stay valid): called once every rank has mapped the segment."""
        unlink_segment(self.name)

    def barrier(self) -> None:
        """Wait until every rank of the host has arrived here."""
        self._arrive_and_wait("waiting at a barrier")

    def close(self) -> None:
        self._words.release()
        self._bytes.release()
        self._slots, self._result, self._typed = [], None, {}  # type: ignore[assignment]
        self._counter_address, self._bell_address = [], []
        del self._anchor
        try:
            self._map.close()
        except BufferError:  # a tensor still views it: the mapping goes with the process
            pass

    def gather_records(self, record: Sequence[int]) -> list[list[int]]:
        """Every host rank's record of ``len(record)`` int64s (at most :data:`RECORD_WORDS`, the
        same length on every rank), in rank order: the collectives' metadata check in one arrival."""
        self._put_record(record)
        self._arrive_and_wait("checking the call's metadata")
        return self._records(len(record))

    def exchange(self, payload: bytes | memoryview, phase: str = "exchanging messages",
                 record: Sequence[int] = ()) -> tuple[list[bytes], list[list[int]]]:
        """Every host rank's ``payload``, in rank order (lengths may differ), and every rank's ``record``
        of the first arrival (at most :data:`RECORD_WORDS` integers, as long as this rank's: where an
        :meth:`allreduce_` that folds a check into that arrival reads it). One arrival for payloads of
        up to :attr:`message_bytes` - 8 bytes, one more per such part of the longest. Ranks that have
        not arrived once this rank has spun (see :data:`SPIN_S`) are rung (:meth:`ring`), so a rank
        that waits for news on its doorbell joins; a rank in step arrives without being woken."""
        self._put_message(payload, 0)
        self._put_record(record)
        self._arrive_and_wait(phase, ring_late=True)
        records = self._records(len(record))
        return self.exchanged(payload, phase), records

    def exchanged(self, payload: bytes | memoryview, phase: str = "exchanging messages") -> list[bytes]:
        """Every host rank's message, once the arrival that carried this rank's ``payload`` is over (an
        :meth:`exchange`, or an :meth:`allreduce_` given it as ``message`` whose judge raised): read from
        the message areas, with one more arrival for each further part of the longest."""
        room = self.message_bytes - 8
        areas = [self._message_area(self._arrivals, rank) for rank in range(self.size)]
        lengths = [int.from_bytes(area[:8], "little") for area in areas]
        parts = [bytearray(area[8: 8 + min(length, room)]) for area, length in zip(areas, lengths)]
        sent = room
        while sent < max(lengths):  # every rank knows every length: all take the same number of arrivals
            self._put_message(payload, sent)
            self._arrive_and_wait(phase)
            for rank, length in enumerate(lengths):
                if length > sent:
                    parts[rank] += self._message_area(self._arrivals, rank)[8: 8 + min(length - sent, room)]
            sent += room
        return [bytes(part) for part in parts]

    def bell(self) -> int:
        """This rank's doorbell as it is now: read it, look for news, then :meth:`wait_bell` with it, and
        no ring that comes after the read is missed."""
        return self._words[self._bell_at[self.rank]]

    def ring(self, ranks: Sequence[int]) -> None:
        """Wake whatever waits on the doorbells of ``ranks`` (this one's too: a thread of this process)."""
        value, words, futex = (next(self._rings) << 16) | self.rank, self._words, self._futex
        for rank in ranks:
            words[self._bell_at[rank]] = value  # never a value this doorbell held before: no wait misses it
            if futex is not None:
                futex(self._bell_address[rank], _FUTEX_WAKE, _WAKE_ALL)

    def wait_bell(self, seen: int, timeout_s: float) -> None:
        """Block until this rank's doorbell is rung after it read ``seen`` (:meth:`bell`), ``timeout_s``
        passes or the group is aborted; takes no core meanwhile. Without futexes it sleeps in steps of
        up to :data:`IDLE_POLL_S`."""
        if timeout_s <= 0 or self._aborted:
            return
        if self._futex is None:
            deadline, pause = time.monotonic() + timeout_s, 5e-5
            while self.bell() == seen and not self._aborted and (left := deadline - time.monotonic()) > 0:
                pause = min(2 * pause, IDLE_POLL_S, left)
                time.sleep(pause)
            return
        low = seen & 0xFFFFFFFF  # the kernel compares the low 32 bits (little-endian)
        nanoseconds = max(int(timeout_s * 1e9), 1000)
        self._futex(self._bell_address[self.rank], _FUTEX_WAIT, low - (1 << 32) if low >= 1 << 31 else low,
                    _Timespec(nanoseconds // 1_000_000_000, nanoseconds % 1_000_000_000))

    def arrived_records(self, length: int) -> list[list[int] | None]:
        """The first ``length`` words of the records that ranks already there wrote for this rank's next
        arrival, in rank order (``None`` for the ranks not there yet): what a rank about to join that
        arrival can read of it first."""
        target, words = self._arrivals + 1, self._words
        offset = (target & 1) * RECORD_WORDS
        return [words[at + offset: at + offset + length].tolist() if words[counter] >= target else None
                for at, counter in zip(self._record_at, self._counter_at)]

    def ahead(self) -> bool:
        """Whether some rank has arrived more often than this one: it waits in an arrival this rank has
        yet to make (a rank whose doorbell rang because a peer started an exchange)."""
        words, mine = self._words, self._arrivals
        return any(words[at] > mine for at in self._counter_at)

    def allreduce_(self, flat: torch.Tensor, op: str, algorithm: str = "backend",
                   agreement: Agreement | None = None, message: bytes | memoryview | None = None) -> None:
        """Reduce the 1-D contiguous CPU tensor ``flat`` over the job's ranks with ``op``, in place.

        ``algorithm`` is how each slice crosses hosts (hierarchical only): ``"backend"`` (Gloo's
        ring), one of :data:`phalanx.comm.algorithms.ALGORITHMS`, or ``"auto"`` (the cost model's
        choice for the slice's size, with the link between hosts measured at its first use).
        ``agreement`` (record, judge) folds the metadata check into the first round's arrival: every
        rank's record reaches ``judge`` before anything is reduced; where it raises, it raises on
        every rank and ``flat`` is untouched; where it returns False (a rank sent its record alone:
        it has joined), the data goes again in rounds of their own. ``message`` (with ``agreement``, and
        a non-empty ``flat``): written with the record, as :meth:`exchange` writes it, so that the first
        arrival is also an exchange: ranks that only exchange in it read it, and where ``judge`` raises,
        :meth:`exchanged` gives every rank's message; the ranks not there are rung as exchange rings them.
        """
        per_round = max(self.slot_bytes // flat.element_size(), 1)
        combine, combine_into = algorithms.combiner(op), algorithms.combiner_into(op)
        judge = None
        if agreement is not None:
            record, judge = agreement
            if flat.numel() == 0:
                judge(self.gather_records(record))
                return
            self._put_record(record)
            if message is not None:
                self._put_message(message, 0)
        for start in range(0, flat.numel(), per_round):
            chunk = flat[start: start + per_round]
            ring_late = judge is not None and message is not None
            if self.direct:
                done = self._direct_round(chunk, combine_into, judge, ring_late)
            else:
                done = self._sliced_round(chunk, op, algorithm, combine, combine_into, judge, ring_late)
            if not done:  # the records said: not everyone's data; all of it again, without records
                self.allreduce_(flat, op, algorithm)
                return
            judge = None

    def reduce_scatter_(self, flat: torch.Tensor, lengths: Sequence[int], op: str, into: torch.Tensor) -> None:
        """Reduce the 1-D ``flat`` over the job's ranks with ``op`` and write this rank's chunk of the
        result into ``into``: ``flat`` holds every rank's chunk in rank order, rank ``r``'s ``lengths[r]``
        long (the same ``lengths`` on every rank).

        In rounds of a slot: every rank copies a piece of each chunk into its slot, placed by local
        index, and arrives; each rank reduces its own piece over the slots (one host), or the pieces of
        its local index on every host; a second arrival lets the slots be written again. Across hosts
        one reduce-scatter exchange among the ranks of that local index (the cross group) then finishes the
        whole chunk at once, keeping the link busy: only the chunks of the other hosts leave a host,
        (H-1)/H of the tensor, half of what an allreduce (and Gloo's reduce-scatter) sends."""
        world, host_count = len(self._position), len(self.hosts)
        capacity = max(self.slot_bytes // flat.element_size() // world, 1)
        offsets = list(itertools.accumulate(lengths, initial=0))
        combine, combine_into = algorithms.combiner(op), algorithms.combiner_into(op)
        mine, longest = lengths[self.job_rank], max(lengths, default=0)
        apart = host_count > 1
        # across hosts: this host's sums of this local index's chunk of every host, and a round's of them
        across = torch.empty((host_count, longest) if apart else (0,), dtype=flat.dtype)
        partial = torch.empty(host_count * min(capacity, longest) if apart else 0, dtype=flat.dtype)
        for start in range(0, longest, capacity):
            stride = min(capacity, longest - start)
            base = self._write_set()
            self._copy_pieces_in(self._slot(base + self.rank, flat.dtype), flat, offsets, lengths, start, stride)
            self._arrive_and_wait("copying in")
            slots = [self._slot(base + local, flat.dtype) for local in range(self.size)]
            if not apart:
                count = min(mine - start, stride)
                if count > 0:
                    at = self._position[self.job_rank] * stride
                    _reduce_into(slots, slice(at, at + count), into[start: start + count], combine, combine_into)
            else:
                at, summed = self.rank * host_count * stride, partial[: host_count * stride]
                _reduce_into(slots, slice(at, at + host_count * stride), summed, combine, combine_into)
                across[:, start: start + stride].copy_(summed.view(host_count, stride))
            self._arrive_and_wait("reducing")
        if apart and longest > 0:
            into[:mine].copy_(algorithms.reduce_scatter(list(across.unbind(0)), op, self.cross)[:mine])

    def allgather_(self, flat: torch.Tensor, lengths: Sequence[int], out: torch.Tensor) -> None:
        """Every rank's 1-D ``flat`` (rank ``r``'s ``lengths[r]`` long, the same ``lengths`` on every
        rank) into ``out``, in rank order.

        In rounds of a slot: each rank copies its piece into its slot (across hosts: the pieces of its
        local index on every host, gathered among those ranks, the cross group; only this host's chunks
        leave it, once each) and arrives; every rank copies every slot's pieces out, and arrives once
        more before the slots are written again. The next round's pieces cross the link while this
        round's are copied within the host."""
        world, host_count = len(self._position), len(self.hosts)
        capacity = max(self.slot_bytes // flat.element_size() // world, 1)
        offsets = list(itertools.accumulate(lengths, initial=0))
        mine, longest = lengths[self.job_rank], max(lengths, default=0)
        rounds = range(0, longest, capacity)
        crossing = None  # across hosts: the round's pieces of every host, gathered one round ahead
        if host_count > 1 and rounds:
            crossing = self._gather_across(flat, mine, 0, min(capacity, longest))
        for start in rounds:
            stride = min(capacity, longest - start)
            base = self._write_set()
            slot = self._slot(base + self.rank, flat.dtype)
            if crossing is None:
                piece = flat[start: start + max(min(mine - start, stride), 0)]
                slot[: piece.numel()].copy_(piece)
            else:
                rows, work = crossing
                following = start + capacity
                crossing = self._gather_across(flat, mine, following, min(capacity, longest - following)) \
                    if following < longest else None
                work.wait()
                slot[: host_count * stride].view(host_count, stride).copy_(rows)
            self._arrive_and_wait("copying in")
            for local, members in enumerate(self._members):
                source = self._slot(base + local, flat.dtype)
                for index, rank in enumerate(members):
                    count = min(lengths[rank] - start, stride)
                    if count > 0:
                        out[offsets[rank] + start: offsets[rank] + start + count].copy_(
                            source[index * stride: index * stride + count])
            self._arrive_and_wait("copying out")

    def _gather_across(self, flat: torch.Tensor, mine: int, start: int, stride: int) -> tuple[torch.Tensor, dist.Work]:
        """Start gathering the pieces ``[start, start + stride)`` of this local index's chunk on every
        host (zeros past a chunk's end) into rows of a new tensor, one per host; the rows and the work."""
        piece = flat[start: start + max(min(mine - start, stride), 0)]
        padded = piece if piece.numel() == stride else torch.cat([piece, piece.new_zeros(stride - piece.numel())])
        rows = torch.empty(len(self.hosts), stride, dtype=flat.dtype)
        return rows, dist.all_gather(list(rows.unbind(0)), padded, group=self.cross, async_op=True)

    def _write_set(self) -> int:
        """The first slot of the set the next arrival's writers use: two ranks alternate two sets by the
        arrival's parity (a set is written again two arrivals later, once every rank has read it)."""
        return ((self._arrivals + 1) & 1) * self.size if self.direct else 0

    def _copy_pieces_in(self, slot: torch.Tensor, flat: torch.Tensor, offsets: Sequence[int],
                        lengths: Sequence[int], start: int, stride: int) -> None:
        """Each rank's piece ``[start, start + stride)`` of its chunk of ``flat`` where the slot places it."""
        for rank, length in enumerate(lengths):
            count = min(length - start, stride)
            if count > 0:
                at = self._position[rank] * stride
                slot[at: at + count].copy_(flat[offsets[rank] + start: offsets[rank] + start + count])

    def _direct_round(self, chunk: torch.Tensor, combine_into: CombineInto,
                      judge: Callable[[list[list[int]]], bool] | None, ring_late: bool = False) -> bool:
        """Two ranks: copy in, arrive, reduce both slots straight into ``chunk`` (in rank order)."""
        count, dtype = chunk.numel(), chunk.dtype
        first = ((self._arrivals + 1) & 1) * 2  # this arrival's set of slots
        self._slot(first + self.rank, dtype)[:count].copy_(chunk)
        self._arrive_and_wait("copying in", ring_late)
        if judge is not None and not judge(self._records(self._record_length)):
            return False
        peer = self._slot(first + 1 - self.rank, dtype)[:count]
        if self.rank == 0:
            combine_into(chunk, peer, chunk)
        else:
            combine_into(peer, chunk, chunk)
        return True

    def _sliced_round(self, chunk: torch.Tensor, op: str, algorithm: str, combine: Combine,
                      combine_into: CombineInto, judge: Callable[[list[list[int]]], bool] | None,
                      ring_late: bool = False) -> bool:
        """Copy in, arrive, reduce this rank's slice into the result area, arrive, copy the result out."""
        count, dtype = chunk.numel(), chunk.dtype
        slots = [self._slot(k, dtype)[:count] for k in range(self.size)]
        slots[self.rank].copy_(chunk)
        self._arrive_and_wait("copying in", ring_late)
        if judge is not None and not judge(self._records(self._record_length)):
            return False
        low, high = (count * self.rank) // self.size, (count * (self.rank + 1)) // self.size
        result = self._slot(-1, dtype)[:count]
        if high > low:
            mine = result[low:high]
            combine_into(slots[0][low:high], slots[1][low:high], mine)
            for slot in slots[2:]:
                combine(mine, slot[low:high])
            if self.cross is not None:  # hierarchical: this host's sum of the slice, with the other hosts'
                self._across_hosts(mine, op, algorithm)
        self._arrive_and_wait("reducing")
        chunk.copy_(result)
        return True

    def _slot(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot ``index`` (-1: the result area) as a tensor of ``dtype``, made once."""
        typed = self._typed.get((index, dtype))
        if typed is None:
            area = self._result if index == -1 else self._slots[index]
            typed = self._typed[(index, dtype)] = area[: self.slot_bytes // dtype.itemsize * dtype.itemsize].view(dtype)
        return typed

    def _put_record(self, record: Sequence[int]) -> None:
        """Write this rank's record where the next arrival's readers look (parity of that arrival)."""
        if len(record) > RECORD_WORDS:
            raise ValueError(f"a record holds at most {RECORD_WORDS} integers, got {len(record)}")
        at = self._record_at[self.rank] + ((self._arrivals + 1) & 1) * RECORD_WORDS
        self._words[at: at + len(record)] = array.array("q", record)
        self._record_length = len(record)

    def _records(self, length: int) -> list[list[int]]:
        """Every rank's record of the last arrival (read before this rank arrives again)."""
        offset = (self._arrivals & 1) * RECORD_WORDS
        words = self._words
        return [words[at + offset: at + offset + length].tolist() for at in self._record_at]

    def _put_message(self, payload: bytes | memoryview, sent: int) -> None:
        """Write ``payload``'s length and its part from byte ``sent`` where the next arrival's readers look."""
        room = self.message_bytes - 8
        if room <= 0:
            raise ValueError("this group was made without a message area (message_bytes=0)")
        mine = self._message_area(self._arrivals + 1, self.rank)
        chunk = payload[sent: sent + room]
        mine[:8] = len(payload).to_bytes(8, "little")
        mine[8: 8 + len(chunk)] = chunk

    def _message_area(self, arrival: int, rank: int) -> memoryview:
        """Where ``rank`` writes its message for arrival number ``arrival`` (two areas, by its parity: a
        rank writes an area again two arrivals later, when every rank has read it)."""
        start = self._messages_at + ((arrival & 1) * self.size + rank) * self.message_bytes
        return self._bytes[start: start + self.message_bytes]

    def _across_hosts(self, mine: torch.Tensor, op: str, algorithm: str) -> None:
        """Allreduce this rank's slice with the same local rank of the other hosts."""
        if algorithm == "auto":
            if self.cross_link is None:  # every member of this cross group is at the same round
                self.cross_link = cost.measure(self.cross)
            algorithm = cost.choose_with_backend(mine.numel() * mine.element_size(),
                                                 dist.get_world_size(self.cross), self.cross_link)
        if algorithm == "backend":
            dist.all_reduce(mine, algorithms.BACKEND_OPS[op], group=self.cross)
        else:
            algorithms.allreduce(mine, op, algorithm, self.cross)

    def _arrive_and_wait(self, phase: str, ring_late: bool = False) -> None:
        """Publish this rank's arrival, wake the ranks blocked on it, and wait for every rank's
        (``ring_late``: ring the doorbells of those not there once the spin is over)."""
        self._arrivals += 1
        target = self._arrivals
        words = self._words
        words[self._counter_at[self.rank]] = target
        if self._futex is not None:
            mark = self.rank + 1
            for at in self._others_blocked_at:
                if words[at] == mark:
                    self._futex(self._counter_address[self.rank], _FUTEX_WAKE, _WAKE_ALL)
                    break
        for at in self._counter_at:
            if words[at] < target:
                self._wait(target, phase, ring_late)
                return

    def _wait(self, target: int, phase: str, ring_late: bool = False) -> None:
        """Spin, then block on a late peer's counter (or yield, then sleep, without futexes);
        ``ring_late``: ring the late ranks' doorbells when the spin is over."""
        words, counters, futex = self._words, self._counter_at, self._futex
        started = time.monotonic()
        spin_until, next_liveness = started + self._spin_s, started + LIVENESS_EVERY_S
        block_s, pause = FIRST_BLOCK_S, 0.0
        while True:
            late, seen = -1, 0
            for rank, at in enumerate(counters):
                seen = words[at]
                if seen < target:
                    late = rank
                    break
            if late < 0:
                return
            if self._aborted:
                raise CollectiveTimeoutError(f"allreduce through shared memory on rank {self.rank} was aborted "
                                             "(the process is leaving the group).")
            now = time.monotonic()
            if now < spin_until:
                continue
            if ring_late:
                ring_late = False
                self.ring([rank for rank, at in enumerate(counters) if words[at] < target])
            if now >= next_liveness:
                next_liveness = now + LIVENESS_EVERY_S
                self._check_peers(target, phase, now - started)
            if futex is not None:
                timeout = min(block_s, next_liveness - now)
                block_s = min(2 * block_s, LIVENESS_EVERY_S)
                words[self._blocked_at[self.rank]] = late + 1
                low = seen & 0xFFFFFFFF  # the kernel compares the counter's low 32 bits (little-endian)
                nanoseconds = max(int(timeout * 1e9), 1000)
                futex(self._counter_address[late], _FUTEX_WAIT, low - (1 << 32) if low >= 1 << 31 else low,
                      _Timespec(nanoseconds // 1_000_000_000, nanoseconds % 1_000_000_000))
                words[self._blocked_at[self.rank]] = 0
            elif now - started < self._yield_s:
                os.sched_yield()
            else:
                pause = min(max(pause * 2, 5e-5), 1e-3)
                time.sleep(pause)

    def _check_peers(self, target: int, phase: str, waited: float) -> None:
        missing = [r for r in range(self.size) if self._words[self._counter_at[r]] < target]
        pids = [self._words[self._pid_at[r]] for r in range(self.size)]
        dead = [r for r in missing if pids[r] > 0 and not is_alive(pids[r])]
        if dead or waited > self.timeout_s:
            why = f"rank(s) {dead} died" if dead else f"rank(s) {missing} did not answer within {self.timeout_s:.0f}s"
            raise CollectiveTimeoutError(
                f"allreduce through shared memory on rank {self.rank} of {self.size} failed while {phase}: {why}. "
                "The first failing rank's output names the root cause.")


def _reduce_into(slots: Sequence[torch.Tensor], region: slice, out: torch.Tensor, combine: Combine,
                 combine_into: CombineInto) -> None:
    """``out`` = the slots' ``region`` combined, in local rank order (the same bits on every rank)."""
    if len(slots) == 1:
        out.copy_(slots[0][region])
        return
    combine_into(slots[0][region], slots[1][region], out)
    for slot in slots[2:]:
        combine(out, slot[region])


def map_segment(name: str, nbytes: int, create: bool) -> mmap.mmap:
    """Map the segment ``name`` of ``nbytes`` bytes, creating it (exclusively) or opening another's."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    descriptor = os.open(os.path.join(SHM_DIR, name), flags, 0o600)
    try:
        if create:
            os.ftruncate(descriptor, nbytes)
        return mmap.mmap(descriptor, nbytes)
    finally:
        os.close(descriptor)


def unlink_segment(name: str) -> None:
    """Remove a segment's name; mappings stay valid until the processes unmap or exit."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def remove_job_segments(job: str) -> list[str]:
    """Unlink every segment of ``job`` still named in /dev/shm (the launcher, after its workers ended)."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(f"{PREFIX}{job}-"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed
