"""``hvd.DistributedOptimizer``: an optimizer whose gradients are averaged by phalanx's gradient engine.

It wraps the user's optimizer by composition (no class is made on the fly): ``param_groups``,
``state``, ``defaults``, ``state_dict``, ``load_state_dict``, ``zero_grad``, ``step`` and
``add_param_group`` reach the wrapped optimizer. It is a ``torch.optim.Optimizer`` (so LR
schedulers accept it) but not an instance of the wrapped class: ``isinstance(opt, torch.optim.SGD)``
is False where Horovod's is True; ``opt.optimizer`` is the wrapped one.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from phalanx.errors import ConfigurationError
from phalanx.horovod.torch import basics
from phalanx.horovod.torch.basics import Average, Sum
from phalanx.horovod.torch.compression import Compressor, NoneCompressor
from phalanx.horovod.torch.exceptions import horovod_errors
from phalanx.horovod.torch.process_sets import ProcessSet, global_process_set, scope_of, set_size
from phalanx.horovod.torch.summation import HorovodAverage
from phalanx.parallel.buckets import DEFAULT_FUSION_THRESHOLD_MB
from phalanx.parallel.reducer import GradientReducer


class DistributedOptimizer(torch.optim.Optimizer):
    """Average gradients over the process set during backward, then step ``optimizer``.

    ``named_parameters`` names the parameters (for errors and the timeline; without it they are named
    as Horovod names them, ``allreduce.noname.<group>.<index>``, and ``_parameter_names`` maps each
    parameter to its name, as in Horovod); ``compression``
    ``hvd.Compression.fp16`` sends gradient buckets as float16; ``backward_passes_per_step=k``
    accumulates k backwards locally and reduces once; ``op`` is ``hvd.Average`` or ``hvd.Sum``;
    ``gradient_predivide_factor`` divides before the sum and multiplies after (Average only);
    ``groups`` (a number of groups, or lists of parameters) fixes which gradients travel together
    instead of the engine's buckets (25 MB, or HOROVOD_FUSION_THRESHOLD bytes); ``sparse_as_dense``
    averages sparse gradients densely and hands them back sparse (so ``torch.optim.SparseAdam`` works).
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 compression: type[Compressor] = NoneCompressor, backward_passes_per_step: int = 1,
                 op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: int | Sequence[Sequence[torch.nn.Parameter]] | None = None, sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set):
        named = _named(optimizer, named_parameters)  # bad names are refused before anything needs init()
        basics.require_init()
        if op not in (Average, Sum):
            basics.op_name(op)  # Adasum and unknown values raise there
            raise ConfigurationError("DistributedOptimizer supports op=hvd.Average and op=hvd.Sum.")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ConfigurationError("gradient_predivide_factor not supported with op != Average")
        if backward_passes_per_step < 1:
            raise ConfigurationError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}.")
        if num_groups:
            warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                          DeprecationWarning, stacklevel=2)
            groups = groups if groups is not None else num_groups
        self.optimizer = optimizer
        self.backward_passes_per_step = backward_passes_per_step
        self.process_set = process_set
        threshold_mb = basics.settings().fusion_threshold_mb  # HOROVOD_FUSION_THRESHOLD, read at hvd.init
        self._settings = dict(op=op, predivide=gradient_predivide_factor, wire_dtype=compression.wire_dtype,
                              groups=groups, sparse_as_dense=sparse_as_dense,
                              threshold_mb=DEFAULT_FUSION_THRESHOLD_MB if threshold_mb is None else threshold_mb)
        self._named = named
        self._synchronized = False
        self._should_synchronize = True
        self._reducer: GradientReducer | None = None
        self._summation: HorovodAverage | None = None
        self._build_reducer()

    # --- the engine ---------------------------------------------------------------------------

    def _build_reducer(self) -> None:
        """Hook every trainable parameter of the wrapped optimizer into a gradient engine."""
        if self._reducer is not None:
            self._reducer.close()
        self._reducer = self._summation = None
        if not self.process_set.included() or set_size(self.process_set) == 1:
            return  # nothing to average with (Horovod likewise hooks nothing)
        named = [(name, p) for name, p in self._named() if p.requires_grad]
        params = [p for _, p in named]
        settings = self._settings
        self._summation = HorovodAverage(
            scope_of(self.process_set), set_size(self.process_set), settings["op"] == Average,
            settings["predivide"], settings["wire_dtype"], self.backward_passes_per_step,
            _groups(settings["groups"], params), settings["sparse_as_dense"], [name for name, _ in named])
        self._reducer = GradientReducer(params, [name for name, _ in named], settings["threshold_mb"],
                                        self._summation, schedule=self._summation.phase)

    @property
    def _parameter_names(self) -> dict[torch.nn.Parameter, str]:
        """Every parameter of the wrapped optimizer and its name (Horovod's attribute, read by some
        scripts): ``named_parameters``' names, else Horovod's ``allreduce.noname.<group>.<index>``,
        the same on every rank that built the optimizer alike."""
        return {p: name for name, p in self._named()}

    def reshard(self, rank: int, world_size: int) -> None:
        """The elastic group was re-formed: hook the engine anew for the new size (``px.elastic.State``'s protocol)."""
        self._build_reducer()

    def synchronize(self) -> None:
        """Finish averaging now: reduces gradients accumulated over fewer than ``backward_passes_per_step``
        backwards (a reducing backward has already averaged them when it returned)."""
        if self._summation is not None and self._summation.backwards > 0:
            self._summation.forced = True
            try:
                with horovod_errors():
                    self._reducer.reduce_without_data()
            finally:
                self._summation.forced = False
        if self._summation is not None:
            self._summation.stepped()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize (after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize (unless inside ``skip_synchronize``), then step the wrapped optimizer."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        if self._summation is not None:
            self._summation.stepped()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the wrapped optimizer's gradients; refused between a reducing backward and ``step()``."""
        if self._summation is not None and (self._summation.backwards or self._summation.reduced):
            raise ConfigurationError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # --- delegation to the wrapped optimizer -----------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (the same as Horovod's)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; the engine is rebuilt to hook its parameters too
        (collective over the set: every rank must add the same group)."""
        self.optimizer.add_param_group(param_group)
        if hasattr(self, "_named"):  # not while the wrapped optimizer is being built
            self._build_reducer()

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"hvd.DistributedOptimizer({self.optimizer!r})"


class _Names:
    """Callable giving ``(name, parameter)`` for every parameter of the optimizer, in group order: its
    given name, else Horovod's for an unnamed one (``allreduce.noname.<group>.<index in the group>``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str]):
        self.optimizer, self.names = optimizer, names

    def __call__(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(self.names.get(id(p), f"allreduce.noname.{g}.{i}"), p)
                for g, group in enumerate(self.optimizer.param_groups) for i, p in enumerate(group["params"])]


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None) -> _Names:
    """Check ``named_parameters`` as Horovod does and name every parameter of ``optimizer``."""
    if named_parameters is None:
        return _Names(optimizer, {})
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ConfigurationError("named_parameters should be a sequence of tuples (name, parameter), usually "
                                 "produced by model.named_parameters().")
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigurationError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                                 f"{', '.join(duplicates)}")
    by_id = {id(p): name for name, p in named}
    unnamed = [id(p) for group in optimizer.param_groups for p in group["params"] if id(p) not in by_id]
    if unnamed:
        raise ConfigurationError("named_parameters was specified, but one or more model parameters were not named. "
                                 f"Python object ids: {', '.join(str(i) for i in unnamed)}")
    return _Names(optimizer, by_id)


def _groups(groups: int | Sequence[Sequence[torch.nn.Parameter]] | None,
            params: Sequence[torch.nn.Parameter]) -> list[list[int]] | None:
    """Bucket groups (indices into ``params``, last parameters first) for Horovod's ``groups``."""
    if groups is None or groups == 0:
        return None
    order = list(reversed(range(len(params))))
    if isinstance(groups, int):
        if groups < 0:
            raise ConfigurationError(f"groups must be a non-negative number or lists of parameters, got {groups}.")
        count = min(groups, len(order))
        return [order[k * len(order) // count:(k + 1) * len(order) // count] for k in range(count)]
    index = {id(p): i for i, p in enumerate(params)}
    listed: list[list[int]] = []
    for group in groups:
        if any(id(p) not in index for p in group):
            raise ConfigurationError("groups must hold lists of the optimizer's trainable parameters.")
        listed.append(sorted((index[id(p)] for p in group), reverse=True))
    seen = {i for group in listed for i in group}
    return listed + [[i] for i in order if i not in seen]  # a parameter in no list travels alone
