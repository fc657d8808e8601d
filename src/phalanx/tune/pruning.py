"""When a trial is stopped early: the pruner a search and each of its trials agree on, by name."""

from __future__ import annotations

import optuna


def pruner(name: str) -> optuna.pruners.BasePruner:
    """``median``: stop a trial whose metric is worse than the median of earlier trials at the same
    step, once two trials completed and from its second report on.

    Steps count from 1 (``px.fit`` reports epoch 1, 2, ...) while Optuna's warm-up counts from 0:
    ``n_warmup_steps=2`` makes step 2 the first step a trial can be stopped at.
    """
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2)
    return optuna.pruners.NopPruner()
