"""Horovod's negotiation, from its documentation: operations are matched by name across ranks, not
by call order; an error any rank can hit is raised on every rank, which all stay in step; leaving
is collective; a lost peer is an error, never a hang."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phalanx.comm import agreement
from phalanx.errors import CollectiveMismatchError
from tests.harness import run_workers


def _raised(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test reports what each rank saw
        return f"{type(error).__name__}: {error}"
    return "no error"


def _out_of_order() -> dict:
    """Ranks submit named operations in opposite orders; one rank submits while the other waits in
    a barrier; a second operation of a name in flight is refused on the rank that made it. An
    outsider rings the doorbell ahead (a raw store client, docs/security.md): empty cycles, the
    same results."""
    import phalanx as px
    import phalanx.horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        outsider = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False)
        for ring in range(100):
            outsider.set(f"{px.communicator().prefix}horovod/bell/{ring}", "forged")
    names = [f"t{k}" for k in range(4)]
    order = names if r % 2 == 0 else names[::-1]
    handles = {name: hvd.allreduce_async(torch.full((3,), float(k + 10 * r)), name=name, op=hvd.Sum)
               for k, name in ((names.index(name), name) for name in order)}
    sums = {name: hvd.synchronize(handle).tolist() for name, handle in handles.items()}
    out: dict = {"sums": sums, "kinds": {}}
    # Different kinds, submitted in opposite orders too, each named.
    work = [("gather", lambda: hvd.allgather_async(torch.tensor([r]), name="gather")),
            ("cast", lambda: hvd.broadcast_async(torch.tensor([r * 1.0]), root_rank=n - 1, name="cast"))]
    started = {name: submit() for name, submit in (work if r == 0 else work[::-1])}
    out["kinds"] = {name: hvd.synchronize(handle).tolist() for name, handle in started.items()}
    # Horovod's duplicate-name test: rank 0 submits while the others sit in a barrier, then they do.
    stranded = None
    if r == 0:
        stranded = hvd.allgather_async(torch.ones(2), name="duplicate")
        out["duplicate"] = _raised(lambda: hvd.allgather_async(torch.ones(2), name="duplicate"))
    hvd.barrier()
    if r != 0:
        stranded = hvd.allgather_async(torch.ones(2), name="duplicate")
        out["duplicate"] = _raised(lambda: hvd.allgather_async(torch.ones(2), name="duplicate"))
    hvd.barrier()
    out["stranded"] = hvd.synchronize(stranded).shape[0]
    out["after"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    # Records longer than a cycle's first slot (60 tensors' shapes and dtypes) travel whole.
    out["many"] = [t.item() for t in hvd.grouped_allreduce([torch.tensor([float(k)]) for k in range(60)], op=hvd.Sum)]
    hvd.shutdown()
    return out


def test_named_operations_are_matched_by_name_in_any_order() -> None:
    n = 2
    for r, out in enumerate(run_workers(_out_of_order, n)):
        for k in range(4):
            assert out["sums"][f"t{k}"] == [float(2 * k + 10)] * 3, (r, out["sums"])
        assert out["kinds"] == {"gather": [0, 1], "cast": [1.0]}
        assert out["duplicate"].startswith("ConfigurationError") and "'duplicate'" in out["duplicate"]
        assert out["stranded"] == 2 * n and out["after"] == n
        assert out["many"] == [float(n * k) for k in range(60)]


def _disagreements() -> dict:
    """Each disagreement raises on every rank with the same words; the next call works."""
    import phalanx.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    cases = {
        "dtype": lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32 if r == 0 else torch.float32)),
        "average_of_ints_vs_floats": lambda: hvd.reducescatter(torch.ones(4, dtype=torch.int64 if r else torch.float32)),
        "shape": lambda: hvd.allgather(torch.ones(2, 3 + r)),
        "root": lambda: hvd.broadcast(torch.ones(2), root_rank=r),
        "op": lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r else hvd.Max, name="op"),
        "kind": lambda: (hvd.allreduce if r else hvd.allgather)(torch.ones(2), name="same"),
    }
    out = {}
    for case, call in cases.items():
        out[case] = _raised(call)
        out[f"{case}_then"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    hvd.shutdown()
    return out


def test_a_disagreement_raises_on_every_rank_and_all_stay_in_step() -> None:
    first, second = run_workers(_disagreements, 2)
    for case in ("dtype", "average_of_ints_vs_floats", "shape", "root", "op", "kind"):
        for rank, out in enumerate((first, second)):
            assert out[case].startswith("HorovodMismatchError"), (case, out[case])
            assert f"on rank {rank}:" in out[case] and "Mismatched" in out[case], out[case]
            assert out[f"{case}_then"] == 2.0
        # the same explanation everywhere, only the raising rank differs
        assert first[case].split(":", 2)[2] == second[case].split(":", 2)[2], case
    # The collectives' check and words (comm/agreement.py): what differs, then every rank's call.
    assert "Mismatched dtype: rank 0: allreduce(torch.int32, shape=[2]); rank 1: allreduce(torch.float32, shape=[2])" \
        in first["dtype"]
    assert "rank 1: broadcast(torch.float32, shape=[2], root_rank=1)" in first["root"]
    assert "Mismatched op: rank 0: allreduce(torch.float32, shape=[2], op=max)" in first["op"]
    assert "Mismatched operation: rank 0: allgather(torch.float32, shape=[2]); rank 1: allreduce(" in first["kind"]
    # Rows may differ, not columns; the same words as phalanx's own allgather, on every rank.
    rows = {rank: agreement.record("allgather", torch.float32, [2, 3 + rank]) for rank in (0, 1)}
    with pytest.raises(CollectiveMismatchError) as collective:
        agreement.compare(rows, "allgather", 0, 2, ignore_first_dim=True)
    words = str(collective.value).split(": ", 1)[1].split(" Every rank")[0]
    assert words.startswith("Mismatched shape beyond dim 0: rank 0: allgather(torch.float32, shape=[2, 3])"), words
    for out in (first, second):
        assert words in out["shape"], (words, out["shape"])


def _shared_memory_and_folds() -> dict:
    """Negotiated operations over shared memory: no Gloo allreduce; each lone allreduce folds its data
    into the arrival that agrees on it (two rounds, an integer average in place); a disagreement is
    refused as a fold and named on every rank; a prescaled one runs after its cycle, and 16 in flight
    (two dtypes, two ops) travel together by dtype and op; one is in flight while the user's thread
    runs px.allreduce in another order on each rank."""
    import phalanx as px
    import phalanx.horovod.torch as hvd
    from phalanx.horovod.torch import negotiation

    through_gloo, folds, together = [], {"agreed": 0, "refused": 0}, []
    real_allreduce, real_fold, real_reduced = dist.all_reduce, negotiation.Negotiator._folded, \
        negotiation.Negotiator._reduced

    counting = threading.Lock()  # cycles run on the caller's thread and on the negotiation's

    def counted(self, *args):  # noqa: ANN001, ANN202 - stands in for the method
        exchanged = real_fold(self, *args)
        if exchanged is not None:
            with counting:
                folds["refused"] += 1
        return exchanged

    def reduced(self, group, agreement=None):  # noqa: ANN001, ANN202 - stands in for the method
        if agreement is None:  # agreed in a cycle, then reduced together (not a fold)
            with counting:
                together.append(len(group))
            return real_reduced(self, group, agreement)
        record, judge = agreement

        def judged(rows):  # noqa: ANN001, ANN202 - a fold agreed by every rank, counted before its future completes
            agreed = judge(rows)
            with counting:
                folds["agreed"] += 1
            return agreed

        return real_reduced(self, group, (record, judged))

    dist.all_reduce = lambda *args, **kwargs: (through_gloo.append(1), real_allreduce(*args, **kwargs))[1]
    negotiation.Negotiator._folded, negotiation.Negotiator._reduced = counted, reduced
    hvd.init()
    r = hvd.rank()
    out = {"lone": [hvd.allreduce(torch.tensor([1.0, r]), op=hvd.Sum).tolist(),
                    torch.equal(hvd.allreduce(torch.arange(262147, dtype=torch.float64) * (r + 1)),
                                torch.arange(262147, dtype=torch.float64) * 1.5),
                    hvd.allreduce_(torch.tensor([3, 4 + r]), op=hvd.Average).tolist()]}
    out["lone_folds"] = dict(folds)
    out["shape"] = _raised(lambda: hvd.allreduce(torch.ones(2 + r), name="shape"))
    out["prescaled"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, prescale_factor=2.0).tolist()
    together.clear()
    folded_before = folds["agreed"]
    handles = [hvd.allreduce_async(torch.full((3,), k + r, dtype=torch.int64 if k % 2 else torch.float32), name=f"f{k}",
                                   op=hvd.Average if k % 3 else hvd.Sum) for k in range(16)]
    out["in_flight"] = [hvd.synchronize(handle)[0].item() for handle in handles]
    out["together"], out["folded_in_flight"] = together[:], folds["agreed"] - folded_before
    beside = hvd.allreduce_async(torch.ones(2), name="beside", op=hvd.Sum) if r == 0 else None
    out["px"] = px.allreduce(torch.tensor([float(r)])).item()
    beside = beside if r == 0 else hvd.allreduce_async(torch.ones(2), name="beside", op=hvd.Sum)
    out["beside"] = hvd.synchronize(beside).tolist()
    out["folds"], out["gloo"] = folds, len(through_gloo)
    hvd.shutdown()
    return out


@pytest.mark.parametrize("threshold", ["", "0"])
def test_a_lone_allreduce_folds_into_its_agreement_and_everything_goes_through_shared_memory(threshold: str) -> None:
    """... and allreduces agreed in one cycle travel together, unless HOROVOD_FUSION_THRESHOLD=0."""
    first, second = run_workers(_shared_memory_and_folds, 2, env={"HOROVOD_FUSION_THRESHOLD": threshold})
    for rank, out in enumerate((first, second)):
        # each of the 16 travelled with others agreed in its cycle, or folded where it was alone in one
        assert sum(out["together"]) + out["folded_in_flight"] == 16, (out["together"], out["folded_in_flight"])
        assert threshold == "" or set(out["together"]) <= {1}, out["together"]
        assert out["lone"] == [[2.0, 1.0], True, [3, 4]], out["lone"]
        assert out["lone_folds"]["agreed"] == 3, out["lone_folds"]  # each folded (maybe after a refusal: see _foldable)
        assert out["shape"].startswith(f"HorovodMismatchError: allreduce 'shape' on rank {rank}: Mismatched shape"), out
        assert out["folds"]["refused"] >= 1 and out["folds"]["agreed"] >= 3  # the mismatch was refused as a fold
        assert out["prescaled"] == [4.0, 4.0]
        assert out["in_flight"] == [(k if k % 2 else k + 0.5) if k % 3 else 2 * k + 1 for k in range(16)], out
        assert out["in_flight"][1:3] == [1, 2.5] and isinstance(out["in_flight"][1], int)  # integers truncated
        assert (out["px"], out["beside"], out["gloo"]) == (1.0, [2.0, 2.0], 0), out
    assert first["shape"].split(":", 2)[2] == second["shape"].split(":", 2)[2]  # the same words on both ranks


HIERARCHICAL_SCRIPT = """\
    import torch
    import phalanx.horovod.torch as hvd
    from phalanx.horovod.torch import negotiation
    hvd.init()
    channel = negotiation.current()._channel
    assert channel is not None and channel.cross is not None, "the negotiation's shared memory is not hierarchical"
    rank = hvd.rank()
    assert hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum).item() == 10.0
    handles = [hvd.allreduce_async(torch.full((3,), float(rank + k)), name=f"h{k}", op=hvd.Sum) for k in range(16)]
    assert [hvd.synchronize(handle)[0].item() for handle in handles] == [6.0 + 4 * k for k in range(16)]
    big = torch.arange(1_100_001, dtype=torch.float64)
    assert torch.equal(hvd.allreduce(big * (rank + 1), op=hvd.Sum), big * 10)
    assert channel.cross_link is not None, "the slices did not cross hosts by the measured algorithm"
    try:
        hvd.allreduce(torch.ones(2 + (rank == 3)), name="shape")
    except hvd.HorovodMismatchError as error:
        assert f"on rank {rank}: Mismatched shape" in str(error), error
    print(f"rank {rank}: negotiated across hosts ok", flush=True)
"""


def test_across_hosts_cycles_go_over_gloo_and_data_through_the_negotiations_own_shared_memory(
        tmp_path: Path, two_hosts: list[str]) -> None:
    """Two workers on each of two hosts (network namespaces): the negotiation's own hierarchical group
    carries the agreed allreduces (its slices cross hosts by the measured algorithm); cycles still agree
    and name a mismatch on every rank."""
    from tests.cli.test_launcher import run_on_hosts, worker_env, write_script

    script = write_script(tmp_path, "negotiated.py", HIERARCHICAL_SCRIPT)
    common = ["-n", "2", "--nnodes", "2", "--master-addr", "198.18.0.1", "--master-port", "29547"]
    codes, outputs = run_on_hosts(two_hosts, common, [str(script)], tmp_path, worker_env(), 120)
    assert codes == [0, 0], outputs
    printed = outputs[0][0] + outputs[1][0]
    assert all(f"rank {r}: negotiated across hosts ok" in printed for r in range(4)), printed


class _NoPickle:
    """Stands in for pickle in the codec: the negotiation must neither pickle nor unpickle a record."""

    @staticmethod
    def loads(*_: object) -> None:
        raise AssertionError("the negotiation used pickle")

    dumps = loads


def _negotiated_without_pickle() -> dict:
    """Records go through the codec's safe way (JSON for plain data): with pickle gone, every kind of
    operation, a large cycle (past the 1 KiB slot) and a disagreement still work."""
    import phalanx.horovod.torch as hvd
    from phalanx.comm import codec

    hvd.init()
    r = hvd.rank()
    real, codec.pickle = codec.pickle, _NoPickle
    try:
        out = {"sum": hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item(),
               "gathered": hvd.allgather(torch.full((r + 1,), r)).tolist(),
               "root": hvd.broadcast(torch.tensor([r]), root_rank=1).item(),
               "grouped": [t.item() for t in hvd.grouped_allreduce([torch.ones(1), torch.ones(1)], op=hvd.Sum)],
               "shape": _raised(lambda: hvd.allreduce(torch.ones(2 + r), name="shape"))}
        handles = [hvd.allreduce_async(torch.ones(1), name=f"a long name to fill the slot {k}", op=hvd.Sum)
                   for k in range(40)]
        out["many"] = sum(hvd.synchronize(handle).item() for handle in handles)
        hvd.barrier()
    finally:
        codec.pickle = real
    hvd.shutdown()
    return out


def test_the_negotiation_never_pickles() -> None:
    for rank, out in enumerate(run_workers(_negotiated_without_pickle, 2)):
        assert (out["sum"], out["gathered"], out["root"], out["grouped"], out["many"]) == (2.0, [0, 1, 1], 1, [2.0, 2.0], 80.0)
        assert out["shape"].startswith(f"HorovodMismatchError: allreduce 'shape' on rank {rank}: Mismatched shape:"), out


def _sets_and_leaving() -> dict:
    """Ranks outside a set shut down early; the set's members go on; a shutdown and init give
    everyone a fresh, working negotiation."""
    import phalanx.horovod.torch as hvd

    hvd.init(process_sets="dynamic")
    r = hvd.rank()
    odd = hvd.add_process_set([1, 3])
    out = {}
    if odd.included():
        time.sleep(0.5)  # the others have shut down by now
        out["set_sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=odd).item()
        out["needs_rank_0"] = _raised(lambda: hvd.allreduce(torch.ones(1), name="all"))
    hvd.shutdown()
    hvd.init()
    out["fresh"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    hvd.shutdown()
    return out


def test_leaving_is_collective_and_a_new_init_starts_afresh() -> None:
    results = run_workers(_sets_and_leaving, 4, timeout=120)
    for r, out in enumerate(results):
        assert out["fresh"] == 4.0
        if r in (1, 3):
            assert out["set_sum"] == 4.0
            assert out["needs_rank_0"].startswith("HorovodMismatchError") and "[0, 2] have shut down" in \
                out["needs_rank_0"], out["needs_rank_0"]


def _join_with_other_kinds() -> dict:
    """While rank 0 is in join(), the others' allreduces get its zeros and their allgathers raise
    on *their* ranks; join() returns the rank that joined last, everywhere."""
    import phalanx.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    if r == 0:
        out["last"] = hvd.join()
    else:
        out["sum"] = hvd.allreduce(torch.tensor([2.0]), op=hvd.Sum, name="while_joined").item()
        out["gather"] = _raised(lambda: hvd.allgather(torch.ones(1)))
        out["last"] = hvd.join()
    out["after"] = hvd.allgather(torch.tensor([r])).tolist()
    hvd.shutdown()
    return out


def test_a_joined_rank_adds_zeros_and_refuses_the_rest_on_the_callers() -> None:
    results = run_workers(_join_with_other_kinds, 3)
    for r, out in enumerate(results):
        assert out["last"] in (1, 2) and out["last"] == results[0]["last"]
        assert out["after"] == [0, 1, 2]
        if r:
            assert out["sum"] == 4.0  # ranks 1 and 2, and rank 0's zeros
            assert out["gather"].startswith("HorovodMismatchError") and "[0] have joined" in out["gather"]


def _missing_rank() -> dict:
    """Rank 1 never submits the name rank 0 waits for: a timeout naming rank 1; then rank 1 dies
    while rank 0 waits for another: an error well before the timeout."""
    import phalanx.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    if r == 0:
        started = time.monotonic()
        out["never"] = _raised(lambda: hvd.allreduce(torch.ones(1), name="only_on_0"))
        out["never_s"] = time.monotonic() - started
    else:
        time.sleep(8.5)  # rank 0 waits out its timeout meanwhile
    hvd.barrier()
    if r == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    out["dead"] = _raised(lambda: hvd.allreduce(torch.ones(1), name="after_death"))
    out["dead_s"] = time.monotonic() - started
    return out


def test_a_missing_or_dead_rank_is_an_error_naming_it_not_a_hang() -> None:
    out, dead = run_workers(_missing_rank, 2, collective_timeout=8, timeout=90, expect_failure=True)
    assert dead == "died with exit code -9" and isinstance(out, dict), (out, dead)
    assert out["never"].startswith("HorovodTimeoutError") and "rank(s) [1] did not submit" in out["never"], out
    assert 7.5 < out["never_s"] < 15
    assert out["dead"].startswith("HorovodTimeoutError") and out["dead_s"] < 5, out


def _barrier_after_an_operation_only_rank_0_submitted() -> dict:
    """Issue 40: rank 0 runs allreduce 'only0' then a barrier; rank 1 only the barrier."""
    import phalanx.horovod.torch as hvd

    hvd.init()
    out = {}
    if hvd.rank() == 0:
        out["only0"] = _raised(lambda: hvd.allreduce(torch.ones(1), name="only0"))
    out["barrier"] = _raised(hvd.barrier)
    hvd.shutdown()
    return out


def test_an_operation_one_rank_gave_up_on_fails_alike_everywhere_and_no_barrier_passes() -> None:
    """The ranks agree on a timeout: rank 0's allreduce and rank 1's barrier, each waiting for the
    other rank, fail with the same report naming both; rank 0's barrier then meets no barrier of
    rank 1's (rank 1 shuts down) instead of passing alone."""
    first, second = run_workers(_barrier_after_an_operation_only_rank_0_submitted, 2, collective_timeout=3)
    assert first["only0"].startswith("HorovodTimeoutError: allreduce 'only0' on rank 0:"), first
    assert second["barrier"].startswith("HorovodTimeoutError: barrier 'barrier.noname.0' on rank 1:"), second
    assert first["only0"].split(": ", 2)[2] == second["barrier"].split(": ", 2)[2]  # the same report
    assert "allreduce 'only0' (submitted by rank(s) [0], rank(s) [1] did not submit it)" in first["only0"], first
    assert "barrier 'barrier.noname.0' (submitted by rank(s) [1], rank(s) [0] did not submit it)" in first["only0"]
    assert first["barrier"].startswith("HorovodMismatchError") and "[1] have shut down" in first["barrier"], first


def _world_of_one() -> list:
    import phalanx.horovod.torch as hvd

    hvd.init()
    handles = [hvd.allreduce_async(torch.ones(2), name=f"x{k}") for k in range(3)]
    return [hvd.synchronize(h).tolist() for h in handles] + [hvd.join()]


@pytest.mark.parametrize("n", [1])
def test_a_world_of_one_agrees_at_once(n: int) -> None:
    assert run_workers(_world_of_one, n)[0] == [[1.0, 1.0]] * 3 + [0]


def _each_rank_joins_first(only: str | None) -> list[dict]:
    """Each rank in turn joins first while the others run an allreduce, an allgather, a broadcast or
    a DistributedOptimizer step (their buckets do not go through the negotiation), then join; ``only``
    one of those kinds where given."""
    import phalanx.horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    model = torch.nn.Linear(3, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step() -> None:
        optimizer.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()

    step()  # every rank takes the first step (the engine agrees on its buckets there)
    kinds = {"allreduce": lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist(),
             "allgather": lambda: _raised(lambda: hvd.allgather(torch.ones(1))),
             "broadcast": lambda: _raised(lambda: hvd.broadcast(torch.ones(1), root_rank=r)),
             "step": step}
    if only is not None:
        kinds = {only: kinds[only]}
    seen = []
    for first in range(n):
        for kind, run in kinds.items():
            out = {"first": first, "kind": kind}
            if r != first:
                out["other"] = run()
            out["last"] = hvd.join()
            seen.append(out)
    hvd.shutdown()
    return seen


@pytest.mark.parametrize("n, only, cycle_ms", [(2, None, "0"), (3, None, "0"), (2, "step", "300")])
def test_join_returns_the_rank_that_joined_last_never_the_first(n: int, only: str | None, cycle_ms: str) -> None:
    """Horovod documents join()'s value as the rank that joined last, the same on every rank. With
    long cycles (HOROVOD_CYCLE_TIME), a rank that joins while the others step would otherwise reach
    the negotiation in the same cycle as the rank its join let finish its step."""
    results = run_workers(_each_rank_joins_first, n, only, env={"HOROVOD_CYCLE_TIME": cycle_ms}, timeout=60)
    for r, seen in enumerate(results):
        assert len(seen) == (1 if only else 4) * n
        for out, at_rank_0 in zip(seen, results[0]):
            assert out["last"] != out["first"] and out["last"] == at_rank_0["last"], (r, out)
            if out["kind"] == "allreduce" and r != out["first"]:
                assert out["other"] == [n - 1.0] * 2  # the joined rank added zeros
            if out["kind"] in ("allgather", "broadcast") and r != out["first"]:
                assert out["other"].startswith("HorovodMismatchError") and "have joined" in out["other"], out
