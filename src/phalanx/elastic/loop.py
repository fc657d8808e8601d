"""``px.elastic.run``: call a training function again after every change of membership."""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from phalanx.comm import runtime
from phalanx.comm.membership import MembershipClosed
from phalanx.elastic.state import MembershipChanged, State
from phalanx.errors import CollectiveError, CollectiveTimeoutError

T = TypeVar("T")


def run(fn: Callable[..., T]) -> Callable[..., T | None]:
    """Wrap ``fn(state, *args, **kwargs)`` so that it survives changes of membership.

    ``fn`` trains from wherever ``state`` says (``state.epoch``, the loader's position) and calls
    ``state.commit()`` after every step. When a member is lost (a collective fails) or workers
    wait to join (``commit()`` raises :class:`MembershipChanged`), the wrapper re-forms the group,
    synchronises the committed state (joiners receive it from a peer), restores it, reshards the
    loaders and calls ``fn`` again. Other exceptions propagate unchanged.

    Outside an elastic launch it simply calls ``fn``. A worker started after the job finished
    returns ``None`` without calling it, saying so (``px.fit`` then exits the process with status
    0). When fewer than ``--min-workers`` remain, the first survivor saves the last commit to
    ``state.checkpoint_path`` (if set) and every survivor raises :class:`px.elastic.MembershipClosed`.
    """

    @functools.wraps(fn)
    def elastic(state: State, *args: Any, **kwargs: Any) -> T | None:
        if not runtime.is_initialized():
            runtime.init()
        if not runtime.is_elastic():
            return fn(state, *args, **kwargs)
        try:
            _start(state)
        except MembershipClosed as closed:
            if closed.reason == "finished":
                print(f"phalanx elastic: this worker was never admitted ({closed}): it trained nothing and is "
                      "master of nothing (px.is_master() is False).", file=sys.stderr, flush=True)
                return None
            raise
        while True:
            try:
                return fn(state, *args, **kwargs)
            except MembershipChanged as change:
                reason = change.reason
            except Exception as error:  # noqa: BLE001 - filtered just below
                if not is_membership_failure(error):
                    raise
                reason = "failure"
            _recover(state, reason, time.monotonic())

    return elastic


def follow() -> bool:
    """Join the next generation now if the group is about to change; whether it did.

    For workers that share no state step by step (asynchronous parameter servers): there is
    nothing to commit or restore, so between two batches each worker reads one store key and,
    when a member was lost or workers wait to join, re-forms the group with the others (each
    at its own next boundary). A worker started after the job asks to be admitted on its first
    call. Outside an elastic launch it does nothing.
    """
    if not runtime.is_elastic():
        return False
    view = runtime.membership()
    if view is None:
        runtime.rejoin("join")
        return True
    ending = runtime.generation_ending(view.generation)
    if ending is None:
        return False
    runtime.rejoin(ending)
    return True


def is_membership_failure(error: BaseException) -> bool:
    """Whether ``error`` means the group lost a member (as opposed to a bug to report)."""
    if isinstance(error, MembershipClosed):
        return False
    if isinstance(error, (CollectiveTimeoutError, dist.DistError)):
        return True
    if isinstance(error, (CollectiveError, RuntimeError)):
        return _generation_broken()
    return False


def _generation_broken() -> bool:
    view = runtime.membership()
    if view is None:
        return False
    try:
        return runtime.generation_ending(view.generation) == "failure"
    except (RuntimeError, OSError):
        return True  # the store itself is unreachable: rejoining will say why


def _start(state: State) -> None:
    """Founders agree on the initial state; a worker started later asks to be admitted. A failure is
    dated when it surfaces (the first sync may wait a heartbeat timeout for a frozen founder)."""
    if runtime.membership() is None:
        _recover(state, "join", time.monotonic())
    elif not _synced(state):
        _recover(state, "failure", time.monotonic())


def _recover(state: State, reason: str, detected: float) -> None:
    """Re-form the group, synchronise and restore the committed state; retry while members keep failing."""
    state._begin_recovery(detected)
    while True:
        try:
            runtime.rejoin(reason)
        except MembershipClosed as closed:
            _save_if_asked(state, closed)
            raise
        if _synced(state):
            state._reformed()
            return
        reason = "failure"


def _synced(state: State) -> bool:
    """Synchronise and restore the committed state; False when a member failed meanwhile."""
    try:
        state.sync()
        state.restore()
    except Exception as error:  # noqa: BLE001 - filtered just below
        if not is_membership_failure(error):
            raise
        return False
    return True


def _save_if_asked(state: State, closed: MembershipClosed) -> None:
    if closed.save_checkpoint and state.checkpoint_path and closed.reason == "below-min":
        path = state.save()
        print(f"phalanx elastic: saved the last committed state (commit {state.version}) to {path}",
              file=sys.stderr, flush=True)
