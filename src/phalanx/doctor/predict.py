"""Predicted step time at other world sizes, layouts and bandwidths, from the measured runs.

A worker's step is ``u(L) T(b) + exposed``. ``T(b) = t0 + ts b`` is everything but waiting for
the allreduce (data, compute, optimizer, the rest) at a local batch of ``b = B/p`` samples, a
line through the run at ``N`` workers and the 1-worker reference run, so both measured
configurations are reproduced exactly; ``u(L) = max(1, L t / cores)`` is the slowdown of ``L``
workers of ``t`` threads taking turns on a host's cores. Communication is the alpha-beta model of
the allreduce in use, per bucket (:func:`phalanx.comm.cost.predict`): shared memory within a host,
its time at the measured size scaled for the ranks taking part; Gloo's ring across hosts, every
local rank sending its 1/L slice over the host's one link; then the buckets are replayed in order
from the moments backward made them ready, and what runs past the end of backward is exposed.
Under px.LocalSGD and px.DiLoCo (the run's schedule: ``fragments`` exchanges every ``period``
steps) nothing is reduced in backward: an exchange is one allreduce of 1/``fragments`` of the
model, hidden behind the ``delay`` inner steps that compute while it crosses, and what it does not
hide is spread over the period.

Some rows cannot be predicted from two runs, and :func:`unpredictable` says why: more workers
than cores (how the OS interleaves them and their lockstep allreduces is not a line) unless that
was the measured count, and local batches where the line through the runs stops being believable
(the runs disagree: a larger batch took less time, as when the host's other load changed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from phalanx.comm import cost
from phalanx.doctor.calibrate import LARGE_BYTES, SMALL_BYTES
from phalanx.doctor.measured import Measured
from phalanx.strategies.base import Exchanges


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

    global_batch: int
    fixed_s: float  # T's part independent of the local batch, on a core of its own
    per_sample_s: float  # T's slope; below zero when the two runs disagree
    optimizer_s: float  # the optimizer step, on a core of its own (paid once per accumulated batch)
    backward_share: float  # of T
    buckets: tuple[tuple[float, int], ...]  # (ready as a fraction of backward, bytes)
    cores: int
    threads: int
    transport: str
    measured_world: int
    measured_local: int
    engine: cost.Link | None  # the engine's allreduce within a host at ``measured_local`` ranks
    ring: cost.Link | None  # Gloo's ring between processes
    comm_factor: float = 1.0  # a core each: how much longer the allreduce takes beside backward than alone
    crowded_factor: float = 1.0  # the same with more workers than cores, where it cannot hide behind backward
    other_load: float | None = None  # cores other processes kept busy while either run measured, at most
    #: How often px.LocalSGD/px.DiLoCo exchange, for a model whose workers step on their own (then
    #: ``buckets`` is empty); ``None``: gradients reduced in every backward.
    schedule: Exchanges | None = None
    model_bytes: int = 0  # the trained parameters, whole: what an exchange of the whole model sends

    @property
    def busy(self) -> bool:
        """Whether other processes took enough of the host for the runs to say nothing about any run."""
        return self.other_load is not None and self.other_load > BUSY_SHARE * self.cores

    def measured_as(self, layout: Layout) -> str | None:
        """Which measured run ``layout`` is (its row reproduces it), or None for the model's rows."""
        if layout == Layout(1, 1):
            return "the 1-worker run"
        if layout == Layout(self.measured_world, self.measured_local):
            return "this run"
        return None

    def slowdown(self, local: int) -> float:
        """``u(L)``: how much slower each of ``local`` workers runs for sharing the host's cores."""
        return max(1.0, local * self.threads / self.cores)

    def crowding(self, local: int) -> float:
        """How much longer a shared-memory allreduce takes at ``local`` ranks than with a core each:
        ``u(L)²``, as every rank copies its tensor in and out (work growing with the ranks) and gets
        ``1/u`` of a core to do it."""
        return self.slowdown(local) ** 2

    def own_step(self, local_batch: float) -> float:
        """``T(b)``: a step without the allreduce's wait, on a core of its own."""
        return self.fixed_s + self.per_sample_s * local_batch

    def with_buckets(self, buckets: tuple[tuple[float, int], ...]) -> "ScalingModel":
        return replace(self, buckets=buckets)


def fit(run: Measured, reference: Measured | None = None) -> ScalingModel:
    """The :class:`ScalingModel` of ``run``; ``reference`` (the same script on one worker) separates
    the per-step from the per-sample work (without it, ``T`` is taken as proportional to the batch)."""
    model = ScalingModel(run.global_batch, 0.0, 0.0, 0.0, 0.0, (), run.cores, run.threads, run.transport,
                         run.world_size, run.workers_per_host, *_links(run))
    u = model.slowdown(run.workers_per_host)
    fixed, per_sample = _line(model, run, reference)
    backward = run.backward_s if run.backward_s is not None else 0.0
    ready = tuple((min(b.ready_s / backward, 1.0) if backward > 0 else 1.0, b.bytes) for b in run.buckets)
    loads = [m.other_load for m in (run, reference) if m is not None and m.other_load is not None]
    model = replace(model, fixed_s=fixed, per_sample_s=per_sample, optimizer_s=run.optimizer_s / u,
                    backward_share=backward / run.own_step_s if run.own_step_s > 0 else 0.0, buckets=ready,
                    other_load=max(loads, default=None), schedule=run.schedule if run.local_steps else None,
                    model_bytes=run.model_bytes or 0)
    if model.ring is None or (model.schedule is not None and not run.exchanges):  # nothing timed to fit to
        return model
    return replace(model, comm_factor=_comm_factor(model, run), crowded_factor=_crowded_factor(model, run))


def _line(model: ScalingModel, run: Measured, reference: Measured | None) -> tuple[float, float]:
    """``(t0, ts)``: the line through ``T`` at the run's and the reference's local batch, each
    measured step without its exposed allreduce and divided by its slowdown."""
    local = run.global_batch / run.world_size
    own = run.own_step_s / model.slowdown(run.workers_per_host)
    if reference is None or reference.global_batch == local:
        return 0.0, own / local
    ref_own = reference.step_s / model.slowdown(reference.workers_per_host)
    slope = (ref_own - own) / (reference.global_batch - local)
    return own - slope * local, slope


#: Other processes keeping more than this share of the host's cores busy make it too busy to predict.
BUSY_SHARE = 0.1


def unpredictable(model: ScalingModel, layout: Layout) -> str | None:
    """Why ``layout`` cannot be predicted from the measured runs (``None``: it can)."""
    if model.busy:  # even a measured layout's next run may differ several times over
        return (f"the host was busy: other processes kept {model.other_load:.1f} of its {model.cores} cores busy while "
                "measuring, and what they will take from any run cannot be told; rerun on a quiet host")
    if model.measured_as(layout) is not None:
        return None  # the line and the allreduce's factor reproduce the measured runs
    if model.slowdown(layout.local) > 1 and layout.local != model.measured_local:
        return (f"more workers x threads than the {model.cores} cores take turns in ways two runs cannot tell; "
                "measure such a count: phalanx doctor -n WORKERS")
    local_batch = model.global_batch / layout.world_size if layout.hosts == 1 else None
    if local_batch is None or local_batch in (model.global_batch, model.global_batch / model.measured_world):
        return None  # a measured local batch: the line passes through it
    if model.per_sample_s < 0:
        return (f"the runs at 1 and {model.measured_world} workers disagree (the larger batch took less time: was the "
                "host's other load changing?); rerun on a quiet host")
    if model.own_step(local_batch) < 0.5 * model.per_sample_s * local_batch:
        return f"a local batch of {local_batch:g} is too far from the measured ones for their line to hold"
    return None


def _crowded_factor(model: ScalingModel, run: Measured) -> float:
    """For a run with more workers than cores: its exposed time over its buckets' time alone (else 1)."""
    if model.slowdown(run.workers_per_host) <= 1:
        return 1.0
    alone, _ = _communication(model, Layout(run.world_size, run.workers_per_host), run.own_step_s, 1.0, False)
    return run.exposed_comm_s / alone if alone > 0 else 1.0


def _comm_factor(model: ScalingModel, run: Measured) -> float:
    """The factor on the allreduce's times within the host that makes the model expose what the run did.

    Beside backward (or the inner steps an exchange overlaps) the allreduce competes for the cores
    and waits for the slowest rank, so it takes longer than alone; the factor carries that over to
    the predictions (bisection, 0.1-1000).
    """
    layout = Layout(run.world_size, run.workers_per_host)
    low, high = 0.1, 1000.0
    for _ in range(40):
        middle = (low * high) ** 0.5
        if _communication(model, layout, run.own_step_s, middle, True)[1] < run.exposed_comm_s:
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


def shared_memory_traffic(local: int) -> float:
    """Copies of each byte a rank makes in a shared-memory allreduce of ``local`` ranks: it copies every
    byte in and out, and reduces 1/local of them from ``local`` slots (reading all of them, writing
    1/local), about half a copy's traffic more (docs/transport.md)."""
    return 2 + (local + 1) / (2 * local)


def shared_memory_link(copy_s_per_byte: float, local: int) -> cost.Link:
    """The shared-memory allreduce of ``local`` ranks predicted from the host's measured copy speed."""
    return cost.Link(SHARED_MEMORY_ALPHA_S, copy_s_per_byte * shared_memory_traffic(local))


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
    work_s: float  # everything but the exposed allreduce
    comm_s: float
    exposed_s: float
    throughput: float
    efficiency: float = 1.0

    def as_dict(self) -> dict[str, object]:
        return {"world_size": self.layout.world_size, "workers_per_host": self.layout.workers_per_host,
                "bandwidth_gbit": self.layout.bandwidth_gbit, "global_batch": self.global_batch,
                "step_s": self.step_s, "work_s": self.work_s,
                "comm_s": self.comm_s, "exposed_comm_s": self.exposed_s, "throughput": self.throughput,
                "efficiency": self.efficiency}


def predict(model: ScalingModel, layout: Layout, global_batch: float | None = None) -> Prediction:
    """The step at ``layout`` (and ``global_batch``, default the measured one); see :func:`unpredictable`
    for the layouts where this is a guess."""
    batch = model.global_batch if global_batch is None else global_batch
    u = model.slowdown(layout.local)
    own = u * max(model.own_step(batch / layout.world_size), 0.0)
    factor = model.crowded_factor if u > 1 else model.comm_factor
    comm, exposed = _communication(model, layout, own, factor, u <= 1)  # u > 1: no idle core to hide it
    step = own + exposed
    return Prediction(layout, batch, step, own, comm, exposed, batch / step)


def _communication(model: ScalingModel, layout: Layout, own_s: float, factor: float,
                   overlap: bool) -> tuple[float, float]:
    """Seconds of communication per step at ``layout`` for a step of ``own_s`` without it, and how many
    of them are exposed: the buckets replayed against backward, or the exchanges of the schedule,
    each hidden behind its ``delay`` inner steps (nothing hides without ``overlap``)."""
    if layout.world_size == 1:
        return 0.0, 0.0
    schedule = model.schedule
    if schedule is not None:
        each = bucket_time(model, layout, model.model_bytes // schedule.fragments, factor)
        hidden = schedule.delay * own_s if overlap else 0.0
        return each * schedule.share, max(each - hidden, 0.0) * schedule.share
    times = [bucket_time(model, layout, n, factor) for _, n in model.buckets]
    if not overlap:
        return sum(times), sum(times)
    return sum(times), _exposed(model.backward_share * own_s, [r for r, _ in model.buckets], times)


def exchange_time(model: ScalingModel, layout: Layout, nbytes: int) -> float:
    """One allreduce of ``nbytes`` in one piece at ``layout``, as the model predicts the run's own:
    an exchange of px.LocalSGD or px.DiLoCo."""
    factor = model.crowded_factor if model.slowdown(layout.local) > 1 else model.comm_factor
    return bucket_time(model, layout, nbytes, factor)


def bucket_time(model: ScalingModel, layout: Layout, nbytes: int, factor: float = 1.0) -> float:
    """One bucket's allreduce: within the host (alone, times ``factor``), then across hosts."""
    if model.ring is None:
        raise ValueError("no transport figures: predictions beyond one worker need a run on two or more")
    within = 0.0
    if layout.local > 1:
        if model.transport == "shm" and model.engine is not None and model.measured_local > 1:
            scale = (model.crowding(layout.local) * shared_memory_traffic(layout.local)
                     / (model.crowding(model.measured_local) * shared_memory_traffic(model.measured_local)))
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
