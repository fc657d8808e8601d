"""The bundled examples, README's first example and `make demo` run end to end and learn."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def accuracy(output: str) -> float:
    """The validation accuracy a script printed, in percent."""
    return float(re.search(r"validation accuracy.*: ([\d.]+)%", output).group(1))


def test_custom_loop_trains_on_two_workers(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(EXAMPLES / "custom_loop.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert accuracy(done.stdout) > 90, done.stdout


def test_the_open_loop_example_reaches_its_accuracy_on_two_workers(tmp_path: Path) -> None:
    """A DataLoader, two optimizers, bf16, clipping, OneCycleLR and a step of its own, together."""
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(EXAMPLES / "open_loop.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert accuracy(done.stdout) >= 95, done.stdout


def test_the_quickstart_learns_digits_as_a_plain_python_script(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # on 2 workers: the same figure (make demo runs 2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert accuracy(done.stdout) > 90 and (tmp_path / "runs" / "quickstart").is_dir(), done.stdout


def test_readme_begins_with_the_quickstart_script_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert first == (EXAMPLES / "quickstart.py").read_text()


def test_make_demo_checkpoints_and_a_second_run_resumes(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    make = ["make", "-s", "-C", str(ROOT), "demo", "STAMP=", f"BIN={Path(sys.executable).parent}",
            f"DEMO_DIR={folder}", "DEMO_ARGS=--epochs 3"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    first = subprocess.run(make, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert accuracy(first.stdout) > 85 and f"checkpoints in {folder}/" in first.stdout, first.stdout
    assert sorted(path.name for path in folder.glob("checkpoint-*.pt"))[-1] == "checkpoint-000000069.pt"
    second = subprocess.run(make, capture_output=True, text=True, timeout=120, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resumed from {folder}/checkpoint-000000069.pt (epoch 3, step 69)" in second.stdout, second.stdout
    assert "training was already complete (3 of 3 epochs)" in second.stdout
    assert accuracy(second.stdout) == accuracy(first.stdout)
