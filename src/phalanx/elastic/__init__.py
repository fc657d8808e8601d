"""Fault-tolerant, elastic training: survive lost workers, admit new ones, keep the global batch.

Under ``phalanx run --min-workers K`` (or ``--nnodes MIN:MAX`` across hosts)::

    state = px.elastic.State(model=model, optimizer=optimizer, loader=loader, epoch=0, step=0)

    @px.elastic.run
    def train(state):
        for epoch in range(state.epoch, epochs):
            loader.set_epoch(epoch)
            for x, y in loader:
                ...  # forward, backward, optimizer.step()
                state.step += 1
                state.commit()

    train(state)

See ``docs/elastic.md``.
"""

from phalanx.comm.membership import Membership, MembershipClosed
from phalanx.comm.runtime import membership
from phalanx.comm.runtime import is_elastic as enabled
from phalanx.elastic.loop import follow, is_membership_failure, run
from phalanx.elastic.state import MembershipChanged, Recovery, State

__all__ = ["Membership", "MembershipChanged", "MembershipClosed", "Recovery", "State", "enabled", "follow",
           "is_membership_failure", "membership", "run"]
