"""What this host offers the processes phalanx starts: the cores they may use, and the cost of more.

``phalanx run``, ``phalanx bench comm`` and ``phalanx tune`` warn in the same words when they
would start more busy processes than there are cores; the launcher makes room for the files its
workers take before it starts them.
"""

from __future__ import annotations

import os
import resource

from phalanx.errors import ConfigurationError


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which the processes it starts inherit)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def oversubscription(processes: int, cores: int) -> str | None:
    """What ``processes`` busy processes on ``cores`` cores cost, in words; None when each has a core."""
    if processes <= cores:
        return None
    return (f"{processes} processes on {cores} cores: each runs about {processes / cores:.1f}x slower than on a "
            "core of its own")


#: Open files the launcher holds for each process it starts: two pipes' read ends, its store
#: connection, and one spare for a re-formed group's.
FILES_PER_PROCESS = 4
#: Open files the launcher needs whatever it starts (Python, torch, the store's listener, logs).
FILES_BASE = 64


def ensure_open_files(processes: int) -> None:
    """Raise this process's open-file limit (which its workers inherit) to what starting ``processes``
    takes, up to the hard limit; refuse, before anything starts, what even that cannot hold."""
    needed = FILES_BASE + FILES_PER_PROCESS * processes
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigurationError(
            f"{processes} processes need about {needed} open files here, and this shell allows at most {hard} "
            f"(ulimit -Hn): start fewer workers, or raise the hard limit (e.g. in /etc/security/limits.conf).")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
