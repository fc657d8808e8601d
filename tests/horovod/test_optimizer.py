"""``hvd.DistributedOptimizer`` at 2 and 3 workers: weights equal to a single-process reference
(Average, Sum, predivide, fp16, groups, backward_passes_per_step, sparse_as_dense), ``hvd.join``
with uneven numbers of batches, ``broadcast_parameters``/``broadcast_optimizer_state``,
``SyncBatchNorm``, and Horovod's warnings and errors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_workers

STEPS, BATCH = 4, 6


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _batch(step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(BATCH, 4, generator=generator)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(BATCH, 1, generator=generator)


def _train(hvd, steps_of: list[int], combine: str = "avg", passes: int = 1, **options) -> dict[str, torch.Tensor]:
    """Train rank-seeded replicas made equal by broadcast; rank r runs ``steps_of[r]`` steps, then joins."""
    r = hvd.rank()
    model = _model(seed=r)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if r == 0:  # rank 0's momentum state must reach the others
        F.mse_loss(model(_batch(99, 0)[0]), _batch(99, 0)[1]).backward()
        optimizer.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if options.get("groups") == "lists":  # the two weights travel together, the biases alone
        options["groups"] = [[model[0].weight, model[2].weight]]
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         backward_passes_per_step=passes,
                                         op=hvd.Sum if combine == "sum" else hvd.Average, **options)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for step in range(steps_of[r]):
        optimizer.zero_grad()
        for micro in range(passes):
            x, y = _batch(step, r, micro)
            F.mse_loss(model(x), y).backward()
        optimizer.step()
    last = hvd.join()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    return {"weights": weights, "last": last, "after": model.state_dict(),
            "buckets": len(optimizer._reducer.bucket_sizes)}


def _reference(n: int, steps_of: list[int], combine: str = "avg", passes: int = 1) -> dict[str, torch.Tensor]:
    """One process: at each step the average (or sum) over the ranks still training of their mean losses."""
    model = _model(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    F.mse_loss(model(_batch(99, 0)[0]), _batch(99, 0)[1]).backward()
    optimizer.step()
    for step in range(max(steps_of)):
        optimizer.zero_grad()
        for micro in range(passes):
            losses = [F.mse_loss(model(_batch(step, r, micro)[0]), _batch(step, r, micro)[1])
                      for r in range(n) if step < steps_of[r]]
            (sum(losses) / (n if combine == "avg" else 1)).backward()
        optimizer.step()
    return model.state_dict()


def _checks() -> dict:
    import phalanx.horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    even = [STEPS] * n
    out = {"average": _train(hvd, even), "sum": _train(hvd, even, "sum"), "passes": _train(hvd, even, passes=2),
           "predivide": _train(hvd, even, gradient_predivide_factor=2.0),
           "fp16": _train(hvd, even, compression=hvd.Compression.fp16), "groups": _train(hvd, even, groups=2),
           "group_lists": _train(hvd, even, groups="lists"),
           "uneven": _train(hvd, [STEPS + 2 - k for k in range(n)])}
    out["sparse"] = _sparse(hvd, sparse_as_dense=True)
    out["sparse_allreduce"] = _sparse(hvd, sparse_as_dense=False)
    out["batchnorm"] = _batchnorm(hvd, r)
    out["usage"] = _usage(hvd)
    hvd.shutdown()
    return out


def _sparse(hvd, sparse_as_dense: bool) -> tuple[torch.Tensor, bool]:
    """One step of an embedding with sparse gradients: averaged densely, or (Horovod's default) as
    a sparse allreduce; either way the gradient the optimizer sees is sparse, as in Horovod."""
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 3, sparse=True)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=1.0),
                                         sparse_as_dense=sparse_as_dense)
    embedding(torch.tensor([hvd.rank(), 9])).sum().backward()
    optimizer.step()
    return embedding.weight.detach().clone(), embedding.weight.grad.is_sparse


def _batchnorm(hvd, r: int) -> torch.Tensor:
    norm = hvd.SyncBatchNorm(3)
    return norm(torch.arange(12.0).reshape(4, 3) * (r + 1)).detach()


def _usage(hvd) -> dict:
    """Horovod's warnings and errors, each raised identically on every rank."""
    from tests.horovod.test_collectives import _raised

    out = {}
    model = _model(0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    out["is_optimizer"] = isinstance(optimizer, torch.optim.Optimizer) and optimizer.param_groups[0]["lr"] == 0.1
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x, y = _batch(0, hvd.rank())
    F.mse_loss(model(x), y).backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with optimizer.skip_synchronize():
            optimizer.step()
        out["skip_warns"] = len(caught)
        F.mse_loss(model(x), y).backward()
        optimizer.synchronize()
        optimizer.step()
        out["step_after_synchronize_warns"] = [str(w.message)[:40] for w in caught]
    scheduler.step()
    out["scheduled_lr"] = optimizer.param_groups[0]["lr"]
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    out["zero_grad_too_early"] = _raised(optimizer.zero_grad)
    out["twice"] = _raised(lambda: F.mse_loss(model(x), y).backward())
    optimizer.step()
    named = list(model.named_parameters())
    out["duplicates"] = _raised(lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                                 named_parameters=[named[0], named[0]] + named[1:]))
    out["unnamed"] = _raised(lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                              named_parameters=named[1:]))
    out["adasum"] = _raised(lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum))
    out["predivide_sum"] = _raised(lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum, gradient_predivide_factor=2.0))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_optimizer_trains_like_one_process(world_size: int) -> None:
    n = world_size
    results = run_workers(_checks, n)
    even = [STEPS] * n
    uneven = [STEPS + 2 - k for k in range(n)]
    references = {"average": _reference(n, even), "sum": _reference(n, even, "sum"),
                  "passes": _reference(n, even, passes=2), "predivide": _reference(n, even),
                  "fp16": _reference(n, even), "groups": _reference(n, even), "group_lists": _reference(n, even),
                  "uneven": _reference(n, uneven)}
    for r, out in enumerate(results):
        for case, reference in references.items():
            tolerance = dict(rtol=2e-3, atol=2e-3) if case == "fp16" else dict(rtol=1e-5, atol=1e-6)
            after = out[case]["after"]
            for key, value in reference.items():
                torch.testing.assert_close(after[key], value, **tolerance, msg=f"rank {r} {case} {key}")
                assert torch.equal(after[key], results[0][case]["after"][key])
            assert out[case]["last"] == 0 if case == "uneven" else out[case]["last"] in range(n)  # rank 0 trains longest
        assert (out["average"]["buckets"], out["groups"]["buckets"], out["group_lists"]["buckets"]) == (1, 2, 3)
        for key, value in references["uneven"].items():
            if r > 0:  # a rank that joined early stopped updating; join's answer brings it level
                assert not torch.allclose(out["uneven"]["weights"][key], value)
        torch.manual_seed(0)
        expected = nn.Embedding(10, 3).weight.detach().clone()
        for k in range(n):
            expected[k] -= 1.0 / n
        expected[9] -= 1.0
        assert out["sparse"][1] is True and out["sparse_allreduce"][1] is True
        torch.testing.assert_close(out["sparse"][0], expected)
        torch.testing.assert_close(out["sparse_allreduce"][0], expected)
        batch = torch.cat([torch.arange(12.0).reshape(4, 3) * (k + 1) for k in range(n)])
        torch.testing.assert_close(out["batchnorm"], F.batch_norm(batch, None, None, training=True)[4 * r:4 * r + 4])
        usage = out["usage"]
        assert usage["is_optimizer"] and usage["skip_warns"] == 0 and usage["scheduled_lr"] == 0.05
        assert usage["step_after_synchronize_warns"] == ["optimizer.step() called without optimize"]
        assert "zero_grad() was called after loss.backward()" in usage["zero_grad_too_early"]
        assert "more than backward_passes_per_step" in usage["twice"]
        assert "must be unique" in usage["duplicates"] and "were not named" in usage["unnamed"]
        assert "Adasum" in usage["adasum"] and "op != Average" in usage["predivide_sum"]


def _names_and_sparse_adam() -> dict:
    """Parameters named by the optimizer itself (two groups, no ``named_parameters``), and an
    embedding with sparse gradients trained by SparseAdam, averaged sparsely and densely."""
    import phalanx.horovod.torch as hvd

    hvd.init()
    model = _model(seed=0)
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.01}]
    unnamed = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    params = list(model.parameters())
    out = {"unnamed": [unnamed._parameter_names[p] for p in params],
           "named": [named._parameter_names[p] for p in params]}
    for sparse_as_dense in (False, True):
        embedding = _embedding()
        optimizer = hvd.DistributedOptimizer(torch.optim.SparseAdam(embedding.parameters(), lr=0.1),
                                             sparse_as_dense=sparse_as_dense)
        for step in range(3):
            optimizer.zero_grad()
            indices, target = _lookups(step, hvd.rank())
            F.mse_loss(embedding(indices), target).backward()
            optimizer.step()
        out[f"sparse_as_dense={sparse_as_dense}"] = embedding.weight.detach().clone()
    hvd.shutdown()
    return out


def _embedding() -> nn.Embedding:
    torch.manual_seed(0)
    return nn.Embedding(12, 3, sparse=True)


def _lookups(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: rows that overlap with the other ranks', and targets."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 12, (5,), generator=generator), torch.randn(5, 3, generator=generator)


def test_parameters_are_named_without_named_parameters_and_sparse_adam_trains() -> None:
    """Horovod names unnamed parameters ``allreduce.noname.<group>.<index>`` and exposes the mapping
    as ``_parameter_names``; SparseAdam needs sparse gradients, which sparse_as_dense hands back."""
    n = 2
    results = run_workers(_names_and_sparse_adam, n, timeout=60)
    embedding = _embedding()  # one process, on every rank's batch at once
    optimizer = torch.optim.SparseAdam(embedding.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        batches = [_lookups(step, r) for r in range(n)]
        F.mse_loss(embedding(torch.cat([i for i, _ in batches])), torch.cat([t for _, t in batches])).backward()
        optimizer.step()
    for out in results:
        assert out["unnamed"] == ["allreduce.noname.0.0", "allreduce.noname.0.1", "allreduce.noname.1.0",
                                  "allreduce.noname.1.1"]
        assert out["named"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        for setting in ("sparse_as_dense=False", "sparse_as_dense=True"):
            torch.testing.assert_close(out[setting], embedding.weight.detach(), msg=setting)
            assert not torch.equal(out[setting], _embedding().weight.detach())  # it trained
