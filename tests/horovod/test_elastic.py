"""``hvd.elastic`` end to end: a Horovod elastic script under ``phalanx run`` loses a worker to
SIGKILL and finishes on the other two, and admits a worker started later; every sample of each
epoch is processed once and the workers end with the same weights; after each reset Horovod's
negotiation and process sets are those of the new generation, the old ones closed."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tests.elastic.launch import free_port, launched

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="elastic jobs are tested on Linux"),
              pytest.mark.timeout(150)]
JOB = Path(__file__).with_name("elastic_job.py")


def test_a_killed_worker_leaves_the_others_training(tmp_path: Path) -> None:
    with launched(tmp_path, ["-np", "3", "--min-workers", "2", "--timeout", "30"], job=JOB) as job:
        pid = job.worker_pid(2)
        job.wait_for_step(8)
        os.kill(pid, signal.SIGKILL)
        assert job.wait(90) == 0, job.output()
    result = job.result()
    assert result["size"] == 2 and result["resets"] == [2], job.output()
    # Horovod's negotiation and process sets of the new generation are new, the old ones closed
    assert result["fresh"] == [{"negotiator": True, "sets": True, "pair": True}], result["fresh"]
    assert result["processed"] == [240, 240]  # the lost worker's share was dealt to the others
    assert max(result["sums"]) == min(result["sums"])  # the survivors hold the same weights
    assert result["loss"] < 0.5, result
    assert "the elastic job completed" in job.stderr


def test_a_worker_started_later_joins_and_receives_the_state(tmp_path: Path) -> None:
    common = ["--nnodes", "1:2", "--master-port", str(free_port()), "--timeout", "30"]
    hold = ["--hold-at", "10", "--hold-file", str(tmp_path / "joining"), "--step-sleep", "0.01"]
    with launched(tmp_path, ["-np", "2", *common], hold, job=JOB) as job:
        job.wait_for_step(1)
        with launched(tmp_path, ["-np", "1", "--node-rank", "1", *common], hold, name="node1", job=JOB) as joiner:
            assert job.wait(90) == 0, job.output()
            assert joiner.wait(90) == 0, joiner.output()
    result = job.result()
    assert result["size"] == 3 and result["resets"] == [3], job.output()
    assert result["fresh"] == [{"negotiator": True, "sets": True, "pair": True}], result["fresh"]
    assert result["processed"] == [240, 240]
    assert len(result["sums"]) == 3 and max(result["sums"]) == min(result["sums"])
