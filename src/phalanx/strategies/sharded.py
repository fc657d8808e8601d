"""``px.Sharded``: the optimizer state (level 1) and the gradients (level 2) split over the workers.

The parameters a worker trains are laid out in *units*: runs of parameters of one optimizer
parameter group and dtype, about a gradient bucket long, in the order gradients become ready.
Each unit is one flat buffer the parameters are views of, cut into one contiguous chunk per rank
(``torch.tensor_split``'s cut); a unit is also exactly one of the gradient engine's buckets. A rank
owns its chunk of every unit: the user's optimizer (its class and hyperparameters, unchanged) steps
only those chunks, so Adam's two moments cost ``8 / W`` bytes per parameter instead of 8.

* Level 1: each bucket is all-reduced as in ``px.DataParallel``; a rank steps its chunk (a view of
  the reduced bucket), then every unit's chunks are all-gathered into the parameters. When every
  worker is on one CPU host (and reduces through shared memory) the units live once, in shared
  memory: each rank steps its chunk in place between two barriers and nothing is gathered.
* Level 2: each bucket is reduce-scattered instead, overlapped with backward as buckets are, so a
  rank receives only the sums of its chunk; after the step the buckets' memory is freed until the
  next backward, and between steps a worker holds no gradient but its chunk's. (With the units
  in shared memory the buckets are all-reduced through it instead, which costs no more there.)
  Where the CPU transport is shared memory the reduce-scatter and the all-gathers go through it,
  hierarchically across hosts: only the chunks of other hosts cross the link, half of an allreduce.
* On several hosts, at levels 1 and 2 by default where it holds no more per worker (and with
  ``shared_memory=True`` at any level): each host keeps the units once in its shared memory and
  its workers shard them (each host its own cut); the hosts are replicas, the buckets all-reduced as
  px.DataParallel's, so that nothing but its allreduce crosses the link (hybrid sharding).

An elementwise optimizer (SGD, Adam, AdamW, ...) computes the same numbers on a chunk as on the
whole tensors, bit for bit (checked on this machine for every torch optimizer below), so sharded
training equals ``px.DataParallel``'s, and with ``reproducible=True`` is bitwise the same for any
number of workers. An optimizer that needs whole tensors (LBFGS, Adafactor's factored moments,
SparseAdam) is refused by name; one of your own that is elementwise is accepted when named in
``elementwise=``. See docs/sharding.md.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from phalanx import tensor_pieces
from phalanx.comm import collectives, runtime
from phalanx.errors import CheckpointError, ConfigurationError
from phalanx.parallel.buckets import DEFAULT_FUSION_THRESHOLD_MB, Bucket
from phalanx.parallel.clipping import Clipping
from phalanx.parallel.data_parallel import DataParallel
from phalanx.parallel.reductions import Reduction
from phalanx.parallel.weights import ShareWeights, Weights
from phalanx.strategies.base import (FitOptions, OptimizerLike, Stateful, Strategy, held_bytes, one_copy_per_host,
                                     refuse, refuse_parameter_servers_launched, state_per_parameter, wrap)
from phalanx.strategies.held import HeldOptimizer
from phalanx.strategies import host_memory, shard_copies
from phalanx.strategies.gathering import Gathering, cut, dtype_name
from phalanx.strategies.shard_layout import Unit, check_stepped, chunk_bounds, lay_out

LEVELS = (1, 2, 3)
#: Optimizer steps between an elastic job's commits where the copies are kept in host memory: a
#: commit copies each rank's chunks of the weights and the optimizer state, up to 18 % of a step at 2
#: workers every step (bench_elastic_shard.py); every 4 steps 1-6 %, and a death costs at most 3
#: steps trained again.
COMMIT_EVERY = 4
#: The same where buddies keep the copies (the workers span hosts): a commit also sends the rank's
#: chunks over the network, 31.6 MB at 2 workers on the benchmark's MLP; every 4 steps that added
#: 8-12 % to a step at 2 workers (3-7 % at 3-4), so every 8 (a death costs at most 7 steps).
COMMIT_EVERY_TO_BUDDIES = 8

logger = logging.getLogger(__name__)

#: torch optimizers whose update of an element depends on that element alone (and scalars).
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta,
               torch.optim.ASGD, torch.optim.Rprop)


class ShardedReduction(Reduction):
    """Buckets laid out as the units; level 1 all-reduces each, level 2 reduce-scatters it (each rank
    receives the sums of its chunk, written where its chunk lies in the bucket)."""

    def __init__(self, units: Sequence[Unit], params: Sequence[nn.Parameter], scatter: bool):
        self.index = {id(p): i for i, p in enumerate(params)}
        self.relay(units, scatter)

    def relay(self, units: Sequence[Unit], scatter: bool) -> None:
        """Reduce into ``units`` (the same parameters, laid out for the current group)."""
        self.groups = [[self.index[id(p)] for p in unit.params] for unit in units]
        self.units = list(units)
        self.scatter = scatter
        self.name = "reduce-scatter to shards" if scatter else "allreduce, sharded step"

    def bucket_groups(self, groups: list[list[int]], params: Sequence[torch.Tensor]) -> list[list[int]]:
        return [list(group) for group in self.groups]

    def agree_order(self, observed: list[int], count: int) -> list[int] | None:
        """The units' order stays: the optimizer's shards are laid out on it."""
        return None

    def weights(self) -> Weights:
        """Sums are exact, as :class:`~phalanx.parallel.reductions.Average`'s: a step assumes the
        last one's global count (no count allreduce, a round trip that waits for the slowest rank
        as the backward starts), rescaled from the trailers where the count changed."""
        return ShareWeights(predict=True)

    def reduce(self, bucket: Bucket) -> Any:
        if not self.scatter:
            return super().reduce(bucket)
        own = self.units[bucket.index].own
        sums = collectives.reduce_scatter(bucket.gradient, "sum", async_op=True, check=False)
        counts = collectives.allreduce_(bucket.trailer, "sum", async_op=True, check=False)
        return _Scattered(sums, counts, bucket.gradient[own])


class _Scattered:
    """A reduce-scatter and the trailer's allreduce; ``wait`` puts this rank's sums in place."""

    def __init__(self, sums: Any, counts: Any, into: torch.Tensor):
        self.sums, self.counts, self.into = sums, counts, into

    def wait(self) -> None:
        self.into.copy_(self.sums.wait())
        self.counts.wait()


#: What a rank that calls the sharded optimizer's state dict alone is told.
_EVERY_RANK = ("px.Sharded's optimizer holds a chunk of the state on each rank, so every rank calls it, and one "
               "saves: state = optimizer.state_dict(); if px.rank() == 0: torch.save(state, path).")


class ShardedOptimizer(HeldOptimizer):
    """The user's optimizer, stepped on this rank's chunk of every unit, then the chunks all-gathered.

    ``param_groups`` are the user's (schedules set them; they are copied to the stepping optimizer
    at each step); ``state`` holds this rank's chunks only. ``state_dict``/``load_state_dict`` are
    collective and speak the user's optimizer's format, whole (a loop of your own may use them);
    ``px.fit``'s checkpoints write and read each rank's pieces instead (``checkpoint_pieces``).
    """

    strategy = "px.Sharded"

    def __init__(self, optimizer: torch.optim.Optimizer, units: list[Unit], model: DataParallel, level: int,
                 gathering: Gathering | None = None, shared: bool = False):
        super().__init__(optimizer)
        self.units, self.model, self.level, self.gathering = units, model, level, gathering
        self.shared = shared  # the units live once per host, in shared memory
        groups = [{**_hyperparameters(group), "params": [u.shard for u in units if u.group == index]}
                  for index, group in enumerate(optimizer.param_groups)]
        self.stepping = _same_kind(optimizer, groups)
        #: why this rank's chunks are not the committed ones, after a re-formed group could not rebuild
        #: them (no copies kept, or lost): a step then refuses until a state is loaded
        self.stale: str | None = None

    def whole_commit_refused(self) -> str:
        """Why an elastic ``State`` must not hold this optimizer as one object: its state dict gathers
        the whole state on every rank at each commit, and after a re-form it is laid out for the old group."""
        return ("px.Sharded's model and optimizer are committed by the strategy, each rank its own chunks: build "
                "the State with **strategy.committed(model, optimizer) in place of model= and optimizer= "
                "(docs/sharding.md, 'Elastic jobs')")

    def relay(self, units: list[Unit], gathering: Gathering | None, shared: bool) -> None:
        """Step ``units`` from now on (laid out again for a re-formed group), with a fresh instance of
        the user's optimizer over their chunks: its state is read next, from a checkpoint."""
        self.units, self.gathering, self.shared = units, gathering, shared
        groups = [{**_hyperparameters(group), "params": [u.shard for u in units if u.group == index]}
                  for index, group in enumerate(self.optimizer.param_groups)]
        self.stepping = _same_kind(self.optimizer, groups)

    @property
    def state(self) -> Any:
        return self.stepping.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.stepping.zero_grad(set_to_none=set_to_none)

    def clip_shards(self, clipping: Clipping) -> None:
        """Clip by the norm of the whole gradient: from the whole reduced gradient where every rank
        holds it (level 1, reproducible mode: the same numbers as unsharded clipping), else from the
        chunks' squared norms summed over ranks."""
        if self._whole_gradients():  # in the user's order, as unsharded clipping sums the norms
            clipping.clip_parameters(p for group in self.optimizer.param_groups for p in group["params"])
            return
        self._collect()
        clipping.clip_parameters((unit.shard for unit in self.units), sum_over_shards=_sum_over_ranks)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient about to be stepped to the 2-norm ``max_norm`` of the whole gradient, as
        ``torch.nn.utils.clip_grad_norm_`` over the unsharded model would, and return that norm
        (before clipping). Collective: every rank calls it between ``backward`` and ``step``. At
        levels 2 and 3 a rank holds only its chunks of the reduced gradient, so torch's own
        function over ``model.parameters()`` would clip by a norm of the wrong numbers."""
        if norm_type != 2.0:
            raise ConfigurationError(f"px.Sharded clips by the 2-norm of the whole gradient; norm_type={norm_type!r} "
                                     "is not supported: leave norm_type at 2.0.")
        clipping = Clipping(max_norm=max_norm)
        self.clip_shards(clipping)
        assert clipping.last_norm is not None  # set by every clip with a max_norm
        return torch.tensor(clipping.last_norm)

    def _whole_gradients(self) -> bool:
        """Whether every rank holds the whole reduced gradient (else only its chunks are summed)."""
        reduction = self._sharded_reduction()
        return runtime.size() == 1 or reduction is None or not reduction.scatter

    def _sharded_reduction(self) -> ShardedReduction | None:
        """The engine's reduction when it is this strategy's (reproducible mode sums its own way)."""
        reduction = getattr(self.model.reducer.summation, "reduction", None) if self.model.reducer else None
        return reduction if isinstance(reduction, ShardedReduction) else None

    def _collect(self) -> None:
        """Each shard's gradient: its chunk of the unit's reduced gradient (a view where it can be)."""
        for unit in self.units:
            whole = unit.full_gradient()
            unit.shard.grad = None if whole is None else whole[unit.own]

    @torch.no_grad()
    def _step(self) -> None:
        if self.stale is not None:
            raise CheckpointError(
                f"{self.stale}, so after the re-form this rank's chunks are not the committed ones: load a state "
                "before stepping (optimizer.load_state_dict with the model's weights, from a checkpoint), or train "
                "with px.fit and a checkpoint_dir, which resumes from the last checkpoint itself.")
        self._collect()
        for mine, theirs in zip(self.stepping.param_groups, self.optimizer.param_groups):
            mine.update(_hyperparameters(theirs))
        if self.shared:
            collectives.host_barrier()  # nobody on this host reads the parameters while they change
        self.stepping.step()
        if self.shared:
            collectives.host_barrier()
        elif self.gathering is not None:
            self.gathering.after_step()  # gathered copies are stale now
        else:
            self._gather()
        if self.level >= 2 and self._sharded_reduction() is not None:
            self.model.reducer.release_buckets()
            for unit in self.units:
                unit.shard.grad = None

    def _gather(self) -> None:
        """Every rank's updated chunks into every unit's parameters (one all-gather per unit, all in
        flight), arriving straight into the flat buffers where the transport can (no whole copy of
        the model allocated and copied each step)."""
        handles = [unit.start_gather() for unit in self.units]
        for unit, handle in zip(self.units, handles):
            unit.finish_gather(handle)

    # --- state dicts in the user's format -------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's state dict, every parameter's state whole (collective: a rank that
        calls it alone raises, naming it, rather than meet the others' collectives)."""
        runtime.communicator_or_alone().arrive("optimizer.state_dict()", _EVERY_RANK)
        whole = self.optimizer.state_dict()
        position = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        state: dict[int, dict[str, Any]] = {}
        for unit in self.units:
            mine = self.stepping.state.get(unit.shard, {})
            for key in sorted(mine):
                value = mine[key]
                if torch.is_tensor(value) and value.dim() > 0:
                    value = _gathered(unit, value)
                    for param, part in zip(unit.params, _split(value, unit.params)):
                        state.setdefault(position[id(param)], {})[key] = part.view_as(param).clone()
                else:
                    for param in unit.params:
                        state.setdefault(position[id(param)], {})[key] = value.clone() if torch.is_tensor(value) \
                            else value
        whole["state"] = state
        for group, mine in zip(whole["param_groups"], self.stepping.param_groups):
            group.update({k: v for k, v in _hyperparameters(mine).items() if k in group})
        return whole

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state (sharded or not, saved at any worker count): this rank keeps its chunks."""
        self.stale = None
        self.optimizer.load_state_dict({**state_dict, "state": {}})
        for mine, theirs in zip(self.stepping.param_groups, self.optimizer.param_groups):
            mine.update(_hyperparameters(theirs))
        position = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        saved = state_dict.get("state", {})
        self.stepping.state.clear()
        for unit in self.units:
            per_param = [saved.get(position[id(p)]) for p in unit.params]
            if any(entry is None for entry in per_param):
                continue
            shard_state: dict[str, Any] = {}
            for key, value in per_param[0].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    whole = torch.cat([entry[key].reshape(-1) for entry in per_param])
                    shard_state[key] = whole[unit.own].clone().to(unit.flat.device)
                else:
                    shard_state[key] = value.clone() if torch.is_tensor(value) else value
            self.stepping.state[unit.shard] = shard_state


    # --- checkpoints in pieces: each rank writes and reads its own ------------------------

    def hyperparameters(self) -> dict[str, Any]:
        """The user's optimizer's state dict without any parameter's state (what rank 0's file holds)."""
        return self.optimizer.state_dict()

    def checkpoint_pieces(self) -> dict[str, Any]:
        """This rank's pieces of the weights (``model/<name>``) and of the optimizer state
        (``optim/<name>/<key>``), keyed by parameter name, for :mod:`phalanx.tensor_pieces`."""
        pieces: dict[str, Any] = {}
        names = self._names()
        for unit in self.units:
            chunks = {"model/{}": unit.shard.detach()}
            for key, value in self.stepping.state.get(unit.shard, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    chunks[f"optim/{{}}/{key}"] = value
                else:  # the same on every rank (a step count): written once, whole
                    pieces.update({f"optim/{names[id(p)]}/{key}": value for p in unit.params})
            pieces.update(_pieces_of(unit, chunks, names, reading=False))
        return pieces

    @torch.no_grad()
    def load_checkpoint_pieces(self, folder: Path, hyperparameters: dict[str, Any]) -> None:
        """Fill this rank's chunks of the weights and optimizer state from ``folder``, written at any
        worker count and level, then share the weights as after a step (collective)."""
        self.load_state_dict({**hyperparameters, "state": {}})
        available = tensor_pieces.contents(folder)
        targets: dict[str, Any] = {}
        names = self._names()
        for unit in self.units:
            first = names[id(unit.params[0])]
            kinds = {name.split("/", 2)[2] for name in available if name.startswith(f"optim/{first}/")}
            chunks, state = {"model/{}": unit.shard.detach()}, {}
            for key in sorted(kinds):
                size, dtype = available[f"optim/{first}/{key}"]
                if len(size) == 1 and size[0] == unit.params[0].numel():
                    state[key] = chunks[f"optim/{{}}/{key}"] = torch.zeros_like(unit.shard.detach(), dtype=dtype)
                else:
                    state[key] = targets[f"optim/{first}/{key}"] = torch.empty(size, dtype=dtype)
            targets.update(_pieces_of(unit, chunks, names, reading=True))
            if state:
                self.stepping.state[unit.shard] = state
        tensor_pieces.load(targets, folder)
        self._share_loaded_weights()

    def first_nonfinite(self) -> str | None:
        """The name of a parameter holding NaN or Inf in any rank's chunk, the same on every rank."""
        names = self._names()
        local = next((names[id(p)] for unit in self.units
                      if not bool(torch.isfinite(unit.shard.detach()).all()) for p in unit.params[:1]), None)
        found = [name for name in collectives.allgather_object(local, safe=True) if name is not None]
        return found[0] if found else None

    def _share_loaded_weights(self) -> None:
        if self.shared:
            collectives.host_barrier()
        elif self.gathering is not None:
            self.gathering.after_step()
        else:
            self._gather()

    def _names(self) -> dict[int, str]:
        return {id(param): name for name, param in self.model.module.named_parameters()}


class _Committed:
    """What an elastic job commits of a sharded model, and how a re-formed group gets it back.

    Each commit copies this rank's chunks into host memory (:mod:`~phalanx.strategies.shard_copies`,
    when the strategy keeps copies) and hands the State the rest, which every rank holds alike: the
    optimizer's hyperparameters and the model's buffers. After a re-form the units are laid out
    again for the new group (``reshard``) and every rank's new chunks rebuilt from the copies.
    """

    def __init__(self, strategy: Sharded, model: DataParallel, optimizer: ShardedOptimizer):
        self.strategy, self.model, self.optimizer = strategy, model, optimizer
        self.version = 0
        self.started = False  # the State's first snapshot, taken before the group agreed, copies nothing

    def state_dict(self) -> dict[str, Any]:
        copies = self.strategy.copies
        version: int | None = None
        if self.started:
            version = 0
            if copies is not None:
                self.version = version = self.version + 1
                copies.commit(version, self.optimizer.units, self.optimizer.stepping.state, self._positions())
        return {"copies": version, "hyperparameters": self.optimizer.hyperparameters(),
                "buffers": dict(self.model.module.named_buffers())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``copies`` None: nothing committed yet, the state set up stands; 0: no copies kept (the
        group reads the last checkpoint); a version: every rank's chunks rebuilt from the copies."""
        self.started = True
        version = state_dict["copies"]
        self.strategy.lost = None
        if version is None:
            return
        optimizer = self.optimizer
        if version == 0:
            self.strategy.lost = optimizer.stale = (f"{self.strategy.name} holds no copy of another worker's shards "
                                                    "(copies=False)")
            return
        optimizer.load_state_dict({**state_dict["hyperparameters"], "state": {}})
        assert self.strategy.copies is not None, "copies are kept wherever a commit made them"
        if not shard_copies.rebuild(self.strategy.copies, version, optimizer.units, optimizer.stepping.state,
                                    self._positions()):
            self.strategy.lost = optimizer.stale = (
                f"{self.strategy.name} lost the copies of commit {version} with the workers that held them (a worker "
                "and its buddy, which kept its chunks, died together)")
            return
        self.version = version
        with torch.no_grad():
            for name, buffer in self.model.module.named_buffers():
                buffer.copy_(state_dict["buffers"][name])
        optimizer._share_loaded_weights()

    def reshard(self, rank: int, world_size: int) -> None:
        if not any(collectives.allgather_object(self.started, safe=True)):
            self._equalize()
        self.strategy.follow_group(self.model, self.optimizer)
        if self.strategy.copies is not None:
            self.strategy.copies.retire()

    @torch.no_grad()
    def _equalize(self) -> None:
        """The group's first formation, before anything was committed: rank 0's parameters and buffers
        on every rank, as px.DataParallel's first synchronisation gives (each worker set the strategy
        up alone, with its units whole, perhaps from an initialization of its own)."""
        for unit in self.optimizer.units:
            collectives.broadcast_(unit.flat, 0)
        for buffer in self.model.module.buffers():
            collectives.broadcast_(buffer, 0)

    def _positions(self) -> dict[int, int]:
        """Each parameter's position among the model's (the same in every process)."""
        return {id(param): position for position, param in enumerate(self.model.module.parameters())}


def _pieces_of(unit: Unit, chunks: dict[str, torch.Tensor], names: dict[int, str], reading: bool) -> dict[str, Any]:
    """For each of the unit's parameters and each of ``chunks`` (this rank's chunk of the weights or
    of a state tensor, keyed by a name pattern such as ``optim/{}/exp_avg``), the parameter's piece as
    :func:`tensor_pieces.piece`, keyed by the pattern filled with the parameter's name. Where hosts
    are replicas each range is one rank's: the lowest holder's when writing, this rank's when
    ``reading`` (so that every replica reads its chunk)."""
    pieces, offset = {}, 0
    held = _each_range_once(unit.bounds, runtime.rank() if reading else None)
    for param in unit.params:
        numel = param.numel()
        # every rank's (start, stop) within this parameter: its chunk's overlap with it
        bounds = [(min(max(start - offset, 0), numel), min(max(stop - offset, 0), numel)) for start, stop in held]
        start, stop = bounds[runtime.rank()]
        base = offset - unit.own.start
        for pattern, chunk in chunks.items():
            local = chunk[base + start: base + stop] if stop > start else chunk[:0]
            pieces[pattern.format(names[id(param)])] = tensor_pieces.piece(local, numel, bounds, runtime.rank())
        offset += numel
    return pieces


def _each_range_once(bounds: Sequence[tuple[int, int]], holder: int | None) -> list[tuple[int, int]]:
    """``bounds`` with each range left to one rank (``holder`` where it holds it, else the lowest
    rank that does) and empty for the others: a sharded tensor's pieces must not overlap."""
    owner: dict[tuple[int, int], int] = {}
    for rank, chunk in enumerate(bounds):
        owner.setdefault(chunk, rank)
    if holder is not None:
        owner[bounds[holder]] = holder
    return [chunk if owner[chunk] == rank else (0, 0) for rank, chunk in enumerate(bounds)]


def _same_kind(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``groups`` (each with every hyperparameter), built
    with those of its defaults its constructor takes (AdamW's defaults name a setting it fixes itself)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _gathered(unit: Unit, chunk: torch.Tensor) -> torch.Tensor:
    """The whole of a tensor laid out as ``unit``, of which this rank holds ``chunk`` (collective)."""
    if runtime.size() == 1:
        return chunk
    received = collectives.allgather(chunk, check=False, lengths=unit.lengths)
    if sum(unit.lengths) == unit.flat.numel():
        return received
    whole = received.new_empty(unit.flat.numel())  # hosts that are replicas hold the same chunks
    for (start, stop), part in zip(unit.bounds, received.split(unit.lengths)):
        whole[start:stop] = part
    return whole


def _split(flat: torch.Tensor, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    return list(flat.split([p.numel() for p in params]))


def _sum_over_ranks(value: float) -> float:
    return float(collectives.allreduce(torch.tensor([value], dtype=torch.float64), check=False))


class Sharded(Strategy):
    """``px.fit(..., strategy=px.Sharded(level=2))``: see the module's docstring and docs/sharding.md.

    ``level`` 1 shards the optimizer state, 2 also the gradients, 3 also the parameters (each block
    gathered for its forward and backward). ``elementwise`` names optimizer classes of your own whose
    update of each element depends on that element alone, which the strategy may then step chunk by
    chunk. ``fusion_threshold_mb`` sizes the units (levels 1-2) and the blocks (level 3);
    ``gather_on_finish`` (level 3) hands the whole model back when training ends. ``gather_dtype``
    (level 3): the dtype blocks are gathered in for the forward and backward, the weights and the
    optimizer state staying float32 in each rank's chunks; ``"auto"`` is px.fit's compute dtype
    (bfloat16 at ``precision="bf16-mixed"``, float16 at ``"16-mixed"``: half the bytes each gather
    moves) and the parameters' own in a loop of one's own, where a dtype may be given. ``shared_memory``:
    ``"auto"`` keeps the units once per host in shared memory when every worker is on this host and
    reduces through it (then each worker's share of the host's one copy is its chunk, at every level,
    and level 3 has nothing to gather), and on each of several hosts at levels 1 and 2 where a worker
    then holds no more than sharding across the hosts (the hosts replicas of each other; not in
    elastic jobs); ``True`` does so on several hosts at any level; ``False`` gives each worker its
    copy (levels 1-2, kept equal by all-gathers) or its chunks (level 3, gathered per block).
    ``copies`` (elastic jobs): ``"auto"`` (or ``True``) commits every rank's chunks where a death does
    not take them, in host memory when every worker is on this host, else in the rank's memory and its
    buddy's on another host, so that a re-formed group rebuilds a lost worker's shards without reading
    the disk; ``False`` commits none (a re-formed group resumes from the last checkpoint on disk).
    ``commit_every`` (elastic jobs): optimizer steps between commits, by default :data:`COMMIT_EVERY`
    where copies are kept in host memory, :data:`COMMIT_EVERY_TO_BUDDIES` where buddies keep them (each
    commit copies the rank's chunks, and sends them to the buddy) and 1 where none are; a death costs
    the steps since the last commit, trained again bitwise alike. Once set up, ``layout`` names where
    the units live (``"one copy per host"``, ``"one copy on the host"``, ``"chunks gathered per block"``
    or ``"a copy per worker"``), as rank 0's log says.
    """

    def __init__(self, level: int = 2, elementwise: Sequence[type] = (),
                 fusion_threshold_mb: float = DEFAULT_FUSION_THRESHOLD_MB, gather_on_finish: bool = True,
                 shared_memory: bool | str = "auto", copies: bool | str = "auto",
                 commit_every: int | None = None, gather_dtype: torch.dtype | str = "auto"):
        if level not in LEVELS:
            raise ConfigurationError(f"px.Sharded(level=...) must be one of {list(LEVELS)}, got {level!r}.")
        if gather_dtype != "auto" and not (isinstance(gather_dtype, torch.dtype) and gather_dtype.is_floating_point):
            raise ConfigurationError(f"px.Sharded(gather_dtype=...) must be 'auto' or a floating torch dtype "
                                     f"(torch.bfloat16, torch.float16, torch.float32), got {gather_dtype!r}.")
        if gather_dtype != "auto" and level != 3:
            raise ConfigurationError(f"px.Sharded(level={level}, gather_dtype={gather_dtype}): only level 3 gathers "
                                     "the parameters for the forward and backward; levels 1 and 2 keep them whole on "
                                     "every worker, in their own dtype. Use level=3, or leave gather_dtype='auto'.")
        self.gather_dtype = gather_dtype
        self.compute_dtype: torch.dtype | None = None  # what px.fit's precision computes in, once checked
        if commit_every is not None and (not isinstance(commit_every, int) or commit_every < 1):
            raise ConfigurationError(f"px.Sharded(commit_every=...) must be a whole number of steps of at least 1, "
                                     f"got {commit_every!r}.")
        self.chosen_commit_every = commit_every
        self.level = level
        self.elementwise = (*ELEMENTWISE, *elementwise)
        self.fusion_threshold_mb = fusion_threshold_mb
        self.gather_on_finish = gather_on_finish
        if shared_memory not in ("auto", True, False):
            raise ConfigurationError(f"px.Sharded(shared_memory=...) must be 'auto', True or False, got {shared_memory!r}.")
        self.shared_memory = shared_memory
        self.gathering: Gathering | None = None
        self.elastic = False
        self.reduction: ShardedReduction | None = None
        self.reproducible = False
        self.nonfinite_agreement = "gradient" if level == 1 else "collective"
        if copies not in ("auto", True, False):
            raise ConfigurationError(f"px.Sharded(copies=...) must be 'auto', True or False, got {copies!r}.")
        self.keep_copies = copies
        self.copies: shard_copies.Copies | None = None
        self.resumes_from_disk = copies is False  # set again by check, where the launch is known
        self.lost: str | None = None  # why the last re-formed group could not rebuild the shards in memory
        self.layout = "not set up"  # where the units live, once set up (see _describe_layout)
        self.checked = False  # px.fit checks its options before setup; a loop of one's own does not

    @property
    def name(self) -> str:
        return f"px.Sharded(level={self.level})"

    def check(self, options: FitOptions) -> None:
        self.checked = True
        refuse_parameter_servers_launched(self.name)
        self.reproducible = options.reproducible  # level 3 then keeps the parameters whole during a step
        self.compute_dtype = options.compute_dtype
        if self.reproducible and isinstance(self.gather_dtype, torch.dtype) and self.gather_dtype != torch.float32:
            refuse(self.name, f"gather_dtype={self.gather_dtype} in reproducible mode", "reproducible mode gathers the "
                   "whole float32 parameters after each step, so that the weights are bitwise those of unsharded "
                   "training; leave gather_dtype='auto'.")
        self.elastic = options.elastic
        if options.several_optimizers:
            refuse(self.name, "a list of optimizers", "the shards are laid out over one optimizer's parameter groups; "
                   "use one optimizer with parameter groups.")
        if options.manual_step:
            refuse(self.name, "a step_fn that steps its own optimizers", "the strategy steps the optimizer on its shards; "
                   "give step_fn(model, batch) and let px.fit step.")
        kept = self.keep_copies is not False
        self.resumes_from_disk = options.elastic and not kept
        self.may_resume_from_disk = options.elastic  # without copies, or a worker and its buddy lost together
        if self.resumes_from_disk and options.checkpoint_dir is None:
            refuse(self.name, "an elastic job without checkpoint_dir", "no worker holds a copy of another's shards "
                   "(copies=False), so after a worker is lost the group resumes from the last checkpoint on disk: "
                   "give checkpoint_dir.")
        self.copies = shard_copies.Copies() if options.elastic and kept else None

    def _for_own_loop(self) -> None:
        """Set up for a loop of one's own: in an elastic launch, the copies that an elastic State holding
        :meth:`committed` keeps at each commit, as in px.fit. Nothing reads a checkpoint for such a loop
        after a re-form, so where no copy rebuilds the chunks (``copies=False``, or a worker lost with
        its buddy) the next ``optimizer.step()`` refuses until a state is loaded."""
        refuse_parameter_servers_launched(self.name)
        self.elastic = runtime.is_elastic()
        self.resumes_from_disk = self.may_resume_from_disk = False
        self.copies = shard_copies.Copies() if self.elastic and self.keep_copies is not False else None

    @property  # type: ignore[override]  # Strategy's is a constant; this one follows the generation
    def commit_every(self) -> int:
        """Optimizer steps between an elastic job's commits in the current generation: as chosen, else
        after every step without copies, every :data:`COMMIT_EVERY` with the copies in host memory and
        every :data:`COMMIT_EVERY_TO_BUDDIES` with buddies (a re-form may move from one to the other)."""
        if self.chosen_commit_every is not None:
            return self.chosen_commit_every
        if self.copies is None:
            return 1
        return COMMIT_EVERY if shard_copies.in_host_memory() else COMMIT_EVERY_TO_BUDDIES

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[DataParallel, ShardedOptimizer]:
        """Lay the parameters out in units, plug the sharded reduction into the engine, and wrap the
        optimizer to step this rank's chunks (collective: every rank builds the same layout)."""
        if not isinstance(optimizer, self.elementwise):
            raise ConfigurationError(
                f"{self.name} steps each rank's chunk of the parameters, which only an elementwise optimizer can do "
                f"(torch's {', '.join(c.__name__ for c in ELEMENTWISE)}); {type(optimizer).__name__} is not known to be "
                "one. If its update of each element depends on that element alone, pass "
                f"px.Sharded(elementwise=[{type(optimizer).__name__}]); otherwise use px.DataParallel.")
        if any(optimizer.state.values()):
            raise ConfigurationError(f"{self.name} needs an optimizer that has not stepped yet: set the strategy up "
                                     "first, then load a saved state with optimizer.load_state_dict.")
        if not self.checked:
            self._for_own_loop()
        wrapped = wrap(model)
        # An elastic job sets up outside the elastic protection: no collective here (a death would end
        # the job); the group's first restore lays the units out again, in shared memory where it can.
        units, reduced, shared = self._lay_out(wrapped, optimizer, alone=self.elastic)
        params = [p for p in wrapped.module.parameters() if p.requires_grad]
        self.reduction = ShardedReduction(reduced, params, scatter=self.level >= 2 and not shared)
        wrapped.rebuild_reducer(reduction=self.reduction)
        return wrapped, ShardedOptimizer(optimizer, units, wrapped, self.level, self.gathering, shared)

    def _lay_out(self, wrapped: DataParallel, optimizer: torch.optim.Optimizer,
                 alone: bool = False) -> tuple[list[Unit], list[Unit], bool]:
        """Cut the parameters into units for the current group (blocks gathered by hooks at level 3
        between hosts) and move them into host shared memory where every worker is on this host; the
        units, the same in the order their buckets are reduced, and whether they are shared.
        ``alone``: units of this worker's own, whole, made without any collective."""
        shared = not alone and self._share_memory(optimizer)
        if self.level == 3 and not shared and not alone:
            if any(hasattr(module, "_orig_mod") for module in wrapped.modules()):
                raise ConfigurationError(f"{self.name} with a model under torch.compile: level 3 frees and gathers the "
                                         "parameters' memory around each block, which compiled code does not follow; "
                                         "use level 2 with torch.compile, or level 3 without it.")
            check_stepped(optimizer, wrapped.module)
            group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
            self.gathering = Gathering(wrapped.module, cut(wrapped.module, self.fusion_threshold_mb, group_of),
                                       whole_between_steps=self.reproducible, dtype=self._gathered_in())
            units = self.gathering.units
            reduced = units[::-1]  # buckets in the order gradients become ready: the last block's first
        else:
            units = reduced = lay_out(optimizer, wrapped.module, self.fusion_threshold_mb)
        shared = shared and bool(units)
        # the gathers are collectives inside the passes: a rank without samples runs them too
        wrapped.passes_without_data = self.gathering is not None and not self.gathering.whole_between_steps
        if shared:  # once per host: a chunk is every worker's share of it, and nothing is gathered
            hosts = host_memory.hosts()
            for unit, view in zip(units, host_memory.shared_copies([u.flat for u in units], host_memory.first_of_host(),
                                                                   "sharded")):
                unit.bounds = chunk_bounds(unit.flat.numel(), hosts)
                unit.adopt(view)
        if not alone:
            self._describe_layout(shared)
        return units, reduced, shared

    def _gathered_in(self) -> torch.dtype | None:
        """The dtype level 3's passes gather in: as chosen, else px.fit's compute dtype (``None``: the
        parameters' own)."""
        if isinstance(self.gather_dtype, torch.dtype):
            return None if self.gather_dtype == torch.float32 else self.gather_dtype
        return self.compute_dtype

    def _describe_layout(self, shared: bool) -> None:
        """Name where the units live (:attr:`layout`) and say it in the log, once per set-up or re-form."""
        hosts = len(host_memory.hosts()) if shared else 1
        if shared and hosts > 1:
            self.layout = "one copy per host"
            detail = (f"each of {hosts} hosts keeps the units once in its shared memory, its {runtime.local_size()} "
                      "workers sharding them; only the gradients' allreduce crosses the network")
        elif shared:
            self.layout = "one copy on the host"
            detail = "the units live once in this host's shared memory, each worker stepping its chunk"
        elif self.gathering is not None:
            self.layout = "chunks gathered per block"
            detail = "each worker keeps its chunks, gathered per block around its forward and backward"
            if self.gathering.dtype is not None:
                detail += f" in {dtype_name(self.gathering.dtype)}"
        else:
            self.layout = "a copy per worker"
            detail = "each worker keeps a copy of the parameters, its chunks all-gathered after each step"
        if runtime.rank() == 0:
            logger.info("%s over %d workers: %s (%s).", self.name, runtime.size(), self.layout, detail)

    commits_whole_state = False  # the State holds no shard: a saved commit could not resume

    def committed(self, model: DataParallel, optimizer: OptimizerLike) -> dict[str, Stateful]:
        """Every rank's chunks copied into host memory at each commit (unless ``copies=False``), the
        rest in the State; a re-formed group lays the units out again and rebuilds them."""
        assert isinstance(optimizer, ShardedOptimizer), "committed comes after setup"
        return {"shards": _Committed(self, model, optimizer)}

    def must_resume_from_disk(self) -> str | None:
        return self.lost

    def follow_group(self, model: DataParallel, optimizer: ShardedOptimizer) -> None:
        """After the group changed: the units laid out afresh for it, as ``setup`` lays them out (the
        parameters' values and the optimizer's state are read next, from the last checkpoint)."""
        if self.gathering is not None:
            self.gathering.detach()
            self.gathering = None
        units, reduced, shared = self._lay_out(model, optimizer.optimizer)
        assert self.reduction is not None, "follow_group comes after setup"
        self.reduction.relay(reduced, scatter=self.level >= 2 and not shared)
        model.reshard(runtime.rank(), runtime.size())  # a new engine, summing as before (reproducible mode's way)
        optimizer.relay(units, self.gathering, shared)

    def _share_memory(self, optimizer: OptimizerLike) -> bool:
        """Whether the units live in host shared memory: on one host unless ``shared_memory=False``;
        on each of several hosts (replicas of each other) where :meth:`_replicas` says so."""
        if self.shared_memory is True and not host_memory.possible(across_hosts=not self.elastic):
            raise ConfigurationError(f"{self.name} with shared_memory=True needs several CPU workers on each host, as "
                                     "many on every host (an elastic job: on one host), with px.init(transport='auto' "
                                     "or 'shm'); use shared_memory='auto'.")
        return self.shared_memory is not False and host_memory.possible(across_hosts=self._replicas(optimizer))

    def _replicas(self, optimizer: OptimizerLike) -> bool:
        """Whether each of several hosts would keep its own copy: with ``shared_memory=True``, and by
        default at levels 1 and 2 where a worker then holds no more (:func:`one_copy_per_host`); never
        in an elastic job, whose hosts may come and go."""
        if self.elastic or self.shared_memory is False:
            return False
        return self.shared_memory is True or one_copy_per_host(
            1.0, float(state_per_parameter(optimizer)), self.level, runtime.size(), runtime.local_size())

    def memory_needed(self, model: nn.Module, optimizer: Any) -> int:
        """``held_bytes`` over the workers that share the state: the host's with ``shared_memory=True``
        between hosts, else the job's (one copy per host by default holds no more than that:
        :func:`one_copy_per_host`, so the figure px.fit's advice names is the one it checks)."""
        replicas = self.shared_memory is True and host_memory.possible(across_hosts=not self.elastic)
        return held_bytes(model, optimizer, level=self.level,
                          workers=runtime.local_size() if replicas else runtime.size())

    def finish(self, history: dict[str, Any] | None = None) -> None:
        """Level 3: the model the user passed gets its whole parameters back, the hooks removed
        (unless ``gather_on_finish=False``: then each rank keeps its chunks, see docs/sharding.md)."""
        if self.gathering is not None and self.gather_on_finish:
            self.gathering.remove()
