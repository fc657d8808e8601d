"""Atomic writes: complete or absent, ordinary permissions, and the temporary files of dead writers removed."""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from phalanx import atomic

# A writer that stops inside torch.save, its temporary file created, until it is killed.
_STALLED_WRITER = textwrap.dedent("""
    import sys, time
    from phalanx.atomic import save_atomically

    class Stall:
        def __reduce__(self):
            print("writing", flush=True)
            time.sleep(600)

    save_atomically({"stall": Stall()}, sys.argv[1])
""")
AN_HOUR = 3600.0  # far longer than atomic.STALE_AFTER_S


def _age(path: Path, seconds: float) -> None:
    """Make ``path`` look untouched for ``seconds``."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture
def stalled_writer(tmp_path: Path):
    """A live process in the middle of writing ``state.pt``, and its temporary file."""
    writer = subprocess.Popen([sys.executable, "-c", _STALLED_WRITER, str(tmp_path / "state.pt")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"  # type: ignore[union-attr]
        (temporary,) = tmp_path.glob(".state.pt.*.tmp")
        yield writer, temporary
    finally:
        writer.kill()
        writer.communicate(timeout=30)


def test_a_dead_writers_temporary_file_goes_at_the_next_write_a_live_ones_stays(
        tmp_path: Path, stalled_writer: tuple[subprocess.Popen, Path], caplog: pytest.LogCaptureFixture) -> None:
    writer, temporary = stalled_writer
    _age(temporary, AN_HOUR)  # only its lock says that its writer lives
    other = tmp_path / ".elastic-last.pt.0123abcd.tmp"
    other.write_bytes(b"half")
    _age(other, AN_HOUR)

    atomic.save_atomically({"x": 2}, tmp_path / "state.pt")
    assert temporary.exists(), "the temporary file of a writer still at work was removed"

    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    _age(temporary, 2 * atomic.UNLOCKED_FOR_S)  # a restart seconds later: the lock, gone, says enough
    with caplog.at_level(logging.INFO, logger="phalanx.atomic"):
        atomic.save_atomically({"x": 3}, tmp_path / "state.pt")
    assert not temporary.exists(), "the temporary file of a killed writer outlived the next save"
    assert other.exists(), "a save removed a temporary file of another name"
    assert torch.load(tmp_path / "state.pt") == {"x": 3}
    assert f"removed {temporary}" in caplog.text


def test_a_recent_temporary_file_stays_and_the_same_name_is_the_default_kind(tmp_path: Path) -> None:
    recent, old = tmp_path / ".state.pt.00000001.tmp", tmp_path / ".state.pt.00000002.tmp"
    for path in (recent, old):
        path.write_bytes(b"half")
    _age(old, 2 * atomic.UNLOCKED_FOR_S)
    atomic.save_atomically({"x": 1}, tmp_path / "state.pt")
    assert _temporaries(tmp_path) == [recent.name]


def test_where_locks_do_not_work_only_an_old_temporary_file_goes(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic, "_try_lock", lambda handle: None)
    minutes, hour = tmp_path / ".state.pt.00000001.tmp", tmp_path / ".state.pt.00000002.tmp"
    for path, seconds in ((minutes, atomic.STALE_AFTER_S / 2), (hour, AN_HOUR)):
        path.write_bytes(b"half")
        _age(path, seconds)
    atomic.save_atomically({"x": 1}, tmp_path / "state.pt")
    assert _temporaries(tmp_path) == [minutes.name]


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = atomic.write_text_atomically(tmp_path / "trials.csv", "previous\n")

    def half_then_fail(handle) -> None:
        handle.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.write_atomically(path, half_then_fail)
    assert path.read_text() == "previous\n" and _temporaries(tmp_path) == []


def test_written_files_are_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    """Checkpoints and records may hold what another user of the host must not read (issue 30)."""
    mask = os.umask(0)
    try:
        path = atomic.save_atomically({"x": 1}, tmp_path / "checkpoint-000000001.pt")
    finally:
        os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
