"""Save and restore the whole training state: model, optimizer, data position, RNG, counters.

``save`` is collective: every rank contributes its random-number state, rank 0 writes. ``restore``
reads on rank 0 and broadcasts, so hosts need no shared file system. A run resumed at another
world size continues the data exactly (the loader's position is global) and re-seeds each rank's
generator from (seed, step, rank), since per-rank streams cannot be redistributed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from phalanx.comm import collectives, runtime
from phalanx.data import mix_seed
from phalanx.train import checkpoint_io
from phalanx.train.metrics import global_sums
from phalanx.train.state import History, TrainState

FORMAT_VERSION = 1


def save(state: TrainState, directory: str | Path, keep: int = 3, extra: dict[str, Any] | None = None) -> None:
    """Write a checkpoint of ``state`` into ``directory`` (collective; rank 0 writes)."""
    rng_states = collectives.allgather_object(torch.get_rng_state())
    running = global_sums(state.metrics) if state.step > 0 else []
    if not runtime.is_master():
        return
    payload = {
        "format": FORMAT_VERSION,
        "model": state.model.state_dict(),
        "optimizer": state.optimizer.state_dict(),
        "loader": state.loader.state_dict(),
        "rng": rng_states,
        "epoch": state.epoch,
        "step": state.step,
        "global_step": state.global_step,
        "history": state.history.state_dict(),
        "scheduled_lrs": list(state.scheduled_lrs),
        "running_metrics": running,
        "exact": state.exact.state_dict() if state.exact is not None else None,
        "world_size": runtime.size(),
        **(extra or {}),
    }
    checkpoint_io.save_atomically(payload, checkpoint_io.checkpoint_path(directory, state.global_step))
    checkpoint_io.prune(directory, keep)


def restore(state: TrainState, directory: str | Path, weights_only: bool = True) -> dict[str, Any] | None:
    """Load the newest readable checkpoint into ``state``; return it (``None`` if there is none)."""
    payload = checkpoint_io.load_latest(directory, weights_only) if runtime.is_master() else None
    payload = collectives.broadcast_object(payload, root=0)
    if payload is None:
        return None
    state.model.load_state_dict(payload["model"])
    state.optimizer.load_state_dict(payload["optimizer"])
    state.loader.load_state_dict(payload["loader"])
    state.epoch, state.step, state.global_step = payload["epoch"], payload["step"], payload["global_step"]
    state.history = History.from_state_dict(payload["history"])
    state.scheduled_lrs = list(payload["scheduled_lrs"])
    _restore_running_metrics(state, payload["running_metrics"])
    if state.exact is not None and payload["exact"] is not None:
        state.exact.load_state_dict(payload["exact"])
    _restore_rng(payload, state)
    return payload


def _restore_running_metrics(state: TrainState, sums: list[list[float]]) -> None:
    """The global sums of a part-finished epoch go to rank 0 only, so the next reduction is exact."""
    for metric, (total, count) in zip(state.metrics, sums or [[0.0, 0.0]] * len(state.metrics)):
        metric.total, metric.count = (total, count) if runtime.is_master() else (0.0, 0.0)


def _restore_rng(payload: dict[str, Any], state: TrainState) -> None:
    if payload["world_size"] == runtime.size():
        torch.set_rng_state(payload["rng"][runtime.rank()])
    else:
        torch.manual_seed(mix_seed(state.seed, state.global_step, runtime.rank()))
