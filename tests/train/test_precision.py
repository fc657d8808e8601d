"""px.fit's precision and clipping: the same weights as a hand-written torch loop, at 1 and 2 workers."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from tests.harness import run_workers
from tests.train.test_fit import EPOCHS, GLOBAL_BATCH, _dataset, _model, _optimizer, global_batches

DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class _Recorder(px.callbacks.Callback):
    """Keeps what the step left behind: the clipped norm and the float16 scale."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.scales: list[float] = []

    def on_train_begin(self, state) -> None:  # type: ignore[no-untyped-def]
        if state.precision.scaler is not None:
            self.scales.append(state.precision.scaler.get_scale())

    def on_step_end(self, step, logs, state) -> None:  # type: ignore[no-untyped-def]
        if state.clipping is not None and state.clipping.last_norm is not None:
            self.norms.append(state.clipping.last_norm)
        if state.precision.scaler is not None:
            self.scales.append(state.precision.scaler.get_scale())


def _overflowing_at(step: int, rank: int):  # type: ignore[no-untyped-def]
    """A mean cross-entropy that is infinite on ``rank`` at its ``step``-th call (0-based)."""
    calls = [0]

    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(outputs, targets)
        calls[0] += 1
        return loss * math.inf if calls[0] - 1 == step and px.rank() == rank else loss
    return loss_fn


def _fit(options: dict) -> dict:
    options = dict(options)
    recorder = _Recorder()
    loss_fn = _overflowing_at(*options.pop("overflow")) if "overflow" in options else F.cross_entropy
    if options.pop("central_storage", False):
        px.shutdown()
        px.init(transport="gloo")  # over Gloo, reduce leaves the sum on the storage rank only
        options["strategy"] = px.CentralStorage()
    model = _model()
    px.fit(model, _optimizer(model), loss_fn, _dataset(), epochs=options.pop("epochs", EPOCHS),
           global_batch_size=GLOBAL_BATCH, verbose=0, callbacks=[recorder], **options)
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "norms": recorder.norms,
            "scales": recorder.scales}


def _reference(precision: str = "32", clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
               overflow_step: int | None = None) -> dict:
    """The hand-written loop: autocast, torch's GradScaler, unscale, clip, step."""
    model, (x, y) = _model(), _dataset()
    optimizer = _optimizer(model)
    dtype = DTYPES.get(precision)
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    for step, indices in enumerate(global_batches()):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            loss = F.cross_entropy(model(x[indices]), y[indices])
        if step == overflow_step:
            loss = loss * math.inf
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)
        if clip_grad_value:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_grad_value)
        if clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return {"weights": model.state_dict(), "scale": scaler.get_scale() if scaler else None}


def _assert_weights(results: list[dict], reference: dict, rtol: float, atol: float) -> None:
    for rank, result in enumerate(results):
        for name, value in reference["weights"].items():
            torch.testing.assert_close(result["weights"][name], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
            assert torch.equal(result["weights"][name], results[0]["weights"][name]), "replicas differ"


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_global_gradient_is_clipped_as_a_serial_loop_clips_it(world_size: int) -> None:
    options = {"clip_grad_norm": 0.5, "clip_grad_value": 0.2}
    results = run_workers(_fit, world_size, options, timeout=150)
    _assert_weights(results, _reference(**options), rtol=1e-5, atol=1e-6)
    norms = results[0]["norms"]
    assert len(norms) == 20 and max(norms) > 0.5, "the test must clip: raise the rate or lower the bound"
    assert all(result["norms"] == norms for result in results), "ranks measured different global norms"


@pytest.mark.parametrize("world_size", [2])
def test_bf16_autocast_trains_as_a_serial_autocast_loop(world_size: int) -> None:
    results = run_workers(_fit, world_size, {"precision": "bf16-mixed"}, timeout=150)
    _assert_weights(results, _reference("bf16-mixed"), rtol=0.05, atol=0.02)  # bfloat16 keeps 8 bits
    float32 = _reference()["weights"]
    assert any(not torch.allclose(results[0]["weights"][n], w, rtol=1e-5, atol=1e-6) for n, w in float32.items()), \
        "the run was not in bfloat16 at all"


@pytest.mark.parametrize("rank, strategy, workers", [(1, {}, 2), (0, {"central_storage": True}, 3)])
def test_a_float16_overflow_on_one_rank_is_skipped_by_every_rank(rank: int, strategy: dict, workers: int) -> None:
    """Under central storage the ranks' gradients differ (only the storage rank sums them): an
    overflow there alone must still be skipped everywhere, or the others step and broadcast alone."""
    results = run_workers(_fit, workers, {"precision": "16-mixed", "overflow": (3, rank), **strategy}, timeout=150)
    reference = _reference("16-mixed", overflow_step=3)  # the step rank 1 overflows in: skipped
    _assert_weights(results, reference, rtol=1e-2, atol=1e-3)
    for result in results:
        assert result["scales"][0] == 65536.0 and result["scales"][-1] == reference["scale"] == 32768.0


def test_the_float16_scale_is_checkpointed_and_resumed(tmp_path: Path) -> None:
    options = {"precision": "16-mixed", "checkpoint_dir": str(tmp_path), "epochs": 1, "overflow": (1, 0)}
    first = run_workers(_fit, 1, options, timeout=150)[0]
    assert first["scales"][-1] == 32768.0
    resumed = run_workers(_fit, 1, {**options, "epochs": 2, "overflow": (-1, 0)}, timeout=150)[0]
    assert resumed["scales"][0] == 32768.0, "the resumed run started from a fresh scale"


def test_pairs_that_cannot_keep_their_promise_are_refused_naming_both() -> None:
    px.init()
    model = _model()
    cases = (({"precision": "bf16-mixed", "reproducible": True, "micro_batch_size": 2}, "reproducible=True with"),
             ({"precision": "16-mixed", "strategy": px.ParameterServer()}, r"ParameterServer\(mode='sync'\) with precision='16-mixed'"),
             ({"precision": "fp8"}, "precision must be one of"), ({"clip_grad_norm": -1.0}, "positive number"))
    for options, message in cases:
        with pytest.raises(px.ConfigurationError, match=message):
            px.fit(model, _optimizer(model), F.cross_entropy, _dataset(), epochs=1, global_batch_size=GLOBAL_BATCH,
                   verbose=0, **options)


def _step_with_gradients_finite_on_rank_0_only() -> tuple[bool, float, bool]:
    from phalanx.train.precision import Precision

    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    precision = Precision("16-mixed")
    precision.scaler.scale(torch.ones(()))  # the scaler starts at its first scaled loss
    weight.grad = torch.full((3,), math.inf if px.rank() == 1 else 1.0)  # as a strategy whose ranks' gradients differ
    taken = precision.step(optimizer, None)
    return taken, precision.scaler.get_scale(), bool(torch.equal(weight.detach(), torch.ones(3)))


def test_ranks_agree_to_skip_a_step_that_overflowed_on_one_of_them() -> None:
    results = run_workers(_step_with_gradients_finite_on_rank_0_only, 2)
    assert results == [(False, 32768.0, True)] * 2

