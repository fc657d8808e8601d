"""A worker lost at any moment after ``px.init()`` is survived, bitwise.

Each case kills chosen workers at named moments (``PHALANX_FAULTS``, see ``phalanx.faults``) of an
elastic ``px.fit`` job in reproducible mode that also validates and writes checkpoints; the job must
exit 0 with the weights of an uninterrupted run, each recovery taking under 5 s from the death to
the next completed step. The randomized test kills a random worker after a random delay instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from phalanx import faults
from phalanx.errors import ConfigurationError
from tests.elastic import fit_job
from tests.elastic.launch import free_port, launched

# (faults, workers, min workers). Every moment, each with the worker most at risk there; to keep
# the suite short every job loses two of its 3 workers: one early and one later, or one and then
# another while the survivors re-form.
CASES = [
    ("init.group@1,train.end@2", 3, 1),          # inside px.init(); after the last commit
    ("init.done@2,step.end@1#5", 3, 1),
    ("fit.setup@1,step.forward@2", 3, 1),        # set-up; the first step
    ("state.sync@0,fit.resume@1", 3, 1),         # the broadcast's root; then the new rank 0, reading checkpoints
    ("loader.check@2,epoch.end@1#3", 3, 1),      # the last epoch's end
    ("validation@2,reform.request@1", 3, 1),
    ("checkpoint.write@0,reform.group@1", 3, 1),  # rank 0 writes
    ("step.reduce@2#12,reform.connect@1", 3, 1),  # buckets in flight in the second epoch
    ("epoch.end@2#2,state.sync@0#2", 3, 1),      # the sync after the re-form
]


@functools.lru_cache(maxsize=1)
def uninterrupted() -> str:
    return fit_job.train()


def run_job(tmp_path: Path, workers: int, min_workers: int, env: dict[str, str] | None = None,
            kill_after: float | None = None, job_args: tuple[str, ...] = ()) -> tuple[str, str]:
    """Run the job to its end; its digest and the launcher's output."""
    args = ["-n", str(workers), "--min-workers", str(min_workers), "--timeout", "40"]
    with launched(tmp_path, args, ["--checkpoints", str(tmp_path / "checkpoints"), *job_args],
                  job=Path(fit_job.__file__), env=env) as job:
        if kill_after is not None:
            _kill_one_after(job, workers, kill_after)
        started = time.monotonic()
        code = job.wait(timeout=150)
        elapsed = time.monotonic() - started
        print(f"exit {code} after {elapsed:.1f}s")
        assert code == 0, job.output()
        assert elapsed < 35, f"the job took {elapsed:.0f}s: a re-form waited for a timeout\n{job.output()}"
        recoveries = [float(s) for s in re.findall(r"first step done ([\d.]+)s after the event", job.stderr)]
        print(f"death to next completed step: {recoveries} s")
        assert all(seconds < 5.0 for seconds in recoveries), job.output()
        return job.result()["digest"], job.stderr


def _kill_one_after(job, workers: int, delay: float) -> None:
    victim = random.randrange(workers)
    pid = job.worker_pid(victim, timeout=60)  # written right after px.init()
    time.sleep(max(0.0, delay))
    with contextlib.suppress(ProcessLookupError):  # it may have finished already
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("spec,workers,min_workers", CASES, ids=[case[0] for case in CASES])
def test_a_worker_lost_at_this_moment_is_survived_bitwise(tmp_path: Path, spec: str, workers: int,
                                                          min_workers: int) -> None:
    digest, launcher = run_job(tmp_path, workers, min_workers, env={faults.ENV: spec})
    assert launcher.count("was lost: signal SIGKILL") == len(spec.split(",")), launcher
    assert digest == uninterrupted()


def test_the_cases_cover_every_moment() -> None:
    named = {entry.split("@")[0] for spec, _, _ in CASES for entry in spec.split(",")}
    assert named == set(faults.MOMENTS)


def test_a_worker_killed_at_a_random_time_is_survived_bitwise(tmp_path: Path) -> None:
    random.seed(f"{os.getpid()}-{time.time()}")  # another moment in every run of the suite
    digest, _ = run_job(tmp_path, 3, 2, kill_after=random.uniform(0.0, 2.5))
    assert digest == uninterrupted()


@functools.lru_cache(maxsize=None)
def uninterrupted_sharded(level: int) -> str:
    return fit_job.train(level=level)


# (faults, level, own copies): a death before the first epoch's checkpoint (the job resumes from the
# one written before its first step), one in the second epoch, and one during the re-form that follows.
SHARDED_CASES = [
    ("step.end@1#5", 1, False),
    ("step.reduce@2#14", 2, False),
    ("step.forward@1#13,reform.connect@2", 3, False),
    ("step.end@2#15", 3, True),                  # level 3 gathering its blocks, as between hosts
]


@pytest.mark.parametrize("spec,level,own_copies", SHARDED_CASES, ids=[f"{c[0]}-level{c[1]}" for c in SHARDED_CASES])
def test_a_sharded_job_resumes_from_its_last_checkpoint_at_the_new_worker_count_bitwise(
        tmp_path: Path, spec: str, level: int, own_copies: bool) -> None:
    """No worker holds a copy of another's shards (the next issue's): the survivors re-form, lay the
    units out for their number, read the last checkpoint on disk and say so; reproducible mode makes
    the result the uninterrupted run's, bit for bit."""
    job_args = ("--level", str(level), *(["--own-copies"] if own_copies else []))
    digest, launcher = run_job(tmp_path, 3, 1, env={faults.ENV: spec}, job_args=job_args)
    assert launcher.count("was lost: signal SIGKILL") == len(spec.split(",")), launcher
    assert re.search(rf"px.Sharded\(level={level}\) holds no copy of another worker's shards, so the new group of "
                     r"[12] resumed from \S+checkpoint-0+\d+\.pt \(global step \d+\)", launcher), launcher
    assert digest == uninterrupted_sharded(level)


def test_a_worker_that_joins_a_sharded_job_takes_its_shards_from_the_last_checkpoint(tmp_path: Path) -> None:
    """Two founders hold after global step 12 until a third worker, started then, asks to join: the
    three lay the units out for three, read the last checkpoint (epoch 0's) and finish bitwise."""
    common = ["--nnodes", "1:2", "--master-port", str(free_port()), "--timeout", "40"]
    job_args = ["--checkpoints", str(tmp_path / "checkpoints"), "--level", "2"]
    joining = tmp_path / "joining"
    with launched(tmp_path, ["-n", "2", *common], [*job_args, "--hold", f"12:{joining}"],
                  job=Path(fit_job.__file__)) as job:
        job.wait_for_step(12)
        with launched(tmp_path, ["-n", "1", "--node-rank", "1", *common], [*job_args, "--started-file", str(joining)],
                      job=Path(fit_job.__file__), name="node1") as joiner:
            assert job.wait(timeout=150) == 0, job.output()
            assert joiner.wait(timeout=60) == 0, joiner.output()
    assert "joined member(s)" in job.stderr, job.output()
    assert "px.Sharded(level=2) holds no copy of another worker's shards, so the new group of 3 resumed" \
        in job.stderr, job.output()
    assert job.result()["digest"] == uninterrupted_sharded(2)


def test_a_fault_spec_that_names_no_moment_is_refused() -> None:
    assert faults.parse("step.end@1#3,validation@2", member=1) == {"step.end": 3}
    with pytest.raises(ConfigurationError, match="step.ned"):
        faults.parse("step.ned@1", member=1)
