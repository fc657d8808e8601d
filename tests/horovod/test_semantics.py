"""Horovod's documented arithmetic and conventions, checked at 4 workers: integers scaled in float64
and truncated, reduce-scatter gradients, grouped ops under autograd, sparse allreduce, optimizer
state created before it is broadcast, and roots given as global ranks inside process sets."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_workers
from tests.horovod.test_collectives import _raised

WORKERS = 4


def _integers(hvd, r: int, n: int) -> dict:
    """Average and scaling of integer tensors: in float64, cast back (truncated toward zero)."""
    t = torch.tensor([3, 5, -7], dtype=torch.int32) * (r + 1)
    return {"average": hvd.allreduce(t, op=hvd.Average),
            "prescale": hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.3),
            "postscale": hvd.allreduce(t.long(), op=hvd.Sum, postscale_factor=0.3),
            "grouped_average": hvd.grouped_allreduce([t, t.long() * 2], op=hvd.Average),
            "reducescatter_average": hvd.reducescatter(torch.arange(2 * n, dtype=torch.int64) * (r + 1)),
            "half_prescale": hvd.allreduce(torch.full((3,), 1.5, dtype=torch.float16), op=hvd.Sum,
                                           prescale_factor=0.1)}


def _gradients(hvd, r: int, n: int) -> dict:
    """Each rank's output gradient is ones: what reaches each input."""
    grads = {}
    for name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
        x = torch.ones(2 * n, 3, requires_grad=True)
        out = hvd.reducescatter(x, op=op)
        out.backward(torch.ones_like(out))
        grads[f"reducescatter_{name}"] = x.grad
    xs = [torch.ones(2 * n, requires_grad=True), torch.ones(n, 2, requires_grad=True)]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum, prescale_factor=0.5)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    grads["grouped_reducescatter"] = [x.grad for x in xs]
    xs = [torch.full((r + 1, 2), 1.0, requires_grad=True), torch.ones(1, requires_grad=True)]
    outs = hvd.grouped_allgather(xs)
    torch.autograd.backward(outs, [torch.arange(float(o.numel())).view_as(o) for o in outs])
    grads["grouped_allgather"] = [x.grad for x in xs]
    return grads


def _sparse(hvd, r: int, n: int) -> dict:
    """Horovod's handle is a callable that waits (``handle()``), with or without a process set; it is
    also an integer handle ``synchronize`` takes."""
    t = torch.sparse_coo_tensor(torch.tensor([[0, 2 + r]]), torch.tensor([1.0, float(r)]), (n + 3,))
    out = {"sum": hvd.sparse_allreduce_async(t, op=hvd.Sum, name="sparse.sum")(),
           "average": hvd.synchronize(hvd.sparse_allreduce_async(t, name="sparse.avg")),
           "dense": hvd.allreduce(t.to_dense(), op=hvd.Sum)}
    lower = hvd.add_process_set(list(range(n // 2)))  # every rank adds it; its members reduce in it
    if lower.included():
        out["set_sum"] = hvd.sparse_allreduce_async(t, op=hvd.Sum, name="sparse.set", process_set=lower)()
        out["set_dense"] = hvd.allreduce(t.to_dense(), op=hvd.Sum, process_set=lower)
    return out


def _optimizer_state(hvd, r: int) -> dict:
    """Before any step: zero gradients where there were none (not for frozen parameters), state made."""
    torch.manual_seed(r)  # different everywhere until broadcast
    frozen, trained = torch.nn.Parameter(torch.ones(2), requires_grad=False), torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.SGD([frozen, trained], lr=0.1, momentum=0.9)
    hvd.broadcast_parameters([frozen, trained], root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return {"frozen_grad": frozen.grad, "trained_grad": trained.grad,
            "momentum": optimizer.state[trained]["momentum_buffer"], "weights": trained.detach()}


def _process_sets(hvd, r: int, n: int) -> dict:
    """Roots are global ranks: in the set of ranks 1 and 3, root_rank=3 is its second member."""
    odd = hvd.add_process_set([1, 3])
    out = {}
    if odd.included():
        out["broadcast"] = hvd.broadcast(torch.tensor([r]), root_rank=3, process_set=odd).item()
        out["object"] = hvd.broadcast_object(f"from {r}", root_rank=3, process_set=odd)
        x = torch.ones(2, requires_grad=True)
        (hvd.broadcast(x, root_rank=3, process_set=odd) * (r + 1)).sum().backward()
        out["grad"] = x.grad
        out["not_a_member"] = _raised(lambda: hvd.broadcast(torch.ones(1), root_rank=0, process_set=odd))
        out["still_works"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=odd).item()
    return out


def _semantics() -> dict:
    import phalanx.horovod.torch as hvd

    hvd.init(process_sets="dynamic")
    r, n = hvd.rank(), hvd.size()
    return {"integers": _integers(hvd, r, n), "grads": _gradients(hvd, r, n), "sparse": _sparse(hvd, r, n),
            "state": _optimizer_state(hvd, r), "sets": _process_sets(hvd, r, n)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_semantics, WORKERS, timeout=120)


def test_integers_are_scaled_in_float64_and_truncated(results: list[dict]) -> None:
    n = WORKERS
    base = torch.tensor([3, 5, -7], dtype=torch.float64)
    total = base * sum(k + 1 for k in range(n))
    for out in (result["integers"] for result in results):
        assert out["average"].dtype == torch.int32 and out["average"].tolist() == (total / n).long().tolist()
        prescaled = sum(((base * (k + 1)) * 0.3).long() for k in range(n))  # each rank's share truncated
        assert out["prescale"].dtype == torch.int32 and out["prescale"].tolist() == prescaled.tolist()
        assert out["postscale"].dtype == torch.int64 and out["postscale"].tolist() == (total * 0.3).long().tolist()
        assert out["grouped_average"][1].tolist() == (2 * total / n).long().tolist()
        shares = torch.arange(2 * n, dtype=torch.float64) * sum(k + 1 for k in range(n)) / n
        assert out["reducescatter_average"].dtype == torch.int64
        assert out["half_prescale"].dtype == torch.float16
        torch.testing.assert_close(out["half_prescale"].float(), torch.full((3,), n * float(torch.tensor(1.5 * 0.1,
                                   dtype=torch.float32).half())))
    for r, result in enumerate(results):
        assert result["integers"]["reducescatter_average"].tolist() == shares.long()[2 * r:2 * r + 2].tolist()


def test_reduce_scatter_and_grouped_gradients_follow_horovod(results: list[dict]) -> None:
    n = WORKERS
    for r, result in enumerate(results):
        grads = result["grads"]
        torch.testing.assert_close(grads["reducescatter_sum"], torch.full((2 * n, 3), float(n)))
        torch.testing.assert_close(grads["reducescatter_average"], torch.ones(2 * n, 3))
        for grad in grads["grouped_reducescatter"]:
            torch.testing.assert_close(grad, torch.full_like(grad, 0.5 * n))
        offset = sum(k + 1 for k in range(r))
        rows = torch.arange(2.0 * sum(k + 1 for k in range(n))).view(-1, 2)
        torch.testing.assert_close(grads["grouped_allgather"][0], rows[offset:offset + r + 1])
        torch.testing.assert_close(grads["grouped_allgather"][1], torch.tensor([float(r)]))


def test_sparse_allreduce_equals_the_dense_one(results: list[dict]) -> None:
    for r, out in enumerate(result["sparse"] for result in results):
        assert out["sum"].is_sparse and out["sum"].is_coalesced()
        torch.testing.assert_close(out["sum"].to_dense(), out["dense"])
        torch.testing.assert_close(out["average"].to_dense(), out["dense"] / WORKERS)
        assert ("set_sum" in out) == (r < WORKERS // 2)
        if "set_sum" in out:  # the set's ranks only: not the whole job's sum
            assert out["set_sum"].is_sparse and not torch.equal(out["set_dense"], out["dense"])
            torch.testing.assert_close(out["set_sum"].to_dense(), out["set_dense"])


def test_optimizer_state_is_created_then_broadcast(results: list[dict]) -> None:
    for out in (result["state"] for result in results):
        assert out["frozen_grad"] is None and torch.equal(out["trained_grad"], torch.zeros(3))
        torch.testing.assert_close(out["momentum"], results[0]["state"]["momentum"])
        torch.testing.assert_close(out["weights"], results[0]["state"]["weights"])


def test_roots_in_process_sets_are_global_ranks(results: list[dict]) -> None:
    for r, result in enumerate(results):
        out = result["sets"]
        if r not in (1, 3):
            assert out == {}
            continue
        assert out["broadcast"] == 3 and out["object"] == "from 3"
        torch.testing.assert_close(out["grad"], torch.full((2,), 3.0 if r == 3 else 0.0))  # (2 + 4) / 2 at root
        assert "root_rank 0 is not a member" in out["not_a_member"]
        assert out["still_works"] == 4.0


def test_bad_parameter_names_are_refused_before_init() -> None:
    import phalanx.horovod.torch as hvd

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="must be unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", model.weight), ("w", model.bias)])


def _duplicate_name_beside_a_barrier() -> list[str]:
    """Horovod's duplicate-name test, as 2 ranks run it: rank 0 submits a named allgather and the
    same name again while rank 1 waits at a barrier; then the reverse."""
    import phalanx.horovod.torch as hvd

    hvd.init()
    r, seen = hvd.rank(), []
    tensor = torch.ones(3, 2)
    for turn in (0, 1):
        if r == turn:
            hvd.allgather_async(tensor, name="duplicate_name")  # its error, if any, comes with synchronize
            seen.append(_raised(lambda: hvd.allgather_async(tensor, name="duplicate_name")))
        seen.append(_raised(hvd.barrier))
    seen.append(str(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()))
    hvd.shutdown()
    hvd.init()
    seen.append(str(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()))
    return seen


def test_a_name_in_flight_is_refused_locally_and_no_rank_fails_alone() -> None:
    """Matching by name is not there yet (docs/horovod.md): the second submission of a name raises
    ValueError on its own rank without a collective, a failed pairing fails on both ranks, and the
    ranks stay in step: the next collective, and a fresh init, work everywhere."""
    for seen in run_workers(_duplicate_name_beside_a_barrier, 2, timeout=60):
        assert sum(entry.startswith("ConfigurationError") and "same name 'duplicate_name'" in entry
                   for entry in seen) == 1, seen
        assert seen[-2:] == ["2.0", "2.0"], seen
