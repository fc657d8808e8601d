"""The messages between workers and parameter servers: kinds, header fields, tags, objects.

Every request starts with an int64 header (tag :data:`HEADER`) and a float64 tensor of the
optimizer's learning rates and metric sums (tag :data:`VALUES`); a push then carries one flat
gradient bucket per parameter group of that server (tag ``GROUP_TAG + g``). Every reply is an
int64 header and, where it returns parameters, one flat tensor per group. Objects (optimizer
state, the history) travel as ``torch.save`` bytes in a uint8 tensor whose length is in the
header, and are loaded with ``weights_only=True``: nothing received can run code.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import torch

from phalanx.comm import codec
from phalanx.comm.channel import Channel

HEADER, VALUES, OBJECT, GROUP_TAG = 1, 2, 3, 16  # OBJECT + 1 carries the bytes
HEADER_LEN = 8


class Kind(enum.IntEnum):
    """What a worker asks of a server."""

    PUSH = 1  # a gradient: apply it (sync: once every worker's is in), reply with the parameters
    PULL = 2  # reply with the parameters
    INIT = 3  # rank 0's initial parameters: take them unless the server already trained
    SAVE = 4  # reply with this shard's optimizer state
    LOAD = 5  # take these parameters and this optimizer state (a resumed run)
    NEXT = 6  # async, server 0: the worker's last task is applied everywhere; deal the next one
    BYE = 7  # the worker is done; worker 0's carries the history


class Status(enum.IntEnum):
    """How a server answers."""

    OK = 0
    LOST = 1  # sync: a worker was lost before the step was complete; it was not applied
    TASK = 2  # async: here is a task (epoch, index, phase)
    EPOCH_DONE = 3  # async: every task of the epoch is applied; the values hold its metric sums
    FAILED = 4  # the server could not apply the request; the object holds its message
    WAIT = 5  # async: no task can be dealt yet (others hold the last ones); follow the group, then ask again


class Request(NamedTuple):
    """A request's header: what it asks, and where the worker stands."""

    kind: int
    step: int  # sync: the worker's step count (a goodbye: 1 when an object follows)
    generation: int  # the workers' group generation (elastic jobs re-form)
    world: int  # workers in that group
    elastic: int  # 1 in an elastic job: keep the state before the last step
    epoch: int  # async: the epoch a task is asked for
    task: int
    values: int  # length of the float64 values that follow


class Phase(enum.IntEnum):
    TRAIN = 0
    VALIDATE = 1


def header(*fields: int) -> torch.Tensor:
    """An int64 header of :data:`HEADER_LEN` fields (missing ones are zero)."""
    values = list(fields) + [0] * (HEADER_LEN - len(fields))
    return torch.tensor(values, dtype=torch.int64)


def empty_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64)


def send_object(channel: Channel, obj: Any) -> None:
    """Send an object's length, then its bytes (the safe codec: nothing a peer sends runs code here)."""
    data = codec.encode(obj, safe=True)
    channel.send([torch.tensor([data.numel()], dtype=torch.int64), data], OBJECT)


def recv_object(channel: Channel) -> Any:
    length = torch.zeros(1, dtype=torch.int64)
    channel.recv([length], OBJECT)
    data = torch.empty(int(length), dtype=torch.uint8)
    channel.recv([data], OBJECT + 1)
    return codec.decode(data, safe=True)
