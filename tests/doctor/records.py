"""Recorded doctor events made by hand: steps of known phases, for testing the analysis in-process."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

FORWARD, BACKWARD, OPTIMIZER, DATA = 0.010, 0.020, 0.002, 0.001
FAULT_S = 3e-6
BUCKETS = ((0.25, 1_000_000, 0.0), (1.0, 3_000_000, 0.004))  # (ready share of backward, bytes, waited)


def steps(count: int, rank: int = 0, wait_scale: float = 1.0, samples: int = 32,
          compute_scale: float = 1.0, short_last: int | None = None, faults: int = 0) -> list[list[Any]]:
    """Events of a warm-up step's end, then ``count`` steps: data, forward, backward, buckets launched
    and waited for, optimizer (the last step of ``short_last`` samples, if given, in half the compute);
    each step takes ``faults`` page faults, 3 µs of kernel time each."""
    events: list[list[Any]] = [["step", 0.0, {"cpu": 0.0, "system": 0.0, "faults": 0}]]
    t = 0.0
    for number in range(1, count + 1):
        short = short_last is not None and number == count
        events.append(["data", t + DATA, {"started": t}])
        t += DATA
        events.append(["forward", t, {"samples": short_last if short else samples}])
        t += FORWARD * compute_scale * (0.5 if short else 1.0)
        begin = t
        events.append(["backward", t, {}])
        exposed = 0.0
        for index, (share, nbytes, waited) in enumerate(BUCKETS):
            events.append(["launch", begin + share * BACKWARD * compute_scale, {"bucket": index, "bytes": nbytes}])
        t = begin + BACKWARD * compute_scale
        for index, (_, _, waited) in enumerate(BUCKETS):
            events.append(["wait", t + waited * wait_scale, {"started": t, "bucket": index}])
            t += waited * wait_scale
            exposed += waited * wait_scale
        events.append(["optimizer", t, {}])
        t += OPTIMIZER
        events.append(["step", t, {"cpu": t, "system": number * faults * FAULT_S, "faults": number * faults}])
    return events


def record(rank: int = 0, world: int = 2, local: int = 2, cores: int = 2, count: int = 6, warmup: int = 1,
           samples: int = 32, wait_scale: float = 1.0, compute_scale: float = 1.0,
           short_last: int | None = None, faults: int = 0) -> dict[str, Any]:
    """One rank's record as the session writes it."""
    figures = None
    if world > 1:
        figures = {"p2p_alpha_s": 1e-4, "p2p_beta_s_per_byte": 1e-10, "ring_alpha_s": 2e-4,
                   "ring_beta_s_per_byte": 2e-10, "engine_small_s": 1e-4, "engine_large_s": 1e-4 + (4 << 20) * 1e-9,
                   "bucket_bytes": [b[1] for b in BUCKETS], "bucket_s": [1e-4 + b[1] * 1e-9 for b in BUCKETS]}
    return {"rank": rank, "warmup": warmup, "complete": True, "world_size": world, "local_size": local, "node": 0,
            "transport": "shm" if world > 1 else "gloo", "transport_figures": figures,
            "host": {"cores": cores, "cpu_count": cores, "threads": 1, "interop_threads": 1, "hostname": "h"},
            "events": steps(count, rank, wait_scale, samples, compute_scale, short_last, faults) if world > 1
            else _without_buckets(steps(count, samples=samples, compute_scale=compute_scale, short_last=short_last,
                                        faults=faults))}


def _without_buckets(events: list[list[Any]]) -> list[list[Any]]:
    return [e for e in events if e[0] not in ("launch", "wait", "backward")]


def local_events(count: int, period: int, waited: float, nbytes: int, fragments: int = 1, delay: int = 0,
                 samples: int = 32) -> list[list[Any]]:
    """Events of a warm-up step's end, then ``count`` steps of px.DiLoCo: nothing reduced in backward;
    after each step ``t`` (the warm-up is step 1) with ``t % period == i * period // fragments`` fragment
    ``i`` starts an exchange of ``nbytes``, merged after step ``t + delay`` and waiting ``waited`` then."""
    events: list[list[Any]] = [["step", 0.0, {"cpu": 0.0, "system": 0.0, "faults": 0}]]
    t, pending = 0.0, {}
    for number in range(2, count + 2):  # the events after step number - 1's end
        for fragment, started in sorted(pending.items()):
            if number - 1 - started >= delay:
                t += waited
                events.append(["outer_merge", t, {"fragment": fragment, "step": number - 1, "waited": waited}])
                del pending[fragment]
        events.append(["data", t + DATA, {"started": t}])
        t += DATA
        events.append(["forward", t, {"samples": samples}])
        t += FORWARD + BACKWARD
        events.append(["optimizer", t, {}])
        t += OPTIMIZER
        events.append(["step", t, {"cpu": t, "system": 0.0, "faults": 0}])
        for fragment in range(fragments):
            if number % period == fragment * period // fragments:
                events.append(["outer_start", t, {"fragment": fragment, "step": number, "bytes": nbytes}])
                pending[fragment] = number
    return events


def local_record(strategy: Any, rank: int = 0, count: int = 20, waited: float = 0.1, nbytes: int = 4_000_000,
                 samples: int = 32) -> dict[str, Any]:
    """One rank of two on one host training with ``strategy`` (a px.LocalSGD or px.DiLoCo), as the session
    writes it: its note, the exchanges' events, the transport timed at the exchange's size."""
    schedule = strategy.exchanges()
    found = {**record(rank), "notes": {"strategy": {"name": strategy.name, **asdict(schedule)}},
             "events": local_events(count, schedule.period, waited, nbytes, schedule.fragments, schedule.delay,
                                    samples)}
    found["transport_figures"].update(bucket_bytes=[nbytes], bucket_s=[1e-4 + nbytes * 1e-9])
    return found
