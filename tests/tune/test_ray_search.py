"""``phalanx tune --on ray``: the same search on a local Ray cluster, interrupted and resumed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tune.test_search import HERE, rows, tune_command, write_space
from tests import warm

SPACE = {"lr": {"type": "float", "low": 0.005, "high": 0.02, "log": True}}


@pytest.mark.timeout(480)  # its own bounds: 60 s for the interrupted search, 400 for the resumed one
def test_a_search_on_ray_runs_two_trials_at_a_time_resumes_and_writes_its_results(
        ray_cluster: dict[str, str], tmp_path: Path) -> None:
    """(A trial on Ray is pruned by the same px.tune report and the same settling as a local one,
    tests/tune/test_search.py; the median pruner needs two completed trials first, a third Ray trial
    of about 25 s here, so this test stops at two.)"""
    space = write_space(tmp_path, SPACE)
    command = tune_command("--on", "ray", "-j", "2", "--space", space, "--trials", "2", "--metric", "val_loss",
                           "--seed", "0", str(HERE / "fit_trial.py"), "4")  # only a trial 4 would learn nothing
    # Interrupted (Ctrl-C) once its first two trials started on the cluster...
    first = warm.Popen(command, cwd=tmp_path, env=ray_cluster, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in first.stdout:
        seen.append(line)
        if line.startswith("trial 1 started"):
            break
    first.send_signal(signal.SIGINT)
    rest, _ = first.communicate(timeout=60)
    assert "trial 0 started" in "".join(seen), "".join(seen) + rest
    assert first.returncode == 130 and "stopped; run the same command again" in rest, "".join(seen) + rest
    assert "complete" not in rest and "pruned" not in rest, rest  # nothing settled after Ctrl-C
    # ...and started again: trials 0 and 1 run again as 2 and 3, at once; the study ends with 2.
    again = warm.run(command, cwd=tmp_path, env=ray_cluster, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "were interrupted; their parameters run again" in again.stdout, again.stdout
    assert "on Ray at" in again.stdout
    directory = tmp_path / "tune-fit_trial"
    table = rows(directory)
    assert [row["number"] for row in table] == ["2", "3"], table
    assert [row["state"] for row in table] == ["COMPLETE"] * 2, table
    for path in ("metric_vs_lr.png", "runtime.png", "learning_curves.png"):
        assert (directory / path).stat().st_size > 0, path
    log = Path(table[1]["log"]).read_text()
    assert int(log.split("epochs trained")[1].split()[0]) == 5, log
    assert not any(name.startswith("ray") for name in os.listdir(tmp_path) if name != "tune-fit_trial"), \
        os.listdir(tmp_path)


def test_on_ray_without_ray_installed_says_what_to_install(tmp_path: Path) -> None:
    space = write_space(tmp_path, SPACE)
    hidden = ("import sys; sys.modules['ray'] = None\n"  # what an environment without Ray looks like to an import
              "from phalanx.cli.main import main; raise SystemExit(main())")
    done = subprocess.run([sys.executable, "-c", hidden, "tune", "--on", "ray", "--space", space, "--trials", "1",
                           str(HERE / "fit_trial.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--on ray needs Ray Train and Tune" in done.stderr and "pip install 'phalanx[ray]'" in done.stderr
    assert not (tmp_path / "tune-fit_trial").exists()  # refused before the study was made
