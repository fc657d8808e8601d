"""The bundled examples, README's first example and `make demo` run end to end and learn."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests import warm

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def accuracy(output: str) -> float:
    """The validation accuracy a script printed, in percent."""
    return float(re.search(r"validation accuracy.*: ([\d.]+)%", output).group(1))


def test_custom_loop_trains_on_two_workers(tmp_path: Path) -> None:
    done = warm.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(EXAMPLES / "custom_loop.py")],
                    capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert accuracy(done.stdout) > 90, done.stdout


def test_the_open_loop_example_reaches_its_accuracy_on_two_workers(tmp_path: Path) -> None:
    """A DataLoader, two optimizers, bf16, clipping, OneCycleLR and a step of its own, together."""
    done = warm.run([sys.executable, "-m", "phalanx", "run", "-n", "2", str(EXAMPLES / "open_loop.py")],
                    capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert accuracy(done.stdout) >= 95, done.stdout


def _quickstart(folder: Path, workers: int, script: Path = EXAMPLES / "quickstart.py", plain: bool = True) -> str:
    """The quickstart's output at 1 worker (a plain ``python``, as README runs it, unless not ``plain``)
    or more (``phalanx run``, forked warm), timings removed."""
    command = [sys.executable, str(script)] if workers == 1 and plain else \
        [sys.executable, "-m", "phalanx", "run", "-n", str(workers), "--no-prefix", str(script)]
    folder.mkdir()
    done = warm.run(command, capture_output=True, text=True, timeout=120, cwd=folder)
    assert done.returncode == 0, done.stdout + done.stderr
    return re.sub(r"  \([\d.]+s\)", "", done.stdout)


def _quickstarts(folder: Path, script: Path = EXAMPLES / "quickstart.py") -> tuple[str, str]:
    """The quickstart at 1 and at 2 workers, at once (each mostly starts and waits), in ``folder``/1 and /2.
    The 2-worker launcher is forked from this thread: a warm fork server started by a thread that ends
    would die with it (the kernel's parent-death signal follows the thread that made the child)."""
    folder.mkdir()
    with ThreadPoolExecutor(1) as other:
        alone = other.submit(_quickstart, folder / "1", 1, script)
        pair = _quickstart(folder / "2", 2, script)
        return alone.result(), pair


def test_the_quickstart_prints_readmes_figures_at_one_and_two_workers_and_bitwise_when_reproducible(
        tmp_path: Path) -> None:
    """README's headline, checked: the same curve at 1 and 2 workers, the figures README quotes, and
    with README's one more line (reproducible=True) the same weights to the bit."""
    readme = (ROOT / "README.md").read_text()
    quoted = re.search(r"both print the same curve.*?\(`(epoch 9/9[^`]*)`\)\s+and\s+`(validation accuracy: [^`]*)`",
                       readme, re.S)
    assert quoted, "README no longer quotes the quickstart's last epoch and accuracy"
    alone, pair = _quickstarts(tmp_path / "default")
    curve = [line for line in alone.splitlines() if line.startswith("epoch ")]
    assert len(curve) == 10 and curve == [line for line in pair.splitlines() if line.startswith("epoch ")], pair
    for figure in quoted.groups():
        assert figure in alone and figure in pair, (figure, alone)
    assert (tmp_path / "default" / "1" / "runs" / "quickstart").is_dir()

    one_more = re.search(r"add\s+`(reproducible=True, micro_batch_size=\d+)`\s+to\s+`px.fit`", readme)
    assert one_more, "README no longer shows the reproducible variant"
    script = tmp_path / "reproducible.py"
    # two epochs show the bits agree as well as ten, in a fifth of the time
    script.write_text((EXAMPLES / "quickstart.py").read_text().replace("epochs=10,", f"epochs=2, {one_more[1]},"))
    weights = []
    for workers in (1, 2):  # both forked warm: README's plain python is the first part's
        _quickstart(tmp_path / f"reproducible-{workers}", workers, script, plain=False)
        newest = sorted((tmp_path / f"reproducible-{workers}" / "runs" / "quickstart").glob("checkpoint-*.pt"))[-1]
        weights.append(torch.load(newest, weights_only=True)["model"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


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
    assert f"resumed from {folder}/checkpoint-000000069.pt (global step 69, epoch 2 done)" in second.stdout
    assert "training was already complete (all 3 epochs, 0-2)" in second.stdout, second.stdout
    assert accuracy(second.stdout) == accuracy(first.stdout)


def test_the_sharded_example_trains_at_level_3_and_is_refused_unsharded(tmp_path: Path) -> None:
    """Four workers under the example's memory limit: unsharded Adam is refused naming the level that
    fits; level 3 trains (a quick look: 256 samples, four steps, the loss falls)."""
    script = str(EXAMPLES / "sharded_transformer.py")
    command = [sys.executable, "-m", "phalanx", "run", "-n", "4", "--no-prefix", script]
    refused = warm.run([*command, "--level", "0"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert refused.returncode != 0
    needed = re.search(r"px.DataParallel needs about ([\d.]+) GiB per worker .* max_memory_gb=0.02 .*: "
                       r"strategy=px.Sharded\(level=3\) holds ([\d.]+) GiB per worker at 4 workers", refused.stderr)
    assert needed and float(needed[1]) > 0.04 and float(needed[2]) < 0.02, refused.stderr
    done = warm.run([*command, "--samples", "256", "--epochs", "2"], capture_output=True, text=True, timeout=240,
                    cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    before, after, first, last = map(float, re.search(
        r"held-out loss ([\d.]+) before training -> ([\d.]+) after 2 epoch\(s\) "
        r"\(training loss ([\d.]+) in epoch 0 -> ([\d.]+) in epoch 1\)", done.stdout).groups())
    assert after < before and last < first, done.stdout
