"""Every way a script can end leaves the job cleanly, without the user calling ``px.shutdown()``.

torch 2.13 leaves the Gloo group to interpreter teardown, which aborts (SIGABRT, exit 134) in a
good share of two-worker runs; phalanx destroys the group at exit by itself. Each test runs real
``phalanx run`` jobs, so a regression shows up as a launcher exit code.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_launcher import phalanx_command, worker_env, write_script
from tests import warm

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the launcher uses POSIX process groups")

# Without the exit hook 40 % of two-worker runs aborted (DESIGN-NOTES): 6 runs miss a regression
# with probability 0.6**6 < 5 % (and the other tests here end jobs too); two run at a time, which
# crowds the exits onto the cores as well.
RUNS, AT_ONCE = 6, 2

SHORT = """\
    import torch
    import phalanx as px
    px.init()
    print(int(px.allreduce(torch.ones(4))[0]))
"""


def launch(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return warm.run(phalanx_command("--timeout", "60", *args), cwd=tmp_path, env=worker_env(),
                    capture_output=True, text=True, timeout=timeout)


def test_a_script_without_shutdown_exits_0_every_time(tmp_path: Path) -> None:
    script = write_script(tmp_path, "short.py", SHORT)
    failures = []
    for first in range(0, RUNS, AT_ONCE):
        jobs = [warm.Popen(phalanx_command("--timeout", "60", "-n", "2", str(script)), cwd=tmp_path,
                           env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(AT_ONCE)]
        for run, job in enumerate(jobs, first):
            out, err = job.communicate(timeout=60)
            if job.returncode != 0 or sorted(out.split()) != ["2", "2", "[0]", "[1]"]:
                failures.append(f"run {run}: exit {job.returncode}\n{err[-2000:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs failed:\n" + "\n".join(failures)


@pytest.mark.parametrize("ending", ["sys.exit(0)", "raise SystemExit", "pass"])
def test_sys_exit_and_a_plain_end_exit_0(tmp_path: Path, ending: str) -> None:
    script = write_script(tmp_path, "end.py", SHORT + f"    import sys\n    {ending}\n")
    done = launch(tmp_path, "-n", "2", str(script))
    assert done.returncode == 0, done.stderr


def test_an_exception_on_one_rank_with_a_pending_collective_fails_fast(tmp_path: Path) -> None:
    # Rank 1 raises while its own allreduce is still waiting for rank 0: tearing its group down
    # must not wait for that collective (it would until the timeout), and the launcher reports it.
    script = write_script(tmp_path, "fail.py", """\
        import time, torch
        import phalanx as px
        px.init()
        if px.rank() == 1:
            pending = px.allreduce(torch.ones(1000), async_op=True, check=False)
            raise RuntimeError("rank 1 gives up")
        time.sleep(50)
    """)
    started = time.monotonic()
    done = launch(tmp_path, "-n", "2", "--grace", "1", str(script))
    assert time.monotonic() - started < 30, "the failing rank waited for its pending collective"
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: rank 1 gives up" in done.stderr and "rank 1" in done.stderr
    assert "SIGABRT" not in done.stderr


def test_loader_prefetch_threads_alive_at_exit(tmp_path: Path) -> None:
    script = write_script(tmp_path, "loader.py", """\
        import torch
        import phalanx as px
        px.init()
        loader = px.data.DistributedLoader(torch.arange(1000.0), global_batch_size=10, prefetch=4)
        batches = iter(loader)
        for _ in range(3):
            px.allreduce(next(batches))
        # ends mid-epoch, its prefetch thread still filling the queue
    """)
    for _ in range(3):
        done = launch(tmp_path, "-n", "2", str(script))
        assert done.returncode == 0, done.stderr


def test_an_elastic_worker_without_shutdown_finishes_the_job(tmp_path: Path) -> None:
    script = write_script(tmp_path, "elastic.py", SHORT)
    for _ in range(3):
        done = launch(tmp_path, "-n", "2", "--min-workers", "1", str(script))
        assert done.returncode == 0, done.stderr
        assert sorted(done.stdout.split()) == ["2", "2", "[0]", "[1]"], done.stdout


def test_ctrl_c_stops_a_job_in_a_collective(tmp_path: Path) -> None:
    script = write_script(tmp_path, "wait.py", """\
        import os, sys, time, torch
        import phalanx as px
        px.init()
        open(os.path.join(sys.argv[1], f"{px.rank()}.ready"), "w").close()
        if px.rank() == 0:
            px.allreduce(torch.ones(4))  # waits for rank 1, which sleeps
        time.sleep(60)
    """)
    launcher = warm.Popen(phalanx_command("-n", "2", str(script), str(tmp_path)), cwd=tmp_path,
                          env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.ready"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, stderr
