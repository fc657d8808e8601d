"""Why the step is slow (causes) and what to change (recommendations ranked by predicted gain).

Every recommendation is a variant of the measured configuration predicted by the same scaling
model (:mod:`phalanx.doctor.predict`), so its gain is the model's step now over its step then,
for the same samples: the global batch stays unless the recommendation is about the batch.

Over a slow link (``--bandwidth``) the run is also predicted between two hosts like this one
(:func:`link_check`): where px.DataParallel's step there mostly waits for the allreduce, px.DiLoCo
is recommended with the smallest round period whose exchange of the whole model, spread over the
period, is within a tenth of the compute (and Streaming DiLoCo where fragments hide it further);
a run that already exchanges every few steps is told whether its period hides the link. Their
gain is per step against the run's strategy there: DiLoCo changes the optimization, so the
samples to a given loss differ, which the note says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from phalanx.doctor.measured import Measured
from phalanx.doctor.noise import NoiseScale
from phalanx.comm import shm
from phalanx.doctor.predict import (Layout, ScalingModel, exchange_time, predict, shared_memory_link,
                                    unpredictable)
from phalanx.strategies.base import Exchanges

MIN_GAIN = 1.03  # below this a change is within the model's error
SHARE_WORTH_NAMING = 0.2  # a phase taking this share of the step is named as a cause
#: The periods recommended for px.LocalSGD/px.DiLoCo: the smallest that hides the link, rounded up to one of these.
ROUND_PERIODS = (5, 10, 20, 25, 50, 100, 200, 500)
#: Fragment counts weighed for Streaming DiLoCo (at most the period).
FRAGMENTS = (2, 4, 5, 10)
#: A period hides the link where the exchange, spread over it, is at most this share of the compute.
HIDDEN_SHARE = 0.1
#: Beyond this share of a px.DataParallel step waiting for the allreduce, DiLoCo is recommended.
DOMINATED_SHARE = 0.5
#: What the recommendation of a change of strategy says about the optimization.
OPTIMIZATION_NOTE = ("it changes the optimization: the loss per sample differs from synchronous training's, so check "
                     "it (docs/strategies.md, 'Training over slow links', has the table)")


@dataclass(frozen=True)
class Recommendation:
    """One change, what it predicts, and by how much it would shorten training."""

    kind: str  # workers, fusion, compression, transport, accumulation, batch_size, diloco, streaming, period
    action: str
    step_s: float  # predicted seconds per step of the measured global batch (per that many samples)
    gain: float  # predicted time to train now over time with the change
    note: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "action": self.action, "step_s": self.step_s, "gain": self.gain, "note": self.note}


def causes(run: Measured, reference: Measured | None, model: ScalingModel | None) -> list[str]:
    """What makes this run's step slow, largest effect first where it can be told."""
    found = []
    if reference is not None and reference.step_s < run.step_s:
        found.append(f"{run.world_size} workers take {run.step_s * 1e3:.1f} ms per step of {run.global_batch:g} samples "
                     f"where 1 worker takes {reference.step_s * 1e3:.1f} ms: more workers are slower here")
    if run.oversubscription > 1:
        found.append(f"oversubscription: {run.workers_per_host} workers x {run.threads} thread(s) on {run.cores} cores, "
                     f"so each worker computes about {run.oversubscription:.1f}x slower than on a core of its own")
    if run.step_s and run.exposed_comm_s / run.step_s > SHARE_WORTH_NAMING and run.local_steps:
        found.append(f"communication: {run.exposed_comm_s * 1e3:.1f} ms a step on average waits for {run.strategy}'s "
                     f"exchanges ({(run.exchange_wait_s or 0) * 1e3:.1f} ms each, {run.exchange_bytes / 1e6:.2f} MB; "
                     f"{100 * run.exposed_comm_s / run.step_s:.0f}% of the step)")
    elif run.step_s and run.exposed_comm_s / run.step_s > SHARE_WORTH_NAMING:
        found.append(f"per-step communication: {run.exposed_comm_s * 1e3:.1f} ms of every step waits for the allreduce "
                     f"of {run.bytes_per_step / 1e6:.2f} MB in {len(run.buckets)} bucket(s) "
                     f"({100 * run.exposed_comm_s / run.step_s:.0f}% of the step)")
    if run.step_s and run.data_wait_s / run.step_s > SHARE_WORTH_NAMING / 2:
        found.append(f"data starvation: {run.data_wait_s * 1e3:.1f} ms per step waiting for the next batch; raise "
                     "num_workers or prefetch of the DistributedLoader")
    if model is not None and model.fixed_s > model.per_sample_s * run.global_batch / run.world_size:
        found.append(f"tiny local batch: {run.global_batch / run.world_size:g} samples per worker cost less than the "
                     f"fixed {model.fixed_s * 1e3:.1f} ms every step pays whatever the batch")
    return found


def recommend(run: Measured, model: ScalingModel | None, scale: NoiseScale | None,
              link_checks: Sequence[LinkCheck] = ()) -> list[Recommendation]:
    """Every change predicted to gain at least :data:`MIN_GAIN`, best first (none from a busy host's runs);
    for each of ``link_checks`` (:func:`link_check` at a bandwidth between hosts), a period of px.DiLoCo
    that hides the link."""
    if model is None or model.busy:
        return []
    now = predict(model, Layout(run.world_size, run.workers_per_host)).step_s
    found = [*_fewer_workers(run, model, now), *_fusion(run, model, now), *_compression(run, model, now),
             *_transport(run, model, now)]
    if scale is not None:  # a larger batch helps only as far as the noise scale says
        found += [*_accumulation(run, model, now, scale), *_batch_size(run, model, now, scale)]
    for check in link_checks:
        found += _local_steps(run, model, check)
    return sorted((r for r in found if r.gain >= MIN_GAIN), key=lambda r: r.gain, reverse=True)


@dataclass(frozen=True)
class LinkCheck:
    """The run's strategy predicted between hosts like this one at a given bandwidth: its step, the
    compute and the exposed communication in it, one exchange of the whole model, and the period
    that would hide that exchange."""

    layout: Layout
    global_batch: float  # the measured batch per worker on every worker
    strategy: str
    schedule: Exchanges
    step_s: float
    compute_s: float  # everything but the exposed communication
    exposed_s: float
    exchange_s: float  # one allreduce of the whole model's parameters
    model_bytes: int
    period: int | None  # the smallest round period that hides the exchange (None: none up to 500)

    @property
    def dominated(self) -> bool:
        """Whether the step mostly waits for the network."""
        return self.exposed_s > DOMINATED_SHARE * self.step_s

    @property
    def hidden(self) -> bool:
        """Whether what the step waits for the network is within :data:`HIDDEN_SHARE` of its compute."""
        return self.exposed_s <= HIDDEN_SHARE * self.compute_s

    def verdict(self) -> str:
        """The check in words, as the report says it."""
        layout = self.layout
        where = (f"at {layout.bandwidth_gbit:g} Gbit/s between {layout.hosts} hosts like this one "
                 f"({layout.world_size} workers)")
        said = (f"{where}: {self.strategy} {_ms(self.step_s)} a step, {_ms(self.exposed_s)} of it waiting for the "
                f"network ({100 * self.exposed_s / self.step_s:.0f}%); one exchange of the whole model "
                f"({self.model_bytes / 1e6:.2f} MB) takes {_ms(self.exchange_s)} against {_ms(self.compute_s)} of "
                "compute a step, so ")
        said += (f"a period of {self.period} or more hides it" if self.period is not None else
                 f"no period up to {ROUND_PERIODS[-1]} hides it")
        if self.schedule.period == 1 and self.schedule.fragments == 1:
            return said
        return said + (f"; this run's period of {self.schedule.period} {'hides' if self.hidden else 'does not hide'} "
                       f"it ({100 * self.exposed_s / self.compute_s:.0f}% of the compute waits)")

    def as_dict(self) -> dict[str, object]:
        return {"world_size": self.layout.world_size, "workers_per_host": self.layout.workers_per_host,
                "bandwidth_gbit": self.layout.bandwidth_gbit, "global_batch": self.global_batch,
                "strategy": self.strategy, "step_s": self.step_s,
                "compute_s": self.compute_s, "exposed_comm_s": self.exposed_s, "exchange_s": self.exchange_s,
                "model_bytes": self.model_bytes, "hiding_period": self.period, "hidden": self.hidden,
                "verdict": self.verdict()}


def link_check(run: Measured, model: ScalingModel | None, bandwidth_gbit: float) -> LinkCheck | None:
    """The run between hosts like this one (two, or as many as it ran on) at ``bandwidth_gbit``, its
    measured workers each at the measured batch per worker; ``None`` where it cannot be predicted."""
    if model is None or model.ring is None or not model.model_bytes:
        return None
    local = run.workers_per_host
    layout = Layout(max(2, math.ceil(run.world_size / local)) * local, local, bandwidth_gbit)
    if unpredictable(model, layout) is not None:
        return None
    batch = run.global_batch / run.world_size * layout.world_size
    step = predict(model, layout, batch)
    whole = exchange_time(model, layout, model.model_bytes)
    return LinkCheck(layout, batch, run.strategy, run.schedule, step.step_s, step.work_s, step.exposed_s, whole,
                     model.model_bytes, hiding_period(whole, step.work_s))


def hiding_period(exchange_s: float, compute_s: float) -> int | None:
    """The smallest of :data:`ROUND_PERIODS` with ``exchange_s / period`` within :data:`HIDDEN_SHARE`
    of ``compute_s`` (``None``: none of them)."""
    return next((period for period in ROUND_PERIODS if exchange_s / period <= HIDDEN_SHARE * compute_s), None)


def _local_steps(run: Measured, model: ScalingModel, check: LinkCheck) -> list[Recommendation]:
    """px.DiLoCo (and its streaming form) where px.DataParallel's step waits mostly for the link;
    a longer period where the run's own does not hide it."""
    period = check.period or ROUND_PERIODS[-1]
    where = f"between {check.layout.hosts} hosts at {check.layout.bandwidth_gbit:g} Gbit/s"
    hides = (f"an exchange of the whole model takes {_ms(check.exchange_s)}, {_ms(check.exchange_s / period)} a step, "
             + (f"within {100 * HIDDEN_SHARE:.0f}% of the {_ms(check.compute_s)} of compute" if check.period else
                f"still over {100 * HIDDEN_SHARE:.0f}% of the {_ms(check.compute_s)} of compute"))
    if run.local_steps:
        if check.hidden or period <= run.schedule.period:
            return []
        schedule = replace(run.schedule, period=period)
        family = run.strategy.split("(")[0]
        streaming = (f", fragments={schedule.fragments}, delay={schedule.delay}"
                     if schedule.fragments > 1 or schedule.delay else "")
        then = predict(replace(model, schedule=schedule), check.layout, check.global_batch).step_s
        return [Recommendation("period", f"{family}(period={period}{streaming}) {where}: one exchange every {period} "
                               f"steps instead of every {run.schedule.period}", then, check.step_s / then,
                               f"{hides}; each worker drifts further between exchanges: check the loss per sample")]
    if not check.dominated:
        return []
    diloco = predict(replace(model, schedule=Exchanges(period)), check.layout, check.global_batch).step_s
    found = [Recommendation(
        "diloco", f"px.fit(..., strategy=px.DiLoCo(period={period})) {where}: the whole model exchanged every "
        f"{period} steps instead of the gradients every step", diloco, check.step_s / diloco,
        f"predicted {_ms(diloco)} a step against {run.strategy}'s {_ms(check.step_s)} there; {hides}; "
        f"{OPTIMIZATION_NOTE}")]
    fragments = [f for f in FRAGMENTS if f <= period]
    count = next((f for f in fragments if exchange_time(model, check.layout, model.model_bytes // f)
                  <= check.compute_s), fragments[-1])
    streaming = predict(replace(model, schedule=Exchanges(period, count, 1)), check.layout, check.global_batch).step_s
    if diloco / streaming >= MIN_GAIN:
        fragment = exchange_time(model, check.layout, model.model_bytes // count)
        found.append(Recommendation(
            "streaming", f"px.fit(..., strategy=px.DiLoCo(period={period}, fragments={count})) {where}: {count} "
            f"exchanges every {period} steps, each of 1/{count} of the model, overlapping the next inner step",
            streaming, check.step_s / streaming,
            f"a fragment takes {_ms(fragment)} against {_ms(check.compute_s)} of compute a step; the fragments are "
            f"merged at staggered steps; {OPTIMIZATION_NOTE}"))
    return found


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _fewer_workers(run: Measured, model: ScalingModel, now: float) -> list[Recommendation]:
    if run.world_size > run.workers_per_host:  # several hosts: fewer workers is not a local choice
        return []
    candidates = [p for p in range(1, run.world_size) if unpredictable(model, Layout(p, p)) is None]
    best = min(candidates, key=lambda p: predict(model, Layout(p, p)).step_s, default=None)
    if best is None:
        return []
    step = predict(model, Layout(best, best)).step_s
    return [Recommendation("workers", f"run {best} worker(s) on this host instead of {run.world_size} "
                           f"({run.cores} cores, {run.threads} thread(s) each)", step, now / step)]


def _fusion(run: Measured, model: ScalingModel, now: float) -> list[Recommendation]:
    if len(model.buckets) < 2:
        return []
    one = model.with_buckets(((1.0, sum(nbytes for _, nbytes in model.buckets)),))
    step = predict(one, Layout(run.world_size, run.workers_per_host)).step_s
    return [Recommendation("fusion", "px.DataParallel(model, fusion_threshold_mb=float('inf')): one allreduce per step "
                           f"instead of {len(model.buckets)}", step, now / step)]


def _compression(run: Measured, model: ScalingModel, now: float) -> list[Recommendation]:
    half = model.with_buckets(tuple((ready, nbytes // 2) for ready, nbytes in model.buckets))
    step = predict(half, Layout(run.world_size, run.workers_per_host)).step_s
    return [Recommendation("compression", "px.DataParallel(model, reduction='bf16'): half the bytes", step, now / step,
                           "about three significant digits per gradient; check the accuracy")]


def _transport(run: Measured, model: ScalingModel, now: float) -> list[Recommendation]:
    """On one host: Gloo's sockets against shared memory, whichever the run did not use."""
    if not 1 < run.world_size <= run.workers_per_host:
        return []
    if model.transport == "shm":
        other = replace(model, transport="gloo")
        action = "px.init(transport='gloo'): Gloo's sockets instead of shared memory"
    else:
        copy = (run.transport_figures or {}).get("copy_s_per_byte")
        if not copy or not shm.available():
            return []
        other = replace(model, transport="shm", engine=shared_memory_link(copy, run.workers_per_host),
                        measured_local=run.workers_per_host)
        action = "px.init(transport='auto'): reduce through shared memory within the host"
    step = predict(other, Layout(run.world_size, run.workers_per_host)).step_s
    return [Recommendation("transport", action, step, now / step,
                           "the overlap measured with the transport in use is assumed for the other")]


def accumulated_step(model: ScalingModel, layout: Layout, k: int) -> float:
    """Seconds per measured global batch when each optimizer step accumulates ``k`` of them: the
    exposed allreduce and the optimizer are paid once per ``k`` batches."""
    whole = predict(model, layout)
    return whole.step_s - (whole.exposed_s + model.slowdown(layout.local) * model.optimizer_s) * (1 - 1 / k)


def _accumulation(run: Measured, model: ScalingModel, now: float, scale: NoiseScale) -> list[Recommendation]:
    found = []
    for k in (2, 4):
        per_batch = accumulated_step(model, Layout(run.world_size, run.workers_per_host), k)
        found.append(Recommendation(
            "accumulation", f"px.fit(..., global_batch_size={k * run.global_batch:g}, accumulate_steps={k}), or in a "
            f"loop of your own px.DataParallel(model, accumulate_steps={k}) and an optimizer step every {k} batches",
            per_batch, now / per_batch * _steps_ratio(scale, run.global_batch, k * run.global_batch),
            f"the optimizer's batch becomes {k * run.global_batch:g}" + _batch_note(scale, k * run.global_batch)))
    return found


def _batch_size(run: Measured, model: ScalingModel, now: float, scale: NoiseScale) -> list[Recommendation]:
    if model.per_sample_s < 0:  # the runs disagree on what a sample costs: no larger batch can be predicted
        return []
    found = []
    for k in (2, 4):
        bigger = predict(model, Layout(run.world_size, run.workers_per_host), k * run.global_batch)
        per_batch = bigger.step_s / k  # seconds per measured global batch of samples
        found.append(Recommendation(
            "batch_size", f"global batch {k * run.global_batch:g} instead of {run.global_batch:g}", per_batch,
            now / per_batch * _steps_ratio(scale, run.global_batch, k * run.global_batch),
            f"predicted step {bigger.step_s * 1e3:.1f} ms" + _batch_note(scale, k * run.global_batch)))
    return found


def _steps_ratio(scale: NoiseScale, batch: float, bigger: float) -> float:
    """Samples to the same loss at ``batch`` over at ``bigger`` (McCandlish: E = E_min (1 + B/B_noise))."""
    if scale.b_simple is None:  # noise dominates: the samples needed do not grow
        return 1.0
    return (batch + scale.b_simple) / (bigger + scale.b_simple)


def _batch_note(scale: NoiseScale, batch: float) -> str:
    if scale.b_simple is None:
        return "; the gradient noise dominates, so the samples needed do not grow"
    return f"; counts the extra samples a batch of {batch:g} needs against a critical batch of {scale.b_simple:.0f}"
