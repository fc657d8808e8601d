"""Why the step is slow (causes) and what to change (recommendations ranked by predicted gain).

Every recommendation is a variant of the measured configuration predicted by the same scaling
model (:mod:`phalanx.doctor.predict`), so its gain is the model's step now over its step then,
for the same samples: the global batch stays unless the recommendation is about the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from phalanx.doctor.measured import Measured
from phalanx.doctor.noise import NoiseScale
from phalanx.comm import shm
from phalanx.doctor.predict import Layout, ScalingModel, predict, shared_memory_link, unpredictable

MIN_GAIN = 1.03  # below this a change is within the model's error
SHARE_WORTH_NAMING = 0.2  # a phase taking this share of the step is named as a cause


@dataclass(frozen=True)
class Recommendation:
    """One change, what it predicts, and by how much it would shorten training."""

    kind: str  # workers, fusion, compression, transport, accumulation, batch_size
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
    if run.step_s and run.exposed_comm_s / run.step_s > SHARE_WORTH_NAMING:
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


def recommend(run: Measured, model: ScalingModel | None, scale: NoiseScale | None) -> list[Recommendation]:
    """Every change predicted to gain at least :data:`MIN_GAIN`, best first (none from a busy host's runs)."""
    if model is None or model.busy:
        return []
    now = predict(model, Layout(run.world_size, run.workers_per_host)).step_s
    found = [*_fewer_workers(run, model, now), *_fusion(run, model, now), *_compression(run, model, now),
             *_transport(run, model, now)]
    if scale is not None:  # a larger batch helps only as far as the noise scale says
        found += [*_accumulation(run, model, now, scale), *_batch_size(run, model, now, scale)]
    return sorted((r for r in found if r.gain >= MIN_GAIN), key=lambda r: r.gain, reverse=True)


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
