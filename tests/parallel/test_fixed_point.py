"""The fixed-point summation of the reducer: exact means, exponents that hold or are redone, unused and fp16 tensors."""

from __future__ import annotations

import math

import pytest
import torch

import phalanx as px
from phalanx.parallel import fixed_point
from phalanx.parallel.fixed_point import FixedPointSum
from phalanx.parallel.reducer import GradientReducer, Phase

ENGINES: dict[int, GradientReducer] = {}  # each summation's engine, which the passes drive


def _params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]


def _pass(reducer: FixedPointSum, params: list, micro_grads: list[list[torch.Tensor | None]],
          samples: list[int], calibrate: bool = False) -> bool:
    """One pass: per micro-batch, a backward that gives each parameter the listed gradient."""
    reducer.begin_pass(len(micro_grads), calibrate=calibrate)
    for k, (grads, size) in enumerate(zip(micro_grads, samples)):
        reducer.begin_micro_batch(size)
        ENGINES[id(reducer)].expect_backward(size, Phase.REDUCE if k == len(micro_grads) - 1 else Phase.GATHER)
        terms = [(p * g).sum() for p, g in zip(params, grads) if g is not None]
        torch.stack(terms).sum().backward()  # the reducer's end of backward completes the micro-batch
    return reducer.finish_pass()


def _calibrated(params: list, micro_grads: list, samples: list[int]) -> FixedPointSum:
    reducer = FixedPointSum()
    ENGINES[id(reducer)] = GradientReducer(params, [str(i) for i in range(len(params))], 25.0, reducer,
                                           follows_forward=False)
    assert not _pass(reducer, params, micro_grads, samples, calibrate=True)
    reducer.recalibrate()
    return reducer


def _random_grads(generator: torch.Generator, shapes: list, scale: float = 1.0) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=generator) * scale for shape in shapes]


def test_the_mean_matches_a_float64_reference_and_calibration_leaves_headroom() -> None:
    # Small tensors (summed per bucket), an empty one, and one large enough to stream in chunks.
    shapes = [(5, 7), (7,), (0, 3), (3, 5), (fixed_point.QUANTISE_CHUNK + 1000,)]
    params = _params(*shapes)
    generator = torch.Generator().manual_seed(0)
    micro = [_random_grads(generator, shapes) for _ in range(3)]
    samples = [4, 4, 2]
    reducer = _calibrated(params, micro, samples)
    assert _pass(reducer, params, micro, samples)
    reducer.publish(global_batch_size=sum(samples))
    limit = fixed_point.term_limit_bits(len(micro))
    for index, param in enumerate(params):
        reference = sum(g[index].double() * n for g, n in zip(micro, samples)) / sum(samples)
        torch.testing.assert_close(param.grad.double(), reference, rtol=1e-6, atol=1e-7)
        if param.numel() == 0:
            continue
        largest = max(float(g[index].abs().max()) * n for g, n in zip(micro, samples))
        top_bits = math.log2(largest) + int(reducer.exponents[index])
        assert limit - fixed_point.HEADROOM_BITS - 1 < top_bits <= limit - fixed_point.HEADROOM_BITS


@pytest.mark.parametrize("factor, holds", [(1.0, True), (20.0, True), (1e-2, True), (200.0, False), (1e-4, False)])
def test_exponents_hold_within_the_headroom_and_slack_and_are_redone_outside(factor: float, holds: bool) -> None:
    shapes = [(64,), (8, 8)]
    params = _params(*shapes)
    generator = torch.Generator().manual_seed(1)
    micro = [_random_grads(generator, shapes) for _ in range(2)]
    reducer = _calibrated(params, micro, [3, 3])
    assert _pass(reducer, params, [[g * factor for g in grads] for grads in micro], [3, 3]) is holds


def test_a_redone_pass_after_recalibrating_holds_and_is_exact() -> None:
    params = _params((16,))
    micro = [[torch.linspace(-1, 1, 16)]]
    reducer = _calibrated(params, micro, [1])
    grown = [[micro[0][0] * 1e4]]
    assert not _pass(reducer, params, grown, [1])
    reducer.recalibrate()
    assert _pass(reducer, params, grown, [1])
    reducer.publish(global_batch_size=1)
    torch.testing.assert_close(params[0].grad, grown[0][0], rtol=1e-7, atol=0)


def test_a_tensor_whose_gradient_is_zero_everywhere_does_not_force_a_redo() -> None:
    params = _params((4,), (4,))
    micro = [[torch.ones(4), torch.ones(4)]]
    reducer = _calibrated(params, micro, [2])
    assert _pass(reducer, params, [[torch.ones(4), torch.zeros(4)]], [2])


def test_a_parameter_no_micro_batch_touched_gets_no_gradient() -> None:
    params = _params((3,), (3,))
    micro = [[torch.ones(3), None], [torch.ones(3) * 2, None]]
    reducer = _calibrated(params, micro, [1, 1])
    assert _pass(reducer, params, micro, [1, 1])
    reducer.publish(global_batch_size=2)
    torch.testing.assert_close(params[0].grad, torch.full((3,), 1.5))
    assert params[1].grad is None


def test_a_non_finite_gradient_raises_instead_of_looping() -> None:
    params = _params((3,))
    reducer = _calibrated(params, [[torch.ones(3)]], [1])
    assert not _pass(reducer, params, [[torch.tensor([1.0, math.nan, 1.0])]], [1])
    with pytest.raises(px.NonFiniteGradientError, match="NaN or Inf"):
        reducer.recalibrate()


def test_float16_parameters_are_scaled_in_float32() -> None:
    params = _params((32,), dtype=torch.float16)
    grads = [[torch.linspace(-3, 3, 32, dtype=torch.float16)], [torch.linspace(0, 1, 32, dtype=torch.float16)]]
    reducer = _calibrated(params, grads, [2, 2])
    assert _pass(reducer, params, grads, [2, 2])
    reducer.publish(global_batch_size=4)
    reference = (grads[0][0].float() + grads[1][0].float()) / 2
    torch.testing.assert_close(params[0].grad.float(), reference, rtol=1e-3, atol=1e-3)
    assert params[0].grad.dtype == torch.float16
