"""How busy the host was while the doctor measured: CPU time its other processes took.

A step's time on a shared host depends on what else runs there, so a prediction from runs made on
a busy host is a guess. Each worker reads the busy time of the CPUs it may run on
(``/proc/stat``) and its own CPU time at the start and the end of its measured steps; what the
host's CPUs spent beyond the workers' own time went to other processes.
"""

from __future__ import annotations

import os
import time

#: Clock ticks per second of ``/proc/stat``'s counters.
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def snapshot() -> dict[str, float]:
    """This moment's wall clock, this process's CPU time and its CPUs' busy time (seconds; the last
    is absent where ``/proc/stat`` cannot be read)."""
    found = {"wall": time.perf_counter(), "own_cpu": time.process_time()}
    busy = _cpus_busy_s(os.sched_getaffinity(0))
    if busy is not None:
        found["host_busy"] = busy
    return found


def _cpus_busy_s(cpus: set[int]) -> float | None:
    """Seconds the ``cpus`` spent on anything but idling and waiting for I/O since boot."""
    try:
        with open("/proc/stat") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total / _TICKS


def other_load(windows: list[tuple[dict[str, float], dict[str, float]]]) -> float | None:
    """Cores other processes kept busy, on average, from each host's workers' (start, end) snapshots:
    the first worker's view of the CPUs' busy time less every worker's own CPU time."""
    if not windows or any("host_busy" not in start or "host_busy" not in end for start, end in windows):
        return None
    first_start, first_end = windows[0]
    wall = first_end["wall"] - first_start["wall"]
    own = sum(end["own_cpu"] - start["own_cpu"] for start, end in windows)
    return max(first_end["host_busy"] - first_start["host_busy"] - own, 0.0) / wall if wall > 0 else None
