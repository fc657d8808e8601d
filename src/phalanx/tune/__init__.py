"""Hyperparameter search: ``phalanx tune`` runs trials of a script; the script asks for its values.

``px.tune.params(**defaults)`` and ``px.tune.report(step, **metrics)`` (see :mod:`.trial`); the
search itself (space, study, runner, report) is only imported by ``phalanx tune``, and the
trial's side on first use (the ``phalanx`` command reads the choices below without PyTorch).
"""

import importlib
from typing import Any

SAMPLERS = ("random", "grid", "tpe")
PRUNERS = ("median", "none")


def __getattr__(name: str) -> Any:
    if name in ("active", "params", "report"):
        return getattr(importlib.import_module("phalanx.tune.trial"), name)
    raise AttributeError(f"module 'phalanx.tune' has no attribute {name!r}")


__all__ = ["PRUNERS", "SAMPLERS", "active", "params", "report"]
