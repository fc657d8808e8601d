"""``phalanx tune``: a hyperparameter search whose trials are ``phalanx run`` jobs, on Optuna.

    phalanx tune -j 2 -n 1 --space space.json --trials 8 train.py --epochs 5
    phalanx tune --report tune-train

Everything after the script belongs to the script. Running the same command again continues the
study (trials interrupted by a kill run again); several hosts share a study through ``--storage``,
or a Ray cluster runs the trials (``--on ray``, :mod:`phalanx.tune.ray_runner`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Iterator, Sequence

from typing import TYPE_CHECKING

from phalanx.atomic import write_text_atomically
from phalanx.errors import ConfigurationError
from phalanx.host import usable_cores
from phalanx.tune import PRUNERS, SAMPLERS

if TYPE_CHECKING:  # Optuna is imported when a search runs, not by every `phalanx run`
    from phalanx.tune import runner, study as studies

SEARCH_FILE = "search.json"

DESCRIPTION = """\
Run T trials of a script, J at a time, each a `phalanx run -n P` job in its own folder under the
study directory (output in its log.txt). The script reads its parameters with
`px.tune.params(name=default, ...)`; px.fit reports its epoch metrics and stops when pruned, and
custom loops call `px.tune.report(step, **metrics)`. At the end: DIR/trials.csv, the best trial,
and plots (metric against each parameter, runtime per trial, learning curves)."""

EPILOG = """\
examples (in a checkout of phalanx):
  phalanx tune -j 2 --space examples/batch_size_space.json --trials 8 --metric val_accuracy \\
      --direction maximize examples/digits.py --epochs 3
  phalanx tune --report tune-digits                 # print and draw the results again"""


def add_parser(commands: argparse._SubParsersAction) -> tuple[argparse.ArgumentParser, frozenset[str]]:
    """Add ``tune`` to the ``phalanx`` command line; return it and its options that take a value."""
    tune = commands.add_parser("tune", help="search hyperparameters, each trial a `phalanx run` job",
                               description=DESCRIPTION, epilog=EPILOG,
                               formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    value_options = []

    def option(*flags: str, **kwargs: object) -> None:
        tune.add_argument(*flags, **kwargs)  # type: ignore[arg-type]
        if kwargs.get("action") is None:
            value_options.extend(flags)

    option("-j", "--jobs", type=int, default=1, metavar="J", help="trials at a time (default 1)")
    option("-n", "--nproc-per-node", type=int, default=1, metavar="P", help="workers per trial (default 1)")
    option("--space", metavar="FILE", help="the search space, JSON or YAML (phalanx's or Comet's format)")
    option("--trials", type=int, metavar="T", help="trials the study ends with (at most the space file's maxCombo, "
                                                    "and a grid's size, which stand for it when it is left out)")
    option("--sampler", choices=SAMPLERS, help="default: the space file's algorithm, else tpe")
    option("--metric", metavar="NAME", help="what to optimise (default: the space file's, else val_loss)")
    option("--direction", choices=("minimize", "maximize"), help="default: the space file's, else minimize")
    option("--pruner", choices=PRUNERS, default="median", help="stop poor trials early (default median)")
    option("--study-dir", metavar="DIR", help="where trials, logs and results go (default ./tune-SCRIPT)")
    option("--storage", metavar="URL", help="an Optuna storage URL shared by several hosts (default: a journal file "
                                            "in the study directory)")
    option("--study", metavar="NAME", help="the study's name (default: the script's name)")
    option("--timeout", type=float, metavar="SECONDS", help="start no trial after this long")
    option("--seed", type=int, metavar="N", help="seed of the sampler")
    option("--on", choices=("local", "ray"), default="local",
           help="where trials run: this machine (phalanx run jobs), or a Ray cluster (Ray Train jobs scheduled "
                "by Ray Tune; pip install 'phalanx[ray]'; see docs/ray.md)")
    option("--ray-address", metavar="ADDR", help="with --on ray: the cluster (default $RAY_ADDRESS, else a local one)")
    option("--cpus-per-worker", type=float, default=1.0, metavar="C", help="with --on ray: CPUs per worker (default 1)")
    option("--gpus-per-worker", type=float, default=0.0, metavar="G", help="with --on ray: GPUs per worker (default 0)")
    option("--report", metavar="DIR", help="print and draw the results of the study in DIR again, and exit")
    tune.add_argument("target", nargs="?", metavar="script.py", help="the script each trial runs")
    tune.add_argument("args", nargs="*", metavar="args", help="arguments passed to the script unchanged")
    return tune, frozenset(value_options)


def run(namespace: argparse.Namespace, script_args: Sequence[str]) -> int:
    """``phalanx tune`` after parsing: configuration errors come before any trial starts."""
    import optuna

    from phalanx.tune import results, runner, study as studies

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # phalanx says what happens, trial by trial
    if namespace.report:
        return _report(Path(namespace.report))
    search, job, directory = _configure(namespace, script_args)
    on_ray = _ray_runner() if namespace.on == "ray" else None  # before the study exists: nothing to undo
    study = studies.open_study(search)
    _remember(directory, search)
    taken = studies.take_over_interrupted(study)
    if taken:
        print(f"phalanx tune: trial(s) {taken} were interrupted; their parameters run again", flush=True)
    done = len(studies.counted(study))
    print(f"phalanx tune: study {search.name!r} in {search.storage}: {done} of {search.trials} trials done", flush=True)
    if on_ray is not None:
        placement = on_ray.Placement(job.workers, namespace.cpus_per_worker, namespace.gpus_per_worker)
        on_ray.run(search, study, job, placement, namespace.jobs, directory, namespace.ray_address, namespace.timeout,
                   lambda line: print(line, flush=True))
    else:
        runner.warn_oversubscription(namespace.jobs, job.workers, usable_cores(), lambda line: print(line, flush=True))
        with warm_trials() as start:
            runner.Runner(search, study, job, namespace.jobs, directory, namespace.timeout, start=start).run()
    for line in results.write(study, directory, search.metric):
        print(line, flush=True)
    unreported = studies.unreported_metric(study, search.metric)
    if unreported:
        raise ConfigurationError(unreported)
    return 0


def _configure(namespace: argparse.Namespace,
               script_args: Sequence[str]) -> tuple["studies.Search", "runner.Job", Path]:
    from phalanx.tune import runner, space as spaces, study as studies
    from phalanx.tune.storage import journal_url

    if not namespace.target:
        raise ConfigurationError("nothing to tune: give the script, `phalanx tune --space S --trials T train.py`.")
    script = Path(namespace.target).resolve()
    if not script.is_file():
        raise ConfigurationError(f"script {namespace.target!r} not found (from {os.getcwd()}).")
    if namespace.space is None:
        raise ConfigurationError("--space FILE is required.")
    for flag, value in (("--trials", namespace.trials), ("-j", namespace.jobs), ("-n", namespace.nproc_per_node)):
        if value is not None and value < 1:
            raise ConfigurationError(f"{flag} must be at least 1, got {value}.")
    space = spaces.load(namespace.space)
    sampler = namespace.sampler or space.sampler or "tpe"
    space.check(sampler)  # a grid's values, what the sampler can draw: said before anything is created
    trials, why = space.trials(namespace.trials, sampler)
    if trials != namespace.trials:
        print(f"phalanx tune: {trials} trials: {why}", flush=True)
    directory = Path(namespace.study_dir or f"tune-{script.stem}").resolve()
    search = studies.Search(
        space=space, storage=namespace.storage or journal_url(directory), name=namespace.study or script.stem,
        trials=trials, metric=namespace.metric or space.metric or "val_loss",
        direction=namespace.direction or space.direction or "minimize",
        sampler=sampler, pruner=namespace.pruner, seed=namespace.seed)
    return search, runner.Job(script, tuple(script_args), namespace.nproc_per_node), directory


@contextlib.contextmanager
def warm_trials() -> Iterator["runner.StartTrial"]:
    """How this search starts its trials' launchers: forked from one fork server for the whole search
    (which loaded torch, phalanx and TorchDynamo once), each launcher then forking its own server from
    itself without importing anything: a trial's script starts in a fraction of a second instead of
    after two imports (torch, then TorchDynamo at its first optimizer). A fresh ``python`` where a fork
    cannot serve."""
    from phalanx.cli.config import WorkerSpec
    from phalanx.cli.forkserver import TORCHDYNAMO, ForkServer
    from phalanx.tune import runner

    forks = ForkServer(WorkerSpec.shared_environment(
        {k: v for k, v in os.environ.items() if not k.startswith(runner.LAUNCH_KEYS)}), preload=[TORCHDYNAMO])
    forks.start()  # before the runner's threads: this process may become the server's parent by a fork

    def start(arguments: list[str], env: dict[str, str], folder: Path, output: int) -> runner.TrialProcess:
        env = WorkerSpec.shared_environment(env)
        if forks.serves(env):
            return forks.spawn(["-m", "phalanx", *arguments], env, str(folder), stdout=output, stderr=output)
        return runner.start_with_python(arguments, env, folder, output)

    try:
        yield start
    finally:
        forks.close()


def _ray_runner() -> ModuleType:
    try:
        from phalanx.tune import ray_runner
    except ImportError as error:
        raise ConfigurationError(f"--on ray needs Ray Train and Tune ({error}): pip install 'phalanx[ray]'.") from None
    return ray_runner


def _remember(directory: Path, search: "studies.Search") -> None:
    """What ``--report DIR`` needs to find the study again."""
    directory.mkdir(parents=True, exist_ok=True)
    write_text_atomically(directory / SEARCH_FILE, json.dumps(
        {"storage": search.storage, "study": search.name, "metric": search.metric}, indent=2) + "\n")


def _report(directory: Path) -> int:
    from phalanx.tune import results
    from phalanx.tune.storage import load_study

    try:
        saved = json.loads((directory / SEARCH_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ConfigurationError(f"--report {directory}: no readable {SEARCH_FILE} there ({error}); give the "
                                 "--study-dir of a search.") from None
    study = load_study(saved["storage"], saved["study"])
    for line in results.write(study, directory, saved["metric"]):
        print(line, flush=True)
    return 0
