"""Writing a ``torch.save`` file so that it is either complete or absent, even across a crash.

It sits at the bottom beside ``errors.py`` because both checkpoints (``train/``) and the elastic
state (``elastic/``) write files this way, and neither may import the other.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def save_atomically(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` ``obj`` to ``path``: never a truncated file under that name; return the path.

    The data goes to a temporary file in the same folder, is flushed to disk, and is renamed over
    ``path``; the folder is then flushed too, so the rename itself survives a power loss. The
    temporary file is removed when anything fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def _fsync_directory(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename); skipped where folders cannot be opened (Windows)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
