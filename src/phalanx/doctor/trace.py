"""The measured steps as a Chrome trace (JSON Trace Event Format, opened by Perfetto and chrome://tracing).

Every rank is a process of its own (``pid`` = rank): track 0 holds its steps' phases (data, forward,
backward with the exposed waits nested in it, optimizer), track ``1 + i`` bucket ``i`` in flight
from its launch to the end of its wait. Times are microseconds from the first event shown; ranks
of one host share the monotonic clock they were recorded with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phalanx.atomic import write_text_atomically

Event = tuple[str, float, dict[str, float]]


def chrome_trace(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The trace object of every rank's measured steps (after the warm-up)."""
    shown = {int(r["rank"]): _measured(r["events"], int(r["warmup"])) for r in records}
    origin = min((events[0][1] for events in shown.values() if events), default=0.0)
    trace: list[dict[str, Any]] = []
    for rank, events in sorted(shown.items()):
        trace.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "step"}})
        trace += [{**slice_, "pid": rank} for slice_ in _slices(events, origin)]
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write(records: list[dict[str, Any]], path: str | Path) -> None:
    """Write :func:`chrome_trace` to ``path``."""
    write_text_atomically(path, json.dumps(chrome_trace(records)))


def _measured(events: list[Event], warmup: int) -> list[Event]:
    """The events after the ``warmup``-th step's end."""
    steps = [i for i, event in enumerate(events) if event[0] == "step"]
    return [tuple(e) for e in events[steps[warmup - 1]:]] if len(steps) > warmup else []  # type: ignore[misc]


def _span(name: str, tid: int, start: float, end: float, origin: float, **args: float) -> dict[str, Any]:
    return {"ph": "X", "name": name, "tid": tid, "ts": (start - origin) * 1e6, "dur": max(end - start, 0.0) * 1e6,
            "args": args}


def _slices(events: list[Event], origin: float) -> list[dict[str, Any]]:
    """Phases and buckets of the steps in ``events`` (which start at a step's end)."""
    slices: list[dict[str, Any]] = []
    marks: dict[str, float] = {}
    launched: dict[int, tuple[float, float]] = {}
    for name, t, fields in events:
        if name == "data":
            slices.append(_span("data wait", 0, fields["started"], t, origin))
        elif name in ("forward", "backward", "optimizer") and name not in marks:
            marks[name] = t
        elif name == "launch":
            launched[int(fields["bucket"])] = (t, fields["bytes"])
        elif name == "wait":
            bucket = int(fields["bucket"])
            slices.append(_span(f"exposed comm #{bucket}", 0, fields["started"], t, origin))
            start, nbytes = launched.pop(bucket, (fields["started"], 0.0))
            slices.append(_span(f"allreduce #{bucket}", 1 + bucket, start, t, origin, bytes=nbytes))
        elif name == "step":
            slices += _phases(marks, t, origin)
            marks = {}
    return slices


def _phases(marks: dict[str, float], end: float, origin: float) -> list[dict[str, Any]]:
    order = [(name, marks[name]) for name in ("forward", "backward", "optimizer") if name in marks]
    bounds = [t for _, t in order[1:]] + [end]
    return [_span(name, 0, start, stop, origin) for (name, start), stop in zip(order, bounds)]
