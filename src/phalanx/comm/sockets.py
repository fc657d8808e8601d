"""This process's sockets, read from ``/proc/self/fd`` (Linux; elsewhere none are found).

The elastic watchdog shuts a broken generation's connections down by them (Gloo offers no abort),
and a wait that watches a group's connection learns from them that Gloo closed it after a failure.
A group's sockets are those opened while it formed: :func:`sockets_since` a :func:`socket_inodes`
taken before.
"""

from __future__ import annotations

import os
import socket
import sys


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
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM and \
                    not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                found[inode] = fd
        except OSError:
            pass
        finally:
            sock.close()
    return found


def shutdown_sockets(sockets: dict[str, int]) -> None:
    """Shut down (not close) the connected sockets among ``sockets`` still open under the same fd.

    The owner (Gloo) still closes them; shutting down makes every pending read or write on them
    fail now, on this side and on the peer's. Listening sockets are left alone.
    """
    for inode, fd in sockets.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != inode:
                continue  # closed meanwhile, the number maybe reused
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()


def any_closed(sockets: dict[str, int]) -> bool:
    """Whether any of ``sockets`` (as :func:`socket_inodes` lists them) has been closed since: Gloo
    closes a pair's connection when the pair fails (its peer died), the sign that a transfer it cut
    part-way will wait for nothing but the timeout."""
    for inode, fd in sockets.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != inode:
                return True  # closed, the number maybe reused
        except OSError:
            return True
    return False
