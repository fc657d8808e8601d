"""Search spaces in phalanx's and Comet's formats, JSON and YAML; bad files fail before any trial."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from phalanx.errors import ConfigurationError
from phalanx.tune import space as spaces

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
