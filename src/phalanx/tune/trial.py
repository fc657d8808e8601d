"""The trial's side of ``phalanx tune``: a script reads its parameters and reports its metrics.

``params = px.tune.params(lr=1e-3, batch_size=32)`` returns the trial's values (the defaults when
the script runs outside a search); ``px.tune.report(step, **metrics)`` records the study's metric
at ``step`` and returns whether the pruner stops the trial (the same answer on every rank).
``px.fit`` reports its epoch metrics by itself and stops early when pruned. Only rank 0 talks to
the storage; the runner says which study and trial through the environment.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import TYPE_CHECKING, Any

from phalanx.comm import collectives, runtime

if TYPE_CHECKING:
    import optuna

STORAGE_ENV, STUDY_ENV, TRIAL_ENV, METRIC_ENV, PRUNER_ENV = (
    "PHALANX_TUNE_STORAGE", "PHALANX_TUNE_STUDY", "PHALANX_TUNE_TRIAL", "PHALANX_TUNE_METRIC", "PHALANX_TUNE_PRUNER")
CURVE_ATTR = "curve"  # per step, every reported metric: the learning curves of the report
PRUNED_ATTR = "pruned_at_step"

logger = logging.getLogger(__name__)


def active() -> bool:
    """Whether this process runs a trial of ``phalanx tune``."""
    return TRIAL_ENV in os.environ


def metric() -> str | None:
    """The metric the search optimises (``--metric``), inside a trial."""
    return os.environ.get(METRIC_ENV) if active() else None


def params(**defaults: Any) -> dict[str, Any]:
    """This trial's parameters over ``defaults`` (outside a search: the defaults, unchanged)."""
    if not active():
        return dict(defaults)
    return {**defaults, **_trial().params}


def report(step: int, **metrics: float) -> bool:
    """Record ``metrics`` at ``step``; True when the pruner says to stop (then stop, and exit normally).

    Steps count from 1, as ``px.fit``'s epochs do: the median pruner compares trials at the same
    step and stops none before step 2. Collective when the job has several workers: every rank must
    call it at the same steps.
    """
    if not active():
        return False
    prune = _record(step, metrics) if runtime.rank() == 0 else False
    if runtime.is_initialized() and runtime.size() > 1:
        prune = bool(collectives.broadcast_object(prune, root=0))
    return prune


def _record(step: int, metrics: dict[str, float]) -> bool:
    trial, name = _trial(), metric()
    curve = dict(trial.user_attrs.get(CURVE_ATTR, {}))
    curve[str(step)] = {key: float(value) for key, value in metrics.items()}
    trial.set_user_attr(CURVE_ATTR, curve)
    if name not in metrics:
        logger.warning("phalanx tune: step %d reported %s but not the search's metric %r", step, sorted(metrics), name)
        return False
    value = float(metrics[name])
    if not math.isfinite(value):
        trial.set_user_attr(PRUNED_ATTR, step)
        return True  # a diverged trial is stopped at once, whatever the pruner says
    trial.report(value, step)
    if trial.should_prune():
        trial.set_user_attr(PRUNED_ATTR, step)
        return True
    return False


@functools.cache
def _trial() -> "optuna.Trial":
    import optuna  # only inside a search: a plain `import phalanx` does not pay for Optuna

    from phalanx.tune.storage import load_study
    from phalanx.tune.pruning import pruner

    study = load_study(os.environ[STORAGE_ENV], os.environ[STUDY_ENV], pruner(os.environ.get(PRUNER_ENV, "none")))
    return optuna.trial.Trial(study, int(os.environ[TRIAL_ENV]))
