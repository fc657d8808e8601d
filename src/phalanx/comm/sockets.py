"""This process's sockets, read from ``/proc/self/fd`` (Linux; elsewhere none are found).

The elastic watchdog shuts a broken generation's connections down by them (Gloo offers no abort),
and a wait that watches a group's connection learns from them that Gloo closed it after a failure.
A group's sockets are those opened while it formed: :func:`sockets_since` a :func:`socket_inodes`
taken before.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from typing import Iterator


def socket_inodes() -> dict[str, int]:
    """This process's open sockets as ``{"socket:[inode]": fd}`` (Linux; empty elsewhere)."""
    found: dict[str, int] = {}
    if not sys.platform.startswith("linux"):
        return found
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[target] = int(name)
    return found


def sockets_since(before: dict[str, int]) -> dict[str, int]:
    """The sockets this process opened since ``before`` (a group's connections, for the watchdog)."""
    return {inode: fd for inode, fd in socket_inodes().items() if inode not in before}


def tcp_connections_since(before: dict[str, int]) -> dict[str, int]:
    """The connected TCP sockets among those opened since ``before``: a Gloo group's pairs, without
    its device's listening socket or a pipe another thread opened meanwhile."""
    found = {}
    for inode, fd in sockets_since(before).items():
        with _borrowed(fd) as sock:
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) and \
                    sock.type == socket.SOCK_STREAM and not _listening(sock):
                found[inode] = fd
    return found


def shutdown_sockets(sockets: dict[str, int]) -> None:
    """Shut down (not close) the connected sockets among ``sockets`` still open under the same fd.

    The owner (Gloo) still closes them; shutting down makes every pending read or write on them
    fail now, on this side and on the peer's. Listening sockets are left alone.
    """
    for inode, fd in sockets.items():
        if not _still_open(inode, fd):
            continue
        with _borrowed(fd) as sock:
            if sock is not None and not _listening(sock):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def any_closed(sockets: dict[str, int]) -> bool:
    """Whether any of ``sockets`` (as :func:`socket_inodes` lists them) has been closed since: Gloo
    closes a pair's connection when the pair fails (its peer died), the sign that a transfer it cut
    part-way will wait for nothing but the timeout."""
    return not all(_still_open(inode, fd) for inode, fd in sockets.items())


def _still_open(inode: str, fd: int) -> bool:
    """Whether ``fd`` is still the socket ``inode`` (not closed, its number not reused since)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == inode
    except OSError:
        return False


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """A socket object over a duplicate of ``fd`` (``None`` where there is none to have), closed after:
    the owner's descriptor is left as it is."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        yield None
        return
    try:
        yield sock
    finally:
        sock.close()


def _listening(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return True  # nothing to do with a socket that cannot say
