"""The trial's side, in process: ``px.tune.report`` against a study in a journal file, as a trial sees it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import optuna
import pytest

import phalanx as px
from phalanx.tune import trial
from phalanx.tune.storage import journal_url, open_storage


@pytest.fixture
def bad_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[optuna.Study]:
    """A study where two trials completed with a low loss at steps 1 to 3, and this process is a third trial."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = journal_url(tmp_path)
    study = optuna.create_study(storage=open_storage(url), study_name="s")
    for _ in range(2):
        study.add_trial(optuna.trial.create_trial(value=0.1, intermediate_values={1: 0.1, 2: 0.1, 3: 0.1}))
    running = study.ask()
    for key, value in ((trial.STORAGE_ENV, url), (trial.STUDY_ENV, "s"), (trial.TRIAL_ENV, str(running._trial_id)),
                       (trial.METRIC_ENV, "loss"), (trial.PRUNER_ENV, "median")):
        monkeypatch.setenv(key, value)
    trial._trial.cache_clear()
    yield study
    trial._trial.cache_clear()


def test_the_median_pruner_stops_a_trial_from_its_second_report_on_not_at_its_first(bad_trial: optuna.Study) -> None:
    assert px.tune.report(1, loss=5.0) is False  # far worse than the median, but its first report (px.fit: epoch 1)
    assert px.tune.report(2, loss=5.0) is True
    assert bad_trial.trials[-1].user_attrs[trial.PRUNED_ATTR] == 2
