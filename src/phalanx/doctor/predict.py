"""Predicted step time at other world sizes, layouts and bandwidths, from a measured run.

A worker's step is ``u(L) (c0 + cs b + f) + exposed``, with ``b = B/p`` its share of the global
batch ``B`` at ``p`` workers, ``c0 + cs b`` the data and compute of a local batch of ``b`` samples
(fitted through the run at ``N`` workers and the 1-worker reference run; without one, ``c0 = 0``),
``f`` the optimizer and the rest, and ``u(L) = max(1, L t / cores)`` the slowdown of ``L``
workers of ``t`` threads taking turns on a host's cores. Communication is the alpha-beta model of
the allreduce in use, per bucket (:func:`phalanx.comm.cost.predict`): shared memory within a host,
its time at the measured size scaled by ``u``; Gloo's ring across hosts, every local rank sending
its 1/L slice over the host's one link; then the buckets are replayed in order from the moments
backward made them ready, and what runs past the end of backward is exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from phalanx.comm import cost
from phalanx.doctor.calibrate import LARGE_BYTES, SMALL_BYTES
from phalanx.doctor.measured import Measured


@dataclass(frozen=True)
class Layout:
    """Where ``world_size`` workers run: ``workers_per_host`` a host, hosts linked at ``bandwidth_gbit``
    (``None``: the measured link)."""

    world_size: int
    workers_per_host: int
    bandwidth_gbit: float | None = None

    @property
    def hosts(self) -> int:
        return math.ceil(self.world_size / self.workers_per_host)

    @property
    def local(self) -> int:
        return min(self.world_size, self.workers_per_host)


@dataclass(frozen=True)
class ScalingModel:
    """The fitted figures a prediction needs (seconds; per worker and step unless named otherwise)."""

    global_batch: float
    work_fixed_s: float  # data and compute of a step, the part independent of the local batch
    work_per_sample_s: float
    step_fixed_s: float  # optimizer and everything else
    backward_share: float  # of data + compute
    buckets: tuple[tuple[float, int], ...]  # (ready as a fraction of backward, bytes)
    cores: int
    threads: int
    transport: str
    measured_local: int
    engine: cost.Link | None  # the engine's allreduce within a host at ``measured_local`` ranks
    ring: cost.Link | None  # Gloo's ring between processes
    comm_factor: float = 1.0  # a core each: how much longer the allreduce takes beside backward than alone
    crowded_factor: float = 1.0  # the same with more workers than cores, where it cannot hide behind backward

    def slowdown(self, local: int) -> float:
        """``u(L)``: how much slower each of ``local`` workers runs for sharing the host's cores."""
        return max(1.0, local * self.threads / self.cores)

    def crowding(self, local: int) -> float:
        """How much longer a shared-memory allreduce takes at ``local`` ranks than with a core each:
        ``u(L)²``, as every rank copies its tensor in and out (work growing with the ranks) and gets
        ``1/u`` of a core to do it."""
        return self.slowdown(local) ** 2

    def with_buckets(self, buckets: tuple[tuple[float, int], ...]) -> "ScalingModel":
        return replace(self, buckets=buckets)


def fit(run: Measured, reference: Measured | None = None) -> ScalingModel:
    """The :class:`ScalingModel` of ``run``; ``reference`` (the same script on one worker) separates
    the per-step from the per-sample work."""
    model = ScalingModel(run.global_batch, 0.0, 0.0, 0.0, 0.0, (), run.cores, run.threads, run.transport,
                         run.workers_per_host, *_links(run))
    u = model.slowdown(run.workers_per_host)
    fixed, per_sample = _work(model, run, reference)
    backward = run.backward_s if run.backward_s is not None else 0.0
    ready = tuple((min(b.ready_s / backward, 1.0) if backward > 0 else 1.0, b.bytes) for b in run.buckets)
    model = replace(model, work_fixed_s=fixed, work_per_sample_s=per_sample,
                    step_fixed_s=(run.optimizer_s + run.other_s) / u,
                    backward_share=backward / (run.data_wait_s + run.compute_s) if run.compute_s else 0.0,
                    buckets=ready)
    if model.ring is None:
        return model
    return replace(model, comm_factor=_comm_factor(model, run), crowded_factor=_crowded_factor(model, run))


def _work(model: ScalingModel, run: Measured, reference: Measured | None) -> tuple[float, float]:
    """``(c0, cs)``: a line through the uncontended work at the run's and the reference's local batch
    (without a reference, the work is taken as proportional to the local batch)."""
    work = (run.data_wait_s + run.compute_s) / model.slowdown(run.workers_per_host)
    local = run.global_batch / run.world_size
    fixed = 0.0
    if reference is not None and reference.global_batch > local:
        ref_work = (reference.data_wait_s + reference.compute_s) / model.slowdown(reference.workers_per_host)
        slope = max((ref_work - work) / (reference.global_batch - local), 0.0)
        fixed = max(work - slope * local, 0.0)
    return fixed, (work - fixed) / local


def _crowded_factor(model: ScalingModel, run: Measured) -> float:
    """For a run with more workers than cores: its exposed time over its buckets' time alone (else 1)."""
    if model.slowdown(run.workers_per_host) <= 1:
        return 1.0
    alone = sum(bucket_time(model, Layout(run.world_size, run.workers_per_host), n) for _, n in model.buckets)
    return run.exposed_comm_s / alone if alone > 0 else 1.0


def _comm_factor(model: ScalingModel, run: Measured) -> float:
    """The factor on the buckets' times within the host that makes the replay expose what the run did.

    Beside backward the allreduce competes for the cores and waits for the slowest rank, so it
    takes longer than alone; the factor carries that over to the predictions (bisection, 0.1-1000).
    """
    layout = Layout(run.world_size, run.workers_per_host)
    backward = model.backward_share * (run.data_wait_s + run.compute_s)
    ready = [r for r, _ in model.buckets]
    low, high = 0.1, 1000.0
    for _ in range(40):
        middle = (low * high) ** 0.5
        times = [bucket_time(model, layout, nbytes, middle) for _, nbytes in model.buckets]
        if _exposed(backward, ready, times) < run.exposed_comm_s:
            low = middle
        else:
            high = middle
    return (low * high) ** 0.5


def _links(run: Measured) -> tuple[cost.Link | None, cost.Link | None]:
    figures = run.transport_figures
    if not figures:
        return None, None
    sizes = [SMALL_BYTES, LARGE_BYTES, *figures["bucket_bytes"]]
    times = [figures["engine_small_s"], figures["engine_large_s"], *figures["bucket_s"]]
    return _least_squares(sizes, times), cost.Link(figures["ring_alpha_s"], figures["ring_beta_s_per_byte"])


#: The fixed cost of a shared-memory allreduce: its two arrivals per round (benchmarks/RESULTS.md:
#: 0.08 ms for 4 KB at 2 workers, issue 15's table).
SHARED_MEMORY_ALPHA_S = 80e-6


def shared_memory_link(copy_s_per_byte: float, local: int) -> cost.Link:
    """The shared-memory allreduce of ``local`` ranks predicted from the host's measured copy speed:
    each rank copies every byte in and out, and reduces 1/local of them from ``local`` slots (reading
    all of them, writing 1/local), about half a copy's traffic more (docs/transport.md)."""
    return cost.Link(SHARED_MEMORY_ALPHA_S, copy_s_per_byte * (2 + (local + 1) / (2 * local)))


def _least_squares(sizes: list[int], times: list[float]) -> cost.Link:
    """``alpha + n beta`` through the timed allreduces (neither below zero)."""
    mean_n, mean_t = sum(sizes) / len(sizes), sum(times) / len(times)
    spread = sum((n - mean_n) ** 2 for n in sizes)
    beta = max(sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes, times)) / spread, 0.0) if spread else 0.0
    return cost.Link(max(mean_t - beta * mean_n, 0.0), beta)


@dataclass(frozen=True)
class Prediction:
    """One predicted configuration."""

    layout: Layout
    global_batch: float
    step_s: float
    compute_s: float
    comm_s: float
    exposed_s: float
    throughput: float
    efficiency: float = 1.0

    def as_dict(self) -> dict[str, object]:
        return {"world_size": self.layout.world_size, "workers_per_host": self.layout.workers_per_host,
                "bandwidth_gbit": self.layout.bandwidth_gbit, "global_batch": self.global_batch,
                "step_s": self.step_s, "compute_s": self.compute_s,
                "comm_s": self.comm_s, "exposed_comm_s": self.exposed_s, "throughput": self.throughput,
                "efficiency": self.efficiency}


def predict(model: ScalingModel, layout: Layout, global_batch: float | None = None) -> Prediction:
    """The step at ``layout`` (and ``global_batch``, default the measured one)."""
    batch = model.global_batch if global_batch is None else global_batch
    u = model.slowdown(layout.local)
    work = u * (model.work_fixed_s + model.work_per_sample_s * batch / layout.world_size)
    factor = model.crowded_factor if u > 1 else model.comm_factor
    times = [bucket_time(model, layout, n, factor) for _, n in model.buckets] if layout.world_size > 1 else []
    if u > 1:  # no core is idle: the allreduce cannot hide behind backward
        exposed = sum(times)
    else:
        exposed = _exposed(model.backward_share * work, [r for r, _ in model.buckets], times)
    step = work + u * model.step_fixed_s + exposed
    return Prediction(layout, batch, step, work, sum(times), exposed, batch / step)


def bucket_time(model: ScalingModel, layout: Layout, nbytes: int, factor: float = 1.0) -> float:
    """One bucket's allreduce: within the host (alone, times ``factor``), then across hosts."""
    if model.ring is None:
        raise ValueError("no transport figures: predictions beyond one worker need a run on two or more")
    within = 0.0
    if layout.local > 1:
        if model.transport == "shm" and model.engine is not None and model.measured_local > 1:
            scale = model.crowding(layout.local) / model.crowding(model.measured_local)
            within = scale * (model.engine.alpha_s + nbytes * model.engine.beta_s_per_byte)
        else:
            within = cost.predict("ring", nbytes, layout.local, model.ring)
        within *= factor
    if layout.hosts == 1:
        return within
    beta = model.ring.beta_s_per_byte if layout.bandwidth_gbit is None else 8e-9 / layout.bandwidth_gbit
    across = cost.Link(model.ring.alpha_s, beta * layout.local)  # the local ranks share the host's link
    return within + cost.predict("ring", nbytes // layout.local, layout.hosts, across)


def _exposed(backward_s: float, ready: list[float], times: list[float]) -> float:
    """Replay the buckets in order from their ready moments: the time past the end of backward."""
    end = 0.0
    for fraction, seconds in zip(ready, times):
        end = max(end, fraction * backward_s) + seconds
    return max(end - backward_s, 0.0)


def scaling(model: ScalingModel, layouts: list[Layout], local_batch: float | None = None) -> list[Prediction]:
    """Predictions for ``layouts`` at the measured global batch (strong scaling: efficiency is the
    speed-up over one worker divided by the workers) or, given ``local_batch``, at that many samples
    per worker (weak scaling: one worker's step at that batch over theirs)."""
    found = []
    for layout in layouts:
        if local_batch is None:
            p = predict(model, layout)
            efficiency = predict(model, Layout(1, 1)).step_s / (layout.world_size * p.step_s)
        else:
            p = predict(model, layout, local_batch * layout.world_size)
            efficiency = predict(model, Layout(1, 1), local_batch).step_s / p.step_s
        found.append(replace(p, efficiency=efficiency))
    return found
