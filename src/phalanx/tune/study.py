"""The study of a search: opening it (again), counting its trials, and taking over interrupted ones.

A search of T trials is done when T of its trials *count*: completed, pruned, or failed on their
own (a crash). Trials that were running when their search was killed are failed with a mark and
their parameters queued again, so a search started again completes exactly T trials and runs
none twice. Several ``phalanx tune`` processes may share one study (one per host, on a database
URL): each runner marks its running trials alive every few seconds, and only trials whose runner
is gone (same host: its process is dead; elsewhere: no sign of life for a minute) are taken over.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Iterable

import optuna
from optuna.trial import FrozenTrial, TrialState

from phalanx.errors import ConfigurationError
from phalanx.lifetime import is_alive
from phalanx.tune.pruning import pruner
from phalanx.tune.space import PriorSampler, Space
from phalanx.tune.storage import open_storage
from phalanx.tune.trial import CURVE_ATTR

RUNNER_ATTR, ALIVE_ATTR, INTERRUPTED_ATTR, SURPLUS_ATTR, ERROR_ATTR, NO_METRIC_ATTR = (
    "phalanx_runner", "phalanx_alive", "phalanx_interrupted", "phalanx_surplus", "phalanx_error", "phalanx_no_metric")
ALIVE_EVERY_S = 5.0
STALE_AFTER_S = 60.0
GIVE_UP_AFTER = 3  # trials that ended normally without the metric, none reporting it: the metric's name is wrong


@dataclass(frozen=True)
class Search:
    """What ``phalanx tune`` was asked for (the command line over the space file)."""

    space: Space
    storage: str
    name: str
    trials: int
    metric: str
    direction: str
    sampler: str
    pruner: str
    seed: int | None = None


def open_study(search: Search) -> optuna.Study:
    """Create the study, or open it again with the same direction."""
    study = optuna.create_study(storage=open_storage(search.storage), study_name=search.name,
                                direction=search.direction, sampler=sampler(search), pruner=pruner(search.pruner),
                                load_if_exists=True)
    wanted = optuna.study.StudyDirection.MAXIMIZE if search.direction == "maximize" else \
        optuna.study.StudyDirection.MINIMIZE
    if study.direction != wanted:
        raise ConfigurationError(f"study {search.name!r} already exists with direction {study.direction.name.lower()}; "
                                 f"pass --direction {study.direction.name.lower()} or another --study name.")
    if "metric" not in study.user_attrs:
        study.set_user_attr("metric", search.metric)
        study.set_user_attr("parameters", list(search.space.names))
    return study


def sampler(search: Search) -> optuna.samplers.BaseSampler:
    """Optuna's sampler of the search; the random one draws parameters with a normal prior from it."""
    if search.sampler == "grid":
        return optuna.samplers.GridSampler(search.space.grid(), seed=search.seed)
    if search.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=search.seed)
    return PriorSampler(search.space.priors(), seed=search.seed)


def counts(trial: FrozenTrial) -> bool:
    """Whether ``trial`` is one of the search's T: finished, and neither interrupted nor surplus."""
    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return trial.state == TrialState.FAIL and not (
        trial.system_attrs.get(INTERRUPTED_ATTR) or trial.system_attrs.get(SURPLUS_ATTR))


def counted(study: optuna.Study) -> list[FrozenTrial]:
    return [trial for trial in study.get_trials(deepcopy=False) if counts(trial)]


def running(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if not t.system_attrs.get(SURPLUS_ATTR)]


def runner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def take_over_interrupted(study: optuna.Study) -> list[int]:
    """Fail the running trials whose runner is gone and queue their parameters again; their numbers."""
    taken = []
    for trial in running(study):
        if _runner_gone(trial):
            study._storage.set_trial_system_attr(trial._trial_id, INTERRUPTED_ATTR, True)
            study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            study.enqueue_trial(trial.params, skip_if_exists=False)
            taken.append(trial.number)
    return taken


def _runner_gone(trial: FrozenTrial) -> bool:
    runner = trial.system_attrs.get(RUNNER_ATTR, "")
    host, _, pid = runner.rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        return not is_alive(int(pid))
    alive = trial.system_attrs.get(ALIVE_ATTR, 0.0)
    return time.time() - float(alive) > STALE_AFTER_S


def claim(study: optuna.Study, trial: optuna.Trial, total: int) -> bool:
    """Mark ``trial`` as this runner's; False (and the trial set aside) when T trials are already
    counted or running, which happens when several runners ask at the same moment."""
    storage = study._storage
    mark_runner(study, trial)
    before = [t for t in study.get_trials(deepcopy=False) if t.number < trial.number
              and (counts(t) or (t.state == TrialState.RUNNING and not t.system_attrs.get(SURPLUS_ATTR)))]
    if len(before) < total:
        return True
    storage.set_trial_system_attr(trial._trial_id, SURPLUS_ATTR, True)
    study.tell(trial, state=TrialState.FAIL)
    if trial.params:  # queued parameters (an interrupted trial's) go back for the runner that needs them
        study.enqueue_trial(trial.params, skip_if_exists=False)
    return False


def mark_runner(study: optuna.Study, trial: optuna.Trial) -> None:
    """Mark ``trial`` as run by this process, alive now (a search started again takes it over once
    this process is gone)."""
    study._storage.set_trial_system_attr(trial._trial_id, RUNNER_ATTR, runner_id())
    study._storage.set_trial_system_attr(trial._trial_id, ALIVE_ATTR, time.time())


def mark_alive(study: optuna.Study, trial_ids: list[int]) -> None:
    for trial_id in trial_ids:
        study._storage.set_trial_system_attr(trial_id, ALIVE_ATTR, time.time())


def record_error(study: optuna.Study, trial: optuna.Trial, message: str) -> None:
    study._storage.set_trial_system_attr(trial._trial_id, ERROR_ATTR, message)


def reported(trials: Iterable[FrozenTrial]) -> set[str]:
    """The names of every metric the trials reported, at any step."""
    return {name for trial in trials for metrics in trial.user_attrs.get(CURVE_ATTR, {}).values() for name in metrics}


def mark_without_metric(study: optuna.Study, trial: optuna.Trial) -> None:
    """``trial`` ended normally but never reported the search's metric (a sign its name is wrong)."""
    study._storage.set_trial_system_attr(trial._trial_id, NO_METRIC_ATTR, True)


def metric_looks_wrong(study: optuna.Study, metric: str) -> bool:
    """Whether to start no more trials: ``GIVE_UP_AFTER`` trials ended normally without reporting
    ``metric``, and no trial of the study ever reported it."""
    trials = study.get_trials(deepcopy=False)
    without = sum(bool(trial.system_attrs.get(NO_METRIC_ATTR)) for trial in trials if counts(trial))
    return without >= GIVE_UP_AFTER and metric not in reported(trials)


def unreported_metric(study: optuna.Study, metric: str) -> str | None:
    """What to tell the user when no counted trial reported ``metric`` (None when one did, or none ran)."""
    trials = counted(study)
    if not trials or metric in reported(trials):
        return None
    others = sorted(reported(trials))
    if not others:
        return (f"no trial reported --metric {metric!r}, nor any other metric: the {len(trials)} trial(s) failed; "
                "their errors are in trials.csv and their logs.")
    return (f"no trial reported --metric {metric!r}; they reported {', '.join(others)}. Pass one of those as --metric "
            f"in a new study (another --study-dir, or --study with --storage): this one keeps its {len(trials)} "
            "failed trial(s).")
