"""Writing a file so that it is either complete or absent, even across a crash.

It sits at the bottom beside ``errors.py`` because checkpoints (``train/``), the elastic state
(``elastic/``), the doctor's records and the tuner's results all write files this way, and none
of them may import the others.

A writer that dies mid-write (a SIGKILL, a power loss) leaves its temporary file behind. Every
write first removes the stale temporary files of its own kind (the same target name, or the
pattern of names it is given): those that no live writer holds locked and that nobody has
touched for :data:`UNLOCKED_FOR_S` seconds (which spares a writer between creating its file and
locking it). On file systems without locks, where another host may write the same folder, the
age alone decides: :data:`STALE_AFTER_S`.
"""

from __future__ import annotations

import glob
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, the age alone decides
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: Seconds an unlocked temporary file must have gone untouched before a later write removes it.
UNLOCKED_FOR_S = 2.0
#: The same where locks do not work, so that only the age can tell a dead writer from a live one.
STALE_AFTER_S = 60.0


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], Any], kind: str | None = None) -> Path:
    """Call ``write(handle)`` to fill ``path``: never a truncated file under that name; return the path.

    The data goes to a new owner-only (0600) temporary file in the same folder
    (``.<name>.<random>.tmp``, locked while it is written), is flushed to disk, and is renamed over
    ``path``; the folder is then flushed too, so the rename itself survives a power loss. The temporary file is removed when anything
    fails. ``kind`` is a glob of the target names whose stale temporary files this write removes
    first (default: ``path``'s own name), e.g. ``"checkpoint-*.pt"`` for every step's checkpoint.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path.parent, kind or glob.escape(path.name))
    temporary = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    handle = os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")  # owner-only
    try:
        with handle:
            _lock(handle)
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
            if fcntl is not None:  # renamed still locked: never taken for a dead writer's file
                os.replace(temporary, path)
        if fcntl is None:  # Windows renames closed files only
            os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def save_atomically(obj: Any, path: str | os.PathLike[str], kind: str | None = None) -> Path:
    """``torch.save`` ``obj`` to ``path`` through :func:`write_atomically`; return the path."""
    import torch  # here: the command line writes text through this module without loading PyTorch

    return write_atomically(path, lambda handle: torch.save(obj, handle), kind)


def write_text_atomically(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through :func:`write_atomically`; return the path."""
    return write_atomically(path, lambda handle: handle.write(text.encode()))


def _remove_stale_temporaries(folder: Path, kind: str) -> None:
    """Remove the temporary files of targets named like the glob ``kind`` in ``folder`` whose writer
    is gone (see the module's description), saying so at INFO."""
    for temporary in folder.glob(f".{kind}.*.tmp"):
        if _remove_if_stale(temporary):
            logger.info("phalanx: removed %s, left by a writer that stopped mid-write", temporary)


def _remove_if_stale(temporary: Path) -> bool:
    """Unlink ``temporary`` when no live writer holds it and it is old enough; whether it was."""
    try:
        age = time.time() - temporary.stat().st_mtime
        if age < UNLOCKED_FOR_S:
            return False
        with open(temporary, "rb+") as handle:  # writable: NFS locks exclusively only what it may write
            locked = _try_lock(handle)
            if locked is False or (locked is None and age < STALE_AFTER_S):
                return False
            temporary.unlink()
            return True
    except OSError:  # renamed by its writer, removed by another one, or not ours to open or remove
        return False


def _lock(handle: BinaryIO) -> None:
    """Hold ``handle``'s file locked until it is closed (nothing, where the file system has no locks)."""
    if fcntl is not None:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        except OSError:
            pass


def _try_lock(handle: BinaryIO) -> bool | None:
    """True when this process got ``handle``'s file locked (no writer holds it), False when another
    process holds it (its writer is alive), None where the file system has no locks."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


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
