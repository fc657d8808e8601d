"""``phalanx.horovod.torch``'s collectives at 2 and 3 workers: results equal to a single-process
reference, autograd as Horovod defines it, process sets, the object collectives, the timeline,
and the errors every rank raises on mismatched calls."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from tests.harness import run_workers


def _value(rank: int, rows: int = 2) -> torch.Tensor:
    return torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) + 10 * rank + 1


def _raised(fn) -> str:
    """The exception type and message ``fn`` raised (the test asserts every rank got one)."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - recorded for the test to inspect
        return f"{type(error).__name__}: {error}"
    return "nothing raised"


def _every_collective(trace: str) -> dict:
    import phalanx.horovod.torch as hvd

    evens = hvd.ProcessSet(list(range(0, int(os.environ["PHALANX_WORLD_SIZE"]), 2)))
    hvd.init(process_sets=[evens])  # static; HOROVOD_DYNAMIC_PROCESS_SETS=1 allows dynamic ones too
    r, n = hvd.rank(), hvd.size()
    t = _value(r)
    out: dict = {"size": n, "rank": r, "local": (hvd.local_rank(), hvd.local_size()),
                 "cross": (hvd.cross_rank(), hvd.cross_size()), "homogeneous": hvd.is_homogeneous()}
    hvd.start_timeline(trace)
    out["ops"] = {name: hvd.allreduce(t, op=op, name=f"op.{name}")
                  for name, op in [("avg", hvd.Average), ("sum", hvd.Sum), ("min", hvd.Min), ("max", hvd.Max),
                                   ("product", hvd.Product)]}
    with pytest.warns(DeprecationWarning):
        out["average_false"] = hvd.allreduce(t, average=False)
    out["scaled"] = hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5 / n)
    out["fp16"] = hvd.allreduce(t.float(), compression=hvd.Compression.fp16)
    inplace = t.clone()
    out["inplace_same"] = hvd.allreduce_(inplace, op=hvd.Sum) is inplace
    out["inplace"] = inplace
    handle = hvd.allreduce_async(t, op=hvd.Sum, name="async.sum")
    out["poll_type"] = isinstance(hvd.poll(handle), bool)
    out["async"] = hvd.synchronize(handle)
    in_place = t.clone()
    out["async_"] = hvd.synchronize(hvd.allreduce_async_(in_place, op=hvd.Max)) is in_place and in_place.equal(
        torch.stack([_value(k) for k in range(n)]).max(0).values)
    pair = [t, torch.full((4,), float(r), dtype=torch.float32)]
    out["grouped"] = hvd.grouped_allreduce(pair, op=hvd.Sum)
    out["grouped_async"] = hvd.synchronize(hvd.grouped_allreduce_async(pair))
    group = [p.clone() for p in pair]
    out["grouped_"] = hvd.grouped_allreduce_(group, op=hvd.Sum)[1] is group[1]
    out["grouped_async_"] = hvd.synchronize(hvd.grouped_allreduce_async_([p.clone() for p in pair], op=hvd.Min))
    out["allgather"] = hvd.allgather(torch.full((r + 1, 2), float(r)))
    out["allgather_async"] = hvd.synchronize(hvd.allgather_async(torch.tensor([r])))
    out["grouped_allgather"] = hvd.grouped_allgather([torch.tensor([r]), torch.full((1, 2), r)])
    out["grouped_allgather_async"] = hvd.synchronize(hvd.grouped_allgather_async([torch.tensor([2 * r])]))
    out["broadcast"] = hvd.broadcast(t, root_rank=n - 1)
    out["broadcast_async"] = hvd.synchronize(hvd.broadcast_async(t, root_rank=0))
    b = t.clone()
    out["broadcast_"] = hvd.broadcast_(b, root_rank=1) is b and b.equal(_value(1))
    b = t.clone()
    out["broadcast_async_"] = hvd.synchronize(hvd.broadcast_async_(b, 1)).equal(_value(1))
    splits = [(r + dest) % 2 + 1 for dest in range(n)]
    out["alltoall_splits"] = hvd.alltoall(torch.full((sum(splits), 2), r), splits=splits)
    out["alltoall_even"] = hvd.alltoall(torch.arange(2 * n) + 100 * r)
    out["alltoall_async"] = hvd.synchronize(hvd.alltoall_async(torch.arange(n) + 10 * r, torch.ones(n, dtype=torch.int32)))
    out["reducescatter"] = hvd.reducescatter(torch.ones(2 * n + 1, 2) * (r + 1))
    out["reducescatter_sum"] = hvd.reducescatter(torch.ones(2 * n, 2) * (r + 1), op=hvd.Sum, prescale_factor=3.0)
    out["reducescatter_async"] = hvd.synchronize(hvd.reducescatter_async(torch.ones(n) * r, op=hvd.Sum))
    out["grouped_reducescatter"] = hvd.grouped_reducescatter([torch.ones(n) * r, torch.ones(2 * n) * 2], op=hvd.Sum)
    out["grouped_reducescatter_async"] = hvd.synchronize(hvd.grouped_reducescatter_async([torch.ones(n) * r]))
    hvd.barrier()
    out["object"] = hvd.broadcast_object({"from": r} if r == 1 else None, root_rank=1)
    out["objects"] = hvd.allgather_object(("rank", r))
    out["autograd"] = _autograd(hvd, r, n)
    out["process_sets"] = _process_sets(hvd, evens, r, n)
    out["errors"] = _errors(hvd, r, n)
    hvd.stop_timeline()
    hvd.shutdown()
    return out


def _autograd(hvd, r: int, n: int) -> dict:
    """Gradients of each differentiable collective, for the test to compare with Horovod's definitions."""
    grads = {}
    x = (_value(r) * 1.0).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * (r + 1)).sum().backward()
    grads["allreduce"] = x.grad
    x = torch.full((r + 1, 2), 1.0, requires_grad=True)
    (hvd.allgather(x) * torch.arange(1.0, sum(range(1, n + 2)) * 1 + 1).reshape(-1, 1)[: sum(range(1, n + 1))]
     ).sum().backward()
    grads["allgather"] = x.grad
    x = torch.ones(3, requires_grad=True)
    (hvd.broadcast(x, root_rank=1) * (r + 1)).sum().backward()
    grads["broadcast"] = x.grad
    x = torch.ones(2 * n, requires_grad=True)
    (hvd.alltoall(x) * (r + 1)).sum().backward()
    grads["alltoall"] = x.grad
    x = torch.ones(2 * n, 2, requires_grad=True)
    (hvd.reducescatter(x) * (r + 1)).sum().backward()
    grads["reducescatter"] = x.grad
    xs = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
    sum(y.sum() * (r + 1) for y in hvd.grouped_allreduce(xs)).backward()
    grads["grouped_allreduce"] = [x.grad for x in xs]
    return grads


def _process_sets(hvd, evens, r: int, n: int) -> dict:
    """A static set of the even ranks and a dynamic one of the last two; collectives stay inside each."""
    out = {}
    out["static_id"] = evens.process_set_id
    if evens.included():
        out["evens_sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=evens)
        out["evens_bcast"] = hvd.broadcast(torch.tensor([r]), root_rank=evens.ranks[-1], process_set=evens)  # global
        out["evens_gather"] = hvd.allgather(torch.tensor([r]), process_set=evens)
        x = torch.ones(2, requires_grad=True)
        (hvd.allreduce(x, op=hvd.Sum, process_set=evens) * (r + 1)).sum().backward()
        out["evens_grad"] = x.grad
    else:
        out["outsider"] = _raised(lambda: hvd.allreduce(torch.ones(1), process_set=evens))
    last_two = hvd.add_process_set([n - 2, n - 1])
    if last_two.included():
        out["dynamic_sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=last_two)
        out["dynamic_rank"] = (last_two.rank(), last_two.size())
    out["duplicate"] = _raised(lambda: hvd.add_process_set([n - 2, n - 1]))
    out["removed"] = hvd.remove_process_set(last_two)
    out["removed_again"] = hvd.remove_process_set(last_two)
    out["after_removal"] = _raised(lambda: hvd.allreduce(torch.ones(1), process_set=last_two))
    out["global_not_removed"] = hvd.remove_process_set(hvd.global_process_set)
    return out


def _errors(hvd, r: int, n: int) -> dict:
    """Mismatched calls raise on every rank; a name in flight raises at once."""
    out = {}
    out["shape"] = _raised(lambda: hvd.allreduce(torch.ones(r + 2)))
    out["dtype"] = _raised(lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if r else torch.float64)))
    out["root"] = _raised(lambda: hvd.broadcast(torch.ones(2), root_rank=r))
    out["op"] = _raised(lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r else hvd.Max))
    # A name is taken until its operation completes, which here needs the others' part after the barrier.
    handle = hvd.allreduce_async(torch.ones(2), name="twice") if r == 0 else None
    out["duplicate_name"] = _raised(lambda: hvd.allreduce_async(torch.ones(2), name="twice")) if r == 0 else None
    hvd.barrier()
    handle = hvd.allreduce_async(torch.ones(2), name="twice") if r else handle
    hvd.synchronize(handle)
    out["reused_after_sync"] = hvd.allreduce(torch.ones(2), name="twice").tolist()
    out["adasum"] = _raised(lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum))
    out["both"] = _raised(lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum))
    out["still_works"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    # While rank 0 has joined, the others' allreduces get its zeros; anything else raises everywhere.
    joined = hvd.join() if r == 0 else (hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item(), hvd.join())
    out["join_allreduce"] = joined
    # Another collective raises on the ranks that call it; the joined rank goes on waiting.
    if r == 0:
        out["join_other"] = hvd.join()
    else:
        out["join_other"] = _raised(lambda: hvd.allgather(torch.ones(1)))
        hvd.join()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_matches_the_reference_on_every_rank(world_size: int) -> None:
    n = world_size
    with tempfile.TemporaryDirectory() as folder:
        trace = os.path.join(folder, "timeline.json")
        results = run_workers(_every_collective, n, trace, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
        events = json.load(open(trace))
    stacked = torch.stack([_value(k) for k in range(n)])
    for r, out in enumerate(results):
        assert (out["size"], out["rank"], out["local"], out["cross"], out["homogeneous"]) == (n, r, (r, n), (0, 1), True)
        expected = {"avg": stacked.mean(0), "sum": stacked.sum(0), "min": stacked.min(0).values,
                    "max": stacked.max(0).values, "product": stacked.prod(0)}
        for name, value in expected.items():
            torch.testing.assert_close(out["ops"][name], value)
        torch.testing.assert_close(out["average_false"], stacked.sum(0))
        torch.testing.assert_close(out["scaled"], stacked.mean(0))
        torch.testing.assert_close(out["fp16"], stacked.mean(0).float(), rtol=1e-3, atol=1e-2)
        assert out["fp16"].dtype == torch.float32
        assert out["inplace_same"] and out["async_"] and out["grouped_"] and out["poll_type"]
        torch.testing.assert_close(out["inplace"], stacked.sum(0))
        torch.testing.assert_close(out["async"], stacked.sum(0))
        fours = torch.stack([torch.full((4,), float(k)) for k in range(n)])
        torch.testing.assert_close(out["grouped"][0], stacked.sum(0))
        torch.testing.assert_close(out["grouped"][1], fours.sum(0))
        torch.testing.assert_close(out["grouped_async"][1], fours.mean(0))
        torch.testing.assert_close(out["grouped_async_"][0], stacked.min(0).values)
        assert out["allgather"].equal(torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]))
        assert out["allgather_async"].tolist() == list(range(n))
        assert out["grouped_allgather"][0].tolist() == list(range(n))
        assert out["grouped_allgather"][1].equal(torch.stack([torch.full((2,), k) for k in range(n)]))
        assert out["grouped_allgather_async"][0].tolist() == [2 * k for k in range(n)]
        assert out["broadcast"].equal(_value(n - 1)) and out["broadcast_async"].equal(_value(0))
        assert out["broadcast_"] and out["broadcast_async_"]
        received = [(k + r) % 2 + 1 for k in range(n)]
        output, splits = out["alltoall_splits"]
        assert splits.dtype == torch.int32 and splits.tolist() == received
        assert output.equal(torch.cat([torch.full((c, 2), k) for k, c in enumerate(received)]))
        assert out["alltoall_even"].tolist() == [100 * k + 2 * r + j for k in range(n) for j in range(2)]
        assert out["alltoall_async"][0].tolist() == [10 * k + r for k in range(n)]
        assert out["alltoall_async"][1].tolist() == [1] * n
        mean = sum(k + 1 for k in range(n)) / n
        rows = [len(c) for c in torch.tensor_split(torch.arange(2 * n + 1), n)][r]
        torch.testing.assert_close(out["reducescatter"], torch.full((rows, 2), mean))
        torch.testing.assert_close(out["reducescatter_sum"], torch.full((2, 2), 3.0 * n * mean))
        torch.testing.assert_close(out["reducescatter_async"], torch.full((1,), float(sum(range(n)))))
        torch.testing.assert_close(out["grouped_reducescatter"][1], torch.full((2,), 2.0 * n))
        torch.testing.assert_close(out["grouped_reducescatter_async"][0], torch.full((1,), sum(range(n)) / n))
        assert out["object"] == {"from": 1} and out["objects"] == [("rank", k) for k in range(n)]
        _check_autograd(out["autograd"], r, n)
        _check_process_sets(out["process_sets"], r, n)
        _check_errors(out["errors"], r, n)
    joined_last = [out["errors"]["join_allreduce"] for out in results]
    assert len({joined_last[0]} | {joined[1] for joined in joined_last[1:]}) == 1, joined_last
    names = {event["name"] for event in events}
    assert {"ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL", "REDUCESCATTER"} <= names
    assert any(event["tid"] == "op.avg" and event["dur"] >= 0 for event in events)


def _check_autograd(grads: dict, r: int, n: int) -> None:
    weights = sum(k + 1 for k in range(n))
    # allreduce(Sum): the gradient is the same allreduce of the output gradients.
    torch.testing.assert_close(grads["allreduce"], torch.full((2, 3), float(weights), dtype=torch.float64))
    # allgather: the average of every rank's output gradient, cut to this rank's rows.
    offset = sum(k + 1 for k in range(r))
    coefficients = torch.arange(1.0, sum(range(1, n + 1)) + 1)
    torch.testing.assert_close(grads["allgather"], coefficients[offset:offset + r + 1].reshape(-1, 1).expand(-1, 2))
    # broadcast: the average on the root, zero elsewhere.
    torch.testing.assert_close(grads["broadcast"], torch.full((3,), weights / n if r == 1 else 0.0))
    # alltoall: each row's gradient comes back from the rank it was sent to.
    torch.testing.assert_close(grads["alltoall"], torch.tensor([float(k + 1) for k in range(n) for _ in range(2)]))
    # reducescatter(Average): the gathered shares' gradients (Horovod counts each once; Sum, size times).
    torch.testing.assert_close(grads["reducescatter"], torch.tensor(
        [float(k + 1) for k in range(n) for _ in range(2)]).reshape(-1, 1).expand(-1, 2))
    for grad in grads["grouped_allreduce"]:
        torch.testing.assert_close(grad, torch.full_like(grad, weights / n))


def _check_process_sets(out: dict, r: int, n: int) -> None:
    evens = list(range(0, n, 2))
    assert out["static_id"] == 1
    if r in evens:
        assert out["evens_sum"].item() == sum(evens)
        assert out["evens_bcast"].item() == evens[-1]
        assert out["evens_gather"].tolist() == evens
        assert out["evens_grad"].tolist() == [float(sum(k + 1 for k in evens))] * 2
    else:
        assert "not part of" in out["outsider"]
    if r >= n - 2:
        assert out["dynamic_sum"].item() == 2 * n - 3 and out["dynamic_rank"] == (r - (n - 2), 2)
    assert "already registered" in out["duplicate"]
    assert out["removed"] is True and out["removed_again"] is False and out["global_not_removed"] is False
    assert "not registered" in out["after_removal"]


def _check_errors(out: dict, r: int, n: int) -> None:
    for case in ("shape", "dtype", "root", "op"):
        assert out[case].startswith("HorovodMismatchError"), (case, out[case])
        assert f"rank {r}" in out[case]
    assert "shape=[2]" in out["shape"] and "shape=[3]" in out["shape"]
    assert "torch.float32" in out["dtype"] and "torch.float64" in out["dtype"]
    if r == 0:
        assert out["duplicate_name"].startswith("ConfigurationError") and "'twice'" in out["duplicate_name"]
    assert out["reused_after_sync"] == [1.0, 1.0]
    assert "Adasum" in out["adasum"] and "supersedes" in out["both"]
    assert out["still_works"] == n
    # The ranks still training each allreduce once more, then join; which of them joins last is a race
    # (as in Horovod): the returned rank is one of them, and the same on every rank (checked by the caller).
    last = out["join_allreduce"] if r == 0 else out["join_allreduce"][1]
    assert last in range(1, n)
    if r:
        assert out["join_allreduce"][0] == n - 1.0
    if r == 0:
        assert out["join_other"] in range(1, n)  # the last to join, after the others' failed allgather
    else:
        assert out["join_other"].startswith("HorovodMismatchError") and "[0] have joined" in out["join_other"]
