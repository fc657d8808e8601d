"""Every collective and reduce op on real worker processes at world sizes 1, 2 and 3."""

from __future__ import annotations

import time

import pytest
import torch

import phalanx as px
from phalanx.comm.collectives import broadcast_tensors_
from tests.harness import run_workers


def _rank_tensor(rank: int, rows: int = 2) -> torch.Tensor:
    return torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) + 10 * rank + 1


def _every_collective() -> dict:
    r, n = px.rank(), px.size()
    t = _rank_tensor(r)
    out = {op: px.allreduce(t, op=op) for op in ("sum", "avg", "min", "max", "product")}
    inplace = t.clone()
    out["inplace_is_same"] = px.allreduce_(inplace, op="sum") is inplace
    out["inplace"] = inplace
    out["input_untouched"] = torch.equal(t, _rank_tensor(r))
    out["allgather_uneven"] = px.allgather(torch.full((r + 1, 2), float(r)))
    out["allgather_scalar"] = px.allgather(torch.tensor(r))
    known = [k + 1 for k in range(n)]  # every rank's length told: no exchange of lengths
    out["allgather_known"] = px.allgather(torch.full((r + 1, 2), float(r)), check=False, lengths=known)
    out["allgather_known_checked"] = px.allgather(torch.full((r + 1, 2), float(r)), lengths=known)
    out["broadcast"] = px.broadcast(t, root=n - 1)
    out["reduce"] = px.reduce(t, root=n - 1, op="sum")
    in_place = t.clone()
    out["reduce_"] = (px.reduce_(in_place, root=n - 1, op="avg"), in_place)
    out["reduce_scatter_even"] = px.reduce_scatter(torch.ones(2 * n, 2) * (r + 1), op="sum")
    out["reduce_scatter_uneven"] = px.reduce_scatter(torch.arange(2 * n + 1.0), op="max")
    splits = [(r + dest) % 2 + 1 for dest in range(n)]
    out["alltoall"] = px.alltoall(torch.full((sum(splits),), r, dtype=torch.int64), splits=splits)
    out["alltoall_even"] = px.alltoall(torch.arange(n * 2) + 100 * r)
    arriving = sum((k + r) % 2 + 1 for k in range(n))
    for name, buffer in (("alltoall_buffer", torch.empty(arriving, dtype=torch.int64)),
                         ("alltoall_misfit", torch.empty(arriving + 1, dtype=torch.int64))):
        received = px.alltoall(torch.full((sum(splits),), r, dtype=torch.int64), splits=splits, buffer=buffer)
        out[name] = (received, received.data_ptr() == buffer.data_ptr())
    rows = sum(k + 1 for k in range(n))
    for name, buffer in (("allgather_buffer", torch.empty(rows, 2)), ("allgather_misfit", torch.empty(rows, 3))):
        received = px.allgather(torch.full((r + 1, 2), float(r)), buffer=buffer)
        out[name] = (received, received.data_ptr() == buffer.data_ptr())
    px.barrier()
    out["object"] = px.broadcast_object({"from": r, "list": [1, 2]} if r == 0 else None)
    out["objects"] = px.allgather_object(("rank", r))
    handles = {
        "allreduce": px.allreduce(t, op="sum", async_op=True),
        "allgather": px.allgather(torch.full((r + 1,), r), async_op=True),
        "broadcast": px.broadcast(t, root=0, async_op=True),
        "reduce": px.reduce(t, root=0, async_op=True),
        "reduce_scatter": px.reduce_scatter(torch.ones(n * 2), async_op=True),
        "alltoall": px.alltoall(torch.arange(n), async_op=True),
        "barrier": px.barrier(async_op=True),
        "objects": px.allgather_object(r, async_op=True),
        "object": px.broadcast_object(r, root=0, async_op=True),
    }
    out["async"] = {name: handle.wait() for name, handle in handles.items()}
    out["async_completed"] = all(handle.is_completed() for handle in handles.values())
    return out


def _expected_allreduce(n: int, op: str) -> torch.Tensor:
    stacked = torch.stack([_rank_tensor(r) for r in range(n)])
    return {"sum": stacked.sum(0), "avg": stacked.mean(0), "min": stacked.min(0).values,
            "max": stacked.max(0).values, "product": stacked.prod(0)}[op]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_collective_gives_the_reference_result(world_size: int) -> None:
    n = world_size
    results = run_workers(_every_collective, n)
    for r, out in enumerate(results):
        for op in ("sum", "avg", "min", "max", "product"):
            torch.testing.assert_close(out[op], _expected_allreduce(n, op), msg=f"rank {r} op {op}")
        assert out["inplace_is_same"] and out["input_untouched"]
        torch.testing.assert_close(out["inplace"], _expected_allreduce(n, "sum"))
        assert torch.equal(out["allgather_uneven"], torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]))
        assert torch.equal(out["allgather_known"], out["allgather_uneven"])
        assert torch.equal(out["allgather_known_checked"], out["allgather_uneven"])
        assert out["allgather_scalar"].tolist() == list(range(n))
        assert torch.equal(out["broadcast"], _rank_tensor(n - 1))
        if r == n - 1:
            torch.testing.assert_close(out["reduce"], _expected_allreduce(n, "sum"))
            assert out["reduce_"][0] is not None
            torch.testing.assert_close(out["reduce_"][1], _expected_allreduce(n, "avg"))
            assert out["reduce_"][0].data_ptr() == out["reduce_"][1].data_ptr()
        else:
            assert out["reduce"] is None
        expected_even = torch.ones(2, 2) * sum(k + 1 for k in range(n))
        assert torch.equal(out["reduce_scatter_even"], expected_even)
        assert torch.equal(out["reduce_scatter_uneven"], torch.tensor_split(torch.arange(2 * n + 1.0), n)[r])
        expected_alltoall = torch.cat([torch.full(((k + r) % 2 + 1,), k, dtype=torch.int64) for k in range(n)])
        assert torch.equal(out["alltoall_buffer"][0], expected_alltoall) and out["alltoall_buffer"][1]  # received there
        assert torch.equal(out["allgather_buffer"][0], out["allgather_uneven"]) and out["allgather_buffer"][1]
        assert torch.equal(out["allgather_misfit"][0], out["allgather_uneven"]) and not out["allgather_misfit"][1]
        assert torch.equal(out["alltoall_misfit"][0], expected_alltoall) and not out["alltoall_misfit"][1]
        assert torch.equal(out["alltoall"], expected_alltoall)
        assert out["alltoall_even"].tolist() == [100 * k + 2 * r + j for k in range(n) for j in range(2)]
        assert out["object"] == {"from": 0, "list": [1, 2]}
        assert out["objects"] == [("rank", k) for k in range(n)]
        done = out["async"]
        torch.testing.assert_close(done["allreduce"], _expected_allreduce(n, "sum"))
        assert done["allgather"].tolist() == [k for k in range(n) for _ in range(k + 1)]
        assert torch.equal(done["broadcast"], _rank_tensor(0))
        assert (done["reduce"] is None) == (r != 0)
        assert done["reduce_scatter"].tolist() == [float(n)] * 2
        assert done["alltoall"].tolist() == [r] * n
        assert done["barrier"] is None
        assert done["objects"] == list(range(n)) and done["object"] == 0
        assert out["async_completed"]


def _mixed_tensors(rank: int) -> list[torch.Tensor]:
    return [torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank, torch.full((4,), rank + 0.5, dtype=torch.float64),
            torch.arange(5) * (rank + 1), torch.empty(0, 3), torch.tensor(rank + 10.0)]


def _grouped_broadcast_from_rank_one() -> list[torch.Tensor]:
    tensors = _mixed_tensors(px.rank())
    originals = [t.data_ptr() for t in tensors]
    broadcast_tensors_(tensors, root=1)
    assert [t.data_ptr() for t in tensors] == originals  # filled in place
    return tensors


def test_the_grouped_broadcast_gives_every_rank_roots_tensors() -> None:
    """Mixed dtypes (two float32 tensors share a buffer), an empty tensor, a scalar, root 1 of 3."""
    for rank, received in enumerate(run_workers(_grouped_broadcast_from_rank_one, 3)):
        expected = _mixed_tensors(1)
        assert [(t.dtype, t.shape) for t in received] == [(t.dtype, t.shape) for t in expected], rank
        assert all(torch.equal(got, want) for got, want in zip(received, expected)), rank


def _mismatched_allreduce() -> tuple[str, str, bool, float]:
    """The message, the in-place form's message, whether its tensor kept its values (through shared
    memory the check travels with the data), and a sum right after (the ranks are in step)."""
    shape = (2, 3) if px.rank() == 0 else (3, 2)
    messages = []
    mine = torch.full(shape, px.rank() + 1.0)
    for call in (lambda: px.allreduce(torch.ones(shape)), lambda: px.allreduce_(mine)):
        try:
            call()
            messages.append("no error")
        except px.CollectiveMismatchError as error:
            messages.append(str(error))
    kept = torch.equal(mine, torch.full(shape, px.rank() + 1.0))
    return messages[0], messages[1], kept, px.allreduce(torch.ones(1)).item()


def _mismatched_dtype_and_operation() -> list[str]:
    messages = []
    for call in (
        lambda: px.allreduce(torch.ones(4, dtype=torch.float32 if px.rank() == 0 else torch.float64)),
        lambda: px.allreduce(torch.ones(4)) if px.rank() == 0 else px.broadcast(torch.ones(4)),
        lambda: px.allgather(torch.ones(2, 3 + px.rank())),
        lambda: px.allgather(torch.ones(2)) if px.rank() == 0 else px.barrier(),  # one side may not pass alone
    ):
        try:
            call()
            messages.append("no error")
        except px.CollectiveMismatchError as error:
            messages.append(str(error))
    messages.append(str(px.allreduce(torch.ones(1)).item()))  # still in step
    return messages


@pytest.mark.parametrize("world_size", [2, 3])
def test_shape_mismatch_raises_on_every_rank_naming_ranks_and_shapes(world_size: int) -> None:
    started = time.monotonic()
    outcomes = run_workers(_mismatched_allreduce, world_size)
    assert time.monotonic() - started < 30
    for message, in_place, kept, total in outcomes:
        assert "rank 0: allreduce(torch.float32, shape=[2, 3])" in message
        assert "rank 1: allreduce(torch.float32, shape=[3, 2])" in message
        assert in_place == message and kept and total == world_size


def test_dtype_and_operation_mismatches_raise_on_every_rank() -> None:
    for messages in run_workers(_mismatched_dtype_and_operation, 2):
        dtype, operation, gathered, barrier, after = messages
        assert "torch.float32" in dtype and "torch.float64" in dtype
        assert "allreduce(" in operation and "broadcast(" in operation
        assert "shape=[2, 3]" in gathered and "shape=[2, 4]" in gathered
        assert "rank 0: allgather(" in barrier and "rank 1: barrier(" in barrier
        assert after == "2.0"


def _rank_one_skips_the_collective() -> str:
    if px.rank() == 1:
        time.sleep(8)  # never joins; rank 0 must give up on its own
        return "skipped"
    started = time.monotonic()
    try:
        px.allreduce(torch.ones(3))
    except px.CollectiveTimeoutError as error:
        return f"{time.monotonic() - started:.1f}s {error}"
    return "no error"


def test_a_rank_that_skips_a_collective_fails_the_others_within_the_timeout() -> None:
    started = time.monotonic()
    outcome = run_workers(_rank_one_skips_the_collective, 2, collective_timeout=2.0)
    assert time.monotonic() - started < 25
    assert "allreduce" in outcome[0] and "rank 0 of 2" in outcome[0], outcome[0]
    assert float(outcome[0].split("s ")[0]) < 6


def _peer_dies() -> str:
    if px.rank() == 1:
        import os

        os._exit(7)
    try:
        px.allreduce(torch.ones(3))
        px.allreduce(torch.ones(3))
    except px.CollectiveTimeoutError as error:
        return str(error)
    return "no error"


def test_a_dead_peer_raises_collective_timeout_error_naming_the_operation() -> None:
    from tests.harness import WorkersFailed

    with pytest.raises(WorkersFailed, match="rank 1 exited with code 7"):
        run_workers(_peer_dies, 2, collective_timeout=5.0, timeout=30)


def test_bad_arguments_get_clear_errors_without_a_job() -> None:
    px.init()
    with pytest.raises(px.ConfigurationError, match="op must be one of"):
        px.allreduce(torch.ones(2), op="mean")
    with pytest.raises(px.ConfigurationError, match="floating-point"):
        px.allreduce(torch.ones(2, dtype=torch.int64), op="avg")
    with pytest.raises(px.ConfigurationError, match="root must be a rank"):
        px.broadcast(torch.ones(2), root=1)
    with pytest.raises(px.ConfigurationError, match="splits"):
        px.alltoall(torch.ones(3), splits=[2])
    with pytest.raises(px.ConfigurationError, match="this rank's tensor has 3 rows"):
        px.allgather(torch.ones(3), check=False, lengths=[2])


def _wrong_lengths() -> str:
    try:
        px.allgather(torch.ones(px.rank() + 1), lengths=[1, 1])
    except px.CollectiveMismatchError as error:
        return str(error)
    return "no error"


def test_lengths_told_to_a_checked_allgather_are_compared_on_every_rank() -> None:
    for message in run_workers(_wrong_lengths, 2):
        assert "told the ranks' lengths are [1, 1], but they are [1, 2]" in message


def _exchanges_in_flight_together() -> list[torch.Tensor]:
    """Over Gloo (no shared memory) reduce-scatters and allgathers are point-to-point exchanges: several
    in flight at once between the same ranks, waited in another order than started, keep their messages."""
    px.shutdown()
    px.init(transport="gloo")
    rank, size = px.rank(), px.size()
    started, buffers = [], []
    for k in range(3):  # sizes that differ, so that a message taken by the wrong exchange would not fit
        buffers.append(torch.empty(sum(range(k + 1, k + size + 1))))  # received straight into place
        started.append(px.allgather(torch.full((k + rank + 1,), float(rank)), async_op=True, buffer=buffers[-1]))
        started.append(px.reduce_scatter(torch.arange(float(size * (k + 2))) * (rank + 1), async_op=True))
    results = [handle.wait() for handle in reversed(started)][::-1]
    assert all(results[2 * k].data_ptr() == buffers[k].data_ptr() for k in range(3))
    return results


def test_exchanges_in_flight_together_keep_their_messages_apart() -> None:
    size = 3
    for rank, results in enumerate(run_workers(_exchanges_in_flight_together, size)):
        for k in range(3):
            gathered, scattered = results[2 * k], results[2 * k + 1]
            assert torch.equal(gathered, torch.cat([torch.full((k + r + 1,), float(r)) for r in range(size)]))
            total = torch.arange(float(size * (k + 2))) * sum(range(1, size + 1))
            assert torch.equal(scattered, total.tensor_split(size)[rank]), (rank, k)
