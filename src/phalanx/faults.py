"""Named moments at which a test can kill a worker: fault injection without sleeps.

Phalanx calls :func:`point` at the moments where a lost worker must be survived (set-up,
the first step, validation, a checkpoint being written, re-forming the group, ...). Nothing
happens unless the environment variable ``PHALANX_FAULTS`` names the moment, for example::

    PHALANX_FAULTS="fit.setup@2"                  # member 2 dies on entering px.fit's set-up
    PHALANX_FAULTS="step.end@1#5,reform.group@0"  # member 1 after its 5th step, then member 0
                                                  # when the group re-forms

Each entry is ``moment@member`` or ``moment@member#n`` (the ``n``-th time that member reaches
the moment, default the first). The member is the worker's initial rank (its ``RANK`` variable,
which stays the same when an elastic job renumbers its workers). The worker kills itself with ``SIGKILL``: no
clean-up, no exit handler, exactly what an out-of-memory kill or a lost host does. The moments
are listed in ``MOMENTS`` and documented in docs/elastic.md.
"""

from __future__ import annotations

import os
import signal

from phalanx.errors import ConfigurationError

ENV = "PHALANX_FAULTS"

#: Every moment phalanx announces, in the order a run meets them.
MOMENTS = (
    "init.group",       # inside px.init(): the founders gather to form the first group
    "init.done",        # px.init() returned
    "fit.setup",        # px.fit entered: the model, loaders and state are being built
    "state.sync",       # the members exchange (and broadcast) the committed state
    "fit.resume",       # px.fit looks for a checkpoint to resume from
    "loader.check",     # the loader compares the data on every rank (its first iteration)
    "step.forward",     # a training step, before its forward pass
    "step.reduce",      # a training step's gradient buckets in flight, before waiting for them
    "step.end",         # a training step done, before its commit
    "commit.copies",    # px.Sharded copying a rank's chunks into host memory at a commit, half done
    "validation",       # px.fit's validation pass, before its first batch
    "checkpoint.write", # rank 0 writing a checkpoint file
    "epoch.end",        # an epoch's callbacks done, before its commit
    "train.end",        # px.fit's last commit done, before its end-of-training callbacks
    "reform.request",   # a survivor asked the coordinator for a place in the next generation
    "reform.group",     # the coordinator answered: the next generation's members gather
    "reform.connect",   # every member of the next generation arrived: its process group forms
)

_plan: dict[str, int] | None = None  # moment -> the count at which this process dies
_seen: dict[str, int] = {}


def point(moment: str) -> None:
    """Die here if ``PHALANX_FAULTS`` asks this worker to; otherwise return at once."""
    plan = _plan if _plan is not None else _load()
    if moment not in plan:
        return
    _seen[moment] = _seen.get(moment, 0) + 1
    if _seen[moment] == plan[moment]:
        os.kill(os.getpid(), signal.SIGKILL)


def _load() -> dict[str, int]:
    global _plan
    _plan = parse(os.environ.get(ENV, ""), _identity())
    return _plan


def parse(spec: str, member: int) -> dict[str, int]:
    """The moments (with the count) at which ``member`` dies under ``spec``; checked."""
    plan: dict[str, int] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        moment, _, rest = entry.partition("@")
        who, _, count = rest.partition("#")
        if moment not in MOMENTS or not who.isdigit() or (count and not count.isdigit()):
            raise ConfigurationError(
                f"{ENV}: cannot read {entry!r}; write moment@member or moment@member#n with a moment "
                f"among {list(MOMENTS)}.")
        if int(who) == member:
            plan[moment] = int(count or 1)
    return plan


def _identity() -> int:
    rank = os.environ.get("RANK", "0")
    return int(rank) if rank.isdigit() else 0
