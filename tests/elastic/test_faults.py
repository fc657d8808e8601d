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
import subprocess
import time
from pathlib import Path

import pytest

from phalanx import faults
from phalanx.errors import ConfigurationError
from tests.elastic import fit_job, transfer_job
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
#: A job longer than this waited for a timeout somewhere (a lost worker's re-form takes a few
#: seconds): its workers dump their stacks into the failure's message.
OVERRUN = 35


@functools.lru_cache(maxsize=1)
def uninterrupted() -> str:
    return fit_job.train()


def run_job(tmp_path: Path, workers: int, min_workers: int, env: dict[str, str] | None = None,
            kill_after: float | None = None, job_args: tuple[str, ...] = (), checkpoints: bool = True) -> tuple[str, str]:
    """Run the job to its end (writing checkpoints unless told not to); its digest and the launcher's output."""
    args = ["-n", str(workers), "--min-workers", str(min_workers), "--timeout", "40"]
    with launched(tmp_path, args, [*(["--checkpoints", str(tmp_path / "checkpoints")] if checkpoints else []), *job_args],
                  job=Path(fit_job.__file__), env=env) as job:
        if kill_after is not None:
            _kill_one_after(job, workers, kill_after)
        started = time.monotonic()
        try:
            code = job.wait(timeout=OVERRUN)
        except subprocess.TimeoutExpired:  # past the bound below: where is each worker waiting?
            job.dump_stacks()
            try:
                code = job.wait(timeout=150 - OVERRUN)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the job did not end within 150s\n{job.output()}\n{job.stacks()}")
        elapsed = time.monotonic() - started
        print(f"exit {code} after {elapsed:.1f}s")
        assert code == 0, job.output()
        assert elapsed < OVERRUN, (f"the job took {elapsed:.0f}s: a re-form waited for a timeout\n{job.output()}\n"
                                   f"the workers' stacks at {OVERRUN}s:\n{job.stacks()}")
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
    named = {entry.split("@")[0] for spec, _, _ in CASES + SHARDED_CASES for entry in spec.split(",")}
    assert named == set(faults.MOMENTS)


def test_a_worker_killed_at_a_random_time_is_survived_bitwise(tmp_path: Path) -> None:
    random.seed(f"{os.getpid()}-{time.time()}")  # another moment in every run of the suite
    digest, _ = run_job(tmp_path, 3, 2, kill_after=random.uniform(0.0, 2.5))
    assert digest == uninterrupted()


@functools.lru_cache(maxsize=None)
def uninterrupted_sharded(level: int) -> str:
    return fit_job.train(level=level)


# (faults, level, own copies of the units): every moment at every level across the cases, in jobs of 4
# workers that lose 3 (one early, one mid-run, one while the survivors re-form or commit), with no
# checkpoint folder: every recovery rebuilds the lost shards from the copies in host memory.
SHARDED_CASES = [
    ("init.group@1,step.forward@2#7,commit.copies@3#12", 1, False),
    ("fit.setup@1,step.reduce@2#9,reform.connect@3", 1, False),
    ("step.end@1#4,epoch.end@2,reform.group@3", 1, True),
    ("init.done@2,step.end@1#13,reform.request@3", 1, False),
    ("init.done@2,step.end@1#13,commit.copies@3#4", 2, False),
    ("fit.setup@3,step.forward@1#15,reform.request@2", 2, True),
    ("state.sync@0#2,step.reduce@2#11,epoch.end@1#2", 2, False),
    ("init.group@2,reform.group@1,reform.connect@3", 2, False),
    ("init.group@3,step.reduce@1#6,reform.group@2", 3, False),
    ("fit.setup@2,epoch.end@1,commit.copies@3#9", 3, True),
    ("step.end@3#8,step.forward@1#18,reform.connect@2", 3, False),
    ("init.done@1,step.reduce@2#10,reform.request@3", 3, False),
]


@pytest.mark.parametrize("spec,level,own_copies", SHARDED_CASES, ids=[f"{c[0]}-level{c[1]}" for c in SHARDED_CASES])
def test_a_sharded_job_rebuilds_lost_shards_from_the_copies_in_memory_bitwise(
        tmp_path: Path, spec: str, level: int, own_copies: bool) -> None:
    """Each rank's chunks are copied into host memory at every commit: the survivors re-form, lay
    the units out for their number and rebuild every chunk from the copies, the dead workers' too,
    with no checkpoint on disk; reproducible mode makes the result the uninterrupted run's."""
    job_args = ("--level", str(level), *(["--own-copies"] if own_copies else []))
    digest, launcher = run_job(tmp_path, 4, 1, env={faults.ENV: spec}, job_args=job_args, checkpoints=False)
    assert launcher.count("was lost: signal SIGKILL") == len(spec.split(",")), launcher
    assert "resumed from" not in launcher, launcher
    assert digest == uninterrupted_sharded(level)


# (faults, level): jobs of 4 workers over Gloo's sockets (no shared memory: the buddies keep the copies,
# as between hosts) that lose 3, no pair of a worker and its buddy within one commit, with no checkpoint
# folder. Buddies pair ranks 0-1-2-3-0 on one host (each keeps the previous one's chunks). The rebuild
# is the host copies' (every moment at every level above); level 2 is the two-host test's below.
BUDDY_CASES = [
    ("step.end@1#4,step.reduce@2#9,commit.copies@3#12", 1),
    ("fit.setup@2,step.forward@1#7,commit.copies@3#9", 3),
]


@pytest.mark.parametrize("spec,level", BUDDY_CASES, ids=[f"{c[0]}-level{c[1]}" for c in BUDDY_CASES])
def test_without_shared_memory_buddies_keep_the_copies_and_a_sharded_job_survives_bitwise(
        tmp_path: Path, spec: str, level: int) -> None:
    """Without host shared memory (between hosts; here transport='gloo') each rank keeps its chunks and
    sends them to its buddy at every commit: the survivors rebuild every lost chunk from the holders,
    with no checkpoint on disk, to the uninterrupted run's bits."""
    job_args = ("--level", str(level), "--transport", "gloo")
    digest, launcher = run_job(tmp_path, 4, 1, env={faults.ENV: spec}, job_args=job_args, checkpoints=False)
    assert launcher.count("was lost: signal SIGKILL") == len(spec.split(",")), launcher
    assert "resumed from" not in launcher, launcher
    assert digest == uninterrupted_sharded(level)


def test_a_worker_and_its_buddy_lost_together_resume_from_the_last_checkpoint_and_say_so(tmp_path: Path) -> None:
    """Ranks 1 and 2 (2 keeps 1's chunks) die at the same step: nobody holds rank 1's chunks, so the
    survivors say so and resume from the last checkpoint on disk, still to the uninterrupted run's bits."""
    job_args = ("--level", "2", "--transport", "gloo")
    digest, launcher = run_job(tmp_path, 4, 1, env={faults.ENV: "step.end@1#6,step.end@2#6"}, job_args=job_args)
    assert launcher.count("was lost: signal SIGKILL") == 2, launcher
    assert re.search(r"px.Sharded\(level=2\) lost the copies of commit \d+ with the workers that held them \(a worker "
                     r"and its buddy, which kept its chunks, died together\), so the new group of 2 resumed from "
                     r"\S+checkpoint-0+\d+\.pt", launcher), launcher
    assert digest == uninterrupted_sharded(2)


def test_a_worker_and_its_buddy_lost_together_without_a_checkpoint_stop_the_job_naming_what_was_lost(
        tmp_path: Path) -> None:
    """The same double death with no checkpoint folder: nothing holds rank 1's chunks, so the job
    ends (no silent wrong state, no hang), every survivor saying what was lost and what to do."""
    args = ["-n", "4", "--min-workers", "1", "--timeout", "40"]
    with launched(tmp_path, args, ["--level", "2", "--transport", "gloo"], job=Path(fit_job.__file__),
                  env={faults.ENV: "step.end@1#6,step.end@2#6"}) as job:
        code = job.wait(timeout=120)
        said = job.output()
    assert code != 0, said
    assert re.search(r"the re-formed group of 2 cannot go on: px.Sharded\(level=2\) lost the copies of commit \d+ with "
                     r"the workers that held them .* no checkpoint_dir to resume from", said), said


def test_a_sharded_job_that_loses_a_whole_host_rebuilds_its_shards_from_the_buddies_on_the_other(
        tmp_path: Path, two_hosts: list[str]) -> None:
    """Host 0's two workers found a level-2 job (copies in host memory) and hold at step 3 until host
    1's two join (copies move to buddies, each on the other host, at the first commit of four); two
    steps later host 1 goes whole, launcher and workers: the two survivors rebuild all four ranks'
    chunks from what they hold, with no checkpoint folder, and finish to the uninterrupted run's bits."""
    common = ["-n", "2", "--nnodes", "2", "--min-workers", "1", "--master-addr", "198.18.0.1", "--master-port",
              "29535", "--timeout", "10"]  # host 1's loss is declared after 5 s without its heartbeat
    started = tmp_path / "host1-started"
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for folder in hosts:
        folder.mkdir()
    with launched(hosts[0], [*common, "--node-rank", "0"], ["--level", "2", "--hold", f"3:{started}"],
                  job=Path(fit_job.__file__), prefix=["ip", "netns", "exec", two_hosts[0]]) as node0:
        node0.wait_for_step(1)
        with launched(hosts[1], [*common, "--node-rank", "1"], ["--level", "2", "--started-file", str(started)],
                      job=Path(fit_job.__file__), name="node1", prefix=["ip", "netns", "exec", two_hosts[1]]) as node1:
            deadline, together = time.monotonic() + 90, None
            while together is None or node0.step() < together + 2:  # two commits of four workers
                assert time.monotonic() < deadline and node0.process.poll() is None, node0.output() + node1.output()
                if together is None and node0.size() == 4:
                    together = node0.step()
                time.sleep(0.05)
            node1.kill()
        assert node0.wait(120) == 0, node0.output()
    said = node0.stderr
    assert "resumed from" not in said and "lost the copies" not in said, said
    assert node0.result()["digest"] == uninterrupted_sharded(2)


def test_a_sharded_job_whose_workers_initialized_differently_trains_rank_0s_model(tmp_path: Path) -> None:
    """Each worker seeds its model with its rank (no seed shared): the group's first formation gives
    every rank rank 0's weights, as px.DataParallel's first synchronisation does, before the units
    are laid out (level 3 with each worker its own copy: blocks gathered by hooks); then a death."""
    job_args = ("--level", "3", "--own-copies", "--seed-by-rank")
    digest, launcher = run_job(tmp_path, 3, 1, env={faults.ENV: "step.end@2#6"}, job_args=job_args, checkpoints=False)
    assert launcher.count("was lost: signal SIGKILL") == 1, launcher
    assert digest == uninterrupted_sharded(3)


def test_a_sharded_job_committing_every_few_steps_trains_the_steps_since_again_bitwise(tmp_path: Path) -> None:
    """px.Sharded's default commits (every 4 steps where copies are kept): rank 1 dies after step 6,
    two steps past the last commit; the survivors go back to it and train steps 5 and 6 again. The
    log gives the time to the first step after the death, then to the commit past the steps redone."""
    job_args = ("--level", "1", "--default-commits")
    digest, launcher = run_job(tmp_path, 3, 1, env={faults.ENV: "step.end@1#6"}, job_args=job_args, checkpoints=False)
    assert launcher.count("was lost: signal SIGKILL") == 1, launcher
    assert digest == uninterrupted_sharded(1)
    first_step = re.findall(r"first step done ([\d.]+)s after the event", launcher)
    caught_up = re.findall(r"back past its last commit before the change .* ([\d.]+)s after the event", launcher)
    assert len(first_step) == len(caught_up) == 1, launcher
    assert float(first_step[0]) < float(caught_up[0]), launcher


def test_the_sharded_cases_cover_every_moment_at_every_level() -> None:
    covered = {(entry.split("@")[0], level) for spec, level, _ in SHARDED_CASES for entry in spec.split(",")}
    moments = {"init.group", "init.done", "fit.setup", "step.forward", "step.reduce", "step.end", "epoch.end",
               "commit.copies", "reform.request", "reform.group", "reform.connect"}
    assert {(moment, level) for moment in moments for level in (1, 2, 3)} - covered == set()


def test_a_sharded_job_without_copies_resumes_from_its_last_checkpoint_at_the_new_worker_count_bitwise(
        tmp_path: Path) -> None:
    """copies=False: the survivors lay the units out for their number, read the last checkpoint on
    disk (the one written before the first step; then, after rank 0 died writing the first epoch's,
    that one still) and say so."""
    job_args = ("--level", "2", "--no-shard-copies")
    digest, launcher = run_job(tmp_path, 3, 1, env={faults.ENV: "step.end@1#5,checkpoint.write@0#2"}, job_args=job_args)
    assert launcher.count("was lost: signal SIGKILL") == 2, launcher
    assert re.search(r"px.Sharded\(level=2\) holds no copy of another worker's shards \(copies=False\), so the new "
                     r"group of [12] resumed from \S+checkpoint-0+\d+\.pt", launcher), launcher
    assert digest == uninterrupted_sharded(2)


def test_a_worker_that_joins_a_sharded_job_takes_its_shards_from_the_copies(tmp_path: Path) -> None:
    """Two founders hold after global step 12 until a third worker, started then, asks to join: the
    three lay the units out for three, take every chunk from the founders' copies (no checkpoint
    folder) and finish bitwise."""
    common = ["--nnodes", "1:2", "--master-port", str(free_port()), "--timeout", "40"]
    job_args = ["--level", "2"]
    joining = tmp_path / "joining"
    with launched(tmp_path, ["-n", "2", *common], [*job_args, "--hold", f"12:{joining}"],
                  job=Path(fit_job.__file__)) as job:
        job.wait_for_step(12)
        with launched(tmp_path, ["-n", "1", "--node-rank", "1", *common], [*job_args, "--started-file", str(joining)],
                      job=Path(fit_job.__file__), name="node1") as joiner:
            assert job.wait(timeout=150) == 0, job.output()
            assert joiner.wait(timeout=60) == 0, joiner.output()
    assert "joined member(s)" in job.stderr and "resumed from" not in job.stderr, job.output()
    assert job.result()["digest"] == uninterrupted_sharded(2)


def test_a_fault_spec_that_names_no_moment_is_refused() -> None:
    assert faults.parse("step.end@1#3,validation@2", member=1) == {"step.end": 3}
    with pytest.raises(ConfigurationError, match="step.ned"):
        faults.parse("step.ned@1", member=1)


def test_a_worker_lost_part_way_through_a_large_transfer_is_left_behind_at_once(tmp_path: Path) -> None:
    """Gloo leaves a send or receive cut part-way by a peer's death waiting until the timeout (60 s
    here): the survivors must leave the generation when the watchdog aborts it, not then."""
    args = ["-n", "3", "--min-workers", "2", "--timeout", "60"]
    with launched(tmp_path, args, ["--die-rank", "1"], job=Path(transfer_job.__file__)) as job:
        started = time.monotonic()
        try:
            code = job.wait(timeout=OVERRUN)
        except subprocess.TimeoutExpired:
            job.dump_stacks()
            code = job.wait(timeout=120)
            pytest.fail(f"the job took over {OVERRUN}s (exit {code}): a survivor waited for the timeout\n"
                        f"{job.output()}\n{job.stacks()}")
        elapsed = time.monotonic() - started
        assert code == 0, job.output()
        result = job.result()
    print(f"exit {code} after {elapsed:.1f}s")
    assert job.stderr.count("was lost: signal SIGKILL") == 1, job.output()
    assert (result["steps"], result["size"], len(result["recoveries"])) == (transfer_job.STEPS, 2, 1), result
