"""Phalanx's exceptions: one base class, a few precise subclasses.

Every message says what went wrong, on which rank and in which operation, and what to do.
"""

from __future__ import annotations


class PhalanxError(RuntimeError):
    """Base class of every error phalanx raises on purpose."""


class ConfigurationError(PhalanxError, ValueError):
    """The launch environment or an argument is invalid; the message names the fix."""


class AuthenticationError(PhalanxError):
    """A message did not prove the job's secret (none given, a wrong one, or a replay): it is refused."""


class NotInitializedError(PhalanxError):
    """A distributed operation was called before ``px.init()``."""


class CollectiveError(PhalanxError):
    """A collective operation failed on this rank."""


class GenerationClosedError(CollectiveError):
    """A collective was called on a communicator whose generation has ended.

    Elastic re-forming and ``px.shutdown()`` close the current generation; ask
    ``px.communicator()`` for the one now in place instead of keeping an old one.
    """


class CollectiveMismatchError(CollectiveError):
    """Ranks called a collective with different operations, shapes or dtypes.

    Raised on every rank of the group, so no rank is left waiting for the others.
    """


class CollectiveTimeoutError(CollectiveError):
    """A peer died or did not answer within the timeout during a collective."""


class ServerFailedError(CollectiveError):
    """A parameter server died, or did not answer within the timeout; the message names it.

    Raised on every worker that talks to it. The job's last checkpoint is intact: start it again
    with ``resume=True`` to continue from there.
    """


class DataMismatchError(ConfigurationError):
    """Ranks hold different datasets (or loader settings) where global batches need the same one.

    Raised on every rank, naming the ranks that differ.
    """


class WorkerFailedError(PhalanxError):
    """A worker process started by the launcher exited with an error."""


class CheckpointError(PhalanxError):
    """A checkpoint could not be written, read or matched to the model."""


class NonFiniteGradientError(PhalanxError):
    """A gradient about to be applied holds NaN or Inf; raised on every rank of the step.

    ``ranks`` lists the ranks whose loss was non-finite (empty when every loss was finite).
    """

    def __init__(self, message: str, ranks: list[int] | tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = list(ranks)


class NonFiniteLossError(NonFiniteGradientError):
    """The loss went NaN or Inf on ``ranks``; ``px.fit`` raises it on every rank before the step."""
