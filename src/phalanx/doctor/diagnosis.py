"""A diagnosis: the measured run, the noise scale, the scaling model, its predictions and the advice.

``diagnose_records`` turns the ranks' records of the run on N workers (and of the 1-worker
reference) into a :class:`Diagnosis`; ``as_dict`` is the ``--json`` object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.doctor import advice, noise, predict
from phalanx.doctor.measured import Measured, norm_samples, summarize

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
    causes: list[str]
    recommendations: list[advice.Recommendation]
    records: list[dict[str, Any]]  # every rank's events, for the trace

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object."""
        return {"measured": self.measured.as_dict(),
                "reference": self.reference.as_dict() if self.reference else None,
                "predicted": [p.as_dict() for p in self.predictions],
                "noise_scale": self.noise.as_dict() if self.noise else None,
                "causes": self.causes,
                "recommendations": [r.as_dict() for r in self.recommendations]}


def diagnose_records(run: list[dict[str, Any]], reference: list[dict[str, Any]] | None,
                     bandwidths_gbit: list[float]) -> Diagnosis:
    """The :class:`Diagnosis` of a run's records (and its 1-worker reference's)."""
    measured = summarize(run)
    ref = summarize(reference) if reference else None
    scale = noise.estimate(norm_samples(run))
    model = predict.fit(measured, ref) if measured.transport_figures else None
    predictions = scaling(model, measured, bandwidths_gbit) if model else []
    return Diagnosis(measured, ref, model, scale, predictions, advice.causes(measured, ref, model),
                     advice.recommend(measured, model, scale), run)


def scaling(model: predict.ScalingModel, measured: Measured, bandwidths_gbit: list[float]) -> list[predict.Prediction]:
    """This host with 1 to twice its cores' workers at the measured global batch; then hosts like it
    (the measured workers each) at the measured link and every given bandwidth, 1 to 1024 workers at
    the measured batch per worker (the global batch grows with the workers)."""
    on_host = [predict.Layout(p, p) for p in range(1, 2 * measured.cores + 1)]
    per_host = measured.workers_per_host
    across = [predict.Layout(p, per_host, bandwidth) for bandwidth in (None, *bandwidths_gbit) for p in WORLD_SIZES
              if p > per_host]
    local = measured.global_batch / measured.world_size
    return predict.scaling(model, on_host) + predict.scaling(model, across, local)
