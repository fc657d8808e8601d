"""The gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018, appendix A).

Data parallelism computes the gradient at two batch sizes anyway: each rank's local batch
(B_small) and the global batch (B_big). From their squared norms, unbiased estimates are

    |G|²  ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1/B_small - 1/B_big)

Each is noisy: numerator and denominator are averaged over every rank and step before dividing.
Training to a given loss takes about S_min (1 + B_noise/B) steps at batch B, so batches well
below B_simple (the critical batch, to first order) are used efficiently and those far above it
mostly repeat what the gradient already knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from phalanx.doctor.records import mean

#: ``(|G_small|², |G_big|², B_small, B_big)`` of one rank and step.
Sample = tuple[float, float, float, float]


@dataclass(frozen=True)
class NoiseScale:
    """The estimate and what it says about the global batch ``batch`` in use."""

    b_simple: float | None  # None: |G|² came out at or below zero (noise dominates, B_simple is huge)
    gradient_sq: float
    trace_sigma: float
    samples: int
    batch: float

    @property
    def critical_batch(self) -> float | None:
        """The batch beyond which larger batches buy little (B_crit ≈ B_simple)."""
        return self.b_simple

    def steps_factor(self, batch: float) -> float:
        """Steps to the same loss at ``batch`` relative to S_min: ``1 + B_simple/batch``."""
        return 1.0 + (self.b_simple or float("inf")) / batch

    def verdict(self) -> str:
        """Whether a larger global batch (more workers at the same local batch) still shortens training."""
        if self.b_simple is None:
            return "yes: the gradient is dominated by noise, so a larger global batch cuts the steps almost in proportion"
        ratio = self.batch / self.b_simple
        if ratio < 0.5:
            return (f"yes: the global batch {self.batch:g} is well below the critical batch {self.b_simple:.0f}, "
                    "so doubling it nearly halves the steps")
        if ratio < 2:
            return (f"partly: the global batch {self.batch:g} is near the critical batch {self.b_simple:.0f}; doubling "
                    f"it cuts the steps by {self.steps_factor(self.batch) / self.steps_factor(2 * self.batch):.2f}x only")
        return (f"no: the global batch {self.batch:g} is above the critical batch {self.b_simple:.0f}; a larger one "
                "mostly spends samples without saving steps")

    def learning_rate_rule(self) -> str:
        """How to set the learning rate when the global batch changes."""
        limit = f"{self.b_simple:.0f}" if self.b_simple else "the critical batch"
        return (f"scale it linearly with the global batch up to about {limit} (px.scale_lr(..., rule='linear'); "
                "'sqrt' for Adam), then hold it: the best rate follows lr_max / (1 + B_simple/B)")

    def as_dict(self) -> dict[str, object]:
        return {"b_simple": self.b_simple, "critical_batch": self.critical_batch, "gradient_sq": self.gradient_sq,
                "trace_sigma": self.trace_sigma, "samples": self.samples, "global_batch": self.batch,
                "larger_batch_helps": self.verdict(), "learning_rate_rule": self.learning_rate_rule()}


def estimate(samples: Iterable[Sample]) -> NoiseScale | None:
    """B_simple from gradient-norm samples at two batch sizes; ``None`` without any usable sample."""
    gradients, traces, batches = [], [], []
    for small_sq, big_sq, b_small, b_big in samples:
        if not 0 < b_small < b_big:
            continue  # one worker, or a rank without samples: no second batch size
        gradients.append((b_big * big_sq - b_small * small_sq) / (b_big - b_small))
        traces.append((small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big))
        batches.append(b_big)
    if not gradients:
        return None
    gradient_sq, trace = mean(gradients), mean(traces)
    b_simple = trace / gradient_sq if gradient_sq > 0 else None
    return NoiseScale(b_simple, gradient_sq, trace, len(gradients), mean(batches))
