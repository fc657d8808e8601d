"""`phalanx doctor` end to end on a problem whose noise scale is known exactly, and on a script too short."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import phalanx as px
from tests.doctor import linear_regression as problem
from tests import warm

SCRIPT = Path(problem.__file__)


def exact_noise_scale() -> float:
    """tr(Σ)/|G|² of the per-sample gradients of the whole dataset at the script's weights."""
    x, y = problem.dataset()
    gradients = 2 * (x @ torch.full((problem.FEATURES,), problem.WEIGHT) - y[:, 0])[:, None] * x
    mean = gradients.mean(0)
    return float(((gradients - mean) ** 2).sum(1).mean() / mean.dot(mean))


def test_doctor_reports_json_trace_plot_and_the_noise_scale_within_a_factor_two(tmp_path: Path) -> None:
    trace, plot = tmp_path / "trace.json", tmp_path / "scaling.png"
    done = warm.run([sys.executable, "-m", "phalanx", "doctor", "-n", "2", "--steps", "30", "--warmup", "2",
                     "--json", "--trace", str(trace), "--plot", str(plot), "--bandwidth", "1", str(SCRIPT)],
                    capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    measured = found["measured"]
    assert measured["world_size"] == 2 and measured["global_batch"] == 64 and measured["step_s"] > 0
    assert measured["compute_s"] > 0 and measured["bytes_per_step"] > 0 and found["reference"]["world_size"] == 1
    rows = {(p["world_size"], p["bandwidth_gbit"]) for p in found["predicted"] + found["not_predicted"]}
    predicted = {(p["world_size"], p["bandwidth_gbit"]) for p in found["predicted"]}
    assert rows >= {(1, None), (3, None), (1024, 1.0)}
    busy = any("the host was busy" in p["reason"] for p in found["not_predicted"])  # then nothing is predicted
    assert busy != ({(1, None), (2, None)} <= predicted) and plot.exists() == bool(predicted)
    truth = exact_noise_scale()
    assert truth / 2 <= found["noise_scale"]["b_simple"] <= 2 * truth, (found["noise_scale"], truth)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X" and e["name"] == "backward"} == {0, 1}
    assert busy or plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    memory = found["memory"]  # a worker's tensors: 8 weights, SGD's momentum, 32 samples a forward
    held, weights = memory["measured"], 4 * problem.FEATURES
    assert (held["parameters_bytes"], held["optimizer_state_bytes"], held["level"]) == (weights, weights, 0)
    bucket = weights + 4 * (1 + 1)  # and the bucket's trailer: a flag per parameter, the sample count
    assert held["gradients_bytes"] == held["step_gradients_bytes"] == bucket and held["activation_samples"] == 32
    batch = 32 * weights  # the forward saves its input batch, and the loss its output and target (32 each)
    assert batch <= held["activations_bytes"] <= batch + 2 * 32 * 4 + 16, held
    assert held["copies_bytes"] == 2 * weights and held["copies_if_elastic"]
    rows = {(row["world_size"], row["workers_per_host"]): row for row in memory["predicted"]}
    assert rows[(1, 1)]["activations_bytes"] == pytest.approx(2 * rows[(2, 2)]["activations_bytes"])
    assert memory["recommended_level"] == 0 and rows[(2, 2)]["lowest_fitting_level"] == 0


def test_a_script_shorter_than_the_measured_steps_is_refused_with_what_to_do(tmp_path: Path) -> None:
    script = tmp_path / "short.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn.functional as F, phalanx as px
        px.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        px.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, (torch.randn(64, 4), torch.randn(64, 1)),
               epochs=1, global_batch_size=16, verbose=0)
    """))
    with pytest.raises(px.ConfigurationError, match="ended before 2 warm-up and 10 measured steps"):
        px.diagnose(str(script), workers=2, steps=10, warmup=2, timeout_s=60)


def test_a_script_that_makes_no_steps_is_stopped_at_the_deadline(tmp_path: Path) -> None:
    script = tmp_path / "stuck.py"
    script.write_text("import time\nimport phalanx as px\npx.init()\ntime.sleep(120)\n")
    with pytest.raises(px.WorkerFailedError, match="0 of 25 optimizer steps after 3 s; stopping the script"):
        px.diagnose(str(script), workers=2, steps=20, warmup=5, timeout_s=3)


def test_a_script_that_trains_through_ray_is_refused_with_what_to_run_instead(ray_cluster: dict[str, str],
                                                                             tmp_path: Path) -> None:
    driver = tmp_path / "ray_driver.py"
    driver.write_text("import ray\nray.init(log_to_driver=False)\nprint('a TorchTrainer would train here')\n")
    done = warm.run([sys.executable, "-m", "phalanx", "doctor", "-n", "1", str(driver)], cwd=tmp_path,
                    env=ray_cluster, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the script trains through Ray" in done.stderr and "docs/ray.md" in done.stderr, done.stderr
