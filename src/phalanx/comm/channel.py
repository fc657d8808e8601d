"""Point-to-point channels between one worker and one parameter server.

A channel is a two-process Gloo group of its own, formed over the job's rendezvous store, so it
lives beside the workers' group and is unaffected by it: a worker that dies breaks only its own
channels, and a worker admitted later opens new ones while the others run. Messages are tensors
matched by tag; every wait is bounded by the job's timeout, and a failure names the peer. A wait
watches the channel's connection: Gloo leaves a message cut part-way by the peer's death waiting
until the timeout, but closes the connection, so the wait ends when it sees that
(:mod:`phalanx.comm.waiting`).

Opening is a handshake through the store: the worker takes a ticket from the server's counter
and announces itself under it, sealed with the job's secret (:mod:`phalanx.comm.auth`: a ticket
that does not carry it is refused with a warning); the server's listener reads the ticket and both sides form the
group under a prefix unique to that ticket (see :class:`Listener`).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from phalanx.comm import auth
from phalanx.comm.connections import own_connection
from phalanx.comm.handles import Works
from phalanx.comm.sealed_store import sealing
from phalanx.comm.sockets import any_closed, socket_inodes, tcp_connections_since
from phalanx.comm.waiting import Waits
from phalanx.errors import CollectiveTimeoutError

logger = logging.getLogger(__name__)

PREFIX = "phalanx/ps"


class ChannelClosed(CollectiveTimeoutError):
    """The peer of a channel died, closed it, or did not answer within the timeout."""


class Channel:
    """One worker-server connection: blocking ``send``/``recv`` of tensor lists, by tag."""

    def __init__(self, store: Any, ticket: str, rank: int, timeout_s: float, peer: str):
        self.peer = peer
        self.timeout_s = timeout_s
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._devices = [_device()]
        self._sealed = sealing(store, timeout_s)  # alive as long as the group: torch calls back into it
        before = socket_inodes()
        try:
            self._group = dist.ProcessGroupGloo(dist.PrefixStore(f"{PREFIX}/{ticket}/", self._sealed), rank, 2, options)
        except (RuntimeError, OSError) as error:
            raise ChannelClosed(f"could not connect to {peer} within {timeout_s:.0f}s ({error}).") from error
        connection = tcp_connections_since(before)
        self._waits = Waits(abortable=True, broken=lambda: any_closed(connection))
        self._peer_rank = 1 - rank

    def send(self, tensors: Sequence[torch.Tensor], tag: int) -> None:
        """Send ``tensors`` (each contiguous, on the CPU; tensor ``k`` with tag ``tag + k``) and wait
        until they are handed to the network."""
        self.wait(self.isend(tensors, tag), "send to")

    def isend(self, tensors: Sequence[torch.Tensor], tag: int) -> list[Any]:
        """Start sending ``tensors`` as :meth:`send` does; ``wait`` on the returned works before reusing them."""
        try:
            return [self._group.send([tensor], self._peer_rank, tag + k) for k, tensor in enumerate(tensors)]
        except RuntimeError as error:
            raise self._closed("send to", error) from error

    def recv(self, tensors: Sequence[torch.Tensor], tag: int, timeout_s: float | None = None) -> None:
        """Receive into ``tensors`` (tensor ``k`` from tag ``tag + k``, shapes and dtypes as sent),
        waiting at most the timeout."""
        try:
            works = [self._group.recv([tensor], self._peer_rank, tag + k) for k, tensor in enumerate(tensors)]
        except RuntimeError as error:
            raise self._closed("receive from", error) from error
        self.wait(works, "receive from", timeout_s)

    def wait(self, works: list[Any], operation: str, timeout_s: float | None = None) -> None:
        """Wait for ``works``; a dead or silent peer becomes :class:`ChannelClosed` naming it."""
        limit = datetime.timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s)
        try:
            self._waits.wait(Works(works, limit))
        except RuntimeError as error:
            raise self._closed(operation, error) from error

    def close(self) -> None:
        """Drop the connection; a peer blocked on it gets an error at once."""
        try:
            self._group.abort()
        except RuntimeError:
            pass
        self._waits.close()

    def _closed(self, operation: str, error: BaseException) -> ChannelClosed:
        return ChannelClosed(f"could not {operation} {self.peer}: {_first_line(error)}")


def connect(store: Any, server: int, worker: int, timeout_s: float) -> Channel:
    """Open a channel from worker ``worker`` (a stable id) to parameter server ``server``; the
    announcement is sealed with the job's secret, so the server admits only the job's workers."""
    ticket = int(store.add(f"{PREFIX}/{server}/tickets", 1))
    key = f"{PREFIX}/{server}/ticket/{ticket}"
    store.set(key, _secret().seal(key, str(worker)))
    return Channel(store, f"{server}/{ticket}", 1, timeout_s, f"parameter server {server}")


def _secret() -> auth.JobSecret:
    return auth.required("a parameter server or its worker", "launch with phalanx run --servers")


class Listener:
    """A server's thread that accepts channels from workers, in ticket order, for as long as it runs.

    ``on_channel(worker, channel)`` is called (on the listener's thread) for every new channel.
    """

    POLL_S = 0.2

    def __init__(self, store: Any, server: int, timeout_s: float, on_channel: Callable[[int, Channel], None]):
        self._store = own_connection(store)
        self.server = server
        self.timeout_s = timeout_s
        self._on_channel = on_channel
        self._secret = _secret()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"phalanx-ps{server}-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _accept(self) -> None:
        ticket = 1
        while not self._stopped.is_set():
            key = f"{PREFIX}/{self.server}/ticket/{ticket}"
            try:
                if not self._store.check([key]):
                    self._stopped.wait(self.POLL_S)
                    continue
                worker = int(self._secret.open(key, self._store.get(key))[0])
                channel = Channel(self._store, f"{self.server}/{ticket}", 0, self.timeout_s, f"worker {worker}")
            except (RuntimeError, OSError, ValueError) as error:
                if self._stopped.is_set():
                    return
                logger.warning("parameter server %d: a worker's connection (ticket %d) failed: %s",
                               self.server, ticket, _first_line(error))
                ticket += 1
                continue
            ticket += 1
            self._on_channel(worker, channel)


def _device() -> Any:
    """Gloo's network device: the interface the launcher chose (``GLOO_SOCKET_IFNAME``), else Gloo's default."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    return dist.ProcessGroupGloo.create_default_device()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
