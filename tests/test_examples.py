"""The bundled examples run end to end under `phalanx run` and learn."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script, args", [("digits.py", ["--epochs", "3"]), ("custom_loop.py", [])])
def test_example_trains_on_two_workers(script: str, args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(EXAMPLES / script), *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    accuracy = float(re.search(r"validation accuracy.*: ([\d.]+)%", done.stdout).group(1))
    assert accuracy > 85, done.stdout
