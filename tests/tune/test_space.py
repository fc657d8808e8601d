"""Search spaces in phalanx's and Comet's formats, JSON and YAML; bad files fail before any trial."""

from __future__ import annotations

import collections
import json
import math
import statistics
from pathlib import Path

import optuna
import pytest

from phalanx.errors import ConfigurationError
from phalanx.tune import space as spaces
from phalanx.tune import study as studies

ISSUE_SPACE = {"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True},
               "batch_size": {"type": "categorical", "values": [8, 32, 128, 512]},
               "depth": {"type": "int", "low": 1, "high": 4}}
COMET = {"algorithm": "random",
         "parameters": {"batch_size": {"type": "discrete", "values": [8, 32, 128]},
                        "lr": {"type": "float", "min": 0.001, "max": 0.1, "scalingType": "loguniform"},
                        "layers": {"type": "integer", "min": 1, "max": 3}},
         "spec": {"metric": "val_loss", "objective": "minimize"}}


def test_phalanx_format_in_json_and_yaml(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text(json.dumps(ISSUE_SPACE))
    (tmp_path / "s.yaml").write_text("lr: {type: float, low: 0.0001, high: 0.1, log: true}\n"
                                     "batch_size: {type: categorical, values: [8, 32, 128, 512]}\n"
                                     "depth: {type: int, low: 1, high: 4}\n")
    from_json, from_yaml = spaces.load(tmp_path / "s.json"), spaces.load(tmp_path / "s.yaml")
    assert from_json.parameters == from_yaml.parameters
    assert from_json.names == ("lr", "batch_size", "depth") and from_json.metric is None
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    values = from_json.suggest(study.ask())
    assert 1e-4 <= values["lr"] <= 0.1 and values["batch_size"] in (8, 32, 128, 512) and values["depth"] in range(1, 5)


def test_comet_optimizer_file_as_it_is() -> None:
    space = spaces.parse(COMET)
    assert (space.metric, space.direction, space.sampler) == ("val_loss", "minimize", "random")
    kinds = {p.name: (p.kind, p.low, p.high, p.log, p.values) for p in space.parameters}
    assert kinds == {"batch_size": ("categorical", None, None, False, (8, 32, 128)),
                     "lr": ("float", 0.001, 0.1, True, ()), "layers": ("int", 1.0, 3.0, False, ())}
    assert spaces.parse({**COMET, "algorithm": "bayes"}).sampler == "tpe"


def test_comet_grid_sizes_build_optunas_grid_and_max_combo_caps_the_trials() -> None:
    space = spaces.parse({"algorithm": "grid", "spec": {"gridSize": 3, "maxCombo": 20, "metric": "loss",
                                                        "minSampleSize": 100, "retryLimit": 20, "retryAssignLimit": 0},
                          "parameters": {"lr": {"type": "float", "min": 0.001, "max": 0.1, "scalingType": "loguniform"},
                                         "dropout": {"type": "double", "min": 0.0, "max": 0.5, "gridSize": 2},
                                         "layers": {"type": "integer", "min": 1, "max": 10, "scalingType": "linear"},
                                         "width": {"type": "integer", "min": 1, "max": 3, "gridSize": 5},
                                         "batch": {"type": "discrete", "values": [16, 64]}}})
    space.check("grid")
    grid = space.grid()
    assert grid["lr"] == pytest.approx([0.001, 0.01, 0.1]) and grid["dropout"] == [0.0, 0.5]
    assert grid["layers"] == [1, 6, 10] and grid["width"] == [1, 2, 3] and grid["batch"] == [16, 64]
    assert space.trials(None, "grid") == (20, "spec.maxCombo is 20")  # of 3 * 2 * 3 * 3 * 2 = 108
    assert space.trials(8, "grid") == (8, "--trials 8")
    without_cap = spaces.parse({"algorithm": "grid", "parameters": {"x": {"type": "float", "min": 0, "max": 1}}})
    assert without_cap.grid()["x"] == pytest.approx([k / 9 for k in range(10)])  # Comet's default gridSize, 10
    assert without_cap.trials(None, "grid") == (10, "the grid has 10 combination(s)")
    study = optuna.create_study(sampler=studies.sampler(_search(space, "grid")))
    seen = {tuple(space.suggest(study.ask()).values()) for _ in range(108)}
    assert len(seen) == 108 and {values[0] for values in seen} == set(grid["lr"])


def _search(space: spaces.Space, sampler: str, seed: int | None = 0) -> studies.Search:
    return studies.Search(space=space, storage="", name="s", trials=1, metric="loss", direction="minimize",
                          sampler=sampler, pruner="none", seed=seed)


def test_comet_normal_and_lognormal_are_drawn_from_their_distributions() -> None:
    space = spaces.parse({"algorithm": "random", "parameters": {
        "momentum": {"type": "float", "min": -10, "max": 10, "scalingType": "normal", "mu": 0.9, "sigma": 0.05},
        "lr": {"type": "float", "min": 1e-6, "max": 1.0, "scalingType": "lognormal", "mu": math.log(1e-3),
               "sigma": 0.5},
        "width": {"type": "integer", "min": 1, "max": 1000, "scalingType": "lognormal", "mu": math.log(40),
                  "sigma": 0.25},
        "depth": {"type": "integer", "min": 2, "max": 4, "scalingType": "normal", "mu": 2, "sigma": 10}}})
    space.check("random")
    study = optuna.create_study(sampler=studies.sampler(_search(space, "random", seed=3)))
    draws = [space.suggest(study.ask()) for _ in range(2000)]
    momentum = [d["momentum"] for d in draws]
    assert statistics.mean(momentum) == pytest.approx(0.9, abs=0.01)
    assert statistics.stdev(momentum) == pytest.approx(0.05, rel=0.1)  # uniform on [-10, 10] would be 5.8
    logs = [math.log(d["lr"]) for d in draws]
    assert statistics.mean(logs) == pytest.approx(math.log(1e-3), abs=0.05)
    assert statistics.stdev(logs) == pytest.approx(0.5, rel=0.1)
    widths = [d["width"] for d in draws]  # quantized: whole numbers around exp(mu)
    assert all(isinstance(w, int) for w in widths) and statistics.median(widths) == pytest.approx(40, abs=2)
    depths = collections.Counter(d["depth"] for d in draws)  # a wide prior cut to 1.5..4.5: nearly uniform
    assert set(depths) == {2, 3, 4} and min(depths.values()) > 550
    recorded = study.trials[0].distributions
    assert recorded["lr"].log and not recorded["momentum"].log and recorded["width"].log
    again = optuna.create_study(sampler=studies.sampler(_search(space, "random", seed=3)))
    assert [space.suggest(again.ask()) for _ in range(5)] == draws[:5]  # seeded by the seed and the trial's number


def test_comet_keys_that_would_change_meaning_are_refused_by_name() -> None:
    grid = {"algorithm": "grid", "parameters": {"x": {"type": "float", "min": 0, "max": 1, "gridSize": 4}}}
    for sampler in ("random", "tpe"):
        with pytest.raises(ConfigurationError, match="parameters.x.gridSize sets a grid, but the sampler is"):
            spaces.parse(grid).check(sampler)
    with pytest.raises(ConfigurationError, match="spec.gridSize sets a grid"):
        spaces.parse({"spec": {"gridSize": 4}, "parameters": {"x": {"type": "float", "min": 0, "max": 1}}}).check(
            "random")
    normal = {"parameters": {"x": {"type": "float", "min": 0, "max": 1, "scalingType": "normal", "mu": 0.5,
                                   "sigma": 0.1}}}
    with pytest.raises(ConfigurationError, match="'x' has scalingType 'normal', which the random sampler draws"):
        spaces.parse({**normal, "algorithm": "bayes"}).check("tpe")
    with pytest.raises(ConfigurationError, match="grid search cannot draw 'x' from its normal distribution"):
        spaces.parse({**normal, "algorithm": "grid"}).check("grid")


def test_grid_values() -> None:
    space = spaces.parse({"a": {"type": "int", "low": 1, "high": 7, "step": 3},
                          "b": {"type": "float", "low": 0.0, "high": 1.0, "step": 0.5},
                          "c": {"type": "categorical", "values": ["x", "y"]}})
    assert space.grid() == {"a": [1, 4, 7], "b": [0.0, 0.5, 1.0], "c": ["x", "y"]}
    with pytest.raises(ConfigurationError, match="grid search needs finite values"):
        spaces.parse({"lr": {"type": "float", "low": 0.1, "high": 1.0}}).grid()


@pytest.mark.parametrize("document,message", [
    ([], "expected a mapping"),
    ({"lr": 0.1}, "must be a mapping"),
    ({"lr": {"type": "real", "low": 0, "high": 1}}, "type must be"),
    ({"lr": {"type": "float", "low": 1, "high": 0}}, "above high"),
    ({"lr": {"type": "float", "low": 0, "high": 1, "log": True}}, "log scale needs low > 0"),
    ({"lr": {"type": "float", "low": "a", "high": 1}}, "'low' must be a number"),
    ({"n": {"type": "int", "low": 0.5, "high": 2}}, "integer bounds"),
    ({"b": {"type": "categorical", "values": []}}, "non-empty list"),
    ({"lr": {"type": "float", "low": 0, "high": 1, "lower": 0}}, "unknown key"),
    ({"algorithm": "annealing", "parameters": {"a": {"type": "discrete", "values": [1]}}}, "algorithm"),
    ({"parameters": {"a": {"type": "cont", "min": 0, "max": 1}}}, "Comet type"),
    ({"parameters": {"a": {"type": "discrete", "values": [1]}}, "spec": {"objective": "up"}}, "objective"),
    ({"parameters": {"a": {"type": "float", "min": 0, "max": 1, "q": 0.1}}}, r"unknown key\(s\) \['q'\]"),
    ({"parameters": {"a": {"type": "discrete", "values": [1], "gridSize": 3}}}, r"unknown key\(s\) \['gridSize'\]"),
    ({"parameters": {"a": {"type": "discrete", "values": [1]}}, "spec": {"gridsize": 3}},
     r"spec has unknown key\(s\) \['gridsize'\]"),
    ({"parameters": {"a": {"type": "discrete", "values": [1]}}, "seed": 1}, r"unknown key\(s\) \['seed'\]"),
    ({"parameters": {"a": {"type": "discrete", "values": [1]}}, "trials": 3}, "'trials': 3 runs each combination"),
    ({"parameters": {"a": {"type": "discrete", "values": [1]}}, "spec": {"randomize": False}}, "spec.randomize"),
    ({"parameters": {"a": {"type": "discrete", "values": [1]}}, "spec": {"maxCombo": -1}}, "spec.maxCombo"),
    ({"parameters": {"a": {"type": "discrete", "values": [1]}}, "spec": {"gridSize": 1}}, "spec: gridSize"),
    ({"parameters": {"a": {"type": "float", "min": 0, "max": 1, "gridSize": 2.5}}}, "'a': gridSize"),
    ({"parameters": {"a": {"type": "float", "min": 0, "max": 1, "scalingType": "exponential"}}}, "scalingType"),
    ({"parameters": {"a": {"type": "float", "min": 0, "max": 1, "scalingType": "normal"}}}, "needs numbers 'mu'"),
    ({"parameters": {"a": {"type": "float", "min": 0, "max": 1, "scalingType": "normal", "mu": 0, "sigma": 0}}},
     "'sigma' must be a positive number"),
    ({"parameters": {"a": {"type": "float", "min": 0, "max": 1, "mu": 0, "sigma": 1}}}, "'mu' and 'sigma' go with"),
    ({"parameters": {"a": {"type": "float", "min": 100, "max": 101, "scalingType": "normal", "mu": 0, "sigma": 1}}},
     "keep almost none"),
    ({"parameters": {"a": {"type": "float", "min": 0, "max": 1, "scalingType": "lognormal", "mu": 0, "sigma": 1}}},
     "needs min > 0"),
    ({"parameters": {"a": {"type": "integer", "min": 3, "max": 1}}}, r"min \(3\) is above max \(1\)"),
    ({"parameters": {"a": {"type": "float", "min": "a", "max": 1}}}, "'min' must be a number"),
])
def test_bad_spaces_name_the_problem(document: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        spaces.parse(document)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read"):
        spaces.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigurationError, match="not valid JSON"):
        spaces.load(tmp_path / "bad.json")


def test_more_processes_than_cores_is_warned_with_its_cost() -> None:
    from phalanx.tune.runner import warn_oversubscription

    said: list[str] = []
    warn_oversubscription(2, 2, 2, said.append)
    assert said and "4 processes on 2 cores" in said[0] and "2.0x slower" in said[0] and "-j 1" in said[0]
    said.clear()
    warn_oversubscription(2, 1, 2, said.append)
    assert said == []
