"""``phalanx tune`` end to end: trials as phalanx run jobs, results, continuing, sharing, pruning."""

from __future__ import annotations

import ast
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from phalanx.tune.storage import journal_url, load_study
from phalanx.tune.study import INTERRUPTED_ATTR, counted, unreported_metric
from phalanx.tune.trial import CURVE_ATTR
from tests.cli.test_launcher import worker_env
from tests import warm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="launcher tests run on Linux")

HERE = Path(__file__).parent
SPACE = {"x": {"type": "float", "low": -5, "high": 5}, "y": {"type": "categorical", "values": [0, 1, 10]}}


def tune_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", "tune", *args]


def tune(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return warm.run(tune_command(*args), cwd=tmp_path, env=env or worker_env(), capture_output=True, text=True,
                    timeout=timeout)


def write_space(tmp_path: Path, space: dict = SPACE, name: str = "space.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(space))
    return str(path)


def rows(directory: Path) -> list[dict[str, str]]:
    with open(directory / "trials.csv") as table:
        return list(csv.DictReader(table))


COMET_GRID = {"algorithm": "grid", "spec": {"metric": "loss", "objective": "minimize", "gridSize": 3, "maxCombo": 4},
              "parameters": {"x": {"type": "float", "min": 0, "max": 4}, "y": {"type": "discrete", "values": [0, 1, 10]}}}


def test_trials_of_a_comet_grid_run_two_at_a_time_up_to_max_combo_and_leave_results(tmp_path: Path) -> None:
    space = write_space(tmp_path, COMET_GRID, "comet.json")
    done = tune(tmp_path, "-j", "2", "--space", space, "--seed", "1", "--pruner", "none", str(HERE / "objective.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "phalanx tune: 4 trials: spec.maxCombo is 4" in done.stdout
    directory = tmp_path / "tune-objective"
    table = rows(directory)
    assert [row["number"] for row in table] == ["0", "1", "2", "3"] and {row["state"] for row in table} == {"COMPLETE"}
    combinations = {(float(row["x"]), int(row["y"])) for row in table}
    assert len(combinations) == 4 and {x for x, _ in combinations} <= {0.0, 2.0, 4.0}  # 3 values, min to max
    for row in table:  # the value is the last report of the trial's own parameters
        assert float(row["value"]) == pytest.approx((float(row["x"]) - 2) ** 2 + int(row["y"]) + 1 / 3)
        assert Path(row["log"]).read_text().startswith("[0] objective")
    best = min(table, key=lambda row: float(row["value"]))
    assert f"best trial {best['number']}: loss" in done.stdout
    for plot in ("metric_vs_x.png", "metric_vs_y.png", "runtime.png", "learning_curves.png"):
        assert (directory / plot).stat().st_size > 1000, plot
    again = tune(tmp_path, "--report", str(directory))
    assert again.returncode == 0 and f"best trial {best['number']}" in again.stdout


def test_a_crashing_trial_is_failed_with_its_error_and_the_search_goes_on(tmp_path: Path) -> None:
    space = write_space(tmp_path, {"x": {"type": "float", "low": 0, "high": 1},
                                   "crash": {"type": "categorical", "values": [0, 1]}})
    done = tune(tmp_path, "--space", space, "--trials", "4", "--metric", "loss", "--sampler", "grid",
                "--pruner", "none", "--study-dir", "out", str(HERE / "objective.py"))
    assert done.returncode == 2 and "grid search needs finite values" in done.stderr  # checked before any trial
    assert not (tmp_path / "out").exists()
    space = write_space(tmp_path, {"crash": {"type": "categorical", "values": [0, 1]}})
    done = tune(tmp_path, "--space", space, "--trials", "2", "--metric", "loss", "--sampler", "grid",
                "--study-dir", "out", str(HERE / "objective.py"))
    assert done.returncode == 0, done.stderr
    table = {row["crash"]: row for row in rows(tmp_path / "out")}
    assert table["0"]["state"] == "COMPLETE"
    assert table["1"]["state"] == "FAIL" and table["1"]["error"] == "exit code 1"
    study = load_study(journal_url(tmp_path / "out"), "objective")
    failed = [t for t in study.trials if t.state.name == "FAIL"][0]
    assert "this trial crashes on purpose" in failed.system_attrs["phalanx_error"]


def test_a_killed_search_started_again_completes_exactly_t_trials(tmp_path: Path) -> None:
    space = write_space(tmp_path)
    command = tune_command("--space", space, "--trials", "2", "--metric", "loss", "--pruner", "none",
                           str(HERE / "objective.py"))
    env = worker_env(OBJECTIVE_SLEEP="0.4")
    search = warm.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)
    seen = []
    for line in search.stdout:
        seen.append(line)
        if line.startswith("trial 1 started"):
            break
    time.sleep(1.0)  # trial 1 is running
    os.kill(search.pid, signal.SIGKILL)
    search.wait()
    done = warm.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trial(s) [1] were interrupted" in done.stdout, done.stdout
    study = load_study(journal_url(tmp_path / "tune-objective"), "objective")
    finished = counted(study)
    assert len(finished) == 2 and all(t.state.name == "COMPLETE" for t in finished)
    interrupted = [t for t in study.trials if t.system_attrs.get(INTERRUPTED_ATTR)]
    assert [t.number for t in interrupted] == [1]
    params = [tuple(sorted(t.params.items())) for t in finished]
    assert len(set(params)) == 2 and params.count(tuple(sorted(interrupted[0].params.items()))) == 1
    assert len(rows(tmp_path / "tune-objective")) == 2


def test_two_searches_share_one_study(tmp_path: Path) -> None:
    space = write_space(tmp_path)
    storage = journal_url(tmp_path / "shared")
    env = worker_env(OBJECTIVE_SLEEP="0.15")
    searches = [warm.Popen(tune_command("--space", space, "--trials", "4", "--metric", "loss", "--pruner", "none",
                                        "--storage", storage, "--study-dir", f"host{k}",
                                        str(HERE / "objective.py")),
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for k in range(2)]
    outputs = [search.communicate(timeout=180)[0] for search in searches]
    assert [search.returncode for search in searches] == [0, 0], outputs
    study = load_study(storage, "objective")
    finished = counted(study)
    assert len(finished) == 4
    assert all(sum(f"trial {t.number} complete" in out for out in outputs) == 1 for t in finished)
    assert all("trial" in out and "started" in out for out in outputs)  # both ran trials


def test_a_trial_bad_from_the_start_is_pruned_before_its_last_epoch(tmp_path: Path) -> None:
    space = write_space(tmp_path, {"lr": {"type": "float", "low": 0.005, "high": 0.02, "log": True}})
    done = tune(tmp_path, "--space", space, "--trials", "3", "--metric", "val_loss", str(HERE / "fit_trial.py"),
                timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    table = rows(tmp_path / "tune-fit_trial")
    assert [row["state"] for row in table] == ["COMPLETE", "COMPLETE", "PRUNED"], table
    log = Path(table[2]["log"]).read_text()
    trained = int(log.split("epochs trained")[1].split()[0])
    assert trained < 5, log


def test_a_metric_no_trial_reports_stops_the_search_early_and_names_what_they_reported(tmp_path: Path) -> None:
    space = write_space(tmp_path)
    done = tune(tmp_path, "-j", "2", "--space", space, "--trials", "8", "--metric", "los", "--pruner", "none",
                str(HERE / "objective.py"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "phalanx tune: error: no trial reported --metric 'los'; they reported loss" in done.stderr.splitlines()[-1]
    assert "stopping: 3 trials ended without reporting 'los'" in done.stdout
    table = rows(tmp_path / "tune-objective")  # the first 3 to end, and the one running beside the third
    assert 3 <= len(table) <= 4 and {row["state"] for row in table} == {"FAIL"}, table


def test_the_search_fails_only_when_no_trial_reported_its_metric() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    assert unreported_metric(study, "loss") is None  # nothing ran (a --timeout, say)
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL))
    assert "nor any other metric" in unreported_metric(study, "loss")
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL,
                                              user_attrs={CURVE_ATTR: {"1": {"val_loss": 0.5, "accuracy": 0.7}}}))
    assert "they reported accuracy, val_loss." in unreported_metric(study, "loss")
    study.add_trial(optuna.trial.create_trial(value=0.5, user_attrs={CURVE_ATTR: {"1": {"loss": 0.5}}}))
    assert unreported_metric(study, "loss") is None


WARM_TRIAL = """\
import os, sys
def ancestry(pid, levels):  # the command lines of this process and its parents
    lines = []
    for _ in range(levels):
        lines.append(open(f"/proc/{pid}/cmdline").read().split("\\0"))
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    return lines
start = {"dynamo": "torch._dynamo" in sys.modules, "ancestry": ancestry(os.getpid(), 5)}
import phalanx as px
px.tune.params(x=0.0)
print("START", start, flush=True)
px.tune.report(1, loss=1.0)
"""


def test_trials_start_warm_forked_from_the_search_without_importing_torch_again(tmp_path: Path) -> None:
    (tmp_path / "warm.py").write_text(WARM_TRIAL)
    space = write_space(tmp_path, {"x": {"type": "float", "low": 0, "high": 1}})
    # started from a shell, as a user starts it (the other tests fork theirs warm: tests/warm.py)
    done = subprocess.run(tune_command("-j", "2", "--space", space, "--trials", "3", "--metric", "loss", "--pruner",
                                       "none", str(tmp_path / "warm.py")),
                          cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    for row in rows(tmp_path / "tune-warm"):
        line = next(line for line in Path(row["log"]).read_text().splitlines() if "START" in line)
        start = ast.literal_eval(line.split("START ", 1)[1])
        # worker <- its launch's server <- its launcher <- the search's server: forked, never a fresh python
        # (all four show that server's command line; the search forks it from itself where it can)
        worker, server, launcher, search_server, above = start["ancestry"]
        assert worker == server == launcher == search_server, start["ancestry"]
        assert ["phalanx", "tune"] in (search_server[2:4], above[2:4]), start["ancestry"]
        assert start["dynamo"], start  # and it found TorchDynamo loaded
