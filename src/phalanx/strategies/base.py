"""What px.fit's loop asks of a strategy: where parameters and optimizer state live, and who drives the epochs.

A strategy is one object (as Lightning's ``Strategy`` is) and one module; the loop knows it only
through :class:`Strategy`, so a new strategy changes nothing in :mod:`phalanx.train`. ``check``
refuses, before anything trains, the options it cannot honour (naming the pair); ``setup`` turns
the user's model and optimizer into the ones the loop trains (a ``px.DataParallel`` and an
optimizer whose ``step`` does what the strategy needs); ``train`` drives the epochs through the
loop's :class:`Run` (the loop's own lockstep epochs unless the strategy has its own, as
asynchronous parameter servers do); ``serve`` is a server process's whole ``fit``; ``committed``
names what an elastic commit holds; ``worker_clipping`` where clipping happens; ``exchanges`` how
often the workers communicate (what ``phalanx doctor`` reports, through :func:`announce`);
``finish``/``close`` end it cleanly or after a failure. ``asynchronous`` says whether workers run in lockstep;
``nonfinite_agreement`` how every rank comes to the same decision about a non-finite step
(:mod:`phalanx.train.finite`'s ``AGREEMENTS``), and ``meets_after_step`` where workers that step on
their own meet to settle it. :class:`Replicated` (every worker holds
everything, the default), :class:`~phalanx.strategies.central_storage.CentralStorage` and
:class:`~phalanx.strategies.parameter_server.ParameterServer` implement it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from phalanx import profile
from phalanx.comm import runtime
from phalanx.errors import ConfigurationError
from phalanx.parallel.clipping import Clipping
from phalanx.parallel.data_parallel import DataParallel


@dataclass(frozen=True)
class FitOptions:
    """The options of one ``px.fit`` call that a strategy may have to refuse."""

    precision: str = "32"
    compute_dtype: torch.dtype | None = None  # what that precision computes in (None: the parameters' dtype)
    clipping: Clipping | None = None
    reproducible: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    several_optimizers: bool = False
    torch_scheduler: bool = False
    elastic: bool = False
    manual_step: bool = False  # a step_fn that runs its own backward passes and optimizer steps


class OptimizerLike(Protocol):
    """A torch optimizer, or several stepped as one (``px.fit`` takes a list)."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def step(self) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Stateful(Protocol):
    """What an elastic commit and a checkpoint copy: an object with a state dict."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Run(Protocol):
    """One ``px.fit`` as a strategy's :meth:`Strategy.train` drives it.

    ``state`` is the loop's :class:`~phalanx.train.state.TrainState` (model, optimizer, loader,
    metrics, position, history), ``hooks`` its callbacks, ``val_loader`` the validation data or
    ``None``. A strategy that keeps the workers in lockstep calls :meth:`lockstep`; one with its own
    epochs takes its steps through the rest.
    """

    state: Any
    hooks: Any
    val_loader: Any

    def lockstep(self) -> None:
        """Train every remaining epoch with all workers in step, elastic or not: px.fit's own loop."""
    def train_batch(self, batch: Any) -> bool:
        """One optimizer step on this worker's ``batch`` (forward, backward, step); whether it stepped."""
    def validate_batch(self, batch: Any, metrics: Sequence[Any]) -> None:
        """Add a validation ``batch``'s loss and metrics to ``metrics`` (fresh ones: :meth:`fresh_metrics`)."""
    def fresh_metrics(self) -> list[Any]:
        """New, empty copies of the run's metrics."""
    def follow_membership(self) -> bool:
        """In an elastic job, join the next generation now if the group is changing; whether it did."""


@dataclass(frozen=True)
class Exchanges:
    """How often a strategy's workers communicate: ``fragments`` exchanges every ``period`` optimizer
    steps, each of 1/``fragments`` of the model, each merged ``delay`` steps after it starts (compute
    hides it meanwhile); ``what`` crosses the network, in words. px.DataParallel: one every step."""

    period: int = 1
    fragments: int = 1
    delay: int = 0
    what: str = ""

    @property
    def share(self) -> float:
        """Exchanges per optimizer step: the share of the steps that start one."""
        return self.fragments / self.period

    def describe(self) -> str:
        """The schedule in words, as the doctor's report says it."""
        what = f" ({self.what})" if self.what else ""
        if self.period == 1 and self.fragments == 1 and not self.delay:
            return f"every step communicates{what}"
        hidden = f", overlapped with the next {self.delay} inner step(s)" if self.delay else ""
        if self.fragments == 1:
            return f"1 step in {self.period} communicates{what}{hidden}"
        return (f"{self.fragments} exchanges every {self.period} steps, each of 1/{self.fragments} of the model{what}"
                f"{hidden}: {self.fragments} step(s) in {self.period} start one")


class Strategy(Protocol):
    """Where the parameters and the optimizer state live (see the module's docstring).

    Subclass it for the defaults below: the loop's lockstep epochs, no serving, a commit of the
    model and the optimizer, clipping on the workers, nothing to tear down.
    """

    asynchronous: bool = False
    nonfinite_agreement: str = "gradient"
    #: Whether a re-formed elastic group reads the last checkpoint on disk (the committed objects
    #: hold no copy of a lost worker's state) rather than going on from the last commit in memory.
    resumes_from_disk: bool = False
    #: Whether a re-formed group may have to (a strategy whose copies can die with the workers that
    #: hold them): an elastic px.fit with a checkpoint folder then saves one before the first step.
    may_resume_from_disk: bool = False
    #: Whether the State's commit holds the whole training state (then a survivor left below the
    #: minimum of workers may save it as a checkpoint to resume from).
    commits_whole_state: bool = True
    #: Optimizer steps between an elastic job's commits (and one at each epoch's end): a lost worker
    #: costs the steps since the last one, which the survivors train again, bitwise alike.
    commit_every: int = 1

    @property
    def name(self) -> str:
        """How messages name the strategy."""
        return type(self).__name__

    def check(self, options: FitOptions) -> None:
        """Refuse, naming the pair, what this strategy cannot honour (before anything trains)."""
    def setup(self, model: nn.Module, optimizer: OptimizerLike) -> tuple[DataParallel, OptimizerLike]:
        """The model and optimizer the loop trains."""
        raise NotImplementedError

    def train(self, run: Run) -> None:
        """Drive the epochs (after ``setup``, ``check`` and a resume): by default the loop's lockstep."""
        run.lockstep()

    def serve(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, train_tasks: int = 0,
              val_tasks: int = 0, metric_values: int = 0, clipping: Clipping | None = None) -> dict[str, Any] | None:
        """A server process's ``fit`` (``phalanx run --servers``): serve ``model``'s parameters with
        ``optimizer`` until the workers are done (``train_tasks``/``val_tasks`` per epoch over all
        workers, ``metric_values`` per task, ``clipping`` of what it applies); worker 0's history as
        a state dict. Strategies without servers refuse."""
        raise ConfigurationError(
            f"this process is a parameter server (phalanx run --servers), but px.fit trains with "
            f"{type(self).__name__}, which has none: pass strategy=px.ParameterServer(...), or launch without "
            "--servers.")

    def committed(self, model: DataParallel, optimizer: OptimizerLike) -> dict[str, Stateful]:
        """What an elastic commit copies of the model and optimizer ``setup`` returned (every worker
        holds them; the loop adds its position, the data and the schedules)."""
        return {"model": model, "optimizer": optimizer}

    def must_resume_from_disk(self) -> str | None:
        """After a re-formed elastic group restored the last commit: why it must also read the last
        checkpoint on disk (said in the log), or ``None`` when the commit holds everything."""
        return f"{self.name} holds no copy of another worker's state" if self.resumes_from_disk else None

    def memory_needed(self, model: nn.Module, optimizer: OptimizerLike) -> int:
        """Bytes a worker holds for parameters, gradients and optimizer state under this strategy
        (activations not counted): ``px.fit(max_memory_gb=...)`` refuses a run above its limit."""
        return held_bytes(model, optimizer, level=0, workers=runtime.size())

    def worker_clipping(self, clipping: Clipping | None) -> Clipping | None:
        """The clipping workers apply before their optimizer step (``None`` where another place clips)."""
        return clipping

    def exchanges(self) -> Exchanges:
        """How often the workers communicate (by default every step): ``phalanx doctor`` names it and
        weighs the steps that communicate by it."""
        return Exchanges()

    def meets_after_step(self) -> bool:
        """Whether the optimizer step about to be taken exchanges with the other workers (by default
        every step does). Workers that step on their own (``nonfinite_agreement = "exchanges"``) carry
        a non-finite step's verdict to the next step that does, rather than meeting every step."""
        return True

    def finish(self, history: dict[str, Any] | None = None) -> None:
        """End after a finished run; ``history`` is the run's, as a state dict."""

    def close(self) -> None:
        """End after a failure."""


class Replicated(Strategy):
    """Every worker holds the parameters and the optimizer state; gradients are averaged by
    ``px.DataParallel`` during backward. The default strategy."""

    name = "px.DataParallel"
    asynchronous = False
    nonfinite_agreement = "gradient"  # every rank holds the same averaged gradient

    def check(self, options: FitOptions) -> None:
        refuse_parameter_servers_launched("px.DataParallel")

    def setup(self, model: nn.Module, optimizer: OptimizerLike) -> tuple[DataParallel, OptimizerLike]:
        return wrap(model), optimizer

    def exchanges(self) -> Exchanges:
        return Exchanges(what="the gradients, during backward")


#: Optimizer state per parameter, in parameters' worth, of torch's optimizers (with their defaults).
STATE_PER_PARAMETER = {"SGD": 1, "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "RMSprop": 1,
                       "Adagrad": 1, "Adadelta": 2, "ASGD": 1, "Rprop": 2, "SparseAdam": 2, "LBFGS": 2}


def state_per_parameter(optimizer: OptimizerLike) -> int:
    """How many parameters' worth of state the optimizer keeps (an optimizer not listed: 2, as Adam)."""
    groups = optimizer.param_groups
    if type(optimizer).__name__ == "SGD" and not any(group.get("momentum") for group in groups):
        return 0
    extra = 1 if any(group.get("amsgrad") or group.get("centered") for group in groups) else 0
    return STATE_PER_PARAMETER.get(type(optimizer).__name__, 2) + extra


@dataclass(frozen=True)
class Held:
    """Bytes one worker holds for the model's training state, by kind: the one place the memory of
    each sharding level is written down (``px.fit(max_memory_gb=...)`` and ``phalanx doctor`` both
    read it). ``gradients`` stay between steps; ``step_gradients`` exist from backward to the end of
    the optimizer step (the engine's gradient buckets, whole at every level)."""

    parameters: float
    gradients: float
    optimizer_state: float
    step_gradients: float

    @property
    def total(self) -> float:
        """Held between steps: what benchmarks/bench_shard.py counts after a step."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def at_step(self) -> float:
        """Held at the optimizer step, the step's gradients whole in their buckets."""
        return self.parameters + max(self.gradients, self.step_gradients) + self.optimizer_state


#: Sharding levels: 0 is px.DataParallel (nothing sharded), 1-3 are px.Sharded's.
SHARDING_LEVELS = (0, 1, 2, 3)


def held_per_worker(weights: float, state: float, level: int, workers: int, shared: bool = False) -> Held:
    """What one of ``workers`` holds at sharding ``level`` (0: px.DataParallel; 1: the optimizer state
    sharded; 2: also the gradients; 3: also the parameters), counted as benchmarks/bench_shard.py
    counts tensors after a step. ``weights``: bytes of the parameters the optimizer steps, ``state``:
    bytes of the whole optimizer state. ``shared``: px.Sharded keeps its units once per host in
    shared memory (every worker on one CPU host, the default there), each worker's share of them
    counted, so the parameters cost ``weights / workers`` at every level. Levels 2 and 3 free the
    gradient buckets after the step; at level 3 blocks gathered for a forward or a backward come on
    top while they are in use (between hosts)."""
    if level not in SHARDING_LEVELS:
        raise ConfigurationError(f"sharding level must be one of {list(SHARDING_LEVELS)}, got {level!r}.")
    if workers < 1:
        raise ConfigurationError(f"workers must be 1 or more, got {workers!r}.")
    own_parameters = level == 3 or (shared and level > 0)
    return Held(parameters=weights / workers if own_parameters else weights,
                gradients=weights if level <= 1 else 0.0,
                optimizer_state=state / workers if level > 0 else state,
                step_gradients=weights)


def one_copy_per_host(weights: float, state: float, level: int, workers: int, local: int) -> bool:
    """Whether px.Sharded keeps one copy per host by default between hosts (each host's ``local``
    workers sharding their host's copy, the hosts replicas): at levels 1 and 2, where a worker then
    holds no more than sharding over all ``workers`` would have it hold. It then sends only
    px.DataParallel's allreduce over the network, where sharding across hosts adds an all-gather
    after the step that nothing hides; at level 3 it would hold more (every host the whole model)."""
    if level not in (1, 2) or local < 2 or workers <= local:
        return False
    replicas = held_per_worker(weights, state, level, local, shared=True)
    return replicas.total <= held_per_worker(weights, state, level, workers).total


def elastic_copies_per_worker(weights: float, state: float, level: int, workers: int, one_host: bool) -> float:
    """Bytes an elastic commit keeps per worker beside training. px.DataParallel (level 0): a whole copy
    of the weights and the optimizer state in the worker's memory (the elastic State's commit).
    px.Sharded: on one host, two slots of the worker's chunks of both in host shared memory
    (strategies/shard_copies.py), ``2 * (weights + state) / workers``; between hosts two slots of
    its own chunks and two of its ward's (it is that worker's buddy), twice that."""
    if level == 0:
        return weights + state
    return (2 if one_host else 4) * (weights + state) / workers


def trained_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that train (``requires_grad``), whole, whatever the sharding."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def held_bytes(model: nn.Module, optimizer: OptimizerLike, level: int, workers: int) -> int:
    """Bytes one of ``workers`` holds for parameters, gradients and optimizer state at sharding ``level``
    as ``px.fit(max_memory_gb=...)`` counts them: :func:`held_per_worker` with each worker its own copy
    of what it does not shard (no credit for host shared memory) and, at levels 2 and 3, the chunk of
    the gradient a rank steps (ZeRO's accounting, the table of docs/sharding.md), not counting the
    blocks level 3 gathers at a given moment."""
    weights = trained_bytes(model)
    held = held_per_worker(weights, state_per_parameter(optimizer) * weights, level, workers)
    return int(held.total + (weights / workers if level >= 2 else 0))


def announce(strategy: Strategy) -> None:
    """Tell a doctor session, if one is on, which strategy trains and how often its workers
    communicate (``profile.note``; nothing otherwise). px.fit calls it after ``setup``, and so does
    a strategy whose ``setup`` is also meant for loops of your own: the note is keyed, so a second
    call says the same thing again rather than adding to it."""
    profile.note("strategy", {"name": strategy.name, **asdict(strategy.exchanges())})


def resolve(strategy: Strategy | None) -> Strategy:
    """The strategy ``px.fit`` trains with: the one given, else :class:`Replicated`."""
    return strategy if strategy is not None else Replicated()


def wrap(model: nn.Module) -> DataParallel:
    """``model`` as the loop trains it: a ``px.DataParallel`` on this worker's device (as given if it is one)."""
    return model if isinstance(model, DataParallel) else DataParallel(model.to(runtime.device()))


def refuse_parameter_servers_launched(strategy: str) -> None:
    """A job launched with ``--servers`` trains only with ``px.ParameterServer``."""
    if runtime.role() == "worker" and runtime.num_servers():
        raise ConfigurationError(
            f"the job was launched with parameter servers (--servers), but it trains with {strategy}: pass "
            "strategy=px.ParameterServer(), or launch without --servers.")


def refuse_without_replicas(strategy: str, where: str, options: FitOptions) -> None:
    """Refuse what needs the optimizer on every worker (reproducible mode, several optimizers, a
    step_fn that steps its own) under a strategy that keeps it ``where`` (on one rank, on the servers)."""
    if options.reproducible:
        refuse(strategy, "reproducible=True", "reproducible mode trains with px.DataParallel only; drop strategy= or "
               "reproducible=.")
    if options.manual_step:
        refuse(strategy, "a step_fn that steps its own optimizers", f"the optimizer steps {where}; give "
               "step_fn(model, batch) and let px.fit step.")
    if options.several_optimizers:
        refuse(strategy, "a list of optimizers", f"one optimizer's state lives {where}; use one optimizer with "
               "parameter groups.")


def refuse(strategy: str, what: str, why: str) -> None:
    """Refuse an option this strategy cannot honour, naming both."""
    raise ConfigurationError(f"{strategy} with {what}: {why}")

