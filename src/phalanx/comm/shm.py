"""Allreduce among the workers of one host through shared memory, without the kernel's sockets;
across hosts, hierarchical: shared memory within each host, Gloo between hosts for each slice.

One segment per job and generation (``/dev/shm/phalanx-JOB-gGEN``): a header with each rank's
pid and arrival counter (one cache line each), one slot per rank, and a result area. A tensor
goes through in rounds of at most a slot: every rank copies its part into its slot and arrives;
each rank then reduces its 1/p slice of all slots into the result area (torch's kernels, the
GIL released) and arrives again; every rank copies the result out. On several hosts each rank
first allreduces its reduced slice with the same local rank of every other host (a Gloo group per
local index, so every rank's link carries a share). Two arrivals per round: a
round's writes cannot overtake a rank still reading the last one, because that rank has not yet
arrived for the new round.

Waiting spins briefly, then yields the core, then sleeps in growing steps, so that a worker
waiting does not take the core its peer computes on. With more ranks than cores it sleeps at once:
yielding only lets this core's queue go first, and kept a peer queued on another core waiting (3
workers on 2 cores ran 6-15 % slower, 4 workers up to 23 %). A waiting rank checks that its peers
live every 50 ms (a dead peer is named at once) and gives up after the job's timeout. The segment
is unlinked as soon as every rank has mapped it, so nothing is left in /dev/shm whatever happens
later; the launcher also removes its job's names, for a worker killed in between.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from phalanx.comm import algorithms, cost
from phalanx.errors import CollectiveTimeoutError
from phalanx.lifetime import is_alive

SHM_DIR = "/dev/shm"
PREFIX = "phalanx-"
SLOT_BYTES = 4 << 20
LINE = 64  # bytes per rank in the header: pid, counter, padding
SPIN_S = 50e-6  # then yield the core, in case the peer waits for it
YIELD_S = 5e-3  # then sleep, in steps growing to 1 ms
LIVENESS_EVERY_S = 0.05

Combine = Callable[[torch.Tensor, torch.Tensor], None]
CombineInto = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def segment_name(job: str, generation: int) -> str:
    return f"{PREFIX}{job}-g{generation}"


def available() -> bool:
    """Whether this host offers POSIX shared memory the way phalanx uses it (Linux ``/dev/shm``)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class SharedMemoryGroup:
    """The ranks of one host, reducing through one mapped segment. ``create`` on local rank 0."""

    def __init__(self, name: str, rank: int, size: int, timeout_s: float, create: bool,
                 cross: dist.ProcessGroup | None = None):
        self.name, self.rank, self.size, self.timeout_s = name, rank, size, timeout_s
        self.cross = cross  # several hosts: this local rank's Gloo group with its peers on the others
        self.cross_link: cost.Link | None = None  # measured at the first "auto" allreduce
        self._map = map_segment(name, size * LINE + (size + 1) * SLOT_BYTES, create)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        header = raw[: size * LINE].view(torch.int64).view(size, LINE // 8)
        self._pids = header[:, 0]
        self._words = memoryview(self._map)[: size * LINE].cast("q")  # plain reads: ~0.1 us, not a torch op
        self._counter_index = [r * (LINE // 8) + 1 for r in range(size)]
        self._slots = [raw[size * LINE + k * SLOT_BYTES: size * LINE + (k + 1) * SLOT_BYTES] for k in range(size)]
        self._result = raw[size * LINE + size * SLOT_BYTES:]
        self._pids[rank] = os.getpid()
        self._arrivals = 0
        # More ranks than cores: a spinning or yielding rank holds a core that a peer waiting in another
        # core's run queue needs (yield only lets this core's queue go first), so sleep at once.
        crowded = size > len(os.sched_getaffinity(0))
        self._spin_s, self._yield_s = (0.0, 0.0) if crowded else (SPIN_S, YIELD_S)
        self._aborted = False

    def abort(self) -> None:
        """Make a wait in progress (on any thread) give up at once; the group is unusable after."""
        self._aborted = True

    def unlink(self) -> None:
        """Remove the name (mappings stay valid): called once every rank has mapped the segment."""
        unlink_segment(self.name)

    def barrier(self) -> None:
        """Wait until every rank of the host has arrived here."""
        self._arrive_and_wait("waiting at a barrier")

    def close(self) -> None:
        self._words.release()
        self._pids = None  # type: ignore[assignment]
        self._slots, self._result = [], None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a tensor still views it: the mapping goes with the process
            pass

    def allreduce_(self, flat: torch.Tensor, op: str, algorithm: str = "backend") -> None:
        """Reduce the 1-D contiguous CPU tensor ``flat`` over the job's ranks with ``op``, in place.

        ``algorithm`` is how each slice crosses hosts (hierarchical only): ``"backend"`` (Gloo's
        ring), one of :data:`phalanx.comm.algorithms.ALGORITHMS`, or ``"auto"`` (the cost model's
        choice for the slice's size, with the link between hosts measured at its first use).
        """
        per_round = max(SLOT_BYTES // flat.element_size(), 1)
        combine, combine_into = algorithms.combiner(op), algorithms.combiner_into(op)
        for start in range(0, flat.numel(), per_round):
            self._round(flat[start: start + per_round], op, algorithm, combine, combine_into)

    def _round(self, chunk: torch.Tensor, op: str, algorithm: str, combine: Combine,
               combine_into: CombineInto) -> None:
        count, dtype = chunk.numel(), chunk.dtype
        slots = [slot[: count * chunk.element_size()].view(dtype) for slot in self._slots]
        slots[self.rank].copy_(chunk)
        self._arrive_and_wait("copying in")
        low, high = (count * self.rank) // self.size, (count * (self.rank + 1)) // self.size
        if high > low:
            mine = self._result[: count * chunk.element_size()].view(dtype)[low:high]
            combine_into(slots[0][low:high], slots[1][low:high], mine)
            for slot in slots[2:]:
                combine(mine, slot[low:high])
            if self.cross is not None:  # hierarchical: this host's sum of the slice, with the other hosts'
                self._across_hosts(mine, op, algorithm)
        self._arrive_and_wait("reducing")
        chunk.copy_(self._result[: count * chunk.element_size()].view(dtype))

    def allgather_(self, record: torch.Tensor) -> torch.Tensor:
        """Every host rank's small 1-D ``record`` (at most a slot), stacked in rank order: the
        collectives' metadata check, without a round trip through the kernel's sockets."""
        nbytes = record.numel() * record.element_size()
        self._slots[self.rank][:nbytes].view(record.dtype).copy_(record)
        self._arrive_and_wait("gathering")
        rows = torch.stack([slot[:nbytes].view(record.dtype) for slot in self._slots])
        self._arrive_and_wait("gathering")  # nobody writes its slot again before every rank has read
        return rows

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

    def _arrive_and_wait(self, phase: str) -> None:
        """Publish this rank's arrival and wait for every rank's: spin, then yield, then sleep."""
        self._arrivals += 1
        target = self._arrivals
        words, indices = self._words, self._counter_index
        words[indices[self.rank]] = target
        started = time.monotonic()
        next_liveness, pause = started + LIVENESS_EVERY_S, 0.0
        while min(words[k] for k in indices) < target:
            if self._aborted:
                raise CollectiveTimeoutError(f"allreduce through shared memory on rank {self.rank} was aborted "
                                             "(the process is leaving the group).")
            now = time.monotonic()
            waited = now - started
            if waited < self._spin_s:
                continue
            if waited < self._yield_s:
                os.sched_yield()
            else:
                pause = min(max(pause * 2, 5e-5), 1e-3)
                time.sleep(pause)
            if now >= next_liveness:
                next_liveness = now + LIVENESS_EVERY_S
                self._check_peers(target, phase, waited)

    def _check_peers(self, target: int, phase: str, waited: float) -> None:
        missing = [r for r in range(self.size) if self._words[self._counter_index[r]] < target]
        dead = [r for r in missing if int(self._pids[r]) > 0 and not is_alive(int(self._pids[r]))]
        if dead or waited > self.timeout_s:
            why = f"rank(s) {dead} died" if dead else f"rank(s) {missing} did not answer within {self.timeout_s:.0f}s"
            raise CollectiveTimeoutError(
                f"allreduce through shared memory on rank {self.rank} of {self.size} failed while {phase}: {why}. "
                "The first failing rank's output names the root cause.")


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
