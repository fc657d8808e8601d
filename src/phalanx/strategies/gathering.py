"""Level 3 of ``px.Sharded``: each block's parameters gathered for its forward and backward, freed after.

A *block* is a module, or a run of modules, whose parameters are gathered together. The model is
cut top down: a module of at most ``threshold_mb`` of parameters (or without children, or one of
:data:`UNCUT`, which use their children's parameters without calling them) is one block; a larger
one gives each child its own cut, consecutive children that fit the threshold together sharing a
block, and keeps the parameters it holds directly in a block gathered around its whole forward; a
block of at most a sixteenth of the threshold that no sibling could join (a classifier head after a
stack of layers) joins the block before it. A parameter two blocks share (tied embeddings) joins
the root's block, gathered for the whole forward and backward.

Between uses a block's flat buffers hold no memory; each rank keeps only its chunks (the
optimizer's parameters). Forward: the pre-forward hook of each of a block's modules waits for its
gather (launched when the block before it started, in the order the first forward took) and the
forward hook of its last module frees it, except the last two blocks' where a backward follows,
which starts with them. Backward: the first gradient to reach the outputs of one of the block's
modules gathers it again (and launches the gather of the block before it); once each of its
parameters has its gradient the block is freed, and whatever is still gathered when the backward
ends is freed then. Every rank runs the same forward, so every rank issues the same gathers in the
same order; a forward without gradients (an evaluation) first waits through the store for every
rank, so that one rank evaluating alone is refused, naming it, instead of gathering with the others'
training gathers.

In mixed precision the passes gather in the compute dtype (``dtype``: each rank's chunk rounded to
bfloat16, half the bytes) into the float32 blocks, so the weights stay float32 in the chunks; a
state dict, which needs the weights themselves, gathers float32 apart, on every rank.

Reproducible mode runs a different number of micro-batches on each rank, so there the gathers
cannot follow the passes: the parameters are gathered whole after each optimizer step and kept
for the step (``whole_between_steps``), and only the optimizer state and gradients stay sharded.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from phalanx.comm import runtime
from phalanx.comm.handles import Handle
from phalanx.strategies.shard_layout import Unit, units_of

logger = logging.getLogger(__name__)

#: The forward's last blocks stay gathered for the backward, which starts with them: no gather to
#: wait for as it starts (the last block is often a small head, too short to hide the next one's),
#: and no more gathered at once than while a block computes with the next one prefetched.
KEPT_FOR_BACKWARD = 2

#: What a rank that runs a forward without gradients alone is told.
EVERY_RANK_FORWARDS = ("each block's parameters are gathered from every rank for the forward, so every rank runs it: "
                       "evaluate on every rank (px.fit's validation does) and report from one, or call "
                       "strategy.finish() first to have the whole model on every rank.")

#: A block of at most 1/SMALL_BLOCK of the threshold joins a neighbour (see ``_small_joined``).
SMALL_BLOCK = 16

#: torch modules whose forward reads their children's parameters without calling the children (a
#: block's parameters are gathered by its modules' hooks): nn.MultiheadAttention passes
#: ``out_proj.weight`` to ``F.multi_head_attention_forward``, nn.TransformerEncoderLayer's fast path
#: (inference) every child's. Each is one block, whatever its size.
UNCUT = (nn.MultiheadAttention, nn.TransformerEncoderLayer)

#: A block being cut: its modules' names, the modules, and the parameters it holds.
Chosen = tuple[list[str], list[nn.Module], list[nn.Parameter]]


class Block:
    """The parameters of one module, or of consecutive modules that fit the threshold together (those
    no smaller block holds; siblings, or a small block joined to its neighbour), as units gathered
    and freed together."""

    def __init__(self, modules: list[nn.Module], name: str, units: list[Unit]):
        self.modules, self.name, self.units = modules, name, units
        self.gathered = True  # laid out whole; freed once the gathering starts
        self.holds: torch.dtype | None = None  # once gathered: the dtype it was gathered in (None: its own)
        self._in_flight: list[Handle[torch.Tensor] | None] = []  # one per unit, None in a world of one
        self._in_flight_dtype: torch.dtype | None = None
        self.in_backward = False  # a gradient reached one of its modules' outputs in this backward
        self.remaining = 0  # parameters still waiting for their gradient in this backward

    @property
    def trained(self) -> int:
        return sum(1 for unit in self.units for p in unit.params if p.requires_grad)

    def launch(self, dtype: torch.dtype | None = None) -> None:
        """Start gathering every rank's chunks into the flat buffers, in ``dtype`` (``None``: the
        parameters' own); nothing if gathered or under way."""
        if self.gathered or self._in_flight:
            return
        for unit in self.units:
            self._in_flight.append(unit.start_gather(dtype))
        self._in_flight_dtype = dtype

    def wait(self, dtype: torch.dtype | None = None) -> None:
        """Have the parameters whole, as gathered in ``dtype`` (launching the gather first if nobody
        did). Held whole already, they are rounded to ``dtype`` in place; held rounded where the
        parameters' own precision is asked for (a state dict), they are gathered again."""
        if not self.gathered:
            self.launch(dtype)
            for unit, handle in zip(self.units, self._in_flight):
                unit.finish_gather(handle, self._in_flight_dtype)
            self._in_flight, self.gathered, self.holds = [], True, self._in_flight_dtype
        if self.holds == dtype:
            return
        if dtype is None:  # rounded values are not the weights: every rank gathers them again (collective)
            self.free()
            self.wait(None)
            return
        for unit in self.units:
            unit.round_to(dtype)
        self.holds = dtype

    def free(self) -> None:
        if not self.gathered:
            return
        for unit in self.units:
            unit.free()
        self.gathered = False


def cut(model: nn.Module, threshold_mb: float, group_of: dict[int, int]) -> list[Block]:
    """The model's blocks, in registration order (roughly the forward's), every trained parameter in one.

    A module within the threshold is gathered whole, and so are consecutive siblings that fit it
    together (a convolution and its batch norm, a run of small layers): one gather instead of one per
    module, each a round trip between hosts. A larger module is cut among its children, unless its
    forward reads their parameters without calling them (:data:`UNCUT`)."""
    limit = threshold_mb * 2**20
    owners: dict[int, list[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module_name)
    chosen: list[Chosen] = []
    taken: set[int] = set()

    def size(params: Iterable[nn.Parameter]) -> int:
        return sum(p.numel() * p.element_size() for p in params if p.requires_grad)

    def take(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        fresh = [p for p in params if p.requires_grad and id(p) not in taken and len(owners[id(p)]) == 1]
        taken.update(id(p) for p in fresh)
        return fresh

    def visit(name: str, module: nn.Module) -> None:
        children = [(f"{name}.{child}" if name else child, sub) for child, sub in module.named_children()]
        if size(module.parameters()) <= limit or not children or isinstance(module, UNCUT):
            if params := take(module.parameters()):
                chosen.append(([name], [module], params))
            return
        if params := take(module.parameters(recurse=False)):
            chosen.append(([name], [module], params))
        run: Chosen = ([], [], [])
        for child_name, child in children:
            if size(child.parameters()) > limit:
                if run[2]:
                    chosen.append(run)
                run = ([], [], [])
                visit(child_name, child)
                continue
            params = take(child.parameters())
            if not params:
                continue  # an activation, a frozen layer: the run goes on past it
            if run[2] and size(run[2]) + size(params) > limit:
                chosen.append(run)
                run = ([], [], [])
            run[0].append(child_name)
            run[1].append(child)
            run[2].extend(params)
        if run[2]:
            chosen.append(run)

    visit("", model)
    shared = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    if shared:  # tied parameters: gathered for the whole forward, with the root's own
        root = [entry for entry in chosen if entry[1] == [model]]
        params = (root[0][2] if root else []) + shared
        chosen = [entry for entry in chosen if entry[1] != [model]]
        chosen.insert(0, ([""], [model], params))
    chosen = _small_joined(chosen, limit, size, model)
    return [Block(modules, _block_name(names), units_of(params, group_of, apart=True))
            for names, modules, params in chosen]


def _small_joined(chosen: list[Chosen], limit: float, size: Callable[[Iterable[nn.Parameter]], int],
                  model: nn.Module) -> list[Chosen]:
    """Each block of at most 1/:data:`SMALL_BLOCK` of the limit (a classifier head after a stack of
    layers, which no sibling could join) joins the block before it (the first block, the one after
    it) where the two stay within the limit and a sixteenth: a gather and a reduce-scatter fewer a
    step, each a round trip between hosts that costs what a large one does. The block of the whole
    model's own parameters, gathered for the whole pass, stays apart."""
    joined: list[Chosen] = []
    for names, modules, params in chosen:
        if joined and modules != [model] and joined[-1][1] != [model]:
            before = size(joined[-1][2])
            either_small = min(before, size(params)) * SMALL_BLOCK <= limit
            if either_small and before + size(params) <= limit * (1 + 1 / SMALL_BLOCK):
                names_before, modules_before, params_before = joined.pop()
                names, modules, params = names_before + names, modules_before + modules, params_before + params
        joined.append((names, modules, params))
    return joined


def _block_name(names: list[str]) -> str:
    first = names[0] or "(the model itself)"
    return first if len(names) == 1 else f"{first} .. {names[-1]}"


class Gathering:
    """The hooks that gather and free the blocks of one model around its forward and backward."""

    def __init__(self, model: nn.Module, blocks: list[Block], whole_between_steps: bool = False,
                 dtype: torch.dtype | None = None):
        self.model, self.blocks, self.whole_between_steps = model, blocks, whole_between_steps
        #: the dtype the passes gather in (``None``: the parameters' own); whole between steps, the
        #: parameters are the weights themselves
        self.dtype = None if whole_between_steps else dtype
        self._order: list[Block] = []  # the first forward's order: what to prefetch next
        self._order_complete = False  # a backward ended: the first forward's order is whole
        self._ending_queued = False
        self._handles: list[RemovableHandle] = []
        for block in blocks:
            for module in block.modules:
                closes = module is block.modules[-1]
                self._handles.append(module.register_forward_pre_hook(self._before_forward(block)))
                self._handles.append(module.register_forward_hook(self._after_forward(block, closes)))
            for unit in block.units:
                for param in unit.params:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._gradient_done(block)))
        self._handles.append(model.register_state_dict_pre_hook(lambda *_: self._whole_for_a_state_dict()))
        self._handles.append(model.register_load_state_dict_pre_hook(lambda *_: self.gather_all()))
        self._handles.append(model.register_load_state_dict_post_hook(lambda *_: self._keep_loaded()))
        if not whole_between_steps:
            for block in blocks:
                block.free()

    @property
    def units(self) -> list[Unit]:
        return [unit for block in self.blocks for unit in block.units]

    def gather_all(self) -> None:
        """Every parameter whole (collective): for a state dict, or for the model handed back. In the
        forward's order, the order of the gathers the other ranks' next forward makes: a state dict
        that only one rank takes between steps (``if rank == 0: torch.save(model.state_dict())``,
        the habit from DDP) then meets the same gathers on the others, and its forward gathers nothing."""
        ordered = [*self._order, *(block for block in self.blocks if block not in self._order)]
        for block in ordered:
            block.launch()
        for block in ordered:
            block.wait()

    def _whole_for_a_state_dict(self) -> None:
        """Every parameter whole for a state dict. Where the passes gather in a compute dtype, the
        weights' own gathers would not meet another rank's passes, and before the first forward the
        forward's order is not known: in both cases the gathers of a state dict one rank takes alone
        could not be made to meet the others', so every rank must be here (through the store)."""
        if self.dtype is not None:
            runtime.communicator_or_alone().arrive(
                f"model.state_dict() at px.Sharded(level=3) gathering in {dtype_name(self.dtype)}",
                f"the forward and backward gather the parameters in {dtype_name(self.dtype)}, so a state dict gathers the "
                "float32 weights apart, from every rank: every rank takes it, and one saves (state = "
                "model.state_dict(); if px.rank() == 0: torch.save(state, path)).")
        elif not self._order_complete and not self.whole_between_steps:
            runtime.communicator_or_alone().arrive(
                "model.state_dict() before the first training step at px.Sharded(level=3)",
                "it gathers every block from every rank, so before training every rank takes it (after a step, one "
                "rank may take it alone).")
        self.gather_all()

    def after_step(self) -> None:
        """The chunks changed: gathered copies are stale (gathered afresh when whole between steps)."""
        self.free_all(even_whole=True)
        if self.whole_between_steps:
            self.gather_all()

    def free_all(self, even_whole: bool = False) -> None:
        """Forget every gathered copy (at the end of a pass, unless kept whole between steps)."""
        if self.whole_between_steps and not even_whole:
            return
        for block in self.blocks:
            if block._in_flight:
                block.wait(block._in_flight_dtype)
            block.free()

    def remove(self) -> None:
        """Detach every hook, leaving the model whole and plain (the end of training)."""
        self.gather_all()
        self.detach()

    def detach(self) -> None:
        """Detach every hook and give every parameter its memory back, without gathering (after the
        group changed: the values are stale, to be read from a checkpoint; gathers in flight
        belonged to the old group and are dropped)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for block in self.blocks:
            block._in_flight = []
            for unit in block.units:
                if unit.allocate():
                    unit.flat.zero_()
            block.gathered = True

    @torch.no_grad()
    def _keep_loaded(self) -> None:
        """A state loaded into the whole parameters becomes each rank's chunks."""
        for unit in self.units:
            unit.shard.copy_(unit.flat[unit.own])

    # --- hooks ------------------------------------------------------------------------------

    def _before_forward(self, block: Block) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if block not in self._order:
                self._order.append(block)
            if not torch.is_grad_enabled() and not self.whole_between_steps and block is self._order[0] \
                    and module is block.modules[0]:
                # An evaluation one rank runs alone (DDP's habit) would gather with the others' training
                # gathers, silently where the sizes agree: every rank must be here first.
                runtime.communicator_or_alone().arrive("a forward without gradients at px.Sharded(level=3)",
                                                        EVERY_RANK_FORWARDS)
            block.wait(self.dtype)
            following = self._neighbour(block, +1)
            if following is not None:
                following.launch(self.dtype)

        return hook

    def _after_forward(self, block: Block, closes: bool) -> Callable[..., None]:
        """After each of the block's modules: its outputs lead the backward to the block; after the
        last of them (``closes``) the block is freed."""
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            outputs = [t for t in _tensors(output) if t.requires_grad]
            backward_follows = bool(outputs) and torch.is_grad_enabled()
            if backward_follows:
                torch.autograd.graph.register_multi_grad_hook(outputs, self._before_backward(block), mode="any")
            kept = self._order_complete and any(block is end for end in self._order[-KEPT_FOR_BACKWARD:])
            if closes and not self.whole_between_steps and not (kept and backward_follows):
                block.free()

        return hook

    def _before_backward(self, block: Block) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self._ending_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
                self._ending_queued = True
            if not block.in_backward:  # the first of its modules the backward reaches
                block.in_backward, block.remaining = True, block.trained
            block.wait(self.dtype)
            previous = self._neighbour(block, -1)
            if previous is not None:
                previous.launch(self.dtype)

        return hook

    def _gradient_done(self, block: Block) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            block.remaining -= 1
            if block.remaining == 0 and not self.whole_between_steps:
                block.free()

        return hook

    def _end_backward(self) -> None:
        self._ending_queued, self._order_complete = False, True
        for block in self.blocks:
            block.in_backward = False
        self.free_all()

    def _neighbour(self, block: Block, step: int) -> Block | None:
        if block not in self._order:
            return None
        index = self._order.index(block) + step
        return self._order[index] if 0 <= index < len(self._order) else None


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16``: a dtype as messages name it."""
    return str(dtype).removeprefix("torch.")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
