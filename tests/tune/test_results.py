"""What a search leaves in its directory survives a write cut off midway."""

from __future__ import annotations

from pathlib import Path

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
