"""The exceptions Horovod scripts catch, as phalanx errors (so ``except px.PhalanxError`` works too)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from phalanx.elastic.state import MembershipChanged
from phalanx.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError


class HorovodInternalError(CollectiveError):
    """A collective failed: a peer was lost or stopped answering, or the ranks called it differently.

    Horovod raises it from ``synchronize()``; ``hvd.elastic.run`` recovers from a lost peer.
    """


class HorovodMismatchError(HorovodInternalError, CollectiveMismatchError):
    """Ranks called a collective with different shapes, dtypes, operations or roots (raised on every rank)."""


class HorovodTimeoutError(HorovodInternalError, CollectiveTimeoutError):
    """A peer died or did not answer within the timeout during a collective."""


class HostsUpdatedInterrupt(MembershipChanged):
    """Workers join or leave at this commit; ``hvd.elastic.run`` re-forms the group and calls the function again."""

    def __init__(self, reason: str = "planned"):
        super().__init__(reason)
        self.skip_sync = False


@contextlib.contextmanager
def horovod_errors() -> Iterator[None]:
    """Re-raise phalanx's collective errors as the Horovod exception of the same meaning."""
    try:
        yield
    except HorovodInternalError:
        raise
    except CollectiveMismatchError as error:
        raise HorovodMismatchError(str(error)) from error
    except CollectiveTimeoutError as error:
        raise HorovodTimeoutError(str(error)) from error
    except CollectiveError as error:
        raise HorovodInternalError(str(error)) from error
