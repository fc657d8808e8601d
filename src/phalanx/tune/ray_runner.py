"""``phalanx tune --on ray``: the same search, each trial a Ray Train job that Ray Tune schedules.

Ray Tune places the trials on the cluster's CPUs and GPUs, J at a time; its search algorithm is
Ray's ``OptunaSearch`` on the search's own study (same sampler, same storage, so an interrupted
search resumes and ``--report`` reads it as a local one). Each trial is a ``TorchTrainer`` of P
workers that runs the user's script unchanged; the script reports and is pruned exactly as in a
local trial (``px.tune``, rank 0 to the study's storage, with the search's Optuna pruner), and
px.fit also reports every epoch to Ray (:mod:`phalanx.train.ray_session`). Only the trial
number and its id in the study travel in Ray's config, beside the parameters.

The storage must be reachable from every node: the default journal file lives in the study
directory, so on a cluster of several hosts that directory must be shared, or ``--storage`` a
database URL. Imported only by ``phalanx tune --on ray``.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import optuna
import ray
from ray import tune
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from phalanx.errors import ConfigurationError, WorkerFailedError
from phalanx.tune import study as studies
from phalanx.tune.runner import Job, format_params, giving_up, settle
from phalanx.tune.storage import open_storage
from phalanx.tune.study import Search
from phalanx.tune.trial import METRIC_ENV, PRUNER_ENV, STORAGE_ENV, STUDY_ENV, TRIAL_ENV

TRIAL_KEY, NUMBER_KEY = "phalanx_trial_id", "phalanx_trial_number"  # beside the parameters in Ray's config


@dataclass(frozen=True)
class Placement:
    """What each trial asks of the cluster: its workers, and each worker's CPUs and GPUs."""

    workers: int
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0


@dataclass(frozen=True)
class TrialSpec:
    """What every trial needs to run, shipped once to Ray's object store."""

    job: Job
    placement: Placement
    search: Search
    directory: Path


def run(search: Search, study: optuna.Study, job: Job, placement: Placement, jobs: int, directory: Path,
        address: str | None, timeout_s: float | None, say: Callable[[str], None]) -> None:
    """Run the study's remaining trials on the Ray cluster at ``address`` (None: ``$RAY_ADDRESS``,
    else a local cluster of this machine), ``jobs`` at a time."""
    remaining = search.trials - len(studies.counted(study))
    if remaining <= 0:
        return
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # Ctrl-C is handled below, as in a local search
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"  # trials report to the study; a missing metric is settled
    _connect(address, say)
    searcher = StudySearch(search, directory, say, time.monotonic() + timeout_s if timeout_s else None)
    trainable = tune.with_resources(tune.with_parameters(run_trial, spec=TrialSpec(job, placement, search, directory)),
                                    {"CPU": 0, "memory": 1})  # the trial's driver waits: its workers hold the CPUs
    tuner = tune.Tuner(trainable,
                       tune_config=tune.TuneConfig(search_alg=searcher, num_samples=remaining,
                                                   max_concurrent_trials=jobs),
                       run_config=tune.RunConfig(name=f"{search.name}-{int(time.time())}",
                                                 storage_path=str(directory / "ray"), verbose=0))
    with _stopped_by_ctrl_c(searcher):
        tuner.fit()


@contextlib.contextmanager
def _stopped_by_ctrl_c(searcher: StudySearch) -> Iterator[None]:
    """Ctrl-C (SIGINT) stops the search as it stops a local one: no trial is settled any more (the
    running ones stay running in the study, and the same command runs them again), Ray Tune ends
    its run (SIGUSR1, its own graceful stop, which also stops the trials), and KeyboardInterrupt
    reaches the command line."""
    def stop(signum: int, frame: object) -> None:
        searcher.stopping = True
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if searcher.stopping:
        raise KeyboardInterrupt


def _connect(address: str | None, say: Callable[[str], None]) -> None:
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError) as error:
        raise ConfigurationError(f"--on ray: cannot reach the Ray cluster at {address} ({error}). Start one with "
                                 "`ray start --head`, or leave --ray-address out for a local cluster.") from None
    resources = ray.cluster_resources()
    say(f"phalanx tune: on Ray at {address or 'a local cluster'}: {resources.get('CPU', 0):g} CPUs, "
        f"{resources.get('GPU', 0):g} GPUs")


class StudySearch(OptunaSearch):
    """Ray Tune's OptunaSearch on the search's study: each trial the study asks for is marked as
    this runner's (an interrupted search takes it over) and settled, when Ray says it ended, from
    what the trial recorded in the study, as a local trial is."""

    def __init__(self, search: Search, directory: Path, say: Callable[[str], None], deadline: float | None):
        super().__init__(space=search.space.suggest, metric=search.metric,
                         mode="max" if search.direction == "maximize" else "min",
                         sampler=studies.sampler(search), study_name=search.name, storage=open_storage(search.storage))
        self.search, self.directory, self.say, self.deadline = search, directory, say, deadline
        self.stopping = False  # Ctrl-C: start nothing, settle nothing
        self.gave_up = False  # said that the metric looks misspelt

    def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
        """The next trial's config; none after ``--timeout`` or once the metric looks misspelt
        (running trials finish), as locally."""
        if self.stopping or (self.deadline is not None and time.monotonic() > self.deadline):
            return Searcher.FINISHED
        if studies.metric_looks_wrong(self._ot_study, self.search.metric):
            if not self.gave_up:
                self.gave_up = True
                self.say(giving_up(self.search.metric))
            return Searcher.FINISHED
        params = super().suggest(trial_id)
        if params is None:
            return None
        trial = self._ot_trials[trial_id]
        studies.mark_runner(self._ot_study, trial)
        self.say(f"trial {trial.number} started: {format_params(params)}")
        return {**params, TRIAL_KEY: trial._trial_id, NUMBER_KEY: trial.number}

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        """The trial reported to the study itself; Ray's copy only says it is alive."""
        studies.mark_alive(self._ot_study, [self._ot_trials[trial_id]._trial_id])

    def save(self, checkpoint_path: str) -> None:
        """Nothing to save: the study, in its storage, is the search's state (a search started
        again resumes from it, not from Ray's experiment folder)."""

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        if self.stopping:
            return
        settle(self._ot_study, self.search, self._ot_trials[trial_id],
               "the trial's Ray job failed" if error else None, self.directory, self.say)


def run_trial(config: dict[str, Any], spec: TrialSpec) -> None:
    """One trial (Ray Tune's trainable): a Ray Train job of the trial's workers running the script."""
    trial_id, number = config[TRIAL_KEY], config[NUMBER_KEY]
    folder = spec.directory / "trials" / f"{number:04d}"
    env = {STORAGE_ENV: spec.search.storage, STUDY_ENV: spec.search.name, TRIAL_ENV: str(trial_id),
           METRIC_ENV: spec.search.metric, PRUNER_ENV: spec.search.pruner}
    placement = spec.placement
    trainer = TorchTrainer(
        run_script,
        train_loop_config={"script": str(spec.job.script), "args": list(spec.job.args), "env": env,
                           "folder": str(folder)},
        scaling_config=ScalingConfig(num_workers=placement.workers, use_gpu=placement.gpus_per_worker > 0,
                                     resources_per_worker={"CPU": placement.cpus_per_worker,
                                                           "GPU": placement.gpus_per_worker}),
        run_config=RunConfig(name=f"trial-{number:04d}", storage_path=str(spec.directory / "ray"),
                             callbacks=[TuneReportCallback()]))
    trainer.fit()


def run_script(config: dict[str, Any]) -> None:
    """Each worker of a trial: the user's script as ``phalanx run`` would start it, in the trial's
    folder, its output appended to the trial's log."""
    os.environ.update(config["env"])
    folder = Path(config["folder"])
    folder.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)
    sys.argv = [config["script"], *config["args"]]
    with open(folder / "log.txt", "a", buffering=1) as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        try:
            runpy.run_path(config["script"], run_name="__main__")
        except SystemExit as exit_:
            if exit_.code not in (None, 0):
                raise WorkerFailedError(f"{config['script']} exited with code {exit_.code}") from None
        except BaseException:
            traceback.print_exc()  # into the trial's log, which the study's error quotes, as a local trial's
            raise
