"""The gradient noise scale against its exact value on linear regression with Gaussian noise."""

from __future__ import annotations

import torch

from phalanx.doctor.noise import estimate

SAMPLES, FEATURES, RANKS, LOCAL, STEPS = 4096, 8, 4, 16, 200


def _problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
    y = x @ torch.ones(FEATURES, dtype=torch.float64) + 0.5 * torch.randn(SAMPLES, generator=generator, dtype=torch.float64)
    return x, y, torch.full((FEATURES,), 0.8, dtype=torch.float64)  # weights off the optimum: |G| > 0


def _per_sample_gradients(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Gradient of 0.5 (x.w - y)^2 for every sample, one row each."""
    return (x @ w - y)[:, None] * x


def true_b_simple(gradients: torch.Tensor) -> float:
    """tr(Σ)/|G|² of sampling one row uniformly (the population's covariance)."""
    mean = gradients.mean(0)
    return float(((gradients - mean) ** 2).sum(1).mean() / mean.dot(mean))


def norm_samples(gradients: torch.Tensor, generator: torch.Generator) -> list[tuple[float, float, float, float]]:
    """What each of RANKS ranks records per step: |local mean|², |global mean|², both batch sizes."""
    found = []
    for _ in range(STEPS):
        batch = gradients[torch.randint(0, SAMPLES, (RANKS * LOCAL,), generator=generator)].view(RANKS, LOCAL, -1)
        local = batch.mean(1)
        whole = local.mean(0)
        found += [(float(g.dot(g)), float(whole.dot(whole)), LOCAL, RANKS * LOCAL) for g in local]
    return found


def test_the_estimate_is_within_a_factor_two_of_the_exact_noise_scale() -> None:
    x, y, w = _problem()
    gradients = _per_sample_gradients(x, y, w)
    truth = true_b_simple(gradients)
    found = estimate(norm_samples(gradients, torch.Generator().manual_seed(1)))
    assert found is not None and found.b_simple is not None
    assert 10 < truth < 1000  # a regime where the batch sizes 16 and 64 tell something
    assert truth / 2 <= found.b_simple <= truth * 2, (found.b_simple, truth)


def test_one_batch_size_gives_no_estimate() -> None:
    assert estimate([(1.0, 1.0, 32, 32)]) is None


def test_a_batch_below_the_critical_one_is_said_to_scale() -> None:
    found = estimate([(2.0, 1.1, 16, 64)] * 4)
    assert found is not None and found.b_simple is not None
    assert found.verdict().startswith("yes" if found.batch < found.b_simple / 2 else ("partly", "no"))
    assert found.steps_factor(found.batch) > found.steps_factor(2 * found.batch)
