"""Elastic jobs end to end: real launchers and workers, real failures, exact results.

Each job trains the MLP of ``job.py`` for 60 steps over a DistributedLoader and must end with
the weights of the uninterrupted single-process run (the global batch is re-split, not
changed). Every launch runs under a hard timeout and is killed, workers included, on the way out.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ip
from phalanx.lifetime import is_alive
from tests.elastic.launch import assert_matches_reference, free_port, launched

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="elastic jobs are tested on Linux"),
    pytest.mark.timeout(150),
]
JOB_TIMEOUT_S = 90
RECOVERY_TARGET_S = 5.0


def first_change(result: dict, generation: int = 1) -> dict:
    changes = [c for c in result["changes"] if c["generation"] == generation]
    assert changes, f"no generation {generation} was seen: {result['changes']}"
    return changes[0]


def test_a_killed_worker_leaves_the_others_training(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    chooser = random.Random(seed)
    victim, at_step = chooser.randrange(3), chooser.randrange(5, 50)
    print(f"seed {seed}: SIGKILL rank {victim} after step {at_step}")
    with launched(tmp_path, ["-n", "3", "--min-workers", "2", "--timeout", "30"]) as job:
        pid = job.worker_pid(victim)
        job.wait_for_step(at_step)
        time.sleep(chooser.uniform(0.0, 0.03))  # anywhere within the next step
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        assert job.wait(JOB_TIMEOUT_S) == 0, job.output()
    result = job.result()
    assert result["size"] == 2 and result["steps"] == 60
    assert first_change(result)["stale_refused"], "the lost generation's communicator was still usable"
    recovery = first_change(result)["time"] - killed_at
    print(f"recovery (SIGKILL to the next completed step): {recovery:.3f}s; library's own measure: "
          f"{result['recoveries'][0]['event_to_step_s']:.3f}s")
    assert recovery < RECOVERY_TARGET_S
    assert f"worker rank {victim} (pid {pid}) was lost: signal SIGKILL" in job.stderr
    assert "the elastic job completed" in job.stderr
    assert_matches_reference(result["weights"])


@pytest.mark.parametrize("level", [1, 3])
def test_a_sharded_loop_of_ones_own_survives_a_killed_worker(tmp_path: Path, level: int) -> None:
    """px.Sharded in the job's own loop, its State holding what the strategy commits (each rank's
    chunks): a re-formed group of 2 lays the units out again and ends at the uninterrupted weights."""
    with launched(tmp_path, ["-n", "3", "--min-workers", "2", "--timeout", "30"], ["--sharded", str(level)]) as job:
        pid = job.worker_pid(1)
        job.wait_for_step(20)
        os.kill(pid, signal.SIGKILL)
        assert job.wait(JOB_TIMEOUT_S) == 0, job.output()
    result = job.result()
    assert result["size"] == 2 and result["steps"] == 60
    assert_matches_reference(result["weights"])


def test_a_sharded_loop_without_copies_refuses_to_step_on_chunks_it_could_not_rebuild(tmp_path: Path) -> None:
    """copies=False keeps nothing a re-formed group could rebuild the chunks from, and a loop of one's
    own reads no checkpoint by itself: its next step refuses, naming what to do, instead of training
    on stale chunks."""
    with launched(tmp_path, ["-n", "3", "--min-workers", "2", "--timeout", "30"],
                  ["--sharded", "2", "--no-copies"]) as job:
        pid = job.worker_pid(1)
        job.wait_for_step(10)
        os.kill(pid, signal.SIGKILL)
        code = job.wait(JOB_TIMEOUT_S)
    assert code != 0, job.output()
    assert "copies=False), so after the re-form this rank's chunks are not the committed ones" in job.stderr, \
        job.output()


def test_a_worker_lost_while_the_others_wait_for_it_at_a_sharded_state_dict_is_left_behind_at_once(
        tmp_path: Path) -> None:
    """The sharded optimizer's state dict first waits, through the store, for every rank: a member lost
    before it arrives must end that wait with its generation, as any collective's, not after most of
    the timeout with an error that ends the job."""
    with launched(tmp_path, ["-n", "3", "--min-workers", "2", "--timeout", "30"],
                  ["--sharded", "2", "--state-dicts-from", "10"]) as job:
        started = time.monotonic()
        assert job.wait(JOB_TIMEOUT_S) == 0, job.output()
        elapsed = time.monotonic() - started
    assert job.stderr.count("was lost: signal SIGKILL") == 1, job.output()
    assert elapsed < 20, f"the job took {elapsed:.0f}s: the survivors waited out the arrival\n{job.output()}"
    result = job.result()
    assert result["size"] == 2 and result["steps"] == 60
    assert_matches_reference(result["weights"])


def test_central_storage_in_an_elastic_loop_of_ones_own_is_refused_as_in_px_fit(tmp_path: Path) -> None:
    """The optimizer state would live on one rank, which the job could lose: setup refuses, naming it."""
    with launched(tmp_path, ["-n", "2", "--min-workers", "1", "--timeout", "30"], ["--central-storage"]) as job:
        code = job.wait(JOB_TIMEOUT_S)
    assert code != 0, job.output()
    assert "px.CentralStorage" in job.stderr and "an elastic job" in job.stderr, job.output()


def test_other_threads_see_the_last_world_or_the_next_never_one_that_did_not_exist(tmp_path: Path) -> None:
    """A thread that reads px.rank(), px.size() and px.is_master() in a loop while a SIGKILL makes the
    survivors re-form: it sees 3 workers, then 2, one master at a time, never a world of one."""
    seed = random.randrange(1 << 30)
    chooser = random.Random(seed)
    victim, at_step = chooser.randrange(3), chooser.randrange(5, 50)
    print(f"seed {seed}: SIGKILL rank {victim} after step {at_step}")
    with launched(tmp_path, ["-n", "3", "--min-workers", "2", "--timeout", "30"],
                  ["--watch-world", "--step-sleep", "0.01"]) as job:
        pid = job.worker_pid(victim)
        job.wait_for_step(at_step)
        os.kill(pid, signal.SIGKILL)
        assert job.wait(JOB_TIMEOUT_S) == 0, job.output()
    assert job.result()["size"] == 2
    survivors = [path for path in (tmp_path / "pids").glob("worlds-*.json") if path.name != f"worlds-{pid}.json"]
    assert len(survivors) == 2, list((tmp_path / "pids").iterdir())
    for path in survivors:
        worlds = {tuple(world) for world in json.loads(path.read_text())}
        # each call answers one generation's value (two calls may straddle the swap, so a pair may mix them)
        assert {size for _, size, _ in worlds} == {3, 2}, f"{path.name}: {sorted(worlds)}"
        assert all(0 <= rank < 3 for rank, _, _ in worlds), f"{path.name}: {sorted(worlds)}"
        if any(master for _, _, master in worlds):
            assert any(rank == 0 for rank, _, _ in worlds), f"{path.name}: {sorted(worlds)}"


def test_a_worker_frozen_before_its_first_step_is_replaced_as_fast_and_reported_consistently(
        tmp_path: Path) -> None:
    """The survivors wait in their first sync for the frozen founder until it is declared dead: the
    report dates the failure when they noticed it (it dated it from before the wait), so 'after
    detection' is the re-forming alone and never exceeds 'after the event' (the declaration)."""
    timeout = 4.0
    with launched(tmp_path, ["-n", "3", "--min-workers", "2", "--timeout", f"{timeout:g}"],
                  ["--step-sleep", "0.02", "--freeze-rank", "1"]) as job:
        assert job.wait(JOB_TIMEOUT_S) == 0, job.output()
    assert "is declared dead: no heartbeat" in job.stderr, job.output()
    found = re.search(r"first step done ([\d.]+)s after the event, ([\d.]+)s after detection", job.stderr)
    assert found, job.output()
    after_event, after_detection = float(found[1]), float(found[2])
    assert after_detection <= after_event + 0.05 and after_event < timeout, job.output()
    assert job.result()["size"] == 2
    assert_matches_reference(job.result()["weights"])


def test_a_frozen_worker_is_declared_dead_and_killed(tmp_path: Path) -> None:
    timeout = 4.0  # the collective timeout; the heartbeat timeout defaults to half of it
    with launched(tmp_path, ["-n", "3", "--min-workers", "2", "--timeout", f"{timeout:g}"],
                  ["--step-sleep", "0.02"]) as job:
        pid = job.worker_pid(1)
        job.wait_for_step(20)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        assert job.wait(JOB_TIMEOUT_S) == 0, job.output()
    result = job.result()
    recovery = first_change(result)["time"] - stopped_at
    print(f"recovery (SIGSTOP to the next completed step): {recovery:.3f}s with --timeout {timeout:g}")
    assert recovery < timeout
    assert not is_alive(pid), "the frozen worker was left behind"
    assert "is declared dead: no heartbeat" in job.stderr and f"killed worker rank 1 (pid {pid})" in job.stderr
    assert result["size"] == 2
    assert_matches_reference(result["weights"])


def test_a_worker_started_later_joins_at_a_step_boundary(tmp_path: Path) -> None:
    port = str(free_port())
    common = ["--nnodes", "1:2", "--master-port", port, "--timeout", "30"]
    hold = ["--hold", f"20:{tmp_path / 'joining'}", "--step-sleep", "0.01"]  # the job waits there for the joiner
    with launched(tmp_path, ["-n", "2", *common], hold) as job:
        job.wait_for_step(20)  # started later indeed: while the job holds after step 20
        with launched(tmp_path, ["-n", "1", "--node-rank", "1", *common],
                      [*hold, "--started-file", str(tmp_path / "joining")], name="node1") as joiner:
            assert job.wait(JOB_TIMEOUT_S) == 0, job.output()
            assert joiner.wait(JOB_TIMEOUT_S) == 0, joiner.output()
    result = job.result()
    joined = first_change(result)
    assert joined["size"] == 3 and joined["joined"] and 20 < joined["step"] <= 23
    assert result["size"] == 3 and result["steps"] == 60
    assert "joined worker" in job.stderr
    assert "done: rank 2 of 3 after 60 steps" in joiner.stdout
    assert_matches_reference(result["weights"])


def test_too_few_workers_stop_the_job_with_an_error_and_a_checkpoint(tmp_path: Path) -> None:
    checkpoint = tmp_path / "last.pt"
    started = time.monotonic()
    with launched(tmp_path, ["-n", "2", "--min-workers", "2", "--timeout", "30"],
                  ["--checkpoint", str(checkpoint), "--step-sleep", "0.01"]) as job:
        pid = job.worker_pid(1)
        survivor = job.worker_pid(0)
        job.wait_for_step(10)
        os.kill(pid, signal.SIGKILL)
        assert job.wait(JOB_TIMEOUT_S) == 1, job.output()
    assert time.monotonic() - started < 60
    assert "error: the elastic job stopped: only 1 worker(s) left, fewer than --min-workers 2" in job.stderr
    assert "saved the last committed state" in job.stderr
    assert not is_alive(survivor)

    import torch

    from phalanx.elastic import State
    from tests.elastic import job as job_module

    model = job_module.build_model()
    state = State(model=model, optimizer=job_module.make_optimizer(model), step=0)
    saved = torch.load(checkpoint, weights_only=True)["state"]
    assert saved["values"]["step"] >= 10
    state.load(checkpoint)
    assert state.step == saved["values"]["step"]


# ---- two hosts: network namespaces joined by a veth pair (the `two_hosts` fixture, conftest.py) ----


def test_two_hosts_train_together(tmp_path: Path, two_hosts: list[str]) -> None:
    common = ["-n", "1", "--nnodes", "2", "--master-addr", "198.18.0.1", "--master-port", "29517",
              "--timeout", "60"]
    fast = ["--step-sleep", "0"]
    with launched(tmp_path, [*common, "--node-rank", "0"], fast,
                  prefix=["ip", "netns", "exec", two_hosts[0]]) as node0, \
            launched(tmp_path, [*common, "--node-rank", "1"], fast, name="node1",
                     prefix=["ip", "netns", "exec", two_hosts[1]]) as node1:
        node0.wait_for_step(1)
        listening = subprocess.run(["ip", "netns", "exec", two_hosts[0], "ss", "-ltnH"], capture_output=True,
                                   text=True, timeout=10).stdout
        assert node0.wait(JOB_TIMEOUT_S) == 0, node0.output()
        assert node1.wait(JOB_TIMEOUT_S) == 0, node1.output()
    if listening:  # the store listens on node 0's address only
        assert "198.18.0.1:29517" in listening and "*:29517" not in listening and "0.0.0.0:29517" not in listening
    result = node0.result()
    assert result["size"] == 2 and result["steps"] == 60
    assert "done: rank 1 of 2 after 60 steps" in node1.stdout
    assert_matches_reference(result["weights"])


def test_a_host_cut_off_the_network_is_declared_dead(tmp_path: Path, two_hosts: list[str]) -> None:
    """Node 1 founds the job with node 0 or, started late, joins it at step 5 (the job holds for it); at
    step 20 both hold while the test cuts node 1's link, and node 0 goes on alone within the timeout."""
    common = ["-n", "1", "--nnodes", "1:2", "--master-addr", "198.18.0.1", "--master-port", "29518",
              "--timeout", "4"]  # a host silent for 2s (half the timeout) is declared dead
    started, cut = tmp_path / "node1-started", tmp_path / "cut"
    job_args = ["--step-sleep", "0.01", "--hold", f"5:{started}", "--hold", f"20:{cut}"]
    with launched(tmp_path, [*common, "--node-rank", "0"], job_args,
                  prefix=["ip", "netns", "exec", two_hosts[0]]) as node0, \
            launched(tmp_path, [*common, "--node-rank", "1"], [*job_args, "--started-file", str(started)],
                     name="node1", prefix=["ip", "netns", "exec", two_hosts[1]]):
        node0.wait_for_step(20)
        assert node0.size() == 2, f"node 1 is not training at step 20\n{node0.output()}"
        links = ip("-n", two_hosts[1], "-o", "link", "show", "type", "veth").stdout
        ip("-n", two_hosts[1], "link", "set", links.split(":")[1].strip().split("@")[0], "down")
        cut_at = time.time()
        cut.touch()
        assert node0.wait(JOB_TIMEOUT_S) == 0, node0.output()
    result = node0.result()
    losses = [change for change in result["changes"] if change["lost"]]
    assert losses, f"node 0 never saw node 1 lost: {result['changes']}"
    recovery = losses[0]["time"] - cut_at
    print(f"recovery (network cut to the next completed step): {recovery:.3f}s with --timeout 4")
    assert 0 < recovery < 4.0
    # member ids go to the launchers in the order they register, which the two hosts race for
    assert re.search(r"\(node 1, member \d+\) is declared dead: no heartbeat", node0.stderr), node0.stderr
    assert result["size"] == 1 and result["steps"] == 60
    assert_matches_reference(result["weights"])
