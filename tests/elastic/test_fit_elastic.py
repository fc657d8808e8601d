"""px.fit is elastic with no change to user code: a SIGKILLed worker costs nothing, bitwise."""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path

from tests.elastic import fit_job
from tests.elastic.launch import launched


def test_fit_survives_a_killed_worker_and_ends_bitwise_where_an_uninterrupted_run_does(tmp_path: Path) -> None:
    uninterrupted = fit_job.train()  # a world of one: reproducible mode makes it the reference
    with launched(tmp_path, ["-n", "3", "--min-workers", "2", "--timeout", "20"], job=fit_job.__file__) as job:
        victim_step = random.Random().randint(3, 25)
        job.wait_for_step(victim_step, timeout=90)
        victim = random.Random().randrange(3)
        os.kill(job.worker_pid(victim), signal.SIGKILL)
        assert job.wait(timeout=120) == 0, job.output()
        recovery = re.search(r"first step done ([\d.]+)s after the event", job.stderr)
        assert recovery, job.output()
        print(f"killed rank {victim} after step {victim_step}; recovery (death to next completed step): "
              f"{recovery.group(1)} s")
        assert float(recovery.group(1)) < 5.0
        assert job.result()["digest"] == uninterrupted
