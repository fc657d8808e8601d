"""Running the trials of a search: J at a time, each a ``phalanx run -n P`` job in its own folder.

Each trial runs the user's script under the launcher with the trial's id in its environment
(see :mod:`phalanx.tune.trial`); its output goes to ``log.txt`` in its folder. How a trial's launcher
starts is injected (:data:`StartTrial`): ``phalanx tune`` forks them warm from one fork server for
the whole search, and a fresh ``python`` (:func:`start_with_python`) serves where it cannot. When the job ends,
the runner tells the study how: pruned (the script was told to stop), complete (the value is the
metric's last report), or failed with the tail of its log. Trials that end normally without ever
reporting the metric suggest a misspelt ``--metric``: after a few of them, and none reporting it,
no more trials start.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import optuna
from optuna.trial import TrialState

from phalanx.host import oversubscription
from phalanx.lifetime import die_with_parent
from phalanx.tune import study as studies
from phalanx.tune.study import Search
from phalanx.tune.trial import CURVE_ATTR, METRIC_ENV, PRUNED_ATTR, PRUNER_ENV, STORAGE_ENV, STUDY_ENV, TRIAL_ENV

ERROR_TAIL_LINES = 20
LAUNCH_KEYS = ("PHALANX_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC_")

logger = logging.getLogger(__name__)


class TrialProcess(Protocol):
    """A started trial launcher, as much of a ``subprocess.Popen`` as the runner uses."""

    pid: int

    def wait(self, timeout: float | None = None) -> int: ...


StartTrial = Callable[[list[str], dict[str, str], Path, int], TrialProcess]
"""Starts one trial's launcher: its ``phalanx`` arguments (``run -n P ...``), environment, folder and
the descriptor its output goes to; in a session of its own, ended when the search ends."""


def start_with_python(arguments: list[str], env: dict[str, str], folder: Path, output: int) -> TrialProcess:
    """A trial's launcher as a fresh ``python -m phalanx``, which imports torch itself."""
    return subprocess.Popen([sys.executable, "-m", "phalanx", *arguments], cwd=folder, env=env, stdout=output,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent(os.getpid()))  # a killed search stops its trials


@dataclass(frozen=True)
class Job:
    """How every trial is launched: ``phalanx run -n workers [launcher_args] script args``."""

    script: Path
    args: tuple[str, ...]
    workers: int
    launcher_args: tuple[str, ...] = ()


class Runner:
    """Runs trials of ``study`` until ``search.trials`` of them count, ``jobs`` at a time."""

    def __init__(self, search: Search, study: optuna.Study, job: Job, jobs: int, directory: Path,
                 timeout_s: float | None = None, out: Callable[[str], None] | None = None,
                 start: StartTrial = start_with_python):
        self.search, self.study, self.job, self.jobs, self.directory = search, study, job, jobs, directory
        self.start = start
        self.deadline = time.monotonic() + timeout_s if timeout_s else None
        self.say = out or (lambda line: print(line, flush=True))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._processes: dict[int, TrialProcess] = {}  # trial id -> its launcher
        self._gave_up = False  # said that the metric looks wrong

    def run(self) -> None:
        """Run to the end; Ctrl-C stops every trial (they are taken over when the search starts again)."""
        threads = [threading.Thread(target=self._loop, name=f"phalanx-tune-{k}", daemon=True) for k in range(self.jobs)]
        for thread in threads:
            thread.start()
        try:
            while any(thread.is_alive() for thread in threads):
                with self._lock:
                    studies.mark_alive(self.study, list(self._processes))
                for thread in threads:
                    thread.join(studies.ALIVE_EVERY_S / len(threads))
        except KeyboardInterrupt:
            self._stop.set()
            self._kill_all()
            raise

    def _loop(self) -> None:
        while not self._stop.is_set() and not self._past_deadline():
            started = self._start_next()
            if started is None:
                return
            self._finish(started, self._launch(started))

    def _start_next(self) -> optuna.Trial | None:
        """Ask for a trial unless enough are counted or running; None when this runner is done."""
        with self._lock:
            if len(studies.counted(self.study)) + len(studies.running(self.study)) >= self.search.trials:
                return None
            if studies.metric_looks_wrong(self.study, self.search.metric):
                if not self._gave_up:
                    self._gave_up = True
                    self.say(giving_up(self.search.metric))
                return None
            trial = self.study.ask()
            if not studies.claim(self.study, trial, self.search.trials):
                return None
            params = self.search.space.suggest(trial)
        self.say(f"trial {trial.number} started: {format_params(params)}")
        return trial

    def _launch(self, trial: optuna.Trial) -> int:
        folder = self.directory / "trials" / f"{trial.number:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        arguments = ["run", "-n", str(self.job.workers), *self.job.launcher_args, str(self.job.script), *self.job.args]
        env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_KEYS)}
        env.update({STORAGE_ENV: self.search.storage, STUDY_ENV: self.search.name, TRIAL_ENV: str(trial._trial_id),
                    METRIC_ENV: self.search.metric, PRUNER_ENV: self.search.pruner})
        with open(folder / "log.txt", "wb") as log:
            process = self.start(arguments, env, folder, log.fileno())
            with self._lock:
                self._processes[trial._trial_id] = process
            code = process.wait()
            with self._lock:
                self._processes.pop(trial._trial_id, None)
        return code

    def _finish(self, trial: optuna.Trial, code: int) -> None:
        """Tell the study how the trial ended (unless the search is being stopped: it stays running)."""
        if not self._stop.is_set():
            settle(self.study, self.search, trial, f"exit code {code}" if code else None, self.directory, self.say)

    def _kill_all(self) -> None:
        with self._lock:
            processes = list(self._processes.values())
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


def giving_up(metric: str) -> str:
    """What a runner says when it starts no more trials because ``metric`` looks misspelt."""
    return (f"phalanx tune: stopping: {studies.GIVE_UP_AFTER} trials ended without reporting {metric!r} and none "
            "reported it; no more trials start")


def settle(study: optuna.Study, search: Search, trial: optuna.Trial, failure: str | None, directory: Path,
           say: Callable[[str], None]) -> None:
    """Tell ``study`` how ``trial`` ended, from what it recorded itself: pruned (it was told to stop),
    complete (the value is the metric's last report), or failed (``failure``, or no report of the
    metric although it ended normally) with the tail of its log."""
    frozen = study._storage.get_trial(trial._trial_id)
    curve = frozen.user_attrs.get(CURVE_ATTR, {})
    log = directory / "trials" / f"{trial.number:04d}" / "log.txt"
    value = _last(curve, search.metric)
    if PRUNED_ATTR in frozen.user_attrs:
        _tell(study, trial, state=TrialState.PRUNED)
        say(f"trial {trial.number} pruned at step {frozen.user_attrs[PRUNED_ATTR]}")
    elif failure is None and value is not None:
        _tell(study, trial, value)
        say(f"trial {trial.number} complete: {search.metric} {value:.6g}")
    else:
        if failure is None:
            others = sorted(studies.reported([frozen]))
            failure = f"the script never reported {search.metric!r}, " + (
                f"only {', '.join(others)}" if others else "nor any metric (px.fit reports its epoch metrics; "
                "px.tune.report(step, **metrics) in a custom loop)")
            studies.mark_without_metric(study, trial)
        studies.record_error(study, trial, f"{failure}\n{_tail(log)}")
        _tell(study, trial, state=TrialState.FAIL)
        say(f"trial {trial.number} failed ({failure}); its log: {log}")


def _tell(study: optuna.Study, trial: optuna.Trial, value: float | None = None,
          state: TrialState | None = None) -> None:
    """``study.tell``; the grid sampler's request to stop once its grid is covered is not an error
    here (runners stop by counting trials), and the state is recorded either way."""
    try:
        study.tell(trial, value, state=state)
    except RuntimeError as error:
        if "Study.stop" not in str(error):
            raise


def _last(curve: dict[str, dict[str, float]], metric: str) -> float | None:
    steps = sorted((int(step) for step, metrics in curve.items() if metric in metrics))
    return curve[str(steps[-1])][metric] if steps else None


def _tail(path: Path, lines: int = ERROR_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def format_params(params: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def warn_oversubscription(jobs: int, workers: int, cores: int, say: Callable[[str], None]) -> None:
    """J x P processes beyond the cores: say what it costs, in the words ``phalanx run`` uses."""
    cost = oversubscription(jobs * workers, cores)
    if cost is not None:
        say(f"phalanx tune: warning: {jobs} trials x {workers} workers: {cost}, and a trial's runtime says so; "
            f"-j {max(1, cores // workers)} keeps one core per worker.")
