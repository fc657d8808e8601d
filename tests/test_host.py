"""What the host offers: usable cores, the cost of more processes, and room for their open files."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from phalanx import host
from phalanx.cli.main import main
from phalanx.host import oversubscription, usable_cores


def test_more_processes_than_cores_are_costed_and_a_core_each_is_not() -> None:
    assert usable_cores() >= 1
    assert oversubscription(2, 2) is None
    assert oversubscription(1000, 2) == "1000 processes on 2 cores: each runs about 500.0x slower than on a core of its own"


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Open-file limits faked at (100, 1000); what ``setrlimit`` was asked lands in the list."""
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (100, 1000))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limit: asked.append(limit))
    return asked


def test_the_open_file_limit_is_raised_for_many_workers_up_to_the_hard_limit(limits: list) -> None:
    host.ensure_open_files(200)
    assert limits == [(864, 1000)]
    host.ensure_open_files(5)  # 84 files fit in the soft limit already
    assert limits == [(864, 1000)]


def test_more_workers_than_the_hard_limit_holds_are_refused_before_any_starts(
        limits: list, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not start')\n")
    assert main(["run", "-n", "300", str(script)]) == 2
    error = capsys.readouterr().err
    assert "300 processes need about 1264 open files here, and this shell allows at most 1000" in error
    assert limits == [] and "must not start" not in error
