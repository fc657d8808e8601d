"""Join: a rank out of data takes part, with zeros, in the allreduces the others still run.

A joined rank answers every metadata check of the ranks still running with a "join" record (see
:mod:`phalanx.comm.agreement`), so they see it there and nowhere else: their checked allreduces go
ahead with its zeros, any other checked collective raises on them, and it waits on (as in Horovod)
until every rank has joined.
"""

from __future__ import annotations

from typing import Callable

import torch

from phalanx.comm import agreement
from phalanx.comm.routing import ALLREDUCE_ALGORITHMS
from phalanx.errors import PhalanxError


def join(exchange: Callable[[int], list[list[int]]], reduce: Callable[[torch.Tensor, str, str], object],
         device: torch.device, rank: int) -> int:
    """Take part as a joined rank until every rank has joined; return the rank that joined last.

    ``exchange(first)`` gives every rank's record of the next check, this rank's a join record
    (``first``: 1 in its first, which names the rank that joined last); ``reduce(zeros, op, algorithm)``
    takes part, unchecked, in the allreduce the others agreed on. ``rank`` is this rank (its global one).
    """
    first = 1
    while True:
        rows = exchange(first)
        first = 0
        calls = [agreement.read(row) for row in rows]
        active = [call for call in calls if call.operation != "join"]
        if not active:
            return max(r for r, call in enumerate(calls) if call.detail == 1)
        if any(call.operation != "allreduce" for call in active):
            continue  # the ranks that called it raise; nothing travels
        try:
            agreement.compare(dict(enumerate(rows)), "allreduce", rank, len(rows))
        except PhalanxError:
            continue  # the ranks still running raise this, before any data
        call = active[0]
        op, algorithm = agreement.reduction_of(call.detail)
        reduce(torch.zeros(call.shape, dtype=call.dtype, device=device), op, ALLREDUCE_ALGORITHMS[algorithm])
