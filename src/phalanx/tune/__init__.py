"""Hyperparameter search: ``phalanx tune`` runs trials of a script; the script asks for its values.

``px.tune.params(**defaults)`` and ``px.tune.report(step, **metrics)`` (see :mod:`.trial`); the
search itself (space, study, runner, report) is only imported by ``phalanx tune``.
"""

from phalanx.tune.trial import active, params, report

SAMPLERS = ("random", "grid", "tpe")
PRUNERS = ("median", "none")

__all__ = ["PRUNERS", "SAMPLERS", "active", "params", "report"]
