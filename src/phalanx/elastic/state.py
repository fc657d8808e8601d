"""``px.elastic.State``: what a worker carries across a change of membership.

A State holds named *objects* and named plain *values* (``epoch``, ``step``, a best metric).
Objects take part through a protocol, not by type: anything with ``state_dict``/``load_state_dict``
(the model, the optimizer, the LR scheduler, a loader) is an object, and an object, or a submodule
of a module object, that also has ``reshard(rank, world_size)`` is told its place in a re-formed
group before its committed state is loaded (``DistributedLoader`` and ``DataParallel`` do).
:meth:`State.commit` copies all of them into memory at a step boundary; :meth:`State.restore`
puts them back; :meth:`State.sync` makes every member's
committed state the same, broadcasting it from the member with the newest commit (a survivor) to
the others (joiners), so a joiner receives the state from a peer, not from disk.
"""

from __future__ import annotations

import collections
import copy
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from phalanx import faults, rng
from phalanx.atomic import save_atomically
from phalanx.comm import codec, collectives, runtime
from phalanx.errors import CheckpointError, ConfigurationError, PhalanxError

CHECKPOINT_FORMAT = "phalanx.elastic.State"
_OWN_ATTRIBUTES = frozenset({"checkpoint_path", "recoveries", "verbose"})


class MembershipChanged(PhalanxError):
    """Raised by :meth:`State.commit` when the group changes at this step boundary.

    ``reason`` is ``"planned"`` (workers are waiting to join) or ``"failure"`` (a member was lost).
    Let it propagate to :func:`px.elastic.run`, which re-forms the group and calls the function again.
    """

    def __init__(self, reason: str):
        super().__init__(f"the elastic group changes at this step boundary ({reason}); "
                         "let px.elastic.run handle it.")
        self.reason = reason


@dataclass(frozen=True)
class Recovery:
    """One change of membership, measured on this worker.

    ``detected_to_step_s``: from this worker noticing the change (a failed collective, or the
    signal at a commit) to the next completed step. ``event_to_step_s``: from the event itself
    (the launcher seeing a worker exit, the coordinator declaring one dead, or the first request)
    to the next completed step, by wall clock across hosts. ``reform_s``: the part spent forming
    the new group and synchronising the state. ``event_to_commit_s``: from the event to the first
    commit after it, where the steps since the last commit before it were trained again (a loop
    that commits less often than every step, and tells the State of each step: :meth:`State.stepped`);
    the same as ``event_to_step_s`` where every step is committed.
    """

    generation: int
    size: int
    reason: str
    lost: tuple[int, ...]
    joined: tuple[int, ...]
    reform_s: float
    detected_to_step_s: float
    event_to_step_s: float
    event_to_commit_s: float | None = None


class State:
    """Model, optimizer, loader, scheduler and counters, committed in memory at step boundaries.

    ``State(model=model, optimizer=opt, loader=loader, scheduler=sched, epoch=0, step=0)``: every
    keyword whose value has ``state_dict``/``load_state_dict`` is an object, every other one a
    value read and written as an attribute (``state.step += 1``). A State is committed once when
    made. ``checkpoint_path``: where a survivor saves the last commit when the job falls below its
    minimum number of workers. When it holds one object whose ``state_dict()`` has an integer
    ``epoch`` (a DistributedLoader's position), the value ``epoch`` follows it: the commit after an
    epoch's last batch sets it to the next epoch.
    """

    def __init__(self, *, checkpoint_path: str | os.PathLike[str] | None = None, verbose: bool = True,
                 **entries: Any):
        if not entries:
            raise ConfigurationError("State() needs something to hold: State(model=..., optimizer=..., step=0).")
        objects, values = {}, {}
        for name, entry in entries.items():
            if name.startswith("_") or name in _OWN_ATTRIBUTES or hasattr(type(self), name):
                raise ConfigurationError(f"State(): '{name}' is a reserved name; choose another.")
            refused = getattr(entry, "whole_commit_refused", None)
            if callable(refused):
                raise ConfigurationError(f"State({name}=...): {refused()}.")
            if _is_stateful(entry):
                objects[name] = entry
            else:
                values[name] = entry
        object.__setattr__(self, "_objects", objects)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "checkpoint_path", None if checkpoint_path is None else os.fspath(checkpoint_path))
        object.__setattr__(self, "verbose", verbose)
        object.__setattr__(self, "recoveries", [])
        object.__setattr__(self, "_committed", None)
        object.__setattr__(self, "_fresh", True)
        object.__setattr__(self, "_pending_recovery", None)
        object.__setattr__(self, "_committed_rng", None)
        self._snapshot(version=0)

    # --- attribute access -------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        objects, values = self.__dict__["_objects"], self.__dict__["_values"]
        if name in objects:
            return objects[name]
        if name in values:
            return values[name]
        raise AttributeError(f"State has no entry '{name}'; entries: {sorted([*objects, *values])}.")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN_ATTRIBUTES or (name.startswith("_") and name in self.__dict__):
            object.__setattr__(self, name, value)
        elif name in self._objects:
            raise AttributeError(f"State entry '{name}' is an object; change it in place, not by assignment.")
        elif name.startswith("_"):
            raise AttributeError(f"cannot set '{name}' on a State.")
        else:
            self._values[name] = value

    @property
    def version(self) -> int:
        """How many commits the committed state has seen (the same on every member after sync)."""
        return int(self._committed["version"])

    def __repr__(self) -> str:
        return f"State(objects={list(self._objects)}, values={self._values!r}, version={self.version})"

    # --- commit and restore -----------------------------------------------------------------

    def commit(self) -> None:
        """Copy every object and value into memory: the point a recovery comes back to.

        Call it after each optimizer step, when every rank has finished the same step. In an
        elastic launch it also reads one store key and raises :class:`MembershipChanged` when the
        group is about to change at this boundary (joiners are admitted, or a member was lost).
        """
        self._snapshot(self.version + 1)
        self._report_recovery(at_commit=True)
        if runtime.is_elastic():
            _check_membership(self.version)

    def stepped(self) -> None:
        """Tell the State a step finished, in a loop that commits less often than every step: the
        first step after a re-form then ends the recovery's clock (``Recovery.event_to_step_s``),
        and the next commit says when the steps trained again were made up."""
        self._report_recovery(at_commit=False)

    def restore(self) -> None:
        """Put every object and value back as committed, for the current world.

        Objects (and submodules) with ``reshard`` are first given this worker's rank and the world
        size, in the same order on every member, so they may run collectives; then every object
        loads its committed state and gradients are cleared. A member that made the commit being
        restored also gets its random streams back (torch, CUDA, Python, NumPy), so the step
        redone after a failure draws the same dropout masks as before. Called by px.elastic.run after each
        change of membership, on every member.
        """
        snapshot = _copy_tree(self._committed, None)  # objects may keep references to what they load
        for participant in self._reshardable():
            participant.reshard(runtime.rank(), runtime.size())
        for name, entry in self._objects.items():
            entry.load_state_dict(snapshot["objects"][name])
        self._values.clear()
        self._values.update(snapshot["values"])
        version, streams = self._committed_rng
        if version == self.version:  # this member made the commit restored: its random streams go back too
            rng.set_state(streams)
        for module in self._modules():
            for param in module.parameters():
                param.grad = None

    def sync(self, root: int | None = None) -> int:
        """Make every member's committed state that of ``root``; return the root used.

        By default the root is the member with the newest commit (lowest rank among equals). The
        state is broadcast only when it can differ: when a member is new (a joiner, or the first
        sync of a job) or commits differ; otherwise members exchange only a small summary. Every
        member of the group must call it. Follow it with :meth:`restore` to load the result.
        """
        if runtime.size() == 1:
            object.__setattr__(self, "_fresh", False)
            return 0
        faults.point("state.sync")
        mine = {"version": self.version, "fresh": self._fresh, "names": sorted([*self._objects, *self._values])}
        everyone = collectives.allgather_object(mine)
        _check_same_entries(everyone)
        if root is None:
            root = max(range(len(everyone)), key=lambda r: (not everyone[r]["fresh"], everyone[r]["version"], -r))
        elif not 0 <= root < len(everyone):
            raise ConfigurationError(f"sync(root={root}): root must be a rank in [0, {len(everyone)}).")
        if any(e["fresh"] for e in everyone) or len({e["version"] for e in everyone}) > 1:
            committed = _broadcast_tree(self._committed if runtime.rank() == root else None, root)
            object.__setattr__(self, "_committed", committed)
        object.__setattr__(self, "_fresh", False)
        return root

    # --- checkpoints ------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write the last commit to ``path`` (default ``checkpoint_path``) atomically; return the path."""
        path = os.fspath(path if path is not None else self.checkpoint_path or "")
        if not path:
            raise ConfigurationError("State.save(): pass a path or construct the State with checkpoint_path=.")
        try:
            save_atomically({"format": CHECKPOINT_FORMAT, "state": self._committed}, path)
        except OSError as error:
            raise CheckpointError(f"rank {runtime.rank()}: could not write the elastic checkpoint {path}: {error}") \
                from error
        return path

    def load(self, path: str | os.PathLike[str]) -> None:
        """Read a checkpoint written by :meth:`save`, commit it and restore it."""
        try:
            data = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
        except (OSError, RuntimeError) as error:
            raise CheckpointError(f"could not read the elastic checkpoint {path}: {error}") from error
        if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} was not written by px.elastic.State.save().")
        object.__setattr__(self, "_committed", data["state"])
        object.__setattr__(self, "_committed_rng", (-1, None))  # not this process's commit: streams stay
        self.restore()

    # --- internals --------------------------------------------------------------------------

    def _snapshot(self, version: int) -> None:
        states = {name: entry.state_dict() for name, entry in self._objects.items()}
        self._follow_epoch(states)
        captured = {"version": version, "objects": states, "values": self._values}
        object.__setattr__(self, "_committed", _copy_tree(captured, self._committed))
        object.__setattr__(self, "_committed_rng", (version, rng.get_state()))

    def _follow_epoch(self, states: dict[str, Any]) -> None:
        """Set the value ``epoch`` from the one object whose state holds an integer epoch (the loader)."""
        if "epoch" not in self._values:
            return
        epochs = [state["epoch"] for state in states.values()
                  if isinstance(state, dict) and isinstance(state.get("epoch"), int)]
        if len(epochs) == 1:
            self._values["epoch"] = epochs[0]

    def _modules(self) -> list[nn.Module]:
        return [entry for entry in self._objects.values() if isinstance(entry, nn.Module)]

    def _reshardable(self) -> list[Any]:
        """Objects and submodules of module objects that implement ``reshard``, each once, in a fixed order."""
        found: dict[int, Any] = {}
        for entry in self._objects.values():
            members = entry.modules() if isinstance(entry, nn.Module) else (entry,)
            for member in members:
                if callable(getattr(member, "reshard", None)):
                    found.setdefault(id(member), member)
        return list(found.values())

    def _begin_recovery(self, detected: float) -> None:
        object.__setattr__(self, "_pending_recovery", {"detected": detected, "reformed": None})

    def _reformed(self) -> None:
        if self._pending_recovery is not None:
            self._pending_recovery["reformed"] = time.monotonic()

    def _report_recovery(self, at_commit: bool) -> None:
        pending = self._pending_recovery
        if pending is None or pending["reformed"] is None:
            return
        view = runtime.membership()
        if view is None:
            object.__setattr__(self, "_pending_recovery", None)
            return
        since_event = max(0.0, time.time() - view.event_time) if view.event_time else float("nan")
        if at_commit:
            object.__setattr__(self, "_pending_recovery", None)
        if pending.get("stepped"):  # the first step was reported: this is the first commit after it
            if at_commit:
                self.recoveries[-1] = replace(self.recoveries[-1], event_to_commit_s=since_event)
                if view.lost:  # a join changes the group at a commit: nothing is trained again
                    self._say(f"phalanx elastic: generation {view.generation} back past its last commit before the "
                              f"change (the steps since it trained again) {since_event:.2f}s after the event")
            return
        pending["stepped"] = True
        record = Recovery(view.generation, view.size, view.reason, view.lost, view.joined,
                          reform_s=pending["reformed"] - pending["detected"],
                          detected_to_step_s=time.monotonic() - pending["detected"], event_to_step_s=since_event,
                          event_to_commit_s=since_event if at_commit else None)
        self.recoveries.append(record)
        change = ", ".join(part for part in (
            f"lost member(s) {list(view.lost)}" if view.lost else "",
            f"joined member(s) {list(view.joined)}" if view.joined else "") if part) or view.reason
        self._say(f"phalanx elastic: generation {view.generation} with {view.size} worker(s) ({change}): "
                  f"first step done {record.event_to_step_s:.2f}s after the event, "
                  f"{record.detected_to_step_s:.2f}s after detection (re-forming took {record.reform_s:.2f}s)")

    def _say(self, message: str) -> None:
        if self.verbose and runtime.rank() == 0:
            print(message, file=sys.stderr, flush=True)


def _is_stateful(entry: Any) -> bool:
    return callable(getattr(entry, "state_dict", None)) and callable(getattr(entry, "load_state_dict", None))


def _check_membership(version: int) -> None:
    """One store read per commit; raise MembershipChanged when this boundary ends the generation."""
    view = runtime.membership()
    if view is None:
        return
    ending = runtime.generation_ending(view.generation)
    if ending is None:
        return
    if ending == "failure":
        raise MembershipChanged("failure")
    # Members are at most one commit apart (each step synchronises), so the first to see the
    # signal proposes the next commit, and every member ends the generation right after it.
    boundary = runtime.agree_boundary(view.generation, version + 1)
    if boundary is None:  # a value without the job's secret holds the key: end it as after a failure
        raise MembershipChanged("failure")
    if version >= boundary:
        raise MembershipChanged("planned")


def _check_same_entries(everyone: list[dict[str, Any]]) -> None:
    names = everyone[0]["names"]
    for rank, entry in enumerate(everyone):
        if entry["names"] != names:
            raise ConfigurationError(
                f"rank {runtime.rank()}: the State on rank {rank} holds {entry['names']} but rank 0's holds {names}; "
                "every worker must build its State with the same entries."
            )


# --- copying and broadcasting nested state ----------------------------------------------------


def _copy_tree(value: Any, previous: Any) -> Any:
    """A deep copy of ``value``; tensors are copied into ``previous``'s matching tensors when possible."""
    if isinstance(value, torch.Tensor):
        if (isinstance(previous, torch.Tensor) and previous is not value and previous.shape == value.shape
                and previous.dtype == value.dtype and previous.device == value.device):
            return previous.copy_(value.detach())
        return value.detach().clone()
    if isinstance(value, dict):
        before = previous if isinstance(previous, dict) else {}
        copied = collections.OrderedDict() if isinstance(value, collections.OrderedDict) else {}
        for key, item in value.items():
            copied[key] = _copy_tree(item, before.get(key))
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            copied._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return copied
    if isinstance(value, (list, tuple)):
        before = previous if isinstance(previous, type(value)) and len(previous) == len(value) else [None] * len(value)
        items = [_copy_tree(item, old) for item, old in zip(value, before)]
        return items if isinstance(value, list) else type(value)(items) if type(value) is tuple else \
            type(value)(*items)
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    return copy.deepcopy(value)


class _Slot:
    """Where the ``index``-th tensor goes back into a broadcast tree."""

    def __init__(self, index: int):
        self.index = index


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, dict):
        flat = collections.OrderedDict() if isinstance(value, collections.OrderedDict) else {}
        for key, item in value.items():
            flat[key] = _flatten(item, tensors)
        if getattr(value, "_metadata", None) is not None:
            flat._metadata = value._metadata  # type: ignore[attr-defined]
        return flat
    if isinstance(value, list):
        return [_flatten(item, tensors) for item in value]
    if type(value) is tuple:
        return tuple(_flatten(item, tensors) for item in value)
    return value


def _unflatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, dict):
        for key in list(value):
            value[key] = _unflatten(value[key], tensors)
        return value
    if isinstance(value, list):
        return [_unflatten(item, tensors) for item in value]
    if type(value) is tuple:
        return tuple(_unflatten(item, tensors) for item in value)
    return value


torch.serialization.add_safe_globals([_Slot])  # the one class of ours a state's structure may hold


def _broadcast_tree(tree: Any, root: int) -> Any:
    """``root``'s nested state on every rank: the structure once, as ``torch.save`` bytes loaded with
    ``weights_only=True`` (nothing a peer sends can run code), the tensors in one broadcast per dtype."""
    is_root = runtime.rank() == root
    tensors: list[torch.Tensor] = []
    skeleton = _flatten(tree, tensors) if is_root else None
    specs = [(tuple(t.shape), t.dtype, t.is_cuda) for t in tensors]
    skeleton, specs = _broadcast_structure((skeleton, specs) if is_root else None, root)
    if not is_root:
        tensors = [torch.empty(shape, dtype=dtype, device=runtime.device() if cuda else "cpu")
                   for shape, dtype, cuda in specs]
    collectives.broadcast_tensors_(tensors, root)
    return tree if is_root else _unflatten(skeleton, tensors)


def _broadcast_structure(structure: Any, root: int) -> Any:
    """``root``'s ``structure`` (containers, numbers, strings, dtypes, slots) on every rank, through the
    safe codec; one that ``torch.load(weights_only=True)`` would refuse raises :class:`ConfigurationError`
    on every rank."""
    try:
        return collectives.broadcast_object(structure, root, safe=True)
    except ConfigurationError as error:  # on every rank; the root's cause names the value's type
        raise ConfigurationError(
            f"the elastic state of rank {root} holds a value that cannot travel safely: a state's values must be "
            f"{codec.SAFE_CONTENTS}. Keep other objects out of the state, or store their numbers."
        ) from error.__cause__ or error
