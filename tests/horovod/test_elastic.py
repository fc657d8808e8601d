"""``hvd.elastic`` end to end: a Horovod elastic script under ``phalanx run -np 3 --min-workers 2``
loses a worker to SIGKILL and finishes on the other two, every sample of each epoch processed."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tests.elastic.launch import launched

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
    assert result["processed"] == [240, 240]  # the lost worker's share was dealt to the others
    assert max(result["sums"]) == min(result["sums"])  # the survivors hold the same weights
    assert result["loss"] < 0.5, result
    assert "the elastic job completed" in job.stderr
