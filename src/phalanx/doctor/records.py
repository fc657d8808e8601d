"""From one rank's recorded events to its steps: where each step's time went.

A step ends at the optimizer step's end (``step``). Within it: the loader's waits (``data``), the
first training forward (``forward``), the start of backward (``backward``, the first gradient
ready), buckets launched (``launch``) and waited for (``wait``), the optimizer's start
(``optimizer``), and on every other measured step the gradient norms (``norms``); under px.LocalSGD
and px.DiLoCo, after the optimizer step, an exchange's start (``outer_start``, its bytes) and its
merge (``outer_merge``, with the time it waited), which land in the next step's events. The first
``warmup`` steps are dropped; steps with norms are kept for the noise scale only, and the step
whose tensors were counted (``memory``, :mod:`phalanx.doctor.footprint`) for nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from phalanx.errors import ConfigurationError

Event = tuple[str, float, dict[str, float]]


@dataclass(frozen=True)
class Step:
    """One step of one rank, in seconds (``forward_s`` is ``None`` where backward was not observed)."""

    start: float
    step_s: float
    data_s: float
    compute_s: float
    forward_s: float | None
    exposed_s: float
    optimizer_s: float
    cpu_s: float
    system_s: float  # of cpu_s, in the kernel: mostly page faults
    faults: int  # minor page faults: memory the process touched afresh
    samples: int
    starts: int  # exchanges of px.LocalSGD/px.DiLoCo started in the step
    merges: int  # and merged in it
    exchange_bytes: int  # of the exchanges started in the step
    exchange_wait_s: float  # of exposed_s, what merging an exchange waited for
    #: Per bucket: seconds from the start of backward to its launch, bytes, seconds waited for it.
    buckets: tuple[tuple[float, int, float], ...]

    @property
    def exchanging(self) -> bool:
        """Whether an exchange started or merged in the step (it is then longer by design)."""
        return bool(self.starts or self.merges)

    @property
    def other_s(self) -> float:
        return max(self.step_s - self.data_s - self.compute_s - self.exposed_s - self.optimizer_s, 0.0)


@dataclass
class RankSteps:
    """One rank's timed steps and its gradient-norm samples ``(|G_local|², |G_global|², b_local, b_global)``."""

    rank: int
    timed: list[Step] = field(default_factory=list)
    norms: list[tuple[float, float, float, float]] = field(default_factory=list)


def split_steps(record: dict[str, Any]) -> RankSteps:
    """Cut ``record['events']`` into steps after the warm-up."""
    result = RankSteps(int(record["rank"]))
    current: list[Event] = []
    previous: Event | None = None
    count = 0
    for event in record["events"]:
        current.append(tuple(event))  # type: ignore[arg-type]
        if event[0] != "step":
            continue
        count += 1
        if previous is not None and count > record["warmup"]:
            _keep(result, previous, current)
        previous, current = tuple(event), []  # type: ignore[assignment]
    if not result.timed:
        raise ConfigurationError(
            "the doctor saw no complete training step after the warm-up: the script must train with px.fit or "
            "px.DataParallel and a torch optimizer, for more steps than --warmup plus --steps.")
    return result


def _keep(result: RankSteps, previous: Event, events: list[Event]) -> None:
    if any(e[0] == "memory" for e in events):  # counting the tensors took part of its time
        return
    norms = [e[2] for e in events if e[0] == "norms"]
    if norms:
        local, total = norms[0]["local"], norms[0]["total"]
        result.norms.append((sum(n["small"] for n in norms), sum(n["big"] for n in norms), local, total))
        return
    step = _step(previous, events)
    if step is not None:
        result.timed.append(step)


def _step(previous: Event, events: list[Event]) -> Step | None:
    """The phases of the step whose events (after ``previous``'s end) are ``events``; ``None`` without a forward."""
    first = {name: (t, fields) for name, t, fields in reversed(events)}
    if "forward" not in first or "optimizer" not in first:
        return None
    forward_t, optimizer_t, end_t = first["forward"][0], first["optimizer"][0], events[-1][1]
    backward_t = first["backward"][0] if "backward" in first else None
    waits = {int(f["bucket"]): t - f["started"] for name, t, f in events if name == "wait"}
    exposed = sum(waits.values())
    starts = [f for name, _, f in events if name == "outer_start"]
    merges = [f for name, _, f in events if name == "outer_merge"]
    outer_wait = sum(f["waited"] for f in merges)
    buckets = tuple((t - backward_t if backward_t is not None else 0.0, int(f["bytes"]), waits.get(int(f["bucket"]), 0.0))
                    for name, t, f in events if name == "launch")
    return Step(start=previous[1], step_s=end_t - previous[1],
                data_s=sum(t - f["started"] for name, t, f in events if name == "data"),
                compute_s=max(optimizer_t - forward_t - exposed, 0.0),
                forward_s=None if backward_t is None else backward_t - forward_t,
                exposed_s=exposed + outer_wait, optimizer_s=end_t - optimizer_t,
                cpu_s=events[-1][2]["cpu"] - previous[2]["cpu"],
                system_s=events[-1][2]["system"] - previous[2]["system"],
                faults=int(events[-1][2]["faults"] - previous[2]["faults"]),
                samples=int(sum(f["samples"] for name, _, f in events if name == "forward")),
                buckets=buckets, starts=len(starts), merges=len(merges),
                exchange_bytes=int(sum(f.get("bytes", 0) for f in starts)), exchange_wait_s=outer_wait)


def mean(values: list[float]) -> float:
    """The mean (0 for no values): what a throughput is made of."""
    return statistics.fmean(values) if values else 0.0
