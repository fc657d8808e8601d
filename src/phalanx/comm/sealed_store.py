"""A store whose values carry the job's secret: torch's own rendezvous (Gloo's and NCCL's
addresses, every group phalanx forms) goes through it, so a process that reaches the store but
lacks the secret cannot stand in for a worker.

:class:`SealedStore` wraps the job's ``TCPStore``: every value ``set`` is sealed for its key
(:meth:`~phalanx.comm.auth.JobSecret.seal`), every ``get`` opens it. A value someone else
wrote first is skipped until the rightful writer's replaces it (within the timeout); counters
(``add``) and existence checks pass through. :func:`sealing` applies it where the job has a secret.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import torch.distributed as dist

from phalanx.comm import auth
from phalanx.errors import AuthenticationError

logger = logging.getLogger(__name__)

RETRY_S = 0.05  # how often a get re-reads a value that does not carry the secret


class SealedStore(dist.Store):
    """``store`` with every value sealed for its key (see the module's docstring)."""

    def __init__(self, store: Any, secret: auth.JobSecret, timeout_s: float):
        super().__init__()
        self.inner, self.secret, self.timeout_s = store, secret, timeout_s

    def set(self, key: str, value: bytes | str) -> None:
        self.inner.set(key, self.secret.seal(key, value))

    def get(self, key: str) -> bytes:
        deadline, warned = time.monotonic() + self.timeout_s, False
        while True:
            try:
                return self.secret.open(key, self.inner.get(key))[0]
            except AuthenticationError:
                if time.monotonic() > deadline:
                    raise
                if not warned:
                    logger.warning("the store's value at %s does not carry the job's secret: waiting for the "
                                   "real one", key)
                    warned = True
                time.sleep(RETRY_S)

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)


def sealing(store: Any, timeout_s: float) -> Any:
    """``store`` sealed with the job's secret when the launcher gave one (``phalanx run``); as it is
    otherwise (torchrun, SLURM, MPI: their rendezvous is theirs, see docs/security.md)."""
    secret = auth.from_environment()
    return store if secret is None else SealedStore(store, secret, timeout_s)
