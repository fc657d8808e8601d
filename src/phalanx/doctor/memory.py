"""The doctor's memory figures: what a worker held in the run, what each sharding level would hold at
each worker count the doctor predicts, and the lowest level that fits the host's memory.

Measured (:mod:`phalanx.doctor.footprint`, every rank; the largest rank's figures are reported, the
worker that needs the most decides what fits): parameters, gradients (between steps, and at the
step), optimizer state and the activations one forward saved, in tensor bytes.

Predicted, for each level (0: px.DataParallel, 1-3: px.Sharded) and layout, from the model's
trained bytes and the whole optimizer state measured (every rank's chunks summed where it was
sharded): :func:`phalanx.strategies.base.held_per_worker`, with the units in host shared memory
where every worker is on one CPU host and, between hosts, once per host at the levels where
px.Sharded keeps them so (:func:`phalanx.strategies.base.one_copy_per_host`; not unless the run
reduced through shared memory), plus the activations scaled to the layout's batch per worker (the
measured forward's bytes per sample), plus, for an elastic run, what its commits keep
(:func:`phalanx.strategies.base.elastic_copies_per_worker`). A level *fits* where its need at the
step (parameters, the step's whole gradient buckets, optimizer state, activations, copies) is within
:data:`HOST_SHARE` of the host's memory divided by the workers on it; the rest is headroom for what
no tensor count sees (see docs/doctor.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from phalanx.doctor.predict import Layout
from phalanx.strategies.base import SHARDING_LEVELS, elastic_copies_per_worker, held_per_worker, one_copy_per_host

logger = logging.getLogger(__name__)

#: Share of a worker's part of the host's memory (MemTotal / workers on the host) that the counted
#: tensors may take: the rest is for what no count sees (transient tensors of the step, the
#: process's own memory, the allocator's, the system's); docs/doctor.md gives the figures behind it.
HOST_SHARE = 0.5


@dataclass(frozen=True)
class MeasuredMemory:
    """What one worker held in the run, in bytes (the largest rank's), and what predictions need."""

    parameters: float
    gradients: float  # between steps
    step_gradients: float  # after backward, as the optimizer starts
    optimizer_state: float
    strategy: float  # what the strategy keeps beside (px.LocalSGD's exchange buffers, px.DiLoCo's outer state)
    activations: float  # saved for backward by one forward of ``activation_samples`` samples
    activation_samples: int
    parameter_count: int
    weights: float  # the model's trained parameters, whole
    state: float  # the optimizer's state, whole (summed over ranks where sharded)
    level: int
    shared: bool
    elastic: bool
    world_size: int
    copies: float  # per worker, what an elastic commit keeps (the run's, or if it were elastic)
    host_memory: int | None
    one_host: bool = True  # every worker of the run on one host (px.Sharded's copies in host memory)

    @property
    def total(self) -> float:
        """Held between steps: parameters, gradients, optimizer state and the strategy's own."""
        return self.parameters + self.gradients + self.optimizer_state + self.strategy

    def per_parameter(self, value: float) -> float:
        """``value`` in bytes per parameter of the whole model."""
        return value / self.parameter_count if self.parameter_count else 0.0

    def as_dict(self) -> dict[str, Any]:
        kinds = {"parameters": self.parameters, "gradients": self.gradients, "step_gradients": self.step_gradients,
                 "optimizer_state": self.optimizer_state, "strategy": self.strategy, "activations": self.activations,
                 "copies": self.copies, "total": self.total}
        return {**{f"{kind}_bytes": value for kind, value in kinds.items()},
                "bytes_per_parameter": {kind: self.per_parameter(value) for kind, value in kinds.items()},
                "activation_samples": self.activation_samples, "parameter_count": self.parameter_count,
                "weights_bytes": self.weights, "optimizer_state_whole_bytes": self.state, "level": self.level,
                "shared": self.shared, "elastic": self.elastic, "copies_if_elastic": not self.elastic,
                "host_memory_bytes": self.host_memory}


@dataclass(frozen=True)
class LevelNeed:
    """One sharding level at one layout: bytes per worker between steps and at the step (with activations
    and copies), and whether that fits the budget (``None``: the host's memory is not known)."""

    level: int
    held: float
    at_step: float
    fits: bool | None

    def as_dict(self) -> dict[str, Any]:
        return {"level": self.level, "held_bytes": self.held, "at_step_bytes": self.at_step, "fits": self.fits}


@dataclass(frozen=True)
class MemoryRow:
    """The memory each level needs per worker at one layout, and the lowest level that fits."""

    layout: Layout
    local_batch: float
    activations: float
    budget: float | None  # bytes a worker may hold: HOST_SHARE of its part of the host's memory
    levels: tuple[LevelNeed, ...]

    @property
    def lowest_fitting(self) -> int | None:
        return next((need.level for need in self.levels if need.fits), None)

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.layout.world_size, "workers_per_host": self.layout.workers_per_host,
                "local_batch": self.local_batch, "activations_bytes": self.activations, "budget_bytes": self.budget,
                "levels": [need.as_dict() for need in self.levels], "lowest_fitting_level": self.lowest_fitting}


@dataclass(frozen=True)
class MemoryReport:
    """The measured figures, the predicted rows, and the level recommended for the measured layout."""

    measured: MeasuredMemory
    rows: list[MemoryRow]
    measured_layout: Layout
    host_memory: int | None

    @property
    def recommended_level(self) -> int | None:
        """The lowest level that fits at the measured layout (``None``: none fits, or unknown)."""
        row = next((r for r in self.rows if r.layout == self.measured_layout), None)
        return row.lowest_fitting if row is not None else None

    def as_dict(self) -> dict[str, Any]:
        return {"measured": self.measured.as_dict(), "predicted": [row.as_dict() for row in self.rows],
                "host_memory_bytes": self.host_memory, "host_share": HOST_SHARE,
                "recommended_level": self.recommended_level,
                "measured_layout": {"world_size": self.measured_layout.world_size,
                                    "workers_per_host": self.measured_layout.workers_per_host}}


def measure(records: list[dict[str, Any]]) -> MeasuredMemory | None:
    """The run's memory from its ranks' records (``None`` where no rank counted its tensors)."""
    counted = [r["memory"] for r in records if r.get("memory")]
    if len(counted) != len(records) or not counted:
        logger.info("doctor: %d of %d ranks counted their tensors; no memory figures", len(counted), len(records))
        return None
    largest = max(counted, key=lambda m: m["parameters"] + m["gradients"] + m["optimizer_state"] + m.get("strategy", 0)
                  + m["activations"])
    first = counted[0]
    level, world = int(first["level"]), int(records[0].get("world_size", 1))
    state = sum(m["optimizer_state"] for m in counted) if level > 0 else largest["optimizer_state"]
    one_host = int(records[0].get("local_size", 1)) == world
    return MeasuredMemory(
        parameters=largest["parameters"], gradients=largest["gradients"], step_gradients=largest["step_gradients"],
        optimizer_state=largest["optimizer_state"], strategy=largest.get("strategy", 0.0),
        activations=largest["activations"],
        activation_samples=int(largest["activation_samples"]), parameter_count=int(first["parameter_count"]),
        weights=float(first["trained_bytes"]), state=float(state), level=level, shared=bool(first["shared"]),
        elastic=bool(first["elastic"]), world_size=world,
        copies=elastic_copies_per_worker(float(first["trained_bytes"]), float(state), level, world, one_host),
        host_memory=records[0]["host"].get("memory_bytes"), one_host=one_host)


def budget(host_memory: int | None, workers_per_host: int) -> float | None:
    """Bytes a worker's counted tensors may take: :data:`HOST_SHARE` of the host's memory over its workers."""
    return None if not host_memory else HOST_SHARE * host_memory / workers_per_host


def predict(measured: MeasuredMemory, layouts: Sequence[Layout], local_batches: Sequence[float],
            shares_host_memory: bool = True, host_memory: int | None = None) -> list[MemoryRow]:
    """Each level's memory per worker at each of ``layouts`` (at ``local_batches`` samples per worker,
    one per layout) and the lowest that fits. ``shares_host_memory``: px.Sharded would keep its units
    in host shared memory on one host (the run reduced through it, or measured one worker);
    ``host_memory``: the bytes of a host, by default the measured host's."""
    memory = host_memory if host_memory is not None else measured.host_memory
    per_sample = measured.activations / measured.activation_samples if measured.activation_samples else 0.0
    rows = []
    for layout, local_batch in zip(layouts, local_batches):
        workers, one_host = layout.world_size, layout.hosts == 1
        activations = per_sample * local_batch
        limit = budget(memory, layout.local)
        needs = []
        for level in SHARDING_LEVELS:
            replicas = shares_host_memory and not one_host and not measured.elastic and one_copy_per_host(
                measured.weights, measured.state, level, workers, layout.local)
            shared = shares_host_memory and workers > 1 and (one_host or replicas)
            sharing = layout.local if replicas else workers
            held = held_per_worker(measured.weights, measured.state, level, sharing, shared)
            copies = elastic_copies_per_worker(measured.weights, measured.state, level, workers, one_host) \
                if measured.elastic else 0.0
            at_step = held.at_step + activations + copies
            needs.append(LevelNeed(level, held.total, at_step, None if limit is None else at_step <= limit))
        rows.append(MemoryRow(layout, local_batch, activations, limit, tuple(needs)))
    return rows


def report(records: list[dict[str, Any]], global_batch: int, on_host: Sequence[Layout], across: Sequence[Layout],
           transport: str, host_memory: int | None = None) -> MemoryReport | None:
    """The memory section of a diagnosis: the run's records measured, then predicted on this host at
    the measured ``global_batch`` and across hosts at the measured batch per worker (one row per
    layout, whatever the link), with ``host_memory`` bytes a host (default: the measured host's)."""
    measured = measure(records)
    if measured is None:
        return None
    rows = list(dict.fromkeys(Layout(layout.world_size, layout.workers_per_host) for layout in [*on_host, *across]))
    local = global_batch / measured.world_size
    batches = [global_batch / layout.world_size if layout.hosts == 1 else local for layout in rows]
    on_cpu = all(r["memory"].get("device", "cpu") == "cpu" for r in records)
    shares = on_cpu and (transport == "shm" or measured.world_size == 1)
    local_size = int(records[0].get("local_size", 1))
    return MemoryReport(measured, predict(measured, rows, batches, shares, host_memory),
                        Layout(measured.world_size, local_size), host_memory or measured.host_memory)
