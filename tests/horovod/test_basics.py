"""The process-level API in one process: truthful build answers, refusals with clear errors,
Compression, the Horovod exception names and the timeline file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import phalanx as px
import phalanx.horovod.torch as hvd


@pytest.fixture
def horovod():
    hvd.init()
    yield hvd
    hvd.shutdown()


def test_before_init_every_query_says_to_call_init() -> None:
    for query in (hvd.size, hvd.rank, hvd.local_rank, hvd.cross_size, hvd.is_homogeneous):
        with pytest.raises(px.NotInitializedError, match=r"hvd\.init\(\)"):
            query()
    assert not hvd.is_initialized()


def test_a_world_of_one_answers_like_horovod(horovod) -> None:
    assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(), hvd.cross_size(), hvd.cross_rank()) == \
        (1, 0, 1, 0, 1, 0)
    assert hvd.is_initialized() and hvd.is_homogeneous()
    hvd.init()  # again: nothing happens
    assert (hvd.mpi_built(), hvd.mpi_enabled(), hvd.ddl_built(), hvd.ccl_built()) == (False,) * 4
    assert hvd.gloo_built() is dist.is_gloo_available() and hvd.gloo_enabled() is dist.is_gloo_available()
    assert hvd.nccl_built() is (dist.is_nccl_available() and torch.cuda.is_available())
    assert hvd.cuda_built() is (torch.version.cuda is not None)
    with pytest.raises(px.ConfigurationError, match="MPI is not enabled"):
        hvd.mpi_threads_supported()
    t = torch.arange(4.0)
    assert torch.equal(hvd.allreduce(t), t) and hvd.join() == 0
    assert torch.equal(hvd.alltoall(t), t) and hvd.alltoall(t, splits=[4])[1].tolist() == [4]


def test_refusals_name_the_fix(horovod) -> None:
    hvd.shutdown()
    with pytest.raises(px.ConfigurationError, match="process_sets"):
        hvd.init(comm=[0])
    hvd.init()
    with pytest.raises(px.ConfigurationError, match="HOROVOD_DYNAMIC_PROCESS_SETS"):
        hvd.add_process_set([0])
    with pytest.raises(px.ConfigurationError, match="list of ranks"):
        hvd.ProcessSet(object())
    with pytest.raises(px.ConfigurationError, match="Adasum"):
        hvd.allreduce(torch.ones(1), op=hvd.Adasum)
    with pytest.raises(px.ConfigurationError, match="reducescatter supports only"):
        hvd.reducescatter(torch.ones(2), op=hvd.Max)
    with pytest.raises(px.ConfigurationError, match="unknown handle"):
        hvd.poll(10**9)
    assert hvd.synchronize(10**9) is None  # Horovod returns None for an unknown handle


def test_compression_and_exception_names() -> None:
    compressed, context = hvd.Compression.fp16.compress(torch.tensor([1.5], dtype=torch.float64))
    assert compressed.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(compressed, context).dtype == torch.float64
    assert hvd.Compression.none.compress(torch.ones(1))[1] is None
    assert issubclass(hvd.HorovodMismatchError, hvd.HorovodInternalError)
    assert issubclass(hvd.HorovodMismatchError, px.CollectiveMismatchError)
    assert issubclass(hvd.HorovodTimeoutError, px.CollectiveTimeoutError)
    assert issubclass(hvd.HostsUpdatedInterrupt, px.elastic.MembershipChanged)


def test_the_timeline_is_a_chrome_trace(horovod, tmp_path: Path) -> None:
    trace = tmp_path / "timeline.json"
    hvd.start_timeline(str(trace), mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="weights")
    hvd.synchronize(hvd.allgather_async(torch.ones(2, 2)))
    hvd.stop_timeline()
    events = json.loads(trace.read_text())
    assert [e["name"] for e in events] == ["ALLREDUCE", "ALLGATHER"]
    assert events[0]["tid"] == "weights" and events[1]["tid"].startswith("allgather.noname.")
    assert events[0]["args"]["shapes"] == [[3]] and events[0]["ph"] == "X" and events[0]["dur"] >= 0
