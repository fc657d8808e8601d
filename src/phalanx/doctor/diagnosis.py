"""A diagnosis: the measured run, the noise scale, the scaling model, its predictions, the advice and memory.

``diagnose_records`` turns the ranks' records of the run on N workers (and of the 1-worker
reference) into a :class:`Diagnosis`; ``as_dict`` is the ``--json`` object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phalanx.doctor import advice, memory, noise, predict
from phalanx.doctor.measured import Measured, norm_samples, summarize
from phalanx.doctor.memory import MemoryReport

#: World sizes of the predicted scaling curves across hosts.
WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Diagnosis:
    """Everything ``phalanx doctor`` reports."""

    measured: Measured
    reference: Measured | None
    model: predict.ScalingModel | None
    noise: noise.NoiseScale | None
    predictions: list[predict.Prediction]
    not_predicted: list[tuple[predict.Layout, str]]  # rows the runs cannot tell, and why
    assumptions: list[str]
    causes: list[str]
    recommendations: list[advice.Recommendation]
    records: list[dict[str, Any]]  # every rank's events, for the trace
    memory: MemoryReport | None = None  # None where the ranks did not count their tensors
    slow_links: list[advice.LinkCheck] = field(default_factory=list)  # the run at each --bandwidth between hosts

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object."""
        return {"measured": self.measured.as_dict(),
                "reference": self.reference.as_dict() if self.reference else None,
                "predicted": [p.as_dict() for p in self.predictions],
                "not_predicted": [{"world_size": layout.world_size, "workers_per_host": layout.workers_per_host,
                                   "bandwidth_gbit": layout.bandwidth_gbit, "reason": reason}
                                  for layout, reason in self.not_predicted],
                "assumptions": self.assumptions,
                "noise_scale": self.noise.as_dict() if self.noise else None,
                "causes": self.causes,
                "recommendations": [r.as_dict() for r in self.recommendations],
                "slow_links": [check.as_dict() for check in self.slow_links],
                "memory": self.memory.as_dict() if self.memory else None}


def diagnose_records(run: list[dict[str, Any]], reference: list[dict[str, Any]] | None,
                     bandwidths_gbit: list[float]) -> Diagnosis:
    """The :class:`Diagnosis` of a run's records (and its 1-worker reference's)."""
    measured = summarize(run)
    ref = summarize(reference) if reference else None
    scale = noise.estimate(norm_samples(run))
    model = predict.fit(measured, ref) if measured.transport_figures else None
    on_host, across = layouts(measured, bandwidths_gbit)
    not_predicted = [(layout, reason) for layout in on_host + across
                     if model and (reason := predict.unpredictable(model, layout))]
    skipped = {layout for layout, _ in not_predicted}
    predictions = [] if model is None else (
        predict.scaling(model, [layout for layout in on_host if layout not in skipped])
        + predict.scaling(model, [layout for layout in across if layout not in skipped],
                          measured.global_batch / measured.world_size))
    checks = [] if model is None or model.busy else [
        check for bandwidth in bandwidths_gbit if (check := advice.link_check(measured, model, bandwidth))]
    return Diagnosis(measured, ref, model, scale, predictions, not_predicted, assumptions(measured, model),
                     advice.causes(measured, ref, model), advice.recommend(measured, model, scale, checks),
                     run, memory.report(run, measured.global_batch, on_host, across, measured.transport), checks)


def layouts(measured: Measured, bandwidths_gbit: list[float]) -> tuple[list[predict.Layout], list[predict.Layout]]:
    """The rows to predict: this host with 1 to twice its cores' workers at the measured global batch;
    then hosts like it (the measured workers each) at the measured link and every given bandwidth,
    1 to 1024 workers at the measured batch per worker (the global batch grows with the workers)."""
    on_host = [predict.Layout(p, p) for p in range(1, 2 * measured.cores + 1)]
    per_host = measured.workers_per_host
    across = [predict.Layout(p, per_host, bandwidth) for bandwidth in (None, *bandwidths_gbit) for p in WORLD_SIZES
              if p > per_host]
    return on_host, across


def assumptions(run: Measured, model: predict.ScalingModel | None) -> list[str]:
    """What the predictions take for granted, in the report's words."""
    if model is None:
        return []
    found = [f"a step without its allreduce wait takes {model.fixed_s * 1e3:.2f} ms + {model.per_sample_s * 1e3:.3f} "
             f"ms per local sample: the line through the runs at {run.world_size} and 1 worker(s), which the rows "
             "for those two counts reproduce",
             f"up to {run.cores} workers on this host each run as fast as with the core to itself (shared memory "
             "bandwidth and caches are not modelled); beyond the cores, only the measured count is given",
             "the allreduce within a host: the measured one, scaled for the ranks taking part "
             "(shared memory: the copies each makes; Gloo: its ring), and as much hidden behind backward as measured",
             f"across hosts: hosts like this one with {run.workers_per_host} worker(s) each, at the measured batch "
             "per worker, reducing over a ring between hosts whose link the local ranks share"]
    if model.schedule is not None:
        schedule = model.schedule
        found.append(f"{run.strategy}: {schedule.fragments} exchange(s) every {schedule.period} steps, each one "
                     f"allreduce of 1/{schedule.fragments} of the model's {model.model_bytes / 1e6:.2f} MB, hidden "
                     f"behind the {schedule.delay} inner step(s) that compute while it crosses (nothing is reduced in "
                     "backward)")
    if model.other_load is not None:
        found.append(f"the host as quiet as measured: other processes kept {model.other_load:.2f} of its {run.cores} cores "
                     f"busy while measuring (above {predict.BUSY_SHARE * run.cores:.1f}, nothing is predicted)")
    return found
