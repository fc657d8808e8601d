"""Checkpoints: written atomically by rank 0, read with ``weights_only=True``, resumed from the
newest one that loads.

A checkpoint is one ``torch.save`` file named ``checkpoint-<global step>.pt``, written by
:func:`phalanx.atomic.save_atomically` (temporary file, fsync, rename), so a crash mid-write never
leaves a truncated file under a checkpoint's name, and the next save removes the temporary file
such a crash left. Loading skips (with a warning) any newest file that is corrupt, and falls back
to the one before; pruning counts only the files that load, so the newest readable one is never
deleted.

A checkpoint of sharded training also has a folder of pieces beside the file
(``checkpoint-<step>.pieces``, torch.distributed.checkpoint's format), which every rank wrote
before rank 0 wrote the file that names it: a file whose pieces are missing is damaged, pruning
and setting aside take the folder with its file, and a save removes the pieces a crash left half
written.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from phalanx.errors import CheckpointError, ConfigurationError

_NAME = re.compile(r"checkpoint-(\d+)\.pt$")
#: The glob of every checkpoint's name: a save removes the stale temporary files of all of them.
KIND = "checkpoint-*.pt"


def checkpoint_path(directory: str | os.PathLike, global_step: int) -> Path:
    return Path(directory) / f"checkpoint-{global_step:09d}.pt"


def pieces_path(path: Path) -> Path:
    """The folder of pieces that belongs to the checkpoint file ``path``."""
    return path.with_suffix(".pieces")


def new_pieces_folder(path: Path) -> Path:
    """A new, empty folder for the pieces of checkpoint ``path``, after removing the half-written ones
    a crash left (only one save writes into a folder at a time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob("checkpoint-*.pieces-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{path.stem}.pieces-", dir=path.parent))


def put_pieces(folder: Path, path: Path) -> None:
    """Give the written ``folder`` of pieces the name that checkpoint ``path`` will refer to."""
    final = pieces_path(path)
    if final.exists():  # another run's, set aside or pruned already: a leftover
        shutil.rmtree(final)
    os.replace(folder, final)


def step_of(path: Path) -> int:
    """The global step in a checkpoint's file name."""
    return int(_NAME.search(path.name).group(1))  # type: ignore[union-attr]


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in ``directory``, newest (highest step) first."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.search(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def load(path: str | os.PathLike, weights_only: bool = True, mmap: bool = False) -> dict[str, Any]:
    """Read one checkpoint; raise :class:`CheckpointError` saying why it cannot be used.

    ``mmap=True`` maps the tensors instead of reading them: a cheap check that the file loads.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except Exception as error:  # torch raises many types for damaged files
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(error).__name__}: {error}).") from error
    if not isinstance(payload, dict) or "model" not in payload:
        raise CheckpointError(f"checkpoint {path} is not a phalanx checkpoint (no 'model' entry).")
    if payload.get("pieces") and not (Path(path).parent / payload["pieces"] / ".metadata").exists():
        raise CheckpointError(f"checkpoint {path} names its weights' pieces {payload['pieces']}, which are missing or "
                              "incomplete beside it.")
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


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Keep the ``keep`` newest checkpoints that load and delete the ones older than those; return them.

    A damaged file among the kept ones does not count as kept: it is left in place, with a warning,
    until enough readable newer ones push it out. So the newest readable checkpoint survives.
    """
    if keep < 1:
        raise ConfigurationError(f"keep={keep}: keep at least the newest checkpoint (keep >= 1).")
    kept, deleted = 0, []
    for path in list_checkpoints(directory):
        if kept >= keep:
            path.unlink(missing_ok=True)
            shutil.rmtree(pieces_path(path), ignore_errors=True)
            deleted.append(path)
        elif _loads(path):
            kept += 1
    return deleted


def _loads(path: Path) -> bool:
    """Whether ``path`` loads; a warning says why not."""
    try:
        load(path, mmap=True)
    except CheckpointError as error:
        warnings.warn(f"phalanx: not counting a damaged checkpoint among the kept ones, leaving it. {error}",
                      stacklevel=3)
        return False
    return True
