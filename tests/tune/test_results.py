"""What a search leaves in its directory: whole after a write cut off midway; plots on the parameters' scales."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from phalanx.tune import results
from tests.disk_full import run_until_full


def test_trials_csv_cut_off_mid_write_leaves_the_previous_one_and_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "trials.csv").write_text("the previous results\n")
    done = run_until_full("""
        import sys
        from pathlib import Path
        import optuna
        from phalanx.tune import results

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study, between = optuna.create_study(), {"x": optuna.distributions.FloatDistribution(0, 30)}
        for number in range(200):
            study.add_trial(optuna.trial.create_trial(params={"x": number / 7}, distributions=between, value=number / 3))
        fill_up_at(4096)
        results.write(study, Path(sys.argv[1]), "loss")
    """, str(tmp_path))
    assert "File too large" in done.stderr, done.stderr[-2000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["trials.csv"]
    assert (tmp_path / "trials.csv").read_text() == "the previous results\n"


def test_a_parameter_sampled_on_a_log_scale_is_plotted_on_a_log_axis(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ranges = {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-2, log=True),  # a factor 10 only
              "dropout": optuna.distributions.FloatDistribution(0.001, 0.5),   # a factor 500, but linear
              "depth": optuna.distributions.IntDistribution(1, 64, log=True),
              "batch": optuna.distributions.CategoricalDistribution([8, 32, 128, 2048])}
    study = optuna.create_study()
    for k, values in enumerate([(1e-3, 0.001, 1, 8), (3e-3, 0.2, 8, 128), (1e-2, 0.5, 64, 2048)]):
        study.add_trial(optuna.trial.create_trial(params=dict(zip(ranges, values)), distributions=ranges, value=k))
    axes = {}
    monkeypatch.setattr(results, "_save", lambda figure, path: axes.setdefault(path.name, figure.axes[0]))
    results.write(study, tmp_path, "loss")
    assert axes["metric_vs_lr.png"].get_xscale() == "log" and axes["metric_vs_depth.png"].get_xscale() == "log"
    assert axes["metric_vs_dropout.png"].get_xscale() == "linear"
    batch = axes["metric_vs_batch.png"]  # categories, evenly spaced in their order
    assert batch.get_xscale() == "linear"
    assert [label.get_text() for label in batch.get_xticklabels()] == ["8", "32", "128", "2048"]
