"""The fork server: workers forked from a process that imported torch once, with nothing of that
process leaking into them, and the old way (a fresh python) wherever a fork cannot be used."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from phalanx.cli.config import LaunchConfig, WorkerSpec
from phalanx.cli.forkserver import ForkServer, _why_not_serving, startup_variables_differ
from phalanx.cli.workers import OutputRelay, Worker
from tests.cli.test_launcher import LAUNCH_TIMEOUT_S, phalanx_command, worker_env, write_script

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc are Linux's here")

WHAT_A_WORKER_SEES = """\
    import gc, json, os, random, sys, threading, time
    preloaded = "phalanx.train.loop" in sys.modules
    collected = len(gc.get_objects())
    import numpy as np
    import torch
    seen = {
        "own": open("/proc/self/cmdline").read().split("\\0"),
        "parent": open(f"/proc/{os.getppid()}/cmdline").read().split("\\0"),
        "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task")),
        "threads": len(os.listdir("/proc/self/task")),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "draws": [random.random(), float(np.random.rand()), torch.rand(1).item()],
        "cuda": torch.cuda.is_initialized(), "intra_op": torch.get_num_threads(),
        "preloaded": preloaded, "collected": collected,
        "rank": os.environ["RANK"], "cwd": os.getcwd(), "argv": sys.argv, "name": __name__,
    }
    print("SEEN " + json.dumps(seen), flush=True)
    threading.Thread(target=lambda: print("a thread joined before exit", flush=True)).start()
    open(f"printed-{os.environ['RANK']}", "w").close()
    if os.environ["RANK"] == "1":  # its exit(3) stops rank 0 (as torchrun's would): only once rank 0 printed
        deadline = time.monotonic() + 60
        while not os.path.exists("printed-0") and time.monotonic() < deadline:
            time.sleep(0.01)
    sys.exit(int(os.environ["RANK"]) * 3)
"""


def test_workers_are_forked_warm_and_inherit_nothing_of_the_server(tmp_path: Path) -> None:
    script = write_script(tmp_path, "sees.py", WHAT_A_WORKER_SEES)
    # started from a shell, as a user starts it (the other launcher tests fork theirs warm: tests/warm.py)
    done = subprocess.run(phalanx_command("-n", "2", str(script), "an-argument"), cwd=tmp_path, env=worker_env(),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    seen = {}
    for line in done.stdout.splitlines():
        if "SEEN " in line:
            report = json.loads(line.split("SEEN ", 1)[1])
            seen[report["rank"]] = report
    assert set(seen) == {"0", "1"}, done.stdout + done.stderr
    for rank, report in seen.items():
        # forked by a server that was itself forked from the launcher: no fresh python in between
        assert report["own"] == report["parent"] and report["parent"][2:4] == ["phalanx", "run"], report
        assert report["parent_threads"] == 1, report  # the server: single-threaded, as it checked
        assert report["intra_op"] == 1, report  # OMP_NUM_THREADS=1 was set before the launcher loaded torch
        assert report["preloaded"], report  # what a training script loads is loaded already
        # the server's ~300,000 objects are frozen: a worker's collections (and its exit) never walk them
        assert report["collected"] < 30_000, report
        assert report["threads"] == 1 and report["fds"] == [0, 1, 2, 3], report  # 3: listdir's own
        assert not report["cuda"] and report["cwd"] == str(tmp_path) and report["name"] == "__main__"
        assert report["argv"] == [str(script), "an-argument"]
    for first, second in zip(seen["0"]["draws"], seen["1"]["draws"]):
        assert first != second  # torch, random and numpy reseeded from the OS in each worker
    assert done.stdout.count("a thread joined before exit") == 2
    assert done.returncode == 3 and "rank 1" in done.stderr, done.stderr  # its sys.exit(3), as with python


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    """A started fork server with the environment a launch gives it, ready to serve; one for the
    module's tests, which only spawn from it (starting one imports torch: 5-7 s of a busy suite)."""
    server = ForkServer(WorkerSpec.shared_environment(worker_env()))
    server.start()
    try:
        assert server.serves(server.environment)
        yield server
    finally:
        server.close()


def test_a_worker_is_forked_with_torch_already_imported_in_well_under_a_second(tmp_path: Path,
                                                                               forks: ForkServer) -> None:
    """The script finds torch imported before its first line (a fresh python takes about 2.5 s of CPU
    to import it here); started to printing takes 0.02-0.05 s on a quiet machine, and the bound leaves
    room for a busy one (0.24 s seen beside the rest of the suite)."""
    script = write_script(tmp_path, "quick.py", "import sys, time\nprint(time.monotonic(), 'torch' in sys.modules)\n")
    started = time.monotonic()
    process = forks.spawn([str(script)], forks.environment, str(tmp_path))
    printed, imported = process.stdout.read().decode().split()
    assert process.wait(30) == 0 and process.exited_at is not None
    assert imported == "True"
    assert float(printed) - started < 1.0, float(printed) - started
    assert started < process.exited_at <= time.monotonic()  # recorded when the server reaped it


def test_a_process_that_imported_torch_before_starts_a_fresh_server(tmp_path: Path, forks: ForkServer) -> None:
    # this test's process imported torch under its own OpenMP settings: forking it would pass those on
    script = write_script(tmp_path, "parent.py", "import os\nprint(open(f'/proc/{os.getppid()}/cmdline').read())\n")
    process = forks.spawn([str(script)], forks.environment, str(tmp_path))
    assert process.wait(30) == 0
    assert "phalanx.cli.forkserver" in process.stdout.read().decode()


def test_a_killed_worker_is_reported_killed_at_the_time_it_died(tmp_path: Path, forks: ForkServer) -> None:
    script = write_script(tmp_path, "sleeps.py", "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    process = forks.spawn([str(script)], forks.environment, str(tmp_path))
    assert process.stdout.readline() == b"up\n"
    killed_at = time.monotonic()
    os.killpg(process.pid, signal.SIGKILL)  # its own session: the launcher stops a group
    assert process.wait(30) == -signal.SIGKILL
    assert process.exited_at is not None and process.exited_at - killed_at < 1.0


def test_start_up_settings_that_differ_make_a_worker_start_the_old_way(caplog: pytest.LogCaptureFixture) -> None:
    server = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert startup_variables_differ({**server, "RANK": "3", "PHALANX_FAULTS": "x"}, server) == []
    assert startup_variables_differ({**server, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "2"}, server) == \
        ["OMP_NUM_THREADS", "PYTHONHASHSEED"]
    forks = ForkServer(server)  # not started: as where fork() is missing, the caller is told no
    forks.refused = "this platform has no fork()"
    assert not forks.serves(server)
    started = ForkServer(WorkerSpec.shared_environment(worker_env()))
    started.start()
    try:
        with caplog.at_level(logging.INFO, logger="phalanx.cli.forkserver"):
            assert not started.serves({**started.environment, "PYTHONHASHSEED": "7"})
        assert "PYTHONHASHSEED differ from the fork server's" in caplog.text
    finally:
        started.close()


def test_the_server_refuses_to_fork_once_a_second_thread_runs() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        reason = _why_not_serving()
    finally:
        stop.set()
        thread.join()
    assert reason is not None and "threads" in reason


def test_a_worker_starts_the_old_way_where_the_server_does_not_serve(tmp_path: Path) -> None:
    script = write_script(tmp_path, "ok.py", "import os\nprint('parent', os.getppid())\n")
    spec = LaunchConfig(target=str(script)).worker_specs(master_port=1)[0]
    forks = ForkServer(WorkerSpec.shared_environment(worker_env()))
    forks.refused = "the fork server ended"  # as after a server that died
    out, exits = io.StringIO(), []
    worker = Worker(spec)
    worker.start(OutputRelay(out, io.StringIO()), exits.append, forks)
    assert worker.exited.wait(60) and worker.exit_code == 0
    worker.join_output(time.monotonic() + 10)
    assert isinstance(worker.process, subprocess.Popen)
    assert out.getvalue() == f"[0] parent {os.getpid()}\n"  # a python started by this process, as before
