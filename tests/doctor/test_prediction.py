"""The doctor's predictions held against separate runs of a real script (examples/digits.py).

A prediction is only as good as the host is steady: where a run saw the host busy, its time says
nothing about another run's (2 workers of digits beside one busy loop took 7 ms a step in one run
and 19 ms in the next), and the doctor must say that it cannot predict instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import phalanx as px
from phalanx.cli.doctor import collect
from phalanx.doctor.measured import Measured, summarize
from phalanx.doctor.predict import BUSY_SHARE, Layout

DIGITS = str(Path(__file__).resolve().parents[2] / "examples" / "digits.py")
STEPS, WARMUP, TOLERANCE = 20, 5, 0.15


def quiet_run(workers: int, cores: int, attempts: int = 3) -> Measured | None:
    """A separate run of the script on ``workers`` workers that saw the host quiet (``None``: none did)."""
    for _ in range(attempts):
        run = summarize(collect(DIGITS, ["--epochs", "3"], workers, STEPS, WARMUP))
        if run.other_load is not None and run.other_load <= BUSY_SHARE * cores:
            return run
    return None


def test_predictions_for_1_and_2_workers_agree_with_separate_runs_within_15_percent() -> None:
    diagnosis = px.diagnose(DIGITS, ["--epochs", "3"], workers=2, steps=STEPS, warmup=WARMUP)
    assert diagnosis.measured.global_batch == 64 and diagnosis.measured.short_batches == (29,)
    assert diagnosis.model is not None
    predicted = {p.layout: p.step_s for p in diagnosis.predictions}
    if diagnosis.model.busy:  # then nothing is predicted, and the report says why
        assert not predicted and all("the host was busy" in reason for _, reason in diagnosis.not_predicted)
        return
    for workers in (1, 2):
        separate = quiet_run(workers, diagnosis.measured.cores)
        if separate is None:
            pytest.skip("the host stayed busy: no quiet run to compare with")
        error = predicted[Layout(workers, workers)] / separate.step_s - 1
        assert abs(error) <= TOLERANCE, (workers, predicted[Layout(workers, workers)], separate.step_s)
