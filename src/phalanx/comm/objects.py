"""The object collectives: objects encoded by :mod:`phalanx.comm.codec`, carried by tensor collectives.

Each sends the payloads' lengths first, -1 for an object its rank could not encode, so that every
rank learns of the failure in the same step and raises the same :class:`ConfigurationError` instead
of waiting for bytes that never come. The tensor collectives they run on are handed in, started
asynchronously and without comparing metadata across ranks (payloads differ in length by nature).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from phalanx.comm import codec
from phalanx.comm.handles import Handle, chain
from phalanx.errors import ConfigurationError

#: A tensor collective of every rank, started: a broadcast from the root, or an allgather.
Exchange = Callable[[torch.Tensor], Handle[torch.Tensor]]

_SAFE_HINT = f" (safe=True sends only {codec.SAFE_CONTENTS})"


def broadcast_object(broadcast: Exchange, obj: Any, root: int, rank: int, async_op: bool, safe: bool) -> Any:
    """``root``'s ``obj`` on every rank, through ``broadcast`` (from ``root``); ``rank`` is this one."""
    payload, problem = codec.encoded(obj, safe) if rank == root else (torch.empty(0, dtype=torch.uint8), None)
    length = broadcast(torch.tensor([-1 if problem else payload.numel()], dtype=torch.int64)).wait()
    if int(length) < 0:  # the same message on every rank; the root's says why in its cause
        raise ConfigurationError(f"broadcast_object: the root, rank {root}, could not encode its object"
                                 f"{_SAFE_HINT if safe else ''}. Every rank raises this error.") \
            from (ValueError(problem) if problem else None)
    if rank != root:
        payload = torch.empty(int(length), dtype=torch.uint8)
    return chain(broadcast(payload), lambda data: codec.decode(data, safe), async_op)


def allgather_object(allgather: Exchange, obj: Any, async_op: bool, safe: bool) -> list[Any] | Handle[list[Any]]:
    """Every rank's ``obj``, in rank order, through ``allgather``."""
    payload, problem = codec.encoded(obj, safe)
    lengths = allgather(torch.tensor([-1 if problem else payload.numel()], dtype=torch.int64)).wait().tolist()
    failed = [rank for rank, length in enumerate(lengths) if length < 0]
    if failed:  # the same message on every rank; a failed rank's says why in its cause
        raise ConfigurationError(f"allgather_object: rank(s) {failed} could not encode their object"
                                 f"{_SAFE_HINT if safe else ''}. Every rank raises this error.") \
            from (ValueError(problem) if problem else None)
    return chain(allgather(payload), lambda flat: [codec.decode(piece, safe) for piece in torch.split(flat, lengths)],
                 async_op)
