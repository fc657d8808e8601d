"""Which parameter server holds which parameters: shards balanced by bytes, identical everywhere.

Workers and servers run the same script and so build the same model; each computes the placement
from the parameters' sizes alone, and they agree without exchanging it. Within a server, its
parameters are grouped by dtype: one flat tensor per group is the unit on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from phalanx.errors import ConfigurationError


@dataclass(frozen=True)
class Group:
    """The parameters of one server that share a dtype, in index order: one message per step."""

    server: int
    index: int  # this group's number on its server (its message tag)
    dtype: torch.dtype
    params: tuple[int, ...]  # parameter indices, ascending
    numels: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.numels)


def place(params: Sequence[torch.Tensor], servers: int) -> list[int]:
    """The server of every parameter: largest first onto the least-loaded server (by bytes).

    Deterministic (ties go to the lower server index), so every process computes the same.
    """
    if servers < 1:
        raise ConfigurationError("a parameter-server job needs at least one server: `phalanx run --servers 1 ...`.")
    if len(params) < servers:
        raise ConfigurationError(
            f"{servers} parameter servers for a model of {len(params)} parameter tensors: some servers would hold "
            f"nothing. Start at most {len(params)} servers."
        )
    load = [0] * servers
    owner = [0] * len(params)
    by_size = sorted(range(len(params)), key=lambda i: (-params[i].numel() * params[i].element_size(), i))
    for index in by_size:
        server = min(range(servers), key=lambda s: (load[s], s))
        owner[index] = server
        load[server] += params[index].numel() * params[index].element_size()
    return owner


def groups(params: Sequence[torch.Tensor], owner: Sequence[int], server: int) -> list[Group]:
    """``server``'s parameters, one :class:`Group` per dtype (in order of first appearance)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, param in enumerate(params):
        if owner[index] == server:
            by_dtype.setdefault(param.dtype, []).append(index)
    return [Group(server, g, dtype, tuple(indices), tuple(params[i].numel() for i in indices))
            for g, (dtype, indices) in enumerate(by_dtype.items())]


def all_groups(params: Sequence[torch.Tensor], servers: int) -> list[Group]:
    """Every server's groups, server by server."""
    owner = place(params, servers)
    return [group for server in range(servers) for group in groups(params, owner, server)]
