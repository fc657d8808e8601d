"""``hvd.start_timeline``/``stop_timeline``: a Chrome trace (chrome://tracing, Perfetto) of the collectives.

Rank 0 writes, as Horovod's coordinator does: one complete event per collective, from its
submission to the end of its ``synchronize`` (for the optimizer's buckets: from launch to the
end of backward's wait), named after the operation, with the tensor's name, shape and dtype.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import IO, Any

from phalanx.comm import runtime

_lock = threading.Lock()
_file: IO[str] | None = None
_events = 0
_mark_cycles = False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the trace to ``file_path`` (rank 0; other ranks record nothing). It is finished
    by ``stop_timeline``, ``hvd.shutdown`` or the process's exit, whichever comes first."""
    global _file, _events, _mark_cycles
    stop_timeline()
    if runtime.rank() != 0:
        return
    with _lock:
        _file = open(os.fspath(file_path), "w", encoding="utf-8")
        _file.write("[\n")
        _events, _mark_cycles = 0, mark_cycles
    atexit.unregister(stop_timeline)  # registered once, however many timelines are started
    atexit.register(stop_timeline)


def stop_timeline() -> None:
    """Finish and close the trace file (valid JSON from then on)."""
    global _file
    with _lock:
        if _file is not None:
            _file.write("\n]\n")
            _file.close()
            _file = None


def active() -> bool:
    """Whether a timeline is being written (so callers skip building event details otherwise)."""
    return _file is not None


def now_us() -> float:
    return time.perf_counter() * 1e6


def record(operation: str, name: str, start_us: float, details: dict[str, Any] | None = None) -> None:
    """Add one complete event from ``start_us`` to now."""
    _write({"name": operation, "ph": "X", "ts": start_us, "dur": max(now_us() - start_us, 0.0),
            "pid": runtime.rank(), "tid": name, "args": {"tensor": name, **(details or {})}})


def cycle() -> None:
    """Mark the end of one optimizer step's reduction (``mark_cycles=True``)."""
    if _mark_cycles:
        _write({"name": "CYCLE_START", "ph": "i", "ts": now_us(), "pid": runtime.rank(), "s": "g"})


def _write(event: dict[str, Any]) -> None:
    global _events
    with _lock:
        if _file is None:
            return
        _file.write((",\n" if _events else "") + json.dumps(event))
        _events += 1
