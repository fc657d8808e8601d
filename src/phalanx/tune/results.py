"""What a search leaves in its directory: ``trials.csv``, the best trial, and three plots.

``metric_vs_<parameter>.png`` (the metric against each parameter, on a log axis where the parameter
was sampled on a log scale, its categories evenly spaced in order), ``runtime.png`` (seconds per
trial) and ``learning_curves.png`` (every trial's reported metric by step), drawn with matplotlib
(Agg, no display needed). ``phalanx tune --report DIR`` writes them again from the study alone.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from phalanx.atomic import write_atomically, write_text_atomically
from phalanx.tune.study import ERROR_ATTR, counted
from phalanx.tune.trial import CURVE_ATTR


def write(study: optuna.Study, directory: Path, metric: str) -> list[str]:
    """Write the CSV and the plots of the counted trials into ``directory``; the lines to print."""
    trials = sorted(counted(study), key=lambda t: t.number)
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted({name for trial in trials for name in trial.params})
    _write_csv(trials, names, directory)
    _plot(trials, names, directory, metric)
    return _summary(study, trials, metric, directory)


def _write_csv(trials: list[FrozenTrial], names: list[str], directory: Path) -> None:
    """``trials.csv``, replaced whole: a search killed while writing it leaves the previous one."""
    out = io.StringIO(newline="")
    writer = csv.writer(out)
    writer.writerow(["number", "state", "value", *names, "duration_s", "log", "error"])
    for trial in trials:
        writer.writerow([trial.number, trial.state.name, "" if trial.value is None else trial.value,
                         *(trial.params.get(name, "") for name in names), f"{_duration(trial):.2f}",
                         directory / "trials" / f"{trial.number:04d}" / "log.txt",
                         trial.system_attrs.get(ERROR_ATTR, "").splitlines()[0] if ERROR_ATTR in trial.system_attrs
                         else ""])
    write_text_atomically(directory / "trials.csv", out.getvalue())


def _summary(study: optuna.Study, trials: list[FrozenTrial], metric: str, directory: Path) -> list[str]:
    states = {state: sum(t.state == state for t in trials) for state in (TrialState.COMPLETE, TrialState.PRUNED,
                                                                           TrialState.FAIL)}
    lines = [f"{len(trials)} trials: {states[TrialState.COMPLETE]} complete, {states[TrialState.PRUNED]} pruned, "
             f"{states[TrialState.FAIL]} failed; results in {directory / 'trials.csv'}"]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        params = ", ".join(f"{k}={v}" for k, v in best.params.items())
        lines.append(f"best trial {best.number}: {metric} {best.value:.6g} ({params}), {_duration(best):.1f}s")
    return lines


def _plot(trials: list[FrozenTrial], names: list[str], directory: Path, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    for name in names:
        figure, axes = plt.subplots(figsize=(5, 3.5))
        points = [(t.params[name], t.value) for t in complete if name in t.params]
        _scatter(axes, points, [t.distributions[name] for t in trials if name in t.distributions][-1])
        axes.set_xlabel(name)
        axes.set_ylabel(metric)
        axes.set_title(f"{metric} by {name}")
        _save(figure, directory / f"metric_vs_{name}.png")
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.bar([str(t.number) for t in trials], [_duration(t) for t in trials],
             color=[{"COMPLETE": "tab:blue", "PRUNED": "tab:orange"}.get(t.state.name, "tab:red") for t in trials])
    axes.set_xlabel("trial (blue complete, orange pruned, red failed)")
    axes.set_ylabel("seconds")
    axes.set_title("runtime per trial")
    _save(figure, directory / "runtime.png")
    figure, axes = plt.subplots(figsize=(6, 4))
    for trial in trials:
        curve = sorted((int(step), values[metric]) for step, values in trial.user_attrs.get(CURVE_ATTR, {}).items()
                       if metric in values)
        if curve:
            axes.plot([s for s, _ in curve], [v for _, v in curve], marker=".", label=f"trial {trial.number}")
    axes.set_xlabel("step (epoch with px.fit)")
    axes.set_ylabel(metric)
    axes.set_title("learning curves")
    if len(trials) <= 12 and axes.lines:
        axes.legend(fontsize="small")
    _save(figure, directory / "learning_curves.png")


def _scatter(axes: Any, points: list[tuple[Any, float]], distribution: BaseDistribution) -> None:
    """The metric against one parameter, on the scale it was sampled on: a log axis for a range
    sampled on a log scale, a linear one for other ranges, and categories evenly spaced in order."""
    if not points:
        return
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x, _ in points)
    if numbers and not isinstance(distribution, CategoricalDistribution):
        axes.scatter([x for x, _ in points], [y for _, y in points])
        if getattr(distribution, "log", False):
            axes.set_xscale("log")
    else:  # the distribution's choices, then any value an earlier search had
        choices = distribution.choices if isinstance(distribution, CategoricalDistribution) else ()
        labels = list(dict.fromkeys([*(str(c) for c in choices), *(str(x) for x, _ in points)]))
        axes.scatter([labels.index(str(x)) for x, _ in points], [y for _, y in points])
        axes.set_xticks(range(len(labels)), labels)


def _save(figure: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    write_atomically(path, lambda handle: figure.savefig(handle, format="png", dpi=100))
    plt.close(figure)


def _duration(trial: FrozenTrial) -> float:
    return trial.duration.total_seconds() if trial.duration is not None else math.nan
