"""The optimizer behind px.LocalSGD and px.DiLoCo: inner steps, and exchanges at each fragment's turn.

:class:`LocalSteps` wraps the user's optimizer (the inner one): ``step()`` steps it on this worker's
own gradients, counts the step and starts or merges the exchanges due (the schedule is
:mod:`phalanx.strategies.local_sgd`'s docstring). An exchange is one
:class:`~phalanx.parallel.reductions.Reduction` call per bucket of a fragment (one bucket per
dtype and device), started without waiting; what each worker contributes and what the sum does
differ: LocalSGD sends its share of the parameters and takes the average, DiLoCo
(:class:`OuterSteps`) sends its share of the outer gradient and steps the outer optimizer with it.

The state: ``state_dict``/``load_state_dict`` are this worker's own (an elastic commit copies them
every step; a loop of your own may save them), and drop an exchange in flight on load (its
fragment synchronizes at its next turn; TopK's residual goes back to before it). ``px.fit``'s
checkpoints need every worker's state, which differs between synchronizations, so every rank
writes its own beside rank 0's file (``checkpoint_pieces``, through :mod:`phalanx.tensor_pieces`):
``model/<name>`` the consensus weights (DiLoCo's parameters of the last outer step, LocalSGD's
average now), ``rank<r>/...`` that rank's weights, inner optimizer state and reduction state,
``outer/...`` the outer optimizer's state and ``exchange/...`` the sums of exchanges in flight,
waited for, which a resume merges at their step: it continues exactly.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from phalanx import profile, tensor_pieces
from phalanx.comm import collectives, runtime
from phalanx.errors import CheckpointError, CollectiveMismatchError, ConfigurationError
from phalanx.parallel import reductions
from phalanx.parallel.buckets import Bucket, plan_buckets
from phalanx.parallel.data_parallel import DataParallel
from phalanx.parallel.reductions import Reduction, Waitable
from phalanx.strategies.held import HeldOptimizer

#: The key of the strategy's own entries in the optimizer's state dicts.
KEY = "local_steps"

#: Makes the outer optimizer from the tensors it steps.
OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class Fragment:
    """Parameters synchronized together: their buckets (one per dtype and device), the exchange in
    flight, and the step at which they were last the workers' consensus."""

    def __init__(self, index: int, offset: int, indices: list[int], params: Sequence[torch.Tensor]):
        self.index, self.offset, self.indices = index, offset, indices
        self.buckets = _buckets(indices, params)
        self.handles: list[Waitable] | None = None  # in flight; [] once summed but not merged yet
        self.started: int | None = None  # the step whose exchange is in flight
        self.synced = 0


class LocalSteps(HeldOptimizer):
    """LocalSGD's optimizer: the user's, stepped on this worker's own gradients; its ``step()`` also
    averages each fragment of the parameters at its turn (see the module's docstring).

    ``state_dict``/``load_state_dict`` are this worker's own (an elastic commit, a loop of your own);
    ``px.fit``'s checkpoints have every rank write its own state beside rank 0's file instead
    (``checkpoint_pieces``), and the weights of the consensus as the model's.
    """

    strategy = "px.LocalSGD"

    def __init__(self, optimizer: torch.optim.Optimizer, model: DataParallel, period: int, fragments: int = 1,
                 delay: int = 0, reduction: Reduction | None = None):
        super().__init__(optimizer)
        self.model, self.period, self.delay = model, period, delay
        self.reduction = reduction if reduction is not None else reductions.Average()
        named = [(name, p) for name, p in model.module.named_parameters() if p.requires_grad]
        self.names, self.params = [name for name, _ in named], [p for _, p in named]
        runs = _cut(self.params, fragments, self.strategy)
        self.fragments = [Fragment(i, i * period // fragments, run, self.params) for i, run in enumerate(runs)]
        self.steps = 0  # inner steps taken

    # --- the steps ---------------------------------------------------------------------------

    def held_beside(self) -> list[torch.Tensor]:
        """The buffers the parameters are exchanged in: a copy of the weights."""
        return [bucket.flat for fragment in self.fragments for bucket in fragment.buckets]

    @torch.no_grad()
    def _step(self) -> None:
        """The inner step; then the exchanges that start after this step, and those due to merge."""
        if self.steps == 0:
            self._begin()
        self.optimizer.step()
        self.steps += 1
        for fragment in self.fragments:
            if self._starts_after(fragment, self.steps):
                self._start(fragment)
        for fragment in self.fragments:
            if self._merges_after(fragment, self.steps):
                self._merge(fragment)

    def _starts_after(self, fragment: Fragment, step: int) -> bool:
        """Whether ``fragment``'s exchange starts after inner step ``step`` (counted from 1)."""
        return step % self.period == fragment.offset

    def _merges_after(self, fragment: Fragment, step: int) -> bool:
        """Whether ``fragment``'s exchange in flight is merged after inner step ``step``."""
        return fragment.started is not None and step - fragment.started >= self.delay

    def merges_in_next_step(self) -> bool:
        """Whether the next ``step()`` completes an exchange (one in flight, or one it starts without
        delay): the workers meet there."""
        coming = self.steps + 1
        return any(self._merges_after(fragment, coming) or self.delay == 0 and self._starts_after(fragment, coming)
                   for fragment in self.fragments)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Merge the exchanges in flight and synchronize every fragment that changed since its last
        merge, now: every worker then holds the same weights (the end of training)."""
        for fragment in self.fragments:
            if fragment.started is not None:
                self._merge(fragment)
        stale = [fragment for fragment in self.fragments if fragment.synced != self.steps]
        for fragment in stale:
            self._start(fragment)
        for fragment in stale:
            self._merge(fragment)

    def _start(self, fragment: Fragment) -> None:
        self._agree_on_schedule(fragment)
        share = 1.0 / runtime.size()
        for bucket in fragment.buckets:
            for slot, index in enumerate(bucket.param_indices):
                self._contribution(index, bucket.views[slot], share)
        fragment.handles = [self.reduction.reduce(bucket) for bucket in fragment.buckets]
        fragment.started = self.steps
        profile.mark("outer_start", fragment=fragment.index, step=self.steps,
                     bytes=sum(bucket.flat.numel() * bucket.flat.element_size() for bucket in fragment.buckets))

    def _agree_on_schedule(self, fragment: Fragment) -> None:
        """Every rank starts the same fragment's exchange at the same step count, or every rank raises:
        ranks whose states differ (a loop of your own that loaded another optimizer state on some rank)
        would otherwise exchange buffers of different sizes, which Gloo answers by aborting the
        process. One allgather of two numbers an exchange, where the workers meet anyway."""
        if runtime.size() == 1:
            return
        seen = collectives.allgather(torch.tensor([self.steps, fragment.index]), check=False).view(-1, 2).tolist()
        if any(entry != seen[0] for entry in seen):
            at = ", ".join(f"rank {rank} after step {steps} (fragment {index})" for rank, (steps, index) in enumerate(seen))
            raise CollectiveMismatchError(
                f"{self.strategy}'s workers disagree on when to exchange: {at}. Every worker must hold the same "
                "step count and schedule: load the same optimizer state on every rank (each rank's own "
                "state_dict() differs only in its weights and inner state, not in its step count), or none.")

    def _merge(self, fragment: Fragment) -> None:
        began = time.perf_counter()
        for handle in fragment.handles or ():
            handle.wait()
        profile.mark("outer_merge", fragment=fragment.index, step=self.steps, waited=time.perf_counter() - began)
        self._apply(fragment)
        fragment.handles, fragment.started, fragment.synced = None, None, self.steps

    def _begin(self) -> None:
        """Before the first inner step, the replicas are equal (in an elastic launch only since the
        first training forward): nothing to note here."""

    def _contribution(self, index: int, into: torch.Tensor, share: float) -> None:
        """Write this worker's part of the sum for parameter ``index``: its share of the parameter."""
        torch.mul(self.params[index].detach(), share, out=into)

    def _apply(self, fragment: Fragment) -> None:
        """The sum arrived: the average replaces the parameters."""
        for bucket in fragment.buckets:
            for slot, index in enumerate(bucket.param_indices):
                self.params[index].copy_(bucket.views[slot])

    def _consensus(self) -> list[torch.Tensor]:
        """The parameters every worker agrees on: here their average, now (collective)."""
        share = 1.0 / runtime.size()
        return [collectives.allreduce(p.detach() * share, check=False) for p in self.params]

    def _complete_in_flight(self) -> None:
        """Wait for the exchanges in flight; they stay due to merge at their step."""
        for fragment in self.fragments:
            for handle in fragment.handles or ():
                handle.wait()
            if fragment.handles is not None:
                fragment.handles = []

    def forget_in_flight(self) -> None:
        """Drop the exchanges in flight without waiting (a failure, or a state loaded over them): their
        fragments take fresh buckets and synchronize at their next turn."""
        for fragment in self.fragments:
            if fragment.started is not None:
                fragment.buckets = _buckets(fragment.indices, self.params)
                fragment.handles = fragment.started = None

    def reshard(self, rank: int, world_size: int) -> None:
        """In a re-formed group (after the model laid out new gradient buckets): they are never used."""
        leave_gradients_local(self.model)

    # --- this worker's state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, with this worker's step count, fragments and exchange state."""
        return {**self.optimizer.state_dict(), KEY: {
            "steps": self.steps, "synced": [f.synced for f in self.fragments],
            "in_flight": [f.index for f in self.fragments if f.started is not None],
            "contexts": [[dict(b.context) for b in f.buckets] for f in self.fragments], **self._own_state()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state of :meth:`state_dict`, or a plain optimizer's (the weights loaded are then the
        consensus). An exchange in flight, here or in the state, is dropped: its fragment synchronizes
        at its next turn."""
        own = state_dict.get(KEY)
        self.optimizer.load_state_dict({key: value for key, value in state_dict.items() if key != KEY})
        self.forget_in_flight()
        self.steps = own["steps"] if own is not None else 0
        for index, fragment in enumerate(self.fragments):
            fragment.synced = own["synced"][index] if own is not None else 0
            for position, bucket in enumerate(fragment.buckets):
                bucket.context = dict(own["contexts"][index][position]) if own is not None else {}
                if own is not None and index in own["in_flight"]:
                    self.reduction.rollback(bucket.context)  # TopK's residual as before that exchange
        self._load_own(own)

    def _own_state(self) -> dict[str, Any]:
        return {}

    def _load_own(self, own: dict[str, Any] | None) -> None:
        """Nothing more: the parameters are the model's."""

    # --- px.fit's checkpoints: every rank writes its own state -----------------------------

    def hyperparameters(self) -> dict[str, Any]:
        """What rank 0's checkpoint file holds: the inner optimizer's state dict without any
        parameter's state, the step count and the exchanges in flight (the same on every rank)."""
        return {**self.optimizer.state_dict(), "state": {}, KEY: {
            "steps": self.steps, "synced": [f.synced for f in self.fragments], "world_size": runtime.size(),
            "in_flight": {f.index: f.started for f in self.fragments if f.started is not None},
            **self._own_hyperparameters()}}

    def checkpoint_pieces(self) -> dict[str, Any]:
        """The consensus weights (``model/<name>``, what ``px.checkpoint_weights`` reads), this rank's
        weights, inner optimizer state and reduction state (``rank<r>/...``) and the sums of the
        exchanges in flight, waited for (collective)."""
        self._complete_in_flight()
        consensus = dict(zip(self.names, self._consensus()))
        mine = f"rank{runtime.rank()}"
        pieces: dict[str, Any] = {f"model/{name}": consensus.get(name, param.detach())
                                  for name, param in self.model.module.named_parameters()}
        pieces.update({f"{mine}/weights/{key}": value for key, value in self.model.module.state_dict().items()})
        for index, entries in self.optimizer.state_dict()["state"].items():
            pieces.update({f"{mine}/inner/{index}/{key}": _tensor(key, value) for key, value in entries.items()
                           if value is not None})
        for fragment in self.fragments:
            for bucket in fragment.buckets:
                pieces.update({f"{mine}/context/{fragment.index}/{bucket.index}/{key}": value
                               for key, value in bucket.context.items() if torch.is_tensor(value)})
                if fragment.started is not None:
                    pieces[f"exchange/{fragment.index}/{bucket.index}"] = bucket.flat
        pieces.update(self._own_pieces())
        return pieces

    @torch.no_grad()
    def load_checkpoint_pieces(self, folder: Path, hyperparameters: dict[str, Any]) -> None:
        """Take this rank's state from ``folder`` (at another worker count, that of rank ``r`` modulo
        the old count), with the exchanges that were in flight, summed, to merge at their step."""
        own = hyperparameters.get(KEY)
        if own is None:
            raise CheckpointError(
                f"{folder} was written in pieces by another strategy, which {self.strategy} cannot resume: resume "
                "with that strategy, or start afresh from its weights (model.load_state_dict(px.checkpoint_weights("
                "path))) with another checkpoint_dir.")
        mine = f"rank{runtime.rank() % own['world_size']}/"
        wanted = (mine, "exchange/", *self._shared_prefixes())
        targets = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in tensor_pieces.contents(folder).items()
                   if key.startswith(wanted)}
        tensor_pieces.load(targets, folder)
        self.model.module.load_state_dict(_under(targets, mine + "weights/"))
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in _under(targets, mine + "inner/").items():
            index, name = key.split("/", 1)
            state.setdefault(int(index), {})[name] = value
        self.optimizer.load_state_dict({**{k: v for k, v in hyperparameters.items() if k != KEY}, "state": state})
        self.forget_in_flight()
        self.steps = own["steps"]
        for fragment, synced in zip(self.fragments, own["synced"]):
            fragment.synced = synced
            fragment.started = own["in_flight"].get(fragment.index)
            fragment.handles = None if fragment.started is None else []
            for bucket in fragment.buckets:
                bucket.context = _under(targets, f"{mine}context/{fragment.index}/{bucket.index}/")
                if fragment.started is not None:
                    bucket.flat.copy_(targets[f"exchange/{fragment.index}/{bucket.index}"])
        self._load_own_pieces(targets, own)

    def first_nonfinite(self) -> str | None:
        """The name of a parameter holding NaN or Inf on any rank, the same on every rank (collective)."""
        local = next((name for name, p in zip(self.names, self.params) if not bool(torch.isfinite(p).all())), None)
        found = [name for name in collectives.allgather_object(local, safe=True) if name is not None]
        return found[0] if found else None

    def _own_hyperparameters(self) -> dict[str, Any]:
        return {}

    def _own_pieces(self) -> dict[str, Any]:
        return {}

    def _shared_prefixes(self) -> tuple[str, ...]:
        """What a resume reads beyond this rank's own state and the exchanges: nothing more here."""
        return ()

    def _load_own_pieces(self, targets: dict[str, torch.Tensor], own: dict[str, Any]) -> None:
        """Nothing more: the parameters are the model's."""


class OuterSteps(LocalSteps):
    """DiLoCo's optimizer: the inner steps as :class:`LocalSteps`; an exchange averages the outer
    gradient (the parameters of the last outer step minus this worker's) and the outer optimizer
    applies it to those saved parameters, which every worker then goes on from."""

    strategy = "px.DiLoCo"

    def __init__(self, optimizer: torch.optim.Optimizer, model: DataParallel, period: int, fragments: int,
                 delay: int, reduction: Reduction, outer_optimizer: OuterOptimizer):
        super().__init__(optimizer, model, period, fragments, delay, reduction)
        self.globals = [p.detach().clone() for p in self.params]  # the parameters of the last outer step
        self.outer = outer_optimizer(self.globals)

    def held_beside(self) -> list[torch.Tensor]:
        """LocalSGD's, the parameters of the last outer step and the outer optimizer's state."""
        state = [value for entry in self.outer.state.values() for value in entry.values() if torch.is_tensor(value)]
        return [*super().held_beside(), *self.globals, *state]

    def _begin(self) -> None:
        """The replicas' first weights are the first outer step's (taken now rather than at setup:
        an elastic launch makes the replicas equal at the first training forward)."""
        for saved, param in zip(self.globals, self.params):
            saved.copy_(param)

    def _contribution(self, index: int, into: torch.Tensor, share: float) -> None:
        torch.sub(self.globals[index], self.params[index].detach(), out=into).mul_(share)

    def _apply(self, fragment: Fragment) -> None:
        """The outer step on the fragment's saved parameters (the others have no gradient, so the
        outer optimizer leaves them alone); its parameters become the result."""
        members = [(index, bucket.views[slot]) for bucket in fragment.buckets
                   for slot, index in enumerate(bucket.param_indices)]
        for index, summed in members:
            self.globals[index].grad = summed
        self.outer.step()
        for index, _ in members:
            self.globals[index].grad = None
            self.params[index].copy_(self.globals[index])

    def _consensus(self) -> list[torch.Tensor]:
        return self.globals

    def _own_state(self) -> dict[str, Any]:
        return {"globals": self.globals, "outer": self.outer.state_dict()}

    def _load_own(self, own: dict[str, Any] | None) -> None:
        with torch.no_grad():
            for saved, loaded in zip(self.globals, own["globals"] if own is not None else self.params):
                saved.copy_(loaded)
        if own is not None:
            self.outer.load_state_dict(own["outer"])

    def _own_hyperparameters(self) -> dict[str, Any]:
        return {"outer": {**self.outer.state_dict(), "state": {}}}

    def _own_pieces(self) -> dict[str, Any]:
        """The outer optimizer's state, the same on every rank."""
        return {f"outer/{index}/{key}": _tensor(key, value)
                for index, entries in self.outer.state_dict()["state"].items()
                for key, value in entries.items() if value is not None}

    def _shared_prefixes(self) -> tuple[str, ...]:
        return ("model/", "outer/")

    def _load_own_pieces(self, targets: dict[str, torch.Tensor], own: dict[str, Any]) -> None:
        for name, saved in zip(self.names, self.globals):
            saved.copy_(targets[f"model/{name}"])
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in _under(targets, "outer/").items():
            index, name = key.split("/", 1)
            state.setdefault(int(index), {})[name] = value
        self.outer.load_state_dict({**own["outer"], "state": state})


def leave_gradients_local(model: DataParallel) -> None:
    """Free the gradient buckets of a model whose backward never reduces (it runs inside ``no_sync()``)."""
    if model.reducer is not None:
        model.reducer.release_buckets()


def _cut(params: Sequence[torch.Tensor], count: int, strategy: str) -> list[list[int]]:
    """The parameters' indices in ``count`` runs of about equal numbers of elements, in order: a
    parameter goes to the run its first element falls in."""
    total = sum(p.numel() for p in params)
    runs: list[list[int]] = [[] for _ in range(count)]
    seen = 0
    for index, param in enumerate(params):
        runs[min(count - 1, seen * count // max(total, 1))].append(index)
        seen += param.numel()
    if any(not run for run in runs):
        raise ConfigurationError(f"{strategy} cuts the model's {len(params)} trainable parameters, in order, into "
                                 f"{count} fragment(s) of about {total // count} elements, but some parameter is too "
                                 "large to leave each fragment one (or none is trainable): use fewer fragments.")
    return runs


def _buckets(indices: list[int], params: Sequence[torch.Tensor]) -> list[Bucket]:
    groups = plan_buckets([params[i] for i in indices], math.inf)  # one per dtype and device
    return [Bucket.allocate(b, [indices[k] for k in group], params) for b, group in enumerate(groups)]


def _tensor(key: str, value: Any) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise CheckpointError(f"an optimizer's state holds '{key}' = {value!r}, not a tensor, and the checkpoints of "
                              "px.LocalSGD and px.DiLoCo hold tensors only: use a torch optimizer, or one whose state "
                              "is tensors.")
    return value


def _under(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of ``tensors`` whose key starts with ``prefix``, keyed by the rest."""
    return {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
