"""What a doctor run measured, over all ranks: the step's phases, the buckets, the transport, the host.

Only typical steps count: the global batch is the one the script configured (the largest any step
had), and a short last batch of an epoch is named but left out of the timing, so no figure is an
average that no step had; so are steps more than half again as long as the median (an epoch's
validation and checkpoint land in the step after it, and a busy host preempts some). Phases are
means over each rank's kept steps, then over ranks (the ranks run in lockstep, so their step
times agree; how they split them may not). Buckets and transport figures are rank 0's.

Under a strategy that communicates every few steps (px.LocalSGD, px.DiLoCo: its schedule is the
record's ``strategy`` note) the steps that start or merge an exchange are longer by design: they
are kept (the outliers are those of their own kind), and each figure per step is the steps without
an exchange plus what the steps with one took beyond them per exchange merged, times the exchanges
per step of the schedule, so that the window's share of exchanging steps does not skew the mean.
The exchange's own cost is reported per exchange as well.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from phalanx.doctor import load
from phalanx.doctor.records import RankSteps, Step, mean, split_steps
from phalanx.strategies.base import Exchanges


@dataclass(frozen=True)
class Bucket:
    """One bucket of the step: when it was ready (seconds after backward began), its bytes, its wait."""

    ready_s: float
    bytes: int
    exposed_s: float
    alone_s: float | None  # its allreduce timed alone after the steps


@dataclass(frozen=True)
class Measured:
    """The measured figures of one run (seconds per step unless named otherwise)."""

    world_size: int
    workers_per_host: int
    cores: int
    threads: int
    transport: str
    global_batch: int
    short_batches: tuple[int, ...]  # smaller global batches seen (an epoch's last), left out of the timing
    outliers: int  # full steps left out for taking more than OUTLIER times the median
    other_load: float | None  # cores other processes kept busy while measuring (None: not measurable)
    step_s: float
    data_wait_s: float
    forward_s: float | None
    backward_s: float | None
    compute_s: float
    exposed_comm_s: float
    optimizer_s: float
    other_s: float
    cpu_s: float
    system_s: float  # of cpu_s, in the kernel: mostly page faults
    page_faults: float  # minor faults per step: memory touched afresh (see docs/doctor.md)
    steps: int
    buckets: tuple[Bucket, ...]
    transport_figures: dict[str, Any] | None
    strategy: str  # as the strategy names itself (px.DataParallel where none was named)
    schedule: Exchanges  # how often it communicates
    exchanges: int  # exchanges of px.LocalSGD/px.DiLoCo merged in the timed steps (rank 0's)
    exchange_bytes: int  # what one exchange sends (a fragment of the model)
    exchange_wait_s: float | None  # exposed communication per exchange (None: no exchange timed)
    exchange_step_s: float | None  # what a step with an exchange took beyond one without, per exchange
    model_bytes: int | None  # the trained parameters, whole (None: not seen)

    @property
    def bytes_per_step(self) -> float:
        """Bytes a worker sends per step: the buckets of every step, and the exchanges averaged over
        the schedule."""
        return sum(bucket.bytes for bucket in self.buckets) + self.exchange_bytes * self.schedule.share

    @property
    def local_steps(self) -> bool:
        """Whether the workers step on their own between exchanges (px.LocalSGD, px.DiLoCo) rather than
        reduce gradients in backward."""
        return self.schedule.period > 1 or self.exchanges > 0

    @property
    def own_step_s(self) -> float:
        """The step without its wait for the allreduce: what the worker itself spent."""
        return self.step_s - self.exposed_comm_s

    @property
    def comm_alone_s(self) -> float | None:
        """The step's allreduces timed alone (``None`` at world size 1)."""
        times = [bucket.alone_s for bucket in self.buckets]
        return sum(times) if times and None not in times else None  # type: ignore[arg-type]

    @property
    def overlapped(self) -> float | None:
        """Fraction of the step's communication hidden behind backward."""
        alone = self.comm_alone_s
        return None if not alone else min(max(1.0 - self.exposed_comm_s / alone, 0.0), 1.0)

    @property
    def oversubscription(self) -> float:
        """Threads that want a core per core this process may use (above 1: they take turns)."""
        return self.workers_per_host * self.threads / self.cores

    def as_dict(self) -> dict[str, Any]:
        """The ``measured`` object of ``--json``."""
        fields = asdict(self)
        fields.update(bytes_per_step=self.bytes_per_step, comm_alone_s=self.comm_alone_s,
                      communicates=self.schedule.describe(), communicating_share=self.schedule.share,
                      overlapped=self.overlapped, oversubscription=self.oversubscription,
                      throughput=self.global_batch / self.step_s if self.step_s else 0.0)
        return fields


def summarize(records: list[dict[str, Any]]) -> Measured:
    """The :class:`Measured` figures of one run from its ranks' records."""
    records = sorted(records, key=lambda r: r["rank"])
    ranks = [split_steps(record) for record in records]
    batches = global_batches(ranks)
    batch = max(batches)
    full = [index for index, size in enumerate(batches) if size == batch]
    longest = [max(rank.timed[i].step_s for rank in ranks) for i in range(len(batches))]
    kinds = {tuple((rank.timed[i].starts, rank.timed[i].merges) for rank in ranks) for i in full}
    kept = sorted(i for kind in kinds for i in typical(  # exchanging steps are measured among their own kind
        [i for i in full if tuple((rank.timed[i].starts, rank.timed[i].merges) for rank in ranks) == kind], longest))
    for rank in ranks:  # the ranks step in lockstep: step i of one is step i of all
        rank.timed = [rank.timed[i] for i in kept]
    first, host = records[0], records[0]["host"]
    note = first.get("notes", {}).get("strategy", {})
    schedule = Exchanges(**{key: value for key, value in note.items() if key != "name"})

    def per_rank(phase: str) -> float:
        return mean([per_step(rank.timed, phase, schedule.share) for rank in ranks])

    forwards = [s.forward_s for r in ranks for s in r.timed if s.forward_s is not None]
    compute = per_rank("compute_s")
    exchanges = sum(step.merges for step in ranks[0].timed)
    started = sum(step.starts for step in ranks[0].timed)
    exchange_bytes = sum(step.exchange_bytes for step in ranks[0].timed) // started if started else 0
    waited = mean([sum(step.exchange_wait_s for step in rank.timed) for rank in ranks])
    buckets = _buckets(ranks[0].timed, first.get("transport_figures"))
    return Measured(
        world_size=int(first.get("world_size", 1)), workers_per_host=int(first.get("local_size", 1)),
        cores=int(host["cores"]), threads=int(host["threads"]), transport=str(first.get("transport", "none")),
        global_batch=batch, short_batches=tuple(sorted({size for size in batches if size < batch})),
        outliers=len(full) - len(kept), other_load=_other_load(records),
        step_s=per_rank("step_s"), data_wait_s=per_rank("data_s"),
        forward_s=mean(forwards) if forwards else None, backward_s=compute - mean(forwards) if forwards else None,
        compute_s=compute, exposed_comm_s=per_rank("exposed_s"), optimizer_s=per_rank("optimizer_s"),
        other_s=per_rank("other_s"), cpu_s=per_rank("cpu_s"), system_s=per_rank("system_s"),
        page_faults=per_rank("faults"), steps=len(ranks[0].timed), buckets=buckets,
        transport_figures=first.get("transport_figures"), strategy=str(note.get("name", "px.DataParallel")),
        schedule=schedule, exchanges=exchanges, exchange_bytes=exchange_bytes,
        exchange_wait_s=waited / exchanges if exchanges else None,
        exchange_step_s=_mean_beyond(ranks, "step_s"),
        model_bytes=_model_bytes(first, buckets, exchange_bytes * schedule.fragments))


#: A full step longer than this many times the median is not a typical step.
OUTLIER = 1.5


def typical(indices: list[int], step_s: list[float]) -> list[int]:
    """The ``indices`` whose steps took at most :data:`OUTLIER` times their median."""
    if not indices:
        return []
    median = statistics.median(step_s[i] for i in indices)
    return [i for i in indices if step_s[i] <= OUTLIER * median]


def per_step(steps: list[Step], phase: str, share: float) -> float:
    """The mean of ``phase`` per step, with ``share`` exchanges per step: the steps without an exchange,
    plus what those that started or merged one took beyond them per exchange merged, times ``share``
    (a plain mean where every step or none holds an exchange)."""
    beyond = _beyond(steps, phase)
    if beyond is None:
        return mean([getattr(step, phase) for step in steps])
    return max(mean([getattr(step, phase) for step in steps if not step.exchanging]) + beyond * share, 0.0)


def _beyond(steps: list[Step], phase: str) -> float | None:
    """What the steps that started or merged an exchange took beyond those without, per exchange merged
    (``None`` without both kinds of step or without a merge)."""
    quiet = [getattr(step, phase) for step in steps if not step.exchanging]
    merged = sum(step.merges for step in steps)
    if not quiet or not merged:
        return None
    base = mean(quiet)
    return sum(getattr(step, phase) - base for step in steps if step.exchanging) / merged


def _mean_beyond(ranks: list[RankSteps], phase: str) -> float | None:
    found = [beyond for rank in ranks if (beyond := _beyond(rank.timed, phase)) is not None]
    return mean(found) if found else None


def _model_bytes(record: dict[str, Any], buckets: tuple[Bucket, ...], exchanged: int) -> int | None:
    """The trained parameters' bytes, whole: as the worker counted them, else as its buckets or one
    round of exchanges carried them."""
    counted = record.get("memory", {}).get("trained_bytes")
    if counted:
        return int(counted)
    return sum(bucket.bytes for bucket in buckets) or exchanged or None


def _other_load(records: list[dict[str, Any]]) -> float | None:
    """Cores other processes kept busy on rank 0's host while it measured (:mod:`phalanx.doctor.load`)."""
    node = records[0].get("node", 0)
    return load.other_load([tuple(r["load"]) for r in records  # type: ignore[misc]
                            if r.get("node", 0) == node and len(r.get("load", ())) == 2])


def global_batches(ranks: list[RankSteps]) -> list[int]:
    """The global batch of each timed step: its samples summed over the ranks."""
    return [sum(step.samples for step in steps) for steps in zip(*(rank.timed for rank in ranks))]


def _buckets(steps: list[Step], figures: dict[str, Any] | None) -> tuple[Bucket, ...]:
    """Rank 0's buckets, their readiness and waits averaged over its timed steps."""
    count = min(len(step.buckets) for step in steps)
    alone = list(figures["bucket_s"]) if figures else []
    return tuple(Bucket(ready_s=mean([step.buckets[i][0] for step in steps]), bytes=steps[0].buckets[i][1],
                        exposed_s=mean([step.buckets[i][2] for step in steps]),
                        alone_s=alone[i] if i < len(alone) else None) for i in range(count))


def norm_samples(records: list[dict[str, Any]]) -> list[tuple[float, float, float, float]]:
    """Every rank's gradient-norm samples, for :func:`phalanx.doctor.noise.estimate`."""
    return [sample for record in records for sample in split_steps(record).norms]

