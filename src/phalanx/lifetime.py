"""Child processes that do not outlive their parent: the launcher's workers, the search's trials.

Linux's ``PR_SET_PDEATHSIG`` has the kernel kill the child when its parent dies, whatever killed
the parent; elsewhere only group kills protect.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` on Linux, or None where it does not exist (then only group kills protect)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the kernel SIGKILL the child when its parent dies, even by SIGKILL.

    Everything is prepared in the parent; the child only makes the call. If the parent died
    before the call took effect, the child exits at once instead of running as an orphan. The kernel
    sends the signal when the *thread* that started the child ends: start long-lived children from
    a thread that lives as long as they should (phalanx starts them from the main thread).
    """
    prctl = _load_prctl()
    option, death_signal = ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL)

    def setup_child() -> None:
        if prctl is not None:
            prctl(option, death_signal)
        if os.getppid() != parent_pid:
            os._exit(1)

    return setup_child


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host lives (a zombie awaiting its reaper counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
