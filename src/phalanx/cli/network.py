"""The launchers' network: the rendezvous store, addresses and interfaces, and the job board.

Node 0's launcher hosts the ``TCPStore``; the others connect to it. The :class:`JobBoard` on that
store is how the launchers of a multi-host job tell each other that one of them saw a worker fail.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import ipaddress
import json
import socket
import subprocess
import time
from typing import TYPE_CHECKING, Any, Callable

from phalanx.errors import ConfigurationError

if TYPE_CHECKING:
    from torch.distributed import TCPStore

DEFAULT_STORE_TIMEOUT_S = 300.0
POLL_INTERVAL_S = 0.1


def bind_store(master_addr: str, master_port: int) -> socket.socket:
    """The store's listening socket: on ``master_addr`` when that is an address of this host (so
    the default, 127.0.0.1, keeps the store on loopback, where a ``TCPStore`` left to bind its own
    port listens on every interface), on every interface otherwise; port 0 picks a free port."""
    try:
        return listen_socket(master_addr, master_port)
    except OSError as error:
        raise ConfigurationError(
            f"could not host the rendezvous store on {master_addr}:{master_port} ({error}). "
            "Pick another --master-port, or 0 for a free one."
        ) from error


def host_store(master_addr: str, listener: socket.socket, timeout_s: float | None) -> TCPStore:
    """Serve the rendezvous ``TCPStore`` in this process on ``listener`` (:func:`bind_store`)."""
    import torch.distributed as dist  # imported here: only the launching process needs the store

    port = listener.getsockname()[1]
    try:
        return dist.TCPStore(
            master_addr, port, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s or DEFAULT_STORE_TIMEOUT_S),
            master_listen_fd=listener.detach(),  # the store owns and closes it
        )
    except (RuntimeError, OSError) as error:
        raise ConfigurationError(
            f"could not host the rendezvous store on {master_addr}:{port} ({error}). "
            "Pick another --master-port, or 0 for a free one."
        ) from error


def connect_store(master_addr: str, master_port: int, timeout_s: float | None) -> TCPStore:
    """Connect this (non-zero) node's launcher to node 0's store, waiting for it up to the timeout."""
    import torch.distributed as dist

    timeout = timeout_s or DEFAULT_STORE_TIMEOUT_S
    try:
        return dist.TCPStore(master_addr, master_port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, OSError) as error:
        raise ConfigurationError(
            f"could not reach node 0's rendezvous store at {master_addr}:{master_port} within {timeout:g}s "
            f"({str(error).splitlines()[0][:200]}). Start node 0 first, and pass the same --master-addr and "
            "--master-port to every host."
        ) from error


def listen_socket(address: str, port: int) -> socket.socket:
    """A listening TCP socket on ``address`` if it belongs to this host, else on every interface."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    try:
        return socket.create_server(sockaddr[:2], family=family, backlog=1024)
    except OSError as error:
        if error.errno != errno.EADDRNOTAVAIL:
            raise
        return socket.create_server(("", port), family=family, backlog=1024)


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a name or a literal) means this host's loopback interface."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def interface_towards(address: str) -> str | None:
    """The name of this host's interface holding the address it uses to reach ``address`` (Linux).

    For an address of this host itself, that is the interface holding it, not loopback.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            local = ipaddress.ip_address(probe.getsockname()[0])
    except (OSError, ValueError):
        return None
    for name, addresses in _interface_addresses().items():
        if local in addresses:
            return name
    return None


def _interface_addresses() -> dict[str, set[Any]]:
    """This host's interfaces and their addresses, read from ``ip -o addr`` (empty if unavailable)."""
    try:
        listing = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, set[Any]] = {}
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("inet", "inet6"):
            with contextlib.suppress(ValueError):
                found.setdefault(fields[1].split("@")[0], set()).add(ipaddress.ip_address(fields[3].split("/")[0]))
    return found


class JobBoard:
    """What the launchers of a multi-host job tell each other through node 0's store.

    Each launcher counts itself in when it starts and out when it ends, so node 0 can keep the
    store up until the last one is done; the first launcher to see a worker fail posts it, so the
    others stop their workers too (non-elastic jobs). Used from the launcher's main thread only.
    """

    PREFIX = "phalanx/launch/"
    FAILURE = PREFIX + "failure"
    JOINED = PREFIX + "joined"
    LEFT = PREFIX + "left"

    def __init__(self, store: Any):
        self.store = store

    def join(self) -> None:
        self.store.add(self.JOINED, 1)

    def leave(self) -> None:
        self.store.add(self.LEFT, 1)

    def post_failure(self, node: int, rank: int, exit_code: int) -> None:
        """Record the job's first failure (later ones keep the first)."""
        record = json.dumps({"node": node, "rank": rank, "exit_code": exit_code})
        self.store.compare_set(self.FAILURE, "", record)

    def failure(self) -> dict[str, Any] | None:
        """The failure another launcher posted, or None (also when the store is unreachable)."""
        try:
            if not self.store.check([self.FAILURE]):
                return None
            return json.loads(self.store.get(self.FAILURE))
        except (RuntimeError, OSError, ValueError):
            return None

    def wait_for_others(self, deadline: float, interrupted: Callable[[], bool]) -> None:
        """Node 0: wait until every launcher that joined has left, or the deadline passes."""
        while time.monotonic() < deadline and not interrupted():
            try:
                if self.store.add(self.LEFT, 0) >= self.store.add(self.JOINED, 0):
                    return
            except (RuntimeError, OSError):
                return
            time.sleep(POLL_INTERVAL_S)
