"""px.DataParallel: averaged gradients equal a single-process reference, on real workers."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.data import share_bounds
from tests.harness import run_workers
from tests.parallel.models import MODELS, data


def _shares(samples: int, world: int) -> list[tuple[int, int]]:
    return [share_bounds(samples, world, r) for r in range(world)]


def _build(name: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def _worker_gradients(cfg: dict) -> dict:
    """Wrap a rank-seeded model (broadcast must equalise it), run the configured backwards."""
    model = px.DataParallel(_build(cfg["model"], seed=100 + px.rank()), **cfg.get("options", {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(cfg.get("steps", 1)):
        optimizer.zero_grad()
        for micro in range(cfg.get("micro", 1)):
            x, y = data(cfg["model"], cfg["samples"], seed=step * 10 + micro)
            start, stop = share_bounds(cfg["samples"], px.size(), px.rank())
            context = model.no_sync() if cfg.get("no_sync_first") and micro == 0 else contextlib.nullcontext()
            with context:
                loss = F.cross_entropy(model(x[start:stop]), y[start:stop]) / cfg.get("micro", 1)
                loss.backward()
        if cfg.get("optimize"):
            optimizer.step()
    return {
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()},
        "params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
        "threshold": model.fusion_threshold_mb,
    }


def _reference(cfg: dict, world: int) -> dict:
    """One process, one model: the weighted objective over every rank's share."""
    model = _build(cfg["model"], seed=100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(cfg.get("steps", 1)):
        optimizer.zero_grad()
        for micro in range(cfg.get("micro", 1)):
            x, y = data(cfg["model"], cfg["samples"], seed=step * 10 + micro)
            if cfg["model"] == "branchy":  # the branch depends on each rank's share
                loss = sum(F.cross_entropy(model(x[a:b]), y[a:b]) * (b - a) / len(x)
                           for a, b in _shares(cfg["samples"], world))
            else:
                loss = F.cross_entropy(model(x), y)
            (loss / cfg.get("micro", 1)).backward()
        if cfg.get("optimize"):
            optimizer.step()
    return {"grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _assert_matches(results: list[dict], reference: dict, key: str = "grads", rtol: float = 1e-5,
                    atol: float = 1e-6) -> None:
    for rank, result in enumerate(results):
        for name, expected in reference[key].items():
            got = result[key][name]
            if expected is None:
                assert got is None, f"rank {rank} {name}: expected no gradient"
            else:
                torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: f"rank {rank} {name}: {m}")


CASES = {
    "mlp": {"model": "mlp", "samples": 12},
    "mlp-uneven-shares": {"model": "mlp", "samples": 7},
    "cnn": {"model": "cnn", "samples": 12},
    "unused-branch": {"model": "branchy", "samples": 5},
    "accumulate-2": {"model": "mlp", "samples": 12, "micro": 2, "options": {"accumulate_steps": 2}},
    "no-sync": {"model": "cnn", "samples": 12, "micro": 2, "no_sync_first": True},
    "sync-batchnorm": {"model": "cnn_bn", "samples": 12, "options": {"sync_batchnorm": True}},
    # phalanx's own algorithms on their background thread, one bucket per tensor, beside backward
    "tree-algorithm": {"model": "mlp", "samples": 7, "options": {"algorithm": "tree", "fusion_threshold_mb": 0}},
    "halving-doubling": {"model": "cnn", "samples": 12,
                         "options": {"algorithm": "halving_doubling", "fusion_threshold_mb": 0.001}},
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_equal_the_single_process_gradient(case: str, world_size: int) -> None:
    cfg = CASES[case]
    _assert_matches(run_workers(_worker_gradients, world_size, cfg), _reference(cfg, world_size))


@pytest.mark.parametrize("threshold", [0, 0.001, math.inf, "auto"])
def test_every_fusion_threshold_gives_the_same_gradients(threshold: float | str) -> None:
    steps = 24 if threshold == "auto" else 2
    cfg = {"model": "cnn", "samples": 12, "steps": steps, "options": {"fusion_threshold_mb": threshold}}
    results = run_workers(_worker_gradients, 2, cfg)
    _assert_matches(results, _reference(cfg, 2))
    if threshold == "auto":
        assert results[0]["threshold"] == results[1]["threshold"] != "auto"


def test_replicas_stay_identical_over_ten_optimizer_steps() -> None:
    cfg = {"model": "mlp", "samples": 9, "steps": 10, "optimize": True}
    results = run_workers(_worker_gradients, 3, cfg)
    for name, value in results[0]["params"].items():
        for other in results[1:]:
            assert torch.equal(other["params"][name], value), name
    _assert_matches(results, _reference(cfg, 3), key="params")


@pytest.mark.parametrize("compression, rtol", [("fp16", 1e-2), ("bf16", 4e-2)])
def test_cast_compression_stays_within_its_precision(compression: str, rtol: float) -> None:
    cfg = {"model": "mlp", "samples": 12, "options": {"compression": compression}}
    _assert_matches(run_workers(_worker_gradients, 2, cfg), _reference(cfg, 2), rtol=rtol, atol=rtol * 1e-2)


def _rank_one_sends_nan() -> str:
    model = px.DataParallel(_build("mlp", 0), check_finite=True)
    x, y = data("mlp", 4)
    if px.rank() == 1:
        x[0, 0] = float("nan")
    try:
        F.cross_entropy(model(x), y).backward()
    except px.NonFiniteGradientError as error:
        return str(error)
    return "no error"


def test_check_finite_raises_on_every_rank_naming_the_parameter() -> None:
    for message in run_workers(_rank_one_sends_nan, 2):
        assert "NaN or Inf" in message and "'4.bias'" in message or "'0.weight'" in message, message


def _differing_models(when: str) -> str:
    torch.manual_seed(0)
    width = 32 if px.rank() == 0 else 33
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 2))
    try:
        if when == "built":
            px.DataParallel(model)
        else:  # an elastic group re-formed: the check comes with reshard, before the state is loaded
            px.DataParallel(model, broadcast=False).reshard(px.rank(), px.size())
    except px.ConfigurationError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("when", ["built", "resharded"])
def test_models_that_differ_between_ranks_are_refused_on_every_rank(when: str) -> None:
    for message in run_workers(_differing_models, 2, when):
        assert "rank 1 differs from rank 0's" in message and "'0.weight' [33, 8]" in message, message


def _empty_share_step() -> dict:
    model = px.DataParallel(_build("mlp", 0))
    x, y = data("mlp", 2)
    if px.rank() == 2:
        model.reduce_without_data()
    else:
        F.cross_entropy(model(x[px.rank() : px.rank() + 1]), y[px.rank() : px.rank() + 1]).backward()
    return {n: p.grad.clone() for n, p in model.module.named_parameters()}


def test_a_rank_without_samples_contributes_zero_and_receives_the_average() -> None:
    results = run_workers(_empty_share_step, 3)
    model = _build("mlp", 0)
    x, y = data("mlp", 2)
    F.cross_entropy(model(x), y).backward()
    for result in results:
        for name, p in model.named_parameters():
            torch.testing.assert_close(result[name], p.grad, rtol=1e-5, atol=1e-6)


def test_world_size_one_installs_nothing_and_changes_nothing() -> None:
    px.init()
    plain = _build("cnn", 0)
    wrapped = px.DataParallel(_build("cnn", 0))
    assert wrapped.reducer is None
    x, y = data("cnn", 6)
    F.cross_entropy(plain(x), y).backward()
    F.cross_entropy(wrapped(x), y).backward()
    for (name, p), q in zip(plain.named_parameters(), wrapped.module.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert list(wrapped.state_dict()) == list(plain.state_dict())


def test_small_local_batch_with_batchnorm_warns_once() -> None:
    px.init()
    model = px.DataParallel(_build("cnn_bn", 0))
    x, _ = data("cnn_bn", 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x)
        model(x)
    assert len([w for w in caught if "sync_batchnorm=True" in str(w.message)]) == 1


def test_sync_batchnorm_conversion_keeps_the_layers_device_and_dtype() -> None:
    """A model moved before wrapping stays where it was (the GPU case: meta stands in for cuda)."""
    for device, dtype in (("cpu", torch.float64), ("meta", torch.float32)):
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4)).to(device, dtype)
        converted = px.SyncBatchNorm.convert(model)[1]
        assert isinstance(converted, px.SyncBatchNorm)
        assert {(t.device.type, t.dtype) for t in (converted.weight, converted.bias, converted.running_mean,
                                                     converted.running_var)} == {(device, dtype)}


def _changing_global_batch(sample_counts: list[int]) -> dict:
    """SGD steps over global batches of varying size; note which steps summed the count separately."""
    model = px.DataParallel(_build("mlp", seed=100 + px.rank()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    count_allreduce = []
    for step, samples in enumerate(sample_counts):
        x, y = data("mlp", samples, seed=step)
        start, stop = share_bounds(samples, px.size(), px.rank())
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[start:stop]), y[start:stop])
        count_allreduce.append(model.reducer.summation.weights._count_handle is not None)
        loss.backward()
        optimizer.step()
    return {"params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
            "count_allreduce": count_allreduce}


def test_a_changing_global_batch_still_gives_the_global_average() -> None:
    """The global count is summed once; later steps reuse it, and rescale where it changed."""
    sample_counts = [12, 12, 7, 7, 12, 2, 12]  # 2 samples over 3 ranks: one rank has none
    results = run_workers(_changing_global_batch, 3, sample_counts)
    model = _build("mlp", seed=100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, samples in enumerate(sample_counts):
        x, y = data("mlp", samples, seed=step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    reference = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    _assert_matches(results, reference, key="params")
    for result in results:
        assert result["count_allreduce"] == [True] + [False] * (len(sample_counts) - 1)


class ThroughRankZero(px.Reduction):
    """A custom reduction written against the documented interface only: the sum is formed on
    rank 0 and sent back (central storage's shape), instead of one allreduce."""

    def __init__(self) -> None:
        self.calls = 0

    def weights(self):
        from phalanx.parallel.weights import ShareWeights

        return ShareWeights(predict=True)  # an exact sum: weighted with last step's sample count

    def reduce(self, bucket):
        from phalanx.comm.collectives import then

        self.calls += 1
        summed = px.reduce(bucket.flat, root=0, async_op=True, check=False)

        def send_back(total):
            if total is not None:
                bucket.flat.copy_(total)
            return px.broadcast_(bucket.flat, root=0, check=False)

        return then(summed, send_back)


def _train_with_custom_reduction(cfg: dict) -> dict:
    reduction = ThroughRankZero()
    result = _worker_gradients({**cfg, "options": {"reduction": reduction, "fusion_threshold_mb": 0}})
    return {**result, "calls": reduction.calls}


def test_a_custom_reduction_trains_like_the_reference() -> None:
    cfg = {"model": "mlp", "samples": 10, "steps": 6, "optimize": True}
    results = run_workers(_train_with_custom_reduction, 2, cfg)
    parameters = len(results[0]["params"])
    assert all(r["calls"] == 6 * parameters for r in results)  # one bucket per tensor, every step
    for name, value in results[0]["params"].items():
        assert torch.equal(results[1]["params"][name], value), name
    _assert_matches(results, _reference(cfg, 2), key="params")


class _FailsInBackward(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: the layers after it have sent gradients already."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _FailsInBackward.armed:
            raise RuntimeError("backward interrupted on purpose")
        return grad


class _Fails(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailsInBackward.apply(x)


def _with_a_failing_layer(net: torch.nn.Module) -> torch.nn.Module:
    layers = list(net)
    return torch.nn.Sequential(*layers[:4], _Fails(), layers[4])


def _step_after_an_interrupted_backward(threshold: float) -> list[torch.Tensor]:
    model = px.DataParallel(_with_a_failing_layer(_build("mlp", seed=100)), fusion_threshold_mb=threshold)
    start, stop = share_bounds(12, px.size(), px.rank())
    x, y = data("mlp", 12, seed=5)
    _FailsInBackward.armed = True
    with pytest.raises(RuntimeError, match="on purpose"):  # the last layer's bucket may be sent already
        F.cross_entropy(model(x[start:stop]), y[start:stop]).backward()
    _FailsInBackward.armed = False
    model.zero_grad()
    x, y = data("mlp", 12, seed=6)
    F.cross_entropy(model(x[start:stop]), y[start:stop]).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("threshold", [0.0, 25.0])
def test_a_step_after_a_backward_that_raised_is_exact(threshold: float) -> None:
    reference = _build("mlp", seed=100)
    x, y = data("mlp", 12, seed=6)
    F.cross_entropy(reference(x), y).backward()
    for grads in run_workers(_step_after_an_interrupted_backward, 2, threshold):
        for got, param in zip(grads, reference.parameters(), strict=True):
            torch.testing.assert_close(got, param.grad, rtol=1e-5, atol=1e-6)
