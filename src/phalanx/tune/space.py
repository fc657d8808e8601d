"""Search spaces: what ``phalanx tune --space FILE`` reads, checked before any trial starts.

Two formats, JSON or YAML:

* phalanx's: ``{"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": true},
  "batch_size": {"type": "categorical", "values": [8, 32]}, "depth": {"type": "int", "low": 1, "high": 4}}``
  (``int`` and ``float`` also take ``step``);
* Comet's optimizer file, as it is: ``{"algorithm": "random" | "grid" | "bayes", "parameters":
  {"batch_size": {"type": "discrete", "values": [...]}, "lr": {"type": "float", "min": ...,
  "max": ..., "scalingType": "loguniform"}}, "spec": {"metric": "val_loss", "objective": "minimize"}}``;
  its metric, objective and algorithm apply unless the command line says otherwise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import optuna
import yaml

from phalanx.errors import ConfigurationError

COMET_ALGORITHMS = {"random": "random", "grid": "grid", "bayes": "tpe"}


@dataclass(frozen=True)
class Parameter:
    """One dimension: ``float``/``int`` between ``low`` and ``high`` (``log``, ``step``), or ``categorical`` ``values``."""

    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    values: tuple[Any, ...] = ()

    def suggest(self, trial: optuna.Trial) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.values))
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), step=self.step, log=self.log)

    def grid(self) -> list[Any]:
        """Every value, for grid search (categorical, or int/float with a step)."""
        if self.kind == "categorical":
            return list(self.values)
        if self.step is None and self.kind == "float":
            raise ConfigurationError(
                f"grid search needs finite values: give {self.name!r} a 'step' or make it categorical.")
        step = self.step or 1
        count = int(math.floor((self.high - self.low) / step + 1e-9)) + 1
        values = [self.low + k * step for k in range(count)]
        return [int(v) for v in values] if self.kind == "int" else values


@dataclass(frozen=True)
class Space:
    """The parameters of a search, and what the file says about metric, direction and sampler."""

    parameters: tuple[Parameter, ...]
    metric: str | None = None
    direction: str | None = None
    sampler: str | None = None
    source: str = ""
    names: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(p.name for p in self.parameters))

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        return {parameter.name: parameter.suggest(trial) for parameter in self.parameters}

    def grid(self) -> dict[str, list[Any]]:
        return {parameter.name: parameter.grid() for parameter in self.parameters}


def load(path: str | Path) -> Space:
    """Read and check a space file (JSON or YAML, either format); a clear error names what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigurationError(f"cannot read the search space {path}: {error.strerror}.") from None
    try:
        document = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise ConfigurationError(f"the search space {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                                 f"{error}") from None
    return parse(document, str(path))


def parse(document: Any, source: str = "the search space") -> Space:
    """A :class:`Space` from a parsed document of either format."""
    if not isinstance(document, Mapping) or not document:
        raise ConfigurationError(f"{source}: expected a mapping of parameter names to their ranges.")
    if "parameters" in document:
        return _comet(document, source)
    return Space(tuple(_parameter(name, spec, source) for name, spec in document.items()), source=source)


def _comet(document: Mapping[str, Any], source: str) -> Space:
    algorithm = document.get("algorithm", "random")
    if algorithm not in COMET_ALGORITHMS:
        raise ConfigurationError(f"{source}: algorithm {algorithm!r} is not one of {sorted(COMET_ALGORITHMS)}.")
    spec = document.get("spec") or {}
    objective = spec.get("objective")
    if objective not in (None, "minimize", "maximize"):
        raise ConfigurationError(f"{source}: spec.objective must be 'minimize' or 'maximize', got {objective!r}.")
    parameters = document["parameters"]
    if not isinstance(parameters, Mapping) or not parameters:
        raise ConfigurationError(f"{source}: 'parameters' must map names to their ranges.")
    converted = tuple(_parameter(name, _from_comet(name, p, source), source) for name, p in parameters.items())
    return Space(converted, metric=spec.get("metric"), direction=objective,
                 sampler=COMET_ALGORITHMS[algorithm], source=source)


def _from_comet(name: str, spec: Any, source: str) -> dict[str, Any]:
    if not isinstance(spec, Mapping):
        raise ConfigurationError(f"{source}: parameter {name!r} must be a mapping, got {spec!r}.")
    kind = spec.get("type")
    if kind in ("discrete", "categorical"):
        return {"type": "categorical", "values": spec.get("values")}
    if kind in ("integer", "float", "double"):
        low, high = spec.get("min"), spec.get("max")
        log = spec.get("scalingType", "uniform") in ("loguniform", "log")
        return {"type": "int" if kind == "integer" else "float", "low": low, "high": high, "log": log}
    raise ConfigurationError(f"{source}: parameter {name!r} has Comet type {kind!r}; "
                             "expected discrete, categorical, integer, float or double.")


def _parameter(name: str, spec: Any, source: str) -> Parameter:
    where = f"{source}: parameter {name!r}"
    if not isinstance(spec, Mapping):
        raise ConfigurationError(f"{where} must be a mapping like {{\"type\": \"float\", \"low\": 0.001, \"high\": 0.1}}.")
    unknown = set(spec) - {"type", "low", "high", "log", "step", "values"}
    if unknown:
        raise ConfigurationError(f"{where} has unknown key(s) {sorted(unknown)}.")
    kind = spec.get("type")
    if kind == "categorical":
        values = spec.get("values")
        if not isinstance(values, (list, tuple)) or not values:
            raise ConfigurationError(f"{where}: a categorical parameter needs a non-empty list 'values'.")
        return Parameter(name, kind, values=tuple(values))
    if kind not in ("int", "float"):
        raise ConfigurationError(f"{where}: type must be 'float', 'int' or 'categorical', got {kind!r}.")
    low, high, step, log = spec.get("low"), spec.get("high"), spec.get("step"), bool(spec.get("log", False))
    for key, value in (("low", low), ("high", high)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigurationError(f"{where}: '{key}' must be a number, got {value!r}.")
    if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
        raise ConfigurationError(f"{where}: an int parameter needs integer bounds, got {low} and {high}.")
    if low > high:
        raise ConfigurationError(f"{where}: low ({low}) is above high ({high}).")
    if log and low <= 0:
        raise ConfigurationError(f"{where}: a log scale needs low > 0, got {low}.")
    if step is not None and (not isinstance(step, (int, float)) or step <= 0 or log):
        raise ConfigurationError(f"{where}: 'step' must be a positive number, and cannot go with log.")
    return Parameter(name, kind, float(low), float(high), log, step)
