"""The suite's own set-up: its header says how the phalanx under test is found, as its workers will find it."""

from __future__ import annotations

import importlib.metadata
import os

import pytest

import phalanx as px
from tests import conftest

SOURCE = os.path.dirname(os.path.dirname(px.__file__))


def test_the_header_names_phalanx_found_on_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", SOURCE + os.sep]))
    header = conftest.pytest_report_header(None)
    assert header == f"phalanx from {SOURCE}, on PYTHONPATH (the tests' workers find it there too)"


def test_the_header_says_when_the_workers_would_not_find_phalanx(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    header = conftest.pytest_report_header(None)
    assert header.startswith(f"phalanx from {SOURCE}: neither installed nor on PYTHONPATH"), header
    assert "pip install -e ." in header
