"""What a doctor run measured, over all ranks: the step's phases, the buckets, the transport, the host.

Phases are means over each rank's timed steps, then over ranks (the ranks run in lockstep, so
their step times agree; how they split them may not). Buckets and transport figures are rank 0's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from phalanx.doctor.records import Step, mean, split_steps


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
    global_batch: float
    step_s: float
    data_wait_s: float
    forward_s: float | None
    backward_s: float | None
    compute_s: float
    exposed_comm_s: float
    optimizer_s: float
    other_s: float
    cpu_s: float
    steps: int
    buckets: tuple[Bucket, ...]
    transport_figures: dict[str, Any] | None

    @property
    def bytes_per_step(self) -> int:
        return sum(bucket.bytes for bucket in self.buckets)

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
                      overlapped=self.overlapped, oversubscription=self.oversubscription,
                      throughput=self.global_batch / self.step_s if self.step_s else 0.0)
        return fields


def summarize(records: list[dict[str, Any]]) -> Measured:
    """The :class:`Measured` figures of one run from its ranks' records."""
    records = sorted(records, key=lambda r: r["rank"])
    ranks = [split_steps(record) for record in records]
    first, host = records[0], records[0]["host"]

    def per_rank(phase: str) -> float:
        return mean([mean([getattr(step, phase) for step in rank.timed]) for rank in ranks])

    forwards = [s.forward_s for r in ranks for s in r.timed if s.forward_s is not None]
    compute = per_rank("compute_s")
    return Measured(
        world_size=int(first.get("world_size", 1)), workers_per_host=int(first.get("local_size", 1)),
        cores=int(host["cores"]), threads=int(host["threads"]), transport=str(first.get("transport", "none")),
        global_batch=sum(mean([float(s.samples) for s in rank.timed]) for rank in ranks),
        step_s=per_rank("step_s"), data_wait_s=per_rank("data_s"),
        forward_s=mean(forwards) if forwards else None, backward_s=compute - mean(forwards) if forwards else None,
        compute_s=compute, exposed_comm_s=per_rank("exposed_s"), optimizer_s=per_rank("optimizer_s"),
        other_s=per_rank("other_s"), cpu_s=per_rank("cpu_s"), steps=len(ranks[0].timed),
        buckets=_buckets(ranks[0].timed, first.get("transport_figures")),
        transport_figures=first.get("transport_figures"))


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

