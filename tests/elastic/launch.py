"""Start ``phalanx run`` on the elastic test job and always clean up after it.

A :class:`Launch` runs one launcher in its own session with its output in files (no pipe can
fill up). Leaving the ``with`` block, or any failure inside it, kills the launcher's session and
every worker pid the job wrote, so nothing outlives a test.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

from phalanx.lifetime import die_with_parent  # the launcher dies with the test, its workers with it
from tests import warm

JOB = Path(__file__).with_name("job.py")
REPO = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without launch variables, with the repository importable."""
    launch_keys = ("PHALANX_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "GLOO_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launch_keys) or k == "PHALANX_SECRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Launch:
    """One ``phalanx run`` of the test job; ``wait()`` returns the exit code, ``stderr`` its summary."""

    def __init__(self, directory: Path, launcher_args: Sequence[str], job_args: Sequence[str] = (),
                 name: str = "node0", prefix: Sequence[str] = (), job: Path = JOB, env: dict[str, str] | None = None):
        self.directory = directory
        self.pids = directory / "pids"
        self.pids.mkdir(exist_ok=True)
        self.out = directory / f"{name}.pt"
        self.progress = directory / f"{name}.progress"
        self.log_out = directory / f"{name}.stdout"
        self.log_err = directory / f"{name}.stderr"
        command = [*prefix, sys.executable, "-m", "phalanx", "run", *launcher_args, str(job),
                   "--out", str(self.out), "--pids", str(self.pids), "--progress", str(self.progress), *job_args]
        with open(self.log_out, "wb") as out, open(self.log_err, "wb") as err:
            if prefix:  # another host's namespace: a fresh python there, which dies with the test
                self.process = subprocess.Popen(command, cwd=directory, env=clean_env(**(env or {})), stdout=out,
                                                stderr=err, start_new_session=True,
                                                preexec_fn=die_with_parent(os.getpid()))
            else:  # forked warm: its own session; it dies with the session's fork server, which dies with the test
                self.process = warm.Popen(command, cwd=directory, env=clean_env(**(env or {})), stdout=out, stderr=err,
                                          start_new_session=True)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    @property
    def stderr(self) -> str:
        return self.log_err.read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return self.log_out.read_text(errors="replace")

    def output(self) -> str:
        return f"---- stdout ----\n{self.stdout[-4000:]}\n---- stderr ----\n{self.stderr[-8000:]}"

    def result(self) -> dict:
        return torch.load(self.out, weights_only=True)

    def step(self) -> int:
        """The last step rank 0 committed (0 before the first)."""
        return self._progress(0)

    def size(self) -> int:
        """The number of workers at rank 0's last commit (0 before the first)."""
        return self._progress(2)

    def _progress(self, field: int) -> int:
        try:
            return int(self.progress.read_text().split()[field])
        except (OSError, ValueError, IndexError):
            return 0

    def wait_for_step(self, step: int, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while (current := self.step()) < step:
            if self.process.poll() is not None:
                raise AssertionError(f"the launcher exited ({self.process.returncode}) before step {step}\n"
                                     + self.output())
            if time.monotonic() > deadline:
                raise AssertionError(f"step {step} not reached within {timeout:.0f}s (at {current})\n" + self.output())
            time.sleep(0.01)
        return current

    def worker_pid(self, rank: int, timeout: float = 30.0) -> int:
        path = self.pids / f"{rank}.pid"
        deadline = time.monotonic() + timeout
        while not (path.exists() and path.read_text().strip()):
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {rank} wrote no pid\n" + self.output())
            time.sleep(0.05)
        return int(path.read_text())

    def dump_stacks(self) -> None:
        """Have every live worker write its threads' stacks beside its pid (fit_job.py's SIGUSR1
        handler; a job without one would die of the signal)."""
        for path in self.pids.glob("*.pid"):
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError, OSError):
                os.kill(int(path.read_text()), signal.SIGUSR1)

    def stacks(self) -> str:
        """The stacks the workers dumped, each headed by its file's name."""
        return "".join(f"---- {path.name} ----\n{path.read_text(errors='replace')}"
                       for path in sorted(self.pids.glob("stacks-*.txt")) if path.stat().st_size)

    def kill(self) -> None:
        """Kill the launcher's session and every worker of the job (workers also die with their launcher)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        for path in self.pids.glob("*.pid"):
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError, OSError):
                pid = int(path.read_text())
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def launched(*launches_args, **kwargs) -> Iterator[Launch]:
    """``with launched(tmp_path, [...]) as job:`` — killed on the way out, whatever happened."""
    job = Launch(*launches_args, **kwargs)
    try:
        yield job
    finally:
        job.kill()


@functools.lru_cache(maxsize=1)
def reference() -> dict[str, torch.Tensor]:
    """The uninterrupted single-process run of the job (computed once per test session)."""
    from tests.elastic import job

    return job.reference()


def assert_matches_reference(weights: dict[str, torch.Tensor]) -> float:
    expected = reference()
    assert set(weights) == set(expected)
    difference = max(float((weights[k] - expected[k]).abs().max()) for k in expected)
    assert difference < 1e-5, f"final weights differ from the uninterrupted run by {difference:.3g}"
    return difference
