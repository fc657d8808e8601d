"""Search spaces: what ``phalanx tune --space FILE`` reads, checked before any trial starts.

Two formats, JSON or YAML:

* phalanx's: ``{"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": true},
  "batch_size": {"type": "categorical", "values": [8, 32]}, "depth": {"type": "int", "low": 1, "high": 4}}``
  (``int`` and ``float`` also take ``step``);
* Comet's optimizer file, as it is written: ``{"algorithm": "random" | "grid" | "bayes", "parameters":
  {"batch_size": {"type": "discrete", "values": [...]}, "lr": {"type": "float", "min": ...,
  "max": ..., "scalingType": "loguniform"}}, "spec": {"metric": "val_loss", "objective": "minimize",
  "gridSize": 10, "maxCombo": 0}}``; its metric, objective and algorithm apply unless the command
  line says otherwise. Every key either keeps its meaning here or is refused by name: grid sizes
  build the grid of Optuna's GridSampler, ``maxCombo`` caps the trials, and a ``normal`` or
  ``lognormal`` scaling is drawn from that distribution (integers rounded) by the random sampler.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any, Mapping

import optuna
import yaml

from phalanx.errors import ConfigurationError

COMET_ALGORITHMS = {"random": "random", "grid": "grid", "bayes": "tpe"}
COMET_SCALINGS = ("linear", "uniform", "normal", "loguniform", "lognormal")
COMET_GRID_SIZE = 10  # Comet's default number of grid values of an integer or float parameter
COMET_KEYS = {"algorithm", "spec", "parameters", "name", "trials"}
# How Comet's own service samples and retries: settings of that service, with nothing to set here.
COMET_SERVICE_KEYS = {"minSampleSize", "retryLimit", "retryAssignLimit"}
COMET_SPEC_KEYS = {"metric", "objective", "gridSize", "maxCombo", "randomize", *COMET_SERVICE_KEYS}
COMET_RANGE_KEYS = {"type", "min", "max", "scalingType", "mu", "sigma", "gridSize"}
SMALLEST_PRIOR_MASS = 1e-9  # a normal prior that keeps less than this between min and max is a mistake


@dataclass(frozen=True)
class Parameter:
    """One dimension: ``float``/``int`` between ``low`` and ``high`` (``log``, ``step``), or ``categorical`` ``values``.

    ``grid_size``: grid search takes this many values from ``low`` to ``high`` (evenly spaced, on a
    log scale when ``log``). ``prior``: ``(mu, sigma)`` of a normal distribution the value is drawn
    from (of its logarithm when ``log``), cut to ``[low, high]``.
    """

    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    values: tuple[Any, ...] = ()
    grid_size: int | None = None
    prior: tuple[float, float] | None = None

    def suggest(self, trial: optuna.Trial) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.name, list(self.values))
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), step=self.step, log=self.log)

    def grid(self) -> list[Any]:
        """Every value, for grid search (categorical, int/float with a step, or with a grid size)."""
        if self.kind == "categorical":
            return list(self.values)
        if self.prior is not None:
            raise ConfigurationError(f"grid search cannot draw {self.name!r} from its {self.prior_name()} "
                                     "distribution: give it scalingType 'linear' or 'loguniform', or use algorithm "
                                     "'random' (or --sampler random).")
        if self.grid_size is not None:
            return self._spaced()
        if self.step is None and self.kind == "float":
            raise ConfigurationError(
                f"grid search needs finite values: give {self.name!r} a 'step' or make it categorical.")
        step = self.step or 1
        count = int(math.floor((self.high - self.low) / step + 1e-9)) + 1
        values = [self.low + k * step for k in range(count)]
        return [int(v) for v in values] if self.kind == "int" else values

    def draw(self, rng: random.Random) -> float | int:
        """A value from the prior cut to ``[low, high]``, by inverting its distribution function
        between the bounds (nothing is clipped or drawn again); integers are rounded, each taking
        the probability of ``[k - 0.5, k + 0.5]``."""
        normal = NormalDist(*self.prior)
        low, high = self._prior_interval()
        p = rng.uniform(normal.cdf(low), normal.cdf(high))
        x = normal.inv_cdf(min(max(p, math.ulp(0.0)), 1.0 - math.ulp(1.0)))
        value = min(max(math.exp(x) if self.log else x, self.low), self.high)
        return int(min(max(round(value), self.low), self.high)) if self.kind == "int" else value

    def prior_mass(self) -> float:
        """How much of the prior lies between ``low`` and ``high``."""
        normal = NormalDist(*self.prior)
        low, high = self._prior_interval()
        return normal.cdf(high) - normal.cdf(low)

    def _prior_interval(self) -> tuple[float, float]:
        low, high = (self.low - 0.5, self.high + 0.5) if self.kind == "int" else (self.low, self.high)
        return (math.log(low), math.log(high)) if self.log else (low, high)

    def prior_name(self) -> str:
        """Comet's name of the prior: ``normal``, or ``lognormal`` when drawn for the logarithm."""
        return "lognormal" if self.log else "normal"

    def _spaced(self) -> list[Any]:
        """``grid_size`` values from ``low`` to ``high``, both included; integers rounded, each once."""
        n = self.grid_size
        if self.log:
            ratio = math.log(self.high / self.low)
            values = [self.low * math.exp(ratio * k / (n - 1)) for k in range(n)]
        else:
            values = [self.low + (self.high - self.low) * k / (n - 1) for k in range(n)]
        values[0], values[-1] = self.low, self.high  # exactly the bounds, not their rounding errors
        if self.kind == "int":
            return list(dict.fromkeys(int(round(v)) for v in values))
        return [float(f"{v:.12g}") if 0 < k < n - 1 else v for k, v in enumerate(values)]


@dataclass(frozen=True)
class Space:
    """The parameters of a search, and what the file says about metric, direction, sampler and budget.

    ``max_combo``: Comet's ``maxCombo``, the most trials to run (None: no limit). ``grid_keys``:
    where the file sets grid sizes, which only grid search can honour.
    """

    parameters: tuple[Parameter, ...]
    metric: str | None = None
    direction: str | None = None
    sampler: str | None = None
    source: str = ""
    max_combo: int | None = None
    grid_keys: tuple[str, ...] = ()
    names: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(p.name for p in self.parameters))

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        return {parameter.name: parameter.suggest(trial) for parameter in self.parameters}

    def grid(self) -> dict[str, list[Any]]:
        return {parameter.name: parameter.grid() for parameter in self.parameters}

    def priors(self) -> dict[str, Parameter]:
        """The parameters drawn from a normal or lognormal distribution, by name."""
        return {parameter.name: parameter for parameter in self.parameters if parameter.prior is not None}

    def check(self, sampler: str) -> None:
        """Refuse, before any trial starts, what ``sampler`` cannot do as the file says."""
        if self.grid_keys and sampler != "grid":
            raise ConfigurationError(f"{self.source}: {self.grid_keys[0]} sets a grid, but the sampler is {sampler}: "
                                     "use algorithm 'grid' (or --sampler grid), or remove it.")
        if sampler == "grid":
            self.grid()
        elif sampler != "random" and self.priors():
            parameter = next(iter(self.priors().values()))
            raise ConfigurationError(
                f"{self.source}: parameter {parameter.name!r} has scalingType {parameter.prior_name()!r}, which the "
                f"random sampler draws from; the {sampler} sampler would not: use algorithm 'random' (or --sampler "
                "random), or scalingType 'uniform' or 'loguniform'.")

    def trials(self, requested: int | None, sampler: str) -> tuple[int, str]:
        """How many trials the search ends with, and what decided it: ``--trials``, capped by the
        file's ``maxCombo`` and by the size of a grid (each combination runs once)."""
        bounds = []
        if requested is not None:
            bounds.append((requested, f"--trials {requested}"))
        if self.max_combo is not None:
            bounds.append((self.max_combo, f"spec.maxCombo is {self.max_combo}"))
        if sampler == "grid":
            size = math.prod(len(values) for values in self.grid().values())
            bounds.append((size, f"the grid has {size} combination(s)"))
        if not bounds:
            raise ConfigurationError("--trials T is required (unless the search is a grid, or the space file gives "
                                     "spec.maxCombo).")
        return min(bounds, key=lambda bound: bound[0])


class PriorSampler(optuna.samplers.RandomSampler):
    """Optuna's random sampler, except for the parameters with a normal or lognormal prior: those
    are drawn from it, with a generator seeded by the seed, the trial's number and the name."""

    def __init__(self, priors: Mapping[str, Parameter], seed: int | None = None):
        super().__init__(seed=seed)
        self._priors, self._seed = dict(priors), seed

    def sample_independent(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, param_name: str,
                           param_distribution: optuna.distributions.BaseDistribution) -> Any:
        parameter = self._priors.get(param_name)
        if parameter is None:
            return super().sample_independent(study, trial, param_name, param_distribution)
        rng = random.Random(f"{self._seed}:{trial.number}:{param_name}") if self._seed is not None else random.Random()
        return parameter.draw(rng)


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
    _known(document, COMET_KEYS, source)
    algorithm = document.get("algorithm", "random")
    if algorithm not in COMET_ALGORITHMS:
        raise ConfigurationError(f"{source}: algorithm {algorithm!r} is not one of {sorted(COMET_ALGORITHMS)}.")
    if document.get("trials", 1) != 1:
        raise ConfigurationError(f"{source}: 'trials': {document['trials']!r} runs each combination that many times; "
                                 "phalanx tune runs each once: remove it.")
    spec = document.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise ConfigurationError(f"{source}: 'spec' must be a mapping, got {spec!r}.")
    _known(spec, COMET_SPEC_KEYS, f"{source}: spec")
    objective, metric = spec.get("objective"), spec.get("metric")
    if objective not in (None, "minimize", "maximize"):
        raise ConfigurationError(f"{source}: spec.objective must be 'minimize' or 'maximize', got {objective!r}.")
    if metric is not None and not isinstance(metric, str):
        raise ConfigurationError(f"{source}: spec.metric must be a metric's name, got {metric!r}.")
    if spec.get("randomize", True) is not True:
        raise ConfigurationError(f"{source}: spec.randomize {spec['randomize']!r} asks for the grid in order; "
                                 "Optuna's GridSampler visits it in random order: remove it or set it true.")
    max_combo = spec.get("maxCombo", 0)
    if not _is_int(max_combo) or max_combo < 0:
        raise ConfigurationError(f"{source}: spec.maxCombo must be a whole number of trials (0: no limit), "
                                 f"got {max_combo!r}.")
    grid_size = _grid_size(spec, f"{source}: spec")
    parameters = document["parameters"]
    if not isinstance(parameters, Mapping) or not parameters:
        raise ConfigurationError(f"{source}: 'parameters' must map names to their ranges.")
    grid_keys = ["spec.gridSize"] if "gridSize" in spec else []
    grid_keys += [f"parameters.{name}.gridSize" for name, p in parameters.items()
                  if isinstance(p, Mapping) and "gridSize" in p]
    return Space(tuple(_from_comet(name, p, source, grid_size or COMET_GRID_SIZE) for name, p in parameters.items()),
                 metric=metric, direction=objective, sampler=COMET_ALGORITHMS[algorithm], source=source,
                 max_combo=max_combo or None, grid_keys=tuple(grid_keys))


def _from_comet(name: str, spec: Any, source: str, grid_size: int) -> Parameter:
    where = f"{source}: parameter {name!r}"
    if not isinstance(spec, Mapping):
        raise ConfigurationError(f"{where} must be a mapping, got {spec!r}.")
    kind = spec.get("type")
    if kind in ("discrete", "categorical"):
        _known(spec, {"type", "values"}, where)
        return _parameter(name, {"type": "categorical", "values": spec.get("values")}, source)
    if kind not in ("integer", "float", "double"):
        raise ConfigurationError(f"{where} has Comet type {kind!r}; "
                                 "expected discrete, categorical, integer, float or double.")
    _known(spec, COMET_RANGE_KEYS, where)
    scaling = spec.get("scalingType", "uniform")
    if scaling not in COMET_SCALINGS:
        raise ConfigurationError(f"{where}: scalingType {scaling!r} is not one of {', '.join(COMET_SCALINGS)}.")
    kind = "int" if kind == "integer" else "float"
    low, high = _bounds(where, kind, spec.get("min"), spec.get("max"), ("min", "max"))
    log = scaling in ("loguniform", "lognormal")
    if log and low <= 0:
        raise ConfigurationError(f"{where}: scalingType {scaling!r} needs min > 0, got {spec.get('min')}.")
    parameter = Parameter(name, kind, low, high, log, grid_size=_grid_size(spec, where) or grid_size)
    if scaling not in ("normal", "lognormal"):
        if "mu" in spec or "sigma" in spec:
            raise ConfigurationError(f"{where}: 'mu' and 'sigma' go with scalingType normal or lognormal, "
                                     f"not {scaling!r}.")
        return parameter
    mu, sigma = spec.get("mu"), spec.get("sigma")
    if not (_is_number(mu) and _is_number(sigma)):
        raise ConfigurationError(f"{where}: scalingType {scaling!r} needs numbers 'mu' and 'sigma' (the mean and "
                                 f"standard deviation{' of the logarithm' if log else ''}), got {mu!r} and {sigma!r}.")
    if sigma <= 0:
        raise ConfigurationError(f"{where}: 'sigma' must be a positive number, got {sigma!r}.")
    parameter = replace(parameter, prior=(float(mu), float(sigma)))
    mass = parameter.prior_mass()
    if mass < SMALLEST_PRIOR_MASS:
        raise ConfigurationError(f"{where}: min and max keep almost none ({mass:.1e}) of the {scaling} distribution "
                                 f"with mu {mu} and sigma {sigma}{' (those of the logarithm)' if log else ''}.")
    return parameter


def _parameter(name: str, spec: Any, source: str) -> Parameter:
    where = f"{source}: parameter {name!r}"
    if not isinstance(spec, Mapping):
        raise ConfigurationError(f"{where} must be a mapping like {{\"type\": \"float\", \"low\": 0.001, \"high\": 0.1}}.")
    _known(spec, {"type", "low", "high", "log", "step", "values"}, where)
    kind = spec.get("type")
    if kind == "categorical":
        values = spec.get("values")
        if not isinstance(values, (list, tuple)) or not values:
            raise ConfigurationError(f"{where}: a categorical parameter needs a non-empty list 'values'.")
        return Parameter(name, kind, values=tuple(values))
    if kind not in ("int", "float"):
        raise ConfigurationError(f"{where}: type must be 'float', 'int' or 'categorical', got {kind!r}.")
    low, high = _bounds(where, kind, spec.get("low"), spec.get("high"), ("low", "high"))
    step, log = spec.get("step"), bool(spec.get("log", False))
    if log and low <= 0:
        raise ConfigurationError(f"{where}: a log scale needs low > 0, got {spec.get('low')}.")
    if step is not None and (not isinstance(step, (int, float)) or step <= 0 or log):
        raise ConfigurationError(f"{where}: 'step' must be a positive number, and cannot go with log.")
    return Parameter(name, kind, low, high, log, step)


def _bounds(where: str, kind: str, low: Any, high: Any, keys: tuple[str, str]) -> tuple[float, float]:
    """Checked numeric bounds (``keys`` are their names in the file)."""
    for key, value in zip(keys, (low, high)):
        if not _is_number(value):
            raise ConfigurationError(f"{where}: '{key}' must be a number, got {value!r}.")
    if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
        raise ConfigurationError(f"{where}: an integer parameter needs integer bounds, got {low} and {high}.")
    if low > high:
        raise ConfigurationError(f"{where}: {keys[0]} ({low}) is above {keys[1]} ({high}).")
    return float(low), float(high)


def _grid_size(spec: Mapping[str, Any], where: str) -> int | None:
    size = spec.get("gridSize")
    if size is not None and (not _is_int(size) or size < 2):
        raise ConfigurationError(f"{where}: gridSize must be a whole number of at least 2 (the grid runs from min to "
                                 f"max), got {size!r}.")
    return size


def _known(spec: Mapping[str, Any], keys: set[str], where: str) -> None:
    unknown = set(spec) - keys
    if unknown:
        raise ConfigurationError(f"{where} has unknown key(s) {sorted(unknown)}; known: {', '.join(sorted(keys))}.")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
