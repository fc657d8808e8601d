"""Run a function on N real worker processes over Gloo, with a hard timeout.

``run_workers(fn, n, *args)`` starts ``n`` processes, each of which joins a real job (the
harness hosts the rendezvous store, as ``phalanx run`` does), calls ``fn(*args)`` and returns its
result. The first failure or the timeout kills every child, and the test fails with each rank's
traceback and output. Results come back as a list indexed by rank.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import multiprocessing
import os
import pickle
import queue as queue_module
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

# Fork: children start in milliseconds with torch already imported. The parent forks before it
# starts any thread of its own (the rendezvous store is created afterwards), so no child can
# inherit a lock held by a thread that does not exist in it.
_CONTEXT = multiprocessing.get_context("fork")


class WorkersFailed(AssertionError):
    """One or more workers failed, or the run exceeded its timeout."""


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0,
                collective_timeout: float = 30.0, env: dict[str, str] | None = None,
                expect_failure: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` workers; return their results in rank order.

    With ``expect_failure=True`` an exception on a rank is returned (as its formatted traceback
    string) instead of failing the test, so tests can assert on the errors every rank saw; a rank
    that died without a result returns ``"died with exit code N"``.
    """
    logs = [tempfile.NamedTemporaryFile(prefix=f"phalanx-rank{r}-", suffix=".log", delete=False).name
            for r in range(world_size)]
    results: Any = _CONTEXT.Queue()
    ports: Any = _CONTEXT.Queue()
    worker_env = {"PHALANX_TIMEOUT": str(collective_timeout), **(env or {})}
    dump_after = max(timeout - 5.0, 1.0)  # a worker still running then writes every thread's stack to its log
    procs = [_CONTEXT.Process(target=_worker, args=(fn, args, rank, world_size, ports, worker_env,
                                                     results, logs[rank], dump_after), daemon=True)
             for rank in range(world_size)]
    for proc in procs:  # fork before any thread exists here: the store below runs one
        proc.start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    for _ in procs:
        ports.put(store.port)
    try:
        return _collect(procs, results, logs, timeout, expect_failure)
    finally:
        _kill(procs)
        for log in logs:
            os.unlink(log)


def _collect(procs: list, results: Any, logs: list[str], timeout: float, expect_failure: bool) -> list[Any]:
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[str, Any]] = {}
    while len(outcome) < len(procs):
        try:
            _record(results.get(timeout=0.2), outcome, logs, expect_failure)
        except queue_module.Empty:
            _check_alive(procs, results, outcome, logs, expect_failure)
        if time.monotonic() > deadline:
            raise WorkersFailed(_report(f"timed out after {timeout:.0f}s", outcome, logs))
    return [outcome[rank][1] for rank in range(len(procs))]


def _record(message: tuple[int, str, bytes], outcome: dict, logs: list[str], expect_failure: bool) -> None:
    """Keep one rank's result; an error fails the test at once unless failures are expected."""
    rank, status, payload = message
    outcome[rank] = (status, pickle.loads(payload))
    if status == "error" and not expect_failure:
        raise WorkersFailed(_report(f"rank {rank} raised", outcome, logs))


def _check_alive(procs: list, results: Any, outcome: dict, logs: list[str], expect_failure: bool) -> None:
    for rank, proc in enumerate(procs):
        if rank not in outcome and not proc.is_alive() and proc.exitcode is not None:
            time.sleep(0.5)  # its result may still be in the pipe: take whatever arrived meanwhile
            while True:
                try:
                    _record(results.get_nowait(), outcome, logs, expect_failure)
                except queue_module.Empty:
                    break
            if rank not in outcome and expect_failure:
                outcome[rank] = ("died", f"died with exit code {proc.exitcode}")
            elif rank not in outcome:
                raise WorkersFailed(_report(f"rank {rank} exited with code {proc.exitcode} and no result",
                                            outcome, logs))


def _report(reason: str, outcome: dict, logs: list[str]) -> str:
    parts = [f"workers failed: {reason}"]
    for rank, log in enumerate(logs):
        status, value = outcome.get(rank, ("no result", ""))
        with open(log, errors="replace") as handle:
            output = handle.read()[-6000:]
        parts.append(f"--- rank {rank}: {status}\n{value if status == 'error' else ''}\n{output}")
    return "\n".join(parts)


def _kill(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)


def _worker(fn: Callable[..., Any], args: tuple, rank: int, world_size: int, ports: Any,
            env: dict[str, str], results: Any, log: str, dump_after: float) -> None:
    # What the pytest process made before the fork (a test's store, a group with its threads) is never
    # collected here: its destructor would join threads that a forked child does not have.
    gc.freeze()
    _redirect_output(log)
    faulthandler.dump_traceback_later(dump_after)  # a hang shows where every thread waits
    port = ports.get(timeout=60)
    os.environ.update(env)
    os.environ.update({
        "PHALANX_RANK": str(rank), "PHALANX_WORLD_SIZE": str(world_size), "PHALANX_LOCAL_RANK": str(rank),
        "PHALANX_LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PHALANX_STORE_HOSTED": "1",
    })
    import torch

    import phalanx as px

    torch.set_num_threads(1)
    try:
        px.init()
        # Plain pickle copies tensors by value; torch's queue reducers would share memory
        # with a process that is about to exit.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        traceback.print_exc()
        results.put((rank, "error", pickle.dumps(traceback.format_exc())))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        px.shutdown()


def _redirect_output(log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
