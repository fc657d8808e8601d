"""Make every replica start equal: check the model's structure, then broadcast rank 0's state."""

from __future__ import annotations

from itertools import chain

from torch import nn

from phalanx.comm import collectives, runtime
from phalanx.errors import ConfigurationError


def describe(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """Name, shape and dtype of every parameter and buffer, in registration order."""
    tensors = chain(module.named_parameters(), module.named_buffers())
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]


def check_same_structure(module: nn.Module) -> None:
    """Raise on every rank, naming the first difference, unless all ranks hold the same model."""
    raise_if_different(collectives.allgather_object(describe(module)))


def raise_if_different(everyone: list[list[tuple[str, tuple[int, ...], str]]]) -> None:
    """Raise on every rank, naming the first difference, unless every rank's :func:`describe` is rank 0's."""
    reference = everyone[0]
    for other_rank, theirs in enumerate(everyone[1:], start=1):
        difference = _first_difference(reference, theirs)
        if difference:
            raise ConfigurationError(
                f"rank {runtime.rank()}: the model on rank {other_rank} differs from rank 0's: {difference}. "
                "Every rank must build the same model before wrapping it in px.DataParallel."
            )


def broadcast_state(module: nn.Module, root: int = 0) -> None:
    """Overwrite every parameter and buffer with ``root``'s values, one broadcast per dtype."""
    collectives.broadcast_tensors_([*module.parameters(), *module.buffers()], root)


def _first_difference(ours: list, theirs: list) -> str:
    for index, (mine, other) in enumerate(zip(ours, theirs)):
        if mine != other:
            return (f"tensor #{index} is '{other[0]}' {list(other[1])} {other[2]} there but "
                    f"'{mine[0]}' {list(mine[1])} {mine[2]} on rank 0")
    if len(ours) != len(theirs):
        return f"it has {len(theirs)} parameters and buffers, rank 0 has {len(ours)}"
    return ""
