"""Horovod's environment variables: honoured with Horovod's meaning (in a real job), or refused by name
at ``hvd.init()`` before anything is joined; read once with the launch, nowhere else."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import phalanx
import phalanx as px
import phalanx.horovod.torch as hvd
from phalanx.comm import runtime
from phalanx.comm.environment import detect
from phalanx.horovod.torch import variables
from tests.harness import run_workers
from tests.horovod.test_collectives import _raised


def test_unset_variables_give_phalanx_its_defaults() -> None:
    settings = variables.read({})
    assert settings == variables.Settings() and settings.transport == "auto"
    assert settings.stall_warning_s == 60.0 and settings.stall_shutdown_s is None  # Horovod's stall check
    assert variables.read({"HOROVOD_HIERARCHICAL_ALLREDUCE": "", "HOROVOD_CACHE_CAPACITY": " "}) == settings  # unset


def test_honoured_variables_are_read_with_horovods_units() -> None:
    settings = variables.read({"HOROVOD_FUSION_THRESHOLD": "33554432", "HOROVOD_CYCLE_TIME": "3.5",
                               "HOROVOD_TIMELINE": "/tmp/t.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1",
                               "HOROVOD_STALL_CHECK_TIME_SECONDS": "30", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90",
                               "HOROVOD_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
                               "HOROVOD_LOG_LEVEL": "TRACE", "HOROVOD_LOG_HIDE_TIME": "1",
                               "HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_CONTROLLER": "GLOO", "HOROVOD_RANK": "3",
                               "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_WITH_PYTORCH": "1"})
    assert settings.fusion_threshold_mb == 32.0 and settings.cycle_time_s == 0.0035
    assert settings.timeline == "/tmp/t.json" and settings.timeline_mark_cycles
    assert (settings.stall_warning_s, settings.stall_shutdown_s) == (30.0, 90.0)
    assert settings.transport == "gloo" and settings.dynamic_process_sets
    assert settings.log_level == logging.DEBUG and settings.log_hide_time and settings.unknown == ()
    assert variables.read({"HOROVOD_STALL_CHECK_DISABLE": "1"}).stall_warning_s is None
    assert variables.read({"HOROVOD_TIMELINE": "DYNAMIC"}).timeline is None  # started later by start_timeline
    assert variables.read({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}).transport == "shm"
    assert variables.read({"HOROVOD_FUSION_THRESHOLD": "0"}).fusion_threshold_mb == 0.0  # one tensor a bucket
    assert variables.read({"HOROVOD_FUSON_THRESHOLD": "1"}).unknown == ("HOROVOD_FUSON_THRESHOLD",)


def test_every_variable_that_cannot_be_honoured_is_named_in_one_error_with_what_to_do() -> None:
    refused = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_CACHE_CAPACITY": "1024", "HOROVOD_HIERARCHICAL_ALLGATHER": "1",
               "HOROVOD_GLOO_TIMEOUT_SECONDS": "30", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
               "HOROVOD_CPU_OPERATIONS": "mpi", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0",
               "HOROVOD_FUSION_THRESHOLD": "64MB", "HOROVOD_CYCLE_TIME": "-1", "HOROVOD_LOG_LEVEL": "loud",
               "HOROVOD_NUM_NCCL_STREAMS": "2", "HOROVOD_TIMELINE_MARK_CYCLES": "maybe"}
    with pytest.raises(px.ConfigurationError) as raised:
        variables.read({**refused, "HOROVOD_TIMELINE": "t.json"})
    message = str(raised.value)
    for name, value in refused.items():
        assert f"{name}={value!r}" in message, name
    assert "HOROVOD_TIMELINE=" not in message  # honoured, so not named
    for fix in ("does not autotune", "no response cache", "allgather is flat", "PHALANX_TIMEOUT",
                "phalanx run -np N", "set it to gloo", "whole number of bytes", "non-negative number of milliseconds",
                "trace, debug", "torch.distributed's own stream", "expected 1 or 0", "docs/horovod.md"):
        assert fix in message, fix


def test_init_refuses_before_joining_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    with pytest.raises(px.ConfigurationError, match="HOROVOD_AUTOTUNE='1': phalanx does not autotune"):
        hvd.init()
    assert not hvd.is_initialized() and not runtime.is_initialized()


def test_only_the_launch_environment_reads_horovods_variables() -> None:
    """Read once with the launch (LaunchInfo.horovod_variables), never from os.environ elsewhere."""
    package = Path(phalanx.__file__).parent
    for path in package.rglob("*.py"):
        text = path.read_text()
        if path.parts[-2:] != ("comm", "environment.py") and "cli" not in path.parts:
            assert not re.search(r"(environ(\.get\(|\[)|getenv\()[^\n]*HOROVOD", text), path
        if "horovod" in path.parts:
            assert not re.search(r"\bos\.environ\b|getenv\(", text), path
    info = detect({"HOROVOD_CYCLE_TIME": "5", "OTHER": "1"})
    assert info.horovod_variables == (("HOROVOD_CYCLE_TIME", "5"),)


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _honoured(trace: str) -> dict:
    """Under HOROVOD_* variables: buckets, cycle time, the stall check's warning and shutdown, the
    timeline, shared memory, dynamic sets and logging, as Horovod means them."""
    hvd.init()
    r, out = hvd.rank(), {}
    kept = _Kept()
    logging.getLogger("phalanx").addHandler(kept)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)).backward()
    optimizer.step()
    out["buckets"] = len(optimizer._reducer.bucket_sizes)  # HOROVOD_FUSION_THRESHOLD=0: one per gradient
    started = time.monotonic()
    for _ in range(4):
        hvd.allreduce(torch.ones(1))
    out["four_allreduces_s"] = time.monotonic() - started  # one cycle each, at least 0.1 s apart
    if r == 1:
        time.sleep(1.0)  # rank 0 waits for 'late' past the stall check's 0.5 s
    hvd.allreduce(torch.ones(1), name="late")
    out["warned"] = [m for m in kept.messages if "'late'" in m]
    if r == 0:
        started = time.monotonic()
        out["never"] = _raised(lambda: hvd.allreduce(torch.ones(1), name="never"))  # fails at the stall shutdown
        out["never_s"] = time.monotonic() - started
    else:
        time.sleep(2.5)  # submits nothing meanwhile, so the stall fails only 'never'
    out["shared_memory"] = px.communicator().shared_memory is not None
    out["dynamic_set"] = hvd.add_process_set([0]).ranks
    out["log_level"] = logging.getLogger("phalanx").level
    handler = next(h for h in logging.getLogger("phalanx").handlers if h.name == variables.LOG_HANDLER)
    out["log_line"] = handler.format(logging.LogRecord("phalanx.x", logging.INFO, "", 0, "hello", None, None))
    hvd.shutdown()  # finishes the timeline HOROVOD_TIMELINE started
    return out


def test_honoured_variables_change_what_horovod_does(tmp_path: Path) -> None:
    trace = tmp_path / "timeline.json"
    env = {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "100", "HOROVOD_TIMELINE": str(trace),
           "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "0.5",
           "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "1.5", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
           "HOROVOD_DYNAMIC_PROCESS_SETS": "1", "HOROVOD_LOG_LEVEL": "info", "HOROVOD_LOG_HIDE_TIME": "1"}
    results = run_workers(_honoured, 2, str(trace), env=env, timeout=60)
    for r, out in enumerate(results):
        assert out["buckets"] == 4 and out["four_allreduces_s"] >= 0.3, out
        assert out["shared_memory"] and out["dynamic_set"] == [0] and out["log_level"] == logging.INFO
        assert out["log_line"] == f"[INFO phalanx.x] [{r}]: hello"
    first = results[0]
    assert len(first["warned"]) == 1 and "rank(s) [1] have not submitted it" in first["warned"][0], first
    assert first["never"].startswith("HorovodTimeoutError") and "[1] did not submit" in first["never"], first
    assert 1.4 < first["never_s"] < 4, first
    events = json.loads(trace.read_text())
    names = [event["name"] for event in events]
    assert "ALLREDUCE" in names and "CYCLE_START" in names
    assert any(event.get("tid") == "late" for event in events)


def _flat_after_shared_memory() -> dict:
    """HOROVOD_HIERARCHICAL_ALLREDUCE=0 where px.init() already chose shared memory: refused; left to
    hvd.init(), the job is joined over Gloo's sockets."""
    out = {"refused": _raised(hvd.init)}
    px.shutdown()
    hvd.init()
    out["shared_memory"] = px.communicator().shared_memory is not None
    out["sum"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()
    return out


def test_a_flat_allreduce_is_honoured_or_refused_by_name() -> None:
    for out in run_workers(_flat_after_shared_memory, 2, env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, timeout=60):
        assert out["refused"].startswith("ConfigurationError: HOROVOD_HIERARCHICAL_ALLREDUCE=0"), out
        assert "px.init(transport='gloo')" in out["refused"]
        assert out["shared_memory"] is False and out["sum"] == 2.0
