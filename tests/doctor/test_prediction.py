"""The doctor's predictions held against separate runs of a real px.fit script (tests/doctor/mlp.py).

A prediction is only as good as the host is steady. Where a run saw the host busy, its time says
nothing about another run's (2 workers of digits beside one busy loop took 7 ms a step in one run
and 19 ms in the next), and the doctor must say that it cannot predict instead. A quiet host here
still drifts: ten runs of this script on 2 workers took 12.1 to 19.0 ms a step, each with its CPU
busy the whole time, so one run, the doctor's included, can be off the typical step by a third.
Hence: each prediction is held against a separate run and, where they disagree by more than 15 %,
against the median of three; and a doctor run whose own measurement was off may be redone twice (a
whole-suite run on this 2-core host once drifted past 15 % in two attempts in a row). A right model
passes; a wrong one (the 36 % error this test was written for) fails every attempt. The 1-worker
row is also held against plain ``phalanx run -n 1`` runs, timed by the script itself: the doctor's
reference must measure what a run without the doctor measures.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from phalanx.cli.doctor import collect, diagnose
from phalanx.doctor.diagnosis import Diagnosis
from phalanx.doctor.measured import summarize, typical
from phalanx.doctor.predict import BUSY_SHARE, Layout
from phalanx.doctor.records import mean

SCRIPT = str(Path(__file__).with_name("mlp.py"))
STEPS, WARMUP, TOLERANCE, ATTEMPTS = 10, 3, 0.15, 3


def separate_step_s(workers: int) -> tuple[float, float]:
    """A separate run's step on ``workers`` workers, and the cores other processes kept busy meanwhile."""
    run = summarize(collect(SCRIPT, [], workers, STEPS, WARMUP))
    return run.step_s, run.other_load if run.other_load is not None else 0.0


def disagreements(diagnosis: Diagnosis) -> list[tuple[int, float, list[float]]]:
    """The rows for 1 and 2 workers that a quiet separate measurement puts more than 15 % away."""
    predicted = {p.layout: p.step_s for p in diagnosis.predictions}
    found = []
    for workers in (1, 2):
        expected = predicted[Layout(workers, workers)]
        runs = [separate_step_s(workers)]
        if abs(expected / runs[0][0] - 1) > TOLERANCE:
            runs += [separate_step_s(workers) for _ in range(2)]
        quiet = [step for step, load in runs if load <= BUSY_SHARE * diagnosis.measured.cores]
        if quiet and abs(expected / statistics.median(quiet) - 1) > TOLERANCE:
            found.append((workers, expected, quiet))
    return found


def test_predictions_for_1_and_2_workers_agree_with_separate_runs_within_15_percent() -> None:
    failures = []
    for _ in range(ATTEMPTS):
        diagnosis = diagnose(SCRIPT, workers=2, steps=STEPS, warmup=WARMUP)
        assert diagnosis.measured.global_batch == 128 and diagnosis.model is not None
        if diagnosis.model.busy:  # then nothing is predicted, and the report says why
            assert not diagnosis.predictions
            assert all("the host was busy" in reason for _, reason in diagnosis.not_predicted)
            return
        failures.append(disagreements(diagnosis))
        if not failures[-1]:
            return
    raise AssertionError(f"predictions (workers, predicted s, separate runs' s) off by more than 15 %: {failures}")


def plain_step_s(steps: int) -> tuple[float, float]:
    """A plain ``phalanx run -n 1`` of the script measured as the doctor measures its runs: the mean
    of the typical steps among the ``steps`` after the warm-up, each timed by the script itself from
    the previous step's end; and the cores other processes kept busy meanwhile."""
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "1", SCRIPT, "--time"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.split("STEPS ", 1)[1])
    timed = found["steps"][WARMUP - 1:WARMUP - 1 + steps]  # the script's i-th figure is step i + 2
    return mean([timed[i] for i in typical(list(range(len(timed))), timed)]), found["other_load"] or 0.0


def test_the_1_worker_row_is_what_a_plain_run_measures_within_10_percent() -> None:
    """The row against plain runs just before and after the doctor's, the median of the quiet ones:
    a host drifting while they run moves both sides alike (issue 39: it once said 0.079 s where
    ``phalanx run -n 1`` took 0.062)."""
    steps, failures = 20, []
    for _ in range(ATTEMPTS):
        before = plain_step_s(steps)
        diagnosis = diagnose(SCRIPT, ["--time"], workers=2, steps=steps, warmup=WARMUP)
        after = plain_step_s(steps)
        assert diagnosis.model is not None
        if diagnosis.model.busy:  # then nothing is predicted, and the report says why
            assert not diagnosis.predictions
            return
        row = {p.layout: p.step_s for p in diagnosis.predictions}[Layout(1, 1)]
        quiet = [step for step, load in (before, after) if load <= BUSY_SHARE * diagnosis.measured.cores]
        if not quiet or abs(row / statistics.median(quiet) - 1) <= 0.10:
            return
        failures.append((row, before, after))
    raise AssertionError(f"the 1-worker row (s) against plain runs before and after it (s, other cores busy): {failures}")
