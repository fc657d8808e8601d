"""Checkpoints: written atomically by rank 0, read with ``weights_only=True``, resumed from the
newest one that loads.

A checkpoint is one ``torch.save`` file named ``checkpoint-<global step>.pt``, written by
:func:`phalanx.atomic.save_atomically` (temporary file, fsync, rename), so a crash mid-write never
leaves a truncated file under a checkpoint's name. Loading skips (with a warning)
any newest file that is corrupt, and falls back to the one before.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from phalanx.errors import CheckpointError

_NAME = re.compile(r"checkpoint-(\d+)\.pt$")


def checkpoint_path(directory: str | os.PathLike, global_step: int) -> Path:
    return Path(directory) / f"checkpoint-{global_step:09d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in ``directory``, newest (highest step) first."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.search(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """Read one checkpoint; raise :class:`CheckpointError` saying why it cannot be used."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as error:  # torch raises many types for damaged files
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(error).__name__}: {error}).") from error
    if not isinstance(payload, dict) or "model" not in payload:
        raise CheckpointError(f"checkpoint {path} is not a phalanx checkpoint (no 'model' entry).")
    return payload


def find_latest(directory: str | os.PathLike, weights_only: bool = True) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``directory`` that loads, with its path; ``None`` if there is none."""
    for path in list_checkpoints(directory):
        try:
            return path, load(path, weights_only)
        except CheckpointError as error:
            warnings.warn(f"phalanx: skipping a damaged checkpoint, trying the one before. {error}", stacklevel=2)
    return None


def load_latest(directory: str | os.PathLike, weights_only: bool = True) -> dict[str, Any] | None:
    """The newest checkpoint in ``directory`` that loads; ``None`` if there is none."""
    found = find_latest(directory, weights_only)
    return None if found is None else found[1]


def prune(directory: str | os.PathLike, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints."""
    for old in list_checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
