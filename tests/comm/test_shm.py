"""Workers on one host reduce through shared memory: the same results as Gloo for every op, dtype
and size; a dead peer named within the timeout; nothing left in /dev/shm."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist

import phalanx as px
from phalanx.comm import runtime, shm
from phalanx.comm.algorithms import BACKEND_OPS
from tests.cli.test_launcher import phalanx_command, worker_env, write_script
from tests.comm.test_algorithms import DTYPES, SIZES, _input
from tests.harness import run_workers
from tests import warm

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm here")

OPS = tuple(BACKEND_OPS)


def _shm_against_gloo() -> dict:
    out = {"shm": runtime.shm_executor() is not None}
    for dtype in DTYPES:
        two_rounds = (shm.SLOT_BYTES // 4 + 3,) if dtype in (torch.float32, torch.int64) else ()
        for numel in (*SIZES, *two_rounds):
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                tensor = _input(px.rank(), numel, dtype)
                through_gloo = tensor.clone()
                if px.size() > 1:
                    dist.all_reduce(through_gloo, BACKEND_OPS[op])
                if op == "avg":
                    through_gloo /= px.size()
                out[(dtype, numel, op)] = (px.allreduce(tensor, op), through_gloo)
    handles = [px.allreduce(torch.full((5,), float(px.rank() + k)), async_op=True) for k in range(4)]
    out["async in order"] = [handle.wait() for handle in handles]
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shared_memory_gives_gloo_results_for_every_op_dtype_and_size(world_size: int) -> None:
    results = run_workers(_shm_against_gloo, world_size)
    assert all(r["shm"] == (world_size > 1) for r in results)
    for key, value in results[0].items():
        if not isinstance(key, tuple):
            continue
        got, expected = value
        dtype = key[0]
        for rank in range(1, world_size):
            assert torch.equal(results[rank][key][0], got), (key, rank)  # the same bits on every rank
        if dtype.is_floating_point:
            tolerance = {torch.float16: 2e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-5)
            torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance, msg=str(key))
        else:
            assert torch.equal(got, expected), key
    total = sum(range(world_size))
    for k, got in enumerate(results[0]["async in order"]):
        assert torch.equal(got, torch.full((5,), float(total + k * world_size)))


def _scatter_and_gather_against_gloo() -> dict:
    """px.reduce_scatter and px.allgather (through shared memory) beside Gloo's, for uneven chunks and
    tensors of several rounds of a slot (two ranks: the two-set layout; more: one set)."""
    world, rank, out = px.size(), px.rank(), {"shm": runtime.shm_executor() is not None}
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        for rows in (world, 7 * world + 3, shm.SLOT_BYTES // 2 + 5):
            tensor = _input(rank, rows, dtype)
            for op in ("sum", "max"):
                expected = torch.empty_like(torch.tensor_split(tensor, world)[rank])
                dist.reduce_scatter(expected, [chunk.contiguous() for chunk in torch.tensor_split(tensor, world)],
                                    BACKEND_OPS[op])
                out[("reduce_scatter", dtype, rows, op)] = (px.reduce_scatter(tensor, op), expected)
    rows = [3, 0, 300_001, 1][:world] if world > 2 else [0, 300_001]
    mine = torch.arange(rows[rank] * 3, dtype=torch.float64).view(rows[rank], 3) - rank
    expected = torch.cat([torch.arange(n * 3, dtype=torch.float64).view(n, 3) - r for r, n in enumerate(rows)])
    out["allgather uneven"] = (px.allgather(mine), expected)
    out["allgather lengths"] = (px.allgather(mine, lengths=rows, check=False), expected)
    handles = [px.reduce_scatter(torch.full((2 * world,), float(rank + k)), async_op=True) for k in range(3)]
    out["async in order"] = [handle.wait() for handle in handles]
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_scatter_and_allgather_through_shared_memory_give_gloos_results(world_size: int) -> None:
    results = run_workers(_scatter_and_gather_against_gloo, world_size)
    assert all(r["shm"] for r in results)
    for rank, result in enumerate(results):
        for key, value in result.items():
            if key == "shm":
                continue
            if key == "async in order":
                total = sum(range(world_size))
                assert [h.tolist() for h in value] == [[float(total + k * world_size)] * 2 for k in range(3)], value
                continue
            got, expected = value
            assert got.dtype == expected.dtype and got.shape == expected.shape, (key, rank)
            if key[0] == "reduce_scatter" and key[1] == torch.bfloat16:
                torch.testing.assert_close(got, expected, rtol=1e-1, atol=1e-1, msg=str((key, rank)))
            elif key[0] == "reduce_scatter" and key[1].is_floating_point:
                torch.testing.assert_close(got, expected, msg=str((key, rank)))
            else:
                assert torch.equal(got, expected), (key, rank)


def _leftovers(job: str) -> list[str]:
    return [name for name in os.listdir(shm.SHM_DIR) if name.startswith(f"{shm.PREFIX}{job}-")]


def test_a_worker_killed_during_an_allreduce_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    script = write_script(tmp_path, "kill.py", """\
        import os, signal, time, torch
        import phalanx as px
        px.init(transport="shm")
        px.allreduce(torch.ones(10))
        if px.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
        px.allreduce(torch.ones(10), check=False)
    """)
    started = time.monotonic()
    launcher = warm.Popen(phalanx_command("-n", "3", "--grace", "5", str(script)), cwd=tmp_path,
                          env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    assert time.monotonic() - started < 20
    assert "worker rank 1" in stderr and "SIGKILL" in stderr, stderr
    assert _leftovers(str(launcher.pid)) == []


def test_a_finished_job_leaves_no_segment(tmp_path: Path) -> None:
    script = write_script(tmp_path, "ok.py", """\
        import torch
        import phalanx as px
        px.init(transport="shm")
        assert int(px.allreduce(torch.ones(3))[0]) == px.size()
    """)
    launcher = warm.Popen(phalanx_command("-n", "2", str(script)), cwd=tmp_path, env=worker_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, stderr
    assert _leftovers(str(launcher.pid)) == []


def _dead_peer_message() -> str:
    px.allreduce(torch.ones(4))
    if px.rank() == 1:
        os._exit(0)  # gone without a word, in the middle of the job
    try:
        px.allreduce(torch.ones(4), check=False)
    except px.CollectiveTimeoutError as error:
        return str(error)
    return "no error"


def test_the_survivor_names_the_dead_peer_at_once() -> None:
    started = time.monotonic()
    try:
        run_workers(_dead_peer_message, 2, timeout=30)
    except AssertionError as failure:  # rank 1 never returns a result; rank 0's message is in the report
        report = str(failure)
    assert time.monotonic() - started < 25
    assert "rank(s) [1] died" in report or "exited" in report, report


def _groups(size: int, tag: str, message_bytes: int = 0) -> list[shm.SharedMemoryGroup]:
    """``size`` ranks of one segment in this process (each rank's calls on a thread of its own)."""
    name = f"phalanx-test-{tag}-{os.getpid()}"
    groups = [shm.SharedMemoryGroup(name, rank, size, 10.0, create=rank == 0, message_bytes=message_bytes)
              for rank in range(size)]
    groups[0].unlink()
    return groups


def _on_threads(*calls) -> list:
    """Run each call on a thread of its own; what each returned or raised, in order."""
    outcomes: list = [None] * len(calls)

    def run(index: int) -> None:
        try:
            outcomes[index] = calls[index]()
        except Exception as error:  # noqa: BLE001 - the test looks at it
            outcomes[index] = error
    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


@pytest.mark.skipif(shm._futex is None, reason="no futex here")
def test_a_waiting_rank_blocks_without_a_core_and_its_peer_wakes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The early rank waits 0.3 s for its peer on a futex: hardly any CPU time, and it returns as soon
    as the peer arrives (its own timeout is 5 s); abort() wakes a blocked wait at once too."""
    monkeypatch.setattr(shm, "FIRST_BLOCK_S", 5.0)
    monkeypatch.setattr(shm, "LIVENESS_EVERY_S", 5.0)
    groups = _groups(2, "futex")
    tensors = [torch.full((1000,), 1.0), torch.full((1000,), 2.0)]

    def early() -> tuple[float, float]:
        cpu = time.thread_time()
        groups[0].allreduce_(tensors[0], "sum")
        return time.thread_time() - cpu, time.monotonic()

    def late() -> float:
        time.sleep(0.3)
        arrived = time.monotonic()
        groups[1].allreduce_(tensors[1], "sum")
        return arrived

    ended = []

    def alone() -> None:
        try:
            groups[0].barrier()
        finally:
            ended.append(time.monotonic())

    def aborted() -> float:
        time.sleep(0.3)
        groups[0].abort()
        return time.monotonic()

    try:
        (cpu, done), arrived = _on_threads(early, late)
        waited, abort_at = _on_threads(alone, aborted)
    finally:
        for group in groups:
            group.close()
    assert torch.equal(tensors[0], torch.full((1000,), 3.0)) and torch.equal(tensors[1], tensors[0])
    assert cpu < 0.1, f"the waiting rank used {cpu:.3f}s of CPU in 0.3s"
    assert done - arrived < 1.0, "the arriving peer did not wake the blocked rank"
    assert isinstance(waited, px.CollectiveTimeoutError) and "aborted" in str(waited), waited
    assert ended[0] - abort_at < 1.0, "abort() did not wake the blocked rank"


@pytest.mark.parametrize("size", [2, 3])
def test_the_check_travels_with_the_first_round_and_a_mismatch_leaves_every_tensor_as_it_was(
        monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """Records of different calls: every rank's judge raises after the first arrival, before any
    reduction; the next allreduce is right (the ranks are in step). A rank that sends its record alone
    (it has joined) makes the others send their data again, in rounds it takes part in with zeros.
    Two ranks reduce directly (one arrival a round), three through the result area (two)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # block at once: threads share the GIL
    groups = _groups(size, f"check{size}")
    numel = shm.SLOT_BYTES // 8 + 3  # several rounds (two with three ranks)
    tensors = [torch.full((numel,), float(rank + 1), dtype=torch.float64) for rank in range(size)]

    def judge(rows: list[list[int]]) -> bool:  # 9: a rank that has joined
        active = [row for row in rows if row[0] != 9]
        if any(row != active[0] for row in active):
            raise px.CollectiveMismatchError(f"records differ: {rows}")
        return len(active) == len(rows)

    def call(rank: int, record: list[int]) -> Callable[[], None]:
        return lambda: groups[rank].allreduce_(tensors[rank], "sum", agreement=(record, judge))

    def joined() -> None:
        assert groups[0].gather_records([9, 0]) == [[9, 0]] + [[1, 4]] * (size - 1)
        zeros = torch.zeros(numel, dtype=torch.float64)
        groups[0].allreduce_(zeros, "sum")

    try:
        mismatched = _on_threads(*[call(rank, [1, 4 + (rank == size - 1)]) for rank in range(size)])
        unchanged = [torch.equal(t, torch.full((numel,), float(rank + 1), dtype=torch.float64))
                     for rank, t in enumerate(tensors)]
        matched = _on_threads(*[call(rank, [1, 4]) for rank in range(size)])
        total = sum(range(1, size + 1))
        summed = [torch.equal(t, torch.full((numel,), float(total), dtype=torch.float64)) for t in tensors]
        with_joined = _on_threads(joined, *[call(rank, [1, 4]) for rank in range(1, size)])
    finally:
        for group in groups:
            group.close()
    assert all(isinstance(error, px.CollectiveMismatchError) for error in mismatched), mismatched
    assert len({str(error) for error in mismatched}) == 1  # the same records reached every rank
    assert all(unchanged), "a rank reduced into its tensor before the check"
    assert matched == [None] * size and all(summed)
    assert with_joined == [None] * size
    assert all(torch.equal(t, torch.full((numel,), float((size - 1) * total), dtype=torch.float64))
               for t in tensors[1:])


@pytest.mark.parametrize("size", [2, 3])
def test_messages_of_any_length_are_exchanged_and_an_allreduce_can_carry_them(monkeypatch: pytest.MonkeyPatch,
                                                                             size: int) -> None:
    """exchange() gives every rank's message (one past the area goes in several arrivals, the others
    take part) and every rank's record of the first arrival; an allreduce whose first arrival carries a
    message meets ranks that only exchange: its judge sees their records and raises, nothing is reduced,
    and exchanged() gives every rank's message; the next allreduce and exchange are right (in step)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # block at once: threads share the GIL
    groups = _groups(size, f"messages{size}", message_bytes=64)
    long = bytes(range(200))  # four arrivals' worth of 56 bytes
    tensors = [torch.full((10,), float(rank + 1)) for rank in range(size)]

    def judge(rows: list[list[int]]) -> bool:
        if any(row != [7, 7] for row in rows):
            raise px.CollectiveMismatchError(f"records {rows}")
        return True

    def folding() -> tuple:
        try:
            groups[0].allreduce_(tensors[0], "sum", agreement=([7, 7], judge), message=b"folded")
        except px.CollectiveMismatchError as refused:
            return str(refused), groups[0].exchanged(b"folded")
        return None

    try:
        exchanged = _on_threads(*[lambda rank=rank: groups[rank].exchange(long if rank == 1 else b"r%d" % rank,
                                                                        record=[rank, 5]) for rank in range(size)])
        mixed = _on_threads(folding, *[lambda rank=rank: groups[rank].exchange(b"plain%d" % rank, record=[1, 2])
                                       for rank in range(1, size)])
        unchanged = torch.equal(tensors[0], torch.full((10,), 1.0))
        _on_threads(*[lambda rank=rank: groups[rank].allreduce_(tensors[rank], "sum", agreement=([7, 7], judge),
                                                                message=b"") for rank in range(size)])
        after = _on_threads(*[lambda rank=rank: groups[rank].exchange(b"after", record=[0]) for rank in range(size)])
    finally:
        for group in groups:
            group.close()
    messages = [b"r0", long, *(b"r%d" % rank for rank in range(2, size))]
    assert exchanged == [(messages, [[rank, 5] for rank in range(size)])] * size
    refusal, seen = mixed[0]
    assert "records [[7, 7], [1, 2]" in refusal and unchanged, refusal
    carried = [b"folded", *(b"plain%d" % rank for rank in range(1, size))]
    assert seen == carried and [messages for messages, _ in mixed[1:]] == [carried] * (size - 1)
    assert all(torch.equal(t, torch.full((10,), float(sum(range(1, size + 1))))) for t in tensors)
    assert after == [([b"after"] * size, [[0]] * size)] * size


@pytest.mark.skipif(shm._futex is None, reason="no futex here")
def test_a_ring_wakes_a_rank_waiting_on_its_doorbell_and_it_sees_who_is_ahead() -> None:
    """wait_bell() takes no core and returns when the doorbell is rung after the value it was given was
    read (a ring before the wait is not missed); a rank that arrives for an exchange rings those not
    there; ahead() and arrived_records() show the arrival a rank has yet to join, and its records."""
    groups = _groups(2, "bell", message_bytes=64)
    try:
        seen = groups[1].bell()
        groups[0].ring([1])
        started = time.monotonic()
        groups[1].wait_bell(seen, 5.0)  # rung already: returns at once
        at_once = time.monotonic() - started
        cpu, started = time.thread_time(), time.monotonic()
        groups[1].wait_bell(groups[1].bell(), 0.2)  # nobody rings: sleeps the whole timeout
        slept, slept_cpu = time.monotonic() - started, time.thread_time() - cpu
        before = (groups[1].ahead(), groups[1].arrived_records(2))
        seen = groups[1].bell()
        exchange = threading.Thread(target=groups[0].exchange, args=(b"news",), kwargs={"record": [4, 2]})
        exchange.start()
        groups[1].wait_bell(seen, 5.0)  # rank 0 rings it once it has spun in vain
        woken = time.monotonic() - started
        during = (groups[1].ahead(), groups[1].arrived_records(2))
        joined = groups[1].exchange(b"reply", record=[4, 2])
        exchange.join(timeout=10)
    finally:
        for group in groups:
            group.close()
    assert at_once < 1.0 and 0.15 < slept < 2.0 and slept_cpu < 0.05, (at_once, slept, slept_cpu)
    assert before == (False, [None, None]) and during == (True, [[4, 2], None]) and woken < 4.0
    assert joined == ([b"news", b"reply"], [[4, 2], [4, 2]])


@pytest.mark.parametrize("futex", [True, False], ids=["futex", "sleeping"])
def test_more_ranks_than_cores_sleep_while_waiting_instead_of_yielding(monkeypatch: pytest.MonkeyPatch,
                                                                        futex: bool) -> None:
    """Two ranks on one core: the early one blocks on a futex (or, without futexes, sleeps), it never
    yields (a yield kept a peer queued on another core waiting); the sum is still right."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    if not futex:
        monkeypatch.setattr(shm, "_futex", None)
    elif shm._futex is None:
        pytest.skip("no futex here")
    yields = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    name = f"phalanx-test-crowded-{os.getpid()}"
    groups = [shm.SharedMemoryGroup(name, rank, 2, 10.0, create=rank == 0) for rank in (0, 1)]
    tensors = [torch.full((1000,), 1.0), torch.full((1000,), 2.0)]

    def late_peer() -> None:
        for _ in range(5):
            time.sleep(0.01)  # rank 0 waits about 10 ms for every arrival
            groups[1].allreduce_(tensors[1], "sum")

    peer = threading.Thread(target=late_peer)
    peer.start()
    try:
        for _ in range(5):
            groups[0].allreduce_(tensors[0], "sum")
    finally:
        peer.join(timeout=30)
        groups[0].unlink()
        for group in groups:
            group.close()
    assert yields == []
    assert torch.equal(tensors[0], tensors[1])
    assert tensors[0][0].item() == 3.0 * 2 ** 4


def test_an_unknown_transport_is_refused() -> None:
    with pytest.raises(px.ConfigurationError, match="transport must be one of"):
        px.init(transport="rdma")


HIERARCHICAL_SCRIPT = """\
    import torch
    import phalanx as px
    from phalanx.comm import runtime
    px.init()
    group = runtime.shm_executor().group
    assert group.cross is not None and group.size == 2, "not hierarchical"
    world, rank = px.size(), px.rank()
    for dtype in (torch.float32, torch.float64, torch.int64):
        for numel in (0, 1, 5, 1_100_001):
            mine = torch.arange(numel, dtype=torch.float64).to(dtype) + rank
            expected = sum(torch.arange(numel, dtype=torch.float64).to(dtype) + r for r in range(world))
            assert torch.equal(px.allreduce(mine), expected), (dtype, numel)
            assert torch.equal(px.allreduce(mine, "max"), mine - rank + world - 1), (dtype, numel)
    for algorithm in ("auto", "tree", "halving_doubling", "ring"):  # how each slice crosses hosts
        mine = torch.arange(300_001, dtype=torch.float64) * (rank + 1)
        expected = torch.arange(300_001, dtype=torch.float64) * sum(range(1, world + 1))
        assert torch.equal(px.allreduce(mine, algorithm=algorithm), expected), algorithm
        assert torch.equal(px.allreduce(torch.tensor([rank + 1.0]), algorithm=algorithm), torch.tensor([10.0]))
    assert group.cross_link is not None and group.cross_link.alpha_s > 0, "auto did not measure the link"
    # allgather goes through shared memory too: every rank's bytes summed into their place (-0.0 and NaN kept)
    lengths = [3, 0, 70_001, 1]

    def rows_of(r, dtype):
        rows = (torch.arange(lengths[r] * 2, dtype=torch.float64).view(lengths[r], 2) - r).to(dtype)
        if dtype == torch.float32 and lengths[r]:
            rows[0] = torch.tensor([-0.0, float("nan")])
        return rows

    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        expected = torch.cat([rows_of(r, dtype) for r in range(world)]).view(torch.uint8)
        assert px.allgather(rows_of(rank, dtype)).view(torch.uint8).equal(expected), dtype
        assert px.allgather(rows_of(rank, dtype), lengths=lengths, check=False).view(torch.uint8).equal(expected)
    # reduce-scatter: each host's share of each local index's chunks, finished between hosts
    for dtype in (torch.float64, torch.int64):
        for numel in (4, 13, 1_500_003):  # uneven chunks; several rounds of a slot
            mine = (torch.arange(numel, dtype=torch.float64) * (rank + 1)).to(dtype)
            expected = torch.tensor_split((torch.arange(numel, dtype=torch.float64) * 10).to(dtype), world)[rank]
            assert torch.equal(px.reduce_scatter(mine), expected), (dtype, numel)
    print(f"rank {rank}: hierarchical allreduce ok", flush=True)
"""


def test_hierarchical_allreduce_across_two_hosts(tmp_path: Path, two_hosts: list[str]) -> None:
    """Two workers on each of two hosts (network namespaces): shared memory within, Gloo between."""
    from tests.cli.test_launcher import run_on_hosts

    script = write_script(tmp_path, "hier.py", HIERARCHICAL_SCRIPT)
    common = ["-n", "2", "--nnodes", "2", "--master-addr", "198.18.0.1", "--master-port", "29541"]
    codes, outputs = run_on_hosts(two_hosts, common, [str(script)], tmp_path, worker_env(), 120)
    assert codes == [0, 0], outputs
    printed = outputs[0][0] + outputs[1][0]
    assert all(f"rank {r}: hierarchical allreduce ok" in printed for r in range(4)), printed
