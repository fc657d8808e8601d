"""How px.Sharded lays parameters out: units of one flat buffer each, a contiguous chunk per rank.

A unit holds parameters of one optimizer parameter group and one dtype. Levels 1 and 2 cut the
parameters into units a gradient bucket long, in the order gradients usually become ready (last
registered first), and each unit is also one bucket of the gradient engine. Level 3 cuts the model
into *blocks* (modules whose parameters are gathered together for their forward and backward,
:mod:`phalanx.strategies.gathering`) and each block into units. Each rank's chunk follows
``torch.tensor_split``'s cut, the cut of the engine's reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

from phalanx.comm import collectives, runtime
from phalanx.comm.handles import Handle
from phalanx.errors import ConfigurationError
from phalanx.parallel.buckets import plan_buckets


@dataclass
class Unit:
    """Parameters of one optimizer group laid out in one flat buffer; this rank steps ``shard``."""

    group: int
    params: list[nn.Parameter]
    flat: torch.Tensor
    bounds: list[tuple[int, int]]  # every rank's chunk of ``flat``, in rank order (hosts' replicas alike)
    #: The chunk apart from ``flat`` (level 3, which frees ``flat`` between uses), else a view of it.
    apart: bool = False
    shard: nn.Parameter = field(init=False)

    def __post_init__(self) -> None:
        chunk = self.flat[self.own]
        self.shard = nn.Parameter(chunk.clone() if self.apart else chunk, requires_grad=True)

    def adopt(self, flat: torch.Tensor) -> None:
        """Move into ``flat`` (as large, already holding the values): the parameters, and the chunk
        unless it is apart, become views of it."""
        self.flat = flat
        offset = 0
        for param in self.params:
            param.data = flat[offset: offset + param.numel()].view_as(param)
            offset += param.numel()
        if not self.apart:
            self.shard.data = flat[self.own]

    def start_gather(self, dtype: torch.dtype | None = None) -> Handle[torch.Tensor] | None:
        """Start gathering every rank's chunk into ``flat`` (collective; on the CPU the rows arrive in
        place, ``flat``'s memory given back first if it was freed); ``None`` in a world of one, where
        the chunk is the whole. ``dtype``: the chunks travel rounded to it (a compute dtype: half of
        float32's bytes), arriving in a buffer of their own (``flat``'s memory comes back only as
        :meth:`finish_gather` copies them in, so a gather in flight holds half as much)."""
        if runtime.size() == 1:
            return None
        dtype = self.narrowed(dtype)
        if dtype is None:
            self.allocate()
            return collectives.allgather(self.shard.detach(), async_op=True, check=False, lengths=self.lengths,
                                         buffer=self.flat)
        return collectives.allgather(self.shard.detach().to(dtype), async_op=True, check=False, lengths=self.lengths)

    @torch.no_grad()
    def finish_gather(self, handle: Handle[torch.Tensor] | None, dtype: torch.dtype | None = None) -> None:
        """Wait for :meth:`start_gather`'s gather: ``flat`` holds every rank's chunk (rounded to
        ``dtype`` and back, as gathered in it, where one is given)."""
        whole = self.shard if handle is None else handle.wait()
        dtype = self.narrowed(dtype)
        if handle is None and dtype is not None:  # a world of one rounds as a gather in ``dtype`` would
            whole = whole.to(dtype)
        if whole.data_ptr() != self.flat.data_ptr():  # gathered elsewhere than into the buffer itself
            self.allocate()
            self.flat.copy_(whole)

    def free(self) -> None:
        """Give ``flat``'s memory back (level 3, between uses): the parameters, its views, hold none."""
        self.flat.untyped_storage().resize_(0)

    def allocate(self) -> bool:
        """Give ``flat`` its memory back where :meth:`free` took it (its values undefined); whether it did."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() > 0:
            return False
        storage.resize_(self.flat.numel() * self.flat.element_size())
        return True

    @torch.no_grad()
    def round_to(self, dtype: torch.dtype) -> None:
        """Round the whole parameters in ``flat`` to ``dtype`` and back, as a gather in it would give them."""
        narrowed = self.narrowed(dtype)
        if narrowed is not None:
            self.flat.copy_(self.flat.to(narrowed))

    def narrowed(self, dtype: torch.dtype | None) -> torch.dtype | None:
        """``dtype`` where it is a narrower floating type than the parameters' (else ``None``: they
        travel as they are)."""
        if dtype is None or not self.flat.is_floating_point() or dtype.itemsize >= self.flat.dtype.itemsize:
            return None
        return dtype

    @property
    def lengths(self) -> list[int]:
        """Every rank's chunk length, in rank order (what an all-gather of the chunks receives)."""
        return [stop - start for start, stop in self.bounds]

    @property
    def own(self) -> slice:
        start, stop = self.bounds[runtime.rank()]
        return slice(start, stop)

    def full_gradient(self) -> torch.Tensor | None:
        """The unit's whole gradient as one flat view when the engine left it contiguous (its bucket),
        else a copy; ``None`` when no parameter has a gradient."""
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):
            return None
        first = grads[0]
        if first is not None and all(g is not None for g in grads):
            offset, base = first.storage_offset(), first.untyped_storage().data_ptr()
            contiguous = True
            for grad, param in zip(grads, self.params):
                contiguous &= (grad.untyped_storage().data_ptr() == base and grad.storage_offset() == offset
                               and grad.is_contiguous())
                offset += param.numel()
            if contiguous:
                return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (self.flat.numel(),))
        return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                          for g, p in zip(grads, self.params)])


def check_stepped(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Every parameter that requires grad is the optimizer's: the strategy steps them through it."""
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if trained - stepped:
        names = [name for name, p in model.named_parameters() if id(p) in trained - stepped]
        raise ConfigurationError(f"px.Sharded steps parameters through the optimizer, which lacks {names[:3]}: give "
                                 "the optimizer every parameter that requires grad, or set requires_grad=False.")


def lay_out(optimizer: torch.optim.Optimizer, model: nn.Module, threshold_mb: float) -> list[Unit]:
    """Units a bucket long of ``optimizer``'s parameters, in the order gradients usually become ready
    (last registered first); each parameter's data becomes a view of its unit's flat buffer."""
    check_stepped(optimizer, model)
    units = []
    for index in reversed(range(len(optimizer.param_groups))):
        params = [p for p in reversed(optimizer.param_groups[index]["params"]) if p.requires_grad]
        units += [unit_of(index, [params[i] for i in group]) for group in plan_buckets(params, threshold_mb)]
    return units


def units_of(params: Iterable[nn.Parameter], group_of: dict[int, int], apart: bool) -> list[Unit]:
    """``params`` (one block's) as units, one per optimizer group and dtype."""
    keyed: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
    for param in params:
        keyed.setdefault((group_of[id(param)], param.dtype), []).append(param)
    return [unit_of(group, members, apart) for (group, _), members in keyed.items()]


def unit_of(group: int, members: Sequence[nn.Parameter], apart: bool = False) -> Unit:
    """One unit of ``members``, whose data become views of its flat buffer."""
    flat = torch.cat([p.detach().reshape(-1) for p in members])
    unit = Unit(group, list(members), flat, chunk_bounds(flat.numel()), apart)
    unit.adopt(flat)
    return unit


def chunk_bounds(numel: int, hosts: Sequence[Sequence[int]] | None = None) -> list[tuple[int, int]]:
    """Every rank's chunk (start, stop) of a flat buffer of ``numel`` elements, in rank order:
    ``torch.tensor_split``'s cut over the workers; with ``hosts`` (each host's ranks in local order),
    each host's own cut over its workers, so that every host holds the whole buffer once and the
    hosts are replicas of each other (a rank's chunk is that of its local index)."""
    bounds: list[tuple[int, int]] = [(0, 0)] * runtime.size()
    for ranks in hosts if hosts is not None else [range(runtime.size())]:
        base, longer = divmod(numel, len(ranks))  # tensor_split's cut: the first ``longer`` one longer
        for local, rank in enumerate(ranks):
            start = local * base + min(local, longer)
            bounds[rank] = (start, start + base + (local < longer))
    return bounds
